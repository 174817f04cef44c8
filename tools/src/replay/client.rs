//! Open-loop streaming client.
//!
//! ## Open loop and the concurrency cap
//! Request *i* is due at `start + at_s`. A tokio task per request sleeps until then, takes a
//! permit of a semaphore of `concurrency_cap` permits (0 = unlimited) and sends. When the cap
//! is reached, due requests queue client-side; **the wait counts in their latency**: TTFT and
//! E2E are measured from the scheduled time, not from the actual send, so an overloaded
//! client shows up as latency instead of silently lowering the offered load (the "coordinated
//! omission" correction, G. Tene, "How NOT to Measure Latency", 2015).
//!
//! ## Measurements (wall seconds)
//! - **TTFT**: scheduled time → first SSE chunk with non-empty `choices[0].delta.content`
//!   (or `reasoning_content`; `text` for completions). The role-only opening chunk does not
//!   count.
//! - **E2E**: scheduled time → end of the stream (`data: [DONE]`, or the body's end).
//! - **TPOT**: `(E2E − TTFT) / (output_tokens − 1)`, `None` for one-token outputs (vLLM's
//!   `benchmark_serving.py` definition).
//! - **output tokens**: `usage.completion_tokens` of the final usage chunk
//!   (`stream_options.include_usage`), else the number of content chunks.
//! - **cached tokens**: `usage.prompt_tokens_details.cached_tokens` (vLLM with
//!   `--enable-prompt-tokens-details`, kvroute-sim, recent llama.cpp), else llama.cpp's
//!   `timings.cache_n` (tokens reused from the slot's KV cache, sent in its final chunk).
//!
//! ## Errors (recorded, never fatal)
//! Non-2xx (status and the first 200 bytes of the body), connection failures, the
//! per-request timeout (`timeout_s` from the scheduled time), a body that is not an SSE
//! stream of JSON chunks, an `error` object inside the stream, and a stream that ends without
//! `[DONE]`. Records keep whatever was measured before the failure.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use serde_json::Value;
use tokio::time::Instant;

use super::kv::{parse_kind, sample_loop};
use super::{ReplayError, ReplayRequest, RequestRecord, RunOptions, RunReport};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Bytes of a non-2xx body kept in the error message.
const ERROR_EXCERPT: usize = 200;

fn validate(opts: &RunOptions) -> Result<hyper::Uri, ReplayError> {
    let bad = |reason| ReplayError::Option {
        option: "url",
        value: opts.url.clone(),
        reason,
    };
    let uri: hyper::Uri = opts.url.parse().map_err(|_| bad("not a URL"))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad("only http:// URLs are supported"));
    }
    if uri.host().is_none() {
        return Err(bad("no host"));
    }
    if !(opts.timeout_s.is_finite() && opts.timeout_s > 0.0) {
        return Err(ReplayError::Option {
            option: "timeout_s",
            value: opts.timeout_s.to_string(),
            reason: "must be a finite number > 0",
        });
    }
    let interval_ok = opts.kv_sample_interval_s.is_finite() && opts.kv_sample_interval_s > 0.0;
    if !opts.kv_sample.is_empty() && !interval_ok {
        return Err(ReplayError::Option {
            option: "kv_sample_interval_s",
            value: opts.kv_sample_interval_s.to_string(),
            reason: "must be a finite number > 0",
        });
    }
    Ok(uri)
}

/// What the stream said so far.
#[derive(Debug, Default)]
struct StreamState {
    first_token: Option<Instant>,
    chunks: u32,
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    cached_tokens: Option<u32>,
    cache_n: Option<u32>,
    done: bool,
}

fn as_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

impl StreamState {
    /// Apply one SSE `data` payload received at `now`. `Err` for an error object or bad JSON.
    fn apply(&mut self, data: &str, now: Instant) -> Result<(), String> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        if data.is_empty() {
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|e| {
            format!(
                "malformed stream chunk ({e}): {}",
                data.chars().take(ERROR_EXCERPT).collect::<String>()
            )
        })?;
        if let Some(err) = v.get("error") {
            return Err(format!("error in stream: {err}"));
        }
        let choice = v.get("choices").and_then(|c| c.get(0));
        let content = choice.and_then(|c| {
            let delta = c.get("delta");
            delta
                .and_then(|d| d.get("content"))
                .or_else(|| delta.and_then(|d| d.get("reasoning_content")))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str)
        });
        if content.is_some_and(|s| !s.is_empty()) {
            self.chunks += 1;
            self.first_token.get_or_insert(now);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.prompt_tokens = as_u32(u.get("prompt_tokens")).or(self.prompt_tokens);
            self.completion_tokens = as_u32(u.get("completion_tokens")).or(self.completion_tokens);
            self.cached_tokens = as_u32(
                u.get("prompt_tokens_details")
                    .and_then(|d| d.get("cached_tokens")),
            )
            .or(self.cached_tokens);
        }
        if let Some(t) = v.get("timings") {
            self.cache_n = as_u32(t.get("cache_n")).or(self.cache_n);
        }
        Ok(())
    }
}

struct Outcome {
    started: Option<Instant>,
    status: u16,
    backend: Option<String>,
    state: StreamState,
    error: Option<String>,
}

async fn send_one(
    client: &HttpClient,
    uri: &hyper::Uri,
    body: Bytes,
    backend_header: Option<&str>,
    out: &mut Outcome,
) {
    let req = match hyper::Request::post(uri.clone())
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(Full::new(body))
    {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("building the request: {e}"));
            return;
        }
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("connection: {e:#}"));
            return;
        }
    };
    out.status = resp.status().as_u16();
    out.backend = backend_header
        .and_then(|h| resp.headers().get(h))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if !resp.status().is_success() {
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        let text: String = body
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .chars()
                    .take(ERROR_EXCERPT)
                    .collect()
            })
            .unwrap_or_default();
        out.error = Some(format!("HTTP {}: {text}", out.status));
        return;
    }
    let mut events = resp.into_body().into_data_stream().eventsource();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ev) => {
                if let Err(e) = out.state.apply(&ev.data, Instant::now()) {
                    out.error = Some(e);
                    return;
                }
                if out.state.done {
                    return;
                }
            }
            Err(e) => {
                out.error = Some(format!("reading the stream: {e}"));
                return;
            }
        }
    }
    if !out.state.done {
        out.error = Some(
            if out.state.chunks == 0 && out.state.completion_tokens.is_none() {
                "response is not an SSE stream of chat chunks (no data events)".to_owned()
            } else {
                "stream ended without [DONE]".to_owned()
            },
        );
    }
}

fn record(
    req: &ReplayRequest,
    start: Instant,
    due: Instant,
    end: Instant,
    o: Outcome,
) -> RequestRecord {
    let e2e_s = end.saturating_duration_since(due).as_secs_f64();
    let ttft_s = o
        .state
        .first_token
        .map(|t| t.saturating_duration_since(due).as_secs_f64());
    let output_tokens = o.state.completion_tokens.unwrap_or(o.state.chunks);
    let tpot_s = match (ttft_s, o.error.is_none() && output_tokens > 1) {
        (Some(t), true) => Some((e2e_s - t).max(0.0) / f64::from(output_tokens - 1)),
        _ => None,
    };
    RequestRecord {
        id: req.id,
        status: o.status,
        error: o.error,
        backend: o.backend,
        sent_at_s: req.at_s,
        started_at_s: o
            .started
            .map_or(0.0, |t| t.saturating_duration_since(start).as_secs_f64()),
        ttft_s,
        tpot_s,
        e2e_s,
        prompt_tokens: o.state.prompt_tokens.unwrap_or(0),
        cached_tokens: o.state.cached_tokens.or(o.state.cache_n).unwrap_or(0),
        output_tokens,
    }
}

fn progress_bar(n: usize, show: bool, label: &str) -> indicatif::ProgressBar {
    if !show || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(n as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
    ) {
        pb.set_style(style);
    }
    pb.set_prefix(label.to_owned());
    pb
}

/// Send `reqs` open-loop to `opts.url` and measure each one (see the module doc).
/// Records come back in `reqs` order; `wall_s` runs from the start to the last response.
///
/// Errors only on setup ([`ReplayError::Option`]): a URL that is not `http://host[:port]/path`,
/// a non-positive timeout or sampling period, an unknown KV adapter kind. Per-request
/// failures are recorded in [`RequestRecord::error`], never returned.
pub async fn run(reqs: &[ReplayRequest], opts: &RunOptions) -> Result<RunReport, ReplayError> {
    let uri = validate(opts)?;
    let targets = opts
        .kv_sample
        .iter()
        .map(|t| Ok((t.clone(), parse_kind(&t.kind)?)))
        .collect::<Result<Vec<_>, ReplayError>>()?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    let sem = (opts.concurrency_cap > 0)
        .then_some(Arc::new(tokio::sync::Semaphore::new(opts.concurrency_cap)));
    let timeout = Duration::from_secs_f64(opts.timeout_s);
    let pb = progress_bar(reqs.len(), opts.progress, &opts.label);
    let start = Instant::now();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampler = (!targets.is_empty()).then(|| {
        tokio::spawn(sample_loop(
            targets,
            Duration::from_secs_f64(opts.kv_sample_interval_s),
            start,
            stop_rx,
        ))
    });
    let backend_header: Option<Arc<str>> = opts.backend_header.as_deref().map(Arc::from);
    let mut tasks = Vec::with_capacity(reqs.len());
    for req in reqs {
        let req = req.clone();
        let client = client.clone();
        let uri = uri.clone();
        let sem = sem.clone();
        let pb = pb.clone();
        let backend_header = backend_header.clone();
        let due = start + Duration::from_secs_f64(req.at_s.max(0.0));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            let mut out = Outcome {
                started: None,
                status: 0,
                backend: None,
                state: StreamState::default(),
                error: None,
            };
            let work = async {
                let _permit = match &sem {
                    Some(s) => s.acquire().await.ok(),
                    None => None,
                };
                out.started = Some(Instant::now());
                send_one(
                    &client,
                    &uri,
                    req.body.clone(),
                    backend_header.as_deref(),
                    &mut out,
                )
                .await;
            };
            if tokio::time::timeout_at(due + timeout, work).await.is_err() {
                out.error = Some(format!("timeout after {:.3} s", timeout.as_secs_f64()));
            }
            let end = Instant::now();
            pb.inc(1);
            (record(&req, start, due, end, out), end)
        }));
    }
    let mut records = Vec::with_capacity(reqs.len());
    let mut last = start;
    for (task, req) in tasks.into_iter().zip(reqs) {
        match task.await {
            Ok((r, end)) => {
                last = last.max(end);
                records.push(r);
            }
            Err(e) => records.push(RequestRecord {
                id: req.id,
                status: 0,
                error: Some(format!("request task failed: {e}")),
                backend: None,
                sent_at_s: req.at_s,
                started_at_s: 0.0,
                ttft_s: None,
                tpot_s: None,
                e2e_s: 0.0,
                prompt_tokens: 0,
                cached_tokens: 0,
                output_tokens: 0,
            }),
        }
    }
    pb.finish_and_clear();
    let _ = stop_tx.send(true);
    let kv = match sampler {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    Ok(RunReport {
        label: opts.label.clone(),
        records,
        kv,
        wall_s: last.saturating_duration_since(start).as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_state_reads_vllm_and_llamacpp_chunks() {
        let t0 = Instant::now();
        let mut s = StreamState::default();
        s.apply(
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            t0,
        )
        .unwrap();
        assert_eq!((s.chunks, s.first_token), (0, None));
        s.apply(r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#, t0)
            .unwrap();
        assert_eq!(s.chunks, 1);
        assert!(s.first_token.is_some());
        s.apply(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
            t0,
        )
        .unwrap();
        assert_eq!(
            (s.prompt_tokens, s.completion_tokens, s.cached_tokens),
            (Some(10), Some(3), Some(8))
        );
        let mut l = StreamState::default();
        l.apply(
            r#"{"choices":[{"finish_reason":"stop","delta":{}}],"usage":{"prompt_tokens":5,"completion_tokens":2},"timings":{"cache_n":4}}"#,
            t0,
        )
        .unwrap();
        assert_eq!((l.cached_tokens, l.cache_n), (None, Some(4)));
        l.apply("[DONE]", t0).unwrap();
        assert!(l.done);
        assert!(l
            .apply("{not json", t0)
            .unwrap_err()
            .starts_with("malformed stream chunk"));
        assert!(l
            .apply(r#"{"error":{"message":"boom"}}"#, t0)
            .unwrap_err()
            .contains("boom"));
    }
}
