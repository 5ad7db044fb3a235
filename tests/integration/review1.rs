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

/// FINDING C. A document too large for one fold statement is folded by
/// several "prefix" statements, one per stretch of the pending array, sent
/// in one unordered `update`. Their doc (statement.rs) says "they apply
/// only in order", and the model relies on it: a token repeated across
/// stretches is counted on its *last* stale entry, its earlier copies
/// removed uncounted. But statement k>1 only checks that the array from
/// offset `fresh entries kept by the earlier stretches` on equals its
/// stretch as read — it does not check that the earlier stretches applied.
/// When the first stretch shrank by exactly its number of stale entries
/// (here: one fresh entry completed by its writer — a busy document does
/// this all the time), the first statement refuses and the second applies
/// out of order. It counts token T (its last entry, `{t: T, n: 1}`, is in
/// the second stretch) and leaves T's earlier bare copy pending; the
/// re-read round (or the next run) counts T again. README: "One token,
/// one count … whatever their forms".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review1_a_token_split_across_fold_statements_is_counted_once_when_a_writer_is_busy() {
    const FRESH: usize = 160_000;
    let ctx = TestContext::new("review1_fold_chunks_out_of_order").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = stale();
    let fresh: Vec<ObjectId> = (0..FRESH).map(|_| ObjectId::new()).collect();
    let mut pending = vec![Bson::ObjectId(t)];
    pending.extend(fresh.iter().map(|f| Bson::ObjectId(*f)));
    // T's second entry (another client's `{t, n}` form), in the second
    // stretch, and one more stale token there.
    pending.push(Bson::Document(doc! { "t": t, "n": 1i64 }));
    pending.push(Bson::ObjectId(stale()));
    let document = doc! { "_id": "k", "counter": 0i64, "pending": pending };
    coll.insert_one(&document).await.unwrap();

    // Sanity: the fold writes this document with two statements.
    let reconciler = Reconciler::new(&client.store());
    let now = reconciler.server_time().await.unwrap();
    let cutoff = Token::cutoff(now - GRACE);
    let statements =
        tally::reconcile::statement::statements(&CollectionConfig::new("views"), &document, cutoff)
            .unwrap();
    assert_eq!(statements.len(), 2, "split in two stretches");

    // Hold the fold's update while a writer completes one fresh entry of
    // the first stretch.
    let fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 8000 },
    )
    .await;
    let store = client.store();
    let events = client.events.clone();
    let fold = tokio::spawn(async move {
        let reconciler = Reconciler::new(&store);
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
    wait_until(
        "the fold's update was sent",
        Duration::from_secs(30),
        || {
            let events = events.clone();
            async move { events.count("update") > 0 }
        },
    )
    .await;
    let rival = ctx.rival_store().await;
    let writer = Counters::new(
        &rival,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    let pending = writer
        .find_pending("k", Token::from_object_id(fresh[100]))
        .await
        .unwrap()
        .expect("pending");
    let completion = writer.complete(pending).await;
    assert!(
        matches!(completion, tally::Completion::Counted(_)),
        "{completion:?}"
    );

    let run = fold.await.unwrap();
    drop(fail);
    assert!(run.error.is_none(), "{:?}", run.error);
    let again = crate::common::run_reconcile(
        &client.store(),
        &target(CollectionConfig::new("views")),
        Mode::Fold,
    )
    .await;
    assert!(again.error.is_none(), "{:?}", again.error);
    // T once, the other stale token once, the completed fresh entry once.
    assert_eq!(
        exact_counter(&coll, "k").await,
        3,
        "runs: {run:?} / {again:?}"
    );
}

/// FINDING B (defaults). `attempt_timeout` and `retry_horizon` both
/// default to 60 s, and nothing relates them (check-config only asks
/// grace > horizon + attempt). A step 1 whose attempt runs out of time is
/// "a lost reply: transient, retried once" (README) — but by then the
/// token is one attempt old, i.e. at the horizon, so the retry is never
/// sent, the increment is `Unknown` already past its horizon, and `resume`
/// — the documented way to count it "exactly once … within the retry
/// horizon", which the CLI's hint says to run "soon (within the retry
/// horizon of 1m)" — refuses. When the hung request never executed (a
/// black-holed connection), the count is lost although the caller did
/// everything the API asks, at once. Scaled down here: both 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review1_a_timed_out_step_1_with_the_default_proportions_can_still_be_counted() {
    let ctx = TestContext::new("review1_timeout_at_horizon").await;
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let coll = client.collection("views");
    let attempt = Duration::from_secs(3);
    let store = client.store().with_attempt_timeout(attempt);
    let views = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig {
            retry_horizon: attempt, // the defaults: 60 s and 60 s
        },
    );
    // Step 1's first attempt hangs past the attempt bound and never
    // executes (a black-holed request).
    let fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 5000,
        "errorCode": 2 },
    )
    .await;
    let outcome = views.increment("home", 1).await;
    let unknown = match outcome {
        Increment::Unknown(unknown) => unknown,
        other => panic!("expected unknown, got {other:?}"),
    };
    let age = unknown.token().age(SystemTime::now());
    drop(fail);
    // The caller resumes at once, as told.
    let resumed = views.resume(unknown).await;
    assert!(
        matches!(resumed, Ok(Increment::Counted(_))),
        "the ticket came back {age:?} old (horizon {attempt:?}): resume gives {resumed:?}; \
         nothing was ever written: {:?}",
        coll.find_one(doc! { "_id": "home" }).await.unwrap()
    );
}
