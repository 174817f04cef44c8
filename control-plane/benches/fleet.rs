//! Fleet benchmark for kvroute-cp (not criterion: it measures a separate process).
//!
//! Run with `make bench-cp` (= `cargo bench -p kvroute-cp --bench fleet`, which builds the
//! `kvroute-cp` binary with the optimised bench profile; `KVROUTE_CP_BIN` overrides it). Two phases, each against a real `kvroute-cp` child process:
//!
//! 1. **Scale**: 1,000 fake vLLM endpoints served from this one process (one listener
//!    each, body = the real-shaped `vllm-v1-0.10-reconstructed.prom` fixture with moving
//!    values), scraped once a second, pushing to a fake ingest. CPU is read from
//!    `/proc/<pid>/stat` (utime + stime) over the window, RSS from `/proc/<pid>/status`
//!    (VmRSS at the end, VmHWM peak).
//! 2. **Latency**: 64 endpoints at the default 200 ms interval; for each snapshot the fake
//!    ingest receives, latency = receive time − the newest `scraped_at_ms` in it.
//!
//! Flags (env): `BENCH_ENDPOINTS` (1000), `BENCH_SECONDS` (20), `BENCH_LAT_ENDPOINTS` (64),
//! `BENCH_LAT_SECONDS` (10).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvroute_core::percentile::percentile;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fixture() -> String {
    let base = kvroute_core::shared_data::dir();
    std::fs::read_to_string(base.join("metrics/vllm-v1-0.10-reconstructed.prom")).unwrap()
}

fn cp_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_CP_BIN") {
        return PathBuf::from(p);
    }
    // Built by `cargo bench` with the bench profile (opt-level 3, release LTO).
    PathBuf::from(env!("CARGO_BIN_EXE_kvroute-cp"))
}

/// A body whose KV usage and queue depth move with every request.
fn body_for(template: &str, n: u64) -> String {
    let kv = (n * 37 % 100) as f64 / 100.0;
    template
        .replace(
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.4219",
            &format!("vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {kv}"),
        )
        .replace(
            "vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 24.0",
            &format!("vllm:num_requests_running{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {}.0", n % 32),
        )
}

async fn serve<F>(listener: tokio::net::TcpListener, f: Arc<F>)
where
    F: Fn(Bytes) -> (u16, Bytes) + Send + Sync + 'static,
{
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let f = f.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: http::Request<Incoming>| {
                let f = f.clone();
                async move {
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let (status, out) = f(body);
                    let mut r = http::Response::new(Full::new(out));
                    *r.status_mut() = http::StatusCode::from_u16(status).unwrap();
                    Ok::<_, Infallible>(r)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Start `n` fake endpoints; returns their addresses and a served-requests counter.
async fn fleet(n: usize, template: Arc<String>) -> (Vec<SocketAddr>, Arc<AtomicU64>) {
    let served = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    for i in 0..n {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(l.local_addr().unwrap());
        let t = template.clone();
        let s = served.clone();
        let counter = AtomicU64::new(i as u64);
        tokio::spawn(serve(
            l,
            Arc::new(move |_b: Bytes| {
                s.fetch_add(1, Ordering::Relaxed);
                let k = counter.fetch_add(1, Ordering::Relaxed);
                (200, Bytes::from(body_for(&t, k)))
            }),
        ));
    }
    (addrs, served)
}

struct Ingest {
    url: String,
    latencies_ms: Arc<Mutex<Vec<f64>>>,
    pushes: Arc<AtomicU64>,
}

async fn ingest() -> Ingest {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/kvroute/v1/snapshot", l.local_addr().unwrap());
    let latencies_ms = Arc::new(Mutex::new(Vec::new()));
    let pushes = Arc::new(AtomicU64::new(0));
    let (lat, p) = (latencies_ms.clone(), pushes.clone());
    tokio::spawn(serve(
        l,
        Arc::new(move |b: Bytes| {
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_micros() as f64
                / 1000.0;
            let snap = kvroute_core::snapshot::Snapshot::decode(&b).unwrap();
            p.fetch_add(1, Ordering::Relaxed);
            if let Some(newest) = snap.endpoints.iter().map(|e| e.scraped_at_ms).max() {
                if newest > 0 {
                    lat.lock().unwrap().push(now_ms - newest as f64);
                }
            }
            (204, Bytes::new())
        }),
    ));
    Ingest {
        url,
        latencies_ms,
        pushes,
    }
}

fn config(addrs: &[SocketAddr], ingest: &str, interval_ms: u64, listen: u16) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:{listen}\nscrape:\n  interval_ms: {interval_ms}\n  timeout_ms: 500\npush:\n  heartbeat_ms: 1000\ntargets:\n  - name: bench\n    url: {ingest}\npools:\n  - name: bench\n    kind: vllm\n    models: [m]\n    endpoints:\n"
    );
    for (i, a) in addrs.iter().enumerate() {
        y.push_str(&format!("      - name: e{i}\n        address: {a}\n"));
    }
    y
}

struct Guard(Child);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_cp(dir: &std::path::Path, yaml: &str) -> Guard {
    let cfg = dir.join("cp.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let bin = cp_bin();
    assert!(
        bin.exists(),
        "{} missing: run `make bench-cp` or set KVROUTE_CP_BIN",
        bin.display()
    );
    Guard(
        Command::new(bin)
            .arg("--config")
            .arg(&cfg)
            .arg("--no-watch")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the `(comm)`: state is field 3; utime 14, stime 15 (1-based).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn status_kb(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let template = Arc::new(fixture());
        let dir = tempfile::tempdir().unwrap();
        let n = env_or("BENCH_ENDPOINTS", 1000) as usize;
        let secs = env_or("BENCH_SECONDS", 20);

        // Phase 1: scale.
        let (addrs, served) = fleet(n, template.clone()).await;
        let sink = ingest().await;
        let cp = spawn_cp(dir.path(), &config(&addrs, &sink.url, 1000, free_port()));
        let pid = cp.0.id();
        tokio::time::sleep(Duration::from_secs(3)).await; // warm-up: connections, first round
        let (t0, c0, s0, p0) = (Instant::now(), cpu_ticks(pid), served.load(Ordering::Relaxed), sink.pushes.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let (el, c1, s1, p1) = (t0.elapsed().as_secs_f64(), cpu_ticks(pid), served.load(Ordering::Relaxed), sink.pushes.load(Ordering::Relaxed));
        let cpu = (c1 - c0) as f64 / clk_tck() / el * 100.0;
        let rss = status_kb(pid, "VmRSS:") as f64 / 1024.0;
        let hwm = status_kb(pid, "VmHWM:") as f64 / 1024.0;
        drop(cp);
        println!("kvroute-cp fleet benchmark (release binary {})", cp_bin().display());
        println!(
            "scale: {n} endpoints @ 1 s, body {} bytes, {el:.1} s window: {:.0} scrapes/s served, {:.1} pushes/s",
            template.len(),
            (s1 - s0) as f64 / el,
            (p1 - p0) as f64 / el
        );
        println!("scale: CPU {cpu:.1}% of one core (target < 10%), RSS {rss:.1} MiB, peak RSS {hwm:.1} MiB (target < 100 MB)");

        // Phase 2: latency.
        let m = env_or("BENCH_LAT_ENDPOINTS", 64) as usize;
        let lat_secs = env_or("BENCH_LAT_SECONDS", 10);
        let (addrs, _) = fleet(m, template.clone()).await;
        let sink = ingest().await;
        let cp = spawn_cp(dir.path(), &config(&addrs, &sink.url, 200, free_port()));
        tokio::time::sleep(Duration::from_secs(2)).await;
        sink.latencies_ms.lock().unwrap().clear();
        tokio::time::sleep(Duration::from_secs(lat_secs)).await;
        drop(cp);
        let mut lat = sink.latencies_ms.lock().unwrap().clone();
        lat.sort_by(|a, b| a.total_cmp(b));
        println!(
            "latency: {m} endpoints @ 200 ms, {} pushes: scrape-to-push p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (target p99 < 50 ms)",
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or(f64::NAN)
        );
    });
}
