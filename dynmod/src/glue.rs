//! The dynamic-module glue: what `kvroute_filter::wasm` does for proxy-wasm, over
//! [`crate::abi`].
//!
//! - **Config** ([`config_new`], main thread): the same JSON plugin config as the Wasm
//!   filter (`kvroute_core::plugin_config`), passed as `filter_config`
//!   (`google.protobuf.StringValue`). A config that does not parse or validate (including
//!   the picker's own checks, by building a `Worker` from it once) is refused: one error
//!   line `kvroute plugin config: ...`, and a null config, which makes Envoy reject it. The
//!   fixed metric set is defined here, because the ABI defines metrics at config time only.
//! - **Worker** (one per Envoy worker thread and config, like one Wasm VM per worker):
//!   thread-local, created lazily from the parsed config on the thread's first stream.
//! - **Shared data**: proxy-wasm's shared data (per-key CAS tokens) becomes one
//!   process-global map with the same semantics ([`SharedData`]): `None` or `Some(0)` writes
//!   unconditionally, any other token must equal the key's current one. The shared queue the
//!   ingest role enqueues to is delivered in-process, synchronously, to
//!   `kvroute_filter::ingest::consume_snapshots`.
//! - **Tick**: the ABI has no per-worker timer. `Worker::periodic` runs on hook entry when
//!   its period (as the Wasm filter computes it, `kvroute_filter::router::tick_period_ms`) has passed, and when a
//!   worker's last stream ends (so releases are published and the gauges fall back to 0 even
//!   when traffic stops). While streams are in flight, one of them per worker (the tick
//!   carrier, [`carry_ticks`]) registers its scheduler with one process-wide ticker thread,
//!   which commits an event to each carrier every period; `on_http_filter_scheduled` then
//!   runs the worker's tick on its own thread. So reservations are published while their
//!   requests wait on the upstream, requests parked by admission (live streams, so their
//!   worker has a carrier) are retried and timed out as under Wasm, and nothing is
//!   committed while nothing is in flight.
//! - **Deferred replies and resumes**: local replies and resumes asked for inside a hook run
//!   after the hook's state is released ([`run_deferred`]): Envoy runs a stream's encoder
//!   hooks inside `send_response`, and another stream's hooks inside `continue_decoding`.

use crate::abi::{self, ConfigHandle, Filter, Kind, LogLevel, Scheduler};
use kvroute_core::plugin_config::{Config, Role};
use kvroute_filter::host::{period_passed, HeaderMap, Host, HostError, Level, MetricKind};
use kvroute_filter::ingest::{consume_snapshots, IngestStream};
use kvroute_filter::names::metric;
use kvroute_filter::router::Worker;
use kvroute_filter::stream::{Flow, Stream};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Request header that makes a hook panic, honoured only when Envoy was started with
/// `KVROUTE_DYNMOD_TEST_PANIC=1` in its environment: the integration test's way to check
/// the panic barrier in real Envoy. Never set in production. Any value makes the request
/// headers hook panic, but [`TEST_PANIC_NEXT_STREAM`], which lets the request go on and
/// makes the next routing stream's creation panic instead ([`HttpFilter::unrouted`]).
pub const TEST_PANIC_HEADER: &str = "x-kvroute-test-panic";

/// [`TEST_PANIC_HEADER`]'s value that arms a panic in the next routing stream's
/// [`HttpFilter::new`], where no request header can be read yet: the process's next one,
/// on any worker and of any config honouring the knob.
pub const TEST_PANIC_NEXT_STREAM: &[u8] = b"next-stream";

/// Armed by [`TEST_PANIC_NEXT_STREAM`]; taken by the next routing stream's creation.
static TEST_PANIC_ARMED: AtomicBool = AtomicBool::new(false);

/// The fixed metrics (`kvroute_filter::names::metric::fixed`), as the ABI's kinds: defined
/// on every config (names identical to the Wasm filter's).
fn fixed_metrics() -> Vec<(&'static str, Kind)> {
    metric::fixed()
        .into_iter()
        .map(|(n, k)| {
            let kind = match k {
                MetricKind::Counter => Kind::Counter,
                MetricKind::Gauge => Kind::Gauge,
                MetricKind::Histogram => Kind::Histogram,
            };
            (n, kind)
        })
        .collect()
}

// The per-endpoint gauges' label: each prefix (`kvroute.inflight_unseen.requests`,
// `...tokens`, without the trailing dot) is one gauge with this label, whose value is the
// `metric::stat_id` the Wasm filter appends to the name. The ABI defines metrics at config
// time only, and endpoints are not known then.
use kvroute_core::peer::ENDPOINT_LABEL;

/// Metric ids of one config.
#[derive(Debug, Default)]
struct Metrics {
    /// Looked up on every counter and histogram write (a few per request): keyed through
    /// `foldhash`'s fixed state, not std's SipHash (the names are the filter's own, so
    /// nothing to defend against; SipHash was ~0.6 µs per 16 KiB request in `perf`).
    by_name: Map<&'static str, (Kind, usize)>,
    unseen_requests: Option<usize>,
    unseen_tokens: Option<usize>,
}

/// One filter configuration (the module's `http_filter_config_module_ptr`).
#[derive(Debug)]
pub struct FilterConfig(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// Process-unique id: the key of the thread-local workers.
    id: u64,
    handle: ConfigHandle,
    config: Config,
    metrics: Metrics,
    /// `kvroute_filter::router::tick_period_ms` of the config.
    tick_ms: u64,
    /// `KVROUTE_DYNMOD_TEST_PANIC=1` was set (see [`TEST_PANIC_HEADER`]).
    test_panic: bool,
}

static NEXT_CONFIG: AtomicU64 = AtomicU64::new(1);

/// How many configs were destroyed (a listener update replaces its filter configs): each
/// worker thread drops its state of destroyed configs ([`sweep_retired`]) at its next
/// stream after this moves.
static RETIRED_COUNT: AtomicU64 = AtomicU64::new(0);

impl Drop for Inner {
    /// The config's last holder let it go (Envoy destroyed it, after every stream using
    /// it): its workers' state goes when their threads next see a stream. Without this,
    /// each listener update left one router `Worker` per worker thread behind for good
    /// (~116 KB per update at `--concurrency 2`, found by a breaker).
    fn drop(&mut self) {
        RETIRED_COUNT.fetch_add(1, Ordering::Release);
    }
}

/// Drop this thread's state of destroyed configs (each entry holds its config weakly),
/// when any was destroyed since the thread last looked (one atomic load otherwise). It
/// replaced a process-wide list of destroyed config ids, which grew by one per listener
/// update for good and was copied whole at every sweep.
fn sweep_retired() {
    thread_local! {
        static SEEN: Cell<u64> = const { Cell::new(0) };
    }
    let n = RETIRED_COUNT.load(Ordering::Acquire);
    if SEEN.with(Cell::get) == n {
        return;
    }
    SEEN.with(|s| s.set(n));
    WORKERS.with(|w| {
        w.borrow_mut().retain(|_, (cfg, slot)| {
            let keep = cfg.strong_count() > 0;
            if !keep {
                if let Some((_, key)) = slot.carrier.take() {
                    stop_waking(key);
                }
            }
            keep
        })
    });
    INGEST.with(|m| m.borrow_mut().retain(|_, (cfg, _)| cfg.strong_count() > 0));
}

/// Parse and check `config`, define the metrics: the config, or `None` (logged) to refuse it.
pub fn config_new(handle: ConfigHandle, name: &[u8], config: &[u8]) -> Option<FilterConfig> {
    let parsed = match Config::parse(config) {
        Ok(c) => c,
        Err(e) => {
            abi::log(
                LogLevel::Error,
                &format!("{e} (filter {})", String::from_utf8_lossy(name)),
            );
            return None;
        }
    };
    if parsed.role == Role::Route {
        if let Err(e) = Worker::new(parsed.clone(), 0) {
            abi::log(
                LogLevel::Error,
                &format!(
                    "kvroute plugin config: {e} (filter {})",
                    String::from_utf8_lossy(name)
                ),
            );
            return None;
        }
    }
    let mut metrics = Metrics::default();
    for (n, kind) in fixed_metrics() {
        match handle.define(kind, n, &[]) {
            Ok(id) => {
                metrics.by_name.insert(n, (kind, id));
            }
            Err(r) => abi::log(
                LogLevel::Warn,
                &format!("kvroute: metric {n} not defined (result {r})"),
            ),
        }
    }
    let unseen = |prefix: &str| {
        handle
            .define(Kind::Gauge, prefix.trim_end_matches('.'), &[ENDPOINT_LABEL])
            .ok()
    };
    metrics.unseen_requests = unseen(metric::INFLIGHT_UNSEEN_REQUESTS);
    metrics.unseen_tokens = unseen(metric::INFLIGHT_UNSEEN_TOKENS);
    let inner = Inner {
        id: NEXT_CONFIG.fetch_add(1, Ordering::Relaxed),
        handle,
        tick_ms: kvroute_filter::router::tick_period_ms(&parsed),
        config: parsed,
        metrics,
        test_panic: std::env::var_os("KVROUTE_DYNMOD_TEST_PANIC").is_some_and(|v| v == "1"),
    };
    // Here, on the main thread before any stream, as the Wasm filter does at configure:
    // made lazily by each worker's first stream, two workers' first updates could race
    // (`kvroute_filter::shared::ensure_keys`).
    let nothing = RefCell::new(Vec::new());
    if let Err(e) = kvroute_filter::shared::ensure_keys(&DmHost::new(&inner, None, None, &nothing))
    {
        abi::log(
            LogLevel::Warn,
            &format!("kvroute: shared keys not created: {e}"),
        );
    }
    Some(FilterConfig(Arc::new(inner)))
}

// ----------------------------------------------------------------------------------------
// Shared data: one process, so one map.
// ----------------------------------------------------------------------------------------

/// The module's hash maps: keyed by names the module or its operator chose (shared-data
/// keys, `vm_id`s, config and context ids, metric names), never by request content, so a fixed
/// `foldhash` serves: std's SipHash, which resists keys chosen to collide, was ~2 k
/// instructions of each request (callgrind: four shared-data reads, three writes, a
/// stream's registration and removal).
type Map<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// proxy-wasm shared data for one process: key → (value, CAS token). Tokens come from one
/// counter, never 0 (0 means "no token", as in proxy-wasm).
#[derive(Debug, Default)]
pub struct SharedData {
    map: Map<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl SharedData {
    /// Value and token of `key`.
    pub fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.map.get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        }
    }

    /// Write `key`: with a token other than 0, only if the key's token is still that one.
    pub fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        let cur = self.map.get(key).map(|(_, c)| *c);
        if let (Some(want), Some(cur)) = (cas.filter(|c| *c != 0), cur) {
            if want != cur {
                return Err(HostError::CasMismatch);
            }
        }
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        // In place when the key exists (every write but a key's first: the in-flight
        // tables, the journals, the signals): no new key, and the value's buffer reused,
        // which keeps the largest value the key held (each bounded where it is written:
        // a snapshot by `ingest_max_bytes`, a journal by its byte bound).
        match self.map.get_mut(key) {
            Some((v, c)) => {
                v.clear();
                v.extend_from_slice(value);
                *c = self.next_cas;
            }
            None => {
                self.map
                    .insert(key.to_owned(), (value.to_vec(), self.next_cas));
            }
        }
        Ok(())
    }
}

/// The process's shared data, one [`SharedData`] per namespace: the plugin config's
/// `vm_id`, as proxy-wasm keeps shared data per VM id, so configs with different `vm_id`s
/// (two fleets, each with its own ingest listener) never see each other's snapshot,
/// in-flight tables or journals.
fn shared() -> MutexGuard<'static, Map<String, SharedData>> {
    static SHARED: OnceLock<Mutex<Map<String, SharedData>>> = OnceLock::new();
    SHARED
        .get_or_init(|| Mutex::new(Map::default()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

// ----------------------------------------------------------------------------------------
// The ticker thread.
// ----------------------------------------------------------------------------------------

/// Schedulers of the workers' tick carriers ([`carry_ticks`]), by registration key: the
/// ticker commits to each one every period. Deleted under the same lock, so a commit never
/// races a delete.
fn woken() -> MutexGuard<'static, BTreeMap<u64, Scheduler>> {
    static WOKEN: OnceLock<Mutex<BTreeMap<u64, Scheduler>>> = OnceLock::new();
    WOKEN
        .get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

static NEXT_WOKEN: AtomicU64 = AtomicU64::new(1);
/// The ticker's period, ms: the smallest tick of the configs that registered a carrier.
static TICKER_MS: AtomicU64 = AtomicU64::new(u64::MAX);
static TICKER_STARTED: AtomicBool = AtomicBool::new(false);

/// Have the ticker thread (started on the first call) wake scheduler `s` every `tick_ms`
/// (or the smallest period registered before); returns the key [`stop_waking`] takes.
fn wake_every(s: Scheduler, tick_ms: u64) -> u64 {
    TICKER_MS.fetch_min(tick_ms, Ordering::Relaxed);
    if !TICKER_STARTED.swap(true, Ordering::Relaxed) {
        let spawned = std::thread::Builder::new()
            .name("kvroute-ticker".into())
            .spawn(|| loop {
                let ms = TICKER_MS.load(Ordering::Relaxed).clamp(1, 1000);
                std::thread::sleep(Duration::from_millis(ms));
                for s in woken().values() {
                    s.commit(0);
                }
            });
        if let Err(e) = spawned {
            TICKER_STARTED.store(false, Ordering::Relaxed);
            abi::log(
                LogLevel::Error,
                &format!("kvroute: no ticker thread ({e}); parked requests and in-flight tables wait for traffic"),
            );
        }
    }
    let key = NEXT_WOKEN.fetch_add(1, Ordering::Relaxed);
    woken().insert(key, s);
    key
}

/// Stop waking the scheduler registered as `key` ([`wake_every`]), and delete it.
fn stop_waking(key: u64) {
    let mut p = woken();
    if let Some(s) = p.remove(&key) {
        s.delete();
    }
}

// ----------------------------------------------------------------------------------------
// Per-thread state.
// ----------------------------------------------------------------------------------------

/// One worker thread's state for one config.
#[derive(Debug)]
struct Slot {
    worker: Rc<RefCell<Worker>>,
    /// When the tick last ran, Unix ms.
    last_tick: Cell<u64>,
    /// Streams of this config alive on this thread.
    live: Cell<u32>,
    /// The live stream whose scheduler the ticker wakes every tick period, so the tick runs
    /// while streams are in flight but no hook comes (context id, ticker key).
    carrier: Cell<Option<(u32, u64)>>,
}

/// A thread's state of each config, by config id, with the config held weakly
/// ([`sweep_retired`]).
type PerConfig<T> = RefCell<Map<u64, (Weak<Inner>, Rc<T>)>>;

thread_local! {
    /// This thread's worker of each config (by config id), with the config held weakly
    /// ([`sweep_retired`]).
    static WORKERS: PerConfig<Slot> = RefCell::new(Map::default());
    /// This thread's copy of each ingest config.
    static INGEST: PerConfig<Config> = RefCell::new(Map::default());
    /// Live streams of this thread by context id, with their config's id: what
    /// `set_effective_context` reaches, and where a tick carrier is found ([`carry_ticks`]).
    static LIVE: RefCell<Map<u32, (u64, Filter)>> = RefCell::new(Map::default());
    static NEXT_CONTEXT: Cell<u32> = const { Cell::new(0) };
    /// This thread's request-body buffer ([`KEPT_BODY_BYTES`]).
    static BODY: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

static NEXT_SEED: AtomicU32 = AtomicU32::new(0);

/// Largest request-body buffer a worker thread keeps from one request to the next, bytes
/// (64 KiB): bodies up to it (chat requests mostly are) are read into one allocation per
/// thread ([`Host::with_request_body`]); a larger one gets its own, freed after its
/// decision. One allocation and free fewer per request (in Envoy's `tcmalloc`, with the
/// router's two scratch buffers, ~850 instructions per 1 KiB request and ~2.5 k per
/// 16 KiB one, docs/overhead.md); at 256 KiB and 1 MiB keeping the buffer showed no gain
/// in timed runs (the kernel's share was the same as Envoy's buffer filter's: no page
/// faults to save), so those bodies keep their own allocation and no worker holds more.
const KEPT_BODY_BYTES: usize = 64 * 1024;

fn slot(cfg: &Arc<Inner>) -> Option<Rc<Slot>> {
    if let Some(s) = WORKERS.with(|w| w.borrow().get(&cfg.id).map(|(_, s)| s.clone())) {
        return Some(s);
    }
    // Starting a worker replies to and resumes no stream.
    let nothing = RefCell::new(Vec::new());
    let host = DmHost::new(cfg, None, None, &nothing);
    let seed = now_us() ^ (u64::from(NEXT_SEED.fetch_add(1, Ordering::Relaxed)) << 40);
    let worker = Worker::start(cfg.config.clone(), seed, &host)?;
    let s = Rc::new(Slot {
        worker: Rc::new(RefCell::new(worker)),
        // Never: the worker's first hook ticks, so it reads the other workers' journals
        // and in-flight tables before its first decision.
        last_tick: Cell::new(0),
        live: Cell::new(0),
        carrier: Cell::new(None),
    });
    WORKERS.with(|w| {
        w.borrow_mut()
            .insert(cfg.id, (Arc::downgrade(cfg), s.clone()))
    });
    Some(s)
}

/// Give `slot` a tick carrier when it has none: a live stream of its config on this thread,
/// whose scheduler is registered with the ticker ([`wake_every`]). Without it, a worker whose
/// streams are all waiting on their upstreams, or parked by admission, would run no tick
/// until the next hook: its reservations would reach neither the other workers nor its
/// in-flight gauges (which kvroute-cp reads for the other gateways), and its parked
/// requests would be neither retried nor timed out. When the carrier ends, another live
/// stream takes over; when none is left, the last stream's end runs the tick itself
/// ([`HttpFilter::finish`]).
fn carry_ticks(cfg: &Inner, slot: &Slot) {
    if slot.carrier.get().is_some() {
        return;
    }
    let next = LIVE.with(|l| {
        l.borrow()
            .iter()
            .find(|(_, (c, _))| *c == cfg.id)
            .map(|(ctx, (_, f))| (*ctx, *f))
    });
    if let Some((ctx, f)) = next {
        if let Some(s) = f.scheduler() {
            slot.carrier.set(Some((ctx, wake_every(s, cfg.tick_ms))));
        }
    }
}

fn ingest_config(cfg: &Arc<Inner>) -> Rc<Config> {
    INGEST.with(|m| {
        m.borrow_mut()
            .entry(cfg.id)
            .or_insert_with(|| (Arc::downgrade(cfg), Rc::new(cfg.config.clone())))
            .1
            .clone()
    })
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn now_ms() -> u64 {
    now_us() / 1000
}

/// Run the worker's tick when due: its period has passed since the last tick, or the clock
/// went back past it ([`period_passed`]; with a plain difference, a clock stepped back by Δ
/// stopped the worker's ticks for Δ, and its parked requests were neither resumed nor timed
/// out meanwhile: found by a breaker, reading the code). With `force` (the worker goes
/// idle): now, with the journal sync forced ([`Worker::flush`]). What it defers (resumes of
/// and replies to parked requests) goes into `deferred`, the calling stream's list.
fn tick(cfg: &Inner, slot: &Slot, now: u64, force: bool, deferred: &RefCell<Vec<Deferred>>) {
    if !force && !period_passed(now, slot.last_tick.get(), cfg.tick_ms) {
        return;
    }
    let Ok(mut w) = slot.worker.try_borrow_mut() else {
        return;
    };
    slot.last_tick.set(now);
    let host = DmHost::new(cfg, None, None, deferred);
    if force {
        // One idle flush at a time in the process: each publishes its worker's releases,
        // reads the others' tables and sets the shared gauges, so the last to go idle
        // writes them from every other worker's final table. Two flushing at once could
        // each read the other's table before its release, and the later writer left a
        // stale count in `kvroute.inflight` until the next request (found by a breaker).
        static IDLE_FLUSH: Mutex<()> = Mutex::new(());
        let _one = IDLE_FLUSH.lock().unwrap_or_else(|e| e.into_inner());
        w.flush(&host);
    } else {
        w.periodic(&host);
    }
}

// ----------------------------------------------------------------------------------------
// The host.
// ----------------------------------------------------------------------------------------

/// A host call whose effect runs after the hook's state is released.
#[derive(Debug)]
pub enum Deferred {
    /// A local reply.
    Reply {
        /// Stream.
        to: Filter,
        /// Status.
        status: u32,
        /// Headers.
        headers: Vec<(String, String)>,
        /// Body.
        body: Vec<u8>,
    },
    /// Resume a paused stream.
    Resume(Filter),
}

impl Deferred {
    /// The stream the call is for.
    pub fn target(&self) -> Filter {
        match self {
            Deferred::Reply { to, .. } => *to,
            Deferred::Resume(f) => *f,
        }
    }
}

/// Carry out deferred host calls, in order.
pub fn run_deferred(v: Vec<Deferred>) {
    for d in v {
        match d {
            Deferred::Reply {
                to,
                status,
                headers,
                body,
            } => {
                let hs: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                to.send_response(status, &hs, &body, "kvroute");
            }
            Deferred::Resume(f) => f.continue_decoding(),
        }
    }
}

/// [`Host`] over the ABI for one hook: the stream it targets (the hook's own, or the one
/// the tick made effective), the config's metrics, and where its deferred calls go.
struct DmHost<'a> {
    cfg: &'a Inner,
    /// The shared-data namespace: the config's `vm_id` ([`shared`]).
    ns: &'a str,
    target: Cell<Option<Filter>>,
    /// The hook's stream's list of deferred calls ([`HttpFilter::deferred`]), outside the
    /// hook's panic barrier: a call asked for before a panic stays there for the panic
    /// path ([`HttpFilter::panicked`]). A tick that took parked requests from the admission
    /// queue and re-decided them before panicking still resumes (or answers) them, where
    /// they had waited for Envoy's stream idle timeout (found by a breaker, reading the
    /// code).
    deferred: &'a RefCell<Vec<Deferred>>,
    /// A stream hook's clock in Unix ms, read once when the hook's own work began: during
    /// one hook (a few µs) [`Host::now_ms`] needs no new read. A clock read cost ~0.1 µs on
    /// the benchmark's VM, and a request made eight (`perf`: ~0.9 µs per request in
    /// `clock_gettime`). `None` (the tick, the ingest, start-up): every call reads the clock,
    /// so the journal sync's compare-and-swap retries stamp their records in time order.
    /// [`Host::now_us`], which times the decision, always reads the clock.
    now_ms: Option<u64>,
}

impl<'a> DmHost<'a> {
    /// A host for one hook; `now_ms` ([`DmHost::now_ms`]): its clock, or `None` to read the
    /// clock at each call; `deferred`: where its deferred calls go ([`DmHost::deferred`]).
    fn new(
        cfg: &'a Inner,
        target: Option<Filter>,
        now_ms: Option<u64>,
        deferred: &'a RefCell<Vec<Deferred>>,
    ) -> Self {
        Self {
            cfg,
            ns: &cfg.config.vm_id,
            target: Cell::new(target),
            deferred,
            now_ms,
        }
    }
    fn text(b: Option<Vec<u8>>) -> Option<String> {
        b.and_then(|b| String::from_utf8(b).ok())
    }
    fn metric(&self, name: &str) -> Option<(Kind, usize)> {
        self.cfg.metrics.by_name.get(name).copied()
    }
    /// Add `call` to the stream's deferred calls. The list is borrowed only here, and
    /// by its owner between hooks, so it is never busy; were it busy, the call is logged
    /// and dropped rather than panicking.
    fn defer(&self, call: Deferred) {
        match self.deferred.try_borrow_mut() {
            Ok(mut d) => d.push(call),
            Err(_) => abi::log(
                LogLevel::Error,
                &format!(
                    "kvroute: deferred call to stream {:?} dropped (list busy)",
                    call.target()
                ),
            ),
        }
    }
}

impl Host for DmHost<'_> {
    fn now_ms(&self) -> u64 {
        self.now_ms.unwrap_or_else(now_ms)
    }
    fn now_us(&self) -> u64 {
        now_us()
    }
    fn request_header(&self, name: &str) -> Option<String> {
        Self::text(self.target.get()?.header(abi::REQUEST_HEADERS, name))
    }
    fn request_headers(&self) -> HeaderMap {
        match self.target.get() {
            Some(f) => f.headers(abi::REQUEST_HEADERS),
            None => HeaderMap::from_pairs(std::iter::empty()),
        }
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        if let Some(f) = self.target.get() {
            f.set_header(abi::REQUEST_HEADERS, name, value.map(str::as_bytes));
            // The routing headers (cluster, endpoint) take effect only once the router
            // matches again: without this the route cached before the filter ran applies.
            f.clear_route_cache();
        }
    }
    fn set_response_header(&self, name: &str, value: &str) {
        if let Some(f) = self.target.get() {
            f.set_header(abi::RESPONSE_HEADERS, name, Some(value.as_bytes()));
        }
    }
    fn response_header(&self, name: &str) -> Option<String> {
        Self::text(self.target.get()?.header(abi::RESPONSE_HEADERS, name))
    }
    fn with_request_body<R>(&self, size: usize, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        let Some(filter) = self.target.get() else {
            return f(None);
        };
        // Out of the thread's slot for the call: a nested read (none is expected) would
        // find it empty and read into a buffer of its own.
        let mut buf = BODY.with(Cell::take);
        buf.clear();
        filter.request_body_into(&mut buf);
        buf.truncate(size);
        let r = f(Some(&buf));
        if buf.capacity() <= KEPT_BODY_BYTES {
            BODY.with(|b| b.set(buf));
        }
        r
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        let mut b = self.target.get()?.response_body();
        b.truncate(size);
        Some(b)
    }
    fn send_local_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        if let Some(to) = self.target.get() {
            self.defer(Deferred::Reply {
                to,
                status,
                headers: headers
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                body: body.to_vec(),
            });
        }
    }
    fn shared_get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        Ok(shared().get(self.ns).map_or((None, None), |d| d.get(key)))
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        let mut all = shared();
        if let Some(d) = all.get_mut(self.ns) {
            return d.set(key, value, cas);
        }
        all.entry(self.ns.to_owned())
            .or_default()
            .set(key, value, cas)
    }
    fn enqueue(&self, vm_id: &str, _name: &str, data: &[u8]) -> Result<(), HostError> {
        // One process: the ingest role's queue is consumed here and now, into the shared
        // data of the VM id it names (its own `vm_id`), one push at a time: pushes arrive on
        // any worker thread, and `publish_snapshot` writes the bytes, then moves the version
        // by compare-and-swap, so two at once could leave one's bytes under the other's
        // version (proxy-wasm has one consumer, the ingest VM's root context).
        static CONSUMING: Mutex<()> = Mutex::new(());
        let _one = CONSUMING.lock().unwrap_or_else(|e| e.into_inner());
        let mut to = DmHost::new(self.cfg, None, None, self.deferred);
        to.ns = vm_id;
        consume_snapshots(&to, vec![data.to_vec()]);
        Ok(())
    }
    fn metric_add(&self, _kind: MetricKind, name: &'static str, delta: i64) {
        match self.metric(name) {
            Some((Kind::Counter, id)) if delta > 0 => {
                self.cfg.handle.counter_add(id, delta.unsigned_abs());
            }
            Some((Kind::Gauge, id)) => self.cfg.handle.gauge_add(id, delta),
            _ => {}
        }
    }
    fn metric_record(&self, _kind: MetricKind, name: &'static str, value: u64) {
        match self.metric(name) {
            Some((Kind::Gauge, id)) => self.cfg.handle.gauge_set(id, &[], value),
            Some((Kind::Histogram, id)) => self.cfg.handle.histogram_record(id, value),
            _ => {}
        }
    }
    fn gauge_set_named(&self, name: &str, value: u64) {
        let m = &self.cfg.metrics;
        let (id, endpoint) = if let Some(e) = name.strip_prefix(metric::INFLIGHT_UNSEEN_REQUESTS) {
            (m.unseen_requests, e)
        } else if let Some(e) = name.strip_prefix(metric::INFLIGHT_UNSEEN_TOKENS) {
            (m.unseen_tokens, e)
        } else {
            (None, "")
        };
        if let Some(id) = id {
            self.cfg.handle.gauge_set(id, &[endpoint], value);
        }
    }
    fn forget_named_gauge(&self, _name: &str) {
        // Labelled values live in Envoy's stats store; there is no per-name handle to drop.
    }
    fn log(&self, level: Level, msg: &str) {
        let l = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        abi::log(l, msg);
    }
    fn set_effective_context(&self, context_id: u32) -> bool {
        match LIVE.with(|l| l.borrow().get(&context_id).map(|(_, f)| *f)) {
            Some(f) => {
                self.target.set(Some(f));
                true
            }
            None => false,
        }
    }
    fn resume_request(&self) {
        if let Some(f) = self.target.get() {
            self.defer(Deferred::Resume(f));
        }
    }
    fn set_property(&self, path: &[&str], value: &[u8]) {
        // proxy-wasm's `set_property` keeps a value as filter state `wasm.<path>`; the same
        // key here, so access-log formats (`%FILTER_STATE(wasm.kvroute_decision:PLAIN)%`)
        // work with either build.
        if let Some(f) = self.target.get() {
            f.set_filter_state(&format!("wasm.{}", path.join(".")), value);
        }
    }
    fn property(&self, path: &[&str]) -> Option<String> {
        let id = match path {
            ["response", "code_details"] => abi::ATTR_RESPONSE_CODE_DETAILS,
            ["upstream", "address"] => abi::ATTR_UPSTREAM_ADDRESS,
            _ => return None,
        };
        Self::text(self.target.get()?.attribute(id))
    }
}

// ----------------------------------------------------------------------------------------
// The per-stream filter.
// ----------------------------------------------------------------------------------------

#[derive(Debug)]
// A `Stream` is ten times the other variants, but the whole `HttpFilter` is boxed once
// (the module pointer): boxing the stream too cost a second allocation per request.
#[allow(clippy::large_enum_variant)]
enum Serving {
    Route {
        stream: Stream,
        slot: Rc<Slot>,
    },
    Ingest(IngestStream),
    /// No worker could be made, or the stream's creation panicked
    /// ([`HttpFilter::unrouted`]): every hook continues, the request headers hook after
    /// removing the client's routing headers.
    Nothing,
}

/// One stream's state (the module's `http_filter_module_ptr`).
#[derive(Debug)]
pub struct HttpFilter {
    cfg: Arc<Inner>,
    filter: Filter,
    context_id: u32,
    serving: Serving,
    /// `on_done` ran.
    done: bool,
    /// A hook of this stream panicked: its later request/response hooks only continue.
    failed: bool,
    /// The request headers have not gone on past this filter: true until a request hook
    /// answers "continue" ([`Self::panicked`] removes the client's routing headers only
    /// then). A tick's resume of a parked request lets them go on unseen here: a panic in
    /// a later request hook then removes headers already sent, which changes nothing.
    held: bool,
    /// Host calls this stream's hooks deferred ([`run_deferred`] runs them after the hook),
    /// kept outside the panic barrier ([`DmHost::deferred`]).
    deferred: RefCell<Vec<Deferred>>,
}

/// Remove the client's routing headers from the request of `host`'s stream, as the stream
/// does before it decides ([`kvroute_filter::stream::strip_client_routing`]).
fn strip_client_routing(host: &DmHost<'_>) {
    let headers = host.request_headers();
    let names = kvroute_filter::stream::client_routing_headers(&host.cfg.config);
    let present = headers.get_all(names).map(|v| v.is_some());
    kvroute_filter::stream::strip_client_routing(host, &host.cfg.config, present);
}

/// Count a stream that fails open (`kvroute.fail_open`).
fn count_fail_open(cfg: &Inner) {
    if let Some((_, id)) = cfg.metrics.by_name.get(metric::FAIL_OPEN) {
        cfg.handle.counter_add(*id, 1);
    }
}

/// Which kind of hook panicked ([`HttpFilter::panicked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hooked {
    /// A request hook (headers, body, trailers): it answers "continue" itself.
    Request,
    /// The ticker's wake-up (`on_http_filter_scheduled`): it answers nothing.
    Scheduled,
    /// A response hook, or the stream's end.
    Other,
}

/// Drop the deferred calls that target stream `me` (a reply to it, its resume).
fn drop_calls_to(deferred: &mut Vec<Deferred>, me: Filter) {
    deferred.retain(|d| d.target() != me);
}

/// `Flow` as every filter status enum numbers it: 0 Continue, 1 StopIteration (headers,
/// trailers) / StopIterationAndBuffer (body).
fn status(f: Flow) -> u32 {
    match f {
        Flow::Continue => 0,
        Flow::Pause => 1,
    }
}

impl HttpFilter {
    /// A stream of `cfg` on this thread.
    pub fn new(cfg: &FilterConfig, filter: Filter) -> Self {
        sweep_retired();
        let cfg = cfg.0.clone();
        if cfg.test_panic
            && cfg.config.role == Role::Route
            && TEST_PANIC_ARMED.swap(false, Ordering::Relaxed)
        {
            #[allow(clippy::panic)] // The test knob's whole purpose (TEST_PANIC_NEXT_STREAM).
            {
                panic!(
                    "kvroute: deliberate test panic in a stream's creation ({TEST_PANIC_HEADER})"
                );
            }
        }
        let context_id = NEXT_CONTEXT.with(|c| {
            let id = c.get().wrapping_add(1).max(1);
            c.set(id);
            id
        });
        let serving = match cfg.config.role {
            Role::Route => match slot(&cfg) {
                Some(slot) => Serving::Route {
                    stream: Stream::new(slot.worker.clone(), context_id),
                    slot,
                },
                None => Serving::Nothing,
            },
            Role::Ingest => Serving::Ingest(IngestStream::new(ingest_config(&cfg))),
        };
        // Registered after everything that runs kvroute code but `carry_ticks`: a panic
        // before this point leaves no entry (the stream is then `unrouted`, whose destroy
        // removes none). `carry_ticks` (lookups and the ticker's registration) runs after
        // the registration, which makes this stream the first carrier; a panic in it only
        // loses the carrier (the next stream takes it), never the entry this one owns.
        if let Serving::Route { slot, .. } = &serving {
            slot.live.set(slot.live.get() + 1);
            LIVE.with(|l| l.borrow_mut().insert(context_id, (cfg.id, filter)));
            let _ = crate::guard::catch(|| carry_ticks(&cfg, slot));
        }
        Self::of(cfg, filter, context_id, serving)
    }

    /// A stream's state before any hook.
    fn of(cfg: Arc<Inner>, filter: Filter, context_id: u32, serving: Serving) -> Self {
        Self {
            cfg,
            filter,
            context_id,
            serving,
            done: false,
            failed: false,
            held: true,
            deferred: RefCell::new(Vec::new()),
        }
    }

    /// A stream of `cfg` whose state could not be made ([`Self::new`] panicked): it routes
    /// nothing, and its request headers hook removes the client's routing headers, so the
    /// request takes Envoy's default route. Counted as a fail-open.
    pub fn unrouted(cfg: &FilterConfig, filter: Filter) -> Self {
        count_fail_open(&cfg.0);
        Self::of(cfg.0.clone(), filter, 0, Serving::Nothing)
    }

    /// The deferred host calls of the last hook.
    pub fn take_deferred(&mut self) -> Vec<Deferred> {
        std::mem::take(self.deferred.get_mut())
    }

    /// A hook of this stream panicked (`hooked`: which kind): count it, and let the rest of
    /// the stream through. Returns the deferred calls to run now: what the hook asked for
    /// before the panic ([`DmHost::deferred`]), so that a tick's resumes of parked requests
    /// are not lost.
    ///
    /// - A request hook answers "continue" itself: this stream's own deferred calls are
    ///   dropped, it leaves the admission queue if parked there, and while its headers are
    ///   still held ([`Self::held`]) the client's routing headers are removed
    ///   ([`strip_client_routing`]): the panic may have come before the stream's own removal
    ///   of them, and the request goes on unrouted, to Envoy's default route.
    /// - The ticker's wake-up answers nothing: this stream's own calls are kept, since a
    ///   resume (or reply) the tick decided for it is its only way on.
    /// - A response hook or the stream's end: its own calls are dropped.
    pub fn panicked(&mut self, hooked: Hooked) -> Vec<Deferred> {
        self.failed = true;
        count_fail_open(&self.cfg);
        let mut d = self.leftovers(hooked == Hooked::Scheduled);
        if hooked == Hooked::Request && !self.done {
            let host = DmHost::new(&self.cfg, Some(self.filter), None, &self.deferred);
            if let Serving::Route { stream, .. } = &mut self.serving {
                stream.leave_queue(&host);
            }
            if self.held {
                strip_client_routing(&host);
                self.held = false;
            }
            d.append(self.deferred.get_mut());
        }
        d
    }

    /// What a panic left to run: this stream's deferred calls, less the calls to this
    /// stream itself unless `keep_own` (a panicked hook answers for its own stream; a
    /// destroyed one is gone).
    pub fn leftovers(&mut self, keep_own: bool) -> Vec<Deferred> {
        let mut d = self.take_deferred();
        if !keep_own {
            drop_calls_to(&mut d, self.filter);
        }
        d
    }

    /// Run `op` with this stream's host (after the worker's tick when due) and keep the
    /// deferred calls.
    fn run(&mut self, eos: bool, op: impl FnOnce(&mut Serving, &DmHost<'_>) -> Flow) -> u32 {
        if self.failed {
            return 0;
        }
        // Split borrows, not an `Arc` clone: the config's reference count is one cache line
        // every worker thread would write on every hook.
        let Self {
            cfg,
            filter,
            serving,
            deferred,
            ..
        } = self;
        let cfg: &Inner = cfg;
        let mut now = now_ms();
        if let Serving::Route { slot, .. } = serving {
            let ticked = slot.last_tick.get();
            tick(cfg, slot, now, false, deferred);
            if slot.last_tick.get() != ticked {
                // The tick ran: the hook's own work begins after it.
                now = now_ms();
            }
        }
        let host = DmHost::new(cfg, Some(*filter), Some(now), deferred);
        let flow = op(serving, &host);
        if flow == Flow::Pause && eos {
            // Parked by admission: only the worker's tick retries or times it out, which the
            // tick carrier brings while no hook comes. The worker has had one since its first
            // live stream; this gives it one again if `carry_ticks` panicked (a Cell read
            // when it has one).
            if let Serving::Route { slot, .. } = serving {
                carry_ticks(cfg, slot);
            }
        }
        status(flow)
    }

    /// [`Self::run`] for a request hook: the request headers stay held ([`Self::held`])
    /// while it answers "stop".
    fn request_hook(
        &mut self,
        eos: bool,
        op: impl FnOnce(&mut Serving, &DmHost<'_>) -> Flow,
    ) -> u32 {
        let st = self.run(eos, op);
        // Once a hook has continued, the headers are gone; a later "stop" (a body hook
        // buffering) does not hold them again.
        self.held &= st != 0;
        st
    }

    /// `on_http_filter_request_headers`.
    pub fn request_headers(&mut self, eos: bool) -> u32 {
        if self.cfg.test_panic && !self.failed {
            match self.filter.header(abi::REQUEST_HEADERS, TEST_PANIC_HEADER) {
                Some(v) if v == TEST_PANIC_NEXT_STREAM => {
                    TEST_PANIC_ARMED.store(true, Ordering::Relaxed);
                }
                Some(_) => {
                    #[allow(clippy::panic)] // The test knob's whole purpose (TEST_PANIC_HEADER).
                    {
                        panic!("kvroute: deliberate test panic ({TEST_PANIC_HEADER})");
                    }
                }
                None => {}
            }
        }
        self.request_hook(eos, |s, h| match s {
            Serving::Route { stream, .. } => stream.on_request_headers(h, eos),
            Serving::Ingest(i) => i.on_request_headers(h, eos),
            Serving::Nothing => {
                // Unrouted: Envoy's default route, not one the client named.
                strip_client_routing(h);
                Flow::Continue
            }
        })
    }

    /// `on_http_filter_request_body`.
    pub fn request_body(&mut self, eos: bool) -> u32 {
        let size = self.filter.request_body_size();
        self.request_hook(eos, |s, h| match s {
            Serving::Route { stream, .. } => stream.on_request_body(h, size, eos),
            Serving::Ingest(i) => i.on_request_body(h, size, eos),
            Serving::Nothing => Flow::Continue,
        })
    }

    /// `on_http_filter_request_trailers`.
    pub fn request_trailers(&mut self) -> u32 {
        self.request_hook(true, |s, h| match s {
            Serving::Route { stream, .. } => stream.on_request_trailers(h),
            Serving::Ingest(i) => i.on_request_trailers(h),
            Serving::Nothing => Flow::Continue,
        })
    }

    /// `on_http_filter_response_headers`.
    pub fn response_headers(&mut self, eos: bool) -> u32 {
        self.run(false, |s, h| match s {
            Serving::Route { stream, .. } => stream.on_response_headers(h, eos),
            _ => Flow::Continue,
        })
    }

    /// `on_http_filter_response_body`.
    pub fn response_body(&mut self, eos: bool) -> u32 {
        let size = self.filter.response_body_size();
        self.run(false, |s, h| match s {
            Serving::Route { stream, .. } => stream.on_response_body(h, size, eos),
            _ => Flow::Continue,
        })
    }

    /// `on_http_filter_scheduled`: the ticker's wake-up; run the worker's tick when due.
    pub fn scheduled(&mut self) {
        if let Serving::Route { slot, .. } = &self.serving {
            tick(&self.cfg, slot, now_ms(), false, &self.deferred);
        }
    }

    /// `on_http_filter_stream_complete`: the stream's end (releases its reservation).
    pub fn complete(&mut self) {
        self.finish(true);
    }

    /// The stream's end; `attached`: Envoy still holds the stream, so host calls may reach it.
    fn finish(&mut self, attached: bool) {
        if self.done {
            return;
        }
        self.done = true;
        let Self {
            cfg,
            filter,
            context_id,
            serving,
            deferred,
            ..
        } = self;
        let cfg: &Inner = cfg;
        if let Serving::Route { stream, slot } = serving {
            // Unregistered first, before kvroute code runs: a panic in `on_done` must not
            // leave this stream reachable (LIVE, the tick carrier) after Envoy frees it.
            LIVE.with(|l| l.borrow_mut().remove(context_id));
            if let Some((ctx, key)) = slot.carrier.get() {
                if ctx == *context_id {
                    stop_waking(key);
                    slot.carrier.set(None);
                    carry_ticks(cfg, slot);
                }
            }
            let live = slot.live.get().saturating_sub(1);
            slot.live.set(live);
            let host = DmHost::new(cfg, attached.then_some(*filter), Some(now_ms()), deferred);
            stream.on_done(&host);
            if live == 0 {
                // No stream left to run the tick on: publish the releases now.
                tick(cfg, slot, now_ms(), true, deferred);
            }
        }
    }

    /// `on_http_filter_destroy`: the end, if `complete` could not run; the stream is
    /// detached from Envoy by now, so no host call reaches it.
    pub fn destroy(&mut self) {
        if !self.done {
            self.finish(false);
            drop_calls_to(self.deferred.get_mut(), self.filter);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a panicked hook's stream keeps of the deferred calls: the ticker's wake-up keeps
    /// the stream's own (a resume the tick decided for it is its only way on), a request or
    /// response hook drops them (it answers "continue" itself); calls for other streams,
    /// those asked for by a host the panic unwound through included, always run.
    #[test]
    fn a_panicked_hook_keeps_what_other_streams_need() {
        let cfg = config_new(ConfigHandle::for_tests(), b"p", br#"{"mode":"cluster"}"#).unwrap();
        let (me, other) = (Filter::for_tests(7), Filter::for_tests(8));
        let targets = |d: &[Deferred]| -> Vec<Filter> { d.iter().map(Deferred::target).collect() };
        for (hooked, want) in [
            (Hooked::Scheduled, vec![me, other, other]),
            (Hooked::Request, vec![other, other]),
            (Hooked::Other, vec![other, other]),
        ] {
            let mut h = HttpFilter::unrouted(&cfg, me);
            h.deferred = RefCell::new(vec![Deferred::Resume(me), Deferred::Resume(other)]);
            // A hook's host (a tick's, made effective on another stream) resumes that
            // stream, then the hook panics.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let host = DmHost::new(&cfg.0, Some(other), None, &h.deferred);
                host.resume_request();
                #[allow(clippy::panic)] // The point of the test.
                {
                    panic!("deliberate");
                }
            }));
            assert!(r.is_err());
            let d = h.panicked(hooked);
            assert_eq!(targets(&d), want, "{hooked:?}");
            assert!(h.failed);
            assert!(h.take_deferred().is_empty());
        }
        // A destroyed stream's leftovers: the calls for other streams only.
        let mut h = HttpFilter::unrouted(&cfg, me);
        h.deferred = RefCell::new(vec![Deferred::Resume(me), Deferred::Resume(other)]);
        assert_eq!(targets(&h.leftovers(false)), vec![other]);
    }

    /// Configs with different `vm_id`s see different shared data, as proxy-wasm VMs do;
    /// the ingest role's snapshot goes into the `vm_id` it names.
    #[test]
    fn configs_with_different_vm_ids_share_nothing() {
        let a = config_new(ConfigHandle::for_tests(), b"a", br#"{"mode":"cluster"}"#).unwrap();
        let b = config_new(
            ConfigHandle::for_tests(),
            b"b",
            br#"{"mode":"cluster","vm_id":"vm-ns-test"}"#,
        )
        .unwrap();
        let nothing = RefCell::new(Vec::new());
        let (ha, hb) = (
            DmHost::new(&a.0, None, None, &nothing),
            DmHost::new(&b.0, None, None, &nothing),
        );
        ha.shared_set("ns-test-key", b"1", None).unwrap();
        assert_eq!(
            ha.shared_get("ns-test-key").unwrap().0.as_deref(),
            Some(&b"1"[..])
        );
        assert_eq!(hb.shared_get("ns-test-key").unwrap(), (None, None));
        hb.shared_set("ns-test-key", b"2", None).unwrap();
        assert_eq!(
            ha.shared_get("ns-test-key").unwrap().0.as_deref(),
            Some(&b"1"[..])
        );
        // A snapshot enqueued for `vm-ns-test` is published there only.
        let snap = kvroute_core::snapshot::Snapshot::new(7, 1, Vec::new());
        ha.enqueue("vm-ns-test", "q", &snap.encode()).unwrap();
        let version = |h: &DmHost<'_>| {
            kvroute_filter::shared::SnapshotCache::default()
                .current(h)
                .ok()
                .flatten()
                .map(|s| s.version)
        };
        assert_eq!(version(&hb), Some(7));
        assert_eq!(version(&ha), None);
    }

    /// A destroyed config's per-thread worker goes at the thread's next stream.
    #[test]
    fn a_destroyed_configs_worker_goes_at_the_threads_next_stream() {
        let c = config_new(ConfigHandle::for_tests(), b"c", br#"{"mode":"cluster"}"#).unwrap();
        let id = c.0.id;
        assert!(slot(&c.0).is_some());
        let held = || WORKERS.with(|w| w.borrow().contains_key(&id));
        assert!(held());
        sweep_retired();
        assert!(held(), "not destroyed yet");
        drop(c);
        sweep_retired();
        assert!(!held());
    }

    #[test]
    fn shared_data_cas_tokens_follow_proxy_wasm() {
        let mut s = SharedData::default();
        assert_eq!(s.get("k"), (None, None));
        s.set("k", b"a", None).unwrap();
        let (v, cas) = s.get("k");
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        let cas = cas.unwrap();
        assert_ne!(cas, 0);
        // A stale token loses; the current one wins and moves the token on.
        assert_eq!(
            s.set("k", b"b", Some(cas + 100)),
            Err(HostError::CasMismatch)
        );
        s.set("k", b"b", Some(cas)).unwrap();
        assert_eq!(s.set("k", b"c", Some(cas)), Err(HostError::CasMismatch));
        // Token 0 writes unconditionally, as proxy-wasm's.
        s.set("k", b"d", Some(0)).unwrap();
        assert_eq!(s.get("k").0.as_deref(), Some(&b"d"[..]));
        // A first write with a token creates the key.
        s.set("new", b"x", Some(5)).unwrap();
        assert_eq!(s.get("new").0.as_deref(), Some(&b"x"[..]));
    }

    #[test]
    fn the_filter_shared_keys_work_over_this_map() {
        // `kvroute_filter::shared` (snapshot publication, worker numbers) only needs get/set
        // with CAS: run its worker counter twice over a SharedData-backed mock.
        let mut s = SharedData::default();
        let mut next = || -> u32 {
            loop {
                let (v, cas) = s.get("seq");
                let n = v
                    .and_then(|b| String::from_utf8(b).ok())
                    .and_then(|t| t.parse::<u32>().ok())
                    .unwrap_or(0);
                if s.set("seq", (n + 1).to_string().as_bytes(), cas.or(Some(0)))
                    .is_ok()
                {
                    return n;
                }
            }
        };
        assert_eq!(next(), 0);
        assert_eq!(next(), 1);
    }

    #[test]
    fn every_fixed_metric_is_defined_with_its_kind() {
        let m = fixed_metrics();
        assert_eq!(m.len(), metric::fixed().len());
        assert!(m.contains(&(metric::INFLIGHT, Kind::Gauge)));
        assert!(m.contains(&(metric::DECISION_US, Kind::Histogram)));
        assert!(m.contains(&(metric::FAIL_OPEN, Kind::Counter)));
    }
}
