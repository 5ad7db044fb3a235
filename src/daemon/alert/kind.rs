//! What an alert is about.

use std::fmt;

use serde::Serialize;

/// What an alert is about; with a collection name, it identifies one
/// condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AlertKind {
    /// Pending tokens older than `[alerts] stuck_after`: their writers are
    /// gone and the counts wait for the fold.
    StuckTokens,
    /// A document whose `pending` array holds more than `[alerts]
    /// max_pending` entries: a writer that never runs step 2.
    PendingTooLong,
    /// A document whose lane map holds more than `[alerts] max_lanes`
    /// entries: too many writer lanes wrote it within `lane_ttl` (or too
    /// many named lanes, which are never pruned), and every write rewrites
    /// the whole map.
    LanesTooMany,
    /// Documents tally cannot read (a counter that is not a number, a
    /// `pending` that is not an array of tokens).
    Malformed,
    /// Reconcile runs that failed.
    RunFailed,
    /// A change stream down for longer than `[alerts] monitor_down_after`.
    MonitorDown,
    /// Documents the last reconcile run could not fold because the server
    /// refused to update them (a validator, a document grown too large):
    /// left untouched, their tokens uncounted.
    FoldRefused,
    /// This host's clock differs from the server's by more than half the
    /// margin the collection's timing leaves for it (`grace −
    /// retry_horizon − attempt_timeout`).
    ClockSkew,
    /// Recorded events of a ledger not folded for longer than `[alerts]
    /// stuck_after`, or a ledger the fold refuses (its indexes are
    /// missing): the counters fall behind their events.
    EventsStuck,
    /// Counters that refused their recorded events' sums (an overflow, a
    /// counter that is not a number, a validator): the sums are held in the
    /// fold's state and offered again every pass; the other counters fold
    /// on.
    EventsHeld,
    /// The change stream on a ledger's events collection could not be
    /// opened for longer than `[alerts] monitor_down_after`: events are
    /// folded at each `[monitor] scan_interval` instead of at once.
    EventsStreamDown,
    /// Buckets past their closing time that the last complete reconcile run
    /// could not close (a pending token the fold has not taken, recorded
    /// events not folded, a malformed document): they are not final.
    BucketsUnclosed,
    /// A ledger's fold stands further back in the events collection's
    /// change stream than half the oplog's window: if it stays behind, the
    /// oplog will no longer hold its position and the fold will stop.
    EventsFoldBehind,
    /// A ledger's fold stopped: its position is no longer in the oplog (or
    /// the events collection was dropped). Nothing more is folded until
    /// `tallyd fold-from`.
    EventsFoldStopped,
}

impl AlertKind {
    /// Every kind: for the series the daemon exports from its start, and
    /// for the tests that check each of them.
    pub(crate) const ALL: [AlertKind; 14] = {
        use AlertKind::*;
        [
            StuckTokens,
            PendingTooLong,
            LanesTooMany,
            Malformed,
            RunFailed,
            MonitorDown,
            FoldRefused,
            ClockSkew,
            EventsStuck,
            EventsHeld,
            EventsStreamDown,
            BucketsUnclosed,
            EventsFoldBehind,
            EventsFoldStopped,
        ]
    };

    /// Whether the kind watches a collection's events ledger (only
    /// collections with one can raise it).
    pub(crate) fn is_ledger(&self) -> bool {
        matches!(
            self,
            AlertKind::EventsStuck
                | AlertKind::EventsHeld
                | AlertKind::EventsStreamDown
                | AlertKind::EventsFoldBehind
                | AlertKind::EventsFoldStopped
        )
    }

    /// Whether the kind watches a collection's buckets (only bucketed
    /// collections can raise it).
    pub(crate) fn is_bucket(&self) -> bool {
        matches!(self, AlertKind::BucketsUnclosed)
    }

    /// The kind's name in logs, metrics labels and webhook bodies.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            AlertKind::StuckTokens => "stuck_tokens",
            AlertKind::PendingTooLong => "pending_too_long",
            AlertKind::LanesTooMany => "lanes_too_many",
            AlertKind::Malformed => "malformed",
            AlertKind::RunFailed => "run_failed",
            AlertKind::MonitorDown => "monitor_down",
            AlertKind::FoldRefused => "fold_refused",
            AlertKind::ClockSkew => "clock_skew",
            AlertKind::EventsStuck => "events_stuck",
            AlertKind::EventsHeld => "events_held",
            AlertKind::EventsStreamDown => "events_stream_down",
            AlertKind::BucketsUnclosed => "buckets_unclosed",
            AlertKind::EventsFoldBehind => "events_fold_behind",
            AlertKind::EventsFoldStopped => "events_fold_stopped",
        }
    }
}

impl fmt::Display for AlertKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
