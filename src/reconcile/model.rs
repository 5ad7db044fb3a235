//! The fold's arithmetic in plain Rust: what folding one document at a
//! given cutoff must produce, or why the document must be left alone.
//!
//! The server-side pipeline ([`super::pipeline`]) is the implementation;
//! this model is its specification, small enough to check by property tests
//! and used by the integration tests to predict exactly what the server must
//! do to every document.

use std::fmt;

use mongodb::bson::{Bson, oid::ObjectId};

use crate::document::bson_type_name;
use crate::token::{BadEntry, Entry, Token};

const EXACT_DOUBLE: i128 = 1 << 53;

/// Why a document is not folded (and never modified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Malformed {
    /// The pending field exists but is not an array.
    PendingNotArray(&'static str),
    /// An entry is neither an ObjectId nor `{t: ObjectId, n: int}`.
    BadEntry(BadEntry),
    /// The counter is not an integer (int32, int64, or a double holding an
    /// integer up to 2^53).
    CounterNotInteger(&'static str),
    /// Adding the stale entries would overflow the counter.
    Overflow,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PendingNotArray(t) => write!(f, "the pending field is a {t}, not an array"),
            Self::BadEntry(bad) => write!(f, "a pending {bad}"),
            Self::CounterNotInteger(t) => write!(f, "the counter is a {t}, not an integer"),
            Self::Overflow => f.write_str("adding the stale entries would overflow the counter"),
        }
    }
}

/// What folding a well-formed document does.
#[derive(Debug, Clone, PartialEq)]
pub struct FoldPlan {
    /// Entries older than the cutoff.
    pub stale_tokens: u64,
    /// What they add up to.
    pub stale_amount: i64,
    /// The oldest valid token in the array.
    pub oldest: Option<Token>,
    /// The counter after the fold, in its type.
    pub counter: Bson,
    /// The entries that stay (the field is removed when this is empty).
    pub keep: Vec<Bson>,
}

/// Plans the fold of a document whose counter field is `counter` and whose
/// pending field is `pending` (`None`: absent), at `cutoff`: an entry is
/// stale when its token sorts below the cutoff.
pub fn plan(
    counter: Option<&Bson>,
    pending: Option<&Bson>,
    cutoff: ObjectId,
) -> Result<FoldPlan, Malformed> {
    let entries = match pending {
        None => &Vec::new(),
        Some(Bson::Array(entries)) => entries,
        Some(other) => return Err(Malformed::PendingNotArray(bson_type_name(other))),
    };
    let mut plan = FoldPlan {
        stale_tokens: 0,
        stale_amount: 0,
        oldest: None,
        counter: Bson::Null,
        keep: Vec::new(),
    };
    let mut sum: i128 = 0;
    for value in entries {
        let entry = Entry::parse(value).map_err(Malformed::BadEntry)?;
        let token = entry.token();
        plan.oldest = Some(plan.oldest.map_or(token, |o| o.min(token)));
        if token.object_id() < cutoff {
            plan.stale_tokens += 1;
            sum += i128::from(entry.amount());
        } else {
            plan.keep.push(value.clone());
        }
    }
    plan.stale_amount = i64::try_from(sum).map_err(|_| Malformed::Overflow)?;
    plan.counter = add(counter, sum)?;
    Ok(plan)
}

/// The counter plus `sum`, keeping its type.
fn add(counter: Option<&Bson>, sum: i128) -> Result<Bson, Malformed> {
    let overflow = |r: i128| i64::try_from(r).map_err(|_| Malformed::Overflow);
    match counter {
        None => Ok(Bson::Int64(overflow(sum)?)),
        Some(Bson::Int32(c)) => {
            let r = overflow(i128::from(*c) + sum)?;
            Ok(i32::try_from(r).map_or(Bson::Int64(r), Bson::Int32))
        }
        Some(Bson::Int64(c)) => Ok(Bson::Int64(overflow(i128::from(*c) + sum)?)),
        Some(Bson::Double(c)) if c.fract() == 0.0 && c.abs() <= EXACT_DOUBLE as f64 => {
            let r = *c as i128 + sum;
            if r.abs() <= EXACT_DOUBLE {
                Ok(Bson::Double(r as f64))
            } else {
                Err(Malformed::Overflow)
            }
        }
        Some(other) => Err(Malformed::CounterNotInteger(bson_type_name(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;
    use proptest::prelude::*;
    use std::time::{Duration, SystemTime};

    fn at(secs_ago: u64) -> ObjectId {
        Token::created_at_time(SystemTime::now() - Duration::from_secs(secs_ago)).object_id()
    }

    fn cutoff() -> ObjectId {
        Token::cutoff(SystemTime::now() - Duration::from_secs(600))
    }

    #[test]
    fn stale_entries_are_added_and_fresh_ones_kept() {
        let fresh = at(5);
        let pending = Bson::Array(vec![
            Bson::ObjectId(at(3600)),
            Bson::Document(doc! { "t": at(7200), "n": 5i64 }),
            Bson::ObjectId(fresh),
            Bson::Document(doc! { "t": at(4000), "n": -2 }),
        ]);
        let plan = plan(Some(&Bson::Int64(10)), Some(&pending), cutoff()).unwrap();
        assert_eq!(plan.stale_tokens, 3);
        assert_eq!(plan.stale_amount, 4);
        assert_eq!(plan.counter, Bson::Int64(14));
        assert_eq!(plan.keep, vec![Bson::ObjectId(fresh)]);
    }

    #[test]
    fn counter_types_are_kept() {
        let pending = Bson::Array(vec![Bson::ObjectId(at(3600))]);
        let p = Some(&pending);
        assert_eq!(
            plan(Some(&Bson::Int32(1)), p, cutoff()).unwrap().counter,
            Bson::Int32(2)
        );
        assert_eq!(
            plan(Some(&Bson::Int32(i32::MAX)), p, cutoff())
                .unwrap()
                .counter,
            Bson::Int64(1 << 31)
        );
        assert_eq!(
            plan(Some(&Bson::Double(4.0)), p, cutoff()).unwrap().counter,
            Bson::Double(5.0)
        );
        assert_eq!(plan(None, p, cutoff()).unwrap().counter, Bson::Int64(1));
    }

    #[test]
    fn every_malformed_kind() {
        let stale = Bson::ObjectId(at(3600));
        let ok = Bson::Array(vec![stale.clone()]);
        let cases: Vec<(Option<Bson>, Bson)> = vec![
            (Some(Bson::Int64(0)), Bson::ObjectId(at(3600))),
            (Some(Bson::Int64(0)), Bson::String("x".into())),
            (
                Some(Bson::Int64(0)),
                Bson::Array(vec![stale.clone(), Bson::String("x".into())]),
            ),
            (
                Some(Bson::Int64(0)),
                Bson::Array(vec![stale.clone(), Bson::Int32(3)]),
            ),
            (
                Some(Bson::Int64(0)),
                Bson::Array(vec![stale.clone(), Bson::Null]),
            ),
            (
                Some(Bson::Int64(0)),
                Bson::Array(vec![Bson::Document(doc! { "t": at(3600), "n": 1.5 })]),
            ),
            (Some(Bson::String("7".into())), ok.clone()),
            (Some(Bson::Double(0.5)), ok.clone()),
            (Some(Bson::Double(f64::NAN)), ok.clone()),
            (Some(Bson::Int64(i64::MAX)), ok),
        ];
        for (counter, pending) in cases {
            let result = plan(counter.as_ref(), Some(&pending), cutoff());
            assert!(
                result.is_err(),
                "{counter:?} {pending:?} must be malformed, got {result:?}"
            );
        }
    }

    fn entry(stale: bool, tagged: bool, n: i64) -> Bson {
        let t = if stale { at(3600) } else { at(1) };
        if tagged {
            Bson::Document(doc! { "t": t, "n": n })
        } else {
            Bson::ObjectId(t)
        }
    }

    proptest! {
        /// Folding never loses or invents an entry: the counter moves by
        /// exactly the stale amount, stale + kept = all, and folding the
        /// result again changes nothing.
        #[test]
        fn the_fold_is_exact_and_idempotent(
            start in -1_000_000i64..1_000_000,
            entries in proptest::collection::vec((any::<bool>(), any::<bool>(), 1i64..1000), 0..20),
        ) {
            let pending = Bson::Array(entries.iter().map(|(s, t, n)| entry(*s, *t, *n)).collect());
            let once = plan(Some(&Bson::Int64(start)), Some(&pending), cutoff()).unwrap();
            let expected: i64 = entries.iter().filter(|e| e.0).map(|(_, t, n)| if *t { *n } else { 1 }).sum();
            prop_assert_eq!(once.stale_amount, expected);
            prop_assert_eq!(once.counter.clone(), Bson::Int64(start + expected));
            prop_assert_eq!(once.stale_tokens as usize + once.keep.len(), entries.len());
            let again = plan(Some(&once.counter), Some(&Bson::Array(once.keep.clone())), cutoff()).unwrap();
            prop_assert_eq!(again.stale_tokens, 0);
            prop_assert_eq!(again.counter, once.counter);
        }

        /// A counter near the int64 limits is folded only when the result
        /// fits; otherwise the document is malformed, never wrapped.
        #[test]
        fn overflow_is_refused_never_wrapped(start in any::<i64>(), n in -1000i64..1000) {
            prop_assume!(n != 0);
            let pending = Bson::Array(vec![entry(true, true, n)]);
            match plan(Some(&Bson::Int64(start)), Some(&pending), cutoff()) {
                Ok(p) => prop_assert_eq!(p.counter, Bson::Int64(start.checked_add(n).unwrap())),
                Err(e) => {
                    prop_assert_eq!(e, Malformed::Overflow);
                    prop_assert!(start.checked_add(n).is_none());
                }
            }
        }
    }
}
