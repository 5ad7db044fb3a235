//! The fold: counting the tokens writers left behind (DESIGN §4).
//!
//! A writer that crashes or gives up between the two steps of an increment
//! leaves its token in the pending array. Once the token is older than the
//! collection's `grace` — so no writer can still be working on it — the fold
//! adds it to the counter and removes it, exactly once, on live documents,
//! however often and by however many daemons it runs.
//!
//! # How
//!
//! 1. **Report.** One aggregation pass selects the documents holding the
//!    pending field and projects the two fields tally owns. Each row is
//!    judged by [`model::plan`] — the fold's specification — into a plan
//!    (stale entries, their sum, the counter after the fold, the entries
//!    that stay) or a reason it is malformed. Rows are streamed: tally keeps
//!    totals and a small sample, never the documents.
//! 2. **Fold.** Each batch of planned documents is folded by one `update`
//!    command holding one compare-and-swap per document: filter on `_id`
//!    alone, and a one-stage pipeline that writes the planned counter and
//!    pending array only if both fields are still exactly what the report
//!    read. A document a writer touched in between (a step 1 or a step 2
//!    landed) is left alone by its swap, and the batch's swapped-out
//!    documents are then folded by [`pipeline::fold`], which judges each
//!    document as it is at that moment. Either way a step 2 that landed
//!    first has already removed its token, one that lands later finds it
//!    gone, and no step 1 is ever erased. Running the fold again finds
//!    nothing stale, so a retried, repeated or concurrent fold is exact.
//!    Only documents the model judged well-formed are ever swapped, and the
//!    pipeline leaves a malformed document alone, so malformed documents
//!    are never modified.
//!
//! **Why this shape** (measured on the test server, 100k documents, 10%
//! holding 1–3 stale tokens; BENCHMARKS.md): a set-based `updateMany` whose
//! pipeline finds stale entries and checks well-formedness itself costs the
//! server an expression evaluation per entry — 4× the bare floor there. The
//! per-document swap needs no per-entry evaluation on the server (tally's
//! model did it while reading), is exact per document, and keeps batches:
//! points where a run can stop for a shutdown and report progress.
//!
//! # Time
//!
//! The cutoff is computed by tally from the **server's** clock (`hello`'s
//! `localTime`) minus the grace, and passed as an ObjectId value — never
//! `$$NOW` — so every daemon agrees on it. A token's time comes from its
//! writer's clock. A writer whose clock lags the server's by `d` has its
//! tokens folded `d` early, so the fold stays exact as long as writers lag
//! the server by less than `grace − retry_horizon` (14 minutes with the
//! defaults); a writer ahead of the server only delays the fold.

pub mod model;
pub mod pipeline;
mod report;

use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::error::{Error as MongoError, ErrorKind, WriteError, WriteFailure};
use tokio_util::sync::CancellationToken;

use crate::document::{display_id, integer_value};
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::CollectionConfig;
use report::{ReportRow, account};

pub use report::{CollectionRun, MALFORMED_SAMPLE, MalformedDocument, Progress, Survey};

/// Default fold grace (the daemon's `[reconcile] grace`).
#[cfg(feature = "daemon")]
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(15 * 60);
/// Default fold batch size (the daemon's `[reconcile] batch_size`).
#[cfg(feature = "daemon")]
pub(crate) const DEFAULT_BATCH_SIZE: u32 = 100;

/// Everything the fold needs to know about one collection: its fields and
/// its effective grace and batch size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldTarget {
    /// The collection and its field names.
    pub spec: CollectionConfig,
    /// Tokens older than this are folded; younger ones belong to writers
    /// still between their two steps. Must exceed the writers' retry horizon
    /// by more than the clock skew between writers and the server. The
    /// daemon's default: 15m.
    pub grace: Duration,
    /// Documents per fold update: work between two points where a run can
    /// stop (shutdown) and report progress. The daemon's default: 100.
    pub batch_size: u32,
}

/// How many malformed documents a run logs one by one before summing up.
const MALFORMED_LOGGED: u64 = 100;
/// Rows the report's cursor fetches per round trip.
const REPORT_BATCH: u32 = 1000;

/// Whether a run changes anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Fold what is stale.
    Fold,
    /// Report exactly what a fold would do, and change nothing.
    DryRun,
}

/// Runs the report and the fold.
#[derive(Clone, Debug)]
pub struct Reconciler {
    store: Store,
}

impl Reconciler {
    /// A reconciler working through `store`.
    pub fn new(store: &Store) -> Self {
        Self {
            store: store.clone(),
        }
    }

    /// The server's clock (`hello`'s `localTime`): every daemon
    /// computes its cutoff from the same clock.
    pub async fn server_time(&self) -> Result<SystemTime, Error> {
        self.store.server_time().await
    }

    /// Surveys a collection's pending arrays with `cutoff` as the line
    /// between fresh and stale, changing nothing.
    pub async fn survey(&self, target: &FoldTarget, cutoff: SystemTime) -> Result<Survey, Error> {
        let mut survey = Survey::default();
        let cutoff = Token::cutoff(cutoff);
        let mut rows = self.report(target).await?;
        while let Some(row) = rows.try_next().await.map_err(report_failed)? {
            survey.add(&ReportRow::read(row, target, cutoff));
        }
        Ok(survey)
    }

    /// Reconciles one collection: folds every stale token of every
    /// well-formed document (or, in a dry run, reports what that would do).
    /// `now` is the server time the cutoff is computed from. Stops between
    /// batches when `stop` is cancelled. Never fails as a whole: what
    /// happened, error included, is in the returned run.
    pub async fn reconcile(
        &self,
        target: &FoldTarget,
        mode: Mode,
        now: SystemTime,
        stop: &CancellationToken,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> CollectionRun {
        let started = Instant::now();
        let cutoff_time = now
            .checked_sub(target.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut run = CollectionRun::new(&target.spec.name, mode, cutoff_time);
        if let Err(err) = self.fold_all(target, mode, stop, progress, &mut run).await {
            tracing::error!(
                collection = %target.spec.name,
                cause = %err,
                folded = run.documents_folded,
                "reconcile failed"
            );
            run.error = Some(err);
        }
        run.oldest_stale_age_seconds = run
            .survey
            .oldest_pending
            .filter(|t| t.object_id() < Token::cutoff(cutoff_time))
            .map(|t| t.age(now).as_secs());
        run.duration = started.elapsed();
        run
    }

    async fn fold_all(
        &self,
        target: &FoldTarget,
        mode: Mode,
        stop: &CancellationToken,
        progress: &mut (dyn FnMut(Progress) + Send),
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        let name = &target.spec.name;
        let cutoff = Token::cutoff(run.cutoff);
        let fold = pipeline::fold(&target.spec, cutoff);
        let mut rows = self.report(target).await?;
        let mut batch: Vec<ReportRow> = Vec::with_capacity(target.batch_size as usize);
        loop {
            let row = rows.try_next().await.map_err(report_failed)?;
            let finished = row.is_none();
            if let Some(row) = row {
                let row = ReportRow::read(row, target, cutoff);
                run.survey.add(&row);
                match &row.plan {
                    Err(reason) => log_malformed(name, &row.id, reason, run.survey.malformed),
                    Ok(plan) if plan.stale_tokens > 0 => batch.push(row),
                    Ok(_) => {}
                }
            }
            let full = batch.len() >= target.batch_size as usize;
            if (full || finished) && !batch.is_empty() {
                if stop.is_cancelled() {
                    run.interrupted = true;
                    tracing::warn!(collection = %name, folded = run.documents_folded, "reconcile stopped by shutdown");
                    return Ok(());
                }
                match mode {
                    Mode::Fold => self.fold_batch(target, &fold, &batch, run).await?,
                    Mode::DryRun => {
                        run.documents_folded += batch.len() as u64;
                        account(run, &batch);
                    }
                }
                batch.clear();
                progress(Progress {
                    examined: run.survey.documents_scanned,
                    folded: run.documents_folded,
                });
            }
            if finished {
                if run.survey.malformed > MALFORMED_LOGGED {
                    tracing::warn!(
                        collection = %name,
                        malformed = run.survey.malformed,
                        "more malformed documents than logged one by one; all left unchanged"
                    );
                }
                return Ok(());
            }
        }
    }

    /// Folds the stale tokens of the documents `ids` now (tokens older than
    /// `now − grace`), whatever a report said about them before: each
    /// document is judged as it is when the update reaches it. Returns how
    /// many documents changed. Used by the daemon to repair stuck tokens at
    /// once.
    pub async fn fold_documents(
        &self,
        target: &FoldTarget,
        ids: Vec<Bson>,
        now: SystemTime,
    ) -> Result<u64, Error> {
        let cutoff = now
            .checked_sub(target.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let fold = pipeline::fold(&target.spec, Token::cutoff(cutoff));
        self.update_batch(target, &fold, ids).await
    }

    /// The pipeline fold of a batch of documents, in one update. Retried
    /// once on a transient failure: a fold applied twice folds nothing the
    /// second time.
    async fn update_batch(
        &self,
        target: &FoldTarget,
        fold: &[Document],
        ids: Vec<Bson>,
    ) -> Result<u64, Error> {
        let collection = self.store.collection(&target.spec.name);
        let filter = doc! { "_id": { "$in": ids } };
        let mut budget = RetryBudget::retry_once("reconcile.fold", false);
        let result = self
            .store
            .with_retry(&mut budget, || {
                collection.update_many(filter.clone(), fold.to_vec())
            })
            .await
            .map_err(Error::Server)?;
        Ok(result.modified_count)
    }

    /// Folds one batch of report rows and accounts for it: one
    /// compare-and-swap per document, then the pipeline for the documents
    /// whose swap found them changed.
    async fn fold_batch(
        &self,
        target: &FoldTarget,
        fold: &[Document],
        batch: &[ReportRow],
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        let swaps: Vec<Bson> = batch
            .iter()
            .filter_map(|row| row.stale().map(|plan| compare_and_swap(target, row, plan)))
            .map(Bson::Document)
            .collect();
        let mut command = doc! {
            "update": &target.spec.name,
            "updates": swaps,
            "ordered": false,
        };
        if let Some(concern) = self.store.database().write_concern() {
            let concern = mongodb::bson::serialize_to_document(concern).map_err(|err| {
                Error::InvalidArgument(format!("cannot encode the write concern: {err}"))
            })?;
            command.insert("writeConcern", concern);
        }
        // Re-sending the swaps is safe: a swap that applied no longer
        // matches what it compares against.
        let sent = Instant::now();
        let mut budget = RetryBudget::retry_once("reconcile.fold", false);
        let reply = self
            .store
            .with_retry(&mut budget, || {
                self.store.database().run_command(command.clone())
            })
            .await
            .map_err(Error::Server)?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            // Classified like any server error (by the first one's code), so
            // the run's failure says whether it is worth running again.
            let first = errors
                .first()
                .and_then(Bson::as_document)
                .cloned()
                .unwrap_or_default();
            tracing::error!(
                collection = %target.spec.name,
                refused = errors.len(),
                of = batch.len(),
                first = %first,
                "fold updates refused by the server"
            );
            let code = first.get("code").and_then(integer_value).unwrap_or(0);
            let message = first.get_str("errmsg").unwrap_or("(no message)");
            let error: WriteError = mongodb::bson::deserialize_from_document(
                doc! { "code": i32::try_from(code).unwrap_or(0), "errmsg": message },
            )
            .map_err(|err| {
                Error::InvalidArgument(format!("cannot read a fold write error: {err}"))
            })?;
            let source = MongoError::from(ErrorKind::Write(WriteFailure::WriteError(error)));
            return Err(Error::Server(Failure::once("reconcile.fold", source)));
        }
        let swapped = reply
            .get("nModified")
            .and_then(integer_value)
            .unwrap_or(0)
            .max(0) as u64;
        let mut folded = swapped;
        if swapped < batch.len() as u64 {
            // Writers touched some documents since the report: fold those
            // as they are now (the pipeline leaves the swapped ones alone,
            // having nothing stale left).
            let ids = batch.iter().map(|r| r.id.clone()).collect();
            folded += self.update_batch(target, fold, ids).await?;
        }
        tracing::debug!(
            collection = %target.spec.name,
            documents = batch.len(),
            swapped,
            folded,
            millis = sent.elapsed().as_millis() as u64,
            "fold batch"
        );
        run.documents_folded += folded;
        run.concurrent_changes += (batch.len() as u64).saturating_sub(folded);
        account(run, batch);
        Ok(())
    }

    /// The report's pass: the documents holding the pending field, with the
    /// two fields tally owns (an index on the pending field can serve the
    /// `$exists` match when it is sparse).
    pub(crate) async fn report(
        &self,
        target: &FoldTarget,
    ) -> Result<mongodb::Cursor<Document>, Error> {
        let spec = &target.spec;
        let collection = self.store.collection(&spec.name);
        let pipeline = vec![
            doc! { "$match": { &spec.pending_field: { "$exists": true } } },
            doc! { "$project": { &spec.counter_field: 1, &spec.pending_field: 1 } },
        ];
        let mut budget = RetryBudget::retry_once("reconcile.report", false);
        self.store
            .with_retry(&mut budget, || {
                collection
                    .aggregate(pipeline.clone())
                    .batch_size(REPORT_BATCH)
            })
            .await
            .map_err(Error::Server)
    }
}

/// One document's fold as a compare-and-swap statement: `_id` alone in the
/// filter (the cheapest lookup a server has), and a pipeline that writes the
/// planned fields only when both are still exactly as read.
fn compare_and_swap(target: &FoldTarget, row: &ReportRow, plan: &model::FoldPlan) -> Document {
    let spec = &target.spec;
    let counter = format!("${}", spec.counter_field);
    let pending = format!("${}", spec.pending_field);
    let counter_unchanged = match &row.counter {
        None => doc! { "$eq": [{ "$type": counter.as_str() }, "missing"] },
        Some(value) => doc! { "$eq": [counter.as_str(), { "$literal": value }] },
    };
    let unchanged = doc! {
        "$and": [
            counter_unchanged,
            { "$eq": [pending.as_str(), { "$literal": row.pending.clone().unwrap_or(Bson::Null) }] },
        ]
    };
    let kept = if plan.keep.is_empty() {
        Bson::String("$$REMOVE".into())
    } else {
        Bson::Document(doc! { "$literal": plan.keep.clone() })
    };
    doc! {
        "q": { "_id": &row.id },
        "u": [{ "$set": {
            &spec.counter_field: { "$cond": [unchanged.clone(), { "$literal": &plan.counter }, counter.as_str()] },
            &spec.pending_field: { "$cond": [unchanged, kept, pending.as_str()] },
        }}],
    }
}

/// A report cursor that broke off mid-stream cannot be resumed where it
/// stopped: the run fails, and is retried as a whole later (the fold is
/// idempotent).
fn report_failed(err: mongodb::error::Error) -> Error {
    Error::Server(Failure::once("reconcile.report", err))
}

fn log_malformed(collection: &str, id: &Bson, reason: &model::Malformed, seen: u64) {
    if seen <= MALFORMED_LOGGED {
        tracing::warn!(collection, id = %display_id(id), reason = %reason, "malformed document left unchanged");
    }
}
