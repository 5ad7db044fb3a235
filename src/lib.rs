//! tally keeps counters in MongoDB that count every event exactly once, even
//! when the network drops replies, primaries step down and writers crash.
//!
//! An increment is split into two idempotent steps joined by a pending token
//! (see [`write::counter`]); the caller always learns which of four outcomes
//! happened, and a token left behind by a crashed writer is folded into its
//! counter later by the `tallyd` daemon. Every failed attempt is classified
//! by [`error::ErrorClass`], and only transient failures of idempotent
//! operations are retried — once.
//!
//! Beside counters: [`Sequences`] hand out numbers that are never handed out
//! twice (a counters collection, as in MongoDB's tutorial, made safe on
//! first use), [`InsertLoop`] gives documents dense numeric ids, and
//! [`BoundedCounters`] hand out limited units only while some are left.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tally::{CollectionConfig, Counters, Increment, Store, WriterConfig};
//!
//! let client = mongodb::Client::with_uri_str("mongodb://localhost:27017").await?;
//! let options = mongodb::options::ClientOptions::parse("mongodb://localhost:27017").await?;
//! let store = Store::from_parts(client, &options, "app");
//! let views = Counters::new(&store, CollectionConfig::new("page_views"), WriterConfig::default());
//! match views.increment("home", 1).await {
//!     Increment::Counted(_) => {}
//!     Increment::Pending(token) => { let _ = views.complete(&token).await; }
//!     Increment::Unknown(token) => { let _ = views.resume(&token).await?; }
//!     Increment::NotCounted(not) => return Err(not.cause().clone().into()),
//! }
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`error`]: error classes, the retry-once rule, the library's error type.
//! - [`token`]: pending tokens and the two entry forms of a `pending` array.
//! - [`store`]: the connected handle (client, database, retry facts).
//! - [`write`]: the protocols a writer calls.
//! - [`write::counter`]: the two-step increment, `complete` and `resume`.
//! - [`document`]: reading values out of documents tally does not own.
//! - [`write::sequence`]: sequences on a counters collection (`next`, blocks, seeding).
//! - [`write::insert_loop`]: the optimistic insert loop (highest `_id` + 1, bounded retries).
//! - [`write::bounded`]: bounded counters: take a unit only while some are left.
//! - [`reconcile`]: the fold of leftover pending tokens, safe on live documents, and its report.
//! - [`config`]: the TOML file and environment overrides, validated as a whole.
//! - [`redact`]: keeping passwords and tokens out of logs, errors and output.
//! - [`logging`]: tracing to standard error, as text or JSON.
//! - [`metrics`]: the daemon's Prometheus metrics, one registry handle.
//! - [`alert`]: alerts (firing once, resolved once) to the log and a webhook.
//! - [`state`]: the daemon's state in MongoDB: last runs, resume tokens.
//! - [`lease`]: one active daemon among several.
//! - [`schedule`]: when the daemon folds (cron, time zone, catch-up).
//! - [`monitor`]: change streams keeping a live view of pending tokens.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`daemon`]: `tallyd run`, wiring all of the above until shutdown.
//! - [`cli`]: the `tallyd` commands, thin layers over the modules above.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod document;
mod error;
pub mod reconcile;
mod redact;
mod store;
mod token;
mod write;

#[cfg(feature = "daemon")]
pub mod cli;
#[cfg(feature = "daemon")]
pub mod config;
#[cfg(feature = "daemon")]
mod daemon;
#[cfg(feature = "daemon")]
pub mod logging;

pub use error::{Effect, Error, ErrorClass, Failure};
pub use reconcile::{
    CollectionRun, FoldTarget, MALFORMED_SAMPLE, MalformedDocument, Mode, Progress, Reconciler,
    Survey,
};
pub use store::{ConnectError, Store, StoreConfig};
pub use token::{BadToken, Entry, Token};
pub use write::bounded::{BoundedConfig, BoundedCounters, GiveBack, Take};
pub use write::counter::{
    CollectionConfig, Completion, Counted, Counters, Increment, NotCounted, PendingToken,
    UnknownToken, WriterConfig,
};
pub use write::insert_loop::InsertLoop;
pub use write::sequence::{Block, SequenceConfig, Sequences};
