//! vLLM adapter (V1 engine, falling back to V0 names).
//!
//! Signals (names from `vllm/v1/metrics/loggers.py` and `vllm/engine/metrics.py`):
//! - KV usage: `vllm:kv_cache_usage_perc` (V1, 0..1). vLLM renamed it from
//!   `vllm:gpu_cache_usage_perc`, which newer releases no longer export; when the new
//!   name is absent the old one is read (V0 servers, and V1 releases that export both).
//!   Neither present → unknown (`None`), never 0.
//! - Capacity: `vllm:cache_config_info` labels `num_gpu_blocks × block_size` (tokens); only
//!   those two labels are read because the label set changes between releases.
//! - Queue depths: `vllm:num_requests_running`, `vllm:num_requests_waiting`.
//! - Data parallelism: one sample per `engine` label ([`LABELS`]). Depths, capacity and
//!   counters are summed over engines; usage is the capacity-weighted mean (plain mean when
//!   a capacity is unknown), i.e. the fraction of all blocks in use. Series of one engine
//!   that differ only in `pid` (older vLLM in prometheus_client's multi-process mode) are
//!   copies, counted once at their maximum.
//! - LoRA: `vllm:lora_requests_info`, whose *value* is a Unix timestamp; vLLM keeps every
//!   label combination it ever set, so only the newest sample per engine is current. Its
//!   `running_lora_adapters` and `waiting_lora_adapters` are comma-separated lists.
//! - Process start: `process_start_time_seconds`, else the earliest `vllm:prompt_tokens_created`
//!   (prometheus_client's counter creation time, set while the engine starts).
//! - Restart counter: `vllm:prompt_tokens_total + vllm:generation_tokens_total`.

use super::{
    count, rank_admitted, ratio, seconds_to_ms, AdapterError, LabelRules, ServerKind, ServerStats,
    PROCESS_START,
};
use crate::expo::Exposition;
use std::collections::BTreeMap;

/// KV usage gauge, vLLM V1.
pub const KV_USAGE_V1: &str = "vllm:kv_cache_usage_perc";
/// KV usage gauge, vLLM V0 (renamed in V1).
pub const KV_USAGE_V0: &str = "vllm:gpu_cache_usage_perc";
/// Cache configuration info gauge (labels carry the config).
pub const CACHE_CONFIG: &str = "vllm:cache_config_info";
/// Running requests gauge.
pub const RUNNING: &str = "vllm:num_requests_running";
/// Waiting requests gauge.
pub const WAITING: &str = "vllm:num_requests_waiting";
/// LoRA info gauge (value = Unix timestamp).
pub const LORA_INFO: &str = "vllm:lora_requests_info";
/// Prompt tokens counter.
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
/// Generation tokens counter.
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// Creation time of the prompt tokens counter (prometheus_client `_created`).
pub const PROMPT_TOKENS_CREATED: &str = "vllm:prompt_tokens_created";

/// How vLLM labels its series (module docs of [`super`]).
pub const LABELS: LabelRules = LabelRules {
    kind: ServerKind::Vllm,
    rank: &["engine"],
    copies: &["pid"],
    known: &["model_name"],
};

/// Extract vLLM stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    extract_as(expo, ServerKind::Vllm)
}

/// Shared by vLLM and llm-d-inference-sim (same names).
pub(crate) fn extract_as(expo: &Exposition, kind: ServerKind) -> Result<ServerStats, AdapterError> {
    if !expo.has(RUNNING) && !expo.has(KV_USAGE_V1) && !expo.has(KV_USAGE_V0) {
        return Err(AdapterError::KindMismatch {
            kind: kind.as_str(),
            expected: RUNNING,
        });
    }
    // engine (rank key) -> capacity tokens, block size
    let mut capacity: BTreeMap<super::RankKey, (u64, u32)> = BTreeMap::new();
    for s in expo.family(CACHE_CONFIG) {
        let bs = s.label("block_size").and_then(|v| v.parse::<u32>().ok());
        let blocks = s
            .label("num_gpu_blocks")
            .and_then(|v| v.parse::<u64>().ok());
        if let (Some(bs), Some(blocks)) = (bs, blocks) {
            let key = LABELS.rank_key(s);
            if rank_admitted(
                capacity.len(),
                capacity.contains_key(&key),
                kind,
                CACHE_CONFIG,
            ) {
                capacity.insert(key, (blocks.saturating_mul(u64::from(bs)), bs));
            }
        }
    }
    let usage_name = if expo.has(KV_USAGE_V1) {
        KV_USAGE_V1
    } else {
        KV_USAGE_V0
    };
    let mut weighted = 0.0;
    let mut weight = 0.0;
    let mut plain = Vec::new();
    let mut all_weighted = true;
    for (engine, value) in LABELS.per_rank(expo, usage_name) {
        let Some(u) = ratio(value) else { continue };
        plain.push(u);
        match capacity.get(&engine) {
            Some(&(cap, _)) if cap > 0 => {
                weighted += u * cap as f64;
                weight += cap as f64;
            }
            _ => all_weighted = false,
        }
    }
    let kv_usage = if plain.is_empty() {
        None
    } else if all_weighted && weight > 0.0 {
        Some(weighted / weight)
    } else {
        Some(plain.iter().sum::<f64>() / plain.len() as f64)
    };
    let kv_capacity_tokens = (!capacity.is_empty()).then(|| {
        capacity
            .values()
            .fold(0u64, |total, c| total.saturating_add(c.0))
    });
    let mut sizes = capacity.values().map(|c| c.1);
    let first = sizes.next();
    let block_size = first.filter(|f| sizes.all(|s| s == *f));

    let mut newest: BTreeMap<&str, (f64, Vec<String>)> = BTreeMap::new();
    for s in expo.family(LORA_INFO) {
        let engine = s.label("engine").unwrap_or("");
        // A sample without a finite timestamp (NaN, ±Inf) cannot be placed in time: skipped,
        // so it never replaces a dated list (a NaN compared false and replaced the newest).
        if !s.value.is_finite() || newest.get(engine).is_some_and(|(ts, _)| *ts >= s.value) {
            continue;
        }
        if !rank_admitted(newest.len(), newest.contains_key(engine), kind, LORA_INFO) {
            continue;
        }
        let mut names = Vec::new();
        for key in ["running_lora_adapters", "waiting_lora_adapters"] {
            names.extend(
                s.label(key)
                    .unwrap_or("")
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned),
            );
        }
        newest.insert(engine, (s.value, names));
    }
    let mut lora_adapters: Vec<String> = newest.into_values().flat_map(|(_, n)| n).collect();
    lora_adapters.sort();
    lora_adapters.dedup();

    let process_start_ms = expo
        .family(PROCESS_START)
        .next()
        .and_then(|s| seconds_to_ms(s.value))
        .or_else(|| {
            expo.family(PROMPT_TOKENS_CREATED)
                .filter_map(|s| seconds_to_ms(s.value))
                .min()
        });
    let monotonic_total = LABELS.sum_of(expo, &[PROMPT_TOKENS, GENERATION_TOKENS]);
    Ok(ServerStats {
        kind,
        kv_usage,
        kv_capacity_tokens,
        block_size,
        running: count(LABELS.sum(expo, RUNNING)),
        waiting: count(LABELS.sum(expo, WAITING)),
        lora_adapters,
        process_start_ms,
        monotonic_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_engines_are_aggregated() {
        let e = Exposition::parse(concat!(
            "vllm:num_requests_running{engine=\"0\"} 3\n",
            "vllm:num_requests_running{engine=\"1\"} 5\n",
            "vllm:num_requests_waiting{engine=\"0\"} 1\n",
            "vllm:num_requests_waiting{engine=\"1\"} 0\n",
            "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
            "vllm:kv_cache_usage_perc{engine=\"1\"} 0.2\n",
            "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1\n",
            "vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"300\"} 1\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.running, 8);
        assert_eq!(s.waiting, 1);
        assert_eq!(s.kv_capacity_tokens, Some(6400));
        assert_eq!(s.block_size, Some(16));
        // (0.5*1600 + 0.2*4800) / 6400 = 0.275
        assert!((s.kv_usage.unwrap() - 0.275).abs() < 1e-12);
    }

    /// Issue 14: two copies of engine 0 (older multi-process vLLM, `pid` label) read as
    /// running 5, not 10; distinct engines still add up.
    #[test]
    fn copies_of_one_engine_are_counted_once() {
        let e = Exposition::parse(concat!(
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\",pid=\"101\"} 5\n",
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\",pid=\"102\"} 5\n",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\",pid=\"101\"} 0\n",
            "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\",pid=\"102\"} 2\n",
            "vllm:num_requests_waiting{engine=\"1\",model_name=\"m\",pid=\"103\"} 3\n",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\",pid=\"101\"} 0.5\n",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\",pid=\"102\"} 0.5\n",
            "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\",pid=\"101\"} 100\n",
            "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\",pid=\"102\"} 100\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.running, 5);
        assert_eq!(s.waiting, 5);
        assert_eq!(s.kv_usage, Some(0.5));
        assert_eq!(s.monotonic_total, Some(100.0));
        assert!(LABELS.unexpected(&e, RUNNING).is_empty());
        let odd = Exposition::parse(concat!(
            "vllm:num_requests_running{engine=\"0\",zone=\"a\"} 4\n",
            "vllm:num_requests_running{engine=\"0\",zone=\"b\"} 4\n",
        ))
        .unwrap();
        assert_eq!(LABELS.unexpected(&odd, RUNNING), vec!["zone"]);
        assert_eq!(extract(&odd).unwrap().running, 4);
    }

    #[test]
    fn missing_kv_gauge_is_unknown_not_zero() {
        let e = Exposition::parse("vllm:num_requests_running 2\n").unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.kv_usage, None);
        assert_eq!(s.kv_capacity_tokens, None);
        assert_eq!(s.running, 2);
    }

    #[test]
    fn newest_lora_info_wins() {
        let e = Exposition::parse(concat!(
            "vllm:num_requests_running 0\n",
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 100\n",
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"b,a\",waiting_lora_adapters=\"c\"} 200\n",
        ))
        .unwrap();
        assert_eq!(extract(&e).unwrap().lora_adapters, vec!["a", "b", "c"]);
        // An undated sample (NaN, +Inf) does not replace the newest dated list.
        for bad in ["NaN", "+Inf"] {
            let text = format!(
                "vllm:num_requests_running 0\n\
                 vllm:lora_requests_info{{running_lora_adapters=\"b,a\",waiting_lora_adapters=\"\"}} 200\n\
                 vllm:lora_requests_info{{running_lora_adapters=\"x\",waiting_lora_adapters=\"\"}} {bad}\n"
            );
            let e = Exposition::parse(&text).unwrap();
            assert_eq!(extract(&e).unwrap().lora_adapters, vec!["a", "b"], "{bad}");
        }
    }

    /// Capacities a broken server reports must not overflow the sum over engines (a
    /// panic in a debug build, a wrapped capacity in a release one): it saturates, and
    /// `adapters::extract` then reads the implausible sum as unknown.
    #[test]
    fn huge_capacities_saturate() {
        let e = Exposition::parse(concat!(
            "vllm:num_requests_running{engine=\"0\"} 1\n",
            "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n",
            "vllm:kv_cache_usage_perc{engine=\"1\"} 0.5\n",
            "vllm:cache_config_info{engine=\"0\",block_size=\"16\",num_gpu_blocks=\"18446744073709551615\"} 1\n",
            "vllm:cache_config_info{engine=\"1\",block_size=\"16\",num_gpu_blocks=\"2\"} 1\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.kv_capacity_tokens, Some(u64::MAX));
        assert_eq!(s.block_size, Some(16));
        assert_eq!(s.kv_usage, Some(0.5));
    }
}
