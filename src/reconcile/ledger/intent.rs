//! The fold's batch intents: before a fold claims a batch it writes the
//! batch's id, lane, number and event ids in one document of the events
//! collection's `_batches` collection (one insert: all or nothing), and
//! deletes it once the batch is marked folded.
//!
//! The claim is an `updateMany`, which MongoDB does not apply atomically
//! across documents: an attempt interrupted part-way claims some of the ids,
//! and a copy held up in the network can claim the rest minutes later. If
//! recovery summed the batch before that copy landed, the late events would
//! join a batch already applied: its lane number is then a no-op on their
//! counters and they would be marked folded uncounted. Recovery therefore
//! claims the intent's ids itself first; once that claim is confirmed every
//! id is claimed by someone, and no copy, however late, changes the batch.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use super::ClaimedBatch;
use super::query::aggregate_all;
use crate::error::{Error, ErrorClass, RetryBudget};
use crate::store::Store;
use crate::write::ledger::field;

/// Ids per claiming `updateMany`. A server may match `$in` in time
/// quadratic in its length (the test server does: 1,000 ids take 2–3 s,
/// ten chunks of 100 about 0.5 s); the claim's meaning does not depend on
/// how the ids are split.
const CLAIM_CHUNK: usize = 100;

/// The intents' collection of the events collection `events`.
pub(crate) fn collection_name(events: &str) -> String {
    format!("{events}_batches")
}

/// A batch and the event ids it was picked with.
#[derive(Debug, Clone)]
pub(super) struct Intent {
    pub(super) batch: ClaimedBatch,
    pub(super) ids: Vec<Bson>,
}

/// Writes the intent of `batch` over `ids`.
pub(super) async fn write(
    store: &Store,
    intents: &Collection<Document>,
    batch: &ClaimedBatch,
    ids: &[Bson],
) -> Result<(), Error> {
    let intent = doc! {
        "_id": batch.id, "l": batch.lane.to_hex(), "s": batch.number, "ids": ids.to_vec(),
    };
    let mut budget = RetryBudget::retry_once("ledger.fold.intent");
    let written = store
        .with_retry(&mut budget, || intents.insert_one(intent.clone()))
        .await;
    match written {
        Ok(_) => Ok(()),
        // Our own earlier attempt landed.
        Err(failure) if failure.class == ErrorClass::DuplicateKey => Ok(()),
        Err(failure) => Err(Error::Server(failure)),
    }
}

/// Claims for `batch` every id of `ids` no one has claimed: sets `c` to
/// the batch, its lane and number, [`CLAIM_CHUNK`] ids per `updateMany`,
/// one after the other. Confirmed — every chunk confirmed — every id is
/// claimed by someone, for good; a chunk that failed fails the claim, and
/// what the others claimed is finished by recovery like any claim
/// interrupted part-way.
pub(super) async fn claim(
    store: &Store,
    events: &Collection<Document>,
    batch: &ClaimedBatch,
    ids: &[Bson],
) -> Result<(), Error> {
    let claim = doc! { "$set": { field::CLAIM: {
        "b": batch.id, "l": batch.lane.to_hex(), "s": batch.number,
    } } };
    for chunk in ids.chunks(CLAIM_CHUNK) {
        let filter = doc! {
            "_id": { "$in": chunk.to_vec() },
            field::CLAIM: { "$exists": false },
            field::FOLDED: { "$exists": false },
        };
        let mut budget = RetryBudget::retry_once("ledger.fold.claim");
        store
            .with_retry(&mut budget, || {
                events.update_many(filter.clone(), claim.clone())
            })
            .await
            .map_err(Error::Server)?;
    }
    Ok(())
}

/// Every intent left (batches not finished, or finished and not deleted
/// yet).
pub(super) async fn all(
    store: &Store,
    intents: &Collection<Document>,
) -> Result<Vec<Intent>, Error> {
    let rows = aggregate_all(
        store,
        intents,
        vec![doc! { "$sort": { "_id": 1 } }],
        "ledger.fold.intents",
    )
    .await?;
    let mut all = Vec::new();
    for row in rows {
        match (ClaimedBatch::of_row(&row), row.get_array("ids")) {
            (Some(batch), Ok(ids)) => all.push(Intent {
                batch,
                ids: ids.clone(),
            }),
            _ => tracing::warn!(intent = %row, "a fold batch's intent is malformed; left as it is"),
        }
    }
    Ok(all)
}

/// Deletes the intent of the finished batch `id`.
pub(super) async fn remove(
    store: &Store,
    intents: &Collection<Document>,
    id: ObjectId,
) -> Result<(), Error> {
    let mut budget = RetryBudget::retry_once("ledger.fold.intent_done");
    store
        .with_retry(&mut budget, || intents.delete_one(doc! { "_id": id }))
        .await
        .map(|_| ())
        .map_err(Error::Server)
}
