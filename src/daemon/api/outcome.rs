//! What an event's outcome and a counter's value look like as JSON: the
//! one shape `tallyd record --json`, `record --from --json`, `get --json`
//! and the HTTP API all print, so a program reads the same object whichever
//! way it counted.

use std::time::SystemTime;

use mongodb::bson::Bson;
use serde_json::{Value, json};

use crate::bucket::Buckets;
use crate::ledger::{ExactValue, Ledger, RangeValue, Recording};
use crate::redact::Secrets;

/// The sentence that says what became of a recording (secrets scrubbed):
/// what the command line prints, and the `error` of its JSON when the
/// event is not counted.
pub(crate) fn said(recording: &Recording, secrets: &Secrets) -> String {
    match recording {
        Recording::Recorded(_) => "recorded: it will be counted once".to_owned(),
        Recording::Duplicate(_) => {
            "duplicate: recorded before with the same counter and amount; counted once".to_owned()
        }
        Recording::Conflict(conflict) => format!("conflict: {conflict}"),
        Recording::Unknown(ticket) => format!(
            "unknown: the insert may or may not have landed ({}); run the same command again",
            ticket
                .cause()
                .map_or_else(String::new, |c| secrets.scrub(&c.to_string()))
        ),
        Recording::NotRecorded(not) => {
            format!("not recorded: {}", secrets.scrub(&not.cause().to_string()))
        }
    }
}

/// The plain key and the start of the bucket of a recording's event, as
/// printed (`None` without buckets): the bucket it was recorded in, else
/// (refused) the bucket holding `at`.
pub(crate) fn key_and_bucket(
    recording: &Recording,
    ledger: &Ledger,
    at: Option<SystemTime>,
) -> (Bson, Option<String>) {
    let counter = recording.event().counter();
    let Some(buckets) = &ledger.spec().buckets else {
        return (counter.clone(), None);
    };
    match crate::write::at::split_id(counter) {
        Some((key, start)) => (key.clone(), Some(buckets.show_time(start))),
        None => {
            let start = at.and_then(|at| buckets.start_of(at).ok());
            (counter.clone(), start.map(|start| buckets.show_time(start)))
        }
    }
}

/// A recording as one JSON object; in a collection with buckets, `key` is
/// the plain key and `bucket` its bucket's start. `text` is [`said`]'s
/// sentence, the object's `error` when the event is not counted.
pub(crate) fn as_json(
    recording: &Recording,
    ledger: &Ledger,
    text: &str,
    at: Option<SystemTime>,
) -> Value {
    let event = recording.event();
    let (key, bucket) = key_and_bucket(recording, ledger, at);
    let mut out = json!({
        "outcome": recording.name(),
        "event": event.key(),
        "key": key.into_relaxed_extjson(),
        "amount": event.amount(),
        "collection": ledger.spec().name,
        "events_collection": ledger.spec().events_collection_name(),
    });
    if let Some(bucket) = bucket {
        out["bucket"] = json!(bucket);
    }
    if let Recording::Conflict(conflict) = recording {
        out["recorded_key"] = conflict.stored_counter().clone().into_relaxed_extjson();
        out["recorded_amount"] = json!(conflict.stored_amount());
    }
    if !recording.is_counted() {
        out["error"] = json!(text);
    }
    out
}

/// An exact read of one counter, as `get --json` prints it.
pub(crate) fn exact_json(key: &str, value: &ExactValue) -> Value {
    json!({
        "key": key,
        "value": value.value,
        "folded": value.folded,
        "unfolded": value.unfolded,
        "unfolded_events": value.unfolded_events,
    })
}

/// A key's buckets in `[from, to)`, each exact, as `get --from --to --json`
/// prints them.
pub(crate) fn range_json(
    key: &str,
    (from, to): (SystemTime, SystemTime),
    read: &RangeValue,
    buckets: &Buckets,
) -> Value {
    let shown = |at| buckets.show_time(at);
    let rows: Vec<Value> = read
        .buckets
        .iter()
        .map(|b| json!({ "start": shown(b.start), "value": b.value, "closed": b.closed }))
        .collect();
    json!({
        "key": key,
        "from": shown(from),
        "to": shown(to),
        "by": read.by.as_str(),
        "total": read.total,
        "buckets": rows,
    })
}

/// An event as written in a line of `record --from` or a request of the
/// API: the event's id, its counter key, its amount and its time as
/// written.
pub(crate) type Written = (String, Bson, i64, Option<String>);

/// Reads one line of NDJSON (`record --from`'s input, the API's NDJSON
/// body) as an event: why not, in words, when it is none — a JSON error
/// by its column alone (the line's number is the caller's).
pub(crate) fn line_of(text: &str) -> Result<Written, String> {
    let value: Value = serde_json::from_str(text).map_err(|err| {
        let text = err.to_string();
        let what = text
            .strip_suffix(&format!(" at line {} column {}", err.line(), err.column()))
            .unwrap_or(&text);
        format!("not a JSON object: {what} at column {}", err.column())
    })?;
    event_of(value)
}

/// Reads one event from a JSON object `{"event": "…", "key": …, "by": N,
/// "at": "…"}` (`by` defaults to 1, `at` to none): why not, in words,
/// when it is none.
pub(crate) fn event_of(value: Value) -> Result<Written, String> {
    let Value::Object(fields) = value else {
        return Err("not a JSON object".into());
    };
    if let Some(unknown) = fields
        .keys()
        .find(|k| !["event", "key", "by", "at"].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown field {unknown:?} (expected event, key, by and at)"
        ));
    }
    let event = match fields.get("event") {
        Some(Value::String(event)) => event.clone(),
        Some(_) => return Err("\"event\" must be a string".into()),
        None => return Err("\"event\" is missing".into()),
    };
    let key = match fields.get("key") {
        None => return Err("\"key\" is missing".into()),
        Some(key) => Bson::try_from(key.clone())
            .map_err(|err| format!("\"key\" is not a value a counter key can be: {err}"))?,
    };
    let by = match fields.get("by") {
        None => 1,
        Some(by) => by
            .as_i64()
            .ok_or("\"by\" must be an integer (a 64-bit signed one)")?,
    };
    let at = match fields.get("at") {
        None => None,
        Some(Value::String(at)) => Some(at.clone()),
        Some(_) => {
            return Err(
                "\"at\" must be a string: RFC 3339 (2026-11-28T14:30:00Z) or a date (2026-11-28)"
                    .into(),
            );
        }
    };
    Ok((event, key, by, at))
}
