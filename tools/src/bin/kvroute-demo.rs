//! `kvroute-demo`: real traces through Envoy + the kvroute filter + kvroute-cp to a fleet of
//! model servers, compared with Envoy's round robin on the same traffic (issue 6).
//!
//! ```text
//! kvroute-demo                         # 4 simulated H100 replicas, Mooncake slice
//! kvroute-demo --backends 8 --policy prefix_affinity --duration 120
//! kvroute-demo real                    # 2 llama-server (SmolLM2-135M, CPU), ShareGPT prompts
//! ```
//! Prints the side-by-side table and where the report and plots are. Exit codes: 0 done,
//! 1 setup error (taken port, missing binary, ...), 130 interrupted (Ctrl-C / SIGTERM;
//! every process it started is stopped first). See `docs/demo.md`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_tools::demo::gateway::parse_policy;
use kvroute_tools::demo::llama::{llama_server_binary, smollm2_gguf, LlamaOptions, SMOLLM2_MODEL};
use kvroute_tools::demo::ports::{PortPlan, DEFAULT_BASE_PORT};
use kvroute_tools::demo::run::{run_demo, Arms, DemoOptions, DemoOutcome, Fleet};
use kvroute_tools::demo::signal::shutdown_signal;
use kvroute_tools::demo::sim::{SimOptions, DEFAULT_SIM_MODEL};
use kvroute_tools::replay::{
    default_trace_path, load_workload, RunOptions, TraceSource, WorkloadOptions,
};
use std::path::PathBuf;
use std::process::ExitCode;

/// Replay a real trace through Envoy + kvroute and through Envoy round robin, side by side.
#[derive(Debug, Parser)]
#[command(name = "kvroute-demo", version)]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    common: Common,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Real model servers: llama-server (llama.cpp, CPU) with SmolLM2-135M-Instruct,
    /// ShareGPT prompts.
    Real(RealArgs),
}

#[derive(Debug, clap::Args)]
struct RealArgs {
    /// llama-server instances.
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// Parallel slots per server (`-np`).
    #[arg(long, default_value_t = 4)]
    slots: u32,
    /// Context tokens per server (`-c`, split across slots).
    #[arg(long, default_value_t = 8192)]
    ctx: u32,
    /// CPU threads per server (`-t`).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Prompts to send.
    #[arg(long, default_value_t = 40)]
    requests: usize,
    /// Output tokens per request (max_tokens).
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Skip prompts estimated longer than this (tokens; a slot holds ctx/slots).
    #[arg(long, default_value_t = 1024)]
    max_prompt_tokens: u32,
}

#[derive(Debug, clap::Args)]
struct Common {
    /// Trace: mooncake, azure, sharegpt, sharegpt-multiround (simulated demo).
    #[arg(long, global = true, default_value = "mooncake")]
    trace: String,
    /// Trace file (default: the kind's file under $KVROUTE_SHARED_DATA).
    #[arg(long, global = true)]
    file: Option<PathBuf>,
    /// Simulated replicas.
    #[arg(long, default_value_t = 4)]
    backends: usize,
    /// Trace slice start, trace seconds (390: the stretch of the Mooncake trace's first hour
    /// with the most prefix reuse inside a short window).
    #[arg(long, global = true, default_value_t = 390.0)]
    start: f64,
    /// Trace slice length, trace seconds.
    #[arg(long, global = true, default_value_t = 120.0)]
    duration: f64,
    /// Arrival-rate multiplier (0.5 = half the trace's rate; the Mooncake trace was recorded
    /// on a much larger cluster than 4 replicas).
    #[arg(long, default_value_t = 0.5)]
    rate_scale: f64,
    /// Cap on output tokens per request (the streamed token rate is what a small machine
    /// runs out of first; 0 = the trace's lengths).
    #[arg(long, default_value_t = 64)]
    max_output_tokens: u32,
    /// At most this many requests of the slice.
    #[arg(long, global = true)]
    max_requests: Option<usize>,
    /// kvroute picker policy: hybrid, prefix_affinity, least_kv, least_request, round_robin, random, predicted_ttft.
    #[arg(long, global = true, default_value = "hybrid")]
    policy: String,
    /// Simulated seconds per wall second; the trace's send times are compressed by the same
    /// factor (simulated demo only).
    #[arg(long, default_value_t = 10.0)]
    time_scale: f64,
    /// Base port: Envoy listener B, ingest B+1, kvroute-cp B+2, backends B+10.. .
    #[arg(long, global = true, default_value_t = DEFAULT_BASE_PORT, env = "KVROUTE_DEMO_PORT")]
    base_port: u16,
    /// Envoy listener port (overrides the base layout).
    #[arg(long, global = true)]
    listen_port: Option<u16>,
    /// Filter ingest listener port.
    #[arg(long, global = true)]
    ingest_port: Option<u16>,
    /// kvroute-cp HTTP port.
    #[arg(long, global = true)]
    cp_port: Option<u16>,
    /// First backend port.
    #[arg(long, global = true)]
    backend_port: Option<u16>,
    /// Envoy worker threads.
    #[arg(long, global = true, default_value_t = 2)]
    envoy_concurrency: u32,
    /// Client-side cap on requests in flight.
    #[arg(long, global = true, default_value_t = 256)]
    concurrency_cap: usize,
    /// Seed of every random choice.
    #[arg(long, global = true, default_value_t = 1)]
    seed: u64,
    /// Report directory (JSON + SVG plots).
    #[arg(long, global = true, default_value = "out/demo")]
    out: PathBuf,
    /// Skip the Envoy round-robin run.
    #[arg(long, global = true)]
    no_compare: bool,
    /// Run only Envoy round robin (no kvroute run); with `--no-compare` and a second
    /// process, the two arms of a long replay can run in parallel on a large machine.
    #[arg(long, global = true, conflicts_with = "no_compare")]
    round_robin_only: bool,
}

fn arms(c: &Common) -> Arms {
    match (c.no_compare, c.round_robin_only) {
        (true, _) => Arms::KvrouteOnly,
        (false, true) => Arms::RoundRobinOnly,
        (false, false) => Arms::Both,
    }
}

fn ports(c: &Common, backends: usize) -> anyhow::Result<PortPlan> {
    let mut p = PortPlan::from_base(c.base_port, backends)?;
    if let Some(v) = c.listen_port {
        p.listen = v;
    }
    if let Some(v) = c.ingest_port {
        p.ingest = v;
    }
    if let Some(v) = c.cp_port {
        p.cp = v;
    }
    if let Some(v) = c.backend_port {
        p.backend_base = v;
    }
    Ok(p)
}

fn source(c: &Common) -> anyhow::Result<TraceSource> {
    let file = c
        .file
        .clone()
        .unwrap_or_else(|| default_trace_path(&c.trace));
    Ok(match c.trace.as_str() {
        "mooncake" => TraceSource::Mooncake(file),
        "azure" => TraceSource::AzureCsv(file),
        "sharegpt" | "sharegpt-multiround" => TraceSource::ShareGpt(file),
        other => anyhow::bail!(
            "unknown --trace {other}: expected mooncake, azure, sharegpt or sharegpt-multiround"
        ),
    })
}

async fn demo(a: Args) -> anyhow::Result<DemoOutcome> {
    let c = &a.common;
    let policy = parse_policy(&c.policy)?;
    let mut run = RunOptions::new("", "");
    run.concurrency_cap = c.concurrency_cap;
    run.progress = true;
    let (opts, reqs) = match &a.cmd {
        None => {
            let mut w = WorkloadOptions::new(source(c)?);
            w.start_s = c.start;
            w.duration_s = Some(c.duration);
            w.max_requests = c.max_requests;
            w.time_scale = c.time_scale;
            w.rate_scale = c.rate_scale;
            w.max_output_tokens = (c.max_output_tokens > 0).then_some(c.max_output_tokens);
            w.seed = c.seed;
            w.model = DEFAULT_SIM_MODEL.to_owned();
            w.sim_extension = true;
            let reqs = load_workload(&w).context(
                "loading the trace (the shared data: ../shared/data beside the repository, \
                 or KVROUTE_SHARED_DATA / make demo KVROUTE_SHARED_DATA=<dir>)",
            )?;
            eprintln!(
                "kvroute-demo: simulated replicas run {}x faster than real time; the table's latencies and tokens/s are wall-clock (multiply latencies by {} for simulated H100 seconds)",
                c.time_scale, c.time_scale
            );
            let fleet = Fleet::Sim(SimOptions {
                replicas: c.backends,
                model: DEFAULT_SIM_MODEL.to_owned(),
                time_scale: c.time_scale,
                seed: c.seed,
                base_port: 0,
            });
            (
                DemoOptions {
                    fleet,
                    model: DEFAULT_SIM_MODEL.to_owned(),
                    policy,
                    ports: ports(c, c.backends)?,
                    envoy_concurrency: c.envoy_concurrency,
                    run,
                    out: Some(c.out.clone()),
                    arms: arms(c),
                    verbose: true,
                },
                reqs,
            )
        }
        Some(Cmd::Real(r)) => {
            let trace = if c.trace == "mooncake" {
                "sharegpt"
            } else {
                c.trace.as_str()
            };
            let file = c.file.clone().unwrap_or_else(|| default_trace_path(trace));
            let mut w = WorkloadOptions::new(TraceSource::ShareGpt(file));
            w.sharegpt_rate_rps = r.rate;
            w.max_requests = Some(c.max_requests.unwrap_or(r.requests));
            w.max_output_tokens = Some(r.max_tokens);
            w.max_prompt_tokens = Some(r.max_prompt_tokens);
            w.seed = c.seed;
            w.model = SMOLLM2_MODEL.to_owned();
            w.sim_extension = false;
            let reqs = load_workload(&w).context("loading the prompts")?;
            let mut lo = LlamaOptions::new(llama_server_binary()?, smollm2_gguf()?);
            lo.slots = r.slots;
            lo.ctx = r.ctx;
            lo.threads = r.threads;
            let fleet = Fleet::Llama {
                servers: r.servers,
                opts: lo,
            };
            (
                DemoOptions {
                    fleet,
                    model: SMOLLM2_MODEL.to_owned(),
                    policy,
                    ports: ports(c, r.servers)?,
                    envoy_concurrency: c.envoy_concurrency,
                    run,
                    out: Some(c.out.clone()),
                    arms: arms(c),
                    verbose: true,
                },
                reqs,
            )
        }
    };
    eprintln!("kvroute-demo: {} requests loaded", reqs.len());
    Ok(run_demo(&reqs, &opts).await?)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let mut run = Box::pin(demo(args));
    tokio::select! {
        r = &mut run => match r {
            Ok(out) => {
                println!("{}", out.table);
                println!("(×k: this column ÷ the first column; on latency rows k > 1 means the first column was faster, on the hit-rate row k < 1 means the first column hit more)");
                for run in &out.runs {
                    if run.gateway.filter_decisions > 0 {
                        println!(
                            "{}: {} requests routed by the filter, {} fell open, {} took the default route; snapshot age max {} ms",
                            run.summary.label,
                            run.gateway.filter_decisions,
                            run.gateway.fail_open,
                            run.gateway.default_route,
                            run.gateway.max_snapshot_age_ms.map_or("?".into(), |v| v.to_string()),
                        );
                    }
                    if let Some(d) = &run.decisions {
                        println!(
                            "{}: why each request went where (decision records, docs/filter.md): {}, {} lines; for example",
                            run.summary.label,
                            d.path.display(),
                            d.records.len(),
                        );
                        for r in d.examples(3) {
                            println!("  {r}");
                        }
                    }
                }
                if let Some(f) = &out.files {
                    println!("report: {}", f.json.display());
                    for p in &f.plots {
                        println!("plot:   {}", p.display());
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvroute-demo: error: {e:#}");
                ExitCode::from(1)
            }
        },
        sig = shutdown_signal() => {
            // Dropping the demo future kills the Envoy and llama-server children (their
            // guards kill and reap on drop) and stops the in-process simulators and
            // kvroute-cp.
            drop(run);
            eprintln!("kvroute-demo: {sig}: stopped every process it started");
            ExitCode::from(130)
        }
    }
}
