//! Inserts that land late are counted once: an insert held up in the
//! network past a pass lands after it and is counted by the next (the log
//! orders inserts by when they commit, so nothing lands behind the fold's
//! position), and recorders whose clocks are minutes off the server's
//! count every event once.
//!
//! Requests are held up in the network by the black-pipe proxy. The
//! oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use mongodb::bson::doc;
use tally::{EventTicket, Ledger, Recording};

use super::*;
use crate::cli::{tallyd, write_config};
use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{TestContext, counter};

/// An insert held up in the network (its recorder gave up on it: unknown)
/// reaches the server after a later event was folded past it. It lands in
/// the log after the fold's position, so an exact read counts it at once,
/// its ticket sent again finds it recorded (its own lane and number:
/// nothing inserted twice), and the next pass counts it — once, however
/// many passes and folds follow.
#[tokio::test]
async fn an_insert_held_in_the_network_past_a_pass_is_counted_once_when_it_lands() {
    let ctx = TestContext::new("ledger_held_insert").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let recorder = Ledger::new(
        &ctx.client_through(&proxy, false).await.store(),
        ledger.spec().clone(),
    );
    let views = direct.collection("views");
    let events = direct.collection("views_events");
    let stored = |key: &'static str| {
        let events = events.clone();
        async move { events.count_documents(doc! { "_id": key }).await.unwrap() }
    };
    assert_outcome(&recorder.record("e0", "a", 1).await, "recorded");
    let fold = fold_of(&store, "views");
    fold_all(&fold).await;

    let ticket = record_held(&proxy, &recorder, "e1", "a", 10).await;
    assert_outcome(&recorder.record("e2", "a", 100).await, "recorded");
    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 1, "the pass folds e2 alone: {run:?}");
    assert_eq!(stored("e1").await, 0, "the held insert has not landed yet");
    assert_eq!(counter(&views, "a").await, 101);
    assert_eq!(ledger.value("a").await.unwrap().value, 101);

    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    assert_eq!(stored("e1").await, 1, "the held insert landed");
    assert_eq!(
        ledger.value("a").await.unwrap().value,
        111,
        "an exact read counts the landed event before any pass"
    );
    assert_outcome(&recorder.record_again(ticket).await.unwrap(), "recorded");
    assert_eq!(stored("e1").await, 1, "sent again, inserted once");
    assert_eq!(ledger.value("a").await.unwrap().value, 111);

    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 1, "the next pass folds e1: {run:?}");
    fold_all(&fold).await;
    fold_all(&fold_of(&store, "views")).await;
    assert_eq!(counter(&views, "a").await, 111, "counted once");
    assert_eq!(ledger.value("a").await.unwrap().value, 111);
    assert_eq!(unfolded(&fold).await, 0);
}

/// Recorder processes whose clocks run ten minutes behind and ten minutes
/// ahead of the server's, recording while the fold runs between them:
/// every event is counted once, nothing is left unfolded, and their
/// redeliveries are duplicates.
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
    // A redelivery from a clock ten minutes behind of an event a clock
    // ten minutes ahead recorded, long folded: a duplicate, counted once.
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
    let stored = ctx
        .client(false)
        .await
        .collection("views_events")
        .count_documents(doc! { "k": "home" })
        .await
        .unwrap();
    assert_eq!(stored, expected as u64, "every event stored once");
    assert_eq!(counter(&views, "home").await, expected as i64);
    assert_eq!(unfolded(&fold).await, 0, "nothing left unfolded");
    let got = tallyd(&["get", "home", "-c", &config, "--json"], &[]).await;
    let got = String::from_utf8_lossy(&got.stdout);
    assert!(got.contains(&format!("\"value\":{expected}")), "{got}");
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

/// Records `event` through `recorder` while the proxy holds its insert up
/// in the network (the first attempt) and cuts its retry: the caller is
/// told unknown, and the insert lands when the test releases it.
async fn record_held(
    proxy: &Proxy,
    recorder: &Ledger,
    event: &str,
    key: &str,
    amount: i64,
) -> EventTicket {
    let _held = [
        proxy.rule(
            Rule::command("insert")
                .collection("views_events")
                .nth(1)
                .then(Action::HoldRequest(Release::WhenReleased)),
        ),
        proxy.rule(
            Rule::command("insert")
                .collection("views_events")
                .nth(2)
                .then(Action::CloseBeforeForwarding),
        ),
    ];
    match recorder.record(event, key, amount).await {
        Recording::Unknown(ticket) => ticket,
        other => panic!("expected unknown, got {other:?}"),
    }
}
