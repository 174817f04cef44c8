//! `least_kv`: lowest KV cache usage after in-flight reservations.
//!
//! Algorithm: cost = `kv_usage + in-flight tokens / kv_capacity_tokens` (the usage the
//! endpoint will reach once the requests already routed there are admitted; `kv_usage` alone
//! when capacity is unknown). Endpoints with unknown KV usage rank after every endpoint with
//! a known one (cost 2.0). Secondary key: outstanding requests; then a random tie-break.
//! Mirrors GIE's KV-cache utilization scorer (`kv-cache-utilization-scorer`, score
//! `1 − KVCacheUsagePercent`), with router-local reservations added.

use super::Candidate;

/// Cost given to endpoints with unknown KV usage (after any known usage, which is ≤ ~1).
pub const UNKNOWN_KV_COST: f64 = 2.0;

/// Rank `cands` by projected KV usage, then load.
pub(super) fn rank(cands: &mut [Candidate]) {
    for c in cands.iter_mut() {
        c.cost = c.projected_usage.unwrap_or(UNKNOWN_KV_COST);
        c.cost2 = c.load as f64;
    }
}
