//! tally keeps counters in MongoDB that count every event exactly once, even
//! when the network drops replies, primaries step down and writers crash.
//!
//! An increment is split into two idempotent steps joined by a pending token
//! ([`Counters`]); the caller always learns which of four outcomes happened
//! ([`Increment`]), and a token left behind by a crashed writer is folded
//! into its counter later by the [`Reconciler`] — which the `tallyd` daemon
//! runs on a schedule, and a service can embed. A second protocol needs one
//! round trip: a writer lane ([`Counters::add`]) numbers its increments and
//! the counter document remembers the highest number each lane applied, so
//! a repeat — a retry, a resume run again, a request delayed in the network
//! — is recognised ([`LaneIncrement`]). Every failed attempt is classified
//! by [`ErrorClass`], and only transient failures of idempotent operations
//! are retried — once.
//!
//! Beside counters: [`Sequences`] hand out numbers that are never handed out
//! twice (a counters collection, as in MongoDB's tutorial, made safe on
//! first use), [`InsertLoop`] gives documents dense numeric ids, and
//! [`BoundedCounters`] hand out limited units only while some are left.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use tally::{CollectionConfig, Counters, Increment, Store, StoreConfig, WriterConfig};
//!
//! let store = Store::connect(&StoreConfig::new("mongodb://localhost:27017", "app")).await?;
//! let views = Counters::new(&store, CollectionConfig::new("page_views"), WriterConfig::default());
//! match views.increment("home", 1).await {
//!     Increment::Counted(_) => {}
//!     Increment::Pending(token) => { let _ = views.complete(token).await; }
//!     Increment::Unknown(token) => { let _ = views.resume(token).await?; }
//!     Increment::NotCounted(not) => return Err(not.cause().clone().into()),
//! }
//! # Ok(()) }
//! ```
//!
//! # Features
//!
//! - `daemon` (default): the `tallyd` daemon and its command line, with
//!   their dependencies (HTTP, metrics, the webhook, the schedule, the
//!   config file). An application that only writes counters depends on
//!   tally with `default-features = false` (see `examples/counter-app`).
//! - `srv`: `mongodb+srv://` URIs (DNS SRV and TXT lookups).
//!
//! # Layout
//!
//! Every module is private: what an application uses is re-exported here,
//! at the crate root, one path per item (the `pub use` list below; the
//! listings in `api/` show it whole). Everything else — the fold's model
//! and statements, the daemon, the command line, logging — is the crate's
//! own and may change in any release.
//!
//! The library, always built:
//!
//! - `error`: error classes, the retry-once rule, the library's [`Error`],
//!   and what a failure says to people (`message`).
//! - `redact`: keeping passwords and tokens out of logs, errors and output.
//! - `bucket`: time buckets ([`Buckets`], [`BucketWidth`]) — where the
//!   minute, hour, day or month of a time zone that holds an instant
//!   starts and ends, and `written` (the times people write: RFC 3339, or
//!   a date).
//! - `store`: the connected [`Store`] — `config` (how to reach the server:
//!   [`StoreConfig`]), `reach` (where it connects, for its failures'
//!   messages).
//! - `document`: reading values out of documents tally does not own.
//! - `token`: pending [`Token`]s and the two entry forms of a `pending`
//!   array.
//! - `write`: the protocols a writer calls — `at` (writes that carry a
//!   time: a bucketed collection's `{k, t}` document), `counter` (the two-step
//!   increment, with [`CollectionConfig`] and [`WriterConfig`]), `lane`
//!   (writer lanes: one round trip, [`Counters::add`], group commit),
//!   `group` (group commit's keyed queue), `sequence`, `insert_loop`,
//!   `bounded`.
//! - `quirks`: what the test server does differently from MongoDB, and
//!   what tally does about it — the one place that knows.
//! - `ledger`: the events ledger, all of it — idempotency keys, the
//!   [`Ledger`] handle, the event document's fields; `record` (recording:
//!   its `recorder`, `insert` and `outcome`), `log` (the events
//!   collection's change stream: positions, inserts), `state` (the fold's
//!   state document — its position in the log, the pass in progress, a
//!   catch-up, the held sums — and the one type that writes it), `index`,
//!   `read` (exact reads: [`ExactValue`]), `fold` (the fold of recorded
//!   events: [`EventFold`] — its `pass`, `tail`, `sums`, `apply`, `held`
//!   sums, `catch_up` and `sweep`).
//! - `reconcile`: the fold of leftover pending tokens as an embeddable
//!   [`Reconciler`] — `model` (its specification), `statement` (a
//!   document's fold as conditioned update statements), `fold` (a run's
//!   passes: rows planned into batches, documents that changed read
//!   again), `batch` (sending them, reading what the server did), `report`
//!   (what a run found and did: [`CollectionRun`]), `ledgers` (each
//!   collection's ledger folded beside its tokens).
//!
//! With the `daemon` feature:
//!
//! - `config`: the TOML file and its environment overrides, read into the
//!   library's settings (`library`) and the daemon's own (`daemon`,
//!   `alerts`), every bad key reported at once (`raw`, `field`).
//! - `daemon`: `tallyd run` and everything it wires together — `supervisor`
//!   (stop and reload), `runner`, `evaluator`, `monitor` (and its
//!   `snapshot`), `alert` (and its `lanes` and `webhook`), `lease`,
//!   `readiness`, `clock` (this host's clock against the server's, and the
//!   margin for it), `schedule`, `state`, `http`, `metrics`; and `api`
//!   (the events ledger over HTTP, `[api]`: its routes, access, problem
//!   documents, connections, and the outcome JSON the command line prints
//!   too).
//! - `cli`: the `tallyd` commands, thin layers over the modules above —
//!   `doctor` (is the deployment safe?) among them, and `generate` (the
//!   man pages and completions of the package); `exit` (exit codes by
//!   class), `envfile` (`--env-file`), `database` (which server and
//!   database a command reads). Its one public item, `tallyd_main`, is
//!   the whole of the binary's `main`.
//! - `logging`: tracing to standard error, as text or JSON.
//!
//! Imports go one way, down this list: a module names (as `crate::…`) only
//! the modules after its arrow. The library never names a module of the
//! `daemon` feature, and the dependency goes config → library, never back.
//! `tests/integration/layout.rs` checks every file of `src/` against these
//! lines, and that none has more than 600 lines before its tests.
//!
//! ```text
//! error     → (nothing)
//! redact    → (nothing)
//! bucket    → (nothing)
//! quirks    → (nothing)
//! store     → error redact
//! document  → error store
//! token     → document
//! write     → error store document token redact bucket
//! ledger    → error store document write bucket quirks
//! reconcile → error store document token write ledger bucket
//! config    → error redact store write ledger reconcile bucket
//! daemon    → config reconcile ledger write store token document error redact bucket
//! cli       → (anything)
//! logging   → (anything)
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod bucket;
mod document;
mod error;
mod ledger;
mod quirks;
mod reconcile;
mod redact;
mod store;
mod token;
mod write;

#[cfg(feature = "daemon")]
mod cli;
#[cfg(feature = "daemon")]
mod config;
#[cfg(feature = "daemon")]
mod daemon;
#[cfg(feature = "daemon")]
mod logging;

#[cfg(feature = "daemon")]
pub use cli::tallyd_main;

pub use bucket::{BucketError, BucketStarts, BucketWidth, Buckets, CLOSED_FIELD};
pub use error::{Effect, Error, ErrorClass, Failure};
pub use ledger::{
    Backlog, BucketValue, Conflict, DEFAULT_EVENT_RETENTION, Event, EventFold, EventFoldSettings,
    EventTicket, EventsRun, ExactValue, FoldFrom, HeldSum, Ledger, MAX_EVENT_KEY_BYTES,
    MAX_RANGE_BUCKETS, NotRecorded, RETENTION_MARGIN, RangeValue, Recording, UncertainEvent,
    retention_floor,
};
pub use reconcile::{
    BucketClosing, CollectionRun, FoldTarget, MALFORMED_SAMPLE, MalformedDocument, Mode,
    NAMED_LANES_LISTED, OpenBuckets, Progress, Reconciler, RefusedDocument, Survey,
    UNCLOSED_SAMPLE, UnclosedBucket,
};
pub use store::{ConnectError, Store, StoreConfig};
pub use token::{BadToken, Token};
pub use write::at::MAX_TIME_AHEAD;
pub use write::bounded::{BoundedConfig, BoundedCounters, GiveBack, Take};
pub use write::counter::{
    CollectionConfig, Completion, Counted, Counters, Increment, NotCounted, PendingToken, Protocol,
    UnknownToken, WriterConfig,
};
pub use write::insert_loop::InsertLoop;
pub use write::lane::{
    BadLaneName, LaneCounted, LaneId, LaneIncrement, LaneName, LaneOutOfOrder, LaneStats,
    LaneTicket,
};
pub use write::sequence::{Block, SequenceConfig, Sequences};
