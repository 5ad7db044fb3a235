//! The indexes an events collection needs, checked and created, and what
//! earlier versions of tally left on it.
//!
//! tally never creates an index behind the user's back: `tallyd setup`
//! creates these ([`create`]), `status`, `doctor` and `check-config
//! --connect` say which are missing ([`missing`]), and the fold refuses to
//! run without them ([`Error::IndexesMissing`]).
//!
//! - `tally_events_number`: `{s: 1}`: events by number — the sweep's
//!   deletion of folded events past the dedupe window, a catch-up's chunks
//!   (`tallyd fold-from`, a first fold, an upgrade).
//!
//! That is all: the fold and exact reads read the events collection's log
//! (its change stream), not the collection, and each secondary index costs
//! every insert. There is no TTL index: events are deleted by the fold,
//! once it is past them and they are older than the dedupe window.
//!
//! Earlier versions indexed events by counter and number, by key, bucket
//! and number, and (0.2.0) by lane; nothing reads those any more, and
//! `tallyd setup` drops them ([`drop_obsolete`]). The version before this
//! one fenced the events collection with a validator (its "floor"), which
//! `setup` removes too ([`remove_floor`]).

use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::{Document, doc};
use mongodb::options::IndexOptions;

use super::field;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;

/// The number index's name.
const NUMBER: &str = "tally_events_number";

#[cfg(feature = "daemon")]
/// Indexes earlier versions made on an events collection that nothing
/// reads any more, by name.
pub(crate) const OBSOLETE: [&str; 4] = [
    "tally_events_counter_number",
    "tally_events_bucket_number",
    "tally_events_lane",
    "tally_events_counter_lane",
];

#[cfg(feature = "daemon")]
/// The validator clause by which the version before this one named its
/// floor's raises.
const FLOOR_TOKEN: &str = "tally_floor";

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
    vec![Needed {
        name: NUMBER,
        keys: doc! { field::NUMBER: 1 },
    }]
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

/// The names of `collection`'s indexes (none when it does not exist).
#[cfg(feature = "daemon")]
pub(crate) async fn names(store: &Store, collection: &str) -> Result<Vec<String>, Error> {
    Ok(listed(store, collection)
        .await?
        .iter()
        .filter_map(|index| index.get_str("name").ok().map(str::to_owned))
        .collect())
}

/// Drops the indexes of `collection` that earlier versions made and nothing
/// reads any more ([`OBSOLETE`], by name): each costs every insert. Returns
/// one line per index dropped.
#[cfg(feature = "daemon")]
pub(crate) async fn drop_obsolete(store: &Store, collection: &str) -> Result<Vec<String>, Error> {
    let listed = listed(store, collection).await?;
    let coll = store.collection(collection);
    let mut dropped = Vec::new();
    for index in listed {
        let Ok(name) = index.get_str("name") else {
            continue;
        };
        if !OBSOLETE.contains(&name) {
            continue;
        }
        let mut budget = RetryBudget::retry_once("ledger.drop_index");
        match store
            .with_retry(&mut budget, || coll.drop_index(name))
            .await
        {
            Ok(()) => {}
            // Dropped meanwhile (another setup): as asked.
            Err(failure) if crate::error::server_code(&failure.source) == Some(27) => {}
            Err(failure) => return Err(Error::Server(failure)),
        }
        let keys = index.get_document("key").cloned().unwrap_or_default();
        dropped.push(format!(
            "{collection}: index {name} {keys}: dropped (an earlier version's; nothing reads it, \
             and it cost every insert)"
        ));
    }
    Ok(dropped)
}

#[cfg(feature = "daemon")]
/// Removes the validator the version before this one set on the events
/// collection `events` (its floor, `{s: {$gt: F}, tally_floor: …}`), which
/// would refuse an insert numbered at or below `F`. Another validator is
/// left as it is. Says what it did, if anything.
pub(crate) async fn remove_floor(store: &Store, events: &str) -> Result<Option<String>, Error> {
    let Some(validator) = floor(store, events).await? else {
        return Ok(None);
    };
    let shown = validator.to_string();
    let database = store.database();
    let remove = doc! { "collMod": events, "validator": {}, "writeConcern": { "w": "majority" } };
    let mut budget = RetryBudget::retry_once("ledger.remove_floor");
    store
        .with_retry(&mut budget, || database.run_command(remove.clone()))
        .await
        .map_err(Error::Server)?;
    Ok(Some(format!(
        "{events}: validator {shown}: removed (the previous version's floor; the fold no longer \
         needs one)"
    )))
}

/// Whether the events collection `events` still carries the previous
/// version's validator.
#[cfg(feature = "daemon")]
pub(crate) async fn has_floor(store: &Store, events: &str) -> Result<bool, Error> {
    Ok(floor(store, events).await?.is_some())
}

/// The previous version's validator on the events collection `events`, if
/// it carries one.
#[cfg(feature = "daemon")]
async fn floor(store: &Store, events: &str) -> Result<Option<Document>, Error> {
    let database = store.database();
    let listing = doc! { "listCollections": 1, "filter": { "name": events } };
    let mut budget = RetryBudget::read_once("ledger.read_validator");
    let reply = store
        .with_retry(&mut budget, || database.run_command(listing.clone()))
        .await
        .map_err(Error::Server)?;
    let validator = reply
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .and_then(|batch| batch.first())
        .and_then(mongodb::bson::Bson::as_document)
        .and_then(|c| c.get_document("options").ok())
        .and_then(|o| o.get_document("validator").ok());
    Ok(validator.filter(|v| is_floor(v)).cloned())
}

#[cfg(feature = "daemon")]
/// Whether `validator` is the previous version's floor: `{s: {$gt: F}}`,
/// with its raise's token or without.
pub(crate) fn is_floor(validator: &Document) -> bool {
    let numbered = validator
        .get_document(field::NUMBER)
        .is_ok_and(|s| s.len() == 1 && s.contains_key("$gt"));
    let named = validator.contains_key(FLOOR_TOKEN);
    numbered
        && validator
            .keys()
            .all(|k| k == field::NUMBER || k == FLOOR_TOKEN)
        || named
}

#[cfg(all(test, feature = "daemon"))]
mod tests {
    use super::*;

    #[test]
    fn only_the_previous_versions_floor_is_taken_for_it() {
        assert!(is_floor(
            &doc! { "s": { "$gt": 5i64 }, "tally_floor": { "$ne": "t" } }
        ));
        assert!(is_floor(&doc! { "s": { "$gt": 5i64 } }));
        assert!(!is_floor(
            &doc! { "s": { "$gt": 5i64 }, "k": { "$exists": true } }
        ));
        assert!(!is_floor(&doc! { "n": { "$type": "long" } }));
        assert!(!is_floor(&doc! {}));
    }
}
