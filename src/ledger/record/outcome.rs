//! What recording an event tells its caller: exactly one of five outcomes
//! ([`Recording`]), the conflict a reused event key is ([`Conflict`]), and
//! the ticket that settles the uncertain outcome ([`EventTicket`]).

use mongodb::Namespace;
use mongodb::bson::{Bson, oid::ObjectId};

use crate::document::display_id;
use crate::error::Error;

/// One event: its key (the idempotency key), the counter it counts on and
/// the amount it adds.
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) {
/// let recording = orders.record("order-1042", "2026-05", 3).await;
/// let event = recording.event();
/// println!("{} adds {} to {}", event.key(), event.amount(), event.counter());
/// # }
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub(super) key: String,
    pub(super) counter: Bson,
    pub(super) amount: i64,
}

impl Event {
    /// The event's key: the `_id` of its document in the events collection.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// assert_eq!(recording.event().key(), "order-1042");
    /// # }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The `_id` of the counter the event counts on.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// assert_eq!(recording.event().counter().as_str(), Some("2026-05"));
    /// # }
    /// ```
    pub fn counter(&self) -> &Bson {
        &self.counter
    }

    /// The amount the event adds to its counter.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// assert_eq!(recording.event().amount(), 3);
    /// # }
    /// ```
    pub fn amount(&self) -> i64 {
        self.amount
    }
}

/// The result of [`Ledger::record`], of each event of
/// [`Ledger::record_many`], or of [`Ledger::record_again`].
///
/// [`Ledger::record`]: crate::Ledger::record
/// [`Ledger::record_many`]: crate::Ledger::record_many
/// [`Ledger::record_again`]: crate::Ledger::record_again
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
/// use tally::Recording;
///
/// let mut recording = orders.record("order-1042", "2026-05", 3).await;
/// if let Recording::Unknown(ticket) = recording {
///     // The insert may have landed: sending the same event again is safe.
///     recording = orders.record_again(ticket).await?;
/// }
/// match recording {
///     Recording::Recorded(_) | Recording::Duplicate(_) => {}
///     Recording::Unknown(ticket) => eprintln!("{}: send it again later", ticket.event().key()),
///     Recording::Conflict(conflict) => eprintln!("{conflict}"),
///     Recording::NotRecorded(not) => return Err(not.cause().clone()),
/// }
/// # Ok(()) }
/// ```
#[must_use = "a recording may be unknown and need sending again"]
#[derive(Debug)]
pub enum Recording {
    /// This call recorded the event (or an earlier attempt of this call,
    /// whose reply was lost, did): it will be counted once.
    Recorded(Event),
    /// The event key was recorded before, with the same counter and
    /// amount: the event is counted once, by the earlier recording.
    Duplicate(Event),
    /// The event key was recorded before with another counter or amount:
    /// nothing was written. The key is being reused for another event — a
    /// bug of the caller's to fix.
    Conflict(Conflict),
    /// The insert may or may not have landed. Send the ticket again with
    /// [`Ledger::record_again`] — safe any number of times, from any
    /// process, within the writers' retry horizon.
    ///
    /// [`Ledger::record_again`]: crate::Ledger::record_again
    Unknown(EventTicket),
    /// Definitely not recorded: nothing was written. Never the outcome of
    /// [`Ledger::record_again`]: a refused resend is still `Unknown`, as
    /// the attempts before it may have landed.
    ///
    /// [`Ledger::record_again`]: crate::Ledger::record_again
    NotRecorded(NotRecorded),
}

impl Recording {
    /// The outcome's name as the CLI prints it: `recorded`, `duplicate`,
    /// `conflict`, `unknown` or `not_recorded`.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// println!("order-1042: {}", recording.name());
    /// # }
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            Self::Recorded(_) => "recorded",
            Self::Duplicate(_) => "duplicate",
            Self::Conflict(_) => "conflict",
            Self::Unknown(_) => "unknown",
            Self::NotRecorded(_) => "not_recorded",
        }
    }

    /// The event as this call gave it.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// assert_eq!(recording.event().key(), "order-1042");
    /// # }
    /// ```
    pub fn event(&self) -> &Event {
        match self {
            Self::Recorded(e) | Self::Duplicate(e) => e,
            Self::Conflict(c) => &c.event,
            Self::Unknown(t) => &t.event,
            Self::NotRecorded(n) => &n.event,
        }
    }

    /// True for the outcomes after which the event is counted exactly once:
    /// recorded and duplicate.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if !recording.is_counted() {
    ///     eprintln!("order-1042 is {}: not counted yet", recording.name());
    /// }
    /// # }
    /// ```
    pub fn is_counted(&self) -> bool {
        matches!(self, Self::Recorded(_) | Self::Duplicate(_))
    }
}

/// An event key recorded before for another counter or amount: nothing
/// was written.
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) {
/// if let tally::Recording::Conflict(conflict) = orders.record("order-1042", "2026-05", 3).await {
///     // One sentence for people: the key, both counters and amounts.
///     eprintln!("{conflict}");
/// }
/// # }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "event {key:?} was recorded before as {stored_amount} on counter {stored}, not {given_amount} \
     on counter {given}: refused, nothing was written",
    key = event.key,
    stored = display_id(stored_counter),
    given = display_id(&event.counter),
    given_amount = event.amount
)]
pub struct Conflict {
    pub(super) event: Event,
    pub(super) stored_counter: Bson,
    pub(super) stored_amount: i64,
}

impl Conflict {
    /// The event as this call gave it.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if let tally::Recording::Conflict(conflict) = recording {
    ///     assert_eq!(conflict.event().amount(), 3);
    /// }
    /// # }
    /// ```
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// The counter the key was recorded for before.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if let tally::Recording::Conflict(conflict) = recording {
    ///     eprintln!("order-1042 counts on {} already", conflict.stored_counter());
    /// }
    /// # }
    /// ```
    pub fn stored_counter(&self) -> &Bson {
        &self.stored_counter
    }

    /// The amount the key was recorded with before.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if let tally::Recording::Conflict(conflict) = recording {
    ///     eprintln!("order-1042 was recorded with {}", conflict.stored_amount());
    /// }
    /// # }
    /// ```
    pub fn stored_amount(&self) -> i64 {
        self.stored_amount
    }
}

/// An event whose insert may or may not have landed: the event, the
/// events collection it was sent to, and every lane and number it was sent
/// with — so that finding the event already there with one of them says
/// "an attempt of ours landed" (recorded), not "someone else recorded it"
/// (duplicate). Only a ledger of that events collection settles it: in
/// another one the event would be recorded, and counted, a second time.
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
/// use tally::Recording;
///
/// if let Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
///     let again = orders.record_again(ticket).await?;
///     println!("order-1042: {}", again.name());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct EventTicket {
    pub(super) event: Event,
    /// The database and events collection its attempts went to.
    pub(super) events: Namespace,
    /// The lanes and numbers it was sent with, first attempt first.
    pub(super) attempts: Vec<(ObjectId, i64)>,
    pub(super) cause: Option<Error>,
}

impl EventTicket {
    /// The event.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// if let tally::Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     eprintln!("{} unknown", ticket.event().key());
    /// }
    /// # }
    /// ```
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// The database and events collection the event was sent to: the
    /// ledger whose [`Ledger::record_again`] settles the ticket (a queue
    /// of tickets shared by several ledgers routes each by it).
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// if let tally::Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     // Queue it for the ledger of this collection, e.g. "app.orders_events".
    ///     let route = ticket.events_collection().to_string();
    ///     eprintln!("order-1042 unknown: settle it with the ledger of {route}");
    /// }
    /// # }
    /// ```
    ///
    /// [`Ledger::record_again`]: crate::Ledger::record_again
    pub fn events_collection(&self) -> &Namespace {
        &self.events
    }

    /// The recorder's lane it was first sent on (`L` in the event
    /// document).
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// if let tally::Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     // Where to look for it: `{L: lane, s: number}` in the events collection.
    ///     eprintln!("sent as {}/{}", ticket.lane(), ticket.number());
    /// }
    /// # }
    /// ```
    pub fn lane(&self) -> ObjectId {
        self.attempts[0].0
    }

    /// Its number on that lane (`s`): microseconds since the epoch by the
    /// recorder's clock when it was first sent.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// if let tally::Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     assert!(ticket.number() > 0);
    /// }
    /// # }
    /// ```
    pub fn number(&self) -> i64 {
        self.attempts[0].1
    }

    /// Why the insert was not confirmed.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// if let tally::Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     if let Some(cause) = ticket.cause() {
    ///         eprintln!("unknown after: {cause}");
    ///     }
    /// }
    /// # }
    /// ```
    pub fn cause(&self) -> Option<&Error> {
        self.cause.as_ref()
    }
}

impl EventTicket {
    /// The ticket of `event`, sent to `events` with `attempts`.
    pub(super) fn new(
        event: Event,
        events: &Namespace,
        attempts: Vec<(ObjectId, i64)>,
        cause: Error,
    ) -> Self {
        Self {
            event,
            events: events.clone(),
            attempts,
            cause: Some(cause),
        }
    }
}

/// What the caller learns of an attempt that wrote nothing (refused, or
/// never sent): `NotRecorded` for an event's first attempt. A resent
/// ticket's `earlier` attempts may have landed, or still may (held up in
/// the network): a resend never says more than unknown about them, so it
/// stays `Unknown`, its ticket as it was, to be sent again.
pub(super) fn refused(
    event: Event,
    earlier: Vec<(ObjectId, i64)>,
    events: &Namespace,
    cause: Error,
) -> Recording {
    if earlier.is_empty() {
        Recording::NotRecorded(NotRecorded { event, cause })
    } else {
        Recording::Unknown(EventTicket::new(event, events, earlier, cause))
    }
}

/// An event that was definitely not recorded, and why.
///
/// ```no_run
/// # async fn demo(orders: tally::Ledger) {
/// if let tally::Recording::NotRecorded(not) = orders.record("order-1042", "2026-05", 3).await {
///     // Nothing was written: record it again later, or give up.
///     eprintln!("{} not recorded: {}", not.event().key(), not.cause());
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct NotRecorded {
    pub(super) event: Event,
    pub(super) cause: Error,
}

impl NotRecorded {
    /// The event.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if let tally::Recording::NotRecorded(not) = recording {
    ///     assert_eq!(not.event().key(), "order-1042");
    /// }
    /// # }
    /// ```
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Why nothing was written.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let recording = orders.record("order-1042", "2026-05", 3).await;
    /// if let tally::Recording::NotRecorded(not) = recording {
    ///     eprintln!("not recorded: {}", not.cause());
    /// }
    /// # }
    /// ```
    pub fn cause(&self) -> &Error {
        &self.cause
    }
}
