//! Every gateway replica gets stats: kvroute-cp discovers two gateway pods through a fake
//! Kubernetes API server (the one in `control-plane/tests/common/fake_kube.rs`) and pushes to
//! the ingest listener of each of two real Envoys running the filter (same port, two loopback
//! addresses, as two pods on one pod network). Both route on the scraped KV load and both
//! follow a change; a gateway pod deleted from the API stops receiving snapshots while the
//! other keeps getting them. Needs the built `.wasm` and the PyPI Envoy.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "../../control-plane/tests/common/fake_kube.rs"]
mod fake_kube;

use fake_kube::{pods_path, FakeKube};
use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::kvroute::{
    envoy_config, vllm_metrics_server, wait_routed, FleetMode, TEST_TOKEN,
};
use kvroute_integration::harness::{Envoy, RecordingBackend, Reply};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const INGESTED: &str = "wasmcustom.kvroute.ingest.accepted";

struct Gateway {
    envoy: Envoy,
    port: u16,
}

/// Envoy in cluster mode with clusters c0, c1 (one backend each), its ingest listener on
/// `ingest_ip:ingest_port`.
async fn gateway(backends: &[String], ingest_ip: &str, ingest_port: u16) -> Gateway {
    let (envoy, [port]) = Envoy::start_on_free_ports(2, |[port]| {
        let yaml = envoy_config(
            FleetMode::Cluster,
            backends,
            r#""picker":{"policy":"least_kv"}"#,
            port,
            ingest_port,
            4 << 20,
        )?;
        let from = format!("address: 127.0.0.1, port_value: {ingest_port}");
        anyhow::ensure!(
            yaml.contains(&from),
            "template binds the ingest listener as expected"
        );
        Ok(yaml.replace(
            &from,
            &format!("address: {ingest_ip}, port_value: {ingest_port}"),
        ))
    })
    .await
    .unwrap();
    Gateway { envoy, port }
}

fn gateway_pod(name: &str, ip: &str) -> serde_json::Value {
    let p = format!(
        "{}/../control-plane/tests/fixtures/k8s/pod-gateway.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["metadata"]["name"] = json!(name);
    v["metadata"]["uid"] = json!(format!("uid-{name}"));
    v["status"]["podIP"] = json!(ip);
    v["status"]["podIPs"] = json!([{ "ip": ip }]);
    v
}

/// A port free on both addresses.
fn common_port(a: &str, b: &str) -> u16 {
    for _ in 0..50 {
        let l = std::net::TcpListener::bind(format!("{a}:0")).unwrap();
        let p = l.local_addr().unwrap().port();
        if std::net::TcpListener::bind(format!("{b}:{p}")).is_ok() {
            return p;
        }
    }
    panic!("no common free port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_pods_both_fresh_and_a_deleted_one_dropped() {
    let b0 = RecordingBackend::start_on("127.0.0.1:0", "b0", Reply::default())
        .await
        .unwrap();
    let b1 = RecordingBackend::start_on("127.0.0.1:0", "b1", Reply::default())
        .await
        .unwrap();
    let addrs = vec![b0.address(), b1.address()];
    let ingest_port = common_port("127.0.0.1", "127.0.0.8");
    let g1 = gateway(&addrs, "127.0.0.1", ingest_port).await;
    let g2 = gateway(&addrs, "127.0.0.8", ingest_port).await;
    let (kv0, kv1) = (Arc::new(Mutex::new(0.8)), Arc::new(Mutex::new(0.1)));
    let (m0, m1) = (
        vllm_metrics_server(kv0.clone()).await.unwrap(),
        vllm_metrics_server(kv1.clone()).await.unwrap(),
    );

    let api = FakeKube::start().await;
    let pods = pods_path("istio-system");
    api.collection(&pods, "PodList", "v1");
    api.apply(&pods, gateway_pod("gw-1", "127.0.0.1"));
    api.apply(&pods, gateway_pod("gw-2", "127.0.0.8"));

    std::env::set_var("KVROUTE_CP_GATEWAYS_TEST_TOKEN", TEST_TOKEN);
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 50\n  timeout_ms: 300\n\
         push:\n  heartbeat_ms: 200\n  min_interval_ms: 5\n  token_env: KVROUTE_CP_GATEWAYS_TEST_TOKEN\n\
         pools:\n  - name: pool\n    kind: vllm\n    models: [m]\n    endpoints:\n\
         \x20     - {{name: e0, address: '{}', metrics_url: 'http://{m0}/metrics', cluster: c0}}\n\
         \x20     - {{name: e1, address: '{}', metrics_url: 'http://{m1}/metrics', cluster: c1}}\n\
         kubernetes:\n  api_server: {}\n  gateways:\n    - name: gw\n      namespace: istio-system\n      selector: {{istio: ingressgateway}}\n      port: {ingest_port}\n",
        addrs[0],
        addrs[1],
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();

    // Both gateways route to the less-loaded backend, then both follow the change.
    wait_routed(&g1.envoy, g1.port, "b1").await.unwrap();
    wait_routed(&g2.envoy, g2.port, "b1").await.unwrap();
    *kv0.lock().unwrap() = 0.05;
    *kv1.lock().unwrap() = 0.9;
    wait_routed(&g1.envoy, g1.port, "b0").await.unwrap();
    wait_routed(&g2.envoy, g2.port, "b0").await.unwrap();
    for g in [&g1, &g2] {
        assert!(g.envoy.stat(INGESTED).await.unwrap().unwrap_or(0) >= 2);
        assert!(g.envoy.wasm_failures().await.unwrap().is_empty());
    }

    // gw-2 leaves the API: no more snapshots reach it; gw-1 keeps getting heartbeats.
    api.delete(&pods, "gw-2");
    let deadline = Instant::now() + Duration::from_secs(10);
    while cp.targets().len() != 1 {
        assert!(
            Instant::now() < deadline,
            "gw-2 not dropped: {:?}",
            cp.targets()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (a1, a2) = (
        g1.envoy.stat(INGESTED).await.unwrap().unwrap_or(0),
        g2.envoy.stat(INGESTED).await.unwrap().unwrap_or(0),
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(g2.envoy.stat(INGESTED).await.unwrap().unwrap_or(0), a2);
    assert!(
        g1.envoy.stat(INGESTED).await.unwrap().unwrap_or(0) >= a1 + 3,
        "heartbeats every 200 ms"
    );
    cp.shutdown().await;
}
