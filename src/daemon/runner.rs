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
use crate::error::{Error, human_duration, words};
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

/// `fold_refused` and `tally_fold_refused_documents` from a run: firing
/// while the collection's last run left documents the server refused to
/// update, resolved by a complete run that refused none. A run that failed
/// or was interrupted says nothing about the documents it did not reach,
/// unless it found refusals itself.
fn report_refused(alerts: &Alerts, metrics: &Metrics, run: &CollectionRun) {
    if run.refused == 0 && !run.succeeded() {
        return;
    }
    let name = run.collection.as_str();
    metrics
        .fold_refused
        .with_label_values(&[name])
        .set(i64::try_from(run.refused).unwrap_or(i64::MAX));
    let refused = (run.refused > 0).then(|| Observation {
        count: run.refused,
        oldest_age: None,
        sample_ids: run.refused_sample.iter().map(|d| d.id.clone()).collect(),
        detail: Some(
            "the server refused to update these documents; they are left untouched and their \
             pending tokens uncounted: fix the document (or the validator), and the next run \
             folds it"
                .into(),
        ),
    });
    alerts.set(AlertKind::FoldRefused, name, refused);
}

/// `tally_buckets_*` and `buckets_unclosed` from a run of a bucketed
/// collection: the alert fires while the last complete run left due
/// buckets open, and resolves when a complete run closed them all. A run
/// that failed or stopped measured nothing, unless it found some itself.
fn report_buckets(alerts: &Alerts, metrics: &Metrics, run: &CollectionRun) {
    let Some(closing) = &run.buckets else {
        return;
    };
    let name = run.collection.as_str();
    metrics
        .buckets_closed
        .with_label_values(&[name])
        .inc_by(closing.closed);
    if closing.unclosed == 0 && !run.succeeded() {
        return;
    }
    let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    if run.succeeded() {
        metrics
            .buckets_open
            .with_label_values(&[name])
            .set(gauge(closing.open));
    }
    metrics
        .buckets_unclosed
        .with_label_values(&[name])
        .set(gauge(closing.unclosed));
    let unclosed = (closing.unclosed > 0).then(|| Observation {
        count: closing.unclosed,
        oldest_age: None,
        sample_ids: closing
            .unclosed_sample
            .iter()
            .map(|b| b.id.clone())
            .collect(),
        detail: Some(format!(
            "these buckets are past their closing time and still hold work, or cannot be \
                 read: `tallyd reconcile --collection {name}` names each and why; once the fold \
                 takes its work (or the document is fixed), the next run closes it"
        )),
    });
    alerts.set(AlertKind::BucketsUnclosed, name, unclosed);
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

    /// `err` as people read it, secrets removed.
    fn explain(&self, err: &Error) -> String {
        self.secrets.scrub(&self.store.explain(err))
    }

    async fn catch_up_missed(
        &mut self,
        failures: &mut BTreeMap<String, u32>,
        retry_at: &mut BTreeMap<String, Instant>,
    ) {
        let now = match self.store.server_time().await {
            Ok(now) => now,
            Err(err) => {
                tracing::warn!(cause = %self.explain(&err), "cannot check for missed runs; the schedule goes on");
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
                    tracing::warn!(collection = %target.spec.name, cause = %self.explain(&err), "cannot read the last run")
                }
            }
        }
        if !missed.is_empty() {
            tracing::info!(collections = %words(&missed), "catching up on a missed run");
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
        let unavailable = run.error.as_ref().is_some_and(Error::is_unavailable);
        let result = match (&run.error, run.interrupted) {
            (Some(_), _) if unavailable => "unavailable",
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
        // Only a run that read every document measured them: a failed or
        // interrupted one leaves the last measurement standing (an outage
        // never resolves the malformed alert).
        if run.succeeded() {
            self.metrics
                .malformed_documents
                .with_label_values(&[name])
                .set(run.survey.malformed as i64);
        }
        tracing::info!(
            collection = name,
            result,
            folded = run.documents_folded,
            tokens = run.tokens_folded,
            amount = run.amount_folded,
            events = run.events_folded,
            lanes_pruned = run.lanes_pruned,
            malformed = run.survey.malformed,
            refused = run.refused,
            buckets_closed = run.buckets.as_ref().map(|b| b.closed),
            buckets_unclosed = run.buckets.as_ref().map(|b| b.unclosed),
            buckets_open = run.buckets.as_ref().map(|b| b.open),
            took = %crate::error::human_duration(run.duration),
            "reconcile run"
        );
        report_refused(&self.alerts, &self.metrics, run);
        report_buckets(&self.alerts, &self.metrics, run);
        match &run.error {
            None if run.interrupted => {}
            None => {
                failures.remove(name);
                self.alerts.set(AlertKind::RunFailed, name, None);
                self.metrics.last_success.with_label_values(&[name]).set(
                    now.duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                );
                if let Err(err) = self
                    .state
                    .record_success(name, now, run.survey.malformed, run.refused)
                    .await
                {
                    tracing::warn!(collection = name, cause = %self.explain(&err), "cannot record the successful run");
                }
            }
            Some(err) => {
                let count = failures.entry(name.to_owned()).or_insert(0);
                *count += 1;
                let wait = RETRY_FIRST
                    .saturating_mul(1 << (*count - 1).min(10))
                    .min(RETRY_MAX);
                retry_at.insert(name.to_owned(), Instant::now() + wait);
                // An outage is its own signal (not ready, MongoDB
                // unreachable): a run it failed says nothing new about the
                // collection, so run_failed keeps what it said.
                if unavailable {
                    tracing::error!(
                        collection = name,
                        failures = *count,
                        retry_in = %human_duration(wait),
                        cause = %self.explain(err),
                        "reconcile run failed: MongoDB is unavailable; it will be retried"
                    );
                    return;
                }
                tracing::error!(
                    collection = name,
                    failures = *count,
                    retry_in = %human_duration(wait),
                    "reconcile run failed; it will be retried (the run_failed alert says why)"
                );
                self.alerts.set(
                    AlertKind::RunFailed,
                    name,
                    Some(Observation {
                        count: u64::from(*count),
                        oldest_age: None,
                        sample_ids: Vec::new(),
                        detail: Some(self.explain(err)),
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
                tracing::warn!(collection, cause = %self.explain(&err), "repair postponed: cannot read the server's clock");
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
                    tracing::warn!(collection, cause = %self.explain(&err), "repair failed; the schedule will fold them");
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

#[cfg(test)]
mod tests {
    use tokio_util::task::TaskTracker;

    use super::*;
    use crate::config::AlertsConfig;
    use crate::daemon::alert::AlertOptions;
    use crate::reconcile::RefusedDocument;
    use crate::redact::Secrets;

    fn engine(metrics: &Metrics) -> Alerts {
        Alerts::start_with(
            &AlertsConfig::default(),
            Secrets::default(),
            metrics.clone(),
            &TaskTracker::new(),
            CancellationToken::new(),
            AlertOptions::default(),
        )
    }

    fn run_refusing(ids: &[&str]) -> CollectionRun {
        let mut run =
            CollectionRun::failed("views", crate::error::Error::InvalidArgument("x".into()));
        run.error = None;
        run.refused = ids.len() as u64;
        run.refused_sample = ids
            .iter()
            .map(|id| RefusedDocument {
                id: (*id).to_owned(),
                code: 121,
                reason: "Document failed validation".into(),
            })
            .collect();
        run
    }

    fn gauge(metrics: &Metrics) -> i64 {
        metrics.fold_refused.with_label_values(&["views"]).get()
    }

    #[test]
    fn refused_documents_fire_until_a_complete_run_refuses_none() {
        let metrics = Metrics::new();
        let alerts = engine(&metrics);
        report_refused(&alerts, &metrics, &run_refusing(&["1", "2"]));
        let firing = alerts.firing();
        assert_eq!(firing.len(), 1, "{firing:?}");
        let (kind, collection, observation) = &firing[0];
        assert_eq!(
            (*kind, collection.as_str()),
            (AlertKind::FoldRefused, "views")
        );
        assert_eq!(observation.count, 2);
        assert_eq!(observation.sample_ids, ["1", "2"]);
        assert_eq!(gauge(&metrics), 2);
        let text = metrics.render();
        assert!(
            text.contains("tally_fold_refused_documents{collection=\"views\"} 2"),
            "{text}"
        );

        // A run that failed or was interrupted before the end says nothing
        // new about the documents it did not reach.
        let mut failed = run_refusing(&[]);
        failed.error = Some(crate::error::Error::InvalidArgument("down".into()));
        report_refused(&alerts, &metrics, &failed);
        let mut interrupted = run_refusing(&[]);
        interrupted.interrupted = true;
        report_refused(&alerts, &metrics, &interrupted);
        assert_eq!(alerts.firing().len(), 1);
        assert_eq!(gauge(&metrics), 2);

        // A complete run that refused nothing resolves it.
        report_refused(&alerts, &metrics, &run_refusing(&[]));
        assert!(alerts.firing().is_empty());
        assert_eq!(gauge(&metrics), 0);
        let notifications = |state| {
            metrics
                .alert_notifications
                .with_label_values(&["fold_refused", state])
                .get()
        };
        assert_eq!((notifications("firing"), notifications("resolved")), (1, 1));
    }
}
