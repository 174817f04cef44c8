//! `random`: a uniformly random eligible endpoint.
//!
//! Algorithm: every eligible endpoint gets the same cost, so the ranking is decided by the
//! per-candidate random tie-break alone (`fastrand::Rng::u64`, seeded by the caller). The
//! primary is uniform over the eligible endpoints and the fallbacks are a uniform random
//! ordering of the rest. Ignores load, KV and prefix state; useful as a baseline and for
//! "power of two choices" style comparisons in the benchmark.

use super::Candidate;

/// Rank `cands` at random (all costs equal; the tie-break decides).
pub(super) fn rank(cands: &mut [Candidate]) {
    for c in cands.iter_mut() {
        c.cost = 0.0;
        c.cost2 = 0.0;
    }
}
