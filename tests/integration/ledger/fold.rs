//! The fold puts every recorded event into its counter once, without ever
//! writing an event: whatever step a pass stops after (it is resumed or
//! taken over and applied once), with two folds at once, with counters
//! the server refuses (their sums held, the other counters folded), with
//! a ledger that cannot fold (the token fold goes on), and it refuses a
//! lost state or missing indexes rather than fold over them.
//!
//! Time is moved by the `now` each fold step is given where a test needs
//! hours or days. The oracle is what the test recorded and what is
//! stored, never what the code under test reports.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, doc};
use proptest::prelude::*;
use tally::{
    CollectionConfig, Error, EventFold, EventFoldSettings, FoldTarget, Ledger, Mode, Recording,
    Store,
};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{TestContext, counter, field, run_reconcile};
use crate::ledger::{assert_outcome, fold_of, ledger_on};

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
    // Writes of a ledger's first fold (its events were recorded before any
    // fold: a catch-up): the fold state made with the catch-up's boundary,
    // the intent, one command carrying the seven counters' updates, the
    // commit. Never one per event.
    let writes = |client: &crate::common::TestClient| -> Vec<_> {
        client
            .events
            .sent()
            .into_iter()
            .filter(|s| ["insert", "update", "delete"].contains(&s.name.as_str()))
            .collect()
    };
    let first = writes(&client);
    assert_eq!(first.len(), 4, "{first:?}");
    assert!(
        first
            .iter()
            .any(|s| s.statements == 7 && s.update_ops == ["$inc", "$set"]),
        "{first:?}"
    );
    // A pass over the log: the intent, the counters' command, the commit.
    let more: Vec<(String, String, i64)> = (300..600)
        .map(|i| (format!("e{i}"), format!("c{}", i % 7), 1 + i % 3))
        .collect();
    for (_, key, n) in &more {
        *expected.entry(key.clone()).or_default() += n;
    }
    assert!(
        ledger
            .record_many(more)
            .await
            .iter()
            .all(Recording::is_counted)
    );
    client.events.clear();
    assert_eq!(fold_all(&fold).await.events_folded, 300);
    let log_pass = writes(&client);
    assert_eq!(log_pass.len(), 3, "{log_pass:?}");
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
            assert_eq!(missing, ["tally_events_number"]);
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
        lease: Duration::from_secs(3),
        // One command per counter, so the pass can stop between them.
        apply_batch: 1,
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

/// A pass over 250 counters sends their sums in commands of 100 (the
/// default `apply_batch`), and stops when every command after the first is
/// cut before it reaches the server: exactly the first command's 100
/// counters hold their sums, every exact read is exact meanwhile, and the
/// same fold's next pass resumes the pass — its first command collides on
/// the counters that have their sums, each of which is read back, never
/// added twice — and applies the rest once.
#[tokio::test]
async fn a_pass_cut_between_its_update_commands_is_resumed_once_per_counter() {
    let ctx = TestContext::new("ledger_batch_cut").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx
        .client_through_with(&proxy, false, "serverSelectionTimeoutMS=1000")
        .await
        .store()
        .with_attempt_timeout(Duration::from_secs(2));
    let ledger = ledger_on(&store, "views").await;
    record_spread(&ledger, 500, 250).await;
    let fold = fold_of(&through, "views");
    {
        let _cut = proxy.rule(
            Rule::command("update")
                .collection("views")
                .after(1)
                .then(Action::CloseBeforeForwarding),
        );
        assert!(fold_all_err(&fold).await, "the pass stops part-way");
    }
    let views = client.collection("views");
    let mut updated = 0;
    for c in 0..250 {
        let key = format!("c{c}");
        updated += i64::from(counter(&views, key.as_str()).await == 2);
        assert_eq!(ledger.value(key).await.unwrap().value, 2, "exact meanwhile");
    }
    assert_eq!(updated, 100, "the first command's counters, and only those");
    let run = fold_all(&fold).await;
    assert!(run.recovered, "{run:?}");
    for c in 0..250 {
        let key = format!("c{c}");
        assert_eq!(counter(&views, key.as_str()).await, 2, "{key}: once");
    }
    assert_eq!(unfolded(&fold).await, 0);
}

/// `apply_batch` is how many counters' updates go in one command, past
/// the default 100 too: 250 counters with `apply_batch: 250` are one
/// command of 250 statements, 250 with 120 three commands of 120, 120, 10.
#[tokio::test]
async fn apply_batch_sets_how_many_counters_one_command_carries() {
    let ctx = TestContext::new("ledger_apply_batch").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    for (batch, want) in [(250, vec![250]), (120, vec![120, 120, 10])] {
        let tag = format!("b{batch}");
        let events: Vec<(String, String, i64)> = (0..250)
            .map(|i| (format!("{tag}-{i}"), format!("c{i}"), 1))
            .collect();
        for recording in ledger.record_many(events).await {
            assert_outcome(&recording, "recorded");
        }
        let settings = EventFoldSettings {
            apply_batch: batch,
            ..EventFoldSettings::default()
        };
        let fold = EventFold::new(&store, CollectionConfig::new("views"), settings);
        client.events.clear();
        fold_all(&fold).await;
        let mut sizes: Vec<usize> = client
            .events
            .sent()
            .into_iter()
            .filter(|s| s.name == "update" && s.update_ops == ["$inc", "$set"])
            .map(|s| s.statements)
            .collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(sizes, want, "apply_batch {batch}");
    }
    let views = client.collection("views");
    for c in 0..250 {
        assert_eq!(counter(&views, format!("c{c}").as_str()).await, 2);
    }
}

/// Finding 2: one counter the server refuses to update (here a string
/// counter) stopped its ledger for good: every later pass retried the same
/// batch first and failed, and the other counters' events were never
/// folded again. Now its sum is held aside and every other counter keeps
/// folding.
#[tokio::test]
async fn a_counter_the_server_refuses_never_stops_the_other_counters_of_its_ledger() {
    let ctx = TestContext::new("ledger_finding_refused").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let views = client.collection("views");
    views
        .insert_one(doc! { "_id": "bad", "counter": "not a number" })
        .await
        .unwrap();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    assert_outcome(&ledger.record("e1", "bad", 1).await, "recorded");
    assert_outcome(&ledger.record("e2", "good", 1).await, "recorded");
    let _ = fold.fold(store_time(&store).await, &stop).await;
    assert_outcome(&ledger.record("e3", "good", 1).await, "recorded");
    let _ = fold.fold(store_time(&store).await, &stop).await;
    let _ = fold.fold(store_time(&store).await, &stop).await;
    assert_eq!(
        counter(&views, "good").await,
        2,
        "the good counter folds on"
    );
    assert_eq!(
        field(&views, "bad", "counter").await,
        Some(Bson::String("not a number".into())),
        "the refused counter is left as it is"
    );
}

/// Finding 3: any ledger failure (here: its indexes are missing) also
/// skipped the collection's pending-token fold and lane pruning in that
/// run.
#[tokio::test]
async fn a_ledger_that_cannot_fold_never_stops_the_token_fold_of_its_collection() {
    let ctx = TestContext::new("ledger_finding_token_fold").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let views = client.collection("views");
    // A token a crashed writer left an hour ago.
    let old = ObjectId::from_bytes({
        let mut bytes = ObjectId::new().bytes();
        let secs = u32::from_be_bytes(bytes[..4].try_into().unwrap()) - 3600;
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        bytes
    });
    views
        .insert_one(doc! { "_id": "a", "counter": 1i64, "pending": [old] })
        .await
        .unwrap();
    // A ledger without its indexes: the fold refuses it.
    let ledger = Ledger::new(
        &store,
        CollectionConfig::new("views").with_events_collection("log"),
    );
    assert!(ledger.record("e1", "a", 1).await.is_counted());
    let target = FoldTarget {
        spec: CollectionConfig::new("views").with_events_collection("log"),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    let run = run_reconcile(&store, &target, Mode::Fold).await;
    assert!(run.error.is_some(), "the ledger's refusal is reported");
    assert_eq!(counter(&views, "a").await, 2, "the stale token is folded");
}

/// Two folds of one ledger at once (a `tallyd reconcile` beside the
/// daemon, or two daemons): one records the pass, the other finds it in
/// progress and leaves it; every event counted once, exact reads exact
/// throughout.
#[tokio::test]
async fn two_folds_of_one_ledger_at_once_count_every_event_once() {
    let ctx = TestContext::new("ledger_review2_two_folds").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let values = |ledger: tally::Ledger| async move {
        let mut v = Vec::new();
        for c in 0..3 {
            v.push(ledger.value(format!("c{c}")).await.unwrap().value);
        }
        v
    };
    let (one, two) = (
        std::sync::Arc::new(crate::ledger::fold_of(&store, "views")),
        std::sync::Arc::new(crate::ledger::fold_of(&store, "views")),
    );
    let mut expected = [0i64; 3];
    for round in 0..5 {
        let events: Vec<(String, String, i64)> = (0..60)
            .map(|i| (format!("r{round}e{i}"), format!("c{}", i % 3), 1))
            .collect();
        for recording in ledger.record_many(events).await {
            assert_outcome(&recording, "recorded");
        }
        expected.iter_mut().for_each(|n| *n += 20);
        let passes = [one.clone(), two.clone()].map(|fold| {
            let stop = stop.clone();
            tokio::spawn(async move { fold.fold(SystemTime::now(), &stop).await })
        });
        assert_eq!(values(ledger.clone()).await, expected);
        for pass in passes {
            pass.await.unwrap().expect("a pass");
        }
        assert_eq!(values(ledger.clone()).await, expected);
    }
    one.fold(SystemTime::now(), &stop).await.expect("last pass");
    for (c, n) in expected.iter().enumerate() {
        let name = format!("c{c}");
        assert_eq!(
            crate::common::counter(&direct.collection("views"), name.as_str()).await,
            *n,
            "{name}"
        );
    }
}

/// Two folds of a fresh ledger, one a step behind (seen under load in the
/// suite, made certain here by the proxy): fold A reads no state document
/// and its survey is held up in the network; fold B makes the state and
/// applies its pass; A's check for a lost state then finds a counter
/// holding a fold pass. The state is there — another fold made it — so A
/// must not refuse with `FoldStateLost` (an alert, a failed run, a page
/// for an operator); it stands back or folds, and every event counts once.
#[tokio::test]
async fn a_fold_a_step_behind_anothers_first_pass_is_not_told_its_state_was_lost() {
    use crate::common::proxy::{Action, Release, Rule};
    use crate::ledger::{fold_of, ledger_through_proxy};
    use tokio_util::sync::CancellationToken;

    let ctx = TestContext::new("ledger_review2_first_pass_race").await;
    let direct = ctx.client(false).await;
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    assert_outcome(&recorder.record("e1", "a", 1).await, "recorded");
    let through = ctx.client_through(&proxy, false).await;
    let behind = fold_of(&through.store(), "views");
    let ahead = fold_of(&direct.store(), "views");
    let _held = proxy.rule(
        Rule::command("aggregate")
            .collection("views_events")
            .nth(1)
            .then(Action::HoldRequest(Release::WhenReleased)),
    );
    let stop = CancellationToken::new();
    let late = tokio::spawn({
        let stop = stop.clone();
        async move { behind.fold(SystemTime::now(), &stop).await }
    });
    proxy
        .wait_until("fold A's survey is held", Duration::from_secs(10), |log| {
            log.iter()
                .any(|e| e.command.as_deref() == Some("aggregate") && !e.reached_server)
        })
        .await;
    ahead
        .fold(SystemTime::now(), &stop)
        .await
        .expect("fold B's first pass");
    proxy.release_held().await;
    let run = late.await.unwrap();
    assert!(
        run.is_ok(),
        "fold A, a step behind, was told the state was lost: {run:?}"
    );
    assert_eq!(
        crate::common::counter(&direct.collection("views"), "a").await,
        1
    );
}

/// Finding 2 (a fixed counter blocked for good by a crash). A counter
/// refused its sum (held at pass 1), and was fixed. The next pass sends
/// the held sum (position 1) and the counter's new sum (position 2): both
/// apply. The pass stops before its commit (a daemon restarted, a network
/// failure at the commit) and is resumed: the held sum, still in the
/// state, goes out again at position 1 — the counter's fold lane holds 2
/// — and comes back `OutOfOrder`, which the fold takes for a refusal
/// ("its fold state was reset"), not for what it is here (applied before
/// the newer one, the only order the fold sends in). It is held again,
/// for good; every later sum of the counter waits behind it. The counter
/// never counts again; `events_held` blames a reset that never happened.
#[tokio::test]
async fn a_pass_resumed_after_a_fixed_counter_took_its_held_sum_never_blocks_the_counter() {
    let rig = HeldRig::new("review_ledger_resumed_held").await;
    assert_outcome(&rig.ledger.record("s1", "big", 8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "refused and held: {run:?}");
    rig.fix_the_counter().await;
    assert_outcome(&rig.ledger.record("s2", "big", 1).await, "recorded");
    rig.pass_stopped_before_its_commit().await;
    assert_eq!(counter(&rig.counters(), "big").await, 9);
    rig.pass().await.expect("the pass resumed");
    assert_outcome(&rig.ledger.record("s3", "big", 1).await, "recorded");
    rig.takes_its_events(10).await;
}

/// Finding 7 (a counter blocked for good after it was fixed). Negative
/// amounts are events too (a refund): a held sum can come to zero — the
/// counter refused +8 (a validator), and a later -8 was merged into it.
/// A zero sum is sent and refused by the lanes protocol ("the amount must
/// not be zero"); once a pass was resumed (any transient failure, any
/// crash before the commit) that refusal is "maybe applied", so nothing is
/// ever merged into it again, and it can never be taken. After the
/// counter is fixed, every later sum of it waits behind that zero for
/// good: the counter never gets its events, and `events_held` blames the
/// counter ("the amount must not be zero") for what is the fold's own.
#[tokio::test]
async fn a_held_sum_that_comes_to_zero_never_blocks_its_counter_once_the_counter_is_fixed() {
    let rig = HeldRig::new("review_ledger_zero_held").await;
    assert_outcome(&rig.ledger.record("sale", "big", 8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "refused and held: {run:?}");
    assert_outcome(&rig.ledger.record("refund", "big", -8).await, "recorded");
    let run = rig.pass().await.expect("a pass");
    assert_eq!(run.backlog.held.len(), 1, "merged: {run:?}");
    assert_eq!(run.backlog.held[0].amount, "0", "{run:?}");
    rig.pass_stopped_before_its_commit().await;
    rig.pass().await.expect("the pass resumed");
    rig.fix_the_counter().await;
    assert_outcome(&rig.ledger.record("sale2", "big", 3).await, "recorded");
    rig.takes_its_events(3).await;
}

/// Finding 8 (the fold state dropped by hand). The design says dropping
/// `<events>_fold` "would fold the events still kept again". It does the
/// opposite, silently: passes are numbered from 1 again, so a counter whose
/// fold lane holds an old pass takes a new pass of the same number as
/// "counted earlier" and drops its events without a word; and the lanes
/// registered before the drop are known to no one any more, so what the
/// running recorders record on them is never surveyed, never in an exact
/// read, never in the backlog. A fold that cannot count must say so
/// (refuse, alert); it must not report a clean pass while dropping
/// recorded events, nor an exact read lie.
#[tokio::test]
async fn a_dropped_fold_state_never_drops_recorded_events_in_silence() {
    let ctx = TestContext::new("review_ledger_state_dropped").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    for i in 0..3 {
        assert_outcome(&ledger.record(format!("e{i}"), "a", 1).await, "recorded");
    }
    fold.fold(SystemTime::now(), &stop).await.expect("a pass");
    assert_eq!(counter(&direct.collection("views"), "a").await, 3);

    direct
        .collection("views_events_fold")
        .drop()
        .await
        .expect("drop the fold state");
    // The running process goes on recording on its lane; a new process
    // records on a fresh one.
    assert_outcome(&ledger.record("e3", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("e4", "a", 1).await, "recorded");
    let other = Ledger::new(&store, ledger.spec().clone());
    assert_outcome(&other.record("e5", "a", 1).await, "recorded");

    let mut refused = false;
    for _ in 0..3 {
        match fold.fold(SystemTime::now(), &stop).await {
            Ok(run) => assert!(
                run.backlog.events + run.backlog.held_events() > 0
                    || counter(&direct.collection("views"), "a").await == 6,
                "a clean pass, nothing left, nothing held, and the counter at {}: three recorded \
                 events dropped in silence ({run:?})",
                counter(&direct.collection("views"), "a").await
            ),
            Err(_) => refused = true,
        }
    }
    match ledger.value("a").await {
        Ok(exact) => assert_eq!(exact.value, 6, "an exact read is exact or refused"),
        Err(err) => assert!(refused, "the read refuses ({err}) but the fold did not"),
    }
}

/// Finding 11 (one counter stops its ledger, on the project's own test
/// server). Events whose amounts sum past 2^63 in one pass: the design
/// counts on `$sum` turning an int64 overflow into a double (real MongoDB
/// does), which sends the counter to the exact sum and holds it. The test
/// server answers the `$group` with `InternalError` instead, so the pass
/// fails, and every pass after it, for every counter of the ledger: `b`
/// is never folded. The fold's isolation of one bad counter hangs on one
/// server's `$sum`; summing as decimals (exact to 34 digits), or falling
/// back to the exact sum when the `$group` fails, would not.
#[tokio::test]
async fn amounts_summing_past_2_63_in_one_pass_never_stop_the_other_counters() {
    let ctx = TestContext::new("review_ledger_sum_overflow").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("big1", "a", i64::MAX).await, "recorded");
    assert_outcome(&ledger.record("big2", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("small", "b", 1).await, "recorded");
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    let mut last = None;
    for _ in 0..3 {
        last = Some(fold.fold(SystemTime::now(), &stop).await);
    }
    assert_eq!(
        counter(&direct.collection("views"), "b").await,
        1,
        "the other counter is folded: {last:?}"
    );
    let run = last.expect("three passes").expect("the pass holds a's sum");
    assert_eq!(run.backlog.held.len(), 1, "{run:?}");
    assert_eq!(
        run.backlog.held[0].amount,
        (i128::from(i64::MAX) + 1).to_string()
    );
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

async fn fold_all_err(fold: &EventFold) -> bool {
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .is_err()
}

async fn store_time(store: &Store) -> std::time::SystemTime {
    tally::Reconciler::new(store)
        .server_time()
        .await
        .expect("server time")
}

/// A ledger of `views` whose counters refuse to pass 5 (a validator),
/// folded through a proxy that can stop a pass before its commit.
struct HeldRig {
    ctx: TestContext,
    direct: crate::common::TestClient,
    ledger: Ledger,
    proxy: Proxy,
    fold: tally::EventFold,
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

impl HeldRig {
    async fn new(name: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let direct = ctx.client(false).await;
        direct
            .client
            .database(&ctx.db_name)
            .run_command(doc! { "create": "views", "validator": { "counter": { "$lte": 5 } } })
            .await
            .unwrap();
        let ledger = ledger_on(&direct.store(), "views").await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let fold = fold_of(&ctx.client_through(&proxy, false).await.store(), "views");
        Self {
            ctx,
            direct,
            ledger,
            proxy,
            fold,
        }
    }

    fn counters(&self) -> mongodb::Collection<mongodb::bson::Document> {
        self.direct.collection("views")
    }

    async fn pass(&self) -> Result<tally::EventsRun, tally::Error> {
        self.fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await
    }

    /// A pass stops before its commit (a daemon restarted, the network).
    async fn pass_stopped_before_its_commit(&self) {
        let _crash = self.proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("$unset")
                .then(Action::CloseBeforeForwarding),
        );
        assert!(
            self.pass().await.is_err(),
            "the pass stops before its commit"
        );
    }

    /// The validator goes: the counter takes any sum.
    async fn fix_the_counter(&self) {
        self.direct
            .client
            .database(&self.ctx.db_name)
            .run_command(doc! { "collMod": "views", "validator": {} })
            .await
            .unwrap();
    }

    /// A few passes later, the counter `big` holds `total` and nothing is
    /// held.
    async fn takes_its_events(&self, total: i64) {
        let mut run = self.pass().await.expect("a pass");
        for _ in 0..3 {
            run = self.pass().await.expect("a pass");
        }
        assert_eq!(self.ledger.value("big").await.unwrap().value, total);
        assert_eq!(
            counter(&self.counters(), "big").await,
            total,
            "the fixed counter takes its events: {run:?}"
        );
        assert!(run.backlog.held.is_empty(), "nothing is held: {run:?}");
    }
}
