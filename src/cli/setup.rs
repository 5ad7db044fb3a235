//! `tallyd setup`: creates the indexes the configuration needs — tally
//! never creates one behind the user's back, so this is the one place it
//! does, when asked. Idempotent: what is there already is left as it is,
//! and every index is named with what was done to it.
//!
//! - every collection: a sparse index on the pending and on the settled
//!   field (the fold's and the monitor's scans read only the documents
//!   holding tokens; README "Indexes"), unless an index starting with the
//!   field exists;
//! - every collection with a ledger: its events collection's indexes (the
//!   fold's by lane, the exact reads' by counter and lane).

use crate::cli::out;
use std::process::ExitCode;

use clap::Args;
use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::doc;
use mongodb::options::IndexOptions;

use super::{EXIT_OK, exit_code_for};
use crate::config::Config;
use crate::error::{Error, Failure, RetryBudget, server_code};
use crate::ledger::Ledger;
use crate::store::Store;
use crate::write::counter::CollectionConfig;

/// `tallyd setup`.
#[derive(Debug, Args)]
pub(crate) struct SetupArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(super) async fn run(args: SetupArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let store = match super::connect(config, args.json).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let mut done = Vec::new();
    let mut failed = Vec::new();
    // The exit code of the first failure: its class says what to do.
    let mut code = EXIT_OK;
    let mut failure = |name: &str, err: &Error| {
        if code == EXIT_OK {
            code = exit_code_for(err);
        }
        failed.push(format!("{name}: {}", secrets.scrub(&store.explain(err))));
    };
    for spec in &config.collections {
        for field in [&spec.pending_field, &spec.settled_field] {
            match sparse_index(&store, spec, field).await {
                Ok(line) => done.push(line),
                Err(err) => failure(&spec.name, &err),
            }
        }
        if spec.events_collection.is_some() {
            let ledger = Ledger::new(&store, spec.clone());
            match ledger.create_indexes().await {
                Ok(lines) => done.extend(lines),
                Err(err) => failure(&spec.events_collection_name(), &err),
            }
        }
    }
    store.shutdown().await;
    if args.json {
        out!("{}", serde_json::json!({ "done": done, "failed": failed }));
    } else {
        done.iter().for_each(|line| out!("{line}"));
        failed.iter().for_each(|line| eprintln!("error: {line}"));
    }
    ExitCode::from(code)
}

/// Creates a sparse index on `field` unless an index starting with it
/// exists.
async fn sparse_index(
    store: &Store,
    spec: &CollectionConfig,
    field: &str,
) -> Result<String, Error> {
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
        return Ok(format!("{}: index {name} on {field}: present", spec.name));
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
    Ok(format!(
        "{}: index {name} on {field} (sparse): created",
        spec.name
    ))
}
