//! Smoke test of `make bench-overhead` (issue 13): every body size and every proxy (plain,
//! floor, kvroute) runs under wrk and reports, the filter routes every request by its policy
//! and reports `decision_us` and its Wasm memory. Not a timed assertion: one short run per
//! row on a shared machine says nothing about speed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

use kvroute_integration::harness::{wasm_path, workspace_root};
use kvroute_tools::overhead::{run, Options, VARIANTS};
use std::path::PathBuf;
use std::time::Duration;

#[tokio::test(flavor = "current_thread")]
async fn every_size_and_proxy_reports() {
    let kvroute_wasm = wasm_path();
    let floor_wasm = std::env::var_os("KVROUTE_FLOOR_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvroute_wasm.with_file_name("kvroute_floor_filter.wasm"));
    let sizes = vec![1024, 16 * 1024, 256 * 1024, 1024 * 1024];
    let opts = Options {
        sizes: sizes.clone(),
        reps: 1,
        duration: Duration::from_secs(1),
        connections: 2,
        wrk: std::env::var_os("WRK").map_or_else(|| PathBuf::from("wrk"), PathBuf::from),
        floor_wasm,
        kvroute_wasm,
        data: std::env::var_os("KVROUTE_SHARED_DATA")
            .map_or_else(|| workspace_root().join("../shared/data"), PathBuf::from),
        stream_events: 0,
        stream_gap: Duration::ZERO,
        plugin_config: None,
    };
    let report = run(&opts, |l| eprintln!("{l}")).await.unwrap();
    assert_eq!(report.rows.len(), sizes.len() * VARIANTS.len());
    for &size in &sizes {
        for v in VARIANTS {
            let r = report.row(size, v).unwrap();
            assert!(
                r.median.requests > 0 && r.median.rps > 0.0,
                "{size} {v}: {r:?}"
            );
            assert!(r.median.cpu_us > 0.0, "{size} {v}: no Envoy CPU time read");
            assert!(
                r.body_bytes.abs_diff(size) * 100 <= size,
                "{size}: body {}",
                r.body_bytes
            );
        }
    }
    assert_eq!(report.filter.len(), sizes.len());
    for (size, f) in &report.filter {
        let kv = report.row(*size, "kvroute").unwrap();
        assert_eq!(f.parse_errors, 0, "{size}");
        // Every request was routed by the policy (none failed open or fell back).
        assert!(f.routed >= kv.median.requests, "{size}: {f:?} vs {kv:?}");
        assert!(
            f.decision_p50_us.is_some() && f.decision_p99_us.is_some(),
            "{size}: {f:?}"
        );
        assert!(
            f.wasm_memory_bytes.unwrap_or(0) >= 1024 * 1024,
            "{size}: {f:?}"
        );
    }
    let md = report.markdown();
    assert_eq!(md.matches("| kvroute |").count(), sizes.len(), "{md}");
}
