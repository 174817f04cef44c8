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
//! chains it recorded since its last sync ([`Journal::append`]) and replays the chains other
//! workers appended since it last looked ([`Journal::since`]) into its own index. The filter
//! keeps the journal in one proxy-wasm shared-data key, updated with compare-and-swap on the
//! worker's tick (every `affinity_sync_ms`, default 100 ms), so the request path pays
//! nothing. The journal is bounded in bytes: the oldest records are dropped first, and a
//! worker that falls further behind than the bound simply misses them (its index is an
//! approximation of the servers' caches anyway; see [`crate::prefix`]).
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
//! Each record: sequence number (u64), writer (u32), endpoint-id length (u16), endpoint id
//! (UTF-8), hash count (u16), then the chain's block hashes (u64 each, in chain order, as
//! [`crate::prefix::block_hashes`] returns them). Sequence numbers strictly increase.

use std::collections::VecDeque;

/// Magic bytes opening an encoded [`Journal`].
pub const JOURNAL_MAGIC: [u8; 4] = *b"KVA1";

/// Default bound on an encoded journal, bytes (256 KiB): about 128 chains of the default
/// 256-block maximum, or thousands of typical chat prefixes, per sync period.
pub const DEFAULT_JOURNAL_BYTES: usize = 256 * 1024;

/// Header bytes: magic + next sequence number.
const HEADER: usize = 4 + 8;
/// Fixed bytes of a record besides its id and hashes: seq + writer + id length + count.
const RECORD_FIXED: usize = 8 + 4 + 2 + 2;

/// One routed chain: `writer` sent a request whose prefix chain is `hashes` to `endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinityRecord {
    /// Sequence number in the journal (assigned by [`Journal::append`]).
    pub seq: u64,
    /// Which router instance wrote it (the filter uses its per-Envoy worker number).
    pub writer: u32,
    /// Endpoint id (`EndpointStats::id`).
    pub endpoint: String,
    /// Block hashes of the chain, at most `u16::MAX`.
    pub hashes: Vec<u64>,
}

impl AffinityRecord {
    fn encoded_len(&self) -> usize {
        RECORD_FIXED + self.endpoint.len() + self.hashes.len() * 8
    }
}

/// A journal that cannot be decoded. The caller starts a fresh one (losing only affinity
/// hints, never a routing decision).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    /// The bytes do not start with [`JOURNAL_MAGIC`].
    #[error("affinity journal: bad magic")]
    BadMagic,
    /// A record runs past the end of the bytes.
    #[error("affinity journal: truncated at byte {0}")]
    Truncated(usize),
    /// An endpoint id is not UTF-8.
    #[error("affinity journal: endpoint id at byte {0} is not UTF-8")]
    BadId(usize),
    /// Sequence numbers do not strictly increase, or reach the header's next number.
    #[error("affinity journal: sequence out of order at byte {0}")]
    BadSequence(usize),
}

/// The bounded journal of routed prefix chains (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    next_seq: u64,
    records: VecDeque<AffinityRecord>,
    /// Encoded size of `records`, bytes (without the header).
    bytes: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], JournalError> {
        let end = self
            .at
            .checked_add(n)
            .ok_or(JournalError::Truncated(self.at))?;
        let s = self
            .buf
            .get(self.at..end)
            .ok_or(JournalError::Truncated(self.at))?;
        self.at = end;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, JournalError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn u32(&mut self) -> Result<u32, JournalError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u16(&mut self) -> Result<u16, JournalError> {
        let mut b = [0u8; 2];
        b.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(b))
    }
}

impl Journal {
    /// An empty journal whose first record will get sequence number 1.
    pub fn new() -> Self {
        Self {
            next_seq: 1,
            records: VecDeque::new(),
            bytes: 0,
        }
    }

    /// Decode [`Journal::encode`]'s bytes. Errors: [`JournalError`], naming the byte offset.
    pub fn decode(buf: &[u8]) -> Result<Self, JournalError> {
        let mut r = Reader { buf, at: 0 };
        if r.take(4).ok() != Some(&JOURNAL_MAGIC[..]) {
            return Err(JournalError::BadMagic);
        }
        let next_seq = r.u64()?;
        let mut records = VecDeque::new();
        let mut bytes = 0;
        let mut last = 0u64;
        while r.at < buf.len() {
            let start = r.at;
            let seq = r.u64()?;
            if seq <= last || seq >= next_seq {
                return Err(JournalError::BadSequence(start));
            }
            last = seq;
            let writer = r.u32()?;
            let id_len = usize::from(r.u16()?);
            let endpoint = std::str::from_utf8(r.take(id_len)?)
                .map_err(|_| JournalError::BadId(start))?
                .to_owned();
            let n = usize::from(r.u16()?);
            let raw = r.take(n * 8)?;
            let hashes = raw
                .chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    u64::from_le_bytes(b)
                })
                .collect();
            let rec = AffinityRecord {
                seq,
                writer,
                endpoint,
                hashes,
            };
            bytes += rec.encoded_len();
            records.push_back(rec);
        }
        Ok(Self {
            next_seq,
            records,
            bytes,
        })
    }

    /// The wire form (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.bytes);
        out.extend_from_slice(&JOURNAL_MAGIC);
        out.extend_from_slice(&self.next_seq.to_le_bytes());
        for r in &self.records {
            out.extend_from_slice(&r.seq.to_le_bytes());
            out.extend_from_slice(&r.writer.to_le_bytes());
            // Lengths were bounded to u16 by `append`.
            out.extend_from_slice(&(r.endpoint.len() as u16).to_le_bytes());
            out.extend_from_slice(r.endpoint.as_bytes());
            out.extend_from_slice(&(r.hashes.len() as u16).to_le_bytes());
            for h in &r.hashes {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        out
    }

    /// Encoded size, bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER + self.bytes
    }

    /// The sequence number the next appended record will get; every record already in the
    /// journal has a smaller one.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.max(1)
    }

    /// Records with a sequence number above `seq`, oldest first.
    pub fn since(&self, seq: u64) -> impl Iterator<Item = &AffinityRecord> {
        self.records.iter().filter(move |r| r.seq > seq)
    }

    /// Number of records held.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when no record is held.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Append `chains` (endpoint id, block hashes) written by `writer`, then drop the oldest
    /// records until the encoded journal fits in `max_bytes`. Chains without hashes are
    /// skipped; an endpoint id over `u16::MAX` bytes is skipped; a chain that alone would not
    /// fit is cut to its leading hashes (a chain's prefix is itself a valid chain).
    pub fn append<I>(&mut self, writer: u32, chains: I, max_bytes: usize)
    where
        I: IntoIterator<Item = (String, Vec<u64>)>,
    {
        let room = max_bytes.saturating_sub(HEADER);
        for (endpoint, mut hashes) in chains {
            if hashes.is_empty() || endpoint.len() > usize::from(u16::MAX) {
                continue;
            }
            let fixed = RECORD_FIXED + endpoint.len();
            let max_hashes = (room.saturating_sub(fixed) / 8).min(usize::from(u16::MAX));
            if max_hashes == 0 {
                continue;
            }
            hashes.truncate(max_hashes);
            let rec = AffinityRecord {
                seq: self.next_seq(),
                writer,
                endpoint,
                hashes,
            };
            self.next_seq = rec.seq.saturating_add(1);
            self.bytes += rec.encoded_len();
            self.records.push_back(rec);
        }
        while self.bytes > room {
            match self.records.pop_front() {
                Some(r) => self.bytes -= r.encoded_len(),
                None => break,
            }
        }
    }
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

    #[test]
    fn round_trip_and_since() {
        let mut j = Journal::new();
        j.append(1, [chain("p/a", &[1, 2, 3]), chain("p/b", &[9])], 1 << 20);
        j.append(2, [chain("p/a", &[1, 2])], 1 << 20);
        let bytes = j.encode();
        assert_eq!(bytes.len(), j.encoded_len());
        // header 12 + (16+3+24) + (16+3+8) + (16+3+16)
        assert_eq!(bytes.len(), 12 + 43 + 27 + 35);
        let d = Journal::decode(&bytes).unwrap();
        assert_eq!(d, j);
        assert_eq!(d.next_seq(), 4);
        let seqs: Vec<(u64, u32, &str)> = d
            .since(1)
            .map(|r| (r.seq, r.writer, r.endpoint.as_str()))
            .collect();
        assert_eq!(seqs, vec![(2, 1, "p/b"), (3, 2, "p/a")]);
    }

    #[test]
    fn bounded_by_dropping_the_oldest() {
        let mut j = Journal::new();
        // Each record: 16 + 3 + 8 = 27 bytes; room for 3 within 12 + 81 = 93.
        for i in 0..5u64 {
            j.append(1, [chain("p/a", &[i])], 93);
        }
        assert_eq!(j.len(), 3);
        assert_eq!(j.encoded_len(), 93);
        let kept: Vec<u64> = j.since(0).map(|r| r.hashes[0]).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        assert_eq!(j.next_seq(), 6);
    }

    #[test]
    fn oversized_chain_is_cut_to_its_leading_hashes() {
        let mut j = Journal::new();
        // room = 64 - 12 = 52; fixed = 16 + 3 = 19; 33 / 8 = 4 hashes fit.
        j.append(7, [chain("p/a", &[1, 2, 3, 4, 5, 6])], 64);
        let r = j.since(0).next().unwrap();
        assert_eq!(r.hashes, vec![1, 2, 3, 4]);
        assert!(j.encoded_len() <= 64);
        // Empty chains and a bound too small for any hash add nothing.
        j.append(7, [chain("p/a", &[]), chain("p/a", &[1])], 20);
        assert!(j.is_empty());
    }

    #[test]
    fn corrupt_bytes_are_errors() {
        assert_eq!(Journal::decode(b"nope"), Err(JournalError::BadMagic));
        let mut j = Journal::new();
        j.append(1, [chain("p/a", &[1, 2])], 1 << 20);
        let bytes = j.encode();
        assert_eq!(
            Journal::decode(&bytes[..bytes.len() - 1]),
            Err(JournalError::Truncated(12 + 19))
        );
        let mut bad_seq = bytes.clone();
        bad_seq[4..12].copy_from_slice(&1u64.to_le_bytes()); // next_seq not above the record
        assert_eq!(
            Journal::decode(&bad_seq),
            Err(JournalError::BadSequence(12))
        );
        let mut bad_id = bytes;
        bad_id[12 + 14] = 0xff;
        assert_eq!(Journal::decode(&bad_id), Err(JournalError::BadId(12)));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Journal::decode(&bytes);
            let mut with_magic = JOURNAL_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = Journal::decode(&with_magic);
        }

        #[test]
        fn appends_round_trip_within_the_bound(
            batches in proptest::collection::vec(
                proptest::collection::vec(("[a-z/]{0,12}", proptest::collection::vec(any::<u64>(), 0..40)), 0..6),
                0..8),
            max in 12usize..2048,
        ) {
            let mut j = Journal::new();
            let mut appended = 0u64;
            for (w, b) in batches.into_iter().enumerate() {
                appended += b.iter().filter(|(_, h)| !h.is_empty()).count() as u64;
                j.append(w as u32, b, max);
                prop_assert!(j.encoded_len() <= max.max(12));
                prop_assert_eq!(j.encode().len(), j.encoded_len());
                prop_assert_eq!(Journal::decode(&j.encode()).unwrap(), j.clone());
            }
            prop_assert!(j.next_seq() <= appended + 1);
            let seqs: Vec<u64> = j.since(0).map(|r| r.seq).collect();
            prop_assert!(seqs.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
