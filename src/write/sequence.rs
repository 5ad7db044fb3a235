//! Sequences on a counters collection (the book: design/sequences.md): numbers for order ids,
//! user ids and the like, one document per sequence, `{_id: name, seq: n}`
//! as in MongoDB's tutorial, so existing counters keep working.
//!
//! `next` is one `findOneAndUpdate` with `$inc` and return-after, the
//! tutorial's shape. What the tutorial leaves out is the first use of a
//! name: concurrent upserts of a new document collide on the unique `_id`
//! (and some servers even answer one of them with no document although its
//! `$inc` applied). tally never upserts here: when the document is missing it
//! is created with an insert whose duplicate-key error is ignored, and the
//! `$inc` is sent again without upsert.
//!
//! **Gaps.** A transient failure is retried once. If the lost attempt had
//! applied, its number is skipped: a sequence may have gaps but never returns
//! a number twice — the same promise PostgreSQL makes for `nextval`. tally
//! makes that retry itself (the driver's retryable writes are off on its
//! client, whatever the URI says), so a lost reply may skip a number on
//! every deployment.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReturnDocument;
use serde::Serialize;

use crate::document::{Inserted, bson_type_name, insert_if_absent, integer_value};
use crate::error::{Error, RetryBudget};
use crate::store::Store;

/// Where sequences live: the counters collection and its field.
///
/// ```
/// use tally::SequenceConfig;
///
/// let config = SequenceConfig { field: "last".into(), ..SequenceConfig::in_collection("ids") };
/// assert_eq!((config.collection.as_str(), config.field.as_str()), ("ids", "last"));
/// assert_eq!(SequenceConfig::default().collection, "counters");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SequenceConfig {
    /// The counters collection: one document `{_id: name, <field>: n}` per
    /// sequence. Default: `counters`, as in MongoDB's tutorial.
    pub collection: String,
    /// The field holding a sequence's last number. Default: `seq`.
    pub field: String,
}

impl Default for SequenceConfig {
    fn default() -> Self {
        Self {
            collection: "counters".into(),
            field: "seq".into(),
        }
    }
}

impl SequenceConfig {
    /// Sequences in another collection, with the default field.
    ///
    /// ```
    /// use tally::SequenceConfig;
    ///
    /// let config = SequenceConfig::in_collection("ids");
    /// assert_eq!((config.collection.as_str(), config.field.as_str()), ("ids", "seq"));
    /// ```
    pub fn in_collection(collection: impl Into<String>) -> Self {
        Self {
            collection: collection.into(),
            ..Self::default()
        }
    }
}

/// How often `next` creates a missing document before giving up (it only
/// goes round again if someone deletes the document in between).
const CREATE_ROUNDS: u32 = 3;

/// Sequences in one counters collection.
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use tally::{SequenceConfig, Sequences};
///
/// let ids = Sequences::new(&store, &SequenceConfig::default());
/// let invoice = ids.next("invoice").await?;
/// println!("invoice #{invoice}");
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Sequences {
    store: Store,
    collection: Collection<Document>,
    field: String,
}

/// A block of consecutive numbers reserved by [`Sequences::next_block`].
///
/// ```no_run
/// # async fn demo(ids: tally::Sequences) -> Result<(), tally::Error> {
/// let block = ids.next_block("invoice", 100).await?;
/// assert_eq!(block.last - block.first, 99);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// The first number of the block.
    pub first: i64,
    /// The last number of the block (`first + n - 1`).
    pub last: i64,
}

impl Block {
    /// The numbers of the block, in order.
    ///
    /// ```
    /// use tally::Block;
    ///
    /// let block = Block { first: 41, last: 43 };
    /// assert_eq!(block.numbers().collect::<Vec<_>>(), [41, 42, 43]);
    /// ```
    pub fn numbers(&self) -> std::ops::RangeInclusive<i64> {
        self.first..=self.last
    }
}

impl Sequences {
    /// Sequences in the configured collection.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{SequenceConfig, Sequences};
    ///
    /// let ids = Sequences::new(&store, &SequenceConfig::in_collection("ids"));
    /// # }
    /// ```
    pub fn new(store: &Store, config: &SequenceConfig) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(&config.collection),
            field: config.field.clone(),
        }
    }

    /// The next number of the sequence `name` (1 for a new sequence).
    ///
    /// ```no_run
    /// # async fn demo(ids: tally::Sequences) -> Result<(), tally::Error> {
    /// // Never handed out twice, even when a reply is lost and the call retried.
    /// let number = ids.next("invoice").await?;
    /// assert!(number >= 1);
    /// # Ok(()) }
    /// ```
    pub async fn next(&self, name: &str) -> Result<i64, Error> {
        self.advance(name, 1).await
    }

    /// Reserves `n` consecutive numbers in one round trip.
    ///
    /// ```no_run
    /// # async fn demo(ids: tally::Sequences) -> Result<(), tally::Error> {
    /// // 100 numbers in one round trip, for a batch import.
    /// for number in ids.next_block("invoice", 100).await?.numbers() {
    ///     println!("invoice #{number}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next_block(&self, name: &str, n: u32) -> Result<Block, Error> {
        if n == 0 {
            return Err(Error::InvalidArgument(
                "a block holds at least one number".into(),
            ));
        }
        let last = self.advance(name, i64::from(n)).await?;
        Ok(Block {
            first: last - i64::from(n) + 1,
            last,
        })
    }

    /// The last number handed out, without changing anything (`None` when
    /// the sequence does not exist yet).
    ///
    /// ```no_run
    /// # async fn demo(ids: tally::Sequences) -> Result<(), tally::Error> {
    /// match ids.current("invoice").await? {
    ///     Some(last) => println!("last invoice: #{last}"),
    ///     None => println!("no invoice yet"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn current(&self, name: &str) -> Result<Option<i64>, Error> {
        let projection = doc! { &self.field: 1 };
        let found = self
            .store
            .find_one(
                &self.collection,
                doc! { "_id": name },
                projection,
                "sequence.current",
            )
            .await?;
        found.map(|d| self.value_of(name, &d)).transpose()
    }

    /// Makes sure the sequence is at least `value`, so the next number is
    /// above it; never moves it backwards. Seeds a sequence from the highest
    /// id already in a collection — without this, a counter that lags the
    /// data sends an insert loop into endless duplicate keys. Returns the
    /// sequence's value afterwards.
    ///
    /// ```no_run
    /// # async fn demo(ids: tally::Sequences, highest_id_in_use: i64) -> Result<(), tally::Error> {
    /// // Before handing out ids for a collection that already holds some.
    /// let now = ids.ensure_at_least("invoice", highest_id_in_use).await?;
    /// assert!(now >= highest_id_in_use);
    /// # Ok(()) }
    /// ```
    pub async fn ensure_at_least(&self, name: &str, value: i64) -> Result<i64, Error> {
        if self.create(name, value).await? {
            return Ok(value);
        }
        // `$max` is idempotent: retrying it is always safe.
        let max = doc! { "$max": { &self.field: value } };
        match self.modify(name, max, "sequence.ensure_at_least").await? {
            Some(value) => Ok(value),
            // Deleted right after we found it: create it again.
            None => Box::pin(self.ensure_at_least(name, value)).await,
        }
    }

    /// Adds `by` and returns the new value.
    async fn advance(&self, name: &str, by: i64) -> Result<i64, Error> {
        for _ in 0..CREATE_ROUNDS {
            // Not idempotent: a retried `$inc` whose first attempt applied
            // skips a number. That is the documented gap, never a duplicate.
            let inc = doc! { "$inc": { &self.field: by } };
            match self.modify(name, inc, "sequence.next").await? {
                Some(value) => return Ok(value),
                None => {
                    self.create(name, 0).await?;
                }
            }
        }
        Err(Error::InvalidArgument(format!(
            "sequence {name:?} was deleted {CREATE_ROUNDS} times while being advanced"
        )))
    }

    /// Applies `update` to the sequence's document (never upserting) and
    /// returns the value after it; `None` when the document does not exist.
    async fn modify(
        &self,
        name: &str,
        update: Document,
        operation: &'static str,
    ) -> Result<Option<i64>, Error> {
        let mut budget = RetryBudget::retry_once(operation);
        let found = self
            .store
            .with_retry(&mut budget, || {
                self.collection
                    .find_one_and_update(doc! { "_id": name }, update.clone())
                    .return_document(ReturnDocument::After)
                    .projection(doc! { &self.field: 1 })
            })
            .await
            .map_err(Error::Server)?;
        found.map(|d| self.value_of(name, &d)).transpose()
    }

    /// Inserts `{_id: name, seq: start}` unless the document exists.
    /// Returns whether this call created it.
    async fn create(&self, name: &str, start: i64) -> Result<bool, Error> {
        let document = doc! { "_id": name, &self.field: start };
        match insert_if_absent(&self.store, &self.collection, &document, "sequence.create").await? {
            Inserted::New => Ok(true),
            Inserted::Existing(_) => Ok(false),
            Inserted::Unsure(cause) => Err(cause),
        }
    }

    fn value_of(&self, name: &str, d: &Document) -> Result<i64, Error> {
        let value = d.get(&self.field).unwrap_or(&Bson::Null);
        integer_value(value).ok_or_else(|| Error::Malformed {
            collection: self.collection.name().to_owned(),
            id: format!("{name:?}"),
            reason: format!(
                "field {:?} is a {}, not an integer",
                self.field,
                bson_type_name(value)
            ),
        })
    }
}
