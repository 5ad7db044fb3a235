//! The [`Ledger`] handle's methods — making one, its indexes — and
//! recording events: [`Ledger::record`], [`Ledger::record_again`] and
//! [`Ledger::record_many`], each event's outcome ([`Recording`]), the
//! recorder that numbers and sends them ([`recorder`]) and the insert that
//! tells what became of each ([`insert`]).

mod insert;
mod outcome;
mod recorder;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

pub use outcome::{Conflict, Event, EventTicket, NotRecorded, Recording};
pub(in crate::ledger) use recorder::Recorder;
pub(crate) use recorder::{time_of, unix_micros};

use super::{Ledger, MAX_EVENT_KEY_BYTES, field, index};
use crate::error::Error;
use crate::store::Store;
use crate::write::at::{bucket_id, counter_id};
use crate::write::counter::{CollectionConfig, WriterConfig};

/// An event to record, with the lanes and numbers it was sent with
/// before (none for a new one), or its outcome decided already (its time
/// refused).
type ToRecord = Result<(Event, Vec<(ObjectId, i64)>), Box<Recording>>;

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
        Self {
            events: store.collection(&events),
            counters: store.collection(&spec.name),
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
        let mut done: Vec<String> = index::create(&self.store, &events)
            .await?
            .into_iter()
            .map(|(need, created)| index::describe(&events, &need, created))
            .collect();
        if self.spec.buckets.is_some() {
            let collection = self.spec.name.as_str();
            let need = vec![index::bucket_counters()];
            for (need, created) in index::create_these(&self.store, collection, need).await? {
                done.push(index::describe(collection, &need, created));
            }
        }
        Ok(done)
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
        self.record_timed(vec![(event_key.into(), counter_key.into(), amount, None)])
            .await
            .pop()
            .expect("one outcome")
    }

    /// Records the event `event_key`, which happened at `at`: `amount` on
    /// the counter `counter_key` of the bucket holding `at`, in a
    /// collection with [`CollectionConfig::buckets`]. The event stores the
    /// bucketed `_id` `{k: counter_key, t: <bucket start>}` as its counter
    /// ([`Event::counter`]), so the fold counts it in the bucket it
    /// happened in, however late it arrives; [`Ledger::record`] is this at
    /// now. The event key stays the idempotency key: recorded again with
    /// another time (another bucket) it is still a
    /// [`Recording::Duplicate`], whose event names the bucket it was
    /// counted in — even when that time is refused. [`Recording::NotRecorded`],
    /// nothing written (the events collection read once, to tell a
    /// repeat): a time more
    /// than [`MAX_TIME_AHEAD`](crate::MAX_TIME_AHEAD) ahead of this host's
    /// clock ([`Error::TimeAhead`]), a time whose bucket ended more than
    /// `close_after` ago ([`Error::BucketClosed`]), any time for a
    /// collection without buckets ([`Error::InvalidArgument`]).
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) -> Result<(), Box<dyn std::error::Error>> {
    /// use tally::Recording;
    ///
    /// let buckets = orders.spec().buckets.clone().expect("a bucketed collection");
    /// let at = buckets.parse_time("2026-11-27T23:59:00+01:00")?;
    /// match orders.record_at("order-1042", "customer-7", 3, at).await {
    ///     Recording::NotRecorded(not) => eprintln!("order-1042: {}", not.cause()),
    ///     recording => println!("order-1042: {}", recording.name()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn record_at(
        &self,
        event_key: impl Into<String>,
        counter_key: impl Into<Bson>,
        amount: i64,
        at: SystemTime,
    ) -> Recording {
        self.record_timed(vec![(
            event_key.into(),
            counter_key.into(),
            amount,
            Some(at),
        )])
        .await
        .pop()
        .expect("one outcome")
    }

    /// [`Ledger::record_many`] of events that carry their time (`None`:
    /// now), each recorded as [`Ledger::record_at`] records it: a refused
    /// time refuses its event alone.
    ///
    /// ```no_run
    /// # async fn demo(orders: tally::Ledger) {
    /// use std::time::{Duration, SystemTime};
    ///
    /// let an_hour_ago = SystemTime::now() - Duration::from_secs(3600);
    /// let lines = [("order-1042", "customer-7", 3, Some(an_hour_ago)), ("order-1043", "customer-7", 1, None)];
    /// for recording in orders.record_many_at(lines).await {
    ///     println!("{}: {}", recording.event().key(), recording.name());
    /// }
    /// # }
    /// ```
    pub async fn record_many_at<K, C>(
        &self,
        events: impl IntoIterator<Item = (K, C, i64, Option<SystemTime>)>,
    ) -> Vec<Recording>
    where
        K: Into<String>,
        C: Into<Bson>,
    {
        let events = events
            .into_iter()
            .map(|(key, counter, amount, at)| (key.into(), counter.into(), amount, at))
            .collect();
        self.record_timed(events).await
    }

    /// Records events, each `counter` made the `_id` of its bucket first.
    /// An event whose time is refused (far ahead, or in a closed bucket) is
    /// not recorded — unless it was recorded before: its key is the
    /// idempotency key whatever its time, so a repeat is judged against
    /// what is stored (a duplicate, or a conflict), as an insert's
    /// collision would be. That costs one read of the events collection,
    /// and only for such events; nothing is written.
    async fn record_timed(
        &self,
        events: Vec<(String, Bson, i64, Option<SystemTime>)>,
    ) -> Vec<Recording> {
        let now = SystemTime::now();
        let mut refused_times = Vec::new();
        let mut prepared: Vec<ToRecord> = Vec::with_capacity(events.len());
        for (i, (key, counter, amount, at)) in events.into_iter().enumerate() {
            let timed = counter_id(&self.spec, counter.clone(), at, now);
            let event = Event {
                key,
                counter,
                amount,
            };
            match timed {
                Ok(counter) => prepared.push(Ok((Event { counter, ..event }, Vec::new()))),
                Err(cause) => {
                    let bucket = self.spec.buckets.as_ref().zip(at);
                    if let Some(start) = bucket.and_then(|(b, at)| b.start_of(at).ok())
                        && matches!(cause, Error::TimeAhead { .. } | Error::BucketClosed { .. })
                    {
                        let counter = bucket_id(event.counter.clone(), start);
                        refused_times.push((
                            i,
                            Event {
                                counter,
                                ..event.clone()
                            },
                        ));
                    }
                    let refused = Recording::NotRecorded(NotRecorded { event, cause });
                    prepared.push(Err(Box::new(refused)));
                }
            }
        }
        for (i, event) in refused_times {
            let stored = self
                .store
                .find_one(
                    &self.events,
                    doc! { "_id": &event.key },
                    doc! { field::COUNTER: 1, field::AMOUNT: 1 },
                    "ledger.read_event",
                )
                .await;
            // Unread (the server failed): not recorded, as refused.
            if let Ok(Some(stored)) = stored {
                prepared[i] = Err(Box::new(insert::judge_other(event, &stored)));
            }
        }
        self.record_all(prepared).await
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
            .record_all(vec![Ok((ticket.event, ticket.attempts))])
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
        let untimed = events
            .into_iter()
            .map(|(key, counter, amount)| (key, counter, amount, None));
        self.record_many_at(untimed).await
    }

    /// Refuses what can never be recorded (and keeps the refusals given),
    /// queues the rest, and waits for every outcome.
    async fn record_all(&self, events: Vec<ToRecord>) -> Vec<Recording> {
        let mut outcomes: Vec<Option<Recording>> = Vec::with_capacity(events.len());
        let mut sending = Vec::new();
        let mut queued = Vec::new();
        for (i, event) in events.into_iter().enumerate() {
            let (event, earlier) = match event {
                Ok(event) => event,
                Err(refused) => {
                    outcomes.push(Some(*refused));
                    continue;
                }
            };
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
                    Error::RecorderStopped,
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
}
