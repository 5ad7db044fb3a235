//! Group commit, generically: a keyed single-flight batcher.
//!
//! Callers queue items under a key; per key at most one batch is in flight,
//! and the items that arrive meanwhile wait and leave together as the next
//! batch. The lanes protocol queues increments under their counter's key
//! (one update in flight per lane and counter, the waiting increments
//! summed into the next); a recorder can queue inserts under one key.
//!
//! - **One sender per busy key.** The caller whose item finds its key idle
//!   is told to start a sender ([`Queued::start_sender`]); the sender takes
//!   batches ([`Batcher::next`]) until the key's queue is empty, then the
//!   key is forgotten. The sender should not be any one caller's future: a
//!   caller that gives up must not strand the others.
//! - **Bounded.** A batch holds at most `max_group` items; at most
//!   `queue_limit` items wait across all keys, and a caller beyond that
//!   waits for room ([`Batcher::queue`]): backpressure, not memory.
//! - **Linger.** With `linger` above zero, a batch smaller than `max_group`
//!   leaves only once its oldest item waited that long.
//! - **A caller that gives up** before its item left takes it back
//!   ([`Batcher::withdraw`]); once the item left, its fate is its batch's.
//!
//! The bookkeeping ([`Groups`]) takes "now" as a parameter and never waits,
//! so its rules are tested with a fake clock; [`Batcher`] adds the waiting
//! for room.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How large batches and queues may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupLimits {
    /// The most items in one batch (at least 1).
    pub(crate) max_group: usize,
    /// The most items waiting across every key (at least 1).
    pub(crate) queue_limit: usize,
    /// How long a batch smaller than `max_group` waits for more items,
    /// from its oldest item's arrival.
    pub(crate) linger: Duration,
}

/// An item's place in its key's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Queued {
    /// The item's id, for [`Groups::withdraw`].
    pub(crate) id: u64,
    /// The key had no sender: the caller must start one.
    pub(crate) start_sender: bool,
}

/// What a key's sender does next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next<I> {
    /// Send these items, oldest first, as one batch; then call
    /// [`Groups::finished`].
    Send(Vec<(u64, I)>),
    /// Nothing to send before this time (the linger of a small batch).
    WaitUntil(Instant),
    /// The queue is empty: the key is forgotten and the sender ends.
    Idle,
}

#[derive(Debug)]
struct Waiting<I> {
    id: u64,
    item: I,
    since: Instant,
}

#[derive(Debug)]
struct KeyQueue<I> {
    in_flight: bool,
    waiting: VecDeque<Waiting<I>>,
}

/// The batcher's bookkeeping: which keys have a sender, which have a batch
/// in flight, and what waits. It never waits and takes the time as a
/// parameter.
#[derive(Debug)]
pub(crate) struct Groups<K, I> {
    keys: HashMap<K, KeyQueue<I>>,
    waiting: usize,
    next_id: u64,
    limits: GroupLimits,
}

impl<K: Eq + Hash + Clone, I> Groups<K, I> {
    pub(crate) fn new(limits: GroupLimits) -> Self {
        Self {
            keys: HashMap::new(),
            waiting: 0,
            next_id: 0,
            limits: GroupLimits {
                max_group: limits.max_group.max(1),
                queue_limit: limits.queue_limit.max(1),
                linger: limits.linger,
            },
        }
    }

    /// Queues `item` under `key` at `now`, or hands it back when
    /// `queue_limit` items wait already.
    pub(crate) fn offer(&mut self, key: K, item: I, now: Instant) -> Result<Queued, I> {
        if self.waiting >= self.limits.queue_limit {
            return Err(item);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting += 1;
        let mut start_sender = false;
        let queue = self.keys.entry(key).or_insert_with(|| {
            start_sender = true;
            KeyQueue {
                in_flight: false,
                waiting: VecDeque::new(),
            }
        });
        queue.waiting.push_back(Waiting {
            id,
            item,
            since: now,
        });
        Ok(Queued { id, start_sender })
    }

    /// The sender of `key` asks what to do at `now`. A batch takes the
    /// oldest items in order while `fits` accepts each given the ones taken
    /// before (the first is always taken), up to `max_group`.
    ///
    /// # Panics
    ///
    /// When `key`'s batch is still in flight: only its sender asks, after
    /// [`Groups::finished`].
    pub(crate) fn next(
        &mut self,
        key: &K,
        now: Instant,
        mut fits: impl FnMut(&[(u64, I)], &I) -> bool,
    ) -> Next<I> {
        let Some(queue) = self.keys.get_mut(key) else {
            return Next::Idle;
        };
        assert!(!queue.in_flight, "one batch in flight per key");
        let Some(oldest) = queue.waiting.front() else {
            self.keys.remove(key);
            return Next::Idle;
        };
        let due = oldest.since + self.limits.linger;
        if queue.waiting.len() < self.limits.max_group && now < due {
            return Next::WaitUntil(due);
        }
        let mut batch: Vec<(u64, I)> = Vec::new();
        while batch.len() < self.limits.max_group {
            let Some(next) = queue.waiting.front() else {
                break;
            };
            if !batch.is_empty() && !fits(&batch, &next.item) {
                break;
            }
            let taken = queue.waiting.pop_front().expect("looked at it");
            batch.push((taken.id, taken.item));
        }
        self.waiting -= batch.len();
        queue.in_flight = true;
        Next::Send(batch)
    }

    /// The batch in flight on `key` is over: its sender may take the next.
    pub(crate) fn finished(&mut self, key: &K) {
        if let Some(queue) = self.keys.get_mut(key) {
            queue.in_flight = false;
        }
    }

    /// Takes back the item `id` queued under `key`, if it has not left in a
    /// batch yet.
    pub(crate) fn withdraw(&mut self, key: &K, id: u64) -> Option<I> {
        let queue = self.keys.get_mut(key)?;
        let at = queue.waiting.iter().position(|w| w.id == id)?;
        let gone = queue.waiting.remove(at).expect("found at this place");
        self.waiting -= 1;
        Some(gone.item)
    }

    /// Forgets `key` — its sender stopped without finishing — and hands
    /// back the items that had not left: none of them was sent.
    pub(crate) fn abandon(&mut self, key: &K) -> Vec<I> {
        let Some(queue) = self.keys.remove(key) else {
            return Vec::new();
        };
        self.waiting -= queue.waiting.len();
        queue.waiting.into_iter().map(|w| w.item).collect()
    }

    /// Items waiting across every key.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether `key` has a batch in flight.
    #[cfg(test)]
    pub(crate) fn in_flight(&self, key: &K) -> bool {
        self.keys.get(key).is_some_and(|q| q.in_flight)
    }
}

/// [`Groups`] shared by callers and senders, with the wait for room.
#[derive(Debug)]
pub(crate) struct Batcher<K, I> {
    groups: Mutex<Groups<K, I>>,
    /// Signalled whenever items stop waiting: a caller waiting for room
    /// tries again.
    room: Notify,
}

impl<K: Eq + Hash + Clone, I> Batcher<K, I> {
    pub(crate) fn new(limits: GroupLimits) -> Self {
        Self {
            groups: Mutex::new(Groups::new(limits)),
            room: Notify::new(),
        }
    }

    /// Queues `item` under `key`, waiting while `queue_limit` items wait.
    pub(crate) async fn queue(&self, key: K, mut item: I) -> Queued {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            // Registered before the check: room made after it wakes us.
            room.as_mut().enable();
            match self.groups().offer(key.clone(), item, Instant::now()) {
                Ok(queued) => return queued,
                Err(back) => item = back,
            }
            room.await;
        }
    }

    /// What `key`'s sender does next (see [`Groups::next`]).
    pub(crate) fn next(&self, key: &K, fits: impl FnMut(&[(u64, I)], &I) -> bool) -> Next<I> {
        let next = self.groups().next(key, Instant::now(), fits);
        if matches!(next, Next::Send(_)) {
            self.room.notify_waiters();
        }
        next
    }

    /// The batch in flight on `key` is over.
    pub(crate) fn finished(&self, key: &K) {
        self.groups().finished(key);
    }

    /// Takes back an item that has not left yet (see [`Groups::withdraw`]).
    pub(crate) fn withdraw(&self, key: &K, id: u64) -> Option<I> {
        let item = self.groups().withdraw(key, id);
        if item.is_some() {
            self.room.notify_waiters();
        }
        item
    }

    /// Forgets `key` whose sender stopped (see [`Groups::abandon`]).
    pub(crate) fn abandon(&self, key: &K) -> Vec<I> {
        let items = self.groups().abandon(key);
        self.room.notify_waiters();
        items
    }

    /// Items waiting across every key.
    pub(crate) fn waiting(&self) -> usize {
        self.groups().waiting()
    }

    /// Locks past poisoning: every change to the bookkeeping is complete
    /// before anything in it can panic.
    fn groups(&self) -> MutexGuard<'_, Groups<K, I>> {
        self.groups.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
