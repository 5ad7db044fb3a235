//! A minted lane's numbers are times: the number `s` a lane sends is
//! `max(last + 1, now in microseconds since the Unix epoch)`, so the entry
//! a lane leaves in a counter tells when the lane last wrote it — no field
//! beside it, and the daemon prunes an entry not written for `lane_ttl`.
//!
//! A minted lane's entry at or above [`TIME_FLOOR`] (10^15 µs, September
//! 2001) is such a time. Below it, it is a count from tally 0.1's lane pool
//! (1, 2, 3, … per lane; also the ledger fold's batch numbers), whose age is
//! its lane's: the time in the lane's id.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mongodb::bson::oid::ObjectId;

use super::LaneId;

/// The least number that is a time (10^15 µs after the Unix epoch,
/// 2001-09-09); a smaller one is a count.
pub(crate) const TIME_FLOOR: i64 = 1_000_000_000_000_000;

/// `time` in microseconds since the Unix epoch (0 before it).
pub(crate) fn micros(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The time a minted lane's number stands for, when it is one.
pub(crate) fn time_of(position: i64) -> Option<SystemTime> {
    let micros = u64::try_from(position)
        .ok()
        .filter(|_| position >= TIME_FLOOR)?;
    UNIX_EPOCH.checked_add(Duration::from_micros(micros))
}

/// How old a minted lane's update at `position` is at `now`: from the time
/// the number holds, or — a count — from the lane's creation (the whole
/// seconds in its id, so never under-estimated). `None` for a named lane.
pub(crate) fn update_age(lane: &LaneId, position: i64, now: SystemTime) -> Option<Duration> {
    match (lane, time_of(position)) {
        (LaneId::Minted(_), Some(written)) => {
            Some(now.duration_since(written).unwrap_or(Duration::ZERO))
        }
        _ => lane.age(now),
    }
}

/// Whether a minted lane's entry holding `position` was last written
/// before `cutoff` (a prune's: the server's time minus `lane_ttl`, to the
/// second as `cutoff_id` says it): by the time it holds, or for a count
/// by the lane's creation.
pub(crate) fn written_before(lane: ObjectId, position: i64, cutoff_id: ObjectId) -> bool {
    match time_of(position) {
        Some(_) => {
            let cutoff = cutoff_id.timestamp().timestamp_millis() / 1000 * 1_000_000;
            position < cutoff
        }
        None => lane < cutoff_id,
    }
}

/// The numbers a handle's lanes send: one growing sequence for all of
/// them, each number a time (see the module's docs).
#[derive(Debug, Default)]
pub(crate) struct LaneNumbers {
    last: AtomicI64,
}

impl LaneNumbers {
    /// The next number at `now`: above every number handed out before, and
    /// at least `now` in microseconds.
    pub(crate) fn next(&self, now: SystemTime) -> i64 {
        let now = micros(now).max(TIME_FLOOR);
        let previous = self
            .last
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
                Some(last.saturating_add(1).max(now))
            })
            .expect("the update always returns a value");
        previous.saturating_add(1).max(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::Token;

    fn t0() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    #[test]
    fn a_number_is_the_time_unless_that_would_not_grow() {
        let numbers = LaneNumbers::default();
        let first = numbers.next(t0());
        assert_eq!(first, 1_700_000_000_000_000);
        assert_eq!(numbers.next(t0()), first + 1, "same microsecond");
        assert_eq!(
            numbers.next(t0() - Duration::from_secs(5)),
            first + 2,
            "a clock stepped back"
        );
        let later = numbers.next(t0() + Duration::from_secs(1));
        assert_eq!(later, first + 1_000_000);
        assert_eq!(time_of(later), Some(t0() + Duration::from_secs(1)));
    }

    #[test]
    fn an_updates_age_counts_from_its_time_or_a_counts_lane() {
        let old_lane = Token::created_at_time(t0() - Duration::from_secs(3600)).object_id();
        let lane = LaneId::Minted(old_lane);
        let written = micros(t0() - Duration::from_secs(60));
        assert_eq!(
            update_age(&lane, written, t0()),
            Some(Duration::from_secs(60))
        );
        assert_eq!(update_age(&lane, 7, t0()), Some(Duration::from_secs(3600)));
        let named = LaneId::Named(super::super::LaneName::new("orders:1").unwrap());
        assert_eq!(update_age(&named, written, t0()), None);
    }

    #[test]
    fn an_entry_is_written_before_the_cutoff_by_its_time_or_a_counts_lane() {
        let cutoff = Token::cutoff(t0());
        let young_lane = Token::created_at_time(t0() + Duration::from_secs(9)).object_id();
        let old_lane = Token::created_at_time(t0() - Duration::from_secs(9)).object_id();
        let just_before = micros(t0()) - 1;
        assert!(written_before(young_lane, just_before, cutoff));
        assert!(!written_before(old_lane, micros(t0()), cutoff));
        assert!(
            written_before(old_lane, 5, cutoff),
            "a count: the lane's age"
        );
        assert!(!written_before(young_lane, 5, cutoff));
    }
}
