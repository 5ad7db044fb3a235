//! `[alerts]` and `[alerts.webhook]`: what the daemon alerts on, and where
//! the notifications go besides the log.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use super::field::Issues;
use super::raw::{RawAlerts, RawWebhook};
use crate::redact::{MASK, SecretString};
use crate::store::serialize_duration;

/// The default `[alerts] max_lanes`.
const DEFAULT_MAX_LANES: u64 = 500;

/// `[alerts]`: what the daemon alerts on, and where to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct AlertsConfig {
    /// A pending token older than this is stuck: its writer is gone and it
    /// waits for the fold. Must be at least the longest grace (`[reconcile]`
    /// or a collection's): younger tokens are not folded yet. Default: 30m.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) stuck_after: Duration,
    /// Alert when a document's pending array holds more entries than this
    /// (a writer that never runs step 2). Default: 1000.
    pub(crate) max_pending: u64,
    /// Alert (`lanes_too_many`) when a document's lane map holds more
    /// entries than this: every lane that wrote the counter within
    /// `lane_ttl` keeps one, every write rewrites the document, and named
    /// lanes are never pruned. Default: 500 (BENCHMARKS.md P7: a write to a
    /// document of 100 entries already costs a two-step increment; 500 fires
    /// only past what a few long-lived handles leave).
    pub(crate) max_lanes: u64,
    /// Fold documents with stuck tokens at once instead of waiting for the
    /// schedule (only tokens older than the grace are folded). Default:
    /// false.
    pub(crate) repair: bool,
    /// Alert when the change stream of a collection has been down for this
    /// long. Default: 5m.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) monitor_down_after: Duration,
    /// `[alerts.webhook]`: where alerts are POSTed, besides the log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) webhook: Option<WebhookConfig>,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            stuck_after: Duration::from_secs(30 * 60),
            max_pending: 1000,
            max_lanes: DEFAULT_MAX_LANES,
            repair: false,
            monitor_down_after: Duration::from_secs(300),
            webhook: None,
        }
    }
}

/// `[alerts.webhook]`: alerts POSTed as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct WebhookConfig {
    /// The URL (`http://` or `https://`). Treated as a secret — many
    /// webhook URLs carry their token — and shown as scheme and host only.
    #[serde(serialize_with = "serialize_webhook_url")]
    pub(crate) url: SecretString,
    /// The name of an environment variable holding the value of the
    /// `Authorization` header (e.g. `Bearer …`). Optional; the variable must
    /// be set when it is named. The value is never shown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) auth_header_env: Option<String>,
    /// The `Authorization` header's value, read from `auth_header_env`.
    #[serde(skip)]
    pub(crate) auth_header: Option<SecretString>,
    /// How long one delivery attempt may take (and hold one of the slots
    /// for requests in flight). Default: 5s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) timeout: Duration,
    /// Attempts per notification (retried with backoff) before it is given
    /// up and logged. Default: 8.
    pub(crate) max_attempts: u32,
}

pub(super) fn validate_alerts(
    raw: RawAlerts,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> AlertsConfig {
    issues.unknown_keys("alerts", &raw.unknown);
    let defaults = AlertsConfig::default();
    let stuck_after = issues.duration("alerts.stuck_after", raw.stuck_after, defaults.stuck_after);
    let max_pending = issues
        .optional_integer("alerts.max_pending", raw.max_pending, 1, 1_000_000)
        .unwrap_or(defaults.max_pending);
    let max_lanes = issues
        .optional_integer("alerts.max_lanes", raw.max_lanes, 1, 1_000_000)
        .unwrap_or(defaults.max_lanes);
    let repair = issues.boolean("alerts.repair", raw.repair, defaults.repair);
    let monitor_down_after = issues.duration(
        "alerts.monitor_down_after",
        raw.monitor_down_after,
        defaults.monitor_down_after,
    );
    let webhook = match raw.webhook {
        None => None,
        Some(section) => {
            let raw = issues.table::<RawWebhook>("alerts.webhook", Some(section));
            validate_webhook(raw, env, issues)
        }
    };
    AlertsConfig {
        stuck_after,
        max_pending,
        max_lanes,
        repair,
        monitor_down_after,
        webhook,
    }
}

fn validate_webhook(
    raw: RawWebhook,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<WebhookConfig> {
    issues.unknown_keys("alerts.webhook", &raw.unknown);
    let url = issues.required_string("alerts.webhook.url", raw.url)?;
    match reqwest::Url::parse(&url) {
        Ok(parsed) if matches!(parsed.scheme(), "http" | "https") && parsed.host().is_some() => {}
        _ => issues.push(
            "alerts.webhook.url",
            format!(
                "not an http:// or https:// URL: {}",
                redact_webhook_url(&url)
            ),
        ),
    }
    let auth_header_env = issues.string("alerts.webhook.auth_header_env", raw.auth_header_env);
    let auth_header = match &auth_header_env {
        None => None,
        Some(name)
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            issues.push(
                "alerts.webhook.auth_header_env",
                format!("{name:?} is not an environment variable name"),
            );
            None
        }
        Some(name) => match env.get(name) {
            Some(value) if reqwest::header::HeaderValue::from_str(value).is_err() => {
                issues.push(
                    "alerts.webhook.auth_header_env",
                    format!("the value of {name} is not a valid HTTP header value (a newline or control character?)"),
                );
                None
            }
            Some(value) if !value.is_empty() => Some(SecretString::new(value.clone())),
            _ => {
                issues.push(
                    "alerts.webhook.auth_header_env",
                    format!("the environment variable {name} is not set"),
                );
                None
            }
        },
    };
    let timeout = issues.duration(
        "alerts.webhook.timeout",
        raw.timeout,
        Duration::from_secs(5),
    );
    let max_attempts = issues
        .optional_integer("alerts.webhook.max_attempts", raw.max_attempts, 1, 100)
        .map_or(8, |n| n as u32);
    Some(WebhookConfig {
        url: SecretString::new(url),
        auth_header_env,
        auth_header,
        timeout,
        max_attempts,
    })
}

/// A webhook URL as it may be shown: scheme and host, the rest masked (a
/// webhook's path or query often is its secret).
pub(crate) fn redact_webhook_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => match parsed.host_str() {
            Some(host) => {
                let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
                format!("{}://{host}{port}/{}", parsed.scheme(), MASK)
            }
            None => MASK.to_owned(),
        },
        Err(_) => MASK.to_owned(),
    }
}

fn serialize_webhook_url<S: serde::Serializer>(
    url: &SecretString,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_webhook_url(url.expose()))
}
