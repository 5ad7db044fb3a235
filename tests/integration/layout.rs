//! The layout rule of `src/lib.rs`, enforced: every `crate::` reference
//! follows the allowed-imports table there, no file grows past 600 lines
//! before its tests, and an application built without the `daemon` feature
//! links none of the daemon's dependencies.
//!
//! No server is involved.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The most lines a file of `src/` may have before its inline tests.
const MAX_LINES: usize = 600;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries =
            std::fs::read_dir(&dir).unwrap_or_else(|err| panic!("list {}: {err}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The file's path below `src/`, with `/` separators.
fn relative(path: &Path) -> String {
    let src = root().join("src");
    let relative = path.strip_prefix(&src).expect("a file under src/");
    relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// The top-level module a file of `src/` belongs to (`write/counter.rs` →
/// `write`); `None` for the crate roots `lib.rs` and `main.rs`.
fn top_module(relative: &str) -> Option<String> {
    let first = relative.split('/').next().expect("a path");
    let module = first.strip_suffix(".rs").unwrap_or(first);
    (module != "lib" && module != "main").then(|| module.to_owned())
}

/// What each module may import, read from the table in `src/lib.rs`'s
/// Layout section: lines `//! name → other other`, where `(nothing)` and
/// `(anything)` say what they say. `None` stands for anything.
fn allowed_imports() -> BTreeMap<String, Option<BTreeSet<String>>> {
    let lib = read(&root().join("src/lib.rs"));
    let mut table = BTreeMap::new();
    for line in lib.lines() {
        let Some((module, targets)) = line
            .strip_prefix("//!")
            .and_then(|rest| rest.split_once('→'))
        else {
            continue;
        };
        let module = module.trim();
        if module.is_empty() || !module.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            continue;
        }
        let targets = match targets.trim() {
            "(anything)" => None,
            "(nothing)" => Some(BTreeSet::new()),
            list => Some(list.split_whitespace().map(str::to_owned).collect()),
        };
        table.insert(module.to_owned(), targets);
    }
    assert!(
        !table.is_empty(),
        "src/lib.rs has no allowed-imports table (lines `//! module → other other`)"
    );
    table
}

/// The modules a source file names as `crate::<module>`, each with the line
/// it is named on; `use crate::{a::b, c}` names `a` and `c`.
fn crate_references(source: &str) -> Vec<(usize, String)> {
    let line_of = |offset: usize| source[..offset].matches('\n').count() + 1;
    let identifier = |text: &str| -> String {
        text.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for (at, _) in source.match_indices("crate::") {
        let preceded_by_word = source[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
        if preceded_by_word {
            continue;
        }
        let rest = &source[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The names at the group's first level.
            let mut depth = 0;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        item_start = false;
                        let name = identifier(&group[i..]);
                        let offset = at + "crate::{".len() + i;
                        found.push((line_of(offset), name));
                    }
                    _ => {}
                }
            }
        } else {
            found.push((line_of(at), identifier(rest)));
        }
    }
    found
}

#[test]
fn every_crate_reference_follows_the_layout_in_lib_rs() {
    let table = allowed_imports();
    let files = rust_files(&root().join("src"));
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|f| top_module(&relative(f)))
        .collect();
    let listed: BTreeSet<String> = table.keys().cloned().collect();
    assert_eq!(
        modules, listed,
        "src/lib.rs's allowed-imports table must list exactly the top-level modules of src/"
    );
    for targets in table.values().flatten() {
        for target in targets {
            assert!(
                modules.contains(target),
                "the allowed-imports table names {target}, which src/ does not have"
            );
        }
    }

    let mut forbidden = Vec::new();
    for file in &files {
        let relative = relative(file);
        let Some(module) = top_module(&relative) else {
            continue;
        };
        let Some(allowed) = &table[&module] else {
            continue;
        };
        for (line, target) in crate_references(&read(file)) {
            if target != module && modules.contains(&target) && !allowed.contains(&target) {
                forbidden.push(format!("src/{relative}:{line}: {module} → {target}"));
            }
        }
    }
    assert!(
        forbidden.is_empty(),
        "imports that src/lib.rs's Layout table does not allow:\n  {}",
        forbidden.join("\n  ")
    );
}

#[test]
fn the_reference_scanner_reads_paths_and_groups() {
    let source = "use crate::error::Error;\nuse crate::{\n    store::{Store, StoreConfig},\n    token,\n};\n\
                  fn f() { crate::write::x(); let _ = $crate::no; }\n";
    assert_eq!(
        crate_references(source),
        [
            (1, "error".to_owned()),
            (3, "store".to_owned()),
            (4, "token".to_owned()),
            (6, "write".to_owned()),
        ]
    );
}

/// Lines before the file's inline tests (`#[cfg(test)]` on a `mod … {`);
/// the whole file when it has none.
fn lines_before_tests(source: &str) -> usize {
    let lines: Vec<&str> = source.lines().collect();
    lines
        .windows(2)
        .position(|pair| {
            pair[0].trim() == "#[cfg(test)]"
                && pair[1].starts_with("mod ")
                && pair[1].trim_end().ends_with('{')
        })
        .unwrap_or(lines.len())
}

#[test]
fn no_file_has_more_than_600_lines_before_its_tests() {
    let mut too_long = Vec::new();
    for file in rust_files(&root().join("src")) {
        // A file of tests (`#[cfg(test)] mod tests;`) does not count.
        if file.file_name().is_some_and(|name| name == "tests.rs") {
            continue;
        }
        let lines = lines_before_tests(&read(&file));
        if lines > MAX_LINES {
            too_long.push(format!("src/{}: {lines} lines", relative(&file)));
        }
    }
    assert!(
        too_long.is_empty(),
        "files over {MAX_LINES} lines before their tests (split them by concept):\n  {}",
        too_long.join("\n  ")
    );
}

/// The crates the `daemon` feature brings (`dep:` entries in Cargo.toml),
/// less those the library links anyway.
fn daemon_only_crates() -> BTreeSet<String> {
    let manifest: toml::Table = read(&root().join("Cargo.toml"))
        .parse()
        .expect("Cargo.toml is TOML");
    let daemon = manifest["features"]["daemon"]
        .as_array()
        .expect("Cargo.toml has a `daemon` feature");
    let mut crates: BTreeSet<String> = daemon
        .iter()
        .filter_map(|f| f.as_str()?.strip_prefix("dep:").map(str::to_owned))
        .collect();
    assert!(
        crates.contains("axum"),
        "the daemon feature lists its dependencies: {crates:?}"
    );
    // The driver's BSON library depends on uuid: every build has it.
    crates.remove("uuid");
    crates
}

#[test]
fn the_application_crate_links_no_daemon_dependency() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(&cargo)
        .args([
            "tree",
            "--locked",
            "-p",
            "tally-counter-app",
            "-e",
            "normal",
        ])
        .args(["--prefix", "none", "--format", "{p}"])
        .arg("--manifest-path")
        .arg(root().join("Cargo.toml"))
        .output()
        .unwrap_or_else(|err| panic!("run {cargo:?} tree: {err}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "cargo tree -p tally-counter-app failed; run it by hand to see why:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let linked: BTreeSet<&str> = stdout
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert!(
        linked.contains("tally") && linked.contains("mongodb"),
        "cargo tree shows the application with tally and the driver:\n{stdout}"
    );
    let daemon_only: Vec<String> = daemon_only_crates()
        .into_iter()
        .filter(|name| linked.contains(name.as_str()))
        .collect();
    assert!(
        daemon_only.is_empty(),
        "tally-counter-app (tally with default-features = false) links daemon-only crates: \
         {daemon_only:?}\n{stdout}"
    );
}
