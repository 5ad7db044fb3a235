//! The recorder behind a [`Ledger`](super::Ledger) handle: its lane, and
//! the group commit that keeps one insert in flight on it.
//!
//! **The lane.** A handle records through one lane `L`, an ObjectId minted
//! when it first records. Each event gets the lane's next number `s =
//! max(last + 1, microseconds since the epoch now)`: numbers only grow, and
//! an event's number also dates it. Before its first insert a fresh lane is
//! registered in the fold's state collection (`{_id: L, at: <the server's
//! clock>}`), so the fold knows to look at it. A lane is used for at most
//! [`LANE_SPAN`] from before its registration, and is retired at once after
//! an insert whose outcome is unknown; the next event mints a fresh one.
//!
//! **One insert in flight.** Events recorded while an insert is in flight
//! wait, and go out together — in the order they were recorded, numbered
//! in that order — as the next ordered insert (group commit). A spawned
//! task sends, not any caller: a caller that stops waiting never strands
//! the others, and its event, once taken into an insert, meets that
//! insert's fate (before that, it is dropped unsent). So a lane's inserts
//! reach the server one after the other, in number order, and none is sent
//! after one whose fate is unknown: every event numbered below the highest
//! one the fold sees on a lane is visible to it.
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

/// How long a recorder uses one lane, from before its registration: after
/// it the next event mints a fresh lane. The fold seals a registered lane
/// (stops looking at it) once no insert on it can land any more.
pub(crate) const LANE_SPAN: Duration = Duration::from_secs(3600);

/// How long after [`LANE_SPAN`] a batch already under way may still send
/// on its lane (its resends after a refusal, and their retries); none
/// starts later.
pub(crate) const LANE_GRACE: Duration = Duration::from_secs(300);

/// Events per `insert` command: the server's `maxWriteBatchSize`, which
/// the driver would otherwise split at (a split command fails as a whole).
const MAX_EVENTS_PER_INSERT: usize = 100_000;
/// Bytes of events per `insert` command: a third of the server's 48 MB
/// message limit, so the driver never splits one.
const MAX_BYTES_PER_INSERT: usize = 16 * 1024 * 1024;

/// The recorder: its lane and the events waiting for the next insert.
pub(super) struct Recorder {
    store: Store,
    events: Collection<Document>,
    registry: Collection<Document>,
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
    minted: Instant,
}

/// One event waiting to be sent.
struct Waiting {
    event: Event,
    earlier: Vec<(ObjectId, i64)>,
    bytes: usize,
    reply: oneshot::Sender<Recording>,
}

impl Recorder {
    pub(super) fn new(store: &Store, events: &str, registry: &str) -> Self {
        Self {
            store: store.clone(),
            events: store.collection(events),
            registry: store.collection(registry),
            queue: Mutex::default(),
        }
    }

    /// Queues `events` (each with the lanes and numbers earlier attempts
    /// sent it with) for the next inserts, in this order, and returns where
    /// each one's outcome will arrive.
    pub(super) fn submit(
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
                        let events = self.events.namespace();
                        for waiting in batch {
                            let outcome =
                                refused(waiting.event, waiting.earlier, &events, cause.clone());
                            let _ = waiting.reply.send(outcome);
                        }
                        continue;
                    }
                },
            };
            let (items, replies, last) = number(batch, lane);
            self.lock().lane = Some(Lane { last, ..lane });
            let send_by = lane.minted + LANE_SPAN + LANE_GRACE;
            let sent = insert::send(&self.store, &self.events, &items, send_by).await;
            if sent.retire {
                let mut queue = self.lock();
                if queue.lane.is_some_and(|l| l.id == lane.id) {
                    queue.lane = None;
                }
            }
            for (reply, outcome) in replies.into_iter().zip(sent.outcomes) {
                let _ = reply.send(outcome);
            }
        }
    }

    /// A fresh lane, registered for the fold.
    async fn mint(&self) -> Result<Lane, Error> {
        let minted = Instant::now();
        let id = ObjectId::new();
        super::state::register(&self.store, &self.registry, id).await?;
        Ok(Lane {
            id,
            last: 0,
            minted,
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
/// send, where their outcomes go, and the lane's last number.
fn number(batch: Vec<Waiting>, lane: Lane) -> (Vec<Item>, Vec<oneshot::Sender<Recording>>, i64) {
    let now = unix_micros(SystemTime::now());
    let mut last = lane.last;
    let mut items = Vec::with_capacity(batch.len());
    let mut replies = Vec::with_capacity(batch.len());
    for waiting in batch {
        let number = (last + 1).max(now);
        last = number;
        items.push(Item {
            document: event_document(&waiting.event, lane.id, number),
            event: waiting.event,
            lane: lane.id,
            number,
            earlier: waiting.earlier,
        });
        replies.push(waiting.reply);
    }
    (items, replies, last)
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
        let lane = Lane {
            id: ObjectId::new(),
            last: unix_micros(SystemTime::now()) + 1_000_000,
            minted: Instant::now(),
        };
        let batch: Vec<Waiting> = (0..3).map(|i| waiting(&format!("e{i}")).0).collect();
        let (items, _, last) = number(batch, lane);
        let numbers: Vec<i64> = items.iter().map(|i| i.number).collect();
        assert_eq!(numbers, vec![lane.last + 1, lane.last + 2, lane.last + 3]);
        assert_eq!(last, lane.last + 3);
        let fresh = Lane { last: 0, ..lane };
        let (items, _, _) = number(vec![waiting("x").0], fresh);
        let age = SystemTime::now()
            .duration_since(time_of(items[0].number))
            .unwrap();
        assert!(age < Duration::from_secs(5), "a number dates its event");
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
