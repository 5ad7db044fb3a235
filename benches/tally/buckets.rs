//! Counters by time: a bucketed write against the same protocol without
//! buckets (the two-step increment, and `record`), and a range read of 31
//! day buckets against one exact read, each pair interleaved in one run.
//!
//! Goals (issue 27): a bucketed increment and record ≥ 0.95× the same
//! protocol without buckets; `get` of 31 day buckets ≤ 2× one exact read.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use mongodb::bson::doc;
use mongodb::options::IndexOptions;
use mongodb::{Client, IndexModel};
use tally::{
    BucketWidth, Buckets, CollectionConfig, Counters, Increment, Ledger, Recording, Store,
    WriterConfig,
};

use crate::Settings;
use crate::measure::{Run, bench_options, merge, ms, server, timed};

const KEYS: usize = 1000;
const DAY: Duration = Duration::from_secs(24 * 3600);

pub async fn run(settings: &Settings) {
    let (uri, _server) = server();
    let options = bench_options(&uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database("tally_bench_buckets");
    db.drop().await.expect("drop bench database");
    let store = Store::from_parts(client, &options, "tally_bench_buckets");
    let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")
        .expect("zone")
        .with_close_after(60 * DAY);
    let bucketed = |name: &str| CollectionConfig::new(name).with_buckets(days.clone());
    println!(
        "buckets (issue 27): a bucketed write vs the same without buckets; {KEYS} keys, 1 writer, \
         retryWrites=false, {} interleaved slices x {:?} per side",
        settings.rounds, settings.run
    );
    println!(
        "{:<30} {:>9} {:>9} {:>9}",
        "side", "ops/s", "p50 ms", "p99 ms"
    );

    let plain = Arc::new(Counters::new(
        &store,
        CollectionConfig::new("plain"),
        WriterConfig::default(),
    ));
    let by_day = Arc::new(Counters::new(
        &store,
        bucketed("by_day"),
        WriterConfig::default(),
    ));
    // The index `tallyd setup` makes for a bucketed collection.
    let by_key_and_bucket = IndexModel::builder()
        .keys(doc! { "_id.k": 1, "_id.t": 1 })
        .options(
            IndexOptions::builder()
                .name("tally_counters_bucket".to_owned())
                .build(),
        )
        .build();
    db.collection::<mongodb::bson::Document>("by_day")
        .create_index(by_key_and_bucket)
        .await
        .expect("the bucket index");
    let [without, with] = interleave(settings, |side| {
        let counters = if side == 0 {
            plain.clone()
        } else {
            by_day.clone()
        };
        async move {
            timed(1, settings.run, move |_, i| {
                let counters = counters.clone();
                async move {
                    let key = format!("k{}", (i * 31) % KEYS);
                    match counters.increment(key, 1).await {
                        Increment::Counted(_) => {}
                        other => panic!("benchmark increment: {other:?}"),
                    }
                }
            })
            .await
        }
    })
    .await;
    print_pair("increment (two-step)", &without, &with, 0.95);

    let serial = Arc::new(AtomicI64::new(0));
    let plain_ledger = Arc::new(Ledger::new(&store, CollectionConfig::new("recorded")));
    let day_ledger = Arc::new(Ledger::new(&store, bucketed("recorded_by_day")));
    for ledger in [&plain_ledger, &day_ledger] {
        ledger.create_indexes().await.expect("indexes");
    }
    let [without, with] = interleave(settings, |side| {
        let ledger = if side == 0 {
            plain_ledger.clone()
        } else {
            day_ledger.clone()
        };
        let serial = serial.clone();
        async move {
            timed(1, settings.run, move |_, i| {
                let (ledger, serial) = (ledger.clone(), serial.clone());
                async move {
                    let key = format!("k{}", (i * 31) % KEYS);
                    let event = format!("e{}", serial.fetch_add(1, Ordering::Relaxed));
                    match ledger.record(event, key, 1).await {
                        Recording::Recorded(_) => {}
                        other => panic!("benchmark record: {other:?}"),
                    }
                }
            })
            .await
        }
    })
    .await;
    print_pair("record", &without, &with, 0.95);

    // 31 days of one key, an event in each day and some not folded yet,
    // against one exact read of a plain key with as many events.
    let now = SystemTime::now();
    let from = days.start_of(now - 30 * DAY).expect("a day");
    let to = days.end_of(now).expect("a day");
    for day in 0..31u32 {
        let at = (from + DAY * day + Duration::from_secs(3600)).min(now);
        let recorded = day_ledger
            .record_at(format!("month-{day}"), "month", 1, at)
            .await;
        assert!(matches!(recorded, Recording::Recorded(_)), "{recorded:?}");
        let recorded = plain_ledger
            .record(format!("month-{day}"), "month", 1)
            .await;
        assert!(matches!(recorded, Recording::Recorded(_)), "{recorded:?}");
    }
    let [one, range] = interleave(settings, |side| {
        let (plain_ledger, day_ledger) = (plain_ledger.clone(), day_ledger.clone());
        async move {
            timed(1, settings.run, move |_, _| {
                let (plain_ledger, day_ledger) = (plain_ledger.clone(), day_ledger.clone());
                async move {
                    if side == 0 {
                        let read = plain_ledger.value("month").await.expect("an exact read");
                        assert_eq!(read.value, 31);
                    } else {
                        let read = day_ledger
                            .values_between("month", from, to, None)
                            .await
                            .expect("a range read");
                        assert_eq!((read.buckets.len(), read.total), (31, 31));
                    }
                }
            })
            .await
        }
    })
    .await;
    print_row("one exact read", &one);
    print_row("31 day buckets", &range);
    let ratio = one.per_second() / range.per_second();
    println!(
        "{:<30} time ratio = {ratio:.2}x (goal <= 2x): met = {}",
        "31 day buckets / one read",
        ratio <= 2.0
    );
}

/// Runs `side(0)` and `side(1)` in alternating slices, `settings.rounds`
/// each (which side goes first rotates), and merges each side's slices.
async fn interleave<F, Fut>(settings: &Settings, side: F) -> [Run; 2]
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Run>,
{
    let mut runs: [Vec<Run>; 2] = Default::default();
    for round in 0..settings.rounds {
        for k in 0..2 {
            let which = (k + round) % 2;
            runs[which].push(side(which).await);
        }
    }
    let [a, b] = runs;
    [merge(a), merge(b)]
}

fn print_row(label: &str, run: &Run) {
    println!(
        "{label:<30} {:>9.0} {:>9.2} {:>9.2}",
        run.per_second(),
        ms(run.percentile(50.0)),
        ms(run.percentile(99.0))
    );
}

fn print_pair(label: &str, without: &Run, with: &Run, goal: f64) {
    print_row(&format!("{label}, no buckets"), without);
    print_row(&format!("{label}, day buckets"), with);
    let ratio = with.per_second() / without.per_second();
    println!(
        "{:<30} ratio = {ratio:.3}x (goal >= {goal}x): met = {}",
        format!("{label} bucketed / plain"),
        ratio >= goal
    );
}
