//! Closing buckets against folding their tokens (issue 27's goal: closing
//! 10,000 buckets ≤ 2× folding their tokens), in one run on one server:
//! 10,000 minute buckets each holding one stale token; a reconcile run
//! whose buckets are not due folds the tokens (the baseline), then a run
//! whose buckets are all due closes them (nothing left to fold). Each run
//! is checked against the documents: every token counted once, then every
//! bucket closed and compact. `TALLY_BENCH_CLOSING_BUCKETS` sets the count.

use std::time::{Duration, Instant, SystemTime};

use mongodb::Client;
use mongodb::bson::{DateTime, Document, doc};
use tally::{BucketWidth, Buckets, CollectionConfig, FoldTarget, Mode, Reconciler, Store, Token};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::measure::{bench_options, server};

const DEFAULT_BUCKETS: usize = 10_000;
const KEYS: usize = 100;
const MINUTE: Duration = Duration::from_secs(60);

pub async fn run(settings: &Settings) {
    let buckets: usize = std::env::var("TALLY_BENCH_CLOSING_BUCKETS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_BUCKETS);
    let rounds = settings.rounds.clamp(1, 3);
    println!(
        "closing (issue 27): {buckets} minute buckets ({KEYS} keys), one stale token each; \
         fold their tokens, then close them; {rounds} round(s), a fresh server each"
    );
    let (mut fold_times, mut close_times) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (uri, _server) = server();
        let options = bench_options(&uri).await;
        let client = Client::with_options(options.clone()).expect("client");
        let db = client.database("tally_bench_closing");
        db.drop().await.expect("drop bench database");
        let store = Store::from_parts(client, &options, "tally_bench_closing");
        let coll = db.collection::<Document>("calls");
        let first = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600); // 2026-01-01
        let stale = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
        let documents: Vec<Document> = (0..buckets)
            .map(|i| {
                let start = first + MINUTE * (i / KEYS) as u32;
                doc! {
                    "_id": { "k": format!("k{}", i % KEYS), "t": DateTime::from_system_time(start) },
                    "counter": 0i64,
                    "pending": [{ "t": stale.object_id(), "n": 1i64 }],
                }
            })
            .collect();
        for chunk in documents.chunks(1000) {
            coll.insert_many(chunk.to_vec()).await.expect("seed");
        }
        // The indexes `tallyd setup` makes on a bucketed collection.
        for keys in [
            doc! { "_id.k": 1, "_id.t": 1 },
            doc! { "closed": 1, "_id.t": 1 },
        ] {
            let index = mongodb::IndexModel::builder().keys(keys).build();
            coll.create_index(index).await.expect("setup's indexes");
        }
        let minutes = Buckets::utc(BucketWidth::Minute);
        let target = |buckets: Buckets| FoldTarget {
            spec: CollectionConfig::new("calls").with_buckets(buckets),
            grace: Duration::from_secs(60),
            batch_size: 100,
        };
        let reconciler = Reconciler::new(&store);
        let now = reconciler.server_time().await.expect("server time");
        let not_due = target(
            minutes
                .clone()
                .with_close_after(Duration::from_secs(10 * 365 * 86_400)),
        );
        let folded = timed_run(&reconciler, &not_due, now).await;
        assert_eq!(
            folded.1.tokens_folded, buckets as u64,
            "every token folded once"
        );
        let due = target(
            minutes
                .with_close_after(Duration::from_secs(1))
                .with_closing_margin(Duration::from_secs(1)),
        );
        let closed = timed_run(&reconciler, &due, now).await;
        let closing = closed.1.buckets.clone().expect("a bucketed collection");
        assert_eq!((closing.closed, closing.unclosed), (buckets as u64, 0));
        let total: i64 = count(
            &coll,
            doc! { "counter": 1i64, "closed": { "$type": "date" } },
        )
        .await;
        assert_eq!(
            total, buckets as i64,
            "every bucket counted once and closed"
        );
        assert_eq!(
            count(&coll, doc! { "pending": { "$exists": true } }).await,
            0
        );
        eprintln!(
            "  fold {:.2} s, close {:.2} s",
            folded.0.as_secs_f64(),
            closed.0.as_secs_f64()
        );
        fold_times.push(folded.0);
        close_times.push(closed.0);
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (fold, close) = (median(fold_times), median(close_times));
    println!(
        "{:<36} {:>8.2} s",
        "fold of their tokens (baseline)",
        fold.as_secs_f64()
    );
    println!("{:<36} {:>8.2} s", "closing them", close.as_secs_f64());
    let ratio = close.as_secs_f64() / fold.as_secs_f64();
    println!(
        "{:<36} time ratio = {ratio:.2}x (goal <= 2x): met = {}",
        format!("closing {buckets} / folding"),
        ratio <= 2.0
    );
}

async fn timed_run(
    reconciler: &Reconciler,
    target: &FoldTarget,
    now: SystemTime,
) -> (Duration, tally::CollectionRun) {
    let started = Instant::now();
    let run = reconciler
        .reconcile(
            target,
            Mode::Fold,
            now,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await;
    let took = started.elapsed();
    assert!(run.error.is_none(), "{:?}", run.error);
    (took, run)
}

async fn count(coll: &mongodb::Collection<Document>, filter: Document) -> i64 {
    let n = coll.count_documents(filter).await.expect("count");
    i64::try_from(n).unwrap_or(i64::MAX)
}
