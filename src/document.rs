//! Reading values out of documents tally does not own: counters written by
//! other clients, sequences created in a shell, ids of existing data.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use crate::error::{Effect, Error, ErrorClass, RetryBudget};
use crate::store::Store;

/// The result of [`insert_if_absent`].
#[derive(Debug)]
pub(crate) enum Inserted {
    /// This call inserted the document.
    New,
    /// A document with the same `_id` exists: the one found under it. It
    /// may be this call's own, if an attempt whose reply was lost applied —
    /// only a field no one else writes (a token) can tell.
    Existing(Document),
    /// An attempt may have applied and the last one failed: the document
    /// may or may not be there. Only a field no one else writes (a token)
    /// can tell, later.
    Unsure(Error),
}

/// Inserts `document` unless one with its `_id` exists, retrying once on a
/// transient failure. A duplicate key is checked by reading the `_id` back
/// (the driver does not keep the server's `keyPattern` for inserts): if
/// nothing is there, the duplicate was on another unique index and is
/// returned as the error it is. A failed read after a duplicate key is
/// [`Inserted::Unsure`] (its effect "may have applied"): the document under
/// the `_id` may be this call's own.
///
/// A write-concern error means the insert applied on the primary but its
/// replication is unconfirmed (DESIGN §1): with a transient code or the
/// retryable label it is treated as a lost reply (retried: the retry's
/// duplicate key finds the document), otherwise it is the command error it
/// is.
pub(crate) async fn insert_if_absent(
    store: &Store,
    collection: &Collection<Document>,
    document: &Document,
    operation: &'static str,
) -> Result<Inserted, Error> {
    let mut budget = RetryBudget::retry_once(operation);
    let failure = match store
        .with_retry(&mut budget, || collection.insert_one(document.clone()))
        .await
    {
        Ok(_) => return Ok(Inserted::New),
        Err(failure) if failure.class == ErrorClass::DuplicateKey => failure,
        // Applied on the primary, replication unconfirmed, and not worth a
        // retry: the command error it is.
        Err(failure)
            if failure.class == ErrorClass::Command
                && failure.effect == Effect::AppliedUnconfirmed =>
        {
            return Err(Error::Server(failure));
        }
        Err(failure) if budget.maybe_applied() => {
            return Ok(Inserted::Unsure(Error::Server(failure)));
        }
        Err(failure) => return Err(Error::Server(failure)),
    };
    let id = document.get("_id").cloned().unwrap_or(Bson::Null);
    let found = match store
        .find_one(collection, doc! { "_id": &id }, doc! {}, operation)
        .await
    {
        Ok(found) => found,
        // Something holds the `_id` — maybe this call's own attempt: the
        // read's failure says nothing about the insert.
        Err(Error::Server(mut read)) => {
            read.effect = Effect::MaybeApplied;
            return Ok(Inserted::Unsure(Error::Server(read)));
        }
        Err(err) => return Ok(Inserted::Unsure(err)),
    };
    match found {
        Some(found) => Ok(Inserted::Existing(found)),
        None => Err(Error::Server(failure)),
    }
}

/// Doubles hold every integer of magnitude below 2^53 exactly, and from
/// 2^53 on no longer tell two neighbouring integers apart (2^53 + 1 is
/// stored as 2^53): the exact range of a double counter, for step 2 and the
/// fold alike.
pub(crate) const EXACT_DOUBLE: i128 = 1 << 53;

/// The open range `(low, high)` of double counters that take `amount`
/// exactly: integral, and both the counter and the sum of magnitude below
/// 2^53 — the rule of step 2 and the fold. `None` when no double counter
/// can take it (the amount itself is not exact as a double).
pub(crate) fn exact_double_range(amount: i64) -> Option<(i64, i64)> {
    let amount = i128::from(amount);
    if amount.abs() >= EXACT_DOUBLE {
        return None;
    }
    let low = -EXACT_DOUBLE + (-amount).max(0);
    let high = EXACT_DOUBLE - amount.max(0);
    // Both within ±2^53: they fit.
    Some((low as i64, high as i64))
}

/// Whether the double counter `counter` takes `amount` exactly
/// ([`exact_double_range`], and integral).
pub(crate) fn double_takes(counter: f64, amount: i64) -> bool {
    exact_double_range(amount).is_some_and(|(low, high)| {
        counter.fract() == 0.0 && counter > low as f64 && counter < high as f64
    })
}

/// An integral number stored as int32, int64 or an integral double (what
/// the legacy shell writes for `0`), as an `i64`; `None` for anything else,
/// including doubles with a fraction and doubles of magnitude 2^53 or more:
/// from 2^53 on, a double no longer tells two neighbouring integers apart
/// (2^53 + 1 is stored as 2^53).
pub(crate) fn integer_value(value: &Bson) -> Option<i64> {
    match value {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        Bson::Double(d) if d.fract() == 0.0 && d.abs() < EXACT_DOUBLE as f64 => Some(*d as i64),
        _ => None,
    }
}

/// Refuses a counter key the server would not take as a plain value in
/// `{_id: key}`: a document with a `$`-prefixed field is read as a query
/// operator (`{$gt: ""}` matches other counters), a regular expression as
/// a pattern, and an array can never be an `_id`. Every write and read of
/// a counter by key checks it first.
pub(crate) fn check_key(key: &Bson) -> Result<(), Error> {
    let reason = match key {
        Bson::Document(d) if d.keys().any(|k| k.starts_with('$')) => {
            "a document with a '$'-prefixed field is read as a query operator"
        }
        Bson::RegularExpression(_) => "a regular expression is read as a pattern over other keys",
        Bson::Array(_) => "an array cannot be a document's _id",
        Bson::Undefined => "undefined cannot be a document's _id",
        _ => return Ok(()),
    };
    Err(Error::InvalidArgument(format!(
        "counter key {} cannot be used: {reason}",
        display_id(key)
    )))
}

/// A key in the form the server compares `_id`s by: every number that is
/// an integer (int32, int64, or an integral double in the int64 range) as
/// that int64 — `5`, `NumberLong(5)` and `5.0` are one `_id` — other
/// doubles as themselves (every NaN as one), and documents and arrays with
/// their values made canonical, recursively, field names and order kept.
/// Other values (decimals included) stay as they are.
pub(crate) fn canonical_key(key: &Bson) -> Bson {
    /// An integral double in the int64 range, as that integer.
    fn exact_integer(d: f64) -> Option<i64> {
        // -2^63 ≤ d < 2^63: `d as i64` is then exact, never saturated.
        const TWO_63: f64 = 9_223_372_036_854_775_808.0;
        (d.fract() == 0.0 && (-TWO_63..TWO_63).contains(&d)).then_some(d as i64)
    }
    match key {
        Bson::Int32(n) => Bson::Int64(i64::from(*n)),
        Bson::Double(d) if d.is_nan() => Bson::Double(f64::NAN),
        Bson::Double(d) => exact_integer(*d).map_or(Bson::Double(*d), Bson::Int64),
        Bson::Document(fields) => Bson::Document(
            fields
                .iter()
                .map(|(name, value)| (name.clone(), canonical_key(value)))
                .collect(),
        ),
        Bson::Array(values) => Bson::Array(values.iter().map(canonical_key).collect()),
        other => other.clone(),
    }
}

/// The bytes of a key's canonical form ([`canonical_key`]): equal exactly
/// when the server takes the two keys for one `_id`, and usable as a map
/// key.
pub(crate) fn key_bytes(key: &Bson) -> Vec<u8> {
    let wrapped = doc! { "k": canonical_key(key) };
    wrapped.to_vec().unwrap_or_default()
}

/// Whether two keys name the same document as the server compares them:
/// numbers by exact value across int32, int64 and double (`5` and
/// `NumberLong(5)` are one `_id`; the double 2^53 and the int64 2^53 + 1
/// are two), at any depth of a document or array key, anything else by
/// its BSON.
pub(crate) fn same_key(a: &Bson, b: &Bson) -> bool {
    key_bytes(a) == key_bytes(b)
}

/// A document id as reports, logs and alerts show it: a string id as
/// itself (`docs`), any other value as its relaxed extended JSON
/// (`{"$oid":"…"}`, `7`, `{"a":1}`), which a shell or a driver reads back.
pub(crate) fn display_id(id: &Bson) -> String {
    match id {
        Bson::String(text) => text.clone(),
        other => other.clone().into_relaxed_extjson().to_string(),
    }
}

/// The BSON type name, as `$type` spells it.
pub(crate) fn bson_type_name(value: &Bson) -> &'static str {
    match value {
        Bson::Double(_) => "double",
        Bson::String(_) => "string",
        Bson::Array(_) => "array",
        Bson::Document(_) => "object",
        Bson::Boolean(_) => "bool",
        Bson::Null => "null",
        Bson::RegularExpression(_) => "regex",
        Bson::JavaScriptCode(_) | Bson::JavaScriptCodeWithScope(_) => "javascript",
        Bson::Int32(_) => "int",
        Bson::Int64(_) => "long",
        Bson::Timestamp(_) => "timestamp",
        Bson::Binary(_) => "binData",
        Bson::ObjectId(_) => "objectId",
        Bson::DateTime(_) => "date",
        Bson::Symbol(_) => "symbol",
        Bson::Decimal128(_) => "decimal",
        Bson::Undefined => "undefined",
        Bson::MaxKey => "maxKey",
        Bson::MinKey => "minKey",
        Bson::DbPointer(_) => "dbPointer",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_as_the_server_compares_ids() {
        assert!(same_key(&Bson::Int32(5), &Bson::Int64(5)));
        assert!(same_key(&Bson::Int64(5), &Bson::Double(5.0)));
        assert!(same_key(&Bson::Double(0.5), &Bson::Double(0.5)));
        assert!(!same_key(&Bson::Int32(5), &Bson::Int64(6)));
        assert!(!same_key(&Bson::Int32(5), &Bson::String("5".into())));
        assert!(same_key(
            &Bson::String("a".into()),
            &Bson::String("a".into())
        ));
    }

    /// A regular expression `^h`, read from its extended JSON (the bson
    /// crate builds one no other way outside itself).
    fn regex() -> mongodb::bson::Regex {
        let value: Bson = serde_json::from_str::<serde_json::Value>(
            r#"{"$regularExpression": {"pattern": "^h", "options": ""}}"#,
        )
        .ok()
        .and_then(|v| Bson::try_from(v).ok())
        .expect("extended JSON regex");
        match value {
            Bson::RegularExpression(r) => r,
            other => panic!("not a regex: {other}"),
        }
    }

    #[test]
    fn keys_the_server_would_read_as_a_query_are_refused() {
        for bad in [
            Bson::Document(doc! { "$gt": "" }),
            Bson::Document(doc! { "a": 1, "$ne": 2 }),
            Bson::RegularExpression(regex()),
            Bson::Array(vec![Bson::Int32(1)]),
        ] {
            let err = check_key(&bad).expect_err("refused");
            assert!(err.to_string().contains("cannot be used"), "{err}");
        }
        for good in [
            Bson::String("$home".into()),
            Bson::Document(doc! { "user": 7, "day": "mon" }),
            Bson::Int64(5),
            Bson::ObjectId(mongodb::bson::oid::ObjectId::new()),
        ] {
            assert!(check_key(&good).is_ok(), "{good}");
        }
    }

    #[test]
    fn numbers_past_2_53_compare_exactly() {
        let two_53 = 1i64 << 53;
        assert!(same_key(&Bson::Double(two_53 as f64), &Bson::Int64(two_53)));
        assert!(!same_key(
            &Bson::Double(two_53 as f64),
            &Bson::Int64(two_53 + 1)
        ));
        assert!(!same_key(
            &Bson::Int64(two_53 + 1),
            &Bson::Double(two_53 as f64)
        ));
        // 2^63 as a double is past every int64: never i64::MAX.
        assert!(!same_key(
            &Bson::Double(2f64.powi(63)),
            &Bson::Int64(i64::MAX)
        ));
        assert!(same_key(
            &Bson::Double(-(2f64.powi(63))),
            &Bson::Int64(i64::MIN)
        ));
        assert!(same_key(&Bson::Double(f64::NAN), &Bson::Double(f64::NAN)));
        assert!(!same_key(&Bson::Double(0.5), &Bson::Int32(0)));
    }

    #[test]
    fn nested_numbers_compare_by_value_and_field_order_counts() {
        let a = Bson::Document(doc! { "u": 5i32, "at": { "day": 2.0f64, "h": [1i32, 0.5] } });
        let b = Bson::Document(doc! { "u": 5i64, "at": { "day": 2i32, "h": [1.0f64, 0.5] } });
        assert!(same_key(&a, &b));
        let other = Bson::Document(doc! { "u": 5i64, "at": { "day": 3i32, "h": [1i64, 0.5] } });
        assert!(!same_key(&a, &other));
        let reordered = Bson::Document(doc! { "at": { "day": 2i32, "h": [1i64, 0.5] }, "u": 5 });
        assert!(
            !same_key(&a, &reordered),
            "the server compares fields in order"
        );
        assert!(same_key(&Bson::Double(-0.0), &Bson::Int32(0)));
    }

    #[test]
    fn integers_of_every_width_and_integral_doubles() {
        assert_eq!(integer_value(&Bson::Int32(-4)), Some(-4));
        assert_eq!(integer_value(&Bson::Int64(1 << 40)), Some(1 << 40));
        assert_eq!(integer_value(&Bson::Double(12.0)), Some(12));
        assert_eq!(integer_value(&Bson::Double(1.5)), None);
        assert_eq!(integer_value(&Bson::Double(1e300)), None);
        assert_eq!(integer_value(&Bson::Double(f64::NAN)), None);
        assert_eq!(integer_value(&Bson::String("1".into())), None);
        assert_eq!(integer_value(&Bson::Null), None);
    }

    #[test]
    fn a_double_counter_takes_an_amount_only_while_counter_and_sum_are_exact() {
        let two_53 = 9_007_199_254_740_992.0_f64;
        assert!(double_takes(5.0, 1));
        assert!(double_takes(two_53 - 2.0, 1));
        assert!(!double_takes(two_53 - 1.0, 1), "the sum is 2^53");
        assert!(double_takes(two_53 - 1.0, -5));
        assert!(!double_takes(two_53, -1), "2^53 itself is not exact");
        assert!(double_takes(-(two_53 - 2.0), -1));
        assert!(!double_takes(-(two_53 - 1.0), -1));
        assert!(!double_takes(2.5, 1));
        assert!(!double_takes(f64::NAN, 1));
        assert!(!double_takes(f64::INFINITY, -1));
        assert!(
            !double_takes(0.0, 1 << 53),
            "the amount is not exact as a double"
        );
        assert_eq!(exact_double_range(3), Some((-(1 << 53), (1 << 53) - 3)));
        assert_eq!(exact_double_range(-3), Some((-(1 << 53) + 3, 1 << 53)));
        assert_eq!(exact_double_range(-(1 << 53)), None);
    }

    #[test]
    fn doubles_are_exact_strictly_below_two_to_the_53() {
        let two_53 = 9_007_199_254_740_992.0_f64;
        assert_eq!(
            integer_value(&Bson::Double(two_53 - 1.0)),
            Some(9_007_199_254_740_991)
        );
        assert_eq!(
            integer_value(&Bson::Double(-(two_53 - 1.0))),
            Some(-9_007_199_254_740_991)
        );
        // 2^53 + 1 rounds to 2^53: the double no longer says which it was.
        assert_eq!(integer_value(&Bson::Double(two_53)), None);
        assert_eq!(integer_value(&Bson::Double(-two_53)), None);
        assert_eq!(integer_value(&Bson::Double(two_53 * 2.0)), None);
        // Integers are exact at any width.
        assert_eq!(integer_value(&Bson::Int64(1 << 53)), Some(1 << 53));
    }

    #[test]
    fn ids_show_strings_as_themselves_and_the_rest_as_extended_json() {
        let oid = mongodb::bson::oid::ObjectId::new();
        assert_eq!(display_id(&Bson::String("docs".into())), "docs");
        assert_eq!(
            display_id(&Bson::String("a \"quoted\" id".into())),
            "a \"quoted\" id"
        );
        assert_eq!(
            display_id(&Bson::ObjectId(oid)),
            format!("{{\"$oid\":\"{}\"}}", oid.to_hex())
        );
        assert_eq!(display_id(&Bson::Int32(7)), "7");
        assert_eq!(display_id(&Bson::Int64(7)), "7");
        assert_eq!(display_id(&Bson::Double(1.5)), "1.5");
        assert_eq!(
            display_id(&Bson::Document(doc! { "a": 1, "b": "x" })),
            "{\"a\":1,\"b\":\"x\"}"
        );
        assert_eq!(display_id(&Bson::Null), "null");
    }
}
