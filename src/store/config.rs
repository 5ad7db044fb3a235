//! How to reach the server ([`StoreConfig`]): the connection string and
//! the timeouts, from the URI where it sets them, else tally's defaults;
//! and how settings show durations.

use std::time::Duration;

use mongodb::options::{ClientOptions, ConnectionString};
use serde::Serialize;

use super::DEFAULT_ATTEMPT_TIMEOUT;
use crate::redact::{SecretString, Secrets, redact_uri};

/// Default TCP connect timeout, when the URI does not set one.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default server selection timeout, when the URI does not set one.
pub(crate) const DEFAULT_SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Default idle time after which the driver closes a connection, when the
/// URI does not set one: below the 5 minutes after which many servers and
/// firewalls cut idle connections.
pub(crate) const DEFAULT_MAX_IDLE_TIME: Duration = Duration::from_secs(240);
/// The application name [`StoreConfig::new`] gives the server when the URI
/// names none.
const DEFAULT_APP_NAME: &str = "tally";

/// How to reach the server. Values set here override the same options in
/// the URI; [`StoreConfig::new`] starts from the URI's own values, then
/// tally's defaults.
///
/// ```
/// use std::time::Duration;
/// use tally::StoreConfig;
///
/// let mut config = StoreConfig::new("mongodb://db1,db2,db3/?replicaSet=rs0", "app");
/// // Fail over faster than the driver's 30 s default.
/// config.server_selection_timeout = Duration::from_secs(10);
/// assert_eq!(config.app_name, "tally");
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct StoreConfig {
    /// The connection string (`mongodb://` or, in builds with the `srv`
    /// feature, `mongodb+srv://`). Its password never appears in logs,
    /// errors or output.
    #[serde(serialize_with = "serialize_uri")]
    pub(crate) uri: SecretString,
    /// The database holding the counter collections and tally's own state.
    pub database: String,
    /// The application name the server sees (`appName`). Default: the
    /// URI's, else `tally` (`tallyd` for the daemon).
    pub app_name: String,
    /// How long to wait for a TCP connection (`connectTimeoutMS`).
    /// Default: the URI's, else 10s.
    #[serde(serialize_with = "serialize_duration")]
    pub connect_timeout: Duration,
    /// How long an operation waits for a usable server before failing
    /// (`serverSelectionTimeoutMS`). Default: the URI's, else 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub server_selection_timeout: Duration,
    /// Connections idle for longer are closed by the driver
    /// (`maxIdleTimeMS`). Default: the URI's, else 4m, below the 5 minutes
    /// after which many servers and firewalls cut idle connections.
    #[serde(serialize_with = "serialize_duration")]
    pub max_idle_time: Duration,
    /// How long tally waits for one attempt of an operation (server
    /// selection included) before abandoning it as a lost reply — a
    /// transient failure, retried once where that is safe. The driver has no
    /// socket timeout; this bounds a hung connection. Always longer than
    /// `server_selection_timeout` (raised to it plus 1s if set shorter), so
    /// a server that cannot be selected is reported as such. Default: 60s.
    #[serde(serialize_with = "serialize_duration")]
    pub attempt_timeout: Duration,
}

impl StoreConfig {
    /// Settings for `uri` and `database`: the options the URI sets, tally's
    /// defaults for the others. A URI that does not parse is reported by
    /// [`Store::connect`](super::Store::connect).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::StoreConfig;
    ///
    /// let config = StoreConfig::new("mongodb://localhost/?appName=billing&connectTimeoutMS=2000", "app");
    /// assert_eq!(config.app_name, "billing");
    /// assert_eq!(config.connect_timeout, Duration::from_secs(2));
    /// assert_eq!(config.attempt_timeout, Duration::from_secs(60));
    /// ```
    pub fn new(uri: impl Into<String>, database: impl Into<String>) -> Self {
        let uri = uri.into();
        let parsed = ConnectionString::parse(&uri).ok();
        let mut config = Self::with_uri_options(SecretString::new(uri), parsed.as_ref());
        config.database = database.into();
        config.app_name = parsed
            .and_then(|p| p.app_name)
            .unwrap_or_else(|| DEFAULT_APP_NAME.into());
        config
    }

    /// Settings taking the timeouts from `parsed` (the URI, parsed) where it
    /// sets them, else from tally's defaults; no database or application
    /// name yet.
    pub(crate) fn with_uri_options(uri: SecretString, parsed: Option<&ConnectionString>) -> Self {
        let from_uri = |f: fn(&ConnectionString) -> Option<Duration>| parsed.and_then(f);
        Self {
            uri,
            database: String::new(),
            app_name: String::new(),
            connect_timeout: from_uri(|p| p.connect_timeout).unwrap_or(DEFAULT_CONNECT_TIMEOUT),
            server_selection_timeout: from_uri(|p| p.server_selection_timeout)
                .unwrap_or(DEFAULT_SERVER_SELECTION_TIMEOUT),
            max_idle_time: from_uri(|p| p.max_idle_time).unwrap_or(DEFAULT_MAX_IDLE_TIME),
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
        }
    }

    /// The secrets to scrub from messages that mention this connection.
    pub(crate) fn secrets(&self) -> Secrets {
        Secrets::new(self.uri.expose(), [])
    }

    /// Applies these settings to options parsed from the URI.
    pub(super) fn apply_to(&self, options: &mut ClientOptions) {
        options.app_name = Some(self.app_name.clone());
        options.connect_timeout = Some(self.connect_timeout);
        options.server_selection_timeout = Some(self.server_selection_timeout);
        options.max_idle_time = Some(self.max_idle_time);
    }
}

/// A duration as settings are shown (`tallyd check-config`): `1m 30s`.
pub(crate) fn serialize_duration<S: serde::Serializer>(
    d: &Duration,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&shown_duration(*d))
}

/// A duration in hours at the most, as a configuration writes one: `24h`,
/// `1h 30m`, `250ms` — never humantime's days, months or years (`24h`
/// shown as `1day`, `720h` as `30days`, which read as other
/// settings than the file's). What it shows parses back to the same
/// duration.
pub(crate) fn shown_duration(d: Duration) -> String {
    let secs = d.as_secs();
    let nanos = d.subsec_nanos();
    let parts = [
        (secs / 3600, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
        (u64::from(nanos / 1_000_000), "ms"),
        (u64::from(nanos / 1_000 % 1_000), "us"),
        (u64::from(nanos % 1_000), "ns"),
    ];
    let shown: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect();
    if shown.is_empty() {
        "0s".to_owned()
    } else {
        shown.join(" ")
    }
}

/// An optional duration as settings are shown.
pub(crate) fn serialize_optional_duration<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => serialize_duration(d, s),
        None => s.serialize_none(),
    }
}

fn serialize_uri<S: serde::Serializer>(uri: &SecretString, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_uri(uri.expose()))
}

#[cfg(test)]
mod tests {
    use super::shown_duration;
    use std::time::Duration;

    /// `check-config` shows a duration as a configuration writes one: a
    /// day as `24h`, not humantime's `1day`; and what it shows parses back
    /// to the same duration.
    #[test]
    fn durations_are_shown_in_hours_at_the_most_and_parse_back() {
        let cases = [
            ("24h", "24h"),
            ("1h 30m", "1h 30m"),
            ("90m", "1h 30m"),
            ("720h", "720h"),
            ("10s", "10s"),
            ("250ms", "250ms"),
            ("1s 5ms", "1s 5ms"),
            ("0s", "0s"),
        ];
        for (written, shown) in cases {
            let d = humantime::parse_duration(written).unwrap();
            assert_eq!(shown_duration(d), shown, "{written}");
            assert_eq!(humantime::parse_duration(shown).unwrap(), d, "{written}");
        }
        assert_eq!(shown_duration(Duration::from_nanos(1_001)), "1us 1ns");
    }
}
