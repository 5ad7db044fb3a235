//! A pass's counter updates sent many to a command (`apply_batch`), under
//! the faults that could make a statement count twice or not at all: a
//! lost reply beside a refused and a held counter, an attempt held in the
//! network until after its retry and a later pass, a write concern error.
//! The oracle is what was recorded against what the counters hold.

use std::collections::BTreeMap;
use std::time::SystemTime;

use mongodb::bson::doc;
use tally::{CollectionConfig, EventFold, EventFoldSettings, Ledger, Store};
use tokio_util::sync::CancellationToken;

use crate::common::proxy::{Action, Proxy, Release, Rule, upstream_of};
use crate::common::{TestContext, counter};
use crate::ledger::{assert_outcome, fold_all, fold_of, ledger_on, unfolded};

/// Records `events` (key, counter, amount) and adds them to `expected`.
async fn record(
    ledger: &Ledger,
    expected: &mut BTreeMap<String, i64>,
    events: Vec<(String, String, i64)>,
) {
    for (_, c, n) in &events {
        *expected.entry(c.clone()).or_default() += n;
    }
    for r in ledger.record_many(events).await {
        assert_outcome(&r, "recorded");
    }
}

fn spread(tag: &str, counters: usize) -> Vec<(String, String, i64)> {
    (0..counters)
        .map(|i| (format!("{tag}-{i}"), format!("c{i}"), 1))
        .collect()
}

/// A last pass, then every counter against what was recorded.
async fn check_all(ctx: &TestContext, fold: &EventFold, expected: &BTreeMap<String, i64>) {
    fold_all(fold).await;
    assert_eq!(unfolded(fold).await, 0);
    let client = ctx.client(false).await;
    let views = client.collection("views");
    let mut wrong = Vec::new();
    for (key, n) in expected {
        let got = counter(&views, key.as_str()).await;
        if got != *n {
            wrong.push((key.clone(), got, *n));
        }
    }
    assert!(wrong.is_empty(), "(counter, stored, recorded): {wrong:?}");
}

/// A test's server, the ledger of `views` on it, and a store whose
/// commands go through a proxy.
async fn through_a_proxy(name: &str) -> (TestContext, Ledger, Proxy, Store) {
    let ctx = TestContext::new(name).await;
    let store = ctx.client(false).await.store();
    let ledger = ledger_on(&store, "views").await;
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await.store();
    (ctx, ledger, proxy, through)
}

/// A batch whose first attempt applied and whose reply was lost, with a
/// counter in it that the server refuses (validator) and a counter with a
/// held sum beside it; later the validator goes. Every event once.
#[tokio::test]
async fn a_batch_whose_reply_is_lost_beside_a_refused_and_a_held_counter_counts_each_event_once() {
    let ctx = TestContext::new("ledger_batch_lost_reply").await;
    let client = ctx.client(false).await;
    let store = client.store();
    let db = client.client.database(&ctx.db_name);
    db.run_command(doc! { "create": "views", "validator": { "counter": { "$lte": 5 } } })
        .await
        .unwrap();
    let ledger = ledger_on(&store, "views").await;
    let mut expected = BTreeMap::new();
    let direct = fold_of(&store, "views");
    let mut events = spread("p1", 150);
    events.extend((0..4).map(|i| (format!("big{i}"), "big".to_string(), 2)));
    events.push(("edge0".into(), "edge".into(), 4));
    record(&ledger, &mut expected, events).await;
    let run = fold_all(&direct).await;
    assert_eq!(run.backlog.held.len(), 1, "{run:?}");

    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await.store();
    let fold = fold_of(&through, "views");
    let mut events = spread("p2", 150);
    events.push(("big4".into(), "big".into(), 2));
    events.push(("edge1".into(), "edge".into(), 2));
    record(&ledger, &mut expected, events).await;
    {
        let _drop = proxy.rule(
            Rule::command("update")
                .collection("views")
                .nth(1)
                .then(Action::DropReply),
        );
        let _ = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await;
    }
    let _ = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    let mut events = spread("p3", 3);
    events.push(("edge2".into(), "edge".into(), 1));
    record(&ledger, &mut expected, events).await;
    fold_all(&fold).await;
    db.run_command(doc! { "collMod": "views", "validator": {} })
        .await
        .unwrap();
    for _ in 0..2 {
        fold_all(&fold).await;
    }
    check_all(&ctx, &fold, &expected).await;
}

/// The first attempt of a batch is held up in the network; the retry
/// applies; the pass commits, another pass applies; then the held attempt
/// lands. Every event once.
#[tokio::test]
async fn a_batch_attempt_landing_after_its_retry_and_a_later_pass_counts_nothing_again() {
    let (ctx, ledger, proxy, through) = through_a_proxy("ledger_batch_late").await;
    let mut expected = BTreeMap::new();
    let settings = EventFoldSettings {
        apply_batch: 7,
        ..EventFoldSettings::default()
    };
    let fold = EventFold::new(&through, CollectionConfig::new("views"), settings);
    record(&ledger, &mut expected, spread("p1", 20)).await;
    let hold = proxy.rule(
        Rule::command("update")
            .collection("views")
            .nth(1)
            .then(Action::HoldRequest(Release::WhenReleased)),
    );
    let _ = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    let _ = fold
        .fold(SystemTime::now(), &CancellationToken::new())
        .await;
    record(&ledger, &mut expected, spread("p2", 20)).await;
    fold_all(&fold).await;
    drop(hold);
    proxy.release_held().await;
    check_all(&ctx, &fold, &expected).await;
}

/// The batch's reply carries a write concern error: the write applied on
/// the primary. Every event once.
#[tokio::test]
async fn a_batch_whose_reply_carries_a_write_concern_error_counts_each_event_once() {
    let (ctx, ledger, proxy, through) = through_a_proxy("ledger_batch_wce").await;
    let mut expected = BTreeMap::new();
    let fold = fold_of(&through, "views");
    record(&ledger, &mut expected, spread("p1", 5)).await;
    {
        let _wce = proxy.rule(Rule::command("update").collection("views").nth(1).then(
            Action::WriteConcernError {
                code: 64,
                code_name: "WriteConcernFailed".into(),
                labels: vec![],
            },
        ));
        // The statements are sent again alone, as resumes: each collides,
        // and its lane holds the pass.
        let _ = fold
            .fold(SystemTime::now(), &CancellationToken::new())
            .await;
    }
    check_all(&ctx, &fold, &expected).await;
}
