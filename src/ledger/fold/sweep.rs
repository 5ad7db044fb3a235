//! The sweep: events the fold is past, deleted once the dedupe window has
//! passed, late and in bulk.
//!
//! An event is deleted once it is **older than `event_retention`** by its
//! number — the server's time when its recorder numbered it, never a
//! recorder's own clock — and **folded**: its insert committed before the
//! fold's position in the log. A number does not say when its insert
//! committed, only that it committed after the number was taken and within
//! two attempts of it ([`EventFold::uncertainty`]); so the sweep deletes
//! what is numbered at or below both `now − retention` and the position's
//! time less that reach: one `deleteMany` on `{s: 1}` (one seek first: most
//! sweeps find nothing due and write nothing). A redelivery inside the
//! window finds its key; one after it is a new event (see the window's
//! floor, [`super::retention_floor`]).
//!
//! There is no TTL index: a TTL monitor deletes by age alone, and a fold
//! stopped longer than the window (then caught up from the collection by
//! `tallyd fold-from`) would find its events gone.

use std::time::SystemTime;

use mongodb::ClientSession;
use mongodb::bson::doc;

use super::EventFold;
use crate::error::{Error, RetryBudget};
use crate::ledger::{field, unix_micros};

impl EventFold {
    /// Deletes the folded events older than the dedupe window at `now`
    /// (the server's clock). Returns how many were deleted. Safe at any
    /// time, by any number of folds at once; deletes nothing while the
    /// fold catches up or is stopped.
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
        let mut session: ClientSession = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        self.saw(&session);
        let Some(position) = state.position.as_ref().filter(|_| {
            state.catch_up.is_none() && state.stopped.is_none() && state.earlier.is_none()
        }) else {
            return Ok(0);
        };
        let window_start = now
            .checked_sub(self.settings.event_retention)
            .map_or(0, unix_micros);
        let folded = position
            .wall_time()
            .checked_sub(self.uncertainty())
            .map_or(0, unix_micros);
        let upto = window_start.min(folded);
        let due = doc! { field::NUMBER: { "$lte": upto } };
        // Most sweeps find nothing due: one index seek, no write.
        if upto <= 0
            || self
                .store
                .find_one(&self.events, due.clone(), doc! { "_id": 1 }, "ledger.sweep")
                .await?
                .is_none()
        {
            return Ok(0);
        }
        let mut budget = RetryBudget::retry_once("ledger.sweep.delete");
        let deleted = self
            .store
            .with_retry(&mut budget, || self.events.delete_many(due.clone()))
            .await
            .map_err(Error::Server)?
            .deleted_count;
        if deleted > 0 {
            tracing::info!(
                events = %self.events_name,
                deleted,
                retention = %humantime::format_duration(self.settings.event_retention),
                "deleted folded events past the dedupe window"
            );
        }
        Ok(deleted)
    }
}
