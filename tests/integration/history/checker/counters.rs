//! The counters' part of the checker: each token's calls against each
//! other and against the oracle, every counter's final value, every read
//! between its bounds.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use mongodb::bson::oid::ObjectId;

use super::Violation;
use crate::history::record::{Call, FinalState, Op, Oracle, Outcome};

/// Every violation of the counters' rules.
pub(super) fn check(ops: &[Op], end: &FinalState, oracle: &Oracle, found: &mut Vec<Violation>) {
    let increments = Increments::collect(ops, oracle, found);
    increments.check_tokens(ops, oracle, found);
    increments.check_counters(ops, end, oracle, found);
    increments.check_reads(ops, found);
}

/// How an increment ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// A call said counted, or pending: its step 1 applied, and the token
    /// is counted by a `complete` or the fold.
    Counted,
    /// A call said not counted, none counted.
    NotCounted,
    /// Nobody learned (a crashed writer's abandoned token): what the
    /// oracle says.
    Unclaimed { reached: bool },
    /// A ticket no call settled (a violation): what the oracle says.
    Unsettled { reached: bool },
}

impl Fate {
    fn counted(self) -> bool {
        match self {
            Self::Counted => true,
            Self::NotCounted => false,
            Self::Unclaimed { reached } | Self::Unsettled { reached } => reached,
        }
    }
}

/// One increment: the call (or crashed writer) that made its token, and
/// every call about that token.
struct Token {
    origin: usize,
    key: String,
    amount: i64,
    /// Calls about the token after the origin (settles, operators).
    settles: Vec<usize>,
}

struct Increments {
    tokens: BTreeMap<ObjectId, Token>,
    fates: BTreeMap<ObjectId, Fate>,
}

impl Increments {
    fn collect(ops: &[Op], oracle: &Oracle, found: &mut Vec<Violation>) -> Self {
        let mut tokens: BTreeMap<ObjectId, Token> = BTreeMap::new();
        for (i, op) in ops.iter().enumerate() {
            let (key, amount, token) = match &op.call {
                Call::Increment {
                    key,
                    amount,
                    token: Some(token),
                } => (key, *amount, *token),
                Call::Crash { key, token, amount } => (key, *amount, *token),
                _ => continue,
            };
            if tokens.contains_key(&token) {
                found.push(
                    Violation::new(format!("token {token} made twice"), vec![i]).of_token(token),
                );
                continue;
            }
            tokens.insert(
                token,
                Token {
                    origin: i,
                    key: key.clone(),
                    amount,
                    settles: Vec::new(),
                },
            );
        }
        for (i, op) in ops.iter().enumerate() {
            let (Call::Complete { token, key } | Call::Resume { token, key, .. }) = &op.call else {
                continue;
            };
            match tokens.get_mut(token) {
                Some(t) if t.key == *key => t.settles.push(i),
                _ => found.push(
                    Violation::new(
                        format!("a settle of token {token} that no increment made"),
                        vec![i],
                    )
                    .of_token(*token),
                ),
            }
        }
        let fates = tokens
            .iter()
            .map(|(token, t)| {
                let claims = || std::iter::once(t.origin).chain(t.settles.iter().copied());
                let reached = oracle.step_1_reached.contains_key(token);
                let said = |o: fn(&Outcome) -> bool| claims().any(|i| o(&ops[i].outcome));
                let fate = if said(|o| matches!(o, Outcome::Counted { .. } | Outcome::Pending)) {
                    Fate::Counted
                } else if said(|o| *o == Outcome::NotCounted) {
                    Fate::NotCounted
                } else if matches!(ops[t.origin].call, Call::Crash { .. }) && t.settles.is_empty() {
                    Fate::Unclaimed { reached }
                } else {
                    Fate::Unsettled { reached }
                };
                (*token, fate)
            })
            .collect();
        Self { tokens, fates }
    }

    /// Per token: who counted it, and whether the calls agree with the
    /// oracle and with each other.
    fn check_tokens(&self, ops: &[Op], oracle: &Oracle, found: &mut Vec<Violation>) {
        for (token, t) in &self.tokens {
            let calls: Vec<usize> = std::iter::once(t.origin)
                .chain(t.settles.iter().copied())
                .collect();
            let with = |o: &dyn Fn(&Outcome) -> bool| -> Vec<usize> {
                calls
                    .iter()
                    .copied()
                    .filter(|&i| o(&ops[i].outcome))
                    .collect()
            };
            let mut flag = |what: String, involved: Vec<usize>| {
                found.push(
                    Violation::new(what, involved)
                        .about(&t.key)
                        .of_token(*token),
                );
            };
            let reached = oracle.step_1_reached.get(token);
            let fresh = with(&|o| *o == Outcome::Counted { earlier: false });
            if fresh.len() > 1 {
                flag(
                    format!(
                        "token {token} ({:+}) was counted by {} calls",
                        t.amount,
                        fresh.len()
                    ),
                    fresh,
                );
            }
            let counted = with(&|o| matches!(o, Outcome::Counted { .. }));
            let pending = with(&|o| *o == Outcome::Pending);
            let not_counted = with(&|o| *o == Outcome::NotCounted);
            // Either says the step 1 applied.
            let applied = [counted.clone(), pending].concat();
            if reached.is_none() && !applied.is_empty() {
                flag(
                    format!(
                        "token {token}: a call said counted or pending, but no step 1 of it reached the server"
                    ),
                    applied.clone(),
                );
            }
            if let Some((key, amount)) = reached
                && (key != &t.key || *amount != t.amount)
            {
                flag(
                    format!(
                        "token {token}: its step 1 carried {key} {amount:+}, the call said {} {:+}",
                        t.key, t.amount
                    ),
                    vec![t.origin],
                );
            }
            let fate = self.fates[token];
            if fate == Fate::NotCounted && reached.is_some() {
                flag(
                    format!(
                        "token {token} ({:+}) ended not counted, but its step 1 reached the server",
                        t.amount
                    ),
                    not_counted.clone(),
                );
            }
            let abandoned = matches!(fate, Fate::Unclaimed { .. });
            if !abandoned && counted.is_empty() && not_counted.is_empty() {
                flag(format!("ticket {token} was left unsettled"), calls.clone());
            }
            for i in with(&|o| matches!(o, Outcome::Refused(_))) {
                flag(
                    format!("resume of {token} refused: the horizon must outlast every settle"),
                    vec![i],
                );
            }
            // Once a call said its step 1 applied, no later call may say
            // it did not: a resume reads the token (or its marker) first.
            if let Some(&first) = applied.iter().min_by_key(|&&i| ops[i].ret) {
                for &i in &not_counted {
                    if ops[i].invoke > ops[first].ret {
                        flag(
                            format!(
                                "token {token}: said not counted after another call had said counted or pending"
                            ),
                            vec![first, i],
                        );
                    }
                }
            }
        }
        for (token, (key, amount)) in &oracle.step_1_reached {
            if !self.tokens.contains_key(token) {
                found.push(
                    Violation::new(
                        format!(
                            "a step 1 of {key} {amount:+} with token {token} that no call made"
                        ),
                        vec![],
                    )
                    .about(key)
                    .of_token(*token),
                );
            }
        }
    }

    /// Each counter exactly: from the calls' answers, and from the oracle.
    fn check_counters(
        &self,
        ops: &[Op],
        end: &FinalState,
        oracle: &Oracle,
        found: &mut Vec<Violation>,
    ) {
        let mut by_calls: BTreeMap<&str, i64> = BTreeMap::new();
        let mut by_oracle: BTreeMap<&str, i64> = BTreeMap::new();
        for (token, t) in &self.tokens {
            if self.fates[token].counted() {
                *by_calls.entry(&t.key).or_default() += t.amount;
            }
        }
        for (key, amount) in oracle.step_1_reached.values() {
            *by_oracle.entry(key).or_default() += amount;
        }
        let keys: BTreeSet<&str> = by_calls
            .keys()
            .chain(by_oracle.keys())
            .copied()
            .chain(end.counters.keys().map(String::as_str))
            .collect();
        for key in keys {
            let actual = end.counters.get(key).copied().unwrap_or(0);
            let (calls, truth) = (
                by_calls.get(key).copied().unwrap_or(0),
                by_oracle.get(key).copied().unwrap_or(0),
            );
            if actual != calls || actual != truth {
                let involved = ops
                    .iter()
                    .enumerate()
                    .filter(|(_, op)| {
                        matches!(op.call, Call::Read { .. }) && op.call.subject() == Some(key)
                    })
                    .map(|(i, _)| i)
                    .next_back()
                    .into_iter()
                    .collect();
                found.push(
                    Violation::new(
                        format!(
                            "counter {key} ended at {actual}; the increments that ended counted add up to {calls}, \
                             the step 1s that reached the server to {truth}"
                        ),
                        involved,
                    )
                    .about(key),
                );
            }
        }
        if end.pending_left > 0 {
            found.push(Violation::new(
                format!(
                    "{} entries left pending after every ticket was settled and the fold ran",
                    end.pending_left
                ),
                vec![],
            ));
        }
    }

    /// Every read between its two bounds, and reads never going back.
    fn check_reads(&self, ops: &[Op], found: &mut Vec<Violation>) {
        // Per key: (instant, amount) of counted acknowledgements and of
        // invocations that may count, sorted, with prefix sums.
        let mut acked: HashMap<&str, Vec<(Duration, i64)>> = HashMap::new();
        let mut invoked: HashMap<&str, Vec<(Duration, i64)>> = HashMap::new();
        for (token, t) in &self.tokens {
            let counted_at = std::iter::once(t.origin)
                .chain(t.settles.iter().copied())
                .filter(|&i| matches!(ops[i].outcome, Outcome::Counted { .. }))
                .map(|i| ops[i].ret)
                .min();
            if let Some(at) = counted_at {
                acked.entry(&t.key).or_default().push((at, t.amount));
            }
            if self.fates[token].counted() {
                invoked
                    .entry(&t.key)
                    .or_default()
                    .push((ops[t.origin].invoke, t.amount));
            }
        }
        let acked: HashMap<&str, Prefix> = acked
            .into_iter()
            .map(|(k, v)| (k, Prefix::new(v)))
            .collect();
        let invoked: HashMap<&str, Prefix> = invoked
            .into_iter()
            .map(|(k, v)| (k, Prefix::new(v)))
            .collect();
        let mut reads: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            if let (Call::Read { key }, Outcome::Value(v)) = (&op.call, &op.outcome) {
                reads.entry(key).or_default().push(i);
                let lower = acked.get(key.as_str()).map_or(0, |p| p.before(op.invoke));
                let upper = invoked.get(key.as_str()).map_or(0, |p| p.before(op.ret));
                if *v < lower || *v > upper {
                    found.push(
                        Violation::new(
                            format!(
                                "read of {key} returned {v}: increments reported counted before it was invoked add up \
                                 to {lower}, increments invoked before it returned to {upper}"
                            ),
                            vec![i],
                        )
                        .about(key),
                    );
                }
            }
        }
        for (key, mut indices) in reads {
            let value = |i: usize| match ops[i].outcome {
                Outcome::Value(v) => v,
                _ => unreachable!("only reads with a value"),
            };
            indices.sort_by_key(|&i| ops[i].ret);
            let rets: Vec<Duration> = indices.iter().map(|&i| ops[i].ret).collect();
            // The read with the highest value among those returned so far.
            let mut highest: Vec<usize> = Vec::with_capacity(indices.len());
            for &i in &indices {
                let best = match highest.last() {
                    Some(&b) if value(b) >= value(i) => b,
                    _ => i,
                };
                highest.push(best);
            }
            for &i in &indices {
                let earlier = rets.partition_point(|&r| r < ops[i].invoke);
                if earlier > 0 {
                    let b = highest[earlier - 1];
                    if value(b) > value(i) {
                        found.push(
                            Violation::new(
                                format!(
                                    "reads of {key} went back from {} to {}",
                                    value(b),
                                    value(i)
                                ),
                                vec![b, i],
                            )
                            .about(key),
                        );
                    }
                }
            }
        }
    }
}

/// Sums of amounts by instant: `before(t)` adds those strictly before `t`.
struct Prefix {
    at: Vec<Duration>,
    sums: Vec<i64>,
}

impl Prefix {
    fn new(mut items: Vec<(Duration, i64)>) -> Self {
        items.sort();
        let mut sum = 0;
        let sums = items
            .iter()
            .map(|(_, n)| {
                sum += n;
                sum
            })
            .collect();
        Self {
            at: items.into_iter().map(|(t, _)| t).collect(),
            sums,
        }
    }

    fn before(&self, t: Duration) -> i64 {
        match self.at.partition_point(|&a| a < t) {
            0 => 0,
            n => self.sums[n - 1],
        }
    }
}
