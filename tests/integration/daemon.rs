//! `tallyd run` as a child process: the schedule, the lease, the monitor,
//! restarts and outages, systemd notifications, shutdown.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::Token;

use crate::common::server::{ServerOptions, TestServer};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{FailPoint, TestContext, counter, external, wait_until};

/// The daemon's settings for a test; rendered to TOML.
pub(crate) struct Conf {
    pub(crate) cron: &'static str,
    pub(crate) catch_up: bool,
    pub(crate) monitor: bool,
    pub(crate) extra: String,
}

impl Default for Conf {
    fn default() -> Self {
        Self {
            cron: "* * * * * *",
            catch_up: true,
            monitor: true,
            extra: String::new(),
        }
    }
}

impl Conf {
    /// The config file: collection `views`, grace 7 s, retry horizon 2 s,
    /// attempts bounded by 4 s (the grace must outlast the horizon plus one
    /// attempt).
    pub(crate) fn render(&self, uri: &str, database: &str) -> String {
        format!(
            r#"
[mongodb]
uri = "{uri}"
database = "{database}"
server_selection_timeout = "2s"
attempt_timeout = "4s"
[[collections]]
name = "views"
[writer]
retry_horizon = "2s"
[reconcile]
grace = "7s"
batch_size = 10
[schedule]
cron = "{cron}"
catch_up = {catch_up}
[monitor]
enabled = {monitor}
save_interval = "200ms"
scan_interval = "10m"
{extra}
"#,
            cron = self.cron,
            catch_up = self.catch_up,
            monitor = self.monitor,
            extra = self.extra,
        )
    }
}

/// The alerts section most tests use: tokens stuck after 7 s (the grace:
/// no shorter).
const ALERTS: &str = "[alerts]\nstuck_after = \"7s\"\n";

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

async fn seed_stale(coll: &Collection<Document>, keys: std::ops::Range<i32>) {
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

const LONG: Duration = Duration::from_secs(30);

/// Waits until the daemon's change stream is open and has seen one write.
async fn watch_one_event(daemon: &Tallyd, views: &Collection<Document>) {
    daemon
        .wait_metric("tally_monitor_up{collection=\"views\"}", 1.0, LONG)
        .await;
    views
        .insert_one(doc! { "_id": "warm", "counter": 1i64 })
        .await
        .unwrap();
    daemon
        .wait_metric(
            "tally_monitor_events_total{collection=\"views\"}",
            1.0,
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
        None
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
    let state = client
        .collection("tally_state")
        .find_one(doc! { "_id": "last_success:views" })
        .await
        .unwrap()
        .unwrap();
    let at = state.get_datetime("at").unwrap().to_system_time();
    assert!(
        at > SystemTime::now() - Duration::from_secs(60),
        "the success was recorded"
    );
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
    let conf = Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        ..Conf::default()
    };
    let mut daemon = start(&ctx, &conf);
    watch_one_event(&daemon, &views).await;
    assert!(daemon.terminate().success(), "{}", daemon.log());
    assert!(
        state
            .find_one(doc! { "_id": "resume:views" })
            .await
            .unwrap()
            .is_some(),
        "the resume token was saved"
    );

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
    let conf = Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        ..Conf::default()
    };
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
    daemon
        .wait_metric(
            "tally_monitor_restarts_total{collection=\"views\",reason=\"history_lost\"}",
            1.0,
            LONG,
        )
        .await;
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
    wait_until("the daemon to wait for MongoDB", LONG, || async {
        daemon.log().contains("waiting for MongoDB")
    })
    .await;

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
        None,
        "{}",
        daemon.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_watchdog_and_stopping() {
    let ctx = TestContext::new("daemon_sd_notify").await;
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let text = Conf {
        cron: "0 30 3 * * *",
        catch_up: false,
        ..Conf::default()
    }
    .render(&ctx.child_uri(false), &ctx.db_name);
    let mut daemon = Tallyd::start(
        &format!("{text}\n{ALERTS}"),
        &[
            ("NOTIFY_SOCKET", socket_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "600000"),
            ("RUST_LOG", "info"),
        ],
    );
    let mut heard = Vec::new();
    let mut buffer = [0u8; 512];
    while !(heard.iter().any(|m: &String| m.contains("READY=1"))
        && heard.iter().any(|m| m.contains("WATCHDOG=1")))
    {
        let n = socket
            .recv(&mut buffer)
            .expect("a notification within 30 s");
        heard.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
    }
    assert!(
        daemon.ready().await.is_some(),
        "READY=1 came after the first connection"
    );
    assert!(daemon.terminate().success(), "{}", daemon.log());
    loop {
        let n = socket.recv(&mut buffer).expect("STOPPING=1 within 30 s");
        if String::from_utf8_lossy(&buffer[..n]).contains("STOPPING=1") {
            break;
        }
    }
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
    let _slow = FailPoint::set(
        &ctx,
        Bson::String("alwaysOn".into()),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 300 },
    )
    .await;
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
        "[[collections]]\nname = \"views\"\n[reconcile]\ngrace = \"2m\"\n\
         [alerts]\nstuck_after = \"2m\"",
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
        "[alerts]\nstuck_after = \"7s\"\nrepair = true\n[alerts.webhook]\nurl = \"http://{}/hook\"\n\
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
/// find, update and changeStream on the counter collections; find,
/// insert, update and remove on its state collection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_with_the_least_privileged_role() {
    if external() {
        return; // needs a server it can restart with authentication
    }
    let data = tempfile::tempdir().unwrap();
    let port = free_address().port();
    let mut options = ServerOptions {
        port,
        storage_path: Some(data.path().to_owned()),
        ..Default::default()
    };
    let db = "t_least_privilege";
    {
        // Users are provisioned before authentication is switched on.
        let mut server = TestServer::start(&options);
        let admin = mongodb::Client::with_uri_str(server.uri()).await.unwrap();
        admin
            .database("admin")
            .run_command(doc! { "createUser": "admin", "pwd": "admin-pw", "roles": ["root"] })
            .await
            .unwrap();
        let app = admin.database(db);
        app.run_command(doc! {
            "createRole": "tallyd",
            "privileges": [
                { "resource": { "db": db, "collection": "views" }, "actions": ["find", "update", "changeStream"] },
                { "resource": { "db": db, "collection": "tally_state" }, "actions": ["find", "insert", "update", "remove"] },
            ],
            "roles": [],
        })
        .await
        .unwrap();
        app.run_command(doc! { "createUser": "tally", "pwd": "tally-pw", "roles": ["tallyd"] })
            .await
            .unwrap();
        server.stop();
    }
    options.auth = true;
    let _server = TestServer::start(&options);
    let admin = mongodb::Client::with_uri_str(format!(
        "mongodb://admin:admin-pw@127.0.0.1:{port}/?directConnection=true&authSource=admin"
    ))
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

    let uri = format!(
        "mongodb://tally:tally-pw@127.0.0.1:{port}/?directConnection=true&authSource={db}&retryWrites=false"
    );
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
    assert!(
        state
            .find_one(doc! { "_id": "resume:views" })
            .await
            .unwrap()
            .is_some()
    );
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
