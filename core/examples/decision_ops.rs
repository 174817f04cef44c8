//! The decision alone, for counting its Wasm operations (`make bench-decision-ops`,
//! `scripts/wasm-ops.py`; method in docs/overhead.md).
//!
//! ```text
//! decision_ops route|analysis|time N BODY.json
//! ```
//! Runs [`Router::route`] (or only the request analysis) `N` times on the chat body in
//! `BODY.json`, over the overhead benchmark's fleet: 16 healthy endpoints serving its
//! model, KV usage 10..40 %, a fresh snapshot, an empty in-flight table. Built for
//! `wasm32-wasip1` and run under Wasmtime with fuel metering, runs of N = 1 and N = 3 give
//! the operations of one decision as their difference halved (start-up and file reading
//! cancel out). Exits 1 when a decision does not route (a changed fleet or body would
//! otherwise count the cheap "no endpoint" path) or on a bad argument.
//!
//! `time` is the native timing of the same decision (docs/overhead.md, "Outside Wasm"):
//! 15 rounds of `N` [`Router::route`] calls after one untimed round, printing the body's
//! size and the median round's nanoseconds per decision. Wall time, so it moves with the
//! machine's load: compare builds in one run, alternating them.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line tool

use kvroute_core::analysis::{analyze_bounded, ApiKind};
use kvroute_core::inflight::InflightTable;
use kvroute_core::router::{Outcome, Router, RouterConfig};
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use std::hint::black_box;
use std::process::ExitCode;

/// The overhead benchmark's model (`kvroute_tools::overhead::MODEL`).
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// Snapshot time and decision time, Unix ms (the snapshot is always fresh).
const NOW_MS: u64 = 1_000_000;
/// Timed rounds of `time` (an odd number: the median is one of them).
const ROUNDS: usize = 15;

fn fleet() -> Snapshot {
    let endpoints = (0..16u32)
        .map(|i| EndpointStats {
            id: format!("pool/e{i}"),
            address: "127.0.0.1:8000".into(),
            cluster: format!("c{i}"),
            pool: "pool".into(),
            models: vec![MODEL.into()],
            lora_adapters: vec![],
            kv_usage: Some(0.1 + 0.02 * f64::from(i)),
            kv_capacity_tokens: Some(4_000_000),
            block_size: Some(16),
            running: 1,
            waiting: 0,
            healthy: true,
            scraped_at_ms: NOW_MS,
            process_start_ms: None,
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        })
        .collect();
    Snapshot::new(1, NOW_MS, endpoints)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(mode), Some(Ok(n)), Some(path)) = (
        args.get(1),
        args.get(2).map(|n| n.parse::<usize>()),
        args.get(3),
    ) else {
        eprintln!("usage: decision_ops route|analysis|time N BODY.json");
        return ExitCode::FAILURE;
    };
    let body = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("decision_ops: {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(mut router) = Router::new(RouterConfig::default(), 1) else {
        return ExitCode::FAILURE;
    };
    let snapshot = fleet();
    let table = InflightTable::new(4096);
    let prefix_limit = RouterConfig::default().prefix.max_bytes();
    if mode == "time" {
        let mut route = || {
            let d = router.route(
                &snapshot,
                &table,
                "/v1/chat/completions",
                Some(black_box(&body)),
                NOW_MS,
            );
            matches!(d.outcome, Outcome::Route(_))
        };
        let mut rounds = Vec::with_capacity(ROUNDS);
        for round in 0..=ROUNDS {
            let start = std::time::Instant::now();
            let routed = (0..n).filter(|_| route()).count();
            let ns = start.elapsed().as_nanos() / n.max(1) as u128;
            if routed != n {
                eprintln!("decision_ops: {path}: the decision did not route");
                return ExitCode::FAILURE;
            }
            // Round 0 warms the caches and the prefix index.
            if round > 0 {
                rounds.push(ns);
            }
        }
        rounds.sort_unstable();
        let median = rounds.get(ROUNDS / 2).copied().unwrap_or_default();
        println!("{} {median}", body.len());
        return ExitCode::SUCCESS;
    }
    for _ in 0..n {
        let ok = match mode.as_str() {
            "route" => matches!(
                router
                    .route(
                        &snapshot,
                        &table,
                        "/v1/chat/completions",
                        Some(black_box(&body)),
                        NOW_MS
                    )
                    .outcome,
                Outcome::Route(_)
            ),
            "analysis" => analyze_bounded(
                ApiKind::ChatCompletions,
                black_box(&body),
                router.estimator(),
                prefix_limit,
            )
            .is_ok(),
            _ => {
                eprintln!("decision_ops: mode must be route or analysis, not {mode}");
                return ExitCode::FAILURE;
            }
        };
        if !ok {
            let what = if mode == "route" {
                "the decision did not route (a body for another model, or one that does not parse?)"
            } else {
                "the body does not parse as a chat completion"
            };
            eprintln!("decision_ops: {path}: {what}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
