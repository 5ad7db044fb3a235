//! `tallyd run`: the long-running daemon (DESIGN §6).
//!
//! [`run`] wires the parts together and drives them until `shutdown`:
//!
//! - the HTTP endpoints ([`http`]) — bound first, so a taken port fails the
//!   start at once;
//! - waiting for MongoDB (READY=1 to systemd once it answers, WATCHDOG=1 at
//!   half the watchdog interval from then on);
//! - the lease ([`lease`], with `[ha]`), deciding whether this
//!   instance folds and alerts;
//! - the monitor ([`monitor`]), the live view of pending tokens;
//! - the [`runner`]: reconcile runs requested by the [`schedule`], by the
//!   catch-up at start (and on becoming active), by a repair, or by its own
//!   retry of a failed run — one at a time, never overlapping;
//! - the [`evaluator`]: every second, [`metrics`] and [`alert`]s from the
//!   view.
//!
//! The daemon's own records (last successful runs, resume tokens, the
//! lease) live in MongoDB ([`state`]).
//!
//! At shutdown (SIGTERM/SIGINT) no new run starts, a running fold finishes
//! its batch, the monitors save their resume tokens, the lease is released
//! — all within `[daemon] shutdown_timeout`.

pub(crate) mod alert;
mod evaluator;
mod http;
mod lease;
pub(crate) mod metrics;
pub(crate) mod monitor;
mod runner;
pub(crate) mod schedule;
mod state;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::reconcile::{FoldTarget, Reconciler};
use crate::redact::Secrets;
use crate::store::Store;
use alert::{AlertOptions, Alerts};
use evaluator::Evaluator;
use http::Readiness;
use lease::{Lease, Role};
use metrics::Metrics;
use monitor::Monitor;
use runner::{Request, Runner};
use schedule::Schedule;
use state::State;

/// Why the daemon could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DaemonError {
    /// The configuration cannot drive a daemon (exit 78).
    #[error("{0}")]
    Config(String),
    /// Something the daemon needs could not be set up.
    #[error("{0}")]
    Start(String),
}

/// Runs the daemon until `shutdown` is cancelled.
pub(crate) async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let schedule =
        Schedule::new(&config.schedule).map_err(|e| DaemonError::Config(e.to_string()))?;
    let secrets = config.secrets();
    let metrics = Metrics::new();
    let tracker = TaskTracker::new();
    let listener = TcpListener::bind(config.http.listen).await.map_err(|err| {
        DaemonError::Start(format!("cannot listen on {}: {err}", config.http.listen))
    })?;
    tracing::info!(listen = %config.http.listen, "serving /metrics, /healthz, /readyz");

    let store = Store::connect(&config.mongodb)
        .await
        .map_err(|err| DaemonError::Start(err.to_string()))?;
    let state = State::new(&store, &config.daemon.state_collection);
    // Without `[ha]` the role never changes; its sender lives as long as
    // this function, so watchers see a steady channel.
    let (_fixed_role, role) = if config.ha.enabled {
        let lease = Lease::new(&store, &state, &config.ha.instance, config.ha.lease_ttl);
        (None, lease.keep(metrics.clone(), shutdown.clone()))
    } else {
        metrics.lease_active.set(1);
        let (sender, receiver) = watch::channel(Role::Active);
        (Some(sender), receiver)
    };
    let readiness = Readiness::new(role.clone());
    tracker.spawn(http::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));

    if !wait_for_server(&store, &secrets, &shutdown).await {
        return drain(tracker, &config, "before MongoDB answered").await;
    }
    readiness.set_connected();
    metrics.ready.set(1);
    notify_systemd(&[sd_notify::NotifyState::Ready]);
    tracing::info!(role = role.borrow().as_str(), "ready");
    if let Some(interval) = sd_notify::watchdog_enabled() {
        tracker.spawn(watchdog(interval / 2, shutdown.clone()));
    }

    let targets: Vec<FoldTarget> = config
        .collections
        .iter()
        .map(|c| config.fold_target(&c.name))
        .collect();
    let alert_options = AlertOptions {
        instance: Some(config.ha.instance.clone()),
        ..AlertOptions::default()
    };
    let alerts = Alerts::start_with(
        &config.alerts,
        secrets.clone(),
        metrics.clone(),
        &tracker,
        shutdown.clone(),
        alert_options,
    );
    let monitor = Monitor::start(
        &store,
        &state,
        &targets,
        config.monitor,
        &metrics,
        &tracker,
        &shutdown,
    );

    let (requests, inbox) = mpsc::channel::<Request>(16);
    let busy = Arc::new(AtomicBool::new(false));
    let runner = Runner {
        reconciler: Reconciler::new(&store),
        store: store.clone(),
        state: state.clone(),
        schedule: schedule.clone(),
        catch_up: config.schedule.catch_up,
        targets: targets.clone(),
        metrics: metrics.clone(),
        alerts: alerts.clone(),
        secrets: secrets.clone(),
        role: role.clone(),
        busy: busy.clone(),
        shutdown: shutdown.clone(),
    };
    tracker.spawn(runner.run(inbox));

    let on_tick = {
        let (requests, busy, metrics) = (requests.clone(), busy.clone(), metrics.clone());
        let stopping = shutdown.clone();
        Arc::new(move || {
            if stopping.is_cancelled() {
                return;
            }
            if busy.load(Ordering::Relaxed) || requests.try_send(Request::Scheduled).is_err() {
                metrics.ticks_skipped.inc();
                tracing::warn!("schedule tick skipped: the previous run is still going");
            }
        })
    };
    schedule
        .start(on_tick, shutdown.clone())
        .await
        .map_err(|err| DaemonError::Start(err.to_string()))?;
    if let Some(next) = schedule.next(SystemTime::now()) {
        tracing::info!(next = %humantime::format_rfc3339_seconds(next), "schedule started");
    }

    let evaluator = Evaluator {
        config: config.clone(),
        monitor,
        alerts,
        metrics: metrics.clone(),
        role,
        requests,
        last_repair: HashMap::new(),
    };
    tracker.spawn(evaluator.run(shutdown.clone()));

    shutdown.cancelled().await;
    drain(tracker, &config, "at shutdown").await
}

/// Waits for the tasks to finish their work, up to the shutdown timeout.
async fn drain(tracker: TaskTracker, config: &Config, when: &str) -> Result<(), DaemonError> {
    notify_systemd(&[sd_notify::NotifyState::Stopping]);
    tracing::info!(when, deadline = ?config.daemon.shutdown_timeout, "shutting down");
    tracker.close();
    if tokio::time::timeout(config.daemon.shutdown_timeout, tracker.wait())
        .await
        .is_err()
    {
        tracing::error!(
            deadline = ?config.daemon.shutdown_timeout,
            "the shutdown deadline passed with work still running; exiting anyway (a fold \
             batch that was cut off is applied or not as a whole, and will be folded again)"
        );
    } else {
        tracing::info!("stopped");
    }
    Ok(())
}

/// Waits until the server answers; `false` if shutdown came first.
async fn wait_for_server(store: &Store, secrets: &Secrets, shutdown: &CancellationToken) -> bool {
    let mut backoff = Duration::from_secs(1);
    loop {
        match store.hello().await {
            Ok(_) => return true,
            Err(err) => {
                tracing::warn!(
                    cause = %secrets.scrub(&err.to_string()),
                    retry_in = ?backoff,
                    "waiting for MongoDB"
                );
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

fn notify_systemd(states: &[sd_notify::NotifyState]) {
    if let Err(err) = sd_notify::notify(states) {
        tracing::warn!(cause = %err, "cannot notify systemd");
    }
}

/// Tells systemd the daemon is alive, every `every`, until shutdown.
async fn watchdog(every: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => notify_systemd(&[sd_notify::NotifyState::Watchdog]),
        }
    }
}
