//! `/metrics` of a simulated replica, in the dialect of the model server it impersonates.
//!
//! Produced with the `prometheus-client` crate (OpenMetrics text). Every metric and label
//! name is a constant below, checked against the expositions in
//! `$KVROUTE_SHARED_DATA/metrics/` (vLLM V1 0.10 and V0 0.7, SGLang, llama.cpp):
//!
//! | role | vLLM V1 | vLLM V0 | SGLang | llama.cpp |
//! |---|---|---|---|---|
//! | running | `vllm:num_requests_running` | same | `sglang:num_running_reqs` | `llamacpp:requests_processing` |
//! | waiting | `vllm:num_requests_waiting` | same | `sglang:num_queue_reqs` | `llamacpp:requests_deferred` |
//! | KV usage 0..1 | `vllm:kv_cache_usage_perc` | `vllm:gpu_cache_usage_perc` | `sglang:token_usage` | none (use `/slots`) |
//! | prefix cache | `vllm:prefix_cache_{queries,hits}_total` | `vllm:gpu_prefix_cache_hit_rate` | `sglang:cache_hit_rate` | `llamacpp:prompt_tokens_total` excludes cached |
//! | TTFT / E2E | `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds` | same | `sglang:…` same suffixes | `llamacpp:prompt_seconds_total` |
//! | cache config | `vllm:cache_config_info{block_size,num_gpu_blocks}` | same | — | — |
//!
//! Counters are registered without the `_total` suffix: `prometheus-client` appends it to the
//! sample name, which then equals vLLM's (e.g. `vllm:prefix_cache_hits_total`). Engine
//! counters are copied in at scrape time (by delta, so they stay monotonic).
//! `vllm:cache_config_info` is a gauge of value 1, as vLLM exposes it (not an OpenMetrics
//! `info`, which would add an `_info` suffix). Histogram buckets are vLLM's
//! (vllm/v1/metrics/loggers.py) and SGLang's (sglang/srt/metrics/collector.py).

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::engine::EngineCounters;

/// `Content-Type` of the exposition (OpenMetrics 1.0 text, what `prometheus-client` writes).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Metric names, one place.
pub mod names {
    #![allow(missing_docs)]
    pub const PROCESS_START: &str = "process_start_time_seconds";
    // vLLM (V1 and V0 share most names).
    pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
    pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
    pub const VLLM_SWAPPED: &str = "vllm:num_requests_swapped";
    pub const VLLM_KV_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const VLLM_GPU_CACHE_USAGE: &str = "vllm:gpu_cache_usage_perc";
    pub const VLLM_CPU_CACHE_USAGE: &str = "vllm:cpu_cache_usage_perc";
    pub const VLLM_GPU_PREFIX_HIT_RATE: &str = "vllm:gpu_prefix_cache_hit_rate";
    pub const VLLM_PREFIX_QUERIES: &str = "vllm:prefix_cache_queries";
    pub const VLLM_PREFIX_HITS: &str = "vllm:prefix_cache_hits";
    pub const VLLM_PREEMPTIONS: &str = "vllm:num_preemptions";
    pub const VLLM_PROMPT_TOKENS: &str = "vllm:prompt_tokens";
    pub const VLLM_GENERATION_TOKENS: &str = "vllm:generation_tokens";
    pub const VLLM_REQUEST_SUCCESS: &str = "vllm:request_success";
    pub const VLLM_TTFT: &str = "vllm:time_to_first_token_seconds";
    pub const VLLM_E2E: &str = "vllm:e2e_request_latency_seconds";
    pub const VLLM_CACHE_CONFIG: &str = "vllm:cache_config_info";
    // SGLang.
    pub const SGLANG_RUNNING: &str = "sglang:num_running_reqs";
    pub const SGLANG_QUEUE: &str = "sglang:num_queue_reqs";
    pub const SGLANG_TOKEN_USAGE: &str = "sglang:token_usage";
    pub const SGLANG_USED_TOKENS: &str = "sglang:num_used_tokens";
    pub const SGLANG_CACHE_HIT_RATE: &str = "sglang:cache_hit_rate";
    pub const SGLANG_PROMPT_TOKENS: &str = "sglang:prompt_tokens";
    pub const SGLANG_GENERATION_TOKENS: &str = "sglang:generation_tokens";
    pub const SGLANG_TTFT: &str = "sglang:time_to_first_token_seconds";
    pub const SGLANG_E2E: &str = "sglang:e2e_request_latency_seconds";
    // llama.cpp server.
    pub const LLAMACPP_PROMPT_TOKENS: &str = "llamacpp:prompt_tokens";
    pub const LLAMACPP_PROMPT_SECONDS: &str = "llamacpp:prompt_seconds";
    pub const LLAMACPP_PREDICTED: &str = "llamacpp:tokens_predicted";
    pub const LLAMACPP_PREDICTED_SECONDS: &str = "llamacpp:tokens_predicted_seconds";
    pub const LLAMACPP_N_DECODE: &str = "llamacpp:n_decode";
    pub const LLAMACPP_PROCESSING: &str = "llamacpp:requests_processing";
    pub const LLAMACPP_DEFERRED: &str = "llamacpp:requests_deferred";
    // Label names.
    pub const L_MODEL_NAME: &str = "model_name";
    pub const L_ENGINE: &str = "engine";
    pub const L_FINISHED_REASON: &str = "finished_reason";
    pub const L_BLOCK_SIZE: &str = "block_size";
    pub const L_NUM_GPU_BLOCKS: &str = "num_gpu_blocks";
}
use names::*;

/// Which model server's metric names to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dialect {
    /// vLLM V1 engine (≥ 0.10): `vllm:kv_cache_usage_perc`, prefix-cache counters.
    VllmV1,
    /// vLLM V0 engine (≤ 0.7): `vllm:gpu_cache_usage_perc`, prefix hit-rate gauge.
    VllmV0,
    /// SGLang: `sglang:token_usage`, `sglang:cache_hit_rate`.
    Sglang,
    /// llama.cpp `llama-server`: `llamacpp:*` counters; KV state at `/slots`.
    Llamacpp,
}

/// A `--metrics-dialect` value that is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown metrics dialect `{0}` (expected vllm, vllm-v0, sglang or llamacpp)")]
pub struct UnknownDialect(pub String);

impl std::str::FromStr for Dialect {
    type Err = UnknownDialect;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm" | "vllm-v1" => Ok(Dialect::VllmV1),
            "vllm-v0" => Ok(Dialect::VllmV0),
            "sglang" => Ok(Dialect::Sglang),
            "llamacpp" | "llama.cpp" => Ok(Dialect::Llamacpp),
            other => Err(UnknownDialect(other.to_string())),
        }
    }
}

/// vLLM's TTFT buckets in seconds (vllm/v1/metrics/loggers.py).
pub const VLLM_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request-latency buckets in seconds (same file).
pub const VLLM_E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// SGLang's TTFT buckets (sglang/srt/metrics/collector.py, as in the shared docs capture).
pub const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
];
/// SGLang's E2E buckets (same source).
pub const SGLANG_E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];

/// Replica state read at scrape time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScrapeState {
    /// Running requests.
    pub running: u64,
    /// Waiting requests.
    pub waiting: u64,
    /// KV usage, 0..1.
    pub kv_usage: f64,
    /// Tokens held in KV by running requests.
    pub used_tokens: u64,
    /// Engine counters.
    pub counters: EngineCounters,
}

type FGauge = Gauge<f64, AtomicU64>;
type FCounter = Counter<f64, AtomicU64>;
type LabelVec = Vec<(String, String)>;

/// The registered metrics of one replica.
#[derive(Debug)]
pub struct Metrics {
    dialect: Dialect,
    registry: Registry,
    running: FGauge,
    waiting: FGauge,
    kv_usage: Option<FGauge>,
    used_tokens: Option<FGauge>,
    hit_rate: Option<FGauge>,
    prefix_queries: Option<Counter>,
    prefix_hits: Option<Counter>,
    preemptions: Option<Counter>,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    prompt_seconds: Option<FCounter>,
    decode_seconds: Option<FCounter>,
    n_decode: Option<Counter>,
    success: Option<Family<LabelVec, Counter>>,
    ttft: Option<Histogram>,
    e2e: Option<Histogram>,
    last: EngineCounters,
}

fn label(k: &'static str, v: &str) -> (Cow<'static, str>, Cow<'static, str>) {
    (Cow::Borrowed(k), Cow::Owned(v.to_string()))
}

impl Metrics {
    /// Register the dialect's metrics for a replica serving `model_name` with
    /// `num_gpu_blocks` blocks of `block_size` tokens; `process_start` is Unix seconds.
    pub fn new(
        dialect: Dialect,
        model_name: &str,
        num_gpu_blocks: u32,
        block_size: u32,
        process_start: f64,
    ) -> Self {
        let mut root = Registry::default();
        if dialect != Dialect::Llamacpp {
            let start = FGauge::default();
            start.set(process_start);
            root.register(
                PROCESS_START,
                "Start time of the process since unix epoch in seconds",
                start,
            );
        }
        if matches!(dialect, Dialect::VllmV1 | Dialect::VllmV0) {
            let info = Family::<LabelVec, FGauge>::default();
            let mut labels = vec![
                (L_BLOCK_SIZE.to_string(), block_size.to_string()),
                ("enable_prefix_caching".to_string(), "True".to_string()),
                ("gpu_memory_utilization".to_string(), "0.9".to_string()),
                (L_NUM_GPU_BLOCKS.to_string(), num_gpu_blocks.to_string()),
            ];
            if dialect == Dialect::VllmV1 {
                labels.push((L_ENGINE.to_string(), "0".to_string()));
            }
            info.get_or_create(&labels).set(1.0);
            root.register(
                VLLM_CACHE_CONFIG,
                "Information of the LLMEngine CacheConfig",
                info,
            );
        }
        let sub_labels: Vec<(Cow<'static, str>, Cow<'static, str>)> = match dialect {
            Dialect::VllmV1 => vec![label(L_ENGINE, "0"), label(L_MODEL_NAME, model_name)],
            Dialect::VllmV0 | Dialect::Sglang => vec![label(L_MODEL_NAME, model_name)],
            Dialect::Llamacpp => vec![],
        };
        let reg = root.sub_registry_with_labels(sub_labels.into_iter());
        let running = FGauge::default();
        let waiting = FGauge::default();
        let prompt_tokens = Counter::default();
        let generation_tokens = Counter::default();
        let mut m = Metrics {
            dialect,
            registry: Registry::default(),
            running: running.clone(),
            waiting: waiting.clone(),
            kv_usage: None,
            used_tokens: None,
            hit_rate: None,
            prefix_queries: None,
            prefix_hits: None,
            preemptions: None,
            prompt_tokens: prompt_tokens.clone(),
            generation_tokens: generation_tokens.clone(),
            prompt_seconds: None,
            decode_seconds: None,
            n_decode: None,
            success: None,
            ttft: None,
            e2e: None,
            last: EngineCounters::default(),
        };
        match dialect {
            Dialect::VllmV1 | Dialect::VllmV0 => {
                reg.register(
                    VLLM_RUNNING,
                    "Number of requests in model execution batches",
                    running,
                );
                reg.register(
                    VLLM_WAITING,
                    "Number of requests waiting to be processed",
                    waiting,
                );
                let kv = FGauge::default();
                if dialect == Dialect::VllmV1 {
                    reg.register(
                        VLLM_KV_USAGE,
                        "KV-cache usage. 1 means 100 percent usage",
                        kv.clone(),
                    );
                    let q = Counter::default();
                    let h = Counter::default();
                    reg.register(
                        VLLM_PREFIX_QUERIES,
                        "Prefix cache queries, in terms of number of queried tokens",
                        q.clone(),
                    );
                    reg.register(
                        VLLM_PREFIX_HITS,
                        "Prefix cache hits, in terms of number of cached tokens",
                        h.clone(),
                    );
                    m.prefix_queries = Some(q);
                    m.prefix_hits = Some(h);
                } else {
                    reg.register(
                        VLLM_SWAPPED,
                        "Number of requests swapped to CPU",
                        FGauge::default(),
                    );
                    reg.register(
                        VLLM_GPU_CACHE_USAGE,
                        "GPU KV-cache usage. 1 means 100 percent usage",
                        kv.clone(),
                    );
                    reg.register(
                        VLLM_CPU_CACHE_USAGE,
                        "CPU KV-cache usage. 1 means 100 percent usage",
                        FGauge::default(),
                    );
                    let hr = FGauge::default();
                    reg.register(
                        VLLM_GPU_PREFIX_HIT_RATE,
                        "GPU prefix cache block hit rate",
                        hr.clone(),
                    );
                    m.hit_rate = Some(hr);
                }
                m.kv_usage = Some(kv);
                let p = Counter::default();
                reg.register(
                    VLLM_PREEMPTIONS,
                    "Cumulative number of preemption from the engine",
                    p.clone(),
                );
                m.preemptions = Some(p);
                reg.register(
                    VLLM_PROMPT_TOKENS,
                    "Number of prefill tokens processed",
                    prompt_tokens,
                );
                reg.register(
                    VLLM_GENERATION_TOKENS,
                    "Number of generation tokens processed",
                    generation_tokens,
                );
                let s = Family::<LabelVec, Counter>::default();
                reg.register(
                    VLLM_REQUEST_SUCCESS,
                    "Count of successfully processed requests",
                    s.clone(),
                );
                m.success = Some(s);
                let t = Histogram::new(VLLM_TTFT_BUCKETS.iter().copied());
                let e = Histogram::new(VLLM_E2E_BUCKETS.iter().copied());
                reg.register(
                    VLLM_TTFT,
                    "Histogram of time to first token in seconds",
                    t.clone(),
                );
                reg.register(
                    VLLM_E2E,
                    "Histogram of e2e request latency in seconds",
                    e.clone(),
                );
                m.ttft = Some(t);
                m.e2e = Some(e);
            }
            Dialect::Sglang => {
                reg.register(
                    SGLANG_PROMPT_TOKENS,
                    "Number of prefill tokens processed",
                    prompt_tokens,
                );
                reg.register(
                    SGLANG_GENERATION_TOKENS,
                    "Number of generation tokens processed",
                    generation_tokens,
                );
                let kv = FGauge::default();
                reg.register(SGLANG_TOKEN_USAGE, "The token usage", kv.clone());
                let hr = FGauge::default();
                reg.register(SGLANG_CACHE_HIT_RATE, "The cache hit rate", hr.clone());
                let t = Histogram::new(SGLANG_TTFT_BUCKETS.iter().copied());
                let e = Histogram::new(SGLANG_E2E_BUCKETS.iter().copied());
                reg.register(
                    SGLANG_TTFT,
                    "Histogram of time to first token in seconds",
                    t.clone(),
                );
                reg.register(
                    SGLANG_E2E,
                    "Histogram of End-to-end request latency in seconds",
                    e.clone(),
                );
                reg.register(SGLANG_RUNNING, "The number of running requests", running);
                let used = FGauge::default();
                reg.register(
                    SGLANG_USED_TOKENS,
                    "The number of used tokens",
                    used.clone(),
                );
                reg.register(
                    SGLANG_QUEUE,
                    "The number of requests in the waiting queue",
                    waiting,
                );
                m.kv_usage = Some(kv);
                m.hit_rate = Some(hr);
                m.used_tokens = Some(used);
                m.ttft = Some(t);
                m.e2e = Some(e);
            }
            Dialect::Llamacpp => {
                reg.register(
                    LLAMACPP_PROMPT_TOKENS,
                    "Number of prompt tokens processed, excluding cached tokens",
                    prompt_tokens,
                );
                let ps = FCounter::default();
                reg.register(LLAMACPP_PROMPT_SECONDS, "Prompt process time", ps.clone());
                reg.register(
                    LLAMACPP_PREDICTED,
                    "Number of generation tokens processed",
                    generation_tokens,
                );
                let ds = FCounter::default();
                reg.register(
                    LLAMACPP_PREDICTED_SECONDS,
                    "Predict process time",
                    ds.clone(),
                );
                let nd = Counter::default();
                reg.register(
                    LLAMACPP_N_DECODE,
                    "Total number of llama_decode() calls",
                    nd.clone(),
                );
                reg.register(
                    LLAMACPP_PROCESSING,
                    "Number of requests processing",
                    running,
                );
                reg.register(LLAMACPP_DEFERRED, "Number of requests deferred", waiting);
                m.prompt_seconds = Some(ps);
                m.decode_seconds = Some(ds);
                m.n_decode = Some(nd);
            }
        }
        m.registry = root;
        m
    }

    /// The dialect in force.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Record a finished request: time to first token and end-to-end latency (seconds),
    /// and vLLM's `finished_reason` (`stop`, `length` or `abort`).
    pub fn observe_finished(&self, ttft_s: Option<f64>, e2e_s: f64, finished_reason: &str) {
        if let (Some(h), Some(t)) = (&self.ttft, ttft_s) {
            h.observe(t);
        }
        if let Some(h) = &self.e2e {
            h.observe(e2e_s);
        }
        if let Some(f) = &self.success {
            f.get_or_create(&vec![(
                L_FINISHED_REASON.to_string(),
                finished_reason.to_string(),
            )])
            .inc();
        }
    }

    /// Update the gauges and counters from `state` and encode the exposition.
    /// Errors only if formatting fails (it writes to a `String`, so in practice never).
    pub fn render(&mut self, state: &ScrapeState) -> Result<String, std::fmt::Error> {
        self.running.set(state.running as f64);
        self.waiting.set(state.waiting as f64);
        if let Some(g) = &self.kv_usage {
            g.set(state.kv_usage);
        }
        if let Some(g) = &self.used_tokens {
            g.set(state.used_tokens as f64);
        }
        let c = state.counters;
        let last = self.last;
        if let Some(g) = &self.hit_rate {
            let rate = if c.prefix_queries_tokens == 0 {
                0.0
            } else {
                c.prefix_hit_tokens as f64 / c.prefix_queries_tokens as f64
            };
            g.set(rate);
        }
        let delta = |new: u64, old: u64| new.saturating_sub(old);
        if let Some(x) = &self.prefix_queries {
            x.inc_by(delta(c.prefix_queries_tokens, last.prefix_queries_tokens));
        }
        if let Some(x) = &self.prefix_hits {
            x.inc_by(delta(c.prefix_hit_tokens, last.prefix_hit_tokens));
        }
        if let Some(x) = &self.preemptions {
            x.inc_by(delta(c.preemptions, last.preemptions));
        }
        self.prompt_tokens
            .inc_by(delta(c.prompt_tokens, last.prompt_tokens));
        self.generation_tokens
            .inc_by(delta(c.generation_tokens, last.generation_tokens));
        if let Some(x) = &self.n_decode {
            x.inc_by(delta(c.steps, last.steps));
        }
        if let Some(x) = &self.prompt_seconds {
            x.inc_by((c.prefill_seconds - last.prefill_seconds).max(0.0));
        }
        if let Some(x) = &self.decode_seconds {
            x.inc_by((c.decode_seconds - last.decode_seconds).max(0.0));
        }
        self.last = c;
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
