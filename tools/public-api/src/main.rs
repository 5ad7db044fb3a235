//! Prints the public API of a crate, one item per line, from the JSON
//! rustdoc writes with `--output-format json` (`scripts/public-api` runs
//! it and keeps the listings in `api/`); with `--missing-examples`, lists
//! instead the public types and functions whose documentation has no
//! example, and fails when there is one.
//!
//! ```text
//! tally-public-api target/doc/tally.json
//! tally-public-api --missing-examples target/doc/tally.json
//! ```
//!
//! Blanket implementations (`impl<T> From<T> for T`, `Any`, `Borrow`, …)
//! are left out: they follow from the rest and would make most of the
//! listing. Auto traits (`Send`, `Sync`, …) and derived implementations
//! stay: losing one breaks callers.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use public_api::PublicApi;
use rustdoc_types::{Crate, Id, ItemEnum};

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (examples, json) = match args.as_slice() {
        [json] => (false, json),
        [flag, json] if flag == "--missing-examples" => (true, json),
        _ => {
            eprintln!("usage: tally-public-api [--missing-examples] RUSTDOC_JSON");
            return ExitCode::from(2);
        }
    };
    let api = public_api::Builder::from_rustdoc_json(json)
        .omit_blanket_impls(true)
        .build();
    let api = match api {
        Ok(api) => api,
        Err(err) => {
            eprintln!(
                "error: cannot read {}: {err} (does the public-api version in \
                 tools/public-api/Cargo.toml read the rustdoc JSON format of the pinned toolchain?)",
                Path::new(json).display()
            );
            return ExitCode::FAILURE;
        }
    };
    if !examples {
        for item in api.items() {
            println!("{item}");
        }
        return ExitCode::SUCCESS;
    }
    let krate = match read_crate(Path::new(json)) {
        Ok(krate) => krate,
        Err(err) => {
            eprintln!("error: cannot read {}: {err}", Path::new(json).display());
            return ExitCode::FAILURE;
        }
    };
    let missing = missing_examples(&api, &krate);
    for item in &missing {
        println!("{item}");
    }
    if missing.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "error: {} public item(s) above have no example in their documentation: \
             give each a ``` block that compiles (no_run when it needs a server)",
            missing.len()
        );
        ExitCode::FAILURE
    }
}

fn read_crate(path: &Path) -> Result<Crate, String> {
    let text = std::fs::read_to_string(path).map_err(|err| err.to_string())?;
    serde_json::from_str(&text).map_err(|err| err.to_string())
}

/// Every public type and function of the crate itself — methods
/// included, those of trait implementations not (`Clone::clone`,
/// `Display::fmt`: the trait documents them) — whose documentation has no
/// Rust example (see [`has_rust_example`]), as the listing shows it. An item reached by several paths
/// is named once.
fn missing_examples(api: &PublicApi, krate: &Crate) -> BTreeSet<String> {
    let in_trait_impls: HashSet<&Id> = krate
        .index
        .values()
        .filter_map(|item| match &item.inner {
            ItemEnum::Impl(imp) if imp.trait_.is_some() => Some(&imp.items),
            _ => None,
        })
        .flatten()
        .collect();
    let mut named: HashMap<Id, String> = HashMap::new();
    for public in api.items() {
        let id = public.id();
        let Some(item) = krate.index.get(&id) else {
            continue;
        };
        let wants_example = matches!(
            item.inner,
            ItemEnum::Struct(_)
                | ItemEnum::Enum(_)
                | ItemEnum::Union(_)
                | ItemEnum::Trait(_)
                | ItemEnum::TypeAlias(_)
                | ItemEnum::Function(_)
        );
        let has_example = item.docs.as_deref().is_some_and(has_rust_example);
        if item.crate_id == 0 && wants_example && !has_example && !in_trait_impls.contains(&id) {
            // The shortest of its paths (`tally::Backlog`, not a longer one).
            let line = public.to_string();
            named
                .entry(id)
                .and_modify(|shown| {
                    if line.len() < shown.len() {
                        shown.clone_from(&line);
                    }
                })
                .or_insert(line);
        }
    }
    named.into_values().collect()
}

/// Whether `docs` hold a code block rustdoc compiles as a doc test: a
/// fence with no info string, or one whose words are all Rust's (`rust`,
/// `no_run`, `should_panic`, an edition). A `text` block, or one rustdoc
/// skips (`ignore`) or expects to fail (`compile_fail`), is no example.
fn has_rust_example(docs: &str) -> bool {
    let mut in_block = false;
    for line in docs.lines() {
        let line = line.trim_start();
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        if in_block {
            in_block = false;
            continue;
        }
        in_block = true;
        let rust = info
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|word| !word.is_empty())
            .all(|word| {
                matches!(word, "rust" | "no_run" | "should_panic") || word.starts_with("edition")
            });
        if rust {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::has_rust_example;

    #[test]
    fn a_rust_fence_is_an_example() {
        assert!(has_rust_example("Adds.\n\n```\nlet x = 1;\n```"));
        assert!(has_rust_example("```rust\nlet x = 1;\n```"));
        assert!(has_rust_example("```no_run\nlet x = 1;\n```"));
        assert!(has_rust_example(
            "```rust,no_run,edition2024\nlet x = 1;\n```"
        ));
    }

    #[test]
    fn text_ignored_or_failing_blocks_are_not() {
        assert!(!has_rust_example("No code."));
        assert!(!has_rust_example("```text\ntallyd run\n```"));
        assert!(!has_rust_example("```ignore\nlet x = 1;\n```"));
        assert!(!has_rust_example("```compile_fail\nlet x: u8 = -1;\n```"));
        // The fence closing a text block is not the opening of an example.
        assert!(!has_rust_example("```text\na\n```\nand then prose"));
        assert!(has_rust_example("```text\na\n```\n```\nlet x = 1;\n```"));
    }
}
