//! Endpoint picker.
//!
//! CONTRACT SKELETON (see `analysis.rs`). One file per policy goes beside this one
//! (`round_robin.rs`, `random.rs`, `least_request.rs`, `least_kv.rs`, `prefix_affinity.rs`,
//! `hybrid.rs`), each opening with a `//!` doc of its algorithm and defaults.

use crate::analysis::ApiKind;
use crate::snapshot::Snapshot;

/// Routing policy names (as written in config and in metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Rotate through eligible endpoints.
    RoundRobin,
    /// Uniformly random eligible endpoint.
    Random,
    /// Fewest running + waiting + in-flight requests.
    LeastRequest,
    /// Lowest KV usage after in-flight reservations.
    LeastKv,
    /// Longest prefix match, ties by load.
    PrefixAffinity,
    /// Weighted score of KV headroom, queue depth, in-flight tokens and prefix overlap.
    #[default]
    Hybrid,
}

impl PolicyKind {
    /// Static name used in config and metrics.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::LeastKv => "least_kv",
            PolicyKind::PrefixAffinity => "prefix_affinity",
            PolicyKind::Hybrid => "hybrid",
        }
    }
}

/// Weights of the `hybrid` score (each ≥ 0).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HybridWeights {
    /// Weight of KV headroom after this request (0..1).
    pub kv_headroom: f64,
    /// Weight of queue depth (waiting requests).
    pub queue: f64,
    /// Weight of router-local in-flight tokens.
    pub inflight: f64,
    /// Weight of prefix overlap (matched blocks / request blocks).
    pub prefix: f64,
}

impl Default for HybridWeights {
    fn default() -> Self {
        Self {
            kv_headroom: 1.0,
            queue: 1.0,
            inflight: 1.0,
            prefix: 2.0,
        }
    }
}

/// A request class mapped to a pool ("short Q&A", "long document", "multi-turn"...).
/// A request matches when every set bound holds; the first matching class wins.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestClass {
    /// Class name (metrics, debug header).
    pub name: String,
    /// Pool the class routes to.
    pub pool: String,
    /// Inclusive lower bound on estimated prompt tokens.
    pub min_prompt_tokens: Option<u64>,
    /// Exclusive upper bound on estimated prompt tokens.
    pub max_prompt_tokens: Option<u64>,
    /// Inclusive lower bound on the output limit (tokens).
    pub min_output_tokens: Option<u64>,
    /// Exclusive upper bound on the output limit (tokens).
    pub max_output_tokens: Option<u64>,
    /// Models this class applies to (empty = any).
    pub models: Vec<String>,
    /// APIs this class applies to (empty = any).
    pub apis: Vec<ApiKind>,
}

/// Picker configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PickerConfig {
    /// Policy in force.
    pub policy: PolicyKind,
    /// Stats older than this (milliseconds) are stale.
    pub stale_after_ms: u64,
    /// Required KV headroom after placing the request, as a 0..1 fraction of capacity.
    pub min_kv_headroom: f64,
    /// `hybrid` weights.
    pub weights: HybridWeights,
    /// Request classes, in match order.
    pub classes: Vec<RequestClass>,
    /// Number of fallbacks returned after the primary.
    pub max_fallbacks: usize,
}

impl Default for PickerConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Hybrid,
            stale_after_ms: 2_000,
            min_kv_headroom: 0.0,
            weights: HybridWeights::default(),
            classes: Vec::new(),
            max_fallbacks: 2,
        }
    }
}

/// Router-local load on one endpoint that the snapshot does not show yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct InFlight {
    /// Requests sent and not yet finished.
    pub requests: u32,
    /// Their reserved KV demand, tokens.
    pub tokens: u64,
}

/// The request side of a decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickRequest<'a> {
    /// Requested model, if any.
    pub model: Option<&'a str>,
    /// API of the request.
    pub api: ApiKind,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Output limit, tokens.
    pub output_limit: u64,
    /// KV demand, tokens (prompt + expected output).
    pub demand_tokens: u64,
    /// Number of prefix blocks of the request (length of its hash chain).
    pub prefix_blocks: u32,
}

/// The fleet side of a decision. Slices are aligned with `snapshot.endpoints`
/// (an empty slice means "all zero").
#[derive(Debug, Clone, Copy)]
pub struct PickInput<'a> {
    /// Current snapshot.
    pub snapshot: &'a Snapshot,
    /// Router-local reservations per endpoint.
    pub inflight: &'a [InFlight],
    /// Prefix blocks of this request already sent to each endpoint.
    pub prefix_match_blocks: &'a [u32],
    /// Now, Unix milliseconds.
    pub now_ms: u64,
}

/// Why the primary was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PickReason {
    /// The configured policy chose among fresh, healthy endpoints.
    Policy,
    /// No endpoint had fresh stats: least-request over the known endpoints.
    StaleFallback,
}

/// A successful decision. Indices point into `snapshot.endpoints`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// Chosen endpoint.
    pub primary: usize,
    /// Ordered fallbacks (distinct, excluding `primary`).
    pub fallbacks: Vec<usize>,
    /// Policy that decided.
    pub policy: PolicyKind,
    /// Why.
    pub reason: PickReason,
    /// Request class matched, if any.
    pub class: Option<String>,
}

/// Result of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickOutcome {
    /// Route to `primary`, then the fallbacks.
    Picked(Pick),
    /// Endpoints exist but none has KV headroom for this request (caller answers 429 or queues).
    NoCapacity,
    /// No endpoint serves this request (caller answers 503).
    NoEndpoints,
}

/// Picker configuration errors, naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("picker config field `{field}` = {value}: {reason}")]
pub struct ConfigError {
    /// Field path.
    pub field: String,
    /// Offending value, rendered.
    pub value: String,
    /// What is wrong.
    pub reason: &'static str,
}

/// Stateful picker (round-robin cursor, seeded RNG for tie-breaks).
#[derive(Debug)]
pub struct Picker {
    config: PickerConfig,
    rng: fastrand::Rng,
    cursor: usize,
}

impl Picker {
    /// Validate `config` and build a picker whose random choices come from `seed`.
    pub fn new(config: PickerConfig, seed: u64) -> Result<Self, ConfigError> {
        Ok(Self {
            config,
            rng: fastrand::Rng::with_seed(seed),
            cursor: 0,
        })
    }

    /// Configuration in force.
    pub fn config(&self) -> &PickerConfig {
        &self.config
    }

    /// Choose an endpoint for `req`.
    pub fn pick(&mut self, input: &PickInput<'_>, req: &PickRequest<'_>) -> PickOutcome {
        let _ = (input, req, &mut self.rng, self.cursor);
        PickOutcome::NoEndpoints
    }
}
