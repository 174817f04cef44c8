//! Prefix affinity shared by the Envoy workers of one proxy (host I/O only; the journal is
//! [`kvroute_core::affinity::Journal`], whose module doc explains why).
//!
//! On its tick (every `affinity_sync_ms`, default 100 ms), each worker:
//! 1. reads the journal from shared data ([`AFFINITY_KEY`]);
//! 2. replays into its router every record other workers appended since its last sync;
//! 3. appends the chains its router recorded since then and writes the journal back with
//!    compare-and-swap, retrying from 1 on a race (at most [`CAS_RETRIES`] times).
//!
//! Nothing runs on the request path. A journal that cannot be decoded is replaced by a fresh
//! one (counter `kvroute.affinity.reset`): affinity hints are lost, routing goes on.

use crate::host::{Host, HostError, MetricKind};
use crate::names::{metric, AFFINITY_KEY};
use crate::shared::{SharedError, CAS_RETRIES};
use kvroute_core::affinity::Journal;
use kvroute_core::router::Router;

/// What one [`sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Synced {
    /// Records from other workers replayed into this worker's router.
    pub imported: usize,
    /// Chains this worker published.
    pub published: usize,
}

/// One sync of `router` (writer number `writer`) with the shared journal: import what others
/// appended after sequence number `seen`, publish what `router` recorded, and advance `seen`.
/// `max_bytes` bounds the journal. Errors: host failures and persistent CAS contention (the
/// chains taken from the router are then lost; only hints, never a reservation).
pub fn sync<H: Host>(
    host: &H,
    router: &mut Router,
    writer: u32,
    seen: &mut u64,
    max_bytes: usize,
) -> Result<Synced, SharedError> {
    let outbox = router.take_recorded();
    let mut done = Synced::default();
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = host.shared_get(AFFINITY_KEY)?;
        let mut journal = match bytes.as_deref().map(Journal::decode) {
            Some(Ok(j)) => j,
            None => Journal::new(),
            Some(Err(_)) => {
                host.metric_add(MetricKind::Counter, metric::AFFINITY_RESET, 1);
                Journal::new()
            }
        };
        // A journal that restarted (reset, or a new Envoy generation) has smaller numbers.
        if journal.next_seq() <= *seen {
            *seen = 0;
        }
        for r in journal.since(*seen).filter(|r| r.writer != writer) {
            router.import_affinity(&r.endpoint, &r.hashes);
            done.imported += 1;
        }
        *seen = journal.next_seq().saturating_sub(1);
        if outbox.is_empty() {
            break;
        }
        journal.append(writer, outbox.iter().cloned(), max_bytes);
        match host.shared_set(AFFINITY_KEY, &journal.encode(), Some(cas.unwrap_or(0))) {
            Ok(()) => {
                // Our own records are skipped by writer, so `seen` may move past them.
                *seen = journal.next_seq().saturating_sub(1);
                done.published = outbox.len();
                break;
            }
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    if !outbox.is_empty() && done.published == 0 {
        return Err(SharedError::Contended(AFFINITY_KEY));
    }
    if done.imported > 0 {
        host.metric_add(
            MetricKind::Counter,
            metric::AFFINITY_IMPORTED,
            i64::try_from(done.imported).unwrap_or(i64::MAX),
        );
    }
    if done.published > 0 {
        host.metric_add(
            MetricKind::Counter,
            metric::AFFINITY_PUBLISHED,
            i64::try_from(done.published).unwrap_or(i64::MAX),
        );
    }
    Ok(done)
}
