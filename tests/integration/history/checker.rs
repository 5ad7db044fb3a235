//! The checker: a pure function over a recorded history, the final state
//! and the proxy's oracle, asserting what a Jepsen counter checker asserts,
//! tightened.
//!
//! - **Counters.** Every read of a key is at least the sum of the
//!   increments a call had reported counted *before the read was invoked*
//!   and at most the sum of those *invoked before it returned* (less the
//!   ones that ended not counted); reads never go backwards in real time
//!   (amounts are positive). After everything is settled each counter is
//!   exactly the sum of its increments that ended counted — and exactly
//!   the sum of the tokens whose step 1 the proxy saw reach the server.
//!   Per token: at most one call counted it (`settled_earlier == false`),
//!   no call said counted or pending without its step 1 reaching the
//!   server, none ended not counted with it there, none said not counted
//!   after another call had said counted, no ticket was refused or left
//!   unsettled.
//! - **Sequences.** No number twice (across `next` and blocks), every
//!   number at most the final value, a block as long as asked, and numbers
//!   grow in real time.
//! - **The insert loop.** No id twice; the document under each returned id
//!   is that call's (its `call` field and the token its inserts carried);
//!   one document at most per call, none for a call that failed without
//!   possibly writing; so the documents number the calls that returned an
//!   id plus at most those that failed after possibly writing.
//! - **Lane increments (group commit).** Each caller's outcome agrees
//!   with the oracle: counted only if its update (lane, number) reached
//!   the server, not counted only if it never did; every unknown one is
//!   settled by a resume; each update that reached the server carried
//!   exactly the sum of its callers' shares; each lane counter is exactly
//!   the sum of its updates that reached the server — and of the shares
//!   of the calls they carried.
//! - **Bounded counters.** A token holds at most one unit and is never
//!   told `Taken` twice for one holding; `available + holders` is the
//!   initial stock; every unit confirmed taken and not given back is held,
//!   every unit given back is not.

mod bounded;
mod counters;
mod ids;
mod lanes;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use mongodb::bson::oid::ObjectId;

use super::record::{Call, FinalState, Op, Oracle};

/// One thing the history shows that must not happen.
#[derive(Debug, Clone)]
pub struct Violation {
    pub what: String,
    /// The calls at the heart of it (indices into the history).
    pub ops: Vec<usize>,
    /// The key, sequence or bounded counter it is about.
    pub subject: Option<String>,
    /// The increment token it is about.
    pub token: Option<ObjectId>,
}

impl Violation {
    pub(super) fn new(what: String, ops: Vec<usize>) -> Self {
        Self {
            what,
            ops,
            subject: None,
            token: None,
        }
    }

    pub(super) fn about(mut self, subject: &str) -> Self {
        self.subject = Some(subject.to_owned());
        self
    }

    pub(super) fn of_token(mut self, token: ObjectId) -> Self {
        self.token = Some(token);
        self
    }
}

/// Every violation in the history, in the order the checks run.
pub fn check(ops: &[Op], end: &FinalState, oracle: &Oracle) -> Vec<Violation> {
    let mut found = Vec::new();
    counters::check(ops, end, oracle, &mut found);
    ids::check_sequences(ops, end, &mut found);
    ids::check_inserts(ops, end, oracle, &mut found);
    bounded::check(ops, end, oracle, &mut found);
    lanes::check(ops, end, oracle, &mut found);
    found
}

/// The violation, with the slice of history around it: its own calls, then
/// the calls about the same subject or token overlapping them (at most
/// `limit` lines).
pub fn explain(ops: &[Op], v: &Violation, limit: usize) -> String {
    let mut text = format!("{}\n", v.what);
    let involved: BTreeSet<usize> = v.ops.iter().copied().collect();
    let (from, to) = involved
        .iter()
        .map(|&i| (ops[i].invoke, ops[i].ret))
        .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)))
        .map_or((Duration::ZERO, Duration::MAX), |(a, b)| {
            (
                a.saturating_sub(Duration::from_millis(500)),
                b + Duration::from_millis(500),
            )
        });
    let related = |op: &Op| {
        v.token.is_some() && op.call.token() == v.token
            || (v.subject.is_some()
                && op.call.subject() == v.subject.as_deref()
                && op.ret >= from
                && op.invoke <= to)
            || (op.call == Call::Fold && op.ret >= from && op.invoke <= to)
    };
    let mut shown: Vec<usize> = (0..ops.len())
        .filter(|&i| involved.contains(&i) || related(&ops[i]))
        .collect();
    shown.sort_by_key(|&i| (ops[i].invoke, i));
    let total = shown.len();
    // Keep the involved calls, then the nearest others.
    if total > limit {
        let centre = involved
            .iter()
            .next()
            .map_or(Duration::ZERO, |&i| ops[i].invoke);
        let mut others: Vec<usize> = shown
            .iter()
            .copied()
            .filter(|i| !involved.contains(i))
            .collect();
        others.sort_by_key(|&i| ops[i].invoke.abs_diff(centre));
        others.truncate(limit.saturating_sub(involved.len()));
        shown = involved.iter().copied().chain(others).collect();
        shown.sort_by_key(|&i| (ops[i].invoke, i));
    }
    for i in &shown {
        let mark = if involved.contains(i) { "»" } else { " " };
        let _ = writeln!(text, "  {mark} #{i:<6} {}", ops[*i]);
    }
    if total > shown.len() {
        let _ = writeln!(
            text,
            "    … {} more related calls not shown",
            total - shown.len()
        );
    }
    text
}

#[cfg(test)]
mod tests;
