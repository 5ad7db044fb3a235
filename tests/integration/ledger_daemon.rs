//! The events ledger through the `tallyd` binary: `setup`, `record`, `get`
//! and `status` as a user runs them, the daemon's continuous fold (within
//! `fold_delay` of new events, with no schedule and no scan to help), its
//! refusal to fold a ledger without indexes. The soak, with the daemon
//! killed with -9 again and again, is in `ledger_soak`.

use std::time::{Duration, Instant};

use mongodb::bson::doc;
use tally::{CollectionConfig, Ledger};

use crate::cli::{json, tallyd, text, write_config};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, counter, wait_until};

/// A config with the ledger of `views` on, no fold on the schedule and no
/// periodic scan within the test's time: only the change stream folds.
pub(crate) fn config(ctx: &TestContext, extra: &str) -> String {
    ctx.config_toml(
        false,
        &format!(
            "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nfold_delay = \
             \"200ms\"\n[schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n[monitor]\n\
             scan_interval = \"1h\"\n{extra}"
        ),
    )
}

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
        Some(2),
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

/// No schedule and no scan: the change stream alone brings new events into
/// their counters, within seconds.
#[tokio::test]
async fn the_daemon_folds_new_events_within_seconds() {
    let ctx = TestContext::new("ledger_continuous").await;
    let client = ctx.client(false).await;
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    ledger.create_indexes().await.unwrap();
    let daemon = Tallyd::start(&config(&ctx, ""), &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    let views = client.collection("views");
    for round in 1..=3i64 {
        let started = Instant::now();
        let events: Vec<(String, &str, i64)> = (0..20)
            .map(|i| (format!("r{round}e{i}"), "home", 1))
            .collect();
        assert!(
            ledger
                .record_many(events)
                .await
                .iter()
                .all(|r| r.is_counted())
        );
        wait_until(
            "the counter has every event",
            Duration::from_secs(10),
            || async { counter(&views, "home").await == 20 * round },
        )
        .await;
        eprintln!("round {round}: folded in {:?}", started.elapsed());
    }
    daemon
        .wait_metric(
            "tally_events_folded_total{collection=\"views\"}",
            60.0,
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(ledger.value("home").await.unwrap().value, 60);
}

#[tokio::test]
async fn the_daemon_refuses_a_ledger_without_indexes_and_alerts() {
    let ctx = TestContext::new("ledger_daemon_no_indexes").await;
    let client = ctx.client(false).await;
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    assert!(ledger.record("e1", "home", 1).await.is_counted());
    let daemon = Tallyd::start(&config(&ctx, ""), &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    daemon
        .wait_metric(
            "tally_alerts_firing{collection=\"views\",kind=\"events_stuck\"}",
            1.0,
            Duration::from_secs(15),
        )
        .await;
    assert!(daemon.log().contains("tallyd setup"), "{}", daemon.log());
    assert_eq!(counter(&client.collection("views"), "home").await, 0);
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
