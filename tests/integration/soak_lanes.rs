//! The lanes soak (issue 12's proof): lane writers beside two-step writers
//! on one set of counters, through the black-pipe proxy with random faults
//! (reply dropped after execution, connection cut before, reply delayed
//! past the attempt bound); `tallyd incr --lane` processes killed with
//! SIGKILL mid-flight; every unknown lane ticket resumed 1–3 times by other
//! `tallyd resume --lane` processes, some at once; the daemon folding and
//! pruning every second with a short `lane_ttl`, so lanes are pruned from
//! documents writers keep writing.
//!
//! Ground truth is the proxy's log: a lane increment (lane L, position s,
//! amount n) counts exactly when some update carrying (L, s) reached the
//! server (the counters exist beforehand, so an update that arrives either
//! applies or finds its position already held); a two-step increment counts
//! when its step 1 reached the server, as in the two-step soak. At the end
//! every counter equals its ground truth and every definite answer agrees
//! with it. The seed is fixed (override with `TALLY_SOAK_SEED`) and printed
//! in every failure.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use mongodb::bson::{Bson, Document};
use tally::{CollectionConfig, Counters, LaneIncrement, WriterConfig};
use tokio::io::AsyncReadExt;

use crate::common::proxy::{Action, Exchange};
use crate::common::tallyd::Tallyd;
use crate::daemon::Conf;
use crate::soak::{
    ATTEMPT, Claim, DELAY, Rig, SELECTION, applied_step_1s, counters, fold_out_and_stop, seed,
    settle,
};

const LANE_WRITERS: usize = 3;
const TWO_STEP_WRITERS: usize = 3;
const INCREMENTS: usize = 200;
/// `tallyd incr --lane` processes, a few at a time.
const PROCESSES: usize = 48;
const AT_ONCE: usize = 3;
/// Share of those processes killed with SIGKILL mid-flight, 5 to 80 ms
/// after they start: a `tallyd incr --lane` on an idle machine takes about
/// 20 ms, so longer delays would let them all finish first.
const KILL_SHARE: f64 = 0.35;
const KEYS: usize = 20;
/// Each of the three fault rules selects this share of the `update`s.
const FAULT_SHARE: f64 = 0.02;
const DEFAULT_SEED: u64 = 20_261_212;
/// The lane lifetimes, the writers' and the daemon's: the resume horizon
/// plus one attempt (3 s) below `lane_ttl`.
const LANE_RESUME_HORIZON: Duration = Duration::from_secs(8);
const LANE_TTL: Duration = Duration::from_secs(12);
const RETRY_HORIZON: Duration = Duration::from_secs(6);
/// The whole soak must finish within this.
const BUDGET: Duration = Duration::from_secs(240);

/// A definite answer about one lane increment, by lane and position.
pub(crate) struct LaneClaim {
    pub(crate) key: String,
    pub(crate) lane: String,
    pub(crate) position: i64,
    pub(crate) claim: Claim,
    pub(crate) by: &'static str,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lane_and_two_step_writers_killed_processes_and_pruning_count_exactly_once() {
    let seed = seed("lanes soak", DEFAULT_SEED);
    let started = Instant::now();
    let faults = [
        Action::DropReply,
        Action::CloseBeforeForwarding,
        Action::DelayReply(DELAY),
    ];
    let rig = Rig::start("soak_lanes", KEYS, &faults, FAULT_SHARE, seed).await;
    let (ctx, direct, keys, proxy) = (&rig.ctx, &rig.direct, &rig.keys, &rig.proxy);

    // The daemon and the processes share one config: folds every second,
    // attempts bounded by 3 s, the short lane lifetimes.
    let config = Conf::default()
        .render(&ctx.child_uri_through(proxy, false), &ctx.db_name)
        .replace(
            "retry_horizon = \"6s\"",
            &format!(
                "retry_horizon = \"6s\"\nlane_resume_horizon = \"{}s\"\nlane_ttl = \"{}s\"",
                LANE_RESUME_HORIZON.as_secs(),
                LANE_TTL.as_secs()
            ),
        );
    assert!(config.contains("lane_ttl"), "the lane settings are in");
    let dir = tempfile::tempdir().expect("tempdir");
    let config_path = dir.path().join("tallyd.toml");
    std::fs::write(&config_path, &config).expect("write the processes' config");
    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;

    let writer_config = WriterConfig {
        retry_horizon: RETRY_HORIZON,
        lane_resume_horizon: LANE_RESUME_HORIZON,
        lane_ttl: LANE_TTL,
        ..WriterConfig::default()
    };
    let mut lane_writers = Vec::new();
    for w in 0..LANE_WRITERS {
        let client = ctx.client_through_with(proxy, false, SELECTION).await;
        let store = client.store().with_attempt_timeout(ATTEMPT);
        let (keys, config_path) = (keys.clone(), config_path.clone());
        lane_writers.push(tokio::spawn(async move {
            let counters = Counters::try_new(&store, CollectionConfig::new("views"), writer_config)
                .expect("valid lane settings");
            let mut rng = fastrand::Rng::with_seed(seed ^ ((w as u64 + 1) << 40));
            let mut claims = Vec::new();
            for i in 0..INCREMENTS {
                let key = &keys[(w * 5 + i * 7) % keys.len()];
                let amount = rng.i64(1..=5);
                let outcome = counters.add(key.as_str(), amount).await;
                let lane = outcome.lane().map(|l| l.key());
                let position = outcome.position();
                let claim = match outcome {
                    LaneIncrement::Counted(_) => Claim::Counted,
                    LaneIncrement::NotCounted(_) => Claim::NotCounted,
                    LaneIncrement::OutOfOrder(o) => {
                        panic!("seed {seed}: a pool lane out of order: {o:?}")
                    }
                    LaneIncrement::Unknown(ticket) => {
                        let lane = ticket.lane().key();
                        let printed = counters.lane_ticket(&ticket).expect("a minted lane");
                        let resumed = resume_elsewhere(
                            &config_path,
                            key,
                            &lane,
                            ticket.position(),
                            &printed,
                            ticket.amount(),
                            &mut rng,
                        )
                        .await;
                        claims.extend(resumed);
                        continue;
                    }
                };
                if let (Some(lane), Some(position)) = (lane, position) {
                    claims.push(LaneClaim {
                        key: key.clone(),
                        lane,
                        position,
                        claim,
                        by: "a lane writer",
                    });
                }
            }
            claims
        }));
    }
    let mut two_step_writers = Vec::new();
    for w in 0..TWO_STEP_WRITERS {
        let client = ctx.client_through_with(proxy, false, SELECTION).await;
        let store = client.store().with_attempt_timeout(ATTEMPT);
        let keys = keys.clone();
        two_step_writers.push(tokio::spawn(async move {
            let counters = Counters::try_new(&store, CollectionConfig::new("views"), writer_config)
                .expect("valid settings");
            let mut rng = fastrand::Rng::with_seed(seed ^ ((w as u64 + 1) << 32));
            let mut claims = Vec::with_capacity(INCREMENTS);
            for i in 0..INCREMENTS {
                let key = &keys[(w * 3 + i * 11) % keys.len()];
                claims.push(settle(&counters, key, &mut rng).await);
            }
            claims
        }));
    }
    let processes = {
        let (keys, config_path) = (keys.clone(), config_path.clone());
        tokio::spawn(async move { incr_processes(&config_path, &keys, seed).await })
    };

    let mut lane_claims: Vec<LaneClaim> = Vec::new();
    for writer in lane_writers {
        lane_claims.extend(writer.await.expect("a lane writer panicked"));
    }
    let mut two_step_claims = Vec::new();
    for writer in two_step_writers {
        two_step_claims.extend(writer.await.expect("a two-step writer panicked"));
    }
    let (process_claims, killed) = processes.await.expect("the process driver panicked");
    lane_claims.extend(process_claims);
    let pruned_while_writing = lanes_pruned(&daemon.log());

    // A final fold: every two-step token is folded once past its grace.
    let logs = fold_out_and_stop(direct, &mut daemon, "", seed, false).await;

    let log = proxy.log();
    let tokens = applied_step_1s(&log, seed);
    let lanes = applied_lane_updates(&log, seed);
    let finals = counters(direct).await;
    let mut wrong = Vec::new();
    let (mut lost, mut doubled) = (0i64, 0i64);
    for key in keys {
        let from_tokens = tokens.get(key).map_or(0, |t| t.len() as i64);
        let from_lanes: i64 = lanes.get(key).map_or(0, |l| l.values().sum());
        let expected = from_tokens + from_lanes;
        let actual = finals.get(key).copied().unwrap_or(0);
        if actual != expected {
            lost += (expected - actual).max(0);
            doubled += (actual - expected).max(0);
            wrong.push(format!(
                "{key}: counter {actual}, ground truth {expected} ({from_tokens} by tokens, \
                 {from_lanes} by lanes)"
            ));
        }
    }
    let mut told: HashMap<(&str, Claim), usize> = HashMap::new();
    for (key, token, claim) in &two_step_claims {
        let applied = tokens
            .get(key)
            .is_some_and(|t| t.contains(&token.object_id()));
        *told.entry(("two-step", *claim)).or_default() += 1;
        if !agrees(*claim, applied) {
            wrong.push(format!(
                "{key}: token {token} was {claim:?}, but its step 1 {}",
                reached(applied)
            ));
        }
    }
    judge_lane_claims(&lane_claims, &lanes, &mut told, &mut wrong);
    let faulted = log.iter().filter(|e| e.action.is_some()).count();
    let updates = log
        .iter()
        .filter(|e| e.command.as_deref() == Some("update"))
        .count();
    let lane_increments: usize = lanes.values().map(HashMap::len).sum();
    eprintln!(
        "lanes soak seed {seed}: {lane_increments} lane increments applied, {updates} updates, \
         {faulted} faulted, {killed} processes killed, {pruned_while_writing} lane entries \
         pruned while writing; told {told:?}; lost {lost}, doubled {doubled}; {:.0?}",
        started.elapsed()
    );
    assert!(
        wrong.is_empty(),
        "seed {seed}: lost {lost}, doubled {doubled}, {} mismatches:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert!(
        pruned_while_writing > 0,
        "seed {seed}: no lane was pruned while the writers wrote\n{logs}"
    );
    assert!(killed > 0, "seed {seed}: no process was killed mid-flight");
    assert!(
        faulted as f64 > 0.03 * updates as f64,
        "seed {seed}: only {faulted} of {updates} updates were faulted"
    );
    assert!(
        started.elapsed() < BUDGET,
        "seed {seed}: the soak took {:?}",
        started.elapsed()
    );
}

pub(crate) fn agrees(claim: Claim, applied: bool) -> bool {
    match claim {
        Claim::Counted => applied,
        Claim::NotCounted => !applied,
        Claim::AtMostOnce => true,
    }
}

pub(crate) fn reached(applied: bool) -> &'static str {
    if applied {
        "reached the server"
    } else {
        "never reached the server"
    }
}

/// `PROCESSES` runs of `tallyd incr KEY --lane --by N`, `AT_ONCE` at a
/// time, a share of them killed with SIGKILL after a random delay; every
/// unknown one resumed by other processes. Returns the definite answers
/// and how many were killed before they exited.
async fn incr_processes(config: &Path, keys: &[String], seed: u64) -> (Vec<LaneClaim>, usize) {
    let mut claims = Vec::new();
    let mut killed = 0;
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    for batch in 0..PROCESSES / AT_ONCE {
        let runs: Vec<_> = (0..AT_ONCE)
            .map(|i| {
                let key = keys[(batch * AT_ONCE + i) * 3 % keys.len()].clone();
                let by = rng.i64(1..=9);
                let kill = (rng.f64() < KILL_SHARE).then(|| Duration::from_millis(rng.u64(5..=80)));
                let seed = rng.u64(..);
                async move {
                    let by_text = by.to_string();
                    let args = ["incr", &key, "--lane", "--by", &by_text, "--json"];
                    (key.clone(), by, seed, run(config, &args, kill).await)
                }
            })
            .collect();
        for (key, by, seed, result) in futures::future::join_all(runs).await {
            let Some((code, out)) = result else {
                killed += 1;
                continue;
            };
            let lane = out["token"].as_str().map(str::to_owned);
            let ticket = out["ticket"].as_str().map(str::to_owned);
            let position = out["position"].as_i64();
            let (Some(lane), Some(ticket), Some(position)) = (lane, ticket, position) else {
                assert_eq!(code, 1, "an incr without a lane that did not fail: {out}");
                continue;
            };
            let claim = match (code, out["outcome"].as_str()) {
                (0, Some("counted")) => Claim::Counted,
                (1, Some("not_counted")) => Claim::NotCounted,
                (75, Some("unknown")) => {
                    let mut rng = fastrand::Rng::with_seed(seed);
                    let resumed =
                        resume_elsewhere(config, &key, &lane, position, &ticket, by, &mut rng)
                            .await;
                    claims.extend(resumed);
                    continue;
                }
                other => panic!("incr answered {other:?}: {out}"),
            };
            claims.push(LaneClaim {
                key,
                lane,
                position,
                claim,
                by: "an incr process",
            });
        }
    }
    (claims, killed)
}

/// Resumes an unknown lane increment — the update of `by` through `lane`
/// at `position`, whose ticket is `ticket` — 1–3 times from `tallyd resume`
/// processes, at once or one after another.
pub(crate) async fn resume_elsewhere(
    config: &Path,
    key: &str,
    lane: &str,
    position: i64,
    ticket: &str,
    by: i64,
    rng: &mut fastrand::Rng,
) -> Vec<LaneClaim> {
    let times = rng.usize(1..=3);
    let by_text = by.to_string();
    let args = ["resume", key, ticket, "--lane", "--by", &by_text, "--json"];
    let outputs = if rng.bool() {
        futures::future::join_all((0..times).map(|_| run(config, &args, None))).await
    } else {
        let mut outputs = Vec::new();
        for _ in 0..times {
            outputs.push(run(config, &args, None).await);
        }
        outputs
    };
    outputs
        .into_iter()
        .filter_map(|output| {
            let (code, out) = output.expect("not killed");
            let claim = match (code, out["outcome"].as_str()) {
                (0, Some("counted")) => Claim::Counted,
                (75, Some("unknown")) => return None,
                // Past the resume horizon: counted at most once. (Never a
                // ticket refused by its check: that would hide a resume.)
                (1, Some("refused")) => {
                    let message = out["error"]["message"].as_str().unwrap_or_default();
                    assert!(message.contains("past the lane resume horizon"), "{out}");
                    Claim::AtMostOnce
                }
                (1, Some("not_counted")) => Claim::NotCounted,
                other => panic!("resume answered {other:?}: {out}"),
            };
            Some(LaneClaim {
                key: key.to_owned(),
                lane: lane.to_owned(),
                position,
                claim,
                by: "a resume process",
            })
        })
        .collect()
}

/// Runs `tallyd --config CONFIG ARGS`; with `kill`, sends it SIGKILL after
/// that long unless it exited first. Its exit code and JSON output, or
/// `None` when it was killed.
async fn run(
    config: &Path,
    args: &[&str],
    kill: Option<Duration>,
) -> Option<(i32, serde_json::Value)> {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start tallyd");
    let status = tokio::select! {
        status = child.wait() => status.expect("wait for tallyd"),
        () = tokio::time::sleep(kill.unwrap_or(Duration::MAX)), if kill.is_some() => {
            // SIGKILL: no shutdown, wherever it is.
            child.start_kill().expect("kill tallyd");
            child.wait().await.expect("reap tallyd");
            return None;
        }
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stdout.take() {
        pipe.read_to_string(&mut stdout).await.expect("read stdout");
    }
    if let Some(mut pipe) = child.stderr.take() {
        pipe.read_to_string(&mut stderr).await.expect("read stderr");
    }
    let code = status.code().expect("exited, not signalled");
    let out = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|err| panic!("{args:?} printed no JSON ({err}): {stdout}{stderr}"));
    Some((code, out))
}

/// Judges what each lane caller was told against `lanes` (what reached the
/// server, from the proxy's log): counts the claims by caller and outcome
/// in `told`, and adds each claim the log contradicts to `wrong`.
pub(crate) fn judge_lane_claims<'a>(
    claims: &'a [LaneClaim],
    lanes: &HashMap<String, HashMap<(String, i64), i64>>,
    told: &mut HashMap<(&'a str, Claim), usize>,
    wrong: &mut Vec<String>,
) {
    for c in claims {
        let applied = lanes
            .get(&c.key)
            .is_some_and(|l| l.contains_key(&(c.lane.clone(), c.position)));
        *told.entry((c.by, c.claim)).or_default() += 1;
        if !agrees(c.claim, applied) {
            wrong.push(format!(
                "{}: lane {} s = {} was {:?} by {}, but its update {}",
                c.key,
                c.lane,
                c.position,
                c.claim,
                c.by,
                reached(applied)
            ));
        }
    }
}

/// For each key, the lane increments — (lane, position) → amount — some
/// update of which reached the server: the first that arrived applied.
pub(crate) fn applied_lane_updates(
    log: &[Exchange],
    seed: u64,
) -> HashMap<String, HashMap<(String, i64), i64>> {
    let mut truth: HashMap<String, HashMap<(String, i64), i64>> = HashMap::new();
    for exchange in log.iter().filter(|e| {
        e.command.as_deref() == Some("update")
            && e.collection.as_deref() == Some("views")
            && e.reached_server
    }) {
        let Ok(statements) = exchange.body.get_array("updates") else {
            continue;
        };
        for statement in statements.iter().filter_map(Bson::as_document) {
            let Some((lane, position, amount)) = lane_update(statement, seed) else {
                continue;
            };
            let key = statement
                .get_document("q")
                .ok()
                .and_then(|q| q.get_str("_id").ok())
                .expect("a lane update filters on _id")
                .to_owned();
            let previous = truth
                .entry(key)
                .or_default()
                .insert((lane.clone(), position), amount);
            assert!(
                previous.is_none_or(|p| p == amount),
                "seed {seed}: lane {lane} s = {position} sent with two amounts"
            );
        }
    }
    truth
}

/// The lane, position and amount of a lane update statement (`$inc` of
/// the counter with one `$set` of `lanes.L`); `None` for any other.
pub(crate) fn lane_update(statement: &Document, seed: u64) -> Option<(String, i64, i64)> {
    let update = statement.get_document("u").ok()?;
    let set = update.get_document("$set").ok()?;
    let lane_entries: Vec<_> = set
        .iter()
        .filter_map(|(path, s)| Some((path.strip_prefix("lanes.")?, s)))
        .collect();
    let [(lane, position)] = lane_entries[..] else {
        return None;
    };
    let position = position
        .as_i64()
        .unwrap_or_else(|| panic!("seed {seed}: a lane position not an int64: {set}"));
    let amount = match update
        .get_document("$inc")
        .ok()
        .and_then(|i| i.get("counter"))
    {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        other => panic!("seed {seed}: a lane update adding {other:?}: {update}"),
    };
    Some((lane.to_owned(), position, amount))
}

/// The lane entries the daemon logged as pruned (its `reconcile run` lines'
/// `lanes_pruned`).
pub(crate) fn lanes_pruned(log: &str) -> u64 {
    log.match_indices("lanes_pruned")
        .filter_map(|(at, name)| {
            let rest = log[at + name.len()..].trim_start_matches(['"', '=', ':', ' ']);
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u64>().ok()
        })
        .sum()
}
