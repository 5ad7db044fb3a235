//! An event is counted once: recorded twice it is a duplicate, and a key
//! reused for another counter or amount is a conflict — whatever numeric
//! type or shape the counter key is redelivered with, and whatever the
//! recorder's clock, inside the dedupe window.
//!
//! The oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::time::SystemTime;

use mongodb::bson::{Bson, doc};
use tally::{Ledger, Recording};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, fold_of, ledger_on};

#[tokio::test]
async fn an_event_recorded_twice_is_a_duplicate_and_a_reused_key_a_conflict() {
    let ctx = TestContext::new("ledger_duplicate_conflict").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("evt_1", "home", 2).await, "recorded");
    assert_outcome(&ledger.record("evt_1", "home", 2).await, "duplicate");
    let conflict = ledger.record("evt_1", "about", 2).await;
    let Recording::Conflict(c) = &conflict else {
        panic!("expected a conflict, got {conflict:?}");
    };
    let said = c.to_string();
    assert!(
        said.contains("evt_1") && said.contains("home") && said.contains("about"),
        "names both: {said}"
    );
    assert_outcome(&ledger.record("evt_1", "home", 3).await, "conflict");
    assert_outcome(&ledger.record("evt_2", "home", 0).await, "not_recorded");
    let events = client.collection("views_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 1);
    let stored = events.find_one(doc! {}).await.unwrap().unwrap();
    assert_eq!(stored.get_str("k").unwrap(), "home");
    assert_eq!(stored.get_i64("n").unwrap(), 2);
    assert!(stored.get_object_id("L").is_ok(), "{stored}");
    assert!(stored.get_i64("s").is_ok(), "{stored}");
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

/// Finding 8: counter keys compare equal on the server when nested numbers
/// differ in type (`{u: 5}` and `{u: NumberLong(5)}`), but the ledger
/// compared nested values byte for byte: a redelivery was told `conflict`.
#[tokio::test]
async fn the_same_event_on_a_counter_key_with_a_nested_number_of_another_type_is_a_duplicate() {
    let ctx = TestContext::new("ledger_finding_nested_key").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let int32 = Bson::Document(doc! { "u": 5i32, "at": { "day": 2.0f64 } });
    let int64 = Bson::Document(doc! { "u": 5i64, "at": { "day": 2i32 } });
    assert_outcome(&ledger.record("e1", int32, 1).await, "recorded");
    assert_outcome(&ledger.record("e1", int64, 1).await, "duplicate");
}

/// The same event redelivered with its counter key as another numeric
/// type (int64 for int32, same value) is a `Duplicate`, as the server
/// compares ids: one counter, counted once.
#[tokio::test]
async fn the_same_event_with_its_counter_key_as_int64_is_a_duplicate() {
    let ctx = TestContext::new("ledger_numeric_key").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("evt_1", 5i32, 1).await, "recorded");
    let again = ledger.record("evt_1", 5i64, 1).await;
    assert_eq!(
        ledger.value(5i64).await.unwrap().value,
        1,
        "one event on counter 5"
    );
    assert_outcome(&again, "duplicate");
}

/// Past 2^53 a double no longer tells neighbouring integers apart, but the
/// server does: an event first recorded on the counter 2^53 (a double) and
/// redelivered under the same key on the counter 2^53 + 1 (an int64) is
/// two different counters to the server (the fold's `$group`, exact reads'
/// `{k: key}`). `same_key` compares them as doubles and calls the second a
/// `duplicate` ("counted once") — a `conflict` it is: counter 2^53 + 1
/// never gets it.
#[tokio::test]
async fn an_event_redelivered_on_a_neighbouring_counter_past_2_53_is_a_conflict() {
    let ctx = TestContext::new("ledger_review2_key_2_53").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let two_53 = 1i64 << 53;
    assert_outcome(
        &ledger.record("evt_1", Bson::Double(two_53 as f64), 1).await,
        "recorded",
    );
    let again = ledger.record("evt_1", Bson::Int64(two_53 + 1), 1).await;
    let on_next = ledger.value(Bson::Int64(two_53 + 1)).await.unwrap().value;
    assert_eq!(on_next, 0, "the server keeps the two counters apart");
    assert_outcome(&again, "conflict");
}

/// A counter key is any BSON value, a document too (a compound key). One
/// shaped like a query operator (`{"$gt": ""}` — say, a key taken from a
/// caller's JSON) is recorded as given, and the fold's update filters on
/// `{_id: key}`: the server reads it as an operator, and the event's amount
/// lands on whichever counter matches. The event's own counter never gets
/// it; another counter is counted for an event it never had. (The same
/// filter shape is in every write path; the ledger says `recorded`.)
#[tokio::test]
async fn an_event_on_an_operator_shaped_counter_key_never_lands_on_another_counter() {
    let ctx = TestContext::new("ledger_review2_operator_key").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    let fold = crate::ledger::fold_of(&store, "views");
    let stop = tokio_util::sync::CancellationToken::new();
    assert_outcome(&ledger.record("e1", "home", 1).await, "recorded");
    fold.fold(SystemTime::now(), &stop).await.expect("fold 1");
    let odd = Bson::Document(doc! { "$gt": "" });
    let recorded = ledger.record("e2", odd.clone(), 100).await;
    let folded = fold.fold(SystemTime::now(), &stop).await;
    let home = crate::common::counter(&client.collection("views"), "home").await;
    assert_eq!(
        home, 1,
        "counter home had one event of 1; e2 ({recorded:?}, fold: {folded:?}) was on \
         counter {odd}"
    );
}

/// Finding 5 (the dedupe window shrinks by a recorder's clock error). An
/// event's age is read from its number, the recorder's clock; the sweep
/// deletes a lane's folded events once that number is older than
/// `event_retention` by the server's clock. A recorder host whose clock is
/// two hours behind (a hardware clock kept in local time, a stalled NTP)
/// has its events forgotten two hours before the window ends, and a
/// redelivery inside the window is recorded and counted again — a day
/// behind, a day early; past the window, right after its lane is sealed.
/// The retention floor's hour covers resends within the retry horizon, not
/// this; nothing measures or alerts on a recorder's clock. (The server's
/// clock is moved here instead of the recorder's: the recorder records at
/// the test's real time, the server reads two hours later.)
#[tokio::test]
async fn a_redelivery_inside_the_window_is_a_duplicate_whatever_the_recorders_clock() {
    let ctx = TestContext::new("review_ledger_recorder_behind").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    // Numbers are the server's clock: the recorder's own clock takes no
    // part (the processes of `clocks::…` run minutes off).
    assert_outcome(&ledger.record("evt_1", "a", 1).await, "recorded");
    let server = server_now(&store).await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    fold.fold(server, &stop).await.expect("a pass");
    fold.fold(server + 2 * HOUR, &stop).await.expect("a pass");
    // Six days and 23 hours after it was recorded (the window is 7 days),
    // the queue delivers the event again, to another consumer.
    let inside = server + 7 * DAY - HOUR;
    fold.sweep(inside).await.expect("a sweep");
    let consumer = Ledger::new(&store, ledger.spec().clone());
    let again = consumer.record("evt_1", "a", 1).await;
    fold.fold(inside, &stop).await.expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "a").await,
        1,
        "the event, delivered again inside the dedupe window, was counted twice ({again:?})"
    );
    assert_outcome(&again, "duplicate");
}
