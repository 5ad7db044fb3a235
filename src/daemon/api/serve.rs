//! The API's connections: accepted on `[api] listen`, wrapped in TLS when
//! `tls_cert` and `tls_key` are set (rustls), served as HTTP/1.1 with
//! keep-alive, and held to the timeouts of `[api]`:
//!
//! - `header_timeout`: from a request's first byte to the end of its
//!   headers;
//! - `idle_timeout`: a connection with no request in flight and nothing
//!   sent or received for this long is closed;
//! - (`body_timeout` is the handler's: the body must arrive within it.)
//!
//! A connection with a request in flight is never cut by a timeout: the
//! request is bounded by the ledger's own attempts. At a stop or reload
//! the listener closes first (connections that come meanwhile wait in the
//! socket's backlog for the next run, which serves the same socket), every
//! connection finishes the request it is serving and answers it, idle ones
//! close, and [`serve`] returns once all are done.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::Api;
use crate::config::{ApiConfig, ApiLimits, Config};
use crate::daemon::{DaemonError, Listening};

/// How often a connection's timeouts are looked at, at the most: they are
/// kept to within this.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// The TLS acceptor `[api] tls_cert` and `tls_key` make (`None`: plain
/// HTTP); why not, in one sentence naming the key, when the files cannot
/// be used.
pub(crate) fn tls_acceptor(api: &ApiConfig) -> Result<Option<TlsAcceptor>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls;
    let (Some(cert), Some(key)) = (&api.tls_cert, &api.tls_key) else {
        return Ok(None);
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|err| {
            format!(
                "cannot read a certificate chain from [api] tls_cert {} ({err}); give a PEM file \
                 the daemon can read",
                cert.display()
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "[api] tls_cert {} holds no certificate; give a PEM file with the chain",
            cert.display()
        ));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|err| {
        format!(
            "cannot read a private key from [api] tls_key {} ({err}); give a PEM file the \
             daemon can read",
            key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("cannot set up TLS: {err}"))?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|err| {
            format!(
                "[api] tls_cert {} and tls_key {} do not make a usable pair ({err}); give the \
                 key of that certificate",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

/// Starts serving `api` on the run's duplicate of `socket` (`[api]
/// listen`), in `tracker`, until `shutdown`.
pub(crate) fn start(
    config: &Config,
    socket: &Listening,
    tls: Option<TlsAcceptor>,
    api: Api,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<(), DaemonError> {
    let listener = socket
        .socket
        .try_clone()
        .and_then(TcpListener::from_std)
        .map_err(|err| {
            DaemonError::Start(format!(
                "cannot serve on {} ([api] listen): {err}",
                config.api.listen
            ))
        })?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let access = if config.api.tokens.is_empty() {
        "open: no token configured".to_owned()
    } else {
        format!("{} tokens", config.api.tokens.len())
    };
    tracing::info!(listen = %config.api.listen, scheme, access, "serving the API");
    tracker.spawn(serve(
        listener,
        tls,
        api.router(),
        config.api.limits,
        shutdown.clone(),
    ));
    Ok(())
}

/// Serves `app` on `listener` (through `tls`, when given) until
/// `shutdown`, then drains: see the module's documentation.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    limits: ApiLimits,
    shutdown: CancellationToken,
) {
    let connections = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, most likely: the connection
                    // waits in the backlog; try again in a moment.
                    tracing::warn!(cause = %err, "the API cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (app, tls, stop) = (app.clone(), tls.clone(), shutdown.clone());
        connections.spawn(async move {
            match tls {
                None => connection(stream, app, limits, stop).await,
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(limits.header_timeout, acceptor.accept(stream));
                    tokio::select! {
                        () = stop.cancelled() => {}
                        done = handshake => if let Ok(Ok(stream)) = done {
                            connection(stream, app, limits, stop).await;
                        },
                    }
                }
            }
        });
    }
    // No new connection is taken: they wait in the socket's backlog.
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Serves one connection until the client closes it, a timeout closes it,
/// or `stop` (after the request in flight is answered).
async fn connection<I>(io: I, app: Router, limits: ApiLimits, stop: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = Watched {
        inner: io,
        activity: activity.clone(),
    };
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            activity.request_began();
            let answered = app.clone().oneshot(request);
            let activity = activity.clone();
            async move {
                let response = answered.await;
                activity.request_ended();
                response
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // A backstop only: the watch below keeps the tighter bounds.
        .header_read_timeout(limits.header_timeout + limits.idle_timeout + WATCH_EVERY)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = stop.cancelled(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
            () = activity.expired(&limits) => return,
        }
    }
}

/// What a connection is doing, for its timeouts: milliseconds since it
/// opened of its last byte in or out, of the first byte of a request whose
/// headers are not in yet (0: none), and the requests in flight.
struct Activity {
    opened: Instant,
    last: AtomicU64,
    receiving_since: AtomicU64,
    in_flight: AtomicU32,
}

impl Activity {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            last: AtomicU64::new(0),
            receiving_since: AtomicU64::new(0),
            in_flight: AtomicU32::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn read(&self) {
        let now = self.now();
        self.last.store(now, Ordering::Relaxed);
        if self.in_flight.load(Ordering::Relaxed) == 0 {
            // The first byte of a request: its headers' clock starts (+1:
            // 0 means none).
            let _ = self.receiving_since.compare_exchange(
                0,
                now + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    fn wrote(&self) {
        self.last.store(self.now(), Ordering::Relaxed);
    }

    fn request_began(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.receiving_since.store(0, Ordering::Relaxed);
    }

    fn request_ended(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.wrote();
    }

    /// Returns once the connection is past a timeout: its headers took
    /// longer than `header_timeout`, or it was idle for `idle_timeout`.
    /// Never while a request is in flight.
    async fn expired(&self, limits: &ApiLimits) {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        loop {
            let now = self.now();
            let deadline = if self.in_flight.load(Ordering::Relaxed) > 0 {
                None
            } else {
                match self.receiving_since.load(Ordering::Relaxed) {
                    0 => Some(self.last.load(Ordering::Relaxed) + millis(limits.idle_timeout)),
                    since => Some(since - 1 + millis(limits.header_timeout)),
                }
            };
            let wait = match deadline {
                Some(deadline) if now >= deadline => return,
                Some(deadline) => Duration::from_millis(deadline - now).min(WATCH_EVERY),
                None => WATCH_EVERY,
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// A connection's stream, noting its activity.
struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.wrote();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
