//! The configuration as `tallyd` reads it: defaults, environment
//! overrides, every bad key reported at once, secrets masked.

use std::time::Duration;

use super::*;
use crate::bucket::{BucketWidth, Buckets};

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const MINIMAL: &str = r#"
    [mongodb]
    uri = "mongodb://localhost:27017"
    database = "app"
"#;

#[test]
fn minimal_config_gets_defaults() {
    let config = Config::from_toml(MINIMAL, []).unwrap();
    assert_eq!(config.mongodb.database, "app");
    assert_eq!(config.mongodb.app_name, "tallyd");
    assert_eq!(config.mongodb.max_idle_time, Duration::from_secs(240));
    assert_eq!(config.writer.retry_horizon, Duration::from_secs(180));
    assert_eq!(config.log.format, LogFormat::Text);
    assert!(config.collections.is_empty());
}

#[test]
fn environment_overrides_the_file() {
    let config = Config::from_toml(
        MINIMAL,
        env(&[
            ("TALLYD__MONGODB__URI", "mongodb://other:27018/"),
            ("TALLYD__MONGODB__DATABASE", "metrics"),
            ("TALLYD__WRITER__RETRY_HORIZON", "150s"),
            ("TALLYD_WEBHOOK_TOKEN", "not a config key"),
            ("PATH", "/bin"),
        ]),
    )
    .unwrap();
    assert_eq!(config.mongodb.uri.expose(), "mongodb://other:27018/");
    assert_eq!(config.mongodb.database, "metrics");
    assert_eq!(config.writer.retry_horizon, Duration::from_secs(150));
}

/// The environment sets keys without a file (`[[collections]]` tables
/// need one: see `without_a_file_the_first_problem_says_so`).
#[test]
fn the_environment_sets_keys_without_a_file() {
    let (config, issues) = Config::validated(
        None,
        DEFAULT_PATH,
        env(&[
            ("TALLYD__MONGODB__URI", "mongodb://h/"),
            ("TALLYD__MONGODB__DATABASE", "d"),
        ]),
    )
    .unwrap();
    let config = issues.into_result(config).unwrap();
    assert_eq!(config.mongodb.database, "d");
}

#[test]
fn the_database_may_come_from_the_uri() {
    let config = Config::from_toml("[mongodb]\nuri = \"mongodb://h/fromuri\"\n", []).unwrap();
    assert_eq!(config.mongodb.database, "fromuri");
}

#[test]
fn uri_options_are_kept_unless_overridden() {
    let config = Config::from_toml(
        "[mongodb]\nuri = \"mongodb://h/d?appName=web&maxIdleTimeMS=1000\"\n",
        [],
    )
    .unwrap();
    assert_eq!(config.mongodb.app_name, "web");
    assert_eq!(config.mongodb.max_idle_time, Duration::from_secs(1));
}

#[test]
fn a_named_file_must_exist() {
    let err = Config::load(Some(Path::new("/nonexistent/tallyd.toml")), []).unwrap_err();
    assert_eq!(err.issues[0].key, "--config");
}

#[test]
fn every_bad_key_is_reported_at_once() {
    let text = r#"
        surprise = 1
        [mongodb]
        database = "bad.name"
        connect_timeout = 10
        server_selection_timeout = "0s"
        max_idle_time = "-5s"
        colour = "blue"
        [writer]
        retry_horizon = "soon"
        [log]
        format = "xml"
        level = "loud[["
        [[collections]]
        name = "events"
        counter_field = "$count"
        pending_field = "a.b"
        [[collections]]
        name = "events"
        pending_field = "_id"
        [[collections]]
        name = 5
        counter_field = "same"
        pending_field = "same"
    "#;
    let err = Config::from_toml(text, []).unwrap_err();
    let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
    for expected in [
        "surprise",
        "mongodb.uri",
        "mongodb.database",
        "mongodb.connect_timeout",
        "mongodb.server_selection_timeout",
        "mongodb.max_idle_time",
        "mongodb.colour",
        "writer.retry_horizon",
        "log.format",
        "log.level",
        "collections[0].counter_field",
        "collections[0].pending_field",
        "collections[1].name",
        "collections[1].pending_field",
        "collections[2].name",
        "collections[2].pending_field",
    ] {
        assert!(keys.contains(&expected), "{expected} missing from {keys:?}");
    }
    let text = err.to_string();
    assert!(text.starts_with("invalid configuration ("), "{text}");
}

#[test]
fn malformed_uris_are_reported_without_their_password() {
    let text = r#"
        [mongodb]
        uri = "mongodb://alice:hunter2@host:notaport/db"
    "#;
    let err = Config::from_toml(text, []).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("mongodb.uri"), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
    let err = Config::from_toml("[mongodb]\nuri = \"postgres://u:hunter2@h/d\"\n", []).unwrap_err();
    assert!(!err.to_string().contains("hunter2"));
}

#[test]
fn errors_name_the_environment_variable_that_caused_them() {
    let err = Config::from_toml(
        MINIMAL,
        env(&[
            ("TALLYD__WRITER__RETRY_HORIZON", "0s"),
            ("TALLYD__WRITER__TYPO", "1"),
        ]),
    )
    .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("set by TALLYD__WRITER__RETRY_HORIZON"),
        "{message}"
    );
    assert!(message.contains("writer.typo"), "{message}");
}

#[test]
fn wrong_section_types_are_reported() {
    let err = Config::from_toml("mongodb = 5\ncollections = \"x\"\n", []).unwrap_err();
    let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
    assert!(keys.contains(&"mongodb"), "{keys:?}");
    assert!(keys.contains(&"collections"), "{keys:?}");
}

#[test]
fn the_effective_config_masks_the_password() {
    let config = Config::from_toml(
        "[mongodb]\nuri = \"mongodb://u:hunter2@h:27017/d?replicaSet=rs\"\n",
        [],
    )
    .unwrap();
    let shown = config.to_redacted_toml();
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(
        shown.contains("mongodb://u:****@h:27017/d?replicaSet=rs"),
        "{shown}"
    );
    assert!(shown.contains("retry_horizon = \"3m\""), "{shown}");
    assert!(!format!("{config:?}").contains("hunter2"));
}

#[test]
fn daemon_sections_are_checked_too() {
    let text = format!(
        "{MINIMAL}\n[[collections]]\nname = \"views\"\n[schedule]\ncron = \"every night\"\n\
         timezone = \"Mars/Olympus\"\ncatch_up = \"maybe\"\n[alerts]\nstuck_after = \"30s\"\n\
         max_pending = 0\nmax_lanes = \"many\"\n[alerts.webhook]\nurl = \"ftp://x/hook\"\nauth_header_env = \"HOOK\"\n\
         [ha]\nlease_ttl = \"1s\"\n[http]\nlisten = \"localhost\"\n\
         [daemon]\nstate_collection = \"views\"\n[monitor]\nscan_interval = \"0s\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
    for expected in [
        "schedule.cron",
        "schedule.timezone",
        "schedule.catch_up",
        "alerts.stuck_after",
        "alerts.max_pending",
        "alerts.max_lanes",
        "alerts.webhook.url",
        "alerts.webhook.auth_header_env",
        "ha.lease_ttl",
        "http.listen",
        "daemon.state_collection",
        "monitor.scan_interval",
    ] {
        assert!(keys.contains(&expected), "{expected} missing from {keys:?}");
    }
}

#[test]
fn the_webhook_secrets_are_read_from_the_environment_and_masked() {
    let text = format!(
        "{MINIMAL}\n[alerts.webhook]\nurl = \"https://hooks.example/T0/SECRETPATH\"\n\
         auth_header_env = \"HOOK\"\n"
    );
    let config = Config::from_toml(&text, env(&[("HOOK", "Bearer s3cret-value")])).unwrap();
    let webhook = config.alerts.webhook.as_ref().unwrap();
    assert_eq!(
        webhook.auth_header.as_ref().unwrap().expose(),
        "Bearer s3cret-value"
    );
    let shown = config.to_redacted_toml();
    assert!(
        !shown.contains("SECRETPATH") && !shown.contains("s3cret"),
        "{shown}"
    );
    assert!(shown.contains("https://hooks.example/****"), "{shown}");
    let scrubbed = config
        .secrets()
        .scrub("posting to https://hooks.example/T0/SECRETPATH with Bearer s3cret-value");
    assert!(
        !scrubbed.contains("SECRETPATH") && !scrubbed.contains("s3cret"),
        "{scrubbed}"
    );
    let bad = Config::from_toml(&text, env(&[("HOOK", "two\nlines")])).unwrap_err();
    assert_eq!(bad.issues[0].key, "alerts.webhook.auth_header_env");
    assert!(!bad.to_string().contains("two"), "the value is not shown");
}

#[test]
fn unlisted_collections_use_default_fields() {
    let config = Config::from_toml(
        &format!("{MINIMAL}\n[[collections]]\nname = \"a\"\ncounter_field = \"c\"\n"),
        [],
    )
    .unwrap();
    assert_eq!(config.collection("a").counter_field, "c");
    assert_eq!(config.collection("b"), CollectionConfig::new("b"));
}

/// The keys of every issue, for assertions.
fn keys(err: &ConfigErrors) -> Vec<&str> {
    err.issues.iter().map(|i| i.key.as_str()).collect()
}

/// The message of the issue under `key`.
fn message<'e>(err: &'e ConfigErrors, key: &str) -> &'e str {
    err.issues
        .iter()
        .find(|i| i.key == key)
        .map(|i| i.message.as_str())
        .unwrap_or_else(|| panic!("no issue under {key}: {err}"))
}

#[test]
fn a_grace_must_outlast_the_retry_horizon_plus_one_attempt() {
    // 20s + 10s = 30s: a grace of 25s is too short, though longer than the
    // horizon alone.
    let text = format!(
        "{MINIMAL}attempt_timeout = \"10s\"\nserver_selection_timeout = \"5s\"\n\
         [writer]\nretry_horizon = \"20s\"\n[reconcile]\ngrace = \"25s\"\n\
         [[collections]]\nname = \"a\"\ngrace = \"30s\"\n[[collections]]\nname = \"b\"\ngrace = \"31s\"\n\
         [alerts]\nstuck_after = \"1h\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(
        keys(&err),
        ["reconcile.grace", "collections[0].grace"],
        "{err}"
    );
    for key in ["reconcile.grace", "collections[0].grace"] {
        let said = message(&err, key);
        assert!(
            said.contains("writer.retry_horizon") && said.contains("mongodb.attempt_timeout"),
            "{said}"
        );
        assert!(said.contains("30s"), "{said}");
        // Either side of the margin is the remedy: the key's own grace, or
        // the horizon the user may just have raised.
        assert!(
            said.contains(&format!(
                "raise {key} past it, or lower writer.retry_horizon"
            )),
            "{said}"
        );
    }
    let fixed = text
        .replace("grace = \"25s\"", "grace = \"31s\"")
        .replace("grace = \"30s\"", "grace = \"40s\"");
    Config::from_toml(&fixed, []).unwrap();
}

#[test]
fn a_retry_horizon_must_leave_room_for_a_retry_and_a_resume() {
    // Two attempts of 40s: a horizon of 79s is too short.
    let text = format!(
        "{MINIMAL}attempt_timeout = \"40s\"\nserver_selection_timeout = \"5s\"\n\
         [writer]\nretry_horizon = \"79s\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(keys(&err), ["writer.retry_horizon"], "{err}");
    let said = message(&err, "writer.retry_horizon");
    assert!(said.contains("mongodb.attempt_timeout"), "{said}");
    assert!(said.contains("1m 20s"), "{said}");
    Config::from_toml(&text.replace("79s", "80s"), []).unwrap();
    // The defaults hold it.
    Config::from_toml(MINIMAL, []).unwrap();
}

#[test]
fn stuck_after_must_be_at_least_the_longest_grace() {
    let text = format!(
        "{MINIMAL}[reconcile]\ngrace = \"15m\"\n[[collections]]\nname = \"a\"\n\
         [[collections]]\nname = \"b\"\ngrace = \"45m\"\n[alerts]\nstuck_after = \"30m\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(keys(&err), ["alerts.stuck_after"], "{err}");
    let said = message(&err, "alerts.stuck_after");
    assert!(said.contains("collections[1].grace"), "{said}");
    assert!(said.contains("45m"), "{said}");
    // Equal to the longest grace is enough.
    Config::from_toml(&text.replace("\"30m\"", "\"45m\""), []).unwrap();
    // Without collections, [reconcile] grace is the one that counts.
    let err =
        Config::from_toml(&format!("{MINIMAL}[reconcile]\ngrace = \"40m\"\n"), []).unwrap_err();
    assert!(
        message(&err, "alerts.stuck_after").contains("reconcile.grace"),
        "{err}"
    );
}

#[test]
fn the_attempt_bound_must_outlast_server_selection() {
    let err = Config::from_toml(
        &format!("{MINIMAL}attempt_timeout = \"30s\"\nserver_selection_timeout = \"30s\"\n"),
        [],
    )
    .unwrap_err();
    assert_eq!(keys(&err), ["mongodb.attempt_timeout"], "{err}");
    assert!(
        message(&err, "mongodb.attempt_timeout").contains("mongodb.server_selection_timeout"),
        "{err}"
    );
    // The URI's selection timeout counts too.
    let err = Config::from_toml(
        "[mongodb]\nuri = \"mongodb://h/d?serverSelectionTimeoutMS=90000\"\n",
        [],
    )
    .unwrap_err();
    assert_eq!(keys(&err), ["mongodb.attempt_timeout"], "{err}");
    // The defaults agree with each other and with the library's.
    let config = Config::from_toml(MINIMAL, []).unwrap();
    assert_eq!(
        config.mongodb.attempt_timeout,
        crate::store::StoreConfig::new("mongodb://h", "d").attempt_timeout
    );
    assert!(config.mongodb.attempt_timeout > config.mongodb.server_selection_timeout);
}

#[test]
fn log_levels_are_checked_directive_by_directive() {
    for good in [
        "info",
        "WARN",
        "off",
        "info,tally::reconcile=debug",
        "tally=trace,tokio_cron_scheduler=Warn",
    ] {
        let text = format!("{MINIMAL}[log]\nlevel = \"{good}\"\n");
        Config::from_toml(&text, []).unwrap_or_else(|err| panic!("{good}: {err}"));
    }
    for (bad, says) in [
        ("inof", "target=level"),
        ("info,debugg", "target=level"),
        ("tally=loud", "trace, debug, info, warn, error, off"),
        ("tal ly=info", "not a Rust path"),
        ("=info", "not a Rust path"),
        ("info,,warn", "empty"),
        ("", "empty"),
    ] {
        let text = format!("{MINIMAL}[log]\nlevel = \"{bad}\"\n");
        let err = Config::from_toml(&text, []).unwrap_err();
        let said = message(&err, "log.level");
        assert!(said.contains(says), "{bad:?}: {said}");
    }
}

#[test]
fn rust_log_is_checked_like_the_level_when_set() {
    let err = Config::from_toml(MINIMAL, env(&[("RUST_LOG", "inof")])).unwrap_err();
    assert_eq!(keys(&err), ["RUST_LOG"], "{err}");
    assert!(message(&err, "RUST_LOG").contains("target=level"), "{err}");
    let config = Config::from_toml(MINIMAL, env(&[("RUST_LOG", "debug,tally=trace")])).unwrap();
    assert_eq!(config.log.rust_log.as_deref(), Some("debug,tally=trace"));
    // Unset or blank: [log] level applies.
    let config = Config::from_toml(MINIMAL, env(&[("RUST_LOG", "  ")])).unwrap();
    assert_eq!(config.log.rust_log, None);
}

#[test]
fn a_cron_expression_that_never_fires_is_refused() {
    let text = format!("{MINIMAL}[schedule]\ncron = \"0 0 0 30 2 *\"\n");
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(keys(&err), ["schedule.cron"], "{err}");
    assert!(message(&err, "schedule.cron").contains("never"), "{err}");
    // Rare but real: 29 February comes within the window.
    Config::from_toml(&text.replace("30 2", "29 2"), []).unwrap();
}

#[test]
fn unknown_top_level_environment_keys_name_their_variable() {
    let err = Config::from_toml(
        &format!("surprise = 1\n{MINIMAL}"),
        env(&[("TALLYD__X__Y", "1"), ("TALLYD__ZED", "2")]),
    )
    .unwrap_err();
    let mut found = keys(&err);
    found.sort();
    assert_eq!(
        found,
        [
            "TALLYD__X__Y (environment)",
            "TALLYD__ZED (environment)",
            "surprise"
        ],
        "{err}"
    );
    assert_eq!(message(&err, "TALLYD__X__Y (environment)"), "unknown key x");
    assert!(
        err.to_string()
            .contains("  TALLYD__X__Y (environment): unknown key x")
    );
}

#[test]
fn the_daemon_needs_at_least_one_collection() {
    let err = Config::for_commands(Some(MINIMAL), "(inline)", []).unwrap_err();
    assert_eq!(keys(&err), ["collections"], "{err}");
    let with = format!("{MINIMAL}[[collections]]\nname = \"a\"\n");
    Config::for_commands(Some(&with), "(inline)", []).unwrap();
    // A bad entry is named as itself, not as "none configured".
    let bad = format!("{MINIMAL}[[collections]]\nname = 5\n");
    let err = Config::for_commands(Some(&bad), "(inline)", []).unwrap_err();
    assert_eq!(keys(&err), ["collections[0].name"], "{err}");
}

/// An empty configuration is told everything it lacks in one run: the
/// URI, the database and the collections (not one per run).
#[test]
fn every_missing_key_is_named_at_once() {
    let err = Config::for_commands(Some("[mongodb]\n"), "(inline)", []).unwrap_err();
    assert_eq!(
        keys(&err),
        ["mongodb.uri", "mongodb.database", "collections"],
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("invalid configuration (3 problems):")
    );
    // A malformed URI may name the database: only the URI is named.
    let text = "[mongodb]\nuri = \"mongodb://h:x/db\"\n[[collections]]\nname = \"a\"\n";
    let err = Config::for_commands(Some(text), "(inline)", []).unwrap_err();
    assert_eq!(keys(&err), ["mongodb.uri"], "{err}");
}

/// Without a file, what is missing comes after the reason: no file was
/// read, and how to name one or set the keys from the environment.
#[test]
fn without_a_file_the_first_problem_says_so() {
    let err = Config::for_commands(None, DEFAULT_PATH, []).unwrap_err();
    assert_eq!(
        keys(&err),
        ["--config", "mongodb.uri", "mongodb.database", "collections"],
        "{err}"
    );
    let first = message(&err, "--config");
    assert!(first.contains(DEFAULT_PATH), "{first}");
    assert!(first.contains("--config PATH"), "{first}");
    assert!(first.contains("TALLYD__MONGODB__URI"), "{first}");
    // What the environment sets is not named; the file is still said.
    let uri = env(&[("TALLYD__MONGODB__URI", "mongodb://h/app")]);
    let err = Config::for_commands(None, DEFAULT_PATH, uri).unwrap_err();
    assert_eq!(keys(&err), ["--config", "collections"], "{err}");
}

#[test]
fn the_settled_field_is_read_and_must_be_a_field_of_its_own() {
    let config = Config::from_toml(
        &format!("{MINIMAL}\n[[collections]]\nname = \"a\"\nsettled_field = \"done\"\n"),
        [],
    )
    .unwrap();
    assert_eq!(config.collection("a").settled_field, "done");
    assert_eq!(config.collection("b").settled_field, "settled");
    let bad = format!(
        "{MINIMAL}\n[[collections]]\nname = \"a\"\nsettled_field = \"pending\"\n\
         [[collections]]\nname = \"b\"\nsettled_field = \"x.t\"\n\
         [[collections]]\nname = \"c\"\ncounter_field = \"n\"\nsettled_field = \"n\"\n"
    );
    let err = Config::from_toml(&bad, []).unwrap_err();
    let keys: Vec<&str> = err.issues.iter().map(|i| i.key.as_str()).collect();
    for expected in [
        "collections[0].settled_field",
        "collections[1].settled_field",
        "collections[2].settled_field",
    ] {
        assert!(keys.contains(&expected), "{expected} missing from {keys:?}");
    }
}

#[test]
fn the_lane_settings_default_and_are_read() {
    let config = Config::from_toml(MINIMAL, []).unwrap();
    assert_eq!(config.writer.group_max, 256);
    assert_eq!(config.writer.queue_limit, 10_000);
    assert_eq!(config.writer.group_wait, Duration::ZERO);
    assert_eq!(
        config.writer.lane_resume_horizon,
        Duration::from_secs(23 * 3600)
    );
    assert_eq!(config.writer.lane_ttl, Duration::from_secs(24 * 3600));
    assert_eq!(
        config.writer.protocol,
        crate::write::counter::Protocol::TwoStep
    );
    assert_eq!(config.warnings().count(), 0);
    let zero = format!("{MINIMAL}[writer]\ngroup_wait = \"0s\"\n");
    assert_eq!(
        Config::from_toml(&zero, []).unwrap().writer.group_wait,
        Duration::ZERO
    );
    let text = format!(
        "{MINIMAL}[writer]\ngroup_max = 4\nqueue_limit = 100\ngroup_wait = \"2ms\"\n\
         lane_resume_horizon = \"2h\"\nlane_ttl = \"3h\"\nprotocol = \"lanes\"\n\
         [[collections]]\nname = \"a\"\nlanes_field = \"w\"\n"
    );
    let config = Config::from_toml(&text, env(&[("TALLYD__WRITER__GROUP_MAX", "8")])).unwrap();
    assert_eq!(config.writer.group_max, 8);
    assert_eq!(config.writer.queue_limit, 100);
    assert_eq!(config.writer.group_wait, Duration::from_millis(2));
    assert_eq!(
        config.writer.protocol,
        crate::write::counter::Protocol::Lanes
    );
    assert_eq!(config.collections[0].lanes_field, "w");
    assert_eq!(config.collection("other").lanes_field, "lanes");
}

/// A file written for the lane pool still loads: its retired keys are
/// warned about, each by name, and change nothing.
#[test]
fn the_retired_pool_keys_are_accepted_with_a_warning_naming_each() {
    let text = format!("{MINIMAL}[writer]\nlanes = 4\nlane_rotate = \"10m\"\n");
    let config = Config::from_toml(&text, []).unwrap();
    let warnings: Vec<String> = config.warnings().collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].starts_with("writer.lanes: no longer used"),
        "{warnings:?}"
    );
    assert!(warnings[1].starts_with("writer.lane_rotate: no longer used"));
    assert!(
        warnings.iter().all(|w| w.ends_with("delete it")),
        "{warnings:?}"
    );
    assert_eq!(
        config.writer,
        Config::from_toml(MINIMAL, []).unwrap().writer
    );
}

#[test]
fn lane_lifetimes_must_leave_their_margins_and_every_bad_lane_key_is_named() {
    // 2h + 60s (the default attempt bound) is not shorter than a lane_ttl
    // of 2h.
    let text = format!(
        "{MINIMAL}[writer]\ngroup_max = 0\nqueue_limit = 0\ngroup_wait = \"2s\"\n\
         lane_resume_horizon = \"2h\"\nlane_ttl = \"2h\"\nprotocol = \"fast\"\n\
         [[collections]]\nname = \"a\"\nlanes_field = \"pending\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(
        keys(&err),
        [
            "collections[0].lanes_field",
            "writer.group_max",
            "writer.queue_limit",
            "writer.protocol",
            "writer.lane_ttl",
            "writer.group_wait",
        ],
        "{err}"
    );
    let said = message(&err, "writer.lane_ttl");
    assert!(
        said.contains("lane_resume_horizon + attempt_timeout") && said.contains("2h 1m"),
        "{said}"
    );
    assert!(message(&err, "writer.group_wait").contains("at most 1s"));
    let fixed = text
        .replace("group_max = 0", "group_max = 1")
        .replace("queue_limit = 0", "queue_limit = 1")
        .replace("\"2s\"", "\"1s\"")
        .replace("lane_ttl = \"2h\"", "lane_ttl = \"2h 1m 1s\"")
        .replace("\"fast\"", "\"two-step\"")
        .replace("lanes_field = \"pending\"", "lanes_field = \"lanes\"");
    Config::from_toml(&fixed, []).unwrap();
}

#[test]
fn a_collections_buckets_are_read_with_their_defaults_and_shown_as_written() {
    let text = format!(
        "{MINIMAL}[[collections]]\nname = \"views\"\nbucket = \"day\"\ntimezone = \"europe/berlin\"\n\
         [[collections]]\nname = \"calls\"\nbucket = \"minute\"\nclose_after = \"2d\"\n\
         [[collections]]\nname = \"plain\"\n"
    );
    let config = Config::from_toml(&text, []).unwrap();
    let views = Buckets::new(BucketWidth::Day, "Europe/Berlin").unwrap();
    assert_eq!(config.collection("views").buckets, Some(views));
    let calls = Buckets::utc(BucketWidth::Minute).with_close_after(Duration::from_secs(48 * 3600));
    assert_eq!(config.collection("calls").buckets, Some(calls));
    assert_eq!(config.collection("plain").buckets, None);
    assert_eq!(
        config.collection("views").buckets.unwrap().close_after(),
        Duration::from_secs(24 * 3600),
        "the default"
    );
    // check-config shows the effective setting as the file writes it, and
    // nothing for a collection without buckets.
    let shown = config.to_redacted_toml();
    for expected in [
        "name = \"views\"\ncounter_field = \"counter\"\npending_field = \"pending\"\n\
         settled_field = \"settled\"\nlanes_field = \"lanes\"\nbucket = \"day\"\n\
         timezone = \"Europe/Berlin\"\nclose_after = \"24h\"\n",
        "bucket = \"minute\"\ntimezone = \"UTC\"\nclose_after = \"48h\"\n",
        "name = \"plain\"\ncounter_field = \"counter\"\npending_field = \"pending\"\n\
         settled_field = \"settled\"\nlanes_field = \"lanes\"\n\n",
    ] {
        assert!(shown.contains(expected), "{expected:?} not in\n{shown}");
    }
    assert_eq!(shown.matches("bucket =").count(), 2, "{shown}");
    // What it shows reads back as the same setting.
    let again = Config::from_toml(&shown, []).unwrap();
    assert_eq!(again.collections, config.collections);
}

/// An unset close_after is its default, 24h, or the margin where that is
/// longer: a configuration that leaves it alone is never refused for it.
#[test]
fn an_unset_close_after_is_raised_to_the_margin() {
    let text = format!(
        "{MINIMAL}[writer]\nlane_resume_horizon = \"30h\"\nlane_ttl = \"31h\"\n\
         [[collections]]\nname = \"views\"\nbucket = \"hour\"\n"
    );
    let config = Config::from_toml(&text, []).unwrap();
    let buckets = config.collection("views").buckets.unwrap();
    assert_eq!(buckets.close_after(), Duration::from_secs(30 * 3600 + 60));
    assert!(
        config
            .to_redacted_toml()
            .contains("close_after = \"30h 1m\"")
    );
}

#[test]
fn a_bad_bucket_setting_is_refused_under_its_key() {
    let text = format!(
        "{MINIMAL}[[collections]]\nname = \"a\"\nbucket = \"week\"\n\
         [[collections]]\nname = \"b\"\nbucket = \"day\"\ntimezone = \"Mars/Olympus\"\n\
         [[collections]]\nname = \"c\"\ntimezone = \"Europe/Berlin\"\nclose_after = \"2d\"\n\
         [[collections]]\nname = \"d\"\nbucket = 1\nclose_after = \"soon\"\n\
         [[collections]]\nname = \"e\"\nbucket = \"Day\"\ntimezone = \"Nowhere\"\n\
         [[collections]]\nname = \"f\"\ntimezone = \"Nowhere\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(
        keys(&err),
        [
            "collections[0].bucket",
            "collections[1].timezone",
            "collections[2].timezone",
            "collections[2].close_after",
            "collections[3].bucket",
            "collections[3].close_after",
            "collections[4].bucket",
            "collections[4].timezone",
            "collections[5].timezone",
        ],
        "{err}"
    );
    for (key, says) in [
        (
            "collections[0].bucket",
            "expected \"minute\", \"hour\", \"day\" or \"month\", found \"week\"",
        ),
        (
            "collections[1].timezone",
            "unknown time zone \"Mars/Olympus\"; use an IANA name such as \"UTC\"",
        ),
        (
            "collections[2].timezone",
            "set without bucket: a time zone says where buckets start",
        ),
        (
            "collections[2].close_after",
            "set without bucket: only buckets are closed",
        ),
        (
            "collections[3].bucket",
            "expected a string, found the number 1",
        ),
        ("collections[3].close_after", "not a duration"),
        ("collections[4].bucket", "found \"Day\""),
    ] {
        let said = message(&err, key);
        assert!(said.contains(says), "{key}: {said}");
    }
    assert!(
        message(&err, "collections[2].close_after")
            .ends_with("add bucket (minute, hour, day or month) or delete it")
    );
}

#[test]
fn a_close_after_below_the_margin_is_refused_naming_what_it_is_made_of() {
    // Two-step: 20s + 10s + 31s = 61s; lanes: 1m + 10s = 70s.
    let text = format!(
        "{MINIMAL}attempt_timeout = \"10s\"\nserver_selection_timeout = \"5s\"\n\
         [writer]\nretry_horizon = \"20s\"\nlane_resume_horizon = \"1m\"\nlane_ttl = \"2m\"\n\
         [reconcile]\ngrace = \"31s\"\n\
         [[collections]]\nname = \"a\"\nbucket = \"minute\"\nclose_after = \"69s\"\n\
         [[collections]]\nname = \"b\"\nbucket = \"minute\"\ngrace = \"5m\"\nclose_after = \"5m 29s\"\n\
         [alerts]\nstuck_after = \"1h\"\n"
    );
    let err = Config::from_toml(&text, []).unwrap_err();
    assert_eq!(
        keys(&err),
        ["collections[0].close_after", "collections[1].close_after"],
        "{err}"
    );
    let said = message(&err, "collections[0].close_after");
    assert!(
        said.starts_with("must be at least 1m 10s, the longer of"),
        "{said}"
    );
    assert!(
        said.contains(
            "writer.retry_horizon + mongodb.attempt_timeout + reconcile.grace (20s + 10s + 31s = \
             1m 1s) and writer.lane_resume_horizon + mongodb.attempt_timeout (1m + 10s = 1m 10s)"
        ),
        "{said}"
    );
    assert!(said.contains("lower writer.lane_resume_horizon"), "{said}");
    // The collection's own grace, when it has one: 20s + 10s + 5m.
    let said = message(&err, "collections[1].close_after");
    assert!(said.starts_with("must be at least 5m 30s"), "{said}");
    assert!(
        said.contains("+ collections[1].grace (20s + 10s + 5m = 5m 30s)"),
        "{said}"
    );
    assert!(!said.contains("lower writer.lane_resume_horizon"), "{said}");
    // The margin itself is enough.
    let fixed = text
        .replace("\"69s\"", "\"70s\"")
        .replace("\"5m 29s\"", "\"5m 30s\"");
    Config::from_toml(&fixed, []).unwrap();
    // With the defaults the lanes' part, 23h 1m, is the margin.
    let short = format!(
        "{MINIMAL}[[collections]]\nname = \"a\"\nbucket = \"day\"\nclose_after = \"23h\"\n"
    );
    let err = Config::from_toml(&short, []).unwrap_err();
    assert!(
        message(&err, "collections[0].close_after").starts_with("must be at least 23h 1m"),
        "{err}"
    );
}

/// The default closing margin, spelled out in `bucket` (a leaf module), is
/// made of the defaults it names.
#[test]
fn the_default_closing_margin_is_made_of_the_defaults() {
    use crate::bucket::{DEFAULT_CLOSING_MARGIN, closing_margin};
    use crate::write::counter::{DEFAULT_LANE_RESUME_HORIZON, DEFAULT_RETRY_HORIZON};
    let margin = closing_margin(
        DEFAULT_RETRY_HORIZON,
        DEFAULT_LANE_RESUME_HORIZON,
        crate::store::DEFAULT_ATTEMPT_TIMEOUT,
        crate::reconcile::DEFAULT_GRACE,
    );
    assert_eq!(DEFAULT_CLOSING_MARGIN, margin);
    assert_eq!(Buckets::utc(BucketWidth::Minute).closing_margin(), margin);
}
