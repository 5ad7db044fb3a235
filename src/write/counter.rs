//! Resilient increments: a non-idempotent `$inc` split into two idempotent
//! steps with a pending token (DESIGN §3).
//!
//! 1. **add the token**: `updateOne({_id: k}, {$addToSet: {pending: e}}, {upsert: true})`;
//! 2. **count the token**: conditioned on the entry being pending, one
//!    update adds its amount to the counter and removes every entry of the
//!    token — and the pending field with the last one ([`step`]).
//!
//! Step 1 is idempotent because `$addToSet` is; step 2 because it is
//! conditioned on the token, which it removes. Each is retried once on a
//! transient failure. The caller learns exactly what happened through
//! [`Increment`]: counted, [`PendingToken`] (settle with
//! [`Counters::complete`], or let the daemon fold it), [`UnknownToken`]
//! (settle with [`Counters::resume`] while it is younger than the retry
//! horizon) or not counted. Pending and unknown are different types so that
//! `resume` — which may re-send step 1 — can never be called on a token whose
//! step 2 may have applied.
//!
//! **Settling twice counts once.** `complete` and `resume` may run again —
//! a caller's retry, an operator re-running `tallyd resume`, two hosts
//! settling the same ticket — and once a settle counted a token, the
//! document no longer shows it as pending. So a settle's step 2 writes a
//! marker `{t: token, n: amount}` into the settled field in the same update
//! that counts the token, and applies only while there is none; `resume`
//! reads the marker first, and its re-sent step 1 applies only while there
//! is none. Why that is enough: a marker exists exactly when a settle
//! counted the token; the fold removes markers only after its `grace`,
//! which exceeds the retry horizon; and `resume` refuses to re-send step 1
//! past the horizon. So two resumes, a resume after a `complete` or a
//! `complete` after a resume, from any number of hosts, count once — and a
//! copy of the token re-added later (the original step 1, held up in the
//! network) is never counted by a settle (the fold drops it).
//!
//! **A step 1 held up in the network.** The increment's own step 2 leaves
//! the same marker when any step 1 attempt of the call may have applied
//! (its retry budget says so): exactly then a copy of step 1 may still be
//! on its way, and land after step 2 counted the token. The fold drops such
//! a copy instead of counting it again — as long as it lands before the
//! fold prunes the marker (`grace`). An increment whose step 1 went through
//! at the first attempt sends no copy, and writes no marker.
//!
//! The settings live in [`config`]: [`CollectionConfig`] (a counter
//! collection's field names, shared with the fold) and [`WriterConfig`]
//! (the retry horizon); the outcomes in [`outcome`].

mod config;
mod outcome;
mod step;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

pub use config::{CollectionConfig, Protocol, WriterConfig};
// The daemon's configuration reads its defaults from here.
#[cfg(feature = "daemon")]
pub(crate) use config::{
    DEFAULT_COUNTER_FIELD, DEFAULT_LANE_RESUME_HORIZON, DEFAULT_LANE_ROTATE, DEFAULT_LANE_TTL,
    DEFAULT_LANES, DEFAULT_LANES_FIELD, DEFAULT_PENDING_FIELD, DEFAULT_RETRY_HORIZON,
    DEFAULT_SETTLED_FIELD, MAX_LANES, MIN_RETRY_HORIZON, least_retry_horizon,
};
pub use outcome::{Completion, Counted, Increment, NotCounted, PendingToken, UnknownToken};
// The fold adds to counters the way step 2 does, and reads markers alike.
pub(crate) use step::{exact_as_double, inc_operand, marker_path};

use super::lane::LanePool;
use crate::error::{Effect, Error, ErrorClass, Failure, Next, RetryBudget, duplicate_on_id};
use crate::store::Store;
use crate::token::{Entry, Token};
use step::By;

/// How many duplicate-key failures an increment's step 1 retries: each is
/// an upsert race that applied nothing.
const UPSERT_RACE_RETRIES: u32 = 3;
/// How often `resume` reads the document again after its step 1 found it
/// changed (a duplicate key: a marker appeared, or a race created it).
const RESUME_ROUNDS: u32 = 3;

/// Increments counters of one collection, with either protocol: the
/// two-step increment ([`Counters::increment`]) or a writer lane
/// ([`Counters::add`], DESIGN §3b). Clones share one pool of lanes.
#[derive(Clone, Debug)]
pub struct Counters {
    pub(super) store: Store,
    pub(super) collection: Collection<Document>,
    pub(super) spec: Arc<CollectionConfig>,
    retry_horizon: Duration,
    /// The pool of lanes and their resume horizon, or why the writer's lane
    /// settings were refused (every lane operation is then refused too).
    pub(super) lanes: Result<Lanes, Error>,
}

/// What the lanes protocol needs from a handle.
#[derive(Clone, Debug)]
pub(super) struct Lanes {
    pub(super) pool: Arc<LanePool>,
    pub(super) resume_horizon: Duration,
}

/// What the counter document says about one token.
#[derive(Debug)]
pub(crate) enum Found {
    /// A settle counted it: its marker, as a counted increment.
    Settled(Counted),
    /// Step 1 applied and nothing counted it yet: the entry as stored.
    Pending(PendingToken),
    /// Neither, or there is no such document.
    Absent,
}

/// Why an upsert sent with [`Counters::upsert_while`] did not apply.
pub(super) enum Stopped {
    /// Its guard refused before an attempt: nothing more was sent.
    Refused(Error),
    /// The retry rule gave up after the last attempt failed.
    GaveUp(Box<Failure>),
}

/// What step 1 established.
enum Added {
    /// Applied; `copy_may_land` when an earlier attempt of this call may
    /// have applied too — a copy of it may still be on its way to the
    /// server and re-add the token after step 2 counted it.
    Yes { copy_may_land: bool },
    /// Definitely not applied.
    No(Error),
    /// May or may not have applied.
    Unknown(Error),
    /// A settle's step 1 found the document changed under it (a duplicate
    /// key: a marker for the token, or a race creating the document);
    /// nothing applied. Read it again.
    Changed(Error),
}

impl Counters {
    /// Increments in `spec`'s collection, through `store`. A retry horizon
    /// shorter than two of the store's attempts, or than 2 s, is raised to
    /// that (with a warning). Lane settings
    /// that do not hold together (see [`Counters::try_new`]) are logged as
    /// an error, and every lane operation of the handle is then refused
    /// without writing; the two-step increment works regardless.
    pub fn new(store: &Store, spec: CollectionConfig, writer: WriterConfig) -> Self {
        let counters = Self::build(store, spec, writer);
        if let Err(refused) = &counters.lanes {
            tracing::error!(
                collection = %counters.spec.name,
                cause = %refused,
                "the lane settings are refused; every lane operation of this handle will be too"
            );
        }
        counters
    }

    /// Like [`Counters::new`], but refuses lane settings that do not hold
    /// together: a pool of 1 to 1024 lanes, `lane_rotate` shorter than
    /// `lane_resume_horizon`, and `lane_resume_horizon` plus the store's
    /// attempt bound shorter than `lane_ttl`
    /// ([`Error::InvalidArgument`], naming every setting at fault).
    pub fn try_new(
        store: &Store,
        spec: CollectionConfig,
        writer: WriterConfig,
    ) -> Result<Self, Error> {
        let counters = Self::build(store, spec, writer);
        match &counters.lanes {
            Ok(_) => Ok(counters),
            Err(refused) => Err(refused.clone()),
        }
    }

    fn build(store: &Store, spec: CollectionConfig, writer: WriterConfig) -> Self {
        let least = config::least_retry_horizon(store.attempt_timeout());
        if writer.retry_horizon < least {
            tracing::warn!(
                collection = %spec.name,
                retry_horizon = ?writer.retry_horizon,
                attempt_timeout = ?store.attempt_timeout(),
                raised_to = ?least,
                "the retry horizon is below two attempts (or 2 s): a step 1 whose attempt \
                 timed out could be neither retried nor resumed; raised"
            );
        }
        Self {
            collection: store.collection(&spec.name),
            store: store.clone(),
            spec: Arc::new(spec),
            retry_horizon: writer.retry_horizon.max(least),
            lanes: lanes(&writer, store.attempt_timeout()),
        }
    }

    /// The collection and field names this handle writes.
    pub fn spec(&self) -> &CollectionConfig {
        &self.spec
    }

    /// The retry horizon in force (at least two attempts, and 2 s).
    pub fn retry_horizon(&self) -> Duration {
        self.retry_horizon
    }

    /// Adds `amount` (not zero) to the counter `key`, creating it if needed.
    pub async fn increment(&self, key: impl Into<Bson>, amount: i64) -> Increment {
        let key = key.into();
        let Some(entry) = Entry::new(Token::new(), amount) else {
            return Increment::NotCounted(NotCounted {
                key,
                token: None,
                lane: None,
                amount,
                cause: Error::InvalidArgument("the amount must not be zero".into()),
            });
        };
        match self.add_token(&key, &entry, By::Increment).await {
            Added::Yes { copy_may_land } => {
                // A copy of step 1 still on its way would re-add the counted
                // token: step 2 then leaves the token's marker, as a settle
                // does, and the fold drops the copy instead of counting it.
                let by = if copy_may_land {
                    By::Settle
                } else {
                    By::Increment
                };
                match self.count_token(&key, &entry, by).await {
                    Ok(settled_earlier) => Increment::Counted(Counted {
                        key,
                        entry,
                        settled_earlier,
                    }),
                    Err(cause) => Increment::Pending(PendingToken {
                        key,
                        entry,
                        cause: Some(cause),
                    }),
                }
            }
            Added::No(cause) | Added::Changed(cause) => not_counted(key, entry, cause),
            Added::Unknown(cause) => Increment::Unknown(UnknownToken {
                key,
                entry,
                cause: Some(cause),
            }),
        }
    }

    /// Runs step 2 only for a pending token, leaving its settle marker:
    /// safe at any age, and counts it exactly once however often it is
    /// settled, by this process or any other. When step 2 fails, the
    /// document is read again: a token another settle or the fold counted
    /// meanwhile is counted (settled earlier), not pending.
    pub async fn complete(&self, pending: PendingToken) -> Completion {
        let counted = |pending: PendingToken, settled_earlier| Counted {
            key: pending.key,
            entry: pending.entry,
            settled_earlier,
        };
        let cause = match self
            .count_token(&pending.key, &pending.entry, By::Settle)
            .await
        {
            Ok(settled_earlier) => return Completion::Counted(counted(pending, settled_earlier)),
            Err(cause) => cause,
        };
        match self.lookup(pending.key.clone(), pending.token()).await {
            Ok(Found::Settled(counted)) if counted.amount() == pending.amount() => {
                Completion::Counted(counted)
            }
            // Step 1 applied, so a token gone was counted, as step 2 itself
            // concludes when it matches nothing.
            Ok(Found::Absent) => Completion::Counted(counted(pending, true)),
            _ => Completion::Pending(PendingToken {
                cause: Some(cause),
                ..pending
            }),
        }
    }

    /// Settles an unknown token. Reads the counter document first:
    ///
    /// - a marker for the token (a settle counted it): counted, settled
    ///   earlier — nothing is written;
    /// - the token pending: step 2 only, leaving the marker;
    /// - neither — so the lost attempt provably did not apply, as the daemon
    ///   never folds a token this young: step 1 (applying only while there
    ///   is no marker) and step 2 again, but only while the token is younger
    ///   than the retry horizon.
    ///
    /// `Err` means the ticket is finished without writing anything:
    /// [`Error::RetryHorizonExceeded`] (counted at most once), or
    /// [`Error::AmountMismatch`] (the document holds the token, or its
    /// marker, with another amount). Every other outcome is in the
    /// [`Increment`], with the ticket when it is still unsettled — a failed
    /// read is [`Increment::Unknown`]: nothing was written, resume again
    /// later. A resume is never [`Increment::NotCounted`]: when the server
    /// refuses its step 1, the document is read again and settled from
    /// what it shows, else the ticket comes back unknown (resume again
    /// later) — another host, or the original step 1 held up in the
    /// network, may still add or count it.
    pub async fn resume(&self, unknown: UnknownToken) -> Result<Increment, Error> {
        let mut unknown = unknown;
        for _ in 0..RESUME_ROUNDS {
            let found = match self.lookup(unknown.key.clone(), unknown.token()).await {
                Ok(found) => found,
                Err(cause) => return Ok(Increment::Unknown(unknown.because(cause))),
            };
            if let Some(settled) = self.settle_found(&unknown, found).await {
                return settled;
            }
            let age = unknown.token().age(SystemTime::now());
            if age >= self.retry_horizon {
                return Err(Error::RetryHorizonExceeded {
                    token: unknown.token().to_string(),
                    age,
                    horizon: self.retry_horizon,
                });
            }
            let UnknownToken { key, entry, .. } = unknown;
            match self.add_token(&key, &entry, By::Settle).await {
                Added::Yes { .. } => {
                    let pending = PendingToken {
                        key,
                        entry,
                        cause: None,
                    };
                    return Ok(self.complete(pending).await.into());
                }
                // The token turned older than the horizon while step 1 was
                // being sent: refused, as above.
                Added::No(cause @ Error::RetryHorizonExceeded { .. }) => return Err(cause),
                Added::No(cause) => {
                    let unknown = UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    };
                    let found = self.lookup(unknown.key.clone(), unknown.token()).await;
                    return match found {
                        Ok(found) => match self.settle_found(&unknown, found).await {
                            Some(settled) => settled,
                            None => Ok(Increment::Unknown(unknown)),
                        },
                        Err(_) => Ok(Increment::Unknown(unknown)),
                    };
                }
                Added::Unknown(cause) => {
                    return Ok(Increment::Unknown(UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    }));
                }
                Added::Changed(cause) => {
                    unknown = UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    };
                }
            }
        }
        Ok(Increment::Unknown(unknown))
    }

    /// Settles `unknown` from what its document shows: counted when a settle
    /// counted it (its marker), step 2 when it is pending; `None` when the
    /// document shows neither. Another amount than the ticket's is refused.
    async fn settle_found(
        &self,
        unknown: &UnknownToken,
        found: Found,
    ) -> Option<Result<Increment, Error>> {
        Some(match found {
            Found::Settled(counted) => {
                check_amount(unknown, counted.amount()).map(|()| Increment::Counted(counted))
            }
            Found::Pending(pending) => match check_amount(unknown, pending.amount()) {
                Ok(()) => Ok(self.complete(pending).await.into()),
                Err(err) => Err(err),
            },
            Found::Absent => return None,
        })
    }

    /// Looks `token` up in the counter `key`'s pending entries, in either
    /// entry form (so tokens written by other clients can be completed).
    /// `None` when it is not pending — never added, or counted already.
    pub async fn find_pending(
        &self,
        key: impl Into<Bson>,
        token: Token,
    ) -> Result<Option<PendingToken>, Error> {
        Ok(match self.lookup(key, token).await? {
            Found::Pending(pending) => Some(pending),
            Found::Settled(_) | Found::Absent => None,
        })
    }

    /// What the counter `key` says about `token`: settled (its marker),
    /// pending (its entry, in either form), or neither. A marker wins over
    /// a pending copy of the token (a copy re-added after a settle counted
    /// it: the fold drops it uncounted).
    pub(crate) async fn lookup(&self, key: impl Into<Bson>, token: Token) -> Result<Found, Error> {
        let key = key.into();
        let (pending_field, settled_field) = (&self.spec.pending_field, &self.spec.settled_field);
        let projection = doc! { pending_field: 1, settled_field: 1 };
        let Some(found) = self
            .read_one("counter.lookup", doc! { "_id": &key }, projection)
            .await?
        else {
            return Ok(Found::Absent);
        };
        let malformed = |reason: String| Error::Malformed {
            collection: self.spec.name.clone(),
            id: key.to_string(),
            reason,
        };
        if let Some(marker) = entries_of(&found, settled_field, token, Entry::parse_marker)
            .map_err(&malformed)?
            .first()
        {
            return Ok(Found::Settled(Counted {
                key,
                entry: *marker,
                settled_earlier: true,
            }));
        }
        let copies = entries_of(&found, pending_field, token, Entry::parse).map_err(&malformed)?;
        match copies.as_slice() {
            [] => Ok(Found::Absent),
            [first, rest @ ..] => {
                if let Some(other) = rest.iter().find(|e| e.amount() != first.amount()) {
                    return Err(malformed(format!(
                        "token {token} is pending with two amounts, {} and {}",
                        first.amount(),
                        other.amount()
                    )));
                }
                Ok(Found::Pending(PendingToken {
                    key,
                    entry: *first,
                    cause: None,
                }))
            }
        }
    }

    /// The counter's current value (`None` when the document or the field
    /// does not exist). Pending entries are not included.
    pub async fn value(&self, key: impl Into<Bson>) -> Result<Option<Bson>, Error> {
        let counter_field = &self.spec.counter_field;
        let found = self
            .read_one(
                "counter.value",
                doc! { "_id": key.into() },
                doc! { counter_field: 1 },
            )
            .await?;
        Ok(found.and_then(|d| d.get(counter_field).cloned()))
    }

    /// Step 1: `$addToSet` the entry, upserting the counter document (for a
    /// settle, only while the token has no marker).
    async fn add_token(&self, key: &Bson, entry: &Entry, by: By) -> Added {
        let driver_retries = match self.store.driver_retries_writes().await {
            Ok(retries) => retries,
            Err(err) => return Added::No(err),
        };
        let (filter, update) = step::add(&self.spec, key, entry, by);
        // A settle reads the document again instead: a duplicate key may
        // mean a marker it must not write past.
        let duplicate_retries = match by {
            By::Increment => UPSERT_RACE_RETRIES,
            By::Settle => 0,
        };
        let mut budget = RetryBudget::retry_once("increment.add_token", driver_retries)
            .with_duplicate_key_retries(duplicate_retries);
        // Never (re)send step 1 for a token the daemon may fold: a retry
        // that lands after the fold would count twice.
        let allowed = || {
            let age = entry.token().age(SystemTime::now());
            if age < self.retry_horizon {
                return Ok(());
            }
            Err(Error::RetryHorizonExceeded {
                token: entry.token().to_string(),
                age,
                horizon: self.retry_horizon,
            })
        };
        match self
            .upsert_while(&mut budget, &filter, &update, allowed)
            .await
        {
            Ok(()) => Added::Yes {
                copy_may_land: budget.maybe_applied(),
            },
            Err(Stopped::Refused(cause)) if budget.maybe_applied() => Added::Unknown(cause),
            Err(Stopped::Refused(cause)) => Added::No(cause),
            Err(Stopped::GaveUp(failure)) => self.step_1_failed(&budget, failure, by),
        }
    }

    /// Sends `update` as an upsert of the document `filter` matches, under
    /// `budget`'s retry rule, asking `allowed` before every attempt whether
    /// it may still be sent.
    pub(super) async fn upsert_while(
        &self,
        budget: &mut RetryBudget,
        filter: &Document,
        update: &Document,
        allowed: impl Fn() -> Result<(), Error>,
    ) -> Result<(), Stopped> {
        loop {
            allowed().map_err(Stopped::Refused)?;
            budget.start_attempt();
            let result = self
                .store
                .attempt(
                    self.collection
                        .update_one(filter.clone(), update.clone())
                        .upsert(true),
                )
                .await;
            match result {
                Ok(_) => return Ok(()),
                Err(err) => match budget.after_failure(err) {
                    Next::Retry => continue,
                    Next::GiveUp(failure) => return Err(Stopped::GaveUp(failure)),
                },
            }
        }
    }

    /// What a step 1 that gave up established.
    fn step_1_failed(&self, budget: &RetryBudget, failure: Box<Failure>, by: By) -> Added {
        let on_id = duplicate_on_id(&failure.source) != Some(false);
        if by == By::Settle && failure.class == ErrorClass::DuplicateKey && on_id {
            return Added::Changed(Error::Server(failure));
        }
        // A write-concern error applied on the primary even when it is not
        // worth a retry.
        if budget.maybe_applied() || failure.effect != Effect::NotApplied {
            Added::Unknown(Error::Server(failure))
        } else {
            Added::No(Error::Server(failure))
        }
    }

    /// Step 2 ([`step::count`]). Returns whether the token was already
    /// gone (counted earlier) or, for a settle, already marked.
    async fn count_token(&self, key: &Bson, entry: &Entry, by: By) -> Result<bool, Error> {
        let (filter, pipeline) = step::count(&self.spec, key, entry, by);
        let result = self
            .store
            .update_one(&self.collection, filter, pipeline, "increment.count_token")
            .await?;
        Ok(result.matched_count == 0)
    }

    async fn read_one(
        &self,
        operation: &'static str,
        filter: Document,
        projection: Document,
    ) -> Result<Option<Document>, Error> {
        self.store
            .find_one(&self.collection, filter, projection, operation)
            .await
    }
}

/// The pool the writer's lane settings make, or every problem with them.
fn lanes(writer: &WriterConfig, attempt_timeout: Duration) -> Result<Lanes, Error> {
    let mut problems = writer.lane_margin_problems(attempt_timeout);
    if !(1..=config::MAX_LANES).contains(&writer.lanes) {
        let why = format!("must be 1 to {}, not {}", config::MAX_LANES, writer.lanes);
        problems.insert(0, ("lanes", why));
    }
    if !problems.is_empty() {
        let listed: Vec<String> = problems
            .iter()
            .map(|(key, why)| format!("WriterConfig::{key} {why}"))
            .collect();
        return Err(Error::InvalidArgument(listed.join("; ")));
    }
    Ok(Lanes {
        pool: LanePool::new(writer.lanes, writer.lane_rotate),
        resume_horizon: writer.lane_resume_horizon,
    })
}

fn not_counted(key: Bson, entry: Entry, cause: Error) -> Increment {
    Increment::NotCounted(NotCounted {
        key,
        token: Some(entry.token()),
        lane: None,
        amount: entry.amount(),
        cause,
    })
}

/// Refuses a resume whose amount is not the one the document holds for the
/// token: the caller's ticket and the document disagree about what the
/// increment was.
fn check_amount(unknown: &UnknownToken, stored: i64) -> Result<(), Error> {
    if stored == unknown.amount() {
        Ok(())
    } else {
        Err(Error::AmountMismatch {
            token: unknown.token().to_string(),
            stored,
            given: unknown.amount(),
        })
    }
}

/// The elements of the array `field` of `document` that belong to `token`,
/// parsed with `parse`. An element naming the token that does not parse is
/// reported (as the reason a document is malformed); elements of other
/// tokens are not looked at. No field, or a field that is not an array,
/// holds none.
fn entries_of(
    document: &Document,
    field: &str,
    token: Token,
    parse: fn(&Bson) -> Result<Entry, crate::token::BadEntry>,
) -> Result<Vec<Entry>, String> {
    let Some(Bson::Array(elements)) = document.get(field) else {
        return Ok(Vec::new());
    };
    let oid = Bson::ObjectId(token.object_id());
    let names_token = |value: &Bson| match value {
        Bson::ObjectId(_) => *value == oid,
        Bson::Document(d) => d.get(crate::token::TOKEN_FIELD) == Some(&oid),
        _ => false,
    };
    elements
        .iter()
        .filter(|value| names_token(value))
        .map(|value| {
            parse(value).map_err(|bad| format!("{field}: the entry for token {token}: {bad}"))
        })
        .collect()
}
