//! Bounded counters: never more taken than there is, a retried take
//! recognised by its token, give-backs counted once.

use std::time::Duration;

use futures::future::join_all;
use mongodb::bson::doc;
use tally::{BoundedConfig, BoundedCounters, GiveBack, Take, Token};

use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{FailPoint, TestContext};

fn seats(client: &crate::common::TestClient) -> BoundedCounters {
    BoundedCounters::new(&client.store(), BoundedConfig::new("seats"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_takers_on_ten_units_take_exactly_ten() {
    let ctx = TestContext::new("bounded_sixteen_takers").await;
    let client = ctx.client(false).await;
    let seats = seats(&client);
    assert!(seats.create("show", 10).await.unwrap());
    assert!(
        !seats.create("show", 99).await.unwrap(),
        "create does not overwrite"
    );
    let tasks = (0..16).map(|i| {
        let seats = seats.clone();
        tokio::spawn(async move { seats.take("show", Token::new(), format!("user{i}")).await })
    });
    let outcomes: Vec<Take> = join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.expect("task").expect("take"))
        .collect();
    assert_eq!(outcomes.iter().filter(|o| **o == Take::Taken).count(), 10);
    assert_eq!(outcomes.iter().filter(|o| **o == Take::NoneLeft).count(), 6);
    let doc = client
        .collection("seats")
        .find_one(doc! { "_id": "show" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_i64("available").unwrap(), 0);
    assert_eq!(doc.get_array("holders").unwrap().len(), 10);
    assert_eq!(
        seats.take("nope", Token::new(), "x").await.unwrap(),
        Take::NotFound
    );
}

#[tokio::test]
async fn a_take_retried_with_its_token_never_takes_twice() {
    let ctx = TestContext::new("bounded_retried_take").await;
    let client = ctx.client(false).await;
    let seats = seats(&client);
    seats.create("show", 3).await.unwrap();
    let token = Token::new();
    {
        // The connection drops on the first attempt; tally retries it once.
        let _fail = FailPoint::updates_cut(&ctx, 1).await;
        assert_eq!(seats.take("show", token, "ann").await.unwrap(), Take::Taken);
    }
    // The caller, unsure, sends the same take again.
    assert_eq!(
        seats.take("show", token, "ann").await.unwrap(),
        Take::AlreadyTaken
    );
    assert_eq!(seats.available("show").await.unwrap(), Some(2));
    let doc = client
        .collection("seats")
        .find_one(doc! { "_id": "show" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_array("holders").unwrap().len(), 1);
}

#[tokio::test]
async fn give_back_twice_returns_once() {
    let ctx = TestContext::new("bounded_give_back").await;
    let client = ctx.client(false).await;
    let seats = seats(&client);
    seats.create("show", 1).await.unwrap();
    let token = Token::new();
    assert_eq!(seats.take("show", token, "bo").await.unwrap(), Take::Taken);
    assert_eq!(
        seats.take("show", Token::new(), "cy").await.unwrap(),
        Take::NoneLeft
    );
    assert_eq!(
        seats.give_back("show", token).await.unwrap(),
        GiveBack::Returned
    );
    assert_eq!(
        seats.give_back("show", token).await.unwrap(),
        GiveBack::NotHeld
    );
    assert_eq!(seats.available("show").await.unwrap(), Some(1));
    assert_eq!(
        seats.give_back("show", Token::new()).await.unwrap(),
        GiveBack::NotHeld
    );
    // The unit given back can be taken again.
    assert_eq!(
        seats.take("show", Token::new(), "cy").await.unwrap(),
        Take::Taken
    );
}

#[tokio::test]
async fn custom_field_names_and_malformed_documents() {
    let ctx = TestContext::new("bounded_custom_fields").await;
    let client = ctx.client(false).await;
    let copies = BoundedCounters::new(
        &client.store(),
        BoundedConfig::new("books").with_fields("copies", "checkout"),
    );
    copies.create("dune", 2).await.unwrap();
    assert_eq!(
        copies.take("dune", Token::new(), "ann").await.unwrap(),
        Take::Taken
    );
    let doc = client
        .collection("books")
        .find_one(doc! { "_id": "dune" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(doc.get_i64("copies").unwrap(), 1);
    assert_eq!(doc.get_array("checkout").unwrap().len(), 1);

    client
        .collection("books")
        .insert_one(doc! { "_id": "odd", "copies": "many", "checkout": [] })
        .await
        .unwrap();
    let err = copies.take("odd", Token::new(), "ann").await.unwrap_err();
    assert!(err.to_string().contains("not an integer"), "{err}");
}

/// Our create is held on the server past its attempt bound (it may have
/// applied, as far as we know) while a rival creates the same counter with
/// the same units: the rival's document equals ours but for its token, so
/// exactly one caller is told it created the counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_creators_of_one_counter_exactly_one_gets_true() {
    let ctx = TestContext::new("bounded_two_creators").await;
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let ours = BoundedCounters::new(
        &client.store().with_attempt_timeout(Duration::from_secs(2)),
        BoundedConfig::new("seats"),
    );
    let rival = BoundedCounters::new(&ctx.rival_store().await, BoundedConfig::new("seats"));
    let (_held, mine) = ctx
        .hold_next_insert(&client.events, || {
            tokio::spawn(async move { ours.create("show", 10).await })
        })
        .await;
    let theirs = rival.create("show", 10).await.unwrap();
    let mine = mine.await.unwrap().unwrap();
    assert_eq!(
        [mine, theirs].iter().filter(|created| **created).count(),
        1,
        "ours: {mine}, theirs: {theirs}"
    );
}

/// A create whose write concern fails with a code that is not transient is
/// a command error (the book: design/errors.md), not "created".
#[tokio::test]
async fn a_create_with_a_write_concern_error_is_a_command_error() {
    let ctx = TestContext::new("bounded_create_write_concern").await;
    let client = ctx.client(false).await;
    let seats = seats(&client);
    let _fail = FailPoint::write_concern_error(&ctx, "insert", 64, "WriteConcernFailed").await;
    let err = seats.create("show", 3).await.unwrap_err();
    assert_eq!(err.class(), Some(tally::ErrorClass::Command), "{err:?}");
}

/// A create whose insert landed with its reply lost, whose retry met the
/// duplicate key and whose read of the counter then failed, may have
/// created the counter: never "not applied".
#[tokio::test]
async fn a_lost_reply_then_a_failed_read_is_a_create_that_may_have_applied() {
    let ctx = TestContext::new("bounded_create_failed_read").await;
    let direct = ctx.client(false).await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let seats = seats(&through);
    let _lost = proxy.rule(
        Rule::command("insert")
            .collection("seats")
            .nth(1)
            .then(Action::DropReply),
    );
    let _refused = proxy.rule(
        Rule::command("find")
            .collection("seats")
            .nth(1)
            .then(Action::error(11601, "Interrupted", &[])),
    );
    let err = seats.create("show", 3).await.unwrap_err();
    let stored = direct
        .collection("seats")
        .count_documents(doc! { "_id": "show" })
        .await
        .unwrap();
    assert_eq!(stored, 1, "the first insert landed");
    match &err {
        tally::Error::Server(failure) => {
            assert_ne!(failure.effect, tally::Effect::NotApplied, "{err:?}")
        }
        other => panic!("a server failure, not {other:?}"),
    }
}
