//! `kvroute-routebench`: replay the first minutes of the Mooncake conversation trace over N
//! simulated replicas, once per router (kvroute policies, llm-d EPP, SGLang cache_aware), in
//! virtual time, and print a side-by-side table (see `kvroute_integration::routebench`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Context};
use clap::Parser;
use kvroute_core::profile::builtin;
use kvroute_integration::routebench::{render_table, run_all, BenchConfig, RouterKind};
use kvroute_integration::sim::metrics::Dialect;
use kvroute_integration::sim::perf::perf_profile_for;
use kvroute_integration::sim::server::ReplicaConfig;
use kvroute_integration::sim::trace::load_mooncake;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "Side-by-side routing benchmark on the Mooncake trace (virtual time)")]
struct Args {
    /// Mooncake JSONL trace.
    #[arg(long)]
    trace: PathBuf,
    /// Engine replicas.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// Model (built-in profile name); the sim picks its perf profile.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Keep trace rows with timestamp < this many minutes.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Divide arrival times by this (×k traffic rate).
    #[arg(long, default_value_t = 2.0)]
    compress: f64,
    /// Snapshot refresh period (virtual milliseconds).
    #[arg(long, default_value_t = 200)]
    snapshot_ms: u64,
    /// Seed for every tie-break.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also print the reports as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let model = builtin(&a.model).ok_or_else(|| anyhow!("unknown model `{}`", a.model))?;
    let perf_id = perf_profile_for(&model).id;
    let replica = ReplicaConfig::for_model(model, Dialect::VllmV1, 1.0, 0).context("KV sizing")?;
    let mut rows = load_mooncake(&a.trace)?;
    let cutoff_ms = (a.minutes.max(0.0) * 60_000.0) as u64;
    rows.retain(|r| r.timestamp < cutoff_ms);
    let cfg = BenchConfig {
        replicas: a.replicas,
        time_compression: a.compress,
        snapshot_interval_ms: a.snapshot_ms,
        seed: a.seed,
        model: a.model.clone(),
    };
    let t0 = Instant::now();
    let reports = run_all(&rows, &replica.engine, &cfg, &RouterKind::all());
    let wall = t0.elapsed();
    println!(
        "kvroute-routebench: {} rows ({} min of trace ×{} → {:.0} s), {} × {} ({}), {} KV tokens/replica, snapshot {} ms, seed {}",
        rows.len(),
        a.minutes,
        a.compress,
        a.minutes * 60.0 / a.compress.max(1e-6),
        a.replicas,
        a.model,
        perf_id,
        u64::from(replica.engine.num_gpu_blocks) * u64::from(replica.engine.block_size),
        a.snapshot_ms,
        a.seed
    );
    print!("{}", render_table(&reports));
    for r in &reports {
        println!(
            "{}: finished {}/{} rejected {} per-replica {:?}",
            r.router, r.finished, r.requests, r.rejected, r.per_replica
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    println!("wall {:.1} s", wall.as_secs_f64());
    Ok(())
}
