//! What the view says at one instant: the numbers metrics and alerts are
//! made of.

use std::time::SystemTime;

use mongodb::bson::Bson;

use super::{Held, View};
use crate::document::display_id;
use crate::token::Token;

/// How many document ids a snapshot names per condition.
const SAMPLE: usize = 10;

/// Past these sizes a document is reported (`[alerts] max_pending` and
/// `max_lanes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Entries in one pending array.
    pub(crate) max_pending: u64,
    /// Entries in one lane map.
    pub(crate) max_lanes: u64,
}

/// What a collection's pending arrays and lane maps look like at one
/// instant.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Snapshot {
    /// Well-formed documents holding pending tokens.
    pub(crate) pending_documents: u64,
    /// Their pending tokens.
    pub(crate) pending_tokens: u64,
    /// Tokens older than the stuck cutoff.
    pub(crate) stuck_tokens: u64,
    /// A few documents holding stuck tokens, their ids as
    /// [`display_id`] shows them (as are the other samples).
    pub(crate) stuck_sample: Vec<String>,
    /// The `_id`s of all documents holding stuck tokens (for a repair).
    pub(crate) stuck_ids: Vec<Bson>,
    /// The oldest pending token.
    pub(crate) oldest: Option<Token>,
    /// Entries in the longest pending array.
    pub(crate) largest_pending: u64,
    /// Documents whose pending array is longer than the limit.
    pub(crate) too_long: u64,
    /// A few of them.
    pub(crate) too_long_sample: Vec<String>,
    /// Well-formed documents holding lane entries.
    pub(crate) lane_documents: u64,
    /// Their lane entries.
    pub(crate) lane_entries: u64,
    /// Entries in the largest lane map.
    pub(crate) largest_lane_map: u64,
    /// Documents whose lane map is larger than the limit.
    pub(crate) too_many_lanes: u64,
    /// A few of them.
    pub(crate) too_many_lanes_sample: Vec<String>,
    /// Malformed documents.
    pub(crate) malformed: u64,
    /// A few of them.
    pub(crate) malformed_sample: Vec<String>,
}

/// The view's pending arrays and lane maps now: tokens older than
/// `stuck_before` are stuck, arrays and maps past `limits` too large.
pub(super) fn take(view: &View, stuck_before: SystemTime, limits: Limits) -> Snapshot {
    let cutoff = Token::cutoff(stuck_before);
    let mut snapshot = Snapshot::default();
    for (raw_id, pending) in view.documents.values() {
        match pending {
            Held::Malformed(_) => {
                snapshot.malformed += 1;
                if snapshot.malformed_sample.len() < SAMPLE {
                    snapshot.malformed_sample.push(display_id(raw_id));
                }
            }
            Held::Entries { tokens, lanes } => {
                if *lanes > 0 {
                    snapshot.lane_documents += 1;
                    snapshot.lane_entries += lanes;
                    snapshot.largest_lane_map = snapshot.largest_lane_map.max(*lanes);
                    if *lanes > limits.max_lanes {
                        snapshot.too_many_lanes += 1;
                        if snapshot.too_many_lanes_sample.len() < SAMPLE {
                            snapshot.too_many_lanes_sample.push(display_id(raw_id));
                        }
                    }
                }
                if tokens.is_empty() {
                    continue;
                }
                snapshot.pending_documents += 1;
                let size = tokens.len() as u64;
                snapshot.pending_tokens += size;
                snapshot.largest_pending = snapshot.largest_pending.max(size);
                if size > limits.max_pending {
                    snapshot.too_long += 1;
                    if snapshot.too_long_sample.len() < SAMPLE {
                        snapshot.too_long_sample.push(display_id(raw_id));
                    }
                }
                let stuck = tokens.iter().filter(|t| **t < cutoff).count() as u64;
                if stuck > 0 {
                    snapshot.stuck_tokens += stuck;
                    snapshot.stuck_ids.push(raw_id.clone());
                    if snapshot.stuck_sample.len() < SAMPLE {
                        snapshot.stuck_sample.push(display_id(raw_id));
                    }
                }
                if let Some(oldest) = tokens.iter().min() {
                    let oldest = Token::from_object_id(*oldest);
                    snapshot.oldest = Some(snapshot.oldest.map_or(oldest, |o| o.min(oldest)));
                }
            }
        }
    }
    snapshot
}
