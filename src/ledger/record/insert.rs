//! Sending one batch of a lane's events: ordered inserts until every event
//! has its outcome, and what a duplicate key says about each.
//!
//! The events go out as one **ordered** `insert`, in number order, so the
//! server inserts them in that order and stops at the first it refuses:
//! what follows a refused event was not inserted and is sent again, with
//! the same numbers, as the next insert. A duplicate key means the event
//! key is there already: the stored event is read and judged — ours (it
//! carries a lane and number this event was sent with), a duplicate (same
//! counter and amount), or a conflict. After a duplicate, the keys of the
//! events that follow are read too (one `find`), so a batch of events
//! recorded before costs two round trips, not one per event.
//!
//! A transient failure sends the same insert once more (the retry rule);
//! an event that may have landed but whose fate is still unknown after that
//! is [`Recording::Unknown`], and its lane is retired: nothing newer may go
//! out on it while an older insert may still land (a lane's events become
//! visible in number order).

use std::collections::HashMap;

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::error::ErrorKind;
use mongodb::options::ReadConcern;
use mongodb::{Collection, Namespace};

use super::outcome::{Conflict, Event, EventTicket, Recording, refused};
use crate::document::integer_value;
use crate::error::{Effect, Error, Facts, Failure, FailureKind, Next, RetryBudget, code};
use crate::ledger::field;
use crate::store::Store;
use crate::write::at::{same_key_any_bucket, split_id};

/// One event of a batch, numbered on its lane.
#[derive(Debug)]
pub(super) struct Item {
    pub(super) event: Event,
    /// The lane and number it is sent with now.
    pub(super) lane: ObjectId,
    pub(super) number: i64,
    /// The lanes and numbers earlier attempts sent it with (a resumed
    /// ticket's).
    pub(super) earlier: Vec<(ObjectId, i64)>,
    pub(super) document: Document,
}

impl Item {
    /// Whether `stored` was inserted by an attempt of this event's.
    fn is_ours(&self, stored: &Document) -> bool {
        let lane = stored.get_object_id(field::LANE).ok();
        let number = stored.get(field::NUMBER).and_then(integer_value);
        let (Some(lane), Some(number)) = (lane, number) else {
            return false;
        };
        (self.lane, self.number) == (lane, number) || self.earlier.contains(&(lane, number))
    }

    fn recorded(&self) -> Recording {
        Recording::Recorded(self.event.clone())
    }

    /// The outcome when this attempt may have landed (`maybe_applied`)
    /// and its fate is still unknown, or when it wrote nothing: unknown, or
    /// refused — which for a resent ticket is unknown still (its earlier
    /// attempts may land).
    fn undecided(&self, maybe_applied: bool, events: &Namespace, cause: Error) -> Recording {
        if maybe_applied {
            self.unknown(events, cause)
        } else {
            refused(self.event.clone(), self.earlier.clone(), events, cause)
        }
    }

    /// Unknown: this attempt may have landed.
    fn unknown(&self, events: &Namespace, cause: Error) -> Recording {
        let mut attempts = self.earlier.clone();
        attempts.push((self.lane, self.number));
        Recording::Unknown(EventTicket::new(
            self.event.clone(),
            events,
            attempts,
            cause,
        ))
    }

    /// Whether `outcome` leaves this attempt's fate unknown: then nothing
    /// newer may go out on its lane.
    fn left_in_doubt(&self, outcome: &Recording) -> bool {
        matches!(outcome, Recording::Unknown(ticket)
            if ticket.attempts.last() == Some(&(self.lane, self.number)))
    }

    /// What the event already stored under this key says.
    pub(super) fn judge(&self, stored: &Document) -> Recording {
        if self.is_ours(stored) {
            return self.recorded();
        }
        judge_other(self.event.clone(), stored)
    }
}

/// What another recording stored under an event's key says: a duplicate
/// (same counter and amount) or a conflict.
pub(super) fn judge_other(event: Event, stored: &Document) -> Recording {
    let stored_counter = stored.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
    let stored_amount = stored.get(field::AMOUNT).and_then(integer_value);
    // The event key is the idempotency key, not its bucket: recorded again
    // with another time it is the same event, counted in the bucket it
    // was recorded for, which its duplicate names.
    if same_key_any_bucket(&stored_counter, &event.counter) && stored_amount == Some(event.amount) {
        let counter = match split_id(&stored_counter) {
            Some(_) => stored_counter,
            None => event.counter,
        };
        Recording::Duplicate(Event { counter, ..event })
    } else {
        Recording::Conflict(Conflict {
            event,
            stored_counter,
            stored_amount: stored_amount.unwrap_or(0),
        })
    }
}

/// What a batch came to: one outcome per item, and whether its lane must be
/// retired (some insert may still land).
pub(super) struct Sent {
    pub(super) outcomes: Vec<Recording>,
    pub(super) retire: bool,
}

/// Sends `items` (in number order) until each has its fate.
pub(super) async fn send(store: &Store, events: &Collection<Document>, items: &[Item]) -> Sent {
    let mut batch = Batch::new(events, items);
    let mut budget = RetryBudget::retry_once("ledger.record");
    while !batch.left.is_empty() {
        budget.start_attempt();
        let err = match store
            .attempt(events.insert_many(batch.documents()).ordered(true))
            .await
        {
            Ok(_) => {
                batch.all_recorded();
                break;
            }
            Err(err) => err,
        };
        let Some(refusal) = Refusal::of(&err).filter(|r| r.at < batch.left.len()) else {
            // No event refused: the whole insert failed, maybe after it
            // wrote some of them.
            let effect = Facts::of(&err).effect();
            match store.after_failure(&mut budget, err) {
                Next::Retry if effect != Effect::NotApplied => batch.maybe_applied_left(),
                Next::Retry => {}
                Next::GiveUp(failure) => {
                    batch.give_up(&Error::Server(failure), effect != Effect::NotApplied);
                }
            }
            continue;
        };
        let cause = Error::Server(Failure::once("ledger.record", err.clone()));
        batch.refused(store, events, &refusal, cause).await;
        if refusal.unconfirmed {
            // The events before the refused one may not be replicated: the
            // same insert once more, under the same budget.
            if let Next::GiveUp(failure) = store.after_failure(&mut budget, err) {
                batch.give_up(&Error::Server(failure), false);
            }
            continue;
        }
        // A refusal is a definite answer: what is left is new work.
        budget = RetryBudget::retry_once("ledger.record");
    }
    batch.finish()
}

/// Where an ordered insert stopped: the first event the server refused.
struct Refusal {
    /// Its index among the events sent.
    at: usize,
    /// The server's code for it.
    code: i32,
    /// Whether a write-concern error came too: the events before it were
    /// inserted, their replication unconfirmed.
    unconfirmed: bool,
}

impl Refusal {
    fn of(err: &mongodb::error::Error) -> Option<Self> {
        let ErrorKind::InsertMany(many) = err.kind.as_ref() else {
            return None;
        };
        let first = many.write_errors.as_ref()?.iter().min_by_key(|e| e.index)?;
        Some(Self {
            at: first.index,
            code: first.code,
            unconfirmed: many.write_concern_error.is_some(),
        })
    }
}

/// A batch on its way: each event's outcome once known, whether an attempt
/// may have written it, and the events still to send (in number order).
struct Batch<'a> {
    items: &'a [Item],
    ns: Namespace,
    outcomes: Vec<Option<Recording>>,
    maybe_applied: Vec<bool>,
    left: Vec<usize>,
}

impl<'a> Batch<'a> {
    fn new(events: &Collection<Document>, items: &'a [Item]) -> Self {
        Self {
            items,
            ns: events.namespace(),
            outcomes: items.iter().map(|_| None).collect(),
            maybe_applied: vec![false; items.len()],
            left: (0..items.len()).collect(),
        }
    }

    /// The documents of the events left, in order.
    fn documents(&self) -> Vec<Document> {
        self.left
            .iter()
            .map(|&i| self.items[i].document.clone())
            .collect()
    }

    /// The insert of every event left landed.
    fn all_recorded(&mut self) {
        for &i in &self.left {
            self.outcomes[i] = Some(self.items[i].recorded());
        }
        self.left.clear();
    }

    /// Every event left may have been written by an attempt.
    fn maybe_applied_left(&mut self) {
        for &i in &self.left {
            self.maybe_applied[i] = true;
        }
    }

    /// No more attempts: every event left is unknown (if an attempt may
    /// have written it, or `maybe` says the last one may have) or refused.
    fn give_up(&mut self, failure: &Error, maybe: bool) {
        for i in std::mem::take(&mut self.left) {
            let maybe = self.maybe_applied[i] || maybe;
            self.outcomes[i] = Some(self.items[i].undecided(maybe, &self.ns, failure.clone()));
        }
    }

    /// An ordered insert stopped at `refusal`: the server inserted the
    /// events before it (their replication unconfirmed when a write-concern
    /// error came too), refused the one at it, and never tried the rest,
    /// which are left to send (with the unconfirmed ones, sent again).
    async fn refused(
        &mut self,
        store: &Store,
        events: &Collection<Document>,
        refusal: &Refusal,
        cause: Error,
    ) {
        let inserted: Vec<usize> = self.left[..refusal.at].to_vec();
        let stopped = self.left[refusal.at];
        let rest: Vec<usize> = self.left[refusal.at + 1..].to_vec();
        if refusal.unconfirmed {
            inserted.iter().for_each(|&i| self.maybe_applied[i] = true);
        } else {
            self.confirm_inserted(store, events, &inserted).await;
        }
        self.left = if refusal.unconfirmed {
            inserted
        } else {
            Vec::new()
        };
        if code::DUPLICATE_KEY_CODES.contains(&refusal.code) {
            let mut candidates = vec![stopped];
            candidates.extend(&rest);
            self.judge_duplicate(store, events, stopped, &candidates, cause)
                .await;
        } else {
            // A write error that says nothing was written (a validator, a
            // document too large) is a refusal; one that may follow a write
            // — a router reporting a shard's lost connection or step-down
            // as the write error of the op it was sending — leaves the
            // event unknown: its ticket settles it.
            let stopped_write = Facts {
                kind: FailureKind::Write(refusal.code),
                retryable_label: false,
            };
            if stopped_write.effect() != Effect::NotApplied {
                self.maybe_applied[stopped] = true;
            }
            let item = &self.items[stopped];
            self.outcomes[stopped] =
                Some(item.undecided(self.maybe_applied[stopped], &self.ns, cause));
        }
        let outcomes = &self.outcomes;
        self.left
            .extend(rest.into_iter().filter(|&i| outcomes[i].is_none()));
    }

    /// A router (mongos) reports an ordered write's write error and drops
    /// its write-concern error: the events before the refused one are
    /// recorded only once a majority read finds them as ours; the others
    /// are unknown.
    async fn confirm_inserted(
        &mut self,
        store: &Store,
        events: &Collection<Document>,
        inserted: &[usize],
    ) {
        let confirmed = confirm(store, events, self.items, inserted).await;
        for &i in inserted {
            let item = &self.items[i];
            self.outcomes[i] = Some(match &confirmed {
                Ok(found) if found.contains(&i) => item.recorded(),
                Ok(_) => item.unknown(&self.ns, unconfirmed_error(events, inserted.len())),
                Err(read) => item.unknown(&self.ns, read.clone()),
            });
        }
    }

    /// The event at `stopped` met a duplicate key: it and `candidates`
    /// (the events after it) are judged by what their keys hold.
    async fn judge_duplicate(
        &mut self,
        store: &Store,
        events: &Collection<Document>,
        stopped: usize,
        candidates: &[usize],
        cause: Error,
    ) {
        let judged =
            judge_existing(store, events, self.items, candidates, &mut self.outcomes).await;
        if let Err(read) = judged {
            // The key is there, but whose it is cannot be told.
            self.outcomes[stopped] = Some(self.items[stopped].unknown(&self.ns, read));
        }
        if self.outcomes[stopped].is_none() {
            // Not found by a majority read: the key is there on the primary
            // only (an attempt of ours or another's, not replicated yet: it
            // may be rolled back), or another unique index of the events
            // collection refused it. Unknown: the ticket settles it.
            self.outcomes[stopped] = Some(self.items[stopped].unknown(&self.ns, cause));
        }
    }

    /// Each event's outcome, and whether the lane must be retired.
    fn finish(self) -> Sent {
        let retire = self
            .items
            .iter()
            .zip(&self.outcomes)
            .any(|(item, outcome)| outcome.as_ref().is_some_and(|o| item.left_in_doubt(o)));
        let ns = &self.ns;
        let outcomes = self
            .outcomes
            .into_iter()
            .zip(self.items)
            .zip(self.maybe_applied)
            .map(|((outcome, item), maybe_applied)| {
                // The loop leaves each event its outcome; one without (never
                // seen) says no more than that it may have landed.
                outcome.unwrap_or_else(|| item.undecided(maybe_applied, ns, Error::RecorderStopped))
            })
            .collect();
        Sent { outcomes, retire }
    }
}

/// Which of `inserted` a majority read finds stored as ours.
async fn confirm(
    store: &Store,
    events: &Collection<Document>,
    items: &[Item],
    inserted: &[usize],
) -> Result<Vec<usize>, Error> {
    if inserted.is_empty() {
        return Ok(Vec::new());
    }
    let stored = read_stored(store, events, items, inserted, "ledger.confirm_events").await?;
    Ok(inserted
        .iter()
        .copied()
        .filter(|&i| {
            stored
                .get(items[i].event.key.as_str())
                .is_some_and(|stored| items[i].is_ours(stored))
        })
        .collect())
}

/// Why an event inserted before a refused one is unknown: a majority read
/// did not find it.
fn unconfirmed_error(events: &Collection<Document>, inserted: usize) -> Error {
    Error::MajorityUnconfirmed {
        collection: events.name().to_owned(),
        writes: inserted as u64,
    }
}

/// Judges each of `candidates` whose key holds an event (read at majority:
/// only what a failover cannot roll back judges an event recorded, a
/// duplicate or a conflict); the others are left without an outcome (not
/// there: to be sent).
async fn judge_existing(
    store: &Store,
    events: &Collection<Document>,
    items: &[Item],
    candidates: &[usize],
    outcomes: &mut [Option<Recording>],
) -> Result<(), Error> {
    let stored = read_stored(store, events, items, candidates, "ledger.read_events").await?;
    for &i in candidates {
        if let Some(stored) = stored.get(items[i].event.key.as_str()) {
            outcomes[i] = Some(items[i].judge(stored));
        }
    }
    Ok(())
}

/// The events stored under the keys of `items` at `indices`, by key: one
/// `find` at read concern `majority`.
async fn read_stored(
    store: &Store,
    events: &Collection<Document>,
    items: &[Item],
    indices: &[usize],
    operation: &'static str,
) -> Result<HashMap<String, Document>, Error> {
    let keys: Vec<&str> = indices
        .iter()
        .map(|&i| items[i].event.key.as_str())
        .collect();
    let filter = doc! { "_id": { "$in": keys } };
    let projection = doc! { field::COUNTER: 1, field::AMOUNT: 1, field::LANE: 1, field::NUMBER: 1 };
    let mut budget = RetryBudget::read_once(operation);
    let cursor = store
        .with_retry(&mut budget, || {
            events
                .find(filter.clone())
                .projection(projection.clone())
                .read_concern(ReadConcern::majority())
        })
        .await
        .map_err(Error::Server)?;
    let stored: Vec<Document> = cursor
        .try_collect()
        .await
        .map_err(|err| Error::Server(Failure::once(operation, err)))?;
    Ok(stored
        .into_iter()
        .filter_map(|d| Some((d.get_str("_id").ok()?.to_owned(), d)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(counter: &str, amount: i64, lane: ObjectId, number: i64) -> Item {
        Item {
            event: Event {
                key: "evt_1".into(),
                counter: counter.into(),
                amount,
            },
            lane,
            number,
            earlier: Vec::new(),
            document: Document::new(),
        }
    }

    #[test]
    fn a_stored_event_is_ours_by_a_lane_and_number_it_was_sent_with() {
        let (ours, theirs) = (ObjectId::new(), ObjectId::new());
        let stored = |lane: ObjectId, s: i64| doc! { "_id": "evt_1", "k": "a", "n": 2i64, "L": lane, "s": s };
        let mine = item("a", 2, ours, 7);
        assert!(matches!(
            mine.judge(&stored(ours, 7)),
            Recording::Recorded(_)
        ));
        assert!(matches!(
            mine.judge(&stored(ours, 6)),
            Recording::Duplicate(_)
        ));
        assert!(matches!(
            mine.judge(&stored(theirs, 7)),
            Recording::Duplicate(_)
        ));
        let resumed = Item {
            earlier: vec![(theirs, 3)],
            ..item("a", 2, ours, 9)
        };
        assert!(matches!(
            resumed.judge(&stored(theirs, 3)),
            Recording::Recorded(_)
        ));
        let Recording::Conflict(conflict) = item("b", 2, ours, 1).judge(&stored(theirs, 1)) else {
            panic!("another counter is a conflict");
        };
        let said = conflict.to_string();
        assert!(
            said.contains("on counter a") && said.contains("on counter b"),
            "{said}"
        );
        assert!(matches!(
            item("a", 3, ours, 1).judge(&stored(theirs, 1)),
            Recording::Conflict(_)
        ));
    }

    #[test]
    fn an_event_recorded_again_in_another_bucket_is_a_duplicate_counted_in_the_first() {
        use mongodb::bson::DateTime;
        let bucket =
            |key: &str, ms: i64| Bson::from(doc! { "k": key, "t": DateTime::from_millis(ms) });
        let (first, later) = (bucket("a", 86_400_000), bucket("a", 2 * 86_400_000));
        let stored =
            doc! { "_id": "evt_1", "k": first.clone(), "n": 2i64, "L": ObjectId::new(), "s": 1i64 };
        let again = Event {
            counter: later,
            ..item("a", 2, ObjectId::new(), 5).event
        };
        let Recording::Duplicate(event) = judge_other(again.clone(), &stored) else {
            panic!("the same event in another bucket is a duplicate");
        };
        assert_eq!(
            event.counter(),
            &first,
            "named by the bucket it was counted in"
        );
        let other_key = Event {
            counter: bucket("b", 86_400_000),
            ..again.clone()
        };
        assert!(matches!(
            judge_other(other_key, &stored),
            Recording::Conflict(_)
        ));
        let other_amount = Event { amount: 3, ..again };
        assert!(matches!(
            judge_other(other_amount, &stored),
            Recording::Conflict(_)
        ));
    }

    #[test]
    fn an_unknown_ticket_keeps_every_attempt_first_one_first() {
        let (first, now) = (ObjectId::new(), ObjectId::new());
        let resumed = Item {
            earlier: vec![(first, 3)],
            ..item("a", 1, now, 9)
        };
        let events = namespace();
        let unknown = resumed.unknown(&events, Error::InvalidArgument("x".into()));
        assert!(resumed.left_in_doubt(&unknown));
        let Recording::Unknown(ticket) = unknown else {
            panic!("unknown");
        };
        assert_eq!((ticket.lane(), ticket.number()), (first, 3));
        assert_eq!(ticket.attempts, vec![(first, 3), (now, 9)]);
        assert_eq!(ticket.events_collection(), &events);
    }

    fn namespace() -> Namespace {
        Namespace {
            db: "app".into(),
            coll: "views_events".into(),
        }
    }

    #[test]
    fn a_refused_resend_stays_unknown_and_a_refused_first_attempt_is_not_recorded() {
        let (first, now) = (ObjectId::new(), ObjectId::new());
        let cause = || Error::InvalidArgument("refused".into());
        let events = namespace();
        let fresh = item("a", 1, now, 9);
        assert!(matches!(
            fresh.undecided(false, &events, cause()),
            Recording::NotRecorded(_)
        ));
        let resumed = Item {
            earlier: vec![(first, 3)],
            ..item("a", 1, now, 9)
        };
        let outcome = resumed.undecided(false, &events, cause());
        assert!(
            !resumed.left_in_doubt(&outcome),
            "nothing of this attempt can land: its lane goes on"
        );
        let Recording::Unknown(ticket) = outcome else {
            panic!("a resend says no more than unknown: {outcome:?}");
        };
        assert_eq!(ticket.attempts, vec![(first, 3)]);
    }
}
