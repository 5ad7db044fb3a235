//! The optimistic insert loop (the book: design/sequences.md): give a new document the highest
//! numeric `_id` in the collection plus one; if another writer took that id
//! first (a duplicate key), read the highest id again and retry — a bounded
//! number of times, with jittered backoff, then a clear error saying how many
//! attempts were made. Any other insert error surfaces at once.
//!
//! Ids stay dense: no number is reserved that is not used. The price is a
//! read per attempt and lost races under contention; a [`Sequences`]
//! counter costs one round trip but may leave gaps.
//!
//! **Whose insert landed** is decided by a token, never by content: every
//! document an insert loop writes carries a field (`_tally_token` unless
//! [`InsertLoop::token_field`] names another) holding a fresh [`Token`] per
//! call. After an attempt that may have applied (a lost reply), a
//! duplicate key on the candidate id is this call's own insert only if the
//! stored token is its token — another caller may have inserted an
//! identical body under that id. And before moving on to a new candidate
//! after an attempt that may have applied, the loop looks for its token
//! under the ids it tried, so an insert that landed unseen is never made
//! twice.
//!
//! [`Sequences`]: crate::write::sequence::Sequences

use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use crate::document::{Inserted, bson_type_name, insert_if_absent, integer_value};
use crate::error::{Error, RetryBudget};
use crate::store::Store;
use crate::token::Token;

/// Default number of inserts tried before giving up.
pub(crate) const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// The field holding the token of the call that inserted a document (the
/// insert loop's default, and the bounded counters' field).
pub(crate) const TOKEN_FIELD: &str = "_tally_token";

/// Inserts documents with the next free numeric `_id`.
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use mongodb::bson::doc;
/// use tally::InsertLoop;
///
/// let tickets = InsertLoop::new(&store, "tickets");
/// let id = tickets.insert(doc! { "title": "printer on fire" }).await?;
/// println!("ticket #{id}");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct InsertLoop {
    store: Store,
    collection: Collection<Document>,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_cap: Duration,
    token_field: String,
}

impl InsertLoop {
    /// An insert loop on `collection`, with 10 attempts and a backoff of
    /// 2 ms doubling up to 100 ms (full jitter); each document gets its
    /// call's token in `_tally_token`.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// let tickets = tally::InsertLoop::new(&store, "tickets");
    /// # }
    /// ```
    pub fn new(store: &Store, collection: &str) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(collection),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff_base: Duration::from_millis(2),
            backoff_cap: Duration::from_millis(100),
            token_field: TOKEN_FIELD.into(),
        }
    }

    /// Names the field that holds each insert's token (default
    /// `_tally_token`); a field of that name in the inserted fields is
    /// replaced.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// let tickets = tally::InsertLoop::new(&store, "tickets").token_field("request");
    /// # }
    /// ```
    pub fn token_field(mut self, name: impl Into<String>) -> Self {
        self.token_field = name.into();
        self
    }

    /// Tries at most `attempts` inserts (at least one).
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// // Many writers racing for ids: give each insert more tries.
    /// let tickets = tally::InsertLoop::new(&store, "tickets").max_attempts(50);
    /// # }
    /// ```
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Waits a random time up to `base × 2^(attempt-1)`, capped at `cap`,
    /// after each lost race.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use std::time::Duration;
    ///
    /// let tickets = tally::InsertLoop::new(&store, "tickets")
    ///     .backoff(Duration::from_millis(5), Duration::from_millis(500));
    /// # }
    /// ```
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_cap = cap;
        self
    }

    /// Inserts `document` (its own `_id`, if any, is replaced) under the
    /// next free id and returns that id. The stored document also holds
    /// this call's token in the token field.
    ///
    /// ```no_run
    /// # async fn demo(tickets: tally::InsertLoop) -> Result<(), tally::Error> {
    /// use mongodb::bson::doc;
    /// use tally::Error;
    ///
    /// match tickets.insert(doc! { "title": "printer on fire" }).await {
    ///     Ok(id) => println!("ticket #{id}"),
    ///     // Every attempt lost its race: nothing was inserted.
    ///     Err(Error::InsertAttemptsExhausted { attempts }) => {
    ///         eprintln!("busy after {attempts} tries")
    ///     }
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn insert(&self, fields: Document) -> Result<i64, Error> {
        let token = Token::new();
        // Candidates an attempt may have landed on, unseen.
        let mut unsure = Vec::new();
        let mut unsure_cause = None;
        for attempt in 1..=self.max_attempts {
            if let Some(id) = self.find_own(&unsure, token).await? {
                return Ok(id);
            }
            let candidate = highest_id(&self.store, &self.collection)
                .await?
                .map_or(1, |max| max + 1);
            let document = self.document(candidate, &fields, token);
            match insert_if_absent(
                &self.store,
                &self.collection,
                &document,
                "insert_loop.insert",
            )
            .await?
            {
                Inserted::New => return Ok(candidate),
                // A lost reply's attempt landed: the token is ours.
                Inserted::Existing(found) if self.holds(&found, token) => return Ok(candidate),
                Inserted::Existing(_) => {}
                Inserted::Unsure(cause) => {
                    unsure.push(candidate);
                    unsure_cause = Some(cause);
                }
            }
            tracing::debug!(
                collection = self.collection.name(),
                candidate,
                attempt,
                "insert loop lost the race for an id"
            );
            if attempt < self.max_attempts {
                tokio::time::sleep(self.jitter(attempt)).await;
            }
        }
        if let Some(id) = self.find_own(&unsure, token).await? {
            return Ok(id);
        }
        Err(unsure_cause.unwrap_or(Error::InsertAttemptsExhausted {
            attempts: self.max_attempts,
        }))
    }

    /// `fields` under `_id` `candidate`, with `token` in the token field.
    fn document(&self, candidate: i64, fields: &Document, token: Token) -> Document {
        // `_id` first, as the server stores it.
        let mut document = doc! { "_id": candidate };
        document.extend(
            fields
                .iter()
                .filter(|(k, _)| *k != "_id" && **k != self.token_field)
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        document.insert(&self.token_field, token.object_id());
        document
    }

    fn holds(&self, found: &Document, token: Token) -> bool {
        found.get(&self.token_field) == Some(&Bson::ObjectId(token.object_id()))
    }

    /// The id among `candidates` whose document holds `token`, if any.
    async fn find_own(&self, candidates: &[i64], token: Token) -> Result<Option<i64>, Error> {
        if candidates.is_empty() {
            return Ok(None);
        }
        let filter = doc! {
            "_id": { "$in": candidates },
            &self.token_field: token.object_id(),
        };
        let found = self
            .store
            .find_one(
                &self.collection,
                filter,
                doc! { "_id": 1 },
                "insert_loop.find_own",
            )
            .await?;
        Ok(found.and_then(|d| d.get("_id").and_then(integer_value)))
    }

    fn jitter(&self, attempt: u32) -> Duration {
        let ceiling = self
            .backoff_base
            .saturating_mul(1 << (attempt - 1).min(20))
            .min(self.backoff_cap);
        ceiling.mul_f64(fastrand::f64())
    }
}

/// The highest numeric `_id` in `collection` (`None` when it holds none).
/// Ids of other types are ignored; a non-integral number is an error.
pub(crate) async fn highest_id(
    store: &Store,
    collection: &Collection<Document>,
) -> Result<Option<i64>, Error> {
    let mut budget = RetryBudget::read_once("insert_loop.highest_id");
    // `$gte: -inf` selects exactly the numbers (type bracketing) and can
    // walk the `_id` index from its top.
    let found = store
        .with_retry(&mut budget, || {
            collection
                .find_one(doc! { "_id": { "$gte": f64::NEG_INFINITY } })
                .sort(doc! { "_id": -1 })
                .projection(doc! { "_id": 1 })
        })
        .await
        .map_err(Error::Server)?;
    let Some(found) = found else {
        return Ok(None);
    };
    let id = found.get("_id").unwrap_or(&Bson::Null);
    integer_value(id).map(Some).ok_or_else(|| Error::Malformed {
        collection: collection.name().to_owned(),
        id: id.to_string(),
        reason: format!(
            "the highest numeric _id is a {} that is not an integer",
            bson_type_name(id)
        ),
    })
}
