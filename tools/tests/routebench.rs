//! Routing benchmark replay on slices of the real Mooncake conversation trace (shared data,
//! kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`): block-hash
//! chaining, router names, the staleness model (snapshots every scrape interval plus a
//! push delay; reservations immediate), and what the filter-text view of a row shows the
//! router.

#![allow(clippy::panic)] // test code: fail loudly

use std::collections::HashMap;
use std::path::PathBuf;

use kvroute_core::analysis::ApiKind;
use kvroute_core::inflight::InflightTable;
use kvroute_core::picker::PolicyKind;
use kvroute_core::profile::builtin;
use kvroute_core::router::{Outcome, RequestInfo};
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_sim::trace::TraceRow;
use kvroute_tools::replay::workload::mooncake_sim_body;
use kvroute_tools::routebench::workers::WorkerModel;
use kvroute_tools::routebench::workload::TraceKind;
use kvroute_tools::routebench::{
    chain_ids, kvroute_router, run_router, BenchConfig, PrefixView, RouterKind,
};

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

/// 40 identical, unrelated requests in the same millisecond.
fn burst() -> Vec<TraceRow> {
    (0..40u64)
        .map(|i| TraceRow {
            timestamp: 0,
            input_length: 1000,
            output_length: 10,
            hash_ids: vec![1_000 + i],
        })
        .collect()
}

#[test]
fn a_burst_is_spread_by_immediate_reservations_not_by_the_snapshot() {
    let (_, engine) = setup(0).expect("built-in model");
    // 40 identical, unrelated requests in the same millisecond: no scrape can happen between
    // them, so only router-local state (kvroute's reservations, in-flight counts) moves.
    let burst = burst();
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
fn workers_spread_a_burst_only_as_far_as_they_share_their_reservations() {
    let (_, engine) = setup(0).expect("built-in model");
    // The same burst on 4 filter workers: a worker sees its own reservations at once and the
    // others' only once published and read. Shared at every request (0 ms), the burst is
    // spread as by one router; shared every 20 ms (the filter's default), the workers'
    // decisions within the millisecond pile up.
    let burst = burst();
    let on = |share_ms| BenchConfig {
        workers: WorkerModel {
            count: 4,
            inflight_share_ms: share_ms,
            ..WorkerModel::default()
        },
        ..BenchConfig::new(4, 1.0, 3, MODEL)
    };
    let kind = RouterKind::kvroute_default();
    let every_request = run_router(&burst, &engine, &on(0), kind);
    assert_eq!(every_request.per_replica, vec![10; 4]);
    let interval = run_router(&burst, &engine, &on(20), kind);
    assert_eq!(interval.finished, 40);
    assert_ne!(interval.per_replica, vec![10; 4]);
}

#[test]
fn workers_share_prefix_affinity_through_the_journal() {
    let (rows, engine) = setup(600).expect("shared Mooncake trace and built-in model");
    // 4 filter workers, each request on a random one: without the affinity journal each
    // worker's prefix index knows a quarter of the routed prefixes, and the prefix-cache
    // hit rate falls (0.119 with the journal, 0.055 without; one router: 0.116).
    let on = |journals| BenchConfig {
        time_compression: 2.0,
        workers: WorkerModel {
            count: 4,
            journals,
            ..WorkerModel::default()
        },
        ..BenchConfig::new(8, 2.0, 1, MODEL)
    };
    let kind = RouterKind::kvroute_default();
    let shared = run_router(&rows, &engine, &on(true), kind);
    let alone = run_router(&rows, &engine, &on(false), kind);
    assert_eq!((shared.finished, alone.finished), (600, 600));
    assert!(
        shared.prefix_hit_ratio > 1.5 * alone.prefix_hit_ratio,
        "journal {} vs none {}",
        shared.prefix_hit_ratio,
        alone.prefix_hit_ratio
    );
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

fn one_endpoint(now_ms: u64) -> Snapshot {
    let e = EndpointStats {
        id: "pool/e0".into(),
        address: "10.0.0.1:8000".into(),
        cluster: "c0".into(),
        pool: "pool".into(),
        models: vec![MODEL.into()],
        lora_adapters: vec![],
        kv_usage: Some(0.1),
        kv_capacity_tokens: Some(500_000),
        block_size: Some(16),
        running: 0,
        waiting: 0,
        healthy: true,
        scraped_at_ms: now_ms,
        process_start_ms: Some(1),
        peer_inflight_requests: 0,
        peer_inflight_tokens: 0,
    };
    Snapshot::new(1, now_ms, vec![e])
}

/// What `PrefixView::FilterText` models, and why the online hit rate differs from the
/// trace-id view: the filter hashes only the first 16 KiB of text (256 blocks of 64
/// characters), so a row sharing its first five 512-token Mooncake blocks (5 × 3,584 =
/// 17,920 bytes) with an earlier row looks wholly cached to it, where the trace's ids show
/// 5 of 20 blocks shared; a row sharing four blocks (14,336 bytes) matches up to the end of
/// the fourth block's text.
#[test]
fn the_filter_view_credits_a_long_shared_head_as_a_full_match() {
    let (_, engine) = setup(0).expect("built-in model");
    let cfg = BenchConfig {
        prefix_view: PrefixView::FilterText,
        ..BenchConfig::new(1, 1.0, 3, MODEL)
    };
    let row =
        |head: u64, tail: u64| -> Vec<u64> { (1..=head).chain(tail..tail + (20 - head)).collect() };
    let (a, b, c) = (row(5, 100), row(5, 200), row(4, 300));
    let now = 1_000_000;
    let snap = one_endpoint(now);
    let table = InflightTable::new(16);
    let input = 20 * 512;
    let mut cache = HashMap::new();
    let mut filter = kvroute_router(PolicyKind::Hybrid, &engine, &cfg).expect("router");
    let mut route = |ids: &[u64], row: u64| {
        let body = mooncake_sim_body(MODEL, ids, input, 100, (3, row), &mut cache);
        match filter
            .route(&snap, &table, "/v1/chat/completions", Some(&body), now)
            .outcome
        {
            Outcome::Route(r) => r,
            other => panic!("{other:?}"),
        }
    };
    let first = route(&a, 0);
    assert_eq!((first.prefix_blocks, first.prefix_match_blocks), (256, 0));
    let full = route(&b, 1);
    assert_eq!((full.prefix_blocks, full.prefix_match_blocks), (256, 256));
    assert_eq!(full.prefill_tokens, 0, "the filter expects all of b cached");
    // Four shared blocks: 14,336 bytes of content after the same chat rendering (shorter
    // than one block), so the first 14,336 / 64 = 224 blocks are identical and block 224
    // holds the first differing byte.
    let four = route(&c, 2);
    assert_eq!(four.prefix_match_blocks, 224);

    // The trace-id view of the same rows: 5 of 20 blocks matched, 15/20 of the prompt to
    // prefill.
    let ids_cfg = BenchConfig::new(1, 1.0, 3, MODEL);
    let mut by_ids = kvroute_router(PolicyKind::Hybrid, &engine, &ids_cfg).expect("router");
    let mut route_ids = |ids: &[u64]| {
        let info = RequestInfo {
            api: ApiKind::Completions,
            model: Some(MODEL.into()),
            prompt_tokens: u64::from(input),
            prompt_tokens_exact: true,
            max_output_tokens: None,
            n: 1,
            priority: 0,
            stream: true,
            prefix_hashes: chain_ids(ids),
        };
        match by_ids.route_request(&snap, &table, &info, now).outcome {
            Outcome::Route(r) => r,
            other => panic!("{other:?}"),
        }
    };
    route_ids(&a);
    let partial = route_ids(&b);
    assert_eq!(
        (partial.prefix_blocks, partial.prefix_match_blocks),
        (20, 5)
    );
    assert_eq!(partial.prefill_tokens, u64::from(input) * 15 / 20);
}
