//! Long generations survive the shipped Envoy configuration.
//!
//! A streamed chat completion through `examples/envoy/endpoint-mode.yaml` itself (only its
//! ports, its backend addresses and the `.wasm` path rewritten) to kvroute-sim replicas
//! slowed so the generation takes [`STREAM_SECONDS`], longer than the 30 s route timeout
//! the examples shipped before (issue 14, item 5). Every token must arrive, in order, with
//! `usage` and `[DONE]`, and tokens must keep flowing the whole time (nothing buffered the
//! stream until the end).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_integration::harness::kvroute::{
    example_config, logged_decision, now_ms, push_to_example,
};
use kvroute_integration::harness::Envoy;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::perf::BatchShape;
use kvroute_sim::server::{spawn_fleet, FleetConfig, ReplicaConfig};
use std::time::{Duration, Instant};

/// Wall-clock length of the generation, seconds (the old route timeout was 30 s).
const STREAM_SECONDS: f64 = 36.0;
/// Tokens generated.
const OUTPUT_TOKENS: u32 = 120;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_old_route_timeout_completes() {
    // Two replicas slowed so that OUTPUT_TOKENS decode steps take STREAM_SECONDS of wall time.
    let mut replica = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, 1.0, 7).unwrap();
    let step = replica.engine.step.step_time(&BatchShape {
        decode_seqs: 1,
        decode_context_tokens: 200,
        ..BatchShape::default()
    });
    replica.time_scale = step * f64::from(OUTPUT_TOKENS) / STREAM_SECONDS;
    let sims = spawn_fleet(FleetConfig::local(replica, 2)).await.unwrap();
    let backends: Vec<String> = sims.addrs().iter().map(|a| a.to_string()).collect();

    let (envoy, [listen, ingest]) = Envoy::start_on_free_ports(1, |[listen, ingest]| {
        example_config("endpoint-mode.yaml", listen, ingest, &backends)
    })
    .await
    .unwrap();
    let now = now_ms();
    let eps = backends
        .iter()
        .enumerate()
        .map(|(i, a)| EndpointStats {
            id: format!("pool/sim-{i}"),
            address: a.clone(),
            cluster: "pool".into(),
            models: vec![MODEL.into()],
            ..EndpointStats::fixture(i, now)
        })
        .collect();
    push_to_example(ingest, &Snapshot::new(1, now, eps))
        .await
        .unwrap();

    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "think for a long time"}],
        "stream": true,
        "stream_options": {"include_usage": true},
        "kvroute_sim": {"output_tokens": OUTPUT_TOKENS},
    })
    .to_string();
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", listen))
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::post("/v1/chat/completions")
        .header("host", "gateway")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let start = Instant::now();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    // Arrival time of each content chunk, seconds since the request.
    let mut arrivals = Vec::new();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(60), body.frame())
        .await
        .unwrap()
    {
        let frame = frame.unwrap_or_else(|e| {
            panic!(
                "stream cut after {:.1} s: {e}\n{}",
                start.elapsed().as_secs_f64(),
                envoy.log()
            )
        });
        if let Some(d) = frame.data_ref() {
            let chunk = String::from_utf8_lossy(d);
            for _ in 0..chunk.matches("\"delta\"").count() {
                arrivals.push(start.elapsed().as_secs_f64());
            }
            text.push_str(&chunk);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    eprintln!(
        "stream: {} content events in {elapsed:.1} s (first at {:.1} s)",
        arrivals.len(),
        arrivals.first().copied().unwrap_or(f64::NAN)
    );
    assert!(elapsed > 30.0, "the stream took only {elapsed:.1} s");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap();
    assert_eq!(usage["completion_tokens"], OUTPUT_TOKENS);
    // The tokens were streamed, not delivered at the end: some arrived before the 30 s mark
    // the old timeout would have cut at, and some after it.
    assert!(arrivals.iter().any(|t| *t < 25.0), "{arrivals:?}");
    assert!(arrivals.iter().any(|t| *t > 30.0), "{arrivals:?}");
    // The example's access log line carries the decision record (filter state
    // `wasm.kvroute_decision`): reason, chosen endpoint, then both replicas ranked, the
    // chosen one first.
    let record = logged_decision(&envoy).await.unwrap();
    let (head, top) = record.split_once(";top=").unwrap();
    let chosen = head
        .strip_prefix("policy:hybrid;endpoint=")
        .unwrap_or_else(|| panic!("{record}"));
    assert!(chosen.starts_with("pool/sim-"), "{record}");
    assert!(top.starts_with(&format!("{chosen}[score=")), "{record}");
    assert_eq!(top.matches("[score=").count(), 2, "{record}");
    assert_eq!(top.matches(",kv=").count(), 2, "{record}");
    assert!(envoy.wasm_failures().await.unwrap().is_empty());
}
