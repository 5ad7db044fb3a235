//! `tallyd bench`: a load generator for operators, to measure tally on
//! their own cluster before adopting it (as pgbench, redis-benchmark and
//! YCSB do for theirs).
//!
//! Each side — a plain `$inc` (the unsafe baseline), the two-step
//! increment, the lanes protocol, the events ledger — runs with `--writers`
//! concurrent callers sharing one handle, as an application's request
//! handlers do, over `--keys` counters, in a scratch collection the command
//! creates and drops (`--collection` names it, `--keep` leaves it). The
//! sides run interleaved in slices, so a server that speeds up or slows
//! down hits them alike. Per side: operations per second, p50 and p99
//! latency, the outcomes, the mean group size for lanes, and the ratio to
//! `plain`.
//!
//! At the end every unknown or pending outcome is settled (resumed,
//! completed, recorded again), and each side's counters are checked
//! against the increments its callers were told were counted: exit 1 on
//! any difference. The ledger's counters are checked after its fold put
//! every recorded event into them (timed apart from the side: the fold's
//! drain rate is reported beside the check). A plain `$inc` that failed cannot be settled — its side
//! is then not checked, and says so.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{EXIT_FAILED, EXIT_USAGE, connect, fail, fail_with, out};
use crate::bucket::{BucketWidth, Buckets};
use crate::config::Config;
use crate::error::words;
use crate::ledger::index;
use crate::ledger::{EventFold, EventFoldSettings};
use crate::ledger::{Ledger, Recording};
use crate::store::Store;
use crate::write::at::{bucket_id, by_id};
use crate::write::counter::{CollectionConfig, Counters, Increment};
use crate::write::lane::LaneIncrement;

mod api;
mod report;
mod side;

use report::{Cut, report, report_cut};
use side::{Settle, Side, Tally};

/// The longest slice: the sides take turns at least this often.
const MAX_SLICE: Duration = Duration::from_secs(1);

/// `tallyd bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// The sides to measure, comma-separated: plain (a bare `$inc`, the
    /// baseline), two-step, lanes, ledger; http, http-batch, ledger-batch,
    /// record-process (the ledger over HTTP and its comparisons).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "plain,two-step,lanes,ledger"
    )]
    protocol: Vec<Protocol>,
    /// Concurrent callers per side, sharing one handle.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    writers: u32,
    /// Counters the callers spread their increments over (1: one hot
    /// counter).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    keys: u32,
    /// Seconds each side runs, in interleaved slices of at most a second.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=86_400))]
    seconds: u32,
    /// The scratch collection (it must not exist; its ledger's events go to
    /// NAME_events, their fold state to NAME_events_fold). Default:
    /// tally_bench_ and a fresh id.
    #[arg(long, value_name = "NAME")]
    collection: Option<String>,
    /// Count by time: the scratch collection gets buckets of WIDTH
    /// (minute, hour, day or month, in UTC), and every side writes now's
    /// bucket — the bare `$inc` too, by the bucket's `{k, t}` `_id`.
    #[arg(long, value_name = "WIDTH")]
    bucket: Option<BucketWidth>,
    /// Leave the scratch collection for inspection instead of dropping it.
    #[arg(long)]
    keep: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// One side of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Protocol {
    /// A bare `updateOne` with `$inc` and upsert: the unsafe baseline.
    Plain,
    /// The two-step increment (`Counters::increment`).
    TwoStep,
    /// Writer lanes with group commit (`Counters::add`).
    Lanes,
    /// The events ledger (`Ledger::record`).
    Ledger,
    /// The events ledger over HTTP: single events to `tallyd run`'s API.
    Http,
    /// The events ledger over HTTP, in batches of 100.
    HttpBatch,
    /// The events ledger's `Ledger::record_many` of 100 events.
    LedgerBatch,
    /// One `tallyd record` process per event.
    RecordProcess,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::TwoStep => "two-step",
            Self::Lanes => "lanes",
            Self::Ledger => "ledger",
            Self::Http => "http",
            Self::HttpBatch => "http-batch",
            Self::LedgerBatch => "ledger-batch",
            Self::RecordProcess => "record-process",
        }
    }

    /// Whether it records into the ledger (checked after the fold).
    fn is_ledger(self) -> bool {
        !matches!(self, Self::Plain | Self::TwoStep | Self::Lanes)
    }
}

/// What every caller of a run shares.
struct Handles {
    plain: mongodb::Collection<Document>,
    counters: Counters,
    ledger: Ledger,
    /// Folds the ledger's side into its counters, to check them.
    fold: EventFold,
    store: Store,
    /// Makes event keys unique to this run.
    run: String,
    keys: u32,
    /// The scratch collection's buckets, with `--bucket`.
    buckets: Option<Buckets>,
    /// The bench's own `tallyd run`, for the HTTP sides.
    api: Option<api::Daemon>,
}

/// `tallyd bench`.
pub(crate) async fn run(args: BenchArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let mut protocols = args.protocol.clone();
    protocols.dedup();
    let name = args
        .collection
        .clone()
        .unwrap_or_else(|| format!("tally_bench_{}", ObjectId::new().to_hex()));
    let buckets = args.bucket.map(Buckets::utc);
    let spec = match &buckets {
        Some(buckets) => CollectionConfig::new(&name).with_buckets(buckets.clone()),
        None => CollectionConfig::new(&name),
    };
    let store = match connect(config, args.json).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let events = spec.events_collection_name();
    let fold_state = crate::ledger::state::collection_name(&events);
    let scratch = [name.clone(), events, fold_state, format!("{name}_state")];
    match existing(&store, &scratch).await {
        Ok(found) if found.is_empty() => {}
        Ok(found) => {
            store.shutdown().await;
            let (s, es) = [("s", ""), ("", "s")][usize::from(found.len() == 1)];
            let message = format!(
                "the collection{s} {} exist{es} already: name a new one with --collection (the \
                 bench drops what it creates, and touches nothing else)",
                words(&found)
            );
            return fail(args.json, &message, &secrets, EXIT_USAGE);
        }
        Err(err) => {
            let code = fail_with(args.json, &err, &store, &secrets);
            store.shutdown().await;
            return code;
        }
    }
    let kept = if args.keep {
        "kept at the end (--keep)"
    } else {
        "dropped at the end, and at Ctrl-C"
    };
    let first = format!(
        "tallyd bench: scratch collections {} ({kept})",
        words(&scratch)
    );
    // The first line, before any is written: what to look for (or drop)
    // if the command is cut short. On a pipe too, at once.
    if args.json {
        eprintln!("{first}");
    } else {
        out!("{first}");
    }
    let interrupted = super::exit::cancelled_at_ctrl_c();
    let daemon = match api::start_for(&protocols, config, &spec, &scratch[3]).await {
        Ok(daemon) => daemon,
        Err(message) => {
            store.shutdown().await;
            return fail(args.json, &message, &secrets, EXIT_FAILED);
        }
    };
    let handles = Arc::new(Handles {
        plain: store.collection(&name),
        counters: Counters::new(&store, spec.clone(), config.writer),
        ledger: Ledger::new(&store, spec.clone()),
        fold: EventFold::new(
            &store,
            spec,
            EventFoldSettings {
                retry_horizon: config.writer.retry_horizon,
                ..EventFoldSettings::default()
            },
        ),
        store: store.clone(),
        run: ObjectId::new().to_hex(),
        keys: args.keys,
        buckets,
        api: daemon,
    });
    // A bucketed collection runs with the indexes `tallyd setup` makes for
    // it (its counters by key and bucket, its open buckets).
    if handles.buckets.is_some() {
        let needs = vec![index::bucket_counters(), index::open_buckets()];
        if let Err(err) = index::create_these(&store, &name, needs).await {
            let code = fail_with(args.json, &err, &store, &secrets);
            drop(handles);
            store.shutdown().await;
            return code;
        }
    }
    // The ledger's side runs as deployed: with the indexes `tallyd setup`
    // creates (the fold refuses to run without them).
    if protocols.iter().any(|p| p.is_ledger())
        && let Err(err) = handles.ledger.create_indexes().await
    {
        let code = fail_with(args.json, &err, &store, &secrets);
        drop(handles);
        store.shutdown().await;
        return code;
    }
    let (sides, outage) = measure(&args, &protocols, &handles, &interrupted).await;
    api::finish(handles.api.as_ref()).await;
    if let Some(why) = outage {
        // Nothing can be settled, checked or dropped now.
        drop(handles);
        store.shutdown().await;
        return report_cut(&args, &scratch, &sides, &Cut::Outage(why));
    }
    // Ctrl-C during the check (the ledger's fold may take minutes) stops
    // it too: nothing is left to report but the interruption.
    let checked = if interrupted.is_cancelled() {
        Err(sides)
    } else {
        tokio::select! {
            biased;
            () = interrupted.cancelled() => Err(Vec::new()),
            checked = check(&handles, sides) => Ok(checked),
        }
    };
    if !args.keep {
        for collection in &scratch {
            if let Err(err) = store.collection(collection).drop().await {
                eprintln!("warning: could not drop {collection}: {err}");
            }
        }
    }
    drop(handles);
    store.shutdown().await;
    match checked {
        Ok(Ok(sides)) => report(&args, &name, &sides),
        Ok(Err(err)) => fail(args.json, &err, &secrets, EXIT_FAILED),
        Err(sides) => report_cut(&args, &scratch, &sides, &Cut::Interrupted),
    }
}

/// Which of `names` exist in the database.
async fn existing(store: &Store, names: &[String]) -> Result<Vec<String>, crate::error::Error> {
    store
        .database()
        .list_collection_names()
        .filter(doc! { "name": { "$in": names } })
        .await
        .map_err(|err| crate::error::Failure::once("bench.list_collections", err).into())
}

/// Runs the sides in interleaved slices and settles what was left open.
async fn measure(
    args: &BenchArgs,
    protocols: &[Protocol],
    handles: &Arc<Handles>,
    interrupted: &CancellationToken,
) -> (Vec<Side>, Option<String>) {
    let total = Duration::from_secs(u64::from(args.seconds));
    let slices = total.as_secs_f64() / MAX_SLICE.as_secs_f64();
    let slices = (slices.ceil() as u32).max(1);
    let slice = total / slices;
    let mut sides: Vec<Side> = protocols.iter().map(|p| Side::new(*p)).collect();
    let progress = (!args.json && std::io::stderr().is_terminal())
        .then(|| progress_bar(u64::from(slices) * sides.len() as u64));
    let mut outage = None;
    'slices: for round in 0..slices {
        for k in 0..sides.len() {
            if interrupted.is_cancelled() {
                break 'slices;
            }
            let at = (k + round as usize) % sides.len();
            if let Some(bar) = &progress {
                bar.set_message(format!(
                    "slice {}/{slices}: {}",
                    round + 1,
                    sides[at].protocol.name()
                ));
            }
            let before = handles.counters.lane_stats();
            let tally = run_slice(handles, sides[at].protocol, args.writers, slice, round).await;
            let after = handles.counters.lane_stats();
            sides[at].add(
                tally,
                after.updates - before.updates,
                after.increments - before.increments,
            );
            if let Some(bar) = &progress {
                bar.inc(1);
            }
            // Every host failed its last heartbeat: each further slice
            // would wait out server selection for the same answer.
            if !handles.store.seems_reachable() {
                // (at least for the slice that just ended)
                outage = Some(handles.store.unanswered(slice));
                break 'slices;
            }
        }
    }
    if interrupted.is_cancelled() || outage.is_some() {
        // Nothing is settled or checked.
        if let Some(bar) = &progress {
            bar.finish_and_clear();
        }
        return (sides, outage);
    }
    if let Some(bar) = &progress {
        bar.set_message("settling the unknown and pending outcomes…");
    }
    for side in &mut sides {
        let open = std::mem::take(&mut side.open);
        for settle in open {
            side.settled(settle_one(handles, settle).await);
        }
    }
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    (sides, None)
}

/// A bar over the `slices` of every side: their share done and the time
/// left; its message names the slice running.
fn progress_bar(slices: u64) -> ProgressBar {
    let bar = ProgressBar::new(slices);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {percent:>3}% ETA {eta} {msg}") {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// `writers` callers on one side for `length`.
async fn run_slice(
    handles: &Arc<Handles>,
    protocol: Protocol,
    writers: u32,
    length: Duration,
    round: u32,
) -> Tally {
    let until = Instant::now() + length;
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let handles = handles.clone();
            tokio::spawn(async move {
                let mut tally = Tally::default();
                let mut i: u64 = 0;
                while Instant::now() < until {
                    let n = u64::from(w) * 7919 + u64::from(round) * 104_729 + i * 31;
                    let key = format!("{}:{}", protocol.name(), n % u64::from(handles.keys));
                    let event = format!("{}:{}:{round}:{w}:{i}", handles.run, protocol.name());
                    let started = Instant::now();
                    let outcome = one(&handles, protocol, key, event).await;
                    tally.record(started.elapsed(), outcome);
                    i += 1;
                }
                tally
            })
        })
        .collect();
    let mut merged = Tally::default();
    for task in tasks {
        match task.await {
            Ok(tally) => merged.merge(tally),
            Err(err) => std::panic::resume_unwind(err.into_panic()),
        }
    }
    merged.elapsed = length;
    merged
}

/// What one increment's caller was told.
pub(crate) enum Told {
    Counted,
    NotCounted,
    /// Unknown or pending: settled at the end.
    Open(Box<Settle>),
    /// A plain `$inc` that failed: nothing can tell whether it applied.
    Failed,
    /// A batch's events, each told.
    Many(Vec<Told>),
}

async fn one(handles: &Handles, protocol: Protocol, key: String, event: String) -> Told {
    match protocol {
        Protocol::Plain => {
            let filter = match &handles.buckets {
                Some(buckets) => {
                    let now = buckets.start_of(std::time::SystemTime::now());
                    let start = now.unwrap_or(std::time::UNIX_EPOCH);
                    by_id("_id", &bucket_id(Bson::String(key), start))
                }
                None => doc! { "_id": &key },
            };
            let sent = handles
                .plain
                .update_one(filter, doc! { "$inc": { "counter": 1 } })
                .upsert(true)
                .await;
            if sent.is_ok() {
                Told::Counted
            } else {
                Told::Failed
            }
        }
        Protocol::TwoStep => match handles.counters.increment(key, 1).await {
            Increment::Counted(_) => Told::Counted,
            Increment::NotCounted(_) => Told::NotCounted,
            Increment::Pending(token) => Told::Open(Box::new(Settle::Pending(token))),
            Increment::Unknown(token) => Told::Open(Box::new(Settle::Unknown(token))),
        },
        Protocol::Lanes => match handles.counters.add(key, 1).await {
            LaneIncrement::Counted(_) => Told::Counted,
            LaneIncrement::Unknown(ticket) => Told::Open(Box::new(Settle::Lane(ticket))),
            LaneIncrement::NotCounted(_) | LaneIncrement::OutOfOrder(_) => Told::NotCounted,
        },
        Protocol::Ledger => match handles.ledger.record(event, key, 1).await {
            Recording::Recorded(_) => Told::Counted,
            Recording::Unknown(ticket) => Told::Open(Box::new(Settle::Event(ticket))),
            Recording::Duplicate(_) | Recording::Conflict(_) | Recording::NotRecorded(_) => {
                Told::NotCounted
            }
        },
        other => api::one(handles, other, key, event).await,
    }
}

/// Settles an open outcome: `Some(counted)` when settled, `None` when it
/// stayed open after a few tries.
async fn settle_one(handles: &Handles, settle: Settle) -> Option<bool> {
    let mut settle = settle;
    for _ in 0..3 {
        let next = match settle {
            Settle::Pending(token) => match handles.counters.complete(token).await {
                crate::write::counter::Completion::Counted(_) => return Some(true),
                crate::write::counter::Completion::Pending(token) => Settle::Pending(token),
            },
            Settle::Unknown(token) => match handles.counters.resume(token).await {
                Ok(Increment::Counted(_)) => return Some(true),
                Ok(Increment::Pending(token)) => Settle::Pending(token),
                Ok(Increment::Unknown(token)) => Settle::Unknown(token),
                Ok(Increment::NotCounted(_)) => return Some(false),
                Err(_) => return None,
            },
            Settle::Lane(ticket) => match handles.counters.resume_lane(ticket).await {
                Ok(LaneIncrement::Counted(_)) => return Some(true),
                Ok(LaneIncrement::Unknown(ticket)) => Settle::Lane(ticket),
                Ok(LaneIncrement::NotCounted(_) | LaneIncrement::OutOfOrder(_)) => {
                    return Some(false);
                }
                Err(_) => return None,
            },
            Settle::Event(ticket) => match handles.ledger.record_again(ticket).await {
                Ok(Recording::Recorded(_)) => return Some(true),
                Ok(Recording::Unknown(ticket)) => Settle::Event(ticket),
                Ok(_) => return Some(false),
                // Past the retry horizon: recorded at most once.
                Err(_) => return None,
            },
        };
        settle = next;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// Reads each side's counters back: what its callers were told counted
/// must be there, no more (and no less).
async fn check(handles: &Handles, mut sides: Vec<Side>) -> Result<Vec<Side>, String> {
    for side in &mut sides {
        let prefix = format!("^{}:", regex_escape(side.protocol.name()));
        let key = if handles.buckets.is_some() {
            "_id.k"
        } else {
            "_id"
        };
        let found = match side.protocol {
            // The ledger's counters, after its fold: what the daemon
            // would do, timed apart from the side.
            protocol if protocol.is_ledger() => {
                side.fold = Some(fold_everything(handles).await?);
                sum(&handles.plain, key, &prefix, "counter").await?
            }
            _ => sum(&handles.plain, key, &prefix, "counter").await?,
        };
        side.found = Some(found);
    }
    Ok(sides)
}

/// Folds every recorded event into its counter (pass after pass, until
/// nothing waits): how many events, and how long it took.
async fn fold_everything(handles: &Handles) -> Result<(u64, Duration), String> {
    let began = Instant::now();
    let stop = CancellationToken::new();
    let mut folded = 0;
    let failed = |err: crate::error::Error| {
        format!(
            "cannot fold the ledger's side: {}",
            handles.store.scrub(&err.to_string())
        )
    };
    while began.elapsed() < FOLD_LIMIT {
        let now = handles.store.server_time().await.map_err(failed)?;
        let run = handles.fold.fold(now, &stop).await.map_err(failed)?;
        folded += run.events_folded;
        if !run.busy && run.backlog.events == 0 && run.backlog.held.is_empty() {
            return Ok((folded, began.elapsed()));
        }
    }
    Err(format!(
        "the ledger's fold did not drain its events within {}",
        humantime::format_duration(FOLD_LIMIT)
    ))
}

/// How long the ledger's side may take to fold.
const FOLD_LIMIT: Duration = Duration::from_secs(600);

/// The sum of `amount` over the documents whose `key` matches `pattern`.
async fn sum(
    collection: &mongodb::Collection<Document>,
    key: &str,
    pattern: &str,
    amount: &str,
) -> Result<i64, String> {
    let pipeline = vec![
        doc! { "$match": { key: { "$regex": pattern } } },
        doc! { "$group": { "_id": Bson::Null, "n": { "$sum": format!("${amount}") } } },
    ];
    let read = |err: mongodb::error::Error| {
        format!(
            "cannot read the counters back: {}",
            crate::error::Failure::once("bench.check", err)
        )
    };
    let mut cursor = collection.aggregate(pipeline).await.map_err(read)?;
    let total = cursor.try_next().await.map_err(read)?;
    Ok(total
        .and_then(|d| crate::document::integer_value(d.get("n")?))
        .unwrap_or(0))
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let special = "\\^$.|?*+()[]{}".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}
