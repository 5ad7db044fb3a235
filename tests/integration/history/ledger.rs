//! The events ledger in the history: one client records events through the
//! same faulting proxy while the other clients run — half of them each on a
//! fresh handle (a one-shot recorder: a lane per event), a share of them
//! twice (a redelivery, on another handle) — and a fold runs beside them.
//! At the end the network heals, every unknown recording is sent again, the
//! fold runs until nothing waits, and the outcomes are judged against the
//! events collection (what landed) and the counters: an event said
//! recorded or duplicate is in the log once, one said not recorded is not,
//! and every counter holds exactly its logged events' amounts.
//!
//! The ledger counts by the hour (UTC): every event carries a time — now,
//! up to two hours before, or up to two minutes ahead — and is counted in
//! its hour's `{k, t}` document; a repeat carries another time half the
//! time, and is still counted once, in the hour it was first recorded in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc};
use tally::{
    BucketWidth, Buckets, CollectionConfig, EventFold, EventFoldSettings, EventTicket, Ledger,
    Recording, Store,
};
use tokio_util::sync::CancellationToken;

/// The ledger's counter collection.
pub const COLLECTION: &str = "ledger_views";
const KEYS: [&str; 3] = ["e0", "e1", "e2"];

/// What the ledger client was told.
#[derive(Default, Debug)]
pub struct Told {
    /// Event key → (counter `_id`: its key's hour, amount) of each
    /// attempt.
    pub attempted: BTreeMap<String, Vec<(Bson, i64)>>,
    /// Events told recorded or duplicate.
    pub counted: BTreeMap<String, u32>,
    /// The counter each of those answers named (the hour the event counts
    /// in).
    pub named: Vec<(String, Bson)>,
    /// Events told not recorded (by every attempt).
    pub not_recorded: Vec<String>,
    /// Unknown recordings, to send again.
    pub tickets: Vec<EventTicket>,
    pub one_shot: u64,
    pub repeats: u64,
}

pub fn spec() -> CollectionConfig {
    CollectionConfig::new(COLLECTION).with_buckets(Buckets::utc(BucketWidth::Hour))
}

/// A time around now: now, up to two hours before, or up to two minutes
/// ahead (every hour still takes writes: `close_after` is a day).
fn draw_time(rng: &mut fastrand::Rng) -> SystemTime {
    let now = SystemTime::now();
    match rng.u8(..4) {
        0 | 1 => now,
        2 => now - Duration::from_secs(rng.u64(1..7200)),
        _ => now + Duration::from_secs(rng.u64(1..120)),
    }
}

/// The `_id` of `key`'s counter in the hour holding `at`.
fn hour_of(key: &str, at: SystemTime) -> Bson {
    let start = Buckets::utc(BucketWidth::Hour)
        .start_of(at)
        .expect("an hour");
    Bson::Document(doc! { "k": key, "t": DateTime::from_system_time(start) })
}

/// Records events until `until`: each on a fresh handle half the time, a
/// fifth of them again later.
pub async fn record_events(store: Store, until: Instant, mut rng: fastrand::Rng) -> Told {
    let mut told = Told::default();
    let long_lived = Ledger::new(&store, spec());
    let mut again = Vec::new();
    let mut i = 0u64;
    while Instant::now() < until {
        let (event, key, amount, at) = match again.pop() {
            Some((event, key, amount, at)) if rng.bool() => {
                told.repeats += 1;
                // A redelivery, or the same event with another time.
                let at = if rng.bool() { at } else { draw_time(&mut rng) };
                (event, key, amount, at)
            }
            other => {
                again.extend(other);
                i += 1;
                let key = KEYS[rng.usize(..KEYS.len())].to_owned();
                (format!("ev{i}"), key, rng.i64(1..4), draw_time(&mut rng))
            }
        };
        told.attempted
            .entry(event.clone())
            .or_default()
            .push((hour_of(&key, at), amount));
        let ledger = if rng.bool() {
            told.one_shot += 1;
            Ledger::new(&store, spec())
        } else {
            long_lived.clone()
        };
        let recording = ledger
            .record_at(event.clone(), key.as_str(), amount, at)
            .await;
        judge(&mut told, recording);
        if rng.u8(..5) == 0 {
            again.push((event, key, amount, at));
        }
    }
    told
}

fn judge(told: &mut Told, recording: Recording) {
    let event = recording.event().key().to_owned();
    match recording {
        Recording::Recorded(_) | Recording::Duplicate(_) => {
            let named = recording.event().counter().clone();
            told.named.push((event.clone(), named));
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
    let in_log: BTreeMap<String, (Bson, i64)> = logged
        .iter()
        .map(|d| {
            let id = d.get_str("_id").unwrap().to_owned();
            let key = d.get("k").unwrap().clone();
            let amount = super::integer(d.get("n"))
                .unwrap_or_else(|| panic!("{id}: amount {:?}", d.get("n")));
            (id, (key, amount))
        })
        .collect();
    for (event, (key, amount)) in &in_log {
        *expected.entry(key.to_string()).or_default() += amount;
        if !told.counted.contains_key(event) {
            found.push(format!(
                "{event} is in the log but no caller was told it counted"
            ));
        }
        let attempts = told.attempted.get(event).map_or(&[][..], Vec::as_slice);
        if !attempts.contains(&(key.clone(), *amount)) {
            found.push(format!(
                "{event} is logged as ({key}, {amount}), not as attempted: {attempts:?}"
            ));
        }
    }
    for (event, named) in &told.named {
        if let Some((key, _)) = in_log.get(event).filter(|(key, _)| key != named) {
            found.push(format!(
                "{event} was told counted in {named}, but it is logged in {key}"
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
    let held: BTreeMap<String, i64> = counters
        .iter()
        .map(|d| {
            let id = d.get("_id").unwrap().to_string();
            (id, super::integer(d.get("counter")).unwrap_or(0))
        })
        .collect();
    let mut hours: Vec<&String> = held.keys().chain(expected.keys()).collect();
    hours.sort();
    hours.dedup();
    for key in hours {
        let held = held.get(key).copied().unwrap_or(0);
        let want = expected.get(key).copied().unwrap_or(0);
        if held != want {
            found.push(format!(
                "counter {key} holds {held}, its logged events add up to {want}"
            ));
        }
    }
    found
}
