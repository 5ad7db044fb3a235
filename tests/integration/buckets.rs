//! Counters by time: a write that carries a time lands in the `{k, t}`
//! document of its bucket — with every protocol (two-step, lanes, the
//! ledger and its fold, the fold of leftover tokens), on days of 23 and 25
//! hours and in months — a late
//! event counts in the bucket it happened in, once, an event recorded
//! again with another time stays a duplicate, and a time far ahead or in a
//! closed bucket is refused with nothing written; the same from the command
//! line (`incr --at`, `record --at`, `"at"` in `record --from`).
//!
//! The oracle is what is stored, read directly, never what the code under
//! test reports.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, DateTime, Document, doc};
use tally::{
    BucketWidth, Buckets, CollectionConfig, Counters, Error, FoldTarget, Increment, LaneIncrement,
    Ledger, Mode, Token, WriterConfig,
};

use crate::cli::{hint, hint_command, json, tallyd, text, write_config};
use crate::common::proxy::{Proxy, upstream_of};
use crate::common::{FailPoint, TestContext, counter, pending_len, run_reconcile};
use crate::ledger::{assert_outcome, fold_all, fold_of};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Day buckets of Berlin, open for a year and a half after they end (so
/// that the daylight-saving days of 2026 take writes).
pub(crate) fn berlin_days() -> Buckets {
    Buckets::new(BucketWidth::Day, "Europe/Berlin")
        .unwrap()
        .with_close_after(540 * DAY)
}

pub(crate) fn bucketed(name: &str, buckets: &Buckets) -> CollectionConfig {
    CollectionConfig::new(name).with_buckets(buckets.clone())
}

/// The `_id` of `key`'s counter in the bucket starting at `start` (RFC
/// 3339).
fn id(key: &str, start: &str) -> Bson {
    let start = Buckets::utc(BucketWidth::Day).parse_time(start).unwrap();
    Bson::Document(doc! { "k": key, "t": DateTime::from_system_time(start) })
}

/// Every `_id` of `collection`, in order.
async fn ids(ctx: &TestContext, collection: &str) -> Vec<Bson> {
    let coll = ctx.client(false).await.collection(collection);
    let mut cursor = coll.find(doc! {}).sort(doc! { "_id": 1 }).await.unwrap();
    let mut ids = Vec::new();
    while cursor.advance().await.unwrap() {
        let found: Document = cursor.deserialize_current().unwrap();
        ids.push(found.get("_id").cloned().unwrap());
    }
    ids
}

#[tokio::test]
async fn increments_land_in_their_day_of_berlin_across_daylight_saving_changes() {
    let ctx = TestContext::new("buckets_dst").await;
    let client = ctx.client(false).await;
    let days = berlin_days();
    let views = Counters::new(
        &client.store(),
        bucketed("views", &days),
        WriterConfig::default(),
    );
    let at = |text: &str| days.parse_time(text).unwrap();
    // 25 October 2026 has 25 hours in Berlin: its first and last minutes
    // are one bucket, the minute before it another.
    for (time, amount) in [
        ("2026-10-25T00:00:00+02:00", 1),
        ("2026-10-25T02:30:00+01:00", 2),
        ("2026-10-25T23:59:59+01:00", 4),
        ("2026-10-24T23:59:59+02:00", 8),
    ] {
        let outcome = views.increment_at("home", amount, at(time)).await;
        assert!(matches!(outcome, Increment::Counted(_)), "{outcome:?}");
    }
    // 29 March 2026 has 23 hours; through a lane, with group commit.
    for (time, amount) in [
        ("2026-03-29T00:00:00+01:00", 16),
        ("2026-03-29T23:59:59+02:00", 32),
    ] {
        let outcome = views.add_at("home", amount, at(time)).await;
        assert!(matches!(outcome, LaneIncrement::Counted(_)), "{outcome:?}");
    }
    let coll = client.collection("views");
    assert_eq!(counter(&coll, id("home", "2026-10-24T22:00:00Z")).await, 7);
    assert_eq!(counter(&coll, id("home", "2026-10-23T22:00:00Z")).await, 8);
    assert_eq!(counter(&coll, id("home", "2026-03-28T23:00:00Z")).await, 48);
    assert_eq!(ids(&ctx, "views").await.len(), 3, "one document a bucket");
}

#[tokio::test]
async fn records_land_in_their_month_and_a_late_event_counts_once_in_its_own() {
    let ctx = TestContext::new("buckets_months").await;
    let store = ctx.client(false).await.store();
    let months = Buckets::utc(BucketWidth::Month).with_close_after(60 * DAY);
    let orders = Ledger::new(&store, bucketed("orders", &months));
    orders.create_indexes().await.unwrap();
    let now = SystemTime::now();
    let this_month = months.start_of(now).unwrap();
    // The last second of last month: late, but its bucket is open.
    let late = this_month - Duration::from_secs(1);
    let last_month = months.start_of(late).unwrap();
    assert_outcome(&orders.record_at("o-1", "acme", 5, late).await, "recorded");
    assert_outcome(&orders.record("o-2", "acme", 3).await, "recorded");
    // Recorded again, with another time: the same event, counted once, in
    // the bucket it was first recorded in.
    let again = orders.record_at("o-1", "acme", 5, now).await;
    assert_outcome(&again, "duplicate");
    assert_eq!(
        again.event().counter(),
        &Bson::Document(doc! { "k": "acme", "t": DateTime::from_system_time(last_month) })
    );
    let many = orders
        .record_many_at([
            ("o-1", "acme", 5, Some(this_month)),
            ("o-3", "acme", 1, Some(late)),
        ])
        .await;
    assert_outcome(&many[0], "duplicate");
    assert_outcome(&many[1], "recorded");
    // A repeat is a duplicate even when its time is refused; a new event
    // with that time is not recorded.
    let long_closed = months.parse_time("2020-01-15").unwrap();
    let repeat = orders.record_at("o-1", "acme", 5, long_closed).await;
    assert_outcome(&repeat, "duplicate");
    assert_eq!(repeat.event().counter(), again.event().counter());
    let ahead = now + 2 * tally::MAX_TIME_AHEAD;
    assert_outcome(
        &orders.record_at("o-2", "acme", 3, ahead).await,
        "duplicate",
    );
    assert_outcome(
        &orders.record_at("o-9", "acme", 1, long_closed).await,
        "not_recorded",
    );

    fold_all(&fold_of(&store, "orders")).await;
    let coll = store.collection("orders");
    let bucket = |start: SystemTime| doc! { "k": "acme", "t": DateTime::from_system_time(start) };
    assert_eq!(counter(&coll, bucket(last_month)).await, 6);
    assert_eq!(counter(&coll, bucket(this_month)).await, 3);
    assert_eq!(ids(&ctx, "orders").await.len(), 2);
    // An exact read of one bucket, by its `_id`; a plain key is refused.
    assert_eq!(orders.value(bucket(last_month)).await.unwrap().value, 6);
    assert!(matches!(
        orders.value("acme").await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn a_time_far_ahead_or_in_a_closed_bucket_is_refused_and_nothing_is_sent() {
    let ctx = TestContext::new("buckets_refused").await;
    let client = ctx.client(false).await;
    let hours = Buckets::utc(BucketWidth::Hour).with_close_after(Duration::from_secs(3600));
    let spec = bucketed("views", &hours);
    let views = Counters::new(&client.store(), spec.clone(), WriterConfig::default());
    let ledger = Ledger::new(&client.store(), spec);
    let now = SystemTime::now();
    let ahead = now + tally::MAX_TIME_AHEAD + Duration::from_secs(60);
    // Three hours ago: its hour ended two hours or more ago.
    let closed = now - Duration::from_secs(3 * 3600);
    client.events.clear();
    let refused = [
        views.increment_at("home", 1, ahead).await,
        views.increment_at("home", 1, closed).await,
    ];
    assert!(
        matches!(&refused[0], Increment::NotCounted(not) if matches!(not.cause(), Error::TimeAhead { .. })),
        "{:?}",
        refused[0]
    );
    assert!(
        matches!(&refused[1], Increment::NotCounted(not) if matches!(not.cause(), Error::BucketClosed { .. })),
        "{:?}",
        refused[1]
    );
    let lane = views.add_at("home", 1, closed).await;
    assert!(
        matches!(&lane, LaneIncrement::NotCounted(not) if matches!(not.cause(), Error::BucketClosed { .. })),
        "{lane:?}"
    );
    for at in [ahead, closed] {
        let recording = ledger.record_at("evt", "home", 1, at).await;
        assert_outcome(&recording, "not_recorded");
    }
    // The ledger reads whether the event was recorded before (a repeat is
    // a duplicate whatever its time); nothing else is sent.
    let sent: Vec<String> = client.events.sent().into_iter().map(|s| s.name).collect();
    assert_eq!(sent, ["find", "find"], "nothing written");

    // A time for a collection without buckets is refused too.
    client.events.clear();
    let plain = Counters::new(
        &client.store(),
        CollectionConfig::new("plain"),
        WriterConfig::default(),
    );
    let outcome = plain.increment_at("home", 1, now).await;
    assert!(
        matches!(&outcome, Increment::NotCounted(not) if not.cause().to_string().contains("has no buckets")),
        "{outcome:?}"
    );
    assert!(client.events.sent().is_empty());
}

/// `tallyd --config PATH ARGS…`.
pub(crate) async fn tallyd_with(path: &str, args: &[&str]) -> std::process::Output {
    let mut all = vec!["--config", path];
    all.extend_from_slice(args);
    tallyd(&all, &[]).await
}

/// A config with `views` counted in Berlin's days, its ledger on, and the
/// collection `plain` without buckets.
pub(crate) fn bucketed_config(ctx: &TestContext) -> String {
    ctx.config_toml(
        false,
        "[[collections]]\nname = \"views\"\nledger = true\nbucket = \"day\"\ntimezone = \
         \"Europe/Berlin\"\nclose_after = \"540d\"\n[[collections]]\nname = \"plain\"\n",
    )
}

#[tokio::test]
async fn incr_and_record_at_a_time_from_the_command_line() {
    let ctx = TestContext::new("buckets_cli").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &bucketed_config(&ctx));
    let setup = tallyd_with(&path, &["setup"]).await;
    assert_eq!(setup.status.code(), Some(0), "{}", text(&setup));

    // The day of 25 hours, by its date and by a time in its last hour.
    let counted = tallyd_with(
        &path,
        &[
            "incr",
            "home",
            "--at",
            "2026-10-25",
            "--json",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(counted.status.code(), Some(0), "{}", text(&counted));
    let shown = json(&counted);
    assert_eq!(shown["outcome"], "counted", "{shown}");
    assert_eq!(shown["bucket"], "2026-10-25T00:00:00+02:00", "{shown}");
    let lane = tallyd_with(
        &path,
        &[
            "incr",
            "home",
            "--at",
            "2026-10-25T23:30:00+01:00",
            "--by",
            "2",
            "--lane",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(lane.status.code(), Some(0), "{}", text(&lane));
    assert!(
        text(&lane).contains("counted: views/home in the day from 2026-10-25T00:00:00+02:00 +2"),
        "{}",
        text(&lane)
    );
    let recorded = tallyd_with(
        &path,
        &[
            "record",
            "evt-1",
            "home",
            "--at",
            "2026-10-25T12:00:00Z",
            "--by",
            "4",
            "--json",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(recorded.status.code(), Some(0), "{}", text(&recorded));
    let shown = json(&recorded);
    assert_eq!(
        (&shown["outcome"], &shown["key"], &shown["bucket"]),
        (
            &"recorded".into(),
            &"home".into(),
            &"2026-10-25T00:00:00+02:00".into()
        ),
        "{shown}"
    );
    // Recorded again on another day: a duplicate, counted in its first.
    let again = tallyd_with(
        &path,
        &[
            "record",
            "evt-1",
            "home",
            "--at",
            "2026-10-26",
            "--by",
            "4",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(again.status.code(), Some(0), "{}", text(&again));
    assert!(
        text(&again).contains("duplicate") && text(&again).contains("in the day from 2026-10-25"),
        "{}",
        text(&again)
    );

    // NDJSON lines with and without "at"; one far ahead, one malformed.
    let ahead = humantime::format_rfc3339_seconds(SystemTime::now() + DAY).to_string();
    let lines = format!(
        "{{\"event\": \"evt-2\", \"key\": \"home\", \"at\": \"2026-10-24T23:00:00+02:00\"}}\n\
         {{\"event\": \"evt-3\", \"key\": \"home\", \"by\": 8, \"at\": \"2026-10-25T01:00:00Z\"}}\n\
         {{\"event\": \"evt-4\", \"key\": \"home\", \"at\": \"{ahead}\"}}\n\
         {{\"event\": \"evt-5\", \"key\": \"home\", \"at\": \"yesterday\"}}\n"
    );
    let file = dir.path().join("events.ndjson");
    std::fs::write(&file, lines).unwrap();
    let from = tallyd_with(
        &path,
        &[
            "record",
            "--from",
            file.to_str().unwrap(),
            "--json",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(from.status.code(), Some(1), "{}", text(&from));
    let outcomes: Vec<serde_json::Value> = String::from_utf8_lossy(&from.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let names: Vec<&str> = outcomes
        .iter()
        .map(|o| o["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["recorded", "recorded", "not_recorded", "malformed"],
        "{outcomes:?}"
    );
    assert_eq!(outcomes[0]["bucket"], "2026-10-24T00:00:00+02:00");
    assert_eq!(outcomes[1]["bucket"], "2026-10-25T00:00:00+02:00");
    assert!(
        outcomes[2]["error"]
            .as_str()
            .unwrap()
            .contains("ahead of this writer's clock"),
        "{}",
        outcomes[2]
    );

    let store = ctx.client(false).await.store();
    fold_all(&fold_of(&store, "views")).await;
    let coll = store.collection("views");
    assert_eq!(
        counter(&coll, id("home", "2026-10-24T22:00:00Z")).await,
        1 + 2 + 4 + 8
    );
    assert_eq!(counter(&coll, id("home", "2026-10-23T22:00:00Z")).await, 1);
    assert_eq!(ids(&ctx, "views").await.len(), 2);
}

#[tokio::test]
async fn a_time_refused_by_the_command_line_says_why_with_its_exit_code() {
    let ctx = TestContext::new("buckets_cli_refused").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &bucketed_config(&ctx));
    // A time that is neither form: usage, naming the forms.
    for args in [
        &["incr", "home", "--at", "yesterday", "--collection", "views"][..],
        &[
            "record",
            "e",
            "home",
            "--at",
            "28/11/2026",
            "--collection",
            "views",
        ][..],
    ] {
        let refused = tallyd_with(&path, args).await;
        assert_eq!(refused.status.code(), Some(64), "{}", text(&refused));
        assert!(
            text(&refused).contains("RFC 3339") && text(&refused).contains("2026-11-28"),
            "{}",
            text(&refused)
        );
    }
    // A time for a collection without buckets: usage.
    let plain = tallyd_with(
        &path,
        &[
            "incr",
            "home",
            "--at",
            "2026-11-28",
            "--collection",
            "plain",
        ],
    )
    .await;
    assert_eq!(plain.status.code(), Some(64), "{}", text(&plain));
    assert!(text(&plain).contains("has no buckets"), "{}", text(&plain));
    // Far ahead, and closed: the event's verdict, exit 1, not counted.
    let ahead = humantime::format_rfc3339_seconds(SystemTime::now() + DAY).to_string();
    let future = tallyd_with(
        &path,
        &[
            "incr",
            "home",
            "--at",
            &ahead,
            "--json",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(future.status.code(), Some(1), "{}", text(&future));
    assert_eq!(json(&future)["outcome"], "not_counted");
    let closed = tallyd_with(
        &path,
        &[
            "record",
            "e",
            "home",
            "--at",
            "2020-01-01",
            "--collection",
            "views",
        ],
    )
    .await;
    assert_eq!(closed.status.code(), Some(1), "{}", text(&closed));
    assert!(
        text(&closed).contains("not recorded") && text(&closed).contains("takes no more writes"),
        "{}",
        text(&closed)
    );
    assert!(ids(&ctx, "views").await.is_empty(), "nothing written");
    // `get KEY` of a bucketed collection has no document to read: usage.
    let get = tallyd_with(&path, &["get", "home", "--collection", "views"]).await;
    assert_eq!(get.status.code(), Some(64), "{}", text(&get));
    assert!(
        text(&get).contains("--from TIME --to TIME"),
        "{}",
        text(&get)
    );
}

/// A bucketed `incr` whose step 2 is refused is pending; its hint repeats
/// `--at` with the bucket's start, and following it counts the token in
/// that bucket. Without `--at`, `complete` of a bucketed counter is a
/// usage error.
#[tokio::test]
async fn a_pending_bucketed_increment_is_completed_in_its_bucket_by_its_hint() {
    let ctx = TestContext::new("buckets_cli_pending").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &bucketed_config(&ctx));
    let pending = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "skip": 1, "times": 1 }),
            doc! { "failCommands": ["update"], "errorCode": 2 },
        )
        .await;
        let args = [
            "incr",
            "k",
            "--by",
            "2",
            "--at",
            "2026-10-25T23:30:00+01:00",
        ];
        tallyd_with(&path, &[&args[..], &["--collection", "views"]].concat()).await
    };
    assert_eq!(pending.status.code(), Some(75), "{}", text(&pending));
    let hint = hint(&pending);
    assert!(
        hint.contains(" --at 2026-10-25T00:00:00+02:00"),
        "{}",
        text(&pending)
    );
    let words = hint_command(&hint);
    let without_at: Vec<&str> = words
        .iter()
        .copied()
        .filter(|w| *w != "--at" && !w.starts_with("2026-10-25"))
        .collect();
    let refused = tallyd_with(&path, &without_at).await;
    assert_eq!(refused.status.code(), Some(64), "{}", text(&refused));
    assert!(text(&refused).contains("give --at"), "{}", text(&refused));

    let completed = tallyd_with(&path, &words).await;
    assert_eq!(completed.status.code(), Some(0), "{}", text(&completed));
    assert!(
        text(&completed).contains("counted: views/k in the day from 2026-10-25T00:00:00+02:00 +2"),
        "{}",
        text(&completed)
    );
    let coll = ctx.client(false).await.collection("views");
    assert_eq!(counter(&coll, id("k", "2026-10-24T22:00:00Z")).await, 2);
    assert_eq!(ids(&ctx, "views").await.len(), 1);
}

/// The fold of leftover pending tokens works on a bucketed counter as on
/// any: a stale token in a bucket's document is counted there, once.
#[tokio::test]
async fn a_leftover_token_in_a_buckets_document_is_folded_into_that_bucket() {
    let ctx = TestContext::new("buckets_fold_token").await;
    let client = ctx.client(false).await;
    let bucket = id("home", "2026-10-24T22:00:00Z");
    let stale = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    client
        .collection("views")
        .insert_one(doc! { "_id": bucket.clone(), "counter": 5i64, "pending": [{ "t": stale.object_id(), "n": 3i64 }] })
        .await
        .unwrap();
    let target = FoldTarget {
        spec: bucketed("views", &berlin_days()),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    for _ in 0..2 {
        run_reconcile(&client.store(), &target, Mode::Fold).await;
    }
    let coll = client.collection("views");
    assert_eq!(counter(&coll, bucket.clone()).await, 8);
    assert_eq!(pending_len(&coll, bucket).await, 0);
    assert_eq!(ids(&ctx, "views").await.len(), 1);
}

/// Every command that finds a bucketed counter by its `_id` — the
/// two-step increment's steps, a lane's update, a read, the ledger's fold
/// and exact read, the fold of a leftover token — asks by the dotted fields
/// of the `_id` as well (`_id.k`, `_id.t`: what the index by key and
/// bucket serves, where the test server scans for a document `_id`), and a
/// counter's events by those of their counter (`k.k`, `k.t`). A plain
/// collection's filters are `{_id: key, …}` as they always were.
#[tokio::test]
async fn a_bucketed_counter_is_asked_for_by_its_dotted_fields_and_a_plain_one_as_ever() {
    let ctx = TestContext::new("buckets_dotted").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let store = through.store();
    let days = berlin_days();
    let views = Counters::new(&store, bucketed("views", &days), WriterConfig::default());
    let plain = Counters::new(
        &store,
        CollectionConfig::new("plain"),
        WriterConfig::default(),
    );
    let orders = Ledger::new(&store, bucketed("orders", &days));
    orders.create_indexes().await.unwrap();
    let at = days.parse_time("2026-10-25T12:00:00+01:00").unwrap();
    let bucket = id("home", "2026-10-24T22:00:00Z");
    assert!(matches!(
        views.increment_at("home", 1, at).await,
        Increment::Counted(_)
    ));
    assert!(matches!(
        views.add_at("home", 2, at).await,
        LaneIncrement::Counted(_)
    ));
    assert_eq!(
        views.value(bucket.clone()).await.unwrap(),
        Some(Bson::Int64(3))
    );
    assert!(matches!(
        plain.increment("home", 1).await,
        Increment::Counted(_)
    ));
    assert!(matches!(
        plain.add("home", 2).await,
        LaneIncrement::Counted(_)
    ));
    assert_eq!(plain.value("home").await.unwrap(), Some(Bson::Int64(3)));
    assert_outcome(&orders.record_at("o-1", "acme", 5, at).await, "recorded");
    let acme = id("acme", "2026-10-24T22:00:00Z");
    assert_eq!(
        orders.value(acme.clone()).await.unwrap().value,
        5,
        "unfolded"
    );
    fold_all(&fold_of(&store, "orders")).await;
    assert_eq!(orders.value(acme.clone()).await.unwrap().value, 5, "folded");
    // A leftover token in a bucket's document, folded.
    let stale = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    let other = id("other", "2026-10-24T22:00:00Z");
    ctx.client(false)
        .await
        .collection("views")
        .insert_one(doc! { "_id": other.clone(), "counter": 0i64, "pending": [{ "t": stale.object_id(), "n": 4i64 }] })
        .await
        .unwrap();
    let target = FoldTarget {
        spec: bucketed("views", &days),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    run_reconcile(&store, &target, Mode::Fold).await;
    let direct = ctx.client(false).await.collection("views");
    assert_eq!(counter(&direct, other).await, 4);

    // Each filter of a counter by `_id` (`path` "_id") or of events by
    // their counter (`path` "k"): dotted for a bucket, plain otherwise.
    let mut seen: Vec<(String, &str)> = Vec::new();
    for exchange in proxy.log() {
        let (Some(command), Some(collection)) = (&exchange.command, &exchange.collection) else {
            continue;
        };
        let filters: Vec<Document> = match command.as_str() {
            "update" => exchange
                .body
                .get_array("updates")
                .unwrap()
                .iter()
                .map(|u| u.as_document().unwrap().get_document("q").unwrap().clone())
                .collect(),
            "find" => vec![exchange.body.get_document("filter").unwrap().clone()],
            _ => continue,
        };
        let path = match collection.as_str() {
            "views" | "plain" | "orders" => "_id",
            "orders_events" => "k",
            _ => continue,
        };
        for filter in filters.into_iter().filter(|f| f.contains_key(path)) {
            let dotted = [format!("{path}.k"), format!("{path}.t")];
            if collection == "plain" {
                assert_eq!(
                    filter.keys().next().map(String::as_str),
                    Some("_id"),
                    "{filter}"
                );
                assert!(!filter.keys().any(|k| k.starts_with("_id.")), "{filter}");
            } else {
                assert!(
                    dotted.iter().all(|d| filter.contains_key(d)),
                    "{command} on {collection}: {filter}"
                );
            }
            seen.push((
                collection.clone(),
                if command == "update" {
                    "update"
                } else {
                    "find"
                },
            ));
        }
    }
    for (collection, command) in [
        ("views", "update"),
        ("views", "find"),
        ("plain", "update"),
        ("plain", "find"),
        ("orders", "update"),
        ("orders", "find"),
        ("orders_events", "find"),
    ] {
        assert!(
            seen.iter().any(|(c, m)| c == collection && *m == command),
            "no {command} on {collection} by its counter: {seen:?}"
        );
    }
}

/// A named lane (a Kafka partition) knows a message delivered again by its
/// position, kept in the counter document it wrote (found by review): in a
/// bucketed collection it writes with the message's own time, so the same
/// message delivered again — after the clock's bucket changed too — goes
/// to the same document and counts once. Without a time it is refused,
/// nothing sent: at now, the redelivery would find the next bucket's
/// document, where the lane holds no position, and count twice.
#[tokio::test]
async fn a_named_lane_writes_with_the_messages_time_and_a_redelivery_counts_once() {
    let ctx = TestContext::new("buckets_named_lane").await;
    let client = ctx.client(false).await;
    let minutes = Buckets::utc(BucketWidth::Minute);
    let views = Counters::new(
        &client.store(),
        bucketed("views", &minutes),
        WriterConfig::default(),
    );
    let lane = tally::LaneName::new("orders-3").unwrap();
    let refused = views.add_from("home", 1, &lane, 41).await;
    match &refused {
        LaneIncrement::NotCounted(not) => {
            assert!(
                matches!(not.cause(), Error::InvalidArgument(_)),
                "{refused:?}"
            );
            assert!(
                not.cause().to_string().contains("add_from_at"),
                "{refused:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(ids(&ctx, "views").await.is_empty(), "nothing sent");
    // The message's time: a minute ago. Delivered twice, counted once.
    let stamped = SystemTime::now() - Duration::from_secs(60);
    let first = views.add_from_at("home", 1, &lane, 41, stamped).await;
    assert!(matches!(first, LaneIncrement::Counted(_)), "{first:?}");
    let again = views.add_from_at("home", 1, &lane, 41, stamped).await;
    match &again {
        LaneIncrement::Counted(counted) => assert!(counted.settled_earlier(), "{again:?}"),
        other => panic!("{other:?}"),
    }
    let coll = client.collection("views");
    let bucket = bucket_id_of("home", minutes.start_of(stamped).unwrap());
    assert_eq!(counter(&coll, bucket).await, 1);
    assert_eq!(ids(&ctx, "views").await.len(), 1);
}

fn bucket_id_of(key: &str, start: SystemTime) -> Bson {
    Bson::Document(doc! { "k": key, "t": DateTime::from_system_time(start) })
}
