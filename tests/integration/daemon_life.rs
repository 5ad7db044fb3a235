//! The daemon's life as exact as its data path: every series an alert rule
//! of `config/alerts.yml` reads is on `/metrics` from the moment the daemon
//! says it is ready, a restart included; and a reload (SIGHUP) is all or
//! nothing — a new configuration that cannot be made ready leaves the old
//! one running, and says so on `/metrics`.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mongodb::bson::doc;

use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, wait_until};
use crate::daemon::{Conf, LONG};

mod api;
mod matrix;

/// The alerts section: tokens stuck after 10 s (the grace: no shorter).
const ALERTS: &str = "[alerts]\nstuck_after = \"10s\"\n";

/// A second collection, with an events ledger: the rules on ledgers read
/// series only such a collection has.
const LEDGER: &str = "[[collections]]\nname = \"hits\"\nledger = true\n";
/// A collection counted by the minute: its buckets' series.
const BUCKETED: &str = "[[collections]]\nname = \"calls\"\nbucket = \"minute\"\n";

fn render(ctx: &TestContext, conf: &Conf) -> String {
    format!(
        "{}{ALERTS}",
        conf.render(&ctx.child_uri(false), &ctx.db_name)
    )
}

/// The value of every `expr` key of a YAML file: plain one-line values and
/// block scalars (`>-`, `|`, ...), whose lines are those indented deeper
/// than the key.
fn yaml_exprs(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut exprs = Vec::new();
    let indent = |line: &str| line.len() - line.trim_start().len();
    for (at, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        if !value.starts_with(['>', '|']) {
            exprs.push(value.trim_matches(['"', '\'']).to_owned());
            continue;
        }
        let key_indent = indent(line);
        let block: Vec<&str> = lines[at + 1..]
            .iter()
            .take_while(|l| l.trim().is_empty() || indent(l) > key_indent)
            .map(|l| l.trim())
            .collect();
        exprs.push(block.join(" ").trim().to_owned());
    }
    exprs
}

/// One series selector of a rule: a `tally_` metric name and the label
/// matchers written after it (`kind="events_stuck"`), if any.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Selector {
    name: String,
    matchers: Vec<String>,
}

/// Every `tally_...` selector in `expr`.
fn selectors(expr: &str) -> Vec<Selector> {
    let bytes = expr.as_bytes();
    let is_name = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = expr[from..].find("tally_") {
        let start = from + at;
        let mut end = start;
        while end < bytes.len() && is_name(bytes[end]) {
            end += 1;
        }
        from = end;
        if start > 0 && (is_name(bytes[start - 1]) || bytes[start - 1].is_ascii_uppercase()) {
            continue;
        }
        let name = expr[start..end].to_owned();
        let matchers = match expr[end..].strip_prefix('{') {
            Some(rest) => rest[..rest.find('}').expect("a closed selector")]
                .split(',')
                .map(|m| m.trim().to_owned())
                .filter(|m| !m.is_empty())
                .collect(),
            None => Vec::new(),
        };
        found.push(Selector { name, matchers });
    }
    found
}

/// What the alert rules of `config/alerts.yml` read, from the file itself.
fn alert_selectors() -> Vec<Selector> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/alerts.yml");
    let text = std::fs::read_to_string(&path).expect("read config/alerts.yml");
    let mut all: Vec<Selector> = yaml_exprs(&text)
        .iter()
        .flat_map(|e| selectors(e))
        .collect();
    all.sort();
    all.dedup();
    let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
    // The reading itself is checked: the rules this issue is about, and a
    // selector with a label matcher.
    for expected in [
        "tally_reconcile_last_success_timestamp_seconds",
        "tally_malformed_documents",
        "tally_fold_refused_documents",
        "tally_lease_active",
    ] {
        assert!(names.contains(&expected), "{expected} not read: {all:?}");
    }
    assert!(
        all.iter()
            .any(|s| s.name == "tally_alerts_firing" && !s.matchers.is_empty()),
        "{all:?}"
    );
    all
}

/// Whether `/metrics` (`text`) has a series for `selector`: a sample line of
/// that name carrying each of its `label="value"` matchers.
fn serves(text: &str, selector: &Selector) -> bool {
    text.lines().filter(|l| !l.starts_with('#')).any(|line| {
        let Some(rest) = line.strip_prefix(&selector.name) else {
            return false;
        };
        if !rest.starts_with(['{', ' ']) {
            return false;
        }
        let labels = rest.split(' ').next().unwrap_or("");
        selector
            .matchers
            .iter()
            .all(|m| labels.contains(m.as_str()))
    })
}

async fn get(http: SocketAddr, path: &str) -> Option<(u16, String)> {
    let response = reqwest::Client::new()
        .get(format!("http://{http}{path}"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

async fn scrape(daemon: &Tallyd) -> String {
    let (status, text) = get(daemon.http, "/metrics")
        .await
        .expect("/metrics answers");
    assert_eq!(status, 200, "{text}");
    text
}

/// The selectors of `config/alerts.yml` that `text` has no series for.
fn missing(text: &str) -> Vec<Selector> {
    alert_selectors()
        .into_iter()
        .filter(|s| !serves(text, s))
        .collect()
}

/// The value of the one series `series` (name and labels as exported).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

#[test]
fn the_rule_reader_finds_block_and_plain_expressions() {
    let yaml = "rules:\n  - alert: A\n    expr: >-\n      max(tally_x{kind=\"k\"}) > 0\n      and tally_y\n    for: 5m\n  - alert: B\n    expr: up{job=\"tallyd\"} == 0 or tally_z\n";
    let exprs = yaml_exprs(yaml);
    assert_eq!(
        exprs,
        [
            "max(tally_x{kind=\"k\"}) > 0 and tally_y",
            "up{job=\"tallyd\"} == 0 or tally_z"
        ]
    );
    let found: Vec<Selector> = exprs.iter().flat_map(|e| selectors(e)).collect();
    assert_eq!(
        found,
        [
            Selector {
                name: "tally_x".into(),
                matchers: vec!["kind=\"k\"".into()]
            },
            Selector {
                name: "tally_y".into(),
                matchers: vec![]
            },
            Selector {
                name: "tally_z".into(),
                matchers: vec![]
            },
        ]
    );
    let text = "# TYPE tally_x gauge\ntally_x{collection=\"v\",kind=\"k\"} 0\ntally_yy 1\n";
    assert!(serves(text, &found[0]));
    assert!(!serves(text, &found[1]), "tally_yy is not tally_y");
}

/// Every series an alert rule reads is there once the daemon is ready:
/// after a first run, and after a restart that needs no run (a nightly
/// schedule, no catch-up), where the last success, the malformed documents
/// and the refused documents come from the state collection — the old
/// values, not nothing until the next run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_an_alert_rule_reads_is_there_once_ready_a_restart_included() {
    let ctx = TestContext::new("life_alert_series").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let state = client.collection("tally_state");
    // A malformed document: its pending field is not an array.
    views
        .insert_one(doc! { "_id": "broken", "counter": 0i64, "pending": "not an array" })
        .await
        .unwrap();
    // Nightly, with the catch-up: views never ran, so it runs at start.
    let first = Conf {
        cron: "0 30 3 * * *",
        catch_up: true,
        extra: format!("{LEDGER}{BUCKETED}"),
        ..Conf::default()
    };
    let mut daemon = Tallyd::start(&render(&ctx, &first), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    daemon
        .wait_metric(
            "tally_reconcile_runs_total{collection=\"views\",result=\"ok\"}",
            1.0,
            LONG,
        )
        .await;
    wait_until("the run of views recorded", LONG, || async {
        state
            .find_one(doc! { "_id": "last_success:views" })
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let text = scrape(&daemon).await;
    let absent = missing(&text);
    assert!(
        absent.is_empty(),
        "after the first run, no series for {absent:?}\n{text}"
    );
    let recorded = state
        .find_one(doc! { "_id": "last_success:views" })
        .await
        .unwrap()
        .unwrap();
    let at = recorded.get_datetime("at").unwrap().timestamp_millis() as f64 / 1000.0;
    assert_eq!(recorded.get_i64("malformed").ok(), Some(1), "{recorded}");
    assert_eq!(recorded.get_i64("refused").ok(), Some(0), "{recorded}");
    assert!(daemon.terminate().success(), "{}", daemon.log());

    // Again, with nothing to run: no catch-up, the next run tonight.
    let idle = Conf {
        extra: format!("{LEDGER}{BUCKETED}"),
        ..Conf::idle()
    };
    let daemon = Tallyd::start(&render(&ctx, &idle), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    let text = scrape(&daemon).await;
    let absent = missing(&text);
    assert!(
        absent.is_empty(),
        "at the first scrape after a restart, no series for {absent:?}\n{text}\nlog:\n{}",
        daemon.log()
    );
    let restored = value(
        &text,
        "tally_reconcile_last_success_timestamp_seconds{collection=\"views\"}",
    )
    .expect("the last success of views");
    assert!(
        (restored - at).abs() < 0.001,
        "restored {restored}, recorded {at}"
    );
    assert_eq!(
        value(&text, "tally_malformed_documents{collection=\"views\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "tally_fold_refused_documents{collection=\"views\"}"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "tally_reconcile_runs_total{collection=\"views\",result=\"ok\"}"
        ),
        Some(0.0),
        "no run since the restart: {text}"
    );
}

/// Polls until `done`, failing after `timeout` with the daemon's log.
async fn until<F, Fut>(daemon: &Tallyd, what: &str, timeout: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}\nlog:\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether anything accepts connections on `address`.
fn listening(address: SocketAddr) -> bool {
    TcpStream::connect_timeout(&address, Duration::from_secs(1)).is_ok()
}

/// A reload's log is not a stop's.
fn assert_no_stop_in(log: &str) {
    for line in log.lines() {
        assert!(
            !line.contains("shutting down") && !line.trim_end().ends_with("stopped"),
            "a reload is not a stop: {line}\nlog:\n{log}"
        );
    }
}

/// SIGHUP with a valid configuration on another port: the new port serves
/// once the reload is done, the old one is closed, and the reload is
/// counted a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_to_another_port_serves_there_and_closes_the_old_one() {
    let ctx = TestContext::new("life_reload_port").await;
    let conf = Conf::idle();
    let mut daemon = Tallyd::start(&render(&ctx, &conf), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    let old = daemon.http;
    let new = free_address();
    daemon.rewrite_config_listening(&render(&ctx, &conf), new);
    daemon.signal("HUP");
    until(&daemon, "the new port serves /healthz", LONG, || async {
        matches!(get(new, "/healthz").await, Some((200, _)))
    })
    .await;
    until(&daemon, "the old port closed", LONG, || async {
        !listening(old)
    })
    .await;
    let (_, text) = get(new, "/metrics")
        .await
        .expect("/metrics on the new port");
    assert_eq!(
        value(&text, "tally_config_last_reload_success"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "tally_config_reload_failures_total"),
        Some(0.0),
        "{text}"
    );
    until(&daemon, "ready again on the new port", LONG, || async {
        matches!(get(new, "/readyz").await, Some((200, body)) if body.trim() == "active")
    })
    .await;
    assert!(daemon.running(), "{}", daemon.log());
    let log = daemon.log();
    assert!(log.contains("configuration reloaded"), "{log}");
    assert_no_stop_in(&log);
}

/// SIGHUP with `[http] listen` on a port another process holds: the daemon
/// runs on with the old configuration on the old port, says why in one
/// line, and counts the failure; a good reload afterwards clears the gauge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_to_a_taken_port_keeps_the_old_configuration_running() {
    let ctx = TestContext::new("life_reload_taken").await;
    let views = ctx.client(false).await.collection("views");
    let conf = Conf::idle();
    let mut daemon = Tallyd::start(&render(&ctx, &conf), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    daemon.rewrite_config_listening(&render(&ctx, &conf), taken.local_addr().unwrap());
    daemon.signal("HUP");
    daemon
        .wait_metric("tally_config_reload_failures_total", 1.0, LONG)
        .await;
    assert_eq!(
        daemon.metric("tally_config_last_reload_success").await,
        Some(0.0)
    );
    assert!(daemon.running(), "{}", daemon.log());
    assert_eq!(daemon.ready().await.as_deref(), Some("active"));
    let log = daemon.log();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("configuration not reloaded"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains("[http] listen"), "{log}");
    assert!(!log.contains("draining"), "nothing was let go: {log}");
    assert_no_stop_in(&log);
    // The old configuration still works: its monitor sees a write.
    views
        .insert_one(doc! { "_id": "after", "counter": 1i64 })
        .await
        .unwrap();
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            1.0,
            LONG,
        )
        .await;

    // Fixed: the next reload takes over, on the same port.
    daemon.rewrite_config(&render(&ctx, &conf));
    daemon.signal("HUP");
    until(&daemon, "the good reload", LONG, || async {
        daemon.metric("tally_config_last_reload_success").await == Some(1.0)
    })
    .await;
    assert_eq!(
        daemon.metric("tally_config_reload_failures_total").await,
        Some(1.0)
    );
    daemon.wait_ready("active", LONG).await;
    assert!(daemon.terminate().success(), "{}", daemon.log());
}

/// SIGHUP with a file holding a bad key: the daemon runs on with the old
/// configuration, and `/metrics` says the reload failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_a_bad_key_keeps_the_old_configuration_and_says_so_on_metrics() {
    let ctx = TestContext::new("life_reload_bad_key").await;
    let conf = Conf::idle();
    let mut daemon = Tallyd::start(&render(&ctx, &conf), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    assert_eq!(
        daemon.metric("tally_config_last_reload_success").await,
        Some(1.0)
    );
    daemon.rewrite_config(&(render(&ctx, &conf) + "[daemon]\nno_such_key = 1\n"));
    daemon.signal("HUP");
    daemon
        .wait_metric("tally_config_reload_failures_total", 1.0, LONG)
        .await;
    assert_eq!(
        daemon.metric("tally_config_last_reload_success").await,
        Some(0.0)
    );
    assert!(daemon.running(), "{}", daemon.log());
    assert_eq!(daemon.ready().await.as_deref(), Some("active"));
    let log = daemon.log();
    assert!(log.contains("daemon.no_such_key"), "{log}");
    assert!(!log.contains("draining"), "nothing was let go: {log}");
    assert_no_stop_in(&log);
}

/// An outage is its own signal: a ledger alert firing (its fold refused:
/// the indexes are missing) is neither resolved nor fired again by passes
/// that fail without measuring anything — here every read of the ledger's
/// collections is cut in the network while the server answers `hello` —
/// and comes back to the truth once the network does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_measurement_neither_fires_nor_resolves_a_ledger_alert() {
    use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
    let ctx = TestContext::new("life_unmeasured").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    // A ledger on `hits` whose indexes were never created: its fold refuses.
    let conf = Conf {
        extra: LEDGER.into(),
        ..Conf::idle()
    }
    .render(&ctx.child_uri_through(&proxy, false), &ctx.db_name)
    .replace("scan_interval = \"10m\"", "scan_interval = \"1s\"");
    let daemon = Tallyd::start(&format!("{conf}{ALERTS}"), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    let firing = "tally_alerts_firing{collection=\"hits\",kind=\"events_stuck\"}";
    until(
        &daemon,
        "events_stuck to fire (indexes missing)",
        LONG,
        || async { daemon.metric(firing).await == Some(1.0) },
    )
    .await;

    // Only the fold's own reads cut (its index check), the backlog's go
    // through: a pass failing by an outage measured the backlog, not
    // whether the fold still refuses, so it must not resolve the alert
    // (it did, one run in a dozen, when the rules below were lifted while
    // a pass was on a cut connection).
    let failed = "folding the ledger failed";
    {
        let _cut = proxy.rule(
            Rule::command("listIndexes")
                .collection("hits_events")
                .then(Action::CloseBeforeForwarding),
        );
        let before = daemon.log().matches(failed).count();
        until(
            &daemon,
            "three passes to fail by the outage",
            LONG,
            || async { daemon.log().matches(failed).count() >= before + 3 },
        )
        .await;
        assert_eq!(
            daemon.metric(firing).await,
            Some(1.0),
            "a pass that failed by an outage resolved a ledger alert: {}",
            daemon.log()
        );
    }

    let cut: Vec<_> = ["listIndexes", "find", "aggregate"]
        .into_iter()
        .flat_map(|command| {
            ["hits_events", "hits_events_fold"].map(|collection| {
                proxy.rule(
                    Rule::command(command)
                        .collection(collection)
                        .then(Action::CloseBeforeForwarding),
                )
            })
        })
        .collect();
    let before = daemon.log().matches(failed).count();
    until(&daemon, "three passes to fail unmeasured", LONG, || async {
        daemon.log().matches(failed).count() >= before + 3
    })
    .await;
    assert_eq!(
        daemon.metric(firing).await,
        Some(1.0),
        "passes that measured nothing resolved a ledger alert: {}",
        daemon.log()
    );
    drop(cut);
    let after = daemon.log().matches(failed).count();
    until(
        &daemon,
        "a pass refused again once reads go through",
        LONG,
        || async {
            daemon.log().matches("lacks the indexes").count() > 0
                && daemon.log().matches(failed).count() > after
        },
    )
    .await;
    assert_eq!(
        daemon.metric(firing).await,
        Some(1.0),
        "still refused after it"
    );
}

/// The operator edits the file (B), sends SIGHUP, edits it again (C) and
/// sends SIGHUP again while the first reload drains: the second one is
/// not lost — once B runs, the file is read again and C takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_during_a_reload_is_read_once_the_first_is_done() {
    let ctx = TestContext::new("life_sighup_during_reload").await;
    let text = format!("{}{LEDGER}", render(&ctx, &Conf::idle()));
    let mut daemon = Tallyd::start(&text, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    let (b, c) = (free_address(), free_address());
    daemon.rewrite_config_listening(&text, b);
    daemon.signal("HUP");
    // The first reload read B: it drains now.
    let deadline = Instant::now() + LONG;
    while !daemon.log().contains("the new configuration is ready") {
        assert!(Instant::now() < deadline, "{}", daemon.log());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    daemon.rewrite_config_listening(&text, c);
    daemon.signal("HUP");
    until(
        &daemon,
        "C serves: the second SIGHUP applied",
        LONG,
        || async { matches!(get(c, "/healthz").await, Some((200, _))) },
    )
    .await;
    until(&daemon, "B closed", LONG, || async { !listening(b) }).await;
    assert_eq!(
        daemon.log().matches("configuration reloaded").count(),
        2,
        "{}",
        daemon.log()
    );
    assert!(daemon.terminate().success(), "{}", daemon.log());
}

/// The daemon's own link to MongoDB goes down (the application's writers
/// are fine) while a two-step increment is pending, and the writer settles
/// it: the monitor cannot see that, but its view's token only ages — it
/// is not measured, so `stuck_tokens` neither fires during the outage
/// (past `stuck_after`) nor resolves after it; once the stream is back,
/// the scan measures no token at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_the_daemons_link_fires_no_stuck_tokens() {
    use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
    let ctx = TestContext::new("life_outage_stuck").await;
    let views = ctx.client(false).await.collection("views");
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let stuck_after = Duration::from_secs(10);
    let text = format!(
        "{}[alerts]\nstuck_after = \"10s\"\n",
        Conf::idle().render(&ctx.child_uri_through(&proxy, false), &ctx.db_name)
    );
    let daemon = Tallyd::start(&text, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    let token = tally::Token::created_at_time(std::time::SystemTime::now()).object_id();
    let created = Instant::now();
    views
        .insert_one(doc! { "_id": "k", "counter": 0i64, "pending": [token] })
        .await
        .unwrap();
    daemon
        .wait_metric("tally_pending_tokens{collection=\"views\"}", 1.0, LONG)
        .await;
    let cut = proxy.rule(Rule::any().then(Action::CloseBeforeForwarding));
    until(&daemon, "the monitor sees the outage", LONG, || async {
        daemon
            .metric("tally_monitor_up{collection=\"views\"}")
            .await
            == Some(0.0)
    })
    .await;
    // The writer settles its increment, directly.
    views
        .update_one(
            doc! { "_id": "k", "pending": token },
            doc! { "$inc": { "counter": 1i64 }, "$pull": { "pending": token } },
        )
        .await
        .unwrap();
    let stuck_said = |log: &str| log.contains("kind=stuck_tokens");
    // Watched past stuck_after plus a few evaluations: it never fires.
    let watched_until = created + stuck_after + Duration::from_secs(4);
    while Instant::now() < watched_until {
        assert!(
            !stuck_said(&daemon.log()),
            "a settled token alerted as stuck during the outage:\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(cut);
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    until(
        &daemon,
        "the scan measures no pending token",
        LONG,
        || async {
            daemon
                .metric("tally_pending_tokens{collection=\"views\"}")
                .await
                == Some(0.0)
                && daemon
                    .metric("tally_stuck_tokens{collection=\"views\"}")
                    .await
                    == Some(0.0)
        },
    )
    .await;
    assert!(!stuck_said(&daemon.log()), "{}", daemon.log());
}
