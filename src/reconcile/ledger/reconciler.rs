//! The ledger's fold inside a reconcile run: the collection's events are
//! folded before its pending tokens, and before anything is pruned; and
//! the fold lanes a prune must keep for the batches still unfinished.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use mongodb::bson::oid::ObjectId;
use tokio_util::sync::CancellationToken;

use super::{EventFold, EventFoldSettings, claimed_lanes};
use crate::error::Error;
use crate::reconcile::model::{Cutoffs, Lines};
use crate::reconcile::report::CollectionRun;
use crate::reconcile::{FoldTarget, Mode, Reconciler};
use crate::write::counter::CollectionConfig;

/// The ledger folds a [`Reconciler`] keeps, one per events collection, so
/// that their lanes carry from run to run.
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
        let mut folds = self.ledgers.folds.lock().expect("the folds' lock");
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

    /// The lines a prune of `spec` draws: `cutoffs`, keeping the fold lanes
    /// every unfinished batch of the collection's ledger was claimed with —
    /// its configured events collection's, or `<name>_events` when this
    /// configuration names no ledger (another host's may fold it; a
    /// collection that does not exist has none). An error when they cannot
    /// be read: then the caller prunes no lane.
    pub(crate) async fn lines(
        &self,
        spec: &CollectionConfig,
        cutoffs: Cutoffs,
    ) -> Result<Lines, Error> {
        let needed = claimed_lanes(&self.store, &spec.events_collection_name()).await?;
        let needed = needed
            .iter()
            .filter_map(|lane| ObjectId::parse_str(lane).ok())
            .collect();
        Ok(Lines { cutoffs, needed })
    }
}
