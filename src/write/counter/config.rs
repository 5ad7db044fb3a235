//! The settings an increment needs: a counter collection's field names
//! ([`CollectionConfig`], shared with the fold) and the writer's limits —
//! the retry horizon, the lanes' group commit bounds and lifetimes
//! ([`WriterConfig`]).

use std::time::Duration;

use serde::{Serialize, Serializer};

use crate::bucket::Buckets;
use crate::store::{serialize_duration, serialize_optional_duration};

/// Default name of the field holding a counter's value.
pub(crate) const DEFAULT_COUNTER_FIELD: &str = "counter";
/// Default name of the field holding a counter's pending entries.
pub(crate) const DEFAULT_PENDING_FIELD: &str = "pending";
/// Default name of the field holding the markers of settled tokens.
pub(crate) const DEFAULT_SETTLED_FIELD: &str = "settled";
/// Default name of the field holding a counter's lane map.
pub(crate) const DEFAULT_LANES_FIELD: &str = "lanes";

/// Default retry horizon: three attempts of the default attempt bound
/// (60s), room for a step 1, its retry and a `resume`.
pub(crate) const DEFAULT_RETRY_HORIZON: Duration = Duration::from_secs(180);
/// The shortest retry horizon: a token's timestamp has one-second
/// resolution, so a fresh token may already look a second old. The daemon's
/// configuration refuses less; the library raises less to it.
pub(crate) const MIN_RETRY_HORIZON: Duration = Duration::from_secs(2);

/// The shortest retry horizon that works with attempts bounded by
/// `attempt_timeout`: [`MIN_RETRY_HORIZON`], and two attempts. A step 1
/// whose attempt runs out of time is one attempt old when its retry is due;
/// with a shorter horizon the retry would never be sent and `resume` would
/// refuse at once, losing a count the caller did everything to keep.
pub(crate) fn least_retry_horizon(attempt_timeout: Duration) -> Duration {
    MIN_RETRY_HORIZON.max(attempt_timeout.saturating_mul(2))
}

/// A counter collection and its field names (in the daemon's configuration,
/// one `[[collections]]` entry).
///
/// ```
/// use tally::CollectionConfig;
///
/// // Counters in `page_views`, their values in `views` instead of `counter`.
/// let spec = CollectionConfig::new("page_views").with_fields("views", "pending");
/// assert_eq!(spec.counter_field, "views");
/// assert_eq!(spec.lanes_field, "lanes");
/// assert_eq!(spec.events_collection_name(), "page_views_events");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CollectionConfig {
    /// The collection's name.
    pub name: String,
    /// The field holding the counter's value. Default: `counter`.
    pub counter_field: String,
    /// The field holding the pending entries. Default: `pending`.
    pub pending_field: String,
    /// The field holding a marker `{t: token, n: amount}` for every token a
    /// settle (`complete`, `resume`) counted, so that settling it again
    /// counts nothing; the fold removes markers older than the grace.
    /// Default: `settled`.
    pub settled_field: String,
    /// The field holding the lane map `{<lane>: <highest applied s>}` of the
    /// lanes protocol ([`Counters::add`]): what each lane that wrote the
    /// counter applied last, so that a repeat is recognised. Default:
    /// `lanes`.
    ///
    /// [`Counters::add`]: super::Counters::add
    pub lanes_field: String,
    /// The events collection of this collection's ledger
    /// ([`Ledger`](crate::Ledger)): where recorded events wait to be folded
    /// into the counters. `None` means the default, `<name>_events`; the
    /// daemon folds a ledger only when its collection enables one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events_collection: Option<String>,
    /// This collection's fold grace, overriding `[reconcile] grace`.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_optional_duration"
    )]
    pub grace: Option<Duration>,
    /// This collection's fold batch size, overriding `[reconcile]
    /// batch_size`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u32>,
    /// This collection's time buckets: a counter per key and per minute,
    /// hour, day or month of a time zone, closed a while after it ends.
    /// `None` (the default): a counter per key, for all time. Shown as the
    /// `bucket`, `timezone` and `close_after` keys of its `[[collections]]`
    /// entry.
    #[serde(flatten, serialize_with = "serialize_buckets")]
    pub buckets: Option<Buckets>,
}

/// A collection's buckets as its `[[collections]]` entry writes them
/// (nothing without).
fn serialize_buckets<S: Serializer>(buckets: &Option<Buckets>, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Shown<'b> {
        bucket: &'static str,
        timezone: &'b str,
        #[serde(serialize_with = "serialize_duration")]
        close_after: Duration,
    }
    buckets
        .as_ref()
        .map(|buckets| Shown {
            bucket: buckets.width().as_str(),
            timezone: buckets.zone(),
            close_after: buckets.close_after(),
        })
        .serialize(s)
}

impl CollectionConfig {
    /// A collection with the default field names.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// let spec = CollectionConfig::new("page_views");
    /// assert_eq!(
    ///     (spec.counter_field.as_str(), spec.pending_field.as_str(), spec.settled_field.as_str()),
    ///     ("counter", "pending", "settled")
    /// );
    /// ```
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            counter_field: DEFAULT_COUNTER_FIELD.into(),
            pending_field: DEFAULT_PENDING_FIELD.into(),
            settled_field: DEFAULT_SETTLED_FIELD.into(),
            lanes_field: DEFAULT_LANES_FIELD.into(),
            events_collection: None,
            grace: None,
            batch_size: None,
            buckets: None,
        }
    }

    /// The same collection with other names for the counter and pending
    /// fields.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// // Documents shaped `{_id, views, views_pending}`.
    /// let spec = CollectionConfig::new("pages").with_fields("views", "views_pending");
    /// assert_eq!(spec.counter_field, "views");
    /// assert_eq!(spec.pending_field, "views_pending");
    /// ```
    pub fn with_fields(mut self, counter: impl Into<String>, pending: impl Into<String>) -> Self {
        self.counter_field = counter.into();
        self.pending_field = pending.into();
        self
    }

    /// The same collection with another name for the settled field.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// let spec = CollectionConfig::new("pages")
    ///     .with_fields("views", "views_pending")
    ///     .with_settled_field("views_settled");
    /// assert_eq!(spec.settled_field, "views_settled");
    /// ```
    pub fn with_settled_field(mut self, settled: impl Into<String>) -> Self {
        self.settled_field = settled.into();
        self
    }

    /// The same collection with its ledger's events in `events` instead of
    /// `<name>_events`.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// let spec = CollectionConfig::new("page_views").with_events_collection("view_events");
    /// assert_eq!(spec.events_collection_name(), "view_events");
    /// ```
    pub fn with_events_collection(mut self, events: impl Into<String>) -> Self {
        self.events_collection = Some(events.into());
        self
    }

    /// The name of this collection's events collection: the configured one,
    /// or `<name>_events`.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// let spec = CollectionConfig::new("page_views");
    /// assert_eq!(spec.events_collection_name(), "page_views_events");
    /// ```
    pub fn events_collection_name(&self) -> String {
        self.events_collection
            .clone()
            .unwrap_or_else(|| format!("{}_events", self.name))
    }

    /// The same collection, its counters kept per time bucket.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tally::{BucketWidth, Buckets, CollectionConfig};
    ///
    /// let days = Buckets::new(BucketWidth::Day, "Europe/Berlin")?
    ///     .with_close_after(Duration::from_secs(2 * 24 * 3600));
    /// let spec = CollectionConfig::new("page_views").with_buckets(days.clone());
    /// assert_eq!(spec.buckets, Some(days));
    /// # Ok::<(), tally::BucketError>(())
    /// ```
    pub fn with_buckets(mut self, buckets: Buckets) -> Self {
        self.buckets = Some(buckets);
        self
    }

    /// The same collection with another name for the lanes field.
    ///
    /// ```
    /// use tally::CollectionConfig;
    ///
    /// let spec = CollectionConfig::new("pages").with_lanes_field("views_lanes");
    /// assert_eq!(spec.lanes_field, "views_lanes");
    /// ```
    pub fn with_lanes_field(mut self, lanes: impl Into<String>) -> Self {
        self.lanes_field = lanes.into();
        self
    }
}

/// Default `group_max`: the most increments one lane update carries.
pub(crate) const DEFAULT_GROUP_MAX: usize = 256;
/// The largest `group_max`.
pub(crate) const MAX_GROUP_MAX: usize = 100_000;
/// Default `queue_limit`: the most increments waiting across a handle.
pub(crate) const DEFAULT_QUEUE_LIMIT: usize = 10_000;
/// The largest `queue_limit`.
pub(crate) const MAX_QUEUE_LIMIT: usize = 10_000_000;
/// Default `group_wait`: a counter's increments leave as soon as its
/// previous update is over.
pub(crate) const DEFAULT_GROUP_WAIT: Duration = Duration::ZERO;
/// The longest `group_wait`: a caller never waits longer than this for
/// company.
pub(crate) const MAX_GROUP_WAIT: Duration = Duration::from_secs(1);
/// Default age up to which a minted lane's ticket may be resumed.
pub(crate) const DEFAULT_LANE_RESUME_HORIZON: Duration = Duration::from_secs(23 * 3600);
/// Default age at which the daemon prunes a minted lane's entries.
pub(crate) const DEFAULT_LANE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Which increment protocol a caller that does not choose one gets: the
/// `tallyd incr` command (the daemon's `[writer] protocol`; `tallyd resume`
/// goes by its ticket's shape). The library's own calls name theirs:
/// [`Counters::increment`](super::Counters::increment) is the two-step
/// increment, [`Counters::add`](super::Counters::add) the lanes protocol.
///
/// ```
/// use tally::{Protocol, WriterConfig};
///
/// // What `tallyd incr` uses when a command names no protocol.
/// let writer = WriterConfig { protocol: Protocol::Lanes, ..WriterConfig::default() };
/// assert_eq!(writer.protocol.as_str(), "lanes");
/// assert_eq!(Protocol::default(), Protocol::TwoStep);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum Protocol {
    /// Two idempotent steps joined by a pending token (the book: design/two-step.md): two
    /// round trips; its data is what other clients of the technique write.
    #[default]
    #[serde(rename = "two-step")]
    TwoStep,
    /// One conditioned update through a writer lane (the book: design/lanes.md): one round
    /// trip, safe to resume any number of times.
    #[serde(rename = "lanes")]
    Lanes,
}

impl Protocol {
    /// The name as configured and printed: `two-step` or `lanes`.
    ///
    /// ```
    /// use tally::Protocol;
    ///
    /// assert_eq!(Protocol::TwoStep.as_str(), "two-step");
    /// assert_eq!(Protocol::Lanes.as_str(), "lanes");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TwoStep => "two-step",
            Self::Lanes => "lanes",
        }
    }
}

/// How the library's increments behave (the daemon's `[writer]` section).
///
/// ```
/// use std::time::Duration;
/// use tally::WriterConfig;
///
/// // Larger groups for a hot counter, waiting up to 5 ms for company.
/// let writer = WriterConfig {
///     group_max: 1024,
///     group_wait: Duration::from_millis(5),
///     ..WriterConfig::default()
/// };
/// assert_eq!(writer.retry_horizon, Duration::from_secs(180));
/// assert_eq!(writer.lane_ttl, Duration::from_secs(24 * 3600));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WriterConfig {
    /// Step 1 of an increment is never (re)sent for a token older than this,
    /// so a token can never be re-added after the daemon may have folded it.
    /// Must stay below the daemon's `grace` by one attempt. At least two
    /// attempts (the store's attempt timeout) and 2s: [`Counters::new`]
    /// raises a shorter one (with less, a step 1 whose attempt timed out
    /// could be neither retried nor resumed; and a token's time has
    /// one-second resolution). Default: 3m.
    ///
    /// [`Counters::new`]: super::Counters::new
    #[serde(serialize_with = "serialize_duration")]
    pub retry_horizon: Duration,
    /// The most increments of one counter a lane update carries (group
    /// commit: while a counter's update is in flight, the handle's further
    /// increments of it wait and leave together as the next update, their
    /// sum under one lane number). 1 sends every increment alone. 1 to
    /// 100000. Default: 256.
    pub group_max: usize,
    /// The most increments waiting for their update across a handle: an
    /// [`add`](super::Counters::add) beyond it waits for room
    /// (backpressure), so a server slower than the callers costs no
    /// unbounded memory. 1 to 10000000. Default: 10000.
    pub queue_limit: usize,
    /// How long a counter's next update waits for more increments when it
    /// holds fewer than `group_max`, from its oldest increment's arrival.
    /// 0 (the default) sends it as soon as the counter's previous update is
    /// over: groups form from the increments that arrive meanwhile. At most
    /// 1s.
    #[serde(serialize_with = "serialize_duration")]
    pub group_wait: Duration,
    /// A minted lane's update is (re)sent only while the time it carries
    /// (its number, the lane's time of writing; for a lane of tally 0.1,
    /// the lane's creation) is younger than this: past it
    /// [`Counters::resume_lane`] refuses without writing, as the daemon may
    /// prune the lane's entry. Must be shorter than
    /// `lane_ttl` by more than one attempt (`attempt_timeout`) plus the
    /// clock skew between writers and the server. Default: 23h.
    ///
    /// [`Counters::resume_lane`]: super::Counters::resume_lane
    #[serde(serialize_with = "serialize_duration")]
    pub lane_resume_horizon: Duration,
    /// The daemon prunes a minted lane's entry in a counter once the lane
    /// has not written that counter for this long (by the time its entry
    /// holds, against the server's clock). Named lanes are never pruned.
    /// Default: 24h.
    #[serde(serialize_with = "serialize_duration")]
    pub lane_ttl: Duration,
    /// The protocol a caller that does not choose one uses: `tallyd incr`
    /// without `--lane` or `--two-step` (`tallyd resume` goes by its
    /// ticket's shape). Default: two-step.
    pub protocol: Protocol,
}

impl WriterConfig {
    /// Why the group commit bounds are refused: each as the key to change
    /// and why.
    pub(crate) fn group_problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        if !(1..=MAX_GROUP_MAX).contains(&self.group_max) {
            problems.push((
                "group_max",
                format!("must be 1 to {MAX_GROUP_MAX}, not {}", self.group_max),
            ));
        }
        if !(1..=MAX_QUEUE_LIMIT).contains(&self.queue_limit) {
            problems.push((
                "queue_limit",
                format!("must be 1 to {MAX_QUEUE_LIMIT}, not {}", self.queue_limit),
            ));
        }
        if self.group_wait > MAX_GROUP_WAIT {
            problems.push((
                "group_wait",
                format!(
                    "must be at most {}, not {}",
                    humantime::format_duration(MAX_GROUP_WAIT),
                    humantime::format_duration(self.group_wait)
                ),
            ));
        }
        problems
    }

    /// Checks the lane settings against each other and against the bound on
    /// one attempt (`attempt_timeout`, the store's): every problem, each as
    /// the key to change and why.
    pub(crate) fn lane_margin_problems(
        &self,
        attempt_timeout: Duration,
    ) -> Vec<(&'static str, String)> {
        let show = |d: Duration| humantime::format_duration(d).to_string();
        let mut problems = Vec::new();
        let least = self.lane_resume_horizon + attempt_timeout;
        if self.lane_ttl <= least {
            problems.push((
                "lane_ttl",
                format!(
                    "must be longer than lane_resume_horizon + attempt_timeout ({} + {} = {}): an \
                     update re-sent just inside the horizon may still execute for one more \
                     attempt, and a lane entry pruned before it lands would let it count twice",
                    show(self.lane_resume_horizon),
                    show(attempt_timeout),
                    show(least)
                ),
            ));
        }
        problems
    }
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self {
            retry_horizon: DEFAULT_RETRY_HORIZON,
            group_max: DEFAULT_GROUP_MAX,
            queue_limit: DEFAULT_QUEUE_LIMIT,
            group_wait: DEFAULT_GROUP_WAIT,
            lane_resume_horizon: DEFAULT_LANE_RESUME_HORIZON,
            lane_ttl: DEFAULT_LANE_TTL,
            protocol: Protocol::TwoStep,
        }
    }
}
