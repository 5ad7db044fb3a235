//! The events collection's floor: an insert held up in the network past a
//! pass meets it and its resend counts once, a late insert is counted and
//! read before the window passes, a late `collMod` never lowers the floor
//! under a folded range, and recorders whose clocks are minutes off count
//! every event once.
//!
//! Requests are held up in the network by the black-pipe proxy. The
//! oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::time::SystemTime;

use mongodb::bson::{Bson, doc};
use tally::{EventTicket, Ledger, Recording};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::cli::{tallyd, write_config};
use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{FailPoint, TestContext, counter};
use crate::ledger::{assert_outcome, fold_all, fold_of, ledger_on, ledger_through_proxy, unfolded};

/// An insert held up in the network (its recorder gave up on it: unknown)
/// reaches the server after later events were folded: the fold raised the
/// events collection's floor past its number, so the server refuses it —
/// nothing lands late, below the watermark, where no pass would look. The
/// ticket sent again records the event on a fresh number, counted once.
#[tokio::test]
async fn an_insert_held_in_the_network_past_a_pass_meets_the_floor_and_its_resend_counts_once() {
    let ctx = TestContext::new("ledger_held_insert").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let recorder = Ledger::new(&through.store(), ledger.spec().clone());
    assert_outcome(&recorder.record("e0", "a", 1).await, "recorded");
    let unknown = {
        let _held = [
            proxy.rule(
                Rule::command("insert")
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            proxy.rule(
                Rule::command("insert")
                    .nth(2)
                    .then(Action::CloseBeforeForwarding),
            ),
        ];
        recorder.record("e1", "a", 10).await
    };
    let Recording::Unknown(ticket) = unknown else {
        panic!("expected unknown, got {unknown:?}");
    };
    assert_outcome(&recorder.record("e2", "a", 100).await, "recorded");
    let fold = fold_of(&store, "views");
    fold_all(&fold).await;
    assert_eq!(counter(&direct.collection("views"), "a").await, 101);
    assert_eq!(ledger.value("a").await.unwrap().value, 101);
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let stored = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "e1" })
        .await
        .unwrap();
    assert_eq!(stored, 0, "the floor refused the late insert");
    assert_eq!(ledger.value("a").await.unwrap().value, 101);
    assert_outcome(&recorder.record_again(ticket).await.unwrap(), "recorded");
    assert_eq!(ledger.value("a").await.unwrap().value, 111);
    fold_all(&fold).await;
    assert_eq!(counter(&direct.collection("views"), "a").await, 111);
    assert_eq!(unfolded(&fold).await, 0);
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

/// Finding 1 (lost for good). A recorder's lane whose first inserts were
/// all duplicates (a consumer replaying a queue's already-recorded
/// events) has nothing folded, so the fold state keeps no folded number
/// for it. Its next insert is held up in the network past the lane's
/// seal; the fold seals the lane (an empty survey) and forgets it. The
/// insert then lands, `record_again` finds it and says `recorded` — and
/// nothing ever counts it: the sweep only looks for late events on lanes
/// that have a folded number, so no pass, no sweep, no exact read ever
/// sees this lane again. The design's limit promises such an insert is
/// "folded only when the sweep finds it, late"; it is never found.
#[tokio::test]
async fn a_late_insert_on_a_sealed_lane_that_never_folded_an_event_is_counted() {
    let ctx = TestContext::new("review_ledger_late_unfolded_lane").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    // Another process recorded the replayed event first.
    assert_outcome(&ledger.record("replayed", "a", 1).await, "recorded");
    // The recorder's lane is minted and registered; its insert stops at
    // the duplicate: nothing of its own lands on it.
    assert_outcome(&recorder.record("replayed", "a", 1).await, "duplicate");
    let ticket = record_held(&proxy, &recorder, "late", "a", 10).await;

    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = server_now(&store).await;
    fold.fold(now, &stop).await.expect("a pass");
    // Two hours on, a pass raises the floor past the held insert's number.
    fold.fold(now + 2 * HOUR, &stop).await.expect("a pass");
    // The held insert reaches the server, which refuses it (the floor):
    // the ticket sent again records the event, on a fresh number.
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    assert_outcome(&again, "recorded");
    let stored = || async {
        direct
            .collection("views_events")
            .count_documents(doc! { "_id": "late" })
            .await
            .unwrap()
    };
    assert_eq!(stored().await, 1, "the late event is in the log");

    // Pass after pass, sweep after sweep, past the dedupe window.
    for later in [3 * HOUR, 8 * DAY, 30 * DAY] {
        fold.sweep(now + later).await.expect("a sweep");
        fold.fold(now + later, &stop).await.expect("a pass");
    }
    // Folded, then deleted a dedupe window after its lane was sealed again.
    assert_eq!(
        stored().await,
        0,
        "the late event is deleted past the window"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        11,
        "30 days on, the fold has counted the recorded event"
    );
    assert_eq!(
        ledger.value("a").await.unwrap().value,
        11,
        "an exact read counts the recorded event"
    );
}

/// Finding 6 (counted a week late, invisible meanwhile). An insert held up
/// in the network a few minutes past its lane's end lands after the fold
/// sealed the lane. The design says only an insert held "longer than an
/// hour past its lane's end is folded only when the sweep finds it, late";
/// but the sweep looks for late events only on lanes whose folded number is
/// older than the whole dedupe window (7 days by default). Until then the
/// event — `recorded`, says `record_again` — is in no counter, in no exact
/// read (`get`), and in no backlog or alert.
#[tokio::test]
async fn a_late_insert_on_a_sealed_lane_is_counted_and_read_before_the_window_passes() {
    let ctx = TestContext::new("review_ledger_late_sealed_lane").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    assert_outcome(&recorder.record("first", "a", 1).await, "recorded");
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = server_now(&store).await;
    fold.fold(now, &stop).await.expect("a pass");
    let ticket = record_held(&proxy, &recorder, "late", "a", 10).await;
    fold.fold(now + 2 * HOUR, &stop).await.expect("a pass");
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    assert_outcome(&again, "recorded");

    assert_eq!(
        ledger.value("a").await.unwrap().value,
        11,
        "an exact read counts the recorded event"
    );
    // An hour later (three past the lane's registration), sweep and pass.
    fold.sweep(now + 3 * HOUR).await.expect("a sweep");
    let run = fold.fold(now + 3 * HOUR, &stop).await.expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        11,
        "the late event is folded within hours, not after the dedupe window: {run:?}"
    );
}

/// Finding 1 (lost for good; the recorder is told `recorded`). The floor
/// only rises — the design says so, and the pass's range being "read once
/// and for good" stands on it — but `floor::raise` is an unconditioned
/// `collMod` that *sets* the validator to `s > W'`. A `collMod` of pass 1
/// held up in the network (its first attempt; the retry goes through and
/// pass 1 commits) reaches the server after pass 2 raised the floor to
/// `W2` and read its range: it puts the floor back at `W1`. An insert
/// numbered in `(W1, W2]`, itself held up in the network since before pass
/// 2 began (the case the floor is there for), now lands: it is above the
/// floor, at or below the watermark. No pass reads it (every later range
/// starts at `W2`), no exact read counts it (`s ≤ W`), and `record_again`
/// finds it — its own lane and number — and says `recorded`. Its 10 are
/// never counted.
#[tokio::test]
async fn a_late_collmod_of_an_earlier_pass_never_lowers_the_floor_under_a_folded_range() {
    let ctx = TestContext::new("review_floor_late_collmod").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let db = direct.client.database(&ctx.db_name);
    // The recorder, through its proxy.
    let (recorder_proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    // The fold, through its own proxy.
    let fold_proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let fold_a = fold_of(
        &ctx.client_through(&fold_proxy, false).await.store(),
        "views",
    );
    let fold_b = fold_of(&store, "views");
    let stop = CancellationToken::new();

    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    // Pass 1: its first collMod is held up in the network; the retry
    // raises the floor to W1 and the pass commits.
    {
        let _held = fold_proxy.rule(
            Rule::command("collMod")
                .nth(1)
                .then(Action::HoldRequest(Release::WhenReleased)),
        );
        let run = fold_a.fold(SystemTime::now(), &stop).await.expect("pass 1");
        assert_eq!(run.pass, Some(1), "{run:?}");
    }
    let w1 = floor_of(&db).await.expect("a floor after pass 1");

    // An insert numbered after pass 1 began is held up in the network; its
    // retry is cut: the caller is told unknown.
    let ticket = {
        let _held = [
            recorder_proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            recorder_proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(2)
                    .then(Action::CloseBeforeForwarding),
            ),
        ];
        match recorder.record("late", "a", 10).await {
            Recording::Unknown(ticket) => ticket,
            other => panic!("expected unknown, got {other:?}"),
        }
    };
    assert!(ticket.number() > w1, "numbered above the floor of pass 1");

    // Pass 2 (another event to fold): floor W2 past the held insert.
    assert_outcome(&ledger.record("e2", "a", 1).await, "recorded");
    let run = fold_b.fold(SystemTime::now(), &stop).await.expect("pass 2");
    assert_eq!(run.pass, Some(2), "{run:?}");
    let w2 = floor_of(&db).await.expect("a floor after pass 2");
    assert!(ticket.number() <= w2, "pass 2 folded past the held insert");

    // Pass 1's held collMod reaches the server, then the held insert.
    let released = fold_proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let released = recorder_proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    let floor_now = floor_of(&db).await;

    // The caller settles its ticket: recorded (its own lane and number).
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    let stored = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "late" })
        .await
        .unwrap();
    // Whatever the caller was told, the log and the counter must agree.
    for _ in 0..3 {
        fold_b.fold(SystemTime::now(), &stop).await.expect("a pass");
    }
    let total = 1 + 1 + if stored == 1 { 10 } else { 0 };
    assert_eq!(
        (again.name(), stored),
        ("recorded", 1),
        "the late insert's fate (floor after the release: {floor_now:?}, W1 {w1}, W2 {w2})"
    );
    assert_eq!(
        ledger.value("a").await.unwrap().value,
        total,
        "an exact read counts the recorded event (floor after the release: {floor_now:?}, \
         W1 {w1}, W2 {w2})"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        total,
        "the fold counts the recorded event (floor after the release: {floor_now:?}, W1 {w1}, \
         W2 {w2})"
    );
}

/// Finding 2 (lost for good; the recorder is told `recorded`). Tally 0.2.0
/// numbered events by its recorder host's clock. One of its recorders ran
/// ten minutes ahead of the server (the clocks this version was rebuilt
/// for); the old fold folded everything. The first pass of this version
/// converts the state: `W` = the highest folded number, ten minutes ahead
/// of the server's clock. The pass then ends at `max(now, W) = W`: nothing
/// to fold, so it returns without raising a floor. A recorder of this
/// version — numbering by the server's clock, as designed — records an
/// event: no floor refuses it, it lands numbered below `W`. It is
/// `recorded`, yet an exact read leaves it out (`s ≤ W`), and no pass ever
/// reads it (every range starts at `W`): its 5 are never counted.
#[tokio::test]
async fn an_event_recorded_after_converting_a_state_whose_recorder_ran_ahead_is_counted() {
    use mongodb::bson::oid::ObjectId;

    let ctx = TestContext::new("review_floor_converted_ahead").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = crate::ledger::ledger_on(&store, "views").await;
    let server_now = tally::Reconciler::new(&store)
        .server_time()
        .await
        .expect("server time");
    // Three events a 0.2.0 recorder numbered ten minutes ahead, all folded.
    let ahead = i64::try_from(
        (server_now + std::time::Duration::from_secs(600))
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap();
    let lane = ObjectId::new();
    let events: Vec<mongodb::bson::Document> = (1..=3i64)
        .map(|s| {
            doc! { "_id": format!("old{s}"), "k": "home", "n": 1i64,
            "at": mongodb::bson::DateTime::now(), "L": lane, "s": ahead - 100 + s }
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
    let state = doc! { "_id": "state", "pass": 7i64, "v": 14i64,
    "folded": { lane.to_hex(): ahead - 97 } };
    client
        .collection("views_events_fold")
        .insert_one(state)
        .await
        .unwrap();

    // The daemon of this version folds: the state is converted.
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = || async {
        tally::Reconciler::new(&store)
            .server_time()
            .await
            .expect("server time")
    };
    fold.fold(now().await, &stop)
        .await
        .expect("the converting pass");
    assert!(ledger.value("home").await.is_ok(), "the state is converted");

    // A recorder of this version records an event.
    assert_outcome(&ledger.record("new1", "home", 5).await, "recorded");
    let read = ledger.value("home").await.unwrap();
    for _ in 0..3 {
        fold.fold(now().await, &stop).await.expect("a pass");
    }
    let stored = client
        .collection("views_events")
        .find_one(doc! { "_id": "new1" })
        .await
        .unwrap();
    assert_eq!(
        read.value,
        8,
        "an exact read counts the recorded event (stored: {stored:?}, converted W {})",
        ahead - 97
    );
    assert_eq!(
        counter(&client.collection("views"), "home").await,
        8,
        "the fold counts the recorded event (stored: {stored:?})"
    );
}

/// Finding 1, by a takeover (the same root: `floor::raise` sets the floor,
/// it never only raises it). Fold A records pass 1 and sends its `collMod`,
/// which is held up in the network; A's retry is cut, its pass fails, its
/// intent stays. Fold B takes the pass over once A's lease ran out, raises
/// the floor to W1, commits pass 1, and folds pass 2 up to W2. A's held
/// `collMod` then reaches the server: the floor is back at W1, and an
/// insert numbered in `(W1, W2]`, held up since before pass 2, lands below
/// the watermark: `recorded`, never counted. (Time is moved by the `now`
/// B's passes are given, as `fold`'s tests do, to pass A's lease.)
#[tokio::test]
async fn a_collmod_of_a_pass_taken_over_never_lowers_the_floor_under_a_later_pass() {
    let ctx = TestContext::new("review_floor_takeover_collmod").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let db = direct.client.database(&ctx.db_name);
    let (recorder_proxy, recorder) = ledger_through_proxy(&ctx).await;
    let ledger = Ledger::new(&store, recorder.spec().clone());
    let fold_proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let fold_a = fold_of(
        &ctx.client_through(&fold_proxy, false).await.store(),
        "views",
    );
    let fold_b = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let now = || async {
        tally::Reconciler::new(&store)
            .server_time()
            .await
            .expect("server time")
    };

    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    {
        let _cut = [
            fold_proxy.rule(
                Rule::command("collMod")
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            fold_proxy.rule(
                Rule::command("collMod")
                    .nth(2)
                    .then(Action::CloseBeforeForwarding),
            ),
        ];
        assert!(
            fold_a.fold(now().await, &stop).await.is_err(),
            "A's pass stops at its floor"
        );
    }
    // The held insert, numbered now.
    let ticket = {
        let _held = [
            recorder_proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            recorder_proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(2)
                    .then(Action::CloseBeforeForwarding),
            ),
        ];
        match recorder.record("late", "a", 10).await {
            Recording::Unknown(ticket) => ticket,
            other => panic!("expected unknown, got {other:?}"),
        }
    };
    // Past A's lease, B takes pass 1 over, then folds pass 2 (another
    // event to fold).
    assert_outcome(&ledger.record("e2", "a", 1).await, "recorded");
    let later = now().await + std::time::Duration::from_secs(300);
    let run = fold_b.fold(later, &stop).await.expect("B's takeover");
    assert!(run.recovered, "{run:?}");
    let w2 = floor_of(&db).await.expect("a floor");
    assert!(ticket.number() <= w2, "B folded past the held insert");

    fold_proxy.release_held().await;
    recorder_proxy.release_held().await;
    let floor_now = floor_of(&db).await;
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    for minutes in [6, 7, 8] {
        let at = now().await + std::time::Duration::from_secs(60 * minutes);
        fold_b.fold(at, &stop).await.expect("a pass");
    }
    assert_outcome(&again, "recorded");
    assert_eq!(
        ledger.value("a").await.unwrap().value,
        12,
        "an exact read counts the recorded event (floor after the release: {floor_now:?}, W2 {w2})"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        12,
        "the fold counts the recorded event (floor after the release: {floor_now:?}, W2 {w2})"
    );
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

/// The floor a `listCollections` shows for `views_events`.
async fn floor_of(db: &mongodb::Database) -> Option<i64> {
    let reply = db
        .run_command(doc! { "listCollections": 1, "filter": { "name": "views_events" } })
        .await
        .unwrap();
    let batch = reply
        .get_document("cursor")
        .unwrap()
        .get_array("firstBatch")
        .unwrap();
    batch
        .first()?
        .as_document()?
        .get_document("options")
        .ok()?
        .get_document("validator")
        .ok()?
        .get_document("s")
        .ok()?
        .get_i64("$gt")
        .ok()
}

/// A fold keeps the events collection's change stream open from one raise
/// of the floor to the next: each later pass reads its raise from where
/// the last left off. Opened afresh at each raise, the stream makes the
/// server find its start, which the test server does by reading its whole
/// oplog — the record-to-counter lag grew from 18 ms to 1.9 s with the
/// oplog full. A kept stream that fails is given up for a new one, and the
/// passes stay exact. The proxy's log is the oracle for the opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folds_later_passes_read_their_raise_from_the_stream_it_kept_open() {
    let ctx = TestContext::new("floor_kept_stream").await;
    let direct = ctx.client(false).await;
    let ledger = ledger_on(&direct.store(), "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let fold = fold_of(&ctx.client_through(&proxy, false).await.store(), "views");
    let opens = || {
        proxy
            .requests("aggregate")
            .iter()
            .filter(|e| e.body_mentions("$changeStream"))
            .count()
    };
    for i in 0..5 {
        assert_outcome(&ledger.record(format!("e{i}"), "a", 1).await, "recorded");
        let run = fold_all(&fold).await;
        assert_eq!(run.events_folded, 1, "pass {i}: {run:?}");
    }
    assert_eq!(opens(), 1, "five passes, one change stream");

    // The kept stream's next read fails (a command error, which the driver
    // does not resume): the raise reads a new stream, and the pass folds.
    {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["getMore"], "errorCode": 2 },
        )
        .await;
        assert_outcome(&ledger.record("e5", "a", 1).await, "recorded");
        let run = fold_all(&fold).await;
        assert_eq!(run.events_folded, 1, "{run:?}");
    }
    assert_eq!(opens(), 2, "the failed stream was replaced once");
    assert_outcome(&ledger.record("e6", "a", 1).await, "recorded");
    assert_eq!(fold_all(&fold).await.events_folded, 1);
    assert_eq!(opens(), 2, "and the new one kept");
    assert_eq!(counter(&direct.collection("views"), "a").await, 7);
}

/// A kept stream whose read stalls past its wait and then fails is given
/// up, and the raise reads a new stream with a wait of its own: the pass
/// folds (found by the adversarial review: the new stream shared the
/// kept one's deadline, and the pass stopped with `FoldFloorUnverified`,
/// which fires the `events_stuck` alert).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_stream_that_stalls_then_fails_leaves_the_raise_a_new_one_with_time_to_read() {
    let ctx = TestContext::new("floor_kept_stall").await;
    let direct = ctx.client(false).await;
    let ledger = ledger_on(&direct.store(), "views").await;
    let fold = fold_of(&direct.store(), "views");
    assert_outcome(&ledger.record("e0", "a", 1).await, "recorded");
    assert_eq!(fold_all(&fold).await.events_folded, 1);
    // The kept stream's next read blocks past the whole wait a raise had
    // before (30 s), then fails.
    let run = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["getMore"], "blockConnection": true,
            "blockTimeMS": 30_500, "errorCode": 2 },
        )
        .await;
        assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
    };
    let run = run.expect("the pass reads a new stream and folds");
    assert_eq!(run.events_folded, 1, "{run:?}");
    assert_eq!(counter(&direct.collection("views"), "a").await, 2);
}
