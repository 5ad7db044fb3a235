//! The commands `tallyd` prints for the user to run, as the user would
//! paste them.

use super::Cli;

/// The global options of this process's command line that a printed
/// command must repeat (`-c PATH`, `--env-file PATH`), as shell words;
/// set once, when the command line is parsed.
static GIVEN_OPTIONS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

impl Cli {
    /// Keeps the options a printed command repeats ([`shown_command`]),
    /// their paths made absolute: the command is pasted anywhere (another
    /// directory, another shell), where a relative path names nothing.
    pub(super) fn remember_options(&self) {
        let word = |path: &std::path::Path| {
            let path = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
            super::increment::shell_word(&path.to_string_lossy())
        };
        let mut given = Vec::new();
        if let Some(path) = &self.config {
            given.push(format!("-c {}", word(path)));
        }
        if let Some(path) = &self.env_file {
            given.push(format!("--env-file {}", word(path)));
        }
        let _ = GIVEN_OPTIONS.set(given.join(" "));
    }
}

/// `tallyd` with the `-c`/`--config` and `--env-file` this command was
/// given, then `rest`: a command printed for the user to run, which works
/// pasted as shown (without them it would read another configuration, or
/// none).
pub(crate) fn shown_command(rest: &str) -> String {
    match GIVEN_OPTIONS.get() {
        Some(given) if !given.is_empty() => format!("tallyd {given} {rest}"),
        _ => format!("tallyd {rest}"),
    }
}

/// Writes `args` (and a newline) to standard output. A reader that went
/// away (`tallyd status | head -1`) is no failure of the command: the rest
/// of the output is dropped, and the command still finishes — closing its
/// connection in order — with the exit code of what it did. Any other
/// failure to write is said on standard error.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>, newline: bool) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let written = if newline {
        writeln!(stdout, "{args}")
    } else {
        write!(stdout, "{args}")
    };
    match written.and_then(|()| stdout.flush()) {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("error: cannot write to standard output: {err}");
        }
        _ => {}
    }
}
