//! The README's quick start runs as written: its shell blocks that can run
//! on a test machine — writing `tallyd.toml`, then each `tallyd …` line —
//! run in order against the test server, with the built binary for
//! `tallyd` and the test server's address for `127.0.0.1:27017`. Each
//! command must succeed, and where the line's comment shows what it prints
//! (`# counted: …`), print that. `scripts/…`, `sudo …` and the daemon's
//! `run` are left out (CI runs the scripts; the daemon has tests of its
//! own).

use crate::common::TestContext;
use crate::common::server::repo_root;
use crate::common::shown::{Fenced, fenced_blocks, local_config, run_tallyd};

/// One step of a block: a file written with a here-document, or a command.
#[derive(Debug)]
enum Step {
    Write {
        file: String,
        text: String,
    },
    Tallyd {
        args: Vec<String>,
        shows: Option<String>,
    },
}

/// The steps of the blocks that can run here, in order.
fn runnable_steps(blocks: &[Fenced]) -> Vec<Step> {
    let mut steps = Vec::new();
    for block in blocks {
        let mut lines = block.text.lines();
        while let Some(line) = lines.next() {
            if let Some(rest) = line.strip_prefix("cat > ") {
                let (file, marker) = rest.split_once(" <<").expect("a here-document");
                let marker = marker.trim_matches(|c| c == '\'' || c == '"');
                let text: Vec<&str> = lines.by_ref().take_while(|l| *l != marker).collect();
                steps.push(Step::Write {
                    file: file.trim().to_owned(),
                    text: text.join("\n") + "\n",
                });
            } else if let Some(rest) = line.strip_prefix("tallyd ") {
                let (command, comment) = match rest.split_once("  #") {
                    Some((command, comment)) => (command, Some(comment.trim())),
                    None => (rest, None),
                };
                let args: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
                if args.iter().any(|a| a == "run") {
                    continue;
                }
                // A comment that shows output starts with the outcome's
                // word and a colon (`counted: …`); the rest says what the
                // command is for.
                let shows = comment
                    .filter(|c| c.split(' ').next().is_some_and(|w| w.ends_with(':')))
                    .map(|c| c.split('…').next().unwrap_or(c).trim().to_owned());
                steps.push(Step::Tallyd { args, shows });
            }
        }
    }
    steps
}

#[tokio::test]
async fn the_readmes_quick_start_runs_as_written() {
    let ctx = TestContext::new("readme_quick_start").await;
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let steps = runnable_steps(&fenced_blocks(&readme, "sh"));
    let commands = steps
        .iter()
        .filter(|s| matches!(s, Step::Tallyd { .. }))
        .count();
    assert!(
        commands >= 5 && matches!(steps.first(), Some(Step::Write { .. })),
        "the quick start writes its configuration, then runs tallyd: {steps:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    for step in &steps {
        match step {
            Step::Write { file, text } => {
                std::fs::write(dir.path().join(file), local_config(&ctx, text)).unwrap();
            }
            Step::Tallyd { args, shows } => {
                let output = run_tallyd(dir.path(), args, &[], "");
                let stdout = String::from_utf8_lossy(&output.stdout);
                let stderr = String::from_utf8_lossy(&output.stderr);
                assert_eq!(
                    output.status.code(),
                    Some(0),
                    "tallyd {}: {stdout}{stderr}",
                    args.join(" ")
                );
                if let Some(shows) = shows {
                    assert!(
                        stdout.starts_with(shows.as_str()),
                        "tallyd {} should print {shows:?}, printed: {stdout}",
                        args.join(" ")
                    );
                }
            }
        }
    }
}

/// Every relative link of the README names a file of the repository (the
/// book's pages are checked by `scripts/book` in CI).
#[test]
fn every_relative_link_of_the_readme_names_a_file() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let mut missing = Vec::new();
    let mut checked = 0;
    for (_, rest) in readme
        .match_indices("](")
        .map(|(i, _)| ((), &readme[i + 2..]))
    {
        let target = rest.split(')').next().unwrap_or_default();
        if target.contains("://") || target.starts_with('#') || target.is_empty() {
            continue;
        }
        let path = target.split('#').next().unwrap_or_default();
        checked += 1;
        if !repo_root().join(path).exists() {
            missing.push(target.to_owned());
        }
    }
    assert!(
        checked >= 10,
        "the README's map of the book: {checked} links"
    );
    assert!(
        missing.is_empty(),
        "README links to missing files: {missing:?}"
    );
}

/// The README's library snippet compiles without a warning in an
/// application: the outcome of `resume_lane` is a `#[must_use]`
/// `LaneIncrement` (it can be unknown again, or not counted), so the
/// snippet uses it instead of dropping it with `….await?;`. (Found by a
/// first-time user who pasted the snippet into a new application: `warning:
/// unused LaneIncrement that must be used … an increment may be unknown and
/// need resuming`, and the code ignores whether the resume counted.)
#[test]
fn the_readmes_library_snippet_uses_the_outcome_of_a_resume() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let snippet = readme
        .split("```rust")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README's Rust snippet");
    assert!(snippet.contains("resume_lane("), "{snippet}");
    let dropped: Vec<&str> = snippet
        .lines()
        .filter(|line| {
            line.contains("resume_lane(")
                && !line.contains("let ")
                && !line.contains("match ")
                && line.contains(".await?;")
        })
        .collect();
    assert!(
        dropped.is_empty(),
        "a LaneIncrement dropped unused: {dropped:?}"
    );
}

/// The quick start says where `tallyd` comes from when the package is not
/// installed — the test server's block is for someone without a MongoDB,
/// most likely without the package too — as the book's getting started
/// does ("use `target/release/tallyd` for `tallyd` below"). (Found by a
/// first-time user: the quick start starts the test server, then runs
/// `tallyd -c tallyd.toml setup`, which is `command not found` until one
/// goes back to "Install" and builds.)
#[test]
fn the_quick_start_says_where_tallyd_comes_from_without_the_package() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let quick_start = readme
        .split("## Quick start")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a section \"Quick start\"");
    assert!(
        quick_start.contains("target/release/tallyd"),
        "the quick start never says tallyd is target/release/tallyd without the package"
    );
}
