//! `tallyd record` and `tallyd get`: the events ledger from the shell.
//!
//! `record` exits 0 when the event is counted once (recorded, or a
//! duplicate of an earlier recording), 75 when the insert is unknown (run
//! the same command again: safe while the dedupe window lasts), 1 for a
//! conflict (the key was recorded with another counter or amount) and when
//! nothing was recorded.

use crate::cli::out;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use serde_json::{Value, json};

use super::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, TargetArgs, exit_code_for, fail};
use crate::config::Config;
use crate::document::display_id;
use crate::error::Error;
use crate::reconcile::ledger::backlog;
use crate::store::Store;
use crate::write::ledger::{Ledger, Recording};

/// `tallyd record EVENT_KEY COUNTER_KEY [--by N]`.
#[derive(Debug, Args)]
pub(crate) struct RecordArgs {
    /// The event's key (its idempotency key: a message id, a webhook's
    /// event id).
    pub(crate) event: String,
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The amount the event adds; negative subtracts; not zero.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd get KEY`.
#[derive(Debug, Args)]
pub(crate) struct GetArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

async fn open(target: &TargetArgs, config: &Config) -> Result<(Store, Ledger), ExitCode> {
    let (spec, store) = target.open_ledger(config).await?;
    let ledger = Ledger::new(&store, spec);
    Ok((store, ledger))
}

pub(super) async fn record(args: RecordArgs, config: &Config) -> ExitCode {
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let recording = ledger
        .record(args.event.as_str(), args.key.as_str(), args.by)
        .await;
    let secrets = config.secrets();
    let (code, text) = match &recording {
        Recording::Recorded(_) => (EXIT_OK, "recorded: it will be counted once".to_owned()),
        Recording::Duplicate(_) => (
            EXIT_OK,
            "duplicate: recorded before with the same counter and amount; counted once".to_owned(),
        ),
        Recording::Conflict(conflict) => (EXIT_FAILED, format!("conflict: {conflict}")),
        Recording::Unknown(ticket) => (
            EXIT_TEMPFAIL,
            format!(
                "unknown: the insert may or may not have landed ({}); run the same command again",
                ticket
                    .cause()
                    .map_or_else(String::new, |c| secrets.scrub(&c.to_string()))
            ),
        ),
        Recording::NotRecorded(not) => (
            EXIT_FAILED,
            format!("not recorded: {}", secrets.scrub(&not.cause().to_string())),
        ),
    };
    let event = recording.event();
    if args.target.json {
        let mut out = json!({
            "outcome": recording.name(),
            "event": event.key(),
            "key": display_id(event.counter()),
            "amount": event.amount(),
            "collection": ledger.spec().name,
            "events_collection": ledger.spec().events_collection_name(),
        });
        if let Recording::Conflict(conflict) = &recording {
            out["recorded_key"] = json!(display_id(conflict.stored_counter()));
            out["recorded_amount"] = json!(conflict.stored_amount());
        }
        if code != EXIT_OK {
            out["error"] = json!(text);
        }
        out!("{out}");
    } else if code == EXIT_OK {
        out!(
            "{}: event {} on {}/{} by {}",
            text,
            event.key(),
            ledger.spec().name,
            args.key,
            event.amount()
        );
    } else {
        eprintln!(
            "{text} (event {} on {}/{} by {})",
            event.key(),
            ledger.spec().name,
            args.key,
            event.amount()
        );
    }
    store.shutdown().await;
    ExitCode::from(code)
}

pub(super) async fn get(args: GetArgs, config: &Config) -> ExitCode {
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match ledger.value(args.key.as_str()).await {
        Ok(value) => {
            if args.target.json {
                out!(
                    "{}",
                    json!({
                        "key": args.key,
                        "value": value.value,
                        "folded": value.folded,
                        "unfolded": value.unfolded,
                        "unfolded_events": value.unfolded_events,
                    })
                );
            } else {
                out!(
                    "{}/{}: {} ({} folded, {} in {} unfolded events)",
                    ledger.spec().name,
                    args.key,
                    value.value,
                    value.folded,
                    value.unfolded,
                    value.unfolded_events
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

/// `status`'s ledger lines: per collection with a ledger, its backlog
/// (unfolded events, the oldest one's age) and the indexes it lacks.
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
        let missing = ledger
            .missing_indexes(config.reconcile.event_retention)
            .await?;
        let events = spec.events_collection_name();
        let backlog = backlog(store, &events, now).await?;
        rows.push(json!({
            "collection": name,
            "events_collection": events,
            "unfolded_events": backlog.events,
            "oldest_unfolded_age_seconds": backlog.oldest_age.map(|a| a.as_secs()),
            "missing_indexes": missing,
        }));
    }
    Ok(rows)
}

/// Prints [`backlogs`] as text.
pub(super) fn print_backlogs(rows: &[Value]) {
    for row in rows {
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
            format!("missing indexes {} (run tallyd setup)", missing.join(", "))
        };
        out!(
            "ledger {}: {} unfolded events, oldest {oldest}; {indexes}",
            row["events_collection"].as_str().unwrap_or_default(),
            row["unfolded_events"],
        );
    }
}
