//! The lifecycle matrix's rows for the HTTP API (`[api]`): each life event
//! of the daemon — a start, SIGHUP moving the API, SIGHUP to a port in
//! use, an outage, a second instance — crossed with what must hold for the
//! API after it: it serves (or answers 503 with `Retry-After` while MongoDB
//! is away, writing nothing), every event it said counted is counted, its
//! series are served, and SIGTERM stops it within the unit's deadline.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tally::{CollectionConfig, Ledger};

use super::scrape;
use crate::api::{PATIENCE, config};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, wait_until};
use crate::daemon::OwnServer;

/// One row's daemon and the events its API said counted.
struct Row {
    ctx: TestContext,
    daemon: Tallyd,
    api: SocketAddr,
    counted: i64,
    client: reqwest::Client,
}

impl Row {
    /// A daemon with `[api]` on, on `ctx`, ready.
    async fn start(ctx: TestContext, lines: &str) -> Self {
        let store = ctx.client(false).await.store();
        Ledger::new(&store, CollectionConfig::new("orders"))
            .create_indexes()
            .await
            .unwrap();
        let api = free_address();
        let daemon = Tallyd::start(&config(&ctx, api, lines), &[("RUST_LOG", "info")]);
        daemon.wait_ready("active", PATIENCE).await;
        Self {
            ctx,
            daemon,
            api,
            counted: 0,
            client: reqwest::Client::new(),
        }
    }

    /// Posts a fresh event `id` to the API at `api`: its status and body
    /// (`None`: no answer).
    async fn post(&self, api: SocketAddr, id: &str) -> Option<(u16, Value)> {
        let response = self
            .client
            .post(format!("http://{api}/v1/orders/events"))
            .timeout(PATIENCE)
            .json(&json!({ "event": id, "key": "home" }))
            .send()
            .await
            .ok()?;
        let status = response.status().as_u16();
        Some((status, response.json().await.unwrap_or_default()))
    }

    /// Records ten events through the API, each 201 — sending one again
    /// after a 503 or no answer, as a client does (the server may just be
    /// back, before the driver saw it).
    async fn record(&mut self, tag: &str) {
        for i in 0..10 {
            let id = format!("{tag}-{i}");
            let deadline = Instant::now() + PATIENCE;
            loop {
                match self.post(self.api, &id).await {
                    Some((201 | 200, _)) => break,
                    Some((503, _)) | None if Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    answer => panic!("{id}: {answer:?}\n{}", self.daemon.log()),
                }
            }
            self.counted += 1;
        }
    }

    /// Ready, serving the rules' series, recording, and every event it
    /// said counted is counted, exactly.
    async fn holds(&mut self) {
        assert!(self.daemon.running(), "{}", self.daemon.log());
        self.daemon.wait_ready("active", PATIENCE).await;
        let text = scrape(&self.daemon).await;
        for series in ["tally_ready 1", "tally_api_requests_in_flight 0"] {
            assert!(text.contains(series), "{series} not served: {text}");
        }
        self.record("after").await;
        let store = self.ctx.client(false).await.store();
        let orders = Ledger::new(&store, CollectionConfig::new("orders"));
        assert_eq!(orders.value("home").await.unwrap().value, self.counted);
    }

    /// SIGTERM: exit 0 within the unit's `TimeoutStopSec`.
    fn stops_in_time(&mut self) {
        let deadline = crate::api::stop_deadline();
        let started = Instant::now();
        self.daemon.signal("TERM");
        let status = self.daemon.wait(deadline);
        assert_eq!(status.code(), Some(0), "{}", self.daemon.log());
        assert!(started.elapsed() < deadline);
    }
}

fn listening(address: SocketAddr) -> bool {
    TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_a_fresh_start() {
    let ctx = TestContext::new("life_api_fresh").await;
    let mut row = Row::start(ctx, "").await;
    row.record("before").await;
    row.holds().await;
    row.stops_in_time();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_sighup_to_another_api_port() {
    let ctx = TestContext::new("life_api_move").await;
    let mut row = Row::start(ctx, "").await;
    row.record("before").await;
    let (old, new) = (row.api, free_address());
    row.daemon.rewrite_config(&config(&row.ctx, new, ""));
    row.daemon.signal("HUP");
    wait_until("the API serves on the new port", PATIENCE, || async {
        matches!(row.post(new, "moved-0").await, Some((201, _)))
    })
    .await;
    row.counted += 1;
    wait_until("the old API port closed", PATIENCE, || async {
        !listening(old)
    })
    .await;
    row.api = new;
    row.holds().await;
    row.stops_in_time();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_sighup_to_an_api_port_in_use() {
    let ctx = TestContext::new("life_api_taken").await;
    let mut row = Row::start(ctx, "").await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    row.daemon
        .rewrite_config(&config(&row.ctx, taken.local_addr().unwrap(), ""));
    row.daemon.signal("HUP");
    row.daemon
        .wait_metric("tally_config_reload_failures_total", 1.0, PATIENCE)
        .await;
    let log = row.daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains("configuration not reloaded"))
        .unwrap();
    assert!(line.contains("[api] listen"), "{line}");
    // The old API runs on, as it was.
    row.holds().await;
    row.stops_in_time();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_an_outage() {
    if crate::common::external() {
        return; // stops its own server
    }
    let own = OwnServer::new();
    let mut server = own.start();
    let ctx = TestContext::on("life_api_outage", server.uri()).await;
    let mut row = Row::start(ctx, "").await;
    row.record("before").await;
    server.stop();
    // While MongoDB is away: 503 with Retry-After, or no answer — never
    // an event said counted.
    let mut unavailable = 0;
    for i in 0..5 {
        let id = format!("during-{i}");
        let response = row
            .client
            .post(format!("http://{}/v1/orders/events", row.api))
            .timeout(PATIENCE)
            .json(&json!({ "event": id, "key": "home" }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 503, "{id}");
        assert!(response.headers().contains_key("retry-after"));
        unavailable += 1;
    }
    assert_eq!(unavailable, 5);
    let _server = own.start();
    row.holds().await;
    let store = row.ctx.client(false).await.store();
    let events = store.collection("orders_events");
    let during = events
        .count_documents(mongodb::bson::doc! { "_id": { "$regex": "^during-" } })
        .await
        .unwrap();
    assert_eq!(during, 0, "an event answered 503 was written");
    row.stops_in_time();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_a_second_instance_records_too() {
    let ctx = TestContext::new("life_api_second").await;
    let ha = "\n[ha]\nenabled = true\nlease_ttl = \"6s\"\n";
    let store = ctx.client(false).await.store();
    let orders = Ledger::new(&store, CollectionConfig::new("orders"));
    orders.create_indexes().await.unwrap();
    let first = Tallyd::start(&(config(&ctx, free_address(), "") + ha), &[]);
    first.wait_ready("active", PATIENCE).await;
    let api = free_address();
    let second = Tallyd::start(&(config(&ctx, api, "") + ha), &[]);
    second.wait_ready("standby", PATIENCE).await;
    let mut row = Row {
        ctx,
        daemon: second,
        api,
        counted: 0,
        client: reqwest::Client::new(),
    };
    // The standby's API records: folding is the active instance's work.
    row.record("on the standby").await;
    assert_eq!(orders.value("home").await.unwrap().value, row.counted);
    row.stops_in_time();
    drop(first);
}
