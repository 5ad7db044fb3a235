//! The black-pipe proxy itself: it passes traffic through unchanged, each
//! action does exactly what it promises to the client and to the server, and
//! its log tells the truth about both.

use std::future::Future;
use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};
use mongodb::error::{Error, ErrorKind};
use mongodb::{Client, Collection};

use crate::common::proxy::{
    Action, Exchange, FrameError, OP_MSG, OP_QUERY, Proxy, Release, Rule, WireMessage,
    encode_op_msg, upstream_of,
};
use crate::common::{TestClient, TestContext};

/// How long a test waits for something that should take milliseconds.
const PATIENCE: Duration = Duration::from_secs(5);

/// One test's setup: its database, a proxy in front of the server, a client
/// through the proxy and a direct client for the server's side of the truth.
struct Rig {
    ctx: TestContext,
    proxy: Proxy,
    through: Client,
    direct: TestClient,
}

impl Rig {
    async fn new(name: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let through = ctx.client_through(&proxy, false).await.client;
        let direct = ctx.client(false).await;
        Self {
            ctx,
            proxy,
            through,
            direct,
        }
    }

    /// `name` as the client through the proxy sees it.
    fn through(&self, name: &str) -> Collection<Document> {
        self.through.database(&self.ctx.db_name).collection(name)
    }
}

/// Polls `check` until it holds; panics with `what` after [`PATIENCE`].
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {PATIENCE:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The one exchange named `command` on `collection`; panics unless there is
/// exactly one.
fn only(log: &[Exchange], command: &str, collection: &str) -> Exchange {
    let matching: Vec<&Exchange> = on(log, command, collection).collect();
    assert_eq!(matching.len(), 1, "one {command} on {collection}: {log:#?}");
    matching[0].clone()
}

fn on<'a>(
    log: &'a [Exchange],
    command: &'a str,
    collection: &'a str,
) -> impl Iterator<Item = &'a Exchange> {
    log.iter().filter(move |e| {
        e.command.as_deref() == Some(command) && e.collection.as_deref() == Some(collection)
    })
}

fn assert_network_error(err: &Error) {
    assert!(
        matches!(*err.kind, ErrorKind::Io(_)),
        "expected an I/O error, got {err:?}"
    );
}

#[tokio::test]
async fn traffic_passes_through_and_is_logged() {
    let rig = Rig::new("proxy_pass_through").await;
    let items = rig.through("items");
    items
        .insert_one(doc! { "_id": 1, "n": 1 })
        .await
        .expect("insert through the proxy");
    let found = items.find_one(doc! { "_id": 1 }).await.expect("find");
    assert_eq!(found, Some(doc! { "_id": 1, "n": 1 }));
    items
        .update_one(doc! { "_id": 1 }, doc! { "$set": { "n": 2 } })
        .await
        .expect("update through the proxy");
    let direct = rig.direct.collection("items");
    assert_eq!(
        direct.find_one(doc! {}).await.unwrap(),
        Some(doc! { "_id": 1, "n": 2 })
    );

    let log = rig
        .proxy
        .wait_until("the update's reply is delivered", PATIENCE, |log| {
            on(log, "update", "items").any(|e| e.settled)
        })
        .await;
    for command in ["insert", "find", "update"] {
        let exchange = only(&log, command, "items");
        assert_eq!(exchange.opcode, OP_MSG);
        assert!(exchange.expects_reply);
        assert_eq!(exchange.action, None);
        assert!(
            exchange.reached_server && exchange.server_replied && exchange.reply_delivered,
            "{exchange:#?}"
        );
    }
    // The insert's `documents` travel as a kind-1 sequence; the log merges it.
    let insert = only(&log, "insert", "items");
    assert_eq!(
        insert.body.get_array("documents").unwrap(),
        &vec![Bson::Document(doc! { "_id": 1, "n": 1 })]
    );
    assert_eq!(insert.body.get_str("$db").unwrap(), rig.ctx.db_name);
    assert!(only(&log, "update", "items").body_mentions("$set"));
    assert_eq!(rig.proxy.requests("update").len(), 1);

    // The driver's handshake and monitoring speak OP_MSG too (`hello`, or
    // the legacy `isMaster` name inside an OP_MSG): no OP_QUERY at all.
    assert!(
        log.iter()
            .any(|e| matches!(e.command.as_deref(), Some("hello" | "isMaster"))),
        "{log:#?}"
    );
    assert!(log.iter().all(|e| e.opcode == OP_MSG), "{log:#?}");
    // The driver numbers requests across all its connections.
    let ids: std::collections::HashSet<i32> = log.iter().map(|e| e.request_id).collect();
    assert_eq!(ids.len(), log.len(), "{log:#?}");

    rig.proxy.clear_log();
    assert!(rig.proxy.requests("insert").is_empty());
}

#[tokio::test]
async fn drop_reply_executes_on_the_server_but_the_client_sees_a_network_error() {
    let rig = Rig::new("proxy_drop_reply").await;
    let _rule = rig.proxy.rule(
        Rule::command("insert")
            .collection("views")
            .nth(1)
            .then(Action::DropReply),
    );
    let views = rig.through("views");
    let err = views
        .insert_one(doc! { "_id": "dropped" })
        .await
        .expect_err("the reply was dropped");
    assert_network_error(&err);
    let direct = rig.direct.collection("views");
    assert_eq!(
        direct
            .count_documents(doc! { "_id": "dropped" })
            .await
            .unwrap(),
        1,
        "the server executed the insert"
    );

    // The driver recovers on a new connection: only the 1st insert was hit.
    views
        .insert_one(doc! { "_id": "after" })
        .await
        .expect("the next insert goes through");
    let log = rig
        .proxy
        .wait_until("both inserts settle", PATIENCE, |log| {
            on(log, "insert", "views").filter(|e| e.settled).count() == 2
        })
        .await;
    let inserts: Vec<&Exchange> = on(&log, "insert", "views").collect();
    let (dropped, after) = (inserts[0], inserts[1]);
    assert_eq!(dropped.action, Some(Action::DropReply));
    assert!(dropped.reached_server && dropped.server_replied && !dropped.reply_delivered);
    assert_eq!(after.action, None);
    assert!(after.reply_delivered);
    assert_ne!(
        dropped.connection, after.connection,
        "the dropped pair is closed"
    );
}

#[tokio::test]
async fn close_before_forwarding_never_reaches_the_server() {
    let rig = Rig::new("proxy_close_before_forwarding").await;
    let direct = rig.direct.collection("views");
    direct.insert_one(doc! { "_id": 1, "n": 0 }).await.unwrap();
    let _rule = rig
        .proxy
        .rule(Rule::command("update").then(Action::CloseBeforeForwarding));
    let err = rig
        .through("views")
        .update_one(doc! { "_id": 1 }, doc! { "$inc": { "n": 1 } })
        .await
        .expect_err("the connection was closed");
    assert_network_error(&err);
    assert_eq!(
        direct.find_one(doc! {}).await.unwrap(),
        Some(doc! { "_id": 1, "n": 0 })
    );
    let update = only(&rig.proxy.log(), "update", "views");
    assert_eq!(update.action, Some(Action::CloseBeforeForwarding));
    assert!(!update.reached_server && !update.server_replied && !update.reply_delivered);
}

#[tokio::test]
async fn a_delayed_reply_is_lost_when_the_client_gives_up() {
    let rig = Rig::new("proxy_delay_reply").await;
    // Far longer than the wait below: the reply can only be settled by the
    // client closing its connection, however slow the machine is.
    let delay = PATIENCE * 4;
    let _rule = rig
        .proxy
        .rule(Rule::command("insert").then(Action::DelayReply(delay)));
    let started = tokio::time::Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_millis(200),
        rig.through("slow").insert_one(doc! { "_id": 1 }),
    )
    .await;
    assert!(outcome.is_err(), "the client should time out: {outcome:?}");

    let direct = rig.direct.collection("slow");
    eventually("the insert is visible on the server", || async {
        direct.count_documents(doc! {}).await.unwrap() == 1
    })
    .await;
    // Dropping the operation's future makes the driver close its connection
    // (checked in while executing), which ends the pair: the held reply is
    // never delivered, well before the delay runs out.
    let log = rig
        .proxy
        .wait_until("the delayed insert settles", PATIENCE, |log| {
            on(log, "insert", "slow").any(|e| e.settled)
        })
        .await;
    assert!(
        started.elapsed() < delay,
        "settled after {:?}",
        started.elapsed()
    );
    let insert = only(&log, "insert", "slow");
    assert_eq!(insert.action, Some(Action::DelayReply(delay)));
    assert!(insert.reached_server);
    // Whether the server's reply got back to the proxy before the client
    // closed depends on the server's speed (under load it may not have);
    // either way the held reply is never delivered.
    assert!(!insert.reply_delivered);
}

#[tokio::test]
async fn a_delayed_reply_arrives_late_to_a_patient_client() {
    let rig = Rig::new("proxy_delay_reply_patient").await;
    let delay = Duration::from_millis(300);
    let _rule = rig
        .proxy
        .rule(Rule::command("find").then(Action::DelayReply(delay)));
    let started = tokio::time::Instant::now();
    rig.through("slow")
        .find_one(doc! {})
        .await
        .expect("the delayed find completes");
    assert!(started.elapsed() >= delay);
    let log = rig
        .proxy
        .wait_until("the find settles", PATIENCE, |log| {
            on(log, "find", "slow").any(|e| e.settled)
        })
        .await;
    let find = only(&log, "find", "slow");
    assert!(find.reached_server && find.server_replied && find.reply_delivered);
}

#[tokio::test]
async fn an_injected_error_carries_its_code_and_labels_and_changes_nothing() {
    let rig = Rig::new("proxy_error").await;
    let _rule = rig.proxy.rule(Rule::command("insert").then(Action::error(
        10107,
        "NotWritablePrimary",
        &["RetryableWriteError"],
    )));
    let err = rig
        .through("views")
        .insert_one(doc! { "_id": 1 })
        .await
        .expect_err("the proxy answered with an error");
    let ErrorKind::Command(command_error) = &*err.kind else {
        panic!("expected a command error, got {err:?}");
    };
    assert_eq!(command_error.code, 10107);
    assert_eq!(command_error.code_name, "NotWritablePrimary");
    assert!(err.contains_label("RetryableWriteError"), "{err:?}");
    assert_eq!(
        rig.direct
            .collection("views")
            .count_documents(doc! {})
            .await
            .unwrap(),
        0
    );
    let log = rig
        .proxy
        .wait_until("the insert settles", PATIENCE, |log| {
            on(log, "insert", "views").any(|e| e.settled)
        })
        .await;
    let insert = only(&log, "insert", "views");
    assert!(matches!(
        insert.action,
        Some(Action::Error { code: 10107, .. })
    ));
    assert!(!insert.reached_server && !insert.server_replied && insert.reply_delivered);
}

/// The duplicate-key error from `err`: its code, whether it came as a write
/// error (rather than a command error), and its `keyPattern`.
fn duplicate_key_of(err: &Error) -> (i32, bool, Option<Document>) {
    let reply = err
        .server_response()
        .and_then(|raw| Document::try_from(raw).ok());
    let key_pattern = |d: &Document| d.get_document("keyPattern").ok().cloned();
    let first_write_error_pattern = || {
        reply.as_ref().and_then(|r| {
            r.get_array("writeErrors")
                .ok()?
                .first()?
                .as_document()
                .and_then(key_pattern)
        })
    };
    match &*err.kind {
        ErrorKind::Write(mongodb::error::WriteFailure::WriteError(write)) => {
            (write.code, true, first_write_error_pattern())
        }
        ErrorKind::Command(command) => (command.code, false, reply.as_ref().and_then(key_pattern)),
        other => panic!("expected a duplicate-key error, got {other:?}"),
    }
}

#[tokio::test]
async fn an_injected_duplicate_key_has_the_shape_the_server_gives_each_command() {
    let rig = Rig::new("proxy_duplicate_key").await;
    let views = rig.through("views");
    let _insert = rig
        .proxy
        .rule(Rule::command("insert").nth(1).then(Action::DuplicateKey));
    let _update = rig
        .proxy
        .rule(Rule::command("update").nth(1).then(Action::DuplicateKey));
    let _modify = rig.proxy.rule(
        Rule::command("findAndModify")
            .nth(1)
            .then(Action::DuplicateKey),
    );

    // The driver keeps no reply for insert errors, so the insert's shape is
    // read from the raw command's answer.
    let reply = rig
        .through
        .database(&rig.ctx.db_name)
        .run_command(doc! { "insert": "views", "documents": [{ "_id": "a" }] })
        .await
        .expect("a write error is an ok: 1 reply");
    let error = reply.get_array("writeErrors").unwrap()[0]
        .as_document()
        .unwrap()
        .clone();
    assert_eq!(reply.get_f64("ok").ok(), Some(1.0), "{reply}");
    assert_eq!(
        (error.get_i32("code").ok(), error.get_i32("index").ok()),
        (Some(11000), Some(0))
    );
    assert_eq!(
        error.get_document("keyValue").ok(),
        Some(&doc! { "_id": "a" })
    );
    let err = views
        .update_one(doc! { "_id": "b" }, doc! { "$inc": { "n": 1 } })
        .upsert(true)
        .await
        .unwrap_err();
    assert_eq!(
        duplicate_key_of(&err),
        (11000, true, Some(doc! { "_id": 1 }))
    );
    let err = views
        .find_one_and_update(doc! { "_id": "c" }, doc! { "$inc": { "n": 1 } })
        .upsert(true)
        .await
        .unwrap_err();
    assert_eq!(
        duplicate_key_of(&err),
        (11000, false, Some(doc! { "_id": 1 }))
    );
    let (_, _, pattern) = duplicate_key_of(&err);
    assert!(
        pattern.is_some_and(|p| p.keys().eq(["_id"])),
        "the reply's keyPattern, which tally reads, names _id alone"
    );
    let direct = rig.direct.collection("views");
    assert_eq!(
        direct.count_documents(doc! {}).await.unwrap(),
        0,
        "nothing was written"
    );
    let log = rig.proxy.log();
    for command in ["insert", "update", "findAndModify"] {
        let exchange = only(&log, command, "views");
        assert_eq!(exchange.action, Some(Action::DuplicateKey));
        assert!(
            !exchange.reached_server && exchange.reply_delivered,
            "{exchange:#?}"
        );
    }

    // The server's own replies are recorded, delivered or not.
    views
        .update_one(doc! { "_id": "b" }, doc! { "$inc": { "n": 1 } })
        .upsert(true)
        .await
        .expect("the second update passes");
    let log = rig
        .proxy
        .wait_until("the second update settles", PATIENCE, |log| {
            on(log, "update", "views").filter(|e| e.settled).count() == 2
        })
        .await;
    let reply = on(&log, "update", "views")
        .nth(1)
        .unwrap()
        .reply
        .clone()
        .expect("reply");
    assert_eq!(reply.get_i32("n").ok(), Some(1), "{reply}");
}

/// A held request: the client's attempt fails at once, a later request
/// goes through, and the held one reaches the server only when the test
/// releases it — on its own upstream connection, its reply recorded.
#[tokio::test]
async fn a_held_request_reaches_the_server_only_when_released() {
    let rig = Rig::new("proxy_hold").await;
    let _rule = rig.proxy.rule(
        Rule::command("insert")
            .collection("held")
            .nth(1)
            .then(Action::HoldRequest(Release::WhenReleased)),
    );
    let held = rig.through("held");
    let err = held
        .insert_one(doc! { "_id": 1 })
        .await
        .expect_err("the held attempt fails");
    assert_network_error(&err);
    held.insert_one(doc! { "_id": 2 })
        .await
        .expect("a later request goes through");
    let direct = rig.direct.collection("held");
    let ids = || async {
        let mut ids = direct.distinct("_id", doc! {}).await.unwrap();
        ids.sort_by_key(|id| id.as_i32());
        ids
    };
    assert_eq!(ids().await, [Bson::Int32(2)], "not forwarded yet");
    let log = rig.proxy.log();
    let inserts: Vec<&Exchange> = on(&log, "insert", "held").collect();
    assert!(
        !inserts[0].reached_server && !inserts[0].settled,
        "{log:#?}"
    );
    assert!(inserts[1].reply_delivered);

    let released = rig.proxy.release_held().await;
    assert_eq!(released.len(), 1, "{released:#?}");
    let first = &released[0];
    assert_eq!(
        first.action,
        Some(Action::HoldRequest(Release::WhenReleased))
    );
    assert!(first.reached_server && first.server_replied && !first.reply_delivered);
    assert_eq!(first.reply.as_ref().unwrap().get_i32("n").ok(), Some(1));
    assert!(
        first.forwarded > inserts[1].forwarded,
        "forwarded after the later request: {first:#?}"
    );
    assert_eq!(ids().await, [Bson::Int32(1), Bson::Int32(2)]);
}

/// Released after the client's retry completed: a plain `$inc` whose first
/// attempt was held up applies twice — the hazard the fault exists for.
#[tokio::test]
async fn a_held_request_is_forwarded_after_the_later_attempts_reply() {
    let rig = Rig::new("proxy_hold_after_retry").await;
    let _rule = rig.proxy.rule(
        Rule::command("update")
            .collection("views")
            .nth(1)
            .then(Action::HoldRequest(Release::AfterLaterReplies(1))),
    );
    let views = rig.through("views");
    let inc = || {
        views
            .update_one(doc! { "_id": 1 }, doc! { "$inc": { "n": 1 } })
            .upsert(true)
    };
    assert_network_error(&inc().await.expect_err("the held attempt fails"));
    inc().await.expect("the retry goes through");
    let log = rig
        .proxy
        .wait_until("the held update was forwarded", PATIENCE, |log| {
            on(log, "update", "views").all(|e| e.settled)
        })
        .await;
    let updates: Vec<&Exchange> = on(&log, "update", "views").collect();
    assert_eq!(updates.len(), 2);
    assert!(updates[0].reached_server && updates[0].server_replied);
    assert!(!updates[0].reply_delivered);
    let direct = rig.direct.collection("views");
    assert_eq!(
        direct.find_one(doc! {}).await.unwrap(),
        Some(doc! { "_id": 1, "n": 2 }),
        "applied by the retry, then again by the held original"
    );
}

#[tokio::test]
async fn nth_hits_only_the_nth_matching_request() {
    let rig = Rig::new("proxy_nth").await;
    let direct = rig.direct.collection("marks");
    direct
        .insert_one(doc! { "_id": 1, "seen": [] })
        .await
        .unwrap();
    let _rule = rig.proxy.rule(
        Rule::command("update")
            .collection("marks")
            .nth(3)
            .then(Action::CloseBeforeForwarding),
    );
    let marks = rig.through("marks");
    // Updates elsewhere do not count towards the rule's nth.
    rig.through("other")
        .update_one(doc! {}, doc! { "$set": { "x": 1 } })
        .await
        .unwrap();
    let mut failed = Vec::new();
    for i in 1..=5 {
        if marks
            .update_one(doc! { "_id": 1 }, doc! { "$push": { "seen": i } })
            .await
            .is_err()
        {
            failed.push(i);
        }
    }
    assert_eq!(failed, [3]);
    let doc = direct.find_one(doc! {}).await.unwrap().unwrap();
    assert_eq!(
        doc.get_array("seen").unwrap(),
        &vec![1.into(), 2.into(), 4.into(), 5.into()]
    );
    let hit: Vec<bool> = on(&rig.proxy.log(), "update", "marks")
        .map(|e| e.action.is_some())
        .collect();
    assert_eq!(hit, [false, false, true, false, false]);
}

/// Runs 24 finds under a rule failing each with probability ½ from `seed`;
/// returns which ones failed.
async fn roll_dice(rig: &Rig, seed: u64) -> Vec<usize> {
    let _rule = rig.proxy.rule(
        Rule::command("find")
            .collection("dice")
            .probability(0.5, seed)
            .then(Action::error(2, "BadValue", &[])),
    );
    let dice = rig.through("dice");
    let mut failed = Vec::new();
    for i in 0..24 {
        if dice.find_one(doc! {}).await.is_err() {
            failed.push(i);
        }
    }
    failed
}

#[tokio::test]
async fn probability_with_a_seed_is_deterministic() {
    let rig = Rig::new("proxy_probability").await;
    let first = roll_dice(&rig, 42).await;
    let from_log: Vec<usize> = on(&rig.proxy.log(), "find", "dice")
        .enumerate()
        .filter(|(_, e)| e.action.is_some())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(first, from_log, "the log agrees with what the client saw");
    assert!(!first.is_empty() && first.len() < 24, "{first:?}");

    assert_eq!(roll_dice(&rig, 42).await, first, "same seed, same hits");
    assert_ne!(roll_dice(&rig, 7).await, first, "another seed, other hits");
}

#[tokio::test]
async fn dropping_the_guard_removes_the_rule() {
    let rig = Rig::new("proxy_guard").await;
    let guarded = rig.through("guarded");
    let rule = rig
        .proxy
        .rule(Rule::command("insert").then(Action::error(2, "BadValue", &[])));
    guarded
        .insert_one(doc! { "_id": 1 })
        .await
        .expect_err("the rule is active");
    drop(rule);
    guarded
        .insert_one(doc! { "_id": 2 })
        .await
        .expect("the rule is gone");
    let ids: Vec<Bson> = rig
        .direct
        .collection("guarded")
        .distinct("_id", doc! {})
        .await
        .unwrap();
    assert_eq!(ids, [Bson::Int32(2)]);
    let actions: Vec<bool> = on(&rig.proxy.log(), "insert", "guarded")
        .map(|e| e.action.is_some())
        .collect();
    assert_eq!(actions, [true, false]);
}

#[tokio::test]
async fn the_first_added_rule_wins_and_every_rule_counts_alone() {
    let rig = Rig::new("proxy_rule_order").await;
    let _first =
        rig.proxy.rule(
            Rule::command("find")
                .nth(1)
                .then(Action::error(1, "InternalError", &[])),
        );
    let _second = rig
        .proxy
        .rule(
            Rule::any()
                .collection("order")
                .nth(2)
                .then(Action::error(2, "BadValue", &[])),
        );
    let codes = rig.through("order");
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(match codes.find_one(doc! {}).await {
            Ok(_) => 0,
            Err(err) => match *err.kind {
                ErrorKind::Command(c) => c.code,
                other => panic!("unexpected error {other:?}"),
            },
        });
    }
    // Both select the 1st find (the first rule wins); the second rule's own
    // count reaches 2 at the 2nd find, so the second rule hits it.
    assert_eq!(seen, [1, 2, 0]);
}

#[tokio::test]
async fn the_streaming_monitor_keeps_working_through_the_proxy() {
    let rig = Rig::new("proxy_streaming").await;
    // The monitor sends one awaitable `hello` and the server answers it
    // every heartbeat (500 ms here) with `moreToCome` replies.
    let log = rig
        .proxy
        .wait_until("an awaitable hello streams 3 replies", PATIENCE, |log| {
            log.iter().any(|e| {
                e.command.as_deref() == Some("hello")
                    && e.body.contains_key("topologyVersion")
                    && e.server_replies >= 3
            })
        })
        .await;
    let stream = log
        .iter()
        .find(|e| e.server_replies >= 3)
        .expect("the streamed hello");
    assert!(stream.reply_delivered && !stream.settled, "{stream:#?}");
    let requests_on_monitor = log
        .iter()
        .filter(|e| e.connection == stream.connection && e.command.as_deref() == Some("hello"))
        .count();
    assert_eq!(
        requests_on_monitor, 1,
        "one request, many replies: {log:#?}"
    );
    rig.through("after")
        .find_one(doc! {})
        .await
        .expect("the client is healthy");
}

#[tokio::test]
async fn dropping_the_proxy_closes_its_connections() {
    let rig = Rig::new("proxy_shutdown").await;
    let address = rig.proxy.address();
    let mut idle = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the proxy");
    let Rig { proxy, .. } = rig;
    drop(proxy);
    let mut buffer = [0u8; 1];
    let read = tokio::time::timeout(
        PATIENCE,
        tokio::io::AsyncReadExt::read(&mut idle, &mut buffer),
    )
    .await
    .expect("the connection is closed promptly");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    eventually("the proxy stops listening", || async {
        tokio::net::TcpStream::connect(address).await.is_err()
    })
    .await;
}

/// `OP_MSG` bytes for `body` plus one document sequence, written out field
/// by field as the wire protocol specifies, with a (dummy) checksum.
fn hand_built_op_msg(
    request_id: i32,
    body: &Document,
    identifier: &str,
    sequence: &[Document],
) -> Vec<u8> {
    let mut section = Vec::new();
    section.extend_from_slice(identifier.as_bytes());
    section.push(0);
    for document in sequence {
        section.extend_from_slice(&document.to_vec().unwrap());
    }
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0i32.to_le_bytes()); // length, patched below
    bytes.extend_from_slice(&request_id.to_le_bytes());
    bytes.extend_from_slice(&0i32.to_le_bytes()); // responseTo
    bytes.extend_from_slice(&2013i32.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes()); // checksumPresent
    bytes.push(0);
    bytes.extend_from_slice(&body.to_vec().unwrap());
    bytes.push(1);
    bytes.extend_from_slice(&(section.len() as i32 + 4).to_le_bytes());
    bytes.extend_from_slice(&section);
    bytes.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]); // not verified
    let length = bytes.len() as i32;
    bytes[..4].copy_from_slice(&length.to_le_bytes());
    bytes
}

#[test]
fn framing_merges_document_sequences_into_the_body() {
    let statements = [
        doc! { "q": { "_id": 1 }, "u": { "$inc": { "counter": 1 } } },
        doc! { "q": { "_id": 2 }, "u": { "$pull": { "pending": "t1" } } },
    ];
    let bytes = hand_built_op_msg(
        7,
        &doc! { "update": "views", "ordered": true, "$db": "tally" },
        "updates",
        &statements,
    );
    let message = WireMessage::parse(&bytes).expect("parse");
    assert_eq!(message.request_id, 7);
    assert_eq!(message.response_to, 0);
    assert_eq!(message.opcode, OP_MSG);
    assert_eq!(message.flag_bits, 1);
    assert!(message.expects_reply());
    assert_eq!(message.command.as_deref(), Some("update"));
    assert_eq!(message.collection.as_deref(), Some("views"));
    let updates: Vec<Bson> = statements.iter().cloned().map(Bson::Document).collect();
    assert_eq!(
        message.body,
        doc! { "update": "views", "ordered": true, "$db": "tally", "updates": updates }
    );

    // Cut anywhere, the message is rejected rather than misread.
    for cut in [3, 16, 21, bytes.len() - 1] {
        let mut short = bytes[..cut].to_vec();
        if short.len() >= 4 {
            short[..4].copy_from_slice(&(cut as i32).to_le_bytes());
        }
        assert!(WireMessage::parse(&short).is_err(), "cut at {cut}");
    }
    let mut unknown_kind = bytes.clone();
    unknown_kind[20] = 9;
    assert!(matches!(
        WireMessage::parse(&unknown_kind),
        Err(FrameError::UnknownSection(9))
    ));
}

#[test]
fn framing_reads_op_query_and_round_trips_injected_replies() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0i32.to_le_bytes());
    bytes.extend_from_slice(&5i32.to_le_bytes());
    bytes.extend_from_slice(&0i32.to_le_bytes());
    bytes.extend_from_slice(&OP_QUERY.to_le_bytes());
    bytes.extend_from_slice(&0i32.to_le_bytes()); // flags
    bytes.extend_from_slice(b"admin.$cmd\0");
    bytes.extend_from_slice(&0i32.to_le_bytes()); // numberToSkip
    bytes.extend_from_slice(&(-1i32).to_le_bytes()); // numberToReturn
    bytes.extend_from_slice(&doc! { "isMaster": 1, "helloOk": true }.to_vec().unwrap());
    let length = bytes.len() as i32;
    bytes[..4].copy_from_slice(&length.to_le_bytes());
    let query = WireMessage::parse(&bytes).expect("parse OP_QUERY");
    assert_eq!(query.command.as_deref(), Some("isMaster"));
    assert_eq!(query.collection, None);
    assert!(query.expects_reply());

    let body = doc! { "ok": 0.0, "code": 2 };
    let reply = WireMessage::parse(&encode_op_msg(11, 5, &body)).expect("parse reply");
    assert_eq!((reply.request_id, reply.response_to), (11, 5));
    assert_eq!(reply.flag_bits, 0);
    assert_eq!(reply.body, body);
}
