//! `tallyd run` (with its signals) and `tallyd status`.

use crate::cli::out;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tokio::sync::mpsc;

use super::{Cli, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, fail};
use crate::config::Config;
use crate::daemon::{self, Command, DaemonError};
use crate::logging::Logging;

/// `tallyd status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Only this collection (repeatable). Default: every configured
    /// collection.
    #[arg(long = "collection", value_name = "NAME")]
    pub(crate) collections: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Runs the daemon until SIGTERM or SIGINT; SIGHUP reloads the
/// configuration from where it was loaded.
pub(super) async fn run(cli: &Cli, config: Config, logging: &Logging) -> ExitCode {
    let secrets = config.secrets();
    let commands = match listen_for_signals() {
        Ok(commands) => commands,
        Err(err) => {
            eprintln!("error: cannot listen for signals: {err}");
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
    );
    match supervised.await {
        Ok(drained) if drained.is_clean() => ExitCode::from(EXIT_OK),
        Ok(drained) => {
            let not_done = secrets.scrub(&drained.not_done.join("; "));
            tracing::error!(not_done = %not_done, "stopped, but not everything was saved");
            eprintln!("error: stopped, but not saved or not finished: {not_done}");
            ExitCode::from(EXIT_FAILED)
        }
        Err(DaemonError::Config(message)) => {
            let message = secrets.scrub(&message);
            tracing::error!(cause = %message, "cannot start: the configuration must be fixed");
            eprintln!("invalid configuration: {message}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(DaemonError::Start(message)) => {
            let message = secrets.scrub(&message);
            tracing::error!(cause = %message, "cannot start");
            eprintln!("error: {message}");
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
pub(super) async fn status(args: StatusArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let (names, reconciler, now, store) =
        match super::survey_setup(&args.collections, args.json, config).await {
            Ok(setup) => setup,
            Err(code) => return code,
        };
    let stuck_before = now
        .checked_sub(config.alerts.stuck_after)
        .unwrap_or(std::time::UNIX_EPOCH);
    let mut rows = Vec::new();
    for name in &names {
        let target = config.fold_target(name);
        match reconciler.survey(&target, stuck_before).await {
            Ok(survey) => rows.push((name.clone(), survey)),
            Err(err) => {
                store.shutdown().await;
                return fail(args.json, &format!("{name}: {err}"), &secrets);
            }
        }
    }
    let ledgers = match super::ledger::backlogs(&store, config, &names, now).await {
        Ok(ledgers) => ledgers,
        Err(err) => {
            store.shutdown().await;
            return fail(args.json, &err.to_string(), &secrets);
        }
    };
    drop(reconciler);
    store.shutdown().await;
    if args.json {
        let collections: Vec<_> = rows
            .iter()
            .map(|(name, s)| {
                json!({
                    "collection": name,
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
                })
            })
            .collect();
        let stuck_after = config.alerts.stuck_after.as_secs();
        out!(
            "{}",
            json!({ "stuck_after_seconds": stuck_after, "collections": collections, "ledgers": ledgers })
        );
    } else {
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
        for (name, s) in &rows {
            let oldest = s
                .oldest_pending
                .map(|t| {
                    humantime::format_duration(Duration::from_secs(t.age(now).as_secs()))
                        .to_string()
                })
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
            "(stuck: older than {}; documents: holding pending tokens; lane docs: holding \
             writer lane entries; largest: the largest lane map)",
            humantime::format_duration(config.alerts.stuck_after)
        );
        for (name, s) in &rows {
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
                out!("  {lane:?}  {position}");
            }
        }
        super::ledger::print_backlogs(&ledgers);
    }
    ExitCode::from(EXIT_OK)
}
