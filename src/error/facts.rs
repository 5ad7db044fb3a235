//! What classification needs from a driver's error: its kind, code and
//! labels ([`Facts`]), and the codes other modules read.

use mongodb::bson::{Bson, Document};
use mongodb::error::{Error as MongoError, ErrorKind, RETRYABLE_WRITE_ERROR, WriteFailure};

use super::{Effect, ErrorClass, code};

/// The kind of failure, reduced to what classification needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// An I/O error: connection refused or reset, a socket timeout.
    Io,
    /// The connection pool was cleared while the operation waited for a
    /// connection.
    PoolCleared,
    /// No suitable server was found within the selection timeout.
    ServerSelection,
    /// The server answered `ok: 0` with this code.
    Command(i32),
    /// The server reported a write error with this code.
    Write(i32),
    /// The server applied the write but reported a write-concern error with
    /// this code.
    WriteConcern(i32),
    /// The driver refused the operation before sending it (bad argument,
    /// serialization, authentication, client shut down).
    ClientRefused,
    /// Anything else the driver reports (an unreadable reply, an internal
    /// error): the request may have been sent.
    Other,
}

/// The facts about a driver error that classification uses: its kind, its
/// code and whether it carries the `RetryableWriteError` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Facts {
    /// The kind of failure, with the server's code where there is one.
    pub(crate) kind: FailureKind,
    /// Whether the error carries the `RetryableWriteError` label.
    pub(crate) retryable_label: bool,
}

impl Facts {
    /// Extracts the facts from a driver error.
    pub(crate) fn of(err: &MongoError) -> Self {
        let kind = match err.kind.as_ref() {
            ErrorKind::Io(_) => FailureKind::Io,
            ErrorKind::ConnectionPoolCleared { .. } => FailureKind::PoolCleared,
            ErrorKind::ServerSelection { .. } => FailureKind::ServerSelection,
            ErrorKind::Command(command) => FailureKind::Command(command.code),
            ErrorKind::Write(WriteFailure::WriteError(write)) => FailureKind::Write(write.code),
            ErrorKind::Write(WriteFailure::WriteConcernError(wce)) => {
                FailureKind::WriteConcern(wce.code)
            }
            ErrorKind::InsertMany(insert) => {
                match (&insert.write_errors, &insert.write_concern_error) {
                    (Some(errors), _) if !errors.is_empty() => FailureKind::Write(errors[0].code),
                    (_, Some(wce)) => FailureKind::WriteConcern(wce.code),
                    _ => FailureKind::Other,
                }
            }
            ErrorKind::InvalidArgument { .. }
            | ErrorKind::Authentication { .. }
            | ErrorKind::BsonSerialization(_)
            | ErrorKind::InvalidTlsConfig { .. }
            | ErrorKind::SessionsNotSupported
            | ErrorKind::IncompatibleServer { .. }
            | ErrorKind::DnsResolve { .. }
            | ErrorKind::Shutdown => FailureKind::ClientRefused,
            _ => FailureKind::Other,
        };
        Self {
            kind,
            retryable_label: err.contains_label(RETRYABLE_WRITE_ERROR),
        }
    }

    /// The error class (the book: design/errors.md).
    pub(crate) fn class(self) -> ErrorClass {
        let transient_code = |c: i32| code::TRANSIENT.contains(&c) || self.retryable_label;
        let duplicate_code = |c: i32| code::DUPLICATE_KEY_CODES.contains(&c);
        match self.kind {
            FailureKind::Io | FailureKind::PoolCleared => ErrorClass::Transient,
            // An outage longer than the selection timeout is not transient:
            // retrying would only wait again.
            FailureKind::ServerSelection => ErrorClass::Command,
            FailureKind::Command(c) | FailureKind::Write(c) if duplicate_code(c) => {
                ErrorClass::DuplicateKey
            }
            FailureKind::Command(c) | FailureKind::Write(c) | FailureKind::WriteConcern(c)
                if transient_code(c) =>
            {
                ErrorClass::Transient
            }
            FailureKind::Command(_)
            | FailureKind::Write(_)
            | FailureKind::WriteConcern(_)
            | FailureKind::ClientRefused
            | FailureKind::Other => ErrorClass::Command,
        }
    }

    /// The class of a failed *read* (find, aggregate, getMore): the write
    /// rule, plus [`code::READ_TRANSIENT`] — a read applies nothing, so a
    /// cursor the server lost or a majority snapshot not ready yet is worth
    /// one more try.
    pub(crate) fn read_class(self) -> ErrorClass {
        match self.kind {
            FailureKind::Command(c) if code::READ_TRANSIENT.contains(&c) => ErrorClass::Transient,
            _ => self.class(),
        }
    }

    /// What the failure tells about the write it carried.
    pub(crate) fn effect(self) -> Effect {
        match (self.kind, self.class()) {
            (FailureKind::WriteConcern(_), _) => Effect::AppliedUnconfirmed,
            (FailureKind::ServerSelection | FailureKind::ClientRefused, _) => Effect::NotApplied,
            // The server answered and refused: nothing was written.
            (FailureKind::Command(_) | FailureKind::Write(_), ErrorClass::Command)
            | (_, ErrorClass::DuplicateKey) => Effect::NotApplied,
            // A lost reply, or a node that stepped down while working on it.
            _ => Effect::MaybeApplied,
        }
    }
}

/// The server's error code, when the server answered with one (a command
/// error, a write error or a write-concern error). For the daemon's
/// change-stream monitor and the ledger's index check.
pub(crate) fn server_code(err: &MongoError) -> Option<i32> {
    match Facts::of(err).kind {
        FailureKind::Command(code) | FailureKind::Write(code) | FailureKind::WriteConcern(code) => {
            Some(code)
        }
        _ => None,
    }
}

/// For a duplicate-key error, whether the duplicate is on `_id` — a race
/// for the same document — rather than on another unique index, which no
/// retry can fix. Read from the `keyPattern` the server attaches (MongoDB
/// 4.4+); `None` when the error is not a duplicate key or the server did not
/// say.
pub(crate) fn duplicate_on_id(err: &MongoError) -> Option<bool> {
    if ErrorClass::of(err) != ErrorClass::DuplicateKey {
        return None;
    }
    let reply = Document::try_from(err.server_response()?).ok()?;
    let pattern = match reply.get("keyPattern") {
        Some(Bson::Document(pattern)) => pattern.clone(),
        _ => reply
            .get_array("writeErrors")
            .ok()?
            .first()?
            .as_document()?
            .get_document("keyPattern")
            .ok()?
            .clone(),
    };
    Some(pattern.keys().eq(["_id"]))
}

impl super::Error {
    /// Whether the server refused the credentials (every operation on
    /// it fails the same way; a missing privilege may be one collection's).
    #[cfg(feature = "daemon")]
    pub(crate) fn is_authentication_failure(&self) -> bool {
        matches!(self, Self::Server(failure) if
            matches!(failure.source.kind.as_ref(), mongodb::error::ErrorKind::Authentication { .. })
                || server_code(&failure.source) == Some(super::code::AUTHENTICATION_FAILED))
    }
}
