//! One document's fold as `update` statements, conditioned on exactly what
//! they remove (DESIGN §4, the per-document conditioned write).
//!
//! A statement applies only while the document still holds what the plan
//! removes, and leaves everything else a writer may have changed in the
//! meantime alone. A concurrent step 1 adds an entry, which the statement
//! keeps; a concurrent step 2 of another token removes one, which the
//! statement does not bring back; a concurrent step 2 (or another fold) that
//! took one of the stale entries makes the statement match nothing, and the
//! reconciler reads the document again. Running a statement twice applies it
//! once: afterwards the document no longer holds what it removes.
//!
//! Two forms, chosen per document by size:
//!
//! - **exact** (the usual one): the filter requires every stale value read
//!   (`{pending: {$all: [...]}}`) and the pipeline removes those values
//!   (`$filter` … `$in`). Its cost grows with *stale entries × entries*,
//!   which is nothing for the few entries a counter normally holds.
//! - **prefix**, for large arrays: writers only append to an array (step
//!   1, a settle's marker) or remove from it, so "the array still starts
//!   with what was read, up to the last stale entry" proves that every stale
//!   entry is there and no entry before it went away. The pipeline checks
//!   that (`$slice` and `$eq`, no per-entry expression) and rebuilds the
//!   array from the fresh entries read plus whatever was appended since.
//!   A document too large for one statement is split into several, each
//!   covering the next stretch of the array; they apply only in order, each
//!   counting the tokens whose last stale entry it removes, so any prefix of
//!   them that applied left a document the next run folds exactly.
//!
//! The counter is written with `$add` on the server, on top of whatever
//! step 2s added meanwhile. Its BSON type is pinned in the filter (the
//! plan's arithmetic depends on it); near the edge of its type's exact
//! range its value is pinned too, so a concurrent change cannot push the
//! sum past the edge unseen.

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use super::model::{self, FoldPlan, Malformed};
use crate::document::bson_type_name;
use crate::write::counter::{CollectionConfig, inc_operand};

/// The field the prefix form keeps its check in, removed again in the same
/// update. A counter document must not use it.
pub(crate) const WORK_FIELD: &str = "__tally_fold";

/// Above this many comparisons of array elements (stale values × array
/// length, for both arrays), a document is written in the prefix form.
const EXACT_FORM_LIMIT: usize = 4096;

/// The most bytes of array values one prefix statement carries; a larger
/// document is split. Far below the server's 16 MiB per statement, so that
/// a few fit in one command.
const CHUNK_BYTES: usize = 3 << 20;

/// Beyond this magnitude an integer counter's value is pinned as well as
/// its type (int64 overflows at 2^63).
const NEAR_LONG_LIMIT: i128 = 1 << 62;
/// Beyond this magnitude a double counter's value is pinned as well as its
/// type (doubles are exact below 2^53).
const NEAR_DOUBLE_LIMIT: i128 = 1 << 52;

/// One update statement (`{q, u}`) and its encoded size.
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    pub(crate) body: Document,
    pub(crate) bytes: usize,
}

/// What one document holds, as read: its `_id` and the three fields the
/// fold owns (`None`: absent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read<'a> {
    pub(crate) id: &'a Bson,
    pub(crate) counter: Option<&'a Bson>,
    pub(crate) pending: Option<&'a Bson>,
    pub(crate) settled: Option<&'a Bson>,
}

impl<'a> Read<'a> {
    /// The fields of `document` named by `spec`.
    pub(crate) fn of(document: &'a Document, spec: &CollectionConfig) -> Self {
        static NULL: Bson = Bson::Null;
        Self {
            id: document.get("_id").unwrap_or(&NULL),
            counter: document.get(&spec.counter_field),
            pending: document.get(&spec.pending_field),
            settled: document.get(&spec.settled_field),
        }
    }

    /// The model's plan for these fields at `cutoff`.
    pub(crate) fn plan(&self, cutoff: ObjectId) -> Result<FoldPlan, Malformed> {
        model::plan(self.counter, self.pending, self.settled, cutoff)
    }
}

/// The update statements (`{q, u}`, for the `updates` of an `update`
/// command, in order) that fold `document` — as read, with its `_id` and
/// the fields `spec` names — at `cutoff` (the
/// [`Token::cutoff`](crate::Token::cutoff) of the server's time minus the
/// grace). Empty when there is nothing to fold; an error, and no
/// statement, for a malformed document. For tools that fold documents
/// their own way; the reconciler sends the same statements.
pub fn statements(
    spec: &CollectionConfig,
    document: &Document,
    cutoff: ObjectId,
) -> Result<Vec<Document>, Malformed> {
    let read = Read::of(document, spec);
    let plan = read.plan(cutoff)?;
    Ok(build(spec, &read, &plan)
        .into_iter()
        .map(|s| s.body)
        .collect())
}

/// The statements of a document `read` that `plan` (its plan) says has
/// work.
pub(crate) fn build(spec: &CollectionConfig, read: &Read<'_>, plan: &FoldPlan) -> Vec<Statement> {
    if !plan.has_work() {
        return Vec::new();
    }
    let pending = elements(read.pending);
    let settled = elements(read.settled);
    let comparisons = plan.stale.len() * pending.len() + plan.stale_markers.len() * settled.len();
    let bodies = if comparisons <= EXACT_FORM_LIMIT {
        vec![exact(spec, read, plan)]
    } else {
        prefix(spec, read, plan, pending, settled)
    };
    bodies
        .into_iter()
        .map(|body| Statement {
            bytes: encoded_len(&body),
            body,
        })
        .collect()
}

fn elements(field: Option<&Bson>) -> &[Bson] {
    match field {
        Some(Bson::Array(values)) => values,
        _ => &[],
    }
}

fn encoded_len(document: &Document) -> usize {
    // A `Document` always encodes: its keys hold no NUL.
    document.to_vec().map_or(0, |bytes| bytes.len())
}

fn field(name: &str) -> String {
    format!("${name}")
}

/// The exact form: `$all` of the stale values in the filter, `$in` in the
/// pipeline.
fn exact(spec: &CollectionConfig, read: &Read<'_>, plan: &FoldPlan) -> Document {
    let mut q = doc! { "_id": read.id.clone() };
    let mut set = Document::new();
    if plan.writes_counter(read.counter) {
        q.extend(pin(spec, read.counter, plan.stale_amount));
        set.insert(
            &spec.counter_field,
            counter(spec, read.counter, plan.stale_amount),
        );
    }
    if touches(
        plan.has_pending,
        plan.stale.is_empty(),
        plan.keep.is_empty(),
    ) {
        let removed: Vec<Bson> = plan.stale.iter().map(|e| e.value.clone()).collect();
        if !removed.is_empty() {
            q.insert(&spec.pending_field, doc! { "$all": removed.clone() });
        }
        set.insert(&spec.pending_field, without(&spec.pending_field, removed));
    }
    if touches(
        plan.has_settled,
        plan.stale_markers.is_empty(),
        plan.kept_markers.is_empty(),
    ) {
        let pruned = plan.stale_markers.clone();
        set.insert(&spec.settled_field, without(&spec.settled_field, pruned));
    }
    doc! { "q": q, "u": [{ "$set": set }] }
}

/// Whether the fold rewrites an array field: it exists, and something in
/// it is stale or it is empty.
fn touches(exists: bool, nothing_stale: bool, nothing_kept: bool) -> bool {
    exists && (!nothing_stale || nothing_kept)
}

/// The array field `name` without the values `removed`, or `$$REMOVE`
/// when nothing is left.
fn without(name: &str, removed: Vec<Bson>) -> Document {
    let rest = doc! {
        "$filter": {
            "input": { "$ifNull": [field(name), []] },
            "cond": { "$not": [{ "$in": ["$$this", { "$literal": removed }] }] },
        }
    };
    or_remove(rest.into())
}

/// `array`, or `$$REMOVE` when it is empty.
fn or_remove(array: Bson) -> Document {
    doc! {
        "$let": {
            "vars": { "rest": array },
            "in": { "$cond": [{ "$eq": [{ "$size": "$$rest" }, 0] }, "$$REMOVE", "$$rest"] },
        }
    }
}

/// The counter plus `sum`, on the server, keeping its type as the model
/// does (`before`: the counter's value when the statement applies).
fn counter(spec: &CollectionConfig, before: Option<&Bson>, sum: i64) -> Bson {
    let current = field(&spec.counter_field);
    let operand = inc_operand(sum);
    let added = doc! { "$add": [{ "$ifNull": [current.as_str(), 0i64] }, operand.clone()] };
    match (before, operand) {
        // int32 + int64 is an int64 on the server; the model keeps an int32
        // counter int32 while the result fits.
        (Some(Bson::Int32(_)), Bson::Int64(_)) => Bson::Document(doc! {
            "$let": {
                "vars": { "r": added },
                "in": { "$cond": [
                    { "$and": [{ "$gte": ["$$r", i32::MIN] }, { "$lte": ["$$r", i32::MAX] }] },
                    { "$toInt": "$$r" },
                    "$$r",
                ]},
            }
        }),
        _ => Bson::Document(added),
    }
}

/// The filter conditions pinning the counter `before` (its value when the
/// statement applies) for adding `sum`: its absence, its type, and near the
/// edge of its type's exact range its value too.
fn pin(spec: &CollectionConfig, before: Option<&Bson>, sum: i64) -> Document {
    let name = spec.counter_field.as_str();
    let Some(value) = before else {
        return doc! { name: { "$exists": false } };
    };
    let mut condition = doc! { "$type": bson_type_name(value) };
    let magnitude = |v: &Bson| match v {
        Bson::Int32(n) => i128::from(*n).abs(),
        Bson::Int64(n) => i128::from(*n).abs(),
        Bson::Double(d) => d.abs() as i128,
        _ => 0,
    };
    let limit = match value {
        Bson::Double(_) => NEAR_DOUBLE_LIMIT,
        _ => NEAR_LONG_LIMIT,
    };
    let after = model::add(Some(value), i128::from(sum)).ok();
    let near = magnitude(value) >= limit || after.is_none_or(|a| magnitude(&a) >= limit);
    if near {
        condition.insert("$eq", value.clone());
    }
    doc! { name: condition }
}

/// The prefix form: statements covering the pending array up to its last
/// stale entry in stretches of at most [`CHUNK_BYTES`]; the last one also
/// prunes the markers and removes emptied fields.
fn prefix(
    spec: &CollectionConfig,
    read: &Read<'_>,
    plan: &FoldPlan,
    pending: &[Bson],
    settled: &[Bson],
) -> Vec<Document> {
    let end = plan.stale.last().map_or(0, |e| e.position + 1);
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (position, value) in pending[..end].iter().enumerate() {
        let size = value_len(value);
        if position > start && bytes + size > CHUNK_BYTES {
            chunks.push(start..position);
            (start, bytes) = (position, 0);
        }
        bytes += size;
    }
    if end > start || chunks.is_empty() {
        chunks.push(start..end);
    }
    // What removing each position up to `end` adds (`None`: it is fresh).
    let mut adds: Vec<Option<i64>> = vec![None; end];
    for e in &plan.stale {
        adds[e.position] = Some(e.adds);
    }
    let mut before = read.counter.cloned();
    let mut kept_before = 0;
    let last = chunks.len() - 1;
    let mut statements = Vec::with_capacity(chunks.len());
    for (i, range) in chunks.into_iter().enumerate() {
        let sum: i64 = adds[range.clone()].iter().flatten().sum();
        let kept: Vec<Bson> = range
            .clone()
            .filter(|p| adds[*p].is_none())
            .map(|p| pending[p].clone())
            .collect();
        let mut q = doc! { "_id": read.id.clone() };
        let mut checks = Vec::new();
        let mut set = Document::new();
        let writes_counter = sum != 0 || before.is_none();
        if writes_counter {
            q.extend(pin(spec, before.as_ref(), sum));
            set.insert(&spec.counter_field, counter(spec, before.as_ref(), sum));
        }
        if !range.is_empty() {
            let (check, rewritten) = rewrite(
                &spec.pending_field,
                kept_before,
                &pending[range.clone()],
                &kept,
            );
            checks.push(check);
            set.insert(&spec.pending_field, rewritten);
        } else if touches(plan.has_pending, true, plan.keep.is_empty()) {
            set.insert(
                &spec.pending_field,
                without(&spec.pending_field, Vec::new()),
            );
        }
        if i == last
            && touches(
                plan.has_settled,
                plan.stale_markers.is_empty(),
                plan.kept_markers.is_empty(),
            )
        {
            if settled.is_empty() {
                set.insert(
                    &spec.settled_field,
                    without(&spec.settled_field, Vec::new()),
                );
            } else {
                let (check, rewritten) =
                    rewrite(&spec.settled_field, 0, settled, &plan.kept_markers);
                checks.push(check);
                set.insert(&spec.settled_field, rewritten);
            }
        }
        statements.push(guarded(q, checks, set));
        kept_before += kept.len();
        before = model::add(before.as_ref(), i128::from(sum)).ok();
    }
    statements
}

/// For the array field `name` whose elements from `offset` on should be
/// `read`: the check that they are, and the array with them replaced by
/// `kept` (or `$$REMOVE` when that leaves nothing).
fn rewrite(name: &str, offset: usize, read: &[Bson], kept: &[Bson]) -> (Document, Document) {
    let array = doc! { "$ifNull": [field(name), []] };
    let check = doc! {
        "$eq": [
            { "$slice": [array.clone(), to_i32(offset), to_i32(read.len())] },
            { "$literal": read.to_vec() },
        ]
    };
    let mut parts = Vec::new();
    if offset > 0 {
        parts.push(Bson::Document(
            doc! { "$slice": [array.clone(), 0, to_i32(offset)] },
        ));
    }
    parts.push(Bson::Document(doc! { "$literal": kept.to_vec() }));
    parts.push(Bson::Document(
        doc! { "$slice": [array, to_i32(offset + read.len()), i32::MAX] },
    ));
    (check, or_remove(doc! { "$concatArrays": parts }.into()))
}

fn to_i32(n: usize) -> i32 {
    // An array in a 16 MiB document has fewer than 2^31 elements.
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// A statement whose `set` applies only when every check holds: the checks
/// go into the work field, each field is set conditionally, then the work
/// field is removed. A document whose checks fail is left as it was (and
/// not counted as modified).
fn guarded(q: Document, checks: Vec<Document>, set: Document) -> Document {
    let work = field(WORK_FIELD);
    let conditional: Document = set
        .into_iter()
        .map(|(name, value)| {
            let unchanged = field(&name);
            (
                name,
                Bson::Document(doc! { "$cond": [work.as_str(), value, unchanged] }),
            )
        })
        .collect();
    doc! {
        "q": q,
        "u": [
            { "$set": { WORK_FIELD: { "$and": checks } } },
            { "$set": conditional },
            { "$unset": WORK_FIELD },
        ],
    }
}

/// Roughly what `value` takes as an array element (type byte, index key,
/// value).
fn value_len(value: &Bson) -> usize {
    const ELEMENT_OVERHEAD: usize = 8;
    ELEMENT_OVERHEAD
        + match value {
            Bson::ObjectId(_) => 12,
            Bson::Document(d) => encoded_len(d),
            _ => 16,
        }
}
