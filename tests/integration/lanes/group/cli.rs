//! Group commit's edges on the command line (`tallyd resume --lane`,
//! `tallyd doctor`): what an operator is told, and what following it does.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tally::{LaneId, LaneIncrement, LaneTicket, Token};

use super::handle;
use crate::cli::{tallyd, text, write_config};
use crate::common::{FailPoint, TestContext};

/// `tallyd --config PATH resume k TICKET --by BY --lane --collection views`.
fn resume_lane(path: &str, ticket: &str, by: &str) -> Vec<String> {
    let args = [
        "--config",
        path,
        "resume",
        "k",
        ticket,
        "--by",
        by,
        "--lane",
        "--collection",
        "views",
    ];
    args.into_iter().map(str::to_owned).collect()
}

/// `tallyd resume --lane --position P` of a library ticket, itself unknown
/// again (both attempts cut): the hint says to resume "within the lane
/// resume horizon of 23h from the lane's creation". But a library ticket's
/// horizon counts from the time its number holds, not from its lane's
/// creation: a handle made two days ago whose update went out a minute ago
/// is resumable for 23 more hours. An operator who believes the hint gives
/// up on a ticket that can still be settled — and a count is lost.
///
/// Should be: the hint names the horizon of the ticket's own number (a
/// time: from that time; a count: from the lane's creation).
#[tokio::test]
async fn an_unknown_resume_of_a_library_ticket_hints_the_horizon_of_its_number() {
    let ctx = TestContext::new("group_cli_horizon").await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let day = Duration::from_secs(24 * 3600);
    // The lane of a handle made two days ago; its update went out a minute
    // ago (a lane's number is the time it was sent, in microseconds).
    let lane = Token::created_at_time(SystemTime::now() - 2 * day).object_id();
    let sent = SystemTime::now() - Duration::from_secs(60);
    let position = sent
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_micros();
    let client = ctx.client(false).await;
    let views = handle(&client.store(), "views");
    let rebuilt = LaneTicket::new("k", LaneId::Minted(lane), position as i64, 3).expect("a ticket");
    let ticket = views
        .lane_ticket(&rebuilt)
        .expect("a minted lane's ticket prints");
    let args = resume_lane(&path, &ticket, "3");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = {
        let _cut = FailPoint::updates_cut(&ctx, 2).await;
        tallyd(&args, &[]).await
    };
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));
    let shown = text(&output);
    // The ticket is resumable indeed: the same command again counts it.
    let again = tallyd(&args, &[]).await;
    assert_eq!(again.status.code(), Some(0), "{}", text(&again));
    assert!(
        !shown.contains("from the lane's creation"),
        "the hint dates the horizon from the lane's creation (two days ago), though the ticket's \
         number is a minute old and the same command counted it right after: {shown}"
    );
}

/// A library ticket settled from the command line without `--position`
/// (the position defaults to 1, `incr --lane`'s): when the ticket's lane
/// holds nothing in the counter yet — the handle's first update of it, or
/// a counter whose lane was retired — `s = 1` applies, counting the
/// ticket's amount. The application resumes the ticket too (a ticket may be
/// resumed from anywhere, any number of times), at its real number, which
/// is above 1: it applies as well. One increment of 7, counted 14.
///
/// Should be: a resume that cannot know the ticket's number sends nothing
/// (`--position` required for a lane whose numbers are not `incr
/// --lane`'s), so the ticket is counted once.
#[tokio::test]
async fn a_library_ticket_resumed_from_the_cli_without_its_position_is_not_counted_twice() {
    let ctx = TestContext::new("group_cli_position").await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = write_config(dir.path(), &ctx.config_toml(false, ""));
    let client = ctx.client(false).await;
    let views = handle(&client.store(), "views");
    let ticket = {
        let _cut = FailPoint::updates_cut(&ctx, 2).await;
        match views.add("k", 7).await {
            LaneIncrement::Unknown(ticket) => ticket,
            other => panic!("expected unknown, got {other:?}"),
        }
    };
    // The lane alone, as an operator might paste it: refused (a ticket
    // names its number), nothing sent.
    let lane = ticket.lane().to_string();
    let args = resume_lane(&path, &lane, "7");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = tallyd(&args, &[]).await;
    let cli = text(&output);
    assert_eq!(output.status.code(), Some(64), "{cli}");
    let resumed = views.resume_lane(ticket.clone()).await;
    let coll = client.collection("views");
    let counter = crate::common::counter(&coll, "k").await;
    let lanes = crate::common::field(&coll, "k", "lanes").await;
    assert_eq!(
        counter, 7,
        "one increment of 7 ({ticket}): the command line said {cli:?}, the library's resume \
         {resumed:?}; lanes {lanes:?}"
    );
}

/// The clock check of `tallyd doctor` (and the daemon's `clock_skew`
/// alert) judges a skew against the two-step margin only (`grace −
/// retry_horizon − attempt_timeout`, 11 minutes by default). Lane entries
/// are pruned by the writer's clock too, within `lane_ttl −
/// lane_resume_horizon − attempt_timeout` — here 1 minute (a valid
/// configuration). A host 2 minutes behind the server can have a lane
/// entry pruned while it still resumes its update (counted twice), yet the
/// doctor calls its clock fine.
///
/// Should be: the skew is judged against the tightest margin, the lanes'
/// included.
#[tokio::test]
async fn the_clock_check_judges_a_skew_against_the_lanes_margin_too() {
    let ctx = TestContext::new("group_lane_margin").await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = ctx.config_toml(
        false,
        "[writer]\nlane_resume_horizon = \"1h58m\"\nlane_ttl = \"2h\"\n\n[[collections]]\nname = \
         \"views\"\n",
    );
    let path = write_config(dir.path(), &config);
    let check = tallyd(&["--config", path.as_str(), "check-config"], &[]).await;
    assert_eq!(check.status.code(), Some(0), "{}", text(&check));
    let output = tallyd(
        &[
            "--config",
            path.as_str(),
            "doctor",
            "--json",
            "--clock-offset",
            "-2m",
        ],
        &[],
    )
    .await;
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&output.stdout).trim())
            .unwrap_or_else(|err| panic!("not one JSON object ({err}): {}", text(&output)));
    let clock = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == "clock_skew")
        .cloned()
        .expect("a clock_skew check");
    assert_eq!(
        clock["verdict"], "fail",
        "a host 2 minutes behind the server, with 1 minute of lane margin \
         (lane_ttl 2h − lane_resume_horizon 1h58m − attempt_timeout 1m): {clock}"
    );
}
