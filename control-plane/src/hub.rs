//! The fleet state shared by the scrape tasks, and the snapshot builder.
//!
//! Scrape tasks write one endpoint's entry each (a short `std::sync::Mutex` section, no
//! `.await` inside) and wake the builder. The builder turns the fleet into a
//! [`kvroute_core::snapshot::Snapshot`] and publishes it on a `tokio::sync::watch` channel,
//! which the push tasks and `GET /v1/snapshot` read; readers always see one whole snapshot.
//!
//! Publishing rules:
//! - on change: when any endpoint's routing fields changed (everything but `scraped_at_ms`;
//!   each scrape compares its endpoint's fields, so no full-fleet diff runs per scrape),
//!   at most once per `push.min_interval_ms` (changes inside the window coalesce);
//! - heartbeat: at least every `push.heartbeat_ms`, so `scraped_at_ms` stays fresh;
//! - the first snapshot waits until every endpoint was tried once, or until
//!   `scrape.timeout + scrape.interval` passed, so a cold start does not publish a fleet
//!   that is all `healthy: false` merely because nothing was scraped yet.
//!
//! Coalescing window for large fleets: the effective minimum gap between two published
//! snapshots is `max(push.min_interval_ms, last snapshot bytes / DECODE_BUDGET_BYTES_PER_SEC)`
//! ([`DECODE_BUDGET_BYTES_PER_SEC`] = 2 MiB/s). Every Envoy worker decodes every published
//! snapshot once (the filter's `SnapshotCache::current` in `filter/src/shared.rs`), and the
//! ingest route decodes it once more to validate it (`filter/src/ingest.rs` `check_body`),
//! so the snapshot byte rate is paid by every worker of every Envoy. A fleet whose every
//! endpoint changes on every scrape would otherwise republish its whole snapshot every
//! `min_interval_ms`. With ~300 bytes per endpoint: 64 endpoints (≈19 KiB) keep the 10 ms
//! default window; 1,000 endpoints (≈300 KiB) get ≈150 ms, i.e. ≈7 pushes/s instead of ≈70.
//!
//! Encoding: each endpoint keeps its wire-form JSON fragment
//! ([`kvroute_core::snapshot::encode_endpoint`]), re-encoded only when that endpoint is
//! recorded (scrape, failure, spec change). A snapshot body is core's envelope around the
//! fragments ([`kvroute_core::snapshot::write_envelope`]) — the functions
//! [`Snapshot::encode`] itself uses, so the bytes are the same (the test
//! `concatenated_body_equals_core_encode` pins this) — and publishing costs one copy of the
//! fragments, not a clone and a JSON encode of the whole fleet.
//!
//! Pools without endpoints: a configured pool (static `pools[]`, or a watched InferencePool)
//! that contributes no endpoint at all (no ready pod: rollout, crash loop, scale from zero)
//! has its models named in the snapshot's `unavailable_models`, so the filter answers a
//! request for them 503 `no_healthy_endpoint` with `retry-after`, which OpenAI clients
//! retry, instead of 404 `model_not_found`, which they do not. A pool's models are those
//! the config names ([`crate::config::Config::pool_models`]) plus those its endpoints listed
//! the last time it had any (remembered by this process only, replaced each time the pool
//! has endpoints again, forgotten when the pool leaves the config), less every model an
//! endpoint of the snapshot lists (such a model is known to the filter already). The list
//! is recomputed when the endpoint set or the pools change ([`Hub::set_endpoints`],
//! [`Hub::set_pools`]), never per scrape. LoRA adapters come from scrapes (vLLM's
//! `lora_requests_info`: those with requests running or waiting); every adapter a pool's
//! endpoints reported since the pool last had none is named with its models when it has
//! none again ([`Hub::record_success`] notes them when an endpoint's list changes).
//!
//! Versions: `max(now in Unix µs, previous + 1)`. The wall clock makes versions grow
//! across control-plane restarts (receivers drop snapshots not newer than theirs); the
//! `+ 1` keeps them growing if the clock steps back while running.

use crate::adapters::ServerStats;
use crate::config::EndpointSpec;
use crate::restart::RestartTracker;
use crate::scrape::FailureClass;
use crate::telemetry::{EndpointLabel, StateLabel, Telemetry};
use bytes::Bytes;
use kvroute_core::peer::{peer_load_for, write_peer_fields, GatewayReport};
use kvroute_core::snapshot::{
    encode_endpoint, write_envelope, EndpointStats, Snapshot, SnapshotError,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{watch, Notify};

/// Unix time now, milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

type RoutingKey = (
    Option<u64>,
    Option<u64>,
    Option<u32>,
    (u32, u32),
    Vec<String>,
    bool,
    Option<u64>,
);

/// One endpoint as the control plane knows it.
#[derive(Debug, Clone)]
pub struct EndpointState {
    /// Where and what it is.
    pub spec: EndpointSpec,
    /// Stats from the last successful scrape (kept, flagged unhealthy, after a failure).
    pub stats: Option<ServerStats>,
    /// Up: not marked down (see [`Hub::record_failure`]). A timed-out scrape leaves it
    /// as it was; the stats are then stale.
    pub healthy: bool,
    /// Connection failures in a row ([`DOWN_AFTER_UNREACHABLE`] mark the endpoint down).
    pub unreachable_in_row: u32,
    /// Unix ms of the last successful scrape; 0 before the first.
    pub scraped_at_ms: u64,
    /// At least one scrape finished (either way).
    pub attempted: bool,
    /// Last scrape error, for logs and `/v1/snapshot` debugging.
    pub last_error: Option<String>,
    /// Restart detection.
    pub restart: RestartTracker,
    /// `serde_json` encoding of [`Self::to_wire`], kept current by every change.
    wire_json: Vec<u8>,
}

/// Connection failures in a row that mark an up endpoint down (2: one refused connect can
/// be a restart racing the scrape; two in a row, one scrape interval apart, mean the
/// server is gone, so no new request goes to a killed backend after two intervals).
pub const DOWN_AFTER_UNREACHABLE: u32 = 2;

/// Snapshot bytes each Envoy worker is asked to decode per second, at most (see the module
/// docs): the coalescing window grows to `snapshot bytes / this`. 2 MiB/s is a few per cent
/// of one core for `serde_json` decoding (hundreds of MB/s natively; Wasm is a few times
/// slower).
pub const DECODE_BUDGET_BYTES_PER_SEC: f64 = 2.0 * 1024.0 * 1024.0;

/// The coalescing window for a snapshot of `body_len` bytes: `max(min_interval,
/// body_len / DECODE_BUDGET_BYTES_PER_SEC)`.
pub fn coalesce_window(min_interval: Duration, body_len: usize) -> Duration {
    min_interval.max(Duration::from_secs_f64(
        body_len as f64 / DECODE_BUDGET_BYTES_PER_SEC,
    ))
}

impl EndpointState {
    fn new(spec: EndpointSpec) -> Self {
        Self {
            spec,
            stats: None,
            healthy: false,
            unreachable_in_row: 0,
            scraped_at_ms: 0,
            attempted: false,
            last_error: None,
            restart: RestartTracker::default(),
            wire_json: Vec::new(),
        }
        .encoded()
    }

    fn encoded(mut self) -> Self {
        self.reencode();
        self
    }

    /// Refresh the cached wire fragment (core's [`encode_endpoint`]).
    ///
    /// Last line of defence: the endpoint is checked with core's endpoint validation
    /// ([`EndpointStats::validate`]) first. Every Envoy rejects a whole snapshot when one endpoint is
    /// invalid, so an endpoint whose scraped stats fail (an adapter bug, a server sending values no
    /// adapter anticipated) is sent as unhealthy without stats instead of blocking the fleet;
    /// one that fails even so (its spec: discovery and config check every spec field, so
    /// this is a defect) is left out of the snapshot, its fragment empty, and logged.
    fn reencode(&mut self) {
        let mut wire = self.to_wire();
        if let Err((field, reason)) = wire.validate() {
            let e = SnapshotError::InvalidEndpoint {
                index: 0,
                id: wire.id.clone(),
                field,
                reason,
            };
            tracing::warn!(
                endpoint = %self.spec.id,
                error = %e,
                "scraped stats fail snapshot validation; sending the endpoint as unhealthy without stats"
            );
            self.stats = None;
            self.healthy = false;
            self.last_error = Some(format!("invalid stats: {e}"));
            wire = self.to_wire();
            if let Err((field, reason)) = wire.validate() {
                tracing::error!(
                    endpoint = %self.spec.id,
                    field,
                    reason,
                    "endpoint fails snapshot validation without stats; left out of the snapshot"
                );
                self.wire_json.clear();
                return;
            }
        }
        // Reuses the fragment's allocation.
        self.wire_json.clear();
        encode_endpoint(&wire, &mut self.wire_json);
    }

    /// The LoRA adapters of the last successful scrape.
    fn adapters(&self) -> &[String] {
        self.stats.as_ref().map_or(&[], |s| &s.lora_adapters)
    }

    /// The fields a routing decision reads (everything on the wire but `scraped_at_ms`).
    fn routing_key(&self) -> RoutingKey {
        let s = self.stats.as_ref();
        (
            s.and_then(|s| s.kv_usage).map(f64::to_bits),
            s.and_then(|s| s.kv_capacity_tokens),
            s.and_then(|s| s.block_size),
            s.map_or((0, 0), |s| (s.running, s.waiting)),
            s.map(|s| s.lora_adapters.clone()).unwrap_or_default(),
            self.healthy,
            self.restart.process_start_ms(),
        )
    }

    /// The wire form.
    pub fn to_wire(&self) -> EndpointStats {
        let s = self.stats.as_ref();
        EndpointStats {
            id: self.spec.id.clone(),
            address: self.spec.address.clone(),
            cluster: self.spec.cluster.clone(),
            pool: self.spec.pool.clone(),
            models: self.spec.models.clone(),
            lora_adapters: s.map(|s| s.lora_adapters.clone()).unwrap_or_default(),
            kv_usage: s.and_then(|s| s.kv_usage),
            kv_capacity_tokens: s.and_then(|s| s.kv_capacity_tokens),
            block_size: s.and_then(|s| s.block_size),
            running: s.map_or(0, |s| s.running),
            waiting: s.map_or(0, |s| s.waiting),
            healthy: self.healthy,
            scraped_at_ms: self.scraped_at_ms,
            process_start_ms: self.restart.process_start_ms(),
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        }
    }
}

/// The configured pools and the models the snapshot names for those without endpoints
/// (see the module docs).
#[derive(Debug, Default)]
struct Pools {
    /// Pool name → its models.
    by_name: BTreeMap<String, PoolModels>,
    /// The snapshot's `unavailable_models`: sorted, unique.
    unavailable: Vec<String>,
}

/// What the hub knows of one pool's models.
#[derive(Debug, Default)]
struct PoolModels {
    /// From the config (empty for an InferencePool that reads its pods' `/v1/models`).
    configured: Vec<String>,
    /// Every model the pool's endpoints listed the last time it had endpoints (that listed
    /// any model).
    last_listed: BTreeSet<String>,
    /// Every LoRA adapter the pool's endpoints reported since it last had no endpoint.
    adapters: BTreeSet<String>,
    /// The pool had no endpoint at the last [`Pools::refresh`].
    empty: bool,
}

impl Pools {
    /// Remember `adapters`, reported by an endpoint of pool `pool` (if configured).
    fn note_adapters(&mut self, pool: &str, adapters: &[String]) {
        if let Some(p) = self.by_name.get_mut(pool) {
            p.adapters.extend(adapters.iter().cloned());
        }
    }

    /// Remember what each pool's endpoints in `fleet` list and recompute
    /// [`Self::unavailable`]; returns whether it changed.
    fn refresh(&mut self, fleet: &BTreeMap<String, EndpointState>) -> bool {
        if self.by_name.is_empty() && self.unavailable.is_empty() {
            return false;
        }
        let mut by_pool: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        let mut listed: BTreeSet<&str> = BTreeSet::new();
        for st in fleet.values() {
            let models = st.spec.models.iter().map(String::as_str);
            by_pool
                .entry(st.spec.pool.as_str())
                .or_default()
                .extend(models.clone());
            listed.extend(models);
            listed.extend(st.adapters().iter().map(String::as_str));
        }
        let mut unavailable = BTreeSet::new();
        for (name, pool) in &mut self.by_name {
            match by_pool.get(name.as_str()) {
                Some(models) => {
                    if !models.is_empty() {
                        pool.last_listed = models.iter().map(|m| (*m).to_owned()).collect();
                    }
                    if pool.empty {
                        // Back: its adapters are counted afresh from its scrapes.
                        pool.adapters.clear();
                        pool.empty = false;
                    }
                }
                None => {
                    pool.empty = true;
                    unavailable.extend(
                        pool.configured
                            .iter()
                            .chain(&pool.last_listed)
                            .chain(&pool.adapters)
                            .filter(|m| !listed.contains(m.as_str()))
                            .cloned(),
                    );
                }
            }
        }
        let unavailable: Vec<String> = unavailable.into_iter().collect();
        if unavailable == self.unavailable {
            return false;
        }
        tracing::info!(
            models = ?unavailable,
            "models of pools without endpoints (answered 503 no_healthy_endpoint) changed"
        );
        self.unavailable = unavailable;
        true
    }
}

/// Endpoints by state ([`Hub::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Up, last scrape succeeded.
    pub healthy: i64,
    /// Up, but the last scrape failed (timed out): stats are aging.
    pub stale: i64,
    /// Down.
    pub unhealthy: i64,
    /// Not scraped yet.
    pub pending: i64,
}

/// A published snapshot.
#[derive(Debug, Clone)]
pub struct Published {
    /// Snapshot version.
    pub version: u64,
    /// When it was built, Unix ms.
    pub generated_at_ms: u64,
    /// Its wire encoding ([`Snapshot::encode`]'s bytes).
    pub body: Bytes,
    /// When the earliest scrape folded into it finished (`None` for heartbeats without a
    /// change); the push tasks measure scrape-to-push latency from it.
    pub changed_at: Option<Instant>,
    /// The gateways' in-flight reports at build time (empty when no gateway is read), and
    /// where each endpoint's fragment lies in [`Self::body`]: [`Self::body_for`] builds
    /// each gateway's own body from them.
    peers: Arc<BTreeMap<String, GatewayReport>>,
    fragments: Vec<FragmentAt>,
}

/// One endpoint's fragment within a published body.
#[derive(Debug, Clone)]
struct FragmentAt {
    id: String,
    scraped_at_ms: u64,
    start: usize,
    end: usize,
}

impl Published {
    /// The snapshot, decoded from [`Self::body`] (debugging and tests; the push path sends
    /// the bytes). Errors: [`SnapshotError`] only if the body were not a valid snapshot.
    pub fn snapshot(&self) -> Result<Snapshot, SnapshotError> {
        Snapshot::decode(&self.body)
    }

    /// The body for gateway `target`: [`Self::body`] with the *other* gateways' in-flight
    /// load ([`kvroute_core::peer::peer_load_for`], reports older than `stale_after` at build
    /// time left out) set as each endpoint's `peer_inflight_requests` /
    /// `peer_inflight_tokens`. The same bytes as `body` when there is no such load.
    pub fn body_for(&self, target: &str, stale_after: Duration) -> Bytes {
        if self.peers.is_empty() {
            return self.body.clone();
        }
        let scraped: BTreeMap<&str, u64> = self
            .fragments
            .iter()
            .map(|f| (f.id.as_str(), f.scraped_at_ms))
            .collect();
        let load = peer_load_for(
            &self.peers,
            target,
            self.generated_at_ms,
            u64::try_from(stale_after.as_millis()).unwrap_or(u64::MAX),
            |id| scraped.get(id).copied(),
        );
        if load.is_empty() {
            return self.body.clone();
        }
        let mut out = Vec::with_capacity(self.body.len() + 48 * load.len());
        let mut at = 0;
        for f in &self.fragments {
            let Some(l) = load.get(&f.id) else { continue };
            let (Some(before), Some(frag)) =
                (self.body.get(at..f.start), self.body.get(f.start..f.end))
            else {
                return self.body.clone();
            };
            out.extend_from_slice(before);
            write_peer_fields(frag, *l, &mut out);
            at = f.end;
        }
        out.extend_from_slice(self.body.get(at..).unwrap_or_default());
        Bytes::from(out)
    }
}

/// Shared state.
pub struct Hub {
    fleet: Mutex<BTreeMap<String, EndpointState>>,
    /// Locked after `fleet` when both are held.
    pools: Mutex<Pools>,
    pending_since: Mutex<Option<Instant>>,
    timing: Mutex<(Duration, Duration, Duration)>,
    changed: Notify,
    dirty: AtomicBool,
    published: watch::Sender<Option<Arc<Published>>>,
    last_version: Mutex<u64>,
    last_body_len: AtomicUsize,
    /// Targets rejecting the ingest token, with why. Only configured targets
    /// (`push_targets`) are ever in it.
    push_rejected: Mutex<BTreeMap<String, String>>,
    /// The configured push targets' names ([`Hub::retain_push_targets`]). Locked before
    /// `push_rejected` when both are held.
    push_targets: Mutex<BTreeSet<String>>,
    /// Each read gateway's last in-flight report, by target name ([`crate::peers`]).
    gateway_reports: Mutex<BTreeMap<String, GatewayReport>>,
    /// Own metrics.
    pub telemetry: Telemetry,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these maps half-written in a way that
    // matters more than stopping routing updates; keep serving the data.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Hub {
    /// New hub. `heartbeat`, `min_interval`: push timing; `first_wait`: how long the first
    /// snapshot waits for every endpoint to be tried.
    pub fn new(heartbeat: Duration, min_interval: Duration, first_wait: Duration) -> Arc<Self> {
        let (published, _) = watch::channel(None);
        Arc::new(Self {
            fleet: Mutex::new(BTreeMap::new()),
            pools: Mutex::new(Pools::default()),
            pending_since: Mutex::new(None),
            timing: Mutex::new((heartbeat, min_interval, first_wait)),
            changed: Notify::new(),
            dirty: AtomicBool::new(true),
            published,
            last_version: Mutex::new(0),
            last_body_len: AtomicUsize::new(0),
            push_rejected: Mutex::new(BTreeMap::new()),
            push_targets: Mutex::new(BTreeSet::new()),
            gateway_reports: Mutex::new(BTreeMap::new()),
            telemetry: Telemetry::new(),
        })
    }

    /// Change push timing (config reload).
    pub fn set_timing(&self, heartbeat: Duration, min_interval: Duration, first_wait: Duration) {
        *lock(&self.timing) = (heartbeat, min_interval, first_wait);
        self.changed.notify_one();
    }

    /// Replace the endpoint set: new ids start pending, removed ids go, changed specs restart
    /// from pending. Returns nothing; wakes the builder.
    pub fn set_endpoints(&self, specs: &[EndpointSpec]) {
        let mut fleet = lock(&self.fleet);
        let mut gone = Vec::new();
        // By id: a scan of `specs` per endpoint took 8,000 discovered pods to a whole core
        // (found by a breaker, 2026-12-05).
        let by_id: std::collections::HashMap<&str, &EndpointSpec> =
            specs.iter().map(|s| (s.id.as_str(), s)).collect();
        fleet.retain(|id, st| {
            let keep = by_id.get(id.as_str()).is_some_and(|s| **s == st.spec);
            if !keep {
                gone.push(id.clone());
            }
            keep
        });
        for s in specs {
            fleet
                .entry(s.id.clone())
                .or_insert_with(|| EndpointState::new(s.clone()));
        }
        lock(&self.pools).refresh(&fleet);
        // Under the fleet lock, as `scrape_error` counts: a scrape that finishes after its
        // endpoint left cannot bring a series back.
        for id in gone {
            self.telemetry.forget_endpoint(&id);
        }
        drop(fleet);
        self.mark_dirty();
    }

    /// Count one scrape error of endpoint `id` with label `reason`
    /// ([`Telemetry::scrape_error`]), only while `id` is in the fleet. Counted under the
    /// fleet lock that [`Self::set_endpoints`] drops a departed endpoint's series under, so
    /// a scrape finishing after its endpoint left never re-creates a series for it (which
    /// would then stay in `/metrics` for good).
    pub fn scrape_error(&self, id: &str, reason: &str) {
        let fleet = lock(&self.fleet);
        if fleet.contains_key(id) {
            self.telemetry.scrape_error(id, reason);
        }
    }

    /// Replace the configured pools: name → the models the config names for it
    /// ([`crate::config::Config::pool_models`]). Pools no longer configured are forgotten
    /// with the models their endpoints listed. Republishes when the snapshot's
    /// `unavailable_models` change (see the module docs).
    pub fn set_pools(&self, pools: &BTreeMap<String, Vec<String>>) {
        let fleet = lock(&self.fleet);
        let changed = {
            let mut p = lock(&self.pools);
            p.by_name.retain(|name, _| pools.contains_key(name));
            for (name, models) in pools {
                p.by_name.entry(name.clone()).or_default().configured = models.clone();
            }
            p.refresh(&fleet)
        };
        drop(fleet);
        if changed {
            self.mark_dirty();
        }
    }

    /// The models the next snapshot names in `unavailable_models`: those of configured
    /// pools without endpoints that no endpoint lists (sorted; see the module docs).
    pub fn unavailable_models(&self) -> Vec<String> {
        lock(&self.pools).unavailable.clone()
    }

    /// A routing field changed: note when (for scrape-to-push latency) and wake the builder.
    fn mark_dirty(&self) {
        {
            let mut p = lock(&self.pending_since);
            if p.is_none() {
                *p = Some(Instant::now());
            }
        }
        self.dirty.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    /// Record a successful scrape of `id` taken at `at_ms`.
    pub fn record_success(&self, id: &str, stats: ServerStats, at_ms: u64) {
        let (restarted, changed) = {
            let mut fleet = lock(&self.fleet);
            let Some(st) = fleet.get_mut(id) else { return };
            let before = st.routing_key();
            let first = !st.attempted;
            let restarted = st.restart.observe(&stats, at_ms);
            if st.adapters() != stats.lora_adapters.as_slice() && !stats.lora_adapters.is_empty() {
                // Lock order: fleet, then pools (as `set_endpoints`).
                lock(&self.pools).note_adapters(&st.spec.pool, &stats.lora_adapters);
            }
            st.stats = Some(stats);
            st.healthy = true;
            st.unreachable_in_row = 0;
            st.attempted = true;
            st.scraped_at_ms = at_ms;
            st.last_error = None;
            st.reencode();
            (restarted, first || st.routing_key() != before)
        };
        if restarted {
            tracing::info!(
                endpoint = id,
                "model server restarted; its prefix state is cold"
            );
            self.telemetry
                .restarts
                .get_or_create(&EndpointLabel {
                    endpoint: id.to_owned(),
                })
                .inc();
        }
        if changed {
            self.mark_dirty();
        }
    }

    /// Record a failed scrape of `id`, of class `class` (see [`crate::scrape`]):
    /// - [`FailureClass::Stale`] (timed out): reachable, so up; stats and `scraped_at_ms`
    ///   are kept, so the picker sees them age into staleness;
    /// - [`FailureClass::Unreachable`]: down once [`DOWN_AFTER_UNREACHABLE`] happened in a
    ///   row (an endpoint never seen up stays down);
    /// - [`FailureClass::NotReady`]: down at once.
    ///
    /// Stats from the last success are kept in every case.
    pub fn record_failure(&self, id: &str, class: FailureClass, error: String) {
        let changed = {
            let mut fleet = lock(&self.fleet);
            let Some(st) = fleet.get_mut(id) else { return };
            let was = (st.healthy, st.attempted);
            match class {
                FailureClass::Stale => {
                    st.healthy = true;
                    st.unreachable_in_row = 0;
                }
                FailureClass::Unreachable => {
                    st.unreachable_in_row = st.unreachable_in_row.saturating_add(1);
                    if st.unreachable_in_row >= DOWN_AFTER_UNREACHABLE {
                        st.healthy = false;
                    }
                }
                FailureClass::NotReady => {
                    st.unreachable_in_row = 0;
                    st.healthy = false;
                }
            }
            st.attempted = true;
            let changed = was != (st.healthy, true);
            st.last_error = Some(error);
            if changed {
                st.reencode();
            }
            changed
        };
        if changed {
            self.mark_dirty();
        } else {
            // Still wakes the builder's first-round wait.
            self.changed.notify_one();
        }
    }

    /// Store gateway `target`'s in-flight report. A change of its load (not of its read
    /// time alone) publishes a new snapshot, coalesced like any change.
    pub fn record_gateway_report(&self, target: &str, report: GatewayReport) {
        let changed = {
            // Only configured targets' reports count: a stats reader of a removed target is
            // aborted, not awaited, and one mid-read could otherwise record after its
            // report was forgotten, sharing a gone gateway's load until it went stale.
            // Locked in the order `push_targets`, then the reports.
            let targets = lock(&self.push_targets);
            if !targets.contains(target) {
                return;
            }
            let mut m = lock(&self.gateway_reports);
            let changed = m.get(target).is_none_or(|r| r.load != report.load);
            m.insert(target.to_owned(), report);
            changed
        };
        if changed {
            self.mark_dirty();
        }
    }

    /// Forget gateway `target`'s report (its push task stopped); republishes if it had load.
    pub fn forget_gateway(&self, target: &str) {
        let had_load = lock(&self.gateway_reports)
            .remove(target)
            .is_some_and(|r| r.load.values().any(|l| !l.is_zero()));
        if had_load {
            self.mark_dirty();
        }
    }

    /// The ids of the current fleet (what a gateway's per-endpoint gauges can name).
    pub fn endpoint_ids(&self) -> Vec<String> {
        lock(&self.fleet).keys().cloned().collect()
    }

    /// A copy of one endpoint's state.
    pub fn endpoint(&self, id: &str) -> Option<EndpointState> {
        lock(&self.fleet).get(id).cloned()
    }

    /// Endpoints the next snapshot sends with `healthy: true` (not marked down; their stats
    /// may be stale), without building the wire form.
    pub fn up_count(&self) -> usize {
        lock(&self.fleet).values().filter(|s| s.healthy).count()
    }

    /// Every endpoint in wire form, sorted by id.
    pub fn wire_endpoints(&self) -> Vec<EndpointStats> {
        lock(&self.fleet)
            .values()
            .map(EndpointState::to_wire)
            .collect()
    }

    /// Whether every endpoint finished one scrape.
    pub fn all_attempted(&self) -> bool {
        lock(&self.fleet).values().all(|s| s.attempted)
    }

    /// Endpoint counts by state.
    pub fn counts(&self) -> Counts {
        let fleet = lock(&self.fleet);
        let mut c = Counts::default();
        for s in fleet.values() {
            if !s.attempted {
                c.pending += 1;
            } else if !s.healthy {
                c.unhealthy += 1;
            } else if s.last_error.is_some() {
                c.stale += 1;
            } else {
                c.healthy += 1;
            }
        }
        c
    }

    /// The latest published snapshot.
    pub fn latest(&self) -> Option<Arc<Published>> {
        self.published.borrow().clone()
    }

    /// Subscribe to published snapshots.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Published>>> {
        self.published.subscribe()
    }

    /// Ready: a snapshot was published and no target refuses the pushes as misconfigured
    /// (the ingest token rejected, or a 404: not the ingest listener).
    pub fn ready(&self) -> bool {
        self.not_ready_reason().is_none()
    }

    /// Why `/readyz` answers 503, or `None` when ready.
    pub fn not_ready_reason(&self) -> Option<String> {
        if self.published.borrow().is_none() {
            let pending = self.counts().pending;
            return Some(format!("no snapshot yet ({pending} endpoints not scraped)"));
        }
        let rejected = lock(&self.push_rejected);
        let (target, why) = rejected.iter().next()?;
        Some(format!("pushes to target `{target}` are rejected: {why}"))
    }

    /// Note that target `target` refuses the pushes as misconfigured (`Some(why)`: the
    /// ingest token rejected, or a 404) or accepted a push (`None`). Any rejection makes
    /// `/readyz` answer 503. A rejection for a target that is
    /// not configured ([`Hub::retain_push_targets`]) is ignored: a push still in flight when
    /// its target was removed by a reload must not hold `/readyz` at 503 for a target no
    /// reload would ever clear.
    pub fn set_push_rejected(&self, target: &str, why: Option<String>) {
        // Held across the insert, so a reload removing `target` cannot slip in between
        // the membership check and the insert.
        let targets = lock(&self.push_targets);
        let mut m = lock(&self.push_rejected);
        match why {
            Some(w) if targets.contains(target) => {
                m.insert(target.to_owned(), w);
            }
            Some(_) => {}
            None => {
                m.remove(target);
            }
        }
    }

    /// Set the configured push targets' names (start, reload) and forget the rejections of
    /// targets no longer among them.
    pub fn retain_push_targets(&self, names: &[&str]) {
        let mut targets = lock(&self.push_targets);
        *targets = names.iter().map(|n| (*n).to_owned()).collect();
        lock(&self.push_rejected).retain(|t, _| targets.contains(t));
    }

    /// Refresh the gauges computed on read (snapshot age, endpoints by state).
    pub fn refresh_gauges(&self) {
        let t = &self.telemetry;
        if let Some(p) = self.latest() {
            let age = now_ms().saturating_sub(p.generated_at_ms) as f64 / 1000.0;
            t.snapshot_age.set(age);
            t.snapshot_version
                .set(i64::try_from(p.version).unwrap_or(i64::MAX));
        }
        let c = self.counts();
        for (state, n) in [
            ("healthy", c.healthy),
            ("stale", c.stale),
            ("unhealthy", c.unhealthy),
            ("pending", c.pending),
        ] {
            t.endpoints
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .set(n);
        }
    }

    /// Build and publish a snapshot of the current fleet now.
    pub fn publish(&self) -> Arc<Published> {
        let changed_at = lock(&self.pending_since).take();
        let version = {
            let mut last = lock(&self.last_version);
            let v = now_us().max(last.saturating_add(1));
            *last = v;
            v
        };
        let generated_at_ms = now_ms();
        let mut body = Vec::with_capacity(self.last_body_len.load(Ordering::Relaxed) + 64);
        let peers: BTreeMap<String, GatewayReport> = lock(&self.gateway_reports)
            .iter()
            .filter(|(_, r)| r.load.values().any(|l| !l.is_zero()))
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        let mut fragments = Vec::new();
        {
            let fleet = lock(&self.fleet);
            // An empty fragment is an endpoint left out ([`EndpointState::reencode`]).
            let sent = || fleet.values().filter(|st| !st.wire_json.is_empty());
            write_envelope(
                &mut body,
                version,
                generated_at_ms,
                &lock(&self.pools).unavailable,
                sent().map(|st| st.wire_json.as_slice()),
            );
            if !peers.is_empty() {
                // Locate each fragment: the envelope writes them in order, comma-separated,
                // in the `"endpoints":[...]` array that ends the body (before its `]}`).
                let mut at = body.len()
                    - 2
                    - sent().map(|st| st.wire_json.len()).sum::<usize>()
                    - sent().count().saturating_sub(1);
                for st in sent() {
                    let end = at + st.wire_json.len();
                    fragments.push(FragmentAt {
                        id: st.spec.id.clone(),
                        scraped_at_ms: st.scraped_at_ms,
                        start: at,
                        end,
                    });
                    at = end + 1;
                }
            }
        }
        self.last_body_len.store(body.len(), Ordering::Relaxed);
        let p = Arc::new(Published {
            version,
            generated_at_ms,
            body: Bytes::from(body),
            changed_at,
            peers: Arc::new(peers),
            fragments,
        });
        self.published.send_replace(Some(p.clone()));
        p
    }

    /// The builder loop (see the module docs). Ends when `shutdown` turns true.
    pub async fn run_builder(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let started = Instant::now();
        // Wait for the first round.
        loop {
            let first_wait = lock(&self.timing).2;
            if self.all_attempted() || started.elapsed() >= first_wait {
                break;
            }
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = tokio::time::sleep_until((started + first_wait).into()) => {}
                _ = shutdown.changed() => return,
            }
        }
        let mut last_publish: Option<Instant> = None;
        loop {
            let (heartbeat, min_interval, _) = *lock(&self.timing);
            let min_interval =
                coalesce_window(min_interval, self.last_body_len.load(Ordering::Relaxed));
            if let Some(lp) = last_publish {
                let since = lp.elapsed();
                if since < min_interval {
                    tokio::select! {
                        _ = tokio::time::sleep(min_interval - since) => {}
                        _ = shutdown.changed() => return,
                    }
                }
            }
            // Swap before building: a change recorded after this point sets the flag again
            // and leaves a Notify permit, so it is never lost.
            let dirty = self.dirty.swap(false, Ordering::AcqRel);
            let heartbeat_due = last_publish.is_none_or(|lp| lp.elapsed() >= heartbeat);
            if dirty || heartbeat_due {
                self.publish();
                last_publish = Some(Instant::now());
            }
            let next_heartbeat = last_publish.map_or_else(Instant::now, |lp| lp + heartbeat);
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = tokio::time::sleep_until(next_heartbeat.into()) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::ServerKind;

    /// A rejection recorded for a target that is not configured (any more) is ignored, and
    /// one of a configured target is cleared when a reload removes it.
    #[test]
    fn rejections_count_only_for_configured_targets() {
        let hub = Hub::new(Duration::from_secs(1), Duration::ZERO, Duration::ZERO);
        hub.publish();
        hub.retain_push_targets(&["a"]);
        hub.set_push_rejected("b", Some("HTTP 401".into()));
        assert_eq!(hub.not_ready_reason(), None);
        hub.set_push_rejected("a", Some("HTTP 401".into()));
        assert_eq!(
            hub.not_ready_reason().as_deref(),
            Some("pushes to target `a` are rejected: HTTP 401")
        );
        hub.retain_push_targets(&["b"]);
        assert_eq!(hub.not_ready_reason(), None);
    }

    /// A scrape error counted after its endpoint left adds no series; one counted while it
    /// is in the fleet does, and leaves with it.
    #[test]
    fn a_departed_endpoints_late_scrape_error_is_not_counted() {
        let hub = Hub::new(Duration::from_secs(1), Duration::ZERO, Duration::ZERO);
        let series = |hub: &Hub| {
            hub.telemetry
                .encode()
                .lines()
                .filter(|l| l.starts_with("kvroute_cp_scrape_errors_total{"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        hub.set_endpoints(&[spec("a")]);
        hub.scrape_error("p/a", "timeout");
        assert_eq!(
            series(&hub),
            ["kvroute_cp_scrape_errors_total{endpoint=\"p/a\",reason=\"timeout\"} 1"]
        );
        hub.set_endpoints(&[]);
        assert!(series(&hub).is_empty());
        hub.scrape_error("p/a", "timeout");
        assert!(series(&hub).is_empty(), "{:?}", series(&hub));
    }

    fn spec(name: &str) -> EndpointSpec {
        EndpointSpec {
            id: format!("p/{name}"),
            pool: "p".into(),
            address: "10.0.0.1:8000".into(),
            metrics_url: http::Uri::from_static("http://10.0.0.1:8000/metrics"),
            slots_url: None,
            cluster: "c\"q".into(),
            kind: ServerKind::Vllm,
            models: vec!["m/é".into()],
        }
    }

    fn stats(kv: f64, running: u32, lora: &[&str]) -> ServerStats {
        ServerStats {
            kind: ServerKind::Vllm,
            kv_usage: Some(kv),
            kv_capacity_tokens: Some(1_000_000),
            block_size: Some(16),
            running,
            waiting: 2,
            lora_adapters: lora.iter().map(|s| (*s).to_owned()).collect(),
            process_start_ms: Some(1_700_000_000_000),
            monotonic_total: Some(5.0),
        }
    }

    /// What `Snapshot::encode` writes for the hub's current fleet at `p`'s version/time.
    fn core_encode(hub: &Hub, p: &Published) -> Vec<u8> {
        let mut snap = Snapshot::new(p.version, p.generated_at_ms, hub.wire_endpoints());
        snap.unavailable_models = hub.unavailable_models();
        snap.encode()
    }

    #[test]
    fn concatenated_body_equals_core_encode() {
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        // Empty fleet.
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        assert_eq!(
            p.body.as_ref(),
            format!(
                "{{\"format\":1,\"version\":{},\"generated_at_ms\":{},\"endpoints\":[]}}",
                p.version, p.generated_at_ms
            )
            .as_bytes()
        );
        hub.set_endpoints(&[spec("a"), spec("b"), spec("c")]);
        // All pending.
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        // Partial updates: one success, one failure after success, one untouched.
        hub.record_success("p/a", stats(0.25, 3, &["x", "y"]), 1_000);
        hub.record_success("p/b", stats(0.5, 1, &[]), 1_001);
        hub.record_failure("p/b", FailureClass::NotReady, "boom".into());
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        let snap = p.snapshot().unwrap();
        assert_eq!(snap.endpoints.len(), 3);
        assert_eq!(snap.endpoints[0].kv_usage, Some(0.25));
        assert_eq!(snap.endpoints[0].lora_adapters, vec!["x", "y"]);
        assert!(!snap.endpoints[1].healthy);
        assert_eq!(snap.endpoints[1].scraped_at_ms, 1_001);
        assert_eq!(snap.endpoints[2].scraped_at_ms, 0);
        // Only `a` changes again, including a value serde writes specially.
        hub.record_success("p/a", stats(1.0 / 3.0, 4, &[]), 2_000);
        hub.record_success("p/c", stats(0.0, 0, &["z"]), 2_001);
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        // Spec change and removal.
        let mut b2 = spec("b");
        b2.address = "10.0.0.2:8000".into();
        hub.set_endpoints(&[spec("a"), b2]);
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        let snap = p.snapshot().unwrap();
        assert_eq!(snap.endpoints.len(), 2);
        assert_eq!(snap.endpoints[1].address, "10.0.0.2:8000");
        assert!(!snap.endpoints[1].healthy);
    }

    #[test]
    fn endpoint_with_invalid_stats_is_sent_unhealthy_without_blocking_the_fleet() {
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        hub.set_endpoints(&[spec("a"), spec("b")]);
        hub.record_success("p/a", stats(0.25, 3, &[]), 1_000);
        // Values `Snapshot::validate` rejects: usage above 1, a LoRA name with a newline
        // (validation reports the first in field order: the string checks come first).
        hub.record_success("p/b", stats(1.5, 1, &["bad\nname"]), 1_001);
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        let snap = p.snapshot().unwrap();
        assert_eq!(snap.endpoints[0].kv_usage, Some(0.25));
        assert!(snap.endpoints[0].healthy);
        assert_eq!(snap.endpoints[1].id, "p/b");
        assert!(!snap.endpoints[1].healthy);
        assert_eq!(snap.endpoints[1].kv_usage, None);
        assert!(snap.endpoints[1].lora_adapters.is_empty());
        let err = hub.endpoint("p/b").unwrap().last_error.unwrap();
        assert!(
            err.starts_with(
                "invalid stats: endpoint 0 (`p/b`): field `lora_adapters` contains a control character"
            ),
            "{err}"
        );
    }

    /// An endpoint whose spec fails the filter's validation (an address that is not
    /// `host:port`) is left out of the snapshot, which every filter would otherwise reject
    /// whole; the others go out, also with peer load stamped into their fragments.
    #[test]
    fn an_endpoint_the_filter_would_refuse_is_left_out() {
        use kvroute_core::peer::PeerLoad;
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        let mut bad = spec("bad");
        bad.address = "10.0.0.1/x:8000".into();
        hub.set_endpoints(&[spec("a"), bad, spec("c")]);
        let t0 = now_ms();
        for id in ["p/a", "p/bad", "p/c"] {
            hub.record_success(id, stats(0.25, 1, &[]), t0 - 500);
        }
        let ids = |body: &Bytes| -> Vec<String> {
            Snapshot::decode(body)
                .unwrap()
                .endpoints
                .into_iter()
                .map(|e| e.id)
                .collect()
        };
        let p = hub.publish();
        assert_eq!(ids(&p.body), ["p/a", "p/c"]);
        hub.retain_push_targets(&["gw-1", "gw-2"]);
        hub.record_gateway_report(
            "gw-2",
            GatewayReport {
                read_at_ms: t0 - 100,
                load: [(
                    "p/c".to_owned(),
                    PeerLoad {
                        requests: 3,
                        tokens: 30,
                    },
                )]
                .into(),
            },
        );
        let p = hub.publish();
        let body = p.body_for("gw-1", Duration::from_secs(60));
        assert_eq!(ids(&body), ["p/a", "p/c"]);
        let snap = Snapshot::decode(&body).unwrap();
        assert_eq!(snap.endpoints[1].peer_inflight_requests, 3);
    }

    #[test]
    fn each_gateway_gets_the_other_gateways_load() {
        use kvroute_core::peer::PeerLoad;
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        hub.set_endpoints(&[spec("a"), spec("b"), spec("c")]);
        let t0 = now_ms();
        for (id, at) in [("p/a", t0 - 500), ("p/b", t0 - 500), ("p/c", t0 - 500)] {
            hub.record_success(id, stats(0.25, 1, &[]), at);
        }
        // Read 100 ms before t0: strictly older than any publish from here on, so the
        // zero staleness bound below drops it however fast this test runs.
        let report = |r: &[(&str, u32, u64)]| GatewayReport {
            read_at_ms: t0 - 100,
            load: r
                .iter()
                .map(|(e, q, t)| {
                    (
                        (*e).to_owned(),
                        PeerLoad {
                            requests: *q,
                            tokens: *t,
                        },
                    )
                })
                .collect(),
        };
        // A report of a target that is not configured is not kept.
        hub.record_gateway_report("gw-1", report(&[("p/a", 2, 1_000)]));
        assert!(lock(&hub.gateway_reports).is_empty());
        hub.retain_push_targets(&["gw-1", "gw-2"]);
        hub.record_gateway_report("gw-1", report(&[("p/a", 2, 1_000)]));
        hub.record_gateway_report("gw-2", report(&[("p/a", 1, 10), ("p/c", 3, 30)]));
        let p = hub.publish();
        let stale = Duration::from_secs(2);
        let for_1 = Snapshot::decode(&p.body_for("gw-1", stale)).unwrap();
        let for_2 = Snapshot::decode(&p.body_for("gw-2", stale)).unwrap();
        let for_3 = Snapshot::decode(&p.body_for("gw-3", stale)).unwrap();
        let peer = |s: &Snapshot| -> Vec<(u32, u64)> {
            s.endpoints
                .iter()
                .map(|e| (e.peer_inflight_requests, e.peer_inflight_tokens))
                .collect()
        };
        assert_eq!(peer(&for_1), vec![(1, 10), (0, 0), (3, 30)]);
        assert_eq!(peer(&for_2), vec![(2, 1_000), (0, 0), (0, 0)]);
        assert_eq!(peer(&for_3), vec![(3, 1_010), (0, 0), (3, 30)]);
        // Everything else is the published snapshot.
        let mut base = for_3.clone();
        for e in &mut base.endpoints {
            e.peer_inflight_requests = 0;
            e.peer_inflight_tokens = 0;
        }
        assert_eq!(base, p.snapshot().unwrap());
        // The same bytes core writes for that snapshot.
        assert_eq!(
            p.body_for("gw-3", stale).as_ref(),
            for_3.encode().as_slice()
        );
        // An endpoint scraped after the reading already counts those requests.
        hub.record_success("p/c", stats(0.25, 4, &[]), t0 + 1);
        let p = hub.publish();
        assert_eq!(
            peer(&Snapshot::decode(&p.body_for("gw-1", stale)).unwrap()),
            vec![(1, 10), (0, 0), (0, 0)]
        );
        // A reading older than the bound counts nothing; no load at all: the plain body.
        assert_eq!(p.body_for("gw-1", Duration::ZERO).len(), p.body.len());
        hub.forget_gateway("gw-1");
        hub.forget_gateway("gw-2");
        let p = hub.publish();
        assert_eq!(p.body_for("gw-3", stale), p.body);
    }

    fn pools(p: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
        p.iter()
            .map(|(n, m)| ((*n).to_owned(), m.iter().map(|s| (*s).to_owned()).collect()))
            .collect()
    }

    fn in_pool(pool: &str, name: &str, models: &[&str]) -> EndpointSpec {
        EndpointSpec {
            id: format!("{pool}/{name}"),
            pool: pool.into(),
            models: models.iter().map(|s| (*s).to_owned()).collect(),
            ..spec(name)
        }
    }

    /// A configured pool without endpoints names its models (configured, or listed by its
    /// endpoints the last time it had any) in `unavailable_models`, less those another
    /// endpoint lists; the field is written only when not empty.
    #[test]
    fn pools_without_endpoints_name_their_models_unavailable() {
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        // `p` has an endpoint; `idle` (static, no endpoints) serves `a` and `m/é` (which
        // `p/a` lists); `k8s` reads its models from its pods.
        hub.set_pools(&pools(&[
            ("p", &["m/é"]),
            ("idle", &["m/é", "a"]),
            ("k8s", &[]),
        ]));
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["a"]);
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        let text = String::from_utf8(p.body.to_vec()).unwrap();
        let head = format!(
            "{{\"format\":1,\"version\":{},\"generated_at_ms\":{},\"unavailable_models\":[\"a\"],\"endpoints\":[{{\"id\":\"p/a\",",
            p.version, p.generated_at_ms
        );
        assert!(text.starts_with(&head), "{text}");
        // `k8s` gets a pod serving `x`, then loses it: `x` is remembered.
        hub.set_endpoints(&[spec("a"), in_pool("k8s", "pod-0", &["x"])]);
        assert_eq!(hub.unavailable_models(), vec!["a"]);
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["a", "x"]);
        // A pod whose model list could not be read (no models) keeps the memory; a pod
        // listing other models replaces it.
        hub.set_endpoints(&[spec("a"), in_pool("k8s", "pod-1", &[])]);
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["a", "x"]);
        hub.set_endpoints(&[spec("a"), in_pool("k8s", "pod-2", &["y"])]);
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["a", "y"]);
        // Fragments are still found (peer load spliced) with the list before them.
        let t0 = now_ms();
        hub.record_success("p/a", stats(0.25, 1, &[]), t0 - 500);
        hub.retain_push_targets(&["gw-1"]);
        hub.record_gateway_report(
            "gw-1",
            GatewayReport {
                read_at_ms: t0 - 100,
                load: [(
                    "p/a".to_owned(),
                    kvroute_core::peer::PeerLoad {
                        requests: 2,
                        tokens: 20,
                    },
                )]
                .into_iter()
                .collect(),
            },
        );
        let p = hub.publish();
        let for_2 = Snapshot::decode(&p.body_for("gw-2", Duration::from_secs(2))).unwrap();
        assert_eq!(for_2.unavailable_models, vec!["a", "y"]);
        assert_eq!(
            (
                for_2.endpoints[0].peer_inflight_requests,
                for_2.endpoints[0].peer_inflight_tokens
            ),
            (2, 20)
        );
        // Pools leaving the config are forgotten, memory included; with nothing to name,
        // the field is left off.
        hub.set_pools(&pools(&[("p", &["m/é"])]));
        assert!(hub.unavailable_models().is_empty());
        let p = hub.publish();
        assert_eq!(p.body.as_ref(), core_encode(&hub, &p).as_slice());
        assert!(!String::from_utf8(p.body.to_vec())
            .unwrap()
            .contains("unavailable_models"));
    }

    /// A pool's LoRA adapters (reported by its endpoints' scrapes since it last had none)
    /// are named with its models when it has none again, less those another endpoint
    /// reports; when the pool is back, they are counted afresh.
    #[test]
    fn pools_without_endpoints_name_their_adapters_unavailable() {
        let hub = Hub::new(
            Duration::from_secs(1),
            Duration::ZERO,
            Duration::from_secs(1),
        );
        hub.set_pools(&pools(&[("p", &["m/é"]), ("k8s", &["base"])]));
        let pod = |name: &str| in_pool("k8s", name, &["base"]);
        hub.set_endpoints(&[spec("a"), pod("pod-0")]);
        let t0 = now_ms();
        hub.record_success("k8s/pod-0", stats(0.1, 1, &["sql-lora", "chat-lora"]), t0);
        hub.record_success("k8s/pod-0", stats(0.1, 1, &["sql-lora"]), t0 + 1);
        hub.record_success("p/a", stats(0.1, 1, &["chat-lora"]), t0 + 1);
        assert!(hub.unavailable_models().is_empty());
        // `k8s` loses its pod: its model and `sql-lora` (`chat-lora` is `p/a`'s now).
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["base", "sql-lora"]);
        // Back with a pod that reports no adapter, then gone again: its model only.
        hub.set_endpoints(&[spec("a"), pod("pod-1")]);
        hub.record_success("k8s/pod-1", stats(0.1, 1, &[]), t0 + 2);
        hub.set_endpoints(&[spec("a")]);
        assert_eq!(hub.unavailable_models(), vec!["base"]);
        let p = hub.publish();
        assert_eq!(
            Snapshot::decode(&p.body).unwrap().unavailable_models,
            vec!["base"]
        );
    }

    #[test]
    fn coalesce_window_grows_with_snapshot_bytes() {
        let ten = Duration::from_millis(10);
        assert_eq!(coalesce_window(ten, 0), ten);
        // 64 endpoints × ~300 B stay at the configured window.
        assert_eq!(coalesce_window(ten, 64 * 300), ten);
        // 2 MiB of snapshot: one push per second at most.
        assert_eq!(
            coalesce_window(ten, 2 * 1024 * 1024),
            Duration::from_secs(1)
        );
        assert_eq!(
            coalesce_window(ten, 1024 * 1024),
            Duration::from_millis(500)
        );
    }
}
