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

use bytes::Bytes;
use http_body_util::Full;
use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::kvroute::{chat, Fleet, FleetOptions, TEST_TOKEN};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A `/metrics` server answering a vLLM V1 body with the current KV usage.
async fn metrics_server(kv: Arc<Mutex<f64>>) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let kv = kv.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |_req: http::Request<hyper::body::Incoming>| {
                        let v = *kv.lock().unwrap();
                        let body = format!(
                        "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {v}\n\
                         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10000\"}} 1.0\n"
                    );
                        async move {
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from(body),
                            )))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

async fn routed_to(fleet: &Fleet) -> String {
    let r = fleet
        .post("/v1/chat/completions", &chat("route me by KV"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.header("x-backend").unwrap_or("").to_owned()
}

/// Wait (deadline 20 s) until 5 requests in a row go to `want`: every Envoy worker has
/// consumed a snapshot that makes `want` the least-KV backend.
async fn wait_routed(fleet: &Fleet, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut in_a_row = 0;
    while in_a_row < 5 {
        let got = routed_to(fleet).await;
        if got == want {
            in_a_row += 1;
            continue;
        }
        in_a_row = 0;
        assert!(
            Instant::now() < deadline,
            "still routed to {got}, want {want}\n{}",
            fleet.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

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
        metrics.push(metrics_server(kv.clone()).await);
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
    wait_routed(&fleet, "b2").await;
    // e2 fills up, e0 drains: the filter follows within a few scrapes.
    *kvs[2].lock().unwrap() = 0.95;
    *kvs[0].lock().unwrap() = 0.1;
    wait_routed(&fleet, "b0").await;
    assert!(fleet.custom("kvroute.snapshots.published").await.unwrap() >= 2);
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
    cp.shutdown().await;
}
