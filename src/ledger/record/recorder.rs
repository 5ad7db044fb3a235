//! The recorder behind a [`Ledger`](crate::ledger::Ledger) handle: its lane, and
//! the group commit that keeps one insert in flight on it.
//!
//! **The lane and its numbers.** A handle records through one lane `L`, an
//! ObjectId minted when it first records. Numbers are **the server's
//! time**: minting a lane reads the server's clock (`hello`'s `localTime`)
//! once, and each event gets `s = max(last + 1, that time + the time
//! elapsed since, by this host's monotonic clock)` in microseconds — never
//! this host's wall clock, which may be minutes off. Numbers only grow, and
//! an event's number dates it on the server's clock. A lane is used for at
//! most [`LANE_SPAN`] (the monotonic clock's drift stays negligible), and
//! is retired at once after an insert whose outcome is unknown; the next
//! event mints a fresh one.
//! The numbers date the events (the sweep deletes by them, `tallyd
//! fold-from` chooses by them); the fold itself follows the log's order,
//! whatever the numbers.
//!
//! **One insert in flight.** Events recorded while an insert is in flight
//! wait, and go out together — in the order they were recorded, numbered
//! in that order — as the next ordered insert (group commit). A spawned
//! task sends, not any caller: a caller that stops waiting never strands
//! the others, and its event, once taken into an insert, meets that
//! insert's fate (before that, it is dropped unsent).
//!
//! This queue is written for the recorder alone (a single key, one lane);
//! the lanes protocol's keyed group commit is a separate piece.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Document, doc, oid::ObjectId};
use tokio::sync::oneshot;

use super::event_document;
use super::insert::{self, Item};
use super::outcome::{Event, Recording, refused};
use crate::error::Error;
use crate::store::Store;

/// How long a recorder numbers on one lane from one reading of the
/// server's clock: after it the next event mints a fresh lane, and reads
/// the clock again.
pub(crate) const LANE_SPAN: Duration = Duration::from_secs(3600);

/// Events per `insert` command: the server's `maxWriteBatchSize`, which
/// the driver would otherwise split at (a split command fails as a whole).
const MAX_EVENTS_PER_INSERT: usize = 100_000;
/// Bytes of events per `insert` command: a third of the server's 48 MB
/// message limit, so the driver never splits one.
const MAX_BYTES_PER_INSERT: usize = 16 * 1024 * 1024;

/// The recorder: its lane and the events waiting for the next insert.
pub(in crate::ledger) struct Recorder {
    store: Store,
    events: Collection<Document>,
    queue: Mutex<Queue>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("events", &self.events.name())
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Queue {
    lane: Option<Lane>,
    waiting: VecDeque<Waiting>,
    /// A sender task is running.
    sending: bool,
}

/// The current lane and its last number.
#[derive(Debug, Clone, Copy)]
struct Lane {
    id: ObjectId,
    last: i64,
    /// The server's clock when it was minted, in microseconds.
    anchor: i64,
    minted: Instant,
}

impl Lane {
    /// The server's time now, as this lane reckons it (microseconds).
    fn now(&self) -> i64 {
        let elapsed = i64::try_from(self.minted.elapsed().as_micros()).unwrap_or(i64::MAX);
        self.anchor.saturating_add(elapsed)
    }
}

/// One event waiting to be sent.
struct Waiting {
    event: Event,
    earlier: Vec<(ObjectId, i64)>,
    bytes: usize,
    reply: oneshot::Sender<Recording>,
}

impl Recorder {
    pub(in crate::ledger) fn new(store: &Store, events: &str) -> Self {
        Self {
            store: store.clone(),
            events: store.collection(events),
            queue: Mutex::default(),
        }
    }

    /// Queues `events` (each with the lanes and numbers earlier attempts
    /// sent it with) for the next inserts, in this order, and returns where
    /// each one's outcome will arrive.
    pub(in crate::ledger) fn submit(
        self: &Arc<Self>,
        events: Vec<(Event, Vec<(ObjectId, i64)>)>,
    ) -> Vec<oneshot::Receiver<Recording>> {
        let mut receivers = Vec::with_capacity(events.len());
        let mut queue = self.lock();
        for (event, earlier) in events {
            let (reply, receiver) = oneshot::channel();
            let bytes = event.key.len()
                + doc! { "k": &event.counter }
                    .to_vec()
                    .map_or(MAX_BYTES_PER_INSERT, |v| v.len())
                + 96;
            queue.waiting.push_back(Waiting {
                event,
                earlier,
                bytes,
                reply,
            });
            receivers.push(receiver);
        }
        if !queue.sending && !queue.waiting.is_empty() {
            queue.sending = true;
            tokio::spawn(Arc::clone(self).send_all());
        }
        receivers
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends what waits, one insert at a time, until nothing waits.
    async fn send_all(self: Arc<Self>) {
        loop {
            let (batch, lane) = {
                let mut queue = self.lock();
                let batch = take_batch(&mut queue.waiting);
                if batch.is_empty() {
                    queue.sending = false;
                    return;
                }
                (batch, queue.lane)
            };
            let lane = match lane.filter(|l| l.minted.elapsed() < LANE_SPAN) {
                Some(lane) => lane,
                None => match self.mint().await {
                    Ok(lane) => lane,
                    Err(cause) => {
                        self.refuse(batch, &cause);
                        continue;
                    }
                },
            };
            let (items, waiting, last) = number(batch, lane);
            self.lock().lane = Some(Lane { last, ..lane });
            let sent = insert::send(&self.store, &self.events, &items).await;
            if sent.retire {
                let mut queue = self.lock();
                if queue.lane.is_some_and(|l| l.id == lane.id) {
                    queue.lane = None;
                }
            }
            for (waiting, outcome) in waiting.into_iter().zip(sent.outcomes) {
                let _ = waiting.reply.send(outcome);
            }
        }
    }

    /// Answers each of `batch` that nothing of this attempt was written:
    /// not recorded, or unknown when an earlier attempt may have landed.
    fn refuse(&self, batch: Vec<Waiting>, cause: &Error) {
        let events = self.events.namespace();
        for waiting in batch {
            let outcome = refused(waiting.event, waiting.earlier, &events, cause.clone());
            let _ = waiting.reply.send(outcome);
        }
    }

    /// A fresh lane, numbered from the server's clock.
    async fn mint(&self) -> Result<Lane, Error> {
        let server = self.store.server_time().await?;
        Ok(Lane {
            id: ObjectId::new(),
            last: 0,
            anchor: unix_micros(server),
            // The reply's time was read on the server at some moment
            // before this: reckoned from here, numbers never run ahead of
            // the server's clock (they lag it by at most the round trip),
            // so an event acknowledged before a pass began is numbered
            // before it.
            minted: Instant::now(),
        })
    }
}

/// The next insert's events: every waiting one whose caller still waits,
/// in order, up to what one command carries.
fn take_batch(waiting: &mut VecDeque<Waiting>) -> Vec<Waiting> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while let Some(next) = waiting.front() {
        if next.reply.is_closed() {
            waiting.pop_front();
            continue;
        }
        if !batch.is_empty()
            && (batch.len() == MAX_EVENTS_PER_INSERT || bytes + next.bytes > MAX_BYTES_PER_INSERT)
        {
            break;
        }
        bytes += next.bytes;
        batch.extend(waiting.pop_front());
    }
    batch
}

/// Numbers the batch's events on `lane`, in order; returns the items to
/// send, the waiting events they came from, and the lane's last number.
fn number(batch: Vec<Waiting>, lane: Lane) -> (Vec<Item>, Vec<Waiting>, i64) {
    let now = lane.now();
    let mut last = lane.last;
    let mut items = Vec::with_capacity(batch.len());
    for waiting in &batch {
        let number = (last + 1).max(now);
        last = number;
        items.push(Item {
            document: event_document(&waiting.event, lane.id, number),
            event: waiting.event.clone(),
            lane: lane.id,
            number,
            earlier: waiting.earlier.clone(),
        });
    }
    (items, batch, last)
}

/// Microseconds since the epoch.
pub(crate) fn unix_micros(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The time a lane number stands for (microseconds since the epoch).
pub(crate) fn time_of(number: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(u64::try_from(number).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(key: &str) -> (Waiting, oneshot::Receiver<Recording>) {
        let (reply, receiver) = oneshot::channel();
        let waiting = Waiting {
            event: Event {
                key: key.into(),
                counter: "a".into(),
                amount: 1,
            },
            earlier: Vec::new(),
            bytes: 100,
            reply,
        };
        (waiting, receiver)
    }

    #[test]
    fn numbers_grow_in_the_order_events_were_recorded_and_date_them() {
        // The server's clock an hour behind this host's: numbers follow
        // the server's.
        let server = unix_micros(SystemTime::now()) - 3_600_000_000;
        let lane = Lane {
            id: ObjectId::new(),
            last: server + 1_000_000,
            anchor: server,
            minted: Instant::now(),
        };
        let batch: Vec<Waiting> = (0..3).map(|i| waiting(&format!("e{i}")).0).collect();
        let (items, _, last) = number(batch, lane);
        let numbers: Vec<i64> = items.iter().map(|i| i.number).collect();
        assert_eq!(numbers, vec![lane.last + 1, lane.last + 2, lane.last + 3]);
        assert_eq!(last, lane.last + 3);
        let fresh = Lane { last: 0, ..lane };
        let (items, _, _) = number(vec![waiting("x").0], fresh);
        let behind = SystemTime::now()
            .duration_since(time_of(items[0].number))
            .unwrap();
        assert!(
            behind >= Duration::from_secs(3595) && behind < Duration::from_secs(3605),
            "a number dates its event on the server's clock, not this host's: {behind:?}"
        );
    }

    #[test]
    fn a_batch_skips_callers_that_stopped_waiting_and_keeps_the_order() {
        let mut queue = VecDeque::new();
        let (first, _keep_first) = waiting("e1");
        let (gone, dropped) = waiting("e2");
        let (third, _keep_third) = waiting("e3");
        drop(dropped);
        queue.extend([first, gone, third]);
        let batch = take_batch(&mut queue);
        let keys: Vec<&str> = batch.iter().map(|w| w.event.key.as_str()).collect();
        assert_eq!(keys, vec!["e1", "e3"]);
        assert!(queue.is_empty());
    }
}
