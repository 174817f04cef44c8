//! Process-wide state in proxy-wasm shared data: the current snapshot (published by the
//! queue consumer, read through a per-worker cache) and the in-flight reservation table
//! (updated with compare-and-swap).
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
    AFFINITY_KEY, INFLIGHT_KEY, LEARNED_KEY, SNAPSHOT_KEY, SNAPSHOT_SIGNAL_KEY,
    SNAPSHOT_VERSION_KEY, WORKER_SEQ_KEY,
};
use kvroute_core::inflight::InflightTable;
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
    /// The in-flight table in shared data is corrupt.
    #[error("in-flight table: {0}")]
    Inflight(String),
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
/// queue, so there is a single consumer in practice. Were there two, one could overwrite the
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
/// is unconditional, so two workers making their first reservation at the same moment
/// would each overwrite the other's table and lose a reservation (seen as one release
/// too few in the herd test). Creating the keys at configure time, before any request,
/// makes every later update a real CAS. A race here only writes the same empty value twice.
pub fn ensure_keys<H: Host>(host: &H) -> Result<(), SharedError> {
    let (inflight, _) = host.shared_get(INFLIGHT_KEY)?;
    if inflight.is_none() {
        host.shared_set(INFLIGHT_KEY, &InflightTable::default().encode(), None)?;
    }
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

/// Per-worker cache of the decoded snapshot, refreshed only when the version changes.
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
}

impl SnapshotCache {
    /// The current snapshot (`None` before the first publication).
    pub fn current<H: Host>(&mut self, host: &H) -> Result<Option<Rc<Snapshot>>, SharedError> {
        let (_, signal) = host.shared_get(SNAPSHOT_SIGNAL_KEY)?;
        if signal.is_some() && signal == self.signal && self.snap.is_some() {
            return Ok(self.snap.clone());
        }
        let v = current_version(host)?;
        if v.is_some() && v != self.version {
            let (bytes, _) = host.shared_get(SNAPSHOT_KEY)?;
            if let Some(bytes) = bytes {
                self.decodes += 1;
                // Keyed by the version *key*, not the decoded version: if two consumers ever
                // raced and left older bytes under a newer version, this still decodes once
                // per published version, never per request.
                self.version = v;
                let snap = Snapshot::decode(&bytes)?;
                self.catalog = Some(Rc::new(crate::reply::ModelCatalog::from_snapshot(&snap)));
                self.snap = Some(Rc::new(snap));
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

/// The in-flight table as one read returned it, with the CAS token to write it back with
/// ([`update_inflight_from`]). `cas` is `None` when the key did not exist.
#[derive(Debug, Clone, PartialEq)]
pub struct InflightRead {
    /// The decoded table (a fresh one when the key did not exist).
    pub table: InflightTable,
    /// The CAS token of that read.
    pub cas: Option<u32>,
}

/// Apply `f` to the shared in-flight table with CAS, retrying on races. Returns `f`'s
/// result from the attempt that was written.
pub fn update_inflight<H: Host, R>(
    host: &H,
    max_entries: usize,
    f: impl FnMut(&mut InflightTable) -> R,
) -> Result<R, SharedError> {
    update_inflight_from(host, max_entries, None, f)
}

/// [`update_inflight`] whose first attempt starts from `first`, a read this callback already
/// made (the decision's), instead of reading the table again: one shared-data read and one
/// decode fewer per request. If another worker wrote in between, the CAS fails and the
/// later attempts read afresh, exactly as [`update_inflight`] does.
pub fn update_inflight_from<H: Host, R>(
    host: &H,
    max_entries: usize,
    mut first: Option<InflightRead>,
    mut f: impl FnMut(&mut InflightTable) -> R,
) -> Result<R, SharedError> {
    for _ in 0..CAS_RETRIES {
        let InflightRead { mut table, cas } = match first.take() {
            Some(r) => r,
            None => read_inflight_cas(host, max_entries)?,
        };
        let out = f(&mut table);
        match host.shared_set(INFLIGHT_KEY, &table.encode(), Some(cas.unwrap_or(0))) {
            Ok(()) => return Ok(out),
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SharedError::Contended(INFLIGHT_KEY))
}

/// Read the shared in-flight table and its CAS token (an empty table bounded by
/// `max_entries` when never written).
pub fn read_inflight_cas<H: Host>(
    host: &H,
    max_entries: usize,
) -> Result<InflightRead, SharedError> {
    let (bytes, cas) = host.shared_get(INFLIGHT_KEY)?;
    let table = match bytes.as_deref() {
        Some(b) => InflightTable::decode(b).map_err(|e| SharedError::Inflight(e.to_string()))?,
        None => InflightTable::new(max_entries),
    };
    Ok(InflightRead { table, cas })
}

/// Read the shared in-flight table (empty when never written).
pub fn read_inflight<H: Host>(host: &H) -> Result<InflightTable, SharedError> {
    read_inflight_cas(host, kvroute_core::inflight::DEFAULT_MAX_ENTRIES).map(|r| r.table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;

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
    fn ensure_keys_creates_once_and_keeps_live_reservations() {
        let h = MockHost::new(0);
        ensure_keys(&h).unwrap();
        assert!(read_inflight(&h).unwrap().is_empty());
        update_inflight(&h, 10, |t| t.reserve(7, "a", 5, 0, 100)).unwrap();
        // A reconfigure (second call) must not wipe the table.
        ensure_keys(&h).unwrap();
        assert_eq!(read_inflight(&h).unwrap().len(), 1);
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
    fn an_update_from_a_stale_read_retries_from_a_fresh_one() {
        let h = MockHost::new(0);
        let stale = read_inflight_cas(&h, 10).unwrap();
        // Another worker writes between this worker's read and its reservation.
        update_inflight(&h, 10, |t| t.reserve(1, "a", 5, 0, 100)).unwrap();
        h.take_calls();
        update_inflight_from(&h, 10, Some(stale), |t| t.reserve(2, "b", 7, 0, 100)).unwrap();
        // The stale write was refused; one fresh read and its write followed.
        assert_eq!(h.take_calls(), [("shared_get", 1), ("shared_set", 2)]);
        let t = read_inflight(&h).unwrap().totals(0);
        assert_eq!(
            (t["a"].tokens, t["b"].tokens),
            (5, 7),
            "neither write is lost"
        );
        // From a read nobody overtook: the write alone.
        let fresh = read_inflight_cas(&h, 10).unwrap();
        h.take_calls();
        assert_eq!(
            update_inflight_from(&h, 10, Some(fresh), |t| t.release(1).is_some()),
            Ok(true)
        );
        assert_eq!(h.take_calls(), [("shared_set", 1)]);
        assert_eq!(read_inflight(&h).unwrap().totals(0).len(), 1);
    }

    #[test]
    fn inflight_update_retries_cas() {
        let h = MockHost::new(0);
        h.shared.borrow_mut().fail_cas = 3;
        update_inflight(&h, 10, |t| t.reserve(1, "a", 5, 0, 100)).unwrap();
        assert_eq!(read_inflight(&h).unwrap().totals(0)["a"].tokens, 5);
        h.shared.borrow_mut().fail_cas = CAS_RETRIES;
        assert_eq!(
            update_inflight(&h, 10, |t| t.release(1)).unwrap_err(),
            SharedError::Contended(INFLIGHT_KEY)
        );
    }
}
