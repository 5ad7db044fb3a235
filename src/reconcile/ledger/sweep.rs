//! The sweep: deleting folded events once the dedupe window has passed,
//! late and in bulk, and dropping from the fold state the lanes with
//! nothing left.
//!
//! Only a sealed lane (no longer registered: no insert on it can land any
//! more) is swept, and only once its highest folded number is older than
//! `event_retention` by the server's clock: then every event of it is
//! folded and past the window, and one `deleteMany` over its folded range
//! removes them all. The lane then leaves the state (conditioned on its
//! folded number being the one read).
//!
//! A sealed lane with events above its folded number — an insert that
//! landed after its lane was sealed, against every bound the recorder
//! keeps — is registered again instead, so the next passes fold it.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Document, doc, oid::ObjectId};

use super::EventFold;
use super::query;
use crate::error::{Error, RetryBudget};
use crate::write::ledger::state::{self, STATE_ID, field};
use crate::write::ledger::{self as ledger, unix_micros};

impl EventFold {
    /// Deletes the events of every sealed lane folded and older than the
    /// dedupe window at `now` (the server's clock), and drops those lanes
    /// from the state. Returns how many events were deleted. Safe at any
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
        let cutoff = unix_micros(
            now.checked_sub(self.settings.event_retention)
                .unwrap_or(SystemTime::UNIX_EPOCH),
        );
        let registered: Vec<ObjectId> = state.registered.iter().map(|r| r.lane).collect();
        let mut deleted = 0;
        let mut gone: Vec<(ObjectId, i64)> = Vec::new();
        for (&lane, &folded) in &state.folded {
            if registered.contains(&lane) || folded > cutoff {
                continue;
            }
            if query::survey_lane(&self.store, &self.events, lane, Some(folded))
                .await?
                .is_some()
            {
                tracing::warn!(
                    events = %self.events_name,
                    lane = %lane,
                    "a sealed recorder lane has events above its folded number (an insert landed \
                     late); registering it again so they are folded"
                );
                state::register(&self.store, &self.state, lane).await?;
                continue;
            }
            let filter = doc! {
                ledger::field::LANE: lane,
                ledger::field::NUMBER: { "$lte": folded },
            };
            let mut budget = RetryBudget::retry_once("ledger.fold.delete");
            let result = self
                .store
                .with_retry(&mut budget, || self.events.delete_many(filter.clone()))
                .await
                .map_err(Error::Server)?;
            deleted += result.deleted_count;
            gone.push((lane, folded));
        }
        if !gone.is_empty() {
            let mut filter = doc! { "_id": STATE_ID };
            let mut unset = Document::new();
            for (lane, folded) in &gone {
                let path = format!("{}.{}", field::FOLDED, lane.to_hex());
                filter.insert(path.clone(), *folded);
                unset.insert(path, "");
            }
            let update = doc! { "$unset": unset };
            self.store
                .update_one(&self.state, filter, update, "ledger.fold.forget_lanes")
                .await?;
            tracing::info!(
                events = %self.events_name,
                lanes = gone.len(),
                deleted,
                retention = %humantime::format_duration(Duration::from_secs(self.settings.event_retention.as_secs())),
                "deleted folded events past the dedupe window"
            );
        }
        Ok(deleted)
    }
}
