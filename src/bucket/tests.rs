//! The bucket arithmetic against the time zone database: daylight-saving
//! days and hours, zones that shift at midnight, month ends and leap years,
//! instants on a boundary, the times people write; and, for random
//! instants in every zone, that each lies in the bucket computed for it.

use std::time::{Duration, SystemTime};

use jiff::Timestamp;
use jiff::tz::TimeZone;
use proptest::prelude::*;

use super::*;

const HOUR: Duration = Duration::from_secs(3600);

/// An RFC 3339 instant, read by jiff (not by the parser under test).
fn at(text: &str) -> SystemTime {
    let instant: Timestamp = text.parse().unwrap_or_else(|err| panic!("{text}: {err}"));
    SystemTime::try_from(instant).unwrap()
}

fn buckets(width: BucketWidth, zone: &str) -> Buckets {
    Buckets::new(width, zone).unwrap()
}

/// The start and the end of the bucket holding the instant `text`.
fn bucket_of(buckets: &Buckets, text: &str) -> (SystemTime, SystemTime) {
    let instant = at(text);
    (
        buckets.start_of(instant).unwrap(),
        buckets.end_of(instant).unwrap(),
    )
}

/// Asserts that the bucket holding the instant `text` is `[start, end)`.
#[track_caller]
fn assert_bucket(buckets: &Buckets, text: &str, start: &str, end: &str) {
    assert_eq!(bucket_of(buckets, text), (at(start), at(end)), "{text}");
}

fn hours(n: u64) -> Duration {
    HOUR * n as u32
}

#[test]
fn widths_are_read_by_name_and_an_unknown_one_names_the_choices() {
    for width in BucketWidth::ALL {
        assert_eq!(width.as_str().parse::<BucketWidth>(), Ok(width));
        assert_eq!(width.to_string(), width.as_str());
    }
    for bad in ["week", "Day", "", "days"] {
        let err = bad.parse::<BucketWidth>().unwrap_err();
        assert_eq!(err, BucketError::UnknownWidth(bad.to_owned()));
        assert!(
            err.to_string()
                .ends_with("expected minute, hour, day or month"),
            "{err}"
        );
    }
}

#[test]
fn a_zone_is_an_iana_name_in_any_case_and_an_unknown_one_is_refused() {
    assert_eq!(
        buckets(BucketWidth::Day, "europe/berlin").zone(),
        "Europe/Berlin"
    );
    assert_eq!(
        buckets(BucketWidth::Day, "UTC"),
        Buckets::utc(BucketWidth::Day)
    );
    for bad in ["Mars/Olympus", "", "+01:00", "CEST"] {
        let err = Buckets::new(BucketWidth::Day, bad).unwrap_err();
        assert_eq!(err, BucketError::UnknownTimeZone(bad.to_owned()));
        assert!(err.to_string().contains("IANA name"), "{err}");
    }
}

#[test]
fn berlin_has_a_23_hour_day_in_march_and_a_25_hour_day_in_october() {
    let days = buckets(BucketWidth::Day, "Europe/Berlin");
    let (start, end) = bucket_of(&days, "2026-03-29T12:00:00Z");
    assert_eq!(
        (start, end),
        (at("2026-03-28T23:00:00Z"), at("2026-03-29T22:00:00Z"))
    );
    assert_eq!(end.duration_since(start).unwrap(), hours(23));
    let (start, end) = bucket_of(&days, "2026-10-25T12:00:00Z");
    assert_eq!(
        (start, end),
        (at("2026-10-24T22:00:00Z"), at("2026-10-25T23:00:00Z"))
    );
    assert_eq!(end.duration_since(start).unwrap(), hours(25));
    // The days either side have 24.
    let (start, end) = bucket_of(&days, "2026-10-26T12:00:00Z");
    assert_eq!(end.duration_since(start).unwrap(), hours(24));
}

#[test]
fn new_york_has_a_23_hour_day_in_march_and_a_25_hour_day_in_november() {
    let days = buckets(BucketWidth::Day, "America/New_York");
    assert_bucket(
        &days,
        "2026-03-08T12:00:00Z",
        "2026-03-08T05:00:00Z",
        "2026-03-09T04:00:00Z",
    );
    assert_bucket(
        &days,
        "2026-11-01T12:00:00Z",
        "2026-11-01T04:00:00Z",
        "2026-11-02T05:00:00Z",
    );
    // The day's start agrees with jiff's own start of the day.
    let zoned = jiff::civil::date(2026, 11, 1)
        .at(9, 0, 0, 0)
        .to_zoned_datetime(TimeZone::get("America/New_York").unwrap())
        .unwrap();
    let jiffs = SystemTime::try_from(zoned.start_of_day().unwrap().timestamp()).unwrap();
    assert_eq!(days.start_of(at("2026-11-01T13:00:00Z")).unwrap(), jiffs);
}

#[test]
fn the_hour_the_clock_repeats_is_two_buckets_and_the_hour_it_skips_none() {
    let hours_ny = buckets(BucketWidth::Hour, "America/New_York");
    // 01:00 EDT (05:00Z) and 01:00 EST (06:00Z): an hour each.
    assert_bucket(
        &hours_ny,
        "2026-11-01T05:30:00Z",
        "2026-11-01T05:00:00Z",
        "2026-11-01T06:00:00Z",
    );
    assert_bucket(
        &hours_ny,
        "2026-11-01T06:30:00Z",
        "2026-11-01T06:00:00Z",
        "2026-11-01T07:00:00Z",
    );
    // 01:00 EST, then 03:00 EDT: 02:00 never starts.
    assert_bucket(
        &hours_ny,
        "2026-03-08T06:59:59Z",
        "2026-03-08T06:00:00Z",
        "2026-03-08T07:00:00Z",
    );
    // A day holds as many hour buckets as it has hours.
    let days = buckets(BucketWidth::Day, "America/New_York");
    for (day, count) in [("2026-03-08", 23), ("2026-11-01", 25), ("2026-11-02", 24)] {
        let from = days.parse_time(day).unwrap();
        let to = days.end_of(from).unwrap();
        assert_eq!(
            hours_ny.starts(from, to).unwrap().count(),
            count,
            "hours of {day}"
        );
    }
    let hours_berlin = buckets(BucketWidth::Hour, "Europe/Berlin");
    // 01:59 CET, then 03:00 CEST.
    assert_bucket(
        &hours_berlin,
        "2026-03-29T00:59:59.999Z",
        "2026-03-29T00:00:00Z",
        "2026-03-29T01:00:00Z",
    );
    assert_bucket(
        &hours_berlin,
        "2026-03-29T01:00:00Z",
        "2026-03-29T01:00:00Z",
        "2026-03-29T02:00:00Z",
    );
}

#[test]
fn a_half_hour_shift_cuts_an_hour_into_two_half_hour_buckets() {
    let hours = buckets(BucketWidth::Hour, "Australia/Lord_Howe");
    // 02:00 (+10:30) becomes 02:30 (+11) at 15:30Z.
    assert_bucket(
        &hours,
        "2026-10-03T15:15:00Z",
        "2026-10-03T14:30:00Z",
        "2026-10-03T15:30:00Z",
    );
    assert_bucket(
        &hours,
        "2026-10-03T15:45:00Z",
        "2026-10-03T15:30:00Z",
        "2026-10-03T16:00:00Z",
    );
    // 02:00 (+11) becomes 01:30 (+10:30) at 15:00Z: 01:30 to 02:00 again.
    assert_bucket(
        &hours,
        "2027-04-03T14:30:00Z",
        "2027-04-03T14:00:00Z",
        "2027-04-03T15:00:00Z",
    );
    assert_bucket(
        &hours,
        "2027-04-03T15:10:00Z",
        "2027-04-03T15:00:00Z",
        "2027-04-03T15:30:00Z",
    );
}

#[test]
fn a_day_whose_midnight_the_clock_skips_starts_where_it_jumps() {
    // Santiago: Saturday 24:00 (-04) is Sunday 01:00 (-03).
    let santiago = buckets(BucketWidth::Day, "America/Santiago");
    assert_bucket(
        &santiago,
        "2026-09-06T12:00:00Z",
        "2026-09-06T04:00:00Z",
        "2026-09-07T03:00:00Z",
    );
    assert_eq!(
        santiago.parse_time("2026-09-06").unwrap(),
        at("2026-09-06T04:00:00Z")
    );
    // And back: Sunday 00:00 (-03) is Saturday 23:00 (-04), a 25-hour
    // Saturday.
    assert_bucket(
        &santiago,
        "2026-04-04T12:00:00Z",
        "2026-04-04T03:00:00Z",
        "2026-04-05T04:00:00Z",
    );
    // Havana: 00:00 (-05) is 01:00 (-04).
    let havana = buckets(BucketWidth::Day, "America/Havana");
    assert_bucket(
        &havana,
        "2026-03-08T12:00:00Z",
        "2026-03-08T05:00:00Z",
        "2026-03-09T04:00:00Z",
    );
    // Apia skipped 30 December 2011: the 29th ends where the 31st starts,
    // which is where the date of the 30th leads.
    let apia = buckets(BucketWidth::Day, "Pacific/Apia");
    assert_bucket(
        &apia,
        "2011-12-29T20:00:00Z",
        "2011-12-29T10:00:00Z",
        "2011-12-30T10:00:00Z",
    );
    assert_bucket(
        &apia,
        "2011-12-30T10:00:00Z",
        "2011-12-30T10:00:00Z",
        "2011-12-31T10:00:00Z",
    );
    assert_eq!(
        apia.parse_time("2011-12-30").unwrap(),
        at("2011-12-30T10:00:00Z")
    );
}

#[test]
fn a_day_whose_midnight_the_clock_repeats_starts_at_the_first() {
    // St. John's, 2010-11-07: at 00:01 NDT (-02:30) the clock went back to
    // 23:01 NST (-03:30) on the 6th. Sunday began at 02:30Z; what follows,
    // though the clock shows Saturday again, is Sunday's.
    let days = buckets(BucketWidth::Day, "America/St_Johns");
    assert_bucket(
        &days,
        "2010-11-06T12:00:00Z",
        "2010-11-06T02:30:00Z",
        "2010-11-07T02:30:00Z",
    );
    let sunday = (at("2010-11-07T02:30:00Z"), at("2010-11-08T03:30:00Z"));
    for instant in [
        "2010-11-07T02:30:00Z",
        "2010-11-07T02:45:00Z",
        "2010-11-07T12:00:00Z",
    ] {
        assert_eq!(bucket_of(&days, instant), sunday, "{instant}");
    }
    // The hours nest in it: 00:00 NDT lasted a minute, then 23:01 NST.
    let hours = buckets(BucketWidth::Hour, "America/St_Johns");
    assert_bucket(
        &hours,
        "2010-11-07T02:30:30Z",
        "2010-11-07T02:30:00Z",
        "2010-11-07T02:31:00Z",
    );
    assert_bucket(
        &hours,
        "2010-11-07T02:45:00Z",
        "2010-11-07T02:31:00Z",
        "2010-11-07T03:30:00Z",
    );
}

#[test]
fn months_end_where_the_calendar_says_in_the_zones_time() {
    let months = Buckets::utc(BucketWidth::Month);
    for (instant, start, end) in [
        (
            "2026-01-31T23:59:59.999999999Z",
            "2026-01-01T00:00:00Z",
            "2026-02-01T00:00:00Z",
        ),
        (
            "2026-02-28T12:00:00Z",
            "2026-02-01T00:00:00Z",
            "2026-03-01T00:00:00Z",
        ),
        (
            "2026-04-30T12:00:00Z",
            "2026-04-01T00:00:00Z",
            "2026-05-01T00:00:00Z",
        ),
        (
            "2026-12-31T23:00:00Z",
            "2026-12-01T00:00:00Z",
            "2027-01-01T00:00:00Z",
        ),
    ] {
        assert_bucket(&months, instant, start, end);
    }
    // Berlin's March has its 23-hour day; its November starts on
    // 31 October at 23:00Z.
    let berlin = buckets(BucketWidth::Month, "Europe/Berlin");
    let (start, end) = bucket_of(&berlin, "2026-03-15T12:00:00Z");
    assert_eq!(
        (start, end),
        (at("2026-02-28T23:00:00Z"), at("2026-03-31T22:00:00Z"))
    );
    assert_eq!(end.duration_since(start).unwrap(), hours(31 * 24 - 1));
    assert_eq!(
        bucket_of(&berlin, "2026-10-31T23:30:00Z").0,
        at("2026-10-31T23:00:00Z")
    );
}

#[test]
fn leap_years_have_a_29th_of_february() {
    let days = Buckets::utc(BucketWidth::Day);
    let months = Buckets::utc(BucketWidth::Month);
    let leap_day = days.parse_time("2028-02-29").unwrap();
    assert_eq!(leap_day, at("2028-02-29T00:00:00Z"));
    assert_eq!(days.end_of(leap_day).unwrap(), at("2028-03-01T00:00:00Z"));
    let (start, end) = bucket_of(&months, "2028-02-29T23:59:59Z");
    assert_eq!(end.duration_since(start).unwrap(), hours(29 * 24));
    assert!(days.parse_time("2000-02-29").is_ok(), "divisible by 400");
    for not_leap in ["2026-02-29", "2100-02-29"] {
        let err = days.parse_time(not_leap).unwrap_err();
        assert!(err.to_string().contains("has no day 29"), "{err}");
    }
}

#[test]
fn an_instant_on_a_boundary_belongs_to_the_bucket_it_starts() {
    for width in BucketWidth::ALL {
        let buckets = buckets(width, "Europe/Berlin");
        let start = buckets.start_of(at("2026-10-25T01:30:00Z")).unwrap();
        let end = buckets.end_of(start).unwrap();
        assert_eq!(buckets.start_of(start).unwrap(), start, "{width}");
        assert_eq!(buckets.start_of(end).unwrap(), end, "{width}");
        let just_before = end - Duration::from_nanos(1);
        assert_eq!(buckets.start_of(just_before).unwrap(), start, "{width}");
    }
}

#[test]
fn rfc_3339_times_are_read_with_their_offsets() {
    let days = buckets(BucketWidth::Day, "Asia/Kolkata");
    let instant = at("2026-11-28T14:30:00Z");
    for text in [
        "2026-11-28T14:30:00Z",
        "2026-11-28T15:30:00+01:00",
        "2026-11-28T09:30:00-05:00",
        "2026-11-28T20:00:00+05:30",
        "2026-11-28t14:30:00z",
        "2026-11-28 14:30:00-00:00",
        " 2026-11-28T14:30:00Z\n",
    ] {
        assert_eq!(days.parse_time(text).unwrap(), instant, "{text:?}");
    }
    assert_eq!(
        days.parse_time("2026-11-28T14:30:00.123456789123Z")
            .unwrap(),
        instant + Duration::from_nanos(123_456_789)
    );
    // A leap second is the second before it.
    assert_eq!(
        days.parse_time("2016-12-31T23:59:60Z").unwrap(),
        at("2016-12-31T23:59:59Z")
    );
    // A date is its local midnight in the zone, here +05:30.
    assert_eq!(
        days.parse_time("2026-11-28").unwrap(),
        at("2026-11-27T18:30:00Z")
    );
}

#[test]
fn anything_else_is_refused_in_one_sentence_saying_what_to_write() {
    let days = Buckets::utc(BucketWidth::Day);
    for (text, says) in [
        ("", "write RFC 3339 with an offset"),
        ("yesterday", "write RFC 3339 with an offset"),
        ("20261128", "write RFC 3339 with an offset"),
        ("2026-11-28T14:30Z", "write RFC 3339 with an offset"),
        ("2026-11-28T14:30:00Z junk", "write RFC 3339 with an offset"),
        (
            "2026-11-28T14:30:00+0100",
            "write an offset as Z, +hh:mm or -hh:mm",
        ),
        (
            "2026-11-28T14:30:00",
            "it has no offset: add one, as in \"2026-11-28T14:30:00Z\"",
        ),
        ("2026-13-01", "there is no month 13"),
        ("2026-04-31", "2026-04 has no day 31"),
        ("2026-11-28T24:00:00Z", "24:00:00 is not a time of day"),
        ("2026-11-28T14:30:00+24:00", "+24:00 is not a UTC offset"),
    ] {
        let err = days.parse_time(text).unwrap_err();
        let shown = err.to_string();
        assert!(
            matches!(&err, BucketError::BadTime { text: t, .. } if t == text),
            "{err:?}"
        );
        assert!(shown.contains(says), "{text:?}: {shown}");
        assert!(
            !shown.contains('\n') && shown.matches(". ").count() == 0,
            "{shown}"
        );
    }
    // Past the calendar's years.
    let far = SystemTime::UNIX_EPOCH + Duration::from_secs(400_000 * 365 * 86_400);
    assert_eq!(days.start_of(far), Err(BucketError::OutOfRange));
}

#[test]
fn starts_are_the_buckets_that_start_in_the_range() {
    let days = buckets(BucketWidth::Day, "Europe/Berlin");
    let from = days.parse_time("2026-10-24").unwrap();
    let to = days.parse_time("2026-10-27").unwrap();
    let starts: Vec<SystemTime> = days.starts(from, to).unwrap().collect();
    assert_eq!(
        starts,
        [
            at("2026-10-23T22:00:00Z"),
            at("2026-10-24T22:00:00Z"),
            at("2026-10-25T23:00:00Z"),
        ]
    );
    // A bucket that starts before `from` is not in it; one at `to` neither.
    let later = from + HOUR;
    assert_eq!(days.starts(later, to).unwrap().count(), 2);
    assert_eq!(days.starts(to, from).unwrap().count(), 0);
    assert_eq!(days.starts(from, from).unwrap().count(), 0);
    let months = buckets(BucketWidth::Month, "America/New_York");
    let year = months
        .starts(
            months.parse_time("2026-01-01").unwrap(),
            months.parse_time("2027-01-01").unwrap(),
        )
        .unwrap();
    assert_eq!(year.count(), 12);
}

#[test]
fn buckets_are_summed_by_coarser_widths_in_their_zone_never_finer() {
    let days = buckets(BucketWidth::Day, "America/New_York");
    let months = days.by(BucketWidth::Month).unwrap();
    assert_eq!(
        (months.width(), months.zone()),
        (BucketWidth::Month, "America/New_York")
    );
    // 1 November in New York starts at 04:00Z: in UTC it would be October.
    let first = days.parse_time("2026-11-01").unwrap();
    assert_eq!(months.start_of(first).unwrap(), first);
    let last = days.parse_time("2026-10-31").unwrap();
    assert_eq!(
        months.start_of(last).unwrap(),
        days.parse_time("2026-10-01").unwrap()
    );
    assert_eq!(days.by(BucketWidth::Day).unwrap(), days);
    let hours = buckets(BucketWidth::Hour, "Europe/Berlin");
    let err = hours.by(BucketWidth::Minute).unwrap_err();
    assert_eq!(
        err.to_string(),
        "hour buckets cannot be summed by minute, which is finer: choose hour, day or month"
    );
    let err = Buckets::utc(BucketWidth::Month)
        .by(BucketWidth::Day)
        .unwrap_err();
    assert!(err.to_string().ends_with("choose month"), "{err}");
}

/// Every zone's name, sorted.
fn zone_names() -> Vec<String> {
    let mut names: Vec<String> = jiff::tz::db()
        .available()
        .map(|name| name.as_str().to_owned())
        .collect();
    names.sort();
    names
}

/// The rules every bucket keeps around `instant`: it lies in its bucket;
/// the bucket's start and end are found again from the start; its end
/// starts the next bucket; and it nests in the bucket of every coarser
/// width.
fn check_around(buckets: &Buckets, instant: SystemTime) -> Result<(), String> {
    let say = |what: &str| format!("{what} ({buckets:?} at {:?})", Timestamp::try_from(instant));
    let start = buckets.start_of(instant).map_err(|e| say(&e.to_string()))?;
    let end = buckets.end_of(instant).map_err(|e| say(&e.to_string()))?;
    if !(start <= instant && instant < end) {
        return Err(say("not in its bucket"));
    }
    if buckets.start_of(start) != Ok(start) || buckets.end_of(start) != Ok(end) {
        return Err(say("the start is not stable"));
    }
    if buckets.start_of(end) != Ok(end) {
        return Err(say("the end does not start the next bucket"));
    }
    for width in BucketWidth::ALL
        .into_iter()
        .filter(|w| *w > buckets.width())
    {
        let coarser = buckets.by(width).unwrap();
        let outer = coarser.start_of(instant).map_err(|e| say(&e.to_string()))?;
        let outer_end = coarser.end_of(instant).map_err(|e| say(&e.to_string()))?;
        if coarser.start_of(start) != Ok(outer) || outer > start || end > outer_end {
            return Err(say(&format!("does not nest in its {width}")));
        }
    }
    Ok(())
}

/// Around every change of offset in every zone from 2000 to 2030: just
/// before it and at it.
#[test]
fn every_offset_change_of_every_zone_keeps_the_rules() {
    let from: Timestamp = "2000-01-01T00:00:00Z".parse().unwrap();
    let to: Timestamp = "2030-01-01T00:00:00Z".parse().unwrap();
    let mut checked = 0;
    for name in zone_names() {
        let zone = TimeZone::get(&name).unwrap();
        let widths = BucketWidth::ALL.map(|width| buckets(width, &name));
        for transition in zone.following(from).take_while(|t| t.timestamp() < to) {
            let instant = SystemTime::try_from(transition.timestamp()).unwrap();
            for buckets in &widths {
                for around in [instant - Duration::from_nanos(1), instant] {
                    check_around(buckets, around).unwrap();
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 10_000, "{checked}");
}

proptest! {
    /// Random instants from 1900 to 2100 in random zones and widths.
    #[test]
    fn every_instant_lies_in_its_bucket_whose_start_is_stable(
        zone in 0usize..10_000,
        width in 0usize..4,
        seconds in -2_208_988_800i64..4_102_444_800,
        nanos in 0u32..1_000_000_000,
    ) {
        let names = zone_names();
        let name = &names[zone % names.len()];
        let buckets = buckets(BucketWidth::ALL[width], name);
        let instant = SystemTime::try_from(
            Timestamp::new(seconds, nanos as i32).unwrap(),
        )
        .unwrap();
        check_around(&buckets, instant).map_err(TestCaseError::fail)?;
    }
}
