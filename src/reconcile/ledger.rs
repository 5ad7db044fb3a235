//! The fold of recorded events into their counters (DESIGN §8): the
//! events ledger's step machine, run by the daemon continuously and on its
//! schedule, and embeddable as an [`EventFold`].
//!
//! One pass folds batches of events, each in five steps, every one of them
//! idempotent:
//!
//! 1. **Recover.** Every claimed, unfolded batch that no fold step of this
//!    [`EventFold`] is working on — claimed before it was created (a
//!    crashed daemon's), longer ago than `claim_timeout` (a stuck one's), or
//!    given up by this one — is finished first: steps 3–5 with the batch's
//!    own lane and number, as recorded in its claims.
//! 2. **Claim.** Up to `batch_size` unclaimed, unfolded event ids are read,
//!    then `updateMany({_id: {$in: ids}, c: absent, f: absent}, {$set: {c:
//!    {b, l, s}}})`: a fresh batch id `b`, this fold's lane `l` and its next
//!    number `s`. Two daemons claim disjoint events. A claim whose reply is
//!    lost is sent again with the same ids, batch and number; once one is
//!    confirmed, every id of the list is claimed by someone, so a copy of
//!    an earlier attempt delayed in the network changes nothing. The ids
//!    are written first in the batch's intent, from which recovery claims
//!    them itself before summing an unconfirmed batch (see the `intent` module's
//!    docs: the race this closes).
//! 3. **Sum** on the server: `$match {"c.b": b}` → `$group` by counter →
//!    `$sum` of the amounts.
//! 4. **Apply** each counter's sum through the lane `(l, s)` with the lanes
//!    protocol's conditioned update (DESIGN §3b): a batch applied again
//!    after a crash is a no-op on every counter that has it.
//! 5. **Mark** the batch's events folded: `updateMany({"c.b": b}, {$set:
//!    {f: now}})`. From then on the TTL index counts down their dedupe
//!    window.
//!
//! **The invariant.** A fold lane never applies `s + 1` to any counter
//! before batch `s` is confirmed on every counter it touches: a claim that
//! was not confirmed, or an apply that ended unknown or refused, retires
//! the lane (the next batch takes a fresh one) and leaves the batch to
//! recovery. So when recovery applies `(l, s)` again, a counter whose lane
//! entry holds `s` or more already has this batch — and one holding less
//! does not. Numbers only grow, and one is never used for two claims.
//!
//! **Pruning.** The lane entries the fold leaves in counter documents are
//! those of a minted lane: the daemon prunes them once the lane is older
//! than `lane_ttl`. A batch recovered after its lane's entry was pruned
//! would count twice, so no prune removes the entries of a lane an
//! unfinished batch was claimed with. Every reconcile run — and the
//! daemon's repair of stuck tokens, which folds documents without a ledger
//! pass — first reads [`claimed_lanes`] of the collection's events
//! collection (the configured one; `<name>_events` when the configuration
//! names no ledger, as another host's may fold it) and keeps those lanes;
//! when that read fails it prunes no lane at all. A run of a configured
//! ledger folds its events before (recovery first), so what it keeps is
//! what another fold is still working on.
//!
//! The read comes before the documents are read: a batch claimed after it
//! is not kept. Only a fold's current lane takes new claims, younger than
//! `lane_rotate` by the folding host's clock, which must be shorter than
//! the pruning `lane_ttl` by more than that clock's lag behind the
//! server's; recovery applies an old lane only to a batch whose intent or
//! claims exist already, which the read sees. As for writers' lanes, an
//! update held up in the network for longer than `lane_ttl − lane_rotate`
//! could land after its entry was pruned.

use std::time::{Duration, Instant, SystemTime};

mod intent;
mod query;
mod reconciler;
mod state;

use futures::{StreamExt, TryStreamExt};
use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::document::integer_value;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;
use crate::write::counter::{CollectionConfig, Counters, WriterConfig};
use crate::write::lane::{LaneId, LaneIncrement};
use crate::write::ledger::{field, index};
#[cfg(feature = "daemon")]
pub(crate) use intent::collection_name as intents_collection_name;
use query::aggregate_all;
pub(crate) use query::backlog;
pub use query::claimed_lanes;
pub(crate) use reconciler::Folds;
use state::{FoldState, Unapplied};

/// How many counters a batch's apply writes at once.
const APPLY_CONCURRENCY: usize = 16;

/// What an [`EventFold`] needs to know besides the collection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFoldSettings {
    /// Events per batch (claimed, summed, applied and marked together).
    /// Default: 5000 — a counter is written once per batch, so larger
    /// batches write fewer times per event (on the test server 5,000 fold
    /// 10,000 events over 1,000 counters in ~0.6× the time 1,000 take); a
    /// batch's intent holds its keys (5,000 keys of the longest, 512 bytes,
    /// are 2.6 MB, well inside a document's 16 MiB).
    pub batch_size: u32,
    /// A batch claimed longer ago than this by a fold step that is not
    /// this one's is finished by recovery. Default: 2 minutes — far longer
    /// than a batch takes.
    pub claim_timeout: Duration,
    /// The fold lane is replaced by a fresh one once older than this (its
    /// numbers are counts, whose entries are pruned by the lane's age;
    /// `tallyd` sets it to `[writer] lane_resume_horizon`, at most 1 hour).
    /// Must be shorter than the
    /// `lane_ttl` of every prune of these counters (see the module docs,
    /// "Pruning"), as the daemon's configuration checks. Default: 1 hour.
    pub lane_rotate: Duration,
    /// The dedupe window: a folded event is forgotten this long after it
    /// was folded (the TTL index's period). Default: 7 days.
    pub event_retention: Duration,
    /// A pass claims no new batch once it has run this long (one batch at
    /// least)
    /// ([`EventsRun::more`] then says events are left): the fold's lock is
    /// released and the caller checks its role between passes. Default:
    /// 10 seconds.
    pub pass_limit: Duration,
}

impl Default for EventFoldSettings {
    fn default() -> Self {
        Self {
            batch_size: 5000,
            claim_timeout: Duration::from_secs(120),
            lane_rotate: Duration::from_secs(3600),
            event_retention: index::DEFAULT_EVENT_RETENTION,
            pass_limit: Duration::from_secs(10),
        }
    }
}

/// One claimed batch: its id and the lane number it is applied with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedBatch {
    /// The batch id (`c.b`); its time is when it was claimed.
    pub id: ObjectId,
    /// The fold lane (`c.l`).
    pub lane: ObjectId,
    /// The lane's number for this batch (`c.s`).
    pub number: i64,
}

impl ClaimedBatch {
    /// The batch of a row `{_id: b, l: <lane hex>, s: <number>}` (a claim
    /// grouped by batch, or an intent); `None` when malformed.
    fn of_row(row: &Document) -> Option<Self> {
        Some(Self {
            id: row.get_object_id("_id").ok()?,
            lane: ObjectId::parse_str(row.get_str("l").ok()?).ok()?,
            number: row.get("s").and_then(integer_value)?,
        })
    }
}

/// One counter's share of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterSum {
    /// The counter's `_id`.
    pub key: Bson,
    /// The sum of the batch's events on it.
    pub amount: i64,
    /// How many of the batch's events are on it.
    pub events: u64,
}

/// What one fold pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventsRun {
    /// Events marked folded (their amounts are in their counters).
    pub events_folded: u64,
    /// Batches finished (recovered ones included).
    pub batches: u64,
    /// Of them, batches finished by recovery.
    pub recovered: u64,
    /// Counter updates sent (one per counter per batch).
    pub counters_written: u64,
    /// The pass ended at its time limit with events possibly left: run
    /// another.
    pub more: bool,
}

/// The unfolded events of a ledger: how many, and the oldest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Events not folded yet (claimed ones included).
    pub events: u64,
    /// The oldest unfolded event's age (by its `at` against `now`).
    pub oldest_age: Option<Duration>,
}

/// Folds one ledger's events into its counters. One pass at a time (a
/// second waits for the first); cheap to keep for the life of a process —
/// its lane and numbers carry from pass to pass.
#[derive(Debug)]
pub struct EventFold {
    store: Store,
    events: Collection<Document>,
    events_name: String,
    intents: Collection<Document>,
    counters: Counters,
    settings: EventFoldSettings,
    started: SystemTime,
    state: Mutex<FoldState>,
}

impl EventFold {
    /// A fold of `spec`'s events collection into `spec`'s counters.
    pub fn new(store: &Store, spec: CollectionConfig, settings: EventFoldSettings) -> Self {
        let events_name = spec.events_collection_name();
        Self {
            store: store.clone(),
            events: store.collection(&events_name),
            intents: store.collection(&intent::collection_name(&events_name)),
            events_name,
            counters: Counters::new(store, spec, WriterConfig::default()),
            settings,
            started: SystemTime::now(),
            state: Mutex::new(FoldState::default()),
        }
    }

    /// The events collection's name.
    pub fn events_collection(&self) -> &str {
        &self.events_name
    }

    /// Refuses a ledger without the indexes the fold needs
    /// ([`Error::IndexesMissing`]).
    pub async fn check_indexes(&self) -> Result<(), Error> {
        let missing = index::missing(
            &self.store,
            &self.events_name,
            self.settings.event_retention,
        )
        .await?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Error::IndexesMissing {
                collection: self.events_name.clone(),
                missing,
            })
        }
    }

    /// One fold pass: recovery, then batches until no unclaimed event is
    /// left, `stop` is cancelled or the pass has run `pass_limit`. `now` is
    /// the server's clock at the start of the pass; each batch's folded
    /// mark carries it advanced by the time the pass has run (a monotonic
    /// clock), so an event's dedupe window starts when its batch is marked.
    /// A failed step fails the pass; what it left is finished by the next
    /// pass's recovery.
    pub async fn fold(
        &self,
        now: SystemTime,
        stop: &CancellationToken,
    ) -> Result<EventsRun, Error> {
        let began = Instant::now();
        let clock = move || now + began.elapsed();
        self.check_indexes().await?;
        let mut state = self.state.lock().await;
        let mut run = self.recover_locked(&mut state, &clock).await?;
        while !stop.is_cancelled() {
            let Some(batch) = self.claim_locked(&mut state).await? else {
                break;
            };
            // The invariant: no `s + 1` on this lane before `s` is
            // confirmed everywhere. Whatever ends this between the claim and
            // a confirmed apply (an error, a dropped future) retires it.
            let unapplied = Unapplied::arm(&mut state, batch.id);
            let sums = self.sum(&batch).await?;
            run.counters_written += self.apply(&batch, &sums, false).await?;
            unapplied.disarm();
            let marked = match self.mark(&batch, clock()).await {
                Ok(marked) => intent::remove(&self.store, &self.intents, batch.id)
                    .await
                    .map(|()| marked),
                Err(err) => Err(err),
            };
            match marked {
                Ok(marked) => run.events_folded += marked,
                Err(err) => {
                    state.abandoned.insert(batch.id);
                    return Err(err);
                }
            }
            run.batches += 1;
            // At least one batch a pass, however short the limit.
            if began.elapsed() >= self.settings.pass_limit {
                run.more = true;
                break;
            }
        }
        Ok(run)
    }

    /// Step 1 alone: finishes every batch no fold step of this one is
    /// working on (see the module docs).
    pub async fn recover(&self, now: SystemTime) -> Result<EventsRun, Error> {
        let began = Instant::now();
        let mut state = self.state.lock().await;
        self.recover_locked(&mut state, &move || now + began.elapsed())
            .await
    }

    /// Step 2 alone: claims the next batch with this fold's lane; `None`
    /// when no unclaimed event is left.
    pub async fn claim(&self) -> Result<Option<ClaimedBatch>, Error> {
        let mut state = self.state.lock().await;
        self.claim_locked(&mut state).await
    }

    async fn recover_locked(
        &self,
        state: &mut FoldState,
        clock: &impl Fn() -> SystemTime,
    ) -> Result<EventsRun, Error> {
        let mut run = EventsRun::default();
        let started = secs(self.started);
        let timed_out =
            secs(SystemTime::now()).saturating_sub(self.settings.claim_timeout.as_secs());
        for (batch, ids) in self.unfinished().await? {
            let claimed =
                u64::try_from(batch.id.timestamp().timestamp_millis() / 1000).unwrap_or(0);
            let ours_live = claimed > started && claimed > timed_out;
            if ours_live && !state.abandoned.contains(&batch.id) {
                continue;
            }
            tracing::info!(
                collection = %self.events_name,
                batch = %batch.id,
                lane = %batch.lane,
                number = batch.number,
                "recovering an unfinished fold batch"
            );
            if let Some(ids) = &ids {
                // Fixes the batch's events: no copy of its claim, however
                // late, adds one from now on.
                intent::claim(&self.store, &self.events, &batch, ids).await?;
            }
            // A batch with every event marked was applied in full: applied
            // again, a lane entry pruned meanwhile would count it twice.
            if self.open(&batch).await? > 0 {
                let sums = self.sum(&batch).await?;
                run.counters_written += self.apply(&batch, &sums, true).await?;
                run.events_folded += self.mark(&batch, clock()).await?;
            }
            if ids.is_some() {
                intent::remove(&self.store, &self.intents, batch.id).await?;
            }
            state.abandoned.remove(&batch.id);
            run.batches += 1;
            run.recovered += 1;
        }
        Ok(run)
    }

    async fn claim_locked(&self, state: &mut FoldState) -> Result<Option<ClaimedBatch>, Error> {
        let filter = doc! {
            field::FOLDED: { "$exists": false },
            field::CLAIM: { "$exists": false },
        };
        let mut budget = RetryBudget::read_once("ledger.fold.pick");
        let limit = i64::from(self.settings.batch_size.max(1));
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .find(filter.clone())
                    .projection(doc! { "_id": 1 })
                    .limit(limit)
            })
            .await
            .map_err(Error::Server)?;
        let picked: Vec<Document> = cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("ledger.fold.pick", err)))?;
        if picked.is_empty() {
            return Ok(None);
        }
        let ids: Vec<Bson> = picked
            .into_iter()
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        let now = SystemTime::now();
        let (lane, number) = match state.lane {
            Some((lane, next)) if age(lane, now) < self.settings.lane_rotate => (lane, next),
            _ => (ObjectId::new(), 1),
        };
        // A number is never used for two claims, whatever becomes of this
        // one.
        state.lane = Some((lane, number + 1));
        let batch = ClaimedBatch {
            id: ObjectId::new(),
            lane,
            number,
        };
        // The intent first: recovery needs the ids to fix the batch's
        // events whatever becomes of the claim (see `intent`).
        // Until confirmed, events may carry this claim, or may still get
        // it: an error or a dropped future retires the lane, and recovery
        // finishes whatever does with this lane and number, which nothing
        // else will use.
        let unclaimed = Unapplied::arm(state, batch.id);
        intent::write(&self.store, &self.intents, &batch, &ids).await?;
        intent::claim(&self.store, &self.events, &batch, &ids).await?;
        unclaimed.disarm();
        Ok(Some(batch))
    }

    /// Step 3: the batch's sums per counter, computed by the server.
    pub async fn sum(&self, batch: &ClaimedBatch) -> Result<Vec<CounterSum>, Error> {
        let pipeline = vec![
            doc! { "$match": { field::BATCH: batch.id } },
            doc! { "$group": {
                "_id": format!("${}", field::COUNTER),
                "n": { "$sum": format!("${}", field::AMOUNT) },
                "events": { "$sum": 1 },
            } },
        ];
        let rows = aggregate_all(&self.store, &self.events, pipeline, "ledger.fold.sum").await?;
        rows.into_iter()
            .map(|row| {
                let key = row.get("_id").cloned().unwrap_or(Bson::Null);
                let amount =
                    row.get("n")
                        .and_then(integer_value)
                        .ok_or_else(|| Error::Malformed {
                            collection: self.events_name.clone(),
                            id: format!("batch {}", batch.id),
                            reason: format!(
                                "the events of counter {key} do not sum to an exact integer"
                            ),
                        })?;
                let events = row.get("events").and_then(integer_value).unwrap_or(0);
                Ok(CounterSum {
                    key,
                    amount,
                    events: u64::try_from(events).unwrap_or(0),
                })
            })
            .collect()
    }

    /// Step 4: adds each counter's sum through the batch's lane number.
    /// `resumed`: the batch may have been applied before (recovery). Ok
    /// with the number of updates sent when every counter is confirmed.
    pub async fn apply(
        &self,
        batch: &ClaimedBatch,
        sums: &[CounterSum],
        resumed: bool,
    ) -> Result<u64, Error> {
        let lane = LaneId::Minted(batch.lane);
        let updates: Vec<_> = sums
            .iter()
            .filter(|sum| sum.amount != 0)
            .map(|sum| {
                let (counters, lane) = (self.counters.clone(), lane.clone());
                let (key, number, amount) = (sum.key.clone(), batch.number, sum.amount);
                async move {
                    counters
                        .add_through(key, lane, number, amount, resumed)
                        .await
                }
            })
            .collect();
        let outcomes: Vec<LaneIncrement> = futures::stream::iter(updates)
            .buffer_unordered(APPLY_CONCURRENCY)
            .collect()
            .await;
        let written = outcomes.len() as u64;
        for outcome in outcomes {
            if let Some(cause) = outcome.cause() {
                tracing::warn!(
                    collection = %self.events_name,
                    batch = %batch.id,
                    counter = %outcome.key(),
                    outcome = outcome.name(),
                    cause = %cause,
                    "a fold batch's counter update is not confirmed; the batch is left to recovery"
                );
                return Err(cause.clone());
            }
        }
        Ok(written)
    }

    /// Step 5: marks the batch's events folded at `now`. Returns how many
    /// this call marked.
    pub async fn mark(&self, batch: &ClaimedBatch, now: SystemTime) -> Result<u64, Error> {
        let filter = doc! { field::BATCH: batch.id, field::FOLDED: { "$exists": false } };
        let update = doc! { "$set": { field::FOLDED: DateTime::from_system_time(now) } };
        let mut budget = RetryBudget::retry_once("ledger.fold.mark");
        let marked = self
            .store
            .with_retry(&mut budget, || {
                self.events.update_many(filter.clone(), update.clone())
            })
            .await
            .map_err(Error::Server)?;
        Ok(marked.modified_count)
    }

    /// The unfolded events: how many, and the oldest one's age at `now`.
    pub async fn backlog(&self, now: SystemTime) -> Result<Backlog, Error> {
        backlog(&self.store, &self.events_name, now).await
    }

    /// How many of the batch's events are not marked folded.
    async fn open(&self, batch: &ClaimedBatch) -> Result<u64, Error> {
        let filter = doc! { field::BATCH: batch.id, field::FOLDED: { "$exists": false } };
        let mut budget = RetryBudget::read_once("ledger.fold.open");
        self.store
            .with_retry(&mut budget, || self.events.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)
    }

    /// The batches left to finish, oldest first: every intent (with its
    /// ids), and every claimed, unfolded batch without one.
    async fn unfinished(&self) -> Result<Vec<(ClaimedBatch, Option<Vec<Bson>>)>, Error> {
        let mut all: std::collections::BTreeMap<ObjectId, (ClaimedBatch, Option<Vec<Bson>>)> = self
            .claimed()
            .await?
            .into_iter()
            .map(|b| (b.id, (b, None)))
            .collect();
        for found in intent::all(&self.store, &self.intents).await? {
            all.insert(found.batch.id, (found.batch, Some(found.ids)));
        }
        Ok(all.into_values().collect())
    }

    /// The claimed, unfolded batches, with their lanes and numbers.
    async fn claimed(&self) -> Result<Vec<ClaimedBatch>, Error> {
        let pipeline = vec![
            doc! { "$match": {
                field::FOLDED: { "$exists": false },
                field::CLAIM: { "$exists": true },
            } },
            doc! { "$group": { "_id": "$c.b", "l": { "$first": "$c.l" }, "s": { "$first": "$c.s" } } },
        ];
        let rows = aggregate_all(
            &self.store,
            &self.events,
            pipeline,
            "ledger.fold.unfinished",
        )
        .await?;
        let mut batches = Vec::new();
        for row in rows {
            match ClaimedBatch::of_row(&row) {
                Some(batch) => batches.push(batch),
                None => tracing::warn!(
                    collection = %self.events_name,
                    claim = %row,
                    "an event's claim is malformed; left as it is"
                ),
            }
        }
        batches.sort_by_key(|b| b.id);
        Ok(batches)
    }
}

/// Seconds since the epoch.
fn secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A lane's age by the time in its id.
fn age(lane: ObjectId, now: SystemTime) -> Duration {
    let created: SystemTime = lane.timestamp().into();
    now.duration_since(created).unwrap_or(Duration::ZERO)
}
