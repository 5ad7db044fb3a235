//! The fold's rules in plain Rust: what folding one document at a given
//! cutoff must produce, or why the document must be left alone.
//!
//! This model is the fold's specification. The reconciler plans every
//! document with it and writes the plan with update statements
//! ([`super::statement`]) conditioned on what the plan removes; the
//! integration tests use it to predict exactly what the server must do to
//! every document, and the property tests below check its arithmetic.
//!
//! At cutoff C, for a document `{counter, pending, settled}`:
//!
//! 1. **One token, one count.** Pending entries whose token sorts below C
//!    are stale. All stale entries of one token are removed together and
//!    counted once — whatever their form (`t` or `{t, n}`, any field order
//!    or integer width) — provided they agree on the amount.
//! 2. **A settle counted it already.** A stale token that has a marker in
//!    `settled` was counted by `complete` or `resume`; its entries are a
//!    copy re-added later (a delayed step 1) and are removed uncounted.
//! 3. **Markers expire.** Markers whose token sorts below C are pruned.
//! 4. **No empty fields.** A `pending` or `settled` left empty (or found
//!    empty) is removed.
//! 5. Everything else stays as it is, fresh entries in their order; a
//!    document with nothing to do is not written.
//!
//! 6. **Lanes expire.** Minted lane entries older than the lane cutoff are
//!    pruned, named ones (a ledger's fold lane among them) kept, an empty
//!    map removed ([`plan_lanes`]); the same statement writes both.
//!
//! A document the rules cannot judge is [`Malformed`] and never modified.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use mongodb::bson::{Bson, oid::ObjectId};

use crate::document::{EXACT_DOUBLE, bson_type_name};
use crate::token::{AMOUNT_FIELD, Entry, TOKEN_FIELD, Token};

mod lanes;

pub(crate) use crate::token::BadEntry;
pub(crate) use lanes::{LanePlan, plan_lanes};

/// The two lines a fold draws, each an ObjectId whose time is the line
/// (see [`Token::cutoff`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cutoffs {
    /// Pending entries and settle markers whose token sorts below this are
    /// stale: the server's time minus the grace.
    pub(crate) tokens: ObjectId,
    /// Minted lanes whose id sorts below this are expired: the server's
    /// time minus `lane_ttl`.
    pub(crate) lanes: ObjectId,
}

/// The lines a run draws.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lines {
    pub(crate) cutoffs: Cutoffs,
}

impl From<Cutoffs> for Lines {
    fn from(cutoffs: Cutoffs) -> Self {
        Self { cutoffs }
    }
}

/// Why a document is not folded (and never modified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Malformed {
    /// The pending field exists but is not an array.
    PendingNotArray(&'static str),
    /// An entry is neither an ObjectId nor `{t: ObjectId, n: int}`.
    BadEntry(BadEntry),
    /// The settled field exists but is not an array.
    SettledNotArray(&'static str),
    /// A marker is not exactly `{t: ObjectId, n: integer}`.
    BadMarker(&'static str),
    /// Stale entries of one token disagree on its amount: which one was
    /// meant cannot be told.
    ConflictingAmounts {
        /// The token.
        token: Token,
        /// One amount found.
        first: i64,
        /// Another.
        second: i64,
    },
    /// The counter is not an integer: int32, int64, or a double holding an
    /// integer of magnitude below 2^53.
    CounterNotInteger(&'static str),
    /// Adding the stale entries would overflow the counter (a double would
    /// reach 2^53).
    Overflow,
    /// The lanes field exists but is not a document.
    LanesNotDocument(&'static str),
    /// A lane's entry is not a non-negative int32 or int64.
    BadLane {
        /// The lane's key.
        lane: String,
        /// What its value is instead.
        why: &'static str,
    },
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PendingNotArray(t) => write!(f, "the pending field is a {t}, not an array"),
            Self::BadEntry(bad) => write!(f, "a pending {bad}"),
            Self::SettledNotArray(t) => write!(f, "the settled field is a {t}, not an array"),
            Self::BadMarker(why) => write!(f, "a settled marker {why}"),
            Self::ConflictingAmounts {
                token,
                first,
                second,
            } => write!(
                f,
                "stale entries of token {token} disagree on its amount ({first} and {second})"
            ),
            Self::CounterNotInteger(t) => write!(f, "the counter is a {t}, not an integer"),
            Self::Overflow => f.write_str("adding the stale entries would overflow the counter"),
            Self::LanesNotDocument(t) => write!(f, "the lanes field is a {t}, not a document"),
            Self::BadLane { lane, why } => write!(
                f,
                "lane {lane:?} holds a {why}, not a non-negative integer position"
            ),
        }
    }
}

/// One stale pending entry, as read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StaleEntry {
    /// Its position in the pending array.
    pub(crate) position: usize,
    /// The value as stored.
    pub(crate) value: Bson,
    /// Its token.
    pub(crate) token: Token,
    /// What removing it adds to the counter: its token's amount on the
    /// token's last stale entry, 0 on the others and on every entry of a
    /// token a settle counted. Removing a prefix of the stale entries with
    /// their `adds` therefore never counts a token whose other entries
    /// stay behind.
    pub(crate) adds: i64,
}

/// What folding a well-formed document does.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FoldPlan {
    /// Stale tokens counted (each once).
    pub(crate) stale_tokens: u64,
    /// What they add up to.
    pub(crate) stale_amount: i64,
    /// Stale entries removed without being counted because another entry
    /// of the same token is counted.
    pub(crate) duplicate_entries: u64,
    /// Stale entries removed without being counted because a settle
    /// counted their token (it has a marker).
    pub(crate) settled_copies: u64,
    /// The oldest valid token in the pending array.
    pub(crate) oldest: Option<Token>,
    /// The counter after the fold, in its type.
    pub(crate) counter: Bson,
    /// The stale entries, in array order: every one is removed.
    pub(crate) stale: Vec<StaleEntry>,
    /// The entries that stay, in order (the field is removed when this is
    /// empty).
    pub(crate) keep: Vec<Bson>,
    /// Markers older than the cutoff, as stored: every one is pruned.
    pub(crate) stale_markers: Vec<Bson>,
    /// The markers that stay, in order.
    pub(crate) kept_markers: Vec<Bson>,
    /// The pending field exists.
    pub(crate) has_pending: bool,
    /// The settled field exists.
    pub(crate) has_settled: bool,
    /// What pruning the lane map does (nothing, from [`plan`] alone).
    pub(crate) lanes: LanePlan,
}

impl FoldPlan {
    /// Whether folding changes the document: something stale, or a field
    /// to remove because it is empty.
    pub(crate) fn has_work(&self) -> bool {
        !self.stale.is_empty()
            || !self.stale_markers.is_empty()
            || self.empties_a_field()
            || self.lanes.has_work()
    }

    /// Whether a field is found empty and only needs removing.
    fn empties_a_field(&self) -> bool {
        (self.has_pending && self.stale.is_empty() && self.keep.is_empty())
            || (self.has_settled && self.stale_markers.is_empty() && self.kept_markers.is_empty())
    }

    /// Whether the fold writes the counter: it adds something, or the
    /// counter is missing (and starts at 0).
    pub(crate) fn writes_counter(&self, counter: Option<&Bson>) -> bool {
        self.stale_amount != 0 || (counter.is_none() && self.has_work())
    }
}

/// Plans the fold of a document whose counter, pending, settled and lanes
/// fields are `counter`, `pending`, `settled` and `lanes` (`None`:
/// absent), at `cutoffs`: the tokens' fold ([`plan`]) and the lanes'
/// pruning ([`plan_lanes`]) together, as one statement writes them.
pub(crate) fn plan_document(
    counter: Option<&Bson>,
    pending: Option<&Bson>,
    settled: Option<&Bson>,
    lanes: Option<&Bson>,
    cutoffs: Cutoffs,
) -> Result<FoldPlan, Malformed> {
    let mut plan = plan(counter, pending, settled, cutoffs.tokens)?;
    plan.lanes = plan_lanes(lanes, cutoffs.lanes)?;
    Ok(plan)
}

/// Plans the fold of a document whose counter, pending and settled fields
/// are `counter`, `pending` and `settled` (`None`: absent), at `cutoff`: an
/// entry or marker is stale when its token sorts below the cutoff. Lanes
/// are left out ([`plan_document`] takes them in).
pub(crate) fn plan(
    counter: Option<&Bson>,
    pending: Option<&Bson>,
    settled: Option<&Bson>,
    cutoff: ObjectId,
) -> Result<FoldPlan, Malformed> {
    let entries = array(pending).map_err(Malformed::PendingNotArray)?;
    let parsed = entries
        .iter()
        .map(Entry::parse)
        .collect::<Result<Vec<Entry>, BadEntry>>()
        .map_err(Malformed::BadEntry)?;
    let markers = array(settled).map_err(Malformed::SettledNotArray)?;
    let marked = markers
        .iter()
        .map(marker_token)
        .collect::<Result<BTreeSet<ObjectId>, &'static str>>()
        .map_err(Malformed::BadMarker)?;

    let mut plan = FoldPlan {
        stale_tokens: 0,
        stale_amount: 0,
        duplicate_entries: 0,
        settled_copies: 0,
        oldest: parsed.iter().map(Entry::token).min(),
        counter: Bson::Null,
        stale: Vec::new(),
        keep: Vec::new(),
        stale_markers: Vec::new(),
        kept_markers: Vec::new(),
        has_pending: pending.is_some(),
        has_settled: settled.is_some(),
        lanes: LanePlan::default(),
    };
    // Each stale token: its amount and the index (in `plan.stale`) of its
    // last entry.
    let mut tokens: BTreeMap<ObjectId, (i64, usize)> = BTreeMap::new();
    for (position, (value, entry)) in entries.iter().zip(&parsed).enumerate() {
        let token = entry.token().object_id();
        if token >= cutoff {
            plan.keep.push(value.clone());
            continue;
        }
        let amount = entry.amount();
        let index = plan.stale.len();
        match tokens.get_mut(&token) {
            Some((first, _)) if *first != amount => {
                return Err(Malformed::ConflictingAmounts {
                    token: entry.token(),
                    first: *first,
                    second: amount,
                });
            }
            Some((_, last)) => *last = index,
            None => {
                tokens.insert(token, (amount, index));
            }
        }
        plan.stale.push(StaleEntry {
            position,
            value: value.clone(),
            token: entry.token(),
            adds: 0,
        });
    }
    let mut sum: i128 = 0;
    for (token, (amount, last)) in &tokens {
        if !marked.contains(token) {
            plan.stale_tokens += 1;
            sum += i128::from(*amount);
            plan.stale[*last].adds = *amount;
        }
    }
    for entry in &plan.stale {
        if marked.contains(&entry.token.object_id()) {
            plan.settled_copies += 1;
        } else if entry.adds == 0 {
            plan.duplicate_entries += 1;
        }
    }
    for (value, token) in markers.iter().zip(markers.iter().map(marker_token)) {
        if token.is_ok_and(|t| t < cutoff) {
            plan.stale_markers.push(value.clone());
        } else {
            plan.kept_markers.push(value.clone());
        }
    }
    // The counter's type is judged before the overflow.
    plan.counter = add(counter, sum)?;
    plan.stale_amount = i64::try_from(sum).map_err(|_| Malformed::Overflow)?;
    Ok(plan)
}

/// The elements of an array field (`None`: absent, no elements), or the
/// type the field has instead.
fn array(field: Option<&Bson>) -> Result<&[Bson], &'static str> {
    match field {
        None => Ok(&[]),
        Some(Bson::Array(values)) => Ok(values),
        Some(other) => Err(bson_type_name(other)),
    }
}

/// The token of a marker `{t: ObjectId, n: integer}` (exactly those two
/// fields), or what is wrong with it.
fn marker_token(value: &Bson) -> Result<ObjectId, &'static str> {
    let Bson::Document(marker) = value else {
        return Err("is not a document");
    };
    if marker.keys().any(|k| k != TOKEN_FIELD && k != AMOUNT_FIELD) {
        return Err("has a field other than `t` and `n`");
    }
    match (marker.get(TOKEN_FIELD), marker.get(AMOUNT_FIELD)) {
        (Some(Bson::ObjectId(t)), Some(Bson::Int32(_) | Bson::Int64(_))) => Ok(*t),
        (Some(Bson::ObjectId(_)), _) => Err("has no integer `n`"),
        _ => Err("has no ObjectId `t`"),
    }
}

/// The counter plus `sum`, keeping its type; an error when the counter is
/// not an integer or the result leaves its type's exact range (for a
/// double, also when `sum` does: the server adds it as a double).
pub(crate) fn add(counter: Option<&Bson>, sum: i128) -> Result<Bson, Malformed> {
    let long = |r: i128| i64::try_from(r).map_err(|_| Malformed::Overflow);
    match counter {
        None => Ok(Bson::Int64(long(sum)?)),
        Some(Bson::Int32(c)) => {
            let r = long(i128::from(*c) + sum)?;
            Ok(i32::try_from(r).map_or(Bson::Int64(r), Bson::Int32))
        }
        Some(Bson::Int64(c)) => Ok(Bson::Int64(long(i128::from(*c) + sum)?)),
        Some(Bson::Double(c)) if exact_double(*c) => {
            let r = *c as i128 + sum;
            // The server adds in doubles: the sum must be exact as one too.
            if r.abs() < EXACT_DOUBLE && sum.abs() < EXACT_DOUBLE {
                Ok(Bson::Double(r as f64))
            } else {
                Err(Malformed::Overflow)
            }
        }
        Some(other) => Err(Malformed::CounterNotInteger(bson_type_name(other))),
    }
}

/// Whether a double holds an integer of magnitude below 2^53.
fn exact_double(d: f64) -> bool {
    d.fract() == 0.0 && d.abs() < EXACT_DOUBLE as f64
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

    fn fold(counter: Option<Bson>, pending: Bson) -> Result<FoldPlan, Malformed> {
        plan(counter.as_ref(), Some(&pending), None, cutoff())
    }

    fn values(stale: &[StaleEntry]) -> Vec<Bson> {
        stale.iter().map(|e| e.value.clone()).collect()
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
        let plan = fold(Some(Bson::Int64(10)), pending).unwrap();
        assert_eq!(plan.stale_tokens, 3);
        assert_eq!(plan.stale_amount, 4);
        assert_eq!(plan.counter, Bson::Int64(14));
        assert_eq!(plan.keep, vec![Bson::ObjectId(fresh)]);
        assert_eq!(
            plan.stale.iter().map(|e| e.position).collect::<Vec<_>>(),
            [0, 1, 3]
        );
        assert!(plan.has_work());
    }

    #[test]
    fn counter_types_are_kept() {
        let pending = || Bson::Array(vec![Bson::ObjectId(at(3600))]);
        let counter = |c: Option<Bson>| fold(c, pending()).unwrap().counter;
        assert_eq!(counter(Some(Bson::Int32(1))), Bson::Int32(2));
        assert_eq!(counter(Some(Bson::Int32(i32::MAX))), Bson::Int64(1 << 31));
        assert_eq!(counter(Some(Bson::Double(4.0))), Bson::Double(5.0));
        assert_eq!(counter(None), Bson::Int64(1));
    }

    /// The server adds to a double counter in doubles: an amount of 2^53 or
    /// more is rounded before it is added, so the result is refused even
    /// when the exact one would fit — as step 2 refuses it.
    #[test]
    fn a_double_counter_is_refused_when_the_amount_is_not_exact_as_a_double() {
        let big = (1i64 << 53) + 1;
        let pending = Bson::Array(vec![Bson::Document(doc! { "t": at(3600), "n": big })]);
        let start = Bson::Double(-((1i64 << 53) - 1) as f64);
        assert_eq!(fold(Some(start), pending.clone()), Err(Malformed::Overflow));
        assert_eq!(
            fold(Some(Bson::Int64(-(1 << 53) + 1)), pending)
                .unwrap()
                .counter,
            Bson::Int64(2)
        );
    }

    /// One token, one count: the fold agrees with step 2, which counts a
    /// token once however many entries hold it (issue 11, item 6).
    #[test]
    fn repeated_entries_of_a_token_count_once() {
        let t = at(3600);
        let cases = [
            (vec![Bson::ObjectId(t), Bson::ObjectId(t)], 1),
            (
                vec![Bson::ObjectId(t), Bson::Document(doc! { "t": t, "n": 1 })],
                1,
            ),
            (
                vec![
                    Bson::Document(doc! { "t": t, "n": 5 }),
                    Bson::Document(doc! { "n": 5i64, "t": t }),
                ],
                5,
            ),
        ];
        for (entries, amount) in cases {
            let plan = fold(Some(Bson::Int64(0)), Bson::Array(entries.clone())).unwrap();
            assert_eq!(plan.counter, Bson::Int64(amount), "{entries:?}");
            assert_eq!((plan.stale_tokens, plan.duplicate_entries), (1, 1));
            assert_eq!(values(&plan.stale), entries, "every copy is removed");
        }
        let conflicting = Bson::Array(vec![
            Bson::Document(doc! { "t": t, "n": 5 }),
            Bson::Document(doc! { "t": t, "n": 3 }),
        ]);
        assert!(matches!(
            fold(Some(Bson::Int64(0)), conflicting),
            Err(Malformed::ConflictingAmounts {
                first: 5,
                second: 3,
                ..
            })
        ));
        // Fresh entries are a writer's business: kept as they are.
        let young = at(1);
        let fresh = Bson::Array(vec![
            Bson::Document(doc! { "t": young, "n": 5 }),
            Bson::Document(doc! { "t": young, "n": 3 }),
        ]);
        let plan = fold(Some(Bson::Int64(0)), fresh.clone()).unwrap();
        assert_eq!(Bson::Array(plan.keep), fresh);
    }

    /// A stale token with a marker was counted by a settle: its entries
    /// are dropped uncounted, the marker pruned; young markers stay.
    #[test]
    fn settled_tokens_are_dropped_and_old_markers_pruned() {
        let (settled, counted, young) = (at(3600), at(3700), at(2));
        let marker = |t: ObjectId, n: i64| Bson::Document(doc! { "t": t, "n": n });
        let pending = Bson::Array(vec![Bson::ObjectId(settled), Bson::ObjectId(counted)]);
        let markers = Bson::Array(vec![marker(settled, 1), marker(young, 4)]);
        let plan = plan(
            Some(&Bson::Int64(10)),
            Some(&pending),
            Some(&markers),
            cutoff(),
        )
        .unwrap();
        assert_eq!(plan.counter, Bson::Int64(11));
        assert_eq!((plan.stale_tokens, plan.settled_copies), (1, 1));
        assert_eq!(plan.stale.len(), 2);
        assert_eq!(plan.stale_markers, vec![marker(settled, 1)]);
        assert_eq!(plan.kept_markers, vec![marker(young, 4)]);

        // A document holding only old markers: they go, and with them the
        // field; the counter is not touched.
        let only = Bson::Array(vec![marker(at(4000), 2)]);
        let plan = super::plan(Some(&Bson::Int64(3)), None, Some(&only), cutoff()).unwrap();
        assert!(plan.has_work() && plan.kept_markers.is_empty());
        assert!(!plan.writes_counter(Some(&Bson::Int64(3))));
        assert_eq!(plan.counter, Bson::Int64(3));
    }

    #[test]
    fn empty_fields_are_work_and_nothing_else_is() {
        let empty = Bson::Array(Vec::new());
        let counter = Bson::Int64(1);
        let c = Some(&counter);
        assert!(plan(c, Some(&empty), None, cutoff()).unwrap().has_work());
        assert!(plan(c, None, Some(&empty), cutoff()).unwrap().has_work());
        assert!(!plan(c, None, None, cutoff()).unwrap().has_work());
        let fresh = Bson::Array(vec![Bson::ObjectId(at(1))]);
        assert!(!plan(c, Some(&fresh), None, cutoff()).unwrap().has_work());
        let young = Bson::Array(vec![Bson::Document(doc! { "t": at(1), "n": 1 })]);
        assert!(
            !plan(c, Some(&fresh), Some(&young), cutoff())
                .unwrap()
                .has_work()
        );
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
            (Some(Bson::Double(2f64.powi(53))), ok.clone()),
            (Some(Bson::Double(2f64.powi(53) - 1.0)), ok.clone()),
            (Some(Bson::Int64(i64::MAX)), ok),
        ];
        for (counter, pending) in cases {
            let result = fold(counter.clone(), pending.clone());
            assert!(
                result.is_err(),
                "{counter:?} {pending:?} must be malformed, got {result:?}"
            );
        }
        let folded = fold(
            Some(Bson::Double(2f64.powi(53) - 2.0)),
            Bson::Array(vec![stale]),
        );
        assert_eq!(folded.unwrap().counter, Bson::Double(2f64.powi(53) - 1.0));
    }

    #[test]
    fn every_malformed_marker() {
        let t = at(3600);
        let bad = [
            (Bson::Int32(1), "is not a document"),
            (Bson::ObjectId(t), "is not a document"),
            (Bson::Document(doc! { "t": t }), "has no integer `n`"),
            (
                Bson::Document(doc! { "t": t, "n": 1.0 }),
                "has no integer `n`",
            ),
            (Bson::Document(doc! { "n": 1 }), "has no ObjectId `t`"),
            (
                Bson::Document(doc! { "t": "x", "n": 1 }),
                "has no ObjectId `t`",
            ),
            (
                Bson::Document(doc! { "t": t, "n": 1, "at": 2 }),
                "has a field other than `t` and `n`",
            ),
        ];
        for (marker, why) in bad {
            let markers = Bson::Array(vec![marker.clone()]);
            assert_eq!(
                plan(Some(&Bson::Int64(0)), None, Some(&markers), cutoff()),
                Err(Malformed::BadMarker(why)),
                "{marker:?}"
            );
        }
        assert_eq!(
            plan(None, None, Some(&Bson::Int32(1)), cutoff()),
            Err(Malformed::SettledNotArray("int"))
        );
    }

    /// The stale amounts are summed exactly, in any order: only a total
    /// that does not fit is refused.
    #[test]
    fn the_sum_is_exact_whatever_the_entry_order() {
        let midway = Bson::Array(vec![
            entry(true, true, i64::MAX),
            entry(true, true, 1),
            entry(true, true, -1),
        ]);
        let folded = fold(Some(Bson::Int64(0)), midway).unwrap();
        assert_eq!(folded.counter, Bson::Int64(i64::MAX));
        let too_much = Bson::Array(vec![entry(true, true, i64::MAX), entry(true, true, 1)]);
        assert_eq!(
            fold(Some(Bson::Int64(0)), too_much.clone()),
            Err(Malformed::Overflow)
        );
        // A counter that is not an integer is named before an overflow.
        assert_eq!(
            fold(Some(Bson::String("7".into())), too_much),
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
        /// result again finds nothing to do.
        #[test]
        fn the_fold_is_exact_and_idempotent(
            start in -1_000_000i64..1_000_000,
            entries in proptest::collection::vec((any::<bool>(), any::<bool>(), 1i64..1000), 0..20),
        ) {
            let pending = Bson::Array(entries.iter().map(|(s, t, n)| entry(*s, *t, *n)).collect());
            let once = fold(Some(Bson::Int64(start)), pending).unwrap();
            let expected: i64 = entries.iter().filter(|e| e.0).map(|(_, t, n)| if *t { *n } else { 1 }).sum();
            prop_assert_eq!(once.stale_amount, expected);
            prop_assert_eq!(once.counter.clone(), Bson::Int64(start + expected));
            prop_assert_eq!(once.stale.len() + once.keep.len(), entries.len());
            let kept = Bson::Array(once.keep.clone());
            let left = (!once.keep.is_empty()).then_some(&kept);
            let again = plan(Some(&once.counter), left, None, cutoff()).unwrap();
            prop_assert!(!again.has_work());
            prop_assert_eq!(again.counter, once.counter);
        }

        /// A counter near the int64 limits is folded only when the result
        /// fits; otherwise the document is malformed, never wrapped.
        #[test]
        fn overflow_is_refused_never_wrapped(start in any::<i64>(), n in -1000i64..1000) {
            prop_assume!(n != 0);
            let pending = Bson::Array(vec![entry(true, true, n)]);
            match fold(Some(Bson::Int64(start)), pending) {
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
    type Generated = (Bson, i32, i64);

    /// The value of an entry of token `t` and amount `n` in one of the
    /// forms other clients write (`form` picks it; the bare form only for
    /// +1).
    fn entry_form(t: ObjectId, n: i64, form: u8) -> Bson {
        match form % 4 {
            0 if n == 1 => Bson::ObjectId(t),
            0 | 1 => Bson::Document(doc! { "t": t, "n": n }),
            2 => Bson::Document(doc! { "n": n, "t": t }),
            _ => match i32::try_from(n) {
                Ok(n32) => Bson::Document(doc! { "t": t, "n": n32 }),
                Err(_) => Bson::Document(doc! { "n": n, "t": t }),
            },
        }
    }

    fn valid_entry(amount: BoxedStrategy<i64>) -> impl Strategy<Value = Generated> {
        let rest = prop_oneof![1 => Just([0u8; 8]), 4 => any::<[u8; 8]>()];
        (-3i32..3, rest, amount, 0u8..4, any::<bool>()).prop_map(|(offset, rest, n, form, one)| {
            let n = if one { 1 } else { n };
            (entry_form(token_at(offset, rest), n, form), offset, n)
        })
    }

    /// Entries with distinct tokens (a repeated token is the subject of
    /// its own property).
    fn distinct_entries(
        amount: BoxedStrategy<i64>,
        len: std::ops::Range<usize>,
    ) -> impl Strategy<Value = Vec<Generated>> {
        proptest::collection::vec(valid_entry(amount), len).prop_map(|entries| {
            let mut seen = BTreeSet::new();
            entries
                .into_iter()
                .filter(|(v, _, _)| seen.insert(Entry::parse(v).unwrap().token()))
                .collect()
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

    /// What the stale entries add up to (the book's design/fold.md: entries of a second
    /// before the cutoff second), exactly.
    fn stale_sum(entries: &[Generated]) -> i128 {
        entries
            .iter()
            .filter(|(_, offset, _)| *offset < 0)
            .map(|(_, _, n)| i128::from(*n))
            .sum()
    }

    fn pending_of(entries: &[Generated]) -> Bson {
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

    fn fold_at(counter: Option<&Bson>, pending: &Bson) -> Result<FoldPlan, Malformed> {
        plan(counter, Some(pending), None, cutoff_at(CUTOFF_SECS))
    }

    proptest! {
        /// An int32 counter stays int32 while the result fits in an int32
        /// and is widened to int64 otherwise (as the server widens `$add`),
        /// and is refused as an overflow only when the exact result does not
        /// fit in an int64.
        #[test]
        fn an_int32_counter_stays_int32_while_it_fits(
            start in prop_oneof![any::<i32>(), Just(i32::MAX), Just(i32::MIN), -5i32..5],
            entries in distinct_entries(wide_amount(), 0..6),
        ) {
            let result = fold_at(Some(&Bson::Int32(start)), &pending_of(&entries));
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
            entries in distinct_entries(wide_amount(), 0..6),
        ) {
            let pending = pending_of(&entries);
            let missing = fold_at(None, &pending);
            match i64::try_from(stale_sum(&entries)) {
                Ok(sum) => {
                    let missing = missing.unwrap();
                    prop_assert_eq!(&missing.counter, &Bson::Int64(sum));
                    prop_assert_eq!(missing.stale_amount, sum);
                    let zero = fold_at(Some(&Bson::Int64(0)), &pending);
                    prop_assert_eq!(zero.unwrap(), missing);
                }
                Err(_) => prop_assert_eq!(missing, Err(Malformed::Overflow)),
            }
        }

        /// A double counter is folded only while it holds an integer of
        /// magnitude below 2^53 and the result stays below 2^53 (where
        /// doubles are exact), and stays a double; NaN, infinities,
        /// fractions and 2^53 itself are not integers here.
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
            entries in distinct_entries(small_amount(), 0..6),
        ) {
            const EXACT: i128 = 1 << 53;
            let result = fold_at(Some(&Bson::Double(start)), &pending_of(&entries));
            let integral = start.is_finite() && start.trunc() == start && (start.abs() as i128) < EXACT;
            if !integral {
                prop_assert_eq!(result, Err(Malformed::CounterNotInteger("double")));
            } else {
                let exact = start as i128 + stale_sum(&entries);
                if exact.abs() < EXACT {
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
            entries in distinct_entries(small_amount(), 0..8),
            bad in malformed_entry(),
            at in any::<proptest::sample::Index>(),
        ) {
            let mut values: Vec<Bson> = entries.iter().map(|(v, _, _)| v.clone()).collect();
            values.insert(at.index(values.len() + 1), bad.clone());
            let result = fold_at(counter.as_ref(), &Bson::Array(values));
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
            let result = fold_at(counter.as_ref(), &pending);
            prop_assert_eq!(result, Err(Malformed::PendingNotArray(type_name)));
        }

        /// The fold never touches an entry created in or after the cutoff
        /// second: the kept entries are exactly those, unchanged and in
        /// their order; the stale ones are removed, counted and summed; the
        /// oldest token is the smallest of all.
        #[test]
        fn the_fold_keeps_exactly_the_young_entries_in_order(
            counter in valid_counter(),
            entries in distinct_entries(small_amount(), 0..12),
        ) {
            let result = fold_at(counter.as_ref(), &pending_of(&entries)).unwrap();
            let (stale, young): (Vec<&Generated>, Vec<&Generated>) =
                entries.iter().partition(|(_, offset, _)| *offset < 0);
            let value = |e: &&Generated| e.0.clone();
            prop_assert_eq!(&result.keep, &young.iter().map(value).collect::<Vec<_>>());
            prop_assert_eq!(values(&result.stale), stale.iter().map(value).collect::<Vec<_>>());
            prop_assert_eq!(result.stale_tokens, stale.len() as u64);
            prop_assert_eq!(i128::from(result.stale_amount), stale_sum(&entries));
            let oldest = entries.iter().map(|(v, _, _)| Entry::parse(v).unwrap().token()).min();
            prop_assert_eq!(result.oldest, oldest);
        }

        /// One token, one count: repeating stale entries — in any of the
        /// forms, anywhere — changes neither the counter nor what stays;
        /// every copy is removed.
        #[test]
        fn repeating_a_stale_entry_in_any_form_counts_it_once(
            counter in valid_counter(),
            entries in distinct_entries(small_amount(), 1..8),
            repeats in proptest::collection::vec((any::<proptest::sample::Index>(), any::<proptest::sample::Index>(), 0u8..4), 1..6),
        ) {
            let once = fold_at(counter.as_ref(), &pending_of(&entries)).unwrap();
            let mut values: Vec<Bson> = entries.iter().map(|(v, _, _)| v.clone()).collect();
            for (which, at, form) in &repeats {
                let (value, offset, n) = which.get(&entries);
                if *offset < 0 {
                    let token = Entry::parse(value).unwrap().token().object_id();
                    values.insert(at.index(values.len() + 1), entry_form(token, *n, *form));
                }
            }
            let repeated = fold_at(counter.as_ref(), &Bson::Array(values.clone())).unwrap();
            prop_assert_eq!(&repeated.counter, &once.counter);
            prop_assert_eq!(repeated.stale_tokens, once.stale_tokens);
            prop_assert_eq!(&repeated.keep, &once.keep);
            prop_assert_eq!(repeated.stale.len() + repeated.keep.len(), values.len());
            prop_assert_eq!(
                repeated.duplicate_entries as usize,
                repeated.stale.len() - once.stale.len()
            );
        }

        /// Tokens with a marker are removed uncounted; the counter moves by
        /// exactly the unmarked stale tokens; markers older than the cutoff
        /// are pruned and the others kept in order.
        #[test]
        fn marked_tokens_are_dropped_and_old_markers_pruned(
            counter in valid_counter(),
            entries in distinct_entries(small_amount(), 0..8),
            marked in proptest::collection::vec(any::<bool>(), 8),
            others in proptest::collection::vec((-3i32..3, any::<[u8; 8]>(), 1i64..9), 0..4),
        ) {
            let mut markers = Vec::new();
            let mut unmarked = Vec::new();
            for ((value, offset, n), mark) in entries.iter().zip(&marked) {
                if *mark {
                    let t = Entry::parse(value).unwrap().token().object_id();
                    markers.push((Bson::Document(doc! { "t": t, "n": *n }), *offset));
                } else {
                    unmarked.push((value.clone(), *offset, *n));
                }
            }
            for (offset, rest, n) in &others {
                markers.push((Bson::Document(doc! { "t": token_at(*offset, *rest), "n": *n }), *offset));
            }
            let settled = Bson::Array(markers.iter().map(|(m, _)| m.clone()).collect());
            let with = plan(counter.as_ref(), Some(&pending_of(&entries)), Some(&settled), cutoff_at(CUTOFF_SECS)).unwrap();
            let without = fold_at(counter.as_ref(), &pending_of(&unmarked)).unwrap();
            prop_assert_eq!(&with.counter, &without.counter);
            prop_assert_eq!(with.stale_tokens, without.stale_tokens);
            let stale_marked = entries.iter().zip(&marked).filter(|((_, o, _), m)| **m && *o < 0).count();
            prop_assert_eq!(with.settled_copies as usize, stale_marked);
            let (old, young): (Vec<_>, Vec<_>) = markers.iter().partition(|(_, o)| *o < 0);
            prop_assert_eq!(with.stale_markers, old.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>());
            prop_assert_eq!(with.kept_markers, young.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>());
        }

        /// Every token's count sits on its last stale entry: removing any
        /// prefix of the stale entries with what they add never counts a
        /// token one of whose entries stays.
        #[test]
        fn a_tokens_count_sits_on_its_last_stale_entry(
            entries in distinct_entries(small_amount(), 1..8),
            repeats in proptest::collection::vec((any::<proptest::sample::Index>(), any::<proptest::sample::Index>()), 0..6),
        ) {
            let mut values: Vec<Bson> = entries.iter().map(|(v, _, _)| v.clone()).collect();
            for (which, at) in &repeats {
                let value = which.get(&values).clone();
                values.insert(at.index(values.len() + 1), value);
            }
            let plan = fold_at(Some(&Bson::Int64(0)), &Bson::Array(values)).unwrap();
            for cut in 0..=plan.stale.len() {
                let (removed, left) = plan.stale.split_at(cut);
                let token = |e: &StaleEntry| Entry::parse(&e.value).unwrap().token();
                let left_tokens: BTreeSet<Token> = left.iter().map(token).collect();
                for e in removed.iter().filter(|e| e.adds != 0) {
                    prop_assert!(!left_tokens.contains(&token(e)));
                }
            }
            prop_assert_eq!(plan.stale.iter().map(|e| e.adds).sum::<i64>(), plan.stale_amount);
        }
    }
}
