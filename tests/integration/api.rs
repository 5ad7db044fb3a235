//! tally over HTTP (`[api]`): the real `tallyd run` serving the events
//! ledger, driven by an HTTP client as any language's would.
//!
//! - `requests`: each route, each status, batches, reads, the outcome the
//!   command line prints, the OpenAPI document held against the routes;
//! - `refusals`: the access and bad-input matrix — status, problem body,
//!   nothing written;
//! - `exactly_once`: a retrying client through a proxy that drops, cuts and
//!   delays: every counter equals its distinct events;
//! - `life`: SIGTERM and SIGHUP under load, readiness, TLS;
//! - `limits`: header, idle and body timeouts, `max_requests`, and an
//!   unknown outcome settled by sending the request again;
//! - `clients`: the book's Python client, run against the daemon.

use std::net::SocketAddr;
use std::time::Duration;

use mongodb::bson::doc;
use serde_json::Value;
use tally::{BucketWidth, Buckets, CollectionConfig, Ledger};

use crate::common::TestContext;
use crate::common::tallyd::{Tallyd, free_address};
use crate::daemon::Conf;

mod clients;
mod exactly_once;
mod life;
mod limits;
mod refusals;
mod requests;

/// How long anything here waits for the daemon.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// The collections the API serves in these tests: `orders` (a ledger),
/// `calls` (a ledger counted by the minute), `page_views` (the book's),
/// `views` (no ledger).
pub(crate) const COLLECTIONS: &str = "[[collections]]\nname = \"orders\"\nledger = true\n\
     [[collections]]\nname = \"calls\"\nledger = true\nbucket = \"minute\"\n\
     [[collections]]\nname = \"page_views\"\nledger = true\n";

/// A daemon with `[api]` on, and a client for it.
pub(crate) struct ApiDaemon {
    pub(crate) daemon: Tallyd,
    pub(crate) api: SocketAddr,
    pub(crate) ctx: TestContext,
    pub(crate) client: reqwest::Client,
    /// `http` or `https`.
    pub(crate) scheme: &'static str,
}

/// A test's daemon: its `[api]` lines beyond `enabled` and `listen`, and
/// its environment.
#[derive(Default)]
pub(crate) struct Setup<'a> {
    pub(crate) api: &'a str,
    pub(crate) env: Vec<(&'a str, &'a str)>,
    pub(crate) options: Vec<&'a std::ffi::OsStr>,
    pub(crate) client: Option<reqwest::Client>,
    pub(crate) scheme: Option<&'static str>,
}

/// The configuration of a test's daemon, `[api]` on `api` with `lines`.
pub(crate) fn config(ctx: &TestContext, api: SocketAddr, lines: &str) -> String {
    let conf = Conf {
        extra: format!("{COLLECTIONS}[api]\nenabled = true\nlisten = \"{api}\"\n{lines}\n"),
        ..Conf::idle()
    };
    format!(
        "{}[alerts]\nstuck_after = \"10s\"\n",
        conf.render(&ctx.child_uri(false), &ctx.db_name)
    )
}

/// A request to record one event, begun on a connection of its own: its
/// headers and the body's first byte sent, the rest held back, so that it
/// stays in flight until [`Held::finish`].
pub(crate) struct Held {
    stream: tokio::net::TcpStream,
    event: &'static str,
}

/// The body's length a held request declares (its JSON, padded).
const HELD_LENGTH: usize = 64;

impl Held {
    /// Sends the rest of the body: the answer's first line and headers.
    pub(crate) async fn finish(mut self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rest = format!("\"event\":\"{}\",\"key\":\"home\"}}", self.event);
        let rest = format!("{rest:<width$}", width = HELD_LENGTH - 1);
        self.stream.write_all(rest.as_bytes()).await.unwrap();
        let mut answer = vec![0u8; 4096];
        let n = self.stream.read(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }
}

impl ApiDaemon {
    /// Begins a request recording `event` in `orders`, and waits until the
    /// daemon serves it (its body held back).
    pub(crate) async fn hold(&self, event: &'static str) -> Held {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(self.api).await.unwrap();
        let head = format!(
            "POST /v1/orders/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {HELD_LENGTH}\r\n\r\n{{"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        self.daemon
            .wait_metric("tally_api_requests_in_flight", 1.0, PATIENCE)
            .await;
        Held { stream, event }
    }

    /// Starts the daemon of `setup` on a fresh database `name`, with the
    /// ledgers' indexes, and waits until it is ready.
    pub(crate) async fn start(name: &str, setup: Setup<'_>) -> Self {
        let ctx = TestContext::new(name).await;
        let store = ctx.client(false).await.store();
        for spec in specs() {
            Ledger::new(&store, spec).create_indexes().await.unwrap();
        }
        let api = free_address();
        let text = config(&ctx, api, setup.api);
        let daemon =
            Tallyd::start_with(&text, &with_log(&setup.env), free_address(), &setup.options);
        daemon.wait_ready("active", PATIENCE).await;
        Self {
            daemon,
            api,
            ctx,
            client: setup.client.unwrap_or_default(),
            scheme: setup.scheme.unwrap_or("http"),
        }
    }

    /// The URL of `path` on the API.
    pub(crate) fn url(&self, path: &str) -> String {
        let host = if self.scheme == "https" {
            format!("localhost:{}", self.api.port())
        } else {
            self.api.to_string()
        };
        format!("{}://{host}{path}", self.scheme)
    }

    /// POSTs `body` (JSON) to `/v1/{collection}/events`: the status and
    /// the body read as JSON.
    pub(crate) async fn post(&self, collection: &str, body: &Value) -> (u16, Value) {
        let request = self
            .client
            .post(self.url(&format!("/v1/{collection}/events")))
            .json(body);
        send(request).await
    }

    /// GETs `path`: the status and the body read as JSON.
    pub(crate) async fn get(&self, path: &str) -> (u16, Value) {
        send(self.client.get(self.url(path))).await
    }

    /// How many events the collection's ledger holds.
    pub(crate) async fn events(&self, collection: &str) -> u64 {
        self.ctx
            .client(false)
            .await
            .collection(&format!("{collection}_events"))
            .count_documents(doc! {})
            .await
            .unwrap()
    }

    /// The exact value of `key` in `orders`, read by the library.
    pub(crate) async fn value(&self, key: &str) -> i64 {
        let store = self.ctx.client(false).await.store();
        let orders = Ledger::new(&store, CollectionConfig::new("orders"));
        orders.value(key).await.unwrap().value
    }
}

/// The test's collections as the library configures them.
pub(crate) fn specs() -> [CollectionConfig; 3] {
    let minutes = Buckets::utc(BucketWidth::Minute);
    [
        CollectionConfig::new("orders"),
        CollectionConfig::new("calls").with_buckets(minutes),
        CollectionConfig::new("page_views"),
    ]
}

/// `env`, with the daemon's log at info unless it sets one.
fn with_log<'a>(env: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = env.to_vec();
    if !env.iter().any(|(k, _)| *k == "RUST_LOG") {
        env.push(("RUST_LOG", "info"));
    }
    env
}

/// Sends `request`: the status and the body as JSON (`Null` when it is
/// not JSON).
pub(crate) async fn send(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request
        .timeout(PATIENCE)
        .send()
        .await
        .expect("the API answers");
    let status = response.status().as_u16();
    let text = response.text().await.expect("a body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `body` without the members of a problem document: what is left of an
/// outcome carried by one.
pub(crate) fn outcome_of(body: &Value) -> Value {
    let mut body = body.clone();
    if let Value::Object(members) = &mut body {
        for name in ["type", "title", "status", "detail"] {
            members.remove(name);
        }
    }
    body
}

/// The stored form of `token` with `scopes`: the value of its
/// `TALLYD_API_TOKEN_…` variable, as `tallyd api-token` prints it.
pub(crate) fn stored(token: &str, scopes: &str) -> String {
    use sha2::{Digest, Sha256};
    let hash: String = Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hash} {scopes}")
}

/// The unit's `TimeoutStopSec`, from `systemd/tallyd.service` itself: how
/// long systemd lets a stop take.
pub(crate) fn stop_deadline() -> Duration {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/tallyd.service");
    let unit = std::fs::read_to_string(path).expect("read the unit");
    let value = unit
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .expect("the unit sets TimeoutStopSec");
    humantime::parse_duration(value.trim()).expect("TimeoutStopSec is a duration")
}
