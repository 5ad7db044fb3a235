//! Exact reads: a counter plus its events not folded yet and its held
//! sums, consistent at any moment of a fold.
//!
//! The fold keeps, per recorder lane, the highest number folded (`M_L`):
//! every event at or below it is in its counter or in a held sum. A pass in
//! progress (its intent) applies the events of the ranges `(M_L, M'_L]`
//! through the fold lane at position `P`, one counter at a time; on a
//! counter, they are in it once its fold lane entry holds `P` or more. A
//! held sum of pass `p` is in it once the entry holds `p` or more (a
//! counter's held sums go through the lane in order).
//!
//! So the exact value is the counter, plus every event of the counter above
//! its lane's `M_L` — except those of the intent's ranges when the counter
//! has the intent's pass — plus every held sum the counter does not have.
//! Only lanes that may hold such events are read (the registered lanes and
//! the intent's), all in one command ([`unfolded_stages`]): one index range
//! on `{k, L, s}` per lane on the server, never the counter's history, and
//! never a round trip per lane — a deployment of many short-lived recorder
//! processes (one lane each) reads as fast as one of a few.
//!
//! The state, the counter and the events are not read atomically, so the
//! state is read before and after (an optimistic double read): when both
//! show the same pass, no pass committed in between — the only write that
//! moves `M_L` or the held sums — and every event and held sum read is
//! judged against the one counter read, with the intent read last (while
//! the pass stays the same, at most one intent can have been applied: that
//! one). When a pass committed meanwhile, the whole read is done again.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::AggregateOptions;

use super::state::{self, FoldState};
use super::{Ledger, field, fold_lane};
use crate::document::{bson_type_name, display_id, integer_value, same_key};
use crate::error::{Error, Failure, RetryBudget};

/// How many double reads [`Ledger::value`] tries before it reports
/// [`Error::ReadContended`].
const READ_ROUNDS: u32 = 20;

/// Unfolded events per batch of an exact read: the first reply carries
/// them all, unless the backlog is long.
const UNFOLDED_BATCH: u32 = 10_000;

/// `lanes` with their folded numbers in `state` (`None`: nothing folded on
/// the lane yet), as [`unfolded_stages`] takes them.
pub(crate) fn folded_numbers(
    state: &FoldState,
    lanes: impl IntoIterator<Item = ObjectId>,
) -> Vec<(ObjectId, Option<i64>)> {
    lanes
        .into_iter()
        .map(|lane| (lane, state.folded.get(&lane).copied()))
        .collect()
}

/// The aggregation stages that keep the events above their lane's folded
/// number on each of `lanes` (every event of a lane whose number is
/// `None`), of the counter `counter` when given: a `$match` on the lanes
/// (and the counter), then one on an `$or` of each lane's range. One
/// command, whatever the number of lanes: MongoDB merges the two stages and
/// reads each branch as one index range (`{L, s}`, or `{k, L, s}` with a
/// counter), so only the events asked for are read; a server that does
/// not merge them reads the lanes' events (of the counter) through the
/// first stage's index and filters them. `lanes` must not be empty (an
/// empty `$or` is refused).
fn unfolded_stages(counter: Option<&Bson>, lanes: &[(ObjectId, Option<i64>)]) -> Vec<Document> {
    let ids: Vec<ObjectId> = lanes.iter().map(|&(lane, _)| lane).collect();
    let mut first = Document::new();
    if let Some(counter) = counter {
        first.insert(field::COUNTER, counter.clone());
    }
    first.insert(field::LANE, doc! { "$in": ids });
    let branches: Vec<Document> = lanes
        .iter()
        .map(|&(lane, folded)| match folded {
            Some(folded) => doc! { field::LANE: lane, field::NUMBER: { "$gt": folded } },
            None => doc! { field::LANE: lane },
        })
        .collect();
    vec![
        doc! { "$match": first },
        doc! { "$match": { "$or": branches } },
    ]
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
}

/// The counter document as far as the ledger cares: its value and its
/// fold lane's position.
#[derive(Debug, PartialEq)]
struct CounterState {
    value: i64,
    fold_position: Option<i64>,
}

impl Ledger {
    /// The counter `key` read exactly: the counter plus its recorded events
    /// not folded into it yet. [`Error::ReadContended`] when a fold pass
    /// moved during every one of 20 double reads.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// use tally::Error;
    ///
    /// match orders.value("2026-05").await {
    ///     Ok(exact) => println!("May: {}", exact.value),
    ///     // A fold kept moving under every read: read again later.
    ///     Err(Error::ReadContended { rounds, .. }) => eprintln!("busy after {rounds} reads"),
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn value(&self, key: impl Into<Bson>) -> Result<ExactValue, Error> {
        let key = key.into();
        crate::document::check_key(&key)?;
        let lane = fold_lane(&self.spec.events_collection_name())?;
        for _ in 0..READ_ROUNDS {
            let before = state::read(&self.store, &self.state).await?;
            let counter = self.counter_state(&key, lane.as_str()).await?;
            let events = self.unfolded_events(&key, &before).await?;
            let after = state::read(&self.store, &self.state).await?;
            if before.seen() != after.seen() {
                continue;
            }
            self.check_state_kept(&key, &counter, &events, &after)?;
            let held = counter.fold_position.unwrap_or(i64::MIN);
            let mut unfolded = 0i128;
            let mut unfolded_events = 0u64;
            for (lane, event) in &events {
                let number = event.get(field::NUMBER).and_then(integer_value);
                let in_pass = after.intent.as_ref().is_some_and(|intent| {
                    held >= intent.pass
                        && intent
                            .ranges
                            .get(lane)
                            .is_some_and(|&(from, to)| number.is_some_and(|s| s > from && s <= to))
                });
                if in_pass {
                    continue;
                }
                let Some(amount) = event.get(field::AMOUNT).and_then(integer_value) else {
                    return Err(self.malformed_event(event, "its amount n is not an integer"));
                };
                unfolded += i128::from(amount);
                unfolded_events += 1;
            }
            for sum in before.held.iter().filter(|h| same_key(&h.key, &key)) {
                if held < sum.pass {
                    unfolded += sum.amount;
                    unfolded_events += sum.events;
                }
            }
            let shown = display_id(&key);
            let too_big = || {
                Error::InvalidArgument(format!(
                    "counter {shown}: its value and its unfolded events pass 2^63"
                ))
            };
            let value =
                i64::try_from(i128::from(counter.value) + unfolded).map_err(|_| too_big())?;
            return Ok(ExactValue {
                key,
                value,
                folded: counter.value,
                unfolded: i64::try_from(unfolded).map_err(|_| too_big())?,
                unfolded_events,
            });
        }
        Err(Error::ReadContended {
            key: display_id(&key),
            rounds: READ_ROUNDS,
        })
    }

    /// The counter's value and its fold lane's position (zero and none
    /// without a document).
    async fn counter_state(&self, key: &Bson, lane: &str) -> Result<CounterState, Error> {
        let spec = &self.spec;
        let entry = format!("{}.{lane}", spec.lanes_field);
        let projection = doc! { &spec.counter_field: 1, &spec.lanes_field: 1 };
        let found = self
            .store
            .find_one(
                &self.counters,
                doc! { "_id": key },
                projection,
                "ledger.read_counter",
            )
            .await?;
        let Some(found) = found else {
            return Ok(CounterState {
                value: 0,
                fold_position: None,
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
        })
    }

    /// Refuses a read whose fold state was lost ([`Error::FoldStateLost`]):
    /// the counter holds a fold pass past any the state knows (passes were
    /// numbered again), or, with no state document, one of the counter's
    /// events is on a lane no registration names (registered, as every
    /// lane is, before its first insert: the registrations went with the
    /// state).
    fn check_state_kept(
        &self,
        key: &Bson,
        counter: &CounterState,
        events: &[(ObjectId, Document)],
        after: &FoldState,
    ) -> Result<(), Error> {
        let known = after
            .intent
            .as_ref()
            .map_or(after.pass, |i| i.pass.max(after.pass));
        if let Some(position) = counter.fold_position.filter(|&p| p > known) {
            let evidence = format!(
                "counter {} holds fold pass {position}, past the last one recorded ({known})",
                display_id(key)
            );
            return Err(state::lost(&self.state, evidence));
        }
        if !after.exists
            && let Some((lane, event)) = events
                .iter()
                .find(|(lane, _)| !after.registered.iter().any(|r| r.lane == *lane))
        {
            let id = event.get("_id").map_or_else(String::new, display_id);
            let evidence = format!("event {id} is on lane {lane}, which no registration names");
            return Err(state::lost(&self.state, evidence));
        }
        Ok(())
    }

    /// The counter's events above their lane's folded number, on every lane
    /// that may hold some, with their lanes: one aggregate, whatever the
    /// number of lanes. Without a state document nothing was folded (the
    /// first pass makes it): every event of the counter, on any lane.
    async fn unfolded_events(
        &self,
        key: &Bson,
        state: &FoldState,
    ) -> Result<Vec<(ObjectId, Document)>, Error> {
        if !state.exists {
            let filter = doc! { field::COUNTER: key };
            let projection = doc! { field::AMOUNT: 1, field::NUMBER: 1, field::LANE: 1 };
            let found = self.find_events(filter, projection).await?;
            // An event without a lane (written by hand) is never folded.
            return Ok(found
                .into_iter()
                .filter_map(|event| Some((event.get_object_id(field::LANE).ok()?, event)))
                .collect());
        }
        let lanes = folded_numbers(state, state.readable_lanes());
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipeline = unfolded_stages(Some(key), &lanes);
        pipeline.push(doc! { "$project": { field::AMOUNT: 1, field::NUMBER: 1, field::LANE: 1 } });
        let mut budget = RetryBudget::read_once("ledger.read_unfolded");
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events.aggregate(pipeline.clone()).with_options(
                    AggregateOptions::builder()
                        .batch_size(UNFOLDED_BATCH)
                        .build(),
                )
            })
            .await
            .map_err(Error::Server)?;
        let found: Vec<Document> = cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("ledger.read_unfolded", err)))?;
        found
            .into_iter()
            .map(|event| match event.get_object_id(field::LANE) {
                Ok(lane) => Ok((lane, event)),
                Err(_) => Err(self.malformed_event(&event, "its lane L is not an ObjectId")),
            })
            .collect()
    }

    /// The events `filter` matches, with the fields of `projection`.
    async fn find_events(
        &self,
        filter: Document,
        projection: Document,
    ) -> Result<Vec<Document>, Error> {
        let mut budget = RetryBudget::read_once("ledger.read_unfolded");
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .projection(projection.clone())
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
