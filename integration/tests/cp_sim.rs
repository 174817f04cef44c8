//! kvroute-cp against kvroute-sim: every simulator dialect is detected and read, and a
//! change in one replica's load shows in the snapshot the control plane pushes.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_core::snapshot::Snapshot;
use kvroute_cp::adapters::ServerKind;
use kvroute_cp::{Config, ControlPlane};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetHandle, ReplicaConfig};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn fleet(dialect: Dialect, n: usize, time_scale: f64) -> (FleetHandle, ReplicaConfig) {
    let cfg = ReplicaConfig::builtin(MODEL, dialect, time_scale, 7).unwrap();
    (
        spawn_fleet(FleetConfig::local(cfg.clone(), n))
            .await
            .unwrap(),
        cfg,
    )
}

fn yaml(endpoints: &[(&str, SocketAddr)], ingest: &str) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 50\n  timeout_ms: 500\npush:\n  heartbeat_ms: 200\ntargets:\n  - name: envoy\n    url: {ingest}\npools:\n  - name: sim\n    models: [{MODEL}]\n    endpoints:\n"
    );
    for (n, a) in endpoints {
        y.push_str(&format!("      - name: {n}\n        address: {a}\n"));
    }
    y
}

/// A fake ingest that keeps the last snapshot it accepted.
async fn ingest() -> (String, Arc<Mutex<Option<Snapshot>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/kvroute/v1/snapshot", l.local_addr().unwrap());
    let last: Arc<Mutex<Option<Snapshot>>> = Arc::new(Mutex::new(None));
    let keep = last.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let keep = keep.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let keep = keep.clone();
                        async move {
                            let b = req.into_body().collect().await.unwrap().to_bytes();
                            *keep.lock().unwrap() = Some(Snapshot::decode(&b).unwrap());
                            let mut r = http::Response::new(Full::new(Bytes::new()));
                            *r.status_mut() = http::StatusCode::NO_CONTENT;
                            Ok::<_, std::convert::Infallible>(r)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (url, last)
}

async fn wait_for<F: FnMut() -> bool>(what: &str, mut cond: F) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_sim_dialect_is_detected_and_read() {
    let (v1, cfg) = fleet(Dialect::VllmV1, 1, f64::INFINITY).await;
    let (v0, _) = fleet(Dialect::VllmV0, 1, f64::INFINITY).await;
    let (sg, _) = fleet(Dialect::Sglang, 1, f64::INFINITY).await;
    let (lc, _) = fleet(Dialect::Llamacpp, 1, f64::INFINITY).await;
    let (url, last) = ingest().await;
    let eps = [
        ("v1", v1.addrs()[0]),
        ("v0", v0.addrs()[0]),
        ("sg", sg.addrs()[0]),
        ("lc", lc.addrs()[0]),
    ];
    let cp = ControlPlane::start(Config::from_yaml(&yaml(&eps, &url)).unwrap())
        .await
        .unwrap();
    wait_for("all healthy and pushed", || {
        last.lock()
            .unwrap()
            .as_ref()
            .is_some_and(|s| s.endpoints.len() == 4 && s.endpoints.iter().all(|e| e.healthy))
    })
    .await;
    let kind = |id: &str| cp.hub().endpoint(id).unwrap().stats.unwrap().kind;
    assert_eq!(kind("sim/v1"), ServerKind::Vllm);
    assert_eq!(kind("sim/v0"), ServerKind::Vllm);
    assert_eq!(kind("sim/sg"), ServerKind::Sglang);
    assert_eq!(kind("sim/lc"), ServerKind::Llamacpp);
    let snap = last.lock().unwrap().clone().unwrap();
    let blocks = u64::from(cfg.engine.num_gpu_blocks) * u64::from(cfg.engine.block_size);
    for e in &snap.endpoints {
        // Idle replicas: KV known and empty (never "unknown" for these dialects).
        assert_eq!(
            (e.kv_usage, e.running, e.waiting),
            (Some(0.0), 0, 0),
            "{}",
            e.id
        );
        assert_eq!(e.models, vec![MODEL.to_string()]);
    }
    let by_id = |id: &str| snap.endpoints.iter().find(|e| e.id == id).unwrap().clone();
    assert_eq!(by_id("sim/v1").kv_capacity_tokens, Some(blocks));
    assert_eq!(by_id("sim/v1").block_size, Some(cfg.engine.block_size));
    assert_eq!(by_id("sim/v0").kv_capacity_tokens, Some(blocks));
    assert_eq!(
        by_id("sim/lc").kv_capacity_tokens,
        Some(u64::from(cfg.engine.max_num_seqs) * u64::from(cfg.model.max_model_len))
    );
    cp.shutdown().await;
}

async fn post_completion(addr: SocketAddr, prompt_tokens: u32, output_tokens: u32) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let body = serde_json::json!({
        "model": MODEL, "prompt": "hello",
        "kvroute_sim": {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    });
    let req = http::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let _ = send.send_request(req).await;
}

#[tokio::test]
async fn load_on_one_replica_shows_in_the_pushed_snapshot() {
    let (f, _) = fleet(Dialect::VllmV1, 2, 1.0).await;
    let (url, last) = ingest().await;
    let eps = [("r0", f.addrs()[0]), ("r1", f.addrs()[1])];
    let cp = ControlPlane::start(Config::from_yaml(&yaml(&eps, &url)).unwrap())
        .await
        .unwrap();
    wait_for("idle snapshot", || {
        last.lock()
            .unwrap()
            .as_ref()
            .is_some_and(|s| s.endpoints.iter().all(|e| e.healthy && e.running == 0))
    })
    .await;
    // Long requests on r0 only (real time: they stay running for the rest of the test).
    let addr = f.addrs()[0];
    let load: Vec<_> = (0..3)
        .map(|_| tokio::spawn(post_completion(addr, 6000, 60_000)))
        .collect();
    wait_for("r0 loaded in the pushed snapshot", || {
        last.lock().unwrap().as_ref().is_some_and(|s| {
            let r0 = s.endpoints.iter().find(|e| e.id == "sim/r0").unwrap();
            r0.running == 3 && r0.kv_usage.is_some_and(|u| u > 0.0)
        })
    })
    .await;
    let snap = last.lock().unwrap().clone().unwrap();
    let r1 = snap.endpoints.iter().find(|e| e.id == "sim/r1").unwrap();
    assert_eq!((r1.running, r1.waiting, r1.kv_usage), (0, 0, Some(0.0)));
    for t in load {
        t.abort();
    }
    cp.shutdown().await;
    f.shutdown();
}
