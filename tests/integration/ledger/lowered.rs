//! A floor lowered behind the fold's back — by a `collMod` that arrived
//! late, or a validator changed by hand — at every point of a pass, during
//! a repair, and while a 0.2.0 state is converted: the
//! events that landed while it was down are found in the change stream and
//! folded by a repair pass, each once, and no pass counts one of them
//! twice.
//!
//! The floor is lowered and the late events inserted directly (numbered
//! where a held insert would be); the fold's commands are slowed by the
//! black-pipe proxy to place them. The oracle is what the test inserted.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tally::{CollectionConfig, EventFold, EventFoldSettings, EventsRun, Ledger, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Exchange, Proxy, Release, Rule, RuleGuard, upstream_of};
use crate::common::{FailPoint, TestContext, counter};
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
    let event = crate::ledger::event_by_hand(id, key, n, s);
    db.collection::<Document>("views_events")
        .insert_one(event)
        .await
        .expect("the floor is down: the late event lands");
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
        self.fold_through_proxy_with(EventFoldSettings::default())
            .await
    }

    /// The same with `settings`.
    async fn fold_through_proxy_with(&self, settings: EventFoldSettings) -> (Proxy, EventFold) {
        let proxy = Proxy::start(&upstream_of(&self.ctx.uri).await).await;
        let through = self.ctx.client_through(&proxy, false).await.store();
        let fold = EventFold::new(&through, CollectionConfig::new("views"), settings);
        (proxy, fold)
    }

    async fn counter(&self, key: &str) -> i64 {
        counter(&self.store.collection("views"), key).await
    }

    /// `collMod` on the events collection with `options`.
    async fn coll_mod(&self, options: Document) {
        let mut command = doc! { "collMod": "views_events" };
        command.extend(options);
        self.db.run_command(command).await.expect("collMod");
    }

    /// Three passes of a fold, then the counter `key`.
    async fn folded(&self, key: &str) -> i64 {
        let fold = fold_of(&self.store, "views");
        for _ in 0..3 {
            fold_all(&fold).await;
        }
        self.counter(key).await
    }

    /// Events on `a` and `b`, and a pass through a proxy that applies one
    /// of the two counters and stops (its connection cut): the fold, its
    /// pass in progress.
    async fn a_pass_stopped_after_one_of_two_counters(&self) -> (Proxy, EventFold) {
        assert_outcome(&self.ledger.record("x1", "a", 1).await, "recorded");
        assert_outcome(&self.ledger.record("x2", "b", 1).await, "recorded");
        // Each counter's update alone, so that the pass can stop between.
        let one_by_one = EventFoldSettings {
            apply_batch: 1,
            ..EventFoldSettings::default()
        };
        let (proxy, fold) = self.fold_through_proxy_with(one_by_one).await;
        let crash = proxy.rule(
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
        drop(crash);
        (proxy, fold)
    }

    /// An event recorded on another counter (so that the next pass raises
    /// the floor), three passes of a fold, then the counter `key`.
    async fn folded_after_more(&self, key: &str) -> i64 {
        assert_outcome(&self.ledger.record("more", "other", 1).await, "recorded");
        let folded = self.folded(key).await;
        assert_eq!(self.counter("other").await, 1);
        folded
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

/// Holds the reply to the fold's first update of its state naming `key`,
/// and the condition that the update reached the server.
fn hold_state_update(
    proxy: &Proxy,
    key: &'static str,
) -> (RuleGuard, impl Fn(&[Exchange]) -> bool) {
    let guard = proxy.rule(
        Rule::command("update")
            .collection("views_events_fold")
            .mentions(key)
            .nth(1)
            .then(Action::DelayReply(HOLD)),
    );
    let reached = move |log: &[Exchange]| {
        log.iter().any(|e| {
            e.command.as_deref() == Some("update") && e.body_mentions(key) && e.server_replied
        })
    };
    (guard, reached)
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
    let (_slow, raised) = hold_state_update(&proxy, "intent.live");
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
    let (_proxy, fold) = scene.a_pass_stopped_after_one_of_two_counters().await;
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

/// A repair pass pays the debts its intent names (`d1`) from the change
/// stream up to its own raise; a debt its own raise finds (`d2`, from the
/// raise keep_the_floor remembered just before) overlaps `d1`'s window, so
/// the repair pays it too and its commit drops both: the late event is
/// folded once (found by the adversarial review: it was folded twice).
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
async fn a_debt_found_by_a_repairs_own_raise_is_paid_by_that_repair_once() {
    let scene = Scene::new("lowered_repair_twice").await;
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
    let (_slow, intended) = hold_state_update(&proxy, "deadline");
    let (fold, _) = fold_while(&proxy, fold, ("the repair's intent", intended), async {
        lower_the_floor(&scene.db).await;
        land(&scene.db, "late", "a", 10, w - 5).await;
    })
    .await;
    scene.fold_twice_more_changes_nothing(&fold).await;
    // Oracle: e1 (1) and the late event (10), each once.
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
    assert_eq!(scene.ledger.value("a").await.unwrap().value, 11);
}

/// The floor is taken away by hand without touching the validator
/// (`validationAction: "warn"`): the token stays, but a floor that only
/// warns is not the raise's, and the next raise replaced a floor it did not
/// make: the event that landed below the watermark meanwhile is folded once
/// (found by the adversarial review: it was never folded).
#[tokio::test]
async fn an_event_landed_while_the_floor_only_warned_is_folded_once() {
    let scene = Scene::new("lowered_warn").await;
    let w = scene.watermark;
    scene.coll_mod(doc! { "validationAction": "warn" }).await;
    land(&scene.db, "late", "a", 10, w - 5).await;
    // A later event, so that a pass raises the floor again.
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    let fold = fold_of(&scene.store, "views");
    for _ in 0..3 {
        fold_all(&fold).await;
    }
    assert_eq!(scene.counter("b").await, 1);
    assert_eq!(scene.counter("a").await, 11, "the late event counted once");
}

/// The same with `validationLevel: "off"`, restored by hand before the
/// next pass: no check reads the floor while it is off, but the next
/// raise's change stream shows both changes since the raise the fold
/// remembers, and the event is folded once.
#[tokio::test]
async fn an_event_landed_while_validation_was_off_and_on_again_is_folded_once() {
    let scene = Scene::new("lowered_level_off").await;
    let w = scene.watermark;
    scene.coll_mod(doc! { "validationLevel": "off" }).await;
    land(&scene.db, "late", "a", 10, w - 5).await;
    scene.coll_mod(doc! { "validationLevel": "strict" }).await;
    assert_eq!(
        scene.folded_after_more("a").await,
        11,
        "the late event counted once"
    );
}

/// The validator taken away and put back as it was (an operator's "disable
/// validation for a migration, then restore the saved options", or a
/// router sending the latest raise's collMod again after a late one): the
/// token is the remembered one again, so neither the floor read nor what
/// the next raise replaced shows that it was down; the next raise's change
/// stream shows both changes, and the event is folded once.
#[tokio::test]
async fn an_event_landed_while_the_floor_was_away_and_put_back_is_folded_once() {
    let scene = Scene::new("lowered_put_back").await;
    let w = scene.watermark;
    let saved = validator(&scene.db).await;
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late", "a", 10, w - 5).await;
    scene.coll_mod(doc! { "validator": saved }).await;
    assert_eq!(
        scene.folded_after_more("a").await,
        11,
        "the late event counted once"
    );
}

/// The same, the floor put back by the fold's own `collMod` sent again
/// (a router sending the latest raise's command again after a late one
/// of an earlier pass lowered it), seen by a fold whose stream was kept
/// open since that raise.
#[tokio::test]
async fn an_event_landed_while_a_late_collmod_held_the_floor_down_until_a_resend_is_folded_once() {
    let scene = Scene::new("lowered_resent").await;
    let fold = fold_of(&scene.store, "views");
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    fold_all(&fold).await;
    let (w, _) = state(&scene.db).await;
    let latest = validator(&scene.db).await;
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late", "a", 10, w - 5).await;
    scene.coll_mod(doc! { "validator": latest }).await;
    assert_outcome(&scene.ledger.record("e3", "b", 1).await, "recorded");
    let mut late = 0;
    for _ in 0..3 {
        late += fold_all(&fold).await.late_events_folded;
    }
    assert_eq!(late, 1, "the late event folded once");
    assert_eq!(scene.counter("a").await, 11);
    assert_eq!(scene.counter("b").await, 2);
    scene.fold_twice_more_changes_nothing(&fold).await;
}

/// Converting a state of tally 0.2.0 scans the events (which lanes it
/// folded, where the unfolded ones start) and only then raises the floor to
/// the watermark it chose. An insert held in the network (numbered below
/// the highest number 0.2.0 folded) landing after the scan began and before
/// the raise is owed by the converted state: the repair pass folds it once
/// (found by the adversarial review: it was never folded).
#[tokio::test]
async fn an_event_landed_while_a_0_2_0_state_is_converted_is_folded_once() {
    let ctx = TestContext::new("lowered_convert").await;
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
    let state =
        doc! { "_id": "state", "pass": 3i64, "v": 6i64, "folded": { lane.to_hex(): base + 3 } };
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
    let (fold, _) = fold_while(&proxy, fold, ("the conversion's scan", scanned), async {
        // A new recorder's insert, numbered a moment before the last event
        // 0.2.0 folded, held in the network: it lands now.
        land(&db, "held", "home", 100, base + 2).await;
    })
    .await;
    for _ in 0..2 {
        fold_all(&fold).await;
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

/// Passes beside busy writers find their own raise in the change stream.
/// The test server answers a `collMod` with the cluster time of the reply,
/// not the `collMod`'s own as MongoDB does: with another write in between,
/// a raise's `operationTime` is past its own `modify` event, so the stream
/// is read from a `ping` before the raise and the raise found by its token
/// (found by the adversarial review: passes stopped after 30 s with
/// `FoldFloorUnverified`, 4 `collMod`s in 200 beside one writer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_beside_busy_writers_find_their_own_raise() {
    let scene = Scene::new("lowered_busy").await;
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
    for i in 0..20 {
        assert_outcome(
            &scene.ledger.record(format!("busy{i}"), "b", 1).await,
            "recorded",
        );
        let began = std::time::Instant::now();
        if let Err(err) = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await
        {
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

/// A floor lowered while the fold's kept change stream loses its
/// connection: the driver resumes the stream from its last position, the
/// next raise still reads what it replaced, and the event that landed
/// below the watermark meanwhile is folded once (from the adversarial
/// review of the kept stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_lowered_while_the_kept_stream_is_resumed_is_seen_and_repaired_once() {
    let ctx = TestContext::new("lowered_kept_resume").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let db = client.client.database(&ctx.db_name);
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    for i in 0..3 {
        assert_outcome(&ledger.record(format!("e{i}"), "a", 1).await, "recorded");
        assert_eq!(fold_all(&fold).await.events_folded, 1);
    }
    let (watermark, _) = state(&db).await;
    lower_the_floor(&db).await;
    land(&db, "late", "a", 1, watermark - 1).await;
    let run = {
        let _cut = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["getMore"], "closeConnection": true },
        )
        .await;
        assert_outcome(&ledger.record("e3", "a", 1).await, "recorded");
        fold_all(&fold).await
    };
    let mut late = run.late_events_folded;
    for _ in 0..3 {
        late += fold_all(&fold).await.late_events_folded;
    }
    assert_eq!(late, 1, "the late event folded once");
    assert_eq!(counter(&client.collection("views"), "a").await, 5);
}

/// The floor taken away and put back as it was (a late `collMod`, then a
/// router resending the pass's own raise) *while a pass reads its range*:
/// the floor read after the sums shows the pass's own token, but the raise
/// over it sees the two changes, so the event that landed in the range is
/// the repair's, folded once (found by the adversarial review: the pass
/// folded it, and the next raise's debt folded it again — 201, not 101).
#[tokio::test]
async fn an_event_landed_in_a_passs_range_while_its_floor_was_away_and_put_back_is_folded_once() {
    let scene = Scene::new("lowered_put_back_in_pass").await;
    assert_outcome(&scene.ledger.record("e2", "b", 1).await, "recorded");
    let (proxy, fold) = scene.fold_through_proxy().await;
    let (_slow, raised) = hold_state_update(&proxy, "intent.live");
    let (fold, first) = fold_while(&proxy, fold, ("the pass raised the floor", raised), async {
        let (_, range) = state(&scene.db).await;
        let (from, _) = range.expect("the pass in progress");
        let raised = validator(&scene.db).await;
        lower_the_floor(&scene.db).await;
        land(&scene.db, "late-in-range", "b", 100, from + 1).await;
        // The pass's own raise sent again: its token is back.
        scene.coll_mod(doc! { "validator": raised }).await;
    })
    .await;
    assert_outcome(&scene.ledger.record("more", "other", 1).await, "recorded");
    let mut late = first.late_events_folded;
    for _ in 0..3 {
        late += fold_all(&fold).await.late_events_folded;
    }
    assert_eq!(late, 1, "a repair folds it");
    assert_eq!(scene.counter("other").await, 1);
    // Oracle: e2 (1) and late-in-range (100), each once.
    assert_eq!(scene.counter("b").await, 101, "late-in-range counted once");
    assert_eq!(scene.ledger.value("b").await.unwrap().value, 101);
}

/// The same in a resumed pass: one counter applied, the floor taken away,
/// events land in the range for both counters, the pass's raise put back
/// as it was; the resumed pass and then the repair count each once (found
/// by the adversarial review: (102, 2001); before the interval check,
/// (2, 1001)).
#[tokio::test]
async fn a_resumed_pass_whose_floor_was_away_and_put_back_counts_each_late_event_once() {
    let scene = Scene::new("lowered_put_back_resumed").await;
    let (_proxy, fold) = scene.a_pass_stopped_after_one_of_two_counters().await;
    let (_, range) = state(&scene.db).await;
    let (from, _) = range.expect("the pass in progress");
    let raised = validator(&scene.db).await;
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late-a", "a", 100, from + 1).await;
    land(&scene.db, "late-b", "b", 1000, from + 2).await;
    scene.coll_mod(doc! { "validator": raised }).await;
    fold_all(&fold).await;
    assert_outcome(&scene.ledger.record("more", "other", 1).await, "recorded");
    for _ in 0..3 {
        fold_all(&fold).await;
    }
    let (a, b) = (scene.counter("a").await, scene.counter("b").await);
    assert_eq!((a, b), (102, 1001), "each late event counted once");
}

/// An earlier attempt's record of its anchor, held up in the network,
/// arrives after a later attempt of the same pass anchored on its own raise
/// and applied counters: it is refused (an anchor is set once), so the
/// resumed pass keeps the sums it applied and the event that landed before
/// the later raise is counted once (found by the adversarial review: the
/// late anchor made the resume give that event to a repair — 201 for 101).
#[tokio::test]
async fn an_anchor_recorded_late_by_an_earlier_attempt_never_replaces_the_pass_s_own() {
    let scene = Scene::new("lowered_late_anchor").await;
    assert_outcome(&scene.ledger.record("x1", "a", 1).await, "recorded");
    assert_outcome(&scene.ledger.record("x2", "b", 1).await, "recorded");
    let (proxy, fold) = scene.fold_through_proxy().await;
    let anchor = || {
        Rule::command("update")
            .collection("views_events_fold")
            .mentions("intent.anchor")
    };
    // Attempt 1: its anchor's record is held in the network, every resend
    // cut: the pass stops with nothing applied.
    let held = proxy.rule(
        anchor()
            .nth(1)
            .then(Action::HoldRequest(Release::WhenReleased)),
    );
    let cut = proxy.rule(anchor().then(Action::CloseBeforeForwarding));
    assert!(
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
            .is_err(),
        "attempt 1 stops"
    );
    drop(cut);
    // A late collMod takes the floor away; an event lands in the range.
    let (_, range) = state(&scene.db).await;
    let (from, _) = range.expect("the pass in progress");
    lower_the_floor(&scene.db).await;
    land(&scene.db, "late", "b", 100, from + 1).await;
    // Attempt 2 anchors on its own raise, applies both counters, and its
    // commit is cut.
    let commit = proxy.rule(
        Rule::command("update")
            .collection("views_events_fold")
            .mentions("$unset")
            .then(Action::CloseBeforeForwarding),
    );
    assert!(
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
            .is_err(),
        "attempt 2 applies and stops at its commit"
    );
    drop(commit);
    // Attempt 1's anchor arrives now.
    let released = proxy.release_held().await;
    assert!(released.iter().any(|e| e.server_replied), "{released:?}");
    drop(held);
    for _ in 0..3 {
        fold_all(&fold).await;
    }
    // Oracle: a = e1 + x1; b = x2 + late, each once.
    assert_eq!(
        (scene.counter("a").await, scene.counter("b").await),
        (2, 101),
        "each event counted once"
    );
    assert_eq!(scene.ledger.value("b").await.unwrap().value, 101);
}
