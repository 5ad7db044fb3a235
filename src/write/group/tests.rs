//! The batcher's rules under a fake clock: one batch in flight per key,
//! order kept, every item sent once or taken back, the bounds, the linger
//! and the wait for room.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::task::noop_waker_ref;
use proptest::prelude::*;

use super::*;

fn limits(max_group: usize, queue_limit: usize, linger_ms: u64) -> GroupLimits {
    GroupLimits {
        max_group,
        queue_limit,
        linger: Duration::from_millis(linger_ms),
    }
}

fn every<I>(_: &[(u64, I)], _: &I) -> bool {
    true
}

fn sent<I>(next: Next<I>) -> Vec<(u64, I)> {
    match next {
        Next::Send(batch) => batch,
        other => panic!("expected a batch, got {}", name(&other)),
    }
}

fn name<I>(next: &Next<I>) -> &'static str {
    match next {
        Next::Send(_) => "a batch",
        Next::WaitUntil(_) => "a wait",
        Next::Idle => "idle",
    }
}

#[test]
fn items_arriving_while_a_batch_is_in_flight_leave_together_as_the_next() {
    let t0 = Instant::now();
    let mut groups = Groups::new(limits(16, 100, 0));
    let first = groups.offer("k", 1, t0).unwrap();
    assert!(first.start_sender);
    assert_eq!(sent(groups.next(&"k", t0, every)), vec![(first.id, 1)]);
    let later: Vec<Queued> = (2..=5).map(|n| groups.offer("k", n, t0).unwrap()).collect();
    assert!(later.iter().all(|q| !q.start_sender), "the sender is busy");
    groups.finished(&"k");
    let batch = sent(groups.next(&"k", t0, every));
    assert_eq!(
        batch.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [2, 3, 4, 5]
    );
    groups.finished(&"k");
    assert_eq!(groups.next(&"k", t0, every), Next::Idle);
    assert!(groups.offer("k", 6, t0).unwrap().start_sender, "forgotten");
}

#[test]
fn a_batch_stops_where_the_next_item_does_not_fit_and_that_item_leads_the_next() {
    let t0 = Instant::now();
    let mut groups = Groups::new(limits(16, 100, 0));
    for n in [i64::MAX - 1, 1, 5] {
        groups.offer("k", n, t0).unwrap();
    }
    let fits = |batch: &[(u64, i64)], next: &i64| {
        batch
            .iter()
            .try_fold(*next, |sum, (_, n)| sum.checked_add(*n))
            .is_some()
    };
    assert_eq!(sent(groups.next(&"k", t0, fits)).len(), 2);
    groups.finished(&"k");
    assert_eq!(sent(groups.next(&"k", t0, fits)), vec![(2, 5)]);
}

#[test]
fn a_small_batch_lingers_until_its_oldest_item_waited_long_enough() {
    let t0 = Instant::now();
    let mut groups = Groups::new(limits(3, 100, 5));
    groups.offer("k", 1, t0).unwrap();
    let due = t0 + Duration::from_millis(5);
    assert_eq!(groups.next(&"k", t0, every), Next::WaitUntil(due));
    groups.offer("k", 2, t0 + Duration::from_millis(1)).unwrap();
    assert_eq!(groups.next(&"k", due, every).unwrap_len(), 2);
    groups.finished(&"k");
    for n in 3..=5 {
        groups.offer("k", n, due).unwrap();
    }
    assert_eq!(
        groups.next(&"k", due, every).unwrap_len(),
        3,
        "full: at once"
    );
}

impl<I> Next<I> {
    fn unwrap_len(self) -> usize {
        sent(self).len()
    }
}

#[test]
fn a_withdrawn_item_never_leaves_and_frees_its_place() {
    let t0 = Instant::now();
    let mut groups = Groups::new(limits(16, 2, 0));
    let a = groups.offer("k", 'a', t0).unwrap();
    let b = groups.offer("j", 'b', t0).unwrap();
    assert_eq!(groups.offer("k", 'c', t0), Err('c'), "full");
    assert_eq!(groups.withdraw(&"k", a.id), Some('a'));
    assert_eq!(groups.withdraw(&"k", a.id), None);
    let c = groups.offer("k", 'c', t0).unwrap();
    assert!(!c.start_sender, "k still has its sender");
    assert_eq!(sent(groups.next(&"k", t0, every)), vec![(c.id, 'c')]);
    assert_eq!(
        groups.withdraw(&"k", c.id),
        None,
        "it left: its batch's fate"
    );
    assert_eq!(groups.withdraw(&"j", b.id), Some('b'));
    assert_eq!(groups.waiting(), 0);
}

fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(noop_waker_ref()))
}

#[tokio::test]
async fn a_caller_beyond_the_queue_limit_waits_for_room() {
    let batcher = Arc::new(Batcher::new(limits(1, 2, 0)));
    batcher.queue("k", 1).await;
    batcher.queue("k", 2).await;
    let mut third = pin!(batcher.queue("j", 3));
    assert!(poll_once(third.as_mut()).is_pending(), "no room");
    assert_eq!(sent(batcher.next(&"k", every)).len(), 1, "max_group 1");
    let Poll::Ready(queued) = poll_once(third.as_mut()) else {
        panic!("a batch left: room for one");
    };
    assert!(queued.start_sender);
    assert_eq!(batcher.waiting(), 2);
}

#[derive(Debug, Clone)]
enum Step {
    /// A caller queues an item under key `k`.
    Offer(u8),
    /// Key `k`'s sender (if any) asks for its next batch.
    Take(u8),
    /// Key `k`'s batch in flight ends.
    Finish(u8),
    /// The `i`th caller still waiting gives up.
    Withdraw(usize),
    /// Time passes.
    Wait(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u8..3).prop_map(Step::Offer),
        3 => (0u8..3).prop_map(Step::Take),
        3 => (0u8..3).prop_map(Step::Finish),
        1 => any::<usize>().prop_map(Step::Withdraw),
        1 => (0u64..10).prop_map(Step::Wait),
    ]
}

proptest! {
    /// Whatever the interleaving: never two batches in flight on one key,
    /// every item sent once or withdrawn (never both), each key's items
    /// sent in the order they were queued, batches within `max_group`, no
    /// more than `queue_limit` waiting (and a caller refused exactly when
    /// that many wait), a sender started exactly when its key had none, and
    /// no small batch sent before its linger.
    #[test]
    fn the_batcher_keeps_every_rule(
        max_group in 1usize..5,
        queue_limit in 1usize..8,
        linger in 0u64..4,
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut groups: Groups<u8, u64> = Groups::new(limits(max_group, queue_limit, linger));
        let mut with_sender: HashSet<u8> = HashSet::new();
        let mut in_flight: HashSet<u8> = HashSet::new();
        // Per key, the items queued and not yet sent or withdrawn, in order.
        let mut queued: BTreeMap<u8, Vec<(u64, Instant)>> = BTreeMap::new();
        let mut done: HashSet<u64> = HashSet::new();
        for step in steps {
            match step {
                Step::Offer(k) => {
                    let waiting: usize = queued.values().map(Vec::len).sum();
                    match groups.offer(k, 0, now) {
                        Ok(q) => {
                            prop_assert!(waiting < queue_limit);
                            prop_assert_eq!(q.start_sender, with_sender.insert(k));
                            queued.entry(k).or_default().push((q.id, now));
                        }
                        Err(_) => prop_assert_eq!(waiting, queue_limit),
                    }
                }
                Step::Take(k) if with_sender.contains(&k) && !in_flight.contains(&k) => {
                    let mine = queued.entry(k).or_default();
                    match groups.next(&k, now, every) {
                        Next::Idle => {
                            prop_assert!(mine.is_empty());
                            with_sender.remove(&k);
                        }
                        Next::WaitUntil(due) => {
                            prop_assert!(mine.len() < max_group);
                            prop_assert_eq!(due, mine[0].1 + Duration::from_millis(linger));
                            prop_assert!(now < due);
                        }
                        Next::Send(batch) => {
                            prop_assert!(!batch.is_empty() && batch.len() <= max_group);
                            let expected: Vec<u64> =
                                mine.iter().take(batch.len()).map(|(id, _)| *id).collect();
                            let ids: Vec<u64> = batch.iter().map(|(id, _)| *id).collect();
                            prop_assert_eq!(&ids, &expected, "in order");
                            let full = mine.len() >= max_group;
                            prop_assert!(full || now >= mine[0].1 + Duration::from_millis(linger));
                            for id in ids {
                                prop_assert!(done.insert(id), "sent twice");
                            }
                            mine.drain(..batch.len());
                            in_flight.insert(k);
                            prop_assert!(groups.in_flight(&k));
                        }
                    }
                }
                Step::Take(_) => {}
                Step::Finish(k) => {
                    if in_flight.remove(&k) {
                        groups.finished(&k);
                    }
                }
                Step::Withdraw(i) => {
                    let all: Vec<(u8, u64)> = queued
                        .iter()
                        .flat_map(|(k, items)| items.iter().map(move |(id, _)| (*k, *id)))
                        .collect();
                    if !all.is_empty() {
                        let (k, id) = all[i % all.len()];
                        prop_assert!(groups.withdraw(&k, id).is_some());
                        prop_assert!(done.insert(id), "withdrawn after it left");
                        queued.get_mut(&k).unwrap().retain(|(other, _)| *other != id);
                    }
                }
                Step::Wait(ms) => now += Duration::from_millis(ms),
            }
            let waiting: usize = queued.values().map(Vec::len).sum();
            prop_assert_eq!(groups.waiting(), waiting);
            prop_assert!(waiting <= queue_limit);
        }
    }
}
