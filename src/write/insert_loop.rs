//! The optimistic insert loop (DESIGN §5): give a new document the highest
//! numeric `_id` in the collection plus one; if another writer took that id
//! first (a duplicate key), read the highest id again and retry — a bounded
//! number of times, with jittered backoff, then a clear error saying how many
//! attempts were made. Any other insert error surfaces at once.
//!
//! Ids stay dense: no number is reserved that is not used. The price is a
//! read per attempt and lost races under contention; a [`Sequences`]
//! counter costs one round trip but may leave gaps.
//!
//! [`Sequences`]: crate::write::sequence::Sequences

use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use crate::document::{Inserted, bson_type_name, insert_if_absent, integer_value};
use crate::error::{Error, RetryBudget};
use crate::store::Store;

/// Default number of inserts tried before giving up.
pub(crate) const DEFAULT_MAX_ATTEMPTS: u32 = 10;

/// Inserts documents with the next free numeric `_id`.
#[derive(Clone, Debug)]
pub struct InsertLoop {
    store: Store,
    collection: Collection<Document>,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_cap: Duration,
}

impl InsertLoop {
    /// An insert loop on `collection`, with 10 attempts and a backoff of
    /// 2 ms doubling up to 100 ms (full jitter).
    pub fn new(store: &Store, collection: &str) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(collection),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff_base: Duration::from_millis(2),
            backoff_cap: Duration::from_millis(100),
        }
    }

    /// Tries at most `attempts` inserts (at least one).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Waits a random time up to `base × 2^(attempt-1)`, capped at `cap`,
    /// after each lost race.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_cap = cap;
        self
    }

    /// Inserts `document` (its own `_id`, if any, is replaced) under the
    /// next free id and returns that id.
    pub async fn insert(&self, fields: Document) -> Result<i64, Error> {
        for attempt in 1..=self.max_attempts {
            let candidate = highest_id(&self.store, &self.collection)
                .await?
                .map_or(1, |max| max + 1);
            // `_id` first, as the server stores it, so a read-back compares equal.
            let mut document = doc! { "_id": candidate };
            document.extend(
                fields
                    .iter()
                    .filter(|(k, _)| *k != "_id")
                    .map(|(k, v)| (k.clone(), v.clone())),
            );
            match insert_if_absent(
                &self.store,
                &self.collection,
                &document,
                "insert_loop.insert",
            )
            .await?
            {
                Inserted::New => return Ok(candidate),
                // After a lost reply, the id may be taken by our own first
                // attempt: it is ours if it holds exactly what we sent.
                Inserted::Existing { found, maybe_ours } if maybe_ours && found == document => {
                    return Ok(candidate);
                }
                Inserted::Existing { .. } => {}
            }
            tracing::debug!(
                collection = self.collection.name(),
                candidate,
                attempt,
                "insert loop lost the race for an id"
            );
            if attempt < self.max_attempts {
                tokio::time::sleep(self.jitter(attempt)).await;
            }
        }
        Err(Error::InsertAttemptsExhausted {
            attempts: self.max_attempts,
        })
    }

    fn jitter(&self, attempt: u32) -> Duration {
        let ceiling = self
            .backoff_base
            .saturating_mul(1 << (attempt - 1).min(20))
            .min(self.backoff_cap);
        ceiling.mul_f64(fastrand::f64())
    }
}

/// The highest numeric `_id` in `collection` (`None` when it holds none).
/// Ids of other types are ignored; a non-integral number is an error.
pub(crate) async fn highest_id(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<Option<i64>, Error> {
    let mut budget = RetryBudget::read_once("insert_loop.highest_id");
    // `$gte: -inf` selects exactly the numbers (type bracketing) and can
    // walk the `_id` index from its top.
    let found = store
        .with_retry(&mut budget, || {
            collection
                .find_one(doc! { "_id": { "$gte": f64::NEG_INFINITY } })
                .sort(doc! { "_id": -1 })
                .projection(doc! { "_id": 1 })
        })
        .await
        .map_err(Error::Server)?;
    let Some(found) = found else {
        return Ok(None);
    };
    let id = found.get("_id").unwrap_or(&Bson::Null);
    integer_value(id).map(Some).ok_or_else(|| Error::Malformed {
        collection: collection.name().to_owned(),
        id: id.to_string(),
        reason: format!(
            "the highest numeric _id is a {} that is not an integer",
            bson_type_name(id)
        ),
    })
}
