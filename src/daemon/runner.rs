//! The runner: reconcile runs one at a time, never overlapping — asked
//! for by the schedule, by the catch-up at start (and on becoming active),
//! by a repair, or by its own retry of a failed run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use mongodb::bson::Bson;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::daemon::alert::{AlertKind, Alerts, Observation};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::daemon::schedule::Schedule;
use crate::daemon::sleep_until;
use crate::daemon::state::State;
use crate::reconcile::{CollectionRun, FoldTarget, Mode, Reconciler};
use crate::redact::Secrets;
use crate::store::Store;

/// The first retry of a failed run comes after this; then it doubles.
const RETRY_FIRST: Duration = Duration::from_secs(10);
/// The longest wait before retrying a failed run.
const RETRY_MAX: Duration = Duration::from_secs(600);

/// What the runner is asked to do.
#[derive(Debug)]
pub(super) enum Request {
    /// A scheduled run of every collection.
    Scheduled,
    /// Fold these documents of a collection at once.
    Repair { collection: String, ids: Vec<Bson> },
}

/// Runs reconciles one at a time.
pub(super) struct Runner {
    pub(super) reconciler: Reconciler,
    pub(super) store: Store,
    pub(super) state: State,
    pub(super) schedule: Schedule,
    pub(super) catch_up: bool,
    pub(super) targets: Vec<FoldTarget>,
    pub(super) metrics: Metrics,
    pub(super) alerts: Alerts,
    pub(super) secrets: Secrets,
    pub(super) role: watch::Receiver<Role>,
    pub(super) busy: Arc<AtomicBool>,
    pub(super) shutdown: CancellationToken,
}

impl Runner {
    pub(super) async fn run(mut self, mut inbox: mpsc::Receiver<Request>) {
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
                () = sleep_until(next_retry.map(Into::into)) => {
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
