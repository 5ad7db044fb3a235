//! The history's lane increments: bursts of concurrent callers on one
//! handle and one counter, so that their increments leave in groups (group
//! commit), and every unknown ticket resumed — by its caller, by a copy on
//! another host, by every caller of the group at once.

use std::sync::Arc;

use futures::future::join_all;
use tally::{LaneIncrement, LaneTicket};

use super::{Host, Leftover, Shared, amount};
use crate::history::LANE_KEYS;
use crate::history::record::{Call, Outcome};

/// 2 to 8 callers add to one lane counter at once through the worker's
/// handle.
pub async fn burst(shared: &Arc<Shared>, w: usize, me: &str, host: &Host, rng: &mut fastrand::Rng) {
    let key = LANE_KEYS[rng.usize(0..LANE_KEYS.len())];
    let amounts: Vec<i64> = (0..rng.usize(2..=8)).map(|_| amount(rng)).collect();
    let spread = rng.u64(..);
    let calls = amounts.into_iter().enumerate().map(|(c, amount)| {
        let (shared, host) = (shared.clone(), host.clone());
        let caller = format!("{me}/{c}");
        async move {
            let invoke = shared.rec.now();
            let outcome = host.lanes.add(key, amount).await;
            let (Some(lane), Some(position)) = (outcome.lane(), outcome.position()) else {
                panic!("a lane add with a valid key and amount took no lane: {outcome:?}");
            };
            let call = Call::Add {
                key: key.into(),
                amount,
                lane: lane.key(),
                position,
            };
            shared.rec.push(&caller, call, invoke, outcome_of(&outcome));
            shared.count("lane add");
            match outcome {
                LaneIncrement::Unknown(ticket) => Some((caller, ticket)),
                _ => None,
            }
        }
    });
    let unknown: Vec<(String, LaneTicket)> = join_all(calls).await.into_iter().flatten().collect();
    if unknown.len() > 1 {
        // The whole group at once, each from its own host or another's.
        shared.count("lane ticket resumed by its group at once");
    }
    let resumes = unknown
        .into_iter()
        .enumerate()
        .map(|(i, (caller, ticket))| {
            let shared = shared.clone();
            let host = (w + i * (spread as usize % 3)) % shared.hosts.len();
            async move { settle(&shared, &caller, host, ticket).await }
        });
    join_all(resumes).await;
}

/// Resumes `ticket` from host `at` until it is settled (a few tries under
/// faults; what is left is settled when the network heals).
async fn settle(shared: &Arc<Shared>, me: &str, at: usize, ticket: LaneTicket) {
    for _ in 0..3 {
        if resume_once(shared, me, at, &ticket).await {
            return;
        }
    }
    shared.leave(Leftover::Lane(ticket));
}

/// One resume of `ticket` from host `at`, recorded: whether it settled.
pub async fn resume_once(shared: &Shared, me: &str, at: usize, ticket: &LaneTicket) -> bool {
    let invoke = shared.rec.now();
    let resumed = shared.hosts[at].lanes.resume_lane(ticket.clone()).await;
    let outcome = match &resumed {
        Ok(outcome) => outcome_of(outcome),
        Err(err) => Outcome::Refused(err.to_string()),
    };
    let call = Call::ResumeLane {
        key: ticket.key().as_str().unwrap_or_default().to_owned(),
        lane: ticket.lane().key(),
        position: ticket.position(),
        total: ticket.amount(),
    };
    let process = if at == 0 {
        me.to_owned()
    } else {
        format!("{me}/copy@h{at}")
    };
    shared.rec.push(&process, call, invoke, outcome.clone());
    shared.count("lane resume");
    !matches!(outcome, Outcome::Unknown)
}

fn outcome_of(outcome: &LaneIncrement) -> Outcome {
    match outcome {
        LaneIncrement::Counted(c) => Outcome::Counted {
            earlier: c.settled_earlier(),
        },
        LaneIncrement::Unknown(_) => Outcome::Unknown,
        LaneIncrement::NotCounted(_) => Outcome::NotCounted,
        LaneIncrement::OutOfOrder(o) => Outcome::Refused(format!("out of order: {o:?}")),
    }
}
