//! `tallyd run` as a child process: the schedule, the lease, the monitor,
//! restarts and outages, systemd notifications, shutdown.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::Token;

use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::server::{AuthServer, ServerOptions, TestServer, create_tallyd_role};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{FailPoint, TestContext, counter, external, wait_until};

/// The daemon's settings for a test; rendered to TOML.
pub(crate) struct Conf {
    pub(crate) cron: &'static str,
    pub(crate) catch_up: bool,
    pub(crate) monitor: bool,
    /// How often the change streams' positions are saved.
    pub(crate) save_interval: &'static str,
    pub(crate) extra: String,
}

impl Default for Conf {
    fn default() -> Self {
        Self {
            cron: "* * * * * *",
            catch_up: true,
            monitor: true,
            save_interval: "200ms",
            extra: String::new(),
        }
    }
}

impl Conf {
    /// No fold unless a test asks for one: nightly, no catch-up at start.
    pub(crate) fn idle() -> Self {
        Self {
            cron: "0 30 3 * * *",
            catch_up: false,
            ..Self::default()
        }
    }

    /// The config file: collection `views`, grace 10 s, retry horizon 6 s,
    /// attempts bounded by 3 s (the horizon must hold two attempts, the
    /// grace must outlast the horizon plus one attempt).
    pub(crate) fn render(&self, uri: &str, database: &str) -> String {
        format!(
            r#"
[mongodb]
uri = "{uri}"
database = "{database}"
server_selection_timeout = "2s"
attempt_timeout = "3s"
[[collections]]
name = "views"
[writer]
retry_horizon = "6s"
[reconcile]
grace = "10s"
batch_size = 10
[schedule]
cron = "{cron}"
catch_up = {catch_up}
[monitor]
enabled = {monitor}
save_interval = "{save_interval}"
scan_interval = "10m"
{extra}
"#,
            cron = self.cron,
            catch_up = self.catch_up,
            monitor = self.monitor,
            save_interval = self.save_interval,
            extra = self.extra,
        )
    }
}

/// The alerts section most tests use: tokens stuck after 10 s (the grace:
/// no shorter).
const ALERTS: &str = "[alerts]\nstuck_after = \"10s\"\n";

fn start(ctx: &TestContext, conf: &Conf) -> Tallyd {
    let mut text = conf.render(&ctx.child_uri(false), &ctx.db_name);
    if !conf.extra.contains("[alerts]") {
        text.push_str(ALERTS);
    }
    Tallyd::start(&text, &[("RUST_LOG", "info,tally=debug")])
}

/// A token an hour old: stale and stuck for every threshold here.
fn stale() -> ObjectId {
    Token::created_at_time(SystemTime::now() - Duration::from_secs(3600)).object_id()
}

pub(crate) async fn seed_stale(coll: &Collection<Document>, keys: std::ops::Range<i32>) {
    for k in keys {
        coll.update_one(
            doc! { "_id": k },
            doc! { "$set": { "counter": 0i64 }, "$push": { "pending": stale() } },
        )
        .upsert(true)
        .await
        .unwrap();
    }
}

async fn pending_documents(coll: &Collection<Document>) -> u64 {
    coll.count_documents(doc! { "pending": { "$exists": true } })
        .await
        .unwrap()
}

pub(crate) const LONG: Duration = Duration::from_secs(30);

/// Restarts of `views`' stream after the server lost (or refused) its
/// history.
const HISTORY_LOST: &str =
    "tally_monitor_restarts_total{collection=\"views\",reason=\"history_lost\"}";

/// Whether the state collection holds a saved position of `views`' stream.
async fn saved_position(state: &Collection<Document>) -> bool {
    state
        .find_one(doc! { "_id": "resume:views" })
        .await
        .unwrap()
        .is_some()
}

/// Makes every `update` of the test's clients, the daemon's included, take
/// `ms` milliseconds, until dropped.
async fn slow_updates(ctx: &TestContext, ms: i32) -> FailPoint {
    FailPoint::set(
        ctx,
        Bson::String("alwaysOn".into()),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": ms },
    )
    .await
}

/// Waits until the daemon's change stream is open and has seen one write.
async fn watch_one_event(daemon: &Tallyd, views: &Collection<Document>) {
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    write_and_see(daemon, views, "warm", 1).await;
}

/// Inserts the document `id` and waits until the daemon has processed
/// `events` change events in all.
async fn write_and_see(daemon: &Tallyd, views: &Collection<Document>, id: &str, events: u32) {
    views
        .insert_one(doc! { "_id": id, "counter": 1i64 })
        .await
        .unwrap();
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            f64::from(events),
            LONG,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedule_folds_and_runs_never_overlap() {
    let ctx = TestContext::new("daemon_schedule").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    seed_stale(&views, 0..5).await;
    let daemon = start(
        &ctx,
        &Conf {
            catch_up: false,
            ..Conf::default()
        },
    );
    daemon.wait_ready("active", LONG).await;
    wait_until("the next run time in the log", LONG, || async {
        daemon
            .log()
            .lines()
            .any(|line| line.contains("schedule started") && line.contains("next="))
    })
    .await;
    // A per-second schedule fires and folds.
    daemon
        .wait_metric(
            "tally_reconcile_runs_total{collection=\"views\",result=\"ok\"}",
            1.0,
            LONG,
        )
        .await;
    wait_until("the stale tokens folded", LONG, || async {
        pending_documents(&views).await == 0
    })
    .await;
    for k in 0..5 {
        assert_eq!(counter(&views, k).await, 1);
    }
    // Runs slower than the ticks: the ticks that come during a run are
    // skipped and counted, never run alongside.
    let _slow = FailPoint::set(
        &ctx,
        Bson::String("alwaysOn".into()),
        doc! { "failCommands": ["aggregate"], "blockConnection": true, "blockTimeMS": 2500 },
    )
    .await;
    daemon
        .wait_metric("tally_schedule_ticks_skipped_total", 2.0, LONG)
        .await;
    assert!(daemon.log().contains("schedule tick skipped"));
    assert_eq!(
        daemon
            .metric("tally_reconcile_runs_total{collection=\"views\",result=\"failed\"}")
            .await,
        Some(0.0),
        "no run failed (the series is there from the start, at 0)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_missed_while_down_is_caught_up_at_start() {
    let ctx = TestContext::new("daemon_catch_up").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    seed_stale(&views, 0..3).await;
    // The last successful run was two days ago; the nightly run since was
    // missed while the daemon was down.
    let two_days_ago = mongodb::bson::DateTime::from_system_time(
        SystemTime::now() - Duration::from_secs(2 * 86400),
    );
    client
        .collection("tally_state")
        .insert_one(doc! { "_id": "last_success:views", "collection": "views", "at": two_days_ago })
        .await
        .unwrap();
    let daemon = start(
        &ctx,
        &Conf {
            cron: "0 30 3 * * *",
            ..Conf::default()
        },
    );
    wait_until("the missed run caught up", LONG, || async {
        pending_documents(&views).await == 0
    })
    .await;
    assert!(
        daemon.log().contains("catching up on a missed run"),
        "{}",
        daemon.log()
    );
    // The runner records the success right after the fold: poll for it.
    let state = client.collection("tally_state");
    wait_until("the success was recorded", LONG, || async {
        let found = state
            .find_one(doc! { "_id": "last_success:views" })
            .await
            .unwrap()
            .unwrap();
        let at = found.get_datetime("at").unwrap().to_system_time();
        at > SystemTime::now() - Duration::from_secs(60)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_one_active_and_a_standby_takes_over_after_a_kill() {
    let ctx = TestContext::new("daemon_lease").await;
    let ha = "[ha]\nenabled = true\nlease_ttl = \"3s\"\n";
    let conf = |instance: &str| Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        extra: format!("{ha}instance = \"{instance}\"\n"),
        ..Conf::default()
    };
    let mut first = start(&ctx, &conf("first"));
    first.wait_ready("active", LONG).await;
    let second = start(&ctx, &conf("second"));
    second.wait_ready("standby", LONG).await;
    assert_eq!(first.ready().await.as_deref(), Some("active"));
    assert_eq!(second.metric("tally_lease_active").await, Some(0.0));
    assert_eq!(first.metric("tally_lease_active").await, Some(1.0));

    first.kill();
    let killed = Instant::now();
    second.wait_ready("active", Duration::from_secs(15)).await;
    let took = killed.elapsed();
    // The lease runs out at most 3 s after the last renewal; the standby
    // tries every second.
    assert!(took <= Duration::from_secs(5), "took over after {took:?}");
    assert!(second.log().contains("lease role changed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_the_change_stream_where_it_stopped() {
    let ctx = TestContext::new("daemon_resume").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let state = client.collection("tally_state");
    let conf = Conf::idle();
    let mut daemon = start(&ctx, &conf);
    watch_one_event(&daemon, &views).await;
    assert!(daemon.terminate().success(), "{}", daemon.log());
    assert!(saved_position(&state).await, "the resume token was saved");

    // Written while no daemon runs.
    for k in 0..5 {
        views
            .update_one(
                doc! { "_id": k },
                doc! { "$push": { "pending": ObjectId::new() } },
            )
            .upsert(true)
            .await
            .unwrap();
    }
    let daemon = start(&ctx, &conf);
    // The five writes arrive as events from the saved position, before any
    // new write is made.
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            5.0,
            LONG,
        )
        .await;
    assert!(
        daemon
            .log()
            .contains("change stream resumed from the saved position"),
        "{}",
        daemon.log()
    );
    daemon
        .wait_metric("tally_pending_tokens{collection=\"views\"}", 5.0, LONG)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_history_rescans_and_misses_nothing() {
    if external() {
        return; // needs a server with a tiny oplog
    }
    let server = TestServer::start(&ServerOptions {
        oplog_max_entries: Some(30),
        ..Default::default()
    });
    let ctx = TestContext::on("daemon_history_lost", server.uri()).await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let conf = Conf::idle();
    let mut daemon = start(&ctx, &conf);
    watch_one_event(&daemon, &views).await;
    assert!(daemon.terminate().success());

    // While it is down: a stuck token, then enough writes elsewhere to push
    // the saved position off the oplog.
    views
        .update_one(
            doc! { "_id": "stuck" },
            doc! { "$push": { "pending": stale() } },
        )
        .upsert(true)
        .await
        .unwrap();
    // The server prunes its oplog every 1,000 writes, down to the 30 kept.
    let noise: Vec<Document> = (0..1100).map(|i| doc! { "_id": i }).collect();
    client.collection("noise").insert_many(noise).await.unwrap();
    let daemon = start(&ctx, &conf);
    daemon.wait_metric(HISTORY_LOST, 1.0, LONG).await;
    assert!(
        daemon.log().contains("restarted with a full rescan"),
        "{}",
        daemon.log()
    );
    // Nothing missed: the rescan saw the stuck token.
    daemon
        .wait_metric("tally_stuck_tokens{collection=\"views\"}", 1.0, LONG)
        .await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_waits_for_the_server_and_recovers_from_its_restart() {
    if external() {
        return; // starts and restarts its own server
    }
    let data = tempfile::tempdir().unwrap();
    let port = free_address().port();
    let options = ServerOptions {
        port,
        storage_path: Some(data.path().to_owned()),
        ..Default::default()
    };
    let uri = format!("mongodb://127.0.0.1:{port}/?directConnection=true");
    let ctx_uri = uri.clone();
    // Nothing listens yet.
    let conf = Conf::default().render(
        &format!("{uri}&appName=tally-test-daemon_outage&retryWrites=false"),
        "t_daemon_outage",
    );
    let daemon = Tallyd::start(&format!("{conf}\n{ALERTS}"), &[("RUST_LOG", "info")]);
    wait_until("the daemon to report not ready", LONG, || async {
        daemon.ready_status().await == Some(503)
    })
    .await;
    // It says at once why it waits, and says it again.
    wait_until("the daemon to say twice why it waits", LONG, || async {
        daemon
            .log()
            .matches(&format!(
                "MongoDB at 127.0.0.1:{port} has not answered for "
            ))
            .count()
            >= 2
    })
    .await;
    let log = daemon.log();
    assert!(
        log.contains("(connection refused); waiting for it"),
        "{log}"
    );

    let mut server = TestServer::start(&options);
    daemon.wait_ready("active", Duration::from_secs(60)).await;
    let ctx = TestContext::on("daemon_outage", ctx_uri.clone()).await;
    let views = ctx.client(false).await.collection("views");
    seed_stale(&views, 0..3).await;
    wait_until("folded before the restart", LONG, || async {
        pending_documents(&views).await == 0
    })
    .await;

    // The server goes away and comes back on the same port and data.
    server.stop();
    let server = TestServer::start(&options);
    let views = ctx.client(false).await.collection("views");
    seed_stale(&views, 3..6).await;
    wait_until(
        "folded after the restart",
        Duration::from_secs(60),
        || async { pending_documents(&views).await == 0 },
    )
    .await;
    for k in 0..6 {
        assert_eq!(counter(&views, k).await, 1, "key {k}");
    }
    daemon
        .wait_metric(
            "tally_monitor_up{collection=\"views\"}",
            1.0,
            Duration::from_secs(60),
        )
        .await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_cut_by_the_server_does_not_break_the_next_run() {
    if external() {
        return; // needs a server with a short idle limit
    }
    let server = TestServer::start(&ServerOptions {
        idle_timeout: Some(Duration::from_millis(1500)),
        ..Default::default()
    });
    let ctx = TestContext::on("daemon_idle_cut", server.uri()).await;
    let views = ctx.client(false).await.collection("views");
    // Runs every 4 s, so every connection idles past the server's 1.5 s.
    let daemon = start(
        &ctx,
        &Conf {
            cron: "*/4 * * * * *",
            monitor: false,
            ..Conf::default()
        },
    );
    daemon.wait_ready("active", LONG).await;
    for round in 0..3 {
        seed_stale(&views, round * 10..round * 10 + 3).await;
        wait_until("folded after an idle period", LONG, || async {
            pending_documents(&views).await == 0
        })
        .await;
    }
    assert_eq!(
        daemon
            .metric("tally_reconcile_runs_total{collection=\"views\",result=\"failed\"}")
            .await,
        Some(0.0),
        "{}",
        daemon.log()
    );
}

/// A stand-in for systemd's notification socket: what the daemon sends to
/// `NOTIFY_SOCKET`, in order.
struct Notifications {
    socket: UnixDatagram,
    path: String,
    heard: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Notifications {
    fn bind() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Self {
            socket,
            path: path.to_str().unwrap().to_owned(),
            heard: Vec::new(),
            _dir: dir,
        }
    }

    /// Reads notifications until `done` holds for all heard so far; panics
    /// after 30 s without one.
    fn until(&mut self, what: &str, done: impl Fn(&[String]) -> bool) -> &[String] {
        let mut buffer = [0u8; 512];
        while !done(&self.heard) {
            let n = self.socket.recv(&mut buffer).unwrap_or_else(|err| {
                panic!("{what}: nothing within 30 s ({err}): {:?}", self.heard)
            });
            self.heard
                .push(String::from_utf8_lossy(&buffer[..n]).into_owned());
        }
        &self.heard
    }
}

/// Whether `heard` has `first`, then `then` after it.
fn in_order(heard: &[String], first: &str, then: &str) -> bool {
    heard
        .iter()
        .skip_while(|m| !m.contains(first))
        .any(|m| m.contains(then))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let ctx = TestContext::new("daemon_sd_notify").await;
    let mut systemd = Notifications::bind();
    let text = Conf::idle().render(&ctx.child_uri(false), &ctx.db_name);
    let mut daemon = Tallyd::start(
        &format!("{text}\n{ALERTS}"),
        &[
            ("NOTIFY_SOCKET", &systemd.path),
            ("WATCHDOG_USEC", "600000"),
            ("RUST_LOG", "info"),
        ],
    );
    systemd.until("READY=1 and WATCHDOG=1", |heard| {
        heard.iter().any(|m| m.contains("READY=1"))
            && heard.iter().any(|m| m.contains("WATCHDOG=1"))
    });
    assert!(
        daemon.ready().await.is_some(),
        "READY=1 came after the first connection"
    );
    assert!(daemon.terminate().success(), "{}", daemon.log());
    systemd.until("STOPPING=1", |heard| {
        heard.iter().any(|m| m.contains("STOPPING=1"))
    });
}

/// SIGTERM while a fold is under way: the batch in flight finishes, the
/// daemon exits 0, and every counter is exact — folded, or still pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_fold_exits_0_with_every_counter_exact() {
    let ctx = TestContext::new("daemon_sigterm_fold").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let mut expected = Vec::new();
    for k in 0..100i32 {
        let amount = i64::from(k % 7 + 1);
        views
            .insert_one(
                doc! { "_id": k, "counter": 10i64, "pending": [{ "t": stale(), "n": amount }] },
            )
            .await
            .unwrap();
        expected.push(10 + amount);
    }
    // Each fold batch (10 documents) takes 300 ms or more.
    let _slow = slow_updates(&ctx, 300).await;
    let mut daemon = start(
        &ctx,
        &Conf {
            cron: "0 30 3 * * *",
            ..Conf::default()
        },
    );
    wait_until("the fold to be under way", LONG, || async {
        let left = pending_documents(&views).await;
        left < 100 && left > 20
    })
    .await;
    let status = daemon.terminate();
    assert!(status.success(), "exit {status:?}\n{}", daemon.log());
    let left = pending_documents(&views).await;
    assert!(left > 0, "the shutdown interrupted the fold");
    drop(_slow);
    let docs: Vec<Document> = views
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    for d in docs {
        let k = d.get_i32("_id").unwrap();
        let pending: i64 = d
            .get_array("pending")
            .map(|p| {
                p.iter()
                    .map(|e| e.as_document().unwrap().get_i64("n").unwrap())
                    .sum()
            })
            .unwrap_or(0);
        assert_eq!(
            d.get_i64("counter").unwrap() + pending,
            expected[k as usize],
            "key {k}"
        );
    }
}

#[tokio::test]
async fn the_status_command_shows_pending_stuck_and_malformed() {
    let ctx = TestContext::new("cli_status").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    views
        .insert_many(vec![
            doc! { "_id": 1, "counter": 1i64, "pending": [stale(), ObjectId::new()] },
            doc! { "_id": 2, "counter": 1i64, "pending": [ObjectId::new()] },
            doc! { "_id": 3, "counter": "x", "pending": [stale()] },
        ])
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = ctx.config_toml(
        false,
        "[[collections]]\nname = \"views\"\n[reconcile]\ngrace = \"5m\"\n\
         [alerts]\nstuck_after = \"5m\"",
    );
    let path = crate::cli::write_config(dir.path(), &config);
    let output = crate::cli::tallyd(&["--config", &path, "status", "--json"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let views = &out["collections"][0];
    assert_eq!(views["collection"], "views");
    assert_eq!(views["documents_pending"], 2);
    assert_eq!(views["pending_tokens"], 3);
    assert_eq!(views["stuck_tokens"], 1);
    assert_eq!(views["malformed"], 1);
    assert!(views["oldest_pending_age_seconds"].as_u64().unwrap() >= 3600);
    let text = crate::cli::tallyd(&["--config", &path, "status"], &[]).await;
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("views"),
        "{text:?}"
    );
}

/// Stuck tokens fire an alert through the webhook (which fails twice
/// first: the daemon retries), the repair folds them, and the alert
/// resolves: one firing, one resolved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_tokens_alert_through_the_webhook_and_are_repaired() {
    let ctx = TestContext::new("daemon_webhook").await;
    let views = ctx.client(false).await.collection("views");
    let receiver = crate::common::receiver::Receiver::start(2).await;
    let alerts = format!(
        "[alerts]\nstuck_after = \"10s\"\nrepair = true\n[alerts.webhook]\nurl = \"http://{}/hook\"\n\
         auth_header_env = \"HOOK_TOKEN\"\nmax_attempts = 10\n",
        receiver.addr
    );
    let conf = Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        extra: alerts,
        ..Conf::default()
    };
    let daemon = Tallyd::start(
        &conf.render(&ctx.child_uri(false), &ctx.db_name),
        &[("HOOK_TOKEN", "Bearer daemon-t0ken"), ("RUST_LOG", "info")],
    );
    daemon.wait_ready("active", LONG).await;
    seed_stale(&views, 0..3).await;
    wait_until(
        "firing then resolved delivered",
        Duration::from_secs(60),
        || async { receiver.delivered().len() >= 2 },
    )
    .await;
    let delivered = receiver.delivered();
    let kinds: Vec<(String, String)> = delivered
        .iter()
        .map(|b| {
            (
                b["kind"].as_str().unwrap().to_owned(),
                b["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("stuck_tokens".to_owned(), "firing".to_owned()),
            ("stuck_tokens".to_owned(), "resolved".to_owned())
        ]
    );
    let firing = &delivered[0];
    assert_eq!(firing["collection"], "views");
    assert_eq!(firing["count"], 3);
    assert!(firing["oldest_age_seconds"].as_u64().unwrap() >= 3600);
    assert_eq!(firing["sample_ids"].as_array().unwrap().len(), 3);
    assert!(
        receiver
            .requests()
            .iter()
            .all(|r| r.authorization.as_deref() == Some("Bearer daemon-t0ken"))
    );
    assert!(
        receiver.requests().len() >= 4,
        "two failed attempts were retried"
    );
    assert_eq!(pending_documents(&views).await, 0, "the repair folded them");
    for k in 0..3 {
        assert_eq!(counter(&views, k).await, 1);
    }
    daemon
        .wait_metric(
            "tally_alert_notifications_total{kind=\"stuck_tokens\",state=\"resolved\"}",
            1.0,
            LONG,
        )
        .await;
    assert_eq!(
        daemon
            .metric("tally_alert_notifications_total{kind=\"stuck_tokens\",state=\"firing\"}")
            .await,
        Some(1.0)
    );
    assert!(
        !daemon.log().contains("daemon-t0ken"),
        "the auth header never appears in logs"
    );
    assert!(daemon.ready().await.is_some());
}

/// The daemon runs as a user holding only the role the README names:
/// find, update and changeStream on the counter collections; find on their
/// events collections and batch intents; find, insert, update and remove
/// on its state collection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_with_the_least_privileged_role() {
    if external() {
        return; // needs a server it can restart with authentication
    }
    let db = "t_least_privilege";
    let server = AuthServer::start(|admin| async move {
        admin
            .database("admin")
            .run_command(doc! { "createUser": "admin", "pwd": "admin-pw", "roles": ["root"] })
            .await
            .unwrap();
        let app = admin.database(db);
        create_tallyd_role(&app, "tallyd", &["find", "update", "changeStream"]).await;
        app.run_command(doc! { "createUser": "tally", "pwd": "tally-pw", "roles": ["tallyd"] })
            .await
            .unwrap();
    })
    .await;
    let admin = mongodb::Client::with_uri_str(server.uri("admin", "admin-pw", "admin"))
        .await
        .unwrap();
    let views = admin.database(db).collection::<Document>("views");
    seed_stale(&views, 0..3).await;
    admin
        .database(db)
        .collection::<Document>("secrets")
        .insert_one(doc! { "x": 1 })
        .await
        .unwrap();

    let uri = format!("{}&retryWrites=false", server.uri("tally", "tally-pw", db));
    let conf = Conf {
        extra: "[ha]\nenabled = true\nlease_ttl = \"3s\"\n".into(),
        ..Conf::default()
    };
    let mut text = conf.render(&uri, db);
    text.push_str(ALERTS);
    let mut daemon = Tallyd::start(&text, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    wait_until("folded with the least privileges", LONG, || async {
        pending_documents(&views).await == 0
    })
    .await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    views
        .insert_one(doc! { "_id": "after", "counter": 0i64 })
        .await
        .unwrap();
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            1.0,
            LONG,
        )
        .await;
    assert!(daemon.terminate().success(), "{}", daemon.log());
    let log = daemon.log();
    assert!(
        !log.to_lowercase().contains("unauthorized") && !log.contains("not authorized"),
        "{log}"
    );
    assert!(!log.contains("tally-pw"), "the password never appears");
    let state = admin.database(db).collection::<Document>("tally_state");
    assert!(saved_position(&state).await);
    // The role really is that narrow: actions it does not grant are refused.
    // (The test server applies a privilege to the whole database rather than
    // to the one collection it names; MongoDB scopes it to the collection.)
    let tally = mongodb::Client::with_uri_str(&uri).await.unwrap();
    let views_as_tally = tally.database(db).collection::<Document>("views");
    let index = mongodb::IndexModel::builder()
        .keys(doc! { "pending": 1 })
        .build();
    assert!(
        views_as_tally.create_index(index).await.is_err(),
        "createIndex must be refused"
    );
    assert!(
        views_as_tally.drop().await.is_err(),
        "dropCollection must be refused"
    );
}

/// A server on a fixed port and data directory, which a test can stop and
/// start again; `users` (name, password) are created before `auth`
/// switches authentication on.
pub(crate) struct OwnServer {
    options: ServerOptions,
    _data: tempfile::TempDir,
}

impl OwnServer {
    pub(crate) fn new() -> Self {
        let data = tempfile::tempdir().unwrap();
        let options = ServerOptions {
            port: free_address().port(),
            storage_path: Some(data.path().to_owned()),
            ..Default::default()
        };
        Self {
            options,
            _data: data,
        }
    }

    pub(crate) fn start(&self) -> TestServer {
        TestServer::start(&self.options)
    }

    /// Creates `user` with `password` as root, then requires authentication
    /// from the next start on.
    async fn with_user(mut self, user: &str, password: &str) -> Self {
        let mut server = self.start();
        let admin = mongodb::Client::with_uri_str(server.uri()).await.unwrap();
        admin
            .database("admin")
            .run_command(doc! { "createUser": user, "pwd": password, "roles": ["root"] })
            .await
            .unwrap();
        server.stop();
        self.options.auth = true;
        self
    }

    /// A URI for the daemon, with `credentials` (`user:password@`) if any.
    fn uri(&self, credentials: &str, name: &str) -> String {
        format!(
            "mongodb://{credentials}127.0.0.1:{}/?directConnection=true&authSource=admin\
             &appName=tally-test-{name}&retryWrites=false",
            self.options.port
        )
    }
}

/// Readiness follows MongoDB: a `hello` every 5 s; not ready once none has
/// succeeded for 15 s, ready again at the first success. Before MongoDB
/// first answered, the instance is neither ready nor active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_server_through_an_outage() {
    if external() {
        return; // stops and restarts its own server
    }
    let own = OwnServer::new();
    let conf = Conf::idle().render(&own.uri("", "daemon_readiness"), "t_daemon_readiness");
    let daemon = Tallyd::start(&format!("{conf}\n{ALERTS}"), &[("RUST_LOG", "info")]);
    wait_until("503 before MongoDB answered", LONG, || async {
        daemon.ready_status().await == Some(503)
    })
    .await;
    assert_eq!(daemon.metric("tally_ready").await, Some(0.0));
    assert_eq!(
        daemon.metric("tally_lease_active").await,
        Some(0.0),
        "not active before MongoDB ever answered"
    );

    let mut server = own.start();
    daemon.wait_ready("active", Duration::from_secs(60)).await;
    daemon.wait_metric("tally_ready", 1.0, LONG).await;
    daemon.wait_metric("tally_lease_active", 1.0, LONG).await;

    server.stop();
    let stopped = Instant::now();
    wait_until("503 during the outage", LONG, || async {
        daemon.ready_status().await == Some(503)
    })
    .await;
    let took = stopped.elapsed();
    assert!(
        took >= Duration::from_secs(9),
        "one failed probe is not an outage: not ready after {took:?}"
    );
    assert_eq!(daemon.metric("tally_ready").await, Some(0.0));
    assert!(
        daemon.log().contains("MongoDB has not answered"),
        "{}",
        daemon.log()
    );

    let _server = own.start();
    daemon.wait_ready("active", Duration::from_secs(60)).await;
    daemon.wait_metric("tally_ready", 1.0, LONG).await;
}

/// Another process holds the HTTP port: exit 78 (systemd does not restart
/// on it) naming `[http] listen`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_already_in_use_exits_78_naming_http_listen() {
    let ctx = TestContext::new("daemon_port_in_use").await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut text = Conf::default().render(&ctx.child_uri(false), &ctx.db_name);
    text.push_str(ALERTS);
    let mut daemon = Tallyd::start_on(&text, &[], taken.local_addr().unwrap());
    let status = daemon.wait(LONG);
    let log = daemon.log();
    assert_eq!(status.code(), Some(78), "{log}");
    assert!(log.contains("[http] listen"), "{log}");
}

/// A wrong password is for the operator to fix: exit 77 (permission
/// denied) at start, saying so once, naming the user and where it is
/// defined, instead of waiting for MongoDB forever. (A server that is
/// merely down is waited for: `the_daemon_waits_for_the_server_...`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_exits_77_at_start_saying_so_once() {
    if external() {
        return; // needs a server with authentication
    }
    let own = OwnServer::new().with_user("tally", "right-pw").await;
    let _server = own.start();
    let conf = Conf::default().render(&own.uri("tally:Wr0ng-pw@", "wrong_pw"), "t_wrong_pw");
    let mut daemon = Tallyd::start(&format!("{conf}\n{ALERTS}"), &[("RUST_LOG", "info")]);
    let status = daemon.wait(LONG);
    let log = daemon.log();
    assert_eq!(status.code(), Some(77), "{log}");
    assert_eq!(
        log.matches("authentication failed for tally on admin")
            .count(),
        1,
        "said once: {log}"
    );
    assert!(!log.contains("Wr0ng-pw"), "{log}");
    for debug in ["Kind:", "Some(", "labels:", "RawDocumentBuf"] {
        assert!(!log.contains(debug), "{debug}: {log}");
    }
}

/// SIGTERM when a change stream's position cannot be saved: exit 1, naming
/// what was not saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_1_naming_the_positions_it_could_not_save() {
    let ctx = TestContext::new("daemon_unsaved").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let conf = Conf::idle();
    let mut daemon = start(&ctx, &conf);
    watch_one_event(&daemon, &views).await;
    // Every update fails from now on, the state collection's included.
    let _fail = FailPoint::set(
        &ctx,
        Bson::String("alwaysOn".into()),
        doc! { "failCommands": ["update"], "errorCode": 2 },
    )
    .await;
    views.insert_one(doc! { "_id": "moved" }).await.unwrap();
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            2.0,
            LONG,
        )
        .await;
    let status = daemon.terminate();
    let log = daemon.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("not saved") && log.contains("change-stream position of views"),
        "{log}"
    );
}

/// SIGTERM while a fold batch outlasts `[daemon] shutdown_timeout`: exit 1,
/// saying the drain was cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_1_when_the_drain_deadline_passes() {
    let ctx = TestContext::new("daemon_drain_deadline").await;
    let views = ctx.client(false).await.collection("views");
    seed_stale(&views, 0..30).await;
    // Each fold batch takes 3 s; the drain may take 1 s.
    let _slow = slow_updates(&ctx, 3000).await;
    let mut daemon = start(
        &ctx,
        &Conf {
            cron: "0 30 3 * * *",
            extra: "[daemon]\nshutdown_timeout = \"1s\"\n".into(),
            ..Conf::default()
        },
    );
    wait_until("the catch-up fold to start", LONG, || async {
        daemon.log().contains("catching up on a missed run")
    })
    .await;
    // Its first batch's update is held by the fail point: in flight.
    let admin = ctx.client(false).await.client.database("admin");
    wait_until("the fold's update to be in flight", LONG, || async {
        let ops = admin.run_command(doc! { "currentOp": 1 }).await.unwrap();
        ops.get_array("inprog").is_ok_and(|ops| {
            ops.iter().filter_map(Bson::as_document).any(|op| {
                op.get_str("op").ok() == Some("update")
                    && op
                        .get_str("appName")
                        .map_or(true, |app| app.contains("daemon_drain_deadline"))
            })
        })
    })
    .await;
    let status = daemon.terminate();
    let log = daemon.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("shutdown deadline passed"), "{log}");
}

/// SIGHUP with a changed, valid configuration: the daemon drains (the
/// stream positions are saved), starts again with the new settings in the
/// same process, and tells systemd RELOADING=1 … READY=1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_changed_configuration_without_stopping() {
    let ctx = TestContext::new("daemon_sighup").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let state = client.collection("tally_state");
    let mut systemd = Notifications::bind();
    // Nightly, and positions saved only at shutdown: what a reload saves is
    // what the drain saved.
    let nightly = Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        save_interval: "10m",
        ..Conf::default()
    };
    let render = |conf: &Conf| {
        format!(
            "{}{ALERTS}",
            conf.render(&ctx.child_uri(false), &ctx.db_name)
        )
    };
    let mut daemon = Tallyd::start(
        &render(&nightly),
        &[("NOTIFY_SOCKET", &systemd.path), ("RUST_LOG", "info")],
    );
    watch_one_event(&daemon, &views).await;
    seed_stale(&views, 0..3).await;
    assert!(
        !saved_position(&state).await,
        "nothing saved before the reload"
    );

    daemon.rewrite_config(&render(&Conf {
        cron: "* * * * * *",
        ..nightly
    }));
    daemon.signal("HUP");
    wait_until("the new schedule to fold", LONG, || async {
        pending_documents(&views).await == 0
    })
    .await;
    assert!(daemon.running(), "{}", daemon.log());
    assert!(
        saved_position(&state).await,
        "the drain saved the stream position"
    );
    let log = daemon.log();
    assert!(log.contains("SIGHUP received"), "{log}");
    assert!(log.contains("configuration reloaded"), "{log}");
    daemon.wait_ready("active", LONG).await;
    let heard = systemd.until("RELOADING=1 then READY=1", |heard| {
        in_order(heard, "RELOADING=1", "READY=1")
    });
    assert!(
        !heard.iter().any(|m| m.contains("STOPPING=1")),
        "a reload is not a stop: {heard:?}"
    );
    assert!(daemon.terminate().success(), "{}", daemon.log());
}

/// SIGHUP with an invalid file: every bad key is logged and the daemon
/// keeps running with the configuration it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_an_invalid_file_keeps_the_old_configuration() {
    let ctx = TestContext::new("daemon_sighup_invalid").await;
    let views = ctx.client(false).await.collection("views");
    let conf = Conf::idle();
    let mut daemon = start(&ctx, &conf);
    daemon.wait_ready("active", LONG).await;
    let broken = conf
        .render(&ctx.child_uri(false), &ctx.db_name)
        .replace("0 30 3 * * *", "0 0 0 30 2 *")
        + "[log]\nlevel = \"inof\"\n";
    daemon.rewrite_config(&broken);
    daemon.signal("HUP");
    wait_until("the refused reload in the log", LONG, || async {
        daemon.log().contains("configuration not reloaded")
    })
    .await;
    let log = daemon.log();
    assert!(log.contains("schedule.cron"), "{log}");
    assert!(log.contains("log.level"), "{log}");
    assert!(!log.contains("configuration reloaded"), "{log}");
    assert!(daemon.running(), "{log}");
    // Still serving with the old configuration: its monitor sees writes.
    watch_one_event(&daemon, &views).await;
    assert_eq!(daemon.ready().await.as_deref(), Some("active"));
}

/// A renewal whose reply hangs (the black-pipe proxy holds it back): the
/// holder steps down on its own timer — the start of its last successful
/// renewal plus the TTL minus a margin — while the call is still in flight,
/// and a standby on a direct connection takes over. At no moment do both
/// report active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_renewal_steps_down_before_the_lease_expires() {
    let ctx = TestContext::new("daemon_lease_hang").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let conf = |instance: &str| Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        extra: format!("[ha]\nenabled = true\nlease_ttl = \"3s\"\ninstance = \"{instance}\"\n"),
        ..Conf::default()
    };
    let render = |conf: &Conf, uri: &str| format!("{}{ALERTS}", conf.render(uri, &ctx.db_name));
    let held = Tallyd::start(
        &render(&conf("held"), &ctx.child_uri_through(&proxy, false)),
        &[("RUST_LOG", "info")],
    );
    held.wait_ready("active", LONG).await;
    let standby = Tallyd::start(
        &render(&conf("standby"), &ctx.child_uri(false)),
        &[("RUST_LOG", "info")],
    );
    standby.wait_ready("standby", LONG).await;

    // From now on every renewal's reply is held back far longer than the
    // lease (and than the attempt timeouts of its retry).
    let _hang = proxy.rule(
        Rule::command("findAndModify")
            .collection("tally_state")
            .then(Action::DelayReply(Duration::from_secs(60))),
    );
    let hung = Instant::now();
    let mut held_stepped_down = None;
    loop {
        let (a, b) = (held.ready().await, standby.ready().await);
        assert!(
            !(a.as_deref() == Some("active") && b.as_deref() == Some("active")),
            "both active {:?} after the renewals began to hang\nheld:\n{}",
            hung.elapsed(),
            held.log()
        );
        if held_stepped_down.is_none() && a.as_deref() == Some("standby") {
            held_stepped_down = Some(hung.elapsed());
        }
        if b.as_deref() == Some("active") {
            break;
        }
        assert!(hung.elapsed() < LONG, "the standby never took over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The last renewal began at most 1 s (a third of the TTL) before the
    // hang; the lease is 3 s.
    let stepped_down = held_stepped_down.expect("the holder stepped down first");
    assert!(stepped_down < Duration::from_secs(3), "{stepped_down:?}");
    assert_eq!(held.metric("tally_lease_active").await, Some(0.0));
    assert!(
        held.log().contains("stepping down before it expires"),
        "{}",
        held.log()
    );
    // The renewal is still in flight (its reply comes after 60 s).
    assert!(
        proxy
            .requests("findAndModify")
            .iter()
            .any(|e| !e.reply_delivered),
        "a renewal is still waiting for its reply"
    );
}

/// A daemon watching `views` through `proxy`, its stream open and one event
/// seen.
async fn watched_through(ctx: &TestContext, proxy: &Proxy) -> (Tallyd, Collection<Document>) {
    let views = ctx.client(false).await.collection("views");
    let text = Conf::idle().render(&ctx.child_uri_through(proxy, false), &ctx.db_name);
    let daemon = Tallyd::start(&format!("{text}{ALERTS}"), &[("RUST_LOG", "info")]);
    watch_one_event(&daemon, &views).await;
    (daemon, views)
}

/// The `$changeStream` stages of the `aggregate`s in `log`, in order.
fn stream_openings(log: &[crate::common::proxy::Exchange]) -> Vec<Document> {
    log.iter()
        .filter(|e| e.command.as_deref() == Some("aggregate"))
        .filter_map(|e| {
            e.body
                .get_array("pipeline")
                .ok()?
                .first()?
                .as_document()?
                .get_document("$changeStream")
                .ok()
                .cloned()
        })
        .collect()
}

/// Codes 280 (ChangeStreamFatalError) and 260 (InvalidResumeToken) are lost
/// history like 286: a rescan and a new stream, never a reconnect to the
/// same position forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_stream_error_or_a_bad_resume_token_rescans_like_a_lost_history() {
    let ctx = TestContext::new("daemon_stream_fatal").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let (daemon, views) = watched_through(&ctx, &proxy).await;
    for (n, (code, name)) in [(280, "ChangeStreamFatalError"), (260, "InvalidResumeToken")]
        .into_iter()
        .enumerate()
    {
        let _fault = proxy.rule(Rule::command("getMore").nth(1).then(Action::error(
            code,
            name,
            &[],
        )));
        daemon.wait_metric(HISTORY_LOST, (n + 1) as f64, LONG).await;
        daemon
            .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
            .await;
    }
    assert_eq!(
        daemon
            .metric("tally_monitor_restarts_total{collection=\"views\",reason=\"error\"}")
            .await,
        None,
        "{}",
        daemon.log()
    );
    // The new stream sees writes.
    write_and_see(&daemon, &views, "after", 2).await;
}

/// After a restart from scratch (a lost history), a later ordinary error
/// reconnects from the position saved since — it does not throw the saved
/// position away again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_fresh_start_an_error_resumes_from_the_saved_position() {
    let ctx = TestContext::new("daemon_fresh_then_error").await;
    let state = ctx.client(false).await.collection("tally_state");
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let (daemon, views) = watched_through(&ctx, &proxy).await;
    {
        let _lost = proxy.rule(Rule::command("getMore").nth(1).then(Action::error(
            286,
            "ChangeStreamHistoryLost",
            &[],
        )));
        daemon.wait_metric(HISTORY_LOST, 1.0, LONG).await;
    }
    // A stream opened from scratch starts at its opening: the write must
    // come after it (one made before is the rescan's, not an event).
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    write_and_see(&daemon, &views, "second", 2).await;
    wait_until("a position saved by the new stream", LONG, || async {
        saved_position(&state).await
    })
    .await;

    proxy.clear_log();
    let _error = proxy.rule(Rule::command("getMore").nth(1).then(Action::error(
        2,
        "BadValue",
        &[],
    )));
    let log = proxy
        .wait_until("the stream reopened after the error", LONG, |log| {
            !stream_openings(log).is_empty()
        })
        .await;
    let opening = &stream_openings(&log)[0];
    assert!(
        opening.contains_key("resumeAfter"),
        "reopened from scratch instead of the saved position: {opening}"
    );
    assert!(
        !log.iter().any(|e| e.command.as_deref() == Some("delete")),
        "the saved position was discarded"
    );
    assert!(saved_position(&state).await);
}

/// An invalidate (the collection dropped) discards the stream's position:
/// the invalidate event's own token is never saved first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidate_never_saves_its_own_token() {
    let ctx = TestContext::new("daemon_invalidate").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let (daemon, views) = watched_through(&ctx, &proxy).await;
    views.drop().await.unwrap();
    daemon
        .wait_metric(
            "tally_monitor_restarts_total{collection=\"views\",reason=\"invalidate\"}",
            1.0,
            LONG,
        )
        .await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    let log = proxy.log();
    // The invalidate event's token, and the batch's position after it.
    let mut after_invalidate = Vec::new();
    for reply in log
        .iter()
        .filter(|e| e.command.as_deref() == Some("getMore"))
        .filter_map(|e| e.reply.as_ref()?.get_document("cursor").ok())
    {
        let batch = reply.get_array("nextBatch").cloned().unwrap_or_default();
        for event in batch.iter().filter_map(Bson::as_document) {
            if event
                .get_str("operationType")
                .is_ok_and(|op| op == "invalidate")
            {
                after_invalidate.extend(event.get("_id").cloned());
                after_invalidate.extend(reply.get("postBatchResumeToken").cloned());
            }
        }
    }
    assert!(
        !after_invalidate.is_empty(),
        "no invalidate event came through the proxy"
    );
    let saved: Vec<Bson> = log
        .iter()
        .filter(|e| e.command.as_deref() == Some("update"))
        .filter(|e| e.collection.as_deref() == Some("tally_state"))
        .filter_map(|e| {
            let statement = e.body.get_array("updates").ok()?.first()?.as_document()?;
            statement.get_document("u").ok()?.get("token").cloned()
        })
        .collect();
    for token in &after_invalidate {
        assert!(
            !saved.contains(token),
            "the position at the invalidate was saved: {token}"
        );
    }
}

/// A webhook's and a log's `sample_ids` show each document id as it is: a
/// string id as itself (`docs`, not `"docs"`), any other BSON type as its
/// relaxed extended JSON (`{"$oid":"…"}`, `7`, `{"a":1}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_ids_show_document_ids_as_they_are() {
    let ctx = TestContext::new("daemon_sample_ids").await;
    let views = ctx.client(false).await.collection("views");
    let object_id = ObjectId::new();
    let ids = [
        Bson::String("docs".into()),
        Bson::ObjectId(object_id),
        Bson::Int32(7),
        Bson::Document(doc! { "a": 1 }),
    ];
    for id in &ids {
        views
            .insert_one(doc! { "_id": id.clone(), "counter": 0i64, "pending": [stale()] })
            .await
            .unwrap();
    }
    let receiver = crate::common::receiver::Receiver::start(0).await;
    let alerts = format!(
        "[alerts]\nstuck_after = \"10s\"\n[alerts.webhook]\nurl = \"http://{}/hook\"\n",
        receiver.addr
    );
    let conf = Conf {
        extra: alerts,
        ..Conf::idle()
    };
    let daemon = Tallyd::start(
        &conf.render(&ctx.child_uri(false), &ctx.db_name),
        &[("RUST_LOG", "info")],
    );
    wait_until("the stuck-token alert delivered", LONG, || async {
        !receiver.delivered().is_empty()
    })
    .await;
    let firing = &receiver.delivered()[0];
    assert_eq!(firing["kind"], "stuck_tokens", "{firing}");
    let mut shown: Vec<String> = firing["sample_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_str().unwrap().to_owned())
        .collect();
    shown.sort();
    let mut expected = vec![
        "docs".to_owned(),
        format!("{{\"$oid\":\"{}\"}}", object_id.to_hex()),
        "7".to_owned(),
        "{\"a\":1}".to_owned(),
    ];
    expected.sort();
    assert_eq!(shown, expected);
    // The log lists them as words, each as the payload shows it.
    let log = daemon.log();
    let line = log
        .lines()
        .find(|l| l.contains("alert firing"))
        .unwrap_or_else(|| panic!("{log}"));
    for id in &expected {
        assert!(line.contains(id.as_str()), "{id}: {line}");
    }
    assert!(!line.contains("[\"") && !line.contains("\\\""), "{line}");
}

/// The daemon measures this host's clock against the server's at each
/// readiness probe (`tally_clock_skew_seconds`) and fires `clock_skew` for
/// each collection whose margin (`grace − retry_horizon − attempt_timeout`)
/// the skew uses more than half of: with the clock moved 10 minutes back
/// (`TALLYD_CLOCK_OFFSET`, a testing aid), `views` (grace 10 s: a 1 s
/// margin) fires, `clicks` (grace 60 m) does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_skew_past_half_the_margin_fires_clock_skew() {
    let ctx = TestContext::new("daemon_clock_skew").await;
    let receiver = crate::common::receiver::Receiver::start(0).await;
    let extra = format!(
        "[[collections]]\nname = \"clicks\"\ngrace = \"60m\"\n\
         [alerts]\nstuck_after = \"60m\"\n[alerts.webhook]\nurl = \"http://{}/hook\"\n",
        receiver.addr
    );
    let conf = Conf {
        extra,
        ..Conf::idle()
    };
    let daemon = Tallyd::start(
        &conf.render(&ctx.child_uri(false), &ctx.db_name),
        &[("RUST_LOG", "info"), ("TALLYD_CLOCK_OFFSET", "-10m")],
    );
    wait_until("the clock_skew alert delivered", LONG, || async {
        receiver
            .delivered()
            .iter()
            .any(|b| b["kind"] == "clock_skew")
    })
    .await;
    let delivered = receiver.delivered();
    let skewed: Vec<&serde_json::Value> = delivered
        .iter()
        .filter(|b| b["kind"] == "clock_skew")
        .collect();
    assert_eq!(skewed.len(), 1, "{delivered:?}");
    let firing = skewed[0];
    assert_eq!(firing["collection"], "views", "{firing}");
    assert_eq!(firing["state"], "firing", "{firing}");
    let seconds = firing["count"].as_u64().unwrap();
    assert!((599..=601).contains(&seconds), "{firing}");
    let detail = firing["detail"].as_str().unwrap();
    assert!(
        detail.contains("behind") && detail.contains("grace 10s"),
        "{detail}"
    );
    let skew = daemon.metric("tally_clock_skew_seconds").await.unwrap();
    assert!(
        (-601.0..=-599.0).contains(&skew),
        "tally_clock_skew_seconds {skew}"
    );
    assert_eq!(
        daemon.metric("tally_clock_skew_margin_seconds").await,
        Some(1.0)
    );
    let firing_for = |collection: &'static str| {
        format!("tally_alerts_firing{{collection=\"{collection}\",kind=\"clock_skew\"}}")
    };
    assert_eq!(daemon.metric(&firing_for("views")).await, Some(1.0));
    assert_eq!(daemon.metric(&firing_for("clicks")).await, Some(0.0));
    assert!(daemon.log().contains("clock_skew"), "{}", daemon.log());
}

/// `[alerts] max_lanes`: a lane map larger than it fires `lanes_too_many`
/// through the webhook with the document's id, and resolves once the map
/// shrinks; the lane gauges follow every change the stream brings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_lane_maps_alert_and_show_in_the_lane_metrics() {
    let ctx = TestContext::new("daemon_lanes").await;
    let views = ctx.client(false).await.collection("views");
    let receiver = crate::common::receiver::Receiver::start(0).await;
    let conf = Conf {
        extra: format!(
            "[alerts]\nstuck_after = \"10s\"\nmax_lanes = 3\n[alerts.webhook]\nurl = \"http://{}/hook\"\n",
            receiver.addr
        ),
        ..Conf::idle()
    };
    let daemon = start(&ctx, &conf);
    daemon.wait_ready("active", LONG).await;
    let (a, b) = (ObjectId::new().to_hex(), ObjectId::new().to_hex());
    views
        .insert_many(vec![
            doc! { "_id": 1, "counter": 5i64, "lanes": {
            "orders:0": 10i64, "orders:1": 11i64, "orders:2": 12i64, &a: 1i64, &b: 2i64 } },
            doc! { "_id": 2, "counter": 2i64, "lanes": { &a: 3i64, &b: 1i64 } },
            doc! { "_id": 3, "counter": 1i64, "pending": [ObjectId::new()] },
        ])
        .await
        .unwrap();
    let gauges = |documents: f64, entries: f64, largest: f64| {
        let daemon = &daemon;
        async move {
            daemon
                .metric("tally_lane_documents{collection=\"views\"}")
                .await
                == Some(documents)
                && daemon
                    .metric("tally_lane_entries{collection=\"views\"}")
                    .await
                    == Some(entries)
                && daemon
                    .metric("tally_largest_lane_map{collection=\"views\"}")
                    .await
                    == Some(largest)
        }
    };
    wait_until("the lane gauges", LONG, || gauges(2.0, 7.0, 5.0)).await;
    wait_until("lanes_too_many fired", LONG, || async {
        !receiver.delivered().is_empty()
    })
    .await;
    let firing = &receiver.delivered()[0];
    assert_eq!(firing["kind"], "lanes_too_many");
    assert_eq!(firing["state"], "firing");
    assert_eq!(firing["count"], 1);
    assert_eq!(firing["sample_ids"], serde_json::json!(["1"]));

    views
        .update_one(
            doc! { "_id": 1 },
            doc! { "$unset": { "lanes.orders:0": "", "lanes.orders:1": "" } },
        )
        .await
        .unwrap();
    wait_until("the lane gauges after the update", LONG, || {
        gauges(2.0, 5.0, 3.0)
    })
    .await;
    wait_until("lanes_too_many resolved", LONG, || async {
        receiver.delivered().len() >= 2
    })
    .await;
    let resolved = &receiver.delivered()[1];
    assert_eq!(
        (&resolved["kind"], &resolved["state"]),
        (
            &serde_json::json!("lanes_too_many"),
            &serde_json::json!("resolved")
        )
    );
    assert_eq!(receiver.delivered().len(), 2, "{:?}", receiver.delivered());
}

/// `tallyd status` shows per collection the documents with lanes, their
/// entries, the largest map, and every named lane with its highest
/// position (named lanes are never pruned: operators must see them).
#[tokio::test]
async fn the_status_command_shows_lanes_and_named_lanes() {
    let ctx = TestContext::new("cli_status_lanes").await;
    let views = ctx.client(false).await.collection("views");
    let old = Token::created_at_time(SystemTime::now() - Duration::from_secs(48 * 3600))
        .object_id()
        .to_hex();
    views
        .insert_many(vec![
            doc! { "_id": 1, "counter": 1i64, "lanes": { "orders:0": 7i64, &old: 1i64 } },
            doc! { "_id": 2, "counter": 1i64, "lanes": { "orders:0": 9i64, "orders:1": 0i64 } },
            doc! { "_id": 3, "counter": 1i64, "lanes": { ObjectId::new().to_hex(): 4i64 } },
            doc! { "_id": 4, "counter": 1i64, "lanes": [1] },
        ])
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = ctx.config_toml(false, "[[collections]]\nname = \"views\"");
    let path = crate::cli::write_config(dir.path(), &config);
    let output = crate::cli::tallyd(&["--config", &path, "status", "--json"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let out: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let views = &out["collections"][0];
    assert_eq!(views["documents_with_lanes"], 3);
    assert_eq!(views["lane_entries"], 5);
    assert_eq!(views["largest_lane_map"], 2);
    assert_eq!(views["named_lane_entries"], 3);
    assert_eq!(
        views["named_lanes"],
        serde_json::json!({ "orders:0": 9, "orders:1": 0 })
    );
    assert_eq!(views["named_lanes_truncated"], false);
    assert_eq!(views["malformed"], 1, "the lane map that is an array");
    let text = crate::cli::tallyd(&["--config", &path, "status"], &[]).await;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("named lanes (never pruned)") && text.contains("  orders:0  9"),
        "{text}"
    );
}
