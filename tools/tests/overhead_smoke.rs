//! Smoke test of `make bench-overhead` (issue 13): every body size and every proxy (plain,
//! floor, kvroute) runs under wrk and reports, the filter routes every request by its policy
//! and reports `decision_us` and its Wasm memory. Not a timed assertion: one short run per
//! row on a shared machine says nothing about speed.
//!
//! With `KVROUTE_DYNMOD` (a dynamic module's `lib<name>.so`, `make test-overhead DYNMOD=...`)
//! the kvroute-native proxy and its floor (Envoy's buffer filter) run too and must report
//! their rows, and with `KVROUTE_FLOOR_DYNMOD` (`bench/floor-dynmod`'s module, which `make
//! test-overhead` gives with the kvroute module) its routing floor, floor-dynmod, whose
//! every request must reach the backend through the cluster its header names (a non-2xx
//! response fails the run). The module's own metrics are printed,
//! not asserted (a module may have none yet). `KVROUTE_DYNMOD_SKIP_PUSH=1` pushes it no
//! snapshot (a module without the ingest role).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: fail loudly

use kvroute_integration::harness::{wasm_path, workspace_root};
use kvroute_tools::overhead::{
    run, DynModule, Options, FLOOR_DYNMOD, FLOOR_NATIVE, NATIVE, VARIANTS,
};
use std::path::PathBuf;
use std::time::Duration;

#[tokio::test(flavor = "current_thread")]
async fn every_size_and_proxy_reports() {
    let kvroute_wasm = wasm_path();
    let floor_wasm = std::env::var_os("KVROUTE_FLOOR_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvroute_wasm.with_file_name("kvroute_floor_filter.wasm"));
    let dynmod = std::env::var_os("KVROUTE_DYNMOD")
        .filter(|p| !p.is_empty())
        .map(|path| DynModule {
            path: PathBuf::from(path),
            filter_name: DynModule::FILTER_NAME.into(),
            // As the binary's flag reads it (clap's falsey values push).
            push: std::env::var("KVROUTE_DYNMOD_SKIP_PUSH").map_or(true, |v| {
                ["", "0", "false", "no", "off", "n", "f"].contains(&v.to_ascii_lowercase().as_str())
            }),
        });
    let floor_dynmod = std::env::var_os("KVROUTE_FLOOR_DYNMOD")
        .filter(|p| !p.is_empty())
        .map(|path| DynModule {
            path: PathBuf::from(path),
            filter_name: "floor".into(),
            push: false,
        });
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
        dynmod,
        floor_dynmod,
    };
    let variants = opts.variants();
    let native = opts.dynmod.is_some();
    let routing_floor = native && opts.floor_dynmod.is_some();
    assert_eq!(
        variants.len(),
        VARIANTS.len() + 2 * usize::from(native) + usize::from(routing_floor)
    );
    let report = run(&opts, |l| eprintln!("{l}")).await.unwrap();
    let md = report.markdown();
    eprintln!("{md}");
    assert_eq!(report.rows.len(), sizes.len() * variants.len());
    for &size in &sizes {
        for &v in &variants {
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
    assert_eq!(report.filter.len(), sizes.len() * (1 + usize::from(native)));
    for f in report.filter.iter().filter(|f| f.variant == "kvroute") {
        let (size, s) = (f.size, f.stats);
        let kv = report.row(size, "kvroute").unwrap();
        assert_eq!(s.parse_errors, Some(0), "{size}");
        // Every request was routed by the policy (none failed open or fell back).
        assert!(
            s.routed.unwrap_or(0) >= kv.median.requests,
            "{size}: {s:?} vs {kv:?}"
        );
        assert!(
            s.decision_p50_us.is_some() && s.decision_p99_us.is_some(),
            "{size}: {s:?}"
        );
        assert!(
            s.wasm_memory_bytes.unwrap_or(0) >= 1024 * 1024,
            "{size}: {s:?}"
        );
    }
    assert_eq!(md.matches("| kvroute |").count(), 2 * sizes.len(), "{md}");
    if native {
        // Rows in both tables; the native module has no Wasm VM.
        assert_eq!(
            md.matches(&format!("| {NATIVE} |")).count(),
            2 * sizes.len(),
            "{md}"
        );
        for f in report.filter.iter().filter(|f| f.variant == NATIVE) {
            assert_eq!(f.stats.wasm_memory_bytes, None, "{f:?}");
        }
        // Its floors, Envoy's buffer filter and the routing module, in the first table
        // only.
        assert_eq!(
            md.matches(&format!("| {FLOOR_NATIVE} |")).count(),
            sizes.len(),
            "{md}"
        );
        assert_eq!(
            md.matches(&format!("| {FLOOR_DYNMOD} |")).count(),
            sizes.len() * usize::from(routing_floor),
            "{md}"
        );
        assert_eq!(
            md.contains(&format!("{FLOOR_DYNMOD}: skipped")),
            !routing_floor,
            "{md}"
        );
    } else {
        assert!(
            md.contains(&format!("{NATIVE} and {FLOOR_NATIVE}: skipped")),
            "{md}"
        );
    }
}
