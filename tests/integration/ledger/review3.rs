//! Review 3: reproducing tests of the adversarial review of the lowered-floor
//! repair and of `record_many`'s majority confirmation. Each fails on the
//! code under review.
//!
//! The oracle is what the test recorded and what is stored (or, for
//! replication, what a majority read returns), never what the code reports.

#[allow(unused_imports)]
use std::time::SystemTime;

use mongodb::bson::doc;
use tally::Recording;
#[allow(unused_imports)]
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::proxy::{Action, Rule};
#[allow(unused_imports)]
use crate::common::{TestContext, counter};
#[allow(unused_imports)]
use crate::ledger::{fold_of, ledger_through_proxy};

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
