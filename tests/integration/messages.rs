//! Output people read (issue 26, "Messages"): a user-supplied value is
//! shown shortened and with its control characters escaped, and an empty
//! counter key is a usage error.

use std::process::Output;

use mongodb::Collection;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Document, doc};

use crate::cli::{json, tallyd, write_config};
use crate::common::TestContext;
use crate::errors::readable;

/// A test's database, a config file for it, and its `views` collection.
struct Setup {
    _ctx: TestContext,
    _dir: tempfile::TempDir,
    path: String,
    views: Collection<Document>,
}

impl Setup {
    async fn new(name: &str, extra: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), &ctx.config_toml(false, extra));
        let views = ctx.client(false).await.collection("views");
        Self {
            _ctx: ctx,
            _dir: dir,
            path,
            views,
        }
    }

    /// `tallyd --config PATH <args>`.
    async fn run(&self, args: &[&str]) -> Output {
        let mut all = vec!["--config", self.path.as_str()];
        all.extend_from_slice(args);
        tallyd(&all, &[]).await
    }
}

/// An empty counter key (or event key) names nothing anyone means: every
/// command that takes one refuses it as a usage error (64) in one
/// sentence, before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_key_is_a_usage_error() {
    let s = Setup::new(
        "msg_empty_key",
        "[[collections]]\nname = \"views\"\nledger = true\n",
    )
    .await;
    let token = ObjectId::new().to_hex();
    let commands: [&[&str]; 8] = [
        &["incr", ""],
        &["incr", "", "--lane"],
        &["get", ""],
        &["complete", "", &token],
        &["resume", "", &token],
        &["record", "e1", ""],
        &["record", "", "k"],
        &["seq", "next", ""],
    ];
    for args in commands {
        let output = s.run(args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {shown}");
        let said = if args[0] == "record" && args[1].is_empty() {
            "an event key must not be empty"
        } else {
            "a counter key must not be empty"
        };
        assert!(shown.contains(said), "{args:?}: {shown}");
    }
    assert_eq!(s.views.count_documents(doc! {}).await.unwrap(), 0);
}

/// A value a user gave is shown shortened and with its control characters
/// escaped — a 100 kB key in a few hundred bytes, an escape sequence or a
/// newline as `\u{1b}` and `\n` — so that data never floods or drives the
/// terminal; `--json` keeps values whole, and of their JSON type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_are_shown_short_and_escaped_json_keeps_them_whole() {
    let s = Setup::new(
        "msg_shown_values",
        "[[collections]]\nname = \"views\"\nledger = true\n",
    )
    .await;
    let long = "k".repeat(100_000);
    let output = s.run(&["record", "e-long", &long]).await;
    let shown = readable(&output);
    assert!(
        shown.len() < 2_000,
        "{} bytes: {}",
        shown.len(),
        &shown[..300]
    );
    assert!(shown.contains("… (100000 bytes)"), "{shown}");

    let output = s.run(&["get", &long]).await;
    let shown = readable(&output);
    assert!(shown.len() < 2_000, "{} bytes", shown.len());

    let tricky = "a\u{1b}[2Jb\nc";
    for args in [
        vec!["incr", tricky],
        vec!["record", tricky, tricky],
        vec!["get", tricky],
    ] {
        let output = s.run(&args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {shown}");
        assert!(!shown.contains('\u{1b}'), "{args:?}: {shown:?}");
        assert!(shown.contains(r"a\u{1b}[2Jb\nc"), "{args:?}: {shown:?}");
    }

    let output = s.run(&["get", tricky, "--json"]).await;
    assert_eq!(json(&output)["key"], tricky);

    let dir = tempfile::tempdir().unwrap();
    let from = dir.path().join("events.ndjson");
    std::fs::write(
        &from,
        "{\"event\": \"n1\", \"key\": 7}\n{\"event\": \"o1\", \"key\": {\"a\": 1}}\n",
    )
    .unwrap();
    let output = s
        .run(&["record", "--from", from.to_str().unwrap(), "--json"])
        .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["key"], serde_json::json!(7), "{stdout}");
    assert_eq!(lines[1]["key"], serde_json::json!({"a": 1}), "{stdout}");
}
