//! The eight findings of the ledger's outside review (issue "The ledger as
//! an append-only log"), each reproduced as a user meets it: through the
//! command line, the daemon or the library. Every test here failed before
//! the ledger became an append-only log folded by lane ranges.
//!
//! The oracle is what the test recorded and what is stored, never what the
//! code under test reports.

use std::time::{Duration, Instant};

use mongodb::bson::{Bson, doc, oid::ObjectId};
use tally::{CollectionConfig, FoldTarget, Ledger, Mode, Store};
use tokio_util::sync::CancellationToken;

use crate::cli::{tallyd, text, write_config};
use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, counter, field, run_reconcile, wait_until};
use crate::ledger::{assert_outcome, fold_of, ledger_on};
use crate::ledger_daemon::config;

/// `check-config` on `collections` (TOML tables) plus `extra`: its exit
/// code and everything it printed.
async fn check_config(ctx: &TestContext, body: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, body));
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    (output.status.code(), text(&output))
}

/// Finding 1: an events collection shared by two ledgers counted one
/// ledger's events on the other's counters; one equal to a counter
/// collection made the fold claim and mark counter documents (and `setup`
/// put a TTL index on them). Both, and an events collection equal to the
/// daemon's state collection or to another ledger's fold state, are
/// configuration errors.
#[tokio::test]
async fn an_events_collection_shared_with_another_ledger_or_a_counter_collection_is_refused() {
    let ctx = TestContext::new("ledger_finding_names").await;
    let cases = [
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"log\"\n[[collections]]\nname = \
             \"b\"\nevents_collection = \"log\"\n",
            "collections[1].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"b\"\n[[collections]]\nname = \
             \"b\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"a\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nevents_collection = \"tally_state\"\n",
            "collections[0].events_collection",
        ),
        (
            "[[collections]]\nname = \"a\"\nledger = true\n[[collections]]\nname = \
             \"b\"\nevents_collection = \"a_events_fold\"\n",
            "collections[1].events_collection",
        ),
    ];
    for (body, key) in cases {
        let (code, shown) = check_config(&ctx, body).await;
        assert_eq!(code, Some(78), "{body}\n{shown}");
        assert!(shown.contains(&format!("  {key}: ")), "{body}\n{shown}");
    }
}

/// Finding 2: one counter the server refuses to update (here a string
/// counter) stopped its ledger for good: every later pass retried the same
/// batch first and failed, and the other counters' events were never
/// folded again. Now its sum is held aside and every other counter keeps
/// folding.
#[tokio::test]
async fn a_counter_the_server_refuses_never_stops_the_other_counters_of_its_ledger() {
    let ctx = TestContext::new("ledger_finding_refused").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let views = client.collection("views");
    views
        .insert_one(doc! { "_id": "bad", "counter": "not a number" })
        .await
        .unwrap();
    let ledger = ledger_on(&store, "views").await;
    let fold = fold_of(&store, "views");
    let stop = CancellationToken::new();
    assert_outcome(&ledger.record("e1", "bad", 1).await, "recorded");
    assert_outcome(&ledger.record("e2", "good", 1).await, "recorded");
    let _ = fold.fold(store_time(&store).await, &stop).await;
    assert_outcome(&ledger.record("e3", "good", 1).await, "recorded");
    let _ = fold.fold(store_time(&store).await, &stop).await;
    let _ = fold.fold(store_time(&store).await, &stop).await;
    assert_eq!(
        counter(&views, "good").await,
        2,
        "the good counter folds on"
    );
    assert_eq!(
        field(&views, "bad", "counter").await,
        Some(Bson::String("not a number".into())),
        "the refused counter is left as it is"
    );
}

/// Finding 3: any ledger failure (here: its indexes are missing) also
/// skipped the collection's pending-token fold and lane pruning in that
/// run.
#[tokio::test]
async fn a_ledger_that_cannot_fold_never_stops_the_token_fold_of_its_collection() {
    let ctx = TestContext::new("ledger_finding_token_fold").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let views = client.collection("views");
    // A token a crashed writer left an hour ago.
    let old = ObjectId::from_bytes({
        let mut bytes = ObjectId::new().bytes();
        let secs = u32::from_be_bytes(bytes[..4].try_into().unwrap()) - 3600;
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        bytes
    });
    views
        .insert_one(doc! { "_id": "a", "counter": 1i64, "pending": [old] })
        .await
        .unwrap();
    // A ledger without its indexes: the fold refuses it.
    let ledger = Ledger::new(
        &store,
        CollectionConfig::new("views").with_events_collection("log"),
    );
    assert!(ledger.record("e1", "a", 1).await.is_counted());
    let target = FoldTarget {
        spec: CollectionConfig::new("views").with_events_collection("log"),
        grace: Duration::from_secs(60),
        batch_size: 100,
    };
    let run = run_reconcile(&store, &target, Mode::Fold).await;
    assert!(run.error.is_some(), "the ledger's refusal is reported");
    assert_eq!(counter(&views, "a").await, 2, "the stale token is folded");
}

/// Finding 4: when the events change stream could not open (a standalone
/// server, a user without `changeStream`), the periodic pass never ran.
/// Now the pass runs every scan interval whatever the stream does, and
/// the stream's failure is a metric.
#[tokio::test]
async fn the_periodic_pass_folds_when_the_events_change_stream_cannot_open() {
    let ctx = TestContext::new("ledger_finding_no_stream").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let _no_streams = proxy.rule(
        Rule::command("aggregate")
            .mentions("$changeStream")
            .then(Action::error(13, "Unauthorized", &[])),
    );
    let config = ctx
        .config_toml(
            false,
            "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nfold_delay = \
             \"200ms\"\n[schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n[monitor]\n\
             scan_interval = \"1s\"\n",
        )
        .replace(&ctx.child_uri(false), &ctx.child_uri_through(&proxy, false));
    let daemon = Tallyd::start(&config, &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    assert_outcome(&ledger.record("e1", "home", 1).await, "recorded");
    let views = client.collection("views");
    wait_until(
        "the periodic pass folded the event",
        Duration::from_secs(30),
        || async { counter(&views, "home").await == 1 },
    )
    .await;
    daemon
        .wait_metric(
            "tally_events_stream_failures_total{collection=\"views\"}",
            1.0,
            Duration::from_secs(10),
        )
        .await;
}

/// Finding 5: while recording outpaced the fold, every pass hit its limit
/// and the backlog, the lag and `events_stuck` were never refreshed: with
/// tens of thousands of events behind and a writer still recording,
/// `/metrics` had no `tally_events_*` series at all. Now they are current
/// after every pass.
#[tokio::test]
async fn the_backlog_metrics_are_current_after_every_pass_while_a_writer_keeps_recording() {
    let ctx = TestContext::new("ledger_finding_backlog_metrics").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    const BACKLOG: usize = 20_000;
    let events: Vec<(String, String, i64)> = (0..BACKLOG)
        .map(|i| (format!("e{i}"), format!("k{}", i % 1000), 1))
        .collect();
    assert!(
        ledger
            .record_many(events)
            .await
            .iter()
            .all(|r| r.is_counted())
    );
    // A writer recording on, in batches, until the metric is seen.
    let writing = CancellationToken::new();
    let writer = tokio::spawn({
        let (ledger, writing) = (ledger.clone(), writing.clone());
        async move {
            let mut recorded = 0usize;
            while !writing.is_cancelled() {
                let events: Vec<(String, String, i64)> = (0..200)
                    .map(|i| (format!("w{}", recorded + i), "hot".to_owned(), 1))
                    .collect();
                let outcomes = ledger.record_many(events).await;
                assert!(outcomes.iter().all(|r| r.is_counted()));
                recorded += outcomes.len();
            }
            recorded
        }
    });
    let started = Instant::now();
    let daemon = Tallyd::start(&config(&ctx, ""), &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    let series = "tally_events_backlog{collection=\"views\"}";
    let lag = "tally_events_fold_lag_seconds{collection=\"views\"}";
    let deadline = Instant::now() + Duration::from_secs(40);
    while daemon.metric(series).await.is_none() || daemon.metric(lag).await.is_none() {
        assert!(
            Instant::now() < deadline,
            "no {series} or {lag} after {:?} while a writer records\n{}",
            started.elapsed(),
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    writing.cancel();
    let hot = writer.await.unwrap() as i64;
    let views = client.collection("views");
    wait_until("every event folded", Duration::from_secs(120), || async {
        counter(&views, "k0").await == (BACKLOG / 1000) as i64
            && counter(&views, "hot").await == hot
    })
    .await;
    wait_until(
        "the backlog metric says none",
        Duration::from_secs(30),
        || async { daemon.metric(series).await == Some(0.0) },
    )
    .await;
}

/// Finding 6: `tallyd record` into a collection with no ledger configured
/// said "recorded: it will be counted once", and nothing ever folded it.
/// `record` and `get` on such a collection are configuration errors.
#[tokio::test]
async fn record_and_get_on_a_collection_without_a_ledger_exit_78() {
    let ctx = TestContext::new("ledger_finding_no_ledger").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        &ctx.config_toml(false, "[[collections]]\nname = \"views\"\n"),
    );
    for args in [
        vec!["record", "e1", "home", "--collection", "views"],
        vec!["get", "home", "--collection", "views"],
    ] {
        let mut all = vec!["--config", path.as_str()];
        all.extend(args.iter().copied());
        let output = tallyd(&all, &[]).await;
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {shown}");
        assert!(shown.contains("ledger"), "{args:?}: {shown}");
    }
    let client = ctx.client(false).await;
    assert_eq!(
        client
            .collection("views_events")
            .count_documents(doc! {})
            .await
            .unwrap(),
        0,
        "nothing was recorded"
    );
}

/// Finding 7: `event_retention` had no floor (`"1s"` was accepted): an
/// insert whose reply was lost, folded and expired within the window, was
/// inserted again by its retry and counted twice.
#[tokio::test]
async fn an_event_retention_below_the_retry_horizon_and_an_attempt_exits_78_naming_the_keys() {
    let ctx = TestContext::new("ledger_finding_retention").await;
    let (code, shown) = check_config(
        &ctx,
        "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nevent_retention = \"1s\"\n",
    )
    .await;
    assert_eq!(code, Some(78), "{shown}");
    for key in [
        "reconcile.event_retention",
        "writer.retry_horizon",
        "mongodb.attempt_timeout",
    ] {
        assert!(shown.contains(key), "{key} not named:\n{shown}");
    }
}

/// Finding 8: counter keys compare equal on the server when nested numbers
/// differ in type (`{u: 5}` and `{u: NumberLong(5)}`), but the ledger
/// compared nested values byte for byte: a redelivery was told `conflict`.
#[tokio::test]
async fn the_same_event_on_a_counter_key_with_a_nested_number_of_another_type_is_a_duplicate() {
    let ctx = TestContext::new("ledger_finding_nested_key").await;
    let client = ctx.client(false).await;
    let ledger = ledger_on(&client.store(), "views").await;
    let int32 = Bson::Document(doc! { "u": 5i32, "at": { "day": 2.0f64 } });
    let int64 = Bson::Document(doc! { "u": 5i64, "at": { "day": 2i32 } });
    assert_outcome(&ledger.record("e1", int32, 1).await, "recorded");
    assert_outcome(&ledger.record("e1", int64, 1).await, "duplicate");
}

async fn store_time(store: &Store) -> std::time::SystemTime {
    tally::Reconciler::new(store)
        .server_time()
        .await
        .expect("server time")
}
