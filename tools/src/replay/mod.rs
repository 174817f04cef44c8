//! `kvroute-replay`: open-loop replay of real LLM request traces against an OpenAI-compatible
//! endpoint (Envoy with the kvroute filter, a model server, or kvroute-sim), with per-request
//! TTFT / TPOT / E2E measurement, KV-usage sampling, a JSON report and SVG plots (issue 6).
//!
//! ## Pipeline
//! 1. [`load_workload`] turns a trace ([`TraceSource`]) into [`ReplayRequest`]s: a send time
//!    (wall seconds from the start of the run) and a ready-made streamed chat body
//!    ([`workload`] explains the text synthesis, time/rate scaling and slicing).
//! 2. [`run`] sends every request at its time (open loop) over hyper, parses the SSE stream
//!    with `eventsource-stream`, samples model-server `/metrics` through kvroute-cp's adapters,
//!    and returns a [`RunReport`] ([`client`] defines the measurements).
//! 3. [`RunReport::summary`], [`render_table`] and [`write_report`] turn runs into a
//!    side-by-side table, a JSON file and SVG plots ([`report`], [`plot`]).
//!
//! ## Example
//! ```no_run
//! # async fn demo() -> Result<(), kvroute_tools::replay::ReplayError> {
//! use kvroute_tools::replay::*;
//! let mut w = WorkloadOptions::new(TraceSource::Mooncake(default_trace_path("mooncake")));
//! w.max_requests = Some(200);
//! w.time_scale = 10.0;
//! let reqs = load_workload(&w)?;
//! let report = run(&reqs, &RunOptions::new("http://127.0.0.1:10000/v1/chat/completions", "kvroute")).await?;
//! println!("{}", render_table(&[report.summary()]));
//! # Ok(()) }
//! ```

pub mod client;
pub mod kv;
pub mod plot;
pub mod report;
pub mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use kvroute_sim::trace::TraceError;
use serde::{Deserialize, Serialize};

pub use client::run;
pub use report::{render_table, write_report};
pub use workload::load_workload;

/// Errors of the replay library. Only setup problems are errors: per-request failures
/// (non-2xx, connection errors, timeouts, malformed streams) are recorded in
/// [`RequestRecord::error`] and never abort a run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A trace, prompt or report file could not be read or written
    /// ([`TraceError::Io`]), or is malformed ([`TraceError::Parse`]).
    #[error(transparent)]
    File(#[from] TraceError),
    /// An option is out of range (names the option and the value).
    #[error("invalid option {option}={value}: {reason}")]
    Option {
        /// Option name, as in [`WorkloadOptions`] / [`RunOptions`].
        option: &'static str,
        /// The offending value.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// The report or a plot could not be rendered.
    #[error("rendering {what}: {message}")]
    Render {
        /// Which output.
        what: String,
        /// The cause.
        message: String,
    },
}

/// A trace file and its format (see `../shared/data/README.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TraceSource {
    /// Mooncake FAST'25 JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.
    Mooncake(PathBuf),
    /// Azure LLM inference trace CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`.
    AzureCsv(PathBuf),
    /// ShareGPT prompts: `sharegpt_v3_filtered_1000.json` (`[{id, conversations}]`) or an
    /// LMBenchmark multi-round file (`[{input, output_length}]`), with Poisson arrivals.
    ShareGpt(PathBuf),
}

/// Default file of a trace kind (`mooncake`, `azure`, `sharegpt`, `sharegpt-multiround`)
/// under [`kvroute_core::shared_data::dir`]; unknown kinds give the Mooncake trace.
pub fn default_trace_path(kind: &str) -> PathBuf {
    let d = kvroute_core::shared_data::dir();
    match kind {
        "azure" => d.join("traces/AzureLLMInferenceTrace_conv.csv"),
        "sharegpt" => d.join("prompts/sharegpt_v3_filtered_1000.json"),
        "sharegpt-multiround" => d.join("prompts/lmbenchmark_sharegpt_multiround_run.json"),
        _ => d.join("traces/mooncake_conversation_trace.jsonl"),
    }
}

/// How to turn a trace into requests (see [`workload`] for the formulas).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadOptions {
    /// The trace.
    pub source: TraceSource,
    /// Slice start, trace seconds from the first row (default 0).
    pub start_s: f64,
    /// Slice length, trace seconds (`None`: to the end).
    pub duration_s: Option<f64>,
    /// Arrival-rate multiplier k: inter-arrival gaps are divided by k (default 1).
    pub rate_scale: f64,
    /// Time compression: send offsets are divided by this too, to match a simulator running
    /// `time_scale` virtual seconds per wall second (default 1 = real time).
    /// `at_s = (t_trace − start_s) / (rate_scale × time_scale)`.
    pub time_scale: f64,
    /// Keep at most this many requests of the slice (`None`: all).
    pub max_requests: Option<usize>,
    /// Poisson arrival rate for ShareGPT sources, requests per trace second (default 1).
    pub sharegpt_rate_rps: f64,
    /// Seed of every random choice (Poisson gaps, filler text); equal seeds give equal bodies.
    pub seed: u64,
    /// `model` field of every body.
    pub model: String,
    /// Cap on output tokens per request (`None`: the trace's value; ShareGPT v3 files carry
    /// none, so [`workload::DEFAULT_SHAREGPT_OUTPUT_TOKENS`] applies).
    pub max_output_tokens: Option<u32>,
    /// Skip rows whose prompt is longer than this (e.g. the server's `max_model_len` minus
    /// the output), tokens (`None`: keep all).
    pub max_prompt_tokens: Option<u32>,
    /// Attach the `kvroute_sim` extension (exact prompt/output tokens, Mooncake block ids).
    /// Only kvroute-sim understands it: keep it off for real model servers (llama.cpp
    /// b11434 ignores unknown fields, `tools/server/server-schema.cpp`; strict
    /// OpenAI-compatible servers may reject them).
    pub sim_extension: bool,
    /// Add `"ignore_eos": true` so real servers generate exactly `max_tokens` (vLLM, SGLang
    /// and llama.cpp accept it; strict OpenAI servers reject it). Default off.
    pub ignore_eos: bool,
}

impl WorkloadOptions {
    /// Defaults for `source`: whole trace, no scaling, seed 0, model
    /// `meta-llama/Llama-3.1-8B-Instruct`, 1 req/s for ShareGPT, no extension.
    pub fn new(source: TraceSource) -> Self {
        Self {
            source,
            start_s: 0.0,
            duration_s: None,
            rate_scale: 1.0,
            time_scale: 1.0,
            max_requests: None,
            sharegpt_rate_rps: 1.0,
            seed: 0,
            model: DEFAULT_MODEL.to_owned(),
            max_output_tokens: None,
            max_prompt_tokens: None,
            sim_extension: false,
            ignore_eos: false,
        }
    }
}

/// Default `model` of generated bodies (the H100 profile kvroute-sim serves in the demo).
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayRequest {
    /// Index in the workload (0-based, in send order).
    pub id: u64,
    /// Send offset from the start of the run, wall seconds.
    pub at_s: f64,
    /// Chat-completions JSON body with `stream: true`, `stream_options.include_usage: true`.
    pub body: bytes::Bytes,
    /// Prompt tokens the trace records (or the estimate for ShareGPT text).
    pub prompt_tokens: u32,
    /// Output tokens requested (`max_tokens`).
    pub output_tokens: u32,
}

/// How to send a workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunOptions {
    /// Full URL, e.g. `http://127.0.0.1:10000/v1/chat/completions` (`http` only).
    pub url: String,
    /// Policy name shown in reports.
    pub label: String,
    /// Requests in flight at most; later ones wait client-side and the wait counts in their
    /// latency (default 256; 0 = unlimited).
    pub concurrency_cap: usize,
    /// Per-request deadline, wall seconds, from the scheduled send time (default 600).
    pub timeout_s: f64,
    /// Show a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Response header naming the backend that served (e.g. `x-kvroute-upstream`).
    pub backend_header: Option<String>,
    /// Model servers to sample for KV usage while the run lasts.
    pub kv_sample: Vec<KvSampleTarget>,
    /// Sampling period, wall seconds (default 0.5).
    pub kv_sample_interval_s: f64,
}

impl RunOptions {
    /// Defaults for `url` and `label`: cap 256, timeout 600 s, no progress bar, no backend
    /// header, no KV sampling (period 0.5 s).
    pub fn new(url: impl Into<String>, label: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            label: label.into(),
            concurrency_cap: 256,
            timeout_s: 600.0,
            progress: false,
            backend_header: None,
            kv_sample: Vec::new(),
            kv_sample_interval_s: 0.5,
        }
    }
}

/// A model server whose KV usage is sampled during a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSampleTarget {
    /// Backend name in reports (match it to what `backend_header` returns to line them up).
    pub name: String,
    /// Prometheus endpoint, e.g. `http://127.0.0.1:8000/metrics`.
    pub metrics_url: String,
    /// kvroute-cp adapter kind: `vllm`, `sglang`, `tgi`, `llamacpp`, `trtllm`, `llmd-sim`,
    /// or `auto`.
    pub kind: String,
    /// llama.cpp `GET /slots` URL (its only KV signal), when `kind` is `llamacpp`.
    pub slots_url: Option<String>,
}

/// What happened to one request. Times are wall seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// [`ReplayRequest::id`].
    pub id: u64,
    /// HTTP status (0 when no response arrived).
    pub status: u16,
    /// Why the request failed (non-2xx body excerpt, connect error, timeout, bad stream).
    pub error: Option<String>,
    /// Value of the backend header, when configured and present.
    pub backend: Option<String>,
    /// Scheduled send offset from the run start.
    pub sent_at_s: f64,
    /// When the request actually went out, offset from the run start (later than
    /// `sent_at_s` by the client-side wait for a concurrency-cap permit; 0 if never sent).
    #[serde(default)]
    pub started_at_s: f64,
    /// Time to first content token, from the scheduled send time.
    pub ttft_s: Option<f64>,
    /// Time per output token after the first: `(e2e − ttft) / (output_tokens − 1)`.
    pub tpot_s: Option<f64>,
    /// Scheduled send time to end of stream (or to the failure).
    pub e2e_s: f64,
    /// `usage.prompt_tokens` (0 when absent).
    pub prompt_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens`, else llama.cpp `timings.cache_n`.
    pub cached_tokens: u32,
    /// `usage.completion_tokens`, else the content chunks counted.
    pub output_tokens: u32,
}

/// One KV-usage sample of one backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvSample {
    /// Wall seconds from the run start.
    pub t_s: f64,
    /// [`KvSampleTarget::name`].
    pub backend: String,
    /// KV cache usage, 0..1.
    pub kv_usage: f64,
    /// Requests running.
    pub running: u32,
    /// Requests waiting.
    pub waiting: u32,
}

/// Everything one run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// [`RunOptions::label`].
    pub label: String,
    /// One record per request, in id order.
    pub records: Vec<RequestRecord>,
    /// KV samples in time order.
    pub kv: Vec<KvSample>,
    /// Run length, wall seconds (start to last response).
    pub wall_s: f64,
}

/// Headline figures of one run (see [`report`] for the percentile definition).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Policy name.
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests with an error.
    pub errors: usize,
    /// TTFT median over successful requests, seconds.
    pub ttft_p50_s: f64,
    /// TTFT 99th percentile, seconds.
    pub ttft_p99_s: f64,
    /// TPOT median, seconds per token.
    pub tpot_p50_s: f64,
    /// E2E 99th percentile, seconds.
    pub e2e_p99_s: f64,
    /// Σ output tokens / wall time, tokens per second.
    pub output_tokens_per_s: f64,
    /// Σ cached prompt tokens / Σ prompt tokens over successful requests, 0..1.
    pub prefix_hit_rate: f64,
    /// Share of successful requests per backend, 0..1 (needs `backend_header`).
    pub backend_share: BTreeMap<String, f64>,
    /// Peak sampled KV usage per backend, 0..1.
    pub peak_kv: BTreeMap<String, f64>,
}

impl RunReport {
    /// Headline figures (see [`Summary`]).
    pub fn summary(&self) -> Summary {
        report::summarize(self)
    }
}

/// Files written by [`write_report`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportFiles {
    /// The JSON report (`report.json`: runs and summaries).
    pub json: PathBuf,
    /// SVG plots: the TTFT CDF of all runs, then one KV-usage plot per run.
    pub plots: Vec<PathBuf>,
}
