//! The routing pipeline: one [`Router`] turns a snapshot, the in-flight table and a request
//! into a pure-data [`Decision`]. The filter, the routing benchmark and the core benchmark
//! all call it; hosts only do I/O around it (shared data, headers, metrics, logs).
//!
//! One decision ([`Router::route`], or [`Router::route_request`] for a request already
//! described, e.g. a trace row):
//! 1. **Fleet view.** Work that depends only on the snapshot is done once per snapshot
//!    (keyed by `version` and `generated_at_ms`), not per request: each endpoint's
//!    `scraped_at_ms`, the largest KV capacity among the healthy endpoints serving each
//!    model, the known model names (every model and LoRA adapter an endpoint lists, plus
//!    the snapshot's `unavailable_models`: a request for a known model nobody can take is
//!    [`Outcome::NoEndpoints`], for any other [`Outcome::UnknownModel`]), and the reconciliation of the prefix index (endpoints that left the fleet or
//!    restarted, i.e. whose `process_start_ms` changed, lose their prefix-affinity state:
//!    their prefix cache is cold).
//! 2. **Analysis.** The body is read by [`crate::analysis::analyze_bounded`] (the prefix
//!    text rendered only as far as the hash chain can reach) into a [`RequestInfo`].
//!    Without a body (not read by the host, not an inference API, or unparsable) the request
//!    is routed by load alone ([`Basis::LoadOnly`]): zero prompt tokens, no model, no prefix.
//! 3. **Demand.** KV demand in tokens from the model's profile
//!    ([`crate::profile::ModelProfile::demand`]). A model without a profile gets the same
//!    formula with the router's generic assumptions ([`generic_profile`]): output limit
//!    [`DEFAULT_MAX_TOKENS`] (1,024) when the request sets none, of which
//!    [`DEFAULT_EXPECTED_OUTPUT_FRACTION`] (0.5) is expected per choice, times `n`. The 512
//!    expected tokens sit near the 90th percentile of generated tokens in the shared traces
//!    (Azure conversation trace, Splitwise ISCA'24: p50 129 / p90 424; Mooncake FAST'25:
//!    p50 350 / p90 597; see [`crate::profile`]), so known and unknown models share one rule
//!    and one source.
//! 4. **Pick.** Prefix blocks are matched in the per-router [`PrefixIndex`], in-flight load
//!    is the table's unseen load ([`crate::inflight::InflightTable::add_unseen`], by snapshot position through a
//!    map built once per snapshot version; reservations the snapshot cannot
//!    show yet, plus all pending prefill) plus the other gateway replicas' unseen load that
//!    the control plane merged into the snapshot ([`crate::peer::add_peer_load`]), and the
//!    configured [`Picker`] policy chooses.
//! 5. **No capacity.** If no endpoint fits and the demand exceeds the whole KV capacity of
//!    every healthy endpoint serving the model, the request can never fit: a 429 "retry
//!    later" would never clear. It is re-picked by load (demand 0 in the pick) and its
//!    reservation is capped at the chosen endpoint's capacity; the model server gives its
//!    own answer (vLLM preempts, or rejects an output limit beyond `max_model_len`).
//!    Otherwise the outcome is [`Outcome::NoCapacity`] (the host queues or answers 429).
//! 6. **Result.** The chosen endpoint's pending prefill is the request's prompt minus the
//!    prefix tokens the index expects cached there ([`uncached_prompt_tokens`]); the chain
//!    is recorded for the chosen endpoint in the prefix index (and, with
//!    [`Router::share_affinity`], kept for the host to share with other instances).
//!
//! **Calibration** ([`Router::observe_usage`]): the response's `usage.prompt_tokens`
//! corrects the per-model estimate with an exponentially weighted moving average of
//! actual / estimated, weight [`CALIBRATION_ALPHA`] (0.1: about the last 10 responses),
//! clamped to [`CALIBRATION_RANGE`] (0.25..4: a tokenizer differs from the character-class
//! estimate by well under ×4 on the shared prompts; a wider factor would mean a broken
//! response, not a tokenizer). Exact counts (token-id prompts) are not calibrated.

use std::collections::BTreeMap;

use crate::analysis::{analyze_bounded_into, AnalysisError, ApiKind, RequestAnalysis};
use crate::estimate::{Estimator, EstimatorConfig};
use crate::inflight::Reservations;
use crate::observation::Observation;
use crate::output_len::OutputLengths;
use crate::picker::{
    uncached_prompt_tokens, ConfigError, Explained, InFlight, PickInput, PickOutcome, PickReason,
    PickRequest, Picker, PickerConfig, PolicyKind,
};
use crate::prefill_rate::PrefillRates;
use crate::prefix::{
    block_hashes, PrefixConfig, PrefixIndex, DEFAULT_INDEX_CAPACITY, DEFAULT_INDEX_TOTAL,
};
use crate::profile::{
    builtin_profiles, KvDemand, ModelProfile, ALIASES, DEFAULT_BLOCK_SIZE,
    DEFAULT_EXPECTED_OUTPUT_FRACTION, DEFAULT_MAX_TOKENS,
};
use crate::snapshot::Snapshot;
use crate::usage_sample::UsageSampler;

/// Output-length quantile the KV demand reserves for once output lengths were learned
/// (the median; [`Router::observe_output`]).
pub const OUTPUT_QUANTILE: f64 = 0.5;

/// Calibration learning rate: EWMA weight of one observation (see the module doc).
pub const CALIBRATION_ALPHA: f64 = 0.1;
/// Calibration factor bounds, inclusive (see the module doc).
pub const CALIBRATION_RANGE: (f64, f64) = (0.25, 4.0);

/// Everything a [`Router`] is configured with. Deserializes from JSON with every field
/// defaulted (the filter's plugin configuration embeds these keys at its top level).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct RouterConfig {
    /// Endpoint picker (policy, staleness, headroom, weights, classes, fallbacks).
    pub picker: PickerConfig,
    /// Token estimator (media allowances, initial per-model calibration).
    pub estimator: EstimatorConfig,
    /// Prefix hashing (block size in characters, max blocks).
    pub prefix: PrefixConfig,
    /// Blocks remembered per endpoint by the prefix index (default
    /// [`DEFAULT_INDEX_CAPACITY`], 31,250: GIE's `DefaultLRUCapacityPerServer`).
    pub prefix_index_blocks: usize,
    /// Blocks the prefix index keeps for all endpoints together (default
    /// [`DEFAULT_INDEX_TOTAL`], 2²⁰): with many endpoints each keeps
    /// `min(prefix_index_blocks, this / endpoints)`, so the index's memory does not grow
    /// with the fleet ([`PrefixIndex::set_endpoint_count`]).
    pub prefix_index_total_blocks: usize,
    /// Model profiles; they replace built-in profiles of the same name.
    pub models: Vec<ModelProfile>,
    /// Learn per-model calibration from response `usage` (default true).
    pub calibrate: bool,
    /// Responses whose `usage` is read: a token bucket per model of
    /// [`crate::usage_sample::BURST_READS`] reads, one back every this many milliseconds
    /// (default [`crate::usage_sample::DEFAULT_INTERVAL_MS`], 5, i.e. up to 200 reads per
    /// second per model once the bucket is empty; 0 reads every response). See
    /// [`Router::sample_usage`].
    pub usage_sample_ms: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            picker: PickerConfig::default(),
            estimator: EstimatorConfig::default(),
            prefix: PrefixConfig::default(),
            prefix_index_blocks: DEFAULT_INDEX_CAPACITY,
            prefix_index_total_blocks: DEFAULT_INDEX_TOTAL,
            models: Vec::new(),
            calibrate: true,
            usage_sample_ms: crate::usage_sample::DEFAULT_INTERVAL_MS,
        }
    }
}

/// A request described for routing: what [`crate::analysis::analyze`] finds in a body,
/// or what a trace row says. The default is an empty request of API
/// [`ApiKind::Other`] with one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestInfo {
    /// API of the request.
    pub api: ApiKind,
    /// Requested model (base model or LoRA adapter), if any.
    pub model: Option<String>,
    /// Estimated (or exact) prompt tokens.
    pub prompt_tokens: u64,
    /// Whether `prompt_tokens` is exact (token ids); exact counts are not calibrated.
    pub prompt_tokens_exact: bool,
    /// Output limit the request sets, tokens (per choice).
    pub max_output_tokens: Option<u32>,
    /// Completions generated (0 counts as 1): `n` choices for each prompt of the request
    /// (a `/v1/completions` batch has several, [`RequestAnalysis::prompts`]).
    pub n: u32,
    /// vLLM priority (lower is served first by the admission queue).
    pub priority: i32,
    /// The request asks for a streamed response (`stream: true`): its first response
    /// bytes are its first token.
    pub stream: bool,
    /// Prefix block hashes (see [`crate::prefix`]).
    pub prefix_hashes: Vec<u64>,
}

impl Default for RequestInfo {
    fn default() -> Self {
        Self {
            api: ApiKind::Other,
            model: None,
            prompt_tokens: 0,
            prompt_tokens_exact: false,
            max_output_tokens: None,
            n: 1,
            priority: 0,
            stream: false,
            prefix_hashes: Vec::new(),
        }
    }
}

impl RequestInfo {
    /// From a body analysis, hashing its prefix text with `prefix`.
    pub fn from_analysis(a: RequestAnalysis, prefix: &PrefixConfig) -> Self {
        Self::from_analysis_keeping_text(a, prefix).0
    }

    /// [`Self::from_analysis`], handing back the analysis's prefix text, whose allocation
    /// the router renders the next request into.
    fn from_analysis_keeping_text(a: RequestAnalysis, prefix: &PrefixConfig) -> (Self, String) {
        let prefix_hashes = block_hashes(
            a.model.as_deref().unwrap_or(""),
            a.cache_salt.as_deref(),
            &a.prefix_text,
            prefix,
        );
        let info = Self {
            api: a.api,
            model: a.model,
            prompt_tokens: a.prompt_tokens,
            prompt_tokens_exact: a.prompt_tokens_exact,
            max_output_tokens: a.max_output_tokens,
            n: a.n.saturating_mul(a.prompts.max(1)),
            priority: a.priority,
            stream: a.stream,
            prefix_hashes,
        };
        (info, a.prefix_text)
    }

    fn load_only(api: ApiKind) -> Self {
        Self {
            api,
            ..Self::default()
        }
    }
}

/// Why a request was routed by load alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadOnlyCause {
    /// The host did not read the body (none, upgrade, encoded, over the size limit).
    BodyNotRead,
    /// The path is not an inference API kvroute reads.
    NotInference,
    /// The body could not be analysed (see [`Decision::parse_error`]).
    Unparsable,
}

impl LoadOnlyCause {
    /// Static name (decision records, logs).
    pub fn name(self) -> &'static str {
        match self {
            LoadOnlyCause::BodyNotRead => "body_not_read",
            LoadOnlyCause::NotInference => "not_inference",
            LoadOnlyCause::Unparsable => "unparsable",
        }
    }
}

/// What the decision was based on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// The request's body (or a trace row's description of it).
    Body,
    /// Load alone: zero prompt tokens, no model, no prefix.
    LoadOnly(LoadOnlyCause),
}

/// What the request told the router, kept by the host for calibration at response time.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestFacts {
    /// Model name.
    pub model: Option<String>,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Exact (token ids)?
    pub exact: bool,
    /// The request asked for a streamed response ([`RequestInfo::stream`]).
    pub stream: bool,
    /// Completions the request asked for ([`RequestInfo::n`]: `n` per prompt; 0 counts as
    /// 1). A response's `usage.completion_tokens` counts the tokens of all of them; the
    /// output learner takes [`Self::per_choice`] of it.
    pub n: u32,
    /// Work the `predicted_ttft` model charged the chosen endpoint ahead of the first token,
    /// tokens ([`crate::picker::predicted_ttft::TtftPrediction::effective_tokens`]); the host
    /// hands it back with the measured TTFT to [`Router::observe_first_token`]. 0 when unknown.
    pub predicted_work_tokens: f64,
}

impl RequestFacts {
    /// Output tokens per choice of a response whose `usage.completion_tokens` is
    /// `completion_tokens` (the total over all [`Self::n`] choices), rounded up, for
    /// [`Router::observe_output`], which learns output lengths per choice.
    pub fn per_choice(&self, completion_tokens: u64) -> u64 {
        completion_tokens.div_ceil(u64::from(self.n.max(1)))
    }
}

/// A request routed to an endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Chosen endpoint, an index into the snapshot's `endpoints`.
    pub primary: usize,
    /// Chosen endpoint's id.
    pub endpoint: String,
    /// Ordered fallbacks, indices into the snapshot's `endpoints` (distinct, not `primary`).
    pub fallbacks: Vec<usize>,
    /// KV demand to reserve on `endpoint`, tokens (capped at its capacity).
    pub reserve_tokens: u64,
    /// Pending prefill to record on `endpoint`, tokens ([`uncached_prompt_tokens`]).
    pub prefill_tokens: u64,
    /// Policy that ranked the candidates.
    pub policy: PolicyKind,
    /// Fresh stats (policy pick) or none fresh (least-request stale fallback).
    pub reason: PickReason,
    /// The demand exceeded every serving endpoint's KV capacity: re-picked by load.
    pub demand_over_capacity: bool,
    /// Prefix blocks the request hashed ([`crate::prefix::block_hashes`]; 0 for a load-only
    /// decision).
    pub prefix_blocks: u32,
    /// Of those, the leading blocks this router's [`PrefixIndex`] had recorded for
    /// `endpoint` before this decision: the prefix-affinity evidence behind the pick (0
    /// after the endpoint restarted or when it never saw this prefix).
    pub prefix_match_blocks: u32,
    /// Request class matched, if any.
    pub class: Option<String>,
    /// Facts for calibration.
    pub facts: RequestFacts,
    /// The best-ranked candidates, the chosen one first, with their scores and predicted
    /// TTFT: only while explaining ([`Router::set_explain`]), empty otherwise.
    pub candidates: Vec<CandidateRecord>,
}

/// One candidate of a decision record ([`Router::set_explain`]): the picker's ranking of it
/// plus what the router adds.
#[derive(Debug, Clone, PartialEq)]
pub struct CandidateRecord {
    /// Endpoint id.
    pub endpoint: String,
    /// The picker's score, terms, prefix blocks and load there.
    pub pick: Explained,
    /// TTFT the `predicted_ttft` model expects there, seconds (whatever the policy).
    pub predicted_ttft_s: f64,
}

/// Outcome of a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Send the request to [`Route::endpoint`].
    Route(Route),
    /// The request names a model (base model or LoRA adapter) that endpoints of the
    /// snapshot list, but none of them can take it now (unhealthy, or filtered out by the
    /// policy), or a model of the snapshot's `unavailable_models` (a configured pool serves
    /// it but has no endpoint now): the host answers 503 with `retry-after`. Also a request
    /// without a model when no endpoint is healthy. Carries the request's model when it
    /// names one (read by the analysis, or by [`crate::analysis::requested_model`] from a
    /// body the analysis rejects), for the reply to name: the host reads no body again.
    NoEndpoints(Option<String>),
    /// Neither an endpoint of the snapshot, healthy or not, nor its `unavailable_models`
    /// lists the requested model (base model or LoRA adapter): the client asked for
    /// something this fleet does not serve, so the host answers 404 (`model_not_found`, as
    /// OpenAI's API does). Carries the model name.
    UnknownModel(String),
    /// Every serving endpoint is out of KV headroom (the host queues or answers 429).
    NoCapacity {
        /// vLLM priority (lower first).
        priority: i32,
        /// KV demand, tokens (the admission queue's job size).
        size: u64,
    },
}

/// One routing decision, pure data.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// What to do.
    pub outcome: Outcome,
    /// What it was based on.
    pub basis: Basis,
    /// Why the body could not be analysed ([`LoadOnlyCause::Unparsable`]).
    pub parse_error: Option<AnalysisError>,
}

/// Per-snapshot derived data (see the module doc, step 1).
#[derive(Debug, Default)]
struct Fleet {
    key: Option<(u64, u64)>,
    /// Endpoint id → (index in the snapshot, `scraped_at_ms`).
    slots: BTreeMap<String, (usize, u64)>,
    process_start: BTreeMap<String, Option<u64>>,
    /// model → largest KV capacity among healthy endpoints serving it, tokens.
    max_capacity: BTreeMap<String, u64>,
    /// Largest KV capacity among all healthy endpoints (requests without a model), tokens.
    max_capacity_any: Option<u64>,
    /// Every model and LoRA adapter any endpoint lists, healthy or not, and every model of
    /// the snapshot's `unavailable_models`: the names a request may ask for without being
    /// an [`Outcome::UnknownModel`].
    models: std::collections::BTreeSet<String>,
}

/// The profile of a model without one: [`DEFAULT_MAX_TOKENS`] output limit,
/// [`DEFAULT_EXPECTED_OUTPUT_FRACTION`] of it expected, blocks of [`DEFAULT_BLOCK_SIZE`]
/// tokens, no architecture (KV bytes 0) and no context cap (see the module doc, step 3).
pub fn generic_profile(name: &str) -> ModelProfile {
    ModelProfile {
        name: name.to_owned(),
        num_layers: 0,
        num_kv_heads: 0,
        head_dim: 0,
        kv_dtype_bytes: 0,
        block_size: DEFAULT_BLOCK_SIZE,
        weight_bytes: 0,
        max_model_len: 0,
        default_max_tokens: DEFAULT_MAX_TOKENS,
        expected_output_fraction: DEFAULT_EXPECTED_OUTPUT_FRACTION,
        source: "kvroute router assumption (kvroute_core::router module doc)".to_owned(),
    }
}

/// The routing pipeline of one router instance (one per Envoy worker, one per benchmark
/// run). See the module doc.
#[derive(Debug)]
pub struct Router {
    picker: Picker,
    estimator: Estimator,
    prefix: PrefixConfig,
    index: PrefixIndex,
    profiles: BTreeMap<String, ModelProfile>,
    /// Lower-cased built-in name or alias → profile name (as [`crate::profile::builtin`]).
    by_lower: BTreeMap<String, String>,
    /// Lower-cased built-in name without its `org/` → profile name.
    by_short: BTreeMap<String, String>,
    generic: ModelProfile,
    calibrate: bool,
    /// Which responses' `usage` the host reads ([`Router::sample_usage`]).
    usage: UsageSampler,
    fleet: Fleet,
    scratch_inflight: Vec<InFlight>,
    /// Per snapshot endpoint: whether the decision's chain is what the prefix index
    /// recorded there last ([`PrefixIndex::match_snapshot_into`]); kept between decisions.
    scratch_last: Vec<bool>,
    /// Per-snapshot-endpoint prefix blocks matched ([`PrefixIndex::match_snapshot_into`]);
    /// kept between decisions.
    scratch_matches: Vec<u32>,
    /// The last request's prefix rendering, whose allocation the next one renders into
    /// ([`crate::analysis::analyze_bounded_into`]), up to [`KEPT_RENDERING_BYTES`].
    scratch_rendering: String,
    /// Learned output lengths per (model, API), fed by [`Router::observe_output`].
    outputs: OutputLengths,
    /// Chains recorded since the last [`Router::take_recorded`], kept only while affinity
    /// sharing is on ([`Router::share_affinity`]); at most [`MAX_RECORDED`].
    recorded: Option<Vec<(String, Vec<u64>)>>,
    /// Learner observations made since the last [`Router::take_observations`], as journal
    /// records, kept only while sharing is on ([`Router::share_learning`]); at most
    /// [`MAX_RECORDED`].
    observed: Option<Vec<(String, Vec<u64>)>>,
}

/// Bound on chains kept for [`Router::take_recorded`], and on observations kept for
/// [`Router::take_observations`], between two takes; later ones are not kept (the host
/// syncs every ~100 ms, so this is thousands of requests per second).
pub const MAX_RECORDED: usize = 4096;

/// Largest prefix rendering a router keeps for the next request to render into, bytes
/// (64 KiB; the default rendering is at most 16 KiB plus a role marker, so it is always
/// kept): one allocation fewer per decision.
pub const KEPT_RENDERING_BYTES: usize = 64 * 1024;

impl Router {
    /// Validate `config` and build a router whose random tie-breaks come from `seed`.
    ///
    /// Errors: the picker's [`ConfigError`], naming the field.
    pub fn new(config: RouterConfig, seed: u64) -> Result<Self, ConfigError> {
        let picker = Picker::new(config.picker, seed)?;
        let mut profiles: BTreeMap<String, ModelProfile> = builtin_profiles()
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect();
        let short = |s: &str| s.rsplit('/').next().unwrap_or(s).to_ascii_lowercase();
        let mut by_lower = BTreeMap::new();
        let mut by_short = BTreeMap::new();
        for name in profiles.keys() {
            by_lower.insert(name.to_ascii_lowercase(), name.clone());
            by_short.entry(short(name)).or_insert_with(|| name.clone());
        }
        for (alias, canonical) in ALIASES {
            by_lower.insert(alias.to_ascii_lowercase(), (*canonical).to_owned());
        }
        for m in config.models {
            profiles.insert(m.name.clone(), m);
        }
        Ok(Self {
            picker,
            estimator: Estimator::new(config.estimator),
            prefix: config.prefix,
            index: PrefixIndex::with_seed(config.prefix_index_blocks, seed)
                .with_total(config.prefix_index_total_blocks),
            profiles,
            by_lower,
            by_short,
            generic: generic_profile(""),
            calibrate: config.calibrate,
            usage: UsageSampler::new(config.usage_sample_ms),
            fleet: Fleet::default(),
            scratch_inflight: Vec::new(),
            scratch_last: Vec::new(),
            scratch_matches: Vec::new(),
            scratch_rendering: String::new(),
            outputs: OutputLengths::new(),
            recorded: None,
            observed: None,
        })
    }

    /// Explain decisions: every [`Route`] then carries its best-ranked candidates with
    /// their scores, terms and predicted TTFT ([`Route::candidates`]), for a decision
    /// record. Off by default (it costs a small copy and one TTFT prediction per candidate).
    pub fn set_explain(&mut self, on: bool) {
        self.picker.set_explain(on);
    }

    /// Turn affinity sharing on or off: while on, every chain the router records for a chosen
    /// endpoint is also kept for [`Router::take_recorded`], so a host can hand it to other
    /// router instances ([`crate::affinity`]).
    pub fn share_affinity(&mut self, on: bool) {
        self.recorded = on.then(Vec::new);
    }

    /// The (endpoint id, chain) pairs recorded since the last call, oldest first; empty when
    /// sharing is off.
    pub fn take_recorded(&mut self) -> Vec<(String, Vec<u64>)> {
        match &mut self.recorded {
            Some(v) => std::mem::take(v),
            None => Vec::new(),
        }
    }

    /// Turn learner sharing on or off: while on, every observation the learners take from
    /// this router's responses ([`Router::observe_first_token`], [`Router::observe_output`])
    /// is also kept for [`Router::take_observations`], so a host can replay it into other
    /// router instances ([`crate::observation`]).
    pub fn share_learning(&mut self, on: bool) {
        self.observed = on.then(Vec::new);
    }

    /// The observations made since the last call, oldest first, as journal records
    /// ([`crate::observation::Observation::to_record`]); empty when sharing is off.
    pub fn take_observations(&mut self) -> Vec<(String, Vec<u64>)> {
        match &mut self.observed {
            Some(v) => std::mem::take(v),
            None => Vec::new(),
        }
    }

    /// Whether [`Router::take_recorded`] or [`Router::take_observations`] would return
    /// anything: records made since the last takes, not yet handed to the other workers.
    pub fn has_unshared(&self) -> bool {
        self.recorded.as_ref().is_some_and(|v| !v.is_empty())
            || self.observed.as_ref().is_some_and(|v| !v.is_empty())
    }

    /// Replay an observation another router instance made (a journal record, `key` and
    /// `words`) into this router's learners, as if this router had made it; it is not
    /// kept for [`Router::take_observations`]. Returns false for a record that is no
    /// observation ([`crate::observation::Observation::from_record`]) or that the learner
    /// ignored (e.g. a non-positive TTFT).
    pub fn import_observation(&mut self, key: &str, words: &[u64]) -> bool {
        match Observation::from_record(key, words) {
            Some(Observation::FirstToken {
                endpoint,
                work_tokens,
                ttft_s,
            }) => self
                .picker
                .prefill_rates_mut()
                .observe(&endpoint, work_tokens, ttft_s),
            Some(Observation::Output {
                model,
                api,
                prompt_tokens,
                completion_tokens,
            }) => self
                .outputs
                .observe(&model, api, prompt_tokens, completion_tokens),
            None => false,
        }
    }

    fn keep_observation(&mut self, o: Observation) {
        if let Some(out) = &mut self.observed {
            if out.len() < MAX_RECORDED {
                out.push(o.to_record());
            }
        }
    }

    /// Learn that another router instance sent a request with chain `hashes` to
    /// `endpoint_id` (as if this router had routed it). Returns false, and keeps nothing, for
    /// an endpoint not in the last snapshot this router saw ([`Router::observe_snapshot`] or
    /// a decision): the index only ever holds endpoints of the fleet, so a router that never
    /// routes (Envoy's main-thread instance) cannot grow without bound.
    pub fn import_affinity(&mut self, endpoint_id: &str, hashes: &[u64]) -> bool {
        if !self.fleet.process_start.contains_key(endpoint_id) {
            return false;
        }
        self.index.record(endpoint_id, hashes);
        true
    }

    /// Take in a snapshot without deciding anything: the once-per-version work of a
    /// decision's step 1 (fleet view, prefix-index reconciliation). Cheap when the snapshot
    /// is the one already seen.
    pub fn observe_snapshot(&mut self, snapshot: &Snapshot) {
        self.refresh_fleet(snapshot);
    }

    /// The estimator, with its learned calibration.
    pub fn estimator(&self) -> &Estimator {
        &self.estimator
    }

    /// The picker configuration in force.
    pub fn picker_config(&self) -> &PickerConfig {
        self.picker.config()
    }

    /// Blocks remembered for `endpoint_id` in the prefix index.
    pub fn prefix_blocks(&self, endpoint_id: &str) -> usize {
        self.index.len(endpoint_id)
    }

    /// The profile used for `model`: a configured or built-in one by exact served name, else
    /// a built-in one by the rules of [`crate::profile::builtin`] (alias, case, no `org/`),
    /// else [`generic_profile`]. The lookup tables are built once, at construction.
    pub fn profile(&self, model: Option<&str>) -> &ModelProfile {
        let Some(m) = model else {
            return &self.generic;
        };
        if let Some(p) = self.profiles.get(m) {
            return p;
        }
        let lower = m.to_ascii_lowercase();
        let short = lower.rsplit('/').next().unwrap_or(&lower);
        self.by_lower
            .get(&lower)
            .or_else(|| self.by_short.get(short))
            .and_then(|name| self.profiles.get(name))
            .unwrap_or(&self.generic)
    }

    /// KV demand of `req` and its output limit (tokens), by the rule of the module doc; once
    /// [`crate::output_len::MIN_OBSERVATIONS`] responses of the model and API were observed
    /// ([`Router::observe_output`]), the expected output per choice is the learned
    /// [`OUTPUT_QUANTILE`] for the prompt length, capped by the request's own limit.
    pub fn demand(&self, req: &RequestInfo) -> (u64, KvDemand) {
        let p = self.profile(req.model.as_deref());
        let limit = u64::from(req.max_output_tokens.unwrap_or(p.default_max_tokens));
        let learned = req.model.as_deref().and_then(|m| {
            self.outputs.predict(
                m,
                req.api,
                req.prompt_tokens,
                req.max_output_tokens.map(u64::from),
                OUTPUT_QUANTILE,
            )
        });
        let demand = match learned {
            Some(out) => p.demand_with_output(req.prompt_tokens, out, req.n),
            None => p.demand_for(req.prompt_tokens, limit, req.n),
        };
        (limit, demand)
    }

    /// Learned output lengths ([`Router::observe_output`]).
    pub fn output_lengths(&self) -> &OutputLengths {
        &self.outputs
    }

    /// The picker's learned prefill throughput per endpoint ([`Router::observe_first_token`]).
    pub fn prefill_rates(&self) -> &PrefillRates {
        self.picker.prefill_rates()
    }

    /// Learn from a response's first token: the request was routed to `endpoint` with
    /// [`RequestFacts::predicted_work_tokens`] = `predicted_work_tokens`, and its first token
    /// came `ttft_s` seconds after the decision. Feeds the `predicted_ttft` policy's prefill
    /// throughput ([`PrefillRates::observe`]); returns whether the sample was used.
    pub fn observe_first_token(
        &mut self,
        endpoint: &str,
        predicted_work_tokens: f64,
        ttft_s: f64,
    ) -> bool {
        let used = self
            .picker
            .prefill_rates_mut()
            .observe(endpoint, predicted_work_tokens, ttft_s);
        if used && self.observed.is_some() {
            self.keep_observation(Observation::FirstToken {
                endpoint: endpoint.to_owned(),
                work_tokens: predicted_work_tokens,
                ttft_s,
            });
        }
        used
    }

    /// Learn from a finished response's `usage`: `prompt_tokens` and the output tokens per
    /// choice (`completion_tokens` counts every choice: pass [`RequestFacts::per_choice`] of
    /// it) of a request to `model` over `api` ([`OutputLengths::observe`]). Later requests without a
    /// learned-better bound reserve KV for the learned output ([`Router::demand`]).
    pub fn observe_output(
        &mut self,
        model: &str,
        api: ApiKind,
        prompt_tokens: u64,
        completion_tokens: u64,
    ) {
        let used = self
            .outputs
            .observe(model, api, prompt_tokens, completion_tokens);
        if used && self.observed.is_some() {
            self.keep_observation(Observation::Output {
                model: model.to_owned(),
                api,
                prompt_tokens,
                completion_tokens,
            });
        }
    }

    /// Decide for a request to `path` with `body` (`None`: the host did not read it) over
    /// `snapshot` and the in-flight `table` at `now_ms` (Unix ms). Never panics.
    pub fn route<T: Reservations + ?Sized>(
        &mut self,
        snapshot: &Snapshot,
        table: &T,
        path: &str,
        body: Option<&[u8]>,
        now_ms: u64,
    ) -> Decision {
        let api = ApiKind::from_path(path);
        let (req, basis, parse_error) = match body {
            None => (
                RequestInfo::load_only(api),
                Basis::LoadOnly(LoadOnlyCause::BodyNotRead),
                None,
            ),
            Some(_) if api == ApiKind::Other => (
                RequestInfo::load_only(api),
                Basis::LoadOnly(LoadOnlyCause::NotInference),
                None,
            ),
            Some(b) => match analyze_bounded_into(
                api,
                b,
                &self.estimator,
                self.prefix.max_bytes(),
                std::mem::take(&mut self.scratch_rendering),
            ) {
                Ok(a) => {
                    let (info, text) = RequestInfo::from_analysis_keeping_text(a, &self.prefix);
                    if text.capacity() <= KEPT_RENDERING_BYTES {
                        self.scratch_rendering = text;
                    }
                    (info, Basis::Body, None)
                }
                // Routed by load, but among the endpoints that serve the body's model
                // when it names one: the analysis is stricter than model servers are
                // (vLLM's pydantic models take `"n": "1"`).
                Err(e) => (
                    RequestInfo {
                        model: crate::analysis::requested_model(b),
                        ..RequestInfo::load_only(api)
                    },
                    Basis::LoadOnly(LoadOnlyCause::Unparsable),
                    Some(e),
                ),
            },
        };
        let outcome = self.decide(snapshot, table, &req, now_ms);
        if let Outcome::Route(r) = &outcome {
            // The request is done with: its chain moves into the outbox, no copy.
            self.keep_recorded(&r.endpoint, req.prefix_hashes);
        }
        Decision {
            outcome,
            basis,
            parse_error,
        }
    }

    /// Keep a chain routed to `endpoint` for [`Router::take_recorded`] while sharing is on.
    fn keep_recorded(&mut self, endpoint: &str, hashes: Vec<u64>) {
        if let Some(out) = &mut self.recorded {
            if out.len() < MAX_RECORDED && !hashes.is_empty() {
                out.push((endpoint.to_owned(), hashes));
            }
        }
    }

    /// Decide for a request already described by `req` (e.g. a trace row). Same pipeline as
    /// [`Router::route`] from step 3 on; the basis is [`Basis::Body`].
    pub fn route_request<T: Reservations + ?Sized>(
        &mut self,
        snapshot: &Snapshot,
        table: &T,
        req: &RequestInfo,
        now_ms: u64,
    ) -> Decision {
        let outcome = self.decide(snapshot, table, req, now_ms);
        if let Outcome::Route(r) = &outcome {
            if self.recorded.is_some() {
                self.keep_recorded(&r.endpoint, req.prefix_hashes.clone());
            }
        }
        Decision {
            outcome,
            basis: Basis::Body,
            parse_error: None,
        }
    }

    fn refresh_fleet(&mut self, snap: &Snapshot) {
        let key = Some((snap.version, snap.generated_at_ms));
        if self.fleet.key == key {
            return;
        }
        let mut fleet = Fleet {
            key,
            models: snap.unavailable_models.iter().cloned().collect(),
            ..Fleet::default()
        };
        for (i, e) in snap.endpoints.iter().enumerate() {
            if let Some(Some(old)) = self.fleet.process_start.get(&e.id) {
                if Some(*old) != e.process_start_ms {
                    self.index.forget(&e.id);
                }
            }
            fleet.process_start.insert(e.id.clone(), e.process_start_ms);
            fleet.slots.insert(e.id.clone(), (i, e.scraped_at_ms));
            fleet
                .models
                .extend(e.models.iter().chain(&e.lora_adapters).cloned());
            if !e.healthy {
                continue;
            }
            if let Some(cap) = e.kv_capacity_tokens {
                fleet.max_capacity_any = fleet.max_capacity_any.max(Some(cap));
                for m in e.models.iter().chain(&e.lora_adapters) {
                    let slot = fleet.max_capacity.entry(m.clone()).or_insert(0);
                    *slot = (*slot).max(cap);
                }
            }
        }
        self.index.retain(|id| fleet.process_start.contains_key(id));
        self.index.set_endpoint_count(snap.endpoints.len());
        // Learned prefill rates go with their endpoint, as its prefix index does: with
        // endpoint ids churning (pods replaced), they filled up to the learner's bound and
        // grew the filter's memory (found by a breaker).
        self.picker
            .prefill_rates_mut()
            .retain(|id| fleet.process_start.contains_key(id));
        self.fleet = fleet;
    }

    fn decide<T: Reservations + ?Sized>(
        &mut self,
        snap: &Snapshot,
        table: &T,
        req: &RequestInfo,
        now_ms: u64,
    ) -> Outcome {
        self.refresh_fleet(snap);
        let (output_limit, demand) = self.demand(req);
        let demand = demand.tokens;
        let slots = &self.fleet.slots;
        let mut inflight = std::mem::take(&mut self.scratch_inflight);
        inflight.clear();
        inflight.resize(snap.endpoints.len(), InFlight::default());
        table.add_unseen_into(now_ms, |id| slots.get(id).copied(), &mut inflight);
        crate::peer::add_peer_load(snap, &mut inflight);
        let mut recorded_last = std::mem::take(&mut self.scratch_last);
        let mut matches = std::mem::take(&mut self.scratch_matches);
        self.index
            .match_snapshot_into(&req.prefix_hashes, snap, &mut recorded_last, &mut matches);
        let pick_req = PickRequest {
            model: req.model.as_deref(),
            api: req.api,
            prompt_tokens: req.prompt_tokens,
            output_limit,
            demand_tokens: demand,
            prefix_blocks: u32::try_from(req.prefix_hashes.len()).unwrap_or(u32::MAX),
        };
        let input = PickInput {
            snapshot: snap,
            inflight: &inflight,
            prefix_match_blocks: &matches,
            now_ms,
        };
        let mut outcome = self.picker.pick(&input, &pick_req);
        let mut reserve = demand;
        let mut over_capacity = false;
        if outcome == PickOutcome::NoCapacity {
            let largest = match req.model.as_deref() {
                Some(m) => self.fleet.max_capacity.get(m).copied(),
                None => self.fleet.max_capacity_any,
            };
            if let Some(cap) = largest.filter(|&cap| demand > cap) {
                let by_load = PickRequest {
                    demand_tokens: 0,
                    ..pick_req
                };
                outcome = self.picker.pick(&input, &by_load);
                reserve = cap;
                over_capacity = true;
            }
        }
        let candidates: Vec<CandidateRecord> = match &outcome {
            PickOutcome::Picked(p) => p
                .top
                .iter()
                .filter_map(|x| {
                    let e = snap.endpoints.get(x.index)?;
                    let ttft = self.picker.predict_ttft(&input, &pick_req, x.index);
                    Some(CandidateRecord {
                        endpoint: e.id.clone(),
                        pick: *x,
                        predicted_ttft_s: ttft.map_or(0.0, |t| t.seconds),
                    })
                })
                .collect(),
            _ => Vec::new(),
        };
        let predicted_work_tokens = match &outcome {
            PickOutcome::Picked(p) => self
                .picker
                .predict_ttft(&input, &pick_req, p.primary)
                .map_or(0.0, |t| t.effective_tokens),
            _ => 0.0,
        };
        self.scratch_inflight = inflight;
        let chain_recorded_last = match &outcome {
            PickOutcome::Picked(p) => recorded_last.get(p.primary).copied().unwrap_or(false),
            _ => false,
        };
        self.scratch_last = recorded_last;
        let matched = match &outcome {
            PickOutcome::Picked(p) => matches.get(p.primary).copied().unwrap_or(0),
            _ => 0,
        };
        self.scratch_matches = matches;
        match outcome {
            PickOutcome::Picked(p) => {
                let Some(primary) = snap.endpoints.get(p.primary) else {
                    // The picker returns indices into the snapshot it was given.
                    return Outcome::NoEndpoints(req.model.clone());
                };
                let prefill_tokens =
                    uncached_prompt_tokens(req.prompt_tokens, matched, pick_req.prefix_blocks);
                // Nothing to record when the chain is what was recorded last there (the same
                // prompt again): recording it would move each block to where it already is.
                if !chain_recorded_last {
                    self.index
                        .record_matched(&primary.id, &req.prefix_hashes, matched);
                }
                Outcome::Route(Route {
                    primary: p.primary,
                    endpoint: primary.id.clone(),
                    fallbacks: p.fallbacks,
                    reserve_tokens: reserve.min(primary.kv_capacity_tokens.unwrap_or(u64::MAX)),
                    prefill_tokens,
                    policy: p.policy,
                    reason: p.reason,
                    demand_over_capacity: over_capacity,
                    prefix_blocks: pick_req.prefix_blocks,
                    prefix_match_blocks: matched,
                    class: p.class,
                    facts: RequestFacts {
                        model: req.model.clone(),
                        prompt_tokens: req.prompt_tokens,
                        exact: req.prompt_tokens_exact,
                        stream: req.stream,
                        n: req.n,
                        predicted_work_tokens,
                    },
                    candidates,
                })
            }
            PickOutcome::NoEndpoints => match req.model.as_deref() {
                Some(m) if !self.fleet.models.contains(m) => Outcome::UnknownModel(m.to_owned()),
                _ => Outcome::NoEndpoints(req.model.clone()),
            },
            PickOutcome::NoCapacity => Outcome::NoCapacity {
                priority: req.priority,
                size: demand,
            },
        }
    }

    /// Whether the host should read the `usage` of the response, beginning at `now_ms`
    /// (the host's clock, ms), to a request routed with `facts`: a token bucket per model,
    /// refilled at one read per `usage_sample_ms` ([`crate::usage_sample`]). Only read
    /// responses feed [`Router::observe_usage`] and [`Router::observe_output`]; the first
    /// token ([`Router::observe_first_token`]) needs no `usage` and is observed for every
    /// response the host finds to be an event stream.
    pub fn sample_usage(&mut self, facts: &RequestFacts, now_ms: u64) -> bool {
        self.usage
            .sample(facts.model.as_deref().unwrap_or(""), now_ms)
    }

    /// Learn from a response's `usage.prompt_tokens` (`actual_prompt`) for a request routed
    /// with `facts`: per-model calibration (see the module doc). Returns the estimate's error,
    /// |actual − estimated| / actual in percent (rounded), when the estimate was not exact.
    pub fn observe_usage(&mut self, facts: &RequestFacts, actual_prompt: u64) -> Option<u64> {
        if facts.exact || facts.prompt_tokens == 0 || actual_prompt == 0 {
            return None;
        }
        let est = facts.prompt_tokens as f64;
        let act = actual_prompt as f64;
        let err_pct = ((act - est).abs() * 100.0 / act).round();
        let err = (err_pct.is_finite() && err_pct >= 0.0).then_some(err_pct as u64);
        if !self.calibrate {
            return err;
        }
        let Some(model) = facts.model.as_deref() else {
            return err;
        };
        let old = self.estimator.calibration(Some(model));
        let target = old * act / est;
        let new = (old + CALIBRATION_ALPHA * (target - old))
            .clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1);
        if new.is_finite() {
            self.estimator
                .config
                .calibration
                .insert(model.to_owned(), new);
        }
        err
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inflight::InflightTable;
    use crate::snapshot::EndpointStats;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NOW: u64 = 1_000;

    fn ep(i: usize, usage: f64) -> EndpointStats {
        EndpointStats {
            kv_usage: Some(usage),
            ..EndpointStats::fixture(i, NOW)
        }
    }

    fn router(policy: PolicyKind) -> Router {
        Router::new(
            RouterConfig {
                picker: PickerConfig {
                    policy,
                    ..PickerConfig::default()
                },
                ..RouterConfig::default()
            },
            7,
        )
        .unwrap()
    }

    fn route(d: &Decision) -> &Route {
        match &d.outcome {
            Outcome::Route(r) => r,
            o => panic!("not routed: {o:?}"),
        }
    }

    #[test]
    fn one_demand_rule_for_known_and_unknown_models() {
        let r = router(PolicyKind::Hybrid);
        // Unknown model: limit 10 → ⌈10 × 0.5⌉ = 5 per choice, no bytes.
        let req = RequestInfo {
            model: Some("unknown".into()),
            prompt_tokens: 3,
            max_output_tokens: Some(10),
            n: 1,
            ..RequestInfo::default()
        };
        let (limit, d) = r.demand(&req);
        assert_eq!((limit, d.tokens, d.bytes, d.blocks), (10, 8, 0, 2));
        // No limit: 1,024 × 0.5 = 512 per choice, × n = 4.
        let req = RequestInfo {
            max_output_tokens: None,
            n: 4,
            ..req
        };
        assert_eq!(r.demand(&req).1.tokens, 3 + 4 * 512);
        // Known model (Qwen3-32B): same formula, with its KV bytes per token.
        let req = RequestInfo {
            model: Some("Qwen/Qwen3-32B".into()),
            prompt_tokens: 40,
            max_output_tokens: Some(100),
            n: 2,
            ..RequestInfo::default()
        };
        let (limit, d) = r.demand(&req);
        assert_eq!((limit, d.expected_output_tokens, d.tokens), (100, 100, 140));
        assert_eq!(d.bytes, 140 * 262_144);
    }

    #[test]
    fn peer_load_counts_like_own_inflight() {
        let body = br#"{"model":"m","prompt":"hello","max_tokens":10}"#;
        let table = InflightTable::default();
        // least_request: e0 carries 2 of another gateway's requests, e1 one of this
        // router's own reservations, e2 one peer request; e3 is idle and wins every time.
        let mut eps = vec![ep(0, 0.1), ep(1, 0.1), ep(2, 0.1), ep(3, 0.1)];
        eps[0].peer_inflight_requests = 2;
        eps[2].peer_inflight_requests = 1;
        let snap = Snapshot::new(1, NOW, eps);
        let mut own = InflightTable::default();
        own.reserve(1, "pool/e1", 10, NOW, 60_000);
        let mut r = router(PolicyKind::LeastRequest);
        for _ in 0..20 {
            let d = r.route(&snap, &own, "/v1/completions", Some(body), NOW);
            assert_eq!(route(&d).endpoint, "pool/e3");
        }
        // least_kv: peer tokens take KV headroom exactly as own reservations do. All four at
        // 10 % of 100,000 tokens; 30,000 peer tokens on e0..e2 leave e3 the least used.
        let mut eps = vec![ep(0, 0.1), ep(1, 0.1), ep(2, 0.1), ep(3, 0.1)];
        for e in eps.iter_mut().take(3) {
            e.peer_inflight_tokens = 30_000;
        }
        let snap = Snapshot::new(2, NOW, eps);
        let mut r = router(PolicyKind::LeastKv);
        for _ in 0..20 {
            let d = r.route(&snap, &table, "/v1/completions", Some(body), NOW);
            assert_eq!(route(&d).endpoint, "pool/e3");
        }
        // The same tokens as an own reservation pick the same way (one implementation).
        let snap = Snapshot::new(3, NOW, vec![ep(0, 0.1), ep(1, 0.1), ep(2, 0.1), ep(3, 0.1)]);
        let mut own = InflightTable::default();
        for (i, e) in ["pool/e0", "pool/e1", "pool/e2"].into_iter().enumerate() {
            own.reserve(i as u64, e, 30_000, NOW, 60_000);
        }
        let d = r.route(&snap, &own, "/v1/completions", Some(body), NOW);
        assert_eq!(route(&d).endpoint, "pool/e3");
    }

    #[test]
    fn body_is_analysed_hashed_and_recorded() {
        let mut r = router(PolicyKind::RoundRobin);
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.1), ep(1, 0.1)]);
        let table = InflightTable::default();
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        let d = r.route(&snap, &table, "/v1/completions", Some(body.as_bytes()), NOW);
        assert_eq!(d.basis, Basis::Body);
        let rt = route(&d);
        assert_eq!(r.prefix_blocks(&rt.endpoint), 10);
        // Nothing cached before: the whole prompt is pending prefill.
        assert_eq!(rt.prefill_tokens, rt.facts.prompt_tokens);
        assert!(rt.facts.prompt_tokens > 100);
        // Same prefix to the same endpoint again: fully cached, no prefill.
        let mut lk = Router::new(RouterConfig::default(), 1).unwrap();
        let a = lk.route(&snap, &table, "/v1/completions", Some(body.as_bytes()), NOW);
        let b = lk.route(&snap, &table, "/v1/completions", Some(body.as_bytes()), NOW);
        assert_eq!(route(&a).endpoint, route(&b).endpoint, "prefix affinity");
        assert_eq!(route(&b).prefill_tokens, 0);
        // The evidence the decision header shows: none matched first, all 10 the second time.
        assert_eq!(
            (route(&a).prefix_blocks, route(&a).prefix_match_blocks),
            (10, 0)
        );
        assert_eq!(
            (route(&b).prefix_blocks, route(&b).prefix_match_blocks),
            (10, 10)
        );
    }

    /// The prefix index's memory follows `prefix_index_total_blocks`, not the fleet: 100
    /// endpoints under a total of 400 blocks keep 4 each, the most recent of a 10-block
    /// prompt (a 2,000-endpoint fleet at the per-endpoint default trapped the VM at 1 GiB).
    #[test]
    fn the_prefix_index_is_bounded_across_the_fleet() {
        let mut r = Router::new(
            RouterConfig {
                prefix_index_total_blocks: 400,
                ..RouterConfig::default()
            },
            1,
        )
        .unwrap();
        let snap = Snapshot::new(1, NOW, (0..100).map(|i| ep(i, 0.1)).collect());
        let table = InflightTable::default();
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        let d = r.route(&snap, &table, "/v1/completions", Some(body.as_bytes()), NOW);
        assert_eq!(route(&d).prefix_blocks, 10);
        assert_eq!(r.index.capacity(), 4);
        assert_eq!(r.prefix_blocks(&route(&d).endpoint), 4);
    }

    #[test]
    fn load_only_causes() {
        let mut r = router(PolicyKind::LeastRequest);
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.1)]);
        let t = InflightTable::default();
        let p = "/v1/chat/completions";
        let d = r.route(&snap, &t, p, None, NOW);
        assert_eq!(d.basis, Basis::LoadOnly(LoadOnlyCause::BodyNotRead));
        assert_eq!(route(&d).facts.prompt_tokens, 0);
        let d = r.route(&snap, &t, "/v1/models", Some(b"{}"), NOW);
        assert_eq!(d.basis, Basis::LoadOnly(LoadOnlyCause::NotInference));
        let d = r.route(&snap, &t, p, Some(b"{not json"), NOW);
        assert_eq!(d.basis, Basis::LoadOnly(LoadOnlyCause::Unparsable));
        assert!(d.parse_error.is_some());
        assert_eq!(route(&d).endpoint, "pool/e0");
    }

    /// `pool/e0` serving `model-a` and `pool/e1` serving `model-b`, the busier by load (50
    /// running).
    fn two_models() -> Snapshot {
        let mut a = ep(0, 0.1);
        a.models = vec!["model-a".into()];
        let mut b = ep(1, 0.1);
        b.models = vec!["model-b".into()];
        b.running = 50;
        Snapshot::new(1, NOW, vec![a, b])
    }

    /// `snap`'s endpoints, every one unhealthy (version 2).
    fn all_unhealthy(snap: &Snapshot) -> Snapshot {
        let down = |mut e: EndpointStats| {
            e.healthy = false;
            e
        };
        Snapshot::new(2, NOW, snap.endpoints.iter().cloned().map(down).collect())
    }

    /// A body the analysis rejects is routed by load among the endpoints serving the model it
    /// names; a model nobody serves is still unknown.
    #[test]
    fn an_unparsable_body_keeps_its_model() {
        let mut r = router(PolicyKind::LeastRequest);
        let snap = two_models();
        let t = InflightTable::default();
        let p = "/v1/chat/completions";
        let body = |model: &str| {
            format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"n":"1"}}"#
            )
        };
        let d = r.route(&snap, &t, p, Some(body("model-b").as_bytes()), NOW);
        assert_eq!(d.basis, Basis::LoadOnly(LoadOnlyCause::Unparsable));
        assert_eq!(route(&d).endpoint, "pool/e1");
        assert_eq!(route(&d).facts.model.as_deref(), Some("model-b"));
        let d = r.route(&snap, &t, p, Some(body("model-c").as_bytes()), NOW);
        assert_eq!(d.outcome, Outcome::UnknownModel("model-c".into()));
        // A served model nobody can take now: the decision names it, read from the body
        // once, for the 503.
        let sick = all_unhealthy(&snap);
        let d = r.route(&sick, &t, p, Some(body("model-b").as_bytes()), NOW);
        assert_eq!(d.basis, Basis::LoadOnly(LoadOnlyCause::Unparsable));
        assert_eq!(d.outcome, Outcome::NoEndpoints(Some("model-b".into())));
        // No model to read: any endpoint, by load.
        let d = r.route(&snap, &t, p, Some(br#"{"model":7,"messages":[]}"#), NOW);
        assert_eq!(route(&d).endpoint, "pool/e0");
    }

    /// A body with a repeated top-level `model` is one the analysis rejects but vLLM takes
    /// (Python's `json`: the last one counts): routed by load among the endpoints serving
    /// that last model, never to one that does not serve it, and named in the outcome.
    #[test]
    fn a_repeated_model_key_routes_among_the_last_models_endpoints() {
        let mut r = router(PolicyKind::LeastRequest);
        let snap = two_models();
        let t = InflightTable::default();
        let p = "/v1/chat/completions";
        for body in [
            &br#"{"model":"model-b","model":"model-b","messages":[]}"#[..],
            br#"{"model":"model-a","messages":[{"role":"user","content":"hi"}],"model":"model-b"}"#,
        ] {
            let d = r.route(&snap, &t, p, Some(body), NOW);
            let text = String::from_utf8_lossy(body);
            assert_eq!(
                d.basis,
                Basis::LoadOnly(LoadOnlyCause::Unparsable),
                "{text}"
            );
            assert_eq!(route(&d).endpoint, "pool/e1", "{text}");
            assert_eq!(route(&d).facts.model.as_deref(), Some("model-b"), "{text}");
        }
        let body = br#"{"model":"model-c","model":"model-c","messages":[]}"#;
        let d = r.route(&snap, &t, p, Some(body), NOW);
        assert_eq!(d.outcome, Outcome::UnknownModel("model-c".into()));
        let sick = all_unhealthy(&snap);
        let body = br#"{"model":"model-b","model":"model-b","messages":[]}"#;
        let d = r.route(&sick, &t, p, Some(body), NOW);
        assert_eq!(d.outcome, Outcome::NoEndpoints(Some("model-b".into())));
    }

    /// A model no endpoint lists is the client's error (404); a listed model whose endpoints
    /// are all unhealthy is the fleet's (503). LoRA adapters count as listed models.
    #[test]
    fn unknown_model_differs_from_no_healthy_endpoint() {
        let mut r = router(PolicyKind::Hybrid);
        let mut sick = ep(1, 0.1);
        sick.models = vec!["sick".into()];
        sick.lora_adapters = vec!["sick-lora".into()];
        sick.healthy = false;
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.1), sick]);
        let t = InflightTable::default();
        let p = "/v1/chat/completions";
        let body =
            |m: &str| format!(r#"{{"model":"{m}","messages":[{{"role":"user","content":"x"}}]}}"#);
        let d = r.route(&snap, &t, p, Some(body("other").as_bytes()), NOW);
        assert_eq!(d.outcome, Outcome::UnknownModel("other".into()));
        for m in ["sick", "sick-lora"] {
            let d = r.route(&snap, &t, p, Some(body(m).as_bytes()), NOW);
            assert_eq!(d.outcome, Outcome::NoEndpoints(Some(m.into())), "{m}");
        }
        assert_eq!(
            route(&r.route(&snap, &t, p, Some(body("m").as_bytes()), NOW)).endpoint,
            "pool/e0"
        );
        // No model named and nothing healthy: no endpoints, not an unknown model.
        let mut down = ep(0, 0.1);
        down.healthy = false;
        let snap = Snapshot::new(2, NOW, vec![down]);
        assert_eq!(
            r.route(&snap, &t, p, None, NOW).outcome,
            Outcome::NoEndpoints(None)
        );
    }

    /// A model only the snapshot's `unavailable_models` names (its pool has no endpoint at
    /// all: rollout, crash loop, scale from zero) is the fleet's problem (503), not the
    /// client's (404); the endpoints of other models route as before.
    #[test]
    fn unavailable_model_without_endpoints_is_no_endpoints() {
        let mut r = router(PolicyKind::Hybrid);
        let t = InflightTable::default();
        let p = "/v1/chat/completions";
        let body =
            |m: &str| format!(r#"{{"model":"{m}","messages":[{{"role":"user","content":"x"}}]}}"#);
        let mut snap = Snapshot::new(1, NOW, vec![ep(0, 0.1)]);
        snap.unavailable_models = vec!["scaled-to-zero".into()];
        let d = r.route(&snap, &t, p, Some(body("scaled-to-zero").as_bytes()), NOW);
        assert_eq!(
            d.outcome,
            Outcome::NoEndpoints(Some("scaled-to-zero".into()))
        );
        assert_eq!(
            r.route(&snap, &t, p, Some(body("other").as_bytes()), NOW)
                .outcome,
            Outcome::UnknownModel("other".into())
        );
        assert_eq!(
            route(&r.route(&snap, &t, p, Some(body("m").as_bytes()), NOW)).endpoint,
            "pool/e0"
        );
        // No endpoint at all, only the pool's models: still 503 for them.
        let mut empty = Snapshot::new(2, NOW, vec![]);
        empty.unavailable_models = vec!["scaled-to-zero".into()];
        let d = r.route(&empty, &t, p, Some(body("scaled-to-zero").as_bytes()), NOW);
        assert_eq!(
            d.outcome,
            Outcome::NoEndpoints(Some("scaled-to-zero".into()))
        );
        // The next snapshot without the list: the name is unknown again (the fleet view is
        // rebuilt per snapshot, nothing is remembered).
        let d = r.route(
            &Snapshot::new(3, NOW, vec![]),
            &t,
            p,
            Some(body("scaled-to-zero").as_bytes()),
            NOW,
        );
        assert_eq!(d.outcome, Outcome::UnknownModel("scaled-to-zero".into()));
    }

    /// A `/v1/completions` batch (`prompt` an array of strings or of token-id arrays) is
    /// completed once per prompt, `n` times each: its KV demand holds an output for every
    /// one, as the `n` choices of one prompt do, and a response's `completion_tokens`
    /// (summed over all of them) is learned per completion.
    #[test]
    fn a_completions_batch_reserves_an_output_per_prompt() {
        let mut r = router(PolicyKind::Hybrid);
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.0)]);
        let t = InflightTable::default();
        // A model without a profile expects ⌈1000 × 0.5⌉ = 500 tokens per completion.
        for (body, completions) in [
            (r#"{"model":"m","prompt":"a b c","max_tokens":1000}"#, 1),
            (r#"{"model":"m","prompt":[1,2,3],"max_tokens":1000}"#, 1),
            (
                r#"{"model":"m","prompt":["a","b","c","d"],"max_tokens":1000}"#,
                4,
            ),
            (
                r#"{"model":"m","prompt":[[1,2],[3]],"max_tokens":1000,"n":3}"#,
                6,
            ),
        ] {
            let d = r.route(&snap, &t, "/v1/completions", Some(body.as_bytes()), NOW);
            let rt = route(&d);
            assert_eq!(rt.facts.n, completions, "{body}");
            assert_eq!(
                rt.reserve_tokens,
                rt.facts.prompt_tokens + 500 * u64::from(completions),
                "{body}"
            );
            assert_eq!(rt.facts.per_choice(1_000 * u64::from(completions)), 1_000);
        }
    }

    #[test]
    fn over_capacity_is_routed_by_load_and_capped() {
        let mut r = router(PolicyKind::Hybrid);
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.0), ep(1, 0.0)]);
        let t = InflightTable::default();
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":60000,"n":4}"#;
        let d = r.route(&snap, &t, "/v1/chat/completions", Some(body), NOW);
        let rt = route(&d);
        assert!(rt.demand_over_capacity);
        assert_eq!(rt.reserve_tokens, 100_000);
        // Fits the capacity but not the headroom: no capacity (429 / queue), size = demand.
        let snap = Snapshot::new(2, NOW, vec![ep(0, 0.99)]);
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4000,"priority":3}"#;
        let d = r.route(&snap, &t, "/v1/chat/completions", Some(body), NOW);
        match d.outcome {
            Outcome::NoCapacity { priority, size } => {
                assert_eq!(priority, 3);
                assert!(size > 2000 && size < 2100, "{size}");
            }
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn restarted_or_removed_endpoints_lose_prefix_state() {
        let mut r = router(PolicyKind::RoundRobin);
        let t = InflightTable::default();
        let mut e = vec![ep(0, 0.1), ep(1, 0.1)];
        e[0].process_start_ms = Some(1);
        e[1].process_start_ms = Some(1);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        let snap = Snapshot::new(1, NOW, e.clone());
        for _ in 0..2 {
            r.route(&snap, &t, "/v1/completions", Some(body.as_bytes()), NOW);
        }
        assert_eq!(
            (r.prefix_blocks("pool/e0"), r.prefix_blocks("pool/e1")),
            (10, 10)
        );
        // Same version again: nothing forgotten.
        r.route(&snap, &t, "/v1/models", None, NOW);
        assert_eq!(r.prefix_blocks("pool/e0"), 10);
        e[0].process_start_ms = Some(2);
        e.remove(1);
        r.route(&Snapshot::new(2, NOW, e), &t, "/v1/models", None, NOW);
        assert_eq!(r.prefix_blocks("pool/e0"), 0, "restarted");
        assert_eq!(r.prefix_blocks("pool/e1"), 0, "removed");
        // The next request with that prefix matches nothing on the restarted endpoint.
        let mut e0 = ep(0, 0.1);
        e0.process_start_ms = Some(2);
        let snap = Snapshot::new(3, NOW, vec![e0]);
        let d = r.route(&snap, &t, "/v1/completions", Some(body.as_bytes()), NOW);
        assert_eq!(
            (route(&d).prefix_blocks, route(&d).prefix_match_blocks),
            (10, 0)
        );
    }

    #[test]
    fn explained_decisions_carry_the_top_candidates_and_their_terms() {
        let usage = [0.5, 0.1, 0.9, 0.3];
        let snap = Snapshot::new(1, NOW, (0..4).map(|i| ep(i, usage[i])).collect());
        let t = InflightTable::default();
        let body = br#"{"model":"m","prompt":"hello","max_tokens":100}"#;
        let mut r = router(PolicyKind::Hybrid);
        let d = r.route(&snap, &t, "/v1/completions", Some(body), NOW);
        assert!(route(&d).candidates.is_empty(), "off by default");
        r.set_explain(true);
        let d = r.route(&snap, &t, "/v1/completions", Some(body), NOW);
        let rt = route(&d);
        let demand = r
            .demand(&RequestInfo {
                model: Some("m".into()),
                prompt_tokens: rt.facts.prompt_tokens,
                max_output_tokens: Some(100),
                n: 1,
                api: ApiKind::Completions,
                ..RequestInfo::default()
            })
            .1
            .tokens as f64;
        let ids: Vec<&str> = rt.candidates.iter().map(|c| c.endpoint.as_str()).collect();
        assert_eq!(
            ids,
            ["pool/e1", "pool/e3", "pool/e0"],
            "most headroom first, top 3"
        );
        assert_eq!(rt.endpoint, "pool/e1");
        for (c, u) in rt.candidates.iter().zip([0.1, 0.3, 0.5]) {
            // Equal queues and in-flight (terms 1 each), equal prefill work with no prefix
            // anywhere (term 0), no prefix match (0): only the headroom differs.
            let terms = c.pick.terms.unwrap();
            assert!(
                (terms[0] - (1.0 - u - demand / 100_000.0)).abs() < 1e-12,
                "{terms:?}"
            );
            assert_eq!(terms[1..], [1.0, 1.0, 0.0, 0.0]);
            assert_eq!(c.pick.score, terms.iter().sum::<f64>());
            assert_eq!((c.pick.prefix_blocks, c.pick.load), (0, 0));
            assert!(c.predicted_ttft_s > 0.0);
        }
    }

    #[test]
    fn shared_affinity_moves_a_prefix_between_router_instances() {
        // Two workers, four idle endpoints: without sharing, worker B knows nothing of where
        // worker A sent the prefix; with it, B follows A.
        let snap = Snapshot::new(1, NOW, (0..4).map(|i| ep(i, 0.1)).collect());
        let t = InflightTable::default();
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "q".repeat(640));
        let mut a = router(PolicyKind::Hybrid);
        a.share_affinity(true);
        let first = route(&a.route(&snap, &t, "/v1/completions", Some(body.as_bytes()), NOW))
            .endpoint
            .clone();
        let recorded = a.take_recorded();
        assert_eq!(recorded.len(), 1);
        assert_eq!(recorded[0].0, first);
        assert_eq!(recorded[0].1.len(), 10, "640 bytes = 10 blocks of 64");
        assert!(a.take_recorded().is_empty(), "taken once");

        let mut b = router(PolicyKind::Hybrid);
        assert!(
            !b.import_affinity(&first, &recorded[0].1),
            "no snapshot seen yet"
        );
        assert_eq!(b.prefix_blocks(&first), 0);
        b.observe_snapshot(&snap);
        for (id, hashes) in &recorded {
            assert!(b.import_affinity(id, hashes));
        }
        assert!(
            !b.import_affinity("pool/gone", &recorded[0].1),
            "not in the fleet"
        );
        assert_eq!(b.prefix_blocks(&first), 10);
        for _ in 0..3 {
            let d = b.route(&snap, &t, "/v1/completions", Some(body.as_bytes()), NOW);
            assert_eq!(route(&d).endpoint, first);
        }
        // Sharing off: nothing is kept.
        assert!(b.take_recorded().is_empty());
    }

    #[test]
    fn calibration_moves_toward_actual_within_bounds() {
        let mut r = router(PolicyKind::Hybrid);
        let facts = RequestFacts {
            model: Some("m".into()),
            prompt_tokens: 100,
            exact: false,
            stream: false,
            n: 1,
            predicted_work_tokens: 0.0,
        };
        assert_eq!(r.observe_usage(&facts, 200), Some(50));
        assert!((r.estimator().calibration(Some("m")) - 1.1).abs() < 1e-9);
        let exact = RequestFacts {
            exact: true,
            ..facts.clone()
        };
        assert_eq!(r.observe_usage(&exact, 10_000), None);
        assert!((r.estimator().calibration(Some("m")) - 1.1).abs() < 1e-9);
        for _ in 0..200 {
            r.observe_usage(&facts, 100_000);
        }
        assert_eq!(r.estimator().calibration(Some("m")), CALIBRATION_RANGE.1);
    }

    #[test]
    fn learned_output_lengths_set_the_demand() {
        let mut r = router(PolicyKind::Hybrid);
        let req = RequestInfo {
            api: ApiKind::Completions,
            model: Some("m".into()),
            prompt_tokens: 1000,
            prompt_tokens_exact: true,
            ..RequestInfo::default()
        };
        let profile_rule = generic_profile("m").demand_for(1000, u64::from(DEFAULT_MAX_TOKENS), 1);
        assert_eq!(r.demand(&req).1, profile_rule);
        for _ in 0..30 {
            r.observe_output("m", ApiKind::Completions, 1000, 100);
        }
        let learned = r
            .output_lengths()
            .predict("m", ApiKind::Completions, 1000, None, OUTPUT_QUANTILE)
            .expect("30 observations");
        assert!((90..=110).contains(&learned), "{learned}");
        let (limit, d) = r.demand(&req);
        assert_eq!(limit, u64::from(DEFAULT_MAX_TOKENS));
        assert_eq!(
            (d.expected_output_tokens, d.tokens),
            (learned, 1000 + learned)
        );
        let capped = RequestInfo {
            max_output_tokens: Some(40),
            n: 2,
            ..req.clone()
        };
        assert_eq!(r.demand(&capped).1.expected_output_tokens, 80);
        let other = RequestInfo {
            model: Some("other".into()),
            ..req
        };
        assert_eq!(r.demand(&other).1, profile_rule);
    }

    #[test]
    fn first_token_feeds_the_prefill_rate_learner() {
        let mut r = router(PolicyKind::PredictedTtft);
        assert!(r.prefill_rates().is_empty());
        assert!(!r.observe_first_token("pool/e1", 0.0, 0.5), "no work");
        assert!(
            !r.observe_first_token("pool/e1", 4000.0, f64::NAN),
            "bad TTFT"
        );
        assert!(r.observe_first_token("pool/e1", 4000.0, 0.5));
        assert_eq!(r.prefill_rates().len(), 1);
        // A snapshot without the endpoint drops what was learned of it; one with it keeps it.
        assert!(r.observe_first_token("pool/e0", 4000.0, 0.5));
        let t = InflightTable::default();
        let snap = Snapshot::new(1, NOW, vec![ep(0, 0.1)]);
        r.route(&snap, &t, "/v1/chat/completions", None, NOW);
        assert_eq!(r.prefill_rates().len(), 1);
        assert_eq!(r.prefill_rates().estimate("pool/e0").observations, 1);
        assert_eq!(r.prefill_rates().estimate("pool/e1").observations, 0);
    }
}
