//! The sides of `tallyd bench` that measure the events ledger as other
//! languages reach it, against the library's:
//!
//! - `http`: each caller a keep-alive HTTP client posting single events
//!   to a real `tallyd run` with `[api]` on (started by the bench, on the
//!   scratch collection, on loopback ports of its own);
//! - `http-batch`: the same, posting batches of [`BATCH`] events;
//! - `ledger-batch`: the library's `record_many` of [`BATCH`] events;
//! - `record-process`: one `tallyd record` process per event, as a shell
//!   script or another language without the API would.
//!
//! A batch side counts events (each with its batch's latency). The daemon
//! runs as deployed — it also folds the scratch ledger as events come —
//! and its peak resident memory is read from `/proc` once the sides ran.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{Handles, Protocol, Told};
use crate::config::Config;
use crate::ledger::Recording;
use crate::write::counter::CollectionConfig;

/// Events per batch of the batch sides.
pub(super) const BATCH: usize = 100;

/// How long the bench waits for its daemon to be ready.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The bench's own `tallyd run`, serving the scratch collection's ledger
/// over HTTP, and what its sides need to reach it.
pub(super) struct Daemon {
    child: std::sync::Mutex<Option<tokio::process::Child>>,
    /// The API's base URL.
    base: String,
    client: reqwest::Client,
    /// Its configuration file (a `tallyd record` process reads it too),
    /// removed at the end.
    config: std::path::PathBuf,
    /// The scratch collection.
    collection: String,
    /// The URI, handed to children through the environment only.
    uri: String,
}

/// A free loopback address.
fn free_address() -> Result<std::net::SocketAddr, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|err| format!("cannot find a free loopback port: {err}"))
}

/// The configuration of the bench's daemon: `config`'s server and
/// settings, the scratch collection `spec` with its ledger as the only
/// collection, its state in `state`, `[http]` and `[api]` on free loopback
/// ports, no schedule run at start and no webhook.
fn daemon_config(
    config: &Config,
    spec: &CollectionConfig,
    state: &str,
) -> Result<(Config, std::net::SocketAddr), String> {
    let mut own = config.clone();
    let api = free_address()?;
    own.collections = vec![
        spec.clone()
            .with_events_collection(spec.events_collection_name()),
    ];
    own.api.enabled = true;
    own.api.listen = api;
    own.api.tokens.clear();
    own.http.listen = free_address()?;
    own.schedule.catch_up = false;
    own.ha.enabled = false;
    own.alerts.webhook = None;
    own.daemon.state_collection = state.to_owned();
    Ok((own, api))
}

impl Daemon {
    /// Starts `tallyd run` on the scratch collection `spec` and waits until
    /// its API answers.
    pub(super) async fn start(
        config: &Config,
        spec: &CollectionConfig,
        state: &str,
    ) -> Result<Self, String> {
        let (own, api) = daemon_config(config, spec, state)?;
        let path = std::env::temp_dir().join(format!("{}.toml", spec.name));
        std::fs::write(&path, own.to_redacted_toml())
            .map_err(|err| format!("cannot write {}: {err}", path.display()))?;
        let uri = config.mongodb.uri.expose().to_owned();
        let exe = std::env::current_exe()
            .map_err(|err| format!("cannot find this program to start the daemon: {err}"))?;
        let child = tokio::process::Command::new(exe)
            .arg("--config")
            .arg(&path)
            .arg("run")
            .env("TALLYD__MONGODB__URI", &uri)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| format!("cannot start the bench's daemon: {err}"))?;
        let daemon = Self {
            child: std::sync::Mutex::new(Some(child)),
            base: format!("http://{api}"),
            client: reqwest::Client::new(),
            config: path,
            collection: spec.name.clone(),
            uri,
        };
        let ready = format!("{}/v1/openapi.json", daemon.base);
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let answered = daemon.client.get(&ready).send().await;
            let probe = format!("{}/v1/{}/counters/ready", daemon.base, daemon.collection);
            let counted = daemon.client.get(&probe).send().await;
            if answered.is_ok() && counted.is_ok_and(|r| r.status().as_u16() != 503) {
                return Ok(daemon);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the bench's daemon (tallyd run with [api]) was not ready within {}",
                    humantime::format_duration(READY_WITHIN)
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The daemon's peak resident memory so far, in bytes (`VmHWM`).
    pub(super) fn peak_rss(&self) -> Option<u64> {
        let pid = self.child.lock().ok()?.as_ref()?.id()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    }

    /// Stops the daemon with SIGTERM (its drain), killing it after 30 s,
    /// and removes its configuration file.
    pub(super) async fn stop(&self) {
        let _ = std::fs::remove_file(&self.config);
        let Some(mut child) = self.child.lock().ok().and_then(|mut c| c.take()) else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = tokio::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        let waited = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        if waited.is_err() {
            let _ = child.kill().await;
        }
    }
}

/// The bench's daemon, when a side of `protocols` needs it.
pub(super) async fn start_for(
    protocols: &[Protocol],
    config: &Config,
    spec: &CollectionConfig,
    state: &str,
) -> Result<Option<Daemon>, String> {
    let needed = [Protocol::Http, Protocol::HttpBatch, Protocol::RecordProcess];
    if !protocols.iter().any(|p| needed.contains(p)) {
        return Ok(None);
    }
    Daemon::start(config, spec, state).await.map(Some)
}

/// Once the sides ran: the daemon's peak memory, said, and the daemon
/// stopped.
pub(super) async fn finish(daemon: Option<&Daemon>) {
    let Some(daemon) = daemon else { return };
    if let Some(rss) = daemon.peak_rss() {
        eprintln!(
            "the bench's daemon (tallyd run with [api]): peak resident memory {:.1} MB",
            rss as f64 / 1e6
        );
    }
    daemon.stop().await;
}

/// One operation of an API-side `protocol`: an event `event` on `key` (a
/// batch side: [`BATCH`] events from there on, over the keys after it).
pub(super) async fn one(handles: &Handles, protocol: Protocol, key: String, event: String) -> Told {
    match protocol {
        Protocol::Http => post(handles, vec![(event, key)]).await,
        Protocol::HttpBatch => post(handles, batch(handles, &key, &event)).await,
        Protocol::LedgerBatch => {
            let events = batch(handles, &key, &event)
                .into_iter()
                .map(|(event, key)| (event, key, 1));
            let recordings = handles.ledger.record_many(events).await;
            Told::Many(recordings.iter().map(told).collect())
        }
        Protocol::RecordProcess => process(handles, &key, &event).await,
        _ => unreachable!("a side of the library"),
    }
}

/// What a recording tells the bench.
fn told(recording: &Recording) -> Told {
    match recording {
        Recording::Recorded(_) => Told::Counted,
        // The library's side settles its unknowns with the ticket; here the
        // outcome is checked against the counters anyway.
        Recording::Unknown(_) => Told::Failed,
        Recording::Duplicate(_) | Recording::Conflict(_) | Recording::NotRecorded(_) => {
            Told::NotCounted
        }
    }
}

/// [`BATCH`] events, from `event` and `key` on: `event:0`…, on the keys
/// after `key`'s number.
fn batch(handles: &Handles, key: &str, event: &str) -> Vec<(String, String)> {
    let (prefix, n) = key.rsplit_once(':').unwrap_or((key, "0"));
    let n: u64 = n.parse().unwrap_or(0);
    (0..BATCH as u64)
        .map(|j| {
            let key = format!("{prefix}:{}", (n + j * 7) % u64::from(handles.keys));
            (format!("{event}:{j}"), key)
        })
        .collect()
}

/// Posts `events` (one: a single event; more: a JSON array), sending it
/// again while its answer is unknown, as the API's clients do.
async fn post(handles: &Handles, events: Vec<(String, String)>) -> Told {
    let Some(daemon) = &handles.api else {
        return Told::Failed;
    };
    let url = format!("{}/v1/{}/events", daemon.base, daemon.collection);
    let body = |(event, key): &(String, String)| json!({ "event": event, "key": key });
    let payload = match events.as_slice() {
        [one] => body(one),
        many => Value::Array(many.iter().map(body).collect()),
    };
    for _ in 0..10 {
        let Ok(response) = daemon.client.post(&url).json(&payload).send().await else {
            continue;
        };
        let status = response.status().as_u16();
        let Ok(answer) = response.json::<Value>().await else {
            continue;
        };
        let outcome = |o: &Value| match o["outcome"].as_str() {
            Some("recorded") => Some(Told::Counted),
            Some("unknown") | None => None,
            Some(_) => Some(Told::NotCounted),
        };
        let told: Option<Vec<Told>> = match (status, events.len()) {
            (503, _) => None,
            (_, 1) => outcome(&answer).map(|t| vec![t]),
            (_, _) => answer["outcomes"]
                .as_array()
                .and_then(|all| all.iter().map(outcome).collect()),
        };
        if let Some(mut told) = told {
            return if told.len() == 1 {
                told.remove(0)
            } else {
                Told::Many(told)
            };
        }
    }
    Told::Failed
}

/// One `tallyd record EVENT KEY` process, on the bench daemon's
/// configuration (the URI through the environment).
async fn process(handles: &Handles, key: &str, event: &str) -> Told {
    let Some(daemon) = &handles.api else {
        return Told::Failed;
    };
    let Ok(exe) = std::env::current_exe() else {
        return Told::Failed;
    };
    let status = tokio::process::Command::new(exe)
        .arg("--config")
        .arg(&daemon.config)
        .args(["record", event, key, "--collection", &daemon.collection])
        .env("TALLYD__MONGODB__URI", &daemon.uri)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    match status.map(|s| s.code()) {
        Ok(Some(0)) => Told::Counted,
        Ok(Some(1)) => Told::NotCounted,
        _ => Told::Failed,
    }
}
