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
//! (see the recorder). The floor only rises: a fold raises it to its own
//! pass's end, and passes follow each other.

use mongodb::bson::{Bson, Document, doc};

use super::field;
use crate::document::integer_value;
use crate::error::{Error, RetryBudget, code, server_code};
use crate::store::Store;

/// `NamespaceNotFound`: no events collection yet.
const NAMESPACE_NOT_FOUND: i32 = 26;
/// `NamespaceExists`: another fold created it meanwhile.
const NAMESPACE_EXISTS: i32 = 48;

/// The validator that refuses events numbered at or below `floor`.
fn validator(floor: i64) -> Document {
    doc! { field::NUMBER: { "$gt": floor } }
}

/// Raises the floor of the events collection `events` to `floor`
/// (creating the collection when it does not exist yet), at write concern
/// `majority`. Idempotent; retried once on a transient failure.
pub(crate) async fn raise(store: &Store, events: &str, floor: i64) -> Result<(), Error> {
    let database = store.database();
    let majority = doc! { "w": "majority" };
    let modify = doc! {
        "collMod": events,
        "validator": validator(floor),
        "validationLevel": "strict",
        "validationAction": "error",
        "writeConcern": majority.clone(),
    };
    let create = doc! {
        "create": events,
        "validator": validator(floor),
        "validationLevel": "strict",
        "validationAction": "error",
        "writeConcern": majority,
    };
    let run = |command: Document| async move {
        let mut budget = RetryBudget::retry_once("ledger.fold.floor");
        store
            .with_retry(&mut budget, || database.run_command(command.clone()))
            .await
            .map(|_| ())
    };
    match run(modify.clone()).await {
        Err(failure) if server_code(&failure.source) == Some(NAMESPACE_NOT_FOUND) => {}
        done => return done.map_err(Error::Server),
    }
    match run(create).await {
        // Created meanwhile (by another fold, or a recorder's insert):
        // modify it.
        Err(failure) if server_code(&failure.source) == Some(NAMESPACE_EXISTS) => {
            run(modify).await.map_err(Error::Server)
        }
        done => done.map_err(Error::Server),
    }
}

/// The floor of the events collection `events`: `None` when it has none
/// (a ledger never folded, or no collection).
pub(crate) async fn read(store: &Store, events: &str) -> Result<Option<i64>, Error> {
    let database = store.database();
    let command = doc! { "listCollections": 1, "filter": { "name": events } };
    let mut budget = RetryBudget::read_once("ledger.read_floor");
    let reply = store
        .with_retry(&mut budget, || database.run_command(command.clone()))
        .await
        .map_err(Error::Server)?;
    let validator = reply
        .get_document("cursor")
        .ok()
        .and_then(|c| c.get_array("firstBatch").ok())
        .and_then(|batch| batch.first())
        .and_then(Bson::as_document)
        .and_then(|c| c.get_document("options").ok())
        .and_then(|o| o.get_document("validator").ok());
    Ok(validator.and_then(floor_of))
}

/// The floor a validator sets, if it is the fold's.
fn floor_of(validator: &Document) -> Option<i64> {
    validator
        .get_document(field::NUMBER)
        .ok()?
        .get("$gt")
        .and_then(integer_value)
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
        assert_eq!(floor_of(&validator(42)), Some(42));
        assert_eq!(floor_of(&doc! { "other": 1 }), None);
        assert!(refused_by_floor(121));
        assert!(!refused_by_floor(11000));
    }
}
