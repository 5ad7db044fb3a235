//! Many counters through one lane at one position, in one `update` command:
//! the fold's sums of a pass.
//!
//! Each statement is the lanes protocol's own conditioned upsert
//! ([`statement`]), so it applies at most once whatever is sent again; the
//! command only saves the round trips (the test server applies a command
//! of 100 statements in about half the time of 100 single updates). An
//! unordered `update` reports every statement that did not apply as a
//! write error with its index: every other statement applied. A statement
//! with an error — a collision on `_id` (the lane holds the position
//! already, the counter is a double that cannot take the amount, or a
//! concurrent first insert) or a refusal of that counter — is sent again
//! alone, which tells which; so is every statement of a command whose
//! reply does not account for each of them. A command that failed as a
//! whole after its retry (an outage) may have applied any statement: each
//! is unknown, and the fold resumes its pass later.

use std::collections::HashSet;
use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};

use super::outcome::{check_amount, check_position};
use super::{By, LaneId, LaneIncrement, LaneOp, Sent, statement, undecided};
use crate::document::integer_value;
use crate::error::{Effect, Error, ErrorClass, RetryBudget};
use crate::write::counter::Counters;

/// A command's statements stop growing at this many bytes (keys can be
/// large documents): the caller's batch goes in more than one command then.
const BYTES: usize = 4 * 1024 * 1024;

/// The statements of one command: each with its sum's index in the
/// caller's order and its operation.
#[derive(Default)]
struct Chunk {
    ops: Vec<(usize, LaneOp)>,
    updates: Vec<Bson>,
    bytes: usize,
}

impl Counters {
    /// Adds each `(key, amount)` of `sums` (amounts not zero) through the
    /// minted lane `lane` at `position`, as [`Counters::add_through`] does
    /// one by one, in one command (more when the keys pass 4 MB); the
    /// outcomes in the order of `sums`. `resumed`: a batch being finished
    /// again, whose earlier updates may have applied.
    pub(crate) async fn add_many_through(
        &self,
        sums: Vec<(Bson, i64)>,
        lane: &LaneId,
        position: i64,
        resumed: bool,
    ) -> Vec<LaneIncrement> {
        let by = if resumed { By::Resume } else { By::Increment };
        let mut outcomes: Vec<Option<LaneIncrement>> = Vec::with_capacity(sums.len());
        let mut chunk = Chunk::default();
        for (at, (key, amount)) in sums.into_iter().enumerate() {
            let op = LaneOp {
                key,
                lane: lane.clone(),
                position,
                amount,
            };
            let usable = self.lanes.as_ref().map_err(Clone::clone).and_then(|_| {
                check_amount(amount)?;
                check_position(&op.lane, position)
            });
            if let Err(cause) = usable {
                outcomes.push(Some(op.outcome(undecided(by, false, cause))));
                continue;
            }
            outcomes.push(None);
            let (filter, update) = statement(&self.spec, &op);
            let one = doc! { "q": filter, "u": update, "upsert": true };
            chunk.bytes += one.to_vec().map_or(BYTES, |raw| raw.len());
            chunk.ops.push((at, op));
            chunk.updates.push(Bson::Document(one));
            if chunk.bytes >= BYTES {
                for (at, outcome) in self.send_chunk(std::mem::take(&mut chunk), by).await {
                    outcomes[at] = Some(outcome);
                }
            }
        }
        if !chunk.ops.is_empty() {
            for (at, outcome) in self.send_chunk(chunk, by).await {
                outcomes[at] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.expect("every sum has an outcome"))
            .collect()
    }

    /// One command of `chunk`'s statements; each one's outcome with its
    /// index in the caller's order.
    async fn send_chunk(&self, chunk: Chunk, by: By) -> Vec<(usize, LaneIncrement)> {
        const OPERATION: &str = "lane.add_many";
        let Chunk { ops, updates, .. } = chunk;
        let namespace = self.collection.namespace();
        let mut command = doc! {
            "update": &namespace.coll,
            "updates": updates,
            "ordered": false,
        };
        if let Some(concern) = self.collection.write_concern()
            && let Ok(concern) = mongodb::bson::serialize_to_document(concern)
        {
            command.insert("writeConcern", concern);
        }
        let database = self.collection.client().database(&namespace.db);
        let mut budget = RetryBudget::retry_once(OPERATION);
        let reply = self
            .store
            .with_retry(&mut budget, || database.run_command(command.clone()))
            .await;
        let mut outcomes = Vec::with_capacity(ops.len());
        let reply = match reply {
            Ok(reply) => reply,
            // The server refused the command itself (not an outage): each
            // statement alone tells its own outcome — as a resume when an
            // earlier attempt may have applied it.
            Err(failure) if failure.class == ErrorClass::Command => {
                let again = if budget.maybe_applied() {
                    By::Resume
                } else {
                    by
                };
                for (at, op) in ops {
                    let sent = self.send(Duration::MAX, &op, again).await;
                    outcomes.push((at, op.outcome(sent)));
                }
                return outcomes;
            }
            Err(failure) => {
                let maybe_applied = budget.maybe_applied() || failure.effect != Effect::NotApplied;
                let cause = Error::Server(failure);
                for (at, op) in ops {
                    let sent = undecided(by, maybe_applied, cause.clone());
                    outcomes.push((at, op.outcome(sent)));
                }
                return outcomes;
            }
        };
        let failed = failed_statements(&reply);
        let applied = ops.len() - failed.len();
        // `n`: the statements that matched or upserted a document.
        let accounted = reply.get("n").and_then(integer_value) == Some(applied as i64)
            && reply.get("writeConcernError").is_none();
        let again = if budget.maybe_applied() || !accounted {
            By::Resume
        } else {
            by
        };
        for (index, (at, op)) in ops.into_iter().enumerate() {
            let sent = if accounted && !failed.contains(&index) {
                Sent::Applied
            } else {
                self.send(Duration::MAX, &op, again).await
            };
            outcomes.push((at, op.outcome(sent)));
        }
        outcomes
    }
}

/// The indexes of the statements an `update` reply reports as write errors.
fn failed_statements(reply: &Document) -> HashSet<usize> {
    let Ok(errors) = reply.get_array("writeErrors") else {
        return HashSet::new();
    };
    errors
        .iter()
        .filter_map(|error| match error {
            Bson::Document(error) => error.get("index").and_then(integer_value),
            _ => None,
        })
        .filter_map(|index| usize::try_from(index).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_names_the_statements_that_did_not_apply() {
        let reply = doc! {
            "n": 2, "nModified": 1,
            "writeErrors": [
                { "index": 1, "code": 11000, "errmsg": "E11000 duplicate key" },
                { "index": 3_i64, "code": 121, "errmsg": "Document failed validation" },
            ],
            "ok": 1.0,
        };
        assert_eq!(failed_statements(&reply), HashSet::from([1, 3]));
        assert!(failed_statements(&doc! { "n": 4, "ok": 1.0 }).is_empty());
    }
}
