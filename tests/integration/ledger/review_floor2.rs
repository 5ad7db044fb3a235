//! Adversarial review of 332a0f0 (a floor lowered behind the fold's back).
//! Each test is a reproduction of a finding: it asserts what must hold
//! (every event once) and fails while the finding stands.
//!
//! The oracle is what the test recorded and inserted, never what the fold
//! reports.

use std::time::{Duration, SystemTime};

use mongodb::bson::{DateTime, Document, doc, oid::ObjectId};
use tally::{EventFold, EventsRun, Ledger, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Exchange, Proxy, Rule, upstream_of};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, fold_all, fold_of, ledger_on};

const HOLD: Duration = Duration::from_secs(3);

async fn lower_the_floor(db: &mongodb::Database) {
    db.run_command(doc! { "collMod": "views_events", "validator": {} })
        .await
        .expect("collMod");
}

async fn land(db: &mongodb::Database, id: &str, key: &str, n: i64, s: i64) {
    let event = doc! {
        "_id": id, "k": key, "n": n, "at": DateTime::now(), "L": ObjectId::new(), "s": s,
    };
    db.collection::<Document>("views_events")
        .insert_one(event)
        .await
        .expect("the floor is down: the late event lands");
}

async fn watermark(db: &mongodb::Database) -> i64 {
    db.collection::<Document>("views_events_fold")
        .find_one(doc! { "_id": "state" })
        .await
        .unwrap()
        .expect("a fold state")
        .get_i64("W")
        .unwrap()
}

/// The events collection's validator as listCollections shows it.
async fn validator(db: &mongodb::Database) -> Document {
    let reply = db
        .run_command(doc! { "listCollections": 1, "filter": { "name": "views_events" } })
        .await
        .unwrap();
    reply
        .get_document("cursor")
        .unwrap()
        .get_array("firstBatch")
        .unwrap()[0]
        .as_document()
        .unwrap()
        .get_document("options")
        .unwrap()
        .get_document("validator")
        .unwrap()
        .clone()
}

struct Scene {
    ctx: TestContext,
    store: Store,
    db: mongodb::Database,
    ledger: Ledger,
    watermark: i64,
}

impl Scene {
    /// A ledger of `views` with one event (`a`: 1) folded.
    async fn new(name: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let client = ctx.client(false).await;
        let store = client.store();
        let db = client.client.database(&ctx.db_name);
        let ledger = ledger_on(&store, "views").await;
        assert_outcome(&ledger.record("e1", "a", 1).await, "recorded");
        fold_all(&fold_of(&store, "views")).await;
        let watermark = watermark(&db).await;
        Self {
            ctx,
            store,
            db,
            ledger,
            watermark,
        }
    }

    async fn fold_through_proxy(&self) -> (Proxy, EventFold) {
        let proxy = Proxy::start(&upstream_of(&self.ctx.uri).await).await;
        let through = self.ctx.client_through(&proxy, false).await.store();
        (proxy, fold_of(&through, "views"))
    }

    async fn counter(&self, key: &str) -> i64 {
        counter(&self.store.collection("views"), key).await
    }
}

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

/// Finding 1. A repair pass pays the debts its intent names (`d1`) from
/// the change stream up to its own raise, but a debt its own raise finds
/// (`d2`, from the raise keep_the_floor remembered just before) overlaps
/// `d1`'s window and survives the repair's commit: the next repair folds
/// the same late event again.
///
/// 1. A stale collMod of the same floor under another token (a held
///    attempt of an earlier raise, landed late) replaces the remembered
///    raise R0: harmless in itself.
/// 2. A pass: keep_the_floor sees the token changed, owes d1 = {R0.at, W},
///    raises R1 and remembers it; records a repair intent (late: [d1]).
/// 3. Before the repair raises, a late collMod lowers the floor and an
///    event numbered below W lands (at > R1.at > R0.at).
/// 4. The repair's raise replaced a validator it did not make: it owes
///    d2 = {R1.at, W}. It folds the late event (d1 owes it) and pulls d1.
/// 5. The next pass repairs d2 and folds the same event again.
#[tokio::test]
async fn review_a_debt_found_by_a_repairs_own_raise_pays_its_event_twice() {
    let scene = Scene::new("rev27_repair_twice").await;
    let w = scene.watermark;
    // 1. The same floor under another token: what a held attempt of the
    // raise that set it does when it lands late.
    scene
        .db
        .run_command(doc! {
            "collMod": "views_events",
            "validator": { "s": { "$gt": w }, "tally_floor": { "$ne": "held-attempt" } },
        })
        .await
        .unwrap();
    let (proxy, fold) = scene.fold_through_proxy().await;
    // The repair's intent (the first update naming a deadline): its reply
    // is held while the floor goes and the late event lands.
    let _slow = proxy.rule(
        Rule::command("update")
            .collection("views_events_fold")
            .mentions("deadline")
            .nth(1)
            .then(Action::DelayReply(HOLD)),
    );
    let intended = |log: &[Exchange]| {
        log.iter().any(|e| {
            e.command.as_deref() == Some("update")
                && e.body_mentions("deadline")
                && e.server_replied
        })
    };
    let (fold, run) = fold_while(&proxy, fold, ("the repair's intent", intended), async {
        lower_the_floor(&scene.db).await;
        land(&scene.db, "late", "a", 10, w - 5).await;
    })
    .await;
    eprintln!("first fold: {run:?}");
    let run = fold_all(&fold).await;
    eprintln!("second fold: {run:?}");
    let run = fold_all(&fold).await;
    eprintln!("third fold: {run:?}");
    // Oracle: e1 (1) and the late event (10), each once.
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
    assert_eq!(scene.ledger.value("a").await.unwrap().value, 11);
}

/// Finding 2a. The floor is taken away by hand without touching the
/// validator (`validationAction: "warn"`, or `validationLevel: "off"`):
/// the token stays, so no check sees it, and the next raise (which sets
/// `validationAction: "error"` again) replaced "its own" validator. The
/// event that landed below the watermark meanwhile is never folded.
#[tokio::test]
async fn review_a_floor_disabled_by_validation_action_is_never_found() {
    let scene = Scene::new("rev27_warn").await;
    let w = scene.watermark;
    scene
        .db
        .run_command(doc! { "collMod": "views_events", "validationAction": "warn" })
        .await
        .unwrap();
    land(&scene.db, "late", "a", 10, w - 5).await;
    // A later event, so that a pass raises the floor again.
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    let fold = fold_of(&scene.store, "views");
    for _ in 0..3 {
        let run = fold_all(&fold).await;
        eprintln!("{run:?}");
    }
    assert_eq!(scene.counter("b").await, 1);
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
}

/// Finding 2b. The same with `validationLevel: "off"`, restored by hand.
#[tokio::test]
async fn review_a_floor_disabled_by_validation_level_is_never_found() {
    let scene = Scene::new("rev27_level_off").await;
    let w = scene.watermark;
    scene
        .db
        .run_command(doc! { "collMod": "views_events", "validationLevel": "off" })
        .await
        .unwrap();
    land(&scene.db, "late", "a", 10, w - 5).await;
    scene
        .db
        .run_command(doc! { "collMod": "views_events", "validationLevel": "strict" })
        .await
        .unwrap();
    let fold = fold_of(&scene.store, "views");
    for _ in 0..3 {
        let run = fold_all(&fold).await;
        eprintln!("{run:?}");
    }
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
}

/// Finding 2c. The validator taken away and put back as it was (an
/// operator's "disable validation for a migration, then restore the saved
/// options", or a router sending the latest raise's collMod again after a
/// late one): the token is the remembered one again, so no check sees that
/// the floor was down. The event that landed meanwhile is never folded.
#[tokio::test]
async fn review_a_floor_taken_away_and_put_back_is_never_found() {
    let scene = Scene::new("rev27_aba").await;
    let w = scene.watermark;
    let saved = validator(&scene.db).await;
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late", "a", 10, w - 5).await;
    scene
        .db
        .run_command(doc! { "collMod": "views_events", "validator": saved })
        .await
        .unwrap();
    let fold = fold_of(&scene.store, "views");
    for _ in 0..3 {
        let run = fold_all(&fold).await;
        eprintln!("{run:?}");
    }
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
}

/// Finding 3. Converting a state of tally 0.2.0 scans the events (which
/// lanes it folded, where the unfolded ones start) and only then raises
/// the floor to the watermark it chose; nothing remembers what landed in
/// between. An insert held in the network (a recorder's, numbered when it
/// was sent, below the highest number 0.2.0 folded) landing after the scan
/// and before the raise is below the watermark, under no debt: never
/// folded, although its recorder was told "recorded".
#[tokio::test]
async fn review_an_event_landed_while_a_0_2_0_state_is_converted_is_never_folded() {
    let ctx = TestContext::new("rev27_convert").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let db = client.client.database(&ctx.db_name);
    ledger_on(&store, "views").await;
    let then = SystemTime::now() - Duration::from_secs(60);
    let base = i64::try_from(
        then.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap();
    let lane = ObjectId::new();
    let events: Vec<Document> = (1..=3i64)
        .map(|s| doc! { "_id": format!("old{s}"), "k": "home", "n": 1i64, "at": DateTime::now(), "L": lane, "s": base + s })
        .collect();
    db.collection::<Document>("views_events")
        .insert_many(events)
        .await
        .unwrap();
    db.collection::<Document>("views")
        .insert_one(doc! { "_id": "home", "counter": 3i64 })
        .await
        .unwrap();
    let state = doc! { "_id": "state", "pass": 3i64, "v": 6i64, "folded": { lane.to_hex(): base + 3 } };
    db.collection::<Document>("views_events_fold")
        .insert_one(state)
        .await
        .unwrap();

    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await.store();
    let fold = fold_of(&through, "views");
    // The conversion's scan (its $group of each lane's lowest and highest
    // number): its reply is held while the held insert lands.
    let _slow = proxy.rule(
        Rule::command("aggregate")
            .collection("views_events")
            .mentions("hi")
            .nth(1)
            .then(Action::DelayReply(HOLD)),
    );
    let scanned = |log: &[Exchange]| {
        log.iter().any(|e| {
            e.command.as_deref() == Some("aggregate") && e.body_mentions("hi") && e.server_replied
        })
    };
    let (fold, run) = fold_while(&proxy, fold, ("the conversion's scan", scanned), async {
        // A new recorder's insert, numbered a moment before the last event
        // 0.2.0 folded, held in the network: it lands now.
        land(&db, "held", "home", 100, base + 2).await;
    })
    .await;
    eprintln!("{run:?}");
    for _ in 0..2 {
        eprintln!("{:?}", fold_all(&fold).await);
    }
    let stored = db
        .collection::<Document>("views_events")
        .count_documents(doc! { "_id": "held" })
        .await
        .unwrap();
    assert_eq!(stored, 1, "the held insert landed (recorded)");
    assert_eq!(
        counter(&store.collection("views"), "home").await,
        103,
        "the held insert counted once"
    );
}

/// Finding 4 (the test server, not the count). SecantusDB answers a
/// `collMod` with `operationTime` = the last cluster time minted when the
/// reply is built (`peek_cluster_time`), not the `collMod`'s own as
/// MongoDB does: with another write in between (any collection), the
/// raise's `at` is past its own `modify` event. `raise_over` opens the
/// change stream at `at`, never sees its own `modify`, waits 30 s and the
/// pass stops with `FoldFloorUnverified`. (Probed: 4 of 200 `collMod`s
/// beside one writer thread.) Not reliable: a failure shows it; a pass
/// shows nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_pass_beside_busy_writers_finds_its_own_raise() {
    let scene = Scene::new("rev27_busy").await;
    let stop = CancellationToken::new();
    let mut noise = Vec::new();
    for w in 0..4i64 {
        let db = scene.db.clone();
        let stop = stop.clone();
        noise.push(tokio::spawn(async move {
            let mut i = 0i64;
            while !stop.is_cancelled() {
                i += 1;
                let _ = db
                    .collection::<Document>("noise")
                    .insert_one(doc! { "_id": w * 1_000_000_000 + i })
                    .await;
            }
        }));
    }
    let fold = fold_of(&scene.store, "views");
    let mut failure = None;
    for i in 0..40 {
        assert_outcome(
            &scene.ledger.record(format!("busy{i}"), "b", 1).await,
            "recorded",
        );
        let began = std::time::Instant::now();
        if let Err(err) = fold.fold(SystemTime::now(), &CancellationToken::new()).await {
            failure = Some(format!("pass {i} after {:?}: {err}", began.elapsed()));
            break;
        }
    }
    stop.cancel();
    for task in noise {
        task.await.unwrap();
    }
    assert_eq!(failure, None);
}
