//! Golden tests: every metrics fixture in `$KVROUTE_SHARED_DATA/metrics/` (default
//! `<workspace>/../shared/data/metrics`) parses to exactly these stats. Each expected value
//! names the fixture line it comes from.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_cp::adapters::{self, ServerKind, ServerStats};
use kvroute_cp::expo::Exposition;
use std::path::PathBuf;

fn metrics_dir() -> PathBuf {
    let base = kvroute_core::shared_data::dir();
    base.join("metrics")
}

fn read(name: &str) -> Vec<u8> {
    let p = metrics_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", p.display()))
}

fn stats(name: &str, slots: Option<&str>) -> ServerStats {
    let expo = Exposition::parse_bytes(&read(name)).unwrap();
    let slots = slots.map(read);
    adapters::extract(ServerKind::Auto, &expo, slots.as_deref()).unwrap()
}

fn close(a: Option<f64>, b: f64) {
    let a = a.expect("kv_usage should be known");
    assert!((a - b).abs() < 1e-12, "kv_usage {a} != {b}");
}

const FIXTURES: &[&str] = &[
    "llamacpp-server-b11434-real-busy.prom",
    "llamacpp-server-current-reconstructed.prom",
    "llamacpp-server-legacy-2024-reconstructed-from-docs.prom",
    "llm-d-inference-sim-reconstructed.prom",
    "sglang-docs-production_metrics.prom",
    "tgi-3.x-reconstructed.prom",
    "triton-trtllm-backend-readme-v1model.prom",
    "triton-trtllm-backend-readme.prom",
    "vllm-v0.7-aibrix-docs.prom",
    "vllm-v1-0.10-reconstructed.prom",
];

#[test]
fn every_fixture_is_covered() {
    let mut found: Vec<String> = std::fs::read_dir(metrics_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".prom"))
        .collect();
    found.sort();
    assert_eq!(
        found, FIXTURES,
        "a fixture was added or removed: add its golden test"
    );
}

#[test]
fn vllm_v1() {
    let s = stats("vllm-v1-0.10-reconstructed.prom", None);
    assert_eq!(s.kind, ServerKind::Vllm);
    close(s.kv_usage, 0.4219); // line 30 vllm:kv_cache_usage_perc{engine="0"} 0.4219
    assert_eq!(s.kv_capacity_tokens, Some(27_713 * 16)); // line 407 num_gpu_blocks="27713", block_size="16"
    assert_eq!(s.block_size, Some(16));
    assert_eq!(s.running, 24); // line 9
    assert_eq!(s.waiting, 3); // line 12
    assert_eq!(s.lora_adapters, Vec::<String>::new()); // no vllm:lora_requests_info
    assert_eq!(s.process_start_ms, Some(1_754_832_641_772)); // line 54 prompt_tokens_created 1.7548326417716122e+09 s
    assert_eq!(s.monotonic_total, Some(596_710.0 + 70_608.0)); // lines 51, 57
}

#[test]
fn vllm_v0() {
    let s = stats("vllm-v0.7-aibrix-docs.prom", None);
    assert_eq!(s.kind, ServerKind::Vllm);
    assert_eq!(s.kv_usage, Some(0.0)); // line 16 vllm:gpu_cache_usage_perc 0.0 (V0 name; a real 0, present)
    assert_eq!(s.kv_capacity_tokens, Some(81_767 * 16)); // line 4 num_gpu_blocks="81767" block_size="16"
    assert_eq!(s.block_size, Some(16));
    assert_eq!((s.running, s.waiting), (0, 0)); // lines 7, 13
    assert_eq!(s.lora_adapters, Vec::<String>::new()); // line 28: empty adapter lists
    assert_eq!(s.process_start_ms, None); // no process_start_time_seconds, no _created
    assert_eq!(s.monotonic_total, Some(148.0 + 955.0)); // lines 34, 37
}

#[test]
fn llmd_inference_sim() {
    let s = stats("llm-d-inference-sim-reconstructed.prom", None);
    assert_eq!(s.kind, ServerKind::LlmdSim);
    assert_eq!(s.kv_usage, Some(0.3125)); // line 64
    assert_eq!(s.kv_capacity_tokens, Some(1024 * 16)); // line 8
    assert_eq!(s.block_size, Some(16));
    assert_eq!((s.running, s.waiting), (3, 1)); // lines 85, 88
    assert_eq!(s.lora_adapters, Vec::<String>::new()); // line 67
    assert_eq!(s.process_start_ms, None);
    assert_eq!(s.monotonic_total, Some(4262.0 + 1733.0)); // lines 97, 37
}

#[test]
fn sglang() {
    let s = stats("sglang-docs-production_metrics.prom", None);
    assert_eq!(s.kind, ServerKind::Sglang);
    assert_eq!(s.kv_usage, Some(0.28)); // line 11 sglang:token_usage
    assert_eq!(s.kv_capacity_tokens, None); // no sglang:max_total_num_tokens in this release
    assert_eq!(s.block_size, None);
    assert_eq!((s.running, s.waiting), (162, 2826)); // lines 108, 117
    assert_eq!(s.monotonic_total, Some(8_128_902.0 + 7_557_572.0)); // lines 5, 8
}

#[test]
fn tgi() {
    let s = stats("tgi-3.x-reconstructed.prom", None);
    assert_eq!(s.kind, ServerKind::Tgi);
    close(s.kv_usage, 18_432.0 / 155_664.0); // line 29 / line 32 (derived; TGI has no KV gauge)
    assert_eq!(s.kv_capacity_tokens, Some(155_664)); // line 32 tgi_batch_max_total_tokens
    assert_eq!((s.running, s.waiting), (12, 4)); // lines 25, 21
    assert_eq!(s.monotonic_total, Some(123.0)); // line 9 tgi_request_count
}

#[test]
fn trtllm_prefers_used_over_max_to_fraction() {
    let s = stats("triton-trtllm-backend-readme.prom", None);
    assert_eq!(s.kind, ServerKind::Trtllm);
    // lines 20 and 22: used 1 / max 6239; the `fraction` 0.4875 on line 18 disagrees and is ignored.
    close(s.kv_usage, 1.0 / 6239.0);
    assert_eq!(s.kv_capacity_tokens, Some(6239 * 64)); // line 22 max × line 19 tokens_per
    assert_eq!(s.block_size, Some(64));
    assert_eq!((s.running, s.waiting), (0, 1)); // line 10 active, line 6 waiting
    assert_eq!(s.monotonic_total, Some(0.0)); // line 44 nv_inference_count
}

#[test]
fn trtllm_v1_model_has_no_kv_signal() {
    let s = stats("triton-trtllm-backend-readme-v1model.prom", None);
    assert_eq!(s.kind, ServerKind::Trtllm);
    assert_eq!(s.kv_usage, None);
    assert_eq!(s.kv_capacity_tokens, None);
    assert_eq!((s.running, s.waiting), (0, 0));
    assert_eq!(s.monotonic_total, None);
}

#[test]
fn llamacpp_real_capture_with_slots() {
    let s = stats(
        "llamacpp-server-b11434-real-busy.prom",
        Some("llamacpp-server-b11434-real-busy.slots.json"),
    );
    assert_eq!(s.kind, ServerKind::Llamacpp);
    // slots.json: 4 busy slots, n_ctx 1024 each; prompt + decoded = 55+12, 76+33, 77+34, 77+34.
    close(s.kv_usage, 398.0 / 4096.0);
    assert_eq!(s.kv_capacity_tokens, Some(4096));
    assert_eq!((s.running, s.waiting), (4, 1)); // lines 41, 44
    assert_eq!(s.monotonic_total, Some(184.0 + 21.0)); // lines 5, 14
}

#[test]
fn llamacpp_without_slots_is_unknown() {
    let s = stats("llamacpp-server-b11434-real-busy.prom", None);
    assert_eq!(s.kv_usage, None);
    assert_eq!(s.kv_capacity_tokens, None);
    let s = stats("llamacpp-server-current-reconstructed.prom", None);
    assert_eq!(s.kind, ServerKind::Llamacpp);
    assert_eq!(s.kv_usage, None); // current builds: no KV gauge
    assert_eq!((s.running, s.waiting), (2, 1)); // lines 36, 39
    assert_eq!(s.monotonic_total, Some(96_641.0 + 23_210.0)); // lines 9, 15
}

#[test]
fn llamacpp_legacy_gauge() {
    let s = stats(
        "llamacpp-server-legacy-2024-reconstructed-from-docs.prom",
        None,
    );
    assert_eq!(s.kind, ServerKind::Llamacpp);
    assert_eq!(s.kv_usage, Some(0.356445)); // line 29 llamacpp:kv_cache_usage_ratio
    assert_eq!(s.kv_capacity_tokens, None);
    assert_eq!((s.running, s.waiting), (2, 1)); // lines 35, 38
}

#[test]
fn explicit_kind_matches_auto_on_every_fixture() {
    for name in FIXTURES {
        let expo = Exposition::parse_bytes(&read(name)).unwrap();
        let auto = adapters::extract(ServerKind::Auto, &expo, None).unwrap();
        let explicit = adapters::extract(auto.kind, &expo, None).unwrap();
        assert_eq!(auto, explicit, "{name}");
        // The scrape path's filtered parse gives the same stats.
        let text = String::from_utf8(read(name)).unwrap();
        let filtered = Exposition::parse_with(&text, adapters::is_relevant).unwrap();
        assert!(filtered.samples.len() <= expo.samples.len(), "{name}");
        assert_eq!(
            adapters::extract(ServerKind::Auto, &filtered, None).unwrap(),
            auto,
            "{name}"
        );
    }
}
