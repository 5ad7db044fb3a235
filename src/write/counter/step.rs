//! The two steps of an increment as the server sees them: each step's
//! filter and update, built from the collection's field names.
//!
//! Step 2 is an update pipeline rather than `$pull` + `$inc`, for two
//! reasons: it removes the pending field with its last entry (so a sparse
//! index on it, and the fold's report, skip every counter with nothing
//! pending), and it removes *every* entry of the token however many copies
//! the array holds, counting it once — the same rule as the fold's.

use mongodb::bson::{Bson, Document, doc};

use super::CollectionConfig;
use crate::document::EXACT_DOUBLE;
use crate::token::{Entry, TOKEN_FIELD};
use crate::write::at::by_id;

/// Who sends a step: the increment itself, or a settle (`complete`,
/// `resume`), which leaves a marker of the token it counted and never
/// counts a token that has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum By {
    /// [`Counters::increment`](super::Counters::increment), whose ticket is
    /// still in hand.
    Increment,
    /// `complete` or `resume`: a ticket that may be settled again, by
    /// anyone.
    Settle,
}

/// Step 1: `$addToSet` the entry, creating the counter document (counting
/// from int64 0) if needed. A settle's step 1 applies only while the
/// document has no marker for the token: once a settle counted it, re-adding
/// it would make it pending again. Neither applies to a counter the amount
/// would take past the int64 limit ([`int64_room`]): step 2 could never
/// count it. Returns the filter and the update.
pub(super) fn add(
    spec: &CollectionConfig,
    key: &Bson,
    entry: &Entry,
    by: By,
) -> (Document, Document) {
    let mut filter = by_id("_id", key);
    filter.insert(&spec.counter_field, int64_room(entry.amount()));
    if by == By::Settle {
        filter.insert(marker_path(spec), doc! { "$ne": entry.token().object_id() });
    }
    let update = doc! {
        "$addToSet": { &spec.pending_field: entry.to_bson() },
        "$setOnInsert": { &spec.counter_field: 0i64 },
    };
    (filter, update)
}

/// Step 2: conditioned on the entry being pending (and, for a settle, on the
/// token having no marker), adds its amount to the counter, removes every
/// entry of the token — and the pending field with the last one — and, for
/// a settle, appends the token's marker. Returns the filter and the
/// pipeline.
pub(super) fn count(
    spec: &CollectionConfig,
    key: &Bson,
    entry: &Entry,
    by: By,
) -> (Document, Vec<Document>) {
    let token = entry.token().object_id();
    let mut filter = by_id("_id", key);
    filter.insert(&spec.pending_field, entry.array_condition());
    let mut set = doc! {
        &spec.counter_field: counter_plus(&spec.counter_field, entry.amount()),
        &spec.pending_field: {
            "$let": {
                "vars": { "rest": {
                    "$filter": {
                        "input": field(&spec.pending_field),
                        "cond": { "$and": [
                            { "$ne": ["$$this", token] },
                            { "$ne": [format!("$$this.{TOKEN_FIELD}"), token] },
                        ] },
                    },
                } },
                "in": { "$cond": [{ "$eq": [{ "$size": "$$rest" }, 0] }, "$$REMOVE", "$$rest"] },
            },
        },
    };
    if by == By::Settle {
        filter.insert(marker_path(spec), doc! { "$ne": token });
        set.insert(
            &spec.settled_field,
            doc! { "$concatArrays": [
                { "$ifNull": [field(&spec.settled_field), []] },
                { "$literal": [entry.marker()] },
            ] },
        );
    }
    (filter, vec![doc! { "$set": set }])
}

/// A condition on the counter: it can take `amount` without passing the
/// int64 limit (`$not` so that a missing counter, which counts from 0,
/// matches). One condition on the counter's own path, off the hot path's
/// `_id` lookup; a counter it refuses makes step 1's upsert collide on
/// `_id`, and the document read then says why.
pub(crate) fn int64_room(amount: i64) -> Document {
    if amount > 0 {
        doc! { "$not": { "$gt": i64::MAX - amount } }
    } else {
        doc! { "$not": { "$lt": i64::MIN - amount } }
    }
}

/// `counter + amount` as `$inc` would compute it: a missing counter counts
/// from int64 0, integers keep their type while the sum fits (int32 widens
/// to int64), doubles and decimals stay what they are. Where `$inc` fails —
/// a counter that is not a number, an int64 that would overflow (`$add`
/// would quietly return a double) — the expression fails too: converting
/// `"not a count: <type>"` to a number is a `ConversionFailure`, and the
/// update writes nothing. A double counter fails the same way unless it and
/// the sum are integers of magnitude below 2^53 — the fold's rule — since
/// past that a double cannot hold the sum and the count would be rounded
/// away.
fn counter_plus(counter_field: &str, amount: i64) -> Document {
    let counter = field(counter_field);
    let counter_type = doc! { "$type": &counter };
    let stays_exact = doc! { "$and": [
        exact_as_double(&counter),
        exact_as_double("$$sum"),
        // The amount becomes a double too: it must be exact as one.
        i128::from(amount).abs() < EXACT_DOUBLE,
    ] };
    let refused = doc! { "$switch": {
        "branches": [
            {
                "case": { "$not": [{ "$in": [&counter_type, ["int", "long", "double", "decimal", "missing"]] }] },
                "then": true,
            },
            { "case": { "$eq": [&counter_type, "double"] }, "then": { "$not": [stays_exact] } },
        ],
        "default": { "$eq": [{ "$type": "$$sum" }, "double"] },
    } };
    doc! {
        "$let": {
            "vars": { "sum": { "$add": [{ "$ifNull": [&counter, 0i64] }, inc_operand(amount)] } },
            "in": { "$cond": [
                refused,
                // Not constant, so the server cannot fold it (and fail)
                // before it knows which branch is taken.
                { "$toLong": { "$concat": ["not a count: ", &counter_type] } },
                "$$sum",
            ] },
        },
    }
}

/// Whether the number `value` (an aggregation expression) is an integer a
/// double holds exactly: integral, of magnitude below 2^53. NaN (which
/// sorts below every number) and the infinities are not.
pub(crate) fn exact_as_double(value: impl Into<Bson>) -> Document {
    let value = value.into();
    let exact = EXACT_DOUBLE as f64;
    doc! { "$and": [
        { "$eq": [&value, { "$trunc": &value }] },
        { "$gt": [&value, -exact] },
        { "$lt": [&value, exact] },
    ] }
}

/// The `$inc` (or `$add`) operand for an amount: int32 when it fits, so an
/// int32 counter stays int32 (widened to int64 on overflow, never to a
/// double), int64 otherwise.
pub(crate) fn inc_operand(amount: i64) -> Bson {
    match i32::try_from(amount) {
        Ok(small) => Bson::Int32(small),
        Err(_) => Bson::Int64(amount),
    }
}

/// `<settled>.t`: the tokens of the markers, for a filter.
pub(crate) fn marker_path(spec: &CollectionConfig) -> String {
    format!("{}.{TOKEN_FIELD}", spec.settled_field)
}

/// `$<name>`: a field's value in an aggregation expression.
fn field(name: &str) -> String {
    format!("${name}")
}
