//! `tallyd doctor`: connects with the configured URI and says, check by
//! check, what is safe and what is not — the deployment's topology and
//! version, the write concern, this host's clock against the server's, the
//! indexes, the connected user's privileges, the change-stream history.
//!
//! Each [`Check`] has a name, a [`Verdict`] and one sentence saying what
//! was found and what it costs. `ok` is safe; `warn` is safe but worth a
//! look (or could not be told: "unknown"); `fail` is a deployment on which
//! tally cannot keep a promise. The exit status is 0 without a `fail`
//! (warnings allowed), 1 with one — and, when the server cannot be used at
//! all, the class's: 69 unreachable, 77 authentication refused.
//!
//! Everything is read, except one probe document that the write-concern
//! check writes to the state collection and removes at once — only in a
//! database that holds a configured collection already: a probe must never
//! create a database (a misspelt `[mongodb] database` is reported instead).

mod access;
mod api;
mod cluster;
mod deployment;
mod ledger;
pub(crate) mod sharding;

use crate::cli::out;
use crate::error::counted;
use std::process::ExitCode;

use clap::Args;
use mongodb::bson::{Document, doc};
use serde::Serialize;

use super::{EXIT_FAILED, EXIT_OK, database, exit_code_for};
use crate::config::Config;
use crate::daemon::clock::{self, Clock, Skew, SkewLevel};
use crate::error::{code, words};
use crate::store::Store;
use deployment::Topology;

/// `tallyd doctor`.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object instead of a list.
    #[arg(long)]
    pub(crate) json: bool,
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Verdict {
    /// Safe.
    Ok,
    /// Safe, but worth a look; or the check could not tell ("unknown").
    Warn,
    /// tally cannot keep a promise on this deployment as it is.
    Fail,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Check {
    /// `connection`, `server`, `write_concern`, `clock_skew`, `indexes`,
    /// `ledger_indexes`, `bucket_indexes`, `unfolded_events`, `ledger_fold`,
    /// `ledger_leftovers`, `privileges`, `change_stream_history`,
    /// `fold_outage`, and with `[api]` `api` and `api_tls`; on a sharded
    /// cluster also `shards`,
    /// `shard_key`, `shard_indexes`, `mongos_clocks` and `migration_pause`.
    pub(crate) name: &'static str,
    /// The collection an `indexes` (`ledger_indexes`, `unfolded_events`,
    /// `shard_indexes`: events; `shard_key`: any configured) check is
    /// about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) collection: Option<String>,
    /// How it came out.
    pub(crate) verdict: Verdict,
    /// What was found and what it costs, in one sentence.
    pub(crate) message: String,
}

impl Check {
    fn new(name: &'static str, verdict: Verdict, message: impl Into<String>) -> Self {
        Self {
            name,
            collection: None,
            verdict,
            message: message.into(),
        }
    }
}

/// What `--json` prints.
#[derive(Serialize)]
struct Report<'a> {
    /// Where doctor connected: hosts, user, database.
    server: serde_json::Value,
    /// No check failed.
    ok: bool,
    /// Every check, in order.
    checks: &'a [Check],
}

/// Runs every check and prints them; exit 1 when any failed (69 or 77 when
/// the server cannot be used at all).
pub(super) async fn run(args: DoctorArgs, config: &Config, clock: Clock) -> ExitCode {
    let secrets = config.secrets();
    let store = match super::connect(config, args.json).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let (mut checks, exit) = examine(&store, config, clock).await;
    for check in &mut checks {
        check.message = secrets.scrub(&check.message);
    }
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    let warned = checks.iter().filter(|c| c.verdict == Verdict::Warn).count();
    if args.json {
        let report = Report {
            server: database::described_json(&store),
            ok: failed == 0,
            checks: &checks,
        };
        out!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        out!("{}", database::described(&store));
        print_checks(&checks);
        out!(
            "{}: {} ok, {warned} warn, {failed} fail",
            counted(checks.len() as u64, "check", "checks"),
            checks.len() - warned - failed
        );
    }
    store.shutdown().await;
    ExitCode::from(match exit {
        Some(code) => code,
        None if failed == 0 => EXIT_OK,
        None => EXIT_FAILED,
    })
}

/// Every check, in order; only `connection` when the server cannot be
/// used, with the exit code of its class.
async fn examine(store: &Store, config: &Config, clock: Clock) -> (Vec<Check>, Option<u8>) {
    let hello = match store.hello().await {
        Ok(hello) => hello,
        Err(err) => {
            let message = format!("[mongodb] uri: {}", store.explain(&err));
            let check = Check::new("connection", Verdict::Fail, message);
            return (vec![check], Some(exit_code_for(&err)));
        }
    };
    let topology = Topology::read(&hello, config);
    let (held, presence) = database_check(store, config).await;
    let mut checks = vec![
        deployment::server(store, &hello, &topology, config).await,
        presence,
        deployment::write_concern(store, &topology, config, held).await,
        clock_skew(store, config, clock).await,
    ];
    let mut indexes = index_checks(store, config).await;
    if !held {
        // A fresh deployment, or a misspelt name: setup creates what it
        // names, so the name comes first.
        let database = store.database().name().to_owned();
        for check in indexes
            .iter_mut()
            .filter(|c| c.message.contains("tallyd setup"))
        {
            check.message.push_str(&format!(
                " — but first check [mongodb] database: {database} holds none of the configured \
                 collections, and setup would create it as named"
            ));
        }
    }
    checks.extend(indexes);
    let now = store
        .server_time()
        .await
        .unwrap_or_else(|_| std::time::SystemTime::now());
    checks.extend(ledger::unfolded_elsewhere(store, config, now).await);
    checks.extend(ledger::folds(store, config, now).await);
    checks.push(access::privileges(store, config).await);
    let (history, window) = deployment::history(store, &topology).await;
    checks.push(history);
    checks.extend(ledger::fold_outage(config, window));
    checks.extend(api::checks(config));
    if sharding::is_mongos(&hello) {
        checks.extend(cluster::checks(store, config, &hello, clock).await);
    }
    (checks, None)
}

/// Whether the configured database holds the configured collections: the
/// `database` check, and whether the database exists to be probed (`false`
/// when it holds none of them: a probe write would create it).
async fn database_check(store: &Store, config: &Config) -> (bool, Check) {
    let names: Vec<String> = config.collections.iter().map(|c| c.name.clone()).collect();
    let mut wanted = names.clone();
    wanted.extend(ledgers(config).map(|c| c.events_collection_name()));
    wanted.push(config.daemon.state_collection.clone());
    let name = store.database().name().to_owned();
    let (held, verdict, message) = match database::existing(store, &wanted).await {
        // Nothing unsafe, and a fresh deployment looks the same as a
        // misspelt name: a warning that says both.
        Ok(Some(existing)) if existing.is_empty() => {
            (false, Verdict::Warn, database::holds_none(store, &names))
        }
        Ok(Some(existing)) => {
            let (held, absent): (Vec<&String>, Vec<&String>) =
                names.iter().partition(|n| existing.contains(n));
            match (held.as_slice(), absent.as_slice()) {
                (_, []) => (true, Verdict::Ok, format!("{name} holds {}", words(&held))),
                // Only the ledgers' events or the daemon's state so far.
                ([], _) => (
                    true,
                    Verdict::Ok,
                    format!(
                        "{name} holds {}; the counter collections come with the first writes",
                        words(&existing)
                    ),
                ),
                _ => (
                    true,
                    Verdict::Warn,
                    format!(
                        "{name} holds {} but not yet {} (the first write creates a collection)",
                        words(&held),
                        words(&absent)
                    ),
                ),
            }
        }
        Ok(None) => (
            true,
            Verdict::Warn,
            format!(
                "unknown: this user may not list the collections of {name} (listCollections); \
                 a misspelt [mongodb] database shows as missing privileges below"
            ),
        ),
        Err(err) => (
            true,
            Verdict::Warn,
            format!(
                "unknown: cannot list the collections of {name}: {}",
                store.explain(&err)
            ),
        ),
    };
    (held, Check::new("database", verdict, message))
}

/// The index checks (also `check-config --connect`'s): each collection's
/// advised sparse indexes, each ledger's needed ones.
pub(super) async fn index_checks(store: &Store, config: &Config) -> Vec<Check> {
    let mut checks = access::indexes(store, config).await;
    checks.extend(access::ledger_indexes(store, config).await);
    checks.extend(access::bucket_indexes(store, config).await);
    checks
}

/// `check-config --connect`: connects (exit 69 or 77 by the class of a
/// failure, 78 for a URI that cannot be used), then the index checks,
/// printed; exit 1 when one failed.
pub(super) async fn check_indexes(config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let store = match super::connect(config, false).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    if let Err(err) = store.hello().await {
        eprintln!(
            "error: cannot connect: {}",
            secrets.scrub(&store.explain(&err))
        );
        store.shutdown().await;
        return ExitCode::from(exit_code_for(&err));
    }
    let mut checks = index_checks(&store, config).await;
    store.shutdown().await;
    for check in &mut checks {
        check.message = secrets.scrub(&check.message);
    }
    print_checks(&checks);
    let failed = checks.iter().any(|c| c.verdict == Verdict::Fail);
    ExitCode::from(if failed { EXIT_FAILED } else { EXIT_OK })
}

/// The configured collections with a ledger.
fn ledgers(config: &Config) -> impl Iterator<Item = &crate::write::counter::CollectionConfig> {
    config
        .collections
        .iter()
        .filter(|c| c.events_collection.is_some())
}

/// Prints checks one a line, with their verdicts.
pub(super) fn print_checks(checks: &[Check]) {
    for check in checks {
        let name = match &check.collection {
            Some(collection) => format!("{} ({collection})", check.name),
            None => check.name.to_owned(),
        };
        out!("{:<5} {name}: {}", check.verdict.as_str(), check.message);
    }
}

/// How many `hello`s the clock check sends; the one with the shortest
/// round trip is kept.
const CLOCK_SAMPLES: usize = 3;

/// This host's clock against the server's, judged against the tightest
/// margin the configuration leaves (the rule of `daemon::clock`).
async fn clock_skew(store: &Store, config: &Config, clock: Clock) -> Check {
    let admin = store.client().database("admin");
    let skew = match sample_skew(store, &admin, clock).await {
        Ok(Some(skew)) => skew,
        Ok(None) => {
            return Check::new(
                "clock_skew",
                Verdict::Warn,
                "unknown: the server's hello gave no localTime, so this host's clock could not \
                 be compared with the server's",
            );
        }
        Err(err) => {
            return Check::new(
                "clock_skew",
                Verdict::Warn,
                format!(
                    "unknown: the server did not answer hello, so this host's clock could not \
                     be compared with the server's: {}",
                    store.describe(&err)
                ),
            );
        }
    };
    let (tightest, margin) = tightest_margin(config);
    let found = format!(
        "{}; the collection {} leaves {margin} for writers' clocks behind the server's ({})",
        skew.describe(),
        tightest.collection,
        tightest.made_of
    );
    let (verdict, cost) = skew_cost(clock::judge(skew.worst_case(), tightest.margin));
    Check::new("clock_skew", verdict, format!("{found}: {cost}"))
}

/// The tightest margin the configuration leaves, and it shown.
fn tightest_margin(config: &Config) -> (clock::Margin, String) {
    let tightest = clock::margins(config).swap_remove(0);
    let shown = humantime::format_duration(tightest.margin).to_string();
    (tightest, shown)
}

/// The best of [`CLOCK_SAMPLES`] `hello`s to `admin` (of `store`'s client
/// or another's): the one with the shortest round trip; `None` when no
/// reply gave a `localTime`. A failed `hello` ends the sampling (a server
/// that does not answer is not waited for three times): the error, when
/// nothing was measured before it.
async fn sample_skew(
    store: &Store,
    admin: &mongodb::Database,
    clock: Clock,
) -> Result<Option<Skew>, mongodb::error::Error> {
    let mut best: Option<Skew> = None;
    for _ in 0..CLOCK_SAMPLES {
        let sent = clock.now();
        let reply = store.attempt(admin.run_command(doc! { "hello": 1 })).await;
        let received = clock.now();
        let reply = match reply {
            Ok(reply) => reply,
            Err(err) if best.is_none() => return Err(err),
            Err(_) => break,
        };
        if let Some(skew) = Skew::from_hello(sent, received, &reply)
            && best.is_none_or(|b| skew.round_trip < b.round_trip)
        {
            best = Some(skew);
        }
    }
    Ok(best)
}

/// The verdict on a skew of this level, and what it costs.
fn skew_cost(level: SkewLevel) -> (Verdict, &'static str) {
    match level {
        SkewLevel::Safe => (Verdict::Ok, "the skew uses at most a quarter of it"),
        SkewLevel::Watch => (
            Verdict::Warn,
            "the skew uses more than a quarter of it — counts stay exact, but find out why (is \
             NTP running here and on the servers?) before it grows",
        ),
        SkewLevel::Unsafe => (
            Verdict::Fail,
            "the skew uses more than half of it — a writer whose clock is this far behind could \
             have a token folded before its last retry lands, counting it twice; fix the clocks \
             (NTP), or raise [reconcile] grace",
        ),
    }
}

/// Runs a command on the admin database, bounded by the attempt timeout.
async fn run_admin(store: &Store, command: Document) -> Result<Document, mongodb::error::Error> {
    let admin = store.client().database("admin");
    store.attempt(admin.run_command(command)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_order_ok_warn_fail_and_serialize_lowercase() {
        assert!(Verdict::Ok < Verdict::Warn && Verdict::Warn < Verdict::Fail);
        let check = Check::new("server", Verdict::Warn, "one member");
        assert_eq!(
            serde_json::to_value(&check).unwrap(),
            serde_json::json!({ "name": "server", "verdict": "warn", "message": "one member" })
        );
    }
}
