//! `predicted_ttft`: send each request where its first token is predicted to come soonest,
//! with the prediction in seconds from a model of the engine, not a weighted score.
//!
//! For each eligible endpoint *e*:
//!
//! ```text
//! work(e)      = pending_prefill(e) + uncached(e)                               tokens
//! shortfall(e) = max(0, uncached(e) + expected_output − free_kv(e))             tokens
//! factor(e)    = B / max(B − D(e), B / 8)                                       ≥ 1
//! ttft(e)      = (work(e) + shortfall(e)) × factor(e) / R(e)                    seconds
//! ```
//!
//! * `pending_prefill(e)`: prompt tokens of the router's requests on *e* that have no first
//!   token yet, minus what the prefix index expected cached there
//!   ([`super::InFlight::prefill_tokens`]). vLLM and SGLang schedule prefill first-come
//!   first-served with chunked prefill, so this is the prefill that runs before ours.
//! * `uncached(e)`: this request's prompt tokens not expected in *e*'s prefix cache
//!   ([`super::uncached_prompt_tokens`]). **Prefix affinity is part of the predicted time**:
//!   a cached prefix is prefill that does not happen. A prefix holder therefore keeps its
//!   conversations until its queue costs more than the recompute elsewhere, and no
//!   threshold decides when ("sticky until saturated", the behaviour llm-d's
//!   `prefix-cache-affinity-filter` gets from its 0.80 gate plus an 18 s TTFT penalty,
//!   here by construction).
//! * `shortfall(e)`: KV tokens this request needs beyond what is free
//!   (`capacity × (1 − kv_usage) − in-flight reserved tokens`; `expected_output` = the
//!   request's KV demand minus its prompt, from learned output lengths when the caller has
//!   them). The engine admits a request only when its blocks fit, so a shortfall is waited
//!   out while running requests finish and free blocks; it is charged as that many tokens of
//!   work, as the oracle of `kvroute-bench` does. 0 when usage or capacity is unknown.
//! * `factor(e)`: decode-batch interference. A vLLM V1 step carries at most `B` tokens
//!   (`max_num_batched_tokens`, [`DEFAULT_STEP_TOKEN_BUDGET`] = 8 192, vLLM's default for
//!   online serving, `vllm/engine/arg_utils.py`), one per running decode sequence first
//!   (decode-first scheduling), the rest for prefill chunks; with `D(e)` decode sequences
//!   (snapshot `running` plus requests sent since the scrape) prefill gets `B − D` tokens per
//!   step, so it takes `B / (B − D)` times longer. Capped at 8× (D ≥ 7B/8 means the engine is
//!   decode-bound and the snapshot is probably stale).
//! * `R(e)`: prefill throughput of *e*, tokens/s, learned online from time to first byte
//!   ([`crate::prefill_rate`]), seeded from the model profile.
//!
//! The endpoint with the lowest predicted TTFT wins; equal predictions fall to fewer
//! outstanding requests, then at random. With one request in the system and no cached
//! prefix, every idle endpoint predicts the same time and the outstanding-request count
//! decides, so the policy degrades to least-request, never to a fixed endpoint.
//!
//! Units are physical (tokens, tokens/s, seconds) and the only parameter that depends on
//! the deployment, `R(e)`, is measured, not tuned, so the cost carries over to fleets and
//! traces it was not fitted on.

use super::{uncached_prompt_tokens, Candidate, PickRequest};
use crate::prefill_rate::PrefillRates;
use crate::snapshot::EndpointStats;

/// vLLM's default `max_num_batched_tokens` for online serving (tokens per engine step).
pub const DEFAULT_STEP_TOKEN_BUDGET: u32 = 8_192;
/// Largest decode-interference factor.
pub const MAX_INTERFERENCE: f64 = 8.0;

/// A TTFT prediction for one endpoint, with each term (for decision records and for the
/// learner's observation).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct TtftPrediction {
    /// Pending prefill of the router's requests there, tokens.
    pub pending_prefill_tokens: u64,
    /// This request's prompt tokens not expected cached there.
    pub uncached_tokens: u64,
    /// KV tokens missing for this request, tokens.
    pub kv_shortfall_tokens: u64,
    /// Decode-interference factor (≥ 1).
    pub interference: f64,
    /// Prefill throughput used, tokens/s.
    pub tokens_per_s: f64,
    /// `(pending + uncached + shortfall) × interference`, tokens: the work to feed the
    /// learner together with the measured time to first byte.
    pub effective_tokens: f64,
    /// Predicted time to first token, seconds.
    pub seconds: f64,
}

/// Predict the TTFT of `req` on endpoint `e` (see the module doc). `matched_blocks` is the
/// request's prefix blocks the router expects cached there; `inflight` the router's load on
/// it; `budget` the engine step token budget (0 → [`DEFAULT_STEP_TOKEN_BUDGET`]).
pub fn predict(
    e: &EndpointStats,
    inflight: &super::InFlight,
    matched_blocks: u32,
    req: &PickRequest<'_>,
    rates: &PrefillRates,
    budget: u32,
) -> TtftPrediction {
    let uncached = uncached_prompt_tokens(req.prompt_tokens, matched_blocks, req.prefix_blocks);
    let expected_output = req.demand_tokens.saturating_sub(req.prompt_tokens);
    let free = match (
        e.kv_usage.filter(|u| u.is_finite()),
        e.kv_capacity_tokens.filter(|&c| c > 0),
    ) {
        (Some(u), Some(c)) => {
            Some((c as f64 * (1.0 - u.clamp(0.0, 1.0)) - inflight.tokens as f64).max(0.0))
        }
        _ => None,
    };
    let need = uncached.saturating_add(expected_output) as f64;
    let shortfall = free.map_or(0.0, |f| (need - f).max(0.0));
    let b = f64::from(if budget == 0 {
        DEFAULT_STEP_TOKEN_BUDGET
    } else {
        budget
    });
    let d = f64::from(e.running) + f64::from(inflight.requests);
    let interference = (b / (b - d).max(b / MAX_INTERFERENCE)).clamp(1.0, MAX_INTERFERENCE);
    let work = inflight.prefill_tokens.saturating_add(uncached) as f64 + shortfall;
    let effective = work * interference;
    let rate = rates.tokens_per_s(&e.id);
    TtftPrediction {
        pending_prefill_tokens: inflight.prefill_tokens,
        uncached_tokens: uncached,
        kv_shortfall_tokens: shortfall as u64,
        interference,
        tokens_per_s: rate,
        effective_tokens: effective,
        seconds: effective / rate,
    }
}

/// Rank `cands` by ascending predicted TTFT, then outstanding requests.
pub(super) fn rank(
    cands: &mut [Candidate],
    endpoints: &[EndpointStats],
    req: &PickRequest<'_>,
    rates: &PrefillRates,
    budget: u32,
) {
    for c in cands.iter_mut() {
        c.cost = endpoints.get(c.index).map_or(f64::INFINITY, |e| {
            predict(e, &c.inflight, c.prefix_blocks, req, rates, budget).seconds
        });
        c.cost2 = c.load as f64;
    }
}
