//! The fold's state: one document per ledger, in `<events>_fold`, and the
//! one type that writes it ([`Keeper`]: every transition is a method, each
//! a conditioned write; no other file knows its field names).
//!
//! ```text
//! { _id: "state", v: <int64>, pass: <int64>,
//!   position: { token: <resume token>, time: <cluster time> },
//!   intent: { pass: P, owner: ObjectId, deadline: <date>, recovered: <bool>,
//!             log: { from: <position>, to: <position and event key> | null }
//!           | chunk: { after: <number> | null, upto: <number> } },
//!   catch_up: { to: <position>, since: <number> | null, done: <number> | null },
//!   held: [ { k, p, n, e, a, why, at }, ... ],
//!   stopped: { why: <text>, at: <date> } }
//! ```
//!
//! - `position` is where every committed pass reached in the events
//!   collection's log (`ledger::log`): every insert at or before it is in
//!   its counter (or in a held sum), every insert after it is not.
//! - `pass` is the last committed pass; `v` changes with every write.
//! - `intent` is the pass in progress ([`Pass`]), recorded before anything
//!   is applied: a **log** pass folds the inserts after `from` up to and
//!   including `to`'s; a **chunk** of a catch-up folds the events numbered
//!   in `(after, upto]` that are in the collection at the catch-up's
//!   boundary.
//! - `catch_up` is a fold of the collection itself up to a boundary in the
//!   log (a ledger's first fold, an upgrade, `tallyd fold-from`): its
//!   chunks go through the events numbered above `since`, `done` the last
//!   one's end; the last chunk makes the boundary the position.
//! - `held` are the sums a counter refused, each with the pass whose fold
//!   lane position it goes through.
//! - `stopped` says the fold cannot go on from its position (the oplog no
//!   longer reaches back to it, the events collection was dropped): it
//!   stays stopped until `tallyd fold-from`.
//!
//! The document's size does not grow with time, events or recorders: only
//! `held` grows, by one entry per counter that refuses its sum (about 150
//! bytes each).
//!
//! Earlier versions left other fields ([`Earlier`]): tally 0.2.0 a `folded`
//! map (per recorder lane, the highest number folded), the version before
//! this one a watermark `W` (every event numbered at or below it folded),
//! with a validator on the events collection. Both are converted by a
//! catch-up (`ledger::fold::catch_up`).

mod stored;

use std::time::SystemTime;

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use mongodb::options::ReadConcern;
use mongodb::{ClientSession, Collection};

use super::log::Position;
use crate::error::{Error, ErrorClass};
use crate::store::Store;

/// The state document's `_id`.
pub(crate) const STATE_ID: &str = "state";

/// The fold state's collection of the events collection `events`.
pub(crate) fn collection_name(events: &str) -> String {
    format!("{events}_fold")
}

/// What [`Keeper::catch_up_from`] keeps of the catch-up it starts.
pub(crate) fn catch_up_started(boundary: &Position, since: Option<i64>) -> Document {
    doc! { "to": boundary.to_document(), "since": since }
}

/// The state document's fields.
mod field {
    pub(super) const PASS: &str = "pass";
    pub(super) const VERSION: &str = "v";
    pub(super) const POSITION: &str = "position";
    pub(super) const INTENT: &str = "intent";
    pub(super) const CATCH_UP: &str = "catch_up";
    pub(super) const CATCH_UP_DONE: &str = "catch_up.done";
    /// The last catch-up started (`{to, since}`), kept once it is done.
    pub(super) const CATCH_UP_STARTED: &str = "catch_up_started";
    pub(super) const HELD: &str = "held";
    pub(super) const STOPPED: &str = "stopped";
    pub(super) const INTENT_PASS: &str = "intent.pass";
    pub(super) const INTENT_OWNER: &str = "intent.owner";
    pub(super) const INTENT_DEADLINE: &str = "intent.deadline";
    pub(super) const INTENT_RECOVERED: &str = "intent.recovered";
    /// tally 0.2.0's per-lane map.
    pub(super) const EARLIER_LANES: &str = "folded";
    /// The previous version's watermark, floor and debts.
    pub(super) const EARLIER_WATERMARK: &str = "W";
    pub(super) const EARLIER_FLOOR: &str = "floor";
    pub(super) const EARLIER_DEBTS: &str = "late";
}

/// A pass: its number (its fold lane position), who applies it until
/// when, and which events it folds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pass {
    /// Its number: the fold lane position its sums go through.
    pub(crate) number: i64,
    /// The fold applying it.
    pub(crate) owner: ObjectId,
    /// Until when the owner may send (the server's clock); renewed while
    /// it works.
    pub(crate) deadline: SystemTime,
    /// It was taken over, or resumed after its owner stopped: any of its
    /// sends may have applied.
    pub(crate) recovered: bool,
    /// Which events it folds.
    pub(crate) window: Window,
}

/// The events a pass folds.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // one per pass
pub(crate) enum Window {
    /// The log's inserts after `from`, up to and including `to` (`None`:
    /// none; a pass of held sums alone).
    Log {
        from: Position,
        to: Option<LastInsert>,
    },
    /// A catch-up's chunk: the events numbered in `(after, upto]` (`after`
    /// `None`: from the lowest) that committed at or before its boundary.
    Chunk { after: Option<i64>, upto: i64 },
}

/// The last insert of a log pass: its position and its event key, by which
/// a pass read again finds where it ends.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LastInsert {
    pub(crate) at: Position,
    pub(crate) key: Bson,
}

/// A fold of the events collection itself up to a boundary in the log.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CatchUp {
    /// Where the log takes over: the catch-up folds what committed at or
    /// before it.
    pub(crate) boundary: Position,
    /// It folds the events numbered above this (`None`: all).
    pub(crate) since: Option<i64>,
    /// The highest number its chunks folded so far (`None`: none yet).
    pub(crate) done: Option<i64>,
    /// Whether its last chunk folds the events without a number too: a
    /// first fold's and an upgrade's (nothing counted them yet), never
    /// `tallyd fold-from`'s (the log counted those that committed before
    /// the stop; they are named instead).
    pub(crate) unnumbered: bool,
    /// The passes left unfinished that `tallyd fold-from` replaced with
    /// this catch-up (and with the catch-ups it replaced): their sends may
    /// have applied, held sums first, so a counter's fold lane may stand at
    /// their positions (see `fold::held`).
    pub(crate) dropped: Vec<i64>,
}

impl CatchUp {
    /// The number its next chunk starts above.
    pub(crate) fn next_after(&self) -> Option<i64> {
        match (self.done, self.since) {
            (Some(done), Some(since)) => Some(done.max(since)),
            (done, since) => done.or(since),
        }
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

/// Why the fold cannot go on from its position, and since when.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stopped {
    pub(crate) why: String,
    pub(crate) since: SystemTime,
}

/// What an earlier version of tally left in the state.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Earlier {
    /// tally 0.2.0: per recorder lane, the highest number folded; a pass
    /// of its own in progress.
    Lanes {
        lanes: Vec<(ObjectId, i64)>,
        in_progress: bool,
    },
    /// The version before this one: every event numbered at or below the
    /// watermark is folded; a pass or a repair of its own in progress.
    Watermark { watermark: i64, in_progress: bool },
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
    /// Where the committed passes reached in the log (`None` before the
    /// first catch-up finished).
    pub(crate) position: Option<Position>,
    /// The pass in progress.
    pub(crate) intent: Option<Pass>,
    /// A catch-up in progress.
    pub(crate) catch_up: Option<CatchUp>,
    /// The held sums, in the order they go out.
    pub(crate) held: Vec<Held>,
    /// The fold cannot go on from its position.
    pub(crate) stopped: Option<Stopped>,
    /// The boundary's token and `since` of the last catch-up started by
    /// [`Keeper::catch_up_from`], kept after it is done: how a command
    /// whose write's reply was lost knows the catch-up was its own.
    pub(crate) catch_up_started: Option<Document>,
    /// What an earlier version left, not converted yet.
    pub(crate) earlier: Option<Earlier>,
    /// The document's size in bytes (0 without one).
    pub(crate) bytes: usize,
}

impl FoldState {
    /// The highest pass the state knows of, committed or in progress.
    pub(crate) fn known_pass(&self) -> i64 {
        self.intent
            .as_ref()
            .map_or(self.pass, |i| i.number.max(self.pass))
    }
}

/// The fold state of one ledger, and every write to it.
#[derive(Debug, Clone)]
pub(crate) struct Keeper {
    store: Store,
    collection: Collection<Document>,
}

impl Keeper {
    /// The keeper of the events collection `events`' fold state.
    pub(crate) fn new(store: &Store, events: &str) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(&collection_name(events)),
        }
    }

    /// The state collection's name.
    pub(crate) fn name(&self) -> &str {
        self.collection.name()
    }

    /// The state collection (for a read inside a transaction).
    pub(crate) fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// Reads the state at read concern `majority` in `session` (causally
    /// after everything the session saw).
    pub(crate) async fn read(&self, session: &mut ClientSession) -> Result<FoldState, Error> {
        let found = self
            .store
            .find_one_in(
                session,
                &self.collection,
                filter(),
                ReadConcern::majority(),
                "ledger.fold_state",
            )
            .await?;
        self.parsed(found)
    }

    /// The state from its document as found (`None`: no document).
    pub(crate) fn parsed(&self, found: Option<Document>) -> Result<FoldState, Error> {
        let Some(document) = found else {
            return Ok(FoldState::default());
        };
        let mut state = stored::parse(&document).map_err(|reason| self.malformed(reason))?;
        state.exists = true;
        state.bytes = document.to_vec().map_or(0, |bytes| bytes.len());
        Ok(state)
    }

    /// The error of a state that cannot be read.
    pub(crate) fn malformed(&self, reason: String) -> Error {
        Error::Malformed {
            collection: self.collection.name().to_owned(),
            id: STATE_ID.to_owned(),
            reason,
        }
    }

    /// Makes a ledger's first state document: a catch-up of everything
    /// that committed up to `boundary`. `false` when another fold made it
    /// first.
    pub(crate) async fn start(
        &self,
        session: &mut ClientSession,
        boundary: &Position,
    ) -> Result<bool, Error> {
        let catch_up = CatchUp {
            boundary: boundary.clone(),
            since: None,
            done: None,
            unnumbered: true,
            dropped: Vec::new(),
        };
        let document = doc! {
            "_id": STATE_ID,
            field::PASS: 0i64,
            field::VERSION: 1i64,
            field::CATCH_UP: catch_up.to_document(),
        };
        match self
            .store
            .insert_one_in(session, &self.collection, document, "ledger.fold.start")
            .await
        {
            Ok(()) => Ok(true),
            // Another fold made it first (or our own lost attempt did: the
            // caller reads it back).
            Err(Error::Server(failure)) if failure.class == ErrorClass::DuplicateKey => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Replaces what `state` stands on — an earlier version's watermark or
    /// lanes, or a stop and the pass it left — with a catch-up of the events
    /// numbered above `since` that committed up to `boundary` (and of those
    /// without a number, with `unnumbered`). Conditioned on the version
    /// read. Its chunks are numbered after every pass before, the one left
    /// unfinished included: a counter that has that pass ignores none of
    /// them. `false` when another fold changed the state first.
    pub(crate) async fn catch_up_from(
        &self,
        session: &mut ClientSession,
        state: &FoldState,
        boundary: &Position,
        since: Option<i64>,
        unnumbered: bool,
    ) -> Result<bool, Error> {
        let unfinished = state
            .intent
            .as_ref()
            .map(|intent| intent.number)
            .filter(|&number| number > state.pass);
        let mut dropped: Vec<i64> = state
            .catch_up
            .iter()
            .flat_map(|c| c.dropped.iter().copied())
            .chain(unfinished)
            .collect();
        dropped.sort_unstable();
        dropped.dedup();
        let catch_up = CatchUp {
            boundary: boundary.clone(),
            since,
            done: None,
            unnumbered,
            dropped,
        };
        let passes = unfinished.unwrap_or(state.pass);
        let filter = doc! { "_id": STATE_ID, field::VERSION: state.version };
        let started = catch_up_started(boundary, since);
        let update = doc! {
            "$set": {
                field::CATCH_UP: catch_up.to_document(),
                field::PASS: passes,
                field::CATCH_UP_STARTED: started,
            },
            "$unset": {
                field::POSITION: "", field::STOPPED: "", field::INTENT: "",
                field::EARLIER_LANES: "", field::EARLIER_WATERMARK: "",
                field::EARLIER_FLOOR: "", field::EARLIER_DEBTS: "",
            },
            "$inc": { field::VERSION: 1 },
        };
        self.conditioned(session, filter, update, "ledger.fold.catch_up")
            .await
    }

    /// Records `pass` as the next pass of `state`, conditioned on the state
    /// not having changed since it was read. `false` when another fold got
    /// there first.
    pub(crate) async fn begin(
        &self,
        session: &mut ClientSession,
        state: &FoldState,
        pass: &Pass,
    ) -> Result<bool, Error> {
        let filter = doc! {
            "_id": STATE_ID,
            field::VERSION: state.version,
            field::INTENT: { "$exists": false },
        };
        let update = doc! {
            "$set": { field::INTENT: pass.to_document() },
            "$inc": { field::VERSION: 1 },
        };
        self.conditioned(session, filter, update, "ledger.fold.intent")
            .await
    }

    /// Makes the unfinished `pass` `owner`'s until `deadline`, marked
    /// recovered. `false` when it changed meanwhile.
    pub(crate) async fn claim(
        &self,
        session: &mut ClientSession,
        pass: &Pass,
        owner: ObjectId,
        deadline: SystemTime,
    ) -> Result<bool, Error> {
        let filter = owned(pass.owner, pass.number);
        let update = doc! { "$set": {
            field::INTENT_OWNER: owner,
            field::INTENT_DEADLINE: DateTime::from_system_time(deadline),
            field::INTENT_RECOVERED: true,
        } };
        self.conditioned(session, filter, update, "ledger.fold.take_over")
            .await
    }

    /// Extends `owner`'s pass `number` to `deadline`; `false` when it is no
    /// longer `owner`'s.
    pub(crate) async fn renew(
        &self,
        owner: ObjectId,
        number: i64,
        deadline: SystemTime,
    ) -> Result<bool, Error> {
        let update =
            doc! { "$set": { field::INTENT_DEADLINE: DateTime::from_system_time(deadline) } };
        let renewed = self
            .store
            .update_one(
                &self.collection,
                owned(owner, number),
                update,
                "ledger.fold.renew",
            )
            .await?;
        Ok(renewed.matched_count == 1)
    }

    /// Commits `owner`'s `pass`: the position moves to its end (a log pass)
    /// or the catch-up `catch_up` past its chunk — to its boundary after
    /// the last one —, the held sums become `held`, the intent goes.
    /// `false` when it was no longer `owner`'s (the caller reads whether it
    /// was committed all the same).
    pub(crate) async fn commit(
        &self,
        session: &mut ClientSession,
        (owner, pass): (ObjectId, &Pass),
        held: &[Held],
        catch_up: Option<&CatchUp>,
    ) -> Result<bool, Error> {
        let held: Vec<Document> = held.iter().map(Held::to_document).collect();
        let mut set = doc! { field::PASS: pass.number, field::HELD: held };
        let mut unset = doc! { field::INTENT: "" };
        match (&pass.window, catch_up) {
            (Window::Log { to: Some(to), .. }, _) => {
                set.insert(field::POSITION, to.at.to_document());
            }
            (Window::Log { to: None, .. }, _) => {}
            (Window::Chunk { upto, .. }, Some(catch_up)) if *upto == i64::MAX => {
                set.insert(field::POSITION, catch_up.boundary.to_document());
                unset.insert(field::CATCH_UP, "");
            }
            (Window::Chunk { upto, .. }, _) => {
                set.insert(field::CATCH_UP_DONE, *upto);
            }
        }
        let update = doc! { "$set": set, "$unset": unset, "$inc": { field::VERSION: 1 } };
        self.conditioned(
            session,
            owned(owner, pass.number),
            update,
            "ledger.fold.commit",
        )
        .await
    }

    /// Moves the position of `state` (no pass in progress, no catch-up) to
    /// `to`, past inserts none of which were found: an idle ledger's
    /// position keeps up with the log, never falling behind what the oplog
    /// holds. Conditioned on the version read.
    pub(crate) async fn advance(
        &self,
        session: &mut ClientSession,
        state: &FoldState,
        to: &Position,
    ) -> Result<bool, Error> {
        let filter = doc! {
            "_id": STATE_ID,
            field::VERSION: state.version,
            field::INTENT: { "$exists": false },
            field::CATCH_UP: { "$exists": false },
        };
        let update = doc! {
            "$set": { field::POSITION: to.to_document() },
            "$inc": { field::VERSION: 1 },
        };
        self.conditioned(session, filter, update, "ledger.fold.advance")
            .await
    }

    /// Records that the fold cannot go on from the position of `state`,
    /// and why. Conditioned on the version read.
    pub(crate) async fn stop(
        &self,
        session: &mut ClientSession,
        state: &FoldState,
        why: &str,
        at: SystemTime,
    ) -> Result<bool, Error> {
        let filter = doc! { "_id": STATE_ID, field::VERSION: state.version };
        let update = doc! {
            "$set": { field::STOPPED: { "why": why, "at": DateTime::from_system_time(at) } },
            "$inc": { field::VERSION: 1 },
        };
        self.conditioned(session, filter, update, "ledger.fold.stop")
            .await
    }

    /// Deletes tally 0.2.0's lane registrations (documents with an
    /// ObjectId `_id`): nothing reads them any more. Returns how many.
    pub(crate) async fn forget_lane_registrations(&self) -> Result<u64, Error> {
        let filter = doc! { "_id": { "$type": "objectId" } };
        let mut budget = crate::error::RetryBudget::retry_once("ledger.fold.forget_registrations");
        self.store
            .with_retry(&mut budget, || self.collection.delete_many(filter.clone()))
            .await
            .map(|r| r.deleted_count)
            .map_err(Error::Server)
    }

    /// The error of a fold state found missing although `evidence` shows it
    /// existed.
    pub(crate) fn lost(&self, evidence: String) -> Error {
        Error::FoldStateLost {
            collection: self.collection.name().to_owned(),
            evidence,
        }
    }

    async fn conditioned(
        &self,
        session: &mut ClientSession,
        filter: Document,
        update: Document,
        operation: &'static str,
    ) -> Result<bool, Error> {
        let written = self
            .store
            .update_one_in(session, &self.collection, filter, update, operation)
            .await?;
        Ok(written.matched_count == 1)
    }
}

/// The filter that finds the state document.
pub(crate) fn filter() -> Document {
    doc! { "_id": STATE_ID }
}

/// The filter of the state while `owner`'s pass `number` is in progress.
fn owned(owner: ObjectId, number: i64) -> Document {
    doc! { "_id": STATE_ID, field::INTENT_OWNER: owner, field::INTENT_PASS: number }
}
