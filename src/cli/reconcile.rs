//! `tallyd reconcile [--dry-run] [--collection NAME]... [--json]`.

use crate::cli::out;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use super::exit::{EXIT_INTERRUPTED, EXIT_UNAVAILABLE};
use super::{CollectionsArgs, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, exit_code_for, shown_command};
use crate::config::Config;
use crate::error::words;
use crate::reconcile::{CollectionRun, FoldTarget, Mode, Progress};
use crate::redact::Secrets;
use crate::store::Store;

/// `tallyd reconcile`.
#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// Change nothing; report exactly what a fold would do.
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub(crate) which: CollectionsArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(super) async fn run(args: ReconcileArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let (names, reconciler, now, store) =
        match super::survey_setup(&args.which, args.json, config).await {
            Ok(setup) => setup,
            Err(code) => return code,
        };
    let stop = super::exit::cancelled_at_ctrl_c();
    let mode = if args.dry_run {
        Mode::DryRun
    } else {
        Mode::Fold
    };
    let bar = (!args.json && std::io::stderr().is_terminal()).then(spinner);
    let mut runs = Vec::new();
    // The server's clock at the setup, carried forward by this process's
    // monotonic clock: each collection's run gets the time it starts at
    // (a ledger's marks start its dedupe window then, never earlier).
    let began = std::time::Instant::now();
    // A server that cannot be reached fails every collection after it
    // the same way, each after its own server selection; Ctrl-C means
    // stop: the collections after it are not tried.
    let mut not_tried: Vec<String> = Vec::new();
    for name in &names {
        if stop.is_cancelled() || runs.iter().any(|(_, run)| stops_the_rest(run)) {
            not_tried.push(name.clone());
            continue;
        }
        let target = config.fold_target(name);
        let started = std::time::Instant::now();
        let mut progress = |p: Progress| {
            if let Some(bar) = &bar {
                let rate = p.examined as f64 / started.elapsed().as_secs_f64().max(0.001);
                let line = progress_line(name, &p, args.dry_run);
                bar.set_message(format!("{line} ({rate:.0} documents/s)"));
            }
        };
        let run = reconciler
            .reconcile(&target, mode, now + began.elapsed(), &stop, &mut progress)
            .await;
        runs.push((target, run));
    }
    drop(reconciler);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let ok = runs.iter().all(|(_, run)| run.succeeded());
    let ok = ok && not_tried.is_empty();
    // Ctrl-C exits 130; a failed run exits by its error's class; an
    // interrupted one (a shutdown), 1.
    let code = match runs.iter().find_map(|(_, run)| run.error.as_ref()) {
        _ if stop.is_cancelled() => EXIT_INTERRUPTED,
        Some(err) => exit_code_for(err),
        None if ok => EXIT_OK,
        None => EXIT_FAILED,
    };
    if args.json {
        print_json(&runs, args.dry_run, ok, &not_tried, &secrets);
    } else {
        print_table(&runs, args.dry_run, &secrets, &store);
        if !not_tried.is_empty() {
            let why = if stop.is_cancelled() {
                "interrupted"
            } else {
                "the error above fails them alike"
            };
            eprintln!(
                "not tried ({why}): {}; run `{}` again to fold them (what was folded stays \
                 folded, and folding again is safe)",
                words(&not_tried),
                shown_command("reconcile")
            );
        }
    }
    store.shutdown().await;
    ExitCode::from(code)
}

/// Whether `run`'s failure ends the command: a server that cannot be
/// reached (or a URI naming another replica set) fails the others alike.
fn stops_the_rest(run: &CollectionRun) -> bool {
    run.error
        .as_ref()
        .is_some_and(|err| matches!(exit_code_for(err), EXIT_UNAVAILABLE | EXIT_CONFIG))
}

fn print_json(
    runs: &[(FoldTarget, CollectionRun)],
    dry_run: bool,
    ok: bool,
    not_tried: &[String],
    secrets: &Secrets,
) {
    let collections: Vec<_> = runs.iter().map(|(_, run)| run).collect();
    let summary = json!({
        "dry_run": dry_run,
        "ok": ok,
        "collections": collections,
        "not_tried": not_tried,
    });
    out!("{}", secrets.scrub(&summary.to_string()));
}

fn print_table(
    runs: &[(FoldTarget, CollectionRun)],
    dry_run: bool,
    secrets: &Secrets,
    store: &Store,
) {
    if dry_run {
        out!("dry run: nothing was changed; the numbers say what a fold would do");
    }
    let verb = if dry_run { "would fold" } else { "folded" };
    out!(
        "{:<24} {:>9} {:>9} {:>11} {:>9} {:>11} {:>9} {:>12} {:>9}  result",
        "collection",
        "scanned",
        "stale",
        verb,
        "tokens",
        "amount",
        "malformed",
        "oldest stale",
        "seconds"
    );
    for (target, run) in runs {
        let oldest = run
            .oldest_stale_age_seconds
            .map(|s| humantime::format_duration(Duration::from_secs(s)).to_string())
            .unwrap_or_else(|| "-".into());
        let result = match (&run.error, run.interrupted) {
            (Some(err), _) => format!("FAILED: {}", secrets.scrub(&store.explain(err))),
            (None, true) => "interrupted".into(),
            (None, false) => {
                let mut notes = Vec::new();
                if run.events_folded > 0 {
                    let verb = if dry_run { "to fold" } else { "folded" };
                    notes.push(format!("{} recorded events {verb}", run.events_folded));
                }
                if run.lanes_pruned > 0 {
                    notes.push(format!("{} expired lane entries pruned", run.lanes_pruned));
                }
                if run.refused > 0 {
                    notes.push(format!("{} refused by the server", run.refused));
                }
                if run.concurrent_changes > 0 {
                    notes.push(format!(
                        "{} changed by writers meanwhile",
                        run.concurrent_changes
                    ));
                }
                notes.extend(bucket_note(target, run, dry_run));
                if notes.is_empty() {
                    "ok".into()
                } else {
                    format!("ok ({})", notes.join(", "))
                }
            }
        };
        out!(
            "{:<24} {:>9} {:>9} {:>11} {:>9} {:>11} {:>9} {:>12} {:>9.2}  {}",
            target.spec.name,
            run.survey.documents_scanned,
            run.survey.documents_stale,
            run.documents_folded,
            run.tokens_folded,
            run.amount_folded,
            run.survey.malformed,
            oldest,
            run.duration.as_secs_f64(),
            result
        );
    }
    for (target, run) in runs {
        if run.survey.malformed > 0 {
            sample_heading(
                &target.spec.name,
                run.survey.malformed,
                run.survey.malformed_sample.len(),
                "malformed document(s) left unchanged",
            );
            for doc in &run.survey.malformed_sample {
                out!("  _id {}: {}", doc.id, doc.reason);
            }
        }
        if let Some(buckets) = run.buckets.as_ref().filter(|b| b.unclosed > 0) {
            sample_heading(
                &target.spec.name,
                buckets.unclosed,
                buckets.unclosed_sample.len(),
                "bucket(s) past their closing time left open",
            );
            for bucket in &buckets.unclosed_sample {
                out!("  {}: {}", bucket.bucket, secrets.scrub(&bucket.reason));
            }
        }
        if run.refused > 0 {
            sample_heading(
                &target.spec.name,
                run.refused,
                run.refused_sample.len(),
                "document(s) refused by the server, left unchanged",
            );
            for doc in &run.refused_sample {
                out!(
                    "  _id {}: error {}: {}",
                    doc.id,
                    doc.code,
                    secrets.scrub(&doc.reason)
                );
            }
        }
    }
}

/// The heading of a list below the table: `NAME: N what:`, and `(first
/// few)` when the sample `listed` holds fewer than `count`.
fn sample_heading(name: &str, count: u64, listed: usize, what: &str) {
    let few = if count as usize > listed {
        " (first few)"
    } else {
        ""
    };
    out!("\n{name}: {count} {what}{few}:");
}

/// What a run did about a bucketed collection's buckets, in the result
/// column: how many it closed and how many stay open, the oldest's start.
fn bucket_note(target: &FoldTarget, run: &CollectionRun, dry_run: bool) -> Option<String> {
    let (Some(buckets), Some(closing)) = (&target.spec.buckets, &run.buckets) else {
        return None;
    };
    let mut said = Vec::new();
    let buckets_of = |n: u64| {
        if n == 1 {
            "1 bucket".to_owned()
        } else {
            format!("{n} buckets")
        }
    };
    if closing.closed > 0 {
        let verb = if dry_run { "to close" } else { "closed" };
        said.push(format!("{} {verb}", buckets_of(closing.closed)));
    }
    if closing.unclosed > 0 {
        said.push(format!(
            "{} past their closing time left open",
            closing.unclosed
        ));
    }
    if let Some(oldest) = closing.oldest_open {
        said.push(format!(
            "{} open, the oldest from {}",
            closing.open,
            buckets.show_time(oldest)
        ));
    }
    (!said.is_empty()).then(|| said.join(", "))
}

/// The progress of a run on a terminal: a spinner, its message the
/// collection's [`progress_line`] and its rate (how many documents a run
/// reads is not known ahead).
fn spinner() -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg}") {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// The progress line of a collection's run on a terminal. A dry run folds
/// nothing: it says what a fold would do.
fn progress_line(name: &str, progress: &Progress, dry_run: bool) -> String {
    let folded = if dry_run { "would fold" } else { "folded" };
    format!(
        "{name}: {} documents read, {} {folded}",
        progress.examined, progress.folded
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dry_runs_progress_says_would_fold() {
        let p = Progress {
            examined: 7,
            folded: 3,
        };
        assert_eq!(
            progress_line("views", &p, true),
            "views: 7 documents read, 3 would fold"
        );
        assert_eq!(
            progress_line("views", &p, false),
            "views: 7 documents read, 3 folded"
        );
    }
}
