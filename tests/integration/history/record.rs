//! The history: every call a client of the history test made — its
//! process, the instants it was invoked and returned, its arguments and its
//! outcome — and what the end of the run found (the final state, and the
//! proxy's log read as an oracle). The checker judges these and nothing
//! else.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::oid::ObjectId;
use tally::{Completion, Error, GiveBack, Increment, Take};

/// One call and what it returned. Instants are measured from the start of
/// the run on one monotonic clock (a `tallyd` child's are its spawn and its
/// exit, seen from the test).
#[derive(Debug, Clone)]
pub struct Op {
    /// Who made the call: `w3`, `w3/copy`, `w3/operator`, `tallyd#4`,
    /// `fold`, `settle` (the end of the run).
    pub process: String,
    pub invoke: Duration,
    pub ret: Duration,
    pub call: Call,
    pub outcome: Outcome,
}

/// A call's arguments.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// `Counters::increment(key, amount)`; the token is the one the
    /// outcome named.
    Increment {
        key: String,
        amount: i64,
        token: Option<ObjectId>,
    },
    /// A writer that sent step 1 itself (a raw `$addToSet` of its entry)
    /// and died before learning what happened: its ticket is handed to
    /// someone else as unknown, or abandoned to the fold.
    Crash {
        key: String,
        token: ObjectId,
        amount: i64,
    },
    /// `complete` of the token: of a pending ticket, or (an operator) of
    /// whatever `find_pending` found for an unknown one.
    Complete { key: String, token: ObjectId },
    /// `resume` of the token with the amount the caller believes.
    Resume {
        key: String,
        token: ObjectId,
        amount: i64,
    },
    /// `Counters::value(key)`.
    Read { key: String },
    /// `Sequences::next(name)`.
    Next { name: String },
    /// `Sequences::next_block(name, n)`.
    Block { name: String, n: u32 },
    /// `BoundedCounters::take(key, token, _)`.
    Take { key: String, token: ObjectId },
    /// `BoundedCounters::give_back(key, token)`.
    GiveBack { key: String, token: ObjectId },
    /// `InsertLoop::insert` of a document naming the call (`call: id`),
    /// or, not `tagged`, of the same body every such call inserts.
    Insert { call: u64, tagged: bool },
    /// One `Reconciler::reconcile` run (not judged; shown in slices).
    Fold,
    /// `Counters::add(key, amount)` on the lanes collection, one caller of
    /// a burst: the lane and number of the update that carried it (shared
    /// by the callers of its group).
    Add {
        key: String,
        amount: i64,
        lane: String,
        position: i64,
    },
    /// `Counters::resume_lane` of a caller's ticket (its update's total).
    ResumeLane {
        key: String,
        lane: String,
        position: i64,
        total: i64,
    },
}

/// What a call returned.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Counted; `earlier` is the library's `settled_earlier` (this call
    /// found it counted already).
    Counted {
        earlier: bool,
    },
    Pending,
    Unknown,
    NotCounted,
    /// `find_pending` found nothing: counted already, or never added.
    NotPending,
    /// `resume` refused (past the horizon, or another amount).
    Refused(String),
    /// A crashed writer's step 1 was sent; nobody learns its fate.
    Sent,
    /// A counter's value (a missing counter reads as 0).
    Value(i64),
    /// Numbers handed out: `first..=last`.
    Numbers {
        first: i64,
        last: i64,
    },
    Take(Take),
    GiveBack(GiveBack),
    /// The insert loop's id.
    Id(i64),
    /// A fold run: tokens and amount folded.
    Folded {
        tokens: u64,
        amount: i64,
    },
    /// An error. `maybe_applied`: the call may have written something.
    Failed {
        error: String,
        maybe_applied: bool,
    },
}

impl Outcome {
    /// What an increment (or a resume that got that far) said.
    pub fn of_increment(outcome: &Increment) -> Self {
        match outcome {
            Increment::Counted(c) => Self::Counted {
                earlier: c.settled_earlier(),
            },
            Increment::Pending(_) => Self::Pending,
            Increment::Unknown(_) => Self::Unknown,
            Increment::NotCounted(_) => Self::NotCounted,
        }
    }

    /// What a `complete` said.
    pub fn of_completion(outcome: &Completion) -> Self {
        match outcome {
            Completion::Counted(c) => Self::Counted {
                earlier: c.settled_earlier(),
            },
            Completion::Pending(_) => Self::Pending,
        }
    }

    /// What a `resume` said: an outcome, or a refusal.
    pub fn of_resume(outcome: &Result<Increment, Error>) -> Self {
        match outcome {
            Ok(outcome) => Self::of_increment(outcome),
            Err(err) => Self::Refused(err.to_string()),
        }
    }

    /// A failed call; every server error may have written something (the
    /// error describes the last attempt only).
    pub fn failed(err: &Error) -> Self {
        Self::Failed {
            error: err.to_string(),
            maybe_applied: matches!(err, Error::Server(_)),
        }
    }
}

impl Call {
    /// The counter, sequence or bounded counter the call is about.
    pub fn subject(&self) -> Option<&str> {
        match self {
            Self::Increment { key, .. }
            | Self::Crash { key, .. }
            | Self::Complete { key, .. }
            | Self::Resume { key, .. }
            | Self::Read { key }
            | Self::Take { key, .. }
            | Self::GiveBack { key, .. }
            | Self::Add { key, .. }
            | Self::ResumeLane { key, .. } => Some(key),
            Self::Next { name } | Self::Block { name, .. } => Some(name),
            Self::Insert { .. } | Self::Fold => None,
        }
    }

    /// The increment token the call is about.
    pub fn token(&self) -> Option<ObjectId> {
        match self {
            Self::Increment { token, .. } => *token,
            Self::Crash { token, .. }
            | Self::Complete { token, .. }
            | Self::Resume { token, .. } => Some(*token),
            _ => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = |t: &ObjectId| t.to_hex()[16..].to_owned();
        write!(
            f,
            "[{:>8.3}s – {:>8.3}s] {:<12} ",
            self.invoke.as_secs_f64(),
            self.ret.as_secs_f64(),
            self.process
        )?;
        match &self.call {
            Call::Increment { key, amount, token } => write!(
                f,
                "increment({key}, {amount:+}) token …{}",
                token.as_ref().map(short).unwrap_or_default()
            )?,
            Call::Crash { key, token, amount } => write!(
                f,
                "step 1 then crash({key}, {amount:+}) token …{}",
                short(token)
            )?,
            Call::Complete { key, token } => write!(f, "complete({key}, …{})", short(token))?,
            Call::Resume { key, token, amount } => {
                write!(f, "resume({key}, …{}, {amount:+})", short(token))?
            }
            Call::Read { key } => write!(f, "value({key})")?,
            Call::Next { name } => write!(f, "next({name})")?,
            Call::Block { name, n } => write!(f, "next_block({name}, {n})")?,
            Call::Take { key, token } => write!(f, "take({key}, …{})", short(token))?,
            Call::GiveBack { key, token } => write!(f, "give_back({key}, …{})", short(token))?,
            Call::Insert { call, tagged } => write!(
                f,
                "insert(call {call}{})",
                if *tagged { "" } else { ", same body as others" }
            )?,
            Call::Fold => write!(f, "fold")?,
            Call::Add {
                key,
                amount,
                lane,
                position,
            } => write!(
                f,
                "add({key}, {amount:+}) lane …{} s {position}",
                &lane[16..]
            )?,
            Call::ResumeLane {
                key,
                lane,
                position,
                total,
            } => write!(
                f,
                "resume_lane({key}, …{} s {position}, total {total:+})",
                &lane[16..]
            )?,
        }
        write!(f, " → {:?}", self.outcome)
    }
}

/// The history being recorded, shared by every task of the run.
#[derive(Clone)]
pub struct Recorder {
    start: Instant,
    ops: Arc<Mutex<Vec<Op>>>,
}

impl Recorder {
    /// An empty history whose clock starts now.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            ops: Arc::default(),
        }
    }

    /// The instant now, on the history's clock.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// Records a call invoked at `invoke` that returns now.
    pub fn push(&self, process: &str, call: Call, invoke: Duration, outcome: Outcome) {
        let op = Op {
            process: process.to_owned(),
            invoke,
            ret: self.now(),
            call,
            outcome,
        };
        self.ops.lock().unwrap().push(op);
    }

    /// Every call so far, in the order they returned.
    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap().clone()
    }
}

/// A bounded counter as the run left it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BoundedState {
    pub initial: i64,
    pub available: i64,
    /// The holders' tokens, one per unit held (a token twice is a unit
    /// taken twice).
    pub holders: Vec<ObjectId>,
}

/// A document the insert loop wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct InsertedDoc {
    pub id: i64,
    /// The `call` field the test put in it.
    pub call: Option<u64>,
    /// The insert loop's own token field.
    pub token: Option<ObjectId>,
}

/// Everything the run left, read directly from the server after every
/// ticket was settled and the fold found nothing left.
#[derive(Debug, Clone, Default)]
pub struct FinalState {
    /// Every counter's value.
    pub counters: BTreeMap<String, i64>,
    /// Pending entries still in the counters (none, once settled and folded).
    pub pending_left: usize,
    /// Every sequence's current value.
    pub sequences: BTreeMap<String, i64>,
    pub inserted: Vec<InsertedDoc>,
    pub bounded: BTreeMap<String, BoundedState>,
    /// Every counter of the lanes collection.
    pub lane_counters: BTreeMap<String, i64>,
}

/// What the proxy's log says reached the server: the second oracle.
#[derive(Debug, Clone, Default)]
pub struct Oracle {
    /// Every token a step 1 (`$addToSet` of its entry, by the increment, a
    /// crashed writer or a settle) carried to the server: its key and
    /// amount. The counters exist beforehand, so such a step 1 adds the
    /// token — or, a settle's, finds its marker: counted already. Either
    /// way the token is counted by the end, exactly once.
    pub step_1_reached: HashMap<ObjectId, (String, i64)>,
    /// Every token an insert-loop insert carried.
    pub inserts: HashMap<ObjectId, InsertSent>,
    /// Every bounded-counter token a give-back `update` reached the server
    /// for and matched (a reply the proxy never saw counts as matched): a
    /// `NotHeld` after it is that call's own earlier attempt.
    pub given_back: HashSet<ObjectId>,
    /// Every lane update (lane, number) that reached the server: its key
    /// and amount (the group's sum). The lane counters exist beforehand, so
    /// the first to arrive applies and a repeat applies nothing.
    pub lane_updates: HashMap<(String, i64), (String, i64)>,
}

/// The inserts that carried one token (one insert-loop call's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InsertSent {
    /// The `call` field they held (none for the shared body).
    pub call: Option<u64>,
    /// Whether one of them reached the server.
    pub reached: bool,
}
