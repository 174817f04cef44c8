//! Routing snapshot: the per-endpoint state the control plane publishes to every filter.
//!
//! Validation ([`Snapshot::validate`], run by [`Snapshot::decode`]) rejects an unknown
//! `format`, duplicate or empty ids, an address that is not `host:port` (IPv6 hosts in
//! brackets), `kv_usage` that is NaN, infinite, negative or above 1, and a zero block size.
//! Negative counts cannot be represented (unsigned fields) and fail decoding.
//!
//! Wire format: JSON (`serde_json`, already linked into the filter for body parsing), an
//! object `{"format": 1, "version": N, "generated_at_ms": T, "endpoints": [...]}`.
//! `format` is the schema version (decoders reject unknown ones); `version` is the
//! snapshot sequence number, increasing monotonically across control-plane restarts.

use serde::{Deserialize, Serialize};

/// Schema version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

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
        /// Endpoint id.
        id: String,
        /// Field name.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// Two endpoints share one id.
    #[error("duplicate endpoint id `{0}`")]
    DuplicateId(String),
}

impl Snapshot {
    /// An empty snapshot of the given version.
    pub fn new(version: u64, generated_at_ms: u64, endpoints: Vec<EndpointStats>) -> Self {
        Self {
            format: FORMAT_VERSION,
            version,
            generated_at_ms,
            endpoints,
        }
    }

    /// Encode to the wire format (JSON bytes).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decode and validate wire bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let snap: Snapshot =
            serde_json::from_slice(bytes).map_err(|e| SnapshotError::Decode(e.to_string()))?;
        snap.validate()?;
        Ok(snap)
    }

    /// Check the invariants: known format, no duplicate ids, finite non-negative numbers,
    /// `kv_usage` in 0..=1, non-empty id, `host:port` address, non-zero block size.
    /// Errors: the first violation found, in endpoint order.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.format != FORMAT_VERSION {
            return Err(SnapshotError::UnsupportedFormat { found: self.format });
        }
        let mut seen = std::collections::BTreeSet::new();
        for (index, e) in self.endpoints.iter().enumerate() {
            let bad = |field: &'static str, reason: &'static str| SnapshotError::InvalidEndpoint {
                index,
                id: e.id.clone(),
                field,
                reason,
            };
            if e.id.is_empty() {
                return Err(bad("id", "is empty"));
            }
            if e.address.is_empty() {
                return Err(bad("address", "is empty"));
            }
            if let Err(reason) = check_address(&e.address) {
                return Err(bad("address", reason));
            }
            // These strings end up in request headers (`x-kvroute-cluster`, debug header)
            // and metric labels: a control character (CR, LF, NUL...) could split a header.
            if has_control(&e.id) {
                return Err(bad("id", "contains a control character"));
            }
            if has_control(&e.cluster) {
                return Err(bad("cluster", "contains a control character"));
            }
            if has_control(&e.pool) {
                return Err(bad("pool", "contains a control character"));
            }
            if e.models.iter().any(|m| has_control(m)) {
                return Err(bad("models", "contains a control character"));
            }
            if e.lora_adapters.iter().any(|m| has_control(m)) {
                return Err(bad("lora_adapters", "contains a control character"));
            }
            if e.block_size == Some(0) {
                return Err(bad("block_size", "is zero"));
            }
            if let Some(u) = e.kv_usage {
                if !u.is_finite() {
                    return Err(bad("kv_usage", "is not a finite number"));
                }
                if u < 0.0 {
                    return Err(bad("kv_usage", "is negative"));
                }
                if u > 1.0 {
                    return Err(bad("kv_usage", "is greater than 1"));
                }
            }
            if !seen.insert(e.id.as_str()) {
                return Err(SnapshotError::DuplicateId(e.id.clone()));
            }
        }
        Ok(())
    }
}

/// True when `s` holds an ASCII or Unicode control character (CR, LF, NUL, DEL...).
fn has_control(s: &str) -> bool {
    s.chars().any(char::is_control)
}

/// Check a `host:port` address: a non-empty host, IPv6 literals in brackets
/// (`[::1]:8000`), a decimal port 1..=65535. Returns the reason on failure.
pub fn check_address(address: &str) -> Result<(), &'static str> {
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
