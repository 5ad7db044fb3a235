//! Prints the public API of a crate, one item per line, from the JSON
//! rustdoc writes with `--output-format json` (`scripts/public-api` runs
//! it and keeps the listings in `api/`).
//!
//! ```text
//! tally-public-api target/doc/tally.json
//! ```
//!
//! Blanket implementations (`impl<T> From<T> for T`, `Any`, `Borrow`, …)
//! are left out: they follow from the rest and would make most of the
//! listing. Auto traits (`Send`, `Sync`, …) and derived implementations
//! stay: losing one breaks callers.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(json), None) = (args.next(), args.next()) else {
        eprintln!("usage: tally-public-api RUSTDOC_JSON");
        return ExitCode::from(2);
    };
    let api = public_api::Builder::from_rustdoc_json(&json)
        .omit_blanket_impls(true)
        .build();
    match api {
        Ok(api) => {
            for item in api.items() {
                println!("{item}");
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!(
                "error: cannot read {}: {err} (does the public-api version in \
                 tools/public-api/Cargo.toml read the rustdoc JSON format of the pinned toolchain?)",
                std::path::Path::new(&json).display()
            );
            ExitCode::FAILURE
        }
    }
}
