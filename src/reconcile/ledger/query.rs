//! The ledger's reads that are not steps of the fold: the backlog (for
//! status, metrics and alerts) and the lanes unfinished claims still need
//! (for a prune to keep), and the one way the fold runs an aggregation.

use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use super::Backlog;
use crate::document::integer_value;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;
use crate::write::ledger::field;

/// Runs `pipeline` on `collection` (retried once on a transient failure)
/// and collects its rows.
pub(super) async fn aggregate_all(
    store: &Store,
    collection: &Collection<Document>,
    pipeline: Vec<Document>,
    operation: &'static str,
) -> Result<Vec<Document>, Error> {
    let mut budget = RetryBudget::read_once(operation);
    let cursor = store
        .with_retry(&mut budget, || collection.aggregate(pipeline.clone()))
        .await
        .map_err(Error::Server)?;
    cursor
        .try_collect()
        .await
        .map_err(|err| Error::Server(Failure::once(operation, err)))
}

/// The unfolded events of the events collection `events`: how many, and
/// the oldest one's age at `now`.
pub(crate) async fn backlog(
    store: &Store,
    events: &str,
    now: SystemTime,
) -> Result<Backlog, Error> {
    let pipeline = vec![
        doc! { "$match": { field::FOLDED: { "$exists": false } } },
        doc! { "$group": {
            "_id": Bson::Null,
            "events": { "$sum": 1 },
            "oldest": { "$min": format!("${}", field::AT) },
        } },
    ];
    let rows = aggregate_all(store, &store.collection(events), pipeline, "ledger.backlog").await?;
    let Some(row) = rows.into_iter().next() else {
        return Ok(Backlog::default());
    };
    let oldest = row.get_datetime("oldest").ok().map(|at| {
        now.duration_since(at.to_system_time())
            .unwrap_or(Duration::ZERO)
    });
    Ok(Backlog {
        events: row
            .get("events")
            .and_then(integer_value)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0),
        oldest_age: oldest,
    })
}

/// The fold lanes unfinished claims (and intents) of the events collection
/// `events` still need: a prune of counter lane entries must keep these, or a batch
/// recovered later would count twice.
pub async fn claimed_lanes(store: &Store, events: &str) -> Result<Vec<String>, Error> {
    let coll = store.collection(events);
    let filter = doc! { field::FOLDED: { "$exists": false }, field::CLAIM: { "$exists": true } };
    let mut budget = RetryBudget::read_once("ledger.claimed_lanes");
    let lanes = store
        .with_retry(&mut budget, || coll.distinct("c.l", filter.clone()))
        .await
        .map_err(Error::Server)?;
    let intents = store.collection(&super::intent::collection_name(events));
    let mut budget = RetryBudget::read_once("ledger.claimed_lanes");
    let intended = store
        .with_retry(&mut budget, || intents.distinct("l", doc! {}))
        .await
        .map_err(Error::Server)?;
    let mut lanes: Vec<String> = lanes
        .into_iter()
        .chain(intended)
        .filter_map(|l| l.as_str().map(str::to_owned))
        .collect();
    lanes.sort();
    lanes.dedup();
    Ok(lanes)
}
