//! `tallyd incr`, `tallyd complete`, `tallyd resume`.

use std::process::ExitCode;

use clap::Args;
use serde_json::{Value, json};

use super::{EXIT_FAILED, EXIT_OK, EXIT_TEMPFAIL, TargetArgs, fail};
use crate::config::Config;
use crate::error::Error;
use crate::redact::Secrets;
use crate::store::Store;
use crate::token::Token;
use crate::write::counter::{CollectionConfig, Completion, Counters, Increment, UnknownToken};

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
    /// The amount of the original increment (used only if step 1 must be
    /// sent again).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// Everything a command needs to talk to one collection.
struct Target {
    counters: Counters,
    spec: CollectionConfig,
    json: bool,
    secrets: Secrets,
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
    report_increment(&target, &args.key, &outcome)
}

pub(super) async fn complete(args: CompleteArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let pending = match target
        .counters
        .find_pending(args.key.as_str(), args.token)
        .await
    {
        Ok(Some(pending)) => pending,
        Ok(None) => {
            let text = format!(
                "token {} is not pending in {}/{}: nothing to do (already counted, or never added)",
                args.token, target.spec.name, args.key
            );
            let fields = json!({ "outcome": "not_pending" });
            return print(&target, &args.key, Some(args.token), fields, &text, EXIT_OK);
        }
        Err(err) => {
            let text = "pending: could not look the token up, it stays pending";
            return print_failure(
                &target,
                &args.key,
                args.token,
                "pending",
                &err,
                text,
                EXIT_TEMPFAIL,
            );
        }
    };
    let outcome = match target.counters.complete(&pending).await {
        Completion::Counted(counted) => Increment::Counted(counted),
        Completion::Pending(pending) => Increment::Pending(pending),
    };
    report_increment(&target, &args.key, &outcome)
}

pub(super) async fn resume(args: ResumeArgs, config: &Config) -> ExitCode {
    let target = match open(&args.target, config).await {
        Ok(target) => target,
        Err(code) => return code,
    };
    let unknown = match UnknownToken::new(args.key.as_str(), args.token, args.by) {
        Ok(unknown) => unknown,
        Err(err) => return fail(target.json, &err.to_string(), &target.secrets),
    };
    match target.counters.resume(&unknown).await {
        Ok(outcome) => report_increment(&target, &args.key, &outcome),
        Err(err @ Error::RetryHorizonExceeded { .. }) => print_failure(
            &target,
            &args.key,
            args.token,
            "refused",
            &err,
            "refused",
            EXIT_FAILED,
        ),
        Err(err) => {
            let text = "unknown: could not read the counter, the token stays unknown";
            print_failure(
                &target,
                &args.key,
                args.token,
                "unknown",
                &err,
                text,
                EXIT_TEMPFAIL,
            )
        }
    }
}

/// Prints an outcome decided by an error: `text: cause` or JSON.
fn print_failure(
    target: &Target,
    key: &str,
    token: Token,
    outcome: &str,
    err: &Error,
    text: &str,
    code: u8,
) -> ExitCode {
    let text = format!("{text}: {}", target.secrets.scrub(&err.to_string()));
    let fields = json!({ "outcome": outcome, "error": error_json(err, &target.secrets) });
    print(target, key, Some(token), fields, &text, code)
}

fn report_increment(target: &Target, key: &str, outcome: &Increment) -> ExitCode {
    let collection = &target.spec.name;
    let token = outcome.token();
    let shown_token = token.map(|t| t.to_string()).unwrap_or_default();
    let cause = outcome
        .cause()
        .map(|err| target.secrets.scrub(&err.to_string()))
        .unwrap_or_default();
    let (text, code) = match outcome {
        Increment::Counted(counted) => (
            format!(
                "counted: {collection}/{key} {:+} (token {shown_token}{})",
                counted.amount(),
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
                "pending: token {shown_token} is in {collection}/{key} but not yet counted; run \
                 `tallyd complete {key} {shown_token} --collection {collection}` or let the \
                 daemon fold it. Cause: {cause}"
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::Unknown(_) => (
            format!(
                "unknown: token {shown_token} may or may not be in {collection}/{key}; run \
                 `tallyd resume {key} {shown_token} --collection {collection}` soon (within the \
                 retry horizon), after that it is counted at most once. Cause: {cause}"
            ),
            EXIT_TEMPFAIL,
        ),
        Increment::NotCounted(_) => (format!("not counted: {cause}"), EXIT_FAILED),
    };
    let mut fields = json!({ "outcome": outcome.name() });
    if let Increment::Counted(counted) = outcome {
        fields["amount"] = json!(counted.amount());
        fields["settled_earlier"] = json!(counted.settled_earlier());
    }
    if let Some(err) = outcome.cause() {
        fields["error"] = error_json(err, &target.secrets);
    }
    print(target, key, token, fields, &text, code)
}

fn print(
    target: &Target,
    key: &str,
    token: Option<Token>,
    mut fields: Value,
    text: &str,
    code: u8,
) -> ExitCode {
    if target.json {
        fields["collection"] = json!(target.spec.name);
        fields["key"] = json!(key);
        fields["token"] = token.map_or(Value::Null, |t| json!(t.to_string()));
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
