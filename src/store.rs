//! The connected handle every operation works through.
//!
//! A [`Store`] is a cheap-to-clone handle holding the driver's `Client`, the
//! database tally works in, and one fact the retry rule needs: whether the
//! driver itself retries writes (retryable writes on, and a deployment that
//! supports them). That fact is learned from one `hello`, lazily, so a
//! `Store` can be built while the server is still down.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use mongodb::bson::{Document, doc};
use mongodb::options::ClientOptions;
use mongodb::results::UpdateResult;
use mongodb::{Client, Collection, Database};
use tokio::sync::OnceCell;

use crate::config::MongoConfig;
use mongodb::error::Error as MongoError;

use crate::error::{Error, Failure, Next, RetryBudget};
use crate::redact::Secrets;

/// Default bound on one attempt of an operation.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// A connected handle: client, database and what the deployment supports.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    database: Database,
    retry_writes_requested: bool,
    load_balanced: bool,
    attempt_timeout: Duration,
    driver_retries_writes: OnceCell<bool>,
}

impl Store {
    /// Builds a client from the `[mongodb]` config. No I/O happens here
    /// unless the URI is `mongodb+srv://` (which resolves DNS records).
    pub async fn connect(config: &MongoConfig) -> Result<Self, ConnectError> {
        let mut options = ClientOptions::parse(config.uri.expose())
            .await
            .map_err(|err| ConnectError(config.secrets().scrub(&err.to_string())))?;
        config.apply_to(&mut options);
        let client = Client::with_options(options.clone())
            .map_err(|err| ConnectError(config.secrets().scrub(&err.to_string())))?;
        Ok(Self::from_parts(client, &options, &config.database)
            .with_attempt_timeout(config.attempt_timeout))
    }

    /// Wraps an existing client. `options` are the ones the client was built
    /// with: they say whether retryable writes were requested.
    pub fn from_parts(client: Client, options: &ClientOptions, database: &str) -> Self {
        let database = client.database(database);
        Self {
            inner: Arc::new(Inner {
                client,
                database,
                retry_writes_requested: options.retry_writes != Some(false),
                load_balanced: options.load_balanced == Some(true),
                attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
                driver_retries_writes: OnceCell::new(),
            }),
        }
    }

    /// The same handle with another bound on each attempt (default 30s).
    pub fn with_attempt_timeout(self, timeout: Duration) -> Self {
        let inner = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Inner {
            client: shared.client.clone(),
            database: shared.database.clone(),
            retry_writes_requested: shared.retry_writes_requested,
            load_balanced: shared.load_balanced,
            attempt_timeout: shared.attempt_timeout,
            driver_retries_writes: OnceCell::new(),
        });
        Self {
            inner: Arc::new(Inner {
                attempt_timeout: timeout,
                ..inner
            }),
        }
    }

    /// How long one attempt may take before it counts as a lost reply.
    pub fn attempt_timeout(&self) -> Duration {
        self.inner.attempt_timeout
    }

    /// Runs one attempt, bounded by the attempt timeout. An attempt that
    /// runs out of time is abandoned — the driver closes its connection —
    /// and reported as an I/O timeout: transient, and it may have applied.
    pub async fn attempt<T>(
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
    pub async fn with_retry<T, F, Fut>(
        &self,
        budget: &mut RetryBudget,
        mut operation: F,
    ) -> Result<T, Box<Failure>>
    where
        F: FnMut() -> Fut,
        Fut: IntoFuture<Output = Result<T, MongoError>>,
    {
        loop {
            budget.start_attempt();
            match self.attempt(operation()).await {
                Ok(value) => return Ok(value),
                Err(err) => match budget.after_failure(err) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => return Err(failure),
                },
            }
        }
    }

    /// The driver client.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The database tally works in.
    pub fn database(&self) -> &Database {
        &self.inner.database
    }

    /// A collection of the working database.
    pub fn collection(&self, name: &str) -> Collection<Document> {
        self.inner.database.collection(name)
    }

    /// Whether the driver retries single-document writes itself: retryable
    /// writes requested and a deployment that supports them (a replica set,
    /// a sharded cluster or a load balancer; never a standalone server).
    /// Learned from one `hello` the first time it is needed.
    pub async fn driver_retries_writes(&self) -> Result<bool, Error> {
        if !self.inner.retry_writes_requested {
            return Ok(false);
        }
        if self.inner.load_balanced {
            return Ok(true);
        }
        self.inner
            .driver_retries_writes
            .get_or_try_init(|| async {
                let hello = self.hello().await?;
                let sessions = hello.contains_key("logicalSessionTimeoutMinutes");
                let replicated = hello.contains_key("setName")
                    || hello.get_str("msg").is_ok_and(|m| m == "isdbgrid");
                Ok(sessions && replicated)
            })
            .await
            .copied()
    }

    /// One idempotent `updateOne`, retried once on a transient failure
    /// (leaving the retry to the driver when it makes it).
    pub async fn update_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        update: Document,
        operation: &'static str,
    ) -> Result<UpdateResult, Error> {
        let driver_retries = self.driver_retries_writes().await?;
        let mut budget = RetryBudget::retry_once(operation, driver_retries);
        self.with_retry(&mut budget, || {
            collection.update_one(filter.clone(), update.clone())
        })
        .await
        .map_err(Error::Server)
    }

    /// One `findOne` with a projection, retried once on a transient failure.
    pub async fn find_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        projection: Document,
        operation: &'static str,
    ) -> Result<Option<Document>, Error> {
        let mut budget = RetryBudget::retry_once(operation, false);
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
    pub async fn server_time(&self) -> Result<std::time::SystemTime, Error> {
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
    pub async fn hello(&self) -> Result<Document, Error> {
        let admin = self.inner.client.database("admin");
        let mut budget = RetryBudget::retry_once("hello", false);
        self.with_retry(&mut budget, || admin.run_command(doc! { "hello": 1 }))
            .await
            .map_err(Error::Server)
    }
}

/// The URI could not be turned into a client. The message has every secret
/// removed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot create a MongoDB client: {0}")]
pub struct ConnectError(String);

impl ConnectError {
    /// Builds the error from a message that may contain secrets.
    pub fn scrubbed(message: &str, secrets: &Secrets) -> Self {
        Self(secrets.scrub(message))
    }
}
