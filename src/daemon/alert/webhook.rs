//! The webhook sink: one task POSTs notifications in the order they
//! happened, retrying each with exponential backoff before it moves on to
//! the next (a `resolved` must never overtake its `firing`).
//!
//! Nothing it logs shows the webhook URL beyond its scheme and host, nor
//! the `Authorization` value: request errors are taken without their URL
//! and scrubbed of every secret before they are printed.

use std::collections::VecDeque;
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, HeaderValue};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{AlertOptions, Notification};
use crate::config::{WebhookConfig, redact_webhook_url};
use crate::daemon::metrics::Metrics;
use crate::redact::{MASK, Secrets};

/// The most a retry wait is shortened at random (a quarter), so that
/// daemons that failed together do not retry in step.
const JITTER: f64 = 0.25;

/// How many undelivered notifications are logged one by one at shutdown;
/// the rest are summed up in one line.
const LOGGED_AT_SHUTDOWN: usize = 10;

/// The wait between two attempts to deliver one notification: `base` after
/// the first failure, doubling after each further one, never more than
/// `cap`, each shortened at random by up to a quarter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Backoff {
    /// The wait after the first failed attempt. Default: 1s.
    pub(crate) base: Duration,
    /// The longest wait. Default: 60s.
    pub(crate) cap: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// The wait after failed attempt number `attempt` (1 for the first),
    /// `jitter` in `[0, 1]` taking off that fraction of a quarter.
    pub(crate) fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let factor = 2u32.saturating_pow(attempt.saturating_sub(1));
        let full = self.base.saturating_mul(factor).min(self.cap);
        full.mul_f64(1.0 - JITTER * jitter.clamp(0.0, 1.0))
    }
}

/// Why one attempt did not deliver.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    /// The webhook answered, but not with a 2xx status.
    #[error("the webhook answered {0}")]
    Status(reqwest::StatusCode),
    /// No answer within the attempt's time.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    /// The connection could not be made (refused, unreachable, TLS).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// Anything else reqwest reports (already scrubbed).
    #[error("request failed: {0}")]
    Request(String),
    /// Shutdown left no time for the attempt.
    #[error("shutting down: no time left to send it")]
    NoTimeLeft,
}

/// How delivering one notification ended.
enum Outcome {
    /// Delivered, or given up after `max_attempts`: on to the next.
    Done,
    /// Shutdown came while it waited to be retried: it gets one last
    /// attempt with the rest.
    Interrupted,
    /// Shutdown came during an attempt, which then failed or ran out of
    /// time: it had its last chance, and the webhook is presumed down for
    /// the rest.
    CutShort(AttemptError),
}

/// Removes secrets from foreign messages: the configuration's, plus the
/// parts of the webhook URL that may be secret on their own (path, query,
/// password), which the whole-URL secret would not catch.
#[derive(Clone, Debug)]
pub(super) struct Scrubber {
    secrets: Secrets,
    url_parts: Vec<String>,
}

impl Scrubber {
    pub(super) fn new(secrets: &Secrets, webhook_url: Option<&str>) -> Self {
        let mut url_parts = Vec::new();
        if let Some(url) = webhook_url.and_then(|url| reqwest::Url::parse(url).ok()) {
            let mut path_and_query = url.path().to_owned();
            if let Some(query) = url.query() {
                path_and_query.push('?');
                path_and_query.push_str(query);
            }
            url_parts.push(path_and_query);
            url_parts.extend(url.password().map(str::to_owned));
            url_parts.retain(|part| part.len() > 1);
            url_parts.sort_by_key(|part| std::cmp::Reverse(part.len()));
        }
        Self {
            secrets: secrets.clone(),
            url_parts,
        }
    }

    pub(super) fn scrub(&self, message: &str) -> String {
        let mut out = self.secrets.scrub(message);
        for part in &self.url_parts {
            out = out.replace(part.as_str(), MASK);
        }
        out
    }
}

/// The delivery task's state: the HTTP client and everything an attempt
/// needs.
pub(super) struct Delivery {
    client: reqwest::Client,
    url: reqwest::Url,
    shown_url: String,
    auth: Option<HeaderValue>,
    timeout: Duration,
    max_attempts: u32,
    backoff: Backoff,
    shutdown_flush: Duration,
    scrubber: Scrubber,
    metrics: Metrics,
}

impl Delivery {
    /// Prepares delivery to the configured webhook; the error says why the
    /// webhook cannot be used (without showing a secret).
    pub(super) fn new(
        config: &WebhookConfig,
        scrubber: Scrubber,
        metrics: Metrics,
        options: &AlertOptions,
    ) -> Result<Self, String> {
        let url = reqwest::Url::parse(config.url.expose())
            .map_err(|_| "the URL is not valid".to_owned())?;
        let auth = match &config.auth_header {
            None => None,
            Some(value) => {
                let mut header = HeaderValue::from_str(value.expose()).map_err(|_| {
                    format!(
                        "the value of {} is not a valid HTTP header value",
                        config
                            .auth_header_env
                            .as_deref()
                            .unwrap_or("auth_header_env")
                    )
                })?;
                header.set_sensitive(true);
                Some(header)
            }
        };
        let client = reqwest::Client::builder()
            // A redirect could carry the Authorization header elsewhere;
            // a 3xx answer is a failed attempt instead.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(config.timeout)
            .user_agent(concat!("tallyd/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| scrubber.scrub(&error_chain(&err.without_url())))?;
        Ok(Self {
            client,
            shown_url: redact_webhook_url(url.as_str()),
            url,
            auth,
            timeout: config.timeout,
            max_attempts: config.max_attempts.max(1),
            backoff: options.backoff,
            shutdown_flush: options.shutdown_flush,
            scrubber,
            metrics,
        })
    }

    /// Delivers queued notifications in order until `shutdown`, then gives
    /// those still waiting one last attempt within the shutdown flush and
    /// logs what could not be sent.
    pub(super) async fn run(
        self,
        mut queue: mpsc::Receiver<Notification>,
        shutdown: CancellationToken,
    ) {
        let mut unsent = VecDeque::new();
        let mut failure = None;
        loop {
            let next = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                next = queue.recv() => next,
            };
            // Every handle is gone: nothing more will come.
            let Some(notification) = next else { return };
            match self.deliver(&notification, &shutdown).await {
                Outcome::Done => {}
                Outcome::Interrupted => {
                    unsent.push_back(notification);
                    break;
                }
                Outcome::CutShort(err) => {
                    unsent.push_back(notification);
                    failure = Some(err);
                    break;
                }
            }
        }
        self.flush(unsent, failure, queue).await;
    }

    /// Delivers one notification, retrying with backoff, unless shutdown
    /// interrupts.
    async fn deliver(&self, notification: &Notification, shutdown: &CancellationToken) -> Outcome {
        for attempt in 1..=self.max_attempts {
            let sending = self.attempt(notification, self.timeout);
            tokio::pin!(sending);
            let result = tokio::select! {
                biased;
                result = &mut sending => result,
                () = shutdown.cancelled() => {
                    // A started attempt may finish, within the flush time.
                    return match tokio::time::timeout(self.shutdown_flush, sending).await {
                        Ok(Ok(())) => {
                            self.count("delivered");
                            Outcome::Done
                        }
                        Ok(Err(err)) => Outcome::CutShort(err),
                        Err(_) => Outcome::CutShort(AttemptError::Timeout(self.shutdown_flush)),
                    };
                }
            };
            let err = match result {
                Ok(()) => {
                    self.count("delivered");
                    tracing::debug!(
                        kind = %notification.kind,
                        state = %notification.state,
                        collection = %notification.collection,
                        attempt,
                        "alert delivered to the webhook"
                    );
                    return Outcome::Done;
                }
                Err(err) => err,
            };
            if attempt == self.max_attempts {
                self.count("failed");
                tracing::error!(
                    kind = %notification.kind,
                    state = %notification.state,
                    collection = %notification.collection,
                    webhook = %self.shown_url,
                    attempts = attempt,
                    cause = %err,
                    "alert not delivered: the webhook failed every attempt; giving up"
                );
                return Outcome::Done;
            }
            self.count("retried");
            let wait = self.backoff.delay(attempt, fastrand::f64());
            tracing::warn!(
                kind = %notification.kind,
                state = %notification.state,
                collection = %notification.collection,
                webhook = %self.shown_url,
                attempt,
                max_attempts = self.max_attempts,
                retry_in_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                cause = %err,
                "webhook delivery failed; will retry"
            );
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Outcome::Interrupted,
                () = tokio::time::sleep(wait) => {}
            }
        }
        Outcome::Done
    }

    /// At shutdown: one last attempt each for the notifications still
    /// waiting, in order, within the flush time; stops at the first failure
    /// (the webhook is down, and order matters) and logs every notification
    /// not delivered.
    async fn flush(
        &self,
        mut unsent: VecDeque<Notification>,
        mut failure: Option<AttemptError>,
        mut queue: mpsc::Receiver<Notification>,
    ) {
        queue.close();
        while let Ok(notification) = queue.try_recv() {
            unsent.push_back(notification);
        }
        let deadline = Instant::now() + self.shutdown_flush;
        while failure.is_none() {
            let Some(notification) = unsent.front() else {
                break;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                failure = Some(AttemptError::NoTimeLeft);
                break;
            }
            match self.attempt(notification, left.min(self.timeout)).await {
                Ok(()) => {
                    self.count("delivered");
                    unsent.pop_front();
                }
                Err(err) => failure = Some(err),
            }
        }
        let cause = failure.map(|err| err.to_string()).unwrap_or_default();
        for notification in unsent.iter().take(LOGGED_AT_SHUTDOWN) {
            tracing::error!(
                kind = %notification.kind,
                state = %notification.state,
                collection = %notification.collection,
                webhook = %self.shown_url,
                cause = %cause,
                "alert not delivered before shutdown"
            );
        }
        if unsent.len() > LOGGED_AT_SHUTDOWN {
            tracing::error!(
                more = unsent.len() - LOGGED_AT_SHUTDOWN,
                webhook = %self.shown_url,
                cause = %cause,
                "more alerts not delivered before shutdown"
            );
        }
        self.metrics
            .webhook_deliveries
            .with_label_values(&["failed"])
            .inc_by(unsent.len() as u64);
        tracing::debug!(undelivered = unsent.len(), "webhook delivery stopped");
    }

    /// One POST of one notification.
    async fn attempt(
        &self,
        notification: &Notification,
        timeout: Duration,
    ) -> Result<(), AttemptError> {
        let mut request = self
            .client
            .post(self.url.clone())
            .timeout(timeout)
            .json(notification);
        if let Some(auth) = &self.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let response = request.send().await.map_err(|err| {
            let err = err.without_url();
            if err.is_timeout() {
                AttemptError::Timeout(timeout)
            } else if err.is_connect() {
                AttemptError::Connect(self.scrubber.scrub(&error_chain(&err)))
            } else {
                AttemptError::Request(self.scrubber.scrub(&error_chain(&err)))
            }
        })?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(AttemptError::Status(status))
        }
    }

    fn count(&self, result: &str) {
        self.metrics
            .webhook_deliveries
            .with_label_values(&[result])
            .inc();
    }
}

/// An error and its sources, `: `-separated, each said once (reqwest's own
/// message leaves out the cause, e.g. "connection refused").
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut parts = vec![err.to_string()];
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !parts.iter().any(|part| part.contains(&text)) {
            parts.push(text);
        }
        source = cause.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_up_to_the_cap() {
        let backoff = Backoff::default();
        let waits: Vec<u64> = (1..=9).map(|n| backoff.delay(n, 0.0).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff.delay(u32::MAX, 0.0), Duration::from_secs(60));
    }

    #[test]
    fn jitter_shortens_the_wait_by_at_most_a_quarter() {
        let backoff = Backoff {
            base: Duration::from_millis(400),
            cap: Duration::from_secs(1),
        };
        assert_eq!(backoff.delay(1, 1.0), Duration::from_millis(300));
        assert_eq!(backoff.delay(2, 0.5), Duration::from_millis(700));
        assert_eq!(backoff.delay(5, 1.0), Duration::from_millis(750));
        for _ in 0..100 {
            let wait = backoff.delay(1, fastrand::f64());
            assert!(wait > Duration::from_millis(299) && wait <= Duration::from_millis(400));
        }
    }

    #[test]
    fn a_webhook_url_at_its_root_leaves_slashes_alone() {
        let scrubber = Scrubber::new(&Secrets::default(), Some("https://hooks.example.com/"));
        assert_eq!(scrubber.scrub("a/b"), "a/b");
    }

    #[test]
    fn url_paths_queries_and_passwords_are_scrubbed() {
        let scrubber = Scrubber::new(
            &Secrets::new("mongodb://h/", ["Bearer t0k"]),
            Some("https://bot:pa55@hooks.example.com/T0/B1/xyz?token=abc"),
        );
        let scrubbed = scrubber
            .scrub("POST /T0/B1/xyz?token=abc as bot:pa55 with Bearer t0k to hooks.example.com");
        assert_eq!(
            scrubbed,
            "POST **** as bot:**** with **** to hooks.example.com"
        );
    }
}
