//! `tallyd setup`: what it answers in JSON (fields, not sentences), and
//! that a server that cannot be reached fails it once, after one server
//! selection, not once per collection.

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use serde_json::Value;

use crate::cli::{json, tallyd, write_config};
use crate::common::TestContext;
use crate::common::tallyd::free_address;
use crate::doctor::{doctor, verdict};
use crate::errors::readable;

/// Three collections, one with a ledger.
const COLLECTIONS: &str = "[[collections]]\nname = \"a\"\nledger = true\n\
                           [[collections]]\nname = \"b\"\n[[collections]]\nname = \"c\"\n";

/// `tallyd --config <config> setup <args>`.
async fn setup(config: &str, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), config);
    let mut all = vec!["--config", path.as_str(), "setup"];
    all.extend_from_slice(args);
    tallyd(&all, &[]).await
}

/// With nothing listening, `setup` fails once — one error, after one
/// server selection (2 s here) — and exits 69, naming the collections it
/// did not try; before, each of the seven indexes of three collections
/// waited its own server selection (14 s) and said the same error seven
/// times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_server_down_setup_fails_once_and_fast() {
    let port = free_address().port();
    let config = format!(
        "[mongodb]\nuri = \"mongodb://127.0.0.1:{port}/?directConnection=true\"\n\
         database = \"app\"\nserver_selection_timeout = \"2s\"\nattempt_timeout = \"3s\"\n\
         {COLLECTIONS}"
    );
    let began = Instant::now();
    let output = setup(&config, &[]).await;
    let took = began.elapsed();
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(69), "{shown}");
    let errors = shown.lines().filter(|l| l.starts_with("error:")).count();
    assert_eq!(errors, 1, "{shown}");
    assert!(shown.contains("not tried: b and c"), "{shown}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {shown}");

    let output = setup(&config, &["--json"]).await;
    assert_eq!(output.status.code(), Some(69), "{}", readable(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "error", "{out}");
    assert_eq!(out["failed"].as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(out["failed"][0]["collection"], "a", "{out}");
    assert!(out["failed"][0]["error"].is_string(), "{out}");
    assert_eq!(out["not_tried"], serde_json::json!(["b", "c"]), "{out}");
}

/// `setup --json` gives each index as fields — collection, name, keys,
/// sparse, and whether it was created or found — not the text's
/// sentences; a second run finds every index present.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_json_gives_each_index_as_fields() {
    let ctx = TestContext::new("setup_json").await;
    let config = ctx.config_toml(false, COLLECTIONS);
    let output = setup(&config, &["--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    let first = json(&output);
    assert_eq!(first["outcome"], "done", "{first}");
    assert_eq!(first["failed"], serde_json::json!([]), "{first}");
    let indexes = first["indexes"].as_array().expect("indexes");
    // Two sparse indexes on each of three collections, one on a's events.
    assert_eq!(indexes.len(), 7, "{first}");
    let find = |collection: &str, name: &str| -> Value {
        indexes
            .iter()
            .find(|i| i["collection"] == collection && i["index"] == name)
            .unwrap_or_else(|| panic!("no {collection}.{name} in {first}"))
            .clone()
    };
    let pending = find("b", "tally_pending_sparse");
    assert_eq!(
        pending["keys"],
        serde_json::json!({ "pending": 1 }),
        "{pending}"
    );
    assert_eq!(pending["sparse"], true, "{pending}");
    assert_eq!(pending["action"], "created", "{pending}");
    let events = find("a_events", "tally_events_number");
    assert_eq!(events["keys"], serde_json::json!({ "s": 1 }), "{events}");
    assert_eq!(events["sparse"], false, "{events}");
    assert_eq!(events["action"], "created", "{events}");

    let output = setup(&config, &["--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    let again = json(&output);
    let actions: Vec<&Value> = again["indexes"]
        .as_array()
        .expect("indexes")
        .iter()
        .map(|i| &i["action"])
        .collect();
    assert_eq!(actions.len(), 7, "{again}");
    assert!(actions.iter().all(|a| *a == "present"), "{again}");
}

/// A bucketed collection, ledger or not, gets its index by key and bucket
/// (`{_id.k: 1, _id.t: 1}`, through which every write and read of a
/// bucketed counter finds it), and a bucketed ledger's events only their
/// index by number (the fold and exact reads read the change stream, not
/// the collection); `doctor` warns while the counters' one is missing and
/// not once it is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_indexes_every_bucketed_collection_by_key_and_bucket() {
    let ctx = TestContext::new("setup_buckets").await;
    let bucket = "bucket = \"day\"\ntimezone = \"Europe/Berlin\"\n";
    let config = ctx.config_toml(
        false,
        &format!(
            "[[collections]]\nname = \"days\"\n{bucket}[[collections]]\nname = \"views\"\n\
             ledger = true\n{bucket}"
        ),
    );
    let client = ctx.client(false).await;
    client
        .collection("days")
        .insert_one(mongodb::bson::doc! { "_id": "created" })
        .await
        .unwrap();
    let (_, checks, _) = doctor(&config, &[]).await;
    let (found, message) = verdict(&checks, "indexes:days");
    let flagged = found == "warn" && message.contains("no index tally_counters_bucket");
    assert!(flagged, "{found}: {message}");

    let output = setup(&config, &["--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    let by_key_and_bucket = mongodb::bson::doc! { "_id.k": 1, "_id.t": 1 };
    let by_number = mongodb::bson::doc! { "s": 1 };
    for (collection, keys) in [
        ("days", &by_key_and_bucket),
        ("views", &by_key_and_bucket),
        ("views_events", &by_number),
    ] {
        let listed: Vec<mongodb::IndexModel> = client
            .collection(collection)
            .list_indexes()
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert!(
            listed.iter().any(|i| &i.keys == keys),
            "{collection}: no {keys} in {listed:?}"
        );
    }
    let (_, checks, _) = doctor(&config, &[]).await;
    let (found, message) = verdict(&checks, "indexes:days");
    assert!(
        !message.contains("tally_counters_bucket"),
        "{found}: {message}"
    );
}
