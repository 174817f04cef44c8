//! kvroute as Envoy runs it: one router per worker thread, each with its own in-flight
//! table and prefix index, sharing with the others only through shared data, late.
//!
//! With one worker ([`WorkerModel::count`] 1, the default) this is the filter on
//! `--concurrency 1`: one [`Router`] and one [`InflightTable`], nothing shared, every
//! reservation seen by the next decision. With N workers each request goes to a worker
//! drawn at random (seeded): Envoy hands each downstream connection to one worker, and the
//! requests of one conversation arrive on different connections, so nothing ties a prefix
//! to a worker. What one worker learns reaches the others as the filter shares it:
//!
//! | state | filter (`filter/src/`) | here |
//! |---|---|---|
//! | in-flight reservations | a worker publishes its own table when it reserves and its last publication is at least `inflight_share_ms` old, else on its tick if it changed (a reservation, a first token that cleared pending prefill, a release that found its entry), and on its tick at least every second while it holds reservations (heartbeat); a decision re-reads the others' copies once its copy is `inflight_share_ms` old, and so does the tick (`inflight.rs`) | the same rules, with the publication a copy of the table at that instant |
//! | prefix affinity, learner observations | each worker, on its tick (`affinity_sync_ms`, 100 ms), replays what the others appended to the journals since its last sync, then appends what its own router recorded (`sharing.rs`) | the same order, in one in-memory journal ([`Router::take_recorded`] / [`Router::import_affinity`], [`Router::take_observations`] / [`Router::import_observation`]) |
//!
//! Worker *w*'s ticks fall at `w × period / N + k × period` (the workers started at
//! different instants), the period being the filter's: 100 ms, or `affinity_sync_ms` if
//! shorter. Before each decision the replay runs the ticks due, in time order, each after
//! the engines ran up to its instant ([`Workers::next_tick`], [`Workers::tick`]). The
//! filter's other liveness rules (stale copies, dead workers) never trigger in a replay,
//! where every worker lives, and are not modelled; nor are the journals' retention and
//! byte bound (a worker here never misses a sync, and no record is dropped).
//!
//! The baselines keep one router: llm-d's endpoint picker, SGLang's router and Dynamo's
//! KV router each run as one process that sees every request.

use std::rc::Rc;

use kvroute_core::inflight::InflightTable;
use kvroute_core::router::Router;
use kvroute_core::snapshot::Snapshot;

/// The filter's default `inflight_share_ms`, ms (`kvroute_core::plugin_config::DEFAULT_INFLIGHT_SHARE_MS`).
pub const DEFAULT_INFLIGHT_SHARE_MS: u64 = 20;
/// The filter's tick, ms: the longest a changed in-flight table waits for publication
/// (`kvroute_filter::router::RELEASE_FLUSH_MS`).
pub const TICK_MS: u64 = 100;
/// A worker holding reservations republishes its table at least this often, ms
/// (`kvroute_filter::inflight::HEARTBEAT_MS`).
pub const HEARTBEAT_MS: u64 = 1_000;
/// Reservation lifetime in the replay, ms: never lapses within a run.
const RESERVATION_TTL_MS: u64 = u64::MAX / 4;
/// The filter's default `affinity_sync_ms` (`kvroute_core::plugin_config`), ms.
pub const DEFAULT_AFFINITY_SYNC_MS: u64 = 100;

/// How many filter workers route, and how often they share (virtual milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerModel {
    /// Envoy worker threads, each with its own router (≥ 1; 0 counts as 1).
    pub count: usize,
    /// The filter's `inflight_share_ms` (0: publish at every reservation, read at every
    /// decision).
    pub inflight_share_ms: u64,
    /// The filter's `share_affinity` and `share_learning` (both on by default): whether the
    /// workers replay each other's routed prefixes and learner observations.
    pub journals: bool,
    /// Longest tick period, ms (≥ 1; default [`TICK_MS`], the filter's constant); the
    /// period is this or `affinity_sync_ms` while the journals are shared, whichever is
    /// shorter, as the filter sets it. On its tick a worker publishes a changed table and
    /// re-reads stale copies of the others'.
    pub tick_ms: u64,
    /// The filter's `affinity_sync_ms`: the journals are synced on the first tick at least
    /// this long after the last sync (default [`DEFAULT_AFFINITY_SYNC_MS`]).
    pub affinity_sync_ms: u64,
}

impl WorkerModel {
    /// The tick period the workers run at, ms: `tick_ms`, or `affinity_sync_ms` if the
    /// journals are shared and that is shorter, as the filter sets it (≥ 1).
    pub fn tick(&self) -> u64 {
        let tick = self.tick_ms.max(1);
        if self.journals {
            tick.min(self.affinity_sync_ms.max(1))
        } else {
            tick
        }
    }
}

impl Default for WorkerModel {
    /// One worker: `--concurrency 1`, nothing shared.
    fn default() -> Self {
        Self {
            count: 1,
            inflight_share_ms: DEFAULT_INFLIGHT_SHARE_MS,
            journals: true,
            tick_ms: TICK_MS,
            affinity_sync_ms: DEFAULT_AFFINITY_SYNC_MS,
        }
    }
}

/// One journal record: who wrote it, and the router call that replays it.
#[derive(Debug, Clone)]
struct Record {
    writer: usize,
    affinity: bool,
    key: String,
    words: Vec<u64>,
}

/// One filter worker.
#[derive(Debug)]
struct Worker {
    router: Router,
    /// Its own reservations, exact for its own decisions.
    own: InflightTable,
    /// Own table changed since its last publication.
    dirty: bool,
    /// Virtual ms of its last publication (`None`: never published).
    published_at: Option<u64>,
    /// Its copy of every worker's publication (its own slot unused), as of `read_at`.
    copies: Vec<Option<Rc<InflightTable>>>,
    read_at: Option<u64>,
    /// Journal records it has seen (an index into [`Workers::journal`]'s absolute count).
    seen: usize,
    /// Virtual ms of its last journal sync (`None`: never synced).
    synced_at: Option<u64>,
    next_tick: u64,
}

/// kvroute's routers, one per filter worker, and what they share.
#[derive(Debug)]
pub struct Workers {
    model: WorkerModel,
    workers: Vec<Worker>,
    /// Every worker's latest publication.
    published: Vec<Option<Rc<InflightTable>>>,
    /// Records not yet seen by every worker; `journal_base` records before them were dropped.
    journal: Vec<Record>,
    journal_base: usize,
    /// Draws each request's worker (its own stream: the routers' tie-breaks are unchanged).
    rng: fastrand::Rng,
}

impl Workers {
    /// `model.count` workers (at least one), each with the router `make(w)` builds and a
    /// table of up to `max_entries` reservations. `None` if a router cannot be built.
    /// Sharing is switched on in each router when there is more than one and
    /// `model.journals` is set.
    pub fn new(
        model: WorkerModel,
        max_entries: usize,
        seed: u64,
        mut make: impl FnMut(usize) -> Option<Router>,
    ) -> Option<Self> {
        let count = model.count.max(1);
        let tick = model.tick();
        let mut workers = Vec::with_capacity(count);
        for w in 0..count {
            let mut router = make(w)?;
            if count > 1 && model.journals {
                router.share_affinity(true);
                router.share_learning(true);
            }
            workers.push(Worker {
                router,
                own: InflightTable::new(max_entries),
                dirty: false,
                published_at: None,
                copies: vec![None; count],
                read_at: None,
                seen: 0,
                synced_at: None,
                next_tick: u64::try_from(u128::from(tick) * w as u128 / count as u128)
                    .unwrap_or(u64::MAX),
            });
        }
        Some(Self {
            model: WorkerModel {
                count,
                tick_ms: tick,
                ..model
            },
            workers,
            published: vec![None; count],
            journal: Vec::new(),
            journal_base: 0,
            rng: fastrand::Rng::with_seed(seed ^ 0x776f_726b_6572),
        })
    }

    /// The worker the next request lands on (always 0 with one worker; draws nothing then).
    pub fn assign(&mut self) -> usize {
        if self.workers.len() > 1 {
            self.rng.usize(..self.workers.len())
        } else {
            0
        }
    }

    /// Worker `w`'s router (for the observations of the requests it routed), if it exists.
    pub fn router(&mut self, w: usize) -> Option<&mut Router> {
        self.workers.get_mut(w).map(|x| &mut x.router)
    }

    /// The instant of the earliest worker tick due by `now_ms` (virtual ms), if any; never
    /// with one worker.
    pub fn next_tick(&self, now_ms: u64) -> Option<u64> {
        if self.workers.len() < 2 {
            return None;
        }
        self.workers
            .iter()
            .map(|x| x.next_tick)
            .filter(|&t| t <= now_ms)
            .min()
    }

    /// Run the worker ticks due at `at` ([`Self::next_tick`]), as the filter's tick runs:
    /// publication of a changed table (or the heartbeat), a read of the others' if the
    /// worker's copy is `inflight_share_ms` old, then, once `affinity_sync_ms` passed since
    /// the last, the journal sync against `snap` (imports keep only its endpoints).
    pub fn tick(&mut self, at: u64, snap: &Snapshot) {
        let due: Vec<usize> = (0..self.workers.len())
            .filter(|&w| self.workers.get(w).is_some_and(|x| x.next_tick <= at))
            .collect();
        for w in due {
            self.publish(w, at, true);
            self.refresh(w, at);
            let sync_ms = self.model.affinity_sync_ms;
            let Some(x) = self.workers.get_mut(w) else {
                continue;
            };
            x.next_tick = at.saturating_add(self.model.tick_ms);
            if x.synced_at.is_none_or(|t| at.saturating_sub(t) >= sync_ms) {
                x.synced_at = Some(at);
                self.sync(w, snap);
            }
        }
        self.trim_journal();
    }

    /// Decide on worker `w` at `now_ms`: refresh its copy of the other workers' tables if
    /// it is `inflight_share_ms` old, then `decide(router, tables)` over its own table and
    /// those copies. `None` for a worker that does not exist.
    pub fn decide<R>(
        &mut self,
        w: usize,
        now_ms: u64,
        decide: impl FnOnce(&mut Router, &[&InflightTable]) -> R,
    ) -> Option<R> {
        self.refresh(w, now_ms);
        let x = self.workers.get_mut(w)?;
        let mut tables: Vec<&InflightTable> = Vec::with_capacity(x.copies.len());
        tables.push(&x.own);
        for (p, c) in x.copies.iter().enumerate() {
            if p != w {
                if let Some(c) = c {
                    tables.push(c);
                }
            }
        }
        Some(decide(&mut x.router, &tables))
    }

    /// Reserve on worker `w`'s own table (tokens of KV demand and pending prefill, as
    /// [`InflightTable::reserve_with_prefill`] takes them; no expiry within the run), and
    /// publish it if its last publication is `inflight_share_ms` old.
    pub fn reserve(
        &mut self,
        w: usize,
        id: u64,
        endpoint_id: &str,
        tokens: u64,
        prefill_tokens: u64,
        now_ms: u64,
    ) {
        let Some(x) = self.workers.get_mut(w) else {
            return;
        };
        x.own.reserve_with_prefill(
            id,
            endpoint_id,
            tokens,
            prefill_tokens,
            now_ms,
            RESERVATION_TTL_MS,
        );
        x.dirty = true;
        self.publish(w, now_ms, false);
    }

    /// Request `id` of worker `w` got its first token: its pending prefill is done (a
    /// change to publish only if there was some, as in the filter). Returns whether it had
    /// pending prefill: the filter takes a TTFT sample only then (`filter/src/stream.rs`,
    /// `first_token`), so a request held with none (its whole prompt predicted cached, or
    /// not held at all) gives none.
    pub fn first_token(&mut self, w: usize, id: u64) -> bool {
        let Some(x) = self.workers.get_mut(w) else {
            return false;
        };
        let pending = x.own.first_token(id).is_some_and(|cleared| cleared > 0);
        x.dirty |= pending;
        pending
    }

    /// Request `id` of worker `w` finished: its reservation ends (a change to publish if
    /// it was held).
    pub fn release(&mut self, w: usize, id: u64) {
        if let Some(x) = self.workers.get_mut(w) {
            x.dirty |= x.own.release(id).is_some();
        }
    }

    /// Worker `w` re-reads the other workers' publications if its copy is
    /// `inflight_share_ms` old (only with more than one worker).
    fn refresh(&mut self, w: usize, now_ms: u64) {
        let share = self.model.inflight_share_ms;
        let published = &self.published;
        if let Some(x) = self.workers.get_mut(w) {
            if published.len() > 1 && x.read_at.is_none_or(|t| now_ms.saturating_sub(t) >= share) {
                x.copies.clone_from(published);
                x.read_at = Some(now_ms);
            }
        }
    }

    /// Publish worker `w`'s table if it changed and (`on_tick`, or its last publication is
    /// `inflight_share_ms` old), or if it holds reservations and its last publication is
    /// [`HEARTBEAT_MS`] old. Only with more than one worker.
    fn publish(&mut self, w: usize, now_ms: u64, on_tick: bool) {
        if self.workers.len() < 2 {
            return;
        }
        let share = self.model.inflight_share_ms;
        let Some(x) = self.workers.get_mut(w) else {
            return;
        };
        let since = x.published_at.map(|t| now_ms.saturating_sub(t));
        let due = (x.dirty && (on_tick || since.is_none_or(|d| d >= share)))
            || (!x.own.is_empty() && since.is_none_or(|d| d >= HEARTBEAT_MS));
        if !due {
            return;
        }
        if let Some(slot) = self.published.get_mut(w) {
            *slot = Some(Rc::new(x.own.clone()));
        }
        x.dirty = false;
        x.published_at = Some(now_ms);
    }

    /// Worker `w`'s journal sync: replay what the others appended since its last sync, then
    /// append what its router recorded and observed since then.
    fn sync(&mut self, w: usize, snap: &Snapshot) {
        let Some(x) = self.workers.get_mut(w) else {
            return;
        };
        x.router.observe_snapshot(snap);
        let from = x.seen.saturating_sub(self.journal_base);
        for r in self.journal.iter().skip(from) {
            if r.writer == w {
                continue;
            }
            if r.affinity {
                x.router.import_affinity(&r.key, &r.words);
            } else {
                x.router.import_observation(&r.key, &r.words);
            }
        }
        let recorded = x.router.take_recorded();
        let observed = x.router.take_observations();
        for (affinity, list) in [(true, recorded), (false, observed)] {
            self.journal
                .extend(list.into_iter().map(|(key, words)| Record {
                    writer: w,
                    affinity,
                    key,
                    words,
                }));
        }
        x.seen = self.journal_base + self.journal.len();
    }

    /// Drop the records every worker has seen.
    fn trim_journal(&mut self) {
        let Some(oldest) = self.workers.iter().map(|x| x.seen).min() else {
            return;
        };
        let n = oldest
            .saturating_sub(self.journal_base)
            .min(self.journal.len());
        self.journal.drain(..n);
        self.journal_base += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::analysis::ApiKind;
    use kvroute_core::router::{Outcome, RequestInfo, RouterConfig};
    use kvroute_core::snapshot::EndpointStats;

    const MODEL: &str = "m";

    fn workers(count: usize, share_ms: u64) -> Workers {
        let model = WorkerModel {
            count,
            inflight_share_ms: share_ms,
            ..WorkerModel::default()
        };
        let make = |w: usize| Router::new(RouterConfig::default(), 7 + w as u64).ok();
        Workers::new(model, 64, 1, make).expect("routers")
    }

    /// Two idle endpoints, `pool/e0` and `pool/e1`, serving model `m`.
    fn snapshot() -> Snapshot {
        Snapshot::new(1, 0, (0..2).map(|i| EndpointStats::fixture(i, 0)).collect())
    }

    /// Every tick due by `now_ms`, in order, against the test snapshot.
    fn run_ticks(ws: &mut Workers, now_ms: u64) {
        let snap = snapshot();
        while let Some(at) = ws.next_tick(now_ms) {
            ws.tick(at, &snap);
        }
    }

    /// Reservations worker `w` counts at `now_ms`: its own and its copies of the others'.
    fn counted(ws: &mut Workers, w: usize, now_ms: u64) -> usize {
        ws.decide(w, now_ms, |_, tables| {
            tables.iter().map(|t| t.live(now_ms)).sum::<usize>()
        })
        .expect("worker")
    }

    fn reserve(ws: &mut Workers, w: usize, id: u64, now_ms: u64) {
        ws.reserve(w, id, "pool/e0", 1_000, 500, now_ms);
    }

    /// The model's constants are the filter's (tools depends on the filter only in tests).
    #[test]
    fn the_models_defaults_are_the_filters() {
        let filter = kvroute_core::plugin_config::RawConfig::default();
        assert_eq!(DEFAULT_INFLIGHT_SHARE_MS, filter.inflight_share_ms);
        assert_eq!(DEFAULT_AFFINITY_SYNC_MS, filter.affinity_sync_ms);
        assert!(filter.share_affinity && filter.share_learning);
        assert_eq!(TICK_MS, kvroute_filter::router::RELEASE_FLUSH_MS);
        assert_eq!(HEARTBEAT_MS, kvroute_filter::inflight::HEARTBEAT_MS);
    }

    #[test]
    fn one_worker_counts_its_reservations_at_once_and_draws_nothing() {
        let mut ws = workers(1, 20);
        assert_eq!(ws.assign(), 0);
        reserve(&mut ws, 0, 1, 0);
        assert_eq!(counted(&mut ws, 0, 1), 1);
        ws.release(0, 1);
        assert_eq!(counted(&mut ws, 0, 2), 0);
        assert!(ws.published.iter().all(Option::is_none));
    }

    #[test]
    fn other_workers_see_a_reservation_after_the_publication_and_their_next_read() {
        let mut ws = workers(2, 20);
        // Worker 1 reads first (an empty copy), at t = 0.
        assert_eq!(counted(&mut ws, 1, 0), 0);
        // Worker 0's first reservation publishes at once (it never published).
        reserve(&mut ws, 0, 1, 5);
        assert_eq!(counted(&mut ws, 0, 5), 1);
        // Worker 1's copy is 10 ms old: not read again yet.
        assert_eq!(counted(&mut ws, 1, 10), 0);
        // 20 ms old: read, and the reservation counts.
        assert_eq!(counted(&mut ws, 1, 20), 1);
        // A second reservation 10 ms after the publication waits for the share interval.
        reserve(&mut ws, 0, 2, 15);
        assert_eq!(counted(&mut ws, 1, 45), 1);
        // The next reservation, 20 ms after the last publication, publishes both.
        reserve(&mut ws, 0, 3, 25);
        assert_eq!(counted(&mut ws, 1, 65), 3);
        // Releases wait for the tick: worker 0 ticks at 0, 100, ...; worker 1 at 50, 150, ...
        ws.release(0, 1);
        ws.release(0, 2);
        assert_eq!(counted(&mut ws, 1, 90), 3);
        assert_eq!(counted(&mut ws, 0, 90), 1);
        run_ticks(&mut ws, 100);
        assert_eq!(counted(&mut ws, 1, 110), 1);
    }

    /// The model against the filter's own `WorkerInflight` on the same steps: a first
    /// token that clears no prefill is no change, so the reservation after the tick is
    /// published at once, by both.
    #[test]
    fn publication_follows_the_filters_worker_inflight() {
        use kvroute_filter::host::mock::MockHost;
        use kvroute_filter::inflight::WorkerInflight;
        use kvroute_filter::shared;
        const BASE: u64 = 1_000_000;
        let h = MockHost::new(BASE);
        shared::ensure_keys(&h).expect("keys");
        let (ha, hb) = (h.sibling(), h.sibling());
        let mut a = WorkerInflight::new(64, 20);
        a.set_worker(shared::next_worker_number(&ha).expect("number"));
        let mut b = WorkerInflight::new(64, 20);
        b.set_worker(shared::next_worker_number(&hb).expect("number"));
        a.reserve(1, "pool/e0", 1_000, 0, BASE + 5, 600_000);
        a.publish(&ha, BASE + 5, false);
        a.first_token(1);
        a.publish(&ha, BASE + 100, true);
        a.reserve(2, "pool/e0", 1_000, 500, BASE + 110, 600_000);
        a.publish(&ha, BASE + 110, false);
        b.refresh_peers(&hb, BASE + 130);

        let mut ws = workers(2, 20);
        run_ticks(&mut ws, 5);
        ws.reserve(0, 1, "pool/e0", 1_000, 0, 5);
        ws.first_token(0, 1);
        run_ticks(&mut ws, 100);
        ws.reserve(0, 2, "pool/e0", 1_000, 500, 110);
        assert_eq!(b.live(BASE + 130), 2);
        assert_eq!(counted(&mut ws, 1, 130), 2);
    }

    #[test]
    fn first_token_reports_pending_prefill_once_as_the_filter_samples_ttft() {
        let mut ws = workers(2, 20);
        ws.reserve(0, 1, "pool/e0", 1_000, 0, 5);
        ws.reserve(0, 2, "pool/e0", 1_000, 500, 5);
        // No pending prefill (the whole prompt predicted cached): no TTFT sample.
        assert!(!ws.first_token(0, 1));
        // Pending prefill: a sample, once; an unknown id or worker gives none.
        assert!(ws.first_token(0, 2));
        assert!(!ws.first_token(0, 2));
        assert!(!ws.first_token(0, 9));
        assert!(!ws.first_token(5, 2));
    }

    #[test]
    fn a_worker_holding_reservations_republishes_every_second() {
        let mut ws = workers(2, 20);
        reserve(&mut ws, 0, 1, 5);
        let first = ws.workers.first().and_then(|x| x.published_at);
        // Worker 0 ticks at 0, 100, ...: nothing changed, and 995 ms is not yet a second.
        run_ticks(&mut ws, 1_000);
        assert_eq!(ws.workers.first().and_then(|x| x.published_at), first);
        run_ticks(&mut ws, 1_100);
        assert_eq!(ws.workers.first().and_then(|x| x.published_at), Some(1_100));
    }

    #[test]
    fn share_zero_reads_and_publishes_at_every_request() {
        let mut ws = workers(2, 0);
        reserve(&mut ws, 0, 1, 5);
        assert_eq!(counted(&mut ws, 1, 5), 1);
        reserve(&mut ws, 0, 2, 5);
        assert_eq!(counted(&mut ws, 1, 5), 2);
    }

    #[test]
    fn a_routed_prefix_reaches_the_other_worker_at_their_ticks_in_order() {
        let mut ws = workers(2, 20);
        let snap = snapshot();
        let info = RequestInfo {
            api: ApiKind::Completions,
            model: Some(MODEL.to_string()),
            prompt_tokens: 2_048,
            prompt_tokens_exact: true,
            max_output_tokens: Some(64),
            n: 1,
            priority: 0,
            stream: true,
            prefix_hashes: vec![11, 12, 13],
        };
        // Worker 0 routes at t = 10, after its tick at 0.
        run_ticks(&mut ws, 10);
        let chosen = ws
            .decide(0, 10, |r, t| {
                match r.route_request(&snap, t, &info, 10).outcome {
                    Outcome::Route(r) => Some(r.primary),
                    _ => None,
                }
            })
            .flatten()
            .expect("routed");
        let id = format!("pool/e{chosen}");
        let blocks = |ws: &mut Workers, w: usize| ws.router(w).map(|r| r.prefix_blocks(&id));
        assert_eq!(blocks(&mut ws, 0), Some(3));
        // Worker 1's tick at 50 comes before worker 0 appended (its tick at 100).
        run_ticks(&mut ws, 60);
        assert_eq!(blocks(&mut ws, 1), Some(0));
        // Worker 0 appends at 100; worker 1 replays at 150.
        run_ticks(&mut ws, 140);
        assert_eq!(blocks(&mut ws, 1), Some(0));
        run_ticks(&mut ws, 150);
        assert_eq!(blocks(&mut ws, 1), Some(3));
        // Every worker has seen the record: the journal is empty again.
        assert!(ws.journal.is_empty());
        assert_eq!(ws.journal_base, 1);
    }

    #[test]
    fn requests_spread_over_the_workers() {
        let mut ws = workers(4, 20);
        let mut per = [0usize; 4];
        for _ in 0..4_000 {
            if let Some(c) = per.get_mut(ws.assign()) {
                *c += 1;
            }
        }
        // Binomial(4000, 1/4): mean 1000, sd 27; ±150 is over 5 sd.
        assert!(per.iter().all(|&c| (850..=1150).contains(&c)), "{per:?}");
    }
}
