//! One counter's part of a pass: its held sums, then its new sum, through
//! the fold lane in order — and what stays held.
//!
//! A counter the server refuses to update (an `$inc` past 2^63, a string
//! counter, a validator, a malformed lane map) never stops the others: its
//! sum is **held** in the fold state with the pass that produced it, and
//! the pass commits anyway. Every later pass offers the counter's held sums
//! again, oldest first, each at its own fold lane position (its pass), each
//! until the counter takes it; a newer sum never goes out while an older
//! one is held — it is held behind it — so the lane's position on the
//! counter tells exactly which sums it has.
//!
//! Two held sums are merged (the newer added to the older, at the older's
//! position) only when no send of either may have applied: the older was
//! refused by a definite answer to the one send this fold made of it, the
//! newer was never sent. Sums of a recovered pass — whose earlier owner may
//! have sent anything — are never merged. A held sum merged to zero (a
//! refund after a refused sale) is taken without a write: it adds nothing,
//! and neither part of it applied.
//!
//! A recovered pass sends again what its earlier attempt may have applied:
//! a held sum whose counter's fold lane is already at a later position of
//! the pass's own sequence for that counter was applied before it (see
//! `refusal`); only a position the pass never sends says the lane was
//! reset.

use std::future::Future;
use std::time::SystemTime;

use mongodb::bson::Bson;

use super::sums::Share;
use crate::error::Error;
use crate::ledger::state::Held;

/// What sending one sum to its counter established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Applied {
    /// The counter has it (now or from an earlier send).
    Counted,
    /// The server refused it for this counter's own reasons; `maybe_applied`
    /// when an earlier send of it may still have applied.
    Refused { cause: String, maybe_applied: bool },
    /// The counter's fold lane holds the later position `held`: nothing was
    /// written. [`apply`] tells whether that position came after this sum
    /// applied, or says the lane was reset.
    Behind { held: i64 },
}

/// A counter's work in a pass.
#[derive(Debug, Clone)]
pub(super) struct Work {
    pub(super) key: Bson,
    /// Its held sums, in order.
    pub(super) held: Vec<Held>,
    /// Its share of the pass's events.
    pub(super) new: Option<Share>,
}

/// What a counter's work came to.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Done {
    /// The counter's held sums after the pass, in order.
    pub(super) held: Vec<Held>,
    /// Sums sent.
    pub(super) written: u64,
}

/// Which sends of a counter's sums may have been made before this pass's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sends<'a> {
    /// The pass's number: the new sum's position.
    pub(super) pass: i64,
    /// The pass was taken over or resumed: any of its sends may have
    /// applied.
    pub(super) recovered: bool,
    /// Passes left unfinished that a catch-up replaced (`tallyd
    /// fold-from`): each sent the held sums older than it, in order, then
    /// its own, so a fold lane at one of them has every older held sum.
    pub(super) dropped: &'a [i64],
}

impl Sends<'_> {
    /// Whether a send of the held sum at `position` may have applied.
    fn maybe_before(&self, position: i64) -> bool {
        self.recovered || self.dropped.iter().any(|&d| d > position)
    }
}

/// Sends `work`'s sums in order through `send(position, amount, resumed)`
/// until one is refused; holds that one and everything after it. An `Err`
/// from `send` (a transient failure: the server, not the counter) ends the
/// pass, to be resumed.
pub(super) async fn apply<F, Fut>(
    work: Work,
    sends: Sends<'_>,
    now: SystemTime,
    mut send: F,
) -> Result<Done, Error>
where
    F: FnMut(i64, i64, bool) -> Fut,
    Fut: Future<Output = Result<Applied, Error>>,
{
    let Sends {
        pass, recovered, ..
    } = sends;
    let unusable = crate::document::check_key(&work.key).err();
    let new = work.new.filter(|s| s.amount != 0);
    // The positions this pass's sends to the counter may have left on its
    // fold lane, in order: its held sums (a zero one needs no write), the
    // unfinished passes a catch-up replaced, then its new sum.
    let positions: Vec<i64> = work
        .held
        .iter()
        .filter(|h| h.amount != 0)
        .map(|h| h.pass)
        .chain(sends.dropped.iter().copied())
        .chain(new.as_ref().map(|_| pass))
        .collect();
    let mut done = Done::default();
    let mut blocked = false;
    for mut held in work.held {
        held.maybe_applied |= sends.maybe_before(held.pass);
        if !blocked {
            // Merged to zero (a refund after a refused sale; merged only
            // when neither part may have applied): nothing to add, and the
            // lanes protocol takes no zero amount. Taken without a write.
            if held.amount == 0 {
                continue;
            }
            match sendable(held.amount, unusable.as_ref()) {
                Err(cause) => held.cause = cause,
                Ok(amount) => {
                    done.written += 1;
                    let sent = send(held.pass, amount, held.maybe_applied).await?;
                    let Some((cause, maybe_applied)) =
                        refusal(sent, held.pass, sends.maybe_before(held.pass), &positions)
                    else {
                        continue;
                    };
                    held.cause = cause;
                    held.maybe_applied |= maybe_applied;
                }
            }
        }
        blocked = true;
        done.held.push(held);
    }
    let Some(share) = new else {
        return Ok(done);
    };
    let mut new = Held {
        key: share.key,
        pass,
        amount: share.amount,
        events: share.events,
        maybe_applied: recovered,
        cause: String::new(),
        since: now,
    };
    if blocked {
        new.cause = "held behind an older sum of this counter".into();
        match done.held.last_mut() {
            Some(last) if !last.maybe_applied && !new.maybe_applied => {
                last.amount += new.amount;
                last.events += new.events;
            }
            _ => done.held.push(new),
        }
        return Ok(done);
    }
    match sendable(new.amount, unusable.as_ref()) {
        Err(cause) => new.cause = cause,
        Ok(amount) => {
            done.written += 1;
            let sent = send(pass, amount, recovered).await?;
            let Some((cause, maybe_applied)) = refusal(sent, pass, recovered, &positions) else {
                return Ok(done);
            };
            new.cause = cause;
            new.maybe_applied |= maybe_applied;
        }
    }
    done.held.push(new);
    Ok(done)
}

/// What `sent` says of the sum at `position`: `None` when the counter has
/// it, else why it is held and whether a send of it may have applied.
///
/// The fold lane holding a later position is the only answer that needs
/// judging. The fold sends a counter's sums in order, each only once the
/// one before it was counted, and a position above this pass's only once
/// this pass committed. So when an earlier send may have applied (a
/// recovered pass, or an unfinished pass a catch-up replaced), a lane at a
/// later position of the sequence for the counter (`positions`) got there
/// after this sum applied: counted. Anything else — a position this fold
/// never sends the counter, or one found where no earlier send was made —
/// means the lane did not come from this fold's sends (its state was
/// reset, or another ledger folds under the same name): refused, and
/// nothing was written, so it counts nowhere twice.
fn refusal(
    sent: Applied,
    position: i64,
    recovered: bool,
    positions: &[i64],
) -> Option<(String, bool)> {
    match sent {
        Applied::Counted => None,
        Applied::Refused {
            cause,
            maybe_applied,
        } => Some((cause, maybe_applied)),
        Applied::Behind { held } if recovered && held > position && positions.contains(&held) => {
            None
        }
        Applied::Behind { held } => Some((
            format!(
                "the counter's fold lane is at pass {held} already, past {position}: its fold \
                 state was reset, or another ledger folds into it under the same name"
            ),
            false,
        )),
    }
}

/// The amount to send, or why no counter update can carry it.
/// The one send [`apply`] makes of `work` when the counter has nothing
/// held: its new sum (not zero, fitting a counter, the key usable) at the
/// pass's position. `None` when `apply` would send anything else, or
/// nothing.
pub(super) fn lone_sum(work: &Work) -> Option<i64> {
    if !work.held.is_empty() {
        return None;
    }
    let unusable = crate::document::check_key(&work.key).err();
    let share = work.new.as_ref().filter(|s| s.amount != 0)?;
    sendable(share.amount, unusable.as_ref()).ok()
}

fn sendable(amount: i128, unusable: Option<&Error>) -> Result<i64, String> {
    if let Some(unusable) = unusable {
        return Err(unusable.to_string());
    }
    i64::try_from(amount).map_err(|_| {
        format!(
            "its events sum to {amount}, past what a counter holds (2^63): no update can add it"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::RefCell;

    /// A counter as the lanes protocol keeps it: its value and the fold
    /// lane's position; it refuses every update while `refusing`.
    #[derive(Debug, Default)]
    struct Counter {
        value: i128,
        position: i64,
        refusing: bool,
        /// Positions applied, in order.
        applied: Vec<i64>,
    }

    impl Counter {
        fn update(&mut self, position: i64, amount: i64) -> Applied {
            assert_ne!(amount, 0, "the lanes protocol takes no zero amount");
            if self.position == position {
                return Applied::Counted;
            }
            if self.position > position {
                return Applied::Behind {
                    held: self.position,
                };
            }
            if self.refusing {
                return Applied::Refused {
                    cause: "refused".into(),
                    maybe_applied: false,
                };
            }
            self.value += i128::from(amount);
            self.position = position;
            self.applied.push(position);
            Applied::Counted
        }
    }

    fn block_on<T>(future: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(future)
    }

    fn share(amount: i128, events: u64) -> Share {
        Share {
            key: Bson::from("c"),
            amount,
            events,
            malformed: 0,
        }
    }

    fn run(counter: &RefCell<Counter>, held: Vec<Held>, new: Option<Share>, pass: i64) -> Done {
        attempt(counter, held, new, pass, false, None).expect("no transient failure")
    }

    /// Where an attempt of a pass stops: at its `nth` send (0 the first),
    /// before the counter sees it or after it applied (its reply lost).
    #[derive(Debug, Clone, Copy)]
    struct Crash {
        nth: usize,
        applied: bool,
    }

    /// One attempt of a pass; `Err` when it stopped at `crash`.
    fn attempt(
        counter: &RefCell<Counter>,
        held: Vec<Held>,
        new: Option<Share>,
        pass: i64,
        recovered: bool,
        crash: Option<Crash>,
    ) -> Result<Done, Error> {
        let work = Work {
            key: Bson::from("c"),
            held,
            new,
        };
        let sends = std::cell::Cell::new(0);
        let sent = apply(
            work,
            sends_of(pass, recovered),
            SystemTime::UNIX_EPOCH,
            |p, n, _| {
                let nth = sends.replace(sends.get() + 1);
                let answer = match crash {
                    Some(crash) if crash.nth == nth => {
                        if crash.applied {
                            let _ = counter.borrow_mut().update(p, n);
                        }
                        Err(Error::InvalidArgument("the pass stopped".into()))
                    }
                    _ => Ok(counter.borrow_mut().update(p, n)),
                };
                async move { answer }
            },
        );
        block_on(sent)
    }

    fn sends_of(pass: i64, recovered: bool) -> Sends<'static> {
        Sends {
            pass,
            recovered,
            dropped: &[],
        }
    }

    /// A pass left unfinished after it sent a held sum (position 1) and its
    /// own (2), replaced by a catch-up (`tallyd fold-from`) whose first
    /// chunk is pass 3: the lane at 2 says the held sum applied — counted,
    /// not taken for a reset — and the chunk's own sum goes out.
    #[test]
    fn a_held_sum_sent_by_a_pass_a_catch_up_replaced_is_counted() {
        let counter = RefCell::new(Counter::default());
        let _ = counter.borrow_mut().update(1, 5);
        let _ = counter.borrow_mut().update(2, 1);
        let work = Work {
            key: Bson::from("c"),
            held: vec![held(1, 5)],
            new: Some(share(4, 1)),
        };
        let sends = Sends {
            pass: 3,
            recovered: false,
            dropped: &[2],
        };
        let sent = apply(work, sends, SystemTime::UNIX_EPOCH, |p, n, _| {
            let answer = counter.borrow_mut().update(p, n);
            async move { Ok(answer) }
        });
        let done = block_on(sent).unwrap();
        assert!(done.held.is_empty(), "{done:?}");
        assert_eq!(counter.borrow().value, 10);
        assert_eq!(counter.borrow().applied, vec![1, 2, 3]);
        // Without the replaced pass, the same lane is a reset: held.
        let counter = RefCell::new(Counter::default());
        let _ = counter.borrow_mut().update(2, 1);
        let done = run(&counter, vec![held(1, 5)], Some(share(4, 1)), 3);
        assert!(done.held[0].cause.contains("reset"), "{done:?}");
        assert_eq!(counter.borrow().applied, vec![2], "nothing written");
    }

    fn held(pass: i64, amount: i128) -> Held {
        Held {
            key: Bson::from("c"),
            pass,
            amount,
            events: 1,
            maybe_applied: false,
            cause: "refused".into(),
            since: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_held_sum_merged_to_zero_is_taken_without_a_write() {
        let counter = RefCell::new(Counter::default());
        let done = run(&counter, vec![held(1, 0)], Some(share(3, 1)), 2);
        assert!(done.held.is_empty(), "{done:?}");
        assert_eq!(done.written, 1, "only the new sum is sent");
        assert_eq!(
            (counter.borrow().value, counter.borrow().applied.clone()),
            (3, vec![2])
        );
    }

    #[test]
    fn a_resumed_pass_finds_its_held_sums_applied_before_its_new_one() {
        // The first attempt applied the held sum (1) and the new one (2),
        // then stopped before its commit.
        let counter = RefCell::new(Counter::default());
        let stopped = attempt(
            &counter,
            vec![held(1, 8)],
            Some(share(1, 1)),
            2,
            false,
            Some(Crash {
                nth: 1,
                applied: true,
            }),
        );
        assert!(stopped.is_err());
        let done =
            attempt(&counter, vec![held(1, 8)], Some(share(1, 1)), 2, true, None).expect("resumed");
        assert!(done.held.is_empty(), "{done:?}");
        assert_eq!(counter.borrow().value, 9, "counted once");
    }

    #[test]
    fn a_fold_lane_past_anything_the_pass_sends_is_a_refusal_even_when_resumed() {
        // The lane is at 7: no send of this fold's put it there (a reset).
        let counter = RefCell::new(Counter {
            position: 7,
            ..Counter::default()
        });
        for recovered in [false, true] {
            let done = attempt(
                &counter,
                vec![held(1, 8)],
                Some(share(1, 1)),
                2,
                recovered,
                None,
            )
            .expect("no transient failure");
            let kept: i128 = done.held.iter().map(|h| h.amount).sum();
            assert_eq!(kept, 9, "both sums held (merged when definite): {done:?}");
            assert!(
                done.held[0].cause.contains("at pass 7"),
                "{}",
                done.held[0].cause
            );
        }
        assert_eq!(counter.borrow().value, 0);
    }

    #[test]
    fn a_refused_sum_is_held_and_the_next_ones_wait_behind_it_merged() {
        let counter = RefCell::new(Counter {
            refusing: true,
            ..Counter::default()
        });
        let done = run(&counter, Vec::new(), Some(share(2, 2)), 1);
        assert_eq!(done.held.len(), 1);
        let done = run(&counter, done.held, Some(share(3, 1)), 2);
        assert_eq!(done.held.len(), 1, "never sent, definitely refused: merged");
        assert_eq!(
            (done.held[0].pass, done.held[0].amount, done.held[0].events),
            (1, 5, 3)
        );
        counter.borrow_mut().refusing = false;
        let done = run(&counter, done.held, Some(share(4, 1)), 3);
        assert!(done.held.is_empty());
        assert_eq!(counter.borrow().value, 9);
        assert_eq!(counter.borrow().applied, vec![1, 3]);
    }

    #[test]
    fn sums_of_a_recovered_pass_are_never_merged() {
        let counter = RefCell::new(Counter {
            refusing: true,
            ..Counter::default()
        });
        let work = Work {
            key: Bson::from("c"),
            held: Vec::new(),
            new: Some(share(2, 1)),
        };
        let sent = apply(
            work,
            sends_of(1, true),
            SystemTime::UNIX_EPOCH,
            |p, n, _| {
                let answer = counter.borrow_mut().update(p, n);
                async move { Ok(answer) }
            },
        );
        let done = block_on(sent).unwrap();
        assert!(done.held[0].maybe_applied);
        let done = run(&counter, done.held, Some(share(3, 1)), 2);
        assert_eq!(done.held.len(), 2, "the older may have applied: kept apart");
    }

    /// `lone_sum` is exactly the one send `apply` makes of a counter with
    /// nothing held (what the fold sends in a batch for it), and nothing
    /// where `apply` sends something else or nothing.
    #[test]
    fn a_lone_sum_is_the_one_send_apply_makes() {
        let work = |held: Vec<Held>, new: Option<Share>| Work {
            key: Bson::from("c"),
            held,
            new,
        };
        let sends = |w: Work| {
            let sent = RefCell::new(Vec::new());
            block_on(apply(
                w,
                sends_of(9, false),
                SystemTime::UNIX_EPOCH,
                |p, n, _| {
                    sent.borrow_mut().push((p, n));
                    async { Ok(Applied::Counted) }
                },
            ))
            .unwrap();
            sent.into_inner()
        };
        for w in [
            work(Vec::new(), Some(share(5, 2))),
            work(Vec::new(), Some(share(0, 2))),
            work(Vec::new(), Some(share(i128::from(i64::MAX) + 1, 2))),
            work(Vec::new(), None),
            work(vec![held(3, 1)], Some(share(5, 2))),
        ] {
            let lone = lone_sum(&w);
            let sent = sends(w);
            match lone {
                Some(n) => assert_eq!(sent, [(9, n)]),
                None => assert_ne!(sent.len(), 1, "{sent:?}"),
            }
        }
        let bad_key = Work {
            key: Bson::Document(mongodb::bson::doc! { "$gt": "" }),
            ..work(Vec::new(), Some(share(1, 1)))
        };
        assert_eq!(lone_sum(&bad_key), None);
    }

    #[test]
    fn an_operator_shaped_key_is_held_and_never_sent() {
        let key = Bson::Document(mongodb::bson::doc! { "$gt": "" });
        let work = Work {
            key: key.clone(),
            held: Vec::new(),
            new: Some(Share {
                key,
                amount: 1,
                events: 1,
                malformed: 0,
            }),
        };
        let sent = apply(
            work,
            sends_of(1, false),
            SystemTime::UNIX_EPOCH,
            |_, _, _| async { panic!("never sent") },
        );
        let done = block_on(sent).unwrap();
        assert_eq!(done.held.len(), 1);
        assert!(
            done.held[0].cause.contains("cannot be used"),
            "{}",
            done.held[0].cause
        );
    }

    proptest! {
        /// Whatever the counter refuses and accepts, pass after pass: every
        /// event is in the counter or in a held sum, exactly once; the
        /// counter takes positions in order; the held sums are the suffix
        /// of what the counter lacks.
        #[test]
        fn every_sum_is_in_the_counter_or_held_exactly_once(
            passes in proptest::collection::vec(
                (-4i64..5, any::<bool>(), proptest::option::of((0usize..4, any::<bool>()))),
                1..40,
            )
        ) {
            let counter = RefCell::new(Counter::default());
            let mut held = Vec::new();
            let mut total = 0i128;
            for (pass, (amount, refusing, crash)) in passes.into_iter().enumerate() {
                let pass = pass as i64 + 1;
                counter.borrow_mut().refusing = refusing;
                total += i128::from(amount);
                let new = (amount != 0).then(|| share(amount.into(), 1));
                // An attempt may stop at any send, applied or not; the pass
                // is then resumed (recovered) from the same state.
                let crash = crash.map(|(nth, applied)| Crash { nth, applied });
                held = match attempt(&counter, held.clone(), new.clone(), pass, false, crash) {
                    Ok(done) => done.held,
                    Err(_) => attempt(&counter, held, new, pass, true, None)
                        .expect("a resumed pass")
                        .held,
                };
                let kept: i128 = held.iter().map(|h| h.amount).sum();
                prop_assert_eq!(counter.borrow().value + kept, total);
                let applied = counter.borrow().applied.clone();
                prop_assert!(applied.windows(2).all(|w| w[0] < w[1]));
                let position = counter.borrow().position;
                prop_assert!(held.iter().all(|h| h.pass > position));
            }
        }
    }
}
