//! `kvroute-replay`: replay a real trace against an OpenAI-compatible endpoint, print the
//! summary table and write a JSON report with SVG plots. See `docs/replay.md`.
//!
//! Exit status: 0 after a run (request failures are reported, not fatal); non-zero only for
//! setup errors (bad flags, unreadable trace, unwritable output directory).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use kvroute_tools::replay::{
    default_trace_path, kv::parse_target, load_workload, render_table, run, write_report,
    RunOptions, TraceSource, WorkloadOptions, DEFAULT_MODEL,
};

/// Trace formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Trace {
    /// Mooncake FAST'25 JSONL (prefix-sharing conversation trace).
    Mooncake,
    /// Azure LLM inference CSV (Splitwise).
    Azure,
    /// ShareGPT prompts (v3 or LMBenchmark multi-round JSON) with Poisson arrivals.
    Sharegpt,
}

/// Open-loop replay of real LLM request traces with TTFT/TPOT/E2E measurement.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Trace format.
    #[arg(long, value_enum, default_value_t = Trace::Mooncake)]
    trace: Trace,
    /// Trace file (default: the shared-data file of the format, under $KVROUTE_SHARED_DATA).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Chat-completions URL.
    #[arg(long, default_value = "http://127.0.0.1:10000/v1/chat/completions")]
    url: String,
    /// Policy name in the report.
    #[arg(long, default_value = "run")]
    label: String,
    /// `model` field of the requests.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Slice start, trace seconds.
    #[arg(long, default_value_t = 0.0)]
    start: f64,
    /// Slice length, trace seconds (default: to the end).
    #[arg(long)]
    duration: Option<f64>,
    /// At most this many requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Arrival-rate multiplier.
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// Time compression (match kvroute-sim --time-scale).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Poisson rate for ShareGPT, requests per second.
    #[arg(long, default_value_t = 1.0)]
    sharegpt_rate: f64,
    /// Seed of Poisson gaps and filler text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Cap on output tokens per request.
    #[arg(long)]
    max_output_tokens: Option<u32>,
    /// Skip requests with longer prompts (tokens).
    #[arg(long)]
    max_prompt_tokens: Option<u32>,
    /// Attach the kvroute_sim extension (exact lengths and block ids; kvroute-sim only).
    #[arg(long)]
    sim_extension: bool,
    /// Send `ignore_eos: true` (vLLM, SGLang, llama.cpp) so outputs have the trace length.
    #[arg(long)]
    ignore_eos: bool,
    /// Requests in flight at most (0 = unlimited); the client-side wait counts in latency.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Per-request timeout, seconds from the scheduled send time.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Response header naming the backend that served.
    #[arg(long)]
    backend_header: Option<String>,
    /// KV sampling targets: name=kind@metrics_url, comma-separated
    /// (kinds: vllm, sglang, tgi, llamacpp, trtllm, llmd-sim, auto).
    #[arg(long, value_delimiter = ',')]
    kv_sample: Vec<String>,
    /// KV sampling period, seconds.
    #[arg(long, default_value_t = 0.5)]
    kv_sample_interval: f64,
    /// Output directory for report.json and the SVG plots.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Load the workload, print its size and exit without sending.
    #[arg(long)]
    dry_run: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (kind, wrap): (&str, fn(PathBuf) -> TraceSource) = match a.trace {
        Trace::Mooncake => ("mooncake", TraceSource::Mooncake),
        Trace::Azure => ("azure", TraceSource::AzureCsv),
        Trace::Sharegpt => ("sharegpt", TraceSource::ShareGpt),
    };
    let file = a.file.clone().unwrap_or_else(|| default_trace_path(kind));
    let mut w = WorkloadOptions::new(wrap(file));
    w.start_s = a.start;
    w.duration_s = a.duration;
    w.rate_scale = a.rate_scale;
    w.time_scale = a.time_scale;
    w.max_requests = a.max_requests;
    w.sharegpt_rate_rps = a.sharegpt_rate;
    w.seed = a.seed;
    w.model = a.model.clone();
    w.max_output_tokens = a.max_output_tokens;
    w.max_prompt_tokens = a.max_prompt_tokens;
    w.sim_extension = a.sim_extension;
    w.ignore_eos = a.ignore_eos;
    let reqs = load_workload(&w).context("loading the workload")?;
    let mut o = RunOptions::new(a.url.clone(), a.label.clone());
    o.concurrency_cap = a.concurrency;
    o.timeout_s = a.timeout;
    o.progress = !a.no_progress;
    o.backend_header = a.backend_header.clone();
    o.kv_sample = a
        .kv_sample
        .iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| parse_target(s))
        .collect::<Result<_, _>>()?;
    o.kv_sample_interval_s = a.kv_sample_interval;
    let last = reqs.last().map_or(0.0, |r| r.at_s);
    eprintln!(
        "kvroute-replay: {} requests over {last:.1} s to {}",
        reqs.len(),
        a.url
    );
    if a.dry_run {
        let prompt: u64 = reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum();
        let output: u64 = reqs.iter().map(|r| u64::from(r.output_tokens)).sum();
        let bytes: usize = reqs.iter().map(|r| r.body.len()).sum();
        println!(
            "{} requests over {last:.3} s: {prompt} prompt tokens, {output} output tokens, {bytes} body bytes",
            reqs.len()
        );
        return Ok(());
    }
    let rt = tokio::runtime::Runtime::new().context("starting tokio")?;
    let report = rt.block_on(run(&reqs, &o))?;
    println!("{}", render_table(&[report.summary()]));
    if let Some(dir) = &a.out {
        let files = write_report(dir, std::slice::from_ref(&report))?;
        println!("report: {}", files.json.display());
        for p in &files.plots {
            println!("plot:   {}", p.display());
        }
    }
    Ok(())
}
