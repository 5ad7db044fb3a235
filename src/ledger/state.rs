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

use crate::document::{bson_type_name, integer_value};
use crate::error::{Error, ErrorClass, RetryBudget};
use crate::ledger::floor::Raise;
use crate::store::Store;

/// The state document's `_id`.
pub(crate) const STATE_ID: &str = "state";

/// The fold state's collection of the events collection `events`.
pub(crate) fn collection_name(events: &str) -> String {
    format!("{events}_fold")
}

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
    let filter = doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: pass };
    let update = doc! { "$set": { field::INTENT_DEADLINE: DateTime::from_system_time(deadline) } };
    let renewed = store
        .update_one(collection, filter, update, "ledger.fold.renew")
        .await?;
    Ok(renewed.matched_count == 1)
}

/// Commits `owner`'s pass `intent`: the watermark moves to its end, the
/// held sums become `held`, the intent goes. `false` when it was no longer
/// `owner`'s (the caller reads whether it was committed all the same).
pub(crate) async fn commit(
    store: &Store,
    collection: &Collection<Document>,
    owner: ObjectId,
    intent: &Intent,
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
    if !intent.late.is_empty() {
        let repaid: Vec<Document> = intent.late.iter().map(Late::to_document).collect();
        update.insert("$pull", doc! { field::LATE: { "$in": repaid } });
    }
    let committed = store
        .update_one(collection, filter, update, "ledger.fold.commit")
        .await?;
    Ok(committed.matched_count == 1)
}

/// Records `raise` as `owner`'s pass `pass`'s latest raise of the floor
/// (and as its anchor, its first, when `anchor`). `false` when the pass is
/// no longer `owner`'s.
pub(crate) async fn record_raise(
    store: &Store,
    collection: &Collection<Document>,
    (owner, pass): (ObjectId, i64),
    raise: &Raise,
    anchor: bool,
) -> Result<bool, Error> {
    let filter = doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: pass };
    let mut set = doc! { field::INTENT_LIVE: raise.to_document() };
    if anchor {
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
    Ok(recorded.matched_count == 1)
}

/// Records that the fold owes `late`, while `owner`'s pass `pass` is in
/// progress. `false` when the pass is no longer `owner`'s.
pub(crate) async fn owe_in_pass(
    store: &Store,
    collection: &Collection<Document>,
    (owner, pass): (ObjectId, i64),
    late: &Late,
) -> Result<bool, Error> {
    let filter = doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: pass };
    owe(store, collection, filter, late).await
}

/// Records that the fold owes `late`, found from the committed raise
/// `floor`: only while the state still remembers it (a repair since would
/// make the debt a second one).
pub(crate) async fn owe_on_floor(
    store: &Store,
    collection: &Collection<Document>,
    floor: &Raise,
    late: &Late,
) -> Result<bool, Error> {
    let filter = doc! { "_id": STATE_ID, field::FLOOR_TOKEN: &floor.token };
    owe(store, collection, filter, late).await
}

async fn owe(
    store: &Store,
    collection: &Collection<Document>,
    filter: Document,
    late: &Late,
) -> Result<bool, Error> {
    let update = doc! {
        "$addToSet": { field::LATE: late.to_document() },
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

/// Converts a 0.2.0 state (read as `state`) to a watermark `watermark`:
/// its per-lane map goes, its pass and held sums stay. Conditioned on the
/// version read; `false` when the state changed meanwhile.
pub(crate) async fn convert_legacy(
    store: &Store,
    collection: &Collection<Document>,
    state: &FoldState,
    watermark: i64,
    floor: &Raise,
) -> Result<bool, Error> {
    let filter = doc! {
        "_id": STATE_ID,
        field::VERSION: state.version,
        field::INTENT: { "$exists": false },
    };
    let update = doc! {
        "$set": { field::WATERMARK: watermark, field::FLOOR: floor.to_document() },
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

/// The state document read into its parts, or what is wrong with it.
fn parse(document: &Document) -> Result<FoldState, String> {
    let number = |name: &str| match document.get(name) {
        None => Ok(0),
        Some(value) => integer_value(value)
            .ok_or_else(|| format!("its {name} is a {}, not an integer", bson_type_name(value))),
    };
    let mut state = FoldState {
        pass: number(field::PASS)?,
        version: number(field::VERSION)?,
        watermark: number(field::WATERMARK)?,
        ..FoldState::default()
    };
    if let Some(folded) = document.get(field::LEGACY_FOLDED) {
        let Bson::Document(folded) = folded else {
            return Err("its folded map (tally 0.2.0) is not a document".into());
        };
        let mut legacy = Legacy::default();
        for (lane, value) in folded {
            let lane = ObjectId::parse_str(lane).map_err(|_| format!("{lane} is not a lane"))?;
            let number = integer_value(value).ok_or("a folded number is not an integer")?;
            legacy.folded.push((lane, number));
        }
        state.legacy = Some(legacy);
    }
    if let Some(intent) = document.get(field::INTENT) {
        let Bson::Document(intent) = intent else {
            return Err("its intent is not a document".into());
        };
        if intent.contains_key("ranges") {
            return Err(
                "its intent is a pass of tally 0.2.0 (lane ranges): finish it with tally 0.2.0's \
                 `tallyd reconcile` before upgrading"
                    .into(),
            );
        }
        state.intent = Some(parse_intent(intent)?);
    }
    if let Some(floor) = document.get(field::FLOOR) {
        let Bson::Document(floor) = floor else {
            return Err("its floor is not a document".into());
        };
        state.floor = Some(Raise::from_document(floor).map_err(|why| format!("{why} (floor)"))?);
    }
    state.late = parse_late(document.get(field::LATE))?;
    if let Some(held) = document.get(field::HELD) {
        let Bson::Array(held) = held else {
            return Err("its held sums are not an array".into());
        };
        for entry in held {
            let Bson::Document(entry) = entry else {
                return Err("a held sum is not a document".into());
            };
            state.held.push(parse_held(entry)?);
        }
    }
    Ok(state)
}

fn parse_late(late: Option<&Bson>) -> Result<Vec<Late>, String> {
    let Some(late) = late else {
        return Ok(Vec::new());
    };
    let Bson::Array(late) = late else {
        return Err("its debts (late) are not an array".into());
    };
    late.iter()
        .map(|entry| match entry {
            Bson::Document(entry) => Late::from_document(entry),
            _ => Err("a debt is not a document".into()),
        })
        .collect()
}

fn parse_raise(intent: &Document, name: &str) -> Result<Option<Raise>, String> {
    match intent.get(name) {
        None => Ok(None),
        Some(Bson::Document(raise)) => Raise::from_document(raise)
            .map(Some)
            .map_err(|why| format!("its intent's {name}: {why}")),
        Some(_) => Err(format!("its intent's {name} is not a document")),
    }
}

fn parse_intent(intent: &Document) -> Result<Intent, String> {
    let bad = |what: &str| format!("its intent's {what} is malformed");
    let number = |name: &str| {
        intent
            .get(name)
            .and_then(integer_value)
            .ok_or_else(|| bad(name))
    };
    Ok(Intent {
        pass: number("pass")?,
        from: number("from")?,
        to: number("to")?,
        owner: intent.get_object_id("owner").map_err(|_| bad("owner"))?,
        deadline: intent
            .get_datetime("deadline")
            .map_err(|_| bad("deadline"))?
            .to_system_time(),
        recovered: intent.get_bool("recovered").unwrap_or(false),
        anchor: parse_raise(intent, "anchor")?,
        live: parse_raise(intent, "live")?,
        late: parse_late(intent.get("late"))?,
    })
}

fn parse_held(entry: &Document) -> Result<Held, String> {
    let bad = |what: &str| format!("a held sum's {what} is malformed");
    let amount = match entry.get("n") {
        Some(Bson::String(text)) => text.parse::<i128>().map_err(|_| bad("sum"))?,
        Some(value) => i128::from(integer_value(value).ok_or_else(|| bad("sum"))?),
        None => return Err(bad("sum")),
    };
    Ok(Held {
        key: entry.get("k").cloned().ok_or_else(|| bad("counter key"))?,
        pass: entry
            .get("p")
            .and_then(integer_value)
            .ok_or_else(|| bad("pass"))?,
        amount,
        events: entry
            .get("e")
            .and_then(integer_value)
            .and_then(|e| u64::try_from(e).ok())
            .unwrap_or(0),
        maybe_applied: entry.get_bool("a").unwrap_or(true),
        cause: entry.get_str("why").unwrap_or_default().to_owned(),
        since: entry
            .get_datetime("at")
            .map_or(SystemTime::UNIX_EPOCH, |d| d.to_system_time()),
    })
}

impl Held {
    /// The held sum as stored.
    pub(crate) fn to_document(&self) -> Document {
        let amount = match i64::try_from(self.amount) {
            Ok(n) => Bson::Int64(n),
            Err(_) => Bson::String(self.amount.to_string()),
        };
        let mut entry = Document::new();
        entry.insert("k", self.key.clone());
        entry.insert("p", self.pass);
        entry.insert("n", amount);
        entry.insert("e", i64::try_from(self.events).unwrap_or(i64::MAX));
        entry.insert("a", self.maybe_applied);
        entry.insert("why", self.cause.clone());
        entry.insert("at", DateTime::from_system_time(self.since));
        entry
    }
}

impl Intent {
    /// The intent as stored.
    pub(crate) fn to_document(&self) -> Document {
        let mut intent = doc! {
            "pass": self.pass,
            "from": self.from,
            "to": self.to,
            "owner": self.owner,
            "deadline": DateTime::from_system_time(self.deadline),
            "recovered": self.recovered,
        };
        if let Some(anchor) = &self.anchor {
            intent.insert("anchor", anchor.to_document());
        }
        if let Some(live) = &self.live {
            intent.insert("live", live.to_document());
        }
        if !self.late.is_empty() {
            let late: Vec<Document> = self.late.iter().map(Late::to_document).collect();
            intent.insert("late", late);
        }
        intent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    #[test]
    fn a_state_document_reads_back_what_the_fold_writes() {
        let intent = Intent {
            pass: 4,
            from: 10,
            to: 20,
            owner: ObjectId::new(),
            deadline: DateTime::from_millis(1_700_000_000_000).to_system_time(),
            recovered: true,
            anchor: Some(Raise {
                floor: 20,
                token: "a".into(),
                at: Timestamp {
                    time: 9,
                    increment: 1,
                },
            }),
            live: None,
            late: vec![Late {
                after: Timestamp {
                    time: 3,
                    increment: 4,
                },
                below: 10,
            }],
        };
        let held = Held {
            key: Bson::Document(doc! { "u": 5 }),
            pass: 3,
            amount: i128::from(i64::MAX) + 1,
            events: 2,
            maybe_applied: false,
            cause: "refused".into(),
            since: DateTime::from_millis(1_700_000_000_000).to_system_time(),
        };
        let document = doc! {
            "_id": STATE_ID, "pass": 3i64, "v": 7i64, "W": 10i64,
            "intent": intent.to_document(),
            "held": [held.to_document()],
        };
        let state = parse(&document).unwrap();
        assert_eq!((state.pass, state.version, state.watermark), (3, 7, 10));
        assert_eq!(state.intent, Some(intent.clone()));
        assert_eq!(state.held, vec![held]);
        assert_eq!(state.legacy, None);
        let late = &intent.late[0];
        assert!(late.owes(
            10,
            Timestamp {
                time: 3,
                increment: 5
            }
        ));
        assert!(!late.owes(
            11,
            Timestamp {
                time: 4,
                increment: 0
            }
        ));
        assert!(!late.owes(10, late.after));
        assert!(intent.folds(11) && intent.folds(20));
        assert!(!intent.folds(10) && !intent.folds(21));
    }

    #[test]
    fn a_state_of_tally_0_2_0_is_recognised() {
        let lane = ObjectId::new();
        let state = parse(&doc! { "pass": 2i64, "folded": { lane.to_hex(): 10i64 } }).unwrap();
        assert_eq!(state.legacy.unwrap().folded, vec![(lane, 10)]);
        let unfinished = doc! { "intent": { "pass": 3i64, "ranges": {} } };
        let refused = parse(&unfinished).unwrap_err();
        assert!(refused.contains("0.2.0"), "{refused}");
    }

    #[test]
    fn a_malformed_state_is_refused_never_guessed() {
        assert!(parse(&doc! { "pass": "x" }).is_err());
        assert!(parse(&doc! { "W": "x" }).is_err());
        assert!(parse(&doc! { "folded": { "nota lane": 1 } }).is_err());
        assert!(parse(&doc! { "intent": { "pass": 1 } }).is_err());
        assert!(parse(&doc! { "held": [{ "k": "a" }] }).is_err());
    }
}
