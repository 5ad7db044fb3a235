//! `POST /v1/{collection}/events`: one event, or a batch.
//!
//! The body is JSON — one object `{"event": "…", "key": "…", "by": N,
//! "at": "…"}`, or an array of them — or NDJSON (`application/x-ndjson`),
//! one object a line, as `tallyd record --from` reads. A single event may
//! leave its id to the `Idempotency-Key` header. Everything is checked
//! before anything is sent: a request over a limit (its body, its batch),
//! not JSON, or a single event that is not one, is refused whole, and
//! nothing is written. In a batch, each item that is not an event is
//! reported in its place (`"outcome": "malformed"`) and the others are
//! recorded, in one `record_many_at` through the collection's one handle.
//!
//! A single event's status follows its outcome: 201 recorded, 200
//! duplicate, 202 unknown (sending the same request again is safe and
//! settles it), 409 conflict, 422 a refused time, 503 (with `Retry-After`)
//! when MongoDB was unavailable and nothing was written. A batch answers
//! 200 with one outcome per item, in order; 503 when MongoDB was
//! unavailable for every event and nothing was written.

use std::time::SystemTime;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use mongodb::bson::Bson;
use serde_json::{Value, json};

use super::outcome::{self, Written};
use super::problem::{Kind, Problem};
use super::{Api, answer};
use crate::bucket::{BucketWidth, Buckets};
use crate::config::{ApiLimits, Verb};
use crate::ledger::{Ledger, Recording};

/// The header that may carry a single event's id.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// How the body is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// One JSON object, or an array of them.
    Json,
    /// One JSON object a line.
    Ndjson,
}

/// An event read from a request, checked against the limits, with its
/// time read in the collection's zone.
type Event = (String, Bson, i64, Option<SystemTime>);

/// One item of a batch: an event, or why it is not one; and where it
/// stood (`index` in an array, `line` in NDJSON).
struct Item {
    place: (&'static str, u64),
    event: Result<Event, String>,
}

pub(super) async fn post(
    State(api): State<Api>,
    Path(collection): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(record(&api, &collection, &headers, body).await)
}

async fn record(
    api: &Api,
    collection: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let ledger = api.ledger(headers, Verb::Record, collection)?;
    let limits = &api.inner.limits;
    let format = format_of(headers)?;
    let idempotency = idempotency_key(headers)?;
    let bytes = read_body(body, headers, limits).await?;
    let items = match (format, first_byte(&bytes)) {
        (Format::Json, Some(b'[')) => {
            let values: Vec<Value> = serde_json::from_slice(&bytes).map_err(not_json)?;
            check_batch(values.len(), limits, idempotency.as_deref())?;
            values
                .into_iter()
                .enumerate()
                .map(|(i, value)| Item {
                    place: ("index", i as u64),
                    event: checked(outcome::event_of(value), ledger, limits),
                })
                .collect()
        }
        (Format::Json, _) => {
            let value: Value = serde_json::from_slice(&bytes).map_err(not_json)?;
            let value = with_idempotency_key(value, idempotency)?;
            let event = checked(outcome::event_of(value), ledger, limits)
                .map_err(|why| Problem::new(Kind::BadRequest, format!("not an event: {why}")))?;
            return Ok(single(api, ledger, event).await);
        }
        (Format::Ndjson, _) => {
            let text = std::str::from_utf8(&bytes).map_err(|err| {
                Problem::new(
                    Kind::BadRequest,
                    format!("the body is not UTF-8 ({err}): send NDJSON as UTF-8 text"),
                )
            })?;
            let lines: Vec<(usize, &str)> = text
                .lines()
                .enumerate()
                .filter(|(_, line)| !line.trim().is_empty())
                .collect();
            check_batch(lines.len(), limits, idempotency.as_deref())?;
            lines
                .into_iter()
                .map(|(i, line)| Item {
                    place: ("line", i as u64 + 1),
                    event: checked(outcome::line_of(line), ledger, limits),
                })
                .collect()
        }
    };
    Ok(batch(api, ledger, items).await)
}

/// The body's format, by its `Content-Type` (none: JSON).
fn format_of(headers: &HeaderMap) -> Result<Format, Problem> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(Format::Json);
    };
    let media = value
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/json" => Ok(Format::Json),
        "application/x-ndjson" | "application/ndjson" | "application/jsonl" => Ok(Format::Ndjson),
        _ => Err(Problem::new(
            Kind::UnsupportedMediaType,
            format!(
                "the body is sent as {media:?}: send one event or an array of them as \
                 application/json, or one event a line as application/x-ndjson (curl: add -H \
                 'Content-Type: application/json')"
            ),
        )),
    }
}

/// The `Idempotency-Key` header, when given: a single event's id.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    value.to_str().map(|v| Some(v.to_owned())).map_err(|_| {
        Problem::new(
            Kind::BadRequest,
            "the Idempotency-Key header is not visible ASCII text: send the event's id in the \
             body's \"event\" instead",
        )
    })
}

/// The body, read within `max_body_bytes` and `body_timeout`: 413 or 408
/// before anything is written. A body over the limit is read on (and
/// thrown away) up to [`DRAIN_AT_MOST`], so that the client, still
/// sending, gets the answer instead of a reset connection.
async fn read_body(body: Body, headers: &HeaderMap, limits: &ApiLimits) -> Result<Bytes, Problem> {
    let too_large = || {
        Problem::new(
            Kind::TooLarge,
            format!(
                "the body is larger than [api] max_body_bytes ({} bytes): nothing was \
                 written; send fewer events per request",
                limits.max_body_bytes
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = body;
    if declared.is_some_and(|length| length > limits.max_body_bytes) {
        if declared.is_some_and(|length| length <= DRAIN_AT_MOST) {
            let _ =
                tokio::time::timeout(limits.body_timeout, drain(&mut body, DRAIN_AT_MOST)).await;
        }
        return Err(too_large());
    }
    let read = tokio::time::timeout(limits.body_timeout, async {
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                Problem::new(
                    Kind::BadRequest,
                    format!(
                        "the body could not be read ({err}): nothing was written; send it again"
                    ),
                )
            })?;
            if let Ok(data) = frame.into_data() {
                bytes.extend_from_slice(&data);
            }
            if bytes.len() as u64 > limits.max_body_bytes {
                drain(&mut body, DRAIN_AT_MOST).await;
                return Err(too_large());
            }
        }
        Ok(Bytes::from(bytes))
    });
    read.await.unwrap_or_else(|_| {
        Err(Problem::new(
            Kind::Timeout,
            format!(
                "the body did not arrive within [api] body_timeout ({}): nothing was written; \
                 send it again",
                humantime::format_duration(limits.body_timeout)
            ),
        ))
    })
}

/// How much of a body over the limit is read and thrown away, at most.
const DRAIN_AT_MOST: u64 = 16 * 1024 * 1024;

/// Reads and throws away what is left of `body`, up to `at_most` bytes.
async fn drain(body: &mut Body, at_most: u64) {
    let mut read = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        if let Ok(data) = frame.into_data() {
            read += data.len() as u64;
        }
        if read > at_most {
            return;
        }
    }
}

fn first_byte(bytes: &[u8]) -> Option<u8> {
    bytes.iter().copied().find(|b| !b.is_ascii_whitespace())
}

fn not_json(err: serde_json::Error) -> Problem {
    Problem::new(
        Kind::BadRequest,
        format!(
            "the body is not JSON ({err}): nothing was written; send one event as a JSON \
             object, or an array of them"
        ),
    )
}

/// A batch of `length` items: within `max_batch`, without an
/// `Idempotency-Key` (each item carries its own id).
fn check_batch(
    length: usize,
    limits: &ApiLimits,
    idempotency: Option<&str>,
) -> Result<(), Problem> {
    if idempotency.is_some() {
        return Err(Problem::new(
            Kind::BadRequest,
            "the Idempotency-Key header names one event, and this is a batch: give each event \
             its id in \"event\" and leave the header out",
        ));
    }
    if length as u64 > limits.max_batch {
        return Err(Problem::new(
            Kind::TooLarge,
            format!(
                "the batch holds {length} events, more than [api] max_batch ({}): nothing was \
                 written; split it",
                limits.max_batch
            ),
        ));
    }
    if length == 0 {
        return Err(Problem::new(
            Kind::BadRequest,
            "the batch is empty: send at least one event",
        ));
    }
    Ok(())
}

/// A single event's object with the `Idempotency-Key` as its id: the
/// header and an `"event"` in the body must agree.
fn with_idempotency_key(value: Value, key: Option<String>) -> Result<Value, Problem> {
    let (Some(key), Value::Object(mut fields)) = (key, value.clone()) else {
        return Ok(value);
    };
    match fields.get("event") {
        Some(Value::String(event)) if *event != key => Err(Problem::new(
            Kind::BadRequest,
            format!(
                "the Idempotency-Key header ({}) and the body's \"event\" ({}) name two \
                 events: give the id once",
                shown(&key),
                shown(event)
            ),
        )),
        _ => {
            fields.insert("event".into(), Value::String(key));
            Ok(Value::Object(fields))
        }
    }
}

/// An event checked against the limits, its time read in the collection's
/// zone (a collection without buckets reads it in UTC, and the ledger
/// refuses it: not recorded).
fn checked(
    written: Result<Written, String>,
    ledger: &Ledger,
    limits: &ApiLimits,
) -> Result<Event, String> {
    let (event, key, by, at) = written?;
    text_within(
        "\"event\"",
        &event,
        limits.max_event_bytes,
        "max_event_bytes",
    )?;
    let Bson::String(text) = &key else {
        return Err("\"key\" must be a string (the read names the counter in its path)".to_owned());
    };
    text_within("\"key\"", text, limits.max_key_bytes, "max_key_bytes")?;
    if by == 0 {
        return Err("\"by\" must not be 0: an event adds or takes away something".into());
    }
    if by.unsigned_abs() > limits.max_amount {
        return Err(format!(
            "\"by\" is {by}, beyond [api] max_amount ({}): send a smaller amount",
            limits.max_amount
        ));
    }
    let zone = match &ledger.spec().buckets {
        Some(buckets) => buckets.clone(),
        None => Buckets::utc(BucketWidth::Day),
    };
    let at = match at {
        None => None,
        Some(at) => Some(
            zone.parse_time(&at)
                .map_err(|err| format!("\"at\": {err}"))?,
        ),
    };
    Ok((event, key, by, at))
}

/// A text field not empty, within `max` bytes, without control characters.
pub(super) fn text_within(field: &str, text: &str, max: u64, limit: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("{field} must not be empty"));
    }
    if text.len() as u64 > max {
        return Err(format!(
            "{field} is {} bytes, more than [api] {limit} ({max}): use a shorter one",
            text.len()
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(format!(
            "{field} must not hold a line end, tab or other control character ({}): send it \
             without",
            shown(text)
        ));
    }
    Ok(())
}

/// A text as messages quote it: escaped, and its first 64 characters only.
fn shown(text: &str) -> String {
    let quoted: String = text.chars().take(64).flat_map(char::escape_debug).collect();
    if text.chars().count() > 64 {
        format!("\"{quoted}…\"")
    } else {
        format!("\"{quoted}\"")
    }
}

/// Records one event and answers with its outcome.
async fn single(api: &Api, ledger: &Ledger, (event, key, by, at): Event) -> Response {
    let recording = match at {
        Some(at) => ledger.record_at(event, key, by, at).await,
        None => ledger.record(event, key, by).await,
    };
    api.count(ledger, std::slice::from_ref(&recording));
    let text = outcome::said(&recording, &api.inner.secrets);
    let shown = outcome::as_json(&recording, ledger, &text, at);
    let status = match &recording {
        Recording::Recorded(_) => StatusCode::CREATED,
        Recording::Duplicate(_) => StatusCode::OK,
        Recording::Unknown(_) => StatusCode::ACCEPTED,
        Recording::Conflict(_) => {
            return Problem::new(Kind::Conflict, text)
                .with_members(shown)
                .into_response();
        }
        Recording::NotRecorded(not) => {
            let refusal = api.refusal(not.cause());
            return Problem::new(refusal.kind(), text)
                .with_members(shown)
                .retry_after_of(&refusal)
                .into_response();
        }
    };
    (status, axum::Json(shown)).into_response()
}

/// Records a batch's events with one `record_many_at` and answers with
/// every item's outcome, in order.
async fn batch(api: &Api, ledger: &Ledger, items: Vec<Item>) -> Response {
    let events: Vec<Event> = items
        .iter()
        .filter_map(|item| item.event.as_ref().ok().cloned())
        .collect();
    let recordings = ledger.record_many_at(events).await;
    api.count(ledger, &recordings);
    let all_unavailable = !recordings.is_empty()
        && recordings.iter().all(|r| match r {
            Recording::NotRecorded(not) => api.refusal(not.cause()).kind() == Kind::Unavailable,
            _ => false,
        });
    let mut recordings = recordings.into_iter();
    let outcomes: Vec<Value> = items
        .into_iter()
        .map(|item| {
            let (name, at) = item.place;
            let mut shown = match item.event {
                Err(why) => json!({ "outcome": "malformed", "error": why }),
                Ok((_, _, _, time)) => {
                    let recording = recordings.next().expect("one outcome per event");
                    let text = outcome::said(&recording, &api.inner.secrets);
                    outcome::as_json(&recording, ledger, &text, time)
                }
            };
            shown[name] = json!(at);
            shown
        })
        .collect();
    if all_unavailable {
        return Problem::new(
            Kind::Unavailable,
            "MongoDB is unavailable: no event of the batch was written; send it again later",
        )
        .with_members(json!({ "outcomes": outcomes }))
        .retry_after(super::RETRY_UNAVAILABLE)
        .into_response();
    }
    (StatusCode::OK, axum::Json(json!({ "outcomes": outcomes }))).into_response()
}

impl Problem {
    /// The same, with `other`'s `Retry-After`.
    fn retry_after_of(self, other: &Problem) -> Self {
        match other.kind() {
            Kind::Unavailable => self.retry_after(super::RETRY_UNAVAILABLE),
            _ => self,
        }
    }
}

impl Api {
    /// Counts the outcomes of a request's events, per collection.
    fn count(&self, ledger: &Ledger, recordings: &[Recording]) {
        let collection = ledger.spec().name.as_str();
        for recording in recordings {
            self.inner
                .metrics
                .api
                .events
                .with_label_values(&[collection, recording.name()])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idempotency_key_names_a_single_event_once() {
        let body = json!({ "key": "home" });
        let merged = with_idempotency_key(body, Some("order-1".into())).unwrap();
        assert_eq!(merged["event"], "order-1");
        let same = json!({ "event": "order-1", "key": "home" });
        assert!(with_idempotency_key(same, Some("order-1".into())).is_ok());
        let other = json!({ "event": "order-2", "key": "home" });
        let refused = with_idempotency_key(other, Some("order-1".into())).unwrap_err();
        assert_eq!(refused.kind(), Kind::BadRequest);
    }

    #[test]
    fn text_fields_are_bounded_and_free_of_control_characters() {
        assert!(text_within("\"key\"", "home", 8, "max_key_bytes").is_ok());
        let long = text_within("\"key\"", &"k".repeat(100_000), 256, "max_key_bytes").unwrap_err();
        assert!(long.contains("100000 bytes"), "{long}");
        assert!(long.len() < 200, "{long}");
        let control = text_within("\"event\"", "a\nb", 256, "max_event_bytes").unwrap_err();
        assert!(control.contains(r#""a\nb""#), "{control}");
        assert!(text_within("\"event\"", "", 256, "max_event_bytes").is_err());
    }
}
