//! The ledger's rows of the fault matrix: every fault the
//! proxy injects — reply lost, connection cut, reply past the attempt
//! timeout, not-primary, a command error, a request held up in the network
//! and forwarded after the operation returned — at `Ledger::record` (its
//! insert), at `Ledger::record_many`, at `Ledger::record_at` of a bucketed
//! collection, at each read and write of a fold pass (the `getMore` of the
//! change stream it reads its window from, the intent, a counter's update
//! through the fold lane, the commit) and at an exact read's stream (its
//! `aggregate` and its `getMore`), with `retryWrites` in the URI off and
//! on: tally owns its retries (the driver's are off on its client), so
//! both give one table.
//!
//! Each cell asserts:
//! - the outcome the caller sees (the table in [`expected`]);
//! - how many requests of the faulted kind were sent and reached the
//!   server (the proxy's log; for a stream's `getMore`, how often the
//!   stream was opened: a stream cut is resumed by opening it again);
//! - for the recordings: every event the outcome says is recorded, and no
//!   other, is in the counters after a final fold, and what is there is
//!   exactly the events whose `insert` reached the server (the log);
//! - for the fold: the exact value of every counter right after the
//!   faulted pass (`Ledger::value`), and after the same fold's next pass
//!   and a new process's, every counter equal to its distinct events,
//!   nothing unfolded, no pass left in progress, no sum held;
//! - for an exact read: the value it answers (never a wrong one), a read
//!   after it exact, and the same end state after a final fold.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::SystemTime;

use mongodb::bson::{Bson, doc};
use tally::{
    BucketWidth, Buckets, CollectionConfig, EventFold, EventFoldSettings, Ledger, Recording,
};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::common::counter;
use crate::common::proxy::{Exchange, Rule};
use crate::faults::{Expected, Fault, Rig, settled_log};

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
    /// `Ledger::record_many` of three events (one ordered `insert`).
    RecordMany,
    /// The pass's read of its window: the first `getMore` of the change
    /// stream of the events collection the fold keeps open.
    PassGetMore,
    /// The pass's intent: the fold state's `update` that records it,
    /// conditioned on no pass being in progress (`$exists`).
    Intent,
    /// A counter's update through the fold lane (the first `update` on the
    /// counters).
    Apply,
    /// The commit (the `update` of the fold state that drops the intent).
    Commit,
    /// An exact read's stream of its counter's inserts after the fold's
    /// position: its `aggregate` (the `$changeStream` resumed after the
    /// position, filtered by counter).
    ReadOpen,
    /// That stream's first `getMore`.
    ReadGetMore,
    /// `Ledger::record_at` in an hour-bucketed collection (one `insert`):
    /// the event counts on `a`'s `{k, t}` document of the hour.
    BucketedRecord,
}

const SITES: [Site; 9] = [
    Site::Record,
    Site::BucketedRecord,
    Site::RecordMany,
    Site::PassGetMore,
    Site::Intent,
    Site::Apply,
    Site::Commit,
    Site::ReadOpen,
    Site::ReadGetMore,
];

impl Site {
    /// The faulted command, the collection (by suffix of the cell's name)
    /// and which of its requests.
    fn target(self) -> (&'static str, &'static str, u64) {
        match self {
            Self::Record | Self::RecordMany | Self::BucketedRecord => ("insert", "_events", 1),
            Self::PassGetMore | Self::ReadGetMore => ("getMore", "_events", 1),
            Self::Intent | Self::Commit => ("update", "_events_fold", 1),
            Self::Apply => ("update", "", 1),
            Self::ReadOpen => ("aggregate", "_events", 1),
        }
    }

    /// The matcher of the faulted request.
    fn rule(self, name: &str) -> crate::common::proxy::Matcher {
        let (command, suffix, nth) = self.target();
        let matcher = Rule::command(command).collection(&format!("{name}{suffix}"));
        match self {
            // The intent is conditioned on no pass in progress; the commit
            // drops the intent.
            Self::Intent => matcher.mentions("$exists").nth(nth),
            Self::Commit => matcher.mentions("$unset").nth(nth),
            // The read's own stream, from the fold's position (a stream
            // opened for where the log stands now resumes after nothing).
            Self::ReadOpen => matcher.mentions("resumeAfter").nth(nth),
            _ => matcher.nth(nth),
        }
    }

    /// The requests a cell counts (sent, reached): the faulted kind's —
    /// for a stream's `getMore`, the opens of that stream (a stream cut is
    /// opened again, resumed from its last token).
    fn counts(self, exchange: &Exchange) -> bool {
        let command = exchange.command.as_deref();
        match self {
            // The stream from a position (the fold's, the read's), and
            // each resume of it (from its last token), never a stream
            // opened for where the log stands now.
            Self::PassGetMore | Self::ReadOpen | Self::ReadGetMore => {
                command == Some("aggregate") && exchange.body_mentions("resumeAfter")
            }
            Self::Intent => command == Some("update") && exchange.body_mentions("$exists"),
            Self::Commit => command == Some("update") && exchange.body_mentions("$unset"),
            _ => command == Some(self.target().0),
        }
    }
}

/// The table: the same with `retryWrites=true` or `false` in the URI,
/// because tally owns its retries (the driver's are off on its client).
fn expected(site: Site, fault: Fault) -> Expected {
    use Fault::*;
    use Site::*;
    let (outcome, sent, reached) = match (site, fault) {
        // A lost reply: the retry's duplicate key names our own lane and
        // number. A bucketed event is the same insert, another counter.
        (Record | BucketedRecord, ReplyDropped | DelayedPastTimeout | Delayed) => {
            ("recorded", 2, 2)
        }
        (Record | BucketedRecord, ClosedBeforeForwarding | NotPrimary) => ("recorded", 2, 1),
        (Record | BucketedRecord, CommandError) => ("not_recorded", 1, 0),
        (RecordMany, ReplyDropped | DelayedPastTimeout | Delayed) => {
            ("recorded recorded recorded", 2, 2)
        }
        (RecordMany, ClosedBeforeForwarding | NotPrimary) => ("recorded recorded recorded", 2, 1),
        (RecordMany, CommandError) => ("not_recorded not_recorded not_recorded", 1, 0),
        // The pass's read of its window from the stream the fold keeps
        // open (counted: the stream's opens during the pass). A cut — the
        // reply lost, the connection closed, the request held up — is
        // resumed by the driver from the stream's last token, once, and
        // the pass folds. An answer past the attempt timeout, or an error
        // the driver does not resume on, fails the pass; the same fold's
        // next pass reads on from the same position (checked below).
        (PassGetMore, ReplyDropped | ClosedBeforeForwarding | Delayed) => ("folded 3", 1, 1),
        (PassGetMore, DelayedPastTimeout | NotPrimary) => ("failed (transient)", 0, 0),
        (PassGetMore, CommandError) => ("failed (command)", 0, 0),
        // The intent: an update retried once; the retry matches nothing
        // when the first attempt applied, and the state read back shows
        // the intent ours.
        (Intent, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Intent, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Intent, CommandError) => ("failed (command)", 1, 0),
        // The apply is one `update` command carrying both counters' lane
        // updates, retried once. A lost reply's retry collides on both
        // (`_id`): each is sent again alone, collides again, and the
        // lane's entry read back holds the pass (1 + 1 + 2 × 2). A command
        // error on the whole command refuses neither counter: each is sent
        // alone and counted (a counter's own refusal, a write error of its
        // statement, holds its sum: `ledger::fold`'s held tests).
        (Apply, ReplyDropped | DelayedPastTimeout) => ("folded 3", 6, 6),
        (Apply, Delayed) => ("folded 3", 2, 2),
        (Apply, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Apply, CommandError) => ("folded 3", 3, 2),
        // The commit is conditioned on the intent being ours: a retry after
        // a lost reply matches nothing, and the state read back shows the
        // pass committed.
        (Commit, ReplyDropped | DelayedPastTimeout | Delayed) => ("folded 3", 2, 2),
        (Commit, ClosedBeforeForwarding | NotPrimary) => ("folded 3", 2, 1),
        (Commit, CommandError) => ("failed (command)", 1, 0),
        // An exact read's stream from the fold's position (counted: its
        // opens). Its `aggregate` is a retryable read: lost, cut or
        // refused as not primary, it is sent once more and the read
        // answers; an answer past the attempt timeout or a command error
        // fails the read — an error, never a wrong value.
        (ReadOpen, ReplyDropped | Delayed) => ("read 4", 2, 2),
        (ReadOpen, ClosedBeforeForwarding | NotPrimary) => ("read 4", 2, 1),
        (ReadOpen, DelayedPastTimeout) => ("failed (transient)", 1, 1),
        (ReadOpen, CommandError) => ("failed (command)", 1, 0),
        // Its `getMore`, as the pass's: a cut is resumed (a second open,
        // after the last event read), anything else fails the read.
        (ReadGetMore, ReplyDropped | ClosedBeforeForwarding | Delayed) => ("read 4", 2, 2),
        (ReadGetMore, DelayedPastTimeout | NotPrimary) => ("failed (transient)", 1, 1),
        (ReadGetMore, CommandError) => ("failed (command)", 1, 1),
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
            .create_indexes()
            .await
            .map_err(|e| format!("indexes: {e}"))?;
        let (_, suffix, _) = site.target();
        let faulted = format!("{name}{suffix}");
        // The fault, from the moment the cell's operation begins.
        let fault_now = || {
            self.rig.proxy.clear_log();
            self.rig
                .proxy
                .rule(site.rule(&name).then(fault.action(false)))
        };
        let mut diff = Vec::new();
        match site {
            Site::BucketedRecord => {
                // Taken once: the hour may turn while the cell runs.
                let hour = hour_start();
                let rule = fault_now();
                let (outcome, recorded) = self.record(site, &name, hour).await;
                drop(rule);
                let log = settled_log(&self.rig.proxy, &faulted).await;
                let landed = landed_events(&log);
                if let Some(key) = recorded.iter().find(|key| !landed.contains(*key)) {
                    diff.push(format!(
                        "{key} recorded, its insert never reached the server"
                    ));
                }
                self.final_fold(&name).await?;
                // What landed counts once, on the hour's document alone.
                let counters = self.rig.direct.collection(&name);
                let want = i64::from(landed.contains("e1"));
                let (bucketed, plain) = (
                    counter(&counters, hour_of_a(hour)).await,
                    counter(&counters, "a").await,
                );
                if (bucketed, plain) != (want, 0) {
                    diff.push(format!(
                        "counters: {bucketed} in a's hour, {plain} under a; expected {want}, 0"
                    ));
                }
                self.check_counts(site, fault, &log, &outcome, &mut diff);
            }
            Site::Record | Site::RecordMany => {
                let rule = fault_now();
                let (outcome, recorded) = self.record(site, &name, hour_start()).await;
                drop(rule);
                let log = settled_log(&self.rig.proxy, &faulted).await;
                let inserts = settled_log(&self.rig.proxy, &format!("{name}_events")).await;
                let landed = landed_events(&inserts);
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
            Site::ReadOpen | Site::ReadGetMore => {
                // Folded: e1, e2, e3; after the fold's position: e4.
                self.final_fold(&name).await?;
                for (key, counter, amount) in EVENTS {
                    let recording = direct.record(key, counter, amount).await;
                    if recording.name() != "recorded" {
                        return Err(format!("seeding {key}: {recording:?}"));
                    }
                }
                self.final_fold(&name).await?;
                // e5, on another counter, after e4: the read's stream
                // reads past its last event of a (a `getMore`).
                for (key, counter) in [("e4", "a"), ("e5", "b")] {
                    let late = direct.record(key, counter, 1).await;
                    if late.name() != "recorded" {
                        return Err(format!("recording {key}: {late:?}"));
                    }
                }
                let reader = Ledger::new(&self.rig.store, CollectionConfig::new(&name));
                let rule = fault_now();
                let outcome = match reader.value("a").await {
                    Ok(read) => format!("read {}", read.value),
                    Err(err) => format!(
                        "failed ({})",
                        err.class().map_or("not a server error", |c| c.as_str())
                    ),
                };
                drop(rule);
                let log = settled_log(&self.rig.proxy, &faulted).await;
                let mut want = sums(EVENTS.iter());
                *want.entry("a").or_default() += 1;
                *want.entry("b").or_default() += 1;
                // The next read, through the same client, is exact.
                match reader.value("a").await {
                    Ok(read) if read.value == want["a"] => {}
                    other => diff.push(format!("the next read of a: {other:?}, expected 4")),
                }
                self.check_values(&direct, &want, "after the faulted read", &mut diff)
                    .await;
                self.final_fold(&name).await?;
                self.check_counters(&name, &direct, &want, &mut diff).await;
                self.check_counts(site, fault, &log, &outcome, &mut diff);
            }
            _ => {
                // A first fold, then the faulted fold's pass with nothing
                // to fold: its pass folds from a position in the log, on
                // the stream it keeps open (read by `getMore`).
                self.final_fold(&name).await?;
                let fold = EventFold::new(
                    &self.rig.store,
                    CollectionConfig::new(&name),
                    EventFoldSettings::default(),
                );
                if let Err(err) = fold
                    .fold(SystemTime::now(), &CancellationToken::new())
                    .await
                {
                    return Err(format!("the fold's first pass: {err}"));
                }
                for (key, counter, amount) in EVENTS {
                    let recording = direct.record(key, counter, amount).await;
                    if recording.name() != "recorded" {
                        return Err(format!("seeding {key}: {recording:?}"));
                    }
                }
                // The pass folds what was numbered before it began.
                let seeded = SystemTime::now();
                let rule = fault_now();
                let outcome = match fold.fold(seeded, &CancellationToken::new()).await {
                    Ok(run) if run.backlog.held.is_empty() => {
                        format!("folded {}", run.events_folded)
                    }
                    Ok(run) => format!(
                        "folded {}, {} held",
                        run.events_folded,
                        run.backlog.held.len()
                    ),
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
                // the faulted pass touches: it resumes what the pass left.
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
    /// keys it says are recorded; the bucketed cell records at `hour`.
    async fn record(&self, site: Site, name: &str, hour: SystemTime) -> (String, BTreeSet<String>) {
        let recordings: Vec<Recording> = match site {
            Site::RecordMany => {
                let ledger = Ledger::new(&self.rig.store, CollectionConfig::new(name));
                ledger.record_many(EVENTS).await
            }
            Site::BucketedRecord => {
                let hours =
                    CollectionConfig::new(name).with_buckets(Buckets::utc(BucketWidth::Hour));
                let ledger = Ledger::new(&self.rig.store, hours);
                vec![ledger.record_at("e1", "a", 1, hour).await]
            }
            _ => {
                let ledger = Ledger::new(&self.rig.store, CollectionConfig::new(name));
                vec![ledger.record("e1", "a", 1).await]
            }
        };
        let names: Vec<&str> = recordings.iter().map(Recording::name).collect();
        let recorded = recordings
            .iter()
            .filter(|r| r.is_counted())
            .map(|r| r.event().key().to_owned())
            .collect();
        (names.join(" "), recorded)
    }

    /// A new process folds every event left.
    async fn final_fold(&self, name: &str) -> Result<(), String> {
        let fold = EventFold::new(
            &self.rig.direct.store(),
            CollectionConfig::new(name),
            EventFoldSettings::default(),
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
        let fold = EventFold::new(
            &self.rig.direct.store(),
            CollectionConfig::new(name),
            EventFoldSettings::default(),
        );
        let backlog = fold.backlog(SystemTime::now()).await;
        let in_progress = self
            .rig
            .direct
            .collection(&format!("{name}_events_fold"))
            .count_documents(doc! { "intent": { "$exists": true } })
            .await
            .unwrap_or(u64::MAX);
        match backlog {
            Ok(b) if b.events == 0 && b.held.is_empty() && in_progress == 0 => {}
            other => diff.push(format!(
                "left after the final fold: {other:?}, {in_progress} passes in progress"
            )),
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
        let ours: Vec<&Exchange> = log.iter().filter(|e| site.counts(e)).collect();
        let sent = ours.len();
        let reached = ours.iter().filter(|e| e.reached_server).count();
        expected(site, fault).judge(outcome, sent, reached, diff);
    }
}

/// The start of the hour the bucketed cell records in: the current one
/// (open whenever the cell runs, as its default close_after is a day).
fn hour_start() -> SystemTime {
    Buckets::utc(BucketWidth::Hour)
        .start_of(SystemTime::now())
        .expect("an hour")
}

/// The `_id` of `a`'s counter of the hour starting at `hour`.
fn hour_of_a(hour: SystemTime) -> Bson {
    Bson::Document(doc! { "k": "a", "t": mongodb::bson::DateTime::from_system_time(hour) })
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
        direct.create_indexes().await.unwrap();
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

/// The invariant the fold stands on, under random faults: 16 callers on
/// one handle record through a proxy that drops replies, cuts connections
/// and holds inserts up in the network (until the end), while a fold runs
/// pass after pass. Unknown recordings are kept, and sent again only at
/// the end — after a last pass, and after every held insert landed. Had a
/// lane gone on after an unknown insert (instead of being retired), its
/// later events would have moved the lane's folded number past the held
/// one's, which would land below it and never be counted. In the end each
/// counter equals the events stored for it (the events collection is the
/// oracle, and every event the proxy's log shows inserted is among them),
/// nothing is left unfolded, and every event acknowledged is stored. The
/// seed (`TALLY_SOAK_SEED`) is printed.
#[tokio::test]
async fn a_lanes_events_become_visible_in_number_order_under_random_faults() {
    use crate::common::proxy::{Action, Release};
    use std::sync::{Arc, Mutex};
    let seed = crate::soak::seed("ledger visibility", 1);
    let rig = Rig::new("ledger_visibility", false).await;
    let name = "vis";
    let direct = Ledger::new(&rig.direct.store(), CollectionConfig::new(name));
    direct.create_indexes().await.unwrap();
    let events = format!("{name}_events");
    let faults = [
        (Action::DropReply, 1),
        (Action::CloseBeforeForwarding, 2),
        (Action::HoldRequest(Release::WhenReleased), 3),
    ]
    .map(|(action, salt)| {
        rig.proxy.rule(
            Rule::command("insert")
                .collection(&events)
                .probability(0.15, seed ^ salt)
                .then(action),
        )
    });
    let ledger = Ledger::new(&rig.store, CollectionConfig::new(name));
    let fold = Arc::new(EventFold::new(
        &rig.direct.store(),
        CollectionConfig::new(name),
        EventFoldSettings::default(),
    ));
    let folding = CancellationToken::new();
    let folder = {
        let (fold, folding) = (fold.clone(), folding.clone());
        tokio::spawn(async move {
            let mut passes = 0u32;
            while !folding.is_cancelled() {
                if let Ok(run) = fold
                    .fold(SystemTime::now(), &CancellationToken::new())
                    .await
                {
                    passes += u32::from(run.pass.is_some());
                }
            }
            passes
        })
    };
    let acknowledged = Arc::new(Mutex::new(BTreeSet::new()));
    let unknown = Arc::new(Mutex::new(Vec::new()));
    let callers: Vec<_> = (0..16)
        .map(|c| {
            let (ledger, acknowledged, unknown) =
                (ledger.clone(), acknowledged.clone(), unknown.clone());
            tokio::spawn(async move {
                for i in 0..25 {
                    let key = format!("c{c}e{i}");
                    let counter = format!("k{}", (c + i) % 5);
                    match ledger.record(key.as_str(), counter.as_str(), 1).await {
                        Recording::Unknown(ticket) => unknown.lock().unwrap().push(ticket),
                        recording if recording.is_counted() => {
                            acknowledged.lock().unwrap().insert(key);
                        }
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    folding.cancel();
    let passes = folder.await.unwrap();
    drop(faults);
    // The lanes' folded numbers move past everything visible now; then the
    // held inserts land, then the unknown ones are sent again.
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .unwrap();
    let log = settled_log(&rig.proxy, &events).await;
    let tickets = std::mem::take(&mut *unknown.lock().unwrap());
    let resumed = tickets.len();
    for ticket in tickets {
        let key = ticket.event().key().to_owned();
        let recording = ledger.record_again(ticket).await.expect("in the horizon");
        assert!(recording.is_counted(), "seed {seed}: {recording:?}");
        acknowledged.lock().unwrap().insert(key);
    }
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .unwrap();
    let stored: Vec<mongodb::bson::Document> = {
        use futures::TryStreamExt;
        rig.direct
            .collection(&events)
            .find(doc! {})
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap()
    };
    let stored_keys: BTreeSet<String> = stored
        .iter()
        .map(|d| d.get_str("_id").unwrap().to_owned())
        .collect();
    let landed = landed_events(&log);
    assert!(
        landed.is_subset(&stored_keys),
        "seed {seed}: an insert that landed is not stored"
    );
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert_eq!(acknowledged.len(), 400, "seed {seed}: every event settled");
    assert!(
        acknowledged.is_subset(&stored_keys),
        "seed {seed}: acknowledged, not stored"
    );
    let mut per_counter: BTreeMap<String, i64> = BTreeMap::new();
    for event in &stored {
        *per_counter
            .entry(event.get_str("k").unwrap().to_owned())
            .or_default() += 1;
    }
    for (key, n) in &per_counter {
        assert_eq!(
            counter(&rig.direct.collection(name), key.as_str()).await,
            *n,
            "seed {seed}: counter {key}: 0 lost, 0 doubled ({passes} passes during the run, \
             {resumed} unknown recordings resumed at the end)"
        );
    }
    let backlog = fold.backlog(SystemTime::now()).await.unwrap();
    assert_eq!((backlog.events, backlog.held.len()), (0, 0), "seed {seed}");
    let held = log
        .iter()
        .filter(|e| matches!(e.action, Some(Action::HoldRequest(_))))
        .count();
    eprintln!(
        "seed {seed}: {} events stored, {resumed} resumed at the end, {held} inserts held, \
         {passes} passes",
        stored.len()
    );
    assert!(resumed >= 1 && held >= 1, "seed {seed}: too few faults");
}
