//! Model-server adapters: one file per server kind, each turning a parsed `/metrics` body
//! into [`ServerStats`].
//!
//! | kind | file | KV usage (0..1) | capacity (tokens) |
//! |---|---|---|---|
//! | `vllm` | [`vllm`] | `vllm:kv_cache_usage_perc` (V1), else `vllm:gpu_cache_usage_perc` (V0) | `cache_config_info` `num_gpu_blocks × block_size` |
//! | `llmd-sim` | [`llmd_sim`] | `vllm:kv_cache_usage_perc` | `cache_config_info` |
//! | `sglang` | [`sglang`] | `sglang:token_usage` | `sglang:max_total_num_tokens` when exported |
//! | `tgi` | [`tgi`] | `tgi_batch_current_max_tokens / tgi_batch_max_total_tokens` (derived) | `tgi_batch_max_total_tokens` |
//! | `llamacpp` | [`llamacpp`] | `GET /slots` (Σ cached tokens of busy slots / Σ `n_ctx`), else legacy `llamacpp:kv_cache_usage_ratio` | Σ `n_ctx` |
//! | `trtllm` | [`trtllm`] | `used / max` of `nv_trt_llm_kv_cache_block_metrics` (`fraction` only as fallback) | `max × tokens_per` |
//!
//! Rules shared by all: a missing KV signal is `None` (unknown), never 0;
//! `process_start_time_seconds` (the standard process collector of Python's and Go's
//! Prometheus clients) gives the process start.
//!
//! **Ranks and copies** ([`LabelRules`]). One server can export several series of one
//! gauge. Series from *distinct engines or ranks* (data parallelism) are added up for
//! queue depths, capacity and counters, and capacity-weighted (else averaged) for usage.
//! Series that differ only in a *copy* label are the same engine's value exported more
//! than once and are counted once, at their maximum (the most loaded reading: a copy left
//! by an exited process reads low or equal, never hides load). Each adapter declares its
//! rank label, copy labels and other known labels:
//!
//! | kind | rank label (added up) | copy labels (counted once) | other known labels |
//! |---|---|---|---|
//! | `vllm`, `llmd-sim` | `engine` | `pid` (older multi-process vLLM, prometheus_client multiprocess mode) | `model_name` |
//! | `sglang` | `dp_rank` | `tp_rank`, `pp_rank`, `pid` (every TP/PP rank of one DP rank reports the same scheduler state) | `model_name`, `engine_type` |
//! | `tgi` | none | every label (one router per server) | none |
//! | `llamacpp` | none | every label (one server process) | none |
//! | `trtllm` | `model` + `version` (each TensorRT-LLM model and loaded version has its own executor and KV pool) | none | `kv_cache_block_type`, `request_type` |
//!
//! At most [`MAX_RANKS`] distinct ranks are read per family (the first ones, in body
//! order); series of further ranks are ignored and logged once per process, so a body with
//! tens of thousands of `engine` values costs time linear in its size, not quadratic.
//!
//! A label no rule names is treated as a copy label (never multiplies a count) and logged
//! once per process at `warn` ([`LabelRules::unexpected`]), so a new upstream label shows
//! up in the logs instead of silently doubling a queue depth.

pub mod llamacpp;
pub mod llmd_sim;
pub mod sglang;
pub mod tgi;
pub mod trtllm;
pub mod vllm;

use crate::expo::{Exposition, Sample};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Longest LoRA adapter name kept, bytes (longer ones are dropped: no real adapter name
/// is this long, and each name travels in every snapshot to every Envoy worker).
pub const MAX_LORA_NAME_BYTES: usize = 256;
/// Most bytes of LoRA names one endpoint keeps (the first names in sorted order). One
/// server listing a megabyte of names otherwise made every snapshot larger than the
/// filter's ingest limit, and every Envoy refused every push.
pub const MAX_LORA_BYTES: usize = 4096;

/// Standard process-collector gauge: process start, Unix seconds
/// (<https://prometheus.io/docs/instrumenting/writing_clientlibs/#process-metrics>).
pub const PROCESS_START: &str = "process_start_time_seconds";

/// Model-server kind, as written in the config (`kind:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ServerKind {
    /// Detect from the exposed metric names on every scrape ([`detect`]).
    #[default]
    Auto,
    /// vLLM, V1 engine (`vllm:kv_cache_usage_perc`) or V0 (`vllm:gpu_cache_usage_perc`).
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
    /// Hugging Face TGI (`tgi_*`).
    Tgi,
    /// llama.cpp `llama-server --metrics` (`llamacpp:*`), plus `GET /slots`.
    Llamacpp,
    /// Triton with the TensorRT-LLM backend (`nv_trt_llm_*`).
    Trtllm,
    /// llm-d-inference-sim (vLLM names, simulator-only `vllm:max_num_generation_tokens`).
    LlmdSim,
}

impl ServerKind {
    /// Config spelling, also used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Tgi => "tgi",
            Self::Llamacpp => "llamacpp",
            Self::Trtllm => "trtllm",
            Self::LlmdSim => "llmd-sim",
        }
    }
}

/// What one scrape says about one endpoint.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServerStats {
    /// Kind that produced these stats (never `Auto`).
    pub kind: ServerKind,
    /// KV cache usage 0..1; `None` when the server exposes no usable signal.
    pub kv_usage: Option<f64>,
    /// KV cache capacity, tokens.
    pub kv_capacity_tokens: Option<u64>,
    /// KV cache block size, tokens.
    pub block_size: Option<u32>,
    /// Requests running.
    pub running: u32,
    /// Requests waiting.
    pub waiting: u32,
    /// LoRA adapters loaded (running or waiting), sorted, deduplicated.
    pub lora_adapters: Vec<String>,
    /// Process start, Unix milliseconds, when exposed.
    pub process_start_ms: Option<u64>,
    /// A monotonically increasing counter (e.g. prompt tokens total); a decrease means the
    /// server restarted. `None` when the kind has none.
    pub monotonic_total: Option<f64>,
}

/// Why an exposition could not be read as a model server's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdapterError {
    /// `auto` found no known metric family.
    #[error(
        "no known model-server metrics (looked for vllm:, sglang:, tgi_, llamacpp:, nv_trt_llm_)"
    )]
    UnknownKind,
    /// The configured kind's metrics are absent.
    #[error("no `{kind}` metrics in the exposition (expected e.g. `{expected}`)")]
    KindMismatch {
        /// Configured kind.
        kind: &'static str,
        /// A metric the kind always exports.
        expected: &'static str,
    },
}

/// Every metric name an adapter or [`detect`] reads. The scrape path keeps only these
/// (see [`crate::expo::Exposition::parse_with`]).
pub const RELEVANT: &[&str] = &[
    PROCESS_START,
    vllm::KV_USAGE_V1,
    vllm::KV_USAGE_V0,
    vllm::CACHE_CONFIG,
    vllm::RUNNING,
    vllm::WAITING,
    vllm::LORA_INFO,
    vllm::PROMPT_TOKENS,
    vllm::GENERATION_TOKENS,
    vllm::PROMPT_TOKENS_CREATED,
    llmd_sim::DETECT_COUNT,
    sglang::TOKEN_USAGE,
    sglang::MAX_TOTAL_TOKENS,
    sglang::RUNNING,
    sglang::WAITING,
    sglang::PROMPT_TOKENS,
    sglang::GENERATION_TOKENS,
    tgi::BATCH_CURRENT_MAX_TOKENS,
    tgi::BATCH_MAX_TOTAL_TOKENS,
    tgi::BATCH_CURRENT_SIZE,
    tgi::QUEUE_SIZE,
    tgi::REQUEST_COUNT,
    llamacpp::KV_USAGE_LEGACY,
    llamacpp::PROCESSING,
    llamacpp::DEFERRED,
    llamacpp::PROMPT_TOKENS,
    llamacpp::PREDICTED_TOKENS,
    trtllm::KV_BLOCKS,
    trtllm::REQUESTS,
    trtllm::INFERENCE_COUNT,
    trtllm::V1_METRICS,
];

/// Whether the adapters read metric `name` (histogram buckets never).
pub fn is_relevant(name: &str) -> bool {
    !name.ends_with("_bucket") && RELEVANT.contains(&name)
}

/// How one adapter reads the labels of the families it sums (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct LabelRules {
    /// Adapter, for the warning.
    pub kind: ServerKind,
    /// Labels that together name a distinct engine or rank (vLLM's `engine`, SGLang's
    /// `dp_rank`, Triton's `model` + `version`); empty: the server has one.
    pub rank: &'static [&'static str],
    /// Labels that only tell copies of one engine's series apart.
    pub copies: &'static [&'static str],
    /// Other labels the adapter knows and ignores.
    pub known: &'static [&'static str],
}

static WARNED: std::sync::Mutex<std::collections::BTreeSet<(String, String)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Most (metric, label) pairs [`LabelRules::unexpected`] warns about, once each, per
/// process; past it one line says that further ones are not logged. A server sending
/// thousands of distinct label names (one malformed line, or new names on every scrape)
/// otherwise wrote a line for each and grew the set of logged names without bound.
pub const MAX_WARNED_LABELS: usize = 64;

impl LabelRules {
    /// Labels of family `name` that these rules do not name, sorted, deduplicated.
    pub fn unexpected(&self, expo: &Exposition, name: &str) -> Vec<String> {
        let mut out: Vec<String> = expo
            .family(name)
            .flat_map(|s| s.labels.iter().map(|(k, _)| k.as_str()))
            .filter(|k| {
                !self.rank.contains(k) && !self.copies.contains(k) && !self.known.contains(k)
            })
            .map(str::to_owned)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Log each unexpected label of `name` once per process.
    fn warn_unexpected(&self, expo: &Exposition, name: &str) {
        let unexpected = self.unexpected(expo, name);
        if unexpected.is_empty() {
            return;
        }
        let mut warned = WARNED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for label in unexpected {
            let key = (name.to_owned(), label);
            if warned.contains(&key) {
                continue;
            }
            if warned.len() >= MAX_WARNED_LABELS {
                static FULL: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !FULL.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        metric = name,
                        kind = self.kind.as_str(),
                        "more unexpected labels than {MAX_WARNED_LABELS}; further ones are read as copies too, and not logged"
                    );
                }
                return;
            }
            tracing::warn!(
                metric = name,
                label = %key.1,
                kind = self.kind.as_str(),
                "unexpected label: series that differ only in it are read as copies of one engine (counted once, not added up)"
            );
            warned.insert(key);
        }
    }

    /// The rank series `s` belongs to: its values of the [`Self::rank`] labels, in that
    /// order (`""` for a missing one).
    pub fn rank_key<'a>(&self, s: &'a Sample) -> RankKey<'a> {
        self.rank.iter().map(|r| s.label(r).unwrap_or("")).collect()
    }

    /// One value per distinct rank of family `name`, in first-seen order: the maximum
    /// finite value among its copies. Ranks whose every copy is non-finite are left out, and
    /// so are ranks first seen after [`MAX_RANKS`] others (logged once per process).
    pub fn per_rank<'a>(&self, expo: &'a Exposition, name: &'a str) -> Vec<(RankKey<'a>, f64)> {
        self.per_rank_where(expo, name, None)
    }

    /// [`Self::per_rank`] over the series of `name` whose label `select.0` equals
    /// `select.1` (families such as TensorRT-LLM's that carry several quantities under one
    /// name, told apart by a label); `None`: every series.
    pub fn per_rank_where<'a>(
        &self,
        expo: &'a Exposition,
        name: &'a str,
        select: Option<(&str, &str)>,
    ) -> Vec<(RankKey<'a>, f64)> {
        self.warn_unexpected(expo, name);
        let mut out: Vec<(RankKey<'a>, f64)> = Vec::new();
        // Rank key -> index in `out`: one lookup per series, so the work is linear in the
        // number of series (a linear search of `out` made 80,000 ranks take 20 s).
        let mut index: HashMap<RankKey<'a>, usize> = HashMap::new();
        let mut ignored = 0usize;
        for s in expo.family(name) {
            if !s.value.is_finite() || select.is_some_and(|(k, v)| s.label(k) != Some(v)) {
                continue;
            }
            let rank = self.rank_key(s);
            match index.get(&rank) {
                Some(&i) => {
                    if let Some((_, v)) = out.get_mut(i) {
                        *v = v.max(s.value);
                    }
                }
                None if out.len() < MAX_RANKS => {
                    index.insert(rank.clone(), out.len());
                    out.push((rank, s.value));
                }
                None => ignored += 1,
            }
        }
        if ignored > 0 {
            warn_too_many_ranks(self.kind, name, ignored);
        }
        out
    }

    /// Σ over distinct ranks of [`Self::per_rank`]; `None` when the family is absent
    /// (present but all non-finite: 0).
    pub fn sum(&self, expo: &Exposition, name: &str) -> Option<f64> {
        self.sum_where(expo, name, None)
    }

    /// Σ of [`Self::sum`] over the families `names` that are present; `None` when none is
    /// (e.g. prompt plus generation tokens, a counter that only grows while the server
    /// lives, with either family missing).
    pub fn sum_of(&self, expo: &Exposition, names: &[&str]) -> Option<f64> {
        names
            .iter()
            .filter_map(|name| self.sum(expo, name))
            .reduce(|a, b| a + b)
    }

    /// Σ over distinct ranks of [`Self::per_rank_where`]; `None` when no series of `name`
    /// matches `select` (matching but all non-finite: 0).
    pub fn sum_where(
        &self,
        expo: &Exposition,
        name: &str,
        select: Option<(&str, &str)>,
    ) -> Option<f64> {
        let present = expo
            .family(name)
            .any(|s| select.is_none_or(|(k, v)| s.label(k) == Some(v)));
        present.then(|| {
            self.per_rank_where(expo, name, select)
                .iter()
                .map(|(_, v)| v)
                .sum()
        })
    }
}

/// Values of a series' rank labels ([`LabelRules::rank_key`]).
pub type RankKey<'a> = Vec<&'a str>;

/// Most distinct ranks (engines, DP ranks, Triton model versions) read per metric family
/// of one endpoint; series of further ranks are ignored and logged once per process
/// ([`LabelRules::per_rank_where`]). A real data-parallel deployment has a handful (vLLM
/// `--data-parallel-size`, SGLang `--dp-size`: one rank per GPU group of one node or a few),
/// so 1,024 is far above any real server, while a body with 80,000 distinct `engine`
/// values (3.5 MB, under `scrape.max_body_bytes`) can no longer make the adapters' work
/// grow beyond what the body's size allows.
pub const MAX_RANKS: usize = 1024;

/// Whether a rank of family `name` may be kept next to `len` ranks kept so far (`known`:
/// it is one of them): true while fewer than [`MAX_RANKS`] are kept; otherwise the rank is
/// ignored and that is logged once per process ([`warn_too_many_ranks`]). For the
/// adapters' own per-rank maps; [`LabelRules::per_rank_where`] applies the same bound.
pub(crate) fn rank_admitted(len: usize, known: bool, kind: ServerKind, name: &str) -> bool {
    if known || len < MAX_RANKS {
        return true;
    }
    warn_too_many_ranks(kind, name, 1);
    false
}

/// Log once per process that `ignored` series of family `name` beyond [`MAX_RANKS`]
/// distinct ranks were left out.
pub(crate) fn warn_too_many_ranks(kind: ServerKind, name: &str, ignored: usize) {
    static WARNED_ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED_ONCE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            metric = name,
            kind = kind.as_str(),
            ignored,
            "more than {MAX_RANKS} distinct ranks (engine, dp_rank, model + version) in one \
             family; series of further ranks ignored (logged once)"
        );
    }
}

/// Detect the kind from exposed names. Order matters: llm-d-inference-sim exports vLLM names
/// plus `vllm:max_num_generation_tokens` (its own spelling; vLLM's is
/// `vllm:request_max_num_generation_tokens`, llm-d-inference-sim `pkg/llm-d-inference-sim/metrics.go`).
pub fn detect(expo: &Exposition) -> Option<ServerKind> {
    let mut has_vllm = false;
    for s in &expo.samples {
        let n = s.name.as_str();
        if n.starts_with("vllm:max_num_generation_tokens") {
            return Some(ServerKind::LlmdSim);
        }
        has_vllm |= n.starts_with("vllm:");
    }
    if has_vllm {
        Some(ServerKind::Vllm)
    } else if expo.has_prefix("sglang:") {
        Some(ServerKind::Sglang)
    } else if expo.has_prefix("llamacpp:") {
        Some(ServerKind::Llamacpp)
    } else if expo.has_prefix("nv_trt_llm_") {
        Some(ServerKind::Trtllm)
    } else if expo.has_prefix("tgi_") {
        Some(ServerKind::Tgi)
    } else {
        None
    }
}

/// Largest KV cache capacity a server is believed to report, tokens (2^32): a larger one is
/// read as unknown. At 4 KiB of KV cache per token (2 × 16 layers × 8 KV heads × 64 head
/// dim × 2 bytes, a ~1B-parameter model; 8B models such as Llama 3.1 take 128 KiB) it would
/// be 16 TiB of KV cache on one model server, far past any GPU node's memory.
pub const MAX_KV_CAPACITY_TOKENS: u64 = 1 << 32;

/// Extract stats for `kind` (`Auto` detects first). `slots` is the body of llama.cpp's
/// `GET /slots` when it was fetched.
pub fn extract(
    kind: ServerKind,
    expo: &Exposition,
    slots: Option<&[u8]>,
) -> Result<ServerStats, AdapterError> {
    let kind = match kind {
        ServerKind::Auto => detect(expo).ok_or(AdapterError::UnknownKind)?,
        k => k,
    };
    let mut stats = match kind {
        ServerKind::Vllm | ServerKind::Auto => vllm::extract(expo)?,
        ServerKind::LlmdSim => llmd_sim::extract(expo)?,
        ServerKind::Sglang => sglang::extract(expo)?,
        ServerKind::Tgi => tgi::extract(expo)?,
        ServerKind::Llamacpp => llamacpp::extract(expo, slots)?,
        ServerKind::Trtllm => trtllm::extract(expo)?,
    };
    // kvroute-core's `Snapshot::validate` rejects the whole snapshot for a zero block size
    // or a control character in a LoRA name, so one odd server (`block_size="0"`,
    // `tokens_per` 0.4, an escaped `\n` in `running_lora_adapters`) must not reach it.
    // A zero KV capacity means nothing either, so it is unknown too, and so is one past
    // `MAX_KV_CAPACITY_TOKENS` (`num_gpu_blocks="18446744073709551615"` would make the
    // endpoint's in-flight tokens count for nothing in every picker's cost).
    stats.block_size = stats.block_size.filter(|b| *b > 0);
    stats.kv_capacity_tokens = stats
        .kv_capacity_tokens
        .filter(|c| (1..=MAX_KV_CAPACITY_TOKENS).contains(c));
    stats
        .lora_adapters
        .retain(|n| kvroute_core::snapshot::check_label(n).is_ok());
    bound_lora_names(&mut stats.lora_adapters);
    if stats.process_start_ms.is_none() {
        stats.process_start_ms = expo
            .family(PROCESS_START)
            .next()
            .and_then(|s| seconds_to_ms(s.value));
    }
    Ok(stats)
}

/// Drop LoRA names over [`MAX_LORA_NAME_BYTES`], then keep the leading names (the list is
/// sorted) that fit in [`MAX_LORA_BYTES`]; logged once per process.
fn bound_lora_names(names: &mut Vec<String>) {
    let before = names.len();
    names.retain(|n| n.len() <= MAX_LORA_NAME_BYTES);
    let mut total = 0usize;
    let keep = names
        .iter()
        .take_while(|n| {
            total = total.saturating_add(n.len());
            total <= MAX_LORA_BYTES
        })
        .count();
    names.truncate(keep);
    if names.len() < before {
        static WARNED_ONCE: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        if !WARNED_ONCE.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                dropped = before - names.len(),
                kept = names.len(),
                "LoRA adapter names over {MAX_LORA_NAME_BYTES} bytes, or beyond {MAX_LORA_BYTES} \
                 bytes per endpoint, dropped from the snapshot (logged once)"
            );
        }
    }
}

/// Latest process start time read, Unix seconds (2100-01-01T00:00:00Z). A server's
/// `process_start_time_seconds 1e308` was published as `u64::MAX` ms, after which no later
/// start could look like a restart (found by a breaker, 2026-12-05).
pub const MAX_START_S: f64 = 4_102_444_800.0;

/// Unix seconds (float) to milliseconds; `None` for non-finite or non-positive input, or
/// after [`MAX_START_S`].
pub fn seconds_to_ms(s: f64) -> Option<u64> {
    (s.is_finite() && s > 0.0 && s <= MAX_START_S).then(|| (s * 1000.0).round() as u64)
}

/// A gauge value as a request count: NaN and negative become 0, fractions round, and what
/// is past `u32::MAX`, +∞ included, saturates there: two engines reporting `1e308` sum to
/// +∞, which read as 0 running made an overloaded server look idle (found by a breaker,
/// 2026-12-05).
pub fn count(v: Option<f64>) -> u32 {
    match v {
        Some(x) if x > 0.0 => x.round().min(u32::MAX as f64) as u32,
        _ => 0,
    }
}

/// A ratio clamped to 0..=1; `None` for non-finite input (e.g. vLLM's `-1` hit rates are
/// not ratios, but usage gauges are always 0..1 upstream).
pub fn ratio(v: f64) -> Option<f64> {
    v.is_finite().then(|| v.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capacity past `MAX_KV_CAPACITY_TOKENS` is unknown; one at it is kept.
    #[test]
    fn implausible_capacities_are_unknown() {
        let at = |blocks: u64| {
            let text = format!(
                "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n\
                 vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"{blocks}\"}} 1\n"
            );
            let expo = Exposition::parse(&text).unwrap();
            extract(ServerKind::Auto, &expo, None)
                .unwrap()
                .kv_capacity_tokens
        };
        assert_eq!(
            at(MAX_KV_CAPACITY_TOKENS / 16),
            Some(MAX_KV_CAPACITY_TOKENS)
        );
        assert_eq!(at(MAX_KV_CAPACITY_TOKENS / 16 + 1), None);
        assert_eq!(at(u64::MAX), None);
        assert_eq!(at(8_192), Some(131_072));
    }

    #[test]
    fn values_the_snapshot_rejects_are_dropped() {
        let text = concat!(
            "vllm:num_requests_running 1\n",
            "vllm:kv_cache_usage_perc 0.5\n",
            "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"10\"} 1\n",
            "vllm:lora_requests_info{running_lora_adapters=\"ok,bad\\nname\",waiting_lora_adapters=\"\"} 5\n",
        );
        let expo = Exposition::parse(text).unwrap();
        let s = extract(ServerKind::Auto, &expo, None).unwrap();
        assert_eq!(s.block_size, None);
        assert_eq!(s.kv_capacity_tokens, None);
        assert_eq!(s.lora_adapters, vec!["ok"]);
        assert_eq!(s.kv_usage, Some(0.5));
        let trt = concat!(
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"tokens_per\"} 0.4\n",
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\"} 1\n",
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\"} 4\n",
        );
        let expo = Exposition::parse(trt).unwrap();
        let s = extract(ServerKind::Trtllm, &expo, None).unwrap();
        assert_eq!(s.block_size, None);
        assert_eq!(s.kv_usage, Some(0.25));
    }

    /// LoRA names are the only strings a model server puts into the snapshot. One server
    /// listing a megabyte of them made every snapshot larger than the filter's ingest
    /// limit (1 MiB by default), so every Envoy refused every push and routed the whole
    /// fleet on stale stats. Names longer than [`MAX_LORA_NAME_BYTES`] are dropped, and an
    /// endpoint keeps at most [`MAX_LORA_BYTES`] of names (the first, in sorted order).
    #[test]
    fn lora_names_are_bounded() {
        let long = "x".repeat(MAX_LORA_NAME_BYTES + 1);
        let fits = "y".repeat(MAX_LORA_NAME_BYTES);
        let many: Vec<String> = (0..2_000).map(|i| format!("adapter-{i:05}")).collect();
        let text = format!(
            "vllm:num_requests_running 1\nvllm:lora_requests_info{{running_lora_adapters=\"ok,{long},{fits}\",waiting_lora_adapters=\"\"}} 5\n"
        );
        let s = extract(ServerKind::Vllm, &Exposition::parse(&text).unwrap(), None).unwrap();
        assert_eq!(s.lora_adapters, vec!["ok".to_owned(), fits]);
        let text = format!(
            "vllm:num_requests_running 1\nvllm:lora_requests_info{{running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} 5\n",
            many.join(",")
        );
        let s = extract(ServerKind::Vllm, &Exposition::parse(&text).unwrap(), None).unwrap();
        // 13 bytes each: the first ⌊4096 / 13⌋ = 315 names, in order.
        assert_eq!(s.lora_adapters.len(), MAX_LORA_BYTES / 13);
        assert_eq!(s.lora_adapters[..], many[..MAX_LORA_BYTES / 13]);
    }

    /// A label no rule names is logged once per process and name; a server that sends
    /// thousands of distinct label names (one malformed line, or new names every scrape)
    /// must not write a line for each nor grow the set of logged names without bound.
    #[test]
    fn unexpected_label_warnings_are_bounded() {
        let labels: Vec<String> = (0..5_000).map(|i| format!("odd_{i}=\"x\"")).collect();
        let text = format!(
            "vllm:num_requests_running{{engine=\"0\",{}}} 3\n",
            labels.join(",")
        );
        let s = extract(ServerKind::Vllm, &Exposition::parse(&text).unwrap(), None).unwrap();
        assert_eq!(s.running, 3);
        let logged = WARNED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        assert!(logged <= MAX_WARNED_LABELS, "{logged} label names kept");
    }

    /// A body of 80,000 distinct `engine` values (3.5 MB, under the 8 MiB
    /// `scrape.max_body_bytes`) took 20 s to extract with a linear search per series, on
    /// the control plane's one worker thread. Read through the scrape path's own calls,
    /// the first [`MAX_RANKS`] engines are kept (in body order) and the rest ignored.
    #[test]
    fn ranks_beyond_the_bound_are_ignored() {
        let body: String = (0..80_000)
            .map(|i| format!("vllm:num_requests_running{{engine=\"{i}\"}} 1\n"))
            .collect();
        assert_eq!(body.len(), 3_508_890);
        let e = Exposition::parse_bytes_with(body.as_bytes(), is_relevant).unwrap();
        assert_eq!(e.samples.len(), 80_000);
        let s = extract(ServerKind::Auto, &e, None).unwrap();
        assert_eq!(s.kind, ServerKind::Vllm);
        assert_eq!(s.running, 1024);
        assert_eq!(s.waiting, 0);
        assert_eq!(s.kv_usage, None);
        let ranks = vllm::LABELS.per_rank(&e, vllm::RUNNING);
        assert_eq!(ranks.len(), MAX_RANKS);
        assert_eq!(ranks.first(), Some(&(vec!["0"], 1.0)));
        assert_eq!(ranks.last(), Some(&(vec!["1023"], 1.0)));

        // SGLang's `dp_rank` and Triton's `model` + `version` likewise.
        let body: String = (0..80_000)
            .map(|i| format!("sglang:num_running_reqs{{dp_rank=\"{i}\"}} 2\n"))
            .collect();
        let e = Exposition::parse_bytes_with(body.as_bytes(), is_relevant).unwrap();
        let s = extract(ServerKind::Auto, &e, None).unwrap();
        assert_eq!((s.kind, s.running), (ServerKind::Sglang, 2048));
        let body: String = (0..20_000)
            .map(|i| {
                format!(
                    "nv_trt_llm_request_metrics{{model=\"m{i}\",request_type=\"active\",version=\"1\"}} 1\n\
                     nv_inference_count{{model=\"m{i}\",version=\"1\"}} 3\n"
                )
            })
            .collect();
        let e = Exposition::parse_bytes_with(body.as_bytes(), is_relevant).unwrap();
        let s = extract(ServerKind::Auto, &e, None).unwrap();
        assert_eq!((s.kind, s.running), (ServerKind::Trtllm, 1024));
        assert_eq!(s.monotonic_total, Some(3.0 * 1024.0));
    }

    /// `sum_of` adds the families present, ranks summed and copies not, and is `None` only
    /// when every family is absent.
    #[test]
    fn sum_of_adds_the_families_present() {
        let e = Exposition::parse(concat!(
            "vllm:prompt_tokens_total{engine=\"0\"} 100\n",
            "vllm:prompt_tokens_total{engine=\"1\"} 20\n",
            "vllm:generation_tokens_total{engine=\"0\",pid=\"1\"} 7\n",
            "vllm:generation_tokens_total{engine=\"0\",pid=\"2\"} 7\n",
        ))
        .unwrap();
        let (p, g) = (vllm::PROMPT_TOKENS, vllm::GENERATION_TOKENS);
        assert_eq!(vllm::LABELS.sum_of(&e, &[p, g]), Some(127.0));
        assert_eq!(vllm::LABELS.sum_of(&e, &[g, "vllm:absent"]), Some(7.0));
        assert_eq!(vllm::LABELS.sum_of(&e, &["vllm:absent"]), None);
        assert_eq!(vllm::LABELS.sum_of(&e, &[]), None);
    }

    /// A normal data-parallel exposition keeps every engine, in first-seen order, each at
    /// the maximum of its copies.
    #[test]
    fn per_rank_keeps_first_seen_order() {
        let e = Exposition::parse(concat!(
            "vllm:num_requests_running{engine=\"2\",pid=\"1\"} 4\n",
            "vllm:num_requests_running{engine=\"0\",pid=\"2\"} 1\n",
            "vllm:num_requests_running{engine=\"2\",pid=\"3\"} 6\n",
            "vllm:num_requests_running{engine=\"1\",pid=\"4\"} NaN\n",
        ))
        .unwrap();
        assert_eq!(
            vllm::LABELS.per_rank(&e, vllm::RUNNING),
            vec![(vec!["2"], 6.0), (vec!["0"], 1.0)]
        );
    }

    #[test]
    fn detect_by_names() {
        let p = |t: &str| Exposition::parse(t).unwrap();
        assert_eq!(
            detect(&p("vllm:num_requests_running 1")),
            Some(ServerKind::Vllm)
        );
        assert_eq!(
            detect(&p(
                "vllm:num_requests_running 1\nvllm:max_num_generation_tokens_sum 3"
            )),
            Some(ServerKind::LlmdSim)
        );
        assert_eq!(
            detect(&p("sglang:token_usage 0.1")),
            Some(ServerKind::Sglang)
        );
        assert_eq!(detect(&p("tgi_queue_size 1")), Some(ServerKind::Tgi));
        assert_eq!(
            detect(&p("llamacpp:requests_processing 1")),
            Some(ServerKind::Llamacpp)
        );
        assert_eq!(
            detect(&p("nv_trt_llm_request_metrics{request_type=\"max\"} 1")),
            Some(ServerKind::Trtllm)
        );
        assert_eq!(detect(&p("go_goroutines 3")), None);
        assert_eq!(
            extract(ServerKind::Auto, &p("go_goroutines 3"), None),
            Err(AdapterError::UnknownKind)
        );
    }

    #[test]
    fn configured_kind_must_match() {
        let e = Exposition::parse("tgi_queue_size 1").unwrap();
        assert_eq!(
            extract(ServerKind::Vllm, &e, None),
            Err(AdapterError::KindMismatch {
                kind: "vllm",
                expected: "vllm:num_requests_running"
            })
        );
    }

    #[test]
    fn helpers() {
        assert_eq!(count(Some(2.6)), 3);
        assert_eq!(count(Some(-1.0)), 0);
        assert_eq!(count(Some(f64::NAN)), 0);
        assert_eq!(count(None), 0);
        assert_eq!(count(Some(1e308 + 1e308)), u32::MAX);
        assert_eq!(count(Some(f64::NEG_INFINITY)), 0);
        assert_eq!(ratio(1.2), Some(1.0));
        assert_eq!(ratio(f64::NAN), None);
        assert_eq!(seconds_to_ms(1.7548326417716122e9), Some(1_754_832_641_772));
        assert_eq!(seconds_to_ms(0.0), None);
        assert_eq!(seconds_to_ms(1e308), None);
        assert_eq!(seconds_to_ms(MAX_START_S), Some(4_102_444_800_000));
    }
}
