//! Folding again from a chosen time after the fold stopped (`tallyd
//! fold-from`): a catch-up of the events numbered after that time, and the
//! events recorded near the stop named — their count cannot be certain.

use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};

use super::range;
use crate::document::integer_value;
use crate::error::{Error, Failure};
use crate::ledger::fold::EventFold;
use crate::ledger::fold::tail::Tail;
use crate::ledger::log::Position;
use crate::ledger::scan::logged;
use crate::ledger::state::{FoldState, Pass, Window};
use crate::ledger::{field, time_of, unix_micros};

/// The most uncertain events [`EventFold::fold_from`] names one by one.
pub(crate) const UNCERTAIN_LISTED: usize = 1_000;

/// What [`EventFold::fold_from`] did: the catch-up it started, and the
/// events whose count it cannot be sure of.
///
/// ```no_run
/// # async fn demo(fold: tally::EventFold, since: std::time::SystemTime) -> Result<(), tally::Error> {
/// let from = fold.fold_from(since).await?;
/// for event in &from.uncertain {
///     let counted = if event.counted { "counted now" } else { "not counted now" };
///     println!("{}: {} on {} ({counted})", event.key, event.amount, event.counter);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldFrom {
    /// The catch-up folds the events numbered after this time.
    pub since: SystemTime,
    /// Where the log takes over again.
    pub boundary: SystemTime,
    /// Where the fold stood when it stopped (`None`: it had not folded
    /// yet).
    pub stopped_at: Option<SystemTime>,
    /// The events recorded near where the fold stopped: each was counted
    /// before the stop, or is counted by this catch-up, or neither — the
    /// log that would tell is gone. At most 1,000 (`uncertain_total` counts them all).
    pub uncertain: Vec<UncertainEvent>,
    /// How many uncertain events there are in all.
    pub uncertain_total: u64,
    /// The uncertain events are those recorded after this time…
    pub uncertain_after: SystemTime,
    /// … and up to this one.
    pub uncertain_until: SystemTime,
}

/// An event whose count a [`FoldFrom`] cannot be sure of.
///
/// ```no_run
/// # fn demo(event: tally::UncertainEvent) {
/// println!("{} at {:?}: counted by the catch-up: {}", event.key, event.recorded, event.counted);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UncertainEvent {
    /// The event key.
    pub key: Bson,
    /// Its counter.
    pub counter: Bson,
    /// Its amount (`0` when it is not an integer).
    pub amount: i64,
    /// When it was recorded (its number: the server's clock).
    pub recorded: SystemTime,
    /// The catch-up counts it (it is numbered after `since`). If the fold
    /// had counted it before it stopped, it is now counted twice; if not
    /// counted here and not before, it is in no counter.
    pub counted: bool,
}

impl EventFold {
    /// Folds again from `since` after the fold stopped (its position no
    /// longer in the oplog, the events collection dropped): a catch-up of
    /// every event numbered after `since` that committed up to now, then
    /// the log from here. The events recorded near where the fold stopped
    /// are named ([`FoldFrom::uncertain`]). Refused while the fold is not
    /// stopped. Run [`EventFold::fold`] after it to fold the catch-up.
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold, clock: tally::Reconciler, since: std::time::SystemTime) -> Result<(), tally::Error> {
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let from = fold.fold_from(since).await?;
    /// println!("{} events near the stop are uncertain", from.uncertain_total);
    /// fold.fold(clock.server_time().await?, &CancellationToken::new()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn fold_from(&self, since: SystemTime) -> Result<FoldFrom, Error> {
        let mut running = self.running.lock().await;
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if state.stopped.is_none() {
            return Err(Error::FoldNotStopped {
                events: self.events_name.clone(),
            });
        }
        // A pass left unfinished when the fold stopped: its first chunk
        // folds up to where that pass ended, at the pass's own number, so
        // a counter that has the pass already ignores it.
        let (_, first_upto) = self.stopped_where(&state).await?;
        let stopped_at = stopped_position(&state).map(Position::wall_time);
        let since_number = unix_micros(since);
        let first_upto = first_upto.filter(|&upto| upto > since_number);
        let uncertain = self
            .uncertain(stopped_at, first_upto.map(time_of), since)
            .await?;
        let reader = self.open_here().await?;
        let boundary = reader.position()?;
        if !self
            .keeper
            .catch_up_from(
                &mut session,
                &state,
                &boundary,
                Some(since_number),
                first_upto,
            )
            .await?
        {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: state.pass + 1,
                why: "the fold state changed while the catch-up was being set up; run the \
                      command again"
                    .into(),
            });
        }
        self.saw(&session);
        running.tail = Some(Tail::over(reader, boundary.clone()));
        tracing::warn!(
            events = %self.events_name,
            since = %humantime::format_rfc3339_seconds(since),
            uncertain = uncertain.1,
            "folding again from a chosen time after the fold stopped"
        );
        Ok(FoldFrom {
            since,
            boundary: boundary.wall_time(),
            stopped_at,
            uncertain: uncertain.0,
            uncertain_total: uncertain.1,
            uncertain_after: uncertain.2.0,
            uncertain_until: uncertain.2.1,
        })
    }

    /// Where a stopped fold stood when it stopped (the start of the pass it
    /// left unfinished, if any): what `tallyd fold-from` folds from by
    /// default. `None` when it never folded; refused when it is not stopped.
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::EventFold) -> Result<(), tally::Error> {
    /// if let Some(at) = fold.stopped_at().await? {
    ///     println!("stopped at {}", humantime::format_rfc3339_seconds(at));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn stopped_at(&self) -> Result<Option<SystemTime>, Error> {
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if state.stopped.is_none() {
            return Err(Error::FoldNotStopped {
                events: self.events_name.clone(),
            });
        }
        Ok(self.stopped_where(&state).await?.0.map(time_of))
    }

    /// Where the fold of `state` stood when it stopped, as an event
    /// number, and where the pass it left unfinished ended (its first
    /// chunk's end when it folds again).
    ///
    /// The stop is the number of the event whose insert is the position:
    /// of two events, the one numbered later nearly always committed later
    /// (numbers are the server's clock as the recorder reckons it, never
    /// ahead of it), and the events numbered near the stop either way are
    /// named uncertain. A position that is no insert (a catch-up's
    /// boundary, an idle fold's), or whose event is gone, stands just
    /// before its cluster time's second: the events numbered in that
    /// second are counted again — some of them twice, all of them named —
    /// rather than any of them not at all.
    ///
    /// A pass's end is the end of its last insert's second: no event of
    /// its window is numbered after that.
    async fn stopped_where(&self, state: &FoldState) -> Result<(Option<i64>, Option<i64>), Error> {
        let stop = match stopped_position(state) {
            Some(position) => Some(self.number_at(position).await?),
            None => None,
        };
        let pass_end = match &state.intent {
            Some(Pass {
                window: Window::Log { to, .. },
                ..
            }) => to.as_ref().map(|to| unix_micros(end_of_second(&to.at))),
            Some(Pass {
                window: Window::Chunk { upto, .. },
                ..
            }) => Some(*upto),
            None => None,
        };
        Ok((stop, pass_end))
    }

    /// The number of the event whose insert `position` is, or just before
    /// its second (see [`EventFold::stopped_where`]).
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

    /// The events whose count a fold from `since` cannot be sure of, when
    /// the fold stopped at `stopped_at` (a pass reaching `pass_end` in
    /// progress): those numbered from one uncertainty before the stop up to
    /// the later of the stop and `since`.
    pub(super) async fn uncertain(
        &self,
        stopped_at: Option<SystemTime>,
        pass_end: Option<SystemTime>,
        since: SystemTime,
    ) -> Result<(Vec<UncertainEvent>, u64, (SystemTime, SystemTime)), Error> {
        let Some(stopped_at) = stopped_at else {
            return Ok((Vec::new(), 0, (since, since)));
        };
        let reach = self.uncertainty();
        let low = (stopped_at
            .checked_sub(reach)
            .unwrap_or(SystemTime::UNIX_EPOCH))
        .min(since);
        // An event committed before the position's insert was numbered
        // before that insert's second ended.
        let high = (stopped_at + Duration::from_secs(1))
            .max(since)
            .max(pass_end.unwrap_or(since));
        let filter = range(Some(unix_micros(low)), unix_micros(high));
        let mut budget = crate::error::RetryBudget::read_once("ledger.fold_from.uncertain");
        let total = self
            .store
            .with_retry(&mut budget, || self.events.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)?;
        let mut budget = crate::error::RetryBudget::read_once("ledger.fold_from.uncertain");
        let listed: Vec<Document> = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .sort(doc! { field::NUMBER: 1 })
                    .limit(UNCERTAIN_LISTED as i64)
            })
            .await
            .map_err(Error::Server)?
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("ledger.fold_from.uncertain", err)))?;
        let since = unix_micros(since);
        let uncertain = listed
            .into_iter()
            .map(logged)
            .map(|event| {
                let number = event.number.as_ref().and_then(integer_value).unwrap_or(0);
                UncertainEvent {
                    counter: event.counter(),
                    amount: event.amount.as_ref().and_then(integer_value).unwrap_or(0),
                    recorded: time_of(number),
                    counted: number > since,
                    key: event.key,
                }
            })
            .collect();
        Ok((uncertain, total, (low, high)))
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

/// The end of the second of `at`'s cluster time.
fn end_of_second(at: &Position) -> SystemTime {
    at.wall_time() + Duration::from_secs(1)
}
