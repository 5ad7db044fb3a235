//! Settling a ticket as an application would, and — for a share of the
//! unknown ones — again and at once from elsewhere: a copy rebuilt on
//! another host, a `tallyd resume` or `tallyd complete` child process, an
//! operator completing the token of an unknown ticket, a resume after the
//! count.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use serde_json::Value;
use tally::{Completion, Increment, PendingToken, Token, UnknownToken};

use super::{Host, Leftover, Shared};
use crate::cli::tallyd;
use crate::history::RETRY_HORIZON;
use crate::history::record::{Call, Outcome};

/// How an unknown ticket is settled.
#[derive(Debug, Clone, Copy)]
enum Settle {
    /// One resume loop.
    Alone,
    /// The same ticket resumed at once by a copy on another host.
    Twice,
    /// ... and by a `tallyd resume` child.
    WithChild,
    /// ... and completed by an operator who looked its token up.
    WithOperator,
}

/// Settles an unknown ticket, a share of them twice or thrice at once,
/// and a share once more after it was counted.
pub(super) async fn settle_unknown(
    shared: &Arc<Shared>,
    w: usize,
    me: &str,
    host: &Host,
    rng: &mut fastrand::Rng,
    unknown: UnknownToken,
) {
    let key = unknown.key().as_str().expect("string keys").to_owned();
    let (token, amount) = (unknown.token(), unknown.amount());
    // What an operator pastes into `tallyd resume` or `tallyd complete`.
    let ticket = host.counters.ticket(&unknown);
    let hosts = shared.hosts.len();
    let other = shared.hosts[(w + 1 + rng.usize(0..hosts - 1)) % hosts].clone();
    let mode = match rng.u32(0..100) {
        0..50 => Settle::Alone,
        50..72 => Settle::Twice,
        72..84 => Settle::WithChild,
        _ => Settle::WithOperator,
    };
    let beside = match mode {
        Settle::Alone => None,
        Settle::Twice => {
            shared.count("resumed twice at once");
            let (shared, me, key) = (shared.clone(), format!("{me}/copy"), key.clone());
            Some(tokio::spawn(async move {
                let copy = UnknownToken::new(key.as_str(), token, amount).expect("an amount");
                // The copy's ticket is dropped if it stays open: the
                // original is the one settled at the end.
                let _ = resume_until_known(&shared, &me, &other, copy).await;
            }))
        }
        Settle::WithChild => {
            let (shared, key, ticket) = (shared.clone(), key.clone(), ticket.clone());
            Some(tokio::spawn(async move {
                child(&shared, "resume", &key, token, &ticket, amount).await;
            }))
        }
        Settle::WithOperator => {
            let (shared, me, key) = (shared.clone(), format!("{me}/operator"), key.clone());
            let ticket = ticket.clone();
            let by_child = rng.u32(0..3) == 0;
            Some(tokio::spawn(async move {
                if by_child {
                    child(&shared, "complete", &key, token, &ticket, amount).await;
                } else {
                    operator_complete(&shared, &me, &other, &key, token).await;
                }
            }))
        }
    };
    let counted = match resume_until_known(shared, me, host, unknown).await {
        Ok(counted) => counted,
        Err(pending) => {
            shared.leave(Leftover::Pending(pending));
            false
        }
    };
    if let Some(beside) = beside {
        beside.await.expect("a settling task panicked");
    }
    if counted && rng.u32(0..100) < 30 {
        shared.count("resumed again after counted");
        if rng.u32(0..4) == 0 {
            child(shared, "resume", &key, token, &ticket, amount).await;
        } else {
            let again = UnknownToken::new(key.as_str(), token, amount).expect("an amount");
            let _ = resume_until_known(shared, &format!("{me}/again"), host, again).await;
        }
    }
}

/// Resumes until the ticket is no longer unknown — counted, not counted,
/// or refused past the horizon (which the checker reports). `Ok(true)`
/// once counted; the ticket back when it is still pending after a few
/// completes.
async fn resume_until_known(
    shared: &Shared,
    me: &str,
    host: &Host,
    unknown: UnknownToken,
) -> Result<bool, PendingToken> {
    let mut unknown = unknown;
    loop {
        let call = Call::Resume {
            key: unknown.key().as_str().expect("string keys").to_owned(),
            token: unknown.token().object_id(),
            amount: unknown.amount(),
        };
        let invoke = shared.rec.now();
        let result = host.counters.resume(unknown).await;
        shared
            .rec
            .push(me, call, invoke, Outcome::of_resume(&result));
        shared.count("resume");
        match result {
            Ok(Increment::Counted(_)) => return Ok(true),
            Ok(Increment::NotCounted(_)) | Err(_) => return Ok(false),
            Ok(Increment::Pending(pending)) => {
                return complete_until_counted(shared, me, host, pending)
                    .await
                    .map(|()| true);
            }
            Ok(Increment::Unknown(next)) => {
                unknown = next;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Completes a pending ticket a few times; the ticket back if it stays
/// pending (the fold, or the end of the run, settles it).
pub(super) async fn complete_until_counted(
    shared: &Shared,
    me: &str,
    host: &Host,
    pending: PendingToken,
) -> Result<(), PendingToken> {
    let mut pending = pending;
    for attempt in 0..4 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let call = Call::Complete {
            key: pending.key().as_str().expect("string keys").to_owned(),
            token: pending.token().object_id(),
        };
        let invoke = shared.rec.now();
        let completion = host.counters.complete(pending).await;
        shared
            .rec
            .push(me, call, invoke, Outcome::of_completion(&completion));
        shared.count("complete");
        match completion {
            Completion::Counted(_) => return Ok(()),
            Completion::Pending(still) => pending = still,
        }
    }
    Err(pending)
}

/// A confused operator completes an unknown ticket's token: whatever
/// `find_pending` finds is completed.
async fn operator_complete(shared: &Shared, me: &str, host: &Host, key: &str, token: Token) {
    shared.count("operator complete");
    let call = Call::Complete {
        key: key.to_owned(),
        token: token.object_id(),
    };
    let invoke = shared.rec.now();
    match host.counters.find_pending(key, token).await {
        Ok(Some(pending)) => {
            let completion = host.counters.complete(pending).await;
            shared
                .rec
                .push(me, call, invoke, Outcome::of_completion(&completion));
        }
        Ok(None) => shared.rec.push(me, call, invoke, Outcome::NotPending),
        Err(err) => shared.rec.push(me, call, invoke, Outcome::failed(&err)),
    }
}

/// `tallyd <command> KEY TICKET --by N` as a child process through the
/// proxy, recorded from spawn to exit; nothing when the run has started
/// all the children it may.
async fn child(shared: &Shared, command: &str, key: &str, token: Token, ticket: &str, amount: i64) {
    let n = shared.children.fetch_add(1, Ordering::Relaxed);
    if n >= shared.max_children {
        return;
    }
    shared.count(if command == "resume" {
        "tallyd resume"
    } else {
        "tallyd complete"
    });
    let _slot = shared.child_slots.acquire().await.expect("slots stay open");
    // An operator resumes soon, or not at all: a resume of a token the
    // document does not show, past the horizon, is refused.
    if token.age(SystemTime::now()) > RETRY_HORIZON / 2 {
        return;
    }
    let me = format!("tallyd#{n}");
    let config = shared.child_config.display().to_string();
    let by = amount.to_string();
    let mut args = vec![
        "--config",
        config.as_str(),
        command,
        key,
        ticket,
        "--by",
        by.as_str(),
    ];
    let call = if command == "resume" {
        Call::Resume {
            key: key.to_owned(),
            token: token.object_id(),
            amount,
        }
    } else {
        Call::Complete {
            key: key.to_owned(),
            token: token.object_id(),
        }
    };
    args.extend(["--collection", "views", "--json"]);
    let invoke = shared.rec.now();
    let output = tallyd(&args, &[]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json: Value = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    let outcome = match json["outcome"].as_str() {
        Some("counted") => Outcome::Counted {
            earlier: json["settled_earlier"] == true,
        },
        Some("pending") => Outcome::Pending,
        Some("unknown") => Outcome::Unknown,
        Some("not_counted") => Outcome::NotCounted,
        Some("not_pending") => Outcome::NotPending,
        Some("refused") => {
            let message = json["error"]["message"].to_string();
            // The ticket is the unknown increment's own: its check holds.
            assert!(
                !message.contains("ticket"),
                "{me} refused its ticket: {message}"
            );
            Outcome::Refused(message)
        }
        _ => Outcome::Failed {
            error: format!(
                "{:?}: {stdout}{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ),
            maybe_applied: true,
        },
    };
    shared.rec.push(&me, call, invoke, outcome);
}
