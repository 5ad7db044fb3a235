//! Output people read (issue 26, "Messages"): a user-supplied value is
//! shown shortened and with its control characters escaped, an empty
//! counter key is a usage error, a printed command works pasted as shown,
//! and a settle that finds nothing says where it looked.

use std::process::Output;

use mongodb::Collection;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Document, doc};

use crate::cli::{hint, hint_args, json, tallyd, text, updates_lost_twice, write_config};
use crate::common::tallyd::free_address;
use crate::common::{TestContext, counter};
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

    // On the command line, a key with a control character is a paste gone
    // wrong (it would count into another counter): refused, shown escaped.
    let tricky = "a\u{1b}[2Jb\nc";
    for args in [
        vec!["incr", tricky],
        vec!["record", "e-tricky", tricky],
        vec!["record", tricky, "k"],
        vec!["get", tricky],
    ] {
        let output = s.run(&args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {shown}");
        assert!(!shown.contains('\u{1b}'), "{args:?}: {shown:?}");
        assert!(shown.contains(r"a\u{1b}[2Jb\nc"), "{args:?}: {shown:?}");
        assert!(shown.contains("control character"), "{args:?}: {shown:?}");
    }
    assert_eq!(s.views.count_documents(doc! {}).await.unwrap(), 0);

    // From a file, such a key is what a program wrote: recorded, never
    // printed raw, and kept whole in JSON.
    let dir = tempfile::tempdir().unwrap();
    let from = dir.path().join("tricky.ndjson");
    std::fs::write(
        &from,
        "{\"event\": \"t1\", \"key\": \"a\\u001b[2Jb\\nc\"}\n",
    )
    .unwrap();
    let output = s.run(&["record", "--from", from.to_str().unwrap()]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(!shown.contains('\u{1b}'), "{shown:?}");
    let output = s
        .run(&["record", "--from", from.to_str().unwrap(), "--json"])
        .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(line["key"], tricky, "{stdout}");

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

/// The command printed to settle an unknown increment repeats the `-c`,
/// `--env-file` and `--collection` it was given, so pasted as shown it
/// settles the increment — here the URI is only in the environment file
/// (the configuration file's points at a closed port), and two collections
/// are configured. Before, it dropped `-c` and `--env-file`: it exited 78,
/// or read the default configuration's database. A `complete` that finds
/// nothing names the database and collection it looked in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_printed_command_repeats_the_options_it_was_given() {
    let ctx = TestContext::new("msg_hint_options").await;
    let dir = tempfile::tempdir().unwrap();
    let env_file = dir.path().join("tallyd.env");
    std::fs::write(
        &env_file,
        format!("TALLYD__MONGODB__URI={}\n", ctx.child_uri(false)),
    )
    .unwrap();
    let env_file = env_file.display().to_string();
    let closed = free_address().port();
    let config = write_config(
        dir.path(),
        &format!(
            "[mongodb]\nuri = \"mongodb://127.0.0.1:{closed}/\"\ndatabase = \"{}\"\n\
             server_selection_timeout = \"10s\"\n\
             [[collections]]\nname = \"views\"\n[[collections]]\nname = \"other\"\n",
            ctx.db_name
        ),
    );
    let mut given = vec!["-c", config.as_str(), "--env-file", env_file.as_str()];
    given.extend(["incr", "k", "--by", "5", "--collection", "views"]);
    let output = updates_lost_twice(&ctx, &given).await;
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let hint = hint(&output);
    let options = format!("tallyd -c {config} --env-file {env_file} resume k ");
    assert!(hint.starts_with(&options), "{hint}");
    assert!(hint.contains(" --collection views"), "{hint}");
    for _ in 0..2 {
        let output = tallyd(&hint_args(&hint), &[]).await;
        assert_eq!(output.status.code(), Some(0), "{hint}: {}", text(&output));
    }
    let views = ctx.client(false).await.collection("views");
    assert_eq!(counter(&views, "k").await, 5);

    let token = ObjectId::new().to_hex();
    let output = tallyd(
        &[
            "-c",
            &config,
            "--env-file",
            &env_file,
            "complete",
            "k",
            &token,
            "--collection",
            "other",
        ],
        &[],
    )
    .await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(shown.contains("not pending in other/k"), "{shown}");
    assert!(
        shown.contains(&format!("(database {})", ctx.db_name)),
        "{shown}"
    );
    let mut args = vec!["-c", config.as_str(), "--env-file", env_file.as_str()];
    args.extend(["complete", "k", &token, "--collection", "other", "--json"]);
    let output = tallyd(&args, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "not_pending", "{out}");
    assert_eq!(out["database"], ctx.db_name.as_str(), "{out}");
    assert_eq!(out["collection"], "other", "{out}");
}

/// A file that cannot be read — the configuration, the environment file,
/// `record --from`'s input — is named with why in words and what to do,
/// never the system's `(os error N)`.
#[tokio::test]
async fn a_file_that_cannot_be_read_is_named_with_why_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let missing = missing.to_str().unwrap();
    let folder = dir.path().to_str().unwrap();
    for (args, said, code) in [
        (
            vec!["--config", missing, "status"],
            format!("--config: cannot read {missing}: there is no such file; check the path"),
            78,
        ),
        (
            vec!["--env-file", folder, "status"],
            format!("--env-file: cannot read {folder}: it is a directory; name the file inside it"),
            78,
        ),
    ] {
        let output = tallyd(&args, &[]).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {shown}");
        assert!(shown.contains(&said), "{args:?}: {shown}");
        assert!(!shown.contains("os error"), "{args:?}: {shown}");
    }
    let setup = Setup::new(
        "msg_unreadable_from",
        "[[collections]]\nname = \"hits\"\nledger = true\n",
    )
    .await;
    let output = setup
        .run(&["record", "--from", missing, "--collection", "hits"])
        .await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(64), "{shown}");
    assert!(
        shown.contains(&format!("cannot read {missing}: there is no such file")),
        "{shown}"
    );
    assert!(!shown.contains("os error"), "{shown}");
}

/// A printed command names the configuration by its absolute path: given
/// `-c tallyd.toml` in one directory, the printed `resume` pasted in
/// another settles the increment (it said "cannot read tallyd.toml").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_printed_command_names_the_configuration_by_its_absolute_path() {
    use mongodb::bson::Bson;
    let ctx = TestContext::new("msg_hint_absolute").await;
    let dir = tempfile::tempdir().unwrap();
    write_config(dir.path(), &ctx.config_toml(false, ""));
    let output = {
        let _fail = crate::common::FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 2 }),
            doc! { "failCommands": ["update"], "closeConnection": true },
        )
        .await;
        tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
            .args(["-c", "tallyd.toml", "incr", "k", "--by", "3"])
            .current_dir(dir.path())
            .env_clear()
            .output()
            .await
            .unwrap()
    };
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let hint = hint(&output);
    let absolute = dir.path().join("tallyd.toml").display().to_string();
    assert!(
        hint.starts_with(&format!("tallyd -c {absolute} resume k ")),
        "{hint}"
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(hint_args(&hint))
        .current_dir(elsewhere.path())
        .env_clear()
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{hint}: {}", text(&output));
    let views = ctx.client(false).await.collection("views");
    assert_eq!(counter(&views, "k").await, 3);
}
