//! Per-worker state and host I/O around the core routing pipeline
//! ([`kvroute_core::router::Router`]): read the snapshot from shared data, call the router
//! over the in-flight reservations of every worker, count and log its decision, and apply
//! it (header, reservation).
//! No routing logic lives here.
//!
//! Decision outcomes:
//! - a pick sets the routing header (cluster name, or `host:port[,fallback...]`; Envoy
//!   then recomputes the route), and reserves the request's KV demand (tokens) and pending
//!   prefill on the chosen endpoint in the worker's in-flight table, which the other
//!   workers read from shared data ([`Worker::apply_route`], the one place a decision is
//!   applied; [`crate::inflight`]);
//! - no endpoint for the model → 404 `model_not_found` when no endpoint lists it, else 503
//!   `no_healthy_endpoint` with `retry-after` ([`crate::reply`], OpenAI's error object);
//! - every endpoint saturated → held in the admission queue when enabled, else 429
//!   `saturated` with `retry-after`;
//! - no snapshot yet, or an internal error → fail open: no header is set and Envoy's
//!   default route applies (counter `kvroute.fail_open`), or 503 `router_unavailable` when
//!   `fail_open` is false.
//!
//! Requests routed without their body (no body, upgrade, over `max_body_bytes`, encoded)
//! are picked with zero prompt tokens: the policy then ranks by load alone.

use crate::host::{period_passed, Host, Level, MetricKind};
use crate::names::{metric, DECISION_HEADER, DECISION_PROPERTY, FAIL_OPEN_REASON};
use crate::shared::SnapshotCache;
use crate::sharing::{Journal, Synced};
use kvroute_core::admission::AdmissionQueue;
use kvroute_core::estimate::Estimator;
use kvroute_core::picker::PickReason;
use kvroute_core::plugin_config::{Config, Mode};
use kvroute_core::router::{Basis, Outcome, Route, Router};
use kvroute_core::snapshot::Snapshot;
use std::collections::BTreeMap;
use std::fmt::Write as _;

pub use kvroute_core::router::RequestFacts;

/// A reservation held by one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Reservation id (unique across workers: [`Worker::next_id`]).
    pub id: u64,
    /// Endpoint id.
    pub endpoint: String,
    /// Tokens reserved.
    pub tokens: u64,
    /// Pending prefill tokens recorded with the reservation; 0 once
    /// [`Worker::prefill_done`] ran (the first response bytes arrived).
    pub prefill_tokens: u64,
}

/// A routed decision, ready to apply: the core [`Route`] plus what the host does with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The routing header's value (the header is the config's:
    /// [`kvroute_core::plugin_config::RawConfig::routing_header`]): the endpoint's cluster,
    /// or `host:port[,fallback...]`.
    pub value: String,
    /// Decision reason (debug header): `policy:<name>` or `stale_fallback`, then
    /// `;endpoint=<id>`, `;load_only=<cause>` when the body was not used
    /// (`body_not_read`, `not_inference`, `unparsable`), `;demand_over_capacity` when re-picked
    /// by load, e.g. `policy:hybrid;endpoint=pool/e1;load_only=unparsable`. Empty unless
    /// `debug_header` or `decision_record` is on (nothing else reads it).
    pub reason: String,
    /// The core decision.
    pub route: Route,
    /// When the decision was made, Unix ms: the reservation's start and the TTFB clock's.
    pub at_ms: u64,
}

/// A decision to apply.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Route (apply with [`Worker::apply_route`]).
    Route(Box<Routed>),
    /// Endpoints list the request's model but none can take it now (503, `retry-after`);
    /// the model the request names, if any ([`Outcome::NoEndpoints`]), for the reply.
    NoEndpoints(Option<String>),
    /// No endpoint lists the requested model (404 `model_not_found`); the model's name.
    UnknownModel(String),
    /// Every endpoint is saturated.
    NoCapacity {
        /// vLLM priority (lower first).
        priority: i32,
        /// Estimated job size, tokens.
        size: u64,
    },
    /// Let Envoy route by default (reason for the log).
    FailOpen(String),
}

/// A parked request the admission tick resumed, for its stream to adopt when it next runs
/// ([`Worker::resumed`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    /// The reservation, facts and decision time (Unix ms) of a routed one; `None` for one
    /// resumed unrouted (fail open).
    pub route: Option<(Held, RequestFacts, u64)>,
    /// Its decision reason, kept by the stream for the response's `x-kvroute-decision` as a
    /// request decided at once keeps its own: [`Routed::reason`] (empty unless
    /// `debug_header` or `decision_record` is on), or [`FAIL_OPEN_REASON`].
    pub reason: String,
    /// The routing header's value ([`Routed::value`]); empty for one resumed unrouted.
    pub routed_to: String,
    /// Endpoint mode: its response checks the upstream Envoy reached
    /// ([`Worker::upstream_check_due`]), as a request decided at once does.
    pub check_upstream: bool,
}

/// A request parked in the admission queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parked {
    /// HTTP context id.
    pub context_id: u32,
    /// Request path.
    pub path: String,
    /// Request body (empty for a request that has none: one whose body the filter does
    /// not read is never parked).
    pub body: Vec<u8>,
}

impl Parked {
    /// What holding a request with this `path` and `body` costs in Wasm memory, counted
    /// against `admission.max_queue_bytes`: the lengths of the body and path the queue
    /// copies, bytes.
    pub fn bytes_of(path: &str, body: &[u8]) -> usize {
        body.len().saturating_add(path.len())
    }
}

/// What one [`Worker::sync`] did, per shared journal (`None`: not shared, or its sync
/// failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SyncReport {
    /// The prefix-affinity journal (`share_affinity`).
    pub affinity: Option<Synced>,
    /// The learner-observation journal (`share_learning`).
    pub learned: Option<Synced>,
}

/// The per-endpoint in-flight gauges of one snapshot version ([`Worker`]'s tick): built
/// once per version, so a tick looks endpoints up with no map rebuilt and no string
/// allocated (it rebuilt both maps on every tick, a few allocations per endpoint with
/// load, ~6.5 k instructions per tick in the native build with 16 endpoints, and the
/// native build ticks each time a worker goes idle). Per endpoint it holds the id and its
/// [`metric::stat_id`], not the gauges' full names, which a tick writes into one reused
/// buffer: the index stays a few dozen bytes per endpoint in the Wasm VM.
#[derive(Debug, Default)]
struct GaugeIndex {
    /// The snapshot version it describes (`None`: none yet).
    version: Option<u64>,
    /// Endpoint id → (its gauge's index in [`Self::keys`], its `scraped_at_ms`).
    by_id: BTreeMap<String, (usize, u64)>,
    /// [`metric::stat_id`] → its gauge's index in [`Self::keys`].
    slot_of: BTreeMap<String, usize>,
    /// One [`metric::stat_id`] per gauge: the distinct ones of the snapshot's endpoints.
    keys: Vec<String>,
}

impl GaugeIndex {
    fn of(snap: &Snapshot) -> Self {
        let mut ix = Self {
            version: Some(snap.version),
            ..Self::default()
        };
        for e in &snap.endpoints {
            let key = metric::stat_id(&e.id);
            let i = match ix.slot_of.get(&key) {
                Some(&i) => i,
                None => {
                    let i = ix.keys.len();
                    ix.keys.push(key.clone());
                    ix.slot_of.insert(key, i);
                    i
                }
            };
            ix.by_id.insert(e.id.clone(), (i, e.scraped_at_ms));
        }
        ix
    }
}

/// Per-worker state, shared by the root context and the worker's HTTP contexts.
#[derive(Debug)]
pub struct Worker {
    /// Configuration.
    pub config: Config,
    router: Router,
    /// Snapshot cache.
    pub cache: SnapshotCache,
    id_prefix: u64,
    seq: u32,
    /// Admission queue.
    pub(crate) admission: AdmissionQueue<Parked>,
    /// The queue length this worker has added to the shared `kvroute.queue_length` gauge
    /// ([`Worker::report_queue_length`]).
    queue_reported: u64,
    /// Parked requests the tick resumed, by context id, for their streams to adopt.
    pub resumed: BTreeMap<u32, Resumed>,
    /// This worker's number among the proxy's workers (writer id in the shared journals).
    worker_number: u32,
    /// Last sequence number seen in the affinity journal.
    affinity_seen: u64,
    /// Last sequence number seen in the observation journal.
    learned_seen: u64,
    /// When the journals were last synced (Unix ms).
    affinity_synced_ms: u64,
    /// When [`Worker::flush`] last forced a journal sync, Unix ms.
    affinity_flushed_ms: u64,
    /// Endpoints ([`metric::stat_id`] of their ids) whose per-endpoint in-flight gauges
    /// this worker last set above zero (set back to 0 once their load is gone).
    exported_unseen: std::collections::BTreeSet<String>,
    /// Endpoints ([`metric::stat_id`]) whose per-endpoint gauges this worker has defined:
    /// handles of endpoints that left the snapshot are dropped when its next version comes
    /// ([`GaugeIndex`] rebuilt), so they stay bounded by the fleet in force (endpoint churn).
    gauge_endpoints: std::collections::BTreeSet<String>,
    /// The per-endpoint gauges of the snapshot in force, built once per version.
    gauge_index: GaugeIndex,
    /// The tick's unseen load per gauge of [`Self::gauge_index`] (kept between ticks).
    gauge_loads: Vec<kvroute_core::inflight::InFlight>,
    /// This worker's reservations and its copy of the other workers'.
    inflight: crate::inflight::WorkerInflight,
    /// Releases not yet added to the `released` counter (added with the next reservation's
    /// counters, or on the tick: no host call of their own).
    released_uncounted: i64,
    /// Endpoint mode: when each endpoint's requests were last checked against the upstream
    /// Envoy reached (`upstream.address`), Unix ms ([`Worker::upstream_check_due`]).
    upstream_checked: std::collections::HashMap<String, u64>,
}

/// The route role's tick is at most this long, ms, so a worker's releases, and
/// reservations made within `inflight_share_ms` of its last publication, reach the other
/// workers within it ([`crate::inflight`]) whatever the sharing settings. Scraped KV stats
/// are older than this anyway (the control plane scrapes once a second).
pub const RELEASE_FLUSH_MS: u64 = 100;

/// How often a worker's tick ([`Worker::periodic`]) runs, ms: as often as its most frequent
/// need, the in-flight publication ([`RELEASE_FLUSH_MS`]), admission's `tick_ms` when
/// enabled, the journal sync's `affinity_sync_ms` when the workers share; at least 1. The
/// same rule for both builds (`filter/src/wasm.rs`, `dynmod/src/glue.rs`).
pub fn tick_period_ms(config: &Config) -> u64 {
    let mut tick = RELEASE_FLUSH_MS;
    if config.admission.enabled {
        tick = tick.min(config.admission.tick_ms);
    }
    if config.shares_with_workers() {
        tick = tick.min(config.affinity_sync_ms);
    }
    tick.max(1)
}

/// Endpoint mode: how often at most one endpoint's routing is checked against the upstream
/// Envoy reached, ms. The check reads `upstream.address` at a response's headers, a host
/// call that returns data (~10 k instructions, docs/overhead.md "Host calls"), so it runs
/// for one response per endpoint per interval: a wrong address shows within seconds of the
/// first request to it, for no measurable cost per request.
pub const UPSTREAM_CHECK_MS: u64 = 10_000;

/// Most endpoints [`Worker::upstream_check_due`] remembers; past it the record starts
/// over (an endpoint is then checked once more), so endpoints that left the snapshot
/// cannot grow it without bound.
const UPSTREAM_CHECKED_MAX: usize = 4096;

/// The decision's reason as the debug header and the decision record show it: policy (or
/// `stale_fallback`), endpoint, prefix blocks matched / hashed, the load-only cause, the
/// over-capacity flag and, when recorded, the ranked candidates (`docs/filter.md`).
fn describe(route: &Route, basis: Basis) -> String {
    let mut reason = match route.reason {
        PickReason::Policy => format!("policy:{}", route.policy.name()),
        PickReason::StaleFallback => "stale_fallback".to_owned(),
    };
    // Where it went and what the decision rested on (a load-only pick of an unparsable
    // body must not read like a body-based one).
    reason.push_str(";endpoint=");
    reason.push_str(&route.endpoint);
    if route.prefix_blocks > 0 {
        // Prefix blocks matched on the chosen endpoint / hashed.
        let _ = write!(
            reason,
            ";prefix={}/{}",
            route.prefix_match_blocks, route.prefix_blocks
        );
    }
    if let Basis::LoadOnly(cause) = basis {
        reason.push_str(";load_only=");
        reason.push_str(cause.name());
    }
    if route.demand_over_capacity {
        reason.push_str(";demand_over_capacity");
    }
    if !route.candidates.is_empty() {
        write_candidates(&mut reason, &route.candidates);
    }
    reason
}

/// Append the decision record's candidates to a decision reason:
/// `;top=<id>[score=…,ttft_ms=…,kv=…,queue=…,inflight=…,prefill=…,prefix=…,blocks=…,load=…],…`,
/// best first (the chosen endpoint leads). `score` is the policy's (higher wins), `ttft_ms`
/// the `predicted_ttft` model's TTFT there, `kv`..`prefix` hybrid's weighted terms (absent
/// for other policies), `blocks` the prefix blocks matched, `load` running + waiting +
/// in-flight requests.
fn write_candidates(out: &mut String, cands: &[kvroute_core::router::CandidateRecord]) {
    use std::fmt::Write;
    out.push_str(";top=");
    for (i, c) in cands.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{}[score={:.3},ttft_ms={:.1}",
            c.endpoint,
            c.pick.score,
            c.predicted_ttft_s * 1e3
        );
        if let Some([kv, queue, inflight, prefill, prefix]) = c.pick.terms {
            let _ = write!(
                out,
                ",kv={kv:.3},queue={queue:.3},inflight={inflight:.3},prefill={prefill:.3},prefix={prefix:.3}"
            );
        }
        let _ = write!(
            out,
            ",blocks={},load={}]",
            c.pick.prefix_blocks, c.pick.load
        );
    }
}

impl Worker {
    /// A worker as a host brings one up on a worker thread (both builds: `wasm.rs`
    /// `on_configure`, `dynmod/src/glue.rs` on a thread's first stream): [`Worker::new`],
    /// then its worker number from shared data ([`crate::shared::next_worker_number`]).
    /// `None` when the picker refuses the config (logged at error); without a number the
    /// worker runs on, with random reservation ids (logged at warn).
    pub fn start<H: Host>(config: Config, seed: u64, host: &H) -> Option<Self> {
        let mut worker = match Self::new(config, seed) {
            Ok(w) => w,
            Err(e) => {
                host.log(Level::Error, &format!("kvroute plugin config: {e}"));
                return None;
            }
        };
        match crate::shared::next_worker_number(host) {
            Ok(n) => worker.set_worker_number(n),
            Err(e) => host.log(
                Level::Warn,
                &format!("kvroute: no worker number (random reservation ids): {e}"),
            ),
        }
        Some(worker)
    }

    /// Build from a validated config and a seed (time + context id; no OS randomness).
    pub fn new(config: Config, seed: u64) -> Result<Self, kvroute_core::picker::ConfigError> {
        let mut router = Router::new(config.router.clone(), seed)?;
        router.share_affinity(config.share_affinity);
        router.share_learning(config.share_learning);
        router.set_explain(config.decision_record);
        let admission =
            AdmissionQueue::new(config.admission.max_queue, config.admission.max_queue_bytes);
        let mut rng = fastrand::Rng::with_seed(seed);
        Ok(Self {
            router,
            cache: SnapshotCache::default(),
            id_prefix: rng.u64(..) & 0xFFFF_FFFF_0000_0000,
            seq: 0,
            admission,
            queue_reported: 0,
            resumed: BTreeMap::new(),
            // Random until `set_worker_number`: two workers then differ with high probability.
            worker_number: rng.u32(..),
            affinity_seen: 0,
            learned_seen: 0,
            affinity_synced_ms: 0,
            affinity_flushed_ms: 0,
            exported_unseen: std::collections::BTreeSet::new(),
            gauge_endpoints: std::collections::BTreeSet::new(),
            gauge_index: GaugeIndex::default(),
            gauge_loads: Vec::new(),
            inflight: crate::inflight::WorkerInflight::new(
                kvroute_core::inflight::DEFAULT_MAX_ENTRIES,
                config.inflight_share_ms,
            ),
            released_uncounted: 0,
            upstream_checked: std::collections::HashMap::new(),
            config,
        })
    }

    /// The estimator, with its learned calibration.
    pub fn estimator(&self) -> &Estimator {
        self.router.estimator()
    }

    /// The worker's core router (read-only: learned state, configuration).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Blocks remembered for `endpoint_id` in the prefix index.
    pub fn prefix_blocks(&self, endpoint_id: &str) -> usize {
        self.router.prefix_blocks(endpoint_id)
    }

    /// Make reservation ids unique across workers: `worker` (from
    /// [`crate::shared::next_worker_number`]) becomes the upper 16 bits. It also names the
    /// worker's in-flight key: until it is set, the worker shares no reservations.
    pub fn set_worker_number(&mut self, worker: u32) {
        self.inflight.set_worker(worker);
        // Keep 16 random bits beside a 16-bit worker number: even if two workers raced to
        // the same number (see `shared::ensure_keys`), their ids still differ.
        self.id_prefix =
            (u64::from(worker & 0xFFFF) << 48) | (self.id_prefix & 0x0000_FFFF_0000_0000);
        self.worker_number = worker;
    }

    /// The tick: publish this worker's in-flight table when it changed (or for the
    /// heartbeat), the admission queue when enabled, the gauges, then the sync of the shared
    /// journals (prefix affinity, learner observations) with the other workers when
    /// `affinity_sync_ms` has passed since the last one.
    pub fn periodic<H: Host>(&mut self, host: &H) {
        self.tick_all(host, false);
    }

    /// [`Self::periodic`]'s work; `sync_now`: the journal sync runs whatever
    /// `affinity_sync_ms` says ([`Self::flush`]).
    fn tick_all<H: Host>(&mut self, host: &H, sync_now: bool) {
        if self.config.admission.enabled {
            self.tick(host);
        }
        let now = host.now_ms();
        self.publish_inflight(host, now);
        self.inflight.refresh_peers(host, now);
        // One read of the snapshot version for the whole tick.
        let snap = self.cache.current(host).ok().flatten();
        self.gauges_with(host, now, snap.as_deref());
        if self.config.shares_with_workers()
            && (sync_now
                || period_passed(now, self.affinity_synced_ms, self.config.affinity_sync_ms))
        {
            self.affinity_synced_ms = now;
            self.sync_with(host, snap.as_deref());
        }
    }

    /// [`Self::periodic`] with the read of the other workers' in-flight tables done now,
    /// whatever `inflight_share_ms` says, and the journal sync (affinity, learner
    /// observations) too when this worker has records to publish (at most once per
    /// `affinity_sync_ms / 10`): for a host without a timer at the moment its worker goes
    /// idle (the native build, `dynmod/src/glue.rs`), so what the worker learned reaches
    /// the other workers, and its gauges are current, before it stops ticking.
    pub fn flush<H: Host>(&mut self, host: &H) {
        // The journal sync reads and rewrites whole journals (up to
        // `affinity_journal_bytes` each): forced only when this worker has records to
        // publish, and at most once per `affinity_sync_ms / 10`, so a worker that goes idle
        // after every request (one client, one request at a time) does not pay it per
        // request; the rest waits for its next tick.
        let now = host.now_ms();
        let sync_now = self.router.has_unshared()
            && period_passed(
                now,
                self.affinity_flushed_ms,
                self.config.affinity_sync_ms / 10,
            );
        if sync_now {
            self.affinity_flushed_ms = now;
        }
        self.inflight.refresh_now();
        self.tick_all(host, sync_now);
    }

    /// The gauges that describe shared state, refreshed on the tick rather than per request
    /// (two host calls fewer per request): live reservations (all workers, the others' as
    /// of the worker's last read) and the age of the snapshot in force.
    pub fn record_gauges<H: Host>(&mut self, host: &H, now: u64) {
        self.inflight.refresh_peers(host, now);
        let snap = self.cache.current(host).ok().flatten();
        self.gauges_with(host, now, snap.as_deref());
    }

    /// The tick's gauges. Besides the totals, each endpoint with load the snapshot in force
    /// does not show yet gets two gauges ([`metric::INFLIGHT_UNSEEN_REQUESTS`],
    /// [`metric::INFLIGHT_UNSEEN_TOKENS`] + endpoint id): the requests and reserved tokens
    /// of every worker of this Envoy made since that endpoint's `scraped_at_ms`, the rule
    /// the picker applies to its own reservations. Every worker computes them over every
    /// worker's reservations (its own, and its copy of the others', read on the same
    /// tick), so whichever writes last writes this Envoy's total; no per-worker sum is
    /// needed. A gauge whose load is gone is set to 0 by the worker that last set it.
    /// Endpoints without load cost nothing.
    fn gauges_with<H: Host>(&mut self, host: &H, now: u64, snap: Option<&Snapshot>) {
        let t = &self.inflight;
        host.metric_record(MetricKind::Gauge, metric::INFLIGHT, t.live(now) as u64);
        if let Some(snap) = snap {
            let new_version = self.gauge_index.version != Some(snap.version);
            if new_version {
                self.gauge_index = GaugeIndex::of(snap);
            }
            let ix = &self.gauge_index;
            // Every worker's unseen load, by gauge (ids that differ only by `.` and `_`
            // share one, which holds their sum): into a buffer kept between ticks.
            let loads = &mut self.gauge_loads;
            loads.clear();
            loads.resize(ix.keys.len(), kvroute_core::inflight::InFlight::default());
            for table in self.inflight.view() {
                table.add_unseen(now, |id| ix.by_id.get(id).copied(), loads);
            }
            // Both of `key`'s gauges set (their handles dropped with `forget`), the names
            // written into one buffer.
            let mut name = String::new();
            let mut set = |key: &str, requests: u64, tokens: u64, forget: bool| {
                for (prefix, v) in [
                    (metric::INFLIGHT_UNSEEN_REQUESTS, requests),
                    (metric::INFLIGHT_UNSEEN_TOKENS, tokens),
                ] {
                    name.clear();
                    name.push_str(prefix);
                    name.push_str(key);
                    host.gauge_set_named(&name, v);
                    if forget {
                        host.forget_named_gauge(&name);
                    }
                }
            };
            for (i, l) in loads.iter().enumerate() {
                if l.requests == 0 {
                    continue;
                }
                let Some(key) = ix.keys.get(i) else { continue };
                set(key, u64::from(l.requests), l.tokens, false);
                if !self.exported_unseen.contains(key) {
                    self.exported_unseen.insert(key.clone());
                    self.gauge_endpoints.insert(key.clone());
                }
            }
            // A gauge this worker set above zero whose load is gone (or whose endpoint left
            // the snapshot) goes back to 0.
            let gone: Vec<String> = self
                .exported_unseen
                .iter()
                .filter(|key| {
                    ix.slot_of
                        .get(key.as_str())
                        .and_then(|&i| loads.get(i))
                        .is_none_or(|l| l.requests == 0)
                })
                .cloned()
                .collect();
            for key in gone {
                set(&key, 0, 0, false);
                self.exported_unseen.remove(&key);
            }
            if new_version {
                let gone: Vec<String> = self
                    .gauge_endpoints
                    .iter()
                    .filter(|key| !ix.slot_of.contains_key(key.as_str()))
                    .cloned()
                    .collect();
                for key in gone {
                    self.gauge_endpoints.remove(&key);
                    set(&key, 0, 0, true);
                }
            }
        }
        if let Some(snap) = snap {
            host.metric_record(
                MetricKind::Gauge,
                metric::SNAPSHOT_AGE_MS,
                now.saturating_sub(snap.generated_at_ms),
            );
        }
    }

    /// Exchange what the workers share (prefix affinity, learner observations; each when
    /// its `share_*` option is on) with the other workers now ([`crate::sharing::sync`]).
    /// Returns what each journal's sync did; failures are logged, and lose hints or
    /// observations, never a request.
    pub fn sync<H: Host>(&mut self, host: &H) -> SyncReport {
        let snap = self.cache.current(host).ok().flatten();
        self.sync_with(host, snap.as_deref())
    }

    fn sync_with<H: Host>(&mut self, host: &H, snap: Option<&Snapshot>) -> SyncReport {
        // Imports are kept only for endpoints of the current snapshot.
        if let Some(snap) = snap {
            self.router.observe_snapshot(snap);
        }
        let retention_ms = self
            .config
            .affinity_sync_ms
            .saturating_mul(crate::sharing::RETENTION_PERIODS);
        let mut out = SyncReport::default();
        for (journal, on) in [
            (Journal::Affinity, self.config.share_affinity),
            (Journal::Learned, self.config.share_learning),
        ] {
            if !on {
                continue;
            }
            let (seen, slot) = match journal {
                Journal::Affinity => (&mut self.affinity_seen, &mut out.affinity),
                Journal::Learned => (&mut self.learned_seen, &mut out.learned),
            };
            let r = crate::sharing::sync(
                host,
                journal,
                &mut self.router,
                self.worker_number,
                seen,
                self.config.affinity_journal_bytes,
                retention_ms,
            );
            match r {
                Ok(s) => *slot = Some(s),
                Err(e) => host.log(Level::Warn, &format!("kvroute: {journal:?} sync: {e}")),
            }
        }
        out
    }

    /// A fresh reservation id: the worker's upper 32 bits (unique per worker once
    /// [`Self::set_worker_number`] ran; random otherwise), a counter below.
    pub fn next_id(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        self.id_prefix | u64::from(self.seq)
    }

    /// Decide for a request to `path` with `body` (`None`: decided without the body) at
    /// `now` (Unix ms, the caller's one clock read): the snapshot signal, the other
    /// workers' in-flight tables when this worker's copy is `inflight_share_ms` old, the
    /// core router over every worker's reservations, decision counters and logs.
    pub fn decide<H: Host>(
        &mut self,
        host: &H,
        path: &str,
        body: Option<&[u8]>,
        now: u64,
    ) -> Decision {
        self.decide_counted(host, path, body, now, true)
    }

    /// [`Self::decide`]; `first` is false when a parked request is decided again by the
    /// admission tick: what the body showed (a parse error, a load-only basis) was counted
    /// and logged at its first decision, and is not counted once per tick.
    fn decide_counted<H: Host>(
        &mut self,
        host: &H,
        path: &str,
        body: Option<&[u8]>,
        now: u64,
        first: bool,
    ) -> Decision {
        let snap = match self.cache.current(host) {
            Ok(Some(s)) => s,
            Ok(None) => return Decision::FailOpen("no snapshot received yet".into()),
            Err(e) => return Decision::FailOpen(format!("snapshot unreadable: {e}")),
        };
        self.inflight.refresh_peers(host, now);
        let d = self
            .router
            .route(&snap, &self.inflight.view()[..], path, body, now);
        if let Some(e) = d.parse_error.as_ref().filter(|_| first) {
            host.metric_add(MetricKind::Counter, metric::PARSE_ERRORS, 1);
            host.log(Level::Debug, &format!("kvroute: body not analysed: {e}"));
        }
        if first && matches!(d.basis, Basis::LoadOnly(_)) {
            host.metric_add(MetricKind::Counter, metric::DECISIONS_LOAD_ONLY, 1);
        }
        match d.outcome {
            Outcome::Route(route) => {
                let Some(primary) = snap.endpoints.get(route.primary) else {
                    return Decision::FailOpen("router returned an index out of range".into());
                };
                if route.demand_over_capacity {
                    host.metric_add(MetricKind::Counter, metric::DEMAND_OVER_CAPACITY, 1);
                }
                let value = match self.config.mode {
                    Mode::Cluster => primary.cluster.clone(),
                    Mode::Endpoint => {
                        let mut v = primary.address.clone();
                        for f in route
                            .fallbacks
                            .iter()
                            .filter_map(|i| snap.endpoints.get(*i))
                        {
                            v.push(',');
                            v.push_str(&f.address);
                        }
                        v
                    }
                };
                match route.reason {
                    PickReason::Policy => {
                        host.metric_add(MetricKind::Counter, metric::DECISIONS_POLICY, 1);
                        host.metric_add(
                            MetricKind::Counter,
                            metric::decisions_by_policy(route.policy),
                            1,
                        );
                    }
                    PickReason::StaleFallback => {
                        host.metric_add(MetricKind::Counter, metric::DECISIONS_STALE, 1);
                    }
                }
                // Built only for the debug header or the decision record that show it.
                let reason = if self.config.debug_header || self.config.decision_record {
                    describe(&route, d.basis)
                } else {
                    String::new()
                };
                Decision::Route(Box::new(Routed {
                    value,
                    reason,
                    route,
                    at_ms: now,
                }))
            }
            Outcome::NoEndpoints(m) => Decision::NoEndpoints(m),
            Outcome::UnknownModel(m) => Decision::UnknownModel(m),
            Outcome::NoCapacity { priority, size } => Decision::NoCapacity { priority, size },
        }
    }

    /// Apply a routed decision, the one place this happens: set the routing header (and the
    /// debug header), and reserve the route's KV demand and pending prefill in this worker's
    /// in-flight table (in memory; published to the other workers at most once per
    /// `inflight_share_ms`, [`crate::inflight`]). Envoy recomputes the route itself after a
    /// Wasm filter changes a request header (see `docs/filter.md`, "The route cache").
    /// Returns the reservation.
    pub fn apply_route<H: Host>(&mut self, host: &H, routed: &mut Routed) -> Held {
        host.set_request_header(self.config.routing_header(), Some(&routed.value));
        if self.config.debug_header {
            host.set_request_header(DECISION_HEADER, Some(&routed.reason));
        }
        if self.config.decision_record {
            host.set_property(&[DECISION_PROPERTY], routed.reason.as_bytes());
        }
        let id = self.next_id();
        let r = &routed.route;
        let now = routed.at_ms;
        self.inflight.reserve(
            id,
            &r.endpoint,
            r.reserve_tokens,
            r.prefill_tokens,
            now,
            self.config.reservation_ttl_ms,
        );
        host.metric_add(MetricKind::Counter, metric::RESERVED, 1);
        self.count_releases(host);
        self.inflight.publish(host, now, false);
        Held {
            id,
            endpoint: r.endpoint.clone(),
            tokens: r.reserve_tokens,
            prefill_tokens: r.prefill_tokens,
        }
    }

    /// Endpoint mode: whether the response to a request routed to `endpoint` at `now_ms`
    /// has its upstream checked: when no check of it was made in the last
    /// [`UPSTREAM_CHECK_MS`] ([`Self::upstream_checked`] records one). Requests in flight
    /// together before the first check all check (each a host call; at most the requests
    /// in flight to one endpoint). Always false in cluster mode, where Envoy's own
    /// `cluster_not_found` shows a wrong name.
    pub fn upstream_check_due(&self, endpoint: &str, now_ms: u64) -> bool {
        self.config.mode == Mode::Endpoint
            && self
                .upstream_checked
                .get(endpoint)
                .is_none_or(|at| period_passed(now_ms, *at, UPSTREAM_CHECK_MS))
    }

    /// Record a check of `endpoint`'s upstream at `now_ms` (made at a response's headers,
    /// so a request that ends without one, aborted or answered by the filter, leaves the
    /// next one due).
    pub fn upstream_checked(&mut self, endpoint: &str, now_ms: u64) {
        if !self.upstream_checked.contains_key(endpoint)
            && self.upstream_checked.len() >= UPSTREAM_CHECKED_MAX
        {
            self.upstream_checked.clear();
        }
        self.upstream_checked.insert(endpoint.to_owned(), now_ms);
    }

    /// Add the releases not yet counted to the `released` counter (one host call).
    fn count_releases<H: Host>(&mut self, host: &H) {
        let expired = self.inflight.take_expired();
        if expired > 0 {
            host.metric_add(
                MetricKind::Counter,
                metric::EXPIRED,
                i64::try_from(expired).unwrap_or(i64::MAX),
            );
        }
        if self.released_uncounted > 0 {
            host.metric_add(
                MetricKind::Counter,
                metric::RELEASED,
                self.released_uncounted,
            );
            self.released_uncounted = 0;
        }
    }

    /// A streamed response from `endpoint` produced its first token `ttft_s` seconds after
    /// the decision: a prefill-throughput sample for the `predicted_ttft` policy
    /// ([`Router::observe_first_token`]; shared with the other workers on the next sync
    /// when `share_learning` is on).
    pub fn observe_first_token(&mut self, endpoint: &str, predicted_work_tokens: f64, ttft_s: f64) {
        self.router
            .observe_first_token(endpoint, predicted_work_tokens, ttft_s);
    }

    /// A response's `usage` reported `completion_tokens` for a `prompt_tokens` prompt to
    /// `model` over `api`: learned output lengths set later requests' KV demand
    /// ([`Router::observe_output`]; shared like [`Self::observe_first_token`]).
    pub fn observe_output(
        &mut self,
        model: &str,
        api: kvroute_core::analysis::ApiKind,
        prompt_tokens: u64,
        completion_tokens: u64,
    ) {
        self.router
            .observe_output(model, api, prompt_tokens, completion_tokens);
    }

    /// The first response bytes of `held`'s stream arrived: its prefill is done, so its
    /// pending prefill drops to 0 (in memory; the other workers see it with the next
    /// publication).
    pub fn prefill_done(&mut self, held: &Held) {
        self.inflight.first_token(held.id);
    }

    /// Release a reservation (call exactly once per [`Held`]; a second call is harmless).
    ///
    /// The reservation leaves this worker's table at once, so its next decision no longer
    /// counts it; the other workers see the release with the next publication: the
    /// worker's next reservation once its last publication is `inflight_share_ms` old, or
    /// its tick ([`RELEASE_FLUSH_MS`]), whichever comes first. No host call.
    pub fn release(&mut self, held: &Held) {
        if self.inflight.release(held.id) {
            self.released_uncounted += 1;
        }
    }

    /// This worker's reservations and its copy of the other workers'.
    pub fn inflight(&self) -> &crate::inflight::WorkerInflight {
        &self.inflight
    }

    /// Publish this worker's in-flight table now if it changed since the last publication
    /// (or for the heartbeat), and count the releases not yet counted: what the tick does.
    pub fn publish_inflight<H: Host>(&mut self, host: &H, now: u64) {
        self.inflight.publish(host, now, true);
        // After the publication, which drops expired reservations: counted on this tick.
        self.count_releases(host);
    }

    /// Whether to read the `usage` of the response, beginning at `now_ms`, to a request
    /// routed with `facts` ([`Router::sample_usage`]: a token bucket per model, one read
    /// back every `usage_sample_ms`).
    pub fn sample_usage(&mut self, facts: &RequestFacts, now_ms: u64) -> bool {
        self.router.sample_usage(facts, now_ms)
    }

    /// Learn from a response's `usage`: the router's per-model calibration, and the
    /// estimate-error metric.
    pub fn observe_usage<H: Host>(&mut self, host: &H, facts: &RequestFacts, actual_prompt: u64) {
        if let Some(err_pct) = self.router.observe_usage(facts, actual_prompt) {
            host.metric_record(MetricKind::Histogram, metric::ESTIMATE_ERROR_PCT, err_pct);
        }
    }
}

impl Worker {
    /// The reply to a request nobody can take: 404 `model_not_found` for a model no
    /// endpoint lists ([`Decision::UnknownModel`]), else 503 `no_healthy_endpoint` with
    /// `retry-after` naming the model the decision carries (the core read it from the body;
    /// the body is not read again). Counted either way. `None` for any other decision.
    pub fn unserved_reply<H: Host>(
        &self,
        host: &H,
        decision: &Decision,
    ) -> Option<crate::reply::LocalReply> {
        match decision {
            Decision::UnknownModel(model) => {
                host.metric_add(MetricKind::Counter, metric::MODEL_NOT_FOUND, 1);
                Some(crate::reply::model_not_found(model))
            }
            Decision::NoEndpoints(model) => {
                host.metric_add(MetricKind::Counter, metric::NO_ENDPOINTS, 1);
                Some(crate::reply::no_healthy_endpoint(
                    model.as_deref(),
                    self.config.admission.retry_after_s,
                ))
            }
            _ => None,
        }
    }

    /// Admission tick: answer 429 to parked requests past `admission.timeout_ms`, then
    /// re-decide parked requests in service order until one still finds no capacity.
    /// Returns how many were resumed.
    pub fn tick<H: Host>(&mut self, host: &H) -> usize {
        let now = host.now_ms();
        let (timeout, retry_after) = (
            self.config.admission.timeout_ms,
            self.config.admission.retry_after_s,
        );
        let reject = crate::reply::saturated(retry_after);
        for p in self.admission.take_expired(now, timeout) {
            if host.set_effective_context(p.context_id) {
                host.metric_add(MetricKind::Counter, metric::REJECTED, 1);
                reject.send(host);
            }
        }
        let mut resumed = 0;
        // The head's path and body are moved out while it is re-decided and moved back if
        // it stays parked: no copy of a body (up to `max_body_bytes`) per tick.
        while let Some(head) = self.admission.peek_mut() {
            let p = Parked {
                context_id: head.context_id,
                path: std::mem::take(&mut head.path),
                body: std::mem::take(&mut head.body),
            };
            if !host.set_effective_context(p.context_id) {
                self.admission.pop();
                continue;
            }
            let body = (!p.body.is_empty()).then_some(p.body.as_slice());
            match self.decide_counted(host, &p.path, body, now, false) {
                Decision::NoCapacity { .. } => {
                    if let Some(head) = self.admission.peek_mut() {
                        head.path = p.path;
                        head.body = p.body;
                    }
                    break;
                }
                Decision::Route(mut routed) => {
                    self.admission.pop();
                    let held = self.apply_route(host, &mut routed);
                    let Routed {
                        reason,
                        route,
                        value,
                        ..
                    } = *routed;
                    let check_upstream = self.upstream_check_due(&held.endpoint, now);
                    let route = Some((held, route.facts, now));
                    let resumed_as = Resumed {
                        route,
                        reason,
                        routed_to: value,
                        check_upstream,
                    };
                    self.resumed.insert(p.context_id, resumed_as);
                    host.resume_request();
                    resumed += 1;
                }
                d @ (Decision::NoEndpoints(_) | Decision::UnknownModel(_)) => {
                    self.admission.pop();
                    if let Some(r) = self.unserved_reply(host, &d) {
                        r.send(host);
                    }
                }
                Decision::FailOpen(why) => {
                    self.admission.pop();
                    host.metric_add(MetricKind::Counter, metric::FAIL_OPEN, 1);
                    host.log(Level::Debug, &format!("kvroute: fail open: {why}"));
                    // As for a request decided at once (`Stream::apply`): unrouted only when
                    // `fail_open` allows it, and then its stream must know it left the queue
                    // (the rest of a body past `max_body_bytes` flows only then).
                    if self.config.fail_open {
                        let unrouted = Resumed {
                            route: None,
                            reason: FAIL_OPEN_REASON.to_owned(),
                            routed_to: String::new(),
                            check_upstream: false,
                        };
                        self.resumed.insert(p.context_id, unrouted);
                        host.resume_request();
                        resumed += 1;
                    } else {
                        crate::reply::router_unavailable(retry_after).send(host);
                    }
                }
            }
        }
        self.report_queue_length(host);
        resumed
    }

    /// Bring the `kvroute.queue_length` gauge up to date with this worker's queue. The gauge
    /// is one stat for the whole Envoy, so each worker adds the change in its own queue's
    /// length since it last reported (Envoy's gauges take signed increments): the gauge is
    /// then the sum over the workers. Setting it instead let every other worker, and Envoy's
    /// main-thread instance, overwrite a held queue with their 0 on each tick (found by a
    /// breaker: 0 in 29 of 40 samples while 3 requests were held).
    pub fn report_queue_length<H: Host>(&mut self, host: &H) {
        let len = self.admission.len() as u64;
        if len != self.queue_reported {
            let delta = i64::try_from(len).unwrap_or(i64::MAX)
                - i64::try_from(self.queue_reported).unwrap_or(i64::MAX);
            host.metric_add(MetricKind::Gauge, metric::QUEUE_LENGTH, delta);
            self.queue_reported = len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use kvroute_core::inflight::InFlight;
    use kvroute_core::snapshot::{EndpointStats, Snapshot};

    pub(crate) fn endpoint(i: usize, now: u64) -> EndpointStats {
        EndpointStats::fixture(i, now)
    }

    fn worker(json: &str) -> Worker {
        Worker::new(Config::parse(json.as_bytes()).unwrap(), 7).unwrap()
    }

    /// A worker with its number, as `on_configure` makes it.
    fn numbered(h: &MockHost, json: &str) -> Worker {
        let mut w = worker(json);
        w.set_worker_number(crate::shared::next_worker_number(h).unwrap());
        w
    }

    #[test]
    fn the_queue_length_gauge_sums_every_workers_queue() {
        let h = MockHost::new(1_000);
        let other = h.sibling(); // shares the metrics, as Envoy's one gauge is shared
        let json = r#"{"admission":{"enabled":true}}"#;
        let (mut a, mut b) = (worker(json), worker(json));
        let park = |w: &mut Worker, id: u32| {
            let p = Parked {
                context_id: id,
                path: "/v1/chat/completions".into(),
                body: Vec::new(),
            };
            w.admission.push(p, 0, 1, 0, 1_000).unwrap();
        };
        park(&mut a, 1);
        park(&mut a, 2);
        a.report_queue_length(&h);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 2);
        // A worker with an empty queue (or Envoy's main-thread instance) leaves it alone...
        b.report_queue_length(&other);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 2);
        // ...and adds its own held requests.
        park(&mut b, 3);
        b.report_queue_length(&other);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 3);
        a.admission.remove_where(|p| p.context_id == 1);
        a.report_queue_length(&h);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 2);
        a.admission.remove_where(|_| true);
        b.admission.remove_where(|_| true);
        a.report_queue_length(&h);
        b.report_queue_length(&other);
        assert_eq!(h.metric(metric::QUEUE_LENGTH), 0);
    }

    #[test]
    fn unseen_inflight_gauges_per_endpoint_follow_every_workers_reservations() {
        let h = MockHost::new(1_000);
        crate::shared::ensure_keys(&h).unwrap();
        let other_worker = h.sibling();
        // e0 scraped at 900, e1 at 1,500 (after the reservations below are made), in a
        // snapshot published at 1,500 (times are on Envoy's clock from its publication on:
        // `Snapshot::rebase_clock`).
        let mut eps = vec![endpoint(0, 900), endpoint(1, 900)];
        eps[1].scraped_at_ms = 1_500;
        *h.now.borrow_mut() = 1_500;
        crate::shared::publish_snapshot(&h, &Snapshot::new(1, 1_500, eps).encode()).unwrap();
        *h.now.borrow_mut() = 1_000;
        let mut w = numbered(&h, "{}");
        let mut w2 = numbered(&other_worker, "{}");
        w.inflight.reserve(1, "pool/e0", 100, 0, 1_000, 60_000);
        w2.inflight.reserve(2, "pool/e0", 50, 0, 1_000, 60_000);
        w.inflight.reserve(3, "pool/e1", 70, 0, 1_000, 60_000);
        w2.publish_inflight(&other_worker, 1_000);
        let g = |name: &str| h.named_gauges.borrow().get(name).copied();
        w.record_gauges(&h, 1_000);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(2));
        assert_eq!(g("kvroute.inflight_unseen.tokens.pool/e0"), Some(150));
        assert_eq!(h.metric(metric::INFLIGHT), 3);
        // e1's reservation predates its scrape: the snapshot shows it, no gauge.
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e1"), None);
        assert_eq!(h.named_gauges.borrow().len(), 2);
        // w releases one: any worker's tick writes the Envoy-wide figure, w2's once it read
        // w's publication.
        w.inflight.release(1);
        w.publish_inflight(&h, 1_000);
        w2.record_gauges(&other_worker, 1_020);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(1));
        assert_eq!(g("kvroute.inflight_unseen.tokens.pool/e0"), Some(50));
        // All gone: the worker that set the gauges sets them back to 0.
        w2.inflight.release(2);
        w2.publish_inflight(&other_worker, 1_020);
        w.record_gauges(&h, 1_040);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(0));
        assert_eq!(g("kvroute.inflight_unseen.tokens.pool/e0"), Some(0));
        // Nothing is written for endpoints that never had load.
        *h.named_gauges.borrow_mut() = BTreeMap::new();
        w.record_gauges(&h, 1_040);
        assert!(h.named_gauges.borrow().is_empty());
        assert!(h.forgotten_gauges.borrow().is_empty());
        // e0 leaves the fleet with a reservation still live: its gauges go to 0, their
        // handles are dropped, and nothing is exported for it any more.
        w.inflight.reserve(4, "pool/e0", 10, 0, 1_000, 60_000);
        w.record_gauges(&h, 1_040);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(1));
        // e1 stays, scraped after its reservation as before.
        *h.now.borrow_mut() = 1_500;
        crate::shared::publish_snapshot(
            &h,
            &Snapshot::new(2, 1_500, vec![endpoint(1, 1_500)]).encode(),
        )
        .unwrap();
        *h.now.borrow_mut() = 1_000;
        w.record_gauges(&h, 1_041);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(0));
        assert_eq!(g("kvroute.inflight_unseen.tokens.pool/e0"), Some(0));
        assert_eq!(
            *h.forgotten_gauges.borrow(),
            vec![
                "kvroute.inflight_unseen.requests.pool/e0".to_owned(),
                "kvroute.inflight_unseen.tokens.pool/e0".to_owned()
            ]
        );
        *h.named_gauges.borrow_mut() = BTreeMap::new();
        w.record_gauges(&h, 1_042);
        assert!(h.named_gauges.borrow().is_empty());
    }

    /// Envoy splits stat names at dots: an id's dots go into its gauge names as `_`, and
    /// ids that then read the same (`pool/a.b.`, `pool/a_b_`) share one gauge, their sum;
    /// it goes back to 0 and is dropped as one.
    #[test]
    fn dotted_ids_make_dot_free_gauge_names() {
        let h = MockHost::new(1_000);
        crate::shared::ensure_keys(&h).unwrap();
        let ids = ["pool/a.b.", "pool/a_b_", "pool/.", "pool/e0"];
        let eps: Vec<EndpointStats> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let mut e = endpoint(i, 900);
                e.id = (*id).to_owned();
                e
            })
            .collect();
        crate::shared::publish_snapshot(&h, &Snapshot::new(1, 1_000, eps).encode()).unwrap();
        let mut w = numbered(&h, "{}");
        for (n, (id, tokens)) in [("pool/a.b.", 100), ("pool/a_b_", 50), ("pool/.", 7)]
            .into_iter()
            .enumerate()
        {
            w.inflight
                .reserve(n as u64 + 1, id, tokens, 0, 1_000, 60_000);
        }
        w.record_gauges(&h, 1_000);
        let gauges = h.named_gauges.borrow().clone();
        assert_eq!(
            gauges,
            BTreeMap::from(
                [
                    ("kvroute.inflight_unseen.requests.pool/_", 1),
                    ("kvroute.inflight_unseen.requests.pool/a_b_", 2),
                    ("kvroute.inflight_unseen.tokens.pool/_", 7),
                    ("kvroute.inflight_unseen.tokens.pool/a_b_", 150),
                ]
                .map(|(k, v)| (k.to_owned(), v))
            )
        );
        // One of the pair ends: the shared gauge holds the other's load.
        w.inflight.release(1);
        w.record_gauges(&h, 1_001);
        assert_eq!(
            h.named_gauges
                .borrow()
                .get("kvroute.inflight_unseen.tokens.pool/a_b_"),
            Some(&50)
        );
        // Both leave the fleet: the gauge goes to 0 and is dropped once per name.
        let rest = vec![{
            let mut e = endpoint(3, 1_000);
            e.id = "pool/e0".to_owned();
            e
        }];
        crate::shared::publish_snapshot(&h, &Snapshot::new(2, 1_000, rest).encode()).unwrap();
        w.record_gauges(&h, 1_002);
        assert_eq!(
            h.named_gauges
                .borrow()
                .get("kvroute.inflight_unseen.requests.pool/a_b_"),
            Some(&0)
        );
        assert_eq!(
            *h.forgotten_gauges.borrow(),
            [
                "kvroute.inflight_unseen.requests.pool/_",
                "kvroute.inflight_unseen.tokens.pool/_",
                "kvroute.inflight_unseen.requests.pool/a_b_",
                "kvroute.inflight_unseen.tokens.pool/a_b_",
            ]
            .map(str::to_owned)
        );
    }

    /// A control plane whose clock runs 1 s ahead of Envoy's: its snapshot's times are
    /// moved to Envoy's clock at publication, so a reservation made after the publication
    /// is not taken as seen by a scrape that, on the control plane's clock, came later.
    #[test]
    fn a_control_plane_clock_ahead_does_not_hide_reservations() {
        let h = MockHost::new(10_000);
        crate::shared::ensure_keys(&h).unwrap();
        let snap = Snapshot::new(1, 11_000, vec![endpoint(0, 11_000), endpoint(1, 10_900)]);
        crate::shared::publish_snapshot(&h, &snap.encode()).unwrap();
        let mut w = numbered(&h, "{}");
        let seen = w.cache.current(&h).unwrap().unwrap();
        let at: Vec<u64> = seen.endpoints.iter().map(|e| e.scraped_at_ms).collect();
        assert_eq!((seen.generated_at_ms, at), (10_000, vec![10_000, 9_900]));
        w.inflight.reserve(1, "pool/e0", 100, 0, 10_010, 60_000);
        let g = |name: &str| h.named_gauges.borrow().get(name).copied();
        w.record_gauges(&h, 10_010);
        assert_eq!(g("kvroute.inflight_unseen.requests.pool/e0"), Some(1));
        assert_eq!(g("kvroute.inflight_unseen.tokens.pool/e0"), Some(100));
    }

    #[test]
    fn no_snapshot_fails_open() {
        let h = MockHost::new(1000);
        let mut w = worker("{}");
        assert!(matches!(
            w.decide(&h, "/v1/chat/completions", None, h.now_ms()),
            Decision::FailOpen(_)
        ));
    }

    #[test]
    fn reserve_and_release_exactly_once() {
        let h = MockHost::new(1000);
        let mut w = worker("{}");
        let mut routed = Routed {
            value: "c1".into(),
            reason: "r".into(),
            route: Route {
                primary: 1,
                endpoint: "pool/e1".into(),
                fallbacks: vec![],
                reserve_tokens: 500,
                prefill_tokens: 300,
                policy: kvroute_core::picker::PolicyKind::Hybrid,
                reason: PickReason::Policy,
                demand_over_capacity: false,
                prefix_blocks: 0,
                prefix_match_blocks: 0,
                class: None,
                facts: RequestFacts::default(),
                candidates: vec![],
            },
            at_ms: 1000,
        };
        let held = w.apply_route(&h, &mut routed);
        assert_eq!(h.header("x-kvroute-cluster").as_deref(), Some("c1"));
        let own = |w: &Worker| w.inflight.own().totals(1000).get("pool/e1").copied();
        assert_eq!(
            own(&w),
            Some(InFlight {
                requests: 1,
                tokens: 500,
                prefill_tokens: 300,
            })
        );
        h.take_calls();
        w.prefill_done(&held);
        assert_eq!(h.take_calls(), [], "in memory: no host call");
        assert_eq!(
            own(&w),
            Some(InFlight {
                requests: 1,
                tokens: 500,
                prefill_tokens: 0,
            })
        );
        // The in-flight gauge is the tick's job, not the request's.
        assert_eq!(h.metric(metric::INFLIGHT), 0);
        w.record_gauges(&h, 1000);
        assert_eq!(h.metric(metric::INFLIGHT), 1);
        h.take_calls();
        w.release(&held);
        w.release(&held);
        assert_eq!(h.take_calls(), [], "in memory: no host call");
        assert_eq!(own(&w), None);
        // Counted on the tick (or with the next reservation's counters), once.
        assert_eq!(h.metric(metric::RELEASED), 0);
        w.periodic(&h);
        assert_eq!(h.metric(metric::RESERVED), 1);
        assert_eq!(h.metric(metric::RELEASED), 1);
        w.record_gauges(&h, 1000);
        assert_eq!(h.metric(metric::INFLIGHT), 0);
    }

    #[test]
    fn decisions_count_other_workers_reservations_once_published_and_read() {
        let h = MockHost::new(1000);
        crate::shared::ensure_keys(&h).unwrap();
        let other = h.sibling();
        let eps = vec![endpoint(0, 1000), endpoint(1, 1000)];
        crate::shared::publish_snapshot(&h, &Snapshot::new(1, 1000, eps).encode()).unwrap();
        let mut a = numbered(&h, "{}");
        let mut b = numbered(&other, "{}");
        let route = |w: &mut Worker, host: &MockHost, now: u64| match w.decide(
            host,
            "/v1/chat/completions",
            None,
            now,
        ) {
            Decision::Route(mut r) => {
                r.at_ms = now;
                w.apply_route(host, &mut r)
            }
            d => panic!("{d:?}"),
        };
        // Load only: each worker spreads its own requests at once.
        let a1 = route(&mut a, &h, 1000);
        let a2 = route(&mut a, &h, 1001);
        assert_ne!(a1.endpoint, a2.endpoint);
        // b read a's table at its first decision (a published its first reservation at
        // once): its first pick avoids a1's endpoint... and a2's is not seen yet.
        let b1 = route(&mut b, &other, 1001);
        assert_eq!(b1.endpoint, a2.endpoint, "a2 was not published yet");
        // 20 ms on, a's next reservation publishes; b's next decision reads it.
        h.take_calls();
        let a3 = route(&mut a, &h, 1021);
        let calls = h.take_calls();
        assert!(calls.contains(&("shared_set", 1)), "{calls:?}");
        assert_eq!(a.inflight.own().len(), 3);
        assert_eq!(b.inflight.live(1021), 2, "b1, and a1 as read at 1001");
        b.inflight.refresh_peers(&other, 1021);
        assert_eq!(b.inflight.live(1021), 4, "b1 and a1..a3");
        // Within the interval a decision reads only the snapshot signal; b's own table,
        // last published at 1001, is due for publication (one write).
        other.take_calls();
        route(&mut b, &other, 1030);
        let calls = other.take_calls();
        assert!(calls.contains(&("shared_get", 1)), "{calls:?}");
        assert!(calls.contains(&("shared_set", 1)), "{calls:?}");
        // Then, within the interval of both, none but the signal.
        route(&mut b, &other, 1035);
        let calls = other.take_calls();
        assert!(calls.contains(&("shared_get", 1)), "{calls:?}");
        assert!(!calls.iter().any(|(c, _)| *c == "shared_set"), "{calls:?}");
        // Releases reach b with a's tick.
        for held in [&a1, &a2, &a3] {
            a.release(held);
        }
        a.periodic(&h);
        assert_eq!(h.metric(metric::RELEASED), 3);
        b.inflight.refresh_peers(&other, 1050);
        assert_eq!(b.inflight.live(1050), 3, "b's own three");
    }

    #[test]
    fn calibration_moves_toward_actual() {
        let h = MockHost::new(0);
        let mut w = worker("{}");
        let facts = RequestFacts {
            model: Some("m".into()),
            prompt_tokens: 100,
            exact: false,
            stream: false,
            n: 1,
            predicted_work_tokens: 0.0,
        };
        w.observe_usage(&h, &facts, 200);
        let f = w.estimator().calibration(Some("m"));
        assert!((f - 1.1).abs() < 1e-9, "{f}");
        let exact = RequestFacts {
            exact: true,
            ..facts
        };
        w.observe_usage(&h, &exact, 10_000);
        assert!((w.estimator().calibration(Some("m")) - 1.1).abs() < 1e-9);
    }

    #[test]
    fn restarted_or_removed_endpoints_lose_prefix_state() {
        let h = MockHost::new(1000);
        let mut e = (0..2).map(|i| endpoint(i, 1000)).collect::<Vec<_>>();
        e[0].process_start_ms = Some(1);
        e[1].process_start_ms = Some(1);
        crate::shared::publish_snapshot(&h, &Snapshot::new(1, 1000, e.clone()).encode()).unwrap();
        let mut w = worker(r#"{"picker":{"policy":"round_robin"}}"#);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        for _ in 0..2 {
            assert!(matches!(
                w.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms()),
                Decision::Route(_)
            ));
        }
        assert_eq!(w.prefix_blocks("pool/e0"), 10);
        assert_eq!(w.prefix_blocks("pool/e1"), 10);
        e[0].process_start_ms = Some(2);
        let e1 = e.remove(1);
        crate::shared::publish_snapshot(&h, &Snapshot::new(2, 1000, e).encode()).unwrap();
        let _ = w.decide(&h, "/v1/models", None, h.now_ms());
        assert_eq!(w.prefix_blocks("pool/e0"), 0, "restarted");
        assert_eq!(w.prefix_blocks(&e1.id), 0, "removed");
        assert_eq!(
            h.metric(metric::decisions_by_policy(
                kvroute_core::picker::PolicyKind::RoundRobin
            )),
            3
        );
    }

    /// A mock host with a snapshot of `endpoints` endpoints and the shared keys, and two
    /// default workers on it, numbered 1 and 2.
    fn two_workers(endpoints: usize) -> (MockHost, Worker, Worker) {
        let h = MockHost::new(1000);
        let snap = Snapshot::new(1, 1000, (0..endpoints).map(|i| endpoint(i, 1000)).collect());
        crate::shared::publish_snapshot(&h, &snap.encode()).unwrap();
        crate::shared::ensure_keys(&h).unwrap();
        let (mut a, mut b) = (worker("{}"), worker("{}"));
        a.set_worker_number(1);
        b.set_worker_number(2);
        (h, a, b)
    }

    /// The affinity journal's part of one [`Worker::sync`].
    fn affinity(w: &mut Worker, h: &MockHost) -> Synced {
        w.sync(h).affinity.unwrap()
    }

    #[test]
    fn workers_share_prefix_affinity_through_the_journal() {
        let (h, mut a, mut b) = two_workers(4);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "s".repeat(640));
        let chosen = match a.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms()) {
            Decision::Route(r) => r.route.endpoint,
            d => panic!("{d:?}"),
        };
        assert_eq!(b.prefix_blocks(&chosen), 0, "not shared yet");
        let sa = affinity(&mut a, &h);
        assert_eq!((sa.imported, sa.published), (0, 1));
        let sb = affinity(&mut b, &h);
        assert_eq!((sb.imported, sb.published), (1, 0));
        assert_eq!(b.prefix_blocks(&chosen), 10);
        for _ in 0..3 {
            match b.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms()) {
                Decision::Route(r) => assert_eq!(r.route.endpoint, chosen),
                d => panic!("{d:?}"),
            }
        }
        // B's chains reach A; neither re-imports what it already saw or wrote itself.
        assert_eq!(
            affinity(&mut b, &h),
            Synced {
                imported: 0,
                published: 3
            }
        );
        assert_eq!(affinity(&mut a, &h).imported, 3);
        assert_eq!(affinity(&mut a, &h).imported, 0);
        assert_eq!(h.metric(metric::AFFINITY_IMPORTED), 4);
        assert_eq!(h.metric(metric::AFFINITY_PUBLISHED), 4);
        // A corrupt journal is replaced, not fatal.
        h.shared_set(crate::names::AFFINITY_KEY, b"garbage", None)
            .unwrap();
        let _ = a.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms());
        assert_eq!(affinity(&mut a, &h).published, 1);
        assert_eq!(h.metric(metric::AFFINITY_RESET), 1);
        assert_eq!(affinity(&mut b, &h).imported, 1, "after the reset");
        // Off: nothing is kept or synced by the tick.
        let mut off = worker(r#"{"share_affinity":false}"#);
        let _ = off.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms());
        off.periodic(&h);
        assert_eq!(h.metric(metric::AFFINITY_PUBLISHED), 5);
    }

    /// The tick period: the most frequent need, at least 1 ms.
    #[test]
    fn tick_period_is_the_most_frequent_need() {
        let c = |json: &str| Config::parse(json.as_bytes()).unwrap();
        // Workers share affinity by default (`affinity_sync_ms` 100).
        assert_eq!(tick_period_ms(&c(r#"{"mode":"cluster"}"#)), 100);
        assert_eq!(
            tick_period_ms(&c(
                r#"{"mode":"cluster","share_affinity":false,"share_learning":false}"#
            )),
            RELEASE_FLUSH_MS
        );
        assert_eq!(
            tick_period_ms(&c(
                r#"{"mode":"cluster","admission":{"enabled":true,"tick_ms":7}}"#
            )),
            7
        );
        assert_eq!(
            tick_period_ms(&c(r#"{"mode":"cluster","affinity_sync_ms":20}"#)),
            20
        );
    }

    /// `flush` syncs the journal and re-reads the other workers' tables now, where
    /// `periodic` waits out `affinity_sync_ms` and `inflight_share_ms` (a worker going
    /// idle without a timer, the native build).
    #[test]
    fn flush_syncs_now_where_periodic_waits() {
        let (h, mut a, mut b) = two_workers(4);
        // The worker counter says two, so each reads the other's in-flight table.
        for n in 1..=2 {
            assert_eq!(crate::shared::next_worker_number(&h).unwrap(), n);
        }
        a.periodic(&h);
        b.periodic(&h);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "s".repeat(640));
        let chosen = match a.decide(&h, "/v1/completions", Some(body.as_bytes()), h.now_ms()) {
            Decision::Route(mut r) => {
                let _held = a.apply_route(&h, &mut r);
                r.route.endpoint
            }
            d => panic!("{d:?}"),
        };
        // Same millisecond as the last sync: the tick publishes the reservation (a dirty
        // table is published at every tick) but not the journal.
        a.periodic(&h);
        assert_eq!(h.metric(metric::AFFINITY_PUBLISHED), 0);
        a.flush(&h);
        assert_eq!(h.metric(metric::AFFINITY_PUBLISHED), 1);
        // Nothing new to publish: a second flush does not sync the journal again.
        a.flush(&h);
        assert_eq!(h.metric(metric::AFFINITY_PUBLISHED), 1);
        // B's copy of A's in-flight table is as fresh as its last read: `periodic` keeps it,
        // `flush` reads A's reservation. B has nothing to publish, so it imports A's chain
        // at its next due tick, not at its flush.
        b.periodic(&h);
        assert_eq!(b.inflight.live(h.now_ms()), 0);
        b.flush(&h);
        assert_eq!(b.inflight.live(h.now_ms()), 1);
        assert_eq!(b.prefix_blocks(&chosen), 0);
        *h.now.borrow_mut() += 100;
        b.periodic(&h);
        assert_eq!(b.prefix_blocks(&chosen), 10);
    }

    #[test]
    fn workers_share_learner_observations_through_the_journal() {
        let (h, mut a, mut b) = two_workers(2);
        let chat = kvroute_core::analysis::ApiKind::ChatCompletions;
        // A sees 3 first tokens of pool/e1 and 25 chat responses of model m (the output
        // learner answers from 20 on); a bad sample is neither used nor shared.
        for (work, ttft) in [(2000.0, 0.25), (4000.0, 0.45), (8000.0, 0.85), (0.0, 1.0)] {
            a.observe_first_token("pool/e1", work, ttft);
        }
        for i in 0..25 {
            a.observe_output("m", chat, 1000, 100 + i);
        }
        a.observe_output("m", chat, 1000, 0);
        assert!(b.router().prefill_rates().is_empty());
        assert_eq!(
            b.router()
                .output_lengths()
                .predict("m", chat, 1000, None, 0.5),
            None
        );
        let learned = |w: &mut Worker| w.sync(&h).learned.unwrap();
        assert_eq!(
            learned(&mut a),
            Synced {
                imported: 0,
                published: 28
            }
        );
        assert_eq!(
            learned(&mut b),
            Synced {
                imported: 28,
                published: 0
            }
        );
        // B now believes exactly what A learned.
        assert_eq!(
            b.router().prefill_rates().estimate("pool/e1"),
            a.router().prefill_rates().estimate("pool/e1")
        );
        assert_eq!(
            b.router().prefill_rates().estimate("pool/e1").observations,
            3
        );
        let median = |w: &Worker| {
            w.router()
                .output_lengths()
                .predict("m", chat, 1000, None, 0.5)
        };
        assert!(median(&b).is_some());
        assert_eq!(median(&b), median(&a));
        // Nothing is imported twice, nor re-published by the importer.
        assert_eq!(learned(&mut b), Synced::default());
        assert_eq!(learned(&mut a), Synced::default());
        assert_eq!(h.metric(metric::LEARNED_IMPORTED), 28);
        assert_eq!(h.metric(metric::LEARNED_PUBLISHED), 28);
        // A corrupt journal is replaced, not fatal.
        h.shared_set(crate::names::LEARNED_KEY, b"garbage", None)
            .unwrap();
        a.observe_first_token("pool/e0", 1000.0, 0.1);
        assert_eq!(learned(&mut a).published, 1);
        assert_eq!(h.metric(metric::LEARNED_RESET), 1);
        assert_eq!(learned(&mut b).imported, 1);
        // A record under a worker's own number is never replayed into it (the writer skip),
        // only into the others.
        let rec = kvroute_core::observation::Observation::FirstToken {
            endpoint: "pool/e1".into(),
            work_tokens: 500.0,
            ttft_s: 0.05,
        }
        .to_record();
        let journal = kvroute_core::affinity::append(None, 7, 1000, &[rec], 1 << 20, u64::MAX);
        h.shared_set(crate::names::LEARNED_KEY, &journal, None)
            .unwrap();
        let (mut c, mut d) = (worker("{}"), worker("{}"));
        c.set_worker_number(7);
        d.set_worker_number(8);
        assert_eq!(learned(&mut c).imported, 0);
        assert!(c.router().prefill_rates().is_empty());
        assert_eq!(learned(&mut d).imported, 1);
        // Off: the learner still learns, but nothing is kept or synced.
        let mut off = worker(r#"{"share_learning":false}"#);
        off.observe_first_token("pool/e0", 1000.0, 0.1);
        assert_eq!(off.router().prefill_rates().len(), 1);
        assert_eq!(off.sync(&h).learned, None);
        off.periodic(&h);
        assert_eq!(h.metric(metric::LEARNED_PUBLISHED), 29);
    }

    #[test]
    fn decision_reason_names_endpoint_and_load_only_cause() {
        let h = MockHost::new(1000);
        let snap = Snapshot::new(1, 1000, vec![endpoint(0, 1000)]);
        crate::shared::publish_snapshot(&h, &snap.encode()).unwrap();
        let mut w = worker(r#"{"debug_header":true}"#);
        let reason = |d: Decision| match d {
            Decision::Route(r) => r.reason,
            d => panic!("unexpected {d:?}"),
        };
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            reason(w.decide(&h, "/v1/chat/completions", Some(body), h.now_ms())),
            "policy:hybrid;endpoint=pool/e0"
        );
        assert_eq!(
            reason(w.decide(&h, "/v1/chat/completions", Some(b"{\"model\":"), h.now_ms())),
            "policy:hybrid;endpoint=pool/e0;load_only=unparsable"
        );
        assert_eq!(h.metric(metric::PARSE_ERRORS), 1);
        // Prefix blocks matched on the chosen endpoint / hashed: none, then all 10.
        let long = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        for matched in [0, 10] {
            assert_eq!(
                reason(w.decide(&h, "/v1/completions", Some(long.as_bytes()), h.now_ms())),
                format!("policy:hybrid;endpoint=pool/e0;prefix={matched}/10")
            );
        }
        let r = w.decide(&h, "/v1/chat/completions", None, h.now_ms());
        let Decision::Route(mut r) = r else {
            panic!("not routed")
        };
        assert_eq!(
            r.reason,
            "policy:hybrid;endpoint=pool/e0;load_only=body_not_read"
        );
        w.apply_route(&h, &mut r);
        assert_eq!(
            h.header(DECISION_HEADER).as_deref(),
            Some(r.reason.as_str())
        );
    }

    #[test]
    fn decision_record_lists_the_top_candidates_as_filter_state() {
        let h = MockHost::new(1000);
        let mut eps: Vec<EndpointStats> = (0..2).map(|i| endpoint(i, 1000)).collect();
        eps[1].kv_usage = Some(0.6);
        crate::shared::publish_snapshot(&h, &Snapshot::new(1, 1000, eps).encode()).unwrap();
        let body = br#"{"model":"m","prompt":"hello","max_tokens":100}"#;
        // Off (the default): no record, no property.
        let mut w = worker("{}");
        let Decision::Route(mut r) = w.decide(&h, "/v1/completions", Some(body), h.now_ms()) else {
            panic!("not routed")
        };
        // Neither the debug header nor the record shows it: not built.
        assert_eq!(r.reason, "");
        let held = w.apply_route(&h, &mut r);
        assert_eq!(h.property(&[DECISION_PROPERTY]), None);
        w.release(&held);
        // On: the reason gains the ranked candidates, and becomes filter state.
        let mut w = worker(r#"{"decision_record":true}"#);
        let Decision::Route(mut r) = w.decide(&h, "/v1/completions", Some(body), h.now_ms()) else {
            panic!("not routed")
        };
        let demand = w.router().demand(&kvroute_core::router::RequestInfo {
            model: Some("m".into()),
            prompt_tokens: r.route.facts.prompt_tokens,
            max_output_tokens: Some(100),
            api: kvroute_core::analysis::ApiKind::Completions,
            n: 1,
            ..Default::default()
        });
        let headroom = |u: f64| 1.0 - u - demand.1.tokens as f64 / 100_000.0;
        let kv0 = format!("kv={:.3}", headroom(0.1));
        let kv1 = format!("kv={:.3}", headroom(0.6));
        let (head, top) = r.reason.split_once(";top=").unwrap();
        assert_eq!(head, "policy:hybrid;endpoint=pool/e0");
        let cands: Vec<&str> = top.split("],").collect();
        assert_eq!(cands.len(), 2, "{top}");
        assert!(cands[0].starts_with("pool/e0[score="), "{top}");
        assert!(cands[1].starts_with("pool/e1[score="), "{top}");
        assert!(cands[0].contains(&kv0) && cands[1].contains(&kv1), "{top}");
        for c in &cands {
            assert!(
                c.contains(
                    ",queue=1.000,inflight=1.000,prefill=0.000,prefix=0.000,blocks=0,load=0"
                ),
                "{c}"
            );
            assert!(c.contains(",ttft_ms="), "{c}");
        }
        w.apply_route(&h, &mut r);
        assert_eq!(h.property(&[DECISION_PROPERTY]), Some(r.reason.clone()));
    }

    #[test]
    fn endpoint_mode_header_lists_fallbacks() {
        let h = MockHost::new(1000);
        let snap = Snapshot::new(1, 1000, (0..3).map(|i| endpoint(i, 1000)).collect());
        crate::shared::publish_snapshot(&h, &snap.encode()).unwrap();
        let mut w =
            worker(r#"{"mode":"endpoint","picker":{"policy":"round_robin","max_fallbacks":2}}"#);
        match w.decide(&h, "/v1/models", None, h.now_ms()) {
            Decision::Route(r) => {
                assert_eq!(w.config.routing_header(), "x-gateway-destination-endpoint");
                let value = r.value;
                let parts: Vec<&str> = value.split(',').collect();
                assert_eq!(parts.len(), 3, "{value}");
                for p in parts {
                    assert!(p.starts_with("127.0.0.1:900"), "{value}");
                }
            }
            d => panic!("unexpected {d:?}"),
        }
    }
}
