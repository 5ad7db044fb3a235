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
    pub(crate) mongodb: Option<Section<RawMongo>>,
    pub(crate) collections: Option<Value>,
    pub(crate) writer: Option<Section<RawWriter>>,
    pub(crate) sequences: Option<Section<RawSequences>>,
    pub(crate) reconcile: Option<Section<RawReconcile>>,
    pub(crate) schedule: Option<Section<RawSchedule>>,
    pub(crate) monitor: Option<Section<RawMonitor>>,
    pub(crate) alerts: Option<Section<RawAlerts>>,
    pub(crate) ha: Option<Section<RawHa>>,
    pub(crate) http: Option<Section<RawHttp>>,
    pub(crate) api: Option<Section<RawApi>>,
    pub(crate) daemon: Option<Section<RawDaemon>>,
    pub(crate) log: Option<Section<RawLog>>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
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
    pub(crate) uri: Option<Value>,
    pub(crate) database: Option<Value>,
    pub(crate) app_name: Option<Value>,
    pub(crate) connect_timeout: Option<Value>,
    pub(crate) server_selection_timeout: Option<Value>,
    pub(crate) max_idle_time: Option<Value>,
    pub(crate) attempt_timeout: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// One `[[collections]]` entry.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawCollection {
    pub(crate) name: Option<Value>,
    pub(crate) counter_field: Option<Value>,
    pub(crate) pending_field: Option<Value>,
    pub(crate) settled_field: Option<Value>,
    pub(crate) lanes_field: Option<Value>,
    pub(crate) ledger: Option<Value>,
    pub(crate) events_collection: Option<Value>,
    pub(crate) grace: Option<Value>,
    pub(crate) batch_size: Option<Value>,
    pub(crate) bucket: Option<Value>,
    pub(crate) timezone: Option<Value>,
    pub(crate) close_after: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[writer]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawWriter {
    pub(crate) retry_horizon: Option<Value>,
    /// Retired: read only to warn that it is no longer used.
    pub(crate) lanes: Option<Value>,
    /// Retired: read only to warn that it is no longer used.
    pub(crate) lane_rotate: Option<Value>,
    pub(crate) group_max: Option<Value>,
    pub(crate) queue_limit: Option<Value>,
    pub(crate) group_wait: Option<Value>,
    pub(crate) lane_resume_horizon: Option<Value>,
    pub(crate) lane_ttl: Option<Value>,
    pub(crate) protocol: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[reconcile]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawReconcile {
    pub(crate) grace: Option<Value>,
    pub(crate) batch_size: Option<Value>,
    pub(crate) event_retention: Option<Value>,
    pub(crate) fold_delay: Option<Value>,
    pub(crate) fold_lease: Option<Value>,
    pub(crate) fold_outage: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[sequences]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawSequences {
    pub(crate) collection: Option<Value>,
    pub(crate) field: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[log]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawLog {
    pub(crate) level: Option<Value>,
    pub(crate) format: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[schedule]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawSchedule {
    pub(crate) cron: Option<Value>,
    pub(crate) timezone: Option<Value>,
    pub(crate) catch_up: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[monitor]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawMonitor {
    pub(crate) enabled: Option<Value>,
    pub(crate) scan_interval: Option<Value>,
    pub(crate) save_interval: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[alerts]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawAlerts {
    pub(crate) stuck_after: Option<Value>,
    pub(crate) max_pending: Option<Value>,
    pub(crate) max_lanes: Option<Value>,
    pub(crate) repair: Option<Value>,
    pub(crate) monitor_down_after: Option<Value>,
    pub(crate) webhook: Option<Section<RawWebhook>>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[alerts.webhook]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawWebhook {
    pub(crate) url: Option<Value>,
    pub(crate) auth_header_env: Option<Value>,
    pub(crate) timeout: Option<Value>,
    pub(crate) max_attempts: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[ha]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawHa {
    pub(crate) enabled: Option<Value>,
    pub(crate) lease_ttl: Option<Value>,
    pub(crate) instance: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[http]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawHttp {
    pub(crate) listen: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[api]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawApi {
    pub(crate) enabled: Option<Value>,
    pub(crate) listen: Option<Value>,
    pub(crate) tls_cert: Option<Value>,
    pub(crate) tls_key: Option<Value>,
    pub(crate) serve_without: Option<Value>,
    pub(crate) max_body_bytes: Option<Value>,
    pub(crate) max_batch: Option<Value>,
    pub(crate) max_event_bytes: Option<Value>,
    pub(crate) max_key_bytes: Option<Value>,
    pub(crate) max_amount: Option<Value>,
    pub(crate) header_timeout: Option<Value>,
    pub(crate) body_timeout: Option<Value>,
    pub(crate) idle_timeout: Option<Value>,
    pub(crate) max_requests: Option<Value>,
    /// Never read: tokens belong in the environment, which its message says.
    pub(crate) tokens: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}

/// `[daemon]`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RawDaemon {
    pub(crate) state_collection: Option<Value>,
    pub(crate) shutdown_timeout: Option<Value>,
    #[serde(flatten)]
    pub(crate) unknown: Unknown,
}
