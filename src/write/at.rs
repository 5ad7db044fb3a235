//! Writes that carry a time: the counter document a write of a bucketed
//! collection goes to (the book: design/buckets.md), and the times refused
//! before anything is sent.
//!
//! A collection with [`Buckets`] keeps a counter per key and per bucket,
//! in the document `{_id: {k: <key>, t: <bucket start, a Date>}}`. Every
//! protocol — the two-step increment, lanes with group commit, the ledger
//! and its fold — works on that `_id` as it works on a plain key: the
//! writer computes it once, from the event's time (now when none is
//! given), and passes it where the key goes. A token, a lane's ticket and
//! a recorded event carry the bucketed `_id`, so settling or folding them
//! later counts in the bucket the event happened in.
//!
//! Refused by the writer's clock, before anything is written (the event's
//! verdict — not counted, not recorded — never an error of the call; the
//! ledger first reads whether the event was recorded before, which makes
//! a repeat a duplicate whatever its time):
//! a time more than [`MAX_TIME_AHEAD`] ahead ([`Error::TimeAhead`]), and
//! a time whose bucket ended more than `close_after` ago
//! ([`Error::BucketClosed`]). A time given for a collection without
//! buckets is refused too ([`Error::InvalidArgument`]): it would be
//! dropped, and the caller counting by time has a configuration to fix.

use std::time::{Duration, SystemTime};

use mongodb::bson::{self, Bson, doc};

use super::counter::{CollectionConfig, Counters};
use super::lane::{LaneIncrement, LaneName};
use crate::bucket::Buckets;
use crate::error::Error;

mod filter;

pub(crate) use filter::{by_any, by_id};

/// How far ahead of the writer's clock an event's time may be: five
/// minutes, room for clocks that disagree a little. Further ahead, a clock
/// or a caller is wrong, and the count is refused ([`Error::TimeAhead`]).
///
/// ```
/// assert_eq!(tally::MAX_TIME_AHEAD.as_secs(), 300);
/// ```
pub const MAX_TIME_AHEAD: Duration = Duration::from_secs(5 * 60);

/// The field of a bucketed `_id` holding the key.
pub(crate) const KEY: &str = "k";
/// The field of a bucketed `_id` holding the bucket's start.
pub(crate) const START: &str = "t";

/// The `_id` a write of `key` at `at` (`None`: now) goes to in `spec`'s
/// collection, judged at `now`: `key` itself without buckets (a time given
/// is refused), else `{k: key, t: <bucket start>}`.
pub(crate) fn counter_id(
    spec: &CollectionConfig,
    key: Bson,
    at: Option<SystemTime>,
    now: SystemTime,
) -> Result<Bson, Error> {
    let Some(buckets) = &spec.buckets else {
        return match at {
            None => Ok(key),
            Some(_) => Err(Error::InvalidArgument(format!(
                "collection {} has no buckets, so a write cannot carry a time: nothing was sent; \
                 give its configuration a bucket (minute, hour, day or month), or write without \
                 a time",
                spec.name
            ))),
        };
    };
    let start = bucket_start(spec, buckets, at.unwrap_or(now), now)?;
    Ok(bucket_id(key, start))
}

/// The `_id` of `key`'s counter in the bucket that starts at `start`.
pub(crate) fn bucket_id(key: Bson, start: SystemTime) -> Bson {
    Bson::Document(doc! { KEY: key, START: bson::DateTime::from_system_time(start) })
}

/// The start of the bucket holding `at`, unless the writer's clock (`now`)
/// refuses it: further ahead than [`MAX_TIME_AHEAD`], or in a bucket closed
/// already.
fn bucket_start(
    spec: &CollectionConfig,
    buckets: &Buckets,
    at: SystemTime,
    now: SystemTime,
) -> Result<SystemTime, Error> {
    if let Ok(ahead) = at.duration_since(now)
        && ahead > MAX_TIME_AHEAD
    {
        return Err(Error::TimeAhead {
            at: buckets.show_time(at),
            ahead,
            bound: MAX_TIME_AHEAD,
        });
    }
    let out_of_range = |err: crate::bucket::BucketError| Error::InvalidArgument(err.to_string());
    let start = buckets.start_of(at).map_err(out_of_range)?;
    let end = buckets.end_of(at).map_err(out_of_range)?;
    if let Ok(ended_ago) = now.duration_since(end)
        && ended_ago >= buckets.close_after()
    {
        return Err(Error::BucketClosed {
            collection: spec.name.clone(),
            bucket: buckets.show_time(start),
            ended_ago,
            close_after: buckets.close_after(),
        });
    }
    Ok(start)
}

impl Counters {
    /// [`Counters::add`] in the bucket holding `at`, in a collection with
    /// [`CollectionConfig::buckets`]: one round trip through this handle's
    /// lane (with group commit) to the document `{_id: {k: key, t: <bucket
    /// start>}}`; `add` is this at now. Refused as
    /// [`Counters::increment_at`] refuses (a time far ahead, a closed
    /// bucket, a collection without buckets): [`LaneIncrement::NotCounted`],
    /// nothing sent.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::{Duration, SystemTime};
    /// use tally::LaneIncrement;
    ///
    /// // An event that happened ten minutes ago, counted in its minute.
    /// let at = SystemTime::now() - Duration::from_secs(600);
    /// if let LaneIncrement::NotCounted(not) = views.add_at("home", 1, at).await {
    ///     eprintln!("not counted: {}", not.cause());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn add_at(&self, key: impl Into<Bson>, amount: i64, at: SystemTime) -> LaneIncrement {
        self.add_timed(key.into(), amount, Some(at)).await
    }

    /// [`Counters::add_from`] in the bucket holding `at` — the message's
    /// own time (a Kafka record's timestamp), so that a message delivered
    /// again goes to the same bucket's document, whose lane entry knows its
    /// position: counted once. Refused as [`Counters::add_at`] refuses.
    /// In a bucketed collection a named lane must write with a time:
    /// `add_from` without one is refused there, since the same message
    /// delivered again after now's bucket changed would find no position in
    /// the next bucket's document and count twice.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters, offset: i64, timestamp: std::time::SystemTime) {
    /// use tally::{LaneIncrement, LaneName};
    ///
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// match views.add_from_at("home", 1, &lane, offset, timestamp).await {
    ///     LaneIncrement::Counted(_) | LaneIncrement::OutOfOrder(_) => { /* commit the offset */ }
    ///     LaneIncrement::Unknown(ticket) => eprintln!("send again, or resume {ticket}"),
    ///     LaneIncrement::NotCounted(not) => eprintln!("not counted: {}", not.cause()),
    /// }
    /// # }
    /// ```
    pub async fn add_from_at(
        &self,
        key: impl Into<Bson>,
        amount: i64,
        lane: &LaneName,
        position: i64,
        at: SystemTime,
    ) -> LaneIncrement {
        self.add_from_timed(key.into(), amount, lane, position, Some(at))
            .await
    }
}

/// Refuses a named lane's write without a time in a bucketed collection:
/// its positions are kept per bucket document, so the same message
/// delivered again after now's bucket changed would count twice.
pub(crate) fn check_named_lane_time(
    spec: &CollectionConfig,
    at: Option<SystemTime>,
) -> Result<(), Error> {
    if spec.buckets.is_none() || at.is_some() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "collection {} counts by time, and a named lane's positions are kept in each bucket's \
         document: written at now, a message delivered again after the bucket changed would \
         count twice; nothing was sent; give the message's own time (Counters::add_from_at)",
        spec.name
    )))
}

/// Refuses a read of the plain `key` in a bucketed collection, where no
/// document has it as its `_id`: the read would say "never counted" of a
/// key counted in every bucket. A bucket's own `_id` (`{k, t}`) reads that
/// bucket; [`Ledger::values_between`](crate::Ledger::values_between) reads
/// a key's buckets from one time to another.
pub(crate) fn check_read(spec: &CollectionConfig, key: &Bson) -> Result<(), Error> {
    if spec.buckets.is_none() || split_id(key).is_some() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "collection {} counts by time: {} has a counter per bucket, and none under its plain \
         key; read one bucket by its _id {{k, t}}, or the key's buckets in a range \
         (Ledger::values_between, tallyd get KEY --from TIME --to TIME)",
        spec.name,
        crate::document::display_id(key)
    )))
}

/// The key and bucket start of a bucketed `_id` (`None` for any other).
pub(crate) fn split_id(id: &Bson) -> Option<(&Bson, SystemTime)> {
    let Bson::Document(id) = id else {
        return None;
    };
    if id.len() != 2 {
        return None;
    }
    let key = id.get(KEY)?;
    let start = id.get_datetime(START).ok()?;
    Some((key, start.to_system_time()))
}

/// Whether two counter `_id`s name the same key, in the same bucket or
/// not: for a ledger, an event recorded again with another time is the
/// same event (its key is the idempotency key, not its bucket).
pub(crate) fn same_key_any_bucket(a: &Bson, b: &Bson) -> bool {
    match (split_id(a), split_id(b)) {
        (Some((a, _)), Some((b, _))) => crate::document::same_key(a, b),
        _ => crate::document::same_key(a, b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketWidth;

    fn days(close_after: Duration) -> CollectionConfig {
        let buckets = Buckets::new(BucketWidth::Day, "Europe/Berlin")
            .unwrap()
            .with_close_after(close_after);
        CollectionConfig::new("views").with_buckets(buckets)
    }

    fn time(buckets: &CollectionConfig, text: &str) -> SystemTime {
        buckets.buckets.as_ref().unwrap().parse_time(text).unwrap()
    }

    #[test]
    fn a_write_goes_to_its_keys_bucket_of_the_collections_zone() {
        let spec = days(Duration::from_secs(48 * 3600));
        let now = time(&spec, "2026-03-30T12:00:00+02:00");
        let at = time(&spec, "2026-03-29T23:30:00+02:00");
        let id = counter_id(&spec, "home".into(), Some(at), now).unwrap();
        let (key, start) = split_id(&id).unwrap();
        assert_eq!(key, &Bson::from("home"));
        assert_eq!(start, time(&spec, "2026-03-28T23:00:00Z"));
        // No time: now's bucket.
        let id = counter_id(&spec, "home".into(), None, now).unwrap();
        assert_eq!(split_id(&id).unwrap().1, time(&spec, "2026-03-30"));
    }

    #[test]
    fn a_time_far_ahead_or_in_a_closed_bucket_is_refused() {
        let spec = days(Duration::from_secs(3600));
        let now = time(&spec, "2026-11-28T00:30:00+01:00");
        let ahead = now + MAX_TIME_AHEAD + Duration::from_secs(1);
        let refused = counter_id(&spec, "k".into(), Some(ahead), now).unwrap_err();
        assert!(matches!(refused, Error::TimeAhead { .. }), "{refused}");
        let soon = now + MAX_TIME_AHEAD;
        assert!(counter_id(&spec, "k".into(), Some(soon), now).is_ok());
        // Yesterday ended 30 minutes ago: open for another half hour.
        let yesterday = time(&spec, "2026-11-27T10:00:00+01:00");
        assert!(counter_id(&spec, "k".into(), Some(yesterday), now).is_ok());
        let later = now + Duration::from_secs(1800);
        let refused = counter_id(&spec, "k".into(), Some(yesterday), later).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "the bucket 2026-11-27T00:00:00+01:00 of views takes no more writes: it ended 1h ago, \
             and its buckets take writes for 1h after they end (close_after): nothing was sent, \
             not counted"
        );
    }

    #[test]
    fn a_time_without_buckets_is_refused_and_no_time_is_the_plain_key() {
        let spec = CollectionConfig::new("views");
        let now = SystemTime::now();
        assert_eq!(
            counter_id(&spec, "k".into(), None, now).unwrap(),
            Bson::from("k")
        );
        let refused = counter_id(&spec, "k".into(), Some(now), now).unwrap_err();
        assert!(refused.to_string().contains("has no buckets"), "{refused}");
    }

    #[test]
    fn the_same_key_in_two_buckets_is_one_event_counter() {
        let spec = days(Duration::from_secs(48 * 3600));
        let now = time(&spec, "2026-03-30T12:00:00+02:00");
        let today = counter_id(&spec, "a".into(), None, now).unwrap();
        let yesterday = time(&spec, "2026-03-29T12:00:00+02:00");
        let earlier = counter_id(&spec, "a".into(), Some(yesterday), now).unwrap();
        let other = counter_id(&spec, "b".into(), None, now).unwrap();
        assert!(same_key_any_bucket(&today, &earlier));
        assert!(!same_key_any_bucket(&today, &other));
        assert!(!same_key_any_bucket(&today, &"a".into()));
    }
}
