//! The fold against a real server: exact on live documents, idempotent,
//! concurrent-safe, one count per token, never touching a malformed
//! document, and isolating the documents the server refuses.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc, oid::ObjectId};
use tally::{
    CollectionConfig, Counters, FoldTarget, Increment, Mode, Reconciler, Store, Token, WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::common::{
    FailPoint, TestClient, TestContext, counter, field, pending_len, run_reconcile, wait_until,
};

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

/// One fold of the collection `views` with the default fields.
async fn fold_views(client: &TestClient) -> tally::CollectionRun {
    reconcile(
        &client.store(),
        &target(CollectionConfig::new("views")),
        Mode::Fold,
    )
    .await
}

/// One fold of the collection `views` with the default fields, at the
/// server time `now`.
async fn fold_views_at(store: &Store, now: SystemTime) -> tally::CollectionRun {
    Reconciler::new(store)
        .reconcile(
            &target(CollectionConfig::new("views")),
            Mode::Fold,
            now,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await
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
        ..WriterConfig::default()
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

/// The fold's first update, held on the server for a moment while another
/// client writes to the document; returns the run.
async fn fold_while(
    ctx: &TestContext,
    client: &TestClient,
    target: FoldTarget,
    write: Document,
) -> tally::CollectionRun {
    // Hold the fold's first write on the server for a moment.
    let _fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 700 },
    )
    .await;
    let store = client.store();
    let events = client.events.clone();
    let run = tokio::spawn(async move { reconcile(&store, &target, Mode::Fold).await });
    wait_until(
        "the fold's update reaches the server",
        Duration::from_secs(10),
        || {
            let events = events.clone();
            async move { events.count("update") > 0 }
        },
    )
    .await;
    // Another client (not held): a writer.
    let writer = mongodb::Client::with_uri_str(&ctx.uri).await.unwrap();
    writer
        .database(&ctx.db_name)
        .collection::<Document>("views")
        .update_one(doc! { "_id": "k" }, write)
        .await
        .unwrap();
    run.await.unwrap()
}

/// A writer's step 1 lands between the report and the fold's update: the
/// update, conditioned only on the stale entries, applies and keeps the
/// new entry — no second round trip, no starving a busy document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_1_landing_after_the_report_is_kept_by_the_fold() {
    let ctx = TestContext::new("fold_step1_after_report").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    coll.insert_one(doc! { "_id": "k", "counter": 1i64, "pending": [stale()] })
        .await
        .unwrap();
    let live = fresh();
    let target = target(CollectionConfig::new("views"));
    let step1 = doc! { "$addToSet": { "pending": live } };
    let run = fold_while(&ctx, &client, target, step1).await;
    assert_eq!((run.documents_folded, run.concurrent_changes), (1, 0));
    assert_eq!(client.events.count("update"), 1, "one update, applied");
    assert_folded_to(&coll, "k", 2, &[Bson::ObjectId(live)]).await;
}

/// Asserts that document `id` holds the int64 counter `counter` and the
/// pending entries `pending`.
async fn assert_folded_to(
    coll: &Collection<Document>,
    id: impl Into<Bson>,
    counter: i64,
    pending: &[Bson],
) {
    let id = id.into();
    let folded = coll.find_one(doc! { "_id": &id }).await.unwrap().unwrap();
    assert_eq!(folded.get_i64("counter").unwrap(), counter, "{id}");
    assert_eq!(folded.get_array("pending").unwrap(), pending, "{id}");
}

/// A step 2 takes one of the stale tokens between the report and the
/// fold's update: the update matches nothing, the fold reads the document
/// again and folds what is left — each token counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_2_taking_a_stale_token_after_the_report_is_read_again_and_folded_exactly() {
    let ctx = TestContext::new("fold_step2_after_report").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let (taken, left) = (stale(), stale());
    coll.insert_one(
        doc! { "_id": "k", "counter": 1i64, "pending": [taken, { "t": left, "n": 5i64 }] },
    )
    .await
    .unwrap();
    let target = target(CollectionConfig::new("views"));
    let step2 = doc! { "$pull": { "pending": taken }, "$inc": { "counter": 1 } };
    client.events.clear();
    let run = fold_while(&ctx, &client, target, step2).await;
    assert!(run.error.is_none(), "{:?}", run.error);
    assert_eq!(
        client.events.count("update"),
        2,
        "sent, refused, sent again"
    );
    assert_eq!(client.events.count("find"), 1, "the document read again");
    assert_eq!(run.documents_folded, 1);
    assert_eq!(
        counter(&coll, "k").await,
        7,
        "1 + the step 2's 1 + the fold's 5"
    );
    assert_eq!(pending_len(&coll, "k").await, 0);
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
        let _fail = FailPoint::updates_cut(&ctx, 1).await;
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
        "nobody wrote in between: one batch, applied at once"
    );
    assert_eq!(client.events.count("find"), 0, "nothing read again");
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
    assert_eq!(run.documents_folded, 4);
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
    for id in 1..=4 {
        assert!(
            get(id).await.get("inflight").is_none(),
            "an emptied (or empty) array is removed"
        );
    }
    assert_eq!(get(4).await.get("total"), Some(&Bson::Int64(1)));
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
        doc! { "_id": "counter-2^53", "counter": 2f64.powi(53), "pending": [stale()] },
        doc! { "_id": "double-reaches-2^53", "counter": 2f64.powi(53) - 1.0, "pending": [stale()] },
        doc! { "_id": "amounts-disagree", "counter": 0i64, "pending": [{ "t": s, "n": 5 }, { "t": s, "n": 3 }] },
        doc! { "_id": "settled-string", "counter": 1i64, "pending": [stale()], "settled": "x" },
        doc! { "_id": "marker-bare", "counter": 1i64, "settled": [stale()] },
        doc! { "_id": "marker-n-double", "counter": 1i64, "settled": [{ "t": stale(), "n": 1.0 }] },
        doc! { "_id": "marker-extra-field", "counter": 1i64, "pending": [stale()], "settled": [{ "t": stale(), "n": 1, "at": 1 }] },
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
    assert_eq!(run.survey.malformed_sample.len(), tally::MALFORMED_SAMPLE);
    assert_eq!(run.documents_folded, 1, "only the well-formed document");
    for (id, bytes) in &before {
        assert_eq!(&raw(&coll, id.as_str()).await, bytes, "{id} was modified");
    }
    assert_eq!(counter(&coll, "fine").await, 2);
    // Folding them directly — as the daemon's repair does — changes nothing
    // either: each document is read and judged again.
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
        sampled.iter().all(|id| before.contains_key(*id)),
        "{sampled:?}"
    );
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
    // A third collection whose validator refuses one document's fold.
    client
        .client
        .database(&ctx.db_name)
        .create_collection("c")
        .validator(doc! { "counter": { "$lte": 10 } })
        .await
        .unwrap();
    client
        .collection("c")
        .insert_many(vec![
            doc! { "_id": 3, "counter": 10i64, "pending": [stale()] },
            doc! { "_id": 4, "counter": 1i64, "pending": [stale()] },
        ])
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = crate::cli::write_config(
        dir.path(),
        &ctx.config_toml(
            false,
            "[[collections]]\nname = \"a\"\n[[collections]]\nname = \"b\"\n[[collections]]\nname = \"c\"",
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
    assert!(table.contains("ok (1 refused by the server)"), "{table}");
    assert!(
        table.contains(
            "c: 1 document(s) refused by the server, left unchanged:\n  _id 3: error 121"
        ),
        "{table}"
    );
    assert_eq!(counter(&client.collection("a"), 2).await, 3);
    assert_eq!(counter(&client.collection("b"), 2).await, 1);
    assert_eq!(counter(&client.collection("c"), 3).await, 10);
    assert_eq!(counter(&client.collection("c"), 4).await, 2);
}

/// One token, one count (issue 11, item 6): the entries of one stale token
/// are counted once, whatever their forms, as step 2 counts them; entries
/// that disagree on the amount make the document malformed.
#[tokio::test]
async fn repeated_entries_of_a_token_are_counted_once() {
    let ctx = TestContext::new("fold_one_token_one_count").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = || stale();
    let (a, b, c, d) = (t(), t(), t(), t());
    coll.insert_many(vec![
        doc! { "_id": "bare-twice", "counter": 10i64, "pending": [a, a] },
        doc! { "_id": "both-forms", "counter": 10i64, "pending": [b, { "t": b, "n": 1 }] },
        doc! { "_id": "field-order", "counter": 10i64, "pending": [{ "t": c, "n": 5 }, { "n": 5i64, "t": c }] },
        doc! { "_id": "amounts-disagree", "counter": 10i64, "pending": [{ "t": d, "n": 5 }, { "t": d, "n": 3 }] },
    ])
    .await
    .unwrap();
    let disagreeing = raw(&coll, "amounts-disagree").await;
    let run = fold_views(&client).await;
    for (id, expected) in [("bare-twice", 11), ("both-forms", 11), ("field-order", 15)] {
        assert_eq!(counter(&coll, id).await, expected, "{id}");
        assert_eq!(pending_len(&coll, id).await, 0, "{id}: every copy removed");
    }
    assert_eq!(
        raw(&coll, "amounts-disagree").await,
        disagreeing,
        "left byte for byte"
    );
    assert_eq!(run.survey.malformed, 1);
    assert_eq!(run.survey.malformed_sample[0].id, "amounts-disagree");
    assert_eq!(
        (
            run.tokens_folded,
            run.amount_folded,
            run.survey.duplicate_entries
        ),
        (3, 7, 3)
    );
}

/// A token a settle counted has a marker: a copy of it re-added later (a
/// delayed step 1) is dropped uncounted, and markers older than the grace
/// are pruned — the field with them when none is left; young markers stay.
#[tokio::test]
async fn a_stale_token_a_settle_counted_is_dropped_and_old_markers_pruned() {
    let ctx = TestContext::new("fold_settled").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let (settled, counted, young) = (stale(), stale(), fresh());
    coll.insert_many(vec![
        doc! {
            "_id": "re-added",
            "counter": 10i64,
            "pending": [settled, counted],
            "settled": [{ "t": settled, "n": 1i64 }, { "t": young, "n": 4i64 }],
        },
        doc! { "_id": "markers-only", "counter": 3i64, "settled": [{ "t": stale(), "n": 2i64 }] },
    ])
    .await
    .unwrap();
    let run = fold_views(&client).await;
    let re_added = coll
        .find_one(doc! { "_id": "re-added" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(re_added.get_i64("counter").unwrap(), 11, "only `counted`");
    assert!(re_added.get("pending").is_none());
    assert_eq!(
        re_added.get_array("settled").unwrap(),
        &vec![Bson::Document(doc! { "t": young, "n": 4i64 })]
    );
    let markers_only = coll
        .find_one(doc! { "_id": "markers-only" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        markers_only,
        doc! { "_id": "markers-only", "counter": 3i64 },
        "the counter untouched, the emptied field removed"
    );
    assert_eq!(
        (
            run.documents_folded,
            run.tokens_folded,
            run.survey.settled_copies,
            run.survey.stale_markers
        ),
        (2, 1, 1, 2)
    );
    let again = fold_views(&client).await;
    assert_eq!(
        (again.survey.documents_scanned, again.documents_folded),
        (1, 0),
        "only the young marker is left"
    );
}

/// The report reads only documents holding tokens (issue 11, item 20):
/// after 1,000 counters were incremented (step 2 leaves no empty array), a
/// report reads none of them; a `pending: []` another client left is read
/// and removed once, and then not read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_report_reads_no_document_without_tokens() {
    let ctx = TestContext::new("fold_reads_only_tokens").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let coll = client.collection("views");
    let counters = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    let writers = (0..8).map(|w| {
        let counters = counters.clone();
        tokio::spawn(async move {
            for i in (w..1000).step_by(8) {
                let outcome = counters.increment(format!("k{i}").as_str(), 1).await;
                assert!(matches!(outcome, Increment::Counted(_)), "{outcome:?}");
            }
        })
    });
    for w in join_all(writers).await {
        w.expect("writer");
    }
    let target = target(CollectionConfig::new("views"));
    let after_increments = reconcile(&store, &target, Mode::Fold).await;
    assert_eq!(
        (
            after_increments.survey.documents_scanned,
            after_increments.documents_folded
        ),
        (0, 0)
    );
    // Another client of the technique leaves its array empty.
    coll.insert_one(doc! { "_id": "other", "counter": 4i64, "pending": [] })
        .await
        .unwrap();
    let cleanup = reconcile(&store, &target, Mode::Fold).await;
    assert_eq!(
        (
            cleanup.survey.documents_scanned,
            cleanup.documents_folded,
            cleanup.tokens_folded
        ),
        (1, 1, 0),
        "the empty array removed"
    );
    client.events.clear();
    let again = reconcile(&store, &target, Mode::Fold).await;
    assert_eq!(again.survey.documents_scanned, 0);
    assert_eq!(client.events.count("update"), 0, "nothing written");
    assert_eq!(counter(&coll, "other").await, 4);
    assert!(field(&coll, "other", "pending").await.is_none());
    for key in ["k0", "k500", "k999"] {
        assert_eq!(counter(&coll, key).await, 1, "{key}");
    }
    assert_eq!(coll.count_documents(doc! {}).await.unwrap(), 1001);
}

/// Doubles hold integers exactly below 2^53 (issue 11, item 19): a double
/// counter the fold would bring to 2^53 is malformed and left alone; one
/// below is folded.
#[tokio::test]
async fn a_double_counter_reaching_2_53_is_malformed_and_one_below_folded() {
    let ctx = TestContext::new("fold_double_edge").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let edge = 2f64.powi(53);
    coll.insert_many(vec![
        doc! { "_id": "reaches", "counter": edge - 1.0, "pending": [stale()] },
        doc! { "_id": "below", "counter": edge - 2.0, "pending": [stale()] },
    ])
    .await
    .unwrap();
    let reaches = raw(&coll, "reaches").await;
    let run = fold_views(&client).await;
    assert_eq!((run.documents_folded, run.survey.malformed), (1, 1));
    assert_eq!(raw(&coll, "reaches").await, reaches);
    let below = coll
        .find_one(doc! { "_id": "below" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(below.get("counter"), Some(&Bson::Double(edge - 1.0)));
}

/// One document the server refuses (a validator on the counter's range)
/// among many (issue 11, item 4): it is left byte for byte and listed with
/// its `_id` and code, not retried within the run; every other document,
/// in its batch and in later ones, is folded, and the run succeeds.
#[tokio::test]
async fn a_document_the_server_refuses_is_reported_and_every_other_one_folded() {
    let ctx = TestContext::new("fold_refused").await;
    let client = ctx.client(false).await;
    let db = client.client.database(&ctx.db_name);
    db.create_collection("views")
        .validator(doc! { "counter": { "$lte": 100 } })
        .await
        .unwrap();
    let coll = client.collection("views");
    let docs: Vec<Document> = (0..25)
        .map(|i| {
            let start = if i == 13 { 100i64 } else { i64::from(i) };
            doc! { "_id": i, "counter": start, "pending": [stale(), fresh()] }
        })
        .collect();
    coll.insert_many(docs).await.unwrap();
    let refused = raw(&coll, 13).await;
    let target = FoldTarget {
        batch_size: 10,
        ..target(CollectionConfig::new("views"))
    };
    client.events.clear();
    let run = reconcile(&client.store(), &target, Mode::Fold).await;
    assert_eq!(client.events.count("update"), 3, "three batches, no retry");
    assert_eq!(client.events.count("find"), 0, "nothing read again");
    assert!(run.succeeded());
    assert_eq!((run.documents_folded, run.refused), (24, 1));
    assert_eq!(run.refused_sample[0].id, "13");
    assert_eq!(run.refused_sample[0].code, 121, "DocumentValidationFailure");
    assert_eq!(raw(&coll, 13).await, refused, "left byte for byte");
    for i in (0..25).filter(|i| *i != 13) {
        assert_eq!(counter(&coll, i).await, i64::from(i) + 1, "document {i}");
        assert_eq!(pending_len(&coll, i).await, 1, "document {i}");
    }
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["refused"], 1);
    assert_eq!(json["refused_sample"][0]["code"], 121);
}

/// Large arrays (issue 11, item 4): fourteen documents holding 60,000 stale
/// entries each make a batch of ~17.5 MB — more than the 16 MiB a command may
/// carry — and fold exactly, in several commands each under the limit (as
/// the proxy saw them).
#[tokio::test]
async fn documents_with_large_pending_arrays_fold_in_commands_under_the_size_limit() {
    use crate::common::proxy::{Proxy, upstream_of};

    const DOCS: i32 = 14;
    const ENTRIES: usize = 60_000;
    const MAX_COMMAND: usize = 16 * 1024 * 1024;
    let ctx = TestContext::new("fold_large_arrays").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let young = fresh();
    for i in 0..DOCS {
        let mut pending: Vec<Bson> = (0..ENTRIES).map(|_| Bson::ObjectId(stale())).collect();
        pending.insert(ENTRIES / 2, Bson::ObjectId(young));
        coll.insert_one(doc! { "_id": i, "counter": 1i64, "pending": pending })
            .await
            .unwrap();
    }
    // Commands of up to 16 MiB keep the test server busy for many seconds
    // on a loaded machine: each attempt may take minutes, and the driver's
    // monitor must not give the server up meanwhile (3 of the 20 documents
    // were left unfolded by timed-out attempts in one suite run).
    let through_proxy = ctx
        .client_through_with(&proxy, false, "connectTimeoutMS=300000")
        .await
        .store()
        .with_attempt_timeout(Duration::from_secs(300));
    let run = reconcile(
        &through_proxy,
        &target(CollectionConfig::new("views")),
        Mode::Fold,
    )
    .await;
    assert!(run.succeeded(), "{run:?}");
    assert_eq!(run.documents_folded, DOCS as u64);
    assert_eq!(run.tokens_folded, DOCS as u64 * ENTRIES as u64);
    let sizes: Vec<usize> = proxy
        .requests("update")
        .iter()
        .map(|e| e.body.to_vec().unwrap().len())
        .collect();
    assert!(sizes.len() > 1, "split into commands: {sizes:?}");
    assert!(sizes.iter().all(|s| *s < MAX_COMMAND), "{sizes:?}");
    for i in 0..DOCS {
        assert_folded_to(&coll, i, 1 + ENTRIES as i64, &[Bson::ObjectId(young)]).await;
    }
}

/// A document whose stale entries are too many for one statement (here
/// 200,000, ~4 MB) is folded by several, in order, each conditioned on its
/// own stretch of the array — with a token repeated across the stretches
/// counted once, a settled token's copies in both dropped, and the fresh
/// entries kept in order.
#[tokio::test]
async fn a_document_too_large_for_one_statement_is_folded_in_several() {
    use crate::common::proxy::{Proxy, upstream_of};

    const ENTRIES: usize = 200_000;
    let ctx = TestContext::new("fold_split_document").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let mut pending: Vec<Bson> = (0..ENTRIES).map(|_| Bson::ObjectId(stale())).collect();
    let (repeated, settled) = (stale(), stale());
    pending[10] = Bson::Document(doc! { "t": repeated, "n": 7i64 });
    pending[ENTRIES - 10] = Bson::Document(doc! { "n": 7, "t": repeated });
    pending[5] = Bson::ObjectId(settled);
    pending[ENTRIES - 5] = Bson::ObjectId(settled);
    let young = [fresh(), fresh()];
    pending[ENTRIES / 4] = Bson::ObjectId(young[0]);
    pending[3 * ENTRIES / 4] = Bson::ObjectId(young[1]);
    let document = doc! {
        "_id": "big",
        "counter": 3i32,
        "pending": pending,
        "settled": [{ "t": settled, "n": 1i64 }],
    };
    coll.insert_one(&document).await.unwrap();
    let store = ctx.client_through(&proxy, false).await.store();
    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap();
    let run = fold_views_at(&store, now).await;
    assert!(run.succeeded(), "{:?}", run.error);
    let statements: usize = proxy
        .requests("update")
        .iter()
        .map(|e| e.body.get_array("updates").unwrap().len())
        .sum();
    assert!(statements > 1, "split: {statements} statement(s)");
    let after = coll.find_one(doc! { "_id": "big" }).await.unwrap().unwrap();
    let expected = 3 + (ENTRIES as i64 - 2 - 2 - 2) + 7;
    assert_eq!(after.get("counter"), Some(&Bson::Int32(expected as i32)));
    assert_eq!(
        after.get_array("pending").unwrap(),
        &young.map(Bson::ObjectId).to_vec()
    );
    assert!(after.get("settled").is_none());
}

/// A `writeConcernError` in the fold's reply (issue 11, item 17) is a
/// failure like any other, classified by its code and labels: a transient
/// one is retried once and the run succeeds; another one fails the run —
/// never recorded as a success. The counters are exact either way: every
/// statement is conditioned on what it removes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_concern_error_fails_the_run_unless_a_retry_clears_it() {
    use crate::common::proxy::{Action, Proxy, Rule, upstream_of};

    let ctx = TestContext::new("fold_write_concern").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let store = ctx.client_through(&proxy, false).await.store();
    let direct = ctx.client(false).await;
    let cases = [
        (
            "plain",
            Action::write_concern_error(64, "WriteConcernFailed", &[]),
            false,
        ),
        (
            "labelled",
            Action::write_concern_error(64, "WriteConcernFailed", &["RetryableWriteError"]),
            true,
        ),
        (
            "listed",
            Action::write_concern_error(91, "ShutdownInProgress", &[]),
            true,
        ),
    ];
    for (name, action, retried) in cases {
        let coll = direct.collection(name);
        coll.insert_many((0..5).map(|i| doc! { "_id": i, "counter": 1i64, "pending": [stale(), { "t": stale(), "n": 2i64 }] }))
            .await
            .unwrap();
        proxy.clear_log();
        let rule = proxy.rule(Rule::command("update").collection(name).nth(1).then(action));
        let run = run_reconcile(&store, &target(CollectionConfig::new(name)), Mode::Fold).await;
        drop(rule);
        let updates = proxy.requests("update");
        assert!(updates.iter().all(|e| e.reached_server), "{name}");
        if retried {
            assert!(run.succeeded(), "{name}: {:?}", run.error);
            assert_eq!(updates.len(), 2, "{name}: sent again once");
        } else {
            assert!(
                !run.succeeded(),
                "{name}: a write-concern error is not a success"
            );
            let err = run.error.as_ref().unwrap();
            assert_eq!(err.class(), Some(tally::ErrorClass::Command), "{name}");
            assert_eq!(updates.len(), 1, "{name}: not sent again");
        }
        // The server applied the first update: every counter is folded,
        // once, and a next run finds nothing.
        for i in 0..5 {
            assert_eq!(counter(&coll, i).await, 4, "{name}: document {i}");
        }
        let again = run_reconcile(&store, &target(CollectionConfig::new(name)), Mode::Fold).await;
        assert!(again.succeeded(), "{name}");
        assert_eq!(again.survey.documents_scanned, 0, "{name}");
    }
}

/// The server's time, as the fold reads it.
async fn server_now(client: &TestClient) -> SystemTime {
    Reconciler::new(&client.store())
        .server_time()
        .await
        .unwrap()
}

/// A writer of `views` on another connection, which this test's fail
/// points do not touch, and its store.
async fn rival_views(ctx: &TestContext) -> (Store, Counters) {
    let rival = ctx.rival_store().await;
    let writer = Counters::new(
        &rival,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    (rival, writer)
}

/// Starts a fold of `views` at `now` whose first `update` the server holds
/// for `hold` before it executes, and returns once that update was sent:
/// what a test does meanwhile happens between the fold's read and its
/// write. The fail point is switched off when the guard is dropped.
pub(crate) async fn fold_held_on_the_server(
    ctx: &TestContext,
    client: &TestClient,
    now: SystemTime,
    hold: Duration,
) -> (FailPoint, tokio::task::JoinHandle<tally::CollectionRun>) {
    let fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true,
        "blockTimeMS": hold.as_millis() as i64 },
    )
    .await;
    let store = client.store();
    let before = client.events.count("update");
    let fold = tokio::spawn(async move { fold_views_at(&store, now).await });
    let events = client.events.clone();
    wait_until(
        "the fold's update was sent",
        Duration::from_secs(30),
        || {
            let events = events.clone();
            async move { events.count("update") > before }
        },
    )
    .await;
    (fail, fold)
}

/// A fold in flight never counts again a token a settle counted, even when
/// the token's original step 1, held up in the network, re-adds it before
/// the fold's update lands: every statement also requires that none of the
/// tokens it counts has a settle marker, so it matches nothing, and the
/// re-read drops the copy uncounted. Found by the adversarial review of
/// issue 11 (finding D): the fold read T pending (no marker), `complete`
/// counted T and left its marker, the late step 1 re-added T, and the
/// fold's update — `pending: {$all: [T]}` held again — counted T twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_in_flight_never_counts_again_a_token_a_settle_counted() {
    let ctx = TestContext::new("fold_marker_race").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = stale();
    // An increment whose step 2 was never confirmed, older than the grace
    // (a writer holding a `Pending` ticket: `complete` is safe at any age).
    coll.insert_one(doc! { "_id": "k", "counter": 0i64, "pending": [t] })
        .await
        .unwrap();
    let now = server_now(&client).await;
    // Another process (not held by the fail point), connected before the
    // hold starts: everything it does below must fit in the hold.
    let (rival, writer) = rival_views(&ctx).await;
    let (fail, fold) = fold_held_on_the_server(&ctx, &client, now, Duration::from_secs(5)).await;

    // The writer settles its pending ticket...
    let pending = writer
        .find_pending("k", Token::from_object_id(t))
        .await
        .unwrap()
        .expect("pending");
    let completion = writer.complete(pending).await;
    assert!(
        matches!(completion, tally::Completion::Counted(_)),
        "{completion:?}"
    );
    // ...and the increment's original step 1, held up in the network,
    // lands now (as `settle::a_delayed_original_step_1_…` writes it).
    rival
        .collection("views")
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": t }, "$setOnInsert": { "counter": 0i64 } },
        )
        .await
        .unwrap();
    // The race this test is about needs the fold's update still held
    // here; under a loaded machine the hold could run out first.
    assert!(
        !fold.is_finished(),
        "the test's precondition: the fold's update is still held on the server"
    );
    let marked = coll.find_one(doc! { "_id": "k" }).await.unwrap().unwrap();
    assert!(
        marked.get_array("settled").is_ok_and(|m| !m.is_empty()),
        "the settle's marker is there: {marked:?}"
    );

    let run = fold.await.unwrap();
    drop(fail);
    assert!(run.error.is_none(), "{:?}", run.error);
    // A later run (the marker still protects the copy) changes nothing.
    let again = fold_views(&client).await;
    assert_eq!(
        counter(&coll, "k").await,
        1,
        "one increment, counted by `complete`; runs: {run:?} / {again:?}; now {:?}",
        coll.find_one(doc! { "_id": "k" }).await.unwrap()
    );
    assert_eq!(pending_len(&coll, "k").await, 0, "the copy is dropped");
}

/// The statements folding one document too large for one statement apply
/// only in order: each later one also requires that the entries before its
/// stretch are all fresh — the earlier statements removed their stale
/// entries — so a token repeated across stretches is counted once even
/// when a writer changed the first stretch. Found by the adversarial review
/// of issue 11 (finding C): a writer completing one fresh entry of the
/// first stretch shifted the array by exactly the first stretch's stale
/// entries, the first statement refused, the second applied out of order
/// and counted T on its last entry, leaving T's earlier copy to be counted
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_split_across_fold_statements_is_counted_once_when_a_writer_changes_the_array() {
    const FRESH: usize = 160_000;
    let ctx = TestContext::new("fold_split_out_of_order").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = stale();
    let young: Vec<ObjectId> = (0..FRESH).map(|_| fresh()).collect();
    let mut pending = vec![Bson::ObjectId(t)];
    pending.extend(young.iter().map(|f| Bson::ObjectId(*f)));
    // T's second entry (another client's `{t, n}` form) and one more stale
    // token, in the second stretch.
    pending.push(Bson::Document(doc! { "t": t, "n": 1i64 }));
    pending.push(Bson::ObjectId(stale()));
    let document = doc! { "_id": "k", "counter": 0i64, "pending": pending };
    coll.insert_one(&document).await.unwrap();
    let now = server_now(&client).await;

    // The fold's update is held while a writer completes one fresh entry
    // of the first stretch.
    let (fail, fold) = fold_held_on_the_server(&ctx, &client, now, Duration::from_secs(8)).await;
    // The race needs the document folded by two statements, sent together:
    // its array split in two stretches.
    let held = client
        .events
        .sent()
        .into_iter()
        .rfind(|s| s.name == "update");
    assert_eq!(
        held.map(|s| s.statements),
        Some(2),
        "the held update folds the document in two stretches"
    );
    let (_, writer) = rival_views(&ctx).await;
    let pending = writer
        .find_pending("k", Token::from_object_id(young[100]))
        .await
        .unwrap()
        .expect("pending");
    let completion = writer.complete(pending).await;
    assert!(
        matches!(completion, tally::Completion::Counted(_)),
        "{completion:?}"
    );

    let run = fold.await.unwrap();
    drop(fail);
    assert!(run.error.is_none(), "{:?}", run.error);
    let again = fold_views(&client).await;
    // T once, the other stale token once, the completed fresh entry once.
    assert_eq!(counter(&coll, "k").await, 3, "runs: {run:?} / {again:?}");
    assert_eq!(pending_len(&coll, "k").await, FRESH - 1);
}

/// The fold never turns an int64 counter into a double: each statement
/// requires that adding its sum to the counter as it is then stays an
/// int64, so a step 2 that moved the counter near the limit after the fold
/// read it makes the statement match nothing, and the re-read finds the
/// document would overflow (malformed, left unchanged). `$add` would
/// otherwise quietly return a double, and the counter would no longer be
/// exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_never_turns_an_int64_counter_into_a_double_when_a_step_2_moved_it() {
    let ctx = TestContext::new("fold_overflow_race").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    let t = stale();
    let big = 1i64 << 61;
    coll.insert_one(doc! { "_id": "k", "counter": 0i64, "pending": [{ "t": t, "n": big }] })
        .await
        .unwrap();
    let now = server_now(&client).await;
    // The writer (another process, not held by the fail point) connects
    // before the hold starts: its increment must fit in the hold.
    let (_, writer) = rival_views(&ctx).await;
    let (fail, fold) = fold_held_on_the_server(&ctx, &client, now, Duration::from_secs(5)).await;
    // A writer's increment lands meanwhile and takes the counter near the
    // int64 limit: `counter + big` no longer fits.
    let near = i64::MAX - 5;
    let outcome = writer.increment("k", near).await;
    assert!(matches!(outcome, Increment::Counted(_)), "{outcome:?}");
    // The race this test is about needs the fold's update still held here;
    // on a loaded machine the hold could run out first.
    assert!(
        !fold.is_finished(),
        "the test's precondition: the fold's update is still held on the server"
    );

    let run = fold.await.unwrap();
    drop(fail);
    assert!(run.error.is_none(), "{:?}", run.error);
    assert_eq!(
        field(&coll, "k", "counter").await,
        Some(Bson::Int64(near)),
        "run: {run:?}"
    );
    assert_eq!(
        field(&coll, "k", "pending").await,
        Some(Bson::Array(vec![Bson::Document(doc! { "t": t, "n": big })])),
        "the stale token stays, uncounted"
    );
    let again = fold_views(&client).await;
    assert_eq!(again.survey.malformed, 1, "{again:?}");
}
