//! The lanes a [`Counters`](crate::Counters) handle keeps: at most `lanes`
//! of them, each carrying one operation at a time.
//!
//! An increment takes a lane ([`LanePool::acquire`], waiting while every
//! lane is busy), sends the lane's next number, and then either returns the
//! lane with its number advanced ([`LaneLease::decided`]: the operation was
//! counted, or definitely not applied) or **retires** it: an operation whose
//! fate is unknown — or whose future the caller dropped mid-flight — may
//! still apply later, so nothing newer may ever be sent on that lane (a
//! newer number applied first would make the old one look applied). The
//! lane is simply never handed out again; the next increment mints a fresh
//! one.
//!
//! A free lane older than `lane_rotate` is dropped instead of used, and a
//! fresh one minted: every lane in use is younger than `lane_rotate`, so an
//! unknown operation's ticket stays resumable for at least
//! `lane_resume_horizon − lane_rotate`.
//!
//! The bookkeeping ([`PoolState`]) takes "now" as a parameter and never
//! waits, so its rules are tested with a fake clock; [`LanePool`] adds the
//! waiting (a semaphore with one permit per lane).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use mongodb::bson::oid::ObjectId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::LaneId;
use crate::token::Token;

/// A minted lane as the pool holds it: its id and the number its next
/// operation sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lane {
    /// The lane's id; its time is the lane's creation time.
    pub(crate) id: ObjectId,
    /// The number the lane's next operation sends: 1 for a fresh lane,
    /// growing by one per decided operation.
    pub(crate) next: i64,
}

impl Lane {
    /// A fresh lane created at `now` (to the second, as its id says).
    fn mint(now: SystemTime) -> Self {
        Self {
            id: Token::created_at_time(now).object_id(),
            next: 1,
        }
    }

    /// The lane as an increment names it.
    pub(crate) fn id(&self) -> LaneId {
        LaneId::Minted(self.id)
    }

    fn age(&self, now: SystemTime) -> Duration {
        LaneId::Minted(self.id).age(now).unwrap_or_default()
    }
}

/// What the pool has done so far (for tests and logs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PoolCounts {
    /// Fresh lanes minted.
    pub(crate) minted: u64,
    /// Lanes dropped because they reached `lane_rotate`.
    pub(crate) rotated: u64,
    /// Lanes retired: their operation's fate was unknown.
    pub(crate) retired: u64,
}

/// The pool's bookkeeping: which lanes are free, and their next numbers.
/// It never waits and takes the time as a parameter.
#[derive(Debug)]
pub(crate) struct PoolState {
    /// Free lanes, the most recently returned last: it is taken first, so a
    /// handle with little concurrency keeps using few lanes (and leaves few
    /// entries in each document).
    free: Vec<Lane>,
    rotate: Duration,
    counts: PoolCounts,
}

impl PoolState {
    pub(crate) fn new(rotate: Duration) -> Self {
        Self {
            free: Vec::new(),
            rotate,
            counts: PoolCounts::default(),
        }
    }

    /// The lane for the next operation at `now`: the most recently returned
    /// free lane younger than `lane_rotate`, else a fresh one. Free lanes
    /// that reached `lane_rotate` (or their last number) are dropped on the
    /// way.
    pub(crate) fn check_out(&mut self, now: SystemTime) -> Lane {
        while let Some(lane) = self.free.pop() {
            if lane.age(now) < self.rotate && lane.next < i64::MAX {
                return lane;
            }
            self.counts.rotated += 1;
        }
        self.counts.minted += 1;
        Lane::mint(now)
    }

    /// Returns a lane whose operation was decided — counted, or definitely
    /// not applied: its next operation sends the next number.
    pub(crate) fn check_in(&mut self, lane: Lane) {
        self.free.push(Lane {
            next: lane.next + 1,
            ..lane
        });
    }

    /// Counts a lane that is never handed out again.
    pub(crate) fn retire(&mut self, _lane: Lane) {
        self.counts.retired += 1;
    }

    #[cfg(test)]
    pub(crate) fn counts(&self) -> PoolCounts {
        self.counts
    }

    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }
}

/// A handle's lanes: at most `size` in use at once.
#[derive(Debug)]
pub(crate) struct LanePool {
    permits: Arc<Semaphore>,
    state: Mutex<PoolState>,
}

impl LanePool {
    /// A pool of `size` lanes (at least one), rotated at `rotate`.
    pub(crate) fn new(size: usize, rotate: Duration) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(size.max(1))),
            state: Mutex::new(PoolState::new(rotate)),
        })
    }

    /// Waits for a free lane and takes it, at the time `now` tells once one
    /// is free. Dropping the lease without [`LaneLease::decided`] retires
    /// the lane.
    pub(crate) async fn acquire(self: &Arc<Self>, now: impl FnOnce() -> SystemTime) -> LaneLease {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the pool never closes its semaphore");
        let lane = self.state().check_out(now());
        LaneLease {
            pool: self.clone(),
            lane: Some(lane),
            _permit: permit,
        }
    }

    #[cfg(test)]
    pub(crate) fn counts(&self) -> PoolCounts {
        self.state().counts()
    }

    /// How many lanes are free (minted and not in use).
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.state().free()
    }

    /// Locks past poisoning: every change to the state is a single push,
    /// pop or count.
    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One lane taken from the pool for one operation. Retires the lane when
/// dropped, unless the operation was [decided](Self::decided).
#[derive(Debug)]
pub(crate) struct LaneLease {
    pool: Arc<LanePool>,
    lane: Option<Lane>,
    _permit: OwnedSemaphorePermit,
}

impl LaneLease {
    /// The lane and the number this operation sends.
    pub(crate) fn lane(&self) -> Lane {
        self.lane.expect("a lease holds its lane until it ends")
    }

    /// The operation was counted, or definitely not applied: the lane goes
    /// back to the pool, its next operation sending the next number.
    pub(crate) fn decided(mut self) {
        if let Some(lane) = self.lane.take() {
            self.pool.state().check_in(lane);
        }
    }

    /// The operation's fate is unknown: the lane is never used again.
    pub(crate) fn retire(self) {
        drop(self);
    }
}

impl Drop for LaneLease {
    fn drop(&mut self) {
        if let Some(lane) = self.lane.take() {
            // An unknown outcome, or a caller that dropped the operation
            // mid-flight: its number may still be on its way.
            tracing::debug!(lane = %lane.id, position = lane.next, "lane retired");
            self.pool.state().retire(lane);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll};

    use futures::task::noop_waker_ref;
    use proptest::prelude::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        future.poll(&mut Context::from_waker(noop_waker_ref()))
    }

    #[test]
    fn a_lane_starts_at_1_and_each_decided_operation_advances_it() {
        let mut state = PoolState::new(HOUR);
        let first = state.check_out(t0());
        assert_eq!(first.next, 1);
        assert_eq!(first.age(t0()), Duration::ZERO);
        state.check_in(first);
        let again = state.check_out(t0() + Duration::from_secs(5));
        assert_eq!((again.id, again.next), (first.id, 2));
        assert_eq!(state.counts().minted, 1);
    }

    #[test]
    fn the_most_recently_returned_lane_is_used_first() {
        let mut state = PoolState::new(HOUR);
        let (a, b) = (state.check_out(t0()), state.check_out(t0()));
        assert_ne!(a.id, b.id);
        state.check_in(a);
        state.check_in(b);
        assert_eq!(state.check_out(t0()).id, b.id);
        assert_eq!(state.check_out(t0()).id, a.id);
    }

    #[test]
    fn a_lane_that_reached_lane_rotate_is_replaced_before_its_next_use() {
        let mut state = PoolState::new(HOUR);
        let old = state.check_out(t0());
        state.check_in(old);
        let just_younger = state.check_out(t0() + HOUR - Duration::from_secs(1));
        assert_eq!(just_younger.id, old.id);
        state.check_in(just_younger);
        let at_rotate = state.check_out(t0() + HOUR);
        assert_ne!(at_rotate.id, old.id);
        assert_eq!(at_rotate.next, 1);
        assert_eq!(
            at_rotate.age(t0() + HOUR),
            Duration::ZERO,
            "minted at the given time"
        );
        assert_eq!(
            state.counts(),
            PoolCounts {
                minted: 2,
                rotated: 1,
                retired: 0
            }
        );
    }

    #[test]
    fn a_retired_lane_is_never_handed_out_again() {
        let mut state = PoolState::new(HOUR);
        let lane = state.check_out(t0());
        state.retire(lane);
        let next = state.check_out(t0());
        assert_ne!(next.id, lane.id);
        assert_eq!(state.counts().retired, 1);
        assert_eq!(state.free(), 0);
    }

    #[tokio::test]
    async fn an_increment_waits_for_a_free_lane_and_gets_the_one_returned() {
        let pool = LanePool::new(2, HOUR);
        let a = pool.acquire(t0).await;
        let b = pool.acquire(t0).await;
        let mut third = pin!(pool.acquire(t0));
        assert!(
            poll_once(third.as_mut()).is_pending(),
            "both lanes are busy"
        );
        let returned = a.lane();
        a.decided();
        let Poll::Ready(c) = poll_once(third.as_mut()) else {
            panic!("a lane was returned");
        };
        assert_eq!((c.lane().id, c.lane().next), (returned.id, 2));
        b.decided();
        c.decided();
        assert_eq!(pool.free(), 2);
    }

    #[tokio::test]
    async fn a_lease_dropped_mid_operation_retires_its_lane_and_frees_its_slot() {
        let pool = LanePool::new(1, HOUR);
        let in_flight = {
            let pool = pool.clone();
            async move {
                let lease = pool.acquire(t0).await;
                let lane = lease.lane();
                // The operation's request is on its way; the caller gives up.
                std::future::pending::<()>().await;
                lease.decided();
                lane
            }
        };
        let mut in_flight = Box::pin(in_flight);
        assert!(poll_once(in_flight.as_mut()).is_pending());
        drop(in_flight);
        assert_eq!(pool.counts().retired, 1);
        assert_eq!(pool.free(), 0);
        let next = pool.acquire(t0).await;
        assert_eq!(next.lane().next, 1, "a fresh lane");
        assert_eq!(pool.counts().minted, 2);
    }

    #[tokio::test]
    async fn an_unknown_outcome_retires_the_lane() {
        let pool = LanePool::new(4, HOUR);
        let lease = pool.acquire(t0).await;
        let lane = lease.lane();
        lease.retire();
        let next = pool.acquire(t0).await;
        assert_ne!(next.lane().id, lane.id);
        assert_eq!(pool.counts().retired, 1);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Take,
        /// Ends the `i`th operation in flight (modulo how many there are).
        End {
            i: usize,
            decided: bool,
        },
        Wait(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => Just(Step::Take),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(i, decided)| Step::End { i, decided }),
            1 => (0u64..2 * 3600).prop_map(Step::Wait),
        ]
    }

    proptest! {
        /// Whatever the interleaving: at most `size` lanes in use, never one
        /// lane twice at once, numbers strictly growing per lane and never
        /// sent twice, no retired lane used again, no lane used at or past
        /// `lane_rotate`.
        #[test]
        fn the_pool_keeps_every_lane_rule(size in 1usize..5, steps in proptest::collection::vec(step(), 1..200)) {
            let rotate = HOUR;
            let mut state = PoolState::new(rotate);
            let mut now = t0();
            let mut in_flight: Vec<Lane> = Vec::new();
            let mut sent: HashSet<(ObjectId, i64)> = HashSet::new();
            let mut highest: HashMap<ObjectId, i64> = HashMap::new();
            let mut retired: HashSet<ObjectId> = HashSet::new();
            for step in steps {
                match step {
                    Step::Take if in_flight.len() < size => {
                        let lane = state.check_out(now);
                        prop_assert!(!retired.contains(&lane.id));
                        prop_assert!(in_flight.iter().all(|l| l.id != lane.id));
                        prop_assert!(lane.age(now) < rotate);
                        prop_assert!(sent.insert((lane.id, lane.next)));
                        if let Some(before) = highest.insert(lane.id, lane.next) {
                            prop_assert!(lane.next > before);
                        } else {
                            prop_assert_eq!(lane.next, 1);
                        }
                        in_flight.push(lane);
                    }
                    Step::Take => {}
                    Step::End { i, decided } if !in_flight.is_empty() => {
                        let lane = in_flight.remove(i % in_flight.len());
                        if decided {
                            state.check_in(lane);
                        } else {
                            retired.insert(lane.id);
                            state.retire(lane);
                        }
                    }
                    Step::End { .. } => {}
                    Step::Wait(secs) => now += Duration::from_secs(secs),
                }
                prop_assert!(state.free() + in_flight.len() <= size);
            }
        }
    }
}
