//! Refusals as RFC 9457 problem documents (`application/problem+json`):
//! a `type` naming the kind of problem (a stable `tag:` URI, each one
//! described in the book's API chapter), a `title` for the kind, the `status`, and a `detail` that
//! says in one sentence what failed and what to do. Members beside them
//! (an event's outcome, a batch's item) carry the rest.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

/// How each problem `type` begins; the kind's name follows (the API
/// chapter lists them).
const TYPE_BASE: &str = "tag:tally.invalid,2026:problem/";

/// The media type of a problem document.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// One kind of refusal: its status, its `type` anchor and its title.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// 400: the request is not what the API reads.
    BadRequest,
    /// 401: no token, or one the daemon does not know.
    Unauthenticated,
    /// 403: a known token without the scope.
    Forbidden,
    /// 404: no such route or collection.
    NotFound,
    /// 405: a route without that method.
    MethodNotAllowed,
    /// 408: the body did not arrive in time.
    Timeout,
    /// 409: the event id was recorded with another counter or amount.
    Conflict,
    /// 413: the body or the batch is over its limit.
    TooLarge,
    /// 415: a body that is neither JSON nor NDJSON.
    UnsupportedMediaType,
    /// 422: an event the ledger refused (its time, or the server refused
    /// it): nothing written.
    Unprocessable,
    /// 500: the daemon cannot do it (its own deployment is at fault).
    Internal,
    /// 503: MongoDB is unavailable or the daemon is busy: nothing written.
    Unavailable,
}

impl Kind {
    /// The HTTP status.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Self::BadRequest => StatusCode::BAD_REQUEST,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::Forbidden => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Timeout => StatusCode::REQUEST_TIMEOUT,
            Self::Conflict => StatusCode::CONFLICT,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The anchor of its `type`, and its title.
    fn named(self) -> (&'static str, &'static str) {
        match self {
            Self::BadRequest => ("bad-request", "The request is not one the API reads"),
            Self::Unauthenticated => ("unauthenticated", "No valid bearer token"),
            Self::Forbidden => ("forbidden", "The token lacks the scope"),
            Self::NotFound => ("not-found", "No such route or collection"),
            Self::MethodNotAllowed => ("method-not-allowed", "The route has no such method"),
            Self::Timeout => ("timeout", "The request did not arrive in time"),
            Self::Conflict => ("conflict", "The event id was recorded as another event"),
            Self::TooLarge => ("too-large", "The request is over a limit"),
            Self::UnsupportedMediaType => (
                "unsupported-media-type",
                "The body is neither JSON nor NDJSON",
            ),
            Self::Unprocessable => ("not-recorded", "The event was refused: nothing written"),
            Self::Internal => ("internal", "The daemon cannot do this"),
            Self::Unavailable => (
                "unavailable",
                "Unavailable: nothing written, try again later",
            ),
        }
    }
}

/// A problem document on its way out.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    kind: Kind,
    detail: String,
    members: Map<String, Value>,
    retry_after: Option<u64>,
    challenge: bool,
}

impl Problem {
    /// A problem of `kind`; `detail` says what failed and what to do.
    pub(crate) fn new(kind: Kind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            members: Map::new(),
            retry_after: None,
            challenge: kind == Kind::Unauthenticated,
        }
    }

    /// The same, with the members of `object` beside the problem's own.
    pub(crate) fn with_members(mut self, object: Value) -> Self {
        if let Value::Object(members) = object {
            self.members.extend(members);
        }
        self
    }

    /// The same, telling the client to try again in `seconds`.
    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Its kind.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// The document as JSON.
    pub(crate) fn body(&self) -> Value {
        let (anchor, title) = self.kind.named();
        let mut body = json!({
            "type": format!("{TYPE_BASE}{anchor}"),
            "title": title,
            "status": self.kind.status().as_u16(),
            "detail": self.detail,
        });
        for (name, value) in &self.members {
            body[name] = value.clone();
        }
        body
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut response = (self.kind.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.challenge {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"tally\""),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_carries_its_members_and_headers() {
        let problem = Problem::new(Kind::Unavailable, "MongoDB is unavailable; try again")
            .with_members(json!({ "outcome": "not_recorded" }))
            .retry_after(5);
        let body = problem.body();
        assert_eq!(body["status"], 503);
        assert_eq!(body["outcome"], "not_recorded");
        assert!(body["type"].as_str().unwrap().ends_with("/unavailable"));
        let response = problem.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "5");
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        let response = Problem::new(Kind::Unauthenticated, "x").into_response();
        assert!(response.headers().contains_key(header::WWW_AUTHENTICATE));
    }
}
