//! Routing-quality benchmark (`kvroute-bench`, issue 7): real traces replayed in virtual
//! time over N simulated engine replicas, once per router, side by side.
//!
//! Pieces:
//! - [`workload`]: Mooncake, Azure conv and ShareGPT multi-round as trace rows;
//! - [`baselines`]: round robin, least request, llm-d EPP, SGLang `cache_aware`, NVIDIA
//!   Dynamo's KV router and an oracle, one file each, citing their sources;
//! - this module: one replay ([`run_router`]) and its [`RouterReport`];
//! - [`workers`]: kvroute as Envoy runs it, one router per worker thread
//!   ([`BenchConfig::workers`], one by default), sharing reservations, prefix affinity and
//!   learner observations with the filter's delays;
//! - [`sweep`]: capacity measurement, the (trace × fleet × load × router) sweep on rayon,
//!   the goal check and the online cross-check prediction;
//! - [`output`]: markdown tables, SVG plots (plotters) and the JSON report.
//!
//! Replay algorithm ([`run_router`]):
//! - Row *i* arrives at `timestamp / time_compression` (virtual seconds). Before each
//!   arrival every engine is stepped up to the arrival time.
//! - **Staleness.** Every [`BenchConfig::scrape_interval_ms`] of virtual time (default 200 ms,
//!   kvroute-cp's `scrape.interval_ms`) each replica's stats (KV usage, running, waiting,
//!   KV capacity) are captured; that snapshot reaches the routers
//!   [`BenchConfig::push_delay_ms`] later (default 10 ms, kvroute-cp's
//!   `push.min_interval_ms` coalescing window). Snapshot-driven routers decide with the
//!   latest snapshot that has arrived.
//! - **Reservations are immediate** for the router that made them, as in the filter's
//!   worker (other workers see them as [`workers`] says): kvroute reserves the request's KV
//!   demand in a real [`InflightTable`](kvroute_core::inflight::InflightTable) and the picker gets
//!   [`InflightTable::unseen_totals`](kvroute_core::inflight::InflightTable::unseen_totals) (reservations made since each endpoint's scrape);
//!   baselines get their own router-local in-flight counts. Each reservation also carries
//!   the request's pending prefill (prompt tokens minus those the router's own prefix index
//!   expects cached on the chosen replica), zeroed at the request's first token (the filter
//!   does this on the first response bytes), when the router also learns prefill throughput
//!   from the route's predicted work and the measured TTFT
//!   ([`kvroute_core::router::Router::observe_first_token`]; only if that prefill was
//!   pending, as in the filter). Reservations are released on the request's last token
//!   (stream end).
//! - kvroute policies go through the filter's own pipeline, [`kvroute_core::router::Router`]
//!   ([`kvroute_router`]): the row becomes a request of `input_length` exact prompt tokens
//!   and no output limit (a router cannot know the output length), KV demand from the
//!   router's learned output lengths ([`kvroute_core::router::Router::observe_output`], fed
//!   with the usage of the finished rows the router's sampler chose at their first token,
//!   [`kvroute_core::router::Router::sample_usage`], as the filter does) or the model's
//!   profile until enough were seen, the
//!   prefix index matched before the pick and recorded for the chosen endpoint;
//!   the index holds the replica's KV capacity in 512-token blocks. A `NoCapacity` answer
//!   (the gateway's 429) sends the request to the replica with the fewest in-flight requests
//!   and counts it in [`RouterReport::overflow`], so every router serves every row.
//! - What kvroute's router sees of a row is [`BenchConfig::prefix_view`]: by default the
//!   trace's block ids as a request description ([`PrefixView::TraceIds`]); for the online
//!   cross-check, the request body the demo sends, through the filter's own entry point
//!   ([`PrefixView::FilterText`]).
//! - Trace `hash_ids` (one per 512-token block) become router block hashes by chaining
//!   xxh64 ([`chain_ids`]); engines key their prefix cache with
//!   [`kvroute_sim::api::id_block_hashes`], as `kvroute-sim` does.
//!
//! Metrics ([`RouterReport`]): TTFT p50/p90/p99, E2E p50/p99 (nearest rank), output
//! tokens/s = generated tokens / (last completion − first arrival), SLO attainment = share
//! of offered requests with TTFT ≤ [`SLO_TTFT_S`] and with TPOT ≤ [`SLO_TPOT_S`] (TPOT =
//! (E2E − TTFT) / (output − 1); single-token outputs meet it), prefix-cache hit rate =
//! prompt tokens found in the engine's cache at each request's first admission / prompt
//! tokens (re-admissions after preemption excluded), preemptions, and imbalance = the mean, over
//! scrape instants where any request runs, of max/mean running requests across replicas
//! (1.0 = perfectly even).
//!
//! Everything is deterministic for a seed: the engines are deterministic and every random
//! tie-break comes from a seeded `fastrand::Rng`.

pub mod baselines;
pub mod ceiling;
pub mod output;
pub mod sweep;
pub mod workers;
pub mod workload;

use std::collections::{HashMap, VecDeque};

use kvroute_core::analysis::ApiKind;
use kvroute_core::percentile::percentile;
use kvroute_core::picker::{PickerConfig, PolicyKind};
use kvroute_core::router::{Outcome, RequestFacts, RequestInfo, RouterConfig};
use kvroute_core::snapshot::{EndpointStats, Snapshot};

use baselines::dynamo::DynamoWorker;
use baselines::{
    DynamoKv, EndpointView, LeastRequest, LlmdEpp, LlmdGuide, Oracle, OracleView, RoundRobin,
    SglangCacheAware,
};
use kvroute_sim::api::{id_block_hashes, DEFAULT_PREFIX_BLOCK_TOKENS};
use kvroute_sim::engine::{Engine, EngineConfig, EngineEvent, SimRequest};
use kvroute_sim::trace::TraceRow;
use workers::{WorkerModel, Workers};

/// Tokens per trace `hash_id` block (Mooncake FAST'25 traces).
pub const TRACE_BLOCK_TOKENS: u32 = 512;
/// TTFT SLO (seconds) of the attainment metric (issue 7).
pub const SLO_TTFT_S: f64 = 2.0;
/// TPOT SLO (seconds per output token) of the attainment metric (issue 7).
pub const SLO_TPOT_S: f64 = 0.1;
/// Default scrape interval, ms (kvroute-cp `scrape.interval_ms` default).
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 200;
/// Default push delay, ms (kvroute-cp `push.min_interval_ms` default).
pub const DEFAULT_PUSH_DELAY_MS: u64 = 10;
/// Path of the requests [`PrefixView::FilterText`] routes (what `kvroute-demo` sends).
const CHAT_PATH: &str = "/v1/chat/completions";

/// A router under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterKind {
    /// [`baselines::RoundRobin`].
    RoundRobin,
    /// [`baselines::LeastRequest`].
    LeastRequest,
    /// [`baselines::LlmdEpp`].
    LlmdEpp,
    /// [`baselines::LlmdGuide`].
    LlmdGuide,
    /// [`baselines::SglangCacheAware`].
    SglangCacheAware,
    /// [`baselines::DynamoKv`].
    DynamoKv,
    /// [`baselines::Oracle`].
    Oracle,
    /// A kvroute picker policy through the filter's pipeline,
    /// [`kvroute_core::router::Router`] (`Hybrid` is the default).
    Kvroute(PolicyKind),
}

impl RouterKind {
    /// Display name (`round_robin`, `least_request`, `llmd-epp`, `sglang-cache-aware`,
    /// `dynamo-kv`, `oracle`, `kvroute-<policy>`).
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::RoundRobin => "round_robin",
            RouterKind::LeastRequest => "least_request",
            RouterKind::LlmdEpp => "llmd-epp",
            RouterKind::LlmdGuide => "llmd-guide",
            RouterKind::SglangCacheAware => "sglang-cache-aware",
            RouterKind::DynamoKv => "dynamo-kv",
            RouterKind::Oracle => "oracle",
            RouterKind::Kvroute(p) => match p {
                PolicyKind::RoundRobin => "kvroute-round_robin",
                PolicyKind::Random => "kvroute-random",
                PolicyKind::LeastRequest => "kvroute-least_request",
                PolicyKind::LeastKv => "kvroute-least_kv",
                PolicyKind::PrefixAffinity => "kvroute-prefix_affinity",
                PolicyKind::Hybrid => "kvroute-hybrid",
                PolicyKind::PredictedTtft => "kvroute-predicted_ttft",
            },
        }
    }

    /// kvroute's default policy.
    pub fn kvroute_default() -> RouterKind {
        RouterKind::Kvroute(PolicyKind::default())
    }

    /// The benchmark's nine routers, `round_robin` first (the ratio baseline): six baselines,
    /// the oracle, kvroute's `predicted_ttft` policy, and kvroute's default (`hybrid`) last.
    pub fn all() -> [RouterKind; 9] {
        [
            RouterKind::RoundRobin,
            RouterKind::LeastRequest,
            RouterKind::LlmdEpp,
            RouterKind::LlmdGuide,
            RouterKind::SglangCacheAware,
            RouterKind::DynamoKv,
            RouterKind::Oracle,
            RouterKind::Kvroute(PolicyKind::PredictedTtft),
            RouterKind::kvroute_default(),
        ]
    }

    /// True for the six non-oracle, non-kvroute baselines.
    pub fn is_baseline(self) -> bool {
        !matches!(self, RouterKind::Oracle | RouterKind::Kvroute(_))
    }

    /// Parse a [`RouterKind::name`].
    pub fn from_name(s: &str) -> Option<RouterKind> {
        let extra = [
            PolicyKind::RoundRobin,
            PolicyKind::Random,
            PolicyKind::LeastRequest,
            PolicyKind::LeastKv,
            PolicyKind::PrefixAffinity,
            PolicyKind::Hybrid,
            PolicyKind::PredictedTtft,
        ]
        .map(RouterKind::Kvroute);
        RouterKind::all()
            .into_iter()
            .chain(extra)
            .find(|k| k.name() == s)
    }
}

/// What kvroute's router is told about a row's prompt, and how its prefix index is sized.
/// Baselines always see the trace's `hash_ids`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixView {
    /// The row as a [`RequestInfo`]: exact prompt tokens, no output limit, one chained hash
    /// per trace `hash_id` ([`chain_ids`]), and a prefix index of one replica's KV capacity
    /// in [`TRACE_BLOCK_TOKENS`]-token blocks. The sweep's view: every router sees the
    /// same blocks.
    #[default]
    TraceIds,
    /// What the filter sees when `kvroute-demo` replays the row: its request body
    /// ([`crate::replay::workload::mooncake_sim_body`]) through
    /// [`kvroute_core::router::Router::route`] on `/v1/chat/completions`, with the filter's
    /// default configuration. So the prompt is estimated from text, `max_tokens` is the
    /// row's output, prefix hashes are 64-character blocks of the first 16 KiB of text only
    /// (about 4.6 of the trace's 512-token blocks), and the index holds
    /// [`kvroute_core::prefix::DEFAULT_INDEX_CAPACITY`] of them per endpoint. Output
    /// lengths are learned per chat API, as the filter learns them; the estimator's
    /// calibration from `usage` is not replayed (the synthetic text's estimate is within a
    /// few tokens of the row's length). Models the online cross-check
    /// ([`sweep::crosscheck`]); needs `hash_ids` (Mooncake rows).
    FilterText,
}

/// Benchmark setup of one replay.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Engine replicas (≥ 1).
    pub replicas: usize,
    /// Arrival times are divided by this (×k faster traffic; ≥ 1e-6).
    pub time_compression: f64,
    /// Stats scrape period, virtual milliseconds (≥ 1).
    pub scrape_interval_ms: u64,
    /// Delay from a scrape to the routers seeing it, virtual milliseconds.
    pub push_delay_ms: u64,
    /// Seed of every random tie-break.
    pub seed: u64,
    /// Model name (seeds the engines' block hashes, fills the snapshot).
    pub model: String,
    /// kvroute picker configuration (its `policy` is overridden by [`RouterKind::Kvroute`]).
    pub picker: PickerConfig,
    /// What kvroute's router sees of each row (default [`PrefixView::TraceIds`]).
    pub prefix_view: PrefixView,
    /// kvroute's `usage_sample_ms`: which finished rows its output-length learner sees
    /// ([`kvroute_core::router::Router::sample_usage`]; default the filter's, 0 = all).
    pub usage_sample_ms: u64,
    /// Envoy workers kvroute routes on, each with its own router ([`workers`]; default one).
    pub workers: WorkerModel,
}

impl BenchConfig {
    /// Defaults: scrape 200 ms, push delay 10 ms, default picker config.
    pub fn new(replicas: usize, time_compression: f64, seed: u64, model: &str) -> Self {
        Self {
            replicas,
            time_compression,
            scrape_interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            push_delay_ms: DEFAULT_PUSH_DELAY_MS,
            seed,
            model: model.to_string(),
            picker: PickerConfig::default(),
            prefix_view: PrefixView::default(),
            usage_sample_ms: RouterConfig::default().usage_sample_ms,
            workers: WorkerModel::default(),
        }
    }
}

/// Per-router results. Times in virtual seconds, ratios 0..1.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouterReport {
    /// Router name.
    pub router: String,
    /// Rows offered.
    pub requests: usize,
    /// Rows the engine refused (prompt larger than the KV cache).
    pub rejected: usize,
    /// Requests that produced their last token.
    pub finished: usize,
    /// Request ids that finished more than once (must be 0).
    pub duplicate_finishes: usize,
    /// kvroute picks answered `NoCapacity`/`NoEndpoints`, sent to the least-loaded replica.
    pub overflow: usize,
    /// TTFT median (seconds).
    pub ttft_p50: f64,
    /// TTFT p90 (seconds).
    pub ttft_p90: f64,
    /// TTFT p99 (seconds).
    pub ttft_p99: f64,
    /// End-to-end latency median (seconds).
    pub e2e_p50: f64,
    /// End-to-end latency p99 (seconds).
    pub e2e_p99: f64,
    /// Generated tokens per virtual second, first arrival to last completion.
    pub output_tokens_per_s: f64,
    /// Share of offered requests with TTFT ≤ 2 s (0..1).
    pub slo_ttft: f64,
    /// Share of offered requests with TPOT ≤ 100 ms (0..1).
    pub slo_tpot: f64,
    /// Prefix-cache hit rate (0..1): prompt tokens found in the cache at each request's
    /// first admission / prompt tokens. Re-admissions after a preemption are excluded (they
    /// would count the request's own blocks as hits).
    pub prefix_hit_ratio: f64,
    /// Preemptions over all replicas.
    pub preemptions: u64,
    /// Mean over scrape instants of max/mean running requests (≥ 1; 0 if never busy).
    pub imbalance: f64,
    /// Requests per replica (load spread).
    pub per_replica: Vec<usize>,
    /// Virtual time at the end (seconds).
    pub virtual_seconds: f64,
}

/// Chain trace block ids into router block hashes (`h_i = xxh64(h_{i−1} ‖ id_i)`, seed 0),
/// so equal hashes mean equal prefixes up to and including that block.
pub fn chain_ids(ids: &[u64]) -> Vec<u64> {
    let mut prev = 0u64;
    ids.iter()
        .map(|id| {
            let mut h = xxhash_rust::xxh64::Xxh64::new(0);
            h.update(&prev.to_le_bytes());
            h.update(&id.to_le_bytes());
            prev = h.digest();
            prev
        })
        .collect()
}

enum Router {
    Kv(Box<Workers>),
    Rr(RoundRobin),
    Lr(LeastRequest),
    Llmd(LlmdEpp),
    LlmdGuide(LlmdGuide),
    Sglang(SglangCacheAware),
    Dynamo(DynamoKv),
    Oracle(Oracle),
}

#[derive(Debug, Clone, Copy, Default)]
struct Req {
    arrival: f64,
    replica: usize,
    prompt: u32,
    output: u32,
    first: Option<f64>,
    admitted: bool,
    done: bool,
    /// Router-tracked pending prefill charged at pick time (llm-d guide, Dynamo), tokens.
    prefill_charge: u64,
    /// kvroute's predicted effective prefill work at pick time (learner input), tokens.
    predicted_work: f64,
    /// kvroute reads this response's `usage` (chosen at its first token by the router's
    /// sampler, as the filter chooses at the response's headers).
    usage_read: bool,
    /// The filter worker that routed it (kvroute; 0 otherwise).
    worker: usize,
}

struct State {
    engines: Vec<Engine>,
    reqs: Vec<Req>,
    /// Router-local in-flight requests per replica (immediate).
    inflight: Vec<u64>,
    /// Dynamo's router-tracked active tokens per replica.
    active_tokens: Vec<u64>,
    /// Requests without a first token yet, per replica (for the oracle).
    prefilling: Vec<Vec<u64>>,
    /// Router-tracked pending prefill tokens per replica (llm-d guide's in-flight load,
    /// Dynamo's active prefill tokens): charged at pick, released at the first token.
    pending_prefill: Vec<u64>,
    /// (request, replica, TTFT seconds) of first tokens not yet fed to the router.
    first_tokens: Vec<(u64, usize, f64)>,
    /// Requests finished and not yet fed to the router.
    finished_ids: Vec<u64>,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    tpot_ok: usize,
    ttft_ok: usize,
    generated: u64,
    last_finish: f64,
    finished: usize,
    duplicates: usize,
    imbalance_sum: f64,
    imbalance_n: u64,
    /// Prefix-cache hit tokens at each request's first admission.
    hit_tokens: u64,
    /// Prompt tokens of admitted requests.
    query_tokens: u64,
}

impl State {
    fn absorb(&mut self, events: Vec<EngineEvent>) {
        for ev in events {
            let (id, time, index, last) = match ev {
                EngineEvent::Token {
                    id,
                    time,
                    index,
                    last,
                } => (id, time, index, last),
                EngineEvent::Admitted {
                    id, cached_tokens, ..
                } => {
                    if let Some(r) = self.reqs.get_mut(id as usize) {
                        if !r.admitted {
                            r.admitted = true;
                            self.hit_tokens += u64::from(cached_tokens);
                            self.query_tokens += u64::from(r.prompt);
                        }
                    }
                    continue;
                }
                EngineEvent::Preempted { .. } => continue,
            };
            let Some(r) = self.reqs.get_mut(id as usize) else {
                continue;
            };
            let k = r.replica;
            if let Some(a) = self.active_tokens.get_mut(k) {
                *a = a.saturating_add(1);
            }
            if index == 1 {
                r.first = Some(time);
                let ttft = time - r.arrival;
                if let Some(p) = self.pending_prefill.get_mut(k) {
                    *p = p.saturating_sub(r.prefill_charge);
                }
                self.first_tokens.push((id, k, ttft));
                self.ttft.push(ttft);
                if ttft <= SLO_TTFT_S {
                    self.ttft_ok += 1;
                }
                if let Some(p) = self.prefilling.get_mut(k) {
                    if let Some(pos) = p.iter().position(|&x| x == id) {
                        p.swap_remove(pos);
                    }
                }
            }
            if !last {
                continue;
            }
            if r.done {
                self.duplicates += 1;
                continue;
            }
            r.done = true;
            self.finished_ids.push(id);
            self.finished += 1;
            self.generated += u64::from(r.output);
            self.last_finish = self.last_finish.max(time);
            self.e2e.push(time - r.arrival);
            let first = r.first.unwrap_or(time);
            let tpot = if r.output > 1 {
                (time - first) / f64::from(r.output - 1)
            } else {
                0.0
            };
            if tpot <= SLO_TPOT_S {
                self.tpot_ok += 1;
            }
            let used = u64::from(r.prompt) + u64::from(r.output);
            if let Some(f) = self.inflight.get_mut(k) {
                *f = f.saturating_sub(1);
            }
            if let Some(a) = self.active_tokens.get_mut(k) {
                *a = a.saturating_sub(used);
            }
        }
    }

    /// Step every engine until its clock reaches `t` (or it idles), then advance idle ones.
    fn run_to(&mut self, t: f64) {
        for k in 0..self.engines.len() {
            while let Some(e) = self.engines.get_mut(k) {
                if e.is_idle() || e.now() >= t {
                    e.advance_to(t);
                    break;
                }
                match e.step() {
                    Some(r) => self.absorb(r.events),
                    None => break,
                }
            }
        }
    }

    fn sample_imbalance(&mut self) {
        let n = self.engines.len().max(1) as f64;
        let running: Vec<usize> = self.engines.iter().map(Engine::num_running).collect();
        let sum: usize = running.iter().sum();
        if sum == 0 {
            return;
        }
        let max = running.iter().copied().max().unwrap_or(0) as f64;
        self.imbalance_sum += max / (sum as f64 / n);
        self.imbalance_n += 1;
    }

    fn snapshot(&self, model: &str, now_ms: u64, version: u64) -> Snapshot {
        let endpoints = self
            .engines
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let c = e.config();
                EndpointStats {
                    id: format!("replica-{i}"),
                    address: format!("10.0.0.{i}:8000"),
                    cluster: format!("replica-{i}"),
                    pool: String::new(),
                    models: vec![model.to_string()],
                    lora_adapters: Vec::new(),
                    kv_usage: Some(e.kv_usage()),
                    kv_capacity_tokens: Some(u64::from(c.num_gpu_blocks) * u64::from(c.block_size)),
                    block_size: Some(c.block_size),
                    running: u32::try_from(e.num_running()).unwrap_or(u32::MAX),
                    waiting: u32::try_from(e.num_waiting()).unwrap_or(u32::MAX),
                    healthy: true,
                    scraped_at_ms: now_ms,
                    process_start_ms: Some(0),
                    peer_inflight_requests: 0,
                    peer_inflight_tokens: 0,
                }
            })
            .collect();
        Snapshot {
            format: kvroute_core::snapshot::FORMAT_VERSION,
            version,
            generated_at_ms: now_ms,
            unavailable_models: Vec::new(),
            endpoints,
        }
    }

    fn oracle_view(&self, k: usize, engine_hashes: &[u64]) -> OracleView {
        let Some(e) = self.engines.get(k) else {
            return OracleView::default();
        };
        let bs = e.config().block_size;
        let pending = self
            .prefilling
            .get(k)
            .map(|ids| {
                ids.iter()
                    .filter_map(|&id| e.progress(id))
                    .map(|p| u64::from(p.prompt_tokens.saturating_sub(p.computed)))
                    .sum()
            })
            .unwrap_or(0);
        OracleView {
            cached_tokens: cached_blocks(e, engine_hashes).saturating_mul(bs),
            pending_prefill_tokens: pending,
            free_kv_tokens: u64::from(e.pool().num_free()) * u64::from(bs),
            running: u32::try_from(e.num_running()).unwrap_or(u32::MAX),
        }
    }
}

fn cached_blocks(e: &Engine, engine_hashes: &[u64]) -> u32 {
    u32::try_from(e.pool().lookup(engine_hashes).len()).unwrap_or(u32::MAX)
}

/// The core routing pipeline ([`kvroute_core::router::Router`], the filter's) as the
/// benchmark configures it for `policy`: `cfg.picker` with that policy, default estimator,
/// prefix hashing and model profiles, and a prefix index holding one replica's KV capacity
/// in [`TRACE_BLOCK_TOKENS`]-token blocks ([`PrefixView::TraceIds`]) or the filter's
/// default capacity ([`PrefixView::FilterText`]). An invalid `cfg.picker` falls back to
/// the default picker configuration; `None` only if that fails too.
pub fn kvroute_router(
    policy: PolicyKind,
    engine: &EngineConfig,
    cfg: &BenchConfig,
) -> Option<kvroute_core::router::Router> {
    let cap_tokens = u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size);
    let index_blocks = match cfg.prefix_view {
        PrefixView::TraceIds => {
            usize::try_from(cap_tokens / u64::from(TRACE_BLOCK_TOKENS)).unwrap_or(1)
        }
        PrefixView::FilterText => RouterConfig::default().prefix_index_blocks,
    };
    let config = |picker: PickerConfig| RouterConfig {
        picker: PickerConfig { policy, ..picker },
        prefix_index_blocks: index_blocks,
        usage_sample_ms: cfg.usage_sample_ms,
        ..RouterConfig::default()
    };
    kvroute_core::router::Router::new(config(cfg.picker.clone()), cfg.seed)
        .or_else(|_| kvroute_core::router::Router::new(config(PickerConfig::default()), cfg.seed))
        .ok()
}

fn build_router(
    kind: RouterKind,
    engine: &EngineConfig,
    cfg: &BenchConfig,
    max_entries: usize,
) -> Router {
    match kind {
        RouterKind::Kvroute(policy) => {
            // Worker w's router draws its tie-breaks from its own stream (worker 0: the
            // benchmark's seed, so one worker replays as before; the others' mixed, so that
            // no worker shares a stream with a worker of another seed's run).
            let make = |w: usize| {
                let seeded = BenchConfig {
                    seed: cfg.seed ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    ..cfg.clone()
                };
                kvroute_router(policy, engine, &seeded)
            };
            match Workers::new(cfg.workers, max_entries, cfg.seed, make) {
                Some(w) => Router::Kv(Box::new(w)),
                None => Router::Lr(LeastRequest),
            }
        }
        RouterKind::RoundRobin => Router::Rr(RoundRobin::new()),
        RouterKind::LeastRequest => Router::Lr(LeastRequest),
        RouterKind::LlmdEpp => Router::Llmd(LlmdEpp::new(cfg.seed)),
        RouterKind::LlmdGuide => Router::LlmdGuide(LlmdGuide::new(cfg.seed)),
        RouterKind::SglangCacheAware => Router::Sglang(SglangCacheAware::new()),
        RouterKind::DynamoKv => Router::Dynamo(DynamoKv::new(engine.block_size, cfg.seed)),
        RouterKind::Oracle => Router::Oracle(Oracle),
    }
}

/// Feed what kvroute would observe from responses since the last call, each to the worker
/// that routed the request: its in-flight table marks the prefill done at the first token
/// (the filter does so on the first response bytes) and releases the reservation at the
/// last; its prefill-rate learner gets (predicted work at pick, TTFT) of each first token
/// that ended a pending prefill (as the filter samples TTFT), its output-length model the
/// (prompt, output) usage of each finished request — the filter's first-byte and `usage`
/// observations, for requests of `api`.
fn feed(router: &mut Router, st: &mut State, model: &str, api: ApiKind, ids: &[String]) {
    let firsts = std::mem::take(&mut st.first_tokens);
    let done = std::mem::take(&mut st.finished_ids);
    let Router::Kv(workers) = router else {
        return;
    };
    let facts = RequestFacts {
        model: Some(model.to_owned()),
        stream: true,
        ..RequestFacts::default()
    };
    for (id, k, ttft) in firsts {
        let (Some(r), Some(ep)) = (st.reqs.get_mut(id as usize), ids.get(k)) else {
            continue;
        };
        let pending = workers.first_token(r.worker, id);
        let Some(router) = workers.router(r.worker) else {
            continue;
        };
        if pending {
            router.observe_first_token(ep, r.predicted_work, ttft);
        }
        // The response begins at its first token (all rows stream): the router's sampler
        // chooses whether its usage is read, as in the filter.
        let begins_ms = ((r.arrival + ttft) * 1e3).max(0.0) as u64;
        r.usage_read = router.sample_usage(&facts, begins_ms);
    }
    for id in done {
        let Some(r) = st.reqs.get(id as usize) else {
            continue;
        };
        workers.release(r.worker, id);
        if let (true, Some(router)) = (r.usage_read, workers.router(r.worker)) {
            router.observe_output(model, api, u64::from(r.prompt), u64::from(r.output));
        }
    }
}

/// Output-length quantile kvroute reserves KV for (the median; the core router's).
pub use kvroute_core::router::OUTPUT_QUANTILE;
/// The model profile's expected output without a limit: ⌈1 024 × 0.5⌉ tokens
/// (`kvroute_core::profile`).
pub const PROFILE_EXPECTED_OUTPUT: u64 = 512;

/// Replay `rows` through `cfg.replicas` engines of `engine` with one router. Never panics;
/// an empty trace gives an all-zero report.
pub fn run_router(
    rows: &[TraceRow],
    engine: &EngineConfig,
    cfg: &BenchConfig,
    kind: RouterKind,
) -> RouterReport {
    let n = cfg.replicas.max(1);
    let compression = if cfg.time_compression.is_finite() && cfg.time_compression > 1e-6 {
        cfg.time_compression
    } else {
        1.0
    };
    let interval_ms = cfg.scrape_interval_ms.max(1);
    let mut router = build_router(kind, engine, cfg, rows.len().max(1));
    let mut st = State {
        engines: (0..n).map(|_| Engine::new(engine.clone())).collect(),
        reqs: vec![Req::default(); rows.len()],
        inflight: vec![0; n],
        active_tokens: vec![0; n],
        prefilling: vec![Vec::new(); n],
        pending_prefill: vec![0; n],
        first_tokens: Vec::new(),
        finished_ids: Vec::new(),
        ttft: Vec::with_capacity(rows.len()),
        e2e: Vec::with_capacity(rows.len()),
        tpot_ok: 0,
        ttft_ok: 0,
        generated: 0,
        last_finish: 0.0,
        finished: 0,
        duplicates: 0,
        imbalance_sum: 0.0,
        imbalance_n: 0,
        hit_tokens: 0,
        query_tokens: 0,
    };
    let ids: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
    // The API kvroute's router sees (the demo sends chat requests), and the block texts of
    // the bodies it renders (ids repeat across rows).
    let api = match cfg.prefix_view {
        PrefixView::TraceIds => ApiKind::Completions,
        PrefixView::FilterText => ApiKind::ChatCompletions,
    };
    let mut block_texts: HashMap<u64, String> = HashMap::new();
    let mut snap = st.snapshot(&cfg.model, 0, 0);
    let mut in_transit: VecDeque<(u64, Snapshot)> = VecDeque::new();
    let mut next_scrape_ms = interval_ms;
    let mut per_replica = vec![0usize; n];
    let (mut rejected, mut overflow) = (0usize, 0usize);
    let first_arrival = rows
        .first()
        .map_or(0.0, |r| r.timestamp as f64 / 1000.0 / compression);
    for (i, row) in rows.iter().enumerate() {
        let t = row.timestamp as f64 / 1000.0 / compression;
        let t_ms = (t * 1000.0) as u64;
        while next_scrape_ms <= t_ms {
            if in_transit.is_empty() && st.engines.iter().all(Engine::is_idle) {
                // Idle fleet: every scrape until the arrival would show the same idle state,
                // so jump to the last two scrape instants before it (exact, and O(1) for long
                // idle gaps at low arrival rates).
                let last = t_ms - (t_ms - next_scrape_ms) % interval_ms;
                next_scrape_ms = next_scrape_ms.max(last.saturating_sub(interval_ms));
            }
            st.run_to(next_scrape_ms as f64 / 1000.0);
            feed(&mut router, &mut st, &cfg.model, api, &ids);
            st.sample_imbalance();
            let s = st.snapshot(&cfg.model, next_scrape_ms, next_scrape_ms / interval_ms);
            in_transit.push_back((next_scrape_ms.saturating_add(cfg.push_delay_ms), s));
            next_scrape_ms += interval_ms;
        }
        while in_transit.front().is_some_and(|(at, _)| *at <= t_ms) {
            if let Some((_, s)) = in_transit.pop_front() {
                snap = s;
            }
        }
        // kvroute's worker ticks due before this arrival, each after the engines ran to it
        // (none with one worker).
        while let Some(at) = match &router {
            Router::Kv(w) => w.next_tick(t_ms),
            _ => None,
        } {
            st.run_to(at as f64 / 1000.0);
            feed(&mut router, &mut st, &cfg.model, api, &ids);
            if let Router::Kv(w) = &mut router {
                w.tick(at, &snap);
            }
        }
        st.run_to(t);
        feed(&mut router, &mut st, &cfg.model, api, &ids);
        let prompt = row.input_length.max(1);
        let output = row.output_length.max(1);
        let hashes = chain_ids(&row.hash_ids);
        let engine_hashes = id_block_hashes(
            &cfg.model,
            &row.hash_ids,
            DEFAULT_PREFIX_BLOCK_TOKENS,
            prompt,
            engine.block_size,
        );
        let views: Vec<EndpointView> = snap
            .endpoints
            .iter()
            .zip(&st.inflight)
            .map(|(e, &f)| EndpointView {
                kv_usage: e.kv_usage.unwrap_or(0.0),
                waiting: e.waiting,
                running: e.running,
                inflight: f,
            })
            .collect();
        let least_loaded = LeastRequest.pick(&views).unwrap_or(0);
        // kvroute's reservation for the chosen replica (set by the Kv arm): KV demand and
        // pending prefill, tokens, and the work its TTFT model predicted ahead of the first
        // token (fed back with the measured TTFT).
        let mut reserve = u64::from(prompt) + PROFILE_EXPECTED_OUTPUT;
        let mut prefill_estimate = 0u64;
        let mut predicted_work = 0.0f64;
        // Pending prefill a baseline's router charges to the chosen replica.
        let mut prefill_charge = 0u64;
        let mut worker = 0;
        let chosen = match &mut router {
            Router::Kv(workers) => {
                worker = workers.assign();
                let info = RequestInfo {
                    api: ApiKind::Completions,
                    model: Some(cfg.model.clone()),
                    prompt_tokens: u64::from(prompt),
                    prompt_tokens_exact: true,
                    // A trace row carries no output limit (the real output length is what the
                    // engine generates, unknown to a router): KV demand comes from the learned
                    // output lengths, or the model profile's rule until enough were seen.
                    max_output_tokens: None,
                    n: 1,
                    priority: 0,
                    // Trace rows stand for streamed requests (the benchmark times first tokens).
                    stream: true,
                    prefix_hashes: hashes.clone(),
                };
                let body = match cfg.prefix_view {
                    PrefixView::TraceIds => None,
                    PrefixView::FilterText => Some(crate::replay::workload::mooncake_sim_body(
                        &cfg.model,
                        &row.hash_ids,
                        prompt,
                        output,
                        (cfg.seed, i as u64),
                        &mut block_texts,
                    )),
                };
                let decided = workers.decide(worker, t_ms, |router, tables| {
                    let decision = match &body {
                        None => router.route_request(&snap, tables, &info, t_ms),
                        Some(body) => router.route(&snap, tables, CHAT_PATH, Some(body), t_ms),
                    };
                    let demand = match decision.outcome {
                        Outcome::Route(_) | Outcome::NoCapacity { .. } => 0,
                        Outcome::NoEndpoints(_) | Outcome::UnknownModel(_) => {
                            router.demand(&info).1.tokens
                        }
                    };
                    (decision.outcome, demand)
                });
                // A worker that does not exist cannot happen (`assign` draws among them).
                let (outcome, demand) = decided.unwrap_or((
                    Outcome::NoEndpoints(None),
                    u64::from(prompt) + PROFILE_EXPECTED_OUTPUT,
                ));
                match outcome {
                    Outcome::Route(r) => {
                        prefill_estimate = r.prefill_tokens;
                        reserve = r.reserve_tokens;
                        predicted_work = r.facts.predicted_work_tokens;
                        r.primary
                    }
                    Outcome::NoCapacity { size, .. } => {
                        overflow += 1;
                        prefill_estimate = u64::from(prompt);
                        reserve = size;
                        least_loaded
                    }
                    Outcome::NoEndpoints(_) | Outcome::UnknownModel(_) => {
                        overflow += 1;
                        prefill_estimate = u64::from(prompt);
                        reserve = demand;
                        least_loaded
                    }
                }
            }
            Router::Rr(p) => p.pick(n).unwrap_or(0),
            Router::Lr(p) => p.pick(&views).unwrap_or(0),
            Router::Llmd(p) => p.pick(&ids, &views, &hashes).unwrap_or(least_loaded),
            Router::LlmdGuide(p) => match p.pick(&ids, &st.pending_prefill, &hashes, prompt) {
                Some(g) => {
                    prefill_charge = g.charge_tokens;
                    g.index
                }
                None => least_loaded,
            },
            Router::Sglang(p) => p
                .pick(&ids, &views, &hashes, prompt)
                .unwrap_or(least_loaded),
            Router::Dynamo(p) => {
                let workers: Vec<DynamoWorker> = st
                    .engines
                    .iter()
                    .zip(&st.active_tokens)
                    .zip(&st.pending_prefill)
                    .map(|((e, &a), &pf)| DynamoWorker {
                        overlap_blocks: cached_blocks(e, &engine_hashes),
                        active_tokens: a,
                        active_prefill_tokens: pf,
                    })
                    .collect();
                let k = p.pick(&workers, prompt).unwrap_or(least_loaded);
                prefill_charge = workers.get(k).map_or(0, |w| p.new_tokens(w, prompt));
                k
            }
            Router::Oracle(p) => {
                let ov: Vec<OracleView> =
                    (0..n).map(|k| st.oracle_view(k, &engine_hashes)).collect();
                p.pick(&ov, prompt, output).unwrap_or(least_loaded)
            }
        };
        let k = chosen.min(n - 1);
        if let Some(r) = st.reqs.get_mut(i) {
            *r = Req {
                arrival: t,
                replica: k,
                prompt,
                output,
                first: None,
                admitted: false,
                done: false,
                prefill_charge,
                predicted_work,
                usage_read: false,
                worker,
            };
        }
        let req = SimRequest {
            id: i as u64,
            prompt_tokens: prompt,
            output_tokens: output,
            block_hashes: engine_hashes,
            priority: 0,
        };
        let Some(e) = st.engines.get_mut(k) else {
            continue;
        };
        if e.submit(req).is_err() {
            rejected += 1;
            continue;
        }
        if let Some(c) = per_replica.get_mut(k) {
            *c += 1;
        }
        if let Some(f) = st.inflight.get_mut(k) {
            *f += 1;
        }
        if let Some(a) = st.active_tokens.get_mut(k) {
            *a = a.saturating_add(u64::from(prompt));
        }
        if let Some(p) = st.prefilling.get_mut(k) {
            p.push(i as u64);
        }
        if let Some(p) = st.pending_prefill.get_mut(k) {
            *p = p.saturating_add(prefill_charge);
        }
        if let (Router::Kv(workers), Some(id)) = (&mut router, ids.get(k)) {
            workers.reserve(worker, i as u64, id, reserve, prefill_estimate, t_ms);
        }
    }
    // Drain, still sampling imbalance at scrape instants.
    loop {
        let busy = st.engines.iter().any(|e| !e.is_idle());
        let steps: u64 = st.engines.iter().map(|e| e.counters().steps).sum();
        if !busy {
            break;
        }
        st.run_to(next_scrape_ms as f64 / 1000.0);
        let after: u64 = st.engines.iter().map(|e| e.counters().steps).sum();
        let clock_moved = st
            .engines
            .iter()
            .any(|e| !e.is_idle() && e.now() >= next_scrape_ms as f64 / 1000.0);
        if after == steps && !clock_moved {
            // A replica that cannot make progress (never happens with admissible requests).
            break;
        }
        st.sample_imbalance();
        next_scrape_ms += interval_ms;
    }
    st.ttft.sort_by(f64::total_cmp);
    st.e2e.sort_by(f64::total_cmp);
    let (q, h) = (st.query_tokens, st.hit_tokens);
    let (mut preemptions, mut vs) = (0u64, 0.0f64);
    for e in &st.engines {
        let c = e.counters();
        preemptions += c.preemptions;
        vs = vs.max(e.now());
    }
    let offered = rows.len().max(1) as f64;
    let span = st.last_finish - first_arrival;
    RouterReport {
        router: kind.name().to_string(),
        requests: rows.len(),
        rejected,
        finished: st.finished,
        duplicate_finishes: st.duplicates,
        overflow,
        ttft_p50: percentile(&st.ttft, 0.5),
        ttft_p90: percentile(&st.ttft, 0.9),
        ttft_p99: percentile(&st.ttft, 0.99),
        e2e_p50: percentile(&st.e2e, 0.5),
        e2e_p99: percentile(&st.e2e, 0.99),
        output_tokens_per_s: if span > 0.0 {
            st.generated as f64 / span
        } else {
            0.0
        },
        slo_ttft: if rows.is_empty() {
            0.0
        } else {
            st.ttft_ok as f64 / offered
        },
        slo_tpot: if rows.is_empty() {
            0.0
        } else {
            st.tpot_ok as f64 / offered
        },
        prefix_hit_ratio: if q == 0 { 0.0 } else { h as f64 / q as f64 },
        preemptions,
        imbalance: if st.imbalance_n == 0 {
            0.0
        } else {
            st.imbalance_sum / st.imbalance_n as f64
        },
        per_replica,
        virtual_seconds: vs,
    }
}

/// Run every router of `kinds` on the same rows and setup (sequentially).
pub fn run_all(
    rows: &[TraceRow],
    engine: &EngineConfig,
    cfg: &BenchConfig,
    kinds: &[RouterKind],
) -> Vec<RouterReport> {
    kinds
        .iter()
        .map(|&k| run_router(rows, engine, cfg, k))
        .collect()
}
