//! A catch-up: the events collection itself folded up to a boundary in its
//! log, where the log takes over. Three things need one:
//!
//! - **a ledger's first fold**: events recorded before any fold (all of
//!   them);
//! - **an upgrade** from an earlier version's state: tally 0.2.0's per-lane
//!   map, or the previous version's watermark `W` (the events numbered
//!   above what it folded);
//! - **`tallyd fold-from`**, after the log was lost (the oplog no longer
//!   reached back to the fold's position): the events numbered after a
//!   time the operator chooses ([`EventFold::fold_from`]).
//!
//! The boundary `B` is a position in the log, taken first. What the
//! catch-up folds is exactly the events that committed at or before `B`
//! and are numbered above its start; every insert after `B` is the log's.
//! It goes in **chunks** of at most [`CHUNK`] events by number, each a pass
//! of its own (intent, apply through the fold lane, commit), so that a
//! collection of any size is folded in bounded memory and a chunk resumed
//! after a crash folds the same events again:
//!
//! - the chunk's events are read from the collection at read concern
//!   `majority`, causally after `B`: every event that committed at or
//!   before `B` is there (the sweep never runs during a catch-up);
//! - some that committed after `B` may be there too; the log from `B` up to
//!   a time after that read names every one of them, and they are taken out.
//!
//! So a chunk's events depend on neither when it is read nor how often.
//! The last chunk (`upto` = `i64::MAX`) makes `B` the fold's position.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::ClientSession;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ReadConcern;

use super::pass::backlog;
use super::tail::{self, Tail};
use super::{Backlog, EventFold, PassRun, Running};
use crate::document::{CanonicalKey, integer_value};
use crate::error::{Error, Failure};
use crate::ledger::log::{Logged, Position, Reader, Scope};
use crate::ledger::state::{CatchUp, Earlier, FoldState, Pass, Window};
use crate::ledger::{field, time_of, unix_micros};

/// The most events one chunk of a catch-up folds.
pub(crate) const CHUNK: i64 = 100_000;

/// How long a chunk reads the log after `B` before it gives up.
const LOG_READ_FOR: Duration = Duration::from_secs(600);

/// The most uncertain events [`EventFold::fold_from`] names one by one.
pub(crate) const UNCERTAIN_LISTED: usize = 1_000;

/// What [`EventFold::fold_from`] did: the catch-up it started, and the
/// events whose count it cannot be sure of.
///
/// ```no_run
/// # async fn demo(fold: tally::EventFold, since: std::time::SystemTime) -> Result<(), tally::Error> {
/// let from = fold.fold_from(since).await?;
/// for event in &from.uncertain {
///     let counted = if event.counted { "counted now" } else { "not counted now" };
///     println!("{}: {} on {} ({counted})", event.key, event.amount, event.counter);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldFrom {
    /// The catch-up folds the events numbered after this time.
    pub since: SystemTime,
    /// Where the log takes over again.
    pub boundary: SystemTime,
    /// Where the fold stood when it stopped (`None`: it had not folded
    /// yet).
    pub stopped_at: Option<SystemTime>,
    /// The events recorded near where the fold stopped: each was counted
    /// before the stop, or is counted by this catch-up, or neither — the
    /// log that would tell is gone. At most [`UNCERTAIN_LISTED`].
    pub uncertain: Vec<UncertainEvent>,
    /// How many uncertain events there are in all.
    pub uncertain_total: u64,
    /// The uncertain events are those recorded after this time…
    pub uncertain_after: SystemTime,
    /// … and up to this one.
    pub uncertain_until: SystemTime,
}

/// An event whose count a [`FoldFrom`] cannot be sure of.
///
/// ```no_run
/// # fn demo(event: tally::UncertainEvent) {
/// println!("{} at {:?}: counted by the catch-up: {}", event.key, event.recorded, event.counted);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UncertainEvent {
    /// The event key.
    pub key: Bson,
    /// Its counter.
    pub counter: Bson,
    /// Its amount (`0` when it is not an integer).
    pub amount: i64,
    /// When it was recorded (its number: the server's clock).
    pub recorded: SystemTime,
    /// The catch-up counts it (it is numbered after `since`). If the fold
    /// had counted it before it stopped, it is now counted twice; if not
    /// counted here and not before, it is in no counter.
    pub counted: bool,
}

impl EventFold {
    /// Starts a catch-up: a ledger's first fold, or the conversion of what
    /// an earlier version left. Refuses an earlier version's pass still in
    /// progress (finish it with that version first).
    pub(super) async fn begin_catch_up(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
    ) -> Result<PassRun, Error> {
        let since = match &state.earlier {
            None => {
                self.check_no_counter_folded().await?;
                None
            }
            Some(Earlier::Lanes {
                in_progress: true, ..
            })
            | Some(Earlier::Watermark {
                in_progress: true, ..
            }) => return Err(self.upgrade_blocked("a pass of that version is in progress")),
            Some(Earlier::Watermark { watermark, .. }) => Some(*watermark),
            Some(Earlier::Lanes { lanes, .. }) => Some(self.watermark_of(lanes).await?),
        };
        // The boundary first: from here, every insert is the log's.
        let reader = self.open_here().await?;
        let boundary = reader.position()?;
        let started = if state.exists {
            self.keeper
                .catch_up_from(session, state, &boundary, since, None)
                .await?
        } else {
            self.keeper.start(session, &boundary).await?
        };
        if !started {
            // Another fold started first: the next pass follows it.
            return Ok(PassRun {
                again: true,
                ..PassRun::default()
            });
        }
        if matches!(state.earlier, Some(Earlier::Lanes { .. })) {
            let forgotten = self.keeper.forget_lane_registrations().await?;
            tracing::info!(events = %self.events_name, forgotten, "converted a fold state of tally 0.2.0");
        }
        running.tail = Some(Tail::over(reader, boundary));
        Ok(PassRun {
            again: true,
            ..PassRun::default()
        })
    }

    /// A stream of the log from now: its position is a boundary every later
    /// insert comes after.
    async fn open_here(&self) -> Result<Reader, Error> {
        Reader::open(
            &self.store,
            &self.events_name,
            None,
            &Scope::All,
            tail::WAIT,
        )
        .await
    }

    /// The next chunk of the catch-up of `state`.
    pub(super) async fn catch_up_chunk(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let catch_up = state.catch_up.as_ref().expect("a catch-up");
        let after = catch_up.next_after();
        let (upto, recovered) = match (catch_up.done, catch_up.first_upto) {
            (None, Some(first)) => (first, true),
            _ => (self.chunk_end(after).await?, false),
        };
        let pass = Pass {
            number: state.pass + 1,
            owner: self.owner,
            deadline: clock() + self.settings.lease,
            recovered,
            window: Window::Chunk { after, upto },
        };
        if !self.keeper.begin(session, state, &pass).await? {
            return Ok(PassRun {
                busy: true,
                ..PassRun::default()
            });
        }
        self.resume_chunk(running, session, state, &pass, (after, upto), clock)
            .await
    }

    /// Folds the chunk `(after, upto]` of the catch-up of `state` as `pass`
    /// (new, resumed or taken over: the same events every time).
    pub(super) async fn resume_chunk(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        pass: &Pass,
        (after, upto): (Option<i64>, i64),
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let Some(catch_up) = &state.catch_up else {
            return Err(self
                .keeper
                .malformed("it has a catch-up's chunk in progress but no catch-up".into()));
        };
        let events = self
            .chunk_events(running, session, catch_up, (after, upto))
            .await?;
        let shares = super::sums::shares_of(&events);
        let mut run = self
            .fold_window(session, pass, state, shares, clock)
            .await?;
        if upto == i64::MAX {
            tracing::info!(
                events = %self.events_name,
                boundary = catch_up.boundary.time.time,
                "caught up: the fold follows the log from here"
            );
        }
        run.again = true;
        Ok(run)
    }

    /// Where the next chunk after `after` ends: the number of the
    /// [`CHUNK`]th event above it, or `i64::MAX` when fewer wait.
    async fn chunk_end(&self, after: Option<i64>) -> Result<i64, Error> {
        const OPERATION: &str = "ledger.catch_up.plan";
        let filter = range(after, i64::MAX);
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        let found = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .sort(doc! { field::NUMBER: 1 })
                    .skip(u64::try_from(CHUNK - 1).unwrap_or(0))
                    .limit(1)
                    .projection(doc! { field::NUMBER: 1 })
            })
            .await
            .map_err(Error::Server)?
            .try_collect::<Vec<Document>>()
            .await
            .map_err(|err| Error::Server(Failure::once(OPERATION, err)))?;
        Ok(found
            .first()
            .and_then(|e| e.get(field::NUMBER))
            .and_then(integer_value)
            .filter(|&s| s < i64::MAX)
            .unwrap_or(i64::MAX))
    }

    /// The events of the chunk `(after, upto]` that committed at or before
    /// the boundary of `catch_up` (see the module docs).
    async fn chunk_events(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        catch_up: &CatchUp,
        (after, upto): (Option<i64>, i64),
    ) -> Result<Vec<Logged>, Error> {
        session.advance_operation_time(catch_up.boundary.time);
        let mut read = self.scan(session, range(after, upto)).await?;
        if upto == i64::MAX {
            // Events whose number is not a number sort outside every range:
            // the last chunk folds them (their amounts are judged as any).
            let unnumbered = doc! { field::NUMBER: { "$not": { "$type": "number" } } };
            read.extend(self.scan(session, unnumbered).await?);
        }
        let read_by = self.store.cluster_time().await?;
        let tail = self.tail_at(running, &catch_up.boundary).await?;
        tail.fill_until(&self.store, read_by, Instant::now() + LOG_READ_FOR)
            .await?;
        let later: HashSet<CanonicalKey> = tail
            .read()
            .iter()
            .map(|inserted| CanonicalKey::of(&inserted.event.key))
            .collect();
        read.retain(|event| !later.contains(&CanonicalKey::of(&event.key)));
        Ok(read)
    }

    /// The events matching `filter`, read at read concern `majority` in
    /// `session`.
    async fn scan(
        &self,
        session: &mut ClientSession,
        filter: Document,
    ) -> Result<Vec<Logged>, Error> {
        const OPERATION: &str = "ledger.catch_up.read";
        let projection = doc! { field::COUNTER: 1, field::AMOUNT: 1, field::NUMBER: 1 };
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        loop {
            budget.start_attempt();
            let found = self
                .events
                .find(filter.clone())
                .projection(projection.clone())
                .read_concern(ReadConcern::majority())
                .session(&mut *session);
            let mut cursor = match self.store.attempt(async { found.await }).await {
                Ok(cursor) => cursor,
                Err(err) => match self.store.after_failure(&mut budget, err) {
                    crate::error::Next::Retry => continue,
                    crate::error::Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            };
            let mut read = Vec::new();
            while let Some(document) = cursor
                .next(&mut *session)
                .await
                .transpose()
                .map_err(|err| Error::Server(Failure::once(OPERATION, err)))?
            {
                read.push(logged(document));
            }
            return Ok(read);
        }
    }

    /// The backlog while a catch-up runs (or before the first): the events
    /// numbered above its progress.
    pub(super) async fn catch_up_backlog(
        &self,
        state: &FoldState,
        now: SystemTime,
    ) -> Result<Backlog, Error> {
        let after = state.catch_up.as_ref().and_then(CatchUp::next_after);
        let filter = range(after, i64::MAX);
        let mut budget = crate::error::RetryBudget::read_once("ledger.catch_up.backlog");
        let events = self
            .store
            .with_retry(&mut budget, || self.events.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)?;
        let lowest = self.chunk_lowest(after).await?;
        Ok(backlog(state, events, lowest.map(time_of), now))
    }

    /// The lowest number above `after`, if any.
    async fn chunk_lowest(&self, after: Option<i64>) -> Result<Option<i64>, Error> {
        let found = self
            .store
            .find_one(
                &self.events,
                range(after, i64::MAX),
                doc! { field::NUMBER: 1 },
                "ledger.catch_up.lowest",
            )
            .await?;
        Ok(found
            .and_then(|e| e.get(field::NUMBER).cloned())
            .and_then(|s| integer_value(&s)))
    }

    /// The watermark a tally 0.2.0 state `lanes` stands for: the highest
    /// number it folded, when every event it did not fold is numbered
    /// above it (the usual case: those are the newest). Otherwise refused,
    /// naming what to run.
    async fn watermark_of(&self, lanes: &[(ObjectId, i64)]) -> Result<i64, Error> {
        let folded: std::collections::HashMap<ObjectId, i64> = lanes.iter().copied().collect();
        let pipeline = vec![doc! { "$group": {
            "_id": format!("${}", field::LANE),
            "lo": { "$min": format!("${}", field::NUMBER) },
            "hi": { "$max": format!("${}", field::NUMBER) },
        } }];
        let spans = self.aggregate(pipeline).await?;
        let (mut highest_folded, mut lowest_unfolded) = (0i64, i64::MAX);
        for span in spans {
            let number = |name| span.get(name).and_then(integer_value);
            let (Some(lo), Some(hi)) = (number("lo"), number("hi")) else {
                continue;
            };
            match span.get_object_id("_id").ok().and_then(|l| folded.get(&l)) {
                None => lowest_unfolded = lowest_unfolded.min(lo),
                Some(&m) if hi <= m => highest_folded = highest_folded.max(hi),
                Some(&m) if lo > m => lowest_unfolded = lowest_unfolded.min(lo),
                Some(&m) => {
                    // Folded and unfolded events on one lane.
                    highest_folded = highest_folded.max(m);
                    let lane = span.get_object_id("_id").ok();
                    if let Some(above) = self.first_above(lane, m).await? {
                        lowest_unfolded = lowest_unfolded.min(above);
                    }
                }
            }
        }
        if highest_folded >= lowest_unfolded {
            return Err(self.upgrade_blocked(&format!(
                "an event it did not fold is numbered {lowest_unfolded}, at or below one it \
                 folded ({highest_folded}): fold them with tally 0.2.0's `tallyd reconcile` \
                 (with every recorder stopped) until `tallyd status` shows no backlog"
            )));
        }
        Ok(highest_folded)
    }

    /// The lowest number above `above` on `lane`, if any.
    async fn first_above(&self, lane: Option<ObjectId>, above: i64) -> Result<Option<i64>, Error> {
        let pipeline = vec![
            doc! { "$match": { field::LANE: lane, field::NUMBER: { "$gt": above } } },
            doc! { "$group": { "_id": Bson::Null, "lo": { "$min": format!("${}", field::NUMBER) } } },
        ];
        let rows = self.aggregate(pipeline).await?;
        Ok(rows
            .first()
            .and_then(|row| row.get("lo"))
            .and_then(integer_value))
    }

    /// Runs `pipeline` on the events collection at read concern `majority`.
    async fn aggregate(&self, pipeline: Vec<Document>) -> Result<Vec<Document>, Error> {
        const OPERATION: &str = "ledger.catch_up.convert";
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .aggregate(pipeline.clone())
                    .read_concern(ReadConcern::majority())
            })
            .await
            .map_err(Error::Server)?;
        cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once(OPERATION, err)))
    }

    fn upgrade_blocked(&self, why: &str) -> Error {
        Error::UpgradeBlocked {
            collection: self.keeper.name().to_owned(),
            why: why.to_owned(),
        }
    }

    /// Folds again from `since` after the fold stopped (its position no
    /// longer in the oplog, the events collection dropped): a catch-up of
    /// every event numbered after `since` that committed up to now, then
    /// the log from here. The events recorded near where the fold stopped
    /// are named ([`FoldFrom::uncertain`]). Refused while the fold is not
    /// stopped. Run [`EventFold::fold`] after it to fold the catch-up.
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold, clock: tally::Reconciler, since: std::time::SystemTime) -> Result<(), tally::Error> {
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let from = fold.fold_from(since).await?;
    /// println!("{} events near the stop are uncertain", from.uncertain_total);
    /// fold.fold(clock.server_time().await?, &CancellationToken::new()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn fold_from(&self, since: SystemTime) -> Result<FoldFrom, Error> {
        let mut running = self.running.lock().await;
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if state.stopped.is_none() {
            return Err(Error::FoldNotStopped {
                events: self.events_name.clone(),
            });
        }
        // A pass left unfinished when the fold stopped: its first chunk
        // folds up to where that pass ended, at the pass's own number, so
        // a counter that has the pass already ignores it.
        let (stopped_at, first_upto) = match &state.intent {
            Some(Pass {
                window: Window::Log { from, to },
                ..
            }) => (
                Some(from.wall_time()),
                to.as_ref().map(|to| unix_micros(to.at.wall_time())),
            ),
            Some(Pass {
                window: Window::Chunk { upto, .. },
                ..
            }) => (
                state.position.as_ref().map(Position::wall_time),
                Some(*upto),
            ),
            None => (state.position.as_ref().map(Position::wall_time), None),
        };
        let since_number = unix_micros(since);
        let first_upto = first_upto.filter(|&upto| upto > since_number);
        let uncertain = self
            .uncertain(stopped_at, first_upto.map(time_of), since)
            .await?;
        let reader = self.open_here().await?;
        let boundary = reader.position()?;
        if !self
            .keeper
            .catch_up_from(
                &mut session,
                &state,
                &boundary,
                Some(since_number),
                first_upto,
            )
            .await?
        {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: state.pass + 1,
                why: "the fold state changed while the catch-up was being set up; run the \
                      command again"
                    .into(),
            });
        }
        self.saw(&session);
        running.tail = Some(Tail::over(reader, boundary.clone()));
        tracing::warn!(
            events = %self.events_name,
            since = %humantime::format_rfc3339_seconds(since),
            uncertain = uncertain.1,
            "folding again from a chosen time after the fold stopped"
        );
        Ok(FoldFrom {
            since,
            boundary: boundary.wall_time(),
            stopped_at,
            uncertain: uncertain.0,
            uncertain_total: uncertain.1,
            uncertain_after: uncertain.2.0,
            uncertain_until: uncertain.2.1,
        })
    }

    /// Where a stopped fold stood when it stopped (the start of the pass it
    /// left unfinished, if any): what `tallyd fold-from` folds from by
    /// default. `None` when it never folded; refused when it is not stopped.
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold) -> Result<(), tally::Error> {
    /// if let Some(at) = fold.stopped_at().await? {
    ///     println!("stopped at {}", humantime::format_rfc3339_seconds(at));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn stopped_at(&self) -> Result<Option<SystemTime>, Error> {
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if state.stopped.is_none() {
            return Err(Error::FoldNotStopped {
                events: self.events_name.clone(),
            });
        }
        Ok(stopped_where(&state).0)
    }

    /// The events whose count a fold from `since` cannot be sure of, when
    /// the fold stopped at `stopped_at` (a pass reaching `pass_end` in
    /// progress): those numbered from one uncertainty before the stop up to
    /// the later of the stop and `since`.
    async fn uncertain(
        &self,
        stopped_at: Option<SystemTime>,
        pass_end: Option<SystemTime>,
        since: SystemTime,
    ) -> Result<(Vec<UncertainEvent>, u64, (SystemTime, SystemTime)), Error> {
        let Some(stopped_at) = stopped_at else {
            return Ok((Vec::new(), 0, (since, since)));
        };
        let reach = self.uncertainty();
        let low = (stopped_at
            .checked_sub(reach)
            .unwrap_or(SystemTime::UNIX_EPOCH))
        .min(since);
        let high = stopped_at.max(since).max(pass_end.unwrap_or(since));
        let filter = range(Some(unix_micros(low)), unix_micros(high));
        let mut budget = crate::error::RetryBudget::read_once("ledger.fold_from.uncertain");
        let total = self
            .store
            .with_retry(&mut budget, || self.events.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)?;
        let mut budget = crate::error::RetryBudget::read_once("ledger.fold_from.uncertain");
        let listed: Vec<Document> = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .sort(doc! { field::NUMBER: 1 })
                    .limit(UNCERTAIN_LISTED as i64)
            })
            .await
            .map_err(Error::Server)?
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("ledger.fold_from.uncertain", err)))?;
        let since = unix_micros(since);
        let uncertain = listed
            .into_iter()
            .map(logged)
            .map(|event| {
                let number = event.number.as_ref().and_then(integer_value).unwrap_or(0);
                UncertainEvent {
                    counter: event.counter(),
                    amount: event.amount.as_ref().and_then(integer_value).unwrap_or(0),
                    recorded: time_of(number),
                    counted: number > since,
                    key: event.key,
                }
            })
            .collect();
        Ok((uncertain, total, (low, high)))
    }

    /// How long after its number an event's insert may still commit: two
    /// attempts (the first and its one retry, each bounded), and a minute
    /// for the recorder's reckoning of the server's clock.
    pub(super) fn uncertainty(&self) -> Duration {
        2 * self.store.attempt_timeout() + Duration::from_secs(60)
    }
}

/// Where the fold of `state` stood when it stopped, and where the pass it
/// left unfinished ended (its first chunk's end when it folds again).
fn stopped_where(state: &FoldState) -> (Option<SystemTime>, Option<i64>) {
    match &state.intent {
        Some(Pass {
            window: Window::Log { from, to },
            ..
        }) => (
            Some(from.wall_time()),
            to.as_ref().map(|to| unix_micros(to.at.wall_time())),
        ),
        Some(Pass {
            window: Window::Chunk { upto, .. },
            ..
        }) => (
            state.position.as_ref().map(Position::wall_time),
            Some(*upto),
        ),
        None => (state.position.as_ref().map(Position::wall_time), None),
    }
}

/// The filter of the events numbered in `(after, upto]` (`after` `None`:
/// from the lowest; `upto` `i64::MAX`: no end).
fn range(after: Option<i64>, upto: i64) -> Document {
    let mut numbers = Document::new();
    if let Some(after) = after {
        numbers.insert("$gt", after);
    }
    if upto < i64::MAX {
        numbers.insert("$lte", upto);
    }
    if numbers.is_empty() {
        return doc! { field::NUMBER: { "$type": "number" } };
    }
    doc! { field::NUMBER: numbers }
}

/// An event document as the fold reads it.
fn logged(document: Document) -> Logged {
    Logged {
        key: document.get("_id").cloned().unwrap_or(Bson::Null),
        counter: document.get(field::COUNTER).cloned(),
        amount: document.get(field::AMOUNT).cloned(),
        number: document.get(field::NUMBER).cloned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_is_a_range_of_numbers_and_the_first_and_last_are_open() {
        assert_eq!(
            range(Some(5), 9),
            doc! { "s": { "$gt": 5i64, "$lte": 9i64 } }
        );
        assert_eq!(range(None, 9), doc! { "s": { "$lte": 9i64 } });
        assert_eq!(range(Some(5), i64::MAX), doc! { "s": { "$gt": 5i64 } });
        assert_eq!(range(None, i64::MAX), doc! { "s": { "$type": "number" } });
    }
}
