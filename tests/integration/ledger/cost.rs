//! What the ledger costs follows the work, not the recorders: one-shot
//! recorders (a handle, or a `tallyd record` process, per event) cost the
//! fold and the exact reads what one long-lived recorder costs.

use std::time::SystemTime;

use mongodb::bson::doc;
use tally::{Ledger, Reconciler};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::{TestContext, counter};
use crate::ledger::{
    assert_outcome, documents, event_by_hand, fold_all, fold_of, ledger_on, number_of, server_now,
    unfolded,
};

/// One `Ledger` per event, as a handler per request or one `tallyd record`
/// per event makes: after 50 such recorders and after 2,000 more, the fold
/// state is the same size, an idle pass and an exact read send the same
/// commands, and every event is counted once.
#[tokio::test]
async fn one_shot_recorders_cost_the_fold_and_the_reads_what_one_recorder_costs() {
    let ctx = TestContext::new("ledger_one_shot").await;
    let store = ctx.client(false).await.store();
    let spec = ledger_on(&store, "views").await.spec().clone();
    let fold = fold_of(&store, "views");
    let record_one_shot = |range: std::ops::Range<usize>| {
        let store = store.clone();
        let spec = spec.clone();
        async move {
            for i in range {
                let once = Ledger::new(&store, spec.clone());
                let key = if i % 2 == 0 { "home" } else { "about" };
                assert_outcome(&once.record(format!("e{i}"), key, 1).await, "recorded");
            }
        }
    };
    record_one_shot(0..50).await;
    fold_all(&fold).await;
    // A pass between two events keeps both its cost and the reads'
    // reckoning honest: the last events are not folded yet.
    record_one_shot(50..52).await;
    let after_50 = cost(&ctx, "home").await;

    let many = one_shot_recorders();
    let chunk = many.div_ceil(4);
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let from = 52 + w * chunk;
            tokio::spawn(record_one_shot(from..(from + chunk).min(52 + many)))
        })
        .collect();
    for (i, writer) in writers.into_iter().enumerate() {
        writer.await.unwrap();
        if i % 2 == 1 {
            fold_all(&fold).await;
        }
    }
    fold_all(&fold).await;
    record_one_shot(52 + many..54 + many).await;
    let after_many = cost(&ctx, "home").await;
    assert_eq!(
        after_many, after_50,
        "the ledger's cost grew with the number of recorder processes"
    );

    fold_all(&fold).await;
    let total = 54 + many;
    let views = ctx.client(false).await.collection("views");
    assert_eq!(counter(&views, "home").await, total.div_ceil(2) as i64);
    assert_eq!(counter(&views, "about").await, (total / 2) as i64);
    assert_eq!(unfolded(&fold).await, 0);
}

/// Finding 9 (cost grows with recorder processes, not events). Every
/// handle mints a lane, and a lane stays registered (surveyed by every
/// pass, read by every exact read) for an hour and more, and keeps an
/// entry in the state document's `folded` map for the whole dedupe window.
/// `tallyd record` is one process — one lane — per event; so is a
/// serverless webhook handler making its `Ledger` per invocation. With the
/// 120 recorder processes of two minutes at one event a second, one exact
/// read of one counter sends 125 commands (one `find` per live lane, plus
/// every registration read twice), and a pass with nothing to fold 605
/// (four survey probes and a backlog count per lane); with the hour's
/// 4,000 live lanes, thirty times that. At that rate the `folded` map gains 86,400 entries a day, each
/// kept 7 days (34 bytes each: 20 MB, past the 16 MB document limit, in
/// under 6 days, after which no commit fits). The design promises "exact
/// reads cost the counter document plus that counter's events not yet
/// folded".
#[tokio::test]
async fn an_exact_read_and_an_idle_pass_cost_the_same_with_many_recorder_processes() {
    let ctx = TestContext::new("review_ledger_many_lanes").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let ledger = ledger_on(&store, "views").await;
    for i in 0..120 {
        // One short-lived recorder process per event.
        let process = Ledger::new(&store, ledger.spec().clone());
        assert_outcome(&process.record(format!("e{i}"), "a", 1).await, "recorded");
    }
    let fold = fold_of(&store, "views");
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("a pass");
    client.events.clear();
    assert_eq!(ledger.value("a").await.unwrap().value, 120);
    let read = client.events.sent().len();
    client.events.clear();
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("an idle pass");
    let idle = client.events.sent().len();
    assert!(
        read <= 10,
        "one exact read of one counter sent {read} commands (an idle pass: {idle})"
    );
    // A pass asks each live lane (registered within its span) whether it
    // holds events above its folded number: one index seek each, and one
    // more each for the backlog's metric. It grows with the recorder
    // processes of the last hour, never with the events kept (one
    // aggregate over every lane would be one command, but on a server that
    // does not bound each branch by the index it reads every event kept).
    assert!(
        idle <= 2 * 121 + 10,
        "a pass with nothing to fold sent {idle} commands"
    );
}

/// How many one-shot recorders the cost test runs after its first 50
/// (`TALLY_ONE_SHOT_RECORDERS`; 2,000 by default).
fn one_shot_recorders() -> usize {
    std::env::var("TALLY_ONE_SHOT_RECORDERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000)
}

/// What an idle pass and an exact read cost: the fold state's size, and
/// the commands each sends.
#[derive(Debug, PartialEq)]
struct Cost {
    state_bytes: usize,
    idle_pass_commands: usize,
    read_commands: usize,
}

async fn cost(ctx: &TestContext, key: &str) -> Cost {
    let client = ctx.client(false).await;
    let store = client.store();
    let fold = fold_of(&store, "views");
    let ledger = Ledger::new(&store, ledger_on(&store, "views").await.spec().clone());
    let state = documents(&store, "views_events_fold").await;
    let state_bytes = state
        .iter()
        .map(|d| d.to_vec().unwrap().len())
        .sum::<usize>();
    assert_eq!(state.len(), 1, "the state is one document: {state:?}");
    // The read with events not folded yet, then the pass that folds them,
    // then an idle pass.
    client.events.clear();
    ledger.value(key).await.unwrap();
    let read_commands = client.events.sent().len();
    fold_all(&fold).await;
    // The first idle pass after work looks back to the watermark in up to
    // eight ranges (how many follows how long ago the pass ended, not the
    // recorders); the next ones, on a ledger still idle, look once.
    let now = Reconciler::new(&store).server_time().await.unwrap();
    client.events.clear();
    let run = fold.fold(now, &CancellationToken::new()).await.unwrap();
    assert_eq!(run.events_folded, 0, "idle: {run:?}");
    let first_idle = client.events.sent().len();
    client.events.clear();
    let run = fold.fold(now, &CancellationToken::new()).await.unwrap();
    assert_eq!(run.events_folded, 0, "idle: {run:?}");
    let idle_pass_commands = client.events.sent().len();
    assert!(
        first_idle <= idle_pass_commands + 7,
        "the first idle pass sent {first_idle} commands, the next {idle_pass_commands}"
    );
    Cost {
        state_bytes,
        idle_pass_commands,
        read_commands,
    }
}

/// A pass looks for waiting events where they are. The test server reads
/// a whole range of `{s: 1}` before it stops at the first event, so one
/// look at everything above the watermark cost a pass as much as its sums
/// again (3.5 s of the fold of 100,000 events). With new events waiting,
/// no look (an aggregate with `$limit`) spans an old backlog; after a look
/// that found nothing, the next pass looks once, at what landed since. The
/// proxy's log is the oracle for what each look asked.
#[tokio::test]
async fn a_pass_looks_for_waiting_events_where_they_are_not_across_the_backlog() {
    let ctx = TestContext::new("ledger_looks").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    // A backlog numbered ten minutes ago (written by hand, as a recorder
    // stopped since would have left it), and one event recorded now.
    let old = number_of(server_now(&store).await - std::time::Duration::from_secs(600));
    let backlog: Vec<mongodb::bson::Document> = (0..200i64)
        .map(|i| event_by_hand(&format!("old{i}"), "home", 1, old + i))
        .collect();
    let events = direct.collection("views_events");
    events.insert_many(backlog).await.unwrap();
    assert_outcome(&ledger.record("new", "home", 1).await, "recorded");

    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let fold = fold_of(&ctx.client_through(&proxy, false).await.store(), "views");
    assert_eq!(fold_all(&fold).await.events_folded, 201);
    let looks = |proxy: &Proxy| -> Vec<(i64, Option<i64>)> {
        proxy
            .requests("aggregate")
            .iter()
            .filter(|e| e.collection.as_deref() == Some("views_events"))
            .filter(|e| e.body_mentions("$limit"))
            .map(|e| {
                let pipeline = e.body.get_array("pipeline").unwrap();
                let first = pipeline[0].as_document().unwrap();
                let range = first
                    .get_document("$match")
                    .and_then(|m| m.get_document("s"))
                    .unwrap_or_else(|_| panic!("a look without a range: {first}"));
                (range.get_i64("$gt").unwrap(), range.get_i64("$lte").ok())
            })
            .collect()
    };
    let first = looks(&proxy);
    assert!(!first.is_empty(), "the pass looked for events");
    for (above, to) in &first {
        let mut range = doc! { "$gt": above };
        if let Some(to) = to {
            range.insert("$lte", to);
        }
        let spanned = events
            .count_documents(doc! { "s": range, "_id": { "$regex": "^old" } })
            .await
            .unwrap();
        assert_eq!(
            spanned, 0,
            "a look at ({above}, {to:?}] read the old backlog while a new event waited: {first:?}"
        );
    }

    // Nothing waits: the pass that found so looked back to the watermark.
    // The next looks once, at what landed since, and folds it.
    proxy.clear_log();
    assert_eq!(fold_all(&fold).await.events_folded, 0);
    assert_outcome(&ledger.record("newer", "home", 1).await, "recorded");
    proxy.clear_log();
    let run = fold_all(&fold).await;
    assert_eq!(run.events_folded, 1, "{run:?}");
    let quiet = looks(&proxy);
    assert_eq!(quiet.len(), 1, "one look at what landed since: {quiet:?}");
    assert_eq!(
        counter(&direct.collection("views"), "home").await,
        202,
        "every event counted once"
    );
}

/// An event numbered by hand with a fraction, the lowest waiting, never
/// hides the events above it (found by the adversarial review of the
/// looks: the look read "nothing waits" from a number it could not read,
/// and the fold stayed idle for good). Both hand-written events are
/// numbered ten seconds ahead of the clock, so every look meets the
/// fractional one first; each is folded once (its amount is an integer).
#[tokio::test]
async fn an_event_numbered_with_a_fraction_never_hides_the_events_above_it() {
    let ctx = TestContext::new("ledger_fraction_number").await;
    let direct = ctx.client(false).await;
    let store = direct.store();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    assert_outcome(&ledger.record("first", "home", 1).await, "recorded");
    assert_eq!(fold_all(&fold).await.events_folded, 1);
    let ahead = number_of(server_now(&store).await + std::time::Duration::from_secs(10)) as f64;
    direct
        .collection("views_events")
        .insert_many([
            event_by_hand("fraction", "home", 1, ahead + 0.5),
            event_by_hand("integral", "home", 1, ahead + 1000.0),
        ])
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        fold_all(&fold).await;
        if counter(&direct.collection("views"), "home").await == 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the events above a fractional number were never folded: the counter holds {}",
            counter(&direct.collection("views"), "home").await
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(unfolded(&fold).await, 0);
}
