//! The daemon's HTTP endpoints (axum), on `127.0.0.1:9187` by default:
//!
//! - `/metrics`: every metric, in the Prometheus text format;
//! - `/healthz`: 200 while the process serves requests (liveness);
//! - `/readyz`: 200 with `active` or `standby` while MongoDB answers, 503
//!   before it first did and during an outage ([`Readiness`]).

use axum::Router;
use axum::extract::State as AxumState;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::daemon::metrics::Metrics;
use crate::daemon::readiness::Readiness;

#[derive(Clone)]
struct Shared {
    metrics: Metrics,
    readiness: Readiness,
}

/// Serves the endpoints on `listener` until `shutdown`.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: CancellationToken,
) {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(Shared { metrics, readiness });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(err) = served {
        tracing::error!(cause = %err, "the HTTP endpoint stopped");
    }
}

async fn metrics_text(AxumState(shared): AxumState<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics.render(),
    )
}

async fn ready(AxumState(shared): AxumState<Shared>) -> impl IntoResponse {
    if shared.readiness.is_ready() {
        let role = shared.readiness.role();
        (StatusCode::OK, format!("{}\n", role.as_str()))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: MongoDB does not answer\n".to_owned(),
        )
    }
}
