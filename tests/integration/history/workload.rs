//! What the history test's clients do: each worker draws its next call from
//! its own seeded generator and records every call it makes, settling each
//! ticket as an application would — and, for a share of them, again and at
//! once from elsewhere: a copy of the ticket rebuilt on another host, a
//! `tallyd resume` or `tallyd complete` child process, an operator
//! completing an unknown ticket's token, a resume after it was counted.

mod lanes;
mod settle;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use tally::{
    BoundedCounters, Counters, GiveBack, Increment, InsertLoop, PendingToken, Sequences, Take,
    Token, UnknownToken,
};
use tokio::sync::Semaphore;

use super::record::{Call, Outcome, Recorder};
use super::{BOUNDED, KEYS, SEQUENCES};
use settle::{complete_until_counted, settle_unknown};

/// Everything one client host has: the public API on its own connection
/// through the proxy, and the raw collection a crashing writer uses.
#[derive(Clone)]
pub struct Host {
    pub counters: Counters,
    /// The lanes collection's handle: one lane, group commit.
    pub lanes: Counters,
    pub sequences: Sequences,
    pub bounded: BoundedCounters,
    pub inserts: InsertLoop,
    pub raw: Collection<Document>,
}

/// A ticket (or a unit) still to settle when the network heals.
pub enum Leftover {
    Pending(PendingToken),
    Take(String, Token),
    GiveBack(String, Token),
    Lane(tally::LaneTicket),
}

/// What every task of the run shares.
pub struct Shared {
    pub rec: Recorder,
    pub hosts: Vec<Host>,
    pub leftovers: Mutex<Vec<Leftover>>,
    /// The `tallyd` config file the child processes use (through the
    /// proxy).
    pub child_config: PathBuf,
    /// `tallyd` children started so far, and how many more may be.
    pub children: AtomicUsize,
    pub max_children: usize,
    /// At most this many children at once: they are whole processes.
    pub child_slots: Semaphore,
    pub next_insert: AtomicU64,
    /// Workers start no new call after this.
    pub until: Instant,
    /// Counts of what the run exercised, for the summary and the floor.
    pub tally: Mutex<BTreeMap<&'static str, u64>>,
}

impl Shared {
    /// Counts one more `what` for the run's summary.
    pub fn count(&self, what: &'static str) {
        *self.tally.lock().unwrap().entry(what).or_default() += 1;
    }

    fn leave(&self, leftover: Leftover) {
        self.leftovers.lock().unwrap().push(leftover);
    }
}

/// One worker: calls drawn from `rng` until the run's end.
pub async fn worker(shared: Arc<Shared>, w: usize, mut rng: fastrand::Rng) {
    let me = format!("w{w}");
    let host = shared.hosts[w].clone();
    let mut held: Vec<(String, Token)> = Vec::new();
    while Instant::now() < shared.until {
        let roll = rng.u32(0..100);
        match roll {
            0..28 => increment(&shared, w, &me, &host, &mut rng).await,
            28..34 => lanes::burst(&shared, w, &me, &host, &mut rng).await,
            34..42 => crash(&shared, w, &me, &host, &mut rng, true).await,
            42..45 => crash(&shared, w, &me, &host, &mut rng, false).await,
            45..63 => read(&shared, &me, &host, &mut rng).await,
            63..74 => sequence(&shared, &me, &host, &mut rng, roll < 70).await,
            74..88 if held.len() < 2 && roll < 82 || held.is_empty() => {
                take(&shared, &me, &host, &mut rng, &mut held).await
            }
            74..88 => give_back(&shared, &me, &host, &mut rng, &mut held).await,
            _ => insert(&shared, &me, &host, roll < 96).await,
        }
        if rng.u32(0..4) == 0 {
            tokio::task::yield_now().await;
        }
    }
}

fn amount(rng: &mut fastrand::Rng) -> i64 {
    match rng.u32(0..100) {
        0..55 => 1,
        55..90 => rng.i64(2..=5),
        _ => 17,
    }
}

async fn increment(shared: &Arc<Shared>, w: usize, me: &str, host: &Host, rng: &mut fastrand::Rng) {
    let key = KEYS[rng.usize(0..KEYS.len())];
    let amount = amount(rng);
    let invoke = shared.rec.now();
    let outcome = host.counters.increment(key, amount).await;
    let call = Call::Increment {
        key: key.into(),
        amount,
        token: outcome.token().map(|t| t.object_id()),
    };
    shared
        .rec
        .push(me, call, invoke, Outcome::of_increment(&outcome));
    shared.count("increment");
    match outcome {
        Increment::Counted(_) | Increment::NotCounted(_) => {}
        Increment::Pending(pending) if rng.bool() => {
            if let Err(left) = complete_until_counted(shared, me, host, pending).await {
                shared.leave(Leftover::Pending(left));
            }
        }
        // Left to the fold (and settled with `complete` at the end).
        Increment::Pending(pending) => shared.leave(Leftover::Pending(pending)),
        Increment::Unknown(unknown) => settle_unknown(shared, w, me, host, rng, unknown).await,
    }
}

/// A writer that sends step 1 itself and dies: its ticket is handed to
/// another process as unknown (`hand_over`), or nobody ever learns it and
/// the fold counts it if it landed.
async fn crash(
    shared: &Arc<Shared>,
    w: usize,
    me: &str,
    host: &Host,
    rng: &mut fastrand::Rng,
    hand_over: bool,
) {
    let key = KEYS[rng.usize(0..KEYS.len())];
    let amount = amount(rng);
    let token = Token::new();
    // The entry as the library writes it.
    let entry = match amount {
        1 => Bson::ObjectId(token.object_id()),
        n => Bson::Document(doc! { "t": token.object_id(), "n": n }),
    };
    let invoke = shared.rec.now();
    let _ = host
        .raw
        .update_one(
            doc! { "_id": key },
            doc! { "$addToSet": { "pending": entry } },
        )
        .await;
    let call = Call::Crash {
        key: key.into(),
        token: token.object_id(),
        amount,
    };
    shared.rec.push(me, call, invoke, Outcome::Sent);
    if hand_over {
        shared.count("crash handed over");
        let unknown = UnknownToken::new(key, token, amount).expect("a non-zero amount");
        settle_unknown(shared, w, me, host, rng, unknown).await;
    } else {
        shared.count("crash abandoned");
    }
}

async fn read(shared: &Shared, me: &str, host: &Host, rng: &mut fastrand::Rng) {
    let key = KEYS[rng.usize(0..KEYS.len())];
    let invoke = shared.rec.now();
    let value = host.counters.value(key).await;
    let outcome = match value {
        Ok(None) => Outcome::Value(0),
        Ok(Some(Bson::Int64(n))) => Outcome::Value(n),
        Ok(Some(Bson::Int32(n))) => Outcome::Value(n.into()),
        Ok(Some(other)) => Outcome::Failed {
            error: format!("a counter that is not an integer: {other:?}"),
            maybe_applied: false,
        },
        Err(err) => Outcome::failed(&err),
    };
    shared
        .rec
        .push(me, Call::Read { key: key.into() }, invoke, outcome);
    shared.count("read");
}

async fn sequence(shared: &Shared, me: &str, host: &Host, rng: &mut fastrand::Rng, one: bool) {
    let name = SEQUENCES[rng.usize(0..SEQUENCES.len())];
    let invoke = shared.rec.now();
    let (call, outcome) = if one {
        let result = host.sequences.next(name).await;
        let outcome = match result {
            Ok(n) => Outcome::Numbers { first: n, last: n },
            Err(err) => Outcome::failed(&err),
        };
        (Call::Next { name: name.into() }, outcome)
    } else {
        let n = rng.u32(2..=8);
        let outcome = match host.sequences.next_block(name, n).await {
            Ok(block) => Outcome::Numbers {
                first: block.first,
                last: block.last,
            },
            Err(err) => Outcome::failed(&err),
        };
        (
            Call::Block {
                name: name.into(),
                n,
            },
            outcome,
        )
    };
    shared.rec.push(me, call, invoke, outcome);
    shared.count(if one { "next" } else { "next_block" });
}

/// One recorded take; whether it is settled (taken or not) and held.
async fn take_once(
    shared: &Shared,
    me: &str,
    host: &Host,
    key: &str,
    token: Token,
) -> Option<bool> {
    let invoke = shared.rec.now();
    let result = host.bounded.take(key, token, me).await;
    let call = Call::Take {
        key: key.into(),
        token: token.object_id(),
    };
    let outcome = match &result {
        Ok(take) => Outcome::Take(*take),
        Err(err) => Outcome::failed(err),
    };
    shared.rec.push(me, call, invoke, outcome);
    shared.count("take");
    match result {
        Ok(Take::Taken | Take::AlreadyTaken) => Some(true),
        Ok(Take::NoneLeft | Take::NotFound) => Some(false),
        Err(_) => None,
    }
}

/// A take with a fresh token, retried with the same token when it failed
/// (and, a share of the time, when it did not).
async fn take(
    shared: &Shared,
    me: &str,
    host: &Host,
    rng: &mut fastrand::Rng,
    held: &mut Vec<(String, Token)>,
) {
    let (key, _) = BOUNDED[rng.usize(0..BOUNDED.len())];
    let token = Token::new();
    for attempt in 0..4 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        match take_once(shared, me, host, key, token).await {
            Some(true) => {
                if rng.u32(0..5) == 0 {
                    take_once(shared, me, host, key, token).await;
                }
                held.push((key.into(), token));
                return;
            }
            Some(false) => return,
            None => {}
        }
    }
    shared.leave(Leftover::Take(key.into(), token));
}

/// One recorded give-back; whether it is settled.
async fn give_back_once(shared: &Shared, me: &str, host: &Host, key: &str, token: Token) -> bool {
    let invoke = shared.rec.now();
    let result = host.bounded.give_back(key, token).await;
    let call = Call::GiveBack {
        key: key.into(),
        token: token.object_id(),
    };
    let outcome = match &result {
        Ok(given) => Outcome::GiveBack(*given),
        Err(err) => Outcome::failed(err),
    };
    shared.rec.push(me, call, invoke, outcome);
    shared.count("give_back");
    matches!(result, Ok(GiveBack::Returned | GiveBack::NotHeld))
}

async fn give_back(
    shared: &Shared,
    me: &str,
    host: &Host,
    rng: &mut fastrand::Rng,
    held: &mut Vec<(String, Token)>,
) {
    let (key, token) = held.swap_remove(rng.usize(0..held.len()));
    for attempt in 0..4 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if give_back_once(shared, me, host, &key, token).await {
            return;
        }
    }
    shared.leave(Leftover::GiveBack(key, token));
}

/// An insert of a body naming the call, or (`tagged` false) of the body
/// every such call inserts: only the insert loop's token tells them apart.
async fn insert(shared: &Shared, me: &str, host: &Host, tagged: bool) {
    let call = shared.next_insert.fetch_add(1, Ordering::Relaxed);
    let body = if tagged {
        doc! { "call": call as i64 }
    } else {
        doc! { "item": "tea" }
    };
    let invoke = shared.rec.now();
    let result = host.inserts.insert(body).await;
    let outcome = match result {
        Ok(id) => Outcome::Id(id),
        Err(err) => Outcome::failed(&err),
    };
    shared
        .rec
        .push(me, Call::Insert { call, tagged }, invoke, outcome);
    shared.count("insert");
}

/// Settles what the workers left, once the network healed: every pending
/// ticket completed (unknown ones were resumed until they were known, or
/// refused), every take and give-back made definite.
pub async fn settle_leftovers(shared: &Shared) {
    let me = "settle";
    let host = &shared.hosts[0];
    let leftovers = std::mem::take(&mut *shared.leftovers.lock().unwrap());
    for leftover in leftovers {
        match leftover {
            Leftover::Pending(pending) => {
                let mut pending = pending;
                for _ in 0..10 {
                    match complete_until_counted(shared, me, host, pending).await {
                        Ok(()) => break,
                        Err(still) => pending = still,
                    }
                }
            }
            Leftover::Take(key, token) => {
                for _ in 0..20 {
                    if take_once(shared, me, host, &key, token).await.is_some() {
                        break;
                    }
                }
            }
            Leftover::GiveBack(key, token) => {
                for _ in 0..20 {
                    if give_back_once(shared, me, host, &key, token).await {
                        break;
                    }
                }
            }
            Leftover::Lane(ticket) => {
                for _ in 0..20 {
                    if lanes::resume_once(shared, me, 0, &ticket).await {
                        break;
                    }
                }
            }
        }
    }
}
