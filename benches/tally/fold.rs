//! The fold on 100k counter documents, 10% of them holding 1–3 stale tokens
//! (bare ObjectIds, the article's form, so every side computes the same
//! result), against two baselines on the same server in the same run:
//!
//! - the article's loop: aggregate `counter + size(pending)`, then one
//!   unconditioned `$set`/`$unset` per document, sequentially;
//! - the floor: one bare server-side `updateMany` doing the same fold.
//!
//! Another shape is measured beside them, to show why tally's fold has the
//! shape it has: the per-document conditioned write, one round trip each.
//! Then the peak RSS of `tallyd reconcile` at 10k and 100k documents.

use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::{Client, Collection, Database};
use tally::{CollectionConfig, FoldTarget, Mode, Reconciler, Store, Token};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::measure::{bench_options, server};

const DOCS: i64 = 100_000;

pub async fn run(settings: &Settings) {
    let rounds = settings.rounds.clamp(1, 3);
    println!(
        "fold: {DOCS} documents, 10% holding 1-3 stale tokens; {rounds} round(s), sides alternating; \
         each measurement on a freshly started server with freshly seeded data"
    );
    let only = std::env::var("TALLY_BENCH_FOLD_SIDES").ok();
    let sides: Vec<(&str, Side)> = vec![
        ("floor: one bare updateMany", Side::Floor),
        ("article's loop", Side::Loop),
        ("tally's fold", Side::Tally),
        ("alt: per-document conditioned", Side::PerDocument),
        ("tally's report alone (dry run)", Side::DryRun),
    ]
    .into_iter()
    .enumerate()
    .filter(|(i, _)| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|s| s == i.to_string()))
    })
    .map(|(_, side)| side)
    .collect();
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); sides.len()];
    for round in 0..rounds {
        for k in 0..sides.len() {
            let i = (k + round) % sides.len();
            // The test server slows down as writes accumulate; a fresh one
            // per measurement keeps the sides comparable.
            let (uri, _server) = server();
            let (store, db) = connect(&uri).await;
            let coll = seed(&db, "fold", DOCS).await;
            let expected = expected_total(&coll).await;
            let took = sides[i].1.run(&store, &coll).await;
            times[i].push(took);
            eprintln!("  {}: {:.2} s", sides[i].0, took.as_secs_f64());
            let total = total(&coll).await;
            assert_eq!(total, expected, "{} folded wrongly", sides[i].0);
            assert_eq!(
                coll.count_documents(doc! { "pending.0": { "$exists": true } })
                    .await
                    .unwrap(),
                0,
                "{} left tokens",
                sides[i].0
            );
        }
    }
    let median = |v: &Vec<Duration>| {
        let mut v = v.clone();
        v.sort();
        v[v.len() / 2]
    };
    let floor = median(&times[0]);
    let looped = median(&times[1]);
    println!(
        "{:<38} {:>9} {:>10} {:>10}",
        "side", "seconds", "vs floor", "vs loop"
    );
    for (i, (name, _)) in sides.iter().enumerate() {
        let t = median(&times[i]);
        println!(
            "{name:<38} {:>9.2} {:>9.2}x {:>9.2}x",
            t.as_secs_f64(),
            t.as_secs_f64() / floor.as_secs_f64(),
            looped.as_secs_f64() / t.as_secs_f64()
        );
    }
    println!("(target: tally <= 1.2x the floor, i.e. >= 1.9x faster than the loop)");

    let (uri, _server) = server();
    let (_, db) = connect(&uri).await;
    println!("\npeak RSS of `tallyd reconcile` (the report is streamed):");
    let mut peaks = Vec::new();
    for n in [10_000, 100_000] {
        seed(&db, "rss", n).await;
        let peak = tallyd_peak_rss(&uri, &db).await;
        println!("  {n:>7} documents: {:>6.1} MB", peak as f64 / 1024.0);
        peaks.push(peak);
    }
    println!(
        "  ratio 100k / 10k = {:.2} (target <= 1.2)",
        peaks[1] as f64 / peaks[0] as f64
    );
}

#[derive(Clone, Copy)]
enum Side {
    Floor,
    Loop,
    Tally,
    PerDocument,
    DryRun,
}

impl Side {
    /// Runs the side and returns how long its measured part took.
    async fn run(self, store: &Store, coll: &Collection<Document>) -> Duration {
        let started = Instant::now();
        match self {
            Side::Floor => {
                let fold = vec![
                    doc! { "$set": { "counter": { "$add": ["$counter", { "$size": "$pending" }] } } },
                    doc! { "$unset": "pending" },
                ];
                coll.update_many(doc! { "pending": { "$exists": true } }, fold)
                    .await
                    .expect("floor");
            }
            Side::Loop => {
                let plan = vec![
                    doc! { "$match": { "pending": { "$exists": true } } },
                    doc! { "$project": { "counter": { "$add": ["$counter", { "$size": "$pending" }] } } },
                ];
                let rows: Vec<Document> = coll
                    .aggregate(plan)
                    .await
                    .unwrap()
                    .try_collect()
                    .await
                    .unwrap();
                for row in rows {
                    coll.update_one(
                        doc! { "_id": row.get("_id").unwrap() },
                        doc! { "$set": { "counter": row.get("counter").unwrap() }, "$unset": { "pending": "" } },
                    )
                    .await
                    .expect("loop");
                }
            }
            Side::DryRun => {
                let reconciler = Reconciler::new(store);
                let now = reconciler.server_time().await.unwrap();
                reconciler
                    .survey(&target(coll), now - Duration::from_secs(900))
                    .await
                    .unwrap();
                let took = started.elapsed();
                // Fold anyway (unmeasured), so the checks after every side hold.
                Box::pin(Side::Floor.run(store, coll)).await;
                return took;
            }
            Side::Tally => {
                let reconciler = Reconciler::new(store);
                let now = reconciler.server_time().await.unwrap();
                let run = reconciler
                    .reconcile(
                        &target(coll),
                        Mode::Fold,
                        now,
                        &CancellationToken::new(),
                        &mut |_| {},
                    )
                    .await;
                assert!(run.error.is_none(), "{:?}", run.error);
            }
            Side::PerDocument => {
                let cutoff = Token::cutoff(SystemTime::now() - Duration::from_secs(900));
                let rows: Vec<Document> = coll
                    .aggregate(vec![
                        doc! { "$match": { "pending": { "$lt": cutoff } } },
                        doc! { "$project": { "pending": 1 } },
                    ])
                    .await
                    .unwrap()
                    .try_collect()
                    .await
                    .unwrap();
                for row in rows {
                    let stale: Vec<Bson> = row
                        .get_array("pending")
                        .unwrap()
                        .iter()
                        .filter(|e| e.as_object_id().is_some_and(|t| t < cutoff))
                        .cloned()
                        .collect();
                    coll.update_one(
                        doc! { "_id": row.get("_id").unwrap(), "pending": { "$all": &stale } },
                        doc! { "$pullAll": { "pending": &stale }, "$inc": { "counter": stale.len() as i64 } },
                    )
                    .await
                    .expect("per-document fold");
                }
            }
        }
        started.elapsed()
    }
}

async fn connect(uri: &str) -> (Store, Database) {
    let options = bench_options(uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database("tally_bench_fold");
    db.drop().await.expect("drop bench database");
    (Store::from_parts(client, &options, "tally_bench_fold"), db)
}

fn target(coll: &Collection<Document>) -> FoldTarget {
    FoldTarget {
        spec: CollectionConfig::new(coll.name()),
        grace: Duration::from_secs(900),
        batch_size: 100,
    }
}

/// Seeds `n` counters, every tenth holding 1–3 stale bare tokens.
async fn seed(db: &Database, name: &str, n: i64) -> Collection<Document> {
    let coll: Collection<Document> = db.collection(name);
    coll.drop().await.expect("drop");
    let old = SystemTime::now() - Duration::from_secs(3600);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut batch = Vec::with_capacity(5000);
    for i in 0..n {
        let mut d = doc! { "_id": i, "counter": rng.i64(0..1000) };
        if i % 10 == 0 {
            let tokens: Vec<Bson> = (0..rng.usize(1..=3))
                .map(|_| Bson::ObjectId(Token::created_at_time(old).object_id()))
                .collect();
            d.insert("pending", tokens);
        }
        batch.push(d);
        if batch.len() == 5000 {
            coll.insert_many(std::mem::take(&mut batch))
                .await
                .expect("seed");
        }
    }
    if !batch.is_empty() {
        coll.insert_many(batch).await.expect("seed");
    }
    coll
}

async fn expected_total(coll: &Collection<Document>) -> i64 {
    sum(
        coll,
        doc! { "$add": ["$counter", { "$size": { "$ifNull": ["$pending", []] } }] },
    )
    .await
}

async fn total(coll: &Collection<Document>) -> i64 {
    sum(coll, Bson::String("$counter".into())).await
}

async fn sum(coll: &Collection<Document>, expr: impl Into<Bson>) -> i64 {
    let rows: Vec<Document> = coll
        .aggregate(vec![
            doc! { "$group": { "_id": null, "s": { "$sum": expr.into() } } },
        ])
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    match rows[0].get("s") {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        other => panic!("sum is {other:?}"),
    }
}

/// Runs `tallyd reconcile` on the `rss` collection and returns its peak
/// resident set size in KiB (VmHWM, polled until it exits).
async fn tallyd_peak_rss(uri: &str, db: &Database) -> u64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("tallyd.toml");
    std::fs::write(
        &config,
        format!(
            "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{}\"\n[[collections]]\nname = \"rss\"\n",
            db.name()
        ),
    )
    .expect("write config");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .arg("--config")
        .arg(&config)
        .args(["reconcile", "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tallyd");
    let pid = child.id().expect("pid");
    let mut peak = 0;
    loop {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kb) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak = peak.max(kb);
        }
        if let Ok(Some(status)) = child.try_wait() {
            assert!(status.success(), "tallyd reconcile failed: {status}");
            return peak;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
