//! This host's clock against the server's, and the margin the
//! configuration leaves for the difference.
//!
//! A token's time is its writer's clock; the fold's cutoff is the server's
//! clock minus the grace. A writer whose clock lags the server's by `d`
//! makes tokens that look `d` older than they are, so the fold could take
//! one `d` early. The configuration leaves `grace − retry_horizon −
//! attempt_timeout` for that (a step 1 re-sent just inside the horizon may
//! still land for one more attempt): the [`Margin`] of each collection.
//!
//! The rule, shared by `tallyd doctor` and the daemon's `clock_skew`
//! alert: a skew (this host's clock minus the server's, either way, worst
//! case over the round trip of the `hello` that measured it) that uses more
//! than a quarter of the margin is worth a look ([`SkewLevel::Watch`]);
//! more than half is unsafe ([`SkewLevel::Unsafe`]) — the rest is what is
//! left for the writers this host does not see.

use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use humantime::format_duration;
use mongodb::bson::{Bson, Document};

use crate::config::Config;

/// A fixed amount this host's clock is pretended to be off by: a testing
/// aid (`--clock-offset`), so the skew checks can be seen to fire on one
/// machine. Written `10m` (ahead) or `-10m` (behind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClockOffset {
    behind: bool,
    by: Duration,
}

impl FromStr for ClockOffset {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (behind, amount) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.strip_prefix('+').unwrap_or(text)),
        };
        let by = humantime::parse_duration(amount.trim())
            .map_err(|err| format!("not a duration such as 10m or -90s ({err}): {text:?}"))?;
        Ok(Self { behind, by })
    }
}

/// This host's clock, moved by a [`ClockOffset`] when one is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Clock {
    offset: ClockOffset,
}

impl Clock {
    /// The system clock, moved by `offset`.
    pub(crate) fn with_offset(offset: ClockOffset) -> Self {
        Self { offset }
    }

    /// The time now, as this host's clock (moved by the offset) reads it.
    pub(crate) fn now(&self) -> SystemTime {
        let now = SystemTime::now();
        let moved = if self.offset.behind {
            now.checked_sub(self.offset.by)
        } else {
            now.checked_add(self.offset.by)
        };
        moved.unwrap_or(now)
    }
}

/// One measurement of this host's clock against the server's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Skew {
    /// This host's clock minus the server's, in seconds: positive when this
    /// host is ahead. Taken at the middle of the round trip.
    pub(crate) seconds: f64,
    /// How long the `hello` that measured it took: the server read its
    /// clock somewhere within it.
    pub(crate) round_trip: Duration,
}

impl Skew {
    /// The skew a `hello` reply shows: its `localTime` against this host's
    /// clock read when the request was `sent` and the reply `received`.
    /// `None` when the reply has no `localTime`.
    pub(crate) fn from_hello(
        sent: SystemTime,
        received: SystemTime,
        hello: &Document,
    ) -> Option<Self> {
        let Some(Bson::DateTime(server)) = hello.get("localTime") else {
            return None;
        };
        let round_trip = received.duration_since(sent).unwrap_or_default();
        let middle = sent + round_trip / 2;
        let seconds = signed_seconds(middle, server.to_system_time());
        Some(Self {
            seconds,
            round_trip,
        })
    }

    /// The largest the difference may be, either way: the skew plus half
    /// the round trip, plus the millisecond the server's clock is read to.
    pub(crate) fn worst_case(&self) -> Duration {
        let seconds = self.seconds.abs() + self.round_trip.as_secs_f64() / 2.0 + 0.001;
        Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
    }

    /// "this host's clock is 3s ahead of the server's (±1ms)".
    pub(crate) fn describe(&self) -> String {
        let by = Duration::try_from_secs_f64(self.seconds.abs()).unwrap_or(Duration::MAX);
        let direction = if self.seconds >= 0.0 {
            "ahead of"
        } else {
            "behind"
        };
        let error = round_to_millis(self.round_trip / 2 + Duration::from_millis(1));
        let by = round_to_millis(by);
        // Within what the measurement can tell, neither ahead nor behind
        // (compared as shown: never "1ms ahead (±1ms)").
        if by <= error {
            return format!(
                "this host's clock agrees with the server's (±{})",
                format_duration(error)
            );
        }
        format!(
            "this host's clock is {} {direction} the server's (±{})",
            format_duration(by),
            format_duration(error)
        )
    }
}

/// `a − b` in seconds, negative when `a` is earlier.
fn signed_seconds(a: SystemTime, b: SystemTime) -> f64 {
    match a.duration_since(b) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    }
}

fn round_to_millis(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().try_into().unwrap_or(u64::MAX))
}

/// The latest [`Skew`] the daemon measured, shared between the task that
/// measures it (the readiness probe) and the one that judges it.
#[derive(Debug, Clone, Default)]
pub(crate) struct LastSkew(Arc<Mutex<Option<Skew>>>);

impl LastSkew {
    /// Records a new measurement.
    pub(crate) fn set(&self, skew: Skew) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(skew);
    }

    /// The latest measurement, if any.
    pub(crate) fn get(&self) -> Option<Skew> {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How far writers' clocks may lag the server's before the daemon could
/// take something early, for one collection: the fold a token (`grace −
/// retry_horizon − attempt_timeout`) or the prune a lane entry a resume
/// still needs (`lane_ttl − lane_resume_horizon − attempt_timeout`),
/// whichever is tighter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Margin {
    /// The collection (or `[reconcile]` when none is configured).
    pub(crate) collection: String,
    /// The tighter of the two margins.
    pub(crate) margin: Duration,
    /// How the margin is made: "the fold: grace 15m − retry_horizon 3m −
    /// attempt_timeout 1m".
    pub(crate) made_of: String,
}

/// Every collection's margin (with no collection configured, the one
/// `[reconcile] grace` leaves), tightest first.
pub(crate) fn margins(config: &Config) -> Vec<Margin> {
    let horizon = config.writer.retry_horizon;
    let attempt = config.mongodb.attempt_timeout;
    let (ttl, resume) = (config.writer.lane_ttl, config.writer.lane_resume_horizon);
    let lanes = ttl.saturating_sub(resume).saturating_sub(attempt);
    let lanes_made_of = format!(
        "the prune of lane entries: lane_ttl {} − lane_resume_horizon {} − attempt_timeout {}",
        format_duration(ttl),
        format_duration(resume),
        format_duration(attempt)
    );
    let mut graces: Vec<(String, Duration)> = config
        .collections
        .iter()
        .map(|c| (c.name.clone(), config.fold_target(&c.name).grace))
        .collect();
    if graces.is_empty() {
        graces.push(("[reconcile]".to_owned(), config.reconcile.grace));
    }
    let mut margins: Vec<Margin> = graces
        .into_iter()
        .map(|(collection, grace)| {
            let fold = grace.saturating_sub(horizon).saturating_sub(attempt);
            let (margin, made_of) = if lanes < fold {
                (lanes, lanes_made_of.clone())
            } else {
                let made_of = format!(
                    "the fold: grace {} − retry_horizon {} − attempt_timeout {}",
                    format_duration(grace),
                    format_duration(horizon),
                    format_duration(attempt)
                );
                (fold, made_of)
            };
            Margin {
                collection,
                margin,
                made_of,
            }
        })
        .collect();
    margins.sort_by_key(|m| m.margin);
    margins
}

/// How much of a margin a skew uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SkewLevel {
    /// A quarter of the margin or less.
    Safe,
    /// More than a quarter, at most half: worth finding out why.
    Watch,
    /// More than half: too little is left for the writers' clocks.
    Unsafe,
}

/// The rule: more than half the margin is unsafe, more than a quarter is
/// worth watching.
pub(crate) fn judge(skew: Duration, margin: Duration) -> SkewLevel {
    if skew > margin / 2 {
        SkewLevel::Unsafe
    } else if skew > margin / 4 {
        SkewLevel::Watch
    } else {
        SkewLevel::Safe
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::{DateTime, doc};

    use super::*;

    #[test]
    fn more_than_a_quarter_is_watched_more_than_half_is_unsafe() {
        let margin = Duration::from_secs(800);
        assert_eq!(judge(Duration::ZERO, margin), SkewLevel::Safe);
        assert_eq!(judge(Duration::from_secs(200), margin), SkewLevel::Safe);
        assert_eq!(judge(Duration::from_secs(201), margin), SkewLevel::Watch);
        assert_eq!(judge(Duration::from_secs(400), margin), SkewLevel::Watch);
        assert_eq!(judge(Duration::from_secs(401), margin), SkewLevel::Unsafe);
        assert_eq!(
            judge(Duration::from_secs(1), Duration::ZERO),
            SkewLevel::Unsafe
        );
    }

    #[test]
    fn the_skew_is_taken_at_the_middle_of_the_round_trip() {
        let sent = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let received = sent + Duration::from_millis(200);
        // The server read its clock 10 s behind this host's middle.
        let server = sent + Duration::from_millis(100) - Duration::from_secs(10);
        let hello = doc! { "localTime": DateTime::from_system_time(server) };
        let skew = Skew::from_hello(sent, received, &hello).unwrap();
        assert!((skew.seconds - 10.0).abs() < 0.002, "{skew:?}");
        assert_eq!(skew.round_trip, Duration::from_millis(200));
        let worst = skew.worst_case();
        assert!(worst >= Duration::from_millis(10_100), "{worst:?}");
        assert!(worst <= Duration::from_millis(10_103), "{worst:?}");
        assert!(skew.describe().contains("ahead of"), "{}", skew.describe());
        assert!(Skew::from_hello(sent, received, &doc! {}).is_none());
    }

    #[test]
    fn a_skew_no_larger_than_its_error_as_shown_agrees() {
        // 1.4 ms ahead, ±1.3 ms: both show as 1ms.
        let skew = Skew {
            seconds: 0.0014,
            round_trip: Duration::from_micros(600),
        };
        assert_eq!(
            skew.describe(),
            "this host's clock agrees with the server's (±1ms)"
        );
        let skew = Skew {
            seconds: -0.0025,
            round_trip: Duration::from_micros(600),
        };
        assert_eq!(
            skew.describe(),
            "this host's clock is 2ms behind the server's (±1ms)"
        );
    }

    #[test]
    fn an_offset_moves_the_clock_either_way() {
        let ahead: ClockOffset = "10m".parse().unwrap();
        let behind: ClockOffset = "-90s".parse().unwrap();
        assert!("soon".parse::<ClockOffset>().is_err());
        let before = SystemTime::now();
        let moved = Clock::with_offset(ahead).now();
        assert!(moved >= before + Duration::from_secs(600));
        let moved = Clock::with_offset(behind).now();
        assert!(moved <= SystemTime::now() - Duration::from_secs(89));
    }
}
