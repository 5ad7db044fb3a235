//! The webhook sink: how one notification is POSTed ([`Delivery::attempt`]),
//! how long to wait before trying it again ([`Backoff`]), and how foreign
//! messages lose their secrets ([`Scrubber`]). Which notification is
//! attempted when is the delivery task's business (`lanes`).
//!
//! Nothing it logs shows the webhook URL beyond its scheme and host, nor
//! the `Authorization` value: request errors are taken without their URL
//! and scrubbed of every secret before they are printed.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, HeaderValue};

use super::{AlertOptions, Notification};
use crate::config::{WebhookConfig, redact_webhook_url};
use crate::daemon::metrics::Metrics;
use crate::redact::{MASK, Secrets};

/// The most a retry wait is shortened at random (a quarter), so that
/// daemons that failed together do not retry in step.
const JITTER: f64 = 0.25;

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
pub(super) enum AttemptError {
    /// The webhook answered, but not with a 2xx status.
    #[error("the webhook answered {0}")]
    Status(reqwest::StatusCode),
    /// No answer within the attempt's time.
    #[error("no answer within {}", crate::error::human_duration(*.0))]
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
    /// An earlier notification of the same condition could not be sent
    /// before shutdown, so this one was not tried (order matters).
    #[error("an earlier notification of the same condition was not sent")]
    Behind,
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

/// The HTTP client and everything an attempt needs.
pub(super) struct Delivery {
    client: reqwest::Client,
    url: reqwest::Url,
    pub(super) shown_url: String,
    auth: Option<HeaderValue>,
    pub(super) timeout: Duration,
    pub(super) max_attempts: u32,
    pub(super) backoff: Backoff,
    pub(super) shutdown_flush: Duration,
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

    /// One POST of one notification, given up after `timeout`.
    pub(super) async fn attempt(
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

    /// Counts one delivery result (`delivered`, `retried`, `failed`).
    pub(super) fn count(&self, result: &str) {
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
