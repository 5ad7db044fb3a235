//! `tallyd incr`, `tallyd complete`, `tallyd resume`.
//!
//! Every outcome, as text or `--json`, says the amount; every hint to run
//! another command repeats it (`--by N`), so following a hint settles the
//! increment that was made, not a `+1`.

use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use serde_json::{Value, json};

use super::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, TargetArgs, fail};
use crate::config::Config;
use crate::error::Error;
use crate::redact::Secrets;
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::{CollectionConfig, Counters, Found, Increment, UnknownToken};

/// `tallyd incr KEY [--by N]`.
#[derive(Debug, Args)]
pub(crate) struct IncrArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The amount to add; negative subtracts; not zero.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
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

/// `tallyd resume KEY TOKEN [--by N]`.
#[derive(Debug, Args)]
pub(crate) struct ResumeArgs {
    /// The counter's `_id` (a string).
    pub(crate) key: String,
    /// The token an increment reported as unknown: 24 hex digits.
    pub(crate) token: Token,
    /// The amount of the original increment. A resume whose amount differs
    /// from what the document holds for the token is refused.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// Everything a command needs to talk to one collection.
struct Target {
    store: Store,
    counters: Counters,
    spec: CollectionConfig,
    json: bool,
    secrets: Secrets,
}

impl Target {
    /// Shuts the client down in order, so that no driver clean-up is left
    /// running when the runtime stops at exit.
    async fn close(self) {
        let Self {
            store, counters, ..
        } = self;
        drop(counters);
        store.shutdown().await;
    }
}

async fn open(target: &TargetArgs, config: &Config) -> Result<Target, ExitCode> {
    let secrets = config.secrets();
    let spec = target
        .resolve(config)
        .map_err(|message| fail(target.json, &message, &secrets))?;
    let store = Store::connect(&config.mongodb)
        .await
        .map_err(|err| fail(target.json, &err.to_string(), &secrets))?;
    Ok(Target {
        counters: Counters::new(&store, spec.clone(), config.writer),
        store,
        spec,
        json: target.json,
        secrets,
    })
}

pub(super) async fn incr(args: IncrArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let outcome = target.counters.increment(args.key.as_str(), args.by).await;
    let code = report_increment(&target, &args.key, &outcome);
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
            let shown = Shown::new(&args.key, args.token, None);
            print(&target, &shown, fields, &text, EXIT_OK)
        }
        Err(err) => {
            let text = "pending: could not look the token up, it stays pending";
            let shown = Shown::new(&args.key, args.token, None);
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
    let shown = Shown::new(&args.key, args.token, Some(args.by));
    let code = match UnknownToken::new(args.key.as_str(), args.token, args.by) {
        Ok(unknown) => match target.counters.resume(unknown).await {
            Ok(outcome) => report_increment(&target, &args.key, &outcome),
            // Past the retry horizon, or another amount than the document
            // holds: the ticket is finished, nothing was written.
            Err(err) => print_failure(&target, &shown, "refused", &err, "refused", EXIT_FAILED),
        },
        Err(err) => print_failure(&target, &shown, "refused", &err, "refused", EXIT_FAILED),
    };
    target.close().await;
    code
}

/// What every outcome shows about the increment: its key, token and amount
/// (`None` when `complete` could not learn it).
struct Shown<'a> {
    key: &'a str,
    token: Option<Token>,
    amount: Option<i64>,
}

impl<'a> Shown<'a> {
    fn new(key: &'a str, token: Token, amount: Option<i64>) -> Self {
        Self {
            key,
            token: Some(token),
            amount,
        }
    }
}

/// Prints an outcome decided by an error: `text: cause` or JSON.
fn print_failure(
    target: &Target,
    shown: &Shown<'_>,
    outcome: &str,
    err: &Error,
    text: &str,
    code: u8,
) -> ExitCode {
    let text = format!("{text}: {}", target.secrets.scrub(&err.to_string()));
    let fields = json!({ "outcome": outcome, "error": error_json(err, &target.secrets) });
    print(target, shown, fields, &text, code)
}

fn report_increment(target: &Target, key: &str, outcome: &Increment) -> ExitCode {
    let collection = &target.spec.name;
    let token = outcome.token();
    let amount = outcome.amount();
    let shown_token = token.map(|t| t.to_string()).unwrap_or_default();
    let cause = outcome
        .cause()
        .map(|err| target.secrets.scrub(&err.to_string()))
        .unwrap_or_default();
    let (text, code) = match outcome {
        Increment::Counted(counted) => (
            format!(
                "counted: {collection}/{key} {amount:+} (token {shown_token}{})",
                if counted.settled_earlier() {
                    ", counted earlier"
                } else {
                    ""
                }
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
                 {collection}/{key}; run `tallyd resume {} {shown_token}{} --collection {}` soon \
                 (within the retry horizon of {}), after that it is counted at most once. \
                 Cause: {cause}",
                shell_word(key),
                by_option(amount),
                shell_word(collection),
                humantime::format_duration(target.counters.retry_horizon()),
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::NotCounted(_) => (format!("not counted ({amount:+}): {cause}"), EXIT_FAILED),
    };
    let mut fields = json!({ "outcome": outcome.name() });
    if let Increment::Counted(counted) = outcome {
        fields["settled_earlier"] = json!(counted.settled_earlier());
    }
    if let Some(err) = outcome.cause() {
        fields["error"] = error_json(err, &target.secrets);
    }
    let shown = Shown {
        key,
        token,
        amount: Some(amount),
    };
    print(target, &shown, fields, &text, code)
}

/// ` --by N` for a hint, or nothing for the default amount, 1.
fn by_option(amount: i64) -> String {
    if amount == 1 {
        String::new()
    } else {
        format!(" --by {amount}")
    }
}

/// `word` as one shell word: as it is when it needs no quoting, else in
/// single quotes.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./:@%+=,".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn print(target: &Target, shown: &Shown<'_>, mut fields: Value, text: &str, code: u8) -> ExitCode {
    if target.json {
        fields["collection"] = json!(target.spec.name);
        fields["key"] = json!(shown.key);
        fields["token"] = shown.token.map_or(Value::Null, |t| json!(t.to_string()));
        fields["amount"] = json!(shown.amount);
        println!("{fields}");
    } else if code == EXIT_OK {
        println!("{text}");
    } else {
        eprintln!("{text}");
    }
    ExitCode::from(code)
}

fn error_json(err: &Error, secrets: &Secrets) -> Value {
    json!({
        "class": err.class().map(|c| c.as_str()),
        "message": secrets.scrub(&err.to_string()),
    })
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
    }
}
