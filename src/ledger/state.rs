//! The fold's state, as stored, and every write to it: the one place that
//! knows its field paths. One document per ledger, in `<events>_fold`:
//!
//! ```text
//! { _id: "state", pass: <int64>, v: <int64>, W: <int64>,
//!   floor: { f: <int64>, t: <token>, at: <timestamp> },
//!   late: [ { after: <timestamp>, below: <int64> }, ... ],
//!   intent: { pass: P, from: <W>, to: <W'>, owner: ObjectId,
//!             deadline: <date>, recovered: <bool>,
//!             anchor: <raise>, live: <raise>, late: [ ... ] },
//!   held: [ { k: <counter key>, p: <pass>, n: <int64>, e: <events>,
//!             a: <maybe applied>, why: <string>, at: <date> }, ... ] }
//! ```
//!
//! - `W`, the **watermark**: every event numbered at or below it is in its
//!   counter (or in a held sum); every event above it is not. The events
//!   collection's floor (see `floor`) is at least `W`, so no event at or
//!   below it can land any more.
//! - `pass` is the last committed pass; `v` changes with every write that
//!   records an intent or commits one.
//! - `intent` is the pass in progress: it folds the events numbered in
//!   `(from, to]`, applied by `owner` until `deadline`.
//! - `held` are the sums a counter refused, each with the pass whose fold
//!   lane position it goes through.
//! - `floor` is the last raise of the events collection's floor a pass
//!   committed (see `floor`): its value, its token and the cluster time it
//!   took effect. An intent's `anchor` is its first raise — the pass folds
//!   the events of its range that landed before it — and `live` its latest.
//! - `late` are the events the fold **owes**: those numbered at or below
//!   `below` that landed after the cluster time `after`, below a floor a
//!   late `collMod` lowered (see `floor`). A repair pass (an intent with
//!   `late`) finds them in the change stream and folds them.
//!
//! The document's size does not grow with time, events or recorders: a
//! watermark and one intent of fixed size; only `held` grows, by one entry
//! per counter that refuses its sum (about 150 bytes each: a hundred
//! thousand refusing counters before the document limit), and `late` by
//! one entry per late `collMod` found, until the next pass repairs it.
//!
//! Tally 0.2.0 kept a `folded` map (one entry per recorder lane) and one
//! registration document per lane in this collection: see
//! [`FoldState::legacy`].

use std::time::SystemTime;

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, Timestamp, doc, oid::ObjectId};

use crate::document::integer_value;
use crate::error::{Error, ErrorClass, RetryBudget};
use crate::ledger::floor::Raise;
use crate::store::Store;

/// The state document's `_id`.
pub(crate) const STATE_ID: &str = "state";

/// The fold state's collection of the events collection `events`.
pub(crate) fn collection_name(events: &str) -> String {
    format!("{events}_fold")
}

mod stored;

use stored::parse;

/// The state document's fields.
mod field {
    pub(super) const PASS: &str = "pass";
    pub(super) const VERSION: &str = "v";
    pub(super) const WATERMARK: &str = "W";
    pub(super) const INTENT: &str = "intent";
    pub(super) const HELD: &str = "held";
    pub(super) const FLOOR: &str = "floor";
    pub(super) const FLOOR_TOKEN: &str = "floor.t";
    pub(super) const LATE: &str = "late";
    /// 0.2.0's per-lane map.
    pub(super) const LEGACY_FOLDED: &str = "folded";

    /// The intent's fields, as paths from the document.
    pub(super) const INTENT_PASS: &str = "intent.pass";
    pub(super) const INTENT_OWNER: &str = "intent.owner";
    pub(super) const INTENT_DEADLINE: &str = "intent.deadline";
    pub(super) const INTENT_RECOVERED: &str = "intent.recovered";
    pub(super) const INTENT_ANCHOR: &str = "intent.anchor";
    pub(super) const INTENT_LIVE: &str = "intent.live";
    pub(super) const INTENT_LATE: &str = "intent.late";
}

/// The pass in progress.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Intent {
    /// Its number: the fold lane position its sums go through.
    pub(crate) pass: i64,
    /// The watermark it starts from: it folds the events numbered above.
    pub(crate) from: i64,
    /// The watermark it ends at: it folds the events numbered up to it.
    pub(crate) to: i64,
    /// The fold applying it.
    pub(crate) owner: ObjectId,
    /// Until when the owner may send (the server's clock); renewed while
    /// it works.
    pub(crate) deadline: SystemTime,
    /// It was taken over, or resumed after its owner stopped: any of its
    /// sends may have applied.
    pub(crate) recovered: bool,
    /// Its first raise of the floor: it folds the events of its range that
    /// landed before it (`None` before it raised).
    pub(crate) anchor: Option<Raise>,
    /// Its latest raise of the floor.
    pub(crate) live: Option<Raise>,
    /// The debts it repairs (a repair pass; empty for a range's pass).
    pub(crate) late: Vec<Late>,
}

/// Events the fold owes: those numbered at or below `below` that landed
/// after the cluster time `after`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Late {
    /// The cluster time after which they landed.
    pub(crate) after: Timestamp,
    /// The highest number among them.
    pub(crate) below: i64,
}

impl Late {
    /// Whether the event numbered `s` that landed at `at` is owed.
    pub(crate) fn owes(&self, s: i64, at: Timestamp) -> bool {
        at > self.after && s <= self.below
    }

    /// The debt as stored (always the same bytes: `$pull` finds it).
    pub(crate) fn to_document(&self) -> Document {
        doc! { "after": self.after, "below": self.below }
    }

    fn from_document(document: &Document) -> Result<Self, String> {
        Ok(Self {
            after: document
                .get_timestamp("after")
                .map_err(|_| "a debt's cluster time is malformed".to_owned())?,
            below: document
                .get("below")
                .and_then(integer_value)
                .ok_or_else(|| "a debt's number is malformed".to_owned())?,
        })
    }
}

impl Intent {
    /// Whether the event numbered `s` is one this pass folds.
    pub(crate) fn folds(&self, s: i64) -> bool {
        s > self.from && s <= self.to
    }
}

/// A sum a counter refused, kept until it accepts it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Held {
    /// The counter's key.
    pub(crate) key: Bson,
    /// The pass it came from: its position on the fold lane.
    pub(crate) pass: i64,
    /// The sum (outside the int64 range only for sums no counter can take).
    pub(crate) amount: i128,
    /// How many events it sums.
    pub(crate) events: u64,
    /// Some send of it may have applied: it is never merged with another.
    pub(crate) maybe_applied: bool,
    /// Why the counter refused it last.
    pub(crate) cause: String,
    /// When it was first held.
    pub(crate) since: SystemTime,
}

/// What tally 0.2.0 left in a fold state: per recorder lane, the highest
/// number folded.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Legacy {
    /// Lane (hex) and its highest folded number.
    pub(crate) folded: Vec<(ObjectId, i64)>,
}

/// Everything the fold keeps, as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FoldState {
    /// Whether the state document exists.
    pub(crate) exists: bool,
    /// The last committed pass (0 before the first).
    pub(crate) pass: i64,
    /// The version (0 before the first write).
    pub(crate) version: i64,
    /// The watermark: every event numbered at or below it is folded.
    pub(crate) watermark: i64,
    /// The pass in progress.
    pub(crate) intent: Option<Intent>,
    /// The held sums, in the order they go out.
    pub(crate) held: Vec<Held>,
    /// A state written by tally 0.2.0, not converted yet.
    pub(crate) legacy: Option<Legacy>,
    /// The last raise of the floor a pass committed.
    pub(crate) floor: Option<Raise>,
    /// The events the fold owes.
    pub(crate) late: Vec<Late>,
    /// The document's size in bytes (0 without one).
    pub(crate) bytes: usize,
}

impl FoldState {
    /// What a reader compares before and after: a commit in between — the
    /// only write that moves the watermark or the held sums — changes it.
    /// (An intent recorded in between does not: the reader judges by the
    /// intent it reads last, the only one that can have applied anything
    /// while the pass stayed the same.)
    pub(crate) fn seen(&self) -> i64 {
        self.pass
    }

    /// The highest pass the state knows of, committed or in progress.
    pub(crate) fn known_pass(&self) -> i64 {
        self.intent
            .as_ref()
            .map_or(self.pass, |i| i.pass.max(self.pass))
    }
}

/// Reads the fold state of `collection` (one `find` by `_id`).
pub(crate) async fn read(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<FoldState, Error> {
    let found = store
        .find_one(collection, filter(), Document::new(), "ledger.fold_state")
        .await?;
    from_document(collection, found)
}

/// The filter that finds the state document.
pub(crate) fn filter() -> Document {
    doc! { "_id": STATE_ID }
}

/// The fold state of `collection` from its state document as found.
pub(crate) fn from_document(
    collection: &Collection<Document>,
    found: Option<Document>,
) -> Result<FoldState, Error> {
    let Some(document) = found else {
        return Ok(FoldState::default());
    };
    let mut state = parse(&document).map_err(|reason| Error::Malformed {
        collection: collection.name().to_owned(),
        id: STATE_ID.to_owned(),
        reason,
    })?;
    state.exists = true;
    state.bytes = document.to_vec().map_or(0, |bytes| bytes.len());
    Ok(state)
}

/// The error of a read or a pass that meets a state tally 0.2.0 wrote and
/// no fold converted yet.
pub(crate) fn not_converted(collection: &Collection<Document>) -> Error {
    Error::Malformed {
        collection: collection.name().to_owned(),
        id: STATE_ID.to_owned(),
        reason: "it was written by tally 0.2.0 and is not converted yet: run `tallyd reconcile` \
                 once (it converts it, see the changelog)"
            .into(),
    }
}

/// Records `intent` as the next pass of `state` — conditioned on the state
/// not having changed since it was read (its version), or, without a state
/// document, by creating it. `false` when another fold got there first.
pub(crate) async fn record_intent(
    store: &Store,
    collection: &Collection<Document>,
    state: &FoldState,
    intent: &Intent,
) -> Result<bool, Error> {
    let mut budget = RetryBudget::retry_once("ledger.fold.intent");
    let written = if state.exists {
        let filter = doc! {
            "_id": STATE_ID,
            field::VERSION: state.version,
            field::INTENT: { "$exists": false },
        };
        let update = doc! {
            "$set": { field::INTENT: intent.to_document() },
            "$inc": { field::VERSION: 1 },
        };
        store
            .with_retry(&mut budget, || {
                collection.update_one(filter.clone(), update.clone())
            })
            .await
            .map(|r| r.matched_count == 1)
    } else {
        let document = doc! {
            "_id": STATE_ID,
            field::PASS: 0i64,
            field::VERSION: 1i64,
            field::WATERMARK: intent.from,
            field::INTENT: intent.to_document(),
        };
        match store
            .with_retry(&mut budget, || collection.insert_one(document.clone()))
            .await
        {
            Ok(_) => Ok(true),
            // Another fold created the state first (or our own lost
            // attempt did: the caller reads it back).
            Err(failure) if failure.class == ErrorClass::DuplicateKey => Ok(false),
            Err(failure) => Err(failure),
        }
    };
    written.map_err(Error::Server)
}

/// Makes the unfinished pass `intent` (owned by `from`) `owner`'s until
/// `deadline`, marked recovered. `false` when it changed meanwhile.
pub(crate) async fn claim(
    store: &Store,
    collection: &Collection<Document>,
    intent: &Intent,
    from: ObjectId,
    owner: ObjectId,
    deadline: SystemTime,
) -> Result<bool, Error> {
    let filter =
        doc! { "_id": STATE_ID, field::INTENT_OWNER: from, field::INTENT_PASS: intent.pass };
    let update = doc! { "$set": {
        field::INTENT_OWNER: owner,
        field::INTENT_DEADLINE: DateTime::from_system_time(deadline),
        field::INTENT_RECOVERED: true,
    } };
    let claimed = store
        .update_one(collection, filter, update, "ledger.fold.take_over")
        .await?;
    Ok(claimed.matched_count == 1)
}

/// Extends `owner`'s pass `pass` to `deadline`; `false` when it is no
/// longer `owner`'s.
pub(crate) async fn renew(
    store: &Store,
    collection: &Collection<Document>,
    owner: ObjectId,
    pass: i64,
    deadline: SystemTime,
) -> Result<bool, Error> {
    let filter = owned(owner, pass);
    let update = doc! { "$set": { field::INTENT_DEADLINE: DateTime::from_system_time(deadline) } };
    let renewed = store
        .update_one(collection, filter, update, "ledger.fold.renew")
        .await?;
    Ok(renewed.matched_count == 1)
}

/// Commits `owner`'s pass `intent`: the watermark moves to its end, the
/// held sums become `held`, the floor remembered becomes `live`, the debts
/// a repair pass `repaid` go, the intent goes. `false` when it was no longer
/// `owner`'s (the caller reads whether it was committed all the same).
pub(crate) async fn commit(
    store: &Store,
    collection: &Collection<Document>,
    owner: ObjectId,
    (intent, repaid): (&Intent, &[Late]),
    live: &Raise,
    held: &[Held],
) -> Result<bool, Error> {
    let filter =
        doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: intent.pass };
    let mut update = doc! {
        "$set": {
            field::PASS: intent.pass,
            field::WATERMARK: intent.to,
            field::HELD: held.iter().map(Held::to_document).collect::<Vec<Document>>(),
            field::FLOOR: live.to_document(),
        },
        "$unset": { field::INTENT: "" },
        "$inc": { field::VERSION: 1 },
    };
    if !repaid.is_empty() {
        let repaid: Vec<Document> = repaid.iter().map(Late::to_document).collect();
        update.insert("$pull", doc! { field::LATE: { "$in": repaid } });
    }
    let committed = store
        .update_one(collection, filter, update, "ledger.fold.commit")
        .await?;
    Ok(committed.matched_count == 1)
}

/// The filter of the state while `owner`'s pass `pass` is in progress.
fn owned(owner: ObjectId, pass: i64) -> Document {
    doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: pass }
}

/// Records `raise` as `owner`'s pass `pass`'s latest raise of the floor
/// (and as its anchor, its first, when `anchor`). `false` when the pass is
/// no longer `owner`'s — or, for an anchor, when the pass has another one
/// already: an anchor is set once, so that an earlier attempt's write held
/// up in the network and arriving late never replaces the anchor a later
/// attempt applied counters against.
pub(crate) async fn record_raise(
    store: &Store,
    collection: &Collection<Document>,
    (owner, pass): (ObjectId, i64),
    raise: &Raise,
    anchor: bool,
) -> Result<bool, Error> {
    let mut filter = owned(owner, pass);
    let mut set = doc! { field::INTENT_LIVE: raise.to_document() };
    if anchor {
        filter.insert(field::INTENT_ANCHOR, doc! { "$exists": false });
        set.insert(field::INTENT_ANCHOR, raise.to_document());
    }
    let recorded = store
        .update_one(
            collection,
            filter,
            doc! { "$set": set },
            "ledger.fold.raise",
        )
        .await?;
    if recorded.matched_count == 1 || !anchor {
        return Ok(recorded.matched_count == 1);
    }
    // Our own first attempt, whose reply was lost, may have set it.
    let mut ours = owned(owner, pass);
    ours.insert(format!("{}.t", field::INTENT_ANCHOR), &raise.token);
    let found = store
        .find_one(collection, ours, doc! { "_id": 1 }, "ledger.fold.raise")
        .await?;
    Ok(found.is_some())
}

/// Records that the fold owes `late`, while `owner`'s pass `pass` is in
/// progress. `false` when the pass is no longer `owner`'s.
pub(crate) async fn owe_in_pass(
    store: &Store,
    collection: &Collection<Document>,
    (owner, pass): (ObjectId, i64),
    late: &Late,
) -> Result<bool, Error> {
    let filter = owned(owner, pass);
    owe(store, collection, filter, late, false).await
}

/// Records that the fold owes `late`, found by `owner`'s repair pass
/// `pass` at its first raise: the pass repays it too (it joins the pass's
/// debts). `false` when the pass is no longer `owner`'s.
pub(crate) async fn owe_in_repair(
    store: &Store,
    collection: &Collection<Document>,
    (owner, pass): (ObjectId, i64),
    late: &Late,
) -> Result<bool, Error> {
    owe(store, collection, owned(owner, pass), late, true).await
}

/// Records that the fold owes `late`, found from the committed raise
/// `floor`: only while the state still remembers it and no pass is in
/// progress (a repair since, or one under way, would make the debt a
/// second one).
pub(crate) async fn owe_on_floor(
    store: &Store,
    collection: &Collection<Document>,
    floor: &Raise,
    late: &Late,
) -> Result<bool, Error> {
    let filter = doc! {
        "_id": STATE_ID,
        field::FLOOR_TOKEN: &floor.token,
        field::INTENT: { "$exists": false },
    };
    owe(store, collection, filter, late, false).await
}

/// Adds `late` to the debts (and to the pass in progress's, with
/// `into_intent`) of the state `filter` finds.
async fn owe(
    store: &Store,
    collection: &Collection<Document>,
    filter: Document,
    late: &Late,
    into_intent: bool,
) -> Result<bool, Error> {
    let debt = late.to_document();
    let mut add = doc! { field::LATE: debt.clone() };
    if into_intent {
        add.insert(field::INTENT_LATE, debt);
    }
    let update = doc! {
        "$addToSet": add,
        "$inc": { field::VERSION: 1 },
    };
    let owed = store
        .update_one(collection, filter, update, "ledger.fold.owe")
        .await?;
    Ok(owed.matched_count == 1)
}

/// Records `raise` as the committed floor in place of `expected` (`None`:
/// none remembered), while no pass is in progress. `false` when the state
/// changed meanwhile.
pub(crate) async fn record_floor(
    store: &Store,
    collection: &Collection<Document>,
    expected: Option<&Raise>,
    raise: &Raise,
) -> Result<bool, Error> {
    let mut filter = doc! { "_id": STATE_ID, field::INTENT: { "$exists": false } };
    match expected {
        Some(floor) => filter.insert(field::FLOOR_TOKEN, &floor.token),
        None => filter.insert(field::FLOOR, doc! { "$exists": false }),
    };
    let update = doc! {
        "$set": { field::FLOOR: raise.to_document() },
        "$inc": { field::VERSION: 1 },
    };
    let recorded = store
        .update_one(collection, filter, update, "ledger.fold.floor")
        .await?;
    Ok(recorded.matched_count == 1)
}

/// Converts a 0.2.0 state (read as `state`) to a watermark `watermark`
/// over the floor's raise `floor`, owing `owed` (what may have landed below
/// it while it was converted): its per-lane map goes, its pass and held
/// sums stay. Conditioned on the version read; `false` when the state
/// changed meanwhile.
pub(crate) async fn convert_legacy(
    store: &Store,
    collection: &Collection<Document>,
    state: &FoldState,
    (watermark, floor): (i64, &Raise),
    owed: &Late,
) -> Result<bool, Error> {
    let filter = doc! {
        "_id": STATE_ID,
        field::VERSION: state.version,
        field::INTENT: { "$exists": false },
    };
    let update = doc! {
        "$set": {
            field::WATERMARK: watermark,
            field::FLOOR: floor.to_document(),
            field::LATE: [owed.to_document()],
        },
        "$unset": { field::LEGACY_FOLDED: "" },
        "$inc": { field::VERSION: 1 },
    };
    let converted = store
        .update_one(collection, filter, update, "ledger.fold.convert")
        .await?;
    Ok(converted.matched_count == 1)
}

/// Deletes 0.2.0's lane registrations (documents with an ObjectId `_id`)
/// from `collection`: nothing reads them any more. Returns how many.
pub(crate) async fn forget_legacy_registrations(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<u64, Error> {
    let filter = doc! { "_id": { "$type": "objectId" } };
    let mut budget = RetryBudget::retry_once("ledger.fold.forget_registrations");
    store
        .with_retry(&mut budget, || collection.delete_many(filter.clone()))
        .await
        .map(|r| r.deleted_count)
        .map_err(Error::Server)
}

/// The error of a fold state found missing although `evidence` shows it
/// existed.
pub(crate) fn lost(collection: &Collection<Document>, evidence: String) -> Error {
    Error::FoldStateLost {
        collection: collection.name().to_owned(),
        evidence,
    }
}
