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
/// Each example is one of `$fence` (the fence's first line), `$setup`
/// (making a ticket `ticket`), the method's own lines and `$end`.
macro_rules! token_accessors {
    ($ty:ident, $cause_doc:literal, $fence:literal, $setup:literal, $end:literal) => {
        impl $ty {
            /// The counter's `_id`.
            ///
            #[doc = concat!($fence, $setup)]
            /// println!("settle it on the counter {}", ticket.key());
            #[doc = concat!($end, "```")]
            pub fn key(&self) -> &Bson {
                &self.key
            }
            /// The token.
            ///
            #[doc = concat!($fence, $setup)]
            /// let made = humantime::format_rfc3339_seconds(ticket.token().created_at());
            /// println!("token {} made at {made}", ticket.token());
            #[doc = concat!($end, "```")]
            pub fn token(&self) -> Token {
                self.entry.token()
            }
            /// The amount the token adds when counted.
            ///
            #[doc = concat!($fence, $setup)]
            /// assert_eq!(ticket.amount(), 5);
            #[doc = concat!($end, "```")]
            pub fn amount(&self) -> i64 {
                self.entry.amount()
            }
            #[doc = $cause_doc]
            ///
            #[doc = concat!($fence, $setup)]
            /// if let Some(cause) = ticket.cause() {
            ///     eprintln!("not settled yet: {cause}");
            /// }
            #[doc = concat!($end, "```")]
            pub fn cause(&self) -> Option<&Error> {
                self.cause.as_ref()
            }
        }
    };
}

/// The result of an increment: exactly one of four outcomes.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
/// use tally::Increment;
///
/// match views.increment("home", 1).await {
///     Increment::Counted(_) => {}
///     // Counted once either way: a settle left pending is the fold's.
///     Increment::Pending(pending) => { let _ = views.complete(pending).await; }
///     Increment::Unknown(unknown) => {
///         if let Increment::Unknown(still) = views.resume(unknown).await? {
///             eprintln!("resume later: {}", views.ticket(&still));
///         }
///     }
///     Increment::NotCounted(not) => return Err(not.cause().clone()),
/// }
/// # Ok(()) }
/// ```
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
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.increment("home", 1).await;
    /// // A label for a log line or a metric: counted, pending, unknown, not_counted.
    /// println!("increment of home: {}", outcome.name());
    /// # }
    /// ```
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
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.increment("home", 1).await;
    /// if let Some(token) = outcome.token() {
    ///     println!("{} of home, token {token}", outcome.name());
    /// }
    /// # }
    /// ```
    pub fn token(&self) -> Option<Token> {
        match self {
            Self::Counted(c) => Some(c.entry.token()),
            Self::Pending(p) => Some(p.entry.token()),
            Self::Unknown(u) => Some(u.entry.token()),
            Self::NotCounted(n) => n.token,
        }
    }

    /// The amount this increment adds (or would have added).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.increment("home", 3).await;
    /// assert_eq!(outcome.amount(), 3);
    /// # }
    /// ```
    pub fn amount(&self) -> i64 {
        match self {
            Self::Counted(c) => c.entry.amount(),
            Self::Pending(p) => p.entry.amount(),
            Self::Unknown(u) => u.entry.amount(),
            Self::NotCounted(n) => n.amount,
        }
    }

    /// The error that kept this increment from being counted, if any.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.increment("home", 1).await;
    /// if let Some(cause) = outcome.cause() {
    ///     eprintln!("home: {} ({cause})", outcome.name());
    /// }
    /// # }
    /// ```
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
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::Increment;
///
/// if let Increment::Counted(counted) = views.increment("home", 1).await {
///     println!("counted {} on {}", counted.amount(), counted.key());
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Counted {
    pub(super) key: Bson,
    pub(super) entry: Entry,
    pub(super) settled_earlier: bool,
}

impl Counted {
    /// The counter's `_id`.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::Counted(counted) = views.increment("home", 1).await {
    ///     assert_eq!(counted.key().as_str(), Some("home"));
    /// }
    /// # }
    /// ```
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// The token of the attempt.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::Counted(counted) = views.increment("home", 1).await {
    ///     println!("counted by token {}", counted.token());
    /// }
    /// # }
    /// ```
    pub fn token(&self) -> Token {
        self.entry.token()
    }
    /// The amount added.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::Counted(counted) = views.increment("home", 1).await {
    ///     assert_eq!(counted.amount(), 1);
    /// }
    /// # }
    /// ```
    pub fn amount(&self) -> i64 {
        self.entry.amount()
    }
    /// True when this call did not count it because it had been counted
    /// already: by an earlier attempt whose reply was lost, by an earlier
    /// settle (`complete`, `resume`, from any process), or by the daemon.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::{Completion, Increment};
    ///
    /// if let Increment::Pending(pending) = views.increment("home", 1).await
    ///     && let Completion::Counted(counted) = views.complete(pending).await
    ///     && counted.settled_earlier()
    /// {
    ///     // Another settle or the daemon got there first: still counted once.
    ///     println!("{} was already counted", counted.token());
    /// }
    /// # }
    /// ```
    pub fn settled_earlier(&self) -> bool {
        self.settled_earlier
    }
}

/// A token that is in the counter's `pending` array: step 2 only is needed.
/// Only the library makes these (from an increment, or after reading the
/// token in the document), so it always names a token whose step 1 applied.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::{Completion, Increment};
///
/// if let Increment::Pending(pending) = views.increment("home", 1).await {
///     // Safe at any age, any number of times: counts once.
///     if let Completion::Pending(pending) = views.complete(pending).await {
///         eprintln!("left to the daemon: {}", pending.token());
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct PendingToken {
    pub(super) key: Bson,
    pub(super) entry: Entry,
    pub(super) cause: Option<Error>,
}

token_accessors!(
    PendingToken,
    "Why step 2 was not confirmed (none when the token was found by \
     [`Counters::find_pending`]).\n\n[`Counters::find_pending`]: \
     super::Counters::find_pending",
    "```no_run\n",
    "# async fn demo(views: tally::Counters) {\n\
     if let tally::Increment::Pending(ticket) = views.increment(\"home\", 5).await {\n",
    "}\n# }\n"
);

/// A token whose step 1 may or may not have applied, and whose step 2 was
/// never sent.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
/// use tally::Increment;
///
/// if let Increment::Unknown(unknown) = views.increment("home", 1).await {
///     // Within the retry horizon: counts once, whatever step 1 did.
///     let settled = views.resume(unknown).await?;
///     println!("resumed: {}", settled.name());
/// }
/// # Ok(()) }
/// ```
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
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::{Token, UnknownToken};
    ///
    /// // The key, token and amount another process logged for its unknown increment.
    /// let token: Token = "65f1a2b3c4d5e6f708192a3b".parse().expect("24 hex digits");
    /// let unknown = UnknownToken::new("home", token, 5)?;
    /// let settled = views.resume(unknown).await?;
    /// println!("{}", settled.name());
    /// # Ok(()) }
    /// ```
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
    "Why step 1 was not confirmed (none when rebuilt with [`UnknownToken::new`]).",
    "```\n",
    "# fn main() -> Result<(), tally::Error> {\n\
     let ticket = tally::UnknownToken::new(\"home\", tally::Token::new(), 5)?;\n",
    "# Ok(()) }\n"
);

/// An increment that was definitely not applied.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::Increment;
///
/// if let Increment::NotCounted(not) = views.increment("home", 1).await {
///     // Nothing was written: the caller may try again, or give up.
///     eprintln!("home not counted: {}", not.cause());
/// }
/// # }
/// ```
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
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::NotCounted(not) = views.increment("home", 1).await {
    ///     eprintln!("{} not counted", not.key());
    /// }
    /// # }
    /// ```
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// For an increment through a lane ([`Counters::add`]): the lane and
    /// its number, when a lane was taken.
    ///
    /// [`Counters::add`]: super::Counters::add
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::LaneIncrement;
    ///
    /// if let LaneIncrement::NotCounted(not) = views.add("home", 1).await
    ///     && let Some((lane, number)) = not.lane()
    /// {
    ///     eprintln!("lane {lane} did not send its number {number}");
    /// }
    /// # }
    /// ```
    pub fn lane(&self) -> Option<(&LaneId, i64)> {
        self.lane.as_ref().map(|(lane, s)| (lane, *s))
    }
    /// The amount that was not added.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::NotCounted(not) = views.increment("home", 1).await {
    ///     assert_eq!(not.amount(), 1);
    /// }
    /// # }
    /// ```
    pub fn amount(&self) -> i64 {
        self.amount
    }
    /// Why nothing was written.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// if let tally::Increment::NotCounted(not) = views.increment("home", 1).await {
    ///     match not.cause().class() {
    ///         Some(class) => eprintln!("not counted ({}): {}", class.as_str(), not.cause()),
    ///         None => eprintln!("refused: {}", not.cause()),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn cause(&self) -> &Error {
        &self.cause
    }
}

/// The result of [`Counters::complete`].
///
/// [`Counters::complete`]: super::Counters::complete
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::{Completion, Increment};
///
/// if let Increment::Pending(pending) = views.increment("home", 1).await {
///     match views.complete(pending).await {
///         Completion::Counted(_) => {}
///         Completion::Pending(pending) => eprintln!("still pending: {}", pending.token()),
///     }
/// }
/// # }
/// ```
#[must_use]
#[derive(Debug)]
pub enum Completion {
    /// Counted (by this call, or earlier).
    Counted(Counted),
    /// Step 2 is still not confirmed; try again later or leave it to the
    /// daemon.
    Pending(PendingToken),
}
