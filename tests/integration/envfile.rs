//! `tallyd --env-file PATH`: the environment file systemd's unit reads,
//! read the way systemd reads it — a URI with `&` and a token with a space
//! arrive whole, where the shell recipe the README used to give (`set -a;
//! . tallyd.env`) cuts the URI at its `&` and loses it.

use std::process::Output;
use std::time::Duration;

use mongodb::bson::doc;

use crate::cli::{json, text, write_config};
use crate::common::server::{AuthServer, create_views_user};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, counter, external, wait_until};
use crate::daemon::{Conf, LONG, seed_stale};

/// Writes `text` as `tallyd.env` in `dir`; returns its path.
fn write_env_file(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("tallyd.env");
    std::fs::write(&path, text).expect("write the environment file");
    path.display().to_string()
}

/// `sh -c "<script>"` with a clean environment: the shell recipe.
async fn shell(script: &str) -> Output {
    tokio::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .await
        .expect("run sh")
}

/// The URI in the environment file needs what follows its `&`
/// (`authSource=app`: the user is defined there): with `--env-file` the
/// command reaches the server as that user and counts; the shell recipe
/// runs the assignment before `&` in the background, so the URI never
/// reaches `tallyd`, which goes on with the configuration file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uri_with_an_ampersand_arrives_whole_where_a_shell_loses_it() {
    if external() {
        return; // needs a server with authentication
    }
    let server = AuthServer::start(|client| async move {
        let actions = ["find", "insert", "update"];
        create_views_user(&client.database("app"), "writer", "Pw-of-writer", &actions).await;
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let uri = server.uri("writer", "Pw-of-writer", "app");
    assert!(uri.contains("&authSource=app"), "{uri}");
    let env_file = write_env_file(
        dir.path(),
        &format!("# secrets of tallyd\nTALLYD__MONGODB__URI={uri}\n"),
    );
    // The file's own URI: a port nothing listens on.
    let closed = free_address().port();
    let config = write_config(
        dir.path(),
        &format!(
            "[mongodb]\nuri = \"mongodb://127.0.0.1:{closed}/?directConnection=true\"\n\
             database = \"app\"\nserver_selection_timeout = \"1s\"\nattempt_timeout = \"3s\"\n\
             [writer]\nretry_horizon = \"6s\"\n[reconcile]\ngrace = \"10s\"\n[alerts]\n\
             stuck_after = \"10s\"\n[[collections]]\nname = \"views\"\n"
        ),
    );
    let tallyd = env!("CARGO_BIN_EXE_tallyd");
    let output = crate::cli::tallyd(
        &[
            "--env-file",
            &env_file,
            "--config",
            &config,
            "incr",
            "k",
            "--json",
        ],
        &[],
    )
    .await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "counted");
    let shown = crate::cli::tallyd(
        &["--env-file", &env_file, "--config", &config, "check-config"],
        &[],
    )
    .await;
    let shown = text(&shown);
    assert!(
        shown.contains("writer:****@") && shown.contains("&authSource=app"),
        "{shown}"
    );
    assert!(!shown.contains("Pw-of-writer"), "{shown}");

    let recipe = format!("set -a; . '{env_file}'; exec '{tallyd}' --config '{config}' incr k");
    let output = shell(&recipe).await;
    assert_eq!(
        output.status.code(),
        Some(69),
        "the shell lost the URI and tallyd used the file's: {}",
        text(&output)
    );
    let admin = mongodb::Client::with_uri_str(server.uri("writer", "Pw-of-writer", "app"))
        .await
        .unwrap();
    assert_eq!(
        counter(&admin.database("app").collection("views"), "k").await,
        1
    );
}

/// The webhook's token has a space (`Bearer …`): the daemon started with
/// `--env-file` sends it whole as the Authorization header of its alerts.
/// (A shell reading the same line runs the token's second word as a
/// command and sets nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_with_a_space_arrives_whole() {
    let ctx = TestContext::new("envfile_token").await;
    let views = ctx.client(false).await.collection("views");
    let receiver = crate::common::receiver::Receiver::start(0).await;
    let dir = tempfile::tempdir().unwrap();
    let env_file = write_env_file(
        dir.path(),
        "# the webhook's whole Authorization header\nHOOK_TOKEN=Bearer t0k en  \n",
    );
    let output = shell(&format!("set -a; . '{env_file}'; echo \"[$HOOK_TOKEN]\"")).await;
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "[]",
        "a shell does not set it: {}",
        text(&output)
    );
    let conf = Conf {
        extra: format!(
            "[alerts]\nstuck_after = \"10s\"\n[alerts.webhook]\nurl = \"http://{}/hook\"\n\
             auth_header_env = \"HOOK_TOKEN\"\n",
            receiver.addr
        ),
        ..Conf::idle()
    };
    let daemon = Tallyd::start_with(
        &conf.render(&ctx.child_uri(false), &ctx.db_name),
        &[("RUST_LOG", "info")],
        free_address(),
        &["--env-file".as_ref(), env_file.as_ref()],
    );
    daemon.wait_ready("active", LONG).await;
    seed_stale(&views, 0..1).await;
    wait_until(
        "the stuck-token alert delivered",
        Duration::from_secs(60),
        || async { !receiver.delivered().is_empty() },
    )
    .await;
    let requests = receiver.requests();
    assert!(
        requests
            .iter()
            .all(|r| r.authorization.as_deref() == Some("Bearer t0k en")),
        "{:?}",
        requests
            .iter()
            .map(|r| &r.authorization)
            .collect::<Vec<_>>()
    );
    assert!(
        !daemon.log().contains("t0k en"),
        "the token is never logged"
    );
}
