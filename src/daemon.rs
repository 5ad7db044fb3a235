//! `tallyd run`: the long-running daemon (DESIGN §6).
//!
//! [`run`] wires the parts together and drives them until `shutdown`:
//!
//! - the HTTP endpoints ([`crate::http`]) — bound first, so a taken port
//!   fails the start at once;
//! - waiting for MongoDB (READY=1 to systemd once it answers, WATCHDOG=1 at
//!   half the watchdog interval from then on);
//! - the lease ([`crate::lease`], with `[ha]`), deciding whether this
//!   instance folds and alerts;
//! - the monitor ([`crate::monitor`]), the live view of pending tokens;
//! - the runner: reconcile runs requested by the schedule, by the catch-up
//!   at start (and on becoming active), by a repair, or by its own retry of
//!   a failed run — one at a time, never overlapping;
//! - the evaluator: every second, metrics and alerts from the view.
//!
//! At shutdown (SIGTERM/SIGINT) no new run starts, a running fold finishes
//! its batch, the monitors save their resume tokens, the lease is released
//! — all within `[daemon] shutdown_timeout`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use mongodb::bson::Bson;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::alert::{AlertKind, AlertOptions, Alerts, Observation};
use crate::config::{Config, FoldTarget};
use crate::http::{self, Readiness};
use crate::lease::{Lease, Role};
use crate::metrics::Metrics;
use crate::monitor::Monitor;
use crate::reconcile::{CollectionRun, Mode, Reconciler};
use crate::redact::Secrets;
use crate::schedule::Schedule;
use crate::state::State;
use crate::store::Store;

/// How often metrics and alerts are evaluated from the view.
const EVALUATE_EVERY: Duration = Duration::from_secs(1);
/// The first retry of a failed run comes after this; then it doubles.
const RETRY_FIRST: Duration = Duration::from_secs(10);
/// The longest wait before retrying a failed run.
const RETRY_MAX: Duration = Duration::from_secs(600);
/// The shortest time between two repairs of one collection.
const REPAIR_EVERY: Duration = Duration::from_secs(5);

/// Why the daemon could not run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration cannot drive a daemon (exit 78).
    #[error("{0}")]
    Config(String),
    /// Something the daemon needs could not be set up.
    #[error("{0}")]
    Start(String),
}

/// What the runner is asked to do.
#[derive(Debug)]
enum Request {
    /// A scheduled run of every collection.
    Scheduled,
    /// Fold these documents of a collection at once.
    Repair { collection: String, ids: Vec<Bson> },
}

/// Runs the daemon until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DaemonError> {
    if config.collections.is_empty() {
        return Err(DaemonError::Config(
            "no [[collections]] configured: the daemon has nothing to watch".into(),
        ));
    }
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

/// Runs reconciles one at a time.
struct Runner {
    reconciler: Reconciler,
    store: Store,
    state: State,
    schedule: Schedule,
    catch_up: bool,
    targets: Vec<FoldTarget>,
    metrics: Metrics,
    alerts: Alerts,
    secrets: Secrets,
    role: watch::Receiver<Role>,
    busy: Arc<AtomicBool>,
    shutdown: CancellationToken,
}

impl Runner {
    async fn run(mut self, mut inbox: mpsc::Receiver<Request>) {
        let mut failures: BTreeMap<String, u32> = BTreeMap::new();
        let mut retry_at: BTreeMap<String, Instant> = BTreeMap::new();
        let mut was_active = false;
        loop {
            let active = *self.role.borrow() == Role::Active;
            if active && !was_active && self.catch_up {
                // At start, and when taking over from another instance:
                // whatever was missed is run now.
                self.catch_up_missed(&mut failures, &mut retry_at).await;
            }
            was_active = active;
            let next_retry = retry_at.values().min().copied();
            let request = tokio::select! {
                () = self.shutdown.cancelled() => return,
                changed = self.role.changed() => {
                    if changed.is_err() {
                        // The lease keeper stopped: shutdown is under way.
                        return;
                    }
                    continue;
                }
                request = inbox.recv() => match request {
                    Some(request) => request,
                    None => return,
                },
                () = sleep_until(next_retry) => {
                    let due: Vec<String> = retry_at
                        .iter()
                        .filter(|(_, at)| **at <= Instant::now())
                        .map(|(name, _)| name.clone())
                        .collect();
                    if *self.role.borrow() == Role::Active {
                        self.run_collections(&due, &mut failures, &mut retry_at).await;
                    } else {
                        for name in due { retry_at.remove(&name); }
                    }
                    continue;
                }
            };
            if *self.role.borrow() != Role::Active {
                tracing::debug!(?request, "standby: leaving the work to the active instance");
                continue;
            }
            match request {
                Request::Scheduled => {
                    let all: Vec<String> =
                        self.targets.iter().map(|t| t.spec.name.clone()).collect();
                    self.run_collections(&all, &mut failures, &mut retry_at)
                        .await;
                }
                Request::Repair { collection, ids } => self.repair(&collection, ids).await,
            }
        }
    }

    async fn catch_up_missed(
        &mut self,
        failures: &mut BTreeMap<String, u32>,
        retry_at: &mut BTreeMap<String, Instant>,
    ) {
        let now = match self.store.server_time().await {
            Ok(now) => now,
            Err(err) => {
                tracing::warn!(cause = %self.secrets.scrub(&err.to_string()), "cannot check for missed runs; the schedule goes on");
                return;
            }
        };
        let mut missed = Vec::new();
        for target in &self.targets {
            match self.state.last_success(&target.spec.name).await {
                Ok(last) if self.schedule.missed(last, now) => {
                    missed.push(target.spec.name.clone())
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(collection = %target.spec.name, cause = %err, "cannot read the last run")
                }
            }
        }
        if !missed.is_empty() {
            tracing::info!(collections = ?missed, "catching up on a missed run");
            self.run_collections(&missed, failures, retry_at).await;
        }
    }

    async fn run_collections(
        &self,
        names: &[String],
        failures: &mut BTreeMap<String, u32>,
        retry_at: &mut BTreeMap<String, Instant>,
    ) {
        self.busy.store(true, Ordering::Relaxed);
        for name in names {
            if self.shutdown.is_cancelled() {
                break;
            }
            retry_at.remove(name);
            let Some(target) = self.targets.iter().find(|t| &t.spec.name == name) else {
                continue;
            };
            let (run, now) = match self.store.server_time().await {
                Ok(now) => {
                    let run = self
                        .reconciler
                        .reconcile(target, Mode::Fold, now, &self.shutdown, &mut |_| {})
                        .await;
                    (run, now)
                }
                Err(err) => (CollectionRun::failed(name, err), SystemTime::now()),
            };
            self.account(&run, now, failures, retry_at).await;
        }
        self.busy.store(false, Ordering::Relaxed);
    }

    /// Metrics, alerts, the stored last success, and a retry for a failure.
    async fn account(
        &self,
        run: &CollectionRun,
        now: SystemTime,
        failures: &mut BTreeMap<String, u32>,
        retry_at: &mut BTreeMap<String, Instant>,
    ) {
        let name = run.collection.as_str();
        let result = match (&run.error, run.interrupted) {
            (Some(_), _) => "failed",
            (None, true) => "interrupted",
            (None, false) => "ok",
        };
        self.metrics
            .reconcile_runs
            .with_label_values(&[name, result])
            .inc();
        self.metrics
            .reconcile_duration
            .with_label_values(&[name])
            .observe(run.duration.as_secs_f64());
        self.metrics
            .documents_folded
            .with_label_values(&[name])
            .inc_by(run.documents_folded);
        self.metrics
            .tokens_folded
            .with_label_values(&[name])
            .inc_by(run.tokens_folded);
        self.metrics
            .malformed_documents
            .with_label_values(&[name])
            .set(run.survey.malformed as i64);
        tracing::info!(
            collection = name,
            result,
            folded = run.documents_folded,
            tokens = run.tokens_folded,
            amount = run.amount_folded,
            malformed = run.survey.malformed,
            seconds = run.duration.as_secs_f64(),
            "reconcile run"
        );
        match &run.error {
            None if run.interrupted => {}
            None => {
                failures.remove(name);
                self.alerts.set(AlertKind::RunFailed, name, None);
                self.metrics.last_success.with_label_values(&[name]).set(
                    now.duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
                if let Err(err) = self.state.record_success(name, now).await {
                    tracing::warn!(collection = name, cause = %err, "cannot record the successful run");
                }
            }
            Some(err) => {
                let count = failures.entry(name.to_owned()).or_insert(0);
                *count += 1;
                let wait = RETRY_FIRST
                    .saturating_mul(1 << (*count - 1).min(10))
                    .min(RETRY_MAX);
                retry_at.insert(name.to_owned(), Instant::now() + wait);
                tracing::error!(collection = name, failures = *count, retry_in = ?wait, "reconcile run failed; it will be retried");
                self.alerts.set(
                    AlertKind::RunFailed,
                    name,
                    Some(Observation {
                        count: u64::from(*count),
                        oldest_age: None,
                        sample_ids: Vec::new(),
                        detail: Some(self.secrets.scrub(&err.to_string())),
                    }),
                );
            }
        }
    }

    async fn repair(&self, collection: &str, ids: Vec<Bson>) {
        let Some(target) = self.targets.iter().find(|t| t.spec.name == collection) else {
            return;
        };
        let now = match self.store.server_time().await {
            Ok(now) => now,
            Err(err) => {
                tracing::warn!(collection, cause = %err, "repair postponed: cannot read the server's clock");
                return;
            }
        };
        let mut folded = 0;
        for batch in ids.chunks(target.batch_size as usize) {
            match self
                .reconciler
                .fold_documents(target, batch.to_vec(), now)
                .await
            {
                Ok(n) => folded += n,
                Err(err) => {
                    tracing::warn!(collection, cause = %err, "repair failed; the schedule will fold them");
                    break;
                }
            }
        }
        self.metrics
            .documents_folded
            .with_label_values(&[collection])
            .inc_by(folded);
        tracing::info!(collection, documents = folded, "repaired stuck tokens");
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Turns the view into metrics and alerts, every second.
struct Evaluator {
    config: Config,
    monitor: Monitor,
    alerts: Alerts,
    metrics: Metrics,
    role: watch::Receiver<Role>,
    requests: mpsc::Sender<Request>,
    last_repair: HashMap<String, Instant>,
}

impl Evaluator {
    async fn run(mut self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(EVALUATE_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => self.evaluate(),
            }
        }
    }

    fn evaluate(&mut self) {
        let now = SystemTime::now();
        let alerts_config = &self.config.alerts;
        let stuck_before = now
            .checked_sub(alerts_config.stuck_after)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let active = *self.role.borrow() == Role::Active;
        for collection in &self.config.collections {
            let name = collection.name.as_str();
            let snapshot = self
                .monitor
                .snapshot(name, stuck_before, alerts_config.max_pending);
            let labels = [name];
            self.metrics
                .pending_documents
                .with_label_values(&labels)
                .set(snapshot.pending_documents as i64);
            self.metrics
                .pending_tokens
                .with_label_values(&labels)
                .set(snapshot.pending_tokens as i64);
            self.metrics
                .stuck_tokens
                .with_label_values(&labels)
                .set(snapshot.stuck_tokens as i64);
            self.metrics
                .largest_pending
                .with_label_values(&labels)
                .set(snapshot.largest_pending as i64);
            let oldest_age = snapshot.oldest.map(|t| t.age(now));
            self.metrics
                .oldest_pending_age
                .with_label_values(&labels)
                .set(oldest_age.map_or(0.0, |a| a.as_secs_f64()));
            if !active {
                // Only the active instance alerts and repairs.
                continue;
            }
            let stuck = (snapshot.stuck_tokens > 0).then(|| Observation {
                count: snapshot.stuck_tokens,
                oldest_age,
                sample_ids: snapshot.stuck_sample.clone(),
                detail: None,
            });
            self.alerts.set(AlertKind::StuckTokens, name, stuck);
            let too_long = (snapshot.too_long > 0).then(|| Observation {
                count: snapshot.too_long,
                oldest_age: None,
                sample_ids: snapshot.too_long_sample.clone(),
                detail: Some(format!(
                    "pending arrays longer than {} entries (largest: {})",
                    alerts_config.max_pending, snapshot.largest_pending
                )),
            });
            self.alerts.set(AlertKind::PendingTooLong, name, too_long);
            let malformed = (snapshot.malformed > 0).then(|| Observation {
                count: snapshot.malformed,
                oldest_age: None,
                sample_ids: snapshot.malformed_sample.clone(),
                detail: Some("malformed documents are never modified; fix or remove them".into()),
            });
            self.alerts.set(AlertKind::Malformed, name, malformed);
            let down = self
                .monitor
                .down_for(name)
                .filter(|d| self.config.monitor.enabled && *d >= alerts_config.monitor_down_after)
                .map(|d| Observation {
                    count: 1,
                    oldest_age: Some(d),
                    sample_ids: Vec::new(),
                    detail: Some(format!(
                        "the change stream has been down for {}s",
                        d.as_secs()
                    )),
                });
            self.alerts.set(AlertKind::MonitorDown, name, down);
            if alerts_config.repair && !snapshot.stuck_ids.is_empty() {
                let due = self
                    .last_repair
                    .get(name)
                    .is_none_or(|at| at.elapsed() >= REPAIR_EVERY);
                if due {
                    let request = Request::Repair {
                        collection: name.to_owned(),
                        ids: snapshot.stuck_ids.clone(),
                    };
                    if self.requests.try_send(request).is_ok() {
                        self.last_repair.insert(name.to_owned(), Instant::now());
                    }
                }
            }
        }
    }
}
