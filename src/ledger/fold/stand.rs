//! The floor under a pass: raised before the pass reads, verified after,
//! and a floor found lowered repaired (the `floor` module says how a late
//! `collMod` lowers it).
//!
//! A range's pass folds the events of `(from, to]` that landed before its
//! **anchor**, its first raise. While the floor stays its latest raise
//! (the token in the validator says so), nothing else lands in the range,
//! so a read after the raise is that set. When the floor is found changed —
//! at a raise (the validator it replaced was not the one remembered), after
//! the read, or when a pass is resumed — the fold first records the debt
//! (the events numbered up to the remembered floor that landed after its
//! raise), raises the floor again and reads again; the events of the range
//! that landed after the anchor are taken out of the pass's sums (found in
//! the change stream, exactly those) and folded by the repair pass that
//! pays the debt. So every event is in exactly one pass: its range's, or a
//! repair's.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use super::EventFold;
use super::query::{self, Share};
use crate::document::CanonicalKey;
use crate::error::Error;
use crate::ledger::floor::{self, Raise};
use crate::ledger::state::{self, FoldState, Intent, Late};
use crate::ledger::unix_micros;

/// How many times a pass raises the floor again while it reads before it
/// gives up (each time a `collMod` it did not send changed it).
const FLOOR_ROUNDS: usize = 3;

/// How old the remembered raise may grow on an idle ledger before a pass
/// raises the floor again: a debt found later starts at most this far back
/// in the change stream.
const REFRESH: Duration = Duration::from_secs(600);

/// The sums of a pass, per counter.
pub(super) type Shares = HashMap<CanonicalKey, Share>;

/// What a pass read.
pub(super) struct Read {
    /// Its sums.
    pub(super) shares: Shares,
    /// The floor's latest raise (the state remembers it at the commit).
    pub(super) live: Raise,
    /// It found events owed: a repair pass should follow.
    pub(super) owed: bool,
    /// The debts it repays (a repair pass: its own, and one its first
    /// raise found); the commit drops them.
    pub(super) repaid: Vec<Late>,
}

impl EventFold {
    /// With no pass in progress: makes sure the events collection's floor
    /// is the last raise the state remembers. A floor changed since (a
    /// `collMod` of an earlier pass that arrived late; a validator changed
    /// by hand) is raised again, and the events that may have landed
    /// meanwhile below the watermark are recorded as owed: the next pass
    /// finds and folds them. Returns whether it wrote the state.
    pub(super) async fn keep_the_floor(
        &self,
        state: &FoldState,
        now: SystemTime,
    ) -> Result<bool, Error> {
        let found = floor::read_floor(&self.store, &self.events_name).await?;
        let Some(remembered) = &state.floor else {
            // A state that remembers no raise (written before raises were
            // remembered): raise the floor once and remember it.
            if found.value.is_some_and(|f| f < state.watermark) {
                tracing::error!(
                    events = %self.events_name,
                    floor = ?found.value,
                    watermark = state.watermark,
                    "the events collection's floor was below the fold's watermark, and the \
                     state remembers no raise to look for late events from; raised again"
                );
            }
            let raise = floor::raise(
                &self.store,
                &self.events_name,
                state.watermark,
                &self.floor_watch,
            )
            .await?;
            return state::record_floor(&self.store, &self.state, None, &raise).await;
        };
        let to = state.watermark.max(remembered.floor);
        if found.is(remembered) {
            if !due(remembered, now) {
                return Ok(false);
            }
            // An idle ledger: raise the floor again, so that a debt found
            // later need not reach far back in the change stream.
            let (raise, foreign) = floor::raise_over(
                &self.store,
                &self.events_name,
                to,
                Some(remembered),
                &self.floor_watch,
            )
            .await?;
            if foreign && !self.owe_on_floor(remembered).await? {
                return Ok(true);
            }
            return state::record_floor(&self.store, &self.state, Some(remembered), &raise).await;
        }
        tracing::error!(
            events = %self.events_name,
            floor = ?found.value,
            watermark = state.watermark,
            "the events collection's floor was changed since the fold last raised it (a collMod \
             of an earlier pass that arrived late, or a validator changed by hand); raised \
             again — the events that landed meanwhile below the watermark are found in the \
             change stream and folded by the next pass"
        );
        if !self.owe_on_floor(remembered).await? {
            // The state changed since it was read: the next pass judges.
            return Ok(true);
        }
        let raise = floor::raise(&self.store, &self.events_name, to, &self.floor_watch).await?;
        state::record_floor(&self.store, &self.state, Some(remembered), &raise).await?;
        Ok(true)
    }

    /// The shares of the pass `intent`, the floor standing at its end from
    /// before the read to after it (see [`Read`]).
    pub(super) async fn read_pass(
        &self,
        state: &FoldState,
        intent: &Intent,
    ) -> Result<Read, Error> {
        let mut owed = false;
        let mut repaid = intent.late.clone();
        let (anchor, mut live) = match &intent.anchor {
            Some(anchor) => {
                let live = intent.live.clone().unwrap_or_else(|| anchor.clone());
                // Resumed: the floor must still be its latest raise.
                let found = floor::read_floor(&self.store, &self.events_name).await?;
                let live = if found.is(&live) {
                    live
                } else {
                    owed = true;
                    self.raise_again(intent, anchor).await?
                };
                (anchor.clone(), live)
            }
            None => {
                // From here no event numbered at or below the pass's end
                // can land.
                let (raise, foreign) = floor::raise_over(
                    &self.store,
                    &self.events_name,
                    intent.to,
                    state.floor.as_ref(),
                    &self.floor_watch,
                )
                .await?;
                if foreign && let Some(remembered) = &state.floor {
                    tracing::error!(
                        events = %self.events_name,
                        pass = intent.pass,
                        "the fold's raise of the floor replaced one it did not make (a collMod \
                         of an earlier pass that arrived late); the events that landed \
                         meanwhile below the watermark are owed and folded by a repair pass"
                    );
                    let debt = debt_from(remembered);
                    if intent.late.is_empty() {
                        self.owe_in_pass(intent, &debt).await?;
                        owed = true;
                    } else {
                        // A repair pass repays it with its own debts: it
                        // reads the change stream up to its anchor anyway.
                        self.owe_in_repair(intent, &debt).await?;
                        if !repaid.contains(&debt) {
                            repaid.push(debt);
                        }
                    }
                }
                self.record_raise(intent, &raise, true).await?;
                (raise.clone(), raise)
            }
        };
        if !repaid.is_empty() {
            let shares = self.repair_shares(intent, &repaid, &anchor).await?;
            return Ok(Read {
                shares,
                live,
                owed,
                repaid,
            });
        }
        for _ in 0..FLOOR_ROUNDS {
            let mut shares = Shares::new();
            query::sum_range(
                &self.store,
                &self.events,
                (intent.from, intent.to),
                &mut shares,
            )
            .await?;
            let found = floor::read_floor(&self.store, &self.events_name).await?;
            if !found.is(&live) {
                owed = true;
                live = self.raise_again(intent, &anchor).await?;
                continue;
            }
            // The floor is the latest raise again; whether it stood the
            // whole time (a floor taken away and put back as it was reads
            // the same) is told by a raise over it, which sees every
            // validation change since.
            let (check, foreign) = floor::raise_over(
                &self.store,
                &self.events_name,
                intent.to,
                Some(&live),
                &self.floor_watch,
            )
            .await?;
            if foreign {
                // Changed under the read: what landed after the anchor is
                // the repair's, as when the token changed.
                owed = true;
                self.changed_under(intent, &anchor).await?;
                self.record_raise(intent, &check, false).await?;
                live = check;
                continue;
            }
            if live != anchor {
                // The range's events that landed after the anchor are
                // the repair's, not this pass's.
                let landed = floor::landed(
                    &self.store,
                    &self.events_name,
                    anchor.at,
                    &live,
                    intent.to,
                    |s, _| intent.folds(s),
                )
                .await?;
                query::take_out(&mut shares, &landed);
            }
            // From `live` to `check` the floor stood: `check` is the
            // raise the pass stands on, remembered before any counter is
            // written (a pass resumed finds the floor it left).
            self.record_raise(intent, &check, false).await?;
            return Ok(Read {
                shares,
                live: check,
                owed,
                repaid,
            });
        }
        Err(Error::FoldPassLost {
            events: self.events_name.clone(),
            pass: intent.pass,
            why: format!(
                "the events collection's floor was changed {FLOOR_ROUNDS} times while it read \
                 its range (collMods it did not send)"
            ),
        })
    }

    /// The floor was changed under the pass `intent` since its anchor:
    /// records the debt, raises it again and remembers the raise.
    async fn raise_again(&self, intent: &Intent, anchor: &Raise) -> Result<Raise, Error> {
        // The debt first: the raise takes the changed floor away.
        self.changed_under(intent, anchor).await?;
        let raise =
            floor::raise(&self.store, &self.events_name, intent.to, &self.floor_watch).await?;
        self.record_raise(intent, &raise, false).await?;
        Ok(raise)
    }

    /// Records that the floor was changed under the pass `intent` since its
    /// anchor: the events that landed after it are owed.
    async fn changed_under(&self, intent: &Intent, anchor: &Raise) -> Result<(), Error> {
        tracing::error!(
            events = %self.events_name,
            pass = intent.pass,
            "the events collection's floor was changed under a fold pass (a collMod of an \
             earlier pass that arrived late, or a validator changed by hand); raised again — \
             the events that landed meanwhile are owed and folded by a repair pass"
        );
        let debt = Late {
            after: anchor.at,
            below: intent.to,
        };
        self.owe_in_pass(intent, &debt).await
    }

    /// The sums of the events a repair pass owes for the debts `late`:
    /// found in the change stream, from the earliest debt to the pass's
    /// anchor.
    async fn repair_shares(
        &self,
        intent: &Intent,
        late: &[Late],
        anchor: &Raise,
    ) -> Result<Shares, Error> {
        let after = late.iter().map(|l| l.after).min();
        let below = late.iter().map(|l| l.below).max();
        let (Some(after), Some(below)) = (after, below) else {
            return Ok(Shares::new());
        };
        let landed = floor::landed(
            &self.store,
            &self.events_name,
            after,
            anchor,
            below,
            |s, at| late.iter().any(|late| late.owes(s, at)),
        )
        .await?;
        if !landed.is_empty() {
            tracing::warn!(
                events = %self.events_name,
                pass = intent.pass,
                found = landed.len(),
                "found events that landed below the watermark while a late collMod held the \
                 floor down; this pass folds them"
            );
        }
        let mut shares = Shares::new();
        query::put_in(&mut shares, &landed);
        Ok(shares)
    }

    async fn record_raise(
        &self,
        intent: &Intent,
        raise: &Raise,
        anchor: bool,
    ) -> Result<(), Error> {
        let id = (self.owner, intent.pass);
        if state::record_raise(&self.store, &self.state, id, raise, anchor).await? {
            return Ok(());
        }
        if anchor {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: intent.pass,
                why: "it has an anchor already (another fold took it over, or an earlier \
                      attempt's write arrived late); the next pass resumes it from that anchor"
                    .into(),
            });
        }
        Err(self.lost(intent))
    }

    async fn owe_in_pass(&self, intent: &Intent, late: &Late) -> Result<(), Error> {
        let id = (self.owner, intent.pass);
        if state::owe_in_pass(&self.store, &self.state, id, late).await? {
            return Ok(());
        }
        Err(self.lost(intent))
    }

    async fn owe_in_repair(&self, intent: &Intent, late: &Late) -> Result<(), Error> {
        let id = (self.owner, intent.pass);
        if state::owe_in_repair(&self.store, &self.state, id, late).await? {
            return Ok(());
        }
        Err(self.lost(intent))
    }

    /// `false`: the state remembers another raise since, or a pass is in
    /// progress (a pass committed, a repair ran or runs): whoever changed
    /// it judges the floor from there.
    async fn owe_on_floor(&self, remembered: &Raise) -> Result<bool, Error> {
        state::owe_on_floor(&self.store, &self.state, remembered, &debt_from(remembered)).await
    }

    fn lost(&self, intent: &Intent) -> Error {
        Error::FoldPassLost {
            events: self.events_name.clone(),
            pass: intent.pass,
            why: "another fold took it over".into(),
        }
    }
}

/// The debt of a floor changed after the raise `remembered`: the events
/// numbered up to its floor that landed after it.
fn debt_from(remembered: &Raise) -> Late {
    Late {
        after: remembered.at,
        below: remembered.floor,
    }
}

/// Whether the raise `remembered` is old enough at `now` to raise the
/// floor again.
fn due(remembered: &Raise, now: SystemTime) -> bool {
    let now_secs = unix_micros(now) / 1_000_000;
    now_secs - i64::from(remembered.at.time) > REFRESH.as_secs() as i64
}
