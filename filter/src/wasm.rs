//! proxy-wasm glue: the real [`Host`] over the SDK's host calls, and the root and HTTP
//! contexts that delegate to [`crate::stream::Stream`] and [`crate::router::Worker`] (role
//! `route`) or to [`crate::ingest::IngestStream`] and [`crate::ingest::consume_snapshots`]
//! (role `ingest`).
//! Compiled for `wasm32` only; everything it calls is unit-tested natively with the mock.

use crate::abi::{self, Failed};
use crate::host::{HeaderMap, Host, HostError, Level, MetricKind};
use crate::ingest::{consume_snapshots, IngestStream};
use crate::names::metric;
use crate::router::Worker;
use crate::stream::{Flow, Stream};
use kvroute_core::plugin_config::{Config, Role};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

thread_local! {
    static METRICS: RefCell<BTreeMap<&'static str, u32>> = const { RefCell::new(BTreeMap::new()) };
    static NAMED_GAUGES: RefCell<BTreeMap<String, u32>> = const { RefCell::new(BTreeMap::new()) };
}

/// The real host: stateless wrappers over the host calls of [`abi`] (not the SDK's
/// `proxy_wasm::hostcalls`, which panic on statuses they do not expect).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProxyHost;

fn status(e: Failed) -> HostError {
    if e.0 == abi::CAS_MISMATCH {
        HostError::CasMismatch
    } else {
        HostError::Other(e.to_string())
    }
}

/// Request headers, as the ABI numbers maps.
const REQUEST_HEADERS: u32 = MapType::HttpRequestHeaders as u32;
/// Response headers, as the ABI numbers maps.
const RESPONSE_HEADERS: u32 = MapType::HttpResponseHeaders as u32;

fn metric_id(kind: MetricKind, name: &'static str) -> Option<u32> {
    METRICS.with(|m| {
        if let Some(id) = m.borrow().get(name) {
            return Some(*id);
        }
        let t = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        let id = abi::define_metric(t as u32, name).ok()?;
        m.borrow_mut().insert(name, id);
        Some(id)
    })
}

/// Header `name` of `map` as text; `None` when absent, not UTF-8, or not readable now.
fn header_text(map: u32, name: &str) -> Option<String> {
    String::from_utf8(abi::header_map_value(map, name)?).ok()
}

impl Host for ProxyHost {
    fn now_ms(&self) -> u64 {
        abi::now_ns().map_or(0, |ns| ns / 1_000_000)
    }
    fn now_us(&self) -> u64 {
        abi::now_ns().map_or(0, |ns| ns / 1_000)
    }
    fn request_header(&self, name: &str) -> Option<String> {
        header_text(REQUEST_HEADERS, name)
    }
    fn request_headers(&self) -> HeaderMap {
        HeaderMap::from_serialized(abi::header_map_pairs(REQUEST_HEADERS))
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        let _ = match value {
            Some(v) => abi::replace_header(REQUEST_HEADERS, name, v.as_bytes()),
            None => abi::remove_header(REQUEST_HEADERS, name),
        };
    }
    fn set_response_header(&self, name: &str, value: &str) {
        let _ = abi::replace_header(RESPONSE_HEADERS, name, value.as_bytes());
    }
    fn response_header(&self, name: &str) -> Option<String> {
        header_text(RESPONSE_HEADERS, name)
    }
    fn with_request_body<R>(&self, size: usize, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        f(abi::buffer(BufferType::HttpRequestBody as u32, 0, size).as_deref())
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        abi::buffer(BufferType::HttpResponseBody as u32, 0, size)
    }
    fn send_local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let map = HeaderMap::from_pairs(headers.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
        if let Err(e) = abi::send_local_response(status, map.as_bytes(), body) {
            self.log(
                Level::Warn,
                &format!("kvroute: local reply {status} not sent: {e}"),
            );
        }
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        abi::shared_data(key).map_err(status)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        abi::set_shared_data(key, value, cas).map_err(status)
    }
    fn enqueue(&self, vm_id: &str, name: &str, data: &[u8]) -> Result<(), HostError> {
        let id = abi::resolve_queue(vm_id, name)
            .map_err(status)?
            .ok_or_else(|| {
                HostError::Other(format!("shared queue {vm_id}/{name} not registered"))
            })?;
        abi::enqueue(id, data).map_err(status)
    }
    fn metric_add(&self, kind: MetricKind, name: &'static str, delta: i64) {
        if let Some(id) = metric_id(kind, name) {
            let _ = abi::increment_metric(id, delta);
        }
    }
    fn metric_record(&self, kind: MetricKind, name: &'static str, value: u64) {
        if let Some(id) = metric_id(kind, name) {
            let _ = abi::record_metric(id, value);
        }
    }
    fn gauge_set_named(&self, name: &str, value: u64) {
        let id = NAMED_GAUGES.with(|m| {
            if let Some(id) = m.borrow().get(name) {
                return Some(*id);
            }
            let id = abi::define_metric(MetricType::Gauge as u32, name).ok()?;
            m.borrow_mut().insert(name.to_owned(), id);
            Some(id)
        });
        if let Some(id) = id {
            let _ = abi::record_metric(id, value);
        }
    }
    fn forget_named_gauge(&self, name: &str) {
        NAMED_GAUGES.with(|m| m.borrow_mut().remove(name));
    }
    fn log(&self, level: Level, msg: &str) {
        let l = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        abi::log(l as u32, msg);
    }
    fn set_effective_context(&self, context_id: u32) -> bool {
        abi::set_effective_context(context_id).is_ok()
    }
    fn resume_request(&self) {
        if let Err(e) = abi::continue_request() {
            self.log(Level::Warn, &format!("kvroute: request not resumed: {e}"));
        }
    }
    fn property(&self, path: &[&str]) -> Option<String> {
        let bytes = abi::property(path)?;
        String::from_utf8(bytes).ok()
    }
    fn set_property(&self, path: &[&str], value: &[u8]) {
        let _ = abi::set_property(path, value);
    }
}

fn action(f: Flow) -> Action {
    match f {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

/// What a configured root context serves.
enum Serving {
    /// Role `route`: the worker state shared with its HTTP contexts.
    Route(Rc<RefCell<Worker>>),
    /// Role `ingest`: the configuration its HTTP contexts check uploads against.
    Ingest(Rc<Config>),
}

/// Root context: parses config, owns the worker state (role `route`) and runs its admission
/// tick, or consumes the snapshot queue (role `ingest`).
struct Root {
    context_id: u32,
    serving: Option<Serving>,
    queue: Option<u32>,
    /// Whether this VM has routed a request: only such VMs report `kvroute.wasm_memory_bytes`
    /// (a single Envoy gauge), so the ingest VM and Envoy's main-thread instance, which
    /// route nothing, do not overwrite the figure with their own smaller memory.
    routed: Cell<bool>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let host = ProxyHost;
        let bytes =
            abi::buffer(BufferType::PluginConfiguration as u32, 0, usize::MAX).unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                host.log(Level::Error, &e.to_string());
                return false;
            }
        };
        let seed = host.now_ms()
            ^ (u64::from(self.context_id) << 32)
            ^ abi::now_ns().map_or(0, |ns| ns % 1_000_000_000);
        if let Err(e) = crate::shared::ensure_keys(&host) {
            host.log(
                Level::Warn,
                &format!("kvroute: shared keys not created: {e}"),
            );
        }
        // Every fixed metric now, not at its first use: each reads 0 in `/stats` until first
        // counted (`names::metric::fixed`), as the native build's do.
        for (name, kind) in crate::names::metric::fixed() {
            let _ = metric_id(kind, name);
        }
        if config.role == Role::Ingest {
            match abi::register_queue(&config.queue_name) {
                Ok(id) => self.queue = Some(id),
                Err(e) => {
                    host.log(
                        Level::Error,
                        &format!("kvroute: cannot register queue {}: {e}", config.queue_name),
                    );
                    return false;
                }
            }
            // No tick: the ingest VM routes nothing and reports no memory gauge.
            self.serving = Some(Serving::Ingest(Rc::new(config)));
            return true;
        }
        // The tick publishes this worker's in-flight table (releases, reservations that
        // waited) and refreshes the Wasm memory gauge (every RELEASE_FLUSH_MS), runs
        // admission and syncs the shared journals (affinity, learner observations): as
        // often as the most frequent needs.
        let tick = crate::router::tick_period_ms(&config);
        let Some(worker) = Worker::start(config, seed, &host) else {
            return false;
        };
        if let Err(e) = abi::set_tick_period_ms(u32::try_from(tick).unwrap_or(u32::MAX)) {
            host.log(Level::Error, &format!("kvroute: no tick ({tick} ms): {e}"));
        }
        self.serving = Some(Serving::Route(Rc::new(RefCell::new(worker))));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let mut items = Vec::new();
        while let Ok(Some(b)) = abi::dequeue(queue_id) {
            items.push(b);
        }
        consume_snapshots(&ProxyHost, items);
    }

    fn on_tick(&mut self) {
        // This VM's linear memory: it only grows, so a leak shows as steady growth.
        if self.routed.get() {
            let pages = core::arch::wasm32::memory_size(0) as u64;
            ProxyHost.metric_record(MetricKind::Gauge, metric::WASM_MEMORY, pages * 65_536);
        }
        if let Some(Serving::Route(w)) = &self.serving {
            w.borrow_mut().periodic(&ProxyHost);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self.serving.as_ref()? {
            Serving::Route(w) => {
                self.routed.set(true);
                Some(Box::new(Http {
                    stream: Stream::new(w.clone(), context_id),
                }))
            }
            Serving::Ingest(c) => Some(Box::new(Ingest {
                stream: IngestStream::new(c.clone()),
            })),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// HTTP context: a thin shell over [`Stream`].
struct Http {
    stream: Stream,
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.stream.on_done(&ProxyHost);
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_request_headers(&ProxyHost, end_of_stream))
    }
    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_request_body(&ProxyHost, size, end_of_stream))
    }
    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        action(self.stream.on_request_trailers(&ProxyHost))
    }
    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_response_headers(&ProxyHost, end_of_stream))
    }
    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        action(
            self.stream
                .on_response_body(&ProxyHost, size, end_of_stream),
        )
    }
    fn on_log(&mut self) {
        self.stream.on_done(&ProxyHost);
    }
}

/// HTTP context of the ingest listener: a thin shell over [`IngestStream`].
struct Ingest {
    stream: IngestStream,
}

impl Context for Ingest {}

impl HttpContext for Ingest {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_request_headers(&ProxyHost, end_of_stream))
    }
    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        action(self.stream.on_request_body(&ProxyHost, size, end_of_stream))
    }
    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        action(self.stream.on_request_trailers(&ProxyHost))
    }
}

#[allow(unsafe_code)] // proxy_wasm::main! expands to the `_initialize` export.
mod entry {
    proxy_wasm::main! {{
        proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
        std::panic::set_hook(Box::new(|info| {
            super::abi::log(
                proxy_wasm::types::LogLevel::Critical as u32,
                &format!("kvroute: panic: {info}"),
            );
        }));
        proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
            Box::new(super::Root {
                context_id,
                serving: None,
                queue: None,
                routed: std::cell::Cell::new(false),
            })
        });
    }}
}
