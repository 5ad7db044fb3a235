//! Range reads of a bucketed ledger (`Ledger::values_between`, `tallyd get
//! KEY --from T --to T [--by W]`): every bucket in the range, each exact
//! whatever the fold is doing, the coarser sums, and the refusals.
//!
//! The oracle is what the test recorded, never what the code reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use tally::{BucketWidth, Error, Ledger};
use tokio_util::sync::CancellationToken;

use crate::buckets::{berlin_days, bucketed, bucketed_config, tallyd_with};
use crate::cli::{json, text, write_config};
use crate::common::TestContext;
use crate::ledger::{assert_outcome, fold_all, fold_of};

/// Berlin's days around the end of summer time 2026 (the 25th has 25
/// hours): events in three of them, some folded, some not, one day left
/// empty. Every read of the range is the recorded sums, bucket by bucket,
/// while a fold runs pass after pass; summed by month, one bucket.
#[tokio::test]
async fn a_range_read_is_exact_bucket_by_bucket_while_the_fold_runs() {
    let ctx = TestContext::new("ranges_exact").await;
    let store = ctx.client(false).await.store();
    let days = berlin_days();
    let views = Ledger::new(&store, bucketed("views", &days));
    // With buckets, the counters by key and bucket too (the events are
    // read from the change stream, by key and bucket on the server).
    let made = views.create_indexes().await.unwrap().join("\n");
    assert!(
        made.contains("tally_events_number") && made.contains("tally_counters_bucket"),
        "{made}"
    );
    let at = |text: &str| days.parse_time(text).unwrap();
    let events = [
        ("e1", "2026-10-24T00:00:00+02:00", 1),
        ("e2", "2026-10-25T02:30:00+01:00", 2),
        ("e3", "2026-10-25T23:59:59+01:00", 4),
        ("e4", "2026-10-27T12:00:00+01:00", 8),
        // Outside the range: the 28th, and the 23rd.
        ("e5", "2026-10-28T00:00:00+01:00", 16),
        ("e6", "2026-10-23T23:59:59+02:00", 32),
    ];
    for (event, time, amount) in &events[..3] {
        assert_outcome(
            &views.record_at(*event, "home", *amount, at(time)).await,
            "recorded",
        );
    }
    fold_all(&fold_of(&store, "views")).await;
    for (event, time, amount) in &events[3..] {
        assert_outcome(
            &views.record_at(*event, "home", *amount, at(time)).await,
            "recorded",
        );
    }
    let (from, to) = (at("2026-10-24"), at("2026-10-28"));
    let expected = [
        ("2026-10-24T00:00:00+02:00", 1),
        ("2026-10-25T00:00:00+02:00", 6),
        ("2026-10-26T00:00:00+01:00", 0),
        ("2026-10-27T00:00:00+01:00", 8),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let folding = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let fold = fold_of(&store, "views");
            let mut passes = 0;
            while !stop.load(Ordering::SeqCst) {
                fold.fold(SystemTime::now(), &CancellationToken::new())
                    .await
                    .expect("a pass");
                passes += 1;
            }
            passes
        })
    };
    // One more event lands while the reads run, outside the range.
    assert_outcome(
        &views
            .record_at("e7", "home", 64, at("2026-10-28T09:00:00+01:00"))
            .await,
        "recorded",
    );
    for _ in 0..20 {
        let read = views.values_between("home", from, to, None).await.unwrap();
        let got: Vec<(String, i64)> = read
            .buckets
            .iter()
            .map(|b| (days.show_time(b.start), b.value))
            .collect();
        let want: Vec<(String, i64)> = expected
            .iter()
            .map(|(s, v)| ((*s).to_owned(), *v))
            .collect();
        assert_eq!(got, want);
        assert_eq!(read.total, 15);
        assert_eq!(read.by, BucketWidth::Day);
    }
    stop.store(true, Ordering::SeqCst);
    assert!(folding.await.unwrap() > 0);
    let month = views
        .values_between(
            "home",
            at("2026-10-01"),
            at("2026-11-01"),
            Some(BucketWidth::Month),
        )
        .await
        .unwrap();
    assert_eq!(month.buckets.len(), 1, "{month:?}");
    assert_eq!(
        days.show_time(month.buckets[0].start),
        "2026-10-01T00:00:00+02:00"
    );
    assert_eq!(
        (month.buckets[0].value, month.total),
        (1 + 2 + 4 + 8 + 16 + 32 + 64, 127)
    );
    // Days of 2026 end well within the collection's close_after: open.
    assert!(month.buckets.iter().all(|b| !b.closed));
}

/// What a range read refuses, before anything is read: a collection
/// without buckets, a start not before the end, a width finer than the
/// collection's, a range of more buckets than one read takes.
#[tokio::test]
async fn a_range_read_refuses_what_it_cannot_read() {
    let ctx = TestContext::new("ranges_refused").await;
    let store = ctx.client(false).await.store();
    let days = berlin_days();
    let views = Ledger::new(&store, bucketed("views", &days));
    let plain = Ledger::new(&store, tally::CollectionConfig::new("plain"));
    let at = |text: &str| days.parse_time(text).unwrap();
    let refused = |result: Result<tally::RangeValue, Error>| match result {
        Err(Error::InvalidArgument(message)) => message,
        other => panic!("not refused: {other:?}"),
    };
    let (from, to) = (at("2026-10-24"), at("2026-10-28"));
    assert!(refused(plain.values_between("home", from, to, None).await).contains("no buckets"));
    assert!(refused(views.values_between("home", to, from, None).await).contains("not before"));
    let finer = refused(
        views
            .values_between("home", from, to, Some(BucketWidth::Hour))
            .await,
    );
    assert!(finer.contains("hour"), "{finer}");
    let long = refused(
        views
            .values_between("home", at("2000-01-01"), at("2040-01-01"), None)
            .await,
    );
    assert!(long.contains("more than 10000"), "{long}");
}

/// `tallyd get KEY --from T --to T [--by W] [--json]`: the buckets and the
/// total in words and in JSON; the same mistakes refused with 64.
#[tokio::test]
async fn get_reads_a_keys_buckets_from_the_command_line() {
    let ctx = TestContext::new("ranges_cli").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &bucketed_config(&ctx));
    for (event, time) in [
        ("e1", "2026-10-24T10:00:00+02:00"),
        ("e2", "2026-10-25T23:00:00+01:00"),
    ] {
        let record = tallyd_with(
            &path,
            &[
                "record",
                event,
                "home",
                "--collection",
                "views",
                "--at",
                time,
            ],
        )
        .await;
        assert_eq!(record.status.code(), Some(0), "{}", text(&record));
    }
    let range = [
        "get",
        "home",
        "--collection",
        "views",
        "--from",
        "2026-10-24",
        "--to",
        "2026-10-27",
    ];
    let get = tallyd_with(&path, &range).await;
    assert_eq!(get.status.code(), Some(0), "{}", text(&get));
    let shown = text(&get);
    assert!(
        shown.contains("views/home from 2026-10-24T00:00:00+02:00 to 2026-10-27T00:00:00+01:00: 2 (day buckets)")
            && shown.contains("  2026-10-25T00:00:00+02:00  1")
            && shown.contains("  2026-10-26T00:00:00+01:00  0"),
        "{shown}"
    );
    let mut with_json = range.to_vec();
    with_json.extend(["--by", "month", "--json"]);
    let get = tallyd_with(&path, &with_json).await;
    assert_eq!(get.status.code(), Some(0), "{}", text(&get));
    let read = json(&get);
    assert_eq!(read["total"], 2);
    assert_eq!(read["by"], "month");
    assert_eq!(read["buckets"][0]["start"], "2026-10-01T00:00:00+02:00");
    assert_eq!(read["buckets"][0]["value"], 2);
    assert_eq!(read["buckets"][0]["closed"], false);
    for (args, says) in [
        (
            &["get", "home", "--collection", "views"][..],
            "--from TIME --to TIME",
        ),
        (
            &[
                "get",
                "home",
                "--collection",
                "plain",
                "--any-collection",
                "--from",
                "2026-10-24",
                "--to",
                "2026-10-27",
            ][..],
            "no buckets",
        ),
        (
            &[
                "get",
                "home",
                "--collection",
                "views",
                "--from",
                "2026-10-27",
                "--to",
                "2026-10-24",
            ][..],
            "not before",
        ),
        (
            &[
                "get",
                "home",
                "--collection",
                "views",
                "--from",
                "2026-10-24",
                "--to",
                "2026-10-27",
                "--by",
                "hour",
            ][..],
            "--by",
        ),
        (
            &[
                "get",
                "home",
                "--collection",
                "views",
                "--from",
                "yesterday",
                "--to",
                "2026-10-27",
            ][..],
            "--from",
        ),
    ] {
        let get = tallyd_with(&path, args).await;
        assert_eq!(get.status.code(), Some(64), "{args:?}: {}", text(&get));
        assert!(text(&get).contains(says), "{args:?}: {}", text(&get));
    }
}
