//! A prune never drops a fold lane an unfinished ledger batch still needs
//! (the module docs of `tally::reconcile::ledger`, "Pruning"): a batch a
//! killed fold left applied but not marked is re-applied by recovery
//! through its own lane and number, which is a no-op only on counters that
//! still hold the lane's entry.
//!
//! Each test builds that state with the library's own steps (claim, sum,
//! apply, then the fold is dropped as a killed process leaves it), prunes
//! at a server time more than `lane_ttl` (24 h) later — the run's `now`,
//! the clock every cutoff is drawn from — and recovers. The oracle is the
//! number of distinct events the test recorded on each counter.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, doc, oid::ObjectId};
use tally::{
    ClaimedBatch, CollectionConfig, CollectionRun, EventFold, EventFoldSettings, FoldTarget,
    Ledger, Mode, Reconciler, Store,
};
use tokio_util::sync::CancellationToken;

use crate::common::{FailPoint, TestContext, counter, field};
use crate::ledger::assert_outcome;

/// Past the default `lane_ttl` (24 h): every lane minted now is expired.
const LATER: Duration = Duration::from_secs(25 * 3600);

fn target(spec: CollectionConfig) -> FoldTarget {
    FoldTarget {
        spec,
        grace: Duration::from_secs(900),
        batch_size: 100,
    }
}

/// One reconcile run of `spec` (a configuration with or without its
/// ledger) at the server's time plus `LATER`.
async fn reconcile_later(store: &Store, spec: CollectionConfig) -> CollectionRun {
    let reconciler = Reconciler::new(store);
    let now = reconciler.server_time().await.expect("server time") + LATER;
    reconciler
        .reconcile(
            &target(spec),
            Mode::Fold,
            now,
            &CancellationToken::new(),
            &mut |_| {},
        )
        .await
}

/// Records 30 distinct events over three counters, every third one twice:
/// the oracle, each counter's number of distinct events.
async fn record_events(ledger: &Ledger) -> BTreeMap<String, i64> {
    let mut oracle = BTreeMap::new();
    for i in 0..30 {
        let key = format!("k{}", i % 3);
        assert_outcome(
            &ledger.record(format!("e{i}"), key.as_str(), 1).await,
            "recorded",
        );
        if i % 3 == 0 {
            assert_outcome(
                &ledger.record(format!("e{i}"), key.as_str(), 1).await,
                "duplicate",
            );
        }
        *oracle.entry(key).or_default() += 1;
    }
    oracle
}

/// A test's database and what a fold killed right after its apply left in
/// it: the events of `record_events` in `spec`'s ledger, one batch of them
/// all claimed and applied to every counter through the fold lane, not
/// marked folded.
struct Left {
    ctx: TestContext,
    store: Store,
    oracle: BTreeMap<String, i64>,
    batch: ClaimedBatch,
}

async fn left_unfinished(test: &str, spec: &CollectionConfig) -> Left {
    let ctx = TestContext::new(test).await;
    let store = ctx.client(false).await.store();
    let ledger = Ledger::new(&store, spec.clone());
    ledger
        .create_indexes(tally::DEFAULT_EVENT_RETENTION)
        .await
        .expect("the ledger's indexes");
    let oracle = record_events(&ledger).await;
    let settings = EventFoldSettings {
        batch_size: 100,
        ..EventFoldSettings::default()
    };
    let fold = EventFold::new(&store, spec.clone(), settings);
    let batch = fold.claim().await.expect("claim").expect("a batch");
    let sums = fold.sum(&batch).await.expect("sum");
    fold.apply(&batch, &sums, false).await.expect("apply");
    for key in oracle.keys() {
        assert!(holds_lane(&store, key, batch.lane).await, "{key}");
    }
    Left {
        ctx,
        store,
        oracle,
        batch,
    }
}

/// Whether the counter `key` holds an entry of `lane`.
async fn holds_lane(store: &Store, key: &str, lane: ObjectId) -> bool {
    let lanes = field(&store.collection("views"), key, "lanes").await;
    matches!(lanes, Some(Bson::Document(map)) if map.contains_key(lane.to_hex()))
}

/// A new process recovers the batch and folds the rest; then every counter
/// must hold its distinct events exactly once, and no event stay unfolded.
async fn recover_and_check(store: &Store, spec: &CollectionConfig, oracle: &BTreeMap<String, i64>) {
    let run = EventFold::new(store, spec.clone(), EventFoldSettings::default())
        .fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("recovery");
    assert_eq!(run.recovered, 1, "{run:?}");
    let ledger = Ledger::new(store, spec.clone());
    for (key, n) in oracle {
        assert_eq!(
            counter(&store.collection("views"), key.as_str()).await,
            *n,
            "counter {key}: its distinct events, once each"
        );
        assert_eq!(ledger.value(key.as_str()).await.unwrap().value, *n);
    }
    let events = store.collection(&spec.events_collection_name());
    let unfolded = events
        .count_documents(doc! { "f": { "$exists": false } })
        .await
        .unwrap();
    assert_eq!(unfolded, 0);
}

/// A host whose configuration omits the collection's ledger reconciles it
/// while a batch of the default events collection (`views_events`) is
/// unfinished, its lane older than `lane_ttl`: the run keeps the lane's
/// entries, and recovery counts each event once. Once the batch is
/// finished, the same run prunes them.
#[tokio::test]
async fn a_run_without_the_ledger_configured_keeps_the_lane_an_unfinished_batch_needs() {
    let with_ledger = CollectionConfig::new("views").with_events_collection("views_events");
    let Left {
        store,
        oracle,
        batch,
        ..
    } = left_unfinished("ledger_prune_unconfigured", &with_ledger).await;

    let run = reconcile_later(&store, CollectionConfig::new("views")).await;
    recover_and_check(&store, &with_ledger, &oracle).await;
    assert!(run.error.is_none(), "{run:?}");
    assert_eq!(run.lanes_pruned, 0, "the batch's lane is kept: {run:?}");

    let run = reconcile_later(&store, CollectionConfig::new("views")).await;
    assert!(run.error.is_none(), "{run:?}");
    assert_eq!(run.lanes_pruned, 3, "finished, its lane expires: {run:?}");
    for key in oracle.keys() {
        assert!(!holds_lane(&store, key, batch.lane).await, "{key}");
    }
}

/// The daemon's repair of stuck tokens folds documents at once, without a
/// ledger pass first, and prunes their expired lanes in the same update: a
/// daemon back after a day down, with a batch of its configured ledger
/// (under its own name, `views_log`) left unfinished, must not prune that
/// batch's lane from a counter it repairs.
#[tokio::test]
async fn a_repair_keeps_the_lane_an_unfinished_batch_of_the_configured_ledger_needs() {
    let spec = CollectionConfig::new("views").with_events_collection("views_log");
    let Left {
        store,
        mut oracle,
        batch,
        ..
    } = left_unfinished("ledger_prune_repair", &spec).await;
    // A token a two-step writer left on k0 an hour ago: stuck, repaired.
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let secs = hour_ago
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token = ObjectId::from_parts(secs as u32, [7; 5], [0; 3]);
    store
        .collection("views")
        .update_one(doc! { "_id": "k0" }, doc! { "$push": { "pending": token } })
        .await
        .unwrap();
    *oracle.get_mut("k0").unwrap() += 1;

    let reconciler = Reconciler::new(&store);
    let now = reconciler.server_time().await.unwrap() + LATER;
    let ids: Vec<Bson> = oracle.keys().map(|k| Bson::String(k.clone())).collect();
    let repaired = reconciler
        .fold_documents(&target(spec.clone()), ids, now)
        .await
        .expect("repair");
    recover_and_check(&store, &spec, &oracle).await;
    assert_eq!(repaired, 1, "only the document with the stuck token");
    assert!(holds_lane(&store, "k1", batch.lane).await);
}

/// When the run cannot read which lanes unfinished batches need, it prunes
/// no lane at all — neither the fold's nor a writer's expired one — and
/// says so; the tokens are still folded.
#[tokio::test]
async fn a_run_that_cannot_read_the_claimed_lanes_prunes_nothing_and_says_so() {
    let with_ledger = CollectionConfig::new("views").with_events_collection("views_events");
    let Left {
        ctx,
        store,
        oracle,
        batch,
    } = left_unfinished("ledger_prune_unreadable", &with_ledger).await;
    let writer_lane = ObjectId::new();
    let stale = ObjectId::from_parts(1_700_000_000, [3; 5], [0; 3]);
    store
        .collection("other")
        .insert_one(doc! {
            "_id": "w", "counter": 1i64, "lanes": { writer_lane.to_hex(): 1i64 }, "pending": [stale],
        })
        .await
        .unwrap();

    let runs = {
        let _refused = FailPoint::set(
            &ctx,
            Bson::String("alwaysOn".into()),
            doc! { "failCommands": ["distinct"], "errorCode": 13 },
        )
        .await;
        (
            reconcile_later(&store, CollectionConfig::new("views")).await,
            reconcile_later(&store, CollectionConfig::new("other")).await,
        )
    };
    for run in [&runs.0, &runs.1] {
        assert_eq!(run.lanes_pruned, 0, "{run:?}");
        let said = run.error.as_ref().expect("the run says why").to_string();
        assert!(said.contains("13 Unauthorized"), "{said}");
    }
    assert_eq!(runs.1.tokens_folded, 1, "tokens are folded all the same");
    assert_eq!(counter(&store.collection("other"), "w").await, 2);
    assert!(holds_lane(&store, "k0", batch.lane).await);
    let lanes = field(&store.collection("other"), "w", "lanes").await;
    assert_eq!(
        lanes,
        Some(Bson::Document(doc! { writer_lane.to_hex(): 1i64 }))
    );
    recover_and_check(&store, &with_ledger, &oracle).await;
}
