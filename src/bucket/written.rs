//! Times as people write them: RFC 3339 with an offset, or a date.

use jiff::Timestamp;
use jiff::civil::{Date, Time};
use jiff::tz::Offset;

use super::{BucketError, Buckets};

/// What a time's text said.
pub(super) enum Written {
    /// A date alone: its start in the buckets' zone.
    Date(Date),
    /// An instant.
    Instant(Timestamp),
}

const WHAT_TO_WRITE: &str = "write RFC 3339 with an offset (2026-11-28T14:30:00Z, \
                             2026-11-28T15:30:00+01:00) or a date (2026-11-28)";

impl Buckets {
    /// `at` as RFC 3339 with the offset these buckets' zone has then, to
    /// the second (to the microsecond when it has a fraction: an event's
    /// number): how tally prints a bucket's start
    /// (`2026-03-29T00:00:00+01:00`), which [`Buckets::parse_time`] reads
    /// back. An instant outside the calendar's range shows as UTC.
    ///
    /// ```
    /// use tally::{BucketWidth, Buckets};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")?;
    /// let start = days.parse_time("2026-03-29")?;
    /// assert_eq!(days.show_time(start), "2026-03-29T00:00:00+01:00");
    /// assert_eq!(days.parse_time(&days.show_time(start))?, start);
    /// let number = start + std::time::Duration::from_micros(1_250);
    /// assert_eq!(days.show_time(number), "2026-03-29T00:00:00.001250+01:00");
    /// assert_eq!(days.parse_time(&days.show_time(number))?, number);
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn show_time(&self, at: std::time::SystemTime) -> String {
        let Ok(instant) = Timestamp::try_from(at) else {
            return humantime::format_rfc3339_seconds(at).to_string();
        };
        let offset = self.zone.to_offset(instant);
        let local = offset.to_datetime(instant);
        let seconds = offset.seconds();
        let sign = if seconds < 0 { '-' } else { '+' };
        let seconds = seconds.unsigned_abs();
        let micros = local.subsec_nanosecond() / 1_000;
        let fraction = if micros == 0 {
            String::new()
        } else {
            format!(".{micros:06}")
        };
        format!(
            "{}T{:02}:{:02}:{:02}{fraction}{sign}{:02}:{:02}",
            local.date(),
            local.hour(),
            local.minute(),
            local.second(),
            seconds / 3600,
            seconds / 60 % 60
        )
    }
}

/// Reads `text` (surrounding spaces allowed).
pub(super) fn parse(text: &str) -> Result<Written, BucketError> {
    let bad = |reason: String| BucketError::BadTime {
        text: text.to_owned(),
        reason,
    };
    let mut cursor = Cursor(text.trim().as_bytes());
    let (year, month, day) = cursor.date().ok_or_else(|| bad(WHAT_TO_WRITE.into()))?;
    let date = calendar_date(year, month, day).map_err(bad)?;
    if cursor.0.is_empty() {
        return Ok(Written::Date(date));
    }
    let (hour, minute, second, nanos) = cursor.time().ok_or_else(|| bad(WHAT_TO_WRITE.into()))?;
    // A leap second (23:59:60) counts as the second before it, as
    // jiff and Temporal read it.
    let time = Time::new(hour, minute, second.min(59), nanos).map_err(|_| {
        bad(format!(
            "{hour:02}:{minute:02}:{second:02} is not a time of day"
        ))
    })?;
    let offset = match cursor.offset() {
        Some(offset) => offset,
        None if cursor.0.is_empty() => {
            return Err(bad(format!(
                "it has no offset: add one, as in \"{}Z\" or \"{}+01:00\" (or write the date \
                 alone for the start of that day)",
                text.trim(),
                text.trim()
            )));
        }
        None => return Err(bad(WHAT_TO_WRITE.into())),
    };
    let offset = offset.map_err(bad)?;
    if !cursor.0.is_empty() {
        return Err(bad(WHAT_TO_WRITE.into()));
    }
    offset
        .to_timestamp(date.to_datetime(time))
        .map(Written::Instant)
        .map_err(|_| BucketError::OutOfRange)
}

/// `year-month-day` as a date of the calendar, or why it is none.
fn calendar_date(year: i16, month: i8, day: i8) -> Result<Date, String> {
    if !(1..=12).contains(&month) {
        return Err(format!("there is no month {month:02}"));
    }
    Date::new(year, month, day).map_err(|_| format!("{year:04}-{month:02} has no day {day:02}"))
}

/// The unread rest of a time's text.
struct Cursor<'t>(&'t [u8]);

impl Cursor<'_> {
    /// `n` digits as a number.
    fn digits(&mut self, n: usize) -> Option<i32> {
        let (head, rest) = self.0.split_at_checked(n)?;
        if !head.iter().all(u8::is_ascii_digit) {
            return None;
        }
        self.0 = rest;
        Some(head.iter().fold(0, |n, d| n * 10 + i32::from(d - b'0')))
    }

    /// One of `bytes`, which it returns.
    fn one_of(&mut self, bytes: &[u8]) -> Option<u8> {
        let (&first, rest) = self.0.split_first()?;
        bytes.contains(&first).then(|| {
            self.0 = rest;
            first
        })
    }

    /// `YYYY-MM-DD`.
    fn date(&mut self) -> Option<(i16, i8, i8)> {
        let year = self.digits(4)?;
        self.one_of(b"-")?;
        let month = self.digits(2)?;
        self.one_of(b"-")?;
        let day = self.digits(2)?;
        Some((year as i16, month as i8, day as i8))
    }

    /// `Thh:mm:ss` with an optional fraction (nanoseconds; further
    /// digits are dropped).
    fn time(&mut self) -> Option<(i8, i8, i8, i32)> {
        self.one_of(b"Tt ")?;
        let hour = self.digits(2)?;
        self.one_of(b":")?;
        let minute = self.digits(2)?;
        self.one_of(b":")?;
        let second = self.digits(2)?;
        let mut nanos = 0;
        if self.one_of(b".").is_some() {
            let count = self.0.iter().take_while(|b| b.is_ascii_digit()).count();
            if count == 0 {
                return None;
            }
            let kept = count.min(9);
            nanos = self.digits(kept)? * 10i32.pow(9 - kept as u32);
            self.digits(count - kept);
        }
        Some((hour as i8, minute as i8, second as i8, nanos))
    }

    /// `Z` or `±hh:mm`: `None` when there is none, `Some(Err(why))`
    /// when it is no UTC offset.
    fn offset(&mut self) -> Option<Result<Offset, String>> {
        let sign = self.one_of(b"Zz+-")?;
        if sign.eq_ignore_ascii_case(&b'z') {
            return Some(Ok(Offset::UTC));
        }
        let shape = || "write an offset as Z, +hh:mm or -hh:mm".to_owned();
        let Some(hours) = self.digits(2) else {
            return Some(Err(shape()));
        };
        let (Some(_), Some(minutes)) = (self.one_of(b":"), self.digits(2)) else {
            return Some(Err(shape()));
        };
        if hours > 23 || minutes > 59 {
            return Some(Err(format!(
                "{}{hours:02}:{minutes:02} is not a UTC offset",
                sign as char
            )));
        }
        let seconds = (hours * 3600 + minutes * 60) * if sign == b'-' { -1 } else { 1 };
        Some(Offset::from_seconds(seconds).map_err(|_| shape()))
    }
}
