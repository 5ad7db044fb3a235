//! A sharded cluster: `tallyd doctor` judges each configured collection's
//! shard key (counters, events, fold state, daemon state, sequences; every
//! case: unsharded, `_id` hashed, `_id` ranged, another key), lists the
//! shards, checks the ledgers' indexes on every shard and the clock of
//! every mongos; `tallyd run` refuses to start (78) on a key that fails.
//!
//! Against the test server the cluster is a mock: two black-pipe proxies
//! in front of it are its mongos — they add `msg: "isdbgrid"` to every
//! `hello` (the server's other fields kept) and answer `listShards`,
//! `getParameter`, `checkMetadataConsistency`, `getClusterParameter` and
//! the `find` on `config.collections` with crafted replies. Against a real
//! mongos (`TALLY_TEST_MONGODB_URI`) the collections are sharded for real
//! and no mock stands between.

use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};

use crate::cli::{tallyd, write_config};
use crate::common::proxy::{Action, Proxy, Rule, RuleGuard, upstream_of};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, base_uri, external};
use crate::doctor::{doctor, verdict};

/// Three counter collections; `views` and `clicks` with a ledger (so
/// `views_events`, `views_events_fold`, ...), `downloads` with one too.
const COLLECTIONS: &str = "[[collections]]\nname = \"views\"\nledger = true\n\
     [[collections]]\nname = \"downloads\"\nledger = true\n\
     [[collections]]\nname = \"clicks\"\nledger = true\n";

/// A cluster whose configured collections have the given shard keys.
struct Cluster {
    ctx: TestContext,
    /// The mock's two mongos; none on a real cluster.
    mongos: Vec<Proxy>,
    _rules: Vec<RuleGuard>,
}

/// Whether the test URI reaches a real mongos.
async fn real_mongos() -> bool {
    if !external() {
        return false;
    }
    let ctx = TestContext::new("sharding_probe").await;
    let hello = ctx
        .client(false)
        .await
        .client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .expect("hello on the test server");
    hello.get_str("msg").is_ok_and(|m| m == "isdbgrid")
}

impl Cluster {
    /// `keys`: collection and shard key; `tracked`: collections that the
    /// mock's `config.collections` lists as MongoDB 8.0 lists unsharded
    /// ones (`unsplittable`); `inconsistent`: the mock's
    /// `checkMetadataConsistency` finds an index missing on a shard.
    async fn new(
        name: &str,
        keys: &[(&str, Document)],
        tracked: &[&str],
        inconsistent: bool,
    ) -> Self {
        let ctx = TestContext::new(name).await;
        if real_mongos().await {
            let admin = ctx.client(false).await.client.database("admin");
            // Before 6.0 a database must be enabled first; later ones
            // accept it and do nothing.
            let _ = admin
                .run_command(doc! { "enableSharding": &ctx.db_name })
                .await;
            for (collection, key) in keys {
                let ns = format!("{}.{collection}", ctx.db_name);
                admin
                    .run_command(doc! { "shardCollection": &ns, "key": key.clone() })
                    .await
                    .unwrap_or_else(|err| panic!("shardCollection {ns}: {err}"));
            }
            return Self {
                ctx,
                mongos: Vec::new(),
                _rules: Vec::new(),
            };
        }
        let upstream = upstream_of(&base_uri()).await;
        let mut entries: Vec<Bson> = keys
            .iter()
            .map(|(collection, key)| {
                Bson::Document(doc! {
                    "_id": format!("{}.{collection}", ctx.db_name),
                    "key": key.clone(),
                    "unique": false,
                })
            })
            .collect();
        entries.extend(tracked.iter().map(|collection| {
            Bson::Document(doc! {
                "_id": format!("{}.{collection}", ctx.db_name),
                "key": { "_id": 1 },
                "unsplittable": true,
            })
        }));
        let found: Vec<Bson> = if inconsistent {
            vec![Bson::Document(doc! {
                "type": "InconsistentIndex",
                "description": "Found an index of a sharded collection that is inconsistent \
                                between different shards",
                "details": { "namespace": format!("{}.views_events", ctx.db_name) },
            })]
        } else {
            Vec::new()
        };
        let mut mongos = Vec::new();
        let mut rules = Vec::new();
        for _ in 0..2 {
            let proxy = Proxy::start(&upstream).await;
            let isdbgrid = doc! { "msg": "isdbgrid" };
            let answers = [
                Rule::command("isMaster").then(Action::AmendReply(isdbgrid.clone())),
                Rule::command("hello").then(Action::AmendReply(isdbgrid)),
                Rule::command("listShards").then(Action::Answer(doc! { "shards": [
                    { "_id": "shard0", "host": "rs0/db1.example:27018", "state": 1 },
                    { "_id": "shard1", "host": "rs1/db2.example:27018", "state": 1 },
                ] })),
                Rule::command("getParameter")
                    .mentions("featureCompatibilityVersion")
                    .then(Action::Answer(
                        doc! { "featureCompatibilityVersion": { "version": "8.0" } },
                    )),
                Rule::command("checkMetadataConsistency").then(Action::Answer(doc! {
                    "cursor": { "id": 0i64, "ns": "admin.$cmd", "firstBatch": found.clone() },
                })),
                Rule::command("getClusterParameter").then(Action::Answer(doc! {
                    "clusterParameters": [
                        { "_id": "pauseMigrationsDuringMultiUpdates", "enabled": false },
                    ],
                })),
                Rule::command("find")
                    .collection("collections")
                    .database("config")
                    .then(Action::Answer(doc! {
                        "cursor": {
                            "id": 0i64,
                            "ns": "config.collections",
                            "firstBatch": entries.clone(),
                        },
                    })),
            ];
            rules.extend(answers.into_iter().map(|rule| proxy.rule(rule)));
            mongos.push(proxy);
        }
        Self {
            ctx,
            mongos,
            _rules: rules,
        }
    }

    /// The URI `tallyd` uses: the test URI on a real cluster, else both
    /// mock mongos as the seed list.
    fn uri(&self) -> String {
        match self.mongos.as_slice() {
            [first, second] => self.ctx.child_uri_through(first, false).replace(
                &format!("{}/?directConnection=true", first.address()),
                &format!(
                    "{},{}/?directConnection=false",
                    first.address(),
                    second.address()
                ),
            ),
            _ => self.ctx.child_uri(false),
        }
    }

    /// The configuration, with `[daemon] state_collection = state`.
    fn config(&self, state: &str) -> String {
        self.config_on(&self.uri(), state)
    }

    /// The configuration on `uri`.
    fn config_on(&self, uri: &str, state: &str) -> String {
        format!(
            "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"5s\"\n\
             [daemon]\nstate_collection = \"{state}\"\n{COLLECTIONS}",
            self.ctx.db_name
        )
    }

    fn mocked(&self) -> bool {
        !self.mongos.is_empty()
    }

    /// `tallyd setup`: the ledgers' indexes (through mongos on a real
    /// cluster, directly on the test server under the mock).
    async fn setup(&self) {
        let direct = self.config_on(&self.ctx.child_uri(false), "tally_state");
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), &direct);
        let output = tallyd(&["--config", &path, "setup"], &[]).await;
        assert!(output.status.success(), "{output:?}");
    }
}

/// The verdict of `shard_key` on each collection named.
fn assert_keys(
    checks: &std::collections::BTreeMap<String, serde_json::Value>,
    want: &[(&str, &str)],
) {
    for (collection, expected) in want {
        let (got, message) = verdict(checks, &format!("shard_key:{collection}"));
        assert_eq!(got, *expected, "{collection}: {message}");
    }
}

/// Keys that are safe: counters unsharded, on `_id` hashed and on `_id`
/// ranged pass; events unsharded pass, on `_id` (hashed or ranged) warn;
/// fold states (one tracked as MongoDB 8.0 tracks unsharded collections),
/// the daemon's state and the sequences unsharded pass. Doctor exits 0 and
/// lists the shards, the clock of each mongos, the ledgers' indexes on
/// every shard and the migration pause; `tallyd run` starts.
// Multi-threaded: the mock mongos answer while the test waits for the
// daemon's exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_keys_on_id_pass_and_the_daemon_starts() {
    let hashed = doc! { "_id": "hashed" };
    let ranged = doc! { "_id": 1 };
    let keys = [
        ("downloads", hashed.clone()),
        ("clicks", ranged.clone()),
        ("views_events", hashed),
        ("clicks_events", ranged),
        // For the reload below: a daemon state on another key.
        ("state_other", doc! { "owner": 1 }),
    ];
    let cluster = Cluster::new("shard_keys_pass", &keys, &["views_events_fold"], false).await;
    cluster.setup().await;
    let config = cluster.config("tally_state");
    let (code, checks, output) = doctor(&config, &[]).await;
    assert_keys(
        &checks,
        &[
            ("views", "ok"),
            ("downloads", "ok"),
            ("clicks", "ok"),
            ("views_events", "warn"),
            ("downloads_events", "ok"),
            ("clicks_events", "warn"),
            ("views_events_fold", "ok"),
            ("downloads_events_fold", "ok"),
            ("clicks_events_fold", "ok"),
            ("tally_state", "ok"),
            ("counters", "ok"),
        ],
    );
    let (_, message) = verdict(&checks, "shard_key:views_events");
    assert!(
        message.contains("sharded on {_id: \"hashed\"}"),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "sh.disableBalancing(\"{}.views_events\")",
            cluster.ctx.db_name
        )),
        "{message}"
    );
    let (clocks, message) = verdict(&checks, "mongos_clocks");
    assert_eq!(clocks, "ok", "{message}");
    if cluster.mocked() {
        for mongos in &cluster.mongos {
            let host = mongos.address().to_string();
            assert!(
                message.contains(&format!("{host}: this host's clock")),
                "{message}"
            );
        }
        let (shards, message) = verdict(&checks, "shards");
        assert_eq!(shards, "ok", "{message}");
        assert_eq!(
            message,
            "a sharded cluster of 2 shards: shard0 (rs0/db1.example:27018), shard1 \
             (rs1/db2.example:27018); feature compatibility version 8.0"
        );
        for events in ["views_events", "downloads_events", "clicks_events"] {
            let (indexes, message) = verdict(&checks, &format!("shard_indexes:{events}"));
            assert_eq!(indexes, "ok", "{message}");
        }
        let (pause, message) = verdict(&checks, "migration_pause");
        assert_eq!(pause, "warn", "{message}");
        assert!(
            message.contains("with views_events and clicks_events sharded:"),
            "{message}"
        );
        assert!(message.contains("{pauseMigrationsDuringMultiUpdates: {enabled: true}}"));
    } else {
        let (shards, message) = verdict(&checks, "shards");
        assert_eq!(shards, "ok", "{message}");
    }
    let (server, message) = verdict(&checks, "server");
    assert_eq!(server, "ok", "{message}");
    assert!(message.contains("a sharded cluster"), "{message}");
    assert_eq!(code, Some(0), "{output:?}");

    // Each mongos's clock is measured: with this host's 10 minutes behind
    // every one of them, the check fails and names each.
    let (code, checks, _) = doctor(&config, &["--clock-offset", "-10m"]).await;
    let (clocks, message) = verdict(&checks, "mongos_clocks");
    assert_eq!(clocks, "fail", "{message}");
    assert!(message.contains("more than half"), "{message}");
    for mongos in &cluster.mongos {
        let host = mongos.address().to_string();
        assert!(
            message.contains(&format!("{host}: this host's clock is ")),
            "{message}"
        );
    }
    let seeds = mongodb::options::ClientOptions::parse(cluster.uri())
        .await
        .unwrap()
        .hosts
        .len();
    assert_eq!(
        message.matches("behind the server's (±").count(),
        seeds,
        "{message}"
    );
    assert_eq!(code, Some(1));

    // A mongos of the seed list that does not answer is named, not
    // skipped: its clock may be off by any amount (mock only: a real
    // cluster's seed list is the test URI's).
    if let [first, second] = cluster.mongos.as_slice() {
        let dead = free_address();
        let both = format!("{},{}/", first.address(), second.address());
        let config = config.replace(&both, &format!("{},{dead}/", both.trim_end_matches('/')));
        let (code, checks, _) = doctor(&config, &[]).await;
        let (clocks, message) = verdict(&checks, "mongos_clocks");
        assert_eq!(clocks, "warn", "{message}");
        assert!(
            message.contains(&format!("{dead}: no answer (")),
            "{message}"
        );
        assert!(message.contains("may be off by any amount"), "{message}");
        assert_eq!(code, Some(0), "{checks:?}");
    }

    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;
    // A reload onto a shard key that would count twice is refused: the
    // daemon runs on with the configuration it has.
    daemon.rewrite_config(&cluster.config("state_other"));
    daemon.signal("HUP");
    daemon
        .wait_metric(
            "tally_config_reload_failures_total",
            1.0,
            Duration::from_secs(60),
        )
        .await;
    assert!(daemon.running(), "{}", daemon.log());
    assert_eq!(daemon.ready().await.as_deref(), Some("active"));
    let log = daemon.log();
    assert!(
        log.contains("state_other: the daemon's state"),
        "the refusal names the collection: {log}"
    );
    let status = daemon.terminate();
    assert!(status.success(), "{status:?}\n{}", daemon.log());
}

/// Keys that fail: a counter collection and an events collection on
/// another key, fold states on `_id` hashed, `_id` ranged and another key,
/// the daemon's state on `_id` hashed, `_id` ranged or another key, the
/// sequences on `_id`; a shard without an index (mock only). Each verdict
/// names the key and the command that fixes it; doctor exits 1; `tallyd
/// run` refuses to start (78), naming the collections and their keys.
// Multi-threaded: the mock mongos answer while the test waits for the
// daemon's exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_keys_that_would_double_count_fail_and_the_daemon_refuses_them() {
    let keys = [
        ("views", doc! { "tenant": 1 }),
        ("views_events", doc! { "tenant": 1, "_id": 1 }),
        ("downloads_events", doc! { "_id": 1 }),
        ("views_events_fold", doc! { "_id": "hashed" }),
        ("downloads_events_fold", doc! { "_id": 1 }),
        ("clicks_events_fold", doc! { "floor": 1 }),
        ("state_ranged", doc! { "_id": 1 }),
        ("state_hashed", doc! { "_id": "hashed" }),
        ("state_other", doc! { "owner": 1 }),
        ("counters", doc! { "_id": "hashed" }),
    ];
    let cluster = Cluster::new("shard_keys_fail", &keys, &[], true).await;
    let db = cluster.ctx.db_name.clone();
    for state in ["state_ranged", "state_hashed", "state_other"] {
        let (code, checks, _) = doctor(&cluster.config(state), &[]).await;
        let (got, message) = verdict(&checks, &format!("shard_key:{state}"));
        assert_eq!(got, "fail", "{message}");
        assert!(
            message.contains(&format!(
                "db.adminCommand({{unshardCollection: \"{db}.{state}\"}})"
            )),
            "{message}"
        );
        assert_eq!(code, Some(1));
    }
    let config = cluster.config("state_ranged");
    let (code, checks, output) = doctor(&config, &[]).await;
    assert_keys(
        &checks,
        &[
            ("views", "fail"),
            ("downloads", "ok"),
            ("views_events", "fail"),
            ("downloads_events", "warn"),
            ("clicks_events", "ok"),
            ("views_events_fold", "fail"),
            ("downloads_events_fold", "fail"),
            ("clicks_events_fold", "fail"),
            ("counters", "fail"),
        ],
    );
    let (_, message) = verdict(&checks, "shard_key:views");
    assert!(message.contains("sharded on {tenant: 1}"), "{message}");
    assert!(
        message.contains(&format!(
            "sh.shardCollection(\"{db}.views_new\", {{_id: \"hashed\"}})"
        )),
        "{message}"
    );
    assert!(message.contains("never reshardCollection"), "{message}");
    let (_, message) = verdict(&checks, "shard_key:views_events");
    assert!(
        message.contains("sharded on {tenant: 1, _id: 1}"),
        "{message}"
    );
    assert!(message.contains("counted twice"), "{message}");
    if cluster.mocked() {
        let (indexes, message) = verdict(&checks, "shard_indexes:views_events");
        assert_eq!(indexes, "fail", "{message}");
        assert!(
            message.contains("InconsistentIndex: Found an index"),
            "{message}"
        );
    }
    assert_eq!(code, Some(1), "{output:?}");
    let shown = format!("{output:?}");
    assert!(!shown.contains("Document("), "no Rust Debug text: {shown}");

    let mut daemon = Tallyd::start(&config, &[]);
    let status = daemon.wait(Duration::from_secs(60));
    let log = daemon.log();
    assert_eq!(status.code(), Some(78), "{log}");
    for named in [
        "views: a counter collection, sharded on {tenant: 1}",
        "views_events: a ledger's events collection, sharded on {tenant: 1, _id: 1}",
        "state_ranged: the daemon's state ([daemon] state_collection), sharded on {_id: 1}",
        "clicks_events_fold: a ledger's fold state, sharded on {floor: 1}",
    ] {
        assert!(log.contains(named), "{named}\n{log}");
    }
    assert!(
        !log.contains("downloads_events:"),
        "a warning is no refusal: {log}"
    );
}

/// Shard keys this user may not read (`find` on `config.collections`
/// refused): doctor says unknown and how to see them; the daemon starts,
/// saying in its log that it did not check them. Mock only: a real
/// cluster's test user can read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_keys_that_cannot_be_read_are_unknown_and_the_daemon_starts() {
    let cluster = Cluster::new("shard_keys_unread", &[], &[], false).await;
    if !cluster.mocked() {
        return;
    }
    let _refused: Vec<RuleGuard> = cluster
        .mongos
        .iter()
        .map(|mongos| {
            mongos.rule_first(
                Rule::command("find")
                    .collection("collections")
                    .database("config")
                    .then(Action::error(13, "Unauthorized", &[])),
            )
        })
        .collect();
    cluster.setup().await;
    let config = cluster.config("tally_state");
    let (code, checks, _) = doctor(&config, &[]).await;
    let (keys, message) = verdict(&checks, "shard_key");
    assert_eq!(keys, "warn", "{message}");
    assert!(
        message.starts_with("unknown: cannot read the shard keys from config.collections: "),
        "{message}"
    );
    assert!(message.contains("Unauthorized"), "{message}");
    assert!(message.contains("clusterMonitor"), "{message}");
    assert_eq!(code, Some(0), "{checks:?}");

    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;
    let status = daemon.terminate();
    let log = daemon.log();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(
        log.contains("starting without checking the shard keys (tallyd doctor checks them)"),
        "{log}"
    );
}
