//! The alert engine: the daemon reports the state of each condition it
//! watches (stuck tokens, oversized `pending` arrays and lane maps,
//! malformed documents,
//! failed runs, a monitor that is down, documents the server refused to
//! fold, a clock too far from the server's) as often as it likes, and the
//! engine
//! turns that stream of states into notifications — one `firing` when a
//! condition starts to hold, one `resolved` when it clears, nothing in
//! between.
//!
//! A condition is identified by its [`AlertKind`] and a collection name.
//! The transition logic is a small state machine free of I/O (the `Ledger`
//! at the bottom of this file); [`Alerts`] wraps it with the sinks:
//!
//! - the log, always: `alert firing` at WARN, `alert resolved` at INFO, as
//!   structured fields;
//! - a webhook, when `[alerts.webhook]` is configured: one JSON
//!   [`Notification`] per POST, retried with exponential [`Backoff`], given
//!   up after `max_attempts`; up to eight requests in flight at once, the
//!   notifications of one condition strictly in order (`lanes`).
//!
//! [`Alerts::set`] never blocks and never waits for the network: a
//! notification is logged at once and queued for the webhook.

mod kind;
mod lanes;
mod webhook;

pub(crate) use kind::AlertKind;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{AlertsConfig, redact_webhook_url};
use crate::daemon::metrics::Metrics;
use crate::error::words;
use crate::redact::Secrets;
use lanes::Backlog;
use webhook::{Delivery, Scrubber};

pub(crate) use webhook::Backoff;

/// The most sample ids a notification carries; more are cut off, so a
/// condition on a million documents still makes a small message.
pub(crate) const MAX_SAMPLE_IDS: usize = 10;

/// How many notifications may wait for the webhook (those being sent or
/// retried included). Notifications are sent only on transitions, so this
/// fills only when the webhook has been down for long while conditions kept
/// flapping; beyond it the newest are dropped (logged and counted as
/// `failed`) rather than blocking [`Alerts::set`].
pub(crate) const QUEUE_CAPACITY: usize = 1024;

/// Whether a notification opens or closes an alert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AlertState {
    /// The condition started to hold.
    Firing,
    /// The condition cleared.
    Resolved,
}

impl AlertState {
    /// The state's name in logs, metrics labels and webhook bodies.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            AlertState::Firing => "firing",
            AlertState::Resolved => "resolved",
        }
    }
}

impl fmt::Display for AlertState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The facts behind a firing alert, as the caller sees them now.
#[derive(Clone, Debug, PartialEq, Default)]
pub(crate) struct Observation {
    /// How many: stuck tokens, oversized or malformed documents, consecutive
    /// failed runs; for a clock skew, its whole seconds.
    pub(crate) count: u64,
    /// The age of the oldest stuck token, or how long the monitor has been
    /// down, when it applies.
    pub(crate) oldest_age: Option<Duration>,
    /// A few document `_id`s, as display strings, for the operator to look
    /// at; cut to [`MAX_SAMPLE_IDS`].
    pub(crate) sample_ids: Vec<String>,
    /// A human-readable line (e.g. a failed run's error). Secrets are
    /// scrubbed from it again before it is logged or sent.
    pub(crate) detail: Option<String>,
}

/// One notification: the body of one webhook POST, and the fields of the
/// matching log line. The JSON keys are exactly the field names below.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Notification {
    /// What the alert is about: `stuck_tokens`, `pending_too_long`,
    /// `malformed`, `run_failed`, `monitor_down`, `fold_refused` or
    /// `clock_skew`.
    pub(crate) kind: AlertKind,
    /// `firing` when the condition started to hold, `resolved` when it
    /// cleared. Each firing is followed by at most one resolved.
    pub(crate) state: AlertState,
    /// The collection the condition is about, as the daemon named it.
    pub(crate) collection: String,
    /// For `firing`, the observation's count when the condition started to
    /// hold; for `resolved`, 0 (the condition is clear).
    pub(crate) count: u64,
    /// For `firing`, the age of the oldest stuck token (or how long the
    /// monitor has been down) in whole seconds, when it applies; otherwise
    /// `null`. Always `null` for `resolved`.
    pub(crate) oldest_age_seconds: Option<u64>,
    /// For `firing`, up to [`MAX_SAMPLE_IDS`] document `_id`s to look at;
    /// empty for `resolved`.
    pub(crate) sample_ids: Vec<String>,
    /// A human-readable line, or `null`: for `firing` the caller's detail
    /// (e.g. the run's error), for `resolved` how long it fired and the last
    /// count seen.
    pub(crate) detail: Option<String>,
    /// When the transition was observed, RFC 3339 in UTC (not when it was
    /// delivered: a retried notification keeps its time).
    pub(crate) at: String,
    /// The daemon instance that sent it (`[ha] instance`), when the daemon
    /// gave one; omitted otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) instance: Option<String>,
}

/// Which conditions fire: kept by the daemon across configuration reloads,
/// so an engine started after a reload neither fires again what already
/// fires nor forgets to resolve it.
#[derive(Clone, Debug, Default)]
pub(crate) struct AlertLedger(Arc<Mutex<Ledger>>);

impl AlertLedger {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Settings of the engine that do not come from the configuration file.
#[derive(Clone, Debug)]
pub(crate) struct AlertOptions {
    /// Put into every notification's `instance`, so a receiver fed by
    /// several daemons (one active at a time) can tell which one spoke.
    /// Default: none.
    pub(crate) instance: Option<String>,
    /// The wait between webhook attempts. Default: [`Backoff::default`].
    pub(crate) backoff: Backoff,
    /// At shutdown, how long notifications not yet delivered get for one
    /// last attempt each (the daemon's drain has a deadline). Default: 3s.
    pub(crate) shutdown_flush: Duration,
    /// Which conditions fire already (from before a reload). Default: none.
    pub(crate) ledger: AlertLedger,
}

impl Default for AlertOptions {
    fn default() -> Self {
        Self {
            instance: None,
            backoff: Backoff::default(),
            shutdown_flush: Duration::from_secs(3),
            ledger: AlertLedger::default(),
        }
    }
}

/// The alert engine: a cheap-to-clone handle shared by every task that
/// watches a condition.
#[derive(Clone)]
pub(crate) struct Alerts {
    inner: Arc<Inner>,
}

struct Inner {
    ledger: AlertLedger,
    metrics: Metrics,
    scrubber: Scrubber,
    instance: Option<String>,
    sink: Sink,
}

/// Where notifications go besides the log.
enum Sink {
    /// No webhook configured.
    LogOnly,
    /// Queued for the delivery task, which sends those of one condition in
    /// order.
    Webhook {
        queue: mpsc::UnboundedSender<Notification>,
        backlog: Backlog,
        shown_url: String,
    },
    /// A webhook is configured but could not be set up (logged at start);
    /// every notification counts as a failed delivery.
    Unusable { shown_url: String },
}

impl fmt::Debug for Alerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sink = match &self.inner.sink {
            Sink::LogOnly => "log",
            Sink::Webhook { .. } => "log and webhook",
            Sink::Unusable { .. } => "log (webhook unusable)",
        };
        f.debug_struct("Alerts").field("sinks", &sink).finish()
    }
}

impl Alerts {
    /// Starts the engine with `options` (the daemon's instance name; short
    /// backoffs in tests); with a webhook configured, its delivery task runs
    /// on `tracker` until `shutdown` (so then it must be called within a
    /// Tokio runtime).
    pub(crate) fn start_with(
        config: &AlertsConfig,
        secrets: Secrets,
        metrics: Metrics,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        options: AlertOptions,
    ) -> Self {
        let webhook_url = config.webhook.as_ref().map(|w| w.url.expose());
        let scrubber = Scrubber::new(&secrets, webhook_url);
        let sink = match &config.webhook {
            None => Sink::LogOnly,
            Some(webhook) => {
                let shown_url = redact_webhook_url(webhook.url.expose());
                match Delivery::new(webhook, scrubber.clone(), metrics.clone(), &options) {
                    Ok(delivery) => {
                        let (queue, receiver) = mpsc::unbounded_channel();
                        let backlog = Backlog::default();
                        tracker.spawn(lanes::run(delivery, receiver, backlog.clone(), shutdown));
                        Sink::Webhook {
                            queue,
                            backlog,
                            shown_url,
                        }
                    }
                    Err(cause) => {
                        tracing::error!(
                            cause = %cause,
                            webhook = %shown_url,
                            "the webhook cannot be used; alerts go to the log only"
                        );
                        Sink::Unusable { shown_url }
                    }
                }
            }
        };
        Self {
            inner: Arc::new(Inner {
                ledger: options.ledger,
                metrics,
                scrubber,
                instance: options.instance,
                sink,
            }),
        }
    }

    /// Reports the current state of one condition: `Some(observation)` when
    /// it holds now, `None` when it is clear. Call it as often as the
    /// condition is checked: only transitions notify (clear → firing sends
    /// one `firing`, firing → clear one `resolved`); while firing, a new
    /// observation silently replaces the one kept (the `resolved` tells the
    /// last).
    /// Every call sets `tally_alerts_firing{kind,collection}` to 1 or 0.
    /// Never blocks: the webhook gets the notification through a queue.
    pub(crate) fn set(&self, kind: AlertKind, collection: &str, observation: Option<Observation>) {
        let observation = observation.map(|o| self.tidy(o));
        let gauge = self
            .inner
            .metrics
            .alerts_firing
            .with_label_values(&[kind.as_str(), collection]);
        let mut ledger = self.inner.ledger.lock();
        let holds = observation.is_some();
        let change = ledger.apply(kind, collection, observation, Instant::now());
        gauge.set(i64::from(holds));
        let Some(change) = change else { return };
        let notification = self.notification(kind, collection, change);
        self.inner
            .metrics
            .alert_notifications
            .with_label_values(&[kind.as_str(), notification.state.as_str()])
            .inc();
        log_notification(&notification);
        // Queued under the ledger's lock, so that notifications reach the
        // webhook in the order their transitions happened even when several
        // tasks report at once.
        self.enqueue(notification);
    }

    /// Resolves every firing condition of a collection `keep` says no (one
    /// no longer configured after a reload): nothing watches it any more.
    pub(crate) fn resolve_unless(&self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<(AlertKind, String)> = self
            .inner
            .ledger
            .lock()
            .firing
            .keys()
            .filter(|(_, collection)| !keep(collection))
            .cloned()
            .collect();
        for (kind, collection) in gone {
            self.set(kind, &collection, None);
        }
    }

    /// What is firing now, with the latest observation of each, ordered by
    /// kind then collection, for the tests.
    #[cfg(test)]
    pub(crate) fn firing(&self) -> Vec<(AlertKind, String, Observation)> {
        let ledger = self.inner.ledger.lock();
        ledger
            .firing
            .iter()
            .map(|((kind, collection), firing)| {
                (*kind, collection.clone(), firing.observation.clone())
            })
            .collect()
    }

    /// The observation as it may be kept and shown: samples cut, detail
    /// scrubbed.
    fn tidy(&self, mut observation: Observation) -> Observation {
        observation.sample_ids.truncate(MAX_SAMPLE_IDS);
        if let Some(detail) = &mut observation.detail {
            *detail = self.inner.scrubber.scrub(detail);
        }
        observation
    }

    fn notification(&self, kind: AlertKind, collection: &str, change: Change) -> Notification {
        let at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let (state, count, oldest_age_seconds, sample_ids, detail) = match change {
            Change::Fired(observation) => (
                AlertState::Firing,
                observation.count,
                observation.oldest_age.map(|age| age.as_secs()),
                observation.sample_ids,
                observation.detail,
            ),
            Change::Resolved { last, lasted } => (
                AlertState::Resolved,
                0,
                None,
                Vec::new(),
                Some(format!(
                    "cleared after {}; the last check that found any counted {}",
                    humantime::format_duration(Duration::from_secs(lasted.as_secs())),
                    last.count
                )),
            ),
        };
        Notification {
            kind,
            state,
            collection: collection.to_owned(),
            count,
            oldest_age_seconds,
            sample_ids,
            detail,
            at,
            instance: self.inner.instance.clone(),
        }
    }

    fn enqueue(&self, notification: Notification) {
        let not_sent = |notification: &Notification, shown_url: &str, reason: &str| {
            self.inner
                .metrics
                .webhook_deliveries
                .with_label_values(&["failed"])
                .inc();
            tracing::error!(
                kind = %notification.kind,
                state = %notification.state,
                collection = %notification.collection,
                webhook = %shown_url,
                "alert not sent: {reason}"
            );
        };
        match &self.inner.sink {
            Sink::LogOnly => {}
            Sink::Unusable { shown_url } => {
                not_sent(&notification, shown_url, "the webhook cannot be used");
            }
            Sink::Webhook {
                queue,
                backlog,
                shown_url,
            } => {
                if !backlog.admit(QUEUE_CAPACITY) {
                    not_sent(
                        &notification,
                        shown_url,
                        &format!("{QUEUE_CAPACITY} notifications already wait for the webhook"),
                    );
                } else if let Err(mpsc::error::SendError(notification)) = queue.send(notification) {
                    backlog.release(1);
                    not_sent(
                        &notification,
                        shown_url,
                        "webhook delivery has stopped (shutting down)",
                    );
                }
            }
        }
    }
}

/// The log sink: WARN for firing, INFO for resolved, facts as fields.
fn log_notification(n: &Notification) {
    match n.state {
        AlertState::Firing => tracing::warn!(
            kind = %n.kind,
            collection = %n.collection,
            count = n.count,
            oldest_age_seconds = n.oldest_age_seconds,
            sample_ids = %words(&n.sample_ids),
            detail = n.detail.as_deref(),
            "alert firing"
        ),
        AlertState::Resolved => tracing::info!(
            kind = %n.kind,
            collection = %n.collection,
            detail = n.detail.as_deref(),
            "alert resolved"
        ),
    }
}

/// What one report changed: the transitions that notify.
#[derive(Clone, Debug, PartialEq)]
enum Change {
    /// The condition was clear and now holds.
    Fired(Observation),
    /// The condition held and is now clear.
    Resolved {
        /// The last observation while it fired.
        last: Observation,
        /// How long it fired.
        lasted: Duration,
    },
}

/// A firing condition's state.
#[derive(Clone, Debug)]
struct Firing {
    since: Instant,
    observation: Observation,
}

/// The transition logic, free of I/O and clocks: which conditions fire, and
/// what a new report changes.
#[derive(Debug, Default)]
struct Ledger {
    firing: BTreeMap<(AlertKind, String), Firing>,
}

impl Ledger {
    /// Records the current state of `(kind, collection)` as of `now` and
    /// returns the transition to notify, if any.
    fn apply(
        &mut self,
        kind: AlertKind,
        collection: &str,
        observation: Option<Observation>,
        now: Instant,
    ) -> Option<Change> {
        let key = (kind, collection.to_owned());
        match observation {
            Some(observation) => match self.firing.get_mut(&key) {
                Some(firing) => {
                    firing.observation = observation;
                    None
                }
                None => {
                    self.firing.insert(
                        key,
                        Firing {
                            since: now,
                            observation: observation.clone(),
                        },
                    );
                    Some(Change::Fired(observation))
                }
            },
            None => self.firing.remove(&key).map(|firing| Change::Resolved {
                lasted: now.saturating_duration_since(firing.since),
                last: firing.observation,
            }),
        }
    }
}

#[cfg(test)]
mod tests;
