//! Routing benchmark replay on slices of the real Mooncake conversation trace (shared data,
//! kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`): block-hash
//! chaining, router names, and the staleness model (snapshots every scrape interval plus a
//! push delay; reservations immediate).

use std::path::PathBuf;

use kvroute_core::profile::builtin;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_sim::trace::TraceRow;
use kvroute_tools::routebench::workload::TraceKind;
use kvroute_tools::routebench::{chain_ids, run_router, BenchConfig, RouterKind};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn data_dir() -> PathBuf {
    kvroute_core::shared_data::dir()
}

fn setup(n: usize) -> Result<(Vec<TraceRow>, EngineConfig), Box<dyn std::error::Error>> {
    let mut rows = TraceKind::Mooncake.load(&data_dir(), 1)?;
    rows.truncate(n);
    let model = builtin(MODEL).ok_or("built-in model missing")?;
    let replica = ReplicaConfig::for_model(model, Dialect::VllmV1, 1.0, 0)?;
    Ok((rows, replica.engine))
}

#[test]
fn chain_ids_are_prefix_chained() {
    let a = chain_ids(&[0, 1, 2]);
    let b = chain_ids(&[0, 1, 3]);
    let c = chain_ids(&[5, 1, 2]);
    assert_eq!(a.len(), 3);
    assert_eq!(a[..2], b[..2]);
    assert_ne!(a[2], b[2]);
    // Same id after a different prefix is a different block.
    assert_ne!(a[1], c[1]);
    assert_ne!(a[2], c[2]);
    assert!(chain_ids(&[]).is_empty());
}

#[test]
fn router_names_round_trip() {
    let names: Vec<&str> = RouterKind::all().iter().map(|k| k.name()).collect();
    assert_eq!(
        names,
        [
            "round_robin",
            "least_request",
            "llmd-epp",
            "llmd-guide",
            "sglang-cache-aware",
            "dynamo-kv",
            "oracle",
            "kvroute-predicted_ttft",
            "kvroute-hybrid"
        ]
    );
    for k in RouterKind::all() {
        assert_eq!(RouterKind::from_name(k.name()), Some(k));
    }
    assert_eq!(RouterKind::from_name("nope"), None);
    assert_eq!(
        RouterKind::all().iter().filter(|k| k.is_baseline()).count(),
        6
    );
}

#[test]
fn a_burst_is_spread_by_immediate_reservations_not_by_the_snapshot() {
    let (_, engine) = setup(0).expect("built-in model");
    // 40 identical, unrelated requests in the same millisecond: no scrape can happen between
    // them, so only router-local state (kvroute's reservations, in-flight counts) moves.
    let burst: Vec<TraceRow> = (0..40u64)
        .map(|i| TraceRow {
            timestamp: 0,
            input_length: 1000,
            output_length: 10,
            hash_ids: vec![1_000 + i],
        })
        .collect();
    let cfg = BenchConfig::new(4, 1.0, 3, MODEL);
    for kind in [
        RouterKind::kvroute_default(),
        RouterKind::LeastRequest,
        RouterKind::SglangCacheAware,
        RouterKind::RoundRobin,
    ] {
        let r = run_router(&burst, &engine, &cfg, kind);
        assert_eq!(r.finished, 40, "{}", r.router);
        assert_eq!(r.per_replica, vec![10; 4], "{}", r.router);
    }
}

#[test]
fn push_delay_is_applied() {
    let (rows, engine) = setup(160).expect("shared Mooncake trace and built-in model");
    // A push delay longer than the scrape interval (snapshots queue up in transit) still
    // serves everything, and the later snapshots change llm-d's decisions.
    let slow = BenchConfig {
        push_delay_ms: 700,
        ..BenchConfig::new(4, 1.0, 3, MODEL)
    };
    let fast = BenchConfig::new(4, 1.0, 3, MODEL);
    let a = run_router(&rows, &engine, &slow, RouterKind::LlmdEpp);
    let b = run_router(&rows, &engine, &fast, RouterKind::LlmdEpp);
    assert_eq!((a.finished, b.finished), (160, 160));
    assert_ne!(a.per_replica, b.per_replica);
}
