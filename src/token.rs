//! Pending tokens and the entries of a `pending` array (the book: design/counter-document.md).
//!
//! A token is a fresh client-generated ObjectId; its first four bytes are its
//! creation time in whole seconds, which is all tally needs to know a token's
//! age. An entry is either the bare token (`+1`, the form other clients of
//! this technique write) or `{t: token, n: amount}` (`+n`, `n != 0`).
//!
//! A settle marker — the record, in the `settled` array, that a settle
//! counted a token — has the `{t, n}` form whatever the amount, with `n` an
//! int64.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use crate::document::bson_type_name;

/// Field holding the token in the `{t, n}` entry form.
pub(crate) const TOKEN_FIELD: &str = "t";
/// Field holding the amount in the `{t, n}` entry form.
pub(crate) const AMOUNT_FIELD: &str = "n";

/// A pending token: identifies one increment attempt (not an event).
///
/// ```
/// use tally::Token;
///
/// let token = Token::new();
/// // As logs and tickets show it, and back.
/// let shown = token.to_string();
/// assert_eq!(shown.len(), 24);
/// assert_eq!(shown.parse::<Token>().expect("24 hex digits"), token);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token(ObjectId);

impl Token {
    /// A fresh token, stamped with the current time.
    ///
    /// ```
    /// use std::time::SystemTime;
    /// use tally::Token;
    ///
    /// let token = Token::new();
    /// assert!(token.created_at() <= SystemTime::now());
    /// assert_ne!(token, Token::new(), "every token is unique");
    /// ```
    pub fn new() -> Self {
        Self(ObjectId::new())
    }

    /// Wraps an existing ObjectId (a token another client wrote, or one read
    /// back from a document).
    ///
    /// ```
    /// use mongodb::bson::oid::ObjectId;
    /// use tally::Token;
    ///
    /// // A bare entry another client wrote in a `pending` array.
    /// let entry = ObjectId::new();
    /// assert_eq!(Token::from_object_id(entry).object_id(), entry);
    /// ```
    pub fn from_object_id(oid: ObjectId) -> Self {
        Self(oid)
    }

    /// The ObjectId.
    ///
    /// ```
    /// use mongodb::bson::doc;
    /// use tally::Token;
    ///
    /// let token = Token::new();
    /// // Look a token up in a counter document yourself.
    /// let filter = doc! { "_id": "home", "pending": token.object_id() };
    /// ```
    pub fn object_id(&self) -> ObjectId {
        self.0
    }

    /// When the token was created, to the second (from its first 4 bytes).
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tally::Token;
    ///
    /// let an_hour_ago = SystemTime::now() - Duration::from_secs(3600);
    /// let token = Token::created_at_time(an_hour_ago);
    /// let skew = an_hour_ago.duration_since(token.created_at()).expect("never later");
    /// assert!(skew < Duration::from_secs(1), "whole seconds");
    /// ```
    pub fn created_at(&self) -> SystemTime {
        self.0.timestamp().into()
    }

    /// The token's age at `now`. The timestamp is truncated to whole seconds,
    /// so the age is never under-estimated — which is the safe side for the
    /// retry horizon.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tally::Token;
    ///
    /// let token = Token::created_at_time(SystemTime::now() - Duration::from_secs(300));
    /// let horizon = Duration::from_secs(180);
    /// if token.age(SystemTime::now()) >= horizon {
    ///     println!("too old to resume: counted at most once");
    /// }
    /// ```
    pub fn age(&self, now: SystemTime) -> Duration {
        now.duration_since(self.created_at())
            .unwrap_or(Duration::ZERO)
    }

    /// The smallest ObjectId created at `time` (truncated to the second):
    /// every token created before `time`'s second sorts below it. Used as an
    /// index-friendly cutoff: `{pending: {$lt: Token::cutoff(t)}}`.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use mongodb::bson::doc;
    /// use tally::Token;
    ///
    /// // Counters holding a token older than 15 minutes.
    /// let line = Token::cutoff(SystemTime::now() - Duration::from_secs(15 * 60));
    /// let filter = doc! { "pending": { "$lt": line } };
    /// let old = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    /// assert!(old.object_id() < line);
    /// ```
    pub fn cutoff(time: SystemTime) -> ObjectId {
        let secs = time
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            .min(u64::from(u32::MAX)) as u32;
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        ObjectId::from_bytes(bytes)
    }

    /// A token stamped with `time` (for tests and tools that need an old
    /// token).
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tally::Token;
    ///
    /// // A token a crashed writer left an hour ago, for a test of the fold.
    /// let old = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    /// assert!(old.age(SystemTime::now()) >= Duration::from_secs(3599));
    /// ```
    pub fn created_at_time(time: SystemTime) -> Self {
        let mut bytes = ObjectId::new().bytes();
        bytes[..4].copy_from_slice(&Self::cutoff(time).bytes()[..4]);
        Self(ObjectId::from_bytes(bytes))
    }
}

impl Default for Token {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.to_hex())
    }
}

/// A token string that is not 24 hex digits.
///
/// ```
/// use tally::{BadToken, Token};
///
/// let bad: BadToken = "not-a-token".parse::<Token>().unwrap_err();
/// eprintln!("{bad}");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("a token is 24 hex digits, got {0:?}")]
pub struct BadToken(String);

impl FromStr for Token {
    type Err = BadToken;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ObjectId::parse_str(s)
            .map(Self)
            .map_err(|_| BadToken(s.to_owned()))
    }
}

/// Which of the two entry forms an entry has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryForm {
    /// The bare ObjectId: `+1`.
    Bare,
    /// `{t: ObjectId, n: amount}`.
    Tagged,
}

/// One entry of a `pending` array: a token and the amount it adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    token: Token,
    amount: i64,
    form: EntryForm,
}

/// Why an element of a `pending` array is not a valid entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadEntry {
    /// Neither an ObjectId nor a document.
    #[error("entry is a {0}, not an ObjectId or {{t, n}}")]
    WrongType(&'static str),
    /// A document without an ObjectId `t`.
    #[error("entry document has no ObjectId field `t`")]
    MissingToken,
    /// `n` is missing, not an integer, or zero.
    #[error("entry amount `n` {0}")]
    BadAmount(&'static str),
    /// A document with fields other than `t` and `n`.
    #[error("entry document has unexpected field {0:?}")]
    ExtraField(String),
}

impl Entry {
    /// The entry for an increment of `amount` with `token`: the bare form for
    /// `+1` (what other clients of the technique write), `{t, n}` otherwise.
    /// Returns `None` for a zero amount, which would count nothing.
    pub(crate) fn new(token: Token, amount: i64) -> Option<Self> {
        match amount {
            0 => None,
            1 => Some(Self {
                token,
                amount,
                form: EntryForm::Bare,
            }),
            _ => Some(Self {
                token,
                amount,
                form: EntryForm::Tagged,
            }),
        }
    }

    /// The token.
    pub(crate) fn token(&self) -> Token {
        self.token
    }

    /// The amount the entry adds when counted.
    pub(crate) fn amount(&self) -> i64 {
        self.amount
    }

    /// The entry's form.
    #[cfg(test)]
    pub(crate) fn form(&self) -> EntryForm {
        self.form
    }

    /// The entry as stored in the `pending` array.
    pub(crate) fn to_bson(self) -> Bson {
        match self.form {
            EntryForm::Bare => Bson::ObjectId(self.token.0),
            EntryForm::Tagged => Bson::Document(doc! {
                TOKEN_FIELD: self.token.0,
                AMOUNT_FIELD: self.amount,
            }),
        }
    }

    /// A query condition on the `pending` array that matches a document
    /// holding this entry, whatever the field order or integer width another
    /// client used.
    pub(crate) fn array_condition(&self) -> Bson {
        match self.form {
            EntryForm::Bare => Bson::ObjectId(self.token.0),
            EntryForm::Tagged => Bson::Document(doc! {
                "$elemMatch": { TOKEN_FIELD: self.token.0, AMOUNT_FIELD: self.amount }
            }),
        }
    }

    /// The settle marker for this entry: `{t: token, n: amount}`, the
    /// amount as an int64.
    pub(crate) fn marker(&self) -> Document {
        doc! { TOKEN_FIELD: self.token.0, AMOUNT_FIELD: self.amount }
    }

    /// Parses one element of a `settled` array: exactly `{t: ObjectId, n:
    /// non-zero integer}`.
    pub(crate) fn parse_marker(value: &Bson) -> Result<Self, BadEntry> {
        match value {
            Bson::Document(doc) => Self::parse_tagged(doc),
            other => Err(BadEntry::WrongType(bson_type_name(other))),
        }
    }

    /// Parses one element of a `pending` array.
    pub(crate) fn parse(value: &Bson) -> Result<Self, BadEntry> {
        match value {
            Bson::ObjectId(oid) => Ok(Self {
                token: Token(*oid),
                amount: 1,
                form: EntryForm::Bare,
            }),
            Bson::Document(doc) => Self::parse_tagged(doc),
            other => Err(BadEntry::WrongType(bson_type_name(other))),
        }
    }

    fn parse_tagged(doc: &Document) -> Result<Self, BadEntry> {
        if let Some(extra) = doc.keys().find(|k| *k != TOKEN_FIELD && *k != AMOUNT_FIELD) {
            return Err(BadEntry::ExtraField(extra.clone()));
        }
        let Some(Bson::ObjectId(oid)) = doc.get(TOKEN_FIELD) else {
            return Err(BadEntry::MissingToken);
        };
        let amount = match doc.get(AMOUNT_FIELD) {
            Some(Bson::Int32(n)) => i64::from(*n),
            Some(Bson::Int64(n)) => *n,
            None => return Err(BadEntry::BadAmount("is missing")),
            Some(_) => return Err(BadEntry::BadAmount("is not an integer")),
        };
        if amount == 0 {
            return Err(BadEntry::BadAmount("is zero"));
        }
        Ok(Self {
            token: Token(*oid),
            amount,
            form: EntryForm::Tagged,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plus_one_is_the_bare_form() {
        let token = Token::new();
        let entry = Entry::new(token, 1).unwrap();
        assert_eq!(entry.to_bson(), Bson::ObjectId(token.object_id()));
        assert_eq!(Entry::parse(&entry.to_bson()).unwrap(), entry);
    }

    #[test]
    fn other_amounts_are_tagged_and_zero_is_refused() {
        let token = Token::new();
        let entry = Entry::new(token, -3).unwrap();
        assert_eq!(entry.form(), EntryForm::Tagged);
        assert_eq!(Entry::parse(&entry.to_bson()).unwrap(), entry);
        assert!(Entry::new(token, 0).is_none());
    }

    #[test]
    fn tagged_entries_from_other_clients_parse_in_any_field_order_and_width() {
        let oid = ObjectId::new();
        let entry = Entry::parse(&Bson::Document(doc! { "n": 5i32, "t": oid })).unwrap();
        assert_eq!(entry.amount(), 5);
        assert_eq!(entry.token().object_id(), oid);
    }

    #[test]
    fn malformed_entries_are_named() {
        let oid = ObjectId::new();
        let cases = [
            (Bson::String("x".into()), BadEntry::WrongType("string")),
            (Bson::Int32(1), BadEntry::WrongType("int")),
            (Bson::Null, BadEntry::WrongType("null")),
            (Bson::Document(doc! { "n": 1 }), BadEntry::MissingToken),
            (
                Bson::Document(doc! { "t": "x", "n": 1 }),
                BadEntry::MissingToken,
            ),
            (
                Bson::Document(doc! { "t": oid }),
                BadEntry::BadAmount("is missing"),
            ),
            (
                Bson::Document(doc! { "t": oid, "n": 1.5 }),
                BadEntry::BadAmount("is not an integer"),
            ),
            (
                Bson::Document(doc! { "t": oid, "n": 0 }),
                BadEntry::BadAmount("is zero"),
            ),
            (
                Bson::Document(doc! { "t": oid, "n": 1, "x": 1 }),
                BadEntry::ExtraField("x".into()),
            ),
        ];
        for (value, expected) in cases {
            assert_eq!(Entry::parse(&value), Err(expected), "{value:?}");
        }
    }

    #[test]
    fn markers_are_tagged_int64_whatever_the_amount() {
        let token = Token::new();
        for amount in [1, -3, 1 << 40] {
            let entry = Entry::new(token, amount).unwrap();
            let marker = entry.marker();
            assert_eq!(marker.get("n"), Some(&Bson::Int64(amount)));
            let parsed = Entry::parse_marker(&Bson::Document(marker)).unwrap();
            assert_eq!((parsed.token(), parsed.amount()), (token, amount));
        }
        assert_eq!(
            Entry::parse_marker(&Bson::ObjectId(token.object_id())),
            Err(BadEntry::WrongType("objectId"))
        );
    }

    #[test]
    fn cutoff_orders_below_every_token_of_its_second() {
        let now = SystemTime::now();
        let token = Token::created_at_time(now);
        assert!(Token::cutoff(now) <= token.object_id());
        let earlier = Token::created_at_time(now - Duration::from_secs(1));
        assert!(earlier.object_id() < Token::cutoff(now));
    }

    #[test]
    fn age_is_never_underestimated() {
        let token = Token::new();
        let now = SystemTime::now();
        assert!(token.age(now) <= Duration::from_secs(1));
        let old = Token::created_at_time(now - Duration::from_secs(120));
        assert!(old.age(now) >= Duration::from_secs(120));
    }

    #[test]
    fn tokens_round_trip_through_hex() {
        let token = Token::new();
        assert_eq!(token.to_string().parse::<Token>().unwrap(), token);
        assert!("xyz".parse::<Token>().is_err());
    }

    proptest! {
        #[test]
        fn every_nonzero_amount_round_trips(amount in any::<i64>().prop_filter("nonzero", |n| *n != 0)) {
            let entry = Entry::new(Token::new(), amount).unwrap();
            prop_assert_eq!(Entry::parse(&entry.to_bson()).unwrap(), entry);
        }

        #[test]
        fn parse_never_panics_and_accepts_only_valid_shapes(
            amount in any::<i64>(), use_i32 in any::<bool>(), extra in any::<bool>()
        ) {
            let oid = ObjectId::new();
            let n = if use_i32 { Bson::Int32(amount as i32) } else { Bson::Int64(amount) };
            let effective = if use_i32 { i64::from(amount as i32) } else { amount };
            let mut d = doc! { "t": oid, "n": n };
            if extra { d.insert("z", 1); }
            let parsed = Entry::parse(&Bson::Document(d));
            prop_assert_eq!(parsed.is_ok(), effective != 0 && !extra);
            if let Ok(entry) = parsed {
                prop_assert_eq!(entry.amount(), effective);
            }
        }
    }

    /// Any ObjectId, from random bytes (not only fresh ones).
    fn any_oid() -> impl Strategy<Value = ObjectId> {
        any::<[u8; 12]>().prop_map(ObjectId::from_bytes)
    }

    /// Scalar BSON values, biased towards the edges that matter for an
    /// amount: zero, the int32 range, integral doubles.
    fn bson_leaf() -> impl Strategy<Value = Bson> {
        prop_oneof![
            Just(Bson::Null),
            any::<bool>().prop_map(Bson::Boolean),
            prop_oneof![Just(0i32), Just(1), Just(-1), any::<i32>()].prop_map(Bson::Int32),
            prop_oneof![
                Just(0i64),
                Just(1),
                Just(-1),
                any::<i32>().prop_map(i64::from),
                any::<i64>(),
            ]
            .prop_map(Bson::Int64),
            prop_oneof![Just(0.0f64), Just(1.0), Just(-1.0), any::<f64>()].prop_map(Bson::Double),
            prop_oneof![Just(String::new()), Just("t".to_owned()), ".{0,8}"].prop_map(Bson::String),
            any_oid().prop_map(Bson::ObjectId),
        ]
    }

    /// Field names, often the entry's own.
    fn any_key() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => Just(TOKEN_FIELD.to_owned()),
            3 => Just(AMOUNT_FIELD.to_owned()),
            1 => Just("T".to_owned()),
            1 => Just("_id".to_owned()),
            2 => "[a-z$_.]{0,4}",
        ]
    }

    /// Arbitrary BSON: leaves, arrays and documents nested a few levels,
    /// plus near-miss entries (`{t, n}` in either order with arbitrary
    /// values, optionally with one more field) so that the accepted shapes
    /// are reached often.
    fn any_bson() -> impl Strategy<Value = Bson> {
        let tree = bson_leaf().prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Bson::Array),
                proptest::collection::vec((any_key(), inner), 0..4)
                    .prop_map(|fields| Bson::Document(fields.into_iter().collect())),
            ]
        });
        let near_entry = (
            prop_oneof![2 => any_oid().prop_map(Bson::ObjectId), 1 => bson_leaf()],
            prop_oneof![
                2 => any::<i32>().prop_map(Bson::Int32),
                2 => any::<i64>().prop_map(Bson::Int64),
                1 => bson_leaf(),
            ],
            any::<bool>(),
            proptest::option::weighted(0.25, (any_key(), bson_leaf())),
        )
            .prop_map(|(t, n, n_first, extra)| {
                let mut d = Document::new();
                if n_first {
                    d.insert(AMOUNT_FIELD, n);
                    d.insert(TOKEN_FIELD, t);
                } else {
                    d.insert(TOKEN_FIELD, t);
                    d.insert(AMOUNT_FIELD, n);
                }
                if let Some((key, value)) = extra {
                    d.insert(key, value);
                }
                Bson::Document(d)
            });
        prop_oneof![2 => tree, 1 => near_entry]
    }

    /// The entry rule (book: design/counter-document.md), apart from `Entry::parse`:
    /// a bare ObjectId is `+1`; a document is an entry when its fields are
    /// exactly `t` and `n`, `t` is an ObjectId and `n` a non-zero int32 or
    /// int64. Anything else is not an entry.
    fn expected_entry(value: &Bson) -> Option<(ObjectId, i64, EntryForm)> {
        match value {
            Bson::ObjectId(oid) => Some((*oid, 1, EntryForm::Bare)),
            Bson::Document(d) => {
                let mut keys: Vec<&str> = d.keys().map(String::as_str).collect();
                keys.sort_unstable();
                if keys != ["n", "t"] {
                    return None;
                }
                let oid = match d.get("t") {
                    Some(Bson::ObjectId(oid)) => *oid,
                    _ => return None,
                };
                let n = match d.get("n") {
                    Some(Bson::Int32(n)) => i64::from(*n),
                    Some(Bson::Int64(n)) => *n,
                    _ => return None,
                };
                (n != 0).then_some((oid, n, EntryForm::Tagged))
            }
            _ => None,
        }
    }

    proptest! {
        /// `Entry::parse` never panics on any BSON value and accepts exactly
        /// the two entry forms (book: design/counter-document.md), right token and amount;
        /// a value that is neither an ObjectId nor a document is refused as
        /// the wrong type.
        #[test]
        fn parse_accepts_exactly_the_two_entry_forms(value in any_bson()) {
            let parsed = Entry::parse(&value);
            match (expected_entry(&value), parsed) {
                (Some((oid, amount, form)), Ok(entry)) => {
                    prop_assert_eq!(entry.token().object_id(), oid);
                    prop_assert_eq!(entry.amount(), amount);
                    prop_assert_eq!(entry.form(), form);
                    prop_assert_eq!(Entry::parse(&entry.to_bson()), Ok(entry));
                }
                (None, Err(bad)) => {
                    let is_doc = matches!(value, Bson::Document(_));
                    prop_assert_eq!(
                        matches!(bad, BadEntry::WrongType(_)),
                        !is_doc,
                        "{:?} refused as {:?}", value, bad
                    );
                }
                (expected, parsed) => prop_assert!(
                    false,
                    "{:?}: expected {:?}, parse gave {:?}", value, expected, parsed
                ),
            }
        }
    }
}
