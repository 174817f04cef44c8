//! The Grafana dashboard (`deploy/grafana/kvroute.json`) only queries metrics that exist:
//! control-plane names as kvroute-cp's own exposition declares them (prometheus-client adds
//! `_total` to counters and `_bucket`/`_sum`/`_count` to histograms), and filter names as
//! `filter/src/names.rs` defines them, the way Envoy's `/stats/prometheus` writes Wasm stats
//! (`wasmcustom.` dropped, `.` → `_`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeSet;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `kvroute_...` identifier in the dashboard's queries.
fn queried() -> BTreeSet<String> {
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/kvroute.json")).unwrap(),
    )
    .unwrap();
    let mut out = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let e = t["expr"].as_str().unwrap();
            let mut rest = e;
            while let Some(i) = rest.find("kvroute_") {
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                out.insert(tail[..end].to_owned());
                rest = &tail[end..];
            }
        }
    }
    out
}

fn cp_names() -> BTreeSet<String> {
    use kvroute_cp::telemetry::{EndpointLabel, StateLabel, TargetLabel, Telemetry};
    // Labelled families are encoded only once they hold a series: create one in each.
    let t = Telemetry::new();
    let e = EndpointLabel {
        endpoint: "p/e".into(),
    };
    let g = TargetLabel {
        target: "gw".into(),
    };
    t.scrape_duration.get_or_create(&e).observe(0.01);
    t.scrape_error("p/e", "connect");
    t.restarts.get_or_create(&e).inc();
    t.skipped_lines.get_or_create(&e).inc();
    t.push_duration.get_or_create(&g).observe(0.01);
    t.push_failure("gw", "timeout");
    t.pushes.get_or_create(&g).inc();
    t.scrape_to_push.get_or_create(&g).observe(0.01);
    t.push_auth_rejected.get_or_create(&g).set(0);
    t.gateway_stats_error("gw", "parse");
    t.file_reload_failures("push.tls");
    t.endpoints
        .get_or_create(&StateLabel {
            state: "healthy".into(),
        })
        .set(1);
    let text = t.encode();
    let mut out = BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut it = rest.split_whitespace();
        let (name, kind) = (it.next().unwrap(), it.next().unwrap());
        match kind {
            "counter" => {
                out.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            _ => {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

fn filter_names() -> BTreeSet<String> {
    let src = std::fs::read_to_string(root().join("filter/src/names.rs")).unwrap();
    let metrics = &src[src.find("pub mod metric").unwrap()..];
    let mut out = BTreeSet::new();
    for part in metrics.split('"').skip(1).step_by(2) {
        if part.starts_with("kvroute.") {
            let n = part.replace('.', "_");
            for s in ["", "_bucket", "_sum", "_count"] {
                out.insert(format!("{n}{s}"));
            }
        }
    }
    out
}

#[test]
fn dashboard_queries_existing_metrics() {
    let q = queried();
    let (cp, filter) = (cp_names(), filter_names());
    assert!(q.len() >= 20, "dashboard queries {} metrics", q.len());
    let unknown: Vec<&String> = q
        .iter()
        .filter(|m| !(cp.contains(*m) || filter.contains(*m)))
        .collect();
    assert!(
        unknown.is_empty(),
        "dashboard queries unknown metrics: {unknown:?}"
    );
    // Every control-plane family appears on the dashboard.
    let families: BTreeSet<&str> = cp
        .iter()
        .map(|n| {
            ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n)
        })
        .collect();
    for f in families {
        assert!(
            q.iter().any(|m| m.starts_with(f)),
            "control-plane metric {f} is not on the dashboard"
        );
    }
}
