//! Bounded counters (the book: design/sequences.md): limited stock — seats, copies, licences —
//! handed out one unit at a time, with who holds each unit recorded in the
//! same document (MongoDB's "copies available + checkout" pattern):
//!
//! ```text
//! { _id: key, available: 3, holders: [ { token: ObjectId, holder: "joe", at: Date }, ... ] }
//! ```
//!
//! A take is one atomic update that decrements `available` only while it is
//! above zero *and* the caller's token is not already among the holders, and
//! records the holder in the same write. The token makes a retried take
//! recognisable: a take whose reply was lost and that is sent again finds its
//! token and reports [`Take::AlreadyTaken`] instead of taking a second unit.
//!
//! **A delayed take after `give_back`.** A take held up in the network that
//! executes *after* its token gave the unit back finds the token no longer
//! among the holders, and takes a unit again (held by that token until it is
//! given back once more). Like an increment's delayed step 1 (README,
//! Limits), tally cannot tell it from a new take with the same token: give
//! back only what a take confirmed, and never reuse a token.
//!
//! [`BoundedCounters::create`] decides "this call created it" by a token,
//! never by content: the document it inserts carries a fresh token in
//! `_tally_token`, and after a lost reply a duplicate key is this call's own
//! insert only if the stored token is its own — another caller may have
//! created the same counter with the same units meanwhile.

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};

use crate::document::{Inserted, bson_type_name, check_key, insert_if_absent, integer_value};
use crate::error::Error;
use crate::store::Store;
use crate::token::Token;
use crate::write::insert_loop::TOKEN_FIELD;

/// How often a take that matched nothing is tried again when the document
/// shows units left (someone gave one back in between).
const RACE_ROUNDS: u32 = 3;

/// Where bounded counters live and how their fields are named.
///
/// ```
/// use tally::BoundedConfig;
///
/// let seats = BoundedConfig::new("concerts").with_fields("seats_left", "ticket_holders");
/// assert_eq!(seats.available_field, "seats_left");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedConfig {
    /// The collection.
    pub collection: String,
    /// The field counting the units left. Default: `available`.
    pub available_field: String,
    /// The array of `{token, holder, at}` entries, one per unit taken.
    /// Default: `holders`.
    pub holders_field: String,
}

impl BoundedConfig {
    /// A collection with the default field names.
    ///
    /// ```
    /// use tally::BoundedConfig;
    ///
    /// let seats = BoundedConfig::new("concerts");
    /// assert_eq!(seats.available_field, "available");
    /// assert_eq!(seats.holders_field, "holders");
    /// ```
    pub fn new(collection: impl Into<String>) -> Self {
        Self {
            collection: collection.into(),
            available_field: "available".into(),
            holders_field: "holders".into(),
        }
    }

    /// The same collection with other field names.
    ///
    /// ```
    /// use tally::BoundedConfig;
    ///
    /// let seats = BoundedConfig::new("concerts").with_fields("seats_left", "ticket_holders");
    /// assert_eq!(seats.holders_field, "ticket_holders");
    /// ```
    pub fn with_fields(mut self, available: impl Into<String>, holders: impl Into<String>) -> Self {
        self.available_field = available.into();
        self.holders_field = holders.into();
        self
    }
}

/// The result of [`BoundedCounters::take`].
///
/// ```no_run
/// # async fn demo(seats: tally::BoundedCounters) -> Result<(), tally::Error> {
/// use tally::{Take, Token};
///
/// let token = Token::new(); // keep it: it gives the seat back, or retries the take
/// match seats.take("gig-2026-06-01", token, "alice").await? {
///     Take::Taken | Take::AlreadyTaken => println!("alice has a seat"),
///     Take::NoneLeft => println!("sold out"),
///     Take::NotFound => println!("no such concert"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// This call took a unit.
    Taken,
    /// The token already holds a unit: taken by an earlier call, or by an
    /// earlier attempt of this one whose reply was lost. Nothing more was
    /// taken.
    AlreadyTaken,
    /// No unit is left.
    NoneLeft,
    /// There is no such bounded counter.
    NotFound,
}

/// The result of [`BoundedCounters::give_back`].
///
/// ```no_run
/// # async fn demo(
/// #     seats: tally::BoundedCounters,
/// #     token: tally::Token,
/// # ) -> Result<(), tally::Error> {
/// use tally::GiveBack;
///
/// match seats.give_back("gig-2026-06-01", token).await? {
///     GiveBack::Returned => println!("the seat is free again"),
///     // Given back before (a retry), or never taken: nothing changed.
///     GiveBack::NotHeld => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveBack {
    /// The unit held by the token is available again.
    Returned,
    /// The token holds no unit (never took one, or already gave it back).
    NotHeld,
}

/// Bounded counters in one collection.
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use tally::{BoundedConfig, BoundedCounters, Take, Token};
///
/// let seats = BoundedCounters::new(&store, BoundedConfig::new("concerts"));
/// seats.create("gig-2026-06-01", 300).await?;
/// let token = Token::new();
/// if seats.take("gig-2026-06-01", token, "alice").await? == Take::Taken {
///     println!("{} seats left", seats.available("gig-2026-06-01").await?.unwrap_or(0));
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct BoundedCounters {
    store: Store,
    collection: Collection<Document>,
    spec: BoundedConfig,
}

impl BoundedCounters {
    /// Bounded counters as `spec` describes them.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{BoundedConfig, BoundedCounters};
    ///
    /// let seats = BoundedCounters::new(&store, BoundedConfig::new("concerts"));
    /// # }
    /// ```
    pub fn new(store: &Store, spec: BoundedConfig) -> Self {
        Self {
            store: store.clone(),
            collection: store.collection(&spec.collection),
            spec,
        }
    }

    /// Creates the counter `key` with `units` available and no holders
    /// (and this call's token in `_tally_token`). Returns `false` (and
    /// changes nothing) when it already exists. An error after an attempt
    /// that may have applied leaves it unknown whether this call created
    /// it; calling again then returns `false` either way.
    ///
    /// ```no_run
    /// # async fn demo(seats: tally::BoundedCounters) -> Result<(), tally::Error> {
    /// if !seats.create("gig-2026-06-01", 300).await? {
    ///     println!("the concert exists already: its seats are left as they are");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn create(&self, key: impl Into<Bson>, units: i64) -> Result<bool, Error> {
        if units < 0 {
            return Err(Error::InvalidArgument("units must not be negative".into()));
        }
        let key = key.into();
        check_key(&key)?;
        let token = Bson::ObjectId(Token::new().object_id());
        let document = doc! {
            "_id": key,
            &self.spec.available_field: units,
            &self.spec.holders_field: [],
            TOKEN_FIELD: &token,
        };
        let inserted =
            insert_if_absent(&self.store, &self.collection, &document, "bounded.create").await?;
        match inserted {
            Inserted::New => Ok(true),
            // After a lost reply, the counter found is ours only if it
            // holds our token.
            Inserted::Existing(found) => Ok(found.get(TOKEN_FIELD) == Some(&token)),
            Inserted::Unsure(cause) => Err(cause),
        }
    }

    /// Takes one unit of `key` for `holder`, identified by `token` (make a
    /// fresh one per take and keep it to give the unit back or to retry).
    ///
    /// ```no_run
    /// # async fn demo(seats: tally::BoundedCounters) -> Result<(), tally::Error> {
    /// use tally::{Take, Token};
    ///
    /// let token = Token::new();
    /// let taken = match seats.take("gig-2026-06-01", token, "alice").await {
    ///     Ok(taken) => taken,
    ///     // The reply was lost: the same token again takes at most one seat.
    ///     Err(_) => seats.take("gig-2026-06-01", token, "alice").await?,
    /// };
    /// if taken == Take::AlreadyTaken {
    ///     println!("the lost attempt had taken alice's seat: still one seat");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn take(
        &self,
        key: impl Into<Bson>,
        token: Token,
        holder: impl Into<Bson>,
    ) -> Result<Take, Error> {
        let key = key.into();
        check_key(&key)?;
        let holders = &self.spec.holders_field;
        let available = &self.spec.available_field;
        let filter = doc! {
            "_id": &key,
            available: { "$gt": 0 },
            format!("{holders}.token"): { "$ne": token.object_id() },
        };
        let update = doc! {
            "$inc": { available: -1 },
            "$push": { holders: { "token": token.object_id(), "holder": holder.into(), "at": DateTime::now() } },
        };
        for _ in 0..RACE_ROUNDS {
            // Idempotent: the filter refuses a token that already holds a unit.
            let result = self
                .store
                .update_one(
                    &self.collection,
                    filter.clone(),
                    update.clone(),
                    "bounded.take",
                )
                .await?;
            if result.matched_count == 1 {
                return Ok(Take::Taken);
            }
            // Matched nothing: find out why.
            let Some(state) = self.state(&key, token).await? else {
                return Ok(Take::NotFound);
            };
            if state.holds_token {
                return Ok(Take::AlreadyTaken);
            }
            if state.available <= 0 {
                return Ok(Take::NoneLeft);
            }
        }
        Ok(Take::NoneLeft)
    }

    /// Gives back the unit `token` holds. Idempotent: a second call reports
    /// [`GiveBack::NotHeld`] and changes nothing.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     seats: tally::BoundedCounters,
    /// #     token: tally::Token,
    /// # ) -> Result<(), tally::Error> {
    /// use tally::GiveBack;
    ///
    /// // Safe to call again: the second call finds nothing held.
    /// if seats.give_back("gig-2026-06-01", token).await? == GiveBack::Returned {
    ///     println!("alice's seat is free again");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn give_back(&self, key: impl Into<Bson>, token: Token) -> Result<GiveBack, Error> {
        let key = key.into();
        check_key(&key)?;
        let holders = &self.spec.holders_field;
        let filter = doc! { "_id": key, format!("{holders}.token"): token.object_id() };
        let update = doc! {
            "$inc": { &self.spec.available_field: 1 },
            "$pull": { holders: { "token": token.object_id() } },
        };
        let result = self
            .store
            .update_one(&self.collection, filter, update, "bounded.give_back")
            .await?;
        Ok(if result.matched_count == 1 {
            GiveBack::Returned
        } else {
            GiveBack::NotHeld
        })
    }

    /// The units left (`None` when the counter does not exist).
    ///
    /// ```no_run
    /// # async fn demo(seats: tally::BoundedCounters) -> Result<(), tally::Error> {
    /// match seats.available("gig-2026-06-01").await? {
    ///     Some(0) => println!("sold out"),
    ///     Some(left) => println!("{left} seats left"),
    ///     None => println!("no such concert"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn available(&self, key: impl Into<Bson>) -> Result<Option<i64>, Error> {
        let key = key.into();
        check_key(&key)?;
        let projection = doc! { &self.spec.available_field: 1 };
        let found = self
            .store
            .find_one(
                &self.collection,
                doc! { "_id": &key },
                projection,
                "bounded.available",
            )
            .await?;
        found.map(|d| self.available_of(&key, &d)).transpose()
    }

    async fn state(&self, key: &Bson, token: Token) -> Result<Option<State>, Error> {
        let holders = &self.spec.holders_field;
        let projection = doc! {
            &self.spec.available_field: 1,
            holders: { "$elemMatch": { "token": token.object_id() } },
        };
        let found = self
            .store
            .find_one(
                &self.collection,
                doc! { "_id": key },
                projection,
                "bounded.state",
            )
            .await?;
        let Some(found) = found else {
            return Ok(None);
        };
        let holds_token = matches!(found.get(holders), Some(Bson::Array(a)) if !a.is_empty());
        Ok(Some(State {
            available: self.available_of(key, &found)?,
            holds_token,
        }))
    }

    fn available_of(&self, key: &Bson, d: &Document) -> Result<i64, Error> {
        let value = d.get(&self.spec.available_field).unwrap_or(&Bson::Null);
        integer_value(value).ok_or_else(|| Error::Malformed {
            collection: self.spec.collection.clone(),
            id: key.to_string(),
            reason: format!(
                "field {:?} is a {}, not an integer",
                self.spec.available_field,
                bson_type_name(value)
            ),
        })
    }
}

struct State {
    available: i64,
    holds_token: bool,
}
