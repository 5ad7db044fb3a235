//! `tallyd run` stops at once at SIGTERM, whatever MongoDB does: while it
//! waits for a server that does not answer (with the default 30 s server
//! selection), and while one of its writes is in flight and the server
//! holds the reply (the monitor's save of a change-stream position is
//! abandoned and made again, not waited out for an attempt timeout).

use std::time::{Duration, Instant};

use mongodb::bson::doc;

use crate::common::proxy::{Action, Proxy, Rule, upstream_of};
use crate::common::tallyd::{Tallyd, free_address};
use crate::common::{TestContext, wait_until};
use crate::daemon::LONG;

/// How soon a stop must end here: far below every timeout in play (30 s
/// server selection, 10 s attempts, the 30 s drain).
const PROMPT: Duration = Duration::from_secs(5);

/// Nothing listens on the port: the daemon says at once that MongoDB does
/// not answer, and a SIGTERM in the middle of a 30 s server selection ends
/// it at once, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_for_mongodb_stops_at_once() {
    let port = free_address().port();
    let config = format!(
        "[mongodb]\nuri = \"mongodb://127.0.0.1:{port}/?directConnection=true\"\n\
         database = \"t_stop_waiting\"\n[[collections]]\nname = \"views\"\n"
    );
    let mut daemon = Tallyd::start(&config, &[("RUST_LOG", "info")]);
    let said = format!("MongoDB at 127.0.0.1:{port} has not answered for 1s (connection refused)");
    wait_until("the daemon to say why it waits", LONG, || async {
        daemon.log().contains(&said)
    })
    .await;
    let stopped = Instant::now();
    daemon.signal("TERM");
    let status = daemon.wait(PROMPT);
    assert_eq!(status.code(), Some(0), "{}", daemon.log());
    assert!(stopped.elapsed() < PROMPT, "{:?}", stopped.elapsed());
}

/// The monitor's save of its stream position is in flight and the server
/// holds the reply (20 s, longer than the 10 s attempt bound): a SIGTERM
/// abandons it and saves the position again — exit 0 within seconds, the
/// position saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_abandons_a_save_in_flight_and_saves_again() {
    let ctx = TestContext::new("stop_save_in_flight").await;
    let views = ctx.client(false).await.collection("views");
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let _held = proxy.rule(
        Rule::command("update")
            .collection("tally_state")
            .nth(1)
            .then(Action::DelayReply(Duration::from_secs(20))),
    );
    let config = format!(
        "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"2s\"\n\
         attempt_timeout = \"10s\"\n[writer]\nretry_horizon = \"20s\"\n[reconcile]\n\
         grace = \"40s\"\n[alerts]\nstuck_after = \"40s\"\n[schedule]\ncron = \"0 30 3 * * *\"\n\
         catch_up = false\n[monitor]\nsave_interval = \"200ms\"\n[[collections]]\n\
         name = \"views\"\n",
        ctx.child_uri_through(&proxy, false),
        ctx.db_name
    );
    let mut daemon = Tallyd::start(&config, &[("RUST_LOG", "info")]);
    daemon.wait_ready("active", LONG).await;
    views.insert_one(doc! { "_id": "moved" }).await.unwrap();
    proxy
        .wait_until("a position save held by the server", LONG, |log| {
            log.iter().any(|e| {
                matches!(e.action, Some(Action::DelayReply(_)))
                    && e.reached_server
                    && !e.reply_delivered
            })
        })
        .await;
    let stopped = Instant::now();
    daemon.signal("TERM");
    let status = daemon.wait(PROMPT);
    let log = daemon.log();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(stopped.elapsed() < PROMPT, "{:?}\n{log}", stopped.elapsed());
    // The last save went through: a second save reached the server and
    // was answered, and nothing is reported unsaved.
    let saves: Vec<_> = proxy
        .requests("update")
        .into_iter()
        .filter(|e| e.collection.as_deref() == Some("tally_state"))
        .collect();
    assert!(
        saves.iter().any(|e| e.action.is_none() && e.server_replied),
        "{saves:#?}\n{log}"
    );
    assert!(!log.contains("could not be saved"), "{log}");
    let state = ctx.client(false).await.collection("tally_state");
    let saved = state
        .count_documents(doc! { "_id": "resume:views" })
        .await
        .unwrap();
    assert_eq!(saved, 1, "{log}");
}
