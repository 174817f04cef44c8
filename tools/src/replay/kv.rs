//! KV-usage sampling of model servers through kvroute-cp's adapters.
//!
//! Every `kv_sample_interval_s` the sampler GETs each target's `/metrics` (and llama.cpp's
//! `/slots`), parses it with kvroute-cp's Prometheus text reader
//! ([`kvroute_cp::expo::Exposition::parse_with`], keeping only the names adapters read) and
//! extracts [`kvroute_cp::adapters::ServerStats`] with the configured adapter
//! ([`kvroute_cp::adapters::extract`]): the same numbers the control plane pushes to the
//! filter. A target whose scrape fails, or that exposes no KV signal (TGI), yields no sample
//! for that tick; failures never stop the run.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use kvroute_cp::adapters::{extract, is_relevant, ServerKind};
use kvroute_cp::expo::Exposition;
use tokio::time::Instant;

use super::{KvSample, KvSampleTarget, ReplayError};

/// Per-scrape deadline (a stuck server must not stall the sampler).
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Parse a kvroute-cp adapter kind (`vllm`, `sglang`, `tgi`, `llamacpp`, `trtllm`,
/// `llmd-sim`, `auto`). Errors with [`ReplayError::Option`] on anything else.
pub fn parse_kind(kind: &str) -> Result<ServerKind, ReplayError> {
    serde_json::from_value(serde_json::Value::String(kind.to_owned())).map_err(|_| {
        ReplayError::Option {
            option: "kv_sample.kind",
            value: kind.to_owned(),
            reason: "want vllm, sglang, tgi, llamacpp, trtllm, llmd-sim or auto",
        }
    })
}

/// Stats of one exposition (and `/slots` body) as one sample at `t_s`; `None` when the
/// adapter finds no KV-usage signal or the text does not parse.
pub fn sample_from(
    name: &str,
    kind: ServerKind,
    t_s: f64,
    metrics: &str,
    slots: Option<&[u8]>,
) -> Option<KvSample> {
    let expo = Exposition::parse_with(metrics, is_relevant).ok()?;
    let stats = extract(kind, &expo, slots).ok()?;
    Some(KvSample {
        t_s,
        backend: name.to_owned(),
        kv_usage: stats.kv_usage?.clamp(0.0, 1.0),
        running: stats.running,
        waiting: stats.waiting,
    })
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn get(client: &HttpClient, url: &str) -> Option<Bytes> {
    let uri: hyper::Uri = url.parse().ok()?;
    let fut = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        Some(resp.into_body().collect().await.ok()?.to_bytes())
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, fut).await.ok()?
}

/// Samples `targets` every `interval` until `stop` fires, plus once more at the end.
/// Times are relative to `start`.
pub(crate) async fn sample_loop(
    targets: Vec<(KvSampleTarget, ServerKind)>,
    interval: Duration,
    start: Instant,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<KvSample> {
    let client: HttpClient =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new());
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let done = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.changed() => true,
        };
        let t_s = start.elapsed().as_secs_f64();
        for (target, kind) in &targets {
            let Some(metrics) = get(&client, &target.metrics_url).await else {
                continue;
            };
            let slots = match &target.slots_url {
                Some(u) => get(&client, u).await,
                None => None,
            };
            let text = String::from_utf8_lossy(&metrics);
            if let Some(s) = sample_from(&target.name, *kind, t_s, &text, slots.as_deref()) {
                out.push(s);
            }
        }
        if done || *stop.borrow() {
            return out;
        }
    }
}

/// Parse one `name=kind@metrics_url` target (the CLI's `--kv-sample` syntax). For
/// `llamacpp`, `slots_url` is the metrics URL with its last path segment replaced by
/// `slots` (llama-server serves both on one port).
///
/// Errors: [`ReplayError::Option`] for a missing `=` / `@`, an empty name or URL, or an
/// unknown kind.
pub fn parse_target(spec: &str) -> Result<KvSampleTarget, ReplayError> {
    let bad = |reason| ReplayError::Option {
        option: "kv_sample",
        value: spec.to_owned(),
        reason,
    };
    let (name, rest) = spec
        .split_once('=')
        .ok_or_else(|| bad("want name=kind@metrics_url"))?;
    let (kind, url) = rest
        .split_once('@')
        .ok_or_else(|| bad("want name=kind@metrics_url"))?;
    let (name, kind, url) = (name.trim(), kind.trim(), url.trim());
    if name.is_empty() || url.is_empty() {
        return Err(bad("empty name or URL"));
    }
    let k = parse_kind(kind)?;
    let slots_url = (k == ServerKind::Llamacpp).then(|| match url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/slots"),
        None => format!("{url}/slots"),
    });
    Ok(KvSampleTarget {
        name: name.to_owned(),
        metrics_url: url.to_owned(),
        kind: kind.to_owned(),
        slots_url,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        let t = parse_target("b0=llamacpp@http://127.0.0.1:8080/metrics").unwrap();
        assert_eq!(t.slots_url.as_deref(), Some("http://127.0.0.1:8080/slots"));
        assert_eq!(t.kind, "llamacpp");
        let v = parse_target("r1=vllm@http://[::1]:9/metrics").unwrap();
        assert_eq!((v.name.as_str(), v.slots_url), ("r1", None));
        assert!(parse_target("x=nope@http://a/metrics").is_err());
        assert!(parse_target("x@http://a").is_err());
        assert!(parse_target("=vllm@http://a").is_err());
    }
}
