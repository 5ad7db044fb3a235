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
//!
//! `upgrade`: what an earlier version's state stands for; `fold_from`:
//! folding again from a chosen time after the fold stopped.

mod fold_from;
mod upgrade;

pub use fold_from::{FoldFrom, UncertainEvent};

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::ClientSession;
use mongodb::bson::{Document, doc};

use super::pass::backlog;
use super::tail::{self, Tail};
use super::{Backlog, EventFold, PassRun, Running};
use crate::document::{CanonicalKey, integer_value};
use crate::error::{Error, Failure};
use crate::ledger::log::{Logged, Position, Reader, Scope, check_history_kept};
use crate::ledger::state::{CatchUp, Earlier, FoldState, Pass, Window};
use crate::ledger::{field, time_of};

/// The most events one chunk of a catch-up folds.
pub(crate) const CHUNK: i64 = 100_000;

/// How long a chunk reads the log after `B` before it gives up.
const LOG_READ_FOR: Duration = Duration::from_secs(600);

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
            }) => {
                return Err(self.upgrade_blocked(
                    "a pass of that version is in progress: finish it with that version's \
                     `tallyd reconcile` (until `tallyd status` shows nothing in progress), then \
                     run this version",
                ));
            }
            Some(Earlier::Watermark { watermark, .. }) => Some(*watermark),
            Some(Earlier::Lanes { lanes, .. }) => Some(self.watermark_of(lanes).await?),
        };
        // The boundary first: from here, every insert is the log's.
        let reader = self.open_here().await?;
        let boundary = reader.position()?;
        let started = if state.exists {
            self.keeper
                .catch_up_from(session, state, &boundary, since, true)
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
    pub(super) async fn open_here(&self) -> Result<Reader, Error> {
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
        let upto = self.chunk_end(after).await?;
        let pass = Pass {
            number: state.pass + 1,
            owner: self.owner,
            deadline: clock() + self.settings.lease,
            recovered: false,
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
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        // A collection of at most a chunk is one chunk: no walk of its index.
        // (The estimate only sizes chunks; which events a chunk folds never
        // depends on it.)
        let estimate = self
            .store
            .with_retry(&mut budget, || self.events.estimated_document_count())
            .await
            .map_err(Error::Server)?;
        if estimate <= u64::try_from(CHUNK).unwrap_or(u64::MAX) {
            return Ok(i64::MAX);
        }
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
        let read = match (after, upto) {
            // One chunk for the whole collection: every event, numbered or
            // not, in one read of it.
            (None, i64::MAX) if catch_up.unnumbered => self.scan(session, Document::new()).await?,
            (_, i64::MAX) if catch_up.unnumbered => {
                let mut read = self.scan(session, range(after, upto)).await?;
                // Events whose number is not a number sort outside every
                // range: the last chunk folds them (their amounts are
                // judged as any).
                let unnumbered = doc! { field::NUMBER: { "$not": { "$type": "number" } } };
                read.extend(self.scan(session, unnumbered).await?);
                read
            }
            _ => self.scan(session, range(after, upto)).await?,
        };
        let mut read = read;
        let tail = self.tail_at(running, &catch_up.boundary).await?;
        let later = self.inserted_since_read(tail, &catch_up.boundary).await?;
        read.retain(|event| !later.contains(&CanonicalKey::of(&event.key)));
        Ok(read)
    }

    /// The inserts after `boundary` up to now, by `tail` (standing at
    /// `boundary`): every event a read of the collection just made saw
    /// that committed after the boundary — the log's, whatever its number
    /// (guarantee 5).
    pub(super) async fn inserted_since_read(
        &self,
        tail: &mut Tail,
        boundary: &Position,
    ) -> Result<HashSet<CanonicalKey>, Error> {
        let read_by = self.store.cluster_time().await?;
        tail.fill_until(&self.store, read_by, Instant::now() + LOG_READ_FOR)
            .await?;
        check_history_kept(&self.store, &self.events_name, boundary).await?;
        Ok(tail
            .read()
            .iter()
            .map(|inserted| CanonicalKey::of(&inserted.event.key))
            .collect())
    }

    /// The events matching `filter`, read at read concern `majority` in
    /// `session`.
    async fn scan(
        &self,
        session: &mut ClientSession,
        filter: Document,
    ) -> Result<Vec<Logged>, Error> {
        crate::ledger::scan::events_matching(
            &self.store,
            &self.events,
            session,
            filter,
            "ledger.catch_up.read",
        )
        .await
    }

    /// The backlog while a catch-up runs (or before the first): the events
    /// numbered above its progress.
    pub(super) async fn catch_up_backlog(
        &self,
        state: &FoldState,
        now: SystemTime,
    ) -> Result<Backlog, Error> {
        let after = state.catch_up.as_ref().and_then(CatchUp::next_after);
        // Before the first chunk every event waits, numbered or not.
        let filter = match after {
            None => Document::new(),
            Some(_) => range(after, i64::MAX),
        };
        let mut budget = crate::error::RetryBudget::read_once("ledger.catch_up.backlog");
        let events = self
            .store
            .with_retry(&mut budget, || self.events.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)?;
        let lowest = self.chunk_lowest(after).await?;
        Ok(backlog(state, events, lowest.map(time_of), now))
    }

    /// The lowest number above `after`, if any (from the number index).
    async fn chunk_lowest(&self, after: Option<i64>) -> Result<Option<i64>, Error> {
        const OPERATION: &str = "ledger.catch_up.lowest";
        let filter = doc! { field::NUMBER: { "$gt": after.unwrap_or(i64::MIN) } };
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        let found: Vec<Document> = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .sort(doc! { field::NUMBER: 1 })
                    .limit(1)
                    .projection(doc! { field::NUMBER: 1 })
            })
            .await
            .map_err(Error::Server)?
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once(OPERATION, err)))?;
        Ok(found
            .first()
            .and_then(|e| e.get(field::NUMBER))
            .and_then(integer_value))
    }

    /// How long after its number an event's insert may still commit: two
    /// attempts (the first and its one retry, each bounded), and a minute
    /// for the recorder's reckoning of the server's clock.
    pub(super) fn uncertainty(&self) -> Duration {
        2 * self.store.attempt_timeout() + Duration::from_secs(60)
    }
}

/// The filter of the events numbered in `(after, upto]` (`after` `None`:
/// from the lowest; `upto` `i64::MAX`: no end).
pub(super) fn range(after: Option<i64>, upto: i64) -> Document {
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
