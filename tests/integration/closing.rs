//! Closing buckets: a run closes every bucket past its closing time — once
//! its fold took what it held — removing its settle markers, its minted
//! lanes' entries and an empty pending array, keeping its counter and its
//! named lanes, and marking it `closed`; a bucket that still holds work, or
//! cannot be judged, stays open and is reported; a bucket not due stays
//! open; a second run changes nothing.
//!
//! The writers keep their buckets open for a year and a half (so that the
//! days of October 2026 take writes); the fold closes the same buckets
//! seconds after they end. The oracle is the documents, read directly.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tally::{
    Buckets, CollectionConfig, Counters, EventFold, EventFoldSettings, FoldTarget, Increment,
    LaneIncrement, Ledger, Mode, Reconciler, Token, WriterConfig,
};
use tokio_util::sync::CancellationToken;

use crate::buckets::{berlin_days, bucketed};
use crate::cli::{tallyd, write_config};
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, wait_until};
use crate::daemon::LONG;
use crate::doctor::{doctor, verdict};
use crate::ledger::assert_outcome;

/// The writers' days of Berlin, and the fold's: the same buckets, closed
/// two seconds after they end.
fn closing_days() -> Buckets {
    berlin_days()
        .with_close_after(Duration::from_secs(1))
        .with_closing_margin(Duration::from_secs(1))
}

fn target(spec: CollectionConfig) -> FoldTarget {
    FoldTarget {
        spec,
        grace: Duration::from_secs(1),
        batch_size: 2,
    }
}

/// `key`'s day of Berlin holding `date` (`YYYY-MM-DD`), as an `_id`.
fn day(key: &str, date: &str) -> Bson {
    let start = berlin_days().parse_time(date).unwrap();
    Bson::Document(doc! { "k": key, "t": DateTime::from_system_time(start) })
}

async fn document(coll: &mongodb::Collection<Document>, id: &Bson) -> Document {
    coll.find_one(doc! { "_id": id.clone() })
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("no document {id}"))
}

/// A document's counter, of either integer type.
fn counter_of(found: &Document) -> i64 {
    match found.get("counter") {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        other => panic!("counter {other:?} in {found}"),
    }
}

/// One run at the server's time plus `ahead`.
async fn run(
    store: &tally::Store,
    target: &FoldTarget,
    mode: Mode,
    ahead: Duration,
) -> tally::CollectionRun {
    let reconciler = Reconciler::new(store);
    let now = reconciler.server_time().await.unwrap() + ahead;
    let run = reconciler
        .reconcile(target, mode, now, &CancellationToken::new(), &mut |_| {})
        .await;
    assert!(run.error.is_none(), "{:?}", run.error);
    run
}

#[tokio::test]
async fn due_buckets_close_compact_and_final_and_the_others_stay_open_and_reported() {
    let ctx = TestContext::new("closing_counters").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let views = Counters::new(
        &store,
        bucketed("views", &berlin_days()),
        WriterConfig::default(),
    );
    let at = |text: &str| berlin_days().parse_time(text).unwrap();
    // Two-step increments and lanes, with group commit.
    for amount in [1, 2, 4] {
        let outcome = views
            .increment_at("home", amount, at("2026-10-25T12:00:00+01:00"))
            .await;
        assert!(matches!(outcome, Increment::Counted(_)), "{outcome:?}");
    }
    for amount in [8, 16] {
        let outcome = views
            .add_at("home", amount, at("2026-10-26T12:00:00+01:00"))
            .await;
        assert!(matches!(outcome, LaneIncrement::Counted(_)), "{outcome:?}");
    }
    let coll = client.collection("views");
    let hour_ago = Token::created_at_time(SystemTime::now() - Duration::from_secs(3600));
    let ahead = Token::created_at_time(SystemTime::now() + Duration::from_secs(3600));
    let marker = Token::created_at_time(SystemTime::now() - Duration::from_secs(60));
    let crafted = [
        // A leftover token the run folds first, and a settle marker.
        doc! { "_id": day("home", "2026-10-27"), "counter": 10i64,
        "pending": [{ "t": hour_ago.object_id(), "n": 5i64 }],
        "settled": [{ "t": marker.object_id(), "n": 1i64 }] },
        // A token younger than the grace: it stays, and so does the bucket.
        doc! { "_id": day("home", "2026-10-28"), "counter": 1i64,
        "pending": [{ "t": ahead.object_id(), "n": 2i64 }] },
        // Malformed: never modified.
        doc! { "_id": day("home", "2026-10-29"), "counter": 3i64, "pending": "x" },
        // A named lane, kept, beside a minted one, removed.
        doc! { "_id": day("home", "2026-10-30"), "counter": 7i64,
        "lanes": { "kafka-0": 7i64, ObjectId::new().to_hex(): 1i64 } },
        // Empty fields go.
        doc! { "_id": day("home", "2026-10-31"), "counter": 0i64, "pending": [], "settled": [] },
    ];
    coll.insert_many(crafted).await.unwrap();
    let today = views.increment("home", 32).await;
    assert!(matches!(today, Increment::Counted(_)), "{today:?}");

    let target = target(bucketed("views", &closing_days()));
    let first = run(&store, &target, Mode::Fold, Duration::from_secs(5)).await;
    let closing = first.buckets.clone().expect("a bucketed collection");
    assert_eq!(closing.closed, 5, "{closing:?}");
    assert_eq!(closing.unclosed, 2, "{closing:?}");
    assert_eq!(closing.open, 3, "the two unclosed and today's: {closing:?}");
    assert_eq!(closing.oldest_open, Some(at("2026-10-28")));
    let reasons: Vec<&str> = closing
        .unclosed_sample
        .iter()
        .map(|u| u.reason.as_str())
        .collect();
    assert!(reasons[0].contains("1 pending entry"), "{reasons:?}");
    assert!(reasons[1].starts_with("malformed"), "{reasons:?}");

    let expect = [
        ("2026-10-25", 7, None),
        ("2026-10-26", 24, None),
        ("2026-10-27", 15, None),
        ("2026-10-30", 7, Some(doc! { "kafka-0": 7i64 })),
        ("2026-10-31", 0, None),
    ];
    let mut closed_at = Vec::new();
    for (date, value, lanes) in expect.clone() {
        let found = document(&coll, &day("home", date)).await;
        let keys: Vec<&str> = found.keys().map(String::as_str).collect();
        let mut want = vec!["_id", "counter", "closed"];
        if lanes.is_some() {
            want.push("lanes");
        }
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        want.sort_unstable();
        assert_eq!(sorted, want, "{date}: {found}");
        assert_eq!(counter_of(&found), value, "{date}");
        assert_eq!(found.get_document("lanes").ok(), lanes.as_ref(), "{date}");
        closed_at.push(found.get_datetime("closed").unwrap().to_owned());
    }
    let young = document(&coll, &day("home", "2026-10-28")).await;
    assert!(young.get("closed").is_none() && young.get_array("pending").unwrap().len() == 1);
    let malformed = document(&coll, &day("home", "2026-10-29")).await;
    assert_eq!(
        malformed,
        doc! { "_id": day("home", "2026-10-29"), "counter": 3i64, "pending": "x" }
    );

    // Again: nothing changes, the closed buckets keep their date.
    let second = run(&store, &target, Mode::Fold, Duration::from_secs(6)).await;
    let again = second.buckets.expect("a bucketed collection");
    assert_eq!(
        (again.closed, again.unclosed, again.open),
        (0, 2, 3),
        "{again:?}"
    );
    for ((date, _, _), was) in expect.iter().zip(&closed_at) {
        let found = document(&coll, &day("home", date)).await;
        assert_eq!(found.get_datetime("closed").unwrap(), was, "{date}");
    }
}

#[tokio::test]
async fn a_ledgers_bucket_closes_once_its_events_are_folded_and_keeps_the_fold_lane() {
    let ctx = TestContext::new("closing_ledger").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let spec = bucketed("orders", &berlin_days()).with_events_collection("orders_events");
    let ledger = Ledger::new(&store, spec.clone());
    ledger.create_indexes().await.unwrap();
    let at = berlin_days()
        .parse_time("2026-10-25T12:00:00+01:00")
        .unwrap();
    for (event, amount) in [("e1", 1), ("e2", 2)] {
        let recorded = ledger.record_at(event, "home", amount, at).await;
        assert_outcome(&recorded, "recorded");
    }
    let fold = EventFold::new(&store, spec, EventFoldSettings::default());
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .unwrap();
    let recorded = ledger.record_at("e3", "home", 4, at).await;
    assert_outcome(&recorded, "recorded");

    let target =
        target(bucketed("orders", &closing_days()).with_events_collection("orders_events"));
    // A dry run folds nothing: the event not folded keeps the bucket open.
    let preview = run(&store, &target, Mode::DryRun, Duration::from_secs(5)).await;
    let closing = preview.buckets.expect("a bucketed collection");
    assert_eq!((closing.closed, closing.unclosed), (0, 1), "{closing:?}");
    assert_eq!(
        closing.unclosed_sample[0].reason,
        "its ledger holds 1 recorded event not folded yet"
    );

    let first = run(&store, &target, Mode::Fold, Duration::from_secs(5)).await;
    assert_eq!(first.events_folded, 1);
    let closing = first.buckets.expect("a bucketed collection");
    assert_eq!(
        (closing.closed, closing.unclosed, closing.open),
        (1, 0, 0),
        "{closing:?}"
    );
    let id = day("home", "2026-10-25");
    let found = document(&client.collection("orders"), &id).await;
    assert_eq!(counter_of(&found), 7, "{found}");
    assert!(found.get_datetime("closed").is_ok(), "{found}");
    let lanes = found.get_document("lanes").expect("the fold's lane stays");
    assert_eq!(lanes.len(), 1, "{found}");

    // The exact read still counts every event once, and says it is final.
    let read = ledger.value(id).await.unwrap();
    assert_eq!((read.value, read.closed), (7, true));
    // A range read: the closed day, an empty day past its closing time
    // (final too), and today, open.
    let closing = Ledger::new(&store, target.spec.clone());
    let (from, to) = (berlin_days().start_of(at).unwrap(), SystemTime::now());
    let range = closing
        .values_between("home", from, to, None)
        .await
        .unwrap();
    let first_two: Vec<(i64, bool)> = range.buckets[..2]
        .iter()
        .map(|b| (b.value, b.closed))
        .collect();
    assert_eq!(first_two, [(7, true), (0, true)]);
    let today = range.buckets.last().unwrap();
    assert_eq!((today.value, today.closed), (0, false), "{range:?}");
}

/// `tallyd setup` makes the index closing reads the open buckets through,
/// for a bucketed collection only; `doctor` flags it until then, and a
/// closing run's reads of open buckets use it.
#[tokio::test]
async fn setup_makes_the_open_buckets_index_and_doctor_flags_it_until_then() {
    let ctx = TestContext::new("closing_index").await;
    let client = ctx.client(false).await;
    let calls = client.collection("calls");
    calls
        .insert_one(doc! { "_id": day("home", "2026-10-25"), "counter": 1i64 })
        .await
        .unwrap();
    let text = format!(
        "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"5s\"\n\
         [[collections]]\nname = \"calls\"\nbucket = \"day\"\n\
         [[collections]]\nname = \"views\"\n",
        ctx.child_uri(false),
        ctx.db_name
    );
    let (_, checks, _) = doctor(&text, &[]).await;
    let (found, message) = verdict(&checks, "bucket_indexes:calls");
    assert_eq!(found, "warn", "{message}");
    assert!(message.contains("run `tallyd setup`"), "{message}");
    assert!(!checks.contains_key("bucket_indexes:views"), "{checks:?}");

    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &text);
    let setup = tallyd(&["--config", path.as_str(), "setup"], &[]).await;
    assert!(setup.status.success(), "{setup:?}");
    let said = String::from_utf8_lossy(&setup.stdout);
    assert!(said.contains("calls: index tally_buckets_open"), "{said}");
    assert!(!said.contains("views: index tally_buckets_open"), "{said}");
    let (_, checks, _) = doctor(&text, &[]).await;
    let (found, message) = verdict(&checks, "bucket_indexes:calls");
    assert_eq!(found, "ok", "{message}");

    // The open buckets are found through it, not by a scan.
    let open = doc! { "closed": Bson::Null, "_id.t": { "$lt": DateTime::now() } };
    let plan = calls
        .client()
        .database(&ctx.db_name)
        .run_command(
            doc! { "explain": { "find": "calls", "filter": open }, "verbosity": "queryPlanner" },
        )
        .await
        .unwrap();
    let winning = plan
        .get_document("queryPlanner")
        .unwrap()
        .get_document("winningPlan")
        .unwrap()
        .to_string();
    assert!(winning.contains("tally_buckets_open"), "{winning}");
}

/// The daemon's scheduled runs close due buckets, export what they did and
/// raise `buckets_unclosed` for a bucket they cannot close, until it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_closes_due_buckets_and_alerts_on_one_it_cannot_close() {
    let ctx = TestContext::new("closing_daemon").await;
    let client = ctx.client(false).await;
    let calls = client.collection("calls");
    let minutes = Buckets::utc(tally::BucketWidth::Minute);
    let start = minutes
        .start_of(SystemTime::now() - Duration::from_secs(600))
        .unwrap();
    let id = |key: &str| Bson::Document(doc! { "k": key, "t": DateTime::from_system_time(start) });
    let marker = Token::created_at_time(SystemTime::now() - Duration::from_secs(900));
    // A lane minted ten minutes ago: older than the closing margin.
    let old_lane = Token::created_at_time(SystemTime::now() - Duration::from_secs(600)).object_id();
    calls
        .insert_many([
            doc! { "_id": id("a"), "counter": 3i64,
            "settled": [{ "t": marker.object_id(), "n": 1i64 }],
            "lanes": { old_lane.to_hex(): 1i64 } },
            doc! { "_id": id("b"), "counter": 1i64, "pending": "x" },
        ])
        .await
        .unwrap();
    // The closing margin: max(6s, 5s) + 3s + 10s = 19s; close_after at
    // least max(6s + 3s + 10s, 5s + 3s).
    let text = format!(
        r#"
[mongodb]
uri = "{}"
database = "{}"
server_selection_timeout = "2s"
attempt_timeout = "3s"
[[collections]]
name = "calls"
bucket = "minute"
close_after = "19s"
[writer]
retry_horizon = "6s"
lane_resume_horizon = "5s"
lane_ttl = "12s"
[reconcile]
grace = "10s"
[schedule]
cron = "* * * * * *"
catch_up = true
[monitor]
enabled = false
"#,
        ctx.child_uri(false),
        ctx.db_name
    );
    let daemon = Tallyd::start(&text, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    daemon
        .wait_metric(
            "tally_buckets_closed_total{collection=\"calls\"}",
            1.0,
            LONG,
        )
        .await;
    let firing = "tally_alerts_firing{collection=\"calls\",kind=\"buckets_unclosed\"}";
    daemon.wait_metric(firing, 1.0, LONG).await;
    assert_eq!(
        daemon
            .metric("tally_buckets_unclosed{collection=\"calls\"}")
            .await,
        Some(1.0)
    );
    let closed = document(&calls, &id("a")).await;
    assert_eq!(
        closed.keys().map(String::as_str).collect::<Vec<_>>(),
        ["_id", "counter", "closed"],
        "{closed}"
    );

    // Fixed, the next run closes it and the alert resolves.
    calls
        .update_one(doc! { "_id": id("b") }, doc! { "$set": { "pending": [] } })
        .await
        .unwrap();
    daemon
        .wait_metric(
            "tally_buckets_closed_total{collection=\"calls\"}",
            2.0,
            LONG,
        )
        .await;
    wait_until("the alert resolved", LONG, || async {
        daemon.metric(firing).await == Some(0.0)
            && daemon
                .metric("tally_buckets_unclosed{collection=\"calls\"}")
                .await
                == Some(0.0)
    })
    .await;
    assert_eq!(
        daemon
            .metric("tally_buckets_open{collection=\"calls\"}")
            .await,
        Some(0.0)
    );
}

/// A close command whose reply is lost is sent again, matches nothing (the
/// first closed them), and the run still says it closed them — not that
/// writers raced it.
#[tokio::test]
async fn a_lost_reply_to_closing_still_counts_the_buckets_closed() {
    let ctx = TestContext::new("closing_lost_reply").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let calls = ctx.client(false).await.collection("calls");
    // A minted lane's entry younger than lane_ttl: the fold keeps it,
    // closing removes it.
    let lane = ObjectId::new().to_hex();
    calls
        .insert_many(["2026-10-25", "2026-10-26", "2026-10-27"].map(|date| {
            doc! { "_id": day("home", date), "counter": 1i64, "lanes": { &lane: 1i64 } }
        }))
        .await
        .unwrap();
    let _lost = proxy.rule(
        Rule::command("update")
            .collection("calls")
            .nth(1)
            .then(Action::DropReply),
    );
    let target = target(bucketed("calls", &closing_days()));
    let run = run(
        &through.store(),
        &target,
        Mode::Fold,
        Duration::from_secs(5),
    )
    .await;
    let closing = run.buckets.expect("a bucketed collection");
    assert_eq!((closing.closed, closing.raced), (3, 0), "{closing:?}");
    for date in ["2026-10-25", "2026-10-26", "2026-10-27"] {
        let found = document(&calls, &day("home", date)).await;
        assert!(
            found.get_datetime("closed").is_ok() && found.get("lanes").is_none(),
            "{found}"
        );
    }
    let updates = proxy
        .log()
        .iter()
        .filter(|e| e.command.as_deref() == Some("update"))
        .filter(|e| e.collection.as_deref() == Some("calls"))
        .count();
    assert_eq!(updates, 3, "the first close command twice, the second once");
}

/// A collection counted by month reconfigured to days (found by review):
/// a month's document starts on a day, so it is due as its first day, a
/// month early. It holds the minted lane entry of an update made minutes
/// ago, whose resend a writer may still send: closing waits until the
/// entry is older than the closing margin, says why, and the resend counts
/// once. Before, closing removed the entry and the resend counted again.
#[tokio::test]
async fn a_bucket_holding_an_entry_younger_than_the_margin_waits_after_the_width_changed() {
    const DAY: Duration = Duration::from_secs(24 * 3600);
    let ctx = TestContext::new("closing_width_changed").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let months = Buckets::utc(tally::BucketWidth::Month).with_close_after(60 * DAY);
    let views = Counters::try_new(
        &store,
        CollectionConfig::new("views").with_buckets(months.clone()),
        WriterConfig::default(),
    )
    .unwrap();
    // An event of ten days before this month: last month's bucket, open.
    let at = months.start_of(SystemTime::now()).unwrap() - 10 * DAY;
    let counted = match views.add_at("home", 1, at).await {
        LaneIncrement::Counted(counted) => counted,
        other => panic!("{other:?}"),
    };
    // The writer never heard back, as far as it knows: its ticket.
    let ticket = tally::LaneTicket::new(
        counted.key().clone(),
        counted.lane().clone(),
        counted.position(),
        1,
    )
    .unwrap();
    // The fold, reconfigured to days, every other setting its default.
    let days = FoldTarget {
        spec: CollectionConfig::new("views").with_buckets(Buckets::utc(tally::BucketWidth::Day)),
        grace: Duration::from_secs(15 * 60),
        batch_size: 100,
    };
    let first = run(&store, &days, Mode::Fold, Duration::ZERO).await;
    let closing = first.buckets.expect("a bucketed collection");
    assert_eq!((closing.closed, closing.unclosed), (0, 1), "{closing:?}");
    assert!(
        closing.unclosed_sample[0]
            .reason
            .contains("a lane's entry written less than the closing margin"),
        "{closing:?}"
    );
    let resumed = views.resume_lane(ticket).await.unwrap();
    assert!(matches!(resumed, LaneIncrement::Counted(_)), "{resumed:?}");
    let coll = client.collection("views");
    let bucket = months.start_of(at).unwrap();
    let id = Bson::Document(doc! { "k": "home", "t": DateTime::from_system_time(bucket) });
    assert_eq!(counter_of(&document(&coll, &id).await), 1);
    // Once the entry is older than the margin, it closes.
    let later = run(
        &store,
        &days,
        Mode::Fold,
        Buckets::utc(tally::BucketWidth::Day).closing_margin() + Duration::from_secs(60),
    )
    .await;
    assert_eq!(later.buckets.map(|b| b.closed), Some(1));
}
