//! The sweep: folded events deleted once the dedupe window has passed,
//! late and in bulk.
//!
//! An event is deleted once it is **folded** (numbered at or below the
//! watermark) and **older than `event_retention`** by its number — the
//! server's time when its recorder numbered it, never a recorder's own
//! clock: one `deleteMany` of the range `s ≤ min(W, now − retention)` on
//! `{s: 1}`. A redelivery inside the window finds its key; one after it is
//! a new event (see the window's floor, [`super::retention_floor`]).

use std::time::{Duration, SystemTime};

use mongodb::bson::doc;

use super::{EventFold, query};
use crate::error::{Error, RetryBudget};
use crate::ledger::{field, state, unix_micros};

impl EventFold {
    /// Deletes the folded events older than the dedupe window at `now`
    /// (the server's clock). Returns how many were deleted. Safe at any
    /// time, by any number of folds at once.
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
        let state = state::read(&self.store, &self.state).await?;
        if state.legacy.is_some() {
            return Err(state::not_converted(&self.state));
        }
        let window_start = now
            .checked_sub(self.settings.event_retention)
            .map_or(0, unix_micros);
        let upto = state.watermark.min(window_start);
        // Most sweeps find nothing due: one index seek, no write.
        if upto <= 0 || !query::any_in(&self.store, &self.events, i64::MIN, upto).await? {
            return Ok(0);
        }
        let filter = doc! { field::NUMBER: { "$lte": upto } };
        let mut budget = RetryBudget::retry_once("ledger.fold.delete");
        let deleted = self
            .store
            .with_retry(&mut budget, || self.events.delete_many(filter.clone()))
            .await
            .map_err(Error::Server)?
            .deleted_count;
        if deleted > 0 {
            tracing::info!(
                events = %self.events_name,
                deleted,
                retention = %humantime::format_duration(Duration::from_secs(
                    self.settings.event_retention.as_secs()
                )),
                "deleted folded events past the dedupe window"
            );
        }
        Ok(deleted)
    }
}
