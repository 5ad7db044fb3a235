//! What a run found and did: the [`Survey`] of one report pass, the
//! [`CollectionRun`] of a fold, and the rows they are counted from.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use mongodb::bson::Bson;
use serde::Serialize;

use super::{Mode, model};
use crate::document::display_id;
use crate::error::Error;
use crate::token::Token;

/// How many malformed (and how many refused) documents a run names in its
/// report.
pub const MALFORMED_SAMPLE: usize = 10;

/// How many named lanes a survey lists (each with its highest position).
pub const NAMED_LANES_LISTED: usize = 100;

/// A document the fold leaves alone, and why.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
/// let now = fold.server_time().await?;
/// let stop = CancellationToken::new();
/// let run = fold.reconcile(&target, tally::Mode::Fold, now, &stop, &mut |_| {}).await;
/// for bad in &run.survey.malformed_sample {
///     eprintln!("{}: {} (left unchanged)", bad.id, bad.reason);
/// }
/// if run.survey.malformed > run.survey.malformed_sample.len() as u64 {
///     eprintln!("and {} more", run.survey.malformed - run.survey.malformed_sample.len() as u64);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MalformedDocument {
    /// The `_id`: a string id as itself, any other as relaxed extended
    /// JSON (`{"$oid":"…"}`, `7`).
    pub id: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A document the server refused to fold: left unchanged, and reported.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
/// let now = fold.server_time().await?;
/// let stop = CancellationToken::new();
/// let run = fold.reconcile(&target, tally::Mode::Fold, now, &stop, &mut |_| {}).await;
/// for refused in &run.refused_sample {
///     eprintln!("{}: the server refused ({}): {}", refused.id, refused.code, refused.reason);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusedDocument {
    /// The `_id`: a string id as itself, any other as relaxed extended
    /// JSON (`{"$oid":"…"}`, `7`).
    pub id: String,
    /// The server's error code (e.g. 121, document validation failure).
    pub code: i32,
    /// The server's message, every secret of the connection removed.
    pub reason: String,
}

/// A bucket past its closing time that a run could not close, and why.
///
/// ```no_run
/// # fn demo(run: tally::CollectionRun) {
/// for bucket in run.buckets.iter().flat_map(|b| &b.unclosed_sample) {
///     eprintln!("not closed: {} ({})", bucket.bucket, bucket.reason);
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnclosedBucket {
    /// The `_id`, as relaxed extended JSON (`{"k":"home","t":{"$date":…}}`).
    pub id: String,
    /// The bucket as people read it: `home in the day from
    /// 2026-12-02T00:00:00+01:00`.
    pub bucket: String,
    /// Why, in words: a pending token the fold has not taken, recorded
    /// events not folded yet, a malformed document, the server's refusal.
    pub reason: String,
}

/// What a run did about a bucketed collection's buckets (see
/// [`Buckets::closes_at`](crate::Buckets::closes_at)).
///
/// ```no_run
/// # fn demo(run: tally::CollectionRun) {
/// if let Some(closing) = &run.buckets {
///     println!(
///         "{} closed, {} past their closing time left open, {} open",
///         closing.closed, closing.unclosed, closing.open
///     );
/// }
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BucketClosing {
    /// Buckets that start before this instant were due to close: they
    /// ended `close_after` plus the closing margin ago. `None` when none
    /// can be (a clock near the epoch).
    #[serde(serialize_with = "serialize_optional_time")]
    pub due_before: Option<SystemTime>,
    /// Buckets closed (in a dry run: that would be).
    pub closed: u64,
    /// Due buckets left open, each for a reason of its own (reported by
    /// `status`, `/metrics` and the `buckets_unclosed` alert).
    pub unclosed: u64,
    /// The first few of them.
    pub unclosed_sample: Vec<UnclosedBucket>,
    /// Due buckets written between their read and their closing: the next
    /// run reads them again.
    pub raced: u64,
    /// Buckets open after the run, the due ones it could not close among
    /// them (0 when the run stopped before counting).
    pub open: u64,
    /// The start of the oldest open bucket.
    #[serde(serialize_with = "serialize_optional_time")]
    pub oldest_open: Option<SystemTime>,
}

/// What one collection holds in its pending arrays and lane maps, from one
/// report pass.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// let now = fold.server_time().await?;
/// let survey = fold.survey(&target, now - target.grace).await?;
/// if let Some(oldest) = survey.oldest_pending {
///     println!("oldest pending token: {} old", humantime::format_duration(oldest.age(now)));
/// }
/// for (lane, position) in &survey.named_lanes {
///     println!("lane {lane} at {position}");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Survey {
    /// Documents holding the pending, the settled or the lanes field: every
    /// one is read by the report, and no other.
    pub documents_scanned: u64,
    /// Well-formed documents with at least one pending entry.
    pub documents_pending: u64,
    /// Entries in the pending arrays of well-formed documents.
    pub pending_tokens: u64,
    /// The oldest of those entries.
    #[serde(skip)]
    pub oldest_pending: Option<Token>,
    /// The longest pending array.
    pub largest_pending: u64,
    /// Well-formed documents with entries older than the cutoff.
    pub documents_stale: u64,
    /// Tokens older than the cutoff that the fold counts (each once).
    pub stale_tokens: u64,
    /// What they add up to.
    pub stale_amount: i64,
    /// Stale entries repeating a token counted once (removed uncounted).
    pub duplicate_entries: u64,
    /// Stale entries of tokens a settle (`complete`, `resume`) counted
    /// already: copies re-added later, removed uncounted.
    pub settled_copies: u64,
    /// Settle markers older than the cutoff (pruned).
    pub stale_markers: u64,
    /// Well-formed documents with at least one lane entry.
    pub documents_with_lanes: u64,
    /// Entries in the lane maps of well-formed documents.
    pub lane_entries: u64,
    /// Entries in the largest lane map.
    pub largest_lane_map: u64,
    /// Entries of minted lanes older than `lane_ttl` (pruned by a run;
    /// always 0 in a survey, which judges no lane's age).
    pub expired_lane_entries: u64,
    /// Entries of named lanes, which are never pruned.
    pub named_lane_entries: u64,
    /// Named lanes and the highest position each holds in any document:
    /// the first [`NAMED_LANES_LISTED`] names met, in name order.
    pub named_lanes: BTreeMap<String, i64>,
    /// More named lanes exist than are listed.
    pub named_lanes_truncated: bool,
    /// Documents the fold must leave alone.
    pub malformed: u64,
    /// The first few of them.
    pub malformed_sample: Vec<MalformedDocument>,
}

/// Where a run is, for progress indicators.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
/// use tally::{Mode, Progress};
///
/// let mut report = |p: Progress| eprint!("\r{} documents read, {} folded", p.examined, p.folded);
/// let now = fold.server_time().await?;
/// let stop = CancellationToken::new();
/// let run = fold.reconcile(&target, Mode::Fold, now, &stop, &mut report).await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Report rows read so far.
    pub examined: u64,
    /// Documents folded so far (would be folded, in a dry run).
    pub folded: u64,
}

/// What a run did to one collection.
///
/// ```no_run
/// # async fn demo(
/// #     fold: tally::Reconciler,
/// #     target: tally::FoldTarget,
/// # ) -> Result<(), tally::Error> {
/// use tokio_util::sync::CancellationToken;
/// let now = fold.server_time().await?;
/// let stop = CancellationToken::new();
/// let run = fold.reconcile(&target, tally::Mode::Fold, now, &stop, &mut |_| {}).await;
/// if let Some(err) = &run.error {
///     eprintln!("{}: {err} (what was folded before stays folded)", run.collection);
/// }
/// println!(
///     "{}: {} documents, {} tokens (+{}), {} lane entries pruned in {}",
///     run.collection, run.documents_folded, run.tokens_folded, run.amount_folded,
///     run.lanes_pruned, humantime::format_duration(run.duration),
/// );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct CollectionRun {
    /// The collection.
    pub collection: String,
    /// `true` for a dry run: nothing was changed, the numbers say what a
    /// fold would have done.
    pub dry_run: bool,
    /// Tokens older than this instant (server time) were stale.
    #[serde(serialize_with = "serialize_time")]
    pub cutoff: SystemTime,
    /// The report's findings.
    #[serde(flatten)]
    pub survey: Survey,
    /// Documents the fold changed (the server's count): stale tokens
    /// counted, markers pruned or empty fields removed.
    pub documents_folded: u64,
    /// Tokens counted, from the plans of the documents folded.
    pub tokens_folded: u64,
    /// What they added to the counters.
    pub amount_folded: i64,
    /// Recorded events the run folded into their counters (the collection's
    /// ledger, when it has one); in a dry run, the events a fold would
    /// fold.
    pub events_folded: u64,
    /// Entries of expired minted lanes removed, from the plans of the
    /// documents folded (would be removed, in a dry run).
    pub lanes_pruned: u64,
    /// Documents that changed between the report and their fold in a way
    /// the fold's conditions refuse (a writer completed a stale token,
    /// another daemon folded them), and either needed no fold any more or
    /// still did after three reads (left for the next run). When this is
    /// not zero, `tokens_folded` and `amount_folded` are upper bounds.
    pub concurrent_changes: u64,
    /// Documents the server refused to update (a validator, a document
    /// grown too large, a unique index): left unchanged, logged with their
    /// `_id`; every other document is folded. Each run tries them again.
    pub refused: u64,
    /// The first few of them, with the server's code and message.
    pub refused_sample: Vec<RefusedDocument>,
    /// Age of the oldest stale token, in seconds, at the cutoff's clock.
    pub oldest_stale_age_seconds: Option<u64>,
    /// The buckets closed and left open, for a bucketed collection.
    pub buckets: Option<BucketClosing>,
    /// How long the run took.
    #[serde(rename = "duration_seconds", serialize_with = "serialize_seconds")]
    pub duration: Duration,
    /// The run stopped early because shutdown was requested.
    pub interrupted: bool,
    /// Why the run failed, if it did (what was folded before stays folded).
    #[serde(serialize_with = "serialize_error")]
    pub error: Option<Error>,
}

impl CollectionRun {
    pub(super) fn new(collection: &str, mode: Mode, cutoff: SystemTime) -> Self {
        Self {
            collection: collection.to_owned(),
            dry_run: mode == Mode::DryRun,
            cutoff,
            survey: Survey::default(),
            documents_folded: 0,
            tokens_folded: 0,
            amount_folded: 0,
            events_folded: 0,
            lanes_pruned: 0,
            concurrent_changes: 0,
            refused: 0,
            refused_sample: Vec::new(),
            oldest_stale_age_seconds: None,
            buckets: None,
            duration: Duration::ZERO,
            interrupted: false,
            error: None,
        }
    }

    /// A run that could not start.
    #[cfg(feature = "daemon")]
    pub(crate) fn failed(collection: &str, error: Error) -> Self {
        let mut run = Self::new(collection, Mode::Fold, SystemTime::UNIX_EPOCH);
        run.error = Some(error);
        run
    }

    /// Whether the collection was reconciled completely.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     fold: tally::Reconciler,
    /// #     target: tally::FoldTarget,
    /// # ) -> Result<(), tally::Error> {
    /// use tokio_util::sync::CancellationToken;
    /// let now = fold.server_time().await?;
    /// let stop = CancellationToken::new();
    /// let run = fold.reconcile(&target, tally::Mode::Fold, now, &stop, &mut |_| {}).await;
    /// if !run.succeeded() {
    ///     // Failed or stopped by shutdown: the fold is idempotent, run it again.
    ///     std::process::exit(75);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn succeeded(&self) -> bool {
        self.error.is_none() && !self.interrupted
    }
}

/// One row of the report: a document and what the model says of it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReportRow {
    pub(crate) id: Bson,
    /// Entries in its pending array.
    pub(crate) size: u64,
    pub(crate) plan: Result<model::FoldPlan, model::Malformed>,
}

impl ReportRow {
    /// The row of a document read as `read`, planned at `lines`.
    pub(super) fn of(read: &super::statement::Read<'_>, lines: &model::Lines) -> Self {
        Self {
            id: read.id.clone(),
            size: match read.pending {
                Some(Bson::Array(entries)) => entries.len() as u64,
                _ => 0,
            },
            plan: read.plan(lines),
        }
    }
}

impl CollectionRun {
    /// Records a document the server refused to fold.
    pub(super) fn add_refused(&mut self, id: &Bson, code: i32, reason: String) {
        self.refused += 1;
        if self.refused_sample.len() < MALFORMED_SAMPLE {
            self.refused_sample.push(RefusedDocument {
                id: display_id(id),
                code,
                reason,
            });
        }
    }

    /// Adds the plans of documents folded to the run's totals.
    pub(super) fn account<'a>(&mut self, plans: impl IntoIterator<Item = &'a model::FoldPlan>) {
        for plan in plans {
            self.tokens_folded += plan.stale_tokens;
            self.amount_folded = self.amount_folded.saturating_add(plan.stale_amount);
            self.lanes_pruned += plan.lanes.expired.len() as u64;
        }
    }
}

impl Survey {
    /// Adds one report row to the totals (and the row's document to the
    /// malformed sample).
    pub(crate) fn add(&mut self, row: &ReportRow) {
        self.documents_scanned += 1;
        let plan = match &row.plan {
            Ok(plan) => plan,
            Err(reason) => {
                self.malformed += 1;
                if self.malformed_sample.len() < MALFORMED_SAMPLE {
                    self.malformed_sample.push(MalformedDocument {
                        id: display_id(&row.id),
                        reason: reason.to_string(),
                    });
                }
                return;
            }
        };
        self.pending_tokens += row.size;
        self.documents_pending += u64::from(row.size > 0);
        self.largest_pending = self.largest_pending.max(row.size);
        self.oldest_pending = min_token(self.oldest_pending, plan.oldest);
        if !plan.stale.is_empty() {
            self.documents_stale += 1;
        }
        self.stale_tokens += plan.stale_tokens;
        self.stale_amount = self.stale_amount.saturating_add(plan.stale_amount);
        self.duplicate_entries += plan.duplicate_entries;
        self.settled_copies += plan.settled_copies;
        self.stale_markers += plan.stale_markers.len() as u64;
        self.add_lanes(&plan.lanes);
    }

    fn add_lanes(&mut self, lanes: &model::LanePlan) {
        self.documents_with_lanes += u64::from(lanes.entries > 0);
        self.lane_entries += lanes.entries;
        self.largest_lane_map = self.largest_lane_map.max(lanes.entries);
        self.expired_lane_entries += lanes.expired.len() as u64;
        self.named_lane_entries += lanes.named.len() as u64;
        for (name, position) in &lanes.named {
            if let Some(highest) = self.named_lanes.get_mut(name) {
                *highest = (*highest).max(*position);
            } else if self.named_lanes.len() < NAMED_LANES_LISTED {
                self.named_lanes.insert(name.clone(), *position);
            } else {
                self.named_lanes_truncated = true;
            }
        }
    }
}

fn min_token(a: Option<Token>, b: Option<Token>) -> Option<Token> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn serialize_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_rfc3339_seconds(*t).to_string())
}

#[allow(clippy::ref_option)]
fn serialize_optional_time<S: serde::Serializer>(
    t: &Option<SystemTime>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => serialize_time(t, s),
        None => s.serialize_none(),
    }
}

fn serialize_seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

fn serialize_error<S: serde::Serializer>(e: &Option<Error>, s: S) -> Result<S::Ok, S::Error> {
    match e {
        Some(err) => s.serialize_str(&err.to_string()),
        None => s.serialize_none(),
    }
}
