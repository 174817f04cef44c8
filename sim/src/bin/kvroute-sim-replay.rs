//! `kvroute-sim-replay`: run a Mooncake trace through the engine model alone, in virtual
//! time, and print the report and the wall time it took (the issue-4 benchmark:
//! one hour of trace in under 60 s).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Context};
use clap::Parser;
use kvroute_core::profile::builtin;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::ReplicaConfig;
use kvroute_sim::trace::{load_mooncake, replay};

/// Replay a Mooncake JSONL trace through simulated replicas (round-robin).
#[derive(Debug, Parser)]
struct Args {
    /// Trace file (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: PathBuf,
    /// Replicas.
    #[arg(long, default_value_t = 16)]
    replicas: usize,
    /// Model (kvroute-core built-in profile).
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Only the first N rows (default: all).
    #[arg(long)]
    limit: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let model = builtin(&a.model).ok_or_else(|| anyhow!("unknown model `{}`", a.model))?;
    let cfg = ReplicaConfig::for_model(model, Dialect::VllmV1, 1.0, 0).context("KV sizing")?;
    let t0 = Instant::now();
    let mut rows = load_mooncake(&a.trace)?;
    if let Some(n) = a.limit {
        rows.truncate(n);
    }
    let loaded = t0.elapsed();
    let report = replay(&rows, &cfg.engine, a.replicas, &a.model);
    let wall = t0.elapsed();
    println!("{}", serde_json::to_string_pretty(&report)?);
    println!(
        "kvroute-sim-replay: {} rows, {:.0} virtual s, wall {:.2} s (load {:.2} s), {:.0}x real time",
        report.requests,
        report.virtual_seconds,
        wall.as_secs_f64(),
        loaded.as_secs_f64(),
        report.virtual_seconds / wall.as_secs_f64().max(1e-9)
    );
    Ok(())
}
