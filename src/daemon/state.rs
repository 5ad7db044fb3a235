//! The daemon's own state, kept in MongoDB (`[daemon] state_collection`) so
//! that a restart — or another instance — carries on where the last one
//! stopped:
//!
//! - `{_id: "last_success:<collection>", at, malformed, refused}`: the last
//!   run that reconciled the collection completely, with the malformed
//!   documents it found and the documents the server refused to update (a
//!   missed run is caught up at start; the metrics start from it);
//! - `{_id: "resume:<collection>", token, at}`: where the collection's
//!   change stream stopped (writes made while the daemon was down are seen);
//! - `{_id: "lease", owner, expires}`: which instance is active
//!   ([`crate::daemon::lease`]).

use std::time::SystemTime;

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::change_stream::event::ResumeToken;

use crate::error::Error;
use crate::store::Store;

/// The last complete reconcile run of a collection, as recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LastRun {
    /// When it ran (the server's clock).
    pub(crate) at: SystemTime,
    /// The malformed documents it found (`None` in older records).
    pub(crate) malformed: Option<u64>,
    /// The documents the server refused to update (`None` in older
    /// records).
    pub(crate) refused: Option<u64>,
}

/// Reads and writes the daemon's state documents.
#[derive(Clone, Debug)]
pub(crate) struct State {
    store: Store,
    collection: Collection<Document>,
}

impl State {
    /// The state in `collection` of the store's database.
    pub(crate) fn new(store: &Store, collection: &str) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(collection),
        }
    }

    /// The state collection itself (the lease lives there too).
    pub(crate) fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// When the collection was last reconciled completely.
    pub(crate) async fn last_success(&self, collection: &str) -> Result<Option<SystemTime>, Error> {
        let found = self.read(&format!("last_success:{collection}")).await?;
        Ok(match found.and_then(|d| d.get("at").cloned()) {
            Some(Bson::DateTime(at)) => Some(at.to_system_time()),
            _ => None,
        })
    }

    /// The last complete reconcile run of the collection, as recorded
    /// (`None` when none was).
    pub(crate) async fn last_run(&self, collection: &str) -> Result<Option<LastRun>, Error> {
        let found = self.read(&format!("last_success:{collection}")).await?;
        let Some(found) = found else { return Ok(None) };
        let Some(Bson::DateTime(at)) = found.get("at") else {
            return Ok(None);
        };
        // Records written before the counts were kept have none: nothing
        // known, nothing claimed.
        let count = |field: &str| match found.get(field) {
            Some(Bson::Int64(n)) => u64::try_from(*n).ok(),
            Some(Bson::Int32(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
        Ok(Some(LastRun {
            at: at.to_system_time(),
            malformed: count("malformed"),
            refused: count("refused"),
        }))
    }

    /// Records a complete reconcile run of the collection at `at`, which
    /// found `malformed` documents and could not fold `refused`.
    pub(crate) async fn record_success(
        &self,
        collection: &str,
        at: SystemTime,
        malformed: u64,
        refused: u64,
    ) -> Result<(), Error> {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.write(
            &format!("last_success:{collection}"),
            doc! {
                "collection": collection,
                "at": DateTime::from_system_time(at),
                "malformed": count(malformed),
                "refused": count(refused),
            },
        )
        .await
    }

    /// Where the collection's change stream stopped, if it was saved.
    pub(crate) async fn resume_token(
        &self,
        collection: &str,
    ) -> Result<Option<ResumeToken>, Error> {
        let found = self.read(&format!("resume:{collection}")).await?;
        let Some(token) = found.and_then(|d| d.get("token").cloned()) else {
            return Ok(None);
        };
        mongodb::bson::deserialize_from_bson(token)
            .map(Some)
            .map_err(|err| Error::InvalidArgument(format!("unreadable saved resume token: {err}")))
    }

    /// Saves where the collection's change stream is.
    pub(crate) async fn save_resume_token(
        &self,
        collection: &str,
        token: &ResumeToken,
    ) -> Result<(), Error> {
        let token = mongodb::bson::serialize_to_bson(token).map_err(|err| {
            Error::InvalidArgument(format!("cannot encode a resume token: {err}"))
        })?;
        self.write(
            &format!("resume:{collection}"),
            doc! { "collection": collection, "token": token, "at": DateTime::now() },
        )
        .await
    }

    /// Forgets the saved resume token (after the server lost its history).
    pub(crate) async fn forget_resume_token(&self, collection: &str) -> Result<(), Error> {
        let filter = doc! { "_id": format!("resume:{collection}") };
        let mut budget = crate::error::RetryBudget::retry_once("state.forget");
        self.store
            .with_retry(&mut budget, || self.collection.delete_one(filter.clone()))
            .await
            .map(|_| ())
            .map_err(Error::Server)
    }

    async fn read(&self, id: &str) -> Result<Option<Document>, Error> {
        self.store
            .find_one(&self.collection, doc! { "_id": id }, doc! {}, "state.read")
            .await
    }

    /// Replaces the document `id` with `fields` (idempotent, so retried once).
    async fn write(&self, id: &str, fields: Document) -> Result<(), Error> {
        // Two daemons upserting the same new document race on `_id`: the
        // loser's duplicate key applied nothing and is sent again.
        let mut budget =
            crate::error::RetryBudget::retry_once("state.write").with_duplicate_key_retries(3);
        self.store
            .with_retry(&mut budget, || {
                self.collection
                    .replace_one(doc! { "_id": id }, fields.clone())
                    .upsert(true)
            })
            .await
            .map(|_| ())
            .map_err(Error::Server)
    }
}
