//! P7: the lane increment against a plain `$inc`, with the two-step
//! increment beside them, same server, interleaved slices.
//!
//! Over 1,000 keys and over one hot key, 1 and 16 writers. Target: the lane
//! increment at ≥ 0.85× a plain `$inc`'s throughput, p99 ≤ 1.3× plain.
//!
//! The writers share one handle, as an application's request handlers do,
//! so on the hot key their increments leave in groups (group commit): the
//! mean group size is printed, and a handle with `group_max = 1` (every
//! increment alone) beside it. Target on the hot key with 16 writers: ≥ 5×
//! a plain `$inc`.
//!
//! Then the cost against the lane map's size: one document holding 10, 100
//! and 1,000 lane entries, incremented through lanes, beside a plain `$inc`
//! on a document holding the same map (so the document's size costs both
//! sides alike, and the ratio is the lane's filter and `$set`).
//!
//! Then lane memory over a simulated day: 8 handles writing one hot
//! counter, one of them replaced every third slice (a restarted process),
//! while a reconciler prunes with `lane_ttl` scaled down to seconds; the
//! most entries the document held after a slice (target: 8, plus the
//! handles replaced within `lane_ttl`, plus unknown outcomes), and the
//! throughput of the last third of the slices against the first, each
//! slice's as a ratio to a plain `$inc` run right after it (target
//! ≥ 0.95×).
//!
//! Every lane increment must count: the lanes collection's counters add up
//! to the increments made, checked at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::{Client, Collection};
use tally::{
    CollectionConfig, Counters, FoldTarget, Increment, LaneIncrement, Mode, Reconciler, Store,
    WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::measure::{Run, bench_options, merge, ms, server, timed};

const KEYS: usize = 1000;
const DATABASE: &str = "tally_bench_lanes";

/// Which counters the writers hit.
#[derive(Debug, Clone, Copy)]
enum Keys {
    /// Spread over `KEYS` pre-created keys.
    Spread,
    /// All on one key.
    Hot(&'static str),
}

impl Keys {
    fn key(self, writer: usize, i: usize) -> String {
        match self {
            Keys::Spread => format!("k{}", (writer * 7919 + i * 31) % KEYS),
            Keys::Hot(key) => key.to_owned(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Keys::Spread => "1000 keys",
            Keys::Hot(_) => "hot key",
        }
    }
}

/// One side of a comparison.
#[derive(Clone)]
enum Side {
    Plain(Collection<Document>),
    Lanes(Arc<Counters>),
    TwoStep(Arc<Counters>),
}

impl Side {
    async fn run(
        &self,
        keys: Keys,
        writers: usize,
        duration: Duration,
        made: &Arc<AtomicI64>,
    ) -> Run {
        let side = self.clone();
        let made = made.clone();
        timed(writers, duration, move |w, i| {
            let side = side.clone();
            let made = made.clone();
            async move {
                let key = keys.key(w, i);
                match side {
                    Side::Plain(coll) => {
                        coll.update_one(doc! { "_id": &key }, doc! { "$inc": { "counter": 1 } })
                            .upsert(true)
                            .await
                            .expect("plain $inc");
                    }
                    Side::Lanes(counters) => match counters.add(key, 1).await {
                        LaneIncrement::Counted(_) => {
                            made.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("benchmark lane increment not counted: {other:?}"),
                    },
                    Side::TwoStep(counters) => match counters.increment(key, 1).await {
                        Increment::Counted(_) => {}
                        other => panic!("benchmark increment not counted: {other:?}"),
                    },
                }
            }
        })
        .await
    }
}

/// Runs `sides` interleaved (which goes first rotates), `settings.rounds`
/// slices each, and returns each side's merged run.
async fn compare(
    settings: &Settings,
    sides: &[Side],
    keys: Keys,
    writers: usize,
    made: &Arc<AtomicI64>,
) -> Vec<Run> {
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); sides.len()];
    for round in 0..settings.rounds {
        for k in 0..sides.len() {
            let side = (k + round) % sides.len();
            runs[side].push(sides[side].run(keys, writers, settings.run, made).await);
        }
    }
    runs.into_iter().map(merge).collect()
}

pub async fn run(settings: &Settings) {
    let (uri, _server) = server();
    let options = bench_options(&uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database(DATABASE);
    db.drop().await.expect("drop bench database");
    let plain: Collection<Document> = db.collection("plain");
    for name in ["plain", "lanes", "two_step"] {
        let docs: Vec<Document> = (0..KEYS)
            .map(|k| doc! { "_id": format!("k{k}"), "counter": 0i64 })
            .chain([doc! { "_id": "hot", "counter": 0i64 }])
            .collect();
        db.collection::<Document>(name)
            .insert_many(docs)
            .await
            .expect("seed keys");
    }
    let store = Store::from_parts(client.clone(), &options, DATABASE);
    let handle = |name: &str, group_max: usize| {
        let writer = WriterConfig {
            group_max,
            ..WriterConfig::default()
        };
        Arc::new(Counters::try_new(&store, CollectionConfig::new(name), writer).expect("lanes"))
    };
    let lanes = handle("lanes", WriterConfig::default().group_max);
    let two_step = handle("two_step", WriterConfig::default().group_max);
    let made = Arc::new(AtomicI64::new(0));

    println!(
        "lanes (P7): plain $inc vs the lane increment vs the two-step increment; \
         retryWrites=false, {} interleaved slices x {:?} per side",
        settings.rounds, settings.run
    );
    println!(
        "{:>7}  {:<10} {:<18} {:>9} {:>9} {:>9}",
        "writers", "keys", "kind", "ops/s", "p50 ms", "p99 ms"
    );
    let sides = [
        Side::Plain(plain.clone()),
        Side::Lanes(lanes.clone()),
        Side::TwoStep(two_step.clone()),
    ];
    for keys in [Keys::Spread, Keys::Hot("hot")] {
        for writers in [1usize, 16] {
            let before = lanes.lane_stats();
            let runs = compare(settings, &sides, keys, writers, &made).await;
            for (kind, run) in ["plain", "lanes", "two-step"].iter().zip(&runs) {
                print_row(writers, keys.name(), kind, run);
            }
            print_ratios(writers, keys.name(), &runs[0], &runs[1], Some(&runs[2]));
            print_group_size(writers, keys.name(), before, lanes.lane_stats());
        }
    }

    // Group commit's share: the hot key through a handle that sends every
    // increment alone.
    let alone = handle("lanes", 1);
    let sides = [Side::Plain(plain.clone()), Side::Lanes(alone)];
    let runs = compare(settings, &sides, Keys::Hot("hot"), 16, &made).await;
    print_row(16, "hot key", "lanes, group_max 1", &runs[1]);
    print_ratios(16, "hot key", &runs[0], &runs[1], None);

    // The lane map's size.
    println!("lane map size: one document holding N lane entries (plus the handle's own)");
    for entries in [10usize, 100, 1000] {
        let key = format!("map{entries}");
        let map: Document = (0..entries)
            .map(|_| (ObjectId::new().to_hex(), Bson::Int64(1)))
            .collect();
        for coll in [&plain, &db.collection("lanes")] {
            coll.insert_one(doc! { "_id": &key, "counter": 0i64, "lanes": map.clone() })
                .await
                .expect("seed map");
        }
        let key: &'static str = Box::leak(key.into_boxed_str());
        let sides = [Side::Plain(plain.clone()), Side::Lanes(lanes.clone())];
        for writers in [1usize, 16] {
            let runs = compare(settings, &sides, Keys::Hot(key), writers, &made).await;
            let label = format!("{entries} lanes");
            print_row(writers, &label, "plain", &runs[0]);
            print_row(writers, &label, "lanes", &runs[1]);
            print_ratios(writers, &label, &runs[0], &runs[1], None);
        }
    }

    lane_memory(settings, &options, &db, &made).await;

    let counted = sum_counters(&db.collection("lanes")).await;
    let made = made.load(Ordering::Relaxed);
    println!(
        "lane increments counted {made}, the lanes collection's counters add up to {counted} (must be equal)"
    );
    assert_eq!(counted, made, "a lane increment was lost or doubled");
}

fn print_row(writers: usize, keys: &str, kind: &str, run: &Run) {
    println!(
        "{:>7}  {:<10} {:<18} {:>9.0} {:>9.2} {:>9.2}",
        writers,
        keys,
        kind,
        run.per_second(),
        ms(run.percentile(50.0)),
        ms(run.percentile(99.0))
    );
}

fn print_group_size(writers: usize, keys: &str, before: tally::LaneStats, after: tally::LaneStats) {
    let updates = after.updates - before.updates;
    let increments = after.increments - before.increments;
    println!(
        "{:>7}  {:<10} lanes: {increments} increments in {updates} updates, mean group {:.1}",
        writers,
        keys,
        increments as f64 / updates.max(1) as f64
    );
}

/// A simulated day on one hot counter: 8 handles, 2 callers each, one of
/// them replaced every third slice (a process restarted), a reconciler
/// pruning with `lane_ttl` of a few seconds after every slice.
async fn lane_memory(
    settings: &Settings,
    options: &mongodb::options::ClientOptions,
    db: &mongodb::Database,
    made: &Arc<AtomicI64>,
) {
    const HANDLES: usize = 8;
    const RESTART_EVERY: usize = 3;
    let lane_ttl = Duration::from_secs(4);
    let writer = WriterConfig {
        lane_resume_horizon: Duration::from_secs(1),
        lane_ttl,
        ..WriterConfig::default()
    };
    // Attempts bounded by 2.5 s (server selection 1 s): the scaled
    // lifetimes leave one attempt between the horizon and lane_ttl.
    let mut options = options.clone();
    options.server_selection_timeout = Some(Duration::from_secs(1));
    let client = Client::with_options(options.clone()).expect("client");
    let store = Store::from_parts(client, &options, DATABASE)
        .with_attempt_timeout(Duration::from_millis(2500));
    let handle = || {
        Arc::new(
            Counters::try_new(&store, CollectionConfig::new("lanes"), writer)
                .expect("the scaled lane settings hold together"),
        )
    };
    let mut handles: Vec<Arc<Counters>> = (0..HANDLES).map(|_| handle()).collect();
    let reconciler = Reconciler::new(&store).with_lane_ttl(lane_ttl);
    let target = FoldTarget {
        spec: CollectionConfig::new("lanes"),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    let slices = (settings.rounds * 3).max(6);
    let mut rates = Vec::new();
    let (mut most, mut pruned, mut unknown) = (0, 0, 0);
    for slice in 0..slices {
        if slice % RESTART_EVERY == RESTART_EVERY - 1 {
            let old = std::mem::replace(&mut handles[slice % HANDLES], handle());
            unknown += old.lane_stats().retired;
        }
        let sides = handles.clone();
        let made_here = made.clone();
        let run = timed(HANDLES * 2, settings.run, move |w, _| {
            let counters = sides[w % HANDLES].clone();
            let made = made_here.clone();
            async move {
                match counters.add("day", 1).await {
                    LaneIncrement::Counted(_) => {
                        made.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!("benchmark lane increment not counted: {other:?}"),
                }
            }
        })
        .await;
        // A plain `$inc` beside it, same slice length, so the server's
        // drift through the day cancels out of the ratio.
        let plain_coll = db.collection::<Document>("plain");
        let baseline = timed(HANDLES * 2, settings.run, move |_, _| {
            let coll = plain_coll.clone();
            async move {
                coll.update_one(doc! { "_id": "day" }, doc! { "$inc": { "counter": 1 } })
                    .upsert(true)
                    .await
                    .expect("plain $inc");
            }
        })
        .await;
        rates.push(run.per_second() / baseline.per_second());
        let now = reconciler.server_time().await.expect("server time");
        let run = reconciler
            .reconcile(
                &target,
                Mode::Fold,
                now,
                &CancellationToken::new(),
                &mut |_| {},
            )
            .await;
        assert!(run.error.is_none(), "prune: {:?}", run.error);
        pruned += run.lanes_pruned;
        let found = db
            .collection::<Document>("lanes")
            .find_one(doc! { "_id": "day" })
            .await
            .expect("read the day's counter")
            .expect("the day's counter exists");
        let entries = found.get_document("lanes").map_or(0, Document::len);
        most = most.max(entries);
    }
    unknown += handles.iter().map(|h| h.lane_stats().retired).sum::<u64>();
    let third = slices / 3;
    let mean = |rates: &[f64]| rates.iter().sum::<f64>() / rates.len() as f64;
    let (start, end) = (mean(&rates[..third]), mean(&rates[slices - third..]));
    let slice_secs = settings.run.as_secs_f64();
    let restarts_within_ttl =
        (lane_ttl.as_secs_f64() / (slice_secs * RESTART_EVERY as f64)).ceil() as usize + 1;
    println!(
        "lane memory: {HANDLES} handles x 2 callers on one counter, one handle restarted every \
         {RESTART_EVERY} slices, {slices} slices of {:?}, lane_ttl {lane_ttl:?}: at most {most} \
         entries (target <= {HANDLES} + {restarts_within_ttl} restarted within lane_ttl + \
         {unknown} unknown), {pruned} pruned; lanes / plain at the end against the start = {:.3}x (target >= 0.95x)",
        settings.run,
        end / start
    );
}

fn print_ratios(writers: usize, keys: &str, plain: &Run, lanes: &Run, two_step: Option<&Run>) {
    let p99 = |run: &Run| ms(run.percentile(99.0)) / ms(plain.percentile(99.0));
    print!(
        "{:>7}  {:<10} lanes / plain = {:.3}x (target >= 0.85x), p99 {:.2}x (target <= 1.3x)",
        writers,
        keys,
        lanes.per_second() / plain.per_second(),
        p99(lanes),
    );
    match two_step {
        Some(two_step) => println!(
            "; two-step / plain = {:.3}x, p99 {:.2}x",
            two_step.per_second() / plain.per_second(),
            p99(two_step)
        ),
        None => println!(),
    }
}

async fn sum_counters(coll: &Collection<Document>) -> i64 {
    let mut cursor = coll
        .aggregate(vec![
            doc! { "$group": { "_id": null, "total": { "$sum": "$counter" } } },
        ])
        .await
        .expect("sum counters");
    match cursor.try_next().await.expect("sum counters") {
        Some(total) => match total.get("total") {
            Some(Bson::Int32(n)) => i64::from(*n),
            Some(Bson::Int64(n)) => *n,
            other => panic!("total: {other:?}"),
        },
        None => 0,
    }
}
