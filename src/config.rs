//! Configuration: one TOML file plus `TALLYD__SECTION__KEY` environment
//! overrides, checked as a whole.
//!
//! Loading has two steps. The file and the environment are merged by the
//! `config` crate and deserialized into a raw shape whose leaves are untyped
//! ([`raw`]); validation then converts every key into the typed [`Config`],
//! collecting **every** problem (unknown keys, wrong types, bad values,
//! duplicates) into one [`ConfigErrors`] instead of stopping at the first.
//! The binary exits with [`EXIT_CONFIG`] (78, `EX_CONFIG`) when there is any.

mod field;
mod raw;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mongodb::options::{ClientOptions, ConnectionString};
use serde::Serialize;
use serde_json::Value;

use crate::redact::{SecretString, Secrets, redact_uri};
use field::Issues;
use raw::{RawCollection, RawConfig};

/// Where `tallyd` looks for its file when `--config` is not given. A missing
/// file there is not an error (the environment may carry everything); a
/// missing file named with `--config` is.
pub const DEFAULT_PATH: &str = "/etc/tally/tallyd.toml";

/// Exit code for a bad configuration (`EX_CONFIG` from `sysexits.h`);
/// systemd units use it to stop restarting a daemon that cannot start.
pub const EXIT_CONFIG: u8 = 78;

pub(crate) const ENV_PREFIX: &str = "TALLYD";
pub(crate) const ENV_SEPARATOR: &str = "__";

/// Default name of the field holding a counter's value.
pub const DEFAULT_COUNTER_FIELD: &str = "counter";
/// Default name of the field holding a counter's pending entries.
pub const DEFAULT_PENDING_FIELD: &str = "pending";

/// The validated configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// `[mongodb]`: how to reach the server.
    pub mongodb: MongoConfig,
    /// `[[collections]]`: the counter collections tally works on.
    pub collections: Vec<CollectionConfig>,
    /// `[writer]`: how the library's increments behave.
    pub writer: WriterConfig,
    /// `[reconcile]`: how leftover pending tokens are folded.
    pub reconcile: ReconcileConfig,
    /// `[sequences]`: where sequences live.
    pub sequences: SequenceConfig,
    /// `[schedule]`: when the daemon folds.
    pub schedule: ScheduleConfig,
    /// `[monitor]`: the daemon's live view of pending tokens.
    pub monitor: MonitorConfig,
    /// `[alerts]`: what the daemon alerts on, and where to.
    pub alerts: AlertsConfig,
    /// `[ha]`: several daemon instances, one active.
    pub ha: HaConfig,
    /// `[http]`: metrics and health endpoints.
    pub http: HttpConfig,
    /// `[daemon]`: the daemon's own state and shutdown.
    pub daemon: DaemonConfig,
    /// `[log]`: what is logged and how.
    pub log: LogConfig,
}

/// `[mongodb]`: how to reach the server. Values set here override the same
/// options in the URI; options not set here keep the URI's value, then
/// tally's default.
#[derive(Debug, Clone, Serialize)]
pub struct MongoConfig {
    /// The connection string (`mongodb://` or, in builds with the `srv`
    /// feature, `mongodb+srv://`). Required. Its password never appears in
    /// logs, errors or output.
    #[serde(serialize_with = "serialize_uri")]
    pub uri: SecretString,
    /// The database holding the counter collections and tally's own state.
    /// Default: the URI's database; one of the two is required.
    pub database: String,
    /// The application name the server sees (`appName`). Default: `tallyd`.
    pub app_name: String,
    /// How long to wait for a TCP connection (`connectTimeoutMS`).
    /// Default: 10s.
    #[serde(serialize_with = "serialize_duration")]
    pub connect_timeout: Duration,
    /// How long an operation waits for a usable server before failing
    /// (`serverSelectionTimeoutMS`). Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub server_selection_timeout: Duration,
    /// Connections idle for longer are closed by the driver
    /// (`maxIdleTimeMS`). Default: 4m, below the 5 minutes after which many
    /// servers and firewalls cut idle connections.
    #[serde(serialize_with = "serialize_duration")]
    pub max_idle_time: Duration,
    /// How long tally waits for one attempt of an operation (server
    /// selection included) before abandoning it as a lost reply — a
    /// transient failure, retried once where that is safe. The driver has no
    /// socket timeout; this bounds a hung connection. Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub attempt_timeout: Duration,
}

impl MongoConfig {
    /// The secrets to scrub from messages that mention this connection.
    pub fn secrets(&self) -> Secrets {
        Secrets::new(self.uri.expose(), [])
    }

    /// Applies this section's settings to options parsed from the URI.
    pub fn apply_to(&self, options: &mut ClientOptions) {
        options.app_name = Some(self.app_name.clone());
        options.connect_timeout = Some(self.connect_timeout);
        options.server_selection_timeout = Some(self.server_selection_timeout);
        options.max_idle_time = Some(self.max_idle_time);
    }
}

/// One `[[collections]]` entry: a counter collection and its field names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CollectionConfig {
    /// The collection's name.
    pub name: String,
    /// The field holding the counter's value. Default: `counter`.
    pub counter_field: String,
    /// The field holding the pending entries. Default: `pending`.
    pub pending_field: String,
    /// This collection's fold grace, overriding `[reconcile] grace`.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_optional_duration"
    )]
    pub grace: Option<Duration>,
    /// This collection's fold batch size, overriding `[reconcile]
    /// batch_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u32>,
}

impl CollectionConfig {
    /// A collection with the default field names.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            counter_field: DEFAULT_COUNTER_FIELD.into(),
            pending_field: DEFAULT_PENDING_FIELD.into(),
            grace: None,
            batch_size: None,
        }
    }

    /// The same collection with other field names.
    pub fn with_fields(mut self, counter: impl Into<String>, pending: impl Into<String>) -> Self {
        self.counter_field = counter.into();
        self.pending_field = pending.into();
        self
    }
}

/// `[writer]`: how the library's increments behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WriterConfig {
    /// Step 1 of an increment is never (re)sent for a token older than this,
    /// so a token can never be re-added after the daemon may have folded it.
    /// Must stay below the daemon's `grace`. Default: 60s.
    #[serde(serialize_with = "serialize_duration")]
    pub retry_horizon: Duration,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            retry_horizon: DEFAULT_RETRY_HORIZON,
        }
    }
}

/// Default retry horizon.
pub const DEFAULT_RETRY_HORIZON: Duration = Duration::from_secs(60);
/// The shortest retry horizon: a token's timestamp has one-second
/// resolution, so a fresh token may already look a second old.
pub const MIN_RETRY_HORIZON: Duration = Duration::from_secs(2);

/// `[reconcile]`: how leftover pending tokens are folded into their
/// counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReconcileConfig {
    /// Only tokens older than this are folded; younger ones belong to
    /// writers still between their two steps. Must exceed `[writer]
    /// retry_horizon` by more than the clock skew between writers and the
    /// server. Default: 15m.
    #[serde(serialize_with = "serialize_duration")]
    pub grace: Duration,
    /// How many documents one fold update covers: work between two points
    /// where a run can stop (shutdown) and report progress. Default: 100.
    pub batch_size: u32,
}

/// Default fold grace.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(15 * 60);
/// Default fold batch size.
pub const DEFAULT_BATCH_SIZE: u32 = 100;

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            grace: DEFAULT_GRACE,
            batch_size: DEFAULT_BATCH_SIZE,
        }
    }
}

/// Everything the fold needs to know about one collection: its fields and
/// its effective grace and batch size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldTarget {
    /// The collection and its field names.
    pub spec: CollectionConfig,
    /// Tokens older than this are folded.
    pub grace: Duration,
    /// Documents per fold update.
    pub batch_size: u32,
}

/// `[schedule]`: when the daemon folds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleConfig {
    /// A cron expression with a seconds field first, as
    /// tokio-cron-scheduler reads it: `sec min hour day-of-month month
    /// day-of-week`. Default: `0 30 3 * * *` (03:30 every night).
    pub cron: String,
    /// The IANA time zone the expression is read in (`UTC`,
    /// `Europe/Berlin`). Default: `UTC`.
    #[serde(serialize_with = "serialize_timezone")]
    pub timezone: chrono_tz::Tz,
    /// At start-up, run at once when a scheduled run was missed while the
    /// daemon was down (the last successful run is older than the latest
    /// scheduled time). Default: true.
    pub catch_up: bool,
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
pub const DEFAULT_CRON: &str = "0 30 3 * * *";

/// Parses a cron expression with a leading seconds field.
pub fn parse_cron(expression: &str) -> Result<croner::Cron, String> {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .dom_and_dow(true)
        .build()
        .parse(expression)
        .map_err(|err| err.to_string())
}

/// `[monitor]`: the daemon's live view of pending tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MonitorConfig {
    /// Watch the collections through change streams. Without it the view is
    /// refreshed only by the periodic scan. Default: true.
    pub enabled: bool,
    /// How often a full scan (the fold's report) rebuilds the view, backing
    /// the stream up. Default: 5m.
    #[serde(serialize_with = "serialize_duration")]
    pub scan_interval: Duration,
    /// How often the change stream's resume token is saved (it is also
    /// saved at shutdown). Default: 10s.
    #[serde(serialize_with = "serialize_duration")]
    pub save_interval: Duration,
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

/// `[alerts]`: what the daemon alerts on, and where to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AlertsConfig {
    /// A pending token older than this is stuck: its writer is gone and it
    /// waits for the fold. Must exceed `[writer] retry_horizon`. Default:
    /// 30m.
    #[serde(serialize_with = "serialize_duration")]
    pub stuck_after: Duration,
    /// Alert when a document's pending array holds more entries than this
    /// (a writer that never runs step 2). Default: 1000.
    pub max_pending: u64,
    /// Fold documents with stuck tokens at once instead of waiting for the
    /// schedule (only tokens older than the grace are folded). Default:
    /// false.
    pub repair: bool,
    /// Alert when the change stream of a collection has been down for this
    /// long. Default: 5m.
    #[serde(serialize_with = "serialize_duration")]
    pub monitor_down_after: Duration,
    /// `[alerts.webhook]`: where alerts are POSTed, besides the log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook: Option<WebhookConfig>,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            stuck_after: Duration::from_secs(30 * 60),
            max_pending: 1000,
            repair: false,
            monitor_down_after: Duration::from_secs(300),
            webhook: None,
        }
    }
}

/// `[alerts.webhook]`: alerts POSTed as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WebhookConfig {
    /// The URL (`http://` or `https://`). Treated as a secret — many
    /// webhook URLs carry their token — and shown as scheme and host only.
    #[serde(serialize_with = "serialize_webhook_url")]
    pub url: SecretString,
    /// The name of an environment variable holding the value of the
    /// `Authorization` header (e.g. `Bearer …`). Optional; the variable must
    /// be set when it is named. The value is never shown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_header_env: Option<String>,
    /// The `Authorization` header's value, read from `auth_header_env`.
    #[serde(skip)]
    pub auth_header: Option<SecretString>,
    /// How long one delivery attempt may take. Default: 5s.
    #[serde(serialize_with = "serialize_duration")]
    pub timeout: Duration,
    /// Attempts per notification (retried with backoff) before it is given
    /// up and logged. Default: 8.
    pub max_attempts: u32,
}

/// `[ha]`: several daemon instances, one active.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HaConfig {
    /// Take a lease in the state collection; only its holder folds and
    /// alerts, the others stand by. Default: false (always active).
    pub enabled: bool,
    /// How long the lease lasts without renewal; the holder renews it every
    /// third of that. A standby takes over within the TTL plus one renewal
    /// after the holder dies. Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub lease_ttl: Duration,
    /// This instance's name in the lease. Default: host name and process
    /// id.
    pub instance: String,
}

/// `[http]`: metrics and health endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HttpConfig {
    /// The address `/metrics`, `/healthz` and `/readyz` listen on. Default:
    /// `127.0.0.1:9187`.
    pub listen: SocketAddr,
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
pub struct DaemonConfig {
    /// The collection holding the daemon's state: last successful runs,
    /// change-stream resume tokens, the lease. Default: `tally_state`.
    pub state_collection: String,
    /// At SIGTERM/SIGINT, how long a running fold batch may take to finish
    /// before the daemon exits anyway. Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub shutdown_timeout: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            state_collection: "tally_state".into(),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// `[sequences]`: where sequences live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SequenceConfig {
    /// The counters collection: one document `{_id: name, <field>: n}` per
    /// sequence. Default: `counters`, as in MongoDB's tutorial.
    pub collection: String,
    /// The field holding a sequence's last number. Default: `seq`.
    pub field: String,
}

impl Default for SequenceConfig {
    fn default() -> Self {
        Self {
            collection: "counters".into(),
            field: "seq".into(),
        }
    }
}

impl SequenceConfig {
    /// Sequences in another collection, with the default field.
    pub fn in_collection(collection: impl Into<String>) -> Self {
        Self {
            collection: collection.into(),
            ..Self::default()
        }
    }
}

/// `[log]`: what is logged and how. Logs go to standard error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogConfig {
    /// A tracing filter: a level (`info`) or directives
    /// (`info,tally::reconcile=debug`). `RUST_LOG`, when set, wins.
    /// Default: `info`.
    pub level: String,
    /// `text` (readable on a terminal) or `json` (one object per line).
    /// Default: `text`.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines, coloured on a terminal.
    Text,
    /// One JSON object per line.
    Json,
}

/// One problem with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// The dotted key (`mongodb.uri`, `collections[1].name`), or `--config`
    /// for the file itself.
    pub key: String,
    /// What is wrong and, where it helps, how to fix it.
    pub message: String,
}

/// Every problem found in a configuration.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors {
    /// The problems, in the order of the file's sections.
    pub issues: Vec<ConfigIssue>,
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.issues.len();
        write!(
            f,
            "invalid configuration ({n} problem{}):",
            if n == 1 { "" } else { "s" }
        )?;
        for issue in &self.issues {
            write!(f, "\n  {}: {}", issue.key, issue.message)?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    fn single(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            issues: vec![ConfigIssue {
                key: key.into(),
                message: message.into(),
            }],
        }
    }
}

impl Config {
    /// Loads the file (`None`: [`DEFAULT_PATH`], which may be missing) and
    /// applies `TALLYD__…` overrides from `env` (pass `std::env::vars()`;
    /// tests pass their own).
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigErrors> {
        let (path, required): (PathBuf, bool) = match path {
            Some(p) => (p.to_owned(), true),
            None => (PathBuf::from(DEFAULT_PATH), false),
        };
        let file = match std::fs::read_to_string(&path) {
            Ok(text) => Some(text),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && !required => None,
            Err(err) => {
                return Err(ConfigErrors::single(
                    "--config",
                    format!("cannot read {}: {err}", path.display()),
                ));
            }
        };
        Self::from_sources(file.as_deref(), &path.display().to_string(), env)
    }

    /// Builds the configuration from TOML text and environment overrides.
    pub fn from_toml(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigErrors> {
        Self::from_sources(Some(text), "(inline)", env)
    }

    fn from_sources(
        text: Option<&str>,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigErrors> {
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
        let all_env: HashMap<String, String> = env.into_iter().collect();
        let env: HashMap<String, String> = all_env
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let from_env: BTreeSet<String> = env
            .keys()
            .map(|k| k[prefix.len()..].to_lowercase().replace(ENV_SEPARATOR, "."))
            .collect();
        let mut builder = config::Config::builder();
        if let Some(text) = text {
            builder = builder.add_source(config::File::from_str(text, config::FileFormat::Toml));
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator(ENV_SEPARATOR)
                .separator(ENV_SEPARATOR)
                .source(Some(env.into_iter().collect())),
        );
        let merged = builder
            .build()
            .map_err(|err| ConfigErrors::single(origin, format!("cannot parse: {err}")))?;
        let raw: RawConfig = merged
            .try_deserialize()
            .map_err(|err| ConfigErrors::single(origin, format!("cannot read: {err}")))?;
        let mut issues = Issues::new(from_env);
        let config = validate(raw, &all_env, &mut issues);
        if issues.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors {
                issues: issues.into_list(),
            })
        }
    }

    /// The settings for a collection: its `[[collections]]` entry, or the
    /// default field names for a collection not listed.
    pub fn collection(&self, name: &str) -> CollectionConfig {
        self.collections
            .iter()
            .find(|c| c.name == name)
            .cloned()
            .unwrap_or_else(|| CollectionConfig::new(name))
    }

    /// The effective configuration as TOML, with every secret masked.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|err| format!("# cannot render: {err}\n"))
    }

    /// The fold settings for a collection: its overrides, else
    /// `[reconcile]`'s.
    pub fn fold_target(&self, name: &str) -> FoldTarget {
        let spec = self.collection(name);
        FoldTarget {
            grace: spec.grace.unwrap_or(self.reconcile.grace),
            batch_size: spec.batch_size.unwrap_or(self.reconcile.batch_size),
            spec,
        }
    }

    /// Every secret value in the configuration: the URI's password, the
    /// webhook URL and its auth header.
    pub fn secrets(&self) -> Secrets {
        let webhook = self.alerts.webhook.as_ref();
        let others = webhook.map(|w| w.url.expose()).into_iter().chain(
            webhook
                .and_then(|w| w.auth_header.as_ref())
                .map(SecretString::expose),
        );
        Secrets::new(self.mongodb.uri.expose(), others)
    }
}

fn validate(raw: RawConfig, env: &HashMap<String, String>, issues: &mut Issues) -> Config {
    issues.unknown_keys("", &raw.unknown);
    let mongodb = validate_mongodb(issues.table("mongodb", raw.mongodb), issues);
    let collections = validate_collections(raw.collections, issues);
    let writer = issues.table("writer", raw.writer);
    issues.unknown_keys("writer", &writer.unknown);
    let retry_horizon = issues.duration(
        "writer.retry_horizon",
        writer.retry_horizon,
        DEFAULT_RETRY_HORIZON,
    );
    if retry_horizon < MIN_RETRY_HORIZON {
        issues.push(
            "writer.retry_horizon",
            format!(
                "must be at least {}: a token's time has one-second resolution",
                humantime::format_duration(MIN_RETRY_HORIZON)
            ),
        );
    }
    let writer = WriterConfig { retry_horizon };
    let reconcile = validate_reconcile(issues.table("reconcile", raw.reconcile), issues);
    check_grace(
        "reconcile.grace",
        reconcile.grace,
        writer.retry_horizon,
        issues,
    );
    for (i, collection) in collections.iter().enumerate() {
        if let Some(grace) = collection.grace {
            check_grace(
                &format!("collections[{i}].grace"),
                grace,
                writer.retry_horizon,
                issues,
            );
        }
    }
    let sequences = validate_sequences(issues.table("sequences", raw.sequences), issues);
    let schedule = validate_schedule(issues.table("schedule", raw.schedule), issues);
    let monitor = validate_monitor(issues.table("monitor", raw.monitor), issues);
    let alerts = validate_alerts(
        issues.table("alerts", raw.alerts),
        writer.retry_horizon,
        env,
        issues,
    );
    let ha = validate_ha(issues.table("ha", raw.ha), issues);
    let http = validate_http(issues.table("http", raw.http), issues);
    let daemon = validate_daemon(issues.table("daemon", raw.daemon), &collections, issues);
    let log = validate_log(issues.table("log", raw.log), issues);
    Config {
        mongodb,
        collections,
        writer,
        reconcile,
        sequences,
        schedule,
        monitor,
        alerts,
        ha,
        http,
        daemon,
        log,
    }
}

fn validate_schedule(raw: raw::RawSchedule, issues: &mut Issues) -> ScheduleConfig {
    issues.unknown_keys("schedule", &raw.unknown);
    let defaults = ScheduleConfig::default();
    let cron = issues
        .string("schedule.cron", raw.cron)
        .unwrap_or(defaults.cron);
    if let Err(err) = parse_cron(&cron) {
        issues.push(
            "schedule.cron",
            format!(
                "not a cron expression with seconds first ({err}): {cron:?}; e.g. \"0 30 3 * * *\""
            ),
        );
    }
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
    let catch_up = issues.boolean("schedule.catch_up", raw.catch_up, defaults.catch_up);
    ScheduleConfig {
        cron,
        timezone,
        catch_up,
    }
}

fn validate_monitor(raw: raw::RawMonitor, issues: &mut Issues) -> MonitorConfig {
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

fn validate_alerts(
    raw: raw::RawAlerts,
    retry_horizon: Duration,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> AlertsConfig {
    issues.unknown_keys("alerts", &raw.unknown);
    let defaults = AlertsConfig::default();
    let stuck_after = issues.duration("alerts.stuck_after", raw.stuck_after, defaults.stuck_after);
    if stuck_after <= retry_horizon {
        issues.push(
            "alerts.stuck_after",
            format!(
                "must be longer than [writer] retry_horizon ({}): younger tokens may still be \
                 completed by their writers",
                humantime::format_duration(retry_horizon)
            ),
        );
    }
    let max_pending = issues
        .optional_integer("alerts.max_pending", raw.max_pending, 1, 1_000_000)
        .unwrap_or(defaults.max_pending);
    let repair = issues.boolean("alerts.repair", raw.repair, defaults.repair);
    let monitor_down_after = issues.duration(
        "alerts.monitor_down_after",
        raw.monitor_down_after,
        defaults.monitor_down_after,
    );
    let webhook = match raw.webhook {
        None => None,
        Some(section) => {
            let raw = issues.table::<raw::RawWebhook>("alerts.webhook", Some(section));
            validate_webhook(raw, env, issues)
        }
    };
    AlertsConfig {
        stuck_after,
        max_pending,
        repair,
        monitor_down_after,
        webhook,
    }
}

fn validate_webhook(
    raw: raw::RawWebhook,
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

/// The shortest lease: it is renewed every third of its TTL.
const MIN_LEASE_TTL: Duration = Duration::from_secs(3);

fn validate_ha(raw: raw::RawHa, issues: &mut Issues) -> HaConfig {
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

fn validate_http(raw: raw::RawHttp, issues: &mut Issues) -> HttpConfig {
    issues.unknown_keys("http", &raw.unknown);
    let listen = match issues.string("http.listen", raw.listen) {
        None => HttpConfig::default().listen,
        Some(text) => text.parse::<SocketAddr>().unwrap_or_else(|_| {
            issues.push(
                "http.listen",
                format!("not an address:port, e.g. \"127.0.0.1:9187\": {text:?}"),
            );
            HttpConfig::default().listen
        }),
    };
    HttpConfig { listen }
}

fn validate_daemon(
    raw: raw::RawDaemon,
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

/// A webhook URL as it may be shown: scheme and host, the rest masked (a
/// webhook's path or query often is its secret).
pub fn redact_webhook_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => match parsed.host_str() {
            Some(host) => {
                let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
                format!("{}://{host}{port}/{}", parsed.scheme(), crate::redact::MASK)
            }
            None => crate::redact::MASK.to_owned(),
        },
        Err(_) => crate::redact::MASK.to_owned(),
    }
}

fn serialize_timezone<S: serde::Serializer>(tz: &chrono_tz::Tz, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(tz.name())
}

fn serialize_webhook_url<S: serde::Serializer>(
    url: &SecretString,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_webhook_url(url.expose()))
}

fn validate_reconcile(raw: raw::RawReconcile, issues: &mut Issues) -> ReconcileConfig {
    issues.unknown_keys("reconcile", &raw.unknown);
    ReconcileConfig {
        grace: issues.duration("reconcile.grace", raw.grace, DEFAULT_GRACE),
        batch_size: issues
            .optional_integer("reconcile.batch_size", raw.batch_size, 1, MAX_BATCH_SIZE)
            .map_or(DEFAULT_BATCH_SIZE, |n| n as u32),
    }
}

/// The largest fold batch: keeps one update's `$in` list and its work
/// bounded.
const MAX_BATCH_SIZE: u64 = 10_000;

/// A token must never be folded while its writer may still re-send step 1.
fn check_grace(key: &str, grace: Duration, retry_horizon: Duration, issues: &mut Issues) {
    if grace <= retry_horizon {
        issues.push(
            key,
            format!(
                "must be longer than [writer] retry_horizon ({}), or a token could be folded \
                 while its writer may still re-send it",
                humantime::format_duration(retry_horizon)
            ),
        );
    }
}

fn validate_mongodb(raw: raw::RawMongo, issues: &mut Issues) -> MongoConfig {
    issues.unknown_keys("mongodb", &raw.unknown);
    let uri = issues.required_string("mongodb.uri", raw.uri);
    let parsed = uri.as_deref().and_then(|uri| parse_uri(uri, issues));
    let from_uri = |f: fn(&ConnectionString) -> Option<Duration>| parsed.as_ref().and_then(f);

    let database = issues
        .string("mongodb.database", raw.database)
        .or_else(|| parsed.as_ref().and_then(|p| p.default_database.clone()));
    match &database {
        Some(name) => check_database_name(name, issues),
        None if parsed.is_some() => issues.push(
            "mongodb.database",
            "missing (set it, or name a database in the URI's path)",
        ),
        None => {}
    }
    let app_name = issues
        .string("mongodb.app_name", raw.app_name)
        .or_else(|| parsed.as_ref().and_then(|p| p.app_name.clone()))
        .unwrap_or_else(|| "tallyd".into());
    if app_name.is_empty() {
        issues.push("mongodb.app_name", "must not be empty");
    }
    let connect_timeout = issues.duration(
        "mongodb.connect_timeout",
        raw.connect_timeout,
        from_uri(|p| p.connect_timeout).unwrap_or(Duration::from_secs(10)),
    );
    let server_selection_timeout = issues.duration(
        "mongodb.server_selection_timeout",
        raw.server_selection_timeout,
        from_uri(|p| p.server_selection_timeout).unwrap_or(Duration::from_secs(30)),
    );
    let max_idle_time = issues.duration(
        "mongodb.max_idle_time",
        raw.max_idle_time,
        from_uri(|p| p.max_idle_time).unwrap_or(Duration::from_secs(240)),
    );
    let attempt_timeout = issues.duration(
        "mongodb.attempt_timeout",
        raw.attempt_timeout,
        crate::store::DEFAULT_ATTEMPT_TIMEOUT,
    );
    MongoConfig {
        uri: SecretString::new(uri.unwrap_or_default()),
        database: database.unwrap_or_default(),
        app_name,
        connect_timeout,
        server_selection_timeout,
        max_idle_time,
        attempt_timeout,
    }
}

/// Parses the URI without any I/O, reporting problems with the password
/// scrubbed.
fn parse_uri(uri: &str, issues: &mut Issues) -> Option<ConnectionString> {
    if uri.starts_with("mongodb+srv://") && !cfg!(feature = "srv") {
        issues.push(
            "mongodb.uri",
            "mongodb+srv:// needs DNS SRV support: build tallyd with `--features srv`, or list \
             the hosts with mongodb://",
        );
        return None;
    }
    match ConnectionString::parse(uri) {
        Ok(parsed) => Some(parsed),
        Err(err) => {
            let secrets = Secrets::new(uri, []);
            let reason = match err.kind.as_ref() {
                mongodb::error::ErrorKind::InvalidArgument { message, .. } => message.clone(),
                _ => err.to_string(),
            };
            issues.push(
                "mongodb.uri",
                format!(
                    "malformed connection string {}: {}",
                    redact_uri(uri),
                    secrets.scrub(&reason)
                ),
            );
            None
        }
    }
}

fn check_database_name(name: &str, issues: &mut Issues) {
    const ILLEGAL: &[char] = &[
        '/', '\\', '.', ' ', '"', '$', '*', '<', '>', ':', '|', '?', '\0',
    ];
    if name.is_empty() {
        issues.push("mongodb.database", "must not be empty");
    } else if let Some(c) = name.chars().find(|c| ILLEGAL.contains(c)) {
        issues.push(
            "mongodb.database",
            format!("{name:?} contains {c:?}, which database names cannot"),
        );
    } else if name.len() > 63 {
        issues.push("mongodb.database", "longer than 63 bytes");
    }
}

fn validate_collections(raw: Option<Value>, issues: &mut Issues) -> Vec<CollectionConfig> {
    let entries = match raw {
        None => return Vec::new(),
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            issues.push(
                "collections",
                format!(
                    "expected [[collections]] tables, found {}",
                    field::describe(&other)
                ),
            );
            return Vec::new();
        }
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let key = format!("collections[{i}]");
        let raw: RawCollection = match entry {
            Value::Object(_) => match serde_json::from_value(entry) {
                Ok(raw) => raw,
                Err(err) => {
                    issues.push(key, format!("cannot read: {err}"));
                    continue;
                }
            },
            other => {
                issues.push(
                    key,
                    format!("expected a table, found {}", field::describe(&other)),
                );
                continue;
            }
        };
        issues.unknown_keys(&key, &raw.unknown);
        let name = issues.required_string(&format!("{key}.name"), raw.name);
        if let Some(name) = &name {
            check_collection_name(&format!("{key}.name"), name, issues);
            if let Some(first) = seen.insert(name.clone(), i) {
                issues.push(
                    format!("{key}.name"),
                    format!("duplicate collection {name:?} (also collections[{first}])"),
                );
            }
        }
        let counter_field = issues
            .string(&format!("{key}.counter_field"), raw.counter_field)
            .unwrap_or_else(|| DEFAULT_COUNTER_FIELD.into());
        let pending_field = issues
            .string(&format!("{key}.pending_field"), raw.pending_field)
            .unwrap_or_else(|| DEFAULT_PENDING_FIELD.into());
        check_field_name(&format!("{key}.counter_field"), &counter_field, issues);
        check_field_name(&format!("{key}.pending_field"), &pending_field, issues);
        if counter_field == pending_field {
            issues.push(
                format!("{key}.pending_field"),
                format!("must differ from counter_field (both are {counter_field:?})"),
            );
        }
        let grace = issues.optional_duration(&format!("{key}.grace"), raw.grace);
        let batch_size = issues
            .optional_integer(
                &format!("{key}.batch_size"),
                raw.batch_size,
                1,
                MAX_BATCH_SIZE,
            )
            .map(|n| n as u32);
        out.push(CollectionConfig {
            name: name.unwrap_or_default(),
            counter_field,
            pending_field,
            grace,
            batch_size,
        });
    }
    out
}

fn check_collection_name(key: &str, name: &str, issues: &mut Issues) {
    if name.is_empty() {
        issues.push(key, "must not be empty");
    } else if name.contains('$') || name.contains('\0') {
        issues.push(
            key,
            format!("{name:?}: collection names cannot contain '$' or NUL"),
        );
    } else if name.starts_with("system.") {
        issues.push(
            key,
            format!("{name:?}: system collections are not counter collections"),
        );
    }
}

/// Field names are used as top-level paths in updates, so they cannot be
/// operators, dotted paths, or `_id`.
fn check_field_name(key: &str, name: &str, issues: &mut Issues) {
    if name.is_empty() {
        issues.push(key, "must not be empty");
    } else if name.starts_with('$') {
        issues.push(
            key,
            format!("{name:?} starts with '$', which field names cannot"),
        );
    } else if name.contains('.') {
        issues.push(
            key,
            format!("{name:?} contains '.'; give a top-level field name"),
        );
    } else if name.contains('\0') {
        issues.push(key, "contains NUL");
    } else if name == "_id" {
        issues.push(key, "cannot be _id");
    }
}

fn validate_sequences(raw: raw::RawSequences, issues: &mut Issues) -> SequenceConfig {
    issues.unknown_keys("sequences", &raw.unknown);
    let defaults = SequenceConfig::default();
    let collection = issues
        .string("sequences.collection", raw.collection)
        .unwrap_or(defaults.collection);
    check_collection_name("sequences.collection", &collection, issues);
    let field = issues
        .string("sequences.field", raw.field)
        .unwrap_or(defaults.field);
    check_field_name("sequences.field", &field, issues);
    SequenceConfig { collection, field }
}

fn validate_log(raw: raw::RawLog, issues: &mut Issues) -> LogConfig {
    issues.unknown_keys("log", &raw.unknown);
    let level = issues
        .string("log.level", raw.level)
        .unwrap_or_else(|| "info".into());
    if let Err(err) = tracing_subscriber::EnvFilter::builder().parse(&level) {
        issues.push(
            "log.level",
            format!("not a level or filter ({err}): {level:?}"),
        );
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
    LogConfig { level, format }
}

fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

fn serialize_optional_duration<S: serde::Serializer>(
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
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const MINIMAL: &str = r#"
        [mongodb]
        uri = "mongodb://localhost:27017"
        database = "app"
    "#;

    #[test]
    fn minimal_config_gets_defaults() {
        let config = Config::from_toml(MINIMAL, []).unwrap();
        assert_eq!(config.mongodb.database, "app");
        assert_eq!(config.mongodb.app_name, "tallyd");
        assert_eq!(config.mongodb.max_idle_time, Duration::from_secs(240));
        assert_eq!(config.writer.retry_horizon, Duration::from_secs(60));
        assert_eq!(config.log.format, LogFormat::Text);
        assert!(config.collections.is_empty());
    }

    #[test]
    fn environment_overrides_the_file() {
        let config = Config::from_toml(
            MINIMAL,
            env(&[
                ("TALLYD__MONGODB__URI", "mongodb://other:27018/"),
                ("TALLYD__MONGODB__DATABASE", "metrics"),
                ("TALLYD__WRITER__RETRY_HORIZON", "30s"),
                ("TALLYD_WEBHOOK_TOKEN", "not a config key"),
                ("PATH", "/bin"),
            ]),
        )
        .unwrap();
        assert_eq!(config.mongodb.uri.expose(), "mongodb://other:27018/");
        assert_eq!(config.mongodb.database, "metrics");
        assert_eq!(config.writer.retry_horizon, Duration::from_secs(30));
    }

    #[test]
    fn environment_alone_is_enough() {
        let config = Config::load(
            None,
            env(&[
                ("TALLYD__MONGODB__URI", "mongodb://h/"),
                ("TALLYD__MONGODB__DATABASE", "d"),
            ]),
        );
        // The default file is normally absent on build machines; if it is
        // there it must at least not break this.
        if !Path::new(DEFAULT_PATH).exists() {
            assert_eq!(config.unwrap().mongodb.database, "d");
        }
    }

    #[test]
    fn the_database_may_come_from_the_uri() {
        let config = Config::from_toml("[mongodb]\nuri = \"mongodb://h/fromuri\"\n", []).unwrap();
        assert_eq!(config.mongodb.database, "fromuri");
    }

    #[test]
    fn uri_options_are_kept_unless_overridden() {
        let config = Config::from_toml(
            "[mongodb]\nuri = \"mongodb://h/d?appName=web&maxIdleTimeMS=1000\"\n",
            [],
        )
        .unwrap();
        assert_eq!(config.mongodb.app_name, "web");
        assert_eq!(config.mongodb.max_idle_time, Duration::from_secs(1));
    }

    #[test]
    fn a_named_file_must_exist() {
        let err = Config::load(Some(Path::new("/nonexistent/tallyd.toml")), []).unwrap_err();
        assert_eq!(err.issues[0].key, "--config");
    }

    #[test]
    fn every_bad_key_is_reported_at_once() {
        let text = r#"
            surprise = 1
            [mongodb]
            database = "bad.name"
            connect_timeout = 10
            server_selection_timeout = "0s"
            max_idle_time = "-5s"
            colour = "blue"
            [writer]
            retry_horizon = "soon"
            [log]
            format = "xml"
            level = "loud[["
            [[collections]]
            name = "events"
            counter_field = "$count"
            pending_field = "a.b"
            [[collections]]
            name = "events"
            pending_field = "_id"
            [[collections]]
            name = 5
            counter_field = "same"
            pending_field = "same"
        "#;
        let err = Config::from_toml(text, []).unwrap_err();
        let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
        for expected in [
            "surprise",
            "mongodb.uri",
            "mongodb.database",
            "mongodb.connect_timeout",
            "mongodb.server_selection_timeout",
            "mongodb.max_idle_time",
            "mongodb.colour",
            "writer.retry_horizon",
            "log.format",
            "log.level",
            "collections[0].counter_field",
            "collections[0].pending_field",
            "collections[1].name",
            "collections[1].pending_field",
            "collections[2].name",
            "collections[2].pending_field",
        ] {
            assert!(keys.contains(&expected), "{expected} missing from {keys:?}");
        }
        let text = err.to_string();
        assert!(text.starts_with("invalid configuration ("), "{text}");
    }

    #[test]
    fn malformed_uris_are_reported_without_their_password() {
        let text = r#"
            [mongodb]
            uri = "mongodb://alice:hunter2@host:notaport/db"
        "#;
        let err = Config::from_toml(text, []).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("mongodb.uri"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
        let err =
            Config::from_toml("[mongodb]\nuri = \"postgres://u:hunter2@h/d\"\n", []).unwrap_err();
        assert!(!err.to_string().contains("hunter2"));
    }

    #[test]
    fn errors_name_the_environment_variable_that_caused_them() {
        let err = Config::from_toml(
            MINIMAL,
            env(&[
                ("TALLYD__WRITER__RETRY_HORIZON", "0s"),
                ("TALLYD__WRITER__TYPO", "1"),
            ]),
        )
        .unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("set by TALLYD__WRITER__RETRY_HORIZON"),
            "{message}"
        );
        assert!(message.contains("writer.typo"), "{message}");
    }

    #[test]
    fn wrong_section_types_are_reported() {
        let err = Config::from_toml("mongodb = 5\ncollections = \"x\"\n", []).unwrap_err();
        let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
        assert!(keys.contains(&"mongodb"), "{keys:?}");
        assert!(keys.contains(&"collections"), "{keys:?}");
    }

    #[test]
    fn the_effective_config_masks_the_password() {
        let config = Config::from_toml(
            "[mongodb]\nuri = \"mongodb://u:hunter2@h:27017/d?replicaSet=rs\"\n",
            [],
        )
        .unwrap();
        let shown = config.to_redacted_toml();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            shown.contains("mongodb://u:****@h:27017/d?replicaSet=rs"),
            "{shown}"
        );
        assert!(shown.contains("retry_horizon = \"1m\""), "{shown}");
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn daemon_sections_are_checked_too() {
        let text = format!(
            "{MINIMAL}\n[[collections]]\nname = \"views\"\n[schedule]\ncron = \"every night\"\n\
             timezone = \"Mars/Olympus\"\ncatch_up = \"maybe\"\n[alerts]\nstuck_after = \"30s\"\n\
             max_pending = 0\n[alerts.webhook]\nurl = \"ftp://x/hook\"\nauth_header_env = \"HOOK\"\n\
             [ha]\nlease_ttl = \"1s\"\n[http]\nlisten = \"localhost\"\n\
             [daemon]\nstate_collection = \"views\"\n[monitor]\nscan_interval = \"0s\"\n"
        );
        let err = Config::from_toml(&text, []).unwrap_err();
        let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
        for expected in [
            "schedule.cron",
            "schedule.timezone",
            "schedule.catch_up",
            "alerts.stuck_after",
            "alerts.max_pending",
            "alerts.webhook.url",
            "alerts.webhook.auth_header_env",
            "ha.lease_ttl",
            "http.listen",
            "daemon.state_collection",
            "monitor.scan_interval",
        ] {
            assert!(keys.contains(&expected), "{expected} missing from {keys:?}");
        }
    }

    #[test]
    fn the_webhook_secrets_are_read_from_the_environment_and_masked() {
        let text = format!(
            "{MINIMAL}\n[alerts.webhook]\nurl = \"https://hooks.example/T0/SECRETPATH\"\n\
             auth_header_env = \"HOOK\"\n"
        );
        let config = Config::from_toml(&text, env(&[("HOOK", "Bearer s3cret-value")])).unwrap();
        let webhook = config.alerts.webhook.as_ref().unwrap();
        assert_eq!(
            webhook.auth_header.as_ref().unwrap().expose(),
            "Bearer s3cret-value"
        );
        let shown = config.to_redacted_toml();
        assert!(
            !shown.contains("SECRETPATH") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(shown.contains("https://hooks.example/****"), "{shown}");
        let scrubbed = config
            .secrets()
            .scrub("posting to https://hooks.example/T0/SECRETPATH with Bearer s3cret-value");
        assert!(
            !scrubbed.contains("SECRETPATH") && !scrubbed.contains("s3cret"),
            "{scrubbed}"
        );
        let bad = Config::from_toml(&text, env(&[("HOOK", "two\nlines")])).unwrap_err();
        assert_eq!(bad.issues[0].key, "alerts.webhook.auth_header_env");
        assert!(!bad.to_string().contains("two"), "the value is not shown");
    }

    #[test]
    fn unlisted_collections_use_default_fields() {
        let config = Config::from_toml(
            &format!("{MINIMAL}\n[[collections]]\nname = \"a\"\ncounter_field = \"c\"\n"),
            [],
        )
        .unwrap();
        assert_eq!(config.collection("a").counter_field, "c");
        assert_eq!(config.collection("b"), CollectionConfig::new("b"));
    }
}
