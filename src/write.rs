//! The protocols a writer calls: each turns one write an application wants
//! into operations that stay exact when replies are lost, primaries step
//! down and writers crash.
//!
//! - [`counter`]: the two-step increment (DESIGN §3) with `complete` and
//!   `resume`, and the settings it shares with the fold (the collection's
//!   field names, the retry horizon);
//! - [`sequence`]: numbers from a counters collection, never handed out
//!   twice (DESIGN §5);
//! - [`insert_loop`]: the optimistic insert loop, dense numeric `_id`s;
//! - [`bounded`]: bounded counters, a unit taken only while some are left.

pub(crate) mod bounded;
pub(crate) mod counter;
pub(crate) mod insert_loop;
pub(crate) mod sequence;
