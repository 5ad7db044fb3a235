//! Every configuration the project ships or shows passes `tallyd
//! check-config`: `config/tallyd.toml`, the demo's (`scripts/demo`), and
//! each TOML block of the README and the book (`docs/`). A new validation
//! rule cannot break one of them unseen.
//!
//! A block that is a Cargo manifest (`[dependencies]`, `tally = …`) is not
//! a configuration and is skipped. A block that shows one part of a
//! configuration (say `[writer]` alone) is checked on top of the smallest
//! whole one: a `[mongodb]` section and one collection, where it has none.

use std::path::Path;

use crate::cli::{tallyd, text, write_config};
use crate::common::server::repo_root;
use crate::common::shown::{book_pages, fenced_blocks};

/// The sections `tallyd` reads: a block with any other top-level key is
/// no configuration of its (a Cargo manifest).
const SECTIONS: [&str; 13] = [
    "mongodb",
    "collections",
    "writer",
    "sequences",
    "reconcile",
    "schedule",
    "monitor",
    "alerts",
    "ha",
    "http",
    "api",
    "daemon",
    "log",
];

/// Where a configuration was shown, and its text.
struct Shown {
    place: String,
    text: String,
}

/// The ```toml blocks of a Markdown file, each with its line number.
fn toml_blocks(path: &Path) -> Vec<Shown> {
    let markdown = std::fs::read_to_string(path).unwrap();
    fenced_blocks(&markdown, "toml")
        .into_iter()
        .map(|block| Shown {
            place: format!("{}:{}", relative(path), block.line),
            text: block.text,
        })
        .collect()
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo_root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The demo's configuration: the here-document `scripts/demo` writes, with
/// its shell variables given values.
fn demo_config() -> Shown {
    let script = std::fs::read_to_string(repo_root().join("scripts/demo")).unwrap();
    let start = script
        .find("tallyd.toml\" <<EOF\n")
        .expect("scripts/demo writes tallyd.toml with a here-document");
    let body = &script[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let text = &body[..body.find("\nEOF\n").expect("the here-document ends")];
    Shown {
        place: "scripts/demo".into(),
        text: text
            .replace("$uri", "mongodb://127.0.0.1:27017/?directConnection=true")
            .replace("$http_port", "9464"),
    }
}

/// The text to check: a whole configuration as shown, or a part of one on
/// top of the smallest whole one. `None` for a block that is no
/// configuration of tallyd's.
fn as_config(shown: &Shown) -> Option<String> {
    let table: toml::Table = shown
        .text
        .parse()
        .unwrap_or_else(|err| panic!("{}: not TOML: {err}", shown.place));
    if table.keys().any(|k| !SECTIONS.contains(&k.as_str())) {
        let manifest = table.contains_key("dependencies") || table.contains_key("tally");
        assert!(
            manifest,
            "{}: neither a configuration nor a Cargo manifest (keys: {})",
            shown.place,
            table.keys().cloned().collect::<Vec<_>>().join(", ")
        );
        return None;
    }
    let mut text = String::new();
    if !table.contains_key("mongodb") {
        text.push_str("[mongodb]\nuri = \"mongodb://127.0.0.1:27017\"\ndatabase = \"app\"\n");
    }
    if !table.contains_key("collections") {
        text.push_str("[[collections]]\nname = \"page_views\"\n");
    }
    text.push_str(&shown.text);
    Some(text)
}

#[tokio::test]
async fn every_configuration_shipped_or_shown_passes_check_config() {
    let root = repo_root();
    let mut shown = vec![
        Shown {
            place: "config/tallyd.toml".into(),
            text: std::fs::read_to_string(root.join("config/tallyd.toml")).unwrap(),
        },
        demo_config(),
    ];
    let mut pages = vec![root.join("README.md")];
    book_pages(&root.join("docs"), &mut pages);
    for page in &pages {
        shown.extend(toml_blocks(page));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for block in &shown {
        let Some(config) = as_config(block) else {
            continue;
        };
        let path = write_config(dir.path(), &config);
        let output = tallyd(&["--config", &path, "check-config"], &[]).await;
        checked += 1;
        if output.status.code() != Some(0) {
            failures.push(format!("{}:\n{}", block.place, text(&output)));
        }
    }
    assert!(checked >= 2, "the shipped and the demo's configurations");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The check itself can fail: a configuration the margin rules refuse (the
/// demo's of the last release) is caught.
#[tokio::test]
async fn a_shown_configuration_the_rules_refuse_is_caught() {
    let shown = Shown {
        place: "test".into(),
        text: "[mongodb]\nuri = \"mongodb://h\"\ndatabase = \"d\"\nattempt_timeout = \"3s\"\n\
               server_selection_timeout = \"2s\"\n[writer]\nretry_horizon = \"2s\"\n"
            .into(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &as_config(&shown).unwrap());
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    assert_eq!(output.status.code(), Some(78), "{}", text(&output));
    assert!(text(&output).contains("writer.retry_horizon"));
}
