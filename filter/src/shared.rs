//! Process-wide state in proxy-wasm shared data: the current snapshot (published by the
//! queue consumer, read through a per-worker cache), the keys later updated with
//! compare-and-swap, and the worker counter. Each worker's in-flight table is in
//! [`crate::inflight`].
//!
//! Snapshot publication writes [`SNAPSHOT_KEY`] first and [`SNAPSHOT_VERSION_KEY`] second,
//! the latter with CAS, so two consumers racing cannot move the version backwards, and a
//! reader that sees a new version always finds a snapshot at least that new. Then the
//! publisher writes [`SNAPSHOT_SIGNAL_KEY`] with an empty value, which gives that key a new
//! CAS token (proxy-wasm hosts give every write of shared data a fresh token,
//! `SharedData::set` in proxy-wasm-cpp-host). Readers poll only the signal on each request:
//! a host call that returns data calls back into the VM to allocate it, ~10 k instructions
//! inside Envoy's V8, while an empty value is returned without any (~1.5 k;
//! `kvroute-overhead --callgrind`, docs/overhead.md). Only when the token changed do they
//! read the version key, and decode the snapshot only when the version changed
//! ([`SnapshotCache`]). Without the signal key (before the first publication) they read the
//! version key on every request, as before.
//!
//! The version key holds 16 bytes: the version (u64, big-endian) then the consumer's clock
//! when it was published (Unix ms, u64 big-endian). That time drives the *takeover* rule:
//! a snapshot that is not newer is normally dropped, but once the version in force has not
//! been replaced for [`TAKEOVER_AFTER_MS`], the next valid snapshot is published whatever
//! its version. Without it, one far-future version (a control plane whose clock later
//! stepped back, a second control plane, a bogus `u64::MAX` push) would pin the filter to
//! stale stats until Envoy restarts. With the control plane's 1 s heartbeat a live
//! publisher is never taken over; a dead one is replaced within the window.

use crate::host::{Host, HostError};
use crate::names::{
    AFFINITY_KEY, LEARNED_KEY, SNAPSHOT_KEY, SNAPSHOT_SIGNAL_KEY, SNAPSHOT_VERSION_KEY,
    WORKER_SEQ_KEY,
};
use kvroute_core::snapshot::{Snapshot, SnapshotError};
use std::rc::Rc;

/// CAS attempts before giving up on a shared-data update.
pub const CAS_RETRIES: u32 = 32;

/// Milliseconds without a new publication after which a snapshot that is not newer than
/// the one in force replaces it (ten control-plane heartbeats of 1 s; see the module doc).
pub const TAKEOVER_AFTER_MS: u64 = 10_000;

/// Outcome of [`publish_snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Now current.
    Published(u64),
    /// Not newer than `current`; dropped.
    Ignored {
        /// Version offered.
        offered: u64,
        /// Version in force.
        current: u64,
    },
}

/// Errors of the shared-data layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SharedError {
    /// The snapshot bytes are invalid.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A host call failed.
    #[error(transparent)]
    Host(#[from] HostError),
    /// CAS kept failing.
    #[error("shared data `{0}` stayed contended after {CAS_RETRIES} attempts")]
    Contended(&'static str),
}

fn decode_version(bytes: Option<&[u8]>) -> Option<u64> {
    let b: [u8; 8] = bytes?.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

/// When the version in force was published (consumer clock, Unix ms); 0 when unknown.
fn decode_published_at(bytes: Option<&[u8]>) -> u64 {
    bytes
        .and_then(|b| b.get(8..16))
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_be_bytes)
}

/// The value of [`SNAPSHOT_VERSION_KEY`]: `version` then `published_at_ms`, both u64
/// big-endian (read back by `decode_version` and `decode_published_at`).
fn version_value(version: u64, published_at_ms: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&version.to_be_bytes());
    v[8..].copy_from_slice(&published_at_ms.to_be_bytes());
    v
}

/// Current published snapshot version, if any.
pub fn current_version<H: Host>(host: &H) -> Result<Option<u64>, HostError> {
    let (v, _) = host.shared_get(SNAPSHOT_VERSION_KEY)?;
    Ok(decode_version(v.as_deref()))
}

/// Validate `bytes` and publish them unless not newer than the current version (or, past
/// [`TAKEOVER_AFTER_MS`] without a publication, whatever their version: see the module doc).
///
/// Race note: Envoy delivers `on_queue_ready` to the one root context that registered the
/// queue, so there is a single consumer in practice; the native build serialises its
/// consumers itself (`dynmod/src/glue.rs`, `enqueue`). Were there two, one could overwrite the
/// snapshot bytes after the other's newer version won the CAS; readers then use those bytes
/// until the next publication ([`SnapshotCache`] still decodes once per version).
pub fn publish_snapshot<H: Host>(host: &H, bytes: &[u8]) -> Result<Published, SharedError> {
    let snap = Snapshot::decode(bytes)?;
    for _ in 0..CAS_RETRIES {
        let (cur, cas) = host.shared_get(SNAPSHOT_VERSION_KEY)?;
        let now = host.now_ms();
        if let Some(current) = decode_version(cur.as_deref()) {
            let idle = now.saturating_sub(decode_published_at(cur.as_deref()));
            if snap.version <= current && idle < TAKEOVER_AFTER_MS {
                return Ok(Published::Ignored {
                    offered: snap.version,
                    current,
                });
            }
        }
        host.shared_set(SNAPSHOT_KEY, bytes, None)?;
        let key = version_value(snap.version, now);
        match host.shared_set(SNAPSHOT_VERSION_KEY, &key, Some(cas.unwrap_or(0))) {
            Ok(()) => {
                // A new CAS token for the readers' poll (see the module doc).
                host.shared_set(SNAPSHOT_SIGNAL_KEY, &[], None)?;
                return Ok(Published::Published(snap.version));
            }
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SharedError::Contended(SNAPSHOT_VERSION_KEY))
}

/// Create the shared keys that are later updated with compare-and-swap, if absent.
///
/// proxy-wasm's CAS value 0 means "no check": an update of a key that does not exist yet
/// is unconditional, so two workers making their first update at the same moment would
/// each overwrite the other's (two workers would get the same number, two journal records
/// would be lost). Creating the keys at configure time, before any request, makes every
/// later update a real CAS. proxy-wasm has no create-if-absent write, so two first
/// configurations racing here could still reset a key another had just updated (the worker
/// counter: two workers would get one number); Envoy configures the plugin's main-thread
/// instance before its workers', so they find the keys created.
pub fn ensure_keys<H: Host>(host: &H) -> Result<(), SharedError> {
    let (seq, _) = host.shared_get(WORKER_SEQ_KEY)?;
    if seq.is_none() {
        host.shared_set(WORKER_SEQ_KEY, &0u64.to_be_bytes(), None)?;
    }
    for key in [AFFINITY_KEY, LEARNED_KEY] {
        let (journal, _) = host.shared_get(key)?;
        if journal.is_none() {
            host.shared_set(key, &kvroute_core::affinity::empty(), None)?;
        }
    }
    Ok(())
}

/// A number no other worker (or plugin instance) of this Envoy got: a counter in shared data,
/// incremented with CAS. Reservation ids use it as their upper bits, so two workers that
/// configured in the same clock tick (same time-derived seed) can never collide; a collision
/// made one worker's reservation replace the other's and lose a release (found by the
/// 64-request herd test on `--concurrency 2`).
pub fn next_worker_number<H: Host>(host: &H) -> Result<u32, SharedError> {
    for _ in 0..CAS_RETRIES {
        let (cur, cas) = host.shared_get(WORKER_SEQ_KEY)?;
        let n = decode_version(cur.as_deref()).unwrap_or(0).wrapping_add(1);
        match host.shared_set(WORKER_SEQ_KEY, &n.to_be_bytes(), Some(cas.unwrap_or(0))) {
            Ok(()) => return Ok(u32::try_from(n & 0xFFFF_FFFF).unwrap_or(u32::MAX)),
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SharedError::Contended(WORKER_SEQ_KEY))
}

/// A decode at least this long, µs, holds its snapshot for [`HOLD_FACTOR`] times as long
/// ([`SnapshotCache::current`]); a faster one holds nothing. A 16-endpoint snapshot
/// decodes in tens of µs (and, under [`HOLD_MIN_BYTES`], is not even timed).
pub const HOLD_AFTER_DECODE_US: u64 = 200;

/// How long a slow decode holds its snapshot, in multiples of the decode's own time: 9, so
/// that decoding takes at most a tenth of a worker's time however often snapshots arrive.
pub const HOLD_FACTOR: u64 = 9;

/// Snapshot bodies shorter than this, bytes, are decoded without reading the clock
/// (16 KiB: ~150 endpoints of ~100 bytes, far under [`HOLD_AFTER_DECODE_US`] to decode).
pub const HOLD_MIN_BYTES: usize = 16 * 1024;

/// Per-worker cache of the decoded snapshot, refreshed only when the version changes.
///
/// Each worker decodes each version it sees, so a fleet's snapshot of ~1 MB (thousands of
/// endpoints; several ms to decode) pushed every few ms would leave a worker decoding
/// instead of routing (found by a breaker). A decode of [`HOLD_AFTER_DECODE_US`] or more
/// therefore holds its snapshot for [`HOLD_FACTOR`] times its own duration: requests in
/// that window use it without polling the signal (one clock read instead), and the newest
/// version is read after it. Stats arrive every scrape interval (200 ms by default), so a
/// hold of a few ms loses nothing.
#[derive(Debug, Default)]
pub struct SnapshotCache {
    /// CAS token of [`SNAPSHOT_SIGNAL_KEY`] when the version was last read.
    signal: Option<u32>,
    version: Option<u64>,
    snap: Option<Rc<Snapshot>>,
    /// Models served and the `GET /v1/models` body, built with each decode.
    catalog: Option<Rc<crate::reply::ModelCatalog>>,
    /// How many times the snapshot was decoded (for tests and debugging).
    pub decodes: u64,
    /// Host clock, µs, until which the snapshot is used without polling; 0: not held.
    hold_until_us: u64,
}

impl SnapshotCache {
    /// The current snapshot (`None` before the first publication); a held one
    /// ([type doc](SnapshotCache)) while its hold lasts.
    pub fn current<H: Host>(&mut self, host: &H) -> Result<Option<Rc<Snapshot>>, SharedError> {
        if self.hold_until_us > 0 {
            if self.snap.is_some() && host.now_us() < self.hold_until_us {
                return Ok(self.snap.clone());
            }
            self.hold_until_us = 0;
        }
        let (_, signal) = host.shared_get(SNAPSHOT_SIGNAL_KEY)?;
        if signal.is_some() && signal == self.signal && self.snap.is_some() {
            return Ok(self.snap.clone());
        }
        let (key, _) = host.shared_get(SNAPSHOT_VERSION_KEY)?;
        let v = decode_version(key.as_deref());
        if v.is_some() && v != self.version {
            let (bytes, _) = host.shared_get(SNAPSHOT_KEY)?;
            if let Some(bytes) = bytes {
                // The clock is read around a decode only for a body large enough to be slow
                // (~100 bytes an endpoint: 16 KiB is ~150 endpoints, tens of µs).
                let started = (bytes.len() >= HOLD_MIN_BYTES).then(|| host.now_us());
                self.decodes += 1;
                // Keyed by the version *key*, not the decoded version: if two consumers ever
                // raced and left older bytes under a newer version, this still decodes once
                // per published version, never per request.
                self.version = v;
                let mut snap = Snapshot::decode(&bytes)?;
                // The control plane's clock is not Envoy's: its times are moved to the
                // moment of publication, on Envoy's clock (`Snapshot::rebase_clock`).
                let published_at = decode_published_at(key.as_deref());
                if published_at > 0 {
                    snap.rebase_clock(published_at);
                }
                self.catalog = Some(Rc::new(crate::reply::ModelCatalog::from_snapshot(&snap)));
                self.snap = Some(Rc::new(snap));
                if let Some(started) = started {
                    let now = host.now_us();
                    let took = now.saturating_sub(started);
                    if took >= HOLD_AFTER_DECODE_US {
                        self.hold_until_us = now.saturating_add(took.saturating_mul(HOLD_FACTOR));
                    }
                }
            }
        }
        // Remembered only once the version it announced has been read.
        self.signal = signal;
        Ok(self.snap.clone())
    }

    /// The models of the current snapshot (`None` before the first publication), refreshed
    /// like [`SnapshotCache::current`].
    pub fn catalog<H: Host>(
        &mut self,
        host: &H,
    ) -> Result<Option<Rc<crate::reply::ModelCatalog>>, SharedError> {
        self.current(host)?;
        Ok(self.catalog.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use kvroute_core::snapshot::EndpointStats;

    fn snap(v: u64) -> Vec<u8> {
        Snapshot::new(v, 0, vec![]).encode()
    }

    #[test]
    fn publish_rejects_older_and_equal_versions() {
        let h = MockHost::new(0);
        assert_eq!(
            publish_snapshot(&h, &snap(5)).unwrap(),
            Published::Published(5)
        );
        assert_eq!(
            publish_snapshot(&h, &snap(5)).unwrap(),
            Published::Ignored {
                offered: 5,
                current: 5
            }
        );
        assert_eq!(
            publish_snapshot(&h, &snap(4)).unwrap(),
            Published::Ignored {
                offered: 4,
                current: 5
            }
        );
        assert_eq!(current_version(&h).unwrap(), Some(5));
        assert!(matches!(
            publish_snapshot(&h, b"{}"),
            Err(SharedError::Snapshot(_))
        ));
    }

    #[test]
    fn silent_publisher_is_taken_over_after_the_window() {
        let h = MockHost::new(1_000);
        assert_eq!(
            publish_snapshot(&h, &snap(u64::MAX)).unwrap(),
            Published::Published(u64::MAX)
        );
        // Within the window an older version is dropped...
        *h.now.borrow_mut() = 1_000 + TAKEOVER_AFTER_MS - 1;
        assert_eq!(
            publish_snapshot(&h, &snap(7)).unwrap(),
            Published::Ignored {
                offered: 7,
                current: u64::MAX
            }
        );
        // ...past it, the live publisher takes over, and normal ordering resumes from there.
        *h.now.borrow_mut() = 1_000 + TAKEOVER_AFTER_MS;
        assert_eq!(
            publish_snapshot(&h, &snap(7)).unwrap(),
            Published::Published(7)
        );
        assert_eq!(current_version(&h).unwrap(), Some(7));
        assert_eq!(
            publish_snapshot(&h, &snap(6)).unwrap(),
            Published::Ignored {
                offered: 6,
                current: 7
            }
        );
        let mut c = SnapshotCache::default();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 7);
    }

    #[test]
    fn ensure_keys_creates_once_and_keeps_the_worker_count() {
        let h = MockHost::new(0);
        ensure_keys(&h).unwrap();
        assert_eq!(next_worker_number(&h).unwrap(), 1);
        // A reconfigure (second call) must not reset the count.
        ensure_keys(&h).unwrap();
        assert_eq!(next_worker_number(&h).unwrap(), 2);
    }

    #[test]
    fn worker_numbers_are_distinct() {
        let h = MockHost::new(0);
        ensure_keys(&h).unwrap();
        let other = h.sibling();
        assert_eq!(next_worker_number(&h).unwrap(), 1);
        assert_eq!(next_worker_number(&other).unwrap(), 2);
        h.shared.borrow_mut().fail_cas = 3;
        assert_eq!(next_worker_number(&h).unwrap(), 3);
    }

    /// A snapshot body of ~20 KiB (200 endpoints), over [`HOLD_MIN_BYTES`].
    fn big_snap(v: u64) -> Vec<u8> {
        let eps = (0..200).map(|i| EndpointStats::fixture(i, 0)).collect();
        let b = Snapshot::new(v, 0, eps).encode();
        assert!(b.len() >= HOLD_MIN_BYTES, "{}", b.len());
        b
    }

    #[test]
    fn a_slow_decode_holds_its_snapshot_nine_times_as_long() {
        let h = MockHost::new(1);
        let mut c = SnapshotCache::default();
        // Each clock read advances the clock by 1 ms: the decode reads it twice, so it
        // "took" 1,000 µs and holds v1 until 1,000 + 9 × 1,000 µs after it ended.
        *h.us_step.borrow_mut() = (1_000, 0);
        publish_snapshot(&h, &big_snap(1)).unwrap();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 1);
        assert_eq!(c.hold_until_us, 1_000 + 1_000 + 9 * 1_000);
        publish_snapshot(&h, &big_snap(2)).unwrap();
        // Clock reads at 3,000 .. 10,000 µs: v1, and the signal is not read.
        *h.calls.borrow_mut() = Default::default();
        for _ in 0..8 {
            assert_eq!(c.current(&h).unwrap().unwrap().version, 1);
        }
        assert_eq!(h.calls.borrow().get("shared_get"), None);
        assert_eq!(h.calls.borrow().get("now_us"), Some(&8));
        assert_eq!(c.decodes, 1);
        // At 11,000 µs the hold is over: v2 is read (and held in turn).
        assert_eq!(c.current(&h).unwrap().unwrap().version, 2);
        assert_eq!(c.decodes, 2);
        // A fast decode (the still clock: 0 µs) holds nothing, and a small body reads no
        // clock at all.
        *h.us_step.borrow_mut() = (0, 0);
        *h.now.borrow_mut() = 100;
        publish_snapshot(&h, &big_snap(3)).unwrap();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 3);
        assert_eq!(c.hold_until_us, 0);
        publish_snapshot(&h, &snap(4)).unwrap();
        *h.calls.borrow_mut() = Default::default();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 4);
        assert_eq!(h.calls.borrow().get("now_us"), None);
    }

    #[test]
    fn cache_decodes_only_on_version_change() {
        let h = MockHost::new(0);
        let mut c = SnapshotCache::default();
        assert!(c.current(&h).unwrap().is_none());
        publish_snapshot(&h, &snap(1)).unwrap();
        for _ in 0..10 {
            assert_eq!(c.current(&h).unwrap().unwrap().version, 1);
        }
        assert_eq!(c.decodes, 1);
        publish_snapshot(&h, &snap(2)).unwrap();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 2);
        assert_eq!(c.decodes, 2);
    }

    #[test]
    fn readers_poll_the_empty_signal_and_read_the_version_only_when_it_moved() {
        let h = MockHost::new(0);
        let mut c = SnapshotCache::default();
        publish_snapshot(&h, &snap(1)).unwrap();
        let (signal, _) = h.shared_get(SNAPSHOT_SIGNAL_KEY).unwrap();
        assert_eq!(
            signal.as_deref(),
            Some(&[][..]),
            "the signal carries no bytes"
        );
        assert_eq!(c.current(&h).unwrap().unwrap().version, 1);
        h.take_calls();
        // Unchanged: one read of the (empty) signal, nothing else.
        assert_eq!(c.current(&h).unwrap().unwrap().version, 1);
        assert_eq!(h.take_calls(), [("shared_get", 1)]);
        // A publication moves the signal's CAS token: the version and snapshot are read.
        publish_snapshot(&h, &snap(2)).unwrap();
        h.take_calls();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 2);
        assert_eq!(h.take_calls(), [("shared_get", 3)]);
        // An older publication is ignored and does not move the signal.
        assert!(matches!(
            publish_snapshot(&h, &snap(1)).unwrap(),
            Published::Ignored { .. }
        ));
        h.take_calls();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 2);
        assert_eq!(h.take_calls(), [("shared_get", 1)]);
        assert_eq!(c.decodes, 2);
    }

    #[test]
    fn without_the_signal_key_the_version_is_read_on_every_request() {
        // A snapshot published by an older ingest that wrote no signal key.
        let h = MockHost::new(0);
        let mut c = SnapshotCache::default();
        h.shared_set(SNAPSHOT_KEY, &snap(7), None).unwrap();
        h.shared_set(SNAPSHOT_VERSION_KEY, &version_value(7, 0), None)
            .unwrap();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 7);
        h.take_calls();
        assert_eq!(c.current(&h).unwrap().unwrap().version, 7);
        // The signal (absent), then the version.
        assert_eq!(h.take_calls(), [("shared_get", 2)]);
        assert_eq!(c.decodes, 1);
    }

    #[test]
    fn a_cas_update_that_stays_contended_is_an_error() {
        let h = MockHost::new(0);
        ensure_keys(&h).unwrap();
        h.shared.borrow_mut().fail_cas = CAS_RETRIES;
        assert_eq!(
            next_worker_number(&h).unwrap_err(),
            SharedError::Contended(WORKER_SEQ_KEY)
        );
        assert_eq!(next_worker_number(&h).unwrap(), 1, "nothing was taken");
    }
}
