//! The continuous fold of the ledgers: one task per ledger reads the
//! events collection's change stream as inserts come (the fold's own log,
//! `EventFold::listen`), folds within `[reconcile] fold_delay` of each
//! burst, and folds every `[monitor] scan_interval` whatever happens. The
//! scheduled reconcile run folds the ledger too, through the same
//! [`EventFold`].
//!
//! Only the active instance folds. After every pass the backlog, the lag,
//! the held sums, where the fold stands in the log and how far back the
//! oplog reaches are current in `/metrics`, and the alerts follow:
//! `events_stuck` (events waiting longer than `[alerts] stuck_after`, or a
//! ledger the fold refuses), `events_held` (counters refusing their sums),
//! `events_stream_down` (the log cannot be read for longer than `[alerts]
//! monitor_down_after`), `events_fold_behind` (the fold's position is older
//! than half the oplog's window, and than `stuck_after`: it would stop if it
//! stayed behind) and
//! `events_fold_stopped` (its position is no longer in the oplog:
//! `tallyd fold-from`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::alert::{AlertKind, Alerts, Observation};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::document::display_id;
use crate::error::Error;
use crate::ledger::{Backlog, EventFold};
use crate::reconcile::{FoldTarget, Reconciler};
use crate::store::Store;

/// How long a failed read of the log waits before the next pass opens it
/// again.
const REOPEN_AFTER: Duration = Duration::from_secs(2);
/// Counters named one by one in an `events_held` alert.
const HELD_SAMPLE: usize = 10;
/// How often the oplog's window is read again.
const WINDOW_EVERY: Duration = Duration::from_secs(60);

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
    fold: Arc<EventFold>,
    collection: String,
    timing: Timing,
    metrics: Metrics,
    alerts: Alerts,
    role: watch::Receiver<Role>,
    shutdown: CancellationToken,
}

/// Starts a folding task for every collection with a ledger.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start(
    reconciler: &Reconciler,
    store: &Store,
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
        let folder = LedgerFolder {
            store: store.clone(),
            fold: reconciler.event_fold(&target.spec),
            collection: target.spec.name.clone(),
            timing,
            metrics: metrics.clone(),
            alerts: alerts.clone(),
            role: role.clone(),
            shutdown: shutdown.clone(),
        };
        tracker.spawn(folder.run());
    }
}

/// How the last read of the log went.
enum Heard {
    /// Inserts wait to be folded.
    Inserts,
    /// Nothing came by the time the next periodic pass is due.
    Nothing,
    /// The fold has no log open yet (or its last pass closed it).
    NotListening,
    /// The read failed.
    Failed(Error),
}

impl LedgerFolder {
    fn events(&self) -> &str {
        self.fold.events_collection()
    }

    /// A pass at start, then one within `fold_delay` of inserts the log
    /// shows and one every scan interval, until shutdown.
    async fn run(self) {
        let name = self.collection.clone();
        let mut next_scan = Instant::now();
        let mut down_since: Option<Instant> = None;
        let mut window = Window::default();
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            if Instant::now() >= next_scan || !self.active() {
                if !self.active() {
                    tokio::select! {
                        () = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep_until(next_scan) => {}
                    }
                }
                let waiting = self.pass(&mut window, &mut down_since).await;
                next_scan = Instant::now() + self.next_pass_in(waiting);
                continue;
            }
            let heard = tokio::select! {
                () = self.shutdown.cancelled() => return,
                heard = self.listen(next_scan) => heard,
            };
            match heard {
                Heard::Inserts => {
                    self.stream_up(&name, &mut down_since);
                    tokio::select! {
                        () = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep(self.timing.fold_delay) => {}
                    }
                    let waiting = self.pass(&mut window, &mut down_since).await;
                    next_scan = Instant::now() + self.next_pass_in(waiting);
                }
                Heard::Nothing => self.stream_up(&name, &mut down_since),
                Heard::NotListening => {
                    tokio::select! {
                        () = self.shutdown.cancelled() => return,
                        () = tokio::time::sleep_until(next_scan) => {}
                    }
                }
                Heard::Failed(err) => {
                    self.stream_down(&name, &mut down_since, &err);
                    next_scan = next_scan.min(Instant::now() + REOPEN_AFTER);
                }
            }
        }
    }

    fn active(&self) -> bool {
        *self.role.borrow() == Role::Active
    }

    /// How soon the next pass runs: soon while events wait (more than one
    /// pass takes), else at the scan interval.
    fn next_pass_in(&self, waiting: bool) -> Duration {
        if waiting {
            self.timing.fold_delay
        } else {
            self.timing.scan_interval
        }
    }

    /// Reads the log until inserts come or `until`.
    async fn listen(&self, until: Instant) -> Heard {
        let wait = until.saturating_duration_since(Instant::now());
        match self.fold.listen(wait).await {
            Ok(Some(0)) => Heard::Nothing,
            Ok(Some(_)) => Heard::Inserts,
            Ok(None) => Heard::NotListening,
            Err(err) => Heard::Failed(err),
        }
    }

    fn stream_up(&self, name: &str, down_since: &mut Option<Instant>) {
        *down_since = None;
        self.metrics
            .events_stream_up
            .with_label_values(&[name])
            .set(1);
        self.alerts.set(AlertKind::EventsStreamDown, name, None);
    }

    fn stream_down(&self, name: &str, down_since: &mut Option<Instant>, err: &Error) {
        self.metrics
            .events_stream_failures
            .with_label_values(&[name])
            .inc();
        self.metrics
            .events_stream_up
            .with_label_values(&[name])
            .set(0);
        let since = *down_since.get_or_insert_with(Instant::now);
        tracing::warn!(collection = name, events = %self.events(), cause = %err, "reading the events collection's change stream failed; the next pass opens it again");
        let down = since.elapsed();
        let observation = (down >= self.timing.stream_down_after).then(|| Observation {
            count: 1,
            oldest_age: Some(down),
            sample_ids: Vec::new(),
            detail: Some(format!(
                "the change stream of {} cannot be read ({err}); its events are folded only as \
                 passes manage to read it",
                self.events()
            )),
        });
        self.alerts
            .set(AlertKind::EventsStreamDown, name, observation);
    }

    /// One fold pass while this instance is active, then the metrics and
    /// alerts of what is left; whether events wait to be folded (or a pass
    /// another fold holds).
    async fn pass(&self, window: &mut Window, down_since: &mut Option<Instant>) -> bool {
        let name = self.collection.as_str();
        if !self.active() {
            return false;
        }
        let now = match self.store.server_time().await {
            Ok(now) => now,
            Err(err) => {
                tracing::warn!(collection = name, cause = %err, "cannot read the server's clock; the fold waits");
                return false;
            }
        };
        window.refresh(&self.store, &self.metrics, now).await;
        let mut held_elsewhere = false;
        let (backlog, refused) = match self.fold.fold(now, &self.shutdown).await {
            Ok(run) => {
                // Another fold holds a pass (or a daemon killed mid-pass
                // left it until its lease runs out): try again soon, not at
                // the scan interval — no insert may come to wake this one.
                held_elsewhere = run.busy;
                tracing::debug!(
                    collection = name,
                    busy = run.busy,
                    folded = run.events_folded,
                    waiting = run.backlog.events,
                    "fold pass"
                );
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
        if let Some(err @ Error::LogRefused { .. }) = &refused {
            self.stream_down(name, down_since, err);
        }
        let stopped = matches!(
            refused,
            Some(Error::HistoryLost { .. } | Error::FoldStopped { .. })
        );
        self.metrics
            .events_fold_stopped
            .with_label_values(&[name])
            .set(i64::from(stopped));
        self.alert_stopped(stopped.then_some(refused.as_ref()).flatten());
        if let Some(backlog) = &backlog {
            self.account(backlog);
            // A pass an outage stopped says nothing of the fold's pace: its
            // position aged with the outage, and the next pass moves it (a
            // young oplog's window — its life so far — made a short outage
            // look like a fold at risk). The alert stays as it was.
            if !refused.as_ref().is_some_and(outage) {
                self.alert_behind(backlog, window.seconds);
            }
        }
        self.alert_stuck(backlog.as_ref(), refused.as_ref());
        held_elsewhere || (refused.is_none() && backlog.is_some_and(|b| b.events > 0))
    }

    /// `events_stuck`: events waiting longer than `stuck_after`, or a
    /// ledger the fold refuses.
    fn alert_stuck(&self, backlog: Option<&Backlog>, refused: Option<&Error>) {
        let stuck = backlog
            .and_then(|b| b.oldest_age)
            .is_some_and(|a| a > self.timing.stuck_after);
        let refusing = matches!(
            refused,
            Some(
                Error::IndexesMissing { .. }
                    | Error::InvalidArgument(_)
                    | Error::Malformed { .. }
                    | Error::FoldStateLost { .. }
                    | Error::UpgradeBlocked { .. }
                    | Error::ReplicaSetRequired { .. }
                    | Error::LogRefused { .. }
            )
        );
        let observation = (stuck || refusing).then(|| Observation {
            count: backlog.map_or(0, |b| b.events),
            oldest_age: backlog.and_then(|b| b.oldest_age),
            sample_ids: Vec::new(),
            detail: Some(match refused {
                Some(err) if refusing => err.to_string(),
                _ => format!(
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
            self.alerts
                .set(AlertKind::EventsStuck, &self.collection, observation);
        }
    }

    /// `events_fold_stopped`: the fold cannot go on from its position.
    fn alert_stopped(&self, stopped: Option<&Error>) {
        let observation = stopped.map(|err| Observation {
            count: 1,
            oldest_age: None,
            sample_ids: Vec::new(),
            detail: Some(err.to_string()),
        });
        self.alerts
            .set(AlertKind::EventsFoldStopped, &self.collection, observation);
    }

    /// `events_fold_behind`: the fold's position is older than half the
    /// oplog's window (`window`, in seconds, when the daemon may read it)
    /// and than `stuck_after` and the idle advance: a fold a moment behind
    /// a young oplog (a new deployment's, whose window is only as long as
    /// its life so far) is not at risk.
    fn alert_behind(&self, backlog: &Backlog, window: Option<f64>) {
        let (Some(age), Some(window)) = (backlog.position_age, window) else {
            return;
        };
        // A position younger than the idle advance is where an idle fold
        // keeps it by design, whatever the window.
        let floor = self.timing.stuck_after.max(self.fold.idle_advance());
        let behind = age.as_secs_f64() > window / 2.0 && age > floor;
        let observation = behind.then(|| Observation {
            count: backlog.events,
            oldest_age: Some(age),
            sample_ids: Vec::new(),
            detail: Some(format!(
                "the fold of {} stands {} back in the change stream, more than half the oplog's \
                 window ({}): if it stays behind, the oplog will no longer hold its position and \
                 the fold will stop",
                self.events(),
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                humantime::format_duration(Duration::from_secs(window as u64))
            )),
        });
        self.alerts
            .set(AlertKind::EventsFoldBehind, &self.collection, observation);
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
        if let Some(age) = backlog.position_age {
            self.metrics
                .events_fold_position_age
                .with_label_values(&[name])
                .set(age.as_secs_f64());
        }
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

/// The oplog's window as last read.
#[derive(Debug, Default)]
struct Window {
    seconds: Option<f64>,
    read_at: Option<Instant>,
}

impl Window {
    /// Reads the window again when it is older than [`WINDOW_EVERY`]; a user
    /// who may not read it leaves it unknown (`tallyd doctor` says so).
    async fn refresh(&mut self, store: &Store, metrics: &Metrics, now: SystemTime) {
        if self.read_at.is_some_and(|at| at.elapsed() < WINDOW_EVERY) {
            return;
        }
        self.read_at = Some(Instant::now());
        match crate::ledger::log::oplog_start(store).await {
            Ok(Some(start)) => {
                let seconds = now.duration_since(start).unwrap_or_default().as_secs_f64();
                self.seconds = Some(seconds);
                metrics
                    .oplog_window
                    .with_label_values::<&str>(&[])
                    .set(seconds);
            }
            Ok(None) => self.seconds = None,
            Err(err) => {
                tracing::debug!(cause = %err, "cannot read the oplog's window");
            }
        }
    }
}

/// Whether a fold pass failed for an outage: the server unreachable (or
/// not primary), or its lease run out while it waited.
fn outage(err: &Error) -> bool {
    err.is_unavailable() || matches!(err, Error::FoldPassLost { .. })
}
