//! Smoke version of `make bench-routing` (issue 7), small enough for `make test`:
//! 2 traces (Mooncake, ShareGPT multi-round) × 4 replicas × 1 load × all nine routers on
//! short slices of the real shared data, plus the Azure loader, capacity search and the
//! report outputs.

use std::path::PathBuf;

use kvroute_core::profile::builtin;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_sim::trace::TraceRow;
use kvroute_tools::routebench::output::{plot_svg, render_tables, TABLE_HEADER};
use kvroute_tools::routebench::sweep::{
    goal_check, measure_capacity, native_rate, BenchReport, Cell, CAPACITY_SLO_SHARE,
};
use kvroute_tools::routebench::workload::{TraceKind, SHAREGPT_BLOCK_CHARS};
use kvroute_tools::routebench::{run_router, BenchConfig, RouterKind, RouterReport};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const SEED: u64 = 11;

fn data_dir() -> PathBuf {
    kvroute_core::shared_data::dir()
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn engine() -> Res<EngineConfig> {
    let model = builtin(MODEL).ok_or("built-in model missing")?;
    Ok(ReplicaConfig::for_model(model, Dialect::VllmV1, 1.0, 0)?.engine)
}

fn rows(kind: TraceKind, n: usize) -> Res<Vec<TraceRow>> {
    let mut r = kind.load(&data_dir(), SEED)?;
    r.truncate(n);
    Ok(r)
}

/// (trace, rows, time compression): Mooncake at its own rate, ShareGPT at 3 req/s.
fn slices() -> Res<Vec<(TraceKind, Vec<TraceRow>, f64)>> {
    Ok(vec![
        (TraceKind::Mooncake, rows(TraceKind::Mooncake, 60)?, 1.0),
        (
            TraceKind::SharegptMultiround,
            rows(TraceKind::SharegptMultiround, 60)?,
            3.0,
        ),
    ])
}

fn run_cells(slices: &[(TraceKind, Vec<TraceRow>, f64)], engine: &EngineConfig) -> Vec<Cell> {
    let mut cells = Vec::new();
    for (kind, rows, scale) in slices {
        let cfg = BenchConfig::new(4, *scale, SEED, MODEL);
        for router in RouterKind::all() {
            cells.push(Cell {
                trace: kind.name().to_string(),
                replicas: 4,
                load: 0.7,
                time_compression: *scale,
                arrival_rate_rps: native_rate(rows) * scale,
                report: run_router(rows, engine, &cfg, router),
            });
        }
    }
    cells
}

fn report_of(cells: Vec<Cell>) -> BenchReport {
    BenchReport {
        model: MODEL.to_string(),
        kv_tokens_per_replica: 0,
        scrape_interval_ms: 200,
        push_delay_ms: 10,
        seed: SEED,
        kvroute_weights: [1.0, 1.0, 1.0, 2.0],
        capacities: Vec::new(),
        goal: goal_check(&cells, &[]),
        ceilings: Vec::new(),
        output_length_error: Vec::new(),
        cells,
    }
}

#[test]
fn smoke_two_traces_four_replicas_all_routers() {
    let engine = engine().expect("engine");
    let slices = slices().expect("shared data");
    let first = run_cells(&slices, &engine);
    let second = run_cells(&slices, &engine);
    assert_eq!(first, second, "same seed must give identical reports");
    assert_eq!(first.len(), 2 * RouterKind::all().len());

    for (kind, rows, _) in &slices {
        let n = rows.len();
        let group: Vec<&RouterReport> = first
            .iter()
            .filter(|c| c.trace == kind.name())
            .map(|c| &c.report)
            .collect();
        assert_eq!(group.len(), RouterKind::all().len());
        for r in &group {
            // Every request finished exactly once.
            assert_eq!(r.requests, n, "{}", r.router);
            assert_eq!(r.rejected, 0, "{}", r.router);
            assert_eq!(r.finished, n, "{} finished {}/{n}", r.router, r.finished);
            assert_eq!(r.duplicate_finishes, 0, "{}", r.router);
            assert_eq!(r.per_replica.iter().sum::<usize>(), n, "{}", r.router);
            assert!(r.ttft_p50 > 0.0 && r.ttft_p50 <= r.ttft_p90 && r.ttft_p90 <= r.ttft_p99);
            assert!(r.e2e_p99 >= r.ttft_p99);
            assert!(r.output_tokens_per_s > 0.0);
            assert!((0.0..=1.0).contains(&r.slo_ttft) && (0.0..=1.0).contains(&r.slo_tpot));
            assert!((0.0..=1.0).contains(&r.prefix_hit_ratio));
            assert!(
                r.imbalance >= 1.0,
                "{}: imbalance {}",
                r.router,
                r.imbalance
            );
            eprintln!(
                "{} {}: ttft p50 {:.3} p99 {:.3} hit {:.4} tps {:.0} spread {:?}",
                kind.name(),
                r.router,
                r.ttft_p50,
                r.ttft_p99,
                r.prefix_hit_ratio,
                r.output_tokens_per_s,
                r.per_replica
            );
        }
        // Round robin: exact even spread (n is a multiple of 4).
        let rr = group
            .iter()
            .find(|r| r.router == "round_robin")
            .expect("round robin");
        assert_eq!(rr.per_replica, vec![n / 4; 4]);
        // The oracle (true caches, least predicted prefill work) hits at least as often as
        // the prefix-blind routers. It minimises prefill work, not misses, so a
        // cache-greedy router may beat its hit rate (see docs/bench.md, "Oracle").
        let oracle = group
            .iter()
            .find(|r| r.router == "oracle")
            .expect("oracle")
            .prefix_hit_ratio;
        for r in group
            .iter()
            .filter(|r| r.router == "round_robin" || r.router == "least_request")
        {
            assert!(
                oracle >= r.prefix_hit_ratio,
                "{}: oracle hit {oracle} < {} {}",
                kind.name(),
                r.router,
                r.prefix_hit_ratio
            );
        }
    }
    // ShareGPT has real multi-round prefix reuse: the oracle finds some of it.
    let sg_oracle = first
        .iter()
        .find(|c| c.trace == "sharegpt_multiround" && c.report.router == "oracle")
        .expect("oracle cell");
    assert!(sg_oracle.report.prefix_hit_ratio > 0.0);

    // Markdown: one table per (trace, fleet), one row per router.
    let report = report_of(first);
    let md = render_tables(&report);
    assert_eq!(md.matches(TABLE_HEADER).count(), 2);
    for kind in [TraceKind::Mooncake, TraceKind::SharegptMultiround] {
        assert!(md.contains(&format!("### {}, 4 replicas", kind.name())));
    }
    for router in RouterKind::all() {
        assert_eq!(
            md.matches(&format!("| 70% | {} |", router.name())).count(),
            2,
            "{}",
            router.name()
        );
    }
    // JSON round-trips (floats to within serde_json's last-digit parsing error).
    let json = serde_json::to_string(&report).expect("encode");
    let back: BenchReport = serde_json::from_str(&json).expect("decode");
    assert_eq!(back.cells.len(), report.cells.len());
    assert_eq!(back.goal.rows.len(), report.goal.rows.len());
    for (a, b) in back.cells.iter().zip(&report.cells) {
        assert_eq!(
            (&a.trace, a.replicas, &a.report.router),
            (&b.trace, b.replicas, &b.report.router)
        );
        assert_eq!(a.report.per_replica, b.report.per_replica);
        assert_eq!(
            (a.report.finished, a.report.preemptions),
            (b.report.finished, b.report.preemptions)
        );
        for (x, y) in [
            (a.report.ttft_p50, b.report.ttft_p50),
            (a.report.ttft_p99, b.report.ttft_p99),
            (a.report.e2e_p99, b.report.e2e_p99),
            (a.report.output_tokens_per_s, b.report.output_tokens_per_s),
            (a.report.prefix_hit_ratio, b.report.prefix_hit_ratio),
            (a.report.imbalance, b.report.imbalance),
            (a.arrival_rate_rps, b.arrival_rate_rps),
        ] {
            assert!((x - y).abs() <= 1e-12 * y.abs().max(1.0), "{x} vs {y}");
        }
    }
    // Goal rows: one per (trace, fleet, load ≥ 70 %).
    assert_eq!(report.goal.rows.len(), 2);
    // SVG plot names every router.
    let svg = plot_svg(&report, "mooncake", 4).expect("plot");
    assert!(svg.starts_with("<svg"));
    for router in RouterKind::all() {
        assert!(svg.contains(router.name()), "{}", router.name());
    }
}

#[test]
fn capacity_search_brackets_the_slo() {
    let engine = engine().expect("engine");
    // One replica, so that a 150-row burst overflows the 2 s TTFT SLO.
    let rows = rows(TraceKind::AzureConv, 150).expect("shared data");
    let base = BenchConfig::new(1, 1.0, SEED, MODEL);
    let cap = measure_capacity("azure_conv", &rows, &engine, &base, 1);
    eprintln!("{cap:?}");
    assert!(cap.capacity_scale > 0.0);
    assert!((cap.capacity_rps - cap.native_rate_rps * cap.capacity_scale).abs() < 1e-9);
    // The chosen scale is a probe that met the SLO share; some larger probe missed it.
    let at = cap
        .probes
        .iter()
        .find(|(s, _)| *s == cap.capacity_scale)
        .expect("capacity is a probed scale");
    assert!(at.1 >= CAPACITY_SLO_SHARE, "{cap:?}");
    assert!(
        cap.probes
            .iter()
            .any(|(s, share)| *s > cap.capacity_scale && *share < CAPACITY_SLO_SHARE),
        "{cap:?}"
    );
    // Every passing probe is below every failing one (monotone bracket).
    let max_pass = cap
        .probes
        .iter()
        .filter(|p| p.1 >= CAPACITY_SLO_SHARE)
        .map(|p| p.0)
        .fold(0.0, f64::max);
    assert_eq!(max_pass, cap.capacity_scale);
}

#[test]
fn azure_loader_reads_the_whole_trace_without_prefixes() {
    let rows = TraceKind::AzureConv.load(&data_dir(), SEED).expect("azure");
    // Shared data README: 19,366 rows, ~1 h.
    assert_eq!(rows.len(), 19_366);
    assert_eq!(rows[0].timestamp, 0);
    // First two rows: 18:15:46.680 and 18:15:50.995 (4,315 ms apart).
    assert_eq!((rows[0].input_length, rows[0].output_length), (374, 44));
    assert_eq!(rows[1].timestamp, 4315);
    assert!(rows.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    let span_min = rows.last().map_or(0, |r| r.timestamp) as f64 / 60_000.0;
    assert!((55.0..65.0).contains(&span_min), "{span_min}");
    assert!(rows.iter().all(|r| r.hash_ids.is_empty()));
}

#[test]
fn sharegpt_prefix_ids_follow_the_text() {
    let rows = TraceKind::SharegptMultiround
        .load(&data_dir(), SEED)
        .expect("sharegpt");
    let raw: Vec<serde_json::Value> = serde_json::from_slice(
        &std::fs::read(data_dir().join(TraceKind::SharegptMultiround.rel_path())).expect("read"),
    )
    .expect("json");
    assert_eq!(rows.len(), raw.len());
    assert_eq!(rows.len(), 252);
    let inputs: Vec<&str> = raw
        .iter()
        .map(|v| v["input"].as_str().expect("input"))
        .collect();
    // Row i shares its first block with an earlier row exactly when its first 2,048 bytes
    // equal an earlier input's.
    let mut shared = 0;
    for i in 0..rows.len() {
        let text_shares = inputs[i].len() >= SHAREGPT_BLOCK_CHARS
            && inputs[..i].iter().any(|p| {
                p.len() >= SHAREGPT_BLOCK_CHARS
                    && p.as_bytes()[..SHAREGPT_BLOCK_CHARS]
                        == inputs[i].as_bytes()[..SHAREGPT_BLOCK_CHARS]
            });
        let ids_share = rows[i]
            .hash_ids
            .first()
            .is_some_and(|h| rows[..i].iter().any(|r| r.hash_ids.first() == Some(h)));
        assert_eq!(text_shares, ids_share, "row {i}");
        shared += usize::from(ids_share);
    }
    assert!(shared > 0, "multi-round file must reuse prefixes");
    // Poisson arrivals: increasing, seeded, mean gap ≈ 1 s.
    assert!(rows.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    let again = TraceKind::SharegptMultiround
        .load(&data_dir(), SEED)
        .expect("sharegpt");
    assert_eq!(rows, again);
    let mean_gap = rows.last().map_or(0, |r| r.timestamp) as f64 / 1000.0 / 251.0;
    assert!((0.8..1.2).contains(&mean_gap), "{mean_gap}");
}
