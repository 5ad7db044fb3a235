//! The fold's state, as stored: one collection per ledger, `<events>_fold`,
//! holding the state document and one registration per recorder lane.
//!
//! ```text
//! { _id: "state", pass: <int64>, v: <int64>,
//!   folded: { "<lane hex>": <int64 M_L>, ... },
//!   intent: { pass: P, ranges: { "<lane hex>": [<from>, <to>], ... },
//!             owner: ObjectId, deadline: <date>, recovered: <bool> },
//!   held: [ { k: <counter key>, p: <pass>, n: <int64>, e: <events>,
//!             a: <maybe applied>, why: <string>, at: <date> }, ... ] }
//! { _id: <lane ObjectId>, at: <date, the server's clock>,
//!   sealed: <date, the fold's clock>, quiet: true }
//! ```
//!
//! - `pass` is the last committed pass; `v` changes with every write that
//!   changes what a pass or a read concludes (intent recorded, pass
//!   committed), so a reader compares it before and after.
//! - `folded` holds, per recorder lane, the highest number folded: every
//!   event of that lane numbered at or below it is in its counter (or in a
//!   held sum).
//! - `intent` is the pass in progress: the ranges `(from, to]` it folds,
//!   who applies it and until when.
//! - `held` are the sums a counter refused, each with the pass whose fold
//!   lane position it goes through.
//! - a lane registration is written by a recorder before its first insert
//!   on a fresh lane (`at` from the server's clock): the fold surveys every
//!   registered lane on every pass, and seals a lane once no insert on it
//!   can land any more (`sealed`: when, by the fold's clock, the server's).
//!   A sealed lane keeps its registration until the sweep deletes its
//!   events: every event's lane is registered, so an insert that lands late
//!   is found, and a lost state is told from a fresh one. Exact reads still
//!   read a sealed lane until the sweep has found it quiet (`quiet`) a
//!   while after its seal (see the fold's module docs).
//!
//! The recorder writes registrations; everything else is the fold's. This
//! module reads both, for the fold and for exact reads.

use std::collections::BTreeMap;
use std::time::SystemTime;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use crate::document::{bson_type_name, integer_value};
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;

/// The state document's `_id`.
pub(crate) const STATE_ID: &str = "state";

/// The fold state's collection of the events collection `events`.
pub(crate) fn collection_name(events: &str) -> String {
    format!("{events}_fold")
}

/// The state document's fields.
pub(crate) mod field {
    /// The last committed pass.
    pub(crate) const PASS: &str = "pass";
    /// The version: changes with every intent and commit.
    pub(crate) const VERSION: &str = "v";
    /// Per lane, the highest number folded.
    pub(crate) const FOLDED: &str = "folded";
    /// The pass in progress.
    pub(crate) const INTENT: &str = "intent";
    /// The sums counters refused.
    pub(crate) const HELD: &str = "held";
    /// A registration's time, and a held sum's.
    pub(crate) const AT: &str = "at";
    /// When a registered lane was sealed (the fold's clock).
    pub(crate) const SEALED: &str = "sealed";
    /// A sealed lane the sweep found with nothing late a while after its
    /// seal: exact reads skip it.
    pub(crate) const QUIET: &str = "quiet";
}

/// The pass in progress.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Intent {
    /// Its number: the fold lane position its sums go through.
    pub(crate) pass: i64,
    /// Per lane, the numbers `(from, to]` it folds.
    pub(crate) ranges: BTreeMap<ObjectId, (i64, i64)>,
    /// The fold applying it.
    pub(crate) owner: ObjectId,
    /// Until when the owner may send (the server's clock); renewed while
    /// it works.
    pub(crate) deadline: SystemTime,
    /// It was taken over, or resumed after its owner stopped: any of its
    /// sends may have applied.
    pub(crate) recovered: bool,
    /// When its survey began (the server's clock): a lane that could
    /// receive no insert after it is sealed once the pass commits.
    pub(crate) surveyed: SystemTime,
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

/// A recorder lane's registration.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Registered {
    /// The lane.
    pub(crate) lane: ObjectId,
    /// When it was registered, by the server's clock.
    pub(crate) at: SystemTime,
    /// When the fold sealed it (no insert on it can land any more), by the
    /// fold's clock; `None` while it is live.
    pub(crate) sealed: Option<SystemTime>,
    /// Sealed, and found with nothing late a while after its seal.
    pub(crate) quiet: bool,
}

/// Everything the fold keeps, as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FoldState {
    /// The last committed pass (0 before the first).
    pub(crate) pass: i64,
    /// The version (0 before the first write).
    pub(crate) version: i64,
    /// Whether the state document exists.
    pub(crate) exists: bool,
    /// Per lane, the highest number folded.
    pub(crate) folded: BTreeMap<ObjectId, i64>,
    /// The pass in progress.
    pub(crate) intent: Option<Intent>,
    /// The held sums, in the order they go out.
    pub(crate) held: Vec<Held>,
    /// The registered lanes.
    pub(crate) registered: Vec<Registered>,
}

impl FoldState {
    /// The lanes a pass surveys and the backlog counts: the registered
    /// lanes not sealed, and those of the pass in progress.
    pub(crate) fn live_lanes(&self) -> Vec<ObjectId> {
        self.lanes_where(|r| r.sealed.is_none())
    }

    /// The lanes that may hold events above their folded number, where an
    /// exact read looks: the live lanes, and the sealed ones the sweep has
    /// not found quiet yet (an insert held up in the network may land on a
    /// lane after its seal).
    pub(crate) fn readable_lanes(&self) -> Vec<ObjectId> {
        self.lanes_where(|r| !r.quiet)
    }

    fn lanes_where(&self, keep: impl Fn(&Registered) -> bool) -> Vec<ObjectId> {
        let mut lanes: Vec<ObjectId> = self
            .registered
            .iter()
            .filter(|r| keep(r))
            .map(|r| r.lane)
            .collect();
        if let Some(intent) = &self.intent {
            lanes.extend(intent.ranges.keys().copied());
        }
        lanes.sort();
        lanes.dedup();
        lanes
    }

    /// What a reader compares before and after: a commit in between — the
    /// only write that moves a lane's folded number or the held sums —
    /// changes it. (An intent recorded in between does not: the reader
    /// judges by the intent it reads last, the only one that can have
    /// applied anything while the pass stayed the same.)
    pub(crate) fn seen(&self) -> i64 {
        self.pass
    }
}

/// Reads the fold state of `collection`: the state document and the
/// registrations but the quiet ones (sealed lanes the passes and exact
/// reads no longer look at, kept only until the sweep deletes their
/// events): what a pass or a read costs does not grow with the dedupe
/// window's lanes.
pub(crate) async fn read(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<FoldState, Error> {
    read_matching(
        store,
        collection,
        doc! { field::QUIET: { "$exists": false } },
    )
    .await
}

/// Reads the fold state of `collection` with every registration, the quiet
/// ones included (for the sweep, which deletes their events).
pub(crate) async fn read_all(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<FoldState, Error> {
    read_matching(store, collection, Document::new()).await
}

async fn read_matching(
    store: &Store,
    collection: &Collection<Document>,
    filter: Document,
) -> Result<FoldState, Error> {
    let mut budget = RetryBudget::read_once("ledger.fold_state");
    let cursor = store
        .with_retry(&mut budget, || collection.find(filter.clone()))
        .await
        .map_err(Error::Server)?;
    let documents: Vec<Document> = cursor
        .try_collect()
        .await
        .map_err(|err| Error::Server(Failure::once("ledger.fold_state", err)))?;
    let mut state = FoldState::default();
    let mut registered = Vec::new();
    let malformed = |id: &str, reason: String| Error::Malformed {
        collection: collection.name().to_owned(),
        id: id.to_owned(),
        reason,
    };
    for document in documents {
        match document.get("_id") {
            Some(Bson::String(id)) if id == STATE_ID => {
                state = parse(&document).map_err(|why| malformed(STATE_ID, why))?;
                state.exists = true;
            }
            Some(Bson::ObjectId(lane)) => {
                let at = document
                    .get_datetime(field::AT)
                    .map_err(|_| malformed(&lane.to_hex(), "its at is not a date".into()))?;
                let sealed = match document.get(field::SEALED) {
                    None => None,
                    Some(Bson::DateTime(sealed)) => Some(sealed.to_system_time()),
                    Some(_) => {
                        return Err(malformed(&lane.to_hex(), "its sealed is not a date".into()));
                    }
                };
                registered.push(Registered {
                    lane: *lane,
                    at: at.to_system_time(),
                    sealed,
                    quiet: document.get_bool(field::QUIET).unwrap_or(false),
                });
            }
            // Not the fold's: left alone.
            _ => {}
        }
    }
    registered.sort_by_key(|r| r.lane);
    state.registered = registered;
    Ok(state)
}

/// Registers the recorder lane `lane` in the fold state `collection` (an
/// idempotent upsert; `at` from the server's clock, which the fold seals
/// lanes by). A recorder does it before its first insert on a fresh lane.
pub(crate) async fn register(
    store: &Store,
    collection: &Collection<Document>,
    lane: ObjectId,
) -> Result<(), Error> {
    upsert_registration(
        store,
        collection,
        lane,
        doc! { "$currentDate": { field::AT: true } },
    )
    .await
}

/// Registers the sealed lane `lane` again, live from now (the server's
/// clock): it got an event after its seal, which the next passes fold.
pub(crate) async fn register_again(
    store: &Store,
    collection: &Collection<Document>,
    lane: ObjectId,
) -> Result<(), Error> {
    let live = doc! {
        "$currentDate": { field::AT: true },
        "$unset": { field::SEALED: "", field::QUIET: "" },
    };
    upsert_registration(store, collection, lane, live).await
}

async fn upsert_registration(
    store: &Store,
    collection: &Collection<Document>,
    lane: ObjectId,
    register: Document,
) -> Result<(), Error> {
    let mut budget = RetryBudget::retry_once("ledger.register_lane");
    store
        .with_retry(&mut budget, || {
            collection
                .update_one(doc! { "_id": lane }, register.clone())
                .upsert(true)
        })
        .await
        .map(|_| ())
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
        ..FoldState::default()
    };
    if let Some(folded) = document.get(field::FOLDED) {
        let Bson::Document(folded) = folded else {
            return Err("its folded map is not a document".into());
        };
        for (lane, value) in folded {
            let lane = ObjectId::parse_str(lane).map_err(|_| format!("{lane} is not a lane"))?;
            let number = integer_value(value).ok_or("a folded number is not an integer")?;
            state.folded.insert(lane, number);
        }
    }
    if let Some(intent) = document.get(field::INTENT) {
        let Bson::Document(intent) = intent else {
            return Err("its intent is not a document".into());
        };
        state.intent = Some(parse_intent(intent)?);
    }
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

fn parse_intent(intent: &Document) -> Result<Intent, String> {
    let bad = |what: &str| format!("its intent's {what} is malformed");
    let pass = intent
        .get("pass")
        .and_then(integer_value)
        .ok_or_else(|| bad("pass"))?;
    let mut ranges = BTreeMap::new();
    for (lane, range) in intent.get_document("ranges").map_err(|_| bad("ranges"))? {
        let lane = ObjectId::parse_str(lane).map_err(|_| bad("ranges"))?;
        let Bson::Array(bounds) = range else {
            return Err(bad("ranges"));
        };
        let (Some(from), Some(to)) = (
            bounds.first().and_then(integer_value),
            bounds.get(1).and_then(integer_value),
        ) else {
            return Err(bad("ranges"));
        };
        ranges.insert(lane, (from, to));
    }
    Ok(Intent {
        pass,
        ranges,
        owner: intent.get_object_id("owner").map_err(|_| bad("owner"))?,
        deadline: intent
            .get_datetime("deadline")
            .map_err(|_| bad("deadline"))?
            .to_system_time(),
        recovered: intent.get_bool("recovered").unwrap_or(false),
        surveyed: intent
            .get_datetime("surveyed")
            .map_err(|_| bad("survey time"))?
            .to_system_time(),
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
            .get_datetime(field::AT)
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
        entry.insert(field::AT, DateTime::from_system_time(self.since));
        entry
    }
}

impl Intent {
    /// The intent as stored.
    pub(crate) fn to_document(&self) -> Document {
        let ranges: Document = self
            .ranges
            .iter()
            .map(|(lane, (from, to))| {
                (
                    lane.to_hex(),
                    Bson::Array(vec![Bson::Int64(*from), Bson::Int64(*to)]),
                )
            })
            .collect();
        let mut intent = Document::new();
        intent.insert("pass", self.pass);
        intent.insert("ranges", ranges);
        intent.insert("owner", self.owner);
        intent.insert("deadline", DateTime::from_system_time(self.deadline));
        intent.insert("recovered", self.recovered);
        intent.insert("surveyed", DateTime::from_system_time(self.surveyed));
        intent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    #[test]
    fn a_state_document_reads_back_what_the_fold_writes() {
        let lane = ObjectId::new();
        let intent = Intent {
            pass: 4,
            ranges: BTreeMap::from([(lane, (10, 20))]),
            owner: ObjectId::new(),
            deadline: DateTime::from_millis(1_700_000_000_000).to_system_time(),
            recovered: true,
            surveyed: DateTime::from_millis(1_699_999_999_000).to_system_time(),
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
            "_id": STATE_ID, "pass": 3i64, "v": 7i64,
            "folded": { lane.to_hex(): 10i64 },
            "intent": intent.to_document(),
            "held": [held.to_document()],
        };
        let state = parse(&document).unwrap();
        assert_eq!((state.pass, state.version), (3, 7));
        assert_eq!(state.folded[&lane], 10);
        assert_eq!(state.intent, Some(intent));
        assert_eq!(state.held, vec![held]);
    }

    #[test]
    fn a_malformed_state_is_refused_never_guessed() {
        assert!(parse(&doc! { "pass": "x" }).is_err());
        assert!(parse(&doc! { "folded": { "nota lane": 1 } }).is_err());
        assert!(parse(&doc! { "intent": { "pass": 1 } }).is_err());
        assert!(parse(&doc! { "held": [{ "k": "a" }] }).is_err());
    }
}
