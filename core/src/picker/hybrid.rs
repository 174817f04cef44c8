//! `hybrid` (the default): a weighted score of KV headroom, queue depth, in-flight tokens,
//! predicted prefill work and prefix overlap.
//!
//! For each eligible endpoint *e*, with every term in 0..1 and higher meaning better:
//!
//! ```text
//! score(e) = w_kv      · headroom(e)
//!          + w_queue   · (1 − norm(waiting(e)))
//!          + w_infl    · (1 − norm(inflight_tokens(e)))
//!          + w_prefill · (1 − work(e) / max_e' work(e'))
//!          + w_prefix  · matched_blocks(e) / request_blocks
//!
//! work(e)     = pending_prefill(e) + uncached(e)                       (tokens)
//! uncached(e) = prompt_tokens × (request_blocks − matched_blocks(e)) / request_blocks
//! ```
//!
//! * `headroom(e)` = fraction of KV capacity left after the router's in-flight tokens and this
//!   request's demand, clamped to 0..1 (`1 − usage` when capacity is unknown). Endpoints
//!   with unknown KV usage get the mean headroom of the others (0.5 if none is known), so
//!   only the other terms separate them.
//! * `norm(x)` is min-max normalisation over the eligible endpoints (0 when all are equal),
//!   as in GIE's queue scorer (`queue-scorer`). `inflight_tokens(e)` is the KV demand the
//!   router reserved there since its last scrape.
//! * `work(e)` is the prefill this endpoint must do before this request's first token, in
//!   tokens: the router-tracked pending prefill of its requests without a first token yet
//!   ([`super::InFlight::prefill_tokens`], counted whatever the scrape age) plus this
//!   request's prompt tokens not expected in its prefix cache
//!   ([`super::uncached_prompt_tokens`]). It is divided by the largest `work` among the
//!   eligible endpoints (the term is 1 for all when every `work` is 0), not min-max
//!   normalised, so magnitudes matter: an endpoint with one queued 80k-token prompt scores
//!   far below one with a queued 1k-token prompt, which the queue term (a request count)
//!   rates equal. Prefill time grows at least linearly in tokens, so tokens stand for time.
//!   This is the prefill half of NVIDIA Dynamo's KV-router cost (`prefill_blocks +
//!   decode_blocks` from the router's own active-sequence tracking:
//!   <https://docs.nvidia.com/dynamo/design-docs/router-design>, `ActiveSequences` in
//!   `lib/llm/src/kv_router/sequence.rs`); the decode half is covered
//!   here by the KV headroom, queue and in-flight terms.
//! * the prefix term is GIE's prefix-cache scorer (matched / total blocks).
//!
//! Default weights ([`super::HybridWeights`]): KV 1, queue 1, in-flight 1, prefill work 2,
//! prefix 2. The prefix term outweighs each snapshot load term, as in
//! llm-d-inference-scheduler's default `EndpointPickerConfig` (queue-scorer 2,
//! kv-cache-utilization-scorer 2, prefix-cache-scorer 3), because a prefix hit saves prefill
//! compute, which dominates TTFT for long shared prompts (a hit also lowers `work(e)`). The
//! prefill-work term weighs as much as the prefix term so that a prefix holder with a long
//! prefill queue loses to an idle endpoint once its queued work is large next to the
//! request's own. Measured with `kvroute-bench` (Mooncake and Azure conv, 4/8/16 replicas,
//! 70–110 % load, see `docs/bench.md`): adding this term at weight 2 cut hybrid's TTFT p99 on
//! Mooncake by 13–30 % with Azure within ±5 %; weight 1 gained less on Mooncake (4–19 %),
//! and replacing the in-flight term with it lost up to 13 % on Azure. The endpoint with the
//! highest score wins; equal scores fall to fewer outstanding requests, then break at
//! random.

use super::{uncached_prompt_tokens, Candidate, HybridWeights, PickRequest};

/// Headroom assumed when no eligible endpoint reports KV usage.
pub const NEUTRAL_HEADROOM: f64 = 0.5;

/// Predicted prefill work of `c` for `req`, tokens (see the module doc).
fn work(c: &Candidate, req: &PickRequest<'_>) -> u64 {
    c.inflight
        .prefill_tokens
        .saturating_add(uncached_prompt_tokens(
            req.prompt_tokens,
            c.prefix_blocks,
            req.prefix_blocks,
        ))
}

/// Rank `cands` by descending hybrid score.
pub(super) fn rank(cands: &mut [Candidate], w: &HybridWeights, req: &PickRequest<'_>) {
    let (mut qmin, mut qmax) = (u32::MAX, 0u32);
    let (mut imin, mut imax) = (u64::MAX, 0u64);
    let mut wmax = 0u64;
    let (mut hsum, mut hn) = (0.0f64, 0u32);
    for c in cands.iter() {
        qmin = qmin.min(c.waiting);
        qmax = qmax.max(c.waiting);
        imin = imin.min(c.inflight.tokens);
        imax = imax.max(c.inflight.tokens);
        wmax = wmax.max(work(c, req));
        if let Some(h) = c.headroom_after {
            hsum += h.clamp(0.0, 1.0);
            hn += 1;
        }
    }
    let hmean = if hn > 0 {
        hsum / f64::from(hn)
    } else {
        NEUTRAL_HEADROOM
    };
    let qspan = f64::from(qmax.saturating_sub(qmin));
    let ispan = imax.saturating_sub(imin) as f64;
    let wspan = wmax as f64;
    let blocks = f64::from(req.prefix_blocks);
    for c in cands.iter_mut() {
        let headroom = c.headroom_after.map_or(hmean, |h| h.clamp(0.0, 1.0));
        let q = if qspan > 0.0 {
            f64::from(c.waiting.saturating_sub(qmin)) / qspan
        } else {
            0.0
        };
        let i = if ispan > 0.0 {
            c.inflight.tokens.saturating_sub(imin) as f64 / ispan
        } else {
            0.0
        };
        let f = if wspan > 0.0 {
            work(c, req) as f64 / wspan
        } else {
            0.0
        };
        let p = if blocks > 0.0 {
            (f64::from(c.prefix_blocks) / blocks).min(1.0)
        } else {
            0.0
        };
        let terms = [
            w.kv_headroom * headroom,
            w.queue * (1.0 - q),
            w.inflight * (1.0 - i),
            w.prefill * (1.0 - f),
            w.prefix * p,
        ];
        let score = terms.iter().sum::<f64>();
        c.cost = -score;
        c.terms = Some(terms);
        c.cost2 = c.load as f64;
    }
}
