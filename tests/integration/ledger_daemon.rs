//! The events ledger through the `tallyd` binary: `setup`, `record`, `get`
//! and `status` as a user runs them, the daemon's continuous fold (within
//! `fold_delay` of new events, with no schedule and no scan to help), its
//! refusal to fold a ledger without indexes, and the soak: recorders
//! sending events twice while the daemon is killed with -9 again and
//! again.
//!
//! The oracle is the set of distinct event keys recorded.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mongodb::bson::doc;
use tally::{CollectionConfig, Ledger};

use crate::cli::{json, tallyd, text, write_config};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, counter, wait_until};

/// A config with the ledger of `views` on, no fold on the schedule and no
/// periodic scan within the test's time: only the change stream folds.
fn config(ctx: &TestContext, extra: &str) -> String {
    ctx.config_toml(
        false,
        &format!(
            "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nfold_delay = \
             \"200ms\"\n[schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n[monitor]\n\
             scan_interval = \"1h\"\n{extra}"
        ),
    )
}

#[tokio::test]
async fn setup_record_get_and_status_from_the_command_line() {
    let ctx = TestContext::new("ledger_cli").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &config(&ctx, ""));
    let run = |args: Vec<&str>| {
        let mut all = vec!["--config", path.as_str()];
        all.extend(args);
        let owned: Vec<String> = all.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            tallyd(&args, &[]).await
        }
    };
    let status = run(vec!["status", "--json"]).await;
    let missing = &json(&status)["ledgers"][0]["missing_indexes"];
    assert_eq!(
        missing.as_array().map(Vec::len),
        Some(3),
        "{}",
        text(&status)
    );

    // check-config --connect and doctor say what is missing, and fail.
    let checked = run(vec!["check-config", "--connect"]).await;
    assert_eq!(checked.status.code(), Some(1), "{}", text(&checked));
    let said = text(&checked);
    assert!(
        said.contains("fail  ledger_indexes (views_events): missing tally_events_folded")
            && said.contains("run `tallyd setup`"),
        "{said}"
    );
    let plain = run(vec!["check-config"]).await;
    assert_eq!(
        plain.status.code(),
        Some(0),
        "no connection without --connect"
    );
    let doctor = run(vec!["doctor", "--json"]).await;
    assert_eq!(doctor.status.code(), Some(1), "{}", text(&doctor));
    let ledger_check = json(&doctor)["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ledger_indexes")
        .cloned()
        .unwrap_or_else(|| panic!("no ledger check: {}", text(&doctor)));
    assert_eq!(ledger_check["verdict"], "fail", "{ledger_check}");
    assert_eq!(ledger_check["collection"], "views_events");

    let setup = run(vec!["setup"]).await;
    assert_eq!(setup.status.code(), Some(0), "{}", text(&setup));
    let checked = run(vec!["check-config", "--connect"]).await;
    assert_eq!(checked.status.code(), Some(0), "{}", text(&checked));
    assert!(
        text(&checked).contains("ok    ledger_indexes (views_events)"),
        "{}",
        text(&checked)
    );
    let doctor = run(vec!["doctor", "--json"]).await;
    let fine = json(&doctor)["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == "ledger_indexes" && c["verdict"] == "ok");
    assert!(fine, "{}", text(&doctor));
    let said = text(&setup);
    assert!(
        said.contains("tally_events_folded") && said.contains("created"),
        "{said}"
    );
    let again = run(vec!["setup"]).await;
    assert!(
        !text(&again).contains("created"),
        "idempotent: {}",
        text(&again)
    );

    let recorded = run(vec!["record", "evt_1", "home", "--by", "3", "--json"]).await;
    assert_eq!(recorded.status.code(), Some(0), "{}", text(&recorded));
    let shown = json(&recorded);
    assert_eq!(shown["outcome"], "recorded");
    assert_eq!(shown["event"], "evt_1");
    assert_eq!(shown["key"], "home");
    assert_eq!(shown["amount"], 3);
    let duplicate = run(vec!["record", "evt_1", "home", "--by", "3", "--json"]).await;
    assert_eq!(duplicate.status.code(), Some(0));
    assert_eq!(json(&duplicate)["outcome"], "duplicate");
    let conflict = run(vec!["record", "evt_1", "home", "--json"]).await;
    assert_eq!(conflict.status.code(), Some(1));
    assert_eq!(json(&conflict)["outcome"], "conflict");
    let zero = run(vec!["record", "evt_2", "home", "--by", "0", "--json"]).await;
    assert_eq!(zero.status.code(), Some(1));
    assert_eq!(json(&zero)["outcome"], "not_recorded");

    let got = run(vec!["get", "home", "--json"]).await;
    assert_eq!(got.status.code(), Some(0), "{}", text(&got));
    let got = json(&got);
    assert_eq!(
        (&got["key"], &got["value"], &got["folded"], &got["unfolded"]),
        (&"home".into(), &3.into(), &0.into(), &3.into())
    );
    let status = json(&run(vec!["status", "--json"]).await);
    assert_eq!(status["ledgers"][0]["unfolded_events"], 1);
    assert_eq!(
        status["ledgers"][0]["missing_indexes"],
        serde_json::json!([])
    );

    let reconciled = run(vec!["reconcile", "--json"]).await;
    assert_eq!(reconciled.status.code(), Some(0), "{}", text(&reconciled));
    assert!(
        text(&reconciled).contains("\"events_folded\":1"),
        "{}",
        text(&reconciled)
    );
    let got = json(&run(vec!["get", "home", "--json"]).await);
    assert_eq!((&got["value"], &got["folded"]), (&3.into(), &3.into()));
}

/// No schedule and no scan: the change stream alone brings new events into
/// their counters, within seconds.
#[tokio::test]
async fn the_daemon_folds_new_events_within_seconds() {
    let ctx = TestContext::new("ledger_continuous").await;
    let client = ctx.client(false).await;
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    ledger
        .create_indexes(Duration::from_secs(3600))
        .await
        .unwrap();
    let daemon = Tallyd::start(&config(&ctx, ""), &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    let views = client.collection("views");
    for round in 1..=3i64 {
        let started = Instant::now();
        let events: Vec<(String, &str, i64)> = (0..20)
            .map(|i| (format!("r{round}e{i}"), "home", 1))
            .collect();
        assert!(
            ledger
                .record_many(events)
                .await
                .iter()
                .all(|r| r.is_counted())
        );
        wait_until(
            "the counter has every event",
            Duration::from_secs(10),
            || async { counter(&views, "home").await == 20 * round },
        )
        .await;
        eprintln!("round {round}: folded in {:?}", started.elapsed());
    }
    daemon
        .wait_metric(
            "tally_events_folded_total{collection=\"views\"}",
            60.0,
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(ledger.value("home").await.unwrap().value, 60);
}

#[tokio::test]
async fn the_daemon_refuses_a_ledger_without_indexes_and_alerts() {
    let ctx = TestContext::new("ledger_daemon_no_indexes").await;
    let client = ctx.client(false).await;
    let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
    assert!(ledger.record("e1", "home", 1).await.is_counted());
    let daemon = Tallyd::start(&config(&ctx, ""), &[("RUST_LOG", "info,tally=debug")]);
    daemon.wait_ready("active", Duration::from_secs(20)).await;
    daemon
        .wait_metric(
            "tally_alerts_firing{collection=\"views\",kind=\"events_stuck\"}",
            1.0,
            Duration::from_secs(15),
        )
        .await;
    assert!(daemon.log().contains("tallyd setup"), "{}", daemon.log());
    assert_eq!(counter(&client.collection("views"), "home").await, 0);
}

/// 8 recorder processes' worth of writers (tasks with their own clients),
/// 20% of events sent twice — some repeats by another recorder, some
/// several fold cycles later — while the daemon folds continuously and is
/// killed with -9 at random moments 20 times. Every exact read during the
/// run lies between the acknowledged and the attempted distinct events;
/// after a final fold every counter equals its distinct events, and no
/// event is left unfolded.
#[tokio::test]
async fn soak_recorders_sending_twice_while_the_daemon_is_killed_20_times() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicI64, Ordering};

    const RECORDERS: usize = 8;
    const EVENTS: usize = 250;
    const COUNTERS: usize = 5;
    let ctx = TestContext::new("ledger_soak").await;
    let admin = ctx.client(false).await;
    let ledger = Ledger::new(&admin.store(), CollectionConfig::new("views"));
    ledger
        .create_indexes(Duration::from_secs(3600))
        .await
        .unwrap();
    let daemon_config = config(&ctx, "");
    let mut daemon = Tallyd::start(&daemon_config, &[("RUST_LOG", "info")]);
    // Per counter: distinct events acknowledged, and attempted.
    let acknowledged: Arc<Vec<AtomicI64>> =
        Arc::new((0..COUNTERS).map(|_| AtomicI64::new(0)).collect());
    let attempted: Arc<Vec<AtomicI64>> =
        Arc::new((0..COUNTERS).map(|_| AtomicI64::new(0)).collect());
    let mut recorders = Vec::new();
    for r in 0..RECORDERS {
        let client = ctx.client(false).await;
        let (acknowledged, attempted) = (acknowledged.clone(), attempted.clone());
        recorders.push(tokio::spawn(async move {
            let ledger = Ledger::new(&client.store(), CollectionConfig::new("views"));
            let mut later = Vec::new();
            for i in 0..EVENTS {
                let c = (r + i) % COUNTERS;
                let key = format!("r{r}e{i}");
                attempted[c].fetch_add(1, Ordering::SeqCst);
                let recording = ledger.record(key.as_str(), format!("c{c}"), 1).await;
                assert_eq!(recording.name(), "recorded", "{recording:?}");
                acknowledged[c].fetch_add(1, Ordering::SeqCst);
                match i % 10 {
                    // A repeat by this recorder at once.
                    0 => {
                        let again = ledger.record(key.as_str(), format!("c{c}"), 1).await;
                        assert_eq!(again.name(), "duplicate", "{again:?}");
                    }
                    // A repeat later (several fold cycles).
                    5 => later.push((key, c)),
                    _ => {}
                }
                // Another recorder's events sent again by this one.
                if i % 10 == 3 && i >= 20 {
                    let other = (r + 1) % RECORDERS;
                    let j = i - 20;
                    let key = format!("r{other}e{j}");
                    let c = (other + j) % COUNTERS;
                    let again = ledger.record(key.as_str(), format!("c{c}"), 1).await;
                    assert!(again.is_counted(), "{again:?}");
                }
                tokio::time::sleep(Duration::from_millis(fastrand::u64(40..120))).await;
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
            for (key, c) in later {
                let again = ledger.record(key.as_str(), format!("c{c}"), 1).await;
                assert_eq!(again.name(), "duplicate", "{again:?}");
            }
        }));
    }
    let reading = tokio_util::sync::CancellationToken::new();
    let reads = {
        let (ledger, acknowledged, attempted, reading) = (
            ledger.clone(),
            acknowledged.clone(),
            attempted.clone(),
            reading.clone(),
        );
        tokio::spawn(async move {
            let mut reads = 0u64;
            loop {
                for c in 0..COUNTERS {
                    let low = acknowledged[c].load(Ordering::SeqCst);
                    let value = ledger.value(format!("c{c}")).await.unwrap().value;
                    let high = attempted[c].load(Ordering::SeqCst);
                    assert!(
                        low <= value && value <= high,
                        "c{c}: {value} outside [{low}, {high}]"
                    );
                    reads += 1;
                }
                if reading.is_cancelled() {
                    return reads;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    for kill in 0..20 {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(800..3000))).await;
        daemon.kill();
        eprintln!("kill {kill}");
        daemon = Tallyd::start(&daemon_config, &[("RUST_LOG", "info")]);
    }
    for recorder in recorders {
        recorder.await.unwrap();
    }
    reading.cancel();
    let reads = reads.await.unwrap();
    eprintln!("{reads} exact reads during the run");
    assert!(reads > 100, "only {reads} exact reads");
    let expected: BTreeMap<usize, i64> = (0..COUNTERS)
        .map(|c| (c, acknowledged[c].load(Ordering::SeqCst)))
        .collect();
    assert_eq!(expected.values().sum::<i64>(), (RECORDERS * EVENTS) as i64);
    let views = admin.collection("views");
    let events = admin.collection("views_events");
    wait_until(
        "the daemon folded every event",
        Duration::from_secs(60),
        || async {
            events
                .count_documents(doc! { "f": { "$exists": false } })
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    for (c, n) in &expected {
        assert_eq!(
            counter(&views, format!("c{c}").as_str()).await,
            *n,
            "c{c}: 0 lost, 0 doubled"
        );
        assert_eq!(ledger.value(format!("c{c}")).await.unwrap().value, *n);
    }
    daemon.terminate();
}
