//! Summaries, the side-by-side table and the JSON report.
//!
//! ## Definitions
//! - Percentiles are nearest-rank ([`kvroute_core::percentile`]): the q-quantile of n
//!   ascending values is the value at 1-based rank ⌈q·n⌉, so p50 of `[1, 2, 3, 4]` is 2 and
//!   p99 of 100 values is the 99th. No value gives 0.
//! - Latency percentiles, TPOT and throughput cover successful requests only (`error` is
//!   `None`); `errors` counts the rest.
//! - `prefix_hit_rate` = Σ cached prompt tokens / Σ prompt tokens over successful requests
//!   (the token-weighted hit rate vLLM's `vllm:prefix_cache_hits / queries` reports).
//! - `backend_share[b]` = successful requests served by `b` / successful requests; requests
//!   without the backend header count for no backend, so shares then sum to less than 1.
//! - `peak_kv[b]` = largest sampled KV usage of `b`.
//! - `output_tokens_per_s` = Σ output tokens of successful requests / `wall_s`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvroute_core::percentile::percentile;
use serde::{Deserialize, Serialize};

use super::{ReplayError, ReportFiles, RunReport, Summary, TraceError};

/// Name of the JSON report inside the output directory.
pub const REPORT_JSON: &str = "report.json";

fn sorted(v: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = v.filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// Headline figures of `r` (see the module doc for the definitions).
pub fn summarize(r: &RunReport) -> Summary {
    let ok: Vec<_> = r.records.iter().filter(|x| x.error.is_none()).collect();
    let ttft = sorted(ok.iter().filter_map(|x| x.ttft_s));
    let tpot = sorted(ok.iter().filter_map(|x| x.tpot_s));
    let e2e = sorted(ok.iter().map(|x| x.e2e_s));
    let out_tokens: f64 = ok.iter().map(|x| f64::from(x.output_tokens)).sum();
    let cached: f64 = ok.iter().map(|x| f64::from(x.cached_tokens)).sum();
    let prompt: f64 = ok.iter().map(|x| f64::from(x.prompt_tokens)).sum();
    let mut backend_share = BTreeMap::new();
    for b in ok.iter().filter_map(|x| x.backend.as_ref()) {
        *backend_share.entry(b.clone()).or_insert(0.0) += 1.0;
    }
    for v in backend_share.values_mut() {
        *v = ratio(*v, ok.len() as f64);
    }
    let mut peak_kv: BTreeMap<String, f64> = BTreeMap::new();
    for s in &r.kv {
        let e = peak_kv.entry(s.backend.clone()).or_insert(0.0);
        *e = e.max(s.kv_usage);
    }
    Summary {
        label: r.label.clone(),
        requests: r.records.len(),
        errors: r.records.len() - ok.len(),
        ttft_p50_s: percentile(&ttft, 0.5),
        ttft_p99_s: percentile(&ttft, 0.99),
        tpot_p50_s: percentile(&tpot, 0.5),
        e2e_p99_s: percentile(&e2e, 0.99),
        output_tokens_per_s: ratio(out_tokens, r.wall_s),
        prefix_hit_rate: ratio(cached, prompt),
        backend_share,
        peak_kv,
    }
}

/// A table row: name, value per run, and whether a ratio to the first run is shown.
fn row(
    out: &mut String,
    name: &str,
    cells: &[Option<f64>],
    fmt: impl Fn(f64) -> String,
    ratios: bool,
) {
    let _ = write!(out, "| {name} |");
    let first = cells.first().copied().flatten();
    for (i, c) in cells.iter().enumerate() {
        match c {
            None => out.push_str(" – |"),
            Some(v) => {
                let _ = write!(out, " {}", fmt(*v));
                if ratios && i > 0 {
                    if let Some(f) = first.filter(|f| *f != 0.0) {
                        let _ = write!(out, " (×{:.2})", v / f);
                    }
                }
                out.push_str(" |");
            }
        }
    }
    out.push('\n');
}

/// Side-by-side markdown table of `summaries`, one column per run; latency and throughput
/// rows of the second and later columns carry their ratio to the first column (`×0.85`).
pub fn render_table(summaries: &[Summary]) -> String {
    let mut s = String::from("| metric |");
    for x in summaries {
        let _ = write!(s, " {} |", x.label);
    }
    s.push_str("\n|---|");
    for _ in summaries {
        s.push_str("---|");
    }
    s.push('\n');
    let col =
        |f: &dyn Fn(&Summary) -> f64| summaries.iter().map(|x| Some(f(x))).collect::<Vec<_>>();
    let int = |v: f64| format!("{v:.0}");
    let secs = |v: f64| format!("{v:.3} s");
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
    row(&mut s, "requests", &col(&|x| x.requests as f64), int, false);
    row(&mut s, "errors", &col(&|x| x.errors as f64), int, false);
    row(&mut s, "TTFT p50", &col(&|x| x.ttft_p50_s), secs, true);
    row(&mut s, "TTFT p99", &col(&|x| x.ttft_p99_s), secs, true);
    row(
        &mut s,
        "TPOT p50",
        &col(&|x| x.tpot_p50_s * 1000.0),
        |v| format!("{v:.2} ms"),
        true,
    );
    row(&mut s, "E2E p99", &col(&|x| x.e2e_p99_s), secs, true);
    row(
        &mut s,
        "output tokens/s",
        &col(&|x| x.output_tokens_per_s),
        |v| format!("{v:.1}"),
        true,
    );
    row(
        &mut s,
        "prefix-cache hit rate",
        &col(&|x| x.prefix_hit_rate),
        pct,
        true,
    );
    let mut backends: Vec<&String> = summaries
        .iter()
        .flat_map(|x| x.backend_share.keys().chain(x.peak_kv.keys()))
        .collect();
    backends.sort();
    backends.dedup();
    for b in &backends {
        let cells: Vec<_> = summaries
            .iter()
            .map(|x| x.backend_share.get(*b).copied())
            .collect();
        if cells.iter().any(Option::is_some) {
            row(&mut s, &format!("share {b}"), &cells, pct, false);
        }
    }
    for b in &backends {
        let cells: Vec<_> = summaries
            .iter()
            .map(|x| x.peak_kv.get(*b).copied())
            .collect();
        if cells.iter().any(Option::is_some) {
            row(&mut s, &format!("peak KV {b}"), &cells, pct, false);
        }
    }
    s
}

/// The JSON report: every run with its records and KV samples, and the summaries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportJson {
    /// Summaries, in run order.
    pub summaries: Vec<Summary>,
    /// Runs, in order.
    pub runs: Vec<RunReport>,
}

/// Read a report written by [`write_report`].
/// Errors: unreadable file or not a report ([`ReplayError::File`]).
pub fn read_report(path: &Path) -> Result<ReportJson, ReplayError> {
    let text = std::fs::read_to_string(path).map_err(|cause| TraceError::Io {
        path: path.to_owned(),
        cause,
    })?;
    Ok(serde_json::from_str(&text).map_err(|e| TraceError::Parse {
        path: path.to_owned(),
        line: e.line(),
        message: e.to_string(),
    })?)
}

/// `label` as a file-name part: ASCII letters, digits, `-` and `_` kept, the rest `_`.
pub fn file_stem(label: &str) -> String {
    let s: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "run".to_owned()
    } else {
        s
    }
}

/// Write [`REPORT_JSON`] and the SVG plots of `runs` into `dir` (created if missing):
/// `ttft_cdf.svg` (all runs) and `kv_<label>.svg` per run ([`super::plot`]).
///
/// Errors: the directory or a file cannot be written ([`ReplayError::File`]), a plot cannot
/// be drawn ([`ReplayError::Render`]).
pub fn write_report(dir: &Path, runs: &[RunReport]) -> Result<ReportFiles, ReplayError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |cause| ReplayError::from(TraceError::Io { path, cause })
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let report = ReportJson {
        summaries: runs.iter().map(RunReport::summary).collect(),
        runs: runs.to_vec(),
    };
    let json_path = dir.join(REPORT_JSON);
    let text = serde_json::to_string_pretty(&report).map_err(|e| ReplayError::Render {
        what: json_path.display().to_string(),
        message: e.to_string(),
    })?;
    std::fs::write(&json_path, text).map_err(io(&json_path))?;
    let mut plots: Vec<PathBuf> = Vec::new();
    let cdf = dir.join("ttft_cdf.svg");
    super::plot::ttft_cdf(&cdf, runs)?;
    plots.push(cdf);
    let mut used = std::collections::BTreeSet::new();
    for (i, r) in runs.iter().enumerate() {
        let mut stem = file_stem(&r.label);
        if !used.insert(stem.clone()) {
            stem = format!("{stem}_{i}");
            used.insert(stem.clone());
        }
        let p = dir.join(format!("kv_{stem}.svg"));
        super::plot::kv_usage(&p, r)?;
        plots.push(p);
    }
    Ok(ReportFiles {
        json: json_path,
        plots,
    })
}
