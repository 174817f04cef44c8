//! Report output: one markdown table per (trace, fleet), a headline table, the goal table,
//! SVG plots of TTFT p99 against load (one line per router, plotters' SVG backend), and
//! the JSON report ([`write_all`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use super::sweep::{BenchReport, Cell};
use super::RouterReport;

/// Errors writing the report.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// File system error.
    #[error("writing {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// JSON error.
    #[error("encoding the JSON report: {0}")]
    Json(#[from] serde_json::Error),
    /// Plotting error (plotters).
    #[error("plotting {0}")]
    Plot(String),
}

/// Distinct (trace, replicas) pairs in first-seen order.
pub fn groups(report: &BenchReport) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    for c in &report.cells {
        let k = (c.trace.clone(), c.replicas);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

fn group_cells<'a>(report: &'a BenchReport, trace: &str, replicas: usize) -> Vec<&'a Cell> {
    report
        .cells
        .iter()
        .filter(|c| c.trace == trace && c.replicas == replicas)
        .collect()
}

/// Header and separator of the per-(trace, fleet) table.
pub const TABLE_HEADER: &str = "| load | router | req/s | TTFT p50 s | TTFT p90 s | TTFT p99 s | E2E p99 s | out tok/s | TTFT≤2s | TPOT≤100ms | prefix hit | hit / ceiling | preempt | imbalance | overflow |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

/// Pooled-LRU ceiling of (trace, replicas) in `report` (0 when absent).
pub fn ceiling(report: &BenchReport, trace: &str, replicas: usize) -> f64 {
    report
        .ceilings
        .iter()
        .find(|c| c.trace == trace && c.replicas == replicas)
        .map_or(0.0, |c| c.hit)
}

fn share(hit: f64, ceiling: f64) -> String {
    if ceiling > 0.0 {
        format!("{:.0}%", 100.0 * hit / ceiling)
    } else {
        "n/a".to_string()
    }
}

/// One table row; `ceiling` is the (trace, fleet)'s pooled-LRU hit rate.
pub fn table_row(c: &Cell, ceiling: f64) -> String {
    let r: &RouterReport = &c.report;
    format!(
        "| {:.0}% | {} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} | {:.0} | {:.3} | {:.3} | {:.3} | {} | {} | {:.2} | {} |\n",
        c.load * 100.0,
        r.router,
        c.arrival_rate_rps,
        r.ttft_p50,
        r.ttft_p90,
        r.ttft_p99,
        r.e2e_p99,
        r.output_tokens_per_s,
        r.slo_ttft,
        r.slo_tpot,
        r.prefix_hit_ratio,
        share(r.prefix_hit_ratio, ceiling),
        r.preemptions,
        r.imbalance,
        r.overflow,
    )
}

/// One markdown table per (trace, fleet), each preceded by a `###` heading with the
/// measured capacity.
pub fn render_tables(report: &BenchReport) -> String {
    let mut s = String::new();
    for (trace, n) in groups(report) {
        let cap = report
            .capacities
            .iter()
            .find(|c| c.trace == trace && c.replicas == n);
        let ceil = ceiling(report, &trace, n);
        let _ = writeln!(
            s,
            "### {trace}, {n} replicas (capacity {:.2} req/s = ×{:.3} the trace's rate, {} rows; pooled-LRU hit ceiling {:.3})\n",
            cap.map_or(0.0, |c| c.capacity_rps),
            cap.map_or(0.0, |c| c.capacity_scale),
            cap.map_or(0, |c| c.rows),
            ceil,
        );
        s.push_str(TABLE_HEADER);
        for c in group_cells(report, &trace, n) {
            s.push_str(&table_row(c, ceil));
        }
        s.push('\n');
    }
    s
}

/// The goal table (one row per trace, fleet and load ≥ 70 %) and the verdict.
pub fn render_goal(report: &BenchReport) -> String {
    let g = &report.goal;
    let mut s = String::from("| trace | replicas | load | kvroute TTFT p99 s | best other (TTFT p99 s) | kvroute p50 s / best | kvroute out tok/s / best | kvroute hit / best baseline (/ ceiling) | pass |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in &g.rows {
        let hit = match r.hit_ok {
            None => "n/a".to_string(),
            Some(ok) => format!(
                "{:.3} / {:.3} {} ({})",
                r.kvroute_hit,
                r.best_baseline_hit,
                if ok { "ok" } else { "low" },
                share(r.kvroute_hit, r.ceiling_hit),
            ),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.0}% | {:.3} {} | {} ({:.3}) | {:.3} / {:.3} {} | {:.0} / {:.0} {} | {} | {} |",
            r.trace,
            r.replicas,
            r.load * 100.0,
            r.kvroute_ttft_p99,
            if r.ttft_win { "win" } else { "loss" },
            r.best_baseline,
            r.best_baseline_ttft_p99,
            r.kvroute_ttft_p50,
            r.best_ttft_p50,
            if r.p50_ok { "ok" } else { "high" },
            r.kvroute_tps,
            r.max_baseline_tps,
            if r.throughput_ok { "ok" } else { "low" },
            hit,
            if r.pass { "yes" } else { "no" },
        );
    }
    let passed = g.rows.iter().filter(|r| r.pass).count();
    let _ = writeln!(
        s,
        "\nCells passing: {passed} of {}; traces passing at every fleet and load ≥ 70 %: {:?} → goal {}.",
        g.rows.len(),
        g.traces_passing,
        if g.met { "MET" } else { "NOT met" }
    );
    s
}

/// Output-length prediction error per trace.
pub fn render_output_error(report: &BenchReport) -> String {
    let mut s = String::from("| trace | rows predicted | mean output | learned p50 MAE | learned p50 median APE | p90 coverage | fixed 512 MAE |\n|---|---|---|---|---|---|---|\n");
    for e in &report.output_length_error {
        let _ = writeln!(
            s,
            "| {} | {} of {} | {:.0} | {:.0} | {:.0}% | {:.0}% | {:.0} |",
            e.trace,
            e.predicted,
            e.rows,
            e.mean_output,
            e.p50_mae,
            100.0 * e.p50_median_ape,
            100.0 * e.p90_coverage,
            e.fixed_rule_mae,
        );
    }
    s
}

/// Headline: TTFT p99 (s) and prefix hit rate per router for each trace at `replicas` and
/// `load`.
pub fn render_headline(report: &BenchReport, replicas: usize, load: f64) -> String {
    let traces: Vec<String> = groups(report)
        .into_iter()
        .filter(|(_, n)| *n == replicas)
        .map(|(t, _)| t)
        .collect();
    let mut s = String::from("| router |");
    for t in &traces {
        let _ = write!(s, " {t} TTFT p99 s | {t} out tok/s | {t} hit |");
    }
    s.push_str("\n|---|");
    for _ in &traces {
        s.push_str("---|---|---|");
    }
    s.push('\n');
    let mut routers: Vec<String> = Vec::new();
    for c in &report.cells {
        if !routers.contains(&c.report.router) {
            routers.push(c.report.router.clone());
        }
    }
    for router in routers {
        let _ = write!(s, "| {router} |");
        for t in &traces {
            match report.cells.iter().find(|c| {
                &c.trace == t
                    && c.replicas == replicas
                    && (c.load - load).abs() < 1e-9
                    && c.report.router == router
            }) {
                Some(c) => {
                    let _ = write!(
                        s,
                        " {:.3} | {:.0} | {:.3} |",
                        c.report.ttft_p99, c.report.output_tokens_per_s, c.report.prefix_hit_ratio
                    );
                }
                None => s.push_str(" – | – | – |"),
            }
        }
        s.push('\n');
    }
    s
}

/// SVG of TTFT p99 (log scale) against load for one (trace, fleet), one line per router.
pub fn plot_svg(report: &BenchReport, trace: &str, replicas: usize) -> Result<String, OutputError> {
    let cells = group_cells(report, trace, replicas);
    let mut routers: Vec<String> = Vec::new();
    for c in &cells {
        if !routers.contains(&c.report.router) {
            routers.push(c.report.router.clone());
        }
    }
    let loads: Vec<f64> = cells.iter().map(|c| c.load * 100.0).collect();
    let xmin = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let xmax = loads.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (xmin, xmax) = if xmin.is_finite() && xmax > xmin {
        (xmin - 5.0, xmax + 5.0)
    } else {
        (0.0, 120.0)
    };
    let ys: Vec<f64> = cells.iter().map(|c| c.report.ttft_p99.max(1e-3)).collect();
    let ymin = ys.iter().copied().fold(f64::INFINITY, f64::min);
    let ymax = ys.iter().copied().fold(0.0f64, f64::max);
    let (ymin, ymax) = if ymin.is_finite() && ymax > ymin {
        (ymin * 0.8, ymax * 1.25)
    } else {
        (1e-3, 10.0)
    };
    let perr = |e: &dyn std::fmt::Display| OutputError::Plot(format!("{trace}/{replicas}: {e}"));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| perr(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("TTFT p99 vs load: {trace}, {replicas} replicas"),
                ("sans-serif", 22),
            )
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(xmin..xmax, (ymin..ymax).log_scale())
            .map_err(|e| perr(&e))?;
        chart
            .configure_mesh()
            .x_desc("offered load, % of measured capacity")
            .y_desc("TTFT p99, s (log)")
            .draw()
            .map_err(|e| perr(&e))?;
        for (i, router) in routers.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mut pts: Vec<(f64, f64)> = cells
                .iter()
                .filter(|c| &c.report.router == router)
                .map(|c| (c.load * 100.0, c.report.ttft_p99.max(1e-3)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| perr(&e))?
                .label(router.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| perr(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| perr(&e))?;
        root.present().map_err(|e| perr(&e))?;
    }
    Ok(svg)
}

fn write(path: &Path, data: &str) -> Result<(), OutputError> {
    std::fs::write(path, data).map_err(|source| OutputError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Write `report.json`, `tables.md` (goal + every table) and one
/// `ttft_p99_<trace>_<n>.svg` per (trace, fleet) under `dir` (created). Returns the paths.
pub fn write_all(report: &BenchReport, dir: &Path) -> Result<Vec<PathBuf>, OutputError> {
    std::fs::create_dir_all(dir).map_err(|source| OutputError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut paths = Vec::new();
    let json = dir.join("report.json");
    write(&json, &serde_json::to_string_pretty(report)?)?;
    paths.push(json);
    let md = dir.join("tables.md");
    write(
        &md,
        &format!(
            "## Goal\n\n{}\n## Output-length prediction error\n\n{}\n## Tables\n\n{}",
            render_goal(report),
            render_output_error(report),
            render_tables(report)
        ),
    )?;
    paths.push(md);
    for (trace, n) in groups(report) {
        let p = dir.join(format!("ttft_p99_{trace}_{n}.svg"));
        write(&p, &plot_svg(report, &trace, n)?)?;
        paths.push(p);
    }
    Ok(paths)
}
