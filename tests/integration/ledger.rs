//! The events ledger (DESIGN §8) against a real server: an event recorded
//! twice is counted once, a reused key is a conflict, a lost reply is told
//! apart from a duplicate by the recording's token, the fold puts every
//! recorded event into its counter once — whatever step it crashes after —
//! and exact reads stay exact while it folds.
//!
//! The oracle is the set of distinct event keys the test recorded (each
//! with its amount), never what the code under test reports.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, doc, oid::ObjectId};
use proptest::prelude::*;
use tally::{CollectionConfig, Error, EventFold, EventFoldSettings, Ledger, Recording, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{FailPoint, TestContext, counter, field};

const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

pub(crate) async fn ledger_on(store: &Store, name: &str) -> Ledger {
    let ledger = Ledger::new(store, CollectionConfig::new(name));
    ledger
        .create_indexes(RETENTION)
        .await
        .expect("create the ledger's indexes");
    ledger
}

pub(crate) fn fold_of(store: &Store, name: &str, batch_size: u32) -> EventFold {
    EventFold::new(
        store,
        CollectionConfig::new(name),
        EventFoldSettings {
            batch_size,
            ..EventFoldSettings::default()
        },
    )
}

/// Records `events` events of 1, `e0…`, spread over the counters `c0…`
/// (`counters` of them, round robin), each `recorded`.
pub(crate) async fn record_spread(ledger: &Ledger, events: usize, counters: usize) {
    let events: Vec<(String, String, i64)> = (0..events)
        .map(|i| (format!("e{i}"), format!("c{}", i % counters), 1))
        .collect();
    for recording in ledger.record_many(events).await {
        assert_outcome(&recording, "recorded");
    }
}

async fn fold_all(fold: &EventFold) -> tally::EventsRun {
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("fold")
}

async fn unfolded(store: &Store, events: &str) -> u64 {
    store
        .collection(events)
        .count_documents(doc! { "f": { "$exists": false } })
        .await
        .unwrap()
}

#[track_caller]
pub(crate) fn assert_outcome(recording: &Recording, name: &str) {
    assert_eq!(recording.name(), name, "{recording:?}");
}

#[tokio::test]
async fn an_event_recorded_twice_is_a_duplicate_and_a_reused_key_a_conflict() {
    let ctx = TestContext::new("ledger_duplicate_conflict").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("evt_1", "home", 2).await, "recorded");
    assert_outcome(&ledger.record("evt_1", "home", 2).await, "duplicate");
    let conflict = ledger.record("evt_1", "about", 2).await;
    let Recording::Conflict(c) = &conflict else {
        panic!("expected a conflict, got {conflict:?}");
    };
    let said = c.to_string();
    assert!(
        said.contains("evt_1") && said.contains("home") && said.contains("about"),
        "names both: {said}"
    );
    assert_outcome(&ledger.record("evt_1", "home", 3).await, "conflict");
    assert_outcome(&ledger.record("evt_2", "home", 0).await, "not_recorded");
    let events = client.collection("views_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 1);
    let stored = events.find_one(doc! {}).await.unwrap().unwrap();
    assert_eq!(stored.get_str("k").unwrap(), "home");
    assert_eq!(stored.get_i64("n").unwrap(), 2);
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

/// The insert landed and its reply was lost; the retry collides with it:
/// the stored token is the recording's own, so it is recorded — not a
/// duplicate, which would tell the caller someone else recorded it.
#[tokio::test]
async fn a_lost_reply_is_recorded_not_duplicate_and_an_unknown_is_settled_by_recording_again() {
    let ctx = TestContext::new("ledger_lost_reply").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let ledger = ledger_on(&ctx.client(false).await.store(), "views").await;
    let ledger = Ledger::new(&through.store(), ledger.spec().clone());
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&recording, "recorded");
    assert_eq!(proxy.requests("insert").len(), 2, "sent, then retried once");

    // Both attempts lost: unknown. Recording the ticket again settles it.
    proxy.clear_log();
    let recording = {
        let _lost = [
            proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply)),
            proxy.rule(Rule::command("insert").nth(2).then(Action::DropReply)),
        ];
        ledger.record("evt_2", "home", 1).await
    };
    let Recording::Unknown(ticket) = recording else {
        panic!("expected unknown, got {recording:?}");
    };
    for _ in 0..2 {
        assert_outcome(&ledger.record_again(ticket.clone()).await, "recorded");
    }
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

#[tokio::test]
async fn a_command_error_is_not_recorded() {
    let ctx = TestContext::new("ledger_command_error").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let refused = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["insert"], "errorCode": 2 },
        )
        .await;
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&refused, "not_recorded");
    let events = client.collection("views_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 0);
    assert_outcome(&ledger.record("evt_1", "home", 1).await, "recorded");
}

#[tokio::test]
async fn record_many_gives_each_event_its_outcome_in_one_round_trip() {
    let ctx = TestContext::new("ledger_record_many").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("seen", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("other", "a", 1).await, "recorded");
    client.events.clear();
    let outcomes = ledger
        .record_many([
            ("e1", "a", 1),
            ("seen", "a", 1),
            ("e2", "b", 5),
            ("e1", "a", 1),
            ("other", "b", 1),
            ("zero", "a", 0),
            ("e3", "a", 1),
        ])
        .await;
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert_eq!(
        names,
        [
            "recorded",
            "duplicate",
            "recorded",
            "duplicate",
            "conflict",
            "not_recorded",
            "recorded"
        ]
    );
    assert_eq!(client.events.count("insert"), 1, "one insert command");
    assert_eq!(client.events.count("bulkWrite"), 0);
    assert_eq!(ledger.value("a").await.unwrap().value, 4);
    assert_eq!(ledger.value("b").await.unwrap().value, 5);
}

/// The whole insert's reply is lost: the retry collides on every event,
/// each with this call's own token: all recorded, none duplicate.
#[tokio::test]
async fn record_many_with_a_lost_reply_is_recorded_once() {
    let ctx = TestContext::new("ledger_record_many_lost").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let spec = ledger_on(&ctx.client(false).await.store(), "views")
        .await
        .spec()
        .clone();
    let ledger = Ledger::new(&through.store(), spec);
    let events: Vec<(String, &str, i64)> = (0..50).map(|i| (format!("e{i}"), "a", 1)).collect();
    let outcomes = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        ledger.record_many(events).await
    };
    assert!(
        outcomes.iter().all(|o| o.name() == "recorded"),
        "{outcomes:?}"
    );
    assert_eq!(ledger.value("a").await.unwrap().value, 50);
}

#[tokio::test]
async fn the_fold_puts_every_event_in_its_counter_once_and_marks_it_folded() {
    let ctx = TestContext::new("ledger_fold").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let batch: Vec<(String, String, i64)> = (0..300)
        .map(|i| (format!("e{i}"), format!("c{}", i % 7), 1 + i % 3))
        .collect();
    for (_, key, n) in &batch {
        *expected.entry(key.clone()).or_default() += n;
    }
    assert!(
        ledger
            .record_many(batch)
            .await
            .iter()
            .all(Recording::is_counted)
    );
    let fold = fold_of(&store, "views", 64);
    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 300);
    assert_eq!(run.batches, 5);
    let views = client.collection("views");
    for (key, n) in &expected {
        assert_eq!(counter(&views, key.as_str()).await, *n, "counter {key}");
        let exact = ledger.value(key.as_str()).await.unwrap();
        assert_eq!((exact.value, exact.unfolded_events), (*n, 0));
    }
    assert_eq!(unfolded(&store, "views_events").await, 0);
    // Folding again finds nothing; a repeat inside the window is a
    // duplicate and adds nothing.
    assert_eq!(fold_all(&fold).await.events_folded, 0);
    assert_outcome(&ledger.record("e1", "c1", 2).await, "duplicate");
    assert_eq!(fold_all(&fold).await.events_folded, 0);
    assert_eq!(counter(&views, "c1").await, expected["c1"]);
}

#[tokio::test]
async fn the_fold_refuses_a_ledger_without_its_indexes() {
    let ctx = TestContext::new("ledger_no_indexes").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = Ledger::new(&store, CollectionConfig::new("views"));
    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    let fold = fold_of(&store, "views", 10);
    let refused = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    match refused {
        Err(Error::IndexesMissing {
            collection,
            missing,
        }) => {
            assert_eq!(collection, "views_events");
            assert_eq!(missing.len(), 3, "{missing:?}");
        }
        other => panic!("expected IndexesMissing, got {other:?}"),
    }
    assert_eq!(unfolded(&store, "views_events").await, 1, "nothing folded");
    let done = ledger.create_indexes(RETENTION).await.unwrap();
    assert!(done.iter().all(|l| l.ends_with("created")), "{done:?}");
    let again = ledger.create_indexes(RETENTION).await.unwrap();
    assert!(again.iter().all(|l| l.ends_with("present")), "{again:?}");
    assert!(ledger.missing_indexes(RETENTION).await.unwrap().is_empty());
    assert_eq!(fold_all(&fold).await.events_folded, 1);
}

/// The step a crashed fold stops after.
#[derive(Debug, Clone, Copy)]
enum CrashAfter {
    Claim,
    Sum,
    ApplySome,
    Apply,
    Mark,
    Nothing,
}

fn crash_after() -> impl Strategy<Value = CrashAfter> {
    prop_oneof![
        Just(CrashAfter::Claim),
        Just(CrashAfter::Sum),
        Just(CrashAfter::ApplySome),
        Just(CrashAfter::Apply),
        Just(CrashAfter::Mark),
        Just(CrashAfter::Nothing),
    ]
}

/// Runs one fold batch step by step and "crashes" (drops the fold, as a
/// killed process would leave it) after `crash`.
async fn fold_until(fold: EventFold, crash: CrashAfter) {
    let Some(batch) = fold.claim().await.unwrap() else {
        return;
    };
    if let CrashAfter::Claim = crash {
        return;
    }
    let sums = fold.sum(&batch).await.unwrap();
    if let CrashAfter::Sum = crash {
        return;
    }
    let half = if let CrashAfter::ApplySome = crash {
        &sums[..sums.len() / 2]
    } else {
        &sums[..]
    };
    fold.apply(&batch, half, false).await.unwrap();
    if let CrashAfter::ApplySome | CrashAfter::Apply = crash {
        return;
    }
    fold.mark(&batch, SystemTime::now()).await.unwrap();
}

/// The model: every distinct event recorded, in its counter once. A round
/// records events (some repeated), then a fold "process" runs one batch
/// and crashes after a chosen step; the next process recovers first. The
/// counters always read exactly (through `value`), and after a final fold
/// equal the model with nothing left unfolded.
#[test]
fn the_folds_step_machine_matches_the_model_whatever_step_it_crashes_after() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ctx = runtime.block_on(TestContext::new("ledger_fold_model"));
    let client = runtime.block_on(ctx.client(false));
    let store = client.store();
    let case = Arc::new(AtomicI64::new(0));
    let config = ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(rounds in proptest::collection::vec(
        (proptest::collection::vec((0u32..40, 0usize..4, 1i64..4), 1..25), crash_after()),
        1..6,
    ))| {
        let name = format!("m{}", case.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(async {
            let ledger = ledger_on(&store, &name).await;
            let mut model: BTreeMap<String, i64> = BTreeMap::new();
            let mut seen: BTreeMap<u32, (String, i64)> = BTreeMap::new();
            for (events, crash) in rounds {
                for (id, counter_of, n) in events {
                    let key = format!("k{counter_of}");
                    // The same event id always carries the same event.
                    let (key, n) = seen.entry(id).or_insert((key, n)).clone();
                    let recording = ledger.record(format!("e{id}"), key.as_str(), n).await;
                    prop_assert!(recording.is_counted(), "{recording:?}");
                    if recording.name() == "recorded" {
                        *model.entry(key).or_default() += n;
                    }
                }
                fold_until(fold_of(&store, &name, 7), crash).await;
                for (key, n) in &model {
                    prop_assert_eq!(ledger.value(key.as_str()).await.unwrap().value, *n);
                }
            }
            // A new process: recovery, then everything else.
            fold_all(&fold_of(&store, &name, 7)).await;
            let coll = client.collection(&name);
            for (key, n) in &model {
                prop_assert_eq!(counter(&coll, key.as_str()).await, *n, "counter {}", key);
            }
            prop_assert_eq!(unfolded(&store, &format!("{name}_events")).await, 0);
            Ok(())
        })?;
    });
}

/// A daemon crashed with a claimed batch applied to its counter but not
/// marked, and stayed down past `lane_ttl`. The next reconcile run must
/// finish the batch before any prune can remove the fold lane's entry — a
/// batch re-applied after its entry was pruned would count twice.
#[tokio::test]
async fn a_batch_left_by_a_crash_is_finished_before_its_lane_could_be_pruned() {
    let ctx = TestContext::new("ledger_recover_before_prune").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 5).await, "recorded");
    // What the crashed fold left: a lane minted 25 hours ago, its batch
    // applied to the counter, the event claimed and not marked.
    let day_ago = SystemTime::now() - Duration::from_secs(25 * 3600);
    let lane = ObjectId::from_parts(
        day_ago
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as u32,
        [1; 5],
        [0; 3],
    );
    let batch = ObjectId::new();
    let events = client.collection("views_events");
    events
        .update_one(
            doc! { "_id": "e1" },
            doc! { "$set": { "c": { "b": batch, "l": lane.to_hex(), "s": 1i64 } } },
        )
        .await
        .unwrap();
    client
        .collection("views")
        .insert_one(doc! { "_id": "a", "counter": 5i64, "lanes": { lane.to_hex(): 1i64 } })
        .await
        .unwrap();
    assert_eq!(ledger.value("a").await.unwrap().value, 5, "exact meanwhile");

    let target = tally::FoldTarget {
        spec: CollectionConfig::new("views").with_events_collection("views_events"),
        grace: Duration::from_secs(900),
        batch_size: 100,
    };
    let run = crate::common::run_reconcile(&store, &target, tally::Mode::Fold).await;
    assert!(run.error.is_none(), "{run:?}");
    assert_eq!(
        run.events_folded, 1,
        "the reconcile run folds the ledger first"
    );
    assert_eq!(counter(&client.collection("views"), "a").await, 5);
    assert_eq!(unfolded(&store, "views_events").await, 0);
    assert_eq!(ledger.value("a").await.unwrap().value, 5);
    // The run did prune the fold lane's entry — after the batch was
    // finished, so the counter is still exact.
    assert_eq!(
        run.lanes_pruned, 1,
        "the expired fold lane's entry is pruned in the same run"
    );
    assert_eq!(field(&client.collection("views"), "a", "lanes").await, None);
}

/// Exact reads while the fold runs batch after batch: every read is at
/// least what was acknowledged before it started and at most what was
/// attempted by the time it returned.
#[tokio::test]
async fn exact_reads_stay_exact_while_the_fold_runs() {
    let ctx = TestContext::new("ledger_exact_reads").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let acknowledged = Arc::new(AtomicI64::new(0));
    let attempted = Arc::new(AtomicI64::new(0));
    let done = CancellationToken::new();
    let recorder = {
        let (ledger, acknowledged, attempted, done) = (
            ledger.clone(),
            acknowledged.clone(),
            attempted.clone(),
            done.clone(),
        );
        tokio::spawn(async move {
            for i in 0..400 {
                attempted.fetch_add(1, Ordering::SeqCst);
                let recording = ledger.record(format!("e{i}"), "hot", 1).await;
                assert_outcome(&recording, "recorded");
                acknowledged.fetch_add(1, Ordering::SeqCst);
                // Every tenth event is sent again: a duplicate, no count.
                if i % 10 == 0 {
                    let again = ledger.record(format!("e{i}"), "hot", 1).await;
                    assert_outcome(&again, "duplicate");
                }
            }
            done.cancel();
        })
    };
    let folder = {
        let (store, done) = (store.clone(), done.clone());
        tokio::spawn(async move {
            let fold = fold_of(&store, "views", 13);
            while !done.is_cancelled() {
                fold_all(&fold).await;
            }
        })
    };
    let mut reads = 0;
    while !done.is_cancelled() {
        let low = acknowledged.load(Ordering::SeqCst);
        let value = ledger.value("hot").await.unwrap().value;
        let high = attempted.load(Ordering::SeqCst);
        assert!(
            low <= value && value <= high,
            "read {value} outside [{low}, {high}]"
        );
        reads += 1;
    }
    recorder.await.unwrap();
    folder.await.unwrap();
    fold_all(&fold_of(&store, "views", 100)).await;
    assert!(reads > 20, "only {reads} reads");
    assert_eq!(counter(&client.collection("views"), "hot").await, 400);
    assert_eq!(ledger.value("hot").await.unwrap().value, 400);
}

/// A claim held up in the network past `claim_timeout`, landing after its
/// batch was recovered. The fold's claim (an `updateMany`) is not atomic
/// across events on MongoDB: an attempt interrupted part-way (a step-down)
/// claims some of the ids, and the rest can be claimed by a copy that
/// arrives later. Recovery must fix the batch's events before it sums them:
/// an event joining the batch after the batch was applied would be marked
/// folded by a no-op apply, and never counted.
#[tokio::test]
async fn a_claim_landing_after_its_batch_was_recovered_loses_no_event() {
    let ctx = TestContext::new("ledger_held_claim").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("e2", "a", 1).await, "recorded");

    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let held = proxy.rule(
        Rule::command("update")
            .collection("views_events")
            .then(Action::HoldRequest(Release::WhenReleased)),
    );
    let first = fold_of(&through.store(), "views", 10);
    let failed = first
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    assert!(failed.is_err(), "every claim attempt is held: {failed:?}");
    let claims = proxy.requests("update");
    assert!(!claims.is_empty());
    let claim = claims[0].body.get_array("updates").unwrap()[0]
        .as_document()
        .unwrap()
        .get_document("u")
        .unwrap()
        .get_document("$set")
        .unwrap()
        .get_document("c")
        .unwrap()
        .clone();
    // The part of an interrupted attempt that executed: e1 alone.
    direct
        .collection("views_events")
        .update_one(doc! { "_id": "e1" }, doc! { "$set": { "c": claim } })
        .await
        .unwrap();
    assert_eq!(ledger.value("a").await.unwrap().value, 2);

    // Another process, past the claim timeout: recovers the batch.
    let recovery = EventFold::new(
        &store,
        CollectionConfig::new("views"),
        EventFoldSettings {
            claim_timeout: Duration::ZERO,
            ..EventFoldSettings::default()
        },
    );
    recovery.recover(SystemTime::now()).await.expect("recover");
    // The held claims land now.
    drop(held);
    let released = proxy.release_held().await;
    assert!(!released.is_empty());
    assert!(released.iter().all(|e| e.server_replied), "{released:?}");
    fold_all(&recovery).await;
    assert_eq!(unfolded(&store, "views_events").await, 0);
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        2,
        "both events counted"
    );
    assert_eq!(ledger.value("a").await.unwrap().value, 2);
}

/// A claim is sent in chunks of 100 ids (a server may match a long `$in`
/// in quadratic time). One chunk refused after another landed fails the
/// pass with the batch claimed in part; the next pass recovers it from its
/// intent, claiming the rest itself: every event counted once.
#[tokio::test]
async fn a_claim_refused_after_its_first_chunk_is_finished_by_recovery_exactly() {
    let ctx = TestContext::new("ledger_claim_chunks").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    record_spread(&ledger, 250, 3).await;
    let fold = fold_of(&store, "views", 5000);
    {
        // The fold's first update is the claim's first chunk; the second
        // chunk is refused (a command error: not retried).
        let _refused = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "skip": 1, "times": 1 }),
            doc! { "failCommands": ["update"], "errorCode": 2 },
        )
        .await;
        let failed = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await;
        assert!(
            failed.is_err(),
            "the claim's second chunk was refused: {failed:?}"
        );
    }
    let claimed = client
        .collection("views_events")
        .count_documents(doc! { "c": { "$exists": true } })
        .await
        .unwrap();
    assert_eq!(claimed, 100, "the first chunk alone landed");
    for c in 0..3 {
        let n = if c == 0 { 84 } else { 83 };
        assert_eq!(ledger.value(format!("c{c}")).await.unwrap().value, n);
    }
    let run = fold_all(&fold).await;
    assert_eq!(run.recovered, 1, "{run:?}");
    assert_eq!(run.events_folded, 250, "{run:?}");
    assert_eq!(unfolded(&store, "views_events").await, 0);
    let intents = client
        .collection("views_events_batches")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(intents, 0, "no intent left");
    for c in 0..3 {
        let n = if c == 0 { 84 } else { 83 };
        assert_eq!(
            counter(&client.collection("views"), format!("c{c}").as_str()).await,
            n,
            "c{c}: 0 lost, 0 doubled"
        );
    }
}
