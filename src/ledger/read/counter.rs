//! The counter documents as an exact read reads them: the value and the
//! fold lane's position (which passes the counter holds), and whether a
//! bucket is closed; a malformed one is named, never guessed.

use std::collections::HashMap;

use mongodb::bson::{Bson, Document};

use super::CounterState;
use crate::bucket::CLOSED_FIELD;
use crate::document::{CanonicalKey, bson_type_name, display_id, integer_value};
use crate::error::Error;
use crate::ledger::Ledger;

impl Ledger {
    /// The counters as the ledger reads them, by key.
    pub(super) fn counter_states(
        &self,
        found: Vec<Document>,
        lane: &str,
    ) -> Result<HashMap<CanonicalKey, CounterState>, Error> {
        found
            .into_iter()
            .map(|counter| {
                let id = counter.get("_id").cloned().unwrap_or(Bson::Null);
                let state = self.counter_state(&id, lane, &counter)?;
                Ok((CanonicalKey::of(&id), state))
            })
            .collect()
    }

    /// The counter's value and its fold lane's position.
    fn counter_state(
        &self,
        key: &Bson,
        lane: &str,
        found: &Document,
    ) -> Result<CounterState, Error> {
        let spec = &self.spec;
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
                Some(position) => Some(integer_value(position).ok_or_else(|| {
                    malformed(format!(
                        "its entry {}.{lane} is not an integer",
                        spec.lanes_field
                    ))
                })?),
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
}
