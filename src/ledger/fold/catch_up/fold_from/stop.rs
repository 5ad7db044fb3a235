//! What a stopped fold had counted, as far as its state tells: where
//! `tallyd fold-from` starts by default, and which events it cannot be sure
//! of.
//!
//! A fold stops where the log it followed is lost, so which events it had
//! counted is known only as nearly as their numbers tell (the server's
//! clock as their recorders reckoned it, never ahead of it, and an insert
//! commits within [`EventFold::uncertainty`] of its number):
//!
//! - **following the log**, it counted every insert that committed up to
//!   its position. Its stop is the number of the event whose insert the
//!   position is; a position that is no insert (a catch-up's boundary, an
//!   idle fold's) stands just before its cluster time's second, so the
//!   events of that second are counted again — some twice, all named —
//!   rather than any of them not at all. In doubt: the events numbered
//!   from one uncertainty before the position's second to its end, and
//!   those of a pass left in progress (a counter may have applied it).
//! - **catching up**, it counted the events numbered up to its progress
//!   that committed at or before its boundary. Its stop is its progress;
//!   in doubt: the events numbered from one uncertainty before the
//!   boundary up to the progress, and those of a chunk left in progress.
//!
//! The events without a number cannot be dated: they were counted if the
//! log or a last chunk took them, which only a state that never counted
//! them rules out.

use std::collections::HashSet;
use std::time::Duration;

use mongodb::ClientSession;
use mongodb::bson::doc;
use mongodb::options::ReadConcern;

use super::{UNCERTAIN_LISTED, UncertainEvent};
use crate::document::{CanonicalKey, integer_value};
use crate::error::Error;
use crate::ledger::fold::EventFold;
use crate::ledger::fold::catch_up::range;
use crate::ledger::log::Position;
use crate::ledger::scan::{Matching, events_matching};
use crate::ledger::state::{CatchUp, FoldState, Pass, Window};
use crate::ledger::{field, time_of, unix_micros};

/// What a stopped fold had counted (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stop {
    /// Every event numbered at or below it was counted, as nearly as can
    /// be told: the default TIME. `None`: none was.
    pub(super) number: Option<i64>,
    /// The events numbered in `(low, high]` may have been counted or not.
    pub(super) doubt: Option<(i64, i64)>,
    /// Whether the events without a number may have been counted.
    pub(super) unnumbered_counted: bool,
}

/// The events a fold from a chosen time cannot be sure of: those listed
/// (at most [`UNCERTAIN_LISTED`]), how many in all, and the numbers they
/// lie between.
pub(super) struct Uncertain {
    pub(super) listed: Vec<UncertainEvent>,
    pub(super) total: u64,
    pub(super) between: (i64, i64),
}

impl Uncertain {
    /// Leaves out the listed events among `later` (inserts the log counts
    /// whatever their number), and from the total.
    pub(super) fn leave_out(&mut self, later: &HashSet<CanonicalKey>) {
        let listed = self.listed.len();
        self.listed
            .retain(|event| !later.contains(&CanonicalKey::of(&event.key)));
        self.total = self
            .total
            .saturating_sub((listed - self.listed.len()) as u64);
    }
}

impl EventFold {
    /// What the stopped fold of `state` had counted.
    pub(super) async fn stop_of(&self, state: &FoldState) -> Result<Stop, Error> {
        let reach = micros(self.uncertainty());
        if let Some(catch_up) = &state.catch_up {
            return Ok(catching_up(catch_up, state.intent.as_ref(), reach));
        }
        let Some(position) = stopped_position(state) else {
            return Ok(Stop {
                number: None,
                doubt: None,
                unnumbered_counted: false,
            });
        };
        let second = unix_micros(position.wall_time());
        let mut high = second + SECOND;
        if let Some(Pass {
            window: Window::Log { to: Some(to), .. },
            ..
        }) = &state.intent
        {
            high = high.max(unix_micros(to.at.wall_time()) + SECOND);
        }
        Ok(Stop {
            number: Some(self.number_at(position).await?),
            doubt: Some((second - reach, high)),
            unnumbered_counted: true,
        })
    }

    /// The number of the event whose insert `position` is, or just before
    /// its second (see the module docs).
    async fn number_at(&self, position: &Position) -> Result<i64, Error> {
        let fallback = unix_micros(position.wall_time()) - 1;
        let Some(key) = &position.event else {
            return Ok(fallback);
        };
        let found = self
            .store
            .find_one(
                &self.events,
                doc! { "_id": key.clone() },
                doc! { field::NUMBER: 1 },
                "ledger.fold_from.stop",
            )
            .await?;
        Ok(found
            .and_then(|event| event.get(field::NUMBER).and_then(integer_value))
            .unwrap_or(fallback))
    }

    /// The events a fold from `since` (a number) after `stop` cannot be
    /// sure of: those `stop` doubts, those between the stop and `since`
    /// (counted twice when `since` is earlier, not at all when later), and
    /// the events without a number when they may have been counted. Read
    /// at read concern `majority` in `session` (causally after the
    /// catch-up's boundary).
    pub(super) async fn uncertain(
        &self,
        session: &mut ClientSession,
        stop: &Stop,
        since: i64,
    ) -> Result<Uncertain, Error> {
        const OPERATION: &str = "ledger.fold_from.uncertain";
        let between = match (stop.doubt, stop.number) {
            (Some((low, high)), Some(_)) => Some((low.min(since), high.max(since))),
            (Some(doubt), None) => Some(doubt),
            (None, Some(number)) => Some((number.min(since), number.max(since))),
            (None, None) => None,
        };
        let mut either = Vec::new();
        if let Some((low, high)) = between {
            either.push(range(Some(low), high));
        }
        if stop.unnumbered_counted {
            either.push(doc! { field::NUMBER: { "$not": { "$type": "number" } } });
        }
        let between = between.unwrap_or((since, since));
        if either.is_empty() {
            return Ok(Uncertain {
                listed: Vec::new(),
                total: 0,
                between,
            });
        }
        let filter = doc! { "$or": either };
        let total = self
            .store
            .count_in(
                session,
                &self.events,
                &filter,
                ReadConcern::majority(),
                OPERATION,
            )
            .await?;
        let listed = events_matching(
            &self.store,
            &self.events,
            session,
            Matching {
                filter,
                first: Some(UNCERTAIN_LISTED),
            },
            OPERATION,
        )
        .await?;
        let listed = listed
            .into_iter()
            .map(|event| {
                let number = event.number.as_ref().and_then(integer_value);
                UncertainEvent {
                    counter: event.counter(),
                    amount: event.amount.as_ref().and_then(integer_value).unwrap_or(0),
                    recorded: number.map(time_of),
                    // The events without a number are left out: they
                    // cannot be dated.
                    counted: number.is_some_and(|number| number > since),
                    key: event.key,
                }
            })
            .collect();
        Ok(Uncertain {
            listed,
            total,
            between,
        })
    }
}

/// One second, in microseconds (an event number's unit).
const SECOND: i64 = 1_000_000;

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// What a fold stopped while catching up had counted: the events numbered
/// up to its progress that committed at or before its boundary (none
/// after: its log never started), and maybe a chunk left in progress.
fn catching_up(catch_up: &CatchUp, intent: Option<&Pass>, reach: i64) -> Stop {
    let progress = catch_up.next_after();
    // An event numbered at or below the progress committed after the
    // boundary only if it was numbered within one uncertainty before it.
    let boundary = unix_micros(catch_up.boundary.wall_time());
    let mut doubt = progress
        .filter(|&progress| progress > boundary - reach)
        .map(|progress| (boundary - reach, progress));
    let mut unnumbered_counted = !catch_up.unnumbered;
    if let Some(Pass {
        window: Window::Chunk { after, upto },
        ..
    }) = intent
    {
        // A chunk's events committed at or before the boundary: numbered
        // before its second ended.
        let chunk = (after.unwrap_or(i64::MIN), (*upto).min(boundary + SECOND));
        doubt = Some(match doubt {
            Some((low, high)) => (low.min(chunk.0), high.max(chunk.1)),
            None => chunk,
        });
        unnumbered_counted |= *upto == i64::MAX;
    }
    Stop {
        number: progress,
        doubt,
        unnumbered_counted,
    }
}

/// The position the fold of `state` stood at when it stopped: the start
/// of the pass it left unfinished, if any.
fn stopped_position(state: &FoldState) -> Option<&Position> {
    match &state.intent {
        Some(Pass {
            window: Window::Log { from, .. },
            ..
        }) => Some(from),
        _ => state.position.as_ref(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    use mongodb::bson::Timestamp;
    use mongodb::change_stream::event::ResumeToken;

    fn boundary(seconds: u32) -> Position {
        let token: ResumeToken =
            mongodb::bson::deserialize_from_bson(doc! { "_data": "00" }.into()).unwrap();
        Position {
            token,
            time: Timestamp {
                time: seconds,
                increment: 1,
            },
            event: None,
        }
    }

    fn chunk(after: Option<i64>, upto: i64) -> Pass {
        Pass {
            number: 4,
            owner: mongodb::bson::oid::ObjectId::new(),
            deadline: SystemTime::UNIX_EPOCH,
            recovered: false,
            window: Window::Chunk { after, upto },
        }
    }

    const REACH: i64 = 180 * SECOND;

    #[test]
    fn a_catch_up_far_behind_its_boundary_doubts_nothing_of_what_it_counted() {
        let catch_up = CatchUp {
            boundary: boundary(10_000),
            since: Some(1_000 * SECOND),
            done: Some(2_000 * SECOND),
            unnumbered: false,
            dropped: Vec::new(),
        };
        let stop = catching_up(&catch_up, None, REACH);
        assert_eq!(stop.number, Some(2_000 * SECOND));
        assert_eq!(stop.doubt, None);
        assert!(
            stop.unnumbered_counted,
            "fold-from's catch-up: the log had them"
        );
    }

    #[test]
    fn a_catch_up_near_its_boundary_doubts_what_may_have_committed_after_it() {
        let catch_up = CatchUp {
            boundary: boundary(10_000),
            since: None,
            done: Some(9_950 * SECOND),
            unnumbered: true,
            dropped: Vec::new(),
        };
        let stop = catching_up(&catch_up, None, REACH);
        assert_eq!(stop.doubt, Some((10_000 * SECOND - REACH, 9_950 * SECOND)));
        assert!(!stop.unnumbered_counted, "its last chunk never ran");
    }

    #[test]
    fn a_chunk_left_in_progress_is_in_doubt_up_to_its_boundary() {
        let catch_up = CatchUp {
            boundary: boundary(10_000),
            since: None,
            done: None,
            unnumbered: true,
            dropped: Vec::new(),
        };
        let stop = catching_up(&catch_up, Some(&chunk(None, i64::MAX)), REACH);
        assert_eq!(stop.number, None, "nothing certainly counted");
        assert_eq!(stop.doubt, Some((i64::MIN, 10_001 * SECOND)));
        assert!(stop.unnumbered_counted, "the last chunk takes them");
    }
}
