//! The events ledger: idempotency keys, so that the same event delivered
//! twice — a queue's redelivery, a webhook's retry, a second press of the
//! button — is counted once (DESIGN §8).
//!
//! A token or a lane identifies one *attempt* to count; an event key
//! identifies the *event*. Recording an event inserts one document into the
//! counter collection's events collection
//! ([`CollectionConfig::events_collection_name`], default `<name>_events`):
//!
//! ```text
//! { _id: <event key>, k: <counter key>, n: <amount, int64>, at: <date>, r: <recording token> }
//! ```
//!
//! The `_id` is the event key, so the server's unique index on `_id` is the
//! memory of what was seen. A duplicate key means the key is there: with
//! the same counter and amount it is a duplicate (counted once), with
//! another one a [`Conflict`] (nothing written). `r` is a fresh token per
//! recording: finding the key with *our* token means an attempt of ours
//! whose reply was lost landed — recorded, not duplicate — which equal
//! content alone could not tell.
//!
//! The daemon folds recorded events into their counters in batches (the
//! fold writes `c: {b, l, s}` when it claims an event and `f: <date>` once
//! its batch is in the counter; see `reconcile::ledger`), and the
//! events collection's TTL index on `f` forgets a folded event after
//! `event_retention`: the dedupe window. A repeat inside the window is a
//! duplicate, always; after it, the key is new again and the repeat is
//! recorded and counted again.
//!
//! [`Ledger::value`] reads a counter exactly: the counter plus its events
//! not yet in it, consistent at any moment of a fold ([`read`]).

pub(crate) mod index;
mod outcome;
mod read;

use std::sync::Arc;

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use mongodb::error::ErrorKind;

pub use index::DEFAULT_EVENT_RETENTION;
pub use outcome::{Conflict, Event, EventTicket, NotRecorded, Recording};
pub use read::ExactValue;

use super::counter::CollectionConfig;
use crate::document::{Inserted, insert_if_absent, integer_value, same_key};
use crate::error::{Effect, Error, Facts, Failure, Next, RetryBudget, code};
use crate::store::Store;

/// The event document's fields, shared with the fold.
pub(crate) mod field {
    /// The counter key.
    pub(crate) const COUNTER: &str = "k";
    /// The amount.
    pub(crate) const AMOUNT: &str = "n";
    /// When the event was recorded (the recorder's clock).
    pub(crate) const AT: &str = "at";
    /// The recording's token.
    pub(crate) const TOKEN: &str = "r";
    /// The claim: `{b: batch, l: lane, s: number}`, written by the fold.
    pub(crate) const CLAIM: &str = "c";
    /// The claim's batch.
    pub(crate) const BATCH: &str = "c.b";
    /// When the fold marked the event folded (the daemon's clock).
    pub(crate) const FOLDED: &str = "f";
}

/// The longest event key, in bytes: keys are `_id`s, and index keys must
/// stay well inside the server's limits.
pub const MAX_EVENT_KEY_BYTES: usize = 512;

/// Records events of one counter collection, each once, and reads its
/// counters exactly. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Ledger {
    store: Store,
    spec: Arc<CollectionConfig>,
    events: Collection<Document>,
    counters: Collection<Document>,
}

impl Ledger {
    /// A ledger for the counter collection `spec`; its events go to
    /// [`CollectionConfig::events_collection_name`].
    pub fn new(store: &Store, spec: CollectionConfig) -> Self {
        Self {
            events: store.collection(&spec.events_collection_name()),
            counters: store.collection(&spec.name),
            store: store.clone(),
            spec: Arc::new(spec),
        }
    }

    /// The counter collection and its field names.
    pub fn spec(&self) -> &CollectionConfig {
        &self.spec
    }

    /// Creates the indexes the events collection needs (`tallyd setup`
    /// calls this; tally never does behind the caller's back) with
    /// `event_retention` as the dedupe window, and returns one line per
    /// index saying what it did. Idempotent.
    pub async fn create_indexes(
        &self,
        event_retention: std::time::Duration,
    ) -> Result<Vec<String>, Error> {
        let events = self.spec.events_collection_name();
        let done = index::create(&self.store, &events, event_retention).await?;
        Ok(done
            .into_iter()
            .map(|(need, created)| index::describe(&events, &need, &created))
            .collect())
    }

    /// The indexes the events collection lacks, by name (empty when the
    /// fold can run).
    pub async fn missing_indexes(
        &self,
        event_retention: std::time::Duration,
    ) -> Result<Vec<String>, Error> {
        index::missing(
            &self.store,
            &self.spec.events_collection_name(),
            event_retention,
        )
        .await
    }

    /// Records the event `event_key`: `amount` (not zero) on the counter
    /// `counter_key`. One round trip (one `insert`); see [`Recording`] for
    /// what the caller learns.
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
        self.insert(event, ObjectId::new(), false).await
    }

    /// Sends an unknown recording again — the same insert with the same
    /// token: [`Recording::Recorded`] when it (or the earlier attempt)
    /// landed, [`Recording::Duplicate`] when another recording of the key
    /// did. Safe any number of times, from any process, while the dedupe
    /// window lasts; after it, an event folded and forgotten would be
    /// recorded again.
    pub async fn record_again(&self, ticket: EventTicket) -> Recording {
        self.insert(ticket.event, ticket.token, true).await
    }

    /// Records a batch of events in one round trip (one unordered `insert`
    /// command; one per 100,000 events or 16 MiB of them): one outcome per
    /// event, in the order given. An event key
    /// given twice in one batch is recorded once; the second is a
    /// duplicate (or a conflict).
    pub async fn record_many<K, C>(
        &self,
        events: impl IntoIterator<Item = (K, C, i64)>,
    ) -> Vec<Recording>
    where
        K: Into<String>,
        C: Into<Bson>,
    {
        let events: Vec<(Event, ObjectId)> = events
            .into_iter()
            .map(|(key, counter, amount)| {
                let event = Event {
                    key: key.into(),
                    counter: counter.into(),
                    amount,
                };
                (event, ObjectId::new())
            })
            .collect();
        let mut outcomes: Vec<Option<Recording>> = Vec::with_capacity(events.len());
        let mut sending = Vec::new();
        for (i, (event, _)) in events.iter().enumerate() {
            match check_event(event) {
                Ok(()) => {
                    outcomes.push(None);
                    sending.push(i);
                }
                Err(cause) => outcomes.push(Some(Recording::NotRecorded(NotRecorded {
                    event: event.clone(),
                    cause,
                }))),
            }
        }
        for chunk in commands(&events, sending) {
            for (i, recording) in self.insert_many(&events, chunk).await {
                outcomes[i] = Some(recording);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every event gets an outcome"))
            .collect()
    }

    /// One event's insert, and what its duplicate key says.
    async fn insert(&self, event: Event, token: ObjectId, resumed: bool) -> Recording {
        if let Err(cause) = check_event(&event) {
            return Recording::NotRecorded(NotRecorded { event, cause });
        }
        let document = event_document(&event, token);
        match insert_if_absent(&self.store, &self.events, &document, "ledger.record").await {
            Ok(Inserted::New) => Recording::Recorded(event),
            Ok(Inserted::Existing(stored)) => judge(event, token, &stored),
            Ok(Inserted::Unsure(cause)) => unknown(event, token, cause),
            // Applied on the primary, its replication unconfirmed.
            Err(Error::Server(failure)) if resumed || failure.effect != Effect::NotApplied => {
                unknown(event, token, Error::Server(failure))
            }
            Err(cause) if resumed => unknown(event, token, cause),
            Err(cause) => Recording::NotRecorded(NotRecorded { event, cause }),
        }
    }

    /// Sends `events[sending]` as unordered inserts, retrying once what a
    /// transient failure left unconfirmed; then reads the keys that were
    /// there already.
    async fn insert_many(
        &self,
        events: &[(Event, ObjectId)],
        mut sending: Vec<usize>,
    ) -> Vec<(usize, Recording)> {
        let mut settled = Vec::new();
        let mut maybe_applied = vec![false; events.len()];
        let mut existing = Vec::new();
        let mut budget = RetryBudget::retry_once("ledger.record_many");
        while !sending.is_empty() {
            let documents: Vec<Document> = sending
                .iter()
                .map(|&i| event_document(&events[i].0, events[i].1))
                .collect();
            budget.start_attempt();
            let sent = self
                .store
                .attempt(self.events.insert_many(documents).ordered(false))
                .await;
            let err = match sent {
                Ok(_) => {
                    settled.extend(sending.drain(..).map(|i| (i, recorded(&events[i]))));
                    break;
                }
                Err(err) => err,
            };
            let cause = || Error::Server(Failure::once("ledger.record_many", err.clone()));
            if let ErrorKind::InsertMany(many) = err.kind.as_ref()
                && let Some(errors) = many.write_errors.as_ref().filter(|e| !e.is_empty())
            {
                // The server answered for each event: a write error
                // names the events it did not insert; the others went in
                // (their replication unconfirmed when there is a
                // write-concern error too).
                let mut failed = vec![None; sending.len()];
                for error in errors {
                    if let Some(slot) = failed.get_mut(error.index) {
                        *slot = Some(error.code);
                    }
                }
                let unconfirmed = many.write_concern_error.is_some();
                let mut again = Vec::new();
                for (slot, &i) in failed.into_iter().zip(&sending) {
                    match slot {
                        Some(code) if code::DUPLICATE_KEY_CODES.contains(&code) => existing.push(i),
                        Some(_) if maybe_applied[i] => {
                            settled.push((i, unknown_of(&events[i], cause())))
                        }
                        Some(_) => settled.push((i, not_recorded(&events[i], cause()))),
                        None if unconfirmed => {
                            maybe_applied[i] = true;
                            again.push(i);
                        }
                        None => settled.push((i, recorded(&events[i]))),
                    }
                }
                sending = again;
                if sending.is_empty() {
                    break;
                }
                // Only the unconfirmed remain: a write-concern error.
                match budget.after_failure(err.clone()) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => {
                        let failure = Error::Server(failure);
                        settled.extend(
                            sending
                                .drain(..)
                                .map(|i| (i, unknown_of(&events[i], failure.clone()))),
                        );
                        break;
                    }
                }
            }
            let effect = Facts::of(&err).effect();
            match budget.after_failure(err.clone()) {
                Next::Retry => {
                    if effect != Effect::NotApplied {
                        sending.iter().for_each(|&i| maybe_applied[i] = true);
                    }
                }
                Next::GiveUp(failure) => {
                    let failure = Error::Server(failure);
                    for i in sending.drain(..) {
                        let applied = maybe_applied[i] || effect != Effect::NotApplied;
                        let recording = if applied {
                            unknown_of(&events[i], failure.clone())
                        } else {
                            not_recorded(&events[i], failure.clone())
                        };
                        settled.push((i, recording));
                    }
                }
            }
        }
        if !existing.is_empty() {
            settled.extend(self.judge_existing(events, existing, &maybe_applied).await);
        }
        settled
    }

    /// The events whose keys were there already: each judged against the
    /// stored event (one read for all).
    async fn judge_existing(
        &self,
        events: &[(Event, ObjectId)],
        existing: Vec<usize>,
        maybe_applied: &[bool],
    ) -> Vec<(usize, Recording)> {
        let keys: Vec<&str> = existing.iter().map(|&i| events[i].0.key.as_str()).collect();
        let filter = doc! { "_id": { "$in": keys } };
        let mut budget = RetryBudget::read_once("ledger.read_events");
        let read = self
            .store
            .with_retry(&mut budget, || self.events.find(filter.clone()))
            .await;
        let stored: Result<Vec<Document>, Error> = match read {
            Ok(cursor) => futures::TryStreamExt::try_collect(cursor)
                .await
                .map_err(|err| Error::Server(Failure::once("ledger.read_events", err))),
            Err(failure) => Err(Error::Server(failure)),
        };
        let mut by_key = std::collections::HashMap::new();
        let stored = match stored {
            Ok(stored) => stored,
            Err(cause) => {
                return existing
                    .into_iter()
                    .map(|i| (i, unknown_of(&events[i], cause.clone())))
                    .collect();
            }
        };
        for document in &stored {
            if let Ok(key) = document.get_str("_id") {
                by_key.insert(key.to_owned(), document);
            }
        }
        existing
            .into_iter()
            .map(|i| {
                let (event, token) = &events[i];
                let recording = match by_key.get(&event.key) {
                    Some(stored) => judge(event.clone(), *token, stored),
                    // The duplicate was on another unique index of the
                    // events collection: the server refused this event.
                    None if !maybe_applied[i] => not_recorded(
                        &events[i],
                        Error::InvalidArgument(format!(
                            "event {:?}: a duplicate key on another unique index of the events \
                             collection",
                            event.key
                        )),
                    ),
                    None => unknown_of(
                        &events[i],
                        Error::InvalidArgument(format!(
                            "event {:?}: the insert collided but the event is not there",
                            event.key
                        )),
                    ),
                };
                (i, recording)
            })
            .collect()
    }
}

/// What a key found already recorded says: ours (an attempt whose reply was
/// lost), the same event recorded by someone else, or another event under
/// the same key.
fn judge(event: Event, token: ObjectId, stored: &Document) -> Recording {
    if stored.get_object_id(field::TOKEN).ok() == Some(token) {
        return Recording::Recorded(event);
    }
    let stored_counter = stored.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
    let stored_amount = stored.get(field::AMOUNT).and_then(integer_value);
    if same_key(&stored_counter, &event.counter) && stored_amount == Some(event.amount) {
        Recording::Duplicate(event)
    } else {
        Recording::Conflict(Conflict {
            event,
            stored_counter,
            stored_amount: stored_amount.unwrap_or(0),
        })
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

/// Events per `insert` command: the server's `maxWriteBatchSize`.
const MAX_EVENTS_PER_INSERT: usize = 100_000;
/// Bytes of event documents per `insert` command: a third of the server's
/// 48 MB message limit, so the driver never splits one.
const MAX_BYTES_PER_INSERT: usize = 16 * 1024 * 1024;

/// Splits `sending` into the `insert` commands `record_many` sends, each
/// small enough that the driver sends it whole. A command the driver split
/// itself would fail as a whole — its error naming the last part, the
/// parts before it inserted — and every event of it would be judged by
/// that one error.
fn commands(events: &[(Event, ObjectId)], sending: Vec<usize>) -> Vec<Vec<usize>> {
    let mut commands = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0;
    for i in sending {
        let size = event_document(&events[i].0, events[i].1)
            .to_vec()
            .map_or(MAX_BYTES_PER_INSERT, |v| v.len());
        if !current.is_empty()
            && (current.len() == MAX_EVENTS_PER_INSERT || bytes + size > MAX_BYTES_PER_INSERT)
        {
            commands.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes += size;
    }
    if !current.is_empty() {
        commands.push(current);
    }
    commands
}

/// The event's document as recorded by the recording `token`.
fn event_document(event: &Event, token: ObjectId) -> Document {
    doc! {
        "_id": &event.key,
        field::COUNTER: &event.counter,
        field::AMOUNT: event.amount,
        field::AT: DateTime::now(),
        field::TOKEN: token,
    }
}

fn recorded((event, _): &(Event, ObjectId)) -> Recording {
    Recording::Recorded(event.clone())
}

fn unknown(event: Event, token: ObjectId, cause: Error) -> Recording {
    Recording::Unknown(EventTicket {
        event,
        token,
        cause: Some(cause),
    })
}

fn unknown_of((event, token): &(Event, ObjectId), cause: Error) -> Recording {
    unknown(event.clone(), *token, cause)
}

fn not_recorded((event, _): &(Event, ObjectId), cause: Error) -> Recording {
    Recording::NotRecorded(NotRecorded {
        event: event.clone(),
        cause,
    })
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
    fn a_stored_event_is_ours_by_its_token_a_duplicate_by_content_else_a_conflict() {
        let ours = ObjectId::new();
        let theirs = ObjectId::new();
        let stored = doc! { "_id": "evt_1", "k": "a", "n": 2i64, "r": theirs };
        let mine = doc! { "_id": "evt_1", "k": "a", "n": 2i64, "r": ours };
        assert!(matches!(
            judge(event("a", 2), ours, &mine),
            Recording::Recorded(_)
        ));
        assert!(matches!(
            judge(event("a", 2), ours, &stored),
            Recording::Duplicate(_)
        ));
        let Recording::Conflict(conflict) = judge(event("b", 2), ours, &stored) else {
            panic!("another counter is a conflict");
        };
        let said = conflict.to_string();
        assert!(
            said.contains("on counter a") && said.contains("on counter b"),
            "{said}"
        );
        assert!(matches!(
            judge(event("a", 3), ours, &stored),
            Recording::Conflict(_)
        ));
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
