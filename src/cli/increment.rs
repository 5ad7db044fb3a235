//! `tallyd incr`, `tallyd complete`, `tallyd resume`: the two-step
//! increment here, the lanes protocol in [`super::lane`]; `--lane` and
//! `--two-step` choose, else `[writer] protocol`.
//!
//! Every outcome, as text or `--json`, says the amount; every hint to run
//! another command repeats it (`--by N`) and always names the protocol
//! (`--lane`, `--two-step`) — never relying on `[writer] protocol`, which
//! may change before the hint is followed — so following a hint settles the
//! increment that was made, not a `+1`, and with the protocol that made it.

use crate::cli::out;
use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use serde_json::{Value, json};

use super::{
    EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, TargetArgs, exit_code_for, fail, lane,
};
use crate::config::Config;
use crate::error::Error;
use crate::redact::Secrets;
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::{
    CollectionConfig, Counters, Found, Increment, Protocol, UnknownToken, WriterConfig,
};
use crate::write::lane::LaneId;

/// `--lane` or `--two-step`: the protocol of `incr` and `resume`, else
/// `[writer] protocol`.
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

/// `tallyd incr KEY [--by N] [--lane | --two-step]`.
#[derive(Debug, Args)]
pub(crate) struct IncrArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The amount to add; negative subtracts; not zero.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) protocol: ProtocolArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd complete KEY TOKEN`.
#[derive(Debug, Args)]
pub(crate) struct CompleteArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The pending token: 24 hex digits.
    pub(crate) token: Token,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd resume KEY TOKEN [--by N] [--lane | --two-step]`.
#[derive(Debug, Args)]
pub(crate) struct ResumeArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The token an increment reported as unknown: 24 hex digits (with
    /// `--lane`, the lane).
    pub(crate) token: Token,
    /// The amount of the original increment. A two-step resume whose amount
    /// differs from what the document holds for the token is refused; a
    /// lane resume adds what it is given, so give the increment's.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    /// The protocol that made the token: a token does not say which, so
    /// give the flag the increment's output shows, or rely on `[writer]
    /// protocol`. A token the document shows under the other protocol is
    /// refused.
    #[command(flatten)]
    pub(crate) protocol: ProtocolArgs,
    /// The lanes protocol only: the lane's position of the increment — 1
    /// (the default) for `incr --lane`, a library ticket's own otherwise
    /// (its display shows it). Refused, nothing written, when the lane
    /// holds a later position.
    #[arg(long)]
    pub(crate) position: Option<i64>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
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
}

impl Target {
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

async fn open(target: &TargetArgs, config: &Config) -> Result<Target, ExitCode> {
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
        counters,
        store,
        spec,
        json: target.json,
        secrets,
        writer: config.writer,
    })
}

pub(super) async fn incr(args: IncrArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let code = match args.protocol.chosen(target.writer.protocol) {
        Protocol::TwoStep => {
            let outcome = target.counters.increment(args.key.as_str(), args.by).await;
            report_increment(&target, &args.key, &outcome)
        }
        Protocol::Lanes => lane::incr(&target, &args.key, args.by).await,
    };
    target.close().await;
    code
}

pub(super) async fn complete(args: CompleteArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let code = match target.counters.lookup(args.key.as_str(), args.token).await {
        Ok(Found::Pending(pending)) => {
            let outcome = target.counters.complete(pending).await.into();
            report_increment(&target, &args.key, &outcome)
        }
        // A settle (`complete` or `resume`, here or elsewhere) counted it.
        Ok(Found::Settled(counted)) => {
            report_increment(&target, &args.key, &Increment::Counted(counted))
        }
        Ok(Found::Absent) => {
            let text = format!(
                "token {} is not pending in {}/{}: nothing to do (already counted, or never added)",
                args.token, target.spec.name, args.key
            );
            let fields = json!({ "outcome": "not_pending" });
            let shown = Shown::new(&args.key, args.token, None, Protocol::TwoStep);
            print(&target, &shown, fields, &text, EXIT_OK)
        }
        Err(err) => {
            let text = "pending: could not look the token up, it stays pending";
            let shown = Shown::new(&args.key, args.token, None, Protocol::TwoStep);
            print_failure(&target, &shown, "pending", &err, text, EXIT_TEMPFAIL)
        }
    };
    target.close().await;
    code
}

pub(super) async fn resume(args: ResumeArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let code = match (args.protocol.chosen(target.writer.protocol), args.position) {
        (Protocol::TwoStep, Some(_)) => {
            let err = Error::InvalidArgument(
                "--position is a lane's: a two-step token has none; nothing was written".into(),
            );
            let shown = Shown::new(&args.key, args.token, Some(args.by), Protocol::TwoStep);
            print_failure(&target, &shown, "refused", &err, "refused", EXIT_FAILED)
        }
        (Protocol::TwoStep, None) => resume_two_step(&target, &args).await,
        (Protocol::Lanes, position) => {
            let position = position.unwrap_or(1);
            lane::resume(&target, &args.key, args.token, args.by, position).await
        }
    };
    target.close().await;
    code
}

async fn resume_two_step(target: &Target, args: &ResumeArgs) -> ExitCode {
    let shown = Shown::new(&args.key, args.token, Some(args.by), Protocol::TwoStep);
    let refuse =
        |err: &Error| print_failure(target, &shown, "refused", err, "refused", EXIT_FAILED);
    let unknown = match UnknownToken::new(args.key.as_str(), args.token, args.by) {
        Ok(unknown) => unknown,
        Err(err) => return refuse(&err),
    };
    // Resuming a lane's increment as a two-step token would add it again.
    let key = mongodb::bson::Bson::from(args.key.as_str());
    let lane = LaneId::Minted(args.token.object_id());
    match target.counters.lane_position(&key, &lane).await {
        Ok(None) => {}
        Ok(Some(_)) => return refuse(&other_protocol(args.token, Protocol::Lanes)),
        // Nothing was written: the ticket is as unknown as it was (past
        // the retry horizon, with no resume hint).
        Err(err) => {
            let outcome = Increment::Unknown(unknown.because(err));
            return report_increment(target, &args.key, &outcome);
        }
    }
    match target.counters.resume(unknown).await {
        Ok(outcome) => report_increment(target, &args.key, &outcome),
        // Past the retry horizon, or another amount than the document
        // holds: the ticket is finished, nothing was written.
        Err(err) => refuse(&err),
    }
}

/// The refusal of a token the counter shows under `protocol`, the other
/// one: resuming it with this one could count it twice.
pub(super) fn other_protocol(token: Token, protocol: Protocol) -> Error {
    let (what, flag) = match protocol {
        Protocol::Lanes => (
            "a lane of this counter (it holds the lane's entry)",
            "--lane",
        ),
        Protocol::TwoStep => (
            "a two-step token of this counter (pending or settled)",
            "--two-step",
        ),
    };
    Error::InvalidArgument(format!(
        "{token} is {what}: resume it with {flag}; nothing was written"
    ))
}

/// What every outcome shows about the increment: its key, token (with
/// `--lane`, the lane) and amount (`None` when `complete` could not learn
/// it), and the protocol.
pub(super) struct Shown<'a> {
    pub(super) key: &'a str,
    pub(super) token: Option<String>,
    pub(super) amount: Option<i64>,
    pub(super) protocol: Protocol,
}

impl<'a> Shown<'a> {
    pub(super) fn new(key: &'a str, token: Token, amount: Option<i64>, protocol: Protocol) -> Self {
        Self {
            key,
            token: Some(token.to_string()),
            amount,
            protocol,
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

fn report_increment(target: &Target, key: &str, outcome: &Increment) -> ExitCode {
    let collection = &target.spec.name;
    let token = outcome.token();
    let amount = outcome.amount();
    let shown_token = token.map(|t| t.to_string()).unwrap_or_default();
    let cause = outcome
        .cause()
        .map(|err| target.explain(err))
        .unwrap_or_default();
    let (text, code) = match outcome {
        Increment::Counted(counted) => (
            counted_text(
                collection,
                key,
                amount,
                "token",
                &shown_token,
                counted.settled_earlier(),
            ),
            EXIT_OK,
        ),
        Increment::Pending(_) => (
            format!(
                "pending: token {shown_token} ({amount:+}) is in {collection}/{key} but not yet \
                 counted; run `tallyd complete {} {shown_token} --collection {}` or let the \
                 daemon fold it. Cause: {cause}",
                shell_word(key),
                shell_word(collection),
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::Unknown(unknown)
            if unknown.token().age(SystemTime::now()) >= target.counters.retry_horizon() =>
        {
            (
                format!(
                    "unknown: token {shown_token} ({amount:+}) may or may not be in \
                     {collection}/{key}, and it is past the retry horizon of {}: it is counted at \
                     most once (a resume would be refused). Cause: {cause}",
                    humantime::format_duration(target.counters.retry_horizon()),
                ),
                EXIT_FAILED,
            )
        }
        Increment::Unknown(_) => (
            format!(
                "unknown: token {shown_token} ({amount:+}) may or may not be in \
                 {collection}/{key}; run `tallyd resume {} {shown_token}{}{} --collection {}` \
                 soon (within the retry horizon of {}), after that it is counted at most once. \
                 Cause: {cause}",
                shell_word(key),
                by_option(amount),
                protocol_flag(Protocol::TwoStep),
                shell_word(collection),
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
        amount: Some(amount),
        protocol: Protocol::TwoStep,
    };
    print(target, &shown, fields, &text, code)
}

/// The line of a counted outcome: `counted: views/k +5 (token …)`, said
/// to be counted earlier when a settle before this one had counted it.
pub(super) fn counted_text(
    collection: &str,
    key: &str,
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
    format!("counted: {collection}/{key} {amount:+} ({what} {id}{earlier})")
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
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
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
        fields["amount"] = json!(shown.amount);
        fields["protocol"] = json!(shown.protocol.as_str());
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
        assert_eq!(by_option(1), "");
        assert_eq!(by_option(-5), " --by -5");
        assert_eq!(protocol_flag(Protocol::Lanes), " --lane");
        assert_eq!(protocol_flag(Protocol::TwoStep), " --two-step");
    }
}
