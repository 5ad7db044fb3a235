//! A pass's sums: its events added up per counter, here, exactly.
//!
//! The events come whole — from the log, whose insert events carry the
//! event, or from the collection in a catch-up — so the fold sums them
//! itself: every counter key compared as the server compares `_id`s
//! ([`CanonicalKey`]: `5`, `NumberLong(5)` and `5.0` are one key), every
//! amount converted as an exact read converts it, so the two always agree.
//! An amount counts when it is an integer — an int32, an int64, or a double
//! with an integral value below 2^53 (`n: 2.0`, what a shell writes); any
//! other amount is reported and left out, except a missing one or `null`,
//! counted as nothing (an exact read before the fold names the event).
//! Sums are kept in 128 bits: no overflow can hide an event.

use std::collections::HashMap;

use mongodb::bson::Bson;

use crate::document::{CanonicalKey, integer_value};
use crate::ledger::log::Logged;

/// One counter's share of a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Share {
    /// The counter's key, as its first event gives it.
    pub(super) key: Bson,
    /// The sum of its events' amounts (integers only).
    pub(super) amount: i128,
    /// Its events, malformed ones included.
    pub(super) events: u64,
    /// Its events whose amount is not an integer (an integral double is
    /// one): reported, not counted.
    pub(super) malformed: u64,
}

/// The shares of a pass, per counter.
pub(super) type Shares = HashMap<CanonicalKey, Share>;

/// The shares of `events`.
pub(super) fn shares_of<'a>(events: impl IntoIterator<Item = &'a Logged>) -> Shares {
    let mut shares = Shares::new();
    for event in events {
        let key = event.counter();
        let share = shares
            .entry(CanonicalKey::of(&key))
            .or_insert_with(|| Share {
                key,
                amount: 0,
                events: 0,
                malformed: 0,
            });
        share.events += 1;
        match &event.amount {
            None | Some(Bson::Null) => {}
            Some(amount) => match integer_value(amount) {
                Some(n) => share.amount += i128::from(n),
                None => share.malformed += 1,
            },
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(key: &str, counter: Bson, amount: Option<Bson>) -> Logged {
        Logged {
            key: Bson::from(key),
            counter: Some(counter),
            amount,
            number: None,
        }
    }

    #[test]
    fn events_sum_per_counter_as_the_server_compares_keys_and_amounts_convert_as_reads_do() {
        let events = [
            logged("a", Bson::Int32(5), Some(Bson::Int64(2))),
            logged("b", Bson::Int64(5), Some(Bson::Double(3.0))),
            logged("c", Bson::Double(5.0), Some(Bson::Int64(i64::MAX))),
            logged("d", Bson::Int32(5), Some(Bson::Double(0.5))),
            logged("e", Bson::Int32(5), Some(Bson::String("7".into()))),
            logged("f", Bson::Int32(5), None),
            logged("g", Bson::from("other"), Some(Bson::Int32(-1))),
        ];
        let shares = shares_of(&events);
        assert_eq!(shares.len(), 2);
        let five = &shares[&CanonicalKey::of(&Bson::Int64(5))];
        assert_eq!(
            five.amount,
            5 + i128::from(i64::MAX),
            "no overflow hides an event"
        );
        assert_eq!((five.events, five.malformed), (6, 2));
        let other = &shares[&CanonicalKey::of(&Bson::from("other"))];
        assert_eq!((other.amount, other.events), (-1, 1));
    }
}
