//! `tallyd run` and `tallyd status`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{EXIT_CONFIG, EXIT_FAILED, EXIT_OK, fail};
use crate::config::Config;
use crate::daemon::{self, DaemonError};

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

/// Runs the daemon until SIGTERM or SIGINT.
pub(super) async fn run(config: Config) -> ExitCode {
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let secrets = config.secrets();
    match daemon::run(config, shutdown).await {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(DaemonError::Config(message)) => {
            eprintln!("invalid configuration: {}", secrets.scrub(&message));
            ExitCode::from(EXIT_CONFIG)
        }
        Err(DaemonError::Start(message)) => {
            tracing::error!(cause = %secrets.scrub(&message), "cannot start");
            eprintln!("error: {}", secrets.scrub(&message));
            ExitCode::from(EXIT_FAILED)
        }
    }
}

async fn stop_on_signal(shutdown: CancellationToken) {
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(err) => {
                tracing::error!(cause = %err, "cannot listen for SIGTERM");
                return;
            }
        };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
    shutdown.cancel();
}

/// Per collection: documents with pending tokens, pending tokens, stuck
/// tokens (older than `[alerts] stuck_after`), the oldest age, malformed
/// documents.
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
                })
            })
            .collect();
        let stuck_after = config.alerts.stuck_after.as_secs();
        println!(
            "{}",
            json!({ "stuck_after_seconds": stuck_after, "collections": collections })
        );
    } else {
        println!(
            "{:<24} {:>10} {:>10} {:>8} {:>14} {:>9}",
            "collection", "documents", "pending", "stuck", "oldest", "malformed"
        );
        for (name, s) in &rows {
            let oldest = s
                .oldest_pending
                .map(|t| {
                    humantime::format_duration(Duration::from_secs(t.age(now).as_secs()))
                        .to_string()
                })
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<24} {:>10} {:>10} {:>8} {:>14} {:>9}",
                name, s.documents_pending, s.pending_tokens, s.stale_tokens, oldest, s.malformed
            );
        }
        println!(
            "(stuck: older than {}; documents: holding pending tokens)",
            humantime::format_duration(config.alerts.stuck_after)
        );
    }
    ExitCode::from(EXIT_OK)
}
