//! The settings an increment needs: a counter collection's field names
//! ([`CollectionConfig`], shared with the fold) and the retry horizon
//! ([`WriterConfig`]).

use std::time::Duration;

use serde::Serialize;

use crate::store::{serialize_duration, serialize_optional_duration};

/// Default name of the field holding a counter's value.
pub(crate) const DEFAULT_COUNTER_FIELD: &str = "counter";
/// Default name of the field holding a counter's pending entries.
pub(crate) const DEFAULT_PENDING_FIELD: &str = "pending";
/// Default name of the field holding the markers of settled tokens.
pub(crate) const DEFAULT_SETTLED_FIELD: &str = "settled";

/// Default retry horizon: three attempts of the default attempt bound
/// (60s), room for a step 1, its retry and a `resume`.
pub(crate) const DEFAULT_RETRY_HORIZON: Duration = Duration::from_secs(180);
/// The shortest retry horizon: a token's timestamp has one-second
/// resolution, so a fresh token may already look a second old. The daemon's
/// configuration refuses less; the library raises less to it.
pub(crate) const MIN_RETRY_HORIZON: Duration = Duration::from_secs(2);

/// The shortest retry horizon that works with attempts bounded by
/// `attempt_timeout`: [`MIN_RETRY_HORIZON`], and two attempts. A step 1
/// whose attempt runs out of time is one attempt old when its retry is due;
/// with a shorter horizon the retry would never be sent and `resume` would
/// refuse at once, losing a count the caller did everything to keep.
pub(crate) fn least_retry_horizon(attempt_timeout: Duration) -> Duration {
    MIN_RETRY_HORIZON.max(attempt_timeout.saturating_mul(2))
}

/// A counter collection and its field names (in the daemon's configuration,
/// one `[[collections]]` entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CollectionConfig {
    /// The collection's name.
    pub name: String,
    /// The field holding the counter's value. Default: `counter`.
    pub counter_field: String,
    /// The field holding the pending entries. Default: `pending`.
    pub pending_field: String,
    /// The field holding a marker `{t: token, n: amount}` for every token a
    /// settle (`complete`, `resume`) counted, so that settling it again
    /// counts nothing; the fold removes markers older than the grace.
    /// Default: `settled`.
    pub settled_field: String,
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
            settled_field: DEFAULT_SETTLED_FIELD.into(),
            grace: None,
            batch_size: None,
        }
    }

    /// The same collection with other names for the counter and pending
    /// fields.
    pub fn with_fields(mut self, counter: impl Into<String>, pending: impl Into<String>) -> Self {
        self.counter_field = counter.into();
        self.pending_field = pending.into();
        self
    }

    /// The same collection with another name for the settled field.
    pub fn with_settled_field(mut self, settled: impl Into<String>) -> Self {
        self.settled_field = settled.into();
        self
    }
}

/// How the library's increments behave (the daemon's `[writer]` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WriterConfig {
    /// Step 1 of an increment is never (re)sent for a token older than this,
    /// so a token can never be re-added after the daemon may have folded it.
    /// Must stay below the daemon's `grace` by one attempt. At least two
    /// attempts (the store's attempt timeout) and 2s: [`Counters::new`]
    /// raises a shorter one (with less, a step 1 whose attempt timed out
    /// could be neither retried nor resumed; and a token's time has
    /// one-second resolution). Default: 3m.
    ///
    /// [`Counters::new`]: super::Counters::new
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
