//! Capacity measurement, the load sweep, the goal check and the online cross-check
//! prediction.
//!
//! **Capacity** ([`measure_capacity`]) is measured per (trace, fleet size) as an SLO
//! goodput capacity, in the sense of DistServe (Zhong et al., OSDI'24): the highest arrival
//! rate at which **round robin** still serves at least [`CAPACITY_SLO_SHARE`] (50 %) of the
//! requests with TTFT ≤ 2 s, i.e. keeps its median TTFT within the SLO. (A 90 % share is
//! unreachable on Mooncake at any rate: more than 10 % of its prompts are long enough that
//! their prefill alone exceeds 2 s on an idle replica.) The trace's arrival rate is scaled
//! (all arrival times divided by a factor), starting at the native rate; the factor is
//! doubled or halved (at most [`CAPACITY_MAX_DOUBLINGS`] times) until the criterion flips,
//! then bisected geometrically [`CAPACITY_BISECT_STEPS`] times. Capacity = the largest
//! passing factor × the native rate (rows / trace span). A load of *L* % then replays the
//! same rows at *L*/100 × capacity. Round robin is the reference because it ignores all
//! state, so "100 %" means the same offered traffic for every router. A short slice whose
//! whole burst fits the fleet never fails; its capacity is then capped at
//! 2^[`CAPACITY_MAX_DOUBLINGS`] × the native rate (reported in the probes).
//!
//! **Sweep** ([`run_sweep`]): every (trace, fleet, load, router) cell is an independent
//! replay; cells run in parallel on rayon's pool (one thread per core) and come back in a
//! fixed order, so the report is identical for a seed whatever the thread count.
//!
//! **Ceiling** ([`super::ceiling::pooled_lru_hit_rate`]): per (trace, fleet), the hit rate of
//! one LRU holding the whole fleet's KV capacity, reported beside every hit rate.
//!
//! **Goal** ([`goal_check`], issue 12): at every load ≥ 70 %, kvroute's default policy must
//! have the lowest TTFT p99 of all non-oracle routers (baselines and kvroute's other
//! policies), a TTFT p50 within [`GOAL_P50_SLACK`] (5 %) of the best non-oracle router's,
//! output throughput ≥ [`GOAL_THROUGHPUT_SHARE`] (99 %) of the best non-oracle router's, and
//! a prefix-cache hit rate ≥ [`GOAL_HIT_SHARE`] (95 %) of the best baseline's (not
//! applicable when every baseline's is 0, e.g. Azure). The goal is met when every (trace,
//! fleet, load ≥ 70 %) cell passes.

use rayon::prelude::*;

use super::ceiling::{output_length_error, pooled_lru_hit_rate, OutputLengthError};
use super::workload::TraceKind;
use super::{run_router, BenchConfig, PrefixView, RouterKind, RouterReport};
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::trace::TraceRow;

/// Share of requests that must meet the TTFT SLO at capacity (the median).
pub const CAPACITY_SLO_SHARE: f64 = 0.5;
/// Most doublings (or halvings) of the arrival-rate scale while bracketing.
pub const CAPACITY_MAX_DOUBLINGS: u32 = 10;
/// Geometric bisection steps after bracketing.
pub const CAPACITY_BISECT_STEPS: u32 = 5;
/// Share of the best non-oracle router's output throughput kvroute must reach.
pub const GOAL_THROUGHPUT_SHARE: f64 = 0.99;
/// kvroute's TTFT p50 may exceed the best non-oracle router's by this fraction.
pub const GOAL_P50_SLACK: f64 = 0.05;
/// Loads at or above this count for the goal.
pub const GOAL_MIN_LOAD: f64 = 0.7;
/// Share of the best baseline's hit rate kvroute must reach.
pub const GOAL_HIT_SHARE: f64 = 0.95;

/// One trace, sliced.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Which trace.
    pub kind: TraceKind,
    /// Its rows (arrival-sorted, first at 0 ms).
    pub rows: Vec<TraceRow>,
}

/// Measured capacity of one (trace, fleet).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Capacity {
    /// Trace name.
    pub trace: String,
    /// Replicas.
    pub replicas: usize,
    /// Rows replayed.
    pub rows: usize,
    /// The trace's own arrival rate, requests/s.
    pub native_rate_rps: f64,
    /// Capacity, requests/s.
    pub capacity_rps: f64,
    /// Capacity as a time-compression factor of the native rate.
    pub capacity_scale: f64,
    /// Every probe: (scale, round robin's TTFT-SLO share).
    pub probes: Vec<(f64, f64)>,
}

/// One replay of the sweep.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Cell {
    /// Trace name.
    pub trace: String,
    /// Replicas.
    pub replicas: usize,
    /// Offered load as a fraction of capacity (0.5 = 50 %).
    pub load: f64,
    /// Time-compression factor applied to the trace.
    pub time_compression: f64,
    /// Offered arrival rate, requests/s.
    pub arrival_rate_rps: f64,
    /// The router's results.
    pub report: RouterReport,
}

/// Goal check of one (trace, fleet, load).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GoalRow {
    /// Trace name.
    pub trace: String,
    /// Replicas.
    pub replicas: usize,
    /// Load fraction.
    pub load: f64,
    /// kvroute default's TTFT p99 (s).
    pub kvroute_ttft_p99: f64,
    /// Best other non-oracle router by TTFT p99.
    pub best_baseline: String,
    /// Its TTFT p99 (s).
    pub best_baseline_ttft_p99: f64,
    /// kvroute default's TTFT p50 (s).
    pub kvroute_ttft_p50: f64,
    /// Lowest TTFT p50 of the other non-oracle routers (s).
    pub best_ttft_p50: f64,
    /// kvroute output tokens/s.
    pub kvroute_tps: f64,
    /// Highest output tokens/s of the other non-oracle routers.
    pub max_baseline_tps: f64,
    /// kvroute hit rate (0..1).
    pub kvroute_hit: f64,
    /// Highest baseline hit rate (0..1).
    pub best_baseline_hit: f64,
    /// Oracle hit rate (0..1).
    pub oracle_hit: f64,
    /// Pooled-LRU ceiling of the (trace, fleet) (0..1).
    pub ceiling_hit: f64,
    /// TTFT p99 strictly below every other non-oracle router.
    pub ttft_win: bool,
    /// TTFT p50 within 5 % of the best.
    pub p50_ok: bool,
    /// Throughput ≥ 99 % of the best.
    pub throughput_ok: bool,
    /// Hit rate ≥ 95 % of the best baseline's; `None` when that is 0.
    pub hit_ok: Option<bool>,
    /// All four.
    pub pass: bool,
}

/// Pooled-LRU hit-rate ceiling of one (trace, fleet).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Ceiling {
    /// Trace name.
    pub trace: String,
    /// Replicas.
    pub replicas: usize,
    /// Hit rate of one LRU with the fleet's KV capacity (0..1).
    pub hit: f64,
}

/// Goal summary.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Goal {
    /// Per (trace, fleet, load ≥ 70 %).
    pub rows: Vec<GoalRow>,
    /// Traces where every row passes.
    pub traces_passing: Vec<String>,
    /// Every row passes.
    pub met: bool,
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BenchReport {
    /// Model served by every replica.
    pub model: String,
    /// KV capacity per replica, tokens.
    pub kv_tokens_per_replica: u64,
    /// Scrape interval, ms.
    pub scrape_interval_ms: u64,
    /// Push delay, ms.
    pub push_delay_ms: u64,
    /// Seed.
    pub seed: u64,
    /// kvroute hybrid weights in force `[kv_headroom, queue, inflight, prefix]`.
    pub kvroute_weights: [f64; 4],
    /// Capacity per (trace, fleet).
    pub capacities: Vec<Capacity>,
    /// Pooled-LRU hit-rate ceiling per (trace, fleet).
    pub ceilings: Vec<Ceiling>,
    /// Output-length prediction error per trace.
    pub output_length_error: Vec<OutputLengthError>,
    /// Every replay.
    pub cells: Vec<Cell>,
    /// Goal check.
    pub goal: Goal,
}

/// What to sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepConfig {
    /// Fleet sizes.
    pub fleets: Vec<usize>,
    /// Loads as fractions of capacity.
    pub loads: Vec<f64>,
    /// Routers.
    pub routers: Vec<RouterKind>,
    /// Template for every replay (`replicas`, `time_compression` are overridden).
    pub base: BenchConfig,
}

/// Requests/s of `rows` as recorded (rows / span; 1.0 when the span is 0).
pub fn native_rate(rows: &[TraceRow]) -> f64 {
    let span_s = rows.last().map_or(0.0, |r| r.timestamp as f64 / 1000.0);
    if span_s > 0.0 {
        rows.len() as f64 / span_s
    } else {
        1.0
    }
}

/// Measure the SLO goodput capacity of `rows` on `replicas` engines (module doc).
pub fn measure_capacity(
    trace: &str,
    rows: &[TraceRow],
    engine: &EngineConfig,
    base: &BenchConfig,
    replicas: usize,
) -> Capacity {
    let mut probes = Vec::new();
    let mut probe = |scale: f64| {
        let cfg = BenchConfig {
            replicas,
            time_compression: scale,
            ..base.clone()
        };
        let share = run_router(rows, engine, &cfg, RouterKind::RoundRobin).slo_ttft;
        probes.push((scale, share));
        share >= CAPACITY_SLO_SHARE
    };
    let (mut lo, mut hi);
    if probe(1.0) {
        lo = 1.0;
        hi = 2.0;
        let mut k = 0;
        while k < CAPACITY_MAX_DOUBLINGS && probe(hi) {
            lo = hi;
            hi *= 2.0;
            k += 1;
        }
    } else {
        hi = 1.0;
        lo = 0.5;
        let mut k = 0;
        while k < CAPACITY_MAX_DOUBLINGS && !probe(lo) {
            hi = lo;
            lo /= 2.0;
            k += 1;
        }
    }
    for _ in 0..CAPACITY_BISECT_STEPS {
        let mid = (lo * hi).sqrt();
        if probe(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let native = native_rate(rows);
    Capacity {
        trace: trace.to_string(),
        replicas,
        rows: rows.len(),
        native_rate_rps: native,
        capacity_rps: native * lo,
        capacity_scale: lo,
        probes,
    }
}

/// Run the sweep: capacity per (trace, fleet), then every cell; returns the full report.
pub fn run_sweep(workloads: &[Workload], engine: &EngineConfig, cfg: &SweepConfig) -> BenchReport {
    let pairs: Vec<(&Workload, usize)> = workloads
        .iter()
        .flat_map(|w| cfg.fleets.iter().map(move |&n| (w, n)))
        .collect();
    let capacities: Vec<Capacity> = pairs
        .par_iter()
        .map(|(w, n)| measure_capacity(w.kind.name(), &w.rows, engine, &cfg.base, *n))
        .collect();
    let mut jobs = Vec::new();
    for ((w, n), cap) in pairs.iter().zip(&capacities) {
        for &load in &cfg.loads {
            for &router in &cfg.routers {
                jobs.push((*w, *n, load, cap.capacity_scale * load, router));
            }
        }
    }
    let cells: Vec<Cell> = jobs
        .par_iter()
        .map(|&(w, n, load, scale, router)| {
            let bc = BenchConfig {
                replicas: n,
                time_compression: scale,
                ..cfg.base.clone()
            };
            Cell {
                trace: w.kind.name().to_string(),
                replicas: n,
                load,
                time_compression: scale,
                arrival_rate_rps: native_rate(&w.rows) * scale,
                report: run_router(&w.rows, engine, &bc, router),
            }
        })
        .collect();
    let kv_tokens = u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size);
    let ceilings: Vec<Ceiling> = pairs
        .iter()
        .map(|(w, n)| Ceiling {
            trace: w.kind.name().to_string(),
            replicas: *n,
            hit: pooled_lru_hit_rate(
                &w.rows,
                usize::try_from(kv_tokens * *n as u64 / u64::from(super::TRACE_BLOCK_TOKENS))
                    .unwrap_or(usize::MAX),
            ),
        })
        .collect();
    let output_length_error = workloads
        .iter()
        .map(|w| output_length_error(w.kind.name(), &w.rows, &cfg.base.model))
        .collect();
    let w = &cfg.base.picker.weights;
    BenchReport {
        model: cfg.base.model.clone(),
        kv_tokens_per_replica: u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size),
        scrape_interval_ms: cfg.base.scrape_interval_ms,
        push_delay_ms: cfg.base.push_delay_ms,
        seed: cfg.base.seed,
        kvroute_weights: [w.kv_headroom, w.queue, w.inflight, w.prefix],
        goal: goal_check(&cells, &ceilings),
        capacities,
        ceilings,
        output_length_error,
        cells,
    }
}

/// Goal check over `cells` (module doc); `ceilings` fill [`GoalRow::ceiling_hit`].
pub fn goal_check(cells: &[Cell], ceilings: &[Ceiling]) -> Goal {
    let kv_name = RouterKind::kvroute_default().name();
    let mut keys: Vec<(String, usize, f64)> = Vec::new();
    for c in cells {
        let k = (c.trace.clone(), c.replicas, c.load);
        if c.load >= GOAL_MIN_LOAD - 1e-9 && !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut rows = Vec::new();
    for (trace, replicas, load) in keys {
        let group: Vec<&RouterReport> = cells
            .iter()
            .filter(|c| c.trace == trace && c.replicas == replicas && c.load == load)
            .map(|c| &c.report)
            .collect();
        let Some(kv) = group.iter().find(|r| r.router == kv_name) else {
            continue;
        };
        // Every other non-oracle router: the baselines and kvroute's other policies.
        let others: Vec<&&RouterReport> = group
            .iter()
            .filter(|r| r.router != kv_name && r.router != RouterKind::Oracle.name())
            .collect();
        let baselines: Vec<&&RouterReport> = group
            .iter()
            .filter(|r| RouterKind::from_name(&r.router).is_some_and(RouterKind::is_baseline))
            .collect();
        let best = others
            .iter()
            .min_by(|a, b| a.ttft_p99.total_cmp(&b.ttft_p99));
        let best_p50 = others
            .iter()
            .map(|r| r.ttft_p50)
            .fold(f64::INFINITY, f64::min);
        let max_tps = others
            .iter()
            .map(|r| r.output_tokens_per_s)
            .fold(0.0f64, f64::max);
        let best_hit = baselines
            .iter()
            .map(|r| r.prefix_hit_ratio)
            .fold(0.0f64, f64::max);
        let oracle_hit = group
            .iter()
            .find(|r| r.router == RouterKind::Oracle.name())
            .map_or(0.0, |r| r.prefix_hit_ratio);
        let ceiling_hit = ceilings
            .iter()
            .find(|c| c.trace == trace && c.replicas == replicas)
            .map_or(0.0, |c| c.hit);
        let ttft_win = best.is_none_or(|b| kv.ttft_p99 < b.ttft_p99);
        let p50_ok = !best_p50.is_finite() || kv.ttft_p50 <= best_p50 * (1.0 + GOAL_P50_SLACK);
        let throughput_ok = kv.output_tokens_per_s >= max_tps * GOAL_THROUGHPUT_SHARE;
        let hit_ok = (best_hit > 0.0).then_some(kv.prefix_hit_ratio >= GOAL_HIT_SHARE * best_hit);
        rows.push(GoalRow {
            trace,
            replicas,
            load,
            kvroute_ttft_p99: kv.ttft_p99,
            best_baseline: best.map_or(String::new(), |b| b.router.clone()),
            best_baseline_ttft_p99: best.map_or(0.0, |b| b.ttft_p99),
            kvroute_ttft_p50: kv.ttft_p50,
            best_ttft_p50: if best_p50.is_finite() { best_p50 } else { 0.0 },
            kvroute_tps: kv.output_tokens_per_s,
            max_baseline_tps: max_tps,
            kvroute_hit: kv.prefix_hit_ratio,
            best_baseline_hit: best_hit,
            oracle_hit,
            ceiling_hit,
            ttft_win,
            p50_ok,
            throughput_ok,
            hit_ok,
            pass: ttft_win && p50_ok && throughput_ok && hit_ok.unwrap_or(true),
        });
    }
    let mut traces: Vec<String> = Vec::new();
    for r in &rows {
        if !traces.contains(&r.trace) {
            traces.push(r.trace.clone());
        }
    }
    let traces_passing: Vec<String> = traces
        .into_iter()
        .filter(|t| rows.iter().filter(|r| &r.trace == t).all(|r| r.pass))
        .collect();
    Goal {
        met: !rows.is_empty() && rows.iter().all(|r| r.pass),
        rows,
        traces_passing,
    }
}

/// The offline prediction the online cross-check (issue 7 item 6) is compared against.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CrossCheck {
    /// Minutes of the Mooncake trace replayed.
    pub slice_minutes: f64,
    /// Rows in the slice.
    pub rows: usize,
    /// Replicas.
    pub replicas: usize,
    /// Load fraction of capacity.
    pub load: f64,
    /// Measured capacity of the slice on the fleet.
    pub capacity: Capacity,
    /// Time-compression factor to apply to the slice's arrival times (divide by it).
    pub time_compression: f64,
    /// Offered arrival rate, requests/s.
    pub arrival_rate_rps: f64,
    /// kvroute's default policy fed what the online filter sees
    /// ([`PrefixView::FilterText`]): the prediction for the online run.
    pub kvroute_filter_view: RouterReport,
    /// kvroute's default policy fed the trace's block ids ([`PrefixView::TraceIds`], the
    /// sweep's view), for comparison.
    pub kvroute_trace_ids: RouterReport,
    /// Round robin (sees no prefix).
    pub round_robin: RouterReport,
}

/// Offline prediction for (Mooncake, 4 replicas, 70 % load, first 10 minutes): TTFT p50 and
/// hit rate of kvroute's default policy (fed what the filter sees, and the trace's ids) and
/// of round robin, plus the arrival-rate scale.
pub fn crosscheck(mooncake: &[TraceRow], engine: &EngineConfig, base: &BenchConfig) -> CrossCheck {
    let slice_minutes = 10.0;
    let rows: Vec<TraceRow> = mooncake
        .iter()
        .filter(|r| (r.timestamp as f64) < slice_minutes * 60_000.0)
        .cloned()
        .collect();
    let replicas = 4;
    let load = 0.7;
    let capacity = measure_capacity(TraceKind::Mooncake.name(), &rows, engine, base, replicas);
    let scale = capacity.capacity_scale * load;
    let cfg = BenchConfig {
        replicas,
        time_compression: scale,
        ..base.clone()
    };
    let filter_cfg = BenchConfig {
        prefix_view: PrefixView::FilterText,
        ..cfg.clone()
    };
    let kv = RouterKind::kvroute_default();
    let (kvroute_filter_view, (kvroute_trace_ids, round_robin)) = rayon::join(
        || run_router(&rows, engine, &filter_cfg, kv),
        || {
            rayon::join(
                || run_router(&rows, engine, &cfg, kv),
                || run_router(&rows, engine, &cfg, RouterKind::RoundRobin),
            )
        },
    );
    CrossCheck {
        slice_minutes,
        rows: rows.len(),
        replicas,
        load,
        arrival_rate_rps: native_rate(&rows) * scale,
        time_compression: scale,
        capacity,
        kvroute_filter_view,
        kvroute_trace_ids,
        round_robin,
    }
}
