//! `tallyd setup`: creates the indexes the configuration needs — tally
//! never creates one behind the user's back, so this is the one place it
//! does, when asked. Idempotent: what is there already is left as it is,
//! and every index is named with what was done to it.
//!
//! - every collection: a sparse index on the pending and on the settled
//!   field (the fold's and the monitor's scans read only the documents
//!   holding tokens; README "Indexes"), unless an index starting with the
//!   field exists;
//! - every collection with buckets: its counters by key and bucket
//!   (`{_id.k: 1, _id.t: 1}`), through which every write and read of a
//!   bucketed counter finds it on every server, and its open buckets
//!   (`{closed: 1, _id.t: 1}`), which closing and `status` read;
//! - every collection with a ledger: its events collection's index by
//!   number (the sweep's, a catch-up's); and what earlier versions left
//!   there is removed: their indexes nothing reads any more, and the
//!   previous version's validator (its "floor").

use crate::cli::out;
use std::process::ExitCode;

use clap::Args;
use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::IndexOptions;
use serde_json::{Value, json};

use super::{EXIT_CONFIG, EXIT_OK, exit::EXIT_UNAVAILABLE, exit_code_for};
use crate::config::Config;
use crate::error::{Error, Failure, RetryBudget, server_code, words};
use crate::ledger::index::{self, Created};
use crate::store::Store;
use crate::write::counter::CollectionConfig;

/// `tallyd setup`.
#[derive(Debug, Args)]
pub(crate) struct SetupArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// One index `setup` found or created.
struct IndexDone {
    collection: String,
    name: String,
    keys: Document,
    sparse: bool,
    created: bool,
    /// The line the text output shows.
    line: String,
}

impl IndexDone {
    fn json(&self) -> Value {
        json!({
            "collection": self.collection,
            "index": self.name,
            "keys": Bson::Document(self.keys.clone()).into_relaxed_extjson(),
            "sparse": self.sparse,
            "action": if self.created { "created" } else { "present" },
        })
    }
}

/// Whether a failure of one collection ends the command: a server that
/// cannot be reached (or a connection string naming another replica set),
/// or credentials it refuses, fail every other collection the same way,
/// so they are not tried. (A missing privilege may be one collection's.)
fn stops_the_rest(err: &Error) -> bool {
    let code = exit_code_for(err);
    code == EXIT_UNAVAILABLE || code == EXIT_CONFIG || err.is_authentication_failure()
}

/// What `setup` says of the indexes of `collection` it found or made.
fn indexes_done(
    collection: &str,
    created: Vec<(index::Needed, Created)>,
) -> impl Iterator<Item = IndexDone> + '_ {
    created.into_iter().map(move |(need, created)| IndexDone {
        line: index::describe(collection, &need, created),
        collection: collection.to_owned(),
        name: need.name.to_owned(),
        keys: need.keys,
        sparse: false,
        created: created == Created::New,
    })
}

pub(super) async fn run(args: SetupArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let store = match super::connect(config, args.json).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let mut done: Vec<IndexDone> = Vec::new();
    let mut removed: Vec<String> = Vec::new();
    let mut failed: Vec<(String, String)> = Vec::new();
    // The exit code of the first failure: its class says what to do.
    let mut code = EXIT_OK;
    let mut not_tried: Vec<String> = Vec::new();
    let mut stopped = false;
    for spec in &config.collections {
        if stopped {
            not_tried.push(spec.name.clone());
            continue;
        }
        let mut failure = |name: &str, err: &Error| {
            if code == EXIT_OK {
                code = exit_code_for(err);
            }
            let said = (name.to_owned(), secrets.scrub(&store.explain(err)));
            // One collection's two indexes refused alike: said once.
            if failed.last() != Some(&said) {
                failed.push(said);
            }
            stops_the_rest(err)
        };
        for field in [&spec.pending_field, &spec.settled_field] {
            match sparse_index(&store, spec, field).await {
                Ok(index) => done.push(index),
                Err(err) => {
                    stopped = failure(&spec.name, &err);
                    if stopped {
                        break;
                    }
                }
            }
        }
        for (collection, needs) in named_indexes(spec) {
            if stopped {
                break;
            }
            match index::create_these(&store, &collection, needs).await {
                Ok(created) => done.extend(indexes_done(&collection, created)),
                Err(err) => stopped = failure(&collection, &err),
            }
        }
        if spec.events_collection.is_some() && !stopped {
            let events = spec.events_collection_name();
            match earlier_leftovers(&store, &events).await {
                Ok(lines) => removed.extend(lines),
                Err(err) => stopped = failure(&events, &err),
            }
        }
    }
    store.shutdown().await;
    if args.json {
        let failed: Vec<Value> = failed
            .iter()
            .map(|(collection, error)| json!({ "collection": collection, "error": error }))
            .collect();
        let indexes: Vec<Value> = done.iter().map(IndexDone::json).collect();
        out!(
            "{}",
            json!({
                "outcome": if code == EXIT_OK { "done" } else { "error" },
                "indexes": indexes,
                "removed": removed,
                "failed": failed,
                "not_tried": not_tried,
            })
        );
    } else {
        done.iter().for_each(|index| out!("{}", index.line));
        removed.iter().for_each(|line| out!("{line}"));
        for (collection, error) in &failed {
            eprintln!("error: {collection}: {error}");
        }
        if !not_tried.is_empty() {
            eprintln!(
                "not tried: {} (the same server would fail them alike); run `{}` again once \
                 the error above is fixed",
                words(&not_tried),
                super::shown_command("setup")
            );
        }
    }
    ExitCode::from(code)
}

/// The named indexes `spec` needs beyond the sparse ones, by collection: a
/// bucketed collection's by key and bucket (every write of a bucketed
/// counter asks through it, ledger or not), a ledger's events' by number.
fn named_indexes(spec: &CollectionConfig) -> Vec<(String, Vec<index::Needed>)> {
    let mut named = Vec::new();
    if spec.buckets.is_some() {
        named.push((
            spec.name.clone(),
            vec![index::bucket_counters(), index::open_buckets()],
        ));
    }
    if spec.events_collection.is_some() {
        named.push((spec.events_collection_name(), index::needed()));
    }
    named
}

/// What earlier versions left on the events collection `events` and
/// nothing needs any more, removed: their indexes, the previous version's
/// validator. One line each.
async fn earlier_leftovers(store: &Store, events: &str) -> Result<Vec<String>, Error> {
    let mut lines = index::drop_obsolete(store, events).await?;
    lines.extend(index::remove_floor(store, events).await?);
    Ok(lines)
}

/// Creates a sparse index on `field` unless an index starting with it
/// exists.
async fn sparse_index(
    store: &Store,
    spec: &CollectionConfig,
    field: &str,
) -> Result<IndexDone, Error> {
    let collection = store.collection(&spec.name);
    let mut budget = RetryBudget::read_once("setup.list_indexes");
    let listed: Vec<IndexModel> = match store
        .with_retry(&mut budget, || collection.list_indexes())
        .await
    {
        Ok(cursor) => cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("setup.list_indexes", err)))?,
        // NamespaceNotFound: creating the index creates the collection.
        Err(failure) if server_code(&failure.source) == Some(26) => Vec::new(),
        Err(failure) => return Err(Error::Server(failure)),
    };
    if let Some(found) = listed
        .iter()
        .find(|i| i.keys.keys().next().is_some_and(|k| k == field))
    {
        let name = found
            .options
            .as_ref()
            .and_then(|o| o.name.clone())
            .unwrap_or_default();
        return Ok(IndexDone {
            line: format!("{}: index {name} on {field}: present", spec.name),
            collection: spec.name.clone(),
            name,
            keys: found.keys.clone(),
            sparse: found.options.as_ref().and_then(|o| o.sparse) == Some(true),
            created: false,
        });
    }
    let name = format!("tally_{field}_sparse");
    let model = IndexModel::builder()
        .keys(doc! { field: 1 })
        .options(
            IndexOptions::builder()
                .name(name.clone())
                .sparse(true)
                .build(),
        )
        .build();
    let mut budget = RetryBudget::retry_once("setup.create_index");
    store
        .with_retry(&mut budget, || collection.create_index(model.clone()))
        .await
        .map_err(Error::Server)?;
    Ok(IndexDone {
        line: format!("{}: index {name} on {field} (sparse): created", spec.name),
        collection: spec.name.clone(),
        name,
        keys: doc! { field: 1 },
        sparse: true,
        created: true,
    })
}
