//! The continuous fold of the ledgers: a change stream on each events
//! collection triggers a fold pass within `[reconcile] fold_delay` of new
//! events (debounced: a burst of inserts is one pass), and a pass also
//! runs every `[monitor] scan_interval` whatever the stream says — the
//! stream makes the fold prompt, the periodic pass makes it certain. The
//! scheduled reconcile run folds the ledger too (before its pending fold).
//!
//! Every pass goes through the reconciler's [`EventFold`] of the
//! collection, the same one the scheduled run uses: one pass at a time,
//! one fold lane per process. The stream's position is saved like the
//! monitor's (`resume:<events collection>` in the state collection); a
//! lost position only costs a pass, which finds every unfolded event.
//!
//! Only the active instance folds. A pass that fails (the server, a
//! missing index) is logged and retried at the next trigger; a ledger
//! whose events wait longer than `[alerts] stuck_after`, or that the fold
//! refuses, fires `events_stuck`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mongodb::bson::{Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, ResumeToken};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::alert::{AlertKind, Alerts, Observation};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::daemon::state::State;
use crate::error::Error;
use crate::reconcile::{EventFold, FoldTarget, Reconciler};
use crate::store::Store;

/// How long one read of the stream waits for events: the debounce's
/// resolution.
const AWAIT: Duration = Duration::from_millis(200);
/// How long a failed stream waits before it is opened again.
const REOPEN_AFTER: Duration = Duration::from_secs(2);
/// How often the stream's position is saved.
const SAVE_EVERY: Duration = Duration::from_secs(10);

/// What a ledger's folding task needs.
pub(crate) struct LedgerFolder {
    pub(crate) store: Store,
    pub(crate) state: State,
    pub(crate) fold: Arc<EventFold>,
    pub(crate) collection: String,
    pub(crate) fold_delay: Duration,
    pub(crate) scan_interval: Duration,
    pub(crate) stuck_after: Duration,
    pub(crate) metrics: Metrics,
    pub(crate) alerts: Alerts,
    pub(crate) role: watch::Receiver<Role>,
    pub(crate) shutdown: CancellationToken,
}

/// Starts a folding task for every collection with a ledger.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    reconciler: &Reconciler,
    store: &Store,
    state: &State,
    targets: &[FoldTarget],
    timing: (Duration, Duration, Duration),
    metrics: &Metrics,
    alerts: &Alerts,
    role: &watch::Receiver<Role>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) {
    let (fold_delay, scan_interval, stuck_after) = timing;
    for target in targets
        .iter()
        .filter(|t| t.spec.events_collection.is_some())
    {
        let folder = LedgerFolder {
            store: store.clone(),
            state: state.clone(),
            fold: reconciler.event_fold(&target.spec),
            collection: target.spec.name.clone(),
            fold_delay,
            scan_interval,
            stuck_after,
            metrics: metrics.clone(),
            alerts: alerts.clone(),
            role: role.clone(),
            shutdown: shutdown.clone(),
        };
        tracker.spawn(folder.run());
    }
}

impl LedgerFolder {
    fn events(&self) -> &str {
        self.fold.events_collection()
    }

    async fn run(self) {
        while !self.shutdown.is_cancelled() {
            match self.follow().await {
                Ok(()) => return,
                Err(err) => {
                    tracing::warn!(collection = %self.collection, events = %self.events(), cause = %err, "the events change stream failed; reopening it");
                }
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tokio::time::sleep(REOPEN_AFTER) => {}
            }
        }
    }

    /// Opens the stream, folds once (what arrived while no one watched),
    /// then folds on every debounced burst and every scan interval.
    async fn follow(&self) -> Result<(), Error> {
        let mut stream = self.open().await?;
        let mut due = Some(Instant::now());
        let mut next_scan = Instant::now() + self.scan_interval;
        let mut next_save = Instant::now() + SAVE_EVERY;
        loop {
            if self.shutdown.is_cancelled() {
                self.save(stream.resume_token()).await;
                return Ok(());
            }
            let now = Instant::now();
            if due.is_some_and(|at| at <= now) || next_scan <= now {
                self.pass().await;
                due = None;
                next_scan = Instant::now() + self.scan_interval;
            }
            if next_save <= now {
                self.save(stream.resume_token()).await;
                next_save = now + SAVE_EVERY;
            }
            match stream.next_if_any().await {
                Ok(Some(_)) => {
                    due.get_or_insert_with(|| Instant::now() + self.fold_delay);
                }
                Ok(None) if stream.is_alive() => {}
                Ok(None) => return Err(Error::InvalidArgument("the change stream ended".into())),
                Err(err) => {
                    self.save(stream.resume_token()).await;
                    return Err(Error::Server(crate::error::Failure::once(
                        "ledger.stream",
                        err,
                    )));
                }
            }
        }
    }

    async fn open(&self) -> Result<ChangeStream<ChangeStreamEvent<Document>>, Error> {
        let saved = self.state.resume_token(self.events()).await.unwrap_or(None);
        let events = self.store.collection(self.events());
        let watch = |from: Option<ResumeToken>| {
            events
                .watch()
                .pipeline([
                    doc! { "$match": { "operationType": "insert" } },
                    doc! { "$project": { "_id": 1, "operationType": 1 } },
                ])
                .max_await_time(AWAIT)
                .resume_after(from)
        };
        match watch(saved.clone()).await {
            Ok(stream) => Ok(stream),
            // The saved position is gone (history lost): start from now;
            // the first pass finds whatever was missed.
            Err(_) if saved.is_some() => {
                let _ = self.state.forget_resume_token(self.events()).await;
                watch(None)
                    .await
                    .map_err(|err| Error::Server(crate::error::Failure::once("ledger.watch", err)))
            }
            Err(err) => Err(Error::Server(crate::error::Failure::once(
                "ledger.watch",
                err,
            ))),
        }
    }

    async fn save(&self, token: Option<ResumeToken>) {
        if let Some(token) = token
            && let Err(err) = self.state.save_resume_token(self.events(), &token).await
        {
            tracing::warn!(events = %self.events(), cause = %err, "cannot save the events stream's position");
        }
    }

    /// Fold passes while this instance is active and events are left (each
    /// pass bounded by `pass_limit`, the fold's lock released and the role
    /// checked between them), then the backlog's metrics and alert.
    async fn pass(&self) {
        let name = self.collection.as_str();
        loop {
            if *self.role.borrow() != Role::Active {
                return;
            }
            let now = match self.store.server_time().await {
                Ok(now) => now,
                Err(err) => {
                    tracing::warn!(collection = name, cause = %err, "cannot read the server's clock; the fold waits");
                    return;
                }
            };
            let (more, refused) = match self.fold.fold(now, &self.shutdown).await {
                Ok(run) => {
                    self.metrics
                        .events_folded
                        .with_label_values(&[name])
                        .inc_by(run.events_folded);
                    if run.events_folded > 0 || run.recovered > 0 {
                        tracing::debug!(
                            collection = name,
                            events = run.events_folded,
                            batches = run.batches,
                            recovered = run.recovered,
                            "ledger folded"
                        );
                    }
                    (run.more && !self.shutdown.is_cancelled(), None)
                }
                Err(err) => {
                    tracing::error!(collection = name, events = %self.events(), cause = %err, "folding the ledger failed");
                    (false, Some(err))
                }
            };
            if !more {
                self.account(now, refused).await;
                return;
            }
        }
    }

    async fn account(&self, now: SystemTime, refused: Option<Error>) {
        let name = self.collection.as_str();
        let backlog = match self.fold.backlog(now).await {
            Ok(backlog) => backlog,
            Err(err) => {
                tracing::warn!(collection = name, cause = %err, "cannot read the ledger's backlog");
                return;
            }
        };
        self.metrics
            .events_backlog
            .with_label_values(&[name])
            .set(i64::try_from(backlog.events).unwrap_or(i64::MAX));
        self.metrics
            .events_fold_lag
            .with_label_values(&[name])
            .set(backlog.oldest_age.map_or(0.0, |a| a.as_secs_f64()));
        let stuck = backlog.oldest_age.is_some_and(|a| a > self.stuck_after);
        let observation =
            (stuck || matches!(refused, Some(Error::IndexesMissing { .. }))).then(|| Observation {
                count: backlog.events,
                oldest_age: backlog.oldest_age,
                sample_ids: Vec::new(),
                detail: Some(match &refused {
                    Some(err) => err.to_string(),
                    None => format!(
                        "recorded events of {} wait longer than stuck_after to be folded",
                        self.events()
                    ),
                }),
            });
        self.alerts.set(AlertKind::EventsStuck, name, observation);
    }
}
