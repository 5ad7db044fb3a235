//! The deployment as a whole: what kind of server it is, whether it
//! acknowledges majority writes, and how much change-stream history it
//! keeps.

use std::time::{Duration, Instant};

use humantime::format_duration;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::{Acknowledgment, ConnectionString};

use super::{Check, Verdict, code, ledgers, run_admin};
use crate::config::Config;
use crate::error::server_code;
use crate::store::Store;

/// The oldest MongoDB the fold works on: 4.2 (wire version 8) brought the
/// update pipelines it writes with.
const MIN_WIRE_VERSION: i32 = 8;

/// The oldest MongoDB a ledger's fold works on: 4.4 (wire version 9) labels
/// the change stream's errors it may resume after
/// (`ResumableChangeStreamError`), which the drivers' change-stream
/// specification resumes by, and gives every reply a high-water mark
/// (`postBatchResumeToken`) whose cluster time the fold reads.
const LEDGER_MIN_WIRE_VERSION: i32 = 9;

/// How long the majority-write probe may wait for replication.
const MAJORITY_WAIT: Duration = Duration::from_secs(5);

/// Less change-stream history than this is worth a warning: a routine
/// restart, an upgrade or a reboot can take that long, and a daemon down
/// for longer than the history rescans every collection.
const SHORT_HISTORY: Duration = Duration::from_secs(3600);

/// What kind of deployment the URI reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Topology {
    /// One server: no replica set.
    Standalone,
    /// A replica set, with its name and data-bearing members.
    ReplicaSet { name: String, members: usize },
    /// A sharded cluster, through `mongos`.
    Sharded,
    /// Behind a load balancer (`loadBalanced=true`): a sharded cluster or a
    /// serverless instance.
    LoadBalanced,
}

impl Topology {
    /// The topology a `hello` reply (and the URI) shows.
    pub(super) fn read(hello: &Document, config: &Config) -> Self {
        let load_balanced = ConnectionString::parse(config.mongodb.uri.expose())
            .ok()
            .and_then(|uri| uri.load_balanced)
            .unwrap_or(false);
        if load_balanced {
            return Topology::LoadBalanced;
        }
        if hello.get_str("msg").is_ok_and(|m| m == "isdbgrid") {
            return Topology::Sharded;
        }
        match hello.get_str("setName") {
            Ok(name) => {
                let count = |key: &str| hello.get_array(key).map_or(0, Vec::len);
                Topology::ReplicaSet {
                    name: name.to_owned(),
                    members: count("hosts") + count("passives"),
                }
            }
            Err(_) => Topology::Standalone,
        }
    }
}

/// The server's version and topology, and what they cost.
pub(super) async fn server(
    store: &Store,
    hello: &Document,
    topology: &Topology,
    config: &Config,
) -> Check {
    let version = match run_admin(store, doc! { "buildInfo": 1 }).await {
        Ok(info) => format!(
            "MongoDB {}",
            info.get_str("version").unwrap_or("(version unknown)")
        ),
        Err(_) => "MongoDB (version unknown)".to_owned(),
    };
    let wire = hello.get("maxWireVersion").and_then(Bson::as_i32);
    let ledgers: Vec<&str> = ledgers(config).map(|c| c.name.as_str()).collect();
    if !ledgers.is_empty() && wire.is_some_and(|w| w < LEDGER_MIN_WIRE_VERSION) {
        return Check::new(
            "server",
            Verdict::Fail,
            format!(
                "{version} is older than 4.4: the ledger's fold (of {}) follows the events \
                 collection's change stream, which older servers neither label the errors it may \
                 resume after on nor mark where it stands between events; upgrade the server",
                ledgers.join(", ")
            ),
        );
    }
    if wire.is_some_and(|w| w < MIN_WIRE_VERSION) {
        return Check::new(
            "server",
            Verdict::Fail,
            format!(
                "{version} is older than 4.2: the fold writes with update pipelines, which it \
                 does not have, so leftover tokens would never be folded; upgrade the server"
            ),
        );
    }
    match topology {
        Topology::ReplicaSet { name, members } if *members <= 1 => Check::new(
            "server",
            Verdict::Warn,
            format!(
                "{version}, replica set {name} with one data-bearing member: retryable writes \
                 and change streams work, but a majority is this one member — its disk is the \
                 only copy of every count, and there is no failover; add members"
            ),
        ),
        Topology::ReplicaSet { name, members } => Check::new(
            "server",
            Verdict::Ok,
            format!(
                "{version}, replica set {name} with {members} data-bearing members: retryable \
                 writes, change streams and majority write concern, as tally expects"
            ),
        ),
        Topology::Sharded | Topology::LoadBalanced => Check::new(
            "server",
            Verdict::Ok,
            format!(
                "{version}, a sharded cluster: retryable writes, change streams and majority \
                 write concern, as tally expects"
            ),
        ),
        Topology::Standalone => {
            let monitor = if config.monitor.enabled {
                "the daemon's monitor ([monitor] enabled) cannot watch the counters, so stuck \
                 tokens are seen only at each periodic scan and monitor_down fires"
            } else {
                "the daemon sees stuck tokens only at each periodic scan ([monitor] is off)"
            };
            Check::new(
                "server",
                if config.monitor.enabled {
                    Verdict::Fail
                } else {
                    Verdict::Warn
                },
                format!(
                    "{version}, a standalone server: no change streams — {monitor}; no retryable \
                     writes — tally retries a lost write once itself; and `majority` is this one \
                     server, whose disk is the only copy of every count; run a replica set (one \
                     member is enough for change streams)"
                ),
            )
        }
    }
}

/// What the URI asks for, and whether the deployment acknowledges a
/// majority write: one probe document inserted into the state collection
/// and removed, both with `w: majority`.
/// `held`: the database exists (holds a configured collection); a probe
/// into one that does not would create it, so none is sent then.
pub(super) async fn write_concern(
    store: &Store,
    topology: &Topology,
    config: &Config,
    held: bool,
) -> Check {
    let mut findings = vec![requested_concern(config, topology)];
    if held {
        findings.push(majority_probe(store, &config.daemon.state_collection).await);
    } else {
        findings.push((
            Verdict::Warn,
            "unknown whether majority writes are acknowledged: not probed, the database holds \
             none of the configured collections and a probe would create it (see database)"
                .to_owned(),
        ));
    }
    let verdict = findings
        .iter()
        .map(|(v, _)| *v)
        .max()
        .unwrap_or(Verdict::Ok);
    let message = findings
        .into_iter()
        .map(|(_, m)| m)
        .collect::<Vec<_>>()
        .join("; ");
    Check::new("write_concern", verdict, message)
}

/// The write concern the URI asks for, against tally's `majority`.
fn requested_concern(config: &Config, topology: &Topology) -> (Verdict, String) {
    let concern = ConnectionString::parse(config.mongodb.uri.expose())
        .ok()
        .and_then(|uri| uri.write_concern);
    let Some(concern) = concern else {
        return (
            Verdict::Ok,
            "the URI sets no write concern; tally's writes use majority".into(),
        );
    };
    let majority = match topology {
        Topology::ReplicaSet { members, .. } => *members / 2 + 1,
        _ => 1,
    };
    // w=1 is weaker even where it is a majority today (one member): the
    // set may grow, and writers on this URI would not follow.
    let weaker = match &concern.w {
        Some(Acknowledgment::Nodes(n)) => *n <= 1 || (*n as usize) < majority,
        _ => false,
    };
    let unjournaled = concern.journal == Some(false);
    if !weaker && !unjournaled {
        return (
            Verdict::Ok,
            "the URI's write concern is at least majority, as tally's writes use".into(),
        );
    }
    let asked = match (&concern.w, unjournaled) {
        (Some(Acknowledgment::Nodes(n)), false) => format!("w={n}"),
        (Some(Acknowledgment::Nodes(n)), true) => format!("w={n}, journal=false"),
        _ => "journal=false".to_owned(),
    };
    (
        Verdict::Warn,
        format!(
            "the URI asks for {asked}: tally overrides it for its own writes (majority), but \
             other writers using this URI are not protected — a write a failover rolls back \
             was acknowledged, and a count built on it is lost; remove it from the URI"
        ),
    )
}

/// Inserts and removes one document with `w: majority` and a short wait.
async fn majority_probe(store: &Store, state: &str) -> (Verdict, String) {
    let concern = doc! { "w": "majority", "wtimeout": MAJORITY_WAIT.as_millis() as i64 };
    let id = format!("tally-doctor-{}", ObjectId::new().to_hex());
    let insert = doc! {
        "insert": state,
        "documents": [{ "_id": &id, "note": "written by tallyd doctor and removed at once" }],
        "writeConcern": concern.clone(),
    };
    let delete = doc! {
        "delete": state,
        "deletes": [{ "q": { "_id": &id }, "limit": 1 }],
        "writeConcern": concern,
    };
    let database = store.database();
    let started = Instant::now();
    let mut outcome = store.attempt(database.run_command(insert)).await;
    if outcome
        .as_ref()
        .is_ok_and(|reply| !reply.contains_key("writeConcernError"))
    {
        outcome = store.attempt(database.run_command(delete)).await;
    }
    let took = started.elapsed();
    match outcome {
        Ok(reply) => match reply.get_document("writeConcernError") {
            Ok(wce) => (
                Verdict::Fail,
                format!(
                    "a majority write to {state} was not acknowledged within {} ({}): every \
                     tally write would wait and then fail — are enough data-bearing members up?",
                    format_duration(MAJORITY_WAIT),
                    wce.get_str("errmsg").unwrap_or("write concern error")
                ),
            ),
            Err(_) => (
                Verdict::Ok,
                format!(
                    "a majority write to {state} was acknowledged in {}",
                    format_duration(Duration::from_millis(took.as_millis() as u64))
                ),
            ),
        },
        Err(err) if server_code(&err) == Some(code::UNAUTHORIZED) => (
            Verdict::Warn,
            format!(
                "unknown whether the deployment acknowledges majority writes: this user may \
                 not insert into and remove from {state} (see privileges)"
            ),
        ),
        Err(err) => (
            Verdict::Fail,
            format!(
                "a majority write to {state} failed: {}",
                store.describe(&err)
            ),
        ),
    }
}

/// How long the daemon may be down and still resume its change streams:
/// the oplog's first and last entries.
pub(super) async fn history(store: &Store, topology: &Topology) -> (Check, Option<Duration>) {
    let name = "change_stream_history";
    let unknown = |message: String| (Check::new(name, Verdict::Warn, message), None);
    match topology {
        Topology::Standalone => {
            return unknown("none: a standalone server has no change streams (see server)".into());
        }
        Topology::Sharded | Topology::LoadBalanced => {
            return unknown(
                "unknown: each shard keeps its own oplog; run tallyd doctor against each \
                 shard's replica set to see how long its history reaches back"
                    .into(),
            );
        }
        Topology::ReplicaSet { .. } => {}
    }
    let (first, last) = match oplog_ends(store).await {
        Ok(Some(ends)) => ends,
        Ok(None) => return unknown("unknown: the oplog (local.oplog.rs) is empty".into()),
        Err(err) if server_code(&err) == Some(code::UNAUTHORIZED) => {
            return unknown(
                "unknown: this user may not read local.oplog.rs (find on the local database, \
                 e.g. the clusterMonitor role), so how long the daemon may be down without a \
                 rescan cannot be told"
                    .into(),
            );
        }
        Err(err) => {
            return unknown(format!(
                "unknown: cannot read the oplog (local.oplog.rs): {}",
                store.describe(&err)
            ));
        }
    };
    let window = Duration::from_secs(u64::from(last.saturating_sub(first)));
    let since = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + Duration::from_secs(u64::from(first)),
    );
    let shown = format_duration(window);
    let check = if window < SHORT_HISTORY {
        Check::new(
            name,
            Verdict::Warn,
            format!(
                "the oplog holds {shown} of history (since {since}): a daemon down longer than \
                 that (a restart, an upgrade, a reboot) starts with a full rescan of each \
                 collection — nothing is missed, but every document is read; an oplog that is \
                 not full yet holds less than it will"
            ),
        )
    } else {
        Check::new(
            name,
            Verdict::Ok,
            format!(
                "the daemon may be down {shown} without a rescan: the oplog's history reaches \
                 back to {since}"
            ),
        )
    };
    (check, Some(window))
}

/// The times (seconds) of the oplog's oldest and newest entries.
async fn oplog_ends(store: &Store) -> Result<Option<(u32, u32)>, mongodb::error::Error> {
    let local = store.client().database("local");
    let mut ends = Vec::new();
    for direction in [1, -1] {
        let command = doc! {
            "find": "oplog.rs",
            "sort": { "$natural": direction },
            "limit": 1,
            "projection": { "ts": 1 },
        };
        let reply = store.attempt(local.run_command(command)).await?;
        let time = reply
            .get_document("cursor")
            .ok()
            .and_then(|c| c.get_array("firstBatch").ok())
            .and_then(|batch| batch.first())
            .and_then(Bson::as_document)
            .and_then(|entry| entry.get_timestamp("ts").ok())
            .map(|ts| ts.time);
        match time {
            Some(time) => ends.push(time),
            None => return Ok(None),
        }
    }
    Ok(Some((ends[0], ends[1])))
}
