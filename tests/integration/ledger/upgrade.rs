//! A fold state of tally 0.2.0 (one entry per recorder lane) is converted
//! to a watermark — even filled to the document limit — and the fold goes
//! on by itself; one whose unfolded events interleave is refused, naming
//! what to run.

use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Document, doc};
use tally::Reconciler;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, documents, fold_all, fold_of, ledger_on, unfolded};

/// The fold state tally 0.2.0 kept grew by a lane per recorder until the
/// document limit refused every pass. Such a state — crafted here at 16 MB,
/// every event folded — is converted by the first pass (its lane map goes),
/// and the fold goes on by itself: new events are folded, nothing twice.
#[tokio::test]
async fn a_state_of_tally_0_2_0_at_the_document_limit_is_converted_and_the_fold_goes_on() {
    let ctx = TestContext::new("ledger_legacy_state").await;
    // A 16 MB document keeps the test server busy for seconds, longer under
    // load: the driver's monitor must not give the server up meanwhile
    // (its check times out after connectTimeoutMS, and clears the pool).
    let client = ctx
        .client_with_uri_options("connectTimeoutMS=120000", false)
        .await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    // Events 0.2.0 recorded an hour ago (numbered by its recorder's clock,
    // in microseconds): three on one lane folded, a fourth not yet.
    let hour_ago = old_number(3600);
    let lane = ObjectId::new();
    let events: Vec<Document> = (1..=4i64)
        .map(|s| {
            doc! { "_id": format!("old{s}"), "k": "home", "n": 1i64, "at": mongodb::bson::DateTime::now(), "L": lane, "s": hour_ago + s }
        })
        .collect();
    client
        .collection("views_events")
        .insert_many(events)
        .await
        .unwrap();
    client
        .collection("views")
        .insert_one(doc! { "_id": "home", "counter": 3i64 })
        .await
        .unwrap();
    // Its state: that lane folded to 3, and 470,000 lanes of one-shot
    // recorders whose events were deleted — 16 MB.
    let mut folded = Document::new();
    folded.insert(lane.to_hex(), hour_ago + 3);
    for _ in 0..470_000 {
        folded.insert(ObjectId::new().to_hex(), 1i64);
    }
    let state = doc! { "_id": "state", "pass": 7i64, "v": 14i64, "folded": folded };
    let bytes = state.to_vec().unwrap().len();
    assert!(bytes > 15 * 1024 * 1024, "{bytes}");
    client
        .collection("views_events_fold")
        .insert_one(state)
        .await
        .unwrap();
    assert!(
        ledger.value("home").await.is_err(),
        "an exact read refuses an unconverted state rather than count twice"
    );

    assert_outcome(&ledger.record("new1", "home", 10).await, "recorded");
    let fold = fold_of(&store, "views");
    let run = fold_all(&fold).await;
    assert_eq!(
        run.events_folded, 2,
        "the old unfolded event and the new one: {run:?}"
    );
    let state = documents(&store, "views_events_fold").await;
    assert_eq!(state.len(), 1);
    assert!(
        state[0].to_vec().unwrap().len() < 1024,
        "the converted state is small: {:?}",
        state[0]
    );
    assert_eq!(counter(&client.collection("views"), "home").await, 14);
    assert_eq!(ledger.value("home").await.unwrap().value, 14);
    assert_outcome(&ledger.record("old2", "home", 1).await, "duplicate");
    assert_outcome(&ledger.record("new2", "home", 5).await, "recorded");
    fold_all(&fold).await;
    assert_eq!(counter(&client.collection("views"), "home").await, 19);
    assert_eq!(unfolded(&fold).await, 0);
}

/// A state of tally 0.2.0 that left an event unfolded *below* one it folded
/// (its recorders' clocks disagreed) cannot be told by a watermark: it is
/// refused, naming what to run, and nothing is written.
#[tokio::test]
async fn a_state_of_tally_0_2_0_whose_unfolded_events_interleave_is_refused_naming_what_to_run() {
    let ctx = TestContext::new("ledger_legacy_unfolded").await;
    let client = ctx.client(false).await;
    let store = client.store();
    ledger_on(&store, "views").await;
    let base = old_number(3600);
    let (folded_lane, other_lane) = (ObjectId::new(), ObjectId::new());
    let events = [
        doc! { "_id": "old1", "k": "home", "n": 1i64, "L": folded_lane, "s": base + 10 },
        doc! { "_id": "old2", "k": "home", "n": 1i64, "L": other_lane, "s": base + 5 },
    ];
    client
        .collection("views_events")
        .insert_many(events)
        .await
        .unwrap();
    let state = doc! { "_id": "state", "pass": 1i64, "v": 2i64, "folded": { folded_lane.to_hex(): base + 10 } };
    client
        .collection("views_events_fold")
        .insert_one(state.clone())
        .await
        .unwrap();
    let fold = fold_of(&store, "views");
    let refused = fold
        .fold(
            Reconciler::new(&store).server_time().await.unwrap(),
            &CancellationToken::new(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("0.2.0") && refused.contains("tallyd reconcile"),
        "{refused}"
    );
    assert_eq!(documents(&store, "views_events_fold").await, vec![state]);
    assert_eq!(counter(&client.collection("views"), "home").await, 0);
}

/// A number tally 0.2.0 gave an event `seconds` ago (microseconds by its
/// recorder's clock).
fn old_number(seconds: u64) -> i64 {
    let then = std::time::SystemTime::now() - std::time::Duration::from_secs(seconds);
    let micros = then
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    i64::try_from(micros).unwrap()
}
