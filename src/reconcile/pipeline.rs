//! The fold as a server-side update pipeline.
//!
//! [`fold`] reads a counter document's pending array in a single pass, on
//! the document as it is when the update reaches it: it adds the entries
//! older than the cutoff to the counter and keeps the others, or — if the
//! document is malformed, or has nothing stale — leaves it exactly as it is.
//! It folds a document that changed (or broke) since anyone looked at it,
//! judged on its current state, which is what makes it safe for documents
//! writers are busy with. The cutoff is a value computed by tally, never
//! `$$NOW`.
//!
//! [`fold`] is public so the same pipeline can be run from other tools (or
//! printed and pasted into a shell) with a cutoff of one's choosing; its
//! arithmetic is specified by [`super::model`] and tested against it.

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use crate::write::counter::CollectionConfig;

/// The field the fold's pipeline uses for its intermediate result; removed
/// again in the same update. A counter document must not use it.
pub(crate) const WORK_FIELD: &str = "__tally_fold";

/// Doubles hold integers exactly up to 2^53.
const EXACT_DOUBLE: f64 = 9_007_199_254_740_992.0;

/// The reasons the pipeline leaves a document alone, as it records them in
/// its work field.
pub(crate) mod why {
    /// `pending` exists but is not an array.
    pub(crate) const PENDING_NOT_ARRAY: &str = "pending_not_array";
    /// Some entry is neither an ObjectId nor `{t: ObjectId, n: int}`.
    pub(crate) const BAD_ENTRY: &str = "bad_entry";
    /// The counter is not an integer (int32, int64, or an integral double).
    pub(crate) const COUNTER_NOT_INTEGER: &str = "counter_not_integer";
    /// Adding the stale entries would overflow the counter.
    pub(crate) const OVERFLOW: &str = "overflow";
}

fn field(name: &str) -> String {
    format!("${name}")
}

/// Whether `value` (an expression) is a valid `{t: ObjectId, n: int}` entry:
/// exactly two fields, an ObjectId token, a non-zero integer amount.
fn is_tagged_entry(value: &str) -> Bson {
    // `$objectToArray` fails on non-documents: only reach it for documents.
    Bson::Document(doc! {
        "$cond": [
            { "$eq": [{ "$type": value }, "object"] },
            { "$and": [
                { "$eq": [{ "$type": format!("{value}.t") }, "objectId"] },
                { "$in": [{ "$type": format!("{value}.n") }, ["int", "long"]] },
                { "$ne": [format!("{value}.n"), 0] },
                { "$eq": [{ "$size": { "$objectToArray": value } }, 2] },
            ]},
            false,
        ]
    })
}

/// The single-pass summary of a document's pending entries:
/// `{bad, n, s, oldest, keep}` — malformed entries, stale entries, their sum
/// (int64), the oldest valid token (or null), and the entries that stay.
/// `null` when the field is not an array.
fn summary(spec: &CollectionConfig, cutoff: ObjectId) -> Bson {
    let pending = field(&spec.pending_field);
    let oldest = doc! {
        "$cond": [
            { "$or": [{ "$eq": ["$$value.oldest", null] }, { "$lt": ["$$tok", "$$value.oldest"] }] },
            "$$tok",
            "$$value.oldest",
        ]
    };
    let stale = doc! {
        "bad": "$$value.bad",
        "n": { "$add": ["$$value.n", 1] },
        "s": { "$add": ["$$value.s", "$$amt"] },
        "oldest": oldest.clone(),
        "keep": "$$value.keep",
    };
    let fresh = doc! {
        "bad": "$$value.bad",
        "n": "$$value.n",
        "s": "$$value.s",
        "oldest": oldest,
        "keep": { "$concatArrays": ["$$value.keep", ["$$this"]] },
    };
    let bad = doc! {
        "bad": { "$add": ["$$value.bad", 1] },
        "n": "$$value.n",
        "s": "$$value.s",
        "oldest": "$$value.oldest",
        "keep": "$$value.keep",
    };
    let initial = doc! { "bad": 0, "n": 0, "s": 0i64, "oldest": null, "keep": [] };
    let step = doc! {
        "$let": {
            "vars": {
                "bare": { "$eq": [{ "$type": "$$this" }, "objectId"] },
                "tagged": is_tagged_entry("$$this"),
            },
            "in": {
                "$cond": [
                    { "$or": ["$$bare", "$$tagged"] },
                    { "$let": {
                        "vars": {
                            "tok": { "$cond": ["$$bare", "$$this", "$$this.t"] },
                            "amt": { "$cond": ["$$bare", 1, "$$this.n"] },
                        },
                        "in": { "$cond": [{ "$lt": ["$$tok", cutoff] }, stale, fresh] },
                    }},
                    bad,
                ]
            }
        }
    };
    Bson::Document(doc! {
        "$cond": [
            { "$isArray": pending.as_str() },
            { "$reduce": { "input": pending.as_str(), "initialValue": initial, "in": step } },
            null,
        ]
    })
}

/// The counter after adding `sum` (an expression), keeping its type: int32
/// stays int32 while the result fits (the server widens it to int64
/// otherwise), int64 stays int64, a missing counter counts from 0. `null`
/// for a counter that is not a number, where `$add` would fail the whole
/// update.
fn new_counter(spec: &CollectionConfig, sum: &str) -> Bson {
    let counter = field(&spec.counter_field);
    let counter_type = doc! { "$type": counter.as_str() };
    let added = doc! { "$add": [{ "$ifNull": [counter.as_str(), 0i64] }, sum] };
    let keep_int = doc! {
        "$let": {
            "vars": { "r": { "$add": [counter.as_str(), sum] } },
            "in": { "$cond": [
                { "$and": [{ "$lte": ["$$r", i32::MAX] }, { "$gte": ["$$r", i32::MIN] }] },
                { "$toInt": "$$r" },
                "$$r",
            ]},
        }
    };
    Bson::Document(doc! {
        "$switch": {
            "branches": [
                { "case": { "$eq": [counter_type.clone(), "int"] }, "then": keep_int },
                { "case": { "$in": [counter_type, ["long", "double", "missing"]] }, "then": added },
            ],
            "default": null,
        }
    })
}

/// Why the document cannot be folded, or `null`, given `summary` and
/// `result` (the new counter) as expressions. Checked in this order:
/// pending not an array, a bad entry, a counter that is not an integer, an
/// overflow.
fn reason(spec: &CollectionConfig, summary: &str, result: &str) -> Bson {
    let counter = field(&spec.counter_field);
    let counter_type = doc! { "$type": counter.as_str() };
    let integral_double = doc! {
        "$and": [
            { "$eq": [counter_type.clone(), "double"] },
            // NaN equals NaN in MQL and sorts below every number: exclude it.
            { "$ne": [counter.as_str(), f64::NAN] },
            { "$eq": [{ "$trunc": counter.as_str() }, counter.as_str()] },
            { "$lte": [{ "$abs": counter.as_str() }, EXACT_DOUBLE] },
        ]
    };
    let counter_ok = doc! {
        "$or": [
            { "$in": [counter_type.clone(), ["int", "long", "missing"]] },
            integral_double,
        ]
    };
    // An int64 sum that overflowed turned into a double; so did an int64
    // counter plus the sum. A double counter must stay within 2^53, judged
    // on the exact int64 sum: the double result may have been rounded into
    // range.
    let exact_double_result = doc! {
        "$let": {
            "vars": { "r": { "$add": [{ "$toLong": counter.as_str() }, format!("{summary}.s")] } },
            "in": { "$and": [
                { "$eq": [{ "$type": "$$r" }, "long"] },
                { "$lte": ["$$r", EXACT_DOUBLE as i64] },
                { "$gte": ["$$r", -(EXACT_DOUBLE as i64)] },
            ]},
        }
    };
    let fits = doc! {
        "$and": [
            { "$in": [{ "$type": format!("{summary}.s") }, ["int", "long"]] },
            { "$cond": [
                { "$eq": [counter_type, "double"] },
                exact_double_result,
                { "$in": [{ "$type": result }, ["int", "long"]] },
            ]},
        ]
    };
    Bson::Document(doc! {
        "$switch": {
            "branches": [
                { "case": { "$eq": [summary, null] }, "then": why::PENDING_NOT_ARRAY },
                { "case": { "$gt": [format!("{summary}.bad"), 0] }, "then": why::BAD_ENTRY },
                { "case": { "$not": [counter_ok] }, "then": why::COUNTER_NOT_INTEGER },
                { "case": { "$not": [fits] }, "then": why::OVERFLOW },
            ],
            "default": null,
        }
    })
}

/// The fold as an update pipeline: on the document as it is when the update
/// runs, add the stale entries to the counter and keep the rest, removing
/// the field when nothing is left — or, if the document is malformed or has
/// nothing stale, leave it exactly as it is.
pub fn fold(spec: &CollectionConfig, cutoff: ObjectId) -> Vec<Document> {
    let work = format!("${WORK_FIELD}");
    let summary_of = format!("{work}.f");
    let result_of = format!("{work}.c");
    // Write only a well-formed document with something to fold: anything
    // else stays exactly as it is (and is not counted as modified).
    let ok = doc! {
        "$and": [
            { "$eq": [format!("{work}.why"), null] },
            { "$gt": [format!("{summary_of}.n"), 0] },
        ]
    };
    vec![
        doc! { "$set": { WORK_FIELD: { "f": summary(spec, cutoff) } } },
        doc! { "$set": { format!("{WORK_FIELD}.c"): new_counter(spec, &format!("{summary_of}.s")) } },
        doc! { "$set": { format!("{WORK_FIELD}.why"): reason(spec, &summary_of, &result_of) } },
        doc! { "$set": {
            &spec.counter_field: { "$cond": [ok.clone(), result_of.as_str(), field(&spec.counter_field)] },
            &spec.pending_field: { "$cond": [
                ok,
                { "$cond": [
                    { "$eq": [{ "$size": format!("{summary_of}.keep") }, 0] },
                    "$$REMOVE",
                    format!("{summary_of}.keep"),
                ]},
                field(&spec.pending_field),
            ]},
        }},
        doc! { "$unset": WORK_FIELD },
    ]
}
