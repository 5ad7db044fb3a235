//! A counter at the int64 limit refuses an increment that would pass it: a
//! definite refusal (not counted, exit 1), never a pending token that no
//! `complete` could ever count, nor an unknown outcome.

use mongodb::bson::doc;
use tally::{CollectionConfig, Counters, Error, Increment, WriterConfig};

use crate::cli::{json, tallyd, text, write_config};
use crate::common::{TestContext, counter, pending_len};

#[tokio::test]
async fn an_increment_past_the_int64_limit_is_not_counted_and_writes_nothing() {
    let ctx = TestContext::new("overflow_two_step").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    coll.insert_many([
        doc! { "_id": "max", "counter": i64::MAX },
        doc! { "_id": "min", "counter": i64::MIN },
        doc! { "_id": "near", "counter": i64::MAX - 5 },
        doc! { "_id": "int32", "counter": i32::MAX },
    ])
    .await
    .unwrap();
    let views = Counters::new(
        &client.store(),
        CollectionConfig::new("views"),
        WriterConfig::default(),
    );
    for (key, amount) in [("max", 1), ("max", 100), ("min", -1), ("near", 6)] {
        let before = coll.find_one(doc! { "_id": key }).await.unwrap();
        match views.increment(key, amount).await {
            Increment::NotCounted(not) => assert!(
                matches!(not.cause(), Error::Overflow { amount: a, .. } if *a == amount),
                "{key} {amount:+}: {:?}",
                not.cause()
            ),
            other => panic!("{key} {amount:+}: expected not counted, got {other:?}"),
        }
        let after = coll.find_one(doc! { "_id": key }).await.unwrap();
        assert_eq!(after, before, "{key} {amount:+}: nothing written");
    }
    // Up to the limit exactly, and back from it: counted. An int32 counter
    // widens to int64, as `$inc` does.
    for (key, amount, value) in [
        ("near", 5, i64::MAX),
        ("max", -1, i64::MAX - 1),
        ("int32", 1, i64::from(i32::MAX) + 1),
    ] {
        let outcome = views.increment(key, amount).await;
        assert!(
            matches!(outcome, Increment::Counted(_)),
            "{key}: {outcome:?}"
        );
        assert_eq!(counter(&coll, key).await, value, "{key}");
        assert_eq!(pending_len(&coll, key).await, 0, "{key}");
    }
}

/// The command line says it once, clearly, and exits 1: nothing to resume,
/// nothing to complete.
#[tokio::test]
async fn tallyd_incr_past_the_int64_limit_says_not_counted_and_exits_1() {
    let ctx = TestContext::new("overflow_cli").await;
    let client = ctx.client(false).await;
    let coll = client.collection("views");
    coll.insert_one(doc! { "_id": "k2", "counter": i64::MAX })
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\n[[collections]]\nname = \"views\"\n",
            ctx.uri, ctx.db_name
        ),
    );
    for protocol in ["--two-step", "--lane"] {
        let args = ["--config", &config, "incr", "k2", "--by", "100", protocol];
        let output = tallyd(&args, &[]).await;
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(1), "{protocol}: {shown}");
        assert!(shown.contains("not counted"), "{protocol}: {shown}");
        assert!(
            !shown.contains("complete") && !shown.contains("resume"),
            "{protocol}: {shown}"
        );
        let mut with_json = args.to_vec();
        with_json.push("--json");
        let output = tallyd(&with_json, &[]).await;
        assert_eq!(output.status.code(), Some(1), "{protocol}");
        assert_eq!(json(&output)["outcome"], "not_counted", "{protocol}");
    }
    assert_eq!(counter(&coll, "k2").await, i64::MAX);
    assert_eq!(pending_len(&coll, "k2").await, 0);
}
