//! The tickets `tallyd` prints and takes back (issue 19): a ticket names
//! its collection, key and amount through its check, so `resume` and
//! `complete` given another one refuse it — exit 1 — before anything is
//! read or written; `resume` takes only a checked ticket, of an unknown
//! increment (a pending or counted one's could be counted twice), and its
//! shape says the protocol; every printed hint, run as printed, settles its
//! increment once.
//!
//! The oracles: the black-pipe proxy's log (a refused command sent nothing
//! that names a collection), the documents before and after, and the
//! number of increments made.

use std::process::Output;

use mongodb::Collection;
use mongodb::bson::{Document, doc};
use serde_json::Value;

use crate::cli::{hint, hint_args, hint_command, json, tallyd, text, write_config};
use crate::common::proxy::{Action, Proxy, Rule, RuleGuard, upstream_of};
use crate::common::{TestContext, counter, pending_len};

/// What happens to updates on `views`, by their number from 1.
type Faults = [(u64, Action)];

/// Step 1 and its retry cut before they reach the server: unknown.
fn step_1_lost() -> [(u64, Action); 2] {
    [1, 2].map(|n| (n, Action::CloseBeforeForwarding))
}

/// A test's database, a proxy every `tallyd` goes through, and a
/// configuration with two collections, `views` and `clicks`.
struct Rig {
    _ctx: TestContext,
    proxy: Proxy,
    _dir: tempfile::TempDir,
    path: String,
    views: Collection<Document>,
    clicks: Collection<Document>,
}

impl Rig {
    async fn new(name: &str, extra: &str) -> Self {
        let ctx = TestContext::new(name).await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let config = format!(
            "[mongodb]\nuri = \"{}\"\ndatabase = \"{}\"\nserver_selection_timeout = \"10s\"\n\
             {extra}\n[[collections]]\nname = \"views\"\n[[collections]]\nname = \"clicks\"\n",
            ctx.child_uri_through(&proxy, false),
            ctx.db_name
        );
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), &config);
        let client = ctx.client(false).await;
        let (views, clicks) = (client.collection("views"), client.collection("clicks"));
        Self {
            _ctx: ctx,
            proxy,
            _dir: dir,
            path,
            views,
            clicks,
        }
    }

    /// `tallyd --config PATH ARGS`.
    async fn run(&self, args: &[&str]) -> Output {
        let mut all = vec!["--config", self.path.as_str()];
        all.extend_from_slice(args);
        tallyd(&all, &[]).await
    }

    /// Installs `faults` until the guards are dropped.
    fn faults(&self, faults: &Faults) -> Vec<RuleGuard> {
        faults
            .iter()
            .map(|(n, action)| {
                let rule = Rule::command("update").collection("views").nth(*n);
                self.proxy.rule(rule.then(action.clone()))
            })
            .collect()
    }

    /// `tallyd incr KEY --by N --collection views --json [flags]` through
    /// `faults`: its exit code and outcome must be `expected`; its ticket,
    /// which starts with its token.
    async fn incr(
        &self,
        key: &str,
        by: i64,
        flags: &[&str],
        faults: &Faults,
        expected: (i32, &str),
    ) -> String {
        let by = by.to_string();
        let mut args = vec!["incr", key, "--by", &by, "--collection", "views", "--json"];
        args.extend_from_slice(flags);
        let output = {
            let _faults = self.faults(faults);
            self.run(&args).await
        };
        let out = json(&output);
        let outcome = (output.status.code(), out["outcome"].as_str());
        assert_eq!(outcome, (Some(expected.0), Some(expected.1)), "{out}");
        let ticket = out["ticket"].as_str().expect("a ticket").to_owned();
        let token = out["token"].as_str().expect("a token");
        assert!(ticket.starts_with(token), "{out}");
        ticket
    }

    /// `tallyd complete home TICKET [--by N] --collection views --json`.
    async fn complete(&self, ticket: &str, by: Option<&str>) -> Output {
        let mut args = vec!["complete", "home", ticket];
        if let Some(by) = by {
            args.extend(["--by", by]);
        }
        args.extend(["--collection", "views", "--json"]);
        self.run(&args).await
    }

    /// Every document of both collections.
    async fn snapshot(&self) -> Vec<Document> {
        let mut all = Vec::new();
        for coll in [&self.views, &self.clicks] {
            let mut found = coll.find(doc! {}).sort(doc! { "_id": 1 }).await.unwrap();
            while found.advance().await.unwrap() {
                all.push(found.deserialize_current().unwrap());
            }
        }
        all
    }

    /// The commands sent through the proxy that name a collection (a read
    /// or a write of documents), since the log was cleared.
    fn document_commands(&self) -> Vec<String> {
        self.proxy
            .log()
            .iter()
            .filter(|e| e.collection.is_some())
            .map(|e| format!("{:?} on {:?}", e.command, e.collection))
            .collect()
    }
}

/// A refusal in `--json`: exit 1, outcome `refused`, the ticket as given,
/// and a message containing `says`.
fn assert_refused(output: &Output, ticket: &str, says: &str) {
    assert_eq!(output.status.code(), Some(1), "{}", text(output));
    let out = json(output);
    assert_eq!(out["outcome"], "refused", "{out}");
    assert_eq!(out["ticket"], ticket, "{out}");
    let message = out["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{says:?} not in {out}");
}

/// The case of the issue: `incr home` printed a ticket, and `resume k1
/// TICKET` — a key pasted wrong — counted `k1 +1`. Now every ticket (a
/// counted and an unknown two-step increment's, a lane's) given another
/// key, amount or collection is refused by `resume`, and the two-step
/// ones by `complete`: exit 1, before anything is read or written.
#[tokio::test]
async fn a_ticket_given_another_key_amount_or_collection_is_refused_before_anything_is_sent() {
    let rig = Rig::new("ticket_wrong_target", "").await;
    let counted = rig.incr("home", 3, &[], &[], (0, "counted")).await;
    let unknown = rig
        .incr("home", 3, &[], &step_1_lost(), (75, "unknown"))
        .await;
    let lane = rig.incr("home", 3, &["--lane"], &[], (0, "counted")).await;
    assert!(
        lane.contains(".1-"),
        "a lane's ticket carries its number: {lane}"
    );

    let before = rig.snapshot().await;
    rig.proxy.clear_log();
    for ticket in [&counted, &unknown, &lane] {
        let cases = [
            (["k1", "--by", "3", "--collection", "views"], "views/k1 +3"),
            (
                ["home", "--by", "4", "--collection", "views"],
                "views/home +4",
            ),
            (
                ["home", "--by", "3", "--collection", "clicks"],
                "clicks/home +3",
            ),
            (
                ["home", "--by", "1", "--collection", "views"],
                "views/home +1",
            ),
        ];
        for (rest, named) in cases {
            let mut args = vec!["resume", rest[0], ticket.as_str()];
            args.extend_from_slice(&rest[1..]);
            args.push("--json");
            let output = rig.run(&args).await;
            assert_refused(&output, ticket, &format!("was not printed for {named}"));
        }
    }
    for ticket in [&counted, &unknown] {
        let args = [
            "complete",
            "k1",
            ticket,
            "--by",
            "3",
            "--collection",
            "views",
            "--json",
        ];
        let output = rig.run(&args).await;
        assert_refused(&output, ticket, "was not printed for views/k1 +3");
    }
    // As text: one line on standard error that names what was given.
    let output = rig
        .run(&[
            "resume",
            "k1",
            &unknown,
            "--by",
            "3",
            "--collection",
            "views",
        ])
        .await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(output.stdout.is_empty(), "{}", text(&output));
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(said.starts_with("refused: "), "{said}");
    assert!(said.contains("was not printed for views/k1 +3"), "{said}");
    assert!(said.contains("nothing was written"), "{said}");

    assert_eq!(rig.document_commands(), Vec::<String>::new());
    assert_eq!(rig.snapshot().await, before, "nothing was written");
    assert_eq!(counter(&rig.views, "home").await, 6);
    let k1 = rig.views.find_one(doc! { "_id": "k1" }).await.unwrap();
    assert_eq!(k1, None, "k1 was not created");
}

/// A resume re-sends step 1 when the document shows neither the token nor
/// its marker — which proves nothing for a counted token (an increment
/// whose step 1 went through at once leaves no marker) or a pending one
/// whose step 2 applied unseen: resuming either counted it again. Their
/// tickets are refused by `resume` (exit 1, nothing written, naming
/// `complete`), and `complete`, which only counts a pending token, settles
/// them harmlessly.
#[tokio::test]
async fn a_counted_or_pending_increments_ticket_is_never_resumed() {
    let rig = Rig::new("ticket_not_resumable", "").await;
    let counted = rig.incr("home", 1, &[], &[], (0, "counted")).await;
    // Step 2 applies, but its reply is lost, and so is its retry's.
    let lost = [2, 3].map(|n| (n, Action::DropReply));
    let pending = rig.incr("home", 2, &[], &lost, (75, "pending")).await;
    assert_eq!(counter(&rig.views, "home").await, 3, "step 2 applied");
    assert_eq!(pending_len(&rig.views, "home").await, 0);

    let before = rig.snapshot().await;
    rig.proxy.clear_log();
    for (ticket, by) in [(&counted, "1"), (&pending, "2")] {
        for protocol in [&[][..], &["--two-step"]] {
            let mut args = vec!["resume", "home", ticket, "--by", by];
            args.extend_from_slice(protocol);
            args.extend(["--collection", "views", "--json"]);
            let output = rig.run(&args).await;
            assert_refused(&output, ticket, "pending or counted");
            let message = json(&output)["error"]["message"].to_string();
            assert!(message.contains("tallyd complete"), "{message}");
        }
    }
    assert_eq!(rig.document_commands(), Vec::<String>::new());
    assert_eq!(rig.snapshot().await, before, "nothing was written");
    for (ticket, by) in [(&counted, "1"), (&pending, "2")] {
        let args = [
            "complete",
            "home",
            ticket,
            "--by",
            by,
            "--collection",
            "views",
            "--json",
        ];
        let output = rig.run(&args).await;
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        assert_eq!(json(&output)["outcome"], "not_pending");
    }
    assert_eq!(counter(&rig.views, "home").await, 3, "counted once each");
}

/// `resume` takes the ticket as printed: a bare token is a usage error
/// (64) that says how to get a ticket, and so is a protocol flag that
/// contradicts the ticket's shape — nothing is sent either way. Without a
/// flag the shape decides, whatever `[writer] protocol` says.
#[tokio::test]
async fn resume_takes_a_checked_ticket_whose_shape_says_the_protocol() {
    let rig = Rig::new("ticket_shape", "[writer]\nprotocol = \"lanes\"").await;
    let lost = step_1_lost();
    let two_step = rig
        .incr("home", 3, &["--two-step"], &lost, (75, "unknown"))
        .await;
    // The configured protocol: lanes.
    let lane = rig.incr("home", 4, &[], &[], (0, "counted")).await;
    assert!(lane.contains(".1-"), "{lane}");

    rig.proxy.clear_log();
    let bare = two_step.split('-').next().unwrap();
    let output = rig
        .run(&["resume", "home", bare, "--by", "3", "--collection", "views"])
        .await;
    let said = text(&output);
    assert_eq!(output.status.code(), Some(64), "{said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    for part in [
        "bare token",
        "as the increment printed it",
        "Counters::ticket",
    ] {
        assert!(said.contains(part), "{part:?} not in {said}");
    }
    let contradictions = [
        (&two_step, "3", "--lane", "a two-step token's"),
        (&lane, "4", "--two-step", "a lane's"),
    ];
    for (ticket, by, flag, shape) in contradictions {
        let args = [
            "resume",
            "home",
            ticket,
            "--by",
            by,
            flag,
            "--collection",
            "views",
        ];
        let output = rig.run(&args).await;
        let said = text(&output);
        assert_eq!(output.status.code(), Some(64), "{said}");
        assert!(said.contains(shape) && said.contains(flag), "{said}");
    }
    // A lane's ticket given to `complete`: a usage error too.
    let output = rig
        .run(&[
            "complete",
            "home",
            &lane,
            "--by",
            "4",
            "--collection",
            "views",
        ])
        .await;
    assert_eq!(output.status.code(), Some(64), "{}", text(&output));
    let resume = format!("tallyd -c {} resume home", rig.path);
    assert!(text(&output).contains(&resume), "{}", text(&output));
    assert!(
        text(&output).contains("--collection views"),
        "{}",
        text(&output)
    );
    assert_eq!(rig.document_commands(), Vec::<String>::new());
    assert_eq!(counter(&rig.views, "home").await, 4);

    // The two-step ticket, no flag, under `protocol = "lanes"`: resumed as
    // the two-step token it is; then with the flag that agrees.
    for flag in [&[][..], &["--two-step"]] {
        let mut args = vec!["resume", "home", &two_step, "--by", "3"];
        args.extend_from_slice(flag);
        args.extend(["--collection", "views", "--json"]);
        let output = rig.run(&args).await;
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        assert_eq!(json(&output)["protocol"], "two-step");
        assert_eq!(json(&output)["settled_earlier"], !flag.is_empty());
    }
    let args = [
        "resume",
        "home",
        &lane,
        "--by",
        "4",
        "--lane",
        "--collection",
        "views",
        "--json",
    ];
    let output = rig.run(&args).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["settled_earlier"], true);
    assert_eq!(counter(&rig.views, "home").await, 7);
}

/// `complete` checks a ticket against the key, `--by` (default 1) and the
/// collection, and a bare token's `--by`, when given, against the amount
/// the document holds: either refusal is exit 1, nothing written.
#[tokio::test]
async fn complete_checks_the_ticket_and_the_amount() {
    let rig = Rig::new("ticket_complete", "").await;
    let refused = [(2, Action::error(2, "BadValue", &[]))];
    let ticket = rig.incr("home", 2, &[], &refused, (75, "pending")).await;
    let bare = ticket.split('-').next().unwrap().to_owned();
    let before = rig.snapshot().await;
    let output = rig.complete(&ticket, None).await;
    assert_refused(&output, &ticket, "was not printed for views/home +1");
    let output = rig.complete(&bare, Some("3")).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "refused", "{out}");
    assert_eq!(
        out["ticket"],
        Value::Null,
        "a bare token has no ticket: {out}"
    );
    let message = out["error"]["message"].as_str().unwrap();
    assert!(message.contains("amount 2, not 3"), "{message}");
    assert_eq!(rig.snapshot().await, before, "nothing was written");
    assert_eq!(pending_len(&rig.views, "home").await, 1);

    let output = rig.complete(&ticket, Some("2")).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["settled_earlier"], false);
    // Counted: a bare token with another amount is still refused, with
    // the same one (or none) it is counted earlier.
    let output = rig.complete(&bare, Some("5")).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    for by in [Some("2"), None] {
        let output = rig.complete(&bare, by).await;
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        assert_eq!(json(&output)["settled_earlier"], true);
        assert_eq!(json(&output)["amount"], 2);
    }
    assert_eq!(counter(&rig.views, "home").await, 2);
}

/// Every hint a `tallyd incr` prints — `complete` for a pending increment,
/// `resume` for an unknown two-step or lane increment — shows the ticket,
/// and run as printed, twice, settles the increment exactly once.
#[tokio::test]
async fn every_printed_hint_run_twice_settles_its_increment_once() {
    let rig = Rig::new("ticket_hints", "").await;
    // (the flag, the amount, what happens to the increment's updates on
    // views — by their number, from 1 — and the hint's start)
    let refused = [(2, Action::error(2, "BadValue", &[]))];
    let lost = step_1_lost();
    let cases: [(&str, i64, &Faults, &str); 3] = [
        ("--two-step", 2, &refused, "complete home "),
        ("--two-step", 3, &lost, "resume home "),
        ("--lane", 4, &lost, "resume home "),
    ];
    let mut expected = 0;
    for (flag, by, faults, starts) in cases {
        let by_text = by.to_string();
        let args = [
            "incr",
            "home",
            "--by",
            &by_text,
            flag,
            "--collection",
            "views",
        ];
        let output = {
            let _faults = rig.faults(faults);
            rig.run(&args).await
        };
        assert_eq!(output.status.code(), Some(75), "{}", text(&output));
        let hint = hint(&output);
        let shown_as = format!("tallyd -c {} {starts}", rig.path);
        assert!(hint.starts_with(&shown_as), "{hint}");
        assert!(hint.contains(&format!("--by {by}")), "{hint}");
        let ticket = hint_command(&hint)[2];
        assert!(ticket.contains('-'), "the hint shows the ticket: {hint}");
        assert!(
            text(&output).contains(&format!("ticket {ticket}")),
            "{}",
            text(&output)
        );
        expected += by;
        for earlier in [false, true] {
            let mut args = hint_args(&hint);
            args.push("--json");
            let output = tallyd(&args, &[]).await;
            assert_eq!(output.status.code(), Some(0), "{hint}: {}", text(&output));
            let out = json(&output);
            assert_eq!(out["outcome"], "counted", "{hint}: {out}");
            assert_eq!(out["settled_earlier"], earlier, "{hint}: {out}");
            assert_eq!(out["amount"], by, "{hint}: {out}");
            assert_eq!(out["ticket"], ticket, "{hint}: {out}");
            assert_eq!(counter(&rig.views, "home").await, expected, "{hint}");
        }
    }
}
