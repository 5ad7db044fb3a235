//! Settling one increment again and again — `tallyd resume` and `tallyd
//! complete` run by separate processes, repeated, concurrent, in any order —
//! counts it exactly once: the settle marker makes every settle after the
//! first a no-op, and a settle given the wrong amount is refused without
//! writing. The tickets resumed are an unknown increment's, as an
//! application prints them (`Counters::ticket`).
//!
//! The oracle is the number of increments made: each test makes one (or
//! writes its step 1 directly) and expects the counter to move by exactly its
//! amount.

use std::process::Output;

use futures::future::join_all;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use serde_json::Value;
use tally::{CollectionConfig, Counters, Increment, Token, UnknownToken, WriterConfig};

use crate::cli::{json, resume_ticket, tallyd, text, write_config};
use crate::common::{FailPoint, TestContext, counter, field};

/// A test's config file and the arguments every command shares.
struct Cli {
    _dir: tempfile::TempDir,
    path: String,
    store: tally::Store,
}

impl Cli {
    async fn new(ctx: &TestContext) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), &ctx.config_toml(false, ""));
        let store = ctx.client(false).await.store();
        Self {
            _dir: dir,
            path,
            store,
        }
    }

    /// The ticket of an unknown increment of `by` to `views/key` whose
    /// token is `token`.
    fn ticket(&self, key: &str, token: Token, by: i64) -> String {
        resume_ticket(&self.store, "views", key, token, by)
    }

    /// `tallyd <command> <key> <ticket> [--by N] --collection views --json`.
    async fn run(&self, command: &str, key: &str, ticket: &str, by: Option<i64>) -> Output {
        let by = by.map(|n| n.to_string());
        let mut args = vec!["--config", &self.path, command, key, ticket];
        if let Some(by) = &by {
            args.extend(["--by", by]);
        }
        args.extend(["--collection", "views", "--json"]);
        tallyd(&args, &[]).await
    }
}

/// A test's database, its `tallyd` config, and its `views` collection
/// read directly.
async fn setup(name: &str) -> (TestContext, Cli, Collection<Document>) {
    let ctx = TestContext::new(name).await;
    let cli = Cli::new(&ctx).await;
    let views = ctx.client(false).await.collection("views");
    (ctx, cli, views)
}

/// `--json` output: exit status and outcome.
fn outcome(output: &Output) -> (Option<i32>, Value) {
    (output.status.code(), json(output))
}

fn assert_counted_once(outputs: &[Output], amount: i64) {
    for output in outputs {
        let (code, out) = outcome(output);
        assert_eq!(code, Some(0), "{}", text(output));
        assert_eq!(out["outcome"], "counted", "{}", text(output));
        assert_eq!(out["amount"], amount, "{}", text(output));
    }
    let fresh = outputs
        .iter()
        .filter(|o| json(o)["settled_earlier"] == false)
        .count();
    assert!(fresh <= 1, "{fresh} runs say they counted it");
}

fn assert_refused(output: &Output, amount: i64) {
    let (code, out) = outcome(output);
    assert_eq!(
        (code, out["outcome"].as_str()),
        (Some(1), Some("refused")),
        "{}",
        text(output)
    );
    assert_eq!(out["amount"], amount);
}

/// Resumes one unknown token `runs` times, one after another or all at
/// once, and checks the counter moved by the amount exactly once.
async fn resume_repeatedly(name: &str, step_1_landed: bool, runs: usize, concurrent: bool) {
    let ctx = TestContext::new(name).await;
    let cli = Cli::new(&ctx).await;
    let views = ctx.client(false).await.collection("views");
    views
        .insert_one(doc! { "_id": "k", "counter": 10i64 })
        .await
        .unwrap();
    let token = Token::new();
    let ticket = cli.ticket("k", token, 3);
    if step_1_landed {
        views
            .update_one(
                doc! { "_id": "k" },
                doc! { "$addToSet": { "pending": { "t": token.object_id(), "n": 3i64 } } },
            )
            .await
            .unwrap();
    }
    let outputs: Vec<Output> = if concurrent {
        join_all((0..runs).map(|_| cli.run("resume", "k", &ticket, Some(3)))).await
    } else {
        let mut outputs = Vec::new();
        for _ in 0..runs {
            outputs.push(cli.run("resume", "k", &ticket, Some(3)).await);
        }
        outputs
    };
    assert_counted_once(&outputs, 3);
    assert_eq!(
        counter(&views, "k").await,
        13,
        "{name}: {runs} resumes (concurrent: {concurrent})"
    );
    assert_eq!(field(&views, "k", "pending").await, None, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_a_token_that_never_landed_1_2_5_times_counts_it_once() {
    for runs in [1, 2, 5] {
        resume_repeatedly(&format!("resume_absent_seq_{runs}"), false, runs, false).await;
        resume_repeatedly(&format!("resume_absent_con_{runs}"), false, runs, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_a_token_whose_step_1_landed_1_2_5_times_counts_it_once() {
    for runs in [1, 2, 5] {
        resume_repeatedly(&format!("resume_landed_seq_{runs}"), true, runs, false).await;
        resume_repeatedly(&format!("resume_landed_con_{runs}"), true, runs, true).await;
    }
}

/// `incr` whose step 2 is refused: pending, with its token in the
/// document; its token and the ticket it printed.
async fn pending_increment(ctx: &TestContext, cli: &Cli) -> (Token, String) {
    let _fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "skip": 1, "times": 1 }),
        doc! { "failCommands": ["update"], "errorCode": 2 },
    )
    .await;
    let output = tallyd(
        &[
            "--config",
            &cli.path,
            "incr",
            "k",
            "--by",
            "2",
            "--collection",
            "views",
            "--json",
        ],
        &[],
    )
    .await;
    let (code, out) = outcome(&output);
    assert_eq!((code, out["outcome"].as_str()), (Some(75), Some("pending")));
    assert_eq!(out["amount"], 2);
    let token = out["token"].as_str().unwrap().parse().unwrap();
    (token, out["ticket"].as_str().unwrap().to_owned())
}

/// An unknown increment whose step 1 landed, completed and then resumed
/// (an operator unsure whether it worked, with its ticket): counted once.
#[tokio::test]
async fn complete_then_resume_counts_once() {
    let (_ctx, cli, views) = setup("settle_complete_then_resume").await;
    let token = Token::new();
    let ticket = cli.ticket("k", token, 2);
    views
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": { "t": token.object_id(), "n": 2i64 } } },
        )
        .upsert(true)
        .await
        .unwrap();
    let completed = cli.run("complete", "k", &ticket, Some(2)).await;
    assert_eq!(outcome(&completed).1["settled_earlier"], false);
    let resumed = cli.run("resume", "k", &ticket, Some(2)).await;
    assert_counted_once(&[completed, resumed], 2);
    assert_eq!(counter(&views, "k").await, 2);
}

#[tokio::test]
async fn resume_then_complete_counts_once() {
    let (_ctx, cli, views) = setup("settle_resume_then_complete").await;
    let ticket = cli.ticket("k", Token::new(), 4);
    let resumed = cli.run("resume", "k", &ticket, Some(4)).await;
    assert_eq!(outcome(&resumed).1["settled_earlier"], false);
    let completed = cli.run("complete", "k", &ticket, Some(4)).await;
    assert_eq!(outcome(&completed).1["settled_earlier"], true);
    assert_counted_once(&[resumed, completed], 4);
    assert_eq!(counter(&views, "k").await, 4);
}

/// A resume whose ticket says +5 for a token the document holds with +2
/// (pending, or its marker): refused, nothing written. (A printed ticket
/// given `--by 5` is refused by its check before anything is read.)
#[tokio::test]
async fn resume_with_another_amount_is_refused_and_writes_nothing() {
    let (ctx, cli, views) = setup("settle_wrong_amount").await;
    let snapshot = || async { views.find_one(doc! { "_id": "k" }).await.unwrap() };
    // The document holds the token (its step 1 landed, +2).
    let (token, printed) = pending_increment(&ctx, &cli).await;
    let five = cli.ticket("k", token, 5);
    let before: Option<Document> = snapshot().await;
    assert_refused(&cli.run("resume", "k", &five, Some(5)).await, 5);
    assert_refused(&cli.run("resume", "k", &printed, Some(5)).await, 5);
    assert_eq!(snapshot().await, before, "nothing written");
    // The document holds its marker (a settle counted it).
    let completed = cli.run("complete", "k", &printed, Some(2)).await;
    assert_counted_once(&[completed], 2);
    let before = snapshot().await;
    assert_refused(&cli.run("resume", "k", &five, Some(5)).await, 5);
    assert_eq!(snapshot().await, before, "nothing written");
    assert_eq!(counter(&views, "k").await, 2);
}

/// The original step 1, held up in the network, lands after a resume
/// counted the token: the token is pending again, but its marker says it
/// was counted, so no settle counts it again.
#[tokio::test]
async fn a_delayed_original_step_1_never_makes_a_settle_count_again() {
    let (_ctx, cli, views) = setup("settle_delayed_step1").await;
    let token = Token::new();
    let ticket = cli.ticket("k", token, 3);
    let resumed = cli.run("resume", "k", &ticket, Some(3)).await;
    assert_eq!(outcome(&resumed).1["settled_earlier"], false);
    views
        .update_one(
            doc! { "_id": "k" },
            doc! { "$addToSet": { "pending": { "t": token.object_id(), "n": 3i64 } } },
        )
        .await
        .unwrap();
    let again = cli.run("resume", "k", &ticket, Some(3)).await;
    let completed = cli.run("complete", "k", &ticket, Some(3)).await;
    assert_counted_once(&[resumed, again, completed], 3);
    assert_eq!(counter(&views, "k").await, 3);
}

/// `views` on `client`.
fn counters(client: &crate::common::TestClient) -> Counters {
    Counters::new(
        &client.store(),
        CollectionConfig::new("views"),
        WriterConfig::default(),
    )
}

/// Runs `settle` with its first update held for 2 s and then refused
/// (error 2, BadValue); while it is held, `other` (another host) counts the
/// same ticket, and must say it counted it.
async fn refused_while_another_host_counts<T: Send + 'static>(
    ctx: &TestContext,
    here: &crate::common::TestClient,
    settle: impl Future<Output = T> + Send + 'static,
    other: impl Future<Output = Increment>,
) -> T {
    let _fail = FailPoint::set(
        ctx,
        Bson::Document(doc! { "times": 1 }),
        doc! { "failCommands": ["update"], "blockConnection": true, "blockTimeMS": 2000,
        "errorCode": 2 },
    )
    .await;
    let held = tokio::spawn(settle);
    crate::common::wait_until(
        "this host's update sent",
        std::time::Duration::from_secs(10),
        || async { here.events.count("update") >= 1 },
    )
    .await;
    let counted = other.await;
    assert!(
        matches!(&counted, Increment::Counted(c) if !c.settled_earlier()),
        "{counted:?}"
    );
    held.await.unwrap()
}

fn assert_counted_earlier(outcome: &Increment, amount: i64) {
    assert!(
        matches!(outcome, Increment::Counted(c) if c.settled_earlier() && c.amount() == amount),
        "{outcome:?}"
    );
}

/// A `resume` whose own step 1 is refused (a command error) while another
/// host's resume counts the same ticket says counted, settled earlier — not
/// "not counted", which would invite the application to make the increment
/// again. The refused step 1 applied nothing, but the document shows the
/// ticket counted; without that a `resume` hands the ticket back as unknown
/// (resume again later), never as not counted: another host, or the
/// original step 1 held up in the network, may still add it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_whose_step_1_is_refused_while_another_host_counts_the_ticket_says_counted() {
    let ctx = TestContext::new("settle_refused_resume").await;
    let (here, there) = (ctx.client(false).await, ctx.client(false).await);
    let token = Token::new();
    let ticket = move || UnknownToken::new("k", token, 3).unwrap();
    let views = counters(&here);
    let resume = async move { views.resume(ticket()).await };
    let other = async { counters(&there).resume(ticket()).await.unwrap() };
    let outcome = refused_while_another_host_counts(&ctx, &here, resume, other).await;
    assert_counted_earlier(&outcome.unwrap(), 3);
    let coll = ctx.client(false).await.collection("views");
    assert_eq!(counter(&coll, "k").await, 3);
}

/// A `complete` whose step 2 is refused while another host's `complete`
/// counts the token says counted, settled earlier — not pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_whose_step_2_is_refused_while_another_host_counts_the_token_says_counted() {
    let ctx = TestContext::new("settle_refused_complete").await;
    let (here, there) = (ctx.client(false).await, ctx.client(false).await);
    let coll = ctx.client(false).await.collection("views");
    let token = Token::new();
    coll.insert_one(doc! { "_id": "k", "counter": 0i64,
    "pending": [{ "t": token.object_id(), "n": 3i64 }] })
        .await
        .unwrap();
    let views = counters(&here);
    let pending = views.find_pending("k", token).await.unwrap().unwrap();
    here.events.clear();
    let complete = async move { Increment::from(views.complete(pending).await) };
    let other = async {
        let there = counters(&there);
        let pending = there.find_pending("k", token).await.unwrap().unwrap();
        there.complete(pending).await.into()
    };
    let outcome = refused_while_another_host_counts(&ctx, &here, complete, other).await;
    assert_counted_earlier(&outcome, 3);
    assert_eq!(counter(&coll, "k").await, 3);
}
