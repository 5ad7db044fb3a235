//! `GET /v1/{collection}/counters/{key}`: a counter read exactly — the
//! counter plus its recorded events not folded yet — as `tallyd get
//! --json` prints it.
//!
//! A collection without buckets has one counter per key: no query. A
//! collection with buckets has one per key and bucket: `?at=TIME` reads
//! the bucket holding TIME, `?from=TIME&to=TIME` the buckets starting in
//! `[from, to)`, `&by=WIDTH` summed by a coarser width — each answered as
//! `get KEY --from … --to … --json` answers (`?at=` as the range of its
//! one bucket).

use std::time::SystemTime;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::events::text_within;
use super::outcome;
use super::problem::{Kind, Problem};
use super::{Api, answer};
use crate::bucket::{BucketWidth, Buckets};
use crate::config::Verb;
use crate::ledger::Ledger;

/// The query a read may carry.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReadQuery {
    at: Option<String>,
    from: Option<String>,
    to: Option<String>,
    by: Option<String>,
}

pub(super) async fn get(
    State(api): State<Api>,
    Path((collection, key)): Path<(String, String)>,
    query: Result<Query<ReadQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    answer(read(&api, &collection, &key, query, &headers).await)
}

async fn read(
    api: &Api,
    collection: &str,
    key: &str,
    query: Result<Query<ReadQuery>, QueryRejection>,
    headers: &HeaderMap,
) -> Result<Response, Problem> {
    let ledger = api.ledger(headers, Verb::Read, collection)?;
    let Query(query) = query.map_err(|err| {
        Problem::new(
            Kind::BadRequest,
            format!(
                "the query is not one a read takes ({}): give at=TIME, or from=TIME&to=TIME \
                 with by=WIDTH if you like, or nothing",
                err.body_text()
            ),
        )
    })?;
    let limits = &api.inner.limits;
    text_within("the key", key, limits.max_key_bytes, "max_key_bytes")
        .map_err(|why| Problem::new(Kind::BadRequest, why))?;
    let Some(buckets) = ledger.spec().buckets.clone() else {
        if query.at.is_some() || query.from.is_some() || query.to.is_some() || query.by.is_some() {
            return Err(Problem::new(
                Kind::BadRequest,
                format!(
                    "collection {collection} has no buckets, so {key:?} has one counter for all \
                     time; leave at, from, to and by out"
                ),
            ));
        }
        let value = ledger.value(key).await.map_err(|err| api.refusal(&err))?;
        return Ok(axum::Json(outcome::exact_json(key, &value)).into_response());
    };
    let (from, to, by) = range_asked(&query, &buckets, collection, key)?;
    range(api, ledger, key, (from, to), by, &buckets).await
}

/// The buckets a read of a bucketed collection asks for.
fn range_asked(
    query: &ReadQuery,
    buckets: &Buckets,
    collection: &str,
    key: &str,
) -> Result<(SystemTime, SystemTime, Option<BucketWidth>), Problem> {
    let bad = |detail: String| Problem::new(Kind::BadRequest, detail);
    let time = |name: &str, text: &str| {
        buckets
            .parse_time(text)
            .map_err(|err| bad(format!("{name}: {err}")))
    };
    let by = match &query.by {
        None => None,
        Some(text) => {
            let width: BucketWidth = text.parse().map_err(|err| bad(format!("by: {err}")))?;
            buckets.by(width).map_err(|err| bad(format!("by: {err}")))?;
            Some(width)
        }
    };
    match (&query.at, &query.from, &query.to) {
        (Some(at), None, None) if by.is_none() => {
            let at = time("at", at)?;
            let start = buckets
                .start_of(at)
                .map_err(|err| bad(format!("at: {err}")))?;
            let end = buckets
                .end_of(at)
                .map_err(|err| bad(format!("at: {err}")))?;
            Ok((start, end, None))
        }
        (None, Some(from), Some(to)) => {
            let (from, to) = (time("from", from)?, time("to", to)?);
            if from >= to {
                return Err(bad(format!(
                    "from {} is not before to {}: the range holds no bucket",
                    buckets.show_time(from),
                    buckets.show_time(to)
                )));
            }
            Ok((from, to, by))
        }
        (None, None, None) => Err(bad(format!(
            "collection {collection} counts by {} buckets: {key:?} has a counter per bucket and \
             none for all time; read one with ?at=TIME, or several with ?from=TIME&to=TIME (and \
             &by= a coarser width to sum them)",
            buckets.width()
        ))),
        _ => Err(bad(
            "give at=TIME alone, or from=TIME and to=TIME (with by=WIDTH if you like)".into(),
        )),
    }
}

async fn range(
    api: &Api,
    ledger: &Ledger,
    key: &str,
    (from, to): (SystemTime, SystemTime),
    by: Option<BucketWidth>,
    buckets: &Buckets,
) -> Result<Response, Problem> {
    let read = ledger
        .values_between(key, from, to, by)
        .await
        .map_err(|err| api.refusal(&err))?;
    Ok(axum::Json(outcome::range_json(key, (from, to), &read, buckets)).into_response())
}
