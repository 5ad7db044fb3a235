//! Error classes and the retry-once rule (the book: design/errors.md).
//!
//! Every failed attempt against the server falls into exactly one
//! [`ErrorClass`]: *transient* (retried once, and only for idempotent
//! operations), *duplicate key* (what it means depends on the operation) or
//! *command* (never retried). Classification looks at the error's kind, code
//! and labels — never at its message text — and is a pure function of
//! [`Facts`] extracted from the driver's error, so every case is unit-tested
//! here, including kinds the driver does not let other crates construct.
//!
//! Orthogonal to the class is the [`Effect`]: what the failure tells about the
//! write it carried. "Not counted" may only be promised when the effect is
//! [`Effect::NotApplied`]. tally owns its retries (the driver's retry of
//! writes is off on every client tally uses, see `store`), so it knows how
//! often each write was sent: a server's refusal of a write sent once is a
//! definite "not applied".
//!
//! [`RetryBudget`] applies the rule inside each operation's loop and logs
//! every retry with its class and attempt number.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use mongodb::error::Error as MongoError;

pub(crate) mod code;
mod facts;
mod message;
mod retry;

pub(crate) use facts::{Facts, FailureKind, duplicate_on_id, server_code};

pub(crate) use retry::{Next, RetryBudget};

pub(crate) use message::{Reach, Readable, human_duration, words};
#[cfg(feature = "daemon")]
pub(crate) use message::{
    Trouble, cannot_read, counted, other_set, server_code_and_name, trouble_reaching,
};

/// The class of a failed attempt, which decides whether it is retried.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::{ErrorClass, Increment};
///
/// if let Increment::NotCounted(not) = views.increment("home", 1).await {
///     match not.cause().class() {
///         // Worth trying again later: the server or the network was busy.
///         Some(ErrorClass::Transient) => eprintln!("try again: {}", not.cause()),
///         Some(ErrorClass::DuplicateKey | ErrorClass::Command) | None => {
///             eprintln!("fix this first: {}", not.cause())
///         }
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The attempt may not have reached the server or its reply was lost, or
    /// the node was not able to serve it right now. Retried once, and only
    /// when the operation is idempotent.
    Transient,
    /// A unique index rejected the write. Whether to retry depends on the
    /// operation: an upsert race applied nothing and is retried; for an
    /// insert retry it may mean the first attempt worked.
    DuplicateKey,
    /// Everything else: the server refused the command (auth, bad value,
    /// validation, document too large), no server could be selected, or the
    /// driver refused it before sending. Never retried.
    Command,
}

impl ErrorClass {
    /// Classifies a driver error.
    ///
    /// ```
    /// use tally::ErrorClass;
    ///
    /// // A reply that never came: the driver's I/O timeout.
    /// let lost = mongodb::error::Error::from(std::io::ErrorKind::TimedOut);
    /// assert_eq!(ErrorClass::of(&lost), ErrorClass::Transient);
    /// ```
    pub fn of(err: &MongoError) -> Self {
        Facts::of(err).class()
    }

    /// The lower-case name used in logs and JSON output.
    ///
    /// ```
    /// use tally::ErrorClass;
    ///
    /// assert_eq!(ErrorClass::DuplicateKey.as_str(), "duplicate_key");
    /// assert_eq!(ErrorClass::Transient.to_string(), "transient");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::DuplicateKey => "duplicate_key",
            Self::Command => "command",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a failed attempt tells about the write it carried.
///
/// ```
/// use tally::{Effect, Error};
///
/// // What a failed write leaves behind decides how to go on.
/// fn next_step(err: &Error) -> &'static str {
///     match err {
///         Error::Server(failure) => match failure.effect {
///             Effect::NotApplied => "nothing was written: send it again or give up",
///             Effect::MaybeApplied => "unknown: settle it with its ticket",
///             Effect::AppliedUnconfirmed => "written, not yet on a majority: settle it",
///         },
///         _ => "refused before anything was sent",
///     }
/// }
/// let zero = Error::InvalidArgument("the amount must not be zero".into());
/// assert_eq!(next_step(&zero), "refused before anything was sent");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The write was definitely not applied: the server refused it (and the
    /// driver did not retry it, or the server said no attempt wrote
    /// anything), no server was selected, or the driver never sent it.
    NotApplied,
    /// The write may or may not have been applied (a lost reply, a reset
    /// connection, an unreadable response).
    MaybeApplied,
    /// The write was applied on the primary but its write concern was not
    /// confirmed: it may still be rolled back by a failover.
    AppliedUnconfirmed,
}

impl Effect {
    /// The effect of a failed write attempt.
    ///
    /// ```
    /// use tally::Effect;
    ///
    /// let lost = mongodb::error::Error::from(std::io::ErrorKind::TimedOut);
    /// assert_eq!(Effect::of(&lost), Effect::MaybeApplied);
    /// ```
    pub fn of(err: &MongoError) -> Self {
        Facts::of(err).effect()
    }
}

/// A failed attempt against the server, classified.
///
/// Its `Display` is for people: what failed in one sentence (the server's
/// message with its code and code name, the host that refused the
/// connection, the user whose authentication failed), then what to do
/// where tally knows — never the driver's internal formatting. Programs
/// read the fields.
///
/// ```no_run
/// # async fn demo(seats: tally::BoundedCounters) {
/// use tally::{Effect, Error};
///
/// if let Err(Error::Server(failure)) = seats.available("gig-2026-06-01").await {
///     // People read the Display; programs read the fields.
///     eprintln!("error: {failure}");
///     let written = match failure.effect {
///         Effect::NotApplied => "nothing was written",
///         Effect::MaybeApplied | Effect::AppliedUnconfirmed => "it may have been written",
///     };
///     let (operation, attempts, class) = (failure.operation, failure.attempts, failure.class);
///     tracing::warn!(operation, attempts, %class, "{written}");
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Failure {
    /// The operation that failed, e.g. `increment.add_token`.
    pub operation: &'static str,
    /// The error class of the last attempt.
    pub class: ErrorClass,
    /// What the last attempt tells about its write.
    pub effect: Effect,
    /// How many attempts were made, the failed one included.
    pub attempts: u32,
    /// The driver's error for the last attempt.
    pub source: MongoError,
    /// Where the operation was sent, for the message (the store adds it).
    reach: Option<Arc<Reach>>,
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

impl Failure {
    /// A failure that is not retried where it happens (a cursor that broke
    /// off mid-stream cannot be resumed): classified, one attempt.
    pub(crate) fn once(operation: &'static str, source: MongoError) -> Box<Self> {
        let facts = Facts::of(&source);
        Box::new(Self {
            operation,
            class: facts.class(),
            effect: facts.effect(),
            attempts: 1,
            source,
            reach: None,
        })
    }

    /// The same failure, its message naming where the operation went.
    pub(crate) fn with_reach(mut self: Box<Self>, reach: Arc<Reach>) -> Box<Self> {
        self.reach = Some(reach);
        self
    }

    /// What the failure means to the person who asked.
    #[cfg(feature = "daemon")]
    pub(crate) fn trouble(&self) -> Trouble {
        trouble_reaching(&self.source, self.reach.as_deref())
    }
}

/// Errors the library returns. Each variant says what the caller can do next.
///
/// ```no_run
/// # async fn demo(ids: tally::Sequences) {
/// use tally::{Error, ErrorClass};
///
/// match ids.next("invoice").await {
///     Ok(number) => println!("invoice #{number}"),
///     Err(err @ Error::Server(_)) if err.class() == Some(ErrorClass::Transient) => {
///         eprintln!("try again later: {err}")
///     }
///     // One sentence for people: what failed, and what to do.
///     Err(err) => eprintln!("error: {err}"),
/// }
/// # }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The server or the network failed; [`Failure::class`] says whether it
    /// is worth trying again later.
    #[error(transparent)]
    Server(#[from] Box<Failure>),

    /// `resume` was asked to re-send step 1 for a token older than the retry
    /// horizon. Re-adding it could count twice if the daemon has already
    /// folded it, so nothing was sent: the increment is counted at most once.
    #[error(
        "token {token} is {age} old, past the retry horizon of {horizon}: nothing was sent; \
         the increment is counted at most once",
        age = human_duration(*.age),
        horizon = human_duration(*.horizon)
    )]
    RetryHorizonExceeded {
        /// The token, as 24 hex digits.
        token: String,
        /// The token's age when `resume` was called.
        age: Duration,
        /// The configured retry horizon.
        horizon: Duration,
    },

    /// A lane's ticket was not resumed: its lane is older than the resume
    /// horizon, and the daemon may prune the lane's entry from the document
    /// (`lane_ttl`), after which re-sending its update could count twice.
    /// Nothing was sent: the increment is counted at most once.
    #[error(
        "lane {lane} is {age} old, past the lane resume horizon of {horizon}: nothing was \
         sent; the increment is counted at most once",
        age = human_duration(*.age),
        horizon = human_duration(*.horizon)
    )]
    LaneResumeHorizonExceeded {
        /// The lane, as 24 hex digits.
        lane: String,
        /// The lane's age when the resume was refused.
        age: Duration,
        /// The configured lane resume horizon.
        horizon: Duration,
    },

    /// [`Ledger::record_again`](crate::Ledger::record_again) was given a
    /// ticket whose first attempt is older than the writers' retry horizon:
    /// the event may have been folded and its key forgotten after the dedupe
    /// window, so sending it again could count it twice. Nothing was sent:
    /// the event is recorded at most once.
    #[error(
        "event {event} was first sent {} ago, past the retry horizon of {}: nothing was sent; \
         the event is recorded at most once",
        humantime::format_duration(std::time::Duration::from_secs(age.as_secs())),
        humantime::format_duration(*horizon)
    )]
    EventRetryHorizonExceeded {
        /// The event's key.
        event: String,
        /// How long ago its first attempt was sent.
        age: Duration,
        /// The configured retry horizon.
        horizon: Duration,
    },

    /// `resume` was given another amount than the document holds for the
    /// token (pending, or in the marker of the settle that counted it):
    /// refused, nothing was written. The ticket and the document disagree
    /// about what the increment was; resume with the stored amount if the
    /// ticket is wrong.
    #[error(
        "token {token} was added with amount {stored}, not {given}: refused, nothing was written"
    )]
    AmountMismatch {
        /// The token, as 24 hex digits.
        token: String,
        /// The amount the document holds for the token.
        stored: i64,
        /// The amount the caller gave.
        given: i64,
    },

    /// The counter cannot take the amount: the sum would pass the int64
    /// limit. Refused before anything was written; not counted.
    #[error(
        "counter {collection}/{key} is {value} and cannot take {amount:+} without passing the \
         int64 limit: nothing was written, not counted"
    )]
    Overflow {
        /// The counter collection.
        collection: String,
        /// The counter's `_id`, as shown in logs.
        key: String,
        /// The counter's value when it was read.
        value: String,
        /// The amount refused.
        amount: i64,
    },

    /// The caller passed a value the operation cannot accept; nothing was
    /// sent.
    #[error("{0}")]
    InvalidArgument(String),

    /// The event's time is further ahead of this writer's clock than
    /// [`MAX_TIME_AHEAD`](crate::MAX_TIME_AHEAD) allows: a clock or a
    /// caller is wrong, and counting it would fill a bucket that has not
    /// begun. Refused before anything was sent; not counted.
    #[error(
        "the time {at} is {ahead} ahead of this writer's clock, more than the {bound} allowed: \
         nothing was sent, not counted; check the time given and this host's clock",
        ahead = human_duration(*.ahead),
        bound = human_duration(*.bound)
    )]
    TimeAhead {
        /// The time given, RFC 3339 in the collection's zone.
        at: String,
        /// How far ahead of the writer's clock it is.
        ahead: Duration,
        /// The bound ([`MAX_TIME_AHEAD`](crate::MAX_TIME_AHEAD)).
        bound: Duration,
    },

    /// The event's bucket ended more than the collection's `close_after`
    /// ago: the bucket takes no more writes (a reconcile run closes it, a
    /// margin later: [`Buckets::closes_at`](crate::Buckets::closes_at)). Refused
    /// before anything was sent; not counted.
    #[error(
        "the bucket {bucket} of {collection} takes no more writes: it ended {ended} ago, and its \
         buckets take writes for {close_after} after they end (close_after): nothing was sent, \
         not counted",
        ended = human_duration(*.ended_ago),
        close_after = human_duration(*.close_after)
    )]
    BucketClosed {
        /// The counter collection.
        collection: String,
        /// The bucket's start, RFC 3339 in the collection's zone.
        bucket: String,
        /// How long ago the bucket ended, by the writer's clock.
        ended_ago: Duration,
        /// The collection's `close_after`.
        close_after: Duration,
    },

    /// A document does not have the shape tally expects; it was not
    /// modified.
    #[error("document {id} in {collection} is malformed: {reason}")]
    Malformed {
        /// The collection.
        collection: String,
        /// The document's `_id`, as relaxed extended JSON.
        id: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An exact read's value does not fit an int64: the counter and its
    /// recorded events not folded yet add up past 2^63. Nothing was
    /// changed; the fold will hold the sum that does not fit.
    #[error("counter {key}: its value and its unfolded events add up past 2^63")]
    ExactValueTooLarge {
        /// The counter's `_id`, as shown in logs.
        key: String,
    },

    /// A fold pass stopped before it committed because it was no longer
    /// its fold's: its lease ran out (the server was unreachable too long)
    /// or another fold took it over. Nothing is lost: the pass is resumed
    /// by whichever fold holds it, and applying it again is a no-op.
    #[error("fold pass {pass} of {events} stopped: {why}; it is resumed by the next pass")]
    FoldPassLost {
        /// The events collection.
        events: String,
        /// The pass.
        pass: i64,
        /// What happened.
        why: String,
    },

    /// An events collection lacks the indexes its ledger's fold needs
    /// (`tallyd setup` creates them): the fold refused to run rather than
    /// scan the collection on every pass.
    #[error(
        "the events collection {collection} lacks the indexes {missing}: run `tallyd setup` \
         to create them",
        missing = words(.missing)
    )]
    IndexesMissing {
        /// The events collection.
        collection: String,
        /// The missing indexes, by name.
        missing: Vec<String>,
    },

    /// A ledger's fold state (`<events>_fold`) is missing while its
    /// counters or its events show it existed: it was dropped or lost.
    /// Folding again from nothing would count events twice or drop them,
    /// so the fold and exact reads of the ledger refuse until it is
    /// restored (from a backup).
    #[error(
        "the fold state {collection} is missing, yet {evidence}: it was dropped or lost; the \
         fold and exact reads of this ledger refuse rather than count events twice or drop \
         them: restore {collection} from a backup"
    )]
    FoldStateLost {
        /// The fold state's collection.
        collection: String,
        /// What shows that it existed.
        evidence: String,
    },

    /// Writes the server applied before refusing a later one of the same
    /// ordered batch were not found by a majority read: their replication
    /// is unconfirmed (a router may report the refusal and drop the
    /// write-concern error). They may be rolled back; send them again once
    /// the deployment is healthy (a ledger event: with its ticket).
    #[error(
        "{writes} writes to {collection} before a refused one were not found by a majority \
         read: their replication is unconfirmed; send them again once the deployment is healthy"
    )]
    MajorityUnconfirmed {
        /// The collection written.
        collection: String,
        /// How many writes the batch applied before the refused one.
        writes: u64,
    },

    /// A recorder stopped (its runtime shutting down) while an event was
    /// in flight: it may have been recorded. Record it again with its
    /// ticket ([`crate::Ledger::record_again`]): that is exact.
    #[error(
        "the recorder stopped with the event possibly in flight: record it again with its ticket"
    )]
    RecorderStopped,

    /// A ledger's fold cannot go on from its position in the events
    /// collection's log: the oplog no longer reaches back to it (the fold
    /// stood still longer than the oplog's window). The fold of that ledger
    /// stops — guessing could count events twice or drop them — and so do
    /// its exact reads; `tallyd fold-from` ([`crate::EventFold::fold_from`])
    /// folds again from a time the operator chooses, naming the events
    /// whose count is then uncertain.
    #[error(
        "the oplog no longer reaches back to where the fold of {events} stands{since}: the fold \
         of this ledger stops rather than guess; fold again from a time you choose with \
         `tallyd fold-from` (the book: \"when the fold stops\")",
        since = message::position_since(.since)
    )]
    HistoryLost {
        /// The events collection.
        events: String,
        /// The time of the position the fold stands at, when known.
        since: Option<std::time::SystemTime>,
    },

    /// The user may not read the events collection's change stream, which
    /// the fold and exact reads read: grant `changeStream` (and `find`) on
    /// it. Nothing was changed.
    #[error(
        "the user may not read the change stream of {events}, which the ledger's fold and exact \
         reads read ({cause}): grant changeStream and find on {events} (the book: the smallest \
         MongoDB role)"
    )]
    LogRefused {
        /// The events collection.
        events: String,
        /// The server's refusal.
        cause: Box<Failure>,
    },

    /// A ledger's fold is stopped: it cannot go on from its position (`why`
    /// says why, and what to do). Nothing is folded and no exact read of the
    /// ledger answers until `tallyd fold-from`.
    #[error("the fold of {events} is stopped: {why}")]
    FoldStopped {
        /// The events collection.
        events: String,
        /// Why, and what to do.
        why: String,
    },

    /// `fold-from` was asked of a fold that is not stopped: it goes on from
    /// its position, and folding again from a chosen time could count
    /// events twice. Nothing was changed.
    #[error(
        "the fold of {events} is not stopped: it goes on from its position in the log, and \
         folding again from a chosen time could count events twice; nothing was changed"
    )]
    FoldNotStopped {
        /// The events collection.
        events: String,
    },

    /// A fold state written by an earlier version of tally cannot be
    /// converted yet (`why` says why and what to run first). Nothing was
    /// changed.
    #[error(
        "the fold state {collection} was written by an earlier version of tally and cannot be \
         converted yet: {why}; nothing was changed (see the changelog's upgrade notes)"
    )]
    UpgradeBlocked {
        /// The fold state's collection.
        collection: String,
        /// Why, and what to run first.
        why: String,
    },

    /// The deployment is a standalone server: `what` needs a replica set or
    /// a sharded cluster (change streams, cluster times).
    #[error(
        "{what} needs a replica set or a sharded cluster, and this server is a standalone (it \
         gives no cluster time): run MongoDB as a replica set (a single member is enough)"
    )]
    ReplicaSetRequired {
        /// What needs it.
        what: String,
    },

    /// The optimistic insert loop lost every race it was allowed to run.
    #[error("gave up after {attempts} attempts: every candidate _id was taken by another writer")]
    InsertAttemptsExhausted {
        /// How many inserts were tried.
        attempts: u32,
    },
}

impl Error {
    /// The error class when this is a server failure.
    ///
    /// ```
    /// use tally::Error;
    ///
    /// // Only a server failure has a class; a refusal of the arguments has none.
    /// assert_eq!(Error::InvalidArgument("the amount must not be zero".into()).class(), None);
    /// ```
    pub fn class(&self) -> Option<ErrorClass> {
        match self {
            Self::Server(failure) => Some(failure.class),
            _ => None,
        }
    }

    /// Whether no server could be reached or used (an outage): what the
    /// exit code 69 and the daemon's readiness stand for.
    #[cfg(feature = "daemon")]
    pub(crate) fn is_unavailable(&self) -> bool {
        matches!(self, Self::Server(failure) if failure.trouble() == Trouble::Unavailable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::{deserialize_from_document as from_document, doc};
    use mongodb::error::{CommandError, WriteConcernError, WriteError};
    use mongodb::error::{ErrorKind, WriteFailure};
    use proptest::prelude::*;

    fn command_error(code: i32) -> MongoError {
        command_error_with(code, "X", "m")
    }

    fn command_error_with(code: i32, code_name: &str, errmsg: &str) -> MongoError {
        let err: CommandError =
            from_document(doc! { "code": code, "codeName": code_name, "errmsg": errmsg }).unwrap();
        ErrorKind::Command(err).into()
    }

    fn write_error(code: i32) -> MongoError {
        write_error_with(code, "X", "m")
    }

    fn write_error_with(code: i32, code_name: &str, errmsg: &str) -> MongoError {
        let err: WriteError =
            from_document(doc! { "code": code, "codeName": code_name, "errmsg": errmsg }).unwrap();
        ErrorKind::Write(WriteFailure::WriteError(err)).into()
    }

    fn write_concern_error(code: i32, labels: &[&str]) -> MongoError {
        write_concern_error_with(code, labels, "X", "m")
    }

    fn write_concern_error_with(
        code: i32,
        labels: &[&str],
        code_name: &str,
        errmsg: &str,
    ) -> MongoError {
        let err: WriteConcernError = from_document(
            doc! { "code": code, "codeName": code_name, "errmsg": errmsg, "errorLabels": labels },
        )
        .unwrap();
        ErrorKind::Write(WriteFailure::WriteConcernError(err)).into()
    }

    fn io(kind: std::io::ErrorKind) -> MongoError {
        ErrorKind::Io(std::sync::Arc::new(kind.into())).into()
    }

    fn io_with(kind: std::io::ErrorKind, message: &str) -> MongoError {
        ErrorKind::Io(std::sync::Arc::new(std::io::Error::new(kind, message))).into()
    }

    /// An argument refused says the sentence alone: the variant's name is
    /// no word for a user (`refused: invalid argument: ticket …` before).
    #[test]
    fn an_invalid_argument_says_its_sentence_alone() {
        let err = Error::InvalidArgument("the event key must not be empty".into());
        assert_eq!(err.to_string(), "the event key must not be empty");
    }

    #[test]
    fn every_listed_code_is_transient_as_a_command_error() {
        for code in [
            6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436,
        ] {
            let err = command_error(code);
            assert_eq!(ErrorClass::of(&err), ErrorClass::Transient, "code {code}");
            assert_eq!(Effect::of(&err), Effect::MaybeApplied, "code {code}");
        }
    }

    #[test]
    fn listed_codes_in_write_errors_are_transient_too() {
        // A server interrupted at shutdown reports it as a write error.
        assert_eq!(ErrorClass::of(&write_error(11600)), ErrorClass::Transient);
        assert_eq!(ErrorClass::of(&write_error(10107)), ErrorClass::Transient);
    }

    #[test]
    fn io_errors_are_transient_and_may_have_applied() {
        for kind in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::BrokenPipe,
        ] {
            let err = io(kind);
            assert_eq!(ErrorClass::of(&err), ErrorClass::Transient, "{kind:?}");
            assert_eq!(Effect::of(&err), Effect::MaybeApplied, "{kind:?}");
        }
    }

    #[test]
    fn pool_cleared_is_transient() {
        let facts = Facts {
            kind: FailureKind::PoolCleared,
            retryable_label: false,
        };
        assert_eq!(facts.class(), ErrorClass::Transient);
    }

    #[test]
    fn server_selection_timeout_is_not_retried_and_applied_nothing() {
        let facts = Facts {
            kind: FailureKind::ServerSelection,
            retryable_label: false,
        };
        assert_eq!(facts.class(), ErrorClass::Command);
        assert_eq!(facts.effect(), Effect::NotApplied);
    }

    #[test]
    fn reads_also_retry_a_lost_cursor_and_a_majority_snapshot_not_ready() {
        // CursorNotFound, ReadConcernMajorityNotAvailableYet: written out
        // again rather than taken from `code`.
        for code in [43, 134] {
            let facts = Facts::of(&command_error(code));
            assert_eq!(
                facts.read_class(),
                ErrorClass::Transient,
                "read, code {code}"
            );
            assert_eq!(facts.class(), ErrorClass::Command, "write, code {code}");
            let mut read = RetryBudget::read_once("find");
            read.start_attempt();
            assert!(matches!(
                read.after_failure(command_error(code)),
                Next::Retry
            ));
            read.start_attempt();
            let Next::GiveUp(failure) = read.after_failure(command_error(code)) else {
                panic!("a read is retried once, code {code}");
            };
            assert_eq!(failure.class, ErrorClass::Transient);
            let mut write = RetryBudget::retry_once("update");
            write.start_attempt();
            assert!(matches!(
                write.after_failure(command_error(code)),
                Next::GiveUp(_)
            ));
        }
        // The read rule adds to the write rule; it takes nothing away.
        for code in DESIGN_TRANSIENT {
            assert_eq!(
                Facts::of(&command_error(code)).read_class(),
                ErrorClass::Transient
            );
        }
        assert_eq!(
            Facts::of(&command_error(2)).read_class(),
            ErrorClass::Command
        );
        assert_eq!(
            Facts::of(&command_error(11000)).read_class(),
            ErrorClass::DuplicateKey
        );
    }

    #[test]
    fn duplicate_keys_through_each_path() {
        // An `update` upsert race surfaces as a write error...
        for code in [11000, 11001, 12582] {
            let err = write_error(code);
            assert_eq!(
                ErrorClass::of(&err),
                ErrorClass::DuplicateKey,
                "write {code}"
            );
            assert_eq!(Effect::of(&err), Effect::NotApplied);
        }
        // ...a `findAndModify` upsert race as a command error.
        for code in [11000, 11001, 12582] {
            let err = command_error(code);
            assert_eq!(
                ErrorClass::of(&err),
                ErrorClass::DuplicateKey,
                "command {code}"
            );
        }
    }

    #[test]
    fn other_server_errors_are_command_errors_that_applied_nothing() {
        // BadValue, Unauthorized, TypeMismatch, DocumentValidationFailure, BSONObjectTooLarge.
        for code in [2, 13, 14, 121, 10334] {
            let err = command_error(code);
            assert_eq!(ErrorClass::of(&err), ErrorClass::Command, "code {code}");
            assert_eq!(Effect::of(&err), Effect::NotApplied, "code {code}");
            assert_eq!(ErrorClass::of(&write_error(code)), ErrorClass::Command);
        }
    }

    #[test]
    fn the_retryable_label_makes_a_command_error_transient() {
        let facts = Facts {
            kind: FailureKind::Command(2),
            retryable_label: true,
        };
        assert_eq!(facts.class(), ErrorClass::Transient);
    }

    #[test]
    fn write_concern_errors() {
        // A listed code: treat it like a lost reply.
        let err = write_concern_error(91, &[]);
        assert_eq!(ErrorClass::of(&err), ErrorClass::Transient);
        assert_eq!(Effect::of(&err), Effect::AppliedUnconfirmed);
        // The retryable label, carried inside the write-concern error.
        let err = write_concern_error(64, &["RetryableWriteError"]);
        assert_eq!(ErrorClass::of(&err), ErrorClass::Transient);
        // Otherwise (wtimeout, unsatisfiable): a command error, but applied on
        // the primary all the same.
        let err = write_concern_error(64, &[]);
        assert_eq!(ErrorClass::of(&err), ErrorClass::Command);
        assert_eq!(Effect::of(&err), Effect::AppliedUnconfirmed);
        let err = write_concern_error(100, &[]);
        assert_eq!(ErrorClass::of(&err), ErrorClass::Command);
    }

    #[test]
    fn client_side_refusals_applied_nothing() {
        let err: MongoError = MongoError::custom("x");
        // A custom error is opaque: it may have followed a send.
        assert_eq!(Effect::of(&err), Effect::MaybeApplied);
        assert_eq!(ErrorClass::of(&err), ErrorClass::Command);
        let facts = Facts {
            kind: FailureKind::ClientRefused,
            retryable_label: false,
        };
        assert_eq!(facts.class(), ErrorClass::Command);
        assert_eq!(facts.effect(), Effect::NotApplied);
    }

    #[test]
    fn budget_retries_a_transient_failure_once() {
        let mut budget = RetryBudget::retry_once("t");
        budget.start_attempt();
        assert!(matches!(
            budget.after_failure(io(std::io::ErrorKind::ConnectionReset)),
            Next::Retry
        ));
        budget.start_attempt();
        let Next::GiveUp(failure) = budget.after_failure(io(std::io::ErrorKind::ConnectionReset))
        else {
            panic!("second transient failure must give up");
        };
        assert_eq!(failure.attempts, 2);
        assert_eq!(failure.class, ErrorClass::Transient);
        assert!(budget.maybe_applied());
    }

    #[test]
    fn budget_never_retries_a_command_error() {
        let mut budget = RetryBudget::retry_once("t");
        budget.start_attempt();
        assert!(matches!(
            budget.after_failure(command_error(2)),
            Next::GiveUp(_)
        ));
        assert!(!budget.maybe_applied());
    }

    #[test]
    fn duplicate_key_retries_have_their_own_budget() {
        let mut budget = RetryBudget::retry_once("t").with_duplicate_key_retries(2);
        for _ in 0..2 {
            budget.start_attempt();
            assert!(matches!(
                budget.after_failure(write_error(11000)),
                Next::Retry
            ));
        }
        budget.start_attempt();
        assert!(matches!(
            budget.after_failure(write_error(11000)),
            Next::GiveUp(_)
        ));
        // None of that used the transient retry, nor may have applied.
        assert!(!budget.maybe_applied());
        budget.start_attempt();
        assert!(matches!(
            budget.after_failure(io(std::io::ErrorKind::TimedOut)),
            Next::Retry
        ));
    }

    fn any_kind() -> impl Strategy<Value = FailureKind> {
        let code = prop_oneof![
            proptest::sample::select(code::TRANSIENT.to_vec()),
            proptest::sample::select(code::DUPLICATE_KEY_CODES.to_vec()),
            proptest::sample::select(code::READ_TRANSIENT.to_vec()),
            any::<i32>(),
        ];
        prop_oneof![
            Just(FailureKind::Io),
            Just(FailureKind::PoolCleared),
            Just(FailureKind::ServerSelection),
            Just(FailureKind::ClientRefused),
            Just(FailureKind::Other),
            code.clone().prop_map(FailureKind::Command),
            code.clone().prop_map(FailureKind::Write),
            code.prop_map(FailureKind::WriteConcern),
        ]
    }

    proptest! {
        /// A failure that definitely applied nothing is never reported as
        /// "may have applied", and the reverse: a write-concern error always
        /// applied on the primary, a lost reply always may have applied.
        #[test]
        fn effect_is_consistent_with_the_kind(kind in any_kind(), label in any::<bool>()) {
            let facts = Facts { kind, retryable_label: label };
            match kind {
                FailureKind::WriteConcern(_) =>
                    prop_assert_eq!(facts.effect(), Effect::AppliedUnconfirmed),
                FailureKind::Io | FailureKind::PoolCleared | FailureKind::Other =>
                    prop_assert_eq!(facts.effect(), Effect::MaybeApplied),
                FailureKind::ServerSelection | FailureKind::ClientRefused =>
                    prop_assert_eq!(facts.effect(), Effect::NotApplied),
                FailureKind::Command(_) | FailureKind::Write(_) =>
                    prop_assert_eq!(
                        facts.effect() == Effect::NotApplied,
                        facts.class() != ErrorClass::Transient
                    ),
            }
        }

        /// Duplicate-key codes win over labels, and the class never depends
        /// on anything but kind, code and label.
        #[test]
        fn classification_is_total_and_ordered(kind in any_kind(), label in any::<bool>()) {
            let facts = Facts { kind, retryable_label: label };
            let class = facts.class();
            if let FailureKind::Command(c) | FailureKind::Write(c) = kind {
                if code::DUPLICATE_KEY_CODES.contains(&c) {
                    prop_assert_eq!(class, ErrorClass::DuplicateKey);
                } else if code::TRANSIENT.contains(&c) || label {
                    prop_assert_eq!(class, ErrorClass::Transient);
                } else {
                    prop_assert_eq!(class, ErrorClass::Command);
                }
            }
            if kind == FailureKind::ServerSelection {
                prop_assert_eq!(class, ErrorClass::Command);
            }
            // Reads differ from writes only by the read-transient codes.
            let read_only = matches!(kind, FailureKind::Command(c) if [43, 134].contains(&c));
            if read_only {
                prop_assert_eq!(facts.read_class(), ErrorClass::Transient);
            } else {
                prop_assert_eq!(facts.read_class(), class);
            }
            prop_assert_eq!(class, Facts { kind, retryable_label: label }.class());
        }
    }

    /// A failure the tests can build as a real driver error. The driver
    /// lets other crates attach the `RetryableWriteError` label only through
    /// a write-concern error, and never a server reply (so a duplicate key
    /// can not be shown to be on another index here).
    #[derive(Debug, Clone)]
    enum Fault {
        Io(std::io::ErrorKind),
        Command(i32),
        Write(i32),
        WriteConcern {
            code: i32,
            labelled: bool,
        },
        /// The client was shut down: refused before sending.
        Shutdown,
        /// An opaque error: may have followed a send.
        Custom,
    }

    /// The codes the book lists (design/errors.md), written out again rather than taken from
    /// [`code`], so that the properties below check the table.
    const DESIGN_TRANSIENT: [i32; 12] = [
        6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436,
    ];
    const DESIGN_DUPLICATE: [i32; 3] = [11000, 11001, 12582];

    impl Fault {
        fn build(&self, code_name: &str, message: &str) -> MongoError {
            match *self {
                Self::Io(kind) => io_with(kind, message),
                Self::Command(code) => command_error_with(code, code_name, message),
                Self::Write(code) => write_error_with(code, code_name, message),
                Self::WriteConcern { code, labelled } => {
                    let labels: &[&str] = if labelled {
                        &["RetryableWriteError"]
                    } else {
                        &[]
                    };
                    write_concern_error_with(code, labels, code_name, message)
                }
                Self::Shutdown => ErrorKind::Shutdown.into(),
                Self::Custom => MongoError::custom(message.to_owned()),
            }
        }

        fn labelled(&self) -> bool {
            matches!(self, Self::WriteConcern { labelled: true, .. })
        }

        /// The book's table (design/errors.md), stated independently of [`Facts::class`].
        fn expected_class(&self) -> ErrorClass {
            match *self {
                Self::Io(_) => ErrorClass::Transient,
                Self::Command(c) | Self::Write(c) if DESIGN_DUPLICATE.contains(&c) => {
                    ErrorClass::DuplicateKey
                }
                Self::Command(c) | Self::Write(c) if DESIGN_TRANSIENT.contains(&c) => {
                    ErrorClass::Transient
                }
                Self::WriteConcern { code, labelled }
                    if labelled || DESIGN_TRANSIENT.contains(&code) =>
                {
                    ErrorClass::Transient
                }
                Self::Command(_)
                | Self::Write(_)
                | Self::WriteConcern { .. }
                | Self::Shutdown
                | Self::Custom => ErrorClass::Command,
            }
        }

        /// Whether the write may have been applied: everything except a
        /// server refusal (command or duplicate key) and a client-side
        /// refusal. A write-concern error applied on the primary.
        fn expected_effect(&self) -> Effect {
            match (self, self.expected_class()) {
                (Self::WriteConcern { .. }, _) => Effect::AppliedUnconfirmed,
                (Self::Shutdown, _) => Effect::NotApplied,
                (Self::Command(_) | Self::Write(_), ErrorClass::Transient) => Effect::MaybeApplied,
                (Self::Command(_) | Self::Write(_), _) => Effect::NotApplied,
                (Self::Io(_) | Self::Custom, _) => Effect::MaybeApplied,
            }
        }
    }

    fn any_code() -> impl Strategy<Value = i32> {
        prop_oneof![
            3 => proptest::sample::select(DESIGN_TRANSIENT.to_vec()),
            3 => proptest::sample::select(DESIGN_DUPLICATE.to_vec()),
            // BadValue, Unauthorized, TypeMismatch, WriteConcernFailed,
            // UnsatisfiableWriteConcern, DocumentValidationFailure.
            2 => proptest::sample::select(vec![2, 13, 14, 64, 100, 121]),
            2 => any::<i32>(),
        ]
    }

    fn any_fault() -> impl Strategy<Value = Fault> {
        let io_kind = proptest::sample::select(vec![
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::UnexpectedEof,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::Other,
        ]);
        prop_oneof![
            2 => io_kind.prop_map(Fault::Io),
            3 => any_code().prop_map(Fault::Command),
            3 => any_code().prop_map(Fault::Write),
            3 => (any_code(), any::<bool>())
                .prop_map(|(code, labelled)| Fault::WriteConcern { code, labelled }),
            1 => Just(Fault::Shutdown),
            1 => Just(Fault::Custom),
        ]
    }

    /// Message texts and code names, including ones that read like another
    /// class than the code says.
    fn any_text() -> impl Strategy<Value = String> {
        let phrase = proptest::sample::select(vec![
            "not master",
            "not primary",
            "node is recovering",
            "interrupted at shutdown",
            "connection reset by peer",
            "NotWritablePrimary",
            "RetryableWriteError",
            "E11000 duplicate key error collection: db.c index: _id_ dup key",
            "DuplicateKey",
            "BadValue",
            "",
        ]);
        prop_oneof![
            1 => ".{0,20}",
            2 => (".{0,4}", phrase, ".{0,4}").prop_map(|(a, p, b)| format!("{a}{p}{b}")),
        ]
    }

    proptest! {
        /// Classification follows the book's table (design/errors.md) by kind, code and label
        /// only: the same failure with two unrelated message texts and code
        /// names gets the same facts, class and effect, and that class and
        /// effect are the ones the table gives.
        #[test]
        fn classification_ignores_the_message_text(
            fault in any_fault(),
            (name_a, msg_a) in (any_text(), any_text()),
            (name_b, msg_b) in (any_text(), any_text()),
        ) {
            let a = fault.build(&name_a, &msg_a);
            let b = fault.build(&name_b, &msg_b);
            prop_assert_eq!(Facts::of(&a), Facts::of(&b));
            prop_assert_eq!(ErrorClass::of(&a), fault.expected_class());
            prop_assert_eq!(ErrorClass::of(&b), fault.expected_class());
            prop_assert_eq!(Effect::of(&a), fault.expected_effect());
            prop_assert_eq!(Effect::of(&b), fault.expected_effect());
            prop_assert_eq!(Facts::of(&a).retryable_label, fault.labelled());
        }

        /// The retry rule over any sequence of failures: at most one
        /// transient retry in total; never a command error; at most `k` duplicate
        /// keys; and `maybe_applied` is true exactly when some failure so far
        /// may have applied its write.
        #[test]
        fn retry_budget_follows_the_rule_for_any_sequence(
            faults in proptest::collection::vec(any_fault(), 1..12),
            duplicate_retries in proptest::option::of(0u32..4),
        ) {
            let mut budget = RetryBudget::retry_once("prop");
            if let Some(k) = duplicate_retries {
                budget = budget.with_duplicate_key_retries(k);
            }
            let k = duplicate_retries.unwrap_or(0);
            let (mut transient_retries, mut duplicate_retries_taken) = (0u32, 0u32);
            let mut any_maybe_applied = false;
            for (i, fault) in faults.iter().enumerate() {
                let attempt = u32::try_from(i).unwrap() + 1;
                budget.start_attempt();
                prop_assert_eq!(budget.attempts(), attempt);
                let class = fault.expected_class();
                // The reference rule, from the book (design/errors.md) and `RetryBudget`'s docs.
                let should_retry = match class {
                    ErrorClass::Transient => {
                        transient_retries == 0
                    }
                    ErrorClass::DuplicateKey => duplicate_retries_taken < k,
                    ErrorClass::Command => false,
                };
                let effect = fault.expected_effect();
                any_maybe_applied |= effect != Effect::NotApplied;
                let next = budget.after_failure(fault.build("X", "m"));
                prop_assert_eq!(budget.maybe_applied(), any_maybe_applied, "after {:?}", fault);
                match next {
                    Next::Retry => {
                        prop_assert!(should_retry, "{:?} retried (attempt {})", fault, attempt);
                        prop_assert_ne!(class, ErrorClass::Command);
                        match class {
                            ErrorClass::Transient => transient_retries += 1,
                            ErrorClass::DuplicateKey => duplicate_retries_taken += 1,
                            ErrorClass::Command => {}
                        }
                        prop_assert!(transient_retries <= 1);
                        prop_assert!(duplicate_retries_taken <= k);
                    }
                    Next::GiveUp(failure) => {
                        prop_assert!(!should_retry, "{:?} not retried (attempt {})", fault, attempt);
                        prop_assert_eq!(failure.class, class);
                        prop_assert_eq!(failure.effect, effect);
                        prop_assert_eq!(failure.attempts, attempt);
                        prop_assert_eq!(failure.operation, "prop");
                        break;
                    }
                }
            }
        }
    }
}
