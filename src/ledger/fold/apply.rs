//! Applying a pass: every counter's held sums and new sum through the
//! ledger's fold lane at the pass's position, the pass's lease renewed
//! meanwhile.
//!
//! Each counter's sums go through the named lane `fold:<events collection>`
//! of the lanes protocol (`write::lane`), never pruned: a counter that has
//! the pass already (its lane entry holds the pass's number or more)
//! ignores it, so applying a pass again is a no-op, counter by counter. The
//! counters with nothing held go 100 to an `update` command
//! ([`super::EventFoldSettings::apply_batch`]), each its own statement; a
//! counter with held sums is sent alone, in order (`held`). A counter the
//! server refuses holds its sum; a transient failure stops the pass, which
//! is resumed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use futures::StreamExt;
use mongodb::bson::Bson;

use super::held::{self, Applied, Work};
use super::sums::Shares;
use super::{APPLY_CONCURRENCY, EventFold};
use crate::document::CanonicalKey;
use crate::error::{Error, ErrorClass};
use crate::ledger::state::{FoldState, Held, Pass};
use crate::write::lane::{LaneId, LaneIncrement};

/// How many `update` commands of new sums a pass sends at once.
const BATCHES_AT_ONCE: usize = 2;

/// Why a pass stops sending when its lease could not be renewed.
const LEASE_RAN_OUT: &str =
    "its lease ran out before it could be renewed (the server did not answer)";

/// What applying a pass came to.
#[derive(Debug, Default)]
pub(super) struct PassApplied {
    /// The held sums after the pass, oldest first.
    pub(super) held: Vec<Held>,
    /// Counter updates sent.
    pub(super) written: u64,
}

impl EventFold {
    /// Applies `pass`: the held sums of `state` and `shares`, every
    /// counter's in order, renewing the pass's lease every third of it; a
    /// pass whose lease could not be renewed stops sending
    /// ([`Error::FoldPassLost`]).
    pub(super) async fn apply(
        &self,
        pass: &Pass,
        state: &FoldState,
        shares: Shares,
        clock: &(impl Fn() -> SystemTime + Sync),
    ) -> Result<PassApplied, Error> {
        let lease = self.settings.lease;
        let sendable_until = Mutex::new(Instant::now() + lease);
        let renew = async {
            loop {
                tokio::time::sleep(lease / 3).await;
                let asked = Instant::now();
                match self
                    .keeper
                    .renew(self.owner, pass.number, clock() + lease)
                    .await
                {
                    Ok(true) => *lock(&sendable_until) = asked + lease,
                    Ok(false) => return self.pass_lost(pass, "another fold took it over"),
                    Err(err) => tracing::warn!(
                        events = %self.events_name,
                        cause = %err,
                        "cannot renew the fold pass's lease; retrying"
                    ),
                }
            }
        };
        // The passes a catch-up replaced unfinished may have sent held sums.
        let dropped = state.catch_up.as_ref().map_or(&[][..], |c| &c.dropped[..]);
        let work = self.apply_all(
            (pass, dropped),
            &state.held,
            shares,
            clock(),
            &sendable_until,
        );
        tokio::select! {
            applied = work => applied,
            lost = renew => Err(lost),
        }
    }

    async fn apply_all(
        &self,
        (pass, dropped): (&Pass, &[i64]),
        held: &[Held],
        shares: Shares,
        now: SystemTime,
        sendable_until: &Mutex<Instant>,
    ) -> Result<PassApplied, Error> {
        let work = work_of(held, shares);
        let mut batched = self.send_batched(&work, pass, sendable_until).await?;
        let outcomes: Vec<Result<held::Done, Error>> = futures::stream::iter(work)
            .map(|work| {
                let key = work.key.clone();
                // The counter's new sum, sent already in a batch: its one send.
                let mut sent = batched.remove(&CanonicalKey::of(&key));
                held::apply(
                    work,
                    held::Sends {
                        pass: pass.number,
                        recovered: pass.recovered,
                        dropped,
                    },
                    now,
                    move |position, amount, resumed| {
                        let sent = sent.take().filter(|_| position == pass.number);
                        let key = key.clone();
                        async move {
                            match sent {
                                Some(applied) => applied,
                                None => {
                                    self.send(key, (position, amount), resumed, sendable_until)
                                        .await
                                }
                            }
                        }
                    },
                )
            })
            .buffer_unordered(APPLY_CONCURRENCY)
            .collect()
            .await;
        let mut applied = PassApplied::default();
        for done in outcomes {
            let done = done?;
            applied.written += done.written;
            applied.held.extend(done.held);
        }
        // Oldest first, each counter's in its order.
        applied.held.sort_by_key(|h| h.pass);
        Ok(applied)
    }

    /// The new sums of the counters with nothing held (a pass's common
    /// case), sent through the fold lane at the pass's position in
    /// commands of many statements: what each established, by counter,
    /// for `held::apply` to judge as if it had sent it itself.
    async fn send_batched(
        &self,
        work: &[Work],
        pass: &Pass,
        sendable_until: &Mutex<Instant>,
    ) -> Result<HashMap<CanonicalKey, Result<Applied, Error>>, Error> {
        let sums: Vec<(Bson, i64)> = work
            .iter()
            .filter_map(|w| Some((w.key.clone(), held::lone_sum(w)?)))
            .collect();
        let groups: Vec<Vec<(Bson, i64)>> = sums
            .chunks(self.settings.apply_batch.max(1))
            .map(<[_]>::to_vec)
            .collect();
        let mut sent = HashMap::with_capacity(sums.len());
        let mut groups = futures::stream::iter(groups)
            .map(|group| self.send_group(group, pass, sendable_until))
            .buffer_unordered(BATCHES_AT_ONCE);
        while let Some(group) = groups.next().await {
            sent.extend(group?);
        }
        Ok(sent)
    }

    /// One group of new sums in one command (more, when its keys are large).
    async fn send_group(
        &self,
        group: Vec<(Bson, i64)>,
        pass: &Pass,
        sendable_until: &Mutex<Instant>,
    ) -> Result<Vec<(CanonicalKey, Result<Applied, Error>)>, Error> {
        self.sendable(pass, sendable_until)?;
        let lane = LaneId::Named(self.fold_lane.clone()?);
        let keys: Vec<CanonicalKey> = group.iter().map(|(key, _)| CanonicalKey::of(key)).collect();
        let outcomes = self
            .counters
            .add_many_through(group, &lane, pass.number, pass.recovered)
            .await;
        Ok(keys
            .into_iter()
            .zip(outcomes)
            .map(|(key, outcome)| (key, self.judge(outcome)))
            .collect())
    }

    /// Refuses to send once the pass's lease may have run out.
    fn sendable(&self, pass: &Pass, sendable_until: &Mutex<Instant>) -> Result<(), Error> {
        if Instant::now() >= *lock(sendable_until) {
            return Err(self.pass_lost(pass, LEASE_RAN_OUT));
        }
        Ok(())
    }

    /// One sum to one counter through the fold lane at `position`.
    async fn send(
        &self,
        key: Bson,
        (position, amount): (i64, i64),
        resumed: bool,
        sendable_until: &Mutex<Instant>,
    ) -> Result<Applied, Error> {
        if Instant::now() >= *lock(sendable_until) {
            return Err(Error::FoldPassLost {
                events: self.events_name.clone(),
                pass: position,
                why: LEASE_RAN_OUT.into(),
            });
        }
        let lane = LaneId::Named(self.fold_lane.clone()?);
        let outcome = self
            .counters
            .add_through(key, lane, position, amount, resumed)
            .await;
        self.judge(outcome)
    }

    /// What a counter's update through the fold lane established.
    fn judge(&self, outcome: LaneIncrement) -> Result<Applied, Error> {
        let refused = |cause: &Error, maybe_applied| Applied::Refused {
            cause: self.store.scrub(&cause.to_string()),
            maybe_applied,
        };
        match &outcome {
            LaneIncrement::Counted(_) => Ok(Applied::Counted),
            LaneIncrement::OutOfOrder(late) => Ok(Applied::Behind { held: late.held() }),
            LaneIncrement::NotCounted(_) | LaneIncrement::Unknown(_) => {
                let maybe_applied = matches!(outcome, LaneIncrement::Unknown(_));
                let Some(cause) = outcome.cause().cloned() else {
                    return Ok(Applied::Refused {
                        cause: "the counter update failed without a cause".into(),
                        maybe_applied,
                    });
                };
                match cause.class() {
                    // The counter's own refusal (a validator, an overflow, a
                    // malformed lane map): held.
                    Some(ErrorClass::Command) | None => Ok(refused(&cause, maybe_applied)),
                    // The server's trouble, not the counter's: the pass is
                    // resumed later.
                    Some(_) => Err(cause),
                }
            }
        }
    }

    /// The error of a pass that is no longer this fold's to apply.
    pub(super) fn pass_lost(&self, pass: &Pass, why: &str) -> Error {
        Error::FoldPassLost {
            events: self.events_name.clone(),
            pass: pass.number,
            why: why.into(),
        }
    }
}

/// Every counter's work: its held sums (in order), then its share.
fn work_of(held: &[Held], shares: Shares) -> Vec<Work> {
    let mut work: Vec<Work> = Vec::new();
    let mut index: HashMap<CanonicalKey, usize> = HashMap::new();
    for held in held {
        let at = *index.entry(CanonicalKey::of(&held.key)).or_insert_with(|| {
            work.push(Work {
                key: held.key.clone(),
                held: Vec::new(),
                new: None,
            });
            work.len() - 1
        });
        work[at].held.push(held.clone());
    }
    for (bytes, share) in shares {
        match index.get(&bytes) {
            Some(&at) => work[at].new = Some(share),
            None => work.push(Work {
                key: share.key.clone(),
                held: Vec::new(),
                new: Some(share),
            }),
        }
    }
    work
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
