//! Each route and each status of the API as a client sees it, the outcome
//! objects the command line prints, and the OpenAPI document held against
//! what the daemon serves.

use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use super::{ApiDaemon, PATIENCE, Setup, outcome_of, send};
use crate::cli::{json, tallyd, write_config};

/// `tallyd record …` with the daemon's configuration: its JSON outcome.
async fn cli(daemon: &ApiDaemon, args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &super::config(&daemon.ctx, daemon.api, ""));
    let mut all = vec!["--config", path.as_str()];
    all.extend_from_slice(args);
    json(&tallyd(&all, &[]).await)
}

/// RFC 3339 for a time `ago` before now.
fn rfc3339(ago: Duration) -> String {
    humantime::format_rfc3339_seconds(SystemTime::now() - ago).to_string()
}

/// `tallyd record EVENT alice --by BY --collection orders --json`.
async fn record_by_cli(daemon: &ApiDaemon, event: &str, by: i64) -> Value {
    let by = by.to_string();
    let args = [
        "record",
        event,
        "alice",
        "--by",
        &by,
        "--collection",
        "orders",
        "--json",
    ];
    cli(daemon, &args).await
}

/// POSTs EVENT on alice by BY to orders.
async fn record_by_api(daemon: &ApiDaemon, event: &str, by: i64) -> (u16, Value) {
    let body = json!({ "event": event, "key": "alice", "by": by });
    daemon.post("orders", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_event_answers_with_its_status_and_the_command_lines_outcome() {
    let daemon = ApiDaemon::start("api_single", Setup::default()).await;
    let (status, recorded) = record_by_api(&daemon, "order-1", 3).await;
    assert_eq!(status, 201, "{recorded}");
    // The command line, recording an event of its own, prints the same
    // object but for the event's id.
    let mut by_cli = record_by_cli(&daemon, "order-2", 3).await;
    by_cli["event"] = json!("order-1");
    assert_eq!(recorded, by_cli);

    // A repeat: 200, the command line's duplicate.
    let (status, again) = record_by_api(&daemon, "order-1", 3).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again, record_by_cli(&daemon, "order-1", 3).await);
    assert_eq!(again["outcome"], "duplicate");

    // Another amount under the same id: 409, a problem carrying the
    // command line's conflict.
    let (status, conflict) = record_by_api(&daemon, "order-1", 5).await;
    assert_eq!(status, 409, "{conflict}");
    assert!(conflict["detail"].as_str().unwrap().contains("conflict"));
    assert_eq!(
        outcome_of(&conflict),
        record_by_cli(&daemon, "order-1", 5).await
    );
    assert_eq!(daemon.events("orders").await, 2);
    assert_eq!(daemon.value("alice").await, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotency_key_header_names_a_single_event() {
    let daemon = ApiDaemon::start("api_idempotency", Setup::default()).await;
    let post = || {
        daemon
            .client
            .post(daemon.url("/v1/orders/events"))
            .header("Idempotency-Key", "webhook-77")
            .json(&json!({ "key": "bob", "by": 2 }))
    };
    let (status, body) = send(post()).await;
    assert_eq!(
        (status, &body["event"]),
        (201, &json!("webhook-77")),
        "{body}"
    );
    let (status, body) = send(post()).await;
    assert_eq!(
        (status, &body["outcome"]),
        (200, &json!("duplicate")),
        "{body}"
    );
    assert_eq!(daemon.value("bob").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_every_item_in_order_and_records_the_well_formed_ones() {
    let daemon = ApiDaemon::start("api_batch", Setup::default()).await;
    let batch = json!([
        { "event": "b-1", "key": "carol" },
        { "key": "carol" },
        { "event": "b-2", "key": "carol", "by": 4 },
        { "event": "b-1", "key": "carol" },
        { "event": "b-3", "key": "carol", "by": "two" },
    ]);
    let (status, body) = daemon.post("orders", &batch).await;
    assert_eq!(status, 200, "{body}");
    let outcomes = body["outcomes"].as_array().unwrap();
    let names: Vec<&str> = outcomes
        .iter()
        .map(|o| o["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "recorded",
            "malformed",
            "recorded",
            "duplicate",
            "malformed"
        ]
    );
    for (i, outcome) in outcomes.iter().enumerate() {
        assert_eq!(outcome["index"], i, "{outcome}");
    }
    assert_eq!(outcomes[1]["error"], "\"event\" is missing");
    assert_eq!(daemon.value("carol").await, 5);

    // NDJSON, as `record --from` reads it: blank lines skipped, a line
    // that is not JSON reported by its number.
    let ndjson = "{\"event\":\"n-1\",\"key\":\"dave\"}\n\nnot json\n{\"event\":\"n-2\",\"key\":\"dave\",\"by\":2}\n";
    let (status, body) = send(
        daemon
            .client
            .post(daemon.url("/v1/orders/events"))
            .header("Content-Type", "application/x-ndjson")
            .body(ndjson),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let outcomes = body["outcomes"].as_array().unwrap();
    let lines: Vec<(u64, &str)> = outcomes
        .iter()
        .map(|o| (o["line"].as_u64().unwrap(), o["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(lines, [(1, "recorded"), (3, "malformed"), (4, "recorded")]);
    assert_eq!(
        outcomes[1]["error"], "not a JSON object: expected ident at column 2",
        "as record --from says it"
    );
    assert_eq!(daemon.value("dave").await, 3);
    assert_eq!(daemon.events("orders").await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_exact_and_print_what_get_prints() {
    let daemon = ApiDaemon::start("api_reads", Setup::default()).await;
    for (i, by) in [1, 2, 3].into_iter().enumerate() {
        let event = json!({ "event": format!("r-{i}"), "key": "erin", "by": by });
        assert_eq!(daemon.post("orders", &event).await.0, 201);
    }
    let (status, read) = daemon.get("/v1/orders/counters/erin").await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read["value"], 6);
    // The same JSON as `get --json`: the same fields, the same value. How
    // the value splits into folded and not yet folded follows the daemon's
    // fold between the two reads.
    let got = cli(
        &daemon,
        &["get", "erin", "--collection", "orders", "--json"],
    )
    .await;
    let fields = |v: &Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(fields(&read), fields(&got), "{read} vs {got}");
    assert_eq!((&read["key"], &read["value"]), (&got["key"], &got["value"]));
    for json in [&read, &got] {
        let (folded, unfolded) = (json["folded"].as_i64(), json["unfolded"].as_i64());
        assert_eq!(folded.zip(unfolded).map(|(f, u)| f + u), Some(6), "{json}");
    }

    // Buckets: two events a minute apart, read one bucket and a range.
    let (earlier, now) = (rfc3339(Duration::from_secs(60)), rfc3339(Duration::ZERO));
    for (event, at) in [("c-1", &earlier), ("c-2", &now), ("c-3", &now)] {
        let body = json!({ "event": event, "key": "line-1", "at": at });
        let (status, answer) = daemon.post("calls", &body).await;
        assert_eq!(status, 201, "{answer}");
        assert!(answer["bucket"].is_string(), "{answer}");
    }
    let (status, one) = daemon
        .get(&format!("/v1/calls/counters/line-1?at={now}"))
        .await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["total"], 2, "{one}");
    assert_eq!(one["buckets"].as_array().unwrap().len(), 1, "{one}");
    // Whole hours around now, summed by the hour.
    let epoch = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let hour = SystemTime::UNIX_EPOCH + Duration::from_secs(epoch - epoch % 3600);
    let shown = |at: SystemTime| humantime::format_rfc3339_seconds(at).to_string();
    let from = shown(hour - Duration::from_secs(3600));
    let to = shown(hour + Duration::from_secs(2 * 3600));
    let path = format!("/v1/calls/counters/line-1?from={from}&to={to}&by=hour");
    let (status, range) = daemon.get(&path).await;
    assert_eq!(status, 200, "{range}");
    assert_eq!(range["total"], 3, "{range}");
    let by_cli = cli(
        &daemon,
        &[
            "get",
            "line-1",
            "--from",
            &from,
            "--to",
            &to,
            "--by",
            "hour",
            "--collection",
            "calls",
            "--json",
        ],
    )
    .await;
    assert_eq!(range, by_cli);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_time_is_422_and_writes_nothing() {
    let daemon = ApiDaemon::start("api_refused_time", Setup::default()).await;
    let body = json!({ "event": "late-1", "key": "line-1", "at": "2020-01-01T00:00:00Z" });
    let (status, answer) = daemon.post("calls", &body).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["outcome"], "not_recorded", "{answer}");
    assert!(
        answer["detail"]
            .as_str()
            .unwrap()
            .contains("takes no more writes"),
        "{answer}"
    );
    let ahead = humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(3600));
    let body = json!({ "event": "ahead-1", "key": "line-1", "at": ahead.to_string() });
    assert_eq!(daemon.post("calls", &body).await.0, 422);
    assert_eq!(daemon.events("calls").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_exactly_what_is_served() {
    let daemon = ApiDaemon::start("api_openapi", Setup::default()).await;
    let (status, document) = daemon.get("/v1/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(document["openapi"], "3.1.0");
    let served_file: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/daemon/api/openapi.json"
    )))
    .unwrap();
    assert_eq!(document, served_file);
    // Every documented route and method is served; the others are not.
    let mut checked = 0;
    for (path, item) in document["paths"].as_object().unwrap() {
        let concrete = path
            .replace("{collection}", "orders")
            .replace("{key}", "alice");
        for method in ["get", "post", "put", "delete"] {
            let request = daemon.client.request(
                method.to_uppercase().parse().unwrap(),
                daemon.url(&concrete),
            );
            let request = if method == "post" {
                request.json(&json!({ "event": "openapi-1", "key": "alice" }))
            } else {
                request
            };
            let (status, body) = send(request).await;
            if item.get(method).is_some() {
                checked += 1;
                assert!(
                    item[method]["responses"].get(status.to_string()).is_some(),
                    "{method} {path}: {status} is not documented: {body}"
                );
                assert!(![404, 405].contains(&status), "{method} {path}: {status}");
            } else {
                assert_eq!(status, 405, "{method} {path} is not documented: {body}");
            }
        }
    }
    assert_eq!(checked, 3);
    let (status, body) = daemon.get("/v2/anything").await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_route_and_status_with_their_latency() {
    let daemon = ApiDaemon::start("api_metrics", Setup::default()).await;
    let body = json!({ "event": "m-1", "key": "frank" });
    assert_eq!(daemon.post("orders", &body).await.0, 201);
    assert_eq!(daemon.post("orders", &body).await.0, 200);
    assert_eq!(daemon.get("/v1/orders/counters/frank").await.0, 200);
    let route = "route=\"POST /v1/{collection}/events\"";
    for status in ["201", "200"] {
        let series = format!("tally_api_requests_total{{{route},status=\"{status}\"}}");
        daemon.daemon.wait_metric(&series, 1.0, PATIENCE).await;
    }
    let count = format!("tally_api_request_duration_seconds_count{{{route}}}");
    assert_eq!(daemon.daemon.metric(&count).await, Some(2.0));
    let recorded = "tally_api_events_total{collection=\"orders\",outcome=\"recorded\"}";
    assert_eq!(daemon.daemon.metric(recorded).await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_the_api_section_naming_tokens_never_showing_them() {
    let daemon = ApiDaemon::start("api_doctor", Setup::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let text = super::config(&daemon.ctx, daemon.api, "");
    let path = write_config(dir.path(), &text);
    let token = super::stored("tally_doctor_0123456789", "record:orders read:*");
    let env = [("TALLYD_API_TOKEN_DOCTOR", token.as_str())];
    let doctor = json(&tallyd(&["--config", &path, "doctor", "--json"], &env).await);
    let check = |name: &str| {
        doctor["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} check: {doctor}"))
    };
    let api = check("api");
    assert_eq!(api["verdict"], "ok", "{api}");
    let said = api["message"].as_str().unwrap();
    assert!(said.contains("doctor (record:orders read:*)"), "{said}");
    assert!(!doctor.to_string().contains("tally_doctor_0123456789"));

    // Without tokens: a warning; TLS files that are not: a failure.
    let lines = "tls_cert = \"/nonexistent/cert.pem\"\ntls_key = \"/nonexistent/key.pem\"\n";
    let path = write_config(dir.path(), &super::config(&daemon.ctx, daemon.api, lines));
    let doctor = json(&tallyd(&["--config", &path, "doctor", "--json"], &[]).await);
    let verdicts: Vec<(String, String)> = doctor["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"].as_str().unwrap().starts_with("api"))
        .map(|c| {
            (
                c["name"].as_str().unwrap().into(),
                c["verdict"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        verdicts,
        [
            ("api".into(), "warn".into()),
            ("api_tls".into(), "fail".into())
        ],
        "{doctor}"
    );
}
