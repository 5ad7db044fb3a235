//! The command line's part of the review of the ledger: what `tallyd
//! check-config` says, and what `tallyd record --from` does with a stream.

use std::time::Duration;

use mongodb::bson::doc;

use crate::cli::{tallyd, text, write_config};
use crate::common::TestContext;
use crate::ledger::ledger_on;

/// Finding 10 (a queue's events held unrecorded in the pipe). `tallyd
/// record --from -` is offered "for backfills from logs and queues", but
/// it sends nothing until it has read 1,000 lines or the end of its input.
/// Fed by a queue consumer (`consumer | tallyd record --from - --json`),
/// the events of a quiet hour wait in the process, unrecorded and without
/// an outcome, for as long as the queue is quiet: the consumer has taken
/// them off the queue, and a restart of the pipeline loses them. A line
/// read must be recorded (and its outcome printed) within a bounded time.
#[tokio::test]
async fn record_from_standard_input_records_each_line_without_waiting_for_a_thousand() {
    let ctx = TestContext::new("review_ledger_record_from_stream").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &crate::ledger_daemon::config(&ctx, ""));
    let client = ctx.client(false).await;
    ledger_on(&client.store(), "views").await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(["--config", &path, "record", "--from", "-", "--json"])
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    {
        use tokio::io::AsyncWriteExt;
        stdin
            .write_all(
                b"{\"event\": \"q1\", \"key\": \"home\"}\n{\"event\": \"q2\", \"key\": \"home\"}\n",
            )
            .await
            .unwrap();
        stdin.flush().await.unwrap();
    }
    let events = client.collection("views_events");
    let mut recorded = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while std::time::Instant::now() < deadline {
        recorded = events.count_documents(doc! {}).await.unwrap();
        if recorded == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(
        recorded, 2,
        "15 s after two lines were read, {recorded} of them were recorded (they wait for 998 \
         more lines or the end of the input)"
    );
}

/// Finding 13 (a message people read). `check-config` refusing an events
/// collection prints a run of 26 spaces in the middle of its sentence (a
/// string continued onto the next source line without its `\`).
#[tokio::test]
async fn check_config_says_an_events_collection_clash_in_one_clean_sentence() {
    let ctx = TestContext::new("review_ledger_clash_message").await;
    let dir = tempfile::tempdir().unwrap();
    let body = "[[collections]]\nname = \"a\"\nevents_collection = \"log\"\n[[collections]]\nname \
                = \"b\"\nevents_collection = \"log\"\n";
    let path = write_config(dir.path(), &ctx.config_toml(false, body));
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    let line = shown
        .lines()
        .find(|l| l.contains("collections[1].events_collection"))
        .unwrap_or_else(|| panic!("the clash is named: {shown}"));
    assert!(
        !line.contains("   "),
        "a run of spaces inside the message: {line:?}"
    );
}
