//! The fold against a real server: exact on live documents, idempotent,
//! concurrent-safe, and never touching a malformed document.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use futures::future::join_all;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc, oid::ObjectId};
use tally::reconcile::model;
use tally::{
    CollectionConfig, Counters, FoldTarget, Increment, Mode, Reconciler, Store, Token, WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::common::{FailPoint, TestContext, counter, pending_len, run_reconcile, wait_until};

const GRACE: Duration = Duration::from_secs(15 * 60);

fn target(spec: CollectionConfig) -> FoldTarget {
    FoldTarget {
        spec,
        grace: GRACE,
        batch_size: 100,
    }
}

/// A token older than the grace.
fn stale() -> ObjectId {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(3600)).object_id()
}

/// A token younger than the grace.
fn fresh() -> ObjectId {
    ObjectId::new()
}

async fn reconcile(store: &Store, target: &FoldTarget, mode: Mode) -> tally::CollectionRun {
    let run = run_reconcile(store, target, mode).await;
    assert!(run.error.is_none(), "reconcile failed: {:?}", run.error);
    run
}

async fn raw(coll: &Collection<Document>, id: impl Into<Bson>) -> RawDocumentBuf {
    coll.clone_with_type::<RawDocumentBuf>()
        .find_one(doc! { "_id": id.into() })
        .await
        .unwrap()
        .expect("document exists")
}

/// The race the classic nightly cleanup loses, made deterministic: a
/// report, then a writer's step 2, then the unconditioned `$set`/`$unset`.
/// tally's fold, run at the same moment, counts everything once.
#[tokio::test]
async fn the_naive_fold_loses_an_increment_that_tallys_fold_keeps() {
    let ctx = TestContext::new("fold_race").await;
    let client = ctx.client(false).await;
    let store = client.store();
    for name in ["naive", "tally"] {
        // A crashed writer's token, and a live writer between its steps.
        client
            .collection(name)
            .insert_one(doc! { "_id": "k", "counter": 10i64, "pending": [stale()] })
            .await
            .unwrap();
    }
    let live = Token::new();

    // The naive cleanup: report (counter + stale entries), step 1 and 2 of a
    // live writer, then set the counter from the report and drop `pending`.
    let naive = client.collection("naive");
    naive
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": live.object_id() } },
        )
        .await
        .unwrap();
    let report = naive.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    let stale_count = report
        .get_array("pending")
        .unwrap()
        .iter()
        .filter(|e| e.as_object_id().is_some_and(|t| t != live.object_id()))
        .count() as i64;
    let planned = report.get_i64("counter").unwrap() + stale_count;
    naive
        .update_one(
            doc! { "_id": "k", "pending": live.object_id() },
            doc! { "$pull": { "pending": live.object_id() }, "$inc": { "counter": 1 } },
        )
        .await
        .unwrap();
    naive
        .update_one(
            doc! { "_id": "k" },
            doc! { "$set": { "counter": planned }, "$unset": { "pending": "" } },
        )
        .await
        .unwrap();
    assert_eq!(
        counter(&naive, "k").await,
        11,
        "the naive fold overwrote the live increment"
    );

    // tally: the same interleaving — step 1, report, step 2, fold.
    let spec = CollectionConfig::new("tally");
    let views = Counters::new(&store, spec.clone(), WriterConfig::default());
    let coll = client.collection("tally");
    coll.update_one(
        doc! { "_id": "k" },
        doc! { "$addToSet": { "pending": live.object_id() } },
    )
    .await
    .unwrap();
    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap();
    let survey = reconciler
        .survey(&target(spec.clone()), now - GRACE)
        .await
        .unwrap();
    assert_eq!((survey.stale_tokens, survey.pending_tokens), (1, 2));
    let pending = views
        .find_pending("k", live)
        .await
        .unwrap()
        .expect("live token pending");
    assert!(matches!(
        views.complete(pending).await,
        tally::Completion::Counted(_)
    ));
    let folded = reconciler
        .fold_documents(&target(spec), vec!["k".into()], now)
        .await
        .unwrap();
    assert_eq!(folded, 1);
    assert_eq!(
        counter(&coll, "k").await,
        12,
        "both increments counted once"
    );
    assert_eq!(pending_len(&coll, "k").await, 0);
    assert!(
        coll.find_one(doc! { "_id": "k" })
            .await
            .unwrap()
            .unwrap()
            .get("pending")
            .is_none()
    );
}

/// 16 writers, some abandoning increments after step 1, while two
/// reconcilers fold every 100 ms: every increment counted exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_writers_and_two_reconcilers_count_everything_once() {
    let ctx = TestContext::new("fold_live").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let grace = Duration::from_secs(3);
    let spec = CollectionConfig::new("views");
    let fold_target = FoldTarget {
        spec: spec.clone(),
        grace,
        batch_size: 50,
    };
    let writer = WriterConfig {
        retry_horizon: Duration::from_secs(2),
    };
    let counters = Counters::new(&store, spec, writer);
    let coll = client.collection("views");

    let writing = Arc::new(AtomicBool::new(true));
    let reconcilers: Vec<_> = (0..2)
        .map(|_| {
            let (store, fold_target, writing) =
                (store.clone(), fold_target.clone(), writing.clone());
            let coll = coll.clone();
            tokio::spawn(async move {
                let reconciler = Reconciler::new(&store);
                let stop = CancellationToken::new();
                let deadline = std::time::Instant::now() + Duration::from_secs(90);
                let mut runs = 0;
                loop {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "pending tokens never drained"
                    );
                    let now = reconciler.server_time().await.unwrap();
                    let run = reconciler
                        .reconcile(&fold_target, Mode::Fold, now, &stop, &mut |_| {})
                        .await;
                    assert!(run.error.is_none(), "{:?}", run.error);
                    runs += 1;
                    let left = coll
                        .count_documents(doc! { "pending": { "$exists": true } })
                        .await
                        .unwrap();
                    if !writing.load(Ordering::Relaxed) && left == 0 {
                        return runs;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        })
        .collect();

    let expected: Arc<HashMap<String, AtomicI64>> = Arc::new(
        (0..8)
            .map(|k| (format!("k{k}"), AtomicI64::new(0)))
            .collect(),
    );
    let writers = (0..16u64).map(|w| {
        let (counters, coll, expected) = (counters.clone(), coll.clone(), expected.clone());
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(w);
            for i in 0..60u64 {
                let key = format!("k{}", (w + i) % 8);
                let amount = if rng.bool() { 1 } else { rng.i64(2..5) };
                if rng.u8(0..10) == 0 {
                    // A writer crashing after step 1, having added the
                    // entry an increment adds (a bare token for +1).
                    let token = Token::new().object_id();
                    let entry = match amount {
                        1 => Bson::ObjectId(token),
                        _ => Bson::Document(doc! { "t": token, "n": amount }),
                    };
                    coll.update_one(
                        doc! { "_id": &key },
                        doc! { "$addToSet": { "pending": entry } },
                    )
                    .upsert(true)
                    .await
                    .unwrap();
                } else {
                    match counters.increment(key.as_str(), amount).await {
                        Increment::Counted(_) | Increment::Pending(_) => {}
                        Increment::Unknown(unknown) => {
                            let resumed = counters.resume(unknown).await.expect("resume");
                            assert!(!matches!(resumed, Increment::NotCounted(_)), "{resumed:?}");
                        }
                        Increment::NotCounted(not) => panic!("not counted: {:?}", not.cause()),
                    }
                }
                expected[&key].fetch_add(amount, Ordering::Relaxed);
            }
        })
    });
    for w in join_all(writers).await {
        w.expect("writer");
    }
    writing.store(false, Ordering::Relaxed);
    let runs: Vec<u32> = join_all(reconcilers)
        .await
        .into_iter()
        .map(|r| r.expect("reconciler"))
        .collect();
    assert!(
        runs.iter().all(|r| *r > 3),
        "reconcilers ran concurrently: {runs:?}"
    );
    for (key, amount) in expected.iter() {
        assert_eq!(
            counter(&coll, key.as_str()).await,
            amount.load(Ordering::Relaxed),
            "{key}"
        );
        assert_eq!(pending_len(&coll, key.as_str()).await, 0, "{key}");
    }
}

/// A writer's step 1 lands between the report and the fold's swap: the
/// swap sees the document changed and leaves it, and the pipeline folds it
/// as it is then — the stale token counted, the new one kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_changed_after_the_report_is_folded_as_it_is_then() {
    let ctx = TestContext::new("fold_changed_after_report").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    coll.insert_one(doc! { "_id": "k", "counter": 1i64, "pending": [stale()] })
        .await
        .unwrap();
    // Hold the fold's first write on the server for a moment.
    let _fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 700 },
    )
    .await;
    let store = client.store();
    let events = client.events.clone();
    let run = tokio::spawn(async move {
        reconcile(&store, &target(CollectionConfig::new("views")), Mode::Fold).await
    });
    wait_until(
        "the fold's swap reaches the server",
        Duration::from_secs(10),
        || {
            let events = events.clone();
            async move { events.count("update") > 0 }
        },
    )
    .await;
    // Another client (not held): a writer's step 1.
    let writer = mongodb::Client::with_uri_str(&ctx.uri).await.unwrap();
    let live = fresh();
    writer
        .database(&ctx.db_name)
        .collection::<Document>("views")
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": live } },
        )
        .await
        .unwrap();
    let run = run.await.unwrap();
    assert_eq!(run.documents_folded, 1);
    assert_eq!(
        client.events.count("update"),
        2,
        "the swap, then the pipeline"
    );
    let folded = coll.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    assert_eq!(folded.get_i64("counter").unwrap(), 2);
    assert_eq!(
        folded.get_array("pending").unwrap(),
        &vec![Bson::ObjectId(live)]
    );
}

#[tokio::test]
async fn a_second_run_folds_nothing_and_a_lost_connection_is_retried_exactly() {
    let ctx = TestContext::new("fold_twice").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let docs: Vec<Document> = (0..30)
        .map(|i| doc! { "_id": i, "counter": 1i64, "pending": [stale(), { "t": stale(), "n": 3i64 }] })
        .collect();
    coll.insert_many(docs).await.unwrap();
    let target = FoldTarget {
        batch_size: 7,
        ..target(CollectionConfig::new("views"))
    };
    {
        // The first fold update's connection drops: retried once.
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["update"], "closeConnection": true },
        )
        .await;
        let run = reconcile(&client.store(), &target, Mode::Fold).await;
        assert_eq!(
            (run.documents_folded, run.tokens_folded, run.amount_folded),
            (30, 60, 120)
        );
    }
    client.events.clear();
    let again = reconcile(&client.store(), &target, Mode::Fold).await;
    assert_eq!(
        (again.documents_folded, again.survey.documents_scanned),
        (0, 0)
    );
    assert_eq!(
        client.events.count("update"),
        0,
        "nothing stale: nothing written"
    );
    for i in 0..30 {
        assert_eq!(counter(&coll, i).await, 5);
    }
}

#[tokio::test]
async fn fresh_tokens_stay_and_a_dry_run_reports_what_the_fold_does() {
    let ctx = TestContext::new("fold_dry_run").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let young = fresh();
    coll.insert_many(vec![
        doc! { "_id": "mixed", "counter": 5i64, "pending": [stale(), young, { "t": stale(), "n": -2i64 }] },
        doc! { "_id": "young", "counter": 1i64, "pending": [fresh()] },
        doc! { "_id": "old", "pending": [{ "t": stale(), "n": 7i64 }] },
        doc! { "_id": "plain", "counter": 9i64 },
    ])
    .await
    .unwrap();
    let target = target(CollectionConfig::new("views"));
    let before = raw(&coll, "young").await;
    client.events.clear();
    let dry = reconcile(&client.store(), &target, Mode::DryRun).await;
    assert_eq!(client.events.count("update"), 0, "a dry run writes nothing");
    assert_eq!(counter(&coll, "mixed").await, 5);
    client.events.clear();
    let real = reconcile(&client.store(), &target, Mode::Fold).await;
    assert_eq!(
        client.events.count("update"),
        1,
        "nobody wrote in between: one batch of swaps, no pipeline fallback"
    );
    assert_eq!(real.concurrent_changes, 0);
    assert_eq!(
        (
            dry.documents_folded,
            dry.tokens_folded,
            dry.amount_folded,
            dry.survey.clone()
        ),
        (
            real.documents_folded,
            real.tokens_folded,
            real.amount_folded,
            real.survey.clone()
        ),
    );
    assert_eq!(
        (
            real.documents_folded,
            real.tokens_folded,
            real.amount_folded
        ),
        (2, 3, 6)
    );
    assert_eq!(real.survey.documents_scanned, 3);
    assert!(real.oldest_stale_age_seconds.unwrap() >= 3600);
    let mixed = coll
        .find_one(doc! { "_id": "mixed" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(mixed.get_i64("counter").unwrap(), 4);
    assert_eq!(
        mixed.get_array("pending").unwrap(),
        &vec![Bson::ObjectId(young)]
    );
    assert_eq!(
        raw(&coll, "young").await,
        before,
        "a document with nothing stale is not written"
    );
    // A missing counter counts from 0.
    assert_eq!(counter(&coll, "old").await, 7);
}

#[tokio::test]
async fn custom_fields_both_forms_and_integer_types() {
    let ctx = TestContext::new("fold_fields_types").await;
    let client = ctx.client(false).await;
    let coll = client.collection("hits");
    coll.insert_many(vec![
        doc! { "_id": 1, "total": 7i32, "inflight": [stale(), { "t": stale(), "n": 2i32 }] },
        doc! { "_id": 2, "total": (i32::MAX - 1), "inflight": [stale(), stale()] },
        doc! { "_id": 3, "total": 40.0, "inflight": [stale()] },
        doc! { "_id": 4, "total": 1i64, "inflight": [] },
    ])
    .await
    .unwrap();
    let spec = CollectionConfig::new("hits").with_fields("total", "inflight");
    let run = reconcile(&client.store(), &target(spec), Mode::Fold).await;
    assert_eq!(run.documents_folded, 3);
    let get = |id: i32| {
        let coll = coll.clone();
        async move { coll.find_one(doc! { "_id": id }).await.unwrap().unwrap() }
    };
    assert_eq!(
        get(1).await.get("total"),
        Some(&Bson::Int32(10)),
        "int32 stays int32"
    );
    assert_eq!(
        get(2).await.get("total"),
        Some(&Bson::Int64(i64::from(i32::MAX) + 1)),
        "widened, never a double"
    );
    assert_eq!(get(3).await.get("total"), Some(&Bson::Double(41.0)));
    for id in 1..=3 {
        assert!(
            get(id).await.get("inflight").is_none(),
            "an emptied array is removed"
        );
    }
    assert_eq!(
        get(4).await.get_array("inflight").unwrap().len(),
        0,
        "nothing stale: untouched"
    );
}

#[tokio::test]
async fn every_malformed_kind_is_left_byte_for_byte_and_listed() {
    let ctx = TestContext::new("fold_malformed").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let s = stale();
    let malformed = vec![
        doc! { "_id": "pending-string", "counter": 1i64, "pending": "oops" },
        doc! { "_id": "pending-number", "counter": 1i64, "pending": 5 },
        doc! { "_id": "pending-object", "counter": 1i64, "pending": { "t": s, "n": 1 } },
        doc! { "_id": "entry-string", "counter": 1i64, "pending": [stale(), "x"] },
        doc! { "_id": "entry-number", "counter": 1i64, "pending": [stale(), 42] },
        doc! { "_id": "entry-null", "counter": 1i64, "pending": [stale(), null] },
        doc! { "_id": "n-double", "counter": 1i64, "pending": [{ "t": stale(), "n": 1.5 }] },
        doc! { "_id": "n-string", "counter": 1i64, "pending": [{ "t": stale(), "n": "2" }] },
        doc! { "_id": "n-zero", "counter": 1i64, "pending": [{ "t": stale(), "n": 0 }] },
        doc! { "_id": "t-missing", "counter": 1i64, "pending": [{ "n": 1 }] },
        doc! { "_id": "extra-field", "counter": 1i64, "pending": [{ "t": stale(), "n": 1, "x": 1 }] },
        doc! { "_id": "counter-string", "counter": "12", "pending": [stale()] },
        doc! { "_id": "counter-bool", "counter": true, "pending": [stale()] },
        doc! { "_id": "counter-fraction", "counter": 2.5, "pending": [stale()] },
        doc! { "_id": "counter-overflow", "counter": i64::MAX, "pending": [stale()] },
        doc! { "_id": "sum-overflow", "counter": 0i64, "pending": [{ "t": stale(), "n": i64::MAX }, { "t": stale(), "n": 1i64 }] },
    ];
    coll.insert_many(malformed.clone()).await.unwrap();
    coll.insert_one(doc! { "_id": "fine", "counter": 1i64, "pending": [stale()] })
        .await
        .unwrap();
    let mut before = HashMap::new();
    for d in &malformed {
        let id = d.get_str("_id").unwrap().to_owned();
        before.insert(id.clone(), raw(&coll, id.as_str()).await);
    }
    let target = FoldTarget {
        batch_size: 3,
        ..target(CollectionConfig::new("views"))
    };
    let run = reconcile(&client.store(), &target, Mode::Fold).await;
    assert_eq!(run.survey.malformed, malformed.len() as u64);
    assert_eq!(
        run.survey.malformed_sample.len(),
        tally::reconcile::MALFORMED_SAMPLE
    );
    assert_eq!(run.documents_folded, 1, "only the well-formed document");
    for (id, bytes) in &before {
        assert_eq!(&raw(&coll, id.as_str()).await, bytes, "{id} was modified");
    }
    assert_eq!(counter(&coll, "fine").await, 2);
    // Folding them directly — as if they broke between the report and the
    // fold — changes nothing either: the pipeline judges each document itself.
    let store = client.store();
    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap();
    let ids: Vec<Bson> = before.keys().map(|id| Bson::String(id.clone())).collect();
    assert_eq!(
        reconciler.fold_documents(&target, ids, now).await.unwrap(),
        0
    );
    for (id, bytes) in &before {
        assert_eq!(
            &raw(&coll, id.as_str()).await,
            bytes,
            "{id} was modified by a direct fold"
        );
    }
    // Every kind is named in the sample or counted; the sample names ids.
    let sampled: Vec<&str> = run
        .survey
        .malformed_sample
        .iter()
        .map(|m| m.id.as_str())
        .collect();
    assert!(
        sampled
            .iter()
            .all(|id| before.contains_key(id.trim_matches('"'))),
        "{sampled:?}"
    );
}

/// Random documents of every shape, folded by the server: each ends exactly
/// as the model says — folded, or byte-for-byte untouched.
#[tokio::test]
async fn the_server_pipeline_does_what_the_model_says() {
    let ctx = TestContext::new("fold_vs_model").await;
    let client = ctx.client(false).await;
    let coll = client.collection("random");
    let mut rng = fastrand::Rng::with_seed(20261122);
    let mut docs: Vec<Document> = (0..300).map(|i| random_document(&mut rng, i)).collect();
    // Edge cases: a double counter whose exact result is just past 2^53
    // (its double sum rounds back into range), or lands on it; a sum that
    // overflows midway and comes back.
    let edge = 2f64.powi(53) - 1.0;
    docs.extend([
        doc! { "_id": 1000, "counter": edge, "pending": [{ "t": stale(), "n": 2i64 }] },
        doc! { "_id": 1001, "counter": edge, "pending": [{ "t": stale(), "n": 1i64 }] },
        doc! { "_id": 1002, "counter": 0i64, "pending": [
            { "t": stale(), "n": i64::MAX }, { "t": stale(), "n": 1i64 }, { "t": stale(), "n": -1i64 },
        ] },
        doc! { "_id": 1003, "counter": 0i64, "pending": [
            { "t": stale(), "n": i64::MAX }, { "t": stale(), "n": -1i64 }, { "t": stale(), "n": 1i64 },
        ] },
    ]);
    coll.insert_many(docs.clone()).await.unwrap();
    let store = client.store();
    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap();
    let cutoff = Token::cutoff(now - GRACE);
    let target = FoldTarget {
        batch_size: 17,
        ..target(CollectionConfig::new("random"))
    };
    let run = reconciler
        .reconcile(
            &target,
            Mode::Fold,
            now,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await;
    assert!(run.error.is_none(), "{:?}", run.error);
    let (mut folded, mut tokens, mut amount, mut malformed) = (0u64, 0u64, 0i64, 0u64);
    let after: HashMap<i32, Document> = coll
        .find(doc! {})
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.get_i32("_id").unwrap(), d))
        .collect();
    for original in &docs {
        let id = original.get_i32("_id").unwrap();
        let now_doc = &after[&id];
        match model::plan(original.get("counter"), original.get("pending"), cutoff) {
            Ok(plan) if plan.stale_tokens > 0 => {
                folded += 1;
                tokens += plan.stale_tokens;
                amount = amount.saturating_add(plan.stale_amount);
                assert_eq!(
                    now_doc.get("counter"),
                    Some(&plan.counter),
                    "counter of {original}"
                );
                match now_doc.get("pending") {
                    None => assert!(plan.keep.is_empty(), "{original}"),
                    Some(Bson::Array(kept)) => assert_eq!(kept, &plan.keep, "{original}"),
                    Some(other) => panic!("pending became {other}"),
                }
            }
            Ok(_) => assert_eq!(now_doc, original, "nothing stale, must be untouched"),
            Err(_) => {
                malformed += u64::from(original.contains_key("pending"));
                assert_eq!(now_doc, original, "malformed, must be untouched");
            }
        }
    }
    assert_eq!(run.documents_folded, folded);
    assert_eq!((run.tokens_folded, run.amount_folded), (tokens, amount));
    assert_eq!(run.survey.malformed, malformed);
    assert!(
        folded > 50 && malformed > 20,
        "the sample covers both: {folded} {malformed}"
    );

    // The same documents folded directly, without the report to pick them:
    // the pipeline alone must leave every malformed one untouched.
    let direct = client.collection("random_direct");
    direct.insert_many(docs.clone()).await.unwrap();
    let direct_target = FoldTarget {
        spec: CollectionConfig::new("random_direct"),
        ..target
    };
    for chunk in docs.chunks(40) {
        let ids = chunk
            .iter()
            .map(|d| d.get("_id").unwrap().clone())
            .collect();
        reconciler
            .fold_documents(&direct_target, ids, now)
            .await
            .unwrap();
    }
    for original in &docs {
        let id = original.get_i32("_id").unwrap();
        let now_doc = direct.find_one(doc! { "_id": id }).await.unwrap().unwrap();
        match model::plan(original.get("counter"), original.get("pending"), cutoff) {
            Ok(plan) if plan.stale_tokens > 0 => {
                assert_eq!(
                    now_doc.get("counter"),
                    Some(&plan.counter),
                    "direct: {original}"
                );
            }
            _ => assert_eq!(&now_doc, original, "direct fold touched {original}"),
        }
    }
}

fn random_document(rng: &mut fastrand::Rng, id: i32) -> Document {
    let mut d = doc! { "_id": id };
    match rng.u8(0..10) {
        0 => {}
        1 => {
            d.insert("counter", Bson::Int32(rng.i32(-1000..1000)));
        }
        2 => {
            d.insert("counter", Bson::Int32(i32::MAX - rng.i32(0..3)));
        }
        3 => {
            d.insert("counter", Bson::Int64(i64::MAX - rng.i64(0..3)));
        }
        4 => {
            d.insert("counter", Bson::Double(f64::from(rng.i32(-100..100))));
        }
        5 => {
            d.insert("counter", Bson::String("7".into()));
        }
        _ => {
            d.insert("counter", Bson::Int64(rng.i64(-1_000_000..1_000_000)));
        }
    }
    let token = |rng: &mut fastrand::Rng| if rng.bool() { stale() } else { fresh() };
    let pending = match rng.u8(0..12) {
        0 => None,
        1 => Some(Bson::String("x".into())),
        2 => Some(Bson::Array(Vec::new())),
        _ => Some(Bson::Array(
            (0..rng.usize(1..5))
                .map(|_| match rng.u8(0..20) {
                    0 => Bson::Null,
                    1 => Bson::Int32(3),
                    2 => Bson::Document(doc! { "t": token(rng), "n": 1.5 }),
                    3..=9 => Bson::ObjectId(token(rng)),
                    10..=14 => Bson::Document(doc! { "t": token(rng), "n": rng.i64(1..100) }),
                    _ => Bson::Document(doc! { "n": rng.i32(-5..-1), "t": token(rng) }),
                })
                .collect(),
        )),
    };
    if let Some(p) = pending {
        d.insert("pending", p);
    }
    d
}

#[tokio::test]
async fn the_reconcile_command_prints_json_and_fails_only_the_broken_collection() {
    let ctx = TestContext::new("cli_reconcile").await;
    let client = ctx.client(false).await;
    for name in ["a", "b"] {
        client
            .collection(name)
            .insert_one(doc! { "_id": 1, "counter": 1i64, "pending": [stale(), "broken"] })
            .await
            .unwrap();
        client
            .collection(name)
            .insert_one(doc! { "_id": 2, "counter": 1i64, "pending": [stale(), stale()] })
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = crate::cli::write_config(
        dir.path(),
        &ctx.config_toml(
            false,
            "[[collections]]\nname = \"a\"\n[[collections]]\nname = \"b\"",
        ),
    );
    let dry = crate::cli::tallyd(
        &["--config", &path, "reconcile", "--dry-run", "--json"],
        &[],
    )
    .await;
    assert_eq!(dry.status.code(), Some(0), "{dry:?}");
    let out: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(out["dry_run"], true);
    let a = &out["collections"][0];
    assert_eq!(a["collection"], "a");
    for (field, value) in [
        ("documents_scanned", 2),
        ("documents_folded", 1),
        ("tokens_folded", 2),
        ("amount_folded", 2),
        ("malformed", 1),
    ] {
        assert_eq!(a[field], value, "{field}: {a}");
    }
    assert!(a["duration_seconds"].is_number());
    assert_eq!(a["malformed_sample"][0]["id"], "1");
    assert_eq!(
        counter(&client.collection("a"), 2).await,
        1,
        "dry run changed nothing"
    );

    // The second collection's report fails: the first is still reconciled.
    let _fail = FailPoint::set(
        &ctx,
        Bson::Document(doc! { "skip": 1, "times": 1 }),
        doc! { "failCommands": ["aggregate"], "errorCode": 2 },
    )
    .await;
    let output = crate::cli::tallyd(&["--config", &path, "reconcile"], &[]).await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("FAILED"), "{table}");
    assert!(table.contains("_id 1: a pending entry"), "{table}");
    assert_eq!(counter(&client.collection("a"), 2).await, 3);
    assert_eq!(counter(&client.collection("b"), 2).await, 1);
}
