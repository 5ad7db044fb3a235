//! Several daemon instances, one active (the book: design/daemon.md): a lease document in
//! the state collection, `{_id: "lease", owner, expires}`, taken and
//! renewed atomically. Only its holder folds and alerts; the others stand
//! by and take over once it expires.
//!
//! The fold is safe with any number of active instances — the lease only
//! saves duplicate work and duplicate alerts — so the rules lean towards
//! availability: a standby takes an expired lease at once, and a holder
//! that cannot renew steps down before its lease may have expired, on a
//! timer of its own, whatever the renewal in flight is doing.
//!
//! Expiry is judged on the server's clock (`hello`'s `localTime`), so
//! instances on hosts with skewed clocks agree.

use std::time::Duration;

use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::ReturnDocument;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::metrics::Metrics;
use crate::daemon::sleep_until;
use crate::daemon::state::State;
use crate::document::{Inserted, insert_if_absent};
use crate::error::{Error, RetryBudget, human_duration};
use crate::store::Store;

const LEASE_ID: &str = "lease";

/// Whether this instance may fold and alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Holds the lease (or `[ha]` is off): folds and alerts.
    Active,
    /// Another instance holds the lease: watches, waits.
    Standby,
}

impl Role {
    /// `active` or `standby`, as `/readyz` and the logs say it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Standby => "standby",
        }
    }
}

/// The lease of one instance.
#[derive(Clone, Debug)]
pub(crate) struct Lease {
    store: Store,
    state: State,
    owner: String,
    ttl: Duration,
}

impl Lease {
    /// The lease `owner` takes in `state`'s collection, lasting `ttl`.
    pub(crate) fn new(store: &Store, state: &State, owner: &str, ttl: Duration) -> Self {
        Self {
            store: store.clone(),
            state: state.clone(),
            owner: owner.to_owned(),
            ttl,
        }
    }

    /// Takes the lease if it is free or expired, renews it if this instance
    /// holds it; otherwise reports standby.
    pub(crate) async fn acquire_or_renew(&self) -> Result<Role, Error> {
        let now = self.store.server_time().await?;
        let collection = self.state.collection();
        // Create the document first, never by upsert: racing upserts on a new
        // document are where servers misbehave.
        let blank = doc! { "_id": LEASE_ID, "owner": "", "expires": DateTime::from_millis(0) };
        if let Inserted::New =
            insert_if_absent(&self.store, collection, &blank, "lease.create").await?
        {
            tracing::debug!("lease document created");
        }
        let filter = doc! {
            "_id": LEASE_ID,
            "$or": [{ "owner": &self.owner }, { "expires": { "$lt": DateTime::from_system_time(now) } }],
        };
        let update = doc! { "$set": {
            "owner": &self.owner,
            "expires": DateTime::from_system_time(now + self.ttl),
            "renewed": DateTime::from_system_time(now),
        }};
        // Idempotent for its owner: setting the same owner and a later expiry
        // again is harmless.
        let mut budget = RetryBudget::retry_once("lease.renew");
        let taken: Option<Document> = self
            .store
            .with_retry(&mut budget, || {
                collection
                    .find_one_and_update(filter.clone(), update.clone())
                    .return_document(ReturnDocument::After)
            })
            .await
            .map_err(Error::Server)?;
        Ok(match taken {
            Some(lease) if lease.get_str("owner").is_ok_and(|o| o == self.owner) => Role::Active,
            _ => Role::Standby,
        })
    }

    /// Gives the lease up (at shutdown), so a standby takes over at once.
    pub(crate) async fn release(&self) -> Result<(), Error> {
        let filter = doc! { "_id": LEASE_ID, "owner": &self.owner };
        let update = doc! { "$set": { "owner": "", "expires": DateTime::from_millis(0) } };
        self.store
            .update_one(self.state.collection(), filter, update, "lease.release")
            .await
            .map(|_| ())
    }

    /// Keeps the lease until `shutdown` (a task on `tracker`, so the drain
    /// waits for its release): tries every third of the TTL and publishes
    /// the role on the returned channel.
    ///
    /// The holder's own clock decides when it stops acting active: its
    /// lease runs from the start of the last successful renewal (the server
    /// computed the expiry from a later instant), so it steps down at that
    /// instant plus the TTL minus a margin — also while a renewal is still
    /// in flight, which can take several attempt timeouts. A late answer
    /// that renewed the lease makes it active again only if that still
    /// leaves time.
    pub(crate) fn keep(
        self,
        metrics: Metrics,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> watch::Receiver<Role> {
        let (tx, rx) = watch::channel(Role::Standby);
        tracker.spawn(async move {
            let every = self.ttl / 3;
            let margin = self.ttl / SAFETY_MARGIN_DIVISOR;
            // While active: when this instance must have stepped down.
            let mut held_until: Option<Instant> = None;
            let mut next_attempt = Instant::now();
            let mut started = Instant::now();
            let mut renewal = None;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep_until(next_attempt), if renewal.is_none() => {
                        started = Instant::now();
                        renewal = Some(Box::pin(self.acquire_or_renew()));
                    }
                    result = async { renewal.as_mut().expect("guarded").await }, if renewal.is_some() => {
                        renewal = None;
                        next_attempt = started + every;
                        let role = match result {
                            Ok(Role::Active) if Instant::now() < started + self.ttl - margin => {
                                held_until = Some(started + self.ttl - margin);
                                Role::Active
                            }
                            Ok(_) => {
                                held_until = None;
                                Role::Standby
                            }
                            Err(err) => {
                                let still_held = held_until.is_some();
                                tracing::warn!(
                                    cause = %self.store.explain(&err),
                                    still_held,
                                    "cannot renew the lease"
                                );
                                if still_held { Role::Active } else { Role::Standby }
                            }
                        };
                        self.publish(&tx, &metrics, role, "renewal");
                    }
                    () = sleep_until(held_until), if held_until.is_some() => {
                        held_until = None;
                        tracing::warn!(
                            in_flight = renewal.is_some(),
                            "no renewal succeeded within the lease: stepping down before it expires"
                        );
                        self.publish(&tx, &metrics, Role::Standby, "lease running out");
                    }
                }
            }
            drop(renewal);
            if *tx.borrow() == Role::Active {
                // A server known to be gone is not waited for at a stop.
                let bound = if self.store.seems_reachable() {
                    self.store.attempt_timeout()
                } else {
                    RELEASE_UNREACHABLE
                };
                match tokio::time::timeout(bound, self.release()).await {
                    Ok(Ok(())) => tracing::info!("lease released"),
                    Ok(Err(err)) => tracing::warn!(
                        cause = %self.store.explain(&err),
                        "cannot release the lease; it expires by itself"
                    ),
                    Err(_) => tracing::warn!(
                        within = %human_duration(bound),
                        "the lease could not be released in time; it expires by itself"
                    ),
                }
            }
            tx.send_replace(Role::Standby);
            metrics.lease_active.set(0);
        });
        rx
    }

    /// Publishes `role` (and `tally_lease_active`), logging a change.
    fn publish(&self, tx: &watch::Sender<Role>, metrics: &Metrics, role: Role, why: &str) {
        if *tx.borrow() != role {
            tracing::info!(role = role.as_str(), owner = %self.owner, why, "lease role changed");
        }
        metrics.lease_active.set(i64::from(role == Role::Active));
        tx.send_replace(role);
    }
}

/// How long a stop tries to release the lease when every host failed its
/// last heartbeat.
const RELEASE_UNREACHABLE: Duration = Duration::from_secs(1);

/// The holder steps down this fraction of the TTL before its lease could
/// expire: room for clocks that run at slightly different rates, and for the
/// moment between stepping down and stopping work.
const SAFETY_MARGIN_DIVISOR: u32 = 10;
