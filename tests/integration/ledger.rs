//! The events ledger against a real server: an event recorded
//! twice is counted once, a reused key is a conflict, a lost reply is told
//! apart from a duplicate by the lane and number it was sent with, one
//! handle's concurrent callers share inserts, the fold puts every recorded
//! event into its counter once — whatever step it crashes after — without
//! ever writing an event, and exact reads stay exact while it folds.
//!
//! The oracle is the set of distinct event keys the test recorded (each
//! with its amount) and what is stored, never what the code under test
//! reports.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use proptest::prelude::*;
use tally::{CollectionConfig, Error, EventFold, EventFoldSettings, Ledger, Recording, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{FailPoint, TestContext, counter};

pub(crate) async fn ledger_on(store: &Store, name: &str) -> Ledger {
    let ledger = Ledger::new(store, CollectionConfig::new(name));
    ledger
        .create_indexes()
        .await
        .expect("create the ledger's indexes");
    ledger
}

/// A proxy to the test server, and a ledger of `views` (its indexes made
/// directly) that reaches the server through it.
pub(crate) async fn ledger_through_proxy(ctx: &TestContext) -> (Proxy, Ledger) {
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let spec = ledger_on(&ctx.client(false).await.store(), "views")
        .await
        .spec()
        .clone();
    (proxy, Ledger::new(&through.store(), spec))
}

pub(crate) fn fold_of(store: &Store, name: &str) -> EventFold {
    EventFold::new(
        store,
        CollectionConfig::new(name),
        EventFoldSettings::default(),
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

pub(crate) async fn fold_all(fold: &EventFold) -> tally::EventsRun {
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("fold")
}

/// Events not in their counters yet (the fold's backlog).
pub(crate) async fn unfolded(fold: &EventFold) -> u64 {
    fold.backlog(SystemTime::now())
        .await
        .expect("backlog")
        .events
}

/// Every document of `collection`, by `_id`.
pub(crate) async fn documents(store: &Store, collection: &str) -> Vec<Document> {
    store
        .collection(collection)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .unwrap()
        .try_collect()
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
    assert!(stored.get_object_id("L").is_ok(), "{stored}");
    assert!(stored.get_i64("s").is_ok(), "{stored}");
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

/// The insert landed and its reply was lost; the retry collides with it:
/// the stored lane and number are the recording's own, so it is recorded —
/// not a duplicate, which would tell the caller someone else recorded it.
#[tokio::test]
async fn a_lost_reply_is_recorded_not_duplicate_and_an_unknown_is_settled_by_recording_again() {
    let ctx = TestContext::new("ledger_lost_reply").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&recording, "recorded");
    assert_eq!(proxy.requests("insert").len(), 2, "sent, then retried once");

    // Both attempts lost: unknown. Recording the ticket again — on a fresh
    // lane, with a fresh number — finds its first attempt: recorded.
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
        let again = ledger.record_again(ticket.clone()).await.expect("in time");
        assert_outcome(&again, "recorded");
    }
    // Another handle (another process) settles it the same way.
    let other = Ledger::new(&ctx.client(false).await.store(), ledger.spec().clone());
    assert_outcome(&other.record_again(ticket).await.unwrap(), "recorded");
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

/// A ticket whose first attempt is older than the retry horizon is never
/// sent again: its event may have been folded and forgotten.
#[tokio::test]
async fn an_unknown_past_the_retry_horizon_is_refused_and_nothing_is_sent() {
    let ctx = TestContext::new("ledger_horizon").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let ledger = ledger.with_retry_horizon(Duration::from_secs(2));
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").then(Action::CloseBeforeForwarding));
        ledger.record("evt_1", "home", 1).await
    };
    let Recording::Unknown(ticket) = recording else {
        panic!("expected unknown, got {recording:?}");
    };
    tokio::time::sleep(Duration::from_millis(2100)).await;
    proxy.clear_log();
    match ledger.record_again(ticket).await {
        Err(err @ Error::EventRetryHorizonExceeded { .. }) => {
            let said = err.to_string();
            assert!(
                said.contains("evt_1") && said.contains("at most once"),
                "{said}"
            );
        }
        other => panic!("expected the horizon's refusal, got {other:?}"),
    }
    assert!(proxy.requests("insert").is_empty(), "nothing was sent");
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

/// One ordered insert stops at the first key recorded before; the keys
/// after it are read in one `find`, and only the new ones sent again.
#[tokio::test]
async fn record_many_gives_each_event_its_outcome_in_few_round_trips() {
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
    assert_eq!(
        client.events.count("insert"),
        2,
        "stopped once, sent again once"
    );
    assert_eq!(client.events.count("find"), 1, "the rest read at once");
    assert_eq!(client.events.count("bulkWrite"), 0);
    assert_eq!(ledger.value("a").await.unwrap().value, 4);
    assert_eq!(ledger.value("b").await.unwrap().value, 5);
    // Recorded again as a whole (a backfill run twice): two round trips.
    client.events.clear();
    let again = ledger
        .record_many([("e1", "a", 1), ("seen", "a", 1), ("e2", "b", 5)])
        .await;
    assert!(again.iter().all(|r| r.name() == "duplicate"), "{again:?}");
    assert_eq!(
        (client.events.count("insert"), client.events.count("find")),
        (1, 1)
    );
}

/// The whole insert's reply is lost: the retry collides on every event,
/// each with its own lane and number: all recorded, none duplicate.
#[tokio::test]
async fn record_many_with_a_lost_reply_is_recorded_once() {
    let ctx = TestContext::new("ledger_record_many_lost").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
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

/// 16 callers recording at once on one handle: one insert in flight, the
/// others' events wait and go out together — far fewer inserts than
/// events, every event numbered apart.
#[tokio::test]
async fn concurrent_callers_on_one_handle_share_inserts_each_event_its_own_number() {
    let ctx = TestContext::new("ledger_group_commit").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    client.events.clear();
    let callers: Vec<_> = (0..16)
        .map(|c| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                for i in 0..20 {
                    let recording = ledger.record(format!("c{c}e{i}"), "hot", 1).await;
                    assert_outcome(&recording, "recorded");
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let inserts = client.events.count("insert");
    assert!(inserts <= 160, "{inserts} inserts for 320 events");
    let stored = documents(&client.store(), "views_events").await;
    assert_eq!(stored.len(), 320);
    let mut numbers: Vec<i64> = stored.iter().map(|d| d.get_i64("s").unwrap()).collect();
    numbers.sort_unstable();
    numbers.dedup();
    assert_eq!(numbers.len(), 320, "every event its own number");
    fold_all(&fold_of(&client.store(), "views")).await;
    assert_eq!(counter(&client.collection("views"), "hot").await, 320);
}

/// The fold puts every event in its counter once, in one pass, and never
/// writes an event: the events collection is the same before and after.
#[tokio::test]
async fn the_fold_puts_every_event_in_its_counter_once_and_never_writes_an_event() {
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
    let before = documents(&store, "views_events").await;
    let fold = fold_of(&store, "views");
    client.events.clear();
    let run = fold_all(&fold).await;
    assert_eq!(
        (run.events_folded, run.counters_written),
        (300, 7),
        "{run:?}"
    );
    assert_eq!(run.backlog.events, 0);
    assert_eq!(
        documents(&store, "views_events").await,
        before,
        "no event written"
    );
    // Writes: the intent, the commit, one per counter.
    let on_events = client
        .events
        .sent()
        .iter()
        .filter(|s| ["insert", "update", "delete"].contains(&s.name.as_str()))
        .count();
    assert_eq!(on_events, 2 + 7, "{:?}", client.events.sent());
    let views = client.collection("views");
    for (key, n) in &expected {
        assert_eq!(counter(&views, key.as_str()).await, *n, "counter {key}");
        let exact = ledger.value(key.as_str()).await.unwrap();
        assert_eq!((exact.value, exact.unfolded_events), (*n, 0));
    }
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
    let fold = fold_of(&store, "views");
    let refused = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    match refused {
        Err(Error::IndexesMissing {
            collection,
            missing,
        }) => {
            assert_eq!(collection, "views_events");
            assert_eq!(missing.len(), 2, "{missing:?}");
        }
        other => panic!("expected IndexesMissing, got {other:?}"),
    }
    assert_eq!(counter(&client.collection("views"), "a").await, 0);
    let done = ledger.create_indexes().await.unwrap();
    assert!(done.iter().all(|l| l.ends_with("created")), "{done:?}");
    let again = ledger.create_indexes().await.unwrap();
    assert!(again.iter().all(|l| l.ends_with("present")), "{again:?}");
    assert!(ledger.missing_indexes().await.unwrap().is_empty());
    assert_eq!(fold_all(&fold).await.events_folded, 1);
}

/// A counter the server refuses (a validator: at most 5) holds its sum;
/// exact reads add it; the other counters fold on; once the counter takes
/// it, it is applied once.
#[tokio::test]
async fn a_refused_counter_holds_its_sum_until_it_accepts_it() {
    let ctx = TestContext::new("ledger_held").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let db = client.client.database(&ctx.db_name);
    db.run_command(doc! {
        "create": "views",
        "validator": { "counter": { "$lte": 5 } },
    })
    .await
    .unwrap();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    for i in 0..4 {
        assert_outcome(
            &ledger.record(format!("big{i}"), "big", 2).await,
            "recorded",
        );
    }
    assert_outcome(&ledger.record("s1", "small", 1).await, "recorded");
    let run = fold_all(&fold).await;
    assert_eq!(run.backlog.held.len(), 1, "{run:?}");
    let held = &run.backlog.held[0];
    assert_eq!((held.key.as_str(), held.events), (Some("big"), 4));
    assert!(
        held.cause.contains("121") || held.cause.contains("alidation"),
        "{}",
        held.cause
    );
    assert_eq!(counter(&client.collection("views"), "small").await, 1);
    assert_eq!(ledger.value("big").await.unwrap().value, 8);
    // More events for it wait behind the held sum; merged, never sent
    // out of order.
    assert_outcome(&ledger.record("big4", "big", 2).await, "recorded");
    let run = fold_all(&fold).await;
    assert_eq!(run.backlog.held.len(), 1, "merged: {run:?}");
    assert_eq!(run.backlog.held[0].amount, "10");
    assert_eq!(ledger.value("big").await.unwrap().value, 10);
    db.run_command(doc! { "collMod": "views", "validator": {} })
        .await
        .unwrap();
    let run = fold_all(&fold).await;
    assert!(run.backlog.held.is_empty(), "{run:?}");
    assert_eq!(counter(&client.collection("views"), "big").await, 10);
    assert_eq!(ledger.value("big").await.unwrap().value, 10);
}

/// Where a faulty pass stops: the first request of this kind fails, and
/// every one after it (a crash).
#[derive(Debug, Clone, Copy)]
enum Crash {
    /// Before the intent: the survey went through.
    AfterSurvey,
    /// After the intent, before the sums.
    AfterIntent,
    /// After some counters' updates.
    AfterApplying(u64),
    /// After every update, before the commit.
    BeforeCommit,
    /// The commit landed; its reply was lost.
    CommitReplyLost,
    /// No crash.
    Nothing,
}

fn crash() -> impl Strategy<Value = Crash> {
    prop_oneof![
        Just(Crash::AfterSurvey),
        Just(Crash::AfterIntent),
        (0u64..3).prop_map(Crash::AfterApplying),
        Just(Crash::BeforeCommit),
        Just(Crash::CommitReplyLost),
        Just(Crash::Nothing),
    ]
}

impl Crash {
    /// The rule that makes the pass on `name` crash there.
    fn rule(self, name: &str) -> Option<crate::common::proxy::Rule> {
        let events = format!("{name}_events");
        let state = format!("{name}_events_fold");
        let close = Action::CloseBeforeForwarding;
        Some(match self {
            Crash::AfterSurvey => Rule::any()
                .collection(&state)
                .mentions("intent")
                .then(close),
            // The survey is the first aggregate of the pass (one lane).
            Crash::AfterIntent => Rule::command("aggregate")
                .collection(&events)
                .after(1)
                .then(close),
            Crash::AfterApplying(n) => Rule::command("update")
                .collection(name)
                .after(n)
                .then(close),
            Crash::BeforeCommit => Rule::command("update")
                .collection(&state)
                .mentions("$unset")
                .then(close),
            Crash::CommitReplyLost => Rule::command("update")
                .collection(&state)
                .mentions("$unset")
                .nth(1)
                .then(Action::DropReply),
            Crash::Nothing => return None,
        })
    }
}

/// The model: every distinct event recorded, in its counter once. A round
/// records events (some repeated), then a fold pass crashes at a chosen
/// step; the same fold's next pass resumes what it left. The counters
/// always read exactly (through `value`), and after a final fold equal the
/// model with nothing left unfolded and no pass in progress.
#[test]
fn the_fold_matches_the_model_whatever_step_it_crashes_after() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ctx = runtime.block_on(TestContext::new("ledger_fold_model"));
    let client = runtime.block_on(ctx.client(false));
    let store = client.store();
    let proxy = runtime.block_on(async { Proxy::start(&upstream_of(&ctx.uri).await).await });
    let through = runtime.block_on(ctx.client_through(&proxy, false)).store();
    let case = Arc::new(AtomicI64::new(0));
    let config = ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(rounds in proptest::collection::vec(
        (proptest::collection::vec((0u32..40, 0usize..4, 1i64..4), 1..25), crash()),
        1..6,
    ))| {
        let name = format!("m{}", case.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(async {
            let ledger = ledger_on(&store, &name).await;
            let fold = fold_of(&through, &name);
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
                let guard = crash.rule(&name).map(|rule| proxy.rule(rule));
                let _ = fold.fold(SystemTime::now(), &CancellationToken::new()).await;
                drop(guard);
                for (key, n) in &model {
                    prop_assert_eq!(ledger.value(key.as_str()).await.unwrap().value, *n);
                }
            }
            fold_all(&fold).await;
            let coll = client.collection(&name);
            for (key, n) in &model {
                prop_assert_eq!(counter(&coll, key.as_str()).await, *n, "counter {}", key);
            }
            prop_assert_eq!(unfolded(&fold).await, 0);
            let state = documents(&store, &format!("{name}_events_fold")).await;
            prop_assert!(state.iter().all(|d| !d.contains_key("intent")), "{:?}", state);
            Ok(())
        })?;
    });
}

/// A fold stops mid-pass (a killed daemon) with its counters half updated;
/// another process's fold takes the pass over once its lease (plus one
/// attempt) has run out, and applies it exactly: the updated counters
/// ignore it, the others get it.
#[tokio::test]
async fn another_fold_takes_a_stopped_pass_over_after_its_lease_and_applies_it_once() {
    let ctx = TestContext::new("ledger_take_over").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let selection = "serverSelectionTimeoutMS=1000";
    let through = ctx
        .client_through_with(&proxy, false, selection)
        .await
        .store()
        .with_attempt_timeout(Duration::from_secs(2));
    let ledger = ledger_on(&store, "views").await;
    record_spread(&ledger, 60, 6).await;
    let settings = EventFoldSettings {
        lease: Duration::from_secs(1),
        ..EventFoldSettings::default()
    };
    let first = EventFold::new(&through, CollectionConfig::new("views"), settings.clone());
    {
        let _crash = proxy.rule(
            Rule::command("update")
                .collection("views")
                .after(3)
                .then(Action::CloseBeforeForwarding),
        );
        assert!(fold_all_err(&first).await, "the pass stops part-way");
    }
    let views = client.collection("views");
    let mut updated = 0;
    for c in 0..6 {
        let key = format!("c{c}");
        updated += i64::from(counter(&views, key.as_str()).await == 10);
        assert_eq!(
            ledger.value(key).await.unwrap().value,
            10,
            "exact meanwhile"
        );
    }
    assert_eq!(updated, 3, "three updates went through before the crash");
    let other = ctx
        .client_with_uri_options(selection, false)
        .await
        .store()
        .with_attempt_timeout(Duration::from_secs(2));
    let second = EventFold::new(&other, CollectionConfig::new("views"), settings);
    let run = second
        .fold(SystemTime::now(), &CancellationToken::new())
        .await
        .unwrap();
    assert!(run.busy, "the lease has not run out yet: {run:?}");
    crate::common::wait_until(
        "the pass is taken over",
        Duration::from_secs(30),
        || async {
            let run = second
                .fold(SystemTime::now(), &CancellationToken::new())
                .await
                .unwrap();
            run.recovered && run.pass == Some(1)
        },
    )
    .await;
    for c in 0..6 {
        let key = format!("c{c}");
        assert_eq!(counter(&views, key.as_str()).await, 10, "{key}: once");
    }
    assert_eq!(unfolded(&second).await, 0);
}

async fn fold_all_err(fold: &EventFold) -> bool {
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .is_err()
}

/// Exact reads while the fold runs pass after pass: every read is at least
/// what was acknowledged before it started and at most what was attempted
/// by the time it returned.
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
            let fold = fold_of(&store, "views");
            let mut passes = 0;
            while !done.is_cancelled() {
                if fold_all(&fold).await.pass.is_some() {
                    passes += 1;
                }
            }
            passes
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
    let passes = folder.await.unwrap();
    fold_all(&fold_of(&store, "views")).await;
    assert!(
        reads > 20 && passes > 5,
        "only {reads} reads and {passes} passes"
    );
    assert_eq!(counter(&client.collection("views"), "hot").await, 400);
    assert_eq!(ledger.value("hot").await.unwrap().value, 400);
}

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
