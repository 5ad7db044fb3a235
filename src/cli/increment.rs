//! `tallyd incr`: the two-step increment here, the lanes protocol in
//! [`super::lane`]; `--lane` and `--two-step` choose, else `[writer]
//! protocol`. `complete` and `resume` are in [`super::settle`]; what every
//! one of them prints is here.
//!
//! Every outcome, as text or `--json`, says the amount and shows the
//! increment's ticket ([`crate::write::ticket`]): its token (or lane and
//! number) with a check over the collection, key and amount. Every hint to
//! run another command repeats the ticket, the amount (`--by N`) and the
//! protocol (`--lane`, `--two-step`), so following a hint settles the
//! increment that was made, not a `+1`, and with the protocol that made it.

use crate::cli::out;
use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use mongodb::bson::Bson;
use mongodb::bson::oid::ObjectId;
use serde_json::{Value, json};

use super::{
    EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, EXIT_USAGE, TargetArgs, exit_code_for, fail,
    lane, shown_command,
};
use crate::config::Config;
use crate::error::Error;
use crate::redact::Secrets;
use crate::store::Store;
use crate::write::counter::{CollectionConfig, Counters, Increment, Protocol, WriterConfig};
use crate::write::ticket::{Settles, Ticket};

/// `--lane` or `--two-step`: the protocol of `incr`, else `[writer]
/// protocol`.
#[derive(Debug, Clone, Copy, Args)]
pub(crate) struct ProtocolArgs {
    /// Use the lanes protocol: one round trip through a fresh lane; its
    /// token is the lane. Overrides `[writer] protocol`.
    #[arg(long, conflicts_with = "two_step")]
    pub(crate) lane: bool,
    /// Use the two-step increment (a pending token). Overrides `[writer]
    /// protocol`.
    #[arg(long)]
    pub(crate) two_step: bool,
}

impl ProtocolArgs {
    /// The protocol chosen: the flag, else `configured`.
    fn chosen(self, configured: Protocol) -> Protocol {
        match (self.lane, self.two_step) {
            (true, _) => Protocol::Lanes,
            (_, true) => Protocol::TwoStep,
            _ => configured,
        }
    }
}

/// `--by N` of a new increment or event: a whole number, not zero (a zero
/// adds nothing and is refused before anything connects, as a zero
/// `--block` is).
pub(super) fn amount(text: &str) -> Result<i64, String> {
    match text.parse::<i64>() {
        Ok(0) => Err("the amount must not be zero: pass a whole number such as 1 or -1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{} is not a whole number from {} to {}: pass one such as 1 or -1",
            crate::document::shown(text),
            i64::MIN,
            i64::MAX
        )),
    }
}

/// `tallyd incr KEY [--by N] [--lane | --two-step]`.
#[derive(Debug, Args)]
pub(crate) struct IncrArgs {
    /// The counter's `_id` (a string, not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) key: String,
    /// The amount to add; negative subtracts; not zero.
    #[arg(
        long,
        default_value_t = 1,
        allow_negative_numbers = true,
        value_parser = amount
    )]
    pub(crate) by: i64,
    /// When the event happened, for a collection with buckets: RFC 3339
    /// (2026-11-28T14:30:00Z, 2026-11-28T15:30:00+01:00) or a date
    /// (2026-11-28, its midnight in the collection's time zone); counted in
    /// the bucket holding it. Default: now.
    #[arg(long, value_name = "TIME")]
    pub(crate) at: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) protocol: ProtocolArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// Whether a command writes an event (its time defaults to now) or
/// settles one (its bucket must be given: it is the event's, not now's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Timed {
    Write,
    Settle,
}

/// `--at TIME` read in `spec`'s buckets: `None` for a collection without
/// buckets, else the time (now when a write gives none). Refused as a
/// usage error (64): a time that is neither form, a time for a collection
/// without buckets, a settle of a bucketed counter without one.
pub(super) fn time_given(
    spec: &CollectionConfig,
    at: Option<&str>,
    timed: Timed,
) -> Result<Option<SystemTime>, String> {
    let Some(buckets) = &spec.buckets else {
        return match at {
            None => Ok(None),
            Some(_) => Err(format!(
                "--at: collection {} has no buckets, so its counters carry no time; give its \
                 [[collections]] entry a bucket (minute, hour, day or month), or leave --at out",
                spec.name
            )),
        };
    };
    match (at, timed) {
        (Some(text), _) => buckets
            .parse_time(text)
            .map(Some)
            .map_err(|err| format!("--at: {err}")),
        (None, Timed::Write) => Ok(Some(SystemTime::now())),
        (None, Timed::Settle) => Err(format!(
            "--at: collection {} counts by {} buckets, and a counter is settled in its bucket: \
             give --at as the increment's hint printed it (the bucket's start)",
            spec.name,
            buckets.width()
        )),
    }
}

/// Everything a command needs to talk to one collection.
pub(super) struct Target {
    store: Store,
    pub(super) counters: Counters,
    pub(super) spec: CollectionConfig,
    json: bool,
    pub(super) secrets: Secrets,
    /// `[writer]`: its protocol (the default of `incr` and `resume`) and
    /// horizons.
    pub(super) writer: WriterConfig,
    /// `--collection NAME` (and `--any-collection` when it was given, and
    /// `--at` with the bucket's start in a bucketed collection), as a
    /// printed command repeats them.
    pub(super) collection_options: String,
    /// The start of the bucket this command writes or settles, in a
    /// collection with buckets ([`Target::in_bucket_of`]).
    pub(super) bucket: Option<SystemTime>,
}

impl Target {
    /// The same target writing or settling the bucket holding `at` (a
    /// collection without buckets: `None`, its plain keys), which every
    /// hint it prints repeats as `--at`.
    pub(super) fn in_bucket_of(mut self, at: Option<SystemTime>) -> Result<Self, String> {
        let (Some(buckets), Some(at)) = (&self.spec.buckets, at) else {
            return Ok(self);
        };
        let start = buckets.start_of(at).map_err(|err| format!("--at: {err}"))?;
        self.collection_options
            .push_str(&format!(" --at {}", buckets.show_time(start)));
        self.bucket = Some(start);
        Ok(self)
    }

    /// The counter document's `_id`: `key`, or its bucket's `{k, t}`.
    pub(super) fn id(&self, key: &str) -> Bson {
        match self.bucket {
            Some(start) => crate::write::at::bucket_id(key.into(), start),
            None => Bson::from(key),
        }
    }

    /// The bucket's start as printed (RFC 3339 in the collection's zone).
    pub(super) fn bucket_shown(&self) -> Option<String> {
        let (buckets, start) = (self.spec.buckets.as_ref()?, self.bucket?);
        Some(buckets.show_time(start))
    }

    /// `collection/key` as messages name the counter, with its bucket in
    /// words: `views/home in the day from 2026-11-28T00:00:00+01:00`.
    pub(super) fn place(&self, key: &str) -> String {
        let place = format!("{}/{}", self.spec.name, crate::document::shown(key));
        match (&self.spec.buckets, self.bucket_shown()) {
            (Some(buckets), Some(start)) => {
                format!("{place} in the {} from {start}", buckets.width())
            }
            _ => place,
        }
    }

    /// The ticket of an increment of `amount` to `key`: the token `id`,
    /// settled as `settles` says, or the minted lane `id` at `position`.
    pub(super) fn ticket(
        &self,
        key: &str,
        id: ObjectId,
        position: Option<i64>,
        amount: i64,
        settles: Settles,
    ) -> String {
        let key = self.id(key);
        self.counters
            .issue_ticket(&key, id, position, amount, settles)
            .to_string()
    }

    /// `err` as people read it: where the operation went, secrets removed.
    pub(super) fn explain(&self, err: &Error) -> String {
        self.secrets.scrub(&self.store.explain(err))
    }

    /// `err` for `--json`: its class, the server's code and code name when
    /// it answered with one, and the message [`Target::explain`] gives.
    pub(super) fn error_json(&self, err: &Error) -> Value {
        let mut shown = error_json(err, &self.secrets);
        shown["message"] = json!(self.explain(err));
        shown
    }

    /// Shuts the client down in order, so that no driver clean-up is left
    /// running when the runtime stops at exit.
    pub(super) async fn close(self) {
        let Self {
            store, counters, ..
        } = self;
        drop(counters);
        store.shutdown().await;
    }
}

pub(super) async fn open(target: &TargetArgs, config: &Config) -> Result<Target, ExitCode> {
    let secrets = config.secrets();
    let (spec, store) = target.open(config).await?;
    let counters = match Counters::try_new(&store, spec.clone(), config.writer) {
        Ok(counters) => counters,
        // The configuration's `[writer]` settings do not fit together.
        Err(err) => {
            store.shutdown().await;
            return Err(fail(target.json, &err.to_string(), &secrets, EXIT_CONFIG));
        }
    };
    Ok(Target {
        collection_options: target.collection_options(&spec.name),
        counters,
        store,
        spec,
        json: target.json,
        secrets,
        writer: config.writer,
        bucket: None,
    })
}

/// [`open`], for a command given `--at` (`at`): the target in that
/// bucket, the time read; a time refused is a usage error (64), refused
/// before anything connects.
pub(super) async fn open_at(
    target: &TargetArgs,
    config: &Config,
    at: Option<&str>,
    timed: Timed,
) -> Result<(Target, Option<SystemTime>), ExitCode> {
    let usage = |message: &str| fail(target.json, message, &config.secrets(), EXIT_USAGE);
    let spec = target
        .resolve(config, false)
        .map_err(|(message, code)| fail(target.json, &message, &config.secrets(), code))?;
    let time = time_given(&spec, at, timed).map_err(|message| usage(&message))?;
    let opened = open(target, config).await?;
    match opened.in_bucket_of(time) {
        Ok(opened) => Ok((opened, time)),
        Err(message) => Err(usage(&message)),
    }
}

pub(super) async fn incr(args: IncrArgs, config: &Config) -> ExitCode {
    let (target, at) = match open_at(&args.target, config, args.at.as_deref(), Timed::Write).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let code = match args.protocol.chosen(target.writer.protocol) {
        Protocol::TwoStep => {
            let key = args.key.as_str();
            let outcome = match at {
                Some(at) => target.counters.increment_at(key, args.by, at).await,
                None => target.counters.increment(key, args.by).await,
            };
            report_increment(&target, &args.key, &outcome, None)
        }
        Protocol::Lanes => lane::incr(&target, &args.key, args.by, at).await,
    };
    target.close().await;
    code
}

/// What every outcome shows about the increment: its key, token (with
/// `--lane`, the lane), ticket (`None` for a bare token typed), amount
/// (`None` when `complete` could not learn it), and the protocol.
pub(super) struct Shown<'a> {
    pub(super) key: &'a str,
    pub(super) token: Option<String>,
    pub(super) ticket: Option<String>,
    pub(super) amount: Option<i64>,
    pub(super) protocol: Protocol,
}

impl<'a> Shown<'a> {
    /// The increment a command was given: `key`, the `ticket` typed, the
    /// amount.
    pub(super) fn given(key: &'a str, ticket: &Ticket, amount: Option<i64>) -> Self {
        Self {
            key,
            token: Some(ticket.token().to_string()),
            ticket: ticket.is_checked().then(|| ticket.to_string()),
            amount,
            protocol: ticket.protocol(),
        }
    }
}

/// Prints an outcome decided by an error: `text: cause` or JSON.
pub(super) fn print_failure(
    target: &Target,
    shown: &Shown<'_>,
    outcome: &str,
    err: &Error,
    text: &str,
    code: u8,
) -> ExitCode {
    let text = format!("{text}: {}", target.explain(err));
    let fields = json!({ "outcome": outcome, "error": target.error_json(err) });
    print(target, shown, fields, &text, code)
}

/// Prints `outcome` of an increment of `key`, or of a settle of the
/// ticket `given`.
pub(super) fn report_increment(
    target: &Target,
    key: &str,
    outcome: &Increment,
    given: Option<&Ticket>,
) -> ExitCode {
    let place = target.place(key);
    let token = outcome.token();
    let amount = outcome.amount();
    // Only an unknown increment's ticket is resumable: a resume could count
    // a pending or counted token twice. A settle keeps the ticket it was
    // given (checked): the settles' writes leave the token's marker, so it
    // stays as resumable as it was.
    let settles = match outcome {
        Increment::Unknown(_) => Settles::Resume,
        _ => Settles::Complete,
    };
    let ticket = match given {
        Some(given) if given.is_checked() => Some(given.to_string()),
        _ => token.map(|t| target.ticket(key, t.object_id(), None, amount, settles)),
    };
    let shown_ticket = ticket.clone().unwrap_or_default();
    let cause = outcome
        .cause()
        .map(|err| target.explain(err))
        .unwrap_or_default();
    let (text, code) = match outcome {
        Increment::Counted(counted) => (
            counted_text(
                &place,
                amount,
                "ticket",
                &shown_ticket,
                counted.settled_earlier(),
            ),
            EXIT_OK,
        ),
        Increment::Pending(_) => (
            format!(
                "pending: ticket {shown_ticket} ({amount:+}) is in {place} but not \
                 yet counted; run `{}` or let the daemon fold it. Cause: {cause}",
                shown_command(&format!(
                    "complete {} {shown_ticket}{}{}",
                    shell_word(key),
                    by_option(amount),
                    target.collection_options
                )),
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::Unknown(unknown)
            if unknown.token().age(SystemTime::now()) >= target.counters.retry_horizon() =>
        {
            (
                format!(
                    "unknown: ticket {shown_ticket} ({amount:+}) may or may not be in \
                     {place}, and it is past the retry horizon of {}: it is counted at \
                     most once (a resume would be refused). Cause: {cause}",
                    humantime::format_duration(target.counters.retry_horizon()),
                ),
                EXIT_FAILED,
            )
        }
        Increment::Unknown(_) => (
            format!(
                "unknown: ticket {shown_ticket} ({amount:+}) may or may not be in \
                 {place}; run `{}` soon (within the retry horizon of {}), \
                 after that it is counted at most once. Cause: {cause}",
                shown_command(&format!(
                    "resume {} {shown_ticket}{}{}{}",
                    shell_word(key),
                    by_option(amount),
                    protocol_flag(Protocol::TwoStep),
                    target.collection_options
                )),
                humantime::format_duration(target.counters.retry_horizon()),
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::NotCounted(not) => (
            format!("not counted ({amount:+}): {cause}"),
            exit_code_for(not.cause()),
        ),
    };
    let mut fields = json!({ "outcome": outcome.name() });
    if let Increment::Counted(counted) = outcome {
        fields["settled_earlier"] = json!(counted.settled_earlier());
    }
    if let Some(err) = outcome.cause() {
        fields["error"] = target.error_json(err);
    }
    let shown = Shown {
        key,
        token: token.map(|t| t.to_string()),
        ticket,
        amount: Some(amount),
        protocol: Protocol::TwoStep,
    };
    print(target, &shown, fields, &text, code)
}

/// The line of a counted outcome: `counted: views/k +5 (ticket …)` (the
/// counter's [`Target::place`]), said
/// to be counted earlier when a settle before this one had counted it.
pub(super) fn counted_text(
    place: &str,
    amount: i64,
    what: &str,
    id: &str,
    settled_earlier: bool,
) -> String {
    let earlier = if settled_earlier {
        ", counted earlier"
    } else {
        ""
    };
    format!("counted: {place} {amount:+} ({what} {id}{earlier})")
}

/// ` --lane` or ` --two-step` for a hint that must use `protocol`: always
/// given, since `[writer] protocol` may change before the hint is followed
/// (a two-step token resumed as a lane would count twice).
pub(super) fn protocol_flag(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Lanes => " --lane",
        Protocol::TwoStep => " --two-step",
    }
}

/// ` --by N` for a hint, or nothing for the default amount, 1.
pub(super) fn by_option(amount: i64) -> String {
    if amount == 1 {
        String::new()
    } else {
        format!(" --by {amount}")
    }
}

/// `word` as one shell word: as it is when it needs no quoting, else in
/// single quotes.
pub(super) fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:@%+=,".contains(c);
    if word.len() > crate::document::SHOWN_CHARS {
        // Too long to paste: shown shortened, as every message shows it.
        format!("'{}'", crate::document::shown(word).replace('\'', r"'\''"))
    } else if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else if word.chars().any(char::is_control) {
        // Bash's ANSI-C quoting: the control characters escaped, never
        // printed to the terminal.
        let escaped: String = word
            .chars()
            .map(|c| match c {
                '\'' => r"\'".to_owned(),
                '\\' => r"\\".to_owned(),
                c if c.is_ascii_control() => format!("\\x{:02x}", u32::from(c)),
                c if c.is_control() => format!("\\u{:04x}", u32::from(c)),
                c => c.to_string(),
            })
            .collect();
        format!("$'{escaped}'")
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

pub(super) fn print(
    target: &Target,
    shown: &Shown<'_>,
    mut fields: Value,
    text: &str,
    code: u8,
) -> ExitCode {
    if target.json {
        fields["collection"] = json!(target.spec.name);
        fields["key"] = json!(shown.key);
        fields["token"] = json!(shown.token);
        fields["ticket"] = json!(shown.ticket);
        fields["amount"] = json!(shown.amount);
        fields["protocol"] = json!(shown.protocol.as_str());
        if let Some(bucket) = target.bucket_shown() {
            fields["bucket"] = json!(bucket);
        }
        out!("{fields}");
    } else if code == EXIT_OK {
        out!("{text}");
    } else {
        eprintln!("{text}");
    }
    ExitCode::from(code)
}

/// `err` for `--json`: its class, the server's code and code name when it
/// answered with one, and its message for people (secrets removed).
pub(super) fn error_json(err: &Error, secrets: &Secrets) -> Value {
    let mut shown = json!({
        "class": err.class().map(|c| c.as_str()),
        "message": secrets.scrub(&err.to_string()),
    });
    if let Error::Server(failure) = err
        && let Some((code, name)) = crate::error::server_code_and_name(&failure.source)
    {
        shown["code"] = json!(code);
        shown["code_name"] = json!(name);
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_quote_what_the_shell_would_split() {
        assert_eq!(shell_word("home"), "home");
        assert_eq!(shell_word("user:42/a-b"), "user:42/a-b");
        assert_eq!(shell_word("two words"), "'two words'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("a\u{1b}[2J\n'b"), r"$'a\x1b[2J\x0a\'b'");
        assert!(shell_word(&"k".repeat(100_000)).ends_with("… (100000 bytes)'"));
        assert_eq!(by_option(1), "");
        assert_eq!(by_option(-5), " --by -5");
        assert_eq!(protocol_flag(Protocol::Lanes), " --lane");
        assert_eq!(protocol_flag(Protocol::TwoStep), " --two-step");
    }

    #[test]
    fn an_amount_that_is_not_a_number_is_named_and_zero_is_said_apart() {
        assert_eq!(amount("-5"), Ok(-5));
        let word = amount("abc").unwrap_err();
        assert!(word.starts_with("abc is not a whole number from"), "{word}");
        assert!(!word.contains("zero"), "{word}");
        assert!(
            amount("99999999999999999999")
                .unwrap_err()
                .contains("9223372036854775807")
        );
        assert!(amount("0").unwrap_err().contains("must not be zero"));
    }
}
