//! The retry-once rule, applied inside each operation's attempt loop
//! ([`RetryBudget`]): a transient failure of an idempotent operation is
//! retried once, a command error never, a duplicate key as the operation
//! says; every retry is logged with its class and attempt.

use std::sync::Arc;

use mongodb::error::Error as MongoError;

use super::{Effect, ErrorClass, Facts, Failure, Reach, Readable, duplicate_on_id};

/// Applies the retry-once rule inside an operation's attempt loop.
///
/// A transient failure earns one retry when the operation is idempotent.
/// The driver never retries tally's writes (its retryable writes are off on
/// the client tally uses), so every attempt is tally's own and counted
/// here: a refusal of a write sent once applied nothing. Duplicate-key
/// retries, for operations where they mean "nothing applied", have their
/// own small budget.
#[derive(Debug)]
pub(crate) struct RetryBudget {
    operation: &'static str,
    /// A read: classified by [`Facts::read_class`].
    read: bool,
    transient_left: u32,
    duplicate_left: u32,
    attempts: u32,
    maybe_applied: bool,
    /// Where the operation goes, for the messages of its failures.
    reach: Option<Arc<Reach>>,
}

/// What to do after a failed attempt.
#[derive(Debug)]
pub(crate) enum Next {
    /// Send the same operation again.
    Retry,
    /// Stop; the failure is final.
    GiveUp(Box<Failure>),
}

impl RetryBudget {
    /// One transient retry: for an idempotent operation, or one whose
    /// repetition is acceptable (a sequence's `$inc`, where it may skip a
    /// number).
    pub(crate) fn retry_once(operation: &'static str) -> Self {
        Self {
            operation,
            read: false,
            transient_left: 1,
            duplicate_left: 0,
            attempts: 0,
            maybe_applied: false,
            reach: None,
        }
    }

    /// One transient retry for a read (find, aggregate, `hello`);
    /// classified by the read rule ([`Facts::read_class`]).
    pub(crate) fn read_once(operation: &'static str) -> Self {
        Self {
            read: true,
            ..Self::retry_once(operation)
        }
    }

    /// Also retries up to `n` duplicate-key failures (for upserts, where a
    /// duplicate key means the race applied nothing).
    pub(crate) fn with_duplicate_key_retries(mut self, n: u32) -> Self {
        self.duplicate_left = n;
        self
    }

    /// Names where the operation goes in its failures' messages.
    pub(crate) fn reaching(&mut self, reach: Arc<Reach>) {
        self.reach = Some(reach);
    }

    /// Attempts made so far.
    #[cfg(test)]
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether any failed attempt so far may have applied its write.
    pub(crate) fn maybe_applied(&self) -> bool {
        self.maybe_applied
    }

    /// Records that an attempt is about to be sent.
    pub(crate) fn start_attempt(&mut self) {
        self.attempts += 1;
    }

    /// Decides what follows a failed attempt, and logs a retry.
    pub(crate) fn after_failure(&mut self, err: MongoError) -> Next {
        let facts = Facts::of(&err);
        let (class, effect) = match (self.read, facts.read_class()) {
            (true, ErrorClass::Transient) => (ErrorClass::Transient, Effect::MaybeApplied),
            (true, class) => (class, facts.effect()),
            (false, _) => (facts.class(), facts.effect()),
        };
        if effect != Effect::NotApplied {
            self.maybe_applied = true;
        }
        let retry = match class {
            ErrorClass::Transient => {
                if self.transient_left > 0 {
                    self.transient_left -= 1;
                    true
                } else {
                    false
                }
            }
            // Only a race on the same `_id` is worth another try.
            ErrorClass::DuplicateKey
                if self.duplicate_left > 0 && duplicate_on_id(&err) != Some(false) =>
            {
                self.duplicate_left -= 1;
                true
            }
            ErrorClass::DuplicateKey | ErrorClass::Command => false,
        };
        if retry && class == ErrorClass::DuplicateKey {
            // A concurrent upsert made the document first: routine, and the
            // next attempt updates it (a warning here alarmed operators on
            // a successful resume).
            tracing::debug!(
                operation = self.operation,
                attempt = self.attempts,
                cause = %Readable { err: &err, reach: self.reach.as_deref() },
                "the document was made by another write meanwhile; updating it"
            );
            Next::Retry
        } else if retry {
            tracing::warn!(
                operation = self.operation,
                class = %class,
                attempt = self.attempts,
                cause = %Readable { err: &err, reach: self.reach.as_deref() },
                "attempt failed, retrying"
            );
            Next::Retry
        } else {
            Next::GiveUp(Box::new(Failure {
                operation: self.operation,
                class,
                effect,
                attempts: self.attempts,
                source: err,
                reach: self.reach.clone(),
            }))
        }
    }
}
