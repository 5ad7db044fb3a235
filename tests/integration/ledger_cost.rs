//! What the ledger costs follows the work, not the recorders: one-shot
//! recorders (a handle, or a `tallyd record` process, per event) cost the
//! fold and the exact reads what one long-lived recorder costs; recorders
//! whose clocks run minutes off the server's count every event once; a
//! fold state tally 0.2.0 filled to the document limit is converted, and
//! the fold goes on by itself.

use mongodb::bson::{Document, doc, oid::ObjectId};
use tally::{Ledger, Reconciler};
use tokio_util::sync::CancellationToken;

use crate::cli::{tallyd, write_config};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, documents, fold_all, fold_of, ledger_on, unfolded};

/// How many one-shot recorders the cost test runs after its first 50
/// (`TALLY_ONE_SHOT_RECORDERS`; 2,000 by default).
fn one_shot_recorders() -> usize {
    std::env::var("TALLY_ONE_SHOT_RECORDERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000)
}

/// What an idle pass and an exact read cost: the fold state's size, and
/// the commands each sends.
#[derive(Debug, PartialEq)]
struct Cost {
    state_bytes: usize,
    idle_pass_commands: usize,
    read_commands: usize,
}

async fn cost(ctx: &TestContext, key: &str) -> Cost {
    let client = ctx.client(false).await;
    let store = client.store();
    let fold = fold_of(&store, "views");
    let ledger = Ledger::new(&store, ledger_on(&store, "views").await.spec().clone());
    let state = documents(&store, "views_events_fold").await;
    let state_bytes = state
        .iter()
        .map(|d| d.to_vec().unwrap().len())
        .sum::<usize>();
    assert_eq!(state.len(), 1, "the state is one document: {state:?}");
    // The read with events not folded yet, then the pass that folds them,
    // then an idle pass.
    client.events.clear();
    ledger.value(key).await.unwrap();
    let read_commands = client.events.sent().len();
    fold_all(&fold).await;
    let now = Reconciler::new(&store).server_time().await.unwrap();
    client.events.clear();
    let run = fold.fold(now, &CancellationToken::new()).await.unwrap();
    assert_eq!(run.events_folded, 0, "idle: {run:?}");
    let idle_pass_commands = client.events.sent().len();
    Cost {
        state_bytes,
        idle_pass_commands,
        read_commands,
    }
}

/// One `Ledger` per event, as a handler per request or one `tallyd record`
/// per event makes: after 50 such recorders and after 2,000 more, the fold
/// state is the same size, an idle pass and an exact read send the same
/// commands, and every event is counted once.
#[tokio::test]
async fn one_shot_recorders_cost_the_fold_and_the_reads_what_one_recorder_costs() {
    let ctx = TestContext::new("ledger_one_shot").await;
    let store = ctx.client(false).await.store();
    let spec = ledger_on(&store, "views").await.spec().clone();
    let fold = fold_of(&store, "views");
    let record_one_shot = |range: std::ops::Range<usize>| {
        let store = store.clone();
        let spec = spec.clone();
        async move {
            for i in range {
                let once = Ledger::new(&store, spec.clone());
                let key = if i % 2 == 0 { "home" } else { "about" };
                assert_outcome(&once.record(format!("e{i}"), key, 1).await, "recorded");
            }
        }
    };
    record_one_shot(0..50).await;
    fold_all(&fold).await;
    // A pass between two events keeps both its cost and the reads'
    // reckoning honest: the last events are not folded yet.
    record_one_shot(50..52).await;
    let after_50 = cost(&ctx, "home").await;

    let many = one_shot_recorders();
    let chunk = many.div_ceil(4);
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let from = 52 + w * chunk;
            tokio::spawn(record_one_shot(from..(from + chunk).min(52 + many)))
        })
        .collect();
    for (i, writer) in writers.into_iter().enumerate() {
        writer.await.unwrap();
        if i % 2 == 1 {
            fold_all(&fold).await;
        }
    }
    fold_all(&fold).await;
    record_one_shot(52 + many..54 + many).await;
    let after_many = cost(&ctx, "home").await;
    assert_eq!(
        after_many, after_50,
        "the ledger's cost grew with the number of recorder processes"
    );

    fold_all(&fold).await;
    let total = 54 + many;
    let views = ctx.client(false).await.collection("views");
    assert_eq!(counter(&views, "home").await, total.div_ceil(2) as i64);
    assert_eq!(counter(&views, "about").await, (total / 2) as i64);
    assert_eq!(unfolded(&fold).await, 0);
}

/// `faketime`'s program, when installed (scripts/install-test-server
/// installs it where it can; CI always has it).
fn faketime() -> Option<&'static str> {
    let found = std::process::Command::new("faketime")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && std::env::var_os("CI").is_some() {
        panic!("faketime is not installed: scripts/install-test-server installs it");
    }
    found.then_some("faketime")
}

/// Runs `tallyd record` for each event as its own process under a clock
/// `offset` off (`-10m`, `+10m`, as faketime reads it; monotonic clocks
/// stay real), and returns how many said recorded.
async fn record_skewed(config: &str, offset: &str, events: std::ops::Range<usize>) -> usize {
    let mut recorded = 0;
    let name = if offset.starts_with('-') {
        "behind"
    } else {
        "ahead"
    };
    for i in events {
        let event = format!("{name}-e{i}");
        let output = tokio::process::Command::new("faketime")
            .args(["-f", offset, env!("CARGO_BIN_EXE_tallyd")])
            .args(["record", &event, "home", "-c", config, "--json"])
            .env_clear()
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .output()
            .await
            .expect("run tallyd under faketime");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("\"recorded\""),
            "tallyd record under a clock {offset}: {stdout} {}",
            String::from_utf8_lossy(&output.stderr)
        );
        recorded += 1;
    }
    recorded
}

/// Recorder processes whose clocks run ten minutes behind and ten minutes
/// ahead of the server's, recording while the fold runs between them:
/// every event is counted once, none is left below the watermark, and
/// their redeliveries are duplicates.
#[tokio::test]
async fn recorders_with_clocks_ten_minutes_off_count_every_event_once() {
    let Some(_) = faketime() else {
        eprintln!("skipped: faketime is not installed");
        return;
    };
    let ctx = TestContext::new("ledger_skewed_clocks").await;
    let store = ctx.client(false).await.store();
    ledger_on(&store, "views").await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &ctx.config_toml(false, "[[collections]]\nname = \"views\"\nledger = true\n"),
    );
    let fold = fold_of(&store, "views");
    let mut expected = 0;
    for round in 0..3 {
        let from = round * 4;
        expected += record_skewed(&config, "-10m", from..from + 4).await;
        fold_all(&fold).await;
        expected += record_skewed(&config, "+10m", from..from + 4).await;
        fold_all(&fold).await;
    }
    // A redelivery from a clock ten minutes behind, after the fold passed
    // its first number: a duplicate, counted once.
    let output = tokio::process::Command::new("faketime")
        .args(["-f", "-10m", env!("CARGO_BIN_EXE_tallyd")])
        .args(["record", "ahead-e0", "home", "-c", &config, "--json"])
        .env_clear()
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("\"duplicate\""), "{stdout}");
    fold_all(&fold).await;
    let views = ctx.client(false).await.collection("views");
    assert_eq!(counter(&views, "home").await, expected as i64);
    assert_eq!(
        unfolded(&fold).await,
        0,
        "nothing stranded below the watermark"
    );
    let got = tallyd(&["get", "home", "-c", &config, "--json"], &[]).await;
    let got = String::from_utf8_lossy(&got.stdout);
    assert!(got.contains(&format!("\"value\":{expected}")), "{got}");
}

/// The fold state tally 0.2.0 kept grew by a lane per recorder until the
/// document limit refused every pass. Such a state — crafted here at 16 MB,
/// every event folded — is converted by the first pass (its lane map goes),
/// and the fold goes on by itself: new events are folded, nothing twice.
#[tokio::test]
async fn a_state_of_tally_0_2_0_at_the_document_limit_is_converted_and_the_fold_goes_on() {
    let ctx = TestContext::new("ledger_legacy_state").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    // Events 0.2.0 recorded an hour ago (numbered by its recorder's clock,
    // in microseconds): three on one lane folded, a fourth not yet.
    let hour_ago = old_number(3600);
    let lane = ObjectId::new();
    let events: Vec<Document> = (1..=4i64)
        .map(|s| {
            doc! { "_id": format!("old{s}"), "k": "home", "n": 1i64, "at": mongodb::bson::DateTime::now(), "L": lane, "s": hour_ago + s }
        })
        .collect();
    client
        .collection("views_events")
        .insert_many(events)
        .await
        .unwrap();
    client
        .collection("views")
        .insert_one(doc! { "_id": "home", "counter": 3i64 })
        .await
        .unwrap();
    // Its state: that lane folded to 3, and 470,000 lanes of one-shot
    // recorders whose events were deleted — 16 MB.
    let mut folded = Document::new();
    folded.insert(lane.to_hex(), hour_ago + 3);
    for _ in 0..470_000 {
        folded.insert(ObjectId::new().to_hex(), 1i64);
    }
    let state = doc! { "_id": "state", "pass": 7i64, "v": 14i64, "folded": folded };
    let bytes = state.to_vec().unwrap().len();
    assert!(bytes > 15 * 1024 * 1024, "{bytes}");
    client
        .collection("views_events_fold")
        .insert_one(state)
        .await
        .unwrap();
    assert!(
        ledger.value("home").await.is_err(),
        "an exact read refuses an unconverted state rather than count twice"
    );

    assert_outcome(&ledger.record("new1", "home", 10).await, "recorded");
    let fold = fold_of(&store, "views");
    let run = fold_all(&fold).await;
    assert_eq!(
        run.events_folded, 2,
        "the old unfolded event and the new one: {run:?}"
    );
    let state = documents(&store, "views_events_fold").await;
    assert_eq!(state.len(), 1);
    assert!(
        state[0].to_vec().unwrap().len() < 1024,
        "the converted state is small: {:?}",
        state[0]
    );
    assert_eq!(counter(&client.collection("views"), "home").await, 14);
    assert_eq!(ledger.value("home").await.unwrap().value, 14);
    assert_outcome(&ledger.record("old2", "home", 1).await, "duplicate");
    assert_outcome(&ledger.record("new2", "home", 5).await, "recorded");
    fold_all(&fold).await;
    assert_eq!(counter(&client.collection("views"), "home").await, 19);
    assert_eq!(unfolded(&fold).await, 0);
}

/// A number tally 0.2.0 gave an event `seconds` ago (microseconds by its
/// recorder's clock).
fn old_number(seconds: u64) -> i64 {
    let then = std::time::SystemTime::now() - std::time::Duration::from_secs(seconds);
    let micros = then
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    i64::try_from(micros).unwrap()
}

/// A state of tally 0.2.0 that left an event unfolded *below* one it folded
/// (its recorders' clocks disagreed) cannot be told by a watermark: it is
/// refused, naming what to run, and nothing is written.
#[tokio::test]
async fn a_state_of_tally_0_2_0_whose_unfolded_events_interleave_is_refused_naming_what_to_run() {
    let ctx = TestContext::new("ledger_legacy_unfolded").await;
    let client = ctx.client(false).await;
    let store = client.store();
    ledger_on(&store, "views").await;
    let base = old_number(3600);
    let (folded_lane, other_lane) = (ObjectId::new(), ObjectId::new());
    let events = [
        doc! { "_id": "old1", "k": "home", "n": 1i64, "L": folded_lane, "s": base + 10 },
        doc! { "_id": "old2", "k": "home", "n": 1i64, "L": other_lane, "s": base + 5 },
    ];
    client
        .collection("views_events")
        .insert_many(events)
        .await
        .unwrap();
    let state = doc! { "_id": "state", "pass": 1i64, "v": 2i64, "folded": { folded_lane.to_hex(): base + 10 } };
    client
        .collection("views_events_fold")
        .insert_one(state.clone())
        .await
        .unwrap();
    let fold = fold_of(&store, "views");
    let refused = fold
        .fold(
            Reconciler::new(&store).server_time().await.unwrap(),
            &CancellationToken::new(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("0.2.0") && refused.contains("tallyd reconcile"),
        "{refused}"
    );
    assert_eq!(documents(&store, "views_events_fold").await, vec![state]);
    assert_eq!(counter(&client.collection("views"), "home").await, 0);
}
