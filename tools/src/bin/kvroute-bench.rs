//! `kvroute-bench`: the routing-quality benchmark (issue 7). kvroute's picker against
//! round robin, least request, llm-d's EPP, SGLang `cache_aware`, NVIDIA Dynamo's KV router
//! and an oracle, on simulated engine replicas in virtual time
//! (see `kvroute_tools::routebench`).
//!
//! Subcommands:
//! - `sweep`: capacity per (trace, fleet), then every (trace, fleet, load, router) cell;
//!   prints the goal and the tables, writes `report.json`, `tables.md` and SVG plots;
//! - `single`: one trace, one fleet, one time-compression factor, every router;
//! - `crosscheck`: the offline prediction for the online cross-check (Mooncake, 4
//!   replicas, 70 % load, first 10 minutes).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Context};
use clap::{Args, Parser, Subcommand};
use kvroute_core::picker::{HybridWeights, PickerConfig};
use kvroute_core::profile::builtin;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_sim::trace::TraceRow;
use kvroute_tools::routebench::output::{
    render_goal, render_headline, render_output_error, render_tables, table_row, write_all,
    TABLE_HEADER,
};
use kvroute_tools::routebench::sweep::{
    crosscheck, native_rate, run_sweep, Cell, SweepConfig, Workload,
};
use kvroute_tools::routebench::workers::{
    WorkerModel, DEFAULT_AFFINITY_SYNC_MS, DEFAULT_INFLIGHT_SHARE_MS, TICK_MS,
};
use kvroute_tools::routebench::workload::TraceKind;
use kvroute_tools::routebench::{run_router, BenchConfig, RouterKind};
use rayon::prelude::*;

#[derive(Debug, Parser)]
#[command(
    about = "Routing-quality benchmark: kvroute vs llm-d, SGLang, Dynamo, baselines (virtual time)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Full sweep: traces × fleets × loads × routers.
    Sweep(SweepArgs),
    /// One trace, one fleet, one arrival-rate scale, every router.
    Single(SingleArgs),
    /// Offline prediction for the online cross-check.
    Crosscheck(Common),
}

#[derive(Debug, Args, Clone)]
struct Common {
    /// Shared data directory (traces/, prompts/); default `$KVROUTE_SHARED_DATA`, else
    /// `../shared/data` beside the workspace (`kvroute_core::shared_data::dir`).
    #[arg(long, default_value_os_t = kvroute_core::shared_data::dir())]
    data: PathBuf,
    /// Model (built-in profile); the simulator picks its GPU perf profile.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Stats scrape interval (virtual ms; kvroute-cp default 200).
    #[arg(long, default_value_t = 200)]
    scrape_ms: u64,
    /// Delay from scrape to router (virtual ms; kvroute-cp push coalescing default 10).
    #[arg(long, default_value_t = 10)]
    push_delay_ms: u64,
    /// Seed of every tie-break and of the ShareGPT arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// kvroute hybrid weight: KV headroom (default: kvroute-core's).
    #[arg(long)]
    w_kv: Option<f64>,
    /// kvroute hybrid weight: queue depth.
    #[arg(long)]
    w_queue: Option<f64>,
    /// kvroute hybrid weight: in-flight tokens.
    #[arg(long)]
    w_inflight: Option<f64>,
    /// kvroute hybrid weight: prefix overlap.
    #[arg(long)]
    w_prefix: Option<f64>,
    /// kvroute's `usage_sample_ms`: responses whose usage its learner reads (a token bucket
    /// of 100 per model, one back every this many virtual ms; 0 = every response; default
    /// the filter's).
    #[arg(long)]
    usage_sample_ms: Option<u64>,
    /// Envoy worker threads kvroute routes on, each with its own router, in-flight table and
    /// prefix index, sharing as the filter does (`kvroute_tools::routebench::workers`); the
    /// baselines stay one router each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    filter_workers: u64,
    /// The filter's `inflight_share_ms` with more than one worker (virtual ms; 0 = read and
    /// publish at every request).
    #[arg(long, default_value_t = DEFAULT_INFLIGHT_SHARE_MS)]
    inflight_share_ms: u64,
    /// With more than one worker, share no prefix affinity and no learner observations
    /// between them (the filter's `share_affinity` and `share_learning` off).
    #[arg(long)]
    no_journals: bool,
    /// The filter workers' longest tick period (virtual ms; the filter's 100, shortened to
    /// `--affinity-sync-ms` as the filter does): publication of changed in-flight tables,
    /// re-reads of stale copies.
    #[arg(long, default_value_t = TICK_MS, value_parser = clap::value_parser!(u64).range(1..))]
    filter_tick_ms: u64,
    /// The filter's `affinity_sync_ms` (virtual ms, ≥ 1 as the filter requires): journal
    /// syncs on the tick.
    #[arg(long, default_value_t = DEFAULT_AFFINITY_SYNC_MS, value_parser = clap::value_parser!(u64).range(1..))]
    affinity_sync_ms: u64,
}

#[derive(Debug, Args)]
struct SweepArgs {
    #[command(flatten)]
    common: Common,
    /// Output directory for report.json, tables.md and the SVG plots.
    #[arg(long, default_value = "out/bench")]
    out: PathBuf,
    /// Traces (mooncake, azure_conv, sharegpt_multiround).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "mooncake,azure_conv,sharegpt_multiround"
    )]
    traces: Vec<String>,
    /// First rows of the Mooncake trace (0 = all).
    #[arg(long, default_value_t = 1500)]
    rows_mooncake: usize,
    /// First rows of the Azure conv trace (0 = all).
    #[arg(long, default_value_t = 3000)]
    rows_azure: usize,
    /// First rows of the ShareGPT multi-round set (0 = all 252).
    #[arg(long, default_value_t = 0)]
    rows_sharegpt: usize,
    /// Fleet sizes.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    fleets: Vec<usize>,
    /// Loads, % of measured capacity.
    #[arg(long, value_delimiter = ',', default_value = "50,70,90,110")]
    loads: Vec<f64>,
    /// Routers (names as printed); default all nine.
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Fleet size of the headline table.
    #[arg(long, default_value_t = 8)]
    headline_replicas: usize,
    /// Load (%) of the headline table.
    #[arg(long, default_value_t = 90.0)]
    headline_load: f64,
}

#[derive(Debug, Args)]
struct SingleArgs {
    #[command(flatten)]
    common: Common,
    /// Trace (mooncake, azure_conv, sharegpt_multiround).
    #[arg(long, default_value = "mooncake")]
    trace: String,
    /// Engine replicas.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// First rows (0 = all).
    #[arg(long, default_value_t = 1750)]
    rows: usize,
    /// Divide arrival times by this (×k traffic rate).
    #[arg(long, default_value_t = 2.0)]
    compress: f64,
    /// Routers (names as printed); default all nine.
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Also print the reports as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_routers(names: &[String]) -> anyhow::Result<Vec<RouterKind>> {
    if names.is_empty() {
        return Ok(RouterKind::all().to_vec());
    }
    names
        .iter()
        .map(|n| RouterKind::from_name(n).ok_or_else(|| anyhow!("unknown router `{n}`")))
        .collect()
}

fn trace_kind(name: &str) -> anyhow::Result<TraceKind> {
    TraceKind::ALL
        .into_iter()
        .find(|k| k.name() == name)
        .ok_or_else(|| {
            anyhow!("unknown trace `{name}` (mooncake, azure_conv, sharegpt_multiround)")
        })
}

fn setup(c: &Common) -> anyhow::Result<(EngineConfig, BenchConfig)> {
    let model = builtin(&c.model).ok_or_else(|| anyhow!("unknown model `{}`", c.model))?;
    let replica = ReplicaConfig::for_model(model, Dialect::VllmV1, 1.0, 0).context("KV sizing")?;
    let d = HybridWeights::default();
    let weights = HybridWeights {
        kv_headroom: c.w_kv.unwrap_or(d.kv_headroom),
        queue: c.w_queue.unwrap_or(d.queue),
        inflight: c.w_inflight.unwrap_or(d.inflight),
        prefix: c.w_prefix.unwrap_or(d.prefix),
        ..d
    };
    let picker = PickerConfig {
        weights,
        ..PickerConfig::default()
    };
    picker.validate().context("kvroute weights")?;
    let base = BenchConfig {
        scrape_interval_ms: c.scrape_ms.max(1),
        push_delay_ms: c.push_delay_ms,
        picker,
        ..BenchConfig::new(1, 1.0, c.seed, &c.model)
    };
    let base = BenchConfig {
        usage_sample_ms: c.usage_sample_ms.unwrap_or(base.usage_sample_ms),
        workers: WorkerModel {
            count: usize::try_from(c.filter_workers).unwrap_or(1),
            inflight_share_ms: c.inflight_share_ms,
            journals: !c.no_journals,
            tick_ms: c.filter_tick_ms,
            affinity_sync_ms: c.affinity_sync_ms,
        },
        ..base
    };
    Ok((replica.engine, base))
}

/// How kvroute runs, for a run's header line (empty for one worker, the default).
fn workers_note(w: WorkerModel) -> String {
    if w.count > 1 {
        format!(
            ", kvroute on {} filter workers (inflight_share_ms {}, tick {} ms, journals {})",
            w.count,
            w.inflight_share_ms,
            w.tick(),
            if w.journals {
                format!("synced every {} ms", w.affinity_sync_ms)
            } else {
                "off".to_string()
            }
        )
    } else {
        String::new()
    }
}

fn load(c: &Common, kind: TraceKind, rows: usize) -> anyhow::Result<Vec<TraceRow>> {
    let mut r = kind
        .load(&c.data, c.seed)
        .with_context(|| format!("loading {}", kind.name()))?;
    if rows > 0 {
        r.truncate(rows);
    }
    Ok(r)
}

fn sweep(a: SweepArgs) -> anyhow::Result<()> {
    let (engine, base) = setup(&a.common)?;
    let mut workloads = Vec::new();
    for t in &a.traces {
        let kind = trace_kind(t)?;
        let rows = match kind {
            TraceKind::Mooncake => a.rows_mooncake,
            TraceKind::AzureConv => a.rows_azure,
            TraceKind::SharegptMultiround => a.rows_sharegpt,
        };
        workloads.push(Workload {
            kind,
            rows: load(&a.common, kind, rows)?,
        });
    }
    let routers = parse_routers(&a.routers)?;
    let cfg = SweepConfig {
        fleets: a.fleets.clone(),
        loads: a.loads.iter().map(|l| l / 100.0).collect(),
        routers,
        base,
    };
    let note = workers_note(cfg.base.workers);
    if !note.is_empty() {
        println!("{}", note.trim_start_matches(", "));
    }
    for w in &workloads {
        println!(
            "{}: {} rows, native {:.2} req/s",
            w.kind.name(),
            w.rows.len(),
            native_rate(&w.rows)
        );
    }
    let t0 = Instant::now();
    let report = run_sweep(&workloads, &engine, &cfg);
    let wall = t0.elapsed();
    println!(
        "\n## Headline ({} replicas, {}% load)\n",
        a.headline_replicas, a.headline_load
    );
    print!(
        "{}",
        render_headline(&report, a.headline_replicas, a.headline_load / 100.0)
    );
    println!("\n## Goal\n");
    print!("{}", render_goal(&report));
    println!("\n## Output-length prediction error\n");
    print!("{}", render_output_error(&report));
    println!("\n## Tables\n");
    print!("{}", render_tables(&report));
    let paths = write_all(&report, &a.out)?;
    for p in paths {
        println!("wrote {}", p.display());
    }
    println!(
        "sweep wall time {:.1} s ({} cells, {} threads)",
        wall.as_secs_f64(),
        report.cells.len(),
        rayon::current_num_threads()
    );
    Ok(())
}

fn single(a: SingleArgs) -> anyhow::Result<()> {
    let (engine, base) = setup(&a.common)?;
    let kind = trace_kind(&a.trace)?;
    let rows = load(&a.common, kind, a.rows)?;
    let cfg = BenchConfig {
        replicas: a.replicas,
        time_compression: a.compress,
        ..base
    };
    let routers = parse_routers(&a.routers)?;
    let t0 = Instant::now();
    let reports: Vec<_> = routers
        .par_iter()
        .map(|&k| run_router(&rows, &engine, &cfg, k))
        .collect();
    let rate = native_rate(&rows) * a.compress;
    println!(
        "kvroute-bench single: {} rows of {} ×{} ({:.2} req/s), {} × {}, scrape {} ms + push {} ms, seed {}{}\n",
        rows.len(),
        kind.name(),
        a.compress,
        rate,
        a.replicas,
        a.common.model,
        cfg.scrape_interval_ms,
        cfg.push_delay_ms,
        cfg.seed,
        workers_note(cfg.workers)
    );
    print!("{TABLE_HEADER}");
    for r in &reports {
        let c = Cell {
            trace: kind.name().to_string(),
            replicas: a.replicas,
            load: 0.0,
            time_compression: a.compress,
            arrival_rate_rps: rate,
            report: r.clone(),
        };
        print!("{}", table_row(&c, 0.0));
    }
    for r in &reports {
        println!(
            "{}: finished {}/{} rejected {} per-replica {:?}",
            r.router, r.finished, r.requests, r.rejected, r.per_replica
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    println!("wall {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

fn cross(c: Common) -> anyhow::Result<()> {
    let (engine, base) = setup(&c)?;
    let rows = load(&c, TraceKind::Mooncake, 0)?;
    let x = crosscheck(&rows, &engine, &base);
    println!(
        "offline prediction: Mooncake first {} min ({} rows), {} replicas, {:.0}% load",
        x.slice_minutes,
        x.rows,
        x.replicas,
        x.load * 100.0
    );
    println!(
        "capacity {:.3} req/s (×{:.4} the slice's {:.3} req/s); replay at ×{:.4} = {:.3} req/s (divide the slice's timestamps by {:.4})",
        x.capacity.capacity_rps,
        x.capacity.capacity_scale,
        x.capacity.native_rate_rps,
        x.time_compression,
        x.arrival_rate_rps,
        x.time_compression
    );
    for (r, view) in [
        (
            &x.kvroute_filter_view,
            " (what the filter sees: the prediction)",
        ),
        (&x.kvroute_trace_ids, " (trace block ids, the sweep's view)"),
        (&x.round_robin, ""),
    ] {
        println!(
            "{}{view}: TTFT p50 {:.3} s, prefix-cache hit rate {:.4}, TTFT p99 {:.3} s, finished {}/{}",
            r.router, r.ttft_p50, r.prefix_hit_ratio, r.ttft_p99, r.finished, r.requests
        );
    }
    println!("{}", serde_json::to_string_pretty(&x)?);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Sweep(a) => sweep(a),
        Cmd::Single(a) => single(a),
        Cmd::Crosscheck(c) => cross(c),
    }
}
