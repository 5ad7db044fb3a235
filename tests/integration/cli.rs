//! The `tallyd` binary as a user runs it: exit codes, JSON output, config
//! errors, and secrets kept out of everything it prints.

use std::path::Path;
use std::process::Output;

use mongodb::bson::{Bson, doc};
use serde_json::Value;

use crate::common::server::repo_root;
use crate::common::{FailPoint, TestContext, counter, pending_len};

/// Runs `tallyd` with a clean environment plus `env`.
pub async fn tallyd(args: &[&str], env: &[(&str, &str)]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run tallyd")
}

pub fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("tallyd.toml");
    std::fs::write(&path, text).expect("write config");
    path.display().to_string()
}

pub fn json(output: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|err| panic!("stdout is not one JSON object ({err}): {stdout:?}"))
}

pub fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The ticket an application prints ([`tally::Counters::ticket`]) for an
/// unknown increment of `by` to `key` in `collection` whose token is
/// `token`: what `tallyd resume` takes.
pub fn resume_ticket(
    store: &tally::Store,
    collection: &str,
    key: &str,
    token: tally::Token,
    by: i64,
) -> String {
    let counters = tally::Counters::new(
        store,
        tally::CollectionConfig::new(collection),
        tally::WriterConfig::default(),
    );
    let unknown = tally::UnknownToken::new(key, token, by).expect("an amount");
    counters.ticket(&unknown)
}

/// The words of a printed command after `tallyd`, to run it as shown: it
/// repeats the `-c` and `--env-file` the command was given.
pub fn hint_args(hint: &str) -> Vec<&str> {
    let mut words = hint.split_whitespace();
    assert_eq!(words.next(), Some("tallyd"), "{hint}");
    words.collect()
}

/// The command of a printed command, without `tallyd` and the global
/// options it repeats (`-c PATH`, `--env-file PATH`): to run it under
/// other ones.
pub fn hint_command(hint: &str) -> Vec<&str> {
    let mut words = hint_args(hint).into_iter().peekable();
    while let Some(&word) = words.peek() {
        if word == "-c" || word == "--config" || word == "--env-file" {
            words.next();
            words.next();
        } else {
            break;
        }
    }
    words.collect()
}

/// The command a printed outcome asks to run: the text between its first
/// pair of backquotes.
pub fn hint(output: &Output) -> String {
    let shown = text(output);
    match shown.split('`').nth(1) {
        Some(hint) => hint.to_owned(),
        None => panic!("no hint in {shown:?}"),
    }
}

#[tokio::test]
async fn the_example_config_passes_check_config() {
    let path = repo_root().join("config/tallyd.toml");
    let output = tallyd(&["--config", path.to_str().unwrap(), "check-config"], &[]).await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(shown.contains("name = \"page_views\""), "{shown}");
    // Durations read as the file writes them: hours at the most, never
    // humantime's `1day` for `24h` (`7d` is `168h`).
    assert!(shown.contains("lane_ttl = \"24h\""), "{shown}");
    assert!(shown.contains("event_retention = \"168h\""), "{shown}");
    // The example follows its own advice: no password in its URI, which
    // the environment file carries instead (and the URI set there wins).
    let file = std::fs::read_to_string(&path).unwrap();
    let uri = file
        .lines()
        .find(|l| l.starts_with("uri = "))
        .expect("a uri line");
    assert!(!uri.contains('@'), "{uri}");
    assert!(file.contains("/etc/tally/tallyd.env"), "{file}");
    let secret = "mongodb://tallyd:s3cret@db9.example.net:27017/?replicaSet=rs0";
    let output = tallyd(
        &["--config", path.to_str().unwrap(), "check-config"],
        &[("TALLYD__MONGODB__URI", secret)],
    )
    .await;
    let shown = text(&output);
    assert_eq!(output.status.code(), Some(0), "{shown}");
    assert!(shown.contains("tallyd:****@db9.example.net"), "{shown}");
    assert!(!shown.contains("s3cret"), "{shown}");
}

#[tokio::test]
async fn a_bad_config_exits_78_naming_every_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        r#"
        unexpected = true
        [mongodb]
        database = "has space"
        connect_timeout = 5
        server_selection_timeout = "0s"
        max_idle_time = "-1m"
        [writer]
        retry_horizon = "soon"
        retry_horizonn = "1m"
        [log]
        format = "yaml"
        [[collections]]
        name = "a"
        counter_field = "$c"
        [[collections]]
        name = "a"
        pending_field = "p.q"
        [[collections]]
        name = 12
        "#,
    );
    let output = tallyd(
        &["--config", &path, "check-config"],
        &[("TALLYD__LOG__LEVEL", "noisy[")],
    )
    .await;
    assert_eq!(output.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&output.stderr);
    for key in [
        "unexpected",
        "mongodb.uri",
        "mongodb.database",
        "mongodb.connect_timeout",
        "mongodb.server_selection_timeout",
        "mongodb.max_idle_time",
        "writer.retry_horizon",
        "writer.retry_horizonn",
        "log.format",
        "log.level",
        "collections[0].counter_field",
        "collections[1].name",
        "collections[1].pending_field",
        "collections[2].name",
    ] {
        assert!(
            stderr.contains(&format!("  {key}: ")),
            "{key} not reported:\n{stderr}"
        );
    }
    assert!(stderr.contains("TALLYD__LOG__LEVEL"), "{stderr}");
}

/// Runs `tallyd` like [`tallyd`], killing it if it has not exited within
/// `limit` (`None` then).
async fn tallyd_within(
    limit: std::time::Duration,
    args: &[&str],
    env: &[(&str, &str)],
) -> Option<Output> {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(limit, child)
        .await
        .ok()
        .map(|output| output.expect("run tallyd"))
}

/// `check-config` answers for `run`: a configuration one refuses, the other
/// refuses too — exit 78, naming the key — before connecting to anything.
#[tokio::test]
async fn check_config_and_run_refuse_the_same_configurations() {
    // Nothing listens there: a `run` that got past its configuration would
    // wait for MongoDB instead of exiting.
    let base = "[mongodb]\nuri = \"mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=300\"\n\
                database = \"d\"\n";
    let views = format!("{base}[[collections]]\nname = \"views\"\n");
    // (configuration file, environment, what the refusal says)
    type Case<'a> = (String, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (base.to_owned(), vec![], "collections: none configured"),
        (
            format!("{views}[schedule]\ncron = \"0 0 0 30 2 *\"\n"),
            vec![],
            "schedule.cron: ",
        ),
        (
            format!("{views}[log]\nlevel = \"inof\"\n"),
            vec![],
            "log.level: ",
        ),
        (views.clone(), vec![("RUST_LOG", "inof")], "RUST_LOG: "),
        // The defaults: retry horizon 3m + attempt 60s.
        (
            format!("{views}[reconcile]\ngrace = \"90s\"\n"),
            vec![],
            "reconcile.grace: ",
        ),
        (
            format!("{views}[alerts]\nstuck_after = \"10m\"\n"),
            vec![],
            "alerts.stuck_after: ",
        ),
        (
            views.clone(),
            vec![("TALLYD__MONGODB__ATTEMPT_TIMEOUT", "200ms")],
            "mongodb.attempt_timeout: ",
        ),
        (
            views.clone(),
            vec![("TALLYD__X__Y", "1")],
            "TALLYD__X__Y (environment): unknown key x",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    let limit = std::time::Duration::from_secs(20);
    for (config, env, says) in &cases {
        let path = write_config(dir.path(), config);
        for command in ["check-config", "run"] {
            let output = tallyd_within(limit, &["--config", &path, command], env)
                .await
                .unwrap_or_else(|| panic!("`{command}` accepted ({says}):\n{config}"));
            let shown = text(&output);
            assert_eq!(
                output.status.code(),
                Some(78),
                "`{command}` ({says}):\n{shown}"
            );
            assert!(shown.contains(says), "`{command}`: no {says:?} in\n{shown}");
        }
    }
    // The same file with the key fixed passes.
    let path = write_config(dir.path(), &views);
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
}

/// A misspelt level would make tracing log nothing at all: it is refused,
/// with the forms a level may take.
#[tokio::test]
async fn a_misspelt_log_level_is_refused_with_the_accepted_forms() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        "[mongodb]\nuri = \"mongodb://h/d\"\n[[collections]]\nname = \"v\"\n[log]\nlevel = \"inof\"\n",
    );
    let output = tallyd(&["--config", &path, "check-config"], &[]).await;
    assert_eq!(output.status.code(), Some(78));
    let shown = text(&output);
    for expected in [
        "log.level: ",
        "\"inof\" is not a level",
        "target=level",
        "trace, debug, info, warn, error, off",
    ] {
        assert!(shown.contains(expected), "no {expected:?} in\n{shown}");
    }
}

#[tokio::test]
async fn a_missing_named_config_file_exits_78() {
    let output = tallyd(
        &["--config", "/nonexistent/tallyd.toml", "check-config"],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(78));
    assert!(text(&output).contains("--config"));
}

#[tokio::test]
async fn incr_prints_the_outcome_and_counts() {
    let ctx = TestContext::new("cli_incr").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let output = tallyd(
        &[
            "--config",
            &path,
            "incr",
            "home",
            "--collection",
            "views",
            "--json",
        ],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "counted");
    assert_eq!(out["key"], "home");
    assert_eq!(out["collection"], "views");
    let token = out["token"].as_str().unwrap();
    assert_eq!(token.len(), 24);
    assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
    // The ticket: the token, then its check.
    let ticket = out["ticket"].as_str().unwrap();
    assert!(ticket.starts_with(&format!("{token}-")), "{ticket}");
    assert_eq!(ticket.len(), 24 + 1 + 6, "{ticket}");

    // Text output, the environment naming the database, --by.
    let output = tallyd(
        &[
            "--config",
            &path,
            "incr",
            "home",
            "--collection",
            "views",
            "--by",
            "-3",
        ],
        &[("TALLYD__MONGODB__DATABASE", &ctx.db_name)],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert!(
        text(&output).starts_with("counted: views/home -3"),
        "{}",
        text(&output)
    );

    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "home").await, -2);
}

#[tokio::test]
async fn incr_not_counted_exits_1() {
    let ctx = TestContext::new("cli_not_counted").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(
        dir.path(),
        &ctx.config_toml(false, "[[collections]]\nname = \"views\""),
    );
    let _fail = FailPoint::update_refused(&ctx).await;
    // One collection configured: --collection may be left out.
    let output = tallyd(&["--config", &path, "incr", "k", "--json"], &[]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "not_counted");
    assert_eq!(out["error"]["class"], "command");
    assert_eq!(out["amount"], 1);
}

/// `tallyd incr k --by 5`, its step 1 and that step's one retry cut off
/// before reaching the server.
async fn incr_by_5_lost_twice(ctx: &TestContext, path: &str, json_output: bool) -> Output {
    let mut args = vec![
        "--config",
        path,
        "incr",
        "k",
        "--by",
        "5",
        "--collection",
        "views",
    ];
    if json_output {
        args.push("--json");
    }
    updates_lost_twice(ctx, &args).await
}

/// `tallyd <args>` while the next two updates of `ctx`'s application are
/// cut off before reaching the server: an increment's step 1 and its one
/// retry, so its outcome is unknown.
pub async fn updates_lost_twice(ctx: &TestContext, args: &[&str]) -> Output {
    let _fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "times": 2 }),
        doc! { "failCommands": ["update"], "closeConnection": true },
    )
    .await;
    tallyd(args, &[]).await
}

/// `tallyd resume k TOKEN --collection views` with the config at `path`.
fn resume_k<'a>(path: &'a str, token: &'a str) -> Vec<&'a str> {
    vec![
        "--config",
        path,
        "resume",
        "k",
        token,
        "--collection",
        "views",
    ]
}

/// The ticket of an unknown `+1` to `views/k` whose token was made
/// `seconds` ago, as an application prints it.
async fn ticket_aged(ctx: &TestContext, seconds: u64) -> String {
    let token = tally::Token::created_at_time(
        std::time::SystemTime::now() - std::time::Duration::from_secs(seconds),
    );
    resume_ticket(&ctx.client(false).await.store(), "views", "k", token, 1)
}

/// `tallyd incr` shuts its MongoDB client down in order before it exits.
/// Without that, the driver's session clean-up raced the runtime's shutdown
/// and panicked after a correct outcome in about 0.75% of runs (15 of 2,000
/// measured), so at least 100 runs, and as many more as fit in ~20 s (two
/// at a time), must all exit 0, none print "panicked", and count once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_incr_runs_never_panic_on_exit() {
    let ctx = TestContext::new("cli_incr_shutdown").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let args = ["--config", &path, "incr", "k", "--collection", "views"];
    let started = std::time::Instant::now();
    let mut runs = 0;
    // At least 100 runs however slow the machine (a count, not a time:
    // the test failed once as "only 62 runs in 20 s" under load), then
    // more while they fit in ~20 s.
    while runs < 100 || (runs < 1000 && started.elapsed() < std::time::Duration::from_secs(20)) {
        let (a, b) = tokio::join!(tallyd(&args, &[]), tallyd(&args, &[]));
        for output in [a, b] {
            runs += 1;
            let shown = text(&output);
            assert_eq!(output.status.code(), Some(0), "run {runs}: {shown}");
            assert!(!shown.contains("panicked"), "run {runs}: {shown}");
        }
    }
    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "k").await, runs);
}

/// `incr --by 5` whose step 1 is lost twice: unknown. The JSON says the
/// amount, the printed hint repeats `--by 5`, and following the hint counts
/// exactly 5 (without `--by`, a resume would re-add the token as +1).
#[tokio::test]
async fn an_unknown_incr_by_5_says_5_and_its_hint_counts_5() {
    let ctx = TestContext::new("cli_unknown_by_5").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let output = incr_by_5_lost_twice(&ctx, &path, true).await;
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "unknown");
    assert_eq!(out["amount"], 5);

    let output = incr_by_5_lost_twice(&ctx, &path, false).await;
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let hint = hint(&output);
    // It repeats the configuration it was given: it works pasted as shown.
    assert!(
        hint.starts_with(&format!("tallyd -c {path} resume k ")),
        "{hint}"
    );
    assert!(hint.contains("--by 5"), "{hint}");
    let output = tallyd(&hint_args(&hint), &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert!(
        text(&output).starts_with("counted: views/k +5"),
        "{}",
        text(&output)
    );
    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "k").await, 5);
}

/// A `resume` that cannot read the document hands the ticket back as
/// unknown; for a token already past the retry horizon it says so — counted
/// at most once, exit 1: nothing is left to do — and never prints a
/// `resume` hint that could only be refused.
#[tokio::test]
async fn an_unknown_token_past_the_horizon_gets_no_resume_hint() {
    let ctx = TestContext::new("cli_unknown_past_horizon").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let old = ticket_aged(&ctx, 3600).await;
    let args = resume_k(&path, &old);
    let output = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "times": 4 }),
            doc! { "failCommands": ["find"], "errorCode": 2 },
        )
        .await;
        tallyd(&args, &[]).await
    };
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let shown = text(&output);
    assert!(shown.starts_with("unknown: "), "{shown}");
    assert!(!shown.contains("tallyd resume"), "{shown}");
    assert!(shown.contains("counted at most once"), "{shown}");
}

#[tokio::test]
async fn pending_exits_75_and_complete_settles_it() {
    let ctx = TestContext::new("cli_pending_complete").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let token = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "skip": 1, "times": 1 }),
            doc! { "failCommands": ["update"], "errorCode": 2 },
        )
        .await;
        let output = tallyd(
            &[
                "--config",
                &path,
                "incr",
                "k",
                "--collection",
                "views",
                "--json",
            ],
            &[],
        )
        .await;
        assert_eq!(output.status.code(), Some(75), "{}", text(&output));
        let out = json(&output);
        assert_eq!(out["outcome"], "pending");
        out["ticket"].as_str().unwrap().to_owned()
    };
    let client = ctx.client(false).await;
    let views = client.collection("views");
    assert_eq!(pending_len(&views, "k").await, 1);

    let complete = [
        "--config",
        &path,
        "complete",
        "k",
        &token,
        "--collection",
        "views",
        "--json",
    ];
    let output = tallyd(&complete, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "counted");
    assert_eq!(json(&output)["amount"], 1);
    // Again: its marker says a settle counted it; nothing more is counted.
    let output = tallyd(&complete, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "counted");
    assert_eq!(json(&output)["settled_earlier"], true);
    let output = tallyd(&complete[..complete.len() - 1], &[]).await;
    assert!(
        text(&output).contains("counted earlier"),
        "{}",
        text(&output)
    );
    // A token that was never added: nothing to do, said so, still exit 0.
    let never = tally::Token::new().to_string();
    let mut complete = complete;
    // A bare token is taken too: `complete` only counts a pending token.
    complete[4] = &never;
    let output = tallyd(&complete, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "not_pending");
    assert_eq!(json(&output)["amount"], Value::Null);
    let output = tallyd(&complete[..complete.len() - 1], &[]).await;
    assert!(text(&output).contains("not pending"), "{}", text(&output));

    assert_eq!(counter(&views, "k").await, 1);
    assert_eq!(pending_len(&views, "k").await, 0);
}

#[tokio::test]
async fn resume_refuses_past_the_horizon_and_settles_within_it() {
    let ctx = TestContext::new("cli_resume").await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let old = ticket_aged(&ctx, 600).await;
    let mut args = resume_k(&path, &old);
    args.push("--json");
    let output = tallyd(&args, &[]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "refused");

    let store = ctx.client(false).await.store();
    let fresh = resume_ticket(&store, "views", "k", tally::Token::new(), 4);
    let output = tallyd(
        &[
            "--config",
            &path,
            "resume",
            "k",
            &fresh,
            "--by",
            "4",
            "--collection",
            "views",
            "--json",
        ],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "counted");
    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "k").await, 4);
}

#[tokio::test]
async fn the_uri_password_never_appears() {
    // Nothing listens on port 9: every command fails, and says why.
    let uri = "mongodb://alice:Sup3rSecretPw@127.0.0.1:9/?serverSelectionTimeoutMS=300&connectTimeoutMS=300";
    let env = [
        ("TALLYD__MONGODB__URI", uri),
        ("TALLYD__MONGODB__DATABASE", "d"),
        ("RUST_LOG", "trace"),
    ];
    // No --config: the default file is absent, the environment says it all.
    let store = tally::Store::connect(&tally::StoreConfig::new(uri, "d"))
        .await
        .expect("a URI the driver takes");
    let ticket = resume_ticket(&store, "c", "k", tally::Token::new(), 1);
    for args in [
        vec!["check-config"],
        vec!["incr", "k", "--collection", "c"],
        vec!["incr", "k", "--collection", "c", "--json"],
        vec![
            "complete",
            "k",
            "0123456789abcdef01234567",
            "--collection",
            "c",
        ],
        vec!["resume", "k", &ticket, "--collection", "c", "--json"],
    ] {
        let output = tallyd(&args, &env).await;
        let shown = text(&output);
        assert!(!shown.is_empty(), "{args:?} printed nothing");
        assert!(
            !shown.contains("Sup3rSecretPw"),
            "{args:?} leaked the password:\n{shown}"
        );
    }
    // A malformed URI is reported without its password, exit 78.
    let bad = [(
        "TALLYD__MONGODB__URI",
        "mongodb://alice:Sup3rSecretPw@host:notaport/d",
    )];
    let output = tallyd(&["check-config"], &bad).await;
    assert_eq!(output.status.code(), Some(78));
    let shown = text(&output);
    assert!(
        shown.contains("mongodb.uri") && !shown.contains("Sup3rSecretPw"),
        "{shown}"
    );
}

#[tokio::test]
async fn retries_are_logged_with_class_and_attempt_as_json() {
    let ctx = TestContext::new("cli_json_logs").await;
    let dir = tempfile::tempdir().unwrap();
    let config = ctx.config_toml(false, "[log]\nformat = \"json\"\nlevel = \"warn\"");
    let path = write_config(dir.path(), &config);
    let _fail = FailPoint::updates_cut(&ctx, 1).await;
    let output = tallyd(
        &["--config", &path, "incr", "k", "--collection", "views"],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let retry: Value = stderr
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).expect("every log line is JSON"))
        .find(|line| line["message"] == "attempt failed, retrying")
        .unwrap_or_else(|| panic!("no retry logged:\n{stderr}"));
    assert_eq!(retry["level"], "WARN");
    assert_eq!(retry["class"], "transient");
    assert_eq!(retry["attempt"], 1);
    assert_eq!(retry["operation"], "increment.add_token");
}

/// Runs `tallyd` with its standard output a pipe nobody reads any more
/// (`tallyd … | head -0`): the read end is closed before the command starts.
async fn tallyd_into_a_closed_pipe(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        std::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
            .args(args)
            .env_clear()
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("run tallyd")
    })
    .await
    .expect("the command's task")
}

/// A reader that went away is no failure of the command: it does not panic
/// (it did, on every command's first line), says nothing about it, and
/// exits with the code of what it did — an increment counted is still 0.
#[tokio::test]
async fn output_into_a_closed_pipe_neither_panics_nor_changes_the_exit_code() {
    let ctx = TestContext::new("cli_closed_pipe").await;
    let dir = tempfile::tempdir().unwrap();
    let collection = "[[collections]]\nname = \"views\"\n";
    let path = write_config(dir.path(), &ctx.config_toml(false, collection));
    let runs: [(&[&str], i32); 3] = [
        (&["--config", &path, "check-config"], 0),
        (
            &["--config", &path, "incr", "k", "--collection", "views"],
            0,
        ),
        (&["--config", &path, "incr", "k", "--by", "2", "--json"], 0),
    ];
    for (args, code) in runs {
        let output = tallyd_into_a_closed_pipe(args).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");
    }
    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "k").await, 3);
}
