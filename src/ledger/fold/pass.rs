//! One pass of the fold: what it folds, then intent, sums, apply, commit
//! (the parent module's docs say why each step is safe), and what is left
//! after it.

use std::time::{Duration, Instant, SystemTime};

use mongodb::ClientSession;

use super::sums::{Shares, shares_of};
use super::tail::Tail;
use super::{Backlog, EventFold, PASS_EVENTS, PassRun, Running, held_sum};
use crate::document::display_id;
use crate::error::Error;
use crate::ledger::log::{Inserted, Position, check_history_kept, wall_time};
use crate::ledger::state::{FoldState, LastInsert, Pass, Window};

/// How long a pass reads the log for what committed before it began before
/// it gives up (the next pass goes on from the same position).
const READ_FOR: Duration = Duration::from_secs(600);

/// How long a resumed pass reads the log for its window before it gives up
/// (the next pass tries again).
const REREAD_FOR: Duration = Duration::from_secs(600);

impl EventFold {
    /// One pass: resumes or takes over an unfinished one, runs a catch-up's
    /// next step, or folds what waits in the log.
    pub(super) async fn pass(
        &self,
        running: &mut Running,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        let run = match self.step(running, &mut session, &state, clock).await {
            Err(err @ (Error::HistoryLost { .. } | Error::FoldStopped { .. }))
                if state.stopped.is_none() =>
            {
                // The fold cannot go on from its position: it stops there,
                // for every fold of the ledger, until `fold-from` — unless
                // another fold moved on from it meanwhile (the state read
                // again: the step may have written its intent).
                running.tail = None;
                let now = self.keeper.read(&mut session).await?;
                let boundary = |s: &FoldState| s.catch_up.as_ref().map(|c| c.boundary.clone());
                if now.stopped.is_none()
                    && now.position == state.position
                    && boundary(&now) == boundary(&state)
                {
                    self.keeper
                        .stop(&mut session, &now, &err.to_string(), clock())
                        .await?;
                }
                Err(err)
            }
            run => run,
        };
        self.saw(&session);
        let mut run = run?;
        run.state_bytes = state.bytes as u64;
        Ok(run)
    }

    async fn step(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        if let Some(stopped) = &state.stopped {
            return Err(Error::FoldStopped {
                events: self.events_name.clone(),
                why: stopped.why.clone(),
            });
        }
        match &state.intent {
            Some(pass)
                if pass.owner != self.owner
                    && clock() < pass.deadline + self.store.attempt_timeout() =>
            {
                tracing::debug!(
                    events = %self.events_name,
                    pass = pass.number,
                    owner = %pass.owner,
                    until = %humantime::format_rfc3339_millis(pass.deadline + self.store.attempt_timeout()),
                    "a fold pass is another fold's until its lease and one attempt run out"
                );
                Ok(PassRun {
                    busy: true,
                    ..PassRun::default()
                })
            }
            Some(pass) => self.recover(running, session, state, pass, clock).await,
            None if !state.exists || state.earlier.is_some() => {
                self.begin_catch_up(running, session, state).await
            }
            None if state.catch_up.is_some() => {
                self.catch_up_chunk(running, session, state, clock).await
            }
            None => self.log_pass(running, session, state, clock).await,
        }
    }

    /// A new pass over what waits in the log after the position (and the
    /// held sums), or, on an idle ledger, the position moved up to where
    /// the log stands.
    async fn log_pass(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let Some(position) = &state.position else {
            return Err(self
                .keeper
                .malformed("it has no position in the log and no catch-up to reach one".into()));
        };
        let now = self.store.cluster_time().await?;
        let tail = self.tail_at(running, position).await?;
        tail.fill_to(&self.store, now, PASS_EVENTS, Instant::now() + READ_FOR)
            .await?;
        let count = tail.read().len().min(PASS_EVENTS);
        if count == 0 && state.held.is_empty() {
            self.advance_if_due(running, session, state, position)
                .await?;
            return Ok(PassRun::default());
        }
        check_history_kept(&self.store, &self.events_name, position).await?;
        let window: Vec<Inserted> = tail.read().iter().take(count).cloned().collect();
        let pass = Pass {
            number: state.pass + 1,
            owner: self.owner,
            deadline: clock() + self.settings.lease,
            recovered: false,
            window: Window::Log {
                from: position.clone(),
                to: window.last().map(|last| LastInsert {
                    at: last.at.clone(),
                    key: last.event.key.clone(),
                }),
            },
        };
        if !self.intend(session, state, &pass).await? {
            return Ok(PassRun {
                busy: true,
                ..PassRun::default()
            });
        }
        let shares = shares_of(window.iter().map(|i| &i.event));
        let mut run = self
            .fold_window(session, &pass, state, shares, clock)
            .await?;
        if let Some(tail) = running.tail.as_mut() {
            let to = window.last().map_or(position, |last| &last.at);
            tail.consumed(count, to);
        }
        run.again = count == PASS_EVENTS;
        Ok(run)
    }

    /// Records `pass` as the next of `state`; `false` when another fold got
    /// there first.
    async fn intend(
        &self,
        session: &mut ClientSession,
        state: &FoldState,
        pass: &Pass,
    ) -> Result<bool, Error> {
        // An unknown outcome fails the pass; if it landed, the next pass
        // finds it as its own.
        if self.keeper.begin(session, state, pass).await? {
            return Ok(true);
        }
        // Nothing matched: another fold got there first — or our own first
        // attempt, whose reply was lost, did.
        let now = self.keeper.read(session).await?;
        Ok(now
            .intent
            .is_some_and(|i| i.owner == self.owner && i.number == pass.number))
    }

    /// Applies `shares` (the window's sums) and the held sums as `pass`,
    /// commits it.
    pub(super) async fn fold_window(
        &self,
        session: &mut ClientSession,
        pass: &Pass,
        state: &FoldState,
        shares: Shares,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let events = shares.values().map(|s| s.events).sum();
        let malformed = shares.values().map(|s| s.malformed).sum();
        if malformed > 0 {
            tracing::warn!(
                events = %self.events_name,
                malformed,
                "events whose amount is not an integer are left out of their counters"
            );
        }
        let applied = self.apply(pass, state, shares, clock).await?;
        self.commit(session, pass, state, &applied.held).await?;
        for held in applied.held.iter().filter(|h| h.pass == pass.number) {
            tracing::warn!(
                events = %self.events_name,
                counter = %display_id(&held.key),
                pass = held.pass,
                cause = %held.cause,
                "a counter refused its events' sum; it is held and offered again every pass"
            );
        }
        Ok(PassRun {
            pass: Some(pass.number),
            recovered: pass.recovered,
            events,
            written: applied.written,
            malformed,
            again: pass.recovered,
            ..PassRun::default()
        })
    }

    /// Commits `pass`, only while it is still this fold's.
    async fn commit(
        &self,
        session: &mut ClientSession,
        pass: &Pass,
        state: &FoldState,
        held: &[crate::ledger::state::Held],
    ) -> Result<(), Error> {
        let committed = self
            .keeper
            .commit(session, (self.owner, pass), held, state.catch_up.as_ref())
            .await?;
        if committed {
            return Ok(());
        }
        // Our lost first attempt committed it, or another fold took it over
        // and committed it: either way it is done.
        let now = self.keeper.read(session).await?;
        if now.pass >= pass.number {
            Ok(())
        } else {
            Err(self.pass_lost(pass, "another fold took it over before it committed"))
        }
    }

    /// Resumes this fold's unfinished pass, or takes over another's whose
    /// lease ran out: claimed (marked recovered: any of its sends may have
    /// applied), its window read again, applied at the same position.
    async fn recover(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        pass: &Pass,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassRun, Error> {
        let deadline = clock() + self.settings.lease;
        if !self
            .keeper
            .claim(session, pass, self.owner, deadline)
            .await?
        {
            return Ok(PassRun {
                busy: true,
                ..PassRun::default()
            });
        }
        if pass.owner != self.owner {
            tracing::info!(
                events = %self.events_name,
                pass = pass.number,
                from = %pass.owner,
                "taking over a fold pass whose owner stopped renewing it"
            );
        }
        let claimed = Pass {
            owner: self.owner,
            deadline,
            recovered: true,
            ..pass.clone()
        };
        match &claimed.window {
            Window::Log { from, to } => {
                let window = self.reread(running, from, to.as_ref()).await?;
                let shares = shares_of(window.iter().map(|i| &i.event));
                let mut run = self
                    .fold_window(session, &claimed, state, shares, clock)
                    .await?;
                if let Some(tail) = running.tail.as_mut() {
                    let end = to.as_ref().map_or(from, |to| &to.at);
                    tail.consumed(window.len(), end);
                }
                run.again = true;
                Ok(run)
            }
            Window::Chunk { after, upto } => {
                self.resume_chunk(running, session, state, &claimed, (*after, *upto), clock)
                    .await
            }
        }
    }

    /// The inserts of a log pass's window read again: after `from`, up to
    /// and including `to`'s (none when `to` is `None`). The log gives the
    /// same inserts in the same order every time it is read from the same
    /// position; an insert past `to`'s time before `to`'s own would mean it
    /// does not, and the pass stops rather than guess.
    async fn reread(
        &self,
        running: &mut Running,
        from: &Position,
        to: Option<&LastInsert>,
    ) -> Result<Vec<Inserted>, Error> {
        let Some(to) = to else {
            return Ok(Vec::new());
        };
        let tail = self.tail_at(running, from).await?;
        let deadline = Instant::now() + REREAD_FOR;
        loop {
            match window_end(tail.read().iter(), to) {
                Ok(Some(end)) => {
                    check_history_kept(&self.store, &self.events_name, from).await?;
                    return Ok(tail.read().iter().take(end + 1).cloned().collect());
                }
                Ok(None) => {}
                Err(past) => return Err(self.window_not_found(to, past)),
            }
            let before = tail.read().len();
            tail.listen(&self.store, usize::MAX, deadline).await?;
            if tail.read().len() == before && Instant::now() >= deadline {
                return Err(Error::FoldPassLost {
                    events: self.events_name.clone(),
                    pass: 0,
                    why: "its window could not be read again in time".into(),
                });
            }
        }
    }

    fn window_not_found(&self, to: &LastInsert, past: &Inserted) -> Error {
        Error::FoldStopped {
            events: self.events_name.clone(),
            why: format!(
                "the log read again from a pass's start showed event {} (cluster time {}) \
                 before the pass's last event {} (cluster time {}): the log is not what the \
                 pass read; nothing more is folded until `tallyd fold-from`",
                display_id(&past.event.key),
                past.at.time.time,
                display_id(&to.key),
                to.at.time.time
            ),
        }
    }

    /// The fold's tail, standing at `position` (opened there when it
    /// stands elsewhere or none is open).
    pub(super) async fn tail_at<'r>(
        &self,
        running: &'r mut Running,
        position: &Position,
    ) -> Result<&'r mut Tail, Error> {
        let reusable = running
            .tail
            .as_mut()
            .is_some_and(|tail| tail.skip_to(position));
        if !reusable {
            running.tail = None;
            let opened = Tail::open(&self.store, &self.events_name, position).await;
            running.tail = Some(opened.map_err(|err| self.lost_history(err))?);
        }
        Ok(running.tail.as_mut().expect("a tail was opened"))
    }

    /// A stream that cannot resume from the state's position: the fold
    /// stops there ([`Error::HistoryLost`] says what to do).
    pub(super) fn lost_history(&self, err: Error) -> Error {
        if matches!(err, Error::HistoryLost { .. }) {
            tracing::error!(
                events = %self.events_name,
                cause = %err,
                "the fold's position is no longer in the oplog; the fold of this ledger stops"
            );
        }
        err
    }

    /// On an idle ledger: moves the position up to where the log stands
    /// once it is `advance_after` behind, so that the position a fold, an
    /// exact read or a restarted daemon resumes from stays well inside the
    /// oplog's window.
    async fn advance_if_due(
        &self,
        running: &mut Running,
        session: &mut ClientSession,
        state: &FoldState,
        position: &Position,
    ) -> Result<(), Error> {
        let Some(tail) = running.tail.as_mut() else {
            return Ok(());
        };
        let Some(quiet) = tail.quiet_at().cloned() else {
            return Ok(());
        };
        let behind = wall_time(quiet.time)
            .duration_since(position.wall_time())
            .unwrap_or_default();
        if behind < self.settings.advance_after || quiet.token == position.token {
            return Ok(());
        }
        check_history_kept(&self.store, &self.events_name, position).await?;
        if self.keeper.advance(session, state, &quiet).await? {
            tail.consumed(0, &quiet);
        }
        Ok(())
    }

    /// What is left after the passes, as the fold's read-ahead shows it.
    pub(super) async fn backlog_of(
        &self,
        running: &mut Running,
        now: SystemTime,
    ) -> Result<Backlog, Error> {
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if state.catch_up.is_some() || state.position.is_none() {
            return self.catch_up_backlog(&state, now).await;
        }
        let read = running
            .tail
            .as_ref()
            .filter(|tail| Some(tail.from()) == state.position.as_ref())
            .map(|tail| tail.read());
        let (events, oldest) = match read {
            Some(read) => (read.len() as u64, read.front().map(|i| i.at.time)),
            None => (0, None),
        };
        Ok(backlog(&state, events, oldest.map(wall_time), now))
    }

    /// What is not in the counters yet at `now` (the server's clock): the
    /// log read from the fold's position up to now (or, while a catch-up
    /// runs, the events it has yet to fold), and the held sums. Changes
    /// nothing.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::EventFold,
    /// #     clock: tally::Reconciler,
    /// # ) -> Result<(), tally::Error> {
    /// // For a metric or a health check; changes nothing.
    /// let backlog = fold.backlog(clock.server_time().await?).await?;
    /// println!("{} events not in their counters yet", backlog.events + backlog.held_events());
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self, now: SystemTime) -> Result<Backlog, Error> {
        let mut session = self.session().await?;
        let state = self.keeper.read(&mut session).await?;
        if let Some(stopped) = &state.stopped {
            return Err(Error::FoldStopped {
                events: self.events_name.clone(),
                why: stopped.why.clone(),
            });
        }
        let Some(position) = state.position.clone().filter(|_| state.catch_up.is_none()) else {
            return self.catch_up_backlog(&state, now).await;
        };
        let until = self.store.cluster_time().await?;
        let mut reader = crate::ledger::log::Reader::open(
            &self.store,
            &self.events_name,
            Some(&position),
            &crate::ledger::log::Scope::All,
            Duration::from_millis(1),
        )
        .await?;
        let deadline = Instant::now() + self.store.attempt_timeout();
        let read = reader.read_until(&self.store, until, deadline).await?;
        let oldest = read.first().map(|i| wall_time(i.at.time));
        Ok(backlog(&state, read.len() as u64, oldest, now))
    }
}

/// Where a log pass's window ends among `read` (the inserts after its
/// start, in the log's order): the index of its last insert `to`, known by
/// its cluster time and event key — several inserts may share a cluster
/// time (a transaction's, or on a sharded cluster two shards' merged by
/// `mongos`), never a key. `Ok(None)`: not read yet. `Err`: an insert of a
/// later cluster time came first — the log is not what the pass read.
fn window_end<'a>(
    read: impl IntoIterator<Item = &'a Inserted>,
    to: &LastInsert,
) -> Result<Option<usize>, &'a Inserted> {
    for (at, inserted) in read.into_iter().enumerate() {
        if inserted.identity() == (to.at.time, &to.key) {
            return Ok(Some(at));
        }
        if inserted.at.time > to.at.time {
            return Err(inserted);
        }
    }
    Ok(None)
}

/// The backlog of `state` with `events` waiting, the oldest committed at
/// `oldest`.
pub(super) fn backlog(
    state: &FoldState,
    events: u64,
    oldest: Option<SystemTime>,
    now: SystemTime,
) -> Backlog {
    let age = |t: SystemTime| now.duration_since(t).unwrap_or(Duration::ZERO);
    Backlog {
        events,
        oldest_age: oldest.map(age),
        held: state.held.iter().map(held_sum).collect(),
        position_age: state.position.as_ref().map(|p| age(p.wall_time())),
        catching_up: state.catch_up.is_some() || state.position.is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::log::Logged;
    use mongodb::bson::{Bson, Timestamp, doc};
    use mongodb::change_stream::event::ResumeToken;

    /// An insert of `key` at cluster time `(time, increment)`, as a shard's
    /// oplog stamps it.
    fn insert(key: &str, time: u32, increment: u32) -> Inserted {
        let token: ResumeToken = mongodb::bson::deserialize_from_bson(Bson::Document(
            doc! { "_data": format!("82{time:08X}{increment:08X}{}", hex(key)) },
        ))
        .unwrap();
        Inserted {
            at: Position {
                token,
                time: Timestamp { time, increment },
                event: Some(Bson::from(key)),
            },
            event: Logged {
                key: Bson::from(key),
                counter: Some(Bson::from("c")),
                amount: Some(Bson::Int64(1)),
                number: None,
            },
        }
    }

    fn hex(text: &str) -> String {
        text.bytes().map(|b| format!("{b:02X}")).collect()
    }

    fn last(inserted: &Inserted) -> LastInsert {
        LastInsert {
            at: inserted.at.clone(),
            key: inserted.event.key.clone(),
        }
    }

    /// Two shards' inserts as `mongos` merges them: shard A's and shard B's
    /// at the same cluster times, interleaved. A pass that ended at B's
    /// second insert, read again, ends exactly there — not at A's insert of
    /// the same time before it, not at the one after it.
    #[test]
    fn a_window_read_again_from_two_shards_ends_at_its_own_last_insert() {
        let merged = [
            insert("a1", 10, 1),
            insert("b1", 10, 1),
            insert("a2", 10, 2),
            insert("b2", 10, 2),
            insert("a3", 10, 2),
            insert("b3", 11, 1),
        ];
        let to = last(&merged[3]);
        assert_eq!(window_end(merged.iter(), &to), Ok(Some(3)));
        // Not read that far yet: more to read.
        assert_eq!(window_end(merged[..3].iter(), &to), Ok(None));
        // Its window read again starts after its start, wherever that was.
        assert_eq!(window_end(merged[2..].iter(), &to), Ok(Some(1)));
        // A log that no longer shows the pass's last insert before a later
        // cluster time: the pass stops rather than guess.
        let without = [merged[0].clone(), merged[1].clone(), merged[5].clone()];
        let past = window_end(without.iter(), &to).unwrap_err();
        assert_eq!(past.event.key, Bson::from("b3"));
    }
}
