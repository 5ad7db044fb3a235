//! The lifecycle matrix, in the spirit of the fault matrix: every life
//! event of the daemon — a start (fresh, after a clean stop, after
//! `kill -9`), SIGHUP with a valid configuration, with an invalid one, with
//! one that cannot be applied (a port in use, an unreachable URI), with a
//! collection added or removed, SIGTERM during an outage, an outage of a
//! few seconds, a second instance — crossed with what must hold after it:
//!
//! - still running, or exited by the exit-code table;
//! - ready and active once the event is over;
//! - `/metrics` serving every series a rule of `config/alerts.yml` reads
//!   (read from the file itself);
//! - no data alert fired or resolved by the event alone (the truth does not
//!   change: one malformed document in `views`, nothing else wrong);
//! - nothing lost: every event recorded before, during and after is folded
//!   into its counter exactly once;
//! - SIGTERM stops it within the unit's `TimeoutStopSec`.
//!
//! Each row is a test of its own, so the rows run side by side.

use std::time::{Duration, Instant};

use mongodb::bson::doc;
use tally::{CollectionConfig, Ledger};

use super::{ALERTS, LEDGER, missing, scrape, value};
use crate::common::server::TestServer;
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, counter, external, wait_until};
use crate::daemon::{Conf, OwnServer};

/// Waits for anything the matrix waits for (a lease left by a killed
/// instance runs out within it).
const PATIENCE: Duration = Duration::from_secs(60);

/// A second collection, added or removed by a reload.
const EXTRA: &str = "[[collections]]\nname = \"extra\"\n";

/// Several instances, one active.
const HA: &str = "[ha]\nenabled = true\nlease_ttl = \"6s\"\n";

/// How long the outage row keeps the server down: `TALLY_LIFE_OUTAGE_SECONDS`,
/// default 5 (a few seconds in the suite, minutes on demand).
fn outage_length() -> Duration {
    let seconds = std::env::var("TALLY_LIFE_OUTAGE_SECONDS").map_or(5, |s| {
        s.parse()
            .expect("TALLY_LIFE_OUTAGE_SECONDS is a whole number of seconds")
    });
    Duration::from_secs(seconds)
}

/// The unit's `TimeoutStopSec`, from `systemd/tallyd.service` itself: how
/// long systemd lets a stop take before it kills the daemon.
fn stop_deadline() -> Duration {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/tallyd.service");
    let unit = std::fs::read_to_string(&path).expect("read the unit");
    let value = unit
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .expect("the unit sets TimeoutStopSec");
    humantime::parse_duration(value.trim()).expect("TimeoutStopSec is a duration")
}

/// One row's world: a server (its own, when the row stops it), a database,
/// a ledger on `hits` recorded into from this process, and what was
/// recorded.
struct Scene {
    own: Option<OwnServer>,
    server: Option<TestServer>,
    ctx: TestContext,
    ledger: Ledger,
    recorded: i64,
    extra: bool,
    ha: bool,
    /// Server selection waits 30 s (the default), not 2 s: what is in
    /// flight at an outage waits that long.
    patient: bool,
}

impl Scene {
    /// A scene on the suite's server, or on a server of its own when the
    /// row stops it (`None` against an external server: it cannot be
    /// stopped).
    async fn new(name: &str, own_server: bool) -> Option<Self> {
        let (own, server, ctx) = if own_server {
            if external() {
                return None;
            }
            let own = OwnServer::new();
            let server = own.start();
            let ctx = TestContext::on(name, server.uri()).await;
            (Some(own), Some(server), ctx)
        } else {
            (None, None, TestContext::new(name).await)
        };
        let client = ctx.client(false).await;
        // The truth the alerts must keep telling: one malformed document.
        client
            .collection("views")
            .insert_one(doc! { "_id": "broken", "counter": 0i64, "pending": "not an array" })
            .await
            .unwrap();
        let ledger = Ledger::new(&client.store(), CollectionConfig::new("hits"));
        ledger.create_indexes().await.unwrap();
        Some(Self {
            own,
            server,
            ctx,
            ledger,
            recorded: 0,
            extra: false,
            ha: false,
            patient: false,
        })
    }

    /// The daemon's configuration: every second a run, a ledger, alerts.
    fn config(&self) -> String {
        let mut extra = LEDGER.to_owned();
        if self.extra {
            extra.push_str(EXTRA);
        }
        if self.ha {
            extra.push_str(HA);
        }
        let conf = Conf {
            extra,
            ..Conf::default()
        };
        let text = format!(
            "{}{ALERTS}",
            conf.render(&self.ctx.child_uri(false), &self.ctx.db_name)
        );
        if !self.patient {
            return text;
        }
        // The default selection timeout, and the margins it implies.
        [
            (
                "server_selection_timeout = \"2s\"",
                "server_selection_timeout = \"30s\"",
            ),
            ("attempt_timeout = \"3s\"", "attempt_timeout = \"35s\""),
            ("retry_horizon = \"6s\"", "retry_horizon = \"70s\""),
            ("grace = \"10s\"", "grace = \"120s\""),
            ("stuck_after = \"10s\"", "stuck_after = \"120s\""),
        ]
        .into_iter()
        .fold(text, |text, (from, to)| {
            assert!(text.contains(from), "{from} in {text}");
            text.replace(from, to)
        })
    }

    fn start(&self) -> Tallyd {
        Tallyd::start(&self.config(), &[("RUST_LOG", "info")])
    }

    /// Records ten new events on the counter `home`.
    async fn record(&mut self, tag: &str) {
        let events: Vec<(String, &str, i64)> =
            (0..10).map(|i| (format!("{tag}-{i}"), "home", 1)).collect();
        let outcomes = self.ledger.record_many(events).await;
        assert!(
            outcomes.iter().all(|o| o.is_counted()),
            "{tag}: {outcomes:?}"
        );
        self.recorded += 10;
    }

    fn stop_server(&mut self) {
        self.server.take().expect("the server runs").stop();
    }

    fn start_server(&mut self) {
        let own = self.own.as_ref().expect("a server of its own");
        self.server = Some(own.start());
    }

    /// Every event recorded so far is in the counter, exactly.
    async fn all_folded(&self, daemon: &Tallyd) {
        let views = self.ctx.client(false).await.collection("hits");
        let expected = self.recorded;
        let deadline = Instant::now() + PATIENCE;
        loop {
            let now = counter(&views, "home").await;
            assert!(
                now <= expected,
                "counted {now} of {expected} events\nlog:\n{}",
                daemon.log()
            );
            if now == expected {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{now} of {expected} events folded within {PATIENCE:?}\nlog:\n{}",
                daemon.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(self.ledger.value("home").await.unwrap().value, expected);
    }
}

/// The alert notifications a log holds from byte `from` on: (`firing` or
/// `resolved`, kind, collection).
fn notifications(log: &str, from: usize) -> Vec<(String, String, String)> {
    let field = |line: &str, name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .unwrap_or("?")
            .to_owned()
    };
    log[from.min(log.len())..]
        .lines()
        .filter_map(|line| {
            let state = if line.contains("alert firing") {
                "firing"
            } else if line.contains("alert resolved") {
                "resolved"
            } else {
                return None;
            };
            Some((
                state.to_owned(),
                field(line, "kind"),
                field(line, "collection"),
            ))
        })
        .collect()
}

/// What must hold once a life event is over, for the daemon that runs on:
/// ready and active, every series an alert rule reads served, no
/// notification since byte `since` of its log but, for a process started by
/// the event, the truth fired again (`restarted`), and every event folded
/// exactly — those recorded after the event included.
async fn holds_after(scene: &mut Scene, daemon: &mut Tallyd, since: usize, restarted: bool) {
    assert!(daemon.running(), "it runs on\nlog:\n{}", daemon.log());
    daemon.wait_ready("active", PATIENCE).await;
    let text = scrape(daemon).await;
    let absent = missing(&text);
    assert!(
        absent.is_empty(),
        "no series for {absent:?}\n{text}\nlog:\n{}",
        daemon.log()
    );
    scene.record("after").await;
    scene.all_folded(daemon).await;
    // The truth is firing: the scheduled runs find the malformed document.
    wait_until("malformed fires for views", PATIENCE, || async {
        daemon
            .metric("tally_alerts_firing{collection=\"views\",kind=\"malformed\"}")
            .await
            == Some(1.0)
    })
    .await;
    let said = notifications(&daemon.log(), since);
    let truth = (
        "firing".to_owned(),
        "malformed".to_owned(),
        "views".to_owned(),
    );
    let unexpected: Vec<_> = said
        .iter()
        .filter(|n| !(restarted && **n == truth))
        .collect();
    assert!(
        unexpected.is_empty(),
        "notified by the event alone: {unexpected:?}\nlog:\n{}",
        daemon.log()
    );
}

/// SIGTERM: exit 0 within the unit's deadline.
fn stops_in_time(daemon: &mut Tallyd) {
    let deadline = stop_deadline();
    let started = Instant::now();
    daemon.signal("TERM");
    let status = daemon.wait(deadline);
    assert_eq!(status.code(), Some(0), "{}", daemon.log());
    assert!(
        started.elapsed() < deadline,
        "stopped in {:?}",
        started.elapsed()
    );
}

/// Starts a daemon on the scene and waits until it folds and alerts: the
/// state every event starts from. Returns it with the length of its log.
async fn running(scene: &mut Scene) -> (Tallyd, usize) {
    let daemon = scene.start();
    daemon.wait_ready("active", PATIENCE).await;
    scene.record("before").await;
    scene.all_folded(&daemon).await;
    wait_until("malformed fires for views", PATIENCE, || async {
        daemon
            .metric("tally_alerts_firing{collection=\"views\",kind=\"malformed\"}")
            .await
            == Some(1.0)
    })
    .await;
    let mark = daemon.log().len();
    (daemon, mark)
}

/// Sends SIGHUP after writing `config` and waits until the reload is done
/// (`reloaded`) or refused; the daemon keeps running either way.
async fn reload(daemon: &Tallyd, config: &str, reloaded: bool) {
    let done = |log: &str| log.matches("configuration reloaded").count();
    let refused = |log: &str| log.matches("configuration not reloaded").count();
    let (done_before, refused_before) = (done(&daemon.log()), refused(&daemon.log()));
    daemon.rewrite_config(config);
    daemon.signal("HUP");
    wait_until("the reload is over", PATIENCE, || async {
        let log = daemon.log();
        done(&log) > done_before || refused(&log) > refused_before
    })
    .await;
    let log = daemon.log();
    assert_eq!(done(&log) > done_before, reloaded, "{log}");
    let success = daemon.metric("tally_config_last_reload_success").await;
    let failures = daemon.metric("tally_config_reload_failures_total").await;
    if reloaded {
        assert_eq!((success, failures), (Some(1.0), Some(0.0)), "{log}");
    } else {
        assert_eq!((success, failures), (Some(0.0), Some(1.0)), "{log}");
        let line = log
            .lines()
            .rfind(|l| l.contains("configuration not reloaded"))
            .unwrap();
        assert!(
            !line.contains("Error {") && !line.contains("kind:"),
            "{line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_start() {
    let mut scene = Scene::new("life_m_fresh", false).await.unwrap();
    let (mut daemon, _) = running(&mut scene).await;
    holds_after(&mut scene, &mut daemon, 0, true).await;
    stops_in_time(&mut daemon);
}

/// The row of a start after the first instance ended by `end`.
async fn start_after(name: &str, end: fn(&mut Tallyd)) {
    let mut scene = Scene::new(name, false).await.unwrap();
    let (mut first, _) = running(&mut scene).await;
    end(&mut first);
    scene.record("between").await;
    let mut daemon = scene.start();
    holds_after(&mut scene, &mut daemon, 0, true).await;
    stops_in_time(&mut daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_after_a_clean_stop() {
    start_after("life_m_after_stop", stops_in_time).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_after_kill_9() {
    start_after("life_m_after_kill", Tallyd::kill).await;
}

/// The row of a SIGHUP with the configuration `change` makes of the
/// scene's, taken over (`reloaded`) or refused.
async fn reload_row(name: &str, change: fn(&Scene) -> String, reloaded: bool) -> String {
    let mut scene = Scene::new(name, false).await.unwrap();
    let (mut daemon, mark) = running(&mut scene).await;
    let changed = change(&scene);
    assert_ne!(changed, scene.config(), "the configuration changed");
    reload(&daemon, &changed, reloaded).await;
    let log = daemon.log();
    holds_after(&mut scene, &mut daemon, mark, false).await;
    stops_in_time(&mut daemon);
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_a_valid_configuration() {
    reload_row(
        "life_m_reload_valid",
        |scene| scene.config().replace("batch_size = 10", "batch_size = 20"),
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_a_bad_key() {
    reload_row(
        "life_m_reload_bad",
        |scene| format!("{}[daemon]\nno_such_key = 1\n", scene.config()),
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_to_a_port_in_use() {
    let mut scene = Scene::new("life_m_reload_port", false).await.unwrap();
    let (mut daemon, mark) = running(&mut scene).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let done = daemon.log().matches("configuration not reloaded").count();
    daemon.rewrite_config_listening(&scene.config(), taken.local_addr().unwrap());
    daemon.signal("HUP");
    wait_until("the reload is refused", PATIENCE, || async {
        daemon.log().matches("configuration not reloaded").count() > done
    })
    .await;
    assert!(daemon.log().contains("[http] listen"), "{}", daemon.log());
    holds_after(&mut scene, &mut daemon, mark, false).await;
    stops_in_time(&mut daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_to_an_unreachable_server() {
    let log = reload_row(
        "life_m_reload_unreachable",
        |scene| {
            let nobody = free_address();
            scene.config().replace(
                &scene.ctx.child_uri(false),
                &format!("mongodb://{nobody}/?directConnection=true"),
            )
        },
        false,
    )
    .await;
    let line = log
        .lines()
        .rfind(|l| l.contains("configuration not reloaded"))
        .unwrap();
    assert!(line.contains("did not answer"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adding_a_collection() {
    let mut scene = Scene::new("life_m_reload_added", false).await.unwrap();
    let (mut daemon, mark) = running(&mut scene).await;
    scene.extra = true;
    reload(&daemon, &scene.config(), true).await;
    wait_until("the new collection is watched", PATIENCE, || async {
        daemon
            .metric("tally_monitor_up{collection=\"extra\"}")
            .await
            == Some(1.0)
    })
    .await;
    holds_after(&mut scene, &mut daemon, mark, false).await;
    stops_in_time(&mut daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_removing_a_collection() {
    let mut scene = Scene::new("life_m_reload_removed", false).await.unwrap();
    scene.extra = true;
    let (mut daemon, mark) = running(&mut scene).await;
    daemon
        .wait_metric("tally_monitor_up{collection=\"extra\"}", 1.0, PATIENCE)
        .await;
    scene.extra = false;
    reload(&daemon, &scene.config(), true).await;
    holds_after(&mut scene, &mut daemon, mark, false).await;
    let text = scrape(&daemon).await;
    let stale: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("collection=\"extra\""))
        .collect();
    assert!(
        stale.is_empty(),
        "series of a collection no longer configured: {stale:?}"
    );
    stops_in_time(&mut daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_an_outage() {
    let Some(mut scene) = Scene::new("life_m_term_outage", true).await else {
        return; // stops its own server
    };
    let (mut daemon, _) = running(&mut scene).await;
    scene.stop_server();
    wait_until("both change streams broke off", PATIENCE, || async {
        daemon
            .metric("tally_monitor_up{collection=\"views\"}")
            .await
            == Some(0.0)
            && daemon.metric("tally_monitor_up{collection=\"hits\"}").await == Some(0.0)
    })
    .await;
    // Its change streams broke off when the server went (their positions
    // saved if they could be; the next start resumes from the last one
    // saved): exit 0 — unless a scheduled run (one a second here) was
    // waiting for the server when the signal came and its retry outlived
    // the drain: then exit 1, saying so, as the exit table says (the
    // row below forces that case). Either answer is true; no other is.
    let started = Instant::now();
    daemon.signal("TERM");
    let status = daemon.wait(stop_deadline());
    assert!(
        started.elapsed() < stop_deadline(),
        "stopped in {:?}",
        started.elapsed()
    );
    let abandoned = daemon
        .log()
        .contains("MongoDB is unreachable: work still waiting for it");
    assert_eq!(
        status.code(),
        Some(if abandoned { 1 } else { 0 }),
        "{}",
        daemon.log()
    );
    restarted_after_the_outage(&mut scene).await;
}

/// The server back after an outage its daemon was stopped in: an event
/// recorded meanwhile, a new daemon, and what must hold after a start.
async fn restarted_after_the_outage(scene: &mut Scene) {
    scene.start_server();
    scene.record("after the outage").await;
    let mut daemon = scene.start();
    holds_after(scene, &mut daemon, 0, true).await;
    stops_in_time(&mut daemon);
}

/// SIGTERM during an outage while work waits out a 30 s server selection:
/// the server is known gone (every host failed its last heartbeat), so the
/// stop abandons that work within seconds — exit 1 by the table, saying
/// so — instead of waiting out the drain's deadline and the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_an_outage_while_work_waits_for_the_server() {
    let Some(mut scene) = Scene::new("life_m_term_outage_waiting", true).await else {
        return; // stops its own server
    };
    scene.patient = true;
    let (mut daemon, _) = running(&mut scene).await;
    scene.stop_server();
    // A scheduled run (every second) is now waiting for a server.
    let waiting = |log: &str| log.matches("MongoDB has not answered").count();
    wait_until("the readiness probe sees the outage", PATIENCE, || async {
        waiting(&daemon.log()) > 0 || daemon.ready_status().await == Some(503)
    })
    .await;
    let started = Instant::now();
    daemon.signal("TERM");
    let status = daemon.wait(stop_deadline());
    let took = started.elapsed();
    assert_eq!(status.code(), Some(1), "{}", daemon.log());
    assert!(
        took < Duration::from_secs(10),
        "stopped in {took:?}, not within seconds\n{}",
        daemon.log()
    );
    assert!(
        daemon
            .log()
            .contains("MongoDB is unreachable: work still waiting for it"),
        "{}",
        daemon.log()
    );
    restarted_after_the_outage(&mut scene).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage() {
    let Some(mut scene) = Scene::new("life_m_outage", true).await else {
        return; // stops its own server
    };
    let (mut daemon, mark) = running(&mut scene).await;
    scene.stop_server();
    let failed =
        |log: &str| log.matches("failed").count() + log.matches("has not answered").count();
    let before = failed(&daemon.log());
    wait_until("the daemon notices the outage", PATIENCE, || async {
        failed(&daemon.log()) > before
    })
    .await;
    // Long enough for scheduled runs and ledger passes to fail; an outage
    // of minutes on demand (TALLY_LIFE_OUTAGE_SECONDS=300).
    let until = Instant::now() + outage_length();
    while Instant::now() < until {
        assert!(daemon.running(), "{}", daemon.log());
        assert_eq!(
            daemon
                .metric("tally_malformed_documents{collection=\"views\"}")
                .await,
            Some(1.0),
            "an outage measured nothing: the malformed count stands"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    scene.start_server();
    holds_after(&mut scene, &mut daemon, mark, false).await;
    assert!(
        value(&scrape(&daemon).await, "tally_ready") == Some(1.0),
        "ready again"
    );
    stops_in_time(&mut daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance() {
    let mut scene = Scene::new("life_m_second", false).await.unwrap();
    scene.ha = true;
    let (mut daemon, mark) = running(&mut scene).await;
    let mut second = scene.start();
    second.wait_ready("standby", PATIENCE).await;
    assert_eq!(daemon.ready().await.as_deref(), Some("active"));
    holds_after(&mut scene, &mut daemon, mark, false).await;
    assert_eq!(second.ready().await.as_deref(), Some("standby"));
    let said = notifications(&second.log(), 0);
    assert!(said.is_empty(), "a standby notified: {said:?}");
    stops_in_time(&mut second);
    stops_in_time(&mut daemon);
}
