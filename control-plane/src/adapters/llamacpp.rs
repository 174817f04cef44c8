//! llama.cpp (`llama-server --metrics`) adapter.
//!
//! Current builds export no KV gauge (`llamacpp:kv_cache_usage_ratio` and
//! `llamacpp:kv_cache_tokens` left with the KV-cache-view API), so KV state comes from
//! `GET /slots` (`tools/server/README.md`): each slot has a context of `n_ctx` tokens;
//! a busy slot (`is_processing`) holds its prompt (`n_prompt_tokens`) plus the tokens
//! decoded so far (`next_token[0].n_decoded`).
//! - KV usage: Σ tokens held by busy slots / Σ `n_ctx`. Idle slots keep their last prompt
//!   for reuse but can be overwritten, so they count as free.
//! - Capacity: Σ `n_ctx` (tokens).
//! - No `/slots` body (disabled with `--no-slots`, or the request failed): the legacy
//!   `llamacpp:kv_cache_usage_ratio` when present, else unknown.
//! - Queue depths: `llamacpp:requests_processing` (running), `llamacpp:requests_deferred` (waiting).
//! - Restart counter: `llamacpp:prompt_tokens_total + llamacpp:tokens_predicted_total`.

use super::{count, ratio, AdapterError, LabelRules, ServerKind, ServerStats};
use crate::expo::Exposition;
use serde::Deserialize;

/// Legacy KV usage gauge (2024 builds).
pub const KV_USAGE_LEGACY: &str = "llamacpp:kv_cache_usage_ratio";
/// Requests being processed.
pub const PROCESSING: &str = "llamacpp:requests_processing";
/// Requests deferred (queued).
pub const DEFERRED: &str = "llamacpp:requests_deferred";
/// Prompt tokens counter.
pub const PROMPT_TOKENS: &str = "llamacpp:prompt_tokens_total";
/// Predicted tokens counter.
pub const PREDICTED_TOKENS: &str = "llamacpp:tokens_predicted_total";

/// One entry of `GET /slots` (fields not listed are ignored).
#[derive(Debug, Deserialize)]
struct Slot {
    #[serde(default)]
    n_ctx: u64,
    #[serde(default)]
    is_processing: bool,
    #[serde(default)]
    n_prompt_tokens: u64,
    #[serde(default)]
    next_token: Vec<NextToken>,
}

#[derive(Debug, Deserialize)]
struct NextToken {
    #[serde(default)]
    n_decoded: u64,
}

/// llama.cpp exports one series per gauge from one process: any repeated series is a copy.
pub const LABELS: LabelRules = LabelRules {
    kind: ServerKind::Llamacpp,
    rank: &[],
    copies: &[],
    known: &[],
};

/// KV state read from a `/slots` body: (tokens held, capacity tokens, busy slots).
/// `None` when the body is not a JSON slot array or the capacity is 0.
pub fn slots_usage(body: &[u8]) -> Option<(u64, u64, u32)> {
    let slots: Vec<Slot> = serde_json::from_slice(body).ok()?;
    let capacity = slots.iter().fold(0u64, |c, s| c.saturating_add(s.n_ctx));
    if capacity == 0 {
        return None;
    }
    let mut held = 0u64;
    let mut busy = 0u32;
    for s in slots.iter().filter(|s| s.is_processing) {
        let decoded = s.next_token.first().map_or(0, |n| n.n_decoded);
        held = held.saturating_add(s.n_prompt_tokens.saturating_add(decoded).min(s.n_ctx));
        busy = busy.saturating_add(1);
    }
    Some((held, capacity, busy))
}

/// Extract llama.cpp stats; `slots` is the `GET /slots` body when fetched.
pub fn extract(expo: &Exposition, slots: Option<&[u8]>) -> Result<ServerStats, AdapterError> {
    if !expo.has_prefix("llamacpp:") {
        return Err(AdapterError::KindMismatch {
            kind: ServerKind::Llamacpp.as_str(),
            expected: PROCESSING,
        });
    }
    let from_slots = slots.and_then(slots_usage);
    let (kv_usage, kv_capacity_tokens) = match from_slots {
        Some((held, cap, _)) => (ratio(held as f64 / cap as f64), Some(cap)),
        None => (
            expo.family(KV_USAGE_LEGACY)
                .next()
                .and_then(|s| ratio(s.value)),
            None,
        ),
    };
    let monotonic_total = LABELS.sum_of(expo, &[PROMPT_TOKENS, PREDICTED_TOKENS]);
    Ok(ServerStats {
        kind: ServerKind::Llamacpp,
        kv_usage,
        kv_capacity_tokens,
        block_size: None,
        running: count(LABELS.sum(expo, PROCESSING)),
        waiting: count(LABELS.sum(expo, DEFERRED)),
        lora_adapters: Vec::new(),
        process_start_ms: None,
        monotonic_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_bad_bodies_are_unknown() {
        assert_eq!(slots_usage(b"not json"), None);
        assert_eq!(slots_usage(b"[]"), None);
        assert_eq!(slots_usage(b"{\"error\":\"slots disabled\"}"), None);
        assert_eq!(
            slots_usage(br#"[{"n_ctx":100,"is_processing":true,"n_prompt_tokens":500}]"#),
            Some((100, 100, 1))
        );
    }

    /// `n_ctx` values a broken server sends must not overflow the capacity sum (a panic
    /// in a debug build, a wrapped, tiny capacity in a release one): it saturates.
    #[test]
    fn huge_contexts_saturate() {
        let body = br#"[{"n_ctx":18446744073709551615,"is_processing":false},{"n_ctx":4096,"is_processing":true,"n_prompt_tokens":100}]"#;
        assert_eq!(slots_usage(body), Some((100, u64::MAX, 1)));
    }
}
