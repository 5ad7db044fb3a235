//! The alert engine's tests: the ledger's transitions and the handle,
//! then the engine against a real webhook receiver on loopback — what
//! arrives, in which order, how often, with which header; what happens when
//! the receiver fails or is not there; what the logs never show.
//!
//! No database is involved: these tests do not start the test server.

use std::net::SocketAddr;

use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::*;
use crate::config::Config;

// The receiver the daemon's integration tests use too.
#[path = "../../../tests/integration/common/receiver.rs"]
mod receiver;
use receiver::Receiver;

fn seen(count: u64) -> Observation {
    Observation {
        count,
        oldest_age: Some(Duration::from_secs(count * 60)),
        sample_ids: vec![format!("doc{count}")],
        detail: None,
    }
}

#[test]
fn a_condition_fires_once_while_it_holds_and_keeps_the_latest_observation() {
    let mut ledger = Ledger::default();
    let t0 = Instant::now();
    assert_eq!(
        ledger.apply(AlertKind::StuckTokens, "views", Some(seen(1)), t0),
        Some(Change::Fired(seen(1)))
    );
    for n in 2..10 {
        let later = t0 + Duration::from_secs(n);
        assert_eq!(
            ledger.apply(AlertKind::StuckTokens, "views", Some(seen(n)), later),
            None
        );
    }
    assert_eq!(ledger.firing.len(), 1);
    assert_eq!(
        ledger.firing[&(AlertKind::StuckTokens, "views".to_owned())].observation,
        seen(9)
    );
}

#[test]
fn a_condition_resolves_once_with_its_last_observation_and_duration() {
    let mut ledger = Ledger::default();
    let t0 = Instant::now();
    ledger.apply(AlertKind::RunFailed, "views", Some(seen(1)), t0);
    ledger.apply(AlertKind::RunFailed, "views", Some(seen(3)), t0);
    assert_eq!(
        ledger.apply(
            AlertKind::RunFailed,
            "views",
            None,
            t0 + Duration::from_secs(90)
        ),
        Some(Change::Resolved {
            last: seen(3),
            lasted: Duration::from_secs(90)
        })
    );
    for n in 0..5 {
        let later = t0 + Duration::from_secs(100 + n);
        assert_eq!(
            ledger.apply(AlertKind::RunFailed, "views", None, later),
            None
        );
    }
    assert!(ledger.firing.is_empty());
}

#[test]
fn a_clear_condition_never_notifies_and_a_resolved_one_can_fire_again() {
    let mut ledger = Ledger::default();
    let now = Instant::now();
    assert_eq!(ledger.apply(AlertKind::Malformed, "views", None, now), None);
    ledger.apply(AlertKind::Malformed, "views", Some(seen(1)), now);
    ledger.apply(AlertKind::Malformed, "views", None, now);
    assert_eq!(
        ledger.apply(AlertKind::Malformed, "views", Some(seen(2)), now),
        Some(Change::Fired(seen(2)))
    );
}

#[test]
fn each_kind_and_collection_is_its_own_condition() {
    let mut ledger = Ledger::default();
    let now = Instant::now();
    let fired = |change: Option<Change>| matches!(change, Some(Change::Fired(_)));
    assert!(fired(ledger.apply(
        AlertKind::StuckTokens,
        "a",
        Some(seen(1)),
        now
    )));
    assert!(fired(ledger.apply(
        AlertKind::StuckTokens,
        "b",
        Some(seen(1)),
        now
    )));
    assert!(fired(ledger.apply(
        AlertKind::Malformed,
        "a",
        Some(seen(1)),
        now
    )));
    assert_eq!(ledger.firing.len(), 3);
    // Clearing one leaves the others firing, silently.
    assert!(matches!(
        ledger.apply(AlertKind::StuckTokens, "a", None, now),
        Some(Change::Resolved { .. })
    ));
    assert_eq!(
        ledger.apply(AlertKind::StuckTokens, "b", Some(seen(2)), now),
        None
    );
    assert_eq!(
        ledger.apply(AlertKind::Malformed, "a", Some(seen(2)), now),
        None
    );
    assert_eq!(ledger.firing.len(), 2);
}

#[test]
fn kind_names_match_their_serialized_form() {
    for kind in AlertKind::ALL {
        assert_eq!(
            serde_json::to_value(kind).unwrap(),
            serde_json::json!(kind.as_str())
        );
    }
}

fn log_only(metrics: &Metrics, secrets: Secrets) -> Alerts {
    Alerts::start_with(
        &AlertsConfig::default(),
        secrets,
        metrics.clone(),
        &TaskTracker::new(),
        CancellationToken::new(),
        AlertOptions {
            instance: Some("tallyd-1".into()),
            ..AlertOptions::default()
        },
    )
}

#[test]
fn the_handle_counts_transitions_and_sets_the_firing_gauge() {
    let metrics = Metrics::new();
    let alerts = log_only(&metrics, Secrets::default());
    let firing = || {
        metrics
            .alerts_firing
            .with_label_values(&["stuck_tokens", "views"])
            .get()
    };
    let notified = |state: &str| {
        metrics
            .alert_notifications
            .with_label_values(&["stuck_tokens", state])
            .get()
    };
    alerts.set(AlertKind::StuckTokens, "views", None);
    assert_eq!((firing(), notified("firing")), (0, 0));
    for n in 1..=3 {
        alerts.set(AlertKind::StuckTokens, "views", Some(seen(n)));
    }
    assert_eq!((firing(), notified("firing")), (1, 1));
    assert_eq!(
        alerts.firing(),
        vec![(AlertKind::StuckTokens, "views".to_owned(), seen(3))]
    );
    alerts.set(AlertKind::StuckTokens, "views", None);
    alerts.set(AlertKind::StuckTokens, "views", None);
    assert_eq!((firing(), notified("resolved")), (0, 1));
    assert!(alerts.firing().is_empty());
}

#[test]
fn observations_are_cut_to_a_few_samples_and_scrubbed() {
    let alerts = log_only(&Metrics::new(), Secrets::new("mongodb://u:pw@h/", ["tok"]));
    alerts.set(
        AlertKind::RunFailed,
        "views",
        Some(Observation {
            count: 1,
            oldest_age: None,
            sample_ids: (0..50).map(|i| i.to_string()).collect(),
            detail: Some("auth failed for pw with tok".into()),
        }),
    );
    let (_, _, observation) = alerts.firing().remove(0);
    assert_eq!(observation.sample_ids.len(), MAX_SAMPLE_IDS);
    assert_eq!(
        observation.detail.as_deref(),
        Some("auth failed for **** with ****")
    );
}

#[test]
fn a_notification_serializes_to_exactly_the_documented_fields() {
    let alerts = log_only(&Metrics::new(), Secrets::default());
    let firing = alerts.notification(
        AlertKind::StuckTokens,
        "views",
        Change::Fired(Observation {
            count: 4,
            oldest_age: Some(Duration::from_millis(3_600_900)),
            sample_ids: vec!["a".into()],
            detail: None,
        }),
    );
    let body = serde_json::to_value(&firing).unwrap();
    let keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    let mut expected = vec![
        "kind",
        "state",
        "collection",
        "count",
        "oldest_age_seconds",
        "sample_ids",
        "detail",
        "at",
        "instance",
    ];
    expected.sort_unstable();
    let mut keys = keys;
    keys.sort_unstable();
    assert_eq!(keys, expected);
    assert_eq!(body["kind"], "stuck_tokens");
    assert_eq!(body["state"], "firing");
    assert_eq!(body["count"], 4);
    assert_eq!(body["oldest_age_seconds"], 3600);
    assert_eq!(body["detail"], serde_json::Value::Null);
    assert_eq!(body["instance"], "tallyd-1");
    assert!(
        chrono::DateTime::parse_from_rfc3339(body["at"].as_str().unwrap()).is_ok(),
        "{body}"
    );

    let resolved = alerts.notification(
        AlertKind::StuckTokens,
        "views",
        Change::Resolved {
            last: seen(7),
            lasted: Duration::from_secs(125),
        },
    );
    let body = serde_json::to_value(&resolved).unwrap();
    assert_eq!(body["state"], "resolved");
    assert_eq!(body["count"], 0);
    assert_eq!(body["oldest_age_seconds"], serde_json::Value::Null);
    assert_eq!(body["sample_ids"], serde_json::json!([]));
    assert_eq!(
        body["detail"],
        "cleared after 2m 5s; the last check that found any counted 7"
    );
}

/// The variable named by `auth_header_env`; only the config's env map
/// holds it, never the process environment.
const AUTH_VAR: &str = "TALLY_TEST_WEBHOOK_AUTH";
const AUTH_VALUE: &str = "Bearer alert-test-t0ken";
/// The webhook's path, secret like many real webhook paths.
const SECRET_PATH: &str = "/hooks/T0KEN-IN-PATH";

/// A configuration with the webhook at `addr`, read the way `tallyd` reads
/// it: TOML plus an environment holding the auth header's value.
fn config_for(addr: SocketAddr, max_attempts: u32) -> Config {
    let text = format!(
        r#"
        [mongodb]
        uri = "mongodb://localhost:27017"
        database = "app"

        [alerts.webhook]
        url = "http://{addr}{SECRET_PATH}"
        auth_header_env = "{AUTH_VAR}"
        timeout = "2s"
        max_attempts = {max_attempts}
        "#
    );
    Config::from_toml(&text, [(AUTH_VAR.to_owned(), AUTH_VALUE.to_owned())])
        .unwrap_or_else(|err| panic!("the test config is valid: {err}"))
}

/// A loopback address where nothing listens (bound, then released).
async fn nothing_listening() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    listener.local_addr().expect("listener address")
}

/// The engine under test, with short backoffs; shuts down on drop.
struct Engine {
    alerts: Alerts,
    metrics: Metrics,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Engine {
    fn start(config: &Config, backoff: Backoff) -> Self {
        let metrics = Metrics::new();
        let tracker = TaskTracker::new();
        let shutdown = CancellationToken::new();
        let alerts = Alerts::start_with(
            &config.alerts,
            config.secrets(),
            metrics.clone(),
            &tracker,
            shutdown.clone(),
            AlertOptions {
                instance: Some("test-instance".into()),
                backoff,
                shutdown_flush: Duration::from_millis(500),
                ..AlertOptions::default()
            },
        );
        Self {
            alerts,
            metrics,
            tracker,
            shutdown,
        }
    }

    fn deliveries(&self, result: &str) -> u64 {
        self.metrics
            .webhook_deliveries
            .with_label_values(&[result])
            .get()
    }

    fn notifications(&self, kind: AlertKind, state: &str) -> u64 {
        self.metrics
            .alert_notifications
            .with_label_values(&[kind.as_str(), state])
            .get()
    }

    /// Shuts the engine down and returns how long its task took to stop.
    async fn stop(&self) -> Duration {
        let started = Instant::now();
        self.shutdown.cancel();
        self.tracker.close();
        tokio::time::timeout(Duration::from_secs(10), self.tracker.wait())
            .await
            .expect("the delivery task stops within 10s of shutdown");
        started.elapsed()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

const FAST: Backoff = Backoff {
    base: Duration::from_millis(10),
    cap: Duration::from_millis(40),
};

fn stuck(count: u64) -> Observation {
    Observation {
        count,
        oldest_age: Some(Duration::from_secs(7200)),
        sample_ids: vec!["a".into(), "b".into()],
        detail: None,
    }
}

/// Waits for `done`, failing the test after 10s.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Fires a marker alert, then waits until every notification sent so far
/// (the marker's included) was delivered or given up: what the receiver
/// holds then is everything that was sent.
async fn sync_with_marker(engine: &Engine, receiver: &Receiver) {
    engine
        .alerts
        .set(AlertKind::Malformed, "marker", Some(stuck(1)));
    eventually("the marker alert", || {
        receiver
            .delivered()
            .iter()
            .any(|b| b["collection"] == "marker")
    })
    .await;
    let sent: u64 = AlertKind::ALL
        .iter()
        .flat_map(|kind| ["firing", "resolved"].map(|state| engine.notifications(*kind, state)))
        .sum();
    eventually("every notification delivered or given up", || {
        engine.deliveries("delivered") + engine.deliveries("failed") == sent
    })
    .await;
}

/// (kind, state, collection) of each body, grouped by collection then
/// kind: the order within one condition is the order of delivery (across
/// conditions there is none).
fn summary(bodies: &[Value]) -> Vec<(String, String, String)> {
    let mut summary: Vec<(String, String, String)> = bodies
        .iter()
        .map(|b| {
            (
                b["kind"].as_str().unwrap_or("?").to_owned(),
                b["state"].as_str().unwrap_or("?").to_owned(),
                b["collection"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect();
    summary.sort_by(|a, b| (&a.2, &a.0).cmp(&(&b.2, &b.0)));
    summary
}

fn entry(kind: &str, state: &str, collection: &str) -> (String, String, String) {
    (kind.to_owned(), state.to_owned(), collection.to_owned())
}

#[tokio::test]
async fn the_webhook_receives_firing_then_resolved_once_each() {
    let receiver = Receiver::start(0).await;
    let engine = Engine::start(&config_for(receiver.addr, 3), FAST);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "views", Some(stuck(3)));
    engine.alerts.set(AlertKind::StuckTokens, "views", None);
    engine.alerts.set(AlertKind::StuckTokens, "views", None);
    sync_with_marker(&engine, &receiver).await;

    let requests = receiver.requests();
    let bodies: Vec<Value> = receiver
        .delivered()
        .into_iter()
        .filter(|b| b["collection"] == "views")
        .collect();
    assert_eq!(
        summary(&receiver.delivered()),
        [
            entry("malformed", "firing", "marker"),
            entry("stuck_tokens", "firing", "views"),
            entry("stuck_tokens", "resolved", "views"),
        ]
    );
    assert_eq!(requests.len(), 3, "no retries were needed: {requests:?}");
    for request in &requests {
        assert_eq!(request.authorization.as_deref(), Some(AUTH_VALUE));
        assert_eq!(request.content_type.as_deref(), Some("application/json"));
        assert_eq!(request.path, SECRET_PATH);
    }

    let firing = &bodies[0];
    assert_eq!(firing["count"], 3);
    assert_eq!(firing["oldest_age_seconds"], 7200);
    assert_eq!(firing["sample_ids"], json!(["a", "b"]));
    assert_eq!(firing["detail"], Value::Null);
    assert_eq!(firing["instance"], "test-instance");
    let at = firing["at"].as_str().expect("`at` is a string");
    chrono::DateTime::parse_from_rfc3339(at).expect("`at` is RFC 3339");

    let resolved = &bodies[1];
    assert_eq!(resolved["count"], 0);
    assert_eq!(resolved["oldest_age_seconds"], Value::Null);
    assert_eq!(resolved["sample_ids"], json!([]));
    assert!(
        resolved["detail"]
            .as_str()
            .is_some_and(|d| d.contains("the last check that found any counted 3")),
        "{resolved}"
    );

    assert_eq!(engine.notifications(AlertKind::StuckTokens, "firing"), 1);
    assert_eq!(engine.notifications(AlertKind::StuckTokens, "resolved"), 1);
    eventually("3 deliveries counted", || {
        engine.deliveries("delivered") == 3
    })
    .await;
    assert_eq!(engine.deliveries("retried"), 0);
    let text = engine.metrics.render();
    assert!(
        text.contains(r#"tally_alerts_firing{collection="views",kind="stuck_tokens"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"tally_alerts_firing{collection="marker",kind="malformed"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn repeated_reports_while_firing_send_nothing_more() {
    let receiver = Receiver::start(0).await;
    let engine = Engine::start(&config_for(receiver.addr, 3), FAST);

    for count in 1..=100 {
        engine
            .alerts
            .set(AlertKind::StuckTokens, "views", Some(stuck(count)));
    }
    sync_with_marker(&engine, &receiver).await;

    let bodies = receiver.delivered();
    assert_eq!(
        summary(&bodies),
        [
            entry("malformed", "firing", "marker"),
            entry("stuck_tokens", "firing", "views"),
        ]
    );
    let firing = bodies.iter().find(|b| b["collection"] == "views").unwrap();
    assert_eq!(firing["count"], 1, "the firing tells the first observation");
    let firing = engine.alerts.firing();
    assert_eq!(
        firing
            .iter()
            .find(|(kind, _, _)| *kind == AlertKind::StuckTokens)
            .map(|(_, _, observation)| observation.count),
        Some(100),
        "the engine keeps the latest observation"
    );
    assert_eq!(engine.notifications(AlertKind::StuckTokens, "firing"), 1);
}

#[tokio::test]
async fn a_failing_webhook_is_retried_and_order_is_kept() {
    let receiver = Receiver::start(2).await;
    let engine = Engine::start(&config_for(receiver.addr, 5), FAST);

    engine
        .alerts
        .set(AlertKind::RunFailed, "views", Some(stuck(1)));
    engine.alerts.set(AlertKind::RunFailed, "views", None);
    eventually("both notifications", || receiver.delivered().len() == 2).await;

    assert_eq!(
        summary(&receiver.delivered()),
        [
            entry("run_failed", "firing", "views"),
            entry("run_failed", "resolved", "views"),
        ]
    );
    let attempts: Vec<(u16, String)> = receiver
        .requests()
        .iter()
        .map(|r| {
            (
                r.status.as_u16(),
                r.body["state"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        attempts,
        [
            (500, "firing".to_owned()),
            (500, "firing".to_owned()),
            (200, "firing".to_owned()),
            (200, "resolved".to_owned()),
        ],
        "the resolved waited behind the retried firing"
    );
    eventually("2 deliveries counted", || {
        engine.deliveries("delivered") == 2
    })
    .await;
    assert_eq!(engine.deliveries("retried"), 2);
    assert_eq!(engine.deliveries("failed"), 0);
}

#[tokio::test]
async fn a_webhook_that_is_down_is_given_up_on_without_blocking_and_the_engine_goes_on() {
    let addr = nothing_listening().await;
    let engine = Engine::start(&config_for(addr, 3), FAST);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "views", Some(stuck(1)));
    // While the first notification is being retried, reporting stays cheap:
    // nothing waits for the network.
    let started = Instant::now();
    for count in 0..1000 {
        engine
            .alerts
            .set(AlertKind::StuckTokens, "views", Some(stuck(count)));
    }
    for _ in 0..3 {
        engine
            .alerts
            .set(AlertKind::MonitorDown, "views", Some(stuck(1)));
        engine.alerts.set(AlertKind::MonitorDown, "views", None);
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(1),
        "1006 reports took {elapsed:?}"
    );

    eventually("the first notification to be given up", || {
        engine.deliveries("failed") >= 1
    })
    .await;
    assert!(engine.deliveries("retried") >= 2);
    assert_eq!(engine.deliveries("delivered"), 0);

    // The webhook comes back: the engine still delivers.
    let receiver = Receiver::start_on(addr).await;
    engine.alerts.set(AlertKind::StuckTokens, "views", None);
    eventually("the resolved after the webhook came back", || {
        receiver
            .delivered()
            .iter()
            .any(|b| b["kind"] == "stuck_tokens" && b["state"] == "resolved")
    })
    .await;
    // 1 firing + 6 monitor_down + 1 resolved, each delivered or given up
    // (the count follows the receiver's answer by a moment).
    eventually("every notification accounted for", || {
        engine.deliveries("failed") + engine.deliveries("delivered") == 8
    })
    .await;
}

#[tokio::test]
async fn a_full_queue_drops_the_newest_without_blocking() {
    let addr = nothing_listening().await;
    let slow = Backoff {
        base: Duration::from_secs(30),
        cap: Duration::from_secs(60),
    };
    let engine = Engine::start(&config_for(addr, 8), slow);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "views", Some(stuck(1)));
    // The delivery task now holds that one and waits to retry it.
    eventually("the first attempt", || engine.deliveries("retried") == 1).await;
    let started = Instant::now();
    for _ in 0..600 {
        engine
            .alerts
            .set(AlertKind::MonitorDown, "views", Some(stuck(1)));
        engine.alerts.set(AlertKind::MonitorDown, "views", None);
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(2),
        "1200 reports took {elapsed:?}"
    );
    // The one waiting for its retry holds a place in the queue too.
    let queued = QUEUE_CAPACITY as u64 - 1;
    assert_eq!(engine.deliveries("failed"), 1200 - queued);
    assert_eq!(engine.notifications(AlertKind::MonitorDown, "firing"), 600);

    engine.stop().await;
    // Everything queued is reported undelivered at shutdown, the held one
    // included.
    assert_eq!(engine.deliveries("failed"), 1200 + 1);
}

#[tokio::test]
async fn shutdown_cuts_retries_short_and_reports_what_was_not_delivered() {
    let receiver = Receiver::start(usize::MAX).await;
    let slow = Backoff {
        base: Duration::from_secs(30),
        cap: Duration::from_secs(60),
    };
    let engine = Engine::start(&config_for(receiver.addr, 8), slow);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "views", Some(stuck(1)));
    eventually("the first attempt", || engine.deliveries("retried") == 1).await;
    engine.alerts.set(AlertKind::StuckTokens, "views", None);

    let took = engine.stop().await;
    assert!(took < Duration::from_secs(2), "shutdown took {took:?}");
    // The firing got one last attempt (answered 500); the resolved behind
    // it was not tried against a webhook known to fail.
    assert_eq!(receiver.requests().len(), 2);
    assert_eq!(engine.deliveries("failed"), 2);

    // Reporting after shutdown neither blocks nor panics.
    engine
        .alerts
        .set(AlertKind::Malformed, "views", Some(stuck(1)));
    assert_eq!(engine.deliveries("failed"), 3);
}

#[tokio::test]
async fn shutdown_delivers_what_is_queued_when_the_webhook_answers() {
    let receiver = Receiver::start(0).await;
    let engine = Engine::start(&config_for(receiver.addr, 3), FAST);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "views", Some(stuck(1)));
    engine.alerts.set(AlertKind::StuckTokens, "views", None);
    engine.stop().await;

    assert_eq!(
        summary(&receiver.delivered()),
        [
            entry("stuck_tokens", "firing", "views"),
            entry("stuck_tokens", "resolved", "views"),
        ]
    );
    assert_eq!(engine.deliveries("delivered"), 2);
}

/// An endpoint that hangs for one alert (its requests are never answered)
/// does not hold the others back: an alert of another collection arrives
/// within one attempt's timeout, not after every attempt of the first.
#[tokio::test]
async fn an_alert_that_hangs_does_not_hold_back_the_others() {
    let receiver = Receiver::start_hanging_for("slow").await;
    // 3 attempts of 2 s each for the hanging one.
    let engine = Engine::start(&config_for(receiver.addr, 3), FAST);

    engine
        .alerts
        .set(AlertKind::StuckTokens, "slow", Some(stuck(1)));
    eventually("the first request to hang", || {
        receiver.requests().len() == 1
    })
    .await;
    let reported = Instant::now();
    engine
        .alerts
        .set(AlertKind::StuckTokens, "fast", Some(stuck(1)));
    eventually("the other alert", || {
        receiver
            .delivered()
            .iter()
            .any(|b| b["collection"] == "fast")
    })
    .await;
    let waited = reported.elapsed();
    assert!(
        waited < Duration::from_secs(2),
        "the other alert waited {waited:?} behind the hanging one"
    );
    // The hanging one is still retried, and its resolved still waits
    // behind it.
    engine.alerts.set(AlertKind::StuckTokens, "slow", None);
    eventually("the hanging alert given up", || {
        engine.deliveries("failed") == 1
    })
    .await;
    eventually("its resolved sent after it", || {
        receiver
            .requests()
            .iter()
            .any(|r| r.body["collection"] == "slow" && r.body["state"] == "resolved")
    })
    .await;
    let slow: Vec<String> = receiver
        .requests()
        .iter()
        .filter(|r| r.body["collection"] == "slow")
        .map(|r| r.body["state"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert_eq!(slow, ["firing", "firing", "firing", "resolved"]);
}

/// However many conditions hang, at most eight requests are in flight at
/// once; the rest wait for a slot, which a timed-out request frees.
#[tokio::test]
async fn at_most_eight_requests_are_in_flight() {
    let receiver = Receiver::start_hanging_for("slow").await;
    let engine = Engine::start(&config_for(receiver.addr, 1), FAST);
    let started = Instant::now();
    for n in 0..10 {
        engine
            .alerts
            .set(AlertKind::StuckTokens, &format!("slow{n}"), Some(stuck(1)));
    }
    eventually("eight requests", || receiver.requests().len() == 8).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        receiver.requests().len(),
        8,
        "a ninth request while eight hang"
    );
    // The first timeouts (2 s) free slots for the other two.
    eventually("ten requests", || receiver.requests().len() == 10).await;
    assert!(started.elapsed() >= Duration::from_secs(2));
}

/// A log sink for one test: everything written, kept in memory.
#[derive(Clone, Default)]
struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLog {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// A current-thread runtime: the subscriber set for this thread sees every
// task of the test, the delivery task included.
#[tokio::test(flavor = "current_thread")]
async fn logs_never_show_the_auth_header_or_the_webhook_path() {
    let log = CapturedLog::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let log = log.clone();
            move || log.clone()
        })
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // tracing caches each callsite's interest when the callsite is first
    // hit. While a single dispatcher is registered it asks only the hitting
    // thread's default, so a callsite first hit by a parallel test (no
    // subscriber on its thread) would stay muted here. A second live
    // dispatcher makes it ask every registered one.
    let _second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());

    // One webhook that answers 500 once, one that is not there at all.
    let receiver = Receiver::start(1).await;
    let answering = Engine::start(&config_for(receiver.addr, 3), FAST);
    let down_addr = nothing_listening().await;
    let down = Engine::start(&config_for(down_addr, 2), FAST);

    // A detail quoting both secrets, as a careless error message might.
    let leaky = Observation {
        detail: Some(format!("rejected {AUTH_VALUE} at {SECRET_PATH}")),
        ..stuck(2)
    };
    for engine in [&answering, &down] {
        engine
            .alerts
            .set(AlertKind::RunFailed, "views", Some(leaky.clone()));
        engine.alerts.set(AlertKind::RunFailed, "views", None);
    }
    eventually("delivery after one 500", || {
        answering.deliveries("delivered") == 2
    })
    .await;
    eventually("giving up on the missing webhook", || {
        down.deliveries("failed") == 2
    })
    .await;
    down.alerts
        .set(AlertKind::RunFailed, "views", Some(stuck(1)));
    down.stop().await;
    answering.stop().await;

    let text = log.text();
    // The log says what happened...
    for expected in [
        "alert firing",
        "alert resolved",
        "the webhook answered 500",
        "will retry",
        "cannot connect",
        "giving up",
        "alert not delivered before shutdown",
        &format!("http://{down_addr}/****"),
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    // ...without the secrets.
    for secret in [AUTH_VALUE, "alert-test-t0ken", SECRET_PATH, "T0KEN-IN-PATH"] {
        assert!(!text.contains(secret), "{secret:?} leaked into:\n{text}");
    }
    // The receiver did get the header: it was sent, only never shown; the
    // detail it got was scrubbed too.
    let requests = receiver.requests();
    assert!(
        requests
            .iter()
            .all(|r| r.authorization.as_deref() == Some(AUTH_VALUE))
    );
    assert_eq!(requests[0].body["detail"], "rejected **** at ****");
}
