//! P8, the ledger's exact reads (`ledger-reads`): `Ledger::value` beside
//! a running `tallyd run` that folds a steady load, against a plain
//! `find_one` of the counter document (p50, interleaved slices), with the
//! read's first steps timed apart; and, with no daemon, an exact read of a
//! counter whose ledger has a backlog of N events since the fold's
//! position, against a bare change stream filtered to that counter on the
//! server, read from the same position.
//!
//! The load: [`LOAD_WRITERS`] writers recording at [`LOAD_RATE`] events/s
//! each over 1,000 keys (a steady few hundred events/s, well under what
//! the test server takes, so that the daemon keeps up), the daemon's
//! `fold_delay` from `TALLY_BENCH_LEDGER_READ_FOLD_DELAY` (default `1s`,
//! the default of `[reconcile] fold_delay`: an exact read reads the log
//! since the daemon's last pass). The backlogs:
//! `TALLY_BENCH_LEDGER_READ_BACKLOGS` (default `10000,100000`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mongodb::bson::{Document, doc};
use mongodb::options::ReadConcern;
use mongodb::{Collection, Database};
use tally::{CollectionConfig, Ledger, Recording, Store};

use crate::Settings;
use crate::daemon::Daemon;
use crate::ledger::{Bare, connect, placed_ledger, position_of, record_backlog};
use crate::measure::{Run, merge, ms};

const KEYS: usize = 1000;

/// Writers of the steady load beside the daemon.
const LOAD_WRITERS: usize = 4;

/// Each load writer's rate, events/s.
const LOAD_RATE: f64 = 100.0;

pub async fn run(settings: &Settings) {
    let (_server, store, db, uri) = connect("tally_bench_reads").await;
    beside_daemon(&store, &db, &uri, settings).await;
    for backlog in backlogs() {
        with_backlog(&store, &db, backlog, settings).await;
    }
}

/// The daemon's `fold_delay` beside the reads.
fn fold_delay() -> String {
    std::env::var("TALLY_BENCH_LEDGER_READ_FOLD_DELAY").unwrap_or_else(|_| "1s".to_owned())
}

fn backlogs() -> Vec<usize> {
    std::env::var("TALLY_BENCH_LEDGER_READ_BACKLOGS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10_000, 100_000])
}

/// A side of the interleaved reads beside the daemon.
#[derive(Clone, Copy, PartialEq)]
enum ReadSide {
    /// `find_one({_id: key})` on the counters collection.
    Plain,
    /// `Ledger::value(key)`.
    Exact,
    /// The read's first steps alone, as the driver's calls: a causally
    /// consistent session, the fold state and the counter read at read
    /// concern majority.
    StateAndCounter,
    /// One more step: a change stream opened with no start point and its
    /// first reply (how a reader of the test server learns where the log
    /// stands now, `quirks`).
    OpenStream,
}

const READ_SIDES: [ReadSide; 4] = [
    ReadSide::Plain,
    ReadSide::Exact,
    ReadSide::StateAndCounter,
    ReadSide::OpenStream,
];

impl ReadSide {
    fn label(self) -> &'static str {
        match self {
            Self::Plain => "plain find_one",
            Self::Exact => "exact read (value)",
            Self::StateAndCounter => "  its state + counter",
            Self::OpenStream => "  a new stream's open",
        }
    }
}

/// Exact reads beside `tallyd run` folding a steady load.
async fn beside_daemon(store: &Store, db: &Database, uri: &str, settings: &Settings) {
    let name = "reads";
    let fold_delay = fold_delay();
    let ledger = Arc::new(Ledger::new(store, CollectionConfig::new(name)));
    ledger.create_indexes().await.expect("indexes");
    let daemon = Daemon::start_with(
        uri,
        &format!(
            "database = \"tally_bench_reads\"\n\
             [[collections]]\nname = \"{name}\"\nledger = true\n\
             [reconcile]\nfold_delay = \"{fold_delay}\"\n\
             [schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n"
        ),
    );
    // Every counter once, folded, before the clock starts.
    let warm: Vec<(String, String, i64)> = (0..KEYS)
        .map(|k| (format!("warm{k}"), format!("k{k}"), 1))
        .collect();
    for recording in ledger.record_many(warm).await {
        assert_eq!(recording.name(), "recorded", "{recording:?}");
    }
    let counters: Collection<Document> = db.collection(name);
    let deadline = Instant::now() + Duration::from_secs(120);
    while counters.count_documents(doc! {}).await.expect("count") < KEYS as u64 {
        assert!(Instant::now() < deadline, "tallyd never folded the warm-up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let recorded = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..LOAD_WRITERS)
        .map(|w| {
            let (ledger, stop, recorded) = (ledger.clone(), stop.clone(), recorded.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / LOAD_RATE));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let key = format!("k{}", (w * 7919 + i * 31) % KEYS);
                    match ledger.record(format!("load{w}_{i}"), key, 1).await {
                        Recording::Recorded(_) => recorded.fetch_add(1, Ordering::Relaxed),
                        other => panic!("load writer: {other:?}"),
                    };
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let loaded_at = (Instant::now(), recorded.load(Ordering::Relaxed));
    let keeper: Collection<Document> = db.collection(&format!("{name}_events_fold"));
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); READ_SIDES.len()];
    let mut unfolded = (0u64, 0u64);
    for round in 0..settings.rounds {
        for k in 0..READ_SIDES.len() {
            let at = (k + round) % READ_SIDES.len();
            let side = READ_SIDES[at];
            let (run, seen) = read_slice(store, &ledger, &counters, &keeper, side, settings).await;
            unfolded.0 += seen.0;
            unfolded.1 += seen.1;
            runs[at].push(run);
        }
    }
    let (took, load) = (
        loaded_at.0.elapsed(),
        recorded.load(Ordering::Relaxed) - loaded_at.1,
    );
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.expect("load writer");
    }
    let lag = daemon
        .metric(&format!(
            "tally_events_fold_lag_seconds{{collection=\"{name}\"}}"
        ))
        .await;
    drop(daemon);
    let runs: Vec<Run> = runs.into_iter().map(merge).collect();
    println!(
        "exact reads beside tallyd run (fold_delay {fold_delay}) folding {LOAD_WRITERS} writers x \
         {LOAD_RATE:.0} events/s over {KEYS} keys (recorded meanwhile: {:.0} events/s; the \
         daemon's lag metric at the end: {}); 1 reader, {} interleaved slices x {:?} per side",
        load as f64 / took.as_secs_f64(),
        lag.map_or("-".to_owned(), |l| format!("{l:.1}s")),
        settings.rounds,
        settings.run
    );
    println!(
        "{:<24} {:>8} {:>9} {:>9} {:>9}",
        "side", "reads", "p50 ms", "p90 ms", "p99 ms"
    );
    for (side, run) in READ_SIDES.iter().zip(&runs) {
        println!(
            "{:<24} {:>8} {:>9.2} {:>9.2} {:>9.2}",
            side.label(),
            run.ops,
            ms(run.percentile(50.0)),
            ms(run.percentile(90.0)),
            ms(run.percentile(99.0))
        );
    }
    println!(
        "exact / plain p50 ratio = {:.2}x (goal <= 3x); unfolded events per exact read: {:.1}",
        runs[1].percentile(50.0).as_secs_f64() / runs[0].percentile(50.0).as_secs_f64(),
        unfolded.1 as f64 / unfolded.0.max(1) as f64
    );
}

/// One slice of `side`'s reads, one after the other, over the keys; and,
/// for exact reads, (reads, unfolded events they added).
async fn read_slice(
    store: &Store,
    ledger: &Ledger,
    counters: &Collection<Document>,
    keeper: &Collection<Document>,
    side: ReadSide,
    settings: &Settings,
) -> (Run, (u64, u64)) {
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut unfolded = (0, 0);
    let mut i = 0usize;
    while started.elapsed() < settings.run {
        let key = format!("k{}", (i * 31) % KEYS);
        let t = Instant::now();
        match side {
            ReadSide::Plain => {
                counters
                    .find_one(doc! { "_id": &key })
                    .await
                    .expect("plain read")
                    .expect("the counter");
            }
            ReadSide::Exact => {
                let value = ledger.value(key.as_str()).await.expect("exact read");
                unfolded.0 += 1;
                unfolded.1 += value.unfolded_events;
            }
            ReadSide::StateAndCounter => {
                let mut session = store
                    .client()
                    .start_session()
                    .causal_consistency(true)
                    .await
                    .expect("session");
                keeper
                    .find_one(doc! { "_id": "state" })
                    .read_concern(ReadConcern::majority())
                    .session(&mut session)
                    .await
                    .expect("state read")
                    .expect("the state");
                counters
                    .find_one(doc! { "_id": &key })
                    .read_concern(ReadConcern::majority())
                    .session(&mut session)
                    .await
                    .expect("counter read");
            }
            ReadSide::OpenStream => {
                let mut stream = ledger_events(store, ledger)
                    .watch()
                    .max_await_time(Duration::from_millis(1))
                    .await
                    .expect("open a stream");
                assert!(stream.resume_token().is_some());
                let _ = stream.next_if_any().await.expect("its first reply");
            }
        }
        latencies.push(t.elapsed());
        i += 1;
    }
    let elapsed = started.elapsed();
    latencies.sort();
    (
        Run {
            ops: latencies.len(),
            elapsed,
            latencies,
        },
        unfolded,
    )
}

fn ledger_events(store: &Store, ledger: &Ledger) -> Collection<Document> {
    store.collection(&ledger.spec().events_collection_name())
}

/// With no daemon: a ledger folded once (its position), then `backlog`
/// events recorded over [`KEYS`] counters; an exact read of the counter
/// whose last event is the backlog's last, against the driver's change
/// stream of that counter's inserts (filtered on the server) resumed
/// after the fold's position and read until all of them came (the least
/// any reader of the log must read), alternating, medians.
async fn with_backlog(store: &Store, db: &Database, backlog: usize, settings: &Settings) {
    let name = format!("backlog_{backlog}");
    let (ledger, _) = placed_ledger(store, &name).await;
    let position = position_of(db, &name).await;
    record_backlog(&ledger, backlog).await;
    let key = format!("k{}", (backlog - 1) % KEYS);
    let expected = (0..backlog)
        .filter(|i| i % KEYS == (backlog - 1) % KEYS)
        .count();
    let events: Collection<Document> = db.collection(&format!("{name}_events"));
    let counter_only = Bare {
        key: Some(&key),
        inserts: expected,
        wait: Duration::from_millis(1),
    };
    let reads = settings.rounds.max(3);
    let (mut exact, mut bare) = (Vec::new(), Vec::new());
    for round in 0..reads {
        for k in 0..2 {
            if (k + round) % 2 == 0 {
                let t = Instant::now();
                let value = ledger.value(key.as_str()).await.expect("exact read");
                exact.push(t.elapsed());
                assert_eq!(value.value as usize, expected, "{value:?}");
                assert_eq!(value.unfolded_events as usize, expected);
            } else {
                bare.push(counter_only.read(&events, &position).await);
            }
        }
    }
    exact.sort();
    bare.sort();
    let median = |v: &[Duration]| v[v.len() / 2];
    println!(
        "exact read with a backlog of {backlog} events, no daemon ({expected} of them the \
         counter's, the last among them): median {:.1} ms (min {:.1}); bare filtered change \
         stream of the counter from the same position: median {:.1} ms (min {:.1}); ratio = \
         {:.2}x (goal <= 1.5x); {reads} reads each, alternating",
        ms(median(&exact)),
        ms(exact[0]),
        ms(median(&bare)),
        ms(bare[0]),
        median(&exact).as_secs_f64() / median(&bare).as_secs_f64()
    );
}
