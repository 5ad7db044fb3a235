//! `tallyd fold-from [TIME]`: a ledger whose fold stopped — its position
//! in the events collection's change stream no longer in the oplog, the
//! events collection dropped — folded again from a time the operator
//! chooses.
//!
//! The fold catches up from the events collection itself: every event
//! numbered after TIME that is there now (up to a boundary in the change
//! stream taken first), then follows the change stream from the boundary.
//! Where exactly the fold stopped in the log is gone, so the events
//! recorded near the stop are named: each was counted before the stop, or
//! is counted now, or neither, and only the application's own records can
//! tell which. TIME defaults to where the fold stopped; an earlier TIME
//! counts more of them (and may count some twice), a later one fewer.
//!
//! Exit 0 once caught up; 1 when the fold is not stopped (nothing to do,
//! nothing changed) or a catch-up step is refused; 69/77 by the failure's
//! class. A catch-up cut short goes on at the next pass (the daemon's, or
//! `tallyd reconcile`).

use std::process::ExitCode;
use std::time::SystemTime;

use clap::Args;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{EXIT_OK, EXIT_USAGE, TargetArgs, fail, fail_with, out};
use crate::bucket::{BucketWidth, Buckets};
use crate::config::Config;
use crate::document::display_id;
use crate::error::counted;
use crate::ledger::{EventFold, FoldFrom};

/// `tallyd fold-from [TIME]`.
#[derive(Debug, Args)]
pub(crate) struct FoldFromArgs {
    /// Fold the events recorded after TIME: RFC 3339
    /// (2026-11-28T14:30:00Z) or a date (its midnight, UTC or the
    /// collection's time zone). Default: where the fold stopped.
    #[arg(value_name = "TIME")]
    pub(crate) since: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) target: TargetArgs,
}

pub(super) async fn run(args: FoldFromArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let (spec, store) = match args.target.open_ledger(config).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let buckets = spec
        .buckets
        .clone()
        .unwrap_or_else(|| Buckets::utc(BucketWidth::Minute));
    let given = match args.since.as_deref().map(|t| buckets.parse_time(t)) {
        None => None,
        Some(Ok(since)) => Some(since),
        Some(Err(err)) => {
            store.shutdown().await;
            return fail(
                args.target.json,
                &format!("TIME: {err}"),
                &secrets,
                EXIT_USAGE,
            );
        }
    };
    let fold = config.reconciler(&store).event_fold(&spec);
    let code = fold_from(&fold, given, &buckets, args.target.json, &store, config).await;
    drop(fold);
    store.shutdown().await;
    code
}

async fn fold_from(
    fold: &EventFold,
    given: Option<SystemTime>,
    buckets: &Buckets,
    json: bool,
    store: &crate::store::Store,
    config: &Config,
) -> ExitCode {
    let secrets = config.secrets();
    let since = match given {
        Some(since) => since,
        None => match fold.stopped_at().await {
            Ok(Some(at)) => at,
            Ok(None) => SystemTime::UNIX_EPOCH,
            Err(err) => return fail_with(json, &err, store, &secrets),
        },
    };
    let from = match fold.fold_from(since).await {
        Ok(from) => from,
        Err(err) => return fail_with(json, &err, store, &secrets),
    };
    if !json {
        say_what_is_uncertain(fold, &from, buckets);
    }
    let mut folded = 0u64;
    let stop = CancellationToken::new();
    // Once the catch-up is set up, a failure still names the uncertain
    // events (the text named them already): a run of the command again is
    // refused, as the fold is no longer stopped.
    let failed = |err: &crate::Error, folded: u64| {
        if !json {
            return fail_with(json, err, store, &secrets);
        }
        let mut shown = as_json(fold, &from, buckets, folded);
        shown["outcome"] = json!("error");
        shown["error"] = json!(secrets.scrub(&store.explain(err)));
        out!("{shown}");
        ExitCode::from(super::exit::exit_code_for(err))
    };
    let run = loop {
        let now = match crate::reconcile::Reconciler::new(store).server_time().await {
            Ok(now) => now,
            Err(err) => return failed(&err, folded),
        };
        match fold.fold(now, &stop).await {
            // Another fold (the daemon) holds the catch-up's chunk: it goes
            // on; wait for it.
            Ok(run) if run.busy => {
                folded += run.events_folded;
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Ok(run) if run.backlog.catching_up => folded += run.events_folded,
            Ok(run) => break run,
            Err(err) => return failed(&err, folded),
        }
    };
    folded += run.events_folded;
    if json {
        out!("{}", as_json(fold, &from, buckets, folded));
    } else {
        out!(
            "{}: caught up ({} folded by this command, the rest by the daemon if it runs): the \
             fold follows the change stream again",
            fold.events_collection(),
            counted(folded, "event", "events")
        );
    }
    ExitCode::from(EXIT_OK)
}

fn say_what_is_uncertain(fold: &EventFold, from: &FoldFrom, buckets: &Buckets) {
    let events = fold.events_collection();
    match from.stopped_at {
        Some(at) => out!(
            "{events}: the fold stopped at {}; folding again from {}: the events recorded \
             after it that are in {events} now, then the change stream",
            buckets.show_time(at),
            buckets.show_time(from.since)
        ),
        None => out!(
            "{events}: folding from {}: the events recorded after it that are in {events} now, \
             then the change stream",
            buckets.show_time(from.since)
        ),
    }
    if from.uncertain_total == 0 {
        out!("{events}: no event was recorded near the stop: every count is certain");
        return;
    }
    out!(
        "{events}: {} recorded near the stop {} uncertain: each was counted before the stop, or \
         is counted now, or neither (the log that would tell is gone); check them against your \
         own records:",
        counted(from.uncertain_total, "event", "events"),
        if from.uncertain_total == 1 {
            "is"
        } else {
            "are"
        }
    );
    for event in &from.uncertain {
        let now = if event.counted {
            "counted now"
        } else {
            "not counted now"
        };
        let recorded = match event.recorded {
            Some(at) => format!("recorded {}", buckets.show_time(at)),
            None => "no number (written by hand)".to_owned(),
        };
        out!(
            "  {}  {}  {:+}  {recorded}  {now}",
            display_id(&event.key),
            display_id(&event.counter),
            event.amount,
        );
    }
    let unlisted = from.uncertain_total - from.uncertain.len() as u64;
    if unlisted > 0 {
        out!(
            "  … and {unlisted} more, recorded up to {}",
            buckets.show_time(from.uncertain_until)
        );
    }
}

fn as_json(fold: &EventFold, from: &FoldFrom, buckets: &Buckets, folded: u64) -> Value {
    let uncertain: Vec<Value> = from
        .uncertain
        .iter()
        .map(|e| {
            json!({
                "event": e.key.clone().into_relaxed_extjson(),
                "key": e.counter.clone().into_relaxed_extjson(),
                "amount": e.amount,
                "recorded": e.recorded.map(|at| buckets.show_time(at)),
                "counted_now": e.counted,
            })
        })
        .collect();
    json!({
        "outcome": "caught_up",
        "events_collection": fold.events_collection(),
        "since": buckets.show_time(from.since),
        "stopped_at": from.stopped_at.map(|at| buckets.show_time(at)),
        "boundary": buckets.show_time(from.boundary),
        "events_folded": folded,
        "uncertain_total": from.uncertain_total,
        "uncertain_after": buckets.show_time(from.uncertain_after),
        "uncertain_until": buckets.show_time(from.uncertain_until),
        "uncertain": uncertain,
    })
}
