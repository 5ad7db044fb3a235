//! Whether the daemon can do its work now: `/readyz` and `tally_ready`.
//!
//! The daemon first waits for MongoDB to answer (as long as it takes: a
//! server that is down may come back), except when the server refuses its
//! credentials, which no wait can fix. While it waits it says so — after a
//! second, then at growing intervals up to a minute — with why each host
//! cannot be reached, and a stop ends the wait at once. From then on a `hello` every
//! [`PROBE_EVERY`], each bounded by [`PROBE_TIMEOUT`], keeps the state
//! current: the daemon is not ready once no probe has succeeded for
//! [`NOT_READY_AFTER`] (a debounce: one lost probe is not an outage), and
//! ready again at the first probe that succeeds. Each answer also measures
//! this host's clock against the server's (`tally_clock_skew_seconds`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use mongodb::bson::{Document, doc};
use mongodb::error::ErrorKind;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::daemon::DaemonError;
use crate::daemon::clock::{Clock, LastSkew, Skew};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::error::{Error, human_duration};
use crate::redact::Secrets;
use crate::store::Store;

/// How often MongoDB is asked whether it is there.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How long one probe may take before it counts as failed.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long without a successful probe before the daemon is not ready.
pub(crate) const NOT_READY_AFTER: Duration = Duration::from_secs(15);

/// The longest wait between two attempts to reach MongoDB at start.
const MAX_WAIT: Duration = Duration::from_secs(30);
/// When the daemon first says that MongoDB has not answered yet.
const FIRST_SAID: Duration = Duration::from_secs(1);
/// The longest interval between two such messages.
const SAID_AT_MOST_EVERY: Duration = Duration::from_secs(60);

/// What `/readyz` reports: whether MongoDB answers, and the role.
#[derive(Clone, Debug)]
pub(crate) struct Readiness {
    ready: Arc<AtomicBool>,
    role: watch::Receiver<Role>,
    metrics: Metrics,
    clock: Clock,
    skew: LastSkew,
}

impl Readiness {
    /// Not ready yet; the role as published by the lease keeper. Each probe
    /// measures `clock` against the server's into `skew`.
    pub(crate) fn new(
        role: watch::Receiver<Role>,
        metrics: Metrics,
        clock: Clock,
        skew: LastSkew,
    ) -> Self {
        metrics.ready.set(0);
        Self {
            ready: Arc::new(AtomicBool::new(false)),
            role,
            metrics,
            clock,
            skew,
        }
    }

    /// Whether MongoDB answered recently enough.
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// The role this instance has now.
    pub(crate) fn role(&self) -> Role {
        *self.role.borrow()
    }

    fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
        self.metrics.ready.set(i64::from(ready));
    }

    /// Records the clock skew a probe's answer shows.
    fn measure(&self, sent: SystemTime, reply: &Document) {
        if let Some(skew) = Skew::from_hello(sent, self.clock.now(), reply) {
            self.metrics.clock_skew.set(skew.seconds);
            self.skew.set(skew);
        }
    }

    /// Marks the daemon ready: after the first contact, once the metrics
    /// the alert rules read are all there.
    pub(crate) fn mark_ready(&self) {
        self.set(true);
    }

    /// Waits until MongoDB answers: `Ok(true)` (the caller marks the daemon
    /// ready when it is); `Ok(false)` when shutdown came first (at once, also in the middle of
    /// an attempt). Credentials the server refuses are for the operator to
    /// fix, not an outage to wait out.
    pub(crate) async fn first_contact(
        &self,
        store: &Store,
        secrets: &Secrets,
        shutdown: &CancellationToken,
    ) -> Result<bool, DaemonError> {
        let mut waiting = Waiting::new(Instant::now());
        let mut backoff = Duration::from_secs(1);
        loop {
            let hello = store.hello();
            tokio::pin!(hello);
            let answer = loop {
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    answer = &mut hello => break answer,
                    () = tokio::time::sleep_until(waiting.next) => waiting.say(store, secrets),
                }
            };
            match answer {
                Ok(_) => {
                    if waiting.said {
                        tracing::info!("MongoDB answers");
                    }
                    return Ok(true);
                }
                Err(err) if refused_credentials(&err) => {
                    return Err(DaemonError::Denied(format!(
                        "MongoDB refused the credentials of [mongodb] uri: {}",
                        secrets.scrub(&store.explain(&err))
                    )));
                }
                // No server could be selected: the messages above say why.
                Err(err) if err.is_unavailable() => {}
                Err(err) => tracing::warn!(
                    cause = %secrets.scrub(&store.explain(&err)),
                    retry_in = %human_duration(backoff),
                    "MongoDB did not answer; trying again"
                ),
            }
            let wake = Instant::now() + backoff;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    () = tokio::time::sleep_until(wake) => break,
                    () = tokio::time::sleep_until(waiting.next) => waiting.say(store, secrets),
                }
            }
            backoff = (backoff * 2).min(MAX_WAIT);
        }
    }

    /// After the first contact: probes MongoDB every [`PROBE_EVERY`] until
    /// `shutdown`, keeping the state current.
    pub(crate) async fn follow(self, store: Store, secrets: Secrets, shutdown: CancellationToken) {
        let admin = store.client().database("admin");
        let mut last_success = Instant::now();
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let sent = self.clock.now();
            let probe = admin.run_command(doc! { "hello": 1 });
            let failure = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                Ok(Ok(reply)) => {
                    self.measure(sent, &reply);
                    None
                }
                Ok(Err(err)) => Some(secrets.scrub(&store.describe(&err))),
                Err(_) => Some(format!(
                    "no answer within {}",
                    human_duration(PROBE_TIMEOUT)
                )),
            };
            let now = Instant::now();
            if failure.is_none() {
                last_success = now;
            }
            let ready = judge(last_success, now);
            match (self.is_ready(), ready) {
                (false, true) => tracing::info!("MongoDB answers again: ready"),
                (true, false) => tracing::warn!(
                    cause = failure.as_deref().unwrap_or(""),
                    silent_for = %human_duration(now.duration_since(last_success)),
                    "MongoDB has not answered for {}: not ready",
                    human_duration(NOT_READY_AFTER)
                ),
                _ => {}
            }
            self.set(ready);
        }
    }
}

/// When to say, while waiting for MongoDB at start, that it has not
/// answered yet: after [`FIRST_SAID`], then at doubling intervals from 5 s
/// up to [`SAID_AT_MOST_EVERY`].
struct Waiting {
    started: Instant,
    next: Instant,
    every: Duration,
    said: bool,
}

impl Waiting {
    fn new(started: Instant) -> Self {
        Self {
            started,
            next: started + FIRST_SAID,
            every: Duration::from_secs(5),
            said: false,
        }
    }

    /// Says that MongoDB has not answered, why, and for how long.
    fn say(&mut self, store: &Store, secrets: &Secrets) {
        let now = Instant::now();
        tracing::warn!(
            "{}; waiting for it (a stop ends the wait)",
            secrets.scrub(&store.unanswered(now - self.started))
        );
        self.said = true;
        self.next = now + self.every;
        self.every = (self.every * 2).min(SAID_AT_MOST_EVERY);
    }
}

/// Ready while the last successful probe is less than [`NOT_READY_AFTER`]
/// old.
fn judge(last_success: Instant, now: Instant) -> bool {
    now.saturating_duration_since(last_success) < NOT_READY_AFTER
}

/// Whether the server refused the credentials: the driver's
/// authentication error kind, never its message.
pub(crate) fn refused_credentials(err: &Error) -> bool {
    match err {
        Error::Server(failure) => matches!(*failure.source.kind, ErrorKind::Authentication { .. }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_lost_probe_is_not_an_outage_three_are() {
        let start = Instant::now();
        assert!(judge(start, start));
        assert!(judge(start, start + PROBE_EVERY));
        assert!(judge(start, start + PROBE_EVERY * 2));
        assert!(!judge(start, start + PROBE_EVERY * 3));
        assert!(!judge(start, start + NOT_READY_AFTER));
    }
}
