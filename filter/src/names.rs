//! Header, shared-data, queue and metric names: every name the filter exposes, in one place.

pub use kvroute_core::plugin_config::{DECISION_HEADER, ENDPOINT_HEADER};
/// [`DECISION_HEADER`]'s value for a request that fell open to Envoy's default route (no
/// snapshot yet, or an internal error, with `fail_open` on): decided at once or resumed
/// from the admission queue.
pub const FAIL_OPEN_REASON: &str = "fail_open";
/// Property holding the decision record (when `decision_record` is on); Envoy keeps it as
/// filter state `wasm.kvroute_decision`, read in access logs with
/// `%FILTER_STATE(wasm.kvroute_decision:PLAIN)%`.
pub const DECISION_PROPERTY: &str = "kvroute_decision";
/// Shared-data key of the current snapshot (JSON bytes, `Snapshot::encode`).
pub const SNAPSHOT_KEY: &str = "kvroute.snapshot";
/// Shared-data key of the current snapshot version (8 bytes, big-endian u64), written after
/// [`SNAPSHOT_KEY`] so a reader that sees a new version finds the new snapshot.
pub const SNAPSHOT_VERSION_KEY: &str = "kvroute.snapshot.version";
/// Shared-data key written with an empty value after each publication: only its CAS token
/// matters, which changes with every write. Workers poll it on each request instead of
/// [`SNAPSHOT_VERSION_KEY`], because reading an empty value costs no allocation inside the
/// VM (see `crate::shared`).
pub const SNAPSHOT_SIGNAL_KEY: &str = "kvroute.snapshot.signal";
/// Prefix of each worker's shared-data key for its in-flight reservations: the worker's
/// number follows, e.g. `kvroute.inflight.3` (publication time, then
/// `InflightTable::encode`; see [`crate::inflight`]).
pub const INFLIGHT_KEY_PREFIX: &str = "kvroute.inflight.";
/// Shared-data key of the prefix-affinity journal shared by the workers
/// (`kvroute_core::affinity` wire format, see [`crate::sharing`]).
pub const AFFINITY_KEY: &str = "kvroute.affinity";
/// Shared-data key of the learner-observation journal shared by the workers (same wire
/// format, records of `kvroute_core::observation`; see [`crate::sharing`]).
pub const LEARNED_KEY: &str = "kvroute.learned";
/// Shared-data key of the worker counter that makes reservation ids unique across workers.
pub const WORKER_SEQ_KEY: &str = "kvroute.worker.seq";

/// Metrics (Envoy stats, prefixed by Envoy with `wasmcustom.`).
pub mod metric {
    /// Decisions by the configured policy (counter).
    pub const DECISIONS_POLICY: &str = "kvroute.decisions.policy";
    /// Decisions per policy name (counter), e.g. `kvroute.decisions.by_policy.hybrid`.
    pub fn decisions_by_policy(p: kvroute_core::picker::PolicyKind) -> &'static str {
        use kvroute_core::picker::PolicyKind as P;
        match p {
            P::RoundRobin => "kvroute.decisions.by_policy.round_robin",
            P::Random => "kvroute.decisions.by_policy.random",
            P::LeastRequest => "kvroute.decisions.by_policy.least_request",
            P::LeastKv => "kvroute.decisions.by_policy.least_kv",
            P::PrefixAffinity => "kvroute.decisions.by_policy.prefix_affinity",
            P::Hybrid => "kvroute.decisions.by_policy.hybrid",
            P::PredictedTtft => "kvroute.decisions.by_policy.predicted_ttft",
        }
    }
    /// Decisions by least-request because no stats were fresh (counter).
    pub const DECISIONS_STALE: &str = "kvroute.decisions.stale_fallback";
    /// Decisions made without the body (no body, upgrade, too large, encoded) (counter).
    pub const DECISIONS_LOAD_ONLY: &str = "kvroute.decisions.load_only";
    /// Requests answered 503 `no_healthy_endpoint`: the model is served, but by no healthy
    /// endpoint (counter).
    pub const NO_ENDPOINTS: &str = "kvroute.outcome.no_endpoints";
    /// Requests answered 404 `model_not_found`: no endpoint lists the model (counter).
    pub const MODEL_NOT_FOUND: &str = "kvroute.outcome.model_not_found";
    /// Cluster-mode requests Envoy could not send because the chosen cluster does not exist
    /// (answered 503 `cluster_not_found`, naming it) (counter).
    pub const CLUSTER_NOT_FOUND: &str = "kvroute.outcome.cluster_not_found";
    /// Endpoint-mode requests whose response came from an upstream none of the endpoint
    /// header's hosts names: Envoy's fallback policy chose it, because the cluster has no
    /// host at a listed address or every listed host failed (counter; checked once per endpoint per 10 s,
    /// `crate::router::UPSTREAM_CHECK_MS`).
    pub const UPSTREAM_MISMATCH: &str = "kvroute.outcome.upstream_mismatch";
    /// `GET /v1/models` answered from the snapshot (counter).
    pub const MODELS_LISTED: &str = "kvroute.models_listed";
    /// Prefix chains learned from other workers' routing (counter, [`crate::sharing`]).
    pub const AFFINITY_IMPORTED: &str = "kvroute.affinity.imported";
    /// Prefix chains this worker shared with the others (counter).
    pub const AFFINITY_PUBLISHED: &str = "kvroute.affinity.published";
    /// Shared affinity journals found corrupt and replaced by an empty one (counter).
    pub const AFFINITY_RESET: &str = "kvroute.affinity.reset";
    /// Learner observations (first tokens, output lengths) replayed from other workers'
    /// responses (counter, [`crate::sharing`]).
    pub const LEARNED_IMPORTED: &str = "kvroute.learned.imported";
    /// Learner observations this worker shared with the others (counter).
    pub const LEARNED_PUBLISHED: &str = "kvroute.learned.published";
    /// Shared observation journals found corrupt and replaced by an empty one (counter).
    pub const LEARNED_RESET: &str = "kvroute.learned.reset";
    /// Linear memory of the reporting worker's Wasm VM, bytes (gauge, refreshed every tick
    /// by each VM that has routed a request; the ingest VM and Envoy's main-thread instance
    /// do not report). Wasm memory only grows, so this is the VM's high-water mark; with one
    /// worker it is the per-worker figure `make bench-overhead` reports.
    pub const WASM_MEMORY: &str = "kvroute.wasm_memory_bytes";
    /// Requests answered 429 (saturated, queue full or timed out) (counter).
    pub const REJECTED: &str = "kvroute.outcome.rejected";
    /// Requests whose KV demand exceeds every serving endpoint's whole KV capacity: they can
    /// never fit, so they are routed by load (not 429) with the reservation capped (counter).
    pub const DEMAND_OVER_CAPACITY: &str = "kvroute.decisions.demand_over_capacity";
    /// Requests held in the admission queue (counter).
    pub const QUEUED: &str = "kvroute.outcome.queued";
    /// Internal errors that fell open to Envoy's default route (counter).
    pub const FAIL_OPEN: &str = "kvroute.fail_open";
    /// Bodies that could not be analysed (routed by load alone) (counter).
    pub const PARSE_ERRORS: &str = "kvroute.parse_errors";
    /// Snapshots accepted by the ingest route (counter).
    pub const INGEST_ACCEPTED: &str = "kvroute.ingest.accepted";
    /// Ingest requests refused: bad token, too large, invalid (counter).
    pub const INGEST_REJECTED: &str = "kvroute.ingest.rejected";
    /// Snapshots published to shared data by the queue consumer (counter).
    pub const SNAPSHOTS_PUBLISHED: &str = "kvroute.snapshots.published";
    /// Snapshots dropped by the consumer because not newer than the current one (counter).
    pub const SNAPSHOTS_STALE: &str = "kvroute.snapshots.ignored_old";
    /// Age of the snapshot in force, milliseconds (gauge, refreshed on each worker's tick).
    pub const SNAPSHOT_AGE_MS: &str = "kvroute.snapshot_age_ms";
    /// Decision time, microseconds (histogram).
    pub const DECISION_US: &str = "kvroute.decision_us";
    /// Time from decision to first response byte, milliseconds (histogram).
    pub const TTFB_MS: &str = "kvroute.ttfb_ms";
    /// |actual − estimated| prompt tokens as a percentage of actual (histogram).
    pub const ESTIMATE_ERROR_PCT: &str = "kvroute.estimate_error_pct";
    /// Requests currently held in the admission queues, all workers together (gauge; each
    /// worker adds its own queue's changes).
    pub const QUEUE_LENGTH: &str = "kvroute.queue_length";
    /// Reservations released at their stream's end (counter); with [`EXPIRED`], equals
    /// reservations made once traffic stops.
    pub const RELEASED: &str = "kvroute.reservations.released";
    /// Reservations dropped by `reservation_ttl_ms` before their stream ended (counter).
    pub const EXPIRED: &str = "kvroute.reservations.expired";
    /// Reservations made (counter).
    pub const RESERVED: &str = "kvroute.reservations.reserved";
    /// Live shared in-flight reservations, all workers (gauge, refreshed on each worker's
    /// tick, not per request).
    pub const INFLIGHT: &str = "kvroute.inflight";
    /// Prefix of the per-endpoint gauge of in-flight requests this Envoy routed to an
    /// endpoint since that endpoint's scrape in the snapshot in force (all workers: each
    /// worker's own table and its copy of the others', [`crate::inflight`]), e.g. `kvroute.inflight_unseen.requests.pool/e0`
    /// (`kvroute_inflight_unseen_requests_pool_e0` in `/stats/prometheus`). The control
    /// plane reads it to share load between gateway replicas (`kvroute_core::peer`).
    pub const INFLIGHT_UNSEEN_REQUESTS: &str = "kvroute.inflight_unseen.requests.";
    /// Prefix of the per-endpoint gauge of those requests' reserved KV demand, tokens.
    pub const INFLIGHT_UNSEEN_TOKENS: &str = "kvroute.inflight_unseen.tokens.";

    /// An endpoint id as it follows [`INFLIGHT_UNSEEN_REQUESTS`] or
    /// [`INFLIGHT_UNSEEN_TOKENS`] in a stat name: each `.` replaced by `_`. Envoy splits stat
    /// names at dots; with the id itself in the name, ids with dots in odd places (`.`,
    /// `..`, a trailing dot) came out of `/stats/prometheus` under names the control plane
    /// could not match (with ids `sim/replica.0.`, kvroute-cp read no load at all:
    /// `integration/tests/cp_herd.rs`). kvroute-cp's `peers::sanitize` maps every byte
    /// outside `[a-zA-Z0-9_]` to `_`, as Envoy's Prometheus output does, so the Prometheus
    /// name of any id without dots is unchanged by this. Ids that differ only by `.` and `_`
    /// share one gauge (the filter writes their sum; kvroute-cp ignores such ambiguous
    /// names).
    pub fn stat_id(id: &str) -> String {
        id.replace('.', "_")
    }

    /// Every metric with a fixed name, with its kind: all of this module's but the
    /// Wasm-only [`WASM_MEMORY`] and the per-endpoint gauges ([`INFLIGHT_UNSEEN_REQUESTS`],
    /// [`INFLIGHT_UNSEEN_TOKENS`]). Both builds define them when a plugin config starts
    /// (the native build must: its ABI defines metrics at config time only), so each reads
    /// 0 until first counted instead of being absent from `/stats`, as alerting rules and
    /// dashboards expect (`rate(kvroute_fail_open[5m])` has no series to alert on before
    /// the first fail-open otherwise).
    pub fn fixed() -> Vec<(&'static str, crate::host::MetricKind)> {
        use crate::host::MetricKind::{Counter, Gauge, Histogram};
        use kvroute_core::picker::PolicyKind as P;
        let mut v = vec![
            (DECISIONS_POLICY, Counter),
            (DECISIONS_STALE, Counter),
            (DECISIONS_LOAD_ONLY, Counter),
            (NO_ENDPOINTS, Counter),
            (MODEL_NOT_FOUND, Counter),
            (CLUSTER_NOT_FOUND, Counter),
            (UPSTREAM_MISMATCH, Counter),
            (MODELS_LISTED, Counter),
            (AFFINITY_IMPORTED, Counter),
            (AFFINITY_PUBLISHED, Counter),
            (AFFINITY_RESET, Counter),
            (LEARNED_IMPORTED, Counter),
            (LEARNED_PUBLISHED, Counter),
            (LEARNED_RESET, Counter),
            (REJECTED, Counter),
            (DEMAND_OVER_CAPACITY, Counter),
            (QUEUED, Counter),
            (FAIL_OPEN, Counter),
            (PARSE_ERRORS, Counter),
            (INGEST_ACCEPTED, Counter),
            (INGEST_REJECTED, Counter),
            (SNAPSHOTS_PUBLISHED, Counter),
            (SNAPSHOTS_STALE, Counter),
            (RELEASED, Counter),
            (EXPIRED, Counter),
            (RESERVED, Counter),
            (SNAPSHOT_AGE_MS, Gauge),
            (QUEUE_LENGTH, Gauge),
            (INFLIGHT, Gauge),
            (DECISION_US, Histogram),
            (TTFB_MS, Histogram),
            (ESTIMATE_ERROR_PCT, Histogram),
        ];
        for p in [
            P::RoundRobin,
            P::Random,
            P::LeastRequest,
            P::LeastKv,
            P::PrefixAffinity,
            P::Hybrid,
            P::PredictedTtft,
        ] {
            v.push((decisions_by_policy(p), Counter));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::metric;
    use crate::host::MetricKind;

    #[test]
    fn every_fixed_metric_is_listed_once_with_its_kind() {
        let m = metric::fixed();
        let names: std::collections::BTreeSet<_> = m.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), m.len(), "no duplicates");
        assert_eq!(m.len(), 39);
        for n in [
            metric::INFLIGHT,
            metric::QUEUE_LENGTH,
            metric::SNAPSHOT_AGE_MS,
        ] {
            assert!(m.contains(&(n, MetricKind::Gauge)), "{n}");
        }
        for n in [
            metric::DECISION_US,
            metric::TTFB_MS,
            metric::ESTIMATE_ERROR_PCT,
        ] {
            assert!(m.contains(&(n, MetricKind::Histogram)), "{n}");
        }
        assert!(m.contains(&(metric::FAIL_OPEN, MetricKind::Counter)));
        assert!(m.contains(&("kvroute.decisions.by_policy.least_kv", MetricKind::Counter)));
        assert!(!names.contains(metric::WASM_MEMORY));
    }
}
