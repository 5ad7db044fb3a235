//! The ledger under the adversarial review's interleavings and faults: a
//! failed fold step, a lost reply followed by a failed read, a fold pass
//! under a steady stream of events, a counter key redelivered as another
//! numeric type.
//!
//! The oracle is always what the test recorded (distinct event keys and
//! their amounts) and what is stored, never what the code under test says.

use std::time::{Duration, SystemTime};

use mongodb::bson::doc;
use tally::{CollectionConfig, EventFold, EventFoldSettings, Ledger};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, fold_of, ledger_on};

/// A sum step that fails after a confirmed claim retires the fold lane
/// and leaves the batch to recovery (as a failed apply does): the next
/// batch goes through a fresh lane, and recovery of the first applies it —
/// both events counted, exact reads exact meanwhile.
#[tokio::test]
async fn a_failed_sum_retires_the_lane_and_its_batch_is_counted_once() {
    let ctx = TestContext::new("ledger_failed_sum").await;
    let direct = ctx.client(false).await;
    let ledger = ledger_on(&direct.store(), "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    // The daemon's fold, kept for the life of the process.
    let fold = fold_of(&through.store(), "views", 100);
    // The daemon has been up a while (batch ids are compared with its start
    // by the second).
    tokio::time::sleep(Duration::from_millis(1100)).await;

    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    // Pass 1: recovery's aggregate goes through; the claim goes through;
    // every attempt of the sum's aggregate has its connection cut (a
    // failover, a flaky link).
    let first = {
        let _cut: Vec<_> = (2..=10)
            .map(|n| {
                proxy.rule(
                    Rule::command("aggregate")
                        .collection("views_events")
                        .nth(n)
                        .then(Action::CloseBeforeForwarding),
                )
            })
            .collect();
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
    };
    assert!(first.is_err(), "the sum failed: {first:?}");
    let claimed = direct
        .collection("views_events")
        .find_one(doc! { "_id": "e1" })
        .await
        .unwrap()
        .unwrap();
    assert!(
        claimed.get_document("c").is_ok(),
        "e1 is claimed: {claimed}"
    );

    // A second event on the same counter; the daemon's next pass.
    assert_outcome(&ledger.record("e2", "a", 1).await, "recorded");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("pass 2");
    let read_during = ledger.value("a").await.unwrap().value;

    // The daemon restarts (or claim_timeout passes): recovery finishes the
    // first batch, then nothing is left.
    let restarted = fold_of(&direct.store(), "views", 100);
    restarted
        .fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("recovery pass");
    let left = direct
        .collection("views_events")
        .count_documents(doc! { "f": { "$exists": false } })
        .await
        .unwrap();
    let stored = counter(&direct.collection("views"), "a").await;
    let read_after = ledger.value("a").await.unwrap().value;
    assert_eq!(left, 0, "every event marked folded");
    assert_eq!(
        (read_during, stored, read_after),
        (2, 2, 2),
        "two distinct events on counter a: (exact read while e1's batch waited, \
         counter after recovery, exact read after) — e1 was marked folded without \
         ever reaching the counter"
    );
}

/// A lost reply whose retry meets the duplicate key, then a failed read of
/// the stored event: the event may be this call's own, so the outcome is
/// `Unknown`, never `NotRecorded` ("nothing was written").
#[tokio::test]
async fn a_lost_reply_then_a_failed_read_is_unknown_never_not_recorded() {
    let ctx = TestContext::new("ledger_false_not_recorded").await;
    let direct = ctx.client(false).await;
    let spec = ledger_on(&direct.store(), "views").await.spec().clone();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let ledger = Ledger::new(&through.store(), spec);

    let recording = {
        let mut rules = vec![
            proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(1)
                    .then(Action::DropReply),
            ),
        ];
        // The read of the stored event, right after the failover that cost
        // the insert's reply: the new primary has no majority snapshot yet
        // (a read-transient code, retried once, then given up on as "not
        // applied"). A server-selection timeout or any non-transient command
        // error (Interrupted, Unauthorized, ...) does the same.
        rules.extend((1..=10).map(|n| {
            proxy.rule(
                Rule::command("find")
                    .collection("views_events")
                    .nth(n)
                    .then(Action::error(
                        134,
                        "ReadConcernMajorityNotAvailableYet",
                        &[],
                    )),
            )
        }));
        let recording = ledger.record("evt_1", "home", 1).await;
        drop(rules);
        recording
    };
    let stored = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "evt_1" })
        .await
        .unwrap();
    assert_eq!(stored, 1, "the first insert landed");
    assert_ne!(
        recording.name(),
        "not_recorded",
        "NotRecorded promises nothing was written, but evt_1 is stored (and will be \
         counted): {recording:?}"
    );
}

/// Under a steady stream of events, each batch is marked folded at the
/// time of its own mark step (the pass's start on the server's clock plus
/// the time the pass has run), never before its events were recorded: the
/// dedupe window is not shortened by the pass's length.
#[tokio::test]
async fn a_fold_pass_under_steady_traffic_marks_each_batch_at_its_own_time() {
    let ctx = TestContext::new("ledger_stale_fold_mark").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;

    let done = CancellationToken::new();
    // A steady stream of events, as a busy service records them.
    let recorder = {
        let (ledger, done) = (ledger.clone(), done.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !done.is_cancelled() {
                let batch: Vec<_> = (0..10)
                    .map(|j| (format!("e{i}_{j}"), "hot", 1i64))
                    .collect();
                for recording in ledger.record_many(batch).await {
                    assert_outcome(&recording, "recorded");
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // One pass, as the daemon runs it: `now` read once at its start.
    let pass_began = SystemTime::now();
    let fold = fold_of(&store, "views", 10);
    let pass = tokio::spawn(async move { fold.fold(pass_began, &CancellationToken::new()).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    done.cancel();
    recorder.await.unwrap();
    let run = pass.await.unwrap().expect("the pass");
    let took = pass_began.elapsed().unwrap();

    // The latest-recorded event the pass folded, and its mark.
    let latest = direct
        .collection("views_events")
        .find_one(doc! { "f": { "$exists": true } })
        .sort(doc! { "at": -1 })
        .await
        .unwrap()
        .unwrap();
    let at = latest.get_datetime("at").unwrap();
    let f = latest.get_datetime("f").unwrap();
    let lag = at.timestamp_millis() - f.timestamp_millis();
    assert!(
        lag <= 500,
        "one pass of {took:?} folded {} events; event {} was recorded at {at} and marked \
         folded at {f}, {lag} ms BEFORE it was recorded: its dedupe window (event_retention \
         after f) is short by the pass's length, which grows while events keep coming",
        run.events_folded,
        latest.get_str("_id").unwrap_or("?"),
    );
}

/// The same event redelivered with its counter key as another numeric
/// type (int64 for int32, same value) is a `Duplicate`, as the server
/// compares ids: one counter, counted once.
#[tokio::test]
async fn the_same_event_with_its_counter_key_as_int64_is_a_duplicate() {
    let ctx = TestContext::new("ledger_numeric_key").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("evt_1", 5i32, 1).await, "recorded");
    let again = ledger.record("evt_1", 5i64, 1).await;
    assert_eq!(
        ledger.value(5i64).await.unwrap().value,
        1,
        "one event on counter 5"
    );
    assert_outcome(&again, "duplicate");
}

/// A pass ends at its time limit, one batch at least, saying events are
/// left; the next passes fold the rest, each event once.
#[tokio::test]
async fn a_fold_pass_ends_at_its_limit_and_the_next_passes_fold_the_rest() {
    let ctx = TestContext::new("ledger_pass_limit").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let events: Vec<_> = (0..30).map(|i| (format!("e{i}"), "hot", 1i64)).collect();
    for recording in ledger.record_many(events).await {
        assert_outcome(&recording, "recorded");
    }
    let fold = EventFold::new(
        &store,
        CollectionConfig::new("views"),
        EventFoldSettings {
            batch_size: 10,
            pass_limit: Duration::ZERO,
            ..EventFoldSettings::default()
        },
    );
    let first = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("the first pass");
    assert_eq!(
        (first.batches, first.events_folded, first.more),
        (1, 10, true)
    );
    let mut passes = 1;
    loop {
        let run = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await
            .expect("a pass");
        passes += 1;
        if !run.more {
            break;
        }
        assert!(passes < 10, "the passes end");
    }
    assert_eq!(counter(&direct.collection("views"), "hot").await, 30);
    assert_eq!(ledger.value("hot").await.unwrap().value, 30);
}
