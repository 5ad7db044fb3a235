//! Sequences: first use under contention, gaps but never duplicates, blocks,
//! seeding; and the `tallyd seq` commands.

use std::collections::BTreeSet;

use futures::future::join_all;
use mongodb::bson::{Bson, doc};
use tally::{SequenceConfig, Sequences};

use crate::cli::{tallyd, write_config};
use crate::common::{FailPoint, TestContext};

fn sequences(client: &crate::common::TestClient) -> Sequences {
    Sequences::new(&client.store(), &SequenceConfig::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_first_uses_of_a_new_name_get_one_to_sixteen() {
    let ctx = TestContext::new("seq_first_use").await;
    let client = ctx.client(false).await;
    let seq = sequences(&client);
    let tasks = (0..16).map(|_| {
        let seq = seq.clone();
        tokio::spawn(async move { seq.next("orders").await })
    });
    let mut values: Vec<i64> = join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.expect("task").expect("next must not surface an error"))
        .collect();
    values.sort();
    assert_eq!(values, (1..=16).collect::<Vec<_>>());
    assert_eq!(seq.current("orders").await.unwrap(), Some(16));
}

/// Lost connections on `findAndModify`: tally's retry may skip a number
/// but never hands one out twice — with `retryWrites` on or off in the URI
/// (tally's client has the driver's retries off either way).
async fn lost_connections(name: &str, retry_writes: bool) -> Vec<i64> {
    let ctx = TestContext::new(name).await;
    let client = ctx.client(retry_writes).await;
    let seq = sequences(&client);
    let mut values = vec![seq.next("ids").await.unwrap()];
    for _ in 0..25 {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 1 }),
            doc! { "failCommands": ["findAndModify"], "closeConnection": true },
        )
        .await;
        values.push(
            seq.next("ids")
                .await
                .expect("one lost connection is retried"),
        );
        values.push(seq.next("ids").await.unwrap());
    }
    let unique: BTreeSet<i64> = values.iter().copied().collect();
    assert_eq!(
        unique.len(),
        values.len(),
        "a number was handed out twice: {values:?}"
    );
    assert!(
        values.windows(2).all(|w| w[0] < w[1]),
        "not increasing: {values:?}"
    );
    values
}

#[tokio::test]
async fn lost_connections_never_duplicate_without_retryable_writes() {
    lost_connections("seq_lost_rw_off", false).await;
}

#[tokio::test]
async fn lost_connections_never_duplicate_with_retry_writes_in_the_uri() {
    lost_connections("seq_lost_rw_on", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocks_and_single_numbers_interleave_without_overlap() {
    let ctx = TestContext::new("seq_blocks").await;
    let client = ctx.client(false).await;
    let seq = sequences(&client);
    let tasks = (0..8).map(|t| {
        let seq = seq.clone();
        tokio::spawn(async move {
            let mut numbers = Vec::new();
            for i in 0..15u32 {
                if (t + i) % 3 == 0 {
                    let block = seq.next_block("mixed", 1 + (i % 7)).await.unwrap();
                    assert_eq!(block.last - block.first + 1, i64::from(1 + (i % 7)));
                    numbers.extend(block.numbers());
                } else {
                    numbers.push(seq.next("mixed").await.unwrap());
                }
            }
            numbers
        })
    });
    let all: Vec<i64> = join_all(tasks)
        .await
        .into_iter()
        .flat_map(|r| r.expect("task"))
        .collect();
    let unique: BTreeSet<i64> = all.iter().copied().collect();
    assert_eq!(unique.len(), all.len(), "overlapping numbers");
    // No failures were injected: the numbers are exactly 1..=N.
    assert_eq!(unique, (1..=all.len() as i64).collect());
    assert!(seq.next_block("mixed", 0).await.is_err());
}

#[tokio::test]
async fn ensure_at_least_seeds_and_never_moves_backwards() {
    let ctx = TestContext::new("seq_ensure_at_least").await;
    let client = ctx.client(false).await;
    let seq = sequences(&client);
    // A new sequence seeded from existing data.
    assert_eq!(seq.ensure_at_least("users", 500).await.unwrap(), 500);
    assert_eq!(seq.next("users").await.unwrap(), 501);
    // Lower values change nothing.
    assert_eq!(seq.ensure_at_least("users", 10).await.unwrap(), 501);
    assert_eq!(seq.current("users").await.unwrap(), Some(501));
    assert_eq!(seq.ensure_at_least("users", 900).await.unwrap(), 900);
    assert_eq!(seq.next("users").await.unwrap(), 901);
}

#[tokio::test]
async fn existing_tutorial_counters_keep_working() {
    let ctx = TestContext::new("seq_tutorial_docs").await;
    let client = ctx.client(false).await;
    let coll = client.collection("counters");
    // The legacy shell writes 0 as a double; mongosh as an int32.
    coll.insert_one(doc! { "_id": "legacy", "seq": 41.0 })
        .await
        .unwrap();
    coll.insert_one(doc! { "_id": "modern", "seq": 7i32 })
        .await
        .unwrap();
    coll.insert_one(doc! { "_id": "broken", "seq": "x" })
        .await
        .unwrap();
    let seq = sequences(&client);
    assert_eq!(seq.next("legacy").await.unwrap(), 42);
    assert_eq!(seq.next("modern").await.unwrap(), 8);
    let err = seq.current("broken").await.unwrap_err();
    assert!(err.to_string().contains("not an integer"), "{err}");
}

#[tokio::test]
async fn seq_commands_print_json() {
    let ctx = TestContext::new("cli_seq").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        &ctx.config_toml(false, "[sequences]\ncollection = \"ids\""),
    );
    let run = |args: Vec<&'static str>| {
        let path = path.clone();
        async move {
            let mut all = vec!["--config", path.as_str()];
            all.extend(args);
            let output = tallyd(&all, &[]).await;
            assert_eq!(output.status.code(), Some(0), "{output:?}");
            serde_json::from_slice::<serde_json::Value>(&output.stdout).expect("one JSON object")
        }
    };
    assert_eq!(
        run(vec!["seq", "current", "invoice", "--json"]).await,
        serde_json::json!({ "name": "invoice", "value": null })
    );
    assert_eq!(
        run(vec!["seq", "next", "invoice", "--json"]).await,
        serde_json::json!({ "name": "invoice", "value": 1 })
    );
    assert_eq!(
        run(vec!["seq", "next", "invoice", "--block", "100", "--json"]).await,
        serde_json::json!({ "name": "invoice", "first": 2, "last": 101 })
    );
    assert_eq!(
        run(vec!["seq", "current", "invoice", "--json"]).await,
        serde_json::json!({ "name": "invoice", "value": 101 })
    );
    let output = tallyd(&["--config", &path, "seq", "next", "invoice"], &[]).await;
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "102");
    // The configured collection is the one used.
    let client = ctx.client(false).await;
    let stored = client
        .collection("ids")
        .find_one(doc! { "_id": "invoice" })
        .await
        .unwrap();
    assert_eq!(stored.unwrap().get_i64("seq").unwrap(), 102);
}

/// Creating a sequence's document follows the book (design/errors.md) for write-concern
/// errors: a transient one is a lost reply (retried; the document is
/// there, the first number is 1), any other is a command error.
#[tokio::test]
async fn a_write_concern_error_on_first_use_is_retried_only_when_transient() {
    let ctx = TestContext::new("seq_create_write_concern").await;
    let client = ctx.client(false).await;
    let seq = sequences(&client);
    for (name, code, code_name) in [
        ("a", 91, "ShutdownInProgress"),
        ("b", 64, "WriteConcernFailed"),
    ] {
        let _fail = FailPoint::write_concern_error(&ctx, "insert", code, code_name).await;
        let result = seq.next(name).await;
        match code {
            91 => assert_eq!(result.unwrap(), 1),
            _ => assert_eq!(
                result.unwrap_err().class(),
                Some(tally::ErrorClass::Command)
            ),
        }
    }
}
