//! What the daemon may do and how fast it finds its work: each counter
//! collection's indexes against the book's advice, and the connected
//! user's privileges against the smallest role (docs/src/operations/role.md).

use futures::TryStreamExt;
use mongodb::IndexModel;
use mongodb::bson::{Bson, Document, doc};

use super::{Check, Verdict, code, ledgers, run_admin};
use crate::config::Config;
use crate::error::server_code;
use crate::ledger::{Ledger, state};
use crate::store::Store;
use crate::write::counter::CollectionConfig;

/// One check per configured collection: is there a sparse index on the
/// fields the fold looks for?
pub(super) async fn indexes(store: &Store, config: &Config) -> Vec<Check> {
    let mut checks = Vec::new();
    for spec in &config.collections {
        let (verdict, message) = match list_indexes(store, &spec.name).await {
            Ok(indexes) => judge_indexes(spec, &indexes),
            Err(err) if server_code(&err) == Some(code::NAMESPACE_NOT_FOUND) => (
                Verdict::Warn,
                "the collection does not exist yet (the first increment creates it); create \
                 the advised index with it"
                    .to_owned(),
            ),
            Err(err) if server_code(&err) == Some(code::UNAUTHORIZED) => (
                Verdict::Warn,
                "unknown: this user may not list the collection's indexes (listIndexes)".to_owned(),
            ),
            Err(err) => (
                Verdict::Warn,
                format!("unknown: cannot list the indexes: {}", store.describe(&err)),
            ),
        };
        checks.push(Check {
            collection: Some(spec.name.clone()),
            ..Check::new("indexes", verdict, message)
        });
    }
    checks
}

/// One check per ledger: the indexes its fold needs, without which the
/// daemon refuses to fold it.
pub(super) async fn ledger_indexes(store: &Store, config: &Config) -> Vec<Check> {
    let mut checks = Vec::new();
    for spec in ledgers(config) {
        let events = spec.events_collection_name();
        let ledger = Ledger::new(store, spec.clone());
        let (verdict, message) = match ledger.missing_indexes().await {
            Ok(missing) if missing.is_empty() => (
                Verdict::Ok,
                "the fold's index is there (by number: the sweep's, a catch-up's)".to_owned(),
            ),
            Ok(missing) => (
                Verdict::Fail,
                format!(
                    "missing {}: the daemon refuses to fold this ledger; run `tallyd setup`",
                    missing.join(", ")
                ),
            ),
            Err(err) => (
                Verdict::Warn,
                format!("unknown: cannot list the indexes: {}", store.explain(&err)),
            ),
        };
        checks.push(Check {
            collection: Some(events),
            ..Check::new("ledger_indexes", verdict, message)
        });
    }
    checks
}

/// One check per bucketed collection: the index closing and `status`
/// read its open buckets through. Without it they still work, reading
/// every bucket ever written.
pub(super) async fn bucket_indexes(store: &Store, config: &Config) -> Vec<Check> {
    let mut checks = Vec::new();
    for spec in config.collections.iter().filter(|s| s.buckets.is_some()) {
        let need = crate::ledger::index::open_buckets();
        let (verdict, message) = match list_indexes(store, &spec.name).await {
            Ok(indexes) if indexes.iter().any(|i| i.keys == need.keys) => (
                Verdict::Ok,
                format!(
                    "{} {}: closing and status read the open buckets only",
                    need.name, need.keys
                ),
            ),
            Ok(_) => (
                Verdict::Warn,
                format!(
                    "no index {}: each closing run and each `status` reads every bucket ever \
                     written to find the open ones; run `tallyd setup`",
                    need.keys
                ),
            ),
            Err(err) if server_code(&err) == Some(code::NAMESPACE_NOT_FOUND) => (
                Verdict::Warn,
                "the collection does not exist yet; `tallyd setup` creates it with its \
                 indexes"
                    .to_owned(),
            ),
            Err(err) => (
                Verdict::Warn,
                format!("unknown: cannot list the indexes: {}", store.describe(&err)),
            ),
        };
        checks.push(Check {
            collection: Some(spec.name.clone()),
            ..Check::new("bucket_indexes", verdict, message)
        });
    }
    checks
}

async fn list_indexes(store: &Store, name: &str) -> Result<Vec<IndexModel>, mongodb::error::Error> {
    let collection = store.collection(name);
    let cursor = store.attempt(collection.list_indexes()).await?;
    store.attempt(cursor.try_collect()).await
}

/// The fields the README advises a sparse index on: the pending and the
/// settled field, the documents holding either of which the fold and the
/// monitor's scans look for.
fn advised_fields(spec: &CollectionConfig) -> Vec<&str> {
    vec![spec.pending_field.as_str(), spec.settled_field.as_str()]
}

/// The sparse indexes ([`judge_sparse`]), and for a bucketed collection
/// its index by key and bucket: without it every write and read of a
/// bucketed counter scans the collection on a server that does not serve
/// a document `_id` from the `_id` index (the test server does not).
fn judge_indexes(spec: &CollectionConfig, indexes: &[IndexModel]) -> (Verdict, String) {
    let (verdict, message) = judge_sparse(spec, indexes);
    let bucket = crate::ledger::index::bucket_counters();
    if spec.buckets.is_none() || indexes.iter().any(|index| index.keys == bucket.keys) {
        return (verdict, message);
    }
    let missing = format!(
        "no index {} {}: each write and read of a bucketed counter asks by these fields, and \
         without it a server that does not serve a document _id from the _id index reads \
         the whole collection for each; `tallyd setup` creates it",
        bucket.name, bucket.keys
    );
    match verdict {
        Verdict::Ok => (Verdict::Warn, missing),
        _ => (Verdict::Warn, format!("{message}; {missing}")),
    }
}

/// Each advised field needs an index that starts with it and holds only
/// the documents that have it (sparse, or partial).
fn judge_sparse(spec: &CollectionConfig, indexes: &[IndexModel]) -> (Verdict, String) {
    let mut missing = Vec::new();
    let mut dense = Vec::new();
    let mut found = Vec::new();
    for field in advised_fields(spec) {
        let leading = indexes
            .iter()
            .filter(|index| index.keys.keys().next().is_some_and(|k| k == field));
        let mut best: Option<(bool, String)> = None;
        for index in leading {
            let options = index.options.as_ref();
            let selective = options
                .is_some_and(|o| o.sparse == Some(true) || o.partial_filter_expression.is_some());
            let name = options
                .and_then(|o| o.name.clone())
                .unwrap_or_else(|| field.to_owned());
            if best.as_ref().is_none_or(|(s, _)| selective && !s) {
                best = Some((selective, name));
            }
        }
        match best {
            Some((true, name)) => found.push(format!("{name} on {field}")),
            Some((false, name)) => dense.push(format!("{name} on {field}")),
            None => missing.push(field),
        }
    }
    if !missing.is_empty() {
        return (
            Verdict::Warn,
            format!(
                "no index on {}: each fold and each monitor scan reads the whole collection to \
                 find the documents holding tokens or settle markers; on a large collection \
                 where few do, `tallyd setup` creates sparse ones, at a price on every \
                 increment step (BENCHMARKS.md)",
                missing.join(", ")
            ),
        );
    }
    if !dense.is_empty() {
        return (
            Verdict::Warn,
            format!(
                "index {} is not sparse: it holds an entry for every document and every write \
                 updates it; a sparse index serves the fold the same at a smaller price",
                dense.join(", ")
            ),
        );
    }
    (
        Verdict::Ok,
        format!(
            "sparse index {}: the fold and the monitor's scans read only the documents holding \
             tokens",
            found.join(", ")
        ),
    )
}

/// One privilege the daemon needs, and what breaks without it.
struct Needed {
    collection: String,
    action: &'static str,
    why: &'static str,
}

/// smallest role in the book (docs/src/operations/role.md), for this configuration.
fn needed(config: &Config) -> Vec<Needed> {
    let mut needed = Vec::new();
    let mut need = |collection: &str, action, why| {
        needed.push(Needed {
            collection: collection.to_owned(),
            action,
            why,
        });
    };
    for spec in &config.collections {
        let ledger = spec.events_collection.is_some();
        let name = spec.name.as_str();
        need(
            name,
            "find",
            "the fold, status and the monitor's scans read it",
        );
        need(name, "update", "the fold writes to it");
        if config.monitor.enabled {
            need(
                name,
                "changeStream",
                "the monitor watches it; without it, stuck tokens are seen only at each scan",
            );
        }
        if !ledger {
            continue;
        }
        let events = spec.events_collection_name();
        let fold_state = state::collection_name(&events);
        need(
            name,
            "insert",
            "the ledger's fold creates a counter on its first event",
        );
        need(
            &events,
            "find",
            "the ledger's fold catches up from it (a first fold, an upgrade, fold-from)",
        );
        need(
            &events,
            "remove",
            "the ledger's fold deletes events folded and past the dedupe window",
        );
        need(
            &events,
            "changeStream",
            "the ledger's fold and exact reads read its change stream: its log",
        );
        let why = "the ledger's fold keeps its state there";
        for action in ["find", "insert", "update", "remove"] {
            need(&fold_state, action, why);
        }
    }
    let why = "the daemon keeps its last runs, stream positions and lease there";
    for action in ["find", "insert", "update", "remove"] {
        need(&config.daemon.state_collection, action, why);
    }
    needed
}

/// The connected user's privileges (`connectionStatus` with
/// `showPrivileges`) against what the daemon needs.
pub(super) async fn privileges(store: &Store, config: &Config) -> Check {
    let name = "privileges";
    let status = run_admin(
        store,
        doc! { "connectionStatus": 1, "showPrivileges": true },
    )
    .await;
    let status = match status {
        Ok(status) => status,
        Err(err) => {
            let message = format!("unknown: connectionStatus failed: {}", store.describe(&err));
            return Check::new(name, Verdict::Warn, message);
        }
    };
    let info = status.get_document("authInfo").cloned().unwrap_or_default();
    let users = names(&info, "authenticatedUsers", "user");
    if users.is_empty() {
        return Check::new(
            name,
            Verdict::Ok,
            "no user: the server let this connection in without authentication, so the daemon \
             lacks no privilege (and any client that reaches the server may change the counters)",
        );
    }
    let privileges: Vec<Document> = info
        .get_array("authenticatedUserPrivileges")
        .map(|list| list.iter().filter_map(Bson::as_document).cloned().collect())
        .unwrap_or_default();
    if privileges.is_empty() {
        return Check::new(
            name,
            Verdict::Warn,
            format!(
                "unknown: the server listed no privileges for {} (roles: {}); compare them with \
                 the smallest role (docs/src/operations/role.md)",
                users.join(", "),
                names(&info, "authenticatedUserRoles", "role").join(", ")
            ),
        );
    }
    let database = &config.mongodb.database;
    let missing: Vec<String> = needed(config)
        .into_iter()
        .filter(|n| !granted(&privileges, database, &n.collection, n.action))
        .map(|n| format!("{} on {database}.{} ({})", n.action, n.collection, n.why))
        .collect();
    let setup = if config
        .collections
        .iter()
        .any(|s| s.events_collection.is_some())
    {
        "; `tallyd setup` needs createIndex on the events collections too (run it once as an \
         administrator)"
    } else {
        ""
    };
    if missing.is_empty() {
        Check::new(
            name,
            Verdict::Ok,
            format!(
                "{} holds every privilege the daemon needs (the smallest role (docs/src/operations/role.md)){setup}",
                users.join(", ")
            ),
        )
    } else {
        Check::new(
            name,
            Verdict::Fail,
            format!("{} lacks: {}", users.join(", "), missing.join("; ")),
        )
    }
}

/// `user@db` (or `role@db`) for each entry of `info[list]`.
fn names(info: &Document, list: &str, key: &str) -> Vec<String> {
    info.get_array(list)
        .map(|entries| {
            entries
                .iter()
                .filter_map(Bson::as_document)
                .map(|e| {
                    format!(
                        "{}@{}",
                        e.get_str(key).unwrap_or("?"),
                        e.get_str("db").unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether one of `privileges` grants `action` on `database.collection`:
/// a resource naming them (an empty name is any), or any resource.
fn granted(privileges: &[Document], database: &str, collection: &str, action: &str) -> bool {
    privileges.iter().any(|privilege| {
        let Ok(resource) = privilege.get_document("resource") else {
            return false;
        };
        let matches = |key: &str, wanted: &str| {
            resource
                .get_str(key)
                .is_ok_and(|value| value.is_empty() || value == wanted)
        };
        let on_it = resource.get_bool("anyResource").unwrap_or(false)
            || (matches("db", database) && matches("collection", collection));
        let actions = privilege
            .get_array("actions")
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        on_it
            && actions
                .iter()
                .any(|a| a.as_str().is_some_and(|a| a == action || a == "anyAction"))
    })
}

#[cfg(test)]
mod tests {
    use mongodb::options::IndexOptions;

    use super::*;

    fn privilege(db: &str, collection: &str, actions: &[&str]) -> Document {
        doc! { "resource": { "db": db, "collection": collection }, "actions": actions }
    }

    #[test]
    fn a_privilege_covers_its_collection_its_whole_database_or_anything() {
        let own = [privilege("app", "views", &["find", "update"])];
        assert!(granted(&own, "app", "views", "find"));
        assert!(!granted(&own, "app", "views", "changeStream"));
        assert!(!granted(&own, "app", "clicks", "find"));
        assert!(!granted(&own, "other", "views", "find"));
        let database = [privilege("app", "", &["changeStream"])];
        assert!(granted(&database, "app", "clicks", "changeStream"));
        let everything = [doc! { "resource": { "anyResource": true }, "actions": ["anyAction"] }];
        assert!(granted(&everything, "app", "views", "remove"));
        let any_db = [privilege("", "", &["find"])];
        assert!(granted(&any_db, "x", "y", "find"));
    }

    /// The actions `config` needs, as `collection: action action …`.
    fn needed_of(config: &str) -> Vec<String> {
        let config = Config::from_toml(config, []).expect("a valid configuration");
        let mut by_collection: Vec<(String, Vec<&str>)> = Vec::new();
        for n in needed(&config) {
            match by_collection.iter_mut().find(|(c, _)| *c == n.collection) {
                Some((_, actions)) => actions.push(n.action),
                None => by_collection.push((n.collection, vec![n.action])),
            }
        }
        by_collection
            .into_iter()
            .map(|(c, actions)| format!("{c}: {}", actions.join(" ")))
            .collect()
    }

    /// The smallest role in the book (docs/src/operations/role.md): without a ledger, nothing on an events
    /// collection; with one, what the fold does there and in its state,
    /// and insert on the counters.
    #[test]
    fn the_ledgers_collections_are_in_the_role_a_configuration_needs() {
        let head = "[mongodb]\nuri = \"mongodb://h/\"\ndatabase = \"app\"\n";
        let plain = format!("{head}[[collections]]\nname = \"views\"\n");
        assert_eq!(
            needed_of(&plain),
            [
                "views: find update changeStream",
                "tally_state: find insert update remove",
            ]
        );
        let ledger = format!(
            "{head}[monitor]\nenabled = false\n[[collections]]\nname = \"views\"\n\
             events_collection = \"log\"\n"
        );
        assert_eq!(
            needed_of(&ledger),
            [
                "views: find update insert",
                "log: find remove changeStream",
                "log_fold: find insert update remove",
                "tally_state: find insert update remove",
            ]
        );
    }

    fn index(keys: Document, options: Option<IndexOptions>) -> IndexModel {
        IndexModel::builder().keys(keys).options(options).build()
    }

    fn sparse(field: &str) -> IndexModel {
        let options = IndexOptions::builder()
            .sparse(true)
            .name(format!("{field}_sparse"))
            .build();
        index(doc! { field: 1 }, Some(options))
    }

    #[test]
    fn the_pending_and_settled_fields_want_a_sparse_or_partial_index_that_starts_with_them() {
        let spec = CollectionConfig::new("views");
        let id = index(doc! { "_id": 1 }, None);
        let (verdict, message) = judge_indexes(&spec, std::slice::from_ref(&id));
        assert_eq!(verdict, Verdict::Warn, "{message}");
        assert!(
            message.contains("no index on pending, settled"),
            "{message}"
        );

        let (verdict, message) = judge_indexes(&spec, &[id.clone(), sparse("pending")]);
        assert_eq!(verdict, Verdict::Warn, "{message}");
        assert!(message.contains("no index on settled"), "{message}");

        let dense = index(doc! { "pending": 1 }, None);
        let (verdict, message) = judge_indexes(&spec, &[dense.clone(), sparse("settled")]);
        assert_eq!(verdict, Verdict::Warn, "{message}");
        assert!(message.contains("not sparse"), "{message}");

        let both = [id.clone(), dense, sparse("pending"), sparse("settled")];
        let (verdict, message) = judge_indexes(&spec, &both);
        assert_eq!(verdict, Verdict::Ok, "{message}");
        assert!(message.contains("pending_sparse on pending"), "{message}");

        let partial = IndexOptions::builder()
            .partial_filter_expression(doc! { "pending": { "$exists": true } })
            .build();
        let partial = index(doc! { "pending": 1, "_id": 1 }, Some(partial));
        assert_eq!(
            judge_indexes(&spec, &[partial, sparse("settled")]).0,
            Verdict::Ok
        );

        let second = index(doc! { "other": 1, "pending": 1 }, None);
        assert_eq!(
            judge_indexes(&spec, &[id, second, sparse("settled")]).0,
            Verdict::Warn
        );
    }

    #[test]
    fn a_bucketed_collection_wants_its_index_by_key_and_bucket() {
        let days = crate::bucket::Buckets::utc(crate::bucket::BucketWidth::Day);
        let spec = CollectionConfig::new("views").with_buckets(days);
        let sparse_ones = [sparse("pending"), sparse("settled")];
        let (verdict, message) = judge_indexes(&spec, &sparse_ones);
        assert_eq!(verdict, Verdict::Warn, "{message}");
        assert!(
            message.starts_with("no index tally_counters_bucket"),
            "{message}"
        );
        let (verdict, message) = judge_indexes(&spec, &sparse_ones[..1]);
        assert_eq!(verdict, Verdict::Warn, "{message}");
        assert!(
            message.contains("no index on settled") && message.contains("tally_counters_bucket"),
            "{message}"
        );
        let bucket = index(doc! { "_id.k": 1, "_id.t": 1 }, None);
        let all = [sparse("pending"), sparse("settled"), bucket];
        assert_eq!(judge_indexes(&spec, &all).0, Verdict::Ok);
        // Without buckets the index is not asked for.
        assert_eq!(
            judge_indexes(&CollectionConfig::new("views"), &sparse_ones).0,
            Verdict::Ok
        );
    }
}
