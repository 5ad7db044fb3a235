//! `tallyd complete` and `tallyd resume`: settling an increment by the
//! ticket it printed ([`crate::write::ticket`]).
//!
//! Both verify the ticket's check against `--collection`, the key and
//! `--by` before anything is read or written, so a key pasted wrong is
//! refused (exit 1) instead of counted there. `resume` takes only a checked
//! ticket, of an unknown increment (a counted or pending one's could be
//! counted twice: a resume re-sends step 1 for a token the document does
//! not show), and goes by its shape for the protocol — never by `[writer]
//! protocol`; a flag that contradicts the shape is a usage error (64).
//! `complete` also takes a bare token: it only ever runs step 2 on a token
//! pending in the document, and compares `--by`, when given, with the
//! amount the document holds.

use std::process::ExitCode;

use clap::Args;
use serde_json::json;

use super::increment::{
    Shown, Target, Timed, by_option, open_at, print, print_failure, report_increment, shell_word,
};
use super::{EXIT_FAILED, EXIT_OK, EXIT_USAGE, TargetArgs, fail, lane, shown_command};
use crate::config::Config;
use crate::error::Error;
use crate::token::Token;
use crate::write::counter::{Found, Increment, Protocol, UnknownToken};
use crate::write::lane::LaneId;
use crate::write::ticket::{Names, Settles, Ticket};

/// `tallyd complete KEY TICKET [--by N]`.
#[derive(Debug, Args)]
pub(crate) struct CompleteArgs {
    /// The counter's `_id` (a string, not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) key: String,
    /// The ticket the increment printed (TOKEN-CHECK), or the bare pending
    /// token (24 hex digits). A ticket whose check does not match the key,
    /// --by and --collection is refused, nothing written.
    pub(crate) ticket: Ticket,
    /// The increment's amount [default: 1]: checked against the ticket's
    /// check, and against the amount the document holds for the token
    /// (for a bare token, only when given).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) by: Option<i64>,
    /// The bucket's start as the increment's hint printed it, in a
    /// collection with buckets (required there): the counter is settled in
    /// the bucket it was written to.
    #[arg(long, value_name = "TIME")]
    pub(crate) at: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `tallyd resume KEY TICKET [--by N]`.
#[derive(Debug, Args)]
pub(crate) struct ResumeArgs {
    /// The counter's `_id` (a string, not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) key: String,
    /// The ticket the increment printed: TOKEN-CHECK for a two-step token,
    /// LANE.NUMBER-CHECK for a lane. Its check covers the key, --by and
    /// --collection: a ticket given another one is refused, nothing
    /// written. A bare token is refused (exit 64).
    pub(crate) ticket: Ticket,
    /// The amount of the original increment, as the printed command gives
    /// it (for a lane, the whole update's).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) by: i64,
    /// The bucket's start as the increment's hint printed it, in a
    /// collection with buckets (required there): the counter is settled in
    /// the bucket it was written to.
    #[arg(long, value_name = "TIME")]
    pub(crate) at: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) protocol: ResumeProtocolArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

/// `resume`'s `--lane` and `--two-step`: the ticket's shape says the
/// protocol; a flag may repeat it, never contradict it.
#[derive(Debug, Clone, Copy, Args)]
pub(crate) struct ResumeProtocolArgs {
    /// The ticket is a lane's (LANE.NUMBER-CHECK), as the printed command
    /// says. Optional: the ticket's shape says so; a two-step ticket is
    /// refused (exit 64).
    #[arg(long, conflicts_with = "two_step")]
    pub(crate) lane: bool,
    /// The ticket is a two-step token's (TOKEN-CHECK), as the printed
    /// command says. Optional: the ticket's shape says so; a lane's ticket
    /// is refused (exit 64).
    #[arg(long)]
    pub(crate) two_step: bool,
}

impl ResumeProtocolArgs {
    /// The flag given that contradicts `ticket`'s shape, if any.
    fn contradicting(self, ticket: &Ticket) -> Option<&'static str> {
        match ticket.protocol() {
            Protocol::TwoStep if self.lane => Some("--lane"),
            Protocol::Lanes if self.two_step => Some("--two-step"),
            _ => None,
        }
    }
}

impl Target {
    /// Refuses `ticket` unless its check matches this collection, `key`
    /// and `amount`, and `command` may settle it.
    fn verify(
        &self,
        command: Settles,
        ticket: &Ticket,
        key: &str,
        amount: i64,
    ) -> Result<(), Error> {
        let key = self.id(key);
        let names = Names {
            collection: &self.spec.name,
            key: &key,
            amount,
        };
        match command {
            Settles::Resume => ticket.verify_resume(names),
            Settles::Complete => ticket.verify_complete(names),
        }
    }
}

pub(super) async fn complete(args: CompleteArgs, config: &Config) -> ExitCode {
    let ticket = &args.ticket;
    if ticket.protocol() == Protocol::Lanes {
        let collection = args
            .target
            .resolve(config, false)
            .map(|spec| args.target.collection_options(&spec.name))
            .unwrap_or_default();
        let message = format!(
            "ticket {ticket} is a lane's (it carries the lane's number), and `tallyd complete` \
             settles a two-step token: resume it with `{}`",
            shown_command(&format!(
                "resume {} {ticket}{}{collection}{}",
                shell_word(&args.key),
                by_option(args.by.unwrap_or(1)),
                args.at
                    .as_deref()
                    .map(|at| format!(" --at {}", shell_word(at)))
                    .unwrap_or_default(),
            )),
        );
        return fail(args.target.json, &message, &config.secrets(), EXIT_USAGE);
    }
    let target = match open_at(&args.target, config, args.at.as_deref(), Timed::Settle).await {
        Ok((target, _)) => target,
        Err(code) => return code,
    };
    let by = args.by.unwrap_or(1);
    // The amount the document must hold for the token: the checked one, or
    // the one given with a bare token.
    let expected = if ticket.is_checked() {
        Some(by)
    } else {
        args.by
    };
    let shown = Shown::given(&args.key, ticket, expected);
    let refuse =
        |err: &Error| print_failure(&target, &shown, "refused", err, "refused", EXIT_FAILED);
    let token = ticket.token();
    let mismatch = |stored: i64| {
        let given = expected.filter(|given| *given != stored)?;
        let token = token.to_string();
        Some(Error::AmountMismatch {
            token,
            stored,
            given,
        })
    };
    let code = if let Err(err) = target.verify(Settles::Complete, ticket, &args.key, by) {
        refuse(&err)
    } else {
        match target.counters.lookup(target.id(&args.key), token).await {
            Ok(Found::Pending(pending)) => match mismatch(pending.amount()) {
                Some(err) => refuse(&err),
                None => {
                    let outcome = target.counters.complete(pending).await.into();
                    report_increment(&target, &args.key, &outcome, Some(ticket))
                }
            },
            // A settle (`complete` or `resume`, here or elsewhere) counted it.
            Ok(Found::Settled(counted)) => match mismatch(counted.amount()) {
                Some(err) => refuse(&err),
                None => {
                    let outcome = Increment::Counted(counted);
                    report_increment(&target, &args.key, &outcome, Some(ticket))
                }
            },
            Ok(Found::Absent) => {
                let text = format!(
                    "token {token} is not pending in {} (database {}): nothing to do \
                     (already counted, or never added — or added in another database or \
                     collection)",
                    target.place(&args.key),
                    config.mongodb.database,
                );
                let fields = json!({
                    "outcome": "not_pending",
                    "database": config.mongodb.database,
                });
                print(&target, &shown, fields, &text, EXIT_OK)
            }
            Err(err) => {
                let text = "pending: could not look the token up, it stays pending";
                let code = super::exit::exit_code_for_pending(&err);
                print_failure(&target, &shown, "pending", &err, text, code)
            }
        }
    };
    target.close().await;
    code
}

pub(super) async fn resume(args: ResumeArgs, config: &Config) -> ExitCode {
    let ticket = &args.ticket;
    let usage = |message: &str| fail(args.target.json, message, &config.secrets(), EXIT_USAGE);
    if !ticket.is_checked() {
        return usage(&format!(
            "{ticket} is a bare token: `tallyd resume` takes the ticket as the increment printed \
             it (TOKEN-CHECK, or LANE.NUMBER-CHECK for a lane), whose check makes sure the key, \
             --by and --collection are the increment's; an application logs it with \
             Counters::ticket or Counters::lane_ticket"
        ));
    }
    if let Some(flag) = args.protocol.contradicting(ticket) {
        let shape = match ticket.protocol() {
            Protocol::Lanes => "a lane's (it carries the lane's number)",
            Protocol::TwoStep => "a two-step token's (it carries no lane number)",
        };
        return usage(&format!(
            "ticket {ticket} is {shape}, but {flag} was given: leave the flag out, the ticket \
             says its protocol"
        ));
    }
    let target = match open_at(&args.target, config, args.at.as_deref(), Timed::Settle).await {
        Ok((target, _)) => target,
        Err(code) => return code,
    };
    let code = match (
        target.verify(Settles::Resume, ticket, &args.key, args.by),
        ticket.position(),
    ) {
        (Err(err), _) => {
            let shown = Shown::given(&args.key, ticket, Some(args.by));
            print_failure(&target, &shown, "refused", &err, "refused", EXIT_FAILED)
        }
        (Ok(()), None) => resume_two_step(&target, &args).await,
        (Ok(()), Some(position)) => {
            lane::resume(&target, &args.key, ticket, args.by, position).await
        }
    };
    target.close().await;
    code
}

async fn resume_two_step(target: &Target, args: &ResumeArgs) -> ExitCode {
    let shown = Shown::given(&args.key, &args.ticket, Some(args.by));
    let refuse =
        |err: &Error| print_failure(target, &shown, "refused", err, "refused", EXIT_FAILED);
    let token = args.ticket.token();
    let unknown = match UnknownToken::new(target.id(&args.key), token, args.by) {
        Ok(unknown) => unknown,
        Err(err) => return refuse(&err),
    };
    // Resuming a lane's increment as a two-step token would add it again
    // (the check makes that a forged ticket; the document has the last
    // word).
    let key = target.id(&args.key);
    let lane = LaneId::Minted(token.object_id());
    match target.counters.lane_position(&key, &lane).await {
        Ok(None) => {}
        Ok(Some(_)) => return refuse(&other_protocol(token, Protocol::Lanes)),
        // Nothing was written: the ticket is as unknown as it was (past
        // the retry horizon, with no resume hint).
        Err(err) => {
            let outcome = Increment::Unknown(unknown.because(err));
            return report_increment(target, &args.key, &outcome, Some(&args.ticket));
        }
    }
    match target.counters.resume(unknown).await {
        Ok(outcome) => report_increment(target, &args.key, &outcome, Some(&args.ticket)),
        // Past the retry horizon, or another amount than the document
        // holds: the ticket is finished, nothing was written.
        Err(err) => refuse(&err),
    }
}

/// The refusal of a token the counter shows under `protocol`, the other
/// one than its ticket says: resuming it with this one could count it
/// twice.
pub(super) fn other_protocol(token: Token, protocol: Protocol) -> Error {
    let what = match protocol {
        Protocol::Lanes => "a lane of this counter (it holds the lane's entry)",
        Protocol::TwoStep => "a two-step token of this counter (pending or settled)",
    };
    Error::InvalidArgument(format!(
        "{token} is {what}, not what its ticket says: resume it with the ticket its own \
         increment printed; nothing was written"
    ))
}
