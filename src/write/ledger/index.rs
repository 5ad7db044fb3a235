//! The indexes an events collection needs, checked and created.
//!
//! tally never creates an index behind the user's back: `tallyd setup`
//! creates these ([`create`]), `status` and `check-config --connect` say
//! which are missing ([`missing`]), and the fold refuses to run without
//! them ([`Error::IndexesMissing`]).
//!
//! - `tally_events_folded`: `{f: 1}`, a TTL index (`expireAfterSeconds` =
//!   `event_retention`): forgets a folded event after the dedupe window,
//!   and serves "not folded yet" (the fold's claims, the backlog);
//! - `tally_events_batch`: `{"c.b": 1}`: a batch's events (its sum, its
//!   mark, its recovery);
//! - `tally_events_counter`: `{k: 1, f: 1}`: a counter's unfolded events
//!   (exact reads).

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::{Document, doc};
use mongodb::options::IndexOptions;

use super::field;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;

/// Default dedupe window: how long a folded event's key is remembered.
pub const DEFAULT_EVENT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The TTL index's name.
const FOLDED: &str = "tally_events_folded";
/// The batch index's name.
const BATCH: &str = "tally_events_batch";
/// The counter index's name.
const COUNTER: &str = "tally_events_counter";

/// One index the ledger needs: its name, keys, and TTL when it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Needed {
    pub(crate) name: &'static str,
    pub(crate) keys: Document,
    pub(crate) expire_after: Option<Duration>,
}

/// What [`create`] did with one index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Created {
    /// It was there already, as needed.
    Present,
    /// It was created.
    New,
    /// It was there with another TTL; its TTL was changed.
    Retuned { from: Option<u64> },
}

/// The indexes an events collection needs with `retention` as its dedupe
/// window.
pub(crate) fn needed(retention: Duration) -> Vec<Needed> {
    vec![
        Needed {
            name: FOLDED,
            keys: doc! { field::FOLDED: 1 },
            expire_after: Some(retention),
        },
        Needed {
            name: BATCH,
            keys: doc! { field::BATCH: 1 },
            expire_after: None,
        },
        Needed {
            name: COUNTER,
            keys: doc! { field::COUNTER: 1, field::FOLDED: 1 },
            expire_after: None,
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
            if let Some(options) = m.options {
                if let Some(name) = options.name {
                    d.insert("name", name);
                }
                if let Some(ttl) = options.expire_after {
                    d.insert("expireAfterSeconds", ttl.as_secs() as i64);
                }
            }
            d
        })
        .collect())
}

/// The needed indexes `collection` lacks, by name. An index with the
/// needed keys counts whatever its name; a TTL with another period counts
/// too (the window differs, the fold works).
pub(crate) async fn missing(
    store: &Store,
    collection: &str,
    retention: Duration,
) -> Result<Vec<String>, Error> {
    let listed = listed(store, collection).await?;
    Ok(needed(retention)
        .into_iter()
        .filter(|n| {
            !listed.iter().any(|d| {
                d.get_document("key").ok() == Some(&n.keys)
                    && (n.expire_after.is_none() || d.contains_key("expireAfterSeconds"))
            })
        })
        .map(|n| n.name.to_owned())
        .collect())
}

/// Creates the needed indexes of `collection` that are missing, and
/// retunes the TTL when its period differs from `retention`. Idempotent.
pub(crate) async fn create(
    store: &Store,
    collection: &str,
    retention: Duration,
) -> Result<Vec<(Needed, Created)>, Error> {
    let listed = listed(store, collection).await?;
    let coll = store.collection(collection);
    let mut done = Vec::new();
    for need in needed(retention) {
        let found = listed
            .iter()
            .find(|d| d.get_document("key").ok() == Some(&need.keys));
        let ttl = need.expire_after.map(|t| t.as_secs() as i64);
        let outcome = match found {
            Some(d) if ttl.is_none() || d.get_i64("expireAfterSeconds").ok() == ttl => {
                Created::Present
            }
            Some(d) => {
                let name = d.get_str("name").unwrap_or(need.name).to_owned();
                let command = doc! {
                    "collMod": collection,
                    "index": { "name": name, "expireAfterSeconds": ttl.unwrap_or_default() },
                };
                let mut budget = RetryBudget::retry_once("ledger.retune_ttl");
                store
                    .with_retry(&mut budget, || {
                        store.database().run_command(command.clone())
                    })
                    .await
                    .map_err(Error::Server)?;
                Created::Retuned {
                    from: d.get_i64("expireAfterSeconds").ok().map(|s| s as u64),
                }
            }
            None => {
                let options = IndexOptions::builder()
                    .name(need.name.to_owned())
                    .expire_after(need.expire_after)
                    .build();
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
            }
        };
        done.push((need, outcome));
    }
    Ok(done)
}

/// One line saying what [`create`] did with an index.
pub(crate) fn describe(collection: &str, need: &Needed, created: &Created) -> String {
    let ttl = need
        .expire_after
        .map(|t| format!(" (TTL {})", humantime::format_duration(t)))
        .unwrap_or_default();
    let what = match created {
        Created::Present => "present".to_owned(),
        Created::New => "created".to_owned(),
        Created::Retuned { from } => format!(
            "TTL changed from {}",
            from.map_or_else(|| "none".to_owned(), |s| format!("{s}s"))
        ),
    };
    format!(
        "{collection}: index {} {}{ttl}: {what}",
        need.name, need.keys
    )
}
