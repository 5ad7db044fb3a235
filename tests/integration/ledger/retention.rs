//! What the ledger leaves behind, and when it goes: the fold lane's entry
//! in each counter is a named lane, never pruned (a pass resumed a day
//! later is still a no-op where it applied); recorder lanes are sealed once
//! no insert can land on them; folded events are deleted only on sealed
//! lanes, once past the dedupe window, and never an event not folded.
//!
//! Time is moved by the `now` each step is given: the server's clock plus
//! hours or days.

use std::time::{Duration, SystemTime};

use mongodb::bson::doc;
use mongodb::bson::oid::ObjectId;
use tally::{CollectionConfig, FoldTarget, Ledger, Mode, Reconciler};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{TestContext, counter, field};
use crate::ledger::{
    assert_outcome, documents, event_by_hand, fold_of, ledger_on, number_of, unfolded,
};

const HOUR: Duration = Duration::from_secs(3600);
const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// A pass stops before its commit with every counter updated; a reconcile
/// run a day later prunes the writers' expired lanes but keeps the fold
/// lane; the pass resumed then applies nothing twice.
#[tokio::test]
async fn a_reconcile_a_day_later_prunes_writer_lanes_but_never_the_fold_lane() {
    let ctx = TestContext::new("ledger_fold_lane_kept").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 5).await, "recorded");
    // A writer lane minted two days ago, in the same counter.
    let old = SystemTime::now() - 2 * DAY;
    let secs = old
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as u32;
    let writer = ObjectId::from_parts(secs, [1; 5], [0; 3]);
    let views = client.collection("views");
    views
        .insert_one(doc! { "_id": "a", "counter": 1i64, "lanes": { writer.to_hex(): 1i64 } })
        .await
        .unwrap();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await.store();
    let fold = fold_of(&through, "views");
    {
        let _crash = proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("$unset")
                .then(Action::CloseBeforeForwarding),
        );
        let stopped = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await;
        assert!(stopped.is_err(), "{stopped:?}");
    }
    assert_eq!(counter(&views, "a").await, 6, "applied, not committed");
    assert_eq!(ledger.value("a").await.unwrap().value, 6);

    let reconciler = Reconciler::new(&store);
    let later = reconciler.server_time().await.unwrap() + DAY + HOUR;
    // A run without the ledger (another host's configuration) prunes.
    let plain = FoldTarget {
        spec: CollectionConfig::new("views"),
        grace: Duration::from_secs(900),
        batch_size: 100,
    };
    let run = reconciler
        .reconcile(
            &plain,
            Mode::Fold,
            later,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await;
    assert!(run.error.is_none(), "{run:?}");
    assert_eq!(run.lanes_pruned, 1, "the writer's lane expired: {run:?}");
    let lanes = field(&views, "a", "lanes")
        .await
        .expect("the fold lane stays");
    let lanes = lanes.as_document().unwrap();
    assert!(lanes.contains_key("fold:views_events"), "{lanes}");
    assert!(!lanes.contains_key(writer.to_hex()), "{lanes}");
    // The same fold resumes its pass: a no-op on the counter.
    fold.fold(later, &CancellationToken::new())
        .await
        .expect("resumed");
    assert_eq!(counter(&views, "a").await, 6);
    assert_eq!(ledger.value("a").await.unwrap().value, 6);
}

/// Folded events stay for the dedupe window (a repeat is a duplicate),
/// then go in bulk, dated by their numbers (the server's clock); events
/// the fold is not past never go, and the fold state holds no trace of the
/// lanes.
#[tokio::test]
async fn folded_events_are_deleted_past_the_window_and_unfolded_ones_never() {
    let ctx = TestContext::new("ledger_sweep").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let now = Reconciler::new(&store).server_time().await.unwrap();
    // Twenty events numbered ten minutes ago (well before the fold's
    // position once it folds them), as their recorder numbered them.
    let events = client.collection("views_events");
    let ten_minutes_ago = number_of(now - 10 * MINUTE);
    for i in 0..20i64 {
        let event = event_by_hand(&format!("e{i}"), "a", 1, ten_minutes_ago + i);
        events.insert_one(event).await.unwrap();
    }
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    fold.fold(now, &stop).await.unwrap();
    // Another handle records and nothing folds it (yet).
    let other = Ledger::new(&store, ledger.spec().clone());
    assert_outcome(&other.record("late", "a", 100).await, "recorded");
    // Inside the window: kept, a repeat is a duplicate.
    assert_eq!(fold.sweep(now + 6 * DAY).await.unwrap(), 0);
    assert_outcome(&ledger.record("e3", "a", 1).await, "duplicate");
    // Past it: the folded events go; the one the fold is not past stays,
    // however old.
    assert_eq!(fold.sweep(now + 8 * DAY).await.unwrap(), 20);
    let left = documents(&store, "views_events").await;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].get_str("_id").unwrap(), "late");
    let state = documents(&store, "views_events_fold").await;
    assert_eq!(
        state.len(),
        1,
        "one state document, no registrations: {state:?}"
    );
    assert!(
        !state[0].contains_key("folded"),
        "no per-lane memory: {:?}",
        state[0]
    );
    assert_eq!(counter(&client.collection("views"), "a").await, 20);
    assert_eq!(ledger.value("a").await.unwrap().value, 120);
    fold.fold(now + 8 * DAY, &stop).await.unwrap();
    assert_eq!(counter(&client.collection("views"), "a").await, 120);
    assert_eq!(unfolded(&fold).await, 0);
}
