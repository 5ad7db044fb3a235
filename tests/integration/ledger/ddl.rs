//! No DDL after `tallyd setup`: recording, the daemon's fold, exact reads
//! (of a counter and of a bucketed key's range), reconcile and the sweep
//! need only reads and writes of documents and the change stream — never
//! `collMod` (the floor of the version before took the events
//! collection's exclusive lock twice a pass), `create`, an index or a
//! drop. A role without those actions runs tally, and nothing tally does
//! queues recorders behind a collection lock. `tallyd fold-from`, an
//! operator's repair, is left out.
//!
//! The oracle is the proxy's log: every command of every client after
//! `setup` goes through the proxy.

use std::collections::BTreeSet;
use std::time::Duration;

use mongodb::bson::doc;
use tally::{BucketWidth, Buckets, CollectionConfig, EventFold, EventFoldSettings, Ledger};

use super::*;
use crate::cli::{tallyd, text, write_config};
use crate::common::proxy::{Exchange, Proxy, upstream_of};
use crate::common::tallyd::Tallyd;
use crate::common::{TestContext, counter, wait_until};

/// The commands that change a collection, an index or a database rather
/// than documents.
const DDL: [&str; 17] = [
    "collMod",
    "create",
    "createIndexes",
    "drop",
    "dropIndexes",
    "deleteIndexes",
    "dropDatabase",
    "renameCollection",
    "convertToCapped",
    "cloneCollectionAsCapped",
    "reIndex",
    "compact",
    "shardCollection",
    "reshardCollection",
    "refineCollectionShardKey",
    "movePrimary",
    "setFeatureCompatibilityVersion",
];

/// Two ledgers: `views`, and `hours`, bucketed by the hour; no schedule
/// and no periodic scan within the test's time (the change stream folds).
fn ledgers(ctx: &TestContext, uri: &str) -> String {
    ctx.config_toml(
        false,
        "[[collections]]\nname = \"views\"\nledger = true\n[[collections]]\nname = \"hours\"\n\
         ledger = true\nbucket = \"hour\"\n[reconcile]\nfold_delay = \"200ms\"\n[schedule]\n\
         cron = \"0 30 3 * * *\"\ncatch_up = false\n[monitor]\nscan_interval = \"1h\"\n",
    )
    .replace(&ctx.child_uri(false), uri)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ddl_reaches_the_server_after_setup() {
    let ctx = TestContext::new("ledger_no_ddl").await;
    let direct = ctx.client(false).await;
    let dir = tempfile::tempdir().unwrap();
    let setup_config = write_config(dir.path(), &ledgers(&ctx, &ctx.child_uri(false)));
    let setup = tallyd(&["--config", &setup_config, "setup"], &[]).await;
    assert_eq!(setup.status.code(), Some(0), "{}", text(&setup));

    // From here on, every client reaches the server through the proxy.
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through_uri = ctx.child_uri_through(&proxy, false);
    let config_dir = tempfile::tempdir().unwrap();
    let config = write_config(config_dir.path(), &ledgers(&ctx, &through_uri));
    let mut daemon = Tallyd::start(&ledgers(&ctx, &through_uri), &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", Duration::from_secs(30)).await;
    let store = ctx.client_through(&proxy, false).await.store();
    let views = Ledger::new(&store, CollectionConfig::new("views"));
    let hour = Buckets::utc(BucketWidth::Hour);
    let hours = Ledger::new(
        &store,
        CollectionConfig::new("hours").with_buckets(hour.clone()),
    );

    // Recording: one event, a batch, a bucketed event, the command line.
    assert_outcome(&views.record("e1", "home", 1).await, "recorded");
    for recording in views
        .record_many([("e2", "home", 2), ("e3", "about", 3)])
        .await
    {
        assert_outcome(&recording, "recorded");
    }
    let now = server_now(&store).await;
    assert_outcome(&hours.record_at("h1", "home", 5, now).await, "recorded");
    let recorded = tallyd(
        &[
            "--config",
            &config,
            "record",
            "e4",
            "home",
            "--collection",
            "views",
        ],
        &[],
    )
    .await;
    assert_eq!(recorded.status.code(), Some(0), "{}", text(&recorded));
    // Events old enough for the sweep, as a recorder numbered them ten
    // days ago.
    let old = number_of(now - Duration::from_secs(10 * 24 * 3600));
    store
        .collection("views_events")
        .insert_many([
            event_by_hand("old1", "home", 10, old),
            event_by_hand("old2", "about", 10, old + 1),
        ])
        .await
        .unwrap();

    // The daemon folds them all.
    let counters = direct.collection("views");
    wait_until("the daemon folded", Duration::from_secs(30), || async {
        counter(&counters, "home").await == 14 && counter(&counters, "about").await == 13
    })
    .await;
    let bucket = hour.start_of(now).unwrap();
    wait_until(
        "the daemon folded the hour",
        Duration::from_secs(30),
        || async {
            let id = doc! { "k": "home", "t": mongodb::bson::DateTime::from_system_time(bucket) };
            counter(&direct.collection("hours"), id).await == 5
        },
    )
    .await;

    // Exact reads: a counter, a key's range of buckets, the command line.
    assert_eq!(views.value("home").await.unwrap().value, 14);
    let range = hours
        .values_between("home", bucket, bucket + Duration::from_secs(3 * 3600), None)
        .await
        .unwrap();
    assert_eq!(range.total, 5, "{range:?}");
    let got = tallyd(
        &[
            "--config",
            &config,
            "get",
            "about",
            "--collection",
            "views",
            "--json",
        ],
        &[],
    )
    .await;
    assert!(text(&got).contains("\"value\":13"), "{}", text(&got));

    // The sweep: the old events go once the fold is past them (the
    // daemon's sweep or this one, whichever comes first).
    let fold = EventFold::new(
        &store,
        CollectionConfig::new("views"),
        EventFoldSettings::default(),
    );
    wait_until(
        "the sweep deleted the old events",
        Duration::from_secs(30),
        || async {
            fold.sweep(server_now(&store).await).await.unwrap();
            direct
                .collection("views_events")
                .count_documents(doc! { "_id": { "$in": ["old1", "old2"] } })
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    drop(fold);
    let reconciled = tallyd(&["--config", &config, "reconcile"], &[]).await;
    assert_eq!(reconciled.status.code(), Some(0), "{}", text(&reconciled));
    assert_eq!(
        counter(&counters, "home").await,
        14,
        "the sweep counts nothing"
    );
    daemon.terminate();

    let log = proxy.log();
    let ddl: Vec<&Exchange> = log
        .iter()
        .filter(|e| e.command.as_deref().is_some_and(|c| DDL.contains(&c)))
        .collect();
    assert!(
        ddl.is_empty(),
        "DDL after setup: {:#?}",
        ddl.iter()
            .map(|e| (e.command.clone(), e.collection.clone()))
            .collect::<Vec<_>>()
    );
    // And the proxy carried the work: the fold's change stream, its
    // counter updates and state, the inserts, the sweep's delete.
    let carried: BTreeSet<(String, String)> = log
        .iter()
        .filter_map(|e| {
            let what = if e.body_mentions("$changeStream") {
                "changeStream".to_owned()
            } else {
                e.command.clone()?
            };
            Some((what, e.collection.clone()?))
        })
        .collect();
    for (command, collection) in [
        ("insert", "views_events"),
        ("insert", "hours_events"),
        ("changeStream", "views_events"),
        ("changeStream", "hours_events"),
        ("update", "views"),
        ("update", "hours"),
        ("update", "views_events_fold"),
        ("delete", "views_events"),
    ] {
        assert!(
            carried.contains(&(command.to_owned(), collection.to_owned())),
            "no {command} on {collection} went through the proxy: {carried:?}"
        );
    }
    eprintln!("{} commands after setup, none DDL", log.len());
}
