//! Criterion benchmark: one routing decision ([`Picker::pick`]) over 8, 64, 512 and 4,096
//! endpoints, for the default `hybrid` policy and `least_request` for comparison, plus the
//! full per-request path at 64 endpoints through the one pipeline the filter runs,
//! [`kvroute_core::router::Router::route`] (analysis + demand + prefix hashing + index
//! lookup + in-flight totals + pick + index record).
//!
//! Run: `make bench-core` (or `cargo bench -p kvroute-core --bench decision`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

// criterion (a native-only dev-dependency) does not build for wasm32; there this bench is an
// empty binary so that `cargo clippy --all-targets --target wasm32-wasip1` covers the crate.
#[cfg(target_family = "wasm")]
fn main() {}

#[cfg(not(target_family = "wasm"))]
fn main() {
    native::benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}

#[cfg(not(target_family = "wasm"))]
mod native {

    use criterion::{criterion_group, BenchmarkId, Criterion};
    use kvroute_core::analysis::ApiKind;
    use kvroute_core::inflight::InflightTable;
    use kvroute_core::picker::*;
    use kvroute_core::router::{Router, RouterConfig};
    use kvroute_core::snapshot::{EndpointStats, Snapshot};
    use std::hint::black_box;

    const NOW: u64 = 1_000_000;

    fn fleet(n: usize) -> (Snapshot, Vec<InFlight>, Vec<u32>) {
        let mut rng = fastrand::Rng::with_seed(42);
        let eps = (0..n)
            .map(|i| EndpointStats {
                id: format!("pool/pod-{i}"),
                address: format!("10.0.{}.{}:8000", i / 250, i % 250),
                cluster: format!("pod-{i}"),
                pool: "default".into(),
                models: vec!["meta-llama/Llama-3.1-8B-Instruct".into()],
                lora_adapters: vec![],
                kv_usage: Some(rng.f64() * 0.9),
                kv_capacity_tokens: Some(500_000),
                block_size: Some(16),
                running: rng.u32(0..64),
                waiting: rng.u32(0..8),
                healthy: rng.u32(0..50) != 0,
                scraped_at_ms: NOW - u64::from(rng.u32(0..1500)),
                process_start_ms: Some(1),
                peer_inflight_requests: 0,
                peer_inflight_tokens: 0,
            })
            .collect();
        let inflight = (0..n)
            .map(|_| InFlight {
                prefill_tokens: 0,
                requests: rng.u32(0..8),
                tokens: u64::from(rng.u32(0..20_000)),
            })
            .collect();
        let prefix = (0..n).map(|_| rng.u32(0..40)).collect();
        (Snapshot::new(1, NOW, eps), inflight, prefix)
    }

    fn bench_decision(c: &mut Criterion) {
        let mut g = c.benchmark_group("decision");
        for n in [8usize, 64, 512, 4096] {
            let (snap, inflight, prefix) = fleet(n);
            let req = PickRequest {
                model: Some("meta-llama/Llama-3.1-8B-Instruct"),
                api: ApiKind::ChatCompletions,
                prompt_tokens: 1200,
                output_limit: 256,
                demand_tokens: 1328,
                prefix_blocks: 40,
            };
            for policy in [PolicyKind::Hybrid, PolicyKind::LeastRequest] {
                let mut picker = Picker::new(
                    PickerConfig {
                        policy,
                        ..PickerConfig::default()
                    },
                    1,
                )
                .unwrap();
                g.bench_with_input(BenchmarkId::new(policy.name(), n), &n, |b, _| {
                    b.iter(|| {
                        let input = PickInput {
                            snapshot: &snap,
                            inflight: &inflight,
                            prefix_match_blocks: &prefix,
                            now_ms: NOW,
                        };
                        black_box(picker.pick(black_box(&input), black_box(&req)))
                    })
                });
            }
        }
        g.finish();
    }

    fn bench_full_path(c: &mut Criterion) {
        let (snap, inflight, _) = fleet(64);
        let mut table = InflightTable::new(4096);
        let mut id = 0;
        for (e, f) in snap.endpoints.iter().zip(&inflight) {
            for _ in 0..f.requests {
                id += 1;
                let t = f.tokens / u64::from(f.requests.max(1));
                table.reserve_with_prefill(id, &e.id, t, t / 2, NOW, 600_000);
            }
        }
        let system = "You are a helpful assistant for Example Corp. ".repeat(40);
        let body = serde_json::json!({
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "max_tokens": 256,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is the warranty?"}],
        })
        .to_string();
        let mut router = Router::new(RouterConfig::default(), 1).unwrap();
        let path = "/v1/chat/completions";
        // Warm the prefix index: the shared system prompt was sent to 8 endpoints before.
        for i in 0..8 {
            let only = Snapshot::new(0, NOW, vec![snap.endpoints[i].clone()]);
            router.route(&only, &table, path, Some(body.as_bytes()), NOW);
        }
        c.bench_function("full_path/64_endpoints_2KiB_chat", |b| {
            b.iter(|| {
                black_box(router.route(&snap, &table, path, Some(black_box(body.as_bytes())), NOW))
            })
        });
    }

    /// What a request paid for one in-flight table shared by every worker (decode at the
    /// decision, reserve, encode for the CAS write: the filter before 2026-12-02) against
    /// what it pays for its worker's own table (reserve, release in memory), by the number
    /// of reservations in flight. Host calls excluded (docs/overhead.md, "Tenth change").
    fn bench_inflight(c: &mut Criterion) {
        let (snap, _, _) = fleet(16);
        let mut g = c.benchmark_group("inflight");
        for n in [8u64, 128, 1024] {
            let mut table = InflightTable::new(65_536);
            for id in 0..n {
                let e = &snap.endpoints[(id % 16) as usize].id;
                table.reserve_with_prefill(id, e, 900, 300, NOW, 600_000);
            }
            let bytes = table.encode();
            let e = snap.endpoints[3].id.clone();
            g.bench_function(format!("shared_round_trip/{n}_in_flight"), |b| {
                b.iter(|| {
                    let mut t = InflightTable::decode(black_box(&bytes)).unwrap_or_default();
                    t.reserve_with_prefill(u64::MAX, &e, 900, 300, NOW, 600_000);
                    black_box(t.encode())
                })
            });
            g.bench_function(format!("own_table/{n}_in_flight"), |b| {
                b.iter(|| {
                    table.reserve_with_prefill(u64::MAX, &e, 900, 300, NOW, 600_000);
                    black_box(table.release(black_box(u64::MAX)))
                })
            });
        }
        g.finish();
    }

    criterion_group!(benches, bench_decision, bench_full_path, bench_inflight);
}
