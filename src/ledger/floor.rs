//! The events collection's **floor**: a validator `{s: {$gt: F}}` that
//! makes the server refuse any event numbered at or below `F`.
//!
//! The fold raises the floor to a pass's end `W'` (with write concern
//! `majority`) *before* it reads the events of `(W, W']`. From then on no
//! insert numbered in that range can land — not a late retry, not an insert
//! held up in the network, not a recorder whose clock is behind — and every
//! one that landed before is visible to a majority read (on MongoDB,
//! `collMod` takes the collection's exclusive lock: inserts in progress
//! finish first, and their oplog entries come before it). So the range read
//! once is the range for good, and the fold needs no memory of lanes.
//!
//! A recorder whose insert meets the floor (`DocumentValidationFailure`)
//! wrote nothing: it numbers the events again above it and sends them again
//! (see the recorder).
//!
//! **A floor that was lowered behind the fold's back.** `collMod` sets the
//! validator; it cannot only raise it. A `collMod` of an earlier pass held
//! up in the network (or sent again by a router) can reach the server after
//! a later pass raised the floor higher, and lower it: an insert numbered
//! below the watermark can then land where no pass looks. Every raise
//! therefore carries a token of its own in the validator (a clause no event
//! matches: `tally_floor: {$ne: <token>}`), and the fold state remembers
//! the last raise (`Raise`: value, token, and the cluster time it took
//! effect). A floor whose token is not the one remembered was changed since
//! — and so was one a raise replaced (`raise_over` reads what its own
//! `collMod` replaced from the change stream's `modify` event). The fold
//! then owes the events numbered at or below the remembered floor that
//! landed after its cluster time, and finds exactly those in the change
//! stream (`history`): the server's own log of what landed when.

mod history;

pub(crate) use history::{Watch, landed};

use mongodb::bson::{Bson, Document, Timestamp, doc, oid::ObjectId};

use super::field;
use crate::document::integer_value;
use crate::error::{Error, RetryBudget, code, server_code};
use crate::store::Store;

/// `NamespaceNotFound`: no events collection yet.
const NAMESPACE_NOT_FOUND: i32 = 26;
/// `NamespaceExists`: another fold created it meanwhile.
const NAMESPACE_EXISTS: i32 = 48;

/// The validator's clause naming the raise that set it: no event has the
/// field, so `$ne` always holds.
const TOKEN: &str = "tally_floor";

/// One raise of the floor, as the fold state remembers it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Raise {
    /// The floor it set: events numbered at or below it are refused.
    pub(crate) floor: i64,
    /// Its token, in the validator while no other `collMod` replaced it.
    pub(crate) token: String,
    /// The cluster time its `collMod` took effect (its `operationTime`).
    pub(crate) at: Timestamp,
}

impl Raise {
    /// The raise as stored in the fold state.
    pub(crate) fn to_document(&self) -> Document {
        doc! { "f": self.floor, "t": &self.token, "at": self.at }
    }

    /// The raise stored as `document`, or what is wrong with it.
    pub(crate) fn from_document(document: &Document) -> Result<Self, String> {
        Ok(Self {
            floor: document
                .get("f")
                .and_then(integer_value)
                .ok_or("its floor is not an integer")?,
            token: document
                .get_str("t")
                .map_err(|_| "its token is not a string")?
                .to_owned(),
            at: document
                .get_timestamp("at")
                .map_err(|_| "its cluster time is not a timestamp")?,
        })
    }
}

/// The floor as read from the collection's options.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Floor {
    /// Its value (`None`: no floor).
    pub(crate) value: Option<i64>,
    /// The token of the raise that set it (`None`: a floor no raise of
    /// this version set, or none).
    pub(crate) token: Option<String>,
    /// The validator is enforced: `validationLevel` strict and
    /// `validationAction` error (the defaults, and what a raise sets).
    pub(crate) enforced: bool,
}

impl Floor {
    /// Whether it is the floor `raise` set, enforced and untouched since.
    pub(crate) fn is(&self, raise: &Raise) -> bool {
        self.enforced && self.token.as_deref() == Some(raise.token.as_str())
    }

    /// The floor a collection's options (`listCollections`' `options`, a
    /// change event's `collectionOptions`) set.
    pub(crate) fn of(options: &Document) -> Self {
        let setting =
            |name: &str, default: &str| options.get_str(name).unwrap_or(default).to_owned();
        let enforced = setting("validationLevel", "strict") == "strict"
            && setting("validationAction", "error") == "error";
        match options.get_document("validator") {
            Ok(validator) => Self {
                enforced,
                ..floor_of(validator)
            },
            Err(_) => Self::default(),
        }
    }
}

/// The validator that refuses events numbered at or below `floor`, naming
/// its raise by `token`.
fn validator(floor: i64, token: &str) -> Document {
    doc! { field::NUMBER: { "$gt": floor }, TOKEN: { "$ne": token } }
}

/// Raises the floor of the events collection `events` to `floor`
/// (creating the collection when it does not exist yet), at write concern
/// `majority`, and says which raise it was. Each attempt carries a token of
/// its own; retried once on a transient failure. `created` is true when the
/// raise created the collection (nothing was replaced). `before` is a
/// cluster time before it took effect (a `ping`'s): where the change stream
/// shows it from, whatever the `collMod`'s own `operationTime` says (the
/// test server's may come a tick after its oplog entry).
async fn set(store: &Store, events: &str, floor: i64) -> Result<Raised, Error> {
    let database = store.database();
    let before = cluster_time(store, events).await?;
    let command = |verb: &str, token: &str| {
        let mut command = doc! { verb: events };
        command.insert("validator", validator(floor, token));
        command.insert("validationLevel", "strict");
        command.insert("validationAction", "error");
        command.insert("writeConcern", doc! { "w": "majority" });
        command
    };
    let run = |verb: &'static str| {
        let database = database.clone();
        async move {
            let mut budget = RetryBudget::retry_once("ledger.fold.floor");
            store
                .with_retry(&mut budget, || {
                    let token = ObjectId::new().to_hex();
                    let command = command(verb, &token);
                    let database = database.clone();
                    async move { database.run_command(command).await.map(|r| (token, r)) }
                })
                .await
        }
    };
    let (created, (token, reply)) = match run("collMod").await {
        Err(failure) if server_code(&failure.source) == Some(NAMESPACE_NOT_FOUND) => {
            match run("create").await {
                // Created meanwhile (by another fold, or a recorder's
                // insert): modify it.
                Err(failure) if server_code(&failure.source) == Some(NAMESPACE_EXISTS) => {
                    (false, run("collMod").await.map_err(Error::Server)?)
                }
                done => (true, done.map_err(Error::Server)?),
            }
        }
        done => (false, done.map_err(Error::Server)?),
    };
    let at = reply
        .get_timestamp("operationTime")
        .map_err(|_| no_cluster_time(events))?;
    Ok(Raised {
        raise: Raise { floor, token, at },
        created,
        before,
    })
}

/// What [`set`] did.
struct Raised {
    raise: Raise,
    created: bool,
    before: Timestamp,
}

/// The server's cluster time now (a `ping`'s `operationTime`): anything
/// written after has a later one. `events` names the ledger in errors.
pub(crate) async fn cluster_time(store: &Store, events: &str) -> Result<Timestamp, Error> {
    let database = store.database();
    let mut budget = RetryBudget::read_once("ledger.fold.cluster_time");
    store
        .with_retry(&mut budget, || database.run_command(doc! { "ping": 1 }))
        .await
        .map_err(Error::Server)?
        .get_timestamp("operationTime")
        .map_err(|_| no_cluster_time(events))
}

/// Raises the floor of `events` to `floor` over the raise `expected` (the
/// last one the fold state remembers; `None` when it remembers none) and
/// says whether the validator it replaced was another's: a `collMod` no
/// raise remembered made, which may have lowered the floor. The raise's
/// `at` is the cluster time of its own `modify` event, read through
/// `watch` (the fold's stream, kept from one raise to the next).
pub(crate) async fn raise_over(
    store: &Store,
    events: &str,
    floor: i64,
    expected: Option<&Raise>,
    watch: &Watch,
) -> Result<(Raise, bool), Error> {
    let since = expected.map(|expected| expected.at);
    watch.prepare(store, events, since).await;
    let Raised {
        raise,
        created,
        before,
    } = set(store, events, floor).await?;
    if created {
        // The collection was gone: the floor with it, and the end of any
        // stream kept on it.
        watch.forget().await;
        return Ok((raise, expected.is_some()));
    }
    // The raise's own `modify` event says what it replaced, and when it
    // took effect: its cluster time, exactly (the reply's `operationTime`
    // may name a later one on the test server), is where the debts and
    // windows that start at this raise start.
    let replaced = history::replaced(store, events, &raise, (since, before), watch).await?;
    let raise = Raise {
        at: replaced.at,
        ..raise
    };
    // Another's validator replaced, or any validation change between the
    // remembered raise and this one (the floor taken away and put back).
    let foreign = expected.is_some_and(|expected| !replaced.floor.is(expected))
        || replaced.changed == Some(true);
    Ok((raise, foreign))
}

/// Raises the floor of `events` to `floor`, whatever it replaced.
pub(crate) async fn raise(
    store: &Store,
    events: &str,
    floor: i64,
    watch: &Watch,
) -> Result<Raise, Error> {
    raise_over(store, events, floor, None, watch)
        .await
        .map(|(raise, _)| raise)
}

/// The floor of the events collection `events` as its validator says:
/// empty when it has none (a ledger never folded, or no collection).
pub(crate) async fn read_floor(store: &Store, events: &str) -> Result<Floor, Error> {
    let database = store.database();
    let command = doc! { "listCollections": 1, "filter": { "name": events } };
    let mut budget = RetryBudget::read_once("ledger.read_floor");
    let reply = store
        .with_retry(&mut budget, || database.run_command(command.clone()))
        .await
        .map_err(Error::Server)?;
    let options = reply
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .and_then(|batch| batch.first())
        .and_then(Bson::as_document)
        .and_then(|c| c.get_document("options").ok());
    Ok(options.map(Floor::of).unwrap_or_default())
}

/// The floor of the events collection `events`: `None` when it has none.
pub(crate) async fn read(store: &Store, events: &str) -> Result<Option<i64>, Error> {
    read_floor(store, events).await.map(|floor| floor.value)
}

/// The floor a validator sets, if it is the fold's.
fn floor_of(validator: &Document) -> Floor {
    let value = validator
        .get_document(field::NUMBER)
        .ok()
        .and_then(|s| s.get("$gt"))
        .and_then(integer_value);
    let token = validator
        .get_document(TOKEN)
        .ok()
        .and_then(|t| t.get_str("$ne").ok())
        .map(str::to_owned);
    Floor {
        value,
        token,
        enforced: true,
    }
}

/// The token of the raise that set `validator` (`None`: none did).
fn token_of(validator: &Document) -> Option<String> {
    floor_of(validator).token
}

/// The error of a server that does not say when a write took effect: not a
/// replica set member.
fn no_cluster_time(events: &str) -> Error {
    Error::FoldFloorUnverified {
        events: events.to_owned(),
        why: "the server did not say when its floor took effect (no operationTime): the ledger \
              needs a replica set or a sharded cluster"
            .into(),
    }
}

/// Whether `failure`'s code says an insert met the floor.
pub(crate) fn refused_by_floor(code: i32) -> bool {
    code == code::DOCUMENT_VALIDATION_FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_reads_back_from_its_validator() {
        let floor = floor_of(&validator(42, "t1"));
        assert_eq!(floor.value, Some(42));
        assert_eq!(token_of(&validator(42, "t1")).as_deref(), Some("t1"));
        let raise = Raise {
            floor: 42,
            token: "t1".into(),
            at: Timestamp {
                time: 5,
                increment: 1,
            },
        };
        assert!(floor.is(&raise));
        assert!(!floor_of(&validator(42, "t2")).is(&raise));
        assert_eq!(
            Raise::from_document(&raise.to_document()),
            Ok(raise.clone())
        );
        // A floor of the version before tokens: its value, no token.
        let old = floor_of(&doc! { "s": { "$gt": 7i64 } });
        assert_eq!((old.value, old.token), (Some(7), None));
        assert_eq!(floor_of(&doc! { "other": 1 }).value, None);
        // A validator not enforced is no floor of the raise's.
        let options = |level: &str, action: &str| {
            doc! { "validator": validator(42, "t1"), "validationLevel": level,
            "validationAction": action }
        };
        assert!(Floor::of(&options("strict", "error")).is(&raise));
        assert!(!Floor::of(&options("off", "error")).is(&raise));
        assert!(!Floor::of(&options("moderate", "error")).is(&raise));
        assert!(!Floor::of(&options("strict", "warn")).is(&raise));
        assert!(Floor::of(&doc! { "validator": validator(42, "t1") }).is(&raise));
        assert!(!Floor::of(&doc! {}).is(&raise));
        assert!(refused_by_floor(121));
        assert!(!refused_by_floor(11000));
    }
}
