//! The filter and the routing benchmark run one decision pipeline
//! (`kvroute_core::router::Router`): fed the same snapshots, in-flight reservations and
//! bodies, the filter's `Worker` (through the mock host and proxy-wasm shared data) and the
//! benchmark's kvroute router (`routebench::kvroute_router`, over its own `InflightTable`)
//! pick the same endpoint, fallbacks, reservation and pending prefill, request by request.
//!
//! Inputs: every request body in `$KVROUTE_SHARED_DATA/requests/`, one malformed body, and
//! the first 300 rows of
//! the Mooncake conversation trace (FAST'25) as the replay sends them
//! (`replay::load_workload`: text synthesised from `hash_ids`, `max_tokens` = output), over
//! a fleet of 6 endpoints whose stats change every 25 requests, with reservations released
//! as requests finish.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

use std::path::PathBuf;

use kvroute_core::inflight::InflightTable;
use kvroute_core::picker::PolicyKind;
use kvroute_core::plugin_config::Config;
use kvroute_core::router::Outcome;
use kvroute_core::shared_data::dir as shared_data_dir;
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_filter::host::mock::MockHost;
use kvroute_filter::router::{Decision, Held, Worker};
use kvroute_filter::shared;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_tools::replay::workload::load_workload;
use kvroute_tools::replay::{TraceSource, WorkloadOptions};
use kvroute_tools::routebench::{kvroute_router, BenchConfig};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SEED: u64 = 11;
const T0: u64 = 1_000_000;
const TTL: u64 = 600_000;

fn fleet(version: u64, now: u64, rng: &mut fastrand::Rng) -> Snapshot {
    let eps = (0..6)
        .map(|i| EndpointStats {
            id: format!("pool/e{i}"),
            address: format!("10.0.0.{i}:8000"),
            cluster: format!("c{i}"),
            pool: "pool".into(),
            models: vec![MODEL.into()],
            lora_adapters: vec![],
            kv_usage: Some(rng.f64() * 0.8),
            kv_capacity_tokens: Some(200_000),
            block_size: Some(16),
            running: rng.u32(0..16),
            waiting: rng.u32(0..4),
            healthy: true,
            // One endpoint's stats are sometimes stale.
            scraped_at_ms: if i == 5 && version.is_multiple_of(3) {
                now.saturating_sub(5_000)
            } else {
                now.saturating_sub(u64::from(rng.u32(0..500)))
            },
            process_start_ms: Some(if i == 2 && version >= 8 { 2 } else { 1 }),
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        })
        .collect();
    Snapshot::new(version, now, eps)
}

fn bodies() -> Vec<(String, Vec<u8>)> {
    let dir = shared_data_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("requests"))
        .expect("shared data requests/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 20, "{} request files", files.len());
    let mut out = Vec::new();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let path = if name.contains("completions_") {
            "/v1/completions"
        } else if name.contains("embeddings") {
            "/v1/embeddings"
        } else if name.contains("responses") {
            "/v1/responses"
        } else if name.contains("tgi") {
            "/generate"
        } else {
            "/v1/chat/completions"
        };
        out.push((path.to_owned(), std::fs::read(f).unwrap()));
    }
    // A malformed body: both route it by load alone.
    out.push(("/v1/chat/completions".into(), br#"{"model":"#.to_vec()));
    let mut w = WorkloadOptions::new(TraceSource::Mooncake(
        dir.join("traces/mooncake_conversation_trace.jsonl"),
    ));
    w.max_requests = Some(300);
    w.model = MODEL.into();
    for r in load_workload(&w).expect("Mooncake slice") {
        out.push(("/v1/chat/completions".into(), r.body.to_vec()));
    }
    out
}

#[test]
fn filter_and_benchmark_pick_identically() {
    let replica = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, 1.0, 0).expect("replica config");
    let engine = replica.engine;
    let cfg = BenchConfig::new(6, 1.0, SEED, MODEL);
    let mut bench = kvroute_router(PolicyKind::Hybrid, &engine, &cfg).expect("bench router");
    // The filter configured as the benchmark configures the core router.
    let blocks = u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size) / 512;
    let filter_cfg = format!(r#"{{"prefix_index_blocks":{blocks}}}"#);
    let mut worker = Worker::new(Config::parse(filter_cfg.as_bytes()).unwrap(), SEED).unwrap();
    let host = MockHost::new(T0);
    shared::ensure_keys(&host).unwrap();
    let mut table = InflightTable::new(kvroute_core::inflight::DEFAULT_MAX_ENTRIES);

    let mut rng = fastrand::Rng::with_seed(5);
    let mut snap = fleet(1, T0, &mut rng);
    shared::publish_snapshot(&host, &snap.encode()).unwrap();
    let mut live: Vec<(Held, u64)> = Vec::new();
    let (mut routed, mut load_only, mut changed_endpoint, mut no_endpoints) = (0, 0, 0, 0);
    let mut last: Option<String> = None;
    for (i, (path, body)) in bodies().iter().enumerate() {
        let now = T0 + 40 * i as u64;
        *host.now.borrow_mut() = now;
        if i % 25 == 24 {
            snap = fleet(snap.version + 1, now, &mut rng);
            shared::publish_snapshot(&host, &snap.encode()).unwrap();
        }
        // Requests finish in arrival order, three at a time, after the first ten.
        if i >= 10 && i % 3 == 0 {
            for (held, bench_id) in live.drain(..3.min(live.len())) {
                worker.release(&held);
                table.release(bench_id);
            }
        }
        let f = worker.decide(&host, path, Some(body), now);
        let b = bench.route(&snap, &table, path, Some(body), now);
        match (f, b.outcome) {
            (Decision::Route(mut f), Outcome::Route(b)) => {
                assert_eq!(f.route, b, "request {i} ({path})");
                let held = worker.apply_route(&host, &mut f);
                let id = i as u64 + 1;
                table.reserve_with_prefill(
                    id,
                    &b.endpoint,
                    b.reserve_tokens,
                    b.prefill_tokens,
                    now,
                    TTL,
                );
                live.push((held, id));
                routed += 1;
                if last.as_deref() != Some(b.endpoint.as_str()) {
                    changed_endpoint += 1;
                }
                last = Some(b.endpoint.clone());
            }
            (Decision::NoEndpoints(a), Outcome::NoEndpoints(b)) if a == b => no_endpoints += 1,
            (Decision::UnknownModel(a), Outcome::UnknownModel(b)) if a == b => no_endpoints += 1,
            (f, b) => panic!("request {i} ({path}): filter {f:?}, benchmark {b:?}"),
        }
        if !matches!(b.basis, kvroute_core::router::Basis::Body) {
            load_only += 1;
        }
        // Both hold the same load per endpoint: the worker's own table (a single worker:
        // there are no others to count) is what the filter's next decision sees.
        assert_eq!(
            worker.inflight().own().totals(now),
            table.totals(now),
            "request {i}"
        );
    }
    // The inputs exercised the pipeline: bodies and load-only ones, several endpoints.
    assert!(routed > 300, "{routed}");
    assert!(load_only >= 2, "{load_only}");
    assert!(changed_endpoint > 10, "{changed_endpoint}");
    eprintln!("routed {routed}, load-only {load_only}, no endpoints {no_endpoints}");
}
