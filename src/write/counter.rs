//! Resilient increments: a non-idempotent `$inc` split into two idempotent
//! steps with a pending token (DESIGN §3).
//!
//! 1. **add the token**: `updateOne({_id: k}, {$addToSet: {pending: e}}, {upsert: true})`;
//! 2. **count the token**: `updateOne({_id: k, pending: e}, {$pull: {pending: e}, $inc: {counter: n}})`.
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
//! The settings live here too: [`CollectionConfig`] (a counter collection's
//! field names, shared with the fold) and [`WriterConfig`] (the retry
//! horizon).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use serde::Serialize;

use crate::error::{Effect, Error, Next, RetryBudget};
use crate::store::{Store, serialize_duration, serialize_optional_duration};
use crate::token::{Entry, Token};

/// Default name of the field holding a counter's value.
pub(crate) const DEFAULT_COUNTER_FIELD: &str = "counter";
/// Default name of the field holding a counter's pending entries.
pub(crate) const DEFAULT_PENDING_FIELD: &str = "pending";
/// Default name of the field holding the markers of tokens a settle counted.
pub(crate) const DEFAULT_SETTLED_FIELD: &str = "settled";

/// A counter collection and its field names (in the daemon's configuration,
/// one `[[collections]]` entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CollectionConfig {
    /// The collection's name.
    pub name: String,
    /// The field holding the counter's value. Default: `counter`.
    pub counter_field: String,
    /// The field holding the pending entries. Default: `pending`.
    pub pending_field: String,
    /// The field holding a marker `{t, n}` for every token a settle
    /// (`complete`, `resume`) counted, until the fold prunes it after the
    /// grace. Default: `settled`.
    pub settled_field: String,
    /// This collection's fold grace, overriding `[reconcile] grace`.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_optional_duration"
    )]
    pub grace: Option<Duration>,
    /// This collection's fold batch size, overriding `[reconcile]
    /// batch_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u32>,
}

impl CollectionConfig {
    /// A collection with the default field names.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            counter_field: DEFAULT_COUNTER_FIELD.into(),
            pending_field: DEFAULT_PENDING_FIELD.into(),
            settled_field: DEFAULT_SETTLED_FIELD.into(),
            grace: None,
            batch_size: None,
        }
    }

    /// The same collection with other field names.
    pub fn with_fields(mut self, counter: impl Into<String>, pending: impl Into<String>) -> Self {
        self.counter_field = counter.into();
        self.pending_field = pending.into();
        self
    }
}

/// How the library's increments behave (the daemon's `[writer]` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WriterConfig {
    /// Step 1 of an increment is never (re)sent for a token older than this,
    /// so a token can never be re-added after the daemon may have folded it.
    /// Must stay below the daemon's `grace`. Default: 60s.
    #[serde(serialize_with = "serialize_duration")]
    pub retry_horizon: Duration,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            retry_horizon: DEFAULT_RETRY_HORIZON,
        }
    }
}

/// Default retry horizon.
pub(crate) const DEFAULT_RETRY_HORIZON: Duration = Duration::from_secs(60);
/// The shortest retry horizon: a token's timestamp has one-second
/// resolution, so a fresh token may already look a second old. Checked by
/// the daemon's configuration.
#[cfg(feature = "daemon")]
pub(crate) const MIN_RETRY_HORIZON: Duration = Duration::from_secs(2);

/// How many duplicate-key failures step 1 retries: each is an upsert race
/// that applied nothing.
const UPSERT_RACE_RETRIES: u32 = 3;

/// The accessors shared by the two token types, which must stay distinct.
macro_rules! token_accessors {
    ($ty:ident, $cause_doc:literal) => {
        impl $ty {
            /// The counter's `_id`.
            pub fn key(&self) -> &Bson {
                &self.key
            }
            /// The token.
            pub fn token(&self) -> Token {
                self.entry.token()
            }
            /// The amount the token adds when counted.
            pub fn amount(&self) -> i64 {
                self.entry.amount()
            }
            #[doc = $cause_doc]
            pub fn cause(&self) -> Option<&Error> {
                self.cause.as_ref()
            }
        }
    };
}

/// Increments counters of one collection.
#[derive(Clone, Debug)]
pub struct Counters {
    store: Store,
    collection: Collection<Document>,
    spec: Arc<CollectionConfig>,
    retry_horizon: Duration,
}

/// The result of an increment: exactly one of four outcomes.
#[must_use = "an increment may be pending or unknown and need settling"]
#[derive(Debug, Clone)]
pub enum Increment {
    /// Step 2 applied, or the token had already been folded.
    Counted(Counted),
    /// Step 1 applied; step 2 was not confirmed. Settle with
    /// [`Counters::complete`] (safe at any age), or leave it to the daemon.
    /// Counted exactly once either way.
    Pending(PendingToken),
    /// Step 1 may or may not have applied; step 2 was never sent. Settle with
    /// [`Counters::resume`] while the token is younger than the retry
    /// horizon; after that, the increment is counted at most once.
    Unknown(UnknownToken),
    /// Definitely not applied: nothing was written.
    NotCounted(NotCounted),
}

impl Increment {
    /// The outcome's name as the CLI prints it: `counted`, `pending`,
    /// `unknown` or `not_counted`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Counted(_) => "counted",
            Self::Pending(_) => "pending",
            Self::Unknown(_) => "unknown",
            Self::NotCounted(_) => "not_counted",
        }
    }

    /// The token of this attempt (absent only when the amount was refused
    /// before a token was made).
    pub fn token(&self) -> Option<Token> {
        match self {
            Self::Counted(c) => Some(c.entry.token()),
            Self::Pending(p) => Some(p.entry.token()),
            Self::Unknown(u) => Some(u.entry.token()),
            Self::NotCounted(n) => n.token,
        }
    }

    /// The error that kept this increment from being counted, if any.
    pub fn cause(&self) -> Option<&Error> {
        match self {
            Self::Counted(_) => None,
            Self::Pending(p) => p.cause.as_ref(),
            Self::Unknown(u) => u.cause.as_ref(),
            Self::NotCounted(n) => Some(&n.cause),
        }
    }
}

/// An increment that is counted.
#[derive(Debug, Clone)]
pub struct Counted {
    key: Bson,
    entry: Entry,
    settled_earlier: bool,
}

impl Counted {
    /// The counter's `_id`.
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// The token of the attempt.
    pub fn token(&self) -> Token {
        self.entry.token()
    }
    /// The amount added.
    pub fn amount(&self) -> i64 {
        self.entry.amount()
    }
    /// True when the token was already gone when step 2 ran: an earlier
    /// attempt whose reply was lost, `complete`, or the daemon counted it.
    pub fn settled_earlier(&self) -> bool {
        self.settled_earlier
    }
}

/// A token that is in the counter's `pending` array: step 2 only is needed.
/// Only the library makes these (from an increment, or after reading the
/// token in the document), so it always names a token whose step 1 applied.
#[derive(Debug, Clone)]
pub struct PendingToken {
    key: Bson,
    entry: Entry,
    cause: Option<Error>,
}

token_accessors!(
    PendingToken,
    "Why step 2 was not confirmed (none when the token was found by [`Counters::find_pending`])."
);

/// A token whose step 1 may or may not have applied, and whose step 2 was
/// never sent.
#[derive(Debug, Clone)]
pub struct UnknownToken {
    key: Bson,
    entry: Entry,
    cause: Option<Error>,
}

impl UnknownToken {
    /// Rebuilds an unknown token from its parts — for a token an increment
    /// reported as *unknown* in another process (the CLI's `resume`). Never
    /// use it for a token reported *pending*: if its step 2 applied unseen,
    /// resuming would re-add it and count it twice.
    pub fn new(key: impl Into<Bson>, token: Token, amount: i64) -> Result<Self, Error> {
        let entry = Entry::new(token, amount)
            .ok_or_else(|| Error::InvalidArgument("the amount must not be zero".into()))?;
        Ok(Self {
            key: key.into(),
            entry,
            cause: None,
        })
    }
}

token_accessors!(
    UnknownToken,
    "Why step 1 was not confirmed (none when rebuilt with [`UnknownToken::new`])."
);

/// An increment that was definitely not applied.
#[derive(Debug, Clone)]
pub struct NotCounted {
    key: Bson,
    token: Option<Token>,
    cause: Error,
}

impl NotCounted {
    /// The counter's `_id`.
    pub fn key(&self) -> &Bson {
        &self.key
    }
    /// Why nothing was written.
    pub fn cause(&self) -> &Error {
        &self.cause
    }
}

/// The result of [`Counters::complete`].
#[must_use]
#[derive(Debug, Clone)]
pub enum Completion {
    /// Counted (by this call, or earlier).
    Counted(Counted),
    /// Step 2 is still not confirmed; try again later or leave it to the
    /// daemon.
    Pending(PendingToken),
}

/// What step 1 established.
enum Added {
    Yes,
    /// Definitely not applied.
    No(Error),
    /// May or may not have applied.
    Unknown(Error),
}

impl Counters {
    /// Increments in `spec`'s collection, through `store`.
    pub fn new(store: &Store, spec: CollectionConfig, writer: WriterConfig) -> Self {
        Self {
            collection: store.collection(&spec.name),
            store: store.clone(),
            spec: Arc::new(spec),
            retry_horizon: writer.retry_horizon,
        }
    }

    /// The collection and field names this handle writes.
    pub fn spec(&self) -> &CollectionConfig {
        &self.spec
    }

    /// Adds `amount` (not zero) to the counter `key`, creating it if needed.
    pub async fn increment(&self, key: impl Into<Bson>, amount: i64) -> Increment {
        let key = key.into();
        let Some(entry) = Entry::new(Token::new(), amount) else {
            return Increment::NotCounted(NotCounted {
                key,
                token: None,
                cause: Error::InvalidArgument("the amount must not be zero".into()),
            });
        };
        self.add_then_count(key, entry).await
    }

    /// Runs step 2 only for a pending token: safe at any age, and counts it
    /// exactly once however often it is called.
    pub async fn complete(&self, pending: &PendingToken) -> Completion {
        match self.count_token(&pending.key, &pending.entry).await {
            Ok(settled_earlier) => Completion::Counted(Counted {
                key: pending.key.clone(),
                entry: pending.entry,
                settled_earlier,
            }),
            Err(cause) => Completion::Pending(PendingToken {
                cause: Some(cause),
                ..pending.clone()
            }),
        }
    }

    /// Settles an unknown token. If the token is in the document, runs step 2
    /// only. If it is absent — so the lost attempt provably did not apply,
    /// as the daemon never folds a token this young — sends step 1 and step
    /// 2 again, but only while the token is younger than the retry horizon;
    /// past it, refuses with [`Error::RetryHorizonExceeded`] without writing.
    pub async fn resume(&self, unknown: &UnknownToken) -> Result<Increment, Error> {
        // Look the token up in either entry form: what is in the document is
        // what step 1 wrote, and its amount is the one to count.
        if let Some(pending) = self
            .find_pending(unknown.key.clone(), unknown.token())
            .await?
        {
            if pending.amount() != unknown.amount() {
                tracing::warn!(
                    token = %unknown.token(),
                    stored = pending.amount(),
                    given = unknown.amount(),
                    "resume: the document holds the token with another amount; counting the stored one"
                );
            }
            return Ok(self.count_after_add(pending.key, pending.entry).await);
        }
        let age = unknown.entry.token().age(SystemTime::now());
        if age >= self.retry_horizon {
            return Err(Error::RetryHorizonExceeded {
                token: unknown.entry.token().to_string(),
                age,
                horizon: self.retry_horizon,
            });
        }
        Ok(self
            .add_then_count(unknown.key.clone(), unknown.entry)
            .await)
    }

    /// Looks `token` up in the counter `key`'s pending entries, in either
    /// entry form (so tokens written by other clients can be completed).
    pub async fn find_pending(
        &self,
        key: impl Into<Bson>,
        token: Token,
    ) -> Result<Option<PendingToken>, Error> {
        let key = key.into();
        let pending_field = &self.spec.pending_field;
        let filter = doc! {
            "_id": &key,
            "$or": [
                { pending_field: token.object_id() },
                { format!("{pending_field}.t"): token.object_id() },
            ],
        };
        let Some(found) = self
            .read_one("complete.find_token", filter, doc! { pending_field: 1 })
            .await?
        else {
            return Ok(None);
        };
        let entries = match found.get(pending_field) {
            Some(Bson::Array(entries)) => entries,
            _ => return Ok(None),
        };
        for value in entries {
            match Entry::parse(value) {
                Ok(entry) if entry.token() == token => {
                    return Ok(Some(PendingToken {
                        key,
                        entry,
                        cause: None,
                    }));
                }
                Ok(_) => {}
                Err(bad) => {
                    let holds_token = match value {
                        Bson::Document(d) => d.get("t") == Some(&Bson::ObjectId(token.object_id())),
                        _ => false,
                    };
                    if holds_token {
                        return Err(Error::Malformed {
                            collection: self.spec.name.clone(),
                            id: key.to_string(),
                            reason: format!("the entry for token {token}: {bad}"),
                        });
                    }
                }
            }
        }
        Ok(None)
    }

    /// The counter's current value (`None` when the document or the field
    /// does not exist). Pending entries are not included.
    pub async fn value(&self, key: impl Into<Bson>) -> Result<Option<Bson>, Error> {
        let counter_field = &self.spec.counter_field;
        let found = self
            .read_one(
                "counter.value",
                doc! { "_id": key.into() },
                doc! { counter_field: 1 },
            )
            .await?;
        Ok(found.and_then(|d| d.get(counter_field).cloned()))
    }

    async fn add_then_count(&self, key: Bson, entry: Entry) -> Increment {
        match self.add_token(&key, &entry).await {
            Added::Yes => self.count_after_add(key, entry).await,
            Added::No(cause) => Increment::NotCounted(NotCounted {
                key,
                token: Some(entry.token()),
                cause,
            }),
            Added::Unknown(cause) => Increment::Unknown(UnknownToken {
                key,
                entry,
                cause: Some(cause),
            }),
        }
    }

    async fn count_after_add(&self, key: Bson, entry: Entry) -> Increment {
        match self.count_token(&key, &entry).await {
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

    /// Step 1: `$addToSet` the entry, upserting the counter document.
    async fn add_token(&self, key: &Bson, entry: &Entry) -> Added {
        let driver_retries = match self.store.driver_retries_writes().await {
            Ok(retries) => retries,
            Err(err) => return Added::No(err),
        };
        let filter = doc! { "_id": key };
        let update = doc! {
            "$addToSet": { &self.spec.pending_field: entry.to_bson() },
            // New counters start as int64, the documented shape.
            "$setOnInsert": { &self.spec.counter_field: 0i64 },
        };
        let mut budget = RetryBudget::retry_once("increment.add_token", driver_retries)
            .with_duplicate_key_retries(UPSERT_RACE_RETRIES);
        loop {
            // Never (re)send step 1 for a token the daemon may fold: a retry
            // that lands after the fold would count twice.
            let age = entry.token().age(SystemTime::now());
            if age >= self.retry_horizon {
                let cause = Error::RetryHorizonExceeded {
                    token: entry.token().to_string(),
                    age,
                    horizon: self.retry_horizon,
                };
                return if budget.maybe_applied() {
                    Added::Unknown(cause)
                } else {
                    Added::No(cause)
                };
            }
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
                Ok(_) => return Added::Yes,
                Err(err) => match budget.after_failure(err) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => {
                        // A write-concern error applied on the primary even
                        // when it is not worth a retry.
                        return if budget.maybe_applied() || failure.effect != Effect::NotApplied {
                            Added::Unknown(Error::Server(failure))
                        } else {
                            Added::No(Error::Server(failure))
                        };
                    }
                },
            }
        }
    }

    /// Step 2: pull the entry and add its amount, conditioned on the entry
    /// being there. Returns whether the token was already gone (counted
    /// earlier).
    async fn count_token(&self, key: &Bson, entry: &Entry) -> Result<bool, Error> {
        let pending_field = &self.spec.pending_field;
        let filter = doc! { "_id": key, pending_field: entry.array_condition() };
        let update = doc! {
            "$pull": { pending_field: entry.pull_condition() },
            "$inc": { &self.spec.counter_field: inc_operand(entry.amount()) },
        };
        let result = self
            .store
            .update_one(&self.collection, filter, update, "increment.count_token")
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

/// The `$inc` operand for an amount: int32 when it fits, so an int32 counter
/// stays int32 (the server widens it to int64 on overflow, never to a
/// double), int64 otherwise.
pub(crate) fn inc_operand(amount: i64) -> Bson {
    match i32::try_from(amount) {
        Ok(small) => Bson::Int32(small),
        Err(_) => Bson::Int64(amount),
    }
}
