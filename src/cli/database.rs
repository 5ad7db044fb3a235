//! Which server and database a command talks to, and whether that
//! database holds the configured collections: `status` and `doctor` name
//! both, and a misspelt `[mongodb] database` (which the server accepts
//! without a word: it would only create the database at the first write)
//! is said as such instead of showing clean zeros.

use mongodb::bson::doc;
use serde_json::{Value, json};

use crate::error::{Error, RetryBudget, code, server_code, words};
use crate::store::Store;

/// `MongoDB at HOSTS as USER, database DB` (never the password).
pub(super) fn described(store: &Store) -> String {
    let reach = store.reach();
    let user = match &reach.user {
        Some(user) => format!(" as {user}"),
        None => String::new(),
    };
    format!(
        "MongoDB at {}{user}, database {}",
        reach.hosts(),
        store.database().name()
    )
}

/// The same for `--json`: `{"hosts", "user", "database"}`.
pub(super) fn described_json(store: &Store) -> Value {
    let reach = store.reach();
    json!({
        "hosts": reach.hosts,
        "user": reach.user,
        "database": store.database().name(),
    })
}

/// Which of `names` exist in the store's database: `None` when the user
/// may not list the database's collections (the smallest role may not).
pub(super) async fn existing(
    store: &Store,
    names: &[String],
) -> Result<Option<Vec<String>>, Error> {
    let database = store.database();
    let mut budget = RetryBudget::read_once("status.list_collections");
    let listed = store
        .with_retry(&mut budget, || {
            database
                .list_collection_names()
                .filter(doc! { "name": { "$in": names } })
                .authorized_collections(true)
        })
        .await;
    match listed {
        Ok(found) => Ok(Some(
            names
                .iter()
                .filter(|n| found.contains(n))
                .cloned()
                .collect(),
        )),
        Err(failure) if server_code(&failure.source) == Some(code::UNAUTHORIZED) => Ok(None),
        Err(failure) => Err(Error::Server(failure)),
    }
}

/// The message for a database that holds none of `names`.
pub(super) fn holds_none(store: &Store, names: &[String]) -> String {
    format!(
        "database {} at {} holds none of the configured collections ({}): it does not exist, or \
         nothing was written to it yet; check [mongodb] database",
        store.database().name(),
        store.reach().hosts(),
        words(names)
    )
}
