//! Tests of `kvroute-replay` (issue 6, part 1): trace loaders on the real shared traces,
//! the Mooncake text-sharing property, live replays against in-process kvroute-sim
//! replicas, recorded failures, summary math, the JSON report and the SVG plots.
//!
//! Expected values of the loader tests were read from the files in `../shared/data/` with a
//! one-off Python `json`/`csv` script (row counts, first rows, slice sizes).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::analysis::{analyze, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::percentile::percentile;
use kvroute_core::prefix::{block_hashes, PrefixConfig};
use kvroute_integration::harness::{RecordingBackend, Reply};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetHandle, ReplicaConfig};
use kvroute_sim::trace::load_mooncake;
use kvroute_tools::replay::report::read_report;
use kvroute_tools::replay::workload::{block_text, BLOCK_TOKENS};
use kvroute_tools::replay::*;
use serde_json::Value;

fn mooncake() -> TraceSource {
    TraceSource::Mooncake(default_trace_path("mooncake"))
}

fn body(r: &ReplayRequest) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

fn content(r: &ReplayRequest) -> String {
    body(r)["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn mooncake_loader_first_rows_and_extension() {
    let mut w = WorkloadOptions::new(mooncake());
    w.max_requests = Some(3);
    w.sim_extension = true;
    let reqs = load_workload(&w).unwrap();
    let got: Vec<_> = reqs
        .iter()
        .map(|r| (r.id, r.at_s, r.prompt_tokens, r.output_tokens))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, 0.0, 6758, 500),
            (1, 0.0, 7322, 490),
            (2, 0.0, 7236, 794)
        ]
    );
    let b = body(&reqs[1]);
    assert_eq!(b["model"], DEFAULT_MODEL);
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"]["include_usage"], true);
    assert_eq!(b["max_tokens"], 490);
    let ext = &b["kvroute_sim"];
    assert_eq!(ext["prompt_tokens"], 7322);
    assert_eq!(ext["output_tokens"], 490);
    assert_eq!(ext["prefix_block_tokens"], 512);
    let ids: Vec<u64> = serde_json::from_value(ext["prefix_block_ids"].clone()).unwrap();
    assert_eq!(
        ids,
        (14..=27).fold(vec![0], |mut v, i| {
            v.push(i);
            v
        })
    );
    assert!(b.get("ignore_eos").is_none());
    // Text: one 7-byte word per token, blocks of 512 words, the last one partial.
    assert_eq!(content(&reqs[1]).len(), 7322 * 7);
    // Extension off (real servers): no kvroute_sim field, same text.
    w.sim_extension = false;
    w.ignore_eos = true;
    let plain = load_workload(&w).unwrap();
    let pb = body(&plain[1]);
    assert!(pb.get("kvroute_sim").is_none());
    assert_eq!(pb["ignore_eos"], true);
    assert_eq!(content(&plain[1]), content(&reqs[1]));
}

/// The routing benchmark's model of the filter's input (`mooncake_sim_body`) is byte for
/// byte the body `kvroute-demo` sends for the same rows (the demo's workload: simulator
/// extension on, no output cap).
#[test]
fn benchmark_bodies_are_the_demo_bodies() {
    let mut w = WorkloadOptions::new(mooncake());
    w.max_requests = Some(40);
    w.sim_extension = true;
    let reqs = load_workload(&w).unwrap();
    let rows = load_mooncake(&default_trace_path("mooncake")).unwrap();
    let mut cache = std::collections::HashMap::new();
    assert_eq!(reqs.len(), 40);
    for (i, r) in reqs.iter().enumerate() {
        let row = &rows[i];
        let b = workload::mooncake_sim_body(
            DEFAULT_MODEL,
            &row.hash_ids,
            row.input_length,
            row.output_length,
            (w.seed, i as u64),
            &mut cache,
        );
        assert_eq!(b, r.body, "row {i}");
    }
}

#[test]
fn mooncake_prompt_length_estimate_matches_trace() {
    let mut w = WorkloadOptions::new(mooncake());
    w.max_requests = Some(20);
    let est = Estimator::default();
    for r in load_workload(&w).unwrap() {
        let a = analyze(ApiKind::ChatCompletions, &r.body, &est).unwrap();
        let diff = a.prompt_tokens as i64 - i64::from(r.prompt_tokens);
        // The chat rendering adds a few tokens (role, separators); the content is exact.
        assert!(
            (0..=8).contains(&diff),
            "row {}: estimate {} vs trace {}",
            r.id,
            a.prompt_tokens,
            r.prompt_tokens
        );
    }
}

#[test]
fn mooncake_slicing_and_scaling() {
    let mut w = WorkloadOptions::new(mooncake());
    w.start_s = 60.0;
    w.duration_s = Some(30.0);
    let reqs = load_workload(&w).unwrap();
    assert_eq!(reqs.len(), 98);
    assert_eq!(reqs[0].prompt_tokens, 893);
    // First kept row (t = 60 s) goes at 0; last (t = 86.999 s) at 26.999 s.
    assert_eq!(reqs[0].at_s, 0.0);
    assert!((reqs[97].at_s - 26.999).abs() < 1e-9);
    w.rate_scale = 2.0;
    w.time_scale = 5.0;
    let fast = load_workload(&w).unwrap();
    assert!((fast[97].at_s - 26.999 / 10.0).abs() < 1e-9);
    assert!(fast.windows(2).all(|p| p[0].at_s <= p[1].at_s));
    // max_prompt_tokens drops long rows; max_requests caps after filtering.
    w.max_prompt_tokens = Some(2000);
    w.max_requests = Some(5);
    let short = load_workload(&w).unwrap();
    assert_eq!(short.len(), 5);
    assert!(short.iter().all(|r| r.prompt_tokens <= 2000));
    assert_eq!(
        short.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    // max_output_tokens caps outputs (and max_tokens in the body).
    w.max_output_tokens = Some(7);
    let capped = load_workload(&w).unwrap();
    assert!(capped
        .iter()
        .all(|r| r.output_tokens <= 7 && body(r)["max_tokens"].as_u64() <= Some(7)));
}

#[test]
fn bad_options_and_files_are_typed_errors() {
    let mut w = WorkloadOptions::new(mooncake());
    w.rate_scale = 0.0;
    assert!(matches!(
        load_workload(&w),
        Err(ReplayError::Option {
            option: "rate_scale",
            ..
        })
    ));
    let mut w = WorkloadOptions::new(mooncake());
    w.time_scale = f64::NAN;
    assert!(matches!(
        load_workload(&w),
        Err(ReplayError::Option {
            option: "time_scale",
            ..
        })
    ));
    let w = WorkloadOptions::new(TraceSource::AzureCsv("/nonexistent/x.csv".into()));
    assert!(matches!(
        load_workload(&w),
        Err(ReplayError::File(TraceError::Io { .. }))
    ));
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\":0,\"input_length\":5,\"output_length\":1}\nnot json\n",
    )
    .unwrap();
    let w = WorkloadOptions::new(TraceSource::Mooncake(bad));
    match load_workload(&w) {
        Err(ReplayError::File(TraceError::Parse { line, .. })) => assert_eq!(line, 2),
        other => panic!("want a parse error on line 2, got {other:?}"),
    }
    let csv = dir.path().join("bad.csv");
    std::fs::write(
        &csv,
        "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n",
    )
    .unwrap();
    match load_workload(&WorkloadOptions::new(TraceSource::AzureCsv(csv))) {
        Err(ReplayError::File(TraceError::Parse { line, message, .. })) => {
            assert_eq!(line, 2);
            assert!(message.contains("bad TIMESTAMP"), "{message}");
        }
        other => panic!("want a parse error, got {other:?}"),
    }
}

/// Azure rows with 10 s ≤ t < 70 s after the first row (Python `csv` + `datetime` scan).
const AZURE_10_70: usize = 229;

#[test]
fn azure_loader_first_rows() {
    let mut w = WorkloadOptions::new(TraceSource::AzureCsv(default_trace_path("azure")));
    w.max_requests = Some(4);
    w.rate_scale = 2.0;
    w.time_scale = 2.0;
    w.sim_extension = true;
    let reqs = load_workload(&w).unwrap();
    let lens: Vec<_> = reqs
        .iter()
        .map(|r| (r.prompt_tokens, r.output_tokens))
        .collect();
    assert_eq!(lens, vec![(374, 44), (396, 109), (879, 55), (91, 16)]);
    // 18:15:46.6805900 → 18:15:50.9951690 = 4.314579 s, /4; 18:15:51.2224670 → 4.541876 s.
    let at: Vec<f64> = reqs.iter().map(|r| r.at_s).collect();
    assert_eq!(at[0], 0.0);
    assert!((at[1] - 4.314579 / 4.0).abs() < 1e-6, "{at:?}");
    assert!((at[2] - 4.541876 / 4.0).abs() < 1e-6, "{at:?}");
    assert!((at[3] - 4.710427 / 4.0).abs() < 1e-6, "{at:?}");
    assert_eq!(content(&reqs[0]).len(), 374 * 7);
    assert_ne!(content(&reqs[0])[..70], content(&reqs[1])[..70]);
    assert_eq!(body(&reqs[2])["kvroute_sim"]["prompt_tokens"], 879);
    assert!(body(&reqs[2])["kvroute_sim"]
        .get("prefix_block_ids")
        .is_none());
    // A 60 s slice from 10 s in (count from a Python scan of the CSV).
    let mut w = WorkloadOptions::new(TraceSource::AzureCsv(default_trace_path("azure")));
    w.start_s = 10.0;
    w.duration_s = Some(60.0);
    assert_eq!(load_workload(&w).unwrap().len(), AZURE_10_70);
}

#[test]
fn sharegpt_loaders_and_poisson_arrivals() {
    let mut w = WorkloadOptions::new(TraceSource::ShareGpt(default_trace_path("sharegpt")));
    w.sharegpt_rate_rps = 4.0;
    w.seed = 11;
    let a = load_workload(&w).unwrap();
    assert_eq!(a.len(), 1000);
    assert!(content(&a[0]).starts_with("a. A blog is a type of website"));
    assert!(a
        .iter()
        .all(|r| r.output_tokens == workload::DEFAULT_SHAREGPT_OUTPUT_TOKENS));
    // The file's broken `\user@example.com` escapes read as a literal backslash.
    assert!(a.iter().any(|r| content(r).contains("\\user@example.com")));
    // Poisson: 999 exponential gaps of mean 0.25 s; the sample mean has sd 0.25/√999 ≈ 0.0079,
    // so ±0.04 is a 5-sigma bound.
    let mean_gap = a[999].at_s / 999.0;
    assert!((mean_gap - 0.25).abs() < 0.04, "mean gap {mean_gap}");
    // Deterministic per seed, different across seeds, same prompts either way.
    assert_eq!(load_workload(&w).unwrap(), a);
    w.seed = 12;
    let b = load_workload(&w).unwrap();
    assert_ne!(a[10].at_s, b[10].at_s);
    assert_eq!(a[10].body, b[10].body);
    // LMBenchmark multi-round: 252 inputs with their output lengths, file order.
    let m = load_workload(&WorkloadOptions::new(TraceSource::ShareGpt(
        default_trace_path("sharegpt-multiround"),
    )))
    .unwrap();
    assert_eq!(m.len(), 252);
    assert_eq!(
        m.iter()
            .take(3)
            .map(|r| r.output_tokens)
            .collect::<Vec<_>>(),
        vec![275, 332, 286]
    );
    assert!(content(&m[0]).starts_with("Summarize the main ideas of Jeff Walker"));
    // Sim extension without exact prompt tokens (estimated from the text by the simulator).
    let mut w = WorkloadOptions::new(TraceSource::ShareGpt(default_trace_path("sharegpt")));
    w.sim_extension = true;
    w.max_requests = Some(1);
    let one = load_workload(&w).unwrap();
    let ext = &body(&one[0])["kvroute_sim"];
    assert_eq!(ext["output_tokens"], 256);
    assert!(ext.get("prompt_tokens").is_none());
}

/// Longest common byte prefix.
fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

#[test]
fn mooncake_rows_sharing_ids_share_text_and_prefix_hashes() {
    let rows = load_mooncake(&default_trace_path("mooncake")).unwrap();
    // Rows 30 and 191 share exactly their first 2 hash ids (found with a Python scan).
    assert_eq!(rows[30].hash_ids[..2], rows[191].hash_ids[..2]);
    assert_ne!(rows[30].hash_ids[2], rows[191].hash_ids[2]);
    // Rows 0 and 1 share exactly 1.
    assert_eq!(rows[0].hash_ids[0], rows[1].hash_ids[0]);
    assert_ne!(rows[0].hash_ids[1], rows[1].hash_ids[1]);
    let mut w = WorkloadOptions::new(mooncake());
    w.max_requests = Some(192);
    let reqs = load_workload(&w).unwrap();
    let est = Estimator::default();
    let cfg = PrefixConfig::default();
    let block_bytes = BLOCK_TOKENS as usize * 7;
    for (i, j, k) in [(30usize, 191usize, 2usize), (0, 1, 1)] {
        let (ca, cb) = (content(&reqs[i]), content(&reqs[j]));
        // The content shares exactly the k blocks: the next word differs.
        assert_eq!(ca[..k * block_bytes], cb[..k * block_bytes]);
        assert_ne!(
            ca[k * block_bytes..k * block_bytes + 7],
            cb[k * block_bytes..k * block_bytes + 7]
        );
        // And each shared block is the id's text.
        for (n, id) in rows[i].hash_ids[..k].iter().enumerate() {
            assert_eq!(
                ca[n * block_bytes..(n + 1) * block_bytes],
                block_text(*id, BLOCK_TOKENS)
            );
        }
        // kvroute-core's GIE-compatible prefix hashes agree on every 64-byte block inside
        // the common prefix of the rendered prompts, and on no later block.
        let pa = analyze(ApiKind::ChatCompletions, &reqs[i].body, &est)
            .unwrap()
            .prefix_text;
        let pb = analyze(ApiKind::ChatCompletions, &reqs[j].body, &est)
            .unwrap()
            .prefix_text;
        let offset = pa.find(&ca[..64]).unwrap();
        let common = common_prefix(&pa, &pb);
        assert!(common >= offset + k * block_bytes && common < offset + k * block_bytes + 7);
        let ha = block_hashes(DEFAULT_MODEL, None, &pa, &cfg);
        let hb = block_hashes(DEFAULT_MODEL, None, &pb, &cfg);
        let agree = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
        let expected = (common / cfg.block_chars).min(cfg.max_blocks);
        assert_eq!(agree, expected, "rows {i},{j}");
        assert!(agree >= k * block_bytes / cfg.block_chars);
        if expected < cfg.max_blocks {
            assert_ne!(ha[expected], hb[expected]);
        }
    }
}

async fn sim_fleet(n: usize, time_scale: f64) -> FleetHandle {
    let cfg = ReplicaConfig::builtin(DEFAULT_MODEL, Dialect::VllmV1, time_scale, 3).unwrap();
    spawn_fleet(FleetConfig::local(cfg, n)).await.unwrap()
}

/// Leading hash ids row `i` of `rows` shares with any earlier row.
fn shared_with_earlier(rows: &[Vec<u64>]) -> Vec<usize> {
    (0..rows.len())
        .map(|i| {
            rows[..i]
                .iter()
                .map(|e| e.iter().zip(&rows[i]).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_against_two_sim_replicas() {
    let fleet = sim_fleet(2, 1000.0).await;
    let trace = load_mooncake(&default_trace_path("mooncake")).unwrap();
    let mut w = WorkloadOptions::new(mooncake());
    w.max_requests = Some(40);
    w.time_scale = 1000.0;
    w.sim_extension = true;
    let reqs = load_workload(&w).unwrap();
    // Even rows to replica 0, odd rows to replica 1, one at a time (cap 1) so every earlier
    // prefix is cached when a later row arrives.
    let mut runs = Vec::new();
    for r in 0..2 {
        let part: Vec<ReplayRequest> = reqs
            .iter()
            .filter(|q| q.id as usize % 2 == r)
            .cloned()
            .collect();
        let addr = fleet.addr(r).unwrap();
        let mut o = RunOptions::new(
            format!("http://{addr}/v1/chat/completions"),
            format!("r{r}"),
        );
        o.concurrency_cap = 1;
        o.timeout_s = 60.0;
        o.kv_sample = vec![KvSampleTarget {
            name: format!("r{r}"),
            metrics_url: format!("http://{addr}/metrics"),
            kind: "vllm".into(),
            slots_url: None,
        }];
        o.kv_sample_interval_s = 0.01;
        runs.push((part, o));
    }
    let (a, b) = tokio::join!(run(&runs[0].0, &runs[0].1), run(&runs[1].0, &runs[1].1));
    for (report, (part, _)) in [a.unwrap(), b.unwrap()].iter().zip(&runs) {
        assert_eq!(report.records.len(), 20);
        assert_eq!(
            report.records.iter().map(|r| r.id).collect::<Vec<_>>(),
            part.iter().map(|q| q.id).collect::<Vec<_>>()
        );
        // Requests due together take the permit in any order: judge sharing in the order
        // they were actually sent.
        let mut order: Vec<&RequestRecord> = report.records.iter().collect();
        order.sort_by(|a, b| a.started_at_s.total_cmp(&b.started_at_s));
        let ids: Vec<Vec<u64>> = order
            .iter()
            .map(|r| trace[r.id as usize].hash_ids.clone())
            .collect();
        let shared = shared_with_earlier(&ids);
        for (rec, sh) in order.iter().zip(&shared) {
            let row = &trace[rec.id as usize];
            assert!(rec.started_at_s >= rec.sent_at_s);
            assert_eq!((rec.status, rec.error.as_deref()), (200, None), "{rec:?}");
            let ttft = rec.ttft_s.unwrap();
            assert!(ttft > 0.0 && ttft <= rec.e2e_s, "{rec:?}");
            assert_eq!(rec.output_tokens, row.output_length);
            assert_eq!(rec.prompt_tokens, row.input_length);
            if *sh == 0 {
                assert_eq!(rec.cached_tokens, 0, "{rec:?}");
            } else {
                // Each shared 512-token id is 32 cached 16-token KV blocks (every prompt here
                // is longer than its shared ids).
                assert_eq!(rec.cached_tokens, 512 * *sh as u32, "{rec:?} shares {sh}");
                assert!(rec.cached_tokens < rec.prompt_tokens);
            }
            if rec.output_tokens > 1 {
                assert!(rec.tpot_s.unwrap() > 0.0);
            }
        }
        let s = report.summary();
        assert_eq!((s.requests, s.errors), (20, 0));
        assert!(s.prefix_hit_rate > 0.0 && s.prefix_hit_rate < 1.0);
        assert!(!report.kv.is_empty(), "KV samples from /metrics");
        let peak = s.peak_kv[&report.label];
        assert!(peak > 0.0 && peak <= 1.0, "peak {peak}");
    }
}

#[tokio::test]
async fn failures_are_recorded_not_fatal() {
    // Closed port: bind, read the port, close.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let req = |id: u64, body: &str| ReplayRequest {
        id,
        at_s: 0.0,
        body: Bytes::from(body.to_owned()),
        prompt_tokens: 1,
        output_tokens: 1,
    };
    let ok_body = format!(
        r#"{{"model":"{DEFAULT_MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let r = run(
        &[req(0, &ok_body)],
        &RunOptions::new(
            format!("http://127.0.0.1:{port}/v1/chat/completions"),
            "closed",
        ),
    )
    .await
    .unwrap();
    let rec = &r.records[0];
    assert_eq!(rec.status, 0);
    assert!(
        rec.error.as_deref().unwrap().starts_with("connection"),
        "{rec:?}"
    );
    assert_eq!(r.summary().errors, 1);

    // 400 from the simulator (invalid extension), next to a good request.
    let fleet = sim_fleet(1, f64::INFINITY).await;
    let url = format!("http://{}/v1/chat/completions", fleet.addr(0).unwrap());
    let bad = ok_body.replace(
        "\"max_tokens\":2",
        "\"max_tokens\":2,\"kvroute_sim\":{\"prompt_tokens\":0}",
    );
    let r = run(
        &[req(0, &bad), req(1, &ok_body)],
        &RunOptions::new(url, "sim"),
    )
    .await
    .unwrap();
    assert_eq!(r.records[0].status, 400);
    assert!(
        r.records[0]
            .error
            .as_deref()
            .unwrap()
            .starts_with("HTTP 400: "),
        "{:?}",
        r.records[0]
    );
    assert_eq!(
        (r.records[1].status, r.records[1].error.as_deref()),
        (200, None)
    );
    assert_eq!(r.records[1].output_tokens, 2);

    // A 200 that is not an SSE stream, and a stream cut before [DONE].
    let json = RecordingBackend::start("json", Reply::default())
        .await
        .unwrap();
    let r = run(
        &[req(0, &ok_body)],
        &RunOptions::new(
            format!("http://{}/v1/chat/completions", json.address()),
            "j",
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.records[0].status, 200);
    assert!(
        r.records[0]
            .error
            .as_deref()
            .unwrap()
            .contains("not an SSE stream"),
        "{:?}",
        r.records[0]
    );
    let cut = RecordingBackend::start(
        "cut",
        Reply::Sse {
            chunks: vec![
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n".into(),
            ],
            gap: Duration::ZERO,
        },
    )
    .await
    .unwrap();
    let r = run(
        &[req(0, &ok_body)],
        &RunOptions::new(format!("http://{}/v1/chat/completions", cut.address()), "c"),
    )
    .await
    .unwrap();
    assert_eq!(
        r.records[0].error.as_deref(),
        Some("stream ended without [DONE]")
    );
    assert!(r.records[0].ttft_s.is_some());

    // Timeout: a server that accepts and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            conns.push(s);
        }
    });
    let mut o = RunOptions::new(format!("http://{addr}/v1/chat/completions"), "t");
    o.timeout_s = 0.3;
    let r = run(&[req(0, &ok_body)], &o).await.unwrap();
    assert_eq!(r.records[0].error.as_deref(), Some("timeout after 0.300 s"));
    assert!(r.records[0].e2e_s >= 0.3);
    hold.abort();

    // Setup errors are errors.
    assert!(matches!(
        run(&[], &RunOptions::new("https://x/v1", "x")).await,
        Err(ReplayError::Option { option: "url", .. })
    ));
    let mut o = RunOptions::new("http://127.0.0.1:1/v1", "x");
    o.kv_sample = vec![KvSampleTarget {
        name: "a".into(),
        metrics_url: "http://127.0.0.1:1/metrics".into(),
        kind: "mystery".into(),
        slots_url: None,
    }];
    assert!(matches!(
        run(&[], &o).await,
        Err(ReplayError::Option {
            option: "kv_sample.kind",
            ..
        })
    ));
}

fn rec(
    id: u64,
    ttft: f64,
    e2e: f64,
    out: u32,
    prompt: u32,
    cached: u32,
    backend: &str,
) -> RequestRecord {
    RequestRecord {
        id,
        status: 200,
        error: None,
        backend: Some(backend.into()),
        sent_at_s: id as f64,
        started_at_s: id as f64 + 0.01,
        ttft_s: Some(ttft),
        tpot_s: Some((e2e - ttft) / f64::from(out - 1)),
        e2e_s: e2e,
        prompt_tokens: prompt,
        cached_tokens: cached,
        output_tokens: out,
    }
}

fn hand_report(label: &str) -> RunReport {
    // 10 successful requests: TTFT 0.1..=1.0 s, E2E = TTFT + 1 s, 11 tokens (TPOT 0.1 s),
    // 100 prompt tokens each with i·10 cached; 7 on "a", 3 on "b"; plus one failure.
    let mut records: Vec<RequestRecord> = (1..=10)
        .map(|i| {
            let t = f64::from(i) / 10.0;
            rec(
                u64::from(i),
                t,
                t + 1.0,
                11,
                100,
                i * 10,
                if i <= 7 { "a" } else { "b" },
            )
        })
        .collect();
    records.push(RequestRecord {
        id: 11,
        status: 503,
        error: Some("HTTP 503: overloaded".into()),
        backend: Some("b".into()),
        sent_at_s: 11.0,
        started_at_s: 11.0,
        ttft_s: None,
        tpot_s: None,
        e2e_s: 0.5,
        prompt_tokens: 0,
        cached_tokens: 0,
        output_tokens: 0,
    });
    RunReport {
        label: label.into(),
        records,
        kv: vec![
            KvSample {
                t_s: 0.0,
                backend: "a".into(),
                kv_usage: 0.25,
                running: 1,
                waiting: 0,
            },
            KvSample {
                t_s: 1.0,
                backend: "a".into(),
                kv_usage: 0.75,
                running: 2,
                waiting: 1,
            },
            KvSample {
                t_s: 1.0,
                backend: "b".into(),
                kv_usage: 0.5,
                running: 1,
                waiting: 0,
            },
            KvSample {
                t_s: 2.0,
                backend: "b".into(),
                kv_usage: 0.25,
                running: 0,
                waiting: 0,
            },
        ],
        wall_s: 11.0,
    }
}

#[test]
fn summary_math_is_exact() {
    assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.0);
    assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.99), 4.0);
    assert_eq!(percentile(&[], 0.5), 0.0);
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&hundred, 0.99), 99.0);
    assert_eq!(percentile(&hundred, 0.5), 50.0);
    let s = hand_report("kvroute").summary();
    assert_eq!((s.requests, s.errors), (11, 1));
    assert_eq!(s.ttft_p50_s, 0.5);
    assert_eq!(s.ttft_p99_s, 1.0);
    assert!((s.tpot_p50_s - 0.1).abs() < 1e-12);
    assert_eq!(s.e2e_p99_s, 2.0);
    // 10 × 11 tokens over 11 s.
    assert_eq!(s.output_tokens_per_s, 10.0);
    // Σ cached = 10·(1+…+10) = 550 of 1000.
    assert_eq!(s.prefix_hit_rate, 0.55);
    assert_eq!(
        s.backend_share,
        BTreeMap::from([("a".to_owned(), 0.7), ("b".to_owned(), 0.3)])
    );
    assert_eq!(
        s.peak_kv,
        BTreeMap::from([("a".to_owned(), 0.75), ("b".to_owned(), 0.5)])
    );
    let mut rr = hand_report("round_robin");
    for r in &mut rr.records {
        r.ttft_s = r.ttft_s.map(|t| t * 2.0);
    }
    let table = render_table(&[s, rr.summary()]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0], "| metric | kvroute | round_robin |");
    assert_eq!(lines[1], "|---|---|---|");
    assert!(lines.contains(&"| requests | 11 | 11 |"), "{table}");
    assert!(lines.contains(&"| errors | 1 | 1 |"), "{table}");
    assert!(
        lines.contains(&"| TTFT p50 | 0.500 s | 1.000 s (×2.00) |"),
        "{table}"
    );
    assert!(
        lines.contains(&"| prefix-cache hit rate | 55.0% | 55.0% (×1.00) |"),
        "{table}"
    );
    assert!(lines.contains(&"| share a | 70.0% | 70.0% |"), "{table}");
    assert!(lines.contains(&"| peak KV b | 50.0% | 50.0% |"), "{table}");
}

fn assert_json_close(a: &Value, b: &Value, path: &str) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
                "{path}: {x} vs {y}"
            );
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{path}");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert_json_close(p, q, &format!("{path}[{i}]"));
            }
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{path}"
            );
            for (k, p) in x {
                assert_json_close(p, &y[k], &format!("{path}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

/// Minimal SVG structure check: one root `<svg>` element with the namespace, closed at the
/// end, with at least `min_lines` data polylines of 2+ points and every label as text.
fn check_svg(path: &std::path::Path, labels: &[&str], min_lines: usize) {
    let s = std::fs::read_to_string(path).unwrap();
    assert!(
        s.starts_with("<svg ") && s.contains("xmlns=\"http://www.w3.org/2000/svg\""),
        "{}",
        path.display()
    );
    assert!(s.trim_end().ends_with("</svg>"));
    assert_eq!(s.matches("<svg").count(), 1);
    assert_eq!(s.matches("<text").count(), s.matches("</text>").count());
    let data_lines = s
        .split("<polyline")
        .skip(1)
        .filter(|p| p.contains("stroke-width=\"2\""))
        .filter(|p| {
            let pts = p
                .split("points=\"")
                .nth(1)
                .and_then(|x| x.split('"').next())
                .unwrap_or("");
            pts.split_whitespace().count() >= 2
        })
        .count();
    assert!(
        data_lines >= min_lines,
        "{}: {data_lines} data lines",
        path.display()
    );
    for l in labels {
        assert!(s.contains(l), "{} lacks {l}", path.display());
    }
}

#[test]
fn report_round_trips_and_plots_are_svg() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nested/out");
    let runs = vec![hand_report("kvroute"), hand_report("envoy rr")];
    let files = write_report(&out, &runs).unwrap();
    assert_eq!(files.json, out.join("report.json"));
    let back = read_report(&files.json).unwrap();
    // serde_json parses floats to within 1 ulp (no `float_roundtrip` feature): compare the
    // trees with a relative tolerance of 1e-12, everything else exactly.
    let want = serde_json::json!({"runs": runs, "summaries": runs.iter().map(RunReport::summary).collect::<Vec<_>>()});
    let got = serde_json::json!({"runs": back.runs, "summaries": back.summaries});
    assert_json_close(&got, &want, "$");
    assert_eq!(back.runs.len(), 2);
    assert_eq!(back.runs[1].label, "envoy rr");
    assert_eq!(
        back.runs[0].records[10].error.as_deref(),
        Some("HTTP 503: overloaded")
    );
    assert_eq!(
        files.plots,
        vec![
            out.join("ttft_cdf.svg"),
            out.join("kv_kvroute.svg"),
            out.join("kv_envoy_rr.svg")
        ]
    );
    check_svg(&files.plots[0], &["TTFT CDF", "kvroute", "envoy rr"], 2);
    check_svg(&files.plots[1], &["KV usage", "kvroute"], 2);
    // A run without KV samples still gets its (empty, titled) plot.
    let mut empty = hand_report("none");
    empty.kv.clear();
    let f = write_report(dir.path(), &[empty]).unwrap();
    check_svg(&f.plots[1], &["no KV samples"], 0);
    assert!(matches!(
        read_report(&dir.path().join("missing.json")),
        Err(ReplayError::File(TraceError::Io { .. }))
    ));
}

#[test]
fn kv_samples_come_from_kvroute_cp_adapters() {
    use kvroute_cp::adapters::ServerKind;
    use kvroute_tools::replay::kv::sample_from;
    let dir = kvroute_core::shared_data::dir().join("metrics");
    let vllm = std::fs::read_to_string(dir.join("vllm-v1-0.10-reconstructed.prom")).unwrap();
    let s = sample_from("r0", ServerKind::Vllm, 1.5, &vllm, None).unwrap();
    // vllm:kv_cache_usage_perc 0.4219, num_requests_running 24, num_requests_waiting 3.
    assert_eq!(
        s,
        KvSample {
            t_s: 1.5,
            backend: "r0".into(),
            kv_usage: 0.4219,
            running: 24,
            waiting: 3
        }
    );
    // llama.cpp: KV usage only from /slots (Σ cached tokens of busy slots / Σ n_ctx).
    let prom = std::fs::read_to_string(dir.join("llamacpp-server-b11434-real-busy.prom")).unwrap();
    let slots = std::fs::read(dir.join("llamacpp-server-b11434-real-busy.slots.json")).unwrap();
    let (used, total, _) = kvroute_cp::adapters::llamacpp::slots_usage(&slots).unwrap();
    let l = sample_from("l0", ServerKind::Llamacpp, 0.0, &prom, Some(&slots)).unwrap();
    assert_eq!((l.running, l.waiting), (4, 1));
    assert_eq!(l.kv_usage, used as f64 / total as f64);
    // Without /slots current llama.cpp has no KV signal: no sample.
    assert_eq!(
        sample_from("l0", ServerKind::Llamacpp, 0.0, &prom, None),
        None
    );
    // The wrong adapter finds no metrics: no sample, no panic.
    assert_eq!(sample_from("x", ServerKind::Sglang, 0.0, &vllm, None), None);
}

#[tokio::test]
async fn backend_header_and_llamacpp_cache_n_are_read() {
    let chunks = vec![
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"finish_reason\":\"stop\",\"delta\":{}}],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42},\"timings\":{\"cache_n\":32,\"prompt_n\":8}}\n\n".to_owned(),
        "data: [DONE]\n\n".to_owned(),
    ];
    let b = RecordingBackend::start(
        "llama-a",
        Reply::Sse {
            chunks,
            gap: Duration::from_millis(20),
        },
    )
    .await
    .unwrap();
    let mut o = RunOptions::new(format!("http://{}/v1/chat/completions", b.address()), "l");
    o.backend_header = Some("x-backend".into());
    let reqs = [ReplayRequest {
        id: 0,
        at_s: 0.0,
        body: Bytes::from_static(b"{}"),
        prompt_tokens: 40,
        output_tokens: 2,
    }];
    let r = run(&reqs, &o).await.unwrap();
    let rec = &r.records[0];
    assert_eq!(rec.error, None);
    assert_eq!(rec.backend.as_deref(), Some("llama-a"));
    assert_eq!(
        (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens),
        (40, 32, 2)
    );
    // First content chunk comes one gap after the role chunk; TPOT spans one more gap.
    let ttft = rec.ttft_s.unwrap();
    assert!(ttft >= 0.02 && ttft <= rec.e2e_s, "{rec:?}");
    assert!((rec.tpot_s.unwrap() - (rec.e2e_s - ttft)).abs() < 1e-12);
    let s = r.summary();
    assert_eq!(
        s.backend_share,
        BTreeMap::from([("llama-a".to_owned(), 1.0)])
    );
    assert_eq!(s.prefix_hit_rate, 0.8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_runs_prints_table_and_writes_files() {
    let fleet = sim_fleet(1, f64::INFINITY).await;
    let addr = fleet.addr(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let bin = env!("CARGO_BIN_EXE_kvroute-replay");
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "--trace",
        "azure",
        "--max-requests",
        "6",
        "--time-scale",
        "1000",
        "--max-output-tokens",
        "4",
        "--sim-extension",
        "--label",
        "cli",
        "--no-progress",
        "--url",
    ])
    .arg(format!("http://{addr}/v1/chat/completions"))
    .arg("--kv-sample")
    .arg(format!("r0=vllm@http://{addr}/metrics"))
    .arg("--out")
    .arg(&out)
    .kill_on_drop(true);
    let o = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("kvroute-replay finishes within 60 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("| metric | cli |"), "{stdout}");
    assert!(stdout.contains("| requests | 6 |"), "{stdout}");
    assert!(stdout.contains("| errors | 0 |"), "{stdout}");
    assert!(stdout.contains(&format!("report: {}", out.join("report.json").display())));
    let report = read_report(&out.join("report.json")).unwrap();
    assert_eq!(report.runs[0].records.len(), 6);
    assert!(report.runs[0].records.iter().all(|r| r.output_tokens == 4));
    assert!(out.join("ttft_cdf.svg").is_file() && out.join("kv_cli.svg").is_file());

    // Setup errors exit non-zero with a message; nothing is sent.
    let o = tokio::process::Command::new(bin)
        .args([
            "--trace",
            "mooncake",
            "--file",
            "/nonexistent/trace.jsonl",
            "--no-progress",
        ])
        .output()
        .await
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/trace.jsonl"));
}
