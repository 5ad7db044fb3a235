//! Exact reads: a counter plus its events not folded yet and its held
//! sums, consistent at any moment of a fold.
//!
//! The fold's position splits the log: every insert at or before it is in
//! its counter (or in a held sum), every insert after it is not — except
//! those of a pass in progress, which are in a counter once the counter's
//! fold lane entry holds the pass. So an exact read is:
//!
//! - the state (its position, the pass in progress, the held sums), then
//!   the counters, in one causally consistent session at read concern
//!   `majority` (the counters as the passes the state knows left them, or
//!   later);
//! - the counters' inserts after the position — after the pass in
//!   progress's last insert, for a counter that has that pass — read from
//!   the log, filtered by key on the server, up to the read's own start:
//!   the `operationTime` of the counters' read (`log::Reader::read_until`);
//! - every held sum the counter does not have yet.
//!
//! Its value is the counter's events that committed up to that time, each
//! once. It costs the log since the fold's position: the daemon keeps that
//! short. A counter whose fold lane shows a pass the state read before it
//! did not know (a pass began in between) is read again; after
//! [`ROUNDS`] such reads the state and the counters are read once inside a
//! read-only transaction at read concern `snapshot` — one view, which no
//! fold can make fail. A busy fold delays a read, never fails it.
//!
//! While the fold catches up (`fold::catch_up`), the events it has yet to
//! fold are read from the collection itself (by number, then by key: a
//! scan of what is left) and from the log after the catch-up's boundary
//! (`catching_up`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::ClientSession;
use mongodb::bson::{Bson, Document, Timestamp, doc};
use mongodb::options::ReadConcern;

mod catching_up;
mod counter;

use super::log::{Inserted, Logged, Position, Reader, Scope};
use super::state::{FoldState, Keeper, Window};
use super::{Ledger, field, fold_lane};
use crate::bucket::CLOSED_FIELD;
use crate::document::{CanonicalKey, display_id, integer_value, same_key};
use crate::error::{Error, Failure, RetryBudget};
use crate::write::at::{by_any, by_id};

/// How many optimistic reads [`Ledger::value`] tries before it reads the
/// state and the counters from one snapshot.
const ROUNDS: u32 = 3;

/// How long one `getMore` of an exact read's log waits at the end of the
/// log: the read's latency when nothing new comes.
const LOG_WAIT: Duration = Duration::from_millis(1);

/// Which counters an exact read reads: `keys` (distinct), and, for a range
/// read of a bucketed key, the range they are the buckets of.
pub(super) struct Which<'a> {
    pub(super) keys: Vec<Bson>,
    pub(super) span: Option<Span<'a>>,
}

/// A key's buckets that start in `[from, to)`: read by the dotted fields of
/// their `_id` (and of the events' counter).
#[derive(Clone, Copy)]
pub(super) struct Span<'a> {
    pub(super) key: &'a Bson,
    pub(super) from: std::time::SystemTime,
    pub(super) to: std::time::SystemTime,
}

impl Span<'_> {
    /// `{<path>.k: key, <path>.t: {$gte: from, $lt: to}}`.
    fn filter(&self, path: &str) -> Document {
        use crate::write::at::{KEY, START};
        let date = mongodb::bson::DateTime::from_system_time;
        doc! {
            format!("{path}.{KEY}"): self.key.clone(),
            format!("{path}.{START}"): { "$gte": date(self.from), "$lt": date(self.to) },
        }
    }
}

impl Which<'_> {
    /// Whether `counter` is one of them.
    fn holds(&self, counter: &Bson) -> bool {
        match &self.span {
            Some(span) => crate::write::at::split_id(counter).is_some_and(|(key, start)| {
                same_key(key, span.key) && start >= span.from && start < span.to
            }),
            None => self.keys.iter().any(|key| same_key(key, counter)),
        }
    }

    /// The filter of their documents (`path`: `_id`, or an event's `k`).
    fn filter(&self, path: &str) -> Document {
        match &self.span {
            Some(span) => span.filter(path),
            None => match self.keys.as_slice() {
                [key] => by_id(path, key),
                keys => by_any(path, keys),
            },
        }
    }
}

/// A counter read exactly: what its document holds and what its recorded
/// events not folded into it yet add.
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
/// let may = orders.value("2026-05").await?;
/// assert_eq!(may.value, may.folded + may.unfolded);
/// println!("{} ({} events not folded yet)", may.value, may.unfolded_events);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactValue {
    /// The counter's `_id`.
    pub key: Bson,
    /// `folded + unfolded`: every event recorded for the counter, once.
    pub value: i64,
    /// The counter document's value (0 when there is no document).
    pub folded: i64,
    /// The sum of the recorded events not in the counter yet (held sums
    /// included).
    pub unfolded: i64,
    /// How many recorded events are not in the counter yet.
    pub unfolded_events: u64,
    /// A reconcile run closed the counter's bucket: it is final (see
    /// [`Buckets::closes_at`](crate::Buckets::closes_at)). Always `false`
    /// for a collection without buckets.
    pub closed: bool,
}

/// The counter document as far as the ledger cares.
#[derive(Debug, PartialEq)]
struct CounterState {
    value: i64,
    fold_position: Option<i64>,
    closed: bool,
}

/// One consistent reading: the state, the counters (by key) and the time
/// the read reaches in the log.
struct Reading {
    state: FoldState,
    counters: HashMap<CanonicalKey, CounterState>,
    until: Timestamp,
}

impl Ledger {
    /// The counter `key` read exactly: the counter plus its recorded events
    /// not folded into it yet. It answers however busy the fold is (after a
    /// few reads that met a moving fold, it reads once from a snapshot).
    /// In a bucketed collection `key` is a bucket's `_id` `{k, t}`; a
    /// plain key is refused ([`Error::InvalidArgument`]), as no document
    /// holds it.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// let may = orders.value("2026-05").await?;
    /// println!("May: {} ({} events not folded yet)", may.value, may.unfolded_events);
    /// # Ok(()) }
    /// ```
    pub async fn value(&self, key: impl Into<Bson>) -> Result<ExactValue, Error> {
        let key = key.into();
        crate::document::check_key(&key)?;
        crate::write::at::check_read(&self.spec, &key)?;
        let counters = Which {
            keys: vec![key],
            span: None,
        };
        let mut values = self.exact(counters).await?;
        Ok(values.pop().expect("one key read, one value"))
    }

    /// The counters `ids` read exactly, from one consistent reading (closing
    /// a bucket asks whether anything is left to fold into it).
    pub(crate) async fn values_of(&self, ids: Vec<Bson>) -> Result<Vec<ExactValue>, Error> {
        self.exact(Which {
            keys: ids,
            span: None,
        })
        .await
    }

    /// The counters `counters` read exactly, from one consistent reading of
    /// them all, in the order of their keys.
    pub(super) async fn exact(&self, counters: Which<'_>) -> Result<Vec<ExactValue>, Error> {
        let keeper = Keeper::new(&self.store, &self.spec.events_collection_name());
        let lane = fold_lane(&self.spec.events_collection_name())?;
        let mut session = self.store.causal_session(None).await?;
        let mut reading = None;
        for _ in 0..ROUNDS {
            let read = self
                .read_once(&keeper, &mut session, &counters, lane.as_str())
                .await?;
            if read.consistent() {
                reading = Some(read);
                break;
            }
        }
        let reading = match reading {
            Some(reading) => reading,
            None => self.snapshot(&keeper, &counters, lane.as_str()).await?,
        };
        reading.check(&keeper)?;
        let unfolded = self.unfolded(&mut session, &counters, &reading).await?;
        counters
            .keys
            .into_iter()
            .map(|key| self.value_of(key, &reading, &unfolded))
            .collect()
    }

    /// The state, then the counters, in `session`.
    async fn read_once(
        &self,
        keeper: &Keeper,
        session: &mut ClientSession,
        counters: &Which<'_>,
        lane: &str,
    ) -> Result<Reading, Error> {
        let state = keeper.read(session).await?;
        refuse_unreadable(keeper, &state, &self.spec.events_collection_name())?;
        let found = self.find_counters(session, counters).await?;
        let until = session
            .operation_time()
            .ok_or_else(|| no_cluster_time(self))?;
        Ok(Reading {
            state,
            counters: self.counter_states(found, lane)?,
            until,
        })
    }

    /// The state and the counters read inside one read-only transaction at
    /// read concern `snapshot` (retried once on a transient failure).
    async fn snapshot(
        &self,
        keeper: &Keeper,
        counters: &Which<'_>,
        lane: &str,
    ) -> Result<Reading, Error> {
        let mut budget = RetryBudget::read_once("ledger.read_snapshot");
        let filter = counters.filter("_id");
        let read = || async {
            let mut session = self.store.client().start_session().await?;
            session
                .start_transaction()
                .read_concern(ReadConcern::snapshot())
                .await?;
            let state = keeper
                .collection()
                .find_one(super::state::filter())
                .session(&mut session)
                .await?;
            let mut cursor = self
                .counters
                .find(filter.clone())
                .projection(self.counter_projection())
                .session(&mut session)
                .await?;
            let found: Vec<Document> = cursor.stream(&mut session).try_collect().await?;
            session.abort_transaction().await?;
            Ok::<_, mongodb::error::Error>((state, found))
        };
        let (state, found) = self
            .store
            .with_retry(&mut budget, read)
            .await
            .map_err(Error::Server)?;
        let state = keeper.parsed(state)?;
        refuse_unreadable(keeper, &state, &self.spec.events_collection_name())?;
        Ok(Reading {
            state,
            counters: self.counter_states(found, lane)?,
            // A time after the snapshot: the log is read past it.
            until: self.store.cluster_time().await?,
        })
    }

    /// The counter documents of `counters` in `session`, with what an exact
    /// read needs of them (and their `_id`).
    async fn find_counters(
        &self,
        session: &mut ClientSession,
        counters: &Which<'_>,
    ) -> Result<Vec<Document>, Error> {
        const OPERATION: &str = "ledger.read_counter";
        let filter = counters.filter("_id");
        let mut budget = RetryBudget::read_once(OPERATION);
        loop {
            budget.start_attempt();
            let found = self
                .counters
                .find(filter.clone())
                .projection(self.counter_projection())
                .read_concern(ReadConcern::majority())
                .session(&mut *session);
            let mut cursor = match self.store.attempt(async { found.await }).await {
                Ok(cursor) => cursor,
                Err(err) => match self.store.after_failure(&mut budget, err) {
                    crate::error::Next::Retry => continue,
                    crate::error::Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            };
            return cursor
                .stream(&mut *session)
                .try_collect()
                .await
                .map_err(|err| Error::Server(Failure::once(OPERATION, err)));
        }
    }

    fn counter_projection(&self) -> Document {
        doc! { &self.spec.counter_field: 1, &self.spec.lanes_field: 1, CLOSED_FIELD: 1 }
    }

    /// The counters' events not in them yet, by counter: from the log after
    /// the fold's position, or, while the fold catches up, from the
    /// collection and the log after the catch-up's boundary.
    async fn unfolded(
        &self,
        session: &mut ClientSession,
        counters: &Which<'_>,
        reading: &Reading,
    ) -> Result<HashMap<CanonicalKey, Vec<Logged>>, Error> {
        let state = &reading.state;
        let events = match (&state.position, &state.catch_up) {
            (Some(position), None) => {
                let end = reading
                    .state
                    .intent
                    .as_ref()
                    .and_then(|pass| match &pass.window {
                        Window::Log { to: Some(to), .. } => Some(to.key.clone()),
                        _ => None,
                    });
                let read = self
                    .log_after(position, counters, end.into_iter().collect(), reading.until)
                    .await?;
                self.after_pass(read, reading)?
            }
            (_, catch_up) => {
                let boundary = catch_up.as_ref().map(|c| &c.boundary);
                self.catching_up(session, counters, reading, boundary)
                    .await?
            }
        };
        let mut by_counter: HashMap<CanonicalKey, Vec<Logged>> = HashMap::new();
        for event in events {
            by_counter
                .entry(CanonicalKey::of(&event.counter()))
                .or_default()
                .push(event);
        }
        Ok(by_counter)
    }

    /// The counters' inserts after `position`, up to `until` (and the
    /// inserts of the events `also`: where a pass in progress ends).
    ///
    /// The stream is filtered by counter on the server, and asks for the
    /// insert it resumes after too: a server that pushes the filter down
    /// into its oplog scan must still find that insert (MongoDB checks
    /// that a resumed stream shows its token's event). Should a server
    /// refuse the resume all the same (`ChangeStreamHistoryLost` with the
    /// oplog still holding the position), the read takes every insert, as
    /// the fold's own stream does, and keeps its counters' here.
    pub(super) async fn log_after(
        &self,
        position: &Position,
        counters: &Which<'_>,
        mut also: Vec<Bson>,
        until: Timestamp,
    ) -> Result<Vec<Inserted>, Error> {
        let events = self.spec.events_collection_name();
        also.extend(position.event.clone());
        let scope = Scope::Matching {
            counters: counters.filter(field::COUNTER),
            events: also,
        };
        let deadline = Instant::now() + self.store.attempt_timeout();
        let opened = Reader::open(&self.store, &events, Some(position), &scope, LOG_WAIT).await;
        let mut reader = match opened {
            Err(Error::HistoryLost { .. }) => {
                let mut all =
                    Reader::open(&self.store, &events, Some(position), &Scope::All, LOG_WAIT)
                        .await?;
                let mut read = all.read_until(&self.store, until, deadline).await?;
                read.retain(|inserted| counters.holds(&inserted.event.counter()));
                return Ok(read);
            }
            opened => opened?,
        };
        reader.read_until(&self.store, until, deadline).await
    }

    /// `read` without the inserts of the pass in progress for the counters
    /// that have it (their fold lane holds its number).
    fn after_pass(&self, read: Vec<Inserted>, reading: &Reading) -> Result<Vec<Logged>, Error> {
        let Some((number, Window::Log { to: Some(to), .. })) = reading
            .state
            .intent
            .as_ref()
            .map(|pass| (pass.number, &pass.window))
        else {
            return Ok(read.into_iter().map(|i| i.event).collect());
        };
        let has_pass = |counter: &Bson| {
            reading
                .counters
                .get(&CanonicalKey::of(counter))
                .and_then(|c| c.fold_position)
                .is_some_and(|p| p >= number)
        };
        // The pass's last insert committed before its intent, which the
        // state showed before the read's time: it is in the read (its
        // scope asks for it), and everything up to it is the pass's.
        let end = match read
            .iter()
            .position(|i| i.identity() == (to.at.time, &to.key))
        {
            Some(end) => end + 1,
            None if reading
                .counters
                .values()
                .any(|c| c.fold_position.is_some_and(|p| p >= number)) =>
            {
                return Err(Error::FoldStopped {
                    events: self.spec.events_collection_name(),
                    why: format!(
                        "the log read from the fold's position does not show the last event of                          the pass in progress ({}): the read cannot tell which events the pass                          put in their counters",
                        display_id(&to.key)
                    ),
                });
            }
            None => 0,
        };
        Ok(read
            .into_iter()
            .enumerate()
            .filter(|(at, inserted)| !(*at < end && has_pass(&inserted.event.counter())))
            .map(|(_, inserted)| inserted.event)
            .collect())
    }

    /// One key's exact value from a consistent reading.
    fn value_of(
        &self,
        key: Bson,
        reading: &Reading,
        unfolded: &HashMap<CanonicalKey, Vec<Logged>>,
    ) -> Result<ExactValue, Error> {
        let canonical = CanonicalKey::of(&key);
        let counter = reading.counters.get(&canonical);
        let position = counter.and_then(|c| c.fold_position).unwrap_or(i64::MIN);
        let mut sum = 0i128;
        let mut events = 0u64;
        for event in unfolded.get(&canonical).into_iter().flatten() {
            let Some(amount) = event.amount.as_ref().and_then(integer_value) else {
                return Err(Error::Malformed {
                    collection: self.spec.events_collection_name(),
                    id: display_id(&event.key),
                    reason: "its amount n is not an integer".into(),
                });
            };
            sum += i128::from(amount);
            events += 1;
        }
        for held in reading.state.held.iter().filter(|h| same_key(&h.key, &key)) {
            if position < held.pass {
                sum += held.amount;
                events += held.events;
            }
        }
        let folded = counter.map_or(0, |c| c.value);
        let too_big = || Error::ExactValueTooLarge {
            key: display_id(&key),
        };
        Ok(ExactValue {
            value: i64::try_from(i128::from(folded) + sum).map_err(|_| too_big())?,
            folded,
            unfolded: i64::try_from(sum).map_err(|_| too_big())?,
            unfolded_events: events,
            closed: counter.is_some_and(|c| c.closed),
            key,
        })
    }
}

impl Reading {
    /// Whether every counter's fold lane holds only passes the state knows:
    /// else a pass began between the two reads, and the read is done again.
    fn consistent(&self) -> bool {
        let known = self.state.known_pass();
        self.counters
            .values()
            .all(|c| c.fold_position.is_none_or(|p| p <= known))
    }

    /// Refuses a reading whose fold state was lost: a counter holds a fold
    /// pass past any the state knows (from one snapshot, where no pass can
    /// have begun in between).
    fn check(&self, keeper: &Keeper) -> Result<(), Error> {
        let known = self.state.known_pass();
        match self
            .counters
            .values()
            .filter_map(|c| c.fold_position)
            .find(|&p| p > known)
        {
            None => Ok(()),
            Some(position) => Err(keeper.lost(format!(
                "a counter holds fold pass {position}, past the last one recorded ({known})"
            ))),
        }
    }
}

/// Refuses a read of a ledger whose state it cannot read exactly: stopped,
/// or written by an earlier version and not converted yet.
fn refuse_unreadable(keeper: &Keeper, state: &FoldState, events: &str) -> Result<(), Error> {
    if let Some(stopped) = &state.stopped {
        return Err(Error::FoldStopped {
            events: events.to_owned(),
            why: stopped.why.clone(),
        });
    }
    if state.earlier.is_some() {
        return Err(keeper.malformed(
            "it was written by an earlier version of tally and is not converted yet: run \
             `tallyd reconcile` once (it converts it; see the changelog)"
                .into(),
        ));
    }
    Ok(())
}

/// The error of a server that does not say when a read took effect.
fn no_cluster_time(ledger: &Ledger) -> Error {
    Error::ReplicaSetRequired {
        what: format!("an exact read of {}", ledger.spec.name),
    }
}
