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
use kvroute_integration::harness::kvroute::now_ms;
use kvroute_integration::harness::{http, wasm_path, workspace_root, Envoy};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::perf::BatchShape;
use kvroute_sim::server::{spawn_fleet, FleetConfig, ReplicaConfig};
use std::time::{Duration, Instant};

/// Wall-clock length of the generation, seconds (the old route timeout was 30 s).
const STREAM_SECONDS: f64 = 36.0;
/// Tokens generated.
const OUTPUT_TOKENS: u32 = 120;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// The ingest token written in the shipped example.
const EXAMPLE_TOKEN: &str = "change-me-to-a-long-random-secret";

/// `examples/envoy/<name>` with its ports, backends and module path replaced.
fn example(name: &str, listen: u16, ingest: u16, backends: &[String]) -> String {
    let path = workspace_root().join("examples").join("envoy").join(name);
    let mut y = std::fs::read_to_string(&path).unwrap();
    for (from, to) in [
        ("port_value: 10000", format!("port_value: {listen}")),
        ("port_value: 10001", format!("port_value: {ingest}")),
        ("port_value: 9901", "port_value: 0".to_owned()),
        ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
        (
            "/etc/envoy/kvroute_filter.wasm",
            wasm_path().display().to_string(),
        ),
    ] {
        assert!(y.contains(from), "{name} no longer contains `{from}`");
        y = y.replace(from, &to);
    }
    for (i, b) in backends.iter().enumerate() {
        let (host, port) = b.rsplit_once(':').unwrap();
        let from = format!(
            "{{socket_address: {{address: \"127.0.0.1\", port_value: {}}}}}",
            8001 + i
        );
        assert!(y.contains(&from), "{name} no longer contains `{from}`");
        y = y.replace(
            &from,
            &format!("{{socket_address: {{address: \"{host}\", port_value: {port}}}}}"),
        );
    }
    y
}

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
        Ok(example("endpoint-mode.yaml", listen, ingest, &backends))
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
    let r = http::request(
        "POST",
        &format!("http://127.0.0.1:{ingest}/kvroute/v1/snapshot"),
        &[("authorization", &format!("Bearer {EXAMPLE_TOKEN}"))],
        &Snapshot::new(1, now, eps).encode(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 204, "{}", r.text());

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
    // chosen one first. Envoy flushes access logs on a timer, so poll.
    let deadline = Instant::now() + Duration::from_secs(20);
    let line = loop {
        let log = envoy.log();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("\"POST /v1/chat/completions\" 200"))
        {
            break l.to_owned();
        }
        assert!(Instant::now() < deadline, "no access log line:\n{log}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("access log: {line}");
    let record = line.split_once(" kvroute=").unwrap().1;
    let (head, top) = record.split_once(";top=").unwrap();
    let chosen = head
        .strip_prefix("policy:hybrid;endpoint=")
        .unwrap_or_else(|| panic!("{line}"));
    assert!(chosen.starts_with("pool/sim-"), "{line}");
    assert!(top.starts_with(&format!("{chosen}[score=")), "{line}");
    assert_eq!(top.matches("[score=").count(), 2, "{line}");
    assert_eq!(top.matches(",kv=").count(), 2, "{line}");
    assert!(envoy.wasm_failures().await.unwrap().is_empty());
}
