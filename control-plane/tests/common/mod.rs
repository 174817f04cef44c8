//! Test doubles: a fake model server and a fake Envoy ingest, both hyper servers on
//! 127.0.0.1:0 that stop (connections included) when told or dropped.
// Each test crate that includes this module uses part of it; the crates allow the
// test-only clippy lints (unwrap, expect, panic, indexing) at their root.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub mod fake_kube;

/// What the fake model server answers on `/metrics`.
#[derive(Clone, Debug)]
pub enum Behavior {
    /// 200 with this body.
    Body(String),
    /// Never answers.
    Hang,
    /// This status, empty body.
    Status(u16),
}

pub type Handler =
    Arc<dyn Fn(http::Method, String, Bytes, Option<String>) -> (u16, Bytes) + Send + Sync>;

/// A stoppable hyper server.
pub struct Server {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
}

impl Server {
    pub async fn start_on(
        addr: SocketAddr,
        handler: Handler,
        hang: Arc<Mutex<bool>>,
        slots_delay: Arc<Mutex<Duration>>,
    ) -> Self {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stop_rx) = watch::channel(false);
        let mut accept_stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
                    _ = accept_stop.changed() => return,
                };
                let handler = handler.clone();
                let hang = hang.clone();
                let slots_delay = slots_delay.clone();
                let mut conn_stop = stop_rx.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<Incoming>| {
                        let handler = handler.clone();
                        let hang = hang.clone();
                        let slots_delay = slots_delay.clone();
                        async move {
                            let method = req.method().clone();
                            let path = req.uri().path().to_owned();
                            let auth = req
                                .headers()
                                .get(http::header::AUTHORIZATION)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            if *hang.lock().unwrap() && path == "/metrics" {
                                std::future::pending::<()>().await;
                            }
                            let delay = *slots_delay.lock().unwrap();
                            if path == "/slots" && !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                            let (status, body) = handler(method, path, body, auth);
                            let mut resp = http::Response::new(Full::new(body));
                            *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = conn_stop.changed() => {}
                    }
                });
            }
        });
        Self { addr, stop }
    }

    /// Stop accepting and drop every open connection.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One request the fake model server received: path and `Authorization` header.
pub type Seen = (String, Option<String>);

/// Fake model server.
pub struct FakeModelServer {
    pub server: Server,
    pub behavior: Arc<Mutex<Behavior>>,
    pub slots: Arc<Mutex<Option<String>>>,
    /// `/slots` answers after this long (a busy llama-server).
    pub slots_delay: Arc<Mutex<Duration>>,
    /// `Some(key)`: `/metrics` and `/slots` answer 401 unless the request carries
    /// `Authorization: Bearer <key>` (llama-server `--api-key`).
    pub api_key: Arc<Mutex<Option<String>>>,
    /// Every request received, in order.
    pub requests: Arc<Mutex<Vec<Seen>>>,
    hang: Arc<Mutex<bool>>,
}

impl FakeModelServer {
    pub async fn start(b: Behavior) -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap(), b).await
    }

    pub async fn start_on(addr: SocketAddr, b: Behavior) -> Self {
        let behavior = Arc::new(Mutex::new(b));
        let slots: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let hang = Arc::new(Mutex::new(false));
        let api_key: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let requests: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let (bh, sl, hg) = (behavior.clone(), slots.clone(), hang.clone());
        let (key, reqs) = (api_key.clone(), requests.clone());
        let handler: Handler = Arc::new(move |_m, path, _b, auth| {
            reqs.lock().unwrap().push((path.clone(), auth.clone()));
            if let Some(k) = key.lock().unwrap().as_deref() {
                if auth.as_deref() != Some(format!("Bearer {k}").as_str()) {
                    return (401, Bytes::from_static(b"{\"error\":\"Invalid API Key\"}"));
                }
            }
            if path == "/slots" {
                return match sl.lock().unwrap().clone() {
                    Some(s) => (200, Bytes::from(s)),
                    None => (404, Bytes::new()),
                };
            }
            match bh.lock().unwrap().clone() {
                Behavior::Body(s) => (200, Bytes::from(s)),
                Behavior::Status(c) => (c, Bytes::new()),
                Behavior::Hang => (200, Bytes::new()),
            }
        });
        let is_hang = matches!(*behavior.lock().unwrap(), Behavior::Hang);
        *hg.lock().unwrap() = is_hang;
        let slots_delay = Arc::new(Mutex::new(Duration::ZERO));
        let server = Server::start_on(addr, handler, hang.clone(), slots_delay.clone()).await;
        Self {
            server,
            behavior,
            slots,
            slots_delay,
            api_key,
            requests,
            hang,
        }
    }

    pub fn set(&self, b: Behavior) {
        *self.hang.lock().unwrap() = matches!(b, Behavior::Hang);
        *self.behavior.lock().unwrap() = b;
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }
}

/// One POST the fake ingest received.
#[derive(Clone, Debug)]
pub struct Received {
    pub at: Instant,
    pub auth: Option<String>,
    pub snapshot: kvroute_core::snapshot::Snapshot,
}

/// Fake Envoy ingest: records decoded snapshots, answers `status`.
pub struct FakeIngest {
    pub server: Server,
    pub received: Arc<Mutex<Vec<Received>>>,
    pub status: Arc<Mutex<u16>>,
}

impl FakeIngest {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    pub async fn start_on(addr: SocketAddr) -> Self {
        let received: Arc<Mutex<Vec<Received>>> = Arc::new(Mutex::new(Vec::new()));
        let status = Arc::new(Mutex::new(204u16));
        let (rc, st) = (received.clone(), status.clone());
        let handler: Handler = Arc::new(move |_m, _path, body, auth| {
            let code = *st.lock().unwrap();
            if code == 204 {
                let snapshot = kvroute_core::snapshot::Snapshot::decode(&body).unwrap();
                rc.lock().unwrap().push(Received {
                    at: Instant::now(),
                    auth,
                    snapshot,
                });
            }
            (code, Bytes::new())
        });
        let server = Server::start_on(
            addr,
            handler,
            Arc::new(Mutex::new(false)),
            Arc::new(Mutex::new(Duration::ZERO)),
        )
        .await;
        Self {
            server,
            received,
            status,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/kvroute/v1/snapshot", self.server.addr)
    }

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub fn last(&self) -> Option<Received> {
        self.received.lock().unwrap().last().cloned()
    }
}

/// GET a URL: (status, body).
pub async fn get(url: &str) -> (u16, String) {
    try_get(url)
        .await
        .unwrap_or_else(|| panic!("GET {url} failed"))
}

/// GET a URL; `None` when the connection fails.
pub async fn try_get(url: &str) -> Option<(u16, String)> {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let resp = client.get(url.parse().unwrap()).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// GET a URL with an `Accept` header: (status, content type, body).
pub async fn get_accept(url: &str, accept: Option<&str>) -> (u16, String, String) {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let mut req = http::Request::get(url);
    if let Some(a) = accept {
        req = req.header(http::header::ACCEPT, a);
    }
    let resp = client
        .request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, ct, String::from_utf8_lossy(&body).into_owned())
}

/// Poll `cond` every 10 ms until it holds or `within` passes; panics with `what` on timeout.
pub async fn wait_for<F: FnMut() -> bool>(within: Duration, what: &str, mut cond: F) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A vLLM V1 body.
pub fn vllm_body(
    kv: f64,
    running: u32,
    waiting: u32,
    start_s: Option<f64>,
    prompt_tokens: f64,
) -> String {
    let mut s = format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n\
         vllm:prompt_tokens_total{{engine=\"0\",model_name=\"m\"}} {prompt_tokens}\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"}} 1.0\n"
    );
    if let Some(t) = start_s {
        s.push_str(&format!("process_start_time_seconds {t}\n"));
    }
    s
}

/// A shared fixture, read in place.
pub fn fixture(name: &str) -> String {
    let base = std::env::var_os("KVROUTE_SHARED_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data")
        });
    std::fs::read_to_string(base.join("metrics").join(name)).unwrap()
}

/// A test config: fast intervals, given endpoints (name, addr) and ingest URLs.
pub fn config_yaml(
    endpoints: &[(&str, SocketAddr)],
    ingests: &[String],
    extra_push: &str,
) -> String {
    let mut y = String::from(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 150\n  jitter: 0.1\n",
    );
    y.push_str(&format!(
        "push:\n  heartbeat_ms: 100\n  min_interval_ms: 5\n  timeout_ms: 200\n  backoff_initial_ms: 10\n  backoff_max_ms: 50\n{extra_push}"
    ));
    y.push_str("targets:\n");
    if ingests.is_empty() {
        y.push_str("  []\n");
    }
    for (i, u) in ingests.iter().enumerate() {
        y.push_str(&format!("  - name: envoy-{i}\n    url: {u}\n"));
    }
    y.push_str("pools:\n  - name: p\n    kind: auto\n    models: [m]\n    endpoints:\n");
    for (n, a) in endpoints {
        y.push_str(&format!("      - name: {n}\n        address: {a}\n"));
    }
    y
}

/// Write `files` into `dir` as kubelet's atomic writer updates a Secret or projected volume:
/// the files in a new `..<timestamp>.<version>` directory, the `..data` symlink renamed onto
/// it, and each `dir/<name>` a symlink to `..data/<name>` (replacing a plain file). Readers
/// see all old or all new files, never a mix.
pub fn kubelet_write(dir: &std::path::Path, version: u32, files: &[(&str, &[u8])]) {
    use std::os::unix::fs::symlink;
    let ts = dir.join(format!("..2026_11_30_12_00_00.{version}"));
    std::fs::create_dir(&ts).unwrap();
    for (name, data) in files {
        std::fs::write(ts.join(name), data).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    symlink(&ts, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (name, _) in files {
        let link_tmp = dir.join(format!("{name}.tmp"));
        symlink(dir.join("..data").join(name), &link_tmp).unwrap();
        std::fs::rename(&link_tmp, dir.join(name)).unwrap();
    }
}
