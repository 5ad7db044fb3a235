//! The fold's reads of the events collection, by index ranges of numbers
//! on `{s: 1}`: whether a range holds any event, the backlog above the
//! watermark, and a range's sums per counter.
//!
//! Reads that decide what a pass folds use read concern `majority`: the
//! fold must never fold an event a failover could still roll back.

use std::collections::HashMap;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReadConcern;

use crate::document::{CanonicalKey, integer_value};
use crate::error::{Error, ErrorClass, Facts, Failure, FailureKind, RetryBudget};
use crate::ledger::field;
use crate::store::Store;

/// Runs `pipeline` on `collection` at read concern `majority` (retried
/// once on a transient failure) and collects its rows.
pub(super) async fn aggregate_all(
    store: &Store,
    collection: &Collection<Document>,
    pipeline: Vec<Document>,
    operation: &'static str,
) -> Result<Vec<Document>, Error> {
    let mut budget = RetryBudget::read_once(operation);
    let cursor = store
        .with_retry(&mut budget, || {
            collection
                .aggregate(pipeline.clone())
                .read_concern(ReadConcern::majority())
        })
        .await
        .map_err(Error::Server)?;
    cursor
        .try_collect()
        .await
        .map_err(|err| Error::Server(Failure::once(operation, err)))
}

/// The filter of the events numbered in `(from, to]` (`to`: no end).
fn range(from: i64, to: Option<i64>) -> Document {
    let mut numbers = doc! { "$gt": from };
    if let Some(to) = to {
        numbers.insert("$lte", to);
    }
    doc! { field::NUMBER: numbers }
}

/// Whether any event is numbered in `(from, to]` (one index seek on
/// `{s: 1}`).
pub(super) async fn any_in(
    store: &Store,
    events: &Collection<Document>,
    from: i64,
    to: i64,
) -> Result<bool, Error> {
    let pipeline = vec![
        doc! { "$match": range(from, Some(to)) },
        doc! { "$limit": 1 },
        doc! { "$project": { "_id": 1 } },
    ];
    Ok(
        !aggregate_all(store, events, pipeline, "ledger.fold.survey")
            .await?
            .is_empty(),
    )
}

/// The lowest number above `from` (`None` when no event waits): one index
/// seek on `{s: 1}`. A number that is not an integer (a fraction or a
/// Decimal128 written by hand) reads as the integer just below it, or as
/// `from + 1` when it cannot be read at all: an event waits there, and
/// the pass that folds its range reports it — it never hides the events
/// above it.
pub(super) async fn lowest_above(
    store: &Store,
    events: &Collection<Document>,
    from: i64,
) -> Result<Option<i64>, Error> {
    let pipeline = vec![
        doc! { "$match": range(from, None) },
        doc! { "$sort": { field::NUMBER: 1 } },
        doc! { "$limit": 1 },
        doc! { "$project": { field::NUMBER: 1 } },
    ];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.survey").await?;
    Ok(rows.first().map(|row| {
        let number = row.get(field::NUMBER);
        match number.and_then(integer_value) {
            Some(n) => n,
            // `as` saturates; a number above `from` is at least `from`.
            #[allow(clippy::cast_possible_truncation)]
            None => match number {
                Some(Bson::Double(d)) if d.is_finite() => (d.floor() as i64).max(from),
                _ => from.saturating_add(1),
            },
        }
    }))
}

/// The events above `from` (not folded yet): how many, and the lowest
/// number among them (one index range on `{s: 1}`: what arrived since the
/// last pass).
pub(super) async fn above(
    store: &Store,
    events: &Collection<Document>,
    from: i64,
) -> Result<(u64, Option<i64>), Error> {
    let number = format!("${}", field::NUMBER);
    let pipeline = vec![
        doc! { "$match": range(from, None) },
        doc! { "$group": { "_id": Bson::Null, "n": { "$sum": 1 }, "lo": { "$min": &number } } },
    ];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.backlog").await?;
    let Some(row) = rows.first() else {
        return Ok((0, None));
    };
    let count = row
        .get("n")
        .and_then(integer_value)
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(0);
    Ok((count, row.get("lo").and_then(integer_value)))
}

/// The highest number of any event (`None` without events): one index seek
/// on `{s: 1}` from its end.
pub(super) async fn highest_number(
    store: &Store,
    events: &Collection<Document>,
) -> Result<Option<i64>, Error> {
    let pipeline = vec![
        doc! { "$sort": { field::NUMBER: -1 } },
        doc! { "$limit": 1 },
        doc! { "$project": { field::NUMBER: 1 } },
    ];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.highest").await?;
    Ok(rows
        .first()
        .and_then(|row| row.get(field::NUMBER))
        .and_then(integer_value))
}

/// Every lane's lowest and highest number (`None` for a lane or a number
/// that is not one): one scan of the events, for converting a state of
/// tally 0.2.0.
pub(super) async fn lanes_span(
    store: &Store,
    events: &Collection<Document>,
) -> Result<
    Vec<(
        Option<mongodb::bson::oid::ObjectId>,
        Option<i64>,
        Option<i64>,
    )>,
    Error,
> {
    let number = format!("${}", field::NUMBER);
    let pipeline = vec![doc! { "$group": {
        "_id": format!("${}", field::LANE),
        "lo": { "$min": &number },
        "hi": { "$max": &number },
    } }];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.convert").await?;
    Ok(rows
        .iter()
        .map(|row| {
            let number = |name| row.get(name).and_then(integer_value);
            (row.get_object_id("_id").ok(), number("lo"), number("hi"))
        })
        .collect())
}

/// The lowest number above `above` on `lane`, if any.
pub(super) async fn first_above(
    store: &Store,
    events: &Collection<Document>,
    lane: mongodb::bson::oid::ObjectId,
    above: i64,
) -> Result<Option<i64>, Error> {
    let pipeline = vec![
        doc! { "$match": { field::LANE: lane, field::NUMBER: { "$gt": above } } },
        doc! { "$group": { "_id": Bson::Null, "lo": { "$min": format!("${}", field::NUMBER) } } },
    ];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.convert").await?;
    Ok(rows
        .first()
        .and_then(|row| row.get("lo"))
        .and_then(integer_value))
}

/// One counter's share of a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Share {
    /// The counter's key, as its first event gives it.
    pub(super) key: Bson,
    /// The sum of its events' amounts (integers only).
    pub(super) amount: i128,
    /// Its events, malformed ones included.
    pub(super) events: u64,
    /// Its events whose amount is not an integer (an integral double is
    /// one): reported, not counted.
    pub(super) malformed: u64,
}

/// The shares of the counters of the events numbered in `(from, to]`, added to
/// `shares` (keyed by the counter key's canonical bytes: the server's
/// `_id` equality). The server sums each counter's amounts and reports
/// their highest; where the sum or the highest is not an int32 or an
/// int64, that counter's events of the range are read and summed here
/// exactly. The two together see every amount that is not an int32 or an
/// int64: a double or a decimal turns the sum into one (so does a sum past
/// what `$sum` keeps exact: real MongoDB turns an int64 overflow into a
/// double), and `$sum` skips any other type but every other type sorts
/// above the numbers, so it is the highest. (The lowest would add only
/// `MinKey`, which `$sum` skips as well: the counter's sum is the same,
/// and an accumulator costs the test server a tenth of the pass.) `null`
/// and a missing amount are skipped by every accumulator: counted as
/// nothing, as the exact read counts them, and not reported here.
/// A server that refuses the `$group` itself (the test server answers an
/// int64 overflow with `InternalError`) has the whole range summed here:
/// one counter's events never stop the others'.
pub(super) async fn sum_range(
    store: &Store,
    events: &Collection<Document>,
    (from, to): (i64, i64),
    shares: &mut HashMap<CanonicalKey, Share>,
) -> Result<(), Error> {
    let amount = format!("${}", field::AMOUNT);
    let pipeline = vec![
        doc! { "$match": range(from, Some(to)) },
        doc! { "$group": {
            "_id": format!("${}", field::COUNTER),
            "n": { "$sum": &amount },
            "e": { "$sum": 1 },
            "hi": { "$max": &amount },
        } },
    ];
    let rows = match aggregate_all(store, events, pipeline, "ledger.fold.sum").await {
        Ok(rows) => rows,
        Err(err) if refused_by_the_server(&err) => {
            tracing::warn!(
                events = %events.name(),
                cause = %err,
                "the server refused to sum a pass's events; summing them one by one"
            );
            return sum_exactly(store, events, range(from, Some(to)), shares).await;
        }
        Err(err) => return Err(err),
    };
    for row in rows {
        let key = row.get("_id").cloned().unwrap_or(Bson::Null);
        let integral = |name| matches!(row.get(name), Some(Bson::Int32(_) | Bson::Int64(_)));
        if !(integral("n") && integral("hi")) {
            let mut filter = range(from, Some(to));
            filter.extend(crate::write::at::by_id(field::COUNTER, &key));
            sum_exactly(store, events, filter, shares).await?;
            continue;
        }
        let events_of = row
            .get("e")
            .and_then(integer_value)
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(0);
        let share = share_of(shares, key);
        share.amount += i128::from(row.get("n").and_then(integer_value).unwrap_or(0));
        share.events += events_of;
    }
    Ok(())
}

/// Adds `events` (documents with a counter and an amount) to `shares`,
/// each as `sum_exactly` counts it.
pub(super) fn put_in(shares: &mut HashMap<CanonicalKey, Share>, events: &[Document]) {
    for event in events {
        let key = event.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
        count(share_of(shares, key), event, 1);
    }
}

/// Takes `events`, which `shares` counted, out of it again (a counter left
/// with no event goes).
pub(super) fn take_out(shares: &mut HashMap<CanonicalKey, Share>, events: &[Document]) {
    for event in events {
        let key = event.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
        let bytes = CanonicalKey::of(&key);
        if let Some(share) = shares.get_mut(&bytes) {
            count(share, event, -1);
            if share.events == 0 {
                shares.remove(&bytes);
            }
        }
    }
}

/// Counts `event` into `share` (`sign` 1) or out of it (-1): the exact
/// read's conversion (`integer_value`), so the fold and `Ledger::value`
/// agree on every event — an integral double (what a shell or a JavaScript
/// driver writes for `2`) counts as its integer, anything else is left out
/// and reported.
fn count(share: &mut Share, event: &Document, sign: i8) {
    let step = |n: u64| {
        if sign > 0 { n + 1 } else { n.saturating_sub(1) }
    };
    share.events = step(share.events);
    match event.get(field::AMOUNT).and_then(integer_value) {
        Some(n) => share.amount += i128::from(sign) * i128::from(n),
        None => share.malformed = step(share.malformed),
    }
}

/// The share of `key` in `shares`, added empty when it is not there yet.
fn share_of(shares: &mut HashMap<CanonicalKey, Share>, key: Bson) -> &mut Share {
    shares
        .entry(CanonicalKey::of(&key))
        .or_insert_with(|| Share {
            key,
            amount: 0,
            events: 0,
            malformed: 0,
        })
}

/// Whether `err` is the server's definite answer to the command (`ok: 0`,
/// not a transient code) — not an outage, which summing event by event
/// would only meet again.
fn refused_by_the_server(err: &Error) -> bool {
    match err {
        Error::Server(failure) => {
            failure.class == ErrorClass::Command
                && matches!(Facts::of(&failure.source).kind, FailureKind::Command(_))
        }
        _ => false,
    }
}

/// Adds the events matching `filter` (a pass's range, maybe one
/// counter's) to `shares`, read event by event (through `{s}` or `{k, s}`)
/// and summed here exactly: the integer amounts counted, the others
/// counted as malformed and left out. Streams the cursor: a lane's whole
/// range is never held in memory.
async fn sum_exactly(
    store: &Store,
    events: &Collection<Document>,
    filter: Document,
    shares: &mut HashMap<CanonicalKey, Share>,
) -> Result<(), Error> {
    const OPERATION: &str = "ledger.fold.exact_sum";
    let mut budget = RetryBudget::read_once(OPERATION);
    let mut cursor = store
        .with_retry(&mut budget, || {
            events
                .find(filter.clone())
                .projection(doc! { field::COUNTER: 1, field::AMOUNT: 1 })
                .read_concern(ReadConcern::majority())
        })
        .await
        .map_err(Error::Server)?;
    while let Some(event) = cursor
        .try_next()
        .await
        .map_err(|err| Error::Server(Failure::once(OPERATION, err)))?
    {
        let key = event.get(field::COUNTER).cloned().unwrap_or(Bson::Null);
        count(share_of(shares, key), &event, 1);
    }
    Ok(())
}
