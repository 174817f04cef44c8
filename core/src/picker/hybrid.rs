//! `hybrid` (the default): a weighted score of KV headroom, queue depth, in-flight tokens and
//! prefix overlap.
//!
//! For each eligible endpoint *e*, with every term in 0..1 and higher meaning better:
//!
//! ```text
//! score(e) = w_kv     · headroom(e)
//!          + w_queue  · (1 − norm(waiting(e)))
//!          + w_infl   · (1 − norm(inflight_tokens(e)))
//!          + w_prefix · matched_blocks(e) / request_blocks
//! ```
//!
//! * `headroom(e)` = fraction of KV capacity left after the router's in-flight tokens and this
//!   request's demand, clamped to 0..1 (`1 − usage` when capacity is unknown). Endpoints
//!   with unknown KV usage get the mean headroom of the others (0.5 if none is known), so
//!   only queue, in-flight and prefix terms separate them.
//! * `norm(x)` is min-max normalisation over the eligible endpoints (0 when all are equal),
//!   as in GIE's queue scorer (`queue-scorer`).
//! * the prefix term is GIE's prefix-cache scorer (matched / total blocks).
//!
//! Default weights ([`super::HybridWeights`]): KV 1, queue 1, in-flight 1, prefix 2. The
//! prefix term outweighs each load term, as in llm-d-inference-scheduler's default
//! `EndpointPickerConfig` (queue-scorer 2, kv-cache-utilization-scorer 2,
//! prefix-cache-scorer 3), because a prefix hit saves prefill compute, which dominates TTFT
//! for long shared prompts; the three load terms together (weight 3) still move traffic away
//! once a prefix holder queues up or fills its KV cache. The endpoint with the highest score
//! wins; equal scores fall to fewer outstanding requests, then break at random.

use super::{Candidate, HybridWeights, PickRequest};

/// Headroom assumed when no eligible endpoint reports KV usage.
pub const NEUTRAL_HEADROOM: f64 = 0.5;

/// Rank `cands` by descending hybrid score.
pub(super) fn rank(cands: &mut [Candidate], w: &HybridWeights, req: &PickRequest<'_>) {
    let (mut qmin, mut qmax) = (u32::MAX, 0u32);
    let (mut imin, mut imax) = (u64::MAX, 0u64);
    let (mut hsum, mut hn) = (0.0f64, 0u32);
    for c in cands.iter() {
        qmin = qmin.min(c.waiting);
        qmax = qmax.max(c.waiting);
        imin = imin.min(c.inflight.tokens);
        imax = imax.max(c.inflight.tokens);
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
        let p = if blocks > 0.0 {
            (f64::from(c.prefix_blocks) / blocks).min(1.0)
        } else {
            0.0
        };
        let score =
            w.kv_headroom * headroom + w.queue * (1.0 - q) + w.inflight * (1.0 - i) + w.prefix * p;
        c.cost = -score;
        c.cost2 = c.load as f64;
    }
}
