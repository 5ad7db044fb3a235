//! The fold: counting the tokens writers left behind (the book: design/fold.md).
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
//! it ([`ledgers`]; the fold itself is the ledger's: `ledger::fold`).
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
//! the server by less than `grace − retry_horizon − attempt_timeout` (11
//! minutes with the defaults); a writer ahead of the server only delays
//! the fold.
//!
//! A minted lane's entry holds its writer's time of writing (a count: its
//! lane id's), and is pruned once older than the server's time − `lane_ttl`;
//! writers stop sending an update at `lane_resume_horizon`, so pruning is
//! exact as long as writers lag the server by less than `lane_ttl −
//! lane_resume_horizon − attempt_timeout`.

mod batch;
mod close;
mod fold;
mod ledgers;
pub(crate) mod model;
mod report;
mod statement;

use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::Bson;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::ledger::EventFoldSettings;
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::{CollectionConfig, WriterConfig};
use fold::{Work, log_malformed, report_failed};
use model::{Cutoffs, Lines};
use report::ReportRow;
use statement::Read;

pub use close::{OpenBuckets, UNCLOSED_SAMPLE};
pub use report::{
    BucketClosing, CollectionRun, MALFORMED_SAMPLE, MalformedDocument, NAMED_LANES_LISTED,
    Progress, RefusedDocument, Survey, UnclosedBucket,
};

/// Default fold grace (the daemon's `[reconcile] grace`).
#[cfg(feature = "daemon")]
pub(crate) const DEFAULT_GRACE: Duration = Duration::from_secs(15 * 60);
/// Default fold batch size (the daemon's `[reconcile] batch_size`).
#[cfg(feature = "daemon")]
pub(crate) const DEFAULT_BATCH_SIZE: u32 = 100;

/// Everything the fold needs to know about one collection: its fields and
/// its effective grace and batch size.
///
/// ```
/// use std::time::Duration;
/// use tally::{CollectionConfig, FoldTarget};
///
/// let target = FoldTarget {
///     spec: CollectionConfig::new("page_views"),
///     grace: Duration::from_secs(15 * 60),
///     batch_size: 100,
/// };
/// ```
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

/// Whether a run changes anything.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
/// use tally::Mode;
///
/// // What a fold would do, changing nothing: check before the first real run.
/// let now = fold.server_time().await?;
/// let stop = CancellationToken::new();
/// let preview = fold.reconcile(&target, Mode::DryRun, now, &stop, &mut |_| {}).await;
/// assert!(preview.dry_run);
/// let (tokens, documents) = (preview.tokens_folded, preview.documents_folded);
/// println!("would fold {tokens} tokens in {documents} documents");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Fold what is stale.
    Fold,
    /// Report exactly what a fold would do, and change nothing.
    DryRun,
}

/// Runs the report and the fold.
///
/// ```no_run
/// # async fn demo(store: tally::Store) {
/// use std::time::Duration;
/// use tokio_util::sync::CancellationToken;
/// use tally::{CollectionConfig, FoldTarget, Mode, Reconciler};
///
/// // A service folding its own collection every ten minutes, instead of tallyd.
/// let fold = Reconciler::new(&store);
/// let target = FoldTarget {
///     spec: CollectionConfig::new("page_views"),
///     grace: Duration::from_secs(15 * 60),
///     batch_size: 100,
/// };
/// let stop = CancellationToken::new();
/// while !stop.is_cancelled() {
///     match fold.server_time().await {
///         Ok(now) => {
///             let run = fold.reconcile(&target, Mode::Fold, now, &stop, &mut |_| {}).await;
///             if let Some(err) = &run.error {
///                 tracing::error!(cause = %err, "fold failed");
///             }
///         }
///         Err(err) => tracing::error!(cause = %err, "no server time"),
///     }
///     tokio::time::sleep(Duration::from_secs(600)).await;
/// }
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Reconciler {
    store: Store,
    /// The folds of the collections' ledgers, kept from run to run.
    ledgers: ledgers::Folds,
    lane_ttl: Duration,
}

impl Reconciler {
    /// A reconciler working through `store`, pruning minted lanes older
    /// than the default `lane_ttl` (24h; see [`Reconciler::with_lane_ttl`]).
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// let fold = tally::Reconciler::new(&store);
    /// # }
    /// ```
    pub fn new(store: &Store) -> Self {
        Self {
            store: store.clone(),
            ledgers: ledgers::Folds::new(EventFoldSettings::default()),
            lane_ttl: WriterConfig::default().lane_ttl,
        }
    }

    /// The same reconciler folding the collections' ledgers with
    /// `settings`.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use std::time::Duration;
    /// use tally::{EventFoldSettings, Reconciler};
    ///
    /// let settings = EventFoldSettings {
    ///     event_retention: Duration::from_secs(3 * 24 * 3600),
    ///     ..EventFoldSettings::default()
    /// };
    /// let fold = Reconciler::new(&store).with_event_settings(settings);
    /// # }
    /// ```
    pub fn with_event_settings(mut self, settings: EventFoldSettings) -> Self {
        self.ledgers = ledgers::Folds::new(settings);
        self
    }

    /// The same reconciler pruning the entries of minted lanes older than
    /// `lane_ttl` — the writers' [`WriterConfig::lane_ttl`], which their
    /// resume horizon is checked against.
    ///
    /// ```no_run
    /// # fn demo(store: tally::Store) {
    /// use tally::{Reconciler, WriterConfig};
    ///
    /// // The same lane_ttl the writers' resume horizon was checked against.
    /// let writer = WriterConfig::default();
    /// let fold = Reconciler::new(&store).with_lane_ttl(writer.lane_ttl);
    /// # }
    /// ```
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
    ///
    /// ```no_run
    /// # async fn demo(fold: tally::Reconciler) -> Result<(), tally::Error> {
    /// use std::time::SystemTime;
    ///
    /// let now = fold.server_time().await?;
    /// match SystemTime::now().duration_since(now) {
    ///     Ok(ahead) => println!("this host is {} ahead", humantime::format_duration(ahead)),
    ///     Err(behind) => {
    ///         println!("this host is {} behind", humantime::format_duration(behind.duration()))
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn server_time(&self) -> Result<SystemTime, Error> {
        self.store.server_time().await
    }

    /// Surveys a collection's pending arrays and lane maps with `cutoff`
    /// as the line between fresh and stale tokens, changing nothing. No
    /// lane counts as expired here (a run reports those).
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::Reconciler,
    /// #     target: tally::FoldTarget,
    /// # ) -> Result<(), tally::Error> {
    /// let now = fold.server_time().await?;
    /// let survey = fold.survey(&target, now - target.grace).await?;
    /// println!(
    ///     "{} pending tokens, {} stale (+{}), {} malformed documents",
    ///     survey.pending_tokens, survey.stale_tokens, survey.stale_amount, survey.malformed
    /// );
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::Reconciler,
    /// #     target: tally::FoldTarget,
    /// # ) -> Result<(), tally::Error> {
    /// use tokio_util::sync::CancellationToken;
    /// use tally::Mode;
    ///
    /// let stop = CancellationToken::new(); // cancel it to stop between batches
    /// let now = fold.server_time().await?;
    /// let run = fold
    ///     .reconcile(&target, Mode::Fold, now, &stop, &mut |progress| {
    ///         println!("{} read, {} folded", progress.examined, progress.folded);
    ///     })
    ///     .await;
    /// if !run.succeeded() {
    ///     eprintln!("{}: stopped or failed; the next run goes on", run.collection);
    /// }
    /// println!("folded {} tokens (+{})", run.tokens_folded, run.amount_folded);
    /// # Ok(()) }
    /// ```
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
        // Buckets close once the fold above has taken what they held; a run
        // that failed or stopped leaves them to the next.
        if run.error.is_none() && ledger_error.is_none() && !run.interrupted {
            let closed = self.close_buckets(target, mode, now, stop, &mut run).await;
            if let Err(err) = closed {
                tracing::error!(collection = %target.spec.name, cause = %err, "closing buckets failed");
                run.error = Some(err);
            }
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

    /// Folds the documents `ids` now (tokens older than `now − grace`,
    /// lanes older than `now − lane_ttl`), whatever a report said about
    /// them before: each is read and planned afresh, then folded as a run
    /// folds. Returns how many documents changed. Used by the daemon to
    /// repair stuck tokens at once.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::Reconciler,
    /// #     target: tally::FoldTarget,
    /// # ) -> Result<(), tally::Error> {
    /// use mongodb::bson::Bson;
    ///
    /// // A writer crashed between its steps on these counters: fold them now.
    /// let ids = vec![Bson::from("home"), Bson::from("pricing")];
    /// let now = fold.server_time().await?;
    /// let changed = fold.fold_documents(&target, ids, now).await?;
    /// println!("{changed} documents folded");
    /// # Ok(()) }
    /// ```
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
}

/// Cutoffs at which no lane expires, tokens at `tokens`.
fn no_lane_expires(tokens: mongodb::bson::oid::ObjectId) -> Cutoffs {
    let lanes = Token::cutoff(SystemTime::UNIX_EPOCH);
    Cutoffs { tokens, lanes }
}

#[cfg(test)]
mod tests;
