//! `prefix_affinity`: longest prefix match, ties by load.
//!
//! Algorithm: cost = −(prefix blocks of this request already routed to the endpoint), taken
//! from the caller's [`crate::prefix::PrefixIndex`] (GIE's approximate prefix scorer keeps
//! the same per-server LRU of block hashes). Among endpoints with equal match, fewer
//! outstanding requests wins, then a random tie-break. With no match anywhere this is
//! `least_request`. It has no imbalance guard: a hot prefix can pin one endpoint until its KV
//! headroom filter rejects it; `hybrid` balances this trade-off with weights.

use super::Candidate;

/// Rank `cands` by matched prefix blocks (descending), then load.
pub(super) fn rank(cands: &mut [Candidate]) {
    for c in cands.iter_mut() {
        c.cost = -f64::from(c.prefix_blocks);
        c.cost2 = c.load as f64;
    }
}
