//! What one [`EventFold`](super::EventFold) keeps between its steps: its
//! lane with the next number, the batches it gave up on, and the guard
//! that retires the lane when a claimed batch is not confirmed applied
//! (the invariant of the fold's module docs).

use std::collections::HashSet;

use mongodb::bson::oid::ObjectId;

/// The fold lane and what this fold gave up on.
#[derive(Debug, Default)]
pub(super) struct FoldState {
    /// The current lane and its next number; none until the first claim,
    /// and after the lane was retired.
    pub(super) lane: Option<(ObjectId, i64)>,
    /// Batches whose claim was confirmed but which this fold could not
    /// finish: the next pass recovers them at once.
    pub(super) abandoned: HashSet<ObjectId>,
}

/// A claimed batch not confirmed applied yet: unless disarmed, dropping it
/// retires the fold lane and leaves the batch to the next pass's recovery.
pub(super) struct Unapplied<'a> {
    state: &'a mut FoldState,
    batch: ObjectId,
    armed: bool,
}

impl<'a> Unapplied<'a> {
    pub(super) fn arm(state: &'a mut FoldState, batch: ObjectId) -> Self {
        Self {
            state,
            batch,
            armed: true,
        }
    }

    /// The batch is applied on every counter it touches: the lane goes on.
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Unapplied<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state.lane = None;
            self.state.abandoned.insert(self.batch);
        }
    }
}
