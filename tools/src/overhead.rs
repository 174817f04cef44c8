//! `make bench-overhead`: what the kvroute filter costs next to plain Envoy and next to the
//! cheapest body-reading filter of each kind (a Wasm one; Envoy's own buffer filter and a
//! routing dynamic module for the native build), in one run (issue 13; method and results
//! in `docs/overhead.md`).
//!
//! ## Set-up
//! - **backend**: one Envoy (`--concurrency 1`) that reads each request body whole (buffer
//!   filter) and answers a fixed chat completion itself ([`templates::DIRECT_RESPONSE`]);
//!   with `--stream-events N`, a hyper server that answers an event stream of `N` token
//!   events, a `usage` event and `[DONE]`, each its own body chunk ([`stream_chunks`]), as a
//!   model server streams a completion;
//! - **plain**: Envoy 1.40, `--concurrency 1`, router only ([`templates::PLAIN`]);
//! - **floor**: the same plus `bench/floor-filter`, a proxy-wasm filter that buffers the body
//!   and copies it into the VM, nothing else ([`templates::FLOOR`] with
//!   [`templates::Floor::Wasm`]);
//! - **kvroute**: the same plus the kvroute filter in cluster mode, hybrid policy, 16
//!   endpoints (all on the one backend) in a snapshot pushed to the ingest listener once a
//!   second, as the control plane does ([`templates::CLUSTER_MODE`]);
//! - **floor-native** (only with a module, as kvroute-native): the plain listener plus
//!   Envoy's own buffer filter (C++), which waits for the whole body and does nothing else
//!   ([`templates::FLOOR`] with [`templates::Floor::EnvoyBuffer`]): the floor of a
//!   body-reading filter without a VM;
//! - **floor-dynmod** (only with `bench/floor-dynmod`'s module, `--floor-dynmod PATH`,
//!   beside kvroute-native): kvroute-native's config with that module instead, which
//!   buffers the body, copies it out once and sets a fixed routing header
//!   ([`FLOOR_DYNMOD_HEADER`]): the floor of a body-routing module, all but the decision;
//! - **kvroute-native** (only with a module: `--dynmod PATH`, `KVROUTE_DYNMOD`): the kvroute
//!   config with the filter stanzas alone changed, to `DynamicModuleFilter` loading kvroute
//!   as a native Envoy dynamic module ([`templates::FilterModule::DynamicModule`]), in the
//!   route and ingest roles with the same plugin configurations, and the same snapshot
//!   pushes. Envoy finds `lib<name>.so` in the directories of [`DYNMOD_SEARCH_PATH`], which
//!   is set to the module's directory for that Envoy alone ([`DynModule`]).
//!
//! The proxies run side by side with the same buffer limit and stats flush interval.
//! For each body size a fresh set is started; then, for each repetition, `wrk -t1 -c8`
//! drives plain, floor, kvroute (and floor-native, floor-dynmod, kvroute-native) in turn (alternating, so
//! slow drift from other load on the machine hits all alike) with the same chat body: real
//! ShareGPT turns from `../shared/data/prompts/` (LMBenchmark warm-up inputs) as
//! alternating user/assistant messages up to the size.
//!
//! ## What is reported (medians over repetitions)
//! - req/s and its ratio to plain; p50/p99 latency from wrk and the latency added over plain;
//! - Envoy's CPU per request: the process's on-CPU time (sum of `/proc/<pid>/task/*/schedstat`,
//!   nanoseconds, all threads) over the run divided by completed requests; "extra" is the
//!   difference to plain. It does not depend on how busy the rest of the machine is, unlike
//!   req/s;
//! - the filter's `decision_us` histogram (analysis + pick + reservation, per request,
//!   measured inside the filter), p50/p99 cumulative over the size's runs, read after a stats
//!   flush, for kvroute and kvroute-native alike: a metric is found by its name whatever
//!   namespace Envoy puts in front of a plugin's metrics ([`kvroute_metric`]); "n/a" when
//!   the proxy reports none;
//! - kvroute's Wasm linear memory per worker (`kvroute.wasm_memory_bytes` gauge, the VM's
//!   high-water mark) after the size's runs ("n/a" for the native module, which has no VM);
//! - for both, Envoy's resident memory over plain Envoy's (`VmRSS` of `/proc/<pid>/status`)
//!   after the size's runs: the filter's whole resident cost, its 16 clusters and ingest
//!   listener included.

use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_integration::harness::templates::FilterModule;
use kvroute_integration::harness::{
    http, render, rss_bytes, templates, Envoy, RecordingBackend, Reply, READY_DEADLINE,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The model every benchmark body names and every endpoint serves.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// Endpoints in the kvroute snapshot.
pub const ENDPOINTS: usize = 16;
/// `per_connection_buffer_limit_bytes` of every proxy and the backend (4 MiB, kvroute's
/// default `max_body_bytes`). The examples set twice that, for chunked uploads
/// (docs/filter.md); every body here, ≤ 1 MiB, is sent with its `Content-Length`, so
/// this limit never refuses one.
pub const BUFFER_LIMIT: usize = 4 * 1024 * 1024;
/// Stats flush interval of every Envoy, so histograms fill quickly.
pub const STATS_FLUSH: Duration = Duration::from_secs(1);
/// The backend's reply: a non-streamed chat completion with `usage`.
pub const REPLY: &str = r#"{"id":"cmpl-bench","object":"chat.completion","model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101}}"#;

/// [`REPLY`] as an event stream with `stream_options.include_usage`, as OpenAI's API
/// reference describes it: `events` token events (`chat.completion.chunk`, a one-token
/// delta, `"usage": null`), then a last event with empty `choices` and the request's
/// `usage`, then `data: [DONE]`; each string is one body chunk.
pub fn stream_chunks(events: usize) -> Vec<String> {
    let token = r#"data: {"id":"cmpl-bench","object":"chat.completion.chunk","model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}],"usage":null}"#;
    let mut chunks: Vec<String> = (0..events).map(|_| format!("{token}\n\n")).collect();
    chunks.push(format!(
        "data: {{\"id\":\"cmpl-bench\",\"object\":\"chat.completion.chunk\",\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":100,\"completion_tokens\":{events},\"total_tokens\":{}}}}}\n\n",
        100 + events
    ));
    chunks.push("data: [DONE]\n\n".into());
    chunks
}

/// The benchmark's model-server stand-in, stopped when dropped.
#[derive(Debug)]
pub enum Backend {
    /// Envoy answering [`REPLY`] in one chunk.
    Direct(Envoy),
    /// A hyper server streaming [`stream_chunks`], `stream_gap` apart.
    Stream(RecordingBackend),
}

/// Start the backend `opts` asks for; returns it and its `host:port`.
pub async fn start_backend(opts: &Options) -> anyhow::Result<(Backend, String)> {
    if opts.stream_events == 0 {
        let (envoy, [port]) = Envoy::start_on_free_ports(1, |[p]| backend_yaml(p)).await?;
        return Ok((Backend::Direct(envoy), format!("127.0.0.1:{port}")));
    }
    let reply = Reply::Sse {
        chunks: stream_chunks(opts.stream_events),
        gap: opts.stream_gap,
    };
    let b = RecordingBackend::start_unrecorded("bench", reply).await?;
    let addr = b.address();
    Ok((Backend::Stream(b), addr))
}

/// Proxy variants run in every benchmark, in the order each repetition runs them.
pub const VARIANTS: [&str; 3] = ["plain", "floor", "kvroute"];
/// The native proxy, run after [`VARIANTS`] when a dynamic module is given
/// ([`Options::dynmod`]).
pub const NATIVE: &str = "kvroute-native";
/// The native proxy's floor, run before it: Envoy's own buffer filter (C++), the cheapest
/// filter that reads the whole body before routing without a VM
/// ([`templates::Floor::EnvoyBuffer`]).
/// What the Wasm floor is to kvroute's `.wasm`, it is to the native module: how close any
/// body-reading native filter can come to plain Envoy.
pub const FLOOR_NATIVE: &str = "floor-native";
/// The native proxy's routing floor, run between [`FLOOR_NATIVE`] and [`NATIVE`] when its
/// module is given ([`Options::floor_dynmod`]): kvroute-native's config with
/// `bench/floor-dynmod` loaded instead of kvroute, a dynamic module that buffers the body,
/// copies it out of Envoy once and sets a fixed routing header ([`FLOOR_DYNMOD_HEADER`]),
/// as kvroute-native does, with no decision: what hosting a body-routing module costs in
/// Envoy, so kvroute-native's cost over it is its decision and glue.
pub const FLOOR_DYNMOD: &str = "floor-dynmod";
/// The floor module's filter config: the routing header it sets on every request (cluster
/// mode's header, naming the first endpoint's cluster).
pub const FLOOR_DYNMOD_HEADER: &str = "x-kvroute-cluster: c0";
/// The environment variable whose `:`-separated directories Envoy searches for a dynamic
/// module's `lib<name>.so`.
pub const DYNMOD_SEARCH_PATH: &str = "ENVOY_DYNAMIC_MODULES_SEARCH_PATH";

/// kvroute as a native Envoy dynamic module: the [`NATIVE`] proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynModule {
    /// The module's shared object, named `lib<name>.so`.
    pub path: PathBuf,
    /// The filter the module implements (`DynamicModuleFilter.filter_name`; default
    /// [`DynModule::FILTER_NAME`]).
    pub filter_name: String,
    /// Push the snapshots to its ingest listener, as to kvroute's. `false` runs it with none
    /// (it then has no endpoint stats to route by): a check of the rest of the plumbing with
    /// a module that has no ingest role yet.
    pub push: bool,
}

impl DynModule {
    /// The filter name kvroute's module implements.
    pub const FILTER_NAME: &'static str = "kvroute";

    /// The module's name, by which Envoy loads it: `kvroute` for `.../libkvroute.so`.
    /// Errors: a file name not of that form.
    pub fn name(&self) -> anyhow::Result<&str> {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("lib")?.strip_suffix(".so"))
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{}: a dynamic module's file must be named lib<name>.so (Envoy loads it by name)",
                    self.path.display()
                )
            })
    }

    /// The directory to search ([`DYNMOD_SEARCH_PATH`]): the module's, absolute (symbolic
    /// links kept, so a `libkvroute.so` link is found by its own name). Errors: the module
    /// is not a file.
    pub fn search_dir(&self) -> anyhow::Result<PathBuf> {
        anyhow::ensure!(
            self.path.is_file(),
            "{}: no such dynamic module",
            self.path.display()
        );
        let abs = std::path::absolute(&self.path)?;
        abs.parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| anyhow::anyhow!("{}: the module has no directory", self.path.display()))
    }

    /// The wrapper that starts Envoy with [`DYNMOD_SEARCH_PATH`] set to
    /// [`DynModule::search_dir`] for that Envoy alone: `env`, which replaces itself with
    /// Envoy, so [`Envoy::pid`] stays Envoy's (see [`Envoy::start_wrapped`]).
    pub fn env_wrapper(&self) -> anyhow::Result<Vec<String>> {
        Ok(vec![
            "env".into(),
            format!("{DYNMOD_SEARCH_PATH}={}", self.search_dir()?.display()),
        ])
    }
}

/// Benchmark options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Body sizes in bytes.
    pub sizes: Vec<usize>,
    /// Repetitions per size and variant.
    pub reps: usize,
    /// Duration of one wrk run.
    pub duration: Duration,
    /// wrk connections (`-c`); wrk runs one thread.
    pub connections: u32,
    /// The wrk binary.
    pub wrk: PathBuf,
    /// The floor filter's `.wasm`.
    pub floor_wasm: PathBuf,
    /// The kvroute filter's `.wasm`.
    pub kvroute_wasm: PathBuf,
    /// `../shared/data`.
    pub data: PathBuf,
    /// Token events per streamed response; 0: the one-chunk [`REPLY`] (see the module doc).
    pub stream_events: usize,
    /// Pause between a streamed response's chunks, so that each reaches the proxies as a
    /// body chunk of its own.
    pub stream_gap: Duration,
    /// kvroute plugin settings (a JSON object) laid over the benchmark's own
    /// ([`plugin_config`]).
    pub plugin_config: Option<String>,
    /// kvroute's dynamic module, for the [`NATIVE`] proxy; `None`: it is skipped.
    pub dynmod: Option<DynModule>,
    /// `bench/floor-dynmod`'s module, for the [`FLOOR_DYNMOD`] proxy (run only beside
    /// [`Options::dynmod`]); `None`: it is skipped.
    pub floor_dynmod: Option<DynModule>,
}

impl Options {
    /// The proxies to run, in order: [`VARIANTS`], then [`FLOOR_NATIVE`], [`FLOOR_DYNMOD`]
    /// (with its module) and [`NATIVE`] when there is a kvroute module.
    pub fn variants(&self) -> Vec<&'static str> {
        let mut v = VARIANTS.to_vec();
        if self.dynmod.is_some() {
            v.push(FLOOR_NATIVE);
            if self.floor_dynmod.is_some() {
                v.push(FLOOR_DYNMOD);
            }
            v.push(NATIVE);
        }
        v
    }

    /// The dynamic module proxy `variant` loads, if any.
    pub fn module_of(&self, variant: &str) -> Option<&DynModule> {
        match variant {
            NATIVE => self.dynmod.as_ref(),
            FLOOR_DYNMOD => self.floor_dynmod.as_ref(),
            _ => None,
        }
    }

    /// The ingest port of proxy `variant` started on `[listen, ingest]` ports to push the
    /// snapshots to: kvroute's, and kvroute-native's unless [`DynModule::push`] is off.
    pub fn push_port(&self, variant: &str, ingest: u16) -> Option<u16> {
        let native_push = self.dynmod.as_ref().is_some_and(|d| d.push);
        (variant == "kvroute" || (variant == NATIVE && native_push)).then_some(ingest)
    }
}

/// One wrk run against one proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Run {
    /// Requests per second.
    pub rps: f64,
    /// Median latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile latency, microseconds.
    pub p99_us: f64,
    /// Envoy on-CPU time per completed request, microseconds.
    pub cpu_us: f64,
    /// Completed requests.
    pub requests: u64,
}

/// Medians of one variant at one body size.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Body size requested (bytes).
    pub size: usize,
    /// Actual body length (bytes).
    pub body_bytes: usize,
    /// Variant name (see [`VARIANTS`]).
    pub variant: &'static str,
    /// Median of each metric over the repetitions.
    pub median: Run,
    /// Every repetition.
    pub runs: Vec<Run>,
}

/// The filter's own figures in one proxy (kvroute or kvroute-native) at one body size;
/// `None` where the proxy reports no such metric.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FilterStats {
    /// `decision_us` p50 (cumulative), microseconds; `None` when the histogram is empty or
    /// absent.
    pub decision_p50_us: Option<f64>,
    /// `decision_us` p99 (cumulative), microseconds.
    pub decision_p99_us: Option<f64>,
    /// Wasm linear memory of the worker VM, bytes.
    pub wasm_memory_bytes: Option<u64>,
    /// Envoy's resident memory minus plain Envoy's after the size's runs, bytes (may be
    /// negative); `None` when either could not be read.
    pub rss_over_plain_bytes: Option<i64>,
    /// Requests the filter routed by its policy (sum of `kvroute.decisions.policy*`);
    /// `None` when the proxy reports no kvroute metric at all.
    pub routed: Option<u64>,
    /// Requests the filter failed to analyse (`kvroute.parse_errors`); `None` as
    /// [`FilterStats::routed`].
    pub parse_errors: Option<u64>,
}

/// The filter's figures of one proxy at one size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterRow {
    /// Body size requested, bytes.
    pub size: usize,
    /// `kvroute` or [`NATIVE`].
    pub variant: &'static str,
    /// The figures.
    pub stats: FilterStats,
}

/// The whole run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Rows in size, then [`Options::variants`] order.
    pub rows: Vec<Row>,
    /// The filter's figures per size, then proxy (kvroute, then kvroute-native).
    pub filter: Vec<FilterRow>,
    /// What was skipped or run differently, and why: printed under the tables.
    pub notes: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    let hi = v.get(n / 2).copied().unwrap_or(0.0);
    if n % 2 == 1 {
        hi
    } else {
        (v.get(n / 2 - 1).copied().unwrap_or(hi) + hi) / 2.0
    }
}

/// Prompts of `prompts/lmbenchmark_sharegpt_multiround_warmup.json` (the `input` field).
pub fn prompts(data: &Path) -> anyhow::Result<Vec<String>> {
    let p = data.join("prompts/lmbenchmark_sharegpt_multiround_warmup.json");
    let text = std::fs::read_to_string(&p)
        .map_err(|e| anyhow::anyhow!("{}: {e} (set KVROUTE_SHARED_DATA)", p.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let out: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e.get("input")?.as_str().map(str::to_owned))
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    anyhow::ensure!(!out.is_empty(), "no prompts in {}", p.display());
    Ok(out)
}

/// A chat completion body of at most `size` bytes (short by at most one message's JSON
/// framing, ~40 bytes): a system message, then the prompts in
/// order as alternating user/assistant turns, the last one cut to fit. With `stream`, it
/// asks for a streamed answer with its usage (`"stream": true`, `stream_options`
/// `include_usage`), as a client of the `--stream-events` backend would.
pub fn chat_body(size: usize, prompts: &[String], stream: bool) -> Vec<u8> {
    let make = |messages: &[serde_json::Value]| {
        let mut body = serde_json::json!({
            "model": MODEL, "max_tokens": 256, "temperature": 0.7, "stream": stream,
            "messages": messages,
        });
        if let Some(fields) = body.as_object_mut().filter(|_| stream) {
            let usage = serde_json::json!({"include_usage": true});
            fields.insert("stream_options".into(), usage);
        }
        body.to_string()
    };
    let mut messages = vec![serde_json::json!({
        "role": "system", "content": "You are a helpful assistant. Answer concisely."
    })];
    let mut i = 0;
    loop {
        let Some(p) = prompts.get(i % prompts.len().max(1)) else {
            return make(&messages).into_bytes();
        };
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": p}));
        let body = make(&messages);
        if body.len() >= size {
            // Cut the last message to the longest prefix that keeps the body within `size`
            // (binary search: JSON escapes make the cut's effect on length uneven).
            let (mut lo, mut hi) = (0usize, p.len());
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                let mut cut = mid;
                while cut > 0 && !p.is_char_boundary(cut) {
                    cut -= 1;
                }
                let text = p.get(..cut).unwrap_or("");
                if let Some(last) = messages.last_mut() {
                    *last = serde_json::json!({"role": role, "content": text});
                }
                if make(&messages).len() <= size {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            let mut cut = lo;
            while cut > 0 && !p.is_char_boundary(cut) {
                cut -= 1;
            }
            let text = p.get(..cut).unwrap_or("");
            if let Some(last) = messages.last_mut() {
                *last = serde_json::json!({"role": role, "content": text});
            }
            let body = make(&messages);
            if body.len() > size {
                // Even an empty last turn overshoots: leave it out.
                messages.pop();
                return make(&messages).into_bytes();
            }
            return body.into_bytes();
        }
        i += 1;
    }
}

/// Now, Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The snapshot pushed to kvroute: [`ENDPOINTS`] healthy endpoints on the backend address,
/// clusters `c0..c15`, KV usage spread over 10..40%, serving [`MODEL`].
pub fn snapshot(version: u64, backend: &str) -> Snapshot {
    let now = now_ms();
    let eps = (0..ENDPOINTS)
        .map(|i| EndpointStats {
            id: format!("pool/e{i}"),
            address: backend.to_owned(),
            cluster: format!("c{i}"),
            pool: "pool".into(),
            models: vec![MODEL.into()],
            lora_adapters: vec![],
            kv_usage: Some(0.1 + 0.02 * i as f64),
            // Large enough that 8 concurrent 1 MiB prompts never saturate an endpoint.
            kv_capacity_tokens: Some(4_000_000),
            block_size: Some(16),
            running: 1,
            waiting: 0,
            healthy: true,
            scraped_at_ms: now,
            process_start_ms: None,
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        })
        .collect();
    Snapshot::new(version, now, eps)
}

/// Total on-CPU time of process `pid` (all threads), nanoseconds, from
/// `/proc/<pid>/task/*/schedstat` (first field: time spent on the CPU, ns).
pub fn cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Ok(total)
}

fn duration_us(s: &str) -> Option<f64> {
    let (num, mul) = if let Some(v) = s.strip_suffix("us") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix("ms") {
        (v, 1e3)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1e6)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60e6)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|v| v * mul)
}

/// Parse wrk's `--latency` output: (req/s, p50 µs, p99 µs, requests, non-2xx responses,
/// socket errors).
pub fn parse_wrk(out: &str) -> anyhow::Result<(f64, f64, f64, u64, u64, u64)> {
    let mut rps = None;
    let (mut p50, mut p99, mut requests, mut non2xx, mut errors) = (None, None, None, 0, 0);
    for line in out.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        match t.as_slice() {
            ["Requests/sec:", v] => rps = v.parse::<f64>().ok(),
            ["50%", v] => p50 = duration_us(v),
            ["99%", v] => p99 = duration_us(v),
            [n, "requests", "in", ..] => requests = n.parse::<u64>().ok(),
            ["Non-2xx", "or", "3xx", "responses:", n] => non2xx = n.parse().unwrap_or(u64::MAX),
            ["Socket", "errors:", rest @ ..] => {
                errors = rest
                    .iter()
                    .filter_map(|x| x.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            _ => {}
        }
    }
    match (rps, p50, p99, requests) {
        (Some(r), Some(a), Some(b), Some(n)) => Ok((r, a, b, n, non2xx, errors)),
        _ => anyhow::bail!("unexpected wrk output:\n{out}"),
    }
}

/// `P50(interval,cumulative)` → cumulative value, from Envoy's text stats line of a histogram.
pub fn parse_quantile(line: &str, q: &str) -> Option<f64> {
    let start = line.find(&format!(" {q}("))? + q.len() + 2;
    let rest = line.get(start..)?;
    let inner = rest.get(..rest.find(')')?)?;
    let (_, cumulative) = inner.split_once(',')?;
    cumulative
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
}

/// One proxy under test.
struct Proxy {
    variant: &'static str,
    envoy: Envoy,
    /// Main listener port.
    port: u16,
    /// Ingest listener port to push snapshots to ([`Options::push_port`]).
    push: Option<u16>,
}

struct Proxies {
    backend: Backend,
    /// In [`Options::variants`] order.
    proxies: Vec<Proxy>,
    backend_addr: String,
}

fn with_flush(yaml: String) -> String {
    format!("stats_flush_interval: {}s\n{yaml}", STATS_FLUSH.as_secs())
}

/// The benchmark backend's config: Envoy answering [`REPLY`] on `port`.
pub fn backend_yaml(port: u16) -> anyhow::Result<String> {
    Ok(with_flush(render(
        templates::DIRECT_RESPONSE,
        &[
            ("LISTEN_PORT", port.to_string()),
            ("BUFFER_LIMIT", BUFFER_LIMIT.to_string()),
            ("REPLY", REPLY.into()),
        ],
    )?))
}

/// The config of proxy `variant` (one of [`Options::variants`]) listening on `listen`, with
/// every cluster on `backend` (`host:port`); kvroute's ingest listener on `ingest` and its
/// plugin configuration `plugin_config` (JSON). kvroute and kvroute-native differ only in
/// where the filter comes from ([`FilterModule`]); floor-dynmod is kvroute-native's cluster
/// mode config with the floor module and its [`FLOOR_DYNMOD_HEADER`] config instead.
/// Errors: an unknown variant, a module proxy without its module, a module not named
/// `lib<name>.so`.
pub fn proxy_yaml(
    variant: &str,
    opts: &Options,
    listen: u16,
    ingest: u16,
    backend: &str,
    plugin_config: &str,
) -> anyhow::Result<String> {
    let addrs = vec![backend.to_owned()];
    let default = templates::static_cluster("default", &addrs);
    let yaml = match variant {
        "plain" => render(
            templates::PLAIN,
            &[
                ("LISTEN_PORT", listen.to_string()),
                ("DEFAULT_CLUSTER", "default".into()),
                ("CLUSTERS", default),
            ],
        )?,
        "floor" | FLOOR_NATIVE => {
            let floor = if variant == "floor" {
                templates::Floor::Wasm(&opts.floor_wasm)
            } else {
                templates::Floor::EnvoyBuffer {
                    max_request_bytes: BUFFER_LIMIT,
                }
            };
            render(
                templates::FLOOR,
                &[
                    ("LISTEN_PORT", listen.to_string()),
                    ("BUFFER_LIMIT", BUFFER_LIMIT.to_string()),
                    ("FLOOR_FILTER", templates::floor_filter(floor)),
                    ("DEFAULT_CLUSTER", "default".into()),
                    ("CLUSTERS", default),
                ],
            )?
        }
        "kvroute" | NATIVE | FLOOR_DYNMOD => {
            let module = match (variant, opts.module_of(variant)) {
                ("kvroute", _) => FilterModule::Wasm(&opts.kvroute_wasm),
                (_, Some(m)) => FilterModule::DynamicModule {
                    name: m.name()?,
                    filter_name: &m.filter_name,
                },
                (_, None) => anyhow::bail!(
                    "{variant} needs a dynamic module ({})",
                    if variant == FLOOR_DYNMOD {
                        "--floor-dynmod, KVROUTE_FLOOR_DYNMOD"
                    } else {
                        "--dynmod, KVROUTE_DYNMOD"
                    }
                ),
            };
            // The floor sets its fixed header in both roles (it has no ingest role: no
            // snapshot is pushed to it) and always runs in cluster mode.
            let (plugin_config, ingest_config) = if variant == FLOOR_DYNMOD {
                (FLOOR_DYNMOD_HEADER, FLOOR_DYNMOD_HEADER.to_owned())
            } else {
                (
                    plugin_config,
                    kvroute_integration::harness::kvroute::ingest_plugin_config(),
                )
            };
            let mut vars = vec![
                ("LISTEN_PORT", listen.to_string()),
                ("INGEST_PORT", ingest.to_string()),
                ("BUFFER_LIMIT", BUFFER_LIMIT.to_string()),
            ];
            vars.extend(templates::kvroute_filters(
                module,
                plugin_config,
                &ingest_config,
            ));
            if endpoint_mode(plugin_config) {
                // Cluster `pool` over the backend, its load balancer reading the filter's
                // endpoint header (every endpoint of the snapshot is the backend).
                vars.push(("POOL_TYPE", "OverrideHost".into()));
                vars.push((
                    "CLUSTERS",
                    templates::override_host_cluster(
                        kvroute_core::plugin_config::ENDPOINT_HEADER,
                        &addrs,
                    ),
                ));
                render(templates::ENDPOINT_MODE, &vars)?
            } else {
                let mut clusters: String = (0..ENDPOINTS)
                    .map(|i| templates::static_cluster(&format!("c{i}"), &addrs))
                    .collect();
                clusters.push_str(&default);
                vars.push(("CLUSTER_HEADER", "x-kvroute-cluster".into()));
                vars.push(("DEFAULT_CLUSTER", "default".into()));
                vars.push(("CLUSTERS", clusters));
                render(templates::CLUSTER_MODE, &vars)?
            }
        }
        other => anyhow::bail!(
            "unknown proxy variant `{other}` (one of {VARIANTS:?}, {FLOOR_NATIVE}, {FLOOR_DYNMOD} or {NATIVE})"
        ),
    };
    Ok(with_flush(yaml))
}

/// Whether kvroute's plugin configuration `plugin_config` (JSON) selects endpoint mode
/// (`"mode":"endpoint"`, e.g. laid over the benchmark's with `--plugin-config`): the
/// kvroute proxies then run [`templates::ENDPOINT_MODE`] (one cluster, `pool`, whose
/// `override_host` load balancer reads `x-gateway-destination-endpoint`) instead of
/// [`templates::CLUSTER_MODE`] (one cluster per endpoint, chosen by `cluster_header`).
pub fn endpoint_mode(plugin_config: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(plugin_config)
        .ok()
        .and_then(|v| v.get("mode")?.as_str().map(|m| m == "endpoint"))
        .unwrap_or(false)
}

/// kvroute's plugin configuration in the benchmark: cluster mode, every default.
pub const PLUGIN_CONFIG: &str = r#"{"mode":"cluster"}"#;

/// The benchmark's plugin configuration `base` (a JSON object) with the top-level keys of
/// `over` laid over it. Errors: either is not a JSON object.
pub fn plugin_config(base: &str, over: Option<&str>) -> anyhow::Result<String> {
    let object =
        |s: &str, what: &str| -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
            match serde_json::from_str(s) {
                Ok(serde_json::Value::Object(m)) => Ok(m),
                _ => anyhow::bail!("{what} is not a JSON object: {s}"),
            }
        };
    let mut m = object(base, "the benchmark's plugin configuration")?;
    if let Some(over) = over {
        m.extend(object(over, "--plugin-config")?);
    }
    Ok(serde_json::Value::Object(m).to_string())
}

/// Start proxy `variant` (see [`proxy_yaml`]) on free `[listen, ingest]` ports (plain and
/// floor leave the ingest port unused) under `wrapper` (see [`Envoy::start_wrapped`]);
/// a module's proxy under its [`DynModule::env_wrapper`] first. Errors name the proxy.
pub async fn start_proxy(
    variant: &'static str,
    opts: &Options,
    backend: &str,
    plugin_config: &str,
    wrapper: &[String],
    ready_within: Duration,
) -> anyhow::Result<(Envoy, [u16; 2])> {
    let mut wrap = match opts.module_of(variant) {
        Some(m) => m.env_wrapper()?,
        None => Vec::new(),
    };
    wrap.extend_from_slice(wrapper);
    Envoy::start_wrapped_on_free_ports(1, &wrap, ready_within, |[port, ingest]| {
        proxy_yaml(variant, opts, port, ingest, backend, plugin_config)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{variant}: Envoy did not start: {e:#}"))
}

async fn start(opts: &Options) -> anyhow::Result<Proxies> {
    let config = plugin_config(PLUGIN_CONFIG, opts.plugin_config.as_deref())?;
    let (backend, backend_addr) = start_backend(opts).await?;
    let mut proxies = Vec::new();
    for variant in opts.variants() {
        let (envoy, [port, ingest]) =
            start_proxy(variant, opts, &backend_addr, &config, &[], READY_DEADLINE).await?;
        let push = opts.push_port(variant, ingest);
        proxies.push(Proxy {
            variant,
            envoy,
            port,
            push,
        });
    }
    Ok(Proxies {
        backend,
        proxies,
        backend_addr,
    })
}

/// [`push`] to proxy `variant`'s ingest listener, its error naming the proxy and, for the
/// native one, the way to run it without.
pub async fn push_to(
    variant: &str,
    ingest: u16,
    version: u64,
    backend: &str,
) -> anyhow::Result<()> {
    push(ingest, version, backend).await.map_err(|e| {
        let hint = if variant == NATIVE {
            " (does the module implement the ingest role? --dynmod-skip-push or KVROUTE_DYNMOD_SKIP_PUSH=1 runs it without snapshots)"
        } else {
            ""
        };
        anyhow::anyhow!("{variant}: snapshot push to its ingest listener (127.0.0.1:{ingest}) failed: {e:#}{hint}")
    })
}

/// Push the benchmark's snapshot `version` (16 endpoints, all on `backend`) to kvroute's
/// ingest listener on `ingest`, as the control plane does.
pub async fn push(ingest: u16, version: u64, backend: &str) -> anyhow::Result<()> {
    let auth = format!(
        "Bearer {}",
        kvroute_integration::harness::kvroute::TEST_TOKEN
    );
    let r = http::request(
        "POST",
        &format!("http://127.0.0.1:{ingest}/kvroute/v1/snapshot"),
        &[
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ],
        &snapshot(version, backend).encode(),
    )
    .await?;
    anyhow::ensure!(
        r.status == 204,
        "ingest answered {}: {}",
        r.status,
        r.text().trim()
    );
    Ok(())
}

async fn wrk(opts: &Options, port: u16, script: &Path, pid: u32) -> anyhow::Result<Run> {
    let cpu0 = cpu_ns(pid)?;
    let out = tokio::process::Command::new(&opts.wrk)
        // A run dropped on a signal stops its wrk too.
        .kill_on_drop(true)
        .arg("-t1")
        .arg(format!("-c{}", opts.connections))
        .arg(format!("-d{}s", opts.duration.as_secs().max(1)))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("{}: {e} (install wrk: make wrk)", opts.wrk.display()))?;
    let cpu1 = cpu_ns(pid)?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "wrk failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (rps, p50_us, p99_us, requests, non2xx, errors) = parse_wrk(&text)?;
    anyhow::ensure!(
        non2xx == 0 && errors == 0,
        "port {port}: {non2xx} non-2xx responses, {errors} socket errors:\n{text}"
    );
    anyhow::ensure!(requests > 0, "port {port}: no request completed:\n{text}");
    Ok(Run {
        rps,
        p50_us,
        p99_us,
        cpu_us: cpu1.saturating_sub(cpu0) as f64 / 1e3 / requests as f64,
        requests,
    })
}

/// `stat` without the namespace Envoy puts in front of a plugin's own metrics
/// (`wasmcustom.` for Wasm; `dynamicmodulescustom.` for dynamic modules, which Envoy may
/// also leave out of `/stats`), so that both proxies' metrics are found by kvroute's names.
pub fn kvroute_metric(stat: &str) -> &str {
    ["wasmcustom.", templates::DYNMOD_STAT_PREFIX]
        .iter()
        .find_map(|ns| stat.strip_prefix(ns))
        .unwrap_or(stat)
}

/// The filter's figures in `proxy` (kvroute or kvroute-native), with its resident memory
/// over `plain_rss` (bytes).
async fn filter_stats(proxy: &Envoy, plain_rss: Option<u64>) -> anyhow::Result<FilterStats> {
    // Histograms reach /stats at a stats flush.
    tokio::time::sleep(STATS_FLUSH * 2 + Duration::from_millis(500)).await;
    let h = http::request(
        "GET",
        &format!("http://{}/stats?filter=kvroute.decision_us", proxy.admin()),
        &[],
        b"",
    )
    .await?;
    let text = h.text();
    let line = text
        .lines()
        .find(|l| {
            l.split_once(": ")
                .is_some_and(|(name, _)| kvroute_metric(name) == "kvroute.decision_us")
        })
        .unwrap_or("");
    let stats: BTreeMap<String, u64> = proxy
        .stats()
        .await?
        .into_iter()
        .map(|(k, v)| (kvroute_metric(&k).to_owned(), v))
        .collect();
    // A counter appears at its first increment: one that is absent counts 0 in a proxy
    // that reports kvroute metrics at all, and is unknown ("n/a") in one that reports none.
    let reports = stats.keys().any(|k| k.starts_with("kvroute."));
    let count = |prefix: &str| -> Option<u64> {
        reports.then(|| {
            stats
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, v)| *v)
                .sum()
        })
    };
    let rss = rss_bytes(proxy.pid());
    Ok(FilterStats {
        decision_p50_us: parse_quantile(line, "P50"),
        decision_p99_us: parse_quantile(line, "P99"),
        wasm_memory_bytes: stats.get("kvroute.wasm_memory_bytes").copied(),
        rss_over_plain_bytes: rss
            .zip(plain_rss)
            .map(|(own, plain)| own as i64 - plain as i64),
        routed: count("kvroute.decisions.policy"),
        parse_errors: count("kvroute.parse_errors"),
    })
}

/// Run the benchmark; `progress` gets one line per wrk run.
pub async fn run(opts: &Options, mut progress: impl FnMut(&str)) -> anyhow::Result<Report> {
    let prompts = prompts(&opts.data)?;
    let mut report = Report::default();
    match &opts.dynmod {
        None => report.notes.push(format!(
            "{NATIVE} and {FLOOR_NATIVE}: skipped (no dynamic module: --dynmod PATH or KVROUTE_DYNMOD){}",
            if opts.floor_dynmod.is_some() {
                format!(", and {FLOOR_DYNMOD} with them")
            } else {
                String::new()
            }
        )),
        Some(m) => {
            // Settle the modules' names and directories before anything starts.
            let floor = opts.floor_dynmod.as_ref();
            for (m, flag) in [
                (Some(m), "--dynmod, KVROUTE_DYNMOD"),
                (floor, "--floor-dynmod, KVROUTE_FLOOR_DYNMOD"),
            ] {
                if let Some(m) = m {
                    m.name()
                        .and_then(|_| m.search_dir())
                        .map_err(|e| anyhow::anyhow!("{e:#} ({flag})"))?;
                }
            }
            if opts.floor_dynmod.is_none() {
                report.notes.push(format!(
                    "{FLOOR_DYNMOD}: skipped (no routing floor module: --floor-dynmod PATH or KVROUTE_FLOOR_DYNMOD; `make floor-dynmod` builds it)"
                ));
            }
            if !m.push {
                report.notes.push(format!(
                    "{NATIVE}: no snapshot pushed (--dynmod-skip-push, KVROUTE_DYNMOD_SKIP_PUSH): it had no endpoint stats to route by"
                ));
            }
        }
    }
    // Removed when dropped, however the run ends.
    let scratch = tempfile::Builder::new()
        .prefix("kvroute-overhead-")
        .tempdir()?;
    let dir = scratch.path();
    let mut version = now_ms();
    for &size in &opts.sizes {
        let body = chat_body(size, &prompts, opts.stream_events > 0);
        let body_path = dir.join(format!("body-{size}.json"));
        std::fs::write(&body_path, &body)?;
        let script = dir.join(format!("post-{size}.lua"));
        std::fs::write(
            &script,
            format!(
                "wrk.method = \"POST\"\nwrk.headers[\"content-type\"] = \"application/json\"\nlocal f = assert(io.open(\"{}\", \"rb\"))\nwrk.body = f:read(\"*a\")\nf:close()\n",
                body_path.display()
            ),
        )?;
        let p = start(opts).await?;
        version += 1;
        let targets: Vec<(&'static str, u16)> = p
            .proxies
            .iter()
            .filter_map(|x| Some((x.variant, x.push?)))
            .collect();
        for &(variant, ingest) in &targets {
            push_to(variant, ingest, version, &p.backend_addr).await?;
        }
        // The control plane's 1 Hz push, for the whole size.
        let backend_addr = p.backend_addr.clone();
        let pusher = tokio::spawn(async move {
            let mut v = version;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                v += 1;
                for &(_, ingest) in &targets {
                    let _ = push(ingest, v, &backend_addr).await;
                }
            }
        });
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); p.proxies.len()];
        let result: anyhow::Result<()> = async {
            for rep in 0..opts.reps {
                for (proxy, runs) in p.proxies.iter().zip(runs.iter_mut()) {
                    let name = proxy.variant;
                    let r = wrk(opts, proxy.port, &script, proxy.envoy.pid())
                        .await
                        .map_err(|e| anyhow::anyhow!("{name}: {e:#}"))?;
                    progress(&format!(
                        "{size:>8} B  rep {rep}  {name:<14} {:>9.1} req/s  p50 {:>8.0} µs  p99 {:>8.0} µs  cpu {:>7.1} µs/req",
                        r.rps, r.p50_us, r.p99_us, r.cpu_us
                    ));
                    runs.push(r);
                }
            }
            Ok(())
        }
        .await;
        pusher.abort();
        result?;
        let plain_rss = p
            .proxies
            .iter()
            .find(|x| x.variant == "plain")
            .and_then(|x| rss_bytes(x.envoy.pid()));
        for proxy in p
            .proxies
            .iter()
            .filter(|x| x.variant == "kvroute" || x.variant == NATIVE)
        {
            let stats = filter_stats(&proxy.envoy, plain_rss).await?;
            report.filter.push(FilterRow {
                size,
                variant: proxy.variant,
                stats,
            });
        }
        if let Some(kvroute) = p.proxies.iter().find(|x| x.variant == "kvroute") {
            let failures = kvroute.envoy.wasm_failures().await?;
            anyhow::ensure!(failures.is_empty(), "kvroute Wasm failures: {failures:?}");
        }
        for (proxy, v) in p.proxies.iter().zip(runs) {
            let m = |f: fn(&Run) -> f64| median(v.iter().map(f).collect());
            report.rows.push(Row {
                size,
                body_bytes: body.len(),
                variant: proxy.variant,
                median: Run {
                    rps: m(|r| r.rps),
                    p50_us: m(|r| r.p50_us),
                    p99_us: m(|r| r.p99_us),
                    cpu_us: m(|r| r.cpu_us),
                    requests: v.iter().map(|r| r.requests).sum(),
                },
                runs: v,
            });
        }
        drop(p.backend);
    }
    Ok(report)
}

/// "1 KiB", "16 KiB", "1 MiB", ... for a body size in bytes.
pub fn size_label(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{} MiB", size >> 20)
    } else if size >= 1 << 10 && size.is_multiple_of(1 << 10) {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

impl Report {
    /// The row of `variant` at `size`.
    pub fn row(&self, size: usize, variant: &str) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.size == size && r.variant == variant)
    }

    /// Markdown tables: one row per size and variant, then the filter's own figures per size
    /// and proxy (kvroute, kvroute-native), then the [`Report::notes`].
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        s.push_str("| body | proxy | req/s | ratio to plain | p50 ms | p99 ms | added p50 ms | added p99 ms | Envoy CPU µs/req | extra CPU µs/req |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &self.rows {
            let Some(base) = self.row(r.size, "plain") else {
                continue;
            };
            let (m, b) = (&r.median, &base.median);
            s.push_str(&format!(
                "| {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:+.2} | {:+.2} | {:.1} | {:+.1} |\n",
                size_label(r.size),
                r.variant,
                m.rps,
                m.rps / b.rps.max(f64::MIN_POSITIVE),
                m.p50_us / 1e3,
                m.p99_us / 1e3,
                (m.p50_us - b.p50_us) / 1e3,
                (m.p99_us - b.p99_us) / 1e3,
                m.cpu_us,
                m.cpu_us - b.cpu_us,
            ));
        }
        s.push_str("\n| body | proxy | extra CPU / floor extra CPU | decision_us p50 | decision_us p99 | Wasm memory per worker | Envoy RSS over plain | routed by policy | parse errors |\n");
        s.push_str("|---|---|---|---|---|---|---|---|---|\n");
        let na = || "n/a".to_string();
        let opt = |v: Option<f64>| v.map_or_else(na, |v| format!("{v:.1}"));
        let count = |v: Option<u64>| v.map_or_else(na, |v| v.to_string());
        let mib = |b: f64| format!("{:.1} MiB", b / (1u64 << 20) as f64);
        for f in &self.filter {
            let extra = |v: &str| -> Option<f64> {
                Some(self.row(f.size, v)?.median.cpu_us - self.row(f.size, "plain")?.median.cpu_us)
            };
            let ratio = match (extra(f.variant), extra("floor")) {
                (Some(k), Some(fl)) if fl > 0.0 => format!("{:.2}", k / fl),
                _ => na(),
            };
            let st = &f.stats;
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                size_label(f.size),
                f.variant,
                ratio,
                opt(st.decision_p50_us),
                opt(st.decision_p99_us),
                st.wasm_memory_bytes.map_or_else(na, |b| mib(b as f64)),
                st.rss_over_plain_bytes.map_or_else(na, |b| format!(
                    "{:+.1} MiB",
                    b as f64 / (1u64 << 20) as f64
                )),
                count(st.routed),
                count(st.parse_errors),
            ));
        }
        for note in &self.notes {
            s.push_str(&format!("\n{note}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn plugin_settings_are_laid_over_the_benchmarks_own() {
        assert_eq!(
            plugin_config(PLUGIN_CONFIG, None).unwrap(),
            r#"{"mode":"cluster"}"#
        );
        assert_eq!(
            plugin_config(
                PLUGIN_CONFIG,
                Some(r#"{"usage_sample_ms":0,"mode":"endpoint"}"#)
            )
            .unwrap(),
            r#"{"mode":"endpoint","usage_sample_ms":0}"#
        );
        for bad in ["[1]", "{", "3"] {
            let e = plugin_config(PLUGIN_CONFIG, Some(bad))
                .unwrap_err()
                .to_string();
            assert_eq!(e, format!("--plugin-config is not a JSON object: {bad}"));
        }
    }

    #[test]
    fn stream_chunks_are_an_event_stream_whose_usage_the_filter_reads() {
        let chunks = stream_chunks(3);
        assert_eq!(chunks.len(), 5);
        assert!(chunks
            .iter()
            .all(|c| c.starts_with("data: ") && c.ends_with("\n\n")));
        assert_eq!(chunks.last().map(String::as_str), Some("data: [DONE]\n\n"));
        assert_eq!(
            kvroute_core::usage::BodyFraming::sniff(chunks[0].as_bytes()),
            Some(kvroute_core::usage::BodyFraming::EventStream)
        );
        let mut sse =
            kvroute_core::usage::SseUsageScanner::new(kvroute_core::usage::DEFAULT_MAX_TAIL);
        for c in &chunks {
            sse.feed(c.as_bytes());
        }
        sse.finish();
        let u = sse.usage().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (100, 3));
    }

    #[test]
    fn parses_wrk_latency_output() {
        let out = "Running 5s test @ http://127.0.0.1:1/v1/chat/completions
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.01ms  340.12us   9.80ms   90.00%
    Req/Sec     3.98k   100.00     4.10k    80.00%
  Latency Distribution
     50%    1.95ms
     75%    2.10ms
     90%    2.40ms
     99%  812.00us
  19823 requests in 5.00s, 6.12MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:   3964.52
Transfer/sec:      1.22MB
";
        let (rps, p50, p99, n, non2xx, errors) = parse_wrk(out).unwrap();
        assert_eq!(
            (rps, p50, p99, n, non2xx, errors),
            (3964.52, 1950.0, 812.0, 19823, 4, 3)
        );
        assert!(parse_wrk("garbage").is_err());
    }

    #[test]
    fn parses_envoy_histogram_quantiles() {
        let line = "wasmcustom.kvroute.decision_us: P0(nan,3) P25(nan,4.05) P50(nan,5.1) P75(nan,6) P90(nan,8) P95(nan,9) P99(12,14.5) P99.5(nan,15) P99.9(nan,16) P100(nan,17)";
        assert_eq!(parse_quantile(line, "P50"), Some(5.1));
        assert_eq!(parse_quantile(line, "P99"), Some(14.5));
        assert_eq!(parse_quantile("x: P50(nan,nan)", "P50"), None);
        assert_eq!(parse_quantile("", "P50"), None);
    }

    #[test]
    fn bodies_have_the_requested_size_and_parse() {
        let prompts: Vec<String> = (0..10).map(|i| format!("prompt {i} ").repeat(50)).collect();
        for (size, stream) in [
            (1024, false),
            (16 * 1024, false),
            (256 * 1024, false),
            (1024, true),
        ] {
            let b = chat_body(size, &prompts, stream);
            assert!(
                b.len() <= size && b.len() + 64 >= size,
                "{size}: {}",
                b.len()
            );
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["model"], MODEL);
            assert_eq!(v["stream"], stream);
            assert_eq!(
                v["stream_options"]["include_usage"].as_bool(),
                stream.then_some(true)
            );
        }
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
    }

    fn options(dynmod: Option<DynModule>) -> Options {
        Options {
            sizes: vec![1024],
            reps: 1,
            duration: Duration::from_secs(1),
            connections: 1,
            wrk: "wrk".into(),
            floor_wasm: "/x/floor.wasm".into(),
            kvroute_wasm: "/x/kvroute_filter.wasm".into(),
            data: "/x".into(),
            stream_events: 0,
            stream_gap: Duration::ZERO,
            plugin_config: None,
            dynmod,
            floor_dynmod: None,
        }
    }

    fn module(path: &str) -> DynModule {
        DynModule {
            path: path.into(),
            filter_name: DynModule::FILTER_NAME.into(),
            push: true,
        }
    }

    #[test]
    fn a_module_is_named_by_its_file_and_found_in_its_directory() {
        assert_eq!(module("/opt/m/libkvroute.so").name().unwrap(), "kvroute");
        assert_eq!(module("libkv_dm.so").name().unwrap(), "kv_dm");
        for bad in [
            "/opt/m/kvroute.so",
            "/opt/m/libkvroute.dylib",
            "/opt/m/lib.so",
            "/",
        ] {
            let e = module(bad).name().unwrap_err().to_string();
            assert!(e.contains("must be named lib<name>.so"), "{bad}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let so = dir.path().join("libkvroute.so");
        assert!(module(so.to_str().unwrap()).search_dir().is_err());
        std::fs::write(&so, b"").unwrap();
        let m = module(so.to_str().unwrap());
        assert_eq!(m.search_dir().unwrap(), dir.path());
        assert_eq!(
            m.env_wrapper().unwrap(),
            [
                "env".to_string(),
                format!("ENVOY_DYNAMIC_MODULES_SEARCH_PATH={}", dir.path().display())
            ]
        );
    }

    #[test]
    fn the_native_proxy_runs_only_with_a_module_and_is_pushed_to_unless_told_not() {
        assert_eq!(options(None).variants(), VARIANTS);
        assert_eq!(options(None).push_port(NATIVE, 9), None);
        assert_eq!(options(None).push_port("kvroute", 9), Some(9));
        let o = options(Some(module("/m/libkvroute.so")));
        assert_eq!(
            o.variants(),
            ["plain", "floor", "kvroute", FLOOR_NATIVE, NATIVE]
        );
        assert_eq!(o.push_port(FLOOR_NATIVE, 9), None);
        assert_eq!(o.push_port(NATIVE, 9), Some(9));
        assert_eq!(o.push_port("floor", 9), None);
        let o = options(Some(DynModule {
            push: false,
            ..module("/m/libkvroute.so")
        }));
        assert_eq!(o.push_port(NATIVE, 9), None);
        assert_eq!(o.push_port("kvroute", 9), Some(9));
    }

    #[test]
    fn the_routing_floor_runs_between_the_native_floors_only_beside_kvroute_native() {
        let floor = DynModule {
            filter_name: "floor".into(),
            push: false,
            ..module("/m/libkvroute_floor_dynmod.so")
        };
        let alone = Options {
            floor_dynmod: Some(floor.clone()),
            ..options(None)
        };
        assert_eq!(alone.variants(), VARIANTS);
        let o = Options {
            floor_dynmod: Some(floor.clone()),
            ..options(Some(module("/m/libkvroute.so")))
        };
        assert_eq!(
            o.variants(),
            [
                "plain",
                "floor",
                "kvroute",
                FLOOR_NATIVE,
                FLOOR_DYNMOD,
                NATIVE
            ]
        );
        assert_eq!(o.module_of(FLOOR_DYNMOD), Some(&floor));
        assert_eq!(o.push_port(FLOOR_DYNMOD, 9), None);

        // kvroute-native's cluster-mode config, the floor module in both filters with the
        // routing header as its config, even where kvroute's config asks for endpoint mode.
        for config in [PLUGIN_CONFIG, r#"{"mode":"endpoint"}"#] {
            let y = proxy_yaml(FLOOR_DYNMOD, &o, 1000, 1001, "127.0.0.1:9", config).unwrap();
            assert_eq!(
                y.matches(
                    "dynamic_module_config: {name: kvroute_floor_dynmod, do_not_close: true}"
                )
                .count(),
                2,
                "{y}"
            );
            assert_eq!(y.matches("filter_name: floor").count(), 2, "{y}");
            assert_eq!(
                y.matches("value: 'x-kvroute-cluster: c0'").count(),
                2,
                "{y}"
            );
            assert!(y.contains("cluster_header: x-kvroute-cluster"), "{y}");
            assert!(y.contains("- name: c15\n"), "{y}");
            assert!(!y.contains(r#""mode""#), "{y}");
        }
        let e = proxy_yaml(FLOOR_DYNMOD, &options(None), 1, 2, "127.0.0.1:9", "{}").unwrap_err();
        assert!(
            e.to_string().contains(
                "floor-dynmod needs a dynamic module (--floor-dynmod, KVROUTE_FLOOR_DYNMOD)"
            ),
            "{e}"
        );
    }

    /// The lines of `yaml` outside the stretches that run from a line where `starts` holds
    /// to the router filter's line (kept).
    fn outside_filters(yaml: &str, starts: impl Fn(&str) -> bool) -> Vec<String> {
        let mut inside = false;
        let mut out = Vec::new();
        for l in yaml.lines() {
            if starts(l) {
                inside = true;
            } else if l.contains("envoy.filters.http.router") {
                inside = false;
            }
            if !inside {
                out.push(l.to_owned());
            }
        }
        out
    }

    #[test]
    fn the_native_config_differs_from_the_wasm_one_only_in_the_filters() {
        let o = options(Some(DynModule {
            filter_name: "kv".into(),
            ..module("/m/libkvroute.so")
        }));
        let config = r#"{"mode":"cluster"}"#;
        let wasm = proxy_yaml("kvroute", &o, 1000, 1001, "127.0.0.1:9", config).unwrap();
        let native = proxy_yaml(NATIVE, &o, 1000, 1001, "127.0.0.1:9", config).unwrap();
        // Lines outside the two filter stanzas (from an `http_filters:` item to the
        // router) are the same.
        let outside = |yaml| outside_filters(yaml, |l| l.contains("templates::kvroute_filters"));
        assert_eq!(outside(&wasm), outside(&native));
        assert_ne!(wasm, native);
        assert_eq!(wasm.matches("envoy.filters.http.wasm").count(), 2);
        assert!(!native.contains("wasm"), "{native}");
        assert_eq!(
            native
                .matches("dynamic_module_config: {name: kvroute, do_not_close: true}")
                .count(),
            2
        );
        assert_eq!(native.matches("filter_name: kv\n").count(), 2);
        assert!(native.contains(&format!("value: '{config}'")), "{native}");
        let ingest = kvroute_integration::harness::kvroute::ingest_plugin_config();
        assert!(native.contains(&format!("value: '{ingest}'")), "{native}");
        let e = proxy_yaml(NATIVE, &options(None), 1, 2, "127.0.0.1:9", config).unwrap_err();
        assert!(
            e.to_string()
                .contains("kvroute-native needs a dynamic module (--dynmod, KVROUTE_DYNMOD)"),
            "{e}"
        );
    }

    /// `"mode":"endpoint"` in the plugin configuration runs both kvroute proxies in
    /// endpoint mode: one `pool` cluster with the `override_host` load balancer, no
    /// per-endpoint clusters and no `cluster_header` route.
    #[test]
    fn endpoint_mode_runs_the_endpoint_template() {
        let o = options(Some(module("/m/libkvroute.so")));
        let config = plugin_config(PLUGIN_CONFIG, Some(r#"{"mode":"endpoint"}"#)).unwrap();
        assert!(endpoint_mode(&config));
        assert!(!endpoint_mode(PLUGIN_CONFIG));
        assert!(!endpoint_mode("not json"));
        for variant in ["kvroute", NATIVE] {
            let yaml = proxy_yaml(variant, &o, 1000, 1001, "127.0.0.1:9", &config).unwrap();
            assert!(
                yaml.contains("envoy.load_balancing_policies.override_host"),
                "{yaml}"
            );
            assert!(
                yaml.contains("header: x-gateway-destination-endpoint"),
                "{yaml}"
            );
            assert!(yaml.contains("cluster: pool"), "{yaml}");
            assert!(!yaml.contains("cluster_header"), "{yaml}");
            assert!(!yaml.contains("name: c0"), "{yaml}");
        }
        let cluster = proxy_yaml(NATIVE, &o, 1000, 1001, "127.0.0.1:9", PLUGIN_CONFIG).unwrap();
        assert!(
            cluster.contains("cluster_header: x-kvroute-cluster"),
            "{cluster}"
        );
        assert!(cluster.contains("name: c15"), "{cluster}");
    }

    #[test]
    fn the_native_floor_is_the_wasm_floor_with_envoys_buffer_filter_instead() {
        let o = options(Some(module("/m/libkvroute.so")));
        let floor = proxy_yaml("floor", &o, 1000, 1001, "127.0.0.1:9", "{}").unwrap();
        let native = proxy_yaml(FLOOR_NATIVE, &o, 1000, 1001, "127.0.0.1:9", "{}").unwrap();
        // The config without its comments and its first filter (up to the router).
        let rest = |yaml: &str| {
            let uncommented: String = yaml
                .lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| format!("{l}\n"))
                .collect();
            outside_filters(&uncommented, |l| {
                l.trim_start().starts_with("- name: envoy.filters.http.") && !l.contains(".router")
            })
        };
        assert_eq!(rest(&floor), rest(&native));
        assert!(!native.contains("wasm"), "{native}");
        assert!(
            native.contains(&format!(
                "envoy.extensions.filters.http.buffer.v3.Buffer\n              max_request_bytes: {BUFFER_LIMIT}\n"
            )),
            "{native}"
        );
        assert_eq!(native.matches("- name: envoy.filters.http.").count(), 2);
    }

    #[test]
    fn plugin_metrics_are_found_under_either_namespace() {
        for stat in [
            "wasmcustom.kvroute.decision_us",
            "dynamicmodulescustom.kvroute.decision_us",
            "kvroute.decision_us",
        ] {
            assert_eq!(kvroute_metric(stat), "kvroute.decision_us");
        }
        assert_eq!(
            kvroute_metric("cluster.c0.upstream_rq"),
            "cluster.c0.upstream_rq"
        );
        assert!(rss_bytes(std::process::id()).unwrap_or(0) > 0);
    }

    #[test]
    fn the_report_has_native_rows_and_says_what_was_skipped() {
        let row = |variant, cpu_us| Row {
            size: 1024,
            body_bytes: 1000,
            variant,
            median: Run {
                rps: 1000.0,
                p50_us: 1000.0,
                p99_us: 2000.0,
                cpu_us,
                requests: 10,
            },
            runs: vec![],
        };
        let kv = FilterStats {
            decision_p50_us: Some(5.0),
            decision_p99_us: Some(9.0),
            wasm_memory_bytes: Some(2 << 20),
            rss_over_plain_bytes: Some(60 << 20),
            routed: Some(10),
            parse_errors: Some(0),
        };
        let native = FilterStats {
            rss_over_plain_bytes: Some(-(1 << 20)),
            ..FilterStats::default()
        };
        let report = Report {
            rows: vec![
                row("plain", 100.0),
                row("floor", 120.0),
                row("kvroute", 160.0),
                row(NATIVE, 110.0),
            ],
            filter: vec![
                FilterRow {
                    size: 1024,
                    variant: "kvroute",
                    stats: kv,
                },
                FilterRow {
                    size: 1024,
                    variant: NATIVE,
                    stats: native,
                },
            ],
            notes: vec!["kvroute-native: a note".into()],
        };
        let md = report.markdown();
        assert!(
            md.contains("| 1 KiB | kvroute-native | 1000 | 1.00 | 1.00 | 2.00 | +0.00 | +0.00 | 110.0 | +10.0 |"),
            "{md}"
        );
        assert!(
            md.contains("| 1 KiB | kvroute | 3.00 | 5.0 | 9.0 | 2.0 MiB | +60.0 MiB | 10 | 0 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| 1 KiB | kvroute-native | 0.50 | n/a | n/a | n/a | -1.0 MiB | n/a | n/a |"
            ),
            "{md}"
        );
        assert!(md.ends_with("\nkvroute-native: a note\n"), "{md}");
    }
}
