//! Timing helpers: timed runs of concurrent writers, percentiles, medians,
//! and the server the benchmarks use.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::server::{ServerOptions, TestServer};

/// The URI of the server to measure against, and the server if we started
/// it (kept alive by the caller).
pub fn server() -> (String, Option<TestServer>) {
    server_with(&ServerOptions::default())
}

/// [`server`], a server we start being started with `options` (the
/// ledger's benchmarks give the test server a larger oplog than its
/// default 100,000 entries and 1 hour: the fold reads the events
/// collection's change stream).
pub fn server_with(options: &ServerOptions) -> (String, Option<TestServer>) {
    match std::env::var("TALLY_BENCH_MONGODB_URI") {
        Ok(uri) if !uri.is_empty() => (uri, None),
        _ => {
            let server = TestServer::start(options);
            (server.uri(), Some(server))
        }
    }
}

/// A server with an oplog of `entries` entries and `retention` (see
/// [`server_with`]).
pub fn server_with_oplog(entries: u64, retention: Duration) -> (String, Option<TestServer>) {
    server_with(&ServerOptions {
        oplog_max_entries: Some(entries),
        oplog_retention: Some(retention),
        ..ServerOptions::default()
    })
}

/// Client options for benchmarks against `uri`: retryable writes off (the
/// test server slows down under many retryable writes, and both sides of a
/// comparison must pay the same), and a pool large enough for 16 writers.
pub async fn bench_options(uri: &str) -> mongodb::options::ClientOptions {
    let mut options = mongodb::options::ClientOptions::parse(uri)
        .await
        .expect("parse URI");
    options.retry_writes = Some(false);
    options.max_pool_size = Some(32);
    options
}

/// What one timed run measured.
#[derive(Debug, Clone)]
pub struct Run {
    pub ops: usize,
    pub elapsed: Duration,
    /// Every operation's latency, sorted.
    pub latencies: Vec<Duration>,
}

impl Run {
    pub fn per_second(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * (self.latencies.len() - 1) as f64).round() as usize;
        self.latencies[rank.min(self.latencies.len() - 1)]
    }
}

/// Runs `writers` tasks, each calling `op(writer, i)` in a loop for
/// `duration`, and measures every call.
pub async fn timed<F, Fut>(writers: usize, duration: Duration, op: F) -> Run
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0;
                while Instant::now() < deadline {
                    let t = Instant::now();
                    op(w, i).await;
                    latencies.push(t.elapsed());
                    i += 1;
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.expect("writer panicked"));
    }
    let elapsed = start.elapsed();
    latencies.sort();
    Run {
        ops: latencies.len(),
        elapsed,
        latencies,
    }
}

/// Several slices of the same side merged: total operations over total
/// time, all latencies together.
pub fn merge(runs: Vec<Run>) -> Run {
    let mut merged = Run {
        ops: 0,
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
    };
    for run in runs {
        merged.ops += run.ops;
        merged.elapsed += run.elapsed;
        merged.latencies.extend(run.latencies);
    }
    merged.latencies.sort();
    merged
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
