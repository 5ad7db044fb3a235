//! The fault matrix's rows for a grouped lane update (group commit): a
//! counter's update is in flight (the pilot, its reply held up a little),
//! 1 or 8 callers queue behind it and leave together as the next update,
//! and the proxy faults that update — reply lost, connection cut, reply past
//! the attempt bound, not primary, a command error, the request held in the
//! network, and two faults in a row (unknown).
//!
//! The oracle is the proxy's log: the group's update (its lane and number)
//! reached the server or it did not, and the document must equal the
//! replay of the updates that reached it. Every caller's outcome must agree
//! with that: counted exactly when the update reached the server, not
//! counted exactly when it did not, and an unknown one — the shared ticket
//! resumed by every caller at once — counted once.

use std::fmt::Write as _;
use std::time::Duration;

use futures::future::join_all;
use tally::{CollectionConfig, Counters, LaneIncrement, WriterConfig};

use crate::common::proxy::{Action, Exchange, Release, Rule};
use crate::common::wait_until;
use crate::faults::{DELAY, Rig, project, replay_lanes, settled_log};

/// A row: its name, and the actions on the group update's first attempts.
type Row = (&'static str, &'static [fn() -> Action]);

/// The faults on the group's update: the actions on its first and, for
/// the unknown rows, its second attempt.
const ROWS: [Row; 8] = [
    ("reply lost", &[|| Action::DropReply]),
    ("connection cut", &[|| Action::CloseBeforeForwarding]),
    (
        "reply past the attempt bound",
        &[|| Action::DelayReply(DELAY)],
    ),
    (
        "not primary",
        &[|| Action::error(10107, "NotWritablePrimary", &[])],
    ),
    ("command error", &[|| Action::error(2, "BadValue", &[])]),
    (
        "held in the network",
        &[|| Action::HoldRequest(Release::WhenReleased)],
    ),
    (
        "reply lost, then cut",
        &[|| Action::DropReply, || Action::CloseBeforeForwarding],
    ),
    (
        "cut twice",
        &[
            || Action::CloseBeforeForwarding,
            || Action::CloseBeforeForwarding,
        ],
    ),
];

/// What every caller of a row must be told.
fn expected(row: &str) -> &'static str {
    match row {
        "reply lost" | "reply past the attempt bound" => "counted (already applied)",
        "connection cut" | "not primary" | "held in the network" => "counted",
        "command error" => "not counted",
        "reply lost, then cut" | "cut twice" => "unknown",
        other => unreachable!("{other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_on_a_grouped_update_tells_every_caller_exactly() {
    let rig = Rig::new("faults_group", false).await;
    let mut failures = String::new();
    for (row, actions) in ROWS {
        for callers in [1usize, 8] {
            if let Err(diff) = cell(&rig, row, actions, callers).await {
                let _ = writeln!(failures, "{row} × {callers} callers: {diff}");
            }
        }
    }
    assert!(failures.is_empty(), "grouped update rows:\n{failures}");
}

async fn cell(
    rig: &Rig,
    row: &str,
    actions: &[fn() -> Action],
    callers: usize,
) -> Result<(), String> {
    let name = format!("{row}_{callers}").replace([' ', ','], "_");
    rig.proxy.clear_log();
    let counters = Counters::try_new(
        &rig.store,
        CollectionConfig::new(&name),
        WriterConfig::default(),
    )
    .expect("the default lane settings");
    // The pilot's reply comes late, but inside the attempt bound: the
    // callers queue behind it and leave together as the second update.
    let mut rules = vec![
        rig.proxy.rule(
            Rule::command("update")
                .collection(&name)
                .nth(1)
                .then(Action::DelayReply(Duration::from_millis(1500))),
        ),
    ];
    for (i, action) in actions.iter().enumerate() {
        rules.push(
            rig.proxy.rule(
                Rule::command("update")
                    .collection(&name)
                    .nth(2 + i as u64)
                    .then(action()),
            ),
        );
    }
    let pilot = tokio::spawn({
        let counters = counters.clone();
        async move { counters.add("k", 100).await }
    });
    let proxy = &rig.proxy;
    wait_until("the pilot's update was sent", DELAY, || async {
        proxy
            .log()
            .iter()
            .any(|e| e.collection.as_deref() == Some(name.as_str()))
    })
    .await;
    let group: Vec<_> = (1..=callers as i64)
        .map(|amount| {
            let counters = counters.clone();
            tokio::spawn(async move { counters.add("k", amount).await })
        })
        .collect();
    wait_until("the callers wait behind the pilot", DELAY, || {
        let waiting = counters.lane_stats().waiting;
        async move { waiting == callers as u64 }
    })
    .await;
    let pilot = pilot.await.expect("the pilot");
    if !matches!(pilot, LaneIncrement::Counted(_)) {
        return Err(format!("the pilot: {pilot:?}"));
    }
    let told: Vec<LaneIncrement> = join_all(group)
        .await
        .into_iter()
        .map(|t| t.expect("a caller"))
        .collect();
    drop(rules);
    let log = settled_log(&rig.proxy, &name).await;
    let sum: i64 = (1..=callers as i64).sum();
    let mut diff = Vec::new();
    // The group's update: one lane and number for every caller.
    let position = told[0].position().expect("a number");
    let lane = told[0].lane().expect("a lane").key();
    if told
        .iter()
        .any(|t| t.position() != Some(position) || t.lane() != told[0].lane())
    {
        diff.push(format!("one update, one ticket: {told:?}"));
    }
    let reached = carried(&log, &lane, position, sum);
    if reached.sent == 0 {
        diff.push(format!("no update carried the group's sum {sum}"));
    }
    for (i, outcome) in told.iter().enumerate() {
        let shown = shown(outcome);
        if shown != expected(row) {
            diff.push(format!(
                "caller {i} told {shown}, expected {}",
                expected(row)
            ));
        }
        let agrees = match outcome {
            LaneIncrement::Counted(_) => reached.reached,
            LaneIncrement::NotCounted(_) => !reached.reached,
            _ => true,
        };
        if !agrees
            || outcome.amount()
                != if shown == "unknown" {
                    sum
                } else {
                    i as i64 + 1
                }
        {
            diff.push(format!("caller {i}: {outcome:?}, the log: {reached:?}"));
        }
    }
    let direct = rig.direct.collection(&name);
    let state = project(&direct, "k", &["counter", "lanes"]).await;
    if state != replay_lanes(&log, None) {
        diff.push(format!(
            "document {state:?}, the log says {:?}",
            replay_lanes(&log, None)
        ));
    }
    // Every caller resumes the shared ticket at once: counted, once.
    let tickets: Vec<_> = told
        .into_iter()
        .filter_map(|t| match t {
            LaneIncrement::Unknown(ticket) => Some(ticket),
            _ => None,
        })
        .collect();
    if !tickets.is_empty() {
        let resumed = join_all(tickets.iter().map(|t| counters.resume_lane(t.clone()))).await;
        let fresh = resumed
            .iter()
            .filter(|r| matches!(r, Ok(LaneIncrement::Counted(c)) if !c.settled_earlier()))
            .count();
        let all_counted = resumed
            .iter()
            .all(|r| matches!(r, Ok(LaneIncrement::Counted(_))));
        let first_applied = carried(&log, &lane, position, sum).reached;
        if !all_counted || fresh != usize::from(!first_applied) {
            diff.push(format!(
                "resumed: {resumed:?} (the update had reached: {first_applied})"
            ));
        }
        if tickets.iter().zip(1..).any(|(t, share)| t.share() != share) {
            diff.push(format!("each ticket names its caller's share: {tickets:?}"));
        }
    }
    let counted = if expected(row) == "not counted" {
        100
    } else {
        100 + sum
    };
    let counter = crate::common::counter(&direct, "k").await;
    if counter != counted {
        diff.push(format!("counter {counter}, expected {counted}"));
    }
    if diff.is_empty() {
        Ok(())
    } else {
        Err(diff.join("; "))
    }
}

fn shown(outcome: &LaneIncrement) -> &'static str {
    match outcome {
        LaneIncrement::Counted(c) if c.settled_earlier() => "counted (already applied)",
        LaneIncrement::Counted(_) => "counted",
        LaneIncrement::NotCounted(_) => "not counted",
        LaneIncrement::Unknown(_) => "unknown",
        LaneIncrement::OutOfOrder(_) => "out of order",
    }
}

/// How the updates of `lane` at `position` fared in the log.
#[derive(Debug)]
struct Carried {
    sent: usize,
    reached: bool,
}

/// The requests that carried the group's update (its lane, its number and
/// its sum), and whether one reached the server.
fn carried(log: &[Exchange], lane: &str, position: i64, sum: i64) -> Carried {
    let path = format!("lanes.{lane}");
    let ours: Vec<&Exchange> = log
        .iter()
        .filter(|e| {
            let Ok(updates) = e.body.get_array("updates") else {
                return false;
            };
            updates.iter().filter_map(|u| u.as_document()).any(|u| {
                let Ok(ops) = u.get_document("u") else {
                    return false;
                };
                let set = ops
                    .get_document("$set")
                    .ok()
                    .and_then(|s| s.get_i64(&path).ok());
                let inc = ops
                    .get_document("$inc")
                    .ok()
                    .and_then(|i| i.get_i32("counter").ok());
                set == Some(position) && inc == Some(sum as i32)
            })
        })
        .collect();
    Carried {
        sent: ours.len(),
        reached: ours.iter().any(|e| e.reached_server),
    }
}

/// A caller that gives up while its increment still waits is taken out of
/// its group: the update that leaves carries the others' sum only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_before_its_group_leaves_is_never_counted() {
    let rig = Rig::new("faults_group_dropped", false).await;
    let name = "views";
    let counters = Counters::try_new(
        &rig.store,
        CollectionConfig::new(name),
        WriterConfig::default(),
    )
    .expect("the default lane settings");
    let _slow = rig.proxy.rule(
        Rule::command("update")
            .collection(name)
            .nth(1)
            .then(Action::DelayReply(Duration::from_millis(1500))),
    );
    let pilot = tokio::spawn({
        let counters = counters.clone();
        async move { counters.add("k", 100).await }
    });
    let proxy = &rig.proxy;
    wait_until("the pilot's update was sent", DELAY, || async {
        proxy
            .log()
            .iter()
            .any(|e| e.collection.as_deref() == Some(name))
    })
    .await;
    let spawn_add = |amount: i64| {
        let counters = counters.clone();
        tokio::spawn(async move { counters.add("k", amount).await })
    };
    let (stays, leaves) = (spawn_add(1), spawn_add(1000));
    wait_until("both callers wait", DELAY, || {
        let waiting = counters.lane_stats().waiting;
        async move { waiting == 2 }
    })
    .await;
    leaves.abort();
    assert!(leaves.await.unwrap_err().is_cancelled());
    assert_eq!(counters.lane_stats().waiting, 1, "taken out of the queue");
    assert!(matches!(pilot.await.unwrap(), LaneIncrement::Counted(_)));
    assert!(matches!(stays.await.unwrap(), LaneIncrement::Counted(_)));
    let direct = rig.direct.collection(name);
    assert_eq!(crate::common::counter(&direct, "k").await, 101);
    let log = settled_log(&rig.proxy, name).await;
    assert_eq!(
        project(&direct, "k", &["counter", "lanes"]).await,
        replay_lanes(&log, None)
    );
}
