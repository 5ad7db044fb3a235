//! One document's fold as `update` statements, conditioned on exactly what
//! they remove (the book: design/fold.md, the statements).
//!
//! A statement applies only while the document still holds what the plan
//! removes and none of the tokens it counts has a settle marker, and
//! leaves everything else a writer may have changed in the meantime alone.
//! A concurrent step 1 adds an entry, which the statement keeps; a
//! concurrent step 2 of another token removes one, which the statement does
//! not bring back; a concurrent step 2 (or another fold) that took one of
//! the stale entries makes the statement match nothing, and the reconciler
//! reads the document again; so does a settle that counted one of them (its
//! marker), even when a late step 1 re-added the token.
//! Running a statement twice applies it once: afterwards the document no
//! longer holds what it removes.
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
//!   covering the next stretch of the array and counting the tokens whose
//!   last stale entry it removes. They apply only in order: each after the
//!   first also requires that every entry before its stretch is fresh (the
//!   earlier ones removed their stale entries; one `$min` over the tokens,
//!   a constant number of bytes), so any prefix of them that applied left a
//!   document the next run folds exactly.
//!
//! Expired lanes are pruned by the same statement (the last one, when
//! split): the filter pins each removed entry's value as read
//! (`{"lanes.<L>": s}`), so a write to that lane since the read makes the
//! statement match nothing and the document is read again; an entry added
//! since is not among those removed and stays.
//!
//! The counter is written with `$add` on the server, on top of whatever
//! step 2s added meanwhile. Its BSON type is pinned in the filter (the
//! plan's arithmetic depends on it), and the pipeline checks that the sum
//! stays exact in that type, so a concurrent change cannot push it past the
//! edge unseen (`$add` would return a double for an int64 overflow).

use std::ops::Range;

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

#[cfg(test)]
use super::model::Cutoffs;
use super::model::{self, FoldPlan, LanePlan, Lines, Malformed, StaleEntry};
use crate::document::bson_type_name;
use crate::token::{Entry, TOKEN_FIELD};
use crate::write::counter::{CollectionConfig, exact_as_double, inc_operand, marker_path};

/// The field a statement keeps its checks in (the prefix form's, and the
/// counter's), removed again in the same update. A counter document must
/// not use it.
pub(crate) const WORK_FIELD: &str = "__tally_fold";

/// Above this many comparisons of array elements (stale values × array
/// length, for both arrays), a document is written in the prefix form.
const EXACT_FORM_LIMIT: usize = 4096;

/// The most bytes of array values one prefix statement carries; a larger
/// document is split. Far below the server's 16 MiB per statement, so that
/// a few fit in one command.
const CHUNK_BYTES: usize = 3 << 20;

/// One update statement (`{q, u}`) and its encoded size.
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    pub(crate) body: Document,
    pub(crate) bytes: usize,
}

/// What one document holds, as read: its `_id` and the four fields the
/// fold owns (`None`: absent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read<'a> {
    pub(crate) id: &'a Bson,
    pub(crate) counter: Option<&'a Bson>,
    pub(crate) pending: Option<&'a Bson>,
    pub(crate) settled: Option<&'a Bson>,
    pub(crate) lanes: Option<&'a Bson>,
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
            lanes: document.get(&spec.lanes_field),
        }
    }

    /// The model's plan for these fields at `lines` — refused as an
    /// overflow, too, when the document is folded by several statements
    /// and one of them could not add its share exactly (only amounts near
    /// the edge of the counter's type can do that).
    pub(crate) fn plan(&self, lines: &Lines) -> Result<FoldPlan, Malformed> {
        let (counter, pending, settled) = (self.counter, self.pending, self.settled);
        let plan = model::plan_document(counter, pending, settled, self.lanes, lines.cutoffs)?;
        if prefix_form(self, &plan) {
            pieces(self, &plan)?;
        }
        Ok(plan)
    }
}

/// The update statements (`{q, u}`, for the `updates` of an `update`
/// command, in order) that fold `document` — as read, with its `_id` and
/// the fields `spec` names — at `cutoffs` (each the
/// [`Token::cutoff`](crate::Token::cutoff) of the server's time minus the
/// grace, and minus `lane_ttl`). Empty when there is nothing to fold; an
/// error, and no statement, for a malformed document. The reconciler sends
/// the same statements; tests send these to the server themselves.
#[cfg(test)]
pub(crate) fn statements(
    spec: &CollectionConfig,
    document: &Document,
    cutoffs: Cutoffs,
) -> Result<Vec<Document>, Malformed> {
    let read = Read::of(document, spec);
    let plan = read.plan(&cutoffs.into())?;
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
    let bodies = if prefix_form(read, plan) {
        prefix(spec, read, plan)
    } else {
        vec![exact(spec, read, plan)]
    };
    bodies
        .into_iter()
        .map(|body| Statement {
            bytes: encoded_len(&body),
            body,
        })
        .collect()
}

/// Whether `plan` is written in the prefix form: the exact form's
/// comparisons would pass [`EXACT_FORM_LIMIT`].
fn prefix_form(read: &Read<'_>, plan: &FoldPlan) -> bool {
    let comparisons = plan.stale.len() * elements(read.pending).len()
        + plan.stale_markers.len() * elements(read.settled).len();
    comparisons > EXACT_FORM_LIMIT
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
    let mut parts = Parts::new(read.id);
    if plan.writes_counter(read.counter) {
        parts.add_to_counter(spec, read.counter, plan.stale_amount);
    }
    if touches(
        plan.has_pending,
        plan.stale.is_empty(),
        plan.keep.is_empty(),
    ) {
        let removed: Vec<Bson> = plan.stale.iter().map(|e| e.value.clone()).collect();
        if !removed.is_empty() {
            parts
                .q
                .insert(&spec.pending_field, doc! { "$all": removed.clone() });
        }
        parts.q.extend(unmarked(spec, &plan.stale));
        parts
            .set
            .insert(&spec.pending_field, without(&spec.pending_field, removed));
    }
    if touches(
        plan.has_settled,
        plan.stale_markers.is_empty(),
        plan.kept_markers.is_empty(),
    ) {
        let pruned = plan.stale_markers.clone();
        parts
            .set
            .insert(&spec.settled_field, without(&spec.settled_field, pruned));
    }
    prune_lanes(&mut parts, &spec.lanes_field, &plan.lanes);
    parts.finish()
}

/// Adds to `parts` the pruning `plan` makes of the lane map `name`: each
/// removed entry pinned in the filter at its value as read, the map
/// rewritten without them (or removed when that leaves it empty). Nothing
/// when the plan has no lane work.
pub(crate) fn prune_lanes(parts: &mut Parts, name: &str, plan: &LanePlan) {
    if !plan.has_work() {
        return;
    }
    for (key, value) in &plan.expired {
        // A minted key is 24 hex digits: a path with no `.` or `$` in it.
        parts.q.insert(format!("{name}.{key}"), value.clone());
    }
    let removed: Vec<Bson> = plan
        .expired
        .iter()
        .map(|(key, _)| Bson::String(key.clone()))
        .collect();
    let rest = doc! {
        "$arrayToObject": { "$filter": {
            "input": { "$objectToArray": { "$ifNull": [field(name), {}] } },
            "cond": { "$not": [{ "$in": ["$$this.k", { "$literal": removed }] }] },
        } }
    };
    let value = doc! {
        "$let": {
            "vars": { "rest": rest },
            "in": { "$cond": [{ "$eq": ["$$rest", {}] }, "$$REMOVE", "$$rest"] },
        }
    };
    parts.set.insert(name, value);
}

/// A statement being built: its filter, the checks its pipeline makes, and
/// the fields it sets when every check holds.
pub(crate) struct Parts {
    q: Document,
    checks: Vec<Document>,
    set: Document,
}

impl Parts {
    fn new(id: &Bson) -> Self {
        Self {
            q: crate::write::at::by_id("_id", id),
            checks: Vec::new(),
            set: Document::new(),
        }
    }

    /// Adds `sum` to the counter, whose value was `before` when read. Its
    /// absence or its type is pinned in the filter (the plan's arithmetic
    /// depends on it), and the pipeline checks that the sum is exact in
    /// that type: a step 2 may have moved the value since it was read, and
    /// `$add` would quietly turn an int64 that overflows into a double, or
    /// round a double past 2^53. The statement then changes nothing, and
    /// the re-read plans the document as it is. (A check in the filter,
    /// `$expr`, would cost the test server a collection scan per
    /// statement.)
    fn add_to_counter(&mut self, spec: &CollectionConfig, before: Option<&Bson>, sum: i64) {
        let name = spec.counter_field.as_str();
        let after = counter(spec, before, sum);
        match before {
            None => {
                self.q.insert(name, doc! { "$exists": false });
            }
            Some(value) => {
                self.q.insert(name, doc! { "$type": bson_type_name(value) });
                self.checks.push(match value {
                    Bson::Double(_) => exact_as_double(after.clone()),
                    _ => doc! { "$ne": [{ "$type": after.clone() }, "double"] },
                });
            }
        }
        self.set.insert(name, after);
    }

    /// The statement: its `set` applies only when every check holds.
    fn finish(self) -> Document {
        if self.checks.is_empty() {
            doc! { "q": self.q, "u": [{ "$set": self.set }] }
        } else {
            guarded(self.q, self.checks, self.set)
        }
    }
}

/// The filter condition that none of the tokens `stale` counts (the
/// entries whose removal adds to the counter) has a settle marker. A
/// settle that counted one after the document was read, and a late step 1
/// that re-added it, would otherwise let the statement count it again; so
/// it matches nothing, and the re-read finds the marker and drops the copy.
fn unmarked<'a>(
    spec: &CollectionConfig,
    stale: impl IntoIterator<Item = &'a StaleEntry>,
) -> Document {
    let counted: Vec<Bson> = stale
        .into_iter()
        .filter(|e| e.adds != 0)
        .map(|e| Bson::ObjectId(e.token.object_id()))
        .collect();
    if counted.is_empty() {
        return Document::new();
    }
    doc! { marker_path(spec): { "$nin": counted } }
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

/// One statement's share of a document folded in the prefix form: a
/// stretch of the pending array, what removing its stale entries adds, and
/// the counter before it applies.
struct Piece {
    range: Range<usize>,
    sum: i64,
    before: Option<Bson>,
}

/// The stretches of at most [`CHUNK_BYTES`] the prefix form covers the
/// pending array with, up to its last stale entry, with what each adds: an
/// overflow when a stretch's sum, or the counter after it, leaves its
/// type's exact range (the plan checked only the whole).
fn pieces(read: &Read<'_>, plan: &FoldPlan) -> Result<Vec<Piece>, Malformed> {
    let pending = elements(read.pending);
    let end = plan.stale.last().map_or(0, |e| e.position + 1);
    let mut ranges = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (position, value) in pending[..end].iter().enumerate() {
        let size = value_len(value);
        if position > start && bytes + size > CHUNK_BYTES {
            ranges.push(start..position);
            (start, bytes) = (position, 0);
        }
        bytes += size;
    }
    if end > start || ranges.is_empty() {
        ranges.push(start..end);
    }
    let mut before = read.counter.cloned();
    let mut pieces = Vec::with_capacity(ranges.len());
    for range in ranges {
        let sum: i128 = plan
            .stale
            .iter()
            .filter(|e| range.contains(&e.position))
            .map(|e| i128::from(e.adds))
            .sum();
        let after = model::add(before.as_ref(), sum)?;
        let sum = i64::try_from(sum).map_err(|_| Malformed::Overflow)?;
        pieces.push(Piece { range, sum, before });
        before = Some(after);
    }
    Ok(pieces)
}

/// The prefix form: one statement per [`pieces`] stretch; the last one
/// also prunes the markers and removes emptied fields.
///
/// Statements after the first apply only after every earlier one did: each
/// also requires that the entries before its stretch are all fresh (their
/// least token is the least token the earlier stretches keep), which holds
/// only once every earlier stale entry is gone. Otherwise a writer changing
/// an earlier stretch could shift the array so that a later stretch still
/// matched, and its statement would count a token whose earlier copy stays
/// behind, to be counted again.
fn prefix(spec: &CollectionConfig, read: &Read<'_>, plan: &FoldPlan) -> Vec<Document> {
    let pending = elements(read.pending);
    let settled = elements(read.settled);
    let end = plan.stale.last().map_or(0, |e| e.position + 1);
    // [`Read::plan`] refused a document whose stretches cannot be added
    // exactly; one statement for all would be exact anyway.
    let pieces = pieces(read, plan).unwrap_or_else(|_| {
        vec![Piece {
            range: 0..end,
            sum: plan.stale_amount,
            before: read.counter.cloned(),
        }]
    });
    let mut fresh = vec![true; end];
    for e in &plan.stale {
        fresh[e.position] = false;
    }
    let (mut kept_before, mut least_kept) = (0, None);
    let last = pieces.len() - 1;
    let mut statements = Vec::with_capacity(pieces.len());
    for (i, Piece { range, sum, before }) in pieces.into_iter().enumerate() {
        let kept: Vec<Bson> = range
            .clone()
            .filter(|p| fresh[*p])
            .map(|p| pending[p].clone())
            .collect();
        let mut parts = Parts::new(read.id);
        parts.q.extend(unmarked(
            spec,
            plan.stale.iter().filter(|e| range.contains(&e.position)),
        ));
        if sum != 0 || before.is_none() {
            parts.add_to_counter(spec, before.as_ref(), sum);
        }
        if let Some(least) = least_kept {
            parts
                .checks
                .push(all_fresh(&spec.pending_field, kept_before, least));
        }
        if !range.is_empty() {
            let (check, rewritten) = rewrite(
                &spec.pending_field,
                kept_before,
                &pending[range.clone()],
                &kept,
            );
            parts.checks.push(check);
            parts.set.insert(&spec.pending_field, rewritten);
        } else if touches(plan.has_pending, true, plan.keep.is_empty()) {
            parts.set.insert(
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
                parts.set.insert(
                    &spec.settled_field,
                    without(&spec.settled_field, Vec::new()),
                );
            } else {
                let (check, rewritten) =
                    rewrite(&spec.settled_field, 0, settled, &plan.kept_markers);
                parts.checks.push(check);
                parts.set.insert(&spec.settled_field, rewritten);
            }
        }
        if i == last {
            prune_lanes(&mut parts, &spec.lanes_field, &plan.lanes);
        }
        statements.push(parts.finish());
        kept_before += kept.len();
        least_kept = kept.iter().filter_map(token_of).chain(least_kept).min();
    }
    statements
}

/// The check that the first `count` entries of the array field `name` all
/// have a token of at least `least`: none of them is stale.
fn all_fresh(name: &str, count: usize, least: ObjectId) -> Document {
    let tokens = doc! { "$map": {
        "input": { "$slice": [{ "$ifNull": [field(name), []] }, 0, to_i32(count)] },
        "in": { "$ifNull": [format!("$$this.{TOKEN_FIELD}"), "$$this"] },
    } };
    doc! { "$gte": [{ "$min": tokens }, least] }
}

/// The token of a pending entry.
fn token_of(value: &Bson) -> Option<ObjectId> {
    Entry::parse(value).ok().map(|e| e.token().object_id())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    use crate::token::Token;

    /// A document folded in two statements (160,000 fresh entries between
    /// its stale ones), with `amounts` on stale entries before and after
    /// them.
    fn split(counter: i64, first: &[i64], second: &[i64]) -> Document {
        let stale = || Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
        let entry = |n: &i64| Bson::Document(doc! { "t": stale().object_id(), "n": *n });
        let mut pending: Vec<Bson> = first.iter().map(entry).collect();
        pending.extend((0..160_000).map(|_| Bson::ObjectId(ObjectId::new())));
        pending.extend(second.iter().map(entry));
        doc! { "_id": 1, "counter": counter, "pending": pending }
    }

    /// The fold's arithmetic never wraps: a document whose stretches would
    /// each add more than an int64 holds, or take the counter past the
    /// limit part way, is refused as an overflow even though its total
    /// fits — never folded with a wrapped sum.
    #[test]
    fn a_stretch_that_cannot_be_added_exactly_refuses_the_document() {
        let spec = CollectionConfig::new("views");
        let cutoff = Token::cutoff(SystemTime::now() - Duration::from_secs(600));
        let cutoff = Cutoffs {
            tokens: cutoff,
            lanes: cutoff,
        };
        let fits = split(0, &[1, 2], &[3]);
        assert_eq!(statements(&spec, &fits, cutoff).unwrap().len(), 2);
        for document in [
            split(0, &[i64::MAX, i64::MAX], &[i64::MIN, i64::MIN]),
            split(5, &[i64::MAX - 2], &[-10]),
        ] {
            assert_eq!(
                statements(&spec, &document, cutoff).map(|s| s.len()),
                Err(Malformed::Overflow)
            );
        }
    }
}
