//! What an increment through a lane tells its caller: exactly one of four
//! outcomes ([`LaneIncrement`]), and the ticket that settles the uncertain
//! one ([`LaneTicket`]).
//!
//! Unlike the two-step increment's tickets, a [`LaneTicket`] is `Clone`:
//! resuming it is harmless any number of times, from any process, because
//! the lane's number `s` can apply only once.

use std::fmt;

use mongodb::bson::Bson;

use super::LaneId;
use crate::error::Error;
use crate::write::counter::NotCounted;

/// The result of [`Counters::add`], [`Counters::add_from`] or
/// [`Counters::resume_lane`].
///
/// [`Counters::add`]: crate::Counters::add
/// [`Counters::add_from`]: crate::Counters::add_from
/// [`Counters::resume_lane`]: crate::Counters::resume_lane
///
/// ```no_run
/// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
/// use tally::LaneIncrement;
///
/// match views.add("home", 1).await {
///     LaneIncrement::Counted(_) => {}
///     // Harmless to resume any number of times: the lane's number applies once.
///     LaneIncrement::Unknown(ticket) => {
///         if let LaneIncrement::Unknown(still) = views.resume_lane(ticket).await? {
///             eprintln!("resume later: {}", views.lane_ticket(&still).unwrap_or_default());
///         }
///     }
///     LaneIncrement::NotCounted(not) => return Err(not.cause().clone()),
///     // Only a named lane (`add_from`) can be out of order.
///     LaneIncrement::OutOfOrder(_) => {}
/// }
/// # Ok(()) }
/// ```
#[must_use = "an increment may be unknown and need resuming"]
#[derive(Debug)]
pub enum LaneIncrement {
    /// Applied once: by this call, or earlier (then
    /// [`LaneCounted::settled_earlier`]).
    Counted(LaneCounted),
    /// The update may or may not have applied. Resume the ticket with
    /// [`Counters::resume_lane`] — any number of times, from any process,
    /// by any caller whose increment the update carried — while the update
    /// is younger than `lane_resume_horizon` (a named lane: at any time);
    /// after that, the increment is counted at most once.
    ///
    /// [`Counters::resume_lane`]: crate::Counters::resume_lane
    Unknown(LaneTicket),
    /// Definitely not applied: nothing was written. [`NotCounted::lane`]
    /// names the lane and its number, when one was taken.
    NotCounted(NotCounted),
    /// The lane holds a later position than this one
    /// ([`LaneOutOfOrder::held`]): nothing was written, and sending it
    /// again gives the same answer (Kafka's `OutOfOrderSequence`). This
    /// position is counted only if it applied before the later one did.
    /// It did when every position of the lane was sent in order, one at a
    /// time, each until it was counted (an unknown one resumed before a
    /// newer one was sent); a position that was not counted and then
    /// skipped was never added — add it through another lane to count it.
    OutOfOrder(LaneOutOfOrder),
}

impl LaneIncrement {
    /// The outcome's name: `counted`, `unknown`, `not_counted` or
    /// `out_of_order`.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.add("home", 1).await;
    /// println!("add to home: {}", outcome.name());
    /// # }
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Self::Counted(_) => "counted",
            Self::Unknown(_) => "unknown",
            Self::NotCounted(_) => "not_counted",
            Self::OutOfOrder(_) => "out_of_order",
        }
    }

    /// The counter's `_id`.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.add("home", 1).await;
    /// assert_eq!(outcome.key().as_str(), Some("home"));
    /// # }
    /// ```
    pub fn key(&self) -> &Bson {
        match self {
            Self::Counted(c) => &c.key,
            Self::Unknown(t) => &t.key,
            Self::NotCounted(n) => n.key(),
            Self::OutOfOrder(o) => &o.key,
        }
    }

    /// The lane the update went through (absent only when the increment
    /// was refused before a lane was taken).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.add("home", 1).await;
    /// if let (Some(lane), Some(number)) = (outcome.lane(), outcome.position()) {
    ///     println!("{} through lane {lane}, number {number}", outcome.name());
    /// }
    /// # }
    /// ```
    pub fn lane(&self) -> Option<&LaneId> {
        match self {
            Self::Counted(c) => Some(&c.lane),
            Self::Unknown(t) => Some(&t.lane),
            Self::NotCounted(n) => n.lane().map(|(lane, _)| lane),
            Self::OutOfOrder(o) => Some(&o.lane),
        }
    }

    /// The lane's number for this increment (absent when no lane was taken).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let lane = tally::LaneName::new("orders-3").expect("a lane name");
    /// let outcome = views.add_from("home", 1, &lane, 41).await;
    /// assert!(outcome.position().is_none_or(|position| position == 41));
    /// # }
    /// ```
    pub fn position(&self) -> Option<i64> {
        match self {
            Self::Counted(c) => Some(c.position),
            Self::Unknown(t) => Some(t.position),
            Self::NotCounted(n) => n.lane().map(|(_, s)| s),
            Self::OutOfOrder(o) => Some(o.position),
        }
    }

    /// The amount this increment adds (or would have added); for an
    /// unknown one, the whole update's (its ticket's
    /// [`share`](LaneTicket::share) is this caller's).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.add("home", 3).await;
    /// assert_eq!(outcome.amount(), 3);
    /// # }
    /// ```
    pub fn amount(&self) -> i64 {
        match self {
            Self::Counted(c) => c.amount,
            Self::Unknown(t) => t.amount,
            Self::NotCounted(n) => n.amount(),
            Self::OutOfOrder(o) => o.amount,
        }
    }

    /// The error that kept this increment from being counted, if any.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// let outcome = views.add("home", 1).await;
    /// if let Some(cause) = outcome.cause() {
    ///     eprintln!("home: {} ({cause})", outcome.name());
    /// }
    /// # }
    /// ```
    pub fn cause(&self) -> Option<&Error> {
        match self {
            Self::Counted(_) | Self::OutOfOrder(_) => None,
            Self::Unknown(t) => t.cause.as_ref(),
            Self::NotCounted(n) => Some(n.cause()),
        }
    }
}

/// The accessors shared by the counted outcome and the ticket. Each
/// example is one of `$fence` (the fence's first line), `$setup` (making
/// one, `outcome`), the method's own lines and `$end`.
macro_rules! lane_accessors {
    ($ty:ident, $amount_doc:literal, $fence:literal, $setup:literal, $end:literal) => {
        impl $ty {
            /// The counter's `_id`.
            ///
            #[doc = concat!($fence, $setup)]
            /// println!("the counter {}", outcome.key());
            #[doc = concat!($end, "```")]
            pub fn key(&self) -> &Bson {
                &self.key
            }
            /// The lane.
            ///
            #[doc = concat!($fence, $setup)]
            /// if let tally::LaneId::Named(name) = outcome.lane() {
            ///     println!("through the source's lane {name}");
            /// }
            #[doc = concat!($end, "```")]
            pub fn lane(&self) -> &LaneId {
                &self.lane
            }
            /// The lane's number for this increment.
            ///
            #[doc = concat!($fence, $setup)]
            /// println!("lane {}, number {}", outcome.lane(), outcome.position());
            #[doc = concat!($end, "```")]
            pub fn position(&self) -> i64 {
                self.position
            }
            #[doc = $amount_doc]
            ///
            #[doc = concat!($fence, $setup)]
            /// println!("{:+} to {}", outcome.amount(), outcome.key());
            #[doc = concat!($end, "```")]
            pub fn amount(&self) -> i64 {
                self.amount
            }
        }
    };
}

/// An increment through a lane that is counted.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::LaneIncrement;
///
/// if let LaneIncrement::Counted(counted) = views.add("home", 1).await {
///     println!("{:+} to {} through lane {}", counted.amount(), counted.key(), counted.lane());
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct LaneCounted {
    pub(super) key: Bson,
    pub(super) lane: LaneId,
    pub(super) position: i64,
    pub(super) amount: i64,
    pub(super) settled_earlier: bool,
}

lane_accessors!(
    LaneCounted,
    "The amount added.",
    "```no_run\n",
    "# async fn demo(views: tally::Counters) {\n\
     if let tally::LaneIncrement::Counted(outcome) = views.add(\"home\", 5).await {\n",
    "}\n# }\n"
);

impl LaneCounted {
    /// True when this call did not apply it because it had applied
    /// already — the lane holds exactly this position: an earlier attempt
    /// whose reply was lost, an earlier resume (from any process), or — for
    /// a named lane — an earlier delivery of the same position.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::{LaneIncrement, LaneName};
    ///
    /// // The source delivered offset 41 of `orders-3` again.
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// if let LaneIncrement::Counted(counted) = views.add_from("home", 1, &lane, 41).await
    ///     && counted.settled_earlier()
    /// {
    ///     println!("offset 41 was counted before: not again");
    /// }
    /// # }
    /// ```
    pub fn settled_earlier(&self) -> bool {
        self.settled_earlier
    }
}

/// An increment through a lane that holds a later position than the
/// increment's: nothing was written (see [`LaneIncrement::OutOfOrder`]).
///
/// ```no_run
/// # async fn demo(views: tally::Counters) {
/// use tally::{LaneIncrement, LaneName};
///
/// let lane = LaneName::new("orders-3").expect("a lane name");
/// if let LaneIncrement::OutOfOrder(old) = views.add_from("home", 1, &lane, 41).await {
///     println!("offset {} is behind the lane's {}: nothing written", old.position(), old.held());
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct LaneOutOfOrder {
    pub(super) key: Bson,
    pub(super) lane: LaneId,
    pub(super) position: i64,
    pub(super) amount: i64,
    pub(super) held: i64,
}

lane_accessors!(
    LaneOutOfOrder,
    "The amount the increment would add.",
    "```no_run\n",
    "# async fn demo(views: tally::Counters) {\n\
     let lane = tally::LaneName::new(\"orders-3\").expect(\"a lane name\");\n\
     if let tally::LaneIncrement::OutOfOrder(outcome) = views.add_from(\"home\", 5, &lane, 41).await {\n",
    "}\n# }\n"
);

impl LaneOutOfOrder {
    /// The later position the lane holds in the counter document.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::{LaneIncrement, LaneName};
    ///
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// if let LaneIncrement::OutOfOrder(old) = views.add_from("home", 1, &lane, 41).await {
    ///     assert!(old.held() > 41);
    /// }
    /// # }
    /// ```
    pub fn held(&self) -> i64 {
        self.held
    }
}

/// The ticket of an increment through a lane whose update may or may not
/// have applied: the counter, the lane, the lane's number and the update's
/// amount — everything needed to send the same update again. With group
/// commit several callers' increments travel in one update: each gets the
/// same update in its ticket ([`LaneTicket::amount`], their sum) and its
/// own [`share`](LaneTicket::share); resuming any of them settles all.
///
/// ```no_run
/// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
/// use tally::LaneIncrement;
///
/// if let LaneIncrement::Unknown(ticket) = views.add("home", 1).await {
///     // Keep it (it is `Clone`): any caller may resume it, any number of times.
///     eprintln!("unknown: {ticket}");
///     let settled = views.resume_lane(ticket.clone()).await?;
///     println!("{}", settled.name());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct LaneTicket {
    pub(super) key: Bson,
    pub(super) lane: LaneId,
    pub(super) position: i64,
    pub(super) amount: i64,
    pub(super) share: i64,
    pub(super) cause: Option<Error>,
}

lane_accessors!(
    LaneTicket,
    "The amount the update adds: the sum of every share it carries.",
    "```\n",
    "# fn main() -> Result<(), tally::Error> {\n\
     let lane = tally::LaneName::new(\"orders-3\").expect(\"a lane name\");\n\
     let outcome = tally::LaneTicket::new(\"home\", tally::LaneId::Named(lane), 41, 5)?;\n",
    "# Ok(()) }\n"
);

impl LaneTicket {
    /// Rebuilds a ticket from its parts — for an increment another process
    /// reported as unknown (the CLI's `resume --lane`, another host). The
    /// position and amount must be the original increment's: the update
    /// is recognised by the lane and position alone, so resuming with
    /// another amount would count that amount instead. A minted lane's
    /// positions start at 1, a named lane's at 0. The amount may be zero:
    /// a group's shares may add up to nothing, and its update must still
    /// be settled.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::{LaneId, LaneName, LaneTicket};
    ///
    /// // What another process logged for its unknown increment through `orders-3`.
    /// let lane = LaneId::Named(LaneName::new("orders-3").expect("a lane name"));
    /// let ticket = LaneTicket::new("home", lane, 41, 5)?;
    /// let settled = views.resume_lane(ticket).await?;
    /// println!("{}", settled.name());
    /// # Ok(()) }
    /// ```
    pub fn new(
        key: impl Into<Bson>,
        lane: LaneId,
        position: i64,
        amount: i64,
    ) -> Result<Self, Error> {
        check_position(&lane, position)?;
        Ok(Self {
            key: key.into(),
            lane,
            position,
            amount,
            share: amount,
            cause: None,
        })
    }

    /// This caller's own increment within the update (the whole amount for
    /// a ticket rebuilt with [`LaneTicket::new`]).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::LaneIncrement;
    ///
    /// if let LaneIncrement::Unknown(ticket) = views.add("home", 2).await {
    ///     // The update carries the whole group; this caller added 2 of it.
    ///     assert_eq!(ticket.share(), 2);
    ///     println!("the update adds {}, of which {} is ours", ticket.amount(), ticket.share());
    /// }
    /// # }
    /// ```
    pub fn share(&self) -> i64 {
        self.share
    }

    /// Why the update was not confirmed (none when rebuilt with
    /// [`LaneTicket::new`]).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::LaneIncrement;
    ///
    /// if let LaneIncrement::Unknown(ticket) = views.add("home", 1).await
    ///     && let Some(cause) = ticket.cause()
    /// {
    ///     eprintln!("unknown after: {cause}");
    /// }
    /// # }
    /// ```
    pub fn cause(&self) -> Option<&Error> {
        self.cause.as_ref()
    }
}

/// `+7 to "k" through lane 65f0…, position 2`: everything a resume needs,
/// and the caller's share when the update carries others' increments too.
/// The CLI's `tallyd resume` takes the ticket
/// [`Counters::lane_ticket`](crate::Counters::lane_ticket) prints.
impl fmt::Display for LaneTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:+} to {} through lane {}, position {}",
            self.amount, self.key, self.lane, self.position
        )?;
        if self.share != self.amount {
            write!(f, " ({:+} of it this caller's)", self.share)?;
        }
        Ok(())
    }
}

/// Refuses a zero amount, as the two-step increment does.
pub(super) fn check_amount(amount: i64) -> Result<(), Error> {
    if amount == 0 {
        Err(Error::InvalidArgument("the amount must not be zero".into()))
    } else {
        Ok(())
    }
}

/// Refuses a position the lane can never hold: below 1 for a minted lane
/// (its numbers start at 1), below 0 for a named one (an offset).
pub(super) fn check_position(lane: &LaneId, position: i64) -> Result<(), Error> {
    let least = match lane {
        LaneId::Minted(_) => 1,
        LaneId::Named(_) => 0,
    };
    if position < least {
        Err(Error::InvalidArgument(format!(
            "lane {lane}: a position must be at least {least}, not {position}"
        )))
    } else {
        Ok(())
    }
}
