//! Endpoint picker.
//!
//! One decision ([`Picker::pick`]) runs in four steps over a [`Snapshot`] plus router-local
//! in-flight reservations ([`InFlight`]) and per-endpoint prefix matches:
//!
//! 1. **Class → pool.** The first [`RequestClass`] whose bounds all hold (estimated prompt
//!    tokens, output limit, model, API) restricts candidates to its pool ("short Q&A",
//!    "long document", "multi-turn" instance groups). If that pool has no healthy endpoint
//!    serving the model, the restriction is dropped rather than failing the request.
//! 2. **Filters.** Candidates serve the model (base model or loaded LoRA adapter) and are
//!    healthy. None → [`PickOutcome::NoEndpoints`] (the caller answers 503). Among them,
//!    *fresh* endpoints have stats younger than `stale_after_ms` (default 2 s: a few scrape
//!    intervals of the control plane). If none is fresh, the least-loaded stale candidate is
//!    used ([`PickReason::StaleFallback`]) so a control-plane outage does not take the
//!    gateway down. Fresh endpoints must then have KV headroom:
//!    `capacity × (1 − usage) − in-flight tokens − demand ≥ min_kv_headroom × capacity`
//!    (endpoints with unknown usage or capacity pass). Fresh endpoints exist but none fits →
//!    [`PickOutcome::NoCapacity`] (429). A stale or unhealthy endpoint is therefore never
//!    chosen while a fresh, healthy one can serve.
//! 3. **Policy.** The configured [`PolicyKind`] ranks the eligible endpoints (one file per
//!    policy: `round_robin.rs`, `random.rs`, `least_request.rs`, `least_kv.rs`,
//!    `prefix_affinity.rs`, `hybrid.rs`, `predicted_ttft.rs`; each documents its algorithm). Ranking keys are a
//!    primary cost, a secondary cost and a random tie-break drawn from the picker's seeded
//!    `fastrand::Rng`, so equal endpoints share load evenly.
//! 4. **Output.** The best endpoint is the primary; the next `max_fallbacks` (default 2) are
//!    ordered fallbacks for retries.
//!
//! The picker reuses one scratch buffer, so a decision allocates only its result
//! (the fallback vector and class name).

use crate::analysis::ApiKind;
pub use crate::inflight::InFlight;
use crate::prefill_rate::PrefillRates;
use crate::snapshot::{EndpointStats, Snapshot};

mod hybrid;
mod least_kv;
mod least_request;
pub mod predicted_ttft;
mod prefix_affinity;
mod random;
mod round_robin;

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
    /// Weighted score of KV headroom, queue depth, in-flight tokens, predicted prefill work
    /// and prefix overlap.
    #[default]
    Hybrid,
    /// Lowest predicted time to first token, in seconds, from pending prefill, cached prefix,
    /// KV shortfall, decode interference and a learned per-endpoint prefill throughput.
    PredictedTtft,
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
            PolicyKind::PredictedTtft => "predicted_ttft",
        }
    }
}

/// Largest `hybrid` weight accepted. Only the weights' ratios matter; with every term in
/// 0..1 the score stays at most 5 × this, finite and printable in decision records. A
/// breaker's weights of 1e308 overflowed the score to infinity, and ties among infinite
/// scores sent requests to the fuller endpoint.
pub const MAX_WEIGHT: f64 = 1e6;

/// Smallest `latency.seed_prefill_tokens_per_s` accepted, tokens/s. Below it a predicted
/// TTFT (tokens ÷ rate) overflows to infinity for every candidate (a breaker's 1e-320 made
/// every score −∞); no model server prefills slower than a token a second.
pub const MIN_SEED_PREFILL_TOKENS_PER_S: f64 = 1.0;

/// Weights of the `hybrid` score (each in 0..=[`MAX_WEIGHT`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HybridWeights {
    /// Weight of KV headroom after this request (0..1).
    pub kv_headroom: f64,
    /// Weight of queue depth (waiting requests).
    pub queue: f64,
    /// Weight of router-local in-flight tokens (reserved KV demand the snapshot does not
    /// show yet).
    pub inflight: f64,
    /// Weight of predicted prefill work, 0..1 term (router-tracked pending prefill tokens
    /// plus this request's uncached prompt tokens, over the largest among the candidates;
    /// see `hybrid.rs`). Absent in older configs: takes the default, 2.
    pub prefill: f64,
    /// Weight of prefix overlap (matched blocks / request blocks).
    pub prefix: f64,
}

impl Default for HybridWeights {
    fn default() -> Self {
        Self {
            kv_headroom: 1.0,
            queue: 1.0,
            inflight: 1.0,
            prefill: 2.0,
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
    /// `predicted_ttft` engine model.
    pub latency: LatencyConfig,
}

/// Engine model of the `predicted_ttft` policy (see `picker/predicted_ttft.rs`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LatencyConfig {
    /// Engine step token budget (`max_num_batched_tokens`), tokens (≥ 1); default 8 192,
    /// vLLM's default for online serving.
    pub step_token_budget: u32,
    /// Prefill throughput assumed before any observation, tokens/s (> 0); default 15 928,
    /// llm-d's `peakPrefillThroughput` (see [`crate::prefill_rate`]). A model profile's
    /// measured value belongs here.
    pub seed_prefill_tokens_per_s: f64,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        Self {
            step_token_budget: predicted_ttft::DEFAULT_STEP_TOKEN_BUDGET,
            seed_prefill_tokens_per_s: crate::prefill_rate::DEFAULT_PREFILL_TOKENS_PER_S,
        }
    }
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
            latency: LatencyConfig::default(),
        }
    }
}

/// Prompt tokens of a request that an endpoint is expected to compute, in tokens:
/// `prompt_tokens × (request_blocks − matched_blocks) / request_blocks` (rounded up), i.e.
/// the prompt minus the share of its prefix blocks the router's prefix index expects cached
/// there. `request_blocks = 0` (no prefix information) means nothing is cached; a match
/// longer than the request counts as the whole request. Used for
/// [`InFlight::prefill_tokens`] at reservation time and by the `hybrid` prefill-work term.
pub fn uncached_prompt_tokens(prompt_tokens: u64, matched_blocks: u32, request_blocks: u32) -> u64 {
    if request_blocks == 0 {
        return prompt_tokens;
    }
    let missing = request_blocks.saturating_sub(matched_blocks);
    // In `u64` whenever the product fits (every prompt under 2³² tokens): a `u128`
    // division is a software routine on wasm32 (`__udivti3`, hundreds of operations), and
    // the hybrid policy takes this twice per candidate.
    match prompt_tokens.checked_mul(u64::from(missing)) {
        Some(p) => p.div_ceil(u64::from(request_blocks)),
        None => {
            let v = (u128::from(prompt_tokens) * u128::from(missing))
                .div_ceil(u128::from(request_blocks));
            u64::try_from(v).unwrap_or(u64::MAX)
        }
    }
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
    /// Router-local load per endpoint: reservations made since that endpoint's scrape, plus
    /// the pending prefill tokens of all its in-flight requests
    /// ([`crate::inflight::InflightTable::unseen_totals`]).
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

/// Candidates kept in a decision record when explaining ([`Picker::set_explain`]).
pub const EXPLAIN_TOP: usize = 3;

/// One of the best-ranked candidates of a decision, for the decision record
/// ([`Picker::set_explain`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Explained {
    /// Index into `snapshot.endpoints`.
    pub index: usize,
    /// The policy's score, higher is better: the negated ranking cost. For `hybrid` the sum
    /// of `terms` (0..8 with the default weights); for `predicted_ttft` minus the predicted
    /// TTFT in seconds; for `least_request` minus the load in requests; for `least_kv` minus
    /// the projected KV usage (0..1).
    pub score: f64,
    /// `hybrid`'s weighted terms, in order KV headroom, queue, in-flight, prefill work,
    /// prefix (each weight × a 0..1 term, see the `hybrid` policy module); `None` for other policies.
    pub terms: Option<[f64; 5]>,
    /// Prefix blocks of the request matched there.
    pub prefix_blocks: u32,
    /// Running + waiting + router in-flight requests there.
    pub load: u64,
}

/// A successful decision. Indices point into `snapshot.endpoints`.
#[derive(Debug, Clone, PartialEq)]
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
    /// The best [`EXPLAIN_TOP`] candidates in rank order (the primary first), only while
    /// explaining ([`Picker::set_explain`]); empty otherwise.
    pub top: Vec<Explained>,
}

/// Result of a decision.
#[derive(Debug, Clone, PartialEq)]
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
    rates: PrefillRates,
    rng: fastrand::Rng,
    cursor: usize,
    scratch: Vec<Candidate>,
    explain: bool,
}

/// One eligible endpoint during a decision, with its ranking keys.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Candidate {
    /// Index into `snapshot.endpoints`.
    pub index: usize,
    /// Running + waiting + router in-flight requests.
    pub load: u64,
    /// Waiting requests (queue depth).
    pub waiting: u32,
    /// Router-local in-flight reservation.
    pub inflight: InFlight,
    /// Projected usage 0..1+ including in-flight tokens (not this request).
    pub projected_usage: Option<f64>,
    /// Fraction of capacity left after in-flight tokens and this request (may be < 0).
    pub headroom_after: Option<f64>,
    /// Prefix blocks of this request already routed here.
    pub prefix_blocks: u32,
    /// Primary ranking key (lower is better).
    pub cost: f64,
    /// Secondary ranking key (lower is better).
    pub cost2: f64,
    /// Random tie-break.
    pub tie: u64,
    /// `hybrid`'s weighted terms (see [`Explained::terms`]).
    pub terms: Option<[f64; 5]>,
}

/// Move the best `keep` candidates (by [`rank_cmp`]) to the front, in rank order.
///
/// For the usual `keep` (`max_fallbacks + 1`, 3 by default) this is a partial selection
/// sort: `keep` passes that each swap one candidate into place, 42 comparisons and 3 swaps
/// for 16 endpoints. `select_nth_unstable_by` and a sort moved candidates to and fro
/// through their small-slice insertion sort: 4.6 k of the 51 k instructions of a 1 KiB
/// decision with 16 endpoints (native, callgrind, 2026-12-01). Larger `keep` (many fallbacks,
/// or `explain`) keeps the O(n) selection. The order is the same either way: `rank_cmp`
/// ends in the per-candidate tie-break, so no two candidates compare equal.
fn rank_top(cands: &mut [Candidate], keep: usize) {
    const SELECTION_MAX: usize = 8;
    if keep <= SELECTION_MAX {
        for j in 0..keep {
            let best = cands
                .get(j..)
                .and_then(|rest| rest.iter().enumerate().min_by(|a, b| rank_cmp(a.1, b.1)))
                .map(|(i, _)| i + j);
            if let Some(m) = best {
                cands.swap(j, m);
            }
        }
        return;
    }
    if keep < cands.len() {
        cands.select_nth_unstable_by(keep - 1, rank_cmp);
    }
    if let Some(ranked) = cands.get_mut(..keep) {
        ranked.sort_unstable_by(rank_cmp);
    }
}

fn rank_cmp(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    a.cost
        .total_cmp(&b.cost)
        .then(a.cost2.total_cmp(&b.cost2))
        .then(a.tie.cmp(&b.tie))
}

fn serves(e: &EndpointStats, model: Option<&str>) -> bool {
    match model {
        None => true,
        Some(m) => e
            .models
            .iter()
            .chain(&e.lora_adapters)
            .any(|x| same_name(x, m)),
    }
}

/// `a == b`, eight bytes per step: the crate's comparison of names on the request path
/// (the picker's model names, the prefix index's endpoint ids). On wasm32 a string `==`
/// calls wasi-libc's `memcmp`, a loop of ~10 operations per byte: comparing each
/// endpoint's model with a 32-byte model name was a third of `Picker::pick` (16
/// endpoints: ~11 k of ~35 k Wasm operations, fuel-counted; docs/overhead.md).
#[inline]
pub(crate) fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let (mut a, mut b) = (a, b);
    while let (Some((x, ra)), Some((y, rb))) =
        (a.split_first_chunk::<8>(), b.split_first_chunk::<8>())
    {
        if u64::from_ne_bytes(*x) != u64::from_ne_bytes(*y) {
            return false;
        }
        (a, b) = (ra, rb);
    }
    a.iter().zip(b).all(|(x, y)| x == y)
}

impl RequestClass {
    /// True when every set bound of this class holds for `req`.
    pub fn matches(&self, req: &PickRequest<'_>) -> bool {
        let within = |v: u64, lo: Option<u64>, hi: Option<u64>| {
            lo.is_none_or(|lo| v >= lo) && hi.is_none_or(|hi| v < hi)
        };
        within(
            req.prompt_tokens,
            self.min_prompt_tokens,
            self.max_prompt_tokens,
        ) && within(
            req.output_limit,
            self.min_output_tokens,
            self.max_output_tokens,
        ) && (self.models.is_empty()
            || req
                .model
                .is_some_and(|m| self.models.iter().any(|x| same_name(x, m))))
            && (self.apis.is_empty() || self.apis.contains(&req.api))
    }
}

/// A number as a config error shows it: in exponent form when plain digits would run long
/// (a breaker's `1e308` came back as 309 digits).
fn shown(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-6..1e15).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

impl PickerConfig {
    /// Check every field; the error names the field, its value and the reason.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field: String, value: String, reason: &'static str| {
            Err(ConfigError {
                field,
                value,
                reason,
            })
        };
        if self.stale_after_ms == 0 {
            return err("stale_after_ms".into(), "0".into(), "must be at least 1");
        }
        if !(self.min_kv_headroom.is_finite() && (0.0..1.0).contains(&self.min_kv_headroom)) {
            return err(
                "min_kv_headroom".into(),
                shown(self.min_kv_headroom),
                "must be a number in 0..1",
            );
        }
        if self.latency.step_token_budget == 0 {
            return err(
                "latency.step_token_budget".into(),
                "0".into(),
                "must be at least 1",
            );
        }
        let seed = self.latency.seed_prefill_tokens_per_s;
        if !(seed.is_finite() && seed >= MIN_SEED_PREFILL_TOKENS_PER_S) {
            return err(
                "latency.seed_prefill_tokens_per_s".into(),
                shown(seed),
                "must be a finite number >= 1",
            );
        }
        let w = &self.weights;
        for (name, v) in [
            ("weights.kv_headroom", w.kv_headroom),
            ("weights.queue", w.queue),
            ("weights.inflight", w.inflight),
            ("weights.prefill", w.prefill),
            ("weights.prefix", w.prefix),
        ] {
            if !(v.is_finite() && (0.0..=MAX_WEIGHT).contains(&v)) {
                return err(name.into(), shown(v), "must be a number in 0..=1e6");
            }
        }
        for (i, c) in self.classes.iter().enumerate() {
            if c.name.is_empty() {
                return err(
                    format!("classes[{i}].name"),
                    "\"\"".into(),
                    "must not be empty",
                );
            }
            if c.pool.is_empty() {
                return err(
                    format!("classes[{i}].pool"),
                    "\"\"".into(),
                    "must not be empty",
                );
            }
            if let (Some(lo), Some(hi)) = (c.min_prompt_tokens, c.max_prompt_tokens) {
                if lo >= hi {
                    return err(
                        format!("classes[{i}].max_prompt_tokens"),
                        hi.to_string(),
                        "must be greater than min_prompt_tokens",
                    );
                }
            }
            if let (Some(lo), Some(hi)) = (c.min_output_tokens, c.max_output_tokens) {
                if lo >= hi {
                    return err(
                        format!("classes[{i}].max_output_tokens"),
                        hi.to_string(),
                        "must be greater than min_output_tokens",
                    );
                }
            }
        }
        Ok(())
    }
}

impl Picker {
    /// Validate `config` and build a picker whose random choices come from `seed`.
    ///
    /// Errors: [`ConfigError`] naming the first invalid field (see [`PickerConfig::validate`]).
    pub fn new(config: PickerConfig, seed: u64) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            rates: PrefillRates::new(config.latency.seed_prefill_tokens_per_s),
            config,
            rng: fastrand::Rng::with_seed(seed),
            cursor: 0,
            scratch: Vec::new(),
            explain: false,
        })
    }

    /// Keep the best [`EXPLAIN_TOP`] candidates with their scores in every [`Pick`]
    /// ([`Pick::top`]), for decision records. Off by default: it costs a small copy per
    /// decision.
    pub fn set_explain(&mut self, on: bool) {
        self.explain = on;
    }

    /// Configuration in force.
    pub fn config(&self) -> &PickerConfig {
        &self.config
    }

    /// Learned per-endpoint prefill throughput used by `predicted_ttft`.
    pub fn prefill_rates(&self) -> &PrefillRates {
        &self.rates
    }

    /// Mutable access, to feed observations ([`PrefillRates::observe`]) or replace the state
    /// with one shared by other workers.
    pub fn prefill_rates_mut(&mut self) -> &mut PrefillRates {
        &mut self.rates
    }

    /// Predicted TTFT of `req` on endpoint `index` of `input.snapshot` under the
    /// `predicted_ttft` model (whatever the policy in force); `None` for an index out of
    /// range. The caller feeds [`predicted_ttft::TtftPrediction::effective_tokens`] of the
    /// chosen endpoint back with the measured time to first byte.
    pub fn predict_ttft(
        &self,
        input: &PickInput<'_>,
        req: &PickRequest<'_>,
        index: usize,
    ) -> Option<predicted_ttft::TtftPrediction> {
        let e = input.snapshot.endpoints.get(index)?;
        let inflight = input.inflight.get(index).copied().unwrap_or_default();
        let matched = input
            .prefix_match_blocks
            .get(index)
            .copied()
            .unwrap_or(0)
            .min(req.prefix_blocks);
        Some(predicted_ttft::predict(
            e,
            &inflight,
            matched,
            req,
            &self.rates,
            self.config.latency.step_token_budget,
        ))
    }

    /// The request class `req` falls into, if any (first match wins).
    pub fn class_for(&self, req: &PickRequest<'_>) -> Option<&RequestClass> {
        self.config.classes.iter().find(|c| c.matches(req))
    }

    /// Choose an endpoint for `req` (see the module doc for the steps).
    pub fn pick(&mut self, input: &PickInput<'_>, req: &PickRequest<'_>) -> PickOutcome {
        let class = self.config.classes.iter().find(|c| c.matches(req));
        let class_name = class.map(|c| c.name.clone());
        let mut pool = class.map(|c| c.pool.as_str());
        let endpoints = &input.snapshot.endpoints;
        let usable = |e: &EndpointStats, pool: Option<&str>| {
            e.healthy && serves(e, req.model) && pool.is_none_or(|p| e.pool == p)
        };
        if pool.is_some() && !endpoints.iter().any(|e| usable(e, pool)) {
            pool = None;
        }

        let mut cands = std::mem::take(&mut self.scratch);
        cands.clear();
        let mut any_usable = false;
        let mut any_fresh = false;
        for (index, e) in endpoints.iter().enumerate() {
            if !usable(e, pool) {
                continue;
            }
            any_usable = true;
            let fresh = input.now_ms.saturating_sub(e.scraped_at_ms) <= self.config.stale_after_ms;
            if !fresh {
                continue;
            }
            any_fresh = true;
            let c = candidate(index, e, input, req);
            if fits(&c, e, req, self.config.min_kv_headroom) {
                cands.push(c);
            }
        }

        let outcome = if !any_usable {
            PickOutcome::NoEndpoints
        } else if !any_fresh {
            // Stale fallback: least-request over the usable (all stale) endpoints.
            for (index, e) in endpoints.iter().enumerate() {
                if usable(e, pool) {
                    cands.push(candidate(index, e, input, req));
                }
            }
            for c in cands.iter_mut() {
                c.cost = c.load as f64;
                c.tie = self.rng.u64(..);
            }
            self.finish(
                &mut cands,
                PolicyKind::LeastRequest,
                PickReason::StaleFallback,
                class_name,
            )
        } else if cands.is_empty() {
            PickOutcome::NoCapacity
        } else {
            let policy = self.config.policy;
            for c in cands.iter_mut() {
                c.tie = self.rng.u64(..);
            }
            match policy {
                PolicyKind::RoundRobin => {
                    round_robin::rank(&mut cands, self.cursor);
                    self.cursor = self.cursor.wrapping_add(1);
                }
                PolicyKind::Random => random::rank(&mut cands),
                PolicyKind::LeastRequest => least_request::rank(&mut cands),
                PolicyKind::LeastKv => least_kv::rank(&mut cands),
                PolicyKind::PrefixAffinity => prefix_affinity::rank(&mut cands),
                PolicyKind::Hybrid => hybrid::rank(&mut cands, &self.config.weights, req),
                PolicyKind::PredictedTtft => predicted_ttft::rank(
                    &mut cands,
                    endpoints,
                    req,
                    &self.rates,
                    self.config.latency.step_token_budget,
                ),
            }
            self.finish(&mut cands, policy, PickReason::Policy, class_name)
        };
        self.scratch = cands;
        outcome
    }

    fn finish(
        &mut self,
        cands: &mut [Candidate],
        policy: PolicyKind,
        reason: PickReason,
        class: Option<String>,
    ) -> PickOutcome {
        let k = self.config.max_fallbacks.saturating_add(1).min(cands.len());
        if k == 0 {
            return PickOutcome::NoEndpoints;
        }
        let keep = if self.explain {
            k.max(EXPLAIN_TOP).min(cands.len())
        } else {
            k
        };
        rank_top(cands, keep);
        let ranked = cands.get(..keep).unwrap_or_default();
        let top = if self.explain {
            ranked
                .iter()
                .take(EXPLAIN_TOP)
                .map(|c| Explained {
                    index: c.index,
                    score: -c.cost,
                    terms: c.terms,
                    prefix_blocks: c.prefix_blocks,
                    load: c.load,
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut it = ranked.iter().take(k).map(|c| c.index);
        let Some(primary) = it.next() else {
            return PickOutcome::NoEndpoints;
        };
        PickOutcome::Picked(Pick {
            primary,
            fallbacks: it.collect(),
            policy,
            reason,
            class,
            top,
        })
    }
}

fn candidate(
    index: usize,
    e: &EndpointStats,
    input: &PickInput<'_>,
    req: &PickRequest<'_>,
) -> Candidate {
    let inflight = input.inflight.get(index).copied().unwrap_or_default();
    let prefix_blocks = input
        .prefix_match_blocks
        .get(index)
        .copied()
        .unwrap_or(0)
        .min(req.prefix_blocks);
    let cap = e.kv_capacity_tokens.filter(|&c| c > 0).map(|c| c as f64);
    let usage = e
        .kv_usage
        .filter(|u| u.is_finite())
        .map(|u| u.clamp(0.0, 1.0));
    let projected_usage = match (usage, cap) {
        (Some(u), Some(c)) => Some(u + inflight.tokens as f64 / c),
        (Some(u), None) => Some(u),
        _ => None,
    };
    let headroom_after = match (usage, cap) {
        (Some(u), Some(c)) => {
            Some(1.0 - u - (inflight.tokens.saturating_add(req.demand_tokens)) as f64 / c)
        }
        (Some(u), None) => Some(1.0 - u),
        _ => None,
    };
    Candidate {
        index,
        load: u64::from(e.running) + u64::from(e.waiting) + u64::from(inflight.requests),
        waiting: e.waiting,
        inflight,
        projected_usage,
        headroom_after,
        prefix_blocks,
        cost: 0.0,
        cost2: 0.0,
        tie: 0,
        terms: None,
    }
}

/// KV headroom filter (see the module doc). Unknown usage passes.
fn fits(c: &Candidate, e: &EndpointStats, req: &PickRequest<'_>, min_headroom: f64) -> bool {
    if let Some(cap) = e.kv_capacity_tokens.filter(|&c| c > 0) {
        if req.demand_tokens > cap {
            return false;
        }
    }
    match c.headroom_after {
        None => true,
        Some(h) => h >= min_headroom,
    }
}
