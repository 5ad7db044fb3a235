//! Group commit's counting edges: one document under two key forms, a
//! refusal after an attempt that may have applied, a group's sum past the
//! int64 limit or inexact on a double counter, a ticket whose shares sum to
//! zero, a caller that panics outside a runtime — each judged against an
//! oracle outside the library: the proxy's log of what reached the server,
//! the document as the server holds it, and the sum of what the callers
//! were told. (Found by the adversarial review of group commit, issue 20:
//! each test failed on the code it reviewed unless its comment says it
//! covers a path found sound.)

mod cli;

use std::future::Future;
use std::time::Duration;

use mongodb::bson::{Bson, Decimal128, doc};
use tally::{CollectionConfig, Counters, FoldTarget, Increment, LaneIncrement, Mode, WriterConfig};

use crate::common::proxy::{Action, Rule};
use crate::common::{FailPoint, TestContext, run_reconcile, wait_until};
use crate::faults::{DELAY, Rig};

fn handle(store: &tally::Store, name: &str) -> Counters {
    Counters::try_new(store, CollectionConfig::new(name), WriterConfig::default())
        .expect("the default lane settings")
}

/// The double 0.5 and the decimal 0.5 name one document — the server finds
/// `{_id: NumberDecimal("0.5")}` in the document created as `{_id: 0.5}` —
/// but the handle queues them as two counters. So after an unknown outcome
/// on the double form, the lane is retired for that form alone: the
/// decimal form's increment goes out through the very lane whose update
/// is unknown, with a later number, and lands on the same document. The
/// unknown update can then never be settled: its resume finds the lane
/// holding the later number and answers "out of order, nothing written" —
/// the increment is lost, and the caller was promised that resuming the
/// ticket counts it once.
///
/// Should be: one queue (and one retirement) per document as the server
/// compares `_id`s, so the resume applies the update (counted).
#[tokio::test]
async fn a_double_and_a_decimal_key_naming_one_document_share_its_lanes_retirement() {
    let ctx = TestContext::new("group_decimal_key").await;
    let client = ctx.client(false).await;
    let views = handle(&client.store(), "views");
    let coll = client.collection("views");
    let double = Bson::Double(0.5);
    let decimal = Bson::Decimal128("0.5".parse::<Decimal128>().expect("a decimal"));
    assert!(matches!(
        views.add(double.clone(), 1).await,
        LaneIncrement::Counted(_)
    ));
    // The premise: one document to the server.
    let found = coll
        .find_one(doc! { "_id": decimal.clone() })
        .await
        .expect("find by the decimal key");
    assert!(
        found.is_some(),
        "the server does not find {{_id: 0.5}} by the decimal 0.5"
    );
    // Both attempts of the next update of the double form are cut before
    // the server sees them: unknown (and in truth not applied).
    let ticket = {
        let _cut = FailPoint::updates_cut(&ctx, 2).await;
        match views.add(double.clone(), 10).await {
            LaneIncrement::Unknown(ticket) => ticket,
            other => panic!("expected unknown, got {other:?}"),
        }
    };
    // Another caller counts the same document through its decimal form.
    let other = views.add(decimal.clone(), 100).await;
    assert!(matches!(other, LaneIncrement::Counted(_)), "{other:?}");
    // The promise of the ticket: resuming it counts it once.
    let resumed = views.resume_lane(ticket.clone()).await.expect("resume");
    let counter = coll
        .find_one(doc! { "_id": double.clone() })
        .await
        .expect("read")
        .expect("the document")
        .get("counter")
        .cloned();
    assert!(
        matches!(resumed, LaneIncrement::Counted(_)),
        "the unknown update of {ticket} can no longer be settled: resuming it says {resumed:?} \
         (the decimal form went out through lane {:?}, the ticket's is {}); counter {counter:?}, \
         1 + 10 + 100 = 111 expected",
        other.lane(),
        ticket.lane(),
    );
    assert_eq!(counter, Some(Bson::Int32(111)));
}

/// Two-step increment near the int64 limit: step 1's first attempt applies
/// (its reply comes after the attempt bound), and meanwhile another
/// writer's increment takes the counter so close to the limit that the
/// retry's guard refuses it. Step 1 gives up on the collision, reads the
/// counter, and reports `NotCounted` (overflow) — but the first attempt
/// left the token pending, and the fold counts it once the counter has
/// room again: told not counted, counted.
///
/// Should be: unknown (or pending) whenever an attempt may have applied —
/// the overflow refusal is definite only for a step 1 sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflow_refusal_after_an_attempt_that_may_have_applied_is_not_not_counted() {
    let rig = Rig::new("group_overflow_maybe", false).await;
    let name = "big";
    let direct = rig.direct.collection(name);
    let start = i64::MAX - 10;
    direct
        .insert_one(doc! { "_id": "k", "counter": start })
        .await
        .expect("seed the counter");
    let mine = Counters::new(
        &rig.store,
        CollectionConfig::new(name),
        WriterConfig::default(),
    );
    let rival = Counters::new(
        &rig.direct.store(),
        CollectionConfig::new(name),
        WriterConfig::default(),
    );
    let late = rig.proxy.rule(
        Rule::command("update")
            .collection(name)
            .nth(1)
            .then(Action::DelayReply(DELAY)),
    );
    let told = tokio::spawn({
        let mine = mine.clone();
        async move { mine.increment("k", 5).await }
    });
    let proxy = &rig.proxy;
    wait_until("step 1's first attempt applied", DELAY, || async {
        proxy
            .requests("update")
            .iter()
            .any(|e| e.collection.as_deref() == Some(name) && e.server_replied)
    })
    .await;
    // Another writer counts +8 before the retry: the counter is now 2 below
    // the limit.
    assert!(matches!(
        rival.increment("k", 8).await,
        Increment::Counted(_)
    ));
    let told = told.await.expect("the increment");
    drop(late);
    let pending = direct
        .find_one(doc! { "_id": "k" })
        .await
        .expect("read")
        .expect("the document")
        .get("pending")
        .cloned();
    // The counter comes down again, and the fold does its job.
    assert!(matches!(
        rival.increment("k", -100).await,
        Increment::Counted(_)
    ));
    let target = FoldTarget {
        spec: CollectionConfig::new(name),
        grace: Duration::ZERO,
        batch_size: 100,
    };
    let fold_store = rig.direct.store();
    wait_until(
        "the fold takes the pending token",
        Duration::from_secs(10),
        || {
            let (store, target, direct) = (fold_store.clone(), target.clone(), direct.clone());
            async move {
                run_reconcile(&store, &target, Mode::Fold).await;
                crate::common::pending_len(&direct, "k").await == 0
            }
        },
    )
    .await;
    let counter = crate::common::counter(&direct, "k").await;
    let counted_mine = counter - (start + 8 - 100);
    assert!(
        !matches!(told, Increment::NotCounted(_)),
        "told {told:?} while step 1's first attempt left the token pending ({pending:?}); the \
         fold then counted {counted_mine:+} of it"
    );
}

/// The pilot's update of `name`/`k` (adding `pilot`) is held up for 1.5 s;
/// the callers adding `amounts` queue behind it and leave together as the
/// next update, to which `then` happens (in order, one per attempt).
/// Returns the pilot's outcome and each caller's.
async fn group_behind_a_pilot(
    rig: &Rig,
    views: &Counters,
    name: &str,
    pilot: i64,
    amounts: &[i64],
    then: &[Action],
) -> (LaneIncrement, Vec<LaneIncrement>) {
    let mut rules = vec![
        rig.proxy.rule(
            Rule::command("update")
                .collection(name)
                .nth(1)
                .then(Action::DelayReply(Duration::from_millis(1500))),
        ),
    ];
    for (i, action) in then.iter().enumerate() {
        rules.push(
            rig.proxy.rule(
                Rule::command("update")
                    .collection(name)
                    .nth(2 + i as u64)
                    .then(action.clone()),
            ),
        );
    }
    let first = tokio::spawn({
        let views = views.clone();
        async move { views.add("k", pilot).await }
    });
    let proxy = &rig.proxy;
    wait_until("the pilot's update was sent", DELAY, || async {
        proxy
            .requests("update")
            .iter()
            .any(|e| e.collection.as_deref() == Some(name))
    })
    .await;
    let group: Vec<_> = amounts
        .iter()
        .map(|&amount| {
            let views = views.clone();
            tokio::spawn(async move { views.add("k", amount).await })
        })
        .collect();
    wait_until("the callers wait behind the pilot", DELAY, || {
        let waiting = views.lane_stats().waiting;
        async move { waiting == amounts.len() as u64 }
    })
    .await;
    let first = first.await.expect("the pilot");
    let mut told = Vec::new();
    for caller in group {
        told.push(caller.await.expect("a caller"));
    }
    drop(rules);
    (first, told)
}

/// A counter 5 below the int64 limit; two callers' increments, +3 and +10,
/// wait behind an update in flight and leave together as one update of
/// +13, which the server refuses (the sum would pass the limit). Both are
/// told `NotCounted` — also the caller whose +3 fits and that alone would
/// have been counted: whether a valid increment is refused depends on
/// which other increments happened to share its update.
///
/// Should be: a group refused for its sum (past int64, or inexact on a
/// double counter) is not the verdict on each share: the +3 is counted,
/// the +10 not (each caller told the refusal of its own amount).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_that_fits_is_not_refused_because_its_group_passes_the_int64_limit() {
    let rig = Rig::new("group_group_overflow", false).await;
    let name = "big";
    let direct = rig.direct.collection(name);
    direct
        .insert_one(doc! { "_id": "k", "counter": i64::MAX - 105 })
        .await
        .expect("seed the counter");
    let views = handle(&rig.store, name);
    let (pilot, told) = group_behind_a_pilot(&rig, &views, name, 100, &[3, 10], &[]).await;
    assert!(matches!(pilot, LaneIncrement::Counted(_)), "{pilot:?}");
    let counter = crate::common::counter(&direct, "k").await;
    assert!(
        matches!(told[0], LaneIncrement::Counted(_)) && counter == i64::MAX - 2,
        "+3 on a counter 5 below the limit: told {}, refused with its group's +13; the +10 \
         beside it: {}; the counter is {} below the limit",
        told[0].name(),
        told[1].name(),
        i64::MAX - counter
    );
    assert!(matches!(told[1], LaneIncrement::NotCounted(_)), "{told:?}");
}

/// Two callers' increments, +10 and −10, leave together as one update of
/// 0, and both its attempts are cut: unknown, with a shared ticket of
/// amount 0. The ticket cannot be rebuilt elsewhere —
/// `LaneTicket::new` refuses an amount of 0, and so does `tallyd resume
/// --by 0` — though "resuming it from any caller, any host" is the
/// promise of a shared ticket. (The library's own clone resumes fine.)
///
/// Should be: a group's ticket can be rebuilt from its parts, whatever its
/// total (or a group never sums to 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_ticket_whose_shares_sum_to_zero_can_be_rebuilt_elsewhere() {
    let rig = Rig::new("group_group_zero", false).await;
    let name = "views";
    let views = handle(&rig.store, name);
    let (_, told) = group_behind_a_pilot(
        &rig,
        &views,
        name,
        1,
        &[10, -10],
        &[Action::CloseBeforeForwarding, Action::CloseBeforeForwarding],
    )
    .await;
    let LaneIncrement::Unknown(ticket) = &told[0] else {
        panic!("expected unknown, got {told:?}");
    };
    let rebuilt = tally::LaneTicket::new(
        ticket.key().clone(),
        ticket.lane().clone(),
        ticket.position(),
        ticket.amount(),
    );
    assert!(
        rebuilt.is_ok(),
        "the shared ticket {ticket} cannot be rebuilt on another host: {rebuilt:?}"
    );
}

/// An `add` polled outside a Tokio runtime (a synchronous corner of the
/// application polling the future by hand, or another executor) panics
/// when it starts its counter's sender (`tokio::spawn`) — after its
/// increment was queued and the counter marked busy. The panic leaves both
/// behind: no sender will ever take that queue, and every later `add` of
/// the counter, from any caller on the real runtime, queues behind it and
/// waits forever (and holds a place of `queue_limit`).
///
/// Should be: a caller that fails to start its sender takes its increment
/// back (or never queues it), and the counter stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_that_panics_outside_a_runtime_does_not_strand_its_counter() {
    let ctx = TestContext::new("group_no_runtime").await;
    let client = ctx.client(false).await;
    let views = handle(&client.store(), "views");
    let outside = views.clone();
    let polled = std::thread::spawn(move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut add = std::pin::pin!(outside.add("k", 1));
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            match add.as_mut().poll(&mut context) {
                std::task::Poll::Ready(outcome) => {
                    format!("{}: {:?}", outcome.name(), outcome.cause())
                }
                std::task::Poll::Pending => "pending".to_owned(),
            }
        }))
    })
    .join()
    .expect("the thread");
    // Refused at once, nothing queued (it panicked before the fix).
    let told = polled.expect("add outside a runtime does not panic");
    assert!(
        told.starts_with("not_counted") && told.contains("Tokio runtime"),
        "{told}"
    );
    let later = tokio::time::timeout(Duration::from_secs(10), views.add("k", 2)).await;
    let stats = views.lane_stats();
    assert!(
        matches!(later, Ok(LaneIncrement::Counted(_))),
        "a later add of the same counter on the runtime: {later:?} after 10 s ({stats:?})"
    );
}

/// The same on a double counter (what the legacy shell writes) 5 below
/// 2^53, where a double still holds every integer: +3 and +10 leave as one
/// update of +13, which the filter refuses (the sum would pass 2^53 and be
/// rounded). The +3 alone fits, and is refused all the same — with a cause
/// that speaks of "+13".
///
/// Should be: the +3 counted, the +10 not counted (its own amount named).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_that_fits_is_not_refused_because_its_group_is_inexact_on_a_double_counter() {
    let rig = Rig::new("group_group_double", false).await;
    let name = "legacy";
    let direct = rig.direct.collection(name);
    let below = (1i64 << 53) - 105;
    direct
        .insert_one(doc! { "_id": "k", "counter": below as f64 })
        .await
        .expect("seed the counter");
    let views = handle(&rig.store, name);
    let (pilot, told) = group_behind_a_pilot(&rig, &views, name, 100, &[3, 10], &[]).await;
    assert!(matches!(pilot, LaneIncrement::Counted(_)), "{pilot:?}");
    let counter = crate::common::field(&direct, "k", "counter").await;
    let cause = told[0].cause().map(ToString::to_string).unwrap_or_default();
    assert!(
        matches!(told[0], LaneIncrement::Counted(_)),
        "+3 on a double counter 5 below 2^53: told {} ({cause}); the +10 beside it: {}; counter \
         {counter:?}",
        told[0].name(),
        told[1].name(),
    );
}
