//! A command's connection: the client for the configured server, and what
//! the command says while no server answers.

use std::process::ExitCode;

use super::{EXIT_CONFIG, fail};
use crate::config::Config;
use crate::redact::Secrets;
use crate::store::Store;

/// A client for the configured server, or the exit code of a URI that
/// cannot be used (printed; 78: the configuration must change).
pub(super) async fn connect(config: &Config, json: bool) -> Result<Store, ExitCode> {
    let secrets = config.secrets();
    let store = Store::connect(&config.mongodb)
        .await
        .map_err(|err| fail(json, &err.to_string(), &secrets, EXIT_CONFIG))?;
    tokio::spawn(watch_while_unreachable(
        store.clone(),
        config.mongodb.server_selection_timeout,
        json,
        secrets,
    ));
    Ok(store)
}

/// How long a command waits for a server before it says so on standard
/// error, and how often it says so again.
const UNANSWERED_FIRST: std::time::Duration = std::time::Duration::from_secs(2);
const UNANSWERED_AGAIN: std::time::Duration = std::time::Duration::from_secs(5);
/// How often a command looks at what the driver's monitoring found.
const UNANSWERED_LOOK: std::time::Duration = std::time::Duration::from_millis(100);

/// Says on standard error, from 2 s on and every 5 s, that MongoDB has not
/// answered and why — while every host of the connection string failed its
/// last try — instead of a silence as long as server selection. When the
/// hosts that answer belong to another replica set than the connection
/// string names, waiting cannot help (the driver selects none of them, so
/// nothing was sent): the command stops at once, with that error and exit
/// 78, instead of waiting out server selection. Ends with the command (the
/// runtime stops with it).
async fn watch_while_unreachable(
    store: Store,
    selection: std::time::Duration,
    json: bool,
    secrets: Secrets,
) {
    let started = tokio::time::Instant::now();
    let mut next_said = started + UNANSWERED_FIRST;
    // Since when every host has failed: what "has not answered for" says
    // (a long command, such as `record --from`, may meet an outage late).
    let mut unanswered_since: Option<tokio::time::Instant> = None;
    let mut answered = false;
    loop {
        if store.seems_reachable() {
            unanswered_since = None;
            answered |= store.answered();
        } else if unanswered_since.is_none() {
            // Never answered: since the command began; else since now.
            unanswered_since = Some(if answered {
                tokio::time::Instant::now()
            } else {
                started
            });
        }
        if let Some(other) = store.in_another_set() {
            let message = format!(
                "{other}; waiting will not help, so the command stops here (nothing was sent)"
            );
            fail(json, &message, &secrets, EXIT_CONFIG);
            std::process::exit(i32::from(EXIT_CONFIG));
        }
        if tokio::time::Instant::now() >= next_said {
            if let Some(since) = unanswered_since {
                eprintln!(
                    "tallyd: {}; still trying (each operation gives up after {} without an \
                     answer)",
                    store.unanswered(since.elapsed()),
                    crate::error::human_duration(selection)
                );
            }
            next_said += UNANSWERED_AGAIN;
        }
        tokio::time::sleep(UNANSWERED_LOOK).await;
    }
}
