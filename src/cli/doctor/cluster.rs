//! The checks of a sharded cluster (the URI reaches a `mongos`): its shards
//! and feature compatibility version, each configured collection's shard
//! key ([`sharding`]), the ledgers' indexes on every shard, the clock of
//! every mongos of the seed list, and on MongoDB 8.0 whether migrations
//! pause for multi-document deletes.

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ClientOptions;

use super::sharding;
use super::{Check, Verdict, ledgers, run_admin, sample_skew, skew_cost, tightest_margin};
use crate::config::Config;
use crate::daemon::clock::{self, Clock, SkewLevel};
use crate::error::{Readable, server_code};
use crate::store::Store;

/// MongoDB 8.0's wire version: the first with the cluster parameter
/// `pauseMigrationsDuringMultiUpdates`.
const WIRE_VERSION_8_0: i32 = 25;

/// `CommandNotFound`: a server without the command (checkMetadataConsistency
/// before 7.0).
const COMMAND_NOT_FOUND: i32 = 59;

/// The cluster's checks, in order.
pub(super) async fn checks(
    store: &Store,
    config: &Config,
    hello: &Document,
    clock: Clock,
) -> Vec<Check> {
    let mut checks = vec![shards(store).await];
    let (keys, sharded_events) = sharding::checks(store, config).await;
    checks.extend(keys);
    checks.extend(shard_indexes(store, config).await);
    checks.push(mongos_clocks(store, config, clock).await);
    let wire = hello.get("maxWireVersion").and_then(Bson::as_i32);
    if wire.is_some_and(|w| w >= WIRE_VERSION_8_0) {
        checks.push(migration_pause(store, &sharded_events).await);
    }
    checks
}

/// `listShards` and the feature compatibility version.
async fn shards(store: &Store) -> Check {
    let fcv = match run_admin(
        store,
        doc! { "getParameter": 1, "featureCompatibilityVersion": 1 },
    )
    .await
    {
        Ok(reply) => match reply
            .get_document("featureCompatibilityVersion")
            .and_then(|f| f.get_str("version"))
        {
            Ok(version) => format!("feature compatibility version {version}"),
            Err(_) => "feature compatibility version not reported".to_owned(),
        },
        Err(err) => format!(
            "feature compatibility version unknown ({})",
            store.describe(&err)
        ),
    };
    let reply = match run_admin(store, doc! { "listShards": 1 }).await {
        Ok(reply) => reply,
        Err(err) => {
            return Check::new(
                "shards",
                Verdict::Warn,
                format!(
                    "unknown: cannot list the shards ({}); {fcv} — grant listShards (the \
                     clusterMonitor role) and run doctor again",
                    store.describe(&err)
                ),
            );
        }
    };
    let listed: Vec<String> = reply
        .get_array("shards")
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(Bson::as_document)
        .map(|shard| {
            format!(
                "{} ({})",
                shard.get_str("_id").unwrap_or("unnamed"),
                shard.get_str("host").unwrap_or("no host")
            )
        })
        .collect();
    let count = match listed.len() {
        1 => "1 shard".to_owned(),
        n => format!("{n} shards"),
    };
    Check::new(
        "shards",
        Verdict::Ok,
        format!("a sharded cluster of {count}: {}; {fcv}", listed.join(", ")),
    )
}

/// Per ledger: whether every shard holds the same indexes on its events
/// collection (`checkMetadataConsistency` with `checkIndexes`, MongoDB 7.0).
async fn shard_indexes(store: &Store, config: &Config) -> Vec<Check> {
    let database = store.database();
    let mut checks = Vec::new();
    for spec in ledgers(config) {
        let events = spec.events_collection_name();
        let command = doc! {
            "checkMetadataConsistency": 1,
            "coll": &events,
            "checkIndexes": true,
        };
        let (verdict, message) = match store.attempt(database.run_command(command)).await {
            Ok(reply) => inconsistencies(&reply),
            Err(err) if server_code(&err) == Some(COMMAND_NOT_FOUND) => (
                Verdict::Warn,
                format!(
                    "unknown: this server has no checkMetadataConsistency (MongoDB 7.0 and \
                     later), so whether every shard holds the ledger's indexes cannot be told \
                     here ({}); run tallyd doctor against each shard's replica set and read its \
                     ledger_indexes",
                    store.describe(&err)
                ),
            ),
            Err(err) => (
                Verdict::Warn,
                format!(
                    "unknown: checkMetadataConsistency failed: {}",
                    store.describe(&err)
                ),
            ),
        };
        checks.push(Check {
            collection: Some(events),
            ..Check::new("shard_indexes", verdict, message)
        });
    }
    checks
}

/// The verdict on a `checkMetadataConsistency` reply.
fn inconsistencies(reply: &Document) -> (Verdict, String) {
    let found: Vec<String> = reply
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(Bson::as_document)
        .map(|entry| {
            let kind = entry.get_str("type").unwrap_or("inconsistency");
            match entry.get_str("description") {
                Ok(description) => format!("{kind}: {description}"),
                Err(_) => kind.to_owned(),
            }
        })
        .collect();
    if found.is_empty() {
        return (
            Verdict::Ok,
            "every shard holds the same indexes (checkMetadataConsistency with checkIndexes \
             found nothing)"
                .to_owned(),
        );
    }
    (
        Verdict::Fail,
        format!(
            "the shards disagree ({}): a shard without the fold's indexes makes the daemon \
             refuse this ledger or read every event; run tallyd setup through mongos (it \
             creates the indexes on every shard) and doctor again",
            found.join("; ")
        ),
    )
}

/// The clock of every mongos of the seed list against this host's, each
/// asked directly, judged against the tightest margin.
async fn mongos_clocks(store: &Store, config: &Config, clock: Clock) -> Check {
    let name = "mongos_clocks";
    let options = match ClientOptions::parse(config.mongodb.uri.expose()).await {
        Ok(options) if options.load_balanced != Some(true) => options,
        Ok(_) => {
            return Check::new(
                name,
                Verdict::Warn,
                "unknown: behind a load balancer each mongos cannot be asked directly; check \
                 NTP on every mongos host",
            );
        }
        Err(err) => {
            return Check::new(
                name,
                Verdict::Warn,
                format!("unknown: {}", store.describe(&err)),
            );
        }
    };
    let (tightest, margin) = tightest_margin(config);
    // The worst verdict and its cost; hosts that could not be measured.
    let mut worst = skew_cost(SkewLevel::Safe);
    let mut found = Vec::new();
    let mut unmeasured = false;
    for host in &options.hosts {
        let mut direct = options.clone();
        direct.hosts = vec![host.clone()];
        direct.direct_connection = Some(true);
        direct.server_selection_timeout = Some(config.mongodb.server_selection_timeout);
        direct.app_name = Some(config.mongodb.app_name.clone());
        let skew = match Client::with_options(direct) {
            Ok(client) => {
                let skew = sample_skew(store, &client.database("admin"), clock).await;
                client.shutdown().await;
                skew
            }
            Err(err) => Err(err),
        };
        match skew {
            Ok(Some(skew)) => {
                let cost = skew_cost(clock::judge(skew.worst_case(), tightest.margin));
                if cost.0 > worst.0 {
                    worst = cost;
                }
                found.push(format!("{host}: {}", skew.describe()));
            }
            Ok(None) => {
                unmeasured = true;
                found.push(format!("{host}: its hello gave no localTime"));
            }
            Err(err) => {
                unmeasured = true;
                // The error as such: the store's hosts are not this one's.
                let readable = Readable {
                    err: &err,
                    reach: None,
                };
                found.push(format!("{host}: no answer ({readable})"));
            }
        }
    }
    let (mut verdict, cost) = worst;
    let mut cost = cost.to_owned();
    if unmeasured {
        verdict = verdict.max(Verdict::Warn);
        cost.push_str(
            "; a mongos that could not be measured may be off by any amount: check NTP on its host",
        );
    }
    Check::new(
        name,
        verdict,
        format!(
            "{}; the collection {} leaves {margin} for writers' clocks behind the server's ({}): \
             {cost}",
            found.join("; "),
            tightest.collection,
            tightest.made_of
        ),
    )
}

/// MongoDB 8.0's `pauseMigrationsDuringMultiUpdates`: whether the fold's
/// `deleteMany` of folded events can race a chunk migration.
async fn migration_pause(store: &Store, sharded_events: &[String]) -> Check {
    let name = "migration_pause";
    let command = doc! { "getClusterParameter": "pauseMigrationsDuringMultiUpdates" };
    let enabled = match run_admin(store, command).await {
        Ok(reply) => reply
            .get_array("clusterParameters")
            .ok()
            .and_then(|p| p.first())
            .and_then(Bson::as_document)
            .and_then(|p| p.get_bool("enabled").ok()),
        Err(err) => {
            return Check::new(
                name,
                Verdict::Warn,
                format!(
                    "unknown: cannot read the cluster parameter pauseMigrationsDuringMultiUpdates: {}",
                    store.describe(&err)
                ),
            );
        }
    };
    match (enabled, sharded_events) {
        (Some(true), _) => Check::new(
            name,
            Verdict::Ok,
            "pauseMigrationsDuringMultiUpdates is on: the fold's deleteMany of folded events \
             never races a chunk migration",
        ),
        (_, []) => Check::new(
            name,
            Verdict::Ok,
            "pauseMigrationsDuringMultiUpdates is off, and no configured events collection is \
             sharded, so no deleteMany of tally's races a chunk migration",
        ),
        (_, sharded) => Check::new(
            name,
            Verdict::Warn,
            format!(
                "pauseMigrationsDuringMultiUpdates is off (or not reported), with {} sharded: the \
                 fold's deleteMany of folded events can race a chunk migration and leave some \
                 behind; turn it on: db.adminCommand({{setClusterParameter: \
                 {{pauseMigrationsDuringMultiUpdates: {{enabled: true}}}}}})",
                crate::error::words(sharded)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inconsistent_indexes_fail_and_name_what_the_server_found() {
        let clean = doc! { "cursor": { "id": 0i64, "firstBatch": [] }, "ok": 1.0 };
        assert_eq!(inconsistencies(&clean).0, Verdict::Ok);
        let found = doc! {
            "cursor": { "id": 0i64, "firstBatch": [{
                "type": "InconsistentIndex",
                "description": "Found an index of a sharded collection that is inconsistent \
                                between different shards",
            }] },
            "ok": 1.0,
        };
        let (verdict, message) = inconsistencies(&found);
        assert_eq!(verdict, Verdict::Fail);
        assert!(
            message.contains("InconsistentIndex: Found an index"),
            "{message}"
        );
        assert!(message.contains("tallyd setup"), "{message}");
    }
}
