//! The optimistic insert loop: dense unique ids under contention, and a
//! clear error when every attempt loses.

use futures::TryStreamExt;
use futures::future::join_all;
use mongodb::bson::{Bson, doc};
use std::collections::BTreeSet;
use std::time::Duration;
use tally::{Error, InsertLoop};

use crate::common::{FailPoint, TestContext, create_unique_index};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_inserters_get_unique_dense_ids() {
    let ctx = TestContext::new("insert_loop_dense").await;
    let client = ctx.client(false).await;
    let orders = InsertLoop::new(&client.store(), "orders").max_attempts(200);
    let tasks = (0..16).map(|w| {
        let orders = orders.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for i in 0..5 {
                ids.push(orders.insert(doc! { "writer": w, "n": i }).await.unwrap());
            }
            ids
        })
    });
    let ids: Vec<i64> = join_all(tasks)
        .await
        .into_iter()
        .flat_map(|r| r.expect("task"))
        .collect();
    let unique: BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(unique.len(), 80, "duplicate ids: {ids:?}");
    assert_eq!(unique, (1..=80).collect(), "ids are not dense");
    let stored = client
        .collection("orders")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(stored, 80);
}

#[tokio::test]
async fn it_continues_after_existing_ids_of_any_numeric_type() {
    let ctx = TestContext::new("insert_loop_existing").await;
    let client = ctx.client(false).await;
    let coll = client.collection("things");
    coll.insert_many(vec![
        doc! { "_id": 3i32 },
        doc! { "_id": 41.0 },
        doc! { "_id": "not-a-number" },
        doc! { "_id": mongodb::bson::oid::ObjectId::new() },
    ])
    .await
    .unwrap();
    let things = InsertLoop::new(&client.store(), "things");
    assert_eq!(things.insert(doc! { "a": 1 }).await.unwrap(), 42);
    // Its own _id, if given, is replaced.
    assert_eq!(things.insert(doc! { "_id": 7, "a": 2 }).await.unwrap(), 43);
    let stored = coll.find_one(doc! { "_id": 43 }).await.unwrap().unwrap();
    assert_eq!(stored.get_i32("a").unwrap(), 2);
}

/// Every attempt loses a real race: our inserts are held 300 ms on the
/// server while a competing writer takes the next id every 20 ms, so the
/// id each attempt read is always gone by the time its insert runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausting_every_attempt_is_a_clear_error() {
    let ctx = TestContext::new("insert_loop_exhausted").await;
    let client = ctx.client(false).await;
    let rival_client = mongodb::Client::with_uri_str(&ctx.uri).await.unwrap();
    let rival = rival_client
        .database(&ctx.db_name)
        .collection::<mongodb::bson::Document>("things");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rival_task = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut next = 1i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // A duplicate means the id is taken already: move on either way.
                let _ = rival.insert_one(doc! { "_id": next, "rival": true }).await;
                next += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let things = InsertLoop::new(&client.store(), "things")
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let _fail = FailPoint::set(
        &ctx,
        Bson::String("alwaysOn".into()),
        doc! { "failCommands": ["insert"], "blockConnection": true, "blockTimeMS": 300 },
    )
    .await;
    client.events.clear();
    let err = things.insert(doc! { "mine": true }).await.unwrap_err();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    rival_task.await.unwrap();
    assert!(
        matches!(err, Error::InsertAttemptsExhausted { attempts: 3 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("after 3 attempts"), "{err}");
    assert_eq!(client.events.count("insert"), 3);
    let mine = client
        .collection("things")
        .count_documents(doc! { "mine": true })
        .await
        .unwrap();
    assert_eq!(mine, 0);
}

#[tokio::test]
async fn a_duplicate_on_another_unique_index_is_not_a_lost_race() {
    let ctx = TestContext::new("insert_loop_secondary_unique").await;
    let client = ctx.client(false).await;
    let coll = client.collection("things");
    create_unique_index(&coll, "sku").await;
    let things = InsertLoop::new(&client.store(), "things");
    assert_eq!(things.insert(doc! { "sku": "A" }).await.unwrap(), 1);
    client.events.clear();
    let err = things.insert(doc! { "sku": "A" }).await.unwrap_err();
    assert_eq!(
        err.class(),
        Some(tally::ErrorClass::DuplicateKey),
        "{err:?}"
    );
    assert_eq!(
        client.events.count("insert"),
        1,
        "surfaced at once, no retry"
    );
}

#[tokio::test]
async fn other_insert_errors_surface_at_once() {
    let ctx = TestContext::new("insert_loop_other_error").await;
    let client = ctx.client(false).await;
    let things = InsertLoop::new(&client.store(), "things");
    let _fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["insert"], "errorCode": 121 },
    )
    .await;
    client.events.clear();
    let err = things.insert(doc! { "a": 1 }).await.unwrap_err();
    assert_eq!(err.class(), Some(tally::ErrorClass::Command), "{err:?}");
    assert_eq!(client.events.count("insert"), 1);
}

/// Our first insert is held on the server past its attempt bound, so it
/// may have applied as far as we know; meanwhile a rival inserts the same
/// body under the id we chose. Our retry then meets a duplicate key on a
/// document equal to ours but for its token: not ours. Both inserts exist,
/// under two ids (by equal content, both callers used to get one id and one
/// insert was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_bodies_from_two_callers_get_two_ids() {
    let ctx = TestContext::new("insert_loop_identical_bodies").await;
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let ours = InsertLoop::new(
        &client.store().with_attempt_timeout(Duration::from_secs(2)),
        "orders",
    );
    let rival = InsertLoop::new(&ctx.rival_store().await, "orders");
    let (_held, mine) = ctx
        .hold_next_insert(&client.events, || {
            tokio::spawn(async move { ours.insert(doc! { "item": "tea" }).await })
        })
        .await;
    let theirs = rival.insert(doc! { "item": "tea" }).await.unwrap();
    let mine = mine.await.unwrap().unwrap();
    assert_ne!(mine, theirs, "one id for two callers");
    let stored = client
        .collection("orders")
        .count_documents(doc! { "item": "tea" })
        .await
        .unwrap();
    assert_eq!(stored, 2, "both inserts exist");
}

/// Our insert lands but both its reply and its retry's reply are lost: the
/// insert loop finds its own document by its token before trying another
/// id, instead of giving up (or inserting it a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_whose_replies_were_lost_is_found_by_its_token() {
    use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
    let ctx = TestContext::new("insert_loop_lost_replies").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let client = ctx.client_through(&proxy, false).await;
    let orders = InsertLoop::new(&client.store(), "orders");
    let _first = proxy.rule(
        Rule::command("insert")
            .collection("orders")
            .nth(1)
            .then(Action::DropReply),
    );
    let _second = proxy.rule(
        Rule::command("insert")
            .collection("orders")
            .nth(2)
            .then(Action::DropReply),
    );
    let id = orders.insert(doc! { "item": "tea" }).await.unwrap();
    let direct = ctx.client(false).await.collection("orders");
    let stored: Vec<_> = direct
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(stored.len(), 1, "inserted once: {stored:?}");
    assert_eq!(stored[0].get("_id"), Some(&Bson::Int64(id)));
    let reached = proxy
        .log()
        .iter()
        .filter(|e| e.command.as_deref() == Some("insert") && e.reached_server)
        .count();
    assert_eq!(reached, 2, "one insert and its retry, nothing more");
}

/// An insert whose write concern fails with a code that is not transient
/// is a command error (the book: design/errors.md), not a success; one with a transient code
/// is a lost reply, and the token says the document is ours.
#[tokio::test]
async fn a_write_concern_error_is_a_command_error_unless_transient() {
    let ctx = TestContext::new("insert_loop_write_concern").await;
    let client = ctx.client(false).await;
    let orders = InsertLoop::new(&client.store(), "orders");
    {
        let _fail = FailPoint::write_concern_error(&ctx, "insert", 64, "WriteConcernFailed").await;
        let err = orders.insert(doc! { "n": 1 }).await.unwrap_err();
        assert_eq!(err.class(), Some(tally::ErrorClass::Command), "{err:?}");
    }
    {
        let _fail = FailPoint::write_concern_error(&ctx, "insert", 91, "ShutdownInProgress").await;
        assert_eq!(orders.insert(doc! { "n": 2 }).await.unwrap(), 2);
    }
    let stored = client
        .collection("orders")
        .count_documents(doc! { "n": 2 })
        .await
        .unwrap();
    assert_eq!(stored, 1);
}
