//! The connected handle every operation works through.
//!
//! A [`Store`] is a cheap-to-clone handle holding the driver's `Client` and
//! the database tally works in. No I/O happens until the first operation, so
//! a `Store` can be built while the server is still down.
//!
//! Some settings are tally's own, whatever the connection string says:
//!
//! - **tally owns its retries**: the driver's retry of writes is off on the
//!   client tally uses (`retryWrites=true` in a URI, the driver's default,
//!   is overridden). Every tally write is idempotent by construction and
//!   tally retries a transient failure once itself, so it knows how often
//!   each write was sent: a refusal of a write sent once is a definite "not
//!   applied" (`NotCounted`), never "unknown". With the driver retrying, a
//!   refusal could be the answer to its retry while the first attempt was
//!   still on its way, and tally could not tell.
//! - **write concern `majority`** for every write (the database handle
//!   carries it, so every collection and command made from it does): with
//!   `w: 1`, a step 1 that a failover rolls back could still be "counted" by
//!   step 2, and a sequence number rolled back could be handed out twice. A
//!   URI asking for another `w` is overridden, with a warning.
//! - **reads from the primary** (the database handle carries that too): a
//!   lagging secondary could miss a settle marker a `resume` must see, or
//!   say a bounded counter has no unit left while a token holds one. A URI
//!   asking for another read preference is overridden, with a warning.
//! - **an attempt bound longer than server selection**: a server that cannot
//!   be selected must surface as the command error it is (nothing was sent:
//!   not counted), not as an attempt that ran out of time (a lost reply:
//!   unknown). The bound is raised to the selection timeout plus a margin
//!   when it is set shorter, with a warning.
//!
//! [`StoreConfig`] says how to reach the server; the daemon's `[mongodb]`
//! section is read into one.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use mongodb::bson::{Document, doc};
use mongodb::error::{Error as MongoError, ErrorKind};
use mongodb::options::{
    Acknowledgment, ClientOptions, DatabaseOptions, ReadPreference, SelectionCriteria,
    UpdateModifications, WriteConcern,
};
use mongodb::results::UpdateResult;
use mongodb::{Client, Collection, Database};

use crate::error::{Error, Failure, Next, Reach, Readable, RetryBudget};

mod config;
mod reach;
mod session;
use crate::redact::Secrets;
use reach::Heartbeats;

use config::DEFAULT_SERVER_SELECTION_TIMEOUT;
pub use config::StoreConfig;
#[cfg(feature = "daemon")]
pub(crate) use config::shown_duration;
pub(crate) use config::{serialize_duration, serialize_optional_duration};

/// Default bound on one attempt of an operation: longer than the default
/// server selection timeout, so an outage is told apart from a lost reply.
pub(crate) const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(60);
/// How much longer than server selection an attempt is allowed at least:
/// the time between the driver giving up on selection and the error
/// reaching tally.
pub(crate) const SELECTION_MARGIN: Duration = Duration::from_secs(1);
/// How long [`Store::shutdown`] waits for the driver's clean-up before it
/// closes everything at once.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

/// How long [`Store::shutdown`] waits when no host answered its last
/// heartbeat: the clean-up would only wait for a server that is gone.
const SHUTDOWN_WAIT_UNREACHABLE: Duration = Duration::from_secs(1);
/// A connected handle: client, database and what the deployment supports.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tally::{SequenceConfig, Sequences, Store, StoreConfig};
///
/// let store = Store::connect(&StoreConfig::new("mongodb://localhost:27017", "app")).await?;
/// // Every protocol works through a clone of the one store.
/// let ids = Sequences::new(&store, &SequenceConfig::default());
/// println!("{}", ids.next("invoice").await?);
/// store.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    database: Database,
    server_selection_timeout: Duration,
    attempt_timeout: Duration,
    /// The connection's password, to scrub from the server's messages.
    secrets: Secrets,
    /// Where the client connects and as whom, for failures' messages.
    reach: Arc<Reach>,
    /// Why each host the driver cannot reach failed its last heartbeat.
    heartbeats: Heartbeats,
}

impl Store {
    /// Builds a client from `config`. No I/O happens here unless the URI is
    /// `mongodb+srv://` (which resolves DNS records).
    ///
    /// ```no_run
    /// # async fn demo() {
    /// use tally::{Store, StoreConfig};
    ///
    /// match Store::connect(&StoreConfig::new("mongodb://localhost:27017", "app")).await {
    ///     Ok(store) => store.shutdown().await,
    ///     // The URI is unusable; its password is not in the message.
    ///     Err(err) => eprintln!("{err}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(config: &StoreConfig) -> Result<Self, ConnectError> {
        let mut options = ClientOptions::parse(config.uri.expose())
            .await
            .map_err(|err| ConnectError::from_driver(&err, &config.secrets()))?;
        config.apply_to(&mut options);
        options.retry_writes = Some(false);
        let heartbeats = Heartbeats::default();
        heartbeats.record_from(&mut options);
        let client = Client::with_options(options.clone())
            .map_err(|err| ConnectError::from_driver(&err, &config.secrets()))?;
        Ok(
            Self::with_heartbeats(client, &options, &config.database, heartbeats)
                .with_attempt_timeout(config.attempt_timeout),
        )
    }

    /// Wraps an existing client. `options` are the ones the client was built
    /// with: they say how long server selection waits. Whatever write
    /// concern they ask for, tally's own writes use `majority` (a warning
    /// says so when they asked for another `w`); whatever read preference,
    /// its reads go to the primary (likewise).
    ///
    /// tally owns its retries: when `options` leave the driver's retryable
    /// writes on (the driver's default), tally builds its own client from
    /// `options` with them off (a second connection pool, sharing nothing
    /// with `client`) and uses that one. Build `client` with
    /// `retry_writes: Some(false)` to share one pool.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), mongodb::error::Error> {
    /// use mongodb::Client;
    /// use mongodb::options::ClientOptions;
    /// use tally::Store;
    ///
    /// // The application's own client, shared: retryable writes off, one pool.
    /// let mut options = ClientOptions::parse("mongodb://localhost:27017").await?;
    /// options.retry_writes = Some(false);
    /// let client = Client::with_options(options.clone())?;
    /// let store = Store::from_parts(client.clone(), &options, "app");
    /// # Ok(()) }
    /// ```
    pub fn from_parts(client: Client, options: &ClientOptions, database: &str) -> Self {
        let heartbeats = Heartbeats::default();
        let client = if options.retry_writes == Some(false) {
            client
        } else {
            let mut own = options.clone();
            own.retry_writes = Some(false);
            heartbeats.record_from(&mut own);
            // Building a client does no I/O; it fails only for options the
            // driver refuses, which `client` was built from already.
            Client::with_options(own).unwrap_or(client)
        };
        Self::with_heartbeats(client, options, database, heartbeats)
    }

    /// A store on `client`, built from `options`, whose monitoring events
    /// `heartbeats` records (if the client was built with its recorder).
    fn with_heartbeats(
        client: Client,
        options: &ClientOptions,
        database: &str,
        heartbeats: Heartbeats,
    ) -> Self {
        let database = client.database_with_options(
            database,
            DatabaseOptions::builder()
                .write_concern(majority_over(options.write_concern.as_ref()))
                .selection_criteria(primary_over(options.selection_criteria.as_ref()))
                .build(),
        );
        let server_selection_timeout = options
            .server_selection_timeout
            .unwrap_or(DEFAULT_SERVER_SELECTION_TIMEOUT);
        let attempt_timeout = attempt_bound(DEFAULT_ATTEMPT_TIMEOUT, server_selection_timeout);
        let reach = reach::of(options, server_selection_timeout, attempt_timeout);
        Self {
            inner: Arc::new(Inner {
                client,
                database,
                server_selection_timeout,
                attempt_timeout,
                reach: Arc::new(reach),
                heartbeats,
                secrets: Secrets::new(
                    "",
                    options
                        .credential
                        .as_ref()
                        .and_then(|c| c.password.as_deref()),
                ),
            }),
        }
    }

    /// The same handle with another bound on each attempt (default 60s).
    /// A bound not longer than server selection is raised to the selection
    /// timeout plus 1s, with a warning: an attempt must never run out of
    /// time before the driver says no server could be selected.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tally::ConnectError> {
    /// use std::time::Duration;
    /// use tally::{Store, StoreConfig};
    ///
    /// let store = Store::connect(&StoreConfig::new("mongodb://localhost", "app"))
    ///     .await?
    ///     .with_attempt_timeout(Duration::from_secs(45));
    /// assert_eq!(store.attempt_timeout(), Duration::from_secs(45));
    /// # Ok(()) }
    /// ```
    pub fn with_attempt_timeout(self, timeout: Duration) -> Self {
        let inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Inner {
            client: shared.client.clone(),
            database: shared.database.clone(),
            server_selection_timeout: shared.server_selection_timeout,
            attempt_timeout: shared.attempt_timeout,
            secrets: shared.secrets.clone(),
            reach: shared.reach.clone(),
            heartbeats: shared.heartbeats.clone(),
        });
        let bound = attempt_bound(timeout, inner.server_selection_timeout);
        if bound != timeout {
            tracing::warn!(
                attempt_timeout = %humantime::format_duration(timeout),
                server_selection_timeout = %humantime::format_duration(inner.server_selection_timeout),
                raised_to = %humantime::format_duration(bound),
                "the attempt timeout must exceed server selection, or an outage would look like a \
                 lost reply; raised"
            );
        }
        let reach = Reach {
            attempt_timeout: bound,
            ..Reach::clone(&inner.reach)
        };
        Self {
            inner: Arc::new(Inner {
                attempt_timeout: bound,
                reach: Arc::new(reach),
                ..inner
            }),
        }
    }

    /// How long one attempt may take before it counts as a lost reply.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// // A reply later than this is a lost reply: the operation's outcome is unknown.
    /// println!("attempts are bounded by {}", humantime::format_duration(store.attempt_timeout()));
    /// # }
    /// ```
    pub fn attempt_timeout(&self) -> Duration {
        self.inner.attempt_timeout
    }

    /// Shuts the client down in order: waits (up to 10 s; 1 s when every
    /// host failed its last heartbeat, the server gone) for the driver's
    /// clean-up of server-side resources, ends the server sessions and
    /// closes the connections. Call it before the runtime stops — at the end
    /// of a command-line program — or the driver's clean-up may race the
    /// runtime's shutdown. Clones of this handle, and everything made from
    /// it, fail afterwards.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tally::{Store, StoreConfig};
    ///
    /// let store = Store::connect(&StoreConfig::new("mongodb://localhost", "app")).await?;
    /// // ... the program's work ...
    /// store.shutdown().await;
    /// # Ok(()) }
    /// ```
    pub async fn shutdown(self) {
        let client = self.inner.client.clone();
        let wait = if self.seems_reachable() {
            SHUTDOWN_WAIT
        } else {
            SHUTDOWN_WAIT_UNREACHABLE
        };
        drop(self);
        if tokio::time::timeout(wait, client.clone().shutdown())
            .await
            .is_err()
        {
            tracing::warn!("the MongoDB client did not shut down in time; closing it now");
            client.shutdown().immediate(true).await;
        }
    }

    /// Runs one attempt, bounded by the attempt timeout. An attempt that
    /// runs out of time is abandoned — the driver closes its connection —
    /// and reported as an I/O timeout: transient, and it may have applied.
    pub(crate) async fn attempt<T>(
        &self,
        operation: impl IntoFuture<Output = Result<T, MongoError>>,
    ) -> Result<T, MongoError> {
        match tokio::time::timeout(self.inner.attempt_timeout, operation.into_future()).await {
            Ok(result) => result,
            Err(_elapsed) => Err(MongoError::from(std::io::ErrorKind::TimedOut)),
        }
    }

    /// Runs `operation` under `budget`'s retry rule, each attempt bounded by
    /// the attempt timeout.
    pub(crate) async fn with_retry<T, F, Fut>(
        &self,
        budget: &mut RetryBudget,
        mut operation: F,
    ) -> Result<T, Box<Failure>>
    where
        F: FnMut() -> Fut,
        Fut: IntoFuture<Output = Result<T, MongoError>>,
    {
        budget.reaching(self.inner.reach.clone());
        loop {
            budget.start_attempt();
            match self.attempt(operation()).await {
                Ok(value) => return Ok(value),
                Err(err) => match self.after_failure(budget, err) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => return Err(failure),
                },
            }
        }
    }

    /// `message` (from the server) without the connection's password.
    pub(crate) fn scrub(&self, message: &str) -> String {
        self.inner.secrets.scrub(message)
    }

    /// The driver client.
    ///
    /// ```no_run
    /// # async fn demo(store: tally::Store) -> Result<(), mongodb::error::Error> {
    /// let names = store.client().list_database_names().await?;
    /// println!("databases: {}", names.join(", "));
    /// # Ok(()) }
    /// ```
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The database tally works in.
    ///
    /// ```no_run
    /// # async fn demo(store: tally::Store) -> Result<(), mongodb::error::Error> {
    /// use mongodb::bson::doc;
    ///
    /// store.database().run_command(doc! { "ping": 1 }).await?;
    /// # Ok(()) }
    /// ```
    pub fn database(&self) -> &Database {
        &self.inner.database
    }

    /// A collection of the working database.
    ///
    /// ```no_run
    /// # async fn demo(store: tally::Store) -> Result<(), mongodb::error::Error> {
    /// use mongodb::bson::doc;
    ///
    /// // The counters are plain documents: read them as any other.
    /// let top = store.collection("page_views").find_one(doc! { "_id": "home" }).await?;
    /// # Ok(()) }
    /// ```
    pub fn collection(&self, name: &str) -> Collection<Document> {
        self.inner.database.collection(name)
    }

    /// One idempotent `updateOne` (operators or a pipeline), retried once on
    /// a transient failure.
    pub(crate) async fn update_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        update: impl Into<UpdateModifications> + Clone,
        operation: &'static str,
    ) -> Result<UpdateResult, Error> {
        let mut budget = RetryBudget::retry_once(operation);
        self.with_retry(&mut budget, || {
            collection.update_one(filter.clone(), update.clone())
        })
        .await
        .map_err(Error::Server)
    }

    /// One `findOne` with a projection, retried once on a transient failure
    /// (by the read rule: a lost cursor or a majority snapshot not ready yet
    /// is transient too).
    pub(crate) async fn find_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        projection: Document,
        operation: &'static str,
    ) -> Result<Option<Document>, Error> {
        let mut budget = RetryBudget::read_once(operation);
        self.with_retry(&mut budget, || {
            collection
                .find_one(filter.clone())
                .projection(projection.clone())
        })
        .await
        .map_err(Error::Server)
    }

    /// The server's clock, from `hello`'s `localTime`: cutoffs and lease
    /// expiries computed from it agree between daemons on different hosts.
    pub(crate) async fn server_time(&self) -> Result<std::time::SystemTime, Error> {
        let hello = self.hello().await?;
        match hello.get("localTime") {
            Some(mongodb::bson::Bson::DateTime(t)) => Ok(t.to_system_time()),
            _ => Err(Error::InvalidArgument(
                "the server's hello reply has no localTime".into(),
            )),
        }
    }

    /// Runs `hello` against the admin database, retrying once on a transient
    /// failure.
    pub(crate) async fn hello(&self) -> Result<Document, Error> {
        let admin = self.inner.client.database("admin");
        let mut budget = RetryBudget::read_once("hello");
        self.with_retry(&mut budget, || admin.run_command(doc! { "hello": 1 }))
            .await
            .map_err(Error::Server)
    }
}

/// The bound on one attempt: `configured`, raised to `server_selection`
/// plus [`SELECTION_MARGIN`] when shorter.
fn attempt_bound(configured: Duration, server_selection: Duration) -> Duration {
    configured.max(server_selection + SELECTION_MARGIN)
}

/// Write concern `majority`, keeping the `wtimeout` and `j` that `asked`
/// (the client's write concern) sets. A warning names the `w` that `asked`
/// gave up — never the URI it came from.
fn majority_over(asked: Option<&WriteConcern>) -> WriteConcern {
    if let Some(w) = asked.and_then(|c| c.w.as_ref())
        && *w != Acknowledgment::Majority
    {
        let shown = match w {
            Acknowledgment::Nodes(n) => n.to_string(),
            Acknowledgment::Custom(tag) => format!("{tag:?}"),
            other => format!("{other:?}"),
        };
        tracing::warn!(
            w = %shown,
            "the connection asks for write concern w: {shown}; tally uses w: \"majority\" for its \
             own writes (with w: {shown}, a write a failover rolls back could be counted)"
        );
    }
    WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .w_timeout(asked.and_then(|c| c.w_timeout))
        .journal(asked.and_then(|c| c.journal))
        .build()
}

/// Reads from the primary, whatever `asked` (the client's selection
/// criteria) says; a warning names a read preference given up.
fn primary_over(asked: Option<&SelectionCriteria>) -> SelectionCriteria {
    let primary = |c: &SelectionCriteria| {
        matches!(
            c,
            SelectionCriteria::ReadPreference(ReadPreference::Primary)
        )
    };
    if let Some(asked) = asked.filter(|c| !primary(c)) {
        let shown = match asked {
            SelectionCriteria::ReadPreference(preference) => preference.to_string(),
            _ => "a custom server selection".to_owned(),
        };
        tracing::warn!(
            read_preference = %shown,
            "the connection asks for read preference {shown}; tally reads from the primary (a \
             lagging secondary could miss a settle marker or a held unit)"
        );
    }
    SelectionCriteria::ReadPreference(ReadPreference::Primary)
}

/// The URI could not be turned into a client. The message has every secret
/// removed.
///
/// ```no_run
/// # async fn demo() {
/// use tally::{Store, StoreConfig};
///
/// let config = StoreConfig::new("mongodb://user:secret@/app?badOption", "app");
/// if let Err(err) = Store::connect(&config).await {
///     assert!(!err.to_string().contains("secret"));
///     eprintln!("error: {err}");
/// }
/// # }
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("the connection string cannot be used: {0}")]
pub struct ConnectError(String);

impl ConnectError {
    /// The driver's refusal of the URI or its options, secrets removed.
    fn from_driver(err: &MongoError, secrets: &Secrets) -> Self {
        let reason = match err.kind.as_ref() {
            ErrorKind::InvalidArgument { message, .. } => message.clone(),
            _ => Readable { err, reach: None }.to_string(),
        };
        Self(secrets.scrub(&reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_attempt_bound_exceeds_server_selection() {
        let config = StoreConfig::new("mongodb://127.0.0.1:9/", "d");
        assert!(
            config.attempt_timeout >= config.server_selection_timeout + SELECTION_MARGIN,
            "{config:?}"
        );
    }

    #[test]
    fn writes_use_majority_keeping_the_uris_timeout_and_journal() {
        assert_eq!(majority_over(None), WriteConcern::majority());
        let asked = WriteConcern::builder()
            .w(Acknowledgment::Nodes(1))
            .w_timeout(Duration::from_secs(5))
            .journal(true)
            .build();
        let used = majority_over(Some(&asked));
        assert_eq!(used.w, Some(Acknowledgment::Majority));
        assert_eq!(used.w_timeout, Some(Duration::from_secs(5)));
        assert_eq!(used.journal, Some(true));
    }

    #[test]
    fn an_attempt_bound_not_longer_than_server_selection_is_raised() {
        let secs = Duration::from_secs;
        assert_eq!(attempt_bound(secs(2), secs(5)), secs(6));
        assert_eq!(attempt_bound(secs(5), secs(5)), secs(6));
        assert_eq!(attempt_bound(secs(6), secs(5)), secs(6));
        assert_eq!(attempt_bound(secs(9), secs(5)), secs(9));
    }
}
