//! SGLang adapter.
//!
//! Signals (names from SGLang `docs/references/production_metrics.md` and
//! `python/sglang/srt/metrics/collector.py`):
//! - KV usage: `sglang:token_usage`, the fraction of the KV token pool in use (0..1).
//! - Capacity: `sglang:max_total_num_tokens` when the release exports it; older releases do
//!   not, and it is then unknown (deriving it as `num_used_tokens / token_usage` would
//!   amplify the gauge's rounding, e.g. `0.28` in the docs sample).
//! - Queue depths: `sglang:num_running_reqs`, `sglang:num_queue_reqs`.
//! - Data parallelism: one sample per rank (`dp_rank` in newer releases); summed, usage
//!   averaged.
//! - Restart counter: `sglang:prompt_tokens_total + sglang:generation_tokens_total`.

use super::{count, ratio, AdapterError, ServerKind, ServerStats};
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

/// Extract SGLang stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    if !expo.has(RUNNING) && !expo.has(TOKEN_USAGE) {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Sglang.as_str(),
            expected: RUNNING,
        });
    }
    let usages: Vec<f64> = expo
        .family(TOKEN_USAGE)
        .filter_map(|s| ratio(s.value))
        .collect();
    let kv_usage = (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64);
    let kv_capacity_tokens = expo
        .sum(MAX_TOTAL_TOKENS)
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| v.round() as u64);
    let monotonic_total = match (expo.sum(PROMPT_TOKENS), expo.sum(GENERATION_TOKENS)) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
    };
    Ok(ServerStats {
        kind: ServerKind::Sglang,
        kv_usage,
        kv_capacity_tokens,
        block_size: None,
        running: count(expo.sum(RUNNING)),
        waiting: count(expo.sum(WAITING)),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total,
    })
}
