//! The daemon's life in one process: run it, stop it, or reload it.
//!
//! The command line turns signals into [`Command`]s: SIGTERM and SIGINT
//! stop, SIGHUP reloads. A reload reads the configuration again; when it is
//! invalid, every bad key is logged and the daemon runs on with the old
//! one. When it is valid, the daemon drains exactly as for a stop (the
//! running fold batch finishes, the stream positions are saved, the lease
//! is released) and starts again with the new configuration, keeping its
//! metrics and which alerts fire. systemd hears `RELOADING=1`, then
//! `READY=1` once the new configuration reached MongoDB; `STOPPING=1` only
//! for a stop. `WATCHDOG=1` goes out all along, reloads included.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigErrors};
use crate::daemon::clock::Clock;
use crate::daemon::{DaemonError, Drained, Kept, run};

/// What the daemon is asked to do from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// Drain and exit.
    Stop,
    /// Read the configuration again; drain and start again with it if it is
    /// valid.
    Reload,
}

/// Runs the daemon with `config` until a [`Command::Stop`] (or the end of
/// `commands`), reloading with what `load` returns at each
/// [`Command::Reload`]; `on_reload` is called with each configuration that
/// takes over (the command line applies its log settings). `clock` is this
/// host's clock, as the skew against the server's is measured. Returns what
/// the final drain could not do, or why the daemon could not start.
pub(crate) async fn supervise(
    mut config: Config,
    clock: Clock,
    mut load: impl FnMut() -> Result<Config, ConfigErrors>,
    mut on_reload: impl FnMut(&Config),
    mut commands: mpsc::UnboundedReceiver<Command>,
) -> Result<Drained, DaemonError> {
    let kept = Kept::with_clock(clock);
    let alive = CancellationToken::new();
    let _stop_watchdog = alive.clone().drop_guard();
    if let Some(interval) = sd_notify::watchdog_enabled() {
        tokio::spawn(watchdog(interval / 2, alive.clone()));
    }
    loop {
        let shutdown = CancellationToken::new();
        let mut running = Box::pin(run(config.clone(), kept.clone(), shutdown.clone()));
        let next = loop {
            tokio::select! {
                // The daemon returns on its own only when it cannot start.
                ended = &mut running => return ended,
                command = commands.recv() => match command {
                    None | Some(Command::Stop) => {
                        notify_systemd(&[sd_notify::NotifyState::Stopping]);
                        shutdown.cancel();
                        return running.await;
                    }
                    Some(Command::Reload) => match load() {
                        Ok(next) => break next,
                        Err(errors) => refuse(&errors),
                    },
                },
            }
        };
        let mut reloading = vec![sd_notify::NotifyState::Reloading];
        reloading.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
        notify_systemd(&reloading);
        tracing::info!("reloading the configuration: draining first");
        shutdown.cancel();
        let drained = running.await?;
        if !drained.is_clean() {
            tracing::warn!(not_done = %drained.not_done.join("; "), "the reload's drain was not complete");
        }
        if let Ok(Command::Stop) = commands.try_recv() {
            return Ok(drained);
        }
        on_reload(&next);
        config = next;
        tracing::info!("configuration reloaded; starting again");
    }
}

/// Logs a configuration a reload refused, key by key.
fn refuse(errors: &ConfigErrors) {
    for issue in &errors.issues {
        tracing::error!(key = %issue.key, problem = %issue.message, "bad configuration key");
    }
    tracing::error!(
        problems = errors.issues.len(),
        "configuration not reloaded: running on with the previous one"
    );
}

/// Tells systemd about the daemon's state (ignored when not run by it).
pub(crate) fn notify_systemd(states: &[sd_notify::NotifyState]) {
    if let Err(err) = sd_notify::notify(states) {
        tracing::warn!(cause = %err, "cannot notify systemd");
    }
}

/// Tells systemd the daemon is alive, every `every`, until `alive` ends.
async fn watchdog(every: Duration, alive: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            () = alive.cancelled() => return,
            _ = tick.tick() => notify_systemd(&[sd_notify::NotifyState::Watchdog]),
        }
    }
}
