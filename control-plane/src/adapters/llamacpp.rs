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
    next_token: FirstDecoded,
}

/// `next_token[0].n_decoded` (0 when absent); the array's other entries are skipped, not
/// collected.
#[derive(Debug, Default)]
struct FirstDecoded(u64);

#[derive(Debug, Deserialize)]
struct NextToken {
    #[serde(default)]
    n_decoded: u64,
}

impl<'de> Deserialize<'de> for FirstDecoded {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = FirstDecoded;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of next tokens")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<NextToken>()?.map_or(0, |t| t.n_decoded);
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(FirstDecoded(first))
            }
        }
        d.deserialize_seq(V)
    }
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
///
/// The slots are folded one by one as they are parsed, never collected: an 8 MB body of
/// `[{},{},…]` (2.7 million slots, within `scrape.max_body_bytes`) took ~300 MB and ~90 ms
/// of the only worker thread per scrape as a `Vec` (found by a breaker, 2026-12-05).
pub fn slots_usage(body: &[u8]) -> Option<(u64, u64, u32)> {
    struct Fold;
    impl<'de> serde::de::Visitor<'de> for Fold {
        type Value = (u64, u64, u32);
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON array of slots")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let (mut held, mut capacity, mut busy) = (0u64, 0u64, 0u32);
            while let Some(s) = seq.next_element::<Slot>()? {
                capacity = capacity.saturating_add(s.n_ctx);
                if s.is_processing {
                    let tokens = s.n_prompt_tokens.saturating_add(s.next_token.0);
                    held = held.saturating_add(tokens.min(s.n_ctx));
                    busy = busy.saturating_add(1);
                }
            }
            Ok((held, capacity, busy))
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let out = serde::Deserializer::deserialize_seq(&mut de, Fold).ok()?;
    de.end().ok()?;
    (out.1 > 0).then_some(out)
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

    /// Slots are folded as they are parsed: a million empty slots and a slot whose
    /// `next_token` holds a million entries give the same sums as the small body, only the
    /// first next token counts, and a body that goes on after the array is not a slot array.
    #[test]
    fn slots_are_folded_not_collected() {
        let busy = r#"{"n_ctx":1000,"is_processing":true,"n_prompt_tokens":200,"next_token":[{"n_decoded":50},"#;
        let many_tokens = format!("{busy}{}{{}}]}}", r#"{"n_decoded":7},"#.repeat(1_000_000));
        let body = format!(
            "[{many_tokens},{}{{\"n_ctx\":24}}]",
            "{},".repeat(1_000_000)
        );
        assert_eq!(slots_usage(body.as_bytes()), Some((250, 1024, 1)));
        assert_eq!(
            slots_usage(
                br#"[{"n_ctx":100,"is_processing":true,"n_prompt_tokens":5,"next_token":[]}]"#
            ),
            Some((5, 100, 1))
        );
        assert_eq!(slots_usage(br#"[{"n_ctx":100}] trailing"#), None);
        assert_eq!(slots_usage(br#"[{"n_ctx":100},"#), None);
    }
}
