//! The webhook's delivery task: notifications go out concurrently, up to
//! [`MAX_IN_FLIGHT`] requests at once, but those of one condition (its kind
//! and collection: a lane) strictly in order — each retried with backoff
//! before the next of its lane is tried, so a `resolved` never overtakes
//! its `firing`.
//!
//! A request holds a slot only while it is in flight (at most `[alerts.webhook]
//! timeout`), never while its notification waits to be retried. So an
//! endpoint that hangs for one alert delays only that alert's lane: a
//! notification waits behind the earlier ones of its own condition, and for
//! a slot only as long as the requests ahead of it take.
//!
//! At shutdown the requests in flight may finish and every notification not
//! delivered yet gets one last attempt, all within the shutdown flush; a
//! lane whose notification fails then sends nothing after it. What was not
//! delivered is logged and counted as failed.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::webhook::{AttemptError, Delivery};
use super::{AlertKind, Notification};
use crate::daemon::sleep_until;

/// The most requests to the webhook in flight at once.
pub(crate) const MAX_IN_FLIGHT: usize = 8;

/// How many undelivered notifications are logged one by one at shutdown;
/// the rest are summed up in one line.
const LOGGED_AT_SHUTDOWN: usize = 10;

/// How many notifications were accepted for the webhook and are not done
/// (delivered, given up, or reported undelivered at shutdown): the queue's
/// bound, shared by the engine that admits and the task that finishes.
#[derive(Clone, Debug, Default)]
pub(super) struct Backlog(Arc<AtomicUsize>);

impl Backlog {
    /// Takes a place for one more notification, unless `capacity` are
    /// already waiting.
    pub(super) fn admit(&self, capacity: usize) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < capacity).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back the places of `n` notifications that are done.
    pub(super) fn release(&self, n: usize) {
        self.0.fetch_sub(n, Ordering::SeqCst);
    }
}

/// A condition: the notifications of one go out in order.
type Condition = (AlertKind, String);

/// One attempt in flight: its lane and how it went.
type Attempt<'d> = Pin<Box<dyn Future<Output = (Condition, Result<(), AttemptError>)> + Send + 'd>>;

/// The notifications of one condition not delivered yet, oldest first.
#[derive(Default)]
struct Lane {
    waiting: VecDeque<Notification>,
    /// Failed attempts of the first one.
    failed: u32,
}

/// Which lanes may send now, which wait for a retry, and what is left
/// undelivered at shutdown.
struct Lanes<'d> {
    delivery: &'d Delivery,
    backlog: Backlog,
    lanes: HashMap<Condition, Lane>,
    /// Lanes whose first notification may be attempted now, in the order
    /// they became ready.
    ready: VecDeque<Condition>,
    /// Lanes whose first notification waits for its retry.
    retry_at: Vec<(Instant, Condition)>,
    /// Set at shutdown: when the last attempts must be over.
    deadline: Option<Instant>,
    /// Notifications given up at shutdown, with why.
    undelivered: Vec<(Notification, String)>,
}

/// Delivers what `queue` brings until `shutdown`, then flushes.
pub(super) async fn run(
    delivery: Delivery,
    mut queue: mpsc::UnboundedReceiver<Notification>,
    backlog: Backlog,
    shutdown: CancellationToken,
) {
    let mut lanes = Lanes {
        delivery: &delivery,
        backlog,
        lanes: HashMap::new(),
        ready: VecDeque::new(),
        retry_at: Vec::new(),
        deadline: None,
        undelivered: Vec::new(),
    };
    let mut in_flight: FuturesUnordered<Attempt<'_>> = FuturesUnordered::new();
    let mut open = true;
    loop {
        lanes.start(&mut in_flight);
        if in_flight.is_empty()
            && lanes.ready.is_empty()
            && (lanes.deadline.is_some() || (!open && lanes.lanes.is_empty()))
        {
            break;
        }
        let retry = lanes.retry_at.iter().map(|(at, _)| *at).min();
        tokio::select! {
            biased;
            () = shutdown.cancelled(), if lanes.deadline.is_none() => {
                queue.close();
                while let Ok(notification) = queue.try_recv() {
                    lanes.push(notification);
                }
                lanes.finish_up(Instant::now() + delivery.shutdown_flush);
            }
            () = sleep_until(lanes.deadline), if lanes.deadline.is_some() => {
                lanes.cut_short();
                break;
            }
            Some((condition, result)) = in_flight.next(), if !in_flight.is_empty() => {
                lanes.settle(condition, result);
            }
            next = queue.recv(), if open && lanes.deadline.is_none() => match next {
                Some(notification) => lanes.push(notification),
                // Every handle is gone: nothing more will come.
                None => open = false,
            },
            () = sleep_until(retry), if retry.is_some() && lanes.deadline.is_none() => {
                lanes.retry_due();
            }
        }
    }
    lanes.report_undelivered();
}

impl<'d> Lanes<'d> {
    /// Queues a notification behind the others of its condition.
    fn push(&mut self, notification: Notification) {
        let condition = (notification.kind, notification.collection.clone());
        let lane = self.lanes.entry(condition.clone()).or_default();
        lane.waiting.push_back(notification);
        if lane.waiting.len() == 1 {
            self.ready.push_back(condition);
        }
    }

    /// Starts attempts for ready lanes while slots are free.
    fn start(&mut self, in_flight: &mut FuturesUnordered<Attempt<'d>>) {
        while in_flight.len() < MAX_IN_FLIGHT {
            let Some(condition) = self.ready.pop_front() else {
                return;
            };
            let Some(notification) = self
                .lanes
                .get(&condition)
                .and_then(|lane| lane.waiting.front())
                .cloned()
            else {
                continue;
            };
            let mut timeout = self.delivery.timeout;
            if let Some(deadline) = self.deadline {
                timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
            }
            let delivery = self.delivery;
            in_flight.push(Box::pin(async move {
                let result = delivery.attempt(&notification, timeout).await;
                (condition, result)
            }));
        }
    }

    /// Records how an attempt went: the next of its lane, a retry, or (at
    /// shutdown) the end of its lane.
    fn settle(&mut self, condition: Condition, result: Result<(), AttemptError>) {
        let delivery = self.delivery;
        let Some(lane) = self.lanes.get_mut(&condition) else {
            return;
        };
        let Some(notification) = lane.waiting.front() else {
            return;
        };
        let attempt = lane.failed + 1;
        let err = match result {
            Ok(()) => {
                delivery.count("delivered");
                tracing::debug!(
                    kind = %notification.kind,
                    state = %notification.state,
                    collection = %notification.collection,
                    attempt,
                    "alert delivered to the webhook"
                );
                self.next_of(condition);
                return;
            }
            Err(err) => err,
        };
        if self.deadline.is_some() {
            // The last attempt failed: nothing of this condition goes out
            // after it.
            let cause = err.to_string();
            let lane = self.lanes.remove(&condition).unwrap_or_default();
            for (i, notification) in lane.waiting.into_iter().enumerate() {
                let cause = if i == 0 {
                    cause.clone()
                } else {
                    AttemptError::Behind.to_string()
                };
                self.undelivered.push((notification, cause));
            }
            return;
        }
        lane.failed = attempt;
        if attempt >= delivery.max_attempts {
            delivery.count("failed");
            tracing::error!(
                kind = %notification.kind,
                state = %notification.state,
                collection = %notification.collection,
                webhook = %delivery.shown_url,
                attempts = attempt,
                cause = %err,
                "alert not delivered: the webhook failed every attempt; giving up"
            );
            self.next_of(condition);
            return;
        }
        delivery.count("retried");
        let wait = delivery.backoff.delay(attempt, fastrand::f64());
        tracing::warn!(
            kind = %notification.kind,
            state = %notification.state,
            collection = %notification.collection,
            webhook = %delivery.shown_url,
            attempt,
            max_attempts = delivery.max_attempts,
            retry_in_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            cause = %err,
            "webhook delivery failed; will retry"
        );
        self.retry_at.push((Instant::now() + wait, condition));
    }

    /// The first notification of `condition` is done: on to the next.
    fn next_of(&mut self, condition: Condition) {
        self.backlog.release(1);
        let Some(lane) = self.lanes.get_mut(&condition) else {
            return;
        };
        lane.waiting.pop_front();
        lane.failed = 0;
        if lane.waiting.is_empty() {
            self.lanes.remove(&condition);
        } else {
            self.ready.push_back(condition);
        }
    }

    /// Makes the lanes whose retry is due ready.
    fn retry_due(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) =
            self.retry_at.drain(..).partition(|(at, _)| *at <= now);
        self.retry_at = later;
        self.ready
            .extend(due.into_iter().map(|(_, condition)| condition));
    }

    /// Shutdown: what waits for a retry gets its last attempt now, and
    /// everything must be over by `deadline`.
    fn finish_up(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
        let waiting: Vec<Condition> = self.retry_at.drain(..).map(|(_, c)| c).collect();
        self.ready.extend(waiting);
    }

    /// The flush ran out: whatever is left was not delivered.
    fn cut_short(&mut self) {
        let cause = AttemptError::NoTimeLeft.to_string();
        for (_, lane) in self.lanes.drain() {
            for notification in lane.waiting {
                self.undelivered.push((notification, cause.clone()));
            }
        }
        self.ready.clear();
    }

    /// Logs and counts what was not delivered before shutdown.
    fn report_undelivered(&mut self) {
        // Lanes still holding notifications here were never tried (the
        // queue closed with them ready): they had no time either.
        self.cut_short();
        let delivery = self.delivery;
        for (notification, cause) in self.undelivered.iter().take(LOGGED_AT_SHUTDOWN) {
            tracing::error!(
                kind = %notification.kind,
                state = %notification.state,
                collection = %notification.collection,
                webhook = %delivery.shown_url,
                cause = %cause,
                "alert not delivered before shutdown"
            );
        }
        let left = self.undelivered.len();
        if left > LOGGED_AT_SHUTDOWN {
            tracing::error!(
                more = left - LOGGED_AT_SHUTDOWN,
                webhook = %delivery.shown_url,
                "more alerts not delivered before shutdown"
            );
        }
        for _ in 0..left {
            delivery.count("failed");
        }
        self.backlog.release(left);
        tracing::debug!(undelivered = left, "webhook delivery stopped");
    }
}
