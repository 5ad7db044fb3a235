//! Folding again from a chosen time after the fold stopped (`tallyd
//! fold-from`): a catch-up of the events numbered after that time, and the
//! events recorded near the stop named — their count cannot be certain.

mod stop;

use std::time::SystemTime;

use mongodb::bson::Bson;

use crate::error::Error;
use crate::ledger::fold::EventFold;
use crate::ledger::fold::tail::Tail;
use crate::ledger::{time_of, unix_micros};

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
    /// When it was recorded (its number: the server's clock); `None` for
    /// an event without a number (written by hand), which the catch-up
    /// leaves out.
    pub recorded: Option<SystemTime>,
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
        let stop = self.stop_of(&state).await?;
        let since_number = unix_micros(since);
        // The boundary first, then the events named, read causally after
        // it: an event that commits before the boundary is named if in
        // doubt; one that commits after it is the log's.
        let reader = self.open_here().await?;
        let boundary = reader.position()?;
        session.advance_operation_time(boundary.time);
        let mut uncertain = self.uncertain(&mut session, &stop, since_number).await?;
        // That read may see inserts that committed after the boundary: the
        // log's, which counts them whatever their number — certain, so not
        // named. The log up to a time after the read names every one
        // (guarantee 5), as for a chunk.
        let mut tail = Tail::over(reader, boundary.clone());
        let later = self.inserted_since_read(&mut tail, &boundary).await?;
        uncertain.leave_out(&later);
        // The events without a number go with the catch-up only when no
        // fold counted any of them; otherwise they are named.
        let unnumbered = !stop.unnumbered_counted;
        let started = self
            .keeper
            .catch_up_from(
                &mut session,
                &state,
                &boundary,
                Some(since_number),
                unnumbered,
            )
            .await?;
        // A write whose reply was lost and whose retry matched nothing may
        // have been this one: the state read back tells (its boundary is
        // this command's own stream's).
        if !started
            && !self
                .started_here(&mut session, &boundary, since_number)
                .await?
        {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: state.pass + 1,
                why: "the fold state changed while the catch-up was being set up (another \
                      `tallyd fold-from`?); `tallyd status` shows where the fold stands"
                    .into(),
            });
        }
        self.saw(&session);
        running.tail = Some(tail);
        tracing::warn!(
            events = %self.events_name,
            since = %humantime::format_rfc3339_micros(since),
            uncertain = uncertain.total,
            "folding again from a chosen time after the fold stopped"
        );
        Ok(FoldFrom {
            since,
            boundary: boundary.wall_time(),
            stopped_at: stop.number.map(time_of),
            uncertain: uncertain.listed,
            uncertain_total: uncertain.total,
            uncertain_after: time_of(uncertain.between.0.max(0)),
            uncertain_until: time_of(uncertain.between.1),
        })
    }

    /// Whether the fold state holds the catch-up from `since` up to
    /// `boundary` that this command set up.
    async fn started_here(
        &self,
        session: &mut mongodb::ClientSession,
        boundary: &crate::ledger::log::Position,
        since: i64,
    ) -> Result<bool, Error> {
        // Its record stays once the catch-up is done (a daemon may have
        // folded it to its end meanwhile).
        let state = self.keeper.read(session).await?;
        let ours = crate::ledger::state::catch_up_started(boundary, Some(since));
        Ok(state.catch_up_started.as_ref() == Some(&ours))
    }

    /// Where a stopped fold stood when it stopped — every event numbered up
    /// to it was counted, as nearly as can be told — : what `tallyd
    /// fold-from` folds from by default. `None` when it never counted an
    /// event; refused when it is not stopped.
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
        Ok(self.stop_of(&state).await?.number.map(time_of))
    }
}
