//! A SecantusDB server run by the tests themselves, or an external server
//! named by `TALLY_TEST_MONGODB_URI`.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The environment variable that points every test at an external server
/// (for example a real MongoDB replica set) instead of a local SecantusDB.
pub const EXTERNAL_URI_VAR: &str = "TALLY_TEST_MONGODB_URI";

/// How a test server is started.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// Port to listen on; 0 picks a free one.
    pub port: u16,
    /// Data directory to keep across restarts; default: a temporary one.
    pub storage_path: Option<PathBuf>,
    /// Close client connections idle this long.
    pub idle_timeout: Option<Duration>,
    /// Keep at most this many oplog entries.
    pub oplog_max_entries: Option<u64>,
    /// Drop oplog entries older than this (as writes come).
    pub oplog_retention: Option<Duration>,
    /// Require authentication.
    pub auth: bool,
    /// Advertise a standalone server (no replica set, no retryable writes).
    pub standalone: bool,
}

/// A running SecantusDB process. Stopped on drop; if the test process dies
/// instead, the server sees its standard input close and stops itself.
pub struct TestServer {
    child: Child,
    stdin: Option<ChildStdin>,
    port: u16,
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    if !python.exists() {
        panic!(
            "the test server is not installed: run `scripts/install-test-server` \
             (or point the tests at a server with {EXTERNAL_URI_VAR}=mongodb://...)"
        );
    }
    python
}

impl TestServer {
    /// Starts a server and waits until it listens.
    pub fn start(options: &ServerOptions) -> Self {
        let mut cmd = Command::new(python());
        cmd.arg(repo_root().join("scripts/test-server.py"))
            .arg("--watch-stdin")
            .arg("--port")
            .arg(options.port.to_string());
        if let Some(path) = &options.storage_path {
            cmd.arg("--storage-path").arg(path);
        }
        if let Some(idle) = options.idle_timeout {
            cmd.arg("--idle-timeout")
                .arg(idle.as_secs_f64().to_string());
        }
        if let Some(n) = options.oplog_max_entries {
            cmd.arg("--oplog-max-entries").arg(n.to_string());
        }
        if let Some(retention) = options.oplog_retention {
            cmd.arg("--oplog-retention-seconds")
                .arg(retention.as_secs_f64().to_string());
        }
        if options.auth {
            cmd.arg("--auth");
        }
        if options.standalone {
            cmd.arg("--standalone");
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start scripts/test-server.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the test server did not start within 60 s"));
        let port = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected test server output: {line:?}"));
        let stdin = child.stdin.take();
        Self { child, stdin, port }
    }

    /// A URI for this server (a one-node replica set, connected directly).
    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/?directConnection=true", self.port)
    }

    /// Stops the server and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.flush();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A server with authentication on its own port and data directory: the
/// users and roles `provision` created (as the only client, before
/// authentication was switched on) are there when it starts.
pub struct AuthServer {
    _server: TestServer,
    port: u16,
    _data: tempfile::TempDir,
}

impl AuthServer {
    pub async fn start<F, Fut>(provision: F) -> Self
    where
        F: FnOnce(mongodb::Client) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let data = tempfile::tempdir().expect("a data directory");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut options = ServerOptions {
            port,
            storage_path: Some(data.path().to_owned()),
            ..Default::default()
        };
        let mut server = TestServer::start(&options);
        let client = mongodb::Client::with_uri_str(server.uri())
            .await
            .expect("a client for provisioning");
        provision(client).await;
        server.stop();
        options.auth = true;
        Self {
            _server: TestServer::start(&options),
            port,
            _data: data,
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URI for `user` (authenticated against `auth_source`).
    pub fn uri(&self, user: &str, password: &str, auth_source: &str) -> String {
        format!(
            "mongodb://{user}:{password}@127.0.0.1:{}/?directConnection=true&authSource={auth_source}",
            self.port
        )
    }
}

/// Creates `role` in `db` as the README's smallest role for the daemon has
/// it without a ledger, with `counter_actions` on the counter collection
/// `views`: find, update and changeStream there; find on its events
/// collection and batch intents (the prune reads them); find, insert,
/// update and remove on the state collection `tally_state`.
pub async fn create_tallyd_role(db: &mongodb::Database, role: &str, counter_actions: &[&str]) {
    let grants = [
        ("views", counter_actions),
        ("views_events", &["find"][..]),
        ("views_events_batches", &["find"][..]),
    ];
    create_role(db, role, &grants).await;
}

/// Creates `role` in `db` with `actions` on each collection named, and
/// the daemon's state collection's find, insert, update and remove.
pub async fn create_role(db: &mongodb::Database, role: &str, grants: &[(&str, &[&str])]) {
    let mut grants = grants.to_vec();
    grants.push(("tally_state", &["find", "insert", "update", "remove"]));
    create_role_on(db, role, &grants).await;
}

/// Creates `role` in `db` with `actions` on each collection named, and
/// nothing else.
async fn create_role_on(db: &mongodb::Database, role: &str, grants: &[(&str, &[&str])]) {
    let name = db.name().to_owned();
    let privileges: Vec<mongodb::bson::Document> = grants
        .iter()
        .map(|(collection, actions)| {
            mongodb::bson::doc! { "resource": { "db": &name, "collection": *collection }, "actions": *actions }
        })
        .collect();
    db.run_command(
        mongodb::bson::doc! { "createRole": role, "privileges": privileges, "roles": [] },
    )
    .await
    .expect("createRole");
}

/// Creates `user` (password `password`) in `db` holding one role of the
/// same name: `actions` on the collection `views`, nothing else. (The test
/// server grants an action on every collection of a database once a role
/// holds it on one, so a user meant to lack an action gets no other
/// grant carrying it.)
pub async fn create_views_user(
    db: &mongodb::Database,
    user: &str,
    password: &str,
    actions: &[&str],
) {
    create_role_on(db, user, &[("views", actions)]).await;
    db.run_command(mongodb::bson::doc! { "createUser": user, "pwd": password, "roles": [user] })
        .await
        .expect("createUser");
}
