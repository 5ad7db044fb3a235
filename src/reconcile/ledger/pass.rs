//! One pass of the fold, step by step (the parent module's docs say why
//! each step is safe): survey, intent, sums, apply, commit, seal.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use futures::StreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tokio_util::sync::CancellationToken;

use super::held::{self, Applied, Work};
use super::query::{self, Share};
use super::{APPLY_CONCURRENCY, EventFold, EventsRun};
use crate::document::{CanonicalKey, display_id};
use crate::error::{Error, ErrorClass, RetryBudget};
use crate::write::lane::{LaneId, LaneIncrement};
use crate::write::ledger::state::{self, FoldState, Held, Intent, STATE_ID, field};

/// What applying a pass came to.
struct Applying {
    held: Vec<Held>,
    written: u64,
    events: u64,
    malformed: u64,
}

impl EventFold {
    /// One pass: resumes or takes over an unfinished one, or surveys and
    /// records a new one; applies it and commits it; seals the lanes it
    /// may.
    pub(super) async fn pass(
        &self,
        clock: &(impl Fn() -> SystemTime + Sync),
        stop: &CancellationToken,
    ) -> Result<EventsRun, Error> {
        let mut run = EventsRun::default();
        if stop.is_cancelled() {
            return Ok(run);
        }
        let state = state::read(&self.store, &self.state).await?;
        if !state.exists {
            self.check_lanes_registered(&state).await?;
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
            None => {
                let surveyed = clock();
                let ranges = self.survey(&state, surveyed).await?;
                if ranges.is_empty() && state.held.is_empty() {
                    run.lanes_sealed = self.seal(&state, surveyed).await?;
                    return Ok(run);
                }
                if !state.exists {
                    self.check_no_counter_folded().await?;
                }
                self.intend(&state, ranges, surveyed, clock()).await?
            }
        };
        let Some(intent) = intent else {
            run.busy = true;
            return Ok(run);
        };
        let applied = self.apply(&state, &intent, clock).await?;
        self.commit(&intent, &applied.held).await?;
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
        run.lanes_sealed = self.seal(&state, intent.surveyed).await?;
        Ok(run)
    }

    /// Step 1: each registered lane's events above its folded number, as
    /// the ranges a pass folds (up to a visible number; `now` is the
    /// server's clock).
    async fn survey(
        &self,
        state: &FoldState,
        now: SystemTime,
    ) -> Result<BTreeMap<ObjectId, (i64, i64)>, Error> {
        // One probe per live lane, sent at once (see `query::survey_lanes`
        // for why not one aggregate over every lane).
        let probes =
            state
                .registered
                .iter()
                .filter(|r| r.sealed.is_none())
                .map(|registered| async move {
                    let lane = registered.lane;
                    let folded = state.folded.get(&lane).copied();
                    let highest =
                        query::highest(&self.store, &self.events, lane, folded, now).await?;
                    // Numbers are positive: 0 is below every one.
                    Ok::<_, Error>(highest.map(|highest| (lane, (folded.unwrap_or(0), highest))))
                });
        Ok(futures::future::try_join_all(probes)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Step 2: records the pass, conditioned on the state not having
    /// changed since it was read; `None` when another fold got there first.
    async fn intend(
        &self,
        state: &FoldState,
        ranges: BTreeMap<ObjectId, (i64, i64)>,
        surveyed: SystemTime,
        now: SystemTime,
    ) -> Result<Option<Intent>, Error> {
        let intent = Intent {
            pass: state.pass + 1,
            ranges,
            owner: self.owner,
            deadline: now + self.settings.lease,
            recovered: false,
            surveyed,
        };
        let mut budget = RetryBudget::retry_once("ledger.fold.intent");
        let written = if state.exists {
            let filter = doc! {
                "_id": STATE_ID,
                field::VERSION: state.version,
                field::INTENT: { "$exists": false },
            };
            let update = doc! {
                "$set": { field::INTENT: intent.to_document() },
                "$inc": { field::VERSION: 1 },
            };
            self.store
                .with_retry(&mut budget, || {
                    self.state.update_one(filter.clone(), update.clone())
                })
                .await
                .map(|r| r.matched_count == 1)
        } else {
            let document = doc! {
                "_id": STATE_ID, field::PASS: 0i64, field::VERSION: 1i64,
                field::INTENT: intent.to_document(),
            };
            match self
                .store
                .with_retry(&mut budget, || self.state.insert_one(document.clone()))
                .await
            {
                Ok(_) => Ok(true),
                // Another fold created the state first (or our own lost
                // attempt did: read below).
                Err(failure) if failure.class == ErrorClass::DuplicateKey => Ok(false),
                Err(failure) => Err(failure),
            }
        };
        // An unknown outcome fails the pass; if it landed, the next pass
        // finds it as its own.
        if written.map_err(Error::Server)? {
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
        let filter = doc! {
            "_id": STATE_ID, "intent.owner": from, "intent.pass": intent.pass,
        };
        let deadline = now + self.settings.lease;
        let update = doc! { "$set": {
            "intent.owner": self.owner,
            "intent.deadline": DateTime::from_system_time(deadline),
            "intent.recovered": true,
        } };
        let claimed = self
            .store
            .update_one(&self.state, filter, update, "ledger.fold.take_over")
            .await?;
        if from != self.owner {
            tracing::info!(
                events = %self.events_name,
                pass = intent.pass,
                from = %from,
                "taking over a fold pass whose owner stopped renewing it"
            );
        }
        Ok((claimed.matched_count == 1).then(|| Intent {
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
                match self.renew(intent, clock() + lease).await {
                    Ok(true) => *lock(&sendable_until) = asked + lease,
                    Ok(false) => {
                        return Error::InvalidArgument(format!(
                            "fold pass {} of {} was taken over by another fold",
                            intent.pass, self.events_name
                        ));
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
        let mut shares: HashMap<CanonicalKey, Share> = HashMap::new();
        for (&lane, &range) in &intent.ranges {
            query::sum_lane(&self.store, &self.events, lane, range, &mut shares).await?;
        }
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
        let outcomes: Vec<Result<held::Done, Error>> = futures::stream::iter(work)
            .map(|work| {
                let key = work.key.clone();
                held::apply(
                    work,
                    intent.pass,
                    intent.recovered,
                    now,
                    move |p, n, resumed| self.send(key.clone(), p, n, resumed, sendable_until),
                )
            })
            .buffer_unordered(APPLY_CONCURRENCY)
            .collect()
            .await;
        let mut applying = Applying {
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

    /// One sum to one counter through the fold lane at `position`.
    async fn send(
        &self,
        key: Bson,
        position: i64,
        amount: i64,
        resumed: bool,
        sendable_until: &Mutex<Instant>,
    ) -> Result<Applied, Error> {
        if Instant::now() >= *lock(sendable_until) {
            return Err(Error::InvalidArgument(format!(
                "the lease of a fold pass of {} ran out; the pass is left to be resumed",
                self.events_name
            )));
        }
        let lane = LaneId::Named(self.fold_lane.clone()?);
        let outcome = self
            .counters
            .add_through(key, lane, position, amount, resumed)
            .await;
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

    /// Extends the pass's deadline; false when it is no longer this
    /// fold's.
    async fn renew(&self, intent: &Intent, deadline: SystemTime) -> Result<bool, Error> {
        let filter = doc! {
            "_id": STATE_ID, "intent.owner": self.owner, "intent.pass": intent.pass,
        };
        let update = doc! { "$set": { "intent.deadline": DateTime::from_system_time(deadline) } };
        let renewed = self
            .store
            .update_one(&self.state, filter, update, "ledger.fold.renew")
            .await?;
        Ok(renewed.matched_count == 1)
    }

    /// Step 5: advances each lane's folded number to its range's end, stores
    /// the held sums and drops the intent — only while the pass is still
    /// this fold's.
    async fn commit(&self, intent: &Intent, held: &[Held]) -> Result<(), Error> {
        let filter = doc! {
            "_id": STATE_ID, "intent.owner": self.owner, "intent.pass": intent.pass,
        };
        let mut set = doc! {
            field::PASS: intent.pass,
            field::HELD: held.iter().map(Held::to_document).collect::<Vec<Document>>(),
        };
        for (lane, (_, to)) in &intent.ranges {
            set.insert(format!("{}.{}", field::FOLDED, lane.to_hex()), *to);
        }
        let update = doc! {
            "$set": set,
            "$unset": { field::INTENT: "" },
            "$inc": { field::VERSION: 1 },
        };
        let committed = self
            .store
            .update_one(&self.state, filter, update, "ledger.fold.commit")
            .await?;
        if committed.matched_count == 1 {
            return Ok(());
        }
        // Our lost first attempt committed it, or another fold took it over
        // and committed it: either way it is done.
        let now = state::read(&self.store, &self.state).await?;
        if now.pass >= intent.pass {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "fold pass {} of {} was taken over by another fold before it committed",
                intent.pass, self.events_name
            )))
        }
    }

    /// Seals the lanes that could receive no insert after `surveyed` — a
    /// pass that began then, and committed, folded them whole — dated
    /// `surveyed` (the fold's clock): passes stop surveying them, and the
    /// sweep deletes their events a dedupe window after that date. Returns
    /// how many.
    async fn seal(&self, state: &FoldState, surveyed: SystemTime) -> Result<u64, Error> {
        let sealed: Vec<ObjectId> = state
            .registered
            .iter()
            .filter(|r| r.sealed.is_none() && self.sealed_after(r.at) <= surveyed)
            .map(|r| r.lane)
            .collect();
        if sealed.is_empty() {
            return Ok(0);
        }
        let filter = doc! { "_id": { "$in": sealed.clone() }, field::SEALED: { "$exists": false } };
        let update = doc! { "$set": { field::SEALED: DateTime::from_system_time(surveyed) } };
        let mut budget = RetryBudget::retry_once("ledger.fold.seal");
        self.store
            .with_retry(&mut budget, || {
                self.state.update_many(filter.clone(), update.clone())
            })
            .await
            .map_err(Error::Server)?;
        tracing::debug!(events = %self.events_name, lanes = sealed.len(), "recorder lanes sealed");
        Ok(sealed.len() as u64)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
