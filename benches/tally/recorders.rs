//! P9, what the ledger costs with one-shot recorders: N events recorded by
//! N recorder processes of one event each (a `tallyd record` per event, a
//! `Ledger` per request: a lane each), spread over the dedupe window
//! (simulated time: the events are inserted as those recorders would have
//! written them, numbered by the server's clock over the last six days),
//! against the same N events recorded by one long-lived recorder (one
//! lane). The ledger is folded once while empty first, so the N events
//! reach the fold through its log, as they would under a running daemon.
//! After their fold: an idle pass, an exact read and the fold state's
//! size, each side against the other.
//!
//! `TALLY_BENCH_LEDGER_RECORDERS` sets N (default 100,000).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mongodb::bson::{Document, doc, oid::ObjectId};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::ledger::{OPLOG_ENTRIES, OPLOG_RETENTION, placed_ledger};
use crate::measure::{bench_options, server_with_oplog};

const KEYS: usize = 1000;
const SIX_DAYS: u64 = 6 * 24 * 3600;

fn recorders() -> usize {
    std::env::var("TALLY_BENCH_LEDGER_RECORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

fn micros(t: SystemTime) -> i64 {
    i64::try_from(t.duration_since(UNIX_EPOCH).unwrap().as_micros()).unwrap()
}

struct Cost {
    idle_pass: Duration,
    read: Duration,
    state_bytes: usize,
    first_fold: Duration,
}

pub async fn run(settings: &Settings) {
    let n = recorders();
    let (uri, _server) = server_with_oplog(OPLOG_ENTRIES, OPLOG_RETENTION);
    let options = bench_options(&uri).await;
    let client = mongodb::Client::with_options(options.clone()).expect("client");
    let db = client.database("tally_bench_recorders");
    db.drop().await.expect("drop bench database");
    let store = tally::Store::from_parts(client, &options, "tally_bench_recorders");
    let one = side(&store, &db, "one_recorder", n, false, settings).await;
    let many = side(&store, &db, "one_shot", n, true, settings).await;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "P9 {n} events over the last six days: one recorder vs {n} one-shot recorders\n\
         idle pass: {:.1} ms vs {:.1} ms (ratio {:.2}x; goal <= 50 ms)\n\
         exact read: {:.1} ms vs {:.1} ms (ratio {:.2}x; goal <= 2x)\n\
         fold state: {} vs {} bytes (goal <= 64 KB)\n\
         the fold of the {n} events (from the log): {:.2} s vs {:.2} s",
        ms(one.idle_pass),
        ms(many.idle_pass),
        many.idle_pass.as_secs_f64() / one.idle_pass.as_secs_f64(),
        ms(one.read),
        ms(many.read),
        many.read.as_secs_f64() / one.read.as_secs_f64(),
        one.state_bytes,
        many.state_bytes,
        one.first_fold.as_secs_f64(),
        many.first_fold.as_secs_f64(),
    );
}

/// Folds `name`'s empty ledger (its position in the log), inserts `n`
/// events (one lane, or one lane each), folds them, then times idle passes
/// and exact reads (medians).
async fn side(
    store: &tally::Store,
    db: &mongodb::Database,
    name: &str,
    n: usize,
    one_shot: bool,
    settings: &Settings,
) -> Cost {
    let (ledger, fold) = placed_ledger(store, name).await;
    let stop = CancellationToken::new();
    let events = db.collection::<Document>(&format!("{name}_events"));
    let now = SystemTime::now();
    let start = micros(now - Duration::from_secs(SIX_DAYS));
    let step = i64::try_from(SIX_DAYS * 1_000_000 / n as u64).unwrap();
    let lane = ObjectId::new();
    let mut batch = Vec::with_capacity(10_000);
    for i in 0..n {
        batch.push(doc! {
            "_id": format!("e{i}"), "k": format!("k{}", i % KEYS), "n": 1i64,
            "at": mongodb::bson::DateTime::now(),
            "L": if one_shot { ObjectId::new() } else { lane },
            "s": start + step * i as i64,
        });
        if batch.len() == 10_000 {
            events
                .insert_many(std::mem::take(&mut batch))
                .await
                .expect("seed");
        }
    }
    if !batch.is_empty() {
        events.insert_many(batch).await.expect("seed");
    }
    let began = Instant::now();
    let run = fold.fold(SystemTime::now(), &stop).await.expect("fold");
    let first_fold = began.elapsed();
    assert_eq!(run.events_folded as usize, n, "{run:?}");
    // One recent event not folded yet, for the read to add.
    let last = ledger.record(format!("{name}-last"), "k1", 1).await;
    assert_eq!(last.name(), "recorded", "{last:?}");
    let rounds = settings.rounds.max(5) * 3;
    let mut passes = Vec::new();
    let mut reads = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let value = ledger.value("k1").await.expect("read");
        reads.push(t.elapsed());
        assert_eq!(value.value as usize, n / KEYS + 1);
    }
    fold.fold(SystemTime::now(), &stop).await.expect("fold");
    for _ in 0..rounds {
        let t = Instant::now();
        let run = fold.fold(SystemTime::now(), &stop).await.expect("fold");
        passes.push(t.elapsed());
        assert_eq!(run.events_folded, 0);
    }
    let state_bytes = db
        .collection::<Document>(&format!("{name}_events_fold"))
        .find_one(doc! { "_id": "state" })
        .await
        .unwrap()
        .map_or(0, |d| d.to_vec().unwrap().len());
    passes.sort();
    reads.sort();
    Cost {
        idle_pass: passes[passes.len() / 2],
        read: reads[reads.len() / 2],
        state_bytes,
        first_fold,
    }
}
