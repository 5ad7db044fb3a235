//! Exit codes by class: the same for every command. [`EXIT_CODES`] is the
//! one table of them, with what each means; every command's `--help` ends
//! with it ([`exit_codes_help`]) and every man page's EXIT STATUS lists it,
//! so the two cannot disagree.
//!
//! The code is decided by the error's class, kind and server code
//! ([`crate::error::Trouble`]), never by its text. An outcome that is
//! unknown or pending exits 75 whatever its cause; a definite "not done"
//! exits by its cause (69, 77, else 1).

use std::process::ExitCode;

use crate::cli::out;
use crate::error::{Effect, Error, Trouble};
use crate::redact::Secrets;
use crate::store::Store;

/// Exit status: done.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit status: definitely not done (refused, nothing written); nothing
/// more will happen on its own.
pub(crate) const EXIT_FAILED: u8 = 1;
/// Exit status: the command line was wrong (`EX_USAGE`).
pub(crate) const EXIT_USAGE: u8 = 64;
/// Exit status: the server is unavailable (`EX_UNAVAILABLE`); nothing was
/// written.
pub(crate) const EXIT_UNAVAILABLE: u8 = 69;
/// Exit status: the outcome is pending or unknown; settling it later is
/// safe (`EX_TEMPFAIL`).
pub(crate) const EXIT_TEMPFAIL: u8 = 75;
/// Exit status: authentication failed or a privilege is missing
/// (`EX_NOPERM`).
pub(crate) const EXIT_NOPERM: u8 = 77;
pub(crate) use crate::config::EXIT_CONFIG;
/// Exit status of a command stopped by Ctrl-C (SIGINT) after it printed
/// what it did: 128 + 2, as a shell reports a process SIGINT ended.
pub(crate) const EXIT_INTERRUPTED: u8 = 130;

/// A token cancelled at the first Ctrl-C (SIGINT), for a command that then
/// stops in order and exits [`EXIT_INTERRUPTED`]; a second Ctrl-C ends the
/// process at once, with that exit status (what was in flight, such as a
/// write waiting for an unreachable server, is not waited for). The handler
/// is in place when this returns.
pub(crate) fn cancelled_at_ctrl_c() -> tokio_util::sync::CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let token = tokio_util::sync::CancellationToken::new();
    let cancel = token.clone();
    match signal(SignalKind::interrupt()) {
        Ok(mut interrupts) => {
            tokio::spawn(async move {
                if interrupts.recv().await.is_some() {
                    eprintln!(
                        "tallyd: interrupted: stopping in order after the work in flight (Ctrl-C \
                         again to stop at once)"
                    );
                    cancel.cancel();
                }
                if interrupts.recv().await.is_some() {
                    eprintln!("tallyd: interrupted again: stopping at once");
                    std::process::exit(i32::from(EXIT_INTERRUPTED));
                }
            });
        }
        Err(err) => eprintln!("warning: Ctrl-C will not stop this command in order: {err}"),
    }
    token
}

/// Every exit status and what it means, in order: the table `--help`
/// ([`exit_codes_help`]) and the man pages' EXIT STATUS render.
pub(crate) const EXIT_CODES: &[(u8, &str)] = &[
    (EXIT_OK, "done"),
    (
        EXIT_FAILED,
        "definitely not done (refused, nothing written); `status --check`: something needs \
         attention",
    ),
    (
        EXIT_USAGE,
        "usage: an unknown command or flag, a missing or malformed argument",
    ),
    (
        EXIT_UNAVAILABLE,
        "the server is unavailable (nothing was written); try again later",
    ),
    (
        EXIT_TEMPFAIL,
        "the outcome is unknown or pending: run the printed command (resuming is safe)",
    ),
    (
        EXIT_NOPERM,
        "permission denied: authentication failed, or the user lacks a privilege",
    ),
    (
        EXIT_CONFIG,
        "configuration: a bad key, a collection not configured, a URI that cannot be used",
    ),
    (
        EXIT_INTERRUPTED,
        "stopped by Ctrl-C after saying what it did (`record --from`, `bench`, `reconcile`); \
         running it again is safe",
    ),
];

/// [`EXIT_CODES`] as the end of every command's `--help`.
pub(crate) fn exit_codes_help() -> String {
    let mut help = String::from("Exit codes (the same for every command):");
    for (code, meaning) in EXIT_CODES {
        help.push_str(&format!("\n  {code:<3} {meaning}"));
    }
    help
}

/// The exit code of a command that did not get done because of `err`.
pub(crate) fn exit_code_for(err: &Error) -> u8 {
    match err {
        Error::Server(failure) => match failure.trouble() {
            Trouble::Unavailable => EXIT_UNAVAILABLE,
            Trouble::PermissionDenied => EXIT_NOPERM,
            Trouble::Refused => EXIT_FAILED,
            Trouble::Misconfigured => EXIT_CONFIG,
        },
        Error::LogRefused { .. } => EXIT_NOPERM,
        _ => EXIT_FAILED,
    }
}

/// The exit code of a read that left an increment pending (a settle's
/// look-up): 75, to be tried again later — unless waiting cannot help (the
/// credentials, the configuration), then its class's.
pub(crate) fn exit_code_for_pending(err: &Error) -> u8 {
    match exit_code_for(err) {
        code @ (EXIT_NOPERM | EXIT_CONFIG) => code,
        _ => EXIT_TEMPFAIL,
    }
}

/// The exit code of a write that failed with `err`: 75 when the write may
/// have been applied (a lost reply: sending it again is the remedy), else
/// as [`exit_code_for`].
pub(crate) fn exit_code_for_write(err: &Error) -> u8 {
    match err {
        Error::Server(failure) if failure.effect != Effect::NotApplied => EXIT_TEMPFAIL,
        _ => exit_code_for(err),
    }
}

/// Prints a failure that happened before any outcome was known; `code` is
/// its exit code.
pub(super) fn fail(json: bool, message: &str, secrets: &Secrets, code: u8) -> ExitCode {
    let message = secrets.scrub(message);
    if json {
        out!(
            "{}",
            serde_json::json!({ "outcome": "error", "error": message })
        );
    } else {
        eprintln!("error: {message}");
    }
    ExitCode::from(code)
}

/// [`fail`] for an error of an operation on `store`: its message names
/// where the operation went; its exit code is its class's.
pub(super) fn fail_with(json: bool, err: &Error, store: &Store, secrets: &Secrets) -> ExitCode {
    fail(json, &store.explain(err), secrets, exit_code_for(err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Failure;
    use mongodb::bson::{deserialize_from_document as from_document, doc};
    use mongodb::error::{CommandError, Error as MongoError, ErrorKind};

    fn command(code: i32) -> Error {
        let err: CommandError =
            from_document(doc! { "code": code, "codeName": "X", "errmsg": "m" }).unwrap();
        Error::Server(Failure::once("t", ErrorKind::Command(err).into()))
    }

    fn io(kind: std::io::ErrorKind) -> Error {
        let err: MongoError = ErrorKind::Io(std::sync::Arc::new(kind.into())).into();
        Error::Server(Failure::once("t", err))
    }

    #[test]
    fn the_exit_code_follows_the_class_kind_and_code() {
        // Permission: Unauthorized, AuthenticationFailed.
        assert_eq!(exit_code_for(&command(13)), EXIT_NOPERM);
        assert_eq!(exit_code_for(&command(18)), EXIT_NOPERM);
        // Unavailable: the network, a node that is not (or no longer) primary.
        assert_eq!(
            exit_code_for(&io(std::io::ErrorKind::ConnectionRefused)),
            EXIT_UNAVAILABLE
        );
        assert_eq!(exit_code_for(&command(10107)), EXIT_UNAVAILABLE);
        // Refused: bad value, validation, too large, a duplicate key.
        for code in [2, 14, 121, 10334, 11000] {
            assert_eq!(exit_code_for(&command(code)), EXIT_FAILED, "code {code}");
        }
        assert_eq!(
            exit_code_for(&Error::InvalidArgument("x".into())),
            EXIT_FAILED
        );
        // A write that may have applied: try again (resuming is safe).
        assert_eq!(
            exit_code_for_write(&io(std::io::ErrorKind::ConnectionReset)),
            EXIT_TEMPFAIL
        );
        assert_eq!(exit_code_for_write(&command(13)), EXIT_NOPERM);
        assert_eq!(exit_code_for_write(&command(2)), EXIT_FAILED);
    }
}
