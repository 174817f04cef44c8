//! Two real llama-server instances (llama.cpp, CPU, SmolLM2-135M-Instruct) behind Envoy with
//! the kvroute filter and kvroute-cp (kind `llamacpp`, with `/slots`), 20 real ShareGPT
//! prompts. Needs `scripts/llama-server.sh` (or `$KVROUTE_LLAMA_SERVER`), the SmolLM2 GGUF
//! (`make smollm2` or `$KVROUTE_SMOLLM2_GGUF`), the `.wasm` and Envoy; `make test-demo`
//! provides all four.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_core::picker::PolicyKind;
use kvroute_integration::harness::http;
use kvroute_tools::demo::gateway::{Gateway, GatewayOptions, Routing};
use kvroute_tools::demo::llama::{
    llama_server_binary, smollm2_gguf, LlamaOptions, LlamaServer, SMOLLM2_MODEL,
};
use kvroute_tools::demo::ports::PortPlan;
use kvroute_tools::demo::BACKEND_HEADER;
use kvroute_tools::replay::{
    default_trace_path, load_workload, run, RunOptions, TraceSource, WorkloadOptions,
};
use std::collections::BTreeMap;
use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What kvroute-cp reported for one endpoint over the run.
#[derive(Debug, Default, Clone)]
struct Seen {
    first_total: Option<f64>,
    last_total: Option<f64>,
    max_running: u32,
    max_kv: f64,
}

/// The stack's failures (a start, the replay) come back as errors, not panics: the test
/// prints them without a backtrace, so CI's excerpt of the output keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sharegpt_prompts_through_envoy_kvroute_to_two_llama_servers(
) -> Result<(), Box<dyn Error>> {
    let mut lo = LlamaOptions::new(llama_server_binary()?, smollm2_gguf()?);
    lo.slots = 4;
    lo.ctx = 8192;
    lo.threads = 1;
    let servers = [
        LlamaServer::start(&lo).await?,
        LlamaServer::start(&lo).await?,
    ];
    let backends: Vec<_> = servers
        .iter()
        .enumerate()
        .map(|(i, s)| s.backend(&format!("llama-{i}")))
        .collect();
    let ports = PortPlan {
        listen: 0,
        ingest: 0,
        cp: 0,
        backend_base: 0,
    };
    let mut go = GatewayOptions::new(Routing::Kvroute(PolicyKind::Hybrid), ports, SMOLLM2_MODEL);
    go.concurrency = 1;
    let gw = Gateway::start(&backends, &go).await?;
    let hub = gw.cp.as_ref().unwrap().hub().clone();

    // Sample kvroute-cp's view of both servers while serving.
    let seen: Arc<Mutex<BTreeMap<String, Seen>>> = Arc::default();
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let sampler = {
        let seen = seen.clone();
        let hub = hub.clone();
        tokio::spawn(async move {
            loop {
                for id in ["demo/llama-0", "demo/llama-1"] {
                    if let Some(st) = hub.endpoint(id).and_then(|e| e.stats) {
                        let mut m = seen.lock().unwrap();
                        let s = m.entry(id.to_owned()).or_default();
                        if s.first_total.is_none() {
                            s.first_total = st.monotonic_total;
                        }
                        s.last_total = st.monotonic_total;
                        s.max_running = s.max_running.max(st.running);
                        s.max_kv = s.max_kv.max(st.kv_usage.unwrap_or(0.0));
                    }
                }
                tokio::select! {
                    _ = stop_rx.changed() => break,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        })
    };

    let mut w = WorkloadOptions::new(TraceSource::ShareGpt(default_trace_path("sharegpt")));
    w.max_requests = Some(20);
    w.max_output_tokens = Some(16);
    w.max_prompt_tokens = Some(1024);
    w.sharegpt_rate_rps = 8.0;
    w.seed = 3;
    w.model = SMOLLM2_MODEL.into();
    w.sim_extension = false;
    let reqs = load_workload(&w)?;
    assert_eq!(reqs.len(), 20);
    let mut ro = RunOptions::new(gw.chat_url(), "kvroute-hybrid");
    ro.backend_header = Some(BACKEND_HEADER.into());
    ro.kv_sample = backends.iter().map(|b| b.kv_target()).collect();
    ro.timeout_s = 300.0;
    let report = run(&reqs, &ro).await?;

    // One more, non-streamed, to read the completion text itself.
    let body = serde_json::json!({
        "model": SMOLLM2_MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 16
    });
    let r = http::request(
        "POST",
        &gw.chat_url(),
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_str(&r.text())?;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(!text.trim().is_empty(), "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");

    // Let kvroute-cp scrape the final counters, then stop sampling.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_tx.send(true);
    sampler.await.unwrap();

    // Every response is a real completion: 200, content streamed (TTFT is the first content
    // chunk), usage counts from llama.cpp.
    assert_eq!(report.records.len(), 20);
    for rec in &report.records {
        assert_eq!((rec.status, rec.error.as_deref()), (200, None), "{rec:?}");
        assert!(rec.ttft_s.is_some(), "no content token: {rec:?}");
        assert!(rec.prompt_tokens > 0 && rec.output_tokens > 0, "{rec:?}");
        assert!(rec.output_tokens <= 16, "{rec:?}");
    }
    // Requests reached both servers.
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.to_string()).collect();
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for rec in &report.records {
        *per.entry(rec.backend.clone().unwrap_or_default())
            .or_default() += 1;
    }
    for a in &addrs {
        assert!(
            per.get(a).copied().unwrap_or(0) > 0,
            "no request reached {a}: {per:?}"
        );
    }
    // kvroute-cp's stats for both servers changed while serving: the token counters grew
    // and each was seen busy.
    let seen = seen.lock().unwrap().clone();
    for id in ["demo/llama-0", "demo/llama-1"] {
        let s = seen
            .get(id)
            .unwrap_or_else(|| panic!("kvroute-cp never scraped {id}"));
        let (a, b) = (s.first_total.unwrap(), s.last_total.unwrap());
        assert!(b > a, "{id}: token counter {a} -> {b}");
        assert!(
            s.max_running > 0 || s.max_kv > 0.0,
            "{id} never seen busy: {s:?}"
        );
    }
    // The filter routed every request (20 streamed + 1).
    assert_eq!(
        gw.envoy
            .stat("wasmcustom.kvroute.decisions.policy")
            .await
            .unwrap(),
        Some(21)
    );
    println!(
        "{}",
        kvroute_tools::replay::render_table(&[report.summary()])
    );
    gw.shutdown().await;
    Ok(())
}
