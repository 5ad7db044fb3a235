//! The two-step increment against a real server: exact counts, and exactly
//! the outcome the book (design/two-step.md) promises when attempts fail.

use std::time::{Duration, SystemTime};

use futures::future::join_all;
use mongodb::bson::{Bson, doc, oid::ObjectId};
use tally::{
    CollectionConfig, Completion, Counters, Error, ErrorClass, Increment, Token, UnknownToken,
    WriterConfig,
};

use crate::common::server::{ServerOptions, TestServer};
use crate::common::{FailPoint, TestContext, counter, create_unique_index, pending_len};

fn counters(client: &crate::common::TestClient, name: &str) -> Counters {
    Counters::new(
        &client.store(),
        CollectionConfig::new(name),
        WriterConfig::default(),
    )
}

/// An increment whose step 2 the server refuses (error 2): pending.
async fn pending_after_a_refused_step_2(
    ctx: &TestContext,
    views: &Counters,
    key: &str,
    amount: i64,
) -> tally::PendingToken {
    let _fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "skip": 1, "times": 1 }),
        doc! { "failCommands": ["update"], "errorCode": 2 },
    )
    .await;
    match views.increment(key, amount).await {
        Increment::Pending(pending) => pending,
        other => panic!("expected pending, got {other:?}"),
    }
}

fn assert_counted(outcome: &Increment) {
    assert!(
        matches!(outcome, Increment::Counted(_)),
        "expected counted, got {outcome:?}"
    );
}

#[tokio::test]
async fn sequential_increments_are_exact() {
    let ctx = TestContext::new("sequential_increments_are_exact").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    for _ in 0..200 {
        assert_counted(&views.increment("home", 1).await);
    }
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "home").await, 200);
    assert_eq!(pending_len(&coll, "home").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_increments_on_one_key_are_exact() {
    let ctx = TestContext::new("concurrent_increments_on_one_key").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let writers = (0..16).map(|_| {
        let views = views.clone();
        tokio::spawn(async move {
            for _ in 0..40 {
                assert_counted(&views.increment("hot", 1).await);
            }
        })
    });
    for result in join_all(writers).await {
        result.expect("writer panicked");
    }
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "hot").await, 16 * 40);
    assert_eq!(pending_len(&coll, "hot").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_increments_on_many_keys_are_exact() {
    let ctx = TestContext::new("concurrent_increments_on_many_keys").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    // Writer w adds w+1 to keys (w + i) % 10, so every key gets a known sum.
    let writers = (0..16i64).map(|w| {
        let views = views.clone();
        tokio::spawn(async move {
            for i in 0..30i64 {
                let key = format!("k{}", (w + i) % 10);
                assert_counted(&views.increment(key, w + 1).await);
            }
        })
    });
    for result in join_all(writers).await {
        result.expect("writer panicked");
    }
    let coll = client.collection("views");
    for k in 0..10i64 {
        let expected: i64 = (0..16i64)
            .flat_map(|w| {
                (0..30i64)
                    .filter(move |i| (w + i) % 10 == k)
                    .map(move |_| w + 1)
            })
            .sum();
        assert_eq!(counter(&coll, format!("k{k}")).await, expected, "key k{k}");
        assert_eq!(pending_len(&coll, format!("k{k}")).await, 0);
    }
}

#[tokio::test]
async fn plus_n_entries_and_negative_amounts() {
    let ctx = TestContext::new("plus_n_entries").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    assert_counted(&views.increment("k", 5).await);
    assert_counted(&views.increment("k", -2).await);
    assert_counted(&views.increment("k", 1).await);
    assert!(matches!(
        views.increment("k", 0).await,
        Increment::NotCounted(_)
    ));
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "k").await, 4);
    // New counters start as int64, the documented shape.
    let doc = coll.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    assert!(
        matches!(doc.get("counter"), Some(Bson::Int64(4))),
        "{doc:?}"
    );
}

#[tokio::test]
async fn custom_field_names() {
    let ctx = TestContext::new("custom_field_names").await;
    let client = ctx.client(false).await;
    let spec = CollectionConfig::new("hits").with_fields("total", "inflight");
    let hits = Counters::new(&client.store(), spec, WriterConfig::default());
    assert_counted(&hits.increment("k", 3).await);
    let doc = client
        .collection("hits")
        .find_one(doc! { "_id": "k" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_i64("total").unwrap(), 3);
    assert!(
        !doc.contains_key("inflight"),
        "no empty pending array is left"
    );
    assert!(!doc.contains_key("counter") && !doc.contains_key("pending"));
}

/// `closeConnection` on step 1 (or step 2): exactly one retry, counted once —
/// made by tally with retryable writes off, by the driver with them on.
async fn one_lost_connection(name: &str, retry_writes: bool, skip: i32, op: &str) {
    let ctx = TestContext::new(name).await;
    let client = ctx.client(retry_writes).await;
    let views = counters(&client, "views");
    assert_counted(&views.increment("warmup", 1).await);
    client.events.clear();
    let _fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "skip": skip, "times": 1 }),
        doc! { "failCommands": ["update"], "closeConnection": true },
    )
    .await;
    assert_counted(&views.increment("k", 1).await);
    assert_eq!(
        client.events.updates_with(op),
        2,
        "{op} must be sent exactly twice"
    );
    assert_eq!(client.events.count("update"), 3, "one retry in all");
    let coll = client.collection("views");
    assert_eq!(counter(&coll, "k").await, 1);
    assert_eq!(pending_len(&coll, "k").await, 0);
}

#[tokio::test]
async fn lost_connection_on_step1_retried_once_without_retryable_writes() {
    one_lost_connection("lost_step1_rw_off", false, 0, "$addToSet").await;
}

#[tokio::test]
async fn lost_connection_on_step1_retried_once_with_retryable_writes() {
    one_lost_connection("lost_step1_rw_on", true, 0, "$addToSet").await;
}

#[tokio::test]
async fn lost_connection_on_step2_retried_once_without_retryable_writes() {
    one_lost_connection("lost_step2_rw_off", false, 1, "pipeline").await;
}

#[tokio::test]
async fn lost_connection_on_step2_retried_once_with_retryable_writes() {
    one_lost_connection("lost_step2_rw_on", true, 1, "pipeline").await;
}

#[tokio::test]
async fn command_error_on_step1_is_not_counted_after_one_attempt() {
    let ctx = TestContext::new("command_error_step1").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    assert_counted(&views.increment("warmup", 1).await);
    client.events.clear();
    let _fail = FailPoint::update_refused(&ctx).await;
    let outcome = views.increment("k", 1).await;
    let Increment::NotCounted(not) = &outcome else {
        panic!("expected not counted, got {outcome:?}");
    };
    assert_eq!(not.cause().class(), Some(ErrorClass::Command));
    assert_eq!(
        client.events.count("update"),
        1,
        "a command error is never retried"
    );
    assert!(
        client
            .collection("views")
            .find_one(doc! { "_id": "k" })
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn command_error_on_step2_is_pending_then_complete_counts_once() {
    let ctx = TestContext::new("command_error_step2").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let coll = client.collection("views");
    let pending = pending_after_a_refused_step_2(&ctx, &views, "k", 1).await;
    assert_eq!(
        client.events.updates_with("pipeline"),
        1,
        "a command error is never retried"
    );
    assert_eq!(
        pending_len(&coll, "k").await,
        1,
        "the token is in the document"
    );
    assert_eq!(counter(&coll, "k").await, 0);

    let token = pending.token();
    let Completion::Counted(first) = views.complete(pending).await else {
        panic!("complete must count");
    };
    assert!(!first.settled_earlier());
    // Settling it again — the ticket rebuilt elsewhere — counts nothing more.
    assert!(views.find_pending("k", token).await.unwrap().is_none());
    let again = UnknownToken::new("k", token, 1).unwrap();
    let Increment::Counted(second) = views.resume(again).await.expect("resume") else {
        panic!("a second settle must report counted");
    };
    assert!(second.settled_earlier());
    assert_eq!(counter(&coll, "k").await, 1);
    assert_eq!(pending_len(&coll, "k").await, 0);
}

#[tokio::test]
async fn two_lost_connections_on_step1_are_unknown_and_resume_counts_once() {
    for retry_writes in [false, true] {
        let ctx = TestContext::new(&format!("two_lost_step1_rw_{retry_writes}")).await;
        let client = ctx.client(retry_writes).await;
        let views = counters(&client, "views");
        assert_counted(&views.increment("warmup", 1).await);
        client.events.clear();
        let unknown = {
            let _fail = FailPoint::updates_cut(&ctx, 2).await;
            match views.increment("k", 1).await {
                Increment::Unknown(unknown) => unknown,
                other => panic!("expected unknown, got {other:?}"),
            }
        };
        assert_eq!(
            client.events.updates_with("$addToSet"),
            2,
            "one retry, then give up"
        );
        assert_eq!(
            client.events.updates_with("pipeline"),
            0,
            "step 2 was never sent"
        );
        // The lost attempts never reached the server: resume sends both steps.
        let outcome = views.resume(unknown).await.expect("resume");
        assert_counted(&outcome);
        let coll = client.collection("views");
        assert_eq!(counter(&coll, "k").await, 1, "retry_writes={retry_writes}");
        assert_eq!(pending_len(&coll, "k").await, 0);
    }
}

#[tokio::test]
async fn unknown_whose_attempt_reached_the_server_resumes_to_counted_once() {
    for retry_writes in [false, true] {
        let ctx = TestContext::new(&format!("unknown_reached_rw_{retry_writes}")).await;
        let client = ctx.client(retry_writes).await;
        let views = counters(&client, "views");
        assert_counted(&views.increment("warmup", 1).await);
        // The write applies, then its write concern fails with a transient
        // code: as good as a lost reply. No error label, so the driver does
        // not retry it itself (the test server would answer a driver retry
        // from its de-duplication record, without the fail point): tally's
        // own retry is a new write and fails the same way.
        let unknown = {
            let _fail = FailPoint::set(
                &ctx,
                Bson::Document(doc! { "times": 2 }),
                doc! {
                    "failCommands": ["update"],
                    "writeConcernError": { "code": 91, "codeName": "ShutdownInProgress", "errmsg": "x" },
                    "errorLabels": [],
                },
            )
            .await;
            match views.increment("k", 1).await {
                Increment::Unknown(unknown) => unknown,
                other => panic!("expected unknown, got {other:?}"),
            }
        };
        let coll = client.collection("views");
        assert_eq!(pending_len(&coll, "k").await, 1, "the lost attempt applied");
        client.events.clear();
        assert_counted(&views.resume(unknown).await.expect("resume"));
        assert_eq!(
            client.events.updates_with("$addToSet"),
            0,
            "step 1 is not re-sent"
        );
        assert_eq!(counter(&coll, "k").await, 1, "retry_writes={retry_writes}");
        assert_eq!(pending_len(&coll, "k").await, 0);
    }
}

#[tokio::test]
async fn resume_past_the_horizon_refuses_and_writes_nothing() {
    let ctx = TestContext::new("resume_past_horizon").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let old = Token::created_at_time(SystemTime::now() - Duration::from_secs(600));
    let unknown = UnknownToken::new("k", old, 1).unwrap();
    client.events.clear();
    let err = views.resume(unknown).await.expect_err("must refuse");
    assert!(matches!(err, Error::RetryHorizonExceeded { .. }), "{err}");
    assert!(err.to_string().contains("at most once"), "{err}");
    assert_eq!(client.events.count("update"), 0, "nothing was written");
    assert!(
        client
            .collection("views")
            .find_one(doc! { "_id": "k" })
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn resume_past_the_horizon_still_completes_a_token_that_is_there() {
    let ctx = TestContext::new("resume_old_token_present").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let coll = client.collection("views");
    let old = Token::created_at_time(SystemTime::now() - Duration::from_secs(600));
    coll.insert_one(
        doc! { "_id": "k", "counter": 10i64, "pending": [{ "t": old.object_id(), "n": 3i64 }] },
    )
    .await
    .unwrap();
    // Given another amount than the document holds, it is refused, and
    // nothing is written.
    let before = coll.find_one(doc! { "_id": "k" }).await.unwrap();
    let wrong = UnknownToken::new("k", old, 1).unwrap();
    let err = views.resume(wrong).await.expect_err("must refuse");
    assert!(
        matches!(
            &err,
            Error::AmountMismatch {
                stored: 3,
                given: 1,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(coll.find_one(doc! { "_id": "k" }).await.unwrap(), before);
    let unknown = UnknownToken::new("k", old, 3).unwrap();
    assert_counted(&views.resume(unknown).await.expect("resume"));
    assert_eq!(counter(&coll, "k").await, 13);
    assert_eq!(pending_len(&coll, "k").await, 0);
}

#[tokio::test]
async fn bare_tokens_written_by_other_clients_are_completed() {
    let ctx = TestContext::new("bare_tokens_other_clients").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let coll = client.collection("views");
    let theirs = ObjectId::new();
    // Another client of the technique: step 1 only, bare ObjectId, int32 counter.
    coll.update_one(
        doc! { "_id": "k" },
        doc! { "$set": { "counter": 7i32 }, "$addToSet": { "pending": theirs } },
    )
    .upsert(true)
    .await
    .unwrap();
    let pending = views
        .find_pending("k", Token::from_object_id(theirs))
        .await
        .unwrap()
        .expect("the token is pending");
    assert_eq!(pending.amount(), 1);
    assert!(matches!(
        views.complete(pending).await,
        Completion::Counted(_)
    ));
    let doc = coll.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    assert_eq!(
        doc.get("counter"),
        Some(&Bson::Int32(8)),
        "an int32 counter stays int32"
    );
    assert_eq!(pending_len(&coll, "k").await, 0);
    assert!(
        views
            .find_pending("k", Token::from_object_id(theirs))
            .await
            .unwrap()
            .is_none()
    );
}

/// A standalone server has no retryable writes even when the URI asks for
/// them: tally must make the one retry itself.
#[tokio::test]
async fn on_a_standalone_server_tally_makes_the_retry_itself() {
    if crate::common::external() {
        return; // the external deployment is what it is
    }
    let server = TestServer::start(&ServerOptions {
        standalone: true,
        ..Default::default()
    });
    let ctx = TestContext::on("standalone_retry", server.uri()).await;
    let client = ctx.client(true).await;
    let views = counters(&client, "views");
    assert_counted(&views.increment("warmup", 1).await);
    client.events.clear();
    let _fail = FailPoint::updates_cut(&ctx, 1).await;
    assert_counted(&views.increment("k", 1).await);
    assert_eq!(client.events.updates_with("$addToSet"), 2);
    assert_eq!(counter(&client.collection("views"), "k").await, 1);
}

/// A reply that does not come within the attempt timeout is abandoned as a
/// lost reply and retried once. (Step 2 is conditioned on the token, so the
/// abandoned attempt cannot count twice when it runs late.) The bound must
/// exceed server selection (here 1 s).
#[tokio::test]
async fn an_attempt_past_the_timeout_is_abandoned_and_retried() {
    let ctx = TestContext::new("attempt_timeout").await;
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let store = client.store().with_attempt_timeout(Duration::from_secs(2));
    assert_eq!(store.attempt_timeout(), Duration::from_secs(2));
    let views = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    assert_counted(&views.increment("warmup", 1).await);
    client.events.clear();
    let _fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "skip": 1, "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 4000 },
    )
    .await;
    assert_counted(&views.increment("k", 1).await);
    assert_eq!(
        client.events.updates_with("pipeline"),
        2,
        "abandoned once, then retried"
    );
    assert_eq!(counter(&client.collection("views"), "k").await, 1);
}

/// An upsert that collides on another unique index is not a race for the
/// counter's `_id`: no retry can fix it, so it is not counted, at once.
#[tokio::test]
async fn a_duplicate_on_another_unique_index_is_not_counted_without_retries() {
    let ctx = TestContext::new("increment_secondary_unique").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    create_unique_index(&coll, "region").await;
    // A document without `region` already holds the index's null key.
    coll.insert_one(doc! { "_id": "other", "counter": 1 })
        .await
        .unwrap();
    let views = counters(&client, "views");
    client.events.clear();
    let outcome = views.increment("new", 1).await;
    let Increment::NotCounted(not) = &outcome else {
        panic!("expected not counted, got {outcome:?}");
    };
    assert_eq!(not.cause().class(), Some(ErrorClass::DuplicateKey));
    assert_eq!(client.events.count("update"), 1);
}

/// Every write tally makes asks for `w: "majority"`, whatever the URI says:
/// with `w: 1` a step 1 a failover rolls back could still be "counted".
#[tokio::test]
async fn every_write_uses_write_concern_majority_even_when_the_uri_says_w1() {
    let ctx = TestContext::new("write_concern_majority").await;
    let client = ctx.client_with_uri_options("w=1", false).await;
    assert_eq!(
        client
            .options
            .write_concern
            .as_ref()
            .and_then(|wc| wc.w.clone()),
        Some(mongodb::options::Acknowledgment::Nodes(1)),
        "the URI asks for w: 1"
    );
    let store = client.store();
    let views = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    assert_counted(&views.increment("k", 1).await);
    let sequences = tally::Sequences::new(&store, &tally::SequenceConfig::default());
    assert_eq!(sequences.next("orders").await.unwrap(), 1);
    let seats = tally::BoundedCounters::new(&store, tally::BoundedConfig::new("seats"));
    assert!(seats.create("show", 2).await.unwrap());
    assert_eq!(
        seats.take("show", Token::new(), "ann").await.unwrap(),
        tally::Take::Taken
    );
    let id = tally::InsertLoop::new(&store, "orders")
        .insert(doc! { "a": 1 })
        .await
        .unwrap();
    assert_eq!(id, 1);
    // The fold's batch command goes through `run_command`.
    fold_one_stale_token(&ctx, &store).await;

    let writes: Vec<_> = client
        .events
        .sent()
        .into_iter()
        .filter(|s| ["insert", "update", "findAndModify", "delete"].contains(&s.name.as_str()))
        .collect();
    let count = |name: &str| writes.iter().filter(|s| s.name == name).count();
    // Step 1, step 2, the take, the fold; the sequence's and the bounded
    // counter's create and the insert loop's insert; the sequence's `next`.
    assert!(count("update") >= 4, "{writes:?}");
    assert!(count("insert") >= 3, "{writes:?}");
    assert!(count("findAndModify") >= 1, "{writes:?}");
    for sent in &writes {
        assert_eq!(
            sent.write_concern,
            Some(doc! { "w": "majority" }),
            "{} sent another write concern",
            sent.name
        );
    }
}

/// Writes a stale token into `views` document `f` (directly) and folds it
/// through `store`.
async fn fold_one_stale_token(ctx: &TestContext, store: &tally::Store) {
    let stale = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    ctx.client(false)
        .await
        .collection("views")
        .update_one(
            doc! { "_id": "f" },
            doc! { "$set": { "counter": 1i64, "pending": [stale.object_id()] } },
        )
        .upsert(true)
        .await
        .unwrap();
    let target = tally::FoldTarget {
        spec: CollectionConfig::new("views"),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    let run = crate::common::run_reconcile(store, &target, tally::Mode::Fold).await;
    assert_eq!(
        (
            run.error.as_ref().map(ToString::to_string),
            run.tokens_folded
        ),
        (None, 1)
    );
}

/// A server nobody answers is an outage, not a lost reply: the increment is
/// not counted (class command) after one attempt — also when the attempt
/// bound is configured shorter than server selection (the old defaults made
/// them equal, 30 s each, and the first to fire won).
#[tokio::test]
async fn a_server_selection_timeout_is_not_counted_after_one_attempt() {
    let address = crate::common::tallyd::free_address();
    let mut config = tally::StoreConfig::new(
        format!("mongodb://{address}/?directConnection=true&retryWrites=false"),
        "d",
    );
    config.server_selection_timeout = Duration::from_secs(1);
    config.attempt_timeout = Duration::from_millis(800);
    let store = tally::Store::connect(&config).await.unwrap();
    assert!(
        store.attempt_timeout() > Duration::from_secs(1),
        "raised above selection: {:?}",
        store.attempt_timeout()
    );
    let views = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    let outcome = views.increment("k", 1).await;
    let Increment::NotCounted(not) = &outcome else {
        panic!("expected not counted, got {outcome:?}");
    };
    let Error::Server(failure) = not.cause() else {
        panic!("expected a server failure, got {:?}", not.cause());
    };
    assert_eq!(failure.class, ErrorClass::Command, "{failure}");
    assert_eq!(failure.attempts, 1, "{failure}");
}

/// Step 2 takes the pending field away with its last entry (so a sparse
/// index, and the fold's report, skip counters with nothing pending), counts
/// a token once however many copies the array holds, and changes a
/// counter's type only where `$inc` would: int32 stays int32, int64 stays
/// int64, a missing counter starts as int64, and an int64 that would
/// overflow is refused (pending) rather than turned into a double.
#[tokio::test]
async fn step_2_leaves_no_pending_field_and_keeps_the_counter_type() {
    let ctx = TestContext::new("step2_no_empty_array").await;
    let client = ctx.client(false).await;
    let views = counters(&client, "views");
    let coll = client.collection("views");
    for i in 0..30 {
        assert_counted(&views.increment(format!("k{}", i % 3), 1 + i % 2).await);
    }
    let pending = pending_after_a_refused_step_2(&ctx, &views, "k0", 5).await;
    assert!(matches!(
        views.complete(pending).await,
        Completion::Counted(_)
    ));
    assert_eq!(
        coll.count_documents(doc! { "pending": { "$exists": true } })
            .await
            .unwrap(),
        0,
        "no counter keeps an empty pending array"
    );
    assert_eq!(counter(&coll, "k0").await, 15 + 5);

    let tokens: Vec<ObjectId> = (0..5).map(|_| ObjectId::new()).collect();
    coll.insert_many([
        doc! { "_id": "int32", "counter": 7i32, "pending": [tokens[0]] },
        doc! { "_id": "int64", "counter": 7i64, "pending": [tokens[1]] },
        doc! { "_id": "missing", "pending": [{ "t": tokens[2], "n": 4i64 }] },
        doc! { "_id": "copies", "counter": 1i64, "pending": [tokens[3], tokens[3], { "t": tokens[3], "n": 1 }] },
        doc! { "_id": "max", "counter": i64::MAX, "pending": [tokens[4]] },
    ])
    .await
    .unwrap();
    for (key, token) in ["int32", "int64", "missing", "copies"]
        .into_iter()
        .zip(&tokens)
    {
        let pending = views
            .find_pending(key, Token::from_object_id(*token))
            .await
            .unwrap()
            .expect("pending");
        assert!(
            matches!(views.complete(pending).await, Completion::Counted(_)),
            "{key}"
        );
    }
    // What the counter and pending fields hold (`complete` also leaves a
    // marker in `settled`).
    let found = |key: &'static str| {
        let coll = coll.clone();
        async move {
            let mut found = coll.find_one(doc! { "_id": key }).await.unwrap().unwrap();
            found.remove("settled");
            found
        }
    };
    assert_eq!(
        found("int32").await,
        doc! { "_id": "int32", "counter": 8i32 }
    );
    assert_eq!(
        found("int64").await,
        doc! { "_id": "int64", "counter": 8i64 }
    );
    assert_eq!(
        found("missing").await,
        doc! { "_id": "missing", "counter": 4i64 }
    );
    assert_eq!(
        found("copies").await,
        doc! { "_id": "copies", "counter": 2i64 }
    );
    assert_eq!(
        crate::common::field(&coll, "copies", "settled").await,
        Some(Bson::Array(vec![Bson::Document(
            doc! { "t": tokens[3], "n": 1i64 }
        )])),
        "one marker for the token counted once"
    );

    let before = found("max").await;
    let pending = views
        .find_pending("max", Token::from_object_id(tokens[4]))
        .await
        .unwrap()
        .expect("pending");
    assert!(
        matches!(views.complete(pending).await, Completion::Pending(_)),
        "an overflow is refused"
    );
    assert_eq!(found("max").await, before, "and nothing was written");
}

/// The library refuses nothing it can make safe: a retry horizon below the
/// 2 s minimum (a token's time has one-second resolution) is raised to it,
/// instead of every increment failing with `RetryHorizonExceeded`.
#[tokio::test]
async fn a_retry_horizon_below_the_minimum_is_raised_to_it() {
    let ctx = TestContext::new("retry_horizon_clamped").await;
    let client = ctx.client(false).await;
    let views = Counters::new(
        &client.store(),
        CollectionConfig::new("views"),
        WriterConfig {
            retry_horizon: Duration::ZERO,
            ..WriterConfig::default()
        },
    );
    assert_counted(&views.increment("k", 1).await);
    assert_eq!(counter(&client.collection("views"), "k").await, 1);
}

/// `Counted` on a double counter means the counter moved by exactly the
/// amount: step 2 applies to a double only while it and the sum are
/// integers of magnitude below 2^53 — the fold's rule — and stays pending,
/// writing nothing, otherwise (from 2^53 on a double cannot hold the sum,
/// and the count would be rounded away; legacy-shell counters are
/// doubles). Found by the adversarial review of issue 11 (finding A).
#[tokio::test]
async fn a_double_counter_is_counted_only_while_it_stays_below_2_53() {
    let ctx = TestContext::new("double_counter_2_53").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let two_53 = (1i64 << 53) as f64;
    coll.insert_many([
        doc! { "_id": "at_2_53", "counter": two_53 },
        doc! { "_id": "legacy", "counter": 0.0 },
        doc! { "_id": "fraction", "counter": 10.5 },
        doc! { "_id": "below", "counter": two_53 - 2.0 },
    ])
    .await
    .unwrap();
    let views = counters(&client, "views");
    let value = |key: &'static str| {
        let coll = coll.clone();
        async move { crate::common::field(&coll, key, "counter").await }
    };

    // (key, amount): each would leave the exact range, or starts outside it.
    for (key, amount) in [
        ("at_2_53", 1),
        ("legacy", (1i64 << 53) + 1),
        ("legacy", 1i64 << 53),
        ("fraction", 1),
        ("below", 2),
    ] {
        let before = value(key).await;
        let outcome = views.increment(key, amount).await;
        assert!(
            matches!(outcome, Increment::Pending(_)),
            "{key} {amount:+}: {outcome:?}"
        );
        assert_eq!(
            value(key).await,
            before,
            "{key} {amount:+}: the counter moved"
        );
    }
    // Inside the range a double counter counts exactly, and stays a double.
    assert_counted(&views.increment("below", 1).await);
    assert_eq!(value("below").await, Some(Bson::Double(two_53 - 1.0)));
    assert_counted(&views.increment("legacy", 5).await);
    assert_eq!(value("legacy").await, Some(Bson::Double(5.0)));
}

/// A step 1 whose attempt runs out of time is retried — the retry horizon
/// is always at least two attempts — so it is counted exactly once, or
/// comes back `Unknown` young enough to resume. Found by the adversarial
/// review of issue 11 (finding B): with the defaults of then (both 60 s,
/// here scaled to 3 s) the token was at the horizon when its attempt timed
/// out, so the retry was never sent and `resume` refused: a black-holed
/// request lost the count although the caller did what the API asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_step_1_is_retried_or_resumed_when_the_horizon_is_one_attempt() {
    let ctx = TestContext::new("timeout_at_horizon").await;
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let attempt = Duration::from_secs(3);
    let store = client.store().with_attempt_timeout(attempt);
    let views = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig {
            retry_horizon: attempt,
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
    drop(fail);
    let outcome = match outcome {
        Increment::Unknown(unknown) => {
            let age = unknown.token().age(SystemTime::now());
            // The caller resumes at once, as told.
            views
                .resume(unknown)
                .await
                .unwrap_or_else(|err| panic!("resume of a ticket {age:?} old: {err}"))
        }
        other => other,
    };
    assert_counted(&outcome);
    assert_eq!(counter(&client.collection("views"), "home").await, 1);
}

/// Every read tally makes goes to the primary, also when the URI prefers
/// secondaries: a lagging secondary could miss a settle marker a `resume`
/// must see, or show a value older than a `Counted` the caller was given.
/// (On a direct connection the driver sends `primary` as
/// `primaryPreferred`, which a single node serves alike.)
#[tokio::test]
async fn reads_go_to_the_primary_even_when_the_uri_prefers_secondaries() {
    let ctx = TestContext::new("reads_primary").await;
    let client = ctx
        .client_with_uri_options("readPreference=secondaryPreferred", false)
        .await;
    let store = client.store();
    let views = counters(&client, "views");
    assert_counted(&views.increment("k", 1).await);
    assert_eq!(views.value("k").await.unwrap(), Some(Bson::Int64(1)));
    let unknown = UnknownToken::new("k", Token::new(), 1).unwrap();
    assert_counted(&views.resume(unknown).await.unwrap());
    let seats = tally::BoundedCounters::new(&store, tally::BoundedConfig::new("seats"));
    assert!(seats.create("show", 2).await.unwrap());
    assert_eq!(seats.available("show").await.unwrap(), Some(2));
    fold_one_stale_token(&ctx, &store).await;

    let reads: Vec<_> = client
        .events
        .sent()
        .into_iter()
        .filter(|s| ["find", "aggregate", "count", "distinct"].contains(&s.name.as_str()))
        .collect();
    // The value, the resume's lookup, the available units, the fold's reads.
    assert!(reads.len() >= 4, "{reads:?}");
    for sent in &reads {
        assert!(
            matches!(
                sent.read_preference.as_deref(),
                None | Some("primary" | "primaryPreferred")
            ),
            "{} was sent with read preference {:?}",
            sent.name,
            sent.read_preference
        );
    }
}
