//! The events ledger: idempotency keys, so that the same event delivered
//! twice — a queue's redelivery, a webhook's retry, a second press of the
//! button — is counted once (`docs/src/design/ledger.md`).
//!
//! A token or a lane identifies one *attempt* to count; an event key
//! identifies the *event*. Recording an event inserts one document into the
//! counter collection's events collection
//! ([`CollectionConfig::events_collection_name`], default `<name>_events`):
//!
//! ```text
//! { _id: <event key>, k: <counter key>, n: <amount, int64>, at: <date>, L: <lane>, s: <number> }
//! ```
//!
//! The `_id` is the event key, so the server's unique index on `_id` is the
//! memory of what was seen. A duplicate key means the key is there: with
//! the same counter and amount it is a duplicate (counted once), with
//! another one a [`Conflict`] (nothing written). `L` and `s` are the
//! recorder's lane and the event's number on it ([`recorder`]): finding the
//! key with a lane and number *this* recording sent it with means an
//! attempt of ours whose reply was lost landed — recorded, not duplicate —
//! which equal content alone could not tell.
//!
//! **The events collection is an append-only log**: after its insert an
//! event is never updated. The fold follows the collection's own log — its
//! change stream ([`log`]), which MongoDB documents to return every
//! majority-committed insert once, in commit order — from one position, a
//! resume token ([`state`]): every insert at or before it is folded, every
//! insert after it is not, and nothing can land behind it. It writes each
//! counter once per pass through its fold lane ([`fold_lane`]). Events are
//! deleted once the fold is past them and they are older than
//! `event_retention`: the dedupe window. A repeat inside the window is a
//! duplicate, always; after it, the key is new again and the repeat is
//! recorded and counted again.
//!
//! [`Ledger::value`] reads a counter exactly: the counter plus its events
//! not folded yet, consistent at any moment of a fold ([`read`]).
//!
//! The module, by concept:
//!
//! - here: the [`Ledger`] handle, the event document's fields ([`field`])
//!   and the fold lane's name ([`fold_lane`]);
//! - [`record`]: the handle's methods and recording events — `recorder` (the lane, its numbers and
//!   the one insert in flight), `insert` (what became of each event of an
//!   insert), `outcome` (what the caller learns: [`Recording`]);
//! - [`log`]: the events collection's change stream — positions in it
//!   (resume tokens and their cluster times), the inserts it shows;
//! - [`state`]: the fold's state document (`<events>_fold`: the position,
//!   the pass in progress, a catch-up, the held sums) and the one type that
//!   writes it;
//! - [`index`]: the index the events collection needs, and what earlier
//!   versions left on it;
//! - [`read`]: exact reads ([`ExactValue`]);
//! - [`range`]: a bucketed key's buckets in a range, read exactly
//!   ([`RangeValue`]);
//! - [`fold`]: the fold of recorded events into their counters
//!   ([`EventFold`]) — `pass` (one pass: read, intent, sums, apply,
//!   commit), `tail` (the log kept open between passes), `sums`, `apply`
//!   (through the fold lane), `held` (sums a counter refused), `catch_up`
//!   (the collection itself folded up to a boundary: a first fold, an
//!   upgrade, `tallyd fold-from`), `sweep` (deleting events past the
//!   dedupe window). A [`Reconciler`] runs it beside the token fold
//!   (`reconcile::ledgers`).
//!
//! [`Reconciler`]: crate::Reconciler

mod fold;
pub(crate) mod index;
pub(crate) mod log;
mod range;
mod read;
mod record;
mod scan;
pub(crate) mod state;

use std::sync::Arc;
use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::Document;

pub use fold::{
    Backlog, EventFold, EventFoldSettings, EventsRun, FoldFrom, HeldSum, RETENTION_MARGIN,
    UncertainEvent, retention_floor,
};
pub use range::{BucketValue, MAX_RANGE_BUCKETS, RangeValue};
pub use read::ExactValue;
pub use record::{Conflict, Event, EventTicket, NotRecorded, Recording};
pub(crate) use record::{time_of, unix_micros};

use crate::error::Error;
use crate::store::Store;
use crate::write::counter::CollectionConfig;
use crate::write::lane::LaneName;
use record::Recorder;

/// Default dedupe window: how long a folded event's key is remembered.
pub const DEFAULT_EVENT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The event document's fields, shared with the fold.
pub(crate) mod field {
    /// The counter key.
    pub(crate) const COUNTER: &str = "k";
    /// The amount.
    pub(crate) const AMOUNT: &str = "n";
    /// When the event was recorded (the recorder's clock).
    pub(crate) const AT: &str = "at";
    /// The recorder's lane.
    pub(crate) const LANE: &str = "L";
    /// The event's number on its lane (microseconds since the epoch by the
    /// server's clock, as the recorder reckons it; unique and growing on
    /// the lane).
    pub(crate) const NUMBER: &str = "s";
}

/// The longest event key, in bytes: keys are `_id`s, and index keys must
/// stay well inside the server's limits.
pub const MAX_EVENT_KEY_BYTES: usize = 512;

/// Records events of one counter collection, each once, and reads its
/// counters exactly. Cheap to clone; clones share one lane, and the events
/// their callers record while an insert is in flight go out together as
/// the next insert. One per process, cloned, shares its inserts best; a
/// handle per request costs the fold nothing more (it keeps no memory of
/// recorders).
///
/// ```no_run
/// # async fn demo(store: tally::Store) -> Result<(), tally::Error> {
/// use tally::{CollectionConfig, Ledger, Recording};
///
/// let orders = Ledger::new(&store, CollectionConfig::new("order_totals"));
/// // The order's id is the event's key: recording it again counts nothing.
/// let mut recording = orders.record("order-1042", "2026-05", 3).await;
/// if let Recording::Unknown(ticket) = recording {
///     // The insert may have landed: sending the same event again is safe.
///     recording = orders.record_again(ticket).await?;
/// }
/// match recording {
///     Recording::Recorded(_) | Recording::Duplicate(_) => {}
///     Recording::Unknown(ticket) => eprintln!("{}: send it again later", ticket.event().key()),
///     Recording::Conflict(conflict) => eprintln!("a reused key: {conflict}"),
///     Recording::NotRecorded(not) => return Err(not.cause().clone()),
/// }
/// println!("May so far: {}", orders.value("2026-05").await?.value);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Ledger {
    store: Store,
    spec: Arc<CollectionConfig>,
    events: Collection<Document>,
    counters: Collection<Document>,
    recorder: Arc<Recorder>,
    retry_horizon: Duration,
}

/// The daemon's fold lane of the events collection `events`: a named lane
/// of the lanes protocol (`fold:<events>`, `.` written as `%2E` and `%` as
/// `%25`, as lane names are field names), whose position on each counter is
/// the last fold pass applied to it.
pub(crate) fn fold_lane(events: &str) -> Result<LaneName, Error> {
    let escaped = events.replace('%', "%25").replace('.', "%2E");
    LaneName::new(format!("{FOLD_LANE}{escaped}")).map_err(|bad| {
        Error::InvalidArgument(format!(
            "events collection {events:?} cannot name its fold lane: {bad}; choose a shorter name"
        ))
    })
}

/// How a fold lane's name begins.
const FOLD_LANE: &str = "fold:";

/// The events collection whose fold lane is named `lane` ([`fold_lane`]
/// read back), `None` for any other lane.
#[cfg(feature = "daemon")]
pub(crate) fn folded_by(lane: &str) -> Option<String> {
    lane.strip_prefix(FOLD_LANE)
        .map(|escaped| escaped.replace("%2E", ".").replace("%25", "%"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fold_lane_names_its_events_collection_as_a_field_name_can() {
        assert_eq!(
            fold_lane("views_events").unwrap().as_str(),
            "fold:views_events"
        );
        assert_eq!(fold_lane("a.b%c").unwrap().as_str(), "fold:a%2Eb%25c");
        assert_ne!(fold_lane("a.b").unwrap(), fold_lane("a%2Eb").unwrap());
        assert!(fold_lane(&"x".repeat(200)).is_err());
    }
}
