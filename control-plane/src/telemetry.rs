//! kvroute-cp's own metrics, exposed on `/metrics` with the `prometheus-client` crate.
//! Names are in [`crate::names`]. Histogram buckets: 0.5 ms × 2^k, k = 0..14 (0.5 ms to 8 s),
//! covering loopback scrapes through the longest allowed timeout.
//!
//! Two renderings, chosen on the request's `Accept` ([`MetricsFormat::negotiate`], as
//! Prometheus' client libraries do): OpenMetrics 1.0 (`prometheus-client`'s own output:
//! counter families named without `_total`, samples with it, `# EOF`) served as
//! `application/openmetrics-text; version=1.0.0`, and the Prometheus text format 0.0.4
//! derived from it (counter `# HELP`/`# TYPE` lines renamed to the `_total` sample name,
//! `# UNIT` and `# EOF` dropped) served as `text/plain; version=0.0.4`. Both are checked
//! with `openmetrics-parser` in `tests/faults.rs` (`own_metrics_parse_in_both_formats`).

use crate::names::*;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, BTreeSet};
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

/// Label set `{source}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    /// Config field the files belong to: `scrape.tls`, `push.tls`, `push.token_file`,
    /// `scrape.token_file`.
    pub source: String,
}

/// Label set `{state}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `healthy`, `stale`, `unhealthy` or `pending`.
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
    /// 1 while a target rejects the ingest token.
    pub push_auth_rejected: Family<TargetLabel, Gauge>,
    /// Malformed exposition lines skipped.
    pub skipped_lines: Family<EndpointLabel, Counter>,
    /// Gateway stats reads not used, by target and reason ([`crate::peers`]).
    pub gateway_stats_errors: Family<TargetReason, Counter>,
    /// Files that changed on disk into something unusable (previous state kept).
    pub file_reload_failures: Family<SourceLabel, Counter>,
    /// The `reason`s each endpoint or target has counted failures under, by family, so that
    /// its series can be dropped when it leaves ([`Self::forget_endpoint`],
    /// [`Self::forget_target`]): `prometheus_client`'s `Family` removes one label set at a
    /// time and cannot list them.
    reasons: std::sync::Mutex<Reasons>,
}

/// Failure reasons by family, then by endpoint id or target name.
type Reasons = BTreeMap<&'static str, BTreeMap<String, BTreeSet<String>>>;

const SCRAPE_ERRORS: &str = "scrape_errors";
const PUSH_FAILURES: &str = "push_failures";
const GATEWAY_STATS_ERRORS: &str = "gateway_stats_errors";

/// A text rendering of the own metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsFormat {
    /// OpenMetrics 1.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    PrometheusText,
}

impl MetricsFormat {
    /// Choose by `Accept`: OpenMetrics when `application/openmetrics-text` is acceptable with
    /// a q-value at least that of `text/plain` (Prometheus 2.x and 3.x send it first), else
    /// the 0.0.4 text format (also with no `Accept`, like curl and older scrapers).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Self::PrometheusText;
        };
        let mut om: Option<f64> = None;
        let mut text: Option<f64> = None;
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f64>().ok())
                .unwrap_or(1.0);
            let slot = match media.as_str() {
                "application/openmetrics-text" => &mut om,
                "text/plain" => &mut text,
                _ => continue,
            };
            *slot = Some(slot.map_or(q, |old: f64| old.max(q)));
        }
        match (om, text) {
            (Some(o), t) if o > 0.0 && o >= t.unwrap_or(0.0) => Self::OpenMetrics,
            _ => Self::PrometheusText,
        }
    }

    /// The `Content-Type` of this rendering.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Self::PrometheusText => PROMETHEUS_TEXT_CONTENT_TYPE,
        }
    }
}

/// Turn `prometheus-client`'s OpenMetrics text into the 0.0.4 text format: counter families
/// take their `_total` sample name in `# HELP`/`# TYPE`, `# UNIT` and `# EOF` go, and `info`
/// and `unknown` types become `gauge` and `untyped`.
pub fn openmetrics_to_prometheus_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut counters = std::collections::BTreeSet::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.insert(name.to_owned());
            }
        }
    }
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rename = |prefix: &str, line: &str| -> Option<String> {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        };
        if let Some(l) = rename("# HELP ", line).or_else(|| rename("# TYPE ", line)) {
            out.push_str(l.trim_end());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let l = match rest.rsplit_once(' ') {
                Some((name, "info")) => format!("# TYPE {name} gauge"),
                Some((name, "unknown")) => format!("# TYPE {name} untyped"),
                _ => line.to_owned(),
            };
            out.push_str(&l);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
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
            push_auth_rejected: Family::default(),
            skipped_lines: Family::default(),
            gateway_stats_errors: Family::default(),
            file_reload_failures: Family::default(),
            reasons: std::sync::Mutex::default(),
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
        registry.register(
            M_PUSH_AUTH_REJECTED,
            "1 while the ingest target rejects the bearer token (HTTP 401/403)",
            t.push_auth_rejected.clone(),
        );
        registry.register(
            M_SKIPPED_LINES,
            "Malformed exposition lines skipped; the rest of the scrape is used",
            t.skipped_lines.clone(),
        );
        registry.register(
            M_GATEWAY_STATS_ERRORS,
            "Gateway Envoy stats reads not used for load sharing, by target and reason",
            t.gateway_stats_errors.clone(),
        );
        registry.register(
            M_FILE_RELOAD_FAILURES,
            "Token or TLS files that changed into something unusable; the previous ones stay in use",
            t.file_reload_failures.clone(),
        );
        Self { registry, ..t }
    }

    /// Encode in the OpenMetrics 1.0 text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Encode in `format`.
    pub fn encode_as(&self, format: MetricsFormat) -> String {
        match format {
            MetricsFormat::OpenMetrics => self.encode(),
            MetricsFormat::PrometheusText => openmetrics_to_prometheus_text(&self.encode()),
        }
    }

    /// The failure counter of the files behind `source` ([`crate::filewatch`]).
    pub fn file_reload_failures(&self, source: &str) -> Counter {
        self.file_reload_failures
            .get_or_create(&SourceLabel {
                source: source.to_owned(),
            })
            .clone()
    }

    /// Note that `who` counted a failure under `reason` in `family`.
    fn note_reason(&self, family: &'static str, who: &str, reason: &str) {
        let mut m = self
            .reasons
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let by_who = m.entry(family).or_default();
        match by_who.get_mut(who) {
            Some(set) if set.contains(reason) => {}
            Some(set) => {
                set.insert(reason.to_owned());
            }
            None => {
                by_who.insert(who.to_owned(), [reason.to_owned()].into());
            }
        }
    }

    /// The reasons `who` counted failures under in `family`, forgotten.
    fn take_reasons(&self, family: &'static str, who: &str) -> BTreeSet<String> {
        self.reasons
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(family)
            .and_then(|m| m.remove(who))
            .unwrap_or_default()
    }

    /// Count one scrape error.
    pub fn scrape_error(&self, endpoint: &str, reason: &str) {
        self.note_reason(SCRAPE_ERRORS, endpoint, reason);
        self.scrape_errors
            .get_or_create(&EndpointReason {
                endpoint: endpoint.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one unusable gateway stats read.
    pub fn gateway_stats_error(&self, target: &str, reason: &str) {
        self.note_reason(GATEWAY_STATS_ERRORS, target, reason);
        self.gateway_stats_errors
            .get_or_create(&TargetReason {
                target: target.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Count one push failure.
    pub fn push_failure(&self, target: &str, reason: &str) {
        self.note_reason(PUSH_FAILURES, target, reason);
        self.push_failures
            .get_or_create(&TargetReason {
                target: target.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Set target `target`'s `push_auth_rejected` gauge to 0, if it has one (its push task
    /// was restarted: the new one has not been rejected yet).
    pub fn clear_auth_rejected(&self, target: &str) {
        let label = TargetLabel {
            target: target.to_owned(),
        };
        if let Some(g) = self.push_auth_rejected.get(&label) {
            g.set(0);
        }
    }

    /// Drop a target's series (a gateway pod that left), failure counters included, so pod
    /// churn does not grow the exposition without bound, and a removed target that was
    /// rejecting the token does not show `push_auth_rejected` 1 for good.
    pub fn forget_target(&self, target: &str) {
        let label = TargetLabel {
            target: target.to_owned(),
        };
        self.push_auth_rejected.remove(&label);
        self.push_duration.remove(&label);
        self.pushes.remove(&label);
        self.scrape_to_push.remove(&label);
        for (family, counters) in [
            (PUSH_FAILURES, &self.push_failures),
            (GATEWAY_STATS_ERRORS, &self.gateway_stats_errors),
        ] {
            for reason in self.take_reasons(family, target) {
                counters.remove(&TargetReason {
                    target: target.to_owned(),
                    reason,
                });
            }
        }
    }

    /// Drop an endpoint's series (it left the fleet, or its spec changed), failure counters
    /// included: with pods churning, `scrape_errors` grew by every departed pod's series
    /// (586 to 3,550 series in 75 s with ~20 live pods; found by a breaker, 2026-12-05).
    pub fn forget_endpoint(&self, endpoint: &str) {
        let label = EndpointLabel {
            endpoint: endpoint.to_owned(),
        };
        self.scrape_duration.remove(&label);
        self.restarts.remove(&label);
        self.skipped_lines.remove(&label);
        for reason in self.take_reasons(SCRAPE_ERRORS, endpoint) {
            self.scrape_errors.remove(&EndpointReason {
                endpoint: endpoint.to_owned(),
                reason,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A removed target's series go, its auth-rejected gauge (it was left at 1) and its
    /// failure counters included; another target's stay.
    #[test]
    fn forget_target_drops_every_series_of_the_target() {
        let t = Telemetry::new();
        let label = TargetLabel {
            target: "gone".into(),
        };
        t.push_auth_rejected.get_or_create(&label).set(1);
        t.pushes.get_or_create(&label).inc();
        for reason in ["401", "timeout", "401"] {
            t.push_failure("gone", reason);
        }
        t.gateway_stats_error("gone", "parse");
        t.push_failure("kept", "500");
        t.forget_target("gone");
        let text = t.encode();
        assert!(!text.contains("gone"), "{text}");
        assert!(
            text.contains("kvroute_cp_push_failures_total{target=\"kept\",reason=\"500\"} 1"),
            "{text}"
        );
    }

    /// An endpoint that left takes its series with it, failure counters included.
    #[test]
    fn forget_endpoint_drops_every_series_of_the_endpoint() {
        let t = Telemetry::new();
        for reason in ["connect", "slots_timeout", "connect"] {
            t.scrape_error("p/gone", reason);
        }
        t.skipped_lines
            .get_or_create(&EndpointLabel {
                endpoint: "p/gone".into(),
            })
            .inc();
        t.scrape_error("p/kept", "timeout");
        t.forget_endpoint("p/gone");
        let text = t.encode();
        assert!(!text.contains("p/gone"), "{text}");
        assert!(
            text.contains(
                "kvroute_cp_scrape_errors_total{endpoint=\"p/kept\",reason=\"timeout\"} 1"
            ),
            "{text}"
        );
    }

    #[test]
    fn negotiate_follows_accept() {
        use MetricsFormat::*;
        // Prometheus 2.x/3.x default scrape protocols.
        let prom = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        assert_eq!(MetricsFormat::negotiate(Some(prom)), OpenMetrics);
        assert_eq!(
            MetricsFormat::negotiate(Some("application/openmetrics-text")),
            OpenMetrics
        );
        assert_eq!(
            MetricsFormat::negotiate(Some(
                "text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5"
            )),
            PrometheusText
        );
        assert_eq!(
            MetricsFormat::negotiate(Some("application/openmetrics-text;q=0")),
            PrometheusText
        );
        assert_eq!(MetricsFormat::negotiate(Some("*/*")), PrometheusText);
        assert_eq!(MetricsFormat::negotiate(None), PrometheusText);
    }

    #[test]
    fn prometheus_text_renames_counter_families() {
        let om = "# HELP x_pushes Pushes.\n# TYPE x_pushes counter\nx_pushes_total{t=\"a\"} 3\n\
                  # HELP g A gauge.\n# TYPE g gauge\n# UNIT g seconds\ng 1.5\n# TYPE i info\ni_info 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus_text(om),
            "# HELP x_pushes_total Pushes.\n# TYPE x_pushes_total counter\nx_pushes_total{t=\"a\"} 3\n\
             # HELP g A gauge.\n# TYPE g gauge\ng 1.5\n# TYPE i gauge\ni_info 1\n"
        );
    }
}
