//! kvroute-cp's own metrics, exposed on `/metrics` with the `prometheus-client` crate.
//! Names are in [`crate::names`]. Histogram buckets: 0.5 ms × 2^k, k = 0..14 (0.5 ms to 8 s),
//! covering loopback scrapes through the longest allowed timeout.

use crate::names::*;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Label set `{endpoint}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    /// Endpoint id.
    pub endpoint: String,
}

/// Label set `{endpoint, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointReason {
    /// Endpoint id.
    pub endpoint: String,
    /// Error class: `timeout`, `connect`, `status`, `parse`, `adapter`, `body`.
    pub reason: String,
}

/// Label set `{target}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    /// Target name.
    pub target: String,
}

/// Label set `{target, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetReason {
    /// Target name.
    pub target: String,
    /// `connect`, `timeout`, or the HTTP status code.
    pub reason: String,
}

/// Label set `{state}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `healthy`, `unhealthy` or `pending`.
    pub state: String,
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 15))
}

/// All own metrics.
pub struct Telemetry {
    registry: Registry,
    /// Scrape duration.
    pub scrape_duration: HistFamily<EndpointLabel>,
    /// Scrape errors.
    pub scrape_errors: Family<EndpointReason, Counter>,
    /// Restarts detected.
    pub restarts: Family<EndpointLabel, Counter>,
    /// Push duration.
    pub push_duration: HistFamily<TargetLabel>,
    /// Push failures.
    pub push_failures: Family<TargetReason, Counter>,
    /// Pushes acknowledged.
    pub pushes: Family<TargetLabel, Counter>,
    /// Scrape-to-push latency.
    pub scrape_to_push: HistFamily<TargetLabel>,
    /// Snapshot age, seconds.
    pub snapshot_age: Gauge<f64, AtomicU64>,
    /// Snapshot version.
    pub snapshot_version: Gauge<i64>,
    /// Endpoints by state.
    pub endpoints: Family<StateLabel, Gauge>,
    /// Failed reloads.
    pub reload_failures: Counter,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry {
    /// Build and register every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let scrape_duration: HistFamily<EndpointLabel> =
            Family::new_with_constructor(latency_histogram);
        let push_duration: HistFamily<TargetLabel> =
            Family::new_with_constructor(latency_histogram);
        let scrape_to_push: HistFamily<TargetLabel> =
            Family::new_with_constructor(latency_histogram);
        let t = Self {
            registry: Registry::default(),
            scrape_duration,
            scrape_errors: Family::default(),
            restarts: Family::default(),
            push_duration,
            push_failures: Family::default(),
            pushes: Family::default(),
            scrape_to_push,
            snapshot_age: Gauge::default(),
            snapshot_version: Gauge::default(),
            endpoints: Family::default(),
            reload_failures: Counter::default(),
        };
        registry.register(
            M_SCRAPE_DURATION,
            "Time to scrape one endpoint, seconds",
            t.scrape_duration.clone(),
        );
        registry.register(
            M_SCRAPE_ERRORS,
            "Failed scrapes by endpoint and reason",
            t.scrape_errors.clone(),
        );
        registry.register(
            M_RESTARTS,
            "Model-server restarts detected",
            t.restarts.clone(),
        );
        registry.register(
            M_PUSH_DURATION,
            "Time of one snapshot push, seconds",
            t.push_duration.clone(),
        );
        registry.register(
            M_PUSH_FAILURES,
            "Failed snapshot pushes by target and reason",
            t.push_failures.clone(),
        );
        registry.register(
            M_PUSHES,
            "Snapshot pushes acknowledged with 204",
            t.pushes.clone(),
        );
        registry.register(
            M_SCRAPE_TO_PUSH,
            "From the scrape that changed the snapshot to its acknowledged push, seconds",
            t.scrape_to_push.clone(),
        );
        registry.register(
            M_SNAPSHOT_AGE,
            "Seconds since the newest snapshot was built",
            t.snapshot_age.clone(),
        );
        registry.register(
            M_SNAPSHOT_VERSION,
            "Version of the newest snapshot",
            t.snapshot_version.clone(),
        );
        registry.register(M_ENDPOINTS, "Endpoints by state", t.endpoints.clone());
        registry.register(
            M_RELOAD_FAILURES,
            "Config reloads rejected as invalid",
            t.reload_failures.clone(),
        );
        Self { registry, ..t }
    }

    /// Encode in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Count one scrape error.
    pub fn scrape_error(&self, endpoint: &str, reason: &str) {
        self.scrape_errors
            .get_or_create(&EndpointReason {
                endpoint: endpoint.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one push failure.
    pub fn push_failure(&self, target: &str, reason: &str) {
        self.push_failures
            .get_or_create(&TargetReason {
                target: target.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Drop a target's per-target series (a gateway pod that left), so pod churn does not
    /// grow the exposition without bound. Failure counters keep their history.
    pub fn forget_target(&self, target: &str) {
        let label = TargetLabel {
            target: target.to_owned(),
        };
        self.push_duration.remove(&label);
        self.pushes.remove(&label);
        self.scrape_to_push.remove(&label);
    }
}
