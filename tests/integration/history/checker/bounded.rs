//! Bounded counters: what each token holds, by its calls and in the end.

use std::collections::{BTreeMap, BTreeSet};

use mongodb::bson::oid::ObjectId;
use tally::{GiveBack, Take};

use super::Violation;
use crate::history::record::{Call, FinalState, Op, Oracle, Outcome};

/// Every violation of the bounded counters' rules.
pub(super) fn check(ops: &[Op], end: &FinalState, oracle: &Oracle, found: &mut Vec<Violation>) {
    // Per (counter, token): the calls about it, in the order invoked.
    let mut tokens: BTreeMap<(&str, ObjectId), Vec<usize>> = BTreeMap::new();
    for (i, op) in ops.iter().enumerate() {
        if let Call::Take { key, token } | Call::GiveBack { key, token } = &op.call {
            tokens.entry((key, *token)).or_default().push(i);
        }
    }
    let mut should_hold: BTreeMap<&str, BTreeSet<ObjectId>> = BTreeMap::new();
    let mut may_hold: BTreeMap<&str, BTreeSet<ObjectId>> = BTreeMap::new();
    for ((key, token), mut calls) in tokens {
        calls.sort_by_key(|&i| ops[i].invoke);
        // Whether the token holds a unit: yes, no, or unknown (`None`).
        let mut holds = Some(false);
        let mut confirmed_by = None;
        let mut flag = |what: String, involved: Vec<usize>| {
            found.push(Violation::new(what, involved).about(key))
        };
        for &i in &calls {
            match (&ops[i].call, &ops[i].outcome) {
                (Call::Take { .. }, Outcome::Take(Take::Taken)) => {
                    if let (Some(true), Some(by)) = (holds, confirmed_by) {
                        flag(
                            format!("{key}: token {token} was given a second unit"),
                            vec![by, i],
                        );
                    }
                    (holds, confirmed_by) = (Some(true), Some(i));
                }
                (Call::Take { .. }, Outcome::Take(Take::AlreadyTaken)) => {
                    if holds == Some(false) && confirmed_by.is_some() {
                        flag(
                            format!(
                                "{key}: token {token} said already taken after its unit was given back"
                            ),
                            vec![i],
                        );
                    }
                    (holds, confirmed_by) = (Some(true), Some(i));
                }
                (Call::Take { .. }, Outcome::Take(Take::NoneLeft | Take::NotFound)) => {
                    if holds == Some(true) {
                        flag(
                            format!(
                                "{key}: token {token} held a unit, then a take with it found none"
                            ),
                            vec![i],
                        );
                    }
                    holds = Some(false);
                }
                // A failed take may have taken a unit; a failed give-back
                // may have returned one.
                (Call::Take { .. }, _) if holds == Some(false) => holds = None,
                (Call::GiveBack { .. }, Outcome::GiveBack(GiveBack::Returned)) => {
                    if holds == Some(false) {
                        flag(
                            format!("{key}: token {token} gave back a unit it did not hold"),
                            vec![i],
                        );
                    }
                    holds = Some(false);
                }
                // Unless an earlier attempt of this call, whose reply was
                // lost, gave it back: the library retried and found none.
                (Call::GiveBack { .. }, Outcome::GiveBack(GiveBack::NotHeld)) => {
                    if holds == Some(true) && !oracle.given_back.contains(&token) {
                        flag(
                            format!("{key}: token {token} held a unit, but give_back found none"),
                            vec![i],
                        );
                    }
                    holds = Some(false);
                }
                (Call::GiveBack { .. }, _) if holds == Some(true) => holds = None,
                _ => {}
            }
        }
        match holds {
            Some(true) => {
                should_hold.entry(key).or_default().insert(token);
            }
            None => {
                may_hold.entry(key).or_default().insert(token);
            }
            Some(false) => {}
        }
    }
    for (key, state) in &end.bounded {
        let key = key.as_str();
        let mut held: BTreeMap<ObjectId, usize> = BTreeMap::new();
        for token in &state.holders {
            *held.entry(*token).or_default() += 1;
        }
        for (token, n) in held.iter().filter(|(_, n)| **n > 1) {
            found.push(
                Violation::new(format!("{key}: token {token} holds {n} units"), vec![]).about(key),
            );
        }
        if state.available < 0 || state.available + state.holders.len() as i64 != state.initial {
            found.push(
                Violation::new(
                    format!(
                        "{key}: {} available + {} held is not the {} units it started with",
                        state.available,
                        state.holders.len(),
                        state.initial
                    ),
                    vec![],
                )
                .about(key),
            );
        }
        let empty = BTreeSet::new();
        let should = should_hold.get(key).unwrap_or(&empty);
        let may = may_hold.get(key).unwrap_or(&empty);
        for token in should.iter().filter(|t| !held.contains_key(t)) {
            found.push(
                Violation::new(
                    format!("{key}: token {token} was confirmed a unit, but holds none"),
                    vec![],
                )
                .about(key),
            );
        }
        for token in held
            .keys()
            .filter(|t| !should.contains(t) && !may.contains(t))
        {
            found.push(
                Violation::new(
                    format!(
                        "{key}: token {token} holds a unit no take confirmed or may have taken"
                    ),
                    vec![],
                )
                .about(key),
            );
        }
    }
}
