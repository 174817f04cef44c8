//! `least_request`: the replica with the fewest router-local in-flight requests (sent and
//! not finished), lowest index on ties. Router-local counts are what Envoy's
//! `LEAST_REQUEST` lb policy uses (active requests per host; Envoy docs, "Load balancers →
//! Weighted least request": with equal weights it is power-of-two-choices over active
//! requests — here the full minimum, the deterministic limit of that rule). Needs no
//! snapshot, so it is immune to staleness.

use super::{argmin_by_key, EndpointView};

/// Stateless least-request policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastRequest;

impl LeastRequest {
    /// Index of the endpoint with the fewest in-flight requests; `None` when empty.
    pub fn pick(&self, views: &[EndpointView]) -> Option<usize> {
        argmin_by_key(views, |v| v.inflight)
    }
}

#[cfg(test)]
mod tests {
    use super::super::view;
    use super::*;

    #[test]
    fn fewest_inflight_lowest_index_on_ties() {
        let v = [view(0.0, 0, 3), view(0.9, 9, 1), view(0.0, 0, 1)];
        assert_eq!(LeastRequest.pick(&v), Some(1));
        assert_eq!(LeastRequest.pick(&[]), None);
    }
}
