//! The fold's reads of the events collection, by index ranges of lanes on
//! `{L: 1, s: 1}`: the survey of every lane at once (per lane, its highest
//! number above what was folded, with the backlog's count and oldest
//! number), and a range's sums per counter.
//!
//! Reads that decide what a pass folds use read concern `majority`: the
//! fold must never fold an event a failover could still roll back.

use std::collections::{BTreeMap, HashMap};

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ReadConcern;

use crate::document::{CanonicalKey, integer_value};
use crate::error::{Error, ErrorClass, Facts, Failure, FailureKind, RetryBudget};
use crate::store::Store;
use crate::write::ledger::field;

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

/// A lane's events above a number: how many, and the lowest and highest
/// numbers among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LaneSurvey {
    pub(super) events: u64,
    pub(super) lowest: i64,
    pub(super) highest: i64,
}

/// The filter of `lane`'s events numbered above `above` (all of them for
/// `None`) and at most `upto`.
fn range(lane: ObjectId, above: Option<i64>, upto: Option<i64>) -> Document {
    let mut numbers = Document::new();
    if let Some(above) = above {
        numbers.insert("$gt", above);
    }
    if let Some(upto) = upto {
        numbers.insert("$lte", upto);
    }
    let mut filter = doc! { field::LANE: lane };
    if !numbers.is_empty() {
        filter.insert(field::NUMBER, numbers);
    }
    filter
}

/// `lane`'s events above `above`; `None` when there are none.
pub(super) async fn survey_lane(
    store: &Store,
    events: &Collection<Document>,
    lane: ObjectId,
    above: Option<i64>,
) -> Result<Option<LaneSurvey>, Error> {
    let number = format!("${}", field::NUMBER);
    let pipeline = vec![
        doc! { "$match": range(lane, above, None) },
        doc! { "$group": {
            "_id": Bson::Null,
            "n": { "$sum": 1 },
            "lo": { "$min": &number },
            "hi": { "$max": &number },
        } },
    ];
    let rows = aggregate_all(store, events, pipeline, "ledger.fold.survey").await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let get = |name| row.get(name).and_then(integer_value);
    match (get("n"), get("lo"), get("hi")) {
        (Some(n), Some(lowest), Some(highest)) => Ok(Some(LaneSurvey {
            events: u64::try_from(n).unwrap_or(0),
            lowest,
            highest,
        })),
        _ => Err(Error::Malformed {
            collection: events.name().to_owned(),
            id: format!("lane {}", lane.to_hex()),
            reason: "its events' numbers s are not all integers".into(),
        }),
    }
}

/// Each of `lanes`' events above its folded number (all of a lane's for
/// `None`): per lane that has some, how many and their lowest and highest
/// numbers; a lane without such events is not in the map. One index range
/// per lane, sent at once: a single aggregate over every lane (an `$in`
/// and an `$or`) is one command, but a server that does not bound its index
/// scan by each branch — the test server — then reads every event the lanes
/// keep, folded ones included, which grows with the dedupe window.
pub(super) async fn survey_lanes(
    store: &Store,
    events: &Collection<Document>,
    lanes: &[(ObjectId, Option<i64>)],
) -> Result<BTreeMap<ObjectId, LaneSurvey>, Error> {
    let surveys = lanes.iter().map(|&(lane, above)| async move {
        Ok::<_, Error>(
            survey_lane(store, events, lane, above)
                .await?
                .map(|survey| (lane, survey)),
        )
    });
    Ok(futures::future::try_join_all(surveys)
        .await?
        .into_iter()
        .flatten()
        .collect())
}

/// How far back from `now` the survey first looks for a lane's newest
/// events, before it reads the lane's whole backlog.
const PROBES: [std::time::Duration; 3] = [
    std::time::Duration::from_millis(100),
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(10),
];

/// A number of an event visible on `lane` above `above`, as high as found
/// cheaply; `None` when the lane has no event above it (one command). Any visible number
/// will do as a pass's range end — every event below it is visible too —
/// so the events of the last moments (by their numbers: their recording
/// time) are read first, and only when there are none the whole backlog.
pub(super) async fn highest(
    store: &Store,
    events: &Collection<Document>,
    lane: ObjectId,
    above: Option<i64>,
    now: std::time::SystemTime,
) -> Result<Option<i64>, Error> {
    // A lane with nothing above `above` — most lanes, most passes — costs
    // one index seek.
    let any = vec![
        doc! { "$match": range(lane, above, None) },
        doc! { "$limit": 1 },
        doc! { "$project": { field::NUMBER: 1 } },
    ];
    if aggregate_all(store, events, any, "ledger.fold.survey")
        .await?
        .is_empty()
    {
        return Ok(None);
    }
    let number = format!("${}", field::NUMBER);
    for window in PROBES {
        let recent = crate::write::ledger::unix_micros(now.checked_sub(window).unwrap_or(now));
        let from = above.map_or(recent, |a| a.max(recent));
        let pipeline = vec![
            doc! { "$match": range(lane, Some(from), None) },
            doc! { "$group": { "_id": Bson::Null, "hi": { "$max": &number } } },
        ];
        let rows = aggregate_all(store, events, pipeline, "ledger.fold.survey").await?;
        if let Some(highest) = rows
            .first()
            .and_then(|row| row.get("hi"))
            .and_then(integer_value)
        {
            return Ok(Some(highest));
        }
    }
    Ok(survey_lane(store, events, lane, above)
        .await?
        .map(|survey| survey.highest))
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

/// The shares of the counters of `lane`'s events in `(from, to]`, added to
/// `shares` (keyed by the counter key's canonical bytes: the server's
/// `_id` equality). The server sums each counter's amounts and reports
/// their lowest and highest; where those are not all int32 or int64 — an
/// amount written by hand as a double or a string, or a sum past what
/// `$sum` keeps exact (real MongoDB turns an int64 overflow into a double)
/// — that counter's events of the range are read and summed here exactly.
/// A server that refuses the `$group` itself (the test server answers an
/// int64 overflow with `InternalError`) has the whole range summed here:
/// one counter's events never stop the others'.
pub(super) async fn sum_lane(
    store: &Store,
    events: &Collection<Document>,
    lane: ObjectId,
    (from, to): (i64, i64),
    shares: &mut HashMap<CanonicalKey, Share>,
) -> Result<(), Error> {
    let amount = format!("${}", field::AMOUNT);
    let pipeline = vec![
        doc! { "$match": range(lane, Some(from), Some(to)) },
        doc! { "$group": {
            "_id": format!("${}", field::COUNTER),
            "n": { "$sum": &amount },
            "e": { "$sum": 1 },
            "lo": { "$min": &amount },
            "hi": { "$max": &amount },
        } },
    ];
    let rows = match aggregate_all(store, events, pipeline, "ledger.fold.sum").await {
        Ok(rows) => rows,
        Err(err) if refused_by_the_server(&err) => {
            tracing::warn!(
                events = %events.name(),
                lane = %lane.to_hex(),
                cause = %err,
                "the server refused to sum a lane's events; summing them one by one"
            );
            return sum_exactly(store, events, range(lane, Some(from), Some(to)), shares).await;
        }
        Err(err) => return Err(err),
    };
    for row in rows {
        let key = row.get("_id").cloned().unwrap_or(Bson::Null);
        let integral = |name| matches!(row.get(name), Some(Bson::Int32(_) | Bson::Int64(_)));
        if !(integral("n") && integral("lo") && integral("hi")) {
            let mut filter = range(lane, Some(from), Some(to));
            filter.insert(field::COUNTER, key);
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

/// Adds the events matching `filter` (one lane's range, maybe one
/// counter's) to `shares`, read event by event (through `{L, s}` or `{k,
/// L, s}`) and summed here exactly: the integer amounts counted, the others
/// counted as malformed and left out. Streams the cursor: a lane's whole
/// backlog is never held in memory.
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
        let share = share_of(shares, key);
        share.events += 1;
        // The exact read's conversion (`integer_value`), so the fold and
        // `Ledger::value` agree on every event: an integral double (what a
        // shell or a JavaScript driver writes for `2`) counts as its
        // integer, anything else is left out and reported.
        match event.get(field::AMOUNT).and_then(integer_value) {
            Some(n) => share.amount += i128::from(n),
            None => share.malformed += 1,
        }
    }
    Ok(())
}
