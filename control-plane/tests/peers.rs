//! Load sharing between gateways through kvroute-cp's run loop, against fake model servers,
//! fake ingests and a fake gateway stats endpoint: the other gateway gets the load with its
//! exact values, the reporting gateway never gets its own load back, and a stats endpoint
//! that answers garbage or goes away is counted, keeps its last reading until the staleness
//! bound, then contributes nothing, while pushes go on.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use kvroute_cp::{Config, ControlPlane};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(10);

/// `peer_inflight_requests`, `peer_inflight_tokens` of `p/e0` in the last snapshot `ingest`
/// received.
fn peer(ingest: &FakeIngest) -> Option<(u32, u64)> {
    let s = ingest.last()?.snapshot;
    let e = s.endpoints.iter().find(|e| e.id == "p/e0")?;
    Some((e.peer_inflight_requests, e.peer_inflight_tokens))
}

fn stats_errors(cp: &ControlPlane, reason: &str) -> u64 {
    cp.hub()
        .telemetry
        .encode()
        .lines()
        .filter(|l| {
            l.starts_with("kvroute_cp_gateway_stats_errors_total")
                && l.contains("target=\"gw-a\"")
                && l.contains(&format!("reason=\"{reason}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn gauges(requests: u32, tokens: u64) -> Behavior {
    Behavior::Body(format!(
        "# TYPE envoy_server_live gauge\nenvoy_server_live{{}} 1\n\
         # TYPE kvroute_inflight_unseen_requests_p_e0 gauge\nkvroute_inflight_unseen_requests_p_e0{{}} {requests}\n\
         # TYPE kvroute_inflight_unseen_tokens_p_e0 gauge\nkvroute_inflight_unseen_tokens_p_e0{{}} {tokens}\n"
    ))
}

#[tokio::test]
async fn other_gateway_gets_the_load_and_bad_stats_age_out() {
    let model = FakeModelServer::start(Behavior::Body(vllm_body(0.1, 0, 0, None, 10.0))).await;
    let stats = FakeModelServer::start(gauges(3, 300)).await;
    let (a, b) = (FakeIngest::start().await, FakeIngest::start().await);
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 5000\n  jitter: 0\n\
         push:\n  heartbeat_ms: 100\n  min_interval_ms: 5\n  peer_load: {{interval_ms: 20, timeout_ms: 200, stale_after_ms: 500}}\n\
         targets:\n  - name: gw-a\n    url: {}\n    stats_url: http://{}/stats/prometheus\n  - name: gw-b\n    url: {}\n\
         pools:\n  - name: p\n    kind: vllm\n    models: [m]\n    endpoints:\n      - {{name: e0, address: '127.0.0.1:9', metrics_url: 'http://{}/metrics'}}\n",
        a.url(),
        stats.addr(),
        b.url(),
        model.addr()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();

    // gw-b gets gw-a's load exactly; gw-a never gets its own back.
    wait_for(WAIT, "gw-b gets gw-a's load", || peer(&b) == Some((3, 300))).await;
    assert!(a.count() > 0);
    assert!(a.received.lock().unwrap().iter().all(|r| r
        .snapshot
        .endpoints
        .iter()
        .all(|e| e.peer_inflight_requests == 0)));

    // The load changes: a new version carries it.
    stats.set(gauges(5, 512));
    wait_for(WAIT, "gw-b follows the change", || {
        peer(&b) == Some((5, 512))
    })
    .await;

    // Garbage: counted, the last reading stays until 500 ms after it was taken, then nothing.
    stats.set(Behavior::Body(
        "<html><body>upstream error</body></html>\n".into(),
    ));
    wait_for(WAIT, "the bad body is counted", || {
        stats_errors(&cp, "parse") > 0
    })
    .await;
    let counted = Instant::now();
    wait_for(WAIT, "the stale reading drops", || peer(&b) == Some((0, 0))).await;
    assert!(
        counted.elapsed() <= Duration::from_millis(500 + 100 + 200),
        "dropped {:?} after the first bad read (bound 500 ms + one heartbeat)",
        counted.elapsed()
    );

    // Back, then gone for good (connection refused): counted as `connect`, ages out.
    stats.set(gauges(2, 64));
    wait_for(WAIT, "gw-b gets the load again", || {
        peer(&b) == Some((2, 64))
    })
    .await;
    stats.server.stop();
    wait_for(WAIT, "refused reads are counted", || {
        stats_errors(&cp, "connect") > 0
    })
    .await;
    wait_for(WAIT, "an unreachable gateway contributes nothing", || {
        peer(&b) == Some((0, 0))
    })
    .await;
    // Pushes to both gateways go on.
    let (na, nb) = (a.count(), b.count());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(a.count() > na && b.count() > nb);
    cp.shutdown().await;
}
