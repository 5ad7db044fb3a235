//! The lanes' part of the checker: callers whose increments shared one
//! update (group commit), against the proxy's log.

use std::collections::{BTreeMap, HashMap};

use super::Violation;
use crate::history::record::{Call, FinalState, Op, Oracle, Outcome};

/// Every violation of the lanes' rules.
pub(super) fn check(ops: &[Op], end: &FinalState, oracle: &Oracle, found: &mut Vec<Violation>) {
    // Per update (lane, number): the calls it carried, and whether any
    // call settled it.
    let mut carried: BTreeMap<(String, i64), Vec<usize>> = BTreeMap::new();
    let mut settled: HashMap<(String, i64), bool> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let (key, lane, position) = match &op.call {
            Call::Add {
                key,
                lane,
                position,
                ..
            } => {
                carried
                    .entry((lane.clone(), *position))
                    .or_default()
                    .push(i);
                (key, lane, *position)
            }
            Call::ResumeLane {
                key,
                lane,
                position,
                ..
            } => (key, lane, *position),
            _ => continue,
        };
        let update = (lane.clone(), position);
        let reached = oracle.lane_updates.contains_key(&update);
        let wrong = match op.outcome {
            Outcome::Counted { .. } => {
                (!reached).then_some("counted, but its update never reached the server")
            }
            Outcome::NotCounted => {
                reached.then_some("not counted, but its update reached the server")
            }
            _ => None,
        };
        if let Some(what) = wrong {
            found.push(
                Violation::new(
                    format!("{key}: lane update s = {position}: {what}"),
                    vec![i],
                )
                .about(key),
            );
        }
        if matches!(op.outcome, Outcome::Counted { .. } | Outcome::NotCounted) {
            settled.insert(update, true);
        }
    }
    let mut by_calls: BTreeMap<&str, i64> = BTreeMap::new();
    for (update, calls) in &carried {
        if !settled.get(update).copied().unwrap_or(false) {
            found.push(Violation::new(
                format!("lane update s = {} was never settled", update.1),
                calls.clone(),
            ));
        }
        let shares: i64 = calls
            .iter()
            .map(|&i| match &ops[i].call {
                Call::Add { amount, .. } => *amount,
                _ => 0,
            })
            .sum();
        if let Some((key, amount)) = oracle.lane_updates.get(update) {
            if *amount != shares {
                found.push(Violation::new(
                    format!("{key}: the update s = {} added {amount}, its callers' shares sum to {shares}", update.1),
                    calls.clone(),
                ).about(key));
            }
            *by_calls.entry(key).or_default() += shares;
        }
    }
    let mut by_oracle: BTreeMap<&str, i64> = BTreeMap::new();
    for (key, amount) in oracle.lane_updates.values() {
        *by_oracle.entry(key).or_default() += amount;
    }
    for (key, actual) in &end.lane_counters {
        let (calls, truth) = (
            by_calls.get(key.as_str()).copied().unwrap_or(0),
            by_oracle.get(key.as_str()).copied().unwrap_or(0),
        );
        if *actual != calls || *actual != truth {
            found.push(
                Violation::new(
                    format!("lane counter {key} is {actual}: its callers' counted shares sum to {calls}, the updates that reached the server to {truth}"),
                    Vec::new(),
                )
                .about(key),
            );
        }
    }
}
