//! A fold state of tally 0.2.0 (one entry per recorder lane) is converted
//! to a watermark — even filled to the document limit — and the fold goes
//! on by itself; one whose unfolded events interleave is refused, naming
//! what to run.

use futures::TryStreamExt;
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

/// The version before this one kept a number watermark `W` (every event
/// numbered at or below it folded, none above) and fenced the events
/// collection with a validator refusing events numbered at or below its
/// floor; it indexed events by counter and number too. `tallyd setup`
/// removes the validator and the index nothing reads any more; the first
/// pass converts the state — a catch-up of the events numbered above `W`
/// — and every event is counted once: those it had folded are not folded
/// again, those it had not are, and the log takes over.
#[tokio::test]
async fn a_state_of_the_watermark_version_with_its_floor_is_converted_exactly_and_setup_removes_the_floor()
 {
    let ctx = TestContext::new("ledger_watermark_state").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let db = client.client.database(&ctx.db_name);
    // What that version left: three events folded (at or below W, in the
    // counter through the fold lane at pass 4), two not (above W), its
    // validator and its index by counter and number.
    let w = old_number(600);
    let lane = ObjectId::new();
    let events = [
        ("f1", "home", 1i64, w - 20),
        ("f2", "home", 2, w - 10),
        ("f3", "about", 4, w),
        ("u1", "home", 8, w + 10),
        ("u2", "about", 16, w + 20),
    ];
    let documents_of: Vec<Document> = events
        .iter()
        .map(|(id, key, n, s)| doc! { "_id": *id, "k": *key, "n": *n, "L": lane, "s": *s })
        .collect();
    client
        .collection("views_events")
        .insert_many(documents_of)
        .await
        .unwrap();
    let views = client.collection("views");
    views
        .insert_many([
            doc! { "_id": "home", "counter": 3i64, "lanes": { "fold:views_events": 4i64 } },
            doc! { "_id": "about", "counter": 4i64, "lanes": { "fold:views_events": 4i64 } },
        ])
        .await
        .unwrap();
    client
        .collection("views_events_fold")
        .insert_one(doc! {
            "_id": "state", "pass": 4i64, "v": 9i64, "W": w, "held": [],
            "floor": { "f": w, "t": "0123", "at": mongodb::bson::Timestamp { time: 1, increment: 1 } },
        })
        .await
        .unwrap();
    db.run_command(doc! {
        "collMod": "views_events",
        "validator": { "s": { "$gt": w }, "tally_floor": { "$ne": "0123" } },
    })
    .await
    .unwrap();
    client
        .collection("views_events")
        .create_index(
            mongodb::IndexModel::builder()
                .keys(doc! { "k": 1, "s": 1 })
                .options(
                    mongodb::options::IndexOptions::builder()
                        .name("tally_events_counter_number".to_owned())
                        .build(),
                )
                .build(),
        )
        .await
        .unwrap();
    assert!(
        ledger.value("home").await.is_err(),
        "an exact read refuses an unconverted state rather than guess"
    );

    // `setup` removes what that version left, and says so.
    let dir = tempfile::tempdir().unwrap();
    let config = crate::cli::write_config(dir.path(), &crate::ledger::config(&ctx, ""));
    let setup = crate::cli::tallyd(&["setup", "-c", &config], &[]).await;
    let said = crate::cli::text(&setup);
    assert_eq!(setup.status.code(), Some(0), "{said}");
    assert!(
        said.contains("tally_events_counter_number") && said.contains("dropped"),
        "{said}"
    );
    assert!(
        said.contains("validator") && said.contains("removed"),
        "{said}"
    );
    let options = db
        .list_collections()
        .filter(doc! { "name": "views_events" })
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    assert!(
        options[0]
            .options
            .validator
            .as_ref()
            .is_none_or(|v| v.is_empty()),
        "{options:?}"
    );
    let again = crate::cli::tallyd(&["setup", "-c", &config], &[]).await;
    assert!(
        !crate::cli::text(&again).contains("removed"),
        "a second setup finds nothing to remove: {}",
        crate::cli::text(&again)
    );

    // The first pass converts; an event recorded meanwhile is the log's.
    assert_outcome(&ledger.record("n1", "home", 32).await, "recorded");
    let fold = fold_of(&store, "views");
    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 3, "u1, u2 and n1: {run:?}");
    assert_eq!(counter(&views, "home").await, 1 + 2 + 8 + 32);
    assert_eq!(counter(&views, "about").await, 4 + 16);
    assert_eq!(ledger.value("home").await.unwrap().value, 43);
    let state = documents(&store, "views_events_fold").await;
    assert!(
        !state[0].contains_key("W") && !state[0].contains_key("floor"),
        "the watermark version's fields are gone: {:?}",
        state[0]
    );
    assert_outcome(&ledger.record("f1", "home", 1).await, "duplicate");
    assert_outcome(&ledger.record("n2", "about", 64).await, "recorded");
    fold_all(&fold).await;
    assert_eq!(counter(&views, "about").await, 84);
    assert_eq!(unfolded(&fold).await, 0);
}

/// A pass of the watermark version left unfinished cannot be converted:
/// its range is half applied, and only that version knows it. Refused,
/// saying what to run, nothing written.
#[tokio::test]
async fn a_pass_of_the_watermark_version_in_progress_is_refused_naming_what_to_run() {
    let ctx = TestContext::new("ledger_watermark_busy").await;
    let client = ctx.client(false).await;
    let store = client.store();
    ledger_on(&store, "views").await;
    let w = old_number(600);
    let state = doc! {
        "_id": "state", "pass": 4i64, "v": 9i64, "W": w,
        "intent": { "pass": 5i64, "from": w, "to": w + 100, "owner": ObjectId::new() },
    };
    client
        .collection("views_events_fold")
        .insert_one(state.clone())
        .await
        .unwrap();
    let refused = fold_of(&store, "views")
        .fold(
            Reconciler::new(&store).server_time().await.unwrap(),
            &CancellationToken::new(),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("earlier version") && refused.contains("in progress"),
        "{refused}"
    );
    assert_eq!(documents(&store, "views_events_fold").await, vec![state]);
}
