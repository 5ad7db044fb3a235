//! What one side of `tallyd bench` did: its slices' operations, latencies
//! and outcomes, what was settled at the end, and the check of its
//! counters.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Protocol, Told};
use crate::ledger::EventTicket;
use crate::write::counter::{PendingToken, UnknownToken};
use crate::write::lane::LaneTicket;

/// An outcome left open, to settle at the end.
pub(crate) enum Settle {
    /// A two-step increment's pending token: completed.
    Pending(PendingToken),
    /// A two-step increment's unknown token: resumed.
    Unknown(UnknownToken),
    /// A lane increment's unknown ticket: resumed.
    Lane(LaneTicket),
    /// An unknown recording: recorded again.
    Event(EventTicket),
}

/// One slice's operations on one side.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) elapsed: Duration,
    latencies: Vec<Duration>,
    counted: u64,
    not_counted: u64,
    failed: u64,
    open: Vec<Settle>,
}

impl Tally {
    pub(crate) fn record(&mut self, latency: Duration, told: Told) {
        if !matches!(told, Told::Many(_)) {
            self.latencies.push(latency);
        }
        match told {
            Told::Counted => self.counted += 1,
            Told::NotCounted => self.not_counted += 1,
            Told::Failed => self.failed += 1,
            Told::Open(settle) => self.open.push(*settle),
            Told::Many(all) => all.into_iter().for_each(|told| self.record(latency, told)),
        }
    }

    pub(crate) fn merge(&mut self, other: Tally) {
        self.latencies.extend(other.latencies);
        self.counted += other.counted;
        self.not_counted += other.not_counted;
        self.failed += other.failed;
        self.open.extend(other.open);
    }
}

/// Everything one side did.
pub(crate) struct Side {
    pub(crate) protocol: Protocol,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// Told counted at once.
    counted: u64,
    not_counted: u64,
    /// Plain `$inc`s that failed.
    failed: u64,
    /// Told unknown or pending.
    unknown: u64,
    /// Of those, settled at the end as counted, as not counted, or left
    /// open.
    settled_counted: u64,
    settled_not_counted: u64,
    unsettled: u64,
    pub(crate) open: Vec<Settle>,
    updates: u64,
    increments: u64,
    /// The sum the side's counters hold.
    pub(crate) found: Option<i64>,
    /// The ledger's side: the events its fold folded after the side, and
    /// how long that took.
    pub(crate) fold: Option<(u64, Duration)>,
}

impl Side {
    pub(crate) fn new(protocol: Protocol) -> Self {
        Self {
            protocol,
            elapsed: Duration::ZERO,
            latencies: Vec::new(),
            counted: 0,
            not_counted: 0,
            failed: 0,
            unknown: 0,
            settled_counted: 0,
            settled_not_counted: 0,
            unsettled: 0,
            open: Vec::new(),
            updates: 0,
            increments: 0,
            found: None,
            fold: None,
        }
    }

    /// Adds a slice, and the lane updates and increments it sent.
    pub(crate) fn add(&mut self, tally: Tally, updates: u64, increments: u64) {
        self.elapsed += tally.elapsed;
        self.latencies.extend(tally.latencies);
        self.counted += tally.counted;
        self.not_counted += tally.not_counted;
        self.failed += tally.failed;
        self.unknown += tally.open.len() as u64;
        self.open.extend(tally.open);
        if self.protocol == Protocol::Lanes {
            self.updates += updates;
            self.increments += increments;
        }
    }

    /// Whether some increment's outcome is not known: told unknown or
    /// pending and not settled, or a plain `$inc` that failed.
    pub(crate) fn uncertain(&self) -> bool {
        !self.open.is_empty() || self.failed > 0
    }

    /// An open outcome's settlement.
    pub(crate) fn settled(&mut self, counted: Option<bool>) {
        match counted {
            Some(true) => self.settled_counted += 1,
            Some(false) => self.settled_not_counted += 1,
            None => self.unsettled += 1,
        }
    }

    pub(crate) fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    fn percentile_ms(&mut self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        self.latencies.sort_unstable();
        let at = ((self.latencies.len() - 1) as f64 * p / 100.0).round() as usize;
        self.latencies[at].as_secs_f64() * 1000.0
    }

    fn group_size(&self) -> Option<f64> {
        (self.protocol == Protocol::Lanes && self.updates > 0)
            .then(|| self.increments as f64 / self.updates as f64)
    }

    /// The counted increments (all of amount 1), and how many more the
    /// counters may hold (outcomes that stayed open).
    fn expected(&self) -> (i64, i64) {
        (
            (self.counted + self.settled_counted) as i64,
            self.unsettled as i64,
        )
    }

    /// Whether the counters hold what the callers were told: `Err` with
    /// why not. A side with failed plain `$inc`s cannot be checked.
    pub(crate) fn check(&self) -> Result<(), String> {
        let (counted, open) = self.expected();
        let Some(found) = self.found else {
            return Err("not read back".into());
        };
        if self.failed > 0 {
            return Ok(());
        }
        if found < counted {
            Err(format!("{} counted increments lost", counted - found))
        } else if found > counted + open {
            Err(format!(
                "{} increments counted twice or never reported counted",
                found - counted - open
            ))
        } else {
            Ok(())
        }
    }

    pub(crate) fn check_line(&self) -> String {
        let (counted, open) = self.expected();
        let found = self.found.unwrap_or_default();
        let name = self.protocol.name();
        if self.failed > 0 {
            return format!(
                "check {name}: not checked: {} plain $inc failed, and nothing can tell whether \
                 they applied (the counters hold {found}, {counted} were acknowledged)",
                self.failed
            );
        }
        let open = match open {
            0 => String::new(),
            n => format!(" (and up to {n} still unknown)"),
        };
        let drained = self.fold.map_or_else(String::new, |(events, took)| {
            let rate = events as f64 / took.as_secs_f64().max(1e-9);
            format!(
                "; the fold put {events} events into them in {:.2}s ({rate:.0} events/s)",
                took.as_secs_f64()
            )
        });
        match self.check() {
            Ok(()) => format!(
                "check {name}: ok, the counters hold {found}: every counted increment once{open}{drained}"
            ),
            Err(why) => format!(
                "check {name}: FAILED: the counters hold {found}, the callers were told {counted}{open}: {why}"
            ),
        }
    }

    pub(crate) fn header() -> String {
        format!(
            "{:<14} {:>9} {:>8} {:>8} {:>8} {:>9} {:>11} {:>8} {:>6}",
            "protocol",
            "ops/s",
            "p50 ms",
            "p99 ms",
            "x plain",
            "counted",
            "not counted",
            "unknown",
            "group"
        )
    }

    pub(crate) fn row(&self, plain: Option<f64>) -> String {
        let mut me = self.snapshot();
        let ratio = plain.map_or("-".to_owned(), |p| format!("{:.2}", self.per_second() / p));
        let group = self
            .group_size()
            .map_or("-".to_owned(), |g| format!("{g:.1}"));
        format!(
            "{:<14} {:>9.0} {:>8.2} {:>8.2} {:>8} {:>9} {:>11} {:>8} {:>6}",
            self.protocol.name(),
            self.per_second(),
            me.percentile_ms(50.0),
            me.percentile_ms(99.0),
            ratio,
            self.counted,
            self.not_counted + self.failed,
            self.unknown,
            group
        )
    }

    pub(crate) fn json(&self, plain: Option<f64>) -> Value {
        let mut me = self.snapshot();
        let (counted, open) = self.expected();
        json!({
            "protocol": self.protocol.name(),
            "ops_per_second": self.per_second(),
            "p50_ms": me.percentile_ms(50.0),
            "p99_ms": me.percentile_ms(99.0),
            "ratio_to_plain": plain.map(|p| self.per_second() / p),
            "outcomes": {
                "counted": self.counted,
                "not_counted": self.not_counted,
                "failed": self.failed,
                "unknown": self.unknown,
                "settled_counted": self.settled_counted,
                "settled_not_counted": self.settled_not_counted,
                "unsettled": self.unsettled,
            },
            "group_size": self.group_size(),
            "fold": self.fold.map(|(events, took)| json!({
                "events": events,
                "seconds": took.as_secs_f64(),
                "events_per_second": events as f64 / took.as_secs_f64().max(1e-9),
            })),
            "check": {
                "counted": counted,
                "open": open,
                "found": self.found,
                "checked": self.failed == 0,
                "ok": self.check().is_ok(),
            },
        })
    }

    /// A copy of the latencies to sort.
    fn snapshot(&self) -> Side {
        Side {
            latencies: self.latencies.clone(),
            ..Side::new(self.protocol)
        }
    }
}
