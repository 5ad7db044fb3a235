//! The fault matrix (the book: design/testing.md): every fault the network or a server can
//! produce, injected by the black-pipe proxy at every write tally makes —
//! increment step 1 and step 2, sequence `next`, bounded `take`, the fold,
//! the lane increment on a new and on an existing counter, and step 1 and
//! the lane increment of a bucketed collection (`increment_at`, `add_at`:
//! the same rows, on an hour's `{k, t}` document) — with
//! retryable writes off (the hard case) and on. A request delayed in the
//! network (held by the proxy, forwarded after the caller's later attempt
//! completed) is injected at the increments' writes.
//!
//! Each cell asserts three things, and reports every cell that disagrees at
//! once:
//! - the exact outcome the caller sees (from the table in [`expected`]);
//! - how many requests of the faulted kind were sent and how many reached
//!   the server (the proxy's log);
//! - the exact document afterwards, which must equal the state derived from
//!   the log alone (what reached the server, in the order it reached it,
//!   de-duplicated the way the server de-duplicates retryable writes) —
//!   independently of what the library said happened; for the lane cells
//!   also the exact counter and lane entry the outcome promises.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use tally::{
    BoundedConfig, BoundedCounters, BucketWidth, Buckets, CollectionConfig, Completion, Counters,
    FoldTarget, Increment, LaneIncrement, Mode, SequenceConfig, Sequences, Store, Take, Token,
    WriterConfig,
};

use crate::common::proxy::{Action, Exchange, Proxy, Release, Rule, upstream_of};
use crate::common::{TestClient, TestContext, run_reconcile};

/// The bound on one attempt for the client through the proxy (which must
/// exceed its server selection timeout, [`SELECTION`], by a second).
pub(crate) const ATTEMPT: Duration = Duration::from_secs(3);
/// The server selection timeout of the client through the proxy.
pub(crate) const SELECTION: &str = "serverSelectionTimeoutMS=2000";
/// A delay well past [`ATTEMPT`]: the client gives up first.
pub(crate) const DELAY: Duration = Duration::from_secs(6);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The server executed the write; its reply never reached the client.
    ReplyDropped,
    /// The connection closed before the request reached the server.
    ClosedBeforeForwarding,
    /// The server executed the write; its reply came after the client's
    /// attempt timeout.
    DelayedPastTimeout,
    /// `NotWritablePrimary` (10107): a failover, nothing executed.
    NotPrimary,
    /// `BadValue` (2): a command error, nothing executed.
    CommandError,
    /// `DuplicateKey` (11000) on `_id`, in the shape the server gives the
    /// command, nothing executed.
    DuplicateKey,
    /// The request is held up in the network: the client's attempt fails,
    /// and the request reaches the server only after the caller's operation
    /// returned (injected at the increments' writes).
    Delayed,
}

const FAULTS: [Fault; 6] = [
    Fault::ReplyDropped,
    Fault::ClosedBeforeForwarding,
    Fault::DelayedPastTimeout,
    Fault::NotPrimary,
    Fault::CommandError,
    Fault::DuplicateKey,
];

impl Fault {
    /// The proxy action. A real server labels a not-primary error
    /// `RetryableWriteError` when the write is a retryable one.
    pub(crate) fn action(self, retryable_write: bool) -> Action {
        match self {
            Self::ReplyDropped => Action::DropReply,
            Self::ClosedBeforeForwarding => Action::CloseBeforeForwarding,
            Self::DelayedPastTimeout => Action::DelayReply(DELAY),
            Self::NotPrimary if retryable_write => {
                Action::error(10107, "NotWritablePrimary", &["RetryableWriteError"])
            }
            Self::NotPrimary => Action::error(10107, "NotWritablePrimary", &[]),
            Self::CommandError => Action::error(2, "BadValue", &[]),
            Self::DuplicateKey => Action::DuplicateKey,
            Self::Delayed => Action::HoldRequest(Release::WhenReleased),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Site {
    /// `Counters::increment`, its step 1 (`$addToSet` upsert).
    Step1,
    /// `Counters::increment`, its step 2 (a conditioned pipeline: `$add` to
    /// the counter, `$filter` the token out of the pending entries).
    Step2,
    /// `Sequences::next` on an existing sequence (`findAndModify` `$inc`).
    SequenceNext,
    /// `BoundedCounters::take` (conditioned `$inc: -1` + `$push`).
    BoundedTake,
    /// `Reconciler::reconcile`, its first fold `update`.
    Fold,
    /// `Counters::add` on a counter that does not exist yet (its update
    /// upserts it).
    LaneNew,
    /// `Counters::add` on an existing counter holding another lane's entry,
    /// through a lane that wrote it once already (a later number).
    LaneExisting,
    /// `Counters::increment_at` in an hour-bucketed collection, its step 1:
    /// the same protocol on the `{k, t}` document of the hour.
    BucketedStep1,
    /// `Counters::add_at` in an hour-bucketed collection, on a bucket not
    /// written yet.
    BucketedLane,
}

const SITES: [Site; 9] = [
    Site::Step1,
    Site::Step2,
    Site::SequenceNext,
    Site::BoundedTake,
    Site::Fold,
    Site::LaneNew,
    Site::LaneExisting,
    Site::BucketedStep1,
    Site::BucketedLane,
];

impl Site {
    fn command(self) -> &'static str {
        match self {
            Self::SequenceNext => "findAndModify",
            _ => "update",
        }
    }

    /// Which request of [`Self::command`] on the cell's collection the fault
    /// hits: step 2 is the increment's second `update`, the existing lane's
    /// add the second through its lane.
    fn nth(self) -> u64 {
        match self {
            Self::Step2 | Self::LaneExisting => 2,
            _ => 1,
        }
    }

    /// The faults injected here: every one, and a delayed request at the
    /// increments' writes.
    fn faults(self) -> Vec<Fault> {
        let mut faults = FAULTS.to_vec();
        if matches!(
            self,
            Self::Step1
                | Self::Step2
                | Self::LaneNew
                | Self::LaneExisting
                | Self::BucketedStep1
                | Self::BucketedLane
        ) {
            faults.push(Fault::Delayed);
        }
        faults
    }

    /// Whether a request belongs to this site (step 1 and step 2 share the
    /// command and the collection).
    fn owns(self, exchange: &Exchange) -> bool {
        exchange.command.as_deref() == Some(self.command())
            && match self {
                Self::Step1 | Self::BucketedStep1 => exchange.body_mentions("$addToSet"),
                Self::Step2 => exchange.body_mentions("$filter"),
                _ => true,
            }
    }
}

/// What a cell must show: the outcome, and how many requests of the site
/// were sent and reached the server.
#[derive(Debug)]
pub(crate) struct Expected {
    pub(crate) outcome: &'static str,
    pub(crate) sent: usize,
    pub(crate) reached: usize,
}

impl Expected {
    /// Adds to `diff` where a cell's outcome and counts disagree.
    pub(crate) fn judge(&self, outcome: &str, sent: usize, reached: usize, diff: &mut Vec<String>) {
        if outcome != self.outcome {
            diff.push(format!("outcome {outcome:?}, expected {:?}", self.outcome));
        }
        if (sent, reached) != (self.sent, self.reached) {
            diff.push(format!(
                "sent/reached {sent}/{reached}, expected {}/{}",
                self.sent, self.reached
            ));
        }
    }
}

/// The matrix: the same with `retryWrites=true` or `false` in the URI,
/// because tally owns its retries (the driver's are off on its client).
fn expected(site: Site, fault: Fault) -> Expected {
    use Fault::*;
    use Site::*;
    // A bucketed write is the same protocol on another `_id`: the same row.
    let site = match site {
        BucketedStep1 => Step1,
        BucketedLane => LaneNew,
        other => other,
    };
    let (outcome, sent, reached) = match (site, fault) {
        // Step 1 is idempotent: every transient fault is retried once and
        // the increment is counted; a refused command is not counted.
        (Step1, ReplyDropped | DelayedPastTimeout) => ("counted", 2, 2),
        (Step1, ClosedBeforeForwarding | NotPrimary) => ("counted", 2, 1),
        (Step1, CommandError) => ("not counted (command)", 1, 0),
        // A duplicate key on an upsert is a race that applied nothing.
        (Step1, DuplicateKey) => ("counted", 2, 1),
        // The held step 1 lands after step 2 counted the token: without
        // retryable writes it re-adds the token, whose marker (left by step
        // 2, as a step 1 attempt may have applied) makes the fold drop it.
        (Step1, Delayed) => ("counted", 2, 2),
        // Step 2 applies at most once: a retry after a lost reply finds the
        // token gone.
        (Step2, ReplyDropped | DelayedPastTimeout) => ("counted (already settled)", 2, 2),
        (Step2, ClosedBeforeForwarding | NotPrimary) => ("counted", 2, 1),
        // A refused step 2 leaves the token pending; `complete` counts it.
        (Step2, CommandError) => ("pending (command), then complete: counted", 2, 1),
        (Step2, DuplicateKey) => ("pending (duplicate_key), then complete: counted", 2, 1),
        // The held step 2 lands after its retry counted the token: it finds
        // the token gone.
        (Step2, Delayed) => ("counted", 2, 2),
        // `next` from 1: a retried `$inc` whose first execution applied
        // skips a number — a gap, never a duplicate.
        (SequenceNext, ReplyDropped | DelayedPastTimeout) => ("3", 2, 2),
        (SequenceNext, ClosedBeforeForwarding | NotPrimary) => ("2", 2, 1),
        (SequenceNext, CommandError) => ("error (command)", 1, 0),
        (SequenceNext, DuplicateKey) => ("error (duplicate_key)", 1, 0),
        // A retried take with the same token never takes twice.
        (BoundedTake, ReplyDropped | DelayedPastTimeout) => ("already taken", 2, 2),
        (BoundedTake, ClosedBeforeForwarding | NotPrimary) => ("taken", 2, 1),
        (BoundedTake, CommandError) => ("error (command)", 1, 0),
        (BoundedTake, DuplicateKey) => ("error (duplicate_key)", 1, 0),
        // The fold: a lost reply is retried (the update, conditioned on
        // the stale entries it removes, then matches nothing, and the
        // document read again has nothing left to fold); a refused command
        // fails the run, and the next run folds; a statement refused for
        // its document's sake leaves that document for the next run.
        (Fold, ReplyDropped | DelayedPastTimeout) => ("folded 2 tokens (+4)", 2, 2),
        (Fold, ClosedBeforeForwarding | NotPrimary) => ("folded 2 tokens (+4)", 2, 1),
        (Fold, CommandError) => ("failed (command), next run: folded 2 tokens (+4)", 2, 1),
        (Fold, DuplicateKey) => ("refused (11000), next run: folded 2 tokens (+4)", 2, 1),
        // A lane's update applies at most once: a retry after a lost reply
        // collides with what the first attempt wrote (its upsert, on `_id`,
        // twice), and the lane's entry says it applied.
        (LaneNew | LaneExisting, ReplyDropped | DelayedPastTimeout) => {
            ("counted (already applied)", 3, 3)
        }
        (LaneNew | LaneExisting, ClosedBeforeForwarding | NotPrimary) => ("counted", 2, 1),
        (LaneNew | LaneExisting, CommandError) => ("not counted (command)", 1, 0),
        // An upsert race that applied nothing: sent again, once.
        (LaneNew | LaneExisting, DuplicateKey) => ("counted", 2, 1),
        // The held request lands after the retry applied: the lane holds
        // its number, so it applies nothing.
        (LaneNew | LaneExisting, Delayed) => ("counted", 2, 2),
        (SequenceNext | BoundedTake | Fold, Delayed) => unreachable!("not injected there"),
        (BucketedStep1 | BucketedLane, _) => unreachable!("read as their protocol's row"),
    };
    Expected {
        outcome,
        sent,
        reached,
    }
}

/// A server, the proxy in front of it, a store through the proxy and a
/// client around it.
pub(crate) struct Rig {
    pub(crate) proxy: Proxy,
    /// Through the proxy, each attempt bounded by [`ATTEMPT`].
    pub(crate) store: Store,
    pub(crate) direct: TestClient,
    retry_writes: bool,
}

impl Rig {
    pub(crate) async fn new(name: &str, retry_writes: bool) -> Self {
        let ctx = TestContext::new(name).await;
        let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
        let store = ctx
            .client_through_with(&proxy, retry_writes, SELECTION)
            .await
            .store()
            .with_attempt_timeout(ATTEMPT);
        assert_eq!(store.attempt_timeout(), ATTEMPT);
        let direct = ctx.client(false).await;
        Self {
            proxy,
            store,
            direct,
            retry_writes,
        }
    }

    /// Runs every cell; panics listing every cell that disagrees.
    async fn run_matrix(&self) {
        let mut failures = String::new();
        for site in SITES {
            for fault in site.faults() {
                if let Err(diff) = self.run_cell(site, fault).await {
                    let _ = writeln!(failures, "{site:?} × {fault:?}: {diff}");
                }
            }
        }
        assert!(
            failures.is_empty(),
            "fault matrix (retryWrites={} in the URI):\n{failures}",
            self.retry_writes
        );
    }

    async fn run_cell(&self, site: Site, fault: Fault) -> Result<(), String> {
        let name = format!("{site:?}_{fault:?}").to_lowercase();
        let direct = self.direct.collection(&name);
        self.proxy.clear_log();
        let rule = self.proxy.rule(
            Rule::command(site.command())
                .collection(&name)
                .nth(site.nth())
                .then(fault.action(false)),
        );
        let want = expected(site, fault);
        let (outcome, state, from_log) = match site {
            Site::Step1 | Site::Step2 | Site::BucketedStep1 => {
                self.increment(site, &name, &direct).await
            }
            Site::SequenceNext => self.sequence_next(&name, &direct).await,
            Site::BoundedTake => self.bounded_take(&name, &direct).await,
            Site::Fold => self.fold(&name, &direct, rule).await,
            Site::LaneNew | Site::LaneExisting | Site::BucketedLane => {
                let counted = want.outcome.starts_with("counted");
                match self.lane_add(site, &name, &direct, counted).await {
                    Ok(cell) => cell,
                    Err(diff) => return Err(diff),
                }
            }
        };
        let log: Vec<Exchange> = self
            .proxy
            .log()
            .into_iter()
            .filter(|e| e.collection.as_deref() == Some(name.as_str()) && site.owns(e))
            .collect();
        let sent = log.len();
        let reached = log.iter().filter(|e| e.reached_server).count();
        let mut diff = Vec::new();
        want.judge(&outcome, sent, reached, &mut diff);
        if state != from_log {
            diff.push(format!("document {state:?}, the log says {from_log:?}"));
        }
        if diff.is_empty() {
            Ok(())
        } else {
            Err(diff.join("; "))
        }
    }

    /// The increment's cells. State: `counter` and `pending` of key `k`
    /// (in a bucketed cell, of `k`'s document of the hour written).
    async fn increment(
        &self,
        site: Site,
        name: &str,
        direct: &mongodb::Collection<Document>,
    ) -> (String, Option<Document>, Option<Document>) {
        let (spec, at, id) = cell_counter(site, name);
        let counters = Counters::new(&self.store, spec, WriterConfig::default());
        let result = match at {
            Some(at) => counters.increment_at("k", 1, at).await,
            None => counters.increment("k", 1).await,
        };
        let token = result.token().expect("a token was made");
        let outcome = match result {
            Increment::Counted(c) if c.settled_earlier() => "counted (already settled)".into(),
            Increment::Counted(_) => "counted".into(),
            Increment::Pending(pending) => {
                let class = class_of(pending.cause());
                match counters.complete(pending).await {
                    Completion::Counted(c) if !c.settled_earlier() => {
                        format!("pending ({class}), then complete: counted")
                    }
                    other => format!("pending ({class}), then complete: {other:?}"),
                }
            }
            Increment::Unknown(unknown) => format!("unknown ({})", class_of(unknown.cause())),
            Increment::NotCounted(not) => format!("not counted ({})", class_of(Some(not.cause()))),
        };
        let log = self.settled_log(name).await;
        let from_log = replay_increment(&log, token.object_id());
        let state = project(direct, id, &["counter", "pending", "settled"]).await;
        (outcome, state, from_log)
    }

    /// The lane cells: `add` of 1 to `k` — a new counter, or one at 5 with
    /// another lane's entry that this handle's lane already wrote once (its
    /// second number is later than its first). State:
    /// `counter` and `lanes`. Besides matching the log, the document must
    /// be exactly what the outcome promises (`counted`: the amount added
    /// once, the lane holding its number); a mismatch is reported at once.
    async fn lane_add(
        &self,
        site: Site,
        name: &str,
        direct: &mongodb::Collection<Document>,
        counted: bool,
    ) -> Result<(String, Option<Document>, Option<Document>), String> {
        let (spec, at, id) = cell_counter(site, name);
        let counters = Counters::try_new(&self.store, spec, WriterConfig::default())
            .expect("the default lane settings");
        let lanes = ["counter", "lanes"];
        let mut first = 0;
        if site == Site::LaneExisting {
            direct
                .insert_one(doc! { "_id": "k", "counter": 5i64, "lanes": { "other:0": 7i64 } })
                .await
                .expect("seed the counter");
            first = match counters.add("k", 1).await {
                LaneIncrement::Counted(c) => c.position(),
                other => return Err(format!("the first add: {other:?}")),
            };
            self.settled_log(name).await;
            self.proxy.clear_log();
        }
        let before = project(direct, id.clone(), &lanes).await;
        let result = match at {
            Some(at) => counters.add_at("k", 1, at).await,
            None => counters.add("k", 1).await,
        };
        let lane = result.lane().expect("a lane was taken").key();
        let position = result.position().expect("a lane was taken");
        let outcome = match &result {
            LaneIncrement::Counted(c) if c.settled_earlier() => "counted (already applied)".into(),
            LaneIncrement::Counted(_) => "counted".into(),
            LaneIncrement::Unknown(t) => format!("unknown ({})", class_of(t.cause())),
            LaneIncrement::NotCounted(n) => format!("not counted ({})", class_of(Some(n.cause()))),
            LaneIncrement::OutOfOrder(o) => format!("out of order (the lane holds {})", o.held()),
        };
        let log = self.settled_log(name).await;
        let from_log = replay_lanes(&log, before.clone());
        let state = project(direct, id, &lanes).await;
        let promised = match (site, counted) {
            (Site::LaneNew | Site::BucketedLane, false) => None,
            (Site::LaneNew | Site::BucketedLane, true) => {
                Some(doc! { "counter": 1i32, "lanes": { &lane: position } })
            }
            (_, false) => before,
            (_, true) => Some(doc! {
                "counter": 7i64,
                "lanes": { "other:0": 7i64, &lane: position },
            }),
        };
        // The same lane, a later number than its first add's.
        if state != promised || position <= first {
            return Err(format!(
                "outcome {outcome:?} at s = {position}: document {state:?}, promised {promised:?}"
            ));
        }
        Ok((outcome, state, from_log))
    }

    /// `next` on the sequence `s`, which stands at 1. State: `seq`.
    async fn sequence_next(
        &self,
        name: &str,
        direct: &mongodb::Collection<Document>,
    ) -> (String, Option<Document>, Option<Document>) {
        direct
            .insert_one(doc! { "_id": "s", "seq": 1i64 })
            .await
            .expect("seed the sequence");
        let sequences = Sequences::new(
            &self.store,
            &SequenceConfig {
                collection: name.into(),
                field: "seq".into(),
            },
        );
        let outcome = match sequences.next("s").await {
            Ok(value) => value.to_string(),
            Err(err) => format!("error ({})", class_name(err.class())),
        };
        let log = self.settled_log(name).await;
        let executions = executed(&log, "findAndModify").len();
        let from_log = Some(doc! { "seq": 1 + executions as i64 });
        let state = project(direct, "s", &["seq"]).await;
        if let (Ok(value), Some(seq)) = (outcome.parse::<i64>(), state.as_ref()) {
            assert_eq!(
                Some(value),
                seq.get_i64("seq").ok(),
                "next returned the sequence's value"
            );
        }
        (outcome, state, from_log)
    }

    /// `take` of the bounded counter `b` with 3 units. State: `available`
    /// and the holders' tokens.
    async fn bounded_take(
        &self,
        name: &str,
        direct: &mongodb::Collection<Document>,
    ) -> (String, Option<Document>, Option<Document>) {
        direct
            .insert_one(doc! { "_id": "b", "available": 3i64, "holders": [] })
            .await
            .expect("seed the bounded counter");
        let bounded = BoundedCounters::new(&self.store, BoundedConfig::new(name));
        let token = Token::new();
        let outcome = match bounded.take("b", token, "alice").await {
            Ok(Take::Taken) => "taken".into(),
            Ok(Take::AlreadyTaken) => "already taken".into(),
            Ok(other) => format!("{other:?}"),
            Err(err) => format!("error ({})", class_name(err.class())),
        };
        let log = self.settled_log(name).await;
        // The take is conditioned on the token not holding a unit yet.
        let from_log = if !executed(&log, "update").is_empty() {
            doc! { "available": 2i64, "holders": [token.object_id()] }
        } else {
            doc! { "available": 3i64, "holders": [] }
        };
        let state = project(direct, "b", &["available", "holders"])
            .await
            .map(|mut d| {
                let tokens: Vec<Bson> = d
                    .get_array("holders")
                    .map(|h| {
                        h.iter()
                            .filter_map(|e| e.as_document()?.get("token").cloned())
                            .collect()
                    })
                    .unwrap_or_default();
                d.insert("holders", tokens);
                d
            });
        (outcome, state, Some(from_log))
    }

    /// A fold of document `f`: counter 5, two stale entries (+1, +3) and a
    /// young one. State: `counter` and `pending`. A run the fault made fail
    /// is followed by a second run without the fault.
    async fn fold(
        &self,
        name: &str,
        direct: &mongodb::Collection<Document>,
        rule: crate::common::proxy::RuleGuard,
    ) -> (String, Option<Document>, Option<Document>) {
        let hour_ago = SystemTime::now() - Duration::from_secs(3600);
        let (stale_one, stale_three) = (
            Token::created_at_time(hour_ago).object_id(),
            Token::created_at_time(hour_ago).object_id(),
        );
        let young = ObjectId::new();
        direct
            .insert_one(doc! {
                "_id": "f",
                "counter": 5i64,
                "pending": [stale_one, { "t": stale_three, "n": 3i64 }, young],
            })
            .await
            .expect("seed the document");
        let target = FoldTarget {
            spec: CollectionConfig::new(name),
            grace: Duration::from_secs(60),
            batch_size: 100,
        };
        let run = || run_reconcile(&self.store, &target, Mode::Fold);
        let folded = |run: &tally::CollectionRun| {
            format!(
                "folded {} tokens (+{})",
                run.tokens_folded, run.amount_folded
            )
        };
        let first = run().await;
        drop(rule);
        let outcome = match &first.error {
            None if first.refused > 0 => {
                let second = run().await;
                format!(
                    "refused ({}), next run: {}",
                    first.refused_sample[0].code,
                    folded(&second)
                )
            }
            None => folded(&first),
            Some(err) => {
                let second = run().await;
                match &second.error {
                    None => format!(
                        "failed ({}), next run: {}",
                        class_name(err.class()),
                        folded(&second)
                    ),
                    Some(again) => format!("failed twice: {err}; {again}"),
                }
            }
        };
        let log = self.settled_log(name).await;
        // Every fold update is conditioned on what it folds: once one
        // reached the server, the stale entries are counted, once.
        let reached = log
            .iter()
            .any(|e| e.command.as_deref() == Some("update") && e.reached_server);
        let from_log = if reached {
            doc! { "counter": 9i64, "pending": [young] }
        } else {
            doc! { "counter": 5i64, "pending": [stale_one, { "t": stale_three, "n": 3i64 }, young] }
        };
        let state = project(direct, "f", &["counter", "pending"]).await;
        (outcome, state, Some(from_log))
    }

    /// The log of the cell's collection once every held request was
    /// forwarded and every request reached the server or was answered or
    /// closed (a delayed reply may still be on its way to a client that has
    /// gone).
    async fn settled_log(&self, name: &str) -> Vec<Exchange> {
        settled_log(&self.proxy, name).await
    }
}

/// The requests named `command` the server executed according to the log,
/// in the order they reached it: every one that reached it, except that
/// retries of one retryable write (the same session and transaction
/// number) execute once — the first to arrive; the others are answered
/// from its result.
/// Releases what the proxy holds (a request held up in the network
/// arrives now, after the caller's operation returned), waits until every
/// request on collection `name` is settled, and returns them.
pub(crate) async fn settled_log(proxy: &Proxy, name: &str) -> Vec<Exchange> {
    proxy.release_held().await;
    proxy
        .wait_until("every request of the cell is settled", DELAY * 2, |log| {
            log.iter()
                .filter(|e| e.collection.as_deref() == Some(name))
                .all(|e| e.settled || e.reached_server)
        })
        .await
        .into_iter()
        .filter(|e| e.collection.as_deref() == Some(name))
        .collect()
}

fn executed<'a>(log: &'a [Exchange], command: &str) -> Vec<&'a Exchange> {
    let mut arrived: Vec<&Exchange> = log
        .iter()
        .filter(|e| e.command.as_deref() == Some(command) && e.reached_server)
        .collect();
    arrived.sort_by_key(|e| e.forwarded);
    let mut retryable = HashSet::new();
    arrived
        .into_iter()
        .filter(|e| match (e.body.get("lsid"), e.body.get("txnNumber")) {
            (Some(lsid), Some(txn)) => retryable.insert(format!("{lsid}/{txn}")),
            _ => true,
        })
        .collect()
}

/// The counter document the increment cells' updates make of key `k`,
/// replayed as the server executed them: step 1 adds the token (creating
/// the document from counter 0); step 2 counts a pending token once and
/// removes it (leaving its marker in its settle form, which applies only
/// while there is none).
fn replay_increment(log: &[Exchange], token: ObjectId) -> Option<Document> {
    // (counter, token pending, token marked)
    let mut state: Option<(i64, bool, bool)> = None;
    for update in executed(log, "update") {
        if Site::Step1.owns(update) {
            let (counter, _, marked) = state.unwrap_or((0, false, false));
            state = Some((counter, true, marked));
        } else if Site::Step2.owns(update) {
            let settle = update.body_mentions("$concatArrays");
            if let Some((counter, true, marked)) = state
                && !(settle && marked)
            {
                state = Some((counter + 1, false, marked || settle));
            }
        }
    }
    state.map(|(counter, pending, marked)| {
        let mut document = doc! { "counter": counter };
        if pending {
            document.insert("pending", vec![token]);
        }
        if marked {
            document.insert("settled", vec![doc! { "t": token, "n": 1i64 }]);
        }
        document
    })
}

/// The counter document the lane cells' updates make of `before`, replayed
/// as the server executed them: an update applies — adds its amount, sets
/// its lane's entry to its number — only while the lane holds less (no
/// entry counts as less), and creates the document when there is none.
pub(crate) fn replay_lanes(log: &[Exchange], before: Option<Document>) -> Option<Document> {
    let mut state = before;
    for update in executed(log, "update") {
        let statement = update.body.get_array("updates").expect("updates")[0]
            .as_document()
            .expect("an update statement")
            .get_document("u")
            .expect("update operators");
        let set = statement.get_document("$set").expect("$set");
        let (path, position) = set.iter().next().expect("the lane's entry");
        let lane = path.strip_prefix("lanes.").expect("a lane path");
        let position = position.as_i64().expect("an int64 number");
        let amount = statement
            .get_document("$inc")
            .and_then(|inc| inc.get_i32("counter"))
            .expect("an int32 amount");
        let document = state.get_or_insert_with(|| doc! { "counter": 0i32, "lanes": {} });
        let lanes = document.get_document_mut("lanes").expect("a lane map");
        if lanes.get_i64(lane).is_ok_and(|held| held >= position) {
            continue;
        }
        lanes.insert(lane, position);
        let counter = match document.get("counter") {
            Some(Bson::Int32(n)) => Bson::Int32(n + amount),
            Some(Bson::Int64(n)) => Bson::Int64(n + i64::from(amount)),
            other => panic!("counter {other:?}"),
        };
        document.insert("counter", counter);
    }
    state
}

/// A cell's counter: its collection (hour buckets of UTC for a bucketed
/// site), the time its write carries, and the `_id` of `k`'s document
/// (`{k, t}` of the hour for a bucketed site).
fn cell_counter(site: Site, name: &str) -> (CollectionConfig, Option<SystemTime>, Bson) {
    if !matches!(site, Site::BucketedStep1 | Site::BucketedLane) {
        return (CollectionConfig::new(name), None, Bson::from("k"));
    }
    let hours = Buckets::utc(BucketWidth::Hour);
    // A minute ago: its hour is open whenever the cell runs.
    let at = SystemTime::now() - Duration::from_secs(60);
    let start = hours.start_of(at).expect("an hour");
    let id = doc! { "k": "k", "t": mongodb::bson::DateTime::from_system_time(start) };
    (
        CollectionConfig::new(name).with_buckets(hours),
        Some(at),
        Bson::Document(id),
    )
}

/// The fields `fields` of document `id`, or `None` when it does not exist.
pub(crate) async fn project(
    coll: &mongodb::Collection<Document>,
    id: impl Into<Bson>,
    fields: &[&str],
) -> Option<Document> {
    let found = coll
        .find_one(doc! { "_id": id.into() })
        .await
        .expect("read the document directly")?;
    Some(
        fields
            .iter()
            .filter_map(|f| found.get(*f).map(|v| ((*f).to_owned(), v.clone())))
            .collect(),
    )
}

fn class_of(err: Option<&tally::Error>) -> &'static str {
    class_name(err.and_then(tally::Error::class))
}

fn class_name(class: Option<tally::ErrorClass>) -> &'static str {
    class.map_or("not a server error", tally::ErrorClass::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_at_every_write_with_retryable_writes_off() {
    Rig::new("faults_retry_off", false).await.run_matrix().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_at_every_write_with_retryable_writes_on() {
    Rig::new("faults_retry_on", true).await.run_matrix().await;
}

/// The increment's first step 1 is held up in the network and lands after
/// the retried step 1 and step 2 counted the token: the token is pending
/// again. The increment's step 2 left the token's settle marker (a step 1
/// attempt may have applied), so the fold drops the late copy instead of
/// counting it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_step_1_landing_after_the_increment_is_never_counted_again() {
    for retry_writes in [false, true] {
        let name = format!("delayed_step1_rw_{retry_writes}");
        let rig = Rig::new(&name, retry_writes).await;
        let coll = "views";
        let _hold = rig.proxy.rule(
            Rule::command("update")
                .collection(coll)
                .nth(1)
                .then(Action::HoldRequest(Release::WhenReleased)),
        );
        let counters = Counters::new(
            &rig.store,
            CollectionConfig::new(coll),
            WriterConfig::default(),
        );
        let outcome = counters.increment("k", 1).await;
        assert!(
            matches!(outcome, Increment::Counted(ref c) if !c.settled_earlier()),
            "{name}: {outcome:?}"
        );
        let held = rig.proxy.release_held().await;
        assert!(
            held.len() == 1 && held[0].reached_server && held[0].body_mentions("$addToSet"),
            "{name}: {held:#?}"
        );
        let direct = rig.direct.collection(coll);
        let target = FoldTarget {
            spec: CollectionConfig::new(coll),
            grace: Duration::from_secs(1),
            batch_size: 100,
        };
        // The late copy is folded once it is older than the grace.
        crate::common::wait_until("the fold took the late copy", DELAY * 2, || {
            let (store, target, direct) = (&rig.store, &target, &direct);
            async move {
                run_reconcile(store, target, Mode::Fold).await;
                project(direct, "k", &["pending"]).await == Some(doc! {})
            }
        })
        .await;
        assert_eq!(
            project(&direct, "k", &["counter"]).await,
            Some(doc! { "counter": 1i64 }),
            "{name}: counted once"
        );
    }
}

/// The first attempt is held up in the network (the client's attempt runs
/// out of time), tally retries, and the server refuses the retry with a
/// command error (BadValue here). The refusal answers the retry only — the
/// held first attempt lands afterwards. So neither protocol may say
/// `NotCounted`: the increment is unknown, and resuming it counts it once.
/// (With `retryWrites=true` in the URI: tally's client has the driver's
/// retries off, and tally's own retry is this one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_refused_after_its_held_first_attempt_is_unknown_never_not_counted() {
    let rig = Rig::new("driver_retry_refused", true).await;
    for protocol in ["lanes", "two-step"] {
        let rules = [
            rig.proxy.rule(
                Rule::command("update")
                    .collection(protocol)
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            rig.proxy.rule(
                Rule::command("update")
                    .collection(protocol)
                    .nth(2)
                    .then(Action::error(2, "BadValue", &[])),
            ),
        ];
        let counters = Counters::try_new(
            &rig.store,
            CollectionConfig::new(protocol),
            WriterConfig::default(),
        )
        .expect("the default lane settings");
        let (outcome, resumed) = if protocol == "lanes" {
            let outcome = counters.add("k", 5).await;
            let shown = format!("{outcome:?}");
            let resumed = match outcome {
                LaneIncrement::Unknown(ticket) => {
                    held_lands(&rig.proxy, protocol).await;
                    format!("{:?}", counters.resume_lane(ticket).await)
                }
                _ => String::new(),
            };
            (shown, resumed)
        } else {
            let outcome = counters.increment("k", 5).await;
            let shown = format!("{outcome:?}");
            let resumed = match outcome {
                Increment::Unknown(unknown) => {
                    held_lands(&rig.proxy, protocol).await;
                    format!("{:?}", counters.resume(unknown).await)
                }
                _ => String::new(),
            };
            (shown, resumed)
        };
        drop(rules);
        held_lands(&rig.proxy, protocol).await;
        assert!(
            outcome.starts_with("Unknown("),
            "{protocol}: told {outcome}, but the held first attempt applies"
        );
        assert!(
            resumed.starts_with("Ok(Counted("),
            "{protocol}: resumed {resumed}"
        );
        let direct = rig.direct.collection(protocol);
        assert_eq!(
            crate::common::counter(&direct, "k").await,
            5,
            "{protocol}: counted once"
        );
    }
}

/// Forwards the held request of `collection` and checks it reached the
/// server (once it did, later calls find nothing held).
async fn held_lands(proxy: &Proxy, collection: &str) {
    for held in proxy.release_held().await {
        if held.collection.as_deref() == Some(collection) {
            assert!(held.reached_server, "{collection}: {held:?}");
        }
    }
}
