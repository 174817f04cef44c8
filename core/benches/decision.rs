//! Criterion benchmark: one routing decision ([`Picker::pick`]) over 8, 64, 512 and 4,096
//! endpoints, for the default `hybrid` policy and `least_request` for comparison, plus the
//! full per-request path at 64 endpoints (analysis + prefix hashing + index lookup + pick).
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
    use kvroute_core::analysis::{analyze, ApiKind};
    use kvroute_core::estimate::Estimator;
    use kvroute_core::picker::*;
    use kvroute_core::prefix::{block_hashes, PrefixConfig, PrefixIndex};
    use kvroute_core::profile::builtin;
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
        let est = Estimator::default();
        let cfg = PrefixConfig::default();
        let profile = builtin("meta-llama/Llama-3.1-8B-Instruct").unwrap();
        let system = "You are a helpful assistant for Example Corp. ".repeat(40);
        let body = serde_json::json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "max_tokens": 256,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is the warranty?"}],
    })
    .to_string();
        let mut index = PrefixIndex::default();
        let a = analyze(ApiKind::ChatCompletions, body.as_bytes(), &est).unwrap();
        let h = block_hashes(
            "meta-llama/Llama-3.1-8B-Instruct",
            None,
            &a.prefix_text,
            &cfg,
        );
        for i in 0..8 {
            index.record(&format!("pool/pod-{i}"), &h);
        }
        let mut picker = Picker::new(PickerConfig::default(), 1).unwrap();
        c.bench_function("full_path/64_endpoints_2KiB_chat", |b| {
            b.iter(|| {
                let a =
                    analyze(ApiKind::ChatCompletions, black_box(body.as_bytes()), &est).unwrap();
                let model = a.model.as_deref().unwrap_or("");
                let hashes = block_hashes(model, a.cache_salt.as_deref(), &a.prefix_text, &cfg);
                let matches = index.match_snapshot(&hashes, &snap);
                let d = profile.demand(&a);
                let req = PickRequest {
                    model: a.model.as_deref(),
                    api: a.api,
                    prompt_tokens: a.prompt_tokens,
                    output_limit: u64::from(profile.output_limit(&a)),
                    demand_tokens: d.tokens,
                    prefix_blocks: hashes.len() as u32,
                };
                let input = PickInput {
                    snapshot: &snap,
                    inflight: &inflight,
                    prefix_match_blocks: &matches,
                    now_ms: NOW,
                };
                black_box(picker.pick(&input, &req))
            })
        });
    }

    criterion_group!(benches, bench_decision, bench_full_path);
}
