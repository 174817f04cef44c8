//! HTTP tests of the simulator: OpenAI endpoints, vLLM error bodies, SSE parsed by an
//! EventSource parser, `/metrics` in every dialect parsed by an OpenMetrics parser, prefix
//! caching observed through the API, and llama.cpp `/slots`.
//!
//! Replicas run in-process on 127.0.0.1:0 with an infinite time scale (no waiting).

// Test helpers outside #[test] fns may fail loudly too (clippy.toml only exempts #[test]).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use kvroute_core::profile::builtin;
use kvroute_sim::metrics::{names, Dialect};
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetHandle, ReplicaConfig};
use serde_json::{json, Value};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn fleet(dialect: Dialect, n: usize) -> FleetHandle {
    let cfg = ReplicaConfig::builtin(MODEL, dialect, f64::INFINITY, 7).unwrap();
    spawn_fleet(FleetConfig::local(cfg, n)).await.unwrap()
}

async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, Bytes) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = tokio::time::timeout(std::time::Duration::from_secs(20), send.send_request(req))
        .await
        .expect("response within 20 s")
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, bytes)
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (s, b) = request(addr, "POST", path, Some(body)).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

async fn metrics_text(addr: SocketAddr) -> String {
    let (s, b) = request(addr, "GET", "/metrics", None).await;
    assert_eq!(s, 200);
    String::from_utf8(b.to_vec()).unwrap()
}

/// Parse with the openmetrics-parser crate; return family name → sample values.
fn parse_metrics(text: &str) -> std::collections::HashMap<String, Vec<f64>> {
    let expo = openmetrics_parser::openmetrics::parse_openmetrics(text)
        .unwrap_or_else(|e| panic!("exposition does not parse: {e:?}\n{text}"));
    let mut out = std::collections::HashMap::new();
    for (name, fam) in expo.families {
        let vals: Vec<f64> = fam
            .iter_samples()
            .filter_map(|s| match &s.value {
                openmetrics_parser::OpenMetricsValue::Gauge(v)
                | openmetrics_parser::OpenMetricsValue::Unknown(v) => Some(v.as_f64()),
                openmetrics_parser::OpenMetricsValue::Counter(c) => Some(c.value.as_f64()),
                openmetrics_parser::OpenMetricsValue::Histogram(h) => {
                    Some(h.count.unwrap_or(0) as f64)
                }
                _ => None,
            })
            .collect();
        out.insert(name, vals);
    }
    out
}

fn chat(prompt_tokens: u32, output: u32, ids: &[u64]) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
           "kvroute_sim": {"prompt_tokens": prompt_tokens, "output_tokens": output,
                           "prefix_block_ids": ids}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_longer_than_max_model_len_is_400() {
    let f = fleet(Dialect::VllmV1, 1).await;
    let addr = f.addr(0).unwrap();
    let max = builtin(MODEL).unwrap().max_model_len;
    let (s, body) = post(addr, "/v1/chat/completions", chat(max + 10, 1, &[])).await;
    assert_eq!(s, 400);
    assert_eq!(body["object"], "error");
    assert_eq!(body["type"], "BadRequestError");
    assert_eq!(body["code"], 400);
    assert_eq!(
        body["message"],
        format!("This model's maximum context length is {max} tokens. However, your request has {} input tokens. Please reduce the length of the input messages.", max + 10)
    );
    // Output limit that does not fit.
    let (s, body) = post(
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": max, "kvroute_sim": {"prompt_tokens": 100}}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    // Wrong model → 404; malformed JSON → 400.
    let (s, body) = post(
        addr,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!((s, body["type"].as_str()), (404, Some("NotFoundError")));
    let (s, _) = request(addr, "POST", "/v1/chat/completions", None).await;
    assert_eq!(s, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_unknown_paths() {
    let f = fleet(Dialect::VllmV1, 2).await;
    assert_ne!(f.addr(0), f.addr(1));
    let addr = f.addr(1).unwrap();
    let (s, b) = request(addr, "GET", "/health", None).await;
    assert_eq!((s, b.len()), (200, 0));
    let (s, b) = request(addr, "GET", "/v1/models", None).await;
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, 200);
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(
        v["data"][0]["max_model_len"],
        builtin(MODEL).unwrap().max_model_len
    );
    let (s, _) = request(addr, "GET", "/nope", None).await;
    assert_eq!(s, 404);
    let (s, _) = request(addr, "GET", "/v1/chat/completions", None).await;
    assert_eq!(s, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_completion_has_exact_usage() {
    let f = fleet(Dialect::VllmV1, 1).await;
    let (s, v) = post(
        f.addr(0).unwrap(),
        "/v1/chat/completions",
        chat(1000, 4, &[]),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "The simulated model writes "
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 1000);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 1004);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_stream_parses_like_an_openai_client() {
    let f = fleet(Dialect::VllmV1, 1).await;
    let addr = f.addr(0).unwrap();
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}],
                      "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
    let req = http::Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("host", addr.to_string())
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let frames = resp.into_body().into_data_stream();
    let events: Vec<_> = frames.eventsource().collect().await;
    let data: Vec<String> = events.into_iter().map(|e| e.unwrap().data).collect();
    // role chunk + 5 token chunks + usage chunk + [DONE]
    assert_eq!(data.len(), 8, "{data:?}");
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..7]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..6]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text, "The simulated model writes one ");
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(chunks[6]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 5);
    let prompt = chunks[6]["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 0);
    assert_eq!(chunks[6]["usage"]["total_tokens"], prompt + 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_hits_prefix_cache_over_http() {
    let f = fleet(Dialect::VllmV1, 1).await;
    let addr = f.addr(0).unwrap();
    let ids: Vec<u64> = (0..16).collect(); // 16 × 512 = 8192 shared tokens
    let (_, a) = post(addr, "/v1/chat/completions", chat(8000, 1, &ids)).await;
    let (_, b) = post(addr, "/v1/chat/completions", chat(8000, 1, &ids)).await;
    let t = |v: &Value, k: &str| v["kvroute_sim"][k].as_f64().unwrap();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 7984);
    let m = parse_metrics(&metrics_text(addr).await);
    assert_eq!(m[names::VLLM_PREFIX_QUERIES], vec![16000.0]);
    assert_eq!(m[names::VLLM_PREFIX_HITS], vec![7984.0]);
    assert_eq!(m[names::VLLM_TTFT], vec![2.0]);
    // The second request's TTFT (its first-token time minus the first's finish) is far lower.
    // Sequential requests on an otherwise idle replica: b arrives when a finishes.
    assert_eq!(t(&a, "arrival_time_s"), 0.0);
    assert_eq!(t(&b, "arrival_time_s"), t(&a, "finish_time_s"));
    for v in [&a, &b] {
        assert_eq!(
            t(v, "ttft_s"),
            t(v, "first_token_time_s") - t(v, "arrival_time_s")
        );
    }
    let (cold, warm) = (t(&a, "ttft_s"), t(&b, "ttft_s"));
    assert!(warm < cold / 5.0, "warm {warm} cold {cold}");
}

/// Tokens reach the client when their step ends in wall time, not when it starts: a
/// one-token answer to an 8,000-token prompt (one prefill step) at time scale 4 arrives no
/// sooner than its engine TTFT ÷ 4 after the request was sent. (A lower bound only: a slow
/// machine can delay the answer, never make it early. Handing a step's tokens out before
/// sleeping to its end delivered them one step early, which halved the online TTFT p50 of
/// the Mooncake cross-check; docs/bench.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_arrive_at_the_end_of_their_step_in_wall_time() {
    const SCALE: f64 = 4.0;
    let cfg = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, SCALE, 7).unwrap();
    let f = spawn_fleet(FleetConfig::local(cfg, 1)).await.unwrap();
    let addr = f.addr(0).unwrap();
    let sent = std::time::Instant::now();
    let (s, v) = post(addr, "/v1/chat/completions", chat(8000, 1, &[])).await;
    let wall = sent.elapsed().as_secs_f64();
    assert_eq!(s, 200);
    let ttft = v["kvroute_sim"]["ttft_s"].as_f64().unwrap();
    assert!(
        ttft > 0.2,
        "an 8,000-token prefill takes well over 0.2 s: {ttft}"
    );
    assert!(
        wall * SCALE >= ttft * 0.95,
        "answer after {:.3} virtual s, its first token ends a step at {ttft:.3} s",
        wall * SCALE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dialect_parses_and_has_its_names() {
    let expected: &[(Dialect, &[&str])] = &[
        (
            Dialect::VllmV1,
            &[
                names::VLLM_KV_USAGE,
                names::VLLM_RUNNING,
                names::VLLM_WAITING,
                names::VLLM_PREFIX_QUERIES,
                names::VLLM_PREFIX_HITS,
                names::VLLM_CACHE_CONFIG,
                names::VLLM_TTFT,
                names::VLLM_E2E,
                names::VLLM_PREEMPTIONS,
                names::PROCESS_START,
            ],
        ),
        (
            Dialect::VllmV0,
            &[
                names::VLLM_GPU_CACHE_USAGE,
                names::VLLM_RUNNING,
                names::VLLM_WAITING,
                names::VLLM_GPU_PREFIX_HIT_RATE,
                names::VLLM_CACHE_CONFIG,
                names::VLLM_TTFT,
                names::VLLM_E2E,
                names::PROCESS_START,
            ],
        ),
        (
            Dialect::Sglang,
            &[
                names::SGLANG_TOKEN_USAGE,
                names::SGLANG_RUNNING,
                names::SGLANG_QUEUE,
                names::SGLANG_CACHE_HIT_RATE,
                names::SGLANG_USED_TOKENS,
                names::SGLANG_TTFT,
                names::SGLANG_E2E,
                names::PROCESS_START,
            ],
        ),
        (
            Dialect::Llamacpp,
            &[
                names::LLAMACPP_PROMPT_TOKENS,
                names::LLAMACPP_PREDICTED,
                names::LLAMACPP_PROCESSING,
                names::LLAMACPP_DEFERRED,
                names::LLAMACPP_N_DECODE,
            ],
        ),
    ];
    for (dialect, want) in expected {
        let f = fleet(*dialect, 1).await;
        let addr = f.addr(0).unwrap();
        let (s, _) = post(
            addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hello", "max_tokens": 3}),
        )
        .await;
        assert_eq!(s, 200);
        let text = metrics_text(addr).await;
        let m = parse_metrics(&text);
        for name in *want {
            assert!(m.contains_key(*name), "{dialect:?} lacks {name}:\n{text}");
        }
        // Sample names exactly as the real servers write them.
        let sample_names: &[&str] = match dialect {
            Dialect::VllmV1 => &[
                "vllm:prefix_cache_hits_total{",
                "vllm:num_preemptions_total{",
                "vllm:kv_cache_usage_perc{",
            ],
            Dialect::VllmV0 => &["vllm:gpu_cache_usage_perc{", "vllm:num_preemptions_total{"],
            Dialect::Sglang => &["sglang:prompt_tokens_total{", "sglang:token_usage{"],
            Dialect::Llamacpp => &[
                "llamacpp:prompt_tokens_total ",
                "llamacpp:tokens_predicted_total 3",
                "llamacpp:requests_processing 0",
            ],
        };
        for s in sample_names {
            assert!(text.contains(s), "{dialect:?}: no `{s}` in\n{text}");
        }
        if matches!(dialect, Dialect::VllmV1 | Dialect::VllmV0) {
            let blocks = ReplicaConfig::builtin(MODEL, *dialect, 1.0, 0)
                .unwrap()
                .engine
                .num_gpu_blocks;
            assert!(text.contains("block_size=\"16\""));
            assert!(text.contains(&format!("num_gpu_blocks=\"{blocks}\"")));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llamacpp_slots_lists_every_slot() {
    let profile = builtin(MODEL).unwrap();
    let mut cfg = ReplicaConfig::for_model(profile, Dialect::Llamacpp, f64::INFINITY, 0).unwrap();
    cfg.engine.max_num_seqs = 4;
    let f = spawn_fleet(FleetConfig::local(cfg, 1)).await.unwrap();
    let (s, b) = request(f.addr(0).unwrap(), "GET", "/slots", None).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_slice(&b).unwrap();
    let slots = v.as_array().unwrap();
    assert_eq!(slots.len(), 4);
    assert!(slots.iter().all(|s| s["is_processing"] == false));
    assert_eq!(slots[0]["n_ctx"], builtin(MODEL).unwrap().max_model_len);
    // Not served in other dialects.
    let f2 = fleet(Dialect::VllmV1, 1).await;
    let (s, _) = request(f2.addr(0).unwrap(), "GET", "/slots", None).await;
    assert_eq!(s, 404);
}

/// Golden over HTTP: with an infinite time scale and sequential requests, a fixed seed and a
/// fixed request sequence give exact output lengths and exact virtual token times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_seed_and_requests_give_exact_timings() {
    async fn run(seed: u64) -> Vec<(u64, f64, f64)> {
        let profile = builtin(MODEL).unwrap();
        let cfg = ReplicaConfig::for_model(profile, Dialect::VllmV1, f64::INFINITY, seed).unwrap();
        let f = spawn_fleet(FleetConfig::local(cfg, 1)).await.unwrap();
        let mut out = Vec::new();
        for i in 0..4u64 {
            // No output limit: the length is the seeded draw.
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "kvroute_sim": {"prompt_tokens": 1000 + 100 * i}});
            let (s, v) = post(f.addr(0).unwrap(), "/v1/chat/completions", body).await;
            assert_eq!(s, 200, "{v}");
            out.push((
                v["usage"]["completion_tokens"].as_u64().unwrap(),
                v["kvroute_sim"]["first_token_time_s"].as_f64().unwrap(),
                v["kvroute_sim"]["finish_time_s"].as_f64().unwrap(),
            ));
        }
        out
    }
    let a = run(7).await;
    let b = run(7).await;
    assert_eq!(a, b);
    let c = run(8).await;
    assert_ne!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        c.iter().map(|x| x.0).collect::<Vec<_>>()
    );
    // The first request's first token ends a single 1000-token prefill step at t = 0.
    let step = kvroute_sim::perf::perf_profile("h100-llama-3.1-8b")
        .unwrap()
        .step;
    let t1 = step.step_time(&kvroute_sim::perf::BatchShape {
        prefill_tokens: 1000,
        prefill_pairs: 1000 * 1001 / 2,
        ..Default::default()
    });
    assert!((a[0].1 - t1).abs() < 1e-12, "{a:?} vs {t1}");
    // Lengths are in the documented range 1..=2·mean−1 (mean = default_max_tokens · fraction).
    let p = builtin(MODEL).unwrap();
    let hi = (2.0 * f64::from(p.default_max_tokens) * p.expected_output_fraction - 1.0) as u64;
    assert!(a.iter().all(|x| x.0 >= 1 && x.0 <= hi), "{a:?}");
    // Each request starts when the previous one finished; its TTFT is one prefill step.
    for w in a.windows(2) {
        assert!(w[1].1 > w[0].2);
    }
}

/// A streaming client that disconnects mid-generation aborts its request: the replica stops
/// running it and frees its KV blocks (vLLM does the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_aborts_and_frees_blocks() {
    let profile = builtin(MODEL).unwrap();
    // Real time: 5000 output tokens take ~35 s, so the request is surely still running.
    let cfg = ReplicaConfig::for_model(profile, Dialect::VllmV1, 1.0, 0).unwrap();
    let f = spawn_fleet(FleetConfig::local(cfg, 1)).await.unwrap();
    let addr = f.addr(0).unwrap();
    {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        let conn = tokio::spawn(conn);
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "stream": true, "max_tokens": 5000,
                          "kvroute_sim": {"prompt_tokens": 4000}});
        let req = http::Request::post("/v1/chat/completions")
            .header("host", addr.to_string())
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        let mut body = resp.into_body();
        // Wait for the first token chunk (after the role chunk).
        let mut seen = 0;
        while seen < 2 {
            let frame = body.frame().await.unwrap().unwrap();
            if let Ok(d) = frame.into_data() {
                seen += d.windows(6).filter(|w| w == b"data: ").count();
            }
        }
        let text = metrics_text(addr).await;
        let m = parse_metrics(&text);
        assert_eq!(m[names::VLLM_RUNNING], vec![1.0]);
        assert!(m[names::VLLM_KV_USAGE][0] > 0.0);
        drop(body);
        drop(send);
        conn.abort();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let m = parse_metrics(&metrics_text(addr).await);
        if m[names::VLLM_RUNNING] == vec![0.0] {
            assert_eq!(m[names::VLLM_KV_USAGE], vec![0.0]);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "request not aborted within 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let text = metrics_text(addr).await;
    assert!(text.contains("finished_reason=\"abort\"} 1"), "{text}");
}

/// Concurrent long prompts on a small cache, observed the way a scraper sees them: KV usage
/// rises, a waiting queue forms, preemptions are counted, and everything still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_shows_in_metrics() {
    let profile = builtin(MODEL).unwrap();
    let mut cfg = ReplicaConfig::for_model(profile, Dialect::VllmV1, 20.0, 0).unwrap();
    cfg.engine.num_gpu_blocks = 400; // 6,400 tokens
    let f = spawn_fleet(FleetConfig::local(cfg, 1)).await.unwrap();
    let addr = f.addr(0).unwrap();
    let mut reqs = Vec::new();
    for i in 0..12u64 {
        reqs.push(tokio::spawn(post(
            addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x",
                   "kvroute_sim": {"prompt_tokens": 1500, "output_tokens": 300,
                                   "prefix_block_ids": [1000 + i]}}),
        )));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut max_usage, mut max_waiting) = (0.0f64, 0.0f64);
    let mut preemptions = 0.0;
    while std::time::Instant::now() < deadline {
        let m = parse_metrics(&metrics_text(addr).await);
        max_usage = max_usage.max(m[names::VLLM_KV_USAGE][0]);
        max_waiting = max_waiting.max(m[names::VLLM_WAITING][0]);
        preemptions = m[names::VLLM_PREEMPTIONS][0];
        if max_usage > 0.9 && max_waiting >= 1.0 && preemptions >= 1.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(max_usage > 0.9, "usage {max_usage}");
    assert!(max_waiting >= 1.0, "waiting {max_waiting}");
    assert!(preemptions >= 1.0, "preemptions {preemptions}");
    for r in reqs {
        let (s, v) = r.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 300);
    }
    let m = parse_metrics(&metrics_text(addr).await);
    assert_eq!(m[names::VLLM_RUNNING], vec![0.0]);
    assert_eq!(m[names::VLLM_WAITING], vec![0.0]);
}

#[test]
fn builtin_replica_config_names_an_unknown_model() {
    use kvroute_sim::server::BuiltinError;
    let cfg = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, 1.0, 0).unwrap();
    let direct =
        ReplicaConfig::for_model(builtin(MODEL).unwrap(), Dialect::VllmV1, 1.0, 0).unwrap();
    assert_eq!(cfg.engine.num_gpu_blocks, direct.engine.num_gpu_blocks);
    assert_eq!(
        ReplicaConfig::builtin("no/such-model", Dialect::VllmV1, 1.0, 0).unwrap_err(),
        BuiltinError::Unknown("no/such-model".into())
    );
}
