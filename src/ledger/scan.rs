//! Reads of the events collection itself, for a catch-up's chunks and for
//! the exact reads while one runs: the fields the fold uses, at read concern
//! `majority` in the caller's causal session, in large batches.

use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReadConcern;
use mongodb::{ClientSession, Collection};

use crate::error::{Error, Failure, Next, RetryBudget};
use crate::ledger::field;
use crate::ledger::log::Logged;
use crate::store::Store;

/// How many events a read takes per batch (a few megabytes).
const BATCH: u32 = 10_000;

/// Which events a read takes: those matching `filter`, or only the
/// `first` of them by number.
pub(crate) struct Matching {
    pub(crate) filter: Document,
    pub(crate) first: Option<usize>,
}

impl From<Document> for Matching {
    fn from(filter: Document) -> Self {
        Matching {
            filter,
            first: None,
        }
    }
}

/// The events of `events` matching, read in `session` at read concern
/// `majority` (retried once, as any read; `operation` names it).
pub(crate) async fn events_matching(
    store: &Store,
    events: &Collection<Document>,
    session: &mut ClientSession,
    matching: impl Into<Matching>,
    operation: &'static str,
) -> Result<Vec<Logged>, Error> {
    let Matching { filter, first } = matching.into();
    let projection = doc! { field::COUNTER: 1, field::AMOUNT: 1, field::NUMBER: 1 };
    let mut budget = RetryBudget::read_once(operation);
    loop {
        budget.start_attempt();
        let mut found = events
            .find(filter.clone())
            .projection(projection.clone())
            .batch_size(BATCH)
            .read_concern(ReadConcern::majority());
        if let Some(first) = first {
            found = found
                .sort(doc! { field::NUMBER: 1 })
                .limit(i64::try_from(first).unwrap_or(i64::MAX));
        }
        let found = found.session(&mut *session);
        let mut cursor = match store.attempt(async { found.await }).await {
            Ok(cursor) => cursor,
            Err(err) => match store.after_failure(&mut budget, err) {
                Next::Retry => continue,
                Next::GiveUp(failure) => return Err(Error::Server(failure)),
            },
        };
        let mut read = Vec::new();
        while let Some(document) = cursor
            .next(&mut *session)
            .await
            .transpose()
            .map_err(|err| Error::Server(Failure::once(operation, err)))?
        {
            read.push(logged(document));
        }
        return Ok(read);
    }
}

/// An event document as the fold reads it.
pub(crate) fn logged(document: Document) -> Logged {
    Logged {
        key: document.get("_id").cloned().unwrap_or(Bson::Null),
        counter: document.get(field::COUNTER).cloned(),
        amount: document.get(field::AMOUNT).cloned(),
        number: document.get(field::NUMBER).cloned(),
    }
}
