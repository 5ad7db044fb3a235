//! The protocols a writer calls: each turns one write an application wants
//! into operations that stay exact when replies are lost, primaries step
//! down and writers crash.
//!
//! - [`at`]: writes that carry a time — the `{k, t}` document of a
//!   bucketed collection a write goes to, and the times refused;
//! - [`counter`]: the two-step increment (the book: design/two-step.md) with `complete` and
//!   `resume`, the [`Counters`](counter::Counters) handle both increment
//!   protocols share, and the settings it shares with the fold (the
//!   collection's field names, the retry horizon, the lanes' lifetimes);
//! - [`lane`]: writer lanes (the book: design/lanes.md), an exact increment in one round
//!   trip, safe to resume any number of times, a counter's concurrent
//!   increments sent together;
//! - [`group`]: group commit's queue, per key one batch in flight;
//! - [`sequence`]: numbers from a counters collection, never handed out
//!   twice (the book: design/sequences.md);
//! - [`insert_loop`]: the optimistic insert loop, dense numeric `_id`s;
//! - [`bounded`]: bounded counters, a unit taken only while some are left;
//! - [`ticket`]: the tickets an operator pastes into `tallyd resume` and
//!   `tallyd complete`, with a check over the collection, key and amount
//!   they settle.

pub(crate) mod at;
pub(crate) mod bounded;
pub(crate) mod counter;
pub(crate) mod group;
pub(crate) mod insert_loop;
pub(crate) mod lane;
pub(crate) mod sequence;
pub(crate) mod ticket;
