//! The book's commands run as shown: on every page, each ```console block's
//! `$ tallyd …` lines run in order against a fresh database of the test
//! server, with the built binary and the page's configuration (the ```toml
//! block naming the test server's address, or else the one of Getting
//! started, which such a page links to). Each must exit as shown — 0, or
//! what a following `$ echo $?` prints — and print the shown output line by
//! line (standard output, then standard error). Tickets, tokens, times,
//! durations and host:port are matched by their shape, everything else
//! literally.
//!
//! `$ cat FILE` writes FILE with the lines shown under it; `$ printf '…' |
//! tallyd …` feeds the text to standard input; `VAR=value tallyd …` sets a
//! variable. The daemon's `run`, `export`, `sudo`, `systemctl`, `scripts/`
//! and `cargo` are left out. A block whose state the page's earlier
//! commands cannot make (a server that does not answer, hours-old tokens,
//! measured speeds) says so on the line before it with
//! `<!-- not run by the tests: REASON -->`.

use std::path::Path;

use crate::common::server::repo_root;
use crate::common::shown::{Fenced, book_pages, fenced_blocks, local_config, run_tallyd};
use crate::common::{TestContext, external};

/// The mark before a block the test leaves out, with its reason.
const NOT_RUN: &str = "<!-- not run by the tests: ";

/// The section of Getting started whose configuration the other pages use.
const LOCAL_CONFIG: &str = "guide/getting-started.md#or-try-it-on-a-local-test-server";

/// Commands a page shows that need more than a test machine.
const LEFT_OUT: [&str; 6] = [
    "export ",
    "sudo ",
    "systemctl ",
    "scripts/",
    "cargo ",
    "tallyd run",
];

/// One shown command that runs here.
#[derive(Debug)]
enum Step {
    /// `$ cat FILE` and the lines shown under it.
    Write {
        file: String,
        text: String,
    },
    Tallyd(Command),
}

#[derive(Debug)]
struct Command {
    line: usize,
    shown: String,
    env: Vec<(String, String)>,
    args: Vec<String>,
    stdin: String,
    output: Vec<String>,
    exit: i32,
}

/// A command line's words, `'…'` quoting kept together.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                word.get_or_insert_with(String::new);
            }
            c if c.is_whitespace() && !quoted => words.extend(word.take()),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    assert!(!quoted, "an unclosed quote: {line}");
    words.extend(word);
    words
}

/// The steps of one ```console block.
fn steps(block: &Fenced, steps: &mut Vec<Step>) {
    let mut lines = block.text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let line_no = block.line + 1 + i;
        let command = line
            .strip_prefix("$ ")
            .unwrap_or_else(|| panic!("line {line_no}: output shown without a command: {line}"));
        let mut output = Vec::new();
        while let Some((_, next)) = lines.next_if(|(_, l)| !l.starts_with("$ ")) {
            output.push(next.to_owned());
        }
        let program: Vec<&str> = command
            .split_whitespace()
            .skip_while(|w| w.contains('='))
            .collect();
        if LEFT_OUT.iter().any(|c| program.join(" ").starts_with(c)) {
            continue;
        }
        if command == "echo $?" {
            let exit = output.first().and_then(|o| o.parse().ok());
            match (steps.last_mut(), exit) {
                (Some(Step::Tallyd(last)), Some(exit)) => last.exit = exit,
                _ => panic!("line {line_no}: `echo $?` shows no exit code of a tallyd command"),
            }
        } else if let Some(file) = command.strip_prefix("cat ") {
            steps.push(Step::Write {
                file: file.trim().to_owned(),
                text: output.join("\n") + "\n",
            });
        } else {
            let (stdin, command) = match command.split_once(" | ") {
                Some((printf, command)) => {
                    let printf = words(printf);
                    assert!(
                        printf.len() == 2 && printf[0] == "printf",
                        "line {line_no}: only `printf '…'` is piped into tallyd"
                    );
                    (printf[1].replace("\\n", "\n"), command)
                }
                None => (String::new(), command),
            };
            let mut words = words(command).into_iter().peekable();
            let mut env = Vec::new();
            while let Some(word) = words.next_if(|w| w.contains('=')) {
                let (name, value) = word.split_once('=').unwrap();
                env.push((name.to_owned(), value.to_owned()));
            }
            assert_eq!(
                words.next().as_deref(),
                Some("tallyd"),
                "line {line_no}: a command the test does not know: {command}"
            );
            let mut args: Vec<String> = words.collect();
            if !args.iter().any(|a| a == "--config" || a == "-c") {
                args.splice(0..0, ["--config".to_owned(), "tallyd.toml".to_owned()]);
            }
            steps.push(Step::Tallyd(Command {
                line: line_no,
                shown: command.to_owned(),
                env,
                args,
                stdin,
                output,
                exit: 0,
            }));
        }
    }
}

/// A line with its variable parts replaced by their kind: times, host:port,
/// tokens and tickets (their check too), durations. Words and other numbers
/// stay as they are.
fn shape(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let word = |c: char| c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '_';
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_word = i == 0 || !word(chars[i - 1]);
        if !starts_word || !chars[i].is_ascii_alphanumeric() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let mut end = i;
        while end < chars.len() && word(chars[end]) {
            end += 1;
        }
        let token: String = chars[i..end].iter().collect();
        let digits_after = |at: usize| {
            let mut j = at;
            while j < chars.len() && chars[j].is_ascii_digit() {
                j += 1;
            }
            j
        };
        // A time: 2026-11-26T22:52:44Z, 2026-11-26T22:52:51.313498Z.
        if token.len() >= 11 && token.as_bytes()[4] == b'-' && token.as_bytes()[10] == b'T' {
            let mut j = end;
            while j < chars.len() && (chars[j] == ':' || word(chars[j])) {
                j += 1;
            }
            out.push_str("<time>");
            i = j;
            continue;
        }
        // host:port
        if (token.contains('.') || token == "localhost")
            && chars.get(end) == Some(&':')
            && digits_after(end + 1) > end + 1
        {
            out.push_str("<host:port>");
            i = digits_after(end + 1);
            continue;
        }
        // A token, a lane, a ticket: HEX, HEX-CHECK, HEX.N-CHECK.
        let hex_len = token.chars().take_while(|c| c.is_ascii_hexdigit()).count();
        if hex_len >= 16 {
            out.push_str("<hex>");
            let rest = &token[hex_len..];
            let (number, check) = match rest.strip_prefix('.') {
                Some(after) => after.split_once('-').unwrap_or((after, "")),
                None => ("", rest.strip_prefix('-').unwrap_or(rest)),
            };
            if !rest.is_empty() && rest.starts_with('.') {
                out.push('.');
                out.push_str(number);
            }
            if check.len() == 6 && check.chars().all(|c| c.is_ascii_alphanumeric()) {
                out.push_str("-<check>");
            } else if !check.is_empty() {
                out.push('-');
                out.push_str(check);
            }
            i = end;
            continue;
        }
        // A duration: 17ms, 5s, 3h 1m 58s, 0.33s.
        let is_duration = |t: &str| {
            let number = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
            let unit = &t[number.len()..];
            !number.is_empty()
                && number.chars().all(|c| c.is_ascii_digit() || c == '.')
                && ["ms", "s", "m", "h", "d"].contains(&unit)
        };
        if is_duration(&token) {
            let mut j = end;
            // The parts after the first: " 1m", " 58s".
            loop {
                let mut k = j + 1;
                if chars.get(j) != Some(&' ') {
                    break;
                }
                while k < chars.len() && word(chars[k]) {
                    k += 1;
                }
                let next: String = chars[j + 1..k].iter().collect();
                if next.is_empty() || !is_duration(&next) {
                    break;
                }
                j = k;
            }
            out.push_str("<duration>");
            i = j;
            continue;
        }
        out.push_str(&token);
        i = end;
    }
    out
}

/// A page's own configuration for the test server: its ```toml block
/// naming the test server's address.
fn own_config(markdown: &str) -> Option<String> {
    fenced_blocks(markdown, "toml")
        .into_iter()
        .find(|b| b.text.contains("127.0.0.1:27017"))
        .map(|b| b.text)
}

/// Runs one page's commands; what differs from the page, one entry each.
async fn run_page(page: &Path, number: usize, differences: &mut Vec<String>) -> usize {
    let markdown = std::fs::read_to_string(page).unwrap();
    let place = page
        .strip_prefix(repo_root())
        .unwrap()
        .display()
        .to_string();
    let mut all = Vec::new();
    for block in fenced_blocks(&markdown, "console") {
        if let Some(reason) = block.before.strip_prefix(NOT_RUN) {
            assert!(
                reason.trim_end_matches("-->").trim().len() > 10,
                "{place}:{}: a block left out says why",
                block.line
            );
            continue;
        }
        steps(&block, &mut all);
    }
    let commands = all.iter().filter(|s| matches!(s, Step::Tallyd(_))).count();
    if commands == 0 {
        return 0;
    }
    let ctx = TestContext::new(&format!("shown_book_{number}")).await;
    let dir = tempfile::tempdir().unwrap();
    // A page without its own uses Getting started's, and says so.
    let config = own_config(&markdown).unwrap_or_else(|| {
        if !markdown.contains(LOCAL_CONFIG) {
            differences.push(format!(
                "{place}: its commands use the configuration of {LOCAL_CONFIG}, and it does not say so"
            ));
        }
        let getting_started = repo_root().join("docs/src/guide/getting-started.md");
        own_config(&std::fs::read_to_string(getting_started).unwrap())
            .expect("Getting started shows a configuration for the test server")
    });
    let config = local_config(&ctx, &config);
    std::fs::write(dir.path().join("tallyd.toml"), config).unwrap();
    for step in &all {
        let command = match step {
            Step::Write { file, text } => {
                std::fs::write(dir.path().join(file), text).unwrap();
                continue;
            }
            Step::Tallyd(command) => command,
        };
        let output = run_tallyd(dir.path(), &command.args, &command.env, &command.stdin);
        let printed: Vec<String> = [&output.stdout, &output.stderr]
            .iter()
            .flat_map(|o| {
                String::from_utf8_lossy(o)
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .map(|l| l.replace(&ctx.db_name, "app"))
            .collect();
        let exit = output.status.code();
        let mut wrong = Vec::new();
        if exit != Some(command.exit) {
            wrong.push(format!("exits {exit:?}, shown {}", command.exit));
        }
        // The server a real replica set runs is not the test server the
        // page shows.
        let compared = !(external() && command.args.iter().any(|a| a == "doctor"));
        let shapes = |lines: &[String]| lines.iter().map(|l| shape(l)).collect::<Vec<_>>();
        if compared && shapes(&printed) != shapes(&command.output) {
            let width = printed.len().max(command.output.len());
            for n in 0..width {
                let shown = command.output.get(n).map_or("", String::as_str);
                let got = printed.get(n).map_or("", String::as_str);
                if shape(shown) != shape(got) {
                    wrong.push(format!(
                        "line {}:\n    shown:   {shown}\n    printed: {got}",
                        n + 1
                    ));
                }
            }
        }
        if !wrong.is_empty() {
            differences.push(format!(
                "{place}:{}: $ {}\n  {}",
                command.line,
                command.shown,
                wrong.join("\n  ")
            ));
        }
    }
    commands
}

#[tokio::test]
async fn the_books_commands_print_what_the_book_shows() {
    let mut pages = Vec::new();
    book_pages(&repo_root().join("docs/src"), &mut pages);
    pages.sort();
    let mut differences = Vec::new();
    let mut ran = 0;
    for (number, page) in pages.iter().enumerate() {
        ran += run_page(page, number, &mut differences).await;
    }
    assert!(ran >= 20, "the book's commands: {ran} run");
    assert!(
        differences.is_empty(),
        "{} of the book's {ran} commands print something else than shown:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

#[test]
fn a_shape_keeps_words_and_counts_and_matches_what_varies() {
    let same = [
        (
            "counted: page_views/home +1 (ticket 6b08b841a1434552400255b7-q86qqa)",
            "counted: page_views/home +1 (ticket 6b08b841fb1f53e278683789-jmphng)",
        ),
        (
            "counted: page_views/home +5 (lane ticket 6b08b7bb30d242035c095759.1-5fwfs9)",
            "counted: page_views/home +5 (lane ticket 6b08b7bb30d24203aaaaaaaa.1-0abcde)",
        ),
        (
            "MongoDB at 127.0.0.1:27017, database app",
            "MongoDB at 127.0.0.1:40321, database app",
        ),
        (
            "the oplog holds 5s of history (since 2026-11-26T22:52:44Z), 3h 1m 58s",
            "the oplog holds 17ms of history (since 2027-01-02T03:04:05.678Z), 2s",
        ),
    ];
    for (shown, printed) in same {
        assert_eq!(shape(shown), shape(printed), "{shown}");
    }
    let differ = [
        ("counted: page_views/home +1", "counted: page_views/home +2"),
        ("8 checks: 6 ok, 2 warn", "8 checks: 7 ok, 1 warn"),
        (
            "page_views/home: 7 (6 folded)",
            "page_views/home: 9 (6 folded)",
        ),
        (
            "lane ticket 6b08b7bb30d242035c095759.1-5fwfs9",
            "lane ticket 6b08b7bb30d242035c095759.2-5fwfs9",
        ),
        ("{\"first\":2,\"last\":101}", "{\"first\":1,\"last\":100}"),
        (
            "recorded: it will be counted once",
            "duplicate: it will be counted once",
        ),
    ];
    for (shown, printed) in differ {
        assert_ne!(shape(shown), shape(printed), "{shown}");
    }
}
