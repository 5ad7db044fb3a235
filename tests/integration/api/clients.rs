//! The book's clients run against the daemon as written: the Python one
//! (requests, installed into `.venv/` by `scripts/install-test-server`)
//! and the JavaScript one (Node's fetch), each from its block of
//! `docs/src/guide/http-api.md`.

use std::process::Command;

use super::{ApiDaemon, Setup};
use crate::common::server::repo_root;
use crate::common::shown::fenced_blocks;

/// The first block of `lang` in the API chapter.
fn example(lang: &str) -> String {
    let page = std::fs::read_to_string(repo_root().join("docs/src/guide/http-api.md")).unwrap();
    let blocks = fenced_blocks(&page, lang);
    let block = blocks
        .first()
        .unwrap_or_else(|| panic!("a ```{lang} block"));
    block.text.clone()
}

/// Runs `program` with the API's address: what it printed.
fn run(daemon: &ApiDaemon, mut program: Command, what: &str) -> String {
    let output = program
        .env("TALLY_API", format!("http://{}", daemon.api))
        .output()
        .unwrap_or_else(|err| panic!("{what}: {err}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed:\n{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// What the chapter records before its clients (its first curl lines:
/// `order-1001` on `home`, twice, as the getting-started chapter did): a
/// reader who follows it in order has these, and a client that reused
/// the id with another amount would be refused as a conflict.
async fn the_chapters_first_events(daemon: &ApiDaemon) {
    for _ in 0..2 {
        let (status, outcome) = daemon
            .post(
                "page_views",
                &serde_json::json!({ "event": "order-1001", "key": "home" }),
            )
            .await;
        assert!(status == 201 || status == 200, "{status} {outcome}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_python_client_records_once_and_reads_back() {
    let daemon = ApiDaemon::start("api_python", Setup::default()).await;
    the_chapters_first_events(&daemon).await;
    let python = repo_root().join(".venv/bin/python");
    let mut program = Command::new(&python);
    program.arg("-c").arg(example("python"));
    let what = format!(
        "{} (scripts/install-test-server installs it, with requests)",
        python.display()
    );
    let printed = run(&daemon, program, &what);
    assert_eq!(printed, "recorded\nduplicate\nhome: 3\n");
    assert_eq!(daemon.events("page_views").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_javascript_client_records_once_and_reads_back() {
    let daemon = ApiDaemon::start("api_javascript", Setup::default()).await;
    the_chapters_first_events(&daemon).await;
    let mut program = Command::new("node");
    program
        .args(["--input-type=module", "-e"])
        .arg(example("js"));
    let printed = run(&daemon, program, "node (Node.js 18 or newer, for fetch)");
    assert_eq!(printed, "recorded duplicate home: 3\n");
    assert_eq!(daemon.events("page_views").await, 2);
}
