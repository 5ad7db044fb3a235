//! The daemon's Prometheus metrics: one registry, one cheap-to-clone
//! handle passed to every task, rendered as text on `/metrics`.
//!
//! Names follow Prometheus conventions: the `tally_` prefix, `_total` on
//! counters, `_seconds` on durations and ages. Labels are bounded: the
//! configured collection names, alert kinds and a few result values — never
//! a document id.

mod api;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use prometheus::core::{MetricVec, MetricVecBuilder};
use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the daemon exports.
#[derive(Clone)]
pub(crate) struct Metrics {
    inner: Arc<Inner>,
}

/// The metric handles; see each field for its name and meaning.
pub(crate) struct Inner {
    registry: Registry,
    /// Every labelled metric, as registered: what a reload that drops a
    /// collection removes that collection's series from.
    labelled: Vec<Box<dyn Forget + Send + Sync>>,
    /// `tally_ready`: 1 once the daemon has reached the server.
    pub(crate) ready: IntGauge,
    /// `tally_lease_active`: 1 while this instance holds the lease (always 1
    /// without `[ha]`).
    pub(crate) lease_active: IntGauge,
    /// `tally_reconcile_runs_total{collection,result}`: result is `ok`,
    /// `failed`, `unavailable` (MongoDB could not be reached: an outage,
    /// which readiness reports, not a failure of the run's own) or
    /// `interrupted`.
    pub(crate) reconcile_runs: IntCounterVec,
    /// `tally_reconcile_duration_seconds{collection}`.
    pub(crate) reconcile_duration: HistogramVec,
    /// `tally_reconcile_documents_folded_total{collection}`.
    pub(crate) documents_folded: IntCounterVec,
    /// `tally_reconcile_tokens_folded_total{collection}`.
    pub(crate) tokens_folded: IntCounterVec,
    /// `tally_reconcile_last_success_timestamp_seconds{collection}`: Unix
    /// time of the last run that reconciled the collection completely.
    pub(crate) last_success: GaugeVec,
    /// `tally_schedule_ticks_skipped_total`: ticks that came while a run
    /// was still going.
    pub(crate) ticks_skipped: IntCounter,
    /// `tally_pending_documents{collection}`: documents holding pending
    /// tokens.
    pub(crate) pending_documents: IntGaugeVec,
    /// `tally_pending_tokens{collection}`.
    pub(crate) pending_tokens: IntGaugeVec,
    /// `tally_stuck_tokens{collection}`: pending tokens older than
    /// `stuck_after`.
    pub(crate) stuck_tokens: IntGaugeVec,
    /// `tally_oldest_pending_age_seconds{collection}` (0 when none).
    pub(crate) oldest_pending_age: GaugeVec,
    /// `tally_largest_pending{collection}`: the longest pending array.
    pub(crate) largest_pending: IntGaugeVec,
    /// `tally_lane_documents{collection}`: documents holding lane entries.
    pub(crate) lane_documents: IntGaugeVec,
    /// `tally_lane_entries{collection}`: entries in their lane maps.
    pub(crate) lane_entries: IntGaugeVec,
    /// `tally_largest_lane_map{collection}`: entries in the largest lane
    /// map.
    pub(crate) largest_lane_map: IntGaugeVec,
    /// `tally_malformed_documents{collection}`, from the last scan.
    pub(crate) malformed_documents: IntGaugeVec,
    /// `tally_fold_refused_documents{collection}`: documents the last
    /// complete reconcile run could not fold because the server refused the
    /// update.
    pub(crate) fold_refused: IntGaugeVec,
    /// `tally_monitor_up{collection}`: 1 while the change stream is open.
    pub(crate) monitor_up: IntGaugeVec,
    /// `tally_monitor_events_total{collection}`: change events processed.
    pub(crate) monitor_events: IntCounterVec,
    /// `tally_monitor_restarts_total{collection,reason}`: reason is
    /// `error`, `history_lost` or `invalidate`.
    pub(crate) monitor_restarts: IntCounterVec,
    /// `tally_monitor_rescans_total{collection}`: full scans that rebuilt
    /// the view (at start, periodic, after a lost history).
    pub(crate) monitor_rescans: IntCounterVec,
    /// `tally_monitor_lag_seconds{collection}`: how far behind the server's
    /// clock the last change event processed was.
    pub(crate) monitor_lag: GaugeVec,
    /// `tally_events_folded_total{collection}`: recorded events the
    /// ledger's fold put into their counters.
    pub(crate) events_folded: IntCounterVec,
    /// `tally_events_backlog{collection}`: recorded events not folded yet.
    pub(crate) events_backlog: IntGaugeVec,
    /// `tally_events_fold_lag_seconds{collection}`: the oldest unfolded
    /// event's age (0 when none): how far the counters are behind.
    pub(crate) events_fold_lag: GaugeVec,
    /// `tally_events_held{collection}`: sums counters refused, held in the
    /// ledger's fold state until they accept them.
    pub(crate) events_held: IntGaugeVec,
    /// `tally_buckets_open{collection}`: buckets not closed yet, after the
    /// last complete reconcile run.
    pub(crate) buckets_open: IntGaugeVec,
    /// `tally_buckets_unclosed{collection}`: buckets past their closing
    /// time that the last complete run could not close.
    pub(crate) buckets_unclosed: IntGaugeVec,
    /// `tally_buckets_closed_total{collection}`: buckets closed.
    pub(crate) buckets_closed: IntCounterVec,
    /// `tally_events_fold_state_bytes{collection}`: the size of the
    /// ledger's fold state document, as the last pass read it (a position
    /// and the held sums: it does not grow with time or recorders).
    pub(crate) events_fold_state_bytes: IntGaugeVec,
    /// `tally_events_fold_position_age_seconds{collection}`: how far behind
    /// the server's clock the fold's position in the events collection's
    /// log is: how far back a fold resumes the change stream, which the
    /// oplog must still hold.
    pub(crate) events_fold_position_age: GaugeVec,
    /// `tally_events_fold_stopped{collection}`: 1 while the ledger's fold is
    /// stopped (its position no longer in the oplog; `tallyd fold-from`).
    pub(crate) events_fold_stopped: IntGaugeVec,
    /// `tally_oplog_window_seconds`: how far back the deployment's oplog
    /// reaches (its oldest entry's age), when the daemon may read it.
    pub(crate) oplog_window: GaugeVec,
    /// `tally_events_stream_up{collection}`: 1 while the change stream on
    /// the ledger's events collection is open (the fold reads it; a pass
    /// opens it again).
    pub(crate) events_stream_up: IntGaugeVec,
    /// `tally_events_stream_failures_total{collection}`: times that stream
    /// could not be opened or broke off.
    pub(crate) events_stream_failures: IntCounterVec,
    /// `tally_alerts_firing{kind,collection}`: 1 while the alert fires.
    pub(crate) alerts_firing: IntGaugeVec,
    /// `tally_alert_notifications_total{kind,state}`: state is `firing` or
    /// `resolved`.
    pub(crate) alert_notifications: IntCounterVec,
    /// `tally_webhook_deliveries_total{result}`: result is `delivered`,
    /// `retried` or `failed` (given up).
    pub(crate) webhook_deliveries: IntCounterVec,
    /// `tally_clock_skew_seconds`: this host's clock minus the server's
    /// (positive: ahead), from the latest readiness probe.
    pub(crate) clock_skew: Gauge,
    /// `tally_clock_skew_margin_seconds`: the tightest margin the
    /// configuration leaves for clock skew (`grace − retry_horizon −
    /// attempt_timeout`); the `clock_skew` alert fires past half of it.
    pub(crate) clock_skew_margin: Gauge,
    /// `tally_config_reload_failures_total`: reloads (SIGHUP) that kept the
    /// running configuration: the new file was invalid, or could not be made
    /// ready (its `[http] listen` not bound, its MongoDB client not built,
    /// its credentials refused).
    pub(crate) config_reload_failures: IntCounter,
    /// `tally_config_last_reload_success`: 0 while the last reload failed
    /// (the daemon runs on the configuration before it), 1 otherwise — also
    /// before any reload.
    pub(crate) config_last_reload_success: IntGauge,
    /// The API's series (`[api]`).
    pub(crate) api: api::ApiMetrics,
}

impl std::ops::Deref for Metrics {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub(crate) fn new() -> Self {
        let registry = Registrar::default();
        let collection = &["collection"];
        let inner = Inner {
            ready: gauge(
                &registry,
                "tally_ready",
                "1 once the daemon has reached the server",
            ),
            lease_active: gauge(
                &registry,
                "tally_lease_active",
                "1 while this instance is the active one",
            ),
            reconcile_runs: counter_vec(
                &registry,
                "tally_reconcile_runs_total",
                "Reconcile runs per collection and result",
                &["collection", "result"],
            ),
            reconcile_duration: register_vec(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tally_reconcile_duration_seconds",
                        "How long a reconcile run of a collection took",
                    )
                    .buckets(vec![0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0]),
                    collection,
                ),
            ),
            documents_folded: counter_vec(
                &registry,
                "tally_reconcile_documents_folded_total",
                "Documents the fold changed",
                collection,
            ),
            tokens_folded: counter_vec(
                &registry,
                "tally_reconcile_tokens_folded_total",
                "Pending tokens folded into their counters",
                collection,
            ),
            last_success: float_vec(
                &registry,
                "tally_reconcile_last_success_timestamp_seconds",
                "Unix time of the last complete reconcile run",
                collection,
            ),
            ticks_skipped: register(
                &registry,
                IntCounter::new(
                    "tally_schedule_ticks_skipped_total",
                    "Schedule ticks skipped because a run was still going",
                ),
            ),
            pending_documents: gauge_vec(
                &registry,
                "tally_pending_documents",
                "Documents holding pending tokens",
                collection,
            ),
            pending_tokens: gauge_vec(
                &registry,
                "tally_pending_tokens",
                "Pending tokens",
                collection,
            ),
            stuck_tokens: gauge_vec(
                &registry,
                "tally_stuck_tokens",
                "Pending tokens older than stuck_after",
                collection,
            ),
            oldest_pending_age: float_vec(
                &registry,
                "tally_oldest_pending_age_seconds",
                "Age of the oldest pending token (0 when none)",
                collection,
            ),
            largest_pending: gauge_vec(
                &registry,
                "tally_largest_pending",
                "Entries in the longest pending array",
                collection,
            ),
            lane_documents: gauge_vec(
                &registry,
                "tally_lane_documents",
                "Documents holding writer lane entries",
                collection,
            ),
            lane_entries: gauge_vec(
                &registry,
                "tally_lane_entries",
                "Writer lane entries in the lane maps",
                collection,
            ),
            largest_lane_map: gauge_vec(
                &registry,
                "tally_largest_lane_map",
                "Entries in the largest lane map",
                collection,
            ),
            malformed_documents: gauge_vec(
                &registry,
                "tally_malformed_documents",
                "Malformed documents found by the last scan",
                collection,
            ),
            fold_refused: gauge_vec(
                &registry,
                "tally_fold_refused_documents",
                "Documents the last reconcile run could not fold: the server refused the update",
                collection,
            ),
            monitor_up: gauge_vec(
                &registry,
                "tally_monitor_up",
                "1 while the change stream is open",
                collection,
            ),
            monitor_events: counter_vec(
                &registry,
                "tally_monitor_events_total",
                "Change events processed",
                collection,
            ),
            monitor_restarts: counter_vec(
                &registry,
                "tally_monitor_restarts_total",
                "Change streams reopened, by reason",
                &["collection", "reason"],
            ),
            monitor_rescans: counter_vec(
                &registry,
                "tally_monitor_rescans_total",
                "Full scans that rebuilt the view",
                collection,
            ),
            monitor_lag: float_vec(
                &registry,
                "tally_monitor_lag_seconds",
                "How far the last processed change event was behind the server's clock",
                collection,
            ),
            events_folded: counter_vec(
                &registry,
                "tally_events_folded_total",
                "Recorded events folded into their counters",
                collection,
            ),
            events_backlog: gauge_vec(
                &registry,
                "tally_events_backlog",
                "Recorded events not folded yet",
                collection,
            ),
            events_fold_state_bytes: gauge_vec(
                &registry,
                "tally_events_fold_state_bytes",
                "Size in bytes of the ledger's fold state document",
                collection,
            ),
            events_fold_lag: float_vec(
                &registry,
                "tally_events_fold_lag_seconds",
                "Age of the oldest recorded event not folded yet",
                collection,
            ),
            events_fold_position_age: float_vec(
                &registry,
                "tally_events_fold_position_age_seconds",
                "How far behind the server's clock the fold's position in the events collection's change stream is",
                collection,
            ),
            events_fold_stopped: gauge_vec(
                &registry,
                "tally_events_fold_stopped",
                "1 while the ledger's fold is stopped: its position is no longer in the oplog",
                collection,
            ),
            oplog_window: float_vec(
                &registry,
                "tally_oplog_window_seconds",
                "How far back the deployment's oplog reaches: its oldest entry's age",
                &[],
            ),
            events_held: gauge_vec(
                &registry,
                "tally_events_held",
                "Sums of recorded events that counters refused, held until they accept them",
                collection,
            ),
            buckets_open: gauge_vec(
                &registry,
                "tally_buckets_open",
                "Buckets not closed yet, after the last complete reconcile run",
                collection,
            ),
            buckets_unclosed: gauge_vec(
                &registry,
                "tally_buckets_unclosed",
                "Buckets past their closing time that the last complete reconcile run could not close",
                collection,
            ),
            buckets_closed: counter_vec(
                &registry,
                "tally_buckets_closed_total",
                "Buckets closed",
                collection,
            ),
            events_stream_up: gauge_vec(
                &registry,
                "tally_events_stream_up",
                "1 while the change stream on the events collection is open",
                collection,
            ),
            events_stream_failures: counter_vec(
                &registry,
                "tally_events_stream_failures_total",
                "Times the change stream on the events collection could not open or broke off",
                collection,
            ),
            alerts_firing: gauge_vec(
                &registry,
                "tally_alerts_firing",
                "1 while an alert fires",
                &["kind", "collection"],
            ),
            alert_notifications: counter_vec(
                &registry,
                "tally_alert_notifications_total",
                "Alert notifications, by kind and state",
                &["kind", "state"],
            ),
            webhook_deliveries: counter_vec(
                &registry,
                "tally_webhook_deliveries_total",
                "Webhook delivery attempts, by result",
                &["result"],
            ),
            clock_skew: float(
                &registry,
                "tally_clock_skew_seconds",
                "This host's clock minus the server's, from the latest readiness probe",
            ),
            clock_skew_margin: float(
                &registry,
                "tally_clock_skew_margin_seconds",
                "The tightest margin for clock skew: grace - retry_horizon - attempt_timeout",
            ),
            config_reload_failures: register(
                &registry,
                IntCounter::new(
                    "tally_config_reload_failures_total",
                    "Reloads that kept the running configuration (the new one was bad or not ready)",
                ),
            ),
            config_last_reload_success: gauge(
                &registry,
                "tally_config_last_reload_success",
                "0 while the last reload failed and the previous configuration runs on, else 1",
            ),
            api: api::ApiMetrics::new(&registry),
            labelled: registry.labelled.into_inner(),
            registry: registry.registry,
        };
        metrics_ready(&inner);
        let metrics = Self {
            inner: Arc::new(inner),
        };
        let build = register_in(
            &metrics.registry,
            IntGaugeVec::new(
                Opts::new("tally_build_info", "The running tally version"),
                &["version"],
            ),
        );
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        metrics
    }

    /// Removes every series of a collection not in `configured`: a reload
    /// that drops a collection drops its series too, so no rule reads (and
    /// no alert fires on) a collection the daemon no longer looks at.
    pub(crate) fn forget_collections_except(&self, configured: &[&str]) {
        let mut stale: Vec<HashMap<String, String>> = Vec::new();
        for family in self.registry.gather() {
            for metric in family.get_metric() {
                let labels: HashMap<String, String> = metric
                    .get_label()
                    .iter()
                    .map(|l| (l.name().to_owned(), l.value().to_owned()))
                    .collect();
                if labels
                    .get("collection")
                    .is_some_and(|c| !configured.contains(&c.as_str()))
                    && !stale.contains(&labels)
                {
                    stale.push(labels);
                }
            }
        }
        for labels in &stale {
            let labels: HashMap<&str, &str> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            // Only the vectors with exactly these label names hold the
            // series; the others refuse, which is nothing to remove.
            for vec in &self.labelled {
                vec.forget(&labels);
            }
        }
    }

    /// Everything, in the Prometheus text format.
    pub(crate) fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(cause = %err, "cannot render metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The series that exist from the start whatever happens: a counter of
/// failures at 0 (so that a rule on its increase sees the first one), the
/// reload gauge at 1 (the configuration the daemon started with was good).
fn metrics_ready(inner: &Inner) {
    inner.config_last_reload_success.set(1);
    for result in ["delivered", "retried", "failed"] {
        inner.webhook_deliveries.with_label_values(&[result]);
    }
}

/// A labelled metric whose series can be removed one label set at a time.
trait Forget {
    fn forget(&self, labels: &HashMap<&str, &str>);
}

impl<T: MetricVecBuilder> Forget for MetricVec<T> {
    fn forget(&self, labels: &HashMap<&str, &str>) {
        let _ = self.remove(labels);
    }
}

/// The registry while the metrics are made, and the labelled ones made so
/// far.
#[derive(Default)]
struct Registrar {
    registry: Registry,
    labelled: RefCell<Vec<Box<dyn Forget + Send + Sync>>>,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registrar,
    metric: prometheus::Result<T>,
) -> T {
    register_in(&registry.registry, metric)
}

/// Registers a labelled metric, kept among those a reload can forget.
fn register_vec<T: MetricVecBuilder + 'static>(
    registry: &Registrar,
    metric: prometheus::Result<MetricVec<T>>,
) -> MetricVec<T>
where
    MetricVec<T>: prometheus::core::Collector + Clone + Send + Sync,
{
    let metric = register(registry, metric);
    registry
        .labelled
        .borrow_mut()
        .push(Box::new(metric.clone()));
    metric
}

fn register_in<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<T>,
) -> T {
    // Names and labels are constants of this file: an error is a bug here.
    let metric = metric.expect("valid metric definition");
    registry
        .register(Box::new(metric.clone()))
        .expect("metric registered once");
    metric
}

fn gauge(registry: &Registrar, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help))
}

fn float(registry: &Registrar, name: &str, help: &str) -> Gauge {
    register(registry, Gauge::new(name, help))
}

fn gauge_vec(registry: &Registrar, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register_vec(registry, IntGaugeVec::new(Opts::new(name, help), labels))
}

fn float_vec(registry: &Registrar, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    register_vec(registry, GaugeVec::new(Opts::new(name, help), labels))
}

fn counter_vec(registry: &Registrar, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register_vec(registry, IntCounterVec::new(Opts::new(name, help), labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_prometheus_text_format_with_conventional_names() {
        let metrics = Metrics::new();
        metrics
            .tokens_folded
            .with_label_values(&["views"])
            .inc_by(3);
        metrics.ready.set(1);
        let text = metrics.render();
        assert!(
            text.contains("tally_reconcile_tokens_folded_total{collection=\"views\"} 3"),
            "{text}"
        );
        assert!(text.contains("tally_ready 1"), "{text}");
        assert!(text.contains("tally_build_info{version="), "{text}");
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).unwrap();
            assert!(name.starts_with("tally_"), "{name}");
            if line.ends_with("counter") {
                assert!(name.ends_with("_total"), "{name}");
            }
        }
    }
}
