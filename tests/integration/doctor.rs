//! `tallyd doctor` against the test server: each check's verdict, the ones
//! that must fail included (a standalone server, a clock moved past the
//! margin, a user without `changeStream`), the ones that warn (a `w=1`
//! URI, a missing index), and a server with authentication and the
//! README's least-privileged role.

use std::collections::BTreeMap;
use std::process::Output;

use mongodb::bson::{Document, doc};
use serde_json::Value;

use crate::cli::{tallyd, write_config};
use crate::common::server::{
    AuthServer, ServerOptions, TestServer, create_role, create_tallyd_role,
};
use crate::common::tallyd::free_address;
use crate::common::{TestContext, external, with_options};

/// `tallyd --config <config> doctor --json <extra>`: its exit code and its
/// checks by name (`indexes:<collection>` for the index checks).
pub(crate) async fn doctor(
    config: &str,
    extra: &[&str],
) -> (Option<i32>, BTreeMap<String, Value>, Output) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), config);
    let mut args = vec!["--config", path.as_str(), "doctor", "--json"];
    args.extend_from_slice(extra);
    let output = tallyd(&args, &[]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|err| panic!("not one JSON object ({err}): {output:?}"));
    let mut checks = BTreeMap::new();
    for check in report["checks"].as_array().unwrap() {
        let name = match check["collection"].as_str() {
            Some(collection) => format!("{}:{collection}", check["name"].as_str().unwrap()),
            None => check["name"].as_str().unwrap().to_owned(),
        };
        checks.insert(name, check.clone());
    }
    let failed = checks.values().any(|c| c["verdict"] == "fail");
    assert_eq!(report["ok"], !failed, "{report}");
    (output.status.code(), checks, output)
}

/// The verdict and message of check `name`.
pub(crate) fn verdict<'a>(checks: &'a BTreeMap<String, Value>, name: &str) -> (&'a str, &'a str) {
    let check = checks
        .get(name)
        .unwrap_or_else(|| panic!("no check {name}: {checks:?}"));
    (
        check["verdict"].as_str().unwrap(),
        check["message"].as_str().unwrap(),
    )
}

fn config(uri: &str, database: &str) -> String {
    format!(
        "[mongodb]\nuri = \"{uri}\"\ndatabase = \"{database}\"\nserver_selection_timeout = \"5s\"\n\
         [[collections]]\nname = \"views\"\n"
    )
}

/// On the test server (a one-member replica set without authentication):
/// the member count is worth a warning, the write concern, the clock and
/// the privileges are fine, the oplog's short history is worth a warning;
/// exit 0. The text form says the same, one line per check.
#[tokio::test]
async fn doctor_names_each_check_with_a_verdict_and_its_cost() {
    let ctx = TestContext::new("doctor_checks").await;
    let views = ctx.client(false).await.collection("views");
    views
        .insert_one(doc! { "_id": "home", "counter": 1i64 })
        .await
        .unwrap();
    let text = config(&ctx.child_uri(false), &ctx.db_name);
    let (code, checks, _) = doctor(&text, &[]).await;
    assert_eq!(code, Some(0), "{checks:?}");
    // A real sharded cluster adds its own checks (tests/integration/sharding.rs).
    const SHARDED: [&str; 5] = [
        "shards",
        "shard_key:",
        "shard_indexes:",
        "mongos_clocks",
        "migration_pause",
    ];
    let names: Vec<&str> = checks
        .keys()
        .map(String::as_str)
        .filter(|name| !SHARDED.iter().any(|s| name.starts_with(s)))
        .collect();
    assert_eq!(
        names,
        [
            "change_stream_history",
            "clock_skew",
            "database",
            "indexes:views",
            "privileges",
            "server",
            "write_concern"
        ]
    );
    let (server, message) = verdict(&checks, "server");
    if external() {
        assert!(["ok", "warn"].contains(&server), "{message}");
    } else {
        assert_eq!(server, "warn", "{message}");
        assert!(message.contains("one data-bearing member"), "{message}");
        let (history, message) = verdict(&checks, "change_stream_history");
        assert_eq!(
            history, "warn",
            "a fresh server's oplog is short: {message}"
        );
        assert!(message.contains("rescan"), "{message}");
        let (privileges, message) = verdict(&checks, "privileges");
        assert_eq!(privileges, "ok", "{message}");
        assert!(message.contains("without authentication"), "{message}");
    }
    let (write_concern, message) = verdict(&checks, "write_concern");
    assert_eq!(write_concern, "ok", "{message}");
    assert!(
        message.contains("majority write to tally_state was acknowledged"),
        "{message}"
    );
    let (clock, message) = verdict(&checks, "clock_skew");
    assert_eq!(clock, "ok", "{message}");
    assert!(
        message.contains("11m") && message.contains("grace 15m"),
        "{message}"
    );
    // The probe document is gone again.
    let state = ctx.client(false).await.collection("tally_state");
    assert_eq!(state.count_documents(doc! {}).await.unwrap(), 0);

    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &text);
    let output = tallyd(&["--config", &path, "doctor"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let shown = String::from_utf8_lossy(&output.stdout);
    assert!(
        shown.contains("ok    clock_skew: this host's clock "),
        "{shown}"
    );
    assert!(
        shown.contains("indexes (views): no index on pending"),
        "{shown}"
    );
    assert!(
        shown.contains(&format!("{} checks:", checks.len())),
        "{shown}"
    );
    // It names where it looked first (never the password).
    let first = shown.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("MongoDB at ") && first.ends_with(&format!(", database {}", ctx.db_name)),
        "{shown}"
    );
    let (database, message) = verdict(&checks, "database");
    assert_eq!(database, "ok", "{message}");
    assert_eq!(message, format!("{} holds views", ctx.db_name));
}

/// A URI asking for `w=1` is flagged: tally overrides it for its own
/// writes, other writers using the URI are not protected. A warning: exit 0.
#[tokio::test]
async fn a_uri_asking_for_w1_is_flagged() {
    let ctx = TestContext::new("doctor_w1").await;
    let uri = with_options(&ctx.child_uri(false), "w=1");
    let (code, checks, _) = doctor(&config(&uri, &ctx.db_name), &[]).await;
    let (write_concern, message) = verdict(&checks, "write_concern");
    assert_eq!(write_concern, "warn", "{message}");
    assert!(message.contains("the URI asks for w=1"), "{message}");
    assert!(message.contains("not protected"), "{message}");
    assert!(
        !checks.values().any(|c| c["verdict"] == "fail"),
        "{checks:?}"
    );
    assert_eq!(code, Some(0));
}

/// This host's clock moved (a testing aid): 10 minutes back uses more than
/// half of the default 13-minute margin — fail, exit 1; 4 minutes ahead
/// more than a quarter — warn, exit 0.
#[tokio::test]
async fn a_clock_moved_past_half_the_margin_fails() {
    let ctx = TestContext::new("doctor_clock").await;
    let text = config(&ctx.child_uri(false), &ctx.db_name);
    let (code, checks, _) = doctor(&text, &["--clock-offset", "-10m"]).await;
    let (clock, message) = verdict(&checks, "clock_skew");
    assert_eq!(clock, "fail", "{message}");
    assert!(message.contains("behind the server's"), "{message}");
    assert!(message.contains("more than half"), "{message}");
    assert_eq!(code, Some(1));

    let (code, checks, _) = doctor(&text, &["--clock-offset", "4m"]).await;
    let (clock, message) = verdict(&checks, "clock_skew");
    assert_eq!(clock, "warn", "{message}");
    assert!(message.contains("ahead of the server's"), "{message}");
    assert!(message.contains("more than a quarter"), "{message}");
    assert_eq!(code, Some(0), "{checks:?}");
}

/// Each collection's pending and settled fields want a sparse index
/// (README's advice): flagged while there is none, ok once they are
/// created; a missing collection is said to be missing. The fields'
/// configured names count.
#[tokio::test]
async fn a_missing_index_is_flagged_until_it_is_created() {
    let ctx = TestContext::new("doctor_indexes").await;
    let client = ctx.client(false).await;
    let downloads = client.collection("downloads");
    downloads
        .insert_one(doc! { "_id": 1, "total": 0i64 })
        .await
        .unwrap();
    let text = format!(
        "{}[[collections]]\nname = \"downloads\"\npending_field = \"inflight\"\n\
         settled_field = \"done\"\n",
        config(&ctx.child_uri(false), &ctx.db_name)
    );
    let (_, checks, _) = doctor(&text, &[]).await;
    let (views, message) = verdict(&checks, "indexes:views");
    assert_eq!(views, "warn", "{message}");
    assert!(message.contains("does not exist yet"), "{message}");
    let (index, message) = verdict(&checks, "indexes:downloads");
    assert_eq!(index, "warn", "{message}");
    assert!(message.contains("no index on inflight, done"), "{message}");
    assert!(message.contains("`tallyd setup` creates"), "{message}");
    assert!(!message.contains("db."), "no shell syntax: {message}");

    for field in ["inflight", "done"] {
        let sparse = mongodb::IndexModel::builder()
            .keys(doc! { field: 1 })
            .options(
                mongodb::options::IndexOptions::builder()
                    .sparse(true)
                    .build(),
            )
            .build();
        downloads.create_index(sparse).await.unwrap();
    }
    let (_, checks, _) = doctor(&text, &[]).await;
    let (index, message) = verdict(&checks, "indexes:downloads");
    assert_eq!(index, "ok", "{message}");
    assert!(
        message.contains("on inflight") && message.contains("on done"),
        "{message}"
    );
}

/// A standalone server has no change streams: with the monitor on, the
/// server check fails (exit 1), and there is no history to measure.
#[tokio::test]
async fn a_standalone_server_fails_the_server_check() {
    if external() {
        return; // starts its own server
    }
    let server = TestServer::start(&ServerOptions {
        standalone: true,
        ..Default::default()
    });
    let (code, checks, _) = doctor(&config(&server.uri(), "t_doctor_standalone"), &[]).await;
    let (topology, message) = verdict(&checks, "server");
    assert_eq!(topology, "fail", "{message}");
    assert!(
        message.contains("standalone") && message.contains("no change streams"),
        "{message}"
    );
    let (history, message) = verdict(&checks, "change_stream_history");
    assert_eq!(history, "warn", "{message}");
    assert_eq!(code, Some(1));
}

/// A server that cannot be reached: one failed `connection` check saying
/// where and why, exit 69 (unavailable), and the URI's password is not in
/// what is printed.
#[tokio::test]
async fn an_unreachable_server_fails_the_connection_check() {
    let port = free_address().port();
    let uri = format!(
        "mongodb://tally:S3cret-pw@127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=1000"
    );
    let text = format!(
        "[mongodb]\nuri = \"{uri}\"\ndatabase = \"app\"\nserver_selection_timeout = \"1s\"\n\
         attempt_timeout = \"3s\"\n[[collections]]\nname = \"views\"\n"
    );
    let (code, checks, output) = doctor(&text, &[]).await;
    assert_eq!(code, Some(69));
    let (connection, message) = verdict(&checks, "connection");
    assert_eq!(connection, "fail", "{message}");
    assert_eq!(
        message,
        format!(
            "[mongodb] uri: no server could be selected within 1s at 127.0.0.1:{port} \
             (connection refused): nothing listens there; check the host and port of the \
             connection string, or start MongoDB"
        )
    );
    assert_eq!(checks.len(), 1, "{checks:?}");
    let printed = format!("{output:?}");
    assert!(!printed.contains("S3cret-pw"), "{printed}");
}

/// A counter in `views`, and each `(user, role)` with the password
/// `Pw-of-doctor`.
async fn views_and_users(app: &mongodb::Database, users: &[(&str, &str)]) {
    app.collection::<Document>("views")
        .insert_one(doc! { "_id": "home", "counter": 0i64 })
        .await
        .unwrap();
    for (user, role) in users {
        app.run_command(doc! { "createUser": *user, "pwd": "Pw-of-doctor", "roles": [*role] })
            .await
            .unwrap();
    }
}

/// On a server with authentication: a user holding exactly the README's
/// smallest role passes the privilege check (the checks that need more —
/// listing indexes, reading the oplog — say "unknown"); a user whose role
/// lacks `changeStream` fails it, named, exit 1. Passwords never appear.
#[tokio::test]
async fn the_least_privileged_role_passes_and_one_without_change_stream_fails() {
    if external() {
        return; // starts its own server with authentication
    }
    let db = "t_doctor_privileges";
    let server = AuthServer::start(|client| async move {
        let app = client.database(db);
        create_tallyd_role(&app, "tallyd", &["find", "update", "changeStream"]).await;
        create_tallyd_role(&app, "nochange", &["find", "update"]).await;
        views_and_users(&app, &[("tally", "tallyd"), ("partial", "nochange")]).await;
    })
    .await;
    let uri = |user: &str| server.uri(user, "Pw-of-doctor", db);

    let (code, checks, output) = doctor(&config(&uri("tally"), db), &[]).await;
    let (privileges, message) = verdict(&checks, "privileges");
    assert_eq!(privileges, "ok", "{message}");
    assert!(message.contains("tally@t_doctor_privileges"), "{message}");
    let (write_concern, message) = verdict(&checks, "write_concern");
    assert_eq!(write_concern, "ok", "{message}");
    for name in ["indexes:views", "change_stream_history"] {
        let (verdict, message) = verdict(&checks, name);
        assert_eq!(verdict, "warn", "{message}");
        assert!(
            message.starts_with("unknown: this user may not"),
            "{message}"
        );
    }
    assert_eq!(code, Some(0), "{checks:?}");
    assert!(!format!("{output:?}").contains("Pw-of-doctor"));

    let (code, checks, output) = doctor(&config(&uri("partial"), db), &[]).await;
    let (privileges, message) = verdict(&checks, "privileges");
    assert_eq!(privileges, "fail", "{message}");
    assert!(
        message.contains("partial@t_doctor_privileges lacks"),
        "{message}"
    );
    assert!(
        message.contains("changeStream on t_doctor_privileges.views"),
        "{message}"
    );
    assert!(!message.contains("find on"), "{message}");
    assert_eq!(code, Some(1));
    assert!(!format!("{output:?}").contains("Pw-of-doctor"));
}

/// With a ledger configured, the privilege check covers its collections
/// too: a role holding the README's ledger grants passes (and notes that
/// `tallyd setup` needs createIndex); one without `remove` on the events
/// collection (the fold deletes folded events past the window) fails,
/// naming the collection and the action, exit 1.
#[tokio::test]
async fn the_privilege_check_covers_the_ledgers_collections() {
    if external() {
        return; // starts its own server with authentication
    }
    let db = "t_doctor_ledger_privileges";
    let server = AuthServer::start(|client| async move {
        let app = client.database(db);
        let counter: &[&str] = &["find", "update", "changeStream", "insert"];
        let state: &[&str] = &["find", "insert", "update", "remove"];
        let database: &[&str] = &["listCollections"];
        for (role, events) in [
            ("ledger", &["find", "remove", "changeStream", "collMod"][..]),
            ("noremove", &["find", "changeStream", "collMod"][..]),
        ] {
            let grants = [
                ("views", counter),
                ("views_events", events),
                ("views_events_fold", state),
                ("", database),
            ];
            create_role(&app, role, &grants).await;
        }
        views_and_users(&app, &[("ledger", "ledger"), ("noremove", "noremove")]).await;
    })
    .await;
    let with_ledger = |user: &str| {
        let uri = server.uri(user, "Pw-of-doctor", db);
        config(&uri, db).replace("name = \"views\"\n", "name = \"views\"\nledger = true\n")
    };

    let (code, checks, output) = doctor(&with_ledger("noremove"), &[]).await;
    let (privileges, message) = verdict(&checks, "privileges");
    assert_eq!(privileges, "fail", "{message}");
    assert!(
        message.contains("remove on t_doctor_ledger_privileges.views_events ("),
        "{message}"
    );
    assert_eq!(
        message.matches(" on t_doctor_ledger_privileges.").count(),
        1,
        "{message}"
    );
    assert_eq!(code, Some(1));
    assert!(!format!("{output:?}").contains("Pw-of-doctor"));

    let (_, checks, _) = doctor(&with_ledger("ledger"), &[]).await;
    let (privileges, message) = verdict(&checks, "privileges");
    assert_eq!(privileges, "ok", "{message}");
    assert!(message.contains("createIndex"), "{message}");
}
