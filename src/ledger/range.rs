//! Range reads of a bucketed ledger: a key's buckets from one time to
//! another, each read exactly (its counter plus its events not folded yet),
//! all from one consistent reading, and summed by a coarser width on
//! request.

use std::time::SystemTime;

use mongodb::bson::Bson;

use super::Ledger;
use super::read::{Span, Which};
use crate::bucket::{BucketWidth, Buckets};
use crate::document::display_id;
use crate::error::Error;
use crate::write::at::bucket_id;

/// The most buckets one range read reads: a year of hours, five weeks of
/// minutes.
pub const MAX_RANGE_BUCKETS: usize = 10_000;

/// A key's buckets in a range, read exactly.
///
/// ```no_run
/// # async fn demo(views: tally::Ledger, from: std::time::SystemTime, to: std::time::SystemTime) -> Result<(), tally::Error> {
/// let read = views.values_between("home", from, to, None).await?;
/// for bucket in &read.buckets {
///     println!("{:?}: {}", bucket.start, bucket.value);
/// }
/// println!("total {}", read.total);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeValue {
    /// The key (plain, not a bucket's `_id`).
    pub key: Bson,
    /// The range's start, as asked.
    pub from: SystemTime,
    /// The range's end (excluded), as asked.
    pub to: SystemTime,
    /// The width of `buckets`: the collection's, or the coarser one asked.
    pub by: BucketWidth,
    /// The sum of every bucket's value.
    pub total: i64,
    /// Every bucket that starts in `[from, to)`, in order, with those
    /// never counted (0).
    pub buckets: Vec<BucketValue>,
}

/// One bucket of a [`RangeValue`].
///
/// ```no_run
/// # fn demo(bucket: tally::BucketValue) {
/// let state = if bucket.closed { "closed" } else { "open" };
/// println!("{:?}: {} ({state})", bucket.start, bucket.value);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketValue {
    /// The bucket's start.
    pub start: SystemTime,
    /// Every event recorded in it, once: its counter plus its events not
    /// folded yet.
    pub value: i64,
    /// How many of its recorded events are not in its counter yet.
    pub unfolded_events: u64,
    /// It is final: a reconcile run closed it, or it is past its closing
    /// time with nothing in it (a coarser bucket: every bucket in it is).
    pub closed: bool,
}

impl Ledger {
    /// The buckets of `key` that start in `[from, to)`, each read exactly
    /// (the counter plus its recorded events not folded yet, as
    /// [`Ledger::value`] reads one), from one consistent reading; with
    /// `by`, summed into the coarser buckets of that width (a month of
    /// day buckets, in the collection's time zone). Refused
    /// ([`Error::InvalidArgument`]) for a collection without buckets, a
    /// `from` not before `to`, a `by` finer than the collection's buckets,
    /// or a range of more than [`MAX_RANGE_BUCKETS`] buckets.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Ledger) -> Result<(), Box<dyn std::error::Error>> {
    /// use tally::BucketWidth;
    ///
    /// let days = views.spec().buckets.clone().expect("a bucketed collection");
    /// let (from, to) = (days.parse_time("2026-11-01")?, days.parse_time("2026-12-01")?);
    /// let november = views.values_between("home", from, to, Some(BucketWidth::Month)).await?;
    /// println!("November: {}", november.total);
    /// # Ok(()) }
    /// ```
    pub async fn values_between(
        &self,
        key: impl Into<Bson>,
        from: SystemTime,
        to: SystemTime,
        by: Option<BucketWidth>,
    ) -> Result<RangeValue, Error> {
        let key = key.into();
        crate::document::check_key(&key)?;
        let buckets = self.range_buckets(from, to)?;
        let coarser = match by {
            Some(width) => Some(buckets.by(width).map_err(|err| self.refused(&err))?),
            None => None,
        };
        let starts: Vec<SystemTime> = buckets
            .starts(from, to)
            .map_err(|err| self.refused(&err))?
            .take(MAX_RANGE_BUCKETS + 1)
            .collect();
        if starts.len() > MAX_RANGE_BUCKETS {
            return Err(Error::InvalidArgument(format!(
                "the range holds more than {MAX_RANGE_BUCKETS} {} buckets: nothing was read; \
                 read a shorter range, in parts",
                buckets.width()
            )));
        }
        let ids = starts
            .iter()
            .map(|start| bucket_id(key.clone(), *start))
            .collect();
        let values = if starts.is_empty() {
            Vec::new()
        } else {
            let span = Span {
                key: &key,
                from: starts[0],
                to: buckets
                    .end_of(starts[starts.len() - 1])
                    .map_err(|err| self.refused(&err))?,
            };
            let counters = Which {
                keys: ids,
                span: Some(span),
            };
            self.exact(counters).await?
        };
        let now = SystemTime::now();
        let mut read: Vec<BucketValue> = Vec::new();
        for (start, value) in starts.into_iter().zip(values) {
            // Final: closed by a run, or past its closing time with
            // nothing in it (no write can land, nothing is left to close).
            let empty = value.value == 0 && value.folded == 0 && value.unfolded_events == 0;
            let closed = value.closed
                || (empty && buckets.closes_at(start).is_ok_and(|closes| closes <= now));
            let start = match &coarser {
                Some(coarser) => coarser.start_of(start).map_err(|err| self.refused(&err))?,
                None => start,
            };
            match read.last_mut() {
                Some(last) if last.start == start => {
                    last.value = last
                        .value
                        .checked_add(value.value)
                        .ok_or_else(|| too_large(&key))?;
                    last.unfolded_events += value.unfolded_events;
                    last.closed &= closed;
                }
                _ => read.push(BucketValue {
                    start,
                    value: value.value,
                    unfolded_events: value.unfolded_events,
                    closed,
                }),
            }
        }
        let total = read
            .iter()
            .try_fold(0_i64, |total, bucket| total.checked_add(bucket.value))
            .ok_or_else(|| too_large(&key))?;
        Ok(RangeValue {
            key,
            from,
            to,
            by: coarser.as_ref().unwrap_or(buckets).width(),
            total,
            buckets: read,
        })
    }

    /// The collection's buckets, for a range `[from, to)`.
    fn range_buckets(&self, from: SystemTime, to: SystemTime) -> Result<&Buckets, Error> {
        let Some(buckets) = &self.spec.buckets else {
            return Err(Error::InvalidArgument(format!(
                "collection {} has no buckets, so it has no range to read: nothing was read; \
                 read its key's one counter, or give the collection a bucket",
                self.spec.name
            )));
        };
        if from >= to {
            return Err(Error::InvalidArgument(format!(
                "the range's start {} is not before its end {}: nothing was read",
                buckets.show_time(from),
                buckets.show_time(to)
            )));
        }
        Ok(buckets)
    }

    /// A bucket error as a refused argument.
    fn refused(&self, err: &crate::bucket::BucketError) -> Error {
        Error::InvalidArgument(format!(
            "collection {}: {err}: nothing was read",
            self.spec.name
        ))
    }
}

fn too_large(key: &Bson) -> Error {
    Error::ExactValueTooLarge {
        key: display_id(key),
    }
}
