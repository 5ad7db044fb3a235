//! Every mistake gets one clear answer: each class of failure provoked
//! through the real `tallyd` binary — an unreachable server, a wrong
//! password, a missing privilege, a bad value, a validator, a document too
//! large, an overflow — says what failed in one sentence (the server's
//! code, code name and message; where and why it could not connect) and
//! exits by its class; never the driver's Debug text. Usage errors exit 64,
//! a configuration one command refuses every command refuses (78), and
//! `--collection` names a configured collection.

use std::process::Output;

use mongodb::bson::{Bson, doc};

use crate::cli::{json, resume_ticket, tallyd, text, write_config};
use crate::common::server::{AuthServer, create_views_user};
use crate::common::tallyd::free_address;
use crate::common::{FailPoint, TestContext, counter, external};

/// What the driver's own formatting looks like: never shown to people.
const DEBUG_TEXT: [&str; 7] = [
    "Kind:",
    "Some(",
    "None,",
    "RawDocumentBuf",
    "labels:",
    "server response",
    "CommandError {",
];

/// Stdout and stderr together, checked for the driver's Debug text.
pub(crate) fn readable(output: &Output) -> String {
    let shown = text(output);
    for debug in DEBUG_TEXT {
        assert!(
            !shown.contains(debug),
            "{debug:?} in what tallyd printed: {shown}"
        );
    }
    shown
}

/// `tallyd --config <config> <args>`, with a clean environment.
async fn run(config: &str, args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), config);
    let mut all = vec!["--config", path.as_str()];
    all.extend_from_slice(args);
    tallyd(&all, &[]).await
}

/// A configuration for `uri` and `database` with the collection `views`,
/// and short timeouts: server selection 1 s, attempts 3 s.
fn quick(uri: &str, database: &str, extra: &str) -> String {
    format!(
        "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{database}\"\nserver_selection_timeout = \"1s\"\n\
         attempt_timeout = \"3s\"\n[writer]\nretry_horizon = \"6s\"\n[reconcile]\ngrace = \"10s\"\n\
         [alerts]\nstuck_after = \"10s\"\n[[collections]]\nname = \"views\"\n{extra}"
    )
}

/// A closed port: every command that talks to the server exits 69 and says
/// that no server could be selected within 1 s at 127.0.0.1:PORT because
/// the connection was refused — the password never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_exits_69_saying_where_and_why() {
    let port = free_address().port();
    let uri = format!("mongodb://tally:S3cret-pw@127.0.0.1:{port}/?directConnection=true");
    let config = quick(&uri, "app", "");
    let said = format!(
        "no server could be selected within 1s at 127.0.0.1:{port} (connection refused): \
         nothing listens there; check the host and port of the connection string, or start \
         MongoDB"
    );
    let commands: [&[&str]; 6] = [
        &["incr", "k"],
        &["status"],
        &["check-config", "--connect"],
        &["reconcile"],
        &["seq", "next", "orders"],
        &["setup"],
    ];
    for args in commands {
        let output = run(&config, args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(69), "{args:?}: {shown}");
        assert!(shown.contains(&said), "{args:?}: {shown}");
        assert!(!shown.contains("S3cret-pw"), "{args:?}: {shown}");
    }
    let output = run(&config, &["incr", "k", "--json"]).await;
    assert_eq!(output.status.code(), Some(69), "{}", readable(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "not_counted");
    assert_eq!(out["error"]["message"], said.as_str());
    assert_eq!(out["error"]["class"], "command");
}

/// While no server answers, a command says so at once and keeps saying
/// it — not a silence as long as server selection (here 8 s): from 2 s on,
/// every 5 s, where and why, on standard error; then the failure, exit 69.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_waiting_for_an_unreachable_server_says_so_while_it_waits() {
    let port = free_address().port();
    let uri = format!("mongodb://127.0.0.1:{port}/?directConnection=true");
    let config = quick(&uri, "app", "").replace(
        "server_selection_timeout = \"1s\"\nattempt_timeout = \"3s\"",
        "server_selection_timeout = \"8s\"\nattempt_timeout = \"9s\"",
    );
    let config = config
        .replace("retry_horizon = \"6s\"", "retry_horizon = \"18s\"")
        .replace("grace = \"10s\"", "grace = \"30s\"")
        .replace("stuck_after = \"10s\"", "stuck_after = \"30s\"");
    let output = run(&config, &["incr", "k"]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(69), "{stderr}");
    let waiting: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains(&format!("MongoDB at 127.0.0.1:{port} has not answered for")))
        .collect();
    assert!(
        waiting.len() >= 2
            && waiting
                .iter()
                .all(|l| l.contains("(connection refused); still trying")),
        "said while waiting: {stderr}"
    );
    assert!(waiting[0].contains("for 2s"), "at once: {stderr}");
}

/// A server with authentication: a wrong password exits 77 naming the user
/// and where it is defined, from every command; a user without the update
/// privilege gets the server's refusal with its code and name, and what to
/// do — exit 77, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_and_a_missing_privilege_exit_77() {
    if external() {
        return; // needs a server with authentication
    }
    let server = AuthServer::start(|client| async move {
        create_views_user(&client.database("app"), "reader", "Pw-of-reader", &["find"]).await;
    })
    .await;

    let wrong = quick(&server.uri("reader", "Wr0ng-pw", "app"), "app", "");
    // A settle's look-up too: waiting would not help (it said 75, "try
    // later", before).
    let token = mongodb::bson::oid::ObjectId::new().to_hex();
    for args in [
        &["incr", "k"][..],
        &["status"],
        &["check-config", "--connect"],
        &["doctor"],
        &["complete", "k", &token],
    ] {
        let output = run(&wrong, args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(77), "{args:?}: {shown}");
        assert!(
            shown.contains("authentication failed for reader on app"),
            "{args:?}: {shown}"
        );
        assert!(shown.contains("password"), "what to check: {shown}");
        assert!(!shown.contains("Wr0ng-pw"), "{args:?}: {shown}");
    }

    // setup says it once, not once a collection and index.
    let output = run(&wrong, &["setup"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(77), "{shown}");
    assert_eq!(
        shown
            .matches("authentication failed for reader on app")
            .count(),
        1,
        "{shown}"
    );

    // No user at all in the URI: no role would help, a user would.
    let nobody = quick(
        &format!(
            "mongodb://127.0.0.1:{}/?directConnection=true",
            server.port()
        ),
        "app",
        "",
    );
    let output = run(&nobody, &["incr", "k"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(77), "{shown}");
    assert!(shown.contains("(13 Unauthorized)"), "{shown}");
    assert!(shown.contains("no user is logged in"), "{shown}");
    assert!(!shown.contains("smallest MongoDB role"), "{shown}");

    let reader = quick(&server.uri("reader", "Pw-of-reader", "app"), "app", "");
    let output = run(&reader, &["incr", "k"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(77), "{shown}");
    assert!(
        shown.starts_with("not counted (+1): not authorized on app"),
        "{shown}"
    );
    assert!(shown.contains("(13 Unauthorized)"), "{shown}");
    assert!(shown.contains("smallest MongoDB role"), "{shown}");
    let output = run(&reader, &["incr", "k", "--json"]).await;
    assert_eq!(output.status.code(), Some(77), "{}", readable(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "not_counted");
    assert_eq!(out["error"]["code"], 13);
    assert_eq!(out["error"]["code_name"], "Unauthorized");
}

/// The server refuses the write: a bad value (a fail point), a validator,
/// a document that would pass 16 MB, a lane increment past the int64
/// limit. Each says the server's message with its code and name (and what
/// to do where tally knows), exits 1, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_exit_1_with_the_servers_code_name_and_message() {
    let ctx = TestContext::new("errors_refusals").await;
    let client = ctx.client(false).await;
    let database = client.client.database(&ctx.db_name);
    database
        .create_collection("validated")
        .validator(doc! { "$jsonSchema": { "required": ["owner"] } })
        .await
        .unwrap();
    let views = client.collection("views");
    views
        .insert_one(doc! { "_id": "big", "counter": i64::MAX })
        .await
        .unwrap();
    // A document 4 bytes below the server's 16 MB: a pending token does
    // not fit any more.
    let huge = client.collection("huge");
    let base = doc! { "_id": "h", "counter": 1i64, "blob": "" };
    let room = 16 * 1024 * 1024 - mongodb::bson::serialize_to_vec(&base).unwrap().len() - 4;
    huge.insert_one(doc! { "_id": "h", "counter": 1i64, "blob": "x".repeat(room) })
        .await
        .unwrap();
    let config = ctx.config_toml(
        false,
        "[[collections]]\nname = \"views\"\n[[collections]]\nname = \"validated\"\n\
         [[collections]]\nname = \"huge\"",
    );

    let shown_for = |args: &'static [&'static str]| {
        let config = config.clone();
        async move {
            let output = run(&config, args).await;
            let shown = readable(&output);
            assert_eq!(output.status.code(), Some(1), "{args:?}: {shown}");
            assert!(shown.starts_with("not counted (+1): "), "{args:?}: {shown}");
            shown
        }
    };
    let shown = {
        let _fail = FailPoint::update_refused(&ctx).await;
        shown_for(&["incr", "k", "--collection", "views"]).await
    };
    assert!(shown.contains("(2 BadValue)"), "{shown}");
    assert_eq!(views.count_documents(doc! { "_id": "k" }).await.unwrap(), 0);

    let shown = shown_for(&["incr", "a", "--collection", "validated"]).await;
    assert!(shown.contains("(121 DocumentValidationFailure)"), "{shown}");
    assert!(shown.contains("validator"), "what to do: {shown}");

    let shown = shown_for(&["incr", "h", "--collection", "huge"]).await;
    assert!(
        shown.contains("16777216") || shown.contains("too large"),
        "{shown}"
    );
    assert!(shown.contains("16 MB limit"), "what to do: {shown}");
    assert_eq!(counter(&huge, "h").await, 1);

    // The lanes protocol: one `$inc` past 2^63 − 1, refused by the server.
    let shown = shown_for(&["incr", "big", "--collection", "views", "--lane"]).await;
    assert!(shown.contains("(2 BadValue)"), "{shown}");
    assert!(shown.contains("$inc"), "the server's message: {shown}");
    assert_eq!(counter(&views, "big").await, i64::MAX);
    let lanes = views
        .find_one(doc! { "_id": "big" })
        .await
        .unwrap()
        .unwrap();
    assert!(lanes.get("lanes").is_none(), "nothing written: {lanes}");
}

/// Usage errors exit 64 — a missing argument, a value out of range (said
/// in words), an unknown flag, flags that exclude each other, no command —
/// and the help and version exit 0; the help ends with the exit codes.
#[tokio::test]
async fn usage_errors_exit_64_and_help_exits_0() {
    let cases: [(&[&str], i32); 8] = [
        (&["incr"], 64),
        (&["seq", "next", "orders", "--block", "0"], 64),
        (&["--bogus", "status"], 64),
        (&["incr", "k", "--lane", "--two-step"], 64),
        (&["status", "--any-collection"], 64),
        (&[], 64),
        (&["--help"], 0),
        (&["--version"], 0),
    ];
    for (args, code) in cases {
        let output = tallyd(args, &[]).await;
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {shown}");
        assert!(!shown.contains("..="), "a range as words: {shown}");
    }
    let help = tallyd(&["doctor", "--help"], &[]).await;
    assert!(
        text(&help).contains("77  permission denied"),
        "{}",
        text(&help)
    );
}

/// A configuration without collections gets one verdict from every
/// command: exit 78, the same message, before anything connects.
#[tokio::test]
async fn one_configuration_gets_one_verdict_from_every_command() {
    let config = "[mongodb]\nuri = \"mongodb://127.0.0.1:9/\"\ndatabase = \"app\"\n";
    let commands: [&[&str]; 10] = [
        &["check-config"],
        &["run"],
        &["doctor"],
        &["setup"],
        &["status"],
        &["reconcile"],
        &["incr", "k", "--collection", "views", "--any-collection"],
        &["resume", "k", "0123456789abcdef01234567-abcdef"],
        &["get", "k"],
        &["seq", "next", "orders"],
    ];
    let mut said = None;
    for args in commands {
        let output = run(config, args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {shown}");
        assert!(
            shown.contains("collections: none configured"),
            "{args:?}: {shown}"
        );
        match &said {
            None => said = Some(shown),
            Some(first) => assert_eq!(&shown, first, "{args:?}"),
        }
    }
}

/// `--collection` names a configured collection: a typo exits 78 naming
/// the configured ones, and nothing is written (the misspelt collection is
/// not created); `--any-collection` means it. The same for `status` and
/// `reconcile`; `record` wants a collection with a ledger.
#[tokio::test]
async fn a_collection_must_be_configured_unless_any_collection_says_so() {
    let ctx = TestContext::new("errors_collection").await;
    let config = ctx.config_toml(
        false,
        "[[collections]]\nname = \"views\"\n[[collections]]\nname = \"clicks\"",
    );
    let output = run(&config, &["incr", "home", "--collection", "veiws"]).await;
    let store = ctx.client(false).await.store();
    let ticket = resume_ticket(&store, "veiws", "home", tally::Token::new(), 1);
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(
        shown.contains("veiws is not a configured collection (configured: views and clicks)"),
        "{shown}"
    );
    assert!(shown.contains("--any-collection"), "{shown}");
    for args in [
        &["status", "--collection", "veiws"][..],
        &[
            "reconcile",
            "--collection",
            "views",
            "--collection",
            "veiws",
        ],
        &["resume", "home", &ticket, "--collection", "veiws"],
    ] {
        let output = run(&config, args).await;
        assert_eq!(
            output.status.code(),
            Some(78),
            "{args:?}: {}",
            readable(&output)
        );
    }
    let output = run(&config, &["incr", "home"]).await;
    assert_eq!(output.status.code(), Some(64), "{}", readable(&output));
    assert!(readable(&output).contains("views and clicks"));
    let output = run(&config, &["record", "e1", "home", "--collection", "views"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(shown.contains("views has no events ledger"), "{shown}");
    // A typo for `record` is not advised `--any-collection`, which cannot
    // give a collection a ledger (a new user followed that advice into a
    // second refusal); given anyway, the same verdict.
    for args in [
        &["record", "e1", "home", "--collection", "veiws"][..],
        &[
            "record",
            "e1",
            "home",
            "--collection",
            "veiws",
            "--any-collection",
        ],
    ] {
        let output = run(&config, args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {shown}");
        assert!(
            shown.contains("veiws is not a configured collection (configured: views and clicks)"),
            "{args:?}: {shown}"
        );
        assert!(
            !shown.contains("pass --any-collection"),
            "{args:?}: advised what cannot work: {shown}"
        );
    }
    let client = ctx.client(false).await;
    let names = client
        .client
        .database(&ctx.db_name)
        .list_collection_names()
        .await
        .unwrap();
    assert!(names.is_empty(), "nothing written: {names:?}");

    let output = run(
        &config,
        &["incr", "home", "--collection", "other", "--any-collection"],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    assert_eq!(counter(&client.collection("other"), "home").await, 1);
}

/// `status` and `doctor` name the server and database they read (never
/// the password). A database that holds none of the configured
/// collections — a misspelt `[mongodb] database` — is said so: `status`
/// exits 78 instead of showing clean zeros, `doctor` warns and does not
/// probe it, and neither creates it.
#[tokio::test]
async fn a_database_that_holds_nothing_is_said_so_and_never_created() {
    let ctx = TestContext::new("errors_database").await;
    let client = ctx.client(false).await;
    client
        .collection("views")
        .insert_one(doc! { "_id": "home", "counter": 1i64 })
        .await
        .unwrap();
    let typo = format!("{}x", ctx.db_name);
    let server = ctx.uri.split('/').nth(2).unwrap().to_owned();
    let config = ctx.config_toml(false, "").replace(
        &format!("database = \"{}\"", ctx.db_name),
        &format!("database = \"{typo}\""),
    );

    let output = run(&config, &["status"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(
        shown.starts_with(&format!("MongoDB at {server}, database {typo}\n")) || external(),
        "{shown}"
    );
    assert!(
        shown.contains(&format!(
            "database {typo} at {server} holds none of the configured collections (views)"
        )) || external(),
        "{shown}"
    );
    let output = run(&config, &["status", "--json"]).await;
    assert_eq!(output.status.code(), Some(78));
    let out = json(&output);
    assert_eq!(out["server"]["database"], typo.as_str());
    assert!(
        out["error"].as_str().unwrap().contains("holds none"),
        "{out}"
    );

    let output = run(&config, &["doctor", "--json"]).await;
    let out = json(&output);
    let checks = out["checks"].as_array().unwrap();
    let check = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap().clone();
    assert_eq!(check("database")["verdict"], "warn", "{out}");
    let probe = check("write_concern")["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(probe.contains("not probed"), "{probe}");
    let databases = client.client.list_database_names().await.unwrap();
    assert!(!databases.contains(&typo), "created: {databases:?}");

    // With a ledger: no advice to run setup, which would create the
    // misspelt database, before the name is checked.
    let ledger = ctx
        .config_toml(false, "[[collections]]\nname = \"views\"\nledger = true\n")
        .replace(
            &format!("database = \"{}\"", ctx.db_name),
            &format!("database = \"{typo}\""),
        );
    let output = run(&ledger, &["status"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(!shown.contains("setup"), "{shown}");
    let output = run(&ledger, &["doctor", "--json"]).await;
    let out = json(&output);
    let checks = out["checks"].as_array().unwrap();
    for check in checks.iter().filter(|c| c["name"] == "ledger_indexes") {
        let message = check["message"].as_str().unwrap();
        assert!(
            message.contains(&format!(
                "first check [mongodb] database: {typo} holds none of the configured collections"
            )),
            "{message}"
        );
    }
    assert!(
        checks.iter().any(|c| c["name"] == "ledger_indexes"),
        "{out}"
    );

    // The right database: named, no error.
    let output = run(&ctx.config_toml(false, ""), &["status"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
}

/// `status --check` exits 1 when something needs attention — a stuck token,
/// a malformed document — and says what; 0 when nothing does. Without
/// `--check` it exits 0 either way.
#[tokio::test]
async fn status_check_exits_1_when_something_needs_attention() {
    let ctx = TestContext::new("errors_status_check").await;
    let views = ctx.client(false).await.collection("views");
    views
        .insert_one(doc! { "_id": "fine", "counter": 1i64 })
        .await
        .unwrap();
    let config = ctx.config_toml(false, "[alerts]\nstuck_after = \"30m\"");
    let output = run(&config, &["status", "--check"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    assert!(!text(&output).contains("needs attention"));

    let stale = tally::Token::created_at_time(
        std::time::SystemTime::now() - std::time::Duration::from_secs(3600),
    )
    .object_id();
    views
        .insert_many([
            doc! { "_id": "stuck", "counter": 0i64, "pending": [stale] },
            doc! { "_id": "bad", "counter": "one", "pending": [Bson::Int32(3)] },
        ])
        .await
        .unwrap();
    let output = run(&config, &["status", "--check"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(1), "{shown}");
    assert!(
        shown.contains("needs attention: 1 stuck tokens in views; 1 malformed documents in views"),
        "{shown}"
    );
    let output = run(&config, &["status"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", readable(&output));
    let output = run(&config, &["status", "--json", "--check"]).await;
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(json(&output)["attention"].as_array().unwrap().len(), 2);
}

/// A zero amount is a malformed argument, as a zero block is: `incr --by 0`
/// and `record --by 0` exit 64 before anything connects, as `seq next
/// --block 0` does — one mistake, one verdict — and say what to pass
/// instead. (Found by a first-time user: `incr home --by 0` exits 1 with
/// `not counted (+0): invalid argument: the amount must not be zero`,
/// `seq next orders --block 0` exits 64.)
#[tokio::test]
async fn a_zero_amount_is_a_usage_error_as_a_zero_block_is() {
    let config = "[mongodb]\nuri = \"mongodb://127.0.0.1:9/\"\ndatabase = \"app\"\n\
                  [[collections]]\nname = \"views\"\nledger = true\n";
    let commands: [&[&str]; 4] = [
        &["seq", "next", "orders", "--block", "0"],
        &["incr", "k", "--by", "0"],
        &["incr", "k", "--by", "0", "--lane"],
        &["record", "e1", "k", "--by", "0"],
    ];
    for args in commands {
        let output = run(config, args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {shown}");
        assert!(!shown.contains("invalid argument:"), "{args:?}: {shown}");
    }
}

/// The book's errors page lists each message under the class it exits
/// with. A ticket `resume` or `complete` refuses (another key, `--by` or
/// `--collection`; a pending or counted increment's ticket given to
/// `resume`) exits 1 — nothing was written, the reference says so and
/// tickets.rs checks it — so it is not listed under "Unknown or pending
/// (75)".
#[test]
fn the_errors_page_lists_a_refused_ticket_under_exit_1() {
    let page = std::fs::read_to_string(
        crate::common::server::repo_root().join("docs/src/operations/errors.md"),
    )
    .unwrap();
    let section = page
        .split("### Unknown or pending (75)")
        .nth(1)
        .expect("the 75 section")
        .split("\n### ")
        .next()
        .unwrap();
    let refusals: Vec<&str> = section
        .lines()
        .filter(|l| l.starts_with("| `refused:"))
        .collect();
    assert!(
        refusals.is_empty(),
        "rows of exit 1 listed under 75: {refusals:?}"
    );
}

/// A configuration missing several things gets them named at once, as
/// `check-config` promises ("names every bad key"): an empty `[mongodb]`
/// table lacks the URI, the database and a `[[collections]]` table, and one
/// run says all three. (Found by a first-time user: it says
/// `mongodb.uri: missing`; with the URI set, `mongodb.database: missing`;
/// with that set, `collections: none configured` — three rounds.)
#[tokio::test]
async fn an_empty_configuration_names_every_missing_key_at_once() {
    for args in [&["check-config"][..], &["incr", "home"]] {
        let output = run("[mongodb]\n", args).await;
        let shown = readable(&output);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {shown}");
        for key in ["mongodb.uri", "mongodb.database", "collections"] {
            assert!(shown.contains(key), "{args:?} should name {key}: {shown}");
        }
    }
}

/// Without `--config`, and without the default file, the message says
/// that no configuration file was read (naming the default path and
/// `--config`), not only that a key is missing "in the file". (Found by a
/// first-time user who left out `-c tallyd.toml`: `tallyd incr home` says
/// `mongodb.uri: missing (set it in the file or with
/// TALLYD__MONGODB__URI)`, naming no file.)
#[tokio::test]
async fn no_configuration_file_is_said_so_naming_the_default_path() {
    if std::path::Path::new("/etc/tally/tallyd.toml").exists() {
        return; // the package is installed here: the default file is read
    }
    let output = tallyd(&["incr", "home"], &[]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(shown.contains("/etc/tally/tallyd.toml"), "{shown}");
    assert!(shown.contains("--config"), "{shown}");
}

/// A URI whose `replicaSet` names another set than the server's — the
/// README's example URI (`?replicaSet=rs0`) pointed at a server whose set
/// has another name — never works, however long one waits: it is a
/// configuration to fix (78), and the message names the URI's set name,
/// not only "is there a primary, and do the hosts belong to one
/// deployment?". (Found by a first-time user: `tallyd incr home` with
/// `mongodb://127.0.0.1:27017/?replicaSet=rs0` against the test server
/// (set `secantus`) exits 69, "try again later", saying `no host refused
/// or failed; none that answers can take it: …`.)
#[tokio::test]
async fn a_replica_set_name_that_does_not_match_is_a_configuration_to_fix() {
    let ctx = TestContext::new("errors_set_name").await;
    if external() {
        return; // the test server's set name is known; a real one's is not
    }
    let server = ctx.uri.split('/').nth(2).unwrap().to_owned();
    let uri = format!("mongodb://{server}/?replicaSet=not-this-set");
    let output = run(&quick(&uri, &ctx.db_name, ""), &["incr", "k"]).await;
    let shown = readable(&output);
    assert_eq!(output.status.code(), Some(78), "{shown}");
    assert!(shown.contains("not-this-set"), "{shown}");
    assert!(!shown.contains("try again"), "{shown}");
}

/// A command waiting for a server whose hosts belong to another replica
/// set says so as soon as they answer, once — not "still trying" — and
/// stops there with 78: waiting cannot help, and it does not wait out
/// server selection (30 s here; before, it said "waiting will not help"
/// and then waited the 30 s).
#[tokio::test]
async fn a_replica_set_name_that_does_not_match_stops_the_command_at_once() {
    let ctx = TestContext::new("errors_set_name_wait").await;
    if external() {
        return; // the test server's set name is known; a real one's is not
    }
    let server = ctx.uri.split('/').nth(2).unwrap().to_owned();
    let uri = format!("mongodb://{server}/?replicaSet=not-this-set");
    let config = format!(
        "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"30s\"\n\
         attempt_timeout = \"40s\"\n[[collections]]\nname = \"views\"\n",
        ctx.db_name
    );
    for args in [&["incr", "k"][..], &["setup"], &["status"]] {
        let began = std::time::Instant::now();
        let output = run(&config, args).await;
        let took = began.elapsed();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(78), "{args:?}: {stderr}");
        let said: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("the connection string names replica set not-this-set"))
            .collect();
        assert_eq!(said.len(), 1, "{args:?}: {stderr}");
        assert!(said[0].contains("waiting will not help"), "{stderr}");
        assert!(
            said[0].contains("correct the replicaSet option"),
            "{stderr}"
        );
        assert!(!stderr.contains("still trying"), "{args:?}: {stderr}");
        assert!(
            took < std::time::Duration::from_secs(10),
            "{args:?} took {took:?}"
        );
    }
    let output = run(&config, &["incr", "k", "--json"]).await;
    assert_eq!(output.status.code(), Some(78), "{}", readable(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "error", "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap_or_default()
            .contains("not-this-set"),
        "{out}"
    );
}

/// `--json` answers in JSON whatever failed: a bad configuration, as a
/// collection not configured does, prints `{"outcome": "error", "error":
/// …}` on standard output (errors.md: "when the command failed before any
/// outcome"), and exits 78. (Found by a first-time user: `tallyd incr home
/// --collection nope --json` prints that object, but `tallyd -c bad.toml
/// incr home --json` prints only `invalid configuration (2 problems): …`
/// on standard error and nothing on standard output.)
#[tokio::test]
async fn json_reports_a_bad_configuration_in_json() {
    let config = "[mongodb]\nuri = \"mongodb://127.0.0.1:9/\"\ndatabase = \"app\"\n\
                  bogus_key = 1\n[[collections]]\nname = \"views\"\n";
    for args in [&["incr", "k", "--json"][..], &["status", "--json"]] {
        let output = run(config, args).await;
        assert_eq!(output.status.code(), Some(78), "{}", readable(&output));
        let out = json(&output);
        assert_eq!(out["outcome"], "error", "{args:?}: {out}");
        assert!(
            out["error"]
                .as_str()
                .unwrap_or_default()
                .contains("bogus_key"),
            "{args:?}: {out}"
        );
    }
}
