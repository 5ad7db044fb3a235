//! A webhook receiver on loopback for the tests that check what the alert
//! engine sends: the daemon's integration tests, and the alert engine's unit
//! tests in `src/daemon/alert/tests.rs`, which include this file with
//! `#[path]` so both use the same receiver.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use serde_json::Value;
use tokio::net::TcpListener;

/// One request the receiver saw.
#[derive(Clone, Debug)]
pub(crate) struct Received {
    pub(crate) status: StatusCode,
    pub(crate) path: String,
    pub(crate) authorization: Option<String>,
    pub(crate) content_type: Option<String>,
    pub(crate) body: Value,
}

#[derive(Default)]
struct ReceiverState {
    /// Requests still to be answered 500.
    fail_next: AtomicUsize,
    /// Requests for collections starting with this are never answered
    /// (recorded with status 408): an endpoint that hangs.
    hang_for: Option<String>,
    requests: Mutex<Vec<Received>>,
}

/// A webhook receiver on 127.0.0.1 that records every request and answers
/// 500 to the first `fail_next` of them, 200 to the rest. Stops on drop.
pub(crate) struct Receiver {
    pub(crate) addr: SocketAddr,
    state: Arc<ReceiverState>,
    server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub(crate) async fn start(fail_next: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the test webhook");
        Self::serve(listener, fail_next, None)
    }

    /// A receiver that never answers the requests for collections whose
    /// name starts with `prefix` (they are recorded with status 408) and
    /// answers 200 to the rest.
    pub(crate) async fn start_hanging_for(prefix: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the test webhook");
        Self::serve(listener, 0, Some(prefix.to_owned()))
    }

    /// A receiver on a port that was free a moment ago (a webhook coming
    /// back up).
    pub(crate) async fn start_on(addr: SocketAddr) -> Self {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|err| panic!("rebind {addr} for the test webhook: {err}"));
        Self::serve(listener, 0, None)
    }

    fn serve(listener: TcpListener, fail_next: usize, hang_for: Option<String>) -> Self {
        let addr = listener.local_addr().expect("listener address");
        let state = Arc::new(ReceiverState {
            fail_next: AtomicUsize::new(fail_next),
            hang_for,
            ..ReceiverState::default()
        });
        let app = axum::Router::new()
            .fallback(receive)
            .with_state(state.clone());
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("the test webhook serves");
        });
        Self {
            addr,
            state,
            server,
        }
    }

    pub(crate) fn requests(&self) -> Vec<Received> {
        self.state.requests.lock().unwrap().clone()
    }

    /// The bodies answered with 200, in the order they arrived.
    pub(crate) fn delivered(&self) -> Vec<Value> {
        self.requests()
            .into_iter()
            .filter(|r| r.status.is_success())
            .map(|r| r.body)
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let fail = state
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    let status = if fail {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::OK
    };
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let hang = state
        .hang_for
        .as_deref()
        .zip(body["collection"].as_str())
        .is_some_and(|(prefix, collection)| collection.starts_with(prefix));
    let status = if hang {
        StatusCode::REQUEST_TIMEOUT
    } else {
        status
    };
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap_or("(not text)").to_owned())
    };
    state.requests.lock().unwrap().push(Received {
        status,
        path: uri.path().to_owned(),
        authorization: header("authorization"),
        content_type: header("content-type"),
        body,
    });
    if hang {
        std::future::pending::<()>().await;
    }
    status
}
