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
