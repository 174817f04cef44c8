//! Routing snapshot: the per-endpoint state the control plane publishes to every filter.
//!
//! Validation ([`Snapshot::validate`], run by [`Snapshot::decode`]) rejects an unknown
//! `format`, duplicate or empty ids, an empty cluster, an address that is not `host:port`
//! (IPv6 hosts in brackets), a control character in any name, `kv_usage` that is NaN, infinite, negative or above 1, a zero block size, an
//! empty or control-character name in `unavailable_models`, and any name or address longer
//! than [`MAX_LABEL_BYTES`].
//! Negative counts cannot be represented (unsigned fields) and fail decoding.
//!
//! Wire format: JSON (`serde_json`, already linked into the filter for body parsing), an
//! object `{"format": 1, "version": N, "generated_at_ms": T, "endpoints": [...]}`, with
//! `"unavailable_models": [...]` before `endpoints` when that list is not empty.
//! `format` is the schema version (decoders reject unknown ones); `version` is the
//! snapshot sequence number, increasing monotonically across control-plane restarts.
//!
//! Compatibility: both structs reject unknown fields (`deny_unknown_fields`), so a field
//! added within `format` 1 is optional, defaulted, and left off the wire while it holds its
//! default (`peer_inflight_*` at 0, `unavailable_models` empty). A snapshot that carries
//! one is rejected (400 `invalid_snapshot`) by a filter built before the field existed:
//! upgrade the filters before the control plane.
//! Writers that keep each endpoint's encoded form between snapshots (the control plane's
//! hub) build a body from [`encode_endpoint`] fragments and [`write_envelope`]; those are
//! what [`Snapshot::encode`] itself uses, so both give the same bytes.
//!
//! Transport ([`INGEST_PATH`], [`AUTH_SCHEME`]): the control plane `POST`s the body to the
//! filter's ingest listener with `Authorization: Bearer <token>`; both sides use these
//! constants.

use serde::{Deserialize, Serialize};

/// Schema version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Default path of the filter's snapshot ingest route (`POST`).
pub const INGEST_PATH: &str = "/kvroute/v1/snapshot";

/// Authorization scheme of the ingest route, with its separating space
/// (`Authorization: Bearer <token>`, RFC 6750 §2.1).
pub const AUTH_SCHEME: &str = "Bearer ";

/// Append the wire form of one endpoint (a JSON object, `serde_json`'s compact form, fields
/// in declaration order) to `out`. Non-finite floats are written as `null`.
pub fn encode_endpoint(endpoint: &EndpointStats, out: &mut Vec<u8>) {
    let start = out.len();
    // Writing into a Vec cannot fail for this type; on the (unreachable) error leave nothing.
    if serde_json::to_writer(&mut *out, endpoint).is_err() {
        out.truncate(start);
    }
}

/// Write a snapshot body around already-encoded endpoint `fragments` (each from
/// [`encode_endpoint`]): `{"format":1,"version":V,"generated_at_ms":T,"endpoints":[f1,f2,...]}`,
/// with `"unavailable_models":[...],` before `"endpoints"` when `unavailable_models` is not
/// empty ([`Snapshot::unavailable_models`]). The endpoints array is always the last member,
/// so the body ends with the last fragment followed by `]}`.
pub fn write_envelope<'a>(
    out: &mut Vec<u8>,
    version: u64,
    generated_at_ms: u64,
    unavailable_models: &[String],
    fragments: impl Iterator<Item = &'a [u8]>,
) {
    envelope(
        out,
        FORMAT_VERSION,
        version,
        generated_at_ms,
        unavailable_models,
        fragments,
    );
}

fn envelope<'a>(
    out: &mut Vec<u8>,
    format: u32,
    version: u64,
    generated_at_ms: u64,
    unavailable_models: &[String],
    fragments: impl Iterator<Item = &'a [u8]>,
) {
    use std::io::Write as _;
    // Writing into a Vec cannot fail.
    let _ = write!(
        out,
        "{{\"format\":{format},\"version\":{version},\"generated_at_ms\":{generated_at_ms},"
    );
    if !unavailable_models.is_empty() {
        out.extend_from_slice(b"\"unavailable_models\":");
        let start = out.len();
        // A string slice always encodes; on the (unreachable) error write an empty list.
        if serde_json::to_writer(&mut *out, unavailable_models).is_err() {
            out.truncate(start);
            out.extend_from_slice(b"[]");
        }
        out.push(b',');
    }
    out.extend_from_slice(b"\"endpoints\":[");
    for (i, f) in fragments.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(f);
    }
    out.extend_from_slice(b"]}");
}

/// A body as [`write_envelope`] writes it, with its `generated_at_ms` replaced by `at_ms`
/// (the rest byte for byte): for a sender whose snapshot waited before it went out (a
/// push retried after a failure), so that the receiver, which measures the sender's clock
/// offset from `generated_at_ms` ([`Snapshot::rebase_clock`]), measures it at sending and
/// the waiting does not make every scrape look that much younger. `None` when `body` does
/// not open as [`write_envelope`] writes it. One copy of the body.
pub fn restamp(body: &[u8], at_ms: u64) -> Option<Vec<u8>> {
    use std::io::Write as _;
    const KEY: &[u8] = b"\"generated_at_ms\":";
    // `{"format":F,"version":V,` comes first: the key is within the first 64 bytes.
    let head = body.get(..body.len().min(64))?;
    let start = memchr::memmem::find(head, KEY)? + KEY.len();
    let digits = body
        .get(start..)?
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if digits == 0 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(body.get(..start)?);
    // Writing into a Vec cannot fail.
    let _ = write!(out, "{at_ms}");
    out.extend_from_slice(body.get(start + digits..)?);
    Some(out)
}

/// One snapshot of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Schema version; must equal [`FORMAT_VERSION`].
    pub format: u32,
    /// Monotonic sequence number; receivers ignore snapshots not newer than their current one.
    pub version: u64,
    /// When the control plane built the snapshot, Unix milliseconds.
    pub generated_at_ms: u64,
    /// Model names (base models, as a client sends them in `model`) that a configured pool
    /// serves but that no endpoint of this snapshot lists, healthy or not: the pool has no
    /// ready pod now (rollout, crash loop, scale from zero; kvroute-cp's hub fills it). The
    /// router treats them as known models with no endpoint, so a request for one is answered
    /// 503 `no_healthy_endpoint` with `retry-after` (which OpenAI clients retry) rather than
    /// 404 `model_not_found` (which they do not). Sorted, no duplicates when kvroute-cp
    /// writes it. Empty by default and then left off the wire, so the snapshots of a fleet
    /// whose every pool has endpoints are unchanged (see the module doc on compatibility).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unavailable_models: Vec<String>,
    /// All known endpoints.
    pub endpoints: Vec<EndpointStats>,
}

/// One model-server endpoint as last scraped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointStats {
    /// Stable unique id (e.g. `pool/pod-name`).
    pub id: String,
    /// Serving address `host:port`; IPv6 hosts in brackets (`[::1]:8000`).
    pub address: String,
    /// Envoy cluster that reaches this endpoint (cluster routing mode).
    pub cluster: String,
    /// Pool (InferencePool) name.
    pub pool: String,
    /// Base models served.
    pub models: Vec<String>,
    /// LoRA adapters currently loaded.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// KV cache usage, 0..1; `None` when the server exposes no usable signal.
    pub kv_usage: Option<f64>,
    /// KV cache capacity in tokens (`num_gpu_blocks × block_size`); `None` when unknown.
    pub kv_capacity_tokens: Option<u64>,
    /// KV cache block size in tokens; `None` when unknown.
    pub block_size: Option<u32>,
    /// Requests running (in the batch).
    pub running: u32,
    /// Requests waiting (queued).
    pub waiting: u32,
    /// Last scrape succeeded and the server reports healthy.
    pub healthy: bool,
    /// When these stats were scraped, Unix milliseconds.
    pub scraped_at_ms: u64,
    /// Model-server process start time, Unix milliseconds; a change means a restart
    /// (its prefix cache is cold).
    pub process_start_ms: Option<u64>,
    /// Requests the *other* gateway replicas sent here that this endpoint's scrape does not
    /// show yet (their unseen in-flight load, merged by the control plane:
    /// [`crate::peer`]). The picker counts them like its own in-flight requests. 0 (and
    /// left off the wire) when gateways do not share load.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub peer_inflight_requests: u32,
    /// KV demand of those requests, tokens (their reservations); counted like the picker's
    /// own reserved tokens against KV headroom. 0 (and left off the wire) when not shared.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub peer_inflight_tokens: u64,
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

#[cfg(any(test, feature = "testing"))]
impl EndpointStats {
    /// A test endpoint: `pool/e{i}` at `127.0.0.1:{9000 + i}`, cluster `c{i}`, pool `pool`,
    /// serving model `m`, healthy and idle, KV usage 0.1 of 100,000 tokens in 16-token
    /// blocks, scraped at `scraped_at_ms`, no process start. Tests change fields with
    /// struct update syntax. Only with `cfg(test)` or the `testing` feature.
    pub fn fixture(i: usize, scraped_at_ms: u64) -> Self {
        Self {
            id: format!("pool/e{i}"),
            address: format!("127.0.0.1:{}", 9000 + i),
            cluster: format!("c{i}"),
            pool: "pool".into(),
            models: vec!["m".into()],
            lora_adapters: vec![],
            kv_usage: Some(0.1),
            kv_capacity_tokens: Some(100_000),
            block_size: Some(16),
            running: 0,
            waiting: 0,
            healthy: true,
            scraped_at_ms,
            process_start_ms: None,
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        }
    }
}

/// Why a snapshot was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SnapshotError {
    /// Not decodable as the wire format.
    #[error("snapshot is not valid: {0}")]
    Decode(String),
    /// Unknown schema version.
    #[error("unsupported snapshot format {found} (this build reads {FORMAT_VERSION})")]
    UnsupportedFormat {
        /// Version found.
        found: u32,
    },
    /// A field of an endpoint is invalid.
    #[error("endpoint {index} (`{id}`): field `{field}` {reason}")]
    InvalidEndpoint {
        /// Index in `endpoints`.
        index: usize,
        /// Endpoint id as the message quotes it: whole up to
        /// [`crate::echo::ECHO_MAX_BYTES`], else cut with its length ([`crate::echo::echo`]).
        id: String,
        /// Field name.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// Two endpoints share one id (quoted as [`Self::InvalidEndpoint`]'s `id` is).
    #[error("duplicate endpoint id `{0}`")]
    DuplicateId(String),
    /// A name in `unavailable_models` is invalid.
    #[error("unavailable_models[{index}]: {reason}")]
    InvalidUnavailableModel {
        /// Index in `unavailable_models`.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Longest decode error message [`Snapshot::decode`] keeps, in bytes (serde_json's
/// messages are short; this bounds the names and values they quote from the body).
pub const DECODE_DETAIL_MAX_BYTES: usize = 2048;

impl Snapshot {
    /// A snapshot of the given version with `endpoints` and no `unavailable_models`.
    pub fn new(version: u64, generated_at_ms: u64, endpoints: Vec<EndpointStats>) -> Self {
        Self {
            format: FORMAT_VERSION,
            version,
            generated_at_ms,
            unavailable_models: Vec::new(),
            endpoints,
        }
    }

    /// Encode to the wire format (JSON bytes): the [`write_envelope`] layout around one
    /// [`encode_endpoint`] fragment per endpoint.
    pub fn encode(&self) -> Vec<u8> {
        let mut fragments: Vec<Vec<u8>> = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let mut f = Vec::with_capacity(256);
            encode_endpoint(e, &mut f);
            fragments.push(f);
        }
        let len: usize = fragments.iter().map(|f| f.len() + 1).sum();
        let models: usize = self.unavailable_models.iter().map(|m| m.len() + 3).sum();
        let mut out = Vec::with_capacity(len + models + 96);
        envelope(
            &mut out,
            self.format,
            self.version,
            self.generated_at_ms,
            &self.unavailable_models,
            fragments.iter().map(Vec::as_slice),
        );
        out
    }

    /// Move the snapshot's times from the control plane's clock to the receiver's: the
    /// snapshot was received at `received_at_ms` (the receiver's Unix ms), so
    /// `generated_at_ms` becomes that and every endpoint's `scraped_at_ms` moves by the same
    /// offset (saturating at 0), capped at `received_at_ms` (no scrape is newer than its
    /// snapshot). Ages are then measured on one clock: staleness (`stale_after_ms`) and
    /// whether a scrape already saw a reservation (`reserved_at_ms < scraped_at_ms`,
    /// [`crate::inflight`]) compare the receiver's own times. Without it a control plane
    /// whose clock ran 1 s ahead of Envoy's made every reservation look seen by the last
    /// scrape (all load went to the least-loaded endpoint), and one far ahead made its stats
    /// never stale. The offset also absorbs the push's transit time (milliseconds), by which
    /// the scrapes look that much younger. Idempotent for a given `received_at_ms`.
    pub fn rebase_clock(&mut self, received_at_ms: u64) {
        let (from, to) = (self.generated_at_ms, received_at_ms);
        for e in &mut self.endpoints {
            let at = match to >= from {
                true => e.scraped_at_ms.saturating_add(to - from),
                false => e.scraped_at_ms.saturating_sub(from - to),
            };
            e.scraped_at_ms = at.min(to);
        }
        self.generated_at_ms = to;
    }

    /// Decode and validate wire bytes. A decode error's message is serde_json's, bounded to
    /// [`DECODE_DETAIL_MAX_BYTES`] ([`crate::echo::echo_within`]): it quotes names and
    /// values from the body (`invalid type: string "…"`), which could be megabytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let snap: Snapshot = serde_json::from_slice(bytes).map_err(|e| {
            SnapshotError::Decode(
                crate::echo::echo_within(&e.to_string(), DECODE_DETAIL_MAX_BYTES).into_owned(),
            )
        })?;
        snap.validate()?;
        Ok(snap)
    }

    /// Check the invariants: known format, no duplicate ids, finite non-negative numbers,
    /// `kv_usage` in 0..=1, each endpoint's own checks ([`EndpointStats::validate`]), and
    /// `unavailable_models` names non-empty without control characters and at most
    /// [`MAX_LABEL_BYTES`] ([`check_label`]: they are named in replies and logs like the
    /// endpoints' models).
    /// Errors: the first violation found: format, then `unavailable_models`, then endpoints
    /// in order.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.format != FORMAT_VERSION {
            return Err(SnapshotError::UnsupportedFormat { found: self.format });
        }
        for (index, m) in self.unavailable_models.iter().enumerate() {
            let checked = if m.is_empty() {
                Err("is empty")
            } else {
                check_label(m)
            };
            if let Err(reason) = checked {
                return Err(SnapshotError::InvalidUnavailableModel { index, reason });
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (index, e) in self.endpoints.iter().enumerate() {
            if let Err((field, reason)) = e.validate() {
                return Err(SnapshotError::InvalidEndpoint {
                    index,
                    id: crate::echo::echo(&e.id).into_owned(),
                    field,
                    reason,
                });
            }
            if !seen.insert(e.id.as_str()) {
                return Err(SnapshotError::DuplicateId(
                    crate::echo::echo(&e.id).into_owned(),
                ));
            }
        }
        Ok(())
    }
}

impl EndpointStats {
    /// Check one endpoint's invariants: non-empty id, address and cluster, `host:port` address
    /// ([`check_address`]), no control character in id, cluster, pool, models or LoRA
    /// adapters ([`check_label`]), non-zero block size, `kv_usage` finite and in 0..=1.
    /// The control plane's config and adapters use the same checks.
    ///
    /// Errors: the first violation as `(field, reason)`.
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if self.id.is_empty() {
            return Err(("id", "is empty"));
        }
        if self.address.is_empty() {
            return Err(("address", "is empty"));
        }
        // Cluster mode routes by it: an empty name sent requests to Envoy's bare 503
        // (found by a breaker; kvroute-cp never writes one).
        if self.cluster.is_empty() {
            return Err(("cluster", "is empty"));
        }
        check_address(&self.address).map_err(|r| ("address", r))?;
        check_label(&self.id).map_err(|r| ("id", r))?;
        check_label(&self.cluster).map_err(|r| ("cluster", r))?;
        check_label(&self.pool).map_err(|r| ("pool", r))?;
        for m in &self.models {
            check_label(m).map_err(|r| ("models", r))?;
        }
        for m in &self.lora_adapters {
            check_label(m).map_err(|r| ("lora_adapters", r))?;
        }
        if self.block_size == Some(0) {
            return Err(("block_size", "is zero"));
        }
        if let Some(u) = self.kv_usage {
            if !u.is_finite() {
                return Err(("kv_usage", "is not a finite number"));
            }
            if u < 0.0 {
                return Err(("kv_usage", "is negative"));
            }
            if u > 1.0 {
                return Err(("kv_usage", "is greater than 1"));
            }
        }
        Ok(())
    }
}

/// Longest name or address a snapshot accepts, bytes: `id`, `address`, `cluster`, `pool`,
/// each model and LoRA adapter, each of `unavailable_models`. These end up in request
/// headers and metric labels, so an unbounded one (a 200 KiB id) would make every routed
/// request's headers that large. 1,024 holds any name Kubernetes can make: object names
/// are at most 253 bytes (DNS subdomain,
/// <https://kubernetes.io/docs/concepts/overview/working-with-objects/names/>), so a
/// discovered id `pool/pod:port` is at most 513.
pub const MAX_LABEL_BYTES: usize = 1024;

/// Check a name that ends up in request headers (`x-kvroute-cluster`, the decision header)
/// and metric labels: it must not hold a control character (CR, LF, NUL, DEL...), which
/// could split a header, nor be longer than [`MAX_LABEL_BYTES`]. Returns the reason on
/// failure.
pub fn check_label(s: &str) -> Result<(), &'static str> {
    if s.len() > MAX_LABEL_BYTES {
        Err("is longer than 1024 bytes")
    } else if s.chars().any(char::is_control) {
        Err("contains a control character")
    } else {
        Ok(())
    }
}

/// Check a `host:port` address: at most [`MAX_LABEL_BYTES`], a non-empty host, IPv6
/// literals in brackets (`[::1]:8000`), a decimal port 1..=65535. Returns the reason on
/// failure.
pub fn check_address(address: &str) -> Result<(), &'static str> {
    if address.len() > MAX_LABEL_BYTES {
        return Err("is longer than 1024 bytes");
    }
    let (host, port) = if let Some(rest) = address.strip_prefix('[') {
        let Some((host, port)) = rest.split_once("]:") else {
            return Err("is not `[ipv6]:port`");
        };
        if host.is_empty() || !host.contains(':') {
            return Err("has an empty or non-IPv6 bracketed host");
        }
        (host, port)
    } else {
        let Some((host, port)) = address.rsplit_once(':') else {
            return Err("has no `:port`");
        };
        if host.contains(':') {
            return Err("has an IPv6 host without brackets");
        }
        (host, port)
    };
    if host.is_empty() {
        return Err("has an empty host");
    }
    if host
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '/')
    {
        return Err("has an invalid host");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err("has an invalid port (expected 1..=65535)"),
    }
}
