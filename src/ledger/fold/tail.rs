//! The log kept open between passes: a stream of the events collection's
//! inserts from the fold's position, and what it read ahead.
//!
//! A fold reads the log from its position once, and keeps reading where it
//! left off: the inserts after the position are the next pass's, in the
//! order they committed, each once. A pass takes a prefix of what was read
//! and, once it commits, the rest is the next pass's. When the state's
//! position is not where the tail stands (another fold committed a pass, a
//! stream failed), the tail skips to it when it read that far, or opens the
//! stream again from it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use mongodb::bson::Timestamp;

use crate::error::Error;
use crate::ledger::log::{Inserted, Position, Reader, Scope, Step, too_slow};
use crate::store::Store;

/// How long one read of the kept stream waits for inserts at the end of
/// the log: short, so that a pass finds out at once that nothing waits (a
/// listener polls instead, [`POLL`]).
pub(super) const WAIT: Duration = Duration::from_millis(5);

/// How often a listener reads the log while nothing comes.
pub(super) const POLL: Duration = Duration::from_millis(50);

/// The kept stream and the inserts it read after `from`.
#[derive(Debug)]
pub(super) struct Tail {
    reader: Reader,
    /// The position the read-ahead starts after.
    from: Position,
    /// Inserts after `from`, in commit order.
    read: VecDeque<Inserted>,
    /// The stream's position when it last found nothing new, with nothing
    /// read after it (where an idle fold may move its position to).
    quiet_at: Option<Position>,
}

impl Tail {
    /// A tail from `from`: the stream opened there.
    pub(super) async fn open(store: &Store, events: &str, from: &Position) -> Result<Self, Error> {
        let reader = Reader::open(store, events, Some(from), &Scope::All, WAIT).await?;
        Ok(Self::over(reader, from.clone()))
    }

    /// A tail over `reader`, which stands at `from`.
    pub(super) fn over(reader: Reader, from: Position) -> Self {
        Self {
            reader,
            from,
            read: VecDeque::new(),
            quiet_at: None,
        }
    }

    /// Where the read-ahead starts.
    pub(super) fn from(&self) -> &Position {
        &self.from
    }

    /// Makes the tail start at `position` (the state's): skips what it
    /// read up to it when it read that far. `false` when it cannot (the
    /// caller opens a new one).
    pub(super) fn skip_to(&mut self, position: &Position) -> bool {
        if self.from.token == position.token {
            return true;
        }
        let Some(at) = self
            .read
            .iter()
            .position(|inserted| inserted.at.token == position.token)
        else {
            return false;
        };
        self.read.drain(..=at);
        self.from = position.clone();
        true
    }

    /// Listens: reads the log until an insert comes, `cap` wait, or
    /// `deadline` passes, polling every [`POLL`] while nothing comes.
    /// Returns how many inserts wait.
    pub(super) async fn listen(
        &mut self,
        store: &Store,
        cap: usize,
        deadline: Instant,
    ) -> Result<usize, Error> {
        while self.read.len() < cap {
            match self.reader.next(store).await? {
                Step::Inserted(inserted) => {
                    self.quiet_at = None;
                    self.read.push_back(inserted);
                }
                Step::Nothing if !self.read.is_empty() || Instant::now() >= deadline => break,
                Step::Nothing => {
                    self.quiet_at = Some(self.reader.position()?);
                    let pause = POLL.min(deadline.saturating_duration_since(Instant::now()));
                    tokio::time::sleep(pause).await;
                }
            }
        }
        Ok(self.read.len())
    }

    /// Reads every insert that committed before now (the cluster time
    /// `now`), or until `cap` wait. Returns how many wait.
    pub(super) async fn fill_to(
        &mut self,
        store: &Store,
        now: Timestamp,
        cap: usize,
        deadline: Instant,
    ) -> Result<usize, Error> {
        let moment = self.reader.moment(store, now).await?;
        while self.read.len() < cap && !self.reader.reached(&moment)? {
            match self.reader.next(store).await? {
                Step::Inserted(inserted) => {
                    self.quiet_at = None;
                    self.read.push_back(inserted);
                }
                Step::Nothing if Instant::now() >= deadline => return Err(too_slow()),
                Step::Nothing => {}
            }
        }
        if self.read.is_empty() {
            self.quiet_at = Some(self.reader.position()?);
        }
        Ok(self.read.len())
    }

    /// Reads until every insert that committed at or before `time` is in
    /// the read-ahead (or `deadline` passes: an error).
    pub(super) async fn fill_until(
        &mut self,
        store: &Store,
        time: Timestamp,
        deadline: Instant,
    ) -> Result<(), Error> {
        if self.read.back().is_some_and(|last| last.at.time > time) {
            return Ok(());
        }
        let moment = self.reader.moment(store, time).await?;
        while !self.reader.reached(&moment)? {
            match self.reader.next(store).await? {
                Step::Inserted(inserted) => {
                    let past = inserted.at.time > time;
                    self.quiet_at = None;
                    self.read.push_back(inserted);
                    if past {
                        return Ok(());
                    }
                }
                Step::Nothing if Instant::now() >= deadline => return Err(too_slow()),
                Step::Nothing => {}
            }
        }
        Ok(())
    }

    /// The inserts read ahead, oldest first.
    pub(super) fn read(&self) -> &VecDeque<Inserted> {
        &self.read
    }

    /// Where an idle fold may move its position: the stream's position
    /// after a read that found nothing, with nothing read since.
    pub(super) fn quiet_at(&self) -> Option<&Position> {
        self.quiet_at.as_ref().filter(|_| self.read.is_empty())
    }

    /// A pass that folded the first `count` inserts committed: the tail
    /// starts after them (or at `to`, a position past them all).
    pub(super) fn consumed(&mut self, count: usize, to: &Position) {
        self.read.drain(..count.min(self.read.len()));
        self.from = to.clone();
        if self.quiet_at.as_ref() == Some(to) {
            self.quiet_at = None;
        }
    }
}
