//! The events ledger: idempotency keys, so that the same event delivered
//! twice — a queue's redelivery, a webhook's retry, a second press of the
//! button — is counted once (`docs/src/design/ledger.md`).
//!
//! A token or a lane identifies one *attempt* to count; an event key
//! identifies the *event*. Recording an event inserts one document into the
//! counter collection's events collection
//! ([`CollectionConfig::events_collection_name`], default `<name>_events`):
//!
//! ```text
//! { _id: <event key>, k: <counter key>, n: <amount, int64>, at: <date>, L: <lane>, s: <number> }
//! ```
//!
//! The `_id` is the event key, so the server's unique index on `_id` is the
//! memory of what was seen. A duplicate key means the key is there: with
//! the same counter and amount it is a duplicate (counted once), with
//! another one a [`Conflict`] (nothing written). `L` and `s` are the
//! recorder's lane and the event's number on it ([`recorder`]): finding the
//! key with a lane and number *this* recording sent it with means an
//! attempt of ours whose reply was lost landed — recorded, not duplicate —
//! which equal content alone could not tell.
//!
//! **The events collection is an append-only log**: after its insert an
//! event is never updated. Event numbers are the server's time (see
//! [`recorder`]); the daemon folds by number ranges (see
//! `reconcile::ledger`): it keeps one watermark `W` — every event numbered
//! at or below it is folded — raises the events collection's floor
//! ([`floor`]) to a pass's end before reading its range, and writes each
//! counter once per pass through its fold lane. Events are deleted once
//! folded and older than `event_retention`: the dedupe window. A repeat inside the window is a duplicate, always; after it,
//! the key is new again and the repeat is recorded and counted again.
//!
//! [`Ledger::value`] reads a counter exactly: the counter plus its events
//! not folded yet, consistent at any moment of a fold ([`read`]).

pub(crate) mod floor;
pub(crate) mod index;
mod insert;
mod outcome;
mod read;
mod recorder;
pub(crate) mod state;

use std::sync::Arc;
use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

pub use outcome::{Conflict, Event, EventTicket, NotRecorded, Recording};
pub use read::ExactValue;
pub(crate) use recorder::{time_of, unix_micros};

use super::counter::{CollectionConfig, WriterConfig};
use super::lane::LaneName;
use crate::error::Error;
use crate::store::Store;
use recorder::Recorder;

/// Default dedupe window: how long a folded event's key is remembered.
pub const DEFAULT_EVENT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The event document's fields, shared with the fold.
pub(crate) mod field {
    /// The counter key.
    pub(crate) const COUNTER: &str = "k";
    /// The amount.
    pub(crate) const AMOUNT: &str = "n";
    /// When the event was recorded (the recorder's clock).
    pub(crate) const AT: &str = "at";
    /// The recorder's lane.
    pub(crate) const LANE: &str = "L";
    /// The event's number on its lane (microseconds since the epoch by the
    /// server's clock, as the recorder reckons it; unique and growing on
    /// the lane).
    pub(crate) const NUMBER: &str = "s";
}

/// The longest event key, in bytes: keys are `_id`s, and index keys must
/// stay well inside the server's limits.
pub const MAX_EVENT_KEY_BYTES: usize = 512;

/// Records events of one counter collection, each once, and reads its
/// counters exactly. Cheap to clone; clones share one lane, and the events
/// their callers record while an insert is in flight go out together as
/// the next insert. Make one per process and clone it.
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use tally::{CollectionConfig, Ledger, Recording};
///
/// let orders = Ledger::new(&store, CollectionConfig::new("order_totals"));
/// // The order's id is the event's key: recording it again counts nothing.
/// let mut recording = orders.record("order-1042", "2026-05", 3).await;
/// if let Recording::Unknown(ticket) = recording {
///     // The insert may have landed: sending the same event again is safe.
///     recording = orders.record_again(ticket).await?;
/// }
/// match recording {
///     Recording::Recorded(_) | Recording::Duplicate(_) => {}
///     Recording::Unknown(ticket) => eprintln!("{}: send it again later", ticket.event().key()),
///     Recording::Conflict(conflict) => eprintln!("a reused key: {conflict}"),
///     Recording::NotRecorded(not) => return Err(not.cause().clone()),
/// }
/// println!("May so far: {}", orders.value("2026-05").await?.value);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Ledger {
    store: Store,
    spec: Arc<CollectionConfig>,
    events: Collection<Document>,
    counters: Collection<Document>,
    state: Collection<Document>,
    recorder: Arc<Recorder>,
    retry_horizon: Duration,
}

impl Ledger {
    /// A ledger for the counter collection `spec`; its events go to
    /// [`CollectionConfig::events_collection_name`], and an unknown
    /// recording may be sent again for the default retry horizon (3
    /// minutes; see [`Ledger::with_retry_horizon`]).
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{CollectionConfig, Ledger};
    ///
    /// let orders = Ledger::new(&store, CollectionConfig::new("order_totals"));
    /// assert_eq!(orders.spec().events_collection_name(), "order_totals_events");
    /// # }
    /// ```
    pub fn new(store: &Store, spec: CollectionConfig) -> Self {
        let events = spec.events_collection_name();
        let state = state::collection_name(&events);
        Self {
            events: store.collection(&events),
            counters: store.collection(&spec.name),
            state: store.collection(&state),
            recorder: Arc::new(Recorder::new(store, &events)),
            store: store.clone(),
            spec: Arc::new(spec),
            retry_horizon: WriterConfig::default().retry_horizon,
        }
    }

    /// The same ledger sending an unknown recording again
    /// ([`Ledger::record_again`]) only within `horizon` of its first
    /// attempt: the writers' retry horizon (`[writer] retry_horizon`),
    /// which the dedupe window (`event_retention`) must outlast.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use std::time::Duration;
    /// use tally::{CollectionConfig, Ledger};
    ///
    /// // The writers' `[writer] retry_horizon`, if not the default.
    /// let orders = Ledger::new(&store, CollectionConfig::new("order_totals"))
    ///     .with_retry_horizon(Duration::from_secs(60));
    /// # }
    /// ```
    pub fn with_retry_horizon(mut self, horizon: Duration) -> Self {
        self.retry_horizon = horizon;
        self
    }

    /// The counter collection and its field names.
    ///
    /// ```no_run
    /// # fn demo(orders: tally::Ledger) {
    /// let spec = orders.spec();
    /// println!("events of {} go to {}", spec.name, spec.events_collection_name());
    /// # }
    /// ```
    pub fn spec(&self) -> &CollectionConfig {
        &self.spec
    }

    /// Creates the indexes the events collection needs (`tallyd setup`
    /// calls this; tally never does behind the caller's back), and returns
    /// one line per index saying what it did. Idempotent.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// // At deployment, as `tallyd setup` does.
    /// for line in orders.create_indexes().await? {
    ///     println!("{line}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn create_indexes(&self) -> Result<Vec<String>, Error> {
        let events = self.spec.events_collection_name();
        let done = index::create(&self.store, &events).await?;
        Ok(done
            .into_iter()
            .map(|(need, created)| index::describe(&events, &need, created))
            .collect())
    }

    /// The indexes the events collection lacks, by name (empty when the
    /// fold can run).
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// let missing = orders.missing_indexes().await?;
    /// if !missing.is_empty() {
    ///     let missing = missing.join(", ");
    ///     eprintln!("the ledger cannot be folded yet: run `tallyd setup` (missing: {missing})");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn missing_indexes(&self) -> Result<Vec<String>, Error> {
        index::missing(&self.store, &self.spec.events_collection_name()).await
    }

    /// Records the event `event_key`: `amount` (not zero) on the counter
    /// `counter_key`. One insert, shared with the events this handle's
    /// other callers record meanwhile; see [`Recording`] for what the
    /// caller learns.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// use tally::Recording;
    ///
    /// match orders.record("order-1042", "2026-05", 3).await {
    ///     recording if recording.is_counted() => {}
    ///     // Safe to send again within the retry horizon: counted once.
    ///     Recording::Unknown(ticket) => {
    ///         let again = orders.record_again(ticket).await?;
    ///         println!("order-1042 sent again: {}", again.name());
    ///     }
    ///     other => eprintln!("order-1042 {}", other.name()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn record(
        &self,
        event_key: impl Into<String>,
        counter_key: impl Into<Bson>,
        amount: i64,
    ) -> Recording {
        let event = Event {
            key: event_key.into(),
            counter: counter_key.into(),
            amount,
        };
        self.record_all(vec![(event, Vec::new())])
            .await
            .pop()
            .expect("one outcome")
    }

    /// Sends an unknown recording again, on this handle's current lane with
    /// a fresh number: [`Recording::Recorded`] when it (or an earlier
    /// attempt of it) landed, [`Recording::Duplicate`] when another
    /// recording of the key did. Safe any number of times, from any
    /// process, within the retry horizon of its first attempt. A resend
    /// that is refused (the server's clock cannot be read, its insert meets a
    /// command error) is still [`Recording::Unknown`], never
    /// [`Recording::NotRecorded`]: the earlier attempts may have landed, or
    /// still may; send the ticket it returns again.
    ///
    /// `Err` means refused, nothing sent:
    /// [`Error::EventRetryHorizonExceeded`] once the first attempt is older
    /// than the retry horizon — the event may have been folded and its key
    /// forgotten, and sending it again could count it twice; it is recorded
    /// at most once. [`Error::InvalidArgument`] for a ticket of another
    /// events collection ([`EventTicket::events_collection`]): recording it
    /// here would count the event on two ledgers.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), tally::Error> {
    /// use tally::{Error, Recording};
    ///
    /// if let Recording::Unknown(ticket) = orders.record("order-1042", "2026-05", 3).await {
    ///     match orders.record_again(ticket).await {
    ///         Ok(again) => println!("order-1042: {}", again.name()),
    ///         // Too late to send again: the event is counted at most once.
    ///         Err(Error::EventRetryHorizonExceeded { event, .. }) => {
    ///             eprintln!("{event}: gave up")
    ///         }
    ///         Err(other) => return Err(other),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn record_again(&self, ticket: EventTicket) -> Result<Recording, Error> {
        let events = self.events.namespace();
        if ticket.events != events {
            return Err(Error::InvalidArgument(format!(
                "event {}: the ticket was issued for the events collection {}, not this \
                 ledger's {}: nothing was sent; settle it with a ledger of {}",
                ticket.event.key, ticket.events, events, ticket.events
            )));
        }
        let Some(&(_, first)) = ticket.attempts.first() else {
            return Err(Error::InvalidArgument(format!(
                "event {}: the ticket names no attempt, so its age is unknown; nothing was sent",
                ticket.event.key
            )));
        };
        // Numbers are the server's time: the age is judged on its clock,
        // never this host's, which may be behind.
        let age = self
            .store
            .server_time()
            .await?
            .duration_since(time_of(first))
            .unwrap_or(Duration::ZERO);
        if age >= self.retry_horizon {
            return Err(Error::EventRetryHorizonExceeded {
                event: ticket.event.key,
                age,
                horizon: self.retry_horizon,
            });
        }
        Ok(self
            .record_all(vec![(ticket.event, ticket.attempts)])
            .await
            .pop()
            .expect("one outcome"))
    }

    /// Records a batch of events: one outcome per event, in the order
    /// given. They go out in order, as few ordered inserts as the server
    /// takes (up to 100,000 events or 16 MiB each), with any events this
    /// handle's other callers record meanwhile. An event key given twice is
    /// recorded once; the second is a duplicate (or a conflict).
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// let lines = [("order-1042", "2026-05", 3), ("order-1043", "2026-05", 1)];
    /// let outcomes = orders.record_many(lines).await;
    /// for recording in outcomes.iter().filter(|r| !r.is_counted()) {
    ///     eprintln!("{}: {}", recording.event().key(), recording.name());
    /// }
    /// # }
    /// ```
    pub async fn record_many<K, C>(
        &self,
        events: impl IntoIterator<Item = (K, C, i64)>,
    ) -> Vec<Recording>
    where
        K: Into<String>,
        C: Into<Bson>,
    {
        let events = events
            .into_iter()
            .map(|(key, counter, amount)| {
                let event = Event {
                    key: key.into(),
                    counter: counter.into(),
                    amount,
                };
                (event, Vec::new())
            })
            .collect();
        self.record_all(events).await
    }

    /// Refuses what can never be recorded, queues the rest, and waits for
    /// every outcome.
    async fn record_all(&self, events: Vec<(Event, Vec<(ObjectId, i64)>)>) -> Vec<Recording> {
        let mut outcomes: Vec<Option<Recording>> = Vec::with_capacity(events.len());
        let mut sending = Vec::new();
        let mut queued = Vec::new();
        for (i, (event, earlier)) in events.into_iter().enumerate() {
            match check_event(&event) {
                Ok(()) => {
                    outcomes.push(None);
                    sending.push(i);
                    queued.push((event, earlier));
                }
                Err(cause) => {
                    outcomes.push(Some(Recording::NotRecorded(NotRecorded { event, cause })))
                }
            }
        }
        let queued_events: Vec<(Event, Vec<(ObjectId, i64)>)> = queued.clone();
        let receivers = self.recorder.submit(queued);
        for ((i, receiver), (event, earlier)) in
            sending.into_iter().zip(receivers).zip(queued_events)
        {
            let outcome = receiver.await.unwrap_or_else(|_| {
                // The sender was stopped (the runtime is shutting down)
                // with this event possibly in flight.
                Recording::Unknown(EventTicket::new(
                    event,
                    &self.events.namespace(),
                    earlier,
                    Error::InvalidArgument(
                        "the recorder stopped with the event possibly in flight".into(),
                    ),
                ))
            });
            outcomes[i] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every event gets an outcome"))
            .collect()
    }
}

/// The daemon's fold lane of the events collection `events`: a named lane
/// of the lanes protocol (`fold:<events>`, `.` written as `%2E` and `%` as
/// `%25`, as lane names are field names), whose position on each counter is
/// the last fold pass applied to it.
pub(crate) fn fold_lane(events: &str) -> Result<LaneName, Error> {
    let escaped = events.replace('%', "%25").replace('.', "%2E");
    LaneName::new(format!("fold:{escaped}")).map_err(|bad| {
        Error::InvalidArgument(format!(
            "events collection {events:?} cannot name its fold lane: {bad}; choose a shorter name"
        ))
    })
}

/// Refuses what can never be recorded: an empty or overlong key, a zero
/// amount.
fn check_event(event: &Event) -> Result<(), Error> {
    if event.key.is_empty() {
        return Err(Error::InvalidArgument(
            "the event key must not be empty".into(),
        ));
    }
    if event.key.len() > MAX_EVENT_KEY_BYTES {
        return Err(Error::InvalidArgument(format!(
            "the event key is {} bytes long; at most {MAX_EVENT_KEY_BYTES} are allowed",
            event.key.len()
        )));
    }
    if event.amount == 0 {
        return Err(Error::InvalidArgument("the amount must not be zero".into()));
    }
    crate::document::check_key(&event.counter)
}

/// The event's document, numbered `number` on `lane`.
fn event_document(event: &Event, lane: ObjectId, number: i64) -> Document {
    doc! {
        "_id": &event.key,
        field::COUNTER: &event.counter,
        field::AMOUNT: event.amount,
        field::AT: DateTime::now(),
        field::LANE: lane,
        field::NUMBER: number,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(counter: &str, amount: i64) -> Event {
        Event {
            key: "evt_1".into(),
            counter: counter.into(),
            amount,
        }
    }

    #[test]
    fn empty_and_overlong_keys_and_zero_amounts_are_refused() {
        assert!(check_event(&event("a", 1)).is_ok());
        assert!(check_event(&event("a", 0)).is_err());
        let mut long = event("a", 1);
        long.key = "x".repeat(MAX_EVENT_KEY_BYTES + 1);
        assert!(check_event(&long).is_err());
        long.key.clear();
        assert!(check_event(&long).is_err());
    }

    #[test]
    fn the_fold_lane_names_its_events_collection_as_a_field_name_can() {
        assert_eq!(
            fold_lane("views_events").unwrap().as_str(),
            "fold:views_events"
        );
        assert_eq!(fold_lane("a.b%c").unwrap().as_str(), "fold:a%2Eb%25c");
        assert_ne!(fold_lane("a.b").unwrap(), fold_lane("a%2Eb").unwrap());
        assert!(fold_lane(&"x".repeat(200)).is_err());
    }
}
