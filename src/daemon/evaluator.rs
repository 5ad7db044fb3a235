//! The evaluator: every second, the monitor's view turned into metrics
//! and alerts (stuck tokens, long pending arrays, large lane maps,
//! malformed documents), and stuck tokens handed to the runner for repair; and the
//! latest clock skew judged against each collection's margin (the
//! `clock_skew` alert, past half of it: the rule of `daemon::clock`).

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::runner::Request;
use crate::config::Config;
use crate::daemon::alert::{AlertKind, Alerts, Observation};
use crate::daemon::clock::{LastSkew, Margin, SkewLevel, judge};
use crate::daemon::lease::Role;
use crate::daemon::metrics::Metrics;
use crate::daemon::monitor::{Limits, Monitor};

/// How often metrics and alerts are evaluated from the view.
const EVALUATE_EVERY: Duration = Duration::from_secs(1);
/// The shortest time between two repairs of one collection.
const REPAIR_EVERY: Duration = Duration::from_secs(5);

/// Turns the view into metrics and alerts, every second.
pub(super) struct Evaluator {
    pub(super) config: Config,
    pub(super) monitor: Monitor,
    pub(super) alerts: Alerts,
    pub(super) metrics: Metrics,
    pub(super) role: watch::Receiver<Role>,
    pub(super) requests: mpsc::Sender<Request>,
    pub(super) last_repair: HashMap<String, Instant>,
    /// The latest clock skew the readiness probe measured.
    pub(super) skew: LastSkew,
    /// Each collection's margin for clock skew.
    pub(super) margins: Vec<Margin>,
}

impl Evaluator {
    pub(super) async fn run(mut self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(EVALUATE_EVERY);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => self.evaluate(),
            }
        }
    }

    pub(super) fn evaluate(&mut self) {
        let now = SystemTime::now();
        let alerts_config = &self.config.alerts;
        let stuck_before = now
            .checked_sub(alerts_config.stuck_after)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let active = *self.role.borrow() == Role::Active;
        for collection in &self.config.collections {
            let name = collection.name.as_str();
            let limits = Limits {
                max_pending: alerts_config.max_pending,
                max_lanes: alerts_config.max_lanes,
            };
            let snapshot = self.monitor.snapshot(name, stuck_before, limits);
            let labels = [name];
            let m = &self.metrics;
            for (gauge, value) in [
                (&m.pending_documents, snapshot.pending_documents),
                (&m.pending_tokens, snapshot.pending_tokens),
                (&m.largest_pending, snapshot.largest_pending),
                (&m.lane_documents, snapshot.lane_documents),
                (&m.lane_entries, snapshot.lane_entries),
                (&m.largest_lane_map, snapshot.largest_lane_map),
            ] {
                gauge.with_label_values(&labels).set(value as i64);
            }
            // While the change stream is down the view is what it was when
            // the stream broke off: its tokens only age, whether or not a
            // writer settled them meanwhile. Their age is not measured then
            // — the stuck count, the oldest age and the stuck_tokens alert
            // keep what they said (an outage is its own signal:
            // monitor_down, readiness) — and the scan that reopens the
            // stream measures again.
            let view_current =
                !(self.config.monitor.enabled && self.monitor.down_for(name).is_some());
            let oldest_age = snapshot.oldest.map(|t| t.age(now));
            if view_current {
                m.stuck_tokens
                    .with_label_values(&labels)
                    .set(snapshot.stuck_tokens as i64);
                m.oldest_pending_age
                    .with_label_values(&labels)
                    .set(oldest_age.map_or(0.0, |a| a.as_secs_f64()));
            } else {
                // Served from the first scrape, at 0 until measured.
                m.stuck_tokens.with_label_values(&labels);
                m.oldest_pending_age.with_label_values(&labels);
            }
            // Malformed documents are counted from the view once a scan
            // filled it; before, the count the last run recorded stands (an
            // empty view would say none).
            let scanned = self.monitor.scanned(name);
            if scanned {
                self.metrics
                    .malformed_documents
                    .with_label_values(&labels)
                    .set(i64::try_from(snapshot.malformed).unwrap_or(i64::MAX));
            }
            if !active {
                // Only the active instance alerts and repairs.
                continue;
            }
            if view_current {
                let stuck = (snapshot.stuck_tokens > 0).then(|| Observation {
                    count: snapshot.stuck_tokens,
                    oldest_age,
                    sample_ids: snapshot.stuck_sample.clone(),
                    detail: None,
                });
                self.alerts.set(AlertKind::StuckTokens, name, stuck);
            }
            let too_long = (snapshot.too_long > 0).then(|| Observation {
                count: snapshot.too_long,
                oldest_age: None,
                sample_ids: snapshot.too_long_sample.clone(),
                detail: Some(format!(
                    "pending arrays longer than {} entries (largest: {})",
                    alerts_config.max_pending, snapshot.largest_pending
                )),
            });
            self.alerts.set(AlertKind::PendingTooLong, name, too_long);
            let too_many_lanes = (snapshot.too_many_lanes > 0).then(|| Observation {
                count: snapshot.too_many_lanes,
                oldest_age: None,
                sample_ids: snapshot.too_many_lanes_sample.clone(),
                detail: Some(format!(
                    "lane maps larger than {} entries (largest: {}): too many writer lanes \
                     within lane_ttl, or named lanes (never pruned)",
                    alerts_config.max_lanes, snapshot.largest_lane_map
                )),
            });
            self.alerts
                .set(AlertKind::LanesTooMany, name, too_many_lanes);
            if scanned {
                let malformed = (snapshot.malformed > 0).then(|| Observation {
                    count: snapshot.malformed,
                    oldest_age: None,
                    sample_ids: snapshot.malformed_sample.clone(),
                    detail: Some(
                        "malformed documents are never modified; fix or remove them".into(),
                    ),
                });
                self.alerts.set(AlertKind::Malformed, name, malformed);
            }
            let down = self
                .monitor
                .down_for(name)
                .filter(|d| self.config.monitor.enabled && *d >= alerts_config.monitor_down_after)
                .map(|d| Observation {
                    count: 1,
                    oldest_age: Some(d),
                    sample_ids: Vec::new(),
                    detail: Some(format!(
                        "the change stream has been down for {}s",
                        d.as_secs()
                    )),
                });
            self.alerts.set(AlertKind::MonitorDown, name, down);
            let skewed = self.clock_skew(name);
            self.alerts.set(AlertKind::ClockSkew, name, skewed);
            if alerts_config.repair && !snapshot.stuck_ids.is_empty() {
                let due = self
                    .last_repair
                    .get(name)
                    .is_none_or(|at| at.elapsed() >= REPAIR_EVERY);
                if due {
                    let request = Request::Repair {
                        collection: name.to_owned(),
                        ids: snapshot.stuck_ids.clone(),
                    };
                    if self.requests.try_send(request).is_ok() {
                        self.last_repair.insert(name.to_owned(), Instant::now());
                    }
                }
            }
        }
    }

    /// The `clock_skew` condition of a collection: holding while the latest
    /// skew uses more than half of the collection's margin.
    fn clock_skew(&self, collection: &str) -> Option<Observation> {
        let skew = self.skew.get()?;
        let margin = self.margins.iter().find(|m| m.collection == collection)?;
        (judge(skew.worst_case(), margin.margin) == SkewLevel::Unsafe).then(|| Observation {
            count: skew.seconds.abs() as u64,
            oldest_age: None,
            sample_ids: Vec::new(),
            detail: Some(format!(
                "{}: more than half of the {} the collection {collection} leaves for clock skew ({}); a \
                 writer whose clock is that far behind could have a token folded, or a lane \
                 entry pruned, before its last retry lands, counting it twice — fix the clocks \
                 (NTP)",
                skew.describe(),
                humantime::format_duration(margin.margin),
                margin.made_of,
            )),
        })
    }
}
