//! What ships beside the binary: the systemd units in `systemd/`, the
//! Prometheus rules in `config/alerts.yml`, the man pages and shell
//! completions the binary generates, checked against the code they
//! describe (metric names, the config exit code, the shutdown deadline, the
//! commands) and against the tools that read them (`systemd-analyze
//! verify`, bash). The alert
//! rules are also checked by `promtool` in `.ci/run` (`scripts/check-alert-rules`).
//! No database needed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    let path = root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

fn output_text(output: &Output) -> String {
    format!(
        "exit: {}\n--- stdout\n{}--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

// --- metric names ----------------------------------------------------------

/// Every metric name `src/daemon/metrics.rs` (and its `metrics/api.rs`) registers: its quoted
/// `"tally_..."` strings. A histogram also exposes `_bucket`, `_sum` and `_count` series.
fn exported_metrics() -> BTreeSet<String> {
    let source = read("src/daemon/metrics.rs") + &read("src/daemon/metrics/api.rs");
    let mut names = BTreeSet::new();
    for (quote, _) in source.match_indices("\"tally_") {
        let start = quote + 1;
        let Some(len) = source[start..].find('"') else {
            continue;
        };
        let name = &source[start..start + len];
        let valid = name.len() > "tally_".len()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            continue;
        }
        names.insert(name.to_owned());
        if source[..quote].trim_end().ends_with("HistogramOpts::new(") {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// Every `tally_[a-z0-9_]+` word in `text`.
fn tally_identifiers(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut found = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("tally_") {
        let start = from + at;
        let mut end = start + "tally_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        let whole_word = (start == 0 || !is_word(bytes[start - 1]))
            && (end == bytes.len() || !is_word(bytes[end]));
        if whole_word && end > start + "tally_".len() {
            found.insert(text[start..end].to_owned());
        }
        from = end;
    }
    found
}

#[test]
fn the_metric_list_is_read_from_the_source() {
    let metrics = exported_metrics();
    for expected in [
        "tally_ready",
        "tally_lease_active",
        "tally_reconcile_runs_total",
        "tally_reconcile_duration_seconds_bucket",
        "tally_webhook_deliveries_total",
    ] {
        assert!(metrics.contains(expected), "{expected} not in {metrics:?}");
    }
    assert!(!metrics.contains("tally_ready_bucket"), "{metrics:?}");
}

#[test]
fn alert_rules_use_only_metrics_the_daemon_exports() {
    let rules = read("config/alerts.yml");
    let metrics = exported_metrics();
    let used = tally_identifiers(&rules);
    for expected in [
        "tally_stuck_tokens",
        "tally_fold_refused_documents",
        "tally_largest_lane_map",
    ] {
        assert!(used.contains(expected), "no rule uses {expected}: {used:?}");
    }
    let unknown: Vec<&String> = used.difference(&metrics).collect();
    assert!(
        unknown.is_empty(),
        "config/alerts.yml names metrics src/daemon/metrics.rs does not define: {unknown:?}\n\
         defined: {metrics:?}"
    );
}

/// Every PromQL query of the Grafana dashboard: each panel target's `expr`
/// and each template variable's `query`.
fn dashboard_queries() -> Vec<String> {
    fn walk(value: &serde_json::Value, queries: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(object) => {
                for (key, value) in object {
                    match (key.as_str(), value) {
                        ("expr" | "definition", serde_json::Value::String(query)) => {
                            queries.push(query.clone());
                        }
                        _ => walk(value, queries),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, queries)),
            _ => {}
        }
    }
    let dashboard: serde_json::Value = serde_json::from_str(&read("config/grafana-dashboard.json"))
        .expect("config/grafana-dashboard.json is JSON");
    let mut queries = Vec::new();
    walk(&dashboard["panels"], &mut queries);
    walk(&dashboard["templating"], &mut queries);
    queries
}

/// The dashboard queries only metrics `/metrics` serves, and shows every
/// one of them (a histogram through its series).
#[test]
fn the_dashboard_queries_exactly_the_metrics_the_daemon_exports() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{queries:?}");
    let used: BTreeSet<String> = queries.iter().flat_map(|q| tally_identifiers(q)).collect();
    let metrics = exported_metrics();
    let unknown: Vec<&String> = used.difference(&metrics).collect();
    assert!(
        unknown.is_empty(),
        "config/grafana-dashboard.json queries metrics src/daemon/metrics.rs does not define: \
         {unknown:?}"
    );
    let histograms: BTreeSet<String> = metrics
        .iter()
        .filter_map(|m| m.strip_suffix("_bucket").map(str::to_owned))
        .collect();
    let unshown: Vec<&String> = metrics
        .iter()
        .filter(|m| !histograms.contains(m.as_str()))
        .filter(|m| !used.contains(m.as_str()))
        .collect();
    assert!(
        unshown.is_empty(),
        "metrics no panel of config/grafana-dashboard.json shows: {unshown:?}"
    );
}

/// Every rule of `config/alerts.yml`: its name and the lines after it,
/// trimmed.
fn alert_rules() -> Vec<(String, String)> {
    let rules = read("config/alerts.yml");
    let mut alerts: Vec<(String, String)> = Vec::new();
    for line in rules.lines() {
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alerts.push((name.trim().to_owned(), String::new()));
        } else if let Some((_, body)) = alerts.last_mut() {
            body.push_str(trimmed);
            body.push('\n');
        }
    }
    alerts
}

/// The rules that mirror a size limit of the daemon's own alerts fire past
/// the same number as the daemon does by default (the value
/// `config/tallyd.toml` shows): the largest pending array against
/// `max_pending`, the largest lane map against `max_lanes`.
#[test]
fn size_alert_rules_use_the_daemons_default_limits() {
    let example = read("config/tallyd.toml");
    let rules = alert_rules();
    for (metric, key) in [
        ("tally_largest_pending", "max_pending"),
        ("tally_largest_lane_map", "max_lanes"),
    ] {
        let default = example
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("config/tallyd.toml sets no {key}"))
            .trim();
        let (name, body) = rules
            .iter()
            .find(|(_, body)| tally_identifiers(body).contains(metric))
            .unwrap_or_else(|| panic!("no rule on {metric}"));
        let threshold = body
            .lines()
            .find_map(|l| l.strip_prefix(") > "))
            .unwrap_or_else(|| panic!("rule {name} has no `) > N` threshold"))
            .trim();
        assert_eq!(threshold, default, "rule {name} against [alerts] {key}");
    }
}

#[test]
fn every_alert_rule_has_a_duration_a_severity_and_instructions() {
    let alerts = alert_rules();
    assert!(alerts.len() >= 10, "{alerts:?}");
    let names: BTreeSet<&str> = alerts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), alerts.len(), "duplicate alert names");
    for (name, body) in &alerts {
        for key in ["expr:", "for:", "severity:", "summary:", "description:"] {
            assert!(
                body.lines().any(|l| l.starts_with(key)),
                "alert {name} has no {key}"
            );
        }
        let severity = body
            .lines()
            .find_map(|l| l.strip_prefix("severity:"))
            .unwrap()
            .trim();
        assert!(
            ["critical", "warning"].contains(&severity),
            "alert {name}: severity {severity}"
        );
    }
}

// --- systemd units ---------------------------------------------------------

/// A unit file as `section -> key -> values` (a key may repeat).
type Unit = BTreeMap<String, BTreeMap<String, Vec<String>>>;

fn parse_unit(relative: &str) -> Unit {
    let mut unit = Unit::new();
    let mut section = String::new();
    for line in read(relative).lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') && line.ends_with(']') {
            section = line[1..line.len() - 1].to_owned();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{relative}: not key=value: {line:?}"));
        unit.entry(section.clone())
            .or_default()
            .entry(key.trim().to_owned())
            .or_default()
            .push(value.trim().to_owned());
    }
    unit
}

fn value<'u>(unit: &'u Unit, section: &str, key: &str) -> Option<&'u str> {
    unit.get(section)?.get(key)?.last().map(String::as_str)
}

fn expect(unit: &Unit, name: &str, section: &str, key: &str, expected: &str) {
    assert_eq!(
        value(unit, section, key),
        Some(expected),
        "{name}: [{section}] {key}"
    );
}

/// Hardening directives both services must set, and to what.
const HARDENING: &[(&str, &str)] = &[
    ("DynamicUser", "yes"),
    ("ProtectSystem", "strict"),
    ("ProtectHome", "yes"),
    ("PrivateTmp", "yes"),
    ("PrivateDevices", "yes"),
    ("NoNewPrivileges", "yes"),
    ("CapabilityBoundingSet", ""),
    ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ("SystemCallArchitectures", "native"),
    ("LockPersonality", "yes"),
    ("MemoryDenyWriteExecute", "yes"),
    ("RestrictNamespaces", "yes"),
    ("RestrictRealtime", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelModules", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectClock", "yes"),
    ("ProtectHostname", "yes"),
    ("ProtectProc", "invisible"),
    ("UMask", "0077"),
];

fn expect_hardening(unit: &Unit, name: &str) {
    for (key, expected) in HARDENING {
        expect(unit, name, "Service", key, expected);
    }
    let filters = &unit["Service"]["SystemCallFilter"];
    assert_eq!(
        filters.first().map(String::as_str),
        Some("@system-service"),
        "{name}: SystemCallFilter {filters:?}"
    );
    // The config file is the only thing read; secrets may come from this.
    expect(
        unit,
        name,
        "Service",
        "EnvironmentFile",
        "-/etc/tally/tallyd.env",
    );
}

fn span(unit: &Unit, name: &str, key: &str) -> Duration {
    let text = value(unit, "Service", key).unwrap_or_else(|| panic!("{name}: no {key}"));
    humantime::parse_duration(text).unwrap_or_else(|err| panic!("{name}: {key}={text}: {err}"))
}

/// The default `[daemon] shutdown_timeout`, as `tallyd check-config` shows
/// it for a configuration that does not set it.
fn default_shutdown_timeout() -> Duration {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tallyd.toml");
    std::fs::write(
        &path,
        "[mongodb]\nuri = \"mongodb://localhost:27017\"\ndatabase = \"app\"\n\
         [[collections]]\nname = \"views\"\n",
    )
    .expect("write a minimal configuration");
    // No TALLYD__ variable of this process may change the defaults.
    let output = Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .env_clear()
        .arg("--config")
        .arg(&path)
        .arg("check-config")
        .output()
        .expect("run tallyd check-config");
    assert!(output.status.success(), "{}", output_text(&output));
    let shown: toml::Table = String::from_utf8_lossy(&output.stdout)
        .parse()
        .unwrap_or_else(|err| panic!("check-config prints TOML ({err}): {}", output_text(&output)));
    let text = shown["daemon"]["shutdown_timeout"]
        .as_str()
        .unwrap_or_else(|| panic!("no [daemon] shutdown_timeout in {shown}"));
    humantime::parse_duration(text).unwrap_or_else(|err| panic!("shutdown_timeout={text}: {err}"))
}

#[test]
fn the_daemon_unit_is_a_hardened_notify_service() {
    let name = "systemd/tallyd.service";
    let unit = parse_unit(name);
    expect(&unit, name, "Service", "Type", "notify");
    expect(
        &unit,
        name,
        "Service",
        "ExecStart",
        "/usr/local/bin/tallyd --config /etc/tally/tallyd.toml run",
    );
    // `systemctl reload`: SIGHUP reads the configuration again.
    expect(
        &unit,
        name,
        "Service",
        "ExecReload",
        "/bin/kill -HUP $MAINPID",
    );
    expect(&unit, name, "Service", "Restart", "on-failure");
    // A bad configuration or refused credentials must not restart in a
    // loop: exit 78 and 77.
    expect(
        &unit,
        name,
        "Service",
        "RestartPreventExitStatus",
        &format!(
            "{} {}",
            exit_code_of("permission denied"),
            exit_code_of("configuration")
        ),
    );
    let watchdog = span(&unit, name, "WatchdogSec");
    assert!(
        watchdog >= Duration::from_secs(10),
        "{name}: WatchdogSec {watchdog:?}"
    );
    // systemd's SIGKILL must come after the daemon's own drain deadline.
    let stop = span(&unit, name, "TimeoutStopSec");
    let drain = default_shutdown_timeout();
    assert!(
        stop > drain,
        "{name}: TimeoutStopSec {stop:?} must exceed the default shutdown_timeout {drain:?}"
    );
    expect_hardening(&unit, name);
    expect(&unit, name, "Install", "WantedBy", "multi-user.target");
}

#[test]
fn the_reconcile_timer_runs_a_hardened_oneshot_nightly() {
    let name = "systemd/tallyd-reconcile.service";
    let service = parse_unit(name);
    expect(&service, name, "Service", "Type", "oneshot");
    expect(
        &service,
        name,
        "Service",
        "ExecStart",
        "/usr/local/bin/tallyd --config /etc/tally/tallyd.toml reconcile",
    );
    assert_eq!(value(&service, "Service", "WatchdogSec"), None, "{name}");
    expect_hardening(&service, name);

    let name = "systemd/tallyd-reconcile.timer";
    let timer = parse_unit(name);
    expect(&timer, name, "Timer", "Persistent", "true");
    let calendar = value(&timer, "Timer", "OnCalendar").expect("OnCalendar");
    assert!(calendar.contains("03:30"), "{name}: OnCalendar={calendar}");
    expect(&timer, name, "Install", "WantedBy", "timers.target");
}

/// Runs a check script from `scripts/`.
fn script(name: &str, args: &[&Path]) -> Output {
    Command::new(root().join("scripts").join(name))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|err| panic!("run scripts/{name}: {err}"))
}

/// `systemd-analyze verify`, through the script that points the units at the
/// built binary. The script installs systemd-analyze where it can (root with
/// apt-get); where it cannot, this fails and its message says what to run.
#[test]
fn systemd_analyze_verifies_the_units() {
    let binary = Path::new(env!("CARGO_BIN_EXE_tallyd"));
    let output = script("check-systemd-units", &[binary]);
    assert!(
        output.status.success(),
        "scripts/check-systemd-units {} failed (if systemd-analyze is missing, \
         install it: apt-get update && apt-get install -y systemd)\n{}",
        binary.display(),
        output_text(&output)
    );
}

// --- man pages and completions ----------------------------------------------

/// Runs the built `tallyd` with `args`, with an empty environment.
fn tallyd(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .env_clear()
        .args(args)
        .output()
        .expect("run tallyd")
}

/// Every man page `tallyd man` should write: its command's path (empty
/// for `tallyd.1`, `["seq", "next"]` for `tallyd-seq-next.1`) and whether
/// the command has subcommands `--help` shows — found as a user finds
/// them, from `tallyd --help` and each command's own `--help`.
fn expected_pages() -> Vec<(Vec<String>, bool)> {
    fn walk(path: Vec<String>, pages: &mut Vec<(Vec<String>, bool)>) {
        let mut args: Vec<&std::ffi::OsStr> = path.iter().map(|arg| arg.as_ref()).collect();
        args.push("--help".as_ref());
        let output = tallyd(&args);
        assert_eq!(output.status.code(), Some(0), "{}", output_text(&output));
        let shown = listed_commands(&String::from_utf8_lossy(&output.stdout));
        pages.push((path.clone(), !shown.is_empty()));
        for sub in shown {
            let mut path = path.clone();
            path.push(sub);
            walk(path, pages);
        }
    }
    let mut pages = Vec::new();
    walk(Vec::new(), &mut pages);
    pages
}

/// The commands a `--help` lists under "Commands:", without clap's own
/// `help` (no page of its own: `--help` is the page).
fn listed_commands(help: &str) -> Vec<String> {
    let Some(section) = help.split("\nCommands:\n").nth(1) else {
        return Vec::new();
    };
    section
        .lines()
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_command_scanner_reads_a_help() {
    let help = "Sequences\n\nUsage: tallyd seq <COMMAND>\n\nCommands:\n  next     Hand out\n  \
                check-config  Check\n  help     Print this message\n\nOptions:\n  -h, --help  Print help\n";
    assert_eq!(listed_commands(help), ["next", "check-config"]);
    assert!(listed_commands("Usage: tallyd run\n\nOptions:\n  -h\n").is_empty());
}

/// The exit code `tallyd --help`'s table gives the class whose meaning
/// starts with `class` (`configuration` → 78).
fn exit_code_of(class: &str) -> String {
    let output = tallyd(&["--help".as_ref()]);
    let table = exit_code_table(&String::from_utf8_lossy(&output.stdout));
    table
        .iter()
        .find(|(_, meaning)| meaning.starts_with(class))
        .map(|(code, _)| code.clone())
        .unwrap_or_else(|| panic!("no exit code for {class} in {table:?}"))
}

/// The page of the command at `path`: `tallyd-seq-next` for `seq next`.
fn page_name(path: &[String]) -> String {
    std::iter::once("tallyd")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("-")
}

/// Every command `--help` shows, nested ones as `seq-next`.
fn visible_commands() -> Vec<String> {
    expected_pages()
        .into_iter()
        .filter(|(path, _)| !path.is_empty())
        .map(|(path, _)| path.join("-"))
        .collect()
}

/// `tallyd man DIR` (what the package ships) writes `tallyd.1`, which names
/// every command, and a page for each — no configuration needed.
#[test]
fn the_man_pages_name_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let output = tallyd(&["man".as_ref(), dir.path().as_os_str()]);
    assert!(output.status.success(), "{}", output_text(&output));
    let main = std::fs::read_to_string(dir.path().join("tallyd.1")).expect("tallyd.1 written");
    let commands = visible_commands();
    for expected in ["run", "doctor", "check-config", "seq", "seq-next"] {
        assert!(commands.iter().any(|c| c == expected), "{commands:?}");
    }
    for command in &commands {
        let page = dir.path().join(format!("tallyd-{command}.1"));
        assert!(page.exists(), "no man page {}", page.display());
        if !command.contains('-') || command == "check-config" {
            // roff escapes the dash: tallyd\-run(1)
            let named = format!("tallyd\\-{}(1)", command.replace('-', "\\-"));
            assert!(
                main.contains(&named),
                "tallyd.1 does not name {named}:\n{main}"
            );
        }
    }
    assert!(
        !main.contains("completions"),
        "hidden commands stay out of the pages"
    );
}

/// The bash completion script loads and registers `tallyd`; zsh and fish
/// scripts are generated too.
#[test]
fn the_bash_completion_loads() {
    let dir = tempfile::tempdir().unwrap();
    for shell in ["bash", "zsh", "fish"] {
        let output = tallyd(&["completions".as_ref(), shell.as_ref()]);
        assert!(output.status.success(), "{shell}: {}", output_text(&output));
        let script = String::from_utf8_lossy(&output.stdout);
        assert!(
            script.contains("doctor"),
            "{shell} completes every command:\n{script}"
        );
        std::fs::write(dir.path().join(shell), &output.stdout).unwrap();
    }
    let loaded = Command::new("bash")
        .arg("-c")
        .arg("source \"$1\" && complete -p tallyd")
        .arg("bash")
        .arg(dir.path().join("bash"))
        .output()
        .expect("run bash");
    assert!(loaded.status.success(), "{}", output_text(&loaded));
    let shown = String::from_utf8_lossy(&loaded.stdout);
    assert!(shown.contains("-F _tallyd tallyd"), "{shown}");
}

/// What `--help` hides — the `completions` and `man` commands of
/// packaging, the `--clock-offset` testing aid — no completion script and
/// no man page offers either.
#[test]
fn completions_and_man_pages_offer_nothing_help_hides() {
    let hidden = [
        "clock-offset",
        "clock_offset",
        "Print the shell completion script",
        "Write the man pages",
    ];
    for shell in ["bash", "zsh", "fish"] {
        let output = tallyd(&["completions".as_ref(), shell.as_ref()]);
        assert!(output.status.success(), "{shell}: {}", output_text(&output));
        let script = String::from_utf8_lossy(&output.stdout);
        for word in hidden {
            assert!(!script.contains(word), "{shell} offers {word}:\n{script}");
        }
        // The commands themselves, as each shell names a subcommand.
        for command in ["man", "completions"] {
            for form in [
                format!("tallyd,{command})"),
                format!("'{command}:"),
                format!("-a \"{command}\""),
            ] {
                assert!(!script.contains(&form), "{shell} offers {form}:\n{script}");
            }
        }
        assert!(script.contains("env-file"), "{shell}: {script}");
    }
    let dir = tempfile::tempdir().unwrap();
    let output = tallyd(&["man".as_ref(), dir.path().as_os_str()]);
    assert!(output.status.success(), "{}", output_text(&output));
    for page in std::fs::read_dir(dir.path()).unwrap() {
        let page = page.unwrap().path();
        let text = std::fs::read_to_string(&page).unwrap();
        assert!(!text.contains("clock\\-offset"), "{}", page.display());
    }
    assert!(!dir.path().join("tallyd-man.1").exists());
    assert!(!dir.path().join("tallyd-completions.1").exists());
}

/// The exit codes by class: one table, the same in every command's
/// `--help`, in the man pages' EXIT STATUS and in the README.
#[test]
fn every_help_and_the_readme_give_the_same_exit_codes() {
    let codes_in = |text: &str| -> Vec<String> {
        exit_code_table(text)
            .into_iter()
            .map(|(code, _)| code)
            .collect()
    };
    let expected = ["0", "1", "64", "69", "75", "77", "78", "130"];
    for args in [
        vec!["--help"],
        vec!["incr", "--help"],
        vec!["seq", "next", "--help"],
    ] {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
        let output = tallyd(&args);
        assert_eq!(output.status.code(), Some(0), "{}", output_text(&output));
        let help = String::from_utf8_lossy(&output.stdout);
        assert_eq!(codes_in(&help), expected, "{help}");
    }
    let readme = read("README.md");
    let section = readme
        .split("## Exit codes")
        .nth(1)
        .expect("README: a section \"Exit codes\"");
    let section = section.split("\n#").next().unwrap();
    assert_eq!(
        codes_in(&format!("Exit codes\n{section}")),
        expected,
        "{section}"
    );
    let page = &man_pages()["tallyd-incr.1"];
    let codes: Vec<String> = exit_status(page)
        .into_iter()
        .map(|(code, _)| code)
        .collect();
    assert_eq!(codes, expected, "{page}");
}

/// The on-call recipes read the environment file as systemd's unit does
/// (`--env-file`), never by sourcing it in a shell, which cuts a URI at its
/// `&` and runs a token's second word as a command.
#[test]
fn the_recipes_read_the_env_file_as_the_unit_does() {
    let unit = parse_unit("systemd/tallyd.service");
    expect(
        &unit,
        "systemd/tallyd.service",
        "Service",
        "EnvironmentFile",
        "-/etc/tally/tallyd.env",
    );
    for file in [
        "README.md",
        "docs/src/operations/installing.md",
        "docs/src/operations/alerts.md",
        "config/alerts.yml",
        "systemd/tallyd.service",
    ] {
        let text = read(file);
        assert!(
            !text.contains("set -a"),
            "{file} sources the file in a shell"
        );
        assert!(!text.contains(". /etc/tally/tallyd.env"), "{file}");
    }
    for file in ["docs/src/operations/installing.md", "config/alerts.yml"] {
        assert!(
            read(file).contains("tallyd --env-file /etc/tally/tallyd.env"),
            "{file} gives no recipe with --env-file"
        );
    }
}

// --- man pages: the sections --help has no room for ------------------------

/// What `tallyd man DIR` writes: file name -> roff source.
fn man_pages() -> BTreeMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let output = tallyd(&["man".as_ref(), dir.path().as_os_str()]);
    assert!(output.status.success(), "{}", output_text(&output));
    std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect()
}

/// The `.SH` headings of a page, unquoted.
fn headings(page: &str) -> Vec<String> {
    page.lines()
        .filter_map(|line| line.strip_prefix(".SH "))
        .map(|heading| heading.trim().trim_matches('"').to_owned())
        .collect()
}

/// The lines of the section `heading` of `page`, up to the next `.SH`.
fn man_section<'p>(page: &'p str, heading: &str) -> Vec<&'p str> {
    let quoted = format!("\"{heading}\"");
    page.lines()
        .skip_while(|line| {
            let shown = line.strip_prefix(".SH ").map(str::trim);
            shown != Some(heading) && shown != Some(quoted.as_str())
        })
        .skip(1)
        .take_while(|line| !line.starts_with(".SH "))
        .collect()
}

/// roff source as a reader sees it: font changes dropped, escaped dashes
/// and apostrophes as themselves.
fn unroff(text: &str) -> String {
    text.replace("\\fB", "")
        .replace("\\fI", "")
        .replace("\\fR", "")
        .replace("\\-", "-")
        .replace("\\*(Aq", "'")
}

/// The `.TP` entries of a section: (term, what follows it), unroffed.
fn entries(lines: &[&str]) -> Vec<(String, String)> {
    let mut entries: Vec<(String, String)> = Vec::new();
    let mut lines = lines.iter().peekable();
    while let Some(line) = lines.next() {
        if *line != ".TP" {
            continue;
        }
        let term = lines.next().map(|t| unroff(t)).unwrap_or_default();
        let mut what = Vec::new();
        while let Some(next) = lines.next_if(|l| !l.starts_with('.')) {
            what.push(unroff(next));
        }
        entries.push((term, what.join(" ")));
    }
    entries
}

/// A page's EXIT STATUS: (code, meaning) in order.
fn exit_status(page: &str) -> Vec<(String, String)> {
    entries(&man_section(page, "EXIT STATUS"))
}

/// The exit-code table after "Exit codes" in `text` — the end of a
/// `--help`, or the README's Markdown table: (code, meaning) in order,
/// code spans as plain text (a man page shows them in bold).
fn exit_code_table(text: &str) -> Vec<(String, String)> {
    let table = text
        .split("Exit codes")
        .nth(1)
        .unwrap_or_else(|| panic!("no exit codes in {text}"));
    table
        .lines()
        .filter_map(|line| {
            let line = line.trim().trim_start_matches('|').trim();
            let (code, meaning) = line.split_once([' ', '|'])?;
            let meaning = meaning.trim().trim_matches('|').trim().replace('`', "");
            (!code.is_empty() && code.chars().all(|c| c.is_ascii_digit()))
                .then(|| (code.to_owned(), meaning))
        })
        .collect()
}

/// Every page `tallyd man` writes — `tallyd.1` and one per command `--help`
/// shows, no other — has the sections of a man page, in order.
#[test]
fn every_man_page_has_every_section_in_order() {
    let pages = man_pages();
    let expected = expected_pages();
    let written: BTreeSet<&str> = pages.keys().map(String::as_str).collect();
    let wanted: BTreeSet<String> = expected
        .iter()
        .map(|(path, _)| format!("{}.1", page_name(path)))
        .collect();
    let wanted: BTreeSet<&str> = wanted.iter().map(String::as_str).collect();
    assert_eq!(written, wanted, "the pages written");
    for (path, has_commands) in expected {
        let name = page_name(&path);
        let page = &pages[&format!("{name}.1")];
        let mut sections = vec!["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS"];
        if has_commands {
            sections.push("COMMANDS");
        }
        sections.extend(["EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO", "VERSION"]);
        assert_eq!(headings(page), sections, "{name}.1:\n{page}");
        let see_also = unroff(&man_section(page, "SEE ALSO").join("\n"));
        if name != "tallyd" {
            assert!(see_also.contains("tallyd(1)"), "{name}.1: {see_also}");
        }
        assert!(see_also.contains("systemd.exec(5)"), "{name}.1: {see_also}");
    }
}

/// Each page's EXIT STATUS is the table its command's `--help` ends with,
/// code for code and word for word: both are rendered from one table.
#[test]
fn every_man_page_gives_the_exit_codes_its_help_gives() {
    let pages = man_pages();
    for (path, _) in expected_pages() {
        let name = page_name(&path);
        let mut args: Vec<&std::ffi::OsStr> = path.iter().map(|arg| arg.as_ref()).collect();
        args.push("--help".as_ref());
        let output = tallyd(&args);
        assert_eq!(output.status.code(), Some(0), "{}", output_text(&output));
        let help = exit_code_table(&String::from_utf8_lossy(&output.stdout));
        let page = exit_status(&pages[&format!("{name}.1")]);
        assert_eq!(page, help, "{name}.1 against {args:?}");
        let codes: Vec<&str> = page.iter().map(|(code, _)| code.as_str()).collect();
        assert_eq!(
            codes,
            ["0", "1", "64", "69", "75", "77", "78", "130"],
            "{name}.1"
        );
    }
}

/// FILES names what the package installs beside the binary and the man
/// pages — the configuration, the units, the alert rules, the dashboard —
/// and the environment file the units read, and no path that is not one of
/// them; SEE ALSO's README is where the package puts it; ENVIRONMENT names
/// the webhook variable the example configuration does.
#[test]
fn the_man_pages_name_the_files_the_package_installs() {
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    let deb = &manifest["package"]["metadata"]["deb"];
    let mut installed: BTreeSet<String> = BTreeSet::new();
    for asset in deb["assets"].as_array().unwrap() {
        let (source, dest) = (asset[0].as_str().unwrap(), asset[1].as_str().unwrap());
        let mut dest = format!("/{dest}");
        if dest.ends_with('/') {
            dest.push_str(source.rsplit('/').next().unwrap());
        }
        installed.insert(dest);
    }
    for unit in std::fs::read_dir(root().join("systemd")).unwrap() {
        let unit = unit.unwrap().file_name().to_string_lossy().into_owned();
        installed.insert(format!("/usr/lib/systemd/system/{unit}"));
    }
    let daemon = parse_unit("systemd/tallyd.service");
    let env_file = value(&daemon, "Service", "EnvironmentFile").unwrap();
    let env_file = env_file.trim_start_matches('-').to_owned();

    let pages = man_pages();
    for (name, page) in &pages {
        let files: BTreeSet<String> = entries(&man_section(page, "FILES"))
            .into_iter()
            .map(|(path, _)| path)
            .collect();
        let invented: Vec<&String> = files
            .iter()
            .filter(|path| **path != env_file && !installed.contains(*path))
            .collect();
        assert!(
            invented.is_empty(),
            "{name}: FILES names {invented:?}, which the package does not install"
        );
        let beside: BTreeSet<&String> = installed
            .iter()
            .filter(|path| {
                path.starts_with("/etc/")
                    || path.starts_with("/usr/share/tally/")
                    || path.starts_with("/usr/lib/systemd/")
            })
            .collect();
        for path in beside.into_iter().chain([&env_file]) {
            assert!(
                files.contains(path),
                "{name}: FILES lacks {path}: {files:?}"
            );
        }
        let see_also = unroff(&man_section(page, "SEE ALSO").join("\n"));
        let readme = "/usr/share/doc/tallyd/README.md";
        assert!(
            installed.contains(readme) && see_also.contains(readme),
            "{name}: {see_also}"
        );
    }

    let example = read("config/tallyd.toml");
    let webhook_variable = example
        .lines()
        .find_map(|line| {
            line.trim_start_matches(['#', ' '])
                .strip_prefix("auth_header_env = ")
        })
        .expect("config/tallyd.toml shows an auth_header_env")
        .trim_matches('"');
    let environment: Vec<String> = entries(&man_section(&pages["tallyd.1"], "ENVIRONMENT"))
        .into_iter()
        .map(|(variable, _)| variable)
        .collect();
    assert_eq!(
        environment,
        [
            "TALLYD__SECTION__KEY",
            webhook_variable,
            "RUST_LOG",
            "NO_COLOR"
        ],
        "tallyd.1: ENVIRONMENT"
    );
}

/// `man` renders every page without a warning from groff (where `man` is
/// installed; the suite installs nothing, so elsewhere this says so and
/// checks nothing more).
#[test]
fn man_renders_every_page_without_a_warning() {
    if Command::new("man").arg("--version").output().is_err() {
        eprintln!(
            "note: `man` is not installed: the man pages were not rendered (apt-get install man-db)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let output = tallyd(&["man".as_ref(), dir.path().as_os_str()]);
    assert!(output.status.success(), "{}", output_text(&output));
    for (path, _) in expected_pages() {
        let page = dir.path().join(format!("{}.1", page_name(&path)));
        let rendered = Command::new("man")
            .args(["--warnings", "-l"])
            .arg(&page)
            .env("MANWIDTH", "80")
            .env("MANPAGER", "cat")
            .env("PAGER", "cat")
            .output()
            .expect("run man");
        assert!(
            rendered.status.success(),
            "{}: {}",
            page.display(),
            output_text(&rendered)
        );
        assert!(
            rendered.stderr.is_empty(),
            "{}: {}",
            page.display(),
            output_text(&rendered)
        );
        let text = String::from_utf8_lossy(&rendered.stdout);
        for heading in ["EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO"] {
            assert!(
                text.contains(&format!("\n{heading}\n")),
                "{}: no {heading}:\n{text}",
                page.display()
            );
        }
    }
}
