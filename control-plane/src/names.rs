//! Every HTTP path, header and own-metric name kvroute-cp uses, in one place.

/// Liveness probe path: 200 while the process serves.
pub const PATH_HEALTHZ: &str = "/healthz";
/// Readiness probe path: 200 once every endpoint was scraped once and a snapshot was built.
pub const PATH_READYZ: &str = "/readyz";
/// Own Prometheus metrics path.
pub const PATH_METRICS: &str = "/metrics";
/// Current snapshot (JSON, the wire format) for debugging.
pub const PATH_SNAPSHOT: &str = "/v1/snapshot";
/// Default ingest path on Envoy's internal listener (the filter's contract, issue 3).
pub const DEFAULT_INGEST_PATH: &str = kvroute_core::snapshot::INGEST_PATH;
/// Content type of the own metrics in the OpenMetrics 1.0 text format.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the own metrics in the Prometheus text format 0.0.4.
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Scrape duration histogram, seconds, label `endpoint`.
pub const M_SCRAPE_DURATION: &str = "kvroute_cp_scrape_duration_seconds";
/// Scrape errors counter (`_total` appended by the encoder), labels `endpoint`, `reason`.
pub const M_SCRAPE_ERRORS: &str = "kvroute_cp_scrape_errors";
/// Restarts detected counter, label `endpoint`.
pub const M_RESTARTS: &str = "kvroute_cp_endpoint_restarts";
/// Push latency histogram, seconds, label `target`.
pub const M_PUSH_DURATION: &str = "kvroute_cp_push_duration_seconds";
/// Push failures counter, labels `target`, `reason`.
pub const M_PUSH_FAILURES: &str = "kvroute_cp_push_failures";
/// Successful pushes counter, label `target`.
pub const M_PUSHES: &str = "kvroute_cp_pushes";
/// Scrape-to-push latency histogram, seconds, label `target`: from the scrape that changed
/// the snapshot to the ingest's 204.
pub const M_SCRAPE_TO_PUSH: &str = "kvroute_cp_scrape_to_push_seconds";
/// Age of the newest snapshot, seconds (computed at scrape time of this endpoint).
pub const M_SNAPSHOT_AGE: &str = "kvroute_cp_snapshot_age_seconds";
/// Version of the newest snapshot.
pub const M_SNAPSHOT_VERSION: &str = "kvroute_cp_snapshot_version";
/// Endpoints by state gauge, label `state` (`healthy`, `unhealthy`, `pending`).
pub const M_ENDPOINTS: &str = "kvroute_cp_endpoints";
/// Failed config reloads counter.
pub const M_RELOAD_FAILURES: &str = "kvroute_cp_config_reload_failures";
/// Token or TLS files that changed into something unusable (previous ones kept), label
/// `source` (`scrape.tls`, `push.tls`, `push.token_file`, `scrape.token_file`).
pub const M_FILE_RELOAD_FAILURES: &str = "kvroute_cp_file_reload_failures";
/// Ingest-token rejection gauge, label `target`: 1 while the target answers 401/403.
pub const M_PUSH_AUTH_REJECTED: &str = "kvroute_cp_push_auth_rejected";
/// Malformed exposition lines skipped (the rest of the scrape is used), label `endpoint`.
pub const M_SKIPPED_LINES: &str = "kvroute_cp_scrape_skipped_lines";
/// Gateway stats reads that were not used (in-flight load sharing), labels `target`,
/// `reason` (`connect`, `timeout`, `status`, `body`, `parse`, `value`, `ambiguous`).
pub const M_GATEWAY_STATS_ERRORS: &str = "kvroute_cp_gateway_stats_errors";
