//! What `tallyd bench` prints: the table (or the JSON) of the sides and
//! their checks, or, after Ctrl-C or an outage, what was measured
//! unchecked.

use std::process::ExitCode;

use serde_json::json;

use super::side::Side;
use super::{BenchArgs, Protocol};
use crate::cli::exit::{EXIT_INTERRUPTED, EXIT_UNAVAILABLE};
use crate::cli::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, out};
use crate::error::words;

/// Prints the table (or the JSON) and says whether every check held.
pub(super) fn report(args: &BenchArgs, collection: &str, sides: &[Side]) -> ExitCode {
    let plain = sides
        .iter()
        .find(|s| s.protocol == Protocol::Plain)
        .map(Side::per_second);
    let ok = sides.iter().all(|s| s.check().is_ok());
    let kept = if args.keep { "kept" } else { "dropped" };
    if args.json {
        let shown: Vec<_> = sides.iter().map(|s| s.json(plain)).collect();
        out!(
            "{}",
            json!({
                "writers": args.writers,
                "keys": args.keys,
                "seconds": args.seconds,
                "collection": collection,
                "kept": args.keep,
                "sides": shown,
                "ok": ok,
            })
        );
    } else {
        let writers = match args.writers {
            1 => "1 writer".to_owned(),
            n => format!("{n} writers sharing one handle"),
        };
        let keys = match args.keys {
            1 => "1 key".to_owned(),
            n => format!("{n} keys"),
        };
        out!(
            "tallyd bench: {writers}, {keys}, {}s per side in interleaved slices; collection \
             {collection} ({kept})",
            args.seconds
        );
        out!("{}", Side::header());
        for side in sides {
            out!("{}", side.row(plain));
        }
        for side in sides {
            out!("{}", side.check_line());
        }
    }
    ExitCode::from(if ok { EXIT_OK } else { EXIT_FAILED })
}

/// Why a bench stopped before its end.
pub(super) enum Cut {
    /// Ctrl-C (SIGINT).
    Interrupted,
    /// The server could not be reached: where, and why.
    Outage(String),
}

/// What a bench cut short measured, unchecked, and what became of its
/// scratch collections: exit 130 for Ctrl-C; for an outage 69, or 75 when
/// some increment's outcome is not known.
pub(super) fn report_cut(
    args: &BenchArgs,
    scratch: &[String],
    sides: &[Side],
    cut: &Cut,
) -> ExitCode {
    let plain = sides
        .iter()
        .find(|s| s.protocol == Protocol::Plain)
        .map(Side::per_second);
    let (outcome, said, code) = match cut {
        Cut::Interrupted => {
            let kept = if args.keep { "kept" } else { "dropped" };
            let said = format!(
                "interrupted: the counters were not checked; the scratch collections {} were \
                 {kept}",
                words(scratch)
            );
            ("interrupted", said, EXIT_INTERRUPTED)
        }
        Cut::Outage(why) => {
            let said = format!(
                "error: the server is unavailable: {why}; stopped: the counters were not \
                 checked, and the scratch collections {} were left (drop them once it answers)",
                words(scratch)
            );
            let uncertain = sides.iter().any(Side::uncertain);
            let code = if uncertain {
                EXIT_TEMPFAIL
            } else {
                EXIT_UNAVAILABLE
            };
            ("unavailable", said, code)
        }
    };
    if args.json {
        let shown: Vec<_> = sides.iter().map(|s| s.json(plain)).collect();
        out!(
            "{}",
            json!({
                "outcome": outcome,
                "collections": scratch,
                "kept": args.keep || matches!(cut, Cut::Outage(_)),
                "sides": shown,
                "ok": false,
            })
        );
    } else {
        out!("{}", Side::header());
        for side in sides {
            out!("{}", side.row(plain));
        }
    }
    eprintln!("{said}");
    ExitCode::from(code)
}
