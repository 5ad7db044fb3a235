//! `tallyd run` measured from outside, as an operator sees it: start to
//! ready, idle memory, how soon a stuck token is noticed, and how far the
//! change stream falls behind under the heaviest write load the server
//! takes.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use mongodb::bson::{Document, doc, oid::ObjectId};
use mongodb::{Client, Collection};
use tally::{CollectionConfig, Counters, Increment, Store, WriterConfig};

use crate::Settings;
use crate::measure::{bench_options, server};

const STUCK_AFTER: Duration = Duration::from_secs(3);

pub(crate) struct Daemon {
    child: Child,
    http: String,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(uri: &str) -> Self {
        Self::start_with(
            uri,
            &format!(
                "database = \"tally_bench_daemon\"\n\
                 server_selection_timeout = \"500ms\"\nattempt_timeout = \"900ms\"\n\
                 [[collections]]\nname = \"views\"\n[writer]\nretry_horizon = \"2s\"\n\
                 [reconcile]\ngrace = \"{stuck}s\"\n[schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n\
                 [alerts]\nstuck_after = \"{stuck}s\"\n",
                stuck = STUCK_AFTER.as_secs()
            ),
        )
    }

    /// `tallyd run` on `uri` with `settings` (the rest of `[mongodb]`, then
    /// any other tables), listening on a free port, logging warnings only.
    pub(crate) fn start_with(uri: &str, settings: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .to_string();
        let config = dir.path().join("tallyd.toml");
        std::fs::write(
            &config,
            format!(
                "[mongodb]\nuri = \"{uri}\"\n{settings}\
                 [http]\nlisten = \"{http}\"\n[log]\nlevel = \"warn\"\n"
            ),
        )
        .expect("config");
        let child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
            .arg("--config")
            .arg(&config)
            .arg("run")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tallyd");
        Self {
            child,
            http,
            _dir: dir,
        }
    }

    pub(crate) async fn ready(&self) -> bool {
        matches!(
            reqwest::get(format!("http://{}/readyz", self.http)).await,
            Ok(r) if r.status().is_success()
        )
    }

    pub(crate) async fn metric(&self, series: &str) -> Option<f64> {
        let text = reqwest::get(format!("http://{}/metrics", self.http))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    fn memory_kib(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

pub async fn run(settings: &Settings) {
    let (uri, _server) = server();
    let options = bench_options(&uri).await;
    let client = Client::with_options(options.clone()).expect("client");
    let db = client.database("tally_bench_daemon");
    db.drop().await.expect("drop");
    let views: Collection<Document> = db.collection("views");
    views
        .insert_one(doc! { "_id": "seed", "counter": 0i64 })
        .await
        .expect("seed");

    println!("daemon: tallyd run as an operator sees it");
    let started = Instant::now();
    let daemon = Daemon::start(&uri);
    while !daemon.ready().await {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "tallyd never became ready"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "  start to ready (/readyz 200):          {:>7.0} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    while daemon
        .metric("tally_monitor_up{collection=\"views\"}")
        .await
        != Some(1.0)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!(
        "  idle RSS after 5 s (target <= 20 MB):   {:>7.1} MB  (peak so far {:.1} MB)",
        daemon.memory_kib("VmRSS:") as f64 / 1024.0,
        daemon.memory_kib("VmHWM:") as f64 / 1024.0
    );

    // Stuck-token detection: a token written now is stuck after
    // STUCK_AFTER; how long until the daemon's gauge shows it.
    let mut latencies = Vec::new();
    for round in 0..settings.rounds.min(5) {
        let id = format!("stuck-{round}");
        let token = ObjectId::new();
        let written = SystemTime::now();
        views
            .update_one(doc! { "_id": &id }, doc! { "$push": { "pending": token } })
            .upsert(true)
            .await
            .expect("write a token");
        loop {
            if daemon
                .metric("tally_stuck_tokens{collection=\"views\"}")
                .await
                .unwrap_or(0.0)
                >= 1.0
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        latencies.push(written.elapsed().unwrap_or_default());
        views
            .delete_one(doc! { "_id": &id })
            .await
            .expect("clean up");
        while daemon
            .metric("tally_stuck_tokens{collection=\"views\"}")
            .await
            .unwrap_or(1.0)
            > 0.0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    latencies.sort();
    println!(
        "  stuck-token detection, from the write (stuck_after {}s; target <= {}s): median {:.2} s, max {:.2} s ({} rounds)",
        STUCK_AFTER.as_secs(),
        STUCK_AFTER.as_secs() + 2,
        latencies[latencies.len() / 2].as_secs_f64(),
        latencies.last().unwrap().as_secs_f64(),
        latencies.len()
    );

    // Change-stream lag under load: 16 writers incrementing as fast as the
    // server takes; the daemon's lag gauge sampled meanwhile.
    let store = Store::from_parts(client.clone(), &options, "tally_bench_daemon");
    let counters = Counters::new(
        &store,
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let increments = Arc::new(AtomicU64::new(0));
    let events_before = daemon
        .metric("tally_monitor_events_total{collection=\"views\"}")
        .await
        .unwrap_or(0.0);
    let writers: Vec<_> = (0..16)
        .map(|w| {
            let (counters, stop, increments) = (counters.clone(), stop.clone(), increments.clone());
            tokio::spawn(async move {
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    match counters.increment(format!("k{}", (w + i) % 100), 1).await {
                        Increment::Counted(_) | Increment::Pending(_) => {}
                        other => panic!("not counted: {other:?}"),
                    }
                    increments.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let load = settings.run.max(Duration::from_secs(10));
    let load_started = Instant::now();
    let mut lags = Vec::new();
    while load_started.elapsed() < load {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(lag) = daemon
            .metric("tally_monitor_lag_seconds{collection=\"views\"}")
            .await
        {
            lags.push(lag);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.expect("writer");
    }
    let wrote = increments.load(Ordering::Relaxed);
    let elapsed = load_started.elapsed().as_secs_f64();
    // Two writes per increment; wait for the stream to drain them.
    let expected_events = events_before + 2.0 * wrote as f64;
    let drain_started = Instant::now();
    while daemon
        .metric("tally_monitor_events_total{collection=\"views\"}")
        .await
        .unwrap_or(0.0)
        < expected_events
    {
        if drain_started.elapsed() > Duration::from_secs(120) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    lags.sort_by(f64::total_cmp);
    println!(
        "  load: 16 writers, {wrote} increments ({:.0}/s, {:.0} writes/s) for {elapsed:.0} s",
        wrote as f64 / elapsed,
        2.0 * wrote as f64 / elapsed
    );
    println!(
        "  change-stream lag under that load: median {:.2} s, max {:.2} s ({} samples); all events drained {:.1} s after the load stopped",
        lags.get(lags.len() / 2).copied().unwrap_or(0.0),
        lags.last().copied().unwrap_or(0.0),
        lags.len(),
        drain_started.elapsed().as_secs_f64()
    );
    println!(
        "  RSS after the load: {:.1} MB (peak {:.1} MB)",
        daemon.memory_kib("VmRSS:") as f64 / 1024.0,
        daemon.memory_kib("VmHWM:") as f64 / 1024.0
    );
}
