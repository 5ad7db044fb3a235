//! `tallyd incr --lane` and `tallyd resume` of a lane's ticket as a user
//! runs them: the token is the lane, the ticket the lane and its number,
//! every outcome says its amount and protocol, the hints repeat the ticket,
//! `--by` and `--lane`, a resume counts once however often and from however
//! many processes it runs, and `[writer] protocol` picks `incr`'s default
//! that the flags override (a ticket says its own protocol).
//!
//! The oracle is the number of increments made; the lane map shows which
//! lane carried them.

use std::time::{Duration, SystemTime};

use futures::future::join_all;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, doc};

use super::lane_map;
use crate::cli::{hint, hint_args, hint_command, json, tallyd, text, write_config};
use crate::common::{FailPoint, TestContext, counter, pending_len};

/// A test database and a configuration file for it (`extra` appended),
/// kept while the returned directory lives.
async fn setup(name: &str, extra: &str) -> (TestContext, tempfile::TempDir, String) {
    let ctx = TestContext::new(name).await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(dir.path(), &ctx.config_toml(false, extra));
    (ctx, dir, path)
}

/// `tallyd --config PATH` followed by `args`, the collection named.
async fn run(path: &str, args: &[&str]) -> std::process::Output {
    let mut all = vec!["--config", path];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--collection", "views"]);
    tallyd(&all, &[]).await
}

/// The ticket an application prints ([`tally::Counters::lane_ticket`]) for
/// the update of `by` to `views/key` through the minted `lane` at
/// `position`.
fn lane_ticket(store: &tally::Store, key: &str, lane: ObjectId, position: i64, by: i64) -> String {
    let views = tally::Counters::new(
        store,
        tally::CollectionConfig::new("views"),
        tally::WriterConfig::default(),
    );
    let ticket = tally::LaneTicket::new(key, tally::LaneId::Minted(lane), position, by)
        .expect("a valid ticket");
    views.lane_ticket(&ticket).expect("a minted lane's ticket")
}

/// `incr --lane`: counted in one update whose lane is the printed token,
/// holding s = 1; the JSON says the amount and the protocol; text and
/// `--by` work as for the two-step increment.
#[tokio::test]
async fn incr_lane_counts_and_its_token_is_the_lane() {
    let (ctx, _dir, path) = setup("cli_lane_incr", "").await;
    let output = run(&path, &["incr", "home", "--lane", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "counted");
    assert_eq!(out["settled_earlier"], false);
    assert_eq!(out["amount"], 1);
    assert_eq!(out["protocol"], "lanes");
    let token = out["token"].as_str().unwrap().to_owned();
    assert_eq!(token.len(), 24);
    assert!(token.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')));
    // Its ticket: the lane, its number (1), the check.
    let ticket = out["ticket"].as_str().unwrap();
    assert!(ticket.starts_with(&format!("{token}.1-")), "{ticket}");
    assert_eq!(ticket.len(), 24 + 2 + 1 + 6, "{ticket}");

    let output = run(&path, &["incr", "home", "--lane", "--by", "-3"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert!(
        text(&output).starts_with("counted: views/home -3 (lane "),
        "{}",
        text(&output)
    );

    let client = ctx.client(false).await;
    let views = client.collection("views");
    assert_eq!(counter(&views, "home").await, -2);
    let map = lane_map(&views, "home").await;
    assert_eq!(map.len(), 2, "one fresh lane per command: {map:?}");
    assert!(map.contains(&(token, 1)), "{map:?}");
    assert!(map.iter().all(|(_, s)| *s == 1), "{map:?}");
    assert_eq!(pending_len(&views, "home").await, 0);
}

/// `incr --lane --by 5` whose update is lost twice: unknown, exit 75. The
/// JSON says 5, the hint repeats `--by 5` and `--lane` (the configured
/// protocol is the two-step one), and following it counts exactly 5 — as
/// often as it is followed.
#[tokio::test]
async fn an_unknown_lane_incr_by_5_says_5_and_its_hint_counts_5_once() {
    let (ctx, _dir, path) = setup("cli_lane_unknown", "").await;
    let lost_twice = |json_output: bool| {
        let ctx = &ctx;
        let path = path.clone();
        async move {
            let _fail = FailPoint::set(
                ctx,
                Bson::Document(doc! { "times": 2 }),
                doc! { "failCommands": ["update"], "closeConnection": true },
            )
            .await;
            let mut args = vec!["incr", "k", "--by", "5", "--lane"];
            if json_output {
                args.push("--json");
            }
            run(&path, &args).await
        }
    };
    let output = lost_twice(true).await;
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "unknown");
    assert_eq!(out["amount"], 5);
    assert_eq!(out["protocol"], "lanes");
    assert_eq!(out["error"]["class"], "transient");

    let output = lost_twice(false).await;
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let hint = hint(&output);
    assert!(
        hint.starts_with(&format!("tallyd -c {path} resume k ")),
        "{hint}"
    );
    assert!(hint.contains(" --by 5"), "{hint}");
    assert!(hint.contains(" --lane"), "{hint}");
    let args = hint_args(&hint);
    for (run, earlier) in [(1, false), (2, true), (3, true)] {
        let output = tallyd(&args, &[]).await;
        assert_eq!(
            output.status.code(),
            Some(0),
            "run {run}: {}",
            text(&output)
        );
        assert!(
            text(&output).starts_with("counted: views/k +5 (lane"),
            "{}",
            text(&output)
        );
        assert_eq!(
            text(&output).contains("counted earlier"),
            earlier,
            "run {run}: {}",
            text(&output)
        );
        // A resume that finds its number counted is a success: no warning,
        // no server text (the counter's upsert meeting the document).
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("WARN") && !stderr.contains("E11000"),
            "run {run}: {stderr}"
        );
    }
    let client = ctx.client(false).await;
    assert_eq!(counter(&client.collection("views"), "k").await, 5);
}

/// The lane token of an `incr --lane` that never reached the server, resumed
/// 1, 2 and 5 times — one process after another, or all at once: counted
/// once, by exactly one of the runs; every other run says it was counted
/// earlier. The token of one that did count, resumed the same ways, adds
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_a_lane_token_1_2_5_times_from_one_or_many_processes_counts_once() {
    let (ctx, _dir, path) = setup("cli_lane_resume_many", "").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");
    for (runs, concurrent) in [(1, false), (2, false), (5, false), (2, true), (5, true)] {
        let name = format!("{runs} runs, concurrent: {concurrent}");
        let key = format!("k{runs}{concurrent}");
        // The lane (the token) and its ticket.
        let lane_and_ticket = |output: &std::process::Output| {
            let out = json(output);
            let field = |name: &str| out[name].as_str().unwrap().to_owned();
            (field("token"), field("ticket"))
        };
        let (token, ticket) = {
            let _fail = FailPoint::updates_cut(&ctx, 2).await;
            let output = run(&path, &["incr", &key, "--by", "7", "--lane", "--json"]).await;
            assert_eq!(output.status.code(), Some(75), "{name}: {}", text(&output));
            lane_and_ticket(&output)
        };
        let applied = run(&path, &["incr", &key, "--by", "2", "--lane", "--json"]).await;
        assert_eq!(applied.status.code(), Some(0), "{name}: {}", text(&applied));
        let (applied, applied_ticket) = lane_and_ticket(&applied);
        let resumed = [
            (&token, &ticket, "7", 1),
            (&applied, &applied_ticket, "2", 0),
        ];
        for (token, ticket, by, fresh_runs) in resumed {
            let args = ["resume", &key, ticket, "--by", by, "--lane", "--json"];
            let outputs = if concurrent {
                join_all((0..runs).map(|_| run(&path, &args))).await
            } else {
                let mut outputs = Vec::new();
                for _ in 0..runs {
                    outputs.push(run(&path, &args).await);
                }
                outputs
            };
            let mut fresh = 0;
            for output in &outputs {
                assert_eq!(output.status.code(), Some(0), "{name}: {}", text(output));
                let out = json(output);
                assert_eq!(out["outcome"], "counted", "{name}: {out}");
                assert_eq!(out["amount"], by.parse::<i64>().unwrap(), "{name}: {out}");
                assert_eq!(out["token"], token.as_str(), "{name}: {out}");
                assert_eq!(out["ticket"], ticket.as_str(), "{name}: {out}");
                if out["settled_earlier"] == false {
                    fresh += 1;
                }
            }
            assert_eq!(fresh, fresh_runs, "{name}: token {token}");
        }
        assert_eq!(counter(&views, key.as_str()).await, 7 + 2, "{name}");
        let mut map = lane_map(&views, &key).await;
        map.sort();
        let mut expected = vec![(token, 1), (applied, 1)];
        expected.sort();
        assert_eq!(map, expected, "{name}");
    }
}

/// A lane token whose lane is older than the lane resume horizon: refused,
/// exit 1, nothing written — the daemon may have pruned its entry.
#[tokio::test]
async fn resume_lane_refuses_past_the_lane_resume_horizon_and_writes_nothing() {
    let (ctx, _dir, path) = setup("cli_lane_resume_horizon", "").await;
    let old = tally::Token::created_at_time(SystemTime::now() - Duration::from_secs(24 * 3600));
    let store = ctx.client(false).await.store();
    let old = lane_ticket(&store, "k", old.object_id(), 1, 1);
    let output = run(&path, &["resume", "k", &old, "--lane", "--json"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "refused");
    assert_eq!(out["protocol"], "lanes");
    assert_eq!(out["amount"], 1);
    let client = ctx.client(false).await;
    let views = client.collection("views");
    assert_eq!(views.count_documents(doc! {}).await.unwrap(), 0);
}

/// `[writer] protocol = "lanes"` makes `incr` use lanes, and `--two-step`
/// overrides it; `resume` goes by the ticket's shape, whatever the
/// configuration says: a flag that contradicts it is a usage error naming
/// the flag, and nothing is written.
#[tokio::test]
async fn writer_protocol_picks_the_default_and_the_flags_override_it() {
    let (ctx, _dir, path) = setup("cli_lane_protocol", "[writer]\nprotocol = \"lanes\"").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");

    let output = run(&path, &["incr", "k", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["protocol"], "lanes");
    let lane = out["token"].as_str().unwrap().to_owned();
    let lane_ticket = out["ticket"].as_str().unwrap().to_owned();
    // A two-step increment whose step 2 failed: its token stays pending.
    let two_step = {
        let _fail = FailPoint::set(
            &ctx,
            Bson::Document(doc! { "skip": 1, "times": 1 }),
            doc! { "failCommands": ["update"], "errorCode": 2 },
        )
        .await;
        let output = run(&path, &["incr", "k", "--two-step", "--json"]).await;
        assert_eq!(output.status.code(), Some(75), "{}", text(&output));
        let out = json(&output);
        assert_eq!(out["outcome"], "pending");
        assert_eq!(out["protocol"], "two-step");
        out["ticket"].as_str().unwrap().to_owned()
    };
    assert_eq!(counter(&views, "k").await, 1);
    assert_eq!(pending_len(&views, "k").await, 1);
    assert_eq!(lane_map(&views, "k").await, vec![(lane.clone(), 1)]);

    // The lane's ticket resumed as a two-step one, the pending token's as a
    // lane: usage errors naming the flag. The pending token's, no flag,
    // under the lanes default: taken as the two-step ticket it is — and
    // refused, a pending increment's ticket is completed, not resumed.
    let output = run(&path, &["resume", "k", &lane_ticket, "--two-step"]).await;
    assert_eq!(output.status.code(), Some(64), "{}", text(&output));
    assert!(text(&output).contains("--two-step"), "{}", text(&output));
    let output = run(&path, &["resume", "k", &two_step, "--lane"]).await;
    assert_eq!(output.status.code(), Some(64), "{}", text(&output));
    assert!(text(&output).contains("--lane"), "{}", text(&output));
    let output = run(&path, &["resume", "k", &two_step, "--json"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "refused");
    assert_eq!(json(&output)["protocol"], "two-step");
    assert_eq!(counter(&views, "k").await, 1);
    assert_eq!(pending_len(&views, "k").await, 1);
    assert_eq!(lane_map(&views, "k").await, vec![(lane.clone(), 1)]);
    let output = run(&path, &["complete", "k", &two_step, "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(counter(&views, "k").await, 2);
    // No flag: the lane's ticket resumes as the lane it is, counted.
    let output = run(&path, &["resume", "k", &lane_ticket, "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["settled_earlier"], true);
    assert_eq!(counter(&views, "k").await, 2);
    let output = run(&path, &["incr", "k", "--lane", "--two-step"]).await;
    assert_eq!(output.status.code(), Some(64), "{}", text(&output));
}

/// A lane ticket from the library (`Counters::add`, at a later number than
/// 1) printed with `Counters::lane_ticket` carries its number: `tallyd
/// resume` re-sends that number — counted once however often it runs. A
/// ticket at a number below the one the lane holds is refused (exit 1,
/// nothing written): re-sending s = 1 for an update at a later number
/// would report a +7 that was never added as counted earlier.
#[tokio::test]
async fn resume_of_a_library_lane_ticket_resends_its_number_and_refuses_a_lower_one() {
    let (ctx, _dir, path) = setup("cli_lane_resume_position", "").await;
    let client = ctx.client(false).await;
    let views = tally::Counters::try_new(
        &client.store(),
        tally::CollectionConfig::new("views"),
        tally::WriterConfig::default(),
    )
    .unwrap();
    let first = views.add("k", 1).await;
    assert!(matches!(first, tally::LaneIncrement::Counted(_)));
    let ticket = {
        let _fail = FailPoint::updates_cut(&ctx, 2).await;
        match views.add("k", 7).await {
            tally::LaneIncrement::Unknown(ticket) => ticket,
            other => panic!("expected unknown, got {other:?}"),
        }
    };
    let position = ticket.position();
    assert!(position > first.position().unwrap(), "numbers grow");
    let tally::LaneId::Minted(lane) = ticket.lane().clone() else {
        panic!("a minted lane: {ticket}");
    };
    let printed = views.lane_ticket(&ticket).expect("a minted lane's ticket");
    assert!(
        printed.starts_with(&format!("{}.{position}-", lane.to_hex())),
        "the ticket carries the lane and its number: {printed}"
    );
    let coll = client.collection("views");
    let resume = |ticket: String| {
        let path = path.clone();
        async move {
            let args = ["resume", "k", &ticket, "--by", "7", "--json"];
            run(&path, &args).await
        }
    };
    for earlier in [false, true] {
        let output = resume(printed.clone()).await;
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        let out = json(&output);
        assert_eq!(out["outcome"], "counted", "{out}");
        assert_eq!(out["settled_earlier"], earlier, "{out}");
        assert_eq!(out["position"], position, "{out}");
        assert_eq!(out["ticket"], printed.as_str(), "{out}");
        assert_eq!(counter(&coll, "k").await, 8);
    }
    // The same lane at s = 1, below what the lane holds: refused.
    let output = resume(lane_ticket(&client.store(), "k", lane, 1, 7)).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "refused", "{out}");
    assert_eq!(out["position"], 1, "{out}");
    assert_eq!(counter(&coll, "k").await, 8);
    assert_eq!(lane_map(&coll, "k").await, vec![(lane.to_hex(), position)]);
}

/// Every resume hint names the protocol that made the token, whatever
/// `[writer] protocol` says: followed under a configuration whose default
/// is the other protocol, it still settles the increment once.
#[tokio::test]
async fn resume_hints_always_name_the_protocol() {
    let (ctx, _dir, lanes_path) =
        setup("cli_hint_protocol", "[writer]\nprotocol = \"lanes\"").await;
    let two_step_dir = tempfile::tempdir().unwrap();
    let two_step_path = write_config(
        two_step_dir.path(),
        &ctx.config_toml(false, "[writer]\nprotocol = \"two-step\""),
    );
    // (the configuration the increment ran under, the one the hint is
    // followed under, the protocol flag, the key)
    let cases = [
        (&lanes_path, &two_step_path, "--lane", "kl"),
        (&two_step_path, &lanes_path, "--two-step", "kt"),
    ];
    let client = ctx.client(false).await;
    let views = client.collection("views");
    for (made_under, followed_under, flag, key) in cases {
        let output = {
            let _fail = FailPoint::updates_cut(&ctx, 2).await;
            run(made_under, &["incr", key, "--by", "3", flag]).await
        };
        assert_eq!(output.status.code(), Some(75), "{flag}: {}", text(&output));
        let hint = hint(&output);
        assert!(hint.contains(&format!(" {flag}")), "{flag}: {hint}");
        let mut args = vec!["--config", followed_under.as_str()];
        args.extend(hint_command(&hint));
        for _ in 0..2 {
            let output = tallyd(&args, &[]).await;
            assert_eq!(output.status.code(), Some(0), "{flag}: {}", text(&output));
        }
        assert_eq!(counter(&views, key).await, 3, "{flag}: counted once");
    }
}
