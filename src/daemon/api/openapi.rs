//! `GET /v1/openapi.json`: the API described in OpenAPI 3.1, for client
//! generators and for people. The document is `openapi.json` beside this
//! file; a test holds it against the routes the router serves
//! ([`ROUTES`]) and the statuses the handlers answer with.

use axum::http::header;
use axum::response::IntoResponse;

/// The document, as served.
pub(crate) const DOCUMENT: &str = include_str!("openapi.json");

/// Every route the API serves: its method (lower case, as OpenAPI writes
/// it) and path pattern.
pub(crate) const ROUTES: [(&str, &str); 3] = [
    ("post", "/v1/{collection}/events"),
    ("get", "/v1/{collection}/counters/{key}"),
    ("get", "/v1/openapi.json"),
];

pub(super) async fn get() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::problem::Kind;
    use serde_json::Value;

    fn document() -> Value {
        serde_json::from_str(DOCUMENT).expect("openapi.json is JSON")
    }

    #[test]
    fn the_document_is_openapi_3_1_and_names_exactly_the_routes() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        let mut documented = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.push((method.clone(), path.clone()));
            }
        }
        documented.sort();
        let mut served: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
            .collect();
        served.sort();
        assert_eq!(documented, served);
    }

    #[test]
    fn every_status_the_handlers_answer_is_documented() {
        let doc = document();
        let events = &doc["paths"]["/v1/{collection}/events"]["post"]["responses"];
        let reads = &doc["paths"]["/v1/{collection}/counters/{key}"]["get"]["responses"];
        let record_kinds = [
            Kind::BadRequest,
            Kind::Unauthenticated,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::Timeout,
            Kind::Conflict,
            Kind::TooLarge,
            Kind::UnsupportedMediaType,
            Kind::Unprocessable,
            Kind::Internal,
            Kind::Unavailable,
        ];
        for status in ["200", "201", "202"] {
            assert!(events.get(status).is_some(), "{status}");
        }
        for kind in record_kinds {
            let status = kind.status().as_u16().to_string();
            assert!(events.get(&status).is_some(), "POST events: {status}");
        }
        for kind in [
            Kind::BadRequest,
            Kind::Unauthenticated,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::Internal,
            Kind::Unavailable,
        ] {
            let status = kind.status().as_u16().to_string();
            assert!(reads.get(&status).is_some(), "GET counters: {status}");
        }
        // Every reference resolves.
        let text = DOCUMENT;
        for reference in text.split("\"$ref\": \"#/").skip(1) {
            let path = reference.split('"').next().unwrap();
            let mut node = &doc;
            for part in path.split('/') {
                node = &node[part];
            }
            assert!(!node.is_null(), "unresolved reference #/{path}");
        }
    }
}
