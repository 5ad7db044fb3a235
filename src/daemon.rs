//! `tallyd run`: the long-running daemon (the book: design/daemon.md).
//!
//! [`supervise`] ([`supervisor`]) runs the daemon until it is told to stop,
//! and on a reload drains it and starts it again with the new
//! configuration, in the same process. [`run`] wires the parts together
//! and drives them until `shutdown`:
//!
//! - the HTTP endpoints ([`http`]) — bound first, so a taken port fails the
//!   start at once;
//! - waiting for MongoDB (READY=1 to systemd once it answers), then a
//!   periodic `hello` that keeps `/readyz` current ([`readiness`]);
//! - the lease ([`lease`], with `[ha]`), deciding whether this
//!   instance folds and alerts;
//! - the monitor ([`monitor`]), the live view of pending tokens;
//! - the continuous fold of the ledgers ([`ledger`]);
//! - the [`runner`]: reconcile runs requested by the [`schedule`], by the
//!   catch-up at start (and on becoming active), by a repair, or by its own
//!   retry of a failed run — one at a time, never overlapping;
//! - the [`evaluator`]: every second, [`metrics`] and [`alert`]s from the
//!   view, and from this host's [`clock`] against the server's (measured
//!   by the readiness probe).
//!
//! The daemon's own records (last successful runs, resume tokens, the
//! lease) live in MongoDB ([`state`]).
//!
//! At shutdown no new run starts, a running fold finishes its batch, the
//! monitors save their resume tokens, the lease is released — all within
//! `[daemon] shutdown_timeout`; what could not be done is reported
//! ([`Drained`]).

pub(crate) mod alert;
pub(crate) mod api;
pub(crate) mod clock;
mod evaluator;
mod http;
mod lease;
mod ledger;
pub(crate) mod metrics;
pub(crate) mod monitor;
mod prepare;
mod readiness;
mod runner;
pub(crate) mod schedule;
mod state;
mod supervisor;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::error::human_duration;
use crate::reconcile::FoldTarget;
use crate::redact::Secrets;
use crate::store::Store;
use alert::{AlertLedger, AlertOptions, Alerts};
use clock::{Clock, LastSkew};
use evaluator::Evaluator;
use lease::{Lease, Role};
use metrics::Metrics;
use monitor::Monitor;
pub(crate) use prepare::{Listening, Prepared};
use readiness::Readiness;
use runner::{Request, Runner};
use schedule::Schedule;
use state::State;

/// How often a drain looks at whether its work is done.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// How long a drain waits for its work once every host failed its last
/// heartbeat: the monitors' last saves get their second
/// (`LAST_SAVE_UNREACHABLE`), the rest waits for a server that is gone.
const DRAIN_UNREACHABLE: Duration = Duration::from_secs(3);

pub(crate) use supervisor::{Command, supervise};

/// Why the daemon could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DaemonError {
    /// The configuration cannot drive a daemon, or the environment refuses
    /// it in a way only the operator can fix (a taken port): exit 78, do
    /// not restart.
    #[error("{0}")]
    Config(String),
    /// The server refused the credentials: exit 77, do not restart.
    #[error("{0}")]
    Denied(String),
    /// Something the daemon needs could not be set up.
    #[error("{0}")]
    Start(String),
}

/// How a drain ended: what it could not do before the process goes on (a
/// reload) or exits. Secrets are scrubbed from every line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Drained {
    /// What was not saved or not finished, one line each.
    pub(crate) not_done: Vec<String>,
}

impl Drained {
    /// Everything was saved and finished.
    pub(crate) fn is_clean(&self) -> bool {
        self.not_done.is_empty()
    }
}

/// What outlives one run of the daemon when the configuration is reloaded:
/// the metrics (counters keep counting), which alerts fire, and the clock
/// the skew is measured with.
#[derive(Clone, Debug, Default)]
pub(crate) struct Kept {
    metrics: Metrics,
    ledger: AlertLedger,
    clock: Clock,
    start_check: Option<StartCheck>,
}

/// A check the command line gives the daemon, run once a run reached
/// MongoDB and before any work: `Err` says what the deployment or the
/// configuration must fix, and the daemon stops with 78 (`tallyd run`
/// passes `doctor`'s shard-key rules; the daemon names no command-line
/// module).
pub(crate) type StartCheck = for<'a> fn(
    &'a Store,
    &'a Config,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(), String>> + Send + 'a>,
>;

impl Kept {
    /// Nothing kept yet; this host's clock read as `clock` reads it, and
    /// `start_check` run at the start of every run.
    pub(crate) fn with_clock(clock: Clock, start_check: Option<StartCheck>) -> Self {
        Self {
            clock,
            start_check,
            ..Self::default()
        }
    }
}

/// Whether the stop that comes is for a reload (the drain then says so,
/// instead of shutting down).
#[derive(Clone, Debug, Default)]
pub(crate) struct Reloading(Arc<AtomicBool>);

impl Reloading {
    /// The next stop is for a reload.
    pub(crate) fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs the daemon on `prepared` until `shutdown` is cancelled, then drains
/// it (for a reload when `reloading` says so by then).
pub(crate) async fn run(
    prepared: Prepared,
    kept: Kept,
    shutdown: CancellationToken,
    reloading: Reloading,
) -> Result<Drained, DaemonError> {
    let Prepared {
        config,
        schedule,
        listener,
        store,
        api_tls,
    } = prepared;
    let secrets = config.secrets();
    let tracker = TaskTracker::new();
    let served = match listener.socket.try_clone().and_then(TcpListener::from_std) {
        Ok(http) => {
            tracing::info!(listen = %config.http.listen, "serving /metrics, /healthz, /readyz");
            let work = Work {
                config: &config,
                kept,
                shutdown: &shutdown,
                reloading: &reloading,
                store: &store,
                secrets,
                api: listener.api.map(|socket| (*socket, api_tls)),
            };
            serve(work, schedule, tracker, http).await
        }
        Err(err) => Err(DaemonError::Start(format!(
            "cannot serve on {} ([http] listen): {err}",
            config.http.listen
        ))),
    };
    // Every task and handle of the run is gone: the client closes its
    // connections before the runtime goes (a driver task left behind by a
    // dropped client can panic on a closed pool at the runtime's end).
    store.shutdown().await;
    served
}

/// What one run of the daemon works with.
struct Work<'a> {
    config: &'a Config,
    kept: Kept,
    shutdown: &'a CancellationToken,
    reloading: &'a Reloading,
    store: &'a Store,
    secrets: Secrets,
    /// The API's socket and TLS, when `[api]` is on.
    api: Option<(Listening, Option<tokio_rustls::TlsAcceptor>)>,
}

/// The daemon's work on `store`, from the first contact to the drain.
async fn serve(
    work: Work<'_>,
    schedule: Schedule,
    tracker: TaskTracker,
    listener: TcpListener,
) -> Result<Drained, DaemonError> {
    let Work {
        config,
        kept,
        shutdown,
        reloading,
        store,
        secrets,
        api,
    } = work;
    let metrics = kept.metrics.clone();
    let state = State::new(store, &config.daemon.state_collection);
    // Not active before MongoDB answered: with `[ha]` the lease keeper says
    // so once the lease is taken; without it, this instance becomes active
    // at the first contact. The sender of the fixed role lives as long as
    // this function, so watchers see a steady channel.
    metrics.lease_active.set(0);
    let (fixed_role, role) = if config.ha.enabled {
        let lease = Lease::new(store, &state, &config.ha.instance, config.ha.lease_ttl);
        (
            None,
            lease.keep(metrics.clone(), &tracker, shutdown.clone()),
        )
    } else {
        let (sender, receiver) = watch::channel(Role::Standby);
        (Some(sender), receiver)
    };
    let skew = LastSkew::default();
    let margins = clock::margins(config);
    if let Some(tightest) = margins.first() {
        metrics.clock_skew_margin.set(tightest.margin.as_secs_f64());
    }
    let readiness = Readiness::new(role.clone(), metrics.clone(), kept.clock, skew.clone());
    tracker.spawn(http::serve(
        listener,
        metrics.clone(),
        readiness.clone(),
        shutdown.clone(),
    ));
    if let Some((socket, tls)) = api {
        let served = api::Api::new(config, store, readiness.clone(), metrics.clone());
        if let Err(err) = api::serve::start(config, &socket, tls, served, &tracker, shutdown) {
            shutdown.cancel();
            drain(tracker, config, store, CANNOT_START, reloading).await;
            return Err(err);
        }
    }

    let reached = match readiness.first_contact(store, &secrets, shutdown).await {
        Ok(reached) => reached,
        Err(err) => {
            shutdown.cancel();
            drain(tracker, config, store, CANNOT_START, reloading).await;
            return Err(err);
        }
    };
    if !reached {
        return Ok(drain(tracker, config, store, "before MongoDB answered", reloading).await);
    }
    if let Some(check) = kept.start_check
        && let Err(refusal) = check(store, config).await
    {
        shutdown.cancel();
        drain(tracker, config, store, CANNOT_START, reloading).await;
        return Err(DaemonError::Config(refusal));
    }
    let targets: Vec<FoldTarget> = config
        .collections
        .iter()
        .map(|c| config.fold_target(&c.name))
        .collect();
    // Every series an alert rule reads is there before the daemon says it
    // is ready, the last run's included: a restart that needs no run must
    // not leave them out until the next scheduled one.
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = restore(&state, &targets, &metrics, &secrets, store) => {}
    }
    if let Some(fixed) = &fixed_role {
        fixed.send_replace(Role::Active);
        metrics.lease_active.set(1);
    }
    let alert_options = AlertOptions {
        instance: Some(config.ha.instance.clone()),
        ledger: kept.ledger.clone(),
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
    alerts.resolve_unless(|name| targets.iter().any(|t| t.spec.name == name));
    let monitor = Monitor::start(
        store,
        &state,
        &targets,
        config.monitor,
        &metrics,
        &tracker,
        shutdown,
        config.daemon.shutdown_timeout,
    );

    let reconciler = config.reconciler(store);
    ledger::start(
        &reconciler,
        store,
        &targets,
        ledger::Timing {
            fold_delay: config.reconcile.fold_delay,
            scan_interval: config.monitor.scan_interval,
            stuck_after: config.alerts.stuck_after,
            stream_down_after: config.alerts.monitor_down_after,
        },
        &metrics,
        &alerts,
        &role,
        &tracker,
        shutdown,
    );

    let (requests, inbox) = mpsc::channel::<Request>(16);
    let busy = Arc::new(AtomicBool::new(false));
    let runner = Runner {
        reconciler,
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

    let mut evaluator = Evaluator {
        config: config.clone(),
        monitor: monitor.clone(),
        alerts,
        metrics: metrics.clone(),
        role: role.clone(),
        requests,
        last_repair: HashMap::new(),
        skew,
        margins,
    };
    // The view's metrics once before the daemon says it is ready.
    evaluator.evaluate();
    tracker.spawn(evaluator.run(shutdown.clone()));

    readiness.mark_ready();
    tracker.spawn(
        readiness
            .clone()
            .follow(store.clone(), secrets.clone(), shutdown.clone()),
    );
    supervisor::notify_systemd(&[sd_notify::NotifyState::Ready]);
    tracing::info!(role = role.borrow().as_str(), "ready");

    shutdown.cancelled().await;
    let mut drained = drain(tracker, config, store, "at shutdown", reloading).await;
    for name in monitor.unsaved() {
        drained
            .not_done
            .push(format!("the change-stream position of {name}"));
    }
    Ok(drained)
}

/// Sleeps until `at`; forever when there is nothing to wait for (a
/// disabled branch of a `select!`).
pub(crate) async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sets, before the daemon says it is ready, every series an alert rule
/// reads: the last complete run of each collection as the state collection
/// recorded it (its time, the malformed documents it found — until the
/// monitor's first scan counts them again — and the documents the server
/// refused to update), every alert kind not firing unless it already fires,
/// the run counters by result at 0, the held sums of each ledger at 0 until
/// its first pass. A collection never reconciled completely has no
/// last-success time. A record that cannot be read is said once; the next
/// run sets its metrics.
async fn restore(
    state: &State,
    targets: &[FoldTarget],
    metrics: &Metrics,
    secrets: &Secrets,
    store: &Store,
) {
    for target in targets {
        let name = target.spec.name.as_str();
        let ledger = target.spec.events_collection.is_some();
        let bucketed = target.spec.buckets.is_some();
        for result in ["ok", "failed", "unavailable", "interrupted"] {
            metrics.reconcile_runs.with_label_values(&[name, result]);
        }
        for kind in alert::AlertKind::ALL {
            if (ledger || !kind.is_ledger()) && (bucketed || !kind.is_bucket()) {
                metrics
                    .alerts_firing
                    .with_label_values(&[kind.as_str(), name]);
            }
        }
        if ledger {
            metrics.events_held.with_label_values(&[name]);
        }
        // The alert rule reads it for every collection: 0 without buckets.
        metrics.buckets_unclosed.with_label_values(&[name]);
        if bucketed {
            metrics.buckets_closed.with_label_values(&[name]);
        }
        let last = match state.last_run(name).await {
            Ok(last) => last,
            Err(err) => {
                tracing::warn!(
                    collection = name,
                    cause = %secrets.scrub(&store.explain(&err)),
                    "cannot read the last run; its metrics come with the next run"
                );
                continue;
            }
        };
        let count = |n: Option<u64>| n.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX));
        if let Some(at) = last.and_then(|l| l.at.duration_since(SystemTime::UNIX_EPOCH).ok()) {
            metrics
                .last_success
                .with_label_values(&[name])
                .set(at.as_secs_f64());
        }
        metrics
            .malformed_documents
            .with_label_values(&[name])
            .set(count(last.and_then(|l| l.malformed)));
        metrics
            .fold_refused
            .with_label_values(&[name])
            .set(count(last.and_then(|l| l.refused)));
    }
}

/// The shutdown's reason when the daemon cannot start: the error that says
/// why is logged once the work is drained, after the "stopped" line.
const CANNOT_START: &str = "at start: it cannot start (the error below says why)";

/// Waits for the tasks to finish their work, up to the shutdown timeout:
/// for a stop, or for a reload (`reloading`), which the log tells apart.
async fn drain(
    tracker: TaskTracker,
    config: &Config,
    store: &Store,
    when: &str,
    reloading: &Reloading,
) -> Drained {
    let deadline = config.daemon.shutdown_timeout;
    let reload = reloading.is_set();
    if reload {
        tracing::info!(deadline = %human_duration(deadline), "draining the previous configuration's work");
    } else {
        tracing::info!(when, deadline = %human_duration(deadline), "shutting down");
    }
    tracker.close();
    let then = if reload {
        "the new configuration takes over anyway"
    } else {
        "exiting anyway"
    };
    // The work is waited for until the deadline — or, once every host has
    // failed its last heartbeat (the server is gone), for a moment only:
    // what still runs then waits for a server that is not there.
    let started = Instant::now();
    let wait = tracker.wait();
    tokio::pin!(wait);
    let cut_off = loop {
        tokio::select! {
            () = &mut wait => break None,
            () = tokio::time::sleep(DRAIN_POLL) => {}
        }
        let waited = started.elapsed();
        if waited >= deadline {
            break Some(format!(
                "the shutdown deadline passed ({}) with work still running",
                human_duration(deadline)
            ));
        }
        if waited >= DRAIN_UNREACHABLE && !store.seems_reachable() {
            break Some(format!(
                "MongoDB is unreachable: work still waiting for it after {} was abandoned",
                human_duration(waited)
            ));
        }
    };
    if let Some(why) = cut_off {
        tracing::error!(
            "{why}; {then} (a fold batch that was cut off is applied or not as a whole, and \
             will be folded again)"
        );
        return Drained {
            not_done: vec![format!("the drain: {why}")],
        };
    }
    if reload {
        tracing::info!("drained");
    } else {
        tracing::info!("stopped");
    }
    Drained::default()
}
