//! Several daemon instances, one active (DESIGN §6): a lease document in
//! the state collection, `{_id: "lease", owner, expires}`, taken and
//! renewed atomically. Only its holder folds and alerts; the others stand
//! by and take over once it expires.
//!
//! The fold is safe with any number of active instances — the lease only
//! saves duplicate work and duplicate alerts — so the rules lean towards
//! availability: a standby takes an expired lease at once, and a holder
//! that cannot renew steps down when its lease may have expired.
//!
//! Expiry is judged on the server's clock (`hello`'s `localTime`), so
//! instances on hosts with skewed clocks agree.

use std::time::{Duration, Instant};

use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::ReturnDocument;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::daemon::metrics::Metrics;
use crate::daemon::state::State;
use crate::document::{Inserted, insert_if_absent};
use crate::error::{Error, RetryBudget};
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
        let driver_retries = self.store.driver_retries_writes().await?;
        // Idempotent for its owner: setting the same owner and a later expiry
        // again is harmless.
        let mut budget = RetryBudget::retry_once("lease.renew", driver_retries);
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

    /// Keeps the lease until `shutdown`: tries every third of the TTL and
    /// publishes the role on the returned channel. A holder that cannot
    /// renew steps down once its lease may have expired.
    pub(crate) fn keep(
        self,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> watch::Receiver<Role> {
        let (tx, rx) = watch::channel(Role::Standby);
        tokio::spawn(async move {
            let every = self.ttl / 3;
            let mut last_renewed: Option<Instant> = None;
            loop {
                let attempt = Instant::now();
                let role = match self.acquire_or_renew().await {
                    Ok(role) => {
                        if role == Role::Active {
                            last_renewed = Some(attempt);
                        }
                        role
                    }
                    Err(err) => {
                        let still_held = last_renewed
                            .is_some_and(|at| at.elapsed() < self.ttl.saturating_sub(every));
                        tracing::warn!(cause = %err, still_held, "cannot renew the lease");
                        if still_held {
                            Role::Active
                        } else {
                            Role::Standby
                        }
                    }
                };
                if *tx.borrow() != role {
                    tracing::info!(role = role.as_str(), owner = %self.owner, "lease role changed");
                }
                metrics.lease_active.set(i64::from(role == Role::Active));
                tx.send_replace(role);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(every) => {}
                }
            }
            if *tx.borrow() == Role::Active {
                match self.release().await {
                    Ok(()) => tracing::info!("lease released"),
                    Err(err) => {
                        tracing::warn!(cause = %err, "cannot release the lease; it expires by itself")
                    }
                }
            }
            tx.send_replace(Role::Standby);
            metrics.lease_active.set(0);
        });
        rx
    }
}
