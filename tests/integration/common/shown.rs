//! What the README and the book show, read for the tests that run it: the
//! fenced blocks of a Markdown page, a shown configuration turned into one
//! for the test server, and `tallyd` run as a reader would run it.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use super::TestContext;

/// The server address the shown configurations use.
pub const SHOWN_URI: &str = "mongodb://127.0.0.1:27017/?directConnection=true";

/// The database the shown configurations use.
pub const SHOWN_DATABASE: &str = "app";

/// One fenced block: the line of its opening fence, the text between the
/// fences, and the last non-blank line before it.
#[derive(Debug)]
pub struct Fenced {
    pub line: usize,
    pub text: String,
    pub before: String,
}

/// The blocks of a Markdown page fenced as `lang` (```` ```toml ````, and
/// also ```` ```toml title ````), in order. A block never closed is a broken
/// page.
pub fn fenced_blocks(markdown: &str, lang: &str) -> Vec<Fenced> {
    let mut blocks = Vec::new();
    let mut open: Option<Fenced> = None;
    let mut before = "";
    for (i, line) in markdown.lines().enumerate() {
        let fence = line.trim_start();
        match &mut open {
            None => {
                let info = fence
                    .strip_prefix("```")
                    .map(|info| info.split_whitespace().next());
                if info == Some(Some(lang)) {
                    open = Some(Fenced {
                        line: i + 1,
                        text: String::new(),
                        before: before.to_owned(),
                    });
                } else if !fence.is_empty() {
                    before = fence;
                }
            }
            Some(_) if fence.starts_with("```") => {
                blocks.extend(open.take());
                before = fence;
            }
            Some(block) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
        }
    }
    assert!(
        open.is_none(),
        "a ```{lang} block is never closed: {open:?}"
    );
    blocks
}

/// Every Markdown file of the book, recursively.
pub fn book_pages(dir: &Path, pages: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            book_pages(&path, pages);
        } else if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
}

/// A shown configuration for the test server: its URI and a fresh
/// database instead of the shown ones.
pub fn local_config(ctx: &TestContext, shown: &str) -> String {
    assert!(
        shown.contains(&format!("uri = \"{SHOWN_URI}\"")),
        "a configuration to run names {SHOWN_URI}: {shown}"
    );
    shown
        .replace(
            &format!("uri = \"{SHOWN_URI}\""),
            &format!("uri = \"{}\"", ctx.child_uri(false)),
        )
        .replace(
            &format!("database = \"{SHOWN_DATABASE}\""),
            &format!("database = \"{}\"", ctx.db_name),
        )
}

/// `tallyd args` in `dir`, with nothing from the test's environment but
/// `env`, and `stdin` as its standard input.
pub fn run_tallyd(dir: &Path, args: &[String], env: &[(String, String)], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .current_dir(dir)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tallyd");
    let mut input = child.stdin.take().expect("tallyd's standard input");
    input.write_all(stdin.as_bytes()).expect("write to tallyd");
    drop(input);
    child.wait_with_output().expect("tallyd's output")
}
