//! The daemon's own sections: `[schedule]`, `[monitor]`, `[ha]`, `[http]`,
//! `[daemon]` and `[log]`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use super::field::Issues;
use super::library::check_collection_name;
use super::raw::{RawDaemon, RawHa, RawHttp, RawLog, RawMonitor, RawSchedule};
use crate::store::serialize_duration;
use crate::write::counter::CollectionConfig;

/// `[schedule]`: when the daemon folds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ScheduleConfig {
    /// A cron expression with a seconds field first, as
    /// tokio-cron-scheduler reads it: `sec min hour day-of-month month
    /// day-of-week`. Default: `0 30 3 * * *` (03:30 every night).
    pub(crate) cron: String,
    /// The IANA time zone the expression is read in (`UTC`,
    /// `Europe/Berlin`). Default: `UTC`.
    #[serde(serialize_with = "serialize_timezone")]
    pub(crate) timezone: chrono_tz::Tz,
    /// At start-up, run at once when a scheduled run was missed while the
    /// daemon was down (the last successful run is older than the latest
    /// scheduled time). Default: true.
    pub(crate) catch_up: bool,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            cron: DEFAULT_CRON.into(),
            timezone: chrono_tz::UTC,
            catch_up: true,
        }
    }
}

/// Default schedule: 03:30 every night.
pub(crate) const DEFAULT_CRON: &str = "0 30 3 * * *";

/// Parses a cron expression with a leading seconds field.
pub(crate) fn parse_cron(expression: &str) -> Result<croner::Cron, String> {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .dom_and_dow(true)
        .build()
        .parse(expression)
        .map_err(|err| err.to_string())
}

/// `[monitor]`: the daemon's live view of pending tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct MonitorConfig {
    /// Watch the collections through change streams. Without it the view is
    /// refreshed only by the periodic scan. Default: true.
    pub(crate) enabled: bool,
    /// How often a full scan (the fold's report) rebuilds the view, backing
    /// the stream up. Default: 5m.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) scan_interval: Duration,
    /// How often the change stream's resume token is saved (it is also
    /// saved at shutdown). Default: 10s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) save_interval: Duration,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            scan_interval: Duration::from_secs(300),
            save_interval: Duration::from_secs(10),
        }
    }
}

/// `[ha]`: several daemon instances, one active.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct HaConfig {
    /// Take a lease in the state collection; only its holder folds and
    /// alerts, the others stand by. Default: false (always active).
    pub(crate) enabled: bool,
    /// How long the lease lasts without renewal; the holder renews it every
    /// third of that, and steps down on its own clock a tenth of it before
    /// the lease could expire when no renewal succeeded. A standby takes
    /// over within the TTL plus one renewal after the holder dies. Default:
    /// 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) lease_ttl: Duration,
    /// This instance's name in the lease. Default: host name and process
    /// id.
    pub(crate) instance: String,
}

/// `[http]`: metrics and health endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct HttpConfig {
    /// The address `/metrics`, `/healthz` and `/readyz` listen on; one this
    /// host cannot listen on stops the daemon with exit 78. Default:
    /// `127.0.0.1:9187`.
    pub(crate) listen: SocketAddr,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9187)),
        }
    }
}

/// `[daemon]`: the daemon's own state and shutdown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct DaemonConfig {
    /// The collection holding the daemon's state: last successful runs,
    /// change-stream resume tokens, the lease. Default: `tally_state`.
    pub(crate) state_collection: String,
    /// At SIGTERM/SIGINT (and before a reload takes over), how long the
    /// drain may take — a running fold batch, the stream positions, the
    /// lease — before the daemon goes on anyway (exit 1 at a stop).
    /// Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) shutdown_timeout: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            state_collection: "tally_state".into(),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// `[log]`: what is logged and how. Logs go to standard error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct LogConfig {
    /// A tracing filter: comma-separated directives, each a level (`info`)
    /// or `target=level` (`info,tally::reconcile=debug`). `RUST_LOG`, when
    /// set, wins. Default: `info`.
    pub(crate) level: String,
    /// `text` (readable on a terminal) or `json` (one object per line).
    /// Default: `text`.
    pub(crate) format: LogFormat,
    /// `RUST_LOG` from the environment the configuration was loaded with,
    /// when set and not blank: checked like `level`, and used instead of it.
    #[serde(skip)]
    pub(crate) rust_log: Option<String>,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
            rust_log: None,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogFormat {
    /// Human-readable lines, coloured on a terminal.
    Text,
    /// One JSON object per line.
    Json,
}

pub(super) fn validate_schedule(raw: RawSchedule, issues: &mut Issues) -> ScheduleConfig {
    issues.unknown_keys("schedule", &raw.unknown);
    let defaults = ScheduleConfig::default();
    let timezone = match issues.string("schedule.timezone", raw.timezone) {
        None => defaults.timezone,
        Some(name) => name.parse::<chrono_tz::Tz>().unwrap_or_else(|_| {
            issues.push(
                "schedule.timezone",
                format!("unknown time zone {name:?}; use an IANA name such as \"UTC\" or \"Europe/Berlin\""),
            );
            defaults.timezone
        }),
    };
    let cron = issues
        .string("schedule.cron", raw.cron)
        .unwrap_or(defaults.cron);
    match parse_cron(&cron) {
        Err(err) => issues.push(
            "schedule.cron",
            format!(
                "not a cron expression with seconds first ({err}): {cron:?}; e.g. \"0 30 3 * * *\""
            ),
        ),
        Ok(parsed) if next_run(&parsed, timezone, chrono::Utc::now()).is_none() => issues.push(
            "schedule.cron",
            format!(
                "{cron:?} never fires: no time matches it within the next {NEVER_YEARS} years \
                 (a day the month does not have?), so nothing would ever be folded"
            ),
        ),
        Ok(_) => {}
    }
    let catch_up = issues.boolean("schedule.catch_up", raw.catch_up, defaults.catch_up);
    ScheduleConfig {
        cron,
        timezone,
        catch_up,
    }
}

/// How far ahead a schedule must fire at least once to be accepted.
const NEVER_YEARS: i32 = 5;

/// The first time `cron` fires after `now` in `timezone`, if it does within
/// [`NEVER_YEARS`] years.
pub(crate) fn next_run(
    cron: &croner::Cron,
    timezone: chrono_tz::Tz,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<chrono::DateTime<chrono::Utc>> {
    use chrono::Datelike;
    let now = now.with_timezone(&timezone);
    let limit = now.with_year(now.year() + NEVER_YEARS)?;
    let next = cron.find_next_occurrence(&now, false).ok()?;
    (next <= limit).then(|| next.with_timezone(&chrono::Utc))
}

pub(super) fn validate_monitor(raw: RawMonitor, issues: &mut Issues) -> MonitorConfig {
    issues.unknown_keys("monitor", &raw.unknown);
    let defaults = MonitorConfig::default();
    MonitorConfig {
        enabled: issues.boolean("monitor.enabled", raw.enabled, defaults.enabled),
        scan_interval: issues.duration(
            "monitor.scan_interval",
            raw.scan_interval,
            defaults.scan_interval,
        ),
        save_interval: issues.duration(
            "monitor.save_interval",
            raw.save_interval,
            defaults.save_interval,
        ),
    }
}

/// The shortest lease: it is renewed every third of its TTL.
const MIN_LEASE_TTL: Duration = Duration::from_secs(3);

pub(super) fn validate_ha(raw: RawHa, issues: &mut Issues) -> HaConfig {
    issues.unknown_keys("ha", &raw.unknown);
    let enabled = issues.boolean("ha.enabled", raw.enabled, false);
    let lease_ttl = issues.duration("ha.lease_ttl", raw.lease_ttl, Duration::from_secs(30));
    if lease_ttl < MIN_LEASE_TTL {
        issues.push(
            "ha.lease_ttl",
            "must be at least 3s (it is renewed every third of it)",
        );
    }
    let instance = issues
        .string("ha.instance", raw.instance)
        .unwrap_or_else(default_instance);
    if instance.is_empty() {
        issues.push("ha.instance", "must not be empty");
    }
    HaConfig {
        enabled,
        lease_ttl,
        instance,
    }
}

/// Host name and process id: unique among instances sharing a database.
fn default_instance() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tallyd".into());
    format!("{host}-{}", std::process::id())
}

pub(super) fn validate_http(raw: RawHttp, issues: &mut Issues) -> HttpConfig {
    issues.unknown_keys("http", &raw.unknown);
    let listen = address(
        issues,
        "http.listen",
        raw.listen,
        HttpConfig::default().listen,
    );
    HttpConfig { listen }
}

/// An `address:port` at `key`, `default` when absent or bad (reported).
pub(super) fn address(
    issues: &mut Issues,
    key: &str,
    value: Option<serde_json::Value>,
    default: SocketAddr,
) -> SocketAddr {
    match issues.string(key, value) {
        None => default,
        Some(text) => text.parse::<SocketAddr>().unwrap_or_else(|_| {
            issues.push(
                key,
                format!("not an address:port, e.g. \"{default}\": {text:?}"),
            );
            default
        }),
    }
}

pub(super) fn validate_daemon(
    raw: RawDaemon,
    collections: &[CollectionConfig],
    issues: &mut Issues,
) -> DaemonConfig {
    issues.unknown_keys("daemon", &raw.unknown);
    let defaults = DaemonConfig::default();
    let state_collection = issues
        .string("daemon.state_collection", raw.state_collection)
        .unwrap_or(defaults.state_collection);
    check_collection_name("daemon.state_collection", &state_collection, issues);
    if collections.iter().any(|c| c.name == state_collection) {
        issues.push(
            "daemon.state_collection",
            format!("{state_collection:?} is also a counter collection"),
        );
    }
    let shutdown_timeout = issues.duration(
        "daemon.shutdown_timeout",
        raw.shutdown_timeout,
        defaults.shutdown_timeout,
    );
    DaemonConfig {
        state_collection,
        shutdown_timeout,
    }
}

fn serialize_timezone<S: serde::Serializer>(tz: &chrono_tz::Tz, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(tz.name())
}

pub(super) fn validate_log(
    raw: RawLog,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> LogConfig {
    issues.unknown_keys("log", &raw.unknown);
    let level = issues
        .string("log.level", raw.level)
        .unwrap_or_else(|| "info".into());
    if let Err(problem) = check_filter(&level) {
        issues.push("log.level", format!("{problem}; {FILTER_FORMS}"));
    }
    let rust_log = env
        .get("RUST_LOG")
        .filter(|directives| !directives.trim().is_empty())
        .cloned();
    if let Some(directives) = &rust_log
        && let Err(problem) = check_filter(directives)
    {
        issues.push("RUST_LOG", format!("{problem}; {FILTER_FORMS}"));
    }
    let format = match issues.string("log.format", raw.format).as_deref() {
        None | Some("text") => LogFormat::Text,
        Some("json") => LogFormat::Json,
        Some(other) => {
            issues.push(
                "log.format",
                format!("expected \"text\" or \"json\", found {other:?}"),
            );
            LogFormat::Text
        }
    };
    LogConfig {
        level,
        format,
        rust_log,
    }
}

/// What a log filter may say, for the messages that refuse one.
const FILTER_FORMS: &str = "write comma-separated directives, each a level (trace, debug, info, \
                            warn, error, off) or target=level, e.g. \"info,tally::reconcile=debug\"";

/// The levels a directive may name, in any case.
const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// Checks a filter directive by directive: each is a level, or
/// `target=level` with a Rust path as the target. (tracing would take a
/// misspelt level as a target and silently log nothing.)
fn check_filter(filter: &str) -> Result<(), String> {
    let is_level = |word: &str| LEVELS.iter().any(|l| l.eq_ignore_ascii_case(word.trim()));
    if filter.trim().is_empty() {
        return Err("empty".into());
    }
    for directive in filter.split(',') {
        let directive = directive.trim();
        match directive.split_once('=') {
            _ if directive.is_empty() => {
                return Err(format!("an empty directive in {filter:?}"));
            }
            None if is_level(directive) => {}
            None => {
                return Err(format!(
                    "{directive:?} is not a level (for a target, write target=level)"
                ));
            }
            Some((target, level)) => {
                if !is_rust_path(target.trim()) {
                    return Err(format!("{target:?} in {directive:?} is not a Rust path"));
                }
                if !is_level(level) {
                    return Err(format!("{level:?} in {directive:?} is not a level"));
                }
            }
        }
    }
    Ok(())
}

/// `name` or `name::name…`, each name an identifier.
fn is_rust_path(target: &str) -> bool {
    target.split("::").all(|segment| {
        let mut chars = segment.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}
