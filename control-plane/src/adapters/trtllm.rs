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

use super::{count, ratio, AdapterError, ServerKind, ServerStats};
use crate::expo::Exposition;

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

/// Extract TensorRT-LLM stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    if !expo.has_prefix("nv_trt_llm_") {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Trtllm.as_str(),
            expected: REQUESTS,
        });
    }
    let block = |t: &str| {
        expo.labelled(KV_BLOCKS, KV_BLOCK_TYPE, t)
            .filter(|v| v.is_finite())
    };
    let used = block("used");
    let max = block("max").filter(|m| *m > 0.0);
    let tokens_per = block("tokens_per").filter(|t| *t > 0.0);
    let kv_usage = match (used, max) {
        (Some(u), Some(m)) => ratio(u / m),
        _ => block("fraction").and_then(ratio),
    };
    let kv_capacity_tokens = match (max, tokens_per) {
        (Some(m), Some(t)) => Some((m * t).round() as u64),
        _ => None,
    };
    Ok(ServerStats {
        kind: ServerKind::Trtllm,
        kv_usage,
        kv_capacity_tokens,
        block_size: tokens_per.map(|t| t.round().min(u32::MAX as f64) as u32),
        running: count(expo.labelled(REQUESTS, REQUEST_TYPE, "active")),
        waiting: count(expo.labelled(REQUESTS, REQUEST_TYPE, "waiting")),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total: expo.sum(INFERENCE_COUNT),
    })
}
