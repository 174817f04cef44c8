//! The HTTP face of the simulator: OpenAI-compatible endpoints, `/metrics`, `/health`,
//! and a fleet of replicas in one process.
//!
//! Each replica owns an [`Engine`] behind a mutex and a driver task. The driver maps
//! virtual time to wall-clock time with the time-scale factor (`virtual = wall × scale`):
//! it computes a step, sleeps until the step's end in wall time, and only then hands out
//! the step's tokens (a token exists when its step ends), so a replica at scale 100
//! runs 100× faster than a GPU would. With an infinite scale it never sleeps: virtual time
//! then advances only by step durations, which is what tests use. Handlers submit requests
//! and receive the engine's events through per-request channels; a client that goes away
//! aborts its request (its KV blocks are freed), as in vLLM.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed and not),
//! `GET /v1/models`, `GET /health`, `GET /metrics`, and `GET /slots` in the llama.cpp dialect.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_core::analysis::ApiKind;
use kvroute_core::estimate::Estimator;
use kvroute_core::profile::ModelProfile;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};

use super::api::{self, ApiError, ParsedRequest, ResponseMeta};
use super::engine::{Engine, EngineConfig, EngineEvent, SimRequest};
use super::metrics::{self, Dialect, Metrics, ScrapeState};
use super::perf::{num_gpu_blocks, perf_profile_for, NoKvRoom, DEFAULT_GPU_MEMORY_UTILIZATION};

/// Response body type of every handler.
pub type Body = BoxBody<Bytes, Infallible>;

/// Configuration of one simulated replica.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// Model architecture and limits (kvroute-core profile).
    pub model: ModelProfile,
    /// Name served at `/v1/models` and required in requests (default: `model.name`).
    pub served_model_name: String,
    /// Engine parameters (KV blocks, batching, step time).
    pub engine: EngineConfig,
    /// Metric names to expose.
    pub dialect: Dialect,
    /// Virtual seconds per wall-clock second (1 = real time; `f64::INFINITY` = no waiting).
    pub time_scale: f64,
    /// Seed of the default output-length draw; replica *i* uses `seed + i`.
    pub seed: u64,
}

/// Why [`ReplicaConfig::builtin`] has no config.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BuiltinError {
    /// kvroute-core has no built-in profile of that name (or alias).
    #[error("no kvroute-core built-in model profile `{0}`")]
    Unknown(String),
    /// The model's weights leave no KV room on its GPUs.
    #[error(transparent)]
    NoKvRoom(#[from] NoKvRoom),
}

impl ReplicaConfig {
    /// [`Self::for_model`] of kvroute-core's built-in profile `name` (an alias works too,
    /// `kvroute_core::profile::builtin`).
    pub fn builtin(
        name: &str,
        dialect: Dialect,
        time_scale: f64,
        seed: u64,
    ) -> Result<Self, BuiltinError> {
        let model = kvroute_core::profile::builtin(name)
            .ok_or_else(|| BuiltinError::Unknown(name.to_owned()))?;
        Ok(Self::for_model(model, dialect, time_scale, seed)?)
    }

    /// A replica of `model` with vLLM's defaults: KV blocks from [`num_gpu_blocks`] on the
    /// model's [`perf_profile_for`] GPUs at `gpu_memory_utilization` 0.9, 8192 batched tokens,
    /// 1024 sequences, FCFS. Errors when the weights leave no KV room.
    pub fn for_model(
        model: ModelProfile,
        dialect: Dialect,
        time_scale: f64,
        seed: u64,
    ) -> Result<Self, NoKvRoom> {
        let perf = perf_profile_for(&model);
        let blocks = num_gpu_blocks(&perf.gpu, perf.gpus, DEFAULT_GPU_MEMORY_UTILIZATION, &model)?;
        Ok(Self {
            served_model_name: model.name.clone(),
            engine: EngineConfig {
                num_gpu_blocks: blocks,
                block_size: model.block_size.max(1),
                max_num_batched_tokens: 8192,
                max_num_seqs: 1024,
                priority_scheduling: false,
                step: perf.step,
            },
            model,
            dialect,
            time_scale,
            seed,
        })
    }
}

/// Configuration of a fleet of identical replicas.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Per-replica configuration.
    pub replica: ReplicaConfig,
    /// Number of replicas (each on its own port).
    pub replicas: usize,
    /// Address to bind (default 127.0.0.1).
    pub bind: IpAddr,
    /// First port; replica *i* binds `base_port + i`. 0 = ephemeral ports.
    pub base_port: u16,
}

impl FleetConfig {
    /// `replicas` replicas of `replica` on ephemeral 127.0.0.1 ports.
    pub fn local(replica: ReplicaConfig, replicas: usize) -> Self {
        Self {
            replica,
            replicas,
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 0,
        }
    }
}

/// Per-request state kept by the replica.
#[derive(Debug)]
struct Pending {
    tx: mpsc::UnboundedSender<EngineEvent>,
    arrival: f64,
    first_token: Option<f64>,
    finish_reason: &'static str,
}

#[derive(Debug)]
struct State {
    engine: Engine,
    metrics: Metrics,
    pending: HashMap<u64, Pending>,
    next_id: u64,
    rng: fastrand::Rng,
}

/// One simulated replica (shared between its driver task and its handlers).
#[derive(Debug)]
pub struct Replica {
    cfg: ReplicaConfig,
    state: Mutex<State>,
    wake: Notify,
    start: Instant,
    created_unix: u64,
    estimator: Estimator,
}

impl Replica {
    /// A replica with its own engine; `index` offsets the seed.
    pub fn new(cfg: ReplicaConfig, index: usize) -> Arc<Self> {
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let metrics = Metrics::new(
            cfg.dialect,
            &cfg.served_model_name,
            cfg.engine.num_gpu_blocks,
            cfg.engine.block_size,
            now_unix.as_secs_f64(),
        );
        Arc::new(Self {
            state: Mutex::new(State {
                engine: Engine::new(cfg.engine.clone()),
                metrics,
                pending: HashMap::new(),
                next_id: 0,
                rng: fastrand::Rng::with_seed(cfg.seed.wrapping_add(index as u64)),
            }),
            cfg,
            wake: Notify::new(),
            start: Instant::now(),
            created_unix: now_unix.as_secs(),
            // A tokenizer's stand-in: every byte counted, not the filter's sampled tail.
            estimator: Estimator::every_byte(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a handler panicked mid-update; the state is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn virtual_now(&self) -> Option<f64> {
        if self.cfg.time_scale.is_finite() && self.cfg.time_scale > 0.0 {
            Some(self.start.elapsed().as_secs_f64() * self.cfg.time_scale)
        } else {
            None
        }
    }

    /// Current `/metrics` body.
    pub fn render_metrics(&self) -> Result<String, std::fmt::Error> {
        let mut st = self.lock();
        let scrape = ScrapeState {
            running: st.engine.num_running() as u64,
            waiting: st.engine.num_waiting() as u64,
            kv_usage: st.engine.kv_usage(),
            used_tokens: st.engine.used_tokens(),
            counters: st.engine.counters(),
        };
        st.metrics.render(&scrape)
    }

    /// Run the engine until idle, then wait for work; returns when `stop` flips.
    async fn drive(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                return;
            }
            let stepped = {
                let mut st = self.lock();
                if let Some(v) = self.virtual_now() {
                    if st.engine.is_idle() {
                        st.engine.advance_to(v);
                    }
                }
                st.engine
                    .step()
                    .map(|report| (st.engine.now(), report.events))
            };
            let Some((vt, events)) = stepped else {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = stop.changed() => return,
                }
                continue;
            };
            // A step's tokens exist at its end: wait for that moment in wall time before
            // handing them out (handing them out first delivered every token, the first
            // included, one step early: an 8,000-token prefill step of the H100 profile is 0.37 s).
            if self.cfg.time_scale.is_finite() && self.cfg.time_scale > 0.0 {
                let at = self.start + Duration::from_secs_f64(vt / self.cfg.time_scale);
                if at > Instant::now() {
                    tokio::time::sleep_until(at.into()).await;
                } else {
                    tokio::task::yield_now().await;
                }
            } else {
                tokio::task::yield_now().await;
            }
            let mut st = self.lock();
            for ev in events {
                dispatch(&mut st, ev);
            }
        }
    }

    /// Submit a parsed request; returns its id and event receiver.
    fn submit(
        &self,
        req: &ParsedRequest,
    ) -> Result<(u64, f64, mpsc::UnboundedReceiver<EngineEvent>), ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.lock();
        if let Some(v) = self.virtual_now() {
            if st.engine.is_idle() {
                st.engine.advance_to(v);
            }
        }
        let id = st.next_id;
        st.next_id += 1;
        st.engine
            .submit(SimRequest {
                id,
                prompt_tokens: req.prompt_tokens,
                output_tokens: req.output_tokens,
                block_hashes: req.block_hashes.clone(),
                priority: req.priority,
            })
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        // A request that arrives while a step is in flight (the engine's clock is already at
        // that step's end) arrived at the current wall-mapped virtual time.
        let arrival = match self.virtual_now() {
            Some(v) => v.min(st.engine.now()),
            None => st.engine.now(),
        };
        st.pending.insert(
            id,
            Pending {
                tx,
                arrival,
                first_token: None,
                finish_reason: req.finish_reason.as_str(),
            },
        );
        drop(st);
        self.wake.notify_one();
        Ok((id, arrival, rx))
    }

    fn abort(&self, id: u64) {
        let mut st = self.lock();
        if st.engine.abort(id) {
            if let Some(p) = st.pending.remove(&id) {
                let now = st.engine.now();
                st.metrics.observe_finished(
                    p.first_token.map(|t| t - p.arrival),
                    now - p.arrival,
                    "abort",
                );
            }
        }
    }

    fn draw(&self) -> f64 {
        self.lock().rng.f64()
    }

    fn slots_json(&self) -> Value {
        let st = self.lock();
        let n_ctx = self.cfg.model.max_model_len;
        let mut slots: Vec<Value> = st
            .engine
            .running_ids()
            .iter()
            .filter_map(|id| st.engine.progress(*id).map(|p| (*id, p)))
            .enumerate()
            .map(|(i, (id, p))| {
                json!({
                    "id": i, "id_task": id, "n_ctx": n_ctx, "speculative": false,
                    "is_processing": true,
                    "n_prompt_tokens": p.prompt_tokens,
                    "n_prompt_tokens_processed": p.computed.min(p.prompt_tokens),
                    "next_token": [{"has_next_token": true, "has_new_line": false,
                                    "n_remain": p.output_tokens.saturating_sub(p.generated),
                                    "n_decoded": p.generated}],
                })
            })
            .collect();
        let busy = slots.len();
        let total = (self.cfg.engine.max_num_seqs as usize).max(busy);
        for i in busy..total {
            slots.push(
                json!({"id": i, "id_task": -1, "n_ctx": n_ctx, "speculative": false,
                              "is_processing": false, "n_prompt_tokens": 0,
                              "next_token": [{"has_next_token": false, "has_new_line": false,
                                              "n_remain": -1, "n_decoded": 0}]}),
            );
        }
        Value::Array(slots)
    }
}

/// Route an engine event to its request's handler and record latency metrics.
fn dispatch(st: &mut State, ev: EngineEvent) {
    let id = match ev {
        EngineEvent::Token { id, .. }
        | EngineEvent::Admitted { id, .. }
        | EngineEvent::Preempted { id, .. } => id,
    };
    let mut remove = false;
    if let Some(p) = st.pending.get_mut(&id) {
        if let EngineEvent::Token {
            time, index, last, ..
        } = ev
        {
            if index == 1 {
                p.first_token = Some(time);
            }
            if last {
                st.metrics.observe_finished(
                    p.first_token.map(|t| t - p.arrival),
                    time - p.arrival,
                    p.finish_reason,
                );
                remove = true;
            }
        }
        // A closed receiver means the handler is gone; its drop guard aborts the request.
        let _ = p.tx.send(ev);
    }
    if remove {
        st.pending.remove(&id);
    }
}

/// Aborts the request in the engine if the handler is dropped before it finishes.
struct AbortOnDrop {
    replica: Arc<Replica>,
    id: u64,
    done: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.done {
            self.replica.abort(self.id);
        }
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST),
        &e.body(),
    )
}

/// Wall-clock Unix seconds.
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Serve one HTTP request.
pub async fn handle(replica: Arc<Replica>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/health") => Response::new(Full::new(Bytes::new()).boxed()),
        (Method::GET, "/metrics") => match replica.render_metrics() {
            Ok(text) => {
                let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    http::HeaderValue::from_static(metrics::CONTENT_TYPE),
                );
                r
            }
            Err(_) => json_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                &json!({"detail": "metrics encoding failed"}),
            ),
        },
        (Method::GET, "/slots") if replica.cfg.dialect == Dialect::Llamacpp => {
            json_response(StatusCode::OK, &replica.slots_json())
        }
        (Method::GET, "/v1/models") => {
            let name = &replica.cfg.served_model_name;
            json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": [{
                    "id": name, "object": "model", "created": replica.created_unix,
                    "owned_by": "vllm", "root": name, "parent": null,
                    "max_model_len": replica.cfg.model.max_model_len, "permission": []}]}),
            )
        }
        (Method::POST, "/v1/chat/completions") => {
            generate(replica, ApiKind::ChatCompletions, req).await
        }
        (Method::POST, "/v1/completions") => generate(replica, ApiKind::Completions, req).await,
        (_, "/health" | "/metrics" | "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                &json!({"detail": "Method Not Allowed"}),
            )
        }
        _ => json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"})),
    }
}

async fn generate(replica: Arc<Replica>, api: ApiKind, req: Request<Incoming>) -> Response<Body> {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&ApiError::bad_request(format!("reading body: {e}"))),
    };
    let parsed = match api::parse_request(
        api,
        &body,
        &replica.cfg.served_model_name,
        &replica.cfg.model,
        &replica.estimator,
        || replica.draw(),
    ) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    let (id, arrival_time, mut rx) = match replica.submit(&parsed) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    #[allow(unused_mut)]
    let mut guard = AbortOnDrop {
        replica: replica.clone(),
        id,
        done: false,
    };
    let meta = ResponseMeta {
        id: format!(
            "{}-{:016x}",
            if api == ApiKind::Completions {
                "cmpl"
            } else {
                "chatcmpl"
            },
            id
        ),
        created: unix_now(),
        model: parsed.model.clone(),
        api,
    };
    if !parsed.stream {
        let mut cached = 0;
        let mut admitted = false;
        let mut first = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                EngineEvent::Admitted { cached_tokens, .. } => {
                    if !admitted {
                        cached = cached_tokens;
                        admitted = true;
                    }
                }
                EngineEvent::Token {
                    index, last, time, ..
                } => {
                    if index == 1 {
                        first = Some(time);
                    }
                    if last {
                        guard.done = true;
                        let timing = json!({
                            "arrival_time_s": arrival_time,
                            "first_token_time_s": first,
                            "finish_time_s": time,
                            "ttft_s": first.map(|f| f - arrival_time),
                            "e2e_s": time - arrival_time,
                        });
                        return json_response(
                            StatusCode::OK,
                            &api::full_response(&meta, &parsed, cached, timing),
                        );
                    }
                }
                EngineEvent::Preempted { .. } => {}
            }
        }
        return json_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"object": "error", "message": "request aborted", "type": "InternalServerError", "param": null, "code": 500}),
        );
    }
    let (tx, body) = crate::body::frame_channel(64);
    tokio::spawn(async move {
        // Own the whole guard (not just the field) so its Drop runs when this task ends.
        let mut guard = guard;
        let mut cached = 0;
        let mut admitted = false;
        if api == ApiKind::ChatCompletions {
            let first = api::sse_event(&api::stream_chunk(&meta, 0, None));
            if tx.send(Frame::data(Bytes::from(first))).await.is_err() {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            match ev {
                EngineEvent::Admitted { cached_tokens, .. } if !admitted => {
                    admitted = true;
                    cached = cached_tokens;
                }
                EngineEvent::Token { index, last, .. } => {
                    let finish = last.then_some(parsed.finish_reason);
                    let mut out = api::sse_event(&api::stream_chunk(&meta, index, finish));
                    if last {
                        guard.done = true;
                        if parsed.include_usage {
                            out.push_str(&api::sse_event(&api::usage_chunk(
                                &meta, &parsed, cached,
                            )));
                        }
                        out.push_str(api::SSE_DONE);
                    }
                    if tx.send(Frame::data(Bytes::from(out))).await.is_err() || last {
                        return; // client gone (guard aborts) or finished
                    }
                }
                _ => {}
            }
        }
        // The engine dropped the request (aborted): end the body without `[DONE]`.
    });
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

/// A running fleet. Dropping it stops every replica and closes its listener.
#[derive(Debug)]
pub struct FleetHandle {
    addrs: Vec<SocketAddr>,
    replicas: Vec<Arc<Replica>>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FleetHandle {
    /// Address of replica `i`.
    pub fn addr(&self, i: usize) -> Option<SocketAddr> {
        self.addrs.get(i).copied()
    }

    /// All replica addresses, in order.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Replica `i` (for in-process inspection, e.g. its engine counters via `/metrics`).
    pub fn replica(&self, i: usize) -> Option<&Arc<Replica>> {
        self.replicas.get(i)
    }

    /// Stop every replica now.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for FleetHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Errors starting a fleet.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// A port could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The port range overflows `u16`.
    #[error("port range {base}+{count} exceeds 65535")]
    PortRange {
        /// Base port.
        base: u16,
        /// Replicas.
        count: usize,
    },
}

/// Start `cfg.replicas` replicas on the current tokio runtime, each with its own listener,
/// engine and driver task. Returns once every listener is bound.
pub async fn spawn_fleet(cfg: FleetConfig) -> Result<FleetHandle, FleetError> {
    let (stop, stop_rx) = watch::channel(false);
    let mut addrs = Vec::with_capacity(cfg.replicas);
    let mut replicas = Vec::with_capacity(cfg.replicas);
    let mut tasks = Vec::new();
    for i in 0..cfg.replicas {
        let port = if cfg.base_port == 0 {
            0
        } else {
            u16::try_from(usize::from(cfg.base_port) + i).map_err(|_| FleetError::PortRange {
                base: cfg.base_port,
                count: cfg.replicas,
            })?
        };
        let addr = SocketAddr::new(cfg.bind, port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| FleetError::Bind { addr, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| FleetError::Bind { addr, source })?;
        let replica = Replica::new(cfg.replica.clone(), i);
        tasks.push(tokio::spawn(replica.clone().drive(stop_rx.clone())));
        tasks.push(tokio::spawn(accept_loop(
            listener,
            replica.clone(),
            stop_rx.clone(),
        )));
        addrs.push(bound);
        replicas.push(replica);
    }
    Ok(FleetHandle {
        addrs,
        replicas,
        stop,
        tasks,
    })
}

async fn accept_loop(
    listener: TcpListener,
    replica: Arc<Replica>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.changed() => return,
        };
        let Ok((stream, _)) = conn else {
            // Out of file descriptors (EMFILE), `accept` fails at once for as long as a
            // connection waits in the backlog: back off instead of spinning a core
            // (tests/sim_accept.rs).
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                _ = stop.changed() => return,
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let replica = replica.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let replica = replica.clone();
                async move { Ok::<_, Infallible>(handle(replica, req).await) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = stop.changed() => {}
            }
        });
    }
}
