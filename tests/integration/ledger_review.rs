//! The ledger under the adversarial review's interleavings and faults: a
//! lost reply followed by a failed read, a counter key redelivered as
//! another numeric type.
//!
//! The oracle is always what the test recorded (distinct event keys and
//! their amounts) and what is stored, never what the code under test says.

use mongodb::bson::doc;
use tally::Ledger;

use crate::common::TestContext;
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::ledger::{assert_outcome, ledger_on};

/// A lost reply whose retry meets the duplicate key, then a failed read of
/// the stored event: the event may be this call's own, so the outcome is
/// `Unknown`, never `NotRecorded` ("nothing was written").
#[tokio::test]
async fn a_lost_reply_then_a_failed_read_is_unknown_never_not_recorded() {
    let ctx = TestContext::new("ledger_false_not_recorded").await;
    let direct = ctx.client(false).await;
    let spec = ledger_on(&direct.store(), "views").await.spec().clone();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let ledger = Ledger::new(&through.store(), spec);

    let recording = {
        let mut rules = vec![
            proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .nth(1)
                    .then(Action::DropReply),
            ),
        ];
        // The read of the stored event, right after the failover that cost
        // the insert's reply: the new primary has no majority snapshot yet
        // (a read-transient code, retried once, then given up on as "not
        // applied"). A server-selection timeout or any non-transient command
        // error (Interrupted, Unauthorized, ...) does the same.
        rules.extend((1..=10).map(|n| {
            proxy.rule(
                Rule::command("find")
                    .collection("views_events")
                    .nth(n)
                    .then(Action::error(
                        134,
                        "ReadConcernMajorityNotAvailableYet",
                        &[],
                    )),
            )
        }));
        let recording = ledger.record("evt_1", "home", 1).await;
        drop(rules);
        recording
    };
    let stored = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "evt_1" })
        .await
        .unwrap();
    assert_eq!(stored, 1, "the first insert landed");
    assert_ne!(
        recording.name(),
        "not_recorded",
        "NotRecorded promises nothing was written, but evt_1 is stored (and will be \
         counted): {recording:?}"
    );
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
