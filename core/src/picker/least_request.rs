//! `least_request`: fewest outstanding requests.
//!
//! Algorithm: cost = `running + waiting` from the snapshot plus the router's own in-flight
//! requests (sent, not yet finished), so bursts between two snapshots spread out instead of
//! piling onto the endpoint that looked idle at the last scrape. Ties break at random. This
//! is the signal Envoy's `LEAST_REQUEST` balancer and SGLang's router `round_robin`
//! fallback use; it needs no KV metrics, so it works for TGI and llama.cpp too.

use super::Candidate;

/// Rank `cands` by outstanding requests.
pub(super) fn rank(cands: &mut [Candidate]) {
    for c in cands.iter_mut() {
        c.cost = c.load as f64;
        c.cost2 = 0.0;
    }
}
