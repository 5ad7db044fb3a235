//! The events ledger against a real server, one file per guarantee: an event recorded
//! twice is counted once, a reused key is a conflict, a lost reply is told
//! apart from a duplicate by the lane and number it was sent with, one
//! handle's concurrent callers share inserts, the fold puts every recorded
//! event into its counter once — whatever step it crashes after — without
//! ever writing an event, and exact reads stay exact while it folds.
//!
//! The oracle is the set of distinct event keys the test recorded (each
//! with its amount) and what is stored, never what the code under test
//! reports.
//!
//! - `duplicates`: an event is counted once — a duplicate is told apart,
//!   a reused key is a conflict, whatever type or shape its counter key;
//! - `recording`: what `record`, `record_again` and `record_many` tell the
//!   caller (recorded, duplicate, unknown, not recorded) and their tickets;
//! - `fold`: the fold's passes — every event once, recovered whatever step
//!   a pass stops after, held sums, two folds at once, a lost state, one
//!   counter or ledger never stopping the others;
//! - `reads`: exact reads, exact while the fold runs;
//! - `late`: inserts that land late (held up in the network past a pass,
//!   from recorders whose clocks are minutes off) are counted once;
//! - `ddl`: after `tallyd setup`, nothing the ledger does sends DDL;
//! - `lost_log`: a fold whose position left the oplog stops and alerts,
//!   and `tallyd fold-from` folds again, naming the uncertain events;
//! - `confirmed`: "recorded" only once a majority read confirms it;
//! - `cost`: what the ledger costs follows the work, not the recorders;
//! - `upgrade`: a fold state of tally 0.2.0 converted;
//! - `retention`: what the ledger leaves behind and when it goes;
//! - `faults`: the ledger's rows of the fault matrix;
//! - `soak`: recorder processes and a daemon killed with -9;
//! - `daemon`: the daemon's continuous fold and its metrics;
//! - `workloads`: an operator's workloads through the binaries — the
//!   daemon folding a 30,000-event `record --from` stream (also across a
//!   server restart), two `reconcile` loops racing it — every stored event
//!   counted once, nothing refused;
//! - `cli`: `tallyd setup`, `record`, `get`, `status`, `doctor` and
//!   `check-config` on a ledger.
//!
//! Here: the helpers they share.

mod batch;
mod cli;
mod confirmed;
mod cost;
mod daemon;
mod ddl;
mod duplicates;
mod faults;
mod fold;
mod late;
mod lost_log;
mod reads;
mod recording;
mod retention;
mod review;
mod soak;
mod upgrade;
mod workloads;

use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use tally::{CollectionConfig, EventFold, EventFoldSettings, Ledger, Reconciler, Recording, Store};
use tokio_util::sync::CancellationToken;

use crate::common::TestContext;
use crate::common::proxy::{Proxy, upstream_of};

pub(crate) async fn ledger_on(store: &Store, name: &str) -> Ledger {
    let ledger = Ledger::new(store, CollectionConfig::new(name));
    ledger
        .create_indexes()
        .await
        .expect("create the ledger's indexes");
    ledger
}

/// A proxy to the test server, and a ledger of `views` (its indexes made
/// directly) that reaches the server through it.
pub(crate) async fn ledger_through_proxy(ctx: &TestContext) -> (Proxy, Ledger) {
    let proxy = Proxy::start(&upstream_of(&ctx.uri).await).await;
    let through = ctx.client_through(&proxy, false).await;
    let spec = ledger_on(&ctx.client(false).await.store(), "views")
        .await
        .spec()
        .clone();
    (proxy, Ledger::new(&through.store(), spec))
}

pub(crate) fn fold_of(store: &Store, name: &str) -> EventFold {
    EventFold::new(
        store,
        CollectionConfig::new(name),
        EventFoldSettings::default(),
    )
}

/// Records `events` events of 1, `e0…`, spread over the counters `c0…`
/// (`counters` of them, round robin), each `recorded`.
pub(crate) async fn record_spread(ledger: &Ledger, events: usize, counters: usize) {
    let events: Vec<(String, String, i64)> = (0..events)
        .map(|i| (format!("e{i}"), format!("c{}", i % counters), 1))
        .collect();
    for recording in ledger.record_many(events).await {
        assert_outcome(&recording, "recorded");
    }
}

pub(crate) async fn fold_all(fold: &EventFold) -> tally::EventsRun {
    fold.fold(SystemTime::now(), &CancellationToken::new())
        .await
        .expect("fold")
}

/// Events not in their counters yet (the fold's backlog).
pub(crate) async fn unfolded(fold: &EventFold) -> u64 {
    fold.backlog(SystemTime::now())
        .await
        .expect("backlog")
        .events
}

/// Every document of `collection`, by `_id`.
pub(crate) async fn documents(store: &Store, collection: &str) -> Vec<Document> {
    store
        .collection(collection)
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

#[track_caller]
pub(crate) fn assert_outcome(recording: &Recording, name: &str) {
    assert_eq!(recording.name(), name, "{recording:?}");
}

/// Whether libfaketime's `faketime` is installed (scripts/install-test-server
/// installs it where it can): asked once per test process.
pub(crate) fn faketime_installed() -> bool {
    static INSTALLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INSTALLED.get_or_init(|| {
        std::process::Command::new("faketime")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// `faketime`'s program, when installed (CI always has it).
#[allow(dead_code)] // the skewed-clock tests of `late` use it
fn faketime() -> Option<&'static str> {
    let found = faketime_installed();
    if !found && std::env::var_os("CI").is_some() {
        panic!("faketime is not installed: scripts/install-test-server installs it");
    }
    found.then_some("faketime")
}

/// A config with the ledger of `views` on, no fold on the schedule and no
/// periodic scan within the test's time: only the change stream folds.
pub(crate) fn config(ctx: &TestContext, extra: &str) -> String {
    ctx.config_toml(
        false,
        &format!(
            "[[collections]]\nname = \"views\"\nledger = true\n[reconcile]\nfold_delay = \
             \"200ms\"\n[schedule]\ncron = \"0 30 3 * * *\"\ncatch_up = false\n[monitor]\n\
             scan_interval = \"1h\"\n{extra}"
        ),
    )
}

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// An event as a recorder writes it (a lane of its own), numbered `s`,
/// for a test to insert by hand.
pub(crate) fn event_by_hand(
    id: &str,
    key: &str,
    n: i64,
    s: impl Into<mongodb::bson::Bson>,
) -> Document {
    doc! {
        "_id": id, "k": key, "n": n, "at": mongodb::bson::DateTime::now(),
        "L": mongodb::bson::oid::ObjectId::new(), "s": s.into(),
    }
}

/// `time` as an event's number: microseconds since the epoch.
pub(crate) fn number_of(time: SystemTime) -> i64 {
    i64::try_from(
        time.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

/// A length setting of a long test: the variable `name` (a number), else
/// `default`.
pub(crate) fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The server's clock.
async fn server_now(store: &Store) -> SystemTime {
    Reconciler::new(store)
        .server_time()
        .await
        .expect("server time")
}
