//! Evaluation of the exposition-parser crates on the shared fixtures (see README "Why a
//! hand-rolled exposition parser"): pins what each crate does with them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::PathBuf;

fn dir() -> PathBuf {
    kvroute_core::shared_data::dir().join("metrics")
}

/// `openmetrics-parser` (Prometheus mode) reads 9 of the 10 fixtures but rejects the whole
/// vLLM V0 body because one unrelated histogram (`vllm:iteration_tokens_total`, truncated
/// by the doc author) lacks its `+Inf` bucket: the endpoint would lose its KV gauge over a
/// family the router never reads. kvroute-cp's reader accepts every fixture.
#[test]
fn openmetrics_parser_rejects_a_whole_body_over_one_histogram() {
    let mut paths: Vec<_> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "prom"))
        .collect();
    paths.sort();
    let mut rejected = Vec::new();
    for p in &paths {
        let text = std::fs::read_to_string(p).unwrap();
        assert!(
            kvroute_cp::expo::Exposition::parse(&text).is_ok(),
            "{}",
            p.display()
        );
        if let Err(e) = openmetrics_parser::prometheus::parse_prometheus(&text) {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            rejected.push((
                name,
                format!("{e:?}").starts_with("InvalidMetric(\"Histograms must have a +INF bucket"),
            ));
        }
    }
    assert_eq!(paths.len(), 10);
    assert_eq!(
        rejected,
        vec![("vllm-v0.7-aibrix-docs.prom".to_string(), true)]
    );
}
