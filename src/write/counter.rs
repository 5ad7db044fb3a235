//! Resilient increments: a non-idempotent `$inc` split into two idempotent
//! steps with a pending token (the book: design/two-step.md).
//!
//! 1. **add the token**: `updateOne({_id: k}, {$addToSet: {pending: e}}, {upsert: true})`;
//! 2. **count the token**: conditioned on the entry being pending, one
//!    update adds its amount to the counter and removes every entry of the
//!    token — and the pending field with the last one ([`step`]).
//!
//! Step 1 is idempotent because `$addToSet` is; step 2 because it is
//! conditioned on the token, which it removes. Each is retried once on a
//! transient failure. The caller learns exactly what happened through
//! [`Increment`]: counted, [`PendingToken`] (settle with
//! [`Counters::complete`], or let the daemon fold it), [`UnknownToken`]
//! (settle with [`Counters::resume`] while it is younger than the retry
//! horizon) or not counted. Pending and unknown are different types so that
//! `resume` — which may re-send step 1 — can never be called on a token whose
//! step 2 may have applied.
//!
//! **Settling twice counts once.** `complete` and `resume` may run again —
//! a caller's retry, an operator re-running `tallyd resume`, two hosts
//! settling the same ticket — and once a settle counted a token, the
//! document no longer shows it as pending. So a settle's step 2 writes a
//! marker `{t: token, n: amount}` into the settled field in the same update
//! that counts the token, and applies only while there is none; `resume`
//! reads the marker first, and its re-sent step 1 applies only while there
//! is none. Why that is enough: a marker exists exactly when a settle
//! counted the token; the fold removes markers only after its `grace`,
//! which exceeds the retry horizon; and `resume` refuses to re-send step 1
//! past the horizon. So two resumes, a resume after a `complete` or a
//! `complete` after a resume, from any number of hosts, count once — and a
//! copy of the token re-added later (the original step 1, held up in the
//! network) is never counted by a settle (the fold drops it).
//!
//! **A step 1 held up in the network.** The increment's own step 2 leaves
//! the same marker when any step 1 attempt of the call may have applied
//! (its retry budget says so): exactly then a copy of step 1 may still be
//! on its way, and land after step 2 counted the token. The fold drops such
//! a copy instead of counting it again — as long as it lands before the
//! fold prunes the marker (`grace`). An increment whose step 1 went through
//! at the first attempt sends no copy, and writes no marker.
//!
//! The settings live in [`config`]: [`CollectionConfig`] (a counter
//! collection's field names, shared with the fold) and [`WriterConfig`]
//! (the retry horizon); the outcomes in [`outcome`].

mod config;
mod outcome;
mod settle;
mod step;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

pub use config::{CollectionConfig, Protocol, WriterConfig};
// The daemon's configuration reads its defaults from here.
#[cfg(feature = "daemon")]
pub(crate) use config::{
    DEFAULT_COUNTER_FIELD, DEFAULT_GROUP_MAX, DEFAULT_GROUP_WAIT, DEFAULT_LANE_RESUME_HORIZON,
    DEFAULT_LANE_TTL, DEFAULT_LANES_FIELD, DEFAULT_PENDING_FIELD, DEFAULT_QUEUE_LIMIT,
    DEFAULT_RETRY_HORIZON, DEFAULT_SETTLED_FIELD, MAX_GROUP_MAX, MAX_QUEUE_LIMIT,
    MIN_RETRY_HORIZON, least_retry_horizon,
};
pub use outcome::{Completion, Counted, Increment, NotCounted, PendingToken, UnknownToken};
// The fold adds to counters the way step 2 does, and reads markers alike.
// `tallyd resume` reads what the document says about a token.
#[cfg(feature = "daemon")]
pub(crate) use settle::Found;
pub(crate) use step::{exact_as_double, inc_operand, marker_path};

use super::lane::LaneWriter;
use crate::error::{
    Effect, Error, ErrorClass, Failure, Next, RetryBudget, duplicate_on_id, human_duration,
};
use crate::store::Store;
use crate::token::{Entry, Token};
use step::By;

/// How many duplicate-key failures an increment's step 1 retries: each is
/// an upsert race that applied nothing.
const UPSERT_RACE_RETRIES: u32 = 3;

/// Increments counters of one collection, with either protocol: the
/// two-step increment ([`Counters::increment`]) or a writer lane
/// ([`Counters::add`], the book: design/lanes.md). Clones share one lane and its queue:
/// make one handle per process (per collection) and clone it. A handle
/// belongs to one Tokio runtime, as the driver's `Client` does: the
/// updates of [`Counters::add`] are sent by tasks spawned on the runtime
/// of the call that found the counter idle, so a handle shared with a
/// runtime that is not running (a `block_on` kept for later) can leave
/// other callers waiting; make one handle per runtime.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tally::{CollectionConfig, Counters, Store, StoreConfig, WriterConfig};
///
/// let store = Store::connect(&StoreConfig::new("mongodb://localhost:27017", "app")).await?;
/// // One handle per collection and process; clone it into each task.
/// let views = Counters::new(&store, CollectionConfig::new("page_views"), WriterConfig::default());
/// let worker = views.clone();
/// tokio::spawn(async move {
///     let added = worker.add("home", 1).await;
///     println!("home +1: {}", added.name());
/// });
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Counters {
    pub(super) store: Store,
    pub(super) collection: Collection<Document>,
    pub(super) spec: Arc<CollectionConfig>,
    retry_horizon: Duration,
    /// The handle's lane and its group commit, or why the writer's lane
    /// settings were refused (every lane operation is then refused too).
    pub(super) lanes: Result<Arc<LaneWriter>, Error>,
}

/// Why an upsert sent with [`Counters::upsert_while`] did not apply.
pub(super) enum Stopped {
    /// Its guard refused before an attempt: nothing more was sent.
    Refused(Error),
    /// The retry rule gave up after the last attempt failed.
    GaveUp(Box<Failure>),
}

/// What step 1 established.
enum Added {
    /// Applied; `copy_may_land` when an earlier attempt of this call may
    /// have applied too — a copy of it may still be on its way to the
    /// server and re-add the token after step 2 counted it.
    Yes { copy_may_land: bool },
    /// Definitely not applied.
    No(Error),
    /// May or may not have applied.
    Unknown(Error),
    /// A settle's step 1 found the document changed under it (a duplicate
    /// key: a marker for the token, or a race creating the document);
    /// nothing applied. Read it again.
    Changed(Error),
}

impl Counters {
    /// Increments in `spec`'s collection, through `store`. A retry horizon
    /// shorter than two of the store's attempts, or than 2 s, is raised to
    /// that (with a warning). Lane settings
    /// that do not hold together (see [`Counters::try_new`]) are logged as
    /// an error, and every lane operation of the handle is then refused
    /// without writing; the two-step increment works regardless.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{CollectionConfig, Counters, WriterConfig};
    ///
    /// let spec = CollectionConfig::new("page_views");
    /// let views = Counters::new(&store, spec, WriterConfig::default());
    /// assert_eq!(views.spec().name, "page_views");
    /// # }
    /// ```
    pub fn new(store: &Store, spec: CollectionConfig, writer: WriterConfig) -> Self {
        let counters = Self::build(store, spec, writer);
        if let Err(refused) = &counters.lanes {
            tracing::error!(
                collection = %counters.spec.name,
                cause = %refused,
                "the lane settings are refused; every lane operation of this handle will be too"
            );
        }
        counters
    }

    /// Like [`Counters::new`], but refuses lane settings that do not hold
    /// together: `group_max`, `queue_limit` and `group_wait` within their
    /// bounds, and `lane_resume_horizon` plus the store's attempt bound
    /// shorter than `lane_ttl`
    /// ([`Error::InvalidArgument`], naming every setting at fault).
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use std::time::Duration;
    /// use tally::{CollectionConfig, Counters, Error, WriterConfig};
    ///
    /// // A lane TTL shorter than the resume horizon is refused.
    /// let writer = WriterConfig { lane_ttl: Duration::from_secs(60), ..WriterConfig::default() };
    /// match Counters::try_new(&store, CollectionConfig::new("page_views"), writer) {
    ///     Ok(_views) => {}
    ///     Err(Error::InvalidArgument(why)) => eprintln!("fix the writer settings: {why}"),
    ///     Err(other) => eprintln!("{other}"),
    /// }
    /// # }
    /// ```
    pub fn try_new(
        store: &Store,
        spec: CollectionConfig,
        writer: WriterConfig,
    ) -> Result<Self, Error> {
        let counters = Self::build(store, spec, writer);
        match &counters.lanes {
            Ok(_) => Ok(counters),
            Err(refused) => Err(refused.clone()),
        }
    }

    fn build(store: &Store, spec: CollectionConfig, writer: WriterConfig) -> Self {
        let least = config::least_retry_horizon(store.attempt_timeout());
        if writer.retry_horizon < least {
            tracing::warn!(
                collection = %spec.name,
                retry_horizon = %human_duration(writer.retry_horizon),
                attempt_timeout = %human_duration(store.attempt_timeout()),
                raised_to = %human_duration(least),
                "the retry horizon is below two attempts (or 2 s): a step 1 whose attempt \
                 timed out could be neither retried nor resumed; raised"
            );
        }
        Self {
            collection: store.collection(&spec.name),
            store: store.clone(),
            spec: Arc::new(spec),
            retry_horizon: writer.retry_horizon.max(least),
            lanes: super::lane::writer(&writer, store.attempt_timeout()),
        }
    }

    /// The collection and field names this handle writes.
    ///
    /// ```no_run
    /// # fn demo(views: tally::Counters) {
    /// println!("counting in {}.{}", views.spec().name, views.spec().counter_field);
    /// # }
    /// ```
    pub fn spec(&self) -> &CollectionConfig {
        &self.spec
    }

    /// The retry horizon in force (at least two attempts, and 2 s).
    ///
    /// ```no_run
    /// # fn demo(views: tally::Counters) {
    /// // An unknown increment can be resumed for this long after its call.
    /// let horizon = humantime::format_duration(views.retry_horizon());
    /// println!("resume unknown increments within {horizon}");
    /// # }
    /// ```
    pub fn retry_horizon(&self) -> Duration {
        self.retry_horizon
    }

    /// Adds `amount` (not zero) to the counter `key`, creating it if needed.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::{Completion, Increment};
    ///
    /// match views.increment("home", 1).await {
    ///     Increment::Counted(_) => {}
    ///     // Step 1 applied: counted exactly once, now or by the daemon.
    ///     Increment::Pending(pending) => {
    ///         if let Completion::Pending(still) = views.complete(pending).await {
    ///             eprintln!("{} stays pending; the daemon folds it", still.token());
    ///         }
    ///     }
    ///     // Settle it within the retry horizon.
    ///     Increment::Unknown(unknown) => {
    ///         if let Increment::Unknown(still) = views.resume(unknown).await? {
    ///             eprintln!("resume later: {}", views.ticket(&still));
    ///         }
    ///     }
    ///     Increment::NotCounted(not) => return Err(not.cause().clone()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn increment(&self, key: impl Into<Bson>, amount: i64) -> Increment {
        self.increment_timed(key.into(), amount, None).await
    }

    /// Adds `amount` (not zero) to the counter `key` of the bucket holding
    /// `at`, in a collection with [`CollectionConfig::buckets`]: the
    /// document `{_id: {k: key, t: <bucket start>}}` (which
    /// [`Increment`]'s outcomes name as their key). [`Counters::increment`]
    /// is this at now. Not counted, nothing sent
    /// ([`Increment::NotCounted`]): a time more than
    /// [`MAX_TIME_AHEAD`](crate::MAX_TIME_AHEAD) ahead of this host's clock
    /// ([`Error::TimeAhead`]), a time whose bucket ended more than
    /// `close_after` ago ([`Error::BucketClosed`]), and any time for a
    /// collection without buckets ([`Error::InvalidArgument`]: the time
    /// would be dropped, and counting by time needs the configuration's
    /// `bucket`).
    ///
    /// ```no_run
    /// # async fn demo(store: tally::Store) -> Result<(), Box<dyn std::error::Error>> {
    /// use tally::{BucketWidth, Buckets, CollectionConfig, Counters, Error, Increment, WriterConfig};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")?;
    /// let spec = CollectionConfig::new("page_views").with_buckets(days.clone());
    /// let views = Counters::new(&store, spec, WriterConfig::default());
    /// // A late event: counted in the day it happened, while that day is open.
    /// let at = days.parse_time("2026-11-27T23:59:00+01:00")?;
    /// match views.increment_at("home", 1, at).await {
    ///     Increment::NotCounted(not) if matches!(not.cause(), Error::BucketClosed { .. }) => {
    ///         eprintln!("too late: {}", not.cause())
    ///     }
    ///     outcome => println!("{}", outcome.name()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn increment_at(
        &self,
        key: impl Into<Bson>,
        amount: i64,
        at: SystemTime,
    ) -> Increment {
        self.increment_timed(key.into(), amount, Some(at)).await
    }

    /// The `_id` a write of `key` at `at` (`None`: now) goes to: the key,
    /// or its bucket's `{k, t}` ([`super::at`]).
    pub(super) fn counter_id(&self, key: Bson, at: Option<SystemTime>) -> Result<Bson, Error> {
        super::at::counter_id(&self.spec, key, at, SystemTime::now())
    }

    async fn increment_timed(&self, key: Bson, amount: i64, at: Option<SystemTime>) -> Increment {
        let checked = crate::document::check_key(&key)
            .and_then(|()| {
                Entry::new(Token::new(), amount)
                    .ok_or_else(|| Error::InvalidArgument("the amount must not be zero".into()))
            })
            .and_then(|entry| Ok((self.counter_id(key.clone(), at)?, entry)));
        let (key, entry) = match checked {
            Ok(checked) => checked,
            Err(cause) => {
                return Increment::NotCounted(NotCounted {
                    key,
                    token: None,
                    lane: None,
                    amount,
                    cause,
                });
            }
        };
        match self.add_token(&key, &entry, By::Increment).await {
            Added::Yes { copy_may_land } => {
                // A copy of step 1 still on its way would re-add the counted
                // token: step 2 then leaves the token's marker, as a settle
                // does, and the fold drops the copy instead of counting it.
                let by = if copy_may_land {
                    By::Settle
                } else {
                    By::Increment
                };
                match self.count_token(&key, &entry, by).await {
                    Ok(settled_earlier) => Increment::Counted(Counted {
                        key,
                        entry,
                        settled_earlier,
                    }),
                    Err(cause) => Increment::Pending(PendingToken {
                        key,
                        entry,
                        cause: Some(cause),
                    }),
                }
            }
            Added::No(cause) | Added::Changed(cause) => not_counted(key, entry, cause),
            Added::Unknown(cause) => Increment::Unknown(UnknownToken {
                key,
                entry,
                cause: Some(cause),
            }),
        }
    }

    /// The counter's current value (`None` when the document or the field
    /// does not exist). Pending entries are not included. In a bucketed
    /// collection `key` is a bucket's `_id` `{k, t}`; a plain key is
    /// refused ([`Error::InvalidArgument`]), as no document holds it.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use mongodb::bson::Bson;
    ///
    /// match views.value("home").await? {
    ///     Some(Bson::Int64(n)) => println!("home: {n}"),
    ///     Some(other) => println!("home holds {other}"),
    ///     None => println!("home was never counted"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn value(&self, key: impl Into<Bson>) -> Result<Option<Bson>, Error> {
        let key = key.into();
        crate::document::check_key(&key)?;
        super::at::check_read(&self.spec, &key)?;
        let counter_field = &self.spec.counter_field;
        let found = self
            .read_one(
                "counter.value",
                super::at::by_id("_id", &key),
                doc! { counter_field: 1 },
            )
            .await?;
        Ok(found.and_then(|d| d.get(counter_field).cloned()))
    }

    /// Step 1: `$addToSet` the entry, upserting the counter document (for a
    /// settle, only while the token has no marker).
    async fn add_token(&self, key: &Bson, entry: &Entry, by: By) -> Added {
        let (filter, update) = step::add(&self.spec, key, entry, by);
        // A settle reads the document again instead: a duplicate key may
        // mean a marker it must not write past.
        let duplicate_retries = match by {
            By::Increment => UPSERT_RACE_RETRIES,
            By::Settle => 0,
        };
        let mut budget = RetryBudget::retry_once("increment.add_token")
            .with_duplicate_key_retries(duplicate_retries);
        // Never (re)send step 1 for a token the daemon may fold: a retry
        // that lands after the fold would count twice.
        let allowed = || {
            let age = entry.token().age(SystemTime::now());
            if age < self.retry_horizon {
                return Ok(());
            }
            Err(Error::RetryHorizonExceeded {
                token: entry.token().to_string(),
                age,
                horizon: self.retry_horizon,
            })
        };
        match self
            .upsert_while(&mut budget, &filter, &update, allowed)
            .await
        {
            Ok(()) => Added::Yes {
                copy_may_land: budget.maybe_applied(),
            },
            Err(Stopped::Refused(cause)) if budget.maybe_applied() => Added::Unknown(cause),
            Err(Stopped::Refused(cause)) => Added::No(cause),
            Err(Stopped::GaveUp(failure)) => {
                // Definite only when no attempt may have applied: an earlier
                // attempt whose reply was lost may hold the token already
                // (the counter moved up since, under another writer).
                if !budget.maybe_applied()
                    && let Some(refused) = self.overflow_refusal(key, entry, &failure).await
                {
                    return Added::No(refused);
                }
                self.step_1_failed(&budget, failure, by)
            }
        }
    }

    /// Sends `update` as an upsert of the document `filter` matches, under
    /// `budget`'s retry rule, asking `allowed` before every attempt whether
    /// it may still be sent.
    pub(super) async fn upsert_while(
        &self,
        budget: &mut RetryBudget,
        filter: &Document,
        update: &Document,
        allowed: impl Fn() -> Result<(), Error>,
    ) -> Result<(), Stopped> {
        budget.reaching(self.store.reach());
        loop {
            allowed().map_err(Stopped::Refused)?;
            budget.start_attempt();
            let result = self
                .store
                .attempt(
                    self.collection
                        .update_one(filter.clone(), update.clone())
                        .upsert(true),
                )
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(err) => match self.store.after_failure(budget, err) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => return Err(Stopped::GaveUp(failure)),
                },
            }
        }
    }

    /// When step 1 collided on `_id` because the counter cannot take the
    /// amount (its filter refuses a counter the amount would take past the
    /// int64 limit): the refusal to report. Nothing applied — a collision
    /// writes nothing, and the filter refused every attempt alike. `None`
    /// for any other failure, or when the document reads otherwise.
    async fn overflow_refusal(
        &self,
        key: &Bson,
        entry: &Entry,
        failure: &Failure,
    ) -> Option<Error> {
        let on_id = duplicate_on_id(&failure.source) != Some(false);
        if failure.class != ErrorClass::DuplicateKey || !on_id {
            return None;
        }
        let value = self.value(key.clone()).await.ok().flatten()?;
        crate::document::int64_overflow(&value, entry.amount()).then(|| Error::Overflow {
            collection: self.spec.name.clone(),
            key: key.to_string(),
            value: value.to_string(),
            amount: entry.amount(),
        })
    }

    /// What a step 1 that gave up established.
    fn step_1_failed(&self, budget: &RetryBudget, failure: Box<Failure>, by: By) -> Added {
        let on_id = duplicate_on_id(&failure.source) != Some(false);
        if by == By::Settle && failure.class == ErrorClass::DuplicateKey && on_id {
            return Added::Changed(Error::Server(failure));
        }
        // A write-concern error applied on the primary even when it is not
        // worth a retry.
        if budget.maybe_applied() || failure.effect != Effect::NotApplied {
            Added::Unknown(Error::Server(failure))
        } else {
            Added::No(Error::Server(failure))
        }
    }

    /// Step 2 ([`step::count`]). Returns whether the token was already
    /// gone (counted earlier) or, for a settle, already marked.
    async fn count_token(&self, key: &Bson, entry: &Entry, by: By) -> Result<bool, Error> {
        let (filter, pipeline) = step::count(&self.spec, key, entry, by);
        let result = self
            .store
            .update_one(&self.collection, filter, pipeline, "increment.count_token")
            .await?;
        Ok(result.matched_count == 0)
    }

    async fn read_one(
        &self,
        operation: &'static str,
        filter: Document,
        projection: Document,
    ) -> Result<Option<Document>, Error> {
        self.store
            .find_one(&self.collection, filter, projection, operation)
            .await
    }
}

fn not_counted(key: Bson, entry: Entry, cause: Error) -> Increment {
    Increment::NotCounted(NotCounted {
        key,
        token: Some(entry.token()),
        lane: None,
        amount: entry.amount(),
        cause,
    })
}
