//! SVG plots with `plotters` (SVG backend, no font files: labels are SVG `<text>`).
//!
//! - [`ttft_cdf`]: the empirical CDF of TTFT per run (policy), successful requests only:
//!   point i of n ascending values is `(ttftᵢ, i/n)`.
//! - [`kv_usage`]: one run's KV usage (0..1) per backend over wall time.

use std::path::Path;

use plotters::prelude::*;

use super::{ReplayError, RunReport};

/// Plot size, pixels.
pub const SIZE: (u32, u32) = (900, 540);

fn render_err(path: &Path) -> impl Fn(String) -> ReplayError + '_ {
    move |message| ReplayError::Render {
        what: path.display().to_string(),
        message,
    }
}

/// The empirical TTFT CDF of every run, one line each, written to `path` as SVG.
/// Errors: [`ReplayError::Render`] when drawing or writing fails.
pub fn ttft_cdf(path: &Path, runs: &[RunReport]) -> Result<(), ReplayError> {
    let err = render_err(path);
    let series: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r
                .records
                .iter()
                .filter(|x| x.error.is_none())
                .filter_map(|x| x.ttft_s)
                .filter(|x| x.is_finite())
                .collect();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            let pts = v
                .iter()
                .enumerate()
                .map(|(i, t)| (*t, (i + 1) as f64 / n))
                .collect();
            (r.label.clone(), pts)
        })
        .collect();
    let xmax = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(x, _)| *x))
        .fold(0.0_f64, f64::max);
    let xmax = if xmax > 0.0 { xmax * 1.05 } else { 1.0 };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF per policy", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// KV usage per backend over time for one run, written to `path` as SVG (an empty chart
/// titled "no KV samples" when the run sampled none).
/// Errors: [`ReplayError::Render`] when drawing or writing fails.
pub fn kv_usage(path: &Path, run: &RunReport) -> Result<(), ReplayError> {
    let err = render_err(path);
    let mut backends: Vec<&str> = run.kv.iter().map(|s| s.backend.as_str()).collect();
    backends.sort_unstable();
    backends.dedup();
    let xmax = run.kv.iter().map(|s| s.t_s).fold(run.wall_s, f64::max);
    let xmax = if xmax > 0.0 { xmax * 1.02 } else { 1.0 };
    let title = if run.kv.is_empty() {
        format!("KV usage per backend — {} (no KV samples)", run.label)
    } else {
        format!("KV usage per backend — {}", run.label)
    };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("KV cache usage")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, b) in backends.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = run
            .kv
            .iter()
            .filter(|s| s.backend == *b)
            .map(|s| (s.t_s, s.kv_usage))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(b.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    if !backends.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
