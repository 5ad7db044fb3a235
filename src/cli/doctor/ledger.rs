//! The ledgers' own check: recorded events that nothing folds.
//!
//! An events collection is one named `<collection>_events` (the default)
//! or one with a fold state collection (`<events>_fold`) beside it. One
//! that is not a configured ledger's, and that holds events not folded
//! yet, is counts that never reach their counters: `tallyd record` or an
//! application recorded into a collection without a ledger (or a ledger
//! was turned off).

use std::time::SystemTime;

use super::{Check, Verdict, ledgers};
use crate::config::Config;
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
