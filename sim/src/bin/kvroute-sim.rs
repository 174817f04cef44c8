//! `kvroute-sim`: a fleet of simulated vLLM-compatible model servers in one process.
//!
//! Prints `kvroute-sim: replica <i> listening on http://<addr>` for each replica once all are
//! bound, then serves until killed. See `docs/sim.md`.

use std::net::IpAddr;

use anyhow::{anyhow, Context};
use clap::Parser;
use kvroute_core::profile::{builtin, builtin_profiles};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::perf::perf_profile;
use kvroute_sim::server::{spawn_fleet, FleetConfig, ReplicaConfig};

/// Simulated vLLM replicas with paged KV cache, prefix caching and continuous batching.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version)]
struct Args {
    /// Model (a kvroute-core built-in profile name).
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Name to serve the model as (default: --model).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Number of replicas, each on its own port (1..=1024).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    replicas: u16,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// First port (replica i gets port+i); 0 = ephemeral ports (printed on stdout).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Metric names: vllm (V1), vllm-v0, sglang, llamacpp.
    #[arg(long, default_value = "vllm")]
    metrics_dialect: String,
    /// Virtual seconds per wall second (e.g. 100 = 100x faster than a GPU; inf = no waiting).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the default output-length draw.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Override the KV cache size in blocks (default: from GPU memory and the model).
    #[arg(long)]
    num_gpu_blocks: Option<u32>,
    /// Override max_model_len (tokens).
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Token budget per step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: u32,
    /// Maximum running requests.
    #[arg(long, default_value_t = 1024)]
    max_num_seqs: u32,
    /// fcfs or priority.
    #[arg(long, default_value = "fcfs")]
    scheduling_policy: String,
    /// Step-time profile id (h100-llama-3.1-8b, h100x2-qwen3-32b); default: by model.
    #[arg(long)]
    perf_profile: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut model = builtin(&a.model).ok_or_else(|| {
        let known: Vec<String> = builtin_profiles().into_iter().map(|p| p.name).collect();
        anyhow!("unknown model `{}`; known: {}", a.model, known.join(", "))
    })?;
    if let Some(n) = a.max_model_len {
        model.max_model_len = n;
    }
    let dialect: Dialect = a.metrics_dialect.parse()?;
    let time_scale = if a.time_scale.is_nan() || a.time_scale <= 0.0 {
        return Err(anyhow!("--time-scale must be > 0"));
    } else {
        a.time_scale
    };
    let mut replica = ReplicaConfig::for_model(model, dialect, time_scale, a.seed)
        .context("sizing the KV cache")?;
    if let Some(name) = a.served_model_name {
        replica.served_model_name = name;
    }
    if let Some(n) = a.num_gpu_blocks {
        replica.engine.num_gpu_blocks = n;
    }
    if let Some(id) = &a.perf_profile {
        replica.engine.step = perf_profile(id)
            .ok_or_else(|| anyhow!("unknown --perf-profile `{id}`"))?
            .step;
    }
    replica.engine.max_num_batched_tokens = a.max_num_batched_tokens.max(1);
    replica.engine.max_num_seqs = a.max_num_seqs.max(1);
    replica.engine.priority_scheduling = match a.scheduling_policy.as_str() {
        "fcfs" => false,
        "priority" => true,
        other => return Err(anyhow!("unknown --scheduling-policy `{other}`")),
    };
    let blocks = replica.engine.num_gpu_blocks;
    let fleet = spawn_fleet(FleetConfig {
        replica,
        replicas: usize::from(a.replicas),
        bind: a.host,
        base_port: a.port,
    })
    .await?;
    eprintln!(
        "kvroute-sim: model {} dialect {} num_gpu_blocks {} time_scale {}",
        a.model, a.metrics_dialect, blocks, time_scale
    );
    for (i, addr) in fleet.addrs().iter().enumerate() {
        println!("kvroute-sim: replica {i} listening on http://{addr}");
    }
    tokio::signal::ctrl_c().await?;
    drop(fleet);
    Ok(())
}
