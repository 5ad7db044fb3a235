//! The sweep: the sealed lanes' late inserts found, and their events
//! deleted once the dedupe window has passed, late and in bulk.
//!
//! A sealed lane keeps its registration (with the date of its seal, by the
//! fold's clock — the server's) until its events are deleted. The sweep
//! looks at it twice or more:
//!
//! - **While recent** (on every sweep until [`LATE_INSERT_HORIZON`] past
//!   its seal): an insert held up in the network can still land on it. A
//!   lane found with events above its folded number is registered again —
//!   live, surveyed by the next passes — so a late insert is folded within
//!   one `sweep_every` of landing; exact reads read the lane meanwhile. Past
//!   the horizon with nothing found, the lane is marked quiet: exact reads
//!   skip it.
//! - **Once the window has passed since its seal** (`event_retention` after
//!   it, by the server's clock — never the recorders', whose clocks may be
//!   behind): looked at once more for a late insert, then one `deleteMany`
//!   of its folded range removes its events, and the lane leaves the state
//!   (its folded number, then its registration). Every event of the lane
//!   was inserted before its seal, so each is kept a whole window.

use std::time::{Duration, SystemTime};

use mongodb::bson::{DateTime, doc, oid::ObjectId};

use super::EventFold;
use super::query;
use crate::error::{Error, RetryBudget};
use crate::write::ledger::state::{self, Registered, STATE_ID, field};
use crate::write::ledger::{self as ledger};

/// How long after its seal a lane is looked at by every sweep (and read by
/// exact reads) for an insert that was held up in the network and landed
/// late. One landing later is found when the lane's events are deleted,
/// and folded then.
pub(crate) const LATE_INSERT_HORIZON: Duration = Duration::from_secs(3600);

impl EventFold {
    /// Looks at the sealed lanes at `now` (the server's clock): registers
    /// again those with events landed after their seal, marks quiet the
    /// recent ones an hour after their seal, and deletes the events of
    /// those sealed a dedupe window ago. Returns how many events were
    /// deleted. Safe at any time, by any number of folds at once.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::EventFold,
    /// #     clock: tally::Reconciler,
    /// # ) -> Result<(), tally::Error> {
    /// // `fold` sweeps every `sweep_every`; sweep now, e.g. after lowering the window.
    /// let deleted = fold.sweep(clock.server_time().await?).await?;
    /// println!("{deleted} old folded events deleted");
    /// # Ok(()) }
    /// ```
    pub async fn sweep(&self, now: SystemTime) -> Result<u64, Error> {
        let state = state::read_all(&self.store, &self.state).await?;
        let mut deleted = 0;
        let mut forgotten = 0;
        for registered in &state.registered {
            let Some(sealed) = registered.sealed else {
                continue;
            };
            let due = sealed + self.settings.event_retention <= now;
            if registered.quiet && !due {
                continue;
            }
            let lane = registered.lane;
            let folded = state.folded.get(&lane).copied();
            if query::survey_lane(&self.store, &self.events, lane, folded)
                .await?
                .is_some()
            {
                tracing::warn!(
                    events = %self.events_name,
                    lane = %lane,
                    "a sealed recorder lane has events above its folded number (an insert landed \
                     late); registering it again so they are folded"
                );
                state::register_again(&self.store, &self.state, lane).await?;
            } else if due {
                deleted += self.forget(registered, folded, sealed).await?;
                forgotten += 1;
            } else if sealed + LATE_INSERT_HORIZON <= now {
                let filter =
                    doc! { "_id": lane, field::SEALED: DateTime::from_system_time(sealed) };
                let update = doc! { "$set": { field::QUIET: true } };
                self.store
                    .update_one(&self.state, filter, update, "ledger.fold.quiet_lane")
                    .await?;
            }
        }
        if forgotten > 0 {
            tracing::info!(
                events = %self.events_name,
                lanes = forgotten,
                deleted,
                retention = %humantime::format_duration(Duration::from_secs(self.settings.event_retention.as_secs())),
                "deleted folded events past the dedupe window"
            );
        }
        Ok(deleted)
    }

    /// Deletes the folded events of the sealed lane `registered` (folded up
    /// to `folded`), then its folded number, then its registration (as
    /// sealed at `sealed`) — in that order, so that a sweep stopped
    /// half-way is finished by the next. Returns how many events were
    /// deleted.
    async fn forget(
        &self,
        registered: &Registered,
        folded: Option<i64>,
        sealed: SystemTime,
    ) -> Result<u64, Error> {
        let lane: ObjectId = registered.lane;
        let mut deleted = 0;
        if let Some(folded) = folded {
            let filter = doc! {
                ledger::field::LANE: lane,
                ledger::field::NUMBER: { "$lte": folded },
            };
            let mut budget = RetryBudget::retry_once("ledger.fold.delete");
            deleted = self
                .store
                .with_retry(&mut budget, || self.events.delete_many(filter.clone()))
                .await
                .map_err(Error::Server)?
                .deleted_count;
            let path = format!("{}.{}", field::FOLDED, lane.to_hex());
            let filter = doc! { "_id": STATE_ID, &path: folded };
            let update = doc! { "$unset": { &path: "" } };
            self.store
                .update_one(&self.state, filter, update, "ledger.fold.forget_lane")
                .await?;
        }
        let filter = doc! { "_id": lane, field::SEALED: DateTime::from_system_time(sealed) };
        let mut budget = RetryBudget::retry_once("ledger.fold.forget_lane");
        self.store
            .with_retry(&mut budget, || self.state.delete_one(filter.clone()))
            .await
            .map_err(Error::Server)?;
        Ok(deleted)
    }
}
