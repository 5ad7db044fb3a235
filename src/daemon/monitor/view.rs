//! The view itself: what the monitor keeps of each document (its pending
//! entries' tokens and its lane map's size — never the map), and how a
//! document is read into it.

use std::collections::HashMap;

use mongodb::bson::{Bson, Document, oid::ObjectId};

use crate::reconcile::FoldTarget;
use crate::reconcile::model::{self, Cutoffs};
use crate::token::Entry;

/// What the view keeps of one document.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Held {
    /// A well-formed document: its pending entries' tokens and the number
    /// of entries in its lane map.
    Entries {
        /// The pending entries' tokens.
        tokens: Vec<ObjectId>,
        /// Entries in the lane map.
        lanes: u64,
    },
    /// The document is malformed.
    Malformed(String),
}

/// The pending entries and lane map sizes of one collection's documents.
#[derive(Debug, Default)]
pub(super) struct View {
    /// Keyed by the `_id`'s display form (ids equal to the server are equal
    /// here: `1` and `NumberLong(1)` display alike), with the `_id` itself.
    pub(super) documents: HashMap<String, (Bson, Held)>,
}

impl View {
    /// Records what document `id` holds now (`None`: nothing pending, no
    /// lanes).
    pub(super) fn set(&mut self, id: &Bson, pending: Option<Held>) {
        match pending {
            Some(p) => {
                self.documents.insert(id.to_string(), (id.clone(), p));
            }
            None => {
                self.documents.remove(&id.to_string());
            }
        }
    }
}

/// Judges a document's pending, lanes (and counter) fields: `None` when it
/// holds no pending entry and no lane entry.
pub(super) fn read_document(target: &FoldTarget, document: &Document) -> Option<Held> {
    let spec = &target.spec;
    let pending = document.get(&spec.pending_field);
    let lanes = document.get(&spec.lanes_field);
    if pending.is_none() && lanes.is_none() {
        return None;
    }
    let counter = document.get(&spec.counter_field);
    let settled = document.get(&spec.settled_field);
    // No cutoff: only the shape matters here (overflow is the fold's call).
    let nothing = ObjectId::from_bytes([0; 12]);
    let cutoffs = Cutoffs {
        tokens: nothing,
        lanes: nothing,
    };
    match model::plan_document(counter, pending, settled, lanes, cutoffs) {
        Err(reason) => Some(Held::Malformed(reason.to_string())),
        Ok(plan) => {
            let tokens: Vec<ObjectId> = match pending {
                Some(Bson::Array(entries)) => entries
                    .iter()
                    .filter_map(|e| Entry::parse(e).ok())
                    .map(|e| e.token().object_id())
                    .collect(),
                _ => Vec::new(),
            };
            let lanes = plan.lanes.entries;
            (!tokens.is_empty() || lanes > 0).then_some(Held::Entries { tokens, lanes })
        }
    }
}
