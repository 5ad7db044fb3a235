//! The fold of recorded events into their counters: run by the
//! daemon continuously and on its schedule, embeddable as an
//! [`EventFold`].
//!
//! The events collection is an append-only log: the fold never writes an
//! event. Event numbers are the server's time (the recorder reads the
//! server's clock when it mints a lane, see `ledger::record::recorder`).
//! The fold keeps one **watermark** `W` in its state document
//! (`<events>_fold`, see `ledger::state`): every event numbered at
//! or below it is folded, every event above it is not.
//!
//! **What the fold stands on: the floor.** Before a pass reads the events
//! of `(W, W']`, it raises the events collection's floor — a validator
//! refusing every event numbered at or below `W'` (`ledger::floor`)
//! — at write concern `majority`. From then on no event of the range can
//! land, and every one that landed is visible: the range read once is the
//! range for good, which is what lets a pass be applied twice. A recorder
//! whose insert meets the floor wrote nothing and numbers it again above.
//!
//! **A pass** ([`EventFold::fold`]):
//!
//! 1. **Intent.** When events wait in `(W, W']` (`W'` is the server's
//!    clock when the pass began: it folds everything numbered before) or
//!    sums are held, one conditioned
//!    write records the pass `P = pass + 1`, its range, its owner and a
//!    deadline (renewed while it works), conditioned on the state's
//!    version: two folds never record the same pass.
//! 2. **Floor** raised to `W'` (and again over itself after the sums: a
//!    floor taken away and put back while they were read shows there).
//! 3. **Sums** on the server: the range's events `$group`ed by counter.
//! 4. **Apply.** Each counter's sum goes through the ledger's fold lane —
//!    the named lane `fold:<events collection>` of the lanes protocol
//!    (see `write::lane`), never pruned — at position `P`: a counter that
//!    has the pass already ignores it, so applying a pass again is a
//!    no-op. A counter the server refuses is held (see `held`), never
//!    stopping the others.
//! 5. **Commit.** One conditioned write (on the intent still being ours)
//!    moves `W` to `W'`, stores the held sums and drops the intent.
//!
//! Writes per pass: the intent, the floor and the commit, plus one update
//! per counter — never one per event, and nothing per recorder. A pass
//! reads what arrived since the last one; an idle pass is one read of the
//! state and one index seek.
//!
//! **Recovery.** A pass left unfinished (a crash, a failure) is resumed by
//! the next pass of the same fold, or taken over by another fold once its
//! deadline plus one attempt has passed; either re-applies it exactly: the
//! same range gives the same sums, at the same position. A resumed pass
//! marks every sum it holds as possibly applied (its earlier owner may have
//! sent it), so none is merged with another (`held`'s rule).
//!
//! **Deletion.** The sweep deletes the events numbered at or below both
//! `W` and the server's clock less `event_retention`: folded, and past the
//! dedupe window, dated by the server's clock. There is no TTL index. The
//! window has a floor, the writers' retry horizon plus one attempt plus a
//! margin ([`retention_floor`]): a resend of an event never finds its key
//! forgotten.
//!
//! **A lost state** (`<events>_fold` dropped) is refused, never folded
//! over: the events collection's floor, or a counter's fold lane position,
//! shows the state existed (`EventFold::check_no_floor`,
//! `EventFold::check_no_counter_folded`).

mod convert;
mod held;
mod pass;
mod query;
mod stand;
mod sweep;

use std::time::{Duration, Instant, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::{DEFAULT_EVENT_RETENTION, floor, fold_lane, index, state};
use crate::document::display_id;
use crate::error::Error;
use crate::store::Store;
use crate::write::counter::{CollectionConfig, Counters, WriterConfig};
use crate::write::lane::LaneName;

/// How many counters a pass applies at once.
const APPLY_CONCURRENCY: usize = 16;

/// How many passes one [`EventFold::fold`] runs after the first, when an
/// unfinished pass or a repair left events out.
const MORE_PASSES: usize = 3;

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
}

impl Default for EventFoldSettings {
    fn default() -> Self {
        Self {
            event_retention: DEFAULT_EVENT_RETENTION,
            retry_horizon: WriterConfig::default().retry_horizon,
            lease: Duration::from_secs(30),
            sweep_every: Duration::from_secs(600),
            apply_batch: 100,
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

/// The events of a ledger not in their counters yet.
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
    /// Recorded events not folded yet (numbered above the watermark).
    pub events: u64,
    /// The oldest of them's age (by its number, the server's clock, against
    /// `now`).
    pub oldest_age: Option<Duration>,
    /// The sums counters refused, with their counters.
    pub held: Vec<HeldSum>,
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

/// What one fold pass did.
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
///     println!("pass {pass}: {events} events into {counters} counters");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventsRun {
    /// The pass applied and committed, if any.
    pub pass: Option<i64>,
    /// The pass was an unfinished one, resumed or taken over.
    pub recovered: bool,
    /// Another fold's pass is in progress and its lease has not run out:
    /// nothing was done.
    pub busy: bool,
    /// Events the pass folded (their sums are in their counters or held).
    pub events_folded: u64,
    /// Counter updates sent.
    pub counters_written: u64,
    /// Events whose amount is not an integer: reported, left out.
    pub malformed_events: u64,
    /// Of the events folded, those a repair pass found in the change
    /// stream: they landed below the watermark while a `collMod` of an
    /// earlier pass, arrived late, held the floor down.
    pub late_events_folded: u64,
    /// The fold state document's size in bytes, as the pass read it.
    pub state_bytes: u64,
    /// Events deleted (folded, older than the dedupe window).
    pub events_deleted: u64,
    /// What is left after the pass.
    pub backlog: Backlog,
}

/// Folds one ledger's events into its counters. One pass at a time per
/// fold (a second waits for the first); keep one per process: it owns its
/// passes by an id minted when it is made, and keeps the events
/// collection's change stream open from one pass to the next (drop it
/// before [`Store::shutdown`], which waits for open cursors).
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
/// // The fold's change stream is a cursor: let go of it first.
/// drop(fold);
/// store.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventFold {
    store: Store,
    events: Collection<Document>,
    events_name: String,
    state: Collection<Document>,
    counters: Counters,
    fold_lane: Result<LaneName, Error>,
    settings: EventFoldSettings,
    owner: ObjectId,
    last_sweep: Mutex<Option<Instant>>,
    /// The events collection's change stream, kept from one raise of the
    /// floor to the next (see `floor::Watch`).
    floor_watch: floor::Watch,
    /// The watermark above which this fold's last look found no event at
    /// all: where to look first next time (only what landed since).
    quiet_above: std::sync::Mutex<Option<i64>>,
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
            state: store.collection(&state::collection_name(&events_name)),
            fold_lane: fold_lane(&events_name),
            events_name,
            counters: Counters::new(store, spec, WriterConfig::default()),
            settings,
            owner: ObjectId::new(),
            last_sweep: Mutex::new(None),
            floor_watch: floor::Watch::default(),
            quiet_above: std::sync::Mutex::new(None),
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

    /// Refuses a ledger whose state document is missing although its
    /// events collection has a floor ([`Error::FoldStateLost`]): only a
    /// fold raises it, after making the state. One `listCollections`, run
    /// before the pass that would make the document.
    pub(super) async fn check_no_floor(&self) -> Result<(), Error> {
        let Some(floor) = floor::read(&self.store, &self.events_name).await? else {
            return Ok(());
        };
        // Another fold made the state and raised the floor since this one
        // read the state: not lost.
        if state::read(&self.store, &self.state).await?.exists {
            return Ok(());
        }
        Err(state::lost(
            &self.state,
            format!(
                "the events collection {} has a floor ({floor}), which only a fold raises",
                self.events_name
            ),
        ))
    }

    /// Refuses to make a ledger's first state document when a counter
    /// holds a fold pass ([`Error::FoldStateLost`]): the state was lost,
    /// and passes numbered from 1 again would be taken for counted by a
    /// counter past them, dropping their sums. Run before the intent that
    /// would make the document: once per ledger (a scan of its counters),
    /// and on every pass with events to fold of a ledger that lost it.
    pub(super) async fn check_no_counter_folded(&self) -> Result<(), Error> {
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
            // Another fold made the state and applied its first pass since
            // this one read the state: not lost (this fold's intent then
            // meets the state it made, and stands back).
            Some(_) if state::read(&self.store, &self.state).await?.exists => Ok(()),
            Some(counter) => {
                let id = counter.get("_id").map_or_else(String::new, display_id);
                let evidence = format!("counter {id} of {} holds a fold pass", spec.name);
                Err(state::lost(&self.state, evidence))
            }
        }
    }

    /// One fold pass (see the module docs) — after resuming an unfinished
    /// one, a fresh one too, so that everything visible when it began is
    /// folded — then the sweep, when it is due. `now` is the server's clock
    /// at the start of the pass. A failed step fails the pass; the next one
    /// resumes it.
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
        let mut last_sweep = self.last_sweep.lock().await;
        let began = Instant::now();
        let clock = move || now + began.elapsed();
        let (mut run, mut again) = self.pass(&clock, stop).await?;
        // After an unfinished pass or a repair, what they left out is
        // folded now too.
        for _ in 0..MORE_PASSES {
            if !again || run.busy {
                break;
            }
            let (next, more) = self.pass(&clock, stop).await?;
            run.pass = next.pass.or(run.pass);
            run.events_folded += next.events_folded;
            run.late_events_folded += next.late_events_folded;
            run.counters_written += next.counters_written;
            run.malformed_events += next.malformed_events;
            run.busy = next.busy;
            again = more;
        }
        if last_sweep.is_none_or(|at| at.elapsed() >= self.settings.sweep_every) && !run.busy {
            let swept = self.sweep(clock()).await?;
            run.events_deleted = swept;
            *last_sweep = Some(Instant::now());
        }
        run.backlog = self.backlog(clock()).await?;
        Ok(run)
    }

    /// What is not in the counters yet at `now` (the server's clock): the
    /// events above their lanes' folded numbers, and the held sums.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::EventFold,
    /// #     clock: tally::Reconciler,
    /// # ) -> Result<(), tally::Error> {
    /// // For a metric or a health check; changes nothing.
    /// let backlog = fold.backlog(clock.server_time().await?).await?;
    /// println!("{} events not in their counters yet", backlog.events + backlog.held_events());
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self, now: SystemTime) -> Result<Backlog, Error> {
        let state = state::read(&self.store, &self.state).await?;
        if state.legacy.is_some() {
            return Err(state::not_converted(&self.state));
        }
        let (events, lowest) = query::above(&self.store, &self.events, state.watermark).await?;
        Ok(Backlog {
            held: state.held.iter().map(held_sum).collect(),
            events,
            oldest_age: lowest.map(|s| {
                now.duration_since(super::time_of(s))
                    .unwrap_or(Duration::ZERO)
            }),
        })
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
