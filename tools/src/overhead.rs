//! `make bench-overhead`: what the kvroute filter costs next to plain Envoy and next to the
//! cheapest body-reading Wasm filter, in one run (issue 13; method and results in
//! `docs/overhead.md`).
//!
//! ## Set-up
//! - **backend**: one Envoy (`--concurrency 1`) that reads each request body whole (buffer
//!   filter) and answers a fixed chat completion itself ([`templates::DIRECT_RESPONSE`]);
//!   with `--stream-events N`, a hyper server that answers an event stream of `N` token
//!   events, a `usage` event and `[DONE]`, each its own body chunk ([`stream_chunks`]), as a
//!   model server streams a completion;
//! - **plain**: Envoy 1.40, `--concurrency 1`, router only ([`templates::PLAIN`]);
//! - **floor**: the same plus `bench/floor-filter`, a proxy-wasm filter that buffers the body
//!   and copies it into the VM, nothing else ([`templates::FLOOR`]);
//! - **kvroute**: the same plus the kvroute filter in cluster mode, hybrid policy, 16
//!   endpoints (all on the one backend) in a snapshot pushed to the ingest listener once a
//!   second, as the control plane does ([`templates::CLUSTER_MODE`]).
//!
//! The three proxies run side by side with the same buffer limit and stats flush interval.
//! For each body size a fresh set is started; then, for each repetition, `wrk -t1 -c8`
//! drives plain, floor and kvroute in turn (alternating, so slow drift from other load on the
//! machine hits all three alike) with the same chat body: real ShareGPT turns from
//! `../shared/data/prompts/` (LMBenchmark warm-up inputs) as alternating user/assistant
//! messages up to the size.
//!
//! ## What is reported (medians over repetitions)
//! - req/s and its ratio to plain; p50/p99 latency from wrk and the latency added over plain;
//! - Envoy's CPU per request: the process's on-CPU time (sum of `/proc/<pid>/task/*/schedstat`,
//!   nanoseconds, all threads) over the run divided by completed requests; "extra" is the
//!   difference to plain. It does not depend on how busy the rest of the machine is, unlike
//!   req/s;
//! - kvroute's `decision_us` histogram (analysis + pick + reservation, per request, measured
//!   inside the filter), p50/p99 cumulative over the size's runs, read after a stats flush;
//! - kvroute's Wasm linear memory per worker (`kvroute.wasm_memory_bytes` gauge, the VM's
//!   high-water mark) after the size's runs.

use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_integration::harness::{http, render, templates, Envoy, RecordingBackend, Reply};
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

/// Proxy variants, in the order each repetition runs them.
pub const VARIANTS: [&str; 3] = ["plain", "floor", "kvroute"];

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

/// kvroute's own figures at one body size.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FilterStats {
    /// `decision_us` p50 (cumulative), microseconds; `None` when the histogram is empty.
    pub decision_p50_us: Option<f64>,
    /// `decision_us` p99 (cumulative), microseconds.
    pub decision_p99_us: Option<f64>,
    /// Wasm linear memory of the worker VM, bytes.
    pub wasm_memory_bytes: Option<u64>,
    /// Requests the filter routed by its policy.
    pub routed: u64,
    /// Requests the filter failed to analyse.
    pub parse_errors: u64,
}

/// The whole run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Rows in size, then [`VARIANTS`] order.
    pub rows: Vec<Row>,
    /// kvroute figures per size, aligned with the sizes.
    pub filter: Vec<(usize, FilterStats)>,
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

struct Proxies {
    backend: Backend,
    plain: Envoy,
    floor: Envoy,
    kvroute: Envoy,
    ports: [u16; 3],
    ingest: u16,
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

/// The config of proxy `variant` (one of [`VARIANTS`]) listening on `listen`, with every
/// cluster on `backend` (`host:port`); kvroute's ingest listener on `ingest` and its
/// plugin configuration `plugin_config` (JSON).
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
        "floor" => render(
            templates::FLOOR,
            &[
                ("LISTEN_PORT", listen.to_string()),
                ("BUFFER_LIMIT", BUFFER_LIMIT.to_string()),
                ("WASM", opts.floor_wasm.display().to_string()),
                ("DEFAULT_CLUSTER", "default".into()),
                ("CLUSTERS", default),
            ],
        )?,
        "kvroute" => {
            let mut clusters: String = (0..ENDPOINTS)
                .map(|i| templates::static_cluster(&format!("c{i}"), &addrs))
                .collect();
            clusters.push_str(&default);
            render(
                templates::CLUSTER_MODE,
                &[
                    ("LISTEN_PORT", listen.to_string()),
                    ("INGEST_PORT", ingest.to_string()),
                    ("BUFFER_LIMIT", BUFFER_LIMIT.to_string()),
                    ("PLUGIN_CONFIG", plugin_config.into()),
                    (
                        "INGEST_CONFIG",
                        kvroute_integration::harness::kvroute::ingest_plugin_config(),
                    ),
                    ("WASM", opts.kvroute_wasm.display().to_string()),
                    ("CLUSTER_HEADER", "x-kvroute-cluster".into()),
                    ("DEFAULT_CLUSTER", "default".into()),
                    ("CLUSTERS", clusters),
                ],
            )?
        }
        other => anyhow::bail!("unknown proxy variant `{other}` (one of {VARIANTS:?})"),
    };
    Ok(with_flush(yaml))
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

async fn start(opts: &Options) -> anyhow::Result<Proxies> {
    let config = plugin_config(PLUGIN_CONFIG, opts.plugin_config.as_deref())?;
    let (backend, backend_addr) = start_backend(opts).await?;
    // Plain and floor have no ingest listener: the port is unused there.
    let yaml = |v: &str, [port, ingest]: [u16; 2]| {
        proxy_yaml(v, opts, port, ingest, &backend_addr, &config)
    };
    let (plain, [pp]) = Envoy::start_on_free_ports(1, |[p]| yaml("plain", [p, 0])).await?;
    let (floor, [fp]) = Envoy::start_on_free_ports(1, |[p]| yaml("floor", [p, 0])).await?;
    let (kvroute, [kp, ip]) = Envoy::start_on_free_ports(1, |p| yaml("kvroute", p)).await?;
    Ok(Proxies {
        backend,
        plain,
        floor,
        kvroute,
        ports: [pp, fp, kp],
        ingest: ip,
        backend_addr,
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
        r.text()
    );
    Ok(())
}

async fn wrk(opts: &Options, port: u16, script: &Path, pid: u32) -> anyhow::Result<Run> {
    let cpu0 = cpu_ns(pid)?;
    let out = tokio::process::Command::new(&opts.wrk)
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

async fn filter_stats(kvroute: &Envoy) -> anyhow::Result<FilterStats> {
    // Histograms reach /stats at a stats flush.
    tokio::time::sleep(STATS_FLUSH * 2 + Duration::from_millis(500)).await;
    let h = http::request(
        "GET",
        &format!(
            "http://{}/stats?filter=wasmcustom.kvroute.decision_us",
            kvroute.admin()
        ),
        &[],
        b"",
    )
    .await?;
    let text = h.text();
    let line = text
        .lines()
        .find(|l| l.starts_with("wasmcustom.kvroute.decision_us:"))
        .unwrap_or("");
    let stats = kvroute.stats().await?;
    let get = |k: &str| stats.get(k).copied();
    Ok(FilterStats {
        decision_p50_us: parse_quantile(line, "P50"),
        decision_p99_us: parse_quantile(line, "P99"),
        wasm_memory_bytes: get("wasmcustom.kvroute.wasm_memory_bytes"),
        routed: stats
            .iter()
            .filter(|(k, _)| k.starts_with("wasmcustom.kvroute.decisions.policy"))
            .map(|(_, v)| *v)
            .sum(),
        parse_errors: get("wasmcustom.kvroute.parse_errors").unwrap_or(0),
    })
}

/// Run the benchmark; `progress` gets one line per wrk run.
pub async fn run(opts: &Options, mut progress: impl FnMut(&str)) -> anyhow::Result<Report> {
    let prompts = prompts(&opts.data)?;
    let dir = std::env::temp_dir().join(format!("kvroute-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut report = Report::default();
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
        push(p.ingest, version, &p.backend_addr).await?;
        // The control plane's 1 Hz push, for the whole size.
        let (ingest, backend_addr) = (p.ingest, p.backend_addr.clone());
        let pusher = tokio::spawn(async move {
            let mut v = version;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                v += 1;
                let _ = push(ingest, v, &backend_addr).await;
            }
        });
        let pids = [p.plain.pid(), p.floor.pid(), p.kvroute.pid()];
        let mut runs: [Vec<Run>; 3] = Default::default();
        let result: anyhow::Result<()> = async {
            for rep in 0..opts.reps {
                for (i, name) in VARIANTS.iter().enumerate() {
                    let (port, pid) = (p.ports.get(i).copied(), pids.get(i).copied());
                    let (Some(port), Some(pid)) = (port, pid) else {
                        continue;
                    };
                    let r = wrk(opts, port, &script, pid).await?;
                    progress(&format!(
                        "{size:>8} B  rep {rep}  {name:<8} {:>9.1} req/s  p50 {:>8.0} µs  p99 {:>8.0} µs  cpu {:>7.1} µs/req",
                        r.rps, r.p50_us, r.p99_us, r.cpu_us
                    ));
                    if let Some(v) = runs.get_mut(i) {
                        v.push(r);
                    }
                }
            }
            Ok(())
        }
        .await;
        pusher.abort();
        result?;
        let fs = filter_stats(&p.kvroute).await?;
        let failures = p.kvroute.wasm_failures().await?;
        anyhow::ensure!(failures.is_empty(), "kvroute Wasm failures: {failures:?}");
        for (i, name) in VARIANTS.iter().enumerate() {
            let v = runs.get(i).cloned().unwrap_or_default();
            let m = |f: fn(&Run) -> f64| median(v.iter().map(f).collect());
            report.rows.push(Row {
                size,
                body_bytes: body.len(),
                variant: name,
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
        report.filter.push((size, fs));
        drop(p.backend);
    }
    let _ = std::fs::remove_dir_all(&dir);
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

    /// Markdown tables: one row per size and variant, then kvroute's own figures per size.
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
        s.push_str("\n| body | kvroute extra CPU / floor extra CPU | decision_us p50 | decision_us p99 | Wasm memory per worker | routed by policy | parse errors |\n");
        s.push_str("|---|---|---|---|---|---|---|\n");
        let opt = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
        for (size, f) in &self.filter {
            let extra = |v: &str| -> Option<f64> {
                Some(self.row(*size, v)?.median.cpu_us - self.row(*size, "plain")?.median.cpu_us)
            };
            let ratio = match (extra("kvroute"), extra("floor")) {
                (Some(k), Some(fl)) if fl > 0.0 => format!("{:.2}", k / fl),
                _ => "n/a".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                size_label(*size),
                ratio,
                opt(f.decision_p50_us),
                opt(f.decision_p99_us),
                f.wasm_memory_bytes.map_or("n/a".to_string(), |b| format!(
                    "{:.1} MiB",
                    b as f64 / (1u64 << 20) as f64
                )),
                f.routed,
                f.parse_errors,
            ));
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
}
