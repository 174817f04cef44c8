//! Hugging Face TGI adapter.
//!
//! TGI exports no KV-cache gauge. It does export its token budget: `tgi_batch_max_total_tokens`
//! is `max_batch_total_tokens`, which the router sets at warm-up from the KV memory the
//! shard could allocate (`backends/v3/src/lib.rs`, `router/src/server.rs`), and
//! `tgi_batch_current_max_tokens` is the tokens the running batch has reserved
//! (prompt + `max_new_tokens` of each request, `backends/v3/src/backend.rs`). Their ratio is
//! the fraction of the KV budget reserved, which is what an admission decision needs, so
//! it is reported as KV usage (clamped to 0..1). Either gauge missing → unknown.
//!
//! - Capacity: `tgi_batch_max_total_tokens` (tokens).
//! - Queue depths: `tgi_batch_current_size` (running), `tgi_queue_size` (waiting).
//! - Restart counter: `tgi_request_count` (counter without `_total`, metrics-exporter-prometheus style).

use super::{count, ratio, AdapterError, LabelRules, ServerKind, ServerStats};
use crate::expo::Exposition;

/// Tokens reserved by the current batch.
pub const BATCH_CURRENT_MAX_TOKENS: &str = "tgi_batch_current_max_tokens";
/// KV token budget (`max_batch_total_tokens`).
pub const BATCH_MAX_TOTAL_TOKENS: &str = "tgi_batch_max_total_tokens";
/// Requests in the running batch.
pub const BATCH_CURRENT_SIZE: &str = "tgi_batch_current_size";
/// Requests queued.
pub const QUEUE_SIZE: &str = "tgi_queue_size";
/// Requests received counter.
pub const REQUEST_COUNT: &str = "tgi_request_count";

/// TGI exports one series per gauge from one process: any repeated series is a copy.
pub const LABELS: LabelRules = LabelRules {
    kind: ServerKind::Tgi,
    rank: &[],
    copies: &[],
    known: &[],
};

/// Extract TGI stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    if !expo.has(QUEUE_SIZE) && !expo.has(BATCH_CURRENT_SIZE) {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Tgi.as_str(),
            expected: QUEUE_SIZE,
        });
    }
    let budget = LABELS
        .sum(expo, BATCH_MAX_TOTAL_TOKENS)
        .filter(|v| v.is_finite() && *v > 0.0);
    let reserved = LABELS.sum(expo, BATCH_CURRENT_MAX_TOKENS);
    let kv_usage = match (reserved, budget) {
        (Some(r), Some(b)) => ratio(r / b),
        _ => None,
    };
    Ok(ServerStats {
        kind: ServerKind::Tgi,
        kv_usage,
        kv_capacity_tokens: budget.map(|b| b.round() as u64),
        block_size: None,
        running: count(LABELS.sum(expo, BATCH_CURRENT_SIZE)),
        waiting: count(LABELS.sum(expo, QUEUE_SIZE)),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total: LABELS.sum(expo, REQUEST_COUNT),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TGI has one router, so every repeated series is a copy, counted once: the token
    /// budget too, not only the reserved tokens (a duplicated budget line halved the usage
    /// and doubled the capacity).
    #[test]
    fn a_repeated_budget_series_is_a_copy() {
        let e = Exposition::parse(concat!(
            "tgi_queue_size 2\n",
            "tgi_batch_current_size 3\n",
            "tgi_batch_current_max_tokens 500\n",
            "tgi_batch_current_max_tokens 500\n",
            "tgi_batch_max_total_tokens{instance=\"a\"} 1000\n",
            "tgi_batch_max_total_tokens{instance=\"b\"} 1000\n",
        ))
        .unwrap();
        let s = extract(&e).unwrap();
        assert_eq!(s.kv_capacity_tokens, Some(1000));
        assert_eq!(s.kv_usage, Some(0.5));
        assert_eq!((s.running, s.waiting), (3, 2));
    }
}
