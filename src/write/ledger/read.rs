//! Exact reads: a counter plus its events not yet in it, consistent at any
//! moment of a fold.
//!
//! An event is in the counter once the fold applied its batch `(l, s)` —
//! the counter document's lane entry `l` then holds `s` or more — and it is
//! marked folded (`f`) only after that. So the exact value is the counter
//! plus every event without `f` whose claim's lane entry is below its
//! number (or which has no claim yet).
//!
//! Reading the counter and its events is not one atomic read, so the
//! counter document is read before and after the events (an optimistic
//! double read): when both reads agree, nothing was applied to the counter
//! while the events were read — an apply changes the counter's lane map —
//! and every event read is judged against that one state. An event folded
//! before the events were read is in that state; one claimed or recorded
//! meanwhile is either read (and judged by the lane map) or not yet there.
//! When the reads disagree, the whole read is done again.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};

use super::{Ledger, field};
use crate::document::{bson_type_name, display_id, integer_value};
use crate::error::{Error, Failure, RetryBudget};

/// How many double reads [`Ledger::value`] tries before it reports
/// [`Error::ReadContended`].
const READ_ROUNDS: u32 = 20;

/// A counter read exactly: what its document holds and what its recorded
/// events not folded into it yet add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactValue {
    /// The counter's `_id`.
    pub key: Bson,
    /// `folded + unfolded`: every event recorded for the counter, once.
    pub value: i64,
    /// The counter document's value (0 when there is no document).
    pub folded: i64,
    /// The sum of the recorded events not in the counter yet.
    pub unfolded: i64,
    /// How many recorded events are not in the counter yet.
    pub unfolded_events: u64,
}

/// The counter document's state as far as the ledger cares: its value and
/// the lane map the fold writes.
#[derive(Debug, PartialEq)]
struct CounterState {
    value: i64,
    lanes: Document,
}

impl Ledger {
    /// The counter `key` read exactly: the counter plus its recorded events
    /// not folded into it yet. [`Error::ReadContended`] when the counter
    /// changed during every one of 20 double reads.
    pub async fn value(&self, key: impl Into<Bson>) -> Result<ExactValue, Error> {
        let key = key.into();
        crate::document::check_key(&key)?;
        for _ in 0..READ_ROUNDS {
            let before = self.counter_state(&key).await?;
            let events = self.unfolded_events(&key).await?;
            let after = self.counter_state(&key).await?;
            if before != after {
                continue;
            }
            let mut unfolded = 0i64;
            let mut unfolded_events = 0u64;
            for event in &events {
                if applied(event, &after.lanes) {
                    continue;
                }
                let amount = event.get(field::AMOUNT).and_then(integer_value);
                let Some(amount) = amount else {
                    return Err(self.malformed_event(event, "its amount n is not an integer"));
                };
                unfolded = unfolded
                    .checked_add(amount)
                    .ok_or_else(|| self.malformed_event(event, "the sum passes 2^63"))?;
                unfolded_events += 1;
            }
            let value = after.value.checked_add(unfolded).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "counter {}: its value and its unfolded events pass 2^63",
                    display_id(&key)
                ))
            })?;
            return Ok(ExactValue {
                key,
                value,
                folded: after.value,
                unfolded,
                unfolded_events,
            });
        }
        Err(Error::ReadContended {
            key: display_id(&key),
            rounds: READ_ROUNDS,
        })
    }

    /// The counter's value and lane map (zero and empty without a
    /// document).
    async fn counter_state(&self, key: &Bson) -> Result<CounterState, Error> {
        let spec = &self.spec;
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
                lanes: Document::new(),
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
        let lanes = match found.get(&spec.lanes_field) {
            None => Document::new(),
            Some(Bson::Document(map)) => map.clone(),
            Some(other) => {
                return Err(malformed(format!(
                    "the lanes field {} is a {}, not a document",
                    spec.lanes_field,
                    bson_type_name(other)
                )));
            }
        };
        Ok(CounterState { value, lanes })
    }

    /// The counter's events without a folded mark, with their amounts and
    /// claims.
    async fn unfolded_events(&self, key: &Bson) -> Result<Vec<Document>, Error> {
        let filter = doc! { field::COUNTER: key, field::FOLDED: { "$exists": false } };
        let projection = doc! { field::AMOUNT: 1, field::CLAIM: 1 };
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

/// Whether the event's claimed batch `(l, s)` is in the counter whose lane
/// map is `lanes`: the lane holds `s` or more.
fn applied(event: &Document, lanes: &Document) -> bool {
    let Ok(claim) = event.get_document(field::CLAIM) else {
        return false;
    };
    let (Ok(lane), Some(s)) = (claim.get_str("l"), claim.get("s").and_then(integer_value)) else {
        return false;
    };
    lanes
        .get(lane)
        .and_then(integer_value)
        .is_some_and(|held| held >= s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::oid::ObjectId;

    #[test]
    fn a_claimed_event_is_in_the_counter_once_its_lane_holds_its_number() {
        let lane = ObjectId::new().to_hex();
        let event = doc! { "n": 1i64, "c": { "b": ObjectId::new(), "l": &lane, "s": 4i64 } };
        assert!(!applied(&event, &doc! {}));
        assert!(!applied(&event, &doc! { &lane: 3i64 }));
        assert!(applied(&event, &doc! { &lane: 4i64 }));
        assert!(applied(&event, &doc! { &lane: 5i32 }));
        assert!(!applied(&doc! { "n": 1i64 }, &doc! { &lane: 5i64 }));
    }
}
