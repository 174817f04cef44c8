//! Routing benchmark: the Mooncake trace replayed in virtual time over N simulated engine
//! replicas, once per router, side by side.
//!
//! Algorithm ([`run_router`]):
//! - Rows arrive at `timestamp / time_compression` (seconds). Before each arrival every
//!   engine is stepped up to the arrival time; on the way, every
//!   [`BenchConfig::snapshot_interval_ms`] (default 200 ms, like the control plane's push
//!   cadence) of virtual time the router's view is refreshed with a snapshot of each replica
//!   (KV usage, running, waiting, KV capacity) taken when the engines reach that instant.
//! - The router decides with only that snapshot, its own in-flight counts (requests and
//!   reserved tokens, released when the request's last token is produced, as the filter
//!   releases on stream end) and its own prefix memory. It never reads engine internals.
//! - kvroute policies go through [`kvroute_core::picker::Picker::pick`] with a
//!   [`kvroute_core::prefix::PrefixIndex`] fed exactly as the filter feeds it (match before
//!   the pick, record for the chosen endpoint). Its per-endpoint capacity is the replica's KV
//!   capacity in 512-token blocks. If the picker answers `NoCapacity` (a real gateway would
//!   return 429), the bench sends the request to the replica with the fewest in-flight
//!   requests and counts it in [`RouterReport::overflow`], so every router serves every row.
//! - Trace `hash_ids` (one per 512-token block) become router block hashes by chaining
//!   xxh64 ([`chain_ids`]); the engines key their prefix cache with
//!   [`crate::sim::api::id_block_hashes`], as `kvroute-sim` does.
//!
//! Everything is deterministic for a given seed: the engines are deterministic and every
//! random tie-break comes from a seeded `fastrand::Rng`.

pub mod baselines;

use kvroute_core::analysis::ApiKind;
use kvroute_core::picker::{
    InFlight, PickInput, PickOutcome, PickRequest, Picker, PickerConfig, PolicyKind,
};
use kvroute_core::prefix::PrefixIndex;
use kvroute_core::snapshot::{EndpointStats, Snapshot};

use crate::sim::api::{id_block_hashes, DEFAULT_PREFIX_BLOCK_TOKENS};
use crate::sim::engine::{Engine, EngineConfig, EngineEvent, SimRequest};
use crate::sim::trace::TraceRow;
use baselines::{EndpointView, LlmdEpp, SglangCacheAware};

/// Tokens per trace `hash_id` block (Mooncake FAST'25 traces).
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// A router under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// A kvroute picker policy, through the real [`Picker`].
    Kvroute(PolicyKind),
    /// llm-d EPP default profile ([`baselines::LlmdEpp`]).
    LlmdEpp,
    /// SGLang `cache_aware` ([`baselines::SglangCacheAware`]).
    SglangCacheAware,
}

impl RouterKind {
    /// Display name (`round_robin`, …, `llmd-epp`, `sglang-cache-aware`).
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::Kvroute(p) => p.name(),
            RouterKind::LlmdEpp => "llmd-epp",
            RouterKind::SglangCacheAware => "sglang-cache-aware",
        }
    }

    /// The seven routers of the benchmark, `round_robin` first (the ratio baseline).
    pub fn all() -> [RouterKind; 7] {
        [
            RouterKind::Kvroute(PolicyKind::RoundRobin),
            RouterKind::Kvroute(PolicyKind::LeastRequest),
            RouterKind::Kvroute(PolicyKind::LeastKv),
            RouterKind::Kvroute(PolicyKind::PrefixAffinity),
            RouterKind::Kvroute(PolicyKind::Hybrid),
            RouterKind::LlmdEpp,
            RouterKind::SglangCacheAware,
        ]
    }
}

/// Benchmark setup.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Engine replicas (≥ 1).
    pub replicas: usize,
    /// Arrival times are divided by this (×k faster traffic; ≥ 1e-6).
    pub time_compression: f64,
    /// Snapshot refresh period, virtual milliseconds (≥ 1).
    pub snapshot_interval_ms: u64,
    /// Seed of every random tie-break.
    pub seed: u64,
    /// Model name (seeds the engines' block hashes, fills the snapshot).
    pub model: String,
}

/// Per-router results. Times in virtual seconds, ratios 0..1.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RouterReport {
    /// Router name.
    pub router: String,
    /// Rows offered.
    pub requests: usize,
    /// Rows the engine refused (prompt larger than the KV cache).
    pub rejected: usize,
    /// Requests that produced their last token.
    pub finished: usize,
    /// Request ids that finished more than once (must be 0).
    pub duplicate_finishes: usize,
    /// kvroute picks answered `NoCapacity`/`NoEndpoints` and sent to the least-loaded replica.
    pub overflow: usize,
    /// TTFT percentiles (seconds).
    pub ttft_p50: f64,
    /// TTFT p90.
    pub ttft_p90: f64,
    /// TTFT p99.
    pub ttft_p99: f64,
    /// End-to-end latency median (seconds).
    pub e2e_p50: f64,
    /// End-to-end p99.
    pub e2e_p99: f64,
    /// Prefix-cache hit tokens / queried prompt tokens over all replicas (0..1).
    pub prefix_hit_ratio: f64,
    /// Preemptions over all replicas.
    pub preemptions: u64,
    /// Requests per replica (load spread).
    pub per_replica: Vec<usize>,
    /// Virtual time at the end (seconds).
    pub virtual_seconds: f64,
}

/// Chain trace block ids into router block hashes (`h_i = xxh64(h_{i−1} ‖ id_i)`, seed 0),
/// so equal hashes mean equal prefixes up to and including that block.
pub fn chain_ids(ids: &[u64]) -> Vec<u64> {
    let mut prev = 0u64;
    ids.iter()
        .map(|id| {
            let mut h = xxhash_rust::xxh64::Xxh64::new(0);
            h.update(&prev.to_le_bytes());
            h.update(&id.to_le_bytes());
            prev = h.digest();
            prev
        })
        .collect()
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted.get(idx).copied().unwrap_or(0.0)
}

enum Router {
    Kv { picker: Picker, index: PrefixIndex },
    Llmd(LlmdEpp),
    Sglang(SglangCacheAware),
}

struct State {
    engines: Vec<Engine>,
    arrival: Vec<f64>,
    replica_of: Vec<usize>,
    reserved: Vec<u64>,
    inflight: Vec<InFlight>,
    /// Load dispatched since the last snapshot (what the kvroute picker's `inflight` means:
    /// router-local load the snapshot cannot show yet, as the filter computes it).
    unseen: Vec<InFlight>,
    done: Vec<bool>,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    finished: usize,
    duplicates: usize,
}

impl State {
    fn absorb(&mut self, events: Vec<EngineEvent>) {
        for ev in events {
            let EngineEvent::Token {
                id,
                time,
                index,
                last,
            } = ev
            else {
                continue;
            };
            let i = id as usize;
            let a = self.arrival.get(i).copied().unwrap_or(0.0);
            if index == 1 {
                self.ttft.push(time - a);
            }
            if last {
                match self.done.get_mut(i) {
                    Some(d) if *d => self.duplicates += 1,
                    Some(d) => {
                        *d = true;
                        self.finished += 1;
                        self.e2e.push(time - a);
                        let r = self.replica_of.get(i).copied().unwrap_or(0);
                        let tok = self.reserved.get(i).copied().unwrap_or(0);
                        if let Some(f) = self.inflight.get_mut(r) {
                            f.requests = f.requests.saturating_sub(1);
                            f.tokens = f.tokens.saturating_sub(tok);
                        }
                    }
                    None => {}
                }
            }
        }
    }

    /// Step every engine until its clock reaches `t` (or it idles), then advance idle ones.
    fn run_to(&mut self, t: f64) {
        for k in 0..self.engines.len() {
            while let Some(e) = self.engines.get_mut(k) {
                if e.is_idle() || e.now() >= t {
                    e.advance_to(t);
                    break;
                }
                match e.step() {
                    Some(r) => self.absorb(r.events),
                    None => break,
                }
            }
        }
    }

    fn snapshot(&self, model: &str, now_ms: u64, version: u64) -> Snapshot {
        let endpoints = self
            .engines
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let c = e.config();
                EndpointStats {
                    id: format!("replica-{i}"),
                    address: format!("10.0.0.{i}:8000"),
                    cluster: format!("replica-{i}"),
                    pool: String::new(),
                    models: vec![model.to_string()],
                    lora_adapters: Vec::new(),
                    kv_usage: Some(e.kv_usage()),
                    kv_capacity_tokens: Some(u64::from(c.num_gpu_blocks) * u64::from(c.block_size)),
                    block_size: Some(c.block_size),
                    running: u32::try_from(e.num_running()).unwrap_or(u32::MAX),
                    waiting: u32::try_from(e.num_waiting()).unwrap_or(u32::MAX),
                    healthy: true,
                    scraped_at_ms: now_ms,
                    process_start_ms: Some(0),
                }
            })
            .collect();
        Snapshot {
            format: kvroute_core::snapshot::FORMAT_VERSION,
            version,
            generated_at_ms: now_ms,
            endpoints,
        }
    }
}

/// Replay `rows` through `cfg.replicas` engines of `engine` with one router. Never panics;
/// an empty trace gives an all-zero report.
pub fn run_router(
    rows: &[TraceRow],
    engine: &EngineConfig,
    cfg: &BenchConfig,
    kind: RouterKind,
) -> RouterReport {
    let n = cfg.replicas.max(1);
    let compression = if cfg.time_compression.is_finite() && cfg.time_compression > 1e-6 {
        cfg.time_compression
    } else {
        1.0
    };
    let interval_ms = cfg.snapshot_interval_ms.max(1);
    let cap_tokens = u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size);
    let mut router = match kind {
        RouterKind::Kvroute(policy) => {
            let pc = PickerConfig {
                policy,
                ..PickerConfig::default()
            };
            match Picker::new(pc, cfg.seed) {
                Ok(picker) => Router::Kv {
                    picker,
                    index: PrefixIndex::new(
                        usize::try_from(cap_tokens / u64::from(TRACE_BLOCK_TOKENS)).unwrap_or(1),
                    ),
                },
                // Default config always validates; fall back to the EPP rather than panic.
                Err(_) => Router::Llmd(LlmdEpp::new(cfg.seed)),
            }
        }
        RouterKind::LlmdEpp => Router::Llmd(LlmdEpp::new(cfg.seed)),
        RouterKind::SglangCacheAware => Router::Sglang(SglangCacheAware::new()),
    };
    let mut st = State {
        engines: (0..n).map(|_| Engine::new(engine.clone())).collect(),
        arrival: vec![0.0; rows.len()],
        replica_of: vec![0; rows.len()],
        reserved: vec![0; rows.len()],
        inflight: vec![InFlight::default(); n],
        unseen: vec![InFlight::default(); n],
        done: vec![false; rows.len()],
        ttft: Vec::with_capacity(rows.len()),
        e2e: Vec::with_capacity(rows.len()),
        finished: 0,
        duplicates: 0,
    };
    let ids: Vec<String> = (0..n).map(|i| format!("replica-{i}")).collect();
    let mut snap = st.snapshot(&cfg.model, 0, 0);
    let mut next_snap_ms = interval_ms;
    let mut per_replica = vec![0usize; n];
    let (mut rejected, mut overflow) = (0usize, 0usize);
    for (i, row) in rows.iter().enumerate() {
        let t = row.timestamp as f64 / 1000.0 / compression;
        let t_ms = (t * 1000.0) as u64;
        while next_snap_ms <= t_ms {
            st.run_to(next_snap_ms as f64 / 1000.0);
            snap = st.snapshot(&cfg.model, next_snap_ms, next_snap_ms / interval_ms);
            st.unseen.iter_mut().for_each(|f| *f = InFlight::default());
            next_snap_ms += interval_ms;
        }
        st.run_to(t);
        let prompt = row.input_length.max(1);
        let output = row.output_length.max(1);
        let hashes = chain_ids(&row.hash_ids);
        let views: Vec<EndpointView> = snap
            .endpoints
            .iter()
            .zip(&st.inflight)
            .map(|(e, f)| EndpointView {
                kv_usage: e.kv_usage.unwrap_or(0.0),
                waiting: e.waiting,
                inflight: u64::from(f.requests),
            })
            .collect();
        let least_loaded = st
            .inflight
            .iter()
            .enumerate()
            .min_by_key(|(_, f)| f.requests)
            .map_or(0, |(k, _)| k);
        let demand = u64::from(prompt) + u64::from(output);
        let chosen = match &mut router {
            Router::Kv { picker, index } => {
                let matches = index.match_snapshot(&hashes, &snap);
                let input = PickInput {
                    snapshot: &snap,
                    inflight: &st.unseen,
                    prefix_match_blocks: &matches,
                    now_ms: t_ms,
                };
                let req = PickRequest {
                    model: Some(&cfg.model),
                    api: ApiKind::Completions,
                    prompt_tokens: u64::from(prompt),
                    output_limit: u64::from(output),
                    demand_tokens: demand,
                    prefix_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
                };
                let k = match picker.pick(&input, &req) {
                    PickOutcome::Picked(p) => p.primary,
                    PickOutcome::NoCapacity | PickOutcome::NoEndpoints => {
                        overflow += 1;
                        least_loaded
                    }
                };
                if let Some(id) = ids.get(k) {
                    index.record(id, &hashes);
                }
                k
            }
            Router::Llmd(p) => p.pick(&ids, &views, &hashes).unwrap_or(least_loaded),
            Router::Sglang(p) => p
                .pick(&ids, &views, &hashes, prompt)
                .unwrap_or(least_loaded),
        };
        let k = chosen.min(n - 1);
        if let Some(a) = st.arrival.get_mut(i) {
            *a = t;
        }
        let req = SimRequest {
            id: i as u64,
            prompt_tokens: prompt,
            output_tokens: output,
            block_hashes: id_block_hashes(
                &cfg.model,
                &row.hash_ids,
                DEFAULT_PREFIX_BLOCK_TOKENS,
                prompt,
                engine.block_size,
            ),
            priority: 0,
        };
        let Some(e) = st.engines.get_mut(k) else {
            continue;
        };
        if e.submit(req).is_err() {
            rejected += 1;
            continue;
        }
        if let Some(c) = per_replica.get_mut(k) {
            *c += 1;
        }
        if let Some(r) = st.replica_of.get_mut(i) {
            *r = k;
        }
        if let Some(r) = st.reserved.get_mut(i) {
            *r = demand;
        }
        for f in [st.inflight.get_mut(k), st.unseen.get_mut(k)]
            .into_iter()
            .flatten()
        {
            f.requests = f.requests.saturating_add(1);
            f.tokens = f.tokens.saturating_add(demand);
        }
    }
    for k in 0..n {
        while let Some(r) = st.engines.get_mut(k).and_then(Engine::step) {
            st.absorb(r.events);
        }
    }
    st.ttft.sort_by(f64::total_cmp);
    st.e2e.sort_by(f64::total_cmp);
    let (mut q, mut h, mut preemptions, mut vs) = (0u64, 0u64, 0u64, 0.0f64);
    for e in &st.engines {
        let c = e.counters();
        q += c.prefix_queries_tokens;
        h += c.prefix_hit_tokens;
        preemptions += c.preemptions;
        vs = vs.max(e.now());
    }
    RouterReport {
        router: kind.name().to_string(),
        requests: rows.len(),
        rejected,
        finished: st.finished,
        duplicate_finishes: st.duplicates,
        overflow,
        ttft_p50: percentile(&st.ttft, 0.5),
        ttft_p90: percentile(&st.ttft, 0.9),
        ttft_p99: percentile(&st.ttft, 0.99),
        e2e_p50: percentile(&st.e2e, 0.5),
        e2e_p99: percentile(&st.e2e, 0.99),
        prefix_hit_ratio: if q == 0 { 0.0 } else { h as f64 / q as f64 },
        preemptions,
        per_replica,
        virtual_seconds: vs,
    }
}

/// Run every router of `kinds` on the same rows and setup.
pub fn run_all(
    rows: &[TraceRow],
    engine: &EngineConfig,
    cfg: &BenchConfig,
    kinds: &[RouterKind],
) -> Vec<RouterReport> {
    kinds
        .iter()
        .map(|&k| run_router(rows, engine, cfg, k))
        .collect()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Markdown table of `reports`; ratios are against the first report (round_robin).
pub fn render_table(reports: &[RouterReport]) -> String {
    let mut s = String::from(
        "| router | TTFT p50 s | TTFT p90 s | TTFT p99 s | E2E p50 s | E2E p99 s | prefix hit | preempt | overflow | TTFT p50 ×rr | TTFT p99 ×rr | E2E p99 ×rr |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let base = reports.first();
    for r in reports {
        let (b50, b99, be99) =
            base.map_or((0.0, 0.0, 0.0), |b| (b.ttft_p50, b.ttft_p99, b.e2e_p99));
        s.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.3} | {} | {} | {:.2} | {:.2} | {:.2} |\n",
            r.router,
            r.ttft_p50,
            r.ttft_p90,
            r.ttft_p99,
            r.e2e_p50,
            r.e2e_p99,
            r.prefix_hit_ratio,
            r.preemptions,
            r.overflow,
            ratio(r.ttft_p50, b50),
            ratio(r.ttft_p99, b99),
            ratio(r.e2e_p99, be99),
        ));
    }
    s
}
