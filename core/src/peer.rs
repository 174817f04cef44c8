//! Load sharing between gateway replicas: the other gateways' in-flight requests, merged into
//! the snapshot each gateway receives.
//!
//! Each gateway's filter reserves the KV demand of every request it routes
//! ([`crate::inflight`]), so one Envoy never herds its own requests onto the endpoint that
//! looked best in the last scrape. Two replicas behind one Service do not see each other's
//! reservations: between two scrapes both send to the same endpoint. The Gateway API
//! Inference Extension avoids this by running one endpoint-picker replica; kvroute shares the
//! load instead:
//!
//! 1. Every filter exports, per endpoint, its *unseen* in-flight load as Envoy gauges on its
//!    worker tick: requests and reserved KV tokens routed since that endpoint's
//!    `scraped_at_ms` in the snapshot it holds ([`crate::inflight::InflightTable::unseen_totals`],
//!    the same rule the picker applies to its own reservations, so a request already in the
//!    model server's `running`/`waiting` counts is not charged twice).
//! 2. The control plane reads each gateway's gauges ([`GatewayReport`]) and, for gateway G,
//!    adds up the reports of every *other* gateway ([`peer_load_for`]). A report is left out
//!    when it is older than the staleness bound (a gateway that stopped answering contributes
//!    nothing after it), and for an endpoint scraped after the report was read: that scrape
//!    already counts the requests the report describes.
//! 3. The sums travel in the snapshot pushed to G as
//!    [`EndpointStats::peer_inflight_requests`] and [`EndpointStats::peer_inflight_tokens`]
//!    ([`write_peer_fields`] splices them into an endpoint's cached wire fragment).
//! 4. G's router adds them to its own unseen in-flight load ([`add_peer_load`]), so every
//!    policy (least request, KV headroom, hybrid, predicted TTFT) counts a peer's request
//!    exactly like one of its own.
//!
//! Delay: a peer's request is seen after that peer's tick, the control plane's next read of
//! its stats and the next push (about `tick + interval + push`, a few hundred ms with the
//! defaults), which is what makes a burst spread over the fleet instead of landing on one
//! endpoint per gateway.

use crate::inflight::InFlight;
use crate::snapshot::{EndpointStats, Snapshot};
use std::collections::BTreeMap;

/// The label that names the endpoint in the native build's labelled per-endpoint gauges
/// (`kvroute-dynmod` defines one gauge per prefix with it, at config time, before any
/// endpoint is known; the control plane reads it back): its value is the filter's stat id of
/// the endpoint (`filter/src/names.rs`, `stat_id`).
pub const ENDPOINT_LABEL: &str = "endpoint";

/// One endpoint's in-flight load as one gateway reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerLoad {
    /// Requests routed there and not finished, not yet in the endpoint's scrape.
    pub requests: u32,
    /// Their reserved KV demand, tokens.
    pub tokens: u64,
}

impl PeerLoad {
    /// True when nothing is in flight.
    pub fn is_zero(&self) -> bool {
        self.requests == 0 && self.tokens == 0
    }

    fn add(&mut self, other: &PeerLoad) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens = self.tokens.saturating_add(other.tokens);
    }
}

/// What one gateway reported, as read by the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GatewayReport {
    /// When the control plane read it, Unix milliseconds.
    pub read_at_ms: u64,
    /// Load by endpoint id (endpoints without load may be absent).
    pub load: BTreeMap<String, PeerLoad>,
}

/// The load gateway `target` must add: the sum over every *other* gateway's report that is
/// younger than `stale_after_ms` at `now_ms`, per endpoint, leaving out an endpoint whose
/// `scraped_at_ms(endpoint)` is after the report was read (that scrape already counts those
/// requests; `None`, an endpoint not in the fleet, also leaves it out). Endpoints whose sum
/// is zero are absent. Sums saturate.
pub fn peer_load_for<F>(
    reports: &BTreeMap<String, GatewayReport>,
    target: &str,
    now_ms: u64,
    stale_after_ms: u64,
    scraped_at_ms: F,
) -> BTreeMap<String, PeerLoad>
where
    F: Fn(&str) -> Option<u64>,
{
    let mut out: BTreeMap<String, PeerLoad> = BTreeMap::new();
    for (gateway, report) in reports {
        if gateway == target || now_ms.saturating_sub(report.read_at_ms) > stale_after_ms {
            continue;
        }
        for (endpoint, load) in &report.load {
            if load.is_zero() {
                continue;
            }
            match scraped_at_ms(endpoint) {
                Some(scraped) if scraped <= report.read_at_ms => {}
                _ => continue,
            }
            out.entry(endpoint.clone()).or_default().add(load);
        }
    }
    out
}

/// Add each endpoint's peer load from `snap` into `out` (indexed like `snap.endpoints`): the
/// router's in-flight input then counts the other gateways' requests like its own.
pub fn add_peer_load(snap: &Snapshot, out: &mut [InFlight]) {
    for (e, o) in snap.endpoints.iter().zip(out.iter_mut()) {
        o.requests = o.requests.saturating_add(e.peer_inflight_requests);
        o.tokens = o.tokens.saturating_add(e.peer_inflight_tokens);
    }
}

/// Write endpoint wire `fragment` (from [`crate::snapshot::encode_endpoint`] of an endpoint
/// without peer load) to `out` with `load` as its peer fields: the same bytes
/// `encode_endpoint` writes for that endpoint with the fields set (zero fields are left off,
/// as serde does). A fragment that does not end in `}` is copied unchanged.
pub fn write_peer_fields(fragment: &[u8], load: PeerLoad, out: &mut Vec<u8>) {
    use std::io::Write as _;
    let Some((b'}', head)) = fragment.split_last() else {
        out.extend_from_slice(fragment);
        return;
    };
    out.extend_from_slice(head);
    // Writing into a Vec cannot fail.
    if load.requests != 0 {
        let _ = write!(out, ",\"peer_inflight_requests\":{}", load.requests);
    }
    if load.tokens != 0 {
        let _ = write!(out, ",\"peer_inflight_tokens\":{}", load.tokens);
    }
    out.push(b'}');
}

/// Set `e`'s peer fields to `load` (tests and callers holding decoded snapshots).
pub fn set_peer_load(e: &mut EndpointStats, load: PeerLoad) {
    e.peer_inflight_requests = load.requests;
    e.peer_inflight_tokens = load.tokens;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::encode_endpoint;

    fn load(requests: u32, tokens: u64) -> PeerLoad {
        PeerLoad { requests, tokens }
    }

    fn report(read_at_ms: u64, loads: &[(&str, u32, u64)]) -> GatewayReport {
        GatewayReport {
            read_at_ms,
            load: loads
                .iter()
                .map(|(e, r, t)| ((*e).to_owned(), load(*r, *t)))
                .collect(),
        }
    }

    #[test]
    fn sums_other_gateways_only() {
        let mut reports = BTreeMap::new();
        reports.insert("gw-a".to_owned(), report(1_000, &[("p/e0", 2, 300)]));
        reports.insert(
            "gw-b".to_owned(),
            report(1_000, &[("p/e0", 1, 100), ("p/e1", 4, 40)]),
        );
        reports.insert("gw-c".to_owned(), report(1_000, &[("p/e1", 1, 5)]));
        let scraped = |_: &str| Some(900);
        let a = peer_load_for(&reports, "gw-a", 1_100, 2_000, scraped);
        assert_eq!(
            a.into_iter().collect::<Vec<_>>(),
            vec![("p/e0".into(), load(1, 100)), ("p/e1".into(), load(5, 45))]
        );
        let b = peer_load_for(&reports, "gw-b", 1_100, 2_000, scraped);
        assert_eq!(
            b.into_iter().collect::<Vec<_>>(),
            vec![("p/e0".into(), load(2, 300)), ("p/e1".into(), load(1, 5))]
        );
        // A gateway that reports nothing itself still gets everyone's load.
        let d = peer_load_for(&reports, "gw-d", 1_100, 2_000, scraped);
        assert_eq!(d["p/e0"], load(3, 400));
        assert_eq!(d["p/e1"], load(5, 45));
    }

    #[test]
    fn stale_reports_and_rescraped_endpoints_are_left_out() {
        let mut reports = BTreeMap::new();
        reports.insert("gw-a".to_owned(), report(1_000, &[("p/e0", 1, 10)]));
        reports.insert(
            "gw-b".to_owned(),
            report(3_000, &[("p/e0", 2, 20), ("p/e1", 3, 30), ("p/gone", 1, 1)]),
        );
        // gw-a read 2,001 ms before now: beyond the 2,000 ms bound.
        let scraped = |e: &str| match e {
            "p/e0" => Some(2_500),
            // Scraped after gw-b's report was read: its requests are in that scrape.
            "p/e1" => Some(3_001),
            _ => None,
        };
        let c = peer_load_for(&reports, "gw-c", 3_001, 2_000, scraped);
        assert_eq!(
            c.into_iter().collect::<Vec<_>>(),
            vec![("p/e0".into(), load(2, 20))]
        );
        // At exactly the bound the report still counts.
        let c = peer_load_for(&reports, "gw-c", 3_000, 2_000, |_| Some(0));
        assert_eq!(c["p/e0"], load(3, 30));
    }

    #[test]
    fn zero_loads_are_absent_and_sums_saturate() {
        let mut reports = BTreeMap::new();
        reports.insert(
            "a".to_owned(),
            report(5, &[("e", 0, 0), ("f", u32::MAX, 1)]),
        );
        reports.insert("b".to_owned(), report(5, &[("f", 7, u64::MAX)]));
        let c = peer_load_for(&reports, "c", 5, 0, |_| Some(5));
        assert_eq!(
            c.into_iter().collect::<Vec<_>>(),
            vec![("f".into(), load(u32::MAX, u64::MAX))]
        );
    }

    proptest::proptest! {
        /// For fresh reports of endpoints scraped before them, what gateway G adds plus G's
        /// own report is the same fleet-wide total for every G: each request is counted
        /// exactly once from every gateway's point of view.
        #[test]
        fn own_plus_peers_is_the_fleet_total(
            raw in proptest::collection::vec(
                proptest::collection::vec((0usize..4, 0u32..50, 0u64..10_000), 0..6),
                1..5,
            )
        ) {
            let reports: BTreeMap<String, GatewayReport> = raw
                .iter()
                .enumerate()
                .map(|(g, loads)| {
                    let mut load: BTreeMap<String, PeerLoad> = BTreeMap::new();
                    for (e, r, t) in loads {
                        load.entry(format!("p/e{e}")).or_default().add(&PeerLoad { requests: *r, tokens: *t });
                    }
                    (format!("gw-{g}"), GatewayReport { read_at_ms: 100, load })
                })
                .collect();
            let mut total: BTreeMap<String, PeerLoad> = BTreeMap::new();
            for r in reports.values() {
                for (e, l) in &r.load {
                    total.entry(e.clone()).or_default().add(l);
                }
            }
            total.retain(|_, l| !l.is_zero());
            for (g, own) in &reports {
                let mut seen = peer_load_for(&reports, g, 100, 1_000, |_| Some(50));
                for (e, l) in &own.load {
                    seen.entry(e.clone()).or_default().add(l);
                }
                seen.retain(|_, l| !l.is_zero());
                proptest::prop_assert_eq!(&seen, &total);
            }
        }
    }

    #[test]
    fn spliced_fragment_equals_encoded_endpoint() {
        for l in [load(0, 0), load(3, 0), load(0, 9), load(2, 4_096)] {
            let plain = EndpointStats::fixture(1, 77);
            let mut frag = Vec::new();
            encode_endpoint(&plain, &mut frag);
            let mut spliced = Vec::new();
            write_peer_fields(&frag, l, &mut spliced);
            let mut with = plain.clone();
            set_peer_load(&mut with, l);
            let mut expect = Vec::new();
            encode_endpoint(&with, &mut expect);
            assert_eq!(
                String::from_utf8(spliced).unwrap(),
                String::from_utf8(expect).unwrap()
            );
        }
        let mut out = Vec::new();
        write_peer_fields(b"", load(1, 1), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn peer_load_adds_to_router_inflight() {
        let mut snap = Snapshot::new(1, 0, vec![EndpointStats::fixture(0, 0)]);
        snap.endpoints.push(EndpointStats {
            peer_inflight_requests: 2,
            peer_inflight_tokens: 500,
            ..EndpointStats::fixture(1, 0)
        });
        let mut inflight = vec![
            InFlight {
                requests: 1,
                tokens: 10,
                prefill_tokens: 3,
            };
            2
        ];
        add_peer_load(&snap, &mut inflight);
        assert_eq!(inflight[0].requests, 1);
        assert_eq!(inflight[0].tokens, 10);
        assert_eq!(inflight[1].requests, 3);
        assert_eq!(inflight[1].tokens, 510);
        assert_eq!(inflight[1].prefill_tokens, 3);
    }

    #[test]
    fn snapshots_without_peer_fields_decode_and_encode_unchanged() {
        let snap = Snapshot::new(3, 4, vec![EndpointStats::fixture(0, 9)]);
        let bytes = snap.encode();
        assert!(!String::from_utf8_lossy(&bytes).contains("peer_"));
        let mut with = snap.clone();
        set_peer_load(&mut with.endpoints[0], load(1, 2));
        let back = Snapshot::decode(&with.encode()).unwrap();
        assert_eq!(back.endpoints[0].peer_inflight_requests, 1);
        assert_eq!(back.endpoints[0].peer_inflight_tokens, 2);
    }
}
