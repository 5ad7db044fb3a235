//! Time buckets: which minute, hour, day or month of a time zone an instant
//! falls in, where that bucket starts and ends, and the times people write
//! for them.
//!
//! A bucketed counter is kept per key and per bucket, so every writer must
//! compute the same bucket for the same instant. The arithmetic is in the
//! zone's local time, with the [jiff] crate's copy of the IANA time zone
//! database, built into tally (not the host's `/usr/share/zoneinfo`):
//! writers on hosts whose system zone data differ still agree, and a change
//! to a zone's rules comes with a tally release.
//!
//! # The rules
//!
//! - A **day** starts at local midnight, so daylight-saving days have 23 or
//!   25 hours; a **month** starts at local midnight of its 1st.
//! - Where the clock jumps over midnight (Chile and Cuba spring forward at
//!   midnight), the day starts at the jump, the first instant of the day
//!   the clock shows. Where midnight happens twice (the clock set back
//!   across it, as in Newfoundland until 2010), the day starts the first
//!   time, and the instants after it belong to that day, though the clock
//!   set back shows the day before again. In one sentence: a day or a month
//!   starts at the first instant the clock reaches or passes its midnight.
//! - A **minute** or an **hour** is one of the local clock, at one UTC
//!   offset: where the offset changes the bucket ends, so the hour the
//!   clock repeats when it is set back is two buckets of an hour each, and
//!   an hour cut by a half-hour shift (Australia/Lord_Howe) is two buckets
//!   of half an hour.
//! - An instant exactly on a boundary belongs to the bucket it starts.
//!
//! Every bucket nests in one bucket of each coarser width, which is what
//! summing buckets into coarser ones ([`Buckets::by`]) rests on.
//!
//! Instants are [`SystemTime`]s, as elsewhere in the crate (the `now` a
//! fold is given, a held sum's age): what a caller has at hand
//! (`SystemTime::now()`), with no driver type in the arithmetic. A bucket
//! start is a whole second in every zone, so it converts to and from the
//! millisecond BSON Date a document stores exactly
//! (`bson::DateTime::from_system_time`, `to_system_time`).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use jiff::civil::{DateTime, Time};
use jiff::tz::{AmbiguousOffset, Offset, TimeZone};
use jiff::{SignedDuration, Span, Timestamp};

mod closing;
mod written;

pub use closing::CLOSED_FIELD;
pub(crate) use closing::DEFAULT_CLOSING_MARGIN;
#[cfg(feature = "daemon")]
pub(crate) use closing::closing_margin;

/// How long after its end a bucket takes writes when a collection does not
/// say: a day, for late events and retries.
pub(crate) const DEFAULT_CLOSE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How much time one bucket covers.
///
/// ```
/// use tally::BucketWidth;
///
/// let width: BucketWidth = "day".parse().expect("a width");
/// assert_eq!(width, BucketWidth::Day);
/// assert!(BucketWidth::Hour < BucketWidth::Day, "ordered finest first");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BucketWidth {
    /// A minute of the local clock.
    Minute,
    /// An hour of the local clock.
    Hour,
    /// A local day, from midnight to midnight (23 to 25 hours).
    Day,
    /// A calendar month, from local midnight of its 1st.
    Month,
}

impl BucketWidth {
    /// Every width, finest first.
    pub const ALL: [BucketWidth; 4] = [Self::Minute, Self::Hour, Self::Day, Self::Month];

    /// The name as configured and printed: `minute`, `hour`, `day` or
    /// `month`.
    ///
    /// ```
    /// use tally::BucketWidth;
    ///
    /// assert_eq!(BucketWidth::Month.as_str(), "month");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Month => "month",
        }
    }
}

impl fmt::Display for BucketWidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BucketWidth {
    type Err = BucketError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|width| width.as_str() == s)
            .ok_or_else(|| BucketError::UnknownWidth(s.to_owned()))
    }
}

/// Why a bucket setting, a time or a bucket sum was refused.
///
/// ```
/// use tally::{BucketError, BucketWidth, Buckets};
///
/// let days = Buckets::utc(BucketWidth::Day);
/// match days.parse_time("yesterday") {
///     Err(BucketError::BadTime { text, .. }) => assert_eq!(text, "yesterday"),
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BucketError {
    /// A width that is not `minute`, `hour`, `day` or `month`.
    #[error("unknown bucket width {0:?}: expected minute, hour, day or month")]
    UnknownWidth(String),
    /// A name the time zone database does not hold.
    #[error(
        "unknown time zone {0:?}: expected an IANA name such as UTC, Europe/Berlin or \
         America/New_York"
    )]
    UnknownTimeZone(String),
    /// A time that is neither RFC 3339 with an offset nor a date.
    #[error("{text:?} is not a time: {reason}")]
    BadTime {
        /// The text as given.
        text: String,
        /// What is wrong with it, and what to write instead.
        reason: String,
    },
    /// Buckets summed by a finer width than their own.
    #[error(
        "{width} buckets cannot be summed by {by}, which is finer: choose {}",
        or_list(&coarser_names(*width))
    )]
    FinerThanBuckets {
        /// The width asked for.
        by: BucketWidth,
        /// The buckets' own width.
        width: BucketWidth,
    },
    /// An instant too far from now for the calendar arithmetic (beyond the
    /// years -9999 to 9999).
    #[error("the time is outside the years -9999 to 9999 that buckets cover")]
    OutOfRange,
}

/// A counter collection's time buckets: their width, the IANA time zone
/// whose clock they follow, and how long after its end a bucket takes writes
/// (in the daemon's configuration: a `[[collections]]` entry's `bucket`,
/// `timezone` and `close_after`).
///
/// ```
/// use std::time::Duration;
/// use tally::{BucketWidth, Buckets};
///
/// let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")?;
/// // 2026-03-29, the day Berlin's clocks go forward, has 23 hours.
/// let start = days.parse_time("2026-03-29")?;
/// let end = days.end_of(start)?;
/// assert_eq!(end.duration_since(start)?, Duration::from_secs(23 * 3600));
/// assert_eq!(days.start_of(start + Duration::from_secs(3 * 3600))?, start);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Buckets {
    width: BucketWidth,
    zone: TimeZone,
    /// The zone's name as the database spells it.
    zone_name: String,
    close_after: Duration,
    /// How long after `close_after` the bucket is closed (see `closing`).
    closing_margin: Duration,
}

impl fmt::Debug for Buckets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buckets")
            .field("width", &self.width)
            .field("zone", &self.zone_name)
            .field("close_after", &self.close_after)
            .field("closing_margin", &self.closing_margin)
            .finish()
    }
}

impl PartialEq for Buckets {
    fn eq(&self, other: &Self) -> bool {
        let fields = |b: &Self| {
            (
                b.width,
                b.zone_name.clone(),
                b.close_after,
                b.closing_margin,
            )
        };
        fields(self) == fields(other)
    }
}

impl Eq for Buckets {}

impl Buckets {
    /// Buckets of `width` in the IANA time zone named `zone` (any case:
    /// `europe/berlin` is `Europe/Berlin`), taking writes a day after their end.
    ///
    /// ```
    /// use tally::{BucketError, BucketWidth, Buckets};
    ///
    /// let hours = Buckets::new(BucketWidth::Hour, "america/new_york")?;
    /// assert_eq!(hours.zone(), "America/New_York");
    /// assert!(matches!(
    ///     Buckets::new(BucketWidth::Hour, "Mars/Olympus"),
    ///     Err(BucketError::UnknownTimeZone(_))
    /// ));
    /// # Ok::<(), BucketError>(())
    /// ```
    pub fn new(width: BucketWidth, zone: &str) -> Result<Self, BucketError> {
        let found =
            TimeZone::get(zone).map_err(|_| BucketError::UnknownTimeZone(zone.to_owned()))?;
        let zone_name = found.iana_name().unwrap_or(zone).to_owned();
        Ok(Self {
            width,
            zone: found,
            zone_name,
            close_after: DEFAULT_CLOSE_AFTER,
            closing_margin: DEFAULT_CLOSING_MARGIN,
        })
    }

    /// Buckets of `width` in UTC, taking writes for a day after they end.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// assert_eq!(Buckets::utc(BucketWidth::Month).zone(), "UTC");
    /// ```
    pub fn utc(width: BucketWidth) -> Self {
        Self {
            width,
            zone: TimeZone::UTC,
            zone_name: "UTC".to_owned(),
            close_after: DEFAULT_CLOSE_AFTER,
            closing_margin: DEFAULT_CLOSING_MARGIN,
        }
    }

    /// The same buckets, taking writes for `close_after` after they end.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let minutes = Buckets::utc(BucketWidth::Minute).with_close_after(Duration::from_secs(3600));
    /// assert_eq!(minutes.close_after(), Duration::from_secs(3600));
    /// ```
    pub fn with_close_after(mut self, close_after: Duration) -> Self {
        self.close_after = close_after;
        self
    }

    /// How much time one bucket covers.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// assert_eq!(Buckets::utc(BucketWidth::Day).width(), BucketWidth::Day);
    /// ```
    pub fn width(&self) -> BucketWidth {
        self.width
    }

    /// The time zone's IANA name, as the database spells it.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "asia/kolkata")?;
    /// assert_eq!(days.zone(), "Asia/Kolkata");
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn zone(&self) -> &str {
        &self.zone_name
    }

    /// How long after its end a bucket stays open to late events and
    /// retries; then it takes no more writes, and a reconcile run closes it a
    /// margin later ([`Buckets::closes_at`]). Default: 24h.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets};
    ///
    /// assert_eq!(Buckets::utc(BucketWidth::Day).close_after(), Duration::from_secs(24 * 3600));
    /// ```
    pub fn close_after(&self) -> Duration {
        self.close_after
    }

    /// The start of the bucket holding `at`.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let hours = Buckets::utc(BucketWidth::Hour);
    /// let at = hours.parse_time("2026-11-28T14:30:15Z")?;
    /// assert_eq!(hours.start_of(at)?, hours.parse_time("2026-11-28T14:00:00Z")?);
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn start_of(&self, at: SystemTime) -> Result<SystemTime, BucketError> {
        system_time(self.bounds(timestamp(at)?)?.0)
    }

    /// The end of the bucket holding `at`: the next bucket's start.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let months = Buckets::utc(BucketWidth::Month);
    /// let leap_day = months.parse_time("2028-02-29T23:59:59Z")?;
    /// assert_eq!(months.end_of(leap_day)?, months.parse_time("2028-03-01")?);
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn end_of(&self, at: SystemTime) -> Result<SystemTime, BucketError> {
        system_time(self.bounds(timestamp(at)?)?.1)
    }

    /// A time as people write it: RFC 3339 with its offset
    /// (`2026-11-28T14:30:00Z`, `2026-11-28T15:30:00+01:00`; `t` or a space
    /// for `T`, `z` for `Z`), or a date `YYYY-MM-DD`, which means the start
    /// of that day in these buckets' zone (its local midnight, or where the
    /// clock jumps past it).
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "America/New_York")?;
    /// assert_eq!(days.parse_time("2026-11-28")?, days.parse_time("2026-11-28T05:00:00Z")?);
    /// assert!(days.parse_time("2026-11-28T00:00:00").is_err(), "no offset");
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn parse_time(&self, text: &str) -> Result<SystemTime, BucketError> {
        let instant = match written::parse(text)? {
            written::Written::Date(date) => self.first_reach(date.to_datetime(Time::midnight()))?,
            written::Written::Instant(instant) => instant,
        };
        system_time(instant)
    }

    /// The starts of the buckets that start in `[from, to)`, in order.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")?;
    /// let from = days.parse_time("2026-10-24")?;
    /// let to = days.parse_time("2026-10-27")?;
    /// let starts: Vec<_> = days.starts(from, to)?.collect();
    /// assert_eq!(starts.len(), 3, "the 24th, the 25th (25 hours) and the 26th");
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn starts(&self, from: SystemTime, to: SystemTime) -> Result<BucketStarts, BucketError> {
        let (from, to) = (timestamp(from)?, timestamp(to)?);
        let (start, end) = self.bounds(from)?;
        let next = if start == from { start } else { end };
        Ok(BucketStarts {
            buckets: self.clone(),
            next: Some(next).filter(|next| *next < to),
            to,
        })
    }

    /// The same collection's buckets summed by `width`: the start of the
    /// `width` bucket that holds one of these buckets is
    /// `by(width)?.start_of(start)`. Refused for a width finer than these
    /// buckets'.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "America/New_York")?;
    /// let months = days.by(BucketWidth::Month)?;
    /// let day = days.parse_time("2026-11-28")?;
    /// assert_eq!(months.start_of(day)?, days.parse_time("2026-11-01")?);
    /// assert!(days.by(BucketWidth::Hour).is_err());
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn by(&self, width: BucketWidth) -> Result<Buckets, BucketError> {
        if width < self.width {
            return Err(BucketError::FinerThanBuckets {
                by: width,
                width: self.width,
            });
        }
        Ok(Self {
            width,
            ..self.clone()
        })
    }

    /// The start and the end of the bucket holding `at`.
    fn bounds(&self, at: Timestamp) -> Result<(Timestamp, Timestamp), BucketError> {
        match self.width {
            BucketWidth::Minute | BucketWidth::Hour => self.clock_bounds(at),
            BucketWidth::Day | BucketWidth::Month => self.calendar_bounds(at),
        }
    }

    /// A minute or an hour of the local clock at `at`'s offset, cut where
    /// the offset changes.
    fn clock_bounds(&self, at: Timestamp) -> Result<(Timestamp, Timestamp), BucketError> {
        let offset = self.zone.to_offset(at);
        let local = offset.to_datetime(at);
        let (truncated, length) = match self.width {
            BucketWidth::Minute => (
                local.date().at(local.hour(), local.minute(), 0, 0),
                SignedDuration::from_mins(1),
            ),
            _ => (
                local.date().at(local.hour(), 0, 0, 0),
                SignedDuration::from_hours(1),
            ),
        };
        let next = truncated
            .checked_add(length)
            .map_err(|_| BucketError::OutOfRange)?;
        let mut start = at_offset(truncated, offset)?;
        let mut end = at_offset(next, offset)?;
        let through_at = at.checked_add(SignedDuration::from_nanos(1)).unwrap_or(at);
        if let Some(change) = self
            .zone
            .preceding(through_at)
            .map(|t| t.timestamp())
            .take_while(|t| *t > start)
            .find(|t| self.offset_changes_at(*t))
        {
            start = change;
        }
        if let Some(change) = self
            .zone
            .following(at)
            .map(|t| t.timestamp())
            .take_while(|t| *t < end)
            .find(|t| self.offset_changes_at(*t))
        {
            end = change;
        }
        Ok((start, end))
    }

    /// Whether the zone's UTC offset differs either side of the transition
    /// at `at` (some transitions change only a zone's abbreviation).
    fn offset_changes_at(&self, at: Timestamp) -> bool {
        match at.checked_sub(SignedDuration::from_nanos(1)) {
            Ok(before) => self.zone.to_offset(before) != self.zone.to_offset(at),
            Err(_) => true,
        }
    }

    /// A day or a month: from the first instant the clock reaches or passes
    /// its midnight to the first instant it reaches or passes the next's.
    fn calendar_bounds(&self, at: Timestamp) -> Result<(Timestamp, Timestamp), BucketError> {
        let local = self.zone.to_datetime(at).date();
        let mut first = match self.width {
            BucketWidth::Month => local.first_of_month(),
            _ => local,
        };
        let mut start = self.first_reach(first.to_datetime(Time::midnight()))?;
        loop {
            let next = match self.width {
                BucketWidth::Month => first.checked_add(Span::new().months(1)),
                _ => first.tomorrow(),
            }
            .map_err(|_| BucketError::OutOfRange)?;
            let end = self.first_reach(next.to_datetime(Time::midnight()))?;
            if end > at {
                return Ok((start, end));
            }
            // The clock was set back across midnight after `next` began:
            // `at` shows the day before again but belongs to `next`.
            (first, start) = (next, end);
        }
    }

    /// The first instant at which the zone's clock reads `local` or later.
    fn first_reach(&self, local: DateTime) -> Result<Timestamp, BucketError> {
        match self.zone.to_ambiguous_timestamp(local).offset() {
            AmbiguousOffset::Unambiguous { offset } => at_offset(local, offset),
            // The clock reads `local` twice: the first time.
            AmbiguousOffset::Fold { before, after } => {
                Ok(at_offset(local, before)?.min(at_offset(local, after)?))
            }
            // The clock jumps over `local`: the instant of the jump, which
            // lies in `(local - after, local - before]`.
            AmbiguousOffset::Gap { before, after } => {
                let (earliest, latest) = (at_offset(local, after)?, at_offset(local, before)?);
                let jump = self
                    .zone
                    .following(earliest)
                    .take_while(|t| t.timestamp() <= latest)
                    .find(|t| t.offset() == after)
                    .map(|t| t.timestamp());
                Ok(jump.unwrap_or(latest))
            }
        }
    }
}

/// The starts of the buckets in a range, in order
/// ([`Buckets::starts`]).
///
/// ```
/// use tally::{BucketWidth, Buckets};
///
/// let hours = Buckets::utc(BucketWidth::Hour);
/// let from = hours.parse_time("2026-11-28T10:30:00Z")?;
/// let to = hours.parse_time("2026-11-28T13:00:00Z")?;
/// let starts: Vec<_> = hours.starts(from, to)?.collect();
/// // 10:00 starts before `from`: 11:00 and 12:00.
/// assert_eq!(starts, [hours.parse_time("2026-11-28T11:00:00Z")?, hours.parse_time("2026-11-28T12:00:00Z")?]);
/// # Ok::<(), tally::BucketError>(())
/// ```
#[derive(Debug, Clone)]
pub struct BucketStarts {
    buckets: Buckets,
    next: Option<Timestamp>,
    to: Timestamp,
}

impl Iterator for BucketStarts {
    type Item = SystemTime;

    fn next(&mut self) -> Option<SystemTime> {
        let start = self.next.take()?;
        // A bucket whose end lies past the calendar's range is the last.
        self.next = self
            .buckets
            .bounds(start)
            .ok()
            .map(|(_, end)| end)
            .filter(|end| *end < self.to);
        system_time(start).ok()
    }
}

/// `local` read at `offset`.
fn at_offset(local: DateTime, offset: Offset) -> Result<Timestamp, BucketError> {
    offset
        .to_timestamp(local)
        .map_err(|_| BucketError::OutOfRange)
}

fn timestamp(at: SystemTime) -> Result<Timestamp, BucketError> {
    Timestamp::try_from(at).map_err(|_| BucketError::OutOfRange)
}

fn system_time(at: Timestamp) -> Result<SystemTime, BucketError> {
    SystemTime::try_from(at).map_err(|_| BucketError::OutOfRange)
}

/// The names of `width` and the widths coarser than it.
fn coarser_names(width: BucketWidth) -> Vec<&'static str> {
    BucketWidth::ALL
        .into_iter()
        .filter(|w| *w >= width)
        .map(BucketWidth::as_str)
        .collect()
}

/// `a`, `a or b`, `a, b or c`.
fn or_list(words: &[&str]) -> String {
    match words {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests;
