//! Configuration: one TOML file plus `TALLYD__SECTION__KEY` environment
//! overrides, checked as a whole.
//!
//! Loading has two steps. The file and the environment are merged by the
//! `config` crate and deserialized into a raw shape whose leaves are untyped
//! (`raw`); validation then converts every key into the typed [`Config`],
//! collecting **every** problem (unknown keys, wrong types, bad values,
//! duplicates) into one [`ConfigErrors`] instead of stopping at the first.
//! The binary exits with [`EXIT_CONFIG`] (78, `EX_CONFIG`) when there is any.
//!
//! The sections the library reads are the library's own types
//! ([`StoreConfig`], [`CollectionConfig`], [`WriterConfig`],
//! [`SequenceConfig`]); this module only fills them in (`library`). The
//! daemon's sections (`daemon`, `alerts`) are its own.

mod alerts;
mod api;
mod daemon;
mod field;
mod ledger;
mod library;
mod margins;
mod raw;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::ledger::EventFoldSettings;
use crate::reconcile::{FoldTarget, Reconciler};
use crate::redact::{SecretString, Secrets};
use crate::store::{Store, StoreConfig};
use crate::write::counter::{CollectionConfig, WriterConfig};
use crate::write::sequence::SequenceConfig;
use field::Issues;
use library::ReconcileConfig;
use raw::RawConfig;

pub(crate) use alerts::{AlertsConfig, WebhookConfig, redact_webhook_url};
pub(crate) use api::{
    ApiConfig, ApiLimits, ApiToken, TOKEN_HASH_PREFIX, TOKEN_VAR_PREFIX, Verb, hash_hex,
    parse_token, token_hash,
};
pub(crate) use daemon::{
    DaemonConfig, HaConfig, HttpConfig, LogConfig, LogFormat, MonitorConfig, ScheduleConfig,
    parse_cron,
};

/// Where `tallyd` looks for its file when `--config` is not given. A missing
/// file there is not an error (the environment may carry everything); a
/// missing file named with `--config` is.
pub(crate) const DEFAULT_PATH: &str = "/etc/tally/tallyd.toml";

/// Exit code for a bad configuration (`EX_CONFIG` from `sysexits.h`);
/// systemd units use it to stop restarting a daemon that cannot start.
pub(crate) const EXIT_CONFIG: u8 = 78;

pub(crate) const ENV_PREFIX: &str = "TALLYD";
pub(crate) const ENV_SEPARATOR: &str = "__";

/// The validated configuration: what `tallyd` reads from its file and
/// environment.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Config {
    /// `[mongodb]`: how to reach the server.
    pub(crate) mongodb: StoreConfig,
    /// `[[collections]]`: the counter collections tally works on.
    pub(crate) collections: Vec<CollectionConfig>,
    /// `[writer]`: how the library's increments behave.
    pub(crate) writer: WriterConfig,
    /// `[reconcile]`: how leftover pending tokens are folded.
    pub(crate) reconcile: ReconcileConfig,
    /// `[sequences]`: where sequences live.
    pub(crate) sequences: SequenceConfig,
    /// `[schedule]`: when the daemon folds.
    pub(crate) schedule: ScheduleConfig,
    /// `[monitor]`: the daemon's live view of pending tokens.
    pub(crate) monitor: MonitorConfig,
    /// `[alerts]`: what the daemon alerts on, and where to.
    pub(crate) alerts: AlertsConfig,
    /// `[ha]`: several daemon instances, one active.
    pub(crate) ha: HaConfig,
    /// `[http]`: metrics and health endpoints.
    pub(crate) http: HttpConfig,
    /// `[api]`: the events ledger over HTTP.
    pub(crate) api: ApiConfig,
    /// `[daemon]`: the daemon's own state and shutdown.
    pub(crate) daemon: DaemonConfig,
    /// `[log]`: what is logged and how.
    pub(crate) log: LogConfig,
    /// Keys that are read but no longer used: `check-config` and `run`
    /// warn about each.
    #[serde(skip)]
    pub(crate) warnings: Vec<ConfigIssue>,
}

/// One problem with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigIssue {
    /// The dotted key (`mongodb.uri`, `collections[1].name`), or `--config`
    /// for the file itself.
    pub(crate) key: String,
    /// What is wrong and, where it helps, how to fix it.
    pub(crate) message: String,
}

/// Every problem found in a configuration.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) struct ConfigErrors {
    /// The problems, in the order of the file's sections.
    pub(crate) issues: Vec<ConfigIssue>,
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid configuration ({}):",
            crate::error::counted(self.issues.len() as u64, "problem", "problems")
        )?;
        for issue in &self.issues {
            write!(f, "\n  {}: {}", issue.key, issue.message)?;
        }
        Ok(())
    }
}

impl ConfigErrors {
    /// One problem, at `key`.
    pub(crate) fn single(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            issues: vec![ConfigIssue {
                key: key.into(),
                message: message.into(),
            }],
        }
    }
}

impl Config {
    /// The reconciler this configuration asks for on `store` (the daemon's
    /// and `tallyd reconcile`'s alike): its `lane_ttl`, and the ledgers'
    /// dedupe window, the writers' retry horizon and the fold's lease.
    pub(crate) fn reconciler(&self, store: &Store) -> Reconciler {
        Reconciler::new(store)
            .with_lane_ttl(self.writer.lane_ttl)
            .with_event_settings(EventFoldSettings {
                event_retention: self.reconcile.event_retention,
                retry_horizon: self.writer.retry_horizon,
                lease: self.reconcile.fold_lease,
                ..EventFoldSettings::default()
            })
    }

    /// Loads the file (`None`: `/etc/tally/tallyd.toml`, which may be missing) and
    /// applies `TALLYD__…` overrides from `env` (pass `std::env::vars()`;
    /// tests pass their own): the configuration every command runs with,
    /// checked as [`Config::for_commands`] says.
    pub(crate) fn load(
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
                    crate::error::cannot_read(&path, &err),
                ));
            }
        };
        Self::for_commands(file.as_deref(), &path.display().to_string(), env)
    }

    /// The configuration every command runs with, from the file's `text`
    /// (`None`: no file was read) and `env`. Besides every key's own check,
    /// it needs the collections the commands work on; and when something
    /// is missing without a file, the first problem says that no file was
    /// read and how to name one. All in one verdict: one run names every
    /// problem.
    fn for_commands(
        text: Option<&str>,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigErrors> {
        let (config, mut issues) = Self::validated(text, origin, env)?;
        if config.collections.is_empty() && !issues.has_under("collections") {
            issues.push(
                "collections",
                "none configured: the daemon would have nothing to watch or fold, and every \
                 command works on configured collections; add a [[collections]] table",
            );
        }
        if text.is_none() && !issues.is_empty() {
            issues.push_first(
                "--config",
                format!(
                    "no configuration file was read: {DEFAULT_PATH} does not exist and --config \
                     was not given; name the file with --config PATH (variables such as \
                     {} set single keys over it)",
                    field::env_var("mongodb.uri")
                ),
            );
        }
        issues.into_result(config)
    }

    /// Builds the configuration from TOML text and environment overrides,
    /// checking every key (but not what [`Config::for_commands`] adds).
    #[cfg(test)]
    pub(crate) fn from_toml(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigErrors> {
        let (config, issues) = Self::validated(Some(text), "(inline)", env)?;
        issues.into_result(config)
    }

    /// The file's `text` and `env` merged and every key checked: the
    /// configuration and its problems (`Err`: the text cannot be read as
    /// TOML at all).
    fn validated(
        text: Option<&str>,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Self, Issues), ConfigErrors> {
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
        let all_env: HashMap<String, String> = env.into_iter().collect();
        let env: HashMap<String, String> = all_env
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let from_env: BTreeMap<String, String> = env
            .keys()
            .map(|k| {
                let dotted = k[prefix.len()..].to_lowercase().replace(ENV_SEPARATOR, ".");
                (dotted, k.clone())
            })
            .collect();
        let mut builder = config::Config::builder();
        let mut in_file = BTreeSet::new();
        if let Some(text) = text {
            let file = config::File::from_str(text, config::FileFormat::Toml);
            let shown = |err| ConfigErrors::single(origin, format!("cannot parse: {err}"));
            in_file = config::Source::collect(&file)
                .map_err(shown)?
                .into_keys()
                .collect();
            builder = builder.add_source(file);
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
        let mut issues = Issues::new(from_env, in_file);
        let config = validate(raw, &all_env, &mut issues);
        Ok((config, issues))
    }

    /// The settings for a collection: its `[[collections]]` entry, or the
    /// default field names for a collection not listed.
    pub(crate) fn collection(&self, name: &str) -> CollectionConfig {
        self.collections
            .iter()
            .find(|c| c.name == name)
            .cloned()
            .unwrap_or_else(|| CollectionConfig::new(name))
    }

    /// Each key that is read but no longer used, as `key: why` (warnings,
    /// not errors: an upgrade must not stop a daemon).
    pub(crate) fn warnings(&self) -> impl Iterator<Item = String> + '_ {
        self.warnings
            .iter()
            .map(|w| format!("{}: {}", w.key, w.message))
    }

    /// The effective configuration as TOML, with every secret masked.
    pub(crate) fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|err| format!("# cannot render: {err}\n"))
    }

    /// The fold settings for a collection: its overrides, else
    /// `[reconcile]`'s.
    pub(crate) fn fold_target(&self, name: &str) -> FoldTarget {
        let spec = self.collection(name);
        FoldTarget {
            grace: spec.grace.unwrap_or(self.reconcile.grace),
            batch_size: spec.batch_size.unwrap_or(self.reconcile.batch_size),
            spec,
        }
    }

    /// Every secret value in the configuration: the URI's password, the
    /// webhook URL and its auth header.
    pub(crate) fn secrets(&self) -> Secrets {
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
    let mongodb = library::validate_mongodb(issues.table("mongodb", raw.mongodb), issues);
    let (collections, close_after_unset) = library::validate_collections(raw.collections, issues);
    let mut warnings = Vec::new();
    let writer =
        library::validate_writer(issues.table("writer", raw.writer), issues, &mut warnings);
    let reconcile = library::validate_reconcile(issues.table("reconcile", raw.reconcile), issues);
    let sequences = library::validate_sequences(issues.table("sequences", raw.sequences), issues);
    let schedule = daemon::validate_schedule(issues.table("schedule", raw.schedule), issues);
    let monitor = daemon::validate_monitor(issues.table("monitor", raw.monitor), issues);
    let alerts = alerts::validate_alerts(issues.table("alerts", raw.alerts), env, issues);
    let ha = daemon::validate_ha(issues.table("ha", raw.ha), issues);
    let http = daemon::validate_http(issues.table("http", raw.http), issues);
    let api = api::validate_api(issues.table("api", raw.api), env, &collections, issues);
    api::check_listen(&api, &http, issues);
    let daemon = daemon::validate_daemon(issues.table("daemon", raw.daemon), &collections, issues);
    let log = daemon::validate_log(issues.table("log", raw.log), env, issues);
    let mut config = Config {
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
        api,
        daemon,
        log,
        warnings,
    };
    margins::default_close_after(&mut config, &close_after_unset, issues);
    margins::set_closing_margins(&mut config);
    margins::check(&config, issues);
    ledger::check(&config, issues);
    config
}

#[cfg(test)]
mod tests;
