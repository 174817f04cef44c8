//! kvroute-specific helpers on top of the generic harness: a [`Fleet`] of recording
//! backends behind real Envoy running the filter, snapshot building and ingest, and stat
//! polling with deadlines.

use super::http::{self, Response};
use super::{render, templates, wasm_path, Envoy, RecordingBackend, Reply};
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Ingest token used by the test fleets (≥ 16 characters, as the filter requires).
pub const TEST_TOKEN: &str = "test-token-0123456789";

/// Now, Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How the fleet routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetMode {
    /// One Envoy cluster per backend (`c0`, `c1`, ...), plus `default` over all of them.
    Cluster,
    /// One STATIC cluster `pool` with the override-host load balancer.
    OverrideHost,
    /// One ORIGINAL_DST cluster `pool` reading the endpoint header.
    OriginalDst,
}

/// The ingest token written in the shipped example configs (`examples/envoy/`).
pub const EXAMPLE_TOKEN: &str = "change-me-to-a-long-random-secret";

/// Where the shipped Wasm example configs load the module from; [`example_config`] puts the
/// built one ([`wasm_path`]) there.
pub const EXAMPLE_WASM: &str = "/etc/envoy/kvroute_filter.wasm";

/// `examples/envoy/<name>` (`name` relative to that folder) as the tests run it: its client
/// listener on `127.0.0.1:listen`, its ingest listener on port `ingest`, its admin on a free
/// port, its `.wasm` path ([`wasm_path`]) where it names one, and its model servers
/// `127.0.0.1:8001`, `:8002`, … replaced by `backends` (`host:port`) in order.
///
/// Errors: the file cannot be read, or no longer contains a string replaced here (the
/// example changed under the test).
pub fn example_config(
    name: &str,
    listen: u16,
    ingest: u16,
    backends: &[String],
) -> anyhow::Result<String> {
    let path = super::workspace_root()
        .join("examples")
        .join("envoy")
        .join(name);
    let mut y =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut swaps = vec![
        (
            "port_value: 10000".to_owned(),
            format!("port_value: {listen}"),
        ),
        (
            "port_value: 10001".to_owned(),
            format!("port_value: {ingest}"),
        ),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        (
            "address: 0.0.0.0".to_owned(),
            "address: 127.0.0.1".to_owned(),
        ),
    ];
    if y.contains(EXAMPLE_WASM) {
        swaps.push((EXAMPLE_WASM.to_owned(), wasm_path().display().to_string()));
    }
    for (i, b) in backends.iter().enumerate() {
        let (host, port) = b
            .rsplit_once(':')
            .ok_or_else(|| anyhow::anyhow!("backend `{b}` is not host:port"))?;
        swaps.push((
            format!(
                "{{socket_address: {{address: \"127.0.0.1\", port_value: {}}}}}",
                8001 + i
            ),
            format!("{{socket_address: {{address: \"{host}\", port_value: {port}}}}}"),
        ));
    }
    for (from, to) in swaps {
        anyhow::ensure!(y.contains(&from), "{name} no longer contains `{from}`");
        y = y.replace(&from, &to);
    }
    Ok(y)
}

/// Push `snap` to the ingest listener (port `ingest`) of an [`example_config`], with the
/// examples' token. Errors: the push failed, or was answered other than 204.
pub async fn push_to_example(ingest: u16, snap: &Snapshot) -> anyhow::Result<()> {
    let r = http::request(
        "POST",
        &format!("http://127.0.0.1:{ingest}/kvroute/v1/snapshot"),
        &[("authorization", &format!("Bearer {EXAMPLE_TOKEN}"))],
        &snap.encode(),
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

/// The decision record in the access log line of the first chat completion `envoy`
/// answered 200, as the examples' log format writes it (`… kvroute=<record>`): Envoy
/// flushes access logs on a timer, so this polls, for up to 20 s. Errors: no such line by
/// then, or one without a record.
pub async fn logged_decision(envoy: &Envoy) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = envoy.log();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("\"POST /v1/chat/completions\" 200"))
        {
            return l
                .split_once(" kvroute=")
                .map(|(_, r)| r.to_owned())
                .ok_or_else(|| anyhow::anyhow!("no decision record: {l}"));
        }
        anyhow::ensure!(Instant::now() < deadline, "no access log line:\n{log}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Envoy's config for the filter in front of `addrs` (`host:port`, endpoint `i` is
/// `addrs[i]`): main listener on `port`, ingest listener on `ingest_port` (token
/// [`TEST_TOKEN`]), `per_connection_buffer_limit_bytes` `buffer_limit`, and the route
/// plugin config `{"mode": …, <route_config>}` (`route_config`: JSON object members without
/// braces, may be empty). Cluster mode has clusters `c0`, `c1`, ... and `default` over all
/// of them; the endpoint modes one cluster `pool`. Errors: a template placeholder left
/// without a value.
pub fn envoy_config(
    mode: FleetMode,
    addrs: &[String],
    route_config: &str,
    port: u16,
    ingest_port: u16,
    buffer_limit: usize,
) -> anyhow::Result<String> {
    let wasm = wasm_path();
    envoy_config_with(
        templates::FilterModule::Wasm(&wasm),
        mode,
        addrs,
        route_config,
        port,
        ingest_port,
        buffer_limit,
    )
}

/// [`envoy_config`] with kvroute from `module`: the Wasm build or the native dynamic
/// module ([`templates::DYNMOD`]).
pub fn envoy_config_with(
    module: templates::FilterModule<'_>,
    mode: FleetMode,
    addrs: &[String],
    route_config: &str,
    port: u16,
    ingest_port: u16,
    buffer_limit: usize,
) -> anyhow::Result<String> {
    let sep = if route_config.is_empty() { "" } else { "," };
    let name = match mode {
        FleetMode::Cluster => "cluster",
        FleetMode::OverrideHost | FleetMode::OriginalDst => "endpoint",
    };
    let mut vars = vec![
        ("LISTEN_PORT", port.to_string()),
        ("INGEST_PORT", ingest_port.to_string()),
        ("BUFFER_LIMIT", buffer_limit.to_string()),
    ];
    vars.extend(templates::kvroute_filters(
        module,
        &format!(r#"{{"mode":"{name}"{sep}{route_config}}}"#),
        &ingest_plugin_config(),
    ));
    let template = match mode {
        FleetMode::Cluster => {
            let mut clusters = templates::per_endpoint_clusters(addrs);
            clusters.push_str(&templates::static_cluster("default", addrs));
            vars.push(("CLUSTER_HEADER", "x-kvroute-cluster".into()));
            vars.push(("DEFAULT_CLUSTER", "default".into()));
            vars.push(("CLUSTERS", clusters));
            templates::CLUSTER_MODE
        }
        FleetMode::OverrideHost | FleetMode::OriginalDst => {
            let header = kvroute_core::plugin_config::ENDPOINT_HEADER;
            let clusters = if mode == FleetMode::OverrideHost {
                templates::override_host_cluster(header, addrs)
            } else {
                templates::original_dst_cluster(header)
            };
            vars.push(("POOL_TYPE", format!("{mode:?}")));
            vars.push(("CLUSTERS", clusters));
            templates::ENDPOINT_MODE
        }
    };
    render(template, &vars)
}

/// Backends + Envoy with the filter.
#[derive(Debug)]
pub struct Fleet {
    /// The backends, in endpoint order (`pool/e0`, `pool/e1`, ...).
    pub backends: Vec<RecordingBackend>,
    /// Envoy.
    pub envoy: Envoy,
    /// Main listener port.
    pub port: u16,
    /// Ingest listener port.
    pub ingest_port: u16,
    /// Prefix of the filter's stats: `wasmcustom.`, or
    /// [`templates::DYNMOD_STAT_PREFIX`] for the dynamic module.
    pub stat_prefix: &'static str,
}

/// Options for [`Fleet::start`].
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Number of backends.
    pub backends: usize,
    /// Routing mode.
    pub mode: FleetMode,
    /// Extra plugin config fields for the route role, as JSON object members without braces
    /// (e.g. `"picker":{"policy":"least_kv"}`).
    pub route_config: String,
    /// Envoy `--concurrency`.
    pub concurrency: u32,
    /// Reply of every backend.
    pub reply: Reply,
    /// `per_connection_buffer_limit_bytes`.
    pub buffer_limit: usize,
    /// Bind address of the backends (`127.0.0.1:0`, or `[::1]:0` for IPv6).
    pub backend_bind: &'static str,
    /// Run the native dynamic module (`make dynmod`) instead of the `.wasm`
    /// ([`templates::DYNMOD`]; Envoy needs `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`).
    pub dynmod: bool,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            backends: 2,
            mode: FleetMode::Cluster,
            route_config: String::new(),
            concurrency: 1,
            reply: Reply::default(),
            buffer_limit: 4 * 1024 * 1024,
            backend_bind: "127.0.0.1:0",
            dynmod: false,
        }
    }
}

impl FleetOptions {
    /// Two backends and the `least_kv` policy with snapshots fresh for a minute: with
    /// [`Fleet::push_usages`] a test decides which endpoint a body-routed request must
    /// reach (the one with the lower KV usage), whatever the test machine's speed.
    pub fn least_kv() -> Self {
        Self {
            route_config: r#""picker":{"policy":"least_kv","stale_after_ms":60000}"#.into(),
            ..Self::default()
        }
    }
}

/// The ingest role's plugin config used by the fleets.
pub fn ingest_plugin_config() -> String {
    format!(r#"{{"role":"ingest","ingest_token":"{TEST_TOKEN}"}}"#)
}

impl Fleet {
    /// Start backends and Envoy.
    pub async fn start(opts: FleetOptions) -> anyhow::Result<Self> {
        let mut backends = Vec::new();
        for i in 0..opts.backends {
            backends.push(
                RecordingBackend::start_on(opts.backend_bind, &format!("b{i}"), opts.reply.clone())
                    .await?,
            );
        }
        let addrs: Vec<String> = backends.iter().map(|b| b.address()).collect();
        let wasm = wasm_path();
        let module = if opts.dynmod {
            templates::DYNMOD
        } else {
            templates::FilterModule::Wasm(&wasm)
        };
        let (envoy, [port, ingest_port]) =
            Envoy::start_on_free_ports(opts.concurrency, |[port, ingest_port]| {
                envoy_config_with(
                    module,
                    opts.mode,
                    &addrs,
                    &opts.route_config,
                    port,
                    ingest_port,
                    opts.buffer_limit,
                )
            })
            .await?;
        Ok(Self {
            backends,
            envoy,
            port,
            ingest_port,
            stat_prefix: if opts.dynmod {
                templates::DYNMOD_STAT_PREFIX
            } else {
                "wasmcustom."
            },
        })
    }

    /// `http://127.0.0.1:<port><path>` on the main listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// POST a JSON body on the main listener.
    pub async fn post(&self, path: &str, body: &[u8]) -> anyhow::Result<Response> {
        http::request(
            "POST",
            &self.url(path),
            &[("content-type", "application/json")],
            body,
        )
        .await
    }

    /// POST a JSON `body` to `path` in a task, and wait until the filter has parked
    /// `parked` requests in all (`kvroute.outcome.queued`: admission on, no headroom): the
    /// task answers when this one leaves the queue.
    ///
    /// Errors: the stat never reaches `parked` (see [`Fleet::wait_stat_at_least`]).
    pub async fn post_parked(
        &self,
        path: &str,
        body: Vec<u8>,
        parked: u64,
    ) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<Response>>> {
        let url = self.url(path);
        let task = tokio::spawn(async move {
            http::request("POST", &url, &[("content-type", "application/json")], &body).await
        });
        let queued = format!("{}kvroute.outcome.queued", self.stat_prefix);
        self.wait_stat_at_least(&[queued.as_str()], parked).await?;
        Ok(task)
    }

    /// Endpoint stats for backend `i` (all healthy, fresh, serving model `m`).
    pub fn endpoint(&self, i: usize, kv_usage: f64, scraped_at_ms: u64) -> EndpointStats {
        let addr = self
            .backends
            .get(i)
            .map(|b| b.address())
            .unwrap_or_default();
        EndpointStats {
            address: addr,
            kv_usage: Some(kv_usage),
            kv_capacity_tokens: Some(1_000_000),
            ..EndpointStats::fixture(i, scraped_at_ms)
        }
    }

    /// POST `snap` to the ingest listener with `token` (`None`: no Authorization header).
    pub async fn ingest(&self, snap: &[u8], token: Option<&str>) -> anyhow::Result<Response> {
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(a) = &auth {
            headers.push(("authorization", a.as_str()));
        }
        http::request(
            "POST",
            &format!("http://127.0.0.1:{}/kvroute/v1/snapshot", self.ingest_port),
            &headers,
            snap,
        )
        .await
    }

    /// Push snapshot `version`, scraped now, in which backend `i` reports KV usage
    /// `usages[i]` (the common case of the end-to-end tests).
    pub async fn push_usages(&self, version: u64, usages: &[f64]) -> anyhow::Result<()> {
        let now = now_ms();
        let eps = usages
            .iter()
            .enumerate()
            .map(|(i, &u)| self.endpoint(i, u, now))
            .collect();
        self.push(&Snapshot::new(version, now, eps)).await
    }

    /// Ingest `snap` with the right token and wait until the consumer has handled it
    /// (published or ignored counter grew).
    pub async fn push(&self, snap: &Snapshot) -> anyhow::Result<()> {
        let before = self.handled().await?;
        let r = match self.ingest(&snap.encode(), Some(TEST_TOKEN)).await {
            Ok(r) => r,
            Err(e) => anyhow::bail!("{e}\n--- envoy log ---\n{}", self.log_tail(60)),
        };
        anyhow::ensure!(
            r.status == 204,
            "ingest answered {}: {}",
            r.status,
            r.text()
        );
        let published = format!("{}kvroute.snapshots.published", self.stat_prefix);
        let ignored = format!("{}kvroute.snapshots.ignored_old", self.stat_prefix);
        self.wait_stat_at_least(&[published.as_str(), ignored.as_str()], before + 1)
            .await
    }

    async fn handled(&self) -> anyhow::Result<u64> {
        let s = self.envoy.stats().await?;
        let get = |n: &str| {
            s.get(&format!("{}{n}", self.stat_prefix))
                .copied()
                .unwrap_or(0)
        };
        Ok(get("kvroute.snapshots.published") + get("kvroute.snapshots.ignored_old"))
    }

    /// Wait (deadline 10 s) until the sum of `names` reaches `want`.
    pub async fn wait_stat_at_least(&self, names: &[&str], want: u64) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.envoy.stats().await?;
            let got: u64 = names.iter().map(|n| s.get(*n).copied().unwrap_or(0)).sum();
            if got >= want {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("stats {names:?} = {got}, wanted ≥ {want} within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait (up to 10 s) until every reservation made was released (or expired by
    /// `reservation_ttl_ms`) and none is held, and return the reservations made; an error names the counts when they never agree.
    pub async fn settled_reservations(&self) -> anyhow::Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let reserved = self.custom("kvroute.reservations.reserved").await?;
            let released = self.custom("kvroute.reservations.released").await?;
            let expired = self.custom("kvroute.reservations.expired").await?;
            let held = self.custom("kvroute.inflight").await?;
            if reserved == released + expired && held == 0 {
                return Ok(reserved);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "leak: reserved {reserved}, released {released}, expired {expired}, held {held}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One of the filter's stats ([`Fleet::stat_prefix`]; 0 when absent).
    pub async fn custom(&self, name: &str) -> anyhow::Result<u64> {
        Ok(self
            .envoy
            .stat(&format!("{}{name}", self.stat_prefix))
            .await?
            .unwrap_or(0))
    }

    /// The last `n` lines of Envoy's log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.envoy.log();
        let lines: Vec<&str> = log.lines().collect();
        lines
            .get(lines.len().saturating_sub(n)..)
            .unwrap_or(&[])
            .join("\n")
    }

    /// Requests each backend received.
    pub fn counts(&self) -> Vec<usize> {
        self.backends.iter().map(|b| b.count()).collect()
    }
}

/// A chat completion body for model `m` with `text` as the user message.
pub fn chat(text: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16
    })
    .to_string()
    .into_bytes()
}

/// A `/metrics` server on 127.0.0.1 (OS-chosen port) answering a vLLM V1 exposition of one
/// idle engine with 10,000 blocks of 16 tokens whose `vllm:kv_cache_usage_perc` is the
/// current value of `kv` (0..1): a model server whose KV load a test moves. It serves until
/// the test's runtime ends.
pub async fn vllm_metrics_server(
    kv: std::sync::Arc<std::sync::Mutex<f64>>,
) -> anyhow::Result<std::net::SocketAddr> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let kv = kv.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |_req: ::http::Request<hyper::body::Incoming>| {
                        let v = *kv.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        let body = format!(
                            "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {v}\n\
                             vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10000\"}} 1.0\n"
                        );
                        async move {
                            Ok::<_, std::convert::Infallible>(::http::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from(body)),
                            ))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// The backend (`x-backend` of a [`super::RecordingBackend`]) that served a chat request
/// sent to Envoy's main listener on `port`. Errors: the request failed or was not 200.
pub async fn routed_to(port: u16) -> anyhow::Result<String> {
    let r = http::request(
        "POST",
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
        &[("content-type", "application/json")],
        &chat("route me by KV"),
    )
    .await?;
    anyhow::ensure!(r.status == 200, "HTTP {}: {}", r.status, r.text());
    Ok(r.header("x-backend").unwrap_or("").to_owned())
}

/// Wait (deadline 20 s) until 5 requests in a row to `envoy`'s main listener `port` go to
/// backend `want`: every Envoy worker has consumed a snapshot that makes `want` the choice.
/// Errors: the deadline passed (with Envoy's log tail) or a request failed.
pub async fn wait_routed(envoy: &Envoy, port: u16, want: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut in_a_row = 0;
    while in_a_row < 5 {
        let got = routed_to(port).await?;
        if got == want {
            in_a_row += 1;
            continue;
        }
        in_a_row = 0;
        if Instant::now() > deadline {
            let log = envoy.log();
            let lines: Vec<&str> = log.lines().collect();
            anyhow::bail!(
                "still routed to {got}, want {want}\n{}",
                lines
                    .get(lines.len().saturating_sub(30)..)
                    .unwrap_or(&[])
                    .join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
