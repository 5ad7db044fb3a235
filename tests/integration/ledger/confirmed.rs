//! What the ledger tells a caller is recorded is what a majority has: an
//! insert that collides with its own earlier attempt, a retry's collisions
//! in `record_many`, a ticket settled by `record_again` — each judged by a
//! majority read, unknown when only the primary has it (majority reads are
//! answered empty by the proxy, as while an insert is not replicated); and
//! a debt starts where its raise took effect, not where a reply says
//! (found by the adversarial review of the lowered-floor repair; each test
//! failed before its fix).

use mongodb::bson::doc;
use tally::Recording;

use crate::common::TestContext;
use crate::common::proxy::{Action, Rule};
use crate::ledger::{assert_outcome, ledger_through_proxy};

/// A majority read that does not (yet) find the events: what a majority read
/// returns while an insert is on the primary only — the state a failover
/// rolls back.
fn not_majority_committed(ns: &str) -> Action {
    Action::Answer(doc! { "cursor": { "id": 0i64, "ns": ns, "firstBatch": [] } })
}

/// Finding 1: the event an insert collides with is judged "ours" by a
/// **local** read. The first insert landed on the primary and its reply was
/// lost (replication never confirmed); the retry is refused as a duplicate
/// key — through mongos a reply with a write error carries no write-concern
/// error (the very reason events *before* a refused one now need a majority
/// read) — and one `find` at read concern local finds the event with this
/// attempt's lane and number: `recorded`. No reply and no read ever said a
/// majority has it; a failover rolls it back and the event the caller was
/// told is recorded is never counted. Here the majority read is answered as
/// it would be before the event replicates: the event must not be reported
/// recorded (unknown, its ticket settles it).
#[tokio::test]
async fn review3_a_collision_with_our_own_lost_insert_is_recorded_without_a_majority_read() {
    let ctx = TestContext::new("review3_local_judge").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let ns = format!("{}.views_events", ctx.db_name);
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        let _unreplicated = proxy.rule(
            Rule::command("find")
                .collection("views_events")
                .mentions("readConcern")
                .then(not_majority_committed(&ns)),
        );
        ledger.record("evt_1", "home", 1).await
    };
    let finds = proxy.requests("find");
    let majority_reads = finds
        .iter()
        .filter(|e| {
            e.body
                .get_document("readConcern")
                .is_ok_and(|r| r.get_str("level").ok() == Some("majority"))
        })
        .count();
    assert!(
        recording.name() != "recorded",
        "reported recorded on a local read alone ({} finds, {majority_reads} at majority; \
         the lost insert was never acknowledged at w:majority): {recording:?}",
        finds.len()
    );
}

/// Finding 1, `record_many`: the same through an ordered batch. The whole
/// insert's reply is lost; the retry stops at its first event (ours) and the
/// keys are read at read concern local: every event `recorded`, none
/// confirmed by a majority — while the events a refused event stops *after*
/// are held to a majority read.
#[tokio::test]
async fn review3_record_many_retry_collisions_are_recorded_without_a_majority_read() {
    let ctx = TestContext::new("review3_local_judge_many").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let ns = format!("{}.views_events", ctx.db_name);
    let outcomes = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        let _unreplicated = proxy.rule(
            Rule::command("find")
                .collection("views_events")
                .mentions("readConcern")
                .then(not_majority_committed(&ns)),
        );
        ledger
            .record_many([("e1", "a", 1), ("e2", "a", 1), ("e3", "b", 2)])
            .await
    };
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert!(
        names.iter().all(|n| *n != "recorded"),
        "reported recorded on a local read alone: {names:?}"
    );
}

/// Finding 1, `record_again`: a ticket whose first attempt landed (both
/// replies lost: unknown) is sent again; the resend collides, a local read
/// finds the first attempt's lane and number: `recorded`, though nothing
/// ever confirmed a majority has it.
#[tokio::test]
async fn review3_a_ticket_is_settled_recorded_on_a_local_read() {
    let ctx = TestContext::new("review3_local_ticket").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let ns = format!("{}.views_events", ctx.db_name);
    let first = {
        let _lost = [
            proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply)),
            proxy.rule(Rule::command("insert").nth(2).then(Action::DropReply)),
        ];
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&first, "unknown");
    let Recording::Unknown(ticket) = first else {
        unreachable!()
    };
    let again = {
        let _unreplicated = proxy.rule(
            Rule::command("find")
                .collection("views_events")
                .mentions("readConcern")
                .then(not_majority_committed(&ns)),
        );
        ledger
            .record_again(ticket)
            .await
            .expect("within the horizon")
    };
    assert!(
        again.name() != "recorded",
        "a ticket settled recorded on a local read alone: {again:?}"
    );
}
