//! The daemon's life in one process: run it, stop it, or reload it.
//!
//! The command line turns signals into [`Command`]s: SIGTERM and SIGINT
//! stop, SIGHUP reloads. A reload is all or nothing: the new configuration
//! is read, checked and made ready — its `[http] listen` bound (the same
//! address keeps its socket), its MongoDB client built, its credentials
//! tried once — while the daemon runs on. When any of that fails, the daemon
//! runs on with the old configuration, says so in one line, and counts it
//! (`tally_config_reload_failures_total`, `tally_config_last_reload_success`
//! 0). Only then does the daemon drain as for a stop (the running fold batch
//! finishes, the stream positions are saved, the lease is released) and
//! start again on the new configuration, keeping its metrics and which
//! alerts fire. systemd hears `RELOADING=1`, then `READY=1` once the new
//! configuration reached MongoDB; `STOPPING=1` only for a stop.
//! `WATCHDOG=1` goes out all along, reloads included.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigErrors};
use crate::daemon::clock::Clock;
use crate::daemon::{DaemonError, Drained, Kept, Listening, Prepared, Reloading, StartCheck, run};
use crate::error::{counted, words};

/// How long a reload waits for the new server's answer to its credentials;
/// a server that does not answer by then is waited for by the new run, as
/// at a start.
const CREDENTIALS_WITHIN: Duration = Duration::from_secs(5);

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
    config: Config,
    clock: Clock,
    mut load: impl FnMut() -> Result<Config, ConfigErrors>,
    mut on_reload: impl FnMut(&Config),
    mut commands: mpsc::UnboundedReceiver<Command>,
    start_check: Option<StartCheck>,
) -> Result<Drained, DaemonError> {
    let kept = Kept::with_clock(clock, start_check);
    let metrics = kept.metrics.clone();
    let alive = CancellationToken::new();
    let _stop_watchdog = alive.clone().drop_guard();
    if let Some(interval) = sd_notify::watchdog_enabled() {
        tokio::spawn(watchdog(interval / 2, alive.clone()));
    }
    let mut prepared = Prepared::new(config, None).await?;
    let mut reload_again = false;
    loop {
        let shutdown = CancellationToken::new();
        let reloading = Reloading::default();
        let listening = prepared.listening().clone();
        let running_uri = prepared.config().mongodb.uri.expose().to_owned();
        let mut running = Box::pin(run(
            prepared,
            kept.clone(),
            shutdown.clone(),
            reloading.clone(),
        ));
        let next = loop {
            let command = if std::mem::take(&mut reload_again) {
                Some(Command::Reload)
            } else {
                tokio::select! {
                    // The daemon returns on its own only when it cannot start.
                    ended = &mut running => return ended,
                    command = commands.recv() => command,
                }
            };
            match command {
                None | Some(Command::Stop) => {
                    notify_systemd(&[sd_notify::NotifyState::Stopping]);
                    shutdown.cancel();
                    return running.await;
                }
                Some(Command::Reload) => {
                    // The running daemon goes on while the new
                    // configuration is made ready.
                    let ready = tokio::select! {
                        ended = &mut running => return ended,
                        ready = prepare(&mut load, &listening, &running_uri, start_check) => ready,
                    };
                    match ready {
                        Ok(next) => break next,
                        Err(reason) => {
                            metrics.config_reload_failures.inc();
                            metrics.config_last_reload_success.set(0);
                            tracing::error!(
                                "configuration not reloaded, running on with the previous \
                                 one: {reason}"
                            );
                        }
                    }
                }
            }
        };
        let mut reloading_states = vec![sd_notify::NotifyState::Reloading];
        reloading_states.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
        notify_systemd(&reloading_states);
        tracing::info!("the new configuration is ready: draining the previous one's work");
        reloading.set();
        shutdown.cancel();
        let drained = match running.await {
            Ok(drained) => drained,
            Err(err) => {
                next.discard().await;
                return Err(err);
            }
        };
        if !drained.is_clean() {
            tracing::warn!(not_done = %drained.not_done.join("; "), "the reload's drain was not complete");
        }
        // What came during the reload: a stop ends here; a reload (the
        // file changed again) reads the file once more as soon as the new
        // configuration runs — never dropped.
        while let Ok(command) = commands.try_recv() {
            match command {
                Command::Stop => {
                    next.discard().await;
                    return Ok(drained);
                }
                Command::Reload => reload_again = true,
            }
        }
        on_reload(next.config());
        let configured: Vec<&str> = next
            .config()
            .collections
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        metrics.forget_collections_except(&configured);
        metrics.config_last_reload_success.set(1);
        tracing::info!("configuration reloaded; running on the new one");
        prepared = next;
    }
}

/// The configuration `load` reads, made ready to take over from the one
/// serving on `listening` and connected with `running_uri`; why not, in one
/// sentence, when it cannot be (its bad keys are logged one by one first).
async fn prepare(
    load: &mut impl FnMut() -> Result<Config, ConfigErrors>,
    listening: &Listening,
    running_uri: &str,
    start_check: Option<StartCheck>,
) -> Result<Prepared, String> {
    let config = load().map_err(|errors| {
        for issue in &errors.issues {
            tracing::error!(key = %issue.key, problem = %issue.message, "bad configuration key");
        }
        let keys: Vec<&str> = errors.issues.iter().map(|i| i.key.as_str()).collect();
        format!(
            "the new configuration has {} ({}, each said above)",
            counted(keys.len() as u64, "bad key", "bad keys"),
            words(&keys)
        )
    })?;
    let prepared = Prepared::new(config, Some(listening))
        .await
        .map_err(|err| err.to_string())?;
    let new_server = prepared.config().mongodb.uri.expose() != running_uri;
    if let Err(err) = prepared
        .check_credentials(CREDENTIALS_WITHIN, new_server)
        .await
    {
        prepared.discard().await;
        return Err(err.to_string());
    }
    // What the new run would refuse at its start (a shard key that would
    // count twice), refused now: the running daemon keeps its
    // configuration. A server that does not answer in time is not a
    // refusal: the new run checks again at its start.
    if let Some(check) = start_check {
        let checked = tokio::time::timeout(
            CREDENTIALS_WITHIN,
            check(prepared.store(), prepared.config()),
        );
        if let Ok(Err(refusal)) = checked.await {
            prepared.discard().await;
            return Err(refusal);
        }
    }
    Ok(prepared)
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
