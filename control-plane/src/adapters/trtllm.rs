//! Triton + TensorRT-LLM backend adapter.
//!
//! Signals (names from `tensorrtllm_backend` README, "Triton Metrics"):
//! - `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=...}` with `max`, `free`,
//!   `used`, `tokens_per` (block size) and `fraction`.
//! - KV usage: `used / max` when both are present and `max > 0`. The README's own sample
//!   reports `fraction 0.4875` next to `used 1`, `max 6239` (0.00016), so `fraction` is
//!   not trusted when the block counts are there; it is read only as a fallback.
//! - Capacity: `max × tokens_per` (tokens); block size `tokens_per`.
//! - Queue depths: `nv_trt_llm_request_metrics{request_type="active"}` (running) and
//!   `{request_type="waiting"}`.
//! - Restart counter: `nv_inference_count` (Triton per-model counter).
//!
//! The V1 (non-inflight-batcher) model exports no KV metrics: usage is unknown.
//!
//! **Several models or versions.** Triton labels every series with `model` and `version`
//! (Triton `docs/user_guide/metrics.md`), and one Triton can serve several TensorRT-LLM
//! models, or several versions of one (version policy `all` / `latest: N`), each with its
//! own executor and KV cache pool. Each (`model`, `version`) pair is therefore a distinct
//! engine ([`LABELS`]): queue depths, block counts and capacity are added up over them,
//! usage is `Σ used / Σ max` (each pool weighted by its size), and the block size is kept
//! only when all pools agree. The restart counter is `nv_inference_count` of those same
//! pairs only (those with a `nv_trt_llm_*` series; the ensemble's pre/post-processing
//! models do not count); a version that is
//! unloaded or replaced takes its count with it, which reads as a restart: right, since the
//! new engine's KV cache is cold. One endpoint still has one KV figure: to route each
//! model on its own pool's load, give each model its own endpoint (port or pod).

use super::{
    count, rank_admitted, ratio, AdapterError, LabelRules, RankKey, ServerKind, ServerStats,
};
use crate::expo::Exposition;
use std::collections::{HashMap, HashSet};

/// KV block metrics family.
pub const KV_BLOCKS: &str = "nv_trt_llm_kv_cache_block_metrics";
/// Label of [`KV_BLOCKS`] naming the quantity.
pub const KV_BLOCK_TYPE: &str = "kv_cache_block_type";
/// Request metrics family.
pub const REQUESTS: &str = "nv_trt_llm_request_metrics";
/// Label of [`REQUESTS`] naming the quantity.
pub const REQUEST_TYPE: &str = "request_type";
/// V1 (non-inflight-batcher) model metrics; read only to detect the kind.
pub const V1_METRICS: &str = "nv_trt_llm_v1_metrics";
/// Triton inference counter.
pub const INFERENCE_COUNT: &str = "nv_inference_count";

/// How Triton labels TensorRT-LLM series: one engine per (`model`, `version`); the
/// quantity labels select a value within a family.
pub const LABELS: LabelRules = LabelRules {
    kind: ServerKind::Trtllm,
    rank: &["model", "version"],
    copies: &[],
    known: &[KV_BLOCK_TYPE, REQUEST_TYPE],
};

/// Extract TensorRT-LLM stats.
pub fn extract<'a>(expo: &'a Exposition) -> Result<ServerStats, AdapterError> {
    if !expo.has_prefix("nv_trt_llm_") {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Trtllm.as_str(),
            expected: REQUESTS,
        });
    }
    let block = |t: &str| LABELS.per_rank_where(expo, KV_BLOCKS, Some((KV_BLOCK_TYPE, t)));
    let by_rank = |ranks: Vec<(RankKey<'a>, f64)>| ranks.into_iter().collect::<HashMap<_, _>>();
    let of = |ranks: &HashMap<RankKey, f64>, key: &RankKey| ranks.get(key).copied();
    let max = block("max");
    let (used, tokens_per) = (by_rank(block("used")), by_rank(block("tokens_per")));
    // Pools with both block counts (and a positive size) give a capacity-weighted usage;
    // capacity needs the block size too.
    let (mut used_sum, mut max_sum, mut capacity, mut sizes) = (0.0, 0.0, 0.0, Vec::new());
    for (key, m) in max.iter().filter(|(_, m)| *m > 0.0) {
        if let Some(u) = of(&used, key) {
            used_sum += u;
            max_sum += m;
        }
        if let Some(t) = of(&tokens_per, key).filter(|t| *t > 0.0) {
            capacity += m * t;
            sizes.push(t);
        }
    }
    let kv_usage = if max_sum > 0.0 {
        ratio(used_sum / max_sum)
    } else {
        let fractions: Vec<f64> = block("fraction")
            .into_iter()
            .filter_map(|(_, f)| ratio(f))
            .collect();
        (!fractions.is_empty()).then(|| fractions.iter().sum::<f64>() / fractions.len() as f64)
    };
    let block_size = sizes
        .first()
        .filter(|f| sizes.iter().all(|s| s == *f))
        .map(|t| t.round().min(u32::MAX as f64) as u32);
    // The TensorRT-LLM engines: every (model, version) with a TensorRT-LLM series.
    // A set, at most `MAX_RANKS` of them: a linear `contains` over every series made a
    // body with tens of thousands of models quadratic.
    let mut engines: HashSet<RankKey> = HashSet::new();
    for s in [KV_BLOCKS, REQUESTS, V1_METRICS]
        .into_iter()
        .flat_map(|n| expo.family(n))
    {
        let key = LABELS.rank_key(s);
        let known = engines.contains(&key);
        if rank_admitted(engines.len(), known, ServerKind::Trtllm, s.name.as_str()) {
            engines.insert(key);
        }
    }
    let counts: Vec<f64> = LABELS
        .per_rank(expo, INFERENCE_COUNT)
        .into_iter()
        .filter(|(k, _)| engines.contains(k))
        .map(|(_, v)| v)
        .collect();
    Ok(ServerStats {
        kind: ServerKind::Trtllm,
        kv_usage,
        kv_capacity_tokens: (capacity > 0.0).then(|| capacity.round() as u64),
        block_size,
        running: count(LABELS.sum_where(expo, REQUESTS, Some((REQUEST_TYPE, "active")))),
        waiting: count(LABELS.sum_where(expo, REQUESTS, Some((REQUEST_TYPE, "waiting")))),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total: (!counts.is_empty()).then(|| counts.iter().sum()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README sample's families (`triton-trtllm-backend-readme.prom` in the shared
    /// data) for a Triton serving three TensorRT-LLM engines: `tensorrt_llm` versions 1 and
    /// 2 (version policy `all`) and `llama_70b` version 1, beside the ensemble's
    /// `preprocessing` and `ensemble` models, which have no `nv_trt_llm_*` series.
    const MULTI: &str = concat!(
        "nv_trt_llm_request_metrics{model=\"tensorrt_llm\",request_type=\"active\",version=\"1\"} 3\n",
        "nv_trt_llm_request_metrics{model=\"tensorrt_llm\",request_type=\"waiting\",version=\"1\"} 1\n",
        "nv_trt_llm_request_metrics{model=\"tensorrt_llm\",request_type=\"max\",version=\"1\"} 512\n",
        "nv_trt_llm_request_metrics{model=\"tensorrt_llm\",request_type=\"active\",version=\"2\"} 2\n",
        "nv_trt_llm_request_metrics{model=\"tensorrt_llm\",request_type=\"waiting\",version=\"2\"} 0\n",
        "nv_trt_llm_request_metrics{model=\"llama_70b\",request_type=\"active\",version=\"1\"} 0\n",
        "nv_trt_llm_request_metrics{model=\"llama_70b\",request_type=\"waiting\",version=\"1\"} 2\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"fraction\",model=\"tensorrt_llm\",version=\"1\"} 0.4875\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"tokens_per\",model=\"tensorrt_llm\",version=\"1\"} 64\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",model=\"tensorrt_llm\",version=\"1\"} 100\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",model=\"tensorrt_llm\",version=\"1\"} 1000\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"tokens_per\",model=\"tensorrt_llm\",version=\"2\"} 64\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",model=\"tensorrt_llm\",version=\"2\"} 300\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",model=\"tensorrt_llm\",version=\"2\"} 1000\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"tokens_per\",model=\"llama_70b\",version=\"1\"} 32\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",model=\"llama_70b\",version=\"1\"} 0\n",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",model=\"llama_70b\",version=\"1\"} 2000\n",
        "nv_inference_count{model=\"tensorrt_llm\",version=\"1\"} 50\n",
        "nv_inference_count{model=\"tensorrt_llm\",version=\"2\"} 20\n",
        "nv_inference_count{model=\"llama_70b\",version=\"1\"} 5\n",
        "nv_inference_count{model=\"preprocessing\",version=\"1\"} 1000\n",
        "nv_inference_count{model=\"ensemble\",version=\"1\"} 1000\n",
    );

    #[test]
    fn models_and_versions_are_distinct_engines() {
        let e = Exposition::parse(MULTI).unwrap();
        let s = extract(&e).unwrap();
        // (100 + 300 + 0) used of (1000 + 1000 + 2000) blocks.
        assert_eq!(s.kv_usage, Some(0.1));
        assert_eq!(
            s.kv_capacity_tokens,
            Some(1000 * 64 + 1000 * 64 + 2000 * 32)
        );
        assert_eq!(s.block_size, None, "pools of 64- and 32-token blocks");
        assert_eq!((s.running, s.waiting), (3 + 2, 1 + 2));
        assert_eq!(
            s.monotonic_total,
            Some(50.0 + 20.0 + 5.0),
            "ensemble models left out"
        );
        for family in [KV_BLOCKS, REQUESTS, INFERENCE_COUNT] {
            assert!(LABELS.unexpected(&e, family).is_empty(), "{family}");
        }
    }

    #[test]
    fn one_model_two_versions_keep_their_block_size() {
        let one: String = MULTI
            .lines()
            .filter(|l| !l.contains("llama_70b"))
            .map(|l| format!("{l}\n"))
            .collect();
        let s = extract(&Exposition::parse(&one).unwrap()).unwrap();
        assert_eq!(s.kv_usage, Some(0.2));
        assert_eq!(s.kv_capacity_tokens, Some(2000 * 64));
        assert_eq!(s.block_size, Some(64));
        assert_eq!((s.running, s.waiting), (5, 1));
        assert_eq!(s.monotonic_total, Some(70.0));
    }

    /// Replacing version 1 by version 2 drops version 1's count: read as a restart (the new
    /// engine's KV cache is cold).
    #[test]
    fn a_replaced_version_reads_as_a_restart() {
        let before: String = MULTI
            .lines()
            .filter(|l| !l.contains("version=\"2\""))
            .map(|l| format!("{l}\n"))
            .collect();
        let after: String = MULTI
            .lines()
            .filter(|l| !(l.contains("tensorrt_llm") && l.contains("version=\"1\"")))
            .map(|l| format!("{l}\n"))
            .collect();
        let a = extract(&Exposition::parse(&before).unwrap()).unwrap();
        let b = extract(&Exposition::parse(&after).unwrap()).unwrap();
        assert_eq!(
            (a.monotonic_total, b.monotonic_total),
            (Some(55.0), Some(25.0))
        );
        let mut t = crate::restart::RestartTracker::default();
        assert!(!t.observe(&a, 1_000));
        assert!(t.observe(&b, 2_000));
    }

    #[test]
    fn fraction_is_the_fallback_without_block_counts() {
        let e = Exposition::parse(concat!(
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"fraction\",model=\"a\",version=\"1\"} 0.2\n",
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"fraction\",model=\"b\",version=\"1\"} 0.4\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert!((s.kv_usage.unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(s.kv_capacity_tokens, None);
    }
}
