//! `tallyd record` and `tallyd get`: the events ledger from the shell.
//!
//! Both work only on a collection whose ledger the configuration turns on
//! (`ledger = true` or `events_collection`): events recorded anywhere else
//! would never be folded into their counters. Another collection is a
//! configuration error (exit 78).
//!
//! `record` exits 0 when the event is counted once (recorded, or a
//! duplicate of an earlier recording), 75 when the insert is unknown (run
//! the same command again: a repeat is recognised as a duplicate), 1 for a
//! conflict (the key was recorded with another counter or amount) and when
//! nothing was recorded.
//!
//! `record --from FILE` (`-`: standard input) records newline-delimited
//! JSON events, `{"event": "…", "key": …, "by": N}` (`by` defaults to 1),
//! in batches — a backfill from logs or a queue. A batch goes out at 1,000
//! lines, or 200 ms after its first line was read, whichever comes
//! first: fed by a quiet queue, each event is recorded (and its outcome
//! printed) within a fraction of a second, never held in the process until
//! more lines come. Each line gets its outcome (one JSON line each with
//! `--json`; the refused ones otherwise, and a summary), printed as its
//! batch settles; a line that is not such an event is reported with its
//! number and records nothing, and the others still go. It exits 0 only
//! when every event was recorded or a duplicate; 75 when some are unknown
//! and nothing else went wrong (run it again: what landed is a duplicate
//! then); 1 otherwise.

use crate::cli::out;
use std::io::{BufRead, IsTerminal};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

use clap::Args;
use mongodb::bson::Bson;
use serde_json::{Value, json};

use super::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, EXIT_USAGE, TargetArgs, exit_code_for, fail};
use crate::config::Config;
use crate::document::display_id;
use crate::error::Error;
use crate::ledger::{EventFold, EventFoldSettings};
use crate::ledger::{Ledger, Recording};
use crate::redact::Secrets;
use crate::store::Store;

/// Events per `record_many` of `record --from`.
const FROM_BATCH: usize = 1000;
/// How long `record --from` holds a line it read before recording it
/// with whatever came after it: a batch goes out this long after its first
/// line, or at [`FROM_BATCH`] lines, whichever comes first.
const FROM_WAIT: Duration = Duration::from_millis(200);

/// `tallyd record EVENT_KEY COUNTER_KEY [--by N]`, or `tallyd record --from
/// FILE`.
#[derive(Debug, Args)]
pub(crate) struct RecordArgs {
    /// The event's key (its idempotency key: a message id, a webhook's
    /// event id; not empty).
    #[arg(required_unless_present = "from", conflicts_with = "from", value_parser = super::event_key)]
    pub(crate) event: Option<String>,
    /// The counter's `_id` (a string, not empty).
    #[arg(required_unless_present = "from", conflicts_with = "from", value_parser = super::counter_key)]
    pub(crate) key: Option<String>,
    /// The amount the event adds; negative subtracts; not zero.
    #[arg(
        long,
        default_value_t = 1,
        allow_negative_numbers = true,
        conflicts_with = "from",
        value_parser = super::increment::amount
    )]
    pub(crate) by: i64,
    /// Record the events of FILE instead, one JSON object a line:
    /// {"event": "…", "key": …, "by": N} ("by" defaults to 1); "-" reads
    /// standard input.
    #[arg(long, value_name = "FILE")]
    pub(crate) from: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd get KEY`.
#[derive(Debug, Args)]
pub(crate) struct GetArgs {
    /// The counter's `_id` (a string, not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) key: String,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// The target's ledger and a connection; a collection without a ledger in
/// the configuration is refused (exit 78).
async fn open(target: &TargetArgs, config: &Config) -> Result<(Store, Ledger), ExitCode> {
    let (spec, store) = target.open_ledger(config).await?;
    let ledger = Ledger::new(&store, spec).with_retry_horizon(config.writer.retry_horizon);
    Ok((store, ledger))
}

pub(super) async fn record(args: RecordArgs, config: &Config) -> ExitCode {
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match (&args.from, &args.event, &args.key) {
        (Some(from), _, _) => record_from(from, &ledger, args.target.json, &config.secrets()).await,
        (None, Some(event), Some(key)) => {
            let recording = ledger.record(event.as_str(), key.as_str(), args.by).await;
            print_one(&recording, &ledger, args.target.json, &config.secrets())
        }
        _ => fail(
            args.target.json,
            "give EVENT and KEY, or --from FILE",
            &config.secrets(),
            EXIT_USAGE,
        ),
    };
    store.shutdown().await;
    code
}

/// What a recording means for the exit code and for the person reading.
fn judged(recording: &Recording, secrets: &Secrets) -> (u8, String) {
    match recording {
        Recording::Recorded(_) => (EXIT_OK, "recorded: it will be counted once".to_owned()),
        Recording::Duplicate(_) => (
            EXIT_OK,
            "duplicate: recorded before with the same counter and amount; counted once".to_owned(),
        ),
        Recording::Conflict(conflict) => (EXIT_FAILED, format!("conflict: {conflict}")),
        Recording::Unknown(ticket) => (
            EXIT_TEMPFAIL,
            format!(
                "unknown: the insert may or may not have landed ({}); run the same command again",
                ticket
                    .cause()
                    .map_or_else(String::new, |c| secrets.scrub(&c.to_string()))
            ),
        ),
        Recording::NotRecorded(not) => (
            exit_code_for(not.cause()),
            format!("not recorded: {}", secrets.scrub(&not.cause().to_string())),
        ),
    }
}

/// A recording as one JSON object.
fn as_json(recording: &Recording, ledger: &Ledger, text: &str, code: u8) -> Value {
    let event = recording.event();
    let mut out = json!({
        "outcome": recording.name(),
        "event": event.key(),
        "key": event.counter().clone().into_relaxed_extjson(),
        "amount": event.amount(),
        "collection": ledger.spec().name,
        "events_collection": ledger.spec().events_collection_name(),
    });
    if let Recording::Conflict(conflict) = recording {
        out["recorded_key"] = conflict.stored_counter().clone().into_relaxed_extjson();
        out["recorded_amount"] = json!(conflict.stored_amount());
    }
    if code != EXIT_OK {
        out["error"] = json!(text);
    }
    out
}

fn print_one(recording: &Recording, ledger: &Ledger, json: bool, secrets: &Secrets) -> ExitCode {
    let (code, text) = judged(recording, secrets);
    let event = recording.event();
    let what = format!(
        "event {} on {}/{} by {}",
        crate::document::shown(event.key()),
        ledger.spec().name,
        display_id(event.counter()),
        event.amount()
    );
    if json {
        out!("{}", as_json(recording, ledger, &text, code));
    } else if code == EXIT_OK {
        out!("{text}: {what}");
    } else {
        eprintln!("{text} ({what})");
    }
    ExitCode::from(code)
}

/// One line of a `--from` file, read.
type Line = Result<(String, Bson, i64), String>;

/// Reads one line of a `--from` file as an event.
fn parse_line(text: &str) -> Line {
    let value: Value =
        serde_json::from_str(text).map_err(|err| format!("not a JSON object: {err}"))?;
    let Value::Object(fields) = value else {
        return Err("not a JSON object".into());
    };
    if let Some(unknown) = fields
        .keys()
        .find(|k| !["event", "key", "by"].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown field {unknown:?} (expected event, key and by)"
        ));
    }
    let event = match fields.get("event") {
        Some(Value::String(event)) => event.clone(),
        Some(_) => return Err("\"event\" must be a string".into()),
        None => return Err("\"event\" is missing".into()),
    };
    let key = match fields.get("key") {
        None => return Err("\"key\" is missing".into()),
        Some(key) => Bson::try_from(key.clone())
            .map_err(|err| format!("\"key\" is not a value a counter key can be: {err}"))?,
    };
    let by = match fields.get("by") {
        None => 1,
        Some(by) => by
            .as_i64()
            .ok_or("\"by\" must be an integer (a 64-bit signed one)")?,
    };
    Ok((event, key, by))
}

/// How `--from` went, outcome by outcome.
#[derive(Debug, Default)]
struct Tally {
    recorded: u64,
    duplicate: u64,
    conflict: u64,
    unknown: u64,
    not_recorded: u64,
    malformed: u64,
}

impl Tally {
    fn add(&mut self, recording: &Recording) {
        match recording {
            Recording::Recorded(_) => self.recorded += 1,
            Recording::Duplicate(_) => self.duplicate += 1,
            Recording::Conflict(_) => self.conflict += 1,
            Recording::Unknown(_) => self.unknown += 1,
            Recording::NotRecorded(_) => self.not_recorded += 1,
        }
    }

    fn lines(&self) -> u64 {
        self.recorded
            + self.duplicate
            + self.conflict
            + self.unknown
            + self.not_recorded
            + self.malformed
    }

    fn code(&self) -> u8 {
        if self.conflict + self.not_recorded + self.malformed > 0 {
            EXIT_FAILED
        } else if self.unknown > 0 {
            EXIT_TEMPFAIL
        } else {
            EXIT_OK
        }
    }

    fn summary(&self) -> String {
        format!(
            "{} recorded, {} duplicates, {} conflicts, {} unknown, {} not recorded, {} malformed \
             lines",
            self.recorded,
            self.duplicate,
            self.conflict,
            self.unknown,
            self.not_recorded,
            self.malformed
        )
    }
}

/// `record --from`: every line of `from`, in batches.
async fn record_from(from: &str, ledger: &Ledger, json: bool, secrets: &Secrets) -> ExitCode {
    let file = if from == "-" {
        None
    } else {
        match std::fs::File::open(from) {
            Ok(file) => Some(file),
            Err(err) => {
                let message = format!("cannot read {from}: {err}");
                return fail(json, &message, secrets, EXIT_USAGE);
            }
        }
    };
    let mut lines = read_lines(file);
    let progress = !json && std::io::stderr().is_terminal();
    let mut tally = Tally::default();
    loop {
        let (batch, finished) = next_batch(&mut lines).await;
        if !batch.is_empty() {
            record_batch(batch, ledger, json, secrets, &mut tally).await;
            if progress {
                eprint!("\r{} lines: {}", tally.lines(), tally.summary());
            }
        }
        if finished {
            break;
        }
    }
    if progress {
        eprintln!();
    }
    if !json {
        let shown = format!("{from}: {}", tally.summary());
        if tally.code() == EXIT_OK {
            out!("{shown}");
        } else {
            eprintln!("{shown}");
        }
    }
    ExitCode::from(tally.code())
}

/// Reads `file` (standard input when `None`) on a thread of its own, line
/// by line, numbered, the blank ones left out: a blocking read never holds
/// up the recording of the lines before it. At most two batches wait
/// unread, so a fast file is read no further ahead than that.
fn read_lines(file: Option<std::fs::File>) -> mpsc::Receiver<(u64, Line)> {
    let (sender, receiver) = mpsc::channel(2 * FROM_BATCH);
    std::thread::spawn(move || {
        let input: Box<dyn BufRead> = match file {
            Some(file) => Box::new(std::io::BufReader::new(file)),
            None => Box::new(std::io::stdin().lock()),
        };
        for (number, read) in (1u64..).zip(input.lines()) {
            let (line, last) = match read {
                Ok(text) if text.trim().is_empty() => continue,
                Ok(text) => (parse_line(&text), false),
                // A line that is not UTF-8 was read past; any other error
                // ends the input (reading on could fail forever).
                Err(err) => (
                    Err(format!("cannot read the line: {err}")),
                    err.kind() != std::io::ErrorKind::InvalidData,
                ),
            };
            if sender.blocking_send((number, line)).is_err() || last {
                break;
            }
        }
    });
    receiver
}

/// The next batch of lines: up to [`FROM_BATCH`], those read within
/// [`FROM_WAIT`] of its first; and whether the input has ended.
async fn next_batch(lines: &mut mpsc::Receiver<(u64, Line)>) -> (Vec<(u64, Line)>, bool) {
    let Some(first) = lines.recv().await else {
        return (Vec::new(), true);
    };
    let due = tokio::time::Instant::now() + FROM_WAIT;
    let mut batch = vec![first];
    while batch.len() < FROM_BATCH {
        match tokio::time::timeout_at(due, lines.recv()).await {
            Ok(Some(line)) => batch.push(line),
            Ok(None) => return (batch, true),
            Err(_) => break,
        }
    }
    (batch, false)
}

/// Records the well-formed lines of `lines` with one `record_many`, and
/// reports every line.
async fn record_batch(
    lines: Vec<(u64, Line)>,
    ledger: &Ledger,
    json: bool,
    secrets: &Secrets,
    tally: &mut Tally,
) {
    let events: Vec<(String, Bson, i64)> = lines
        .iter()
        .filter_map(|(_, line)| line.as_ref().ok().cloned())
        .collect();
    let mut outcomes = ledger.record_many(events).await.into_iter();
    for (number, line) in lines {
        match line {
            Err(why) => {
                tally.malformed += 1;
                if json {
                    out!(
                        "{}",
                        json!({ "line": number, "outcome": "malformed", "error": why })
                    );
                } else {
                    eprintln!("line {number}: malformed, not recorded: {why}");
                }
            }
            Ok(_) => {
                let recording = outcomes.next().expect("one outcome per event");
                tally.add(&recording);
                let (code, text) = judged(&recording, secrets);
                if json {
                    let mut shown = as_json(&recording, ledger, &text, code);
                    shown["line"] = json!(number);
                    out!("{shown}");
                } else if code != EXIT_OK {
                    eprintln!(
                        "line {number}: {text} (event {})",
                        crate::document::shown(recording.event().key())
                    );
                }
            }
        }
    }
}

pub(super) async fn get(args: GetArgs, config: &Config) -> ExitCode {
    let (store, ledger) = match open(&args.target, config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match ledger.value(args.key.as_str()).await {
        Ok(value) => {
            if args.target.json {
                out!(
                    "{}",
                    json!({
                        "key": args.key,
                        "value": value.value,
                        "folded": value.folded,
                        "unfolded": value.unfolded,
                        "unfolded_events": value.unfolded_events,
                    })
                );
            } else {
                out!(
                    "{}/{}: {} ({} folded, {} in {} unfolded events)",
                    ledger.spec().name,
                    crate::document::shown(&args.key),
                    value.value,
                    value.folded,
                    value.unfolded,
                    value.unfolded_events
                );
            }
            ExitCode::from(EXIT_OK)
        }
        Err(err) => fail(
            args.target.json,
            &store.explain(&err),
            &config.secrets(),
            exit_code_for(&err),
        ),
    };
    store.shutdown().await;
    code
}

/// `status`'s ledger lines: per collection with a ledger, its backlog
/// (unfolded events, the oldest one's age, the held sums) and the indexes
/// it lacks.
pub(super) async fn backlogs(
    store: &Store,
    config: &Config,
    names: &[String],
    now: SystemTime,
) -> Result<Vec<Value>, Error> {
    let mut rows = Vec::new();
    for name in names {
        let spec = config.collection(name);
        if spec.events_collection.is_none() {
            continue;
        }
        let ledger = Ledger::new(store, spec.clone());
        let missing = ledger.missing_indexes().await?;
        let events = spec.events_collection_name();
        let backlog = EventFold::new(store, spec, EventFoldSettings::default())
            .backlog(now)
            .await?;
        let held: Vec<Value> = backlog
            .held
            .iter()
            .map(|h| json!({ "key": display_id(&h.key), "pass": h.pass, "amount": h.amount, "events": h.events, "cause": h.cause }))
            .collect();
        rows.push(json!({
            "collection": name,
            "events_collection": events,
            "unfolded_events": backlog.events,
            "oldest_unfolded_age_seconds": backlog.oldest_age.map(|a| a.as_secs()),
            "held_sums": held,
            "missing_indexes": missing,
        }));
    }
    Ok(rows)
}

/// Prints [`backlogs`] as text.
pub(super) fn print_backlogs(rows: &[Value]) {
    for row in rows {
        let oldest = row["oldest_unfolded_age_seconds"].as_u64().map_or_else(
            || "-".to_owned(),
            |s| humantime::format_duration(Duration::from_secs(s)).to_string(),
        );
        let missing: Vec<&str> = row["missing_indexes"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let indexes = if missing.is_empty() {
            "indexes ok".to_owned()
        } else {
            format!("missing indexes {} (run tallyd setup)", missing.join(", "))
        };
        let held = row["held_sums"].as_array().map_or(0, Vec::len);
        let held = if held == 0 {
            String::new()
        } else {
            let keys: Vec<&str> = row["held_sums"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|h| h["key"].as_str())
                .collect();
            format!(
                "; {held} sums held by counters that refused them ({})",
                keys.join(", ")
            )
        };
        out!(
            "ledger {}: {} unfolded events, oldest {oldest}{held}; {indexes}",
            row["events_collection"].as_str().unwrap_or_default(),
            row["unfolded_events"],
        );
    }
}
