//! The closing soak: two-step writers, lane writers and a ledger's
//! recorder write into minute buckets (UTC) through the black-pipe proxy
//! with random faults (reply dropped after execution, connection cut
//! before, reply delayed past the attempt bound), each write carrying a
//! time drawn around now — mostly the current minute, some seconds late
//! (into the previous minute near its end), some in the previous minute
//! (refused once it stopped taking writes), a few seconds ahead — while a
//! closer runs `Reconciler::reconcile` every 0.7 s at the server's time, as
//! the daemon would, closing buckets the writers wrote into a minute ago
//! while they write into the new ones. The horizons are seconds, so the
//! closing margin is too.
//!
//! Ground truth is the proxy's log and the events collection, read
//! directly: a token counts when a step 1 carrying it applied (reached the
//! server and drew no write error: the buckets' documents are created by
//! the writes themselves, so an upsert may collide), a lane increment when
//! an update carrying (lane, position) applied, an event when it is in the
//! events collection. At the end — once every written bucket's closing
//! time passed and a last run changed nothing — every bucket's counter
//! equals its ground truth, every definite answer agrees with it, every
//! refusal was due (and every due refusal made, with nothing sent), every
//! bucket is closed no earlier than its closing time, compact (`_id`,
//! counter, `closed` and the fold's named lane only), and unchanged since
//! the closer first saw it closed. The seed is fixed (override with
//! `TALLY_SOAK_SEED`) and printed in every failure.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tally::{
    BucketWidth, Buckets, CollectionConfig, Counters, Error, EventFoldSettings, FoldTarget,
    Increment, LaneIncrement, Ledger, Mode, Reconciler, Recording, Store, WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Exchange, Rule};
use crate::common::run_with;
use crate::soak::{
    Claim, Rig, assert_faulted_in_time, counter_of, every_document, faulted_updates, resolve, seed,
    soak_scale, step_1_token,
};
use crate::soak_lanes::{agrees, lane_update, reached};

const KEYS: usize = 4;
const TWO_STEP_WRITERS: usize = 3;
const LANE_WRITERS: usize = 3;
/// Each of the three fault rules selects this share of the counters'
/// `update`s and of the events' `insert`s (those two rules only).
const FAULT_SHARE: f64 = 0.02;
const DEFAULT_SEED: u64 = 20_261_128;
/// The writers' bound on one attempt, above their server selection
/// timeout by a second; the delay fault holds replies longer.
const ATTEMPT: Duration = Duration::from_secs(2);
const SELECTION: &str = "serverSelectionTimeoutMS=1000";
const DELAY: Duration = Duration::from_secs(3);
const RETRY_HORIZON: Duration = Duration::from_secs(3);
const LANE_RESUME_HORIZON: Duration = Duration::from_secs(3);
/// Above the resume horizon plus one attempt.
const LANE_TTL: Duration = Duration::from_secs(8);
/// The fold's grace: above the retry horizon plus one attempt.
const GRACE: Duration = Duration::from_secs(6);
/// How long after its end a minute takes writes.
const CLOSE_AFTER: Duration = Duration::from_secs(5);
/// `max(retry_horizon, lane_resume_horizon) + attempt + grace`, as the
/// daemon's configuration makes it.
const MARGIN: Duration = Duration::from_secs(3 + 2 + 6);
/// How far ahead of now a write's time may be drawn.
const AHEAD: Duration = Duration::from_secs(3);
/// Writing lasts at least this (× the soak scale), and always past a
/// minute's closing, to the 50th second of a minute.
const WRITING: Duration = Duration::from_secs(40);
/// How often the closer runs.
const EVERY: Duration = Duration::from_millis(700);
/// The whole soak must finish within this, at scale 1.
const BUDGET: Duration = Duration::from_secs(240);
const MINUTE: Duration = Duration::from_secs(60);

/// The minutes the writers write into (they refuse a time `CLOSE_AFTER`
/// past its minute).
fn minutes() -> Buckets {
    Buckets::utc(BucketWidth::Minute).with_close_after(CLOSE_AFTER)
}

fn spec(buckets: &Buckets) -> CollectionConfig {
    CollectionConfig::new("views")
        .with_buckets(buckets.clone())
        .with_events_collection("views_events")
}

/// One key's minute.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Bucket {
    key: String,
    /// The minute's start, milliseconds since the epoch.
    start: i64,
}

impl Bucket {
    fn of(key: &str, at: SystemTime) -> Self {
        let start = minutes().start_of(at).expect("a minute");
        Self {
            key: key.to_owned(),
            start: DateTime::from_system_time(start).timestamp_millis(),
        }
    }

    fn from_id(id: &Bson) -> Option<Self> {
        let id = id.as_document()?;
        Some(Self {
            key: id.get_str("k").ok()?.to_owned(),
            start: id.get_datetime("t").ok()?.timestamp_millis(),
        })
    }

    fn start_time(&self) -> SystemTime {
        DateTime::from_millis(self.start).to_system_time()
    }

    /// When writers stop taking it, by their clock.
    fn stops_at(&self) -> SystemTime {
        self.start_time() + MINUTE + CLOSE_AFTER
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let start = humantime::format_rfc3339_seconds(self.start_time());
        write!(f, "{}@{start}", self.key)
    }
}

/// What one write was told.
#[derive(Debug)]
enum Told {
    /// Refused for its time (`BucketClosed`), with what it named, if
    /// anything (nothing may have been sent).
    Refused {
        token: Option<ObjectId>,
        lane: Option<(String, i64)>,
        event: Option<String>,
    },
    Token(ObjectId, Claim),
    Lane(String, i64, Claim),
    /// An event: `repeat` when an attempt of it came before.
    Event {
        event: String,
        claim: Claim,
        repeat: bool,
    },
}

/// One write: its bucket (from its time), the writer's clock before and
/// after the call, and what it was told.
#[derive(Debug)]
struct Write {
    bucket: Bucket,
    before: SystemTime,
    after: SystemTime,
    told: Told,
}

/// A time around `now`: mostly now, some seconds late, some in the
/// previous minute, a few seconds ahead, a few long closed.
fn draw_time(rng: &mut fastrand::Rng) -> SystemTime {
    let now = SystemTime::now();
    let ms = Duration::from_millis;
    match rng.u32(0..100) {
        0..55 => now - ms(rng.u64(0..1500)),
        55..75 => now - ms(rng.u64(2000..10_000)),
        75..90 => {
            let start = minutes().start_of(now).expect("a minute");
            start - ms(rng.u64(1..=60_000))
        }
        90..97 => now + ms(rng.u64(0..=AHEAD.as_millis() as u64)),
        _ => now - MINUTE * 2 - ms(rng.u64(0..60_000)),
    }
}

fn refused_for_time(cause: Option<&Error>) -> bool {
    matches!(cause, Some(Error::BucketClosed { .. }))
}

/// The first 50th second of a minute at or after both `at_least` and the
/// 50th second of the minute after `started`'s: writing always spans a
/// minute's closing time (16 s past the next minute's start).
fn stop_writing_at(started: SystemTime, at_least: SystemTime) -> SystemTime {
    let fiftieth = |t: SystemTime| minutes().start_of(t).unwrap() + Duration::from_secs(50);
    let floor = fiftieth(started) + MINUTE;
    let at = fiftieth(at_least);
    let at = if at < at_least { at + MINUTE } else { at };
    at.max(floor)
}

/// A pause between two writes, so the log stays small.
async fn pause(rng: &mut fastrand::Rng) {
    tokio::time::sleep(Duration::from_millis(rng.u64(20..80))).await;
}

/// A writer's writes until `stop`.
struct Writes {
    stop: SystemTime,
    writes: Vec<Write>,
}

impl Writes {
    fn until(stop: SystemTime) -> Self {
        Self {
            stop,
            writes: Vec::new(),
        }
    }

    fn go_on(&self) -> bool {
        SystemTime::now() < self.stop
    }

    /// Before `stop`: a key, a time drawn around now, and now.
    fn next(
        &self,
        keys: &[String],
        rng: &mut fastrand::Rng,
    ) -> Option<(String, SystemTime, SystemTime)> {
        let before = SystemTime::now();
        self.go_on().then(|| {
            (
                keys[rng.usize(..keys.len())].clone(),
                draw_time(rng),
                before,
            )
        })
    }

    /// Notes a write of `key` at `at` begun `before`, then pauses.
    async fn wrote(
        &mut self,
        (key, at, before): (&str, SystemTime, SystemTime),
        told: Told,
        rng: &mut fastrand::Rng,
    ) {
        self.writes.push(Write {
            bucket: Bucket::of(key, at),
            before,
            after: SystemTime::now(),
            told,
        });
        pause(rng).await;
    }
}

async fn two_step_writer(
    counters: Counters,
    keys: Vec<String>,
    stop: SystemTime,
    mut rng: fastrand::Rng,
) -> Vec<Write> {
    let mut writes = Writes::until(stop);
    while let Some((key, at, before)) = writes.next(&keys, &mut rng) {
        let outcome = counters.increment_at(key.as_str(), 1, at).await;
        let told =
            if refused_for_time(outcome.cause()) && matches!(outcome, Increment::NotCounted(_)) {
                Told::Refused {
                    token: outcome.token().map(|t| t.object_id()),
                    lane: None,
                    event: None,
                }
            } else {
                let (token, claim) = resolve(&counters, outcome, &mut rng).await;
                Told::Token(token.object_id(), claim)
            };
        writes.wrote((&key, at, before), told, &mut rng).await;
    }
    writes.writes
}

async fn lane_writer(
    counters: Counters,
    keys: Vec<String>,
    stop: SystemTime,
    mut rng: fastrand::Rng,
    seed: u64,
) -> Vec<Write> {
    let mut writes = Writes::until(stop);
    while let Some((key, at, before)) = writes.next(&keys, &mut rng) {
        let amount = rng.i64(1..=5);
        let mut outcome = counters.add_at(key.as_str(), amount, at).await;
        let named = |o: &LaneIncrement| Some((o.lane()?.key(), o.position()?));
        let mut resumes = 0;
        let told = loop {
            let claim = match outcome {
                LaneIncrement::NotCounted(_) if refused_for_time(outcome.cause()) => {
                    break Told::Refused {
                        token: None,
                        lane: named(&outcome),
                        event: None,
                    };
                }
                LaneIncrement::Counted(_) => Claim::Counted,
                LaneIncrement::NotCounted(_) => Claim::NotCounted,
                LaneIncrement::OutOfOrder(o) => {
                    panic!("seed {seed}: a pool lane out of order: {o:?}")
                }
                LaneIncrement::Unknown(ticket) if resumes < 10 => {
                    if resumes > 0 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    resumes += 1;
                    let (lane, position) = (ticket.lane().key(), ticket.position());
                    match counters.resume_lane(ticket).await {
                        Ok(next) => outcome = next,
                        Err(Error::LaneResumeHorizonExceeded { .. }) => {
                            break Told::Lane(lane, position, Claim::AtMostOnce);
                        }
                        Err(err) => panic!("seed {seed}: resume_lane refused: {err}"),
                    }
                    continue;
                }
                LaneIncrement::Unknown(_) => Claim::AtMostOnce,
            };
            let (lane, position) = named(&outcome).expect("a lane increment names its lane");
            break Told::Lane(lane, position, claim);
        };
        writes.wrote((&key, at, before), told, &mut rng).await;
    }
    writes.writes
}

/// Records events `e0…`, a fifth of the time delivering an earlier one
/// again (same key, amount and time): a duplicate, whatever its time now.
async fn recorder(
    ledger: Ledger,
    keys: Vec<String>,
    stop: SystemTime,
    mut rng: fastrand::Rng,
    seed: u64,
) -> Vec<Write> {
    let mut sent: Vec<(String, String, i64, SystemTime)> = Vec::new();
    let mut writes = Writes::until(stop);
    while writes.go_on() {
        let before = SystemTime::now();
        let (event, key, amount, at, repeat) = if !sent.is_empty() && rng.u32(0..5) == 0 {
            let (event, key, amount, at) = sent[rng.usize(..sent.len())].clone();
            (event, key, amount, at, true)
        } else {
            let event = format!("e{}", sent.len());
            let key = keys[rng.usize(..keys.len())].clone();
            let (amount, at) = (rng.i64(1..=3), draw_time(&mut rng));
            sent.push((event.clone(), key.clone(), amount, at));
            (event, key, amount, at, false)
        };
        let mut outcome = ledger
            .record_at(event.as_str(), key.as_str(), amount, at)
            .await;
        let mut agains = 0;
        let told = loop {
            let claim = match outcome {
                Recording::NotRecorded(ref not) if refused_for_time(Some(not.cause())) => {
                    break Told::Refused {
                        token: None,
                        lane: None,
                        event: Some(event.clone()),
                    };
                }
                Recording::Recorded(_) | Recording::Duplicate(_) => Claim::Counted,
                Recording::NotRecorded(_) => Claim::NotCounted,
                Recording::Conflict(c) => panic!("seed {seed}: {event} in conflict: {c:?}"),
                Recording::Unknown(ticket) if agains < 10 => {
                    if agains > 0 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    agains += 1;
                    match ledger.record_again(ticket).await {
                        Ok(next) => outcome = next,
                        Err(Error::EventRetryHorizonExceeded { .. }) => {
                            break Told::Event {
                                event: event.clone(),
                                claim: Claim::AtMostOnce,
                                repeat,
                            };
                        }
                        Err(err) => panic!("seed {seed}: record_again refused: {err}"),
                    }
                    continue;
                }
                Recording::Unknown(_) => Claim::AtMostOnce,
            };
            break Told::Event {
                event: event.clone(),
                claim,
                repeat,
            };
        };
        writes.wrote((&key, at, before), told, &mut rng).await;
    }
    writes.writes
}

/// What the closer saw: each bucket's document as first read closed (and
/// whether writers were still writing then), any closed document that
/// changed afterwards, and its runs.
#[derive(Default)]
struct Closings {
    first_seen: HashMap<Bucket, (Document, bool)>,
    changed: Vec<String>,
    runs: u64,
    failed_runs: Vec<String>,
    closed: u64,
    raced: u64,
}

/// Reads every closed document: remembers those closed since the last
/// read, and reports those that changed since they were first read.
async fn watch_closed(
    direct: &Collection<Document>,
    closings: &Mutex<Closings>,
    writing: bool,
    seed: u64,
) {
    let closed = documents(direct, doc! { "closed": { "$exists": true } }, seed).await;
    let mut closings = closings.lock().unwrap();
    for (bucket, document) in closed {
        match closings.first_seen.get(&bucket) {
            None => {
                closings.first_seen.insert(bucket, (document, writing));
            }
            Some((first, _)) if *first != document => {
                let change = format!("{bucket} changed after it was closed: {first} → {document}");
                if !closings.changed.contains(&change) {
                    closings.changed.push(change);
                }
            }
            Some(_) => {}
        }
    }
}

/// The daemon's loop: a run at the server's time every [`EVERY`] until
/// `stop`, each followed by a read of the closed buckets.
async fn closer(
    store: Store,
    direct: Collection<Document>,
    target: FoldTarget,
    stop: CancellationToken,
    writing: Arc<AtomicBool>,
    closings: Arc<Mutex<Closings>>,
    seed: u64,
) {
    let reconciler = reconciler(&store);
    let never = CancellationToken::new();
    while !stop.is_cancelled() {
        match reconciler.server_time().await {
            Ok(now) => {
                let run = reconciler
                    .reconcile(&target, Mode::Fold, now, &never, &mut |_| {})
                    .await;
                let mut closings = closings.lock().unwrap();
                closings.runs += 1;
                if let Some(err) = run.error {
                    closings.failed_runs.push(err.to_string());
                }
                if let Some(buckets) = run.buckets {
                    closings.closed += buckets.closed;
                    closings.raced += buckets.raced;
                }
            }
            Err(err) => closings.lock().unwrap().failed_runs.push(err.to_string()),
        }
        watch_closed(&direct, &closings, writing.load(Ordering::SeqCst), seed).await;
        tokio::select! {
            () = tokio::time::sleep(EVERY) => {}
            () = stop.cancelled() => {}
        }
    }
}

/// A reconciler as the daemon's configuration makes it from the writers'
/// settings.
fn reconciler(store: &Store) -> Reconciler {
    Reconciler::new(store)
        .with_lane_ttl(LANE_TTL)
        .with_event_settings(EventFoldSettings {
            retry_horizon: RETRY_HORIZON,
            ..EventFoldSettings::default()
        })
}

/// What applied, from the proxy's log: each token whose step 1 applied and
/// its bucket; each (lane, position) an update of which applied, with its
/// bucket and amount (the ledger fold's lane aside: its events are counted
/// from the events collection).
#[derive(Default)]
struct Applied {
    tokens: HashMap<ObjectId, Bucket>,
    lanes: HashMap<(String, i64), (Bucket, i64)>,
    /// Statements that reached the server with no reply to judge them by.
    unjudged: Vec<String>,
    /// Lane increments applied by two updates.
    twice: Vec<String>,
}

fn applied(log: &[Exchange], seed: u64) -> Applied {
    let mut applied = Applied::default();
    for exchange in log.iter().filter(|e| {
        e.command.as_deref() == Some("update")
            && e.collection.as_deref() == Some("views")
            && e.reached_server
    }) {
        let Ok(statements) = exchange.body.get_array("updates") else {
            continue;
        };
        // A statement with a write error (an upsert that collided) applied
        // nothing; a command refused as a whole applied nothing.
        let failed: Option<HashSet<i64>> = exchange.reply.as_ref().map(|reply| {
            if reply
                .get("ok")
                .and_then(Bson::as_f64)
                .or_else(|| reply.get("ok").and_then(|ok| ok.as_i32().map(f64::from)))
                != Some(1.0)
            {
                return (0..statements.len() as i64).collect();
            }
            reply
                .get_array("writeErrors")
                .map(|errors| {
                    errors
                        .iter()
                        .filter_map(Bson::as_document)
                        .filter_map(|e| e.get("index").and_then(|i| i.as_i32().map(i64::from)))
                        .collect()
                })
                .unwrap_or_default()
        });
        for (index, statement) in statements.iter().filter_map(Bson::as_document).enumerate() {
            let token = step_1_token(statement, seed);
            let lane = lane_update(statement, seed).filter(|(lane, ..)| !lane.starts_with("fold:"));
            if token.is_none() && lane.is_none() {
                continue;
            }
            let id = statement
                .get_document("q")
                .ok()
                .and_then(|q| q.get("_id"))
                .and_then(Bucket::from_id)
                .unwrap_or_else(|| panic!("seed {seed}: a write to no bucket: {statement}"));
            let Some(failed) = &failed else {
                applied.unjudged.push(format!("{id}: {statement}"));
                continue;
            };
            if failed.contains(&(index as i64)) {
                continue;
            }
            if let Some(token) = token {
                let before = applied.tokens.insert(token, id.clone());
                assert!(
                    before.is_none_or(|b| b == id),
                    "seed {seed}: token {token} sent to two buckets"
                );
            }
            if let Some((lane, position, amount)) = lane {
                let entry = (lane.clone(), position);
                if applied.lanes.insert(entry, (id.clone(), amount)).is_some() {
                    applied
                        .twice
                        .push(format!("{id}: lane {lane} s = {position}"));
                }
            }
        }
    }
    applied
}

/// Every event of the events collection: its bucket and amount.
async fn events(direct: &Collection<Document>, seed: u64) -> HashMap<String, (Bucket, i64)> {
    every_document(direct, doc! {})
        .await
        .into_iter()
        .map(|e| {
            let bucket = Bucket::from_id(e.get("k").unwrap_or(&Bson::Null))
                .unwrap_or_else(|| panic!("seed {seed}: an event of no bucket: {e}"));
            let amount = e
                .get_i64("n")
                .unwrap_or_else(|_| panic!("seed {seed}: {e}"));
            (e.get_str("_id").unwrap().to_owned(), (bucket, amount))
        })
        .collect()
}

/// Every bucket document that `filter` matches, by bucket.
async fn documents(
    direct: &Collection<Document>,
    filter: Document,
    seed: u64,
) -> Vec<(Bucket, Document)> {
    every_document(direct, filter)
        .await
        .into_iter()
        .map(|d| {
            let bucket = Bucket::from_id(d.get("_id").unwrap_or(&Bson::Null))
                .unwrap_or_else(|| panic!("seed {seed}: a document that is not a bucket: {d}"));
            (bucket, d)
        })
        .collect()
}

/// What is wrong with a closed bucket's document: not compact (anything
/// but `_id`, the counter, `closed` and the ledger fold's lane), or closed
/// before its closing time.
fn not_compact(bucket: &Bucket, document: &Document) -> Option<String> {
    let Ok(closed) = document.get_datetime("closed") else {
        return Some(format!("{bucket} is not closed: {document}"));
    };
    let closes_at = minutes()
        .with_closing_margin(MARGIN)
        .closes_at(bucket.start_time())
        .expect("a closing time");
    if closed.to_system_time() < closes_at {
        return Some(format!(
            "{bucket} closed at {closed}, before its closing time {}",
            humantime::format_rfc3339_millis(closes_at)
        ));
    }
    let extra: Vec<&str> = document
        .keys()
        .map(String::as_str)
        .filter(|k| !["_id", "counter", "closed", "lanes"].contains(k))
        .collect();
    let minted: Vec<&str> = document
        .get_document("lanes")
        .map(|lanes| {
            lanes
                .keys()
                .map(String::as_str)
                .filter(|l| !l.starts_with("fold:"))
                .collect()
        })
        .unwrap_or_default();
    (!extra.is_empty() || !minted.is_empty()).then(|| {
        format!("{bucket} closed but not compact (fields {extra:?}, minted lanes {minted:?}): {document}")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writers_into_minutes_that_close_while_they_write_count_exactly_once_in_compact_buckets() {
    let seed = seed("buckets soak", DEFAULT_SEED);
    let started = Instant::now();
    let budget = BUDGET.mul_f64(soak_scale().max(1.0));
    let faults = [
        Action::DropReply,
        Action::CloseBeforeForwarding,
        Action::DelayReply(DELAY),
    ];
    let rig = Rig::without_counters("soak_buckets", KEYS, &faults, FAULT_SHARE, seed).await;
    let (ctx, direct, keys, proxy) = (&rig.ctx, &rig.direct, &rig.keys, &rig.proxy);
    let _event_faults: Vec<_> = [Action::DropReply, Action::CloseBeforeForwarding]
        .into_iter()
        .enumerate()
        .map(|(i, action)| {
            proxy.rule(
                Rule::command("insert")
                    .collection("views_events")
                    .probability(FAULT_SHARE, seed.wrapping_add(100 + i as u64))
                    .then(action),
            )
        })
        .collect();
    let direct_store = ctx.client(false).await.store();
    let closing = minutes().with_closing_margin(MARGIN);
    Ledger::new(&direct_store, spec(&closing))
        .create_indexes()
        .await
        .expect("the ledger's indexes");
    let through_proxy = || async {
        let client = ctx.client_through_with(proxy, false, SELECTION).await;
        client.store().with_attempt_timeout(ATTEMPT)
    };

    let begin = SystemTime::now();
    let stop = stop_writing_at(begin, begin + WRITING.mul_f64(soak_scale()));
    eprintln!(
        "buckets soak seed {seed}: writing from {} to {}",
        humantime::format_rfc3339_seconds(begin),
        humantime::format_rfc3339_seconds(stop)
    );
    let writing = Arc::new(AtomicBool::new(true));
    let closings = Arc::new(Mutex::new(Closings::default()));
    let stop_closer = CancellationToken::new();
    let target = FoldTarget {
        spec: spec(&closing),
        grace: GRACE,
        batch_size: 3,
    };
    let closer = tokio::spawn(closer(
        through_proxy().await,
        direct.clone(),
        target.clone(),
        stop_closer.clone(),
        writing.clone(),
        closings.clone(),
        seed,
    ));

    let writer_config = WriterConfig {
        retry_horizon: RETRY_HORIZON,
        lane_resume_horizon: LANE_RESUME_HORIZON,
        lane_ttl: LANE_TTL,
        ..WriterConfig::default()
    };
    let mut writers = Vec::new();
    for w in 0..TWO_STEP_WRITERS + LANE_WRITERS {
        let counters = Counters::try_new(&through_proxy().await, spec(&minutes()), writer_config)
            .expect("valid writer settings");
        let rng = fastrand::Rng::with_seed(seed ^ ((w as u64 + 1) << 32));
        let keys = keys.clone();
        writers.push(if w < TWO_STEP_WRITERS {
            tokio::spawn(two_step_writer(counters, keys, stop, rng))
        } else {
            tokio::spawn(lane_writer(counters, keys, stop, rng, seed))
        });
    }
    let ledger =
        Ledger::new(&through_proxy().await, spec(&minutes())).with_retry_horizon(RETRY_HORIZON);
    let rng = fastrand::Rng::with_seed(seed ^ 0x1ed9e5);
    writers.push(tokio::spawn(recorder(
        ledger,
        keys.clone(),
        stop,
        rng,
        seed,
    )));
    let mut writes: Vec<Write> = Vec::new();
    for writer in writers {
        writes.extend(writer.await.expect("a writer panicked"));
    }
    writing.store(false, Ordering::SeqCst);
    let wrote_for = started.elapsed();

    // Every written bucket closes once its closing time passed: polled,
    // with a deadline a minute past the last one's.
    let fold = reconciler(&direct_store);
    let deadline = Instant::now() + MINUTE + CLOSE_AFTER + MARGIN + Duration::from_secs(60);
    loop {
        let docs: HashMap<_, _> = documents(direct, doc! {}, seed).await.into_iter().collect();
        let now = fold.server_time().await.expect("the server's time");
        let last = docs
            .keys()
            .map(|b| closing.closes_at(b.start_time()).unwrap())
            .max();
        let open: Vec<String> = docs
            .iter()
            .filter(|(_, d)| !d.contains_key("closed"))
            .map(|(b, d)| format!("{b}: {d}"))
            .collect();
        if open.is_empty() && last.is_none_or(|last| now >= last) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {} buckets still open long after their closing time (the last \
             closes at {:?}, now {:?}):\n{}",
            open.len(),
            last.map(humantime::format_rfc3339_millis),
            humantime::format_rfc3339_millis(now),
            open.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    stop_closer.cancel();
    closer.await.expect("the closer panicked");
    // A last run, as the daemon's next: nothing left to close or fold.
    let last = run_with(&fold, &target, Mode::Fold).await;
    assert!(last.error.is_none(), "seed {seed}: {:?}", last.error);
    let after = last.buckets.clone().expect("a bucketed collection");
    assert_eq!(
        (after.closed, after.unclosed, after.open),
        (0, 0, 0),
        "seed {seed}: the last run: {after:?}"
    );
    watch_closed(direct, &closings, false, seed).await;

    // The oracle.
    let log = proxy.log();
    let applied = applied(&log, seed);
    let events_coll = ctx.client(false).await.collection("views_events");
    let events = events(&events_coll, seed).await;
    let docs: HashMap<_, _> = documents(direct, doc! {}, seed).await.into_iter().collect();
    let closings = std::mem::take(&mut *closings.lock().unwrap());
    let mut wrong: Vec<String> = Vec::new();
    wrong.extend(applied.unjudged.iter().map(|s| format!("unjudged: {s}")));
    wrong.extend(applied.twice.iter().map(|s| format!("applied twice: {s}")));
    wrong.extend(closings.changed.iter().cloned());
    let mut expected: HashMap<Bucket, i64> = HashMap::new();
    for bucket in applied.tokens.values() {
        *expected.entry(bucket.clone()).or_default() += 1;
    }
    for (bucket, amount) in applied.lanes.values().chain(events.values()) {
        *expected.entry(bucket.clone()).or_default() += amount;
    }
    let mut buckets: Vec<&Bucket> = expected.keys().chain(docs.keys()).collect();
    buckets.sort();
    buckets.dedup();
    let (mut lost, mut doubled) = (0i64, 0i64);
    for bucket in buckets {
        let want = expected.get(bucket).copied().unwrap_or(0);
        let Some(found) = docs.get(bucket) else {
            wrong.push(format!("{bucket}: no document, ground truth {want}"));
            continue;
        };
        let counter = counter_of(found);
        if counter != want {
            lost += (want - counter).max(0);
            doubled += (counter - want).max(0);
            wrong.push(format!("{bucket}: counter {counter}, ground truth {want}"));
        }
        wrong.extend(not_compact(bucket, found));
        match closings.first_seen.get(bucket) {
            None => wrong.push(format!("{bucket}: never seen closed")),
            Some((first, _)) if first != found => wrong.push(format!(
                "{bucket} changed after it was closed: {first} → {found}"
            )),
            Some(_) => {}
        }
    }
    let mut told: HashMap<&str, usize> = HashMap::new();
    for write in &writes {
        let bucket = &write.bucket;
        let must_refuse = write.before >= bucket.stops_at();
        let may_refuse = write.after >= bucket.stops_at();
        let late = write.before >= bucket.start_time() + MINUTE;
        let (what, applied_to, claim) = match &write.told {
            Told::Refused { token, lane, event } => {
                *told.entry("refused").or_default() += 1;
                if !may_refuse {
                    wrong.push(format!(
                        "{bucket}: refused though it took writes: {write:?}"
                    ));
                }
                let sent = token.is_some_and(|t| applied.tokens.contains_key(&t))
                    || lane.as_ref().is_some_and(|l| applied.lanes.contains_key(l))
                    || event.as_ref().is_some_and(|e| events.contains_key(e));
                if sent {
                    wrong.push(format!("{bucket}: refused, yet written: {write:?}"));
                }
                continue;
            }
            Told::Token(token, claim) => {
                (format!("token {token}"), applied.tokens.get(token), claim)
            }
            Told::Lane(lane, position, claim) => (
                format!("lane {lane} s = {position}"),
                applied
                    .lanes
                    .get(&(lane.clone(), *position))
                    .map(|(b, _)| b),
                claim,
            ),
            Told::Event { event, claim, .. } => (
                format!("event {event}"),
                events.get(event).map(|(b, _)| b),
                claim,
            ),
        };
        let duplicate = matches!(write.told, Told::Event { repeat: true, .. });
        if must_refuse && !duplicate {
            wrong.push(format!(
                "{bucket}: {what} taken past close_after: {write:?}"
            ));
        }
        *told
            .entry(match (late, claim) {
                (true, Claim::Counted) => "late, counted",
                (false, Claim::Counted) => "counted",
                (_, Claim::NotCounted) => "not counted",
                (_, Claim::AtMostOnce) => "at most once",
            })
            .or_default() += 1;
        if !agrees(*claim, applied_to.is_some()) {
            wrong.push(format!(
                "{bucket}: {what} was {claim:?}, but it {}",
                reached(applied_to.is_some())
            ));
        }
        if let Some(landed) = applied_to.filter(|b| *b != bucket) {
            wrong.push(format!("{bucket}: {what} counted in {landed}"));
        }
    }
    let closed_while_writing = closings.first_seen.values().filter(|(_, w)| *w).count();
    let (faulted, updates) = faulted_updates(&log);
    eprintln!(
        "buckets soak seed {seed}: {} writes in {wrote_for:.0?}, told {told:?}; {} tokens, {} lane \
         increments, {} events applied; {updates} updates, {faulted} faulted; {} buckets, {} \
         closed while writing; {} runs ({} failed: {:?}), {} closings, {} raced; lost {lost}, \
         doubled {doubled}; {:.0?}",
        writes.len(),
        applied.tokens.len(),
        applied.lanes.len(),
        events.len(),
        docs.len(),
        closed_while_writing,
        closings.runs,
        closings.failed_runs.len(),
        closings.failed_runs.iter().take(3).collect::<Vec<_>>(),
        closings.closed,
        closings.raced,
        started.elapsed()
    );
    assert!(
        wrong.is_empty(),
        "seed {seed}: lost {lost}, doubled {doubled}, {} mismatches:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert!(
        closed_while_writing > 0,
        "seed {seed}: no bucket closed while the writers wrote"
    );
    for kind in ["refused", "late, counted"] {
        assert!(
            told.contains_key(kind),
            "seed {seed}: no write {kind}: {told:?}"
        );
    }
    assert_faulted_in_time((faulted, updates), 0.02, started, budget, seed);
}
