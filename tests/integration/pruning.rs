//! The fold's pruning of writer lanes (the book: design/lanes.md) against a real server:
//! expired minted lanes go, named and young ones stay, malformed lane maps
//! are never touched, documents holding tokens and lanes are folded and
//! pruned by one statement, and pruning is exact on documents writers keep
//! writing through fresh lanes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{
    CollectionConfig, Counters, FoldTarget, LaneIncrement, Mode, Reconciler, Store, Token,
    WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::common::{TestClient, TestContext, counter, field};

const GRACE: Duration = Duration::from_secs(15 * 60);
const LANE_TTL: Duration = Duration::from_secs(3600);

fn target() -> FoldTarget {
    FoldTarget {
        spec: CollectionConfig::new("views"),
        grace: GRACE,
        batch_size: 100,
    }
}

/// A minted lane's key, the lane created `age` ago.
fn minted(age: Duration) -> String {
    Token::created_at_time(SystemTime::now() - age)
        .object_id()
        .to_hex()
}

/// A minted lane expired for every `lane_ttl` here (the default 24h too).
fn expired() -> String {
    minted(Duration::from_secs(48 * 3600))
}

fn young() -> String {
    ObjectId::new().to_hex()
}

/// A pending token older than the grace.
fn stale() -> ObjectId {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(3600)).object_id()
}

async fn server_now(store: &Store) -> SystemTime {
    Reconciler::new(store).server_time().await.unwrap()
}

/// One run of `views` with `LANE_TTL`, at the server's time.
async fn run(store: &Store, mode: Mode) -> tally::CollectionRun {
    run_by(&Reconciler::new(store).with_lane_ttl(LANE_TTL), mode).await
}

/// One run of `views` by `reconciler` at the server's time; it must not
/// fail.
async fn run_by(reconciler: &Reconciler, mode: Mode) -> tally::CollectionRun {
    let now = reconciler.server_time().await.unwrap();
    let run = reconciler
        .reconcile(&target(), mode, now, &CancellationToken::new(), &mut |_| {})
        .await;
    assert!(run.error.is_none(), "reconcile failed: {:?}", run.error);
    run
}

async fn all(client: &TestClient) -> Vec<Document> {
    use futures::TryStreamExt;
    client
        .collection("views")
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// Expired minted lanes are removed, named and young minted lanes kept
/// with their values, an emptied or empty map removed, the counter never
/// touched; a dry run reports exactly what the run then prunes, and a
/// second run finds nothing.
#[tokio::test]
async fn expired_minted_lanes_are_pruned_and_named_and_young_ones_kept() {
    let ctx = TestContext::new("prune_lanes").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let (old1, old2, old3, fresh) = (expired(), expired(), expired(), young());
    views
        .insert_many(vec![
            doc! { "_id": 1, "counter": 7i64,
            "lanes": { &old1: 3i64, &fresh: 2i64, "orders:1": 9i64, &old2: 1 } },
            doc! { "_id": 2, "counter": 1, "lanes": { &old3: 1i64 } },
            doc! { "_id": 3, "counter": 2i64, "lanes": {} },
            doc! { "_id": 4, "counter": 3i64, "lanes": { &fresh: 5i64 } },
            doc! { "_id": 5, "counter": 4i64 },
        ])
        .await
        .unwrap();
    let before = all(&client).await;

    let dry = run(&client.store(), Mode::DryRun).await;
    assert_eq!(all(&client).await, before, "a dry run changes nothing");
    assert_eq!(dry.lanes_pruned, 3);
    assert_eq!(dry.documents_folded, 3, "1 and 2 pruned, 3's empty map");
    assert_eq!(
        dry.survey.documents_scanned, 4,
        "5 holds no lanes: not read"
    );
    assert_eq!(dry.survey.documents_with_lanes, 3);
    assert_eq!(dry.survey.lane_entries, 6);
    assert_eq!(dry.survey.largest_lane_map, 4);
    assert_eq!(dry.survey.expired_lane_entries, 3);
    assert_eq!(dry.survey.named_lanes.get("orders:1"), Some(&9));

    let folded = run(&client.store(), Mode::Fold).await;
    assert_eq!(
        (folded.lanes_pruned, folded.documents_folded),
        (dry.lanes_pruned, dry.documents_folded),
        "the dry run reported exactly what the run did"
    );
    assert_eq!(folded.tokens_folded, 0);
    let after = all(&client).await;
    assert_eq!(
        after[0],
        doc! { "_id": 1, "counter": 7i64, "lanes": { &fresh: 2i64, "orders:1": 9i64 } }
    );
    assert_eq!(after[1], doc! { "_id": 2, "counter": 1 });
    assert_eq!(after[2], doc! { "_id": 3, "counter": 2i64 });
    assert_eq!(after[3], before[3], "nothing expired: not written");
    assert_eq!(after[4], before[4]);

    let again = run(&client.store(), Mode::Fold).await;
    assert_eq!((again.lanes_pruned, again.documents_folded), (0, 0));
    assert_eq!(all(&client).await, after);
}

/// A lane map that is not a document, or holds a value that is not a
/// non-negative integer, makes its document malformed: never modified
/// (its stale tokens and expired lanes included), counted and named.
#[tokio::test]
async fn malformed_lane_maps_are_never_modified_and_are_reported() {
    let ctx = TestContext::new("prune_malformed").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let old = expired();
    let bad = [
        Bson::Array(vec![Bson::Int64(1)]),
        Bson::String("x".into()),
        Bson::Document(doc! { &old: 1.5 }),
        Bson::Document(doc! { &old: 2i64, "orders:1": -1i64 }),
        Bson::Document(doc! { &old: "3" }),
        Bson::Document(doc! { &old: Bson::Null }),
    ];
    for (i, lanes) in bad.iter().enumerate() {
        views
            .insert_one(doc! { "_id": i as i32, "counter": 1i64, "pending": [stale()], "lanes": lanes.clone() })
            .await
            .unwrap();
    }
    views
        .insert_one(doc! { "_id": "ok", "counter": 1i64, "lanes": { &old: 1i64 } })
        .await
        .unwrap();
    let before = all(&client).await;
    let folded = run(&client.store(), Mode::Fold).await;
    assert_eq!(folded.survey.malformed, bad.len() as u64);
    assert_eq!(folded.lanes_pruned, 1, "only the well-formed document");
    assert_eq!(folded.tokens_folded, 0);
    let mut sampled: Vec<String> = folded
        .survey
        .malformed_sample
        .iter()
        .map(|m| m.id.clone())
        .collect();
    sampled.sort();
    assert_eq!(sampled, ["0", "1", "2", "3", "4", "5"]);
    assert!(
        folded
            .survey
            .malformed_sample
            .iter()
            .all(|m| m.reason.contains("lane")),
        "{:?}",
        folded.survey.malformed_sample
    );
    let after = all(&client).await;
    assert_eq!(&after[..bad.len()], &before[..bad.len()], "never modified");
    assert_eq!(field(&views, "ok", "lanes").await, None);
}

/// Interop: documents holding pending tokens, settle markers and lanes are
/// folded, pruned and reported by one statement each — in the exact form
/// and in the prefix form of a large pending array.
#[tokio::test]
async fn documents_with_tokens_markers_and_lanes_fold_prune_and_report() {
    let ctx = TestContext::new("prune_interop").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let (old, fresh) = (expired(), young());
    let (t, settled_t, young_token) = (stale(), stale(), ObjectId::new());
    views
        .insert_one(doc! {
            "_id": "small",
            "counter": 10i64,
            "pending": [{ "t": t, "n": 5i64 }, young_token, settled_t],
            "settled": [{ "t": settled_t, "n": 1i64 }],
            "lanes": { &old: 4i64, &fresh: 1i64, "orders:0": 3i64 },
        })
        .await
        .unwrap();
    // Stale entries × array length past the exact form's limit: the prefix
    // form, its lanes pruned by the last statement.
    let mut pending: Vec<Bson> = vec![Bson::ObjectId(stale()), Bson::ObjectId(stale())];
    pending.extend((0..3000).map(|_| Bson::ObjectId(ObjectId::new())));
    let large_fresh: Vec<Bson> = pending[2..].to_vec();
    views
        .insert_one(doc! {
            "_id": "large",
            "counter": 0i64,
            "pending": pending,
            "lanes": { expired(): 9i64, &fresh: 2i64 },
        })
        .await
        .unwrap();

    let dry = run(&client.store(), Mode::DryRun).await;
    assert_eq!(
        (dry.tokens_folded, dry.amount_folded, dry.lanes_pruned),
        (3, 7, 2)
    );
    let folded = run(&client.store(), Mode::Fold).await;
    assert_eq!(
        (
            folded.tokens_folded,
            folded.amount_folded,
            folded.lanes_pruned
        ),
        (3, 7, 2)
    );
    assert_eq!(folded.survey.settled_copies, 1);
    assert_eq!(folded.survey.stale_markers, 1);
    assert_eq!(folded.documents_folded, 2);
    assert_eq!(folded.concurrent_changes, 0);

    let small = views
        .find_one(doc! { "_id": "small" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        small,
        doc! {
            "_id": "small",
            "counter": 15i64,
            "pending": [young_token],
            "lanes": { &fresh: 1i64, "orders:0": 3i64 },
        }
    );
    assert_eq!(counter(&views, "large").await, 2);
    assert_eq!(
        field(&views, "large", "pending").await,
        Some(Bson::Array(large_fresh))
    );
    assert_eq!(
        field(&views, "large", "lanes").await,
        Some(Bson::Document(doc! { &fresh: 2i64 }))
    );
    let again = run(&client.store(), Mode::Fold).await;
    assert_eq!((again.documents_folded, again.lanes_pruned), (0, 0));
}

/// A fold whose update the server holds while a writer adds through a
/// fresh lane and a late copy bumps the expired lane: the fold re-reads,
/// prunes what is expired and keeps the fresh lane; every count stays.
#[tokio::test]
async fn a_fold_racing_a_lane_writer_keeps_the_fresh_lane_and_every_count() {
    let ctx = TestContext::new("prune_race").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let old = expired();
    views
        .insert_one(doc! { "_id": "k", "counter": 1i64, "lanes": { &old: 3i64 } })
        .await
        .unwrap();
    let now = server_now(&client.store()).await;
    let (fail, fold) =
        crate::reconcile::fold_held_on_the_server(&ctx, &client, now, Duration::from_secs(4)).await;
    let rival = ctx.rival_store().await;
    let writer = Counters::new(
        &rival,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    assert!(matches!(
        writer.add("k", 5).await,
        LaneIncrement::Counted(_)
    ));
    views
        .update_one(
            doc! { "_id": "k" },
            doc! { "$set": { format!("lanes.{old}"): 4i64 } },
        )
        .await
        .unwrap();
    let folded = fold.await.unwrap();
    drop(fail);
    assert_eq!(folded.lanes_pruned, 1);
    assert!(folded.concurrent_changes == 0 && folded.documents_folded == 1);
    let lanes = match field(&views, "k", "lanes").await {
        Some(Bson::Document(lanes)) => lanes,
        other => panic!("lanes: {other:?}"),
    };
    assert_eq!(lanes.len(), 1, "the writer's fresh lane stays: {lanes:?}");
    assert!(!lanes.contains_key(&old));
    assert_eq!(counter(&views, "k").await, 6);
}

/// Writers keep adding through fresh handles (a new one every second, as
/// processes come and go) while the fold prunes entries not written for
/// 5 s every 300 ms: every counter equals the increments acknowledged,
/// entries were pruned while writers wrote, and no map keeps an entry past
/// its lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_is_exact_on_live_documents_written_through_fresh_lanes() {
    const KEYS: i32 = 3;
    const WRITERS: usize = 3;
    let lane_ttl = Duration::from_secs(5);
    let ctx = TestContext::new("prune_live").await;
    // Attempts bounded by 2 s (server selection 1 s + its margin), so an
    // update resumable for 2 s may be pruned after 5 s.
    let client = ctx
        .client_with_uri_options("serverSelectionTimeoutMS=1000", false)
        .await;
    let store = client.store().with_attempt_timeout(Duration::from_secs(2));
    let writer = WriterConfig {
        lane_resume_horizon: Duration::from_secs(2),
        lane_ttl,
        ..WriterConfig::default()
    };
    let handle = move || {
        Counters::try_new(&store, CollectionConfig::new("views"), writer)
            .expect("the lane settings hold together")
    };
    let stop = Arc::new(AtomicBool::new(false));
    let acknowledged: Arc<Vec<AtomicU64>> =
        Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (handle, stop, acknowledged) = (handle.clone(), stop.clone(), acknowledged.clone());
        writers.push(tokio::spawn(async move {
            let mut i = w;
            let mut counters = handle();
            let mut made = std::time::Instant::now();
            while !stop.load(Ordering::Relaxed) {
                if made.elapsed() >= Duration::from_secs(1) {
                    (counters, made) = (handle(), std::time::Instant::now());
                }
                let key = (i % KEYS as usize) as i32;
                match counters.add(key, 1).await {
                    LaneIncrement::Counted(_) => {
                        acknowledged[key as usize].fetch_add(1, Ordering::Relaxed);
                    }
                    LaneIncrement::NotCounted(_) => {}
                    other => panic!("no fault here, yet {other:?}"),
                }
                i += 1;
            }
        }));
    }
    // The fold and the checks use a client of their own with the default
    // server selection: under a loaded machine the writers' 1 s bound may
    // run out, which their outcomes allow, but a check must not give up.
    let checker = ctx.client(false).await;
    let fold_store = checker.store();
    let reconciler = Reconciler::new(&fold_store).with_lane_ttl(lane_ttl);
    let mut pruned = 0;
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        pruned += run_by(&reconciler, Mode::Fold).await.lanes_pruned;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let views = checker.collection("views");
    let mut total = 0;
    for key in 0..KEYS {
        let expected = acknowledged[key as usize].load(Ordering::Relaxed);
        assert_eq!(counter(&views, key).await as u64, expected, "key {key}");
        total += expected;
    }
    assert!(total > 100, "the writers wrote: {total}");
    assert!(pruned > 0, "entries were pruned while writers wrote");
    // One more run: no entry written before the lifetime stays.
    let now = run_by(&reconciler, Mode::Fold).await.cutoff + GRACE;
    let cutoff = now - lane_ttl;
    let cutoff_micros = cutoff
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        * 1_000_000;
    for key in 0..KEYS {
        if let Some(Bson::Document(lanes)) = field(&views, key, "lanes").await {
            assert!(
                lanes.len() <= WRITERS * 7,
                "key {key}: {} entries",
                lanes.len()
            );
            for (lane, written) in &lanes {
                let written = written.as_i64().expect("a time");
                assert!(
                    written >= cutoff_micros,
                    "key {key}: lane {lane} outlived lane_ttl"
                );
            }
        }
    }
}
