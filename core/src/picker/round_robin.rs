//! `round_robin`: rotate through the eligible endpoints.
//!
//! Algorithm: the picker keeps a cursor that advances by one per decision. Eligible
//! endpoints are ranked by their position in snapshot order, rotated so that the one at
//! `cursor mod len` comes first; the next ones are the fallbacks. With a stable eligible set
//! every endpoint is primary once every `len` decisions. No defaults; ignores load, KV and
//! prefix state (the baseline Envoy's `ROUND_ROBIN` load balancer provides).

use super::Candidate;

/// Rank `cands` (in snapshot order) by rotated position from `cursor`.
pub(super) fn rank(cands: &mut [Candidate], cursor: usize) {
    let len = cands.len().max(1);
    let start = cursor % len;
    for (pos, c) in cands.iter_mut().enumerate() {
        c.cost = ((pos + len - start) % len) as f64;
        c.cost2 = 0.0;
    }
}
