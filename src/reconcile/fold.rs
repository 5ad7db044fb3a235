//! The fold's passes over a collection: the report's rows planned into
//! batches of work, each batch sent and accounted for, the documents that
//! changed under a batch read again and planned afresh (see the module
//! docs of [`super`]).

use std::collections::HashMap;
use std::time::Instant;

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use tokio_util::sync::CancellationToken;

use super::model::{self, Lines};
use super::report::{CollectionRun, Progress, ReportRow};
use super::statement::{self, Read, Statement};
use super::{FoldTarget, Mode, Reconciler, batch};
use crate::document::display_id;
use crate::error::{Error, Failure, RetryBudget};
use crate::write::counter::CollectionConfig;

/// How many malformed documents a run logs one by one before summing up.
const MALFORMED_LOGGED: u64 = 100;
/// Rows the report's cursor fetches per round trip.
const REPORT_BATCH: u32 = 1000;

impl Reconciler {
    pub(super) async fn fold_all(
        &self,
        target: &FoldTarget,
        mode: Mode,
        lines: &Lines,
        stop: &CancellationToken,
        progress: &mut (dyn FnMut(Progress) + Send),
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        let name = &target.spec.name;
        let mut rows = self.report(target).await?;
        let mut batch = Batch::default();
        loop {
            let row = rows.try_next().await.map_err(report_failed)?;
            let finished = row.is_none();
            let work = row.and_then(|row| plan_row(target, &row, lines, mode, run));
            let full = work
                .as_ref()
                .is_some_and(|w| batch.is_full(w, target.batch_size));
            if (full || finished) && !batch.is_empty() {
                if stop.is_cancelled() {
                    run.interrupted = true;
                    tracing::warn!(collection = %name, folded = run.documents_folded, "reconcile stopped by shutdown");
                    return Ok(());
                }
                let documents = std::mem::take(&mut batch).documents;
                match mode {
                    Mode::Fold => self.fold_batch(target, lines, documents, run).await?,
                    Mode::DryRun => {
                        run.documents_folded += documents.len() as u64;
                        run.account(documents.iter().map(|w| &w.plan));
                    }
                }
                progress(Progress {
                    examined: run.survey.documents_scanned,
                    folded: run.documents_folded,
                });
            }
            if let Some(work) = work {
                batch.push(work);
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

    /// Folds one batch of planned documents and accounts for it. A document
    /// the server refuses is reported and dropped from the batch; when
    /// fewer statements applied than were sent, the documents are read
    /// again, and those still holding work are planned and sent again, up to
    /// [`FOLD_ROUNDS`] times.
    pub(super) async fn fold_batch(
        &self,
        target: &FoldTarget,
        lines: &Lines,
        mut documents: Vec<Work>,
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        let name = &target.spec.name;
        for round in 1..=FOLD_ROUNDS {
            if documents.is_empty() {
                return Ok(());
            }
            let sent = Instant::now();
            let statements: Vec<(usize, &Statement)> = documents
                .iter()
                .enumerate()
                .flat_map(|(i, w)| w.statements.iter().map(move |s| (i, s)))
                .collect();
            let outcome = batch::send(&self.store, name, &statements).await?;
            let mut refused = vec![false; documents.len()];
            for refusal in &outcome.refused {
                if !std::mem::replace(&mut refused[refusal.document], true) {
                    let id = &documents[refusal.document].id;
                    if run.refused < MALFORMED_LOGGED {
                        tracing::warn!(
                            collection = %name,
                            id = %display_id(id),
                            code = refusal.code,
                            reason = %refusal.message,
                            "the server refused to fold a document; left unchanged"
                        );
                    }
                    run.add_refused(id, refusal.code, refusal.message.clone());
                }
            }
            let expected = statements.len() - outcome.refused.len();
            tracing::debug!(
                collection = %name,
                round,
                documents = documents.len(),
                statements = statements.len(),
                modified = outcome.modified,
                refused = outcome.refused.len(),
                millis = sent.elapsed().as_millis() as u64,
                "fold batch"
            );
            let remaining: Vec<Work> = documents
                .into_iter()
                .zip(refused)
                .filter_map(|(w, refused)| (!refused).then_some(w))
                .collect();
            if outcome.modified >= expected as u64 {
                run.documents_folded += remaining.len() as u64;
                run.account(remaining.iter().map(|w| &w.plan));
                return Ok(());
            }
            // Some documents changed since they were read in a way the
            // statements refuse: see what they hold now.
            let ids = remaining.iter().map(|w| w.id.clone()).collect();
            let mut now: HashMap<String, Document> = self
                .read_documents(target, ids)
                .await?
                .into_iter()
                .map(|d| (d.get("_id").unwrap_or(&Bson::Null).to_string(), d))
                .collect();
            let mut done = Vec::new();
            documents = Vec::new();
            for work in remaining {
                let Some(document) = now.remove(&work.id.to_string()) else {
                    run.concurrent_changes += 1;
                    continue;
                };
                let read = Read::of(&document, &target.spec);
                match read.plan(lines) {
                    Ok(plan) if plan.has_work() => {
                        documents.push(Work::new(target, &read, plan, Mode::Fold));
                    }
                    Ok(_) => done.push(work),
                    Err(reason) => {
                        log_malformed(name, read.id, &reason, 0);
                        run.concurrent_changes += 1;
                    }
                }
            }
            let ours = outcome.modified.min(done.len() as u64);
            run.documents_folded += ours;
            run.concurrent_changes += done.len() as u64 - ours;
            run.account(done.iter().map(|w| &w.plan));
        }
        if !documents.is_empty() {
            tracing::info!(
                collection = %name,
                documents = documents.len(),
                "documents kept changing under the fold; the next run folds them"
            );
            run.concurrent_changes += documents.len() as u64;
        }
        Ok(())
    }

    /// The documents `ids`, with the four fields tally owns, as they are
    /// now.
    pub(super) async fn read_documents(
        &self,
        target: &FoldTarget,
        ids: Vec<Bson>,
    ) -> Result<Vec<Document>, Error> {
        let spec = &target.spec;
        let collection = self.store.collection(&spec.name);
        let filter = crate::write::at::by_any("_id", &ids);
        let mut budget = RetryBudget::retry_once("reconcile.read");
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                collection.find(filter.clone()).projection(projection(spec))
            })
            .await
            .map_err(Error::Server)?;
        cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once("reconcile.read", err)))
    }

    /// The report's pass: the documents holding the pending, the settled or
    /// the lanes field, with the four fields tally owns. A sparse index on
    /// each of the three fields can serve the `$exists` matches.
    pub(crate) async fn report(
        &self,
        target: &FoldTarget,
    ) -> Result<mongodb::Cursor<Document>, Error> {
        let spec = &target.spec;
        let collection = self.store.collection(&spec.name);
        let pipeline = vec![
            doc! { "$match": { "$or": [
                { &spec.pending_field: { "$exists": true } },
                { &spec.settled_field: { "$exists": true } },
                { &spec.lanes_field: { "$exists": true } },
            ] } },
            doc! { "$project": projection(spec) },
        ];
        let mut budget = RetryBudget::retry_once("reconcile.report");
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

/// Reads one report row into the run's survey; the document's work when
/// it has any. A malformed document is logged.
fn plan_row(
    target: &FoldTarget,
    row: &Document,
    lines: &Lines,
    mode: Mode,
    run: &mut CollectionRun,
) -> Option<Work> {
    let read = Read::of(row, &target.spec);
    let report = ReportRow::of(&read, lines);
    run.survey.add(&report);
    match report.plan {
        Err(reason) => {
            log_malformed(&target.spec.name, read.id, &reason, run.survey.malformed);
            None
        }
        Ok(plan) if plan.has_work() => Some(Work::new(target, &read, plan, mode)),
        Ok(_) => None,
    }
}

/// How many times a batch is sent (and its documents read again in
/// between) before what keeps changing is left to the next run.
const FOLD_ROUNDS: u32 = 3;

/// One document the fold has work on: its plan, and the statements that
/// carry it out (none in a dry run).
pub(super) struct Work {
    id: Bson,
    plan: model::FoldPlan,
    statements: Vec<Statement>,
    bytes: usize,
}

impl Work {
    pub(super) fn new(
        target: &FoldTarget,
        read: &Read<'_>,
        plan: model::FoldPlan,
        mode: Mode,
    ) -> Self {
        let statements = match mode {
            Mode::Fold => statement::build(&target.spec, read, &plan),
            Mode::DryRun => Vec::new(),
        };
        Self {
            id: read.id.clone(),
            bytes: statements.iter().map(|s| s.bytes).sum(),
            plan,
            statements,
        }
    }
}

/// The documents of the next batch: at most `batch_size` of them, and no
/// more statement bytes than one command carries (unless one document
/// alone needs more).
#[derive(Default)]
struct Batch {
    documents: Vec<Work>,
    bytes: usize,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.documents.is_empty()
    }

    /// Whether `next` must wait for the next batch.
    fn is_full(&self, next: &Work, batch_size: u32) -> bool {
        self.documents.len() >= batch_size as usize
            || (!self.is_empty() && self.bytes + next.bytes > batch::COMMAND_BYTES)
    }

    fn push(&mut self, work: Work) {
        self.bytes += work.bytes;
        self.documents.push(work);
    }
}

/// The four fields tally owns.
fn projection(spec: &CollectionConfig) -> Document {
    doc! {
        &spec.counter_field: 1,
        &spec.pending_field: 1,
        &spec.settled_field: 1,
        &spec.lanes_field: 1,
    }
}

/// A report cursor that broke off mid-stream cannot be resumed where it
/// stopped: the run fails, and is retried as a whole later (the fold is
/// idempotent).
pub(super) fn report_failed(err: mongodb::error::Error) -> Error {
    Error::Server(Failure::once("reconcile.report", err))
}

pub(super) fn log_malformed(collection: &str, id: &Bson, reason: &model::Malformed, seen: u64) {
    if seen <= MALFORMED_LOGGED {
        tracing::warn!(collection, id = %display_id(id), reason = %reason, "malformed document left unchanged");
    }
}
