//! Numbers handed out: a sequence's, and the insert loop's ids.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use mongodb::bson::oid::ObjectId;

use super::Violation;
use crate::history::record::{Call, FinalState, InsertedDoc, Op, Oracle, Outcome};

/// No number twice, none above the final value, blocks as long as asked,
/// numbers growing in real time.
pub(super) fn check_sequences(ops: &[Op], end: &FinalState, found: &mut Vec<Violation>) {
    let mut by_name: BTreeMap<&str, Vec<(usize, i64, i64)>> = BTreeMap::new();
    for (i, op) in ops.iter().enumerate() {
        let (name, asked) = match &op.call {
            Call::Next { name } => (name, 1),
            Call::Block { name, n } => (name, i64::from(*n)),
            _ => continue,
        };
        let Outcome::Numbers { first, last } = op.outcome else {
            continue;
        };
        if first < 1 || last - first + 1 != asked {
            found.push(
                Violation::new(
                    format!("{name}: asked for {asked} numbers, got {first}..={last}"),
                    vec![i],
                )
                .about(name),
            );
        }
        by_name.entry(name).or_default().push((i, first, last));
    }
    for (name, mut handed) in by_name {
        let current = end.sequences.get(name).copied();
        handed.sort_by_key(|&(_, first, _)| first);
        for pair in handed.windows(2) {
            let ((a, _, a_last), (b, b_first, _)) = (pair[0], pair[1]);
            if b_first <= a_last {
                found.push(
                    Violation::new(
                        format!("{name}: number {b_first} handed out twice"),
                        vec![a, b],
                    )
                    .about(name),
                );
            }
        }
        for &(i, _, last) in &handed {
            if current.is_none_or(|c| last > c) {
                found.push(
                    Violation::new(
                        format!("{name}: {last} handed out, but the sequence ended at {current:?}"),
                        vec![i],
                    )
                    .about(name),
                );
            }
        }
        // Real time: a call that returned before another was invoked got
        // smaller numbers.
        handed.sort_by_key(|&(i, _, _)| ops[i].ret);
        let rets: Vec<Duration> = handed.iter().map(|&(i, _, _)| ops[i].ret).collect();
        let mut highest = Vec::with_capacity(handed.len());
        for &(i, _, last) in &handed {
            let best = match highest.last() {
                Some(&(b, b_last)) if b_last >= last => (b, b_last),
                _ => (i, last),
            };
            highest.push(best);
        }
        for &(i, first, _) in &handed {
            let earlier = rets.partition_point(|&r| r < ops[i].invoke);
            if earlier > 0 && highest[earlier - 1].1 >= first {
                let (b, b_last) = highest[earlier - 1];
                found.push(
                    Violation::new(
                        format!("{name}: {first} handed out after {b_last} had been"),
                        vec![b, i],
                    )
                    .about(name),
                );
            }
        }
    }
}

/// No id twice, each id holding its call's document, one document at
/// most per call.
pub(super) fn check_inserts(
    ops: &[Op],
    end: &FinalState,
    oracle: &Oracle,
    found: &mut Vec<Violation>,
) {
    let mut calls: HashMap<u64, usize> = HashMap::new();
    let mut ids: HashMap<i64, usize> = HashMap::new();
    let (mut returned, mut maybe) = (0, 0);
    for (i, op) in ops.iter().enumerate() {
        let Call::Insert { call, .. } = op.call else {
            continue;
        };
        calls.insert(call, i);
        match op.outcome {
            Outcome::Id(id) => {
                returned += 1;
                if let Some(&other) = ids.get(&id) {
                    found.push(Violation::new(
                        format!("insert loop: _id {id} handed out twice"),
                        vec![other, i],
                    ));
                }
                ids.insert(id, i);
            }
            Outcome::Failed {
                maybe_applied: true,
                ..
            } => maybe += 1,
            _ => {}
        }
    }
    let docs: HashMap<i64, &InsertedDoc> = end.inserted.iter().map(|d| (d.id, d)).collect();
    // The document under each id returned holds what that call sent: its
    // `call` field (or none, for an identical body) and a token its
    // inserts carried to the server.
    for (&id, &i) in &ids {
        let Call::Insert { call, tagged } = ops[i].call else {
            unreachable!()
        };
        let own = |doc: &&&InsertedDoc| {
            doc.call == tagged.then_some(call)
                && doc.token.is_some_and(|t| {
                    oracle
                        .inserts
                        .get(&t)
                        .is_some_and(|sent| sent.reached && sent.call == doc.call)
                })
        };
        match docs.get(&id) {
            Some(doc) if own(&doc) => {}
            other => found.push(Violation::new(
                format!(
                    "insert loop: _id {id} was returned to call {call}, but holds {other:?}, not what \
                     the call sent"
                ),
                vec![i],
            )),
        }
    }
    let mut per_token: HashMap<Option<ObjectId>, Vec<i64>> = HashMap::new();
    let mut per_call: HashMap<u64, Vec<i64>> = HashMap::new();
    for doc in &end.inserted {
        per_token.entry(doc.token).or_default().push(doc.id);
        let sent = doc.token.and_then(|t| oracle.inserts.get(&t));
        if !sent.is_some_and(|sent| sent.reached && sent.call == doc.call) {
            found.push(Violation::new(
                format!(
                    "insert loop: document {} (call {:?}, token {:?}) is not one an insert carried",
                    doc.id, doc.call, doc.token
                ),
                vec![],
            ));
        }
        let Some(call) = doc.call else {
            continue;
        };
        per_call.entry(call).or_default().push(doc.id);
        if let Some(&i) = calls.get(&call)
            && let Outcome::Failed {
                maybe_applied: false,
                ..
            } = ops[i].outcome
        {
            found.push(Violation::new(
                format!(
                    "insert loop: document {} stored for call {call}, which failed without writing",
                    doc.id
                ),
                vec![i],
            ));
        }
    }
    for (token, docs) in per_token.into_iter().filter(|(_, d)| d.len() > 1) {
        found.push(Violation::new(
            format!("insert loop: one call's token {token:?} is in {docs:?}"),
            vec![],
        ));
    }
    for (call, docs) in per_call.into_iter().filter(|(_, d)| d.len() > 1) {
        found.push(Violation::new(
            format!(
                "insert loop: call {call} stored {} documents, {docs:?}",
                docs.len()
            ),
            calls.get(&call).copied().into_iter().collect(),
        ));
    }
    let stored = end.inserted.len();
    if stored < returned || stored > returned + maybe {
        found.push(Violation::new(
            format!(
                "insert loop: {stored} documents, for {returned} calls that returned an id and {maybe} \
                 that failed after possibly writing"
            ),
            vec![],
        ));
    }
}
