//! The ledger under the second adversarial review (r13): a `record_many`
//! larger than one `insert` command can carry, refused part-way; the
//! command line's reconcile run folding a ledger after another collection
//! took a while; a counter key redelivered as a neighbouring number past
//! 2^53; a counter key shaped like a query operator; and (passing) a
//! recovery racing a live fold's chunked claim.
//!
//! The oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, doc};

use crate::cli::{tallyd, text, write_config};
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::{FailPoint, TestContext};
use crate::ledger::{assert_outcome, ledger_on};

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
    let client = ctx.client(false).await;
    // Inserting 100,000 events takes the test server tens of seconds, more
    // under load: one attempt must be allowed to finish (a timed-out first
    // attempt would meet the fail point with its retry instead).
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

/// `tallyd reconcile` reads the server's clock once and passes that `now`
/// to every collection's run; a ledger's fold marks its batches at `now`
/// plus the time its own pass has run (`EventFold::fold`). A ledger
/// reconciled after another collection that took a while is marked folded
/// at the command's start — before events recorded meanwhile even existed:
/// their dedupe window (`event_retention` after `f`) is short by the time
/// the earlier collections took (hours on a large collection), and a
/// redelivery in that gap is recorded and counted again.
#[tokio::test]
async fn the_command_lines_reconcile_marks_a_later_collections_events_at_their_fold_time() {
    let ctx = TestContext::new("ledger_review2_cli_now").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    // The first collection exists (its run reads it).
    client
        .collection("big")
        .insert_one(doc! { "_id": "x", "counter": 1i64 })
        .await
        .unwrap();
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let config = format!(
        "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"10s\"\n\
         [[collections]]\nname = \"big\"\n[[collections]]\nname = \"views\"\nledger = true\n",
        ctx.child_uri_through(&proxy, false),
        ctx.db_name
    );
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config);
    // The first collection's run is slow (a large collection: here its
    // report's first reply takes 5 s).
    let slow = proxy.rule(
        Rule::command("aggregate")
            .collection("big")
            .nth(1)
            .then(Action::DelayReply(Duration::from_secs(5))),
    );
    let run =
        tokio::spawn(async move { tallyd(&["--config", &path, "reconcile", "--json"], &[]).await });
    let waited = tokio::time::Instant::now();
    while proxy.requests("aggregate").is_empty() {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the run reached big"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Meanwhile, an event of the second collection is recorded.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let recorded_at = SystemTime::now();
    assert_outcome(&ledger.record("evt_1", "home", 1).await, "recorded");
    let output = run.await.unwrap();
    drop(slow);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let event = client
        .collection("views_events")
        .find_one(doc! { "_id": "evt_1" })
        .await
        .unwrap()
        .unwrap();
    let at = event.get_datetime("at").unwrap().to_system_time();
    let f = event
        .get_datetime("f")
        .unwrap_or_else(|_| panic!("evt_1 folded by the run: {event}"))
        .to_system_time();
    let early = at.duration_since(f).unwrap_or(Duration::ZERO);
    assert!(
        f >= recorded_at && early.is_zero(),
        "evt_1 was recorded at {at:?} and marked folded at {f:?}, {early:?} BEFORE it was \
         recorded (the command's start): its dedupe window ends that much early"
    );
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
    let fold = crate::ledger::fold_of(&store, "views", 100);
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

/// Safe path: a fold started elsewhere (a `tallyd reconcile`, a second
/// daemon) recovers a live fold's batch while its chunked claim is part-way
/// (the live fold's second chunk's reply is slow): recovery claims the
/// intent's ids with the same batch, lane and number, applies, marks; the
/// live fold then finds its lane's number applied everywhere. Every event
/// counted once, exact reads exact throughout.
#[tokio::test]
async fn a_recovery_racing_a_live_chunked_claim_counts_every_event_once() {
    let ctx = TestContext::new("ledger_review2_recovery_race").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    crate::ledger::record_spread(&ledger, 250, 3).await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let live = crate::ledger::fold_of(&through.store(), "views", 5000);
    let _slow = proxy.rule(
        Rule::command("update")
            .collection("views_events")
            .nth(2)
            .then(Action::DelayReply(Duration::from_secs(3))),
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let pass = {
        let stop = stop.clone();
        tokio::spawn(async move { live.fold(SystemTime::now(), &stop).await })
    };
    let waited = tokio::time::Instant::now();
    while proxy.requests("update").len() < 2 {
        assert!(waited.elapsed() < Duration::from_secs(20));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let values = |ledger: tally::Ledger| async move {
        let mut v = Vec::new();
        for c in 0..3 {
            v.push(ledger.value(format!("c{c}")).await.unwrap().value);
        }
        v
    };
    assert_eq!(values(ledger.clone()).await, [84, 83, 83]);
    let other = crate::ledger::fold_of(&store, "views", 5000);
    let recovered = other.recover(SystemTime::now()).await.expect("recovery");
    assert_eq!(recovered.recovered, 1, "{recovered:?}");
    assert_eq!(values(ledger.clone()).await, [84, 83, 83]);
    let run = pass.await.unwrap().expect("the live pass");
    assert_eq!(values(ledger.clone()).await, [84, 83, 83]);
    // More events through the live fold's lane, next number.
    let more: Vec<(String, String, i64)> = (250..260)
        .map(|i| (format!("e{i}"), format!("c{}", i % 3), 1))
        .collect();
    for recording in ledger.record_many(more).await {
        assert_outcome(&recording, "recorded");
    }
    let live = crate::ledger::fold_of(&store, "views", 5000);
    live.fold(SystemTime::now(), &stop)
        .await
        .expect("next pass");
    for (c, n) in [(0, 87), (1, 87), (2, 86)] {
        let name = format!("c{c}");
        assert_eq!(
            crate::common::counter(&direct.collection("views"), name.as_str()).await,
            n,
            "{name} (live run {run:?})"
        );
    }
    assert_eq!(values(ledger).await, [87, 87, 86]);
}
