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
            ..WriterConfig::default()
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
