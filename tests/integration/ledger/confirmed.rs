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

mod anchor_time {
    //! Finding 2: a raise's cluster time (`at`) is the `collMod` reply's
    //! `operationTime`, which can be later than the `collMod`'s own oplog
    //! entry (the maintainers' own note: "the test server's collMod reply
    //! can name a later cluster time"; a DDL's reply names the node's last
    //! optime, concurrent writes included). Every debt starts at such an
    //! `at` (`{after: anchor.at, below: to}`, `{after: remembered.at, …}`)
    //! and owes only events that landed *after* it; an event numbered below
    //! the pass's range that lands between the raise and the time its reply
    //! names — under a floor lowered in that gap — is in no pass: the range
    //! read does not hold it (its number is below the range) and the debt
    //! does not owe it (it landed "before" the anchor). Lost.

    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use mongodb::bson::{Document, Timestamp, doc};
    use tokio_util::sync::CancellationToken;

    use crate::common::proxy::{Action, Exchange, Proxy, Rule, upstream_of};
    use crate::common::{TestContext, counter};
    use crate::ledger::{assert_outcome, fold_all, fold_of, ledger_on};

    const HOLD: Duration = Duration::from_secs(3);

    async fn land(db: &mongodb::Database, id: &str, key: &str, n: i64, s: i64) {
        let event = crate::ledger::event_by_hand(id, key, n, s);
        db.collection::<Document>("views_events")
            .insert_one(event)
            .await
            .expect("the floor is down: the late event lands");
    }

    async fn range(db: &mongodb::Database) -> (i64, Option<(i64, i64)>) {
        let state = db
            .collection::<Document>("views_events_fold")
            .find_one(doc! { "_id": "state" })
            .await
            .unwrap()
            .expect("a fold state");
        let range = state
            .get_document("intent")
            .ok()
            .map(|i| (i.get_i64("from").unwrap(), i.get_i64("to").unwrap()));
        (state.get_i64("W").unwrap(), range)
    }

    /// The pass's first raise replies with a cluster time two seconds on
    /// (what its reply may name); within those two seconds the floor is
    /// taken away and two events land: one in the pass's range, one below
    /// it. The pass finds the floor changed after its read and owes what
    /// landed after its anchor's `at` — which names a time after both.
    #[tokio::test]
    async fn review3_an_event_landed_before_the_time_a_raise_reply_names_is_lost() {
        let ctx = TestContext::new("review3_anchor_time").await;
        let client = ctx.client(false).await;
        let store = client.store();
        let db = client.client.database(&ctx.db_name);
        let ledger = ledger_on(&store, "views").await;
        assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
        fold_all(&fold_of(&store, "views")).await;
        assert_outcome(&ledger.record("e2", "b", 1).await, "recorded");

        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let through = ctx.client_through(&proxy, false).await.store();
        let fold = fold_of(&through, "views");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as u32;
        let later = Timestamp {
            time: now + 2,
            increment: 0,
        };
        let _late_time = std::env::var("R3_CONTROL").is_err().then(|| {
            proxy.rule(
                Rule::command("collMod")
                    .nth(1)
                    .then(Action::AmendReply(doc! { "operationTime": later })),
            )
        });
        let _slow = proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("intent.live")
                .nth(1)
                .then(Action::DelayReply(HOLD)),
        );
        let pass = tokio::spawn(async move {
            let run = fold
                .fold(SystemTime::now(), &CancellationToken::new())
                .await;
            (fold, run)
        });
        proxy
            .wait_until("the pass raised the floor", HOLD, |log: &[Exchange]| {
                log.iter().any(|e| {
                    e.command.as_deref() == Some("update")
                        && e.body_mentions("intent.live")
                        && e.server_replied
                })
            })
            .await;
        let (_, range_now) = range(&db).await;
        let (from, _) = range_now.expect("the pass in progress");
        db.run_command(doc! { "collMod": "views_events", "validator": {} })
            .await
            .expect("collMod");
        land(&db, "late-in-range", "b", 100, from + 1).await;
        land(&db, "late-below", "a", 10, from - 1).await;
        let (fold, run) = pass.await.unwrap();
        let run = run.expect("the pass");
        eprintln!("{run:?}");
        for _ in 0..3 {
            fold_all(&fold).await;
        }
        let views = store.collection("views");
        assert_eq!(
            (counter(&views, "a").await, counter(&views, "b").await),
            (1 + 10, 1 + 100),
            "every event inserted counted once"
        );
    }
}

mod exact_read {
    //! Note (not a count error): an exact read with a range pass's debt
    //! pending. An event that lands in a pass's range after its anchor
    //! (floor lowered meanwhile) is read by `Ledger::value` while above the
    //! watermark; the pass takes it out of its sums and commits; until the
    //! repair pass commits, the exact read no longer sees it — a value read
    //! as including it goes back down, then up again.

    use std::time::{Duration, SystemTime};

    use mongodb::bson::{DateTime, Document, doc, oid::ObjectId};
    use tokio_util::sync::CancellationToken;

    use crate::common::TestContext;
    use crate::common::proxy::{Action, Exchange, Proxy, Rule, upstream_of};
    use crate::ledger::{assert_outcome, fold_all, fold_of, ledger_on};

    const HOLD: Duration = Duration::from_secs(3);

    #[tokio::test]
    #[ignore = "open: an event of a pass's range that landed after its anchor is read exactly while it is above the watermark, then left to the repair pass: until the repair commits, exact reads do not see it (docs/src/design/ledger.md, limits)"]
    async fn review3_an_exact_read_goes_down_while_a_range_pass_debt_is_pending() {
        let ctx = TestContext::new("review3_exact_pending").await;
        let client = ctx.client(false).await;
        let store = client.store();
        let db = client.client.database(&ctx.db_name);
        let ledger = ledger_on(&store, "views").await;
        assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
        fold_all(&fold_of(&store, "views")).await;
        assert_outcome(&ledger.record("e2", "b", 1).await, "recorded");

        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let through = ctx.client_through(&proxy, false).await.store();
        let fold = fold_of(&through, "views");
        let _slow = proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("intent.live")
                .nth(1)
                .then(Action::DelayReply(HOLD)),
        );
        // The repair pass's intent is held (the second update naming the
        // debts: the first records the debt).
        let _repair = proxy.rule(
            Rule::command("update")
                .collection("views_events_fold")
                .mentions("late")
                .nth(2)
                .then(Action::DelayReply(HOLD * 2)),
        );
        let pass = tokio::spawn(async move {
            fold.fold(SystemTime::now(), &CancellationToken::new())
                .await
        });
        proxy
            .wait_until("the pass raised the floor", HOLD, |log: &[Exchange]| {
                log.iter().any(|e| {
                    e.command.as_deref() == Some("update")
                        && e.body_mentions("intent.live")
                        && e.server_replied
                })
            })
            .await;
        let state = db
            .collection::<Document>("views_events_fold")
            .find_one(doc! { "_id": "state" })
            .await
            .unwrap()
            .unwrap();
        let from = state
            .get_document("intent")
            .unwrap()
            .get_i64("from")
            .unwrap();
        db.run_command(doc! { "collMod": "views_events", "validator": {} })
            .await
            .unwrap();
        let late = doc! {
            "_id": "late-in-range", "k": "b", "n": 100i64, "at": DateTime::now(),
            "L": ObjectId::new(), "s": from + 1,
        };
        db.collection::<Document>("views_events")
            .insert_one(late)
            .await
            .unwrap();
        let before = ledger.value("b").await.unwrap().value;
        assert_eq!(
            before, 101,
            "read while the late event is above the watermark"
        );
        proxy
            .wait_until(
                "the repair's intent was sent",
                HOLD * 3,
                |log: &[Exchange]| {
                    log.iter().any(|e| {
                        e.command.as_deref() == Some("update")
                            && e.body_mentions("late")
                            && e.body_mentions("intent")
                            && e.server_replied
                    })
                },
            )
            .await;
        let pending = ledger.value("b").await.unwrap().value;
        let _ = pass.await.unwrap().expect("fold");
        let after = ledger.value("b").await.unwrap().value;
        assert_eq!(after, 101);
        assert_eq!(
            pending, 101,
            "an exact read of 101 went back to {pending} while the repair was pending"
        );
    }
}
