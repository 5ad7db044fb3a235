//! The timing margins between sections that safety rests on, checked once
//! every section has been read:
//!
//! - a server-selection timeout must end before the attempt bound does, so
//!   that it surfaces as the command error it is (nothing was sent), not as
//!   a lost reply (which makes an increment `Unknown`);
//! - the retry horizon must hold two attempts: a step 1 whose attempt ran
//!   out of time is one attempt old when its retry is due, and a caller
//!   told `Unknown` must still be able to `resume` it;
//! - every grace must outlast the retry horizon plus one attempt: a step 1
//!   re-sent just inside the horizon may still execute for up to one
//!   attempt, and the fold must not have taken the token before it lands;
//! - `stuck_after` must be at least the longest grace: a token younger than
//!   its grace is not folded yet, so an alert for it would be noise and a
//!   repair would find nothing to do, again and again;
//! - `lane_resume_horizon` plus one attempt must be shorter than
//!   `lane_ttl`: a
//!   lane's update re-sent just inside the horizon may still execute for one
//!   attempt, and must find the lane's entry not pruned yet.
//! - a bucketed collection's `close_after` must be at least the longer of
//!   `retry_horizon` plus one attempt plus its grace (a step 1 re-sent
//!   just inside the horizon lands within an attempt, and its token is
//!   folded after the grace) and `lane_resume_horizon` plus one attempt (a
//!   lane's update re-sent just inside its horizon): a bucket must not be
//!   closed while a write accepted for it can still land. Lanes count in
//!   every collection: `tallyd incr --lane` and the library's
//!   `Counters::add` write any collection, whatever `[writer] protocol`
//!   says. An unset `close_after` is its default (24h) or this margin,
//!   whichever is longer.
//!
//! Writers' clocks may then lag the server's by up to `grace −
//! retry_horizon − attempt_timeout` (11 minutes with the defaults) before a
//! token could be folded early.
//!
//! A margin is only judged when the keys it involves were read without a
//! problem, so one bad value is not reported twice.

use std::time::Duration;

use humantime::format_duration;

use super::Config;
use super::field::Issues;
use crate::bucket::{DEFAULT_CLOSE_AFTER, closing_margin};
use crate::write::counter::least_retry_horizon;

/// Checks every margin of `config`, reporting under the key to change.
pub(super) fn check(config: &Config, issues: &mut Issues) {
    check_attempt_timeout(config, issues);
    check_retry_horizon(config, issues);
    check_graces(config, issues);
    check_stuck_after(config, issues);
    check_lane_lifetimes(config, issues);
    check_group_bounds(config, issues);
    check_close_after(config, issues);
}

/// The least `close_after` of a bucketed collection, and how it is made.
struct CloseAfterMargin {
    least: Duration,
    /// The sums it is the longer of, in words and numbers.
    made_of: String,
    /// Whether the lanes' part is the longer.
    by_lanes: bool,
}

/// The least `close_after` of the collection at `index` (see the module's
/// documentation); `None` when a key it is made of has a problem, which
/// is reported under that key.
fn close_after_margin(config: &Config, index: usize, issues: &Issues) -> Option<CloseAfterMargin> {
    let spec = &config.collections[index];
    let (grace_key, grace) = match spec.grace {
        Some(grace) => (format!("collections[{index}].grace"), grace),
        None => ("reconcile.grace".to_owned(), config.reconcile.grace),
    };
    let involved = [
        "writer.retry_horizon",
        "writer.lane_resume_horizon",
        "mongodb.attempt_timeout",
        &grace_key,
    ];
    if any_issue(issues, &involved) {
        return None;
    }
    let (horizon, attempt) = (config.writer.retry_horizon, config.mongodb.attempt_timeout);
    let lanes = config.writer.lane_resume_horizon;
    let (steps, by_lanes) = (horizon + attempt + grace, lanes + attempt);
    Some(CloseAfterMargin {
        least: steps.max(by_lanes),
        made_of: format!(
            "writer.retry_horizon + mongodb.attempt_timeout + {grace_key} ({} + {} + {} = {}) \
             and writer.lane_resume_horizon + mongodb.attempt_timeout ({} + {} = {})",
            format_duration(horizon),
            format_duration(attempt),
            format_duration(grace),
            format_duration(steps),
            format_duration(lanes),
            format_duration(attempt),
            format_duration(by_lanes)
        ),
        by_lanes: by_lanes > steps,
    })
}

/// Raises the unset `close_after` of the bucketed collections at
/// `unset` from its default to the margin where the margin is longer.
pub(super) fn default_close_after(config: &mut Config, unset: &[usize], issues: &Issues) {
    for &index in unset {
        let Some(margin) = close_after_margin(config, index, issues) else {
            continue;
        };
        let least = margin.least.max(DEFAULT_CLOSE_AFTER);
        let buckets = &mut config.collections[index].buckets;
        *buckets = buckets.take().map(|b| b.with_close_after(least));
    }
}

/// Sets every bucketed collection's closing margin from the writers'
/// horizons, the attempt bound and its grace (`crate::bucket`'s closing:
/// when no write a bucket accepted can still land).
pub(super) fn set_closing_margins(config: &mut Config) {
    let (writer, attempt) = (&config.writer, config.mongodb.attempt_timeout);
    let (horizon, lanes) = (writer.retry_horizon, writer.lane_resume_horizon);
    for spec in &mut config.collections {
        let grace = spec.grace.unwrap_or(config.reconcile.grace);
        let margin = closing_margin(horizon, lanes, attempt, grace);
        spec.buckets = spec.buckets.take().map(|b| b.with_closing_margin(margin));
    }
}

/// Every bucketed collection's `close_after` against its margin.
fn check_close_after(config: &Config, issues: &mut Issues) {
    for (index, spec) in config.collections.iter().enumerate() {
        let Some(buckets) = &spec.buckets else {
            continue;
        };
        let key = format!("collections[{index}].close_after");
        let Some(margin) = close_after_margin(config, index, issues) else {
            continue;
        };
        if buckets.close_after() >= margin.least || issues.has(&key) {
            continue;
        }
        let sooner = if margin.by_lanes {
            "; to close sooner, lower writer.lane_resume_horizon (and lane_ttl with it)"
        } else {
            ""
        };
        issues.push(
            &key,
            format!(
                "must be at least {}, the longer of {}: a step 1 or a lane's update re-sent \
                 within its horizon may land that long after it was accepted, and must find its \
                 bucket open (lanes write any collection: `tallyd incr --lane`, the library's \
                 Counters::add){sooner}",
                format_duration(margin.least),
                margin.made_of
            ),
        );
    }
}

/// The writer's lane lifetimes against each other and one attempt, as the
/// library checks them when a handle is built.
fn check_lane_lifetimes(config: &Config, issues: &mut Issues) {
    let involved = [
        "writer.lane_resume_horizon",
        "writer.lane_ttl",
        "mongodb.attempt_timeout",
    ];
    if any_issue(issues, &involved) {
        return;
    }
    let attempt = config.mongodb.attempt_timeout;
    for (key, problem) in config.writer.lane_margin_problems(attempt) {
        issues.push(format!("writer.{key}"), problem);
    }
}

/// The group commit bounds, as the library checks them (their ranges were
/// checked as they were read; what is left is `group_wait`'s).
fn check_group_bounds(config: &Config, issues: &mut Issues) {
    for (key, problem) in config.writer.group_problems() {
        let key = format!("writer.{key}");
        if !issues.has(&key) {
            issues.push(key, problem);
        }
    }
}

fn any_issue(issues: &Issues, keys: &[&str]) -> bool {
    keys.iter().any(|key| issues.has(key))
}

fn check_attempt_timeout(config: &Config, issues: &mut Issues) {
    let involved = [
        "mongodb.uri",
        "mongodb.attempt_timeout",
        "mongodb.server_selection_timeout",
    ];
    if any_issue(issues, &involved) {
        return;
    }
    let mongodb = &config.mongodb;
    if mongodb.attempt_timeout <= mongodb.server_selection_timeout {
        issues.push(
            "mongodb.attempt_timeout",
            format!(
                "must be longer than mongodb.server_selection_timeout ({}, from the key or the \
                 URI's serverSelectionTimeoutMS): a server-selection timeout must surface as the \
                 error it is (nothing was sent), not be cut off as a lost reply",
                format_duration(mongodb.server_selection_timeout)
            ),
        );
    }
}

/// The retry horizon against two attempts, the bound the library raises a
/// shorter horizon to.
fn check_retry_horizon(config: &Config, issues: &mut Issues) {
    if any_issue(issues, &["writer.retry_horizon", "mongodb.attempt_timeout"]) {
        return;
    }
    let attempt = config.mongodb.attempt_timeout;
    let least = least_retry_horizon(attempt);
    if config.writer.retry_horizon < least {
        issues.push(
            "writer.retry_horizon",
            format!(
                "must be at least twice mongodb.attempt_timeout ({}, so at least {}): a step 1 \
                 whose attempt timed out could otherwise be neither retried nor resumed",
                format_duration(attempt),
                format_duration(least)
            ),
        );
    }
}

/// Every grace (`[reconcile]`'s and each collection's) against the retry
/// horizon plus one attempt.
fn check_graces(config: &Config, issues: &mut Issues) {
    if any_issue(issues, &["writer.retry_horizon", "mongodb.attempt_timeout"]) {
        return;
    }
    let horizon = config.writer.retry_horizon;
    let attempt = config.mongodb.attempt_timeout;
    let least = horizon + attempt;
    let mut graces = vec![("reconcile.grace".to_owned(), config.reconcile.grace)];
    for (i, collection) in config.collections.iter().enumerate() {
        if let Some(grace) = collection.grace {
            graces.push((format!("collections[{i}].grace"), grace));
        }
    }
    for (key, grace) in graces {
        if grace <= least && !issues.has(&key) {
            issues.push(
                &key,
                format!(
                    "must be longer than writer.retry_horizon + mongodb.attempt_timeout ({} + {} \
                     = {}): a step 1 re-sent just inside the horizon may still execute for one \
                     more attempt, and a token folded before it lands would count twice; raise \
                     {key} past it, or lower writer.retry_horizon",
                    format_duration(horizon),
                    format_duration(attempt),
                    format_duration(least)
                ),
            );
        }
    }
}

/// The longest grace any collection is folded with, and the key that sets
/// it: a collection's own, else `[reconcile]`'s (which also stands alone
/// when no collection is configured).
fn longest_grace(config: &Config) -> (String, Duration) {
    let shared = ("reconcile.grace".to_owned(), config.reconcile.grace);
    let own = config
        .collections
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.grace.map(|g| (format!("collections[{i}].grace"), g)));
    let uses_shared =
        config.collections.is_empty() || config.collections.iter().any(|c| c.grace.is_none());
    own.chain(uses_shared.then_some(shared))
        .fold(
            None,
            |longest: Option<(String, Duration)>, (key, grace)| match longest {
                Some((_, best)) if best >= grace => longest,
                _ => Some((key, grace)),
            },
        )
        .unwrap_or(("reconcile.grace".to_owned(), config.reconcile.grace))
}

fn check_stuck_after(config: &Config, issues: &mut Issues) {
    let (key, grace) = longest_grace(config);
    if any_issue(issues, &["alerts.stuck_after", &key]) {
        return;
    }
    let stuck_after = config.alerts.stuck_after;
    if stuck_after < grace {
        issues.push(
            "alerts.stuck_after",
            format!(
                "must be at least the longest grace ({key} = {}): a token younger than its grace \
                 is not folded yet, so alerts would fire for tokens the fold will not touch and a \
                 repair would spin",
                format_duration(grace)
            ),
        );
    }
}
