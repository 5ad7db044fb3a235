//! tally over HTTP (`[api]`): the events ledger for any language, served
//! by `tallyd run` on an address of its own (the book:
//! guide/http-api.md).
//!
//! - `POST /v1/{collection}/events` records one event (a JSON object; the
//!   `Idempotency-Key` header may carry its id) or a batch (a JSON array,
//!   or NDJSON): [`events`].
//! - `GET /v1/{collection}/counters/{key}` reads a counter exactly, one
//!   bucket (`?at=`) or a range of buckets (`?from=&to=&by=`):
//!   [`counters`].
//! - `GET /v1/openapi.json`: the OpenAPI 3.1 document of these routes
//!   ([`openapi`]).
//!
//! Every request of a collection goes through **one** [`Ledger`] handle,
//! made when the run starts: concurrent requests share its lane and its
//! inserts (group commit). Each event's outcome is the command line's JSON
//! outcome ([`outcome`], which `tallyd record --json` prints too); a single
//! event's status follows it, a batch answers 200 with one outcome per
//! item. Every refusal is a problem document ([`problem`]); a request
//! refused whole writes nothing. Access is by bearer token ([`access`]);
//! [`serve`] holds the connections to their limits (TLS, header and idle
//! timeouts, the drain at a stop or reload).

pub(crate) mod access;
mod counters;
mod events;
pub(crate) mod openapi;
pub(crate) mod outcome;
pub(crate) mod problem;
pub(crate) mod serve;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tower::ServiceBuilder;

use crate::config::{ApiLimits, Config, Verb};
use crate::daemon::metrics::Metrics;
use crate::daemon::readiness::Readiness;
use crate::error::{Error, Trouble};
use crate::ledger::Ledger;
use crate::redact::Secrets;
use crate::store::Store;
use access::Access;
use problem::{Kind, Problem};

/// What `Retry-After` says when MongoDB is unavailable: about one
/// readiness probe.
const RETRY_UNAVAILABLE: u64 = 5;
/// What `Retry-After` says when the daemon is at `max_requests`.
const RETRY_BUSY: u64 = 1;

/// One run's API: the ledgers, the access rules and the limits, shared by
/// every request (cheap to clone).
#[derive(Clone)]
pub(crate) struct Api {
    inner: Arc<Inner>,
}

struct Inner {
    /// One handle per collection with a ledger, for every request.
    ledgers: HashMap<String, Ledger>,
    access: Access,
    limits: ApiLimits,
    readiness: Readiness,
    metrics: Metrics,
    secrets: Secrets,
    store: Store,
}

impl Api {
    /// The API of a run of `config` on `store`: a ledger handle per
    /// configured collection with a ledger.
    pub(crate) fn new(
        config: &Config,
        store: &Store,
        readiness: Readiness,
        metrics: Metrics,
    ) -> Self {
        let ledgers = config
            .collections
            .iter()
            .filter(|spec| spec.events_collection.is_some())
            .map(|spec| {
                let ledger = Ledger::new(store, spec.clone())
                    .with_retry_horizon(config.writer.retry_horizon);
                (spec.name.clone(), ledger)
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                ledgers,
                access: Access::new(config.api.tokens.clone()),
                limits: config.api.limits,
                readiness,
                metrics,
                secrets: config.secrets(),
                store: store.clone(),
            }),
        }
    }

    /// The routes, held to `max_requests` at once (one more is refused at
    /// once: 503) and measured per route and status.
    pub(crate) fn router(&self) -> Router {
        let busy = |_: tower::BoxError| async {
            Problem::new(
                Kind::Unavailable,
                "the daemon is serving as many requests as [api] max_requests allows: nothing \
                 was written; try again in a moment",
            )
            .retry_after(RETRY_BUSY)
        };
        let limit = ServiceBuilder::new()
            .layer(HandleErrorLayer::new(busy))
            .load_shed()
            .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                usize::try_from(self.inner.limits.max_requests).unwrap_or(usize::MAX),
            ));
        Router::new()
            .route(openapi::ROUTES[0].1, post(events::post))
            .route(openapi::ROUTES[1].1, get(counters::get))
            .route(openapi::ROUTES[2].1, get(openapi::get))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(limit)
            .layer(axum::middleware::from_fn_with_state(self.clone(), measured))
            .with_state(self.clone())
    }

    /// The ledger a request may use: after its token (401), that the
    /// collection has a ledger here (404: no scope could make it one), that
    /// the token's scopes allow it (403) and that MongoDB answers (503).
    fn ledger(
        &self,
        headers: &HeaderMap,
        verb: Verb,
        collection: &str,
    ) -> Result<&Ledger, Problem> {
        let token = self.inner.access.identify(headers)?;
        let ledger = self.inner.ledgers.get(collection).ok_or_else(|| {
            let mut names: Vec<&str> = self.inner.ledgers.keys().map(String::as_str).collect();
            names.sort_unstable();
            Problem::new(
                Kind::NotFound,
                format!(
                    "{collection} is not a collection with an events ledger in this daemon's \
                     configuration (those are: {}); correct the path",
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                ),
            )
        })?;
        Access::authorize(token, verb, collection)?;
        if !self.inner.readiness.is_ready() {
            return Err(Problem::new(
                Kind::Unavailable,
                "the daemon cannot reach MongoDB (or has not yet): nothing was written; try \
                 again in a few seconds",
            )
            .retry_after(RETRY_UNAVAILABLE));
        }
        Ok(ledger)
    }

    /// The problem a failed read or write of the ledger is, by the error's
    /// class (as the command line's exit code is): 503 when MongoDB is
    /// unavailable, 400 for an argument the ledger refused, 422 for a time
    /// or a write it refused, 500 when the daemon's own deployment is at
    /// fault.
    fn refusal(&self, err: &Error) -> Problem {
        let said = self.inner.secrets.scrub(&self.inner.store.explain(err));
        match refusal_kind(err) {
            Kind::Unavailable => Problem::new(
                Kind::Unavailable,
                format!("MongoDB is unavailable: {said}; nothing was written: try again later"),
            )
            .retry_after(RETRY_UNAVAILABLE),
            Kind::Internal => Problem::new(
                Kind::Internal,
                format!("{said} (the daemon's deployment must be fixed; tell its operator)"),
            ),
            kind => Problem::new(kind, said),
        }
    }
}

/// The kind of problem `err` is (see [`Api::refusal`]).
fn refusal_kind(err: &Error) -> Kind {
    match err {
        Error::TimeAhead { .. } | Error::BucketClosed { .. } => Kind::Unprocessable,
        Error::InvalidArgument(_) => Kind::BadRequest,
        Error::Server(failure) => match failure.trouble() {
            Trouble::Unavailable => Kind::Unavailable,
            Trouble::Refused => Kind::Unprocessable,
            Trouble::PermissionDenied | Trouble::Misconfigured => Kind::Internal,
        },
        _ => Kind::Internal,
    }
}

/// The route label of a request: its method and path pattern.
fn route_of(method: &Method, path: &str) -> &'static str {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        (&Method::POST, ["v1", _, "events"]) => "POST /v1/{collection}/events",
        (&Method::GET, ["v1", _, "counters", _]) => "GET /v1/{collection}/counters/{key}",
        (&Method::GET, ["v1", "openapi.json"]) => "GET /v1/openapi.json",
        _ => "other",
    }
}

/// Counts every request by route and status, and times it.
async fn measured(State(api): State<Api>, request: Request, next: Next) -> Response {
    let route = route_of(request.method(), request.uri().path());
    let started = Instant::now();
    let metrics = &api.inner.metrics.api;
    // Decremented however the request ends: a client that goes away drops
    // this future before its answer.
    metrics.in_flight.inc();
    let _in_flight = InFlight(&metrics.in_flight);
    let response = next.run(request).await;
    let status = response.status();
    metrics
        .requests
        .with_label_values(&[route, status.as_str()])
        .inc();
    metrics
        .duration
        .with_label_values(&[route])
        .observe(started.elapsed().as_secs_f64());
    response
}

/// A request counted in `tally_api_requests_in_flight` until dropped.
struct InFlight<'a>(&'a prometheus::IntGauge);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn not_found() -> Problem {
    Problem::new(
        Kind::NotFound,
        "no such route: the API serves POST /v1/{collection}/events, GET \
         /v1/{collection}/counters/{key} and GET /v1/openapi.json",
    )
}

async fn method_not_allowed() -> Problem {
    Problem::new(
        Kind::MethodNotAllowed,
        "the route has no such method: events are recorded with POST, counters read with GET",
    )
}

/// A response from either a result or its refusal.
fn answer(result: Result<Response, Problem>) -> Response {
    result.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_labelled_by_their_pattern_never_their_values() {
        assert_eq!(
            route_of(&Method::POST, "/v1/orders/events"),
            "POST /v1/{collection}/events"
        );
        assert_eq!(
            route_of(&Method::GET, "/v1/orders/counters/a%20b"),
            "GET /v1/{collection}/counters/{key}"
        );
        assert_eq!(route_of(&Method::GET, "/v1/orders/events"), "other");
        assert_eq!(route_of(&Method::GET, "/anything/else"), "other");
    }

    #[test]
    fn errors_are_refused_by_their_class() {
        assert_eq!(
            refusal_kind(&Error::InvalidArgument("x".into())),
            Kind::BadRequest
        );
        let ahead = Error::TimeAhead {
            at: "t".into(),
            ahead: std::time::Duration::from_secs(600),
            bound: std::time::Duration::from_secs(120),
        };
        assert_eq!(refusal_kind(&ahead), Kind::Unprocessable);
    }
}
