//! Prefix block hashing, compatible with the Gateway API Inference Extension approximate
//! prefix-cache scorer, and an approximate per-endpoint index of routed prefixes.
//!
//! ## Hash chain
//! Same construction as GIE's `hashPrompt`
//! (kubernetes-sigs/gateway-api-inference-extension,
//! `pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`):
//! 1. the text is truncated to `max_blocks × block_chars` bytes (defaults 256 × 64, GIE's
//!    `DefaultMaxPrefixBlocks` / `DefaultHashBlockSize`: vLLM's 16-token blocks at ~4
//!    characters per token);
//! 2. `h₀ = xxh64(model)` (seed 0), so different models never share prefixes;
//! 3. block `i` (bytes `[i·B, (i+1)·B)`) hashes as `hᵢ = xxh64(blockᵢ ‖ le_u64(hᵢ₋₁))`;
//! 4. a trailing partial block is not hashed (text shorter than one block gives no hashes).
//!
//! kvroute adds vLLM's `cache_salt`: when present, the seed becomes
//! `h₀ = xxh64(salt ‖ le_u64(xxh64(model)))`, so tenants with different salts never match
//! each other. vLLM likewise mixes the salt into the hash of the first block only (as an
//! extra key, `vllm/v1/core/kv_cache_utils.py`), so the chain isolates exactly the requests
//! vLLM's cache isolates. Without a salt the chain is bit-identical to GIE's.
//!
//! [`block_hashes`] returns `h₁..hₖ` (GIE's list minus its leading model hash), so its length
//! is the number of full blocks.
//!
//! ## PrefixIndex
//! [`PrefixIndex`] remembers, per endpoint, the block hashes of requests recently routed
//! there, with LRU eviction at a bounded capacity (GIE's `DefaultLRUCapacityPerServer`,
//! 31,250 blocks: ~500k tokens of Llama-3-8B KV on an 80 GB GPU at 16 tokens/block). Because
//! hashes are chained, an endpoint's match length is the number of leading hashes it holds.
//! It is an approximation of the server's real prefix cache: it does not see evictions on the
//! server, and [`PrefixIndex::forget`] must be called when an endpoint restarts.
//!
//! Each endpoint's LRU is a linked hash map (`hashlink::LinkedHashMap`: a hash table whose
//! entries are also a list in order of use): recording a block is one lookup that moves it
//! to the back of the list or adds it there, and eviction takes the front. Freed entries
//! are reused, so a full index allocates nothing. It replaced a hash map (block hash →
//! tick) with a queue of `(tick, hash)` in order of use, which a block recorded again left
//! a stale pair in, compacted by a pass over the whole queue: with a 16 KiB system prompt
//! recorded on every request that cost ~100 Wasm operations per block and request,
//! amortised, and the push another ~30 (`docs/overhead.md`); before that, two ordered maps
//! (three B-tree operations per block). The table is keyed through `foldhash` seeded per
//! index ([`PrefixIndex::with_seed`]): block hashes come from client text, and a public,
//! unseeded bucket function would let a client craft hashes that all land in one probe
//! sequence.

use std::collections::BTreeMap;

use hashlink::LinkedHashMap;

use xxhash_rust::xxh64::{xxh64, Xxh64};

/// Prefix hashing parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixConfig {
    /// Block size in characters (bytes of UTF-8 text), default 64.
    pub block_chars: usize,
    /// Maximum number of blocks hashed, default 256.
    pub max_blocks: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        Self {
            block_chars: 64,
            max_blocks: 256,
        }
    }
}

impl PrefixConfig {
    /// Bytes of text that can contribute to a hash: `max_blocks × block_chars` (16 KiB by
    /// default). The router renders no more than this of a prompt
    /// ([`crate::analysis::analyze_bounded`]).
    pub fn max_bytes(&self) -> usize {
        self.block_chars.saturating_mul(self.max_blocks)
    }
}

/// Seed of the chain: `xxh64(model)`, or `xxh64(salt ‖ le_u64(xxh64(model)))` with a salt.
pub fn seed_hash(model: &str, cache_salt: Option<&str>) -> u64 {
    let h = xxh64(model.as_bytes(), 0);
    match cache_salt {
        None => h,
        Some(salt) => {
            let mut s = Xxh64::new(0);
            s.update(salt.as_bytes());
            s.update(&h.to_le_bytes());
            s.digest()
        }
    }
}

/// Chain of block hashes of `text`: block *i*'s hash covers blocks 0..=i, seeded with the
/// model name and `cache_salt`. A trailing partial block is not hashed. Returns at most
/// `config.max_blocks` hashes; none when `block_chars` is 0.
pub fn block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    config: &PrefixConfig,
) -> Vec<u64> {
    if config.block_chars == 0 {
        return Vec::new();
    }
    let bytes = text.as_bytes();
    let limit = config.max_bytes();
    let bytes = bytes.get(..limit).unwrap_or(bytes);
    let mut out = Vec::with_capacity(bytes.len() / config.block_chars);
    let mut prev = seed_hash(model, cache_salt);
    if config.block_chars.is_multiple_of(32) {
        // Whole 32-byte stripes (the default 64-byte blocks): no copy, see `chain_step`.
        for block in bytes.chunks_exact(config.block_chars) {
            prev = chain_step(block, prev);
            out.push(prev);
        }
        return out;
    }
    // Other sizes: one-shot hashing of `block ‖ le_u64(prev)` copied into one buffer, as
    // GIE's Go code does (the streaming hasher's buffering and finalisation cost more than
    // the copy: callgrind, ~240 → ~150 instructions per 64-byte block).
    let mut buf = Vec::with_capacity(config.block_chars.saturating_add(8));
    for block in bytes.chunks_exact(config.block_chars) {
        buf.clear();
        buf.extend_from_slice(block);
        buf.extend_from_slice(&prev.to_le_bytes());
        prev = xxh64(&buf, 0);
        out.push(prev);
    }
    out
}

// XXH64's primes (the xxHash specification, `doc/xxhash_spec.md`, "XXH64 algorithm").
const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;

#[inline(always)]
fn xxh64_round(acc: u64, lane: u64) -> u64 {
    acc.wrapping_add(lane.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

/// One link of the chain for a block of whole 32-byte stripes: `xxh64(block ‖
/// le_u64(prev), seed 0)`, computed on the block in place with `prev` as the input's last
/// 8-byte lane. Bit-identical to the `xxhash-rust` crate on the concatenation (the test
/// `chain_step_is_xxh64_of_block_and_prev` checks it against the crate); written out
/// because the general path copies each block next to `prev` and calls the crate's
/// length-generic loop: on wasm32 that was ~300 Wasm operations per 64-byte block, and a
/// 16 KiB prompt hashes 256 blocks (fuel-counted; docs/overhead.md).
fn chain_step(block: &[u8], prev: u64) -> u64 {
    let mut v = [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)];
    let mut rest = block;
    while let Some((stripe, tail)) = rest.split_first_chunk::<32>() {
        for (acc, lane) in v.iter_mut().zip(stripe.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(lane);
            *acc = xxh64_round(*acc, u64::from_le_bytes(w));
        }
        rest = tail;
    }
    let [v1, v2, v3, v4] = v;
    let mut h = v1
        .rotate_left(1)
        .wrapping_add(v2.rotate_left(7))
        .wrapping_add(v3.rotate_left(12))
        .wrapping_add(v4.rotate_left(18));
    for acc in v {
        h = (h ^ xxh64_round(0, acc)).wrapping_mul(P1).wrapping_add(P4);
    }
    h = h.wrapping_add(block.len() as u64 + 8);
    h ^= xxh64_round(0, prev);
    h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// GIE's `DefaultLRUCapacityPerServer` (see the module doc), in blocks.
pub const DEFAULT_INDEX_CAPACITY: usize = 31_250;

/// Default bound on the blocks the index holds for all endpoints together: 2²⁰ (about
/// 44 MB of a worker's Wasm memory at ~42 bytes a block, docs/filter.md "Prefix affinity
/// state"). GIE bounds each server's LRU only; a per-server bound alone grows with the
/// fleet (2,000 endpoints at [`DEFAULT_INDEX_CAPACITY`] is ~2.6 GB, past the ~1 GiB a V8
/// Wasm VM may use, where it traps). At the default per-endpoint capacity it binds from 34
/// endpoints on.
pub const DEFAULT_INDEX_TOTAL: usize = 1 << 20;

/// Largest product of the index's endpoints and a snapshot's for which
/// [`PrefixIndex::match_snapshot_into`] compares ids pairwise rather than looking each
/// snapshot endpoint up.
pub const PAIRWISE_MAX: usize = 256;

/// `a == b` for endpoint ids: the last bytes first (ids of one pool, `pool/e3` and
/// `pool/e5`, differ at their end), then eight bytes per step
/// ([`crate::picker::same_name`]; a string `==` calls wasi-libc's byte-at-a-time `memcmp`
/// on wasm32).
#[inline]
fn same_id(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.as_bytes().last() == b.as_bytes().last()
        && crate::picker::same_name(a, b)
}

/// Hasher of the per-endpoint maps: `foldhash` with a per-index seed (see the module doc).
type Seeded = foldhash::fast::FixedState;

/// One endpoint's blocks, least recently recorded first.
#[derive(Debug, Clone)]
struct Lru {
    blocks: LinkedHashMap<u64, (), Seeded>,
    /// How many blocks at the back of the list are the chain recorded last, in order (its
    /// length, less what the capacity cut at the front).
    tail: usize,
}

impl Lru {
    fn new(seed: u64) -> Self {
        Self {
            blocks: LinkedHashMap::with_hasher(Seeded::with_seed(seed)),
            tail: 0,
        }
    }

    /// Whether the list ends with `chain`, in order: its last block is the list's back and
    /// it is no longer than the run of the chain recorded last still there ([`Self::tail`]).
    /// For prefix chains that is exact, with no block looked up and no link walked: a hash
    /// determines the block and the hash before it (barring a 64-bit collision), so two
    /// chains that end in the same hash agree from their ends back to the shorter one's
    /// start, and the shorter is a suffix of the longer. (Suffixes happen: a chain seeded with
    /// a 64-byte `cache_salt` is the unsalted chain of that salt and the text, less its first
    /// hash.) Callers pass chains ([`block_hashes`]); a list of unrelated hashes could be
    /// called held when only its last one is (a wrong match length, nothing worse). It
    /// replaced a walk back over `chain.len()` links per endpoint: in the overhead
    /// benchmark, where every endpoint last took the same 256-block prompt, 4,096 list nodes
    /// read per decision, scattered in memory (docs/overhead.md).
    ///
    /// [`Self::tail`]: Lru::tail
    fn ends_with(&self, chain: &[u64]) -> bool {
        chain.len() <= self.tail && self.blocks.back().map(|(k, _)| k) == chain.last()
    }

    /// Leading blocks of `hashes` held, and whether `hashes` are the blocks recorded last
    /// (then all are held). The same chain recorded last here (the same prompt again) is
    /// found by one compare ([`Self::ends_with`]), with no block looked up.
    fn leading(&self, hashes: &[u64]) -> (u32, bool) {
        let last = self.ends_with(hashes);
        let n = if last {
            hashes.len()
        } else {
            hashes
                .iter()
                .take_while(|h| self.blocks.contains_key(h))
                .count()
        };
        (u32::try_from(n).unwrap_or(u32::MAX), last)
    }

    /// Record `hashes` in order (the last is the most recent), then evict the least
    /// recently recorded blocks beyond `capacity`. `held` is how many leading blocks of
    /// `hashes` are believed held (0: unknown, try all of them).
    fn record(&mut self, hashes: &[u64], held: usize, capacity: usize) {
        if hashes.is_empty() {
            return;
        }
        // When the list already ends with `hashes[..held]` in order (the same chain, or its
        // prefix, was the last recorded here), moving those blocks to the back one by one
        // leaves the list as it is: skip them. Exact whatever `held` is; the check fails
        // at its first compare unless the chain was recorded last.
        let held = match held {
            0 => hashes.len(),
            n => n.min(hashes.len()),
        };
        let skip = match hashes.get(..held) {
            Some(p) if held > 0 && self.ends_with(p) => held,
            _ => 0,
        };
        for &h in hashes.get(skip..).unwrap_or_default() {
            // Moves a held block to the back, or adds it there.
            self.blocks.insert(h, ());
        }
        let grown = self.blocks.len() > capacity;
        while self.blocks.len() > capacity {
            self.blocks.pop_front();
        }
        // The list now ends with all of `hashes`, in order, less what the capacity cut.
        self.tail = hashes.len().min(self.blocks.len());
        if grown && hashes.len() > capacity {
            // A chain longer than the capacity grew the table to its own length, and a hash
            // table does not shrink by itself: at `max_blocks` 16,384 each endpoint kept
            // ~700 KB for good, and a 2,000-endpoint fleet's VM passed 1 GiB and trapped.
            self.blocks.shrink_to_fit();
        }
    }

    /// Drop the least recently recorded blocks beyond `capacity`, and the memory they held.
    fn shrink_to(&mut self, capacity: usize) {
        if self.blocks.len() > capacity {
            while self.blocks.len() > capacity {
                self.blocks.pop_front();
            }
            self.tail = self.tail.min(self.blocks.len());
            self.blocks.shrink_to_fit();
        }
    }
}

/// Approximate per-endpoint LRU of recently routed block hashes (see the module doc).
///
/// Every `hashes` argument is a prefix chain, `h₁..hₖ` as [`block_hashes`] returns it:
/// the index relies on each hash covering the blocks before it (a chain's leading blocks
/// held, and the chain recorded last found by its last hash alone).
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    /// Blocks each endpoint keeps now: `per_endpoint`, or less under `total`.
    capacity: usize,
    /// Configured blocks per endpoint.
    per_endpoint: usize,
    /// Configured blocks for all endpoints together ([`Self::with_total`]).
    total: usize,
    seed: u64,
    endpoints: BTreeMap<String, Lru>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(DEFAULT_INDEX_CAPACITY)
    }
}

impl PrefixIndex {
    /// An empty index keeping at most `capacity_per_endpoint` blocks per endpoint
    /// (at least 1), its maps keyed with a fixed seed (for offline use: benchmarks, tests).
    pub fn new(capacity_per_endpoint: usize) -> Self {
        Self::with_seed(capacity_per_endpoint, 0x6b76_726f_7574_6531)
    }

    /// [`Self::new`] with the per-endpoint maps keyed by `seed`. The router passes its own
    /// seed, which the filter draws per worker from the clock's nanoseconds at configure
    /// time, so clients cannot aim block hashes at one bucket of the map.
    pub fn with_seed(capacity_per_endpoint: usize, seed: u64) -> Self {
        Self {
            capacity: capacity_per_endpoint.max(1),
            per_endpoint: capacity_per_endpoint.max(1),
            total: usize::MAX,
            seed,
            endpoints: BTreeMap::new(),
        }
    }

    /// Bound the blocks held for all endpoints together to `total` (at least 1): with
    /// [`Self::set_endpoint_count`], each endpoint then keeps at most
    /// `min(capacity_per_endpoint, total / endpoints)`.
    pub fn with_total(mut self, total: usize) -> Self {
        self.total = total.max(1);
        self.set_endpoint_count(self.endpoints.len().max(1));
        self
    }

    /// The fleet now has `n` endpoints (once per snapshot version): each endpoint's
    /// capacity becomes `min(capacity_per_endpoint, total / n)` (at least 1 block), and
    /// lists longer than that drop their least recently recorded blocks now.
    pub fn set_endpoint_count(&mut self, n: usize) {
        let capacity = self.per_endpoint.min(self.total / n.max(1)).max(1);
        if capacity < self.capacity {
            for lru in self.endpoints.values_mut() {
                lru.shrink_to(capacity);
            }
        }
        self.capacity = capacity;
    }

    /// Record that a request with chain `hashes` was routed to `endpoint_id`; evicts the
    /// least recently used blocks beyond capacity.
    pub fn record(&mut self, endpoint_id: &str, hashes: &[u64]) {
        self.record_matched(endpoint_id, hashes, 0);
    }

    /// [`Self::record`] after [`Self::match_one`] (or [`Self::match_snapshot`]) found
    /// `matched` leading blocks of `hashes` held for `endpoint_id`: when those are the
    /// blocks recorded last there, in order (a conversation's next turn, the same prompt
    /// again), they are not moved one by one. The index ends the same as with
    /// [`Self::record`], whatever `matched` is (0: unknown).
    pub fn record_matched(&mut self, endpoint_id: &str, hashes: &[u64], matched: u32) {
        if hashes.is_empty() {
            return;
        }
        let seed = self.seed;
        let lru = match self.endpoints.get_mut(endpoint_id) {
            Some(l) => l,
            None => self
                .endpoints
                .entry(endpoint_id.to_string())
                .or_insert_with(|| Lru::new(seed)),
        };
        let held = usize::try_from(matched).unwrap_or(usize::MAX);
        lru.record(hashes, held, self.capacity);
    }

    /// Leading blocks of `hashes` recorded for `endpoint_id`. Read-only: recency is refreshed
    /// by [`Self::record`] (called for the endpoint actually chosen), not by lookups.
    pub fn match_one(&self, hashes: &[u64], endpoint_id: &str) -> u32 {
        self.endpoints
            .get(endpoint_id)
            .map_or(0, |lru| lru.leading(hashes).0)
    }

    /// Leading blocks of `hashes` recorded for each of `endpoint_ids`, aligned with them
    /// (suitable for [`crate::picker::PickInput::prefix_match_blocks`]).
    pub fn match_blocks<'a, I>(&self, hashes: &[u64], endpoint_ids: I) -> Vec<u32>
    where
        I: IntoIterator<Item = &'a str>,
    {
        endpoint_ids
            .into_iter()
            .map(|id| self.match_one(hashes, id))
            .collect()
    }

    /// [`Self::match_blocks`] over every endpoint of a snapshot, in snapshot order.
    pub fn match_snapshot(&self, hashes: &[u64], snapshot: &crate::snapshot::Snapshot) -> Vec<u32> {
        let mut out = Vec::new();
        self.match_snapshot_into(hashes, snapshot, &mut Vec::new(), &mut out);
        out
    }

    /// [`Self::match_snapshot`] into `out` (resized to the snapshot; a router keeps one
    /// vector for every decision), also setting `last[i]` (resized too) when `hashes` are
    /// the blocks last recorded for endpoint `i`, in order: recording them there again
    /// ([`Self::record`]) would leave the index as it is.
    ///
    /// While the index holds few endpoints (its endpoints × the snapshot's at most
    /// [`PAIRWISE_MAX`]), each held endpoint's id is compared with the snapshot's ids,
    /// 8 bytes per step, instead of a map lookup per snapshot endpoint: a lookup compares
    /// ids through wasi-libc's byte-at-a-time `memcmp`, ~290 Wasm operations for an
    /// endpoint the index does not hold (docs/overhead.md).
    pub fn match_snapshot_into(
        &self,
        hashes: &[u64],
        snapshot: &crate::snapshot::Snapshot,
        last: &mut Vec<bool>,
        out: &mut Vec<u32>,
    ) {
        let eps = &snapshot.endpoints;
        out.clear();
        out.resize(eps.len(), 0);
        last.clear();
        last.resize(eps.len(), false);
        if hashes.is_empty() || self.endpoints.is_empty() {
            return;
        }
        if self.endpoints.len().saturating_mul(eps.len()) <= PAIRWISE_MAX {
            for (id, lru) in &self.endpoints {
                let mut found = None;
                for ((m, l), e) in out.iter_mut().zip(last.iter_mut()).zip(eps) {
                    if same_id(&e.id, id) {
                        (*m, *l) = *found.get_or_insert_with(|| lru.leading(hashes));
                    }
                }
            }
        } else {
            for ((m, l), e) in out.iter_mut().zip(last.iter_mut()).zip(eps) {
                if let Some(lru) = self.endpoints.get(e.id.as_str()) {
                    (*m, *l) = lru.leading(hashes);
                }
            }
        }
    }

    /// Drop everything recorded for `endpoint_id` (it restarted: its cache is cold).
    pub fn forget(&mut self, endpoint_id: &str) {
        self.endpoints.remove(endpoint_id);
    }

    /// Keep only endpoints for which `keep(id)` is true (e.g. those still in the snapshot).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.endpoints.retain(|id, _| keep(id));
    }

    /// Blocks currently held for `endpoint_id`.
    pub fn len(&self, endpoint_id: &str) -> usize {
        self.endpoints
            .get(endpoint_id)
            .map(|l| l.blocks.len())
            .unwrap_or(0)
    }

    /// True when nothing is recorded for any endpoint.
    pub fn is_empty(&self) -> bool {
        self.endpoints.values().all(|l| l.blocks.is_empty())
    }

    /// Per-endpoint capacity in blocks, as bounded now ([`Self::set_endpoint_count`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy;

    /// [`PrefixIndex::match_snapshot_into`]'s matches, returned.
    fn matched_last(
        idx: &PrefixIndex,
        hashes: &[u64],
        snapshot: &crate::snapshot::Snapshot,
        last: &mut Vec<bool>,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        idx.match_snapshot_into(hashes, snapshot, last, &mut out);
        out
    }

    proptest::proptest! {
        /// The in-place chain step is the crate's `xxh64` of `block ‖ le_u64(prev)`.
        #[test]
        fn chain_step_is_xxh64_of_block_and_prev(
            stripes in 1usize..5,
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 128),
            prev in proptest::num::u64::ANY,
        ) {
            let block = &bytes[..stripes * 32];
            let mut joined = block.to_vec();
            joined.extend_from_slice(&prev.to_le_bytes());
            proptest::prop_assert_eq!(chain_step(block, prev), xxh64(&joined, 0));
        }
    }

    /// The LRU as a plain list: each block moved (or added) to the back, then the front
    /// evicted beyond `capacity`.
    fn naive_record(list: &mut Vec<u64>, hashes: &[u64], capacity: usize) {
        for &h in hashes {
            list.retain(|&x| x != h);
            list.push(h);
        }
        while list.len() > capacity {
            list.remove(0);
        }
    }

    /// A snapshot of `n` fixture endpoints (`pool/e0`, `pool/e1`, ...).
    fn fleet(n: usize) -> crate::snapshot::Snapshot {
        crate::snapshot::Snapshot::new(
            1,
            0,
            (0..n)
                .map(|i| crate::snapshot::EndpointStats::fixture(i, 0))
                .collect(),
        )
    }

    fn held(idx: &PrefixIndex, id: &str) -> Vec<u64> {
        idx.endpoints
            .get(id)
            .map(|l| l.blocks.keys().copied().collect())
            .unwrap_or_default()
    }

    /// `symbols` as a prefix chain, as [`block_hashes`] makes one: each hash covers its
    /// symbol and every one before it, so chains share exactly their common prefix.
    fn chained(symbols: &[u64]) -> Vec<u64> {
        let mut prev = 0u64;
        symbols
            .iter()
            .map(|s| {
                let mut joined = s.to_le_bytes().to_vec();
                joined.extend_from_slice(&prev.to_le_bytes());
                prev = xxh64(&joined, 0);
                prev
            })
            .collect()
    }

    /// A chain of a few symbols from a small alphabet (so that chains share prefixes and are
    /// recorded again), sometimes less its first hash: a chain seeded with a `cache_salt` of
    /// one block is the unsalted chain of the salt and the text less its first hash, so
    /// one chain can be a suffix of another.
    fn a_chain() -> impl proptest::strategy::Strategy<Value = Vec<u64>> {
        (proptest::collection::vec(0u64..3, 0..10), 0usize..3).prop_map(|(s, salted)| {
            let c = chained(&s);
            c.get(salted.min(1)..).unwrap_or_default().to_vec()
        })
    }

    /// Chains recorded to a few endpoints with any `matched` hint.
    fn chains() -> impl proptest::strategy::Strategy<Value = Vec<(u8, Vec<u64>, u32)>> {
        proptest::collection::vec((0u8..3, a_chain(), 0u32..12), 1..40)
    }

    proptest::proptest! {
        /// `record_matched` leaves the index as the plain list does, whatever the hint:
        /// the skipped blocks are only those the list already ends with.
        #[test]
        fn record_matched_is_record_whatever_the_hint(
            ops in chains(),
            capacity in 1usize..16,
        ) {
            let mut idx = PrefixIndex::new(capacity);
            let mut want: [Vec<u64>; 3] = Default::default();
            for (e, chain, hint) in &ops {
                let id = format!("e{e}");
                // Half the time the hint is the true match, as the router passes it.
                let hint = if hint % 2 == 0 { idx.match_one(chain, &id) } else { *hint };
                idx.record_matched(&id, chain, hint);
                naive_record(&mut want[usize::from(*e)], chain, capacity);
                for (i, w) in want.iter().enumerate() {
                    proptest::prop_assert_eq!(&held(&idx, &format!("e{i}")), w);
                }
            }
        }

        /// `match_snapshot_into` gives `match_one` for every snapshot endpoint (ids
        /// compared pairwise, or looked up for a large index), and flags exactly the
        /// endpoints where recording the chain again would change nothing.
        #[test]
        fn match_snapshot_last_is_match_one_and_flags_no_op_records(
            ops in chains(),
            probe in a_chain(),
            extra in 0usize..300,
        ) {
            let mut idx = PrefixIndex::new(8);
            for (e, chain, _) in &ops {
                idx.record(&format!("pool/e{e}"), chain);
            }
            // Many held endpoints take the lookup path (over `PAIRWISE_MAX` pairs).
            for i in 0..extra {
                idx.record(&format!("other/{i}"), &[100]);
            }
            // Snapshot ids: the held ones, one held twice, and one never recorded.
            let snapshot = crate::snapshot::Snapshot::new(
                1,
                0,
                [0, 1, 2, 1, 7]
                    .iter()
                    .map(|&i| crate::snapshot::EndpointStats::fixture(i, 0))
                    .collect(),
            );
            let mut last = vec![true; 2];
            let got = matched_last(&idx, &probe, &snapshot, &mut last);
            proptest::prop_assert_eq!(last.len(), snapshot.endpoints.len());
            for (i, e) in snapshot.endpoints.iter().enumerate() {
                proptest::prop_assert_eq!(got[i], idx.match_one(&probe, &e.id));
                let mut again = idx.clone();
                again.record(&e.id, &probe);
                let unchanged = held(&again, &e.id) == held(&idx, &e.id);
                // Flagged only where nothing would change (an empty chain is never
                // flagged: it records nothing anyway).
                proptest::prop_assert!(!last[i] || unchanged);
                if !probe.is_empty() && last[i] {
                    proptest::prop_assert_eq!(got[i] as usize, probe.len());
                }
            }
            proptest::prop_assert_eq!(idx.match_snapshot(&probe, &snapshot), got);
        }
    }

    /// Ids of every length 0..=17 (the 8-byte steps and the tail of `same_id`), and ids
    /// that differ from them in one byte at each place (last, first, inside a step), by
    /// length, or only in a multi-byte character: `match_snapshot_into` matches an
    /// endpoint exactly when its id is equal, ids compared pairwise (few held endpoints)
    /// or looked up (over `PAIRWISE_MAX` pairs).
    #[test]
    fn ids_match_only_when_equal_at_every_length() {
        let base = "pool/e0123456789abc".as_bytes();
        for n in 0..=17 {
            let id = String::from_utf8(base[..n].to_vec()).unwrap();
            let mut near: Vec<String> = (0..n)
                .map(|j| {
                    let mut b = base[..n].to_vec();
                    b[j] ^= 0x01;
                    String::from_utf8(b).unwrap()
                })
                .collect();
            near.push(String::from_utf8(base[..n + 1].to_vec()).unwrap());
            if n > 0 {
                near.push(String::from_utf8(base[..n - 1].to_vec()).unwrap());
            }
            near.push(format!("{id}é"));
            near.push(format!("{id}è"));
            for other in &near {
                assert!(!same_id(&id, other), "{id:?} {other:?}");
            }
            assert!(same_id(&id, &id.clone()), "{id:?}");
            for filler in [0, 100] {
                let mut idx = PrefixIndex::new(8);
                idx.record(&id, &[1, 2, 3]);
                idx.record(&format!("{id}é"), &[1, 2]);
                for i in 0..filler {
                    idx.record(&format!("other/{i}"), &[1]);
                }
                let mut eps: Vec<crate::snapshot::EndpointStats> = near
                    .iter()
                    .chain([&id])
                    .enumerate()
                    .map(|(i, e)| crate::snapshot::EndpointStats {
                        id: e.clone(),
                        ..crate::snapshot::EndpointStats::fixture(i, 0)
                    })
                    .collect();
                eps.rotate_left(n / 2);
                let snapshot = crate::snapshot::Snapshot::new(1, 0, eps);
                let mut last = Vec::new();
                let got = matched_last(&idx, &[1, 2, 3], &snapshot, &mut last);
                let want: Vec<(u32, bool)> = snapshot
                    .endpoints
                    .iter()
                    .map(|e| match e.id.as_str() {
                        x if x == id => (3, true),
                        x if x == format!("{id}é") => (2, false),
                        _ => (0, false),
                    })
                    .collect();
                let got: Vec<(u32, bool)> = got.into_iter().zip(last).collect();
                assert_eq!(got, want, "{id:?} with {filler} others");
            }
        }
    }

    /// A chain recorded last is flagged, and again after a longer chain of its own prefix
    /// is not (the list ends with the longer one).
    #[test]
    fn the_chain_recorded_last_is_flagged() {
        let mut idx = PrefixIndex::new(DEFAULT_INDEX_CAPACITY);
        let chain: Vec<u64> = (1..=64).collect();
        idx.record("pool/e1", &chain);
        let snapshot = fleet(3);
        let mut last = Vec::new();
        let got = matched_last(&idx, &chain, &snapshot, &mut last);
        assert_eq!(
            (got, last.clone()),
            (vec![0, 64, 0], vec![false, true, false])
        );
        let got = matched_last(&idx, &chain[..32], &snapshot, &mut last);
        assert_eq!((got, last.clone()), (vec![0, 32, 0], vec![false; 3]));
        // A next turn: the prefix held last is skipped, the new blocks recorded after it.
        let longer: Vec<u64> = (1..=80).collect();
        idx.record_matched("pool/e1", &longer, 64);
        assert_eq!(held(&idx, "pool/e1"), longer);
    }

    /// A chain seeded with a 64-byte `cache_salt` is the unsalted chain of the salt and the
    /// text less its first hash. Recorded last, it ends with the unsalted chain's last hash,
    /// yet the unsalted chain is not held: its first block never was (found by a review).
    #[test]
    fn a_salted_chain_is_a_suffix_and_does_not_stand_for_the_longer_chain() {
        let config = PrefixConfig::default();
        let salt = "s".repeat(config.block_chars);
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(6);
        let salted = block_hashes("m", Some(&salt), &text, &config);
        let unsalted = block_hashes("m", None, &format!("{salt}{text}"), &config);
        assert_eq!(salted.len(), 4);
        assert_eq!(&unsalted[1..], &salted[..], "the salted chain is a suffix");
        let mut idx = PrefixIndex::new(DEFAULT_INDEX_CAPACITY);
        idx.record("pool/e1", &[7, 8, 9]);
        idx.record("pool/e1", &salted);
        let snapshot = fleet(2);
        let mut last = Vec::new();
        let got = matched_last(&idx, &unsalted, &snapshot, &mut last);
        assert_eq!((got, last.clone()), (vec![0, 0], vec![false, false]));
        let got = matched_last(&idx, &salted, &snapshot, &mut last);
        assert_eq!((got, last.clone()), (vec![0, 4], vec![false, true]));
        // Its suffixes are held in order too: a shorter chain ending in the same hash.
        assert_eq!(idx.match_one(&salted[1..], "pool/e1"), 3);
        idx.record_matched("pool/e1", &unsalted, 0);
        let mut want = vec![7, 8, 9];
        want.extend_from_slice(&unsalted);
        assert_eq!(held(&idx, "pool/e1"), want);
    }

    /// The total bound splits among the fleet's endpoints: each keeps at most
    /// `min(per endpoint, total / endpoints)`, a larger fleet trims every list to its most
    /// recent blocks at once, and a smaller one lets them grow again.
    #[test]
    fn the_total_bound_is_shared_by_the_fleet() {
        let mut idx = PrefixIndex::new(100).with_total(300);
        idx.set_endpoint_count(2);
        assert_eq!(idx.capacity(), 100);
        let chain: Vec<u64> = (1..=100).collect();
        for id in ["a", "b"] {
            idx.record(id, &chain);
        }
        idx.set_endpoint_count(6);
        assert_eq!(idx.capacity(), 50);
        for id in ["a", "b"] {
            assert_eq!(held(&idx, id), (51..=100).collect::<Vec<_>>(), "{id}");
        }
        idx.record("c", &chain);
        assert_eq!(held(&idx, "c"), (51..=100).collect::<Vec<_>>());
        idx.set_endpoint_count(1_000);
        assert_eq!(idx.capacity(), 1, "at least one block");
        assert_eq!(held(&idx, "c"), [100]);
        idx.set_endpoint_count(2);
        assert_eq!(idx.capacity(), 100);
        idx.record("c", &chain);
        assert_eq!(idx.len("c"), 100);
    }

    /// Both paths of `block_hashes` (whole stripes in place, other sizes copied) give the
    /// crate's chain: 64-byte blocks against 48-byte ones hashed the general way.
    #[test]
    fn block_hashes_agree_with_the_crate_at_every_block_size() {
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(20);
        for block_chars in [32, 48, 64, 96] {
            let config = PrefixConfig {
                block_chars,
                max_blocks: 256,
            };
            let mut prev = seed_hash("m", None);
            let want: Vec<u64> = text
                .as_bytes()
                .chunks_exact(block_chars)
                .map(|b| {
                    let mut joined = b.to_vec();
                    joined.extend_from_slice(&prev.to_le_bytes());
                    prev = xxh64(&joined, 0);
                    prev
                })
                .collect();
            assert_eq!(want.len(), 900 / block_chars);
            assert_eq!(block_hashes("m", None, &text, &config), want);
        }
    }

    /// The same 256-block chain recorded again and again (a shared system prompt) holds
    /// its 256 blocks once, in chain order: recording a held block moves it, and adds
    /// nothing.
    #[test]
    fn repeated_records_hold_each_block_once() {
        let mut idx = PrefixIndex::new(DEFAULT_INDEX_CAPACITY);
        let chain: Vec<u64> = (1..=256).collect();
        for _ in 0..1000 {
            idx.record("a", &chain);
        }
        assert_eq!(idx.len("a"), 256);
        assert_eq!(idx.match_one(&chain, "a"), 256);
        let held: Vec<u64> = idx
            .endpoints
            .get("a")
            .map(|l| l.blocks.keys().copied().collect())
            .unwrap_or_default();
        assert_eq!(held, chain);
    }
}
