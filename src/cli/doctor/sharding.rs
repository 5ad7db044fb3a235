//! Shard keys on a sharded cluster: which of the configured collections may
//! be sharded, and on what key, without counting anything twice.
//!
//! `_id` is unique across shards only when it is the whole shard key. tally
//! relies on that uniqueness everywhere: a counter's document is found and
//! created by `_id` alone, and an event recorded again collides with itself
//! on its `_id`. So counter collections may be sharded on `_id` (hashed or
//! ranged) and nothing else; events collections likewise, with a warning
//! for what sharding them still costs; the small state collections (a
//! ledger's fold state, the daemon's state, the sequences) must not be
//! sharded at all. `doctor` reports each collection's verdict, and the
//! daemon refuses to start on a failing one ([`refusal`]).

use std::collections::BTreeMap;

use mongodb::bson::{Bson, Document, doc};

use super::{Check, Verdict, ledgers};
use crate::config::Config;
use crate::ledger::state::collection_name as fold_state_collection;
use crate::store::Store;

/// What tally keeps in a collection, which decides the keys it may be
/// sharded on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// A `[[collections]]` counter collection.
    Counters,
    /// A ledger's events collection.
    Events,
    /// A ledger's fold state (`<events>_fold`).
    FoldState,
    /// `[daemon] state_collection`.
    DaemonState,
    /// `[sequences] collection`.
    Sequences,
}

impl Role {
    /// What the collection is, as the messages say it.
    fn what(self) -> &'static str {
        match self {
            Role::Counters => "a counter collection",
            Role::Events => "a ledger's events collection",
            Role::FoldState => "a ledger's fold state",
            Role::DaemonState => "the daemon's state ([daemon] state_collection)",
            Role::Sequences => "the sequences ([sequences] collection)",
        }
    }
}

/// One configured collection and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Namespace {
    /// The collection's name (in the configured database).
    pub(super) collection: String,
    /// What tally keeps in it.
    pub(super) role: Role,
}

/// Every collection the configuration names, with its role, in the
/// configuration's order (a name with two roles is listed twice).
pub(super) fn namespaces(config: &Config) -> Vec<Namespace> {
    let mut all = Vec::new();
    let mut add = |collection: String, role| all.push(Namespace { collection, role });
    for spec in &config.collections {
        add(spec.name.clone(), Role::Counters);
    }
    for spec in ledgers(config) {
        let events = spec.events_collection_name();
        add(fold_state_collection(&events), Role::FoldState);
        add(events, Role::Events);
    }
    add(config.daemon.state_collection.clone(), Role::DaemonState);
    add(config.sequences.collection.clone(), Role::Sequences);
    all
}

/// Whether a shard key is `_id` alone, hashed or ranged: the one key under
/// which `_id` is unique across shards.
fn is_id_key(key: &Document) -> bool {
    key.len() == 1
        && match key.get("_id") {
            Some(Bson::String(kind)) => kind == "hashed",
            Some(Bson::Int32(1)) | Some(Bson::Int64(1)) => true,
            Some(Bson::Double(d)) => *d == 1.0,
            _ => false,
        }
}

/// A shard key as the shell writes it: `{tenant: 1, _id: "hashed"}`.
pub(super) fn shown(key: &Document) -> String {
    let fields: Vec<String> = key
        .iter()
        .map(|(field, value)| {
            let value = match value {
                Bson::String(kind) => format!("\"{kind}\""),
                Bson::Int32(n) => n.to_string(),
                Bson::Int64(n) => n.to_string(),
                Bson::Double(d) => format!("{d}"),
                other => other.to_string(),
            };
            format!("{field}: {value}")
        })
        .collect();
    format!("{{{}}}", fields.join(", "))
}

/// The verdict on `namespace` (in `database`) sharded on `key` (`None`:
/// unsharded), with what it costs and the command that fixes it.
pub(super) fn judge(database: &str, namespace: &Namespace, key: Option<&Document>) -> Check {
    let ns = format!("{database}.{}", namespace.collection);
    let what = namespace.role.what();
    let (verdict, message) = match (namespace.role, key) {
        (_, None) => (
            Verdict::Ok,
            format!("{what}, unsharded: every document lives on one shard"),
        ),
        (Role::Counters, Some(key)) if is_id_key(key) => (
            Verdict::Ok,
            format!(
                "{what}, sharded on {}: _id is unique across the shards, so a lane update \
                 already applied collides with its document instead of creating a second one",
                shown(key)
            ),
        ),
        (Role::Counters, Some(key)) => (
            Verdict::Fail,
            format!(
                "{what}, sharded on {}: _id is unique only within each shard, so a key's \
                 document can be created twice and an increment counted in both (MongoDB 7.1 \
                 and later accept the _id-only upsert; older ones refuse it) — there is no safe \
                 fix in place: with no writer and no daemon running, move the documents to a \
                 new collection sharded on _id (sh.shardCollection(\"{ns}_new\", {{_id: \
                 \"hashed\"}})) and name it in [[collections]]; never reshardCollection to a \
                 key other than _id",
                shown(key)
            ),
        ),
        (Role::Events, Some(key)) if is_id_key(key) => (
            Verdict::Warn,
            format!(
                "{what}, sharded on {}: an event recorded twice still collides on its _id, \
                 but the fold's deleteMany of folded events can race a chunk migration and \
                 leave some behind, and its change stream through mongos waits for idle \
                 shards; keep its chunks still with sh.disableBalancing(\"{ns}\") (on MongoDB \
                 8.0: db.adminCommand({{setClusterParameter: \
                 {{pauseMigrationsDuringMultiUpdates: {{enabled: true}}}}}})), or leave it \
                 unsharded",
                shown(key)
            ),
        ),
        (Role::Events, Some(key)) => (
            Verdict::Fail,
            format!(
                "{what}, sharded on {}: _id is unique only within each shard, so an event \
                 recorded again (a redelivery, a retry on another lane) can land on another \
                 shard and be counted twice — there is no safe fix in place: with no writer \
                 and no daemon running, move the events to a new collection sharded on _id \
                 (sh.shardCollection(\"{ns}_new\", {{_id: \"hashed\"}})) and name it in \
                 events_collection; never reshardCollection to a key other than _id",
                shown(key)
            ),
        ),
        (Role::FoldState | Role::DaemonState | Role::Sequences, Some(key)) => (
            Verdict::Fail,
            format!(
                "{what}, sharded on {}: it must live on one shard — a few small documents \
                 that tally reads and replaces by _id alone; with the daemon stopped, unshard \
                 it: db.adminCommand({{unshardCollection: \"{ns}\"}}) (MongoDB 8.0; before \
                 8.0, copy its documents into a new unsharded collection and name that in \
                 the configuration)",
                shown(key)
            ),
        ),
    };
    Check {
        collection: Some(namespace.collection.clone()),
        ..Check::new("shard_key", verdict, message)
    }
}

/// The shard keys of `collections` (of `database`) as `config.collections`
/// records them; a collection not there (or dropped, or tracked but
/// unsplittable, as MongoDB 8.0 tracks unsharded ones) is unsharded.
pub(super) async fn shard_keys(
    store: &Store,
    database: &str,
    collections: &[&str],
) -> Result<BTreeMap<String, Document>, mongodb::error::Error> {
    let ids: Vec<String> = collections
        .iter()
        .map(|c| format!("{database}.{c}"))
        .collect();
    let batch = i64::try_from(ids.len() + 1).unwrap_or(i64::MAX);
    let command = doc! {
        "find": "collections",
        "filter": { "_id": { "$in": &ids } },
        "projection": { "key": 1, "dropped": 1, "unsplittable": 1 },
        "batchSize": batch,
    };
    let config = store.client().database("config");
    let reply = store.attempt(config.run_command(command)).await?;
    let mut keys = BTreeMap::new();
    let found = reply
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .into_iter()
        .flatten()
        .filter_map(Bson::as_document);
    for entry in found {
        let gone = entry.get_bool("dropped").unwrap_or(false)
            || entry.get_bool("unsplittable").unwrap_or(false);
        let (Ok(id), Ok(key)) = (entry.get_str("_id"), entry.get_document("key")) else {
            continue;
        };
        let Some(collection) = id.strip_prefix(&format!("{database}.")) else {
            continue;
        };
        if !gone {
            keys.insert(collection.to_owned(), key.clone());
        }
    }
    Ok(keys)
}

/// One `shard_key` check per configured collection (one warning when the
/// keys cannot be read), and the events collections that are sharded.
pub(super) async fn checks(store: &Store, config: &Config) -> (Vec<Check>, Vec<String>) {
    let database = store.database().name().to_owned();
    let all = namespaces(config);
    let names: Vec<&str> = all.iter().map(|n| n.collection.as_str()).collect();
    match shard_keys(store, &database, &names).await {
        Ok(keys) => {
            let sharded_events = all
                .iter()
                .filter(|n| n.role == Role::Events && keys.contains_key(&n.collection))
                .map(|n| n.collection.clone())
                .collect();
            let checks = all
                .iter()
                .map(|n| judge(&database, n, keys.get(&n.collection)))
                .collect();
            (checks, sharded_events)
        }
        Err(err) => {
            let check = Check::new(
                "shard_key",
                Verdict::Warn,
                format!(
                    "unknown: cannot read the shard keys from config.collections: {}; grant \
                     find on the config database (the clusterMonitor role) and run doctor again",
                    store.describe(&err)
                ),
            );
            (vec![check], Vec::new())
        }
    }
}

/// Whether `hello` comes from a mongos.
pub(super) fn is_mongos(hello: &Document) -> bool {
    hello.get_str("msg").is_ok_and(|m| m == "isdbgrid")
}

/// The daemon's start: on a sharded cluster, `Err` with one sentence naming
/// every configured collection whose shard key fails (and its key). Not a
/// sharded cluster, or keys that cannot be read (said in the log), is no
/// reason to refuse.
pub(crate) async fn refusal(store: &Store, config: &Config) -> Result<(), String> {
    let Ok(hello) = store.hello().await else {
        return Ok(());
    };
    if !is_mongos(&hello) {
        return Ok(());
    }
    let failed: Vec<String> = checks(store, config)
        .await
        .0
        .into_iter()
        .filter_map(|check| match (check.verdict, check.collection) {
            (Verdict::Fail, Some(collection)) => Some(format!("{collection}: {}", check.message)),
            (Verdict::Warn, None) => {
                tracing::warn!(
                    "starting without checking the shard keys (tallyd doctor checks them): {}",
                    check.message
                );
                None
            }
            _ => None,
        })
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "a shard key would count twice or break tally's state (tallyd doctor says the same): {}",
        failed.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace(collection: &str, role: Role) -> Namespace {
        Namespace {
            collection: collection.to_owned(),
            role,
        }
    }

    /// The verdicts of the table, for every role and key.
    #[test]
    fn every_role_and_key_has_its_verdict() {
        let hashed = doc! { "_id": "hashed" };
        let ranged = doc! { "_id": 1 };
        let other = doc! { "tenant": 1, "_id": 1 };
        let cases = [
            (Role::Counters, None, Verdict::Ok),
            (Role::Counters, Some(&hashed), Verdict::Ok),
            (Role::Counters, Some(&ranged), Verdict::Ok),
            (Role::Counters, Some(&other), Verdict::Fail),
            (Role::Events, None, Verdict::Ok),
            (Role::Events, Some(&hashed), Verdict::Warn),
            (Role::Events, Some(&ranged), Verdict::Warn),
            (Role::Events, Some(&other), Verdict::Fail),
            (Role::FoldState, None, Verdict::Ok),
            (Role::FoldState, Some(&hashed), Verdict::Fail),
            (Role::DaemonState, Some(&ranged), Verdict::Fail),
            (Role::Sequences, Some(&hashed), Verdict::Fail),
            (Role::Sequences, None, Verdict::Ok),
        ];
        for (role, key, expected) in cases {
            let check = judge("app", &namespace("c", role), key);
            assert_eq!(
                check.verdict, expected,
                "{role:?} {key:?}: {}",
                check.message
            );
            assert_eq!(check.collection.as_deref(), Some("c"));
        }
    }

    #[test]
    fn a_failing_key_names_the_key_and_the_fix() {
        let other = doc! { "tenant": 1 };
        let check = judge("app", &namespace("views", Role::Counters), Some(&other));
        assert!(
            check.message.contains("sharded on {tenant: 1}"),
            "{check:?}"
        );
        assert!(
            check
                .message
                .contains("sh.shardCollection(\"app.views_new\", {_id: \"hashed\"})"),
            "{check:?}"
        );
        assert!(check.message.contains("never reshardCollection"));
        let check = judge(
            "app",
            &namespace("tally_state", Role::DaemonState),
            Some(&other),
        );
        assert!(
            check
                .message
                .contains("db.adminCommand({unshardCollection: \"app.tally_state\"})"),
            "{check:?}"
        );
    }

    #[test]
    fn only_id_alone_is_an_id_key() {
        assert!(is_id_key(&doc! { "_id": "hashed" }));
        assert!(is_id_key(&doc! { "_id": 1i64 }));
        assert!(is_id_key(&doc! { "_id": 1.0 }));
        assert!(!is_id_key(&doc! { "_id": -1 }));
        assert!(!is_id_key(&doc! { "_id": 1, "tenant": 1 }));
        assert!(!is_id_key(&doc! { "key": "hashed" }));
    }
}
