//! `tallyd incr --lane` and `tallyd resume --lane` as a user runs them:
//! the token is the lane, every outcome says its amount and protocol, the
//! hints repeat `--by` and `--lane`, a resume counts once however often and
//! from however many processes it runs, and `[writer] protocol` picks the
//! default that the flags override.
//!
//! The oracle is the number of increments made; the lane map shows which
//! lane carried them.

use std::time::{Duration, SystemTime};

use futures::future::join_all;
use mongodb::bson::{Bson, doc};

use super::lane_map;
use crate::cli::{hint, json, tallyd, text, write_config};
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
    assert!(hint.starts_with("tallyd resume k "), "{hint}");
    assert!(hint.contains(" --by 5"), "{hint}");
    assert!(hint.contains(" --lane"), "{hint}");
    let mut args = vec!["--config", path.as_str()];
    args.extend(hint.split_whitespace().skip(1));
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
        let token = {
            let _fail = FailPoint::updates_cut(&ctx, 2).await;
            let output = run(&path, &["incr", &key, "--by", "7", "--lane", "--json"]).await;
            assert_eq!(output.status.code(), Some(75), "{name}: {}", text(&output));
            json(&output)["token"].as_str().unwrap().to_owned()
        };
        let applied = run(&path, &["incr", &key, "--by", "2", "--lane", "--json"]).await;
        assert_eq!(applied.status.code(), Some(0), "{name}: {}", text(&applied));
        let applied = json(&applied)["token"].as_str().unwrap().to_owned();
        for (token, by, fresh_runs) in [(&token, "7", 1), (&applied, "2", 0)] {
            let args = ["resume", &key, token, "--by", by, "--lane", "--json"];
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
    let old = tally::Token::created_at_time(SystemTime::now() - Duration::from_secs(24 * 3600))
        .to_string();
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

/// `[writer] protocol = "lanes"` makes `incr` and `resume` use lanes, and
/// `--two-step` overrides it; a token resumed with the protocol that did
/// not make it is refused without writing, and the refusal names the flag.
#[tokio::test]
async fn writer_protocol_picks_the_default_and_the_flags_override_it() {
    let (ctx, _dir, path) = setup("cli_lane_protocol", "[writer]\nprotocol = \"lanes\"").await;
    let client = ctx.client(false).await;
    let views = client.collection("views");

    let output = run(&path, &["incr", "k", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let lane = json(&output);
    assert_eq!(lane["protocol"], "lanes");
    let lane = lane["token"].as_str().unwrap().to_owned();
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
        out["token"].as_str().unwrap().to_owned()
    };
    assert_eq!(counter(&views, "k").await, 1);
    assert_eq!(pending_len(&views, "k").await, 1);
    assert_eq!(lane_map(&views, "k").await, vec![(lane.clone(), 1)]);

    // The lane's token resumed as a two-step one, and the pending token
    // resumed as a lane (the configured default): refused, nothing written,
    // the refusal names the flag that would do.
    let output = run(&path, &["resume", "k", &lane, "--two-step"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(text(&output).contains("--lane"), "{}", text(&output));
    let output = run(&path, &["resume", "k", &two_step, "--json"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert_eq!(json(&output)["outcome"], "refused");
    assert!(
        json(&output)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--two-step"),
        "{}",
        text(&output)
    );
    assert_eq!(counter(&views, "k").await, 1);
    assert_eq!(pending_len(&views, "k").await, 1);
    assert_eq!(lane_map(&views, "k").await, vec![(lane.clone(), 1)]);
    let output = run(&path, &["resume", "k", &two_step, "--two-step", "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(counter(&views, "k").await, 2);
    // The configured protocol needs no flag: the lane resumes as counted.
    let output = run(&path, &["resume", "k", &lane, "--json"]).await;
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    assert_eq!(json(&output)["settled_earlier"], true);
    assert_eq!(counter(&views, "k").await, 2);
    let output = run(&path, &["incr", "k", "--lane", "--two-step"]).await;
    assert_eq!(output.status.code(), Some(64), "{}", text(&output));
}

/// A lane ticket from the library (`Counters::add`) carries its position:
/// its Display shows it, and `resume --lane --position S` re-sends that
/// position — counted once however often it runs. A position below the
/// one the lane holds is refused (exit 1, nothing written): re-sending
/// s = 1 for a ticket at a later number would report a +7 that was never
/// added as counted earlier.
#[tokio::test]
async fn resume_lane_position_resends_a_library_tickets_position_and_refuses_a_lower_one() {
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
    let shown_position = position.to_string();
    let lane = ticket.lane().to_string();
    assert!(
        ticket.to_string().contains(&format!("position {position}")),
        "the ticket's display names its position: {ticket}"
    );
    let coll = client.collection("views");
    let resume = |position: Option<&str>| {
        let position = position.map(str::to_owned);
        let (path, lane) = (path.clone(), lane.clone());
        async move {
            let mut args = vec![
                "resume",
                "k",
                lane.as_str(),
                "--by",
                "7",
                "--lane",
                "--json",
            ];
            if let Some(position) = &position {
                args.extend(["--position", position.as_str()]);
            }
            run(&path, &args).await
        }
    };
    for earlier in [false, true] {
        let output = resume(Some(&shown_position)).await;
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        let out = json(&output);
        assert_eq!(out["outcome"], "counted", "{out}");
        assert_eq!(out["settled_earlier"], earlier, "{out}");
        assert_eq!(out["position"], position, "{out}");
        assert_eq!(counter(&coll, "k").await, 8);
    }
    // s = 1 (the default) is below what the lane holds: refused.
    let output = resume(None).await;
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    let out = json(&output);
    assert_eq!(out["outcome"], "refused", "{out}");
    assert_eq!(out["position"], 1, "{out}");
    assert_eq!(counter(&coll, "k").await, 8);
    assert_eq!(lane_map(&coll, "k").await, vec![(lane.clone(), position)]);
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
        args.extend(hint.split_whitespace().skip(1));
        for _ in 0..2 {
            let output = tallyd(&args, &[]).await;
            assert_eq!(output.status.code(), Some(0), "{flag}: {}", text(&output));
        }
        assert_eq!(counter(&views, key).await, 3, "{flag}: counted once");
    }
}
