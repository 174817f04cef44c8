//! The gateway in front of the backends: Envoy (child process) and, in kvroute mode,
//! kvroute-cp (in this process) pushing snapshots to the filter.

use super::ports::PortPlan;
use super::DemoError;
use kvroute_core::picker::PolicyKind;
use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::{free_port, render, templates, wasm_path, Envoy, PORT_ATTEMPTS};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Envoy config of kvroute mode (placeholders `LISTEN_PORT`, `INGEST_PORT`, `TIMEOUT_S`,
/// `WASM`, `PLUGIN_CONFIG`, `INGEST_CONFIG`, `CLUSTERS`, `ACCESS_LOG_PATH`).
pub const KVROUTE_TEMPLATE: &str = include_str!("templates/kvroute.yaml");
/// Envoy config of the round-robin baseline (placeholders `LISTEN_PORT`, `TIMEOUT_S`,
/// `CLUSTERS`).
pub const ROUND_ROBIN_TEMPLATE: &str = include_str!("templates/round_robin.yaml");
/// How long [`Gateway::start`] waits for the filter to publish its first snapshot.
pub const SNAPSHOT_DEADLINE: Duration = Duration::from_secs(30);
/// Filter stat: snapshots published to shared data (counter).
pub const STAT_PUBLISHED: &str = "wasmcustom.kvroute.snapshots.published";
/// Filter stat: decisions by the configured policy (counter).
pub const STAT_DECISIONS: &str = "wasmcustom.kvroute.decisions.policy";
/// Filter stat: internal errors that fell open to the default route (counter).
pub const STAT_FAIL_OPEN: &str = "wasmcustom.kvroute.fail_open";
/// Filter stat: age of the snapshot used by the last decision, milliseconds (gauge).
pub const STAT_SNAPSHOT_AGE_MS: &str = "wasmcustom.kvroute.snapshot_age_ms";
/// Envoy stat: requests that took the default route (cluster `all`), i.e. not routed by
/// the filter in kvroute mode.
pub const STAT_DEFAULT_ROUTE: &str = "cluster.all.upstream_rq_total";
/// Marker before the filter's decision record in each line of the decision log (the
/// access-log format of the template and of `examples/envoy/*.yaml`).
pub const DECISION_MARKER: &str = " kvroute=";
/// How long [`Gateway::decision_records`] waits for Envoy to write the last lines.
pub const DECISION_LOG_DEADLINE: Duration = Duration::from_secs(5);

/// One model server behind the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// kvroute-cp endpoint name (`sim-0`, `llama-1`, ...); its Envoy cluster is `c<i>`.
    pub name: String,
    /// Where it listens.
    pub address: SocketAddr,
    /// Its Prometheus endpoint.
    pub metrics_url: String,
    /// kvroute-cp adapter kind (`vllm`, `llamacpp`, ...).
    pub kind: String,
    /// llama.cpp `/slots` URL.
    pub slots_url: Option<String>,
}

impl Backend {
    /// The replay's KV sampling target for this backend, named by its address (the value
    /// of [`super::BACKEND_HEADER`]) so shares and KV peaks line up in the table.
    pub fn kv_target(&self) -> crate::replay::KvSampleTarget {
        crate::replay::KvSampleTarget {
            name: self.address.to_string(),
            metrics_url: self.metrics_url.clone(),
            kind: self.kind.clone(),
            slots_url: self.slots_url.clone(),
        }
    }
}

/// How Envoy routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// The kvroute filter with this picker policy, fed by kvroute-cp.
    Kvroute(PolicyKind),
    /// Envoy's own `ROUND_ROBIN` over all backends, no filter, no control plane.
    RoundRobin,
}

impl Routing {
    /// Label used in reports: `kvroute-<policy>` or `envoy-round-robin`.
    pub fn label(&self) -> String {
        match self {
            Routing::Kvroute(p) => format!("kvroute-{}", p.name()),
            Routing::RoundRobin => "envoy-round-robin".to_owned(),
        }
    }
}

/// Parse a picker policy name (`hybrid`, `prefix_affinity`, `least_kv`, `least_request`,
/// `round_robin`, `random`, `predicted_ttft`; `-` accepted for `_`).
pub fn parse_policy(name: &str) -> Result<PolicyKind, DemoError> {
    let norm = name.trim().replace('-', "_");
    serde_json::from_value::<PolicyKind>(serde_json::Value::String(norm)).map_err(|_| {
        DemoError::Option {
            option: "--policy",
            value: name.to_owned(),
            reason:
                "expected hybrid, prefix_affinity, least_kv, least_request, round_robin, random or predicted_ttft"
                    .into(),
        }
    })
}

/// Options of [`Gateway::start`].
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Routing mode.
    pub routing: Routing,
    /// Ports (`listen`/`ingest` 0: any free port; `cp` 0: OS-chosen).
    pub ports: PortPlan,
    /// Model name the backends serve (kvroute-cp pool `models`).
    pub model: String,
    /// Envoy route timeout, seconds.
    pub timeout_s: u64,
    /// Envoy `--concurrency` (worker threads).
    pub concurrency: u32,
    /// kvroute-cp scrape interval, milliseconds.
    pub scrape_interval_ms: u64,
    /// kvroute-cp heartbeat (push at least this often), milliseconds.
    pub heartbeat_ms: u64,
    /// kvroute mode: turn the filter's decision record on and have Envoy write one
    /// access-log line per request, with the record, to this file (replaced if it
    /// exists). `None`: the record is off, as in the filter's default config.
    pub decision_log: Option<PathBuf>,
}

impl GatewayOptions {
    /// Defaults: ports from `ports`, 600 s timeout, 2 Envoy workers, scrape every 100 ms,
    /// heartbeat 100 ms (so the filter's snapshot stays well under 1 s old even on a busy
    /// machine; the picker's `stale_after_ms` default is 2 s).
    pub fn new(routing: Routing, ports: PortPlan, model: &str) -> Self {
        Self {
            routing,
            ports,
            model: model.to_owned(),
            timeout_s: 600,
            concurrency: 2,
            scrape_interval_ms: 100,
            heartbeat_ms: 100,
            decision_log: None,
        }
    }
}

/// Envoy, and kvroute-cp in kvroute mode. Dropping it kills Envoy; [`Gateway::shutdown`]
/// also stops kvroute-cp's tasks.
pub struct Gateway {
    /// Envoy (killed on drop).
    pub envoy: Envoy,
    /// The control plane (kvroute mode only).
    pub cp: Option<ControlPlane>,
    /// Envoy's main listener port.
    pub listen_port: u16,
    /// The filter's ingest port (kvroute mode only).
    pub ingest_port: Option<u16>,
    /// Routing mode.
    pub routing: Routing,
    /// The decision log Envoy writes (kvroute mode with [`GatewayOptions::decision_log`]).
    pub decision_log: Option<PathBuf>,
    token_file: Option<PathBuf>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("envoy", &self.envoy)
            .field("cp", &self.cp.as_ref().map(|c| c.local_addr()))
            .field("listen_port", &self.listen_port)
            .field("ingest_port", &self.ingest_port)
            .field("routing", &self.routing)
            .field("decision_log", &self.decision_log)
            .finish()
    }
}

fn any_port(p: u16) -> Result<u16, DemoError> {
    if p != 0 {
        return Ok(p);
    }
    free_port().map_err(|e| DemoError::Io {
        path: PathBuf::from("127.0.0.1:0"),
        source: e,
    })
}

/// The lines of an access log in the order their requests started: by the leading
/// `[START_TIME]` of each (the demo's format; a line without one sorts first), a stable sort,
/// so lines of one millisecond keep the order Envoy wrote them in.
fn by_start(log: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = log.lines().collect();
    lines.sort_by_key(|l| {
        l.strip_prefix('[')
            .and_then(|r| r.split_once(']'))
            .map_or("", |(t, _)| t)
    });
    lines
}

/// Start Envoy on the config `yaml(listen, ingest)` renders. A port given as 0 is chosen
/// free ([`free_port`]) and chosen again, up to [`PORT_ATTEMPTS`] starts in all, when Envoy
/// exits because it is taken: between the choice and Envoy's bind another process, or
/// Envoy's own OS-chosen admin port, can take it. `ingest: None` (round robin) has no
/// ingest listener (`yaml` gets 0). A port given explicitly is never changed: taken, it
/// fails at once (the demo refuses taken explicit ports before it starts, `ports.rs`).
async fn start_envoy(
    listen: u16,
    ingest: Option<u16>,
    concurrency: u32,
    mut yaml: impl FnMut(u16, u16) -> Result<String, DemoError>,
) -> Result<(Envoy, u16, u16), DemoError> {
    let chosen = listen == 0 || ingest == Some(0);
    let mut attempt = 1;
    loop {
        let l = any_port(listen)?;
        let i = match ingest {
            Some(p) => any_port(p)?,
            None => 0,
        };
        match Envoy::start(&yaml(l, i)?, concurrency).await {
            Ok(envoy) => return Ok((envoy, l, i)),
            Err(e) if chosen && e.is_port_taken() && attempt < PORT_ATTEMPTS => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

fn token() -> String {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ u64::from(std::process::id()).rotate_left(32);
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..32).map(|_| rng.alphanumeric()).collect()
}

/// kvroute-cp's YAML for `backends`, pushing to `ingest_port` with the token in `token_file`.
pub fn cp_yaml(
    backends: &[Backend],
    opts: &GatewayOptions,
    ingest_port: u16,
    token_file: &std::path::Path,
) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:{cp}\nscrape:\n  interval_ms: {si}\n  timeout_ms: 1000\npush:\n  heartbeat_ms: {hb}\n  token_file: {tf}\ntargets:\n  - name: envoy\n    url: http://127.0.0.1:{ingest_port}/kvroute/v1/snapshot\npools:\n  - name: demo\n    models: [\"{model}\"]\n    endpoints:\n",
        cp = opts.ports.cp,
        si = opts.scrape_interval_ms,
        hb = opts.heartbeat_ms,
        tf = token_file.display(),
        model = opts.model,
    );
    for (i, b) in backends.iter().enumerate() {
        y.push_str(&format!(
            "      - name: {}\n        address: {}\n        cluster: c{i}\n        kind: {}\n        metrics_url: {}\n",
            b.name, b.address, b.kind, b.metrics_url
        ));
        if let Some(s) = &b.slots_url {
            y.push_str(&format!("        slots_url: {s}\n"));
        }
    }
    y
}

impl Gateway {
    /// Start kvroute-cp (kvroute mode) and Envoy in front of `backends`; in kvroute mode,
    /// wait (up to [`SNAPSHOT_DEADLINE`]) until the filter has published a snapshot in
    /// which every backend is healthy, so the first request is routed on real stats.
    pub async fn start(backends: &[Backend], opts: &GatewayOptions) -> Result<Self, DemoError> {
        let addrs: Vec<String> = backends.iter().map(|b| b.address.to_string()).collect();
        let all = templates::static_cluster("all", &addrs);
        let timeout = opts.timeout_s.to_string();
        match opts.routing {
            Routing::RoundRobin => {
                let (envoy, listen_port, _) =
                    start_envoy(opts.ports.listen, None, opts.concurrency, |listen, _| {
                        render(
                            ROUND_ROBIN_TEMPLATE,
                            &[
                                ("LISTEN_PORT", listen.to_string()),
                                ("TIMEOUT_S", timeout.clone()),
                                ("CLUSTERS", all.clone()),
                            ],
                        )
                        .map_err(|e| DemoError::Sim(e.to_string()))
                    })
                    .await?;
                Ok(Self {
                    envoy,
                    cp: None,
                    listen_port,
                    ingest_port: None,
                    routing: opts.routing,
                    decision_log: None,
                    token_file: None,
                })
            }
            Routing::Kvroute(policy) => {
                let token = token();
                let mut clusters = templates::per_endpoint_clusters(&addrs);
                clusters.push_str(&all);
                let route_cfg = serde_json::json!({
                    "mode": "cluster",
                    "picker": {"policy": policy.name()},
                    "decision_record": opts.decision_log.is_some(),
                })
                .to_string();
                let access_log = match &opts.decision_log {
                    Some(path) => {
                        // Envoy appends: start from an empty file, in a directory that exists.
                        let io = |source| DemoError::Io {
                            path: path.clone(),
                            source,
                        };
                        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                            std::fs::create_dir_all(dir).map_err(io)?;
                        }
                        std::fs::write(path, b"").map_err(io)?;
                        std::path::absolute(path).map_err(io)?.display().to_string()
                    }
                    None => "/dev/null".to_owned(),
                };
                let ingest_cfg =
                    serde_json::json!({"role": "ingest", "ingest_token": token}).to_string();
                let wasm = wasm_path();
                if !wasm.is_file() {
                    return Err(DemoError::NotReady(format!(
                        "no filter at {}: run `make wasm` or set KVROUTE_WASM",
                        wasm.display()
                    )));
                }
                // A JSON string is a YAML double-quoted scalar: any path.
                let access_log = serde_json::Value::String(access_log).to_string();
                let (envoy, listen_port, ingest_port) = start_envoy(
                    opts.ports.listen,
                    Some(opts.ports.ingest),
                    opts.concurrency,
                    |listen, ingest| {
                        render(
                            KVROUTE_TEMPLATE,
                            &[
                                ("LISTEN_PORT", listen.to_string()),
                                ("INGEST_PORT", ingest.to_string()),
                                ("TIMEOUT_S", timeout.clone()),
                                ("WASM", wasm.display().to_string()),
                                ("PLUGIN_CONFIG", route_cfg.clone()),
                                ("INGEST_CONFIG", ingest_cfg.clone()),
                                ("CLUSTERS", clusters.clone()),
                                ("ACCESS_LOG_PATH", access_log.clone()),
                            ],
                        )
                        .map_err(|e| DemoError::Sim(e.to_string()))
                    },
                )
                .await?;
                let token_file = std::env::temp_dir().join(format!(
                    "kvroute-demo-{}-{ingest_port}.token",
                    std::process::id()
                ));
                std::fs::write(&token_file, &token).map_err(|source| DemoError::Io {
                    path: token_file.clone(),
                    source,
                })?;
                let yaml = cp_yaml(backends, opts, ingest_port, &token_file);
                let config =
                    Config::from_yaml(&yaml).map_err(|e| DemoError::ControlPlane(e.to_string()))?;
                let cp = ControlPlane::start(config)
                    .await
                    .map_err(|e| DemoError::ControlPlane(e.to_string()))?;
                let mut gw = Self {
                    envoy,
                    cp: Some(cp),
                    listen_port,
                    ingest_port: Some(ingest_port),
                    routing: opts.routing,
                    decision_log: opts.decision_log.clone(),
                    token_file: Some(token_file),
                };
                gw.wait_first_snapshot(backends.len()).await?;
                Ok(gw)
            }
        }
    }

    /// A failed read of Envoy's stats is tried again until the deadline (the last failure
    /// is named then), unless Envoy has exited: that returns at once, with its log's tail.
    async fn wait_first_snapshot(&mut self, backends: usize) -> Result<(), DemoError> {
        let deadline = Instant::now() + SNAPSHOT_DEADLINE;
        loop {
            let (published, admin_error) = match self.envoy.stat(STAT_PUBLISHED).await {
                Ok(n) => (n.unwrap_or(0), None),
                Err(e) => match self.envoy.exit_error() {
                    Some(exited) => return Err(exited.into()),
                    None => (0, Some(e)),
                },
            };
            let healthy = self.cp.as_ref().map_or(0, |cp| cp.hub().up_count());
            if published > 0 && healthy == backends {
                return Ok(());
            }
            if Instant::now() > deadline {
                let admin =
                    admin_error.map_or(String::new(), |e| format!(" (last stats read: {e})"));
                return Err(DemoError::NotReady(format!(
                    "after {SNAPSHOT_DEADLINE:?}: filter published {published} snapshots, kvroute-cp sees {healthy}/{backends} backends healthy{admin}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `http://127.0.0.1:<listen>/v1/chat/completions`.
    pub fn chat_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1/chat/completions", self.listen_port)
    }

    /// The decision records Envoy wrote to the decision log, one per request in the order
    /// the requests started (Envoy writes a line when its request completes; the lines are
    /// sorted by their leading `[%START_TIME%]`, ISO 8601 UTC to the millisecond, so they
    /// sort as text, and lines of one millisecond keep their order: [`by_start`]), each
    /// the part of its line after [`DECISION_MARKER`] (`-` for a request the filter did not
    /// record). Envoy buffers access logs and writes them every 10 s, so
    /// this asks it to reopen its logs (`POST /reopen_logs`, which writes the buffer first)
    /// until `expected` lines are there or [`DECISION_LOG_DEADLINE`] has passed. Empty
    /// without a decision log.
    pub async fn decision_records(&self, expected: usize) -> Result<Vec<String>, DemoError> {
        let Some(path) = &self.decision_log else {
            return Ok(Vec::new());
        };
        let deadline = Instant::now() + DECISION_LOG_DEADLINE;
        loop {
            // A failed reopen only delays the lines to Envoy's next timed write.
            let _ = kvroute_integration::harness::http::request(
                "POST",
                &format!("http://{}/reopen_logs", self.envoy.admin()),
                &[],
                b"",
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let text = std::fs::read_to_string(path).map_err(|source| DemoError::Io {
                path: path.clone(),
                source,
            })?;
            let records: Vec<String> = by_start(&text)
                .into_iter()
                .map(|l| {
                    l.split_once(DECISION_MARKER)
                        .map_or("-", |(_, r)| r)
                        .to_owned()
                })
                .collect();
            if records.len() >= expected || Instant::now() > deadline {
                return Ok(records);
            }
        }
    }

    /// kvroute-cp's own address (kvroute mode).
    pub fn cp_addr(&self) -> Option<SocketAddr> {
        self.cp.as_ref().map(|c| c.local_addr())
    }

    /// Stop kvroute-cp (waits for its tasks) and Envoy.
    pub async fn shutdown(mut self) {
        if let Some(cp) = self.cp.take() {
            cp.shutdown().await;
        }
        if let Some(t) = self.token_file.take() {
            let _ = std::fs::remove_file(t);
        }
        // Envoy is killed when `self` drops here.
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(t) = self.token_file.take() {
            let _ = std::fs::remove_file(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template's access-log format puts the record right after [`DECISION_MARKER`],
    /// which [`Gateway::decision_records`] splits on.
    #[test]
    fn the_access_log_format_carries_the_decision_record_after_the_marker() {
        assert!(KVROUTE_TEMPLATE.contains(&format!(
            "{DECISION_MARKER}%FILTER_STATE(wasm.kvroute_decision:PLAIN)%\\n\""
        )));
        assert!(KVROUTE_TEMPLATE.contains("path: {{ACCESS_LOG_PATH}}"));
        assert!(KVROUTE_TEMPLATE.contains(r#"inline_string: "[%START_TIME%] "#));
    }

    /// Lines written as requests completed come back in the order they started; lines of
    /// one millisecond keep Envoy's order, and a line without a start time comes first.
    #[test]
    fn records_are_sorted_by_start_time() {
        let log = "[2026-12-04T05:10:35.900Z] \"POST /\" 200 5ms kvroute=c\n\
                   [2026-12-04T05:10:34.100Z] \"POST /\" 200 900ms kvroute=a\n\
                   [2026-12-04T05:10:35.900Z] \"POST /\" 200 1ms kvroute=d\n\
                   [2026-12-04T05:10:35.050Z] \"POST /\" 200 80ms kvroute=b\n\
                   garbage";
        let records: Vec<&str> = by_start(log)
            .into_iter()
            .map(|l| l.split_once(DECISION_MARKER).map_or("-", |(_, r)| r))
            .collect();
        assert_eq!(records, ["-", "a", "b", "c", "d"]);
    }
}
