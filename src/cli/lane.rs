//! `tallyd incr --lane` and `tallyd resume --lane`: the lanes protocol
//! (the book: design/lanes.md) on the command line.
//!
//! A command is one process, so `incr` takes one fresh lane of its own
//! and sends its first number, s = 1, in one round trip (a count, whose age
//! is the lane's, minted now); the token it prints is the lane, and its
//! ticket the lane and its number (`LANE.1-CHECK`). `resume` re-sends the
//! update a ticket names — `incr`'s, or one an application printed with
//! [`Counters::lane_ticket`](crate::Counters::lane_ticket) at a later
//! number — harmless however often it runs, from wherever, until the lane
//! resume horizon; refused, nothing written, when the lane holds a later
//! number. A named lane (an ordered source's) has no ticket: its source
//! delivers the message again.

use std::process::ExitCode;

use serde_json::json;

use super::increment::{
    Shown, Target, by_option, counted_text, print, print_failure, protocol_flag, shell_word,
};
use super::settle::other_protocol;
use super::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, exit_code_for, shown_command};
use crate::write::counter::{Found, Protocol};
use crate::write::lane::{LaneId, LaneIncrement, LaneTicket};
use crate::write::ticket::{Settles, Ticket};

/// `tallyd incr KEY [--by N] --lane`.
pub(super) async fn incr(
    target: &Target,
    key: &str,
    by: i64,
    at: Option<std::time::SystemTime>,
) -> ExitCode {
    let outcome = target.counters.add_once(key, by, at).await;
    report(target, key, &outcome)
}

/// `tallyd resume KEY LANE.S-CHECK [--by N]`, the ticket checked.
pub(super) async fn resume(
    target: &Target,
    key: &str,
    ticket: &Ticket,
    by: i64,
    position: i64,
) -> ExitCode {
    let shown = Shown::given(key, ticket, Some(by));
    let token = ticket.token();
    let refuse = |err| print_failure(target, &shown, "refused", err, "refused", EXIT_FAILED);
    // A two-step token resumed as a lane would be counted again.
    match target.counters.lookup(target.id(key), token).await {
        Ok(Found::Absent) => {}
        Ok(Found::Pending(_) | Found::Settled(_)) => {
            return refuse(&other_protocol(token, Protocol::TwoStep));
        }
        Err(err) => {
            let text = "unknown: could not read the counter, nothing was written; resume later";
            let code = super::exit::exit_code_for_pending(&err);
            return print_failure(target, &shown, "unknown", &err, text, code);
        }
    }
    let ticket = match LaneTicket::new(
        target.id(key),
        LaneId::Minted(token.object_id()),
        position,
        by,
    ) {
        Ok(ticket) => ticket,
        Err(err) => return refuse(&err),
    };
    match target.counters.resume_lane(ticket).await {
        Ok(outcome) => report(target, key, &outcome),
        // Past the lane resume horizon: nothing was written.
        Err(err) => refuse(&err),
    }
}

fn report(target: &Target, key: &str, outcome: &LaneIncrement) -> ExitCode {
    let place = target.place(key);
    let amount = outcome.amount();
    let lane = outcome.lane().map(LaneId::to_string);
    let ticket = match (outcome.lane(), outcome.position()) {
        (Some(LaneId::Minted(lane)), position @ Some(_)) => {
            Some(target.ticket(key, *lane, position, amount, Settles::Resume))
        }
        _ => None,
    };
    let shown_ticket = ticket.clone().unwrap_or_default();
    let cause = outcome
        .cause()
        .map(|err| target.explain(err))
        .unwrap_or_default();
    let (text, code) = match outcome {
        LaneIncrement::Counted(counted) => (
            counted_text(
                &place,
                amount,
                "lane ticket",
                &shown_ticket,
                counted.settled_earlier(),
            ),
            EXIT_OK,
        ),
        LaneIncrement::Unknown(_) => (
            format!(
                "unknown: the update of lane ticket {shown_ticket} ({amount:+}) may or may not \
                 have applied to {place}; run `{}` — harmless to repeat, as \
                 often as needed — within the lane resume horizon of {} from when the update \
                 was sent ({}); after that it is counted at most once. Cause: {cause}",
                shown_command(&format!(
                    "resume {} {shown_ticket}{}{}{}",
                    shell_word(key),
                    by_option(amount),
                    protocol_flag(Protocol::Lanes),
                    target.collection_options
                )),
                humantime::format_duration(target.writer.lane_resume_horizon),
                resume_deadline(outcome, target.writer.lane_resume_horizon),
            ),
            EXIT_TEMPFAIL,
        ),
        LaneIncrement::NotCounted(not) => (
            format!("not counted ({amount:+}): {cause}"),
            exit_code_for(not.cause()),
        ),
        LaneIncrement::OutOfOrder(behind) => (
            format!(
                "refused: lane {} holds position {} in {place}, above {}: \
                 nothing was written; position {} ({amount:+}) is counted only if it applied \
                 before position {} did",
                lane.as_deref().unwrap_or_default(),
                behind.held(),
                behind.position(),
                behind.position(),
                behind.held(),
            ),
            EXIT_FAILED,
        ),
    };
    let mut fields = json!({ "outcome": outcome.name(), "position": outcome.position() });
    match outcome {
        LaneIncrement::Counted(counted) => {
            fields["settled_earlier"] = json!(counted.settled_earlier());
        }
        LaneIncrement::OutOfOrder(behind) => {
            fields["outcome"] = json!("refused");
            fields["held"] = json!(behind.held());
        }
        _ => {}
    }
    if let Some(err) = outcome.cause() {
        fields["error"] = target.error_json(err);
    }
    let shown = Shown {
        key,
        token: lane,
        ticket,
        amount: Some(amount),
        protocol: Protocol::Lanes,
    };
    print(target, &shown, fields, &text, code)
}

/// Until when an unknown lane update may be resumed, in words: `until
/// 2026-11-27T21:07:53Z`, counted from the time its number holds (or, for
/// a number that is a count, from its lane's creation).
fn resume_deadline(outcome: &LaneIncrement, horizon: std::time::Duration) -> String {
    let now = std::time::SystemTime::now();
    let age = match (outcome.lane(), outcome.position()) {
        (Some(lane), Some(position)) => crate::write::lane::update_age(lane, position, now),
        _ => None,
    };
    match age {
        Some(age) if age < horizon => format!(
            "until {}",
            humantime::format_rfc3339_seconds(now + (horizon - age))
        ),
        Some(_) => "already past".to_owned(),
        None => "a named lane has none".to_owned(),
    }
}
