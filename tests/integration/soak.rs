//! The exactly-once soak: 16 writers × 150 increments (× the soak scale,
//! `TALLY_SOAK_SCALE`, default 1; 10 for a long run) through the
//! black-pipe proxy with ~10% of the `update`s on the counters faulted at
//! random (reply dropped, connection closed, reply delayed past the
//! timeout, not-primary), some writers "crashing" after step 1, the daemon
//! folding every second through the same faulty proxy, and the daemon
//! killed with SIGKILL and restarted once halfway.
//!
//! Ground truth is the proxy's log: an increment counts exactly when its
//! token's step 1 reached the server (the counters exist beforehand, so an
//! `$addToSet` that arrives always applies). At the end every counter must
//! equal its ground truth, every definite answer a writer got must agree
//! with it, and no token may be left. The seed is fixed (override with
//! `TALLY_SOAK_SEED`) and printed in every failure.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{CollectionConfig, Completion, Counters, Error, Increment, Token, WriterConfig};

use crate::common::proxy::{Action, Exchange, Proxy, Rule, upstream_of};
use crate::common::server::{ServerOptions, TestServer};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, external};
use crate::daemon::Conf;

const WRITERS: usize = 16;
/// Increments per writer at scale 1.
const INCREMENTS: usize = 150;
const KEYS: usize = 50;
/// Each of the four fault rules selects this share of the `update`s.
const FAULT_SHARE: f64 = 0.026;
/// Share of increments whose writer "crashes" right after step 1.
const CRASH_SHARE: f64 = 0.05;
const DEFAULT_SEED: u64 = 20_261_122;
/// The writers' bound on one attempt (it must exceed their server
/// selection timeout, [`SELECTION`], by a second); the delay fault holds
/// replies longer.
pub(crate) const ATTEMPT: Duration = Duration::from_secs(3);
pub(crate) const SELECTION: &str = "serverSelectionTimeoutMS=2000";
pub(crate) const DELAY: Duration = Duration::from_secs(4);
/// The writers' retry horizon, the same as the daemon's config says.
const RETRY_HORIZON: Duration = Duration::from_secs(6);
/// The whole soak must finish within this, at scale 1.
const BUDGET: Duration = Duration::from_secs(300);

/// How much longer than in CI a soak runs: `TALLY_SOAK_SCALE` (a number,
/// default 1), multiplying its work and its time budget. CI runs scale 1,
/// about a minute per soak; `TALLY_SOAK_SCALE=10 scripts/test soak` is the
/// long form.
pub(crate) fn soak_scale() -> f64 {
    match std::env::var("TALLY_SOAK_SCALE") {
        Ok(text) => match text.parse::<f64>() {
            Ok(scale) if scale.is_finite() && scale > 0.0 => scale,
            _ => panic!("TALLY_SOAK_SCALE must be a positive number, not {text:?}"),
        },
        Err(_) => 1.0,
    }
}

/// `n` at the soak scale (at least 1).
pub(crate) fn scaled(n: usize) -> usize {
    ((n as f64 * soak_scale()).round() as usize).max(1)
}

/// What a writer was told about one increment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Claim {
    /// Counted, or pending (then counted exactly once, by `complete` or the
    /// fold).
    Counted,
    /// Definitely not applied.
    NotCounted,
    /// `resume` refused past the retry horizon: counted at most once.
    AtMostOnce,
}

/// A soak's seed: `TALLY_SOAK_SEED`, else `default`; printed, so a failure
/// can be replayed.
pub(crate) fn seed(name: &str, default: u64) -> u64 {
    let seed = std::env::var("TALLY_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("{name} seed: {seed} (rerun with TALLY_SOAK_SEED={seed})");
    seed
}

/// What a soak runs on: its own server (its load must not slow the other
/// tests), the counters `k0…` of `views` created at 0, and a proxy that
/// gives each of `faults` to a seeded `share` of the `update`s on them.
pub(crate) struct Rig {
    _server: Option<TestServer>,
    pub(crate) ctx: TestContext,
    pub(crate) direct: Collection<Document>,
    pub(crate) keys: Vec<String>,
    pub(crate) proxy: Proxy,
    _rules: Vec<crate::common::proxy::RuleGuard>,
}

impl Rig {
    pub(crate) async fn start(
        name: &str,
        keys: usize,
        faults: &[Action],
        share: f64,
        seed: u64,
    ) -> Self {
        let rig = Self::without_counters(name, keys, faults, share, seed).await;
        rig.direct
            .insert_many(rig.keys.iter().map(|k| doc! { "_id": k, "counter": 0i64 }))
            .await
            .expect("create the counters");
        rig
    }

    /// [`Rig::start`] with no counter created: each write creates its
    /// document (a bucketed collection's, whose buckets come with time).
    pub(crate) async fn without_counters(
        name: &str,
        keys: usize,
        faults: &[Action],
        share: f64,
        seed: u64,
    ) -> Self {
        let server = (!external()).then(|| TestServer::start(&ServerOptions::default()));
        let ctx = match &server {
            Some(server) => TestContext::on(name, server.uri()).await,
            None => TestContext::new(name).await,
        };
        let direct = ctx.client(false).await.collection("views");
        let keys: Vec<String> = (0..keys).map(|k| format!("k{k}")).collect();
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let rules = faults
            .iter()
            .enumerate()
            .map(|(i, action)| {
                proxy.rule(
                    Rule::command("update")
                        .collection("views")
                        .probability(share, seed.wrapping_add(i as u64))
                        .then(action.clone()),
                )
            })
            .collect();
        Self {
            _server: server,
            ctx,
            direct,
            keys,
            proxy,
            _rules: rules,
        }
    }
}

/// After the writers: waits (90 s at most) until the daemon folded every
/// token of `direct`, stops it, and checks it exited cleanly with no panic
/// in its log (`earlier`: a killed predecessor's log, checked too), or —
/// with `late_save` — with the honest exit 1 of a stop that could not save
/// its change-stream position. Returns the whole log.
pub(crate) async fn fold_out_and_stop(
    direct: &Collection<Document>,
    daemon: &mut Tallyd,
    earlier: &str,
    seed: u64,
    late_save: bool,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let left = direct
            .count_documents(doc! { "pending.0": { "$exists": true } })
            .await
            .expect("count pending");
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {left} documents still hold tokens 90 s after the writers stopped\nlog:\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let exit = daemon.terminate();
    let logs = format!("{earlier}\n{}", daemon.log());
    let saved_late = late_save
        && exit.code() == Some(1)
        && logs.contains("stopped, but not saved or not finished: the change-stream position");
    assert!(
        exit.success() || saved_late,
        "seed {seed}: tallyd exited {exit:?}\n{logs}"
    );
    assert!(
        !logs.contains("panicked"),
        "seed {seed}: a panic in the daemon's log\n{logs}"
    );
    logs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_writers_through_random_faults_and_a_killed_daemon_count_exactly_once() {
    let seed = seed("soak", DEFAULT_SEED);
    let started = Instant::now();
    let faults = [
        Action::DropReply,
        Action::CloseBeforeForwarding,
        Action::DelayReply(DELAY),
        Action::error(10107, "NotWritablePrimary", &[]),
    ];
    let rig = Rig::start("soak", KEYS, &faults, FAULT_SHARE, seed).await;
    let (ctx, direct, keys, proxy) = (&rig.ctx, &rig.direct, &rig.keys, &rig.proxy);

    // Folds every second, grace 10 s, retry horizon 6 s (as the writers'),
    // more than the horizon plus the writers' 3 s attempts.
    let config = Conf::default().render(&ctx.child_uri_through(proxy, false), &ctx.db_name);
    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;

    let increments = scaled(INCREMENTS);
    let budget = BUDGET.mul_f64(soak_scale().max(1.0));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = ctx.client_through_with(proxy, false, SELECTION).await;
        let store = client.store().with_attempt_timeout(ATTEMPT);
        let keys = keys.clone();
        let done = done.clone();
        writers.push(tokio::spawn(async move {
            let counters = Counters::new(
                &store,
                CollectionConfig::new("views"),
                WriterConfig {
                    retry_horizon: RETRY_HORIZON,
                    ..WriterConfig::default()
                },
            );
            let raw = store.collection("views");
            let mut rng = fastrand::Rng::with_seed(seed ^ ((w as u64 + 1) << 32));
            let mut claims = Vec::with_capacity(increments);
            for i in 0..increments {
                let key = &keys[(w * 7 + i * 13) % keys.len()];
                if rng.f64() < CRASH_SHARE {
                    crash_after_step_1(&raw, key).await;
                } else {
                    claims.push(settle(&counters, key, &mut rng).await);
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            claims
        }));
    }

    // Halfway: SIGKILL the daemon (mid-fold, likely) and start another.
    let half = WRITERS * increments / 2;
    while done.load(std::sync::atomic::Ordering::Relaxed) < half {
        assert!(
            started.elapsed() < budget,
            "seed {seed}: writers stalled before halfway"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_log = {
        daemon.kill();
        daemon.log()
    };
    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;

    let mut claims: Vec<(String, Token, Claim)> = Vec::new();
    for writer in writers {
        claims.extend(writer.await.expect("a writer panicked"));
    }

    // Every token is folded once it is older than the grace. A stop that
    // comes while a fold's update is held by the delay fault may not save
    // the stream position: the daemon says so and exits 1 — an honest
    // report, not a count error (the next start resumes or rescans).
    fold_out_and_stop(direct, &mut daemon, &first_log, seed, true).await;

    // The ground truth from the proxy's log, against the counters and
    // against what the writers were told.
    let log = proxy.log();
    let truth = applied_step_1s(&log, seed);
    let finals = counters(direct).await;
    let mut wrong = Vec::new();
    for key in keys {
        let expected = truth.get(key).map_or(0, HashSet::len) as i64;
        let actual = finals.get(key).copied().unwrap_or(0);
        if actual != expected {
            wrong.push(format!("{key}: counter {actual}, ground truth {expected}"));
        }
    }
    let mut told = HashMap::new();
    for (key, token, claim) in &claims {
        let applied = truth
            .get(key)
            .is_some_and(|t| t.contains(&token.object_id()));
        *told.entry(*claim).or_insert(0usize) += 1;
        let agrees = match claim {
            Claim::Counted => applied,
            Claim::NotCounted => !applied,
            Claim::AtMostOnce => true,
        };
        if !agrees {
            wrong.push(format!(
                "{key}: token {token} was {claim:?}, but its step 1 {} the server",
                if applied { "reached" } else { "never reached" }
            ));
        }
    }
    let (faulted, updates) = faulted_updates(&log);
    eprintln!(
        "soak seed {seed}: {} increments, {updates} updates, {faulted} faulted; writers told {told:?}; {:.0?}",
        WRITERS * increments,
        started.elapsed()
    );
    assert!(
        wrong.is_empty(),
        "seed {seed}: {} mismatches:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert_faulted_in_time((faulted, updates), 0.05, started, budget, seed);
}

/// How many exchanges of `log` were faulted, and how many were `update`s.
pub(crate) fn faulted_updates(log: &[Exchange]) -> (usize, usize) {
    let faulted = log.iter().filter(|e| e.action.is_some()).count();
    let updates = log
        .iter()
        .filter(|e| e.command.as_deref() == Some("update"))
        .count();
    (faulted, updates)
}

/// Asserts that more than `least` of the `update`s were faulted
/// (`faulted` of `updates`), and that the soak begun at `started` took
/// less than `budget`.
pub(crate) fn assert_faulted_in_time(
    (faulted, updates): (usize, usize),
    least: f64,
    started: Instant,
    budget: Duration,
    seed: u64,
) {
    assert!(
        faulted as f64 > least * updates as f64,
        "seed {seed}: only {faulted} of {updates} updates were faulted"
    );
    assert!(
        started.elapsed() < budget,
        "seed {seed}: the soak took {:?}",
        started.elapsed()
    );
}

/// A writer that dies right after step 1: its token is left for the fold.
/// The write goes through the proxy and may itself be faulted; the log
/// says whether it arrived.
async fn crash_after_step_1(raw: &Collection<Document>, key: &str) {
    let token = ObjectId::new();
    let _ = raw
        .update_one(
            doc! { "_id": key },
            doc! { "$addToSet": { "pending": token } },
        )
        .await;
}

/// One increment, settled as an application would: `complete` half of the
/// pending ones (the fold gets the rest), `resume` the unknown ones.
pub(crate) async fn settle(
    counters: &Counters,
    key: &str,
    rng: &mut fastrand::Rng,
) -> (String, Token, Claim) {
    let outcome = counters.increment(key, 1).await;
    let (token, claim) = resolve(counters, outcome, rng).await;
    (key.to_owned(), token, claim)
}

/// Settles one increment's outcome as [`settle`] does; its token and what
/// the writer was told.
pub(crate) async fn resolve(
    counters: &Counters,
    mut outcome: Increment,
    rng: &mut fastrand::Rng,
) -> (Token, Claim) {
    let token = outcome.token().expect("a token");
    let mut lookups = 0;
    let claim = loop {
        match outcome {
            Increment::Counted(_) => break Claim::Counted,
            Increment::Pending(pending) => {
                if rng.bool() {
                    let _: Completion = counters.complete(pending).await;
                }
                break Claim::Counted;
            }
            Increment::NotCounted(_) => break Claim::NotCounted,
            // Still unknown after a few resumes (a read that keeps failing):
            // given up on, counted at most once.
            Increment::Unknown(_) if lookups >= 10 => break Claim::AtMostOnce,
            Increment::Unknown(unknown) => {
                if lookups > 0 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                lookups += 1;
                match counters.resume(unknown).await {
                    Ok(next) => outcome = next,
                    Err(Error::RetryHorizonExceeded { .. }) => break Claim::AtMostOnce,
                    Err(err) => panic!("resume refused: {err}"),
                }
            }
        }
    };
    (token, claim)
}

/// For each key, the tokens whose step 1 (an `$addToSet` of the token)
/// reached the server.
pub(crate) fn applied_step_1s(log: &[Exchange], seed: u64) -> HashMap<String, HashSet<ObjectId>> {
    let mut truth: HashMap<String, HashSet<ObjectId>> = HashMap::new();
    for exchange in log.iter().filter(|e| {
        e.command.as_deref() == Some("update") && e.collection.as_deref() == Some("views")
    }) {
        let Ok(statements) = exchange.body.get_array("updates") else {
            continue;
        };
        for statement in statements.iter().filter_map(Bson::as_document) {
            let Some(token) = step_1_token(statement, seed) else {
                continue;
            };
            let key = statement
                .get_document("q")
                .ok()
                .and_then(|q| q.get_str("_id").ok())
                .expect("step 1 filters on _id")
                .to_owned();
            if let Some(reply) = &exchange.reply {
                // The counters exist: an `$addToSet` that arrived matched.
                assert_eq!(
                    reply.get_i32("n").ok(),
                    Some(1),
                    "seed {seed}: a step 1 the server did not apply: {reply}"
                );
            }
            if exchange.reached_server {
                truth.entry(key).or_default().insert(token);
            }
        }
    }
    truth
}

/// The token a step 1 statement (an `$addToSet` of the token, or of its
/// entry `{t, n}`) adds; `None` for any other statement.
pub(crate) fn step_1_token(statement: &Document, seed: u64) -> Option<ObjectId> {
    let added = statement
        .get_document("u")
        .ok()
        .and_then(|u| u.get_document("$addToSet").ok())
        .and_then(|a| a.get("pending"));
    match added {
        Some(Bson::ObjectId(t)) => Some(*t),
        Some(Bson::Document(entry)) => match entry.get("t") {
            Some(Bson::ObjectId(t)) => Some(*t),
            _ => panic!("seed {seed}: an entry without a token: {entry}"),
        },
        _ => None,
    }
}

/// Every counter's value.
pub(crate) async fn counters(direct: &Collection<Document>) -> HashMap<String, i64> {
    every_document(direct, doc! {})
        .await
        .into_iter()
        .map(|d| {
            (
                d.get_str("_id").unwrap_or_default().to_owned(),
                counter_of(&d),
            )
        })
        .collect()
}

/// Every document of `collection` that `filter` matches.
pub(crate) async fn every_document(
    collection: &Collection<Document>,
    filter: Document,
) -> Vec<Document> {
    collection
        .find(filter)
        .await
        .expect("find")
        .try_collect()
        .await
        .expect("read documents")
}

/// A counter document's counter, of either integer type.
pub(crate) fn counter_of(document: &Document) -> i64 {
    match document.get("counter") {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        other => panic!("a counter that is not an integer: {other:?} in {document}"),
    }
}
