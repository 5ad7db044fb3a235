//! The fold of recorded events into their counters: run by the daemon
//! continuously and on its schedule, embeddable as an [`EventFold`].
//!
//! The events collection is an append-only log: the fold never writes an
//! event. It follows the collection's own log — its change stream
//! (`ledger::log`): every insert once, in the order inserts committed,
//! only what a majority has written. The fold keeps one **position** in it
//! (`ledger::state`): every insert at or before it is in its counter (or in
//! a held sum), every insert after it is not. An insert that commits later
//! comes after every position already read, so nothing can land behind the
//! fold, and recording never waits for it.
//!
//! **A pass** (`pass`):
//!
//! 1. **Read.** The inserts after the position, as the log gives them (up
//!    to [`PASS_EVENTS`]); the last one read is the pass's end.
//! 2. **Intent.** One conditioned write records the pass `P = pass + 1`:
//!    its window (the position, and its last insert), its owner and a
//!    deadline (renewed while it works), conditioned on the state's
//!    version: two folds never record the same pass.
//! 3. **Sums** of the window's events per counter, here (`sums`).
//! 4. **Apply.** Each counter's sum through the ledger's fold lane at
//!    position `P` (`apply`): a counter that has the pass already ignores
//!    it, so applying a pass again is a no-op. A counter the server refuses
//!    holds its sum (`held`), never stopping the others.
//! 5. **Commit.** One conditioned write (on the intent still being ours)
//!    moves the position to the window's end, stores the held sums and
//!    drops the intent.
//!
//! **Recovery.** A pass left unfinished is resumed by the next pass of the
//! same fold, or taken over by another once its deadline plus one attempt
//! has passed: it reads its window again from the log — the same inserts,
//! in the same order, up to the same last one — and applies it at the same
//! position.
//!
//! **A catch-up** (`catch_up`) folds the collection itself, up to a
//! boundary in the log, where the log takes over: a ledger's first fold
//! (events recorded before any fold), the upgrade from an earlier version's
//! state, and `tallyd fold-from` after the log was lost.
//!
//! **Deletion** (`sweep`): events the fold is past and older than
//! `event_retention` go, in bulk; there is no TTL index, which could not
//! wait for the fold.
//!
//! **A lost state** (`<events>_fold` dropped) is refused, never folded
//! over: a counter's fold lane position shows the state existed.

mod apply;
mod catch_up;
mod held;
mod pass;
mod sums;
mod sweep;
mod tail;

use std::time::{Duration, Instant, SystemTime};

use mongodb::bson::{Bson, Document, Timestamp, doc, oid::ObjectId};
use mongodb::{ClientSession, Collection};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::{DEFAULT_EVENT_RETENTION, fold_lane, index, state};
use crate::document::display_id;
use crate::error::Error;
use crate::store::Store;
use crate::write::counter::{CollectionConfig, Counters, WriterConfig};
use crate::write::lane::LaneName;

pub use catch_up::{FoldFrom, UncertainEvent};

/// How many counters a pass applies at once.
const APPLY_CONCURRENCY: usize = 16;

/// The most inserts one pass folds: a longer backlog goes in several.
pub(crate) const PASS_EVENTS: usize = 100_000;

/// The part of the dedupe window's floor beyond the retry horizon and one
/// attempt: room for the fold's lag and the clocks.
pub const RETENTION_MARGIN: Duration = Duration::from_secs(3600);

/// The shortest dedupe window that is safe with writers retrying for
/// `retry_horizon` and attempts bounded by `attempt_timeout`.
///
/// ```
/// use std::time::Duration;
/// use tally::{EventFoldSettings, retention_floor};
///
/// let settings = EventFoldSettings::default();
/// let floor = retention_floor(settings.retry_horizon, Duration::from_secs(60));
/// assert!(settings.event_retention >= floor, "the default window is safe");
/// ```
pub fn retention_floor(retry_horizon: Duration, attempt_timeout: Duration) -> Duration {
    retry_horizon + attempt_timeout + RETENTION_MARGIN
}

/// What an [`EventFold`] needs to know besides the collection.
///
/// ```
/// use std::time::Duration;
/// use tally::{EventFoldSettings, retention_floor};
///
/// // Writers retrying for up to 10 minutes: the dedupe window must outlast them.
/// let settings = EventFoldSettings {
///     retry_horizon: Duration::from_secs(600),
///     event_retention: Duration::from_secs(2 * 24 * 3600),
///     ..EventFoldSettings::default()
/// };
/// let floor = retention_floor(settings.retry_horizon, Duration::from_secs(60));
/// assert!(settings.event_retention >= floor);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFoldSettings {
    /// The dedupe window: an event is deleted once folded and older than
    /// this. At least [`retention_floor`]. Default: 7 days.
    pub event_retention: Duration,
    /// The writers' retry horizon (`[writer] retry_horizon`): how long a
    /// recorder may send an unknown event again. Default: 3 minutes.
    pub retry_horizon: Duration,
    /// How long a pass's intent is its owner's without renewal: another
    /// fold takes a pass over only this long (plus one attempt) after its
    /// owner last renewed it. Renewed every third of it. Default: 30
    /// seconds.
    pub lease: Duration,
    /// How often a fold deletes old folded events (the sweep). Default: 10
    /// minutes.
    pub sweep_every: Duration,
    /// How many counters' new sums of a pass go to the server in one
    /// `update` command (each its own statement: the lanes protocol's
    /// update); 1 sends one command per counter. A counter with a held sum
    /// is always sent alone. Default: 100.
    pub apply_batch: usize,
    /// How far an idle ledger's position may fall behind the log before a
    /// pass moves it (one write): a position is where a fold, an exact read
    /// and a restarted daemon resume the log from, and must stay well
    /// inside the oplog's window. Default: 1 minute.
    pub advance_after: Duration,
}

impl Default for EventFoldSettings {
    fn default() -> Self {
        Self {
            event_retention: DEFAULT_EVENT_RETENTION,
            retry_horizon: WriterConfig::default().retry_horizon,
            lease: Duration::from_secs(30),
            sweep_every: Duration::from_secs(600),
            apply_batch: 100,
            advance_after: Duration::from_secs(60),
        }
    }
}

/// A sum a counter refused, held until it accepts it.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::EventFold,
/// #     now: std::time::SystemTime,
/// # ) -> Result<(), tally::Error> {
/// for held in fold.backlog(now).await?.held {
///     // A counter refused its sum (a validator, an overflow): fix the counter.
///     eprintln!(
///         "{} holds {} ({} events) since pass {}: {}",
///         held.key, held.amount, held.events, held.pass, held.cause
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldSum {
    /// The counter's `_id`.
    pub key: Bson,
    /// The pass it came from (its fold lane position).
    pub pass: i64,
    /// The sum (as text when past 2^63: no counter can take it).
    pub amount: String,
    /// How many events it sums.
    pub events: u64,
    /// Why the counter refused it last.
    pub cause: String,
    /// Since when it is held.
    pub since: SystemTime,
}

/// The events of a ledger not in their counters yet, and where its fold
/// stands.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::EventFold,
/// #     now: std::time::SystemTime,
/// # ) -> Result<(), tally::Error> {
/// let backlog = fold.backlog(now).await?;
/// if let Some(age) = backlog.oldest_age {
///     let age = humantime::format_duration(age);
///     println!("{} events to fold, the oldest {age} old", backlog.events);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Recorded events not folded yet.
    pub events: u64,
    /// The oldest of them's age (since its insert committed, by the
    /// server's clock, against `now`).
    pub oldest_age: Option<Duration>,
    /// The sums counters refused, with their counters.
    pub held: Vec<HeldSum>,
    /// How far behind `now` the fold's position in the log is (`None`
    /// before its first fold finished): how far back a fold resumes the
    /// log, which the oplog must still hold.
    pub position_age: Option<Duration>,
    /// The fold folds the collection itself up to a boundary in the log
    /// (a first fold, an upgrade, `tallyd fold-from`).
    pub catching_up: bool,
}

impl Backlog {
    /// Events in held sums.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::EventFold,
    /// #     now: std::time::SystemTime,
    /// # ) -> Result<(), tally::Error> {
    /// let backlog = fold.backlog(now).await?;
    /// if backlog.held_events() > 0 {
    ///     eprintln!("{} events wait in {} held sums", backlog.held_events(), backlog.held.len());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn held_events(&self) -> u64 {
        self.held.iter().map(|h| h.events).sum()
    }
}

/// What one call of [`EventFold::fold`] did.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::EventFold,
/// #     now: std::time::SystemTime,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
///
/// let run = fold.fold(now, &CancellationToken::new()).await?;
/// if run.busy {
///     println!("another fold is at work: nothing done");
/// } else if let Some(pass) = run.pass {
///     let (events, counters) = (run.events_folded, run.counters_written);
///     println!("up to pass {pass}: {events} events into {counters} counters");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventsRun {
    /// The last pass applied and committed, if any.
    pub pass: Option<i64>,
    /// A pass was an unfinished one, resumed or taken over.
    pub recovered: bool,
    /// Another fold's pass is in progress and its lease has not run out:
    /// nothing more was done.
    pub busy: bool,
    /// Events the passes folded (their sums are in their counters or held).
    pub events_folded: u64,
    /// Counter updates sent.
    pub counters_written: u64,
    /// Events whose amount is not an integer: reported, left out.
    pub malformed_events: u64,
    /// The fold state document's size in bytes, as the last pass read it.
    pub state_bytes: u64,
    /// Events deleted (folded, older than the dedupe window).
    pub events_deleted: u64,
    /// What is left after the passes.
    pub backlog: Backlog,
}

impl EventsRun {
    /// Adds one pass's work.
    fn add(&mut self, pass: &PassRun) {
        self.pass = pass.pass.or(self.pass);
        self.recovered |= pass.recovered;
        self.busy = pass.busy;
        self.events_folded += pass.events;
        self.counters_written += pass.written;
        self.malformed_events += pass.malformed;
        self.state_bytes = pass.state_bytes;
    }
}

/// What one pass did, and whether another should follow at once.
#[derive(Debug, Default)]
struct PassRun {
    pass: Option<i64>,
    recovered: bool,
    busy: bool,
    events: u64,
    written: u64,
    malformed: u64,
    state_bytes: u64,
    /// More work waits (a catch-up's next chunk, a full pass's rest, the
    /// passes after a resumed one).
    again: bool,
}

/// What a fold keeps between passes: the log kept open, and when it last
/// swept. Behind one lock: one pass at a time per fold.
#[derive(Debug, Default)]
struct Running {
    tail: Option<tail::Tail>,
    last_sweep: Option<Instant>,
}

/// Folds one ledger's events into its counters. One pass at a time per
/// fold (a second waits for the first); keep one per process: it owns its
/// passes by an id minted when it is made, and keeps the events
/// collection's log open from one pass to the next (drop it before
/// [`Store::shutdown`], which waits for open cursors).
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use std::time::Duration;
/// use tokio_util::sync::CancellationToken;
/// use tally::{CollectionConfig, EventFold, EventFoldSettings, Reconciler};
///
/// // A service folding its ledger itself, every few seconds, instead of tallyd.
/// let spec = CollectionConfig::new("order_totals");
/// let fold = EventFold::new(&store, spec, EventFoldSettings::default());
/// fold.check_indexes().await?;
/// let clock = Reconciler::new(&store);
/// let stop = CancellationToken::new();
/// while !stop.is_cancelled() {
///     let run = fold.fold(clock.server_time().await?, &stop).await?;
///     if run.backlog.events == 0 {
///         tokio::time::sleep(Duration::from_secs(5)).await;
///     }
/// }
/// // The fold's log is a cursor: let go of it first.
/// drop(fold);
/// store.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventFold {
    store: Store,
    events: Collection<Document>,
    events_name: String,
    keeper: state::Keeper,
    counters: Counters,
    fold_lane: Result<LaneName, Error>,
    settings: EventFoldSettings,
    owner: ObjectId,
    running: Mutex<Running>,
    /// The latest cluster time this fold saw: its next pass reads the
    /// state causally after it.
    seen: std::sync::Mutex<Option<Timestamp>>,
}

impl EventFold {
    /// A fold of `spec`'s events collection into `spec`'s counters.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{CollectionConfig, EventFold, EventFoldSettings};
    ///
    /// let spec = CollectionConfig::new("order_totals");
    /// let fold = EventFold::new(&store, spec, EventFoldSettings::default());
    /// assert_eq!(fold.events_collection(), "order_totals_events");
    /// # }
    /// ```
    pub fn new(store: &Store, spec: CollectionConfig, settings: EventFoldSettings) -> Self {
        let events_name = spec.events_collection_name();
        Self {
            store: store.clone(),
            events: store.collection(&events_name),
            keeper: state::Keeper::new(store, &events_name),
            fold_lane: fold_lane(&events_name),
            events_name,
            counters: Counters::new(store, spec, WriterConfig::default()),
            settings,
            owner: ObjectId::new(),
            running: Mutex::default(),
            seen: std::sync::Mutex::default(),
        }
    }

    /// The events collection's name.
    ///
    /// ```no_run
    /// # fn demo(fold: tally::EventFold) {
    /// tracing::info!(events = fold.events_collection(), "folding");
    /// # }
    /// ```
    pub fn events_collection(&self) -> &str {
        &self.events_name
    }

    /// Refuses a ledger without the indexes the fold needs
    /// ([`Error::IndexesMissing`]).
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold) -> Result<(), tally::Error> {
    /// use tally::Error;
    ///
    /// match fold.check_indexes().await {
    ///     Ok(()) => {}
    ///     Err(Error::IndexesMissing { collection, missing }) => {
    ///         eprintln!("run `tallyd setup` first: {collection} lacks {}", missing.join(", "));
    ///     }
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn check_indexes(&self) -> Result<(), Error> {
        let missing = index::missing(&self.store, &self.events_name).await?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::IndexesMissing {
                collection: self.events_name.clone(),
                missing,
            })
        }
    }

    /// Refuses settings that could count twice: a dedupe window below its
    /// floor, an events collection whose fold lane cannot be named.
    fn check_settings(&self) -> Result<(), Error> {
        let floor = retention_floor(self.settings.retry_horizon, self.store.attempt_timeout());
        if self.settings.event_retention < floor {
            return Err(Error::InvalidArgument(format!(
                "event_retention is {}, below its floor of {} (the retry horizon, one attempt and \
                 {} for clocks): a resent event could find its key forgotten and count twice",
                humantime::format_duration(self.settings.event_retention),
                humantime::format_duration(floor),
                humantime::format_duration(RETENTION_MARGIN)
            )));
        }
        self.fold_lane.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// Refuses to make a ledger's first state document when a counter
    /// holds a fold pass ([`Error::FoldStateLost`]): the state was lost,
    /// and passes numbered from 1 again would be taken for counted by a
    /// counter past them, dropping their sums. One read of the counters.
    async fn check_no_counter_folded(&self) -> Result<(), Error> {
        let spec = self.counters.spec();
        let position = format!("{}.{}", spec.lanes_field, self.fold_lane.clone()?.as_str());
        let counters: Collection<Document> = self.store.collection(&spec.name);
        let filter = doc! { &position: { "$exists": true } };
        let projection = doc! { "_id": 1 };
        let folded = self
            .store
            .find_one(&counters, filter, projection, "ledger.fold.check_state")
            .await?;
        match folded {
            None => Ok(()),
            Some(counter) => {
                let id = counter.get("_id").map_or_else(String::new, display_id);
                let evidence = format!("counter {id} of {} holds a fold pass", spec.name);
                Err(self.keeper.lost(evidence))
            }
        }
    }

    /// Folds what is there to fold — every insert the log holds when it
    /// begins, a catch-up to its end, a pass left unfinished — then sweeps
    /// when the sweep is due. `now` is the server's clock. A failed step
    /// fails the call; the next one resumes it.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::EventFold,
    /// #     clock: tally::Reconciler,
    /// # ) -> Result<(), tally::Error> {
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let stop = CancellationToken::new();
    /// let run = fold.fold(clock.server_time().await?, &stop).await?;
    /// println!(
    ///     "{} events folded, {} deleted; {} left",
    ///     run.events_folded, run.events_deleted, run.backlog.events
    /// );
    /// # Ok(()) }
    /// ```
    pub async fn fold(
        &self,
        now: SystemTime,
        stop: &CancellationToken,
    ) -> Result<EventsRun, Error> {
        self.check_settings()?;
        self.check_indexes().await?;
        let mut running = self.running.lock().await;
        let began = Instant::now();
        let clock = move || now + began.elapsed();
        let mut run = EventsRun::default();
        while !stop.is_cancelled() {
            let pass = self.pass(&mut running, &clock).await?;
            run.add(&pass);
            if !pass.again || pass.busy {
                break;
            }
        }
        if !run.busy
            && running
                .last_sweep
                .is_none_or(|at| at.elapsed() >= self.settings.sweep_every)
        {
            run.events_deleted = self.sweep(clock()).await?;
            running.last_sweep = Some(Instant::now());
        }
        run.backlog = self.backlog_of(&mut running, clock()).await?;
        Ok(run)
    }

    /// How far behind the log an idle ledger's position may stand before a
    /// pass moves it up (`advance_after`).
    #[cfg(feature = "daemon")]
    pub(crate) fn idle_advance(&self) -> Duration {
        self.settings.advance_after
    }

    /// Reads the log into the fold's read-ahead for at most `wait`, and says
    /// how many inserts wait to be folded: for a daemon that folds as soon
    /// as inserts come. `None` (at once) while the fold has no log open:
    /// before its first pass, or after a read failed (the next pass opens
    /// it again).
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold, clock: tally::Reconciler) -> Result<(), tally::Error> {
    /// use std::time::Duration;
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let stop = CancellationToken::new();
    /// loop {
    ///     match fold.listen(Duration::from_secs(1)).await? {
    ///         Some(0) => {}
    ///         // Inserts wait, or the log is not open yet: a pass opens it.
    ///         Some(_) | None => {
    ///             fold.fold(clock.server_time().await?, &stop).await?;
    ///         }
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn listen(&self, wait: Duration) -> Result<Option<u64>, Error> {
        let deadline = Instant::now() + wait;
        let mut running = self.running.lock().await;
        let Some(tail) = running.tail.as_mut() else {
            return Ok(None);
        };
        let waiting = match tail.listen(&self.store, PASS_EVENTS, deadline).await {
            Ok(waiting) => waiting,
            Err(err) => {
                // The next pass opens the log again from the state's position.
                running.tail = None;
                return Err(err);
            }
        };
        Ok(Some(waiting as u64))
    }

    /// A causally consistent session, after everything this fold saw.
    async fn session(&self) -> Result<ClientSession, Error> {
        let seen = *self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.store.causal_session(seen).await
    }

    /// Remembers what `session` saw, for the next pass's reads.
    fn saw(&self, session: &ClientSession) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(time) = session.operation_time() {
            *seen = Some(seen.map_or(time, |seen| seen.max(time)));
        }
    }
}

/// A held sum as the library shows it.
fn held_sum(held: &state::Held) -> HeldSum {
    HeldSum {
        key: held.key.clone(),
        pass: held.pass,
        amount: held.amount.to_string(),
        events: held.events,
        cause: held.cause.clone(),
        since: held.since,
    }
}
