//! The events ledger in the history: one client records events through the
//! same faulting proxy while the other clients run — half of them each on a
//! fresh handle (a one-shot recorder: a lane per event), a share of them
//! twice (a redelivery, on another handle) — and a fold runs beside them.
//! At the end the network heals, every unknown recording is sent again, the
//! fold runs until nothing waits, and the outcomes are judged against the
//! events collection (what landed) and the counters: an event said
//! recorded or duplicate is in the log once, one said not recorded is not,
//! and every counter holds exactly its logged events' amounts.

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use tally::{
    CollectionConfig, EventFold, EventFoldSettings, EventTicket, Ledger, Recording, Store,
};
use tokio_util::sync::CancellationToken;

/// The ledger's counter collection.
pub const COLLECTION: &str = "ledger_views";
const KEYS: [&str; 3] = ["e0", "e1", "e2"];

/// What the ledger client was told.
#[derive(Default, Debug)]
pub struct Told {
    /// Event key → (counter key, amount) for every event attempted.
    pub attempted: BTreeMap<String, (String, i64)>,
    /// Events told recorded or duplicate.
    pub counted: BTreeMap<String, u32>,
    /// Events told not recorded (by every attempt).
    pub not_recorded: Vec<String>,
    /// Unknown recordings, to send again.
    pub tickets: Vec<EventTicket>,
    pub one_shot: u64,
    pub repeats: u64,
}

fn spec() -> CollectionConfig {
    CollectionConfig::new(COLLECTION)
}

/// Records events until `until`: each on a fresh handle half the time, a
/// fifth of them again later.
pub async fn record_events(store: Store, until: Instant, mut rng: fastrand::Rng) -> Told {
    let mut told = Told::default();
    let long_lived = Ledger::new(&store, spec());
    let mut again = Vec::new();
    let mut i = 0u64;
    while Instant::now() < until {
        let (event, key, amount) = match again.pop() {
            Some(repeat) if rng.bool() => {
                told.repeats += 1;
                repeat
            }
            other => {
                again.extend(other);
                i += 1;
                let key = KEYS[rng.usize(..KEYS.len())].to_owned();
                (format!("ev{i}"), key, rng.i64(1..4))
            }
        };
        told.attempted.insert(event.clone(), (key.clone(), amount));
        let ledger = if rng.bool() {
            told.one_shot += 1;
            Ledger::new(&store, spec())
        } else {
            long_lived.clone()
        };
        let recording = ledger.record(event.clone(), key.as_str(), amount).await;
        judge(&mut told, recording);
        if rng.u8(..5) == 0 {
            again.push((event, key, amount));
        }
    }
    told
}

fn judge(told: &mut Told, recording: Recording) {
    let event = recording.event().key().to_owned();
    match recording {
        Recording::Recorded(_) | Recording::Duplicate(_) => {
            *told.counted.entry(event).or_default() += 1;
        }
        Recording::Unknown(ticket) => told.tickets.push(ticket),
        Recording::NotRecorded(_) => told.not_recorded.push(event),
        Recording::Conflict(conflict) => panic!("a repeat of the same event conflicts: {conflict}"),
    }
}

/// Heals: every unknown recording sent again (directly), then the fold
/// until nothing waits.
pub async fn settle_and_fold(direct: &Store, told: &mut Told) {
    let ledger = Ledger::new(direct, spec());
    for ticket in std::mem::take(&mut told.tickets) {
        let again = ledger
            .record_again(ticket)
            .await
            .expect("every ticket within the retry horizon");
        assert!(
            matches!(again, Recording::Recorded(_) | Recording::Duplicate(_)),
            "a ticket sent again on a healed network: {again:?}"
        );
        judge(told, again);
    }
    let fold = EventFold::new(direct, spec(), EventFoldSettings::default());
    let stop = CancellationToken::new();
    for _ in 0..20 {
        let run = fold
            .fold(SystemTime::now(), &stop)
            .await
            .expect("the final fold");
        if !run.busy && run.backlog.events == 0 && run.backlog.held.is_empty() {
            return;
        }
    }
    panic!("the ledger's fold did not drain after the calls ended");
}

/// Every way the outcomes and the counters disagree with the log.
pub async fn violations(direct: &Store, told: &Told) -> Vec<String> {
    let logged: Vec<Document> = direct
        .collection(&format!("{COLLECTION}_events"))
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut found = Vec::new();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let in_log: BTreeMap<String, (String, i64)> = logged
        .iter()
        .map(|d| {
            let id = d.get_str("_id").unwrap().to_owned();
            let key = d.get_str("k").unwrap().to_owned();
            let amount = super::integer(d.get("n"))
                .unwrap_or_else(|| panic!("{id}: amount {:?}", d.get("n")));
            (id, (key, amount))
        })
        .collect();
    for (event, (key, amount)) in &in_log {
        *expected.entry(key.clone()).or_default() += amount;
        if !told.counted.contains_key(event) {
            found.push(format!(
                "{event} is in the log but no caller was told it counted"
            ));
        }
        if told.attempted.get(event) != Some(&(key.clone(), *amount)) {
            found.push(format!(
                "{event} is logged as ({key}, {amount}), not as attempted"
            ));
        }
    }
    for event in told.counted.keys() {
        if !in_log.contains_key(event) {
            found.push(format!("{event} was told counted but is not in the log"));
        }
    }
    for event in &told.not_recorded {
        if in_log.contains_key(event) && !told.counted.contains_key(event) {
            found.push(format!("{event} was told not recorded but is in the log"));
        }
    }
    let counters: Vec<Document> = direct
        .collection(COLLECTION)
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    for key in KEYS {
        let held = counters
            .iter()
            .find(|d| d.get_str("_id").ok() == Some(key))
            .and_then(|d| super::integer(d.get("counter")))
            .unwrap_or(0);
        let want = expected.get(key).copied().unwrap_or(0);
        if held != want {
            found.push(format!(
                "counter {key} holds {held}, its logged events add up to {want}"
            ));
        }
    }
    found
}
