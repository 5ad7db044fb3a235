//! The ledger's rows of the fault matrix (DESIGN §7, §8): every fault the
//! proxy injects — reply lost, connection cut, reply past the attempt
//! timeout, not-primary, a command error, a request held up in the network
//! and forwarded after the operation returned — at `Ledger::record`, at
//! `Ledger::record_many`, and at each write and read of the fold's steps
//! (the batch's intent, the claim, the sum, a counter's apply, the mark,
//! the intent's removal), with retryable writes off (the hard case) and on.
//! With them on, the driver retries a retryable write once itself (the
//! `insert`s, the apply's single-document `update`, the intent's `delete`;
//! not the claim's and the mark's `updateMany`) on a lost reply, a cut
//! connection or a not-primary, and the server answers a retried `insert`,
//! `update` or `delete` from its first execution.
//!
//! Each cell asserts:
//! - the outcome the caller sees (the table in [`expected`]);
//! - how many requests of the faulted kind were sent and reached the
//!   server (the proxy's log);
//! - for the recordings: every event the outcome says is recorded, and no
//!   other, is in the counters after a final fold, and what is there is
//!   exactly the events whose `insert` reached the server (the log);
//! - for the fold: the exact value of every counter right after the
//!   faulted pass (`Ledger::value`), and after a new process's pass
//!   (recovery first), every counter equal to its distinct events (the
//!   known operations), nothing unfolded, no intent left.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, doc};
use tally::{CollectionConfig, EventFold, EventFoldSettings, Ledger, Recording};
use tokio_util::sync::CancellationToken;

use crate::common::counter;
use crate::common::proxy::{Exchange, Rule};
use crate::faults::{Expected, Fault, Rig, settled_log};

const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

const FAULTS: [Fault; 6] = [
    Fault::ReplyDropped,
    Fault::ClosedBeforeForwarding,
    Fault::DelayedPastTimeout,
    Fault::NotPrimary,
    Fault::CommandError,
    Fault::Delayed,
];

/// The recorded events of the fold cells (and `record_many`'s): key,
/// counter, amount.
const EVENTS: [(&str, &str, i64); 3] = [("e1", "a", 1), ("e2", "a", 2), ("e3", "b", 3)];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Site {
    /// `Ledger::record` (one `insert`).
    Record,
    /// `Ledger::record_many` of three events (one unordered `insert`).
    RecordMany,
    /// The fold's intent (`insert` into `<events>_batches`).
    Intent,
    /// The claim (`updateMany` with the picked ids).
    Claim,
    /// The sum (`aggregate` `$match c.b` → `$group`): the events
    /// collection's second aggregate of a pass, after recovery's.
    Sum,
    /// A counter's apply through the fold lane (the first `update` on the
    /// counters).
    Apply,
    /// The mark (`updateMany` `$set f`): the events collection's second
    /// `update` of a pass.
    Mark,
    /// The intent's removal (`delete`).
    Done,
}

const SITES: [Site; 8] = [
    Site::Record,
    Site::RecordMany,
    Site::Intent,
    Site::Claim,
    Site::Sum,
    Site::Apply,
    Site::Mark,
    Site::Done,
];

impl Site {
    /// The faulted command, the collection (by suffix of the cell's name)
    /// and which of its requests.
    fn target(self) -> (&'static str, &'static str, u64) {
        match self {
            Self::Record | Self::RecordMany => ("insert", "_events", 1),
            Self::Intent => ("insert", "_events_batches", 1),
            Self::Claim => ("update", "_events", 1),
            Self::Sum => ("aggregate", "_events", 2),
            Self::Apply => ("update", "", 1),
            Self::Mark => ("update", "_events", 2),
            Self::Done => ("delete", "_events_batches", 1),
        }
    }
}

/// The table: the same with `retryWrites=true` or `false` in the URI,
/// because tally owns its retries (the driver's are off on its client).
fn expected(site: Site, fault: Fault) -> Expected {
    use Fault::*;
    use Site::*;
    let (outcome, sent, reached) = match (site, fault) {
        // A lost reply: the retry's duplicate key names our own token.
        (Record, ReplyDropped | DelayedPastTimeout | Delayed) => ("recorded", 2, 2),
        (Record, ClosedBeforeForwarding | NotPrimary) => ("recorded", 2, 1),
        (Record, CommandError) => ("not_recorded", 1, 0),
        (RecordMany, ReplyDropped | DelayedPastTimeout | Delayed) => {
            ("recorded recorded recorded", 2, 2)
        }
        (RecordMany, ClosedBeforeForwarding | NotPrimary) => ("recorded recorded recorded", 2, 1),
        (RecordMany, CommandError) => ("not_recorded not_recorded not_recorded", 1, 0),
        // The intent: an insert retried once; a duplicate key on the retry
        // is our own first attempt. A refused intent stops the pass before
        // the claim.
        (Intent, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Intent, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Intent, CommandError) => ("failed (command)", 1, 0),
        // The claim is retried with the same batch; a retry after a lost
        // reply matches nothing (every id is claimed) and the pass goes on.
        (Claim, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Claim, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Claim, CommandError) => ("failed (command)", 1, 0),
        // The sum is a read, retried once.
        (Sum, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Sum, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Sum, CommandError) => ("failed (command)", 1, 0),
        // The apply is a lane update (the counts include the other
        // counter's one update): retried, a lost reply's retry collides
        // with the upsert that landed, and the update sent again finds the
        // lane holding the number. A refused one leaves the batch to
        // recovery.
        (Apply, ReplyDropped | DelayedPastTimeout) => ("folded 3", 4, 4),
        (Apply, Delayed) => ("folded 3", 3, 3),
        (Apply, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 3, 2),
        (Apply, CommandError) => ("failed (command)", 2, 1),
        // The mark's retry after a lost reply marks nothing more: the pass
        // reports only what its own reply said (the events are folded).
        (Mark, ReplyDropped | DelayedPastTimeout) => ("folded 0", 2, 2),
        (Mark, Delayed) => ("folded 3", 2, 2),
        (Mark, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Mark, CommandError) => ("failed (command)", 1, 0),
        (Done, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Done, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Done, CommandError) => ("failed (command)", 1, 0),
        (_, DuplicateKey) => unreachable!("not injected at the ledger"),
    };
    Expected {
        outcome,
        sent,
        reached,
    }
}

/// The matrix's rig, with the ledger's cells.
struct LedgerRig {
    rig: Rig,
    /// `retryWrites` in the URI.
    retry_writes: bool,
}

impl LedgerRig {
    async fn new(name: &str, retry_writes: bool) -> Self {
        let rig = Rig::new(name, retry_writes).await;
        Self { rig, retry_writes }
    }

    /// Runs every cell; panics listing every cell that disagrees.
    async fn run_matrix(&self) {
        let mut failures = String::new();
        for site in SITES {
            for fault in FAULTS {
                if let Err(diff) = self.run_cell(site, fault).await {
                    let _ = writeln!(failures, "{site:?} × {fault:?}: {diff}");
                }
            }
        }
        assert!(
            failures.is_empty(),
            "ledger fault matrix (retryWrites={} in the URI):\n{failures}",
            self.retry_writes
        );
    }

    async fn run_cell(&self, site: Site, fault: Fault) -> Result<(), String> {
        let name = format!("l_{site:?}_{fault:?}").to_lowercase();
        let direct = Ledger::new(&self.rig.direct.store(), CollectionConfig::new(&name));
        direct
            .create_indexes(RETENTION)
            .await
            .map_err(|e| format!("indexes: {e}"))?;
        let (command, suffix, nth) = site.target();
        let faulted = format!("{name}{suffix}");
        self.rig.proxy.clear_log();
        let rule = self.rig.proxy.rule(
            Rule::command(command)
                .collection(&faulted)
                .nth(nth)
                .then(fault.action(false)),
        );
        let mut diff = Vec::new();
        match site {
            Site::Record | Site::RecordMany => {
                let (outcome, recorded) = self.record(site, &name).await;
                drop(rule);
                let log = settled_log(&self.rig.proxy, &faulted).await;
                let landed = landed_events(&log);
                // What the outcomes promise, against the log.
                for key in &recorded {
                    if !landed.contains(key) {
                        diff.push(format!(
                            "{key} recorded, its insert never reached the server"
                        ));
                    }
                }
                self.final_fold(&name).await?;
                let want = sums(EVENTS.iter().filter(|(k, _, _)| landed.contains(*k)));
                self.check_counters(&name, &direct, &want, &mut diff).await;
                self.check_counts(site, fault, &log, &outcome, &mut diff);
            }
            _ => {
                for (key, counter, amount) in EVENTS {
                    let recording = direct.record(key, counter, amount).await;
                    if recording.name() != "recorded" {
                        return Err(format!("seeding {key}: {recording:?}"));
                    }
                }
                let fold = EventFold::new(
                    &self.rig.store,
                    CollectionConfig::new(&name),
                    EventFoldSettings::default(),
                );
                let outcome = match fold
                    .fold(SystemTime::now(), &CancellationToken::new())
                    .await
                {
                    Ok(run) => format!("folded {}", run.events_folded),
                    Err(err) => format!(
                        "failed ({})",
                        err.class().map_or("not a server error", |c| c.as_str())
                    ),
                };
                drop(rule);
                let log = settled_log(&self.rig.proxy, &faulted).await;
                let mut want = sums(EVENTS.iter());
                // Exact whatever the pass left.
                self.check_values(&direct, &want, "after the faulted pass", &mut diff)
                    .await;
                // The same fold's next pass, with a new event on a counter
                // the faulted batch touches: its lane must not go on past a
                // batch it did not confirm.
                let late = direct.record("e_late", "a", 1).await;
                if late.name() != "recorded" {
                    return Err(format!("recording e_late: {late:?}"));
                }
                *want.entry("a").or_default() += 1;
                if let Err(err) = fold
                    .fold(SystemTime::now(), &CancellationToken::new())
                    .await
                {
                    diff.push(format!("the same fold's next pass: {err}"));
                }
                self.final_fold(&name).await?;
                self.check_counters(&name, &direct, &want, &mut diff).await;
                self.check_counts(site, fault, &log, &outcome, &mut diff);
            }
        }
        if diff.is_empty() {
            Ok(())
        } else {
            Err(diff.join("; "))
        }
    }

    /// The recording cells: the outcome (names, space-separated) and the
    /// keys it says are recorded.
    async fn record(&self, site: Site, name: &str) -> (String, BTreeSet<String>) {
        let ledger = Ledger::new(&self.rig.store, CollectionConfig::new(name));
        let recordings: Vec<Recording> = if site == Site::Record {
            vec![ledger.record("e1", "a", 1).await]
        } else {
            ledger.record_many(EVENTS).await
        };
        let names: Vec<&str> = recordings.iter().map(Recording::name).collect();
        let recorded = recordings
            .iter()
            .filter(|r| r.is_counted())
            .map(|r| r.event().key().to_owned())
            .collect();
        (names.join(" "), recorded)
    }

    /// A new process folds: recovery first, then every event left.
    async fn final_fold(&self, name: &str) -> Result<(), String> {
        let fold = EventFold::new(
            &self.rig.direct.store(),
            CollectionConfig::new(name),
            EventFoldSettings {
                claim_timeout: Duration::ZERO,
                ..EventFoldSettings::default()
            },
        );
        fold.fold(SystemTime::now(), &CancellationToken::new())
            .await
            .map(|_| ())
            .map_err(|e| format!("the final fold: {e}"))
    }

    async fn check_values(
        &self,
        ledger: &Ledger,
        want: &BTreeMap<&str, i64>,
        when: &str,
        diff: &mut Vec<String>,
    ) {
        for (key, n) in want {
            match ledger.value(*key).await {
                Ok(read) if read.value == *n => {}
                other => diff.push(format!("value of {key} {when}: {other:?}, expected {n}")),
            }
        }
    }

    /// After the final fold: counters, exact reads, nothing unfolded, no
    /// intent left.
    async fn check_counters(
        &self,
        name: &str,
        ledger: &Ledger,
        want: &BTreeMap<&str, i64>,
        diff: &mut Vec<String>,
    ) {
        let counters = self.rig.direct.collection(name);
        for key in ["a", "b"] {
            let n = want.get(key).copied().unwrap_or(0);
            let got = counter(&counters, key).await;
            if got != n {
                diff.push(format!("counter {key} {got}, expected {n}"));
            }
        }
        self.check_values(ledger, want, "after the final fold", diff)
            .await;
        let events = self.rig.direct.collection(&format!("{name}_events"));
        let unfolded = events
            .count_documents(doc! { "f": { "$exists": false } })
            .await
            .unwrap_or(u64::MAX);
        let intents = self
            .rig
            .direct
            .collection(&format!("{name}_events_batches"))
            .count_documents(doc! {})
            .await
            .unwrap_or(u64::MAX);
        if (unfolded, intents) != (0, 0) {
            diff.push(format!(
                "{unfolded} unfolded events, {intents} intents left"
            ));
        }
    }

    fn check_counts(
        &self,
        site: Site,
        fault: Fault,
        log: &[Exchange],
        outcome: &str,
        diff: &mut Vec<String>,
    ) {
        let (command, _, _) = site.target();
        let ours: Vec<&Exchange> = log
            .iter()
            .filter(|e| e.command.as_deref() == Some(command) && owns(site, e))
            .collect();
        let sent = ours.len();
        let reached = ours.iter().filter(|e| e.reached_server).count();
        expected(site, fault).judge(outcome, sent, reached, diff);
    }
}

/// Whether a request on the faulted collection is one of the site's: the
/// claim carries the picked ids (`$in`), the mark does not; the sum
/// matches on the batch (`c.b`).
fn owns(site: Site, exchange: &Exchange) -> bool {
    match site {
        Site::Claim => exchange.body_mentions("$in"),
        Site::Mark => !exchange.body_mentions("$in"),
        Site::Sum => exchange.body_mentions("c.b"),
        _ => true,
    }
}

/// The event keys of every `insert` that reached the server.
fn landed_events(log: &[Exchange]) -> BTreeSet<String> {
    log.iter()
        .filter(|e| e.command.as_deref() == Some("insert") && e.reached_server)
        .filter_map(|e| e.body.get_array("documents").ok())
        .flatten()
        .filter_map(Bson::as_document)
        .filter_map(|d| d.get_str("_id").ok().map(str::to_owned))
        .collect()
}

/// Each counter's sum over `events`.
fn sums<'a>(events: impl Iterator<Item = &'a (&'a str, &'a str, i64)>) -> BTreeMap<&'a str, i64> {
    let mut sums = BTreeMap::new();
    for (_, counter, amount) in events {
        *sums.entry(*counter).or_default() += amount;
    }
    sums
}

#[tokio::test]
async fn every_fault_at_every_ledger_write_and_fold_step_with_retryable_writes_off() {
    LedgerRig::new("faults_ledger", false)
        .await
        .run_matrix()
        .await;
}

#[tokio::test]
async fn every_fault_at_every_ledger_write_and_fold_step_with_retryable_writes_on() {
    LedgerRig::new("faults_ledger_retry_on", true)
        .await
        .run_matrix()
        .await;
}

/// The first `insert` is held up in the network (its attempt runs out of
/// time), tally retries, and the server refuses the retry with a command
/// error. The held first insert lands afterwards: no recording may say
/// `not_recorded`; `record` and `record_many` say `unknown`.
#[tokio::test]
async fn a_retry_refused_after_its_held_first_insert_is_unknown_never_not_recorded() {
    use crate::common::proxy::{Action, Release};
    let rig = LedgerRig::new("ledger_driver_retry_refused", true).await;
    for many in [false, true] {
        let name = if many { "many" } else { "one" };
        let events = format!("{name}_events");
        let direct = Ledger::new(&rig.rig.direct.store(), CollectionConfig::new(name));
        direct.create_indexes(RETENTION).await.unwrap();
        let rules = [
            rig.rig.proxy.rule(
                Rule::command("insert")
                    .collection(&events)
                    .nth(1)
                    .then(Action::HoldRequest(Release::WhenReleased)),
            ),
            rig.rig.proxy.rule(
                Rule::command("insert")
                    .collection(&events)
                    .nth(2)
                    .then(Action::error(2, "BadValue", &[])),
            ),
        ];
        let ledger = Ledger::new(&rig.rig.store, CollectionConfig::new(name));
        let recordings = if many {
            ledger.record_many(EVENTS).await
        } else {
            vec![ledger.record("e1", "a", 1).await]
        };
        drop(rules);
        let log = settled_log(&rig.rig.proxy, &events).await;
        let landed = landed_events(&log);
        let told: Vec<&str> = recordings.iter().map(Recording::name).collect();
        eprintln!("{name}: told {told:?}, landed {landed:?}");
        for recording in &recordings {
            assert!(
                !(recording.name() == "not_recorded" && landed.contains(recording.event().key())),
                "{name}: told {recording:?}, but its held first insert landed"
            );
        }
    }
}
