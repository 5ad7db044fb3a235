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
/// replication is unconfirmed (the book: design/errors.md): with a transient code or the
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

/// Whether a counter `value` cannot take `amount` without passing the int64
/// limit — the rule of step 1's guard (`int64_room`): integers exactly, a
/// double by its value. Other types are not this rule's (malformed).
pub(crate) fn int64_overflow(value: &Bson, amount: i64) -> bool {
    const LIMIT: f64 = 9_223_372_036_854_775_808.0; // 2^63
    match value {
        Bson::Int32(v) => i64::from(*v).checked_add(amount).is_none(),
        Bson::Int64(v) => v.checked_add(amount).is_none(),
        Bson::Double(v) => {
            let sum = *v + amount as f64;
            !(-LIMIT..LIMIT).contains(&sum)
        }
        _ => false,
    }
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

/// Whether two keys name the same document as the server compares them
/// (see [`CanonicalKey`]).
pub(crate) fn same_key(a: &Bson, b: &Bson) -> bool {
    CanonicalKey::of(a) == CanonicalKey::of(b)
}

/// A counter key in the form the server compares `_id`s by, so that two
/// keys naming one document are equal (and hash alike) here too: numbers
/// by exact value across int32, int64, double and decimal (`5`,
/// `NumberLong(5)`, `5.0` and `NumberDecimal("5.00")` are one `_id`; the
/// double 2^53 and the int64 2^53 + 1 are two), inside documents and arrays
/// as well; strings by their bytes (no collation); anything else by its
/// BSON. A double that is no int64 is compared with decimals as the server
/// compares them: by its value rounded to a decimal's 34 significant
/// digits (the double 0.5 and `NumberDecimal("0.5")` are one `_id`, as are
/// 1e19 and `NumberDecimal("1E+19")`; the double 0.1, whose binary value
/// is not 0.1, and `NumberDecimal("0.1")` are two). Every NaN is one key,
/// and each infinity is one, whichever type holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum CanonicalKey {
    /// An integral number in the int64 range, whatever its type.
    Integer(i64),
    /// Not a number, double or decimal.
    NotANumber,
    /// An infinity, double or decimal.
    Infinity {
        /// Below zero.
        negative: bool,
    },
    /// Any other finite number (a double by its value rounded to 34
    /// significant digits), as its sign, its significant digits (no
    /// leading or trailing zero) and the exponent of the last one; `digits`
    /// holds a decimal's text when it does not read as a number.
    Decimal {
        /// Below zero.
        negative: bool,
        /// The significant digits.
        digits: String,
        /// The power of ten of the last digit.
        exponent: i64,
    },
    /// A string.
    Text(String),
    /// A document: its fields in order.
    Document(Vec<(String, CanonicalKey)>),
    /// An array: its elements in order.
    Array(Vec<CanonicalKey>),
    /// Anything else: its BSON encoding.
    Other(Vec<u8>),
}

impl CanonicalKey {
    /// The canonical form of `key`.
    pub(crate) fn of(key: &Bson) -> Self {
        match key {
            Bson::Int32(n) => Self::Integer(i64::from(*n)),
            Bson::Int64(n) => Self::Integer(*n),
            Bson::Double(d) => match exact_integer(*d) {
                Some(n) => Self::Integer(n),
                None if d.is_nan() => Self::NotANumber,
                None if d.is_infinite() => Self::Infinity { negative: *d < 0.0 },
                // Its value to a decimal's 34 digits, correctly rounded.
                None => decimal_key(&format!("{d:.33e}")),
            },
            Bson::Decimal128(d) => decimal_key(&d.to_string()),
            Bson::String(text) => Self::Text(text.clone()),
            Bson::Document(fields) => Self::Document(
                fields
                    .iter()
                    .map(|(name, value)| (name.clone(), Self::of(value)))
                    .collect(),
            ),
            Bson::Array(items) => Self::Array(items.iter().map(Self::of).collect()),
            other => {
                let mut bytes = Vec::new();
                let wrapped = doc! { "": other.clone() };
                // Writing a document to memory fails only for a value that
                // has no encoding; its text then stands for it.
                if wrapped.to_writer(&mut bytes).is_err() {
                    bytes = other.to_string().into_bytes();
                }
                Self::Other(bytes)
            }
        }
    }
}

/// An integral double in the int64 range, as that integer.
fn exact_integer(d: f64) -> Option<i64> {
    // -2^63 ≤ d < 2^63: `d as i64` is then exact, never saturated.
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    (d.fract() == 0.0 && (-TWO_63..TWO_63).contains(&d)).then_some(d as i64)
}

/// The canonical form of a decimal written as `text` (`-12.50E+3`, as the
/// bson crate shows one): an integer when it is one in the int64 range,
/// else its sign, significant digits and exponent.
fn decimal_key(text: &str) -> CanonicalKey {
    let not_finite = || CanonicalKey::Decimal {
        negative: false,
        digits: text.to_owned(),
        exponent: 0,
    };
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    match unsigned.to_ascii_lowercase().as_str() {
        "nan" => return CanonicalKey::NotANumber,
        "inf" | "infinity" => return CanonicalKey::Infinity { negative },
        _ => {}
    }
    let (mantissa, exponent) = match unsigned.split_once(['E', 'e']) {
        Some((m, e)) => match e.parse::<i64>() {
            Ok(e) => (m, e),
            Err(_) => return not_finite(),
        },
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return not_finite();
    }
    let all = format!("{whole}{fraction}");
    let mut exponent = exponent - fraction.len() as i64;
    let trimmed = all.trim_start_matches('0');
    let significant = trimmed.trim_end_matches('0');
    if significant.is_empty() {
        return CanonicalKey::Integer(0);
    }
    exponent += (trimmed.len() - significant.len()) as i64;
    if (0..=18).contains(&exponent) && significant.len() as i64 + exponent <= 19 {
        let magnitude = format!("{significant}{}", "0".repeat(exponent as usize));
        let signed = if negative {
            format!("-{magnitude}")
        } else {
            magnitude
        };
        if let Ok(n) = signed.parse::<i64>() {
            return CanonicalKey::Integer(n);
        }
    }
    CanonicalKey::Decimal {
        negative,
        digits: significant.to_owned(),
        exponent,
    }
}

/// A document id as reports, logs and alerts show it: a string id as
/// itself (`docs`), any other value as its relaxed extended JSON
/// (`{"$oid":"…"}`, `7`, `{"a":1}`), which a shell or a driver reads back.
///
/// Shown through [`shown`]: shortened past [`SHOWN_CHARS`] characters, its
/// control characters escaped.
pub(crate) fn display_id(id: &Bson) -> String {
    match id {
        Bson::String(text) => shown(text),
        other => shown(&other.clone().into_relaxed_extjson().to_string()),
    }
}

/// The most characters of a user's value a message shows.
pub(crate) const SHOWN_CHARS: usize = 200;

/// A user-supplied value (a key, an id) as a message shows it: its control
/// characters escaped (`\n`, `\u{1b}`), so that no value drives the
/// terminal, and past [`SHOWN_CHARS`] characters cut to a prefix followed by
/// `… (N bytes)`, N the value's whole length. JSON output shows values
/// whole instead (JSON escapes control characters itself).
pub(crate) fn shown(text: &str) -> String {
    let mut out = String::new();
    let mut count = 0;
    for c in text.chars() {
        let piece: String = if c.is_control() {
            c.escape_default().collect()
        } else {
            c.to_string()
        };
        count += piece.chars().count();
        if count > SHOWN_CHARS {
            out.push_str(&format!("… ({} bytes)", text.len()));
            break;
        }
        out.push_str(&piece);
    }
    out
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

    /// One document, one key: numbers of every type by value, at every
    /// depth, so one counter is never queued as two.
    #[test]
    fn a_keys_canonical_form_compares_numbers_by_value_at_every_depth() {
        use mongodb::bson::Decimal128;
        let decimal = |text: &str| Bson::Decimal128(text.parse::<Decimal128>().unwrap());
        let five = CanonicalKey::of(&Bson::Int32(5));
        for same in [
            Bson::Int64(5),
            Bson::Double(5.0),
            decimal("5"),
            decimal("5.00"),
            decimal("0.5E+1"),
        ] {
            assert_eq!(CanonicalKey::of(&same), five, "{same}");
        }
        assert_ne!(CanonicalKey::of(&decimal("5.5")), five);
        // Doubles and decimals that are no int64, by value as the server
        // compares them (a double to a decimal's 34 digits).
        for (double, text) in [
            (0.5, "0.5"),
            (-0.25, "-0.250"),
            (1e19, "1E+19"),
            (-1e19, "-10000000000000000000"),
            (2f64.powi(100), "1267650600228229401496703205376"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(
                CanonicalKey::of(&Bson::Double(double)),
                CanonicalKey::of(&decimal(text)),
                "{double} and {text}"
            );
        }
        assert_ne!(
            CanonicalKey::of(&Bson::Double(0.1)),
            CanonicalKey::of(&decimal("0.1"))
        );
        assert_eq!(
            CanonicalKey::of(&Bson::Double(0.1)),
            CanonicalKey::of(&decimal("0.1000000000000000055511151231257827"))
        );
        assert_ne!(
            CanonicalKey::of(&Bson::Double(f64::INFINITY)),
            CanonicalKey::of(&Bson::Double(f64::NEG_INFINITY))
        );
        assert_eq!(
            CanonicalKey::of(&decimal("5.50")),
            CanonicalKey::of(&decimal("55E-1"))
        );
        assert_eq!(
            CanonicalKey::of(&Bson::Double(-0.0)),
            CanonicalKey::of(&Bson::Int32(0))
        );
        let nested = |n: Bson| Bson::Document(doc! { "user": n.clone(), "tags": [n, "x"] });
        assert_eq!(
            CanonicalKey::of(&nested(Bson::Int32(7))),
            CanonicalKey::of(&nested(Bson::Double(7.0)))
        );
        assert_ne!(
            CanonicalKey::of(&nested(Bson::Int32(7))),
            CanonicalKey::of(&nested(Bson::Int32(8)))
        );
        // Field order matters to the server, and so it does here.
        assert_ne!(
            CanonicalKey::of(&Bson::Document(doc! { "a": 1, "b": 2 })),
            CanonicalKey::of(&Bson::Document(doc! { "b": 2, "a": 1 }))
        );
        let oid = mongodb::bson::oid::ObjectId::new();
        assert_eq!(
            CanonicalKey::of(&Bson::ObjectId(oid)),
            CanonicalKey::of(&Bson::ObjectId(oid))
        );
        assert_ne!(
            CanonicalKey::of(&Bson::ObjectId(oid)),
            CanonicalKey::of(&Bson::String(oid.to_hex()))
        );
        assert!(same_key(&decimal("5"), &Bson::Int64(5)));
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

    #[test]
    fn shown_values_are_short_and_never_drive_the_terminal() {
        assert_eq!(shown("a\nb\u{1b}[31mc\t"), "a\\nb\\u{1b}[31mc\\t");
        let long = "é".repeat(50_000);
        let cut = shown(&long);
        assert_eq!(cut, format!("{}… (100000 bytes)", "é".repeat(SHOWN_CHARS)));
        assert_eq!(shown(&"a".repeat(SHOWN_CHARS)), "a".repeat(SHOWN_CHARS));
        assert_eq!(
            display_id(&Bson::String("\u{7}".repeat(300))),
            format!("{}… (300 bytes)", r"\u{7}".repeat(SHOWN_CHARS / 5))
        );
    }
}
