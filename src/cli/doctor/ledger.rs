//! The ledgers' own check: recorded events that nothing folds.
//!
//! An events collection is one named `<collection>_events` (the default)
//! or one with a fold state collection (`<events>_fold`) beside it. One
//! that is not a configured ledger's, and that holds events not folded
//! yet, is counts that never reach their counters: `tallyd record` or an
//! application recorded into a collection without a ledger (or a ledger
//! was turned off).

use std::time::{Duration, SystemTime};

use super::{Check, Verdict, ledgers};
use crate::config::Config;
use crate::error::{Error, counted, human_duration, words};
use crate::ledger::index;
use crate::ledger::{EventFold, EventFoldSettings};
use crate::store::Store;
use crate::write::counter::CollectionConfig;

/// The fold state collections' suffix.
const FOLD_SUFFIX: &str = "_fold";
/// The default events collections' suffix.
const EVENTS_SUFFIX: &str = "_events";

/// One check per events collection with a fold state that no configured
/// ledger folds: fail when it holds events not folded yet.
pub(super) async fn unfolded_elsewhere(
    store: &Store,
    config: &Config,
    now: SystemTime,
) -> Vec<Check> {
    let names = match store.database().list_collection_names().await {
        Ok(names) => names,
        Err(err) => {
            let message = format!("unknown: cannot list the collections: {err}");
            return vec![Check::new("unfolded_events", Verdict::Warn, message)];
        }
    };
    let folded: Vec<String> = ledgers(config)
        .map(CollectionConfig::events_collection_name)
        .collect();
    let mut candidates: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_suffix(FOLD_SUFFIX))
        .chain(
            names
                .iter()
                .filter(|n| n.ends_with(EVENTS_SUFFIX))
                .map(String::as_str),
        )
        .filter(|events| names.iter().any(|n| n == events) && !folded.iter().any(|f| f == events))
        .collect();
    candidates.sort_unstable();
    candidates.dedup();
    let mut checks = Vec::new();
    for events in candidates {
        // The events' counters: a configured collection whose default
        // events collection this is, else a name that says so.
        let spec = config
            .collections
            .iter()
            .find(|s| s.events_collection_name() == events)
            .cloned()
            .unwrap_or_else(|| {
                CollectionConfig::new(format!("(the counters of {events})"))
                    .with_events_collection(events)
            });
        let fold = EventFold::new(store, spec.clone(), EventFoldSettings::default());
        let (verdict, message) = match fold.backlog(now).await {
            Ok(backlog) if backlog.events == 0 && backlog.held.is_empty() => (
                Verdict::Ok,
                "no configured ledger folds it, and it holds no event waiting to be folded"
                    .to_owned(),
            ),
            Ok(backlog) => (
                Verdict::Fail,
                format!(
                    "{} recorded events (and {} held sums) wait here, but no configured ledger \
                     folds this collection: they are in no counter; turn the ledger of {} on \
                     (`ledger = true`, or `events_collection = \"{events}\"`) so the daemon folds \
                     them",
                    backlog.events,
                    backlog.held.len(),
                    spec.name
                ),
            ),
            Err(err) => (
                Verdict::Warn,
                format!("unknown: cannot read what waits to be folded: {err}"),
            ),
        };
        let has_state = names
            .iter()
            .any(|n| n.strip_suffix(FOLD_SUFFIX) == Some(events));
        if verdict == Verdict::Ok && !has_state {
            // A collection merely named like an events collection, with
            // nothing of a ledger's in it: not a ledger's business.
            continue;
        }
        checks.push(Check {
            collection: Some(events.to_owned()),
            ..Check::new("unfolded_events", verdict, message)
        });
    }
    checks
}

/// One check per configured ledger: its fold's state — stopped (fail:
/// `tallyd fold-from`), catching up, or following the change stream and
/// how far behind — and what earlier versions of tally left on its events
/// collection (an index nothing reads, the previous version's validator:
/// `tallyd setup` removes them).
pub(super) async fn folds(store: &Store, config: &Config, now: SystemTime) -> Vec<Check> {
    let mut checks = Vec::new();
    for spec in ledgers(config) {
        let events = spec.events_collection_name();
        let fold = EventFold::new(store, spec.clone(), EventFoldSettings::default());
        let (verdict, message) = match fold.backlog(now).await {
            Ok(backlog) if backlog.catching_up => (
                Verdict::Ok,
                format!(
                    "catching up from the events collection ({} to go): a first fold, an \
                     upgrade or fold-from; the daemon finishes it",
                    counted(backlog.events, "event", "events")
                ),
            ),
            Ok(backlog) => (
                Verdict::Ok,
                format!(
                    "follows the change stream, its position {} behind",
                    backlog
                        .position_age
                        .map_or_else(|| "-".to_owned(), human_duration)
                ),
            ),
            Err(err @ (Error::FoldStopped { .. } | Error::HistoryLost { .. })) => {
                (Verdict::Fail, err.to_string())
            }
            Err(err) => (
                Verdict::Warn,
                format!("unknown: cannot read the fold's state: {err}"),
            ),
        };
        checks.push(Check {
            collection: Some(events.clone()),
            ..Check::new("ledger_fold", verdict, message)
        });
        if let Some(check) = earlier_leftovers(store, &events).await {
            checks.push(check);
        }
    }
    checks
}

/// What earlier versions left on the events collection `events`, as a
/// check (`None` when nothing is there).
async fn earlier_leftovers(store: &Store, events: &str) -> Option<Check> {
    let listed = index::names(store, events).await.ok()?;
    let mut found: Vec<String> = listed
        .into_iter()
        .filter(|name| index::OBSOLETE.contains(&name.as_str()))
        .map(|name| format!("the index {name}, which nothing reads and every insert pays for"))
        .collect();
    if index::has_floor(store, events).await.unwrap_or(false) {
        found.push(
            "the previous version's validator (its floor), which refuses late inserts".to_owned(),
        );
    }
    if found.is_empty() {
        return None;
    }
    Some(Check {
        collection: Some(events.to_owned()),
        ..Check::new(
            "ledger_leftovers",
            Verdict::Warn,
            format!(
                "{} {}: run `tallyd setup`, which removes them",
                words(&found),
                if found.len() == 1 {
                    "is left"
                } else {
                    "are left"
                }
            ),
        )
    })
}

/// The oplog's window against `[reconcile] fold_outage`, when a ledger is
/// configured: a fold that stands still longer than the window cannot
/// resume its change stream (it stops, and `tallyd fold-from` folds again
/// with some counts uncertain).
pub(super) fn fold_outage(config: &Config, window: Option<Duration>) -> Option<Check> {
    ledgers(config).next()?;
    let planned = config.reconcile.fold_outage;
    let name = "fold_outage";
    let Some(window) = window else {
        return Some(Check::new(
            name,
            Verdict::Warn,
            format!(
                "unknown: the oplog's window cannot be read here (see change_stream_history), so \
                 whether a ledger's fold survives [reconcile] fold_outage ({}) cannot be told",
                human_duration(planned)
            ),
        ));
    };
    Some(if window >= planned {
        Check::new(
            name,
            Verdict::Ok,
            format!(
                "the oplog holds {} of history, at least [reconcile] fold_outage ({}): a ledger's \
                 fold stopped that long resumes where it stood",
                human_duration(window),
                human_duration(planned)
            ),
        )
    } else {
        Check::new(
            name,
            Verdict::Warn,
            format!(
                "the oplog holds {} of history, less than [reconcile] fold_outage ({}): a \
                 ledger's fold stopped longer than that cannot resume and stops (`tallyd \
                 fold-from` then folds again, with the counts near the stop uncertain); grow the \
                 oplog (replSetResizeOplog, or storage.oplogMinRetentionHours) or plan for a \
                 shorter outage (an oplog not full yet holds less than it will)",
                human_duration(window),
                human_duration(planned)
            ),
        )
    })
}
