//! `tallyd run` (with its signals) and `tallyd status`.

use crate::cli::out;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{
    Cli, CollectionsArgs, EXIT_CONFIG, EXIT_FAILED, EXIT_NOPERM, EXIT_OK, database, exit_code_for,
    fail, fail_with,
};
use crate::config::Config;
use crate::daemon::{self, Command, DaemonError};
use crate::error::{human_duration, words};
use crate::logging::Logging;
use crate::reconcile::{OpenBuckets, Survey};

/// `tallyd status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) which: CollectionsArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Exit 1 when something needs attention — stuck tokens, malformed
    /// documents, a ledger's events unfolded for longer than `[alerts]
    /// stuck_after`, a ledger lacking its indexes — for scripts and
    /// monitoring checks (the output says what).
    #[arg(long)]
    pub(crate) check: bool,
}

/// Runs the daemon until SIGTERM or SIGINT; SIGHUP reloads the
/// configuration from where it was loaded. How it ended is logged once
/// (the log is standard error: the journal under systemd).
pub(super) async fn run(cli: &Cli, config: Config, logging: &Logging) -> ExitCode {
    let secrets = config.secrets();
    let commands = match listen_for_signals() {
        Ok(commands) => commands,
        Err(err) => {
            tracing::error!(cause = %err, "cannot start: cannot listen for signals");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let load = || cli.load_config(std::env::vars());
    let supervised = daemon::supervise(
        config,
        cli.clock(),
        load,
        |new| logging.apply(new),
        commands,
        Some(|store, config| Box::pin(super::shard_key_refusal(store, config))),
    );
    match supervised.await {
        Ok(drained) if drained.is_clean() => ExitCode::from(EXIT_OK),
        Ok(drained) => {
            let not_done = secrets.scrub(&drained.not_done.join("; "));
            tracing::error!("stopped, but not saved or not finished: {not_done}");
            ExitCode::from(EXIT_FAILED)
        }
        Err(DaemonError::Config(message)) => {
            let message = secrets.scrub(&message);
            tracing::error!("cannot start, the configuration must be fixed: {message}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(DaemonError::Denied(message)) => {
            let message = secrets.scrub(&message);
            tracing::error!("cannot start, permission denied: {message}");
            ExitCode::from(EXIT_NOPERM)
        }
        Err(DaemonError::Start(message)) => {
            let message = secrets.scrub(&message);
            tracing::error!("cannot start: {message}");
            ExitCode::from(EXIT_FAILED)
        }
    }
}

/// Turns SIGTERM and SIGINT into [`Command::Stop`], SIGHUP into
/// [`Command::Reload`]. The handlers are installed before this returns, so
/// a SIGHUP from then on never takes the process down.
fn listen_for_signals() -> std::io::Result<mpsc::UnboundedReceiver<Command>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let command = tokio::select! {
                _ = terminate.recv() => {
                    tracing::info!("SIGTERM received");
                    Command::Stop
                }
                _ = interrupt.recv() => {
                    tracing::info!("SIGINT received");
                    Command::Stop
                }
                _ = hangup.recv() => {
                    tracing::info!("SIGHUP received: reloading the configuration");
                    Command::Reload
                }
            };
            if sender.send(command).is_err() {
                return;
            }
        }
    });
    Ok(receiver)
}

/// Per collection: documents with pending tokens, pending tokens, stuck
/// tokens (older than `[alerts] stuck_after`), the oldest age, malformed
/// documents; documents with lane entries, lane entries, the largest lane
/// map and the named lanes (never pruned) with their highest positions.
/// First, the server and database it reads; a database that holds none of
/// the collections (nor their ledgers' events, nor the daemon's state) is
/// said so and exits 78 — a misspelt `[mongodb] database` must not pass
/// for a clean one. With `--check`, exit 1 when something needs attention.
pub(super) async fn status(args: StatusArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let (names, reconciler, now, store) =
        match super::survey_setup(&args.which, args.json, config).await {
            Ok(setup) => setup,
            Err(code) => return code,
        };
    let mut wanted = names.clone();
    for name in &names {
        let spec = config.collection(name);
        if spec.events_collection.is_some() {
            wanted.push(spec.events_collection_name());
        }
    }
    wanted.push(config.daemon.state_collection.clone());
    let existing = match database::existing(&store, &wanted).await {
        Ok(existing) => existing,
        Err(err) => {
            let code = fail_with(args.json, &err, &store, &secrets);
            store.shutdown().await;
            return code;
        }
    };
    let stuck_before = now
        .checked_sub(config.alerts.stuck_after)
        .unwrap_or(std::time::UNIX_EPOCH);
    let mut rows = Vec::new();
    let mut open = Vec::new();
    for name in &names {
        let target = config.fold_target(name);
        let read = async {
            let survey = reconciler.survey(&target, stuck_before).await?;
            let buckets = reconciler.open_buckets(&target, now).await?;
            Ok::<_, crate::error::Error>((survey, buckets))
        };
        match read.await {
            Ok((survey, buckets)) => {
                rows.push((name.clone(), survey));
                open.extend(buckets.map(|b| (name.clone(), b)));
            }
            Err(err) => {
                let message = format!("{name}: {}", store.explain(&err));
                store.shutdown().await;
                return fail(args.json, &message, &secrets, exit_code_for(&err));
            }
        }
    }
    let ledgers = match super::ledger::backlogs(&store, config, &names, now).await {
        Ok(ledgers) => ledgers,
        Err(err) => {
            let code = fail_with(args.json, &err, &store, &secrets);
            store.shutdown().await;
            return code;
        }
    };
    drop(reconciler);
    let attention = attention(&rows, &ledgers, config.alerts.stuck_after);
    let missing = |name: &String| existing.as_ref().map(|e| !e.contains(name));
    let holds_none = existing
        .as_ref()
        .is_some_and(Vec::is_empty)
        .then(|| database::holds_none(&store, &names));
    if args.json {
        let collections: Vec<_> = rows
            .iter()
            .map(|(name, s)| {
                json!({
                    "collection": name,
                    "exists": missing(name).map(|m| !m),
                    "documents_pending": s.documents_pending,
                    "pending_tokens": s.pending_tokens,
                    "stuck_tokens": s.stale_tokens,
                    "stuck_documents": s.documents_stale,
                    "oldest_pending_age_seconds": s.oldest_pending.map(|t| t.age(now).as_secs()),
                    "largest_pending": s.largest_pending,
                    "malformed": s.malformed,
                    "malformed_sample": s.malformed_sample,
                    "documents_with_lanes": s.documents_with_lanes,
                    "lane_entries": s.lane_entries,
                    "largest_lane_map": s.largest_lane_map,
                    "named_lane_entries": s.named_lane_entries,
                    "named_lanes": s.named_lanes,
                    "named_lanes_truncated": s.named_lanes_truncated,
                    "buckets": open_json(config, name, &open),
                })
            })
            .collect();
        let stuck_after = config.alerts.stuck_after.as_secs();
        out!(
            "{}",
            json!({
                "server": database::described_json(&store),
                "stuck_after_seconds": stuck_after,
                "collections": collections,
                "ledgers": ledgers,
                "attention": attention,
                "error": holds_none,
            })
        );
    } else if let Some(message) = &holds_none {
        // Nothing else is worth reading (every count is 0, every index
        // missing), and setup's advice would create the misspelt name.
        out!("{}", database::described(&store));
        eprintln!("error: {}", secrets.scrub(message));
    } else {
        out!("{}", database::described(&store));
        print_table(&rows, now, config);
        print_open(config, &open);
        for name in names.iter().filter(|n| missing(n) == Some(true)) {
            out!("{name}: no such collection in this database yet");
        }
        super::ledger::print_backlogs(&ledgers);
        if !attention.is_empty() {
            out!("needs attention: {}", attention.join("; "));
        }
    }
    store.shutdown().await;
    ExitCode::from(match holds_none {
        Some(_) => EXIT_CONFIG,
        None if args.check && !attention.is_empty() => EXIT_FAILED,
        None => EXIT_OK,
    })
}

/// `status`'s table, and the named lanes below it.
fn print_table(rows: &[(String, Survey)], now: SystemTime, config: &Config) {
    out!(
        "{:<24} {:>10} {:>10} {:>8} {:>14} {:>9} {:>10} {:>8} {:>8}",
        "collection",
        "documents",
        "pending",
        "stuck",
        "oldest",
        "malformed",
        "lane docs",
        "lanes",
        "largest"
    );
    for (name, s) in rows {
        let oldest = s
            .oldest_pending
            .map(|t| human_duration(t.age(now)))
            .unwrap_or_else(|| "-".into());
        out!(
            "{:<24} {:>10} {:>10} {:>8} {:>14} {:>9} {:>10} {:>8} {:>8}",
            name,
            s.documents_pending,
            s.pending_tokens,
            s.stale_tokens,
            oldest,
            s.malformed,
            s.documents_with_lanes,
            s.lane_entries,
            s.largest_lane_map
        );
    }
    out!(
        "(stuck: older than {}; documents: holding pending tokens; pending: their entries, a \
         token stored twice counted twice; lane docs: holding \
         writer lane entries; largest: the largest lane map)",
        human_duration(config.alerts.stuck_after)
    );
    for (name, s) in rows {
        if s.named_lanes.is_empty() {
            continue;
        }
        let more = if s.named_lanes_truncated {
            " (the first names only)"
        } else {
            ""
        };
        out!("\n{name}: named lanes (never pruned), highest position{more}:");
        for (lane, position) in &s.named_lanes {
            out!("  {lane}  {position}{}", whose(lane));
        }
    }
}

/// A bucketed collection's open buckets, for `status --json`; `null`
/// without buckets.
fn open_json(config: &Config, name: &str, open: &[(String, OpenBuckets)]) -> Value {
    let Some(buckets) = &config.collection(name).buckets else {
        return Value::Null;
    };
    open.iter()
        .find(|(n, _)| n == name)
        .map_or(Value::Null, |(_, o)| {
            json!({
                "open": o.open,
                "oldest_open": o.oldest_open.map(|t| buckets.show_time(t)),
                "past_closing_time": o.past_closing_time,
            })
        })
}

/// One line per bucketed collection: its open buckets, the oldest, and
/// those past their closing time.
fn print_open(config: &Config, open: &[(String, OpenBuckets)]) {
    for (name, o) in open {
        let Some(buckets) = &config.collection(name).buckets else {
            continue;
        };
        let oldest = o
            .oldest_open
            .map(|t| format!(", the oldest from {}", buckets.show_time(t)))
            .unwrap_or_default();
        let past = match o.past_closing_time {
            0 => String::new(),
            n => format!(
                "; {n} past their closing time (each reconcile run closes those it can and names \
                 the others)"
            ),
        };
        let plural = if o.open == 1 { "" } else { "s" };
        out!(
            "{name}: {} {} bucket{plural} open{oldest}{past}",
            o.open,
            buckets.width()
        );
    }
}

/// Whose a named lane is, where tally made it: the fold of a ledger
/// writes its counters through `fold:<events collection>`, one position
/// per pass.
fn whose(lane: &str) -> String {
    match crate::ledger::folded_by(lane) {
        Some(events) => {
            format!("  (the fold of the ledger {events}: its latest pass to write here)")
        }
        None => String::new(),
    }
}

/// What needs someone's attention, one phrase each: stuck tokens,
/// malformed documents, a ledger's events left unfolded for longer than
/// `stuck_after` (the fold is continuous), a ledger whose fold stopped, a
/// ledger lacking its indexes (the daemon refuses to fold it). `status
/// --check` exits 1 on any.
fn attention(rows: &[(String, Survey)], ledgers: &[Value], stuck_after: Duration) -> Vec<String> {
    let mut found = Vec::new();
    for (name, s) in rows {
        if s.stale_tokens > 0 {
            found.push(format!("{} stuck tokens in {name}", s.stale_tokens));
        }
        if s.malformed > 0 {
            found.push(format!("{} malformed documents in {name}", s.malformed));
        }
    }
    for ledger in ledgers {
        let events = ledger["events_collection"].as_str().unwrap_or_default();
        if ledger["stopped"].is_string() {
            found.push(format!(
                "the fold of {events} is stopped (run `tallyd fold-from`)"
            ));
        }
        let oldest = ledger["oldest_unfolded_age_seconds"].as_u64();
        if let Some(age) = oldest.filter(|age| *age > stuck_after.as_secs()) {
            found.push(format!(
                "{} events in {events} unfolded, the oldest for {}",
                ledger["unfolded_events"],
                human_duration(Duration::from_secs(age))
            ));
        }
        let missing: Vec<&str> = ledger["missing_indexes"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !missing.is_empty() {
            found.push(format!("{events} lacks the indexes {}", words(&missing)));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::whose;

    #[test]
    fn the_fold_s_lane_is_named_as_the_fold_s() {
        assert_eq!(
            whose("fold:page_views_events"),
            "  (the fold of the ledger page_views_events: its latest pass to write here)"
        );
        assert_eq!(whose("importer"), "");
    }
}
