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
/// state stays small (a position and no lanes), an idle pass and an exact
/// read send the same commands, and every event is counted once.
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
        after_many.idle_pass_commands, after_50.idle_pass_commands,
        "an idle pass's cost grew with the number of recorder processes"
    );
    // A read's stream may take one more `getMore` to reach its moment, by
    // timing alone; a cost that followed the recorders would be thousands.
    assert!(
        after_many.read_commands <= after_50.read_commands + 1 && after_many.read_commands <= 8,
        "an exact read's cost grew with the number of recorder processes: {after_50:?} then \
         {after_many:?}"
    );
    // The state holds a position (a resume token: its size follows the
    // last event key's, not the recorders) and no per-lane memory.
    for state_bytes in [after_50.state_bytes, after_many.state_bytes] {
        assert!(state_bytes < 512, "{state_bytes} bytes");
    }

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
    // A pass reads the state and the log from its position: a few
    // commands, whatever the recorders.
    assert!(
        idle <= 10,
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
    let now = Reconciler::new(&store).server_time().await.unwrap();
    let run = fold.fold(now, &CancellationToken::new()).await.unwrap();
    assert_eq!(run.events_folded, 0, "idle: {run:?}");
    client.events.clear();
    let run = fold.fold(now, &CancellationToken::new()).await.unwrap();
    assert_eq!(run.events_folded, 0, "idle: {run:?}");
    let idle_pass_commands = client.events.sent().len();
    Cost {
        state_bytes,
        idle_pass_commands,
        read_commands,
    }
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
