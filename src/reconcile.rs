//! The fold: counting the tokens writers left behind (DESIGN §4).
//!
//! A writer that crashes or gives up between the two steps of an increment
//! leaves its token in the pending array. Once the token is older than the
//! collection's `grace` — so no writer can still be working on it — the fold
//! adds it to the counter and removes it, exactly once, on live documents,
//! however often and by however many daemons it runs. It also prunes the
//! markers settles leave (`settled`) once they are older than the grace,
//! the entries of minted writer lanes not written for `lane_ttl` (named
//! lanes stay — the ledgers' fold lanes among them), and removes fields
//! left empty. The collection's ledger, when it has one, is folded beside
//! it ([`ledger`]).
//!
//! # How
//!
//! 1. **Report.** One aggregation pass selects the documents holding the
//!    pending, the settled or the lanes field — no other document is read,
//!    so the reads grow with the documents holding tokens or lanes, not
//!    with the collection — and projects the four fields tally owns. Each row is judged by
//!    [`model::plan`] — the fold's specification — into a plan or a reason
//!    it is malformed. Rows are streamed: tally keeps totals, a small
//!    sample and one batch of plans, never the collection.
//! 2. **Fold.** Each planned document becomes an update statement
//!    conditioned on exactly what it removes ([`statement`]); a batch of
//!    them goes to the server in one unordered `update` command (several,
//!    when large arrays make the batch bigger than a command may be). A
//!    statement applies only while the document still holds its stale
//!    entries, so a concurrent step 1 is kept, a concurrent step 2 is never
//!    overwritten, and a second or concurrent fold finds nothing. When a
//!    batch applied fewer statements than it sent, its documents are read
//!    again and re-planned, up to three times; what still changes under the
//!    fold's feet is left to the next run.
//! 3. **Refusals.** A statement the server refuses for a reason of its
//!    document's (a validator, a document grown too large) leaves that
//!    document unchanged; it is logged with its `_id` and reported
//!    ([`CollectionRun::refused`]), and everything else is folded. Only a
//!    failure of the whole command — after its one retry when transient,
//!    a write-concern error included — fails the run.
//!
//! Malformed documents are never modified: the model refuses them before
//! any statement is built.
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
//!
//! A minted lane's entry holds its writer's time of writing (a count: its
//! lane id's), and is pruned once older than the server's time − `lane_ttl`;
//! writers stop sending an update at `lane_resume_horizon`, so pruning is
//! exact as long as writers lag the server by less than `lane_ttl −
//! lane_resume_horizon − attempt_timeout`.

mod batch;
mod ledger;
pub(crate) mod model;
mod report;
mod statement;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use tokio_util::sync::CancellationToken;

use crate::document::display_id;
use crate::error::{Error, Failure, RetryBudget};
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::{CollectionConfig, WriterConfig};
use model::{Cutoffs, Lines};
use report::ReportRow;
use statement::{Read, Statement};

pub use ledger::{
    Backlog, EventFold, EventFoldSettings, EventsRun, HeldSum, RETENTION_MARGIN, retention_floor,
};
pub use report::{
    CollectionRun, MALFORMED_SAMPLE, MalformedDocument, NAMED_LANES_LISTED, Progress,
    RefusedDocument, Survey,
};

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
    /// plus one attempt by more than the clock skew between writers and the
    /// server (`grace − retry_horizon − attempt_timeout` is the skew
    /// tolerated: 11 minutes with the defaults). The daemon's default: 15m.
    pub grace: Duration,
    /// Documents per fold batch: work between two points where a run can
    /// stop (shutdown) and report progress. A batch is one `update` command,
    /// or several when its statements pass 8 MiB. The daemon's default: 100.
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
    /// The folds of the collections' ledgers, kept from run to run.
    ledgers: ledger::Folds,
    lane_ttl: Duration,
}

impl Reconciler {
    /// A reconciler working through `store`, pruning minted lanes older
    /// than the default `lane_ttl` (24h; see [`Reconciler::with_lane_ttl`]).
    pub fn new(store: &Store) -> Self {
        Self {
            store: store.clone(),
            ledgers: ledger::Folds::new(EventFoldSettings::default()),
            lane_ttl: WriterConfig::default().lane_ttl,
        }
    }

    /// The same reconciler folding the collections' ledgers with
    /// `settings`.
    pub fn with_event_settings(mut self, settings: EventFoldSettings) -> Self {
        self.ledgers = ledger::Folds::new(settings);
        self
    }

    /// The same reconciler pruning the entries of minted lanes older than
    /// `lane_ttl` — the writers' [`WriterConfig::lane_ttl`], which their
    /// resume horizon is checked against.
    pub fn with_lane_ttl(mut self, lane_ttl: Duration) -> Self {
        self.lane_ttl = lane_ttl;
        self
    }

    /// The lines the fold of `target` draws at server time `now`, and the
    /// grace's line as a time.
    fn cutoffs(&self, target: &FoldTarget, now: SystemTime) -> (Cutoffs, SystemTime) {
        let tokens = now
            .checked_sub(target.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let lanes = now
            .checked_sub(self.lane_ttl)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let cutoffs = Cutoffs {
            tokens: Token::cutoff(tokens),
            lanes: Token::cutoff(lanes),
        };
        (cutoffs, tokens)
    }

    /// The server's clock (`hello`'s `localTime`): every daemon
    /// computes its cutoff from the same clock.
    pub async fn server_time(&self) -> Result<SystemTime, Error> {
        self.store.server_time().await
    }

    /// Surveys a collection's pending arrays and lane maps with `cutoff`
    /// as the line between fresh and stale tokens, changing nothing. No
    /// lane counts as expired here (a run reports those).
    pub async fn survey(&self, target: &FoldTarget, cutoff: SystemTime) -> Result<Survey, Error> {
        let mut survey = Survey::default();
        let lines = Lines::from(no_lane_expires(Token::cutoff(cutoff)));
        let mut rows = self.report(target).await?;
        while let Some(row) = rows.try_next().await.map_err(report_failed)? {
            let read = Read::of(&row, &target.spec);
            survey.add(&ReportRow::of(&read, &lines));
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
        let (cutoffs, cutoff_time) = self.cutoffs(target, now);
        let mut run = CollectionRun::new(&target.spec.name, mode, cutoff_time);
        // The ledger and the tokens are independent: a ledger that cannot
        // fold (missing indexes, the server refusing its state) never stops
        // the token fold or the pruning, and the reverse. Both errors are
        // logged; the run reports the first.
        let folded = self.fold_ledger(target, mode, now, stop, &mut run).await;
        let ledger_error = folded.err().inspect(|err| {
            tracing::error!(collection = %target.spec.name, cause = %err, "folding the ledger failed");
        });
        let lines = Lines::from(cutoffs);
        let folded = self.fold_all(target, mode, &lines, stop, progress, &mut run);
        if let Err(err) = folded.await {
            tracing::error!(
                collection = %target.spec.name,
                cause = %err,
                folded = run.documents_folded,
                "reconcile failed"
            );
            run.error = Some(err);
        }
        if let Some(err) = ledger_error {
            run.error.get_or_insert(err);
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

    /// Folds the documents `ids` now (tokens older than `now − grace`,
    /// lanes older than `now − lane_ttl`), whatever a report said about
    /// them before: each is read and planned afresh, then folded as a run
    /// folds. Returns how many documents changed. Used by the daemon to
    /// repair stuck tokens at once.
    pub async fn fold_documents(
        &self,
        target: &FoldTarget,
        ids: Vec<Bson>,
        now: SystemTime,
    ) -> Result<u64, Error> {
        let (cutoffs, cutoff_time) = self.cutoffs(target, now);
        let lines = Lines::from(cutoffs);
        let mut run = CollectionRun::new(&target.spec.name, Mode::Fold, cutoff_time);
        let mut documents = Vec::new();
        for document in self.read_documents(target, ids).await? {
            let read = Read::of(&document, &target.spec);
            match read.plan(&lines) {
                Ok(plan) if plan.has_work() => {
                    documents.push(Work::new(target, &read, plan, Mode::Fold));
                }
                Ok(_) => {}
                Err(reason) => log_malformed(&target.spec.name, read.id, &reason, 0),
            }
        }
        self.fold_batch(target, &lines, documents, &mut run).await?;
        Ok(run.documents_folded)
    }

    /// Folds one batch of planned documents and accounts for it. A document
    /// the server refuses is reported and dropped from the batch; when
    /// fewer statements applied than were sent, the documents are read
    /// again, and those still holding work are planned and sent again, up to
    /// [`FOLD_ROUNDS`] times.
    async fn fold_batch(
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
    async fn read_documents(
        &self,
        target: &FoldTarget,
        ids: Vec<Bson>,
    ) -> Result<Vec<Document>, Error> {
        let spec = &target.spec;
        let collection = self.store.collection(&spec.name);
        let filter = doc! { "_id": { "$in": ids } };
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

/// Cutoffs at which no lane expires, tokens at `tokens`.
fn no_lane_expires(tokens: mongodb::bson::oid::ObjectId) -> Cutoffs {
    let lanes = Token::cutoff(SystemTime::UNIX_EPOCH);
    Cutoffs { tokens, lanes }
}

/// How many times a batch is sent (and its documents read again in
/// between) before what keeps changing is left to the next run.
const FOLD_ROUNDS: u32 = 3;

/// One document the fold has work on: its plan, and the statements that
/// carry it out (none in a dry run).
struct Work {
    id: Bson,
    plan: model::FoldPlan,
    statements: Vec<Statement>,
    bytes: usize,
}

impl Work {
    fn new(target: &FoldTarget, read: &Read<'_>, plan: model::FoldPlan, mode: Mode) -> Self {
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
fn report_failed(err: mongodb::error::Error) -> Error {
    Error::Server(Failure::once("reconcile.report", err))
}

fn log_malformed(collection: &str, id: &Bson, reason: &model::Malformed, seen: u64) {
    if seen <= MALFORMED_LOGGED {
        tracing::warn!(collection, id = %display_id(id), reason = %reason, "malformed document left unchanged");
    }
}

#[cfg(test)]
mod tests;
