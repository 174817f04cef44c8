//! Prefix affinity shared between router instances: a bounded journal of routed prefix
//! chains.
//!
//! Envoy runs one Wasm VM per worker thread, and each worker has its own [`crate::router::Router`]
//! and [`crate::prefix::PrefixIndex`]. Without sharing, a conversation whose turns arrive on
//! different connections (and so on different workers) is matched only against what that
//! worker routed: with `--concurrency N` the affinity a fleet can see is diluted N ways, and
//! two workers can pin the same prefix to two different replicas.
//!
//! The journal is how workers tell each other what they routed. Each worker appends the
//! chains it recorded since its last sync ([`append`]) and replays the chains other workers
//! appended since it last looked ([`JournalRef::records`]) into its own index. The filter
//! keeps the journal in one proxy-wasm shared-data key, updated with compare-and-swap on the
//! worker's tick (every `affinity_sync_ms`, default 100 ms), so the request path pays
//! nothing. The journal is a transport, not a store: records older than a retention time
//! (the filter keeps 20 sync periods, 2 s by default) are dropped when a worker next writes
//! (by [`append`]), and the journal is bounded in bytes, oldest records dropped first.
//! A worker that falls further behind simply misses them (its index is an approximation of
//! the servers' caches anyway; see [`crate::prefix`]). So the journal's size follows the
//! request rate over the retention time, not the number of requests ever routed.
//!
//! ## Wire format
//! Little-endian, no padding:
//!
//! | field | bytes |
//! |---|---|
//! | magic `KVA1` | 4 |
//! | next sequence number | 8 (u64) |
//! | records, oldest first | see below |
//!
//! Each record: sequence number (u64), time written (Unix ms, u64), writer (u32),
//! endpoint-id length (u16), endpoint id
//! (UTF-8), hash count (u16), then the chain's block hashes (u64 each, in chain order, as
//! [`crate::prefix::block_hashes`] returns them). Sequence numbers strictly increase.
//!
//! The format is a transport of (key, `u64` words) records, so the same code carries the
//! learners' observations ([`crate::observation`]) in a journal of their own: the key is
//! an endpoint id or a model name, the words a kind and values instead of a chain.

/// Magic bytes opening an encoded journal.
pub const JOURNAL_MAGIC: [u8; 4] = *b"KVA1";

/// Default bound on an encoded journal, bytes (256 KiB): about 128 chains of the default
/// 256-block maximum, or thousands of typical chat prefixes, within the retention time.
pub const DEFAULT_JOURNAL_BYTES: usize = 256 * 1024;

/// Header bytes: magic + next sequence number.
const HEADER: usize = 4 + 8;
/// Fixed bytes of a record besides its id and hashes: seq + time + writer + id length +
/// count.
const RECORD_FIXED: usize = 8 + 8 + 4 + 2 + 2;

/// A journal that cannot be read. The caller starts a fresh one (losing only affinity
/// hints or learner observations, never a routing decision).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    /// The bytes do not start with [`JOURNAL_MAGIC`].
    #[error("shared journal: bad magic")]
    BadMagic,
    /// A record runs past the end of the bytes.
    #[error("shared journal: truncated at byte {0}")]
    Truncated(usize),
    /// A record's key (endpoint id, or model name for an observation) is not UTF-8.
    #[error("shared journal: record key at byte {0} is not UTF-8")]
    BadId(usize),
    /// Sequence numbers do not strictly increase, or reach the header's next number.
    #[error("shared journal: sequence out of order at byte {0}")]
    BadSequence(usize),
}

/// One routed chain, read in place from a journal's bytes: `writer` sent a request whose
/// prefix chain is [`RecordRef::hashes`] to `endpoint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRef<'a> {
    /// Sequence number in the journal.
    pub seq: u64,
    /// When it was appended, Unix ms.
    pub at_ms: u64,
    /// Which router instance wrote it (the filter uses its per-Envoy worker number).
    pub writer: u32,
    /// Endpoint id (`EndpointStats::id`).
    pub endpoint: &'a str,
    /// The chain's block hashes, 8 bytes each, little-endian.
    raw_hashes: &'a [u8],
    /// Offset of the record in the journal's bytes.
    offset: usize,
}

impl<'a> RecordRef<'a> {
    /// The chain's block hashes, in chain order.
    pub fn hashes(&self) -> impl Iterator<Item = u64> + 'a {
        self.raw_hashes.chunks_exact(8).map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
    }

    /// Number of block hashes.
    pub fn hash_count(&self) -> usize {
        self.raw_hashes.len() / 8
    }
}

/// A journal read in place (nothing is copied): the header, then records on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalRef<'a> {
    next_seq: u64,
    buf: &'a [u8],
}

/// Iterator over a journal's records, oldest first; yields an error (then stops) at the
/// first record that cannot be read.
#[derive(Debug, Clone)]
pub struct Records<'a> {
    buf: &'a [u8],
    at: usize,
    last: u64,
    next_seq: u64,
    failed: bool,
}

fn take<'a>(buf: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], JournalError> {
    let end = at.checked_add(n).ok_or(JournalError::Truncated(*at))?;
    let s = buf.get(*at..end).ok_or(JournalError::Truncated(*at))?;
    *at = end;
    Ok(s)
}

fn le<const N: usize>(buf: &[u8], at: &mut usize) -> Result<[u8; N], JournalError> {
    let mut b = [0u8; N];
    b.copy_from_slice(take(buf, at, N)?);
    Ok(b)
}

impl<'a> Records<'a> {
    fn read(&mut self) -> Result<RecordRef<'a>, JournalError> {
        let offset = self.at;
        let at = &mut self.at;
        let seq = u64::from_le_bytes(le(self.buf, at)?);
        if seq <= self.last || seq >= self.next_seq {
            return Err(JournalError::BadSequence(offset));
        }
        self.last = seq;
        let at_ms = u64::from_le_bytes(le(self.buf, at)?);
        let writer = u32::from_le_bytes(le(self.buf, at)?);
        let id_len = usize::from(u16::from_le_bytes(le(self.buf, at)?));
        let endpoint = std::str::from_utf8(take(self.buf, at, id_len)?)
            .map_err(|_| JournalError::BadId(offset))?;
        let n = usize::from(u16::from_le_bytes(le(self.buf, at)?));
        let raw_hashes = take(self.buf, at, n * 8)?;
        Ok(RecordRef {
            seq,
            at_ms,
            writer,
            endpoint,
            raw_hashes,
            offset,
        })
    }
}

impl<'a> Iterator for Records<'a> {
    type Item = Result<RecordRef<'a>, JournalError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.at >= self.buf.len() {
            return None;
        }
        let r = self.read();
        self.failed = r.is_err();
        Some(r)
    }
}

impl<'a> JournalRef<'a> {
    /// Read a journal's header. Errors: [`JournalError::BadMagic`], or
    /// [`JournalError::Truncated`] for bytes shorter than the header; records are checked
    /// as [`JournalRef::records`] reaches them.
    pub fn parse(buf: &'a [u8]) -> Result<Self, JournalError> {
        if buf.get(..4) != Some(&JOURNAL_MAGIC[..]) {
            return Err(JournalError::BadMagic);
        }
        let mut at = 4;
        let next_seq = u64::from_le_bytes(le(buf, &mut at)?);
        Ok(Self { next_seq, buf })
    }

    /// The sequence number the next appended record will get; every record already in the
    /// journal has a smaller one.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.max(1)
    }

    /// The records, oldest first.
    pub fn records(&self) -> Records<'a> {
        Records {
            buf: self.buf,
            at: HEADER,
            last: 0,
            next_seq: self.next_seq,
            failed: false,
        }
    }
}

/// The bytes of an empty journal whose first record will get sequence number 1.
pub fn empty() -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER);
    out.extend_from_slice(&JOURNAL_MAGIC);
    out.extend_from_slice(&1u64.to_le_bytes());
    out
}

/// A new journal: the records of `old` (a journal's bytes; `None` or unreadable bytes start
/// afresh) appended at or after `now_ms − max_age_ms`, then `chains` (endpoint id, block
/// hashes) written by `writer` at `now_ms`, with the oldest records dropped until the whole
/// fits in `max_bytes`. Records are copied as bytes, never decoded. Chains without hashes
/// or with an endpoint id over `u16::MAX` bytes are skipped; a chain that alone would not
/// fit is cut to its leading hashes (a chain's prefix is itself a valid chain).
pub fn append(
    old: Option<&[u8]>,
    writer: u32,
    now_ms: u64,
    chains: &[(String, Vec<u64>)],
    max_bytes: usize,
    max_age_ms: u64,
) -> Vec<u8> {
    let room = max_bytes.saturating_sub(HEADER);
    let cutoff = now_ms.saturating_sub(max_age_ms);
    // Existing records to keep: offsets of the readable, young-enough ones (a tail).
    let (mut next_seq, body, starts) = match old.map(JournalRef::parse) {
        Some(Ok(j)) => {
            let mut starts: Vec<usize> = Vec::new();
            let mut end = HEADER;
            for r in j.records() {
                let Ok(r) = r else { break };
                if r.at_ms < cutoff {
                    starts.clear();
                } else {
                    starts.push(r.offset);
                }
                end = r.offset + RECORD_FIXED + r.endpoint.len() + r.raw_hashes.len();
            }
            (j.next_seq(), j.buf.get(..end).unwrap_or_default(), starts)
        }
        _ => (1, &[][..], Vec::new()),
    };
    // New records: each chain's hash count (cut to what fits alone), measured before any
    // is encoded.
    let sized: Vec<(&str, &[u64])> = chains
        .iter()
        .filter_map(|(endpoint, hashes)| {
            if hashes.is_empty() || endpoint.len() > usize::from(u16::MAX) {
                return None;
            }
            let fixed = RECORD_FIXED + endpoint.len();
            let n = hashes
                .len()
                .min((room.saturating_sub(fixed) / 8).min(usize::from(u16::MAX)));
            (n > 0).then(|| (endpoint.as_str(), hashes.get(..n).unwrap_or_default()))
        })
        .collect();
    let record_len =
        |(endpoint, hashes): &(&str, &[u64])| RECORD_FIXED + endpoint.len() + 8 * hashes.len();
    // Drop the oldest (kept records first, then new ones) until the whole fits: `k` kept
    // and `f` new records from the front. (An index, not `Vec::remove(0)`: a journal at
    // its bound drops about as many records per sync as it appends, hundreds at 9,000
    // requests a second, and removing each from the front moved the rest every time: about
    // a tenth of a sync's ~335 µs in Envoy, docs/overhead.md.) Only the new records that
    // stay are encoded, straight into the journal sized for them: at that rate a tick's
    // records come to several times the bound, and most are dropped here.
    let kept_len = |k: usize| starts.get(k).map_or(0, |&s| body.len() - s);
    let mut fresh_len: usize = sized.iter().map(record_len).sum();
    let (mut k, mut f) = (0, 0);
    while kept_len(k) + fresh_len > room {
        if k < starts.len() {
            k += 1;
        } else if let Some(r) = sized.get(f) {
            fresh_len -= record_len(r);
            f += 1;
        } else {
            break;
        }
    }
    // Every new record takes a sequence number, the dropped ones too.
    let first_seq = next_seq;
    next_seq = next_seq.saturating_add(sized.len() as u64);
    let mut out = Vec::with_capacity(HEADER + kept_len(k) + fresh_len);
    out.extend_from_slice(&JOURNAL_MAGIC);
    out.extend_from_slice(&next_seq.to_le_bytes());
    if let Some(&s) = starts.get(k) {
        out.extend_from_slice(body.get(s..).unwrap_or_default());
    }
    for (i, (endpoint, hashes)) in sized.iter().enumerate().skip(f) {
        let seq = first_seq.saturating_add(i as u64);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&now_ms.to_le_bytes());
        out.extend_from_slice(&writer.to_le_bytes());
        out.extend_from_slice(&(endpoint.len() as u16).to_le_bytes());
        out.extend_from_slice(endpoint.as_bytes());
        out.extend_from_slice(&(hashes.len() as u16).to_le_bytes());
        for h in *hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn chain(id: &str, hashes: &[u64]) -> (String, Vec<u64>) {
        (id.to_owned(), hashes.to_vec())
    }

    /// (seq, at_ms, writer, endpoint, hashes) of every record, or the first error.
    type Rec = (u64, u64, u32, String, Vec<u64>);
    fn read(buf: &[u8]) -> Result<(u64, Vec<Rec>), JournalError> {
        let j = JournalRef::parse(buf)?;
        let recs = j
            .records()
            .map(|r| {
                r.map(|r| {
                    (
                        r.seq,
                        r.at_ms,
                        r.writer,
                        r.endpoint.to_owned(),
                        r.hashes().collect(),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((j.next_seq(), recs))
    }

    const BIG: usize = 1 << 20;
    const FOREVER: u64 = u64::MAX;

    #[test]
    fn append_and_read_in_place() {
        let j = append(
            None,
            1,
            5,
            &[chain("p/a", &[1, 2, 3]), chain("p/b", &[9])],
            BIG,
            FOREVER,
        );
        let j = append(Some(&j), 2, 6, &[chain("p/a", &[1, 2])], BIG, FOREVER);
        // header 12 + (24+3+24) + (24+3+8) + (24+3+16)
        assert_eq!(j.len(), 12 + 51 + 35 + 43);
        let (next, recs) = read(&j).unwrap();
        assert_eq!(next, 4);
        assert_eq!(
            recs,
            vec![
                (1, 5, 1, "p/a".into(), vec![1, 2, 3]),
                (2, 5, 1, "p/b".into(), vec![9]),
                (3, 6, 2, "p/a".into(), vec![1, 2]),
            ]
        );
        assert_eq!(read(&empty()).unwrap(), (1, vec![]));
    }

    /// Sequence numbers saturate at `u64::MAX`: the header's next number stays there, the
    /// records numbered up to it read back, and one numbered past it repeats it, which a
    /// reader reports as a bad sequence (the journal is then taken as reset).
    #[test]
    fn sequence_numbers_saturate() {
        let mut j = empty();
        j[4..12].copy_from_slice(&(u64::MAX - 2).to_le_bytes());
        let two = [chain("p/a", &[1]), chain("p/b", &[2])];
        let j = append(Some(&j), 1, 5, &two, BIG, FOREVER);
        let (next, recs) = read(&j).unwrap();
        assert_eq!(next, u64::MAX);
        let seqs: Vec<u64> = recs.iter().map(|r| r.0).collect();
        assert_eq!(seqs, [u64::MAX - 2, u64::MAX - 1]);
        let j = append(Some(&j), 1, 6, &two, BIG, FOREVER);
        assert_eq!(JournalRef::parse(&j).unwrap().next_seq(), u64::MAX);
        // Header 12, then four 35-byte records (24 fixed, a 3-byte id, one hash); the third
        // and fourth are both numbered u64::MAX.
        assert_eq!(j.len(), 12 + 4 * 35);
        assert_eq!(j[12 + 70..12 + 78], u64::MAX.to_le_bytes());
        assert_eq!(j[12 + 105..12 + 113], u64::MAX.to_le_bytes());
        assert_eq!(read(&j), Err(JournalError::BadSequence(12 + 70)));
    }

    #[test]
    fn bounded_by_dropping_the_oldest() {
        // Each record: 24 + 3 + 8 = 35 bytes; room for 3 within 12 + 105 = 117.
        let mut j = empty();
        for i in 0..5u64 {
            j = append(Some(&j), 1, i, &[chain("p/a", &[i])], 117, FOREVER);
        }
        assert_eq!(j.len(), 117);
        let (next, recs) = read(&j).unwrap();
        assert_eq!(next, 6);
        let kept: Vec<u64> = recs.iter().map(|r| r.4[0]).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        // One append larger than the room keeps its newest records only.
        let many: Vec<_> = (10..15u64).map(|i| chain("p/a", &[i])).collect();
        let j = append(Some(&j), 1, 9, &many, 117, FOREVER);
        let kept: Vec<u64> = read(&j).unwrap().1.iter().map(|r| r.4[0]).collect();
        assert_eq!(kept, vec![12, 13, 14]);
    }

    #[test]
    fn old_records_expire() {
        let mut j = empty();
        for t in [100u64, 200, 300, 400] {
            j = append(Some(&j), 1, t, &[chain("p/a", &[t])], BIG, 1_000);
        }
        let j = append(Some(&j), 1, 450, &[], BIG, 200);
        let (next, recs) = read(&j).unwrap();
        assert_eq!(recs.iter().map(|r| r.1).collect::<Vec<_>>(), vec![300, 400]);
        assert_eq!(next, 5, "sequence numbers never reused");
        // A clock that stepped back drops nothing.
        let again = append(Some(&j), 1, 0, &[], BIG, 10);
        assert_eq!(again, j);
    }

    #[test]
    fn oversized_chain_is_cut_to_its_leading_hashes() {
        // room = 72 - 12 = 60; fixed = 24 + 3 = 27; 33 / 8 = 4 hashes fit.
        let j = append(
            None,
            7,
            0,
            &[chain("p/a", &[1, 2, 3, 4, 5, 6])],
            72,
            FOREVER,
        );
        assert_eq!(read(&j).unwrap().1[0].4, vec![1, 2, 3, 4]);
        assert!(j.len() <= 72);
        // Empty chains and a bound too small for any hash add nothing.
        let j = append(
            None,
            7,
            0,
            &[chain("p/a", &[]), chain("p/a", &[1])],
            20,
            FOREVER,
        );
        assert_eq!(read(&j).unwrap(), (1, vec![]));
    }

    #[test]
    fn corrupt_bytes_are_errors_and_appends_start_afresh() {
        assert_eq!(
            JournalRef::parse(b"nope").unwrap_err(),
            JournalError::BadMagic
        );
        let j = append(None, 1, 0, &[chain("p/a", &[1, 2])], BIG, FOREVER);
        assert_eq!(
            read(&j[..j.len() - 1]),
            Err(JournalError::Truncated(12 + 27))
        );
        let mut bad_seq = j.clone();
        bad_seq[4..12].copy_from_slice(&1u64.to_le_bytes()); // next_seq not above the record
        assert_eq!(read(&bad_seq), Err(JournalError::BadSequence(12)));
        let mut bad_id = j.clone();
        bad_id[12 + 22] = 0xff;
        assert_eq!(read(&bad_id), Err(JournalError::BadId(12)));
        // Appending after garbage starts a new journal.
        let fresh = append(Some(b"garbage"), 1, 0, &[chain("p/a", &[7])], BIG, FOREVER);
        assert_eq!(
            read(&fresh).unwrap(),
            (2, vec![(1, 0, 1, "p/a".into(), vec![7])])
        );
    }

    proptest! {
        #[test]
        fn reading_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = read(&bytes);
            let mut with_magic = JOURNAL_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = read(&with_magic);
            let _ = append(Some(&with_magic), 1, 1, &[chain("p", &[1])], 4096, 10);
        }

        #[test]
        fn appends_keep_the_newest_records_within_the_bounds(
            batches in proptest::collection::vec(
                proptest::collection::vec(("[a-z/]{0,12}", proptest::collection::vec(any::<u64>(), 0..40)), 0..6),
                0..8),
            max in 12usize..2048,
            age in 0u64..5,
        ) {
            let mut j = empty();
            let mut all: Vec<(u64, String, Vec<u64>)> = Vec::new(); // (time, id, hashes) appended
            for (t, b) in batches.into_iter().enumerate() {
                let t = t as u64;
                j = append(Some(&j), 9, t, &b, max, age);
                prop_assert!(j.len() <= max.max(12));
                let (_, recs) = read(&j).unwrap();
                // Appended: chains with hashes whose id leaves room for at least one hash.
                let room = max.saturating_sub(12);
                for (id, h) in b.into_iter().filter(|(id, h)| {
                    !h.is_empty() && room.saturating_sub(24 + id.len()) >= 8
                }) {
                    all.push((t, id, h));
                }
                // What is kept is a suffix of what was appended, none older than `age`,
                // each chain a prefix of the one appended.
                prop_assert!(recs.len() <= all.len());
                let tail = &all[all.len() - recs.len()..];
                for (r, (at, id, h)) in recs.iter().zip(tail) {
                    prop_assert_eq!(r.1, *at);
                    prop_assert!(r.1 + age >= t);
                    prop_assert_eq!(&r.3, id);
                    prop_assert!(h.starts_with(&r.4));
                }
                let seqs: Vec<u64> = recs.iter().map(|r| r.0).collect();
                prop_assert!(seqs.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }
}
