//! How `record --from` went, outcome by outcome, and what it did not send.

use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Read;
use crate::error::counted;
use crate::ledger::Recording;

/// Why `record --from` stopped before the end of its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// The server could not be reached.
    Outage,
    /// Ctrl-C (SIGINT).
    Interrupted,
}

impl Stop {
    /// The `outcome` of the JSON summary.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Outage => "unavailable",
            Self::Interrupted => "interrupted",
        }
    }
}

/// The lines' outcomes so far.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) recorded: u64,
    pub(super) duplicate: u64,
    pub(super) conflict: u64,
    pub(super) unknown: u64,
    pub(super) not_recorded: u64,
    pub(super) malformed: u64,
    /// Lines not sent: kept back by an outage, or never read into a batch.
    not_sent: u64,
    /// The first of them.
    first_not_sent: Option<u64>,
    /// The last line of the batches sent.
    sent_through: u64,
    /// Standard input was not read to its end: more lines may follow the
    /// ones counted as not sent.
    rest_unread: bool,
    /// Why the server could not be reached, when an outage stopped it.
    pub(super) unavailable: Option<String>,
}

impl Tally {
    pub(super) fn add(&mut self, recording: &Recording) {
        match recording {
            Recording::Recorded(_) => self.recorded += 1,
            Recording::Duplicate(_) => self.duplicate += 1,
            Recording::Conflict(_) => self.conflict += 1,
            Recording::Unknown(_) => self.unknown += 1,
            Recording::NotRecorded(_) => self.not_recorded += 1,
        }
    }

    /// An event of a batch given up in flight: it may or may not have
    /// landed.
    pub(super) fn unknown_in_flight(&mut self) {
        self.unknown += 1;
    }

    /// Line `line` was not sent.
    pub(super) fn not_sent_from(&mut self, line: u64) {
        self.not_sent += 1;
        self.first_not_sent = Some(self.first_not_sent.map_or(line, |first| first.min(line)));
    }

    /// The batches sent so far end at line `line`.
    pub(super) fn sent_through(&mut self, line: u64) {
        self.sent_through = self.sent_through.max(line);
    }

    /// The lines settled so far.
    pub(super) fn lines(&self) -> u64 {
        self.recorded
            + self.duplicate
            + self.conflict
            + self.unknown
            + self.not_recorded
            + self.malformed
    }

    /// After a stop: counts the lines left unsent — the rest of a file,
    /// read to its end; of standard input, only what was read already
    /// (reading on could wait for ever).
    pub(super) async fn count_not_sent(&mut self, lines: &mut mpsc::Receiver<Read>, stdin: bool) {
        loop {
            let read = if stdin {
                match lines.try_recv() {
                    Ok(read) => read,
                    Err(mpsc::error::TryRecvError::Empty) => {
                        self.rest_unread = true;
                        break;
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            } else {
                match lines.recv().await {
                    Some(read) => read,
                    None => break,
                }
            };
            self.not_sent_from(read.number);
        }
        if self.rest_unread && self.first_not_sent.is_none() {
            self.first_not_sent = Some(self.sent_through + 1);
        }
    }

    /// The progress bar's message: the lines settled in `elapsed`, their
    /// rate, and the outcomes so far, short.
    pub(super) fn progress(&self, elapsed: std::time::Duration) -> String {
        let lines = self.lines();
        let rate = lines as f64 / elapsed.as_secs_f64().max(0.001);
        format!(
            "{lines} lines, {rate:.0}/s: {} recorded, {}, {} unknown, {} refused",
            self.recorded,
            counted(self.duplicate, "duplicate", "duplicates"),
            self.unknown,
            self.conflict + self.not_recorded + self.malformed
        )
    }

    /// The outcomes as one line; after a stop, with the lines not sent.
    pub(super) fn summary(&self) -> String {
        let mut summary = format!(
            "{} recorded, {}, {}, {} unknown, {} not recorded, {}",
            self.recorded,
            counted(self.duplicate, "duplicate", "duplicates"),
            counted(self.conflict, "conflict", "conflicts"),
            self.unknown,
            self.not_recorded,
            counted(self.malformed, "malformed line", "malformed lines")
        );
        if let Some(first) = self.first_not_sent {
            let rest = if self.rest_unread {
                " and whatever standard input still holds"
            } else {
                ""
            };
            summary.push_str(&format!(
                "; not sent: {} lines{rest}, the first line {first}",
                self.not_sent
            ));
        }
        summary
    }

    /// The summary's fields.
    pub(super) fn json(&self) -> Value {
        json!({
            "recorded": self.recorded,
            "duplicates": self.duplicate,
            "conflicts": self.conflict,
            "unknown": self.unknown,
            "not_recorded": self.not_recorded,
            "malformed": self.malformed,
            "not_sent": self.not_sent,
            "first_not_sent_line": self.first_not_sent,
            "rest_unread": self.rest_unread,
            "error": self.unavailable,
        })
    }
}
