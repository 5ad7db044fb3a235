//! Shared test support: one server per test process (or the external one),
//! a database per test, clients whose commands are recorded, fail points
//! that undo themselves.

pub mod proxy;
// The alert engine's unit tests include this file too (with `#[path]`),
// and use parts of it the integration tests do not.
#[allow(dead_code)]
pub mod receiver;
pub mod server;
pub mod shown;
pub mod tallyd;

use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use mongodb::bson::{Bson, Document, doc};
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection};
use tally::{CollectionRun, FoldTarget, Mode, Reconciler, Store};
use tokio_util::sync::CancellationToken;

use server::{EXTERNAL_URI_VAR, ServerOptions, TestServer};

static SHARED_SERVER: OnceLock<TestServer> = OnceLock::new();

/// The URI of the server every test uses: `TALLY_TEST_MONGODB_URI` when set,
/// else a SecantusDB started once for this test process.
pub fn base_uri() -> String {
    match std::env::var(EXTERNAL_URI_VAR) {
        Ok(uri) if !uri.is_empty() => uri,
        _ => SHARED_SERVER
            .get_or_init(|| TestServer::start(&ServerOptions::default()))
            .uri(),
    }
}

/// Whether the tests run against an external server.
pub fn external() -> bool {
    std::env::var(EXTERNAL_URI_VAR).is_ok_and(|u| !u.is_empty())
}

/// `uri` with extra query options appended.
pub fn with_options(uri: &str, options: &str) -> String {
    if options.is_empty() {
        uri.to_owned()
    } else if uri.contains('?') {
        format!("{uri}&{options}")
    } else if uri.ends_with('/') {
        format!("{uri}?{options}")
    } else {
        format!("{uri}/?{options}")
    }
}

/// One test's corner of the server: its own database and application name
/// (fail points are scoped to the application name).
pub struct TestContext {
    pub db_name: String,
    pub app_name: String,
    pub uri: String,
}

impl TestContext {
    /// A fresh database for the test `name` (dropped first if a previous run
    /// left it behind).
    pub async fn new(name: &str) -> Self {
        Self::on(name, base_uri()).await
    }

    /// The same, on a given server.
    pub async fn on(name: &str, uri: String) -> Self {
        let short: String = name
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let db_name = format!("t_{}", &short[..short.len().min(50)]);
        let ctx = Self {
            app_name: format!("tally-test-{short}"),
            db_name,
            uri,
        };
        let admin = ctx.client(false).await;
        admin
            .client
            .database(&ctx.db_name)
            .drop()
            .await
            .expect("drop the test database");
        ctx
    }

    /// A client for this test, recording the commands it sends.
    pub async fn client(&self, retry_writes: bool) -> TestClient {
        let options = ClientOptions::parse(&self.uri)
            .await
            .expect("parse test URI");
        self.client_with(options, retry_writes)
    }

    /// A client for this test built from the test URI with `uri_options`
    /// appended (e.g. `w=1`), recording the commands it sends.
    pub async fn client_with_uri_options(
        &self,
        uri_options: &str,
        retry_writes: bool,
    ) -> TestClient {
        let options = ClientOptions::parse(with_options(&self.uri, uri_options))
            .await
            .expect("parse test URI with options");
        self.client_with(options, retry_writes)
    }

    /// A store on the test server under another application name, so this
    /// test's fail points (scoped to its own) do not touch it: a rival
    /// writer.
    pub async fn rival_store(&self) -> Store {
        let mut options = ClientOptions::parse(&self.uri)
            .await
            .expect("parse test URI");
        options.app_name = Some(format!("{}-rival", self.app_name));
        options.retry_writes = Some(false);
        let client = Client::with_options(options.clone()).expect("build client");
        Store::from_parts(client, &options, &self.db_name)
    }

    /// Holds this test's next `insert` on the server for 3 s before it
    /// executes (until the guard is dropped), and returns once the insert
    /// `start` began was sent: its caller may have given up on it (a short
    /// attempt bound) by the time it applies.
    pub async fn hold_next_insert<T>(
        &self,
        sent: &CommandLog,
        start: impl FnOnce() -> T,
    ) -> (FailPoint, T) {
        let fail = FailPoint::set(
            self,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["insert"], "blockConnection": true, "blockTimeMS": 3000 },
        )
        .await;
        let before = sent.count("insert");
        let started = start();
        wait_until("the held insert was sent", Duration::from_secs(10), || {
            let sent = sent.clone();
            async move { sent.count("insert") > before }
        })
        .await;
        (fail, started)
    }

    /// A client for this test that reaches the server through `proxy`
    /// (with the test URI's credentials: the proxy's URI has none).
    pub async fn client_through(&self, proxy: &proxy::Proxy, retry_writes: bool) -> TestClient {
        self.client_through_with(proxy, retry_writes, "").await
    }

    /// The same, with `uri_options` appended to the proxy's URI (e.g.
    /// `serverSelectionTimeoutMS=2000`, so an attempt bound can be short:
    /// it must exceed server selection).
    pub async fn client_through_with(
        &self,
        proxy: &proxy::Proxy,
        retry_writes: bool,
        uri_options: &str,
    ) -> TestClient {
        let mut options = ClientOptions::parse(with_options(&proxy.uri(), uri_options))
            .await
            .expect("parse the proxy's URI");
        options.credential = ClientOptions::parse(&self.uri)
            .await
            .expect("parse test URI")
            .credential;
        self.client_with(options, retry_writes)
    }

    /// The URI a child process should use to reach the server through
    /// `proxy`: the proxy's address with the test URI's credentials.
    pub fn child_uri_through(&self, proxy: &proxy::Proxy, retry_writes: bool) -> String {
        let after_scheme = self.uri.split_once("://").map_or("", |(_, rest)| rest);
        let authority = after_scheme.split('/').next().unwrap_or("");
        let user_info = authority
            .rsplit_once('@')
            .map(|(info, _)| format!("{info}@"))
            .unwrap_or_default();
        let auth_options: Vec<&str> = self
            .uri
            .split_once('?')
            .map(|(_, query)| query.split('&').filter(|o| o.starts_with("auth")).collect())
            .unwrap_or_default();
        let mut uri = format!(
            "mongodb://{user_info}{}/?directConnection=true",
            proxy.address()
        );
        for option in auth_options {
            uri = with_options(&uri, option);
        }
        with_options(
            &uri,
            &format!("appName={}&retryWrites={retry_writes}", self.app_name),
        )
    }

    fn client_with(&self, mut options: ClientOptions, retry_writes: bool) -> TestClient {
        options.app_name = Some(self.app_name.clone());
        options.retry_writes = Some(retry_writes);
        if options.server_selection_timeout.is_none() {
            options.server_selection_timeout = Some(Duration::from_secs(10));
        }
        // Recover quickly after a fault marks the server unknown.
        options.heartbeat_freq = Some(Duration::from_millis(500));
        let events = CommandLog::default();
        options.command_event_handler = Some(events.handler());
        let client = Client::with_options(options.clone()).expect("build client");
        TestClient {
            client,
            options,
            events,
            db_name: self.db_name.clone(),
        }
    }

    /// The URI a child process (`tallyd`) should use.
    pub fn child_uri(&self, retry_writes: bool) -> String {
        with_options(
            &self.uri,
            &format!("appName={}&retryWrites={retry_writes}", self.app_name),
        )
    }

    /// A config file for this test: `[mongodb]` plus `extra`, and the
    /// collection `views` unless `extra` configures collections (every
    /// command needs one).
    pub fn config_toml(&self, retry_writes: bool, extra: &str) -> String {
        let views = if extra.contains("[[collections]]") {
            ""
        } else {
            "[[collections]]\nname = \"views\"\n"
        };
        format!(
            "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"10s\"\n{extra}\n{views}",
            self.child_uri(retry_writes),
            self.db_name
        )
    }
}

/// A client plus the log of the commands it sent.
pub struct TestClient {
    pub client: Client,
    pub options: ClientOptions,
    pub events: CommandLog,
    db_name: String,
}

impl TestClient {
    pub fn store(&self) -> Store {
        Store::from_parts(self.client.clone(), &self.options, &self.db_name)
    }

    pub fn collection(&self, name: &str) -> Collection<Document> {
        self.client.database(&self.db_name).collection(name)
    }
}

/// A command the client started.
#[derive(Debug, Clone)]
pub struct Sent {
    pub name: String,
    /// For `update`: the update operators (or `pipeline`) of the first
    /// statement, e.g. `["$addToSet", "$setOnInsert"]`.
    pub update_ops: Vec<String>,
    /// For `update`: how many statements its `updates` carry.
    pub statements: usize,
    /// The command's `writeConcern`, as sent.
    pub write_concern: Option<Document>,
    /// The mode of the command's `$readPreference`, as sent.
    pub read_preference: Option<String>,
}

/// Every command a client started, in order.
#[derive(Clone, Default)]
pub struct CommandLog(Arc<Mutex<Vec<Sent>>>);

impl CommandLog {
    fn handler(&self) -> EventHandler<CommandEvent> {
        let log = self.0.clone();
        EventHandler::callback(move |event| {
            if let CommandEvent::Started(started) = event {
                let update_ops = started
                    .command
                    .get_array("updates")
                    .ok()
                    .and_then(|u| u.first())
                    .and_then(Bson::as_document)
                    .map(|stmt| match stmt.get("u") {
                        Some(Bson::Document(u)) => u.keys().cloned().collect(),
                        Some(Bson::Array(_)) => vec!["pipeline".to_string()],
                        _ => Vec::new(),
                    })
                    .unwrap_or_default();
                let statements = started
                    .command
                    .get_array("updates")
                    .map_or(0, |updates| updates.len());
                log.lock().unwrap().push(Sent {
                    name: started.command_name.clone(),
                    update_ops,
                    statements,
                    write_concern: started.command.get_document("writeConcern").ok().cloned(),
                    read_preference: started
                        .command
                        .get_document("$readPreference")
                        .ok()
                        .and_then(|p| p.get_str("mode").ok())
                        .map(str::to_owned),
                });
            }
        })
    }

    /// How many commands named `name` were started.
    pub fn count(&self, name: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == name)
            .count()
    }

    /// How many `update` commands used the operator `op`.
    pub fn updates_with(&self, op: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == "update" && s.update_ops.iter().any(|o| o == op))
            .count()
    }

    /// Every command started so far, in order.
    pub fn sent(&self) -> Vec<Sent> {
        self.0.lock().unwrap().clone()
    }

    /// Forgets everything recorded so far.
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

/// The server keeps one `failCommand` fail point at a time, so tests that
/// set one take turns.
static FAIL_POINT_TURN: LazyLock<Arc<tokio::sync::Mutex<()>>> =
    LazyLock::new(|| Arc::new(tokio::sync::Mutex::new(())));

/// A `failCommand` fail point scoped to one test's application name,
/// switched off when dropped (also when the test panics).
pub struct FailPoint {
    uri: String,
    _turn: tokio::sync::OwnedMutexGuard<()>,
}

impl FailPoint {
    /// Sets `failCommand` with `mode` (`{times: n}`, `{skip: s, times: n}`,
    /// `"alwaysOn"`) and `data` (`failCommands`, `errorCode`,
    /// `closeConnection`, ...), scoped to `ctx`'s clients.
    pub async fn set(ctx: &TestContext, mode: Bson, mut data: Document) -> Self {
        let turn = FAIL_POINT_TURN.clone().lock_owned().await;
        data.insert("appName", ctx.app_name.clone());
        let admin = Client::with_uri_str(&ctx.uri).await.expect("admin client");
        admin
            .database("admin")
            .run_command(doc! { "configureFailPoint": "failCommand", "mode": mode, "data": data })
            .await
            .expect("configureFailPoint (a real mongod needs --setParameter enableTestCommands=1)");
        Self {
            uri: ctx.uri.clone(),
            _turn: turn,
        }
    }
}

impl FailPoint {
    /// The next `command` of `ctx`'s clients applies, then reports a
    /// write-concern error with `code` (named `code_name`) and no labels.
    pub async fn write_concern_error(
        ctx: &TestContext,
        command: &str,
        code: i32,
        code_name: &str,
    ) -> Self {
        Self::set(
            ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! {
                "failCommands": [command],
                "writeConcernError": { "code": code, "codeName": code_name, "errmsg": "injected" },
            },
        )
        .await
    }
}

impl FailPoint {
    /// The next `times` updates of `ctx`'s clients lose their connection
    /// before the server sees them.
    pub async fn updates_cut(ctx: &TestContext, times: i32) -> Self {
        let data = doc! { "failCommands": ["update"], "closeConnection": true };
        Self::set(ctx, Bson::Document(doc! { "times": times }), data).await
    }

    /// The next update of `ctx`'s clients is refused with BadValue (2), a
    /// command error: nothing applied.
    pub async fn update_refused(ctx: &TestContext) -> Self {
        let data = doc! { "failCommands": ["update"], "errorCode": 2 };
        Self::set(ctx, Bson::Document(doc! { "times": 1 }), data).await
    }
}

impl Drop for FailPoint {
    fn drop(&mut self) {
        let uri = self.uri.clone();
        // Drop cannot await: switch it off from a thread with its own runtime.
        let result = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let admin = Client::with_uri_str(&uri).await?;
                admin
                    .database("admin")
                    .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
                    .await
                    .map(|_| ())
            })
        })
        .join();
        if !std::thread::panicking() {
            result
                .expect("fail point thread")
                .expect("switch the fail point off");
        }
    }
}

/// One reconcile run of `target` at the server's current time.
pub async fn run_reconcile(store: &Store, target: &FoldTarget, mode: Mode) -> CollectionRun {
    run_with(&Reconciler::new(store), target, mode).await
}

/// One run of `reconciler` at the server's time.
pub async fn run_with(reconciler: &Reconciler, target: &FoldTarget, mode: Mode) -> CollectionRun {
    let now = reconciler.server_time().await.expect("server time");
    reconciler
        .reconcile(target, mode, now, &CancellationToken::new(), &mut |_| {})
        .await
}

/// Polls `condition` until it holds or `timeout` passes; panics with
/// `what` on timeout.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if !poll_until(timeout, condition).await {
        panic!("timed out after {timeout:?} waiting for {what}");
    }
}

/// Polls `condition` until it holds (`true`) or `timeout` passes
/// (`false`): for a wait whose condition a defect may keep from ever
/// holding, so that the test's own assertions say what is wrong.
pub async fn poll_until<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of `field` in the document `_id`, or `None`.
pub async fn field(coll: &Collection<Document>, id: impl Into<Bson>, field: &str) -> Option<Bson> {
    coll.find_one(doc! { "_id": id.into() })
        .await
        .expect("find_one")
        .and_then(|d| d.get(field).cloned())
}

/// The counter `field` as an integer (`0` when absent).
pub async fn counter(coll: &Collection<Document>, id: impl Into<Bson>) -> i64 {
    match field(coll, id, "counter").await {
        None => 0,
        Some(Bson::Int32(n)) => n.into(),
        Some(Bson::Int64(n)) => n,
        Some(other) => panic!("counter is not an integer: {other:?}"),
    }
}

/// How many entries the `pending` array holds (`0` when absent).
pub async fn pending_len(coll: &Collection<Document>, id: impl Into<Bson>) -> usize {
    match field(coll, id, "pending").await {
        None => 0,
        Some(Bson::Array(a)) => a.len(),
        Some(other) => panic!("pending is not an array: {other:?}"),
    }
}

/// Creates a unique index on `field`.
pub async fn create_unique_index(coll: &Collection<Document>, field: &str) {
    let index = mongodb::IndexModel::builder()
        .keys(doc! { field: 1 })
        .options(
            mongodb::options::IndexOptions::builder()
                .unique(true)
                .build(),
        )
        .build();
    coll.create_index(index).await.expect("create unique index");
}
