//! Per-worker routing state and the decision glue: snapshot → analysis → demand → prefix
//! match → picker → header + reservation. Pure over [`Host`]; no proxy-wasm types.
//!
//! Decision outcomes:
//! - a pick sets the routing header (cluster name, or `host:port[,fallback...]`), asks Envoy
//!   to clear its route cache, and reserves the request's KV demand (tokens) on the chosen
//!   endpoint in the shared in-flight table;
//! - no endpoint for the model → JSON 503;
//! - every endpoint saturated → held in the admission queue when enabled, else JSON 429
//!   with `retry-after`;
//! - no snapshot yet, or an internal error → fail open: no header is set and Envoy's
//!   default route applies (counter `kvroute.fail_open`), or JSON 503 when
//!   `fail_open` is false.
//!
//! Requests routed without their body (no body, upgrade, over `max_body_bytes`, encoded)
//! are picked with zero prompt tokens: the policy then ranks by load alone.

use crate::config::{Config, Mode};
use crate::host::{Host, Level, MetricKind};
use crate::names::{metric, DECISION_HEADER};
use crate::shared::{self, SnapshotCache};
use kvroute_core::admission::AdmissionQueue;
use kvroute_core::analysis::{analyze_bounded, ApiKind, RequestAnalysis};
use kvroute_core::estimate::Estimator;
use kvroute_core::picker::{InFlight, PickInput, PickOutcome, PickReason, PickRequest, Picker};
use kvroute_core::prefix::{block_hashes, PrefixIndex};
use kvroute_core::profile::{builtin, ModelProfile};
use std::collections::BTreeMap;

/// True when `e` serves `model` (base model or LoRA adapter; any model when `None`), as
/// kvroute-core's picker filters candidates.
fn serves(e: &kvroute_core::snapshot::EndpointStats, model: Option<&str>) -> bool {
    model.is_none_or(|m| e.models.iter().any(|x| x == m) || e.lora_adapters.iter().any(|x| x == m))
}

/// Output limit assumed for a model without a profile and a request without a limit,
/// tokens (vLLM's and OpenAI's legacy completions default `max_tokens` is 16; chat has none,
/// so a conservative 256 keeps reservations meaningful).
pub const UNKNOWN_MODEL_OUTPUT_TOKENS: u64 = 256;

/// Calibration learning rate (EWMA weight of one observation).
pub const CALIBRATION_ALPHA: f64 = 0.1;
/// Calibration factor bounds.
pub const CALIBRATION_RANGE: (f64, f64) = (0.25, 4.0);

/// A reservation held by one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Reservation id in the shared table.
    pub id: u64,
    /// Endpoint id.
    pub endpoint: String,
    /// Tokens reserved.
    pub tokens: u64,
    /// Pending prefill tokens recorded with the reservation; 0 once
    /// [`Worker::prefill_done`] ran (the first response bytes arrived).
    pub prefill_tokens: u64,
}

/// What the request told us, kept for calibration at response time.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestFacts {
    /// Model name.
    pub model: Option<String>,
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// Exact (token ids)?
    pub exact: bool,
}

/// A decision to apply.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Route: set `header` to `value`, reserve `tokens` on `endpoint`.
    Route {
        /// Header name.
        header: String,
        /// Header value.
        value: String,
        /// Endpoint id.
        endpoint: String,
        /// KV demand, tokens.
        tokens: u64,
        /// Pending prefill on `endpoint`, tokens: estimated prompt minus the prefix tokens
        /// the prefix index expects cached there
        /// ([`kvroute_core::picker::uncached_prompt_tokens`]).
        prefill_tokens: u64,
        /// Reason (debug header): `policy:<name>` or `stale_fallback`.
        reason: String,
        /// Facts for calibration.
        facts: RequestFacts,
    },
    /// No endpoint serves the request.
    NoEndpoints,
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

/// A request parked in the admission queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parked {
    /// HTTP context id.
    pub context_id: u32,
    /// Request path.
    pub path: String,
    /// Request body (empty when decided without it).
    pub body: Vec<u8>,
}

/// Per-worker state, shared by the root context and the worker's HTTP contexts.
#[derive(Debug)]
pub struct Worker {
    /// Configuration.
    pub config: Config,
    picker: Picker,
    /// Estimator (with learned calibration).
    pub estimator: Estimator,
    prefix: PrefixIndex,
    /// Snapshot cache.
    pub cache: SnapshotCache,
    profiles: BTreeMap<String, ModelProfile>,
    id_prefix: u64,
    seq: u32,
    /// Admission queue.
    pub admission: AdmissionQueue<Parked>,
    /// Reservations made by the tick for parked requests, by context id.
    pub resumed: BTreeMap<u32, (Held, RequestFacts, u64)>,
    /// Snapshot version the prefix index was last reconciled with, and each endpoint's
    /// process start time then.
    seen_version: Option<u64>,
    process_starts: BTreeMap<String, Option<u64>>,
}

impl Worker {
    /// Build from a validated config and a seed (time + context id; no OS randomness).
    pub fn new(config: Config, seed: u64) -> Result<Self, kvroute_core::picker::ConfigError> {
        let picker = Picker::new(config.picker.clone(), seed)?;
        let estimator = Estimator::new(config.estimator.clone());
        let prefix = PrefixIndex::new(config.prefix_index_blocks);
        let profiles = config
            .models
            .iter()
            .map(|m| (m.name.clone(), m.clone()))
            .collect();
        let admission = AdmissionQueue::new(config.admission.max_queue);
        let mut rng = fastrand::Rng::with_seed(seed);
        Ok(Self {
            config,
            picker,
            estimator,
            prefix,
            cache: SnapshotCache::default(),
            profiles,
            id_prefix: rng.u64(..) & 0xFFFF_FFFF_0000_0000,
            seq: 0,
            admission,
            resumed: BTreeMap::new(),
            seen_version: None,
            process_starts: BTreeMap::new(),
        })
    }

    fn profile(&self, model: Option<&str>) -> Option<ModelProfile> {
        let m = model?;
        self.profiles.get(m).cloned().or_else(|| builtin(m))
    }

    /// On a new snapshot: forget prefix-affinity state of endpoints that left the fleet or
    /// restarted (their prefix cache is cold: `process_start_ms` changed).
    fn reconcile_prefix_index(&mut self, snap: &kvroute_core::snapshot::Snapshot) {
        let mut starts = BTreeMap::new();
        for e in &snap.endpoints {
            if let Some(old) = self.process_starts.get(&e.id) {
                if old.is_some() && *old != e.process_start_ms {
                    self.prefix.forget(&e.id);
                }
            }
            starts.insert(e.id.clone(), e.process_start_ms);
        }
        self.prefix.retain(|id| starts.contains_key(id));
        self.process_starts = starts;
        self.seen_version = Some(snap.version);
    }

    /// Blocks remembered for `endpoint_id` in the prefix index.
    pub fn prefix_blocks(&self, endpoint_id: &str) -> usize {
        self.prefix.len(endpoint_id)
    }

    /// Make reservation ids unique across workers: `worker` (from
    /// [`crate::shared::next_worker_number`]) becomes the upper 16 bits.
    pub fn set_worker_number(&mut self, worker: u32) {
        // Keep 16 random bits beside a 16-bit worker number: even if two workers raced to
        // the same number (see `shared::ensure_keys`), their ids still differ.
        self.id_prefix =
            (u64::from(worker & 0xFFFF) << 48) | (self.id_prefix & 0x0000_FFFF_0000_0000);
    }

    /// A fresh reservation id: the worker's upper 32 bits (unique per worker once
    /// [`Self::set_worker_number`] ran; random otherwise), a counter below.
    pub fn next_id(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        self.id_prefix | u64::from(self.seq)
    }

    /// Decide for a request to `path` with `body` (`None`: decided without the body).
    pub fn decide<H: Host>(&mut self, host: &H, path: &str, body: Option<&[u8]>) -> Decision {
        let now = host.now_ms();
        let snap = match self.cache.current(host) {
            Ok(Some(s)) => s,
            Ok(None) => return Decision::FailOpen("no snapshot received yet".into()),
            Err(e) => return Decision::FailOpen(format!("snapshot unreadable: {e}")),
        };
        if self.seen_version != Some(snap.version) {
            self.reconcile_prefix_index(&snap);
        }
        host.metric_record(
            MetricKind::Gauge,
            metric::SNAPSHOT_AGE_MS,
            now.saturating_sub(snap.generated_at_ms),
        );
        let api = ApiKind::from_path(path);
        let analysis: Option<RequestAnalysis> = match body {
            Some(b) if api != ApiKind::Other => {
                match analyze_bounded(api, b, &self.estimator, self.config.prefix.max_bytes()) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        host.metric_add(MetricKind::Counter, metric::PARSE_ERRORS, 1);
                        host.log(Level::Debug, &format!("kvroute: body not analysed: {e}"));
                        None
                    }
                }
            }
            _ => None,
        };
        if analysis.is_none() {
            host.metric_add(MetricKind::Counter, metric::DECISIONS_LOAD_ONLY, 1);
        }
        let model = analysis.as_ref().and_then(|a| a.model.clone());
        let (prompt, output_limit, demand) = match &analysis {
            Some(a) => match self.profile(a.model.as_deref()) {
                Some(p) => {
                    let d = p.demand(a);
                    (a.prompt_tokens, u64::from(p.output_limit(a)), d.tokens)
                }
                None => {
                    let out = a
                        .max_output_tokens
                        .map(u64::from)
                        .unwrap_or(UNKNOWN_MODEL_OUTPUT_TOKENS)
                        .saturating_mul(u64::from(a.n.max(1)));
                    (a.prompt_tokens, out, a.prompt_tokens.saturating_add(out))
                }
            },
            None => (0, 0, 0),
        };
        let hashes = match &analysis {
            Some(a) => block_hashes(
                a.model.as_deref().unwrap_or(""),
                a.cache_salt.as_deref(),
                &a.prefix_text,
                &self.config.prefix,
            ),
            None => Vec::new(),
        };
        let table = match shared::read_inflight(host) {
            Ok(t) => t,
            Err(e) => return Decision::FailOpen(format!("in-flight table unreadable: {e}")),
        };
        // Only reservations the snapshot cannot show yet (made since each endpoint's scrape).
        let scraped: std::collections::BTreeMap<&str, u64> = snap
            .endpoints
            .iter()
            .map(|e| (e.id.as_str(), e.scraped_at_ms))
            .collect();
        let totals = table.unseen_totals(now, |id| scraped.get(id).copied());
        let inflight: Vec<InFlight> = snap
            .endpoints
            .iter()
            .map(|e| totals.get(&e.id).copied().unwrap_or_default())
            .collect();
        let matches = self.prefix.match_snapshot(&hashes, &snap);
        let req = PickRequest {
            model: model.as_deref(),
            api,
            prompt_tokens: prompt,
            output_limit,
            demand_tokens: demand,
            prefix_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
        };
        let input = PickInput {
            snapshot: &snap,
            inflight: &inflight,
            prefix_match_blocks: &matches,
            now_ms: now,
        };
        let mut outcome = self.picker.pick(&input, &req);
        let mut reserve = demand;
        if outcome == PickOutcome::NoCapacity {
            // Larger than the whole KV cache of every endpoint serving the model: it can never
            // fit, so a 429 "retry later" would never clear. Route it by load (demand 0 in
            // the pick) and let the model server answer (vLLM preempts, or 400s an output
            // limit beyond max_model_len); reserve at most the chosen capacity.
            let largest = snap
                .endpoints
                .iter()
                .filter(|e| e.healthy && serves(e, model.as_deref()))
                .filter_map(|e| e.kv_capacity_tokens)
                .max();
            if let Some(cap) = largest.filter(|&cap| demand > cap) {
                host.metric_add(MetricKind::Counter, metric::DEMAND_OVER_CAPACITY, 1);
                let by_load = PickRequest {
                    demand_tokens: 0,
                    ..req
                };
                outcome = self.picker.pick(&input, &by_load);
                reserve = cap;
            }
        }
        match outcome {
            PickOutcome::Picked(p) => {
                let Some(primary) = snap.endpoints.get(p.primary) else {
                    return Decision::FailOpen("picker returned an index out of range".into());
                };
                let prefill_tokens = kvroute_core::picker::uncached_prompt_tokens(
                    prompt,
                    matches.get(p.primary).copied().unwrap_or(0),
                    req.prefix_blocks,
                );
                self.prefix.record(&primary.id, &hashes);
                let (header, value) = match self.config.mode {
                    Mode::Cluster => (self.config.cluster_header.clone(), primary.cluster.clone()),
                    Mode::Endpoint => {
                        let mut v = primary.address.clone();
                        for f in p.fallbacks.iter().filter_map(|i| snap.endpoints.get(*i)) {
                            v.push(',');
                            v.push_str(&f.address);
                        }
                        (self.config.endpoint_header.clone(), v)
                    }
                };
                let reason = match p.reason {
                    PickReason::Policy => {
                        host.metric_add(MetricKind::Counter, metric::DECISIONS_POLICY, 1);
                        host.metric_add(
                            MetricKind::Counter,
                            metric::decisions_by_policy(p.policy),
                            1,
                        );
                        format!("policy:{}", p.policy.name())
                    }
                    PickReason::StaleFallback => {
                        host.metric_add(MetricKind::Counter, metric::DECISIONS_STALE, 1);
                        "stale_fallback".to_owned()
                    }
                };
                Decision::Route {
                    header,
                    value,
                    endpoint: primary.id.clone(),
                    tokens: reserve.min(primary.kv_capacity_tokens.unwrap_or(u64::MAX)),
                    prefill_tokens,
                    reason,
                    facts: RequestFacts {
                        model,
                        prompt_tokens: prompt,
                        exact: analysis.as_ref().is_some_and(|a| a.prompt_tokens_exact),
                    },
                }
            }
            PickOutcome::NoEndpoints => Decision::NoEndpoints,
            PickOutcome::NoCapacity => Decision::NoCapacity {
                priority: analysis.as_ref().map(|a| a.priority).unwrap_or(0),
                size: demand,
            },
        }
    }

    /// Set the routing header and reserve `tokens` of KV demand and `prefill_tokens` of
    /// pending prefill. Returns the reservation (none when the shared table could not be
    /// updated: routing still proceeds, counted as fail-open).
    #[allow(clippy::too_many_arguments)]
    pub fn apply_route<H: Host>(
        &mut self,
        host: &H,
        header: &str,
        value: &str,
        endpoint: &str,
        tokens: u64,
        prefill_tokens: u64,
        reason: &str,
    ) -> Option<Held> {
        host.set_request_header(header, Some(value));
        if self.config.debug_header {
            host.set_request_header(DECISION_HEADER, Some(reason));
        }
        host.clear_route_cache();
        let id = self.next_id();
        let (now, ttl, max) = (
            host.now_ms(),
            self.config.reservation_ttl_ms,
            kvroute_core::inflight::DEFAULT_MAX_ENTRIES,
        );
        match shared::update_inflight(host, max, |t| {
            t.purge_expired(now);
            t.reserve_with_prefill(id, endpoint, tokens, prefill_tokens, now, ttl);
            t.len()
        }) {
            Ok(n) => {
                host.metric_add(MetricKind::Counter, metric::RESERVED, 1);
                host.metric_record(MetricKind::Gauge, metric::INFLIGHT, n as u64);
                Some(Held {
                    id,
                    endpoint: endpoint.to_owned(),
                    tokens,
                    prefill_tokens,
                })
            }
            Err(e) => {
                host.metric_add(MetricKind::Counter, metric::FAIL_OPEN, 1);
                host.log(
                    Level::Warn,
                    &format!("kvroute: reservation not recorded: {e}"),
                );
                None
            }
        }
    }

    /// The first response bytes of `held`'s stream arrived: its prefill is done, so its
    /// pending prefill in the shared table drops to 0 (same CAS update path as
    /// [`Worker::release`]; a failure only leaves the prefill counted until release).
    pub fn prefill_done<H: Host>(&mut self, host: &H, held: &Held) {
        if let Err(e) =
            shared::update_inflight(host, kvroute_core::inflight::DEFAULT_MAX_ENTRIES, |t| {
                t.first_token(held.id)
            })
        {
            host.log(
                Level::Warn,
                &format!("kvroute: prefill-done update failed (kept until release): {e}"),
            );
        }
    }

    /// Release a reservation (call exactly once per [`Held`]; a second call is harmless).
    pub fn release<H: Host>(&mut self, host: &H, held: &Held) {
        let now = host.now_ms();
        match shared::update_inflight(host, kvroute_core::inflight::DEFAULT_MAX_ENTRIES, |t| {
            t.purge_expired(now);
            (t.release(held.id).is_some(), t.len())
        }) {
            Ok((released, n)) => {
                if released {
                    host.metric_add(MetricKind::Counter, metric::RELEASED, 1);
                }
                host.metric_record(MetricKind::Gauge, metric::INFLIGHT, n as u64);
            }
            Err(e) => host.log(
                Level::Warn,
                &format!("kvroute: release failed (reservation will expire): {e}"),
            ),
        }
    }

    /// Learn from a response's `usage`: per-model calibration (EWMA of actual / estimated
    /// prompt tokens) and the estimate-error metric.
    pub fn observe_usage<H: Host>(&mut self, host: &H, facts: &RequestFacts, actual_prompt: u64) {
        if facts.exact || facts.prompt_tokens == 0 || actual_prompt == 0 {
            return;
        }
        let est = facts.prompt_tokens as f64;
        let act = actual_prompt as f64;
        let err_pct = ((act - est).abs() * 100.0 / act).round();
        if err_pct.is_finite() && err_pct >= 0.0 {
            host.metric_record(
                MetricKind::Histogram,
                metric::ESTIMATE_ERROR_PCT,
                err_pct as u64,
            );
        }
        if !self.config.calibrate {
            return;
        }
        let Some(model) = facts.model.as_deref() else {
            return;
        };
        let old = self.estimator.calibration(Some(model));
        let target = old * act / est;
        let new = (old + CALIBRATION_ALPHA * (target - old))
            .clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1);
        if new.is_finite() {
            self.estimator
                .config
                .calibration
                .insert(model.to_owned(), new);
        }
    }
}

impl Worker {
    /// Admission tick: answer 429 to parked requests past `admission.timeout_ms`, then
    /// re-decide parked requests in service order until one still finds no capacity.
    /// Returns how many were resumed.
    pub fn tick<H: Host>(&mut self, host: &H) -> usize {
        let now = host.now_ms();
        let (timeout, retry_after) = (
            self.config.admission.timeout_ms,
            self.config.admission.retry_after_s.to_string(),
        );
        let reject_body = r#"{"error":"saturated"}"#;
        for p in self.admission.take_expired(now, timeout) {
            if host.set_effective_context(p.context_id) {
                host.metric_add(MetricKind::Counter, metric::REJECTED, 1);
                host.send_local_reply(
                    429,
                    &[
                        ("content-type", "application/json"),
                        ("retry-after", &retry_after),
                    ],
                    reject_body.as_bytes(),
                );
            }
        }
        let mut resumed = 0;
        while let Some(p) = self.admission.peek().cloned() {
            if !host.set_effective_context(p.context_id) {
                self.admission.pop();
                continue;
            }
            let body = (!p.body.is_empty()).then_some(p.body.as_slice());
            match self.decide(host, &p.path, body) {
                Decision::NoCapacity { .. } => break,
                Decision::Route {
                    header,
                    value,
                    endpoint,
                    tokens,
                    prefill_tokens,
                    reason,
                    facts,
                } => {
                    self.admission.pop();
                    if let Some(held) = self.apply_route(
                        host,
                        &header,
                        &value,
                        &endpoint,
                        tokens,
                        prefill_tokens,
                        &reason,
                    ) {
                        self.resumed.insert(p.context_id, (held, facts, now));
                    }
                    host.resume_request();
                    resumed += 1;
                }
                Decision::NoEndpoints => {
                    self.admission.pop();
                    host.metric_add(MetricKind::Counter, metric::NO_ENDPOINTS, 1);
                    host.send_local_reply(
                        503,
                        &[("content-type", "application/json")],
                        br#"{"error":"no_endpoints"}"#,
                    );
                }
                Decision::FailOpen(_) => {
                    self.admission.pop();
                    host.metric_add(MetricKind::Counter, metric::FAIL_OPEN, 1);
                    host.resume_request();
                    resumed += 1;
                }
            }
        }
        host.metric_record(
            MetricKind::Gauge,
            metric::QUEUE_LENGTH,
            self.admission.len() as u64,
        );
        resumed
    }
}

/// Drain snapshot bytes dequeued from the shared queue: publish each (newer versions only).
pub fn consume_snapshots<H: Host>(host: &H, items: Vec<Vec<u8>>) {
    for bytes in items {
        match shared::publish_snapshot(host, &bytes) {
            Ok(shared::Published::Published(v)) => {
                host.metric_add(MetricKind::Counter, metric::SNAPSHOTS_PUBLISHED, 1);
                host.log(Level::Debug, &format!("kvroute: snapshot {v} published"));
            }
            Ok(shared::Published::Ignored { offered, current }) => {
                host.metric_add(MetricKind::Counter, metric::SNAPSHOTS_STALE, 1);
                host.log(
                    Level::Info,
                    &format!("kvroute: snapshot {offered} ignored (current {current})"),
                );
            }
            Err(e) => host.log(
                Level::Warn,
                &format!("kvroute: snapshot not published: {e}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use kvroute_core::snapshot::{EndpointStats, Snapshot};

    pub(crate) fn endpoint(i: usize, now: u64) -> EndpointStats {
        EndpointStats {
            id: format!("pool/e{i}"),
            address: format!("127.0.0.1:{}", 9000 + i),
            cluster: format!("c{i}"),
            pool: "pool".into(),
            models: vec!["m".into()],
            lora_adapters: vec![],
            kv_usage: Some(0.1),
            kv_capacity_tokens: Some(100_000),
            block_size: Some(16),
            running: 0,
            waiting: 0,
            healthy: true,
            scraped_at_ms: now,
            process_start_ms: None,
        }
    }

    fn worker(json: &str) -> Worker {
        Worker::new(Config::parse(json.as_bytes()).unwrap(), 7).unwrap()
    }

    #[test]
    fn no_snapshot_fails_open() {
        let h = MockHost::new(1000);
        let mut w = worker("{}");
        assert!(matches!(
            w.decide(&h, "/v1/chat/completions", None),
            Decision::FailOpen(_)
        ));
    }

    #[test]
    fn reserve_and_release_exactly_once() {
        let h = MockHost::new(1000);
        let mut w = worker("{}");
        let held = w
            .apply_route(&h, "x-kvroute-cluster", "c1", "pool/e1", 500, 300, "r")
            .unwrap();
        assert_eq!(h.header("x-kvroute-cluster").as_deref(), Some("c1"));
        assert_eq!(*h.route_clears.borrow(), 1);
        assert_eq!(
            shared::read_inflight(&h).unwrap().totals(1000)["pool/e1"],
            InFlight {
                requests: 1,
                tokens: 500,
                prefill_tokens: 300,
            }
        );
        w.prefill_done(&h, &held);
        assert_eq!(
            shared::read_inflight(&h).unwrap().totals(1000)["pool/e1"],
            InFlight {
                requests: 1,
                tokens: 500,
                prefill_tokens: 0,
            }
        );
        w.release(&h, &held);
        w.release(&h, &held);
        assert!(shared::read_inflight(&h).unwrap().totals(1000).is_empty());
        assert_eq!(h.metric(metric::RESERVED), 1);
        assert_eq!(h.metric(metric::RELEASED), 1);
    }

    #[test]
    fn calibration_moves_toward_actual() {
        let h = MockHost::new(0);
        let mut w = worker("{}");
        let facts = RequestFacts {
            model: Some("m".into()),
            prompt_tokens: 100,
            exact: false,
        };
        w.observe_usage(&h, &facts, 200);
        let f = w.estimator.calibration(Some("m"));
        assert!((f - 1.1).abs() < 1e-9, "{f}");
        let exact = RequestFacts {
            exact: true,
            ..facts
        };
        w.observe_usage(&h, &exact, 10_000);
        assert!((w.estimator.calibration(Some("m")) - 1.1).abs() < 1e-9);
    }

    #[test]
    fn restarted_or_removed_endpoints_lose_prefix_state() {
        let h = MockHost::new(1000);
        let mut e = (0..2).map(|i| endpoint(i, 1000)).collect::<Vec<_>>();
        e[0].process_start_ms = Some(1);
        e[1].process_start_ms = Some(1);
        shared::publish_snapshot(&h, &Snapshot::new(1, 1000, e.clone()).encode()).unwrap();
        let mut w = worker(r#"{"picker":{"policy":"round_robin"}}"#);
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "p".repeat(640));
        for _ in 0..2 {
            assert!(matches!(
                w.decide(&h, "/v1/completions", Some(body.as_bytes())),
                Decision::Route { .. }
            ));
        }
        assert_eq!(w.prefix_blocks("pool/e0"), 10);
        assert_eq!(w.prefix_blocks("pool/e1"), 10);
        e[0].process_start_ms = Some(2);
        let e1 = e.remove(1);
        shared::publish_snapshot(&h, &Snapshot::new(2, 1000, e).encode()).unwrap();
        let _ = w.decide(&h, "/v1/models", None);
        assert_eq!(w.prefix_blocks("pool/e0"), 0, "restarted");
        assert_eq!(w.prefix_blocks(&e1.id), 0, "removed");
        assert_eq!(
            h.metric(metric::decisions_by_policy(
                kvroute_core::picker::PolicyKind::RoundRobin
            )),
            3
        );
    }

    #[test]
    fn endpoint_mode_header_lists_fallbacks() {
        let h = MockHost::new(1000);
        let snap = Snapshot::new(1, 1000, (0..3).map(|i| endpoint(i, 1000)).collect());
        shared::publish_snapshot(&h, &snap.encode()).unwrap();
        let mut w =
            worker(r#"{"mode":"endpoint","picker":{"policy":"round_robin","max_fallbacks":2}}"#);
        match w.decide(&h, "/v1/models", None) {
            Decision::Route { header, value, .. } => {
                assert_eq!(header, "x-gateway-destination-endpoint");
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
