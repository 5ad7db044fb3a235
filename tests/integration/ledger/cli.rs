//! The events ledger through the `tallyd` command line, as a user runs it:
//! `setup`, `record` (one event, from a file, from standard input), `get`,
//! `status`, `doctor`, and `check-config` on what a ledger's configuration
//! may not be.

use std::time::Duration;

use mongodb::bson::doc;
use tally::{CollectionConfig, Ledger};

use super::*;
use crate::cli::{json, tallyd, text, write_config};
use crate::common::TestContext;
use crate::ledger::{config, ledger_on};

#[tokio::test]
async fn setup_record_get_and_status_from_the_command_line() {
    let ctx = TestContext::new("ledger_cli").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx, ""));
    let run = |args: Vec<&str>| {
        let mut all = vec!["--config", path.as_str()];
        all.extend(args);
        let owned: Vec<String> = all.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            tallyd(&args, &[]).await
        }
    };
    let status = run(vec!["status", "--json"]).await;
    let missing = &json(&status)["ledgers"][0]["missing_indexes"];
    assert_eq!(
        missing.as_array().map(Vec::len),
        Some(1),
        "{}",
        text(&status)
    );

    // check-config --connect and doctor say what is missing, and fail.
    let checked = run(vec!["check-config", "--connect"]).await;
    assert_eq!(checked.status.code(), Some(1), "{}", text(&checked));
    let said = text(&checked);
    assert!(
        said.contains("fail  ledger_indexes (views_events): missing tally_events_number")
            && said.contains("run `tallyd setup`"),
        "{said}"
    );
    let plain = run(vec!["check-config"]).await;
    assert_eq!(
        plain.status.code(),
        Some(0),
        "no connection without --connect"
    );
    let doctor = run(vec!["doctor", "--json"]).await;
    assert_eq!(doctor.status.code(), Some(1), "{}", text(&doctor));
    let ledger_check = json(&doctor)["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ledger_indexes")
        .cloned()
        .unwrap_or_else(|| panic!("no ledger check: {}", text(&doctor)));
    assert_eq!(ledger_check["verdict"], "fail", "{ledger_check}");
    assert_eq!(ledger_check["collection"], "views_events");

    let setup = run(vec!["setup"]).await;
    assert_eq!(setup.status.code(), Some(0), "{}", text(&setup));
    let checked = run(vec!["check-config", "--connect"]).await;
    assert_eq!(checked.status.code(), Some(0), "{}", text(&checked));
    assert!(
        text(&checked).contains("ok    ledger_indexes (views_events)"),
        "{}",
        text(&checked)
    );
    let doctor = run(vec!["doctor", "--json"]).await;
    let fine = json(&doctor)["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == "ledger_indexes" && c["verdict"] == "ok");
    assert!(fine, "{}", text(&doctor));
    let said = text(&setup);
    assert!(
        said.contains("tally_events_number") && said.contains("created"),
        "{said}"
    );
    let again = run(vec!["setup"]).await;
    assert!(
        !text(&again).contains("created"),
        "idempotent: {}",
        text(&again)
    );

    let recorded = run(vec!["record", "evt_1", "home", "--by", "3", "--json"]).await;
    assert_eq!(recorded.status.code(), Some(0), "{}", text(&recorded));
    let shown = json(&recorded);
    assert_eq!(shown["outcome"], "recorded");
    assert_eq!(shown["event"], "evt_1");
    assert_eq!(shown["key"], "home");
    assert_eq!(shown["amount"], 3);
    let duplicate = run(vec!["record", "evt_1", "home", "--by", "3", "--json"]).await;
    assert_eq!(duplicate.status.code(), Some(0));
    assert_eq!(json(&duplicate)["outcome"], "duplicate");
    let conflict = run(vec!["record", "evt_1", "home", "--json"]).await;
    assert_eq!(conflict.status.code(), Some(1));
    assert_eq!(json(&conflict)["outcome"], "conflict");
    // A zero amount is a usage error, before anything connects.
    let zero = run(vec!["record", "evt_2", "home", "--by", "0", "--json"]).await;
    assert_eq!(zero.status.code(), Some(64), "{}", text(&zero));

    let got = run(vec!["get", "home", "--json"]).await;
    assert_eq!(got.status.code(), Some(0), "{}", text(&got));
    let got = json(&got);
    assert_eq!(
        (&got["key"], &got["value"], &got["folded"], &got["unfolded"]),
        (&"home".into(), &3.into(), &0.into(), &3.into())
    );
    let status = json(&run(vec!["status", "--json"]).await);
    assert_eq!(status["ledgers"][0]["unfolded_events"], 1);
    assert_eq!(
        status["ledgers"][0]["missing_indexes"],
        serde_json::json!([])
    );

    let reconciled = run(vec!["reconcile", "--json"]).await;
    assert_eq!(reconciled.status.code(), Some(0), "{}", text(&reconciled));
    assert!(
        text(&reconciled).contains("\"events_folded\":1"),
        "{}",
        text(&reconciled)
    );
    let got = json(&run(vec!["get", "home", "--json"]).await);
    assert_eq!((&got["value"], &got["folded"]), (&3.into(), &3.into()));
}

/// `record --from`: newline-delimited JSON events, each line its outcome
/// (one JSON line each with `--json`), a malformed line reported with its
/// number and recording nothing while the others go; exit 0 only when
/// every event is recorded or a duplicate.
#[tokio::test]
async fn record_from_a_file_gives_every_line_its_outcome() {
    let ctx = TestContext::new("ledger_record_from").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx, ""));
    let client = ctx.client(false).await;
    Ledger::new(&client.store(), CollectionConfig::new("views"))
        .create_indexes()
        .await
        .unwrap();
    let file = dir.path().join("events.ndjson");
    std::fs::write(
        &file,
        "{\"event\": \"e1\", \"key\": \"home\", \"by\": 2}\n\
         {\"event\": \"e2\", \"key\": \"home\"}\n\
         \n\
         not json\n\
         {\"event\": \"e3\", \"key\": {\"page\": \"a\", \"day\": 7}}\n\
         {\"event\": \"e1\", \"key\": \"home\", \"by\": 2}\n\
         {\"event\": \"e1\", \"key\": \"about\"}\n\
         {\"event\": \"e4\", \"key\": \"home\", \"by\": 1.5}\n",
    )
    .unwrap();
    let file = file.display().to_string();
    let output = tallyd(
        &["--config", &path, "record", "--from", &file, "--json"],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let outcomes: Vec<(u64, &str)> = lines
        .iter()
        .map(|l| (l["line"].as_u64().unwrap(), l["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (1, "recorded"),
            (2, "recorded"),
            (4, "malformed"),
            (5, "recorded"),
            (6, "duplicate"),
            (7, "conflict"),
            (8, "malformed"),
        ]
    );
    assert!(
        lines[2]["error"].as_str().unwrap().contains("JSON"),
        "{}",
        lines[2]
    );
    // Only the well-formed events are stored, and counted once.
    let events = client.collection("views_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 3);
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    assert_eq!(ledger.value("home").await.unwrap().value, 3);
    // Standard input, text: every event seen before, a summary, exit 0.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(["--config", &path, "record", "--from", "-"])
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"{\"event\": \"e1\", \"key\": \"home\", \"by\": 2}\n{\"event\": \"e2\", \"key\": \"home\"}\n")
            .await
            .unwrap();
    }
    let output = child.wait_with_output().await.unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert!(
        text(&output).contains("0 recorded, 2 duplicates"),
        "{}",
        text(&output)
    );
}

/// Events recorded into a collection whose ledger the configuration does
/// not turn on are in no counter: `doctor` fails its `unfolded_events`
/// check, naming the events collection and what to do; with the ledger on,
/// the check is gone (the ledger's own checks cover it).
#[tokio::test]
async fn doctor_flags_events_no_configured_ledger_folds() {
    let ctx = TestContext::new("ledger_doctor_unfolded").await;
    let client = ctx.client(false).await;
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    ledger.create_indexes().await.unwrap();
    assert!(ledger.record("e1", "home", 1).await.is_counted());
    let dir = tempfile::tempdir().unwrap();
    let without = ctx.config_toml(false, "[[collections]]\nname = \"views\"\n");
    let path = write_config(dir.path(), &without);
    let doctor = tallyd(&["--config", &path, "doctor", "--json"], &[]).await;
    assert_eq!(doctor.status.code(), Some(1), "{}", text(&doctor));
    let checks = json(&doctor)["checks"].as_array().unwrap().clone();
    let unfolded = checks
        .iter()
        .find(|c| c["name"] == "unfolded_events")
        .unwrap_or_else(|| panic!("no unfolded_events check: {checks:?}"));
    assert_eq!(unfolded["verdict"], "fail", "{unfolded}");
    assert_eq!(unfolded["collection"], "views_events");
    let message = unfolded["message"].as_str().unwrap();
    assert!(
        message.contains("1 recorded events") && message.contains("ledger = true"),
        "{message}"
    );
    let path = write_config(dir.path(), &config(&ctx, ""));
    let doctor = tallyd(&["--config", &path, "doctor", "--json"], &[]).await;
    let checks = json(&doctor)["checks"].as_array().unwrap().clone();
    assert!(
        !checks.iter().any(|c| c["name"] == "unfolded_events"),
        "{checks:?}"
    );
}

/// Finding 1: an events collection shared by two ledgers counted one
/// ledger's events on the other's counters; one equal to a counter
/// collection made the fold claim and mark counter documents (and `setup`
/// put a TTL index on them). Both, and an events collection equal to the
/// daemon's state collection or to another ledger's fold state, are
/// configuration errors.
#[tokio::test]
async fn an_events_collection_shared_with_another_ledger_or_a_counter_collection_is_refused() {
    let ctx = TestContext::new("ledger_finding_names").await;
    let cases = [
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"log\"\n[[collections]]\nname = \
             \"b\"\nevents_collection = \"log\"\n",
            "collections[1].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"b\"\n[[collections]]\nname = \
             \"b\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"a\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"tally_state\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nledger = true\n[[collections]]\nname = \
             \"b\"\nevents_collection = \"a_events_fold\"\n",
            "collections[1].events_collection",
        ),
    ];
    for (body, key) in cases {
        let (code, shown) = check_config(&ctx, body).await;
        assert_eq!(code, Some(78), "{body}\n{shown}");
        assert!(shown.contains(&format!("  {key}: ")), "{body}\n{shown}");
    }
}

/// Finding 6: `tallyd record` into a collection with no ledger configured
/// said "recorded: it will be counted once", and nothing ever folded it.
/// `record` and `get` on such a collection are configuration errors.
#[tokio::test]
async fn record_and_get_on_a_collection_without_a_ledger_exit_78() {
    let ctx = TestContext::new("ledger_finding_no_ledger").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        &ctx.config_toml(false, "[[collections]]\nname = \"views\"\n"),
    );
    for args in [
        vec!["record", "e1", "home", "--collection", "views"],
        vec!["get", "home", "--collection", "views"],
    ] {
        let mut all = vec!["--config", path.as_str()];
        all.extend(args.iter().copied());
        let output = tallyd(&all, &[]).await;
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {shown}");
        assert!(shown.contains("ledger"), "{args:?}: {shown}");
    }
    let client = ctx.client(false).await;
    assert_eq!(
        client
            .collection("views_events")
            .count_documents(doc! {})
            .await
            .unwrap(),
        0,
        "nothing was recorded"
    );
}

/// Finding 7: `event_retention` had no floor (`"1s"` was accepted): an
/// insert whose reply was lost, folded and expired within the window, was
/// inserted again by its retry and counted twice.
#[tokio::test]
async fn an_event_retention_below_the_retry_horizon_and_an_attempt_exits_78_naming_the_keys() {
    let ctx = TestContext::new("ledger_finding_retention").await;
    let (code, shown) = check_config(
        &ctx,
        "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nevent_retention = \"1s\"\n",
    )
    .await;
    assert_eq!(code, Some(78), "{shown}");
    for key in [
        "reconcile.event_retention",
        "writer.retry_horizon",
        "mongodb.attempt_timeout",
    ] {
        assert!(shown.contains(key), "{key} not named:\n{shown}");
    }
}

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
    let path = write_config(dir.path(), &crate::ledger::config(&ctx, ""));
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
    // Their outcomes are printed as they settle, the input still open.
    let printed = {
        use tokio::io::AsyncBufReadExt;
        let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut printed = Vec::new();
        while printed.len() < 2 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match tokio::time::timeout(left, stdout.next_line()).await {
                Ok(Ok(Some(line))) => printed.push(line),
                _ => break,
            }
        }
        printed
    };
    drop(stdin);
    let output = child.wait_with_output().await.unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(
        recorded, 2,
        "15 s after two lines were read, {recorded} of them were recorded (they wait for 998 \
         more lines or the end of the input)"
    );
    assert!(
        printed.len() == 2 && printed.iter().all(|l| l.contains("\"recorded\"")),
        "the outcomes are printed before the input ends: {printed:?}"
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

/// `check-config` on `collections` (TOML tables) plus `extra`: its exit
/// code and everything it printed.
async fn check_config(ctx: &TestContext, body: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, body));
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    (output.status.code(), text(&output))
}
