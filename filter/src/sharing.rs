//! What the Envoy workers of one proxy share through journals in shared data (host I/O only;
//! the journal is [`kvroute_core::affinity`]):
//!
//! | journal | key | records | router calls |
//! |---|---|---|---|
//! | prefix affinity | [`AFFINITY_KEY`] | (endpoint id, prefix chain) of each routed request | `take_recorded` / `import_affinity` |
//! | learner observations | [`LEARNED_KEY`] | first-token and output-length observations ([`kvroute_core::observation`]) | `take_observations` / `import_observation` |
//!
//! The core module docs say why each is shared. On its tick (every `affinity_sync_ms`,
//! default 100 ms), each worker, for each journal it shares:
//! 1. reads the journal from shared data;
//! 2. replays into its router every record other workers appended since its last sync;
//! 3. drops records older than [`RETENTION_PERIODS`] sync periods, appends the records its
//!    router made since then and writes the journal back with compare-and-swap,
//!    retrying from 1 on a race (at most [`CAS_RETRIES`] times).
//!
//! Nothing runs on the request path. A journal is read in place and appended to as bytes;
//! each imported record is handed to the router as a key and words (an observation copies
//! its key into the learner). An observation whose record was cut to fit the byte bound
//! (possible only for a model name near `affinity_journal_bytes`) no longer decodes and is
//! skipped by every reader. A journal that cannot be read is replaced by
//! a fresh one (counter `kvroute.affinity.reset` or `kvroute.learned.reset`): hints or
//! observations are lost, routing goes on.

use crate::host::{Host, HostError, MetricKind};
use crate::names::{metric, AFFINITY_KEY, LEARNED_KEY};
use crate::shared::{SharedError, CAS_RETRIES};
use kvroute_core::affinity::{append, JournalRef};
use kvroute_core::router::Router;

/// Sync periods a journal record is kept: every live worker syncs once per period, so 20
/// leaves a stalled worker 2 s (at the default 100 ms) before it misses records.
pub const RETENTION_PERIODS: u64 = 20;

/// What one sync of one journal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Synced {
    /// Records from other workers replayed into this worker's router (affinity: endpoints
    /// of its current snapshot only; observations: those the learners used).
    pub imported: usize,
    /// Records this worker published.
    pub published: usize,
}

/// A journal and the router calls that fill and read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Journal {
    /// Prefix affinity ([`AFFINITY_KEY`]).
    Affinity,
    /// Learner observations ([`LEARNED_KEY`]).
    Learned,
}

impl Journal {
    fn key(self) -> &'static str {
        match self {
            Journal::Affinity => AFFINITY_KEY,
            Journal::Learned => LEARNED_KEY,
        }
    }

    /// (imported, published, reset) counters.
    fn metrics(self) -> [&'static str; 3] {
        match self {
            Journal::Affinity => [
                metric::AFFINITY_IMPORTED,
                metric::AFFINITY_PUBLISHED,
                metric::AFFINITY_RESET,
            ],
            Journal::Learned => [
                metric::LEARNED_IMPORTED,
                metric::LEARNED_PUBLISHED,
                metric::LEARNED_RESET,
            ],
        }
    }

    fn take(self, router: &mut Router) -> Vec<(String, Vec<u64>)> {
        match self {
            Journal::Affinity => router.take_recorded(),
            Journal::Learned => router.take_observations(),
        }
    }

    fn import(self, router: &mut Router, key: &str, words: &[u64]) -> bool {
        match self {
            Journal::Affinity => router.import_affinity(key, words),
            Journal::Learned => router.import_observation(key, words),
        }
    }
}

/// One sync of `router` (writer number `writer`) with the shared `journal`: import what
/// others appended after sequence number `seen`, publish what `router` made since the last
/// sync (dropping records older than `retention_ms` first), and advance `seen`. `max_bytes`
/// bounds the journal. Errors: host failures and persistent CAS contention (the records
/// taken from the router are then lost; only hints and observations, never a reservation).
pub fn sync<H: Host>(
    host: &H,
    journal: Journal,
    router: &mut Router,
    writer: u32,
    seen: &mut u64,
    max_bytes: usize,
    retention_ms: u64,
) -> Result<Synced, SharedError> {
    let key = journal.key();
    let [imported_metric, published_metric, reset_metric] = journal.metrics();
    let outbox = journal.take(router);
    let mut done = Synced::default();
    let mut words: Vec<u64> = Vec::new();
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = host.shared_get(key)?;
        match bytes.as_deref().map(JournalRef::parse) {
            Some(Ok(j)) => {
                // A journal that restarted (reset, or a new Envoy generation) has smaller
                // numbers than this worker saw.
                if j.next_seq() <= *seen {
                    *seen = 0;
                }
                for r in j.records() {
                    let Ok(r) = r else {
                        host.metric_add(MetricKind::Counter, reset_metric, 1);
                        break;
                    };
                    if r.seq <= *seen || r.writer == writer {
                        continue;
                    }
                    words.clear();
                    words.extend(r.hashes());
                    if journal.import(router, r.endpoint, &words) {
                        done.imported += 1;
                    }
                }
                *seen = j.next_seq().saturating_sub(1);
            }
            Some(Err(_)) => {
                host.metric_add(MetricKind::Counter, reset_metric, 1);
                *seen = 0;
            }
            None => {}
        }
        if outbox.is_empty() {
            break;
        }
        let next = append(
            bytes.as_deref(),
            writer,
            host.now_ms(),
            &outbox,
            max_bytes,
            retention_ms,
        );
        match host.shared_set(key, &next, Some(cas.unwrap_or(0))) {
            Ok(()) => {
                // Our own records are skipped by writer, so `seen` may move past them.
                if let Ok(j) = JournalRef::parse(&next) {
                    *seen = j.next_seq().saturating_sub(1);
                }
                done.published = outbox.len();
                break;
            }
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    if !outbox.is_empty() && done.published == 0 {
        return Err(SharedError::Contended(key));
    }
    if done.imported > 0 {
        host.metric_add(
            MetricKind::Counter,
            imported_metric,
            i64::try_from(done.imported).unwrap_or(i64::MAX),
        );
    }
    if done.published > 0 {
        host.metric_add(
            MetricKind::Counter,
            published_metric,
            i64::try_from(done.published).unwrap_or(i64::MAX),
        );
    }
    Ok(done)
}
