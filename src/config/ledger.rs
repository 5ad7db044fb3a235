//! The ledgers' checks, once every section has been read:
//!
//! - **names**: an events collection holds one ledger's events and nothing
//!   else, and its fold state (`<events>_fold`) likewise. Two ledgers
//!   sharing one would count one's events on the other's counters; an
//!   events collection that is a counter collection would have the fold
//!   read counters as events; one that is the daemon's state collection or
//!   the sequences' mixes tally's own documents in. Each is refused under
//!   the key that names it last. An events collection must also name its
//!   fold lane (`fold:<events>`, at most 128 bytes).
//! - **the dedupe window's floor**: `event_retention` must be at least the
//!   writers' `retry_horizon` plus one `attempt_timeout` plus an hour for
//!   recorders' clocks: an event sent again within the horizon must find
//!   its key still remembered, or it would be recorded and counted twice.

use std::collections::HashMap;

use humantime::format_duration;

use super::Config;
use super::field::Issues;
use crate::ledger::{RETENTION_MARGIN, retention_floor};
use crate::ledger::{fold_lane, state};

/// Checks every ledger of `config`.
pub(super) fn check(config: &Config, issues: &mut Issues) {
    check_names(config, issues);
    check_retention(config, issues);
}

/// What a collection name is already used for, and under which key.
struct Use {
    key: String,
    what: String,
}

fn check_names(config: &Config, issues: &mut Issues) {
    // What every name is used for besides the ledgers (these may share
    // among themselves: not the ledgers' business).
    let mut used: HashMap<String, Use> = HashMap::new();
    let mut others = vec![
        (
            config.daemon.state_collection.clone(),
            "daemon.state_collection".to_owned(),
            "the daemon's state collection".to_owned(),
        ),
        (
            config.sequences.collection.clone(),
            "sequences.collection".to_owned(),
            "the sequences' collection".to_owned(),
        ),
    ];
    for (i, spec) in config.collections.iter().enumerate() {
        others.insert(
            i,
            (
                spec.name.clone(),
                format!("collections[{i}].name"),
                "a counter collection".to_owned(),
            ),
        );
    }
    for (name, key, what) in others {
        used.entry(name).or_insert(Use { key, what });
    }
    for (i, spec) in config.collections.iter().enumerate() {
        if spec.events_collection.is_none() {
            continue;
        }
        let events = spec.events_collection_name();
        let key = format!("collections[{i}].events_collection");
        if let Err(err) = fold_lane(&events) {
            issues.push(&key, err.to_string());
        }
        let fold_state = state::collection_name(&events);
        for (name, what) in [
            (events, format!("the events collection of {:?}", spec.name)),
            (
                fold_state,
                format!("the fold state of {:?}'s ledger", spec.name),
            ),
        ] {
            match used.get(&name) {
                Some(first) if !issues.has(&key) => issues.push(
                    &key,
                    format!(
                        "{name:?} is already {} ({}): a ledger's events and its fold state \
                         ({name:?} and \"<events>_fold\") each need a collection of their own; \
                         name another",
                        first.what, first.key
                    ),
                ),
                Some(_) => {}
                None => {
                    used.insert(
                        name,
                        Use {
                            key: key.clone(),
                            what,
                        },
                    );
                }
            }
        }
    }
}

fn check_retention(config: &Config, issues: &mut Issues) {
    let involved = [
        "reconcile.event_retention",
        "writer.retry_horizon",
        "mongodb.attempt_timeout",
    ];
    if involved.iter().any(|key| issues.has(key)) {
        return;
    }
    let horizon = config.writer.retry_horizon;
    let attempt = config.mongodb.attempt_timeout;
    let floor = retention_floor(horizon, attempt);
    if config.reconcile.event_retention < floor {
        issues.push(
            "reconcile.event_retention",
            format!(
                "must be at least writer.retry_horizon + mongodb.attempt_timeout + {} ({} + {} + \
                 {} = {}): an event sent again just inside the horizon must find its key still \
                 remembered, or it would be recorded and counted twice",
                format_duration(RETENTION_MARGIN),
                format_duration(horizon),
                format_duration(attempt),
                format_duration(RETENTION_MARGIN),
                format_duration(floor)
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;

    const HEAD: &str = "[mongodb]\nuri = \"mongodb://h/\"\ndatabase = \"app\"\n";

    /// The keys `text`'s configuration is refused under, with their
    /// messages.
    fn refused(text: &str) -> Vec<(String, String)> {
        match Config::from_toml(&format!("{HEAD}{text}"), []) {
            Ok(_) => Vec::new(),
            Err(errors) => errors
                .issues
                .into_iter()
                .map(|i| (i.key, i.message))
                .collect(),
        }
    }

    #[test]
    fn an_events_collection_is_one_ledgers_alone() {
        let cases = [
            // Two ledgers, one events collection.
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"log\"\n\
                 [[collections]]\nname = \"b\"\nevents_collection = \"log\"\n",
                "collections[1].events_collection",
                "the events collection of \"a\"",
            ),
            // A counter collection, its own or another's.
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"a\"\n",
                "collections[0].events_collection",
                "a counter collection",
            ),
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"b\"\n\
                 [[collections]]\nname = \"b\"\n",
                "collections[0].events_collection",
                "a counter collection",
            ),
            // tally's own collections.
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"tally_state\"\n",
                "collections[0].events_collection",
                "the daemon's state collection",
            ),
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"counters\"\n",
                "collections[0].events_collection",
                "the sequences' collection",
            ),
            // Another ledger's fold state, and a fold state that is a
            // counter collection.
            (
                "[[collections]]\nname = \"a\"\nledger = true\n\
                 [[collections]]\nname = \"b\"\nevents_collection = \"a_events_fold\"\n",
                "collections[1].events_collection",
                "the fold state of \"a\"'s ledger",
            ),
            (
                "[[collections]]\nname = \"a\"\nevents_collection = \"x\"\n\
                 [[collections]]\nname = \"x_fold\"\n",
                "collections[0].events_collection",
                "a counter collection",
            ),
        ];
        for (text, key, what) in cases {
            let issues = refused(text);
            assert!(
                issues
                    .iter()
                    .any(|(k, m)| k == key && m.contains(what) && !m.contains("  ")),
                "{text}: {issues:?}"
            );
        }
        // One ledger each, under default and chosen names: fine.
        assert!(
            refused(
                "[[collections]]\nname = \"a\"\nledger = true\n[[collections]]\nname = \"b\"\n\
                 events_collection = \"b_log\"\n[[collections]]\nname = \"c\"\n"
            )
            .is_empty()
        );
    }

    #[test]
    fn an_events_collection_must_name_its_fold_lane() {
        let long = "e".repeat(130);
        let issues = refused(&format!(
            "[[collections]]\nname = \"a\"\nevents_collection = \"{long}\"\n"
        ));
        assert!(
            issues
                .iter()
                .any(|(k, m)| k == "collections[0].events_collection" && m.contains("fold lane")),
            "{issues:?}"
        );
    }

    #[test]
    fn the_dedupe_window_has_a_floor_naming_the_keys_it_comes_from() {
        let issues = refused("[reconcile]\nevent_retention = \"1h\"\n");
        let (key, message) = &issues[0];
        assert_eq!(key, "reconcile.event_retention");
        assert!(
            message.contains("writer.retry_horizon + mongodb.attempt_timeout + 1h")
                && message.contains("3m + 1m + 1h = 1h 4m"),
            "{message}"
        );
        assert!(refused("[reconcile]\nevent_retention = \"1h 4m\"\n").is_empty());
    }
}
