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
    let namespace = events.namespace();
    let ns = &namespace;
    let mut outcomes: Vec<Option<Recording>> = items.iter().map(|_| None).collect();
    let mut maybe_applied = vec![false; items.len()];
    let mut left: Vec<usize> = (0..items.len()).collect();
    let mut budget = RetryBudget::retry_once("ledger.record");
    while !left.is_empty() {
        let documents: Vec<Document> = left.iter().map(|&i| items[i].document.clone()).collect();
        budget.start_attempt();
        let err = match store
            .attempt(events.insert_many(documents).ordered(true))
            .await
        {
            Ok(_) => {
                for &i in &left {
                    outcomes[i] = Some(items[i].recorded());
                }
                break;
            }
            Err(err) => err,
        };
        let cause = || Error::Server(Failure::once("ledger.record", err.clone()));
        let refused = match err.kind.as_ref() {
            ErrorKind::InsertMany(many) => many
                .write_errors
                .as_ref()
                .and_then(|errors| errors.iter().min_by_key(|e| e.index))
                .map(|e| (e.index, e.code, many.write_concern_error.is_some())),
            _ => None,
        };
        if let Some((at, refused_code, unconfirmed)) = refused.filter(|(at, ..)| *at < left.len()) {
            // The server inserted the events before `at` (their replication
            // unconfirmed when a write-concern error came too), refused the
            // one at `at`, and never tried the rest.
            let inserted: Vec<usize> = left[..at].to_vec();
            let stopped = left[at];
            let rest: Vec<usize> = left[at + 1..].to_vec();
            if unconfirmed {
                inserted.iter().for_each(|&i| maybe_applied[i] = true);
            } else {
                // A router (mongos) reports an ordered write's write error
                // and drops its write-concern error: the events before the
                // refused one are recorded only once a majority read finds
                // them as ours; the others are unknown.
                let confirmed = confirm(store, events, items, &inserted).await;
                for &i in &inserted {
                    outcomes[i] = Some(match &confirmed {
                        Ok(found) if found.contains(&i) => items[i].recorded(),
                        Ok(_) => items[i].unknown(ns, unconfirmed_error(events, inserted.len())),
                        Err(read) => items[i].unknown(ns, read.clone()),
                    });
                }
            }
            left = if unconfirmed { inserted } else { Vec::new() };
            if code::DUPLICATE_KEY_CODES.contains(&refused_code) {
                let mut candidates = vec![stopped];
                candidates.extend(&rest);
                let unread = judge_existing(store, events, items, &candidates, &mut outcomes).await;
                match unread {
                    Ok(()) => {}
                    Err(read) => {
                        // The key is there, but whose it is cannot be told.
                        outcomes[stopped] = Some(items[stopped].unknown(ns, read));
                    }
                }
                if outcomes[stopped].is_none() {
                    // Not found by a majority read: the key is there on the
                    // primary only (an attempt of ours or another's, not
                    // replicated yet: it may be rolled back), or another
                    // unique index of the events collection refused it.
                    // Unknown: the ticket settles it.
                    outcomes[stopped] = Some(items[stopped].unknown(ns, cause()));
                }
            } else {
                // A write error that says nothing was written (a validator,
                // a document too large) is a refusal; one that may follow a
                // write — a router reporting a shard's lost connection or
                // step-down as the write error of the op it was sending —
                // leaves the event unknown: its ticket settles it.
                let stopped_write = Facts {
                    kind: FailureKind::Write(refused_code),
                    retryable_label: false,
                };
                if stopped_write.effect() != Effect::NotApplied {
                    maybe_applied[stopped] = true;
                }
                outcomes[stopped] =
                    Some(items[stopped].undecided(maybe_applied[stopped], ns, cause()));
            }
            left.extend(rest.into_iter().filter(|&i| outcomes[i].is_none()));
            if unconfirmed {
                match store.after_failure(&mut budget, err.clone()) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => {
                        let failure = Error::Server(failure);
                        for i in left.drain(..) {
                            outcomes[i] =
                                Some(items[i].undecided(maybe_applied[i], ns, failure.clone()));
                        }
                        break;
                    }
                }
            }
            // A refusal is a definite answer: what is left is new work.
            budget = RetryBudget::retry_once("ledger.record");
            continue;
        }
        let effect = Facts::of(&err).effect();
        match store.after_failure(&mut budget, err.clone()) {
            Next::Retry => {
                if effect != Effect::NotApplied {
                    left.iter().for_each(|&i| maybe_applied[i] = true);
                }
            }
            Next::GiveUp(failure) => {
                let failure = Error::Server(failure);
                for i in left.drain(..) {
                    let maybe = maybe_applied[i] || effect != Effect::NotApplied;
                    outcomes[i] = Some(items[i].undecided(maybe, ns, failure.clone()));
                }
            }
        }
    }
    let retire = items
        .iter()
        .zip(&outcomes)
        .any(|(item, outcome)| outcome.as_ref().is_some_and(|o| item.left_in_doubt(o)));
    let outcomes = outcomes
        .into_iter()
        .zip(items)
        .zip(maybe_applied)
        .map(|((outcome, item), maybe_applied)| {
            // The loop above leaves each event its outcome; one without
            // (never seen) says no more than that it may have landed.
            outcome.unwrap_or_else(|| item.undecided(maybe_applied, ns, Error::RecorderStopped))
        })
        .collect();
    Sent { outcomes, retire }
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
