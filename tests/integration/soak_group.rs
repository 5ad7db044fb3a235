//! The group commit soak (issue 20's proof): writer processes, 8 at a time,
//! each one handle with 16 concurrent callers on 4 hot counters — so their
//! increments leave in groups — through the black-pipe proxy with random
//! faults (reply dropped after execution, connection cut before, reply
//! delayed past the attempt bound); a share of the writers killed with
//! SIGKILL mid-flight and replaced; every unknown ticket resumed 1–3 times
//! by `tallyd resume --lane` processes, some at once; the daemon folding
//! and pruning every second with a short `lane_ttl`.
//!
//! Ground truth is the proxy's log: a group's update (lane L, number s,
//! the group's sum) counts exactly when some request carrying (L, s)
//! reached the server. At the end every counter equals its ground truth
//! (0 lost, 0 doubled), every definite answer a caller was told agrees
//! with it, and each counter holds at most one lane entry per writer
//! process started plus one per unknown outcome.
//!
//! A writer process is this test binary run again
//! ([`group_soak_writer_process`], ignored unless a soak starts it): it
//! prints one JSON line per outcome. `TALLY_SOAK_GROUP_SECONDS` sets how
//! long writers are started (default 25; the long form, e.g. 600); the seed is fixed (override with
//! `TALLY_SOAK_SEED`) and printed in every failure.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tally::{CollectionConfig, Counters, LaneIncrement, Store, StoreConfig, WriterConfig};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::proxy::Action;
use crate::common::tallyd::Tallyd;
use crate::daemon::Conf;
use crate::soak::{ATTEMPT, Claim, DELAY, Rig, counters, fold_out_and_stop, seed};
use crate::soak_lanes::{
    LaneClaim, applied_lane_updates, judge_lane_claims, lanes_pruned, resume_elsewhere,
};

const AT_ONCE: usize = 8;
const CALLERS: usize = 16;
const KEYS: usize = 4;
/// Share of the writer processes killed with SIGKILL mid-flight.
const KILL_SHARE: f64 = 0.4;
/// Each of the three fault rules selects this share of the `update`s.
const FAULT_SHARE: f64 = 0.01;
const DEFAULT_SEED: u64 = 20_261_126;
const DEFAULT_SECONDS: u64 = 25;
/// How long one writer process writes, unless killed first.
const WRITER_LIFE: Duration = Duration::from_secs(3);
/// The lane lifetimes, the writers' and the daemon's: the resume horizon
/// plus one attempt (3 s) below `lane_ttl`.
const LANE_RESUME_HORIZON: Duration = Duration::from_secs(10);
const LANE_TTL: Duration = Duration::from_secs(14);
/// The environment variable that makes the ignored test a writer process.
const WRITER_ENV: &str = "TALLY_GROUP_SOAK_WRITER";

fn writer_config() -> WriterConfig {
    WriterConfig {
        retry_horizon: Duration::from_secs(6),
        lane_resume_horizon: LANE_RESUME_HORIZON,
        lane_ttl: LANE_TTL,
        ..WriterConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writer_processes_in_groups_killed_and_resumed_elsewhere_count_exactly_once() {
    let seed = seed("group soak", DEFAULT_SEED);
    let seconds = std::env::var("TALLY_SOAK_GROUP_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SECONDS);
    let started = Instant::now();
    let faults = [
        Action::DropReply,
        Action::CloseBeforeForwarding,
        Action::DelayReply(DELAY),
    ];
    let rig = Rig::start("soak_group", KEYS, &faults, FAULT_SHARE, seed).await;
    let (ctx, direct, keys, proxy) = (&rig.ctx, &rig.direct, &rig.keys, &rig.proxy);
    let uri = ctx.child_uri_through(proxy, false);
    let config = Conf::default().render(&uri, &ctx.db_name).replace(
        "retry_horizon = \"6s\"",
        &format!(
            "retry_horizon = \"6s\"\nlane_resume_horizon = \"{}s\"\nlane_ttl = \"{}s\"",
            LANE_RESUME_HORIZON.as_secs(),
            LANE_TTL.as_secs()
        ),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let config_path = dir.path().join("tallyd.toml");
    std::fs::write(&config_path, &config).expect("write the processes' config");
    let mut daemon = Tallyd::start(&config, &[]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;

    let writer = json!({ "uri": uri, "database": ctx.db_name, "keys": keys });
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut running = tokio::task::JoinSet::new();
    let (mut started_processes, mut killed) = (0usize, 0usize);
    let mut claims: Vec<LaneClaim> = Vec::new();
    let mut unknown: HashSet<(String, String, i64)> = HashSet::new();
    let until = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < until || !running.is_empty() {
        while Instant::now() < until && running.len() < AT_ONCE {
            let kill = (rng.f64() < KILL_SHARE)
                .then(|| Duration::from_millis(rng.u64(300..=WRITER_LIFE.as_millis() as u64)));
            let (writer, config_path, rng_seed) =
                (writer.clone(), config_path.clone(), rng.u64(..));
            started_processes += 1;
            running.spawn(async move {
                let (lines, was_killed) = writer_process(&writer, kill).await;
                let mut rng = fastrand::Rng::with_seed(rng_seed);
                let mut claims = Vec::new();
                let mut tickets = HashMap::new();
                for line in &lines {
                    let (claim, key, lane, position) = parse(line);
                    match claim {
                        Some(claim) => claims.push(LaneClaim {
                            key,
                            lane,
                            position,
                            claim,
                            by: "a writer process",
                        }),
                        None => {
                            let total = line["total"].as_i64().expect("a ticket's total");
                            let ticket = line["ticket"].as_str().expect("a ticket").to_owned();
                            tickets.insert((key, lane, position), (total, ticket));
                        }
                    }
                }
                // Another process resumes each shared ticket, once for the
                // whole group.
                for ((key, lane, position), (total, ticket)) in &tickets {
                    let resumed = resume_elsewhere(
                        &config_path,
                        key,
                        lane,
                        *position,
                        ticket,
                        *total,
                        &mut rng,
                    );
                    claims.extend(resumed.await);
                }
                (claims, tickets.into_keys().collect::<Vec<_>>(), was_killed)
            });
        }
        if let Some(done) = running.join_next().await {
            let (more, tickets, was_killed) = done.expect("a writer's driver panicked");
            claims.extend(more);
            unknown.extend(tickets);
            killed += usize::from(was_killed);
        }
    }
    let pruned_while_writing = lanes_pruned(&daemon.log());
    let logs = fold_out_and_stop(direct, &mut daemon, "", seed, false).await;

    let log = proxy.log();
    let lanes = applied_lane_updates(&log, seed);
    let finals = counters(direct).await;
    let mut wrong = Vec::new();
    let (mut lost, mut doubled) = (0i64, 0i64);
    for key in keys {
        let expected: i64 = lanes.get(key).map_or(0, |l| l.values().sum());
        let actual = finals.get(key).copied().unwrap_or(0);
        lost += (expected - actual).max(0);
        doubled += (actual - expected).max(0);
        if actual != expected {
            wrong.push(format!("{key}: counter {actual}, ground truth {expected}"));
        }
    }
    let mut told: HashMap<(&str, Claim), usize> = HashMap::new();
    judge_lane_claims(&claims, &lanes, &mut told, &mut wrong);
    // Lane entries: one per writer process that wrote the counter, plus
    // one per unknown outcome (its counter's fresh lane), at most.
    let bound = started_processes + unknown.len();
    for key in keys {
        let found = direct
            .find_one(mongodb::bson::doc! { "_id": key })
            .await
            .expect("read a counter");
        let entries = found
            .as_ref()
            .and_then(|d| d.get_document("lanes").ok())
            .map_or(0, |m| m.len());
        if entries > bound {
            wrong.push(format!(
                "{key}: {entries} lane entries, more than {started_processes} processes + {} \
                 unknown outcomes",
                unknown.len()
            ));
        }
    }
    let updates: usize = lanes.values().map(HashMap::len).sum();
    let increments = claims.iter().filter(|c| c.by == "a writer process").count();
    eprintln!(
        "group soak seed {seed}: {started_processes} writer processes ({killed} killed), \
         {increments} increments told, {updates} updates applied, {} unknown tickets, \
         {pruned_while_writing} entries pruned while writing; told {told:?}; lost {lost}, \
         doubled {doubled}; {:.0?}",
        unknown.len(),
        started.elapsed()
    );
    assert!(
        wrong.is_empty(),
        "seed {seed}: lost {lost}, doubled {doubled}, {} mismatches:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert!(killed > 0, "seed {seed}: no writer was killed mid-flight");
    assert!(
        pruned_while_writing > 0,
        "seed {seed}: no lane entry was pruned while the writers wrote\n{logs}"
    );
    assert!(
        increments > updates,
        "seed {seed}: no group formed ({increments} increments, {updates} updates)"
    );
    assert!(
        !logs.contains("panicked"),
        "seed {seed}: a panic in the daemon's log"
    );
}

/// One JSON line of a writer: the claim (`None`: unknown), key, lane and
/// number.
fn parse(line: &Value) -> (Option<Claim>, String, String, i64) {
    let claim = match line["outcome"].as_str() {
        Some("counted") => Some(Claim::Counted),
        Some("not_counted") => Some(Claim::NotCounted),
        Some("unknown") => None,
        other => panic!("a writer said {other:?}: {line}"),
    };
    let text = |field: &str| line[field].as_str().expect(field).to_owned();
    let position = line["position"].as_i64().expect("position");
    (claim, text("key"), text("lane"), position)
}

/// Runs one writer process (this binary, the ignored test below); with
/// `kill`, SIGKILL after that long. Every outcome line it printed (up to
/// its death), and whether it was killed.
async fn writer_process(writer: &Value, kill: Option<Duration>) -> (Vec<Value>, bool) {
    let exe: PathBuf = std::env::current_exe().expect("the test binary");
    let mut child = tokio::process::Command::new(exe)
        .args([
            "soak_group::group_soak_writer_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WRITER_ENV, writer.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start a writer process");
    let mut out = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut lines = Vec::new();
    let deadline = kill.map(|k| tokio::time::Instant::now() + k);
    loop {
        let next = match deadline {
            Some(at) => match tokio::time::timeout_at(at, out.next_line()).await {
                Ok(next) => next,
                Err(_) => {
                    // SIGKILL: no shutdown, wherever its callers are.
                    child.start_kill().expect("kill a writer");
                    child.wait().await.expect("reap a writer");
                    return (lines, true);
                }
            },
            None => out.next_line().await,
        };
        match next.expect("read a writer's output") {
            Some(line) if line.starts_with('{') => {
                lines.push(serde_json::from_str(&line).expect("a writer's JSON line"));
            }
            Some(_) => {}
            None => break,
        }
    }
    let status = child.wait().await.expect("reap a writer");
    assert!(status.success(), "a writer process failed: {status:?}");
    (lines, false)
}

/// A writer process of the soak (run by it, never alone): one handle, 16
/// callers on the soak's counters for [`WRITER_LIFE`], one JSON line per
/// outcome on standard output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a writer process: the group soak starts it"]
async fn group_soak_writer_process() {
    let writer: Value = serde_json::from_str(
        &std::env::var(WRITER_ENV).expect("started by the soak, with its settings"),
    )
    .expect("the writer's settings");
    let mut store_config = StoreConfig::new(
        writer["uri"].as_str().expect("uri"),
        writer["database"].as_str().expect("database"),
    );
    store_config.server_selection_timeout = Duration::from_secs(2);
    store_config.attempt_timeout = ATTEMPT;
    let store = Store::connect(&store_config).await.expect("connect");
    let counters = Counters::try_new(&store, CollectionConfig::new("views"), writer_config())
        .expect("valid lane settings");
    let keys: Vec<String> = writer["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .filter_map(|k| k.as_str().map(str::to_owned))
        .collect();
    let until = Instant::now() + WRITER_LIFE;
    let callers: Vec<_> = (0..CALLERS)
        .map(|c| {
            let (counters, keys) = (counters.clone(), keys.clone());
            tokio::spawn(async move {
                let mut i = c;
                while Instant::now() < until {
                    let key = &keys[i % keys.len()];
                    let amount = (i % 5) as i64 + 1;
                    print_outcome(&counters, key, &counters.add(key.as_str(), amount).await);
                    i += 1;
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.expect("a caller");
    }
}

/// One JSON line of an outcome: an unknown one's with the update's total
/// and the ticket `tallyd resume` takes.
fn print_outcome(counters: &Counters, key: &str, outcome: &LaneIncrement) {
    let (name, total, ticket) = match outcome {
        LaneIncrement::Counted(_) => ("counted", None, None),
        LaneIncrement::NotCounted(_) => ("not_counted", None, None),
        LaneIncrement::Unknown(ticket) => (
            "unknown",
            Some(ticket.amount()),
            counters.lane_ticket(ticket),
        ),
        LaneIncrement::OutOfOrder(o) => panic!("a minted lane out of order: {o:?}"),
    };
    let (Some(lane), Some(position)) = (outcome.lane(), outcome.position()) else {
        return;
    };
    println!(
        "{}",
        json!({ "key": key, "lane": lane.key(), "position": position, "outcome": name,
                "total": total, "ticket": ticket })
    );
}
