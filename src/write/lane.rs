//! Writer lanes: an exact increment in one round trip, safe to repeat any
//! number of times (the book: design/lanes.md).
//!
//! A **lane** is one writer's sequence of operations: an id and a number
//! `s` that only grows. The counter document remembers, per lane that wrote
//! it, the highest `s` applied — `{_id, counter, lanes: {"<lane>": s}}`
//! (the field is [`CollectionConfig::lanes_field`]). Adding `n` to `k`
//! through lane `L` with its next number `s` is one conditioned upsert:
//!
//! ```text
//! updateOne({_id: k, "lanes.L": {$not: {$gte: s}}},
//!           {$inc: {counter: n}, $set: {"lanes.L": s}}, {upsert: true})
//! ```
//!
//! It applies at most once: afterwards the document holds `s`, and the
//! filter no longer matches. Matched or upserted: counted. A duplicate key
//! on `_id` means the filter did not match an existing document — the lane
//! holds `s` already — or a concurrent first insert won the race: the same
//! update is sent once more, and if it collides again the lane's entry is
//! read (`s`: counted earlier; more: out of order, nothing written; less:
//! a race, send again). A transient failure is re-sent once with the same
//! `s` (the retry rule, the book: design/errors.md; tally makes the retry
//! itself). A command error before anything may have applied:
//! not counted. Anything else leaves the outcome unknown, with a
//! [`LaneTicket`].
//!
//! **A double counter** (the legacy shell writes `0` as one) is added to
//! only while the sum is exact as a double — the rule of step 2 and the
//! fold: a `$inc` past 2^53 would round the count away. The filter says so
//! too (cheaper than an update pipeline on this fast path); a counter it
//! refuses makes the upsert collide, and the read finds it: not counted,
//! with the cause ([`Error::Malformed`]) — unknown when an attempt may have
//! applied.
//!
//! **Why a delayed request cannot count again.** A copy of an old request —
//! the lost first attempt, held up in the network, arriving after its retry
//! counted — carries the same `s`, and the document already holds `s`: its
//! filter does not match (its upsert collides on `_id`). A resume re-sends
//! the same update, so any number of resumes, from any host, at once, apply
//! it once. This holds as long as nothing newer was sent on the lane while
//! the old `s` was in flight, and as long as the lane's entry is in the
//! document:
//!
//! - **One lane per handle, one update in flight per counter.** A
//!   [`Counters`] handle mints its lane when it is made, and its clones
//!   share it: make one handle per process and clone it. The lane carries
//!   updates to many counters at once, to each one at a time, in order;
//!   increments of a counter that arrive while its update is in flight
//!   wait and leave together as its next update — **group commit**
//!   ([`sender`]): their sum under one number, each caller told its own
//!   outcome (`Counted`, `NotCounted`, or `Unknown` with the group's shared
//!   ticket). Bounded by `group_max` increments per update and
//!   `queue_limit` waiting per handle (a caller beyond it waits for room).
//! - **Numbers are times.** The number a lane sends is `max(last + 1, now
//!   in µs)` ([`number`]): the entry a lane leaves in a counter tells when
//!   it last wrote it.
//! - **Retirement, per counter.** After an unknown outcome on a counter,
//!   nothing newer goes to that counter on that lane: the handle mints a
//!   fresh lane for that counter alone.
//! - **Pruning, no rotation.** The daemon prunes a minted lane's entry once
//!   it was not written for `lane_ttl` (24 h), and a minted lane's update
//!   is sent, and resumed, only while the time in its number is younger
//!   than `lane_resume_horizon` (23 h): an update arriving after its entry
//!   was pruned would apply again. Entries per counter ≈ the handles that
//!   wrote it within `lane_ttl`, plus one per unknown outcome. (An entry of
//!   tally 0.1's lane pool holds a count, not a time: its age is its lane
//!   id's.)
//!
//! **Named lanes** ([`Counters::add_from`]) serve ordered sources — a Kafka
//! partition, a change stream, a log file: the caller names the lane
//! (`orders:3`) and passes the source's position as `s`, so a message
//! delivered again is recognised and counted once. The caller keeps the
//! lane's rule: one operation in flight, positions in order, and an unknown
//! position resumed (delivered again) before a newer one is sent. Named
//! lanes are never pruned and have no resume horizon.

mod batch;
mod name;
mod number;
mod outcome;
mod sender;

use std::time::{Duration, SystemTime};

use mongodb::bson::{Bson, Document, doc};

pub use name::{BadLaneName, LaneId, LaneName};
// The command line dates a ticket's resume horizon.
#[cfg(feature = "daemon")]
pub(crate) use number::update_age;
pub(crate) use number::written_before;
pub use outcome::{LaneCounted, LaneIncrement, LaneOutOfOrder, LaneTicket};
pub use sender::LaneStats;
pub(crate) use sender::{LaneWriter, writer};

use super::counter::{CollectionConfig, Counters, NotCounted, Stopped, inc_operand};
use crate::document::{bson_type_name, double_takes, exact_double_range};
use crate::error::{Effect, Error, ErrorClass, RetryBudget, duplicate_on_id};
use outcome::{check_amount, check_position};

/// How often an increment reads its lane's entry after its update collided
/// on `_id` (and sends the update again when the entry says a race).
const READ_ROUNDS: u32 = 3;

/// One increment through a lane: everything its update says.
#[derive(Debug)]
struct LaneOp {
    key: Bson,
    lane: LaneId,
    position: i64,
    amount: i64,
}

/// Who sends an update: the increment itself, or a resume of its ticket —
/// for which "nothing this call sent applied" says nothing about the
/// original request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    Increment,
    Resume,
}

/// What sending an update established.
#[derive(Debug)]
enum Sent {
    /// This call's update applied.
    Applied,
    /// The lane holds this number already.
    AppliedEarlier,
    /// The lane holds this later number: nothing was written.
    OutOfOrder(i64),
    /// Definitely not applied.
    NotApplied(Error),
    /// May or may not have applied.
    Unknown(Error),
    /// Nothing was sent: the lane is past its resume horizon.
    Refused(Error),
    /// The sender stopped while the update was on its way: unknown, with
    /// no error to tell.
    Dropped,
}

impl Counters {
    /// Adds `amount` (not zero) to the counter `key` through the named lane
    /// `lane` at the source's `position` (0 or more): the position the lane
    /// holds — the same message delivered again — is counted once; an
    /// earlier one is [`LaneIncrement::OutOfOrder`], nothing written.
    /// Positions must be sent in order, one at a time per lane, each until
    /// it is counted (an unknown one sent again, or resumed, before a newer
    /// one): then an out-of-order position is one counted before.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters, offset: i64) -> Result<(), tally::Error> {
    /// use tally::{LaneIncrement, LaneName};
    ///
    /// // Partition 3 of the `orders` topic: its offsets number the lane.
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// let counted = match views.add_from("home", 1, &lane, offset).await {
    ///     // Counted now, or before (the message delivered again).
    ///     LaneIncrement::Counted(_) => true,
    ///     // Send the same offset again (or resume) before the next one.
    ///     LaneIncrement::Unknown(ticket) => {
    ///         matches!(views.resume_lane(ticket).await?, LaneIncrement::Counted(_))
    ///     }
    ///     // Sent in order, an earlier offset is one counted before.
    ///     LaneIncrement::OutOfOrder(old) => {
    ///         eprintln!("offset {offset} behind {}", old.held());
    ///         true
    ///     }
    ///     LaneIncrement::NotCounted(not) => return Err(not.cause().clone()),
    /// };
    /// if counted {
    ///     // Commit the offset to the source; until then it delivers it again.
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn add_from(
        &self,
        key: impl Into<Bson>,
        amount: i64,
        lane: &LaneName,
        position: i64,
    ) -> LaneIncrement {
        self.add_from_timed(key.into(), amount, lane, position, None)
            .await
    }

    /// [`Counters::add_from`] at `at` (`None`: now, refused in a bucketed
    /// collection: see [`Counters::add_from_at`]).
    pub(super) async fn add_from_timed(
        &self,
        key: Bson,
        amount: i64,
        lane: &LaneName,
        position: i64,
        at: Option<std::time::SystemTime>,
    ) -> LaneIncrement {
        let op = LaneOp {
            key,
            lane: LaneId::Named(lane.clone()),
            position,
            amount,
        };
        let usable = self.lanes.as_ref().map_err(Clone::clone).and_then(|lanes| {
            crate::document::check_key(&op.key)?;
            check_amount(amount)?;
            check_position(&op.lane, position)?;
            super::at::check_named_lane_time(&self.spec, at)?;
            Ok((lanes, self.counter_id(op.key.clone(), at)?))
        });
        match usable {
            Ok((writer, key)) => {
                let op = LaneOp { key, ..op };
                let sent = self.send(writer.resume_horizon, &op, By::Increment).await;
                op.outcome(sent)
            }
            Err(cause) => op.outcome(Sent::NotApplied(cause)),
        }
    }

    /// Sends a ticket's update again — the whole group's, when the ticket
    /// is shared: harmless any number of times, from any caller or
    /// process, concurrently — the lane's number applies once. Returns
    /// [`LaneIncrement::Counted`] (with `settled_earlier` when the lane
    /// holds its number already), [`LaneIncrement::OutOfOrder`] when the
    /// lane holds a later number (nothing written), or, when this attempt
    /// did not settle it either, [`LaneIncrement::Unknown`] with the
    /// ticket: resume again later.
    ///
    /// `Err` means refused without writing anything:
    /// [`Error::LaneResumeHorizonExceeded`] (a minted lane's update whose
    /// time is older than `lane_resume_horizon`, whose entry the daemon may
    /// prune: the increment is counted at most once), or the handle's lane
    /// settings
    /// were refused ([`Error::InvalidArgument`]).
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::{Error, LaneIncrement};
    ///
    /// if let LaneIncrement::Unknown(ticket) = views.add("home", 1).await {
    ///     match views.resume_lane(ticket).await {
    ///         Ok(LaneIncrement::Unknown(ticket)) => eprintln!("resume later: {ticket}"),
    ///         Ok(settled) => println!("{}", settled.name()),
    ///         // Past the resume horizon: counted at most once, nothing written now.
    ///         Err(Error::LaneResumeHorizonExceeded { lane, .. }) => {
    ///             eprintln!("too late for {lane}")
    ///         }
    ///         Err(other) => return Err(other),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn resume_lane(&self, ticket: LaneTicket) -> Result<LaneIncrement, Error> {
        let writer = self.lanes.as_ref().map_err(Clone::clone)?;
        let op = LaneOp {
            key: ticket.key.clone(),
            lane: ticket.lane,
            position: ticket.position,
            amount: ticket.amount,
        };
        match self.send(writer.resume_horizon, &op, By::Resume).await {
            Sent::Refused(cause) => Err(cause),
            sent => Ok(op.outcome_for(&sent, ticket.key, ticket.share)),
        }
    }

    /// Adds `amount` (not zero) to `key` through a fresh lane of its own,
    /// at number 1: the increment of a one-shot process (`tallyd incr
    /// --lane`), whose ticket is its lane alone — a count, not a time, so
    /// its age, and its entry's, is the lane's (minted now).
    #[cfg(feature = "daemon")]
    pub(crate) async fn add_once(
        &self,
        key: impl Into<Bson>,
        amount: i64,
        at: Option<SystemTime>,
    ) -> LaneIncrement {
        let fresh = crate::token::Token::created_at_time(SystemTime::now()).object_id();
        let op = LaneOp {
            key: key.into(),
            lane: LaneId::Minted(fresh),
            position: 1,
            amount,
        };
        let usable = self
            .lanes
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|writer| {
                crate::document::check_key(&op.key)?;
                check_amount(amount)?;
                Ok((writer.resume_horizon, self.counter_id(op.key.clone(), at)?))
            });
        match usable {
            Ok((horizon, key)) => {
                let op = LaneOp { key, ..op };
                let sent = self.send(horizon, &op, By::Increment).await;
                op.outcome(sent)
            }
            Err(cause) => op.outcome(Sent::NotApplied(cause)),
        }
    }

    /// Adds `amount` to `key` through the minted lane `lane` at `position`
    /// for the daemon's fold of recorded events: the lanes protocol's
    /// update, without a resume horizon — the fold finishes a batch it
    /// claimed before anything prunes its lane's entries. `resumed`: a
    /// batch being finished again, whose earlier update may have applied.
    pub(crate) async fn add_through(
        &self,
        key: Bson,
        lane: LaneId,
        position: i64,
        amount: i64,
        resumed: bool,
    ) -> LaneIncrement {
        let op = LaneOp {
            key,
            lane,
            position,
            amount,
        };
        let usable = self.lanes.as_ref().map_err(Clone::clone).and_then(|_| {
            check_amount(amount)?;
            check_position(&op.lane, position)
        });
        let by = if resumed { By::Resume } else { By::Increment };
        match usable {
            Ok(()) => {
                let sent = self.send(Duration::MAX, &op, by).await;
                op.outcome(sent)
            }
            Err(cause) => op.outcome(undecided(by, false, cause)),
        }
    }

    /// The highest number the lane `lane` applied to the counter `key`
    /// (`None` when the document or the entry does not exist).
    #[cfg(feature = "daemon")]
    pub(crate) async fn lane_position(
        &self,
        key: &Bson,
        lane: &LaneId,
    ) -> Result<Option<i64>, Error> {
        Ok(self.lane_view(key, lane).await?.held)
    }

    /// What the counter document `key` shows an update of `lane`: the
    /// lane's entry and the counter.
    async fn lane_view(&self, key: &Bson, lane: &LaneId) -> Result<LaneView, Error> {
        let lanes_field = &self.spec.lanes_field;
        let counter_field = &self.spec.counter_field;
        let projection = doc! { lane_path(&self.spec, lane): 1, counter_field: 1 };
        let Some(found) = self
            .store
            .find_one(
                &self.collection,
                super::at::by_id("_id", key),
                projection,
                "lane.read",
            )
            .await?
        else {
            return Ok(LaneView::default());
        };
        let counter = found.get(counter_field).cloned();
        let malformed = |reason: String| Error::Malformed {
            collection: self.spec.name.clone(),
            id: key.to_string(),
            reason,
        };
        let map = match found.get(lanes_field) {
            None => {
                return Ok(LaneView {
                    held: None,
                    counter,
                });
            }
            Some(Bson::Document(map)) => map,
            Some(other) => {
                let kind = bson_type_name(other);
                return Err(malformed(format!(
                    "the lanes field {lanes_field} is a {kind}, not a document"
                )));
            }
        };
        let held = match map.get(lane.key()) {
            None => None,
            Some(Bson::Int32(s)) => Some(i64::from(*s)),
            Some(Bson::Int64(s)) => Some(*s),
            Some(other) => {
                return Err(malformed(format!(
                    "the entry of lane {lane} in {lanes_field} is a {}, not an integer",
                    bson_type_name(other)
                )));
            }
        };
        Ok(LaneView { held, counter })
    }

    /// Sends `op`'s update until its fate is known or the retry rule gives
    /// up — a minted lane's only while its time is younger than `horizon`.
    async fn send(&self, horizon: Duration, op: &LaneOp, by: By) -> Sent {
        let operation = match by {
            By::Increment => "lane.add",
            By::Resume => "lane.resume",
        };
        let (filter, update) = statement(&self.spec, op);
        let mut maybe_applied = false;
        let mut collided = None;
        for _ in 0..READ_ROUNDS {
            let mut budget = RetryBudget::retry_once(operation).with_duplicate_key_retries(1);
            // Never (re)send a minted lane's update once the daemon may
            // prune its entry: it would apply again.
            let allowed = || within_horizon(horizon, &op.lane, op.position, SystemTime::now());
            let failure = match self
                .upsert_while(&mut budget, &filter, &update, allowed)
                .await
            {
                Ok(()) => return Sent::Applied,
                Err(Stopped::Refused(refused)) if maybe_applied || budget.maybe_applied() => {
                    return Sent::Unknown(refused);
                }
                Err(Stopped::Refused(refused)) => return Sent::Refused(refused),
                Err(Stopped::GaveUp(failure)) => failure,
            };
            // A write-concern error applied on the primary even when it is
            // not worth a retry.
            maybe_applied |= budget.maybe_applied() || failure.effect != Effect::NotApplied;
            let on_id = duplicate_on_id(&failure.source) != Some(false);
            if failure.class != ErrorClass::DuplicateKey || !on_id {
                return undecided(by, maybe_applied, Error::Server(failure));
            }
            // The filter did not match an existing document: the lane holds
            // this number (or a later one) already, or the counter is a
            // double that cannot take the amount exactly — or the document
            // did not exist yet and a concurrent first insert won. The
            // document tells which.
            let view = match self.lane_view(&op.key, &op.lane).await {
                Ok(view) => view,
                Err(read) => return undecided(by, maybe_applied, read),
            };
            match view.held {
                Some(held) if held == op.position => return Sent::AppliedEarlier,
                Some(held) if held > op.position => return Sent::OutOfOrder(held),
                _ => {}
            }
            if let Some(Bson::Double(value)) = view.counter
                && !double_takes(value, op.amount)
            {
                return undecided(by, maybe_applied, self.inexact(op, value));
            }
            collided = Some(Error::Server(failure));
        }
        let cause = collided.expect("every round ends in a collision or returns");
        undecided(by, maybe_applied, cause)
    }

    /// The refusal of `op` on a double counter at `value`, which cannot
    /// take its amount exactly.
    fn inexact(&self, op: &LaneOp, value: f64) -> Error {
        Error::Malformed {
            collection: self.spec.name.clone(),
            id: op.key.to_string(),
            reason: format!(
                "the counter {} is the double {value}, which cannot take {:+} exactly (a double \
                 holds integers of magnitude below 2^53): nothing was written; convert it to a \
                 long to count past that",
                self.spec.counter_field, op.amount
            ),
        }
    }
}

/// What a counter document shows an update of one lane.
#[derive(Debug, Default)]
struct LaneView {
    /// The lane's entry: the highest number it applied.
    held: Option<i64>,
    /// The counter, as stored.
    counter: Option<Bson>,
}

impl LaneOp {
    /// The outcome of the caller whose own increment was `op`.
    fn outcome(self, sent: Sent) -> LaneIncrement {
        let key = self.key.clone();
        let amount = self.amount;
        self.outcome_for(&sent, key, amount)
    }

    /// The outcome of one caller whose `share` of this update's amount was
    /// its increment of `key`: the update's fate, with the caller's own
    /// key and share; an unknown one names the whole update.
    fn outcome_for(&self, sent: &Sent, key: Bson, share: i64) -> LaneIncrement {
        let lane = self.lane.clone();
        let position = self.position;
        let counted = |settled_earlier| {
            LaneIncrement::Counted(LaneCounted {
                key: key.clone(),
                lane: lane.clone(),
                position,
                amount: share,
                settled_earlier,
            })
        };
        match sent {
            Sent::Applied => counted(false),
            Sent::AppliedEarlier => counted(true),
            Sent::OutOfOrder(held) => LaneIncrement::OutOfOrder(LaneOutOfOrder {
                key,
                lane,
                position,
                amount: share,
                held: *held,
            }),
            Sent::NotApplied(cause) | Sent::Refused(cause) => {
                LaneIncrement::NotCounted(NotCounted {
                    key,
                    token: None,
                    lane: Some((lane, position)),
                    amount: share,
                    cause: cause.clone(),
                })
            }
            Sent::Unknown(_) | Sent::Dropped => LaneIncrement::Unknown(LaneTicket {
                key: self.key.clone(),
                lane,
                position,
                amount: self.amount,
                share,
                cause: match sent {
                    Sent::Unknown(cause) => Some(cause.clone()),
                    _ => None,
                },
            }),
        }
    }
}

/// The outcome of a send that did not settle the update: not applied only
/// when nothing the increment sent may have applied — never for a resume,
/// whose original request may have.
fn undecided(by: By, maybe_applied: bool, cause: Error) -> Sent {
    if maybe_applied || by == By::Resume {
        Sent::Unknown(cause)
    } else {
        Sent::NotApplied(cause)
    }
}

/// Refuses a minted lane's update at `position` whose time is at or past
/// `horizon` at `now` (a count's: its lane's creation).
fn within_horizon(
    horizon: Duration,
    lane: &LaneId,
    position: i64,
    now: SystemTime,
) -> Result<(), Error> {
    match number::update_age(lane, position, now) {
        Some(age) if age >= horizon => Err(Error::LaneResumeHorizonExceeded {
            lane: lane.to_string(),
            age,
            horizon,
        }),
        _ => Ok(()),
    }
}

/// `<lanes>.<lane>`: the lane's entry, as a path.
fn lane_path(spec: &CollectionConfig, lane: &LaneId) -> String {
    format!("{}.{}", spec.lanes_field, lane.key())
}

/// The update of `op`: its filter and its operators. The filter also
/// refuses a double counter that cannot take the amount exactly — unless
/// it is integral (`$bitsAllClear` matches only numbers an int64 holds) and
/// within the range where the sum stays below 2^53. One condition on the
/// counter's own path, no `$or`: a top-level `$or` (or `$expr`) takes the
/// test server off its `_id` lookup, 15x slower per update.
fn statement(spec: &CollectionConfig, op: &LaneOp) -> (Document, Document) {
    let path = lane_path(spec, &op.lane);
    let mut inexact_double = doc! { "$type": "double" };
    if let Some((low, high)) = exact_double_range(op.amount) {
        let exact = doc! { "$gt": low, "$lt": high, "$bitsAllClear": 0 };
        inexact_double.insert("$not", exact);
    }
    let mut filter = super::at::by_id("_id", &op.key);
    filter.insert(&path, doc! { "$not": { "$gte": op.position } });
    filter.insert(&spec.counter_field, doc! { "$not": inexact_double });
    let update = doc! {
        "$inc": { &spec.counter_field: inc_operand(op.amount) },
        "$set": { &path: op.position },
    };
    (filter, update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::oid::ObjectId;
    use std::time::Duration;

    #[test]
    fn the_update_is_conditioned_on_the_lane_holding_less_than_its_number() {
        let spec = CollectionConfig::new("views").with_lanes_field("ln");
        let lane = ObjectId::new();
        let op = LaneOp {
            key: Bson::from("k"),
            lane: LaneId::Minted(lane),
            position: 7,
            amount: 3,
        };
        let path = format!("ln.{}", lane.to_hex());
        let (filter, update) = statement(&spec, &op);
        let low = -(1i64 << 53);
        let high = (1i64 << 53) - 3;
        assert_eq!(
            filter,
            doc! {
                "_id": "k",
                &path: { "$not": { "$gte": 7i64 } },
                "counter": { "$not": {
                    "$type": "double",
                    "$not": { "$gt": low, "$lt": high, "$bitsAllClear": 0 },
                } },
            }
        );
        assert_eq!(
            update,
            doc! { "$inc": { "counter": 3i32 }, "$set": { &path: 7i64 } }
        );
        let big = LaneOp {
            amount: i64::from(i32::MAX) + 1,
            ..op
        };
        assert_eq!(
            statement(&spec, &big).1.get_document("$inc").unwrap(),
            &doc! { "counter": i64::from(i32::MAX) + 1 }
        );
    }

    #[test]
    fn a_minted_lane_is_refused_from_its_resume_horizon_on_and_a_named_one_never() {
        let horizon = Duration::from_secs(23 * 3600);
        let minted = ObjectId::new();
        let created: SystemTime = minted.timestamp().into();
        let lane = LaneId::Minted(minted);
        // A count (tally 0.1's pool): the lane's age.
        let just_inside = created + horizon - Duration::from_secs(1);
        assert!(within_horizon(horizon, &lane, 1, just_inside).is_ok());
        let refused = within_horizon(horizon, &lane, 1, created + horizon);
        assert!(
            matches!(refused, Err(Error::LaneResumeHorizonExceeded { .. })),
            "{refused:?}"
        );
        // A time: its own age, whatever the lane's.
        let written = created + Duration::from_secs(48 * 3600);
        let position = number::micros(written);
        assert!(
            within_horizon(
                horizon,
                &lane,
                position,
                written + horizon - Duration::from_secs(1)
            )
            .is_ok()
        );
        assert!(within_horizon(horizon, &lane, position, written + horizon).is_err());
        let named = LaneId::Named(LaneName::new("orders:3").unwrap());
        let far = created + Duration::from_secs(10 * 365 * 86400);
        assert!(within_horizon(horizon, &named, 1, far).is_ok());
    }

    /// Every caller of a group hears the update's fate with its own key
    /// and share; an unknown one names the whole update.
    #[test]
    fn each_caller_of_a_group_gets_the_updates_outcome_with_its_own_share() {
        let op = LaneOp {
            key: Bson::Int32(5),
            lane: LaneId::Minted(ObjectId::new()),
            position: 1_700_000_000_000_000,
            amount: 10,
        };
        let shares = [(Bson::Int64(5), 3), (Bson::Double(5.0), 7)];
        let cause = || Error::InvalidArgument("x".into());
        let fates = [
            Sent::Applied,
            Sent::AppliedEarlier,
            Sent::NotApplied(cause()),
            Sent::Unknown(cause()),
            Sent::Dropped,
            Sent::OutOfOrder(op.position + 1),
        ];
        for sent in &fates {
            let outcomes: Vec<LaneIncrement> = shares
                .iter()
                .map(|(key, share)| op.outcome_for(sent, key.clone(), *share))
                .collect();
            for (outcome, (key, share)) in outcomes.iter().zip(&shares) {
                let unknown = matches!(outcome, LaneIncrement::Unknown(_));
                let amount = if unknown { op.amount } else { *share };
                assert_eq!(outcome.amount(), amount, "{sent:?}");
                assert_eq!(outcome.position(), Some(op.position));
                assert_eq!(outcome.lane(), Some(&op.lane));
                match (sent, outcome) {
                    (Sent::Applied, LaneIncrement::Counted(c)) => assert!(!c.settled_earlier()),
                    (Sent::AppliedEarlier, LaneIncrement::Counted(c)) => {
                        assert!(c.settled_earlier())
                    }
                    (Sent::NotApplied(_), LaneIncrement::NotCounted(n)) => assert_eq!(n.key(), key),
                    (Sent::Unknown(_) | Sent::Dropped, LaneIncrement::Unknown(t)) => {
                        assert_eq!((t.amount(), t.share()), (10, *share));
                        assert_eq!(t.key(), &op.key);
                    }
                    (Sent::OutOfOrder(_), LaneIncrement::OutOfOrder(_)) => {}
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_failed_resume_is_never_not_counted() {
        let cause = || Error::InvalidArgument("x".into());
        assert!(matches!(
            undecided(By::Increment, false, cause()),
            Sent::NotApplied(_)
        ));
        assert!(matches!(
            undecided(By::Increment, true, cause()),
            Sent::Unknown(_)
        ));
        assert!(matches!(
            undecided(By::Resume, false, cause()),
            Sent::Unknown(_)
        ));
    }
}
