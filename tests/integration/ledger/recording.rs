//! What recording tells the caller: a lost reply is recorded (told apart
//! from a duplicate by the lane and number it was sent with), an unknown is
//! settled by recording again within the retry horizon and refused past
//! it, a command error is not recorded, a refused resend stays unknown,
//! a ticket is refused by another ledger; `record_many` gives each event
//! its outcome, and one handle's concurrent callers share inserts.
//!
//! The oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, doc};
use tally::{Error, EventTicket, Ledger, Recording};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{FailPoint, TestContext, counter};
use crate::ledger::{assert_outcome, fold_of, ledger_on, ledger_through_proxy};

/// The insert landed and its reply was lost; the retry collides with it:
/// the stored lane and number are the recording's own, so it is recorded —
/// not a duplicate, which would tell the caller someone else recorded it.
#[tokio::test]
async fn a_lost_reply_is_recorded_not_duplicate_and_an_unknown_is_settled_by_recording_again() {
    let ctx = TestContext::new("ledger_lost_reply").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&recording, "recorded");
    assert_eq!(proxy.requests("insert").len(), 2, "sent, then retried once");

    // Both attempts lost: unknown. Recording the ticket again — on a fresh
    // lane, with a fresh number — finds its first attempt: recorded.
    proxy.clear_log();
    let recording = {
        let _lost = [
            proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply)),
            proxy.rule(Rule::command("insert").nth(2).then(Action::DropReply)),
        ];
        ledger.record("evt_2", "home", 1).await
    };
    let Recording::Unknown(ticket) = recording else {
        panic!("expected unknown, got {recording:?}");
    };
    for _ in 0..2 {
        let again = ledger.record_again(ticket.clone()).await.expect("in time");
        assert_outcome(&again, "recorded");
    }
    // Another handle (another process) settles it the same way.
    let other = Ledger::new(&ctx.client(false).await.store(), ledger.spec().clone());
    assert_outcome(&other.record_again(ticket).await.unwrap(), "recorded");
    assert_eq!(ledger.value("home").await.unwrap().value, 2);
}

/// A ticket whose first attempt is older than the retry horizon is never
/// sent again: its event may have been folded and forgotten.
#[tokio::test]
async fn an_unknown_past_the_retry_horizon_is_refused_and_nothing_is_sent() {
    let ctx = TestContext::new("ledger_horizon").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let ledger = ledger.with_retry_horizon(Duration::from_secs(2));
    let recording = {
        let _lost = proxy.rule(Rule::command("insert").then(Action::CloseBeforeForwarding));
        ledger.record("evt_1", "home", 1).await
    };
    let Recording::Unknown(ticket) = recording else {
        panic!("expected unknown, got {recording:?}");
    };
    tokio::time::sleep(Duration::from_millis(2100)).await;
    proxy.clear_log();
    match ledger.record_again(ticket).await {
        Err(err @ Error::EventRetryHorizonExceeded { .. }) => {
            let said = err.to_string();
            assert!(
                said.contains("evt_1") && said.contains("at most once"),
                "{said}"
            );
        }
        other => panic!("expected the horizon's refusal, got {other:?}"),
    }
    assert!(proxy.requests("insert").is_empty(), "nothing was sent");
}

#[tokio::test]
async fn a_command_error_is_not_recorded() {
    let ctx = TestContext::new("ledger_command_error").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let refused = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["insert"], "errorCode": 2 },
        )
        .await;
        ledger.record("evt_1", "home", 1).await
    };
    assert_outcome(&refused, "not_recorded");
    let events = client.collection("views_events");
    assert_eq!(events.count_documents(doc! {}).await.unwrap(), 0);
    assert_outcome(&ledger.record("evt_1", "home", 1).await, "recorded");
}

/// One ordered insert stops at the first key recorded before; the events
/// it inserted before it are confirmed by one majority read, the keys after
/// it are read in one `find`, and only the new ones sent again.
#[tokio::test]
async fn record_many_gives_each_event_its_outcome_in_few_round_trips() {
    let ctx = TestContext::new("ledger_record_many").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    assert_outcome(&ledger.record("seen", "a", 1).await, "recorded");
    assert_outcome(&ledger.record("other", "a", 1).await, "recorded");
    client.events.clear();
    let outcomes = ledger
        .record_many([
            ("e1", "a", 1),
            ("seen", "a", 1),
            ("e2", "b", 5),
            ("e1", "a", 1),
            ("other", "b", 1),
            ("zero", "a", 0),
            ("e3", "a", 1),
        ])
        .await;
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert_eq!(
        names,
        [
            "recorded",
            "duplicate",
            "recorded",
            "duplicate",
            "conflict",
            "not_recorded",
            "recorded"
        ]
    );
    assert_eq!(
        client.events.count("insert"),
        2,
        "stopped once, sent again once"
    );
    assert_eq!(
        client.events.count("find"),
        2,
        "those before confirmed at majority, the rest read at once"
    );
    assert_eq!(client.events.count("bulkWrite"), 0);
    assert_eq!(ledger.value("a").await.unwrap().value, 4);
    assert_eq!(ledger.value("b").await.unwrap().value, 5);
    // Recorded again as a whole (a backfill run twice): two round trips.
    client.events.clear();
    let again = ledger
        .record_many([("e1", "a", 1), ("seen", "a", 1), ("e2", "b", 5)])
        .await;
    assert!(again.iter().all(|r| r.name() == "duplicate"), "{again:?}");
    assert_eq!(
        (client.events.count("insert"), client.events.count("find")),
        (1, 1)
    );
}

/// The reply to an ordered insert carries a write error and no
/// write-concern error — as `mongos` sends it, having dropped the
/// write-concern error of the events it inserted before. Those events are
/// recorded only once a majority read finds them; when that read fails,
/// they are unknown, never recorded, and their tickets settle them.
#[tokio::test]
async fn events_before_a_refused_one_are_recorded_only_once_a_majority_read_finds_them() {
    let ctx = TestContext::new("ledger_hidden_wce").await;
    let client = ctx.client(false).await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    assert_outcome(&ledger.record("seen", "a", 1).await, "recorded");
    let batch = [
        ("e1", "a", 1),
        ("e2", "b", 5),
        ("seen", "a", 1),
        ("e3", "a", 1),
    ];

    // The confirming read fails: the events before the refused one are
    // unknown.
    let outcomes = {
        let _unread = proxy.rule(
            Rule::command("find")
                .collection("views_events")
                .mentions("readConcern")
                .then(Action::error(91, "ShutdownInProgress", &[])),
        );
        ledger.record_many(batch).await
    };
    // The key already held ("seen") is judged by a majority read too: that
    // read failing, it is unknown as well; the event after it is sent again.
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert_eq!(names, ["unknown", "unknown", "unknown", "recorded"]);
    let confirming = proxy.requests("find");
    assert!(
        confirming.iter().any(|e| {
            e.body
                .get_document("readConcern")
                .is_ok_and(|r| r.get_str("level").ok() == Some("majority"))
        }),
        "a majority read was sent: {confirming:#?}"
    );
    for outcome in outcomes {
        if let Recording::Unknown(ticket) = outcome {
            let key = ticket.event().key().to_owned();
            let again = ledger
                .record_again(ticket)
                .await
                .expect("within the horizon");
            let told = if key == "seen" {
                "duplicate"
            } else {
                "recorded"
            };
            assert_outcome(&again, told);
        }
    }

    // The read finds them: recorded.
    let outcomes = ledger
        .record_many([("f1", "a", 1), ("seen", "a", 1), ("f2", "b", 1)])
        .await;
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert_eq!(names, ["recorded", "duplicate", "recorded"]);

    let fold = fold_of(&client.store(), "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("fold");
    assert_eq!(
        counter(&client.collection("views"), "a").await,
        1 + 1 + 1 + 1
    );
    assert_eq!(counter(&client.collection("views"), "b").await, 5 + 1);
}

/// The whole insert's reply is lost: the retry collides on every event,
/// each with its own lane and number: all recorded, none duplicate.
#[tokio::test]
async fn record_many_with_a_lost_reply_is_recorded_once() {
    let ctx = TestContext::new("ledger_record_many_lost").await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let events: Vec<(String, &str, i64)> = (0..50).map(|i| (format!("e{i}"), "a", 1)).collect();
    let outcomes = {
        let _lost = proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply));
        ledger.record_many(events).await
    };
    assert!(
        outcomes.iter().all(|o| o.name() == "recorded"),
        "{outcomes:?}"
    );
    assert_eq!(ledger.value("a").await.unwrap().value, 50);
}

/// 16 callers recording at once on one handle: one insert in flight, the
/// others' events wait and go out together — far fewer inserts than
/// events, every event numbered apart.
#[tokio::test]
async fn concurrent_callers_on_one_handle_share_inserts_each_event_its_own_number() {
    let ctx = TestContext::new("ledger_group_commit").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    client.events.clear();
    let callers: Vec<_> = (0..16)
        .map(|c| {
            let ledger = ledger.clone();
            tokio::spawn(async move {
                for i in 0..20 {
                    let recording = ledger.record(format!("c{c}e{i}"), "hot", 1).await;
                    assert_outcome(&recording, "recorded");
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let inserts = client.events.count("insert");
    assert!(inserts <= 160, "{inserts} inserts for 320 events");
    let stored = documents(&client.store(), "views_events").await;
    assert_eq!(stored.len(), 320);
    let mut numbers: Vec<i64> = stored.iter().map(|d| d.get_i64("s").unwrap()).collect();
    numbers.sort_unstable();
    numbers.dedup();
    assert_eq!(numbers.len(), 320, "every event its own number");
    fold_all(&fold_of(&client.store(), "views")).await;
    assert_eq!(counter(&client.collection("views"), "hot").await, 320);
}

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

/// `record_many` documents "one round trip (one unordered `insert`
/// command)", but the driver splits a batch over `maxWriteBatchSize`
/// (100,000) or the 48 MB message limit into several commands, and when a
/// later command fails with anything but write errors the driver returns
/// that error alone, dropping what the earlier commands inserted
/// (mongodb-3.9.1 `action/insert_many.rs`: `_ => return Err(e)`).
/// `insert_many` then judges every event by that one error: a command
/// error on the first attempt is "not applied", so every event is
/// `not_recorded` — including the 100,000 that landed and that the fold
/// will count.
#[tokio::test]
async fn record_many_past_the_drivers_batch_limit_refused_part_way_never_says_not_recorded_for_events_that_landed()
 {
    let ctx = TestContext::new("ledger_review2_split_batch").await;
    // Inserting 100,000 events takes the test server tens of seconds, more
    // under load: one attempt must be allowed to finish (a timed-out first
    // attempt would meet the fail point with its retry instead), and the
    // driver's monitor must not give the server up meanwhile (its check
    // times out after connectTimeoutMS, and clears the pool: the insert
    // was cut at 7,001 events in one suite run).
    let client = ctx
        .client_with_uri_options("connectTimeoutMS=120000", false)
        .await;
    let store = client
        .store()
        .with_attempt_timeout(Duration::from_secs(600));
    let ledger = ledger_on(&store, "views").await;
    const EVENTS: usize = 100_001;
    let events: Vec<(String, &str, i64)> = (0..EVENTS).map(|i| (format!("e{i}"), "a", 1)).collect();
    let outcomes = {
        // The driver's second `insert` (the 100,001st event) is refused with
        // BadValue, a command error; the first goes through.
        let _refused = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "skip": 1, "times": 1 }),
            doc! { "failCommands": ["insert"], "errorCode": 2 },
        )
        .await;
        ledger.record_many(events).await
    };
    let stored = client
        .collection("views_events")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(stored, 100_000, "the driver's first insert command landed");
    let mut names = std::collections::BTreeMap::new();
    for recording in &outcomes[..100_000] {
        *names.entry(recording.name()).or_insert(0u64) += 1;
    }
    assert_eq!(
        names.get("not_recorded").copied().unwrap_or(0),
        0,
        "outcomes of the 100,000 events that are stored (and will be counted): {names:?}; \
         not_recorded promises nothing was written"
    );
}

/// Finding 3 (`not_recorded` for an event that landed). `record_again`
/// sends an unknown event again; when that resend is refused — its fresh
/// lane's registration fails (a network failure, twice), or its insert
/// meets a command error — the outcome is `NotRecorded`: "definitely not
/// recorded: nothing was written". But the ticket's first attempt landed
/// (or still may: it can be held up in the network), and the fold counts
/// it. A resend can never say more than "unknown" about the attempts
/// before it — the lanes protocol's resume says exactly that.
#[tokio::test]
async fn a_refused_resend_of_an_unknown_event_is_unknown_never_not_recorded() {
    let ctx = TestContext::new("review_ledger_resend_refused").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, recorder) = ledger_through_proxy(&ctx).await;
    // A resend that goes through finds the earlier attempt's landing.
    let ticket = landed_unknown(&proxy, &recorder, "evt_1").await;
    let again = recorder
        .record_again(ticket)
        .await
        .expect("within the horizon");
    // The resend's insert meets a command error.
    let ticket = landed_unknown(&proxy, &recorder, "evt_2").await;
    assert_outcome(&recorder.record("warm", "other", 1).await, "recorded");
    let again_2 = {
        let _refused = proxy.rule(Rule::command("insert").nth(1).then(Action::error(
            13,
            "Unauthorized",
            &[],
        )));
        recorder
            .record_again(ticket)
            .await
            .expect("within the horizon")
    };
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    assert_eq!(
        counter(&direct.collection("views"), "home").await,
        2,
        "both events landed and count"
    );
    assert_eq!(
        (again.name(), again_2.name()),
        ("recorded", "unknown"),
        "two landed events told not recorded: {again:?} / {again_2:?}"
    );
}

/// Finding 4 (a ticket settled on the wrong ledger). An `EventTicket`
/// does not name its events collection, so `record_again` takes another
/// ledger's ticket — a retry queue shared by two ledgers, a ticket pasted
/// into the wrong handle — and records the event there. The first insert
/// had landed in `views_events`: the event is now counted on both ledgers'
/// counters, and the caller was told `recorded`. (Lane tickets refuse
/// another collection before anything is sent since the ticket review.)
#[tokio::test]
async fn a_ticket_is_refused_by_another_ledger_before_anything_is_sent() {
    let ctx = TestContext::new("review_ledger_ticket_elsewhere").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let (proxy, views) = ledger_through_proxy(&ctx).await;
    let clicks = ledger_on(&store, "clicks").await;
    let ticket = landed_unknown(&proxy, &views, "evt_1").await;
    let landed = direct
        .collection("views_events")
        .count_documents(doc! { "_id": "evt_1" })
        .await
        .unwrap();
    assert_eq!(landed, 1, "the first attempt landed in views_events");
    let settled = clicks.record_again(ticket).await;
    let written = direct
        .collection("clicks_events")
        .count_documents(doc! {})
        .await
        .unwrap();
    assert_eq!(
        written, 0,
        "the views event was recorded in clicks_events too ({settled:?}): counted on two ledgers"
    );
    assert!(settled.is_err(), "refused: {settled:?}");
}

/// Records `event` through `recorder` while the proxy lets both attempts
/// land and loses both replies: unknown, and in the log.
async fn landed_unknown(proxy: &Proxy, recorder: &Ledger, event: &str) -> EventTicket {
    let _lost = [
        proxy.rule(Rule::command("insert").nth(1).then(Action::DropReply)),
        proxy.rule(Rule::command("insert").nth(2).then(Action::DropReply)),
    ];
    match recorder.record(event, "home", 1).await {
        Recording::Unknown(ticket) => ticket,
        other => panic!("expected unknown, got {other:?}"),
    }
}

/// A router (mongos) whose batch to a shard failed with a network error
/// after the shard applied it reports that as the *write error* of the op
/// it was sending (HostUnreachable, code 6): the event there is not
/// "definitely not written" — it landed — but unknown, its ticket to
/// settle it; the events before it are recorded (a majority read finds
/// them), and every event is counted once.
#[tokio::test]
async fn a_write_error_that_may_follow_a_write_leaves_the_event_unknown_not_unrecorded() {
    let ctx = TestContext::new("ledger_write_error_maybe_applied").await;
    let client = ctx.client(false).await;
    let (proxy, ledger) = ledger_through_proxy(&ctx).await;
    let outcomes = {
        let _mongos = proxy.rule(
            Rule::command("insert")
                .collection("views_events")
                .nth(1)
                .then(Action::AmendReply(doc! {
                    "n": 1,
                    "writeErrors": [{
                        "index": 1,
                        "code": 6,
                        "codeName": "HostUnreachable",
                        "errmsg": "Connection refused: shard01/host:27018",
                    }],
                })),
        );
        ledger
            .record_many([("e1", "a", 1), ("e2", "a", 1), ("e3", "a", 1)])
            .await
    };
    let names: Vec<&str> = outcomes.iter().map(Recording::name).collect();
    assert_eq!(names, ["recorded", "unknown", "recorded"], "{outcomes:?}");
    // The unknown one settles as recorded: it is there, ours.
    let Recording::Unknown(ticket) = &outcomes[1] else {
        unreachable!()
    };
    let settled = ledger.record_again(ticket.clone()).await.expect("in time");
    assert!(settled.is_counted(), "{settled:?}");
    fold_all(&fold_of(&client.store(), "views")).await;
    assert_eq!(counter(&client.collection("views"), "a").await, 3);
}
