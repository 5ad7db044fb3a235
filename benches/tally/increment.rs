//! Plain `$inc` against the two-step increment, same server, same keys.
//!
//! Two round trips are the floor for the two-step increment, so the target
//! is a throughput ratio of at least 0.47× (the floor is 0.5×).
//!
//! A fourth side sends the two steps as tally sent them before step 2
//! became an update pipeline (`$pull` + `$inc`, raw through the driver, with
//! the same write concern), so the pipeline's cost is measured in the same
//! run: the `pipeline / $pull` ratio.

use std::sync::Arc;
use std::time::Duration;

use mongodb::bson::{Document, doc, oid::ObjectId};
use mongodb::{Client, Collection};
use tally::{CollectionConfig, Counters, Increment, Store, WriterConfig};

use crate::Settings;
use crate::measure::{Run, bench_options, merge, ms, server, timed};

const KEYS: usize = 1000;

pub async fn run(settings: &Settings) {
    let (uri, _server) = server();
    let options = bench_options(&uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database("tally_bench_increment");
    db.drop().await.expect("drop bench database");
    let plain: Collection<Document> = db.collection("plain");
    let two_step: Collection<Document> = db.collection("two_step");
    let pull: Collection<Document> = db.collection("pull_step_2");
    for coll in [&plain, &two_step, &pull] {
        let docs: Vec<Document> = (0..KEYS)
            .map(|k| doc! { "_id": format!("k{k}"), "counter": 0i64 })
            .collect();
        coll.insert_many(docs).await.expect("seed keys");
    }
    let store = Store::from_parts(client.clone(), &options, "tally_bench_increment");
    // tally's write concern (majority), so only step 2's shape differs.
    let pull = store.collection(pull.name());
    let counters = Arc::new(Counters::new(
        &store,
        CollectionConfig::new("two_step"),
        WriterConfig::default(),
    ));

    println!(
        "increment: plain $inc vs tally's two-step increment; {KEYS} keys, retryWrites=false, \
         {} interleaved slices x {:?} per side",
        settings.rounds, settings.run
    );
    println!(
        "{:>7}  {:<9} {:>9} {:>9} {:>9}",
        "writers", "kind", "ops/s", "p50 ms", "p99 ms"
    );
    for writers in [1usize, 16] {
        let mut runs: [Vec<Run>; 4] = Default::default();
        for round in 0..settings.rounds {
            // Rotate which side goes first, so drift hits every side alike.
            for k in 0..4 {
                let side = (k + round) % 4;
                let run = match side {
                    0 => run_plain(&plain, writers, settings.run, KEYS, 1).await,
                    1 => run_plain(&plain, writers, settings.run, KEYS, 2).await,
                    2 => run_pull_step_2(&pull, writers, settings.run).await,
                    _ => run_two_step(&counters, writers, settings.run).await,
                };
                runs[side].push(run);
            }
        }
        let [plain_runs, double_runs, pull_runs, tally_runs] = runs;
        let (plain_run, double) = (merge(plain_runs), merge(double_runs));
        let (pull_run, tally) = (merge(pull_runs), merge(tally_runs));
        print_row(writers, "plain", &plain_run);
        print_row(writers, "2x plain", &double);
        print_row(writers, "$pull", &pull_run);
        print_row(writers, "two-step", &tally);
        println!(
            "{:>7}  ratio two-step / plain = {:.3}x (target >= 0.47x); two plain round trips = {:.3}x",
            writers,
            tally.per_second() / plain_run.per_second(),
            double.per_second() / plain_run.per_second(),
        );
        println!(
            "{:>7}  ratio pipeline step 2 / $pull step 2 = {:.3}x",
            writers,
            tally.per_second() / pull_run.per_second(),
        );
    }
    let total = store
        .collection("two_step")
        .aggregate(vec![doc! { "$group": { "_id": null, "pending": { "$sum": { "$size": { "$ifNull": ["$pending", []] } } } } }])
        .await;
    if let Ok(mut cursor) = total {
        use futures::TryStreamExt;
        if let Ok(Some(d)) = cursor.try_next().await {
            let left = d
                .get_i32("pending")
                .map(i64::from)
                .or_else(|_| d.get_i64("pending"))
                .unwrap_or(-1);
            println!("tokens left pending after the runs: {left} (must be 0)");
        }
    }
}

fn print_row(writers: usize, kind: &str, run: &Run) {
    println!(
        "{:>7}  {:<9} {:>9.0} {:>9.2} {:>9.2}",
        writers,
        kind,
        run.per_second(),
        ms(run.percentile(50.0)),
        ms(run.percentile(99.0))
    );
}

/// Plain `$inc` upserts over `keys` keys; `round_trips` of them make one
/// counted operation
/// (2: the floor for any protocol with two round trips).
pub(crate) async fn run_plain(
    coll: &Collection<Document>,
    writers: usize,
    duration: Duration,
    keys: usize,
    round_trips: usize,
) -> Run {
    let coll = coll.clone();
    timed(writers, duration, move |w, i| {
        let coll = coll.clone();
        async move {
            let key = format!("k{}", (w * 7919 + i * 31) % keys);
            for _ in 0..round_trips {
                coll.update_one(doc! { "_id": &key }, doc! { "$inc": { "counter": 1 } })
                    .upsert(true)
                    .await
                    .expect("plain $inc");
            }
        }
    })
    .await
}

/// The two steps as tally sent them before step 2 became a pipeline: an
/// `$addToSet` upsert, then a conditioned `$pull` + `$inc` (which leaves an
/// empty pending array behind).
async fn run_pull_step_2(coll: &Collection<Document>, writers: usize, duration: Duration) -> Run {
    let coll = coll.clone();
    timed(writers, duration, move |w, i| {
        let coll = coll.clone();
        async move {
            let key = format!("k{}", (w * 7919 + i * 31) % KEYS);
            let token = ObjectId::new();
            coll.update_one(
                doc! { "_id": &key },
                doc! { "$addToSet": { "pending": token }, "$setOnInsert": { "counter": 0i64 } },
            )
            .upsert(true)
            .await
            .expect("step 1");
            let counted = coll
                .update_one(
                    doc! { "_id": &key, "pending": token },
                    doc! { "$pull": { "pending": token }, "$inc": { "counter": 1 } },
                )
                .await
                .expect("$pull step 2");
            assert_eq!(counted.matched_count, 1, "$pull step 2 counted nothing");
        }
    })
    .await
}

async fn run_two_step(counters: &Arc<Counters>, writers: usize, duration: Duration) -> Run {
    let counters = counters.clone();
    timed(writers, duration, move |w, i| {
        let counters = counters.clone();
        async move {
            let key = format!("k{}", (w * 7919 + i * 31) % KEYS);
            match counters.increment(key, 1).await {
                Increment::Counted(_) => {}
                other => panic!("benchmark increment not counted: {other:?}"),
            }
        }
    })
    .await
}
