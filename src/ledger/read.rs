//! Exact reads: a counter plus its events not folded yet and its held
//! sums, consistent at any moment of a fold.
//!
//! The fold keeps a watermark `W`: every event numbered at or below it is
//! in its counter (or in a held sum), every event above it is not — except
//! those of a pass in progress (its intent, `(W, W']`), which are in a
//! counter once the counter's fold lane entry holds the pass. A held sum of
//! pass `p` is in it once the entry holds `p` or more.
//!
//! So the exact value is the counter, plus the counter's events above `W`
//! (one index range on `{k: 1, s: 1}`: what happened since the last pass,
//! never the counter's history, whatever the number of recorders), less
//! those of the intent when the counter has its pass, plus every held sum
//! the counter does not have.
//!
//! The state, the counter and the events are not read atomically, so the
//! state is read before and after (an optimistic double read): when both
//! show the same pass, no pass committed in between — the only write that
//! moves `W` or the held sums — and every event and held sum read is
//! judged against the one counter read, with the intent read last (while
//! the pass stays the same, at most one intent can have been applied: that
//! one). After [`OPTIMISTIC_ROUNDS`] double reads that met a moving fold,
//! the three are read once inside a read-only transaction at read concern
//! `snapshot`: one consistent view, which no fold can make fail. A busy
//! fold delays a read, never fails it.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReadConcern;

use super::state::{self, FoldState};
use super::{Ledger, field, floor, fold_lane};
use std::collections::HashMap;

use crate::bucket::CLOSED_FIELD;
use crate::document::{CanonicalKey, bson_type_name, display_id, integer_value, same_key};
use crate::error::{Error, Failure, RetryBudget};
use crate::write::at::{by_any, by_id};

/// How many optimistic double reads [`Ledger::value`] tries before it
/// reads from one snapshot.
const OPTIMISTIC_ROUNDS: u32 = 3;

/// Unfolded events per batch of an exact read: the first reply carries
/// them all, unless the backlog is long.
const UNFOLDED_BATCH: u32 = 10_000;

/// The fields of an event an exact read needs.
fn event_projection() -> Document {
    doc! { field::COUNTER: 1, field::AMOUNT: 1, field::NUMBER: 1 }
}

/// Which counters an exact read reads: `keys` (distinct), and, for a range
/// read of a bucketed key, the range they are the buckets of.
pub(super) struct Which<'a> {
    pub(super) keys: Vec<Bson>,
    pub(super) span: Option<Span<'a>>,
}

/// A key's buckets that start in `[from, to)`: read by the dotted fields of
/// their `_id` (and of the events' counter), which the range indexes serve
/// on every server (the test server scans for a document `_id`).
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
    /// The filter of their documents.
    fn documents(&self) -> Document {
        match &self.span {
            Some(span) => span.filter("_id"),
            None => one_or_any("_id", &self.keys),
        }
    }

    /// The filter of their events above `watermark`.
    fn unfolded(&self, watermark: i64) -> Document {
        let mut filter = match &self.span {
            Some(span) => span.filter(field::COUNTER),
            None => one_or_any(field::COUNTER, &self.keys),
        };
        filter.insert(field::NUMBER, doc! { "$gt": watermark });
        filter
    }
}

/// The filter of the documents whose `path` is one of `keys`: the key
/// itself for one (an equality, as every read of one counter is), `$in`
/// for more; a bucketed `_id` by its dotted fields too ([`by_id`]).
fn one_or_any(path: &str, keys: &[Bson]) -> Document {
    match keys {
        [key] => by_id(path, key),
        _ => by_any(path, keys),
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

/// The counter document as far as the ledger cares: its value and its
/// fold lane's position.
#[derive(Debug, PartialEq)]
struct CounterState {
    value: i64,
    fold_position: Option<i64>,
    closed: bool,
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
        let lane = fold_lane(&self.spec.events_collection_name())?;
        for _ in 0..OPTIMISTIC_ROUNDS {
            let before = state::read(&self.store, &self.state).await?;
            if before.legacy.is_some() {
                return Err(state::not_converted(&self.state));
            }
            let found = self.find_counters(&counters).await?;
            let events = self.unfolded_events(&counters, before.watermark).await?;
            let after = state::read(&self.store, &self.state).await?;
            if before.seen() == after.seen() {
                return self
                    .judge_all(counters.keys, lane.as_str(), found, events, &after)
                    .await;
            }
        }
        let (state, found, events) = self.snapshot(&counters).await?;
        if state.legacy.is_some() {
            return Err(state::not_converted(&self.state));
        }
        self.judge_all(counters.keys, lane.as_str(), found, events, &state)
            .await
    }

    /// Each key's exact value from one consistent reading of the counters
    /// `found`, their events above the watermark and the state.
    async fn judge_all(
        &self,
        keys: Vec<Bson>,
        lane: &str,
        found: Vec<Document>,
        events: Vec<Document>,
        state: &FoldState,
    ) -> Result<Vec<ExactValue>, Error> {
        let mut counters: HashMap<CanonicalKey, Document> = found
            .into_iter()
            .map(|counter| {
                let id = counter.get("_id").cloned().unwrap_or(Bson::Null);
                (CanonicalKey::of(&id), counter)
            })
            .collect();
        let mut by_counter: HashMap<CanonicalKey, Vec<Document>> = HashMap::new();
        for event in events {
            let counter = event.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
            by_counter
                .entry(CanonicalKey::of(&counter))
                .or_default()
                .push(event);
        }
        self.check_floor_kept(state).await?;
        let mut values = Vec::with_capacity(keys.len());
        for key in keys {
            let canonical = CanonicalKey::of(&key);
            let counter = self.counter_state(&key, lane, counters.remove(&canonical))?;
            let events = by_counter.remove(&canonical).unwrap_or_default();
            values.push(self.judge(key, &counter, &events, state).await?);
        }
        Ok(values)
    }

    /// The exact value from one consistent reading of the counter, its
    /// events above the watermark, and the state.
    async fn judge(
        &self,
        key: Bson,
        counter: &CounterState,
        events: &[Document],
        state: &FoldState,
    ) -> Result<ExactValue, Error> {
        self.check_counter_kept(&key, counter, state)?;
        let position = counter.fold_position.unwrap_or(i64::MIN);
        let in_counter = |s: i64| {
            state
                .intent
                .as_ref()
                .is_some_and(|intent| position >= intent.pass && intent.folds(s))
        };
        let mut unfolded = 0i128;
        let mut unfolded_events = 0u64;
        for event in events {
            let Some(number) = event.get(field::NUMBER).and_then(integer_value) else {
                return Err(self.malformed_event(event, "its number s is not an integer"));
            };
            if number <= state.watermark || in_counter(number) {
                continue;
            }
            let Some(amount) = event.get(field::AMOUNT).and_then(integer_value) else {
                return Err(self.malformed_event(event, "its amount n is not an integer"));
            };
            unfolded += i128::from(amount);
            unfolded_events += 1;
        }
        for sum in state.held.iter().filter(|h| same_key(&h.key, &key)) {
            if position < sum.pass {
                unfolded += sum.amount;
                unfolded_events += sum.events;
            }
        }
        let too_big = || Error::ExactValueTooLarge {
            key: display_id(&key),
        };
        let value = i64::try_from(i128::from(counter.value) + unfolded).map_err(|_| too_big())?;
        Ok(ExactValue {
            value,
            folded: counter.value,
            unfolded: i64::try_from(unfolded).map_err(|_| too_big())?,
            unfolded_events,
            closed: counter.closed,
            key,
        })
    }

    /// The state, the counter documents and their events above the
    /// watermark, read inside one read-only transaction at read concern
    /// `snapshot` (retried once on a transient failure).
    async fn snapshot(
        &self,
        counters: &Which<'_>,
    ) -> Result<(FoldState, Vec<Document>, Vec<Document>), Error> {
        let mut budget = RetryBudget::read_once("ledger.read_snapshot");
        let read = || async {
            let mut session = self.store.client().start_session().await?;
            session
                .start_transaction()
                .read_concern(ReadConcern::snapshot())
                .await?;
            let state = self
                .state
                .find_one(state::filter())
                .session(&mut session)
                .await?;
            let mut cursor = self
                .counters
                .find(counters.documents())
                .projection(self.counter_projection())
                .session(&mut session)
                .await?;
            let found: Vec<Document> = cursor.stream(&mut session).try_collect().await?;
            let events = match state::from_document(&self.state, state.clone()) {
                Ok(parsed) => {
                    let mut cursor = self
                        .events
                        .find(counters.unfolded(parsed.watermark))
                        .projection(event_projection())
                        .batch_size(UNFOLDED_BATCH)
                        .session(&mut session)
                        .await?;
                    cursor.stream(&mut session).try_collect().await?
                }
                Err(_) => Vec::new(),
            };
            session.abort_transaction().await?;
            Ok::<_, mongodb::error::Error>((state, found, events))
        };
        let (state, counters, events) = self
            .store
            .with_retry(&mut budget, read)
            .await
            .map_err(Error::Server)?;
        Ok((state::from_document(&self.state, state)?, counters, events))
    }

    /// The counter documents of `keys`, with what an exact read needs of
    /// them (and their `_id`).
    async fn find_counters(&self, counters: &Which<'_>) -> Result<Vec<Document>, Error> {
        const OPERATION: &str = "ledger.read_counter";
        let filter = counters.documents();
        let mut budget = RetryBudget::read_once(OPERATION);
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.counters
                    .find(filter.clone())
                    .projection(self.counter_projection())
            })
            .await
            .map_err(Error::Server)?;
        cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once(OPERATION, err)))
    }

    fn counter_projection(&self) -> Document {
        doc! { &self.spec.counter_field: 1, &self.spec.lanes_field: 1, CLOSED_FIELD: 1 }
    }

    /// The counter's value and its fold lane's position (zero and none
    /// without a document).
    fn counter_state(
        &self,
        key: &Bson,
        lane: &str,
        found: Option<Document>,
    ) -> Result<CounterState, Error> {
        let spec = &self.spec;
        let entry = format!("{}.{lane}", spec.lanes_field);
        let Some(found) = found else {
            return Ok(CounterState {
                value: 0,
                fold_position: None,
                closed: false,
            });
        };
        let malformed = |reason: String| Error::Malformed {
            collection: spec.name.clone(),
            id: display_id(key),
            reason,
        };
        let value = match found.get(&spec.counter_field) {
            None => 0,
            Some(value) => integer_value(value).ok_or_else(|| {
                malformed(format!(
                    "the counter field {} is a {}, not an exact integer",
                    spec.counter_field,
                    bson_type_name(value)
                ))
            })?,
        };
        let fold_position = match found.get(&spec.lanes_field) {
            None => None,
            Some(Bson::Document(map)) => match map.get(lane) {
                None => None,
                Some(position) => Some(
                    integer_value(position)
                        .ok_or_else(|| malformed(format!("its entry {entry} is not an integer")))?,
                ),
            },
            Some(other) => {
                return Err(malformed(format!(
                    "the lanes field {} is a {}, not a document",
                    spec.lanes_field,
                    bson_type_name(other)
                )));
            }
        };
        Ok(CounterState {
            value,
            fold_position,
            closed: spec.buckets.is_some()
                && matches!(found.get(CLOSED_FIELD), Some(Bson::DateTime(_))),
        })
    }

    /// Refuses a read whose fold state was lost ([`Error::FoldStateLost`]),
    /// as the counter `key` shows it: it holds a fold pass past any the
    /// state knows (passes were numbered again, or the document is gone).
    fn check_counter_kept(
        &self,
        key: &Bson,
        counter: &CounterState,
        state: &FoldState,
    ) -> Result<(), Error> {
        let known = state.known_pass();
        if let Some(position) = counter.fold_position.filter(|&p| p > known) {
            let evidence = format!(
                "counter {} holds fold pass {position}, past the last one recorded ({known})",
                display_id(key)
            );
            return Err(state::lost(&self.state, evidence));
        }
        Ok(())
    }

    /// Refuses a read whose fold state was lost, as the events collection
    /// shows it: with no state document, it has a floor (only a fold raises
    /// it, after making the document). Once per read, whatever the number
    /// of counters it reads.
    async fn check_floor_kept(&self, state: &FoldState) -> Result<(), Error> {
        // A floor with no state document: lost — unless a ledger's first
        // pass made the document since this read (then nothing was applied
        // before the read, and the value it found stands).
        if !state.exists
            && let Some(floor) =
                floor::read(&self.store, &self.spec.events_collection_name()).await?
            && !state::read(&self.store, &self.state).await?.exists
        {
            let evidence = format!(
                "the events collection {} has a floor ({floor}), which only a fold raises",
                self.spec.events_collection_name()
            );
            return Err(state::lost(&self.state, evidence));
        }
        Ok(())
    }

    /// The counters' events above the watermark: one index range each.
    async fn unfolded_events(
        &self,
        counters: &Which<'_>,
        watermark: i64,
    ) -> Result<Vec<Document>, Error> {
        let filter = counters.unfolded(watermark);
        let mut budget = RetryBudget::read_once("ledger.read_unfolded");
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .projection(event_projection())
                    .batch_size(UNFOLDED_BATCH)
            })
            .await
            .map_err(Error::Server)?;
        cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("ledger.read_unfolded", err)))
    }

    fn malformed_event(&self, event: &Document, reason: &str) -> Error {
        Error::Malformed {
            collection: self.spec.events_collection_name(),
            id: event.get("_id").map_or_else(String::new, display_id),
            reason: reason.into(),
        }
    }
}
