//! The stack the fault-matrix tests break: kvroute-sim replicas (each in its own handle, so
//! one can be killed or restarted in place), real Envoy with the filter (endpoint mode with
//! override_host, or cluster mode) from the harness templates, and kvroute-cp scraping the
//! replicas and pushing to the filter's ingest listener. Everything on 127.0.0.1.
// Each test crate that includes this module uses part of it; the crates allow the
// test-only clippy lints (unwrap, expect, panic, indexing) at their root.
#![allow(dead_code)]

use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::kvroute::{envoy_config, FleetMode, TEST_TOKEN};
use kvroute_integration::harness::{http, Envoy};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetHandle, ReplicaConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The model every replica serves (a kvroute-core built-in profile).
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// How the filter hands its decision to Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `x-gateway-destination-endpoint` to an override_host cluster, with the route's retry
    /// policy moving to the next listed host.
    Endpoint,
    /// `x-kvroute-cluster`, one cluster per replica.
    Cluster,
}

/// Options of [`Stack::start`].
#[derive(Debug, Clone)]
pub struct StackOptions {
    pub replicas: usize,
    pub mode: Mode,
    /// kvroute-cp scrape interval, ms.
    pub scrape_ms: u64,
    /// Extra members of the route plugin config (JSON, no braces), e.g. `"debug_header":true`.
    pub plugin: String,
    /// Envoy worker threads.
    pub concurrency: u32,
    /// Virtual seconds per wall second of the replicas.
    pub time_scale: f64,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            replicas: 3,
            mode: Mode::Endpoint,
            scrape_ms: 200,
            plugin: String::new(),
            concurrency: 1,
            time_scale: 1.0,
        }
    }
}

/// Replicas + Envoy + kvroute-cp.
pub struct Stack {
    pub opts: StackOptions,
    replica: ReplicaConfig,
    /// One handle per replica; `None` while killed.
    pub sims: Vec<Option<FleetHandle>>,
    pub addrs: Vec<SocketAddr>,
    pub envoy: Envoy,
    pub cp: Option<ControlPlane>,
    pub port: u16,
    pub ingest_port: u16,
    cp_yaml: String,
    token_file: PathBuf,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.token_file);
    }
}

fn cp_yaml(
    addrs: &[SocketAddr],
    scrape_ms: u64,
    ingest_port: u16,
    token_file: &std::path::Path,
) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: {scrape_ms}\n  timeout_ms: 1000\n  jitter: 0\npush:\n  heartbeat_ms: 200\n  min_interval_ms: 10\n  token_file: {}\ntargets:\n  - name: envoy\n    url: http://127.0.0.1:{ingest_port}/kvroute/v1/snapshot\npools:\n  - name: pool\n    kind: vllm\n    models: [\"{MODEL}\"]\n    endpoints:\n",
        token_file.display()
    );
    for (i, a) in addrs.iter().enumerate() {
        y.push_str(&format!(
            "      - name: sim-{i}\n        address: {a}\n        cluster: c{i}\n"
        ));
    }
    y
}

impl Stack {
    pub async fn start(opts: StackOptions) -> Self {
        let replica = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, opts.time_scale, 1).unwrap();
        let mut sims = Vec::new();
        let mut addrs = Vec::new();
        for _ in 0..opts.replicas {
            let f = spawn_fleet(FleetConfig::local(replica.clone(), 1))
                .await
                .unwrap();
            addrs.push(f.addrs()[0]);
            sims.push(Some(f));
        }
        let strs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
        let mode = match opts.mode {
            Mode::Endpoint => FleetMode::OverrideHost,
            Mode::Cluster => FleetMode::Cluster,
        };
        let (envoy, [port, ingest_port]) =
            Envoy::start_on_free_ports(opts.concurrency, |[port, ingest_port]| {
                envoy_config(
                    mode,
                    &strs,
                    &opts.plugin,
                    port,
                    ingest_port,
                    4 * 1024 * 1024,
                )
            })
            .await
            .unwrap();
        let token_file = std::env::temp_dir().join(format!(
            "kvroute-rel-{}-{ingest_port}.token",
            std::process::id()
        ));
        std::fs::write(&token_file, TEST_TOKEN).unwrap();
        let cp_yaml = cp_yaml(&addrs, opts.scrape_ms, ingest_port, &token_file);
        let mut s = Self {
            opts,
            replica,
            sims,
            addrs,
            envoy,
            cp: None,
            port,
            ingest_port,
            cp_yaml,
            token_file,
        };
        s.start_cp().await;
        s.wait_healthy(s.addrs.len()).await;
        s
    }

    /// Start (or restart) kvroute-cp with the stack's config.
    pub async fn start_cp(&mut self) {
        let config = Config::from_yaml(&self.cp_yaml).unwrap();
        self.cp = Some(ControlPlane::start(config).await.unwrap());
    }

    /// Stop kvroute-cp (its tasks end; nothing is pushed any more).
    pub async fn kill_cp(&mut self) {
        if let Some(cp) = self.cp.take() {
            cp.shutdown().await;
        }
    }

    /// Kill replica `i`: its listener closes and its open connections drop.
    pub fn kill(&mut self, i: usize) {
        if let Some(f) = self.sims[i].take() {
            f.shutdown();
        }
    }

    /// Start replica `i` again on the same address (a fresh process: new start time, cold
    /// prefix cache).
    pub async fn restart(&mut self, i: usize) {
        self.kill(i);
        let a = self.addrs[i];
        let deadline = Instant::now() + Duration::from_secs(5);
        let f = loop {
            let cfg = FleetConfig {
                replica: self.replica.clone(),
                replicas: 1,
                bind: a.ip(),
                base_port: a.port(),
            };
            match spawn_fleet(cfg).await {
                Ok(f) => break f,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("rebinding {a}: {e}"),
            }
        };
        self.sims[i] = Some(f);
    }

    /// Wait (10 s) until kvroute-cp reports `n` healthy endpoints and the filter has
    /// published a snapshot.
    pub async fn wait_healthy(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let healthy = self.cp.as_ref().map_or(0, |cp| cp.hub().up_count());
            let published = self
                .envoy
                .stat("wasmcustom.kvroute.snapshots.published")
                .await
                .unwrap()
                .unwrap_or(0);
            if healthy == n && published > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "kvroute-cp sees {healthy}/{n} healthy, filter published {published}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Envoy counter or gauge `name` (0 when absent).
    pub async fn stat(&self, name: &str) -> u64 {
        self.envoy.stat(name).await.unwrap().unwrap_or(0)
    }

    /// POST `body` to `path` through Envoy.
    pub async fn post(&self, path: &str, body: &[u8]) -> anyhow::Result<http::Response> {
        http::request(
            "POST",
            &format!("http://127.0.0.1:{}{path}", self.port),
            &[("content-type", "application/json")],
            body,
        )
        .await
    }
}

/// A chat request of conversation `conv` (a long shared system prompt) with `output_tokens`.
pub fn chat(conv: u64, turn: u64, output_tokens: u32, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": format!("Conversation {conv}. {}", "Keep every answer short and exact. ".repeat(30))},
            {"role": "user", "content": format!("turn {turn}")},
        ],
        "stream": stream,
        "kvroute_sim": {"output_tokens": output_tokens},
    }))
    .unwrap()
}

/// `usage.prompt_tokens` of a non-streamed completion body.
pub fn prompt_tokens(r: &http::Response) -> Option<u64> {
    serde_json::from_slice::<serde_json::Value>(&r.body)
        .ok()?
        .get("usage")?
        .get("prompt_tokens")?
        .as_u64()
}
