//! The kvroute filter's plugin configuration: parsed from the plugin's JSON
//! `configuration` with serde (`deny_unknown_fields`, every field defaulted), then validated
//! into [`Config`] by `TryFrom<RawConfig>`. A bad config makes the filter's `on_configure`
//! return false with one log line naming the field (see [`ConfigError`]), and Envoy refuses
//! the plugin.
//!
//! It lives in core, not in the filter, so that `kvroute-cp --check --envoy-config` judges
//! the plugin configurations of an Envoy config with the filter's own rules.
//!
//! Every field, its default and unit is listed in docs/filter.md's configuration table.

use crate::picker::Picker;
use crate::router::RouterConfig;
use serde::Deserialize;

/// Gateway API Inference Extension destination header, the default `endpoint_header`:
/// `host:port[,host:port...]`
/// (<https://gateway-api-inference-extension.sigs.k8s.io/> "endpoint picker protocol").
pub const ENDPOINT_HEADER: &str = "x-gateway-destination-endpoint";

/// Debug header carrying the decision reason (when `debug_header` is on); the filter also
/// strips it from client requests, so neither routing header may take its name.
pub const DECISION_HEADER: &str = "x-kvroute-decision";

/// Request headers a routing header may not be named after. The filter removes the
/// client's values of its routing headers and writes its own, so on one of these it would
/// break the request: message framing and hop-by-hop headers (RFC 9110 §7.6.1, RFC 9112
/// §6–7: `content-length`, `transfer-encoding`, `connection`, `keep-alive`, `te`,
/// `trailer`, `upgrade`, `proxy-connection`), `host` (the upstream's authority), `expect`
/// (RFC 9110 §10.1.1) and the body's own description (`content-type`,
/// `content-encoding`); nor may it start with [`RESERVED_HEADER_PREFIX`]. A breaker's
/// `cluster_header: "content-length"` made every request a 503, `endpoint_header: "host"`
/// rewrote every upstream authority.
pub const RESERVED_HEADERS: [&str; 12] = [
    "host",
    "expect",
    "content-length",
    "content-type",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Header prefix a routing header may not start with ([`RESERVED_HEADERS`]): Envoy's own
/// request headers, which its router reads as instructions (`x-envoy-upstream-rq-timeout-ms`,
/// `x-envoy-retry-on`, ...;
/// <https://www.envoyproxy.io/docs/envoy/latest/configuration/http/http_filters/router_filter#http-headers-consumed>).
pub const RESERVED_HEADER_PREFIX: &str = "x-envoy-";

/// Default `inflight_share_ms`: how long a worker's view of the other workers' in-flight
/// reservations may age before its next decision reads them again, milliseconds (the
/// measurements behind it: docs/overhead.md, "Per-worker in-flight tables").
pub const DEFAULT_INFLIGHT_SHARE_MS: u64 = 20;

/// Which job this plugin instance does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Route client requests (the data path).
    #[default]
    Route,
    /// Serve the snapshot ingest route and answer everything else locally (404): nothing
    /// reaches an upstream. Put this on a listener bound to loopback.
    Ingest,
}

/// How the decision is handed to Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Set `cluster_header` to the endpoint's Envoy cluster; the route uses `cluster_header`.
    #[default]
    Cluster,
    /// Set `endpoint_header` to `host:port[,fallback...]` (Gateway API Inference Extension).
    Endpoint,
}

/// Default `admission.max_queue_bytes`: 8 MiB, bytes. Wasm memory never shrinks, and the
/// target is at most 32 MiB per worker (issue 13): the worst high-water mark measured with
/// admission off is 20.0 MiB (16 KiB bodies, `make bench-overhead`; docs/overhead.md,
/// "Results (2-core machine, 2026-12-02)"), and besides what the queue holds, one body up to
/// `max_body_bytes` (default 4 MiB) is in memory as it is read (the tick re-decides the
/// queue's head in place, with no copy), so 20 + 8 + 4 = 32 MiB. Without this bound the default 64
/// entries of 4 MiB bodies could hold 256 MiB.
pub const DEFAULT_MAX_QUEUE_BYTES: usize = 8 * 1024 * 1024;

/// Admission control (see [`crate::admission`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Hold requests when every endpoint is saturated (default false: answer 429 at once).
    pub enabled: bool,
    /// Most requests held per Envoy worker (default 64).
    pub max_queue: usize,
    /// Most bytes of held requests per Envoy worker: the bodies and paths the filter copies
    /// into Wasm memory to park them, bytes (default 8 MiB, [`DEFAULT_MAX_QUEUE_BYTES`]; at
    /// least 1 when enabled). A saturated request that would pass it, or `max_queue`, is
    /// answered 429 at once; a body larger than it is never held (a body over
    /// `max_body_bytes` is not read, so it counts its path only).
    pub max_queue_bytes: usize,
    /// Longest hold before a 429, milliseconds (default 5000).
    pub timeout_ms: u64,
    /// How often held requests are retried, milliseconds (default 50).
    pub tick_ms: u64,
    /// `retry-after` sent with a 429, seconds (default 1).
    pub retry_after_s: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queue: 64,
            max_queue_bytes: DEFAULT_MAX_QUEUE_BYTES,
            timeout_ms: 5_000,
            tick_ms: 50,
            retry_after_s: 1,
        }
    }
}

/// The plugin configuration as written (JSON).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// `route` (default) or `ingest`.
    pub role: Role,
    /// `cluster` (default) or `endpoint`.
    pub mode: Mode,
    /// Header set in cluster mode (default `x-kvroute-cluster`).
    pub cluster_header: String,
    /// Header set in endpoint mode (default `x-gateway-destination-endpoint`).
    pub endpoint_header: String,
    /// Largest request body inspected, bytes (default 4 MiB). Larger bodies are routed by
    /// load alone; set Envoy's `per_connection_buffer_limit_bytes` to at least twice this:
    /// Envoy adds each read of a chunked upload to the buffered body before the filter sees
    /// it and answers 413 when that passes its limit (docs/filter.md).
    /// `Content-Encoding`-compressed bodies are never decoded: they are routed by load
    /// alone, decided at header time without buffering.
    pub max_body_bytes: usize,
    /// Ingest path (default `/kvroute/v1/snapshot`).
    pub ingest_path: String,
    /// Bearer token the control plane must send (required for role `ingest`).
    pub ingest_token: String,
    /// Largest snapshot accepted, bytes (default 1 MiB).
    pub ingest_max_bytes: usize,
    /// Shared queue name (default `kvroute.snapshots`).
    pub queue_name: String,
    /// `vm_config.vm_id` of this plugin (default `kvroute`), used to resolve the queue.
    pub vm_id: String,
    /// Reservation lifetime, milliseconds (default 600000).
    pub reservation_ttl_ms: u64,
    /// How old a worker's copy of the other workers' in-flight reservations may get before
    /// its next decision reads them again, and how often at most a worker that keeps
    /// reserving publishes its own, milliseconds (default 20,
    /// [`DEFAULT_INFLIGHT_SHARE_MS`]; 0: every decision reads and every
    /// reservation publishes; at most 10000). See `kvroute_filter::inflight`.
    pub inflight_share_ms: u64,
    /// The router's own keys, at the top level of the JSON: `picker` (policy,
    /// `stale_after_ms`, headroom, weights, classes, fallbacks), `estimator` (media
    /// allowances, per-model calibration), `prefix` (block size in characters, max blocks),
    /// `prefix_index_blocks` (per-worker prefix index capacity), `models` (extra model
    /// profiles, added to the built-in ones) and `calibrate` (learn calibration from
    /// response `usage`). See [`RouterConfig`] for units and defaults.
    #[serde(flatten)]
    pub router: RouterConfig,
    /// Admission control.
    pub admission: AdmissionConfig,
    /// Internal errors let Envoy route by its default route (default true). When false,
    /// they answer a JSON 503.
    pub fail_open: bool,
    /// Add `x-kvroute-decision` with the decision reason to the upstream request and the
    /// response (default false).
    pub debug_header: bool,
    /// Bound on the bytes kept while reading a response's `usage`, bytes (default 16384;
    /// at least [`MIN_USAGE_TAIL_BYTES`], below which no `usage` event would fit and every
    /// sampled response would be read for nothing): the current SSE event's data (a longer
    /// event is read from its last this many bytes) or the end of a JSON body.
    pub usage_tail_bytes: usize,
    /// Keep a decision record per routed request (default false): the decision reason
    /// plus the best 3 candidates with their score, predicted TTFT and each hybrid term, as
    /// Envoy filter state `wasm.kvroute_decision` for access logs, and in
    /// `x-kvroute-decision` when `debug_header` is on. Costs one small string per request.
    pub decision_record: bool,
    /// Share prefix affinity between this Envoy's workers through shared data (default
    /// true; see `kvroute_filter::sharing`). Off, each worker only knows what it routed.
    pub share_affinity: bool,
    /// Share the learners' observations between this Envoy's workers through shared data
    /// (default true; see `kvroute_filter::sharing`): every worker's prefill-throughput and
    /// output-length learners then learn from every first token the proxy sees and every
    /// response it reads (`usage_sample_ms`), not from 1/workers of them. Uses `affinity_sync_ms` and `affinity_journal_bytes` too.
    pub share_learning: bool,
    /// How often each worker syncs the shared journals (affinity, observations),
    /// milliseconds (default 100): the longest a prefix routed, or a response seen, by one
    /// worker stays unknown to the others.
    pub affinity_sync_ms: u64,
    /// Bound on each shared journal, bytes (default 262144,
    /// [`crate::affinity::DEFAULT_JOURNAL_BYTES`]; at least 1024).
    pub affinity_journal_bytes: usize,
}

impl RawConfig {
    /// Whether the workers share anything through shared data (`share_affinity` or
    /// `share_learning`): then `affinity_sync_ms` must be set, and each worker's tick runs
    /// at least that often.
    pub fn shares_with_workers(&self) -> bool {
        self.share_affinity || self.share_learning
    }

    /// The header a routing decision sets: `cluster_header` in cluster mode,
    /// `endpoint_header` in endpoint mode.
    pub fn routing_header(&self) -> &str {
        match self.mode {
            Mode::Cluster => &self.cluster_header,
            Mode::Endpoint => &self.endpoint_header,
        }
    }
}

impl Default for RawConfig {
    fn default() -> Self {
        Self {
            role: Role::Route,
            mode: Mode::Cluster,
            cluster_header: "x-kvroute-cluster".into(),
            endpoint_header: ENDPOINT_HEADER.into(),
            max_body_bytes: 4 * 1024 * 1024,
            ingest_path: crate::snapshot::INGEST_PATH.into(),
            ingest_token: String::new(),
            ingest_max_bytes: 1024 * 1024,
            queue_name: "kvroute.snapshots".into(),
            vm_id: "kvroute".into(),
            reservation_ttl_ms: crate::inflight::DEFAULT_TTL_MS,
            inflight_share_ms: DEFAULT_INFLIGHT_SHARE_MS,
            router: RouterConfig::default(),
            admission: AdmissionConfig::default(),
            fail_open: true,
            debug_header: false,
            usage_tail_bytes: crate::usage::DEFAULT_MAX_TAIL,
            decision_record: false,
            share_affinity: true,
            share_learning: true,
            affinity_sync_ms: 100,
            affinity_journal_bytes: crate::affinity::DEFAULT_JOURNAL_BYTES,
        }
    }
}

/// A config problem, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON at all (a syntax error, or the text ends early).
    #[error("kvroute plugin config is not valid JSON: {0}")]
    Parse(String),
    /// Valid JSON that does not fit [`RawConfig`]: an unknown field (a typo), an unknown
    /// value of an enumerated field, or a value of the wrong type. serde's message names
    /// the field or value and its position.
    #[error(
        "kvroute plugin config: {0} (fields and values: docs/filter.md, \"Configuration reference\")"
    )]
    Schema(String),
    /// A field has an invalid value.
    #[error("kvroute plugin config field `{field}` = {value}: {reason}")]
    Invalid {
        /// Field path.
        field: String,
        /// Offending value.
        value: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config(pub RawConfig);

impl std::ops::Deref for Config {
    type Target = RawConfig;
    fn deref(&self) -> &RawConfig {
        &self.0
    }
}

/// Smallest `usage_tail_bytes`, bytes: a chat completion chunk that carries `usage` (id,
/// model name, `usage` with its details) is ~300 bytes; 1 KiB leaves room for long ids and
/// model names.
pub const MIN_USAGE_TAIL_BYTES: usize = 1024;

/// Largest `prefix.block_chars` accepted: 64 KiB of text per block (the default is 64).
pub const MAX_PREFIX_BLOCK_CHARS: usize = 65_536;
/// Largest `admission.timeout_ms`, ms: Envoy's default stream idle timeout, 5 minutes.
pub const MAX_ADMISSION_TIMEOUT_MS: u64 = 300_000;
/// Largest `prefix.max_blocks` accepted (the default is 256, GIE's).
pub const MAX_PREFIX_BLOCKS: usize = 65_536;
/// Largest `prefix_index_total_blocks` accepted: 2²² blocks, ~176 MB at ~42 bytes a block,
/// well under the ~1 GiB a V8 Wasm VM may grow to.
pub const MAX_PREFIX_INDEX_TOTAL_BLOCKS: usize = 1 << 22;

fn invalid(field: &str, value: impl std::fmt::Display, reason: &'static str) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        value: value.to_string(),
        reason,
    }
}

/// Why routing header name `h` is refused, or `None` when it is a usable name.
fn header_name_problem(h: &str) -> Option<&'static str> {
    if h.is_empty()
        || !h
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        Some("must be a non-empty lower-case header name")
    } else if RESERVED_HEADERS.contains(&h) {
        Some("must not be a framing, hop-by-hop, host or content header: the filter removes the client's value and writes its own")
    } else if h.starts_with(RESERVED_HEADER_PREFIX) {
        Some("must not start with x-envoy-: Envoy's router reads those headers as instructions")
    } else if h == DECISION_HEADER {
        Some("must not be x-kvroute-decision, the filter's debug header")
    } else {
        None
    }
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;
    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        for (field, name) in [
            ("cluster_header", &raw.cluster_header),
            ("endpoint_header", &raw.endpoint_header),
        ] {
            if let Some(reason) = header_name_problem(name) {
                return Err(invalid(field, name, reason));
            }
        }
        if raw.cluster_header == raw.endpoint_header {
            return Err(invalid(
                "endpoint_header",
                &raw.endpoint_header,
                "must differ from cluster_header: the filter strips both from client requests",
            ));
        }
        if raw.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", 0, "must be at least 1"));
        }
        if !raw.ingest_path.starts_with('/') {
            return Err(invalid(
                "ingest_path",
                &raw.ingest_path,
                "must start with /",
            ));
        }
        if raw.role == Role::Ingest && raw.ingest_token.len() < 16 {
            return Err(invalid(
                "ingest_token",
                "<redacted>",
                "role ingest needs a token of at least 16 characters",
            ));
        }
        if raw.ingest_max_bytes == 0 {
            return Err(invalid("ingest_max_bytes", 0, "must be at least 1"));
        }
        if raw.queue_name.is_empty() {
            return Err(invalid("queue_name", "\"\"", "must not be empty"));
        }
        if raw.reservation_ttl_ms == 0 {
            return Err(invalid("reservation_ttl_ms", 0, "must be at least 1"));
        }
        if raw.inflight_share_ms > 10_000 {
            return Err(invalid(
                "inflight_share_ms",
                raw.inflight_share_ms,
                "must be at most 10000",
            ));
        }
        if raw.admission.enabled && raw.admission.max_queue == 0 {
            return Err(invalid(
                "admission.max_queue",
                0,
                "must be at least 1 when enabled",
            ));
        }
        if raw.admission.enabled && raw.admission.max_queue_bytes == 0 {
            return Err(invalid(
                "admission.max_queue_bytes",
                0,
                "must be at least 1 when enabled",
            ));
        }
        if raw.admission.tick_ms == 0 {
            return Err(invalid("admission.tick_ms", 0, "must be at least 1"));
        }
        // Envoy's default stream idle timeout (5 min) ends a longer hold anyway
        // (https://www.envoyproxy.io/docs/envoy/latest/faq/configuration/timeouts); a value
        // like u64::MAX held requests for good (found by a breaker).
        if raw.admission.timeout_ms > MAX_ADMISSION_TIMEOUT_MS {
            return Err(invalid(
                "admission.timeout_ms",
                raw.admission.timeout_ms,
                "must be at most 300000 (5 minutes)",
            ));
        }
        let sharing = raw.shares_with_workers();
        if sharing && raw.affinity_sync_ms == 0 {
            return Err(invalid("affinity_sync_ms", 0, "must be at least 1"));
        }
        if sharing && raw.affinity_journal_bytes < 1024 {
            return Err(invalid(
                "affinity_journal_bytes",
                raw.affinity_journal_bytes,
                "must be at least 1024",
            ));
        }
        if raw.usage_tail_bytes < MIN_USAGE_TAIL_BYTES {
            return Err(invalid(
                "usage_tail_bytes",
                raw.usage_tail_bytes,
                "must be at least 1024 (a streamed `usage` event is ~300 bytes)",
            ));
        }
        // Upper bounds keep a worker's Wasm memory bounded whatever is accepted: a block is
        // copied once per request (`block_chars`), a request hashes up to `max_blocks`, and
        // the prefix index holds up to `prefix_index_total_blocks` of ~42 bytes each.
        for (field, v, max, reason) in [
            (
                "prefix.block_chars",
                raw.router.prefix.block_chars,
                MAX_PREFIX_BLOCK_CHARS,
                "must be at most 65536",
            ),
            (
                "prefix.max_blocks",
                raw.router.prefix.max_blocks,
                MAX_PREFIX_BLOCKS,
                "must be at most 65536",
            ),
            (
                "prefix_index_total_blocks",
                raw.router.prefix_index_total_blocks,
                MAX_PREFIX_INDEX_TOTAL_BLOCKS,
                "must be at most 4194304 (~176 MB of a worker's memory)",
            ),
        ] {
            if v > max {
                return Err(invalid(field, v, reason));
            }
        }
        if raw.router.prefix.block_chars == 0 {
            return Err(invalid("prefix.block_chars", 0, "must be at least 1"));
        }
        if raw.router.prefix_index_total_blocks == 0 {
            return Err(invalid(
                "prefix_index_total_blocks",
                0,
                "must be at least 1",
            ));
        }
        for (i, m) in raw.router.models.iter().enumerate() {
            if m.name.is_empty() {
                return Err(invalid(
                    &format!("models[{i}].name"),
                    "\"\"",
                    "must not be empty",
                ));
            }
        }
        if let Err(e) = Picker::new(raw.router.picker.clone(), 0) {
            return Err(ConfigError::Invalid {
                field: format!("picker.{}", e.field),
                value: e.value,
                reason: e.reason,
            });
        }
        Ok(Config(raw))
    }
}

impl Config {
    /// Parse and validate plugin configuration bytes; empty bytes mean all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let raw: RawConfig = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            RawConfig::default()
        } else {
            serde_json::from_slice(bytes).map_err(|e| {
                // serde_json reports some type errors as syntax errors (a number where an
                // enum's string belongs: `"mode": 5` is "expected value"), so the category
                // comes from whether the text is JSON at all.
                if serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok() {
                    ConfigError::Schema(e.to_string())
                } else {
                    ConfigError::Parse(e.to_string())
                }
            })?
        };
        Config::try_from(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_is_all_defaults() {
        let c = Config::parse(b"").unwrap();
        assert_eq!(c.0, RawConfig::default());
        assert_eq!(c.mode, Mode::Cluster);
        assert_eq!(c.cluster_header, "x-kvroute-cluster");
        assert_eq!(c.endpoint_header, "x-gateway-destination-endpoint");
        assert_eq!(c.max_body_bytes, 4 * 1024 * 1024);
        assert_eq!(c.admission.max_queue, 64);
        assert_eq!(c.admission.max_queue_bytes, 8_388_608);
        assert!(c.fail_open);
        assert_eq!(Config::parse(b"{}").unwrap().0, RawConfig::default());
    }

    /// The header a decision sets is the mode's own.
    #[test]
    fn the_routing_header_is_the_modes() {
        let c = Config::parse(br#"{"cluster_header":"x-c","endpoint_header":"x-e"}"#).unwrap();
        assert_eq!(c.routing_header(), "x-c");
        let c =
            Config::parse(br#"{"mode":"endpoint","cluster_header":"x-c","endpoint_header":"x-e"}"#)
                .unwrap();
        assert_eq!(c.routing_header(), "x-e");
    }

    #[test]
    fn full_config_parses() {
        let c = Config::parse(
            br#"{"role":"ingest","mode":"endpoint","cluster_header":"x-c","endpoint_header":"x-e",
            "max_body_bytes":1000,"ingest_path":"/in",
            "ingest_token":"0123456789abcdef","ingest_max_bytes":10,"queue_name":"q","vm_id":"v",
            "reservation_ttl_ms":5,"picker":{"policy":"least_kv","stale_after_ms":100},
            "estimator":{},"prefix":{"block_chars":32,"max_blocks":8},"prefix_index_blocks":9,
            "models":[],"calibrate":false,
            "admission":{"enabled":true,"max_queue":2,"max_queue_bytes":6,"timeout_ms":3,"tick_ms":4,"retry_after_s":5},
            "fail_open":false,"debug_header":true,"usage_tail_bytes":1024,
            "share_affinity":false,"share_learning":false,"affinity_sync_ms":0}"#,
        )
        .unwrap();
        // Nothing shared: no sync period needed.
        assert!(!c.share_affinity && !c.share_learning);
        assert_eq!(c.affinity_sync_ms, 0);
        assert_eq!(c.role, Role::Ingest);
        assert_eq!(c.mode, Mode::Endpoint);
        assert_eq!(c.router.picker.stale_after_ms, 100);
        assert_eq!(c.admission.max_queue, 2);
        assert_eq!(c.admission.max_queue_bytes, 6);
        assert_eq!(c.router.prefix.block_chars, 32);
        assert_eq!(c.router.prefix.max_blocks, 8);
        assert_eq!(c.router.prefix_index_blocks, 9);
        assert!(!c.router.calibrate);
        assert!(c.debug_header);
    }

    #[test]
    fn one_invalid_case_per_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"bogus":1}"#, "unknown field `bogus`"),
            (r#"{"picker":{"bogus":1}}"#, "unknown field `bogus`"),
            (
                r#"{"calibrate":"yes"}"#,
                "invalid type: string \"yes\", expected a boolean",
            ),
            (
                r#"{"prefix_index_blocks":-3}"#,
                "invalid value: integer `-3`",
            ),
            (r#"{"mode":"nope"}"#, "unknown variant `nope`"),
            (r#"{"cluster_header":"X Bad"}"#, "field `cluster_header`"),
            (r#"{"endpoint_header":""}"#, "field `endpoint_header`"),
            (
                r#"{"cluster_header":"content-length"}"#,
                "field `cluster_header` = content-length: must not be a framing, hop-by-hop, host or content header",
            ),
            (
                r#"{"mode":"endpoint","endpoint_header":"host"}"#,
                "field `endpoint_header` = host: must not be a framing",
            ),
            (
                r#"{"cluster_header":"x-envoy-upstream-rq-timeout-ms"}"#,
                "must not start with x-envoy-",
            ),
            (
                r#"{"cluster_header":"x-kvroute-decision"}"#,
                "field `cluster_header` = x-kvroute-decision: must not be x-kvroute-decision",
            ),
            (
                r#"{"cluster_header":"x-route","endpoint_header":"x-route"}"#,
                "field `endpoint_header` = x-route: must differ from cluster_header",
            ),
            (r#"{"max_body_bytes":0}"#, "field `max_body_bytes`"),
            (r#"{"ingest_path":"x"}"#, "field `ingest_path`"),
            (
                r#"{"role":"ingest","ingest_token":"short"}"#,
                "field `ingest_token`",
            ),
            (r#"{"ingest_max_bytes":0}"#, "field `ingest_max_bytes`"),
            (r#"{"queue_name":""}"#, "field `queue_name`"),
            (r#"{"reservation_ttl_ms":0}"#, "field `reservation_ttl_ms`"),
            (
                r#"{"inflight_share_ms":10001}"#,
                "field `inflight_share_ms`",
            ),
            (
                r#"{"admission":{"enabled":true,"max_queue":0}}"#,
                "field `admission.max_queue`",
            ),
            (
                r#"{"admission":{"enabled":true,"max_queue_bytes":0}}"#,
                "field `admission.max_queue_bytes`",
            ),
            (
                r#"{"admission":{"max_queue_bytes":-1}}"#,
                "invalid value: integer `-1`",
            ),
            (
                r#"{"admission":{"max_queue_bytes":1.5}}"#,
                "invalid type: floating point `1.5`",
            ),
            (
                r#"{"admission":{"max_queue_bytes":"8MiB"}}"#,
                "invalid type: string \"8MiB\"",
            ),
            (
                r#"{"admission":{"max_queue_bytes":null}}"#,
                "invalid type: null",
            ),
            (
                r#"{"admission":{"max_queue_byte":1}}"#,
                "unknown field `max_queue_byte`",
            ),
            (
                r#"{"admission":{"tick_ms":0}}"#,
                "field `admission.tick_ms`",
            ),
            (
                r#"{"admission":{"timeout_ms":300001}}"#,
                "field `admission.timeout_ms` = 300001: must be at most 300000 (5 minutes)",
            ),
            (r#"{"affinity_sync_ms":0}"#, "field `affinity_sync_ms`"),
            // Learner sharing alone still needs a sync period.
            (
                r#"{"share_affinity":false,"affinity_sync_ms":0}"#,
                "field `affinity_sync_ms`",
            ),
            (
                r#"{"affinity_journal_bytes":100}"#,
                "field `affinity_journal_bytes`",
            ),
            (
                r#"{"prefix":{"block_chars":0}}"#,
                "field `prefix.block_chars`",
            ),
            // Values that grew a worker's memory past what V8 allows (the VM trapped).
            (
                r#"{"prefix":{"block_chars":4294967295}}"#,
                "field `prefix.block_chars` = 4294967295: must be at most 65536",
            ),
            (
                r#"{"prefix":{"max_blocks":4294967295}}"#,
                "field `prefix.max_blocks` = 4294967295: must be at most 65536",
            ),
            (
                r#"{"prefix_index_total_blocks":4194305}"#,
                "field `prefix_index_total_blocks` = 4194305: must be at most 4194304",
            ),
            (
                r#"{"prefix_index_total_blocks":0}"#,
                "field `prefix_index_total_blocks` = 0: must be at least 1",
            ),
            (r#"{"max_body_bytes":-1}"#, "invalid value"),
            (
                r#"{"usage_tail_bytes":0}"#,
                "field `usage_tail_bytes` = 0: must be at least 1024",
            ),
            (
                r#"{"usage_tail_bytes":1023}"#,
                "field `usage_tail_bytes` = 1023: must be at least 1024",
            ),
            ("not json", "not valid JSON"),
            (r#"{"debug_header":true"#, "not valid JSON"),
        ];
        for (json, want) in cases {
            let err = Config::parse(json.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: got `{err}`, want `{want}`");
        }
    }

    /// Valid JSON with a typo or a wrong value is not called invalid JSON: the message
    /// names what serde rejected and where to look (a newcomer's `decison_record` was
    /// reported as "not valid JSON").
    #[test]
    fn valid_json_that_does_not_fit_names_the_field() {
        let cases = [
            (
                r#"{"debug_header":true,"decison_record":true}"#,
                "kvroute plugin config: unknown field `decison_record` at line 1 column 43 \
                 (fields and values: docs/filter.md, \"Configuration reference\")",
            ),
            (
                r#"{"debug_header":"yes"}"#,
                "kvroute plugin config: invalid type: string \"yes\", expected a boolean \
                 at line 1 column 21 (fields and values: docs/filter.md, \"Configuration reference\")",
            ),
            // serde_json calls this "expected value", a syntax error; it was reported as
            // "not valid JSON".
            (
                r#"{"mode":5}"#,
                "kvroute plugin config: expected value at line 1 column 9 (fields and values: \
                 docs/filter.md, \"Configuration reference\")",
            ),
        ];
        for (json, want) in cases {
            let err = Config::parse(json.as_bytes()).unwrap_err();
            assert!(matches!(err, ConfigError::Schema(_)), "{json}: {err:?}");
            assert_eq!(err.to_string(), want, "{json}");
        }
        // Not JSON at all: the syntax error, as documented in filter.md.
        assert_eq!(
            Config::parse(br#"{"debug_header":true"#)
                .unwrap_err()
                .to_string(),
            "kvroute plugin config is not valid JSON: EOF while parsing an object at line 1 column 20"
        );
        // An unknown policy (a nested, flattened key) says which values exist.
        let err = Config::parse(br#"{"picker":{"policy":"hybird"}}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("kvroute plugin config: unknown variant `hybird`, expected one of"),
            "{err}"
        );
        assert!(
            err.contains("`hybrid`") && err.contains("`predicted_ttft`"),
            "{err}"
        );
    }

    /// `admission.max_queue_bytes` 0 would refuse every parked body: with admission on it is
    /// a config error naming the field; with admission off nothing is held, so it is unused
    /// and accepted (as `max_queue` 0 is).
    #[test]
    fn max_queue_bytes_zero_is_an_error_only_when_enabled() {
        assert_eq!(
            Config::parse(br#"{"admission":{"enabled":true,"max_queue_bytes":0}}"#).unwrap_err(),
            ConfigError::Invalid {
                field: "admission.max_queue_bytes".into(),
                value: "0".into(),
                reason: "must be at least 1 when enabled",
            }
        );
        assert_eq!(
            Config::parse(br#"{"admission":{"enabled":true,"max_queue_bytes":0}}"#)
                .unwrap_err()
                .to_string(),
            "kvroute plugin config field `admission.max_queue_bytes` = 0: must be at least 1 when enabled"
        );
        let off = Config::parse(br#"{"admission":{"max_queue_bytes":0}}"#).unwrap();
        assert_eq!(off.admission.max_queue_bytes, 0);
        let one = Config::parse(br#"{"admission":{"enabled":true,"max_queue_bytes":1}}"#).unwrap();
        assert_eq!(one.admission.max_queue_bytes, 1);
    }

    #[test]
    fn token_is_never_echoed() {
        let err = Config::parse(br#"{"role":"ingest","ingest_token":"secret"}"#)
            .unwrap_err()
            .to_string();
        assert!(!err.contains("secret"), "{err}");
    }

    /// Every top-level key of docs/filter.md's configuration table is one the filter reads
    /// (a value of the wrong type is a type error, not an unknown field), and a key it does
    /// not list is refused as unknown. (`kvroute-cp --check` kept its own copy of these
    /// keys, held to the table; it now validates with this module.)
    #[test]
    fn documented_keys_are_the_filters() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/filter.md"))
                .unwrap();
        let table = doc.split("## Configuration reference").nth(1).unwrap();
        let documented: std::collections::BTreeSet<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with("| field |"))
            .skip(2)
            .take_while(|l| l.starts_with("| `"))
            .map(|l| l[3..].split('`').next().unwrap().split('.').next().unwrap())
            .collect();
        assert_eq!(documented.len(), 29, "{documented:?}");
        for key in &documented {
            // `-1.5` fits none of the fields (no top-level field is a float): each answers
            // with a type error naming its type.
            let Err(err) = Config::parse(format!(r#"{{"{key}":-1.5}}"#).as_bytes()) else {
                panic!("{key} took -1.5");
            };
            assert!(
                matches!(&err, ConfigError::Schema(m) if !m.contains("unknown field")),
                "{key}: {err}"
            );
        }
        let err = Config::parse(br#"{"undocumented":1}"#).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Schema(m) if m.contains("unknown field")),
            "{err}"
        );
    }
}
