//! A floor lowered behind the fold's back — by a `collMod` that arrived
//! late, or a validator changed by hand — at every point of a pass: the
//! events that landed while it was down are found in the change stream and
//! folded by a repair pass, each once, and no pass counts one of them
//! twice.
//!
//! The floor is lowered and the late events inserted directly (numbered
//! where a held insert would be); the fold's commands are slowed by the
//! black-pipe proxy to place them. The oracle is what the test inserted.

use std::time::{Duration, SystemTime};

use mongodb::bson::{DateTime, Document, doc, oid::ObjectId};
use tally::EventsRun;
use tokio_util::sync::CancellationToken;

use tally::{EventFold, Ledger, Store};

use crate::common::proxy::{Action, Exchange, Proxy, Rule, upstream_of};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, documents, fold_all, fold_of, ledger_on};

/// How long the proxy holds the reply the test places its writes behind.
const HOLD: Duration = Duration::from_secs(3);

/// Takes the floor away, as a late `collMod` or a hand would.
async fn lower_the_floor(db: &mongodb::Database) {
    db.run_command(doc! { "collMod": "views_events", "validator": {} })
        .await
        .expect("collMod");
}

/// An event as a recorder writes it, numbered `s`, inserted directly.
async fn land(db: &mongodb::Database, id: &str, key: &str, n: i64, s: i64) {
    let event = doc! {
        "_id": id, "k": key, "n": n, "at": DateTime::now(), "L": ObjectId::new(), "s": s,
    };
    db.collection::<Document>("views_events")
        .insert_one(event)
        .await
        .expect("the floor is down: the late event lands");
}

/// The fold state's watermark and the pass in progress's range, if any.
async fn state(db: &mongodb::Database) -> (i64, Option<(i64, i64)>) {
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

/// Whether the request `command` got its reply from the server (the proxy
/// may still hold it).
fn executed(log: &[Exchange], command: &str, nth: usize) -> bool {
    log.iter()
        .filter(|e| e.command.as_deref() == Some(command))
        .nth(nth)
        .is_some_and(|e| e.server_replied)
}

/// A ledger of `views` with one event (`a`: 1) folded, and its watermark.
struct Scene {
    ctx: TestContext,
    store: Store,
    db: mongodb::Database,
    ledger: Ledger,
    watermark: i64,
}

impl Scene {
    async fn new(name: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let client = ctx.client(false).await;
        let store = client.store();
        let db = client.client.database(&ctx.db_name);
        let ledger = ledger_on(&store, "views").await;
        assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
        fold_all(&fold_of(&store, "views")).await;
        let (watermark, _) = state(&db).await;
        Self {
            ctx,
            store,
            db,
            ledger,
            watermark,
        }
    }

    /// A fold of `views` whose commands go through a proxy.
    async fn fold_through_proxy(&self) -> (Proxy, EventFold) {
        let proxy = Proxy::start(&upstream_of(&self.ctx.uri).await).await;
        let through = self.ctx.client_through(&proxy, false).await.store();
        (proxy, fold_of(&through, "views"))
    }

    async fn counter(&self, key: &str) -> i64 {
        counter(&self.store.collection("views"), key).await
    }

    /// Two more passes fold nothing and change no counter.
    async fn fold_twice_more_changes_nothing(&self, fold: &EventFold) {
        let before = documents(&self.store, "views").await;
        for _ in 0..2 {
            let run = fold_all(fold).await;
            assert_eq!(run.late_events_folded, 0, "{run:?}");
        }
        assert_eq!(
            before,
            documents(&self.store, "views").await,
            "nothing folded twice"
        );
    }
}

/// Runs one `fold` call on `fold` in the background; `meanwhile` runs
/// once `ready` holds for the proxy's log.
async fn fold_while(
    proxy: &Proxy,
    fold: EventFold,
    ready: (&str, impl Fn(&[Exchange]) -> bool),
    meanwhile: impl std::future::Future<Output = ()>,
) -> (EventFold, EventsRun) {
    let pass = tokio::spawn(async move {
        let run = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await;
        (fold, run)
    });
    proxy.wait_until(ready.0, HOLD, ready.1).await;
    meanwhile.await;
    let (fold, run) = pass.await.unwrap();
    (fold, run.expect("the pass"))
}

/// An idle ledger: the floor is taken away and an event lands below the
/// watermark. The next pass finds the floor changed, raises it again and
/// folds the late event once.
#[tokio::test]
async fn an_event_landed_below_a_floor_taken_away_is_found_and_folded_once() {
    let scene = Scene::new("lowered_idle").await;
    let fold = fold_of(&scene.store, "views");
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late", "a", 10, scene.watermark - 5).await;
    let run = fold_all(&fold).await;
    assert_eq!(run.late_events_folded, 1, "{run:?}");
    assert_eq!(scene.counter("a").await, 11);
    assert_eq!(scene.ledger.value("a").await.unwrap().value, 11);
    let later = doc! { "_id": "later", "k": "a", "n": 1i64, "s": scene.watermark - 4 };
    assert!(
        scene
            .db
            .collection::<Document>("views_events")
            .insert_one(later)
            .await
            .is_err(),
        "the floor stands again"
    );
    scene.fold_twice_more_changes_nothing(&fold).await;
}

/// The floor is taken away after a pass read it and before it raised it:
/// the raise replaced a validator it did not make (the change stream says
/// so), and the event that landed in between is folded once.
#[tokio::test]
async fn an_event_landed_between_a_passs_floor_read_and_its_raise_is_folded_once() {
    let scene = Scene::new("lowered_gap").await;
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    let (proxy, fold) = scene.fold_through_proxy().await;
    let _slow = proxy.rule(
        Rule::command("listCollections")
            .nth(1)
            .then(Action::DelayReply(HOLD)),
    );
    let (fold, run) = fold_while(
        &proxy,
        fold,
        ("the pass read the floor", |log: &[Exchange]| {
            executed(log, "listCollections", 0)
        }),
        async {
            lower_the_floor(&scene.db).await;
            land(&scene.db, "late", "a", 10, scene.watermark - 5).await;
        },
    )
    .await;
    assert_eq!(
        (run.events_folded, run.late_events_folded),
        (2, 1),
        "{run:?}"
    );
    assert_eq!(
        (scene.counter("a").await, scene.counter("b").await),
        (11, 1)
    );
    assert_eq!(scene.ledger.value("a").await.unwrap().value, 11);
    scene.fold_twice_more_changes_nothing(&fold).await;
}

/// The floor is taken away after a pass raised it and before it read its
/// range: events land in the range and below it. The pass finds the floor
/// changed after its read, raises it again and reads again; the range's
/// late event is left to the repair pass, which folds both late events —
/// each once.
#[tokio::test]
async fn events_landed_while_a_pass_read_its_range_are_folded_once() {
    let scene = Scene::new("lowered_read").await;
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    let (proxy, fold) = scene.fold_through_proxy().await;
    // The pass remembers its raise (an update of the state naming
    // intent.live): its reply is held while the floor goes.
    let _slow = proxy.rule(
        Rule::command("update")
            .collection("views_events_fold")
            .mentions("intent.live")
            .nth(1)
            .then(Action::DelayReply(HOLD)),
    );
    let raised = |log: &[Exchange]| {
        log.iter().any(|e| {
            e.command.as_deref() == Some("update")
                && e.body_mentions("intent.live")
                && e.server_replied
        })
    };
    let (fold, run) = fold_while(&proxy, fold, ("the pass raised the floor", raised), async {
        let (_, range) = state(&scene.db).await;
        let (from, to) = range.expect("the pass in progress");
        assert_eq!(from, scene.watermark);
        assert!(from < to);
        lower_the_floor(&scene.db).await;
        land(&scene.db, "late-in-range", "b", 100, from + 1).await;
        land(&scene.db, "late-below", "a", 10, from - 1).await;
    })
    .await;
    assert_eq!(
        (run.events_folded, run.late_events_folded),
        (3, 2),
        "{run:?}"
    );
    assert_eq!(
        (scene.counter("a").await, scene.counter("b").await),
        (11, 101)
    );
    assert_eq!(scene.ledger.value("b").await.unwrap().value, 101);
    scene.fold_twice_more_changes_nothing(&fold).await;
}

/// A pass applies one of its two counters and stops; the floor is taken
/// away and events land in its range for both counters. The resumed pass
/// applies the second counter exactly what the first would have got — the
/// late events go to the repair pass — so the counter it had applied
/// loses none and the other counts none twice.
#[tokio::test]
async fn a_pass_resumed_after_the_floor_was_taken_away_applies_what_it_read_first() {
    let scene = Scene::new("lowered_resumed").await;
    assert_outcome(&scene.ledger.record("x1", "a", 1).await, "recorded");
    assert_outcome(&scene.ledger.record("x2", "b", 1).await, "recorded");
    let (proxy, fold) = scene.fold_through_proxy().await;
    {
        let _crash = proxy.rule(
            Rule::command("update")
                .collection("views")
                .after(1)
                .then(Action::CloseBeforeForwarding),
        );
        assert!(
            fold.fold(SystemTime::now(), &CancellationToken::new())
                .await
                .is_err(),
            "the pass stops after one counter"
        );
    }
    let applied = scene.counter("a").await + scene.counter("b").await;
    assert_eq!(applied, 2, "one counter of the pass applied (a had 1)");
    let (_, range) = state(&scene.db).await;
    let (from, _) = range.expect("the pass in progress");
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late-a", "a", 100, from + 1).await;
    land(&scene.db, "late-b", "b", 1000, from + 2).await;

    let run = fold_all(&fold).await;
    assert!(run.recovered, "{run:?}");
    assert_eq!(run.late_events_folded, 2, "{run:?}");
    assert_eq!(
        (scene.counter("a").await, scene.counter("b").await),
        (102, 1001)
    );
    assert_eq!(scene.ledger.value("a").await.unwrap().value, 102);
    scene.fold_twice_more_changes_nothing(&fold).await;
}
