//! `tallyd record` and `tallyd get`: the events ledger from the shell.
//!
//! Both work only on a collection whose ledger the configuration turns on
//! (`ledger = true` or `events_collection`): events recorded anywhere else
//! would never be folded into their counters. Another collection is a
//! configuration error (exit 78).
//!
//! `record` exits 0 when the event is counted once (recorded, or a
//! duplicate of an earlier recording), 75 when the insert is unknown (run
//! the same command again: a repeat is recognised as a duplicate), 1 for a
//! conflict (the key was recorded with another counter or amount) and when
//! nothing was recorded.
//!
//! `record --from FILE` records a file of events in batches (`from`).

use crate::cli::out;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use serde_json::{Value, json};

use super::increment::shell_word;
use super::{
    EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, EXIT_USAGE, TargetArgs, exit_code_for, fail, shown_command,
};
use crate::bucket::BucketWidth;
use crate::config::Config;
use crate::daemon::api::outcome;
use crate::document::display_id;
use crate::error::Error;
use crate::error::counted;
use crate::ledger::{EventFold, EventFoldSettings};
use crate::ledger::{Ledger, Recording};
use crate::redact::Secrets;
use crate::store::Store;
use crate::write::counter::CollectionConfig;

mod from;

/// `tallyd record EVENT_KEY COUNTER_KEY [--by N]`, or `tallyd record --from
/// FILE`.
#[derive(Debug, Args)]
pub(crate) struct RecordArgs {
    /// The event's key (its idempotency key: a message id, a webhook's
    /// event id; not empty).
    #[arg(required_unless_present = "from", conflicts_with = "from", value_parser = super::event_key)]
    pub(crate) event: Option<String>,
    /// The counter's `_id` (a string, not empty).
    #[arg(required_unless_present = "from", conflicts_with = "from", value_parser = super::counter_key)]
    pub(crate) key: Option<String>,
    /// The amount the event adds; negative subtracts; not zero.
    #[arg(
        long,
        default_value_t = 1,
        allow_negative_numbers = true,
        conflicts_with = "from",
        value_parser = super::increment::amount
    )]
    pub(crate) by: i64,
    /// When the event happened, for a collection with buckets: RFC 3339
    /// (2026-11-28T14:30:00Z, 2026-11-28T15:30:00+01:00) or a date
    /// (2026-11-28, its midnight in the collection's time zone); counted in
    /// the bucket holding it. Default: now.
    #[arg(long, value_name = "TIME", conflicts_with = "from")]
    pub(crate) at: Option<String>,
    /// Record the events of FILE instead, one JSON object a line:
    /// {"event": "…", "key": …, "by": N, "at": "TIME"} ("by" defaults to
    /// 1, "at" to now); "-" reads standard input.
    #[arg(long, value_name = "FILE")]
    pub(crate) from: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd get KEY`.
#[derive(Debug, Args)]
pub(crate) struct GetArgs {
    /// The counter's `_id` (a string, not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) key: String,
    /// In a collection with buckets: read KEY's buckets that start at or
    /// after TIME (RFC 3339, or a date for its midnight in the
    /// collection's time zone). With --to.
    #[arg(long, value_name = "TIME", requires = "to")]
    pub(crate) from: Option<String>,
    /// … and before TIME. With --from.
    #[arg(long, value_name = "TIME", requires = "from")]
    pub(crate) to: Option<String>,
    /// Sum the buckets by this coarser width: minute, hour, day or month.
    #[arg(long, value_name = "WIDTH", requires = "from")]
    pub(crate) by: Option<BucketWidth>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// The target's ledger and a connection; a collection without a ledger in
/// the configuration is refused (exit 78).
async fn open(target: &TargetArgs, config: &Config) -> Result<(Store, Ledger), ExitCode> {
    let (spec, store) = target.open_ledger(config).await?;
    let ledger = Ledger::new(&store, spec).with_retry_horizon(config.writer.retry_horizon);
    Ok((store, ledger))
}

pub(super) async fn record(args: RecordArgs, config: &Config) -> ExitCode {
    // A time refused is a usage error, before anything connects.
    let at = match args.target.resolve(config, true).map(|spec| {
        super::increment::time_given(&spec, args.at.as_deref(), super::increment::Timed::Write)
    }) {
        Ok(Ok(at)) => at,
        Ok(Err(message)) => return fail(args.target.json, &message, &config.secrets(), EXIT_USAGE),
        // Said by `open`, as for any command.
        Err(_) => None,
    };
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match (&args.from, &args.event, &args.key) {
        (Some(from), _, _) => {
            let target = from::Target {
                ledger: &ledger,
                store: &store,
                json: args.target.json,
                secrets: &config.secrets(),
                again: shown_command(&format!(
                    "record --from {}{}",
                    shell_word(from),
                    args.target.collection_options(&ledger.spec().name)
                )),
                window: config.reconcile.event_retention,
            };
            from::record_from(from, &target).await
        }
        (None, Some(event), Some(key)) => {
            let recording = match at {
                Some(at) => {
                    ledger
                        .record_at(event.as_str(), key.as_str(), args.by, at)
                        .await
                }
                None => ledger.record(event.as_str(), key.as_str(), args.by).await,
            };
            print_one(&recording, &ledger, args.target.json, &config.secrets(), at)
        }
        _ => fail(
            args.target.json,
            "give EVENT and KEY, or --from FILE",
            &config.secrets(),
            EXIT_USAGE,
        ),
    };
    store.shutdown().await;
    code
}

/// What a recording means for the exit code and for the person reading
/// (the sentence is the one the API's outcome carries too).
fn judged(recording: &Recording, secrets: &Secrets) -> (u8, String) {
    let code = match recording {
        Recording::Recorded(_) | Recording::Duplicate(_) => EXIT_OK,
        Recording::Conflict(_) => EXIT_FAILED,
        Recording::Unknown(_) => EXIT_TEMPFAIL,
        Recording::NotRecorded(not) => exit_code_for(not.cause()),
    };
    (code, outcome::said(recording, secrets))
}

fn print_one(
    recording: &Recording,
    ledger: &Ledger,
    json: bool,
    secrets: &Secrets,
    at: Option<SystemTime>,
) -> ExitCode {
    let (code, text) = judged(recording, secrets);
    let event = recording.event();
    let (key, bucket) = outcome::key_and_bucket(recording, ledger, at);
    let bucket = match (&ledger.spec().buckets, bucket) {
        (Some(buckets), Some(start)) => format!(" in the {} from {start}", buckets.width()),
        _ => String::new(),
    };
    let what = format!(
        "event {} on {}/{}{bucket} by {}",
        crate::document::shown(event.key()),
        ledger.spec().name,
        display_id(&key),
        event.amount()
    );
    if json {
        out!("{}", outcome::as_json(recording, ledger, &text, at));
    } else if code == EXIT_OK {
        out!("{text}: {what}");
    } else {
        eprintln!("{text} ({what})");
    }
    ExitCode::from(code)
}

pub(super) async fn get(args: GetArgs, config: &Config) -> ExitCode {
    let range = match args
        .target
        .resolve(config, true)
        .map(|spec| range_asked(&args, &spec))
    {
        Ok(Ok(range)) => range,
        Ok(Err(message)) => return fail(args.target.json, &message, &config.secrets(), EXIT_USAGE),
        // Said by `open`, as for any command.
        Err(_) => None,
    };
    if let Some((from, to, by)) = range {
        return get_range(&args, config, (from, to, by)).await;
    }
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match ledger.value(args.key.as_str()).await {
        Ok(value) => {
            if args.target.json {
                out!("{}", outcome::exact_json(&args.key, &value));
            } else {
                out!(
                    "{}/{}: {} ({} folded, {} in {})",
                    ledger.spec().name,
                    crate::document::shown(&args.key),
                    value.value,
                    value.folded,
                    value.unfolded,
                    counted(value.unfolded_events, "unfolded event", "unfolded events")
                );
            }
            ExitCode::from(EXIT_OK)
        }
        Err(err) => fail(
            args.target.json,
            &store.explain(&err),
            &config.secrets(),
            exit_code_for(&err),
        ),
    };
    store.shutdown().await;
    code
}

/// The range `get` reads: `None` for one counter. A usage error for a range
/// asked of a collection without buckets, a bucketed collection read
/// without one, or a time or width the collection cannot take.
fn range_asked(
    args: &GetArgs,
    spec: &CollectionConfig,
) -> Result<Option<(SystemTime, SystemTime, Option<BucketWidth>)>, String> {
    let Some(buckets) = &spec.buckets else {
        return match args.from {
            None => Ok(None),
            Some(_) => Err(format!(
                "--from: collection {} has no buckets, so {} has one counter for all time; leave --from, --to and --by out",
                spec.name,
                crate::document::shown(&args.key)
            )),
        };
    };
    let (Some(from), Some(to)) = (&args.from, &args.to) else {
        return Err(format!(
            "collection {} counts by {} buckets: {} has a counter per bucket and none for all time; read its buckets with --from TIME --to TIME (and --by a coarser width to sum them)",
            spec.name,
            buckets.width(),
            crate::document::shown(&args.key)
        ));
    };
    let from = buckets
        .parse_time(from)
        .map_err(|err| format!("--from: {err}"))?;
    let to = buckets
        .parse_time(to)
        .map_err(|err| format!("--to: {err}"))?;
    if from >= to {
        return Err(format!(
            "--from {} is not before --to {}: the range holds no bucket",
            buckets.show_time(from),
            buckets.show_time(to)
        ));
    }
    if let Some(by) = args.by {
        buckets.by(by).map_err(|err| format!("--by: {err}"))?;
    }
    Ok(Some((from, to, args.by)))
}

/// `get KEY --from T --to T [--by W]`: the key's buckets, each exact.
async fn get_range(
    args: &GetArgs,
    config: &Config,
    (from, to, by): (SystemTime, SystemTime, Option<BucketWidth>),
) -> ExitCode {
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match ledger.values_between(args.key.as_str(), from, to, by).await {
        Ok(read) => {
            let buckets = ledger
                .spec()
                .buckets
                .clone()
                .expect("a range read is bucketed");
            let shown = |at| buckets.show_time(at);
            if args.target.json {
                let read = outcome::range_json(&args.key, (from, to), &read, &buckets);
                out!("{read}");
            } else {
                out!(
                    "{}/{} from {} to {}: {} ({} buckets)",
                    ledger.spec().name,
                    crate::document::shown(&args.key),
                    shown(from),
                    shown(to),
                    read.total,
                    read.by
                );
                for bucket in &read.buckets {
                    let closed = if bucket.closed { "  closed" } else { "" };
                    out!("  {}  {}{closed}", shown(bucket.start), bucket.value);
                }
                if read.buckets.is_empty() {
                    out!(
                        "  (no {} bucket starts in this range: a bucket is read whole, by its \
                         start; move --from back to the start of the one you want)",
                        read.by
                    );
                }
            }
            ExitCode::from(EXIT_OK)
        }
        // The caller's range or key (too many buckets, a key that cannot
        // be one): a usage error, nothing was read.
        Err(crate::error::Error::InvalidArgument(why)) => {
            fail(args.target.json, &why, &config.secrets(), EXIT_USAGE)
        }
        Err(err) => fail(
            args.target.json,
            &store.explain(&err),
            &config.secrets(),
            exit_code_for(&err),
        ),
    };
    store.shutdown().await;
    code
}

/// `status`'s ledger lines: per collection with a ledger, its backlog
/// (unfolded events, the oldest one's age, the held sums) and the indexes
/// it lacks.
pub(super) async fn backlogs(
    store: &Store,
    config: &Config,
    names: &[String],
    now: SystemTime,
) -> Result<Vec<Value>, Error> {
    let mut rows = Vec::new();
    for name in names {
        let spec = config.collection(name);
        if spec.events_collection.is_none() {
            continue;
        }
        let ledger = Ledger::new(store, spec.clone());
        let missing = ledger.missing_indexes().await?;
        let events = spec.events_collection_name();
        let backlog = match EventFold::new(store, spec, EventFoldSettings::default())
            .backlog(now)
            .await
        {
            Ok(backlog) => backlog,
            Err(err @ (Error::FoldStopped { .. } | Error::HistoryLost { .. })) => {
                rows.push(json!({
                    "collection": name,
                    "events_collection": events,
                    "stopped": err.to_string(),
                    "missing_indexes": missing,
                }));
                continue;
            }
            Err(err) => return Err(err),
        };
        let held: Vec<Value> = backlog
            .held
            .iter()
            .map(|h| json!({ "key": display_id(&h.key), "pass": h.pass, "amount": h.amount, "events": h.events, "cause": h.cause }))
            .collect();
        rows.push(json!({
            "collection": name,
            "events_collection": events,
            "unfolded_events": backlog.events,
            "oldest_unfolded_age_seconds": backlog.oldest_age.map(|a| a.as_secs()),
            "fold_position_age_seconds": backlog.position_age.map(|a| a.as_secs()),
            "catching_up": backlog.catching_up,
            "held_sums": held,
            "missing_indexes": missing,
        }));
    }
    Ok(rows)
}

/// Prints [`backlogs`] as text.
pub(super) fn print_backlogs(rows: &[Value]) {
    for row in rows {
        if let Some(stopped) = row["stopped"].as_str() {
            out!(
                "ledger {}: STOPPED: {stopped}",
                row["events_collection"].as_str().unwrap_or_default()
            );
            continue;
        }
        let oldest = row["oldest_unfolded_age_seconds"].as_u64().map_or_else(
            || "-".to_owned(),
            |s| humantime::format_duration(Duration::from_secs(s)).to_string(),
        );
        let missing: Vec<&str> = row["missing_indexes"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let indexes = if missing.is_empty() {
            "indexes ok".to_owned()
        } else {
            format!(
                "missing indexes {} (run `{}`)",
                missing.join(", "),
                shown_command("setup")
            )
        };
        let held = row["held_sums"].as_array().map_or(0, Vec::len);
        let held = if held == 0 {
            String::new()
        } else {
            let keys: Vec<&str> = row["held_sums"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|h| h["key"].as_str())
                .collect();
            format!(
                "; {} held by counters that refused them ({})",
                counted(held as u64, "sum", "sums"),
                keys.join(", ")
            )
        };
        let position = match (
            row["catching_up"].as_bool(),
            row["fold_position_age_seconds"].as_u64(),
        ) {
            (Some(true), _) => "; catching up (its first fold, an upgrade or fold-from)".to_owned(),
            (_, Some(age)) => format!(
                "; fold position {} behind",
                humantime::format_duration(Duration::from_secs(age))
            ),
            _ => String::new(),
        };
        out!(
            "ledger {}: {}, oldest {oldest}{held}{position}; {indexes}",
            row["events_collection"].as_str().unwrap_or_default(),
            counted(
                row["unfolded_events"].as_u64().unwrap_or_default(),
                "unfolded event",
                "unfolded events"
            ),
        );
    }
}
