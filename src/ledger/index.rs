//! The indexes an events collection needs, checked and created.
//!
//! tally never creates an index behind the user's back: `tallyd setup`
//! creates these ([`create`]), `status`, `doctor` and `check-config
//! --connect` say which are missing ([`missing`]), and the fold refuses to
//! run without them ([`Error::IndexesMissing`]).
//!
//! - `tally_events_number`: `{s: 1}`: events by number — a pass's range,
//!   the backlog above the watermark, the deletion of folded events;
//! - `tally_events_counter_number`: `{k: 1, s: 1}`: a counter's events
//!   above the watermark (exact reads).
//!
//! Each secondary index costs every insert; there is no TTL index: events
//! are deleted by the fold, once folded and older than the dedupe window.

use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::{Document, doc};
use mongodb::options::IndexOptions;

use super::field;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;

/// The number index's name.
const NUMBER: &str = "tally_events_number";
/// The counter index's name.
const COUNTER: &str = "tally_events_counter_number";

/// One index the ledger needs: its name and keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Needed {
    pub(crate) name: &'static str,
    pub(crate) keys: Document,
}

/// Whether [`create`] found an index or made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Created {
    /// It was there already.
    Present,
    /// It was created.
    New,
}

/// The indexes an events collection needs.
pub(crate) fn needed() -> Vec<Needed> {
    vec![
        Needed {
            name: NUMBER,
            keys: doc! { field::NUMBER: 1 },
        },
        Needed {
            name: COUNTER,
            keys: doc! { field::COUNTER: 1, field::NUMBER: 1 },
        },
    ]
}

/// The indexes of `collection` as the server lists them (none when the
/// collection does not exist).
async fn listed(store: &Store, collection: &str) -> Result<Vec<Document>, Error> {
    let coll = store.collection(collection);
    let mut budget = RetryBudget::read_once("ledger.list_indexes");
    let cursor = match store.with_retry(&mut budget, || coll.list_indexes()).await {
        Ok(cursor) => cursor,
        // NamespaceNotFound: no collection, no indexes.
        Err(failure) if crate::error::server_code(&failure.source) == Some(26) => {
            return Ok(Vec::new());
        }
        Err(failure) => return Err(Error::Server(failure)),
    };
    let models: Vec<IndexModel> = cursor
        .try_collect()
        .await
        .map_err(|err| Error::Server(Failure::once("ledger.list_indexes", err)))?;
    Ok(models
        .into_iter()
        .map(|m| {
            let mut d = doc! { "key": m.keys };
            if let Some(name) = m.options.and_then(|o| o.name) {
                d.insert("name", name);
            }
            d
        })
        .collect())
}

/// The needed indexes `collection` lacks, by name. An index with the
/// needed keys counts whatever its name.
pub(crate) async fn missing(store: &Store, collection: &str) -> Result<Vec<String>, Error> {
    let listed = listed(store, collection).await?;
    Ok(needed()
        .into_iter()
        .filter(|n| {
            !listed
                .iter()
                .any(|d| d.get_document("key").ok() == Some(&n.keys))
        })
        .map(|n| n.name.to_owned())
        .collect())
}

/// The index of a bucketed ledger's events, beside [`needed`]: by key,
/// bucket and number (the events' counter is a document `{k, t}`). A
/// counter's events are asked for by the dotted fields of their counter
/// ([`by_id`](crate::write::at::by_id)), which this serves on every server
/// (the test server answers an equality with a document by a collection
/// scan). Not required: reads work without it, scanning.
pub(crate) fn bucket_events() -> Needed {
    Needed {
        name: "tally_events_bucket_number",
        keys: doc! {
            format!("{}.{}", field::COUNTER, crate::write::at::KEY): 1,
            format!("{}.{}", field::COUNTER, crate::write::at::START): 1,
            field::NUMBER: 1,
        },
    }
}

/// The index of a bucketed counters collection, ledger or not: by key and
/// bucket (the `_id` is a document `{k, t}`). Every write and read of a
/// bucketed counter asks by the dotted fields of its `_id` as well, which
/// this serves on every server. Not required: writes and reads work
/// without it, scanning on the test server (MongoDB serves them from the
/// `_id` index).
pub(crate) fn bucket_counters() -> Needed {
    Needed {
        name: "tally_counters_bucket",
        keys: doc! {
            format!("_id.{}", crate::write::at::KEY): 1,
            format!("_id.{}", crate::write::at::START): 1,
        },
    }
}

/// The index closing and `status` read a bucketed collection's open
/// buckets through: `closed: null` is the open buckets' range of it, so
/// a run reads what is open, not the history (`reconcile::close`).
#[cfg(feature = "daemon")]
pub(crate) fn open_buckets() -> Needed {
    Needed {
        name: "tally_buckets_open",
        keys: doc! {
            crate::bucket::CLOSED_FIELD: 1,
            format!("_id.{}", crate::write::at::START): 1,
        },
    }
}

/// Creates the needed indexes of `collection` that are missing.
/// Idempotent.
pub(crate) async fn create(
    store: &Store,
    collection: &str,
) -> Result<Vec<(Needed, Created)>, Error> {
    create_these(store, collection, needed()).await
}

/// Creates those of `needs` that `collection` lacks. Idempotent.
pub(crate) async fn create_these(
    store: &Store,
    collection: &str,
    needs: Vec<Needed>,
) -> Result<Vec<(Needed, Created)>, Error> {
    let listed = listed(store, collection).await?;
    let coll = store.collection(collection);
    let mut done = Vec::new();
    for need in needs {
        let found = listed
            .iter()
            .any(|d| d.get_document("key").ok() == Some(&need.keys));
        let outcome = if found {
            Created::Present
        } else {
            let options = IndexOptions::builder().name(need.name.to_owned()).build();
            let model = IndexModel::builder()
                .keys(need.keys.clone())
                .options(options)
                .build();
            let mut budget = RetryBudget::retry_once("ledger.create_index");
            store
                .with_retry(&mut budget, || coll.create_index(model.clone()))
                .await
                .map_err(Error::Server)?;
            Created::New
        };
        done.push((need, outcome));
    }
    Ok(done)
}

/// One line saying what [`create`] did with an index.
pub(crate) fn describe(collection: &str, need: &Needed, created: Created) -> String {
    let what = match created {
        Created::Present => "present",
        Created::New => "created",
    };
    format!("{collection}: index {} {}: {what}", need.name, need.keys)
}
