//! Sending fold statements to the server and reading what it did.
//!
//! A batch's statements go in `update` commands with `ordered: false`, each
//! command at most [`COMMAND_BYTES`] of statements (the server takes 16 MiB
//! per command; a batch of documents holding large arrays takes several).
//! The reply says, per command, how many documents were modified, which
//! statements the server refused (`writeErrors`, by index) and whether the
//! write concern was met (`writeConcernError`). Each is read here:
//!
//! - a refused statement whose error is about the document (a validator, a
//!   document grown too large, a duplicate on a unique index) refuses that
//!   document: it is reported and the rest goes on;
//! - a refusal the retry rule calls transient (the node stepping down, a
//!   shutdown) or a write-concern error is a failure of the command,
//!   classified like any server error: transient ones are sent again once —
//!   safe, every statement is conditioned on what it removes — and anything
//!   else fails the run, which the daemon retries later. A reply with a
//!   write-concern error is never taken for a success.

use mongodb::bson::{Bson, Document, doc};
use mongodb::error::{Error as MongoError, ErrorKind, WriteConcernError, WriteError, WriteFailure};

use super::statement::Statement;
use crate::document::integer_value;
use crate::error::{Error, ErrorClass, Next, RetryBudget};
use crate::store::Store;

/// The most bytes of statements one `update` command carries: half the
/// server's 16 MiB command limit, leaving room for the command itself.
pub(crate) const COMMAND_BYTES: usize = 8 << 20;

/// A statement the server refused, and why.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    /// The document it belongs to (the caller's index).
    pub(crate) document: usize,
    /// The server's error code.
    pub(crate) code: i32,
    /// The server's message, scrubbed of the connection's secrets.
    pub(crate) message: String,
}

/// What the server did with a batch of statements.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// Statements that changed their document.
    pub(crate) modified: u64,
    /// Statements refused for a reason of their document's.
    pub(crate) refused: Vec<Refusal>,
}

/// Sends `statements` (each with the index of its document) to collection
/// `collection`, in order, in as many commands as their size needs.
pub(crate) async fn send(
    store: &Store,
    collection: &str,
    statements: &[(usize, &Statement)],
) -> Result<Outcome, Error> {
    let mut outcome = Outcome::default();
    let mut start = 0;
    while start < statements.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < statements.len()
            && (end == start || bytes + statements[end].1.bytes <= COMMAND_BYTES)
        {
            bytes += statements[end].1.bytes;
            end += 1;
        }
        send_command(store, collection, &statements[start..end], &mut outcome).await?;
        start = end;
    }
    Ok(outcome)
}

/// One `update` command, retried once (without the statements it refused)
/// after a transient failure.
async fn send_command(
    store: &Store,
    collection: &str,
    statements: &[(usize, &Statement)],
    outcome: &mut Outcome,
) -> Result<(), Error> {
    let mut live: Vec<&(usize, &Statement)> = statements.iter().collect();
    let mut budget = RetryBudget::retry_once("reconcile.fold");
    loop {
        let mut command = doc! {
            "update": collection,
            "updates": live.iter().map(|(_, s)| Bson::Document(s.body.clone())).collect::<Vec<_>>(),
            "ordered": false,
        };
        if let Some(concern) = store.database().write_concern() {
            let concern = mongodb::bson::serialize_to_document(concern).map_err(|err| {
                Error::InvalidArgument(format!("cannot encode the write concern: {err}"))
            })?;
            command.insert("writeConcern", concern);
        }
        budget.start_attempt();
        let reply = match store.attempt(store.database().run_command(command)).await {
            Ok(reply) => Reply::read(&reply)?,
            Err(err) => match store.after_failure(&mut budget, err) {
                Next::Retry => continue,
                Next::GiveUp(failure) => return Err(Error::Server(failure)),
            },
        };
        outcome.modified += reply.modified;
        let mut failure = reply.write_concern_error;
        let mut refused = Vec::new();
        for (index, error) in reply.write_errors {
            let Some((document, _)) = live.get(index) else {
                continue;
            };
            let code = error.code;
            let message = store.scrub(&error.message);
            let error = MongoError::from(ErrorKind::Write(WriteFailure::WriteError(error)));
            if ErrorClass::of(&error) == ErrorClass::Transient {
                failure.get_or_insert(error);
            } else {
                refused.push(index);
                outcome.refused.push(Refusal {
                    document: *document,
                    code,
                    message,
                });
            }
        }
        let Some(error) = failure else {
            return Ok(());
        };
        match store.after_failure(&mut budget, error) {
            Next::Retry => {
                live = live
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| !refused.contains(i))
                    .map(|(_, s)| s)
                    .collect();
            }
            Next::GiveUp(failure) => return Err(Error::Server(failure)),
        }
    }
}

/// An `update` command's reply, read.
struct Reply {
    modified: u64,
    write_errors: Vec<(usize, WriteError)>,
    write_concern_error: Option<MongoError>,
}

impl Reply {
    fn read(reply: &Document) -> Result<Self, Error> {
        let unreadable = |err: &dyn std::fmt::Display| {
            Error::InvalidArgument(format!("cannot read the fold's reply: {err}"))
        };
        let modified = reply
            .get("nModified")
            .and_then(integer_value)
            .unwrap_or(0)
            .max(0) as u64;
        let mut write_errors = Vec::new();
        if let Ok(errors) = reply.get_array("writeErrors") {
            for error in errors.iter().filter_map(Bson::as_document) {
                let index = error.get("index").and_then(integer_value).unwrap_or(-1);
                let error: WriteError = mongodb::bson::deserialize_from_document(error.clone())
                    .map_err(|err| unreadable(&err))?;
                if let Ok(index) = usize::try_from(index) {
                    write_errors.push((index, error));
                }
            }
        }
        let write_concern_error = match reply.get_document("writeConcernError") {
            Ok(error) => {
                let mut error = error.clone();
                // The server puts the labels (`RetryableWriteError`) beside
                // the error, at the top of the reply.
                if let Ok(labels) = reply.get_array("errorLabels") {
                    error.insert("errorLabels", labels.clone());
                }
                let error: WriteConcernError = mongodb::bson::deserialize_from_document(error)
                    .map_err(|err| unreadable(&err))?;
                Some(ErrorKind::Write(WriteFailure::WriteConcernError(error)).into())
            }
            Err(_) => None,
        };
        Ok(Self {
            modified,
            write_errors,
            write_concern_error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Effect;

    #[test]
    fn a_reply_names_refused_statements_by_index() {
        let reply = doc! {
            "n": 3, "nModified": 2, "ok": 1.0,
            "writeErrors": [{ "index": 1, "code": 121, "errmsg": "Document failed validation" }],
        };
        let reply = Reply::read(&reply).unwrap();
        assert_eq!(reply.modified, 2);
        assert_eq!(reply.write_errors.len(), 1);
        assert_eq!(reply.write_errors[0].0, 1);
        assert_eq!(reply.write_errors[0].1.code, 121);
        assert!(reply.write_concern_error.is_none());
    }

    #[test]
    fn a_write_concern_error_is_classified_with_the_replys_labels() {
        let labelled = doc! {
            "n": 1, "nModified": 1, "ok": 1.0,
            "writeConcernError": { "code": 64, "codeName": "WriteConcernFailed", "errmsg": "waiting" },
            "errorLabels": ["RetryableWriteError"],
        };
        let error = Reply::read(&labelled).unwrap().write_concern_error.unwrap();
        assert_eq!(ErrorClass::of(&error), ErrorClass::Transient);
        assert_eq!(Effect::of(&error), Effect::AppliedUnconfirmed);
        let plain = doc! {
            "n": 1, "nModified": 1, "ok": 1.0,
            "writeConcernError": { "code": 100, "codeName": "UnsatisfiableWriteConcern", "errmsg": "no" },
        };
        let error = Reply::read(&plain).unwrap().write_concern_error.unwrap();
        assert_eq!(ErrorClass::of(&error), ErrorClass::Command);
        let listed = doc! {
            "n": 1, "nModified": 1, "ok": 1.0,
            "writeConcernError": { "code": 91, "codeName": "ShutdownInProgress", "errmsg": "bye" },
        };
        let error = Reply::read(&listed).unwrap().write_concern_error.unwrap();
        assert_eq!(ErrorClass::of(&error), ErrorClass::Transient);
    }
}
