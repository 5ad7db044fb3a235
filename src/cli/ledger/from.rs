//! `tallyd record --from FILE` (`-`: standard input): newline-delimited
//! JSON events, `{"event": "…", "key": …, "by": N, "at": "…"}` (`by`
//! defaults to 1; `at`, the event's time in a collection with buckets, to
//! now), recorded in batches — a backfill from logs or a queue.
//!
//! A batch goes out at 1,000 lines, or 200 ms after its first line was
//! read, whichever comes first: fed by a quiet queue, each event is
//! recorded (and its outcome printed) within a fraction of a second. Each
//! line gets its outcome (one JSON line each with `--json`; the refused
//! ones otherwise, and a summary), printed as its batch settles; a line
//! that is not such an event is reported with its number and records
//! nothing, and the others still go.
//!
//! It stops early, with the same summary, in two cases:
//! - **an outage**: a batch that found the server unreachable is the last
//!   one sent (each further batch would wait out its own server selection
//!   for the same answer). One message names the hosts and why; the
//!   summary counts the lines not sent and names the first. Exit 69 when
//!   nothing may have landed unseen, 75 when some outcome is unknown.
//! - **Ctrl-C** (SIGINT): the batch in flight is finished (a second Ctrl-C
//!   gives it up, its events counted unknown); exit 130.
//!
//! Either way, sending the whole input again is safe within the dedupe
//! window: an event recorded before is a duplicate under its key, counted
//! once. A progress bar shows on a terminal (events per second, and the
//! time left for a file); a pipe gets the summary line.

use std::io::{BufRead, IsTerminal};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::mpsc;

use super::judged;
use crate::bucket::{BucketWidth, Buckets};
use crate::cli::exit::{EXIT_INTERRUPTED, EXIT_UNAVAILABLE};
use crate::cli::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, EXIT_USAGE, exit_code_for, fail, out};
use crate::daemon::api::outcome;
use crate::error::{Error, words};
use crate::ledger::{Ledger, Recording};
use crate::redact::Secrets;
use crate::store::Store;

mod tally;

use tally::{Stop, Tally};

/// Events per `record_many`.
const BATCH: usize = 1000;
/// How long a line read waits for the lines after it: a batch goes out
/// this long after its first line, or at [`BATCH`] lines, whichever comes
/// first.
const WAIT: Duration = Duration::from_millis(200);

/// One line of the input, read: the event, its counter key, its amount
/// and its time as written (read in the collection's zone when its batch
/// goes out).
type Line = Result<outcome::Written, String>;

/// A line read: its number, how many bytes of the input were read through
/// it, and what it holds.
struct Read {
    number: u64,
    through: u64,
    line: Line,
}

/// Where the events go and what to say about them.
pub(in crate::cli) struct Target<'a> {
    pub(in crate::cli) ledger: &'a Ledger,
    pub(in crate::cli) store: &'a Store,
    pub(in crate::cli) json: bool,
    pub(in crate::cli) secrets: &'a Secrets,
    /// The command that sends the input again, as printed.
    pub(in crate::cli) again: String,
    /// The dedupe window within which sending it again is safe.
    pub(in crate::cli) window: Duration,
}

/// `record --from`: every line of `from`, in batches.
pub(in crate::cli) async fn record_from(from: &str, target: &Target<'_>) -> ExitCode {
    let (file, size) = if from == "-" {
        (None, None)
    } else {
        match std::fs::File::open(from) {
            Ok(file) => {
                let size = file.metadata().ok().map(|m| m.len());
                (Some(file), size)
            }
            Err(err) => {
                let message = crate::error::cannot_read(std::path::Path::new(from), &err);
                return fail(target.json, &message, target.secrets, EXIT_USAGE);
            }
        }
    };
    let mut interrupts = match signal(SignalKind::interrupt()) {
        Ok(interrupts) => interrupts,
        Err(err) => {
            let message = format!("cannot listen for Ctrl-C: {err}");
            return fail(target.json, &message, target.secrets, EXIT_FAILED);
        }
    };
    let mut lines = read_lines(file);
    let bar = (!target.json && std::io::stderr().is_terminal()).then(|| progress_bar(size));
    let mut tally = Tally::default();
    let started = std::time::Instant::now();
    let mut stop = None;
    while stop.is_none() {
        let (batch, finished) = tokio::select! {
            read = next_batch(&mut lines) => read,
            _ = interrupts.recv() => {
                stop = Some(Stop::Interrupted);
                break;
            }
        };
        let through = batch.last().map(|read| read.through);
        if !batch.is_empty() {
            stop = record_batch(batch, target, &mut tally, &mut interrupts, bar.as_ref()).await;
        }
        if let (Some(bar), Some(through)) = (&bar, through) {
            bar.set_position(through);
            bar.set_message(tally.progress(started.elapsed()));
        }
        if finished {
            break;
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    if stop.is_some() {
        tally.count_not_sent(&mut lines, from == "-").await;
    }
    report(from, target, &tally, stop.as_ref())
}

/// Prints the summary (and, after a stop, what to do) and returns the
/// exit code.
fn report(from: &str, target: &Target<'_>, tally: &Tally, stop: Option<&Stop>) -> ExitCode {
    let code = tally.code(stop);
    if target.json {
        if let Some(stop) = stop {
            let mut summary = tally.json();
            summary["outcome"] = json!(stop.name());
            summary["again"] = json!(target.again);
            out!("{summary}");
        }
        return ExitCode::from(code);
    }
    let shown = format!("{from}: {}", tally.summary());
    match stop {
        None if code == EXIT_OK => out!("{shown}"),
        None => eprintln!("{shown}"),
        Some(_) => {
            eprintln!("{shown}");
            let input = if from == "-" {
                " with the same input"
            } else {
                ""
            };
            eprintln!(
                "sending it all again is safe within the dedupe window ({}): an event recorded \
                 before is a duplicate under its key, counted once; run `{}`{input}",
                crate::store::shown_duration(target.window),
                target.again
            );
        }
    }
    ExitCode::from(code)
}

/// A bar for `size` bytes of a file (its time left), or a spinner for
/// standard input; its message is [`Tally::progress`].
fn progress_bar(size: Option<u64>) -> ProgressBar {
    let (bar, template) = match size {
        Some(size) => (
            ProgressBar::new(size),
            "{bar:30} {percent:>3}% ETA {eta} {msg}",
        ),
        None => (ProgressBar::new_spinner(), "{spinner} {msg}"),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// Reads one line of the input as an event.
fn parse_line(text: &str) -> Line {
    outcome::line_of(text)
}

/// The time of a line's `"at"`, in the collection's zone (a collection
/// without buckets reads it in UTC, and the ledger refuses it: not
/// recorded). A time that is neither form makes the line malformed.
fn line_time(ledger: &Ledger, at: Option<&str>) -> Result<Option<SystemTime>, String> {
    let Some(at) = at else { return Ok(None) };
    let zone = match &ledger.spec().buckets {
        Some(buckets) => buckets.clone(),
        None => Buckets::utc(BucketWidth::Day),
    };
    zone.parse_time(at)
        .map(Some)
        .map_err(|err| format!("\"at\": {err}"))
}

/// Reads `file` (standard input when `None`) on a thread of its own, line
/// by line, numbered, the blank ones left out: a blocking read never holds
/// up the recording of the lines before it. At most two batches wait
/// unread, so a fast file is read no further ahead than that.
fn read_lines(file: Option<std::fs::File>) -> mpsc::Receiver<Read> {
    let (sender, receiver) = mpsc::channel(2 * BATCH);
    std::thread::spawn(move || {
        let mut input: Box<dyn BufRead> = match file {
            Some(file) => Box::new(std::io::BufReader::new(file)),
            None => Box::new(std::io::stdin().lock()),
        };
        let mut through = 0;
        let mut buffer = Vec::new();
        for number in 1u64.. {
            buffer.clear();
            let (line, last) = match input.read_until(b'\n', &mut buffer) {
                Ok(0) => break,
                Ok(n) => {
                    through += n as u64;
                    match std::str::from_utf8(&buffer) {
                        Ok(text) if text.trim().is_empty() => continue,
                        Ok(text) => (parse_line(text.trim_end_matches(['\n', '\r'])), false),
                        // A line that is not UTF-8 is read past.
                        Err(err) => (Err(format!("cannot read the line: {err}")), false),
                    }
                }
                // Any other error ends the input (reading on could fail
                // forever).
                Err(err) => (Err(format!("cannot read the line: {err}")), true),
            };
            let read = Read {
                number,
                through,
                line,
            };
            if sender.blocking_send(read).is_err() || last {
                break;
            }
        }
    });
    receiver
}

/// The next batch of lines: up to [`BATCH`], those read within [`WAIT`] of
/// its first; and whether the input has ended.
async fn next_batch(lines: &mut mpsc::Receiver<Read>) -> (Vec<Read>, bool) {
    let Some(first) = lines.recv().await else {
        return (Vec::new(), true);
    };
    let due = tokio::time::Instant::now() + WAIT;
    let mut batch = vec![first];
    while batch.len() < BATCH {
        match tokio::time::timeout_at(due, lines.recv()).await {
            Ok(Some(line)) => batch.push(line),
            Ok(None) => return (batch, true),
            Err(_) => break,
        }
    }
    (batch, false)
}

/// The cause of `recording` when it says the server could not be reached
/// (an outage): what stops the command.
fn unreachable(recording: &Recording) -> Option<&Error> {
    let cause = match recording {
        Recording::NotRecorded(not) => Some(not.cause()),
        Recording::Unknown(ticket) => ticket.cause(),
        _ => None,
    }?;
    (exit_code_for(cause) == EXIT_UNAVAILABLE).then_some(cause)
}

/// Records the well-formed lines of `batch` with one `record_many`, and
/// reports every line. Ctrl-C while it waits: the batch is finished, or
/// given up at a second Ctrl-C. Returns why the command must stop, if it
/// must.
async fn record_batch(
    mut batch: Vec<Read>,
    target: &Target<'_>,
    tally: &mut Tally,
    interrupts: &mut Signal,
    bar: Option<&ProgressBar>,
) -> Option<Stop> {
    let mut events = Vec::new();
    for read in &mut batch {
        let Ok((event, key, by, at)) = &read.line else {
            continue;
        };
        match line_time(target.ledger, at.as_deref()) {
            Ok(at) => events.push((event.clone(), key.clone(), *by, at)),
            Err(why) => read.line = Err(why),
        }
    }
    let recording = target.ledger.record_many_at(events);
    tokio::pin!(recording);
    let mut stop = None;
    let outcomes = tokio::select! {
        outcomes = &mut recording => Some(outcomes),
        _ = interrupts.recv() => {
            stop = Some(Stop::Interrupted);
            let said = "interrupted: waiting for the batch in flight (Ctrl-C again to stop \
                        without its outcomes: they are counted unknown)";
            match bar {
                Some(bar) => bar.println(said),
                None => eprintln!("{said}"),
            }
            tokio::select! {
                outcomes = &mut recording => Some(outcomes),
                _ = interrupts.recv() => None,
            }
        }
    };
    let Some(outcomes) = outcomes else {
        // Given up in flight: each event may or may not have landed.
        for read in &batch {
            match &read.line {
                Ok(_) => tally.unknown_in_flight(),
                Err(why) => malformed(read.number, why, target, tally),
            }
        }
        tally.sent_through(batch.last().map_or(0, |read| read.number));
        return stop;
    };
    let mut outcomes = outcomes.into_iter();
    let mut outage: Option<String> = None;
    let mut unknown_in_outage = Vec::new();
    for read in &batch {
        let recording = match &read.line {
            Err(why) => {
                malformed(read.number, why, target, tally);
                continue;
            }
            Ok(_) => outcomes.next().expect("one outcome per event"),
        };
        if let Some(cause) = unreachable(&recording) {
            outage.get_or_insert_with(|| target.store.explain(cause));
            if let Recording::NotRecorded(_) = recording {
                // Nothing was sent: the line is one of those to send again.
                tally.not_sent_from(read.number);
                continue;
            }
            // Said once for the batch, below (each line in JSON).
            unknown_in_outage.push(read.number);
            tally.add(&recording);
            if target.json {
                report_line(read.number, &recording, target);
            }
            continue;
        }
        tally.add(&recording);
        report_line(read.number, &recording, target);
    }
    tally.sent_through(batch.last().map_or(0, |read| read.number));
    let Some(why) = outage else { return stop };
    let why = target.secrets.scrub(&why);
    tally.unavailable = Some(why.clone());
    if !target.json {
        let unknown = match unknown_in_outage.as_slice() {
            [] => String::new(),
            lines => format!(
                "; {} events sent as it went may or may not have landed (lines {})",
                lines.len(),
                words(&shown_lines(lines))
            ),
        };
        let said =
            format!("error: the server is unavailable: {why}{unknown}; stopped, sending no more");
        match bar {
            Some(bar) => bar.println(said),
            None => eprintln!("{said}"),
        }
    }
    Some(stop.unwrap_or(Stop::Outage))
}

/// Line numbers as people read them: the first three, then how many more.
fn shown_lines(lines: &[u64]) -> Vec<String> {
    let mut shown: Vec<String> = lines.iter().take(3).map(u64::to_string).collect();
    if lines.len() > 3 {
        shown.push(format!("{} more", lines.len() - 3));
    }
    shown
}

/// Reports a line that is not an event.
fn malformed(number: u64, why: &str, target: &Target<'_>, tally: &mut Tally) {
    tally.malformed += 1;
    if target.json {
        out!(
            "{}",
            json!({ "line": number, "outcome": "malformed", "error": why })
        );
    } else {
        eprintln!("line {number}: malformed, not recorded: {why}");
    }
}

/// Reports a line's outcome: every one in JSON, the ones not counted once
/// otherwise.
fn report_line(number: u64, recording: &Recording, target: &Target<'_>) {
    let (code, text) = judged(recording, target.secrets);
    if target.json {
        let mut shown = outcome::as_json(recording, target.ledger, &text, None);
        shown["line"] = json!(number);
        out!("{shown}");
    } else if code != EXIT_OK {
        eprintln!(
            "line {number}: {text} (event {})",
            crate::document::shown(recording.event().key())
        );
    }
}

impl Stop {
    /// The exit code of a command stopped so, with some outcome unknown
    /// (`unknown`) or not.
    fn code(&self, unknown: bool) -> u8 {
        match self {
            Self::Interrupted => EXIT_INTERRUPTED,
            Self::Outage if unknown => EXIT_TEMPFAIL,
            Self::Outage => EXIT_UNAVAILABLE,
        }
    }
}

impl Tally {
    /// The exit code: a stop's, else by the outcomes.
    fn code(&self, stop: Option<&Stop>) -> u8 {
        if let Some(stop) = stop {
            return stop.code(self.unknown > 0);
        }
        if self.conflict + self.not_recorded + self.malformed > 0 {
            EXIT_FAILED
        } else if self.unknown > 0 {
            EXIT_TEMPFAIL
        } else {
            EXIT_OK
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_line;

    /// A line that is not JSON is reported by its column alone: the line's
    /// number is the input's, never serde's "line 1".
    #[test]
    fn a_line_that_is_not_json_names_its_column_not_line_one() {
        let Err(error) = parse_line("not json") else {
            panic!("not JSON was read as an event");
        };
        assert_eq!(error, "not a JSON object: expected ident at column 2");
    }
}
