//! Shell completions and man pages, generated from the command line's own
//! definitions (hidden commands, run when the package is built): what
//! `--help` says and what the shell completes never drift apart. Neither
//! offers what `--help` hides (`completions`, `man`, `--clock-offset`):
//! the generators would, so they are given the command line without it.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Command};
use clap_complete::Shell;

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

/// Writes `tallyd.1` and a page per command (`tallyd-run.1`, …) into
/// `args.dir`, and prints their paths.
pub(super) fn man(args: &ManArgs) -> ExitCode {
    let command = visible(&command());
    if let Err(err) = clap_mangen::generate_to(command, &args.dir) {
        eprintln!(
            "error: cannot write the man pages into {}: {err}",
            args.dir.display()
        );
        return ExitCode::from(EXIT_FAILED);
    }
    ExitCode::from(EXIT_OK)
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
        .arg_required_else_help(command.is_arg_required_else_help_set());
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
