//! Shell completions and man pages, generated from the command line's own
//! definitions (hidden commands, run when the package is built): what
//! `--help` says and what the shell completes never drift apart. Neither
//! offers what `--help` hides (`completions`, `man`, `--clock-offset`):
//! the generators would, so they are given the command line without it.
//!
//! A man page is `--help` in clap_mangen's sections (NAME, SYNOPSIS,
//! DESCRIPTION, OPTIONS, COMMANDS, VERSION) with the sections `--help` has
//! no room for between them: EXIT STATUS (the table every `--help` ends
//! with, [`EXIT_CODES`]), ENVIRONMENT, FILES and SEE ALSO.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Command};
use clap_complete::Shell;
use clap_mangen::Man;
use clap_mangen::roff::{Inline, Roff, bold, italic, roman};

use super::exit::EXIT_CODES;
use super::{EXIT_FAILED, EXIT_OK, command};

/// `tallyd completions SHELL`.
#[derive(Debug, Args)]
pub(crate) struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: Shell,
}

/// `tallyd man DIR`.
#[derive(Debug, Args)]
pub(crate) struct ManArgs {
    /// The directory to write into (it must exist).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
}

/// Prints the completion script for `args.shell` to standard output.
pub(super) fn completions(args: &CompletionsArgs) -> ExitCode {
    let mut command = visible(&command());
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "tallyd", &mut script);
    match std::io::stdout().write_all(&script) {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(err) => {
            eprintln!("error: cannot write the completions: {err}");
            ExitCode::from(EXIT_FAILED)
        }
    }
}

/// Writes `tallyd.1` and a page per command (`tallyd-run.1`, …,
/// `tallyd-seq-next.1`) into `args.dir`, and prints their paths.
pub(super) fn man(args: &ManArgs) -> ExitCode {
    for (file, text) in pages() {
        let path = args.dir.join(&file);
        if let Err(err) = std::fs::write(&path, text) {
            eprintln!("error: cannot write the man page {}: {err}", path.display());
            return ExitCode::from(EXIT_FAILED);
        }
        super::out!("{}", path.display());
    }
    ExitCode::from(EXIT_OK)
}

/// Every man page, as (file name, roff source): `tallyd.1` first, then one
/// per visible command, nested ones as `tallyd-seq-next.1`.
fn pages() -> Vec<(String, String)> {
    fn walk(command: &Command, parent: Option<&Command>, pages: &mut Vec<(String, String)>) {
        pages.push((
            format!("{}.1", display_name(command)),
            page(command, parent),
        ));
        for sub in command.get_subcommands() {
            walk(sub, Some(command), pages);
        }
    }
    // Built, every subcommand knows its display name (`tallyd-seq-next`),
    // its usage (`tallyd seq next`) and the version.
    let mut root = visible(&command()).disable_help_subcommand(true);
    root.build();
    let mut pages = Vec::new();
    walk(&root, None, &mut pages);
    pages
}

/// `tallyd-seq-next` for `tallyd seq next`.
fn display_name(command: &Command) -> &str {
    command
        .get_display_name()
        .unwrap_or_else(|| command.get_name())
}

/// The man page of `command` (a subcommand of `parent`, if any).
fn page(command: &Command, parent: Option<&Command>) -> String {
    let name = display_name(command);
    let shown = command
        .clone()
        .subcommand_help_heading("COMMANDS")
        .subcommand_value_name("COMMAND");
    let version = command.get_version().unwrap_or_default();
    let man = Man::new(shown)
        .title(name.to_uppercase())
        .source(format!("tallyd {version}"));
    let mut page = Page::default();
    page.add(|w| man.render_title(w));
    page.add(|w| man.render_name_section(w));
    page.add(|w| man.render_synopsis_section(w));
    page.add(|w| man.render_description_section(w));
    page.add(|w| man.render_options_section(w));
    if command.has_subcommands() {
        page.add(|w| man.render_subcommands_section(w));
    }
    page.add(|w| exit_status().to_writer(w));
    page.add(|w| listed("ENVIRONMENT", ENVIRONMENT_INTRO, ENVIRONMENT, |n| bold(n)).to_writer(w));
    page.add(|w| listed("FILES", "", FILES, |n| italic(n)).to_writer(w));
    page.add(|w| see_also(command, parent).to_writer(w));
    if command.get_version().is_some() {
        page.add(|w| man.render_version_section(w));
    }
    page.text
}

/// A page put together from sections rendered one by one. roff starts
/// every rendering with the same preamble (the string it writes
/// apostrophes with); the page keeps the first.
struct Page {
    preamble: String,
    text: String,
}

impl Default for Page {
    fn default() -> Self {
        let preamble = Roff::new().render();
        Self {
            text: preamble.clone(),
            preamble,
        }
    }
}

impl Page {
    /// Appends what `render` writes, less the preamble.
    fn add(&mut self, render: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) {
        let mut section = Vec::new();
        // Writing into a Vec cannot fail, nor can a renderer given one.
        let _ = render(&mut section);
        let section = String::from_utf8_lossy(&section);
        let section = section.strip_prefix(&self.preamble).unwrap_or(&section);
        self.text.push_str(section);
    }
}

/// `text` with its `code` spans in bold.
fn marked(text: &str) -> Vec<Inline> {
    text.split('`')
        .enumerate()
        .filter(|(_, part)| !part.is_empty())
        .map(|(at, part)| if at % 2 == 1 { bold(part) } else { roman(part) })
        .collect()
}

/// EXIT STATUS: the table every `--help` ends with.
fn exit_status() -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", ["EXIT STATUS"]);
    roff.text(marked(
        "The same for every command, by the class of what happened (the error's kind and \
         code, never its text):",
    ));
    for (code, meaning) in EXIT_CODES {
        roff.control("TP", []);
        roff.text([bold(code.to_string())]);
        roff.text(marked(meaning));
    }
    roff
}

/// A section of `intro` and a list of terms (shown by `term`), each with
/// what it is.
fn listed(heading: &str, intro: &str, entries: &[(&str, &str)], term: fn(&str) -> Inline) -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", [heading]);
    if !intro.is_empty() {
        roff.text(marked(intro));
    }
    for (name, what) in entries {
        roff.control("TP", []);
        roff.text([term(name)]);
        roff.text(marked(what));
    }
    roff
}

const ENVIRONMENT_INTRO: &str = "Every command reads its configuration from the file and \
     from these variables. `--env-file PATH` reads more variables from PATH first, as \
     systemd reads the units' `EnvironmentFile=` (see systemd.exec(5)); its values win over \
     the environment's.";

/// ENVIRONMENT: what tallyd reads from its environment (`config`,
/// `config::alerts`, `config::daemon`), and clap's `NO_COLOR`.
const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "TALLYD__SECTION__KEY",
        "Sets the configuration key KEY of [SECTION] over the file's value; a nested table's \
         names are joined by `__` too. `TALLYD__MONGODB__URI` sets `[mongodb] uri`, \
         `TALLYD__WRITER__RETRY_HORIZON=30s` sets `[writer] retry_horizon`, \
         `TALLYD__ALERTS__WEBHOOK__URL` sets `[alerts.webhook] url`. Keep the URI's password \
         here (in /etc/tally/tallyd.env), not in the world-readable configuration file.",
    ),
    (
        "TALLYD_WEBHOOK_TOKEN",
        "Or whichever variable `[alerts.webhook] auth_header_env` names: the whole value of \
         the alert webhook's Authorization header (`Bearer …`). It must be set when named \
         (exit 78 otherwise); its value is never shown.",
    ),
    (
        "RUST_LOG",
        "A log filter (`info`, `info,tally::reconcile=debug`) used instead of `[log] level` \
         when set and not blank; checked as that key is (exit 78 when malformed).",
    ),
    (
        "NO_COLOR",
        "When set and not empty, `--help` and command-line errors are printed without colour.",
    ),
];

/// FILES: where the configuration is read from and what the package
/// installs beside the binary (`[package.metadata.deb]` in Cargo.toml).
const FILES: &[(&str, &str)] = &[
    (
        "/etc/tally/tallyd.toml",
        "The configuration, read when `--config` names no other file; it may be absent when \
         the environment sets everything. The package installs it, every key explained and at \
         its default, as a conffile. It is world-readable: no secrets in it.",
    ),
    (
        "/etc/tally/tallyd.env",
        "The secrets (`TALLYD__MONGODB__URI`, the webhook's token), one KEY=VALUE a line, \
         readable by root only; the operator creates it. The units read it \
         (`EnvironmentFile=`); a command run by hand reads it with \
         `--env-file /etc/tally/tallyd.env`, never by sourcing it in a shell.",
    ),
    (
        "/usr/lib/systemd/system/tallyd.service",
        "The daemon's unit (`tallyd run`): installed, neither enabled nor started.",
    ),
    (
        "/usr/lib/systemd/system/tallyd-reconcile.service",
        "The nightly fold without the daemon (`tallyd reconcile`), started by \
         tallyd-reconcile.timer; a host runs it or the daemon, not both.",
    ),
    (
        "/usr/lib/systemd/system/tallyd-reconcile.timer",
        "Starts tallyd-reconcile.service every night; installed, not enabled.",
    ),
    (
        "/usr/share/tally/alerts.yml",
        "Prometheus alerting rules on the daemon's /metrics, each saying what to do.",
    ),
    (
        "/usr/share/tally/grafana-dashboard.json",
        "A Grafana dashboard of the daemon's metrics.",
    ),
];

/// Commands used together: the page of each points to the others' (beside
/// tallyd(1), its parent and its own subcommands).
const RELATED: &[(&str, &[&str])] = &[
    ("run", &["status", "reconcile", "check-config", "doctor"]),
    ("status", &["run", "reconcile", "doctor"]),
    ("check-config", &["doctor", "setup"]),
    ("doctor", &["check-config", "setup", "status"]),
    ("incr", &["complete", "resume", "reconcile", "get"]),
    ("complete", &["incr", "resume", "reconcile"]),
    ("resume", &["incr", "complete"]),
    ("reconcile", &["status", "run", "incr"]),
    ("record", &["get", "setup"]),
    ("get", &["record", "incr"]),
    ("setup", &["check-config", "doctor"]),
    ("bench", &["doctor"]),
];

/// SEE ALSO: the pages next to `command`'s, the environment file's syntax,
/// the README and the book.
fn see_also(command: &Command, parent: Option<&Command>) -> Roff {
    let name = display_name(command);
    let mut pages: Vec<String> = Vec::new();
    let mut add = |page: &str| {
        if page != name && !pages.iter().any(|p| p == page) {
            pages.push(page.to_owned());
        }
    };
    match parent {
        // tallyd(1) lists every page.
        None => {
            fn every(command: &Command, add: &mut dyn FnMut(&str)) {
                for sub in command.get_subcommands() {
                    add(display_name(sub));
                    every(sub, add);
                }
            }
            every(command, &mut add);
        }
        Some(parent) => {
            add("tallyd");
            add(display_name(parent));
            let path = name.strip_prefix("tallyd-").unwrap_or(name);
            let related = RELATED.iter().find(|(of, _)| *of == path);
            for other in related.map_or(&[][..], |(_, others)| others) {
                add(&format!("tallyd-{other}"));
            }
            // Its own subcommands; a nested command's siblings.
            let nested = display_name(parent) != "tallyd";
            let siblings = parent.get_subcommands().filter(|_| nested);
            for other in command.get_subcommands().chain(siblings) {
                add(display_name(other));
            }
        }
    }
    let mut refs: Vec<Inline> = Vec::new();
    for page in pages.iter().map(String::as_str).chain(["systemd.exec"]) {
        let section = if page == "systemd.exec" { 5 } else { 1 };
        refs.push(bold(page));
        refs.push(roman(format!("({section}), ")));
    }
    if let Some(Inline::Roman(last)) = refs.last_mut() {
        *last = last.trim_end_matches(", ").to_owned();
    }
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]);
    roff.text(refs);
    roff.control("PP", []);
    roff.text([
        roman("The README: "),
        italic("/usr/share/doc/tallyd/README.md"),
        roman(
            ". The book (the guide, operations and runbooks, the configuration reference, \
               the guarantees and the design) is ",
        ),
        italic("docs/"),
        roman(" in tally's source; "),
        bold("mdbook build docs"),
        roman(" builds it."),
    ]);
    roff
}

/// `command` without its hidden arguments and subcommands, recursively:
/// what `--help` shows. (clap keeps no way to remove them, so the
/// command is built again from what is shown.)
fn visible(command: &Command) -> Command {
    let hidden: Vec<&str> = command
        .get_arguments()
        .filter(|arg| arg.is_hide_set())
        .map(|arg| arg.get_id().as_str())
        .collect();
    let mut shown = Command::new(command.get_name().to_owned())
        .subcommand_required(command.is_subcommand_required_set())
        .arg_required_else_help(command.is_arg_required_else_help_set())
        .propagate_version(command.is_propagate_version_set());
    if let Some(about) = command.get_about() {
        shown = shown.about(about.clone());
    }
    if let Some(about) = command.get_long_about() {
        shown = shown.long_about(about.clone());
    }
    if let Some(after) = command.get_after_help() {
        shown = shown.after_help(after.clone());
    }
    if let Some(after) = command.get_after_long_help() {
        shown = shown.after_long_help(after.clone());
    }
    if let Some(version) = command.get_version() {
        shown = shown.version(version.to_owned());
    }
    shown = shown.args(
        command
            .get_arguments()
            .filter(|arg| !arg.is_hide_set())
            .cloned(),
    );
    for group in command.get_groups() {
        if !group.get_args().any(|id| hidden.contains(&id.as_str())) {
            shown = shown.group(group.clone());
        }
    }
    for sub in command.get_subcommands().filter(|sub| !sub.is_hide_set()) {
        shown = shown.subcommand(visible(sub));
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command renamed or removed fails here, not as a dangling SEE ALSO.
    #[test]
    fn related_commands_are_commands() {
        let files: Vec<String> = pages().into_iter().map(|(file, _)| file).collect();
        for (of, others) in RELATED {
            for name in std::iter::once(of).chain(others.iter()) {
                let file = format!("tallyd-{name}.1");
                assert!(files.contains(&file), "{file} not among {files:?}");
            }
        }
    }

    /// Every page's EXIT STATUS lists the table's codes, each once, in
    /// its order, and nothing else.
    #[test]
    fn every_page_lists_exactly_the_table_of_exit_codes() {
        let table: Vec<String> = EXIT_CODES
            .iter()
            .map(|(code, _)| format!("\\fB{code}\\fR"))
            .collect();
        for (file, text) in pages() {
            let section = text
                .split(".SH \"EXIT STATUS\"\n")
                .nth(1)
                .and_then(|rest| rest.split("\n.SH ").next())
                .unwrap_or_else(|| panic!("{file} has no EXIT STATUS"));
            let lines: Vec<&str> = section.lines().collect();
            let codes: Vec<&str> = lines
                .windows(2)
                .filter(|pair| pair[0] == ".TP")
                .map(|pair| pair[1])
                .collect();
            assert_eq!(codes, table, "{file}:\n{section}");
        }
    }

    /// Whatever `--help` hides — an argument's flag and variable, a command —
    /// no man page shows and no page is written for: found from the command
    /// line's own definitions.
    #[test]
    fn no_page_shows_what_help_hides() {
        fn hidden(command: &Command, words: &mut Vec<String>, commands: &mut Vec<String>) {
            for arg in command.get_arguments().filter(|arg| arg.is_hide_set()) {
                words.extend(arg.get_long().map(|long| format!("--{long}")));
                words.extend(arg.get_env().map(|env| env.to_string_lossy().into_owned()));
            }
            for sub in command.get_subcommands() {
                if sub.is_hide_set() {
                    commands.push(sub.get_name().to_owned());
                    words.push(format!("tallyd {}", sub.get_name()));
                    words.extend(sub.get_about().map(|about| about.to_string()));
                } else {
                    hidden(sub, words, commands);
                }
            }
        }
        // roff source as a reader sees it: font changes dropped, escaped
        // dashes and apostrophes as themselves.
        fn unroff(text: &str) -> String {
            text.replace("\\fB", "")
                .replace("\\fI", "")
                .replace("\\fR", "")
                .replace("\\-", "-")
                .replace("\\*(Aq", "'")
        }
        let (mut words, mut commands) = (Vec::new(), Vec::new());
        hidden(&command(), &mut words, &mut commands);
        for expected in ["--clock-offset", "TALLYD_CLOCK_OFFSET", "tallyd man"] {
            assert!(words.iter().any(|w| w == expected), "{words:?}");
        }
        let pages = pages();
        for command in &commands {
            let file = format!("tallyd-{command}.1");
            assert!(!pages.iter().any(|(name, _)| *name == file), "{file}");
            words.push(format!("tallyd-{command}("));
        }
        for (name, page) in &pages {
            let text = unroff(page);
            for word in &words {
                assert!(
                    !text.contains(word.as_str()),
                    "{name} shows {word}:\n{text}"
                );
            }
        }
    }

    #[test]
    fn code_spans_are_bold() {
        assert_eq!(
            marked("run `tallyd setup` first"),
            vec![roman("run "), bold("tallyd setup"), roman(" first")]
        );
    }
}
