//! `kvroute-sim-load`: throughput benchmark of the simulator server. Starts a fleet of
//! replicas in this process (or targets `--targets`), drives them with keep-alive HTTP/1.1
//! clients sending short chat requests, and prints completed requests per second.
//! Client and servers share the same cores, so the figure is a lower bound.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use kvroute_core::profile::builtin;
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, ReplicaConfig};

/// Short-request load against simulated replicas.
#[derive(Debug, Parser)]
struct Args {
    /// Replicas to start in-process (ignored with --targets).
    #[arg(long, default_value_t = 16)]
    replicas: usize,
    /// Existing replicas (host:port, comma-separated) instead of in-process ones.
    #[arg(long, value_delimiter = ',')]
    targets: Vec<SocketAddr>,
    /// Concurrent connections in total.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Measurement length in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Time scale of in-process replicas.
    #[arg(long, default_value_t = 1000.0)]
    time_scale: f64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
}

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn client(
    addr: SocketAddr,
    body: Bytes,
    until: Instant,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    while Instant::now() < until {
        let req = http::Request::post("/v1/chat/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let resp = send.send_request(req).await?;
        let status = resp.status();
        resp.into_body().collect().await?;
        if status.is_success() {
            ok.fetch_add(1, Ordering::Relaxed);
        } else {
            failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut _fleet = None;
    let targets = if a.targets.is_empty() {
        let model = builtin(MODEL).ok_or_else(|| anyhow!("no built-in profile {MODEL}"))?;
        let cfg = ReplicaConfig::for_model(model, Dialect::VllmV1, a.time_scale, 0)
            .context("KV sizing")?;
        let f = spawn_fleet(FleetConfig::local(cfg, a.replicas.max(1))).await?;
        let addrs = f.addrs().to_vec();
        _fleet = Some(f);
        addrs
    } else {
        a.targets.clone()
    };
    let body = Bytes::from(
        serde_json::json!({"model": MODEL, "max_tokens": a.max_tokens,
            "messages": [{"role": "user", "content": "Say hello in one short sentence."}]})
        .to_string(),
    );
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let until = start + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for i in 0..a.connections.max(1) {
        let Some(addr) = targets.get(i % targets.len().max(1)).copied() else {
            break;
        };
        tasks.push(tokio::spawn(client(
            addr,
            body.clone(),
            until,
            ok.clone(),
            failed.clone(),
        )));
    }
    let mut errors = 0;
    for t in tasks {
        if !matches!(t.await, Ok(Ok(()))) {
            errors += 1;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let n = ok.load(Ordering::Relaxed);
    println!(
        "kvroute-sim-load: {} replicas, {} connections, {n} ok, {} non-2xx, {errors} connection errors in {wall:.2} s = {:.0} req/s",
        targets.len(),
        a.connections,
        failed.load(Ordering::Relaxed),
        n as f64 / wall
    );
    Ok(())
}
