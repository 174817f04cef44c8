//! SGLang adapter.
//!
//! Signals (names from SGLang `docs/references/production_metrics.md` and
//! `python/sglang/srt/metrics/collector.py`):
//! - KV usage: `sglang:token_usage`, the fraction of the KV token pool in use (0..1).
//! - Capacity: `sglang:max_total_num_tokens` when the release exports it; older releases do
//!   not, and it is then unknown (deriving it as `num_used_tokens / token_usage` would
//!   amplify the gauge's rounding, e.g. `0.28` in the docs sample).
//! - Queue depths: `sglang:num_running_reqs`, `sglang:num_queue_reqs`.
//! - Data parallelism: one sample per `dp_rank` ([`LABELS`]); depths, capacity and counters
//!   summed, usage averaged. Newer releases label series with `tp_rank` and `pp_rank`, and
//!   with `--enable-metrics-for-all-schedulers` every TP/PP rank of one DP rank reports the
//!   same scheduler state: those are copies, counted once.
//! - Restart counter: `sglang:prompt_tokens_total + sglang:generation_tokens_total`.

use super::{count, ratio, AdapterError, LabelRules, ServerKind, ServerStats};
use crate::expo::Exposition;

/// KV token pool usage gauge.
pub const TOKEN_USAGE: &str = "sglang:token_usage";
/// KV token pool size gauge (newer releases).
pub const MAX_TOTAL_TOKENS: &str = "sglang:max_total_num_tokens";
/// Running requests gauge.
pub const RUNNING: &str = "sglang:num_running_reqs";
/// Queued requests gauge.
pub const WAITING: &str = "sglang:num_queue_reqs";
/// Prompt tokens counter.
pub const PROMPT_TOKENS: &str = "sglang:prompt_tokens_total";
/// Generation tokens counter.
pub const GENERATION_TOKENS: &str = "sglang:generation_tokens_total";

/// How SGLang labels its series (`python/sglang/srt/metrics/collector.py`).
pub const LABELS: LabelRules = LabelRules {
    kind: ServerKind::Sglang,
    rank: &["dp_rank"],
    copies: &["tp_rank", "pp_rank", "pid"],
    known: &["model_name", "engine_type"],
};

/// Extract SGLang stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    if !expo.has(RUNNING) && !expo.has(TOKEN_USAGE) {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Sglang.as_str(),
            expected: RUNNING,
        });
    }
    let usages: Vec<f64> = LABELS
        .per_rank(expo, TOKEN_USAGE)
        .into_iter()
        .filter_map(|(_, v)| ratio(v))
        .collect();
    let kv_usage = (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64);
    let kv_capacity_tokens = LABELS
        .sum(expo, MAX_TOTAL_TOKENS)
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| v.round() as u64);
    let monotonic_total = LABELS.sum_of(expo, &[PROMPT_TOKENS, GENERATION_TOKENS]);
    Ok(ServerStats {
        kind: ServerKind::Sglang,
        kv_usage,
        kv_capacity_tokens,
        block_size: None,
        running: count(LABELS.sum(expo, RUNNING)),
        waiting: count(LABELS.sum(expo, WAITING)),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TP ranks of one DP rank are copies; DP ranks add up.
    #[test]
    fn dp_ranks_add_up_tp_copies_do_not() {
        let e = Exposition::parse(concat!(
            "sglang:num_running_reqs{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 7\n",
            "sglang:num_running_reqs{dp_rank=\"0\",model_name=\"m\",tp_rank=\"1\"} 7\n",
            "sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\",tp_rank=\"0\"} 3\n",
            "sglang:token_usage{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 0.5\n",
            "sglang:token_usage{dp_rank=\"0\",model_name=\"m\",tp_rank=\"1\"} 0.5\n",
            "sglang:token_usage{dp_rank=\"1\",model_name=\"m\",tp_rank=\"0\"} 0.1\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.running, 10);
        assert!((s.kv_usage.unwrap() - 0.3).abs() < 1e-12);
    }
}
