//! A fold whose position is no longer in the oplog: it stops — never
//! guesses — and says so (the pass's error, the state, the daemon's
//! metric and alert, exact reads refused), until `tallyd fold-from [TIME]`
//! folds again from a time the operator chooses, naming the events
//! recorded near the stop whose count it cannot be sure of. And
//! `fold-from` refuses a fold that is not stopped.
//!
//! The server's oplog is made small (`ServerOptions::oplog_max_entries`)
//! so that a few hundred writes push the fold's position out of it. The
//! oracle is the events collection and the stored documents.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};
use tally::{Error, Store};

use super::*;
use crate::cli::{json, tallyd, text, write_config};
use crate::common::server::{ServerOptions, TestServer};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, base_uri, counter, external, wait_until};

/// The test server's oplog: far fewer entries than the writes made while
/// the fold stands still.
const OPLOG: u64 = 400;
/// Events recorded while the fold stands still (and as many writes to
/// another collection).
const WHILE_STOPPED: usize = 600;
/// The counters.
const KEYS: [&str; 3] = ["a", "b", "c"];

/// A ledger whose fold stopped, and what it is made of.
struct Stopped {
    /// The server with the small oplog.
    _server: TestServer,
    ctx: TestContext,
    store: Store,
    /// The events folded before the stop, recorded (by their numbers)
    /// within the command's uncertainty before it: each named by
    /// `fold-from`.
    near: BTreeSet<String>,
    /// The server's clock once the pass before the stop had folded.
    folded_at: std::time::SystemTime,
    /// Every event folded before the stop.
    folded: BTreeSet<String>,
}

/// How the fold stands still while the oplog moves past its position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StandsStill {
    /// Stopped (a daemon down): the next pass opens the stream anew.
    Stopped,
    /// Alive but not folding (a daemon paused, cut off from the server):
    /// its next pass reads on from the stream it kept open.
    KeepingItsStream,
}

/// A server with a small oplog; a ledger folded once: three events a
/// recorder numbered ten minutes ago and two it numbered a minute ago
/// (the near ones); then, the fold standing still, 600 events and 600
/// writes to another collection, far more than the oplog holds.
async fn stopped_ledger(name: &str, stands_still: StandsStill) -> Stopped {
    let server = TestServer::start(&ServerOptions {
        oplog_max_entries: Some(OPLOG),
        ..ServerOptions::default()
    });
    let ctx = TestContext::on(name, server.uri()).await;
    let store = ctx.client(false).await.store();
    let ledger = ledger_on(&store, "views").await;
    let now = server_now(&store).await;
    let minutes_ago = |m: u64| number_of(now - Duration::from_secs(60 * m));
    let events = store.collection("views_events");
    events
        .insert_many([
            event_by_hand("old0", "a", 1, minutes_ago(10)),
            event_by_hand("old1", "b", 1, minutes_ago(10) + 1),
            event_by_hand("old2", "c", 1, minutes_ago(10) + 2),
            event_by_hand("near0", "a", 1, minutes_ago(1)),
            event_by_hand("near1", "b", 1, minutes_ago(1) + 1),
        ])
        .await
        .unwrap();
    // The fold folds them, then stands still: a daemon stopped (its
    // stream closed with it), or one whose stream is kept open.
    let fold = fold_of(&store, "views");
    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 5, "{run:?}");
    let kept = match stands_still {
        StandsStill::Stopped => {
            drop(fold);
            None
        }
        StandsStill::KeepingItsStream => Some(fold),
    };
    let folded_at = server_now(&store).await;
    // The events recorded while the fold stands still are numbered after
    // a whole second past `folded_at`.
    let resumed_after = folded_at + Duration::from_secs(1);
    wait_until(
        "the server's clock passes the resume time",
        Duration::from_secs(5),
        || async { server_now(&store).await > resumed_after + Duration::from_millis(10) },
    )
    .await;
    for batch in 0..WHILE_STOPPED / 100 {
        let recorded = (0..100).map(|i| {
            let n = batch * 100 + i;
            (format!("s{n}"), KEYS[n % KEYS.len()].to_owned(), 1)
        });
        for recording in ledger.record_many(recorded.collect::<Vec<_>>()).await {
            assert_outcome(&recording, "recorded");
        }
        let other: Vec<Document> = (0..100)
            .map(|i| doc! { "i": (batch * 100 + i) as i64 })
            .collect();
        store.collection("other").insert_many(other).await.unwrap();
    }
    // The pass after: its position is gone from the oplog.
    let fold = kept.unwrap_or_else(|| fold_of(&store, "views"));
    let pass = fold
        .fold(server_now(&store).await, &Default::default())
        .await;
    if !matches!(
        pass,
        Err(Error::HistoryLost { .. } | Error::FoldStopped { .. })
    ) {
        let (counters, events) = counters_and_events(&store).await;
        panic!(
            "{stands_still:?}: the pass after the oplog lost the fold's position: {pass:?}; \
             the counters {counters:?}, the events stored {events:?}"
        );
    }
    let state = fold_state(&store).await;
    assert!(
        state.contains_key("stopped"),
        "the state says stopped: {state:?}"
    );
    Stopped {
        _server: server,
        ctx,
        store,
        near: ["near0", "near1"].map(str::to_owned).into(),
        folded_at,
        folded: ["old0", "old1", "old2", "near0", "near1"]
            .map(str::to_owned)
            .into(),
    }
}

/// The fold state document.
async fn fold_state(store: &Store) -> Document {
    store
        .collection("views_events_fold")
        .find_one(doc! { "_id": "state" })
        .await
        .unwrap()
        .expect("a fold state")
}

/// Each counter, and each key's distinct events in the collection.
async fn counters_and_events(
    store: &Store,
) -> (BTreeMap<&'static str, i64>, BTreeMap<&'static str, i64>) {
    let (mut counters, mut events) = (BTreeMap::new(), BTreeMap::new());
    for key in KEYS {
        counters.insert(key, counter(&store.collection("views"), key).await);
        let stored = store
            .collection("views_events")
            .count_documents(doc! { "k": key })
            .await
            .unwrap();
        events.insert(key, stored as i64);
    }
    (counters, events)
}

/// The daemon's configuration: a pass every second (a stopped fold has no
/// change stream to wake it).
fn daemon_config(ctx: &TestContext) -> String {
    config(ctx, "").replace("scan_interval = \"1h\"", "scan_interval = \"1s\"")
}

/// The lost-history proof: the fold stops at a position the
/// oplog no longer holds (the pass fails with the history-lost error, the
/// state says stopped), exact reads are refused, the daemon exports
/// `tally_events_fold_stopped` 1 and fires `events_fold_stopped`; `tallyd
/// fold-from` (its default TIME: where the fold stopped) names the events
/// recorded near the stop and exits 0; then every counter equals its
/// distinct events, exact reads answer again, and the daemon's metric and
/// alert clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_whose_position_left_the_oplog_stops_alerts_and_fold_from_brings_the_counts_back() {
    if external() {
        return; // needs a server with a small oplog
    }
    let stopped = stopped_ledger("ledger_lost_log", StandsStill::Stopped).await;
    let (ctx, store) = (&stopped.ctx, &stopped.store);
    let ledger = tally::Ledger::new(store, tally::CollectionConfig::new("views"));
    let read = ledger.value("a").await;
    assert!(
        matches!(read, Err(Error::FoldStopped { .. })),
        "an exact read of a stopped fold is refused: {read:?}"
    );
    let daemon = Tallyd::start(&daemon_config(ctx), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;
    let stopped_series = "tally_events_fold_stopped{collection=\"views\"}";
    let alert = "tally_alerts_firing{collection=\"views\",kind=\"events_fold_stopped\"}";
    daemon
        .wait_metric(stopped_series, 1.0, Duration::from_secs(30))
        .await;
    daemon
        .wait_metric(alert, 1.0, Duration::from_secs(30))
        .await;

    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(ctx, ""));
    let output = tallyd(&["--config", &path, "fold-from"], &[]).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(shown.contains("caught up"), "{shown}");
    let named: BTreeSet<String> = shown
        .lines()
        .filter(|l| l.starts_with("  ") && l.contains("counted now"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    assert_eq!(named, stopped.near, "the uncertain events named: {shown}");
    for line in shown
        .lines()
        .filter(|l| l.starts_with("  ") && l.contains("counted now"))
    {
        assert!(
            line.contains("not counted now"),
            "folded before the stop, not counted again: {line}"
        );
    }

    let (counters, events) = counters_and_events(store).await;
    assert_eq!(counters, events, "every counter equals its distinct events");
    assert_eq!(
        events.values().sum::<i64>(),
        (5 + WHILE_STOPPED) as i64,
        "every event stored"
    );
    for key in KEYS {
        assert_eq!(ledger.value(key).await.unwrap().value, events[key], "{key}");
    }
    wait_until(
        "the daemon's fold goes on",
        Duration::from_secs(30),
        || async {
            daemon.metric(stopped_series).await == Some(0.0)
                && daemon.metric(alert).await == Some(0.0)
        },
    )
    .await;
    assert!(!fold_state(store).await.contains_key("stopped"));
    // And the daemon folds what comes next.
    assert_outcome(&ledger.record("after", "a", 1).await, "recorded");
    wait_until(
        "the daemon folds again",
        Duration::from_secs(30),
        || async { counter(&store.collection("views"), "a").await == events["a"] + 1 },
    )
    .await;
}

/// A fold that stood still with its stream kept open while the oplog
/// moved past its position stops too: its next pass must not read on past
/// the inserts the oplog no longer holds (MongoDB's `getMore` fails with
/// `ChangeStreamHistoryLost`, 286) and move its position over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_whose_kept_stream_fell_out_of_the_oplog_stops_too() {
    if external() {
        return; // needs a server with a small oplog
    }
    let stopped = stopped_ledger("ledger_lost_log_kept", StandsStill::KeepingItsStream).await;
    let ledger = tally::Ledger::new(&stopped.store, tally::CollectionConfig::new("views"));
    let read = ledger.value("a").await;
    assert!(
        matches!(read, Err(Error::FoldStopped { .. })),
        "an exact read of a stopped fold is refused: {read:?}"
    );
}

/// `tallyd fold-from` on a fold that is not stopped: exit 1, saying so,
/// and nothing changed — neither the fold state nor a counter.
#[tokio::test]
async fn fold_from_refuses_a_fold_that_is_not_stopped() {
    let ctx = TestContext::on("ledger_fold_from_not_stopped", base_uri()).await;
    let store = ctx.client(false).await.store();
    let ledger = ledger_on(&store, "views").await;
    record_spread(&ledger, 6, 2).await;
    fold_all(&fold_of(&store, "views")).await;
    assert_outcome(&ledger.record("unfolded", "c0", 1).await, "recorded");
    let state = fold_state(&store).await;
    let counters = documents(&store, "views").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx, ""));
    for args in [
        vec!["fold-from"],
        vec!["fold-from", "2020-01-01T00:00:00Z", "--json"],
    ] {
        let mut all = vec!["--config", path.as_str()];
        all.extend(&args);
        let output = tallyd(&all, &[]).await;
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {shown}");
        assert!(shown.contains("not stopped"), "{args:?}: {shown}");
        assert_eq!(
            fold_state(&store).await,
            state,
            "{args:?}: the state unchanged"
        );
        assert_eq!(documents(&store, "views").await, counters, "{args:?}");
    }
}

/// `tallyd fold-from TIME --json`, TIME earlier than the stop (before the
/// near events, after the old ones): the JSON names every event recorded
/// near the stop — exactly those the events collection holds there — each
/// `counted_now` when numbered after TIME; those the fold had counted
/// before it stopped are then counted twice, and they are all the
/// difference between the counters and the events: nothing lost, and
/// every count that is off is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fold_from_an_explicit_time_names_in_json_every_event_whose_count_it_cannot_be_sure_of() {
    if external() {
        return; // needs a server with a small oplog
    }
    let stopped = stopped_ledger("ledger_lost_log_time", StandsStill::Stopped).await;
    let (ctx, store) = (&stopped.ctx, &stopped.store);
    // Two minutes before the fold's last pass: after the old events, before
    // the near ones.
    let since = stopped.folded_at - Duration::from_secs(120);
    let time = humantime::format_rfc3339_seconds(since).to_string();
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(ctx, ""));
    let output = tallyd(&["--config", &path, "fold-from", &time, "--json"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let shown = json(&output);
    let named = judge_fold_from(store, &shown, &stopped.folded).await;
    for near in &stopped.near {
        assert_eq!(
            named.get(near).map(|(_, counted)| *counted),
            Some(true),
            "{near}: numbered after TIME, counted now: {shown}"
        );
    }
    assert!(
        named.keys().all(|k| !k.starts_with("old")),
        "numbered before TIME: not uncertain: {shown}"
    );
}

/// `tallyd fold-from --json` (its default TIME) after a fold that folded
/// events as recorders numbered them (the server's clock, now): every
/// event the catch-up counts again — folded before the stop, numbered
/// after TIME — is named `counted_now`, and the counters are off from the
/// events by exactly those. (TIME is the number of the event whose insert
/// the position is; a catch-up's boundary, no insert, stands just before
/// its second, so the events folded in that second are counted again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fold_from_names_every_event_it_counts_again() {
    names_every_event_counted_again(false).await;
}

/// The same, the fold's position the insert of an event (its last pass
/// read the log) rather than a catch-up's boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fold_from_names_every_event_it_counts_again_from_a_position_in_the_log() {
    names_every_event_counted_again(true).await;
}

/// Events folded, the fold stopped while more are recorded, `tallyd
/// fold-from` with its default TIME: judged by [`judge_fold_from`]. With
/// `from_the_log`, the last pass before the stop read the log.
async fn names_every_event_counted_again(from_the_log: bool) {
    if external() {
        return; // needs a server with a small oplog
    }
    let server = TestServer::start(&ServerOptions {
        oplog_max_entries: Some(OPLOG),
        ..ServerOptions::default()
    });
    let ctx = TestContext::on("ledger_lost_log_named", server.uri()).await;
    let store = ctx.client(false).await.store();
    let ledger = ledger_on(&store, "views").await;
    // Recorded now, in three batches, and folded: the fold's last pass.
    let mut folded = BTreeSet::new();
    for batch in 0..3 {
        let events: Vec<(String, String, i64)> = (0..50)
            .map(|i| (format!("f{batch}_{i}"), KEYS[i % KEYS.len()].to_owned(), 1))
            .collect();
        folded.extend(events.iter().map(|(key, _, _)| key.clone()));
        for recording in ledger.record_many(events).await {
            assert_outcome(&recording, "recorded");
        }
    }
    let run = fold_all(&fold_of(&store, "views")).await;
    assert_eq!(run.events_folded, 150, "{run:?}");
    if from_the_log {
        let events: Vec<(String, String, i64)> = (0..30)
            .map(|i| (format!("l{i}"), KEYS[i % KEYS.len()].to_owned(), 1))
            .collect();
        folded.extend(events.iter().map(|(key, _, _)| key.clone()));
        for recording in ledger.record_many(events).await {
            assert_outcome(&recording, "recorded");
        }
        let run = fold_all(&fold_of(&store, "views")).await;
        assert_eq!(run.events_folded, 30, "{run:?}");
    }
    // The fold stands still (stopped) while the oplog moves past it.
    for batch in 0..WHILE_STOPPED / 100 {
        let events: Vec<(String, String, i64)> = (0..100)
            .map(|i| (format!("s{batch}_{i}"), KEYS[i % KEYS.len()].to_owned(), 1))
            .collect();
        for recording in ledger.record_many(events).await {
            assert_outcome(&recording, "recorded");
        }
        let other: Vec<Document> = (0..100).map(|i| doc! { "i": i as i64 }).collect();
        store.collection("other").insert_many(other).await.unwrap();
    }
    let pass = fold_of(&store, "views")
        .fold(server_now(&store).await, &Default::default())
        .await;
    assert!(matches!(pass, Err(Error::HistoryLost { .. })), "{pass:?}");

    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx, ""));
    let output = tallyd(&["--config", &path, "fold-from", "--json"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    judge_fold_from(&store, &json(&output), &folded).await;
}

/// Judges what `tallyd fold-from --json` printed (`shown`) against the
/// events collection, `folded` being the events the fold had counted
/// before it stopped: the JSON names exactly the events its window holds,
/// and every counter is off from its distinct events by exactly the named
/// events it counts now that were folded before (counted twice) — none
/// lost, every count that is off named. Returns the named events: their
/// counters and whether they are counted now.
async fn judge_fold_from(
    store: &Store,
    shown: &serde_json::Value,
    folded: &BTreeSet<String>,
) -> BTreeMap<String, (String, bool)> {
    assert_eq!(shown["outcome"], "caught_up", "{shown}");
    let listed = shown["uncertain"].as_array().unwrap();
    assert_eq!(
        shown["uncertain_total"].as_u64(),
        Some(listed.len() as u64),
        "{shown}"
    );
    let named: BTreeMap<String, (String, bool)> = listed
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_owned(),
                (
                    e["key"].as_str().unwrap().to_owned(),
                    e["counted_now"] == true,
                ),
            )
        })
        .collect();
    // What the events collection holds in the window the JSON states.
    let window = |name: &str| {
        let at = shown[name].as_str().unwrap();
        let at: jiff::Timestamp = at.parse().unwrap_or_else(|e| panic!("{at}: {e}"));
        at.as_microsecond()
    };
    let (after, until) = (window("uncertain_after"), window("uncertain_until"));
    let in_window: BTreeSet<String> = documents(store, "views_events")
        .await
        .into_iter()
        .filter(|e| {
            let s = e.get("s").and_then(Bson::as_i64).unwrap_or(0);
            after < s && s <= until
        })
        .map(|e| e.get_str("_id").unwrap().to_owned())
        .collect();
    assert_eq!(
        named.keys().cloned().collect::<BTreeSet<_>>(),
        in_window,
        "the JSON names every event in its window: {shown}"
    );
    let (counters, events) = counters_and_events(store).await;
    let mut twice: BTreeMap<&str, i64> = KEYS.iter().map(|k| (*k, 0)).collect();
    for (event, (key, counted)) in &named {
        if *counted && folded.contains(event) {
            *twice.get_mut(key.as_str()).unwrap() += 1;
        }
    }
    let expected: BTreeMap<&str, i64> = KEYS.iter().map(|k| (*k, events[k] + twice[k])).collect();
    assert_eq!(
        counters,
        expected,
        "the counters against the events plus the named events counted twice (the events \
         stored: {events:?}; named: {} of them, {} counted now)",
        named.len(),
        named.values().filter(|(_, counted)| *counted).count()
    );
    named
}
