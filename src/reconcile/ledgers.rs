//! The ledger's fold inside a reconcile run: the collection's events are
//! folded (by the ledger's [`EventFold`], `ledger::fold`) beside its
//! pending tokens, each independent of the other — a ledger that cannot
//! fold never stops the token fold or the pruning of its collection, and
//! the reverse.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::ledger::{EventFold, EventFoldSettings};
use crate::reconcile::report::CollectionRun;
use crate::reconcile::{FoldTarget, Mode, Reconciler};
use crate::write::counter::CollectionConfig;

/// The ledger folds a [`Reconciler`] keeps, one per events collection, so
/// that a process keeps one owner id for its passes.
#[derive(Debug, Clone)]
pub(crate) struct Folds {
    settings: EventFoldSettings,
    folds: Arc<std::sync::Mutex<HashMap<String, Arc<EventFold>>>>,
}

impl Folds {
    pub(crate) fn new(settings: EventFoldSettings) -> Self {
        Self {
            settings,
            folds: Arc::default(),
        }
    }
}

impl Reconciler {
    /// The fold of `spec`'s ledger, made on first use.
    pub(crate) fn event_fold(&self, spec: &CollectionConfig) -> Arc<EventFold> {
        let mut folds = self
            .ledgers
            .folds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        folds
            .entry(spec.events_collection_name())
            .or_insert_with(|| {
                Arc::new(EventFold::new(
                    &self.store,
                    spec.clone(),
                    self.ledgers.settings.clone(),
                ))
            })
            .clone()
    }

    /// Folds the collection's ledger, when it has one (its events
    /// collection is configured): `events_folded` in `run`. A dry run
    /// counts the backlog instead.
    pub(crate) async fn fold_ledger(
        &self,
        target: &FoldTarget,
        mode: Mode,
        now: SystemTime,
        stop: &CancellationToken,
        run: &mut CollectionRun,
    ) -> Result<(), Error> {
        if target.spec.events_collection.is_none() {
            return Ok(());
        }
        let fold = self.event_fold(&target.spec);
        match mode {
            Mode::DryRun => run.events_folded = fold.backlog(now).await?.events,
            Mode::Fold => run.events_folded = fold.fold(now, stop).await?.events_folded,
        }
        Ok(())
    }
}
