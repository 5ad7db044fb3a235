//! The continuous fold of the ledgers: a fold pass runs every `[monitor]
//! scan_interval` whatever happens, and within `[reconcile] fold_delay` of
//! new events while a change stream on the events collection is open
//! (debounced: a burst of inserts is one pass). The stream is a trigger,
//! never a condition: when it cannot open (a standalone server, a user
//! without `changeStream`) the periodic pass folds on, the failure is
//! counted (`tally_events_stream_failures_total`), and after `[alerts]
//! monitor_down_after` it fires `events_stream_down`. The scheduled
//! reconcile run folds the ledger too.
//!
//! Every pass goes through the reconciler's [`EventFold`] of the
//! collection, the same one the scheduled run uses. The stream's position
//! is saved like the monitor's (`resume:<events collection>` in the state
//! collection); a lost position only costs a pass, which finds every
//! unfolded event.
//!
//! Only the active instance folds. While events are left after a pass, the
//! next one follows within `fold_delay`. After every pass — however long
//! the backlog: a pass folds up to its survey's end — the backlog,
//! the lag and the held sums are current in `/metrics`; events waiting
//! longer than `[alerts] stuck_after`, or a ledger the fold refuses, fire
//! `events_stuck`; counters holding refused sums fire `events_held`.

use std::sync::Arc;
use std::time::Duration;

use mongodb::bson::{Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, ResumeToken};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::alert::{AlertKind, Alerts, Observation};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::daemon::state::State;
use crate::document::display_id;
use crate::error::{Error, Failure};
use crate::ledger::{Backlog, EventFold};
use crate::reconcile::{FoldTarget, Reconciler};
use crate::store::Store;

/// How long one read of the stream waits for events: the debounce's
/// resolution.
const AWAIT: Duration = Duration::from_millis(200);
/// How long a failed stream waits before it is opened again.
const REOPEN_AFTER: Duration = Duration::from_secs(2);
/// How often the stream's position is saved.
const SAVE_EVERY: Duration = Duration::from_secs(10);
/// Counters named one by one in an `events_held` alert.
const HELD_SAMPLE: usize = 10;

/// How the ledger tasks are timed (from the configuration).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) fold_delay: Duration,
    pub(crate) scan_interval: Duration,
    pub(crate) stuck_after: Duration,
    pub(crate) stream_down_after: Duration,
}

/// What a ledger's folding task needs.
struct LedgerFolder {
    store: Store,
    state: State,
    fold: Arc<EventFold>,
    collection: String,
    timing: Timing,
    metrics: Metrics,
    alerts: Alerts,
    role: watch::Receiver<Role>,
    shutdown: CancellationToken,
    /// Rung by the stream on new events.
    inserted: Notify,
}

/// Starts a folding task for every collection with a ledger.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    reconciler: &Reconciler,
    store: &Store,
    state: &State,
    targets: &[FoldTarget],
    timing: Timing,
    metrics: &Metrics,
    alerts: &Alerts,
    role: &watch::Receiver<Role>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) {
    for target in targets
        .iter()
        .filter(|t| t.spec.events_collection.is_some())
    {
        let folder = Arc::new(LedgerFolder {
            store: store.clone(),
            state: state.clone(),
            fold: reconciler.event_fold(&target.spec),
            collection: target.spec.name.clone(),
            timing,
            metrics: metrics.clone(),
            alerts: alerts.clone(),
            role: role.clone(),
            shutdown: shutdown.clone(),
            inserted: Notify::new(),
        });
        tracker.spawn(Arc::clone(&folder).fold_periodically());
        tracker.spawn(folder.watch());
    }
}

impl LedgerFolder {
    fn events(&self) -> &str {
        self.fold.events_collection()
    }

    /// A pass at start, then one every scan interval and one within
    /// `fold_delay` of each burst the stream reports, until shutdown.
    async fn fold_periodically(self: Arc<Self>) {
        let mut next_scan = Instant::now();
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next_scan) => {}
                () = self.inserted.notified() => {
                    tokio::select! {
                        () = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep(self.timing.fold_delay) => {}
                    }
                }
            }
            // Events left (newer than the pass's survey, or more than one
            // pass takes): the next pass soon, stream or not.
            let waiting = self.pass().await;
            next_scan = Instant::now()
                + if waiting {
                    self.timing.fold_delay
                } else {
                    self.timing.scan_interval
                };
        }
    }

    /// Follows the events collection's inserts, opening the stream again
    /// after a failure; a trigger for the passes, nothing more.
    async fn watch(self: Arc<Self>) {
        let name = self.collection.as_str();
        let mut down_since: Option<Instant> = None;
        while !self.shutdown.is_cancelled() {
            let followed = self.follow(&mut down_since).await;
            if self.shutdown.is_cancelled() {
                return;
            }
            if let Err(err) = followed {
                self.metrics
                    .events_stream_failures
                    .with_label_values(&[name])
                    .inc();
                self.metrics
                    .events_stream_up
                    .with_label_values(&[name])
                    .set(0);
                let since = *down_since.get_or_insert_with(Instant::now);
                tracing::warn!(collection = name, events = %self.events(), cause = %err, "the events change stream failed; the periodic pass folds meanwhile, and the stream is opened again");
                let down = since.elapsed();
                let observation = (down >= self.timing.stream_down_after).then(|| Observation {
                    count: 1,
                    oldest_age: Some(down),
                    sample_ids: Vec::new(),
                    detail: Some(format!(
                        "the change stream on {} cannot be opened ({err}); its events are folded \
                         every {} instead of at once",
                        self.events(),
                        humantime::format_duration(self.timing.scan_interval)
                    )),
                });
                self.alerts
                    .set(AlertKind::EventsStreamDown, name, observation);
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return,
                () = tokio::time::sleep(REOPEN_AFTER) => {}
            }
        }
    }

    /// Opens the stream and rings for every burst of inserts until it
    /// fails or the daemon stops.
    async fn follow(&self, down_since: &mut Option<Instant>) -> Result<(), Error> {
        let name = self.collection.as_str();
        // Opening reads the saved position, then opens the stream: two
        // waits for a server in an outage, longer together than the stop's
        // grace for work in flight. A stop meanwhile drops them (nothing
        // is written but the forgetting of a lost position, which the next
        // start does again), so a stop in an outage is not held by them.
        let mut stream = tokio::select! {
            () = self.shutdown.cancelled() => return Ok(()),
            opened = self.open() => opened?,
        };
        *down_since = None;
        self.metrics
            .events_stream_up
            .with_label_values(&[name])
            .set(1);
        self.alerts.set(AlertKind::EventsStreamDown, name, None);
        // What arrived while no one watched.
        self.inserted.notify_one();
        let mut next_save = Instant::now() + SAVE_EVERY;
        loop {
            if self.shutdown.is_cancelled() {
                self.save(stream.resume_token()).await;
                return Ok(());
            }
            if next_save <= Instant::now() {
                self.save(stream.resume_token()).await;
                next_save = Instant::now() + SAVE_EVERY;
            }
            match stream.next_if_any().await {
                Ok(Some(_)) => self.inserted.notify_one(),
                Ok(None) if stream.is_alive() => {}
                Ok(None) => return Err(Error::InvalidArgument("the change stream ended".into())),
                Err(err) => {
                    self.save(stream.resume_token()).await;
                    return Err(Error::Server(Failure::once("ledger.stream", err)));
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
            // the next pass finds whatever was missed.
            Err(_) if saved.is_some() => {
                let _ = self.state.forget_resume_token(self.events()).await;
                watch(None)
                    .await
                    .map_err(|err| Error::Server(Failure::once("ledger.watch", err)))
            }
            Err(err) => Err(Error::Server(Failure::once("ledger.watch", err))),
        }
    }

    async fn save(&self, token: Option<ResumeToken>) {
        if let Some(token) = token
            && let Err(err) = self.state.save_resume_token(self.events(), &token).await
        {
            tracing::warn!(events = %self.events(), cause = %err, "cannot save the events stream's position");
        }
    }

    /// One fold pass while this instance is active, then the metrics and
    /// alerts of what is left; whether events wait to be folded.
    async fn pass(&self) -> bool {
        let name = self.collection.as_str();
        if *self.role.borrow() != Role::Active {
            return false;
        }
        let now = match self.store.server_time().await {
            Ok(now) => now,
            Err(err) => {
                tracing::warn!(collection = name, cause = %err, "cannot read the server's clock; the fold waits");
                return false;
            }
        };
        let (backlog, refused) = match self.fold.fold(now, &self.shutdown).await {
            Ok(run) => {
                self.metrics
                    .events_folded
                    .with_label_values(&[name])
                    .inc_by(run.events_folded);
                self.metrics
                    .events_fold_state_bytes
                    .with_label_values(&[name])
                    .set(i64::try_from(run.state_bytes).unwrap_or(i64::MAX));
                if run.events_folded > 0 || run.recovered || run.events_deleted > 0 {
                    tracing::debug!(
                        collection = name,
                        events = run.events_folded,
                        pass = run.pass,
                        counters = run.counters_written,
                        recovered = run.recovered,
                        deleted = run.events_deleted,
                        "ledger folded"
                    );
                }
                (Some(run.backlog), None)
            }
            Err(err) => {
                tracing::error!(collection = name, events = %self.events(), cause = %err, "folding the ledger failed");
                (self.fold.backlog(now).await.ok(), Some(err))
            }
        };
        if let Some(backlog) = &backlog {
            self.account(backlog);
        }
        let stuck = backlog
            .as_ref()
            .and_then(|b| b.oldest_age)
            .is_some_and(|a| a > self.timing.stuck_after);
        let refusing = matches!(
            refused,
            Some(
                Error::IndexesMissing { .. }
                    | Error::InvalidArgument(_)
                    | Error::Malformed { .. }
                    | Error::FoldStateLost { .. }
                    | Error::HistoryLost { .. }
                    | Error::FoldStopped { .. }
                    | Error::UpgradeBlocked { .. }
            )
        );
        let observation = (stuck || refusing).then(|| Observation {
            count: backlog.as_ref().map_or(0, |b| b.events),
            oldest_age: backlog.as_ref().and_then(|b| b.oldest_age),
            sample_ids: Vec::new(),
            detail: Some(match &refused {
                Some(err) => err.to_string(),
                None => format!(
                    "recorded events of {} wait longer than stuck_after to be folded",
                    self.events()
                ),
            }),
        });
        // A pass that failed without a verdict on the ledger (an outage: the
        // server unreachable, a lease that ran out) measured at most the
        // backlog: events waiting too long fire the alert, but nothing
        // resolves it — whether the fold still refuses is unknown. The
        // alert stays as it was through the outage (which `tally_ready` and
        // `/readyz` show).
        let measured = refused.is_none() || refusing || stuck;
        if measured {
            self.alerts.set(AlertKind::EventsStuck, name, observation);
        }
        refused.is_none() && backlog.is_some_and(|b| b.events > 0)
    }

    /// The backlog's metrics and the `events_held` alert.
    fn account(&self, backlog: &Backlog) {
        let name = self.collection.as_str();
        self.metrics
            .events_backlog
            .with_label_values(&[name])
            .set(i64::try_from(backlog.events).unwrap_or(i64::MAX));
        self.metrics
            .events_fold_lag
            .with_label_values(&[name])
            .set(backlog.oldest_age.map_or(0.0, |a| a.as_secs_f64()));
        self.metrics
            .events_held
            .with_label_values(&[name])
            .set(i64::try_from(backlog.held.len()).unwrap_or(i64::MAX));
        let held = (!backlog.held.is_empty()).then(|| {
            let oldest = backlog.held.iter().map(|h| h.since).min();
            Observation {
                count: backlog.held.len() as u64,
                oldest_age: oldest.and_then(|t| t.elapsed().ok()),
                sample_ids: backlog
                    .held
                    .iter()
                    .take(HELD_SAMPLE)
                    .map(|h| display_id(&h.key))
                    .collect(),
                detail: backlog.held.first().map(|h| {
                    format!(
                        "counter {} refused the sum of {} recorded events of {} ({}); it is held \
                         and offered again every pass",
                        display_id(&h.key),
                        h.events,
                        self.events(),
                        h.cause
                    )
                }),
            }
        });
        self.alerts.set(AlertKind::EventsHeld, name, held);
    }
}
