//! In-flight reservations across this Envoy's workers: each worker keeps its own table in
//! its VM and publishes a copy under its own shared-data key; it reads the other workers'
//! copies at most once per `inflight_share_ms` (config; 20 ms by default).
//!
//! Why per worker: one table shared by every worker had to be read (a host call that
//! returns data allocates inside the VM: ~10 k instructions in Envoy's V8) and decoded at
//! each decision, then encoded and written back with compare-and-swap at each reservation,
//! and read and written again when the first response bytes arrived; that work also grew
//! with the number of requests in flight, since the whole table travelled each time.
//! Now a reservation, a first token and a release touch only the worker's own table in
//! memory; the shared-data traffic happens at most once per interval (and on the tick),
//! whatever the request rate (docs/overhead.md, "Per-worker in-flight tables").
//!
//! What it costs: a decision sees its own worker's reservations at once, and the other
//! workers' as of at most `inflight_share_ms` + their publication delay ago (a worker
//! publishes when it reserves and its last publication is at least `inflight_share_ms` old,
//! else on its next tick, ≤ [`crate::router::RELEASE_FLUSH_MS`]). The shared table already
//! made releases wait for the tick; reservations now wait too, across workers only.
//!
//! Liveness: a worker holding reservations republishes its table at least every
//! [`HEARTBEAT_MS`]; a worker whose table is empty publishes an empty value, once, and
//! needs no heartbeat (an empty key counts nothing, and reading it allocates nothing in the
//! VM). Readers ignore a non-empty copy dated more than [`PEER_STALE_MS`] from their clock
//! (older, or in their future after the clock stepped back; the writer republishes at its
//! next tick after such a step): a worker whose VM was
//! replaced by a reconfiguration stops counting within seconds, where its entries in the
//! shared table lasted until their TTL, 10 minutes by default. A key a reader has found
//! stale, with the same publication time, across [`PEER_DEAD_MS`] of its own reads (a dead
//! worker's, never a live one's: a live worker with reservations heartbeats every second,
//! also after a pause of the whole process or a step of the clock) is then read only once
//! per [`PEER_DEAD_MS`], and counted again as soon as it moves.
//!
//! The value under `kvroute.inflight.<worker number>`: empty, or the publication time (Unix
//! ms, u64 big-endian) then `InflightTable::encode`.

use crate::host::{period_passed, Host, Level};
use crate::names::{INFLIGHT_KEY_PREFIX, WORKER_SEQ_KEY};
use kvroute_core::inflight::InflightTable;
use std::collections::BTreeMap;

/// A worker holding reservations republishes its table at least this often, ms.
pub const HEARTBEAT_MS: u64 = 1_000;
/// A worker's published table dated more than this from the reader's clock (older, or in
/// its future after the clock stepped back) is ignored, ms (five heartbeats).
pub const PEER_STALE_MS: u64 = 5_000;
/// A key found stale with the same publication time for this long of a reader's time is
/// read only once per this interval afterwards, ms.
pub const PEER_DEAD_MS: u64 = 60_000;
/// Only the latest this many worker numbers are read (each reconfiguration of the plugin
/// numbers its workers anew): a worker more than this many numbers older than the newest
/// is not counted by the others (a plugin instance that outlived 256 newer workers of
/// reconfigured ones).
pub const PEER_SCAN: u32 = 256;

/// How long a read of the worker counter (`kvroute.worker.seq`) serves, ms: workers are
/// numbered when Envoy starts or reconfigures the plugin, so a new worker's table is
/// first read up to this late, and a read of the others' tables costs no read of the
/// counter in between (a data-returning host call, ~10 k instructions in Envoy's V8). The
/// filter's tick period ([`crate::router::RELEASE_FLUSH_MS`]).
pub const WORKER_COUNT_MS: u64 = crate::router::RELEASE_FLUSH_MS;

/// What a reader remembers of a worker whose non-empty table it found stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Silent {
    /// The publication time it found.
    published_at: u64,
    /// When it first found that publication stale (reader's clock, Unix ms).
    since_ms: u64,
    /// Not read again before this time (0: read at every refresh).
    skip_until_ms: u64,
}

/// This worker's reservations and its latest copy of the other workers'.
#[derive(Debug)]
pub struct WorkerInflight {
    /// Reservations this worker made and has not released.
    own: InflightTable,
    /// The other workers' reservations, as last read.
    peers: InflightTable,
    /// This worker's number (0: none, then nothing is published or read).
    worker: u32,
    /// `kvroute.inflight.<worker>`.
    key: String,
    share_ms: u64,
    /// When `peers` was last read (Unix ms); `None` before the first read.
    read_ms: Option<u64>,
    /// The highest worker number, as read from the counter at `count_ms` (Unix ms; `None`
    /// before the first read).
    highest: u32,
    count_ms: Option<u64>,
    /// When `own` was last published (Unix ms).
    published_ms: u64,
    /// `own` changed since it was last published.
    dirty: bool,
    /// Reservations dropped by their `reservation_ttl_ms` since the last
    /// [`Self::take_expired`] (their stream outlived it, or never ended).
    expired: u64,
    /// Workers whose table was found stale, by number (within the scan window).
    silent: BTreeMap<u32, Silent>,
}

/// Outcome of one read of the other workers' tables ([`WorkerInflight::refresh_peers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerRead {
    /// Workers whose table was read and counted.
    pub counted: u32,
    /// Workers whose table was dated more than [`PEER_STALE_MS`] from the reader's clock
    /// (ignored).
    pub stale: u32,
    /// Workers not read: found stale with the same publication time for
    /// [`PEER_DEAD_MS`], read again once per that interval.
    pub skipped: u32,
    /// Workers whose value could not be decoded (ignored, logged).
    pub corrupt: u32,
}

impl WorkerInflight {
    /// An empty view, bounded like `InflightTable::new(max_entries)` per table, reading the
    /// other workers at most once per `share_ms`.
    pub fn new(max_entries: usize, share_ms: u64) -> Self {
        Self {
            own: InflightTable::new(max_entries),
            peers: InflightTable::new(max_entries),
            worker: 0,
            key: String::new(),
            share_ms,
            read_ms: None,
            highest: 0,
            count_ms: None,
            published_ms: 0,
            dirty: false,
            expired: 0,
            silent: BTreeMap::new(),
        }
    }

    /// Set this worker's number (`shared::next_worker_number`), which names its key.
    pub fn set_worker(&mut self, worker: u32) {
        self.worker = worker;
        self.key = format!("{INFLIGHT_KEY_PREFIX}{worker}");
    }

    /// The tables a decision counts: this worker's, then the others' copy (the router takes
    /// them as `kvroute_core::inflight::Reservations`).
    pub fn view(&self) -> [&InflightTable; 2] {
        [&self.own, &self.peers]
    }

    /// This worker's own table.
    pub fn own(&self) -> &InflightTable {
        &self.own
    }

    /// Reserve on this worker's table (`InflightTable::reserve_with_prefill`).
    pub fn reserve(
        &mut self,
        id: u64,
        endpoint: &str,
        tokens: u64,
        prefill_tokens: u64,
        now_ms: u64,
        ttl_ms: u64,
    ) {
        self.own
            .reserve_with_prefill(id, endpoint, tokens, prefill_tokens, now_ms, ttl_ms);
        self.dirty = true;
    }

    /// `id`'s first token arrived: its pending prefill drops to 0.
    pub fn first_token(&mut self, id: u64) {
        if self.own.first_token(id).is_some_and(|cleared| cleared > 0) {
            self.dirty = true;
        }
    }

    /// Release `id`; true the first time (false for an unknown or released id).
    pub fn release(&mut self, id: u64) -> bool {
        let released = self.own.release(id).is_some();
        self.dirty |= released;
        released
    }

    /// Live reservations counted, this worker's and the others' (expired ones excluded).
    pub fn live(&self, now_ms: u64) -> usize {
        self.own.live(now_ms) + self.peers.live(now_ms)
    }

    /// Make the next [`Self::refresh_peers`] read the other workers' tables whatever
    /// `share_ms` says (a worker about to go idle with no timer, [`crate::router::Worker::flush`]).
    pub fn refresh_now(&mut self) {
        self.read_ms = None;
    }

    /// Read the other workers' tables again if the copy is `inflight_share_ms` old (0: at
    /// every call), or the clock stepped back. `None` when the copy was fresh enough, or
    /// this worker has no number. A host error keeps the old copy (logged) and retries next
    /// interval. Costs one read per other worker number in the scan window (a
    /// data-returning read for a worker holding reservations, an empty or absent one, with
    /// no allocation in the VM, for the others), and one of the worker counter when the
    /// last is [`WORKER_COUNT_MS`] old.
    pub fn refresh_peers<H: Host>(&mut self, host: &H, now_ms: u64) -> Option<PeerRead> {
        if self.worker == 0 {
            return None;
        }
        if let Some(t) = self.read_ms {
            if !period_passed(now_ms, t, self.share_ms) {
                return None;
            }
        }
        self.read_ms = Some(now_ms);
        // The counter again once its last read is old (or the clock stepped back past it).
        if self
            .count_ms
            .is_none_or(|t| period_passed(now_ms, t, WORKER_COUNT_MS))
        {
            let count = match host.shared_get(WORKER_SEQ_KEY) {
                Ok((Some(b), _)) => b
                    .get(..8)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map_or(0, u64::from_be_bytes),
                Ok((None, _)) => 0,
                Err(e) => {
                    host.log(
                        Level::Warn,
                        &format!("kvroute: worker count unreadable: {e}"),
                    );
                    return None;
                }
            };
            self.highest = u32::try_from(count).unwrap_or(u32::MAX);
            self.count_ms = Some(now_ms);
        }
        let highest = self.highest;
        let mut read = PeerRead::default();
        self.peers.clear();
        let mut key = String::with_capacity(INFLIGHT_KEY_PREFIX.len() + 10);
        let low = highest.saturating_sub(PEER_SCAN - 1).max(1);
        self.silent.retain(|n, _| *n >= low);
        for n in low..=highest {
            if n == self.worker {
                continue;
            }
            if let Some(s) = self.silent.get(&n) {
                // Skipped until the interval ends (or the clock stepped back past it).
                if now_ms < s.skip_until_ms && s.skip_until_ms - now_ms <= PEER_DEAD_MS {
                    read.skipped += 1;
                    continue;
                }
            }
            key.clear();
            key.push_str(INFLIGHT_KEY_PREFIX);
            let _ = std::fmt::Write::write_fmt(&mut key, format_args!("{n}"));
            let bytes = match host.shared_get(&key) {
                Ok((Some(b), _)) if !b.is_empty() => b,
                // Not published yet, or an empty table (or unreadable: counted as nothing).
                _ => {
                    self.silent.remove(&n);
                    continue;
                }
            };
            let Some((at, table)) = bytes.split_first_chunk::<8>() else {
                read.corrupt += 1;
                continue;
            };
            let at = u64::from_be_bytes(*at);
            if now_ms.abs_diff(at) >= PEER_STALE_MS {
                read.stale += 1;
                let fresh = Silent {
                    published_at: at,
                    since_ms: now_ms,
                    skip_until_ms: 0,
                };
                let s = self.silent.entry(n).or_insert(fresh);
                if s.published_at != at || now_ms < s.since_ms {
                    *s = fresh;
                } else if now_ms - s.since_ms >= PEER_DEAD_MS {
                    s.skip_until_ms = now_ms.saturating_add(PEER_DEAD_MS);
                }
                continue;
            }
            self.silent.remove(&n);
            match InflightTable::decode(table) {
                Ok(t) => {
                    self.peers.absorb(t);
                    read.counted += 1;
                }
                Err(e) => {
                    read.corrupt += 1;
                    host.log(Level::Warn, &format!("kvroute: worker {n}'s {e}"));
                }
            }
        }
        Some(read)
    }

    /// Reservations dropped by their `reservation_ttl_ms` since the last call: a stream
    /// that outlived it is never released, so these balance the counters
    /// (`reserved = released + expired` once traffic stops).
    pub fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    /// Publish this worker's table under its key when it changed and the last publication
    /// is `inflight_share_ms` old (`force`: whenever it changed), or when it holds
    /// reservations and the last publication is [`HEARTBEAT_MS`] old. Expired reservations
    /// are dropped first; an empty table is published as an empty value. True when
    /// written; a host error leaves it to the next call.
    pub fn publish<H: Host>(&mut self, host: &H, now_ms: u64, force: bool) -> bool {
        if self.worker == 0 {
            return false;
        }
        let passed = |period| period_passed(now_ms, self.published_ms, period);
        let due = (self.dirty && (force || passed(self.share_ms)))
            || (!self.own.is_empty() && passed(HEARTBEAT_MS));
        if !due {
            return false;
        }
        let expired = self.own.purge_expired(now_ms);
        if expired > 0 {
            self.dirty = true;
            self.expired = self.expired.saturating_add(expired as u64);
        }
        let mut value = Vec::new();
        if !self.own.is_empty() {
            let table = self.own.encode();
            value.reserve_exact(8 + table.len());
            value.extend_from_slice(&now_ms.to_be_bytes());
            value.extend_from_slice(&table);
        }
        match host.shared_set(&self.key, &value, None) {
            Ok(()) => {
                self.published_ms = now_ms;
                self.dirty = false;
                true
            }
            Err(e) => {
                host.log(
                    Level::Warn,
                    &format!("kvroute: in-flight table not published: {e}"),
                );
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;

    const NOW: u64 = 1_000_000;

    fn numbered(h: &MockHost) -> WorkerInflight {
        let mut w = WorkerInflight::new(64, 20);
        w.set_worker(crate::shared::next_worker_number(h).unwrap());
        w
    }

    /// A host with the shared keys, two sibling hosts on it and a numbered worker on each.
    fn two_workers() -> (MockHost, MockHost, MockHost, WorkerInflight, WorkerInflight) {
        let h = MockHost::new(NOW);
        crate::shared::ensure_keys(&h).unwrap();
        let (ha, hb) = (h.sibling(), h.sibling());
        let (a, b) = (numbered(&ha), numbered(&hb));
        (h, ha, hb, a, b)
    }

    fn requests(t: &[&InflightTable; 2], i: usize) -> u32 {
        t[i].totals(NOW + 10_000).values().map(|l| l.requests).sum()
    }

    #[test]
    fn a_worker_sees_its_own_reservations_at_once_and_others_after_the_interval() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        assert_eq!(b.refresh_peers(&hb, NOW), Some(PeerRead::default()));
        a.reserve(1, "e0", 100, 40, NOW, 600_000);
        assert_eq!(requests(&a.view(), 0), 1);
        assert!(
            a.publish(&ha, NOW, false),
            "first change: published at once"
        );
        a.reserve(2, "e1", 50, 0, NOW + 5, 600_000);
        assert!(
            !a.publish(&ha, NOW + 5, false),
            "within the interval: waits"
        );
        // b's copy is fresh until 20 ms have passed; then it reads a's publication.
        assert_eq!(b.refresh_peers(&hb, NOW + 19), None);
        assert_eq!(requests(&b.view(), 1), 0);
        assert_eq!(
            b.refresh_peers(&hb, NOW + 20),
            Some(PeerRead {
                counted: 1,
                ..PeerRead::default()
            })
        );
        assert_eq!(b.peers.totals(NOW + 20)["e0"].prefill_tokens, 40);
        assert_eq!(requests(&b.view(), 1), 1);
        // The tick publishes what waited; first token and release reach b likewise.
        assert!(a.publish(&ha, NOW + 30, true));
        a.first_token(1);
        assert!(a.release(2));
        assert!(!a.release(2), "a second release is a no-op");
        assert!(a.publish(&ha, NOW + 60, false));
        b.refresh_peers(&hb, NOW + 60);
        let t = b.peers.totals(NOW + 60);
        assert_eq!(t["e0"].prefill_tokens, 0);
        assert_eq!(t["e0"].tokens, 100);
        assert!(!t.contains_key("e1"));
        assert_eq!(b.live(NOW + 60), 1);
        assert_eq!(a.live(NOW + 60), 1, "a does not read its own key back");
    }

    #[test]
    fn a_silent_worker_stops_counting_and_is_then_read_once_a_minute() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        a.reserve(1, "e0", 100, 0, NOW, 600_000);
        assert!(a.publish(&ha, NOW, false));
        // A live worker with reservations heartbeats even without changes.
        assert!(!a.publish(&ha, NOW + HEARTBEAT_MS - 1, true));
        assert!(a.publish(&ha, NOW + HEARTBEAT_MS, false));
        let at = NOW + HEARTBEAT_MS;
        // Then it goes silent (its VM was replaced).
        assert_eq!(
            b.refresh_peers(&hb, at + PEER_STALE_MS - 20)
                .unwrap()
                .counted,
            1
        );
        let r = b.refresh_peers(&hb, at + PEER_STALE_MS).unwrap();
        assert_eq!((r.counted, r.stale), (0, 1));
        assert_eq!(b.live(at + PEER_STALE_MS), 0);
        // Found stale with the same publication time for a minute of b's reads: skipped.
        let first_stale = at + PEER_STALE_MS;
        assert_eq!(
            b.refresh_peers(&hb, first_stale + PEER_DEAD_MS - 20)
                .unwrap()
                .stale,
            1
        );
        assert_eq!(
            b.refresh_peers(&hb, first_stale + PEER_DEAD_MS)
                .unwrap()
                .stale,
            1
        );
        hb.take_calls();
        let r = b
            .refresh_peers(&hb, first_stale + PEER_DEAD_MS + 100)
            .unwrap();
        assert_eq!((r.skipped, r.stale), (1, 0));
        assert_eq!(
            hb.take_calls(),
            [("shared_get", 1)],
            "only the worker count is read: the silent worker's key is skipped"
        );
        // A minute later it is read again; had it moved, it counts at once.
        a.reserve(2, "e0", 5, 0, first_stale + 2 * PEER_DEAD_MS, 600_000);
        assert!(a.publish(&ha, first_stale + 2 * PEER_DEAD_MS, false));
        let r = b
            .refresh_peers(&hb, first_stale + 2 * PEER_DEAD_MS)
            .unwrap();
        assert_eq!((r.counted, r.skipped), (1, 0));
        assert_eq!(b.live(first_stale + 2 * PEER_DEAD_MS), 2);
    }

    #[test]
    fn an_idle_worker_publishes_an_empty_value_and_counts_again_when_it_reserves() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        a.reserve(1, "e0", 100, 0, NOW, 600_000);
        assert!(a.publish(&ha, NOW, false));
        assert!(a.release(1));
        assert!(a.publish(&ha, NOW + 100, true));
        assert_eq!(ha.shared_get(&a.key).unwrap().0.as_deref(), Some(&[][..]));
        // Idle for two minutes: nothing to heartbeat, and b's reads find nothing stale.
        let mut t = NOW + 100;
        while t < NOW + 120_000 {
            t += 100;
            assert!(!a.publish(&ha, t, true));
            let r = b.refresh_peers(&hb, t).unwrap();
            assert_eq!((r.counted, r.stale, r.skipped), (0, 0, 0));
        }
        for id in 10..15 {
            a.reserve(id, "e0", 100, 0, t, 600_000);
        }
        assert!(a.publish(&ha, t, false));
        assert_eq!(b.refresh_peers(&hb, t + 20).unwrap().counted, 1);
        assert_eq!(b.live(t + 20), 5);
    }

    #[test]
    fn a_pause_of_the_whole_process_or_a_clock_step_marks_no_worker_silent_for_good() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        a.reserve(1, "e0", 100, 0, NOW, 600_000);
        assert!(a.publish(&ha, NOW, false));
        assert_eq!(b.refresh_peers(&hb, NOW + 20).unwrap().counted, 1);
        // 61 s later (paused, or the clock stepped): b reads first and finds a stale...
        let t = NOW + 61_000;
        assert_eq!(b.refresh_peers(&hb, t).unwrap().stale, 1);
        // ...then a heartbeats, reserves again, and b counts both at its next read.
        assert!(a.publish(&ha, t + 1, true));
        a.reserve(2, "e0", 100, 0, t + 5, 600_000);
        assert!(a.publish(&ha, t + 30, false));
        b.refresh_peers(&hb, t + 30);
        assert_eq!(b.live(t + 30), 2);
    }

    #[test]
    fn share_interval_zero_reads_and_publishes_at_every_call() {
        let h = MockHost::new(NOW);
        crate::shared::ensure_keys(&h).unwrap();
        let mut w = WorkerInflight::new(64, 0);
        w.set_worker(crate::shared::next_worker_number(&h).unwrap());
        for i in 0..3 {
            assert!(w.refresh_peers(&h, NOW).is_some(), "read {i}");
            w.reserve(i, "e0", 1, 0, NOW, 600_000);
            assert!(w.publish(&h, NOW, false), "publication {i}");
        }
    }

    #[test]
    fn corrupt_or_truncated_peer_tables_are_ignored() {
        let (_h, ha, hb, a, mut b) = two_workers();
        ha.shared_set(&a.key, b"\x00\x01", None).unwrap();
        assert_eq!(b.refresh_peers(&hb, NOW).unwrap().corrupt, 1);
        let mut v = NOW.to_be_bytes().to_vec();
        v.extend_from_slice(b"KVI1\x01");
        ha.shared_set(&a.key, &v, None).unwrap();
        assert_eq!(b.refresh_peers(&hb, NOW + 20).unwrap().corrupt, 1);
        assert!(hb
            .logs
            .borrow()
            .iter()
            .any(|l| l.contains("in-flight table")));
        assert_eq!(b.live(NOW + 20), 0);
    }

    #[test]
    fn without_a_worker_number_nothing_is_shared() {
        let h = MockHost::new(NOW);
        let mut w = WorkerInflight::new(64, 20);
        w.reserve(1, "e0", 10, 0, NOW, 600_000);
        h.take_calls();
        assert!(!w.publish(&h, NOW, true));
        assert_eq!(w.refresh_peers(&h, NOW), None);
        assert!(h.take_calls().is_empty());
        assert_eq!(w.live(NOW), 1);
    }

    #[test]
    fn one_worker_reads_only_the_worker_count_once_per_tick() {
        for share_ms in [0, 20] {
            let h = MockHost::new(NOW);
            crate::shared::ensure_keys(&h).unwrap();
            let mut w = WorkerInflight::new(64, share_ms);
            w.set_worker(crate::shared::next_worker_number(&h).unwrap());
            h.take_calls();
            for i in 0..250 {
                w.refresh_peers(&h, NOW + i);
            }
            assert_eq!(
                h.take_calls(),
                [("shared_get", 3)],
                "at 0, 100 and 200 ms, share {share_ms} ms"
            );
        }
    }

    #[test]
    fn a_worker_numbered_later_is_read_once_the_count_is_read_again() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        assert!(b.refresh_peers(&hb, NOW).is_some());
        // A third worker starts and reserves; b's count (2 workers) is 30 ms old.
        let hc = ha.sibling();
        let mut c = numbered(&hc);
        c.reserve(1, "e0", 10, 0, NOW + 30, 600_000);
        assert!(c.publish(&hc, NOW + 30, false));
        let r = b.refresh_peers(&hb, NOW + 30).unwrap();
        assert_eq!((r.counted, b.live(NOW + 30)), (0, 0));
        // At 100 ms the count is read again, and c's table with it.
        let r = b.refresh_peers(&hb, NOW + 100).unwrap();
        assert_eq!((r.counted, b.live(NOW + 100)), (1, 1));
        a.reserve(2, "e0", 10, 0, NOW + 100, 600_000);
        assert!(a.publish(&ha, NOW + 100, false));
        let r = b.refresh_peers(&hb, NOW + 120).unwrap();
        assert_eq!((r.counted, b.live(NOW + 120)), (2, 2));
    }

    /// Ticks of `a` (publish) and `b` (read) every 100 ms from `t`, `n` times: how long b
    /// counted none of a's reservations, ms. Reads first, as a reader may tick first.
    fn missed_ms(
        (a, ha): (&mut WorkerInflight, &MockHost),
        (b, hb): (&mut WorkerInflight, &MockHost),
        t: &mut u64,
        n: u32,
    ) -> u64 {
        let mut missed = 0;
        for _ in 0..n {
            *t += 100;
            b.refresh_peers(hb, *t);
            if b.peers.totals(*t).is_empty() {
                missed += 100;
            }
            a.publish(ha, *t, true);
        }
        missed
    }

    #[test]
    fn a_failed_write_after_purging_the_last_entries_skips_no_live_worker() {
        let (h, ha, hb, mut a, mut b) = two_workers();
        // A 2 s reservation, published, then a heartbeat.
        a.reserve(1, "e0", 100, 0, NOW, 2_000);
        assert!(a.publish(&ha, NOW, false));
        assert!(a.publish(&ha, NOW + 1_000, true));
        // The next heartbeat purges the expired entry and its write fails: the table stays
        // changed, so the tick after writes the empty value (else the old non-empty key
        // would age into "silent" and hide a's later reservations for a minute).
        h.shared.borrow_mut().fail_sets = 1;
        assert!(!a.publish(&ha, NOW + 2_000, true));
        assert!(a.publish(&ha, NOW + 2_100, true));
        assert_eq!(ha.shared_get(&a.key).unwrap().0.as_deref(), Some(&[][..]));
        let mut t = NOW + 2_100;
        missed_ms((&mut a, &ha), (&mut b, &hb), &mut t, 800);
        assert!(b.silent.is_empty());
        a.reserve(2, "e0", 100, 0, t, 600_000);
        assert!(a.publish(&ha, t, false));
        assert_eq!(missed_ms((&mut a, &ha), (&mut b, &hb), &mut t, 600), 0);
    }

    #[test]
    fn a_dead_workers_table_dated_in_the_future_does_not_count() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        a.reserve(1, "e0", 100, 0, NOW, 600_000);
        assert!(a.publish(&ha, NOW, false));
        // a's VM is replaced (nothing publishes under its key again), then the clock steps
        // back 10 minutes: its last table is dated in b's future.
        drop(a);
        let mut nobody = WorkerInflight::new(64, 20);
        let mut t = NOW - 600_000;
        let missed = missed_ms((&mut nobody, &ha), (&mut b, &hb), &mut t, 3_000);
        assert_eq!(missed, 300_000, "never counted");
    }

    #[test]
    fn a_live_worker_is_counted_across_a_backward_clock_step() {
        let (_h, ha, hb, mut a, mut b) = two_workers();
        a.reserve(1, "e0", 100, 0, NOW, 600_000);
        assert!(a.publish(&ha, NOW, false));
        // b reads first after the step (a's table is dated in its future), then a's tick
        // republishes: one read missed.
        let mut t = NOW - 600_000;
        assert_eq!(missed_ms((&mut a, &ha), (&mut b, &hb), &mut t, 1_000), 100);
    }
}
