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
use crate::token::{Entry, Token};

pub use crate::token::BadEntry;

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
    // Summed in entry order in int64, as the server's pipeline does: a sum
    // that overflows at any point is refused, even if later entries would
    // bring it back.
    let mut sum = Some(0i64);
    for value in entries {
        let entry = Entry::parse(value).map_err(Malformed::BadEntry)?;
        let token = entry.token();
        plan.oldest = Some(plan.oldest.map_or(token, |o| o.min(token)));
        if token.object_id() < cutoff {
            plan.stale_tokens += 1;
            sum = sum.and_then(|s| s.checked_add(entry.amount()));
        } else {
            plan.keep.push(value.clone());
        }
    }
    // The counter's type is judged before the overflow, as the pipeline
    // does.
    plan.counter = add(counter, sum)?;
    plan.stale_amount = sum.ok_or(Malformed::Overflow)?;
    Ok(plan)
}

/// The counter plus `sum` (`None`: the sum overflowed), keeping its type.
fn add(counter: Option<&Bson>, sum: Option<i64>) -> Result<Bson, Malformed> {
    let sum = || sum.ok_or(Malformed::Overflow);
    let checked = |c: i64| c.checked_add(sum()?).ok_or(Malformed::Overflow);
    match counter {
        None => Ok(Bson::Int64(sum()?)),
        Some(Bson::Int32(c)) => {
            let r = checked(i64::from(*c))?;
            Ok(i32::try_from(r).map_or(Bson::Int64(r), Bson::Int32))
        }
        Some(Bson::Int64(c)) => Ok(Bson::Int64(checked(*c)?)),
        Some(Bson::Double(c)) if c.fract() == 0.0 && c.abs() <= EXACT_DOUBLE as f64 => {
            let r = *c as i128 + i128::from(sum()?);
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

    /// The stale amounts are summed in entry order in int64, as the
    /// server's pipeline sums them: an overflow midway is refused even when
    /// later entries would bring the sum back.
    #[test]
    fn a_sum_that_overflows_midway_is_refused() {
        let midway = Bson::Array(vec![
            entry(true, true, i64::MAX),
            entry(true, true, 1),
            entry(true, true, -1),
        ]);
        assert_eq!(
            plan(Some(&Bson::Int64(0)), Some(&midway), cutoff()),
            Err(Malformed::Overflow)
        );
        let in_order = Bson::Array(vec![
            entry(true, true, i64::MAX),
            entry(true, true, -1),
            entry(true, true, 1),
        ]);
        let folded = plan(Some(&Bson::Int64(0)), Some(&in_order), cutoff()).unwrap();
        assert_eq!(folded.counter, Bson::Int64(i64::MAX));
        // A counter that is not an integer is named before an overflow.
        assert_eq!(
            plan(Some(&Bson::String("7".into())), Some(&midway), cutoff()),
            Err(Malformed::CounterNotInteger("string"))
        );
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

    /// The cutoff second the properties below fold at (any time in 2023).
    const CUTOFF_SECS: u32 = 1_690_000_000;

    fn cutoff_at(secs: u32) -> ObjectId {
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        ObjectId::from_bytes(bytes)
    }

    /// A token created `offset` seconds from the cutoff second, with random
    /// remaining bytes (all-zero included: the cutoff itself).
    fn token_at(offset: i32, rest: [u8; 8]) -> ObjectId {
        let secs = CUTOFF_SECS.checked_add_signed(offset).unwrap();
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        bytes[4..].copy_from_slice(&rest);
        ObjectId::from_bytes(bytes)
    }

    /// A valid entry as another client may have written it: `(value, its
    /// token's offset from the cutoff second, its amount)`.
    fn valid_entry(amount: BoxedStrategy<i64>) -> impl Strategy<Value = (Bson, i32, i64)> {
        let rest = prop_oneof![1 => Just([0u8; 8]), 4 => any::<[u8; 8]>()];
        (-3i32..3, rest, amount, 0u8..4).prop_map(|(offset, rest, n, form)| {
            let t = token_at(offset, rest);
            let value = match form {
                0 => Bson::ObjectId(t),
                1 => Bson::Document(doc! { "t": t, "n": n }),
                2 => Bson::Document(doc! { "n": n, "t": t }),
                _ => match i32::try_from(n) {
                    Ok(n32) => Bson::Document(doc! { "t": t, "n": n32 }),
                    Err(_) => Bson::Document(doc! { "t": t, "n": n }),
                },
            };
            let amount = if form == 0 { 1 } else { n };
            (value, offset, amount)
        })
    }

    fn small_amount() -> BoxedStrategy<i64> {
        prop_oneof![1i64..1000, -1000i64..-1].boxed()
    }

    /// Amounts that push an int32 counter across its limits, and now and
    /// then an int64 one.
    fn wide_amount() -> BoxedStrategy<i64> {
        prop_oneof![
            4 => prop_oneof![1i64..(1 << 32), -(1i64 << 32)..-1],
            1 => any::<i64>().prop_filter("nonzero", |n| *n != 0),
        ]
        .boxed()
    }

    /// What the stale entries add up to (DESIGN §4: entries of a second
    /// before the cutoff second), summed in entry order in int64 as the fold
    /// does; 2^70 (beyond any int64) when a partial sum overflows.
    fn stale_sum(entries: &[(Bson, i32, i64)]) -> i128 {
        let mut sum = 0i64;
        for (_, _, n) in entries.iter().filter(|(_, offset, _)| *offset < 0) {
            match sum.checked_add(*n) {
                Some(s) => sum = s,
                None => return 1 << 70,
            }
        }
        i128::from(sum)
    }

    fn pending_of(entries: &[(Bson, i32, i64)]) -> Bson {
        Bson::Array(entries.iter().map(|(v, _, _)| v.clone()).collect())
    }

    /// Values that are not an entry: wrong types, and documents that look
    /// like `{t, n}` but are not (`n` not an integer or zero, `t` not an
    /// ObjectId, a field missing or one too many).
    fn malformed_entry() -> impl Strategy<Value = Bson> {
        let t = token_at(-2, [7; 8]);
        prop_oneof![
            ".{0,6}".prop_map(Bson::String),
            any::<i32>().prop_map(Bson::Int32),
            any::<i64>().prop_map(Bson::Int64),
            any::<f64>().prop_map(Bson::Double),
            any::<bool>().prop_map(Bson::Boolean),
            Just(Bson::Null),
            Just(Bson::Array(vec![Bson::ObjectId(t)])),
            Just(Bson::Document(doc! {})),
            Just(Bson::Document(doc! { "t": t })),
            Just(Bson::Document(doc! { "n": 1 })),
            Just(Bson::Document(doc! { "t": t, "n": 0 })),
            Just(Bson::Document(doc! { "t": t, "n": 0i64 })),
            any::<f64>().prop_map(move |n| Bson::Document(doc! { "t": t, "n": n })),
            ".{0,3}".prop_map(move |n| Bson::Document(doc! { "t": t, "n": n })),
            Just(Bson::Document(doc! { "t": t, "n": Bson::Null })),
            Just(Bson::Document(doc! { "t": t.to_hex(), "n": 1 })),
            Just(Bson::Document(doc! { "t": t, "n": 1, "x": 1 })),
            Just(Bson::Document(doc! { "_id": t, "n": 1 })),
        ]
    }

    /// A counter of any valid type and a sensible size.
    fn valid_counter() -> impl Strategy<Value = Option<Bson>> {
        prop_oneof![
            Just(None),
            any::<i32>().prop_map(|c| Some(Bson::Int32(c))),
            (-1_000_000i64..1_000_000).prop_map(|c| Some(Bson::Int64(c))),
            (-1_000_000i32..1_000_000).prop_map(|c| Some(Bson::Double(f64::from(c)))),
        ]
    }

    proptest! {
        /// An int32 counter stays int32 while the result fits in an int32
        /// and is widened to int64 otherwise (as the server widens `$add`),
        /// and is refused as an overflow only when the exact result does not
        /// fit in an int64.
        #[test]
        fn an_int32_counter_stays_int32_while_it_fits(
            start in prop_oneof![any::<i32>(), Just(i32::MAX), Just(i32::MIN), -5i32..5],
            entries in proptest::collection::vec(valid_entry(wide_amount()), 0..6),
        ) {
            let pending = pending_of(&entries);
            let result = plan(Some(&Bson::Int32(start)), Some(&pending), cutoff_at(CUTOFF_SECS));
            let exact = i128::from(start) + stale_sum(&entries);
            match (i32::try_from(exact), i64::try_from(exact), i64::try_from(stale_sum(&entries))) {
                (Ok(r), _, Ok(_)) => prop_assert_eq!(result.unwrap().counter, Bson::Int32(r)),
                (Err(_), Ok(r), Ok(_)) => prop_assert_eq!(result.unwrap().counter, Bson::Int64(r)),
                _ => prop_assert_eq!(result, Err(Malformed::Overflow)),
            }
        }

        /// A missing counter counts from 0 and is written as an int64: the
        /// fold is the same as that of an int64 counter holding 0.
        #[test]
        fn a_missing_counter_counts_from_zero(
            entries in proptest::collection::vec(valid_entry(wide_amount()), 0..6),
        ) {
            let pending = pending_of(&entries);
            let missing = plan(None, Some(&pending), cutoff_at(CUTOFF_SECS));
            match i64::try_from(stale_sum(&entries)) {
                Ok(sum) => {
                    let missing = missing.unwrap();
                    prop_assert_eq!(&missing.counter, &Bson::Int64(sum));
                    prop_assert_eq!(missing.stale_amount, sum);
                    let zero = plan(Some(&Bson::Int64(0)), Some(&pending), cutoff_at(CUTOFF_SECS));
                    prop_assert_eq!(zero.unwrap(), missing);
                }
                Err(_) => prop_assert_eq!(missing, Err(Malformed::Overflow)),
            }
        }

        /// A double counter is folded only while it holds an integer and the
        /// result stays within 2^53 (where doubles are exact), and stays a
        /// double; NaN, infinities and fractions are not integers.
        #[test]
        fn a_double_counter_stays_exact_or_is_refused(
            start in prop_oneof![
                (-(1i64 << 53)..=(1i64 << 53)).prop_map(|c| c as f64),
                (-(1i64 << 53) - 5..-(1i64 << 53)).prop_map(|c| c as f64),
                ((1i64 << 53) - 5..(1i64 << 53) + 5).prop_map(|c| c as f64),
                any::<f64>(),
                Just(f64::NAN),
                Just(f64::INFINITY),
                Just(0.5),
            ],
            entries in proptest::collection::vec(valid_entry(small_amount()), 0..6),
        ) {
            const EXACT: i128 = 1 << 53;
            let pending = pending_of(&entries);
            let result = plan(Some(&Bson::Double(start)), Some(&pending), cutoff_at(CUTOFF_SECS));
            let integral = start.is_finite() && start.trunc() == start && (start.abs() as i128) <= EXACT;
            if !integral {
                prop_assert_eq!(result, Err(Malformed::CounterNotInteger("double")));
            } else {
                let exact = start as i128 + stale_sum(&entries);
                if exact.abs() <= EXACT {
                    prop_assert_eq!(result.unwrap().counter, Bson::Double(exact as f64));
                } else {
                    prop_assert_eq!(result, Err(Malformed::Overflow));
                }
            }
        }

        /// One malformed entry anywhere in `pending` — before, between or
        /// after valid stale and young entries — makes the whole document
        /// malformed, whatever its (valid) counter.
        #[test]
        fn one_malformed_entry_anywhere_makes_the_document_malformed(
            counter in valid_counter(),
            entries in proptest::collection::vec(valid_entry(small_amount()), 0..8),
            bad in malformed_entry(),
            at in any::<proptest::sample::Index>(),
        ) {
            let mut values: Vec<Bson> = entries.iter().map(|(v, _, _)| v.clone()).collect();
            values.insert(at.index(values.len() + 1), bad.clone());
            let result = plan(counter.as_ref(), Some(&Bson::Array(values)), cutoff_at(CUTOFF_SECS));
            prop_assert!(
                matches!(result, Err(Malformed::BadEntry(_))),
                "{:?} in pending gave {:?}", bad, result
            );
        }

        /// A `pending` field that is not an array is malformed, named by its
        /// `$type`, whatever the counter.
        #[test]
        fn a_pending_field_that_is_not_an_array_is_malformed(
            counter in valid_counter(),
            (pending, type_name) in prop_oneof![
                Just((Bson::Null, "null")),
                any::<bool>().prop_map(|b| (Bson::Boolean(b), "bool")),
                any::<i32>().prop_map(|n| (Bson::Int32(n), "int")),
                any::<i64>().prop_map(|n| (Bson::Int64(n), "long")),
                any::<f64>().prop_map(|n| (Bson::Double(n), "double")),
                ".{0,6}".prop_map(|s| (Bson::String(s), "string")),
                any::<[u8; 12]>().prop_map(|b| (Bson::ObjectId(ObjectId::from_bytes(b)), "objectId")),
                any::<[u8; 12]>().prop_map(|b| {
                    (Bson::Document(doc! { "0": ObjectId::from_bytes(b) }), "object")
                }),
            ],
        ) {
            let result = plan(counter.as_ref(), Some(&pending), cutoff_at(CUTOFF_SECS));
            prop_assert_eq!(result, Err(Malformed::PendingNotArray(type_name)));
        }

        /// The fold never touches an entry created in or after the cutoff
        /// second: the kept entries are exactly those, unchanged and in
        /// their order; the stale ones are counted and summed; the oldest
        /// token is the smallest of all.
        #[test]
        fn the_fold_keeps_exactly_the_young_entries_in_order(
            counter in valid_counter(),
            entries in proptest::collection::vec(valid_entry(small_amount()), 0..12),
        ) {
            let result = plan(counter.as_ref(), Some(&pending_of(&entries)), cutoff_at(CUTOFF_SECS)).unwrap();
            let young: Vec<Bson> = entries
                .iter()
                .filter(|(_, offset, _)| *offset >= 0)
                .map(|(v, _, _)| v.clone())
                .collect();
            prop_assert_eq!(&result.keep, &young);
            let stale = entries.iter().filter(|(_, offset, _)| *offset < 0).count();
            prop_assert_eq!(result.stale_tokens, stale as u64);
            prop_assert_eq!(i128::from(result.stale_amount), stale_sum(&entries));
            let oldest = entries
                .iter()
                .map(|(v, _, _)| match v {
                    Bson::ObjectId(t) => *t,
                    Bson::Document(d) => d.get_object_id("t").unwrap(),
                    _ => unreachable!(),
                })
                .min();
            prop_assert_eq!(result.oldest.map(|t| t.object_id()), oldest);
        }
    }
}
