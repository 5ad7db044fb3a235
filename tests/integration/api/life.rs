//! The API's life with the daemon's: SIGTERM under load answers what it
//! accepted, truly, and exits 0 in time; SIGHUP under load reloads tokens
//! and limits all or nothing; before MongoDB answers, every request is
//! 503 with `Retry-After`; TLS with rustls.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::doc;
use serde_json::{Value, json};

use super::{ApiDaemon, PATIENCE, Setup, send, stop_deadline};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, wait_until};

/// What each event's one request was answered: the status, or `None`
/// when no answer came (a connection refused or cut).
type Said = Arc<Mutex<HashMap<String, Option<u16>>>>;

/// Clients posting fresh events to `url` (with `token`) until `stop`,
/// each event sent once; what each was answered goes into `said`.
fn load(
    url: String,
    token: Option<Arc<Mutex<String>>>,
    stop: Arc<AtomicBool>,
    said: Said,
    clients: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let (url, token, stop, said) = (url.clone(), token.clone(), stop.clone(), said.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let id = format!("load-{c}-{i}");
                    let mut request = client
                        .post(&url)
                        .timeout(PATIENCE)
                        .json(&json!({ "event": id, "key": "home" }));
                    if let Some(token) = &token {
                        let token = token.lock().unwrap().clone();
                        request = request.bearer_auth(token);
                    }
                    let status = request.send().await.ok().map(|r| r.status().as_u16());
                    said.lock().unwrap().insert(id, status);
                    if status.is_none() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect()
}

/// The ids of the events `orders_events` holds.
async fn recorded(ctx: &TestContext) -> std::collections::HashSet<String> {
    let events = ctx.client(false).await.collection("orders_events");
    let ids = events.distinct("_id", doc! {}).await.unwrap();
    ids.iter()
        .map(|id| id.as_str().unwrap().to_owned())
        .collect()
}

/// Every answer was true: each event answered 201 or 200 is recorded; no
/// answer said anything but those, `refused` (when given) and 503.
async fn every_answer_true(ctx: &TestContext, said: &Said, refused: &[u16]) -> usize {
    let stored = recorded(ctx).await;
    let said = said.lock().unwrap().clone();
    let mut counted = 0;
    for (id, status) in &said {
        match status {
            Some(201 | 200) => {
                assert!(
                    stored.contains(id),
                    "{id} was answered {status:?} but is not recorded"
                );
                counted += 1;
            }
            Some(503) | None => {}
            Some(other) if refused.contains(other) => {
                assert!(
                    !stored.contains(id),
                    "{id} was refused {other} yet recorded"
                );
            }
            Some(other) => panic!("{id} was answered {other}"),
        }
    }
    counted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_what_it_accepted_truly_and_exits_in_time() {
    let mut daemon = ApiDaemon::start("api_sigterm", Setup::default()).await;
    let (stop, said): (Arc<AtomicBool>, Said) = Default::default();
    let clients = load(
        daemon.url("/v1/orders/events"),
        None,
        stop.clone(),
        said.clone(),
        8,
    );
    wait_until("some events recorded", PATIENCE, || async {
        said.lock()
            .unwrap()
            .values()
            .filter(|s| **s == Some(201))
            .count()
            >= 50
    })
    .await;
    let started = Instant::now();
    daemon.daemon.signal("TERM");
    let status = daemon.daemon.wait(stop_deadline());
    assert_eq!(status.code(), Some(0), "{}", daemon.daemon.log());
    assert!(started.elapsed() < stop_deadline());
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    let counted = every_answer_true(&daemon.ctx, &said, &[]).await;
    assert!(counted >= 50, "{counted}");
    let log = daemon.daemon.log();
    assert!(!log.contains("deadline passed"), "{log}");
}

/// A request the daemon accepted before SIGTERM — its body still on the
/// way when the signal comes — is finished and answered truly before the
/// daemon exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_a_request_it_accepted_before_it_exits() {
    let mut daemon = ApiDaemon::start("api_sigterm_accepted", Setup::default()).await;
    let held = daemon.hold("held-1").await;
    daemon.daemon.signal("TERM");
    wait_until("the drain began", PATIENCE, || async {
        daemon.daemon.log().contains("shutting down")
    })
    .await;
    let answer = held.finish().await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let status = daemon.daemon.wait(stop_deadline());
    assert_eq!(status.code(), Some(0), "{}", daemon.daemon.log());
    assert!(recorded(&daemon.ctx).await.contains("held-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_under_load_reloads_tokens_and_limits_all_or_nothing() {
    let (a, b) = ("tally_token_a_0123456789", "tally_token_b_0123456789");
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("tallyd.env");
    let write_env = |lines: &[String]| std::fs::write(&env_file, lines.join("\n") + "\n").unwrap();
    write_env(&[format!(
        "TALLYD_API_TOKEN_A={}",
        super::stored(a, "record:orders")
    )]);
    let setup = Setup {
        api: "max_batch = 5\n",
        options: vec![OsStr::new("--env-file"), env_file.as_os_str()],
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_sighup", setup).await;
    let batch = |token: &str| {
        let events: Vec<Value> = (0..8)
            .map(|i| json!({ "event": format!("batch-{token}-{i}"), "key": "home" }))
            .collect();
        daemon
            .client
            .post(daemon.url("/v1/orders/events"))
            .bearer_auth(token)
            .json(&events)
    };
    assert_eq!(send(batch(a)).await.0, 413, "max_batch 5");
    let token = Arc::new(Mutex::new(a.to_owned()));
    let (stop, said): (Arc<AtomicBool>, Said) = Default::default();
    let url = daemon.url("/v1/orders/events");
    let clients = load(url, Some(token.clone()), stop.clone(), said.clone(), 4);
    let reloads = |log: &str, what: &str| log.matches(what).count();

    // A bad line: nothing of the new file is taken; A still records.
    write_env(&[
        format!("TALLYD_API_TOKEN_A={}", super::stored(a, "record:orders")),
        format!("TALLYD_API_TOKEN_B={b}"),
    ]);
    daemon.daemon.signal("HUP");
    daemon
        .daemon
        .wait_metric("tally_config_reload_failures_total", 1.0, PATIENCE)
        .await;
    let log = daemon.daemon.log();
    assert_eq!(reloads(&log, "configuration reloaded"), 0, "{log}");
    assert!(!log.contains(b), "a token in the log: {log}");
    let single = |token: &str, id: &str| {
        daemon
            .client
            .post(daemon.url("/v1/orders/events"))
            .bearer_auth(token)
            .json(&json!({ "event": id, "key": "home" }))
    };
    assert_eq!(send(single(a, "after-bad-a")).await.0, 201);
    assert_eq!(send(single(b, "after-bad-b")).await.0, 401);

    // A good file: B replaces A, and the batch limit rises — at once, as
    // a whole, while the load goes on (switching to B once it works).
    write_env(&[format!(
        "TALLYD_API_TOKEN_B={}",
        super::stored(b, "record:orders")
    )]);
    daemon
        .daemon
        .rewrite_config(&super::config(&daemon.ctx, daemon.api, "max_batch = 10\n"));
    daemon.daemon.signal("HUP");
    wait_until("the reload", PATIENCE, || async {
        reloads(&daemon.daemon.log(), "configuration reloaded") == 1
    })
    .await;
    *token.lock().unwrap() = b.to_owned();
    daemon.daemon.wait_ready("active", PATIENCE).await;
    assert_eq!(send(single(b, "after-good-b")).await.0, 201);
    assert_eq!(send(single(a, "after-good-a")).await.0, 401);
    assert_eq!(send(batch(b)).await.0, 200, "max_batch 10");
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    // Under the load: only true answers (A's requests refused 401 once B
    // took over, and nothing written for them).
    let counted = every_answer_true(&daemon.ctx, &said, &[401]).await;
    assert!(counted > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_mongodb_answers_every_request_is_503_with_retry_after() {
    let ctx = TestContext::new("api_not_ready").await;
    let api = free_address();
    let text = super::config(&ctx, api, "").replace(
        &ctx.child_uri(false),
        &format!("mongodb://{}/?directConnection=true", free_address()),
    );
    let daemon = Tallyd::start(&text, &[("RUST_LOG", "info")]);
    let client = reqwest::Client::new();
    let url = format!("http://{api}/v1/orders/events");
    wait_until("the API answers", PATIENCE, || async {
        client.post(&url).json(&json!({})).send().await.is_ok()
    })
    .await;
    let response = client
        .post(&url)
        .json(&json!({ "event": "early-1", "key": "home" }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(response.headers()["retry-after"], "5");
    let body: Value = response.json().await.unwrap();
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("nothing was written"),
        "{body}"
    );
    assert_eq!(daemon.ready_status().await, Some(503));
}

/// A test CA, and a certificate it signed for `localhost` with its key,
/// made by `openssl` into `dir`: (the CA, the certificate, the key).
fn certificate(dir: &std::path::Path) -> [std::path::PathBuf; 3] {
    let path = |name: &str| dir.join(name);
    std::fs::write(
        path("leaf.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    let steps: [&[&str]; 3] = [
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=tally test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "key.pem",
            "-out",
            "leaf.csr",
        ],
        &[
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "leaf.ext",
            "-out",
            "cert.pem",
        ],
    ];
    for args in steps {
        let made = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl makes the test's certificates (Debian: apt-get install openssl)");
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
    }
    [path("ca.pem"), path("cert.pem"), path("key.pem")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_by_rustls_serves_https_only() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, cert, key] = certificate(dir.path());
    let lines = format!(
        "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
        cert.display(),
        key.display()
    );
    let root = reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .add_root_certificate(root)
        .build()
        .unwrap();
    let setup = Setup {
        api: &lines,
        client: Some(client),
        scheme: Some("https"),
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_tls", setup).await;
    let (status, body) = daemon
        .post("orders", &json!({ "event": "tls-1", "key": "home" }))
        .await;
    assert_eq!(status, 201, "{body}");
    let plain = reqwest::Client::new()
        .get(format!("http://{}/v1/openapi.json", daemon.api))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP on the TLS port: {plain:?}");

    // A key that is not a key: the daemon does not start (78), naming it.
    std::fs::write(&key, "not a key").unwrap();
    let ctx = TestContext::new("api_tls_bad").await;
    let mut bad = Tallyd::start(&super::config(&ctx, free_address(), &lines), &[]);
    assert_eq!(bad.wait(PATIENCE).code(), Some(78), "{}", bad.log());
    assert!(bad.log().contains("[api] tls_key"), "{}", bad.log());
}
