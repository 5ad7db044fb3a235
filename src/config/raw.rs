//! The configuration as written: the shape of the file, nothing checked.
//!
//! Every leaf is an untyped value and every table catches the keys it does
//! not know, so deserializing never stops at the first problem: validation
//! (in the parent module) then reports every bad key at once.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// Keys a table did not expect, with their values.
pub(crate) type Unknown = BTreeMap<String, Value>;

/// The whole file, merged with the environment.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawConfig {
    pub mongodb: Option<Section<RawMongo>>,
    pub collections: Option<Value>,
    pub writer: Option<Section<RawWriter>>,
    pub sequences: Option<Section<RawSequences>>,
    pub reconcile: Option<Section<RawReconcile>>,
    pub schedule: Option<Section<RawSchedule>>,
    pub monitor: Option<Section<RawMonitor>>,
    pub alerts: Option<Section<RawAlerts>>,
    pub ha: Option<Section<RawHa>>,
    pub http: Option<Section<RawHttp>>,
    pub daemon: Option<Section<RawDaemon>>,
    pub log: Option<Section<RawLog>>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// A table, or whatever stood where a table was expected.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Section<T> {
    Table(T),
    NotATable(Value),
}

/// `[mongodb]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawMongo {
    pub uri: Option<Value>,
    pub database: Option<Value>,
    pub app_name: Option<Value>,
    pub connect_timeout: Option<Value>,
    pub server_selection_timeout: Option<Value>,
    pub max_idle_time: Option<Value>,
    pub attempt_timeout: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// One `[[collections]]` entry.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawCollection {
    pub name: Option<Value>,
    pub counter_field: Option<Value>,
    pub pending_field: Option<Value>,
    pub grace: Option<Value>,
    pub batch_size: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[writer]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawWriter {
    pub retry_horizon: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[reconcile]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawReconcile {
    pub grace: Option<Value>,
    pub batch_size: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[sequences]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawSequences {
    pub collection: Option<Value>,
    pub field: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[log]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawLog {
    pub level: Option<Value>,
    pub format: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[schedule]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawSchedule {
    pub cron: Option<Value>,
    pub timezone: Option<Value>,
    pub catch_up: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[monitor]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawMonitor {
    pub enabled: Option<Value>,
    pub scan_interval: Option<Value>,
    pub save_interval: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[alerts]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawAlerts {
    pub stuck_after: Option<Value>,
    pub max_pending: Option<Value>,
    pub repair: Option<Value>,
    pub monitor_down_after: Option<Value>,
    pub webhook: Option<Section<RawWebhook>>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[alerts.webhook]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawWebhook {
    pub url: Option<Value>,
    pub auth_header_env: Option<Value>,
    pub timeout: Option<Value>,
    pub max_attempts: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[ha]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawHa {
    pub enabled: Option<Value>,
    pub lease_ttl: Option<Value>,
    pub instance: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[http]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawHttp {
    pub listen: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}

/// `[daemon]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawDaemon {
    pub state_collection: Option<Value>,
    pub shutdown_timeout: Option<Value>,
    #[serde(flatten)]
    pub unknown: Unknown,
}
