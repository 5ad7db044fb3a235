//! Shell completions and man pages, generated from the command line's own
//! definitions (hidden commands, run when the package is built): what
//! `--help` says and what the shell completes never drift apart.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::{Cli, EXIT_FAILED, EXIT_OK};

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
    let mut command = Cli::command();
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
    let command = Cli::command();
    if let Err(err) = clap_mangen::generate_to(command, &args.dir) {
        eprintln!(
            "error: cannot write the man pages into {}: {err}",
            args.dir.display()
        );
        return ExitCode::from(EXIT_FAILED);
    }
    ExitCode::from(EXIT_OK)
}
