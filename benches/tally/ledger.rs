//! P8, the events ledger: `record` against a plain `$inc` per event (1
//! caller, and 16 concurrent callers on one handle, whose events share
//! inserts), `record_many` of 100 against a plain `$inc` per event, each
//! beside its floor (the driver's own insert into a collection with the
//! ledger's one index) — the `ledger` group; and (`ledger-fold`) the fold
//! of N events over 1,000 counters against a bare change-stream read of the
//! same N inserts (and against the bare `$group` of the fold before it),
//! the process's peak RSS, a backlog of 50,000 events drained by `tallyd
//! run` while one writer keeps recording (its metrics checked against the
//! events all along), and the lag from an acknowledged `record` to its
//! counter.
//!
//! The fold follows the events collection's change stream, so the test
//! server is started with an oplog of [`OPLOG_ENTRIES`] entries kept
//! [`OPLOG_RETENTION`] (its default, 100,000 entries, would not hold the
//! events one fold reads beside the others of the run).
//!
//! `TALLY_BENCH_LEDGER_EVENTS` sets N (default 100,000);
//! `TALLY_BENCH_LEDGER_BACKLOG` the drained backlog (default 50,000).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{Bson, Document, doc};
use mongodb::change_stream::event::ResumeToken;
use mongodb::{Client, Collection};
use tally::{CollectionConfig, EventFold, EventFoldSettings, Ledger, Recording, Store};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::daemon::Daemon;
use crate::increment::run_plain;
use crate::measure::{Run, bench_options, merge, ms, server_with_oplog, timed};

const KEYS: usize = 1000;
const MANY: usize = 100;

/// The test server's oplog for the ledger's benchmarks: room for every
/// insert of a run (the folds' 210,000 events, the drain's 50,000 and what
/// the writers beside them record).
pub(crate) const OPLOG_ENTRIES: u64 = 2_000_000;

/// How long the test server keeps an oplog entry: longer than a run.
pub(crate) const OPLOG_RETENTION: Duration = Duration::from_secs(4 * 3600);

/// The `ledger` group: `record` and `record_many` against a plain `$inc`
/// per event, each beside its floor.
pub async fn run(settings: &Settings) {
    let (_server, store, db, _uri) = connect("tally_bench_ledger").await;
    let plain: Collection<Document> = db.collection("plain");
    let ledger = Arc::new(Ledger::new(&store, CollectionConfig::new("recorded")));
    ledger.create_indexes().await.expect("indexes");
    let serial = Arc::new(AtomicI64::new(0));

    println!(
        "ledger (P8): record vs plain $inc per event; {KEYS} keys, retryWrites=false, \
         {} interleaved slices x {:?} per side",
        settings.rounds, settings.run
    );
    println!(
        "{:<26} {:>7} {:>11} {:>9} {:>9}",
        "side", "callers", "events/s", "p50 ms", "p99 ms"
    );
    // The floor beside tally: the driver's own insert into a collection
    // with the same index (what any ledger of this shape pays).
    let bare_ledger = Ledger::new(&store, CollectionConfig::new("bare"));
    bare_ledger.create_indexes().await.expect("indexes");
    let bare: Collection<Document> = db.collection("bare_events");
    let mut plain_one = 0.0;
    for (label, writers, goal) in [("record", 1usize, 0.9), ("record, one handle", 16, 2.0)] {
        let mut runs: [Vec<Run>; 3] = Default::default();
        for round in 0..settings.rounds {
            for k in 0..3 {
                let side = (k + round) % 3;
                let run = match side {
                    0 => run_plain(&plain, writers, settings.run, KEYS, 1).await,
                    1 => run_record(&ledger, &serial, writers, settings.run, KEYS).await,
                    _ => run_bare(&bare, &serial, writers, settings.run, KEYS, 1).await,
                };
                runs[side].push(run);
            }
        }
        let [plain_runs, record_runs, bare_runs] = runs;
        let (plain_run, record, bare_run) =
            (merge(plain_runs), merge(record_runs), merge(bare_runs));
        if writers == 1 {
            plain_one = plain_run.per_second();
        }
        print_row("plain $inc", writers, &plain_run, 1);
        print_row(label, writers, &record, 1);
        print_row("bare insert, same idx", writers, &bare_run, 1);
        println!(
            "{:<26} {writers:>7} ratio = {:.3}x (goal >= {goal}x); against one plain $inc \
             writer {:.3}x; bare insert / $inc = {:.3}x",
            format!("{label} / $inc"),
            record.per_second() / plain_run.per_second(),
            record.per_second() / plain_one,
            bare_run.per_second() / plain_run.per_second()
        );
    }
    // record_many of 100: events per second against $inc per event.
    let mut runs: [Vec<Run>; 3] = Default::default();
    for round in 0..settings.rounds {
        for k in 0..3 {
            let side = (k + round) % 3;
            let run = match side {
                0 => run_plain(&plain, 1, settings.run, KEYS, 1).await,
                1 => run_record_many(&ledger, &serial, settings.run).await,
                _ => run_bare(&bare, &serial, 1, settings.run, KEYS, MANY).await,
            };
            runs[side].push(run);
        }
    }
    let [plain_runs, many_runs, bare_runs] = runs;
    let (plain_run, many, bare_run) = (merge(plain_runs), merge(many_runs), merge(bare_runs));
    print_row("plain $inc", 1, &plain_run, 1);
    print_row("record_many of 100", 1, &many, MANY);
    print_row("bare insert_many 100", 1, &bare_run, MANY);
    println!(
        "{:<26} {:>7} ratio = {:.3}x events/s (goal >= 4x); bare insert_many / $inc = {:.3}x",
        "record_many / $inc",
        1,
        many.per_second() * MANY as f64 / plain_run.per_second(),
        bare_run.per_second() * MANY as f64 / plain_run.per_second()
    );
}

/// The `ledger-fold` group: the folds, peak RSS, the drain and the lags,
/// the lag's rate taken from one writer's plain `$inc` measured here.
pub async fn run_fold(settings: &Settings) {
    let events = events();
    let (_server, store, db, uri) = connect("tally_bench_ledger").await;
    let plain: Collection<Document> = db.collection("plain");
    let capacity = run_plain(&plain, 1, settings.run, KEYS, 1)
        .await
        .per_second();
    println!("one writer's plain $inc alone: {capacity:.0}/s");
    folds(&store, &db, &uri, events, capacity, settings).await;
}

/// A fresh benchmark database `name` (on a server started for the run,
/// with the oplog the ledger needs, unless `TALLY_BENCH_MONGODB_URI` names
/// one; the guard keeps it alive).
pub(crate) async fn connect(
    name: &str,
) -> (
    Option<crate::server::TestServer>,
    Store,
    mongodb::Database,
    String,
) {
    let (uri, server) = server_with_oplog(OPLOG_ENTRIES, OPLOG_RETENTION);
    let options = bench_options(&uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database(name);
    db.drop().await.expect("drop bench database");
    let store = Store::from_parts(client, &options, name);
    (server, store, db, uri)
}

/// N from `TALLY_BENCH_LEDGER_EVENTS` (default 100,000).
fn events() -> usize {
    std::env::var("TALLY_BENCH_LEDGER_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

async fn folds(
    store: &Store,
    db: &mongodb::Database,
    uri: &str,
    events: usize,
    capacity: f64,
    settings: &Settings,
) {
    println!(
        "ledger fold (P8): a log pass of N events over {KEYS} counters vs a bare change-stream \
         read of the same N inserts from the same position (and the bare $group over them, the \
         old baseline); the bare read goes first in even rounds, the fold in odd ones"
    );
    let sizes = [events / 10, events, events];
    for (round, n) in sizes.into_iter().enumerate() {
        let name = format!("fold_{round}");
        let fold = fold_side(store, db, &name, n, round % 2 == 1).await;
        println!(
            "fold of {n} events over {KEYS} counters (round {round}): {:.2}s; bare change-stream \
             read of them: {:.2}s, ratio = {:.2}x (goal <= 1.5x); bare $group over them: {:.2}s, \
             ratio = {:.2}x; the counters' sums as plain $inc upserts, 100 to an update \
             command: {:.2}s; the fold's peak RSS above the process's before it {} KiB",
            fold.folded.as_secs_f64(),
            fold.stream.as_secs_f64(),
            fold.folded.as_secs_f64() / fold.stream.as_secs_f64(),
            fold.group.as_secs_f64(),
            fold.folded.as_secs_f64() / fold.group.as_secs_f64(),
            fold.writes.as_secs_f64(),
            fold.rss,
        );
    }
    drain(store, db, uri).await;
    lag(store, capacity / 2.0, settings, Folder::Library).await;
    for fold_delay in ["1s", "100ms"] {
        lag(
            store,
            capacity / 2.0,
            settings,
            Folder::Daemon { uri, fold_delay },
        )
        .await;
    }
}

/// The backlog from `TALLY_BENCH_LEDGER_BACKLOG` (default 50,000).
fn backlog_size() -> usize {
    std::env::var("TALLY_BENCH_LEDGER_BACKLOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

/// A backlog recorded while no daemon runs — after a first fold gave the
/// ledger its position in the log, so the daemon drains it from the log as
/// it would after an outage — then drained by `tallyd run` while one
/// writer keeps recording at full speed: the drain's rate against the
/// writer's, and the daemon's backlog and lag metrics, sampled twice a
/// second, against the truth (events recorded minus the counters' sum:
/// every event adds 1).
async fn drain(store: &Store, db: &mongodb::Database, uri: &str) {
    let backlog = backlog_size();
    let name = "drain";
    let ledger = Arc::new(placed_ledger(store, name).await.0);
    record_backlog(&ledger, backlog).await;
    let counters: Collection<Document> = db.collection(name);
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicI64::new(0));
    let writer = {
        let (ledger, stop, written) = (ledger.clone(), stop.clone(), written.clone());
        tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                match ledger
                    .record(format!("w{i}"), format!("k{}", i % KEYS), 1)
                    .await
                {
                    Recording::Recorded(_) => written.fetch_add(1, Ordering::Relaxed),
                    other => panic!("drain writer: {other:?}"),
                };
                i += 1;
            }
        })
    };
    // The writer's own rate, alone with the server, before the daemon.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = written.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let alone = (written.load(Ordering::Relaxed) - before) as f64 / 3.0;
    let at_start = written.load(Ordering::Relaxed);
    let started = Instant::now();
    let daemon = Daemon::start_with(
        uri,
        &format!(
            "database = \"tally_bench_ledger\"\n\
             [[collections]]\nname = \"{name}\"\nledger = true\n\
             [reconcile]\nfold_delay = \"100ms\"\n[monitor]\nscan_interval = \"1s\"\n\
             [schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n"
        ),
    );
    let mut ready = None;
    let series = format!("tally_events_backlog{{collection=\"{name}\"}}");
    let lag_series = format!("tally_events_fold_lag_seconds{{collection=\"{name}\"}}");
    let mut samples = Vec::new();
    let mut drained = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    while Instant::now() < deadline {
        if ready.is_none() {
            if daemon.ready().await {
                ready = Some(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let metric = daemon.metric(&series).await;
        let lag = daemon.metric(&lag_series).await;
        // Every event recorded is stored: the backlog and what the writer
        // recorded (counted before the sum, so never more than it saw). A
        // count of the events collection would cost the test server a scan
        // of it every sample, which slowed the drain it measures.
        let stored = backlog as i64 + written.load(Ordering::Relaxed);
        let folded = sum_of(&counters).await;
        let at = started.elapsed();
        samples.push((at, stored - folded, metric, lag));
        if drained.is_none() && folded >= backlog as i64 {
            drained = Some((at, folded, written.load(Ordering::Relaxed)));
        }
        if drained.is_some_and(|(t, _, _)| at > t + Duration::from_secs(3)) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = writer.await;
    drop(daemon);
    let Some((took, folded, writes)) = drained else {
        println!("drain: the backlog of {backlog} events was not drained in 10 minutes");
        return;
    };
    let ready = ready.unwrap_or_default();
    let draining = took.saturating_sub(ready);
    let drain_rate = folded as f64 / draining.as_secs_f64();
    let writer_rate = (writes - at_start) as f64 / took.as_secs_f64();
    println!(
        "drain of {backlog} events by tallyd run (fold_delay 100ms, scan 1s) while one writer \
         records at full speed: ready after {:.1}s, drained {:.1}s later: {drain_rate:.0} \
         events/s folded; the writer meanwhile {writer_rate:.0} events/s, alone before \
         {alone:.0} events/s; ratio = {:.2}x against the writer meanwhile, {:.2}x against it \
         alone (goal >= 5x)",
        ready.as_secs_f64(),
        draining.as_secs_f64(),
        drain_rate / writer_rate,
        drain_rate / alone
    );
    let first = samples.iter().find(|s| s.2.is_some()).map(|s| s.0);
    let worst = samples
        .iter()
        .filter_map(|(_, truth, metric, _)| metric.map(|m| (m - *truth as f64).abs()))
        .fold(0.0f64, f64::max);
    println!(
        "drain metrics: first backlog sample at {:.1}s; {} samples; largest gap between the \
         backlog metric and the truth {worst:.0} events (the events of one pass: {:.0} at the \
         writer's rate over 1 s)",
        first.map_or(f64::NAN, |t| t.as_secs_f64()),
        samples.len(),
        writer_rate
    );
    for (at, truth, metric, lag) in samples.iter().step_by((samples.len() / 8).max(1)) {
        println!(
            "  at {:>5.1}s: backlog {truth:>6} (metric {}), lag metric {}",
            at.as_secs_f64(),
            metric.map_or("-".to_owned(), |m| format!("{m:.0}")),
            lag.map_or("-".to_owned(), |l| format!("{l:.1}s"))
        );
    }
}

/// `backlog` events `b<i>` of 1 recorded over [`KEYS`] counters (`k<i %
/// KEYS>`), 1,000 to a `record_many`, through one handle.
pub(crate) async fn record_backlog(ledger: &Ledger, backlog: usize) {
    for chunk in 0..backlog.div_ceil(1000) {
        let batch: Vec<(String, String, i64)> = (chunk * 1000..((chunk + 1) * 1000).min(backlog))
            .map(|i| (format!("b{i}"), format!("k{}", i % KEYS), 1))
            .collect();
        for recording in ledger.record_many(batch).await {
            assert_eq!(recording.name(), "recorded", "{recording:?}");
        }
    }
}

/// The sum of every counter of `coll`.
async fn sum_of(coll: &Collection<Document>) -> i64 {
    let rows: Vec<Document> = coll
        .aggregate(vec![
            doc! { "$group": { "_id": mongodb::bson::Bson::Null, "n": { "$sum": "$counter" } } },
        ])
        .await
        .expect("sum")
        .try_collect()
        .await
        .expect("sum rows");
    rows.first()
        .and_then(|r| match r.get("n") {
            Some(mongodb::bson::Bson::Int32(n)) => Some(i64::from(*n)),
            Some(mongodb::bson::Bson::Int64(n)) => Some(*n),
            _ => None,
        })
        .unwrap_or(0)
}

/// What folds the events while the lag is measured.
#[derive(Clone, Copy)]
enum Folder<'a> {
    /// The library's `EventFold` in a loop: a pass as soon as the last one
    /// found work, else after 50 ms.
    Library,
    /// `tallyd run` with the ledger on: the change stream on the events
    /// collection triggers a fold within `fold_delay`.
    Daemon { uri: &'a str, fold_delay: &'a str },
}

fn print_row(label: &str, writers: usize, run: &Run, per_op: usize) {
    println!(
        "{:<22} {:>7} {:>11.0} {:>9.2} {:>9.2}",
        label,
        writers,
        run.per_second() * per_op as f64,
        ms(run.percentile(50.0)),
        ms(run.percentile(99.0))
    );
}

async fn run_record(
    ledger: &Arc<Ledger>,
    serial: &Arc<AtomicI64>,
    writers: usize,
    duration: Duration,
    keys: usize,
) -> Run {
    let (ledger, serial) = (ledger.clone(), serial.clone());
    timed(writers, duration, move |w, i| {
        let (ledger, serial) = (ledger.clone(), serial.clone());
        async move {
            let key = format!("k{}", (w * 7919 + i * 31) % keys);
            let event = format!("e{}", serial.fetch_add(1, Ordering::Relaxed));
            match ledger.record(event, key, 1).await {
                Recording::Recorded(_) => {}
                other => panic!("benchmark record: {other:?}"),
            }
        }
    })
    .await
}

/// The driver's own unordered insert of `per_op` event documents into
/// `coll` (no outcome judged, no retry): the floor for `record` and
/// `record_many`.
async fn run_bare(
    coll: &Collection<Document>,
    serial: &Arc<AtomicI64>,
    writers: usize,
    duration: Duration,
    keys: usize,
    per_op: usize,
) -> Run {
    let (coll, serial) = (coll.clone(), serial.clone());
    timed(writers, duration, move |w, i| {
        let (coll, serial) = (coll.clone(), serial.clone());
        async move {
            let first = serial.fetch_add(per_op as i64, Ordering::Relaxed);
            let lane = mongodb::bson::oid::ObjectId::new();
            let docs: Vec<Document> = (0..per_op)
                .map(|j| {
                    doc! {
                        "_id": format!("e{}", first + j as i64),
                        "k": format!("k{}", (w * 7919 + i * 31 + j) % keys),
                        "n": 1i64,
                        "at": mongodb::bson::DateTime::now(),
                        "L": lane,
                        "s": first + j as i64,
                    }
                })
                .collect();
            coll.insert_many(docs)
                .ordered(false)
                .await
                .expect("bare insert");
        }
    })
    .await
}

async fn run_record_many(ledger: &Arc<Ledger>, serial: &Arc<AtomicI64>, duration: Duration) -> Run {
    let (ledger, serial) = (ledger.clone(), serial.clone());
    timed(1, duration, move |_, i| {
        let (ledger, serial) = (ledger.clone(), serial.clone());
        async move {
            let first = serial.fetch_add(MANY as i64, Ordering::Relaxed);
            let batch: Vec<(String, String, i64)> = (0..MANY)
                .map(|j| {
                    let key = format!("k{}", (i * 31 + j) % KEYS);
                    (format!("e{}", first + j as i64), key, 1)
                })
                .collect();
            for recording in ledger.record_many(batch).await {
                assert_eq!(recording.name(), "recorded", "{recording:?}");
            }
        }
    })
    .await
}

/// What one fold of N events and its baselines took.
struct FoldSides {
    /// The fold's pass over the N inserts (one `EventFold::fold`).
    folded: Duration,
    /// A bare change stream reading the same N inserts from the fold's
    /// position, with the fold's projection.
    stream: Duration,
    /// The bare `$group` by counter over the events collection.
    group: Duration,
    /// The counters' sums written as plain `$inc` upserts, 100 to an
    /// `update` command (the fold's own writes go through the fold lane).
    writes: Duration,
    /// The fold's peak RSS above the process's before it, in KiB.
    rss: u64,
}

/// `name`'s ledger folded once while empty (its position in the log), then
/// `events` events recorded over [`KEYS`] counters through [`SEED_LANES`]
/// handles at once (`record_many` of 1,000: not timed); then, on the same
/// inserts, the bare change-stream read from the fold's position and
/// tally's fold of them — one pass, as a running daemon would make it
/// (`fold_first`: the fold first) — then the bare `$group` and the plain
/// writes of its sums.
async fn fold_side(
    store: &Store,
    db: &mongodb::Database,
    name: &str,
    events: usize,
    fold_first: bool,
) -> FoldSides {
    let (_, fold) = placed_ledger(store, name).await;
    let stop = CancellationToken::new();
    let position = position_of(db, name).await;
    seed(store, name, events).await;
    let coll: Collection<Document> = db.collection(&format!("{name}_events"));
    let all = Bare {
        key: None,
        inserts: events,
        wait: Duration::from_millis(5),
    };
    let mut stream = None;
    if !fold_first {
        stream = Some(all.read(&coll, &position).await);
    }
    let resident = rss_kib("VmRSS:");
    reset_peak_rss();
    let started = Instant::now();
    let run = fold.fold(SystemTime::now(), &stop).await.expect("fold");
    let folded = started.elapsed();
    let rss = peak_rss_kib().saturating_sub(resident);
    assert_eq!(
        run.events_folded, events as u64,
        "every event folded in one pass"
    );
    let stream = match stream {
        Some(stream) => stream,
        None => all.read(&coll, &position).await,
    };
    let started = Instant::now();
    let rows: Vec<Document> = coll
        .aggregate(vec![
            doc! { "$group": { "_id": "$k", "n": { "$sum": "$n" } } },
        ])
        .await
        .expect("bare $group")
        .try_collect()
        .await
        .expect("bare $group rows");
    let group = started.elapsed();
    assert_eq!(rows.len(), KEYS.min(events));
    let writes = plain_sums(db, name, &rows).await;
    FoldSides {
        folded,
        stream,
        group,
        writes,
        rss,
    }
}

/// The fold's position in the log of `name`'s ledger, from its state
/// document: the resume token a bare reader starts after.
pub(crate) async fn position_of(db: &mongodb::Database, name: &str) -> ResumeToken {
    let state = db
        .collection::<Document>(&format!("{name}_events_fold"))
        .find_one(doc! { "_id": "state" })
        .await
        .expect("read the fold state")
        .expect("a fold state");
    let token = state
        .get_document("position")
        .expect("the fold state has a position")
        .get("token")
        .cloned()
        .expect("a position's token");
    mongodb::bson::deserialize_from_bson(token).expect("a resume token")
}

/// A change event as a bare reader reads it: the inserted event's fields.
#[derive(Debug, serde::Deserialize)]
struct BareChange {
    #[serde(rename = "fullDocument")]
    document: Option<Document>,
}

/// The pipeline of a bare stream of inserts (of counter `key`, or every
/// insert), projected to the fields the fold reads.
fn bare_pipeline(key: Option<&str>) -> Vec<Document> {
    let mut inserts = doc! { "operationType": "insert" };
    if let Some(key) = key {
        inserts.insert("fullDocument.k", key);
    }
    vec![
        doc! { "$match": inserts },
        doc! { "$project": {
            "_id": 1, "operationType": 1, "clusterTime": 1, "fullDocument._id": 1,
            "fullDocument.k": 1, "fullDocument.n": 1, "fullDocument.s": 1,
        } },
    ]
}

/// A bare reader of the log: the driver's change stream of an events
/// collection's inserts (of counter `key` only, filtered on the server, or
/// every insert), projected to what the fold reads, each `getMore` waiting
/// at most `wait`, read until `inserts` came.
pub(crate) struct Bare<'a> {
    pub(crate) key: Option<&'a str>,
    pub(crate) inserts: usize,
    pub(crate) wait: Duration,
}

impl Bare<'_> {
    /// The read of `coll`'s log resumed after `position`: how long it took.
    pub(crate) async fn read(
        &self,
        coll: &Collection<Document>,
        position: &ResumeToken,
    ) -> Duration {
        let started = Instant::now();
        let mut stream = coll
            .watch()
            .pipeline(bare_pipeline(self.key))
            .max_await_time(self.wait)
            .resume_after(position.clone())
            .await
            .expect("open a bare change stream")
            .with_type::<BareChange>();
        let mut seen = 0;
        while seen < self.inserts {
            if let Some(change) = stream.next_if_any().await.expect("bare change stream") {
                assert!(change.document.is_some(), "an insert's event");
                seen += 1;
            }
        }
        started.elapsed()
    }
}

/// `name`'s ledger with its index, folded once while empty: its fold
/// state holds a position in the log, so what is recorded next reaches
/// the fold through the log (not a first fold's catch-up of the
/// collection), as under a running daemon.
pub(crate) async fn placed_ledger(store: &Store, name: &str) -> (Ledger, EventFold) {
    let ledger = Ledger::new(store, CollectionConfig::new(name));
    ledger.create_indexes().await.expect("indexes");
    let fold = EventFold::new(
        store,
        CollectionConfig::new(name),
        EventFoldSettings::default(),
    );
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("the first fold of an empty ledger");
    (ledger, fold)
}

/// The `$group`'s sums written to a scratch collection as plain `$inc`
/// upserts, 100 statements to an unordered `update` command, two commands
/// at once (as a pass sends its counters): the writes any fold makes.
async fn plain_sums(db: &mongodb::Database, name: &str, rows: &[Document]) -> Duration {
    let target = format!("{name}_plain_sums");
    let started = Instant::now();
    let commands: Vec<Document> = rows
        .chunks(100)
        .map(|chunk| {
            let updates: Vec<Document> = chunk
                .iter()
                .map(|row| {
                    let key = row.get("_id").cloned().unwrap_or(Bson::Null);
                    let sum = row.get("n").cloned().unwrap_or(Bson::Int64(0));
                    doc! { "q": { "_id": key }, "u": { "$inc": { "counter": sum } }, "upsert": true }
                })
                .collect();
            doc! { "update": &target, "updates": updates, "ordered": false }
        })
        .collect();
    futures::stream::iter(commands)
        .map(|command| async move { db.run_command(command).await.expect("plain sums") })
        .buffer_unordered(2)
        .collect::<Vec<_>>()
        .await;
    started.elapsed()
}

/// Handles (recorder lanes) the seeded events are recorded through.
const SEED_LANES: usize = 4;

/// Records `events` events of 1 over [`KEYS`] counters in `name`'s ledger,
/// [`SEED_LANES`] handles at once.
async fn seed(store: &Store, name: &str, events: usize) {
    let share = events.div_ceil(SEED_LANES);
    let handles: Vec<_> = (0..SEED_LANES)
        .map(|h| {
            let ledger = Ledger::new(store, CollectionConfig::new(name));
            tokio::spawn(async move {
                let mine: Vec<usize> = (h * share..((h + 1) * share).min(events)).collect();
                for chunk in mine.chunks(1000) {
                    let batch: Vec<(String, String, i64)> = chunk
                        .iter()
                        .map(|i| (format!("e{i}"), format!("k{}", i % KEYS), 1))
                        .collect();
                    for recording in ledger.record_many(batch).await {
                        assert_eq!(recording.name(), "recorded", "{recording:?}");
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("seeding");
    }
}

/// Resets the process's peak resident set (Linux: `clear_refs` 5), so the
/// next [`peak_rss_kib`] is the peak since.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's peak resident set (`VmHWM`), in KiB; 0 where unknown.
fn peak_rss_kib() -> u64 {
    rss_kib("VmHWM:")
}

/// A line of `/proc/self/status` in KiB (`VmRSS:`, `VmHWM:`); 0 where
/// unknown.
fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// One recorder at `rate` events/s on one counter, the events folded by
/// `folder`, a poller reading the counter every 5 ms: each event's lag is
/// from its acknowledgement to the first poll that sees the counter
/// include it.
async fn lag(store: &Store, rate: f64, settings: &Settings, folder: Folder<'_>) {
    let name = match folder {
        Folder::Library => "lag".to_owned(),
        Folder::Daemon { fold_delay, .. } => format!("lag_daemon_{}", fold_delay),
    };
    let ledger = Arc::new(Ledger::new(store, CollectionConfig::new(&name)));
    ledger.create_indexes().await.expect("indexes");
    let stop = CancellationToken::new();
    let coll: Collection<Document> = store.collection(&name);
    let (folder_task, _daemon, label) = match folder {
        Folder::Library => {
            let fold = Arc::new(EventFold::new(
                store,
                CollectionConfig::new(&name),
                EventFoldSettings::default(),
            ));
            let stop = stop.clone();
            let task = tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let run = fold.fold(SystemTime::now(), &stop).await;
                    if !matches!(run, Ok(ref r) if r.events_folded > 0) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            });
            (Some(task), None, "the library's fold in a loop".to_owned())
        }
        Folder::Daemon { uri, fold_delay } => {
            let daemon = Daemon::start_with(
                uri,
                &format!(
                    "database = \"tally_bench_ledger\"\n\
                     [[collections]]\nname = \"{name}\"\nledger = true\n\
                     [reconcile]\nfold_delay = \"{fold_delay}\"\n\
                     [schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n"
                ),
            );
            // Until it folds: one event through before the clock starts.
            match ledger.record(format!("{name}_warm"), "warm", 1).await {
                Recording::Recorded(_) => {}
                other => panic!("lag warm-up record: {other:?}"),
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while value_of(&coll, "warm").await < 1 {
                assert!(
                    Instant::now() < deadline,
                    "tallyd never folded the warm-up event"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (
                None,
                Some(daemon),
                format!("tallyd run, fold_delay {fold_delay}"),
            )
        }
    };
    let poller = {
        let (coll, stop) = (coll.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seen: Vec<(Instant, i64)> = Vec::new();
            while !stop.is_cancelled() {
                let value = hot_value(&coll).await;
                seen.push((Instant::now(), value));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        })
    };
    let total = (settings.run.as_secs_f64() * settings.rounds as f64 * rate).max(50.0) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut acked = Vec::with_capacity(total);
    let started = Instant::now();
    for i in 0..total {
        let due = started + interval * i as u32;
        tokio::time::sleep_until(due.into()).await;
        match ledger.record(format!("{name}{i}"), "hot", 1).await {
            Recording::Recorded(_) => acked.push(Instant::now()),
            other => panic!("lag record: {other:?}"),
        }
    }
    // Until the counter holds every event.
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if hot_value(&coll).await >= total as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.cancel();
    if let Some(task) = folder_task {
        let _ = task.await;
    }
    let seen = poller.await.expect("poller");
    let mut lags: Vec<Duration> = acked
        .iter()
        .enumerate()
        .filter_map(|(i, at)| {
            seen.iter()
                .find(|(_, v)| *v > i as i64)
                .map(|(t, _)| t.saturating_duration_since(*at))
        })
        .collect();
    lags.sort();
    if lags.is_empty() {
        println!("lag: the counter never showed the events (nothing to report)");
        return;
    }
    let p = |q: f64| lags[((q / 100.0) * (lags.len() - 1) as f64).round() as usize];
    println!(
        "lag record -> counter, {label}, {total} events at {rate:.0}/s (half of one \
         writer's plain $inc rate): median {:.1} ms, p99 {:.1} ms",
        ms(p(50.0)),
        ms(p(99.0))
    );
}

/// The hot counter's value (0 before it exists).
async fn hot_value(coll: &Collection<Document>) -> i64 {
    value_of(coll, "hot").await
}

/// Counter `key`'s value (0 before it exists).
async fn value_of(coll: &Collection<Document>, key: &str) -> i64 {
    coll.find_one(doc! { "_id": key })
        .await
        .ok()
        .flatten()
        .and_then(|d| match d.get("counter") {
            Some(mongodb::bson::Bson::Int32(n)) => Some(i64::from(*n)),
            Some(mongodb::bson::Bson::Int64(n)) => Some(*n),
            _ => None,
        })
        .unwrap_or(0)
}
