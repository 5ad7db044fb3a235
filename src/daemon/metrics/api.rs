//! The API's metrics (`[api]`): requests by route and status, their
//! latency, the requests in flight, and the events recorded over HTTP by
//! outcome. Routes are labelled by their pattern (`POST
//! /v1/{collection}/events`), never by a key or an event id.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge};

use super::{Registrar, counter_vec, gauge, register_vec};

/// The API's series; see each field for its name.
pub(crate) struct ApiMetrics {
    /// `tally_api_requests_total{route,status}`: requests answered.
    pub(crate) requests: IntCounterVec,
    /// `tally_api_request_duration_seconds{route}`: how long a request
    /// took to answer, from its headers to its response.
    pub(crate) duration: HistogramVec,
    /// `tally_api_requests_in_flight`: requests being served now.
    pub(crate) in_flight: IntGauge,
    /// `tally_api_events_total{collection,outcome}`: events recorded over
    /// HTTP, by outcome (`recorded`, `duplicate`, `conflict`, `unknown`,
    /// `not_recorded`).
    pub(crate) events: IntCounterVec,
}

impl ApiMetrics {
    /// The series, registered.
    pub(super) fn new(registry: &Registrar) -> Self {
        Self {
            requests: counter_vec(
                registry,
                "tally_api_requests_total",
                "API requests answered, by route and status",
                &["route", "status"],
            ),
            duration: register_vec(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_api_request_duration_seconds",
                        "How long the API took to answer a request",
                    )
                    .buckets(vec![
                        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
                        30.0,
                    ]),
                    &["route"],
                ),
            ),
            in_flight: gauge(
                registry,
                "tally_api_requests_in_flight",
                "API requests being served now",
            ),
            events: counter_vec(
                registry,
                "tally_api_events_total",
                "Events recorded over HTTP, by outcome",
                &["collection", "outcome"],
            ),
        }
    }
}
