//! Adversarial review 1: interleavings and faults that make tally count an
//! event twice, lose a count, or report an outcome that is false. Every
//! test here FAILS on main at 9e556ff; each names the finding it proves.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{
    CollectionConfig, Counters, FoldTarget, Increment, Mode, Reconciler, Token, WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::common::{FailPoint, TestContext, wait_until};

const GRACE: Duration = Duration::from_secs(15 * 60);

fn target(spec: CollectionConfig) -> FoldTarget {
    FoldTarget {
        spec,
        grace: GRACE,
        batch_size: 100,
    }
}

/// A token older than the grace.
fn stale() -> ObjectId {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(3600)).object_id()
}

/// The counter as an exact integer, whatever its numeric type.
async fn exact_counter(coll: &mongodb::Collection<Document>, id: &str) -> i128 {
    let found = coll.find_one(doc! { "_id": id }).await.unwrap().unwrap();
    match found.get("counter") {
        Some(Bson::Int32(n)) => i128::from(*n),
        Some(Bson::Int64(n)) => i128::from(*n),
        Some(Bson::Double(d)) => *d as i128,
        other => panic!("counter: {other:?}"),
    }
}

/// FINDING A. Step 2 adds to a double counter with `$add` whatever its
/// magnitude; from 2^53 on a double cannot hold the sum, so the increment
/// is reported `Counted` while the counter does not move (the count is
/// lost). The fold refuses exactly this case (a double counter is folded
/// only while the result stays below 2^53, README); step 2 does not — the
/// same "refuse rather than round" it applies to an int64 overflow is
/// missing for doubles. Legacy-shell counters are doubles (README).
#[tokio::test]
async fn review1_counted_on_a_double_counter_past_2_53_means_the_counter_moved() {
    let ctx = TestContext::new("review1_double_2_53").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let two_53 = 9_007_199_254_740_992.0_f64;
    coll.insert_one(doc! { "_id": "bytes", "counter": two_53 })
        .await
        .unwrap();
    // A legacy-shell counter of 0.0 given one big increment, too.
    coll.insert_one(doc! { "_id": "legacy", "counter": 0.0_f64 })
        .await
        .unwrap();
    let views = Counters::new(
        &client.store(),
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );

    let before = exact_counter(&coll, "bytes").await;
    let outcome = views.increment("bytes", 1).await;
    let after = exact_counter(&coll, "bytes").await;
    if matches!(outcome, Increment::Counted(_)) {
        assert_eq!(
            after,
            before + 1,
            "`Counted` +1, but the double counter went from {before} to {after}: the count \
             is lost"
        );
    }

    let amount: i64 = (1 << 53) + 1;
    let outcome = views.increment("legacy", amount).await;
    let after = exact_counter(&coll, "legacy").await;
    if matches!(outcome, Increment::Counted(_)) {
        assert_eq!(
            after,
            i128::from(amount),
            "`Counted` +{amount} on a legacy 0.0 counter, but it holds {after}"
        );
    }
}

/// FINDING D. The fold's statement is conditioned on the stale entries it
/// counts still being pending, but not on their tokens still having no
/// settle marker. README (Limits) promises that after a settle "the
/// token's marker makes such a late step 1 harmless until the fold prunes
/// the marker". Interleaving: the fold reads a stale pending token T (no
/// marker) and plans to count it; `complete(T)` counts T and leaves its
/// marker; the original step 1 of T, held up in the network, lands and
/// re-adds T; the fold's update — `pending: {$all: [T]}` holds again —
/// counts T a second time. The marker is still there when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review1_a_late_step_1_after_a_settle_is_not_counted_again_by_a_fold_in_flight() {
    let ctx = TestContext::new("review1_fold_marker_race").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = stale();
    // An increment whose step 2 was never confirmed, older than the grace
    // (a writer holding a `Pending` ticket: `complete` is safe at any age).
    coll.insert_one(doc! { "_id": "k", "counter": 0i64, "pending": [t] })
        .await
        .unwrap();

    // Hold the fold's first update on the server while the settle and the
    // late step 1 happen.
    let fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 1500 },
    )
    .await;
    let store = client.store();
    let events = client.events.clone();
    let fold = tokio::spawn(async move {
        let reconciler = Reconciler::new(&store);
        let now = reconciler.server_time().await.unwrap();
        reconciler
            .reconcile(
                &target(CollectionConfig::new("views")),
                Mode::Fold,
                now,
                &CancellationToken::new(),
                &mut |_| {},
            )
            .await
    });
    wait_until("the fold's update was sent", Duration::from_secs(10), || {
        let events = events.clone();
        async move { events.count("update") > 0 }
    })
    .await;

    // Another process (not held by the fail point): the writer settles its
    // pending ticket...
    let rival = ctx.rival_store().await;
    let writer = Counters::new(&rival, CollectionConfig::new("views"), WriterConfig::default());
    let pending = writer
        .find_pending("k", Token::from_object_id(t))
        .await
        .unwrap()
        .expect("pending");
    let completion = writer.complete(pending).await;
    assert!(matches!(completion, tally::Completion::Counted(_)), "{completion:?}");
    // ...and the increment's original step 1, held up in the network,
    // lands now (what `settle::a_delayed_original_step_1_…` writes too).
    rival
        .collection("views")
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": t }, "$setOnInsert": { "counter": 0i64 } },
        )
        .await
        .unwrap();
    let marker = coll.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    assert!(
        marker.get_array("settled").is_ok_and(|m| !m.is_empty()),
        "the settle's marker is there: {marker:?}"
    );

    let run = fold.await.unwrap();
    drop(fail);
    assert!(run.error.is_none(), "{:?}", run.error);
    // A later run (the marker still protects the copy) changes nothing.
    let again = crate::common::run_reconcile(
        &client.store(),
        &target(CollectionConfig::new("views")),
        Mode::Fold,
    )
    .await;
    assert!(again.error.is_none(), "{:?}", again.error);
    assert_eq!(
        exact_counter(&coll, "k").await,
        1,
        "one increment, counted by `complete`; the fold counted it again: {:?}",
        coll.find_one(doc! { "_id": "k" }).await.unwrap()
    );
}
