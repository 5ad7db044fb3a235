//! What an increment, a `complete` or a `resume` tells its caller: exactly
//! one of four outcomes ([`Increment`]), the tickets that settle the two
//! uncertain ones ([`PendingToken`], [`UnknownToken`]), and what `complete`
//! returns ([`Completion`]).
//!
//! The tickets are not `Clone`, and `complete` and `resume` take them by
//! value: a caller cannot settle one ticket twice in one process. Across
//! processes (the CLI rebuilds an unknown ticket with [`UnknownToken::new`])
//! the settle marker makes a second settle count nothing.

use mongodb::bson::Bson;

use crate::error::Error;
use crate::token::{Entry, Token};
use crate::write::lane::LaneId;

/// The accessors shared by the two ticket types, which must stay distinct.
macro_rules! token_accessors {
    ($ty:ident, $cause_doc:literal) => {
        impl $ty {
            /// The counter's `_id`.
            pub fn key(&self) -> &Bson {
                &self.key
            }
            /// The token.
            pub fn token(&self) -> Token {
                self.entry.token()
            }
            /// The amount the token adds when counted.
            pub fn amount(&self) -> i64 {
                self.entry.amount()
            }
            #[doc = $cause_doc]
            pub fn cause(&self) -> Option<&Error> {
                self.cause.as_ref()
            }
        }
    };
}

/// The result of an increment: exactly one of four outcomes.
#[must_use = "an increment may be pending or unknown and need settling"]
#[derive(Debug)]
pub enum Increment {
    /// Step 2 applied, or the token had already been counted.
    Counted(Counted),
    /// Step 1 applied; step 2 was not confirmed. Settle with
    /// [`Counters::complete`] (safe at any age), or leave it to the daemon.
    /// Counted exactly once either way.
    ///
    /// [`Counters::complete`]: super::Counters::complete
    Pending(PendingToken),
    /// Step 1 may or may not have applied; step 2 was never sent. Settle with
    /// [`Counters::resume`] while the token is younger than the retry
    /// horizon; after that, the increment is counted at most once.
    ///
    /// [`Counters::resume`]: super::Counters::resume
    Unknown(UnknownToken),
    /// Definitely not applied: nothing was written.
    NotCounted(NotCounted),
}

impl Increment {
    /// The outcome's name as the CLI prints it: `counted`, `pending`,
    /// `unknown` or `not_counted`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Counted(_) => "counted",
            Self::Pending(_) => "pending",
            Self::Unknown(_) => "unknown",
            Self::NotCounted(_) => "not_counted",
        }
    }

    /// The token of this attempt (absent only when the amount was refused
    /// before a token was made).
    pub fn token(&self) -> Option<Token> {
        match self {
            Self::Counted(c) => Some(c.entry.token()),
            Self::Pending(p) => Some(p.entry.token()),
            Self::Unknown(u) => Some(u.entry.token()),
            Self::NotCounted(n) => n.token,
        }
    }

    /// The amount this increment adds (or would have added).
    pub fn amount(&self) -> i64 {
        match self {
            Self::Counted(c) => c.entry.amount(),
            Self::Pending(p) => p.entry.amount(),
            Self::Unknown(u) => u.entry.amount(),
            Self::NotCounted(n) => n.amount,
        }
    }

    /// The error that kept this increment from being counted, if any.
    pub fn cause(&self) -> Option<&Error> {
        match self {
            Self::Counted(_) => None,
            Self::Pending(p) => p.cause.as_ref(),
            Self::Unknown(u) => u.cause.as_ref(),
            Self::NotCounted(n) => Some(&n.cause),
        }
    }
}

impl From<Completion> for Increment {
    fn from(completion: Completion) -> Self {
        match completion {
            Completion::Counted(counted) => Self::Counted(counted),
            Completion::Pending(pending) => Self::Pending(pending),
        }
    }
}

/// An increment that is counted.
#[derive(Debug, Clone)]
pub struct Counted {
    pub(super) key: Bson,
    pub(super) entry: Entry,
    pub(super) settled_earlier: bool,
}

impl Counted {
    /// The counter's `_id`.
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// The token of the attempt.
    pub fn token(&self) -> Token {
        self.entry.token()
    }
    /// The amount added.
    pub fn amount(&self) -> i64 {
        self.entry.amount()
    }
    /// True when this call did not count it because it had been counted
    /// already: by an earlier attempt whose reply was lost, by an earlier
    /// settle (`complete`, `resume`, from any process), or by the daemon.
    pub fn settled_earlier(&self) -> bool {
        self.settled_earlier
    }
}

/// A token that is in the counter's `pending` array: step 2 only is needed.
/// Only the library makes these (from an increment, or after reading the
/// token in the document), so it always names a token whose step 1 applied.
#[derive(Debug)]
pub struct PendingToken {
    pub(super) key: Bson,
    pub(super) entry: Entry,
    pub(super) cause: Option<Error>,
}

token_accessors!(
    PendingToken,
    "Why step 2 was not confirmed (none when the token was found by [`Counters::find_pending`]).\n\n[`Counters::find_pending`]: super::Counters::find_pending"
);

/// A token whose step 1 may or may not have applied, and whose step 2 was
/// never sent.
#[derive(Debug)]
pub struct UnknownToken {
    pub(super) key: Bson,
    pub(super) entry: Entry,
    pub(super) cause: Option<Error>,
}

impl UnknownToken {
    /// Rebuilds an unknown token from its parts — for a token an increment
    /// reported as *unknown* in another process (the CLI's `resume`). The
    /// amount must be the original increment's: a resume with another
    /// amount is refused. Never use it for a token reported *pending*: if
    /// its step 2 applied unseen, resuming would re-add it and count it
    /// twice.
    pub fn new(key: impl Into<Bson>, token: Token, amount: i64) -> Result<Self, Error> {
        let entry = Entry::new(token, amount)
            .ok_or_else(|| Error::InvalidArgument("the amount must not be zero".into()))?;
        Ok(Self {
            key: key.into(),
            entry,
            cause: None,
        })
    }

    /// The same ticket, with the reason it is still unknown.
    pub(crate) fn because(self, cause: Error) -> Self {
        Self {
            cause: Some(cause),
            ..self
        }
    }
}

token_accessors!(
    UnknownToken,
    "Why step 1 was not confirmed (none when rebuilt with [`UnknownToken::new`])."
);

/// An increment that was definitely not applied.
#[derive(Debug, Clone)]
pub struct NotCounted {
    pub(in crate::write) key: Bson,
    pub(in crate::write) token: Option<Token>,
    /// For an increment through a lane: the lane and the number it would
    /// have sent (absent when refused before a lane was taken).
    pub(in crate::write) lane: Option<(LaneId, i64)>,
    pub(in crate::write) amount: i64,
    pub(in crate::write) cause: Error,
}

impl NotCounted {
    /// The counter's `_id`.
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// For an increment through a lane ([`Counters::add`]): the lane and
    /// its number, when a lane was taken.
    ///
    /// [`Counters::add`]: super::Counters::add
    pub fn lane(&self) -> Option<(&LaneId, i64)> {
        self.lane.as_ref().map(|(lane, s)| (lane, *s))
    }
    /// The amount that was not added.
    pub fn amount(&self) -> i64 {
        self.amount
    }
    /// Why nothing was written.
    pub fn cause(&self) -> &Error {
        &self.cause
    }
}

/// The result of [`Counters::complete`].
///
/// [`Counters::complete`]: super::Counters::complete
#[must_use]
#[derive(Debug)]
pub enum Completion {
    /// Counted (by this call, or earlier).
    Counted(Counted),
    /// Step 2 is still not confirmed; try again later or leave it to the
    /// daemon.
    Pending(PendingToken),
}
