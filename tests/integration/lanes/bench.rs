//! `tallyd bench` as an operator runs it: every side measured and checked
//! in a scratch collection that is dropped afterwards (or kept), groups on
//! a hot counter, and a collection that exists already left alone.

use mongodb::bson::doc;

use crate::cli::{json, tallyd, text, write_config};
use crate::common::TestContext;

/// Two seconds per side, 8 callers on 2 counters: every side runs, its
/// counters hold exactly what its callers were told counted, lanes form
/// groups, and the scratch collection is gone afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_and_checks_every_side_and_drops_its_collection() {
    let ctx = TestContext::new("cli_bench").await;
    let output = bench(&ctx, &["--writers", "8", "--keys", "2"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["ok"], true, "{out}");
    let sides = out["sides"].as_array().expect("sides");
    let names: Vec<&str> = sides
        .iter()
        .filter_map(|s| s["protocol"].as_str())
        .collect();
    assert_eq!(names, ["plain", "two-step", "lanes", "ledger"], "{out}");
    for side in sides {
        let counted = side["outcomes"]["counted"].as_u64().unwrap();
        assert!(counted > 0, "{side}");
        assert!(side["ops_per_second"].as_f64().unwrap() > 0.0, "{side}");
        assert!(side["p99_ms"].as_f64() >= side["p50_ms"].as_f64(), "{side}");
        assert_eq!(side["check"]["ok"], true, "{side}");
        assert_eq!(
            side["check"]["found"], side["check"]["counted"],
            "no fault: {side}"
        );
    }
    assert_eq!(sides[0]["ratio_to_plain"], 1.0);
    let group = sides[2]["group_size"]
        .as_f64()
        .expect("the lanes side's group size");
    assert!(group > 1.5, "8 callers on 2 counters form groups: {group}");
    let collection = out["collection"].as_str().unwrap();
    assert!(collection.starts_with("tally_bench_"), "{out}");
    let client = ctx.client(false).await;
    let names = client
        .store()
        .database()
        .list_collection_names()
        .await
        .unwrap();
    assert!(
        !names.iter().any(|n| n.starts_with(collection)),
        "dropped: {names:?}"
    );
}

/// `--collection` names the scratch collection, `--keep` leaves it with
/// the counters the check read; a collection that exists is refused
/// before anything is written, and text output is a table.
#[tokio::test]
async fn bench_keeps_a_named_collection_and_refuses_one_that_exists() {
    let ctx = TestContext::new("cli_bench_keep").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let args = [
        "--config",
        &path,
        "bench",
        "--seconds",
        "1",
        "--writers",
        "2",
        "--keys",
        "1",
        "--protocol",
        "plain,lanes",
        "--collection",
        "scratch",
        "--keep",
    ];
    let output = tallyd(&args, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let shown = text(&output);
    assert!(shown.contains("collection scratch (kept)"), "{shown}");
    assert!(shown.contains("check lanes: ok"), "{shown}");
    assert!(
        !shown.contains("two-step"),
        "only the sides asked for: {shown}"
    );
    let client = ctx.client(false).await;
    let scratch = client.collection("scratch");
    let lanes = scratch
        .find_one(doc! { "_id": "lanes:0" })
        .await
        .unwrap()
        .expect("kept");
    assert!(lanes.get_document("lanes").is_ok(), "{lanes}");
    // Again: it exists now, and is left as it is.
    let before = scratch.count_documents(doc! {}).await.unwrap();
    let refused = |said: &'static str| async move {
        let output = tallyd(&args, &[]).await;
        assert_eq!(output.status.code(), Some(64), "{}", text(&output));
        assert!(text(&output).contains(said), "{}", text(&output));
    };
    refused("the collection scratch exists already").await;
    assert_eq!(scratch.count_documents(doc! {}).await.unwrap(), before);
    // Two of its scratch collections there: named in one phrase.
    client
        .collection("scratch_events")
        .insert_one(doc! { "_id": 1 })
        .await
        .unwrap();
    refused("the collections scratch and scratch_events exist already").await;
}

/// `--bucket minute`: every side writes now's minute of a bucketed scratch
/// collection — the bare `$inc` by the bucket's `{k, t}` `_id` — and each
/// side's buckets hold exactly what its callers were told counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_counts_into_buckets_with_every_side() {
    let ctx = TestContext::new("cli_bench_buckets").await;
    let output = bench(
        &ctx,
        &[
            "--writers",
            "4",
            "--keys",
            "3",
            "--bucket",
            "minute",
            "--keep",
        ],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let out = json(&output);
    for side in out["sides"].as_array().expect("sides") {
        assert!(side["outcomes"]["counted"].as_u64().unwrap() > 0, "{side}");
        assert_eq!(side["check"]["ok"], true, "{side}");
    }
    let collection = out["collection"].as_str().unwrap();
    let client = ctx.client(false).await;
    let kept = client.collection(collection);
    let plain = kept
        .find_one(doc! { "_id.k": { "$regex": "^plain:" } })
        .await
        .unwrap()
        .expect("a bucket of the bare $inc");
    let id = plain.get_document("_id").expect("a {k, t} _id");
    assert!(id.get_datetime("t").is_ok(), "{plain}");
    assert_eq!(
        kept.count_documents(doc! { "_id": { "$type": "string" } })
            .await
            .unwrap(),
        0,
        "no plain key"
    );
    // A width that is none is a usage error.
    let bad = bench(&ctx, &["--bucket", "week"]).await;
    assert_eq!(bad.status.code(), Some(64), "{}", text(&bad));
}

/// `tallyd bench --seconds 2 --json` and `extra` against `ctx`'s database.
async fn bench(ctx: &TestContext, extra: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let mut args = vec![
        "--config",
        path.as_str(),
        "bench",
        "--seconds",
        "2",
        "--json",
    ];
    args.extend_from_slice(extra);
    tallyd(&args, &[]).await
}
