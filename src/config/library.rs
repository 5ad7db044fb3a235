//! The sections read into the library's own types: `[mongodb]`
//! ([`StoreConfig`]), `[[collections]]` ([`CollectionConfig`]), `[writer]`
//! ([`WriterConfig`]), `[reconcile]` (the grace and batch size of each
//! [`FoldTarget`]) and `[sequences]` ([`SequenceConfig`]).
//!
//! [`FoldTarget`]: crate::reconcile::FoldTarget

use std::collections::HashMap;
use std::time::Duration;

use mongodb::options::ConnectionString;
use serde::Serialize;
use serde_json::Value;

use super::ConfigIssue;
use super::field::{Issues, describe};
use super::raw::{RawCollection, RawMongo, RawReconcile, RawSequences, RawWriter};
use crate::bucket::{BucketWidth, Buckets, DEFAULT_CLOSE_AFTER};
use crate::ledger::DEFAULT_EVENT_RETENTION;
use crate::reconcile::{DEFAULT_BATCH_SIZE, DEFAULT_GRACE};
use crate::redact::{SecretString, Secrets, redact_uri};
use crate::store::{StoreConfig, serialize_duration};
use crate::write::counter::{
    CollectionConfig, DEFAULT_COUNTER_FIELD, DEFAULT_GROUP_MAX, DEFAULT_GROUP_WAIT,
    DEFAULT_LANE_RESUME_HORIZON, DEFAULT_LANE_TTL, DEFAULT_LANES_FIELD, DEFAULT_PENDING_FIELD,
    DEFAULT_QUEUE_LIMIT, DEFAULT_RETRY_HORIZON, DEFAULT_SETTLED_FIELD, MAX_GROUP_MAX,
    MAX_QUEUE_LIMIT, MIN_RETRY_HORIZON, Protocol, WriterConfig,
};
use crate::write::sequence::SequenceConfig;

/// `[reconcile]`: how leftover pending tokens are folded into their
/// counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct ReconcileConfig {
    /// Only tokens older than this are folded; younger ones belong to
    /// writers still between their two steps. Must exceed `[writer]
    /// retry_horizon` plus `[mongodb] attempt_timeout`, by more than the
    /// clock skew between writers and the server. Default: 15m.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) grace: Duration,
    /// How many documents one fold update covers: work between two points
    /// where a run can stop (shutdown) and report progress. Default: 100.
    pub(crate) batch_size: u32,
    /// The ledgers' dedupe window: an event is deleted once folded and
    /// older than this, and a repeat inside it is a duplicate. At least
    /// `retry_horizon + attempt_timeout + 1h` (checked with the margins).
    /// Default: 7d.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) event_retention: Duration,
    /// How soon after new events the daemon folds a ledger (its change
    /// stream's debounce). Default: 1s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) fold_delay: Duration,
    /// How long a ledger's fold pass stays its daemon's without renewal:
    /// another daemon takes an unfinished pass over this long (plus one
    /// attempt) after its owner stopped renewing it. Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) fold_lease: Duration,
    /// The longest a ledger's fold may stand still — the daemon down, the
    /// cluster unreachable — that this deployment plans to survive: the
    /// fold resumes the events collection's change stream from where it
    /// stood, which the oplog must still hold. `tallyd doctor` checks the
    /// oplog's window against it, and the daemon alerts
    /// (`events_fold_behind`) when the fold's position is older than half
    /// the window. Default: 24h.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) fold_outage: Duration,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            grace: DEFAULT_GRACE,
            batch_size: DEFAULT_BATCH_SIZE,
            event_retention: DEFAULT_EVENT_RETENTION,
            fold_delay: DEFAULT_FOLD_DELAY,
            fold_lease: DEFAULT_FOLD_LEASE,
            fold_outage: DEFAULT_FOLD_OUTAGE,
        }
    }
}

/// Default `[reconcile] fold_outage`.
pub(crate) const DEFAULT_FOLD_OUTAGE: Duration = Duration::from_secs(24 * 3600);

/// Default `[reconcile] fold_delay`.
pub(crate) const DEFAULT_FOLD_DELAY: Duration = Duration::from_secs(1);
/// Default `[reconcile] fold_lease`.
pub(crate) const DEFAULT_FOLD_LEASE: Duration = Duration::from_secs(30);

pub(super) fn validate_reconcile(raw: RawReconcile, issues: &mut Issues) -> ReconcileConfig {
    issues.unknown_keys("reconcile", &raw.unknown);
    ReconcileConfig {
        grace: issues.duration("reconcile.grace", raw.grace, DEFAULT_GRACE),
        batch_size: issues
            .optional_integer("reconcile.batch_size", raw.batch_size, 1, MAX_BATCH_SIZE)
            .map_or(DEFAULT_BATCH_SIZE, |n| n as u32),
        event_retention: issues.duration(
            "reconcile.event_retention",
            raw.event_retention,
            DEFAULT_EVENT_RETENTION,
        ),
        fold_delay: issues.duration("reconcile.fold_delay", raw.fold_delay, DEFAULT_FOLD_DELAY),
        fold_lease: issues.duration("reconcile.fold_lease", raw.fold_lease, DEFAULT_FOLD_LEASE),
        fold_outage: issues.duration(
            "reconcile.fold_outage",
            raw.fold_outage,
            DEFAULT_FOLD_OUTAGE,
        ),
    }
}

/// The largest fold batch: keeps one update's `$in` list and its work
/// bounded.
const MAX_BATCH_SIZE: u64 = 10_000;

/// Keys of `[writer]` that tally no longer reads, and why: a file from an
/// earlier version still loads, with a warning naming each.
const RETIRED_WRITER_KEYS: [&str; 2] = ["lanes", "lane_rotate"];

/// `[writer]`, and a warning for each retired key it sets.
pub(super) fn validate_writer(
    raw: RawWriter,
    issues: &mut Issues,
    warnings: &mut Vec<ConfigIssue>,
) -> WriterConfig {
    issues.unknown_keys("writer", &raw.unknown);
    for (key, set) in RETIRED_WRITER_KEYS
        .into_iter()
        .zip([raw.lanes.is_some(), raw.lane_rotate.is_some()])
    {
        if set {
            warnings.push(ConfigIssue {
                key: format!("writer.{key}"),
                message: "no longer used: a handle has one lane, whose entries the daemon prunes \
                          by when they were last written; delete it"
                    .into(),
            });
        }
    }
    let retry_horizon = issues.duration(
        "writer.retry_horizon",
        raw.retry_horizon,
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
    let group_max = issues
        .optional_integer("writer.group_max", raw.group_max, 1, MAX_GROUP_MAX as u64)
        .map_or(DEFAULT_GROUP_MAX, |n| n as usize);
    let queue_limit = issues
        .optional_integer(
            "writer.queue_limit",
            raw.queue_limit,
            1,
            MAX_QUEUE_LIMIT as u64,
        )
        .map_or(DEFAULT_QUEUE_LIMIT, |n| n as usize);
    // Zero is a group_wait of its own (no waiting), unlike other durations.
    let zero = raw
        .group_wait
        .as_ref()
        .and_then(Value::as_str)
        .map(str::trim);
    let group_wait = match zero.map(humantime::parse_duration) {
        Some(Ok(wait)) if wait.is_zero() => Duration::ZERO,
        _ => issues.duration("writer.group_wait", raw.group_wait, DEFAULT_GROUP_WAIT),
    };
    let lane_resume_horizon = issues.duration(
        "writer.lane_resume_horizon",
        raw.lane_resume_horizon,
        DEFAULT_LANE_RESUME_HORIZON,
    );
    let lane_ttl = issues.duration("writer.lane_ttl", raw.lane_ttl, DEFAULT_LANE_TTL);
    let protocol = match issues.string("writer.protocol", raw.protocol).as_deref() {
        None | Some("two-step") => Protocol::TwoStep,
        Some("lanes") => Protocol::Lanes,
        Some(other) => {
            issues.push(
                "writer.protocol",
                format!("expected \"two-step\" or \"lanes\", found {other:?}"),
            );
            Protocol::TwoStep
        }
    };
    WriterConfig {
        retry_horizon,
        group_max,
        queue_limit,
        group_wait,
        lane_resume_horizon,
        lane_ttl,
        protocol,
    }
}

pub(super) fn validate_mongodb(raw: RawMongo, issues: &mut Issues) -> StoreConfig {
    issues.unknown_keys("mongodb", &raw.unknown);
    let uri = issues.required_string("mongodb.uri", raw.uri);
    let parsed = uri.as_deref().and_then(|uri| parse_uri(uri, issues));
    let no_uri = uri.is_none();
    // The URI's own options, else tally's defaults; the keys set here win.
    let defaults =
        StoreConfig::with_uri_options(SecretString::new(uri.unwrap_or_default()), parsed.as_ref());

    let database = issues
        .string("mongodb.database", raw.database)
        .or_else(|| parsed.as_ref().and_then(|p| p.default_database.clone()));
    match &database {
        Some(name) => check_database_name(name, issues),
        // A URI that cannot be read may name one: only its problem is said.
        None if parsed.is_some() || no_uri => issues.push(
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
        defaults.connect_timeout,
    );
    let server_selection_timeout = issues.duration(
        "mongodb.server_selection_timeout",
        raw.server_selection_timeout,
        defaults.server_selection_timeout,
    );
    let max_idle_time = issues.duration(
        "mongodb.max_idle_time",
        raw.max_idle_time,
        defaults.max_idle_time,
    );
    let attempt_timeout = issues.duration(
        "mongodb.attempt_timeout",
        raw.attempt_timeout,
        defaults.attempt_timeout,
    );
    StoreConfig {
        database: database.unwrap_or_default(),
        app_name,
        connect_timeout,
        server_selection_timeout,
        max_idle_time,
        attempt_timeout,
        ..defaults
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

/// The `[[collections]]` entries, and the positions of the bucketed ones
/// that leave `close_after` to its default: the margin it must meet is
/// known only once every section is read.
pub(super) fn validate_collections(
    raw: Option<Value>,
    issues: &mut Issues,
) -> (Vec<CollectionConfig>, Vec<usize>) {
    let mut close_after_unset = Vec::new();
    let entries = match raw {
        None => return (Vec::new(), close_after_unset),
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            let mut message = format!(
                "expected [[collections]] tables, found {}",
                describe(&other)
            );
            // `TALLYD__COLLECTIONS__0__GRACE` makes the whole list a table
            // `{"0": {"grace": …}}`: the variable is what to name.
            let vars = issues.vars_below("collections");
            if !vars.is_empty() {
                message.push_str(&format!(
                    " (set by {}): an environment variable cannot set a key of one \
                     [[collections]] entry, it replaces the whole list; set the key in the file \
                     and unset the variable",
                    crate::error::words(&vars)
                ));
            }
            issues.push("collections", message);
            return (Vec::new(), close_after_unset);
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
                issues.push(key, format!("expected a table, found {}", describe(&other)));
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
        let settled_field = issues
            .string(&format!("{key}.settled_field"), raw.settled_field)
            .unwrap_or_else(|| DEFAULT_SETTLED_FIELD.into());
        let lanes_field = issues
            .string(&format!("{key}.lanes_field"), raw.lanes_field)
            .unwrap_or_else(|| DEFAULT_LANES_FIELD.into());
        check_field_name(&format!("{key}.counter_field"), &counter_field, issues);
        check_field_name(&format!("{key}.pending_field"), &pending_field, issues);
        check_field_name(&format!("{key}.settled_field"), &settled_field, issues);
        check_field_name(&format!("{key}.lanes_field"), &lanes_field, issues);
        if counter_field == pending_field {
            issues.push(
                format!("{key}.pending_field"),
                format!("must differ from counter_field (both are {counter_field:?})"),
            );
        }
        if settled_field == counter_field || settled_field == pending_field {
            issues.push(
                format!("{key}.settled_field"),
                format!(
                    "must differ from counter_field and pending_field (it is {settled_field:?})"
                ),
            );
        }
        if [&counter_field, &pending_field, &settled_field].contains(&&lanes_field) {
            issues.push(
                format!("{key}.lanes_field"),
                format!(
                    "must differ from counter_field, pending_field and settled_field (it is \
                     {lanes_field:?})"
                ),
            );
        }
        let ledger = issues.boolean(&format!("{key}.ledger"), raw.ledger, false);
        let events_collection =
            issues.string(&format!("{key}.events_collection"), raw.events_collection);
        if let Some(events) = &events_collection {
            check_collection_name(&format!("{key}.events_collection"), events, issues);
        }
        // Naming an events collection turns the ledger on.
        let events_collection = match (events_collection, &name) {
            (Some(events), _) => Some(events),
            (None, Some(name)) if ledger => Some(format!("{name}_events")),
            (None, _) => None,
        };
        let grace = issues.optional_duration(&format!("{key}.grace"), raw.grace);
        let batch_size = issues
            .optional_integer(
                &format!("{key}.batch_size"),
                raw.batch_size,
                1,
                MAX_BATCH_SIZE,
            )
            .map(|n| n as u32);
        let (buckets, close_after_set) =
            collection_buckets(&key, [raw.bucket, raw.timezone, raw.close_after], issues);
        if buckets.is_some() && !close_after_set {
            close_after_unset.push(i);
        }
        out.push(CollectionConfig {
            name: name.unwrap_or_default(),
            counter_field,
            pending_field,
            settled_field,
            lanes_field,
            events_collection,
            grace,
            batch_size,
            buckets,
        });
    }
    (out, close_after_unset)
}

/// A `[[collections]]` entry's (at `key`) `bucket`, `timezone` and
/// `close_after`, as given: its buckets (`None` without `bucket`, or after
/// a problem), and whether `close_after` was set.
fn collection_buckets(
    key: &str,
    [bucket, timezone, close_after]: [Option<Value>; 3],
    issues: &mut Issues,
) -> (Option<Buckets>, bool) {
    let bucket_key = format!("{key}.bucket");
    let zone_key = format!("{key}.timezone");
    let close_key = format!("{key}.close_after");
    let bucketed = bucket.is_some();
    let without_bucket = [
        (
            zone_key.clone(),
            timezone.is_some(),
            "a time zone says where buckets start",
        ),
        (
            close_key.clone(),
            close_after.is_some(),
            "only buckets are closed",
        ),
    ];
    let width = issues.string(&bucket_key, bucket).and_then(|name| {
        let width = name.parse::<BucketWidth>().ok();
        if width.is_none() {
            issues.push(
                &bucket_key,
                format!("expected \"minute\", \"hour\", \"day\" or \"month\", found {name:?}"),
            );
        }
        width
    });
    let zone = issues.string(&zone_key, timezone).filter(|name| {
        let known = Buckets::new(BucketWidth::Day, name).is_ok();
        if !known {
            issues.push(
                &zone_key,
                format!(
                    "unknown time zone {name:?}; use an IANA name such as \"UTC\" or \
                     \"Europe/Berlin\""
                ),
            );
        }
        known
    });
    let close_after = issues.optional_duration(&close_key, close_after);
    if !bucketed {
        for (key, set, why) in without_bucket {
            if set && !issues.has(&key) {
                issues.push(
                    key,
                    format!(
                        "set without bucket: {why}, and this collection counts for all time; \
                         add bucket (minute, hour, day or month) or delete it"
                    ),
                );
            }
        }
    }
    let Some(Ok(buckets)) =
        width.map(|width| Buckets::new(width, zone.as_deref().unwrap_or("UTC")))
    else {
        return (None, false);
    };
    let close_after_set = close_after.is_some();
    let close_after = close_after.unwrap_or(DEFAULT_CLOSE_AFTER);
    (Some(buckets.with_close_after(close_after)), close_after_set)
}

pub(super) fn check_collection_name(key: &str, name: &str, issues: &mut Issues) {
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

pub(super) fn validate_sequences(raw: RawSequences, issues: &mut Issues) -> SequenceConfig {
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
