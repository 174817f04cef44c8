//! Criterion benchmark: request analysis ([`analyze`]) of chat bodies of 1 KiB, 16 KiB,
//! 256 KiB and 1 MiB, built from real ShareGPT prompts (`../shared/data/prompts/`) as
//! alternating user/assistant turns, side by side with the serde_json-based analyser it
//! replaced (`analyze_serde`, `core/tests/oracle/`), plus its parts on their own: the token
//! tally of the rendered text (`estimate_text`) and prefix hashing (`block_hashes`).
//!
//! Run: `make bench-core` (or `cargo bench -p kvroute-core --bench analysis`).
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
#[path = "../tests/oracle/mod.rs"]
mod oracle;

#[cfg(not(target_family = "wasm"))]
mod native {

    use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
    use kvroute_core::analysis::{analyze, ApiKind};
    use kvroute_core::estimate::Estimator;
    use kvroute_core::prefix::{block_hashes, PrefixConfig};
    use std::hint::black_box;

    fn prompts() -> Vec<String> {
        let dir = kvroute_core::shared_data::dir();
        let text = std::fs::read_to_string(
            dir.join("prompts/lmbenchmark_sharegpt_multiround_warmup.json"),
        )
        .expect("shared prompts (set KVROUTE_SHARED_DATA)");
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        v.as_array()
            .expect("array")
            .iter()
            .filter_map(|e| e["input"].as_str().map(str::to_string))
            .collect()
    }

    /// A chat body of about `size` bytes.
    fn body(size: usize, prompts: &[String]) -> String {
        let mut messages = Vec::new();
        let mut len = 0;
        let mut i = 0;
        while len < size {
            let p = &prompts[i % prompts.len()];
            let take = p.char_indices().nth(600).map_or(p.len(), |(b, _)| b);
            let text = &p[..take];
            len += text.len() + 40;
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(serde_json::json!({"role": role, "content": text}));
            i += 1;
        }
        serde_json::json!({"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 256, "temperature": 0.7, "messages": messages})
        .to_string()
    }

    fn bench_analysis(c: &mut Criterion) {
        let prompts = prompts();
        let est = Estimator::default();
        let cfg = PrefixConfig::default();
        let mut g = c.benchmark_group("analysis");
        for (label, size) in [
            ("1KiB", 1024usize),
            ("16KiB", 16 * 1024),
            ("256KiB", 256 * 1024),
            ("1MiB", 1024 * 1024),
        ] {
            let b = body(size, &prompts);
            g.throughput(Throughput::Bytes(b.len() as u64));
            g.bench_with_input(BenchmarkId::new("analyze", label), &b, |bench, b| {
                bench.iter(|| {
                    black_box(analyze(
                        ApiKind::ChatCompletions,
                        black_box(b.as_bytes()),
                        &est,
                    ))
                })
            });
            // The serde_json-based analyser this one replaced (the differential test's oracle).
            g.bench_with_input(BenchmarkId::new("analyze_serde", label), &b, |bench, b| {
                bench.iter(|| {
                    black_box(super::oracle::oracle_analyze(
                        ApiKind::ChatCompletions,
                        black_box(b.as_bytes()),
                        &est,
                    ))
                })
            });
            let a = analyze(ApiKind::ChatCompletions, b.as_bytes(), &est).unwrap();
            g.bench_with_input(
                BenchmarkId::new("estimate_text", label),
                &a.prefix_text,
                |bench, t| bench.iter(|| black_box(est.estimate_text(black_box(t)))),
            );
            g.bench_with_input(
                BenchmarkId::new("block_hashes", label),
                &a.prefix_text,
                |bench, t| {
                    bench.iter(|| {
                        black_box(block_hashes(
                            "meta-llama/Llama-3.1-8B-Instruct",
                            None,
                            black_box(t),
                            &cfg,
                        ))
                    })
                },
            );
        }
        g.finish();
    }

    criterion_group!(benches, bench_analysis);
}
