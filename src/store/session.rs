//! Causally consistent sessions, and the few operations tally runs in one.
//!
//! A read that must see a write already acknowledged — the fold's state
//! after a commit, a counter after the state that says a pass applied it,
//! the events collection after a position in its log — runs in a causally
//! consistent session at read concern `majority`: the driver sends the
//! session's `operationTime` as `afterClusterTime`, and the server answers
//! only once its majority snapshot has reached it. With majority writes,
//! that gives read-your-writes and monotonic reads even across a failover
//! (the manual's "Causal Consistency and Read and Write Concerns").

use mongodb::bson::{Document, Timestamp};
use mongodb::options::ReadConcern;
use mongodb::results::UpdateResult;
use mongodb::{ClientSession, Collection};

use super::Store;
use crate::error::{Error, Next, RetryBudget};

impl Store {
    /// A causally consistent session whose first read waits for the cluster
    /// time `after` (a time this process saw a write take effect), if any.
    pub(crate) async fn causal_session(
        &self,
        after: Option<Timestamp>,
    ) -> Result<ClientSession, Error> {
        let mut budget = RetryBudget::read_once("session");
        let mut session = self
            .with_retry(&mut budget, || {
                self.client().start_session().causal_consistency(true)
            })
            .await
            .map_err(Error::Server)?;
        if let Some(after) = after {
            session.advance_operation_time(after);
        }
        Ok(session)
    }

    /// One `findOne` in `session` at `read_concern`, retried once on a
    /// transient failure.
    pub(crate) async fn find_one_in(
        &self,
        session: &mut ClientSession,
        collection: &Collection<Document>,
        filter: Document,
        read_concern: ReadConcern,
        operation: &'static str,
    ) -> Result<Option<Document>, Error> {
        let mut budget = RetryBudget::read_once(operation);
        loop {
            budget.start_attempt();
            let found = collection
                .find_one(filter.clone())
                .read_concern(read_concern.clone())
                .session(&mut *session);
            match self.attempt(async { found.await }).await {
                Ok(found) => return Ok(found),
                Err(err) => match self.after_failure(&mut budget, err) {
                    Next::Retry => {}
                    Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            }
        }
    }

    /// One `countDocuments` in `session` at `read_concern`, retried once on
    /// a transient failure.
    pub(crate) async fn count_in(
        &self,
        session: &mut ClientSession,
        collection: &Collection<Document>,
        filter: &Document,
        read_concern: ReadConcern,
        operation: &'static str,
    ) -> Result<u64, Error> {
        let mut budget = RetryBudget::read_once(operation);
        loop {
            budget.start_attempt();
            let counted = collection
                .count_documents(filter.clone())
                .read_concern(read_concern.clone())
                .session(&mut *session);
            match self.attempt(async { counted.await }).await {
                Ok(count) => return Ok(count),
                Err(err) => match self.after_failure(&mut budget, err) {
                    Next::Retry => {}
                    Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            }
        }
    }

    /// One idempotent `updateOne` in `session`, retried once on a
    /// transient failure.
    pub(crate) async fn update_one_in(
        &self,
        session: &mut ClientSession,
        collection: &Collection<Document>,
        filter: Document,
        update: Document,
        operation: &'static str,
    ) -> Result<UpdateResult, Error> {
        let mut budget = RetryBudget::retry_once(operation);
        loop {
            budget.start_attempt();
            let updated = collection
                .update_one(filter.clone(), update.clone())
                .session(&mut *session);
            match self.attempt(async { updated.await }).await {
                Ok(updated) => return Ok(updated),
                Err(err) => match self.after_failure(&mut budget, err) {
                    Next::Retry => {}
                    Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            }
        }
    }

    /// One `insertOne` in `session`, retried once on a transient failure (a
    /// duplicate key after a retry is the caller's to judge).
    pub(crate) async fn insert_one_in(
        &self,
        session: &mut ClientSession,
        collection: &Collection<Document>,
        document: Document,
        operation: &'static str,
    ) -> Result<(), Error> {
        let mut budget = RetryBudget::retry_once(operation);
        loop {
            budget.start_attempt();
            let inserted = collection
                .insert_one(document.clone())
                .session(&mut *session);
            match self.attempt(async { inserted.await }).await {
                Ok(_) => return Ok(()),
                Err(err) => match self.after_failure(&mut budget, err) {
                    Next::Retry => {}
                    Next::GiveUp(failure) => return Err(Error::Server(failure)),
                },
            }
        }
    }
}

impl Store {
    /// The deployment's cluster time now (a `ping`'s `operationTime`):
    /// every write acknowledged before took effect at or before it.
    pub(crate) async fn cluster_time(&self) -> Result<Timestamp, Error> {
        let mut budget = RetryBudget::read_once("cluster_time");
        let reply = self
            .with_retry(&mut budget, || {
                self.database()
                    .run_command(mongodb::bson::doc! { "ping": 1 })
            })
            .await
            .map_err(Error::Server)?;
        reply
            .get_timestamp("operationTime")
            .map_err(|_| Error::ReplicaSetRequired {
                what: "the events ledger".into(),
            })
    }
}
