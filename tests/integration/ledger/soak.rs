//! The events ledger's soak: 8 recorder processes, about 20% of their
//! events sent twice — at once by the same process, by another process,
//! and by the same process 3–6 s later (15–30 `fold_delay`s: many fold
//! cycles) — while the daemon folds continuously and is killed with -9
//! again and again at random moments (half of them — the first always —
//! as soon as a pass is between its intent and its commit, which the next
//! daemon takes over once its lease has run out: the soak fails unless
//! one was), and two recorder processes are killed with
//! -9 with an event in flight (just before or just after it is sent) and
//! started again.
//!
//! Its length is a setting: `TALLY_LEDGER_SOAK_KILLS` daemon kills (6 by
//! default, a minute or so), `TALLY_LEDGER_SOAK_EVENTS` events per
//! recorder (250). The issue's long form kills the daemon 20 times:
//!
//! ```text
//! TALLY_LEDGER_SOAK_KILLS=20 cargo test --test integration ledger::soak
//! ```
//!
//! A recorder is this test binary run again with [`ROLE`] set: its
//! [`recorder_process_of_the_ledger_soak`] records its share of the plan,
//! and prints a line before each send (`attempt KEY COUNTER`, answered
//! `go` on its stdin once the soak has counted the attempt, so no insert
//! can land before it is counted) and one after (`ack KEY COUNTER
//! OUTCOME`; an `unknown` is sent again with its ticket first). A recorder
//! started again re-sends the event its predecessor was killed with
//! (attempted, never acknowledged) and goes on from there.
//!
//! The oracles: the plan (every planned event key once), the keys
//! attempted and acknowledged (the recorders' lines), and the events
//! collection. One seed (`TALLY_SOAK_SEED`) drives every random choice —
//! the plan, the pauses, which recorders are killed and when, the daemon's
//! kills — and is printed, so a failure can be replayed (the server's and
//! the scheduler's timing aside).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use mongodb::options::ClientOptions;
use tally::{CollectionConfig, Ledger, Recording, Store};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use super::*;
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, counter};
use crate::ledger::config;
use crate::soak::seed;

const RECORDERS: usize = 8;
/// Each recorder's own events by default (`TALLY_LEDGER_SOAK_EVENTS`).
const DEFAULT_EVENTS: usize = 250;
/// The settings of the soak's length (inherited by the recorders).
const EVENTS_VAR: &str = "TALLY_LEDGER_SOAK_EVENTS";
const KILLS_VAR: &str = "TALLY_LEDGER_SOAK_KILLS";

/// Each recorder's own events.
fn events_each() -> usize {
    setting(EVENTS_VAR, DEFAULT_EVENTS)
}
const COUNTERS: usize = 5;
/// Recorder processes killed with -9 (and started again) during the run.
const RECORDERS_KILLED: usize = 2;
/// Daemon kills by default (`TALLY_LEDGER_SOAK_KILLS`).
const DAEMON_KILLS: usize = 6;
const DEFAULT_SEED: u64 = 20_251_123;

/// Set (to the recorder's number) in a recorder process's environment.
const ROLE: &str = "TALLY_LEDGER_SOAK_RECORDER";
/// The recorder's other settings, each in its own variable.
const URI: &str = "TALLY_LEDGER_SOAK_URI";
const DATABASE: &str = "TALLY_LEDGER_SOAK_DATABASE";
const SEED: &str = "TALLY_LEDGER_SOAK_SEED";
/// How many times this recorder was started before.
const GENERATION: &str = "TALLY_LEDGER_SOAK_GENERATION";
/// The first of its own events not attempted yet.
const FROM: &str = "TALLY_LEDGER_SOAK_FROM";
/// `KEY=COUNTER` of the event its predecessor attempted unacknowledged.
const RESEND: &str = "TALLY_LEDGER_SOAK_RESEND";
/// What starts a recorder's line on stdout (the test harness's own output
/// shares the stream).
const MARK: &str = "tally-ledger-soak:";

/// What a recorder does with one of its events besides recording it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Repeat {
    None,
    /// Sent again at once by the same process.
    AtOnce,
    /// Sent again by the same process 3–6 s later.
    Later,
    /// Another recorder's event `(recorder, index)`, sent by this one.
    Other(usize, usize),
}

/// Recorder `r`'s event `i`: its key, its counter and what else happens —
/// the same in every process.
fn plan(seed: u64, r: usize, i: usize) -> (String, String, Repeat) {
    let event = (r * events_each() + i + 1) as u64;
    let mut rng = fastrand::Rng::with_seed(seed ^ event.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let counter = format!("c{}", rng.usize(..COUNTERS));
    let repeat = match rng.u32(..100) {
        0..8 => Repeat::AtOnce,
        8..14 => Repeat::Later,
        14..20 => Repeat::Other(
            (r + 1 + rng.usize(..RECORDERS - 1)) % RECORDERS,
            rng.usize(..=i),
        ),
        _ => Repeat::None,
    };
    (format!("r{r}e{i}"), counter, repeat)
}

/// The keys the recorders record, by counter: the plan's own events.
fn planned(seed: u64) -> BTreeMap<String, BTreeSet<String>> {
    let mut planned: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in 0..RECORDERS {
        for i in 0..events_each() {
            let (key, counter, _) = plan(seed, r, i);
            planned.entry(counter).or_default().insert(key);
        }
    }
    planned
}

/// The recorder: returns at once unless this process is one (the soak
/// starts it with [`ROLE`] set).
#[tokio::test]
async fn recorder_process_of_the_ledger_soak() {
    let Ok(recorder) = std::env::var(ROLE) else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let r: usize = recorder.parse().expect("a recorder number");
    let seed: u64 = var(SEED).parse().expect("a seed");
    let generation: u64 = var(GENERATION).parse().expect("a generation");
    let from: usize = var(FROM).parse().expect("an event index");
    let options = ClientOptions::parse(var(URI)).await.expect("the URI");
    let client = mongodb::Client::with_options(options.clone()).expect("a client");
    let store = Store::from_parts(client, &options, &var(DATABASE));
    // Every other recorder is one-shot: a handle (a lane) per event.
    let recorder = Recorder {
        ledger: Ledger::new(&store, CollectionConfig::new("views")),
        one_shot: r % 2 == 1,
        store: store.clone(),
    };
    let mut rng = fastrand::Rng::with_seed(seed ^ ((r as u64 + 1) << 40) ^ (generation << 48));
    let mut later = Vec::new();
    let due = |rng: &mut fastrand::Rng| Instant::now() + Duration::from_millis(rng.u64(3000..6000));
    // The later repeats a killed predecessor had yet to send.
    for i in 0..from {
        if let (key, counter, Repeat::Later) = plan(seed, r, i) {
            later.push((due(&mut rng), key, counter));
        }
    }
    if let Some((key, counter)) = std::env::var(RESEND)
        .ok()
        .and_then(|k| k.split_once('=').map(|(k, c)| (k.to_owned(), c.to_owned())))
    {
        recorder.send(&key, &counter).await;
    }
    for i in from..events_each() {
        let (key, counter, repeat) = plan(seed, r, i);
        recorder.send(&key, &counter).await;
        match repeat {
            Repeat::None => {}
            Repeat::AtOnce => recorder.send(&key, &counter).await,
            Repeat::Later => later.push((due(&mut rng), key, counter)),
            Repeat::Other(o, j) => {
                let (key, counter, _) = plan(seed, o, j);
                recorder.send(&key, &counter).await;
            }
        }
        let now = Instant::now();
        for (_, key, counter) in later.extract_if(.., |(at, _, _)| *at <= now) {
            recorder.send(&key, &counter).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(40..120))).await;
    }
    later.sort();
    for (at, key, counter) in later {
        tokio::time::sleep_until(at.into()).await;
        recorder.send(&key, &counter).await;
    }
    println!("{MARK} done");
}

/// A recorder process's ledger.
struct Recorder {
    ledger: Ledger,
    /// A fresh handle (a fresh lane) for every event, as one `tallyd
    /// record` per event records.
    one_shot: bool,
    store: Store,
}

impl Recorder {
    /// Records `key` on `counter` (an unknown outcome is sent again with
    /// its ticket), between its two lines.
    async fn send(&self, key: &str, counter: &str) {
        println!("{MARK} attempt {key} {counter}");
        let go = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await
        .expect("the read of stdin");
        assert_eq!(go.ok().as_deref(), Some("go\n"), "the soak has gone");
        let ledger = if self.one_shot {
            Ledger::new(&self.store, self.ledger.spec().clone())
        } else {
            self.ledger.clone()
        };
        let mut recording = ledger.record(key, counter, 1).await;
        for _ in 0..10 {
            let Recording::Unknown(ticket) = recording else {
                break;
            };
            tokio::time::sleep(Duration::from_millis(200)).await;
            recording = match ledger.record_again(ticket).await {
                Ok(recording) => recording,
                Err(err) => panic!("{key}: refused to send again: {err}"),
            };
        }
        println!("{MARK} ack {key} {counter} {}", recording.name());
    }
}

/// What the recorders' lines say, kept by the soak.
#[derive(Debug, Default)]
struct Books {
    /// Distinct keys attempted and acknowledged (recorded or duplicate),
    /// with their counters.
    attempted: BTreeMap<String, String>,
    acknowledged: BTreeMap<String, String>,
    /// The same, counted per counter.
    attempted_per: BTreeMap<String, i64>,
    acknowledged_per: BTreeMap<String, i64>,
    /// Keys some attempt said `recorded` of: one attempt's insert each.
    recorded: BTreeSet<String>,
    attempts: u64,
    /// Outcomes that break a promise.
    errors: Vec<String>,
}

impl Books {
    /// Counts an attempt; whether its key was acknowledged already.
    fn attempt(&mut self, key: &str, counter: &str) -> bool {
        self.attempts += 1;
        if self
            .attempted
            .insert(key.to_owned(), counter.to_owned())
            .is_none()
        {
            *self.attempted_per.entry(counter.to_owned()).or_default() += 1;
        }
        self.acknowledged.contains_key(key)
    }

    /// Checks and counts an acknowledgement. `known`: the key was
    /// acknowledged before the attempt began, so it must be a duplicate.
    fn ack(&mut self, key: &str, counter: &str, outcome: &str, known: bool) {
        match outcome {
            "recorded" if known => self.errors.push(format!(
                "{key}: recorded, but acknowledged before it was sent"
            )),
            "recorded" if !self.recorded.insert(key.to_owned()) => {
                self.errors.push(format!("{key}: recorded by two attempts"))
            }
            "recorded" | "duplicate" => {}
            other => {
                self.errors.push(format!("{key} on {counter}: {other}"));
                return;
            }
        }
        if self
            .acknowledged
            .insert(key.to_owned(), counter.to_owned())
            .is_none()
        {
            *self.acknowledged_per.entry(counter.to_owned()).or_default() += 1;
        }
    }
}

/// What the soak needs to start a recorder, and its books.
#[derive(Clone)]
struct Start {
    uri: String,
    database: String,
    seed: u64,
    books: Arc<Mutex<Books>>,
}

/// How one recorder process ended.
#[derive(Debug, Default)]
struct Ended {
    /// It printed `done`.
    done: bool,
    /// The soak killed it; with this attempt (key, counter) not
    /// acknowledged, if any.
    killed_in_flight: Option<Option<(String, String)>>,
    /// One past the last of its own events it attempted.
    next_own: usize,
    status: Option<std::process::ExitStatus>,
    stderr: String,
}

impl Start {
    fn spawn(
        &self,
        r: usize,
        generation: u64,
        from: usize,
        resend: Option<&(String, String)>,
    ) -> Child {
        // A third of the recorders run with their clock ten minutes
        // behind the server's, a third ten minutes ahead (libfaketime,
        // when installed; the monotonic clock stays real).
        let exe = std::env::current_exe().expect("the test binary");
        let skew = match r % 3 {
            _ if !super::faketime_installed() => None,
            1 => Some("-10m"),
            2 => Some("+10m"),
            _ => None,
        };
        let mut command = match skew {
            Some(offset) => {
                let mut command = Command::new("faketime");
                command
                    .args(["-f", offset])
                    .arg(&exe)
                    .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
                command
            }
            None => Command::new(&exe),
        };
        command
            .args([
                "--exact",
                "ledger::soak::recorder_process_of_the_ledger_soak",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, r.to_string())
            .env(URI, &self.uri)
            .env(DATABASE, &self.database)
            .env(SEED, self.seed.to_string())
            .env(GENERATION, generation.to_string())
            .env(FROM, from.to_string())
            .env_remove(RESEND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some((key, counter)) = resend {
            command.env(RESEND, format!("{key}={counter}"));
        }
        command.spawn().expect("start a recorder process")
    }

    /// Runs recorder `r` to its end; once `kill_at` has come, kills it
    /// with -9 at its next attempt (just before or just after letting the
    /// attempt go), and starts it again. Returns the attempts its kills
    /// left unacknowledged.
    async fn run(
        self,
        r: usize,
        mut kill_at: Option<Instant>,
        rng_seed: u64,
    ) -> Result<Vec<(String, String)>, String> {
        let mut rng = fastrand::Rng::with_seed(rng_seed);
        let (mut generation, mut from, mut resend) = (0, 0, None);
        let mut in_flight_at_kills = Vec::new();
        loop {
            let child = self.spawn(r, generation, from, resend.as_ref());
            let ended = self.follow(r, child, kill_at, &mut rng).await;
            match ended.killed_in_flight {
                Some(in_flight) => {
                    kill_at = None;
                    generation += 1;
                    from = ended.next_own;
                    in_flight_at_kills.extend(in_flight.clone());
                    resend = in_flight;
                }
                None if ended.done && ended.status.is_some_and(|s| s.success()) => {
                    return if kill_at.is_some() {
                        Err(format!("recorder {r} ended before its kill"))
                    } else {
                        Ok(in_flight_at_kills)
                    };
                }
                None => return Err(format!("recorder {r} (generation {generation}): {ended:?}")),
            }
        }
    }

    /// Follows one recorder process's lines until it exits.
    async fn follow(
        &self,
        r: usize,
        mut child: Child,
        kill_at: Option<Instant>,
        rng: &mut fastrand::Rng,
    ) -> Ended {
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut stderr = child.stderr.take().expect("piped stderr");
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            text
        });
        let mut ended = Ended::default();
        // The attempt without an acknowledgement yet, and whether its key
        // was acknowledged before it began.
        let mut in_flight: Option<(String, String, bool)> = None;
        let own = format!("r{r}e");
        while let Ok(Some(line)) = lines.next_line().await {
            let Some(at) = line.find(MARK) else {
                continue;
            };
            let words: Vec<&str> = line[at + MARK.len()..].split_whitespace().collect();
            match words[..] {
                ["attempt", key, counter] => {
                    let known = self.books.lock().unwrap().attempt(key, counter);
                    in_flight = Some((key.to_owned(), counter.to_owned(), known));
                    if let Some(i) = key.strip_prefix(&own).and_then(|i| i.parse::<usize>().ok()) {
                        ended.next_own = ended.next_own.max(i + 1);
                    }
                    let kill = ended.killed_in_flight.is_none()
                        && kill_at.is_some_and(|at| Instant::now() >= at);
                    // Killed before its go, the attempt is never sent;
                    // after it, its insert may land or not.
                    if !(kill && rng.bool()) {
                        // A recorder killed meanwhile: its next line never
                        // comes.
                        let _ = stdin.write_all(b"go\n").await;
                        if kill {
                            tokio::time::sleep(Duration::from_millis(rng.u64(0..8))).await;
                        }
                    }
                    if kill {
                        let _ = child.start_kill();
                        ended.killed_in_flight = Some(None);
                    }
                }
                ["ack", key, counter, outcome] => {
                    let known = in_flight
                        .take()
                        .filter(|(k, _, _)| k == key)
                        .is_some_and(|(_, _, known)| known);
                    self.books.lock().unwrap().ack(key, counter, outcome, known);
                }
                ["done"] => ended.done = true,
                _ => self
                    .books
                    .lock()
                    .unwrap()
                    .errors
                    .push(format!("recorder {r}: {line}")),
            }
        }
        if ended.killed_in_flight.is_some() {
            // What its successor sends again: the attempt it was killed in.
            ended.killed_in_flight = Some(in_flight.map(|(key, counter, _)| (key, counter)));
        }
        ended.status = child.wait().await.ok();
        ended.stderr = stderr.await.unwrap_or_default();
        ended
    }
}

/// The issue's soak. What it proves: every exact read (`Ledger::value`)
/// during the run lies between the distinct events acknowledged before it
/// and those attempted by its end; no attempt says `recorded` of a key
/// acknowledged before it began, and no two attempts say it of one key
/// (one insert per event); every planned event is acknowledged in the end
/// (the killed recorders' in-flight ones re-sent by their successors);
/// and after the final fold nothing is unfolded and every counter equals
/// the number of distinct events of its key in the events collection —
/// which lies between the acknowledged and the attempted, equals the plan,
/// and holds every acknowledged key: 0 lost, 0 doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_recorder_processes_sending_twice_while_the_daemon_is_killed_again_and_again() {
    let seed = seed("ledger soak", DEFAULT_SEED);
    let mut rng = fastrand::Rng::with_seed(seed);
    let began = Instant::now();
    let ctx = TestContext::new("ledger_soak").await;
    let admin = ctx.client(false).await;
    let ledger = Ledger::new(&admin.store(), CollectionConfig::new("views"));
    ledger.create_indexes().await.unwrap();
    // A pass left by a killed daemon is taken over once its lease and one
    // attempt have passed: short ones, so the soak keeps folding.
    let daemon_config = config(&ctx, "");
    let daemon_env = [
        ("RUST_LOG", "info,tally=debug"),
        ("TALLYD__RECONCILE__FOLD_LEASE", "2s"),
        ("TALLYD__MONGODB__SERVER_SELECTION_TIMEOUT", "2s"),
        ("TALLYD__MONGODB__ATTEMPT_TIMEOUT", "3s"),
    ];
    let kills = setting(KILLS_VAR, DAEMON_KILLS);
    let fold = crate::ledger::fold_of(&admin.store(), "views");
    let mut daemon = Tallyd::start(&daemon_config, &daemon_env);
    let books = Arc::new(Mutex::new(Books::default()));
    let start = Start {
        uri: ctx.child_uri(false),
        database: ctx.db_name.clone(),
        seed,
        books: books.clone(),
    };
    let mut killed: Vec<usize> = (0..RECORDERS).collect();
    rng.shuffle(&mut killed);
    killed.truncate(RECORDERS_KILLED);
    let recorders: Vec<_> = (0..RECORDERS)
        .map(|r| {
            let kill_at = killed
                .contains(&r)
                .then(|| Instant::now() + Duration::from_millis(rng.u64(3000..15_000)));
            tokio::spawn(start.clone().run(r, kill_at, rng.u64(..)))
        })
        .collect();
    let reading = tokio_util::sync::CancellationToken::new();
    let reads = {
        let (ledger, books, reading) = (ledger.clone(), books.clone(), reading.clone());
        tokio::spawn(async move {
            let mut reads = 0u64;
            let mut outside = Vec::new();
            while !reading.is_cancelled() {
                for c in 0..COUNTERS {
                    let key = format!("c{c}");
                    let low = books
                        .lock()
                        .unwrap()
                        .acknowledged_per
                        .get(&key)
                        .copied()
                        .unwrap_or(0);
                    let value = ledger.value(key.as_str()).await.unwrap().value;
                    let high = books
                        .lock()
                        .unwrap()
                        .attempted_per
                        .get(&key)
                        .copied()
                        .unwrap_or(0);
                    if !(low <= value && value <= high) {
                        outside.push(format!("{key}: {value} outside [{low}, {high}]"));
                    }
                    reads += 1;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (reads, outside)
        })
    };
    let events = admin.collection("views_events");
    let state = admin.collection("views_events_fold");
    let (mut kills_mid_batch, mut recoveries) = (0, 0);
    for kill in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.u64(800..3000))).await;
        // Half the kills — and every one until a kill has left a pass
        // behind — wait for a pass between its intent and its commit (its
        // counters updated or not): a moment rarely hit at random. Whether
        // the kill left one is read after it (a pass seen may commit before
        // the signal lands); a pass left is taken over by a later daemon.
        let wait_for_a_pass = rng.bool() || kills_mid_batch == 0;
        if wait_for_a_pass {
            intent_soon(&state).await;
        }
        daemon.kill();
        let mid_batch = state
            .find_one(doc! { "_id": "state", "intent": { "$exists": true } })
            .await
            .unwrap()
            .is_some();
        kills_mid_batch += u32::from(mid_batch);
        recoveries += daemon.log().matches("taking over a fold pass").count();
        eprintln!(
            "daemon kill {kill} at {:?}{}",
            began.elapsed(),
            if mid_batch {
                ", a pass in progress"
            } else {
                ""
            }
        );
        daemon = Tallyd::start(&daemon_config, &daemon_env);
    }
    let mut in_flight_at_kills = Vec::new();
    for recorder in recorders {
        let killed = recorder.await.unwrap();
        in_flight_at_kills.extend(killed.unwrap_or_else(|e| panic!("seed {seed}: {e}")));
    }
    reading.cancel();
    let (reads, outside) = reads.await.unwrap();
    let books = std::mem::take(&mut *books.lock().unwrap());
    // No attempt said `recorded` of an event that only a killed attempt
    // inserted.
    let landed = in_flight_at_kills
        .iter()
        .filter(|(key, _)| !books.recorded.contains(key))
        .count();
    eprintln!(
        "{reads} exact reads during the run; {} attempts of {} distinct events; {RECORDERS_KILLED} \
         recorders killed, {} of them with an attempt in flight, {landed} of which landed",
        books.attempts,
        books.attempted.len(),
        in_flight_at_kills.len(),
    );
    assert!(
        outside.is_empty(),
        "seed {seed}: exact reads outside their bounds: {outside:#?}"
    );
    assert!(reads > 100, "only {reads} exact reads");
    assert!(books.errors.is_empty(), "seed {seed}: {:#?}", books.errors);

    let deadline = Instant::now() + Duration::from_secs(60);
    while crate::ledger::unfolded(&fold).await > 0 {
        if Instant::now() > deadline {
            let log = daemon.log();
            panic!(
                "seed {seed}: the daemon did not fold every event in 60 s: {:?} unfolded; \
                 its state {:?}; its log ends:\n{}",
                fold.backlog(std::time::SystemTime::now()).await,
                state.find_one(doc! {}).await,
                &log[log.len().saturating_sub(6000)..],
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stored: Vec<Document> = events
        .find(doc! {})
        .projection(doc! { "k": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut present: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for event in &stored {
        present
            .entry(event.get_str("k").unwrap().to_owned())
            .or_default()
            .insert(event.get_str("_id").unwrap().to_owned());
    }
    let planned = planned(seed);
    let views = admin.collection("views");
    for (c, keys) in &planned {
        let stored = present.get(c).cloned().unwrap_or_default();
        let n = stored.len() as i64;
        let (low, high) = (books.acknowledged_per[c], books.attempted_per[c]);
        assert_eq!(
            counter(&views, c.as_str()).await,
            n,
            "seed {seed}: {c}: 0 lost, 0 doubled"
        );
        assert_eq!(
            ledger.value(c.as_str()).await.unwrap().value,
            n,
            "seed {seed}: {c}"
        );
        assert!(
            low <= n && n <= high,
            "seed {seed}: {c}: {n} outside [{low}, {high}]"
        );
        assert_eq!(&stored, keys, "seed {seed}: {c}: the planned events");
    }
    let lost: Vec<&String> = books
        .acknowledged
        .keys()
        .filter(|k| !present.values().any(|keys| keys.contains(*k)))
        .collect();
    assert!(
        lost.is_empty(),
        "seed {seed}: acknowledged, not stored: {lost:?}"
    );
    assert_eq!(
        books.acknowledged.len(),
        RECORDERS * events_each(),
        "seed {seed}: every event acknowledged"
    );
    recoveries += daemon.log().matches("taking over a fold pass").count();
    daemon.terminate();
    eprintln!(
        "{kills_mid_batch} of {kills} daemon kills left a pass in progress, {recoveries} passes \
         taken over; the soak took {:?}",
        began.elapsed()
    );
    // What the soak is for: a daemon killed with -9 between a pass's
    // intent and its commit, and the pass taken over by the next one.
    if kills > 0 {
        assert!(
            kills_mid_batch >= 1,
            "seed {seed}: no daemon was killed with a pass in progress"
        );
        assert!(
            recoveries >= 1,
            "seed {seed}: no pass a killed daemon left was taken over"
        );
    }
}

/// Waits (up to 2 s) until a fold pass is in progress (its intent is
/// recorded); whether one was.
async fn intent_soon(state: &mongodb::Collection<Document>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    let in_progress = doc! { "_id": "state", "intent": { "$exists": true } };
    while Instant::now() < deadline {
        if let Ok(Some(_)) = state.find_one(in_progress.clone()).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}
