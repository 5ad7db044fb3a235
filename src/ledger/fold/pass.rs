//! One pass of the fold, step by step (the parent module's docs say why
//! each step is safe): intent, floor, sums, apply, commit. The floor's
//! steps are in `stand`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use futures::StreamExt;
use mongodb::bson::{Bson, oid::ObjectId};
use tokio_util::sync::CancellationToken;

use super::held::{self, Applied, Work};
use super::query;
use super::stand::Read;
use super::{APPLY_CONCURRENCY, EventFold, EventsRun};
use crate::document::{CanonicalKey, display_id};
use crate::error::{Error, ErrorClass};
use crate::ledger::floor::Raise;
use crate::ledger::state::{self, FoldState, Held, Intent, Late};
use crate::ledger::unix_micros;
use crate::write::lane::{LaneId, LaneIncrement};

/// How far before a new pass's end its first look for waiting events
/// reaches, in microseconds (the numbers' unit): where a busy ledger's
/// newest events are.
const RECENT: i64 = 50_000;

/// How many times as long each further look back is than the one before.
const FURTHER: i64 = 4;

/// The longest look back before the rest is looked at in one: about 3½
/// minutes (50 ms × 4⁶).
const MAX_WIDTH: i64 = RECENT * 4_096;

/// How many such commands a pass sends at once.
const BATCHES_AT_ONCE: usize = 2;

/// What waits above the watermark, for a new pass.
enum Waiting {
    /// No event.
    Nothing,
    /// Events numbered up to the pass's end.
    UpTo,
    /// Events numbered only after the pass's end.
    OnlyAhead,
}

/// What applying a pass came to.
struct Applying {
    live: Raise,
    owed: bool,
    repaid: Vec<Late>,
    held: Vec<Held>,
    written: u64,
    events: u64,
    malformed: u64,
}

impl EventFold {
    /// One pass: resumes or takes over an unfinished one, repairs what the
    /// fold owes, or records a new one when there is something to fold;
    /// raises the floor to its end, applies it and commits it. Says too
    /// whether another pass should follow at once (it was unfinished, or a
    /// repair).
    pub(super) async fn pass(
        &self,
        clock: &(impl Fn() -> SystemTime + Sync),
        stop: &CancellationToken,
    ) -> Result<(EventsRun, bool), Error> {
        let mut run = EventsRun::default();
        if stop.is_cancelled() {
            return Ok((run, false));
        }
        let mut state = state::read(&self.store, &self.state).await?;
        if state.legacy.is_some() {
            state = self.convert(&state).await?;
        }
        run.state_bytes = state.bytes as u64;
        if state.exists && state.intent.is_none() && self.keep_the_floor(&state, clock()).await? {
            state = state::read(&self.store, &self.state).await?;
        }
        let intent = match &state.intent {
            Some(intent) if intent.owner == self.owner => {
                run.recovered = true;
                self.claim(intent, intent.owner, clock()).await?
            }
            Some(intent) if clock() < intent.deadline + self.store.attempt_timeout() => None,
            Some(intent) => {
                run.recovered = true;
                self.claim(intent, intent.owner, clock()).await?
            }
            // Events owed: a repair pass first.
            None if !state.late.is_empty() => {
                self.intend(&state, state.watermark, state.late.clone(), clock())
                    .await?
            }
            None => {
                let mut to = self.pass_end(&state, clock());
                match self.waiting(state.watermark, to).await? {
                    Waiting::Nothing if state.held.is_empty() => return Ok((run, false)),
                    Waiting::Nothing | Waiting::UpTo => {}
                    // Only events numbered ahead of the server's clock (a
                    // recorder numbered above a floor a converted state or
                    // a caller's clock put ahead): the floor protects any
                    // end, so the pass ends at the highest.
                    Waiting::OnlyAhead => {
                        to = query::highest_number(&self.store, &self.events)
                            .await?
                            .unwrap_or(to)
                            .max(to);
                    }
                }
                if !state.exists {
                    self.check_no_floor().await?;
                    self.check_no_counter_folded().await?;
                }
                self.intend(&state, to, Vec::new(), clock()).await?
            }
        };
        let Some(intent) = intent else {
            run.busy = true;
            return Ok((run, false));
        };
        let applied = self.apply(&state, &intent, clock).await?;
        self.commit((&intent, &applied.repaid), &applied.live, &applied.held)
            .await?;
        for held in applied.held.iter().filter(|h| h.pass == intent.pass) {
            tracing::warn!(
                events = %self.events_name,
                counter = %display_id(&held.key),
                pass = held.pass,
                cause = %held.cause,
                "a counter refused its events' sum; it is held and offered again every pass"
            );
        }
        run.pass = Some(intent.pass);
        run.events_folded = applied.events;
        run.counters_written = applied.written;
        run.malformed_events = applied.malformed;
        let repair = !applied.repaid.is_empty();
        if repair {
            run.late_events_folded = applied.events;
        }
        let again = run.recovered || repair || applied.owed;
        Ok((run, again))
    }

    /// What waits above the watermark `from` for a pass ending at `to`.
    ///
    /// On MongoDB one index seek on `{s: 1}` would do. The test server
    /// reads a whole range before it stops at the first event, so a look
    /// at everything above the watermark would cost the whole backlog:
    /// as much as the pass's own sums. So the fold looks where events
    /// are: first at those numbered in the last [`RECENT`] before `to`
    /// or after it (a busy ledger's newest), then further back in ranges
    /// each [`FURTHER`] times as long, and the rest of `(from, to]` in
    /// one. A look costs the events in its range, and a pass stops
    /// looking at the first it finds. After a look that found nothing
    /// above this watermark, the next looks at all of them at once: what
    /// landed since, one seek on an idle ledger.
    async fn waiting(&self, from: i64, to: i64) -> Result<Waiting, Error> {
        let quiet = *lock(&self.quiet_above) == Some(from);
        let mut bound = if quiet {
            from
        } else {
            to.saturating_sub(RECENT).max(from)
        };
        let newest = query::lowest_above(&self.store, &self.events, bound).await?;
        let mut found = newest.is_some_and(|lowest| lowest <= to);
        let mut width = RECENT;
        while !found && bound > from {
            width = width.saturating_mul(FURTHER);
            let lower = if width > MAX_WIDTH {
                from
            } else {
                bound.saturating_sub(width).max(from)
            };
            found = query::any_in(&self.store, &self.events, lower, bound).await?;
            bound = lower;
        }
        *lock(&self.quiet_above) = (!found && newest.is_none()).then_some(from);
        Ok(match newest {
            _ if found => Waiting::UpTo,
            Some(_) => Waiting::OnlyAhead,
            None => Waiting::Nothing,
        })
    }

    /// Where a new pass of `state` ends at `now` (the server's clock when
    /// it began): it folds every event numbered before — an insert
    /// numbered earlier but not landed yet meets the floor and is numbered
    /// again — never below the watermark.
    fn pass_end(&self, state: &FoldState, now: SystemTime) -> i64 {
        unix_micros(now).max(state.watermark)
    }

    /// Records the pass folding `(W, to]` — or, with `late`, the pass
    /// repairing those debts — conditioned on the state not having changed
    /// since it was read; `None` when another fold got there first.
    async fn intend(
        &self,
        state: &FoldState,
        to: i64,
        late: Vec<Late>,
        now: SystemTime,
    ) -> Result<Option<Intent>, Error> {
        let intent = Intent {
            pass: state.pass + 1,
            from: state.watermark,
            to,
            owner: self.owner,
            deadline: now + self.settings.lease,
            recovered: false,
            anchor: None,
            live: None,
            late,
        };
        // An unknown outcome fails the pass; if it landed, the next pass
        // finds it as its own.
        if state::record_intent(&self.store, &self.state, state, &intent).await? {
            return Ok(Some(intent));
        }
        // Nothing matched: another fold got there first — or our own first
        // attempt, whose reply was lost, did.
        let now = state::read(&self.store, &self.state).await?;
        Ok(now
            .intent
            .filter(|i| i.owner == self.owner && i.pass == intent.pass)
            .map(|_| intent))
    }

    /// Makes the unfinished pass `intent` (owned by `from`) this fold's:
    /// `None` when it changed meanwhile. It is marked recovered — any of
    /// its sends may have applied — and its deadline renewed.
    async fn claim(
        &self,
        intent: &Intent,
        from: ObjectId,
        now: SystemTime,
    ) -> Result<Option<Intent>, Error> {
        let deadline = now + self.settings.lease;
        let claimed =
            state::claim(&self.store, &self.state, intent, from, self.owner, deadline).await?;
        if from != self.owner {
            tracing::info!(
                events = %self.events_name,
                pass = intent.pass,
                from = %from,
                "taking over a fold pass whose owner stopped renewing it"
            );
        }
        Ok(claimed.then(|| Intent {
            owner: self.owner,
            deadline,
            recovered: true,
            ..intent.clone()
        }))
    }

    /// Steps 3 and 4: the sums of the pass's ranges, then every counter's
    /// held sums and share through the fold lane, renewing the pass's
    /// lease meanwhile.
    async fn apply(
        &self,
        state: &FoldState,
        intent: &Intent,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<Applying, Error> {
        let lease = self.settings.lease;
        let sendable_until = Mutex::new(Instant::now() + lease);
        let renew = async {
            loop {
                tokio::time::sleep(lease / 3).await;
                let asked = Instant::now();
                let renewed = state::renew(
                    &self.store,
                    &self.state,
                    self.owner,
                    intent.pass,
                    clock() + lease,
                )
                .await;
                match renewed {
                    Ok(true) => *lock(&sendable_until) = asked + lease,
                    Ok(false) => {
                        return Error::FoldPassLost {
                            events: self.events_name.clone(),
                            pass: intent.pass,
                            why: "another fold took it over".into(),
                        };
                    }
                    Err(err) => tracing::warn!(
                        events = %self.events_name,
                        cause = %err,
                        "cannot renew the fold pass's lease; retrying"
                    ),
                }
            }
        };
        let work = self.sums_and_work(state, intent, &sendable_until, clock);
        tokio::select! {
            applied = work => applied,
            lost = renew => Err(lost),
        }
    }

    async fn sums_and_work(
        &self,
        state: &FoldState,
        intent: &Intent,
        sendable_until: &Mutex<Instant>,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<Applying, Error> {
        let Read {
            shares,
            live,
            owed,
            repaid,
        } = self.read_pass(state, intent).await?;
        let events = shares.values().map(|s| s.events).sum();
        let malformed: u64 = shares.values().map(|s| s.malformed).sum();
        if malformed > 0 {
            tracing::warn!(
                events = %self.events_name,
                malformed,
                "events whose amount is not an integer are left out of their counters"
            );
        }
        let mut work: Vec<Work> = Vec::new();
        let mut index: HashMap<CanonicalKey, usize> = HashMap::new();
        for held in &state.held {
            let at = *index.entry(CanonicalKey::of(&held.key)).or_insert_with(|| {
                work.push(Work {
                    key: held.key.clone(),
                    held: Vec::new(),
                    new: None,
                });
                work.len() - 1
            });
            work[at].held.push(held.clone());
        }
        for (bytes, share) in shares {
            match index.get(&bytes) {
                Some(&at) => work[at].new = Some(share),
                None => work.push(Work {
                    key: share.key.clone(),
                    held: Vec::new(),
                    new: Some(share),
                }),
            }
        }
        let now = clock();
        let mut sent = self.send_batched(&work, intent, sendable_until).await?;
        let outcomes: Vec<Result<held::Done, Error>> = futures::stream::iter(work)
            .map(|work| {
                let key = work.key.clone();
                // The counter's new sum, sent already in a batch: its one send.
                let mut batched = sent.remove(&CanonicalKey::of(&key));
                held::apply(
                    work,
                    intent.pass,
                    intent.recovered,
                    now,
                    move |p, n, resumed| {
                        let batched = batched.take().filter(|_| p == intent.pass);
                        let key = key.clone();
                        async move {
                            match batched {
                                Some(applied) => applied,
                                None => self.send(key, p, n, resumed, sendable_until).await,
                            }
                        }
                    },
                )
            })
            .buffer_unordered(APPLY_CONCURRENCY)
            .collect()
            .await;
        let mut applying = Applying {
            live,
            owed,
            repaid,
            held: Vec::new(),
            written: 0,
            events,
            malformed,
        };
        for done in outcomes {
            let done = done?;
            applying.written += done.written;
            applying.held.extend(done.held);
        }
        // Oldest first, each counter's in its order.
        applying.held.sort_by_key(|h| h.pass);
        Ok(applying)
    }

    /// The new sums of the counters with nothing held (a pass's common
    /// case), sent through the fold lane at the pass's position in
    /// commands of many statements ([`Counters::add_many_through`]):
    /// what each established, by counter, for `held::apply` to judge as if
    /// it had sent it itself. Every other counter's sums go one by one.
    ///
    /// [`Counters::add_many_through`]: crate::Counters
    async fn send_batched(
        &self,
        work: &[Work],
        intent: &Intent,
        sendable_until: &Mutex<Instant>,
    ) -> Result<HashMap<CanonicalKey, Result<Applied, Error>>, Error> {
        let sums: Vec<(Bson, i64)> = work
            .iter()
            .filter_map(|w| Some((w.key.clone(), held::lone_sum(w)?)))
            .collect();
        let groups: Vec<Vec<(Bson, i64)>> = sums
            .chunks(self.settings.apply_batch.max(1))
            .map(<[_]>::to_vec)
            .collect();
        let mut sent = HashMap::with_capacity(sums.len());
        let mut groups = futures::stream::iter(groups)
            .map(|group| self.send_group(group, intent, sendable_until))
            .buffer_unordered(BATCHES_AT_ONCE);
        while let Some(group) = groups.next().await {
            sent.extend(group?);
        }
        Ok(sent)
    }

    /// One group of new sums in one command (more, when its keys are large).
    async fn send_group(
        &self,
        group: Vec<(Bson, i64)>,
        intent: &Intent,
        sendable_until: &Mutex<Instant>,
    ) -> Result<Vec<(CanonicalKey, Result<Applied, Error>)>, Error> {
        self.sendable(intent.pass, sendable_until)?;
        let lane = LaneId::Named(self.fold_lane.clone()?);
        let keys: Vec<CanonicalKey> = group.iter().map(|(key, _)| CanonicalKey::of(key)).collect();
        let outcomes = self
            .counters
            .add_many_through(group, &lane, intent.pass, intent.recovered)
            .await;
        Ok(keys
            .into_iter()
            .zip(outcomes)
            .map(|(key, outcome)| (key, self.judge(outcome)))
            .collect())
    }

    /// Refuses to send once the pass's lease may have run out.
    fn sendable(&self, pass: i64, sendable_until: &Mutex<Instant>) -> Result<(), Error> {
        if Instant::now() >= *lock(sendable_until) {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass,
                why: "its lease ran out before it could be renewed (the server did not answer)"
                    .into(),
            });
        }
        Ok(())
    }

    /// One sum to one counter through the fold lane at `position`.
    async fn send(
        &self,
        key: Bson,
        position: i64,
        amount: i64,
        resumed: bool,
        sendable_until: &Mutex<Instant>,
    ) -> Result<Applied, Error> {
        self.sendable(position, sendable_until)?;
        let lane = LaneId::Named(self.fold_lane.clone()?);
        let outcome = self
            .counters
            .add_through(key, lane, position, amount, resumed)
            .await;
        self.judge(outcome)
    }

    /// What a counter's update through the fold lane established.
    fn judge(&self, outcome: LaneIncrement) -> Result<Applied, Error> {
        let refused = |cause: &Error, maybe_applied| Applied::Refused {
            cause: self.store.scrub(&cause.to_string()),
            maybe_applied,
        };
        match &outcome {
            LaneIncrement::Counted(_) => Ok(Applied::Counted),
            LaneIncrement::OutOfOrder(late) => Ok(Applied::Behind { held: late.held() }),
            LaneIncrement::NotCounted(_) | LaneIncrement::Unknown(_) => {
                let maybe_applied = matches!(outcome, LaneIncrement::Unknown(_));
                let cause = outcome
                    .cause()
                    .cloned()
                    .unwrap_or_else(|| Error::InvalidArgument("the counter update failed".into()));
                match cause.class() {
                    // The counter's own refusal (a validator, an overflow, a
                    // malformed lane map): held.
                    Some(ErrorClass::Command) | None => Ok(refused(&cause, maybe_applied)),
                    // The server's trouble, not the counter's: the pass is
                    // resumed later.
                    Some(_) => Err(cause),
                }
            }
        }
    }

    /// Commits the pass: the watermark moves to its end, the held sums are
    /// stored, the intent goes — only while the pass is still this fold's.
    async fn commit(
        &self,
        (intent, repaid): (&Intent, &[Late]),
        live: &Raise,
        held: &[Held],
    ) -> Result<(), Error> {
        let committed = state::commit(
            &self.store,
            &self.state,
            self.owner,
            (intent, repaid),
            live,
            held,
        );
        if committed.await? {
            return Ok(());
        }
        // Our lost first attempt committed it, or another fold took it over
        // and committed it: either way it is done.
        let now = state::read(&self.store, &self.state).await?;
        if now.pass >= intent.pass {
            Ok(())
        } else {
            Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: intent.pass,
                why: "another fold took it over before it committed".into(),
            })
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
