//! The daemon's HTTP endpoints (axum), on `127.0.0.1:9187` by default:
//!
//! - `/metrics`: every metric, in the Prometheus text format;
//! - `/healthz`: 200 while the process serves requests (liveness);
//! - `/readyz`: 200 with `active` or `standby` once the daemon has reached
//!   MongoDB, 503 before (readiness).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State as AxumState;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;

/// What `/readyz` reports: whether the server was reached, and the role.
#[derive(Clone, Debug)]
pub(crate) struct Readiness {
    connected: Arc<AtomicBool>,
    role: watch::Receiver<Role>,
}

impl Readiness {
    /// Not connected yet; the role as published by the lease keeper.
    pub(crate) fn new(role: watch::Receiver<Role>) -> Self {
        Self {
            connected: Arc::new(AtomicBool::new(false)),
            role,
        }
    }

    /// Marks the daemon as having reached the server.
    pub(crate) fn set_connected(&self) {
        self.connected.store(true, Ordering::Relaxed);
    }
}

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
    if shared.readiness.connected.load(Ordering::Relaxed) {
        let role = *shared.readiness.role.borrow();
        (StatusCode::OK, format!("{}\n", role.as_str()))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for MongoDB\n".to_owned(),
        )
    }
}
