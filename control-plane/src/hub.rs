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
//! Versions: `max(now in Unix µs, previous + 1)`. The wall clock makes versions grow
//! across control-plane restarts (receivers drop snapshots not newer than theirs); the
//! `+ 1` keeps them growing if the clock steps back while running.

use crate::adapters::ServerStats;
use crate::config::EndpointSpec;
use crate::restart::RestartTracker;
use crate::telemetry::{EndpointLabel, StateLabel, Telemetry};
use bytes::Bytes;
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Last scrape succeeded.
    pub healthy: bool,
    /// Unix ms of the last successful scrape; 0 before the first.
    pub scraped_at_ms: u64,
    /// At least one scrape finished (either way).
    pub attempted: bool,
    /// Last scrape error, for logs and `/v1/snapshot` debugging.
    pub last_error: Option<String>,
    /// Restart detection.
    pub restart: RestartTracker,
}

impl EndpointState {
    fn new(spec: EndpointSpec) -> Self {
        Self {
            spec,
            stats: None,
            healthy: false,
            scraped_at_ms: 0,
            attempted: false,
            last_error: None,
            restart: RestartTracker::default(),
        }
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
        }
    }
}

/// A published snapshot.
#[derive(Debug, Clone)]
pub struct Published {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// Its wire encoding.
    pub body: Bytes,
    /// When the earliest scrape folded into it finished (`None` for heartbeats without a
    /// change); the push tasks measure scrape-to-push latency from it.
    pub changed_at: Option<Instant>,
}

/// Shared state.
pub struct Hub {
    fleet: Mutex<BTreeMap<String, EndpointState>>,
    pending_since: Mutex<Option<Instant>>,
    timing: Mutex<(Duration, Duration, Duration)>,
    changed: Notify,
    dirty: AtomicBool,
    published: watch::Sender<Option<Arc<Published>>>,
    last_version: Mutex<u64>,
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
            pending_since: Mutex::new(None),
            timing: Mutex::new((heartbeat, min_interval, first_wait)),
            changed: Notify::new(),
            dirty: AtomicBool::new(true),
            published,
            last_version: Mutex::new(0),
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
        fleet.retain(|id, st| {
            let keep = specs.iter().any(|s| &s.id == id && *s == st.spec);
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
        drop(fleet);
        for id in gone {
            let label = EndpointLabel { endpoint: id };
            self.telemetry.scrape_duration.remove(&label);
            self.telemetry.restarts.remove(&label);
        }
        self.mark_dirty();
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
            st.stats = Some(stats);
            st.healthy = true;
            st.attempted = true;
            st.scraped_at_ms = at_ms;
            st.last_error = None;
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

    /// Record a failed scrape of `id`.
    pub fn record_failure(&self, id: &str, error: String) {
        let changed = {
            let mut fleet = lock(&self.fleet);
            let Some(st) = fleet.get_mut(id) else { return };
            let changed = st.healthy || !st.attempted;
            st.healthy = false;
            st.attempted = true;
            st.last_error = Some(error);
            changed
        };
        if changed {
            self.mark_dirty();
        } else {
            // Still wakes the builder's first-round wait.
            self.changed.notify_one();
        }
    }

    /// A copy of one endpoint's state.
    pub fn endpoint(&self, id: &str) -> Option<EndpointState> {
        lock(&self.fleet).get(id).cloned()
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

    /// Endpoint counts: (healthy, unhealthy, pending).
    pub fn counts(&self) -> (i64, i64, i64) {
        let fleet = lock(&self.fleet);
        let mut c = (0, 0, 0);
        for s in fleet.values() {
            if !s.attempted {
                c.2 += 1;
            } else if s.healthy {
                c.0 += 1;
            } else {
                c.1 += 1;
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

    /// Ready: a snapshot was published.
    pub fn ready(&self) -> bool {
        self.published.borrow().is_some()
    }

    /// Refresh the gauges computed on read (snapshot age, endpoints by state).
    pub fn refresh_gauges(&self) {
        let t = &self.telemetry;
        if let Some(p) = self.latest() {
            let age = now_ms().saturating_sub(p.snapshot.generated_at_ms) as f64 / 1000.0;
            t.snapshot_age.set(age);
            t.snapshot_version
                .set(i64::try_from(p.snapshot.version).unwrap_or(i64::MAX));
        }
        let (h, u, p) = self.counts();
        for (state, n) in [("healthy", h), ("unhealthy", u), ("pending", p)] {
            t.endpoints
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .set(n);
        }
    }

    /// Build and publish a snapshot of the current fleet now.
    pub fn publish(&self) -> Arc<Published> {
        let endpoints = self.wire_endpoints();
        let changed_at = lock(&self.pending_since).take();
        let version = {
            let mut last = lock(&self.last_version);
            let v = now_us().max(last.saturating_add(1));
            *last = v;
            v
        };
        let snapshot = Snapshot::new(version, now_ms(), endpoints);
        let body = Bytes::from(snapshot.encode());
        let p = Arc::new(Published {
            snapshot,
            body,
            changed_at,
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
