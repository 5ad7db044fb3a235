//! Closing buckets (the book: design/buckets.md): every bucket of a
//! bucketed collection that ended `close_after` plus the closing margin ago
//! ([`Buckets::closes_at`](crate::Buckets::closes_at)) is made final and
//! compact — once the run's fold has taken its pending tokens and its
//! recorded events — and marked `closed` with the run's server time.
//!
//! By then no write the bucket accepted can still land: writers refuse its
//! time from `close_after` on, and the margin outlasts every re-send (a
//! step 1's, a lane's) plus the grace. So closing only removes what can no
//! longer be needed:
//!
//! - **settle markers**, all of them — the fold prunes them after the grace
//!   anyway, and no delayed step 1 of the bucket can re-add a token now;
//! - **minted lanes' entries**, all of them — no update of a lane for the
//!   bucket can be re-sent past `lane_resume_horizon`;
//! - an empty `pending` array.
//!
//! It keeps the counter as it is and **named lanes' entries**: a ledger's
//! fold lane may resume a pass with an update for the counter at any time
//! (a daemon down for days), and that update is refused only while the
//! entry is there. A named lane writes one entry, so a closed bucket holds
//! at most one per named lane: compact.
//!
//! A bucket closes only when nothing is left to fold: a pending token (the
//! fold did not take it: younger than its grace — a writer's clock far
//! behind — or refused), a recorded event not folded yet or a held sum
//! keeps it open and reported, and a malformed document is never modified.
//! The statement is conditioned on every field it removes or keeps exactly
//! as read and on `closed` being unset, so a write in between makes it
//! match nothing (the next run reads the bucket again), and sending it
//! twice closes once.
//!
//! The cost follows what is open: buckets are found through the index
//! `{closed: 1, _id.t: 1}` (`tallyd setup`), whose `closed: null` range
//! holds the open buckets only.

use std::time::SystemTime;

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use tokio_util::sync::CancellationToken;

use super::batch;
use super::model::{self, plan_lanes};
use super::report::{BucketClosing, CollectionRun, UnclosedBucket};
use super::statement::Statement;
use super::{FoldTarget, Mode, Reconciler};
use crate::bucket::{Buckets, CLOSED_FIELD};
use crate::document::display_id;
use crate::error::{Error, Failure, RetryBudget};
use crate::ledger::Ledger;
use crate::token::Token;
use crate::write::at::{START, by_any, by_id, split_id};
use crate::write::counter::CollectionConfig;

/// Unclosed buckets a run lists by `_id` (all are counted).
pub const UNCLOSED_SAMPLE: usize = 10;

/// The least Date an open bucket's start is looked for from: the start of
/// year 1 (the test server's dates begin there; buckets before it are not
/// found).
const FIRST_DATE: DateTime = DateTime::from_millis(-62_135_596_800_000);

/// The open buckets (`closed` unset), those that start before `below`
/// when given: one range of the index `{closed: 1, _id.t: 1}`.
fn open_filter(below: Option<SystemTime>) -> Document {
    let mut start = doc! { "$gte": FIRST_DATE };
    if let Some(below) = below {
        start.insert("$lt", DateTime::from_system_time(below));
    }
    doc! { CLOSED_FIELD: Bson::Null, format!("_id.{START}"): start }
}

/// The line below which buckets are due to close at `now`
/// ([`Buckets::due_before`]), as the run's error when the calendar cannot
/// reach it.
fn due_line(buckets: &Buckets, now: SystemTime) -> Result<Option<SystemTime>, Error> {
    buckets
        .due_before(now)
        .map_err(|err| Error::InvalidArgument(format!("closing buckets: {err}")))
}

/// One bucket that can be closed: its statement, as read.
struct Closable {
    id: Bson,
    statement: Statement,
}

/// A bucketed collection's buckets not closed yet, as `tallyd status`
/// shows them: how many, the oldest one's start, and how many of them are
/// past their closing time (the next run closes them, or names why not).
///
/// ```no_run
/// # fn demo(open: tally::OpenBuckets) {
/// if open.past_closing_time > 0 {
///     eprintln!("{} buckets wait for a reconcile run to close them", open.past_closing_time);
/// }
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenBuckets {
    /// Buckets not closed.
    pub open: u64,
    /// The start of the oldest one.
    pub oldest_open: Option<SystemTime>,
    /// Those that ended `close_after` plus the closing margin ago.
    pub past_closing_time: u64,
}

impl Reconciler {
    /// The open buckets of `target` at server time `now`, read through the
    /// index `{closed: 1, _id.t: 1}` (their number, not the collection's);
    /// `None` for a collection without buckets.
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::Reconciler, target: tally::FoldTarget) -> Result<(), tally::Error> {
    /// let now = fold.server_time().await?;
    /// if let Some(open) = fold.open_buckets(&target, now).await? {
    ///     println!("{} open, {} past their closing time", open.open, open.past_closing_time);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn open_buckets(
        &self,
        target: &FoldTarget,
        now: SystemTime,
    ) -> Result<Option<OpenBuckets>, Error> {
        let Some(buckets) = &target.spec.buckets else {
            return Ok(None);
        };
        let mut closing = BucketClosing::default();
        self.count_open(&target.spec, &mut closing).await?;
        let past_closing_time = match due_line(buckets, now)? {
            None => 0,
            Some(due) => {
                let collection = self.store.collection(&target.spec.name);
                let filter = open_filter(Some(due));
                let mut budget = RetryBudget::read_once("close.count_due");
                self.store
                    .with_retry(&mut budget, || collection.count_documents(filter.clone()))
                    .await
                    .map_err(Error::Server)?
            }
        };
        Ok(Some(OpenBuckets {
            open: closing.open,
            oldest_open: closing.oldest_open,
            past_closing_time,
        }))
    }

    /// Closes the due buckets of `target` (nothing without buckets) and
    /// counts those left open: `run.buckets`.
    pub(super) async fn close_buckets(
        &self,
        target: &FoldTarget,
        mode: Mode,
        now: SystemTime,
        stop: &CancellationToken,
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        let Some(buckets) = &target.spec.buckets else {
            return Ok(());
        };
        let due = due_line(buckets, now)?;
        let mut closing = BucketClosing {
            due_before: due,
            ..BucketClosing::default()
        };
        let result = self
            .close_due(target, buckets, mode, now, due, stop, run, &mut closing)
            .await;
        if result.is_ok() && !run.interrupted {
            self.count_open(&target.spec, &mut closing).await?;
        }
        run.buckets = Some(closing);
        result
    }

    /// Reads the open buckets that start before `due`, a batch at a time,
    /// and closes those that can be.
    #[allow(clippy::too_many_arguments)]
    async fn close_due(
        &self,
        target: &FoldTarget,
        buckets: &Buckets,
        mode: Mode,
        now: SystemTime,
        due: Option<SystemTime>,
        stop: &CancellationToken,
        run: &mut CollectionRun,
        closing: &mut BucketClosing,
    ) -> Result<(), Error> {
        let Some(due) = due else {
            return Ok(());
        };
        let spec = &target.spec;
        let collection = self.store.collection(&spec.name);
        let filter = open_filter(Some(due));
        let projection = doc! {
            &spec.counter_field: 1,
            &spec.pending_field: 1,
            &spec.settled_field: 1,
            &spec.lanes_field: 1,
        };
        let mut budget = RetryBudget::retry_once("close.find");
        let mut cursor = self
            .store
            .with_retry(&mut budget, || {
                collection
                    .find(filter.clone())
                    .projection(projection.clone())
                    .batch_size(target.batch_size)
            })
            .await
            .map_err(Error::Server)?;
        let mut batch: Vec<Closable> = Vec::new();
        loop {
            let next = cursor
                .try_next()
                .await
                .map_err(|err| Error::Server(Failure::once("close.find", err)))?;
            let finished = next.is_none();
            if let Some(document) = next {
                match judge(spec, buckets, &document, now) {
                    Ok(closable) => batch.push(closable),
                    Err(reason) => closing.unclosed_one(buckets, &document, reason),
                }
            }
            if batch.len() >= target.batch_size.max(1) as usize || (finished && !batch.is_empty()) {
                if stop.is_cancelled() {
                    run.interrupted = true;
                    return Ok(());
                }
                let ready = self
                    .nothing_unfolded(spec, std::mem::take(&mut batch), closing)
                    .await?;
                match mode {
                    Mode::DryRun => closing.closed += ready.len() as u64,
                    Mode::Fold => self.send(spec, ready, closing).await?,
                }
            }
            if finished {
                return Ok(());
            }
        }
    }

    /// Those of `batch` whose ledger (when the collection has one) holds
    /// no recorded event or held sum not folded into them yet; the others
    /// are reported.
    async fn nothing_unfolded(
        &self,
        spec: &CollectionConfig,
        batch: Vec<Closable>,
        closing: &mut BucketClosing,
    ) -> Result<Vec<Closable>, Error> {
        let Some(buckets) = spec.buckets.as_ref() else {
            return Ok(batch);
        };
        if spec.events_collection.is_none() || batch.is_empty() {
            return Ok(batch);
        }
        let ledger = Ledger::new(&self.store, spec.clone());
        let ids: Vec<Bson> = batch.iter().map(|c| c.id.clone()).collect();
        let values = match ledger.values_of(ids).await {
            Ok(values) => values,
            // One bad counter or event fails a read of many: read them one
            // by one, so that it stops only itself.
            Err(Error::Malformed { .. }) => {
                let mut values = Vec::with_capacity(batch.len());
                let mut ready = Vec::new();
                for closable in batch {
                    match ledger.values_of(vec![closable.id.clone()]).await {
                        Ok(mut one) => {
                            values.push(one.pop().expect("one value per id"));
                            ready.push(closable);
                        }
                        Err(err @ Error::Malformed { .. }) => {
                            closing.unclosed_id(buckets, &closable.id, err.to_string());
                        }
                        Err(err) => return Err(err),
                    }
                }
                return Ok(keep_folded(buckets, ready, values, closing));
            }
            Err(err) => return Err(err),
        };
        Ok(keep_folded(buckets, batch, values, closing))
    }

    /// Sends the statements closing `ready`.
    async fn send(
        &self,
        spec: &CollectionConfig,
        ready: Vec<Closable>,
        closing: &mut BucketClosing,
    ) -> Result<(), Error> {
        let Some(buckets) = spec.buckets.as_ref() else {
            return Ok(());
        };
        if ready.is_empty() {
            return Ok(());
        }
        let statements: Vec<(usize, &Statement)> = ready
            .iter()
            .enumerate()
            .map(|(i, c)| (i, &c.statement))
            .collect();
        let outcome = batch::send(&self.store, &spec.name, &statements).await?;
        let mut refused = vec![false; ready.len()];
        for refusal in &outcome.refused {
            refused[refusal.document] = true;
            let id = &ready[refusal.document].id;
            tracing::warn!(collection = %spec.name, id = %display_id(id), code = refusal.code, reason = %refusal.message, "the server refused to close a bucket");
            closing.unclosed_id(
                buckets,
                id,
                format!(
                    "the server refused to close it ({}: {})",
                    refusal.code, refusal.message
                ),
            );
        }
        let sent = (ready.len() - outcome.refused.len()) as u64;
        if outcome.modified == sent {
            closing.closed += sent;
            return Ok(());
        }
        // Some matched nothing: written since they were read (the next run
        // reads them again) — or closed by a first attempt whose reply was
        // lost, the retry then matching nothing. Which, the documents say.
        let ids: Vec<Bson> = ready
            .iter()
            .zip(&refused)
            .filter(|(_, refused)| !**refused)
            .map(|(c, _)| c.id.clone())
            .collect();
        let now_closed = self.count_closed(spec, &ids).await?;
        closing.closed += now_closed;
        closing.raced += sent.saturating_sub(now_closed);
        Ok(())
    }

    /// How many of the documents `ids` are closed now.
    async fn count_closed(&self, spec: &CollectionConfig, ids: &[Bson]) -> Result<u64, Error> {
        let collection = self.store.collection(&spec.name);
        let mut filter = by_any("_id", ids);
        filter.insert(CLOSED_FIELD, doc! { "$type": "date" });
        let mut budget = RetryBudget::read_once("close.read_closed");
        self.store
            .with_retry(&mut budget, || collection.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)
    }

    /// How many buckets are open and the oldest one's start, through the
    /// index `{closed: 1, _id.t: 1}`. After a dry run, those it would close
    /// still count as open.
    async fn count_open(
        &self,
        spec: &CollectionConfig,
        closing: &mut BucketClosing,
    ) -> Result<(), Error> {
        let collection = self.store.collection(&spec.name);
        let filter = open_filter(None);
        let mut budget = RetryBudget::read_once("close.count_open");
        closing.open = self
            .store
            .with_retry(&mut budget, || collection.count_documents(filter.clone()))
            .await
            .map_err(Error::Server)?;
        let mut budget = RetryBudget::read_once("close.oldest_open");
        let oldest = self
            .store
            .with_retry(&mut budget, || {
                collection
                    .find_one(filter.clone())
                    .sort(doc! { CLOSED_FIELD: 1, format!("_id.{START}"): 1 })
                    .projection(doc! { "_id": 1 })
            })
            .await
            .map_err(Error::Server)?;
        closing.oldest_open = oldest
            .as_ref()
            .and_then(|d| d.get("_id"))
            .and_then(split_id)
            .map(|(_, start)| start);
        Ok(())
    }
}

/// Keeps those of `batch` whose exact value (`values`, in order) has
/// nothing unfolded; reports the others.
fn keep_folded(
    buckets: &Buckets,
    batch: Vec<Closable>,
    values: Vec<crate::ledger::ExactValue>,
    closing: &mut BucketClosing,
) -> Vec<Closable> {
    batch
        .into_iter()
        .zip(values)
        .filter_map(|(closable, value)| {
            if value.unfolded_events == 0 && value.unfolded == 0 {
                return Some(closable);
            }
            let what = match value.unfolded_events {
                0 => format!("a held sum of {:+} not applied yet", value.unfolded),
                1 => "1 recorded event not folded yet".to_owned(),
                n => format!("{n} recorded events not folded yet"),
            };
            closing.unclosed_id(buckets, &closable.id, format!("its ledger holds {what}"));
            None
        })
        .collect()
}

/// The statement closing `document`, or why it cannot be closed.
fn judge(
    spec: &CollectionConfig,
    buckets: &Buckets,
    document: &Document,
    now: SystemTime,
) -> Result<Closable, String> {
    let closed_at = DateTime::from_system_time(now);
    let id = document.get("_id").cloned().unwrap_or(Bson::Null);
    let Some((_, start)) = split_id(&id) else {
        return Err("its _id is not a bucket's {k, t}".to_owned());
    };
    if buckets.start_of(start).ok() != Some(start) {
        return Err(format!(
            "its _id.t is not the start of a {} bucket in {} (were the buckets reconfigured?)",
            buckets.width(),
            buckets.zone()
        ));
    }
    let (pending, settled, lanes) = (
        document.get(&spec.pending_field),
        document.get(&spec.settled_field),
        document.get(&spec.lanes_field),
    );
    // The model judges the document as the fold does: a malformed one is
    // never modified.
    // Everything closing removes must be older than the closing margin:
    // no write it answers for can still be re-sent. Under the collection's
    // own configuration every entry of a due bucket is (its writers refused
    // it from `close_after` on); a younger one was accepted under another
    // configuration (the width made finer, `close_after` lowered) or by a
    // clock far behind, and the bucket waits until it is old enough.
    let counter = document.get(&spec.counter_field);
    let old_enough = now
        .checked_sub(buckets.closing_margin())
        .map_or(ObjectId::from_bytes([0; 12]), Token::cutoff);
    let plan = model::plan(counter, pending, settled, old_enough)
        .map_err(|malformed| format!("malformed: {malformed}"))?;
    let lane_plan = plan_lanes(lanes, old_enough).map_err(|m| format!("malformed: {m}"))?;
    let young_lanes = lane_plan.entries as usize - lane_plan.expired.len() - lane_plan.named.len();
    if young_lanes > 0 || !plan.kept_markers.is_empty() {
        return Err(format!(
            "it holds {} written less than the closing margin ({}) ago, after the bucket stopped \
             taking writes — accepted under another configuration (a finer bucket width, a \
             lower close_after) or by a writer's clock far behind; it closes once {} older",
            if young_lanes > 0 {
                "a lane's entry"
            } else {
                "a settle marker"
            },
            humantime::format_duration(buckets.closing_margin()),
            if young_lanes > 0 {
                "every entry is"
            } else {
                "every marker is"
            },
        ));
    }
    match pending {
        Some(Bson::Array(entries)) if !entries.is_empty() => {
            return Err(format!(
                "it holds {} pending {} the fold has not taken (younger than the grace: a \
                 writer's clock behind the server's, or refused)",
                entries.len(),
                if entries.len() == 1 {
                    "entry"
                } else {
                    "entries"
                }
            ));
        }
        _ => {}
    }
    let mut filter = by_id("_id", &id);
    filter.insert(CLOSED_FIELD, Bson::Null);
    for (name, value) in [
        (&spec.pending_field, pending),
        (&spec.settled_field, settled),
        (&spec.lanes_field, lanes),
    ] {
        filter.insert(name.as_str(), as_read(value));
    }
    let mut set = doc! { CLOSED_FIELD: closed_at };
    let mut unset = doc! { &spec.pending_field: "", &spec.settled_field: "" };
    if lane_plan.named.is_empty() {
        unset.insert(spec.lanes_field.as_str(), "");
    } else {
        let kept: Document = lanes
            .and_then(Bson::as_document)
            .map(|map| {
                map.iter()
                    .filter(|(lane, _)| lane_plan.named.contains_key(*lane))
                    .map(|(lane, value)| (lane.clone(), value.clone()))
                    .collect()
            })
            .unwrap_or_default();
        set.insert(spec.lanes_field.as_str(), kept);
    }
    let body = doc! { "q": filter, "u": { "$set": set, "$unset": unset } };
    let bytes = body.to_vec().map_or(0, |b| b.len());
    Ok(Closable {
        id,
        statement: Statement { body, bytes },
    })
}

/// A filter's condition that a field is exactly as read: absent, an empty
/// array, or equal to the value.
fn as_read(value: Option<&Bson>) -> Bson {
    match value {
        None => Bson::Document(doc! { "$exists": false }),
        Some(Bson::Array(values)) if values.is_empty() => Bson::Document(doc! { "$size": 0 }),
        Some(value) => Bson::Document(doc! { "$eq": value.clone() }),
    }
}

impl BucketClosing {
    fn unclosed_one(&mut self, buckets: &Buckets, document: &Document, reason: String) {
        let id = document.get("_id").cloned().unwrap_or(Bson::Null);
        self.unclosed_id(buckets, &id, reason);
    }

    fn unclosed_id(&mut self, buckets: &Buckets, id: &Bson, reason: String) {
        self.unclosed += 1;
        if self.unclosed_sample.len() < UNCLOSED_SAMPLE {
            self.unclosed_sample.push(UnclosedBucket {
                id: display_id(id),
                bucket: describe(buckets, id),
                reason,
            });
        }
    }
}

/// A bucket's `_id` as people read it: `home in the day from
/// 2026-12-02T00:00:00+01:00` (the `_id` as extended JSON when it is not a
/// bucket's).
fn describe(buckets: &Buckets, id: &Bson) -> String {
    match split_id(id) {
        Some((key, start)) => format!(
            "{} in the {} from {}",
            match key {
                Bson::String(key) => crate::document::shown(key),
                other => display_id(other),
            },
            buckets.width(),
            buckets.show_time(start)
        ),
        None => display_id(id),
    }
}
