//! The randomized history test (issue 11, "proof beyond the fault matrix"):
//! eight clients drive the whole public API — increments, settles repeated
//! and concurrent (copies of a ticket on other hosts, `tallyd resume` and
//! `tallyd complete` child processes, an operator completing an unknown
//! ticket's token, a resume after the count), reads, sequences and blocks,
//! takes and give-backs, the insert loop, lane adds in bursts of concurrent
//! callers (group commit) and their shared tickets resumed from several
//! hosts at once, and events recorded into a ledger (half on one-shot
//! handles, a lane each; a share delivered twice; judged in `ledger`) —
//! through the black-pipe proxy,
//! which faults a seeded share of their requests (reply dropped after the
//! server executed it, connection closed before forwarding, reply delayed
//! past the attempt timeout, not-primary 10107, command error 2, duplicate
//! key 11000), while a fold runs every second as the daemon would. Every
//! call is recorded with its invoke and return instants, arguments and
//! outcome.
//!
//! At the end the network heals, every ticket is settled, the fold runs
//! until nothing is pending, and [`checker::check`] judges the history
//! against the final state and the proxy's log (what reached the server).
//!
//! `TALLY_HISTORY_SEED=<n>` replays a run: the seed drives every client's
//! calls and the proxy's fault decisions (the k-th request a rule sees
//! draws the k-th number of its generator). Timing still differs between
//! runs — which request is the k-th, how calls interleave — so a replay
//! makes the same choices, not necessarily the same history.
//! `TALLY_HISTORY_SECONDS` sets how long the clients run (default 20).

mod checker;
mod ledger;
mod record;
mod workload;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{
    BoundedConfig, BoundedCounters, CollectionConfig, Counters, FoldTarget, InsertLoop, Mode,
    Reconciler, SequenceConfig, Sequences, WriterConfig,
};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Exchange, Proxy, Rule, RuleGuard, upstream_of};
use crate::common::server::{ServerOptions, TestServer};
use crate::common::{TestClient, TestContext, external};
use record::{BoundedState, Call, FinalState, InsertedDoc, Oracle, Outcome, Recorder};
use workload::{Host, Shared};

/// The hot counters every increment goes to.
const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];
/// The hot counters of the lanes collection, which lane adds go to.
const LANE_KEYS: [&str; 2] = ["l0", "l1"];
/// The lanes collection.
const LANES: &str = "lane_views";
/// Sequences handed out by `next` and `next_block` alike.
const SEQUENCES: [&str; 2] = ["orders", "invoices"];
/// Bounded counters and their stock.
const BOUNDED: [(&str, i64); 2] = [("seats-a", 6), ("seats-b", 3)];
const WORKERS: usize = 8;
/// Workers with retryable writes on (the test server slows down after
/// ~10k retryable writes, so only a few).
const RETRYING_WORKERS: usize = 2;
const DEFAULT_SECONDS: u64 = 20;
/// Share of the faultable requests each run faults, over all actions.
const FAULT_SHARE: f64 = 0.08;
/// The clients' bound on one attempt (it must exceed their server
/// selection timeout, [`SELECTION`]); the delay fault holds replies longer.
const ATTEMPT: Duration = Duration::from_secs(3);
const SELECTION: &str = "serverSelectionTimeoutMS=2000";
const DELAY: Duration = Duration::from_secs(4);
/// Every ticket is settled well within it (or the test fails): an
/// increment whose step 1 timed out twice is 6 s old when it is resumed,
/// and each resume that meets a delayed reply takes another 3 s.
const RETRY_HORIZON: Duration = Duration::from_secs(15);
/// The fold's grace: more than the horizon plus one attempt, as the
/// daemon's configuration requires.
const GRACE: Duration = Duration::from_secs(20);
const FOLD_EVERY: Duration = Duration::from_secs(1);
const MAX_CHILDREN: usize = 24;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_histories_through_faults_are_exact() {
    assert!(GRACE > RETRY_HORIZON + ATTEMPT + Duration::from_secs(1));
    let (seed, seconds) = seed_and_seconds();
    eprintln!("history seed: {seed} (replay with TALLY_HISTORY_SEED={seed}), {seconds} s of calls");
    let started = Instant::now();

    // Its own server: the load must not slow the other tests, nor theirs
    // this one's horizon.
    let server = (!external()).then(|| TestServer::start(&ServerOptions::default()));
    let ctx = match &server {
        Some(server) => TestContext::on("history", server.uri()).await,
        None => TestContext::new("history").await,
    };
    let direct = ctx.client(false).await;
    create_counters(&direct).await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let rules = faults(&proxy, seed);
    let config_dir = tempfile::tempdir().unwrap();
    let child_config = config_dir.path().join("tallyd.toml");
    std::fs::write(&child_config, child_config_text(&ctx, &proxy)).unwrap();
    let mut hosts = Vec::new();
    for w in 0..WORKERS {
        let client = ctx
            .client_through_with(&proxy, w < RETRYING_WORKERS, SELECTION)
            .await;
        hosts.push(host(&client.store().with_attempt_timeout(ATTEMPT)));
    }
    let shared = Arc::new(Shared {
        rec: Recorder::new(),
        hosts,
        leftovers: Mutex::default(),
        child_config,
        children: AtomicUsize::new(0),
        max_children: MAX_CHILDREN,
        child_slots: Semaphore::new(2),
        next_insert: AtomicU64::new(1),
        until: Instant::now() + Duration::from_secs(seconds),
        tally: Mutex::default(),
    });
    let fold_client = ctx.client_through_with(&proxy, false, SELECTION).await;
    let reconciler = Reconciler::new(&fold_client.store().with_attempt_timeout(ATTEMPT));

    let stop_folding = CancellationToken::new();
    let folding = tokio::spawn(fold_periodically(
        shared.clone(),
        reconciler.clone(),
        stop_folding.clone(),
    ));
    // The events ledger: one client, half its events on one-shot handles.
    let ledger_client = ctx.client_through_with(&proxy, false, SELECTION).await;
    let recording = tokio::spawn(ledger::record_events(
        ledger_client.store().with_attempt_timeout(ATTEMPT),
        shared.until,
        fastrand::Rng::with_seed(seed ^ (0x1ed6e7 << 32)),
    ));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let rng = fastrand::Rng::with_seed(seed ^ ((w as u64 + 1) << 40));
            tokio::spawn(workload::worker(shared.clone(), w, rng))
        })
        .collect();
    for worker in workers {
        if let Err(err) = worker.await {
            panic!("seed {seed}: a worker panicked: {err}");
        }
    }
    let calls_done = started.elapsed();

    let mut told = recording.await.expect("the ledger client panicked");
    // Heal, settle every ticket, fold until nothing is pending.
    drop(rules);
    workload::settle_leftovers(&shared).await;
    ledger::settle_and_fold(&direct.store(), &mut told).await;
    stop_folding.cancel();
    folding.await.expect("the fold task panicked");
    fold_until_nothing_is_pending(&shared, &reconciler, &direct.collection("views"), seed).await;

    let end = final_state(&direct).await;
    let log = proxy.log();
    let ops = shared.rec.ops();
    let exercised = shared.tally.lock().unwrap().clone();
    let faulted = log.iter().filter(|e| e.action.is_some()).count();
    eprintln!(
        "history seed {seed}: {} calls, {} requests ({faulted} faulted); calls for {calls_done:.0?}, \
         all done in {:.0?}\nexercised: {exercised:?}\noutcomes: {:?}\ncounters: {:?}",
        ops.len(),
        log.len(),
        started.elapsed(),
        outcome_counts(&ops),
        end.counters,
    );
    let ledger_violations = ledger::violations(&direct.store(), &told).await;
    assert!(
        ledger_violations.is_empty(),
        "seed {seed} (replay with TALLY_HISTORY_SEED={seed}): the ledger: {ledger_violations:#?}"
    );
    assert!(
        told.counted.len() > 10 && told.one_shot > 5 && told.repeats > 2,
        "seed {seed}: the ledger client exercised too little: {} counted, {} one-shot, {} repeats",
        told.counted.len(),
        told.one_shot,
        told.repeats
    );
    eprintln!(
        "ledger: {} events counted ({} one-shot handles, {} repeats), {} not recorded",
        told.counted.len(),
        told.one_shot,
        told.repeats,
        told.not_recorded.len()
    );
    let violations = checker::check(&ops, &end, &oracle(&log));
    if !violations.is_empty() {
        let mut report = format!(
            "seed {seed} (replay with TALLY_HISTORY_SEED={seed}): {} violations\n",
            violations.len()
        );
        for violation in violations.iter().take(10) {
            report.push_str(&checker::explain(&ops, violation, 30));
        }
        panic!("{report}");
    }
    assert_exercised(seed, &exercised, &ops, &log);
}

/// The seed (`TALLY_HISTORY_SEED`, else from the clock) and how many
/// seconds the clients run (`TALLY_HISTORY_SECONDS`).
fn seed_and_seconds() -> (u64, u64) {
    let seed = std::env::var("TALLY_HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap();
            now.as_nanos() as u64 % 1_000_000_000
        });
    let seconds = std::env::var("TALLY_HISTORY_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SECONDS);
    (seed, seconds)
}

/// A lane update statement's (lane, number), key and amount.
fn lane_update(statement: &Document) -> Option<((String, i64), String, i64)> {
    let ops = statement.get_document("u").ok()?;
    let (path, position) = ops.get_document("$set").ok()?.iter().next()?;
    let lane = path.strip_prefix("lanes.")?.to_owned();
    let amount = integer(ops.get_document("$inc").ok()?.get("counter"))?;
    let key = statement
        .get_document("q")
        .ok()?
        .get_str("_id")
        .ok()?
        .to_owned();
    Some(((lane, position.as_i64()?), key, amount))
}

/// The counters exist before the first step 1 (so one that reaches the
/// server always applies: the oracle relies on it); so do the bounded
/// counters. Sequences are created by their first use, under faults.
async fn create_counters(direct: &TestClient) {
    direct
        .collection("views")
        .insert_many(KEYS.iter().map(|k| doc! { "_id": k, "counter": 0i64 }))
        .await
        .expect("create the counters");
    direct
        .collection(LANES)
        .insert_many(LANE_KEYS.iter().map(|k| doc! { "_id": k, "counter": 0i64 }))
        .await
        .expect("create the lane counters");
    tally::Ledger::new(&direct.store(), ledger::spec())
        .create_indexes()
        .await
        .expect("the ledger's indexes");
    let seats = BoundedCounters::new(&direct.store(), BoundedConfig::new("seats"));
    for (key, units) in BOUNDED {
        let created = seats.create(key, units).await;
        assert!(created.expect("create a bounded counter"));
    }
}

/// The fold, once every ticket is settled, until no counter holds a
/// pending entry (the abandoned tokens are folded once older than the
/// grace).
async fn fold_until_nothing_is_pending(
    shared: &Shared,
    reconciler: &Reconciler,
    views: &Collection<Document>,
    seed: u64,
) {
    let patience = GRACE + Duration::from_secs(30);
    let deadline = Instant::now() + patience;
    loop {
        fold_once(shared, reconciler).await;
        let left = views
            .count_documents(doc! { "pending.0": { "$exists": true } })
            .await
            .expect("count pending");
        if left == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {left} counters still hold pending tokens {patience:?} after the calls ended"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A run that exercised nothing proves nothing: every kind of call was
/// made, the fold folded, and the proxy faulted its share.
fn assert_exercised(
    seed: u64,
    exercised: &BTreeMap<&str, u64>,
    ops: &[record::Op],
    log: &[Exchange],
) {
    for what in [
        "increment",
        "resume",
        "complete",
        "resumed twice at once",
        "resumed again after counted",
        "operator complete",
        "tallyd resume",
        "read",
        "next",
        "next_block",
        "take",
        "give_back",
        "insert",
        "crash abandoned",
        "lane add",
    ] {
        assert!(
            exercised.get(what).copied().unwrap_or(0) > 0,
            "seed {seed}: the run made no `{what}` (raise TALLY_HISTORY_SECONDS)"
        );
    }
    let folded: u64 = ops
        .iter()
        .filter_map(|op| match op.outcome {
            Outcome::Folded { tokens, .. } => Some(tokens),
            _ => None,
        })
        .sum();
    assert!(folded > 0, "seed {seed}: the fold folded nothing");
    let faultable = log.iter().filter(|e| faultable(e)).count();
    let faulted = log.iter().filter(|e| e.action.is_some()).count();
    assert!(
        faulted as f64 > FAULT_SHARE / 2.0 * faultable as f64,
        "seed {seed}: only {faulted} of {faultable} requests were faulted"
    );
}

/// The library's handles on one client.
fn host(store: &tally::Store) -> Host {
    Host {
        counters: Counters::new(
            store,
            CollectionConfig::new("views"),
            WriterConfig {
                retry_horizon: RETRY_HORIZON,
                ..WriterConfig::default()
            },
        ),
        sequences: Sequences::new(store, &SequenceConfig::default()),
        bounded: BoundedCounters::new(store, BoundedConfig::new("seats")),
        inserts: InsertLoop::new(store, "docs").max_attempts(20),
        raw: store.collection("views"),
        lanes: Counters::new(store, CollectionConfig::new(LANES), WriterConfig::default()),
    }
}

/// The commands the faults hit, and whether they write.
const FAULTED: [(&str, bool); 5] = [
    ("update", true),
    ("insert", true),
    ("findAndModify", true),
    ("find", false),
    ("aggregate", false),
];

fn faultable(exchange: &Exchange) -> bool {
    FAULTED
        .iter()
        .any(|(c, _)| exchange.command.as_deref() == Some(c))
}

/// One rule per command and action, each drawing from its own generator
/// seeded from `seed`: the first installed rule that selects a request
/// wins.
fn faults(proxy: &Proxy, seed: u64) -> Vec<RuleGuard> {
    let actions = [
        Action::DropReply,
        Action::CloseBeforeForwarding,
        Action::DelayReply(DELAY),
        Action::error(10107, "NotWritablePrimary", &[]),
        Action::error(2, "BadValue", &[]),
        Action::DuplicateKey,
    ];
    let mut rules = Vec::new();
    for (c, (command, writes)) in FAULTED.into_iter().enumerate() {
        let kinds: Vec<&Action> = actions
            .iter()
            .filter(|a| writes || **a != Action::DuplicateKey)
            .collect();
        let share = FAULT_SHARE / kinds.len() as f64;
        for (a, action) in kinds.into_iter().enumerate() {
            let rule_seed = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add((c * 16 + a) as u64);
            rules.push(
                proxy.rule(
                    Rule::command(command)
                        .probability(share, rule_seed)
                        .then(action.clone()),
                ),
            );
        }
    }
    rules
}

/// The `tallyd` configuration of the child processes: through the proxy,
/// with the writers' horizon and the fold's grace.
fn child_config_text(ctx: &TestContext, proxy: &Proxy) -> String {
    format!(
        "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"2s\"\n\
         attempt_timeout = \"{}s\"\n\n[writer]\nretry_horizon = \"{}s\"\n\n[reconcile]\n\
         grace = \"{}s\"\n\n[[collections]]\nname = \"views\"\n",
        ctx.child_uri_through(proxy, false),
        ctx.db_name,
        ATTEMPT.as_secs(),
        RETRY_HORIZON.as_secs(),
        GRACE.as_secs(),
    )
}

fn fold_target() -> FoldTarget {
    FoldTarget {
        spec: CollectionConfig::new("views"),
        grace: GRACE,
        batch_size: 2,
    }
}

/// One fold run at the server's time, recorded.
async fn fold_once(shared: &Shared, reconciler: &Reconciler) {
    let invoke = shared.rec.now();
    let outcome = match reconciler.server_time().await {
        Ok(now) => {
            let run = reconciler
                .reconcile(
                    &fold_target(),
                    Mode::Fold,
                    now,
                    &CancellationToken::new(),
                    &mut |_| {},
                )
                .await;
            match &run.error {
                None => Outcome::Folded {
                    tokens: run.tokens_folded,
                    amount: run.amount_folded,
                },
                Some(err) => Outcome::failed(err),
            }
        }
        Err(err) => Outcome::failed(&err),
    };
    shared.rec.push("fold", Call::Fold, invoke, outcome);
}

/// The daemon's part during the run: a fold every [`FOLD_EVERY`].
async fn fold_periodically(shared: Arc<Shared>, reconciler: Reconciler, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(FOLD_EVERY) => {}
        }
        fold_once(&shared, &reconciler).await;
    }
}

fn integer(value: Option<&Bson>) -> Option<i64> {
    match value {
        Some(Bson::Int32(n)) => Some((*n).into()),
        Some(Bson::Int64(n)) => Some(*n),
        _ => None,
    }
}

async fn all(collection: Collection<Document>) -> Vec<Document> {
    collection
        .find(doc! {})
        .await
        .expect("find")
        .try_collect()
        .await
        .expect("read every document")
}

/// What the run left, read directly (not through the proxy).
async fn final_state(direct: &TestClient) -> FinalState {
    let mut end = FinalState::default();
    for d in all(direct.collection(LANES)).await {
        let key = d.get_str("_id").expect("string keys").to_owned();
        let counter = integer(d.get("counter"))
            .unwrap_or_else(|| panic!("lane counter {key} is not an integer: {d}"));
        end.lane_counters.insert(key, counter);
    }
    for d in all(direct.collection("views")).await {
        let key = d.get_str("_id").expect("string keys").to_owned();
        let counter = integer(d.get("counter"))
            .unwrap_or_else(|| panic!("counter {key} is not an integer: {d}"));
        end.counters.insert(key, counter);
        end.pending_left += d.get_array("pending").map_or(0, Vec::len);
    }
    for d in all(direct.collection("counters")).await {
        let name = d.get_str("_id").expect("string names").to_owned();
        end.sequences
            .insert(name, integer(d.get("seq")).expect("an integer sequence"));
    }
    for d in all(direct.collection("docs")).await {
        end.inserted.push(InsertedDoc {
            id: integer(d.get("_id")).expect("integer ids"),
            call: integer(d.get("call")).map(|c| c as u64),
            token: d.get_object_id("_tally_token").ok(),
        });
    }
    let initial: HashMap<&str, i64> = BOUNDED.into_iter().collect();
    for d in all(direct.collection("seats")).await {
        let key = d.get_str("_id").expect("string keys").to_owned();
        let holders = d
            .get_array("holders")
            .expect("a holders array")
            .iter()
            .map(|h| {
                h.as_document()
                    .and_then(|h| h.get_object_id("token").ok())
                    .expect("a holder with a token")
            })
            .collect();
        end.bounded.insert(
            key.clone(),
            BoundedState {
                initial: initial[key.as_str()],
                available: integer(d.get("available")).expect("an integer stock"),
                holders,
            },
        );
    }
    end
}

/// What the proxy saw reach the server: every step 1's token (see
/// [`Oracle::step_1_reached`]) and every insert-loop call's token.
fn oracle(log: &[Exchange]) -> Oracle {
    let mut oracle = Oracle::default();
    for exchange in log {
        let Ok(statements) = exchange.body.get_array(match exchange.command.as_deref() {
            Some("update") => "updates",
            Some("insert") => "documents",
            _ => continue,
        }) else {
            continue;
        };
        for statement in statements.iter().filter_map(Bson::as_document) {
            match exchange.collection.as_deref() {
                Some(LANES) => {
                    if let Some((update, key, amount)) = lane_update(statement)
                        && exchange.reached_server
                    {
                        oracle.lane_updates.entry(update).or_insert((key, amount));
                    }
                }
                Some("views") => {
                    if let Some((key, token, amount)) = step_1(statement)
                        && exchange.reached_server
                        && step_1_applied(exchange, statement)
                    {
                        oracle.step_1_reached.insert(token, (key, amount));
                    }
                }
                Some("seats") => {
                    let pulled = statement
                        .get_document("u")
                        .and_then(|u| u.get_document("$pull"))
                        .and_then(|pull| pull.get_document("holders"))
                        .and_then(|holder| holder.get_object_id("token"));
                    if let Ok(token) = pulled
                        && exchange.reached_server
                        && matched(exchange)
                    {
                        oracle.given_back.insert(token);
                    }
                }
                Some("docs") => {
                    let token = statement
                        .get_object_id("_tally_token")
                        .expect("an insert holds its token");
                    let sent = oracle.inserts.entry(token).or_default();
                    sent.call = integer(statement.get("call")).map(|c| c as u64);
                    sent.reached |= exchange.reached_server;
                }
                _ => {}
            }
        }
    }
    oracle
}

/// The key, token and amount of a step 1 statement (`$addToSet` of an
/// entry to `pending`).
fn step_1(statement: &Document) -> Option<(String, ObjectId, i64)> {
    let entry = statement
        .get_document("u")
        .ok()?
        .get_document("$addToSet")
        .ok()?
        .get("pending")?;
    let (token, amount) = match entry {
        Bson::ObjectId(token) => (*token, 1),
        Bson::Document(entry) => (entry.get_object_id("t").ok()?, integer(entry.get("n"))?),
        _ => return None,
    };
    let key = statement
        .get_document("q")
        .ok()?
        .get_str("_id")
        .ok()?
        .to_owned();
    Some((key, token, amount))
}

/// Whether a step 1 that reached the server leaves its token counted: it
/// added the token (the counters exist, so it matches), or — a settle's,
/// conditioned on no marker — hit the marker (a duplicate key on the
/// upsert): counted already. A reply the client never saw is assumed
/// applied: the request was on the server.
fn step_1_applied(exchange: &Exchange, statement: &Document) -> bool {
    let settle = statement
        .get_document("q")
        .is_ok_and(|q| q.contains_key("settled.t"));
    let duplicate = exchange
        .reply
        .as_ref()
        .and_then(|reply| reply.get_array("writeErrors").ok())
        .is_some_and(|errors| {
            errors
                .iter()
                .filter_map(Bson::as_document)
                .any(|e| e.get_i32("code").is_ok_and(|c| c == 11000))
        });
    matched(exchange) || (settle && duplicate)
}

/// Whether an `update` that reached the server matched a document; a reply
/// the proxy never saw counts as matched.
fn matched(exchange: &Exchange) -> bool {
    exchange
        .reply
        .as_ref()
        .is_none_or(|reply| integer(reply.get("n")).is_some_and(|n| n >= 1))
}

fn outcome_counts(ops: &[record::Op]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for op in ops {
        let name = match &op.outcome {
            Outcome::Failed { .. } => "failed".to_owned(),
            Outcome::Refused(_) => "refused".to_owned(),
            Outcome::Counted { earlier: true } => "counted (earlier)".to_owned(),
            other => format!("{other:?}")
                .split([' ', '(', '{'])
                .next()
                .unwrap_or_default()
                .to_owned(),
        };
        *counts.entry(name).or_default() += 1;
    }
    counts
}
