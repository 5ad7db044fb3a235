//! Converting a fold state of tally 0.2.0 (per-lane folded numbers and lane
//! registrations) to a watermark, once, on the first pass that meets it.

use mongodb::bson::oid::ObjectId;

use super::{EventFold, query};
use crate::error::Error;
use crate::ledger::{floor, state};

impl EventFold {
    /// Converts a fold state tally 0.2.0 wrote (per-lane folded numbers) to
    /// a watermark `W`: the highest number it folded, allowed when every
    /// event it did not fold (one recorded since, by this version's
    /// recorders or an old one's) is numbered above it — then "folded" is
    /// exactly `s ≤ W`. Otherwise (folded and unfolded numbers interleave:
    /// a recorder's clock was ahead) refused, naming what to run.
    pub(super) async fn convert(
        &self,
        state: &state::FoldState,
    ) -> Result<state::FoldState, Error> {
        let legacy = state.legacy.clone().unwrap_or_default();
        let refuse = |why: String| Error::Malformed {
            collection: self.state.name().to_owned(),
            id: state::STATE_ID.into(),
            reason: format!(
                "it was written by tally 0.2.0 and {why}: fold them with tally 0.2.0's `tallyd \
                 reconcile` (with every recorder stopped) until `tallyd status` shows no backlog, \
                 then run this version again (see the changelog)"
            ),
        };
        let before = floor::cluster_time(&self.store, &self.events_name).await?;
        let (highest_folded, lowest_unfolded) = self.split(&legacy, state).await?;
        if highest_folded >= lowest_unfolded {
            return Err(refuse(format!(
                "an event it did not fold is numbered {lowest_unfolded}, below one it folded \
                 ({highest_folded})"
            )));
        }
        let watermark = highest_folded;
        // The floor first: a watermark above the server's clock (an old
        // recorder's clock ran ahead) must never stand without it, or this
        // version's recorders, numbering by the server's clock, would
        // record below it, where no pass looks.
        let raise =
            floor::raise(&self.store, &self.events_name, watermark, &self.floor_watch).await?;
        // An insert numbered at or below the watermark that landed after
        // the scan began and before the raise (held up in the network) was
        // not folded by 0.2.0 and is not above the watermark: owed, and
        // found in the change stream by the repair pass that follows.
        let owed = state::Late {
            after: before,
            below: watermark,
        };
        if state::convert_legacy(&self.store, &self.state, state, (watermark, &raise), &owed)
            .await?
        {
            let forgotten = state::forget_legacy_registrations(&self.store, &self.state).await?;
            tracing::info!(
                events = %self.events_name,
                watermark,
                registrations = forgotten,
                "converted a fold state of tally 0.2.0 to a watermark"
            );
        }
        let converted = state::read(&self.store, &self.state).await?;
        if converted.legacy.is_some() {
            return Err(refuse(
                "another fold changed it while it was converted".into(),
            ));
        }
        Ok(converted)
    }

    /// The highest number the 0.2.0 state `state` folded and the lowest it
    /// did not (`i64::MAX`: none), from one scan of the events: each lane's
    /// lowest and highest number — a one-off, whatever the number of lanes
    /// the old state names.
    async fn split(
        &self,
        legacy: &state::Legacy,
        state: &state::FoldState,
    ) -> Result<(i64, i64), Error> {
        let folded: std::collections::HashMap<ObjectId, i64> =
            legacy.folded.iter().copied().collect();
        let mut highest_folded = state.watermark;
        let mut lowest_unfolded = i64::MAX;
        for (lane, lowest, highest) in query::lanes_span(&self.store, &self.events).await? {
            let (Some(lowest), Some(highest)) = (lowest, highest) else {
                continue;
            };
            match lane.and_then(|lane| folded.get(&lane).map(|&m| (lane, m))) {
                None => lowest_unfolded = lowest_unfolded.min(lowest),
                Some((_, m)) if highest <= m => highest_folded = highest_folded.max(highest),
                Some((_, m)) if lowest > m => lowest_unfolded = lowest_unfolded.min(lowest),
                Some((lane, m)) => {
                    highest_folded = highest_folded.max(m);
                    if let Some(above) =
                        query::first_above(&self.store, &self.events, lane, m).await?
                    {
                        lowest_unfolded = lowest_unfolded.min(above);
                    }
                }
            }
        }
        Ok((highest_folded, lowest_unfolded))
    }
}
