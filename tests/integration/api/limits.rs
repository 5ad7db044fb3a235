//! The connection limits of `[api]`, from a raw socket: headers that do
//! not arrive in time, a connection left idle, a body that does not
//! arrive, one request more than `max_requests`; an unknown outcome (202)
//! settled by sending the same request again; and concurrent requests
//! sharing inserts (one `Ledger` handle for all), both seen in the MongoDB
//! proxy's log.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{ApiDaemon, PATIENCE, Setup, send};
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};

/// Reads from `stream` until the server closes it (or `within` passes):
/// what it sent, and how long the wait took.
async fn until_closed(stream: &mut TcpStream, within: Duration) -> (String, Duration) {
    let started = Instant::now();
    let mut read = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match tokio::time::timeout(within, stream.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => read.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("the connection was still open after {within:?}"),
        }
    }
    (
        String::from_utf8_lossy(&read).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_closed_and_a_slow_body_is_408() {
    let setup = Setup {
        api: "header_timeout = \"1s\"\nidle_timeout = \"2s\"\nbody_timeout = \"1s\"\n",
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_timeouts", setup).await;
    // Headers begun and never finished: closed after about a second.
    let mut slow = TcpStream::connect(daemon.api).await.unwrap();
    slow.write_all(b"POST /v1/orders/events HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (_, took) = until_closed(&mut slow, PATIENCE).await;
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "headers cut after {took:?}"
    );
    // A kept-alive connection after its answer, idle: closed after about
    // two seconds, not one (the header clock starts with a request).
    let mut idle = TcpStream::connect(daemon.api).await.unwrap();
    idle.write_all(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (answered, took) = until_closed(&mut idle, PATIENCE).await;
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "idle connection closed after {took:?}"
    );
    // A body that never comes: 408, nothing written.
    let mut stalled = TcpStream::connect(daemon.api).await.unwrap();
    stalled
        .write_all(
            b"POST /v1/orders/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"event\":",
        )
        .await
        .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, stalled.read(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert_eq!(daemon.events("orders").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_more_than_max_requests_is_503_at_once() {
    let setup = Setup {
        api: "max_requests = 1\nbody_timeout = \"20s\"\n",
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_max_requests", setup).await;
    // One request in flight, waiting for its body.
    let held = daemon.hold("first").await;
    let started = Instant::now();
    let response = daemon
        .client
        .post(daemon.url("/v1/orders/events"))
        .json(&json!({ "event": "second", "key": "home" }))
        .send()
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5), "not at once");
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: serde_json::Value = response.json().await.unwrap();
    assert!(
        body["detail"].as_str().unwrap().contains("max_requests"),
        "{body}"
    );
    // The held one finishes; then the next is served.
    let answer = held.finish().await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let again = daemon
        .client
        .post(daemon.url("/v1/orders/events"))
        .json(&json!({ "event": "second", "key": "home" }));
    assert_eq!(send(again).await.0, 201);
    assert_eq!(daemon.value("home").await, 2);
}

/// A daemon whose MongoDB traffic goes through a fault-injecting proxy
/// that logs it.
async fn through_a_proxy(
    name: &str,
) -> (
    Proxy,
    crate::common::tallyd::Tallyd,
    std::net::SocketAddr,
    tally::Store,
) {
    let ctx = crate::common::TestContext::new(name).await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let store = ctx.client(false).await.store();
    for spec in super::specs() {
        tally::Ledger::new(&store, spec)
            .create_indexes()
            .await
            .unwrap();
    }
    let api = crate::common::tallyd::free_address();
    let text = super::config(&ctx, api, "")
        .replace(&ctx.child_uri(false), &ctx.child_uri_through(&proxy, false));
    let daemon = crate::common::tallyd::Tallyd::start(&text, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", PATIENCE).await;
    (proxy, daemon, api, store)
}

/// The daemon's inserts of the ledger lose their replies (the insert and
/// its one retry): the event's outcome is unknown, 202. Sending the same
/// request again, once the network is back, settles it: counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_202_and_the_same_request_again_settles_it() {
    let (proxy, _daemon, api, store) = through_a_proxy("api_unknown").await;
    let client = reqwest::Client::new();
    let post = || {
        client
            .post(format!("http://{api}/v1/orders/events"))
            .json(&json!({ "event": "lost-1", "key": "home", "by": 4 }))
    };
    let (status, body) = {
        let _lost = proxy.rule(
            Rule::command("insert")
                .collection("orders_events")
                .then(Action::DropReply),
        );
        send(post()).await
    };
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["outcome"], "unknown", "{body}");
    assert!(body["error"].as_str().unwrap().contains("again"), "{body}");
    let (status, body) = send(post()).await;
    assert!(
        matches!(status, 200 | 201),
        "settled, counted once: {status} {body}"
    );
    let orders = tally::Ledger::new(&store, tally::CollectionConfig::new("orders"));
    assert_eq!(orders.value("home").await.unwrap().value, 4);
}

/// Concurrent requests go through one `Ledger` handle: 64 events posted
/// at once, each in a request of its own, reach MongoDB in far fewer
/// inserts than events (group commit across requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_inserts() {
    let (proxy, _daemon, api, store) = through_a_proxy("api_group_commit").await;
    let client = reqwest::Client::new();
    let before = proxy.requests("insert").len();
    let posts: Vec<_> = (0..64)
        .map(|i| {
            let request = client
                .post(format!("http://{api}/v1/orders/events"))
                .json(&json!({ "event": format!("g-{i}"), "key": "home" }));
            tokio::spawn(send(request))
        })
        .collect();
    for post in posts {
        assert_eq!(post.await.unwrap().0, 201);
    }
    let inserts = proxy
        .requests("insert")
        .iter()
        .skip(before)
        .filter(|e| e.collection.as_deref() == Some("orders_events"))
        .count();
    eprintln!("64 events posted at once reached MongoDB in {inserts} inserts");
    assert!(inserts < 32, "64 events took {inserts} inserts");
    let orders = tally::Ledger::new(&store, tally::CollectionConfig::new("orders"));
    assert_eq!(orders.value("home").await.unwrap().value, 64);
}
