//! The access and bad-input matrix: every request the API must refuse —
//! without a token, with a wrong one or one without the scope, over a
//! limit, not JSON, of the wrong types, with control characters or a key
//! of 100 kB — answers its status with a problem document that says what
//! to do, and writes nothing. No token ever shows in an answer or the log.

use serde_json::{Value, json};

use super::{ApiDaemon, Setup, send};
use crate::common::tallyd::{Tallyd, free_address};

/// The tokens of the matrix: `writer` records into orders and reads it,
/// `reader` only reads.
const WRITER: &str = "tally_writer_0123456789abcdef0123456789abcdef01234567";
const READER: &str = "tally_reader_0123456789abcdef0123456789abcdef01234567";

/// One row: what is sent, and the status it must get.
struct Row {
    what: &'static str,
    token: Option<&'static str>,
    path: &'static str,
    content_type: &'static str,
    idempotency: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
}

impl Row {
    fn json(what: &'static str, body: &Value, status: u16) -> Self {
        Self {
            what,
            token: Some(WRITER),
            path: "/v1/orders/events",
            content_type: "application/json",
            idempotency: None,
            body: body.to_string().into_bytes(),
            status,
        }
    }
}

fn rows() -> Vec<Row> {
    let event = json!({ "event": "e-1", "key": "home" });
    let batch: Vec<Value> = (0..6)
        .map(|i| json!({ "event": format!("b-{i}"), "key": "home" }))
        .collect();
    let huge_key = "k".repeat(100_000);
    vec![
        Row {
            token: None,
            ..Row::json("no token", &event, 401)
        },
        Row {
            token: Some("tally_guessed"),
            ..Row::json("a wrong token", &event, 401)
        },
        Row {
            token: Some(READER),
            ..Row::json("a token without record", &event, 403)
        },
        Row {
            path: "/v1/calls/events",
            ..Row::json("a token without the collection", &event, 403)
        },
        Row {
            path: "/v1/nothing/events",
            ..Row::json(
                "no such collection (a token without it: no scope would help)",
                &event,
                404,
            )
        },
        Row {
            token: Some(READER),
            path: "/v1/nothing/counters/home",
            ..Row::json(
                "no such collection (a token for every one)",
                &Value::Null,
                404,
            )
        },
        Row {
            body: vec![b' '; 300 * 1024],
            ..Row::json("a body over max_body_bytes", &event, 413)
        },
        Row::json("a batch over max_batch", &json!(batch), 413),
        Row {
            body: b"{\"event\": \"e-1\", ".to_vec(),
            ..Row::json("malformed JSON", &event, 400)
        },
        Row::json(
            "by of the wrong type",
            &json!({ "event": "e-1", "key": "home", "by": "two" }),
            400,
        ),
        Row::json(
            "a key of the wrong type",
            &json!({ "event": "e-1", "key": 7 }),
            400,
        ),
        Row::json(
            "an event id of the wrong type",
            &json!({ "event": 7, "key": "home" }),
            400,
        ),
        Row::json(
            "an unknown field",
            &json!({ "event": "e-1", "key": "home", "n": 1 }),
            400,
        ),
        Row::json(
            "a control character",
            &json!({ "event": "e-1\n", "key": "home" }),
            400,
        ),
        Row::json(
            "a key of 100 kB",
            &json!({ "event": "e-1", "key": huge_key }),
            400,
        ),
        Row::json(
            "an amount of 0",
            &json!({ "event": "e-1", "key": "home", "by": 0 }),
            400,
        ),
        Row::json(
            "an amount beyond max_amount",
            &json!({ "event": "e-1", "key": "home", "by": 1_000_000_001i64 }),
            400,
        ),
        Row::json("an array of nothing", &json!([]), 400),
        Row {
            idempotency: Some("e-2"),
            ..Row::json("an Idempotency-Key naming another event", &event, 400)
        },
        Row {
            idempotency: Some("e-2"),
            ..Row::json("an Idempotency-Key on a batch", &json!([event]), 400)
        },
        Row {
            content_type: "application/x-www-form-urlencoded",
            ..Row::json("a form", &event, 415)
        },
        Row {
            token: None,
            path: "/v1/orders/counters/home",
            ..Row::json("a read without a token", &Value::Null, 401)
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_a_problem_that_says_what_to_do_and_writes_nothing() {
    let (writer, reader) = (
        super::stored(WRITER, "record:orders read:orders"),
        super::stored(READER, "read:*"),
    );
    let setup = Setup {
        api: "max_body_bytes = 262144\nmax_batch = 5\n",
        env: vec![
            ("TALLYD_API_TOKEN_WRITER", writer.as_str()),
            ("TALLYD_API_TOKEN_READER", reader.as_str()),
        ],
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_refusals", setup).await;
    let mut failures = Vec::new();
    for row in rows() {
        let method = if row.path.contains("/counters/") {
            "GET"
        } else {
            "POST"
        };
        let mut request = daemon
            .client
            .request(method.parse().unwrap(), daemon.url(row.path))
            .header("Content-Type", row.content_type);
        if method == "POST" {
            request = request.body(row.body.clone());
        }
        if let Some(token) = row.token {
            request = request.bearer_auth(token);
        }
        if let Some(key) = row.idempotency {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await.expect("an answer");
        let status = response.status().as_u16();
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_owned();
        let challenge = response.headers().contains_key("www-authenticate");
        let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap_or_default();
        let detail = body["detail"].as_str().unwrap_or("");
        let said = format!("{}: {status} {body}", row.what);
        if status != row.status {
            failures.push(format!("expected {}; {said}", row.status));
        }
        if content_type != "application/problem+json"
            || body["status"] != row.status
            || !body["type"].as_str().is_some_and(|t| t.starts_with("tag:"))
            || body["title"].as_str().is_none_or(str::is_empty)
        {
            failures.push(format!("not a problem document: {content_type} {said}"));
        }
        // One sentence that says what to do: never Rust's Debug text, never
        // the 100 kB key, never a token.
        if detail.len() < 20 || detail.len() > 600 || detail.contains("Error {") {
            failures.push(format!("a detail people cannot use: {said}"));
        }
        if [WRITER, READER]
            .iter()
            .any(|t| body.to_string().contains(t))
        {
            failures.push(format!("a token in the answer: {said}"));
        }
        if (status == 401) != challenge {
            failures.push(format!("WWW-Authenticate only with 401: {said}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(daemon.events("orders").await, 0, "a refused request wrote");
    assert_eq!(daemon.events("calls").await, 0, "a refused request wrote");

    // The tokens do what they may.
    let good = daemon
        .client
        .post(daemon.url("/v1/orders/events"))
        .bearer_auth(WRITER)
        .json(&json!({ "event": "ok-1", "key": "home" }));
    assert_eq!(send(good).await.0, 201);
    let read = daemon
        .client
        .get(daemon.url("/v1/orders/counters/home"))
        .bearer_auth(READER);
    let (status, value) = send(read).await;
    assert_eq!((status, &value["value"]), (200, &json!(1)), "{value}");
    let log = daemon.daemon.log();
    assert!(!log.contains(WRITER) && !log.contains(READER), "{log}");
}

/// An address other hosts reach, without TLS and tokens, and without the
/// configuration saying so: the daemon does not start (78).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_api_on_the_network_refuses_to_start_unless_the_configuration_says_so() {
    let ctx = crate::common::TestContext::new("api_exposed").await;
    let listen = format!("0.0.0.0:{}", free_address().port())
        .parse()
        .unwrap();
    let text = super::config(&ctx, listen, "");
    let mut daemon = Tallyd::start(&text, &[]);
    let status = daemon.wait(super::PATIENCE);
    assert_eq!(status.code(), Some(78), "{}", daemon.log());
    let log = daemon.log();
    assert!(log.contains("api.listen"), "{log}");
    assert!(
        log.contains("serve_without = [\"tls\", \"tokens\"]"),
        "{log}"
    );
}

/// `tallyd api-token` makes a token and its line; the daemon started with
/// the line accepts the token for its scopes, and only for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_from_tallyd_api_token_works_for_its_scopes_only() {
    let ctx = crate::common::TestContext::new("api_token_made").await;
    let dir = tempfile::tempdir().unwrap();
    let path = crate::cli::write_config(dir.path(), &super::config(&ctx, free_address(), ""));
    let args = [
        "--config",
        path.as_str(),
        "api-token",
        "billing",
        "--record",
        "orders",
        "--json",
    ];
    let made = crate::cli::json(&crate::cli::tallyd(&args, &[]).await);
    let token = made["token"].as_str().unwrap().to_owned();
    let line = made["line"].as_str().unwrap();
    assert!(!line.contains(&token), "the line holds the token: {line}");
    let (variable, value) = line.split_once('=').unwrap();
    assert_eq!(variable, "TALLYD_API_TOKEN_BILLING");
    let setup = Setup {
        env: vec![(variable, value)],
        ..Setup::default()
    };
    let daemon = ApiDaemon::start("api_token_made", setup).await;
    let post = |token: Option<&str>| {
        let request = daemon
            .client
            .post(daemon.url("/v1/orders/events"))
            .json(&json!({ "event": "made-1", "key": "home" }));
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    };
    assert_eq!(send(post(None)).await.0, 401);
    assert_eq!(send(post(Some(&token))).await.0, 201);
    let read = daemon
        .client
        .get(daemon.url("/v1/orders/counters/home"))
        .bearer_auth(&token);
    assert_eq!(send(read).await.0, 403, "recording only");
    // A scope naming a collection without a ledger: refused, 78.
    let args = [
        "--config",
        path.as_str(),
        "api-token",
        "x",
        "--read",
        "views",
    ];
    let refused = crate::cli::tallyd(&args, &[]).await;
    assert_eq!(
        refused.status.code(),
        Some(78),
        "{}",
        crate::cli::text(&refused)
    );
}
