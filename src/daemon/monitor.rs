//! A live view of the pending tokens and lane maps in the counter
//! collections (the book: design/daemon.md), kept by change streams and backed up by
//! periodic scans.
//!
//! The view holds, per document that has pending entries or lane entries,
//! the entries' tokens and the number of lane entries (not the map) —
//! nothing for documents without either — so its memory is bounded by the
//! number of pending tokens and of documents written through lanes, not of
//! all documents. From it the daemon computes, every second, how many
//! tokens are stuck, the oldest age, the longest array, the largest lane
//! map and the malformed documents, for metrics and alerts.
//!
//! Per collection, one task:
//!
//! 1. opens the change stream where the last one stopped (the resume token
//!    saved in the state collection), so writes made while the daemon was
//!    down are seen; then scans the collection (the fold's report) to
//!    rebuild the view, and applies events from then on;
//! 2. saves the resume token every `save_interval` and at shutdown — a
//!    stop abandons whatever is in flight (a save, a scan, a read of the
//!    stream: the stream's position is that of the last event applied)
//!    and makes one last save, bounded so that it ends within the drain's
//!    deadline, and at once when the server is known to be unreachable;
//! 3. rescans every `scan_interval`;
//! 4. on a lost history (286, 280, 260: see [`history_lost`]) or an
//!    invalidate event, logs at WARN, counts it, discards the saved
//!    position, rescans and opens a new stream — never a silent gap; on
//!    other errors reconnects from the last saved position with capped
//!    exponential backoff.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, OperationType, ResumeToken};
use mongodb::options::FullDocumentType;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::MonitorConfig;
use crate::daemon::metrics::Metrics;
use crate::daemon::state::State;
use crate::error::{Error, code, human_duration, server_code};
use crate::reconcile::{FoldTarget, Reconciler};
use crate::store::Store;

mod snapshot;
mod view;
pub(crate) use snapshot::{Limits, Snapshot};
use view::{Held, View, read_document};

/// How long one read of the stream waits for events on the server: also
/// how quickly the watcher notices a shutdown or a timer.
const AWAIT: Duration = Duration::from_millis(500);
/// The longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long the last save at a stop is given when every host of the
/// connection failed its last heartbeat: the server is gone, and the stop
/// does not wait for it.
const LAST_SAVE_UNREACHABLE: Duration = Duration::from_secs(1);

/// Whether a collection's stream is open.
#[derive(Debug, Clone, Copy)]
struct Health {
    up: bool,
    /// When it went down (or the monitor started); `None` while up.
    down_since: Option<Instant>,
}

struct Watched {
    target: FoldTarget,
    view: Mutex<View>,
    health: Mutex<Health>,
    /// The last attempt to save the stream's position failed (and none
    /// succeeded since).
    unsaved: AtomicBool,
    /// A scan has filled the view since the start: until then it is empty
    /// for want of looking, not for want of documents.
    scanned: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The live view of every configured collection: a cheap-to-clone handle.
#[derive(Clone)]
pub(crate) struct Monitor {
    collections: Arc<HashMap<String, Arc<Watched>>>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("collections", &self.collections.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Everything a collection's watcher task needs.
struct Watcher {
    watched: Arc<Watched>,
    store: Store,
    state: State,
    config: MonitorConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
    /// The drain's deadline: the last save ends before it.
    stop_within: Duration,
}

impl Monitor {
    /// Starts watching `targets` (one task each, on `tracker`) until
    /// `shutdown`; the last save of each stream's position ends within
    /// `stop_within` of it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        store: &Store,
        state: &State,
        targets: &[FoldTarget],
        config: MonitorConfig,
        metrics: &Metrics,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
        stop_within: Duration,
    ) -> Self {
        let started = Instant::now();
        let collections: HashMap<String, Arc<Watched>> = targets
            .iter()
            .map(|target| {
                let watched = Arc::new(Watched {
                    target: target.clone(),
                    view: Mutex::new(View::default()),
                    health: Mutex::new(Health {
                        up: false,
                        down_since: Some(started),
                    }),
                    unsaved: AtomicBool::new(false),
                    scanned: AtomicBool::new(false),
                });
                // Down until its stream opens: the series is there from
                // the start.
                metrics
                    .monitor_up
                    .with_label_values(&[target.spec.name.as_str()])
                    .set(0);
                (target.spec.name.clone(), watched)
            })
            .collect();
        for watched in collections.values() {
            let watcher = Watcher {
                watched: watched.clone(),
                store: store.clone(),
                state: state.clone(),
                config,
                metrics: metrics.clone(),
                shutdown: shutdown.clone(),
                stop_within,
            };
            tracker.spawn(watcher.run());
        }
        Self {
            collections: Arc::new(collections),
        }
    }

    /// The collection's pending arrays and lane maps now: tokens older
    /// than `stuck_before` are stuck; arrays and maps past `limits` too
    /// large.
    pub(crate) fn snapshot(
        &self,
        collection: &str,
        stuck_before: SystemTime,
        limits: Limits,
    ) -> Snapshot {
        let Some(watched) = self.collections.get(collection) else {
            return Snapshot::default();
        };
        snapshot::take(&lock(&watched.view), stuck_before, limits)
    }

    /// Whether a scan of the collection has filled the view yet.
    pub(crate) fn scanned(&self, collection: &str) -> bool {
        self.collections
            .get(collection)
            .is_some_and(|watched| watched.scanned.load(Ordering::Relaxed))
    }

    /// The collections whose latest stream position could not be saved (the
    /// last attempt failed): the next start resumes from an older one.
    pub(crate) fn unsaved(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .collections
            .iter()
            .filter(|(_, watched)| watched.unsaved.load(Ordering::Relaxed))
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    /// How long the collection's change stream has been down (`None` while
    /// it is up).
    pub(crate) fn down_for(&self, collection: &str) -> Option<Duration> {
        let watched = self.collections.get(collection)?;
        let health = *lock(&watched.health);
        if health.up {
            None
        } else {
            health.down_since.map(|since| since.elapsed())
        }
    }
}

/// Whether the stream cannot go on from its position: the history is gone
/// (286), the stream failed for good (280), the token is refused (260).
fn history_lost(err: &mongodb::error::Error) -> bool {
    matches!(
        server_code(err),
        Some(
            code::CHANGE_STREAM_HISTORY_LOST
                | code::CHANGE_STREAM_FATAL_ERROR
                | code::INVALID_RESUME_TOKEN
        )
    )
}

/// How a stream ends on `err` from `operation`.
fn ended_by(operation: &'static str, err: mongodb::error::Error) -> Ended {
    if history_lost(&err) {
        Ended::Restart("history_lost")
    } else {
        Ended::Failed(Error::Server(crate::error::Failure::once(operation, err)))
    }
}

/// Why a stream ended.
enum Ended {
    /// Shutdown: stop.
    Shutdown,
    /// The server lost the stream's history, or the stream was invalidated:
    /// rescan and start afresh.
    Restart(&'static str),
    /// An error: reconnect from the last position after a backoff.
    Failed(Error),
}

impl Watcher {
    fn name(&self) -> &str {
        &self.watched.target.spec.name
    }

    fn set_up(&self, up: bool) {
        let mut health = lock(&self.watched.health);
        if up {
            *health = Health {
                up: true,
                down_since: None,
            };
        } else if health.up {
            *health = Health {
                up: false,
                down_since: Some(Instant::now()),
            };
        }
        self.metrics
            .monitor_up
            .with_label_values(&[self.name()])
            .set(i64::from(up));
    }

    async fn run(self) {
        let mut backoff = Duration::from_secs(1);
        // Cleared once a stream opened from scratch: later reconnects
        // resume from what that stream saved.
        let mut fresh_start = false;
        loop {
            if self.shutdown.is_cancelled() {
                break;
            }
            let started = Instant::now();
            let ended = if self.config.enabled {
                self.stream(&mut fresh_start).await
            } else {
                self.scan_only().await
            };
            self.set_up(false);
            match ended {
                Ended::Shutdown => break,
                Ended::Restart(reason) => {
                    tracing::warn!(collection = %self.name(), reason, "change stream restarted with a full rescan");
                    self.metrics
                        .monitor_restarts
                        .with_label_values(&[self.name(), reason])
                        .inc();
                    fresh_start = true;
                    backoff = Duration::from_secs(1);
                }
                Ended::Failed(err) => {
                    self.metrics
                        .monitor_restarts
                        .with_label_values(&[self.name(), "error"])
                        .inc();
                    if started.elapsed() > MAX_BACKOFF {
                        backoff = Duration::from_secs(1);
                    }
                    tracing::warn!(
                        collection = %self.name(),
                        cause = %self.store.explain(&err),
                        retry_in = %human_duration(backoff),
                        "change stream failed; reconnecting"
                    );
                    let wait = backoff.mul_f64(0.5 + fastrand::f64() / 2.0);
                    tokio::select! {
                        () = self.shutdown.cancelled() => break,
                        () = tokio::time::sleep(wait) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Runs `work` unless a stop comes first: `None` then, and `work` is
    /// abandoned (a read changes nothing; a save abandoned in flight may
    /// still land, after the last one — an older position, from which the
    /// next start replays a few events more).
    async fn or_stop<T>(&self, work: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::select! {
            () = self.shutdown.cancelled() => None,
            done = work => Some(done),
        }
    }

    /// Without change streams: a scan every `scan_interval`.
    async fn scan_only(&self) -> Ended {
        loop {
            match self.or_stop(self.rescan()).await {
                None => return Ended::Shutdown,
                Some(Err(err)) => return Ended::Failed(err),
                Some(Ok(())) => {}
            }
            tokio::select! {
                () = self.shutdown.cancelled() => return Ended::Shutdown,
                () = tokio::time::sleep(self.config.scan_interval) => {}
            }
        }
    }

    /// Opens the stream (from scratch when `fresh_start`, which is then
    /// cleared), scans, and follows it until it ends.
    async fn stream(&self, fresh_start: &mut bool) -> Ended {
        let saved = if *fresh_start {
            match self
                .or_stop(self.state.forget_resume_token(self.name()))
                .await
            {
                None => return Ended::Shutdown,
                Some(Err(err)) => return Ended::Failed(err),
                Some(Ok(())) => None,
            }
        } else {
            match self.or_stop(self.state.resume_token(self.name())).await {
                None => return Ended::Shutdown,
                Some(Err(err)) => return Ended::Failed(err),
                Some(Ok(token)) => token,
            }
        };
        let resumed = saved.is_some();
        let mut stream = match self.or_stop(self.open(saved)).await {
            None => return Ended::Shutdown,
            Some(Ok(stream)) => stream,
            Some(Err(ended)) => return ended,
        };
        *fresh_start = false;
        if resumed {
            tracing::info!(collection = %self.name(), "change stream resumed from the saved position");
        }
        // The stream is open first, so nothing that happens during the scan
        // is missed: it arrives as events afterwards.
        match self.or_stop(self.rescan()).await {
            None => return Ended::Shutdown,
            Some(Err(err)) => return Ended::Failed(err),
            Some(Ok(())) => {}
        }
        self.set_up(true);
        tracing::info!(collection = %self.name(), "watching for changes");
        let mut saved_token: Option<ResumeToken> = None;
        let mut next_save = Instant::now() + self.config.save_interval;
        let mut next_rescan = Instant::now() + self.config.scan_interval;
        // The stream is read with `next_if_any`, which returns after each
        // getMore (at most `AWAIT` long), and never raced against timers: a
        // getMore cancelled midway would leave the cursor unusable. Only a
        // stop abandons one: the cursor is not read again, and its position
        // is that of the last event applied.
        loop {
            if self.shutdown.is_cancelled() {
                self.last_save(stream.resume_token(), &mut saved_token)
                    .await;
                return Ended::Shutdown;
            }
            if Instant::now() >= next_save {
                let save = self.save(stream.resume_token(), &mut saved_token);
                if self.or_stop(save).await.is_none() {
                    continue;
                }
                next_save = Instant::now() + self.config.save_interval;
            }
            if Instant::now() >= next_rescan {
                match self.or_stop(self.rescan()).await {
                    None => continue,
                    Some(Err(err)) => {
                        self.save(stream.resume_token(), &mut saved_token).await;
                        self.watched.unsaved.store(false, Ordering::Relaxed);
                        return Ended::Failed(err);
                    }
                    Some(Ok(())) => {}
                }
                next_rescan = Instant::now() + self.config.scan_interval;
            }
            let Some(next) = self.or_stop(stream.next_if_any()).await else {
                continue;
            };
            match next {
                Ok(Some(event)) => {
                    // An invalidate ends the stream: its position is
                    // discarded, never saved (nothing can resume after it).
                    if let Some(ended) = self.apply(event) {
                        return ended;
                    }
                }
                Ok(None) if stream.is_alive() => {}
                Ok(None) => return Ended::Restart("invalidate"),
                Err(err) => {
                    // Broken off: the next stream resumes from the last saved
                    // position (and scans); none is left unsaved for a stop.
                    self.save(stream.resume_token(), &mut saved_token).await;
                    self.watched.unsaved.store(false, Ordering::Relaxed);
                    return ended_by("monitor.next", err);
                }
            }
        }
    }

    async fn open(
        &self,
        resume_after: Option<ResumeToken>,
    ) -> Result<ChangeStream<ChangeStreamEvent<Document>>, Ended> {
        let spec = &self.watched.target.spec;
        let collection = self.store.collection(&spec.name);
        let projection = doc! { "$project": {
            "operationType": 1,
            "documentKey": 1,
            "wallTime": 1,
            "clusterTime": 1,
            "ns": 1,
            format!("fullDocument.{}", spec.pending_field): 1,
            format!("fullDocument.{}", spec.counter_field): 1,
            format!("fullDocument.{}", spec.settled_field): 1,
            format!("fullDocument.{}", spec.lanes_field): 1,
        }};
        let opened = collection
            .watch()
            .pipeline([projection])
            .full_document(FullDocumentType::UpdateLookup)
            .max_await_time(AWAIT)
            .resume_after(resume_after)
            .await;
        match opened {
            Ok(stream) => Ok(stream),
            Err(err) => Err(ended_by("monitor.open", err)),
        }
    }

    /// Applies one event to the view; `Some` when the stream must end.
    fn apply(&self, event: ChangeStreamEvent<Document>) -> Option<Ended> {
        let name = self.name();
        self.metrics.monitor_events.with_label_values(&[name]).inc();
        if let Some(wall) = event.wall_time
            && let Ok(lag) = SystemTime::now().duration_since(wall.to_system_time())
        {
            self.metrics
                .monitor_lag
                .with_label_values(&[name])
                .set(lag.as_secs_f64());
        }
        let id = event
            .document_key
            .as_ref()
            .and_then(|k| k.get("_id"))
            .cloned();
        match event.operation_type {
            OperationType::Insert | OperationType::Update | OperationType::Replace => {
                if let Some(id) = id {
                    let pending = event
                        .full_document
                        .as_ref()
                        .and_then(|d| read_document(&self.watched.target, d));
                    lock(&self.watched.view).set(&id, pending);
                }
                None
            }
            OperationType::Delete => {
                if let Some(id) = id {
                    lock(&self.watched.view).set(&id, None);
                }
                None
            }
            OperationType::Invalidate => Some(Ended::Restart("invalidate")),
            // Drop, rename, drop database: an invalidate follows.
            _ => None,
        }
    }

    /// Rebuilds the view from a full scan (the fold's report pass).
    async fn rescan(&self) -> Result<(), Error> {
        let target = &self.watched.target;
        let reconciler = Reconciler::new(&self.store);
        let mut rows = reconciler.report(target).await?;
        let mut view = View::default();
        while let Some(row) = rows
            .try_next()
            .await
            .map_err(|err| Error::Server(crate::error::Failure::once("monitor.scan", err)))?
        {
            let id = row.get("_id").cloned().unwrap_or(Bson::Null);
            view.set(&id, read_document(target, &row));
        }
        *lock(&self.watched.view) = view;
        self.watched.scanned.store(true, Ordering::Relaxed);
        self.metrics
            .monitor_rescans
            .with_label_values(&[self.name()])
            .inc();
        Ok(())
    }

    /// The save at a stop: tried a few times (a position lost at a stop
    /// costs the next start a rescan, and one blip of the network should
    /// not), all within the drain's deadline less a second — or within
    /// [`LAST_SAVE_UNREACHABLE`] when every host failed its last heartbeat.
    /// A save cut off is reported as not saved.
    async fn last_save(&self, token: Option<ResumeToken>, saved: &mut Option<ResumeToken>) {
        let bound = if self.store.seems_reachable() {
            self.stop_within
                .saturating_sub(Duration::from_secs(1))
                .max(self.stop_within / 2)
        } else {
            LAST_SAVE_UNREACHABLE
        };
        let tries = async {
            let mut pauses = [250, 500, 1000].into_iter();
            while !self.save(token.clone(), saved).await {
                let Some(pause) = pauses.next() else { break };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        };
        if tokio::time::timeout(bound, tries).await.is_err() {
            self.watched.unsaved.store(true, Ordering::Relaxed);
            tracing::warn!(
                collection = %self.name(),
                within = %human_duration(bound),
                "the change-stream position could not be saved before the stop; the next start \
                 resumes from the last saved one"
            );
        }
    }

    /// Saves the stream's position (`token`, taken from the stream) when it
    /// moved; false when the save failed.
    async fn save(&self, token: Option<ResumeToken>, saved: &mut Option<ResumeToken>) -> bool {
        let Some(token) = token else {
            return true;
        };
        if saved.as_ref() == Some(&token) {
            return true;
        }
        match self.state.save_resume_token(self.name(), &token).await {
            Ok(()) => {
                *saved = Some(token);
                self.watched.unsaved.store(false, Ordering::Relaxed);
                true
            }
            Err(err) => {
                self.watched.unsaved.store(true, Ordering::Relaxed);
                tracing::warn!(
                    collection = %self.name(),
                    cause = %self.store.explain(&err),
                    "cannot save the change-stream position"
                );
                false
            }
        }
    }
}
