//! Exact reads: a counter plus its events not folded yet, exact at any
//! moment of a fold, and equal to what the fold makes of it.
//!
//! The oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::SystemTime;

use mongodb::bson::{Bson, doc};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, event_by_hand, fold_of, ledger_on, number_of};

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

/// Finding 12 (an exact read the fold contradicts). An event written by
/// hand from the shell carries its amount as a double (`n: 2`) — the case
/// the design reads and reports. The fold sums only int32 and int64
/// amounts and leaves the double out as malformed; the exact read counts
/// it (`integer_value` takes an integral double). So `get` says 3, the
/// pass runs, and `get` says 1 with nothing new recorded: one of the two is
/// untrue.
#[tokio::test]
async fn an_exact_read_and_the_fold_agree_on_an_amount_stored_as_a_double() {
    let ctx = TestContext::new("review_ledger_double_amount").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
    let events = direct.collection("views_events");
    let first = events
        .find_one(doc! { "_id": "e1" })
        .await
        .unwrap()
        .unwrap();
    // The next number on the same lane, as the shell writes it.
    events
        .insert_one(doc! {
            "_id": "by_hand", "k": "a", "n": 2.0,
            "at": mongodb::bson::DateTime::now(),
            "L": first.get_object_id("L").unwrap(),
            "s": first.get_i64("s").unwrap() + 1,
        })
        .await
        .unwrap();
    let before = ledger.value("a").await.unwrap().value;
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    let after = ledger.value("a").await.unwrap().value;
    assert_eq!(
        before, after,
        "nothing was recorded between the two reads, yet the exact value moved"
    );
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        after,
        "the counter is what the exact read said"
    );
}

/// Every amount that is not an integer — of any type but the three every
/// accumulator skips (null, `MinKey`, a missing amount: counted as nothing,
/// and named by an exact read before the fold, not by the fold) — is left
/// out of its counter by the fold, which reports each (an exact read over it
/// names it; once folded it is left out of the read too): the pass's sums find them by the `$sum` of the amounts
/// (a double or a decimal turns it into one) and by the highest amount
/// (every other type sorts above the numbers).
#[tokio::test]
async fn every_kind_of_amount_that_is_not_an_integer_is_left_out_and_reported() {
    let ctx = TestContext::new("ledger_malformed_amounts").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    assert_outcome(&ledger.record("e1", "a", 5).await, "recorded");
    assert_outcome(&ledger.record("e2", "b", 7).await, "recorded");
    let events = direct.collection("views_events");
    let s = number_of(SystemTime::now());
    let malformed = [
        Bson::Double(2.5),
        Bson::String("3".into()),
        Bson::Boolean(true),
        Bson::Document(doc! { "n": 1 }),
        Bson::Array(vec![Bson::Int32(1)]),
        Bson::Decimal128("4".parse().unwrap()),
    ];
    for (i, amount) in (0_i64..).zip(&malformed) {
        let mut event = event_by_hand(&format!("by_hand_{i}"), "a", 0, s + i);
        event.insert("n", amount.clone());
        events.insert_one(event).await.unwrap();
    }
    assert!(
        matches!(ledger.value("a").await, Err(tally::Error::Malformed { .. })),
        "an exact read over an unfolded malformed event names it"
    );
    let run = fold_of(&store, "views")
        .fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    assert_eq!(
        run.malformed_events,
        malformed.len() as u64,
        "each malformed amount reported once"
    );
    assert_eq!(counter(&direct.collection("views"), "a").await, 5);
    assert_eq!(counter(&direct.collection("views"), "b").await, 7);
    assert_eq!(ledger.value("a").await.unwrap().value, 5);
}

/// An exact read never goes back: read again and again while a pass is
/// recorded, applied to the counter (its reply held up, so the counter has
/// the pass and the state still shows it in progress) and committed (its
/// reply held up too), every read is every event recorded so far — the
/// pass's own events counted once, by the counter or by the log, never
/// neither and never both — and an event recorded while the pass runs is
/// read at once.
#[tokio::test]
async fn an_exact_read_never_goes_back_while_a_pass_is_applied() {
    use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
    const HOLD: std::time::Duration = std::time::Duration::from_secs(2);
    let ctx = TestContext::new("ledger_read_never_back").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    assert_outcome(&ledger.record("e1", "b", 1).await, "recorded");
    fold_all(&fold).await;
    for i in 2..=20 {
        assert_outcome(&ledger.record(format!("e{i}"), "b", 1).await, "recorded");
    }
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await.store();
    let _slow_apply = proxy.rule(
        Rule::command("update")
            .collection("views")
            .then(Action::DelayReply(HOLD)),
    );
    let _slow_commit = proxy.rule(
        Rule::command("update")
            .collection("views_events_fold")
            .mentions("$unset")
            .then(Action::DelayReply(HOLD)),
    );
    let pass = tokio::spawn(async move {
        let fold = fold_of(&through, "views");
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
            .map(|run| run.events_folded)
    });
    let views = client.collection("views");
    let mut expected = 20;
    let (mut reads, mut applied_seen) = (0, false);
    while !pass.is_finished() {
        let read = ledger.value("b").await.unwrap();
        assert_eq!(read.value, expected, "{read:?} after {reads} reads");
        // The counter holds the pass while its commit is held up.
        applied_seen |= read.folded == 20;
        reads += 1;
        if reads == 5 {
            assert_outcome(&ledger.record("late", "b", 100).await, "recorded");
            expected += 100;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let folded = pass.await.unwrap().unwrap();
    assert!((19..=20).contains(&folded), "the pass folded {folded}");
    assert!(reads > 10, "only {reads} reads while the pass ran");
    assert!(applied_seen, "no read saw the counter holding the pass");
    assert_eq!(ledger.value("b").await.unwrap().value, expected);
    fold_all(&fold).await;
    assert_eq!(counter(&views, "b").await, expected);
}
