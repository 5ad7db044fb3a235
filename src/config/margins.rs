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
use crate::write::counter::least_retry_horizon;

/// Checks every margin of `config`, reporting under the key to change.
pub(super) fn check(config: &Config, issues: &mut Issues) {
    check_attempt_timeout(config, issues);
    check_retry_horizon(config, issues);
    check_graces(config, issues);
    check_stuck_after(config, issues);
    check_lane_lifetimes(config, issues);
    check_group_bounds(config, issues);
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
