//! What a run found and did: the [`Survey`] of one report pass, the
//! [`CollectionRun`] of a fold, and the rows they are counted from.

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, Document, oid::ObjectId};
use serde::Serialize;

use super::{FoldTarget, Mode, model};
use crate::document::display_id;
use crate::error::Error;
use crate::token::Token;

/// How many malformed documents a run names in its report and logs.
pub const MALFORMED_SAMPLE: usize = 10;

/// A document the fold leaves alone, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MalformedDocument {
    /// The `_id`: a string id as itself, any other as relaxed extended
    /// JSON (`{"$oid":"…"}`, `7`).
    pub id: String,
    /// What is wrong with it.
    pub reason: String,
}

/// What one collection holds in its pending arrays, from one report pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Survey {
    /// Documents holding the pending field: every one is read by the report.
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
    /// Entries older than the cutoff.
    pub stale_tokens: u64,
    /// What they add up to.
    pub stale_amount: i64,
    /// Documents the fold must leave alone.
    pub malformed: u64,
    /// The first few of them.
    pub malformed_sample: Vec<MalformedDocument>,
}

/// Where a run is, for progress indicators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Report rows read so far.
    pub examined: u64,
    /// Documents folded so far (would be folded, in a dry run).
    pub folded: u64,
}

/// What a run did to one collection.
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
    /// Documents the fold changed (the server's count).
    pub documents_folded: u64,
    /// Tokens folded, from the report rows of the documents folded.
    pub tokens_folded: u64,
    /// What they added to the counters.
    pub amount_folded: i64,
    /// Documents the report found stale that needed no fold by the time
    /// their batch ran (a writer completed them in between). When this is
    /// not zero, `tokens_folded` and `amount_folded` are upper bounds.
    pub concurrent_changes: u64,
    /// Documents the server refused to update (a validator, a document that
    /// would grow too large): left untouched, their tokens uncounted.
    pub refused: u64,
    /// A few of them, with what the server said.
    pub refused_sample: Vec<MalformedDocument>,
    /// Age of the oldest stale token, in seconds, at the cutoff's clock.
    pub oldest_stale_age_seconds: Option<u64>,
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
            concurrent_changes: 0,
            refused: 0,
            refused_sample: Vec::new(),
            oldest_stale_age_seconds: None,
            duration: Duration::ZERO,
            interrupted: false,
            error: None,
        }
    }

    /// A run that could not start.
    pub fn failed(collection: &str, error: Error) -> Self {
        let mut run = Self::new(collection, Mode::Fold, SystemTime::UNIX_EPOCH);
        run.error = Some(error);
        run
    }

    /// Whether the collection was reconciled completely.
    pub fn succeeded(&self) -> bool {
        self.error.is_none() && !self.interrupted
    }
}

/// One row of the report: a document and what the model says of it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReportRow {
    pub(crate) id: Bson,
    /// The two fields as read, for the compare-and-swap.
    pub(crate) counter: Option<Bson>,
    pub(crate) pending: Option<Bson>,
    pub(crate) size: u64,
    pub(crate) plan: Result<model::FoldPlan, model::Malformed>,
}

impl ReportRow {
    pub(super) fn read(row: Document, target: &FoldTarget, cutoff: ObjectId) -> Self {
        let counter = row.get(&target.spec.counter_field).cloned();
        let pending = row.get(&target.spec.pending_field).cloned();
        let plan = model::plan(counter.as_ref(), pending.as_ref(), cutoff);
        Self {
            id: row.get("_id").cloned().unwrap_or(Bson::Null),
            size: match &pending {
                Some(Bson::Array(entries)) => entries.len() as u64,
                _ => 0,
            },
            counter,
            pending,
            plan,
        }
    }

    pub(super) fn stale(&self) -> Option<&model::FoldPlan> {
        self.plan.as_ref().ok().filter(|p| p.stale_tokens > 0)
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
        if plan.stale_tokens > 0 {
            self.documents_stale += 1;
            self.stale_tokens += plan.stale_tokens;
            self.stale_amount = self.stale_amount.saturating_add(plan.stale_amount);
        }
    }
}

fn min_token(a: Option<Token>, b: Option<Token>) -> Option<Token> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Adds a batch's planned tokens and amounts to the run.
pub(super) fn account(run: &mut CollectionRun, batch: &[ReportRow]) {
    for plan in batch.iter().filter_map(ReportRow::stale) {
        run.tokens_folded += plan.stale_tokens;
        run.amount_folded = run.amount_folded.saturating_add(plan.stale_amount);
    }
}

fn serialize_time<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_rfc3339_seconds(*t).to_string())
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
