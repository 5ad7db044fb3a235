//! When a bucket is closed: `close_after` past its end it takes no more
//! writes, and a margin later — once no write it accepted can still land —
//! it is closed, final and compact.
//!
//! A writer refuses a time whose bucket ended `close_after` ago or more, by
//! its own clock. A write accepted just before that line may still land
//! later: a two-step increment's step 1 is re-sent until `retry_horizon`,
//! each attempt lasting up to `attempt_timeout`, and its token is folded
//! only once it is older than the collection's grace; a lane's update is
//! re-sent until `lane_resume_horizon`. So the bucket is closed
//! `max(retry_horizon, lane_resume_horizon) + attempt_timeout + grace`
//! after that line — the **closing margin**. The grace on top of the
//! lanes' horizon is the writers' clock skew the closing tolerates, the
//! same the fold tolerates for tokens.

use std::time::{Duration, SystemTime};

use super::{BucketError, Buckets};

/// The field a closed bucket's document holds: the server time (a Date)
/// of the reconcile run that closed it. A bucketed counter document must
/// not use it for anything else.
pub const CLOSED_FIELD: &str = "closed";

/// The closing margin with every default: the lanes' resume horizon (23h)
/// plus an attempt (60s) plus the fold's grace (15m). Its parts live with
/// the writer, the store and the fold (this module names none of them);
/// `config`'s tests check it is made of them.
pub(crate) const DEFAULT_CLOSING_MARGIN: Duration = closing_margin(
    Duration::from_secs(3 * 60),
    Duration::from_secs(23 * 3600),
    Duration::from_secs(60),
    Duration::from_secs(15 * 60),
);

/// `max(retry_horizon, lane_resume_horizon) + attempt_timeout + grace`.
pub(crate) const fn closing_margin(
    retry_horizon: Duration,
    lane_resume_horizon: Duration,
    attempt_timeout: Duration,
    grace: Duration,
) -> Duration {
    let longer = if retry_horizon.as_nanos() > lane_resume_horizon.as_nanos() {
        retry_horizon
    } else {
        lane_resume_horizon
    };
    longer.saturating_add(attempt_timeout).saturating_add(grace)
}

impl Buckets {
    /// The same buckets, closed `margin` after they stop taking writes
    /// (`close_after` past their end). The daemon's configuration sets it
    /// from the writers' horizons and the collection's grace; set it the
    /// same way when folding from a service of your own.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let minutes = Buckets::utc(BucketWidth::Minute).with_closing_margin(Duration::from_secs(600));
    /// assert_eq!(minutes.closing_margin(), Duration::from_secs(600));
    /// ```
    pub fn with_closing_margin(mut self, margin: Duration) -> Self {
        self.closing_margin = margin;
        self
    }

    /// How long after it stops taking writes a bucket is closed: long
    /// enough for every write it accepted to have landed and been folded —
    /// `max(retry_horizon, lane_resume_horizon) + attempt_timeout + grace`.
    /// Default: those of the defaults, 23h 16m.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let margin = Buckets::utc(BucketWidth::Day).closing_margin();
    /// assert_eq!(margin, Duration::from_secs(23 * 3600 + 60 + 15 * 60));
    /// ```
    pub fn closing_margin(&self) -> Duration {
        self.closing_margin
    }

    /// When the bucket holding `at` is closed: its end, plus
    /// `close_after`, plus the closing margin.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let hours = Buckets::utc(BucketWidth::Hour)
    ///     .with_close_after(Duration::from_secs(3600))
    ///     .with_closing_margin(Duration::from_secs(1800));
    /// let at = hours.parse_time("2026-11-28T14:30:00Z")?;
    /// assert_eq!(hours.closes_at(at)?, hours.parse_time("2026-11-28T16:30:00Z")?);
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn closes_at(&self, at: SystemTime) -> Result<SystemTime, BucketError> {
        self.end_of(at)?
            .checked_add(self.close_after + self.closing_margin)
            .ok_or(BucketError::OutOfRange)
    }

    /// The line below which buckets are due to close at `now`: every bucket
    /// that starts before it ended `close_after` plus the closing margin
    /// ago or earlier (buckets are contiguous, so a bucket starting before
    /// the one that holds the instant `now − close_after − margin` ended
    /// at or before that instant). `None` before the epoch.
    pub(crate) fn due_before(&self, now: SystemTime) -> Result<Option<SystemTime>, BucketError> {
        match now.checked_sub(self.close_after + self.closing_margin) {
            Some(line) if line > SystemTime::UNIX_EPOCH => self.start_of(line).map(Some),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketWidth;

    fn at(days: &Buckets, text: &str) -> SystemTime {
        days.parse_time(text).expect("a time")
    }

    #[test]
    fn a_bucket_is_due_once_it_ended_close_after_and_the_margin_ago() {
        let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")
            .unwrap()
            .with_close_after(Duration::from_secs(3600))
            .with_closing_margin(Duration::from_secs(1800));
        // 2026-10-25 has 25 hours in Berlin; it ends at 2026-10-26 local
        // midnight, 23:00 UTC, and closes 1h30 later.
        let day = at(&days, "2026-10-25");
        let closes = at(&days, "2026-10-26T00:30:00Z");
        assert_eq!(days.closes_at(day).unwrap(), closes);
        // One second before: the day is not below the line yet.
        let before = days.due_before(closes - Duration::from_secs(1)).unwrap();
        assert_eq!(before, Some(day), "only the days before it are due");
        // At its closing time exactly, it is.
        let due = days.due_before(closes).unwrap();
        assert_eq!(due, Some(at(&days, "2026-10-26")));
        assert!(day < due.unwrap());
    }

    #[test]
    fn the_margin_is_the_longer_horizon_an_attempt_and_the_grace() {
        let steps_longer = closing_margin(
            Duration::from_secs(600),
            Duration::from_secs(60),
            Duration::from_secs(10),
            Duration::from_secs(1),
        );
        assert_eq!(steps_longer, Duration::from_secs(611));
    }
}
