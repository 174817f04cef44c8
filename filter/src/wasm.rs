//! proxy-wasm glue: the real [`Host`] over the SDK's host calls, and the root and HTTP
//! contexts that delegate to [`crate::stream::Stream`] and [`crate::router::Worker`] (role
//! `route`) or to [`crate::ingest::IngestStream`] and [`crate::ingest::consume_snapshots`]
//! (role `ingest`).
//! Compiled for `wasm32` only; everything it calls is unit-tested natively with the mock.

use crate::host::{HeaderMap, Host, HostError, Level, MetricKind};
use crate::ingest::{consume_snapshots, IngestStream};
use crate::names::metric;
use crate::router::Worker;
use crate::stream::{Flow, Stream};
use kvroute_core::plugin_config::{Config, Role};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

thread_local! {
    static METRICS: RefCell<BTreeMap<&'static str, u32>> = const { RefCell::new(BTreeMap::new()) };
    static NAMED_GAUGES: RefCell<BTreeMap<String, u32>> = const { RefCell::new(BTreeMap::new()) };
}

/// The real host: stateless wrappers over `proxy_wasm::hostcalls`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProxyHost;

fn status(e: Status) -> HostError {
    match e {
        Status::CasMismatch => HostError::CasMismatch,
        other => HostError::Other(format!("{other:?}")),
    }
}

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
        let id = hostcalls::define_metric(t, name).ok()?;
        m.borrow_mut().insert(name, id);
        Some(id)
    })
}

/// Header `name` of `map` as text; `None` when absent, not UTF-8, or not readable now.
fn header_text(map: MapType, name: &str) -> Option<String> {
    String::from_utf8(raw::header_map_value(map, name)?).ok()
}

/// The raw header host calls. The SDK's wrappers panic, and the VM with them, on a value
/// that is not UTF-8 (`get_map`, `get_map_value`: HTTP allows such bytes,
/// [`crate::headers`]) and on any status but `Ok` and `NotFound`: Envoy answers
/// `BadArgument` once it no longer holds the map for the filter (the request headers after
/// the filter let them go, or after `resume_http_request`). Here either is "no value".
#[allow(unsafe_code)] // One host import and the buffer it hands over; see the SAFETY notes.
mod raw {
    use proxy_wasm::types::{MapType, Status};

    #[link(wasm_import_module = "env")]
    extern "C" {
        // The proxy-wasm ABI v0.2.1 import the SDK declares (`hostcalls.rs`), with its map
        // type and status as the `u32`s they are on the wire: a status outside the SDK's
        // enum is then a number, not an invalid enum value.
        fn proxy_get_header_map_pairs(
            map_type: u32,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> u32;
        fn proxy_get_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
    }

    /// A buffer the host handed over: `Some` when the call returned `Ok` with data.
    ///
    /// # Safety
    /// `data` and `size` must be what a proxy-wasm host call wrote on `status`: on `Ok`, a
    /// pointer to `size` bytes the host obtained from this module's
    /// `proxy_on_memory_allocate` (the SDK's `allocator.rs`: a `Box<[u8]>` of exactly `size`
    /// bytes, leaked) and handed over to the caller, or null.
    unsafe fn take(status: u32, data: *mut u8, size: usize) -> Option<Vec<u8>> {
        if status != Status::Ok as u32 || data.is_null() {
            return None;
        }
        // SAFETY: per this function's contract, a `Vec` of that pointer, length and
        // capacity has the allocation's layout, takes ownership back and frees it when
        // dropped, as the SDK's own `get_map` does.
        Some(unsafe { Vec::from_raw_parts(data, size, size) })
    }

    /// Header `key` of `map` as bytes; `None` when absent or not readable now.
    pub fn header_map_value(map: MapType, key: &str) -> Option<Vec<u8>> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the key is valid for `key.len()` bytes for the call; the host only writes
        // the two out-parameters, which are valid for writes.
        let status = unsafe {
            proxy_get_header_map_value(map as u32, key.as_ptr(), key.len(), &mut data, &mut size)
        };
        // SAFETY: `data` and `size` are what the call wrote on `status`.
        unsafe { take(status, data, size) }
    }

    /// Map `map` serialized as the host returns it ([`crate::headers::HeaderMap`]); empty
    /// when the call fails (the map not readable now) or returns nothing.
    pub fn header_map_pairs(map: MapType) -> Vec<u8> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the host only writes the two out-parameters, which are valid for writes.
        let status = unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) };
        // SAFETY: `data` and `size` are what the call wrote on `status`.
        unsafe { take(status, data, size) }.unwrap_or_default()
    }
}

impl Host for ProxyHost {
    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
    fn now_us(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
    fn request_header(&self, name: &str) -> Option<String> {
        header_text(MapType::HttpRequestHeaders, name)
    }
    fn request_headers(&self) -> HeaderMap {
        HeaderMap::from_serialized(raw::header_map_pairs(MapType::HttpRequestHeaders))
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
    }
    fn set_response_header(&self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
    }
    fn response_header(&self, name: &str) -> Option<String> {
        header_text(MapType::HttpResponseHeaders, name)
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }
    fn send_local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        hostcalls::get_shared_data(key).map_err(status)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(status)
    }
    fn enqueue(&self, vm_id: &str, name: &str, data: &[u8]) -> Result<(), HostError> {
        let id = hostcalls::resolve_shared_queue(vm_id, name)
            .map_err(status)?
            .ok_or_else(|| {
                HostError::Other(format!("shared queue {vm_id}/{name} not registered"))
            })?;
        hostcalls::enqueue_shared_queue(id, Some(data)).map_err(status)
    }
    fn metric_add(&self, kind: MetricKind, name: &'static str, delta: i64) {
        if let Some(id) = metric_id(kind, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }
    fn metric_record(&self, kind: MetricKind, name: &'static str, value: u64) {
        if let Some(id) = metric_id(kind, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
    fn gauge_set_named(&self, name: &str, value: u64) {
        let id = NAMED_GAUGES.with(|m| {
            if let Some(id) = m.borrow().get(name) {
                return Some(*id);
            }
            let id = hostcalls::define_metric(MetricType::Gauge, name).ok()?;
            m.borrow_mut().insert(name.to_owned(), id);
            Some(id)
        });
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
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
        let _ = hostcalls::log(l, msg);
    }
    fn set_effective_context(&self, context_id: u32) -> bool {
        hostcalls::set_effective_context(context_id).is_ok()
    }
    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }
    fn property(&self, path: &[&str]) -> Option<String> {
        let bytes = hostcalls::get_property(path.to_vec()).ok()??;
        String::from_utf8(bytes).ok()
    }
    fn set_property(&self, path: &[&str], value: &[u8]) {
        let _ = hostcalls::set_property(path.to_vec(), Some(value));
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
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                host.log(Level::Error, &e.to_string());
                return false;
            }
        };
        let seed = host.now_ms()
            ^ (u64::from(self.context_id) << 32)
            ^ hostcalls::get_current_time()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| u64::from(d.subsec_nanos()))
                .unwrap_or(0);
        if let Err(e) = crate::shared::ensure_keys(&host) {
            host.log(
                Level::Warn,
                &format!("kvroute: shared keys not created: {e}"),
            );
        }
        if config.role == Role::Ingest {
            match hostcalls::register_shared_queue(&config.queue_name) {
                Ok(id) => self.queue = Some(id),
                Err(e) => {
                    host.log(
                        Level::Error,
                        &format!(
                            "kvroute: cannot register queue {}: {e:?}",
                            config.queue_name
                        ),
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
        let mut tick = crate::router::RELEASE_FLUSH_MS;
        if config.admission.enabled {
            tick = tick.min(config.admission.tick_ms);
        }
        if config.shares_with_workers() {
            tick = tick.min(config.affinity_sync_ms);
        }
        let mut worker = match Worker::new(config, seed) {
            Ok(w) => w,
            Err(e) => {
                host.log(Level::Error, &format!("kvroute plugin config: {e}"));
                return false;
            }
        };
        match crate::shared::next_worker_number(&host) {
            Ok(n) => worker.set_worker_number(n),
            Err(e) => host.log(
                Level::Warn,
                &format!("kvroute: no worker number (random reservation ids): {e}"),
            ),
        }
        let _ = hostcalls::set_tick_period(Duration::from_millis(tick));
        self.serving = Some(Serving::Route(Rc::new(RefCell::new(worker))));
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let mut items = Vec::new();
        while let Ok(Some(b)) = hostcalls::dequeue_shared_queue(queue_id) {
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
            let _ = proxy_wasm::hostcalls::log(
                proxy_wasm::types::LogLevel::Critical,
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
