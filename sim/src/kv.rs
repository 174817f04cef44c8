//! Paged KV cache with automatic prefix caching, modelled on vLLM V1's `KVCacheManager`.
//!
//! The cache is a pool of `num_blocks` fixed-size blocks (`block_size` tokens each, vLLM's
//! default 16). A request holds a list of blocks covering its computed tokens.
//!
//! **Prefix caching.** A *full* block of prompt tokens is identified by a hash chained over
//! all blocks before it (block *i*'s hash covers tokens `0..(i+1)*block_size`), as in vLLM's
//! `hash_block_tokens` (vllm/v1/core/kv_cache_utils.py). When a block fills, its hash is
//! registered; a later request whose hash chain starts with the same hashes reuses those
//! blocks instead of recomputing them.
//!
//! **Free queue and eviction.** As in vLLM V1's `FreeKVCacheBlockQueue`, every block with a
//! reference count of zero sits in one free queue ordered by release time. A freed block
//! keeps its hash (it stays a cache hit until reused). Allocation takes the block at the head
//! of the queue (least recently released) and, if it still carries a hash, evicts that cache
//! entry. A request releases its blocks tail-first, so the end of a prompt is evicted before
//! its (more shareable) beginning. A cache hit on a block in the free queue takes it out of
//! the queue again ("touch").
//!
//! **Usage.** `usage() = 1 − free / total`, the same formula as vLLM V1's
//! `BlockPool.get_usage` (cached-but-unreferenced blocks count as free), which is what
//! `vllm:kv_cache_usage_perc` reports.

use std::collections::{BTreeMap, HashMap};

/// Index of a block in the pool (`0..num_blocks`).
pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    /// Number of running requests holding this block.
    ref_count: u32,
    /// Prefix-chain hash when the block is full and registered in the cache.
    hash: Option<u64>,
    /// Position key in the free queue while `ref_count == 0`.
    free_key: Option<u64>,
}

/// A pool of KV cache blocks with hash-chained prefix caching and LRU eviction of
/// unreferenced blocks. All operations are O(log n) in the number of blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    /// Free queue: monotonically increasing key → block, head = least recently released.
    free: BTreeMap<u64, BlockId>,
    next_free_key: u64,
    /// Registered full blocks: chain hash → block.
    cached: HashMap<u64, BlockId>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks, all free.
    pub fn new(num_blocks: u32) -> Self {
        let mut pool = Self {
            blocks: vec![BlockMeta::default(); num_blocks as usize],
            free: BTreeMap::new(),
            next_free_key: 0,
            cached: HashMap::new(),
            evictions: 0,
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    fn push_free(&mut self, id: BlockId) {
        let key = self.next_free_key;
        self.next_free_key += 1;
        if let Some(meta) = self.blocks.get_mut(id as usize) {
            meta.free_key = Some(key);
            self.free.insert(key, id);
        }
    }

    /// Total blocks in the pool.
    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks with a reference count of zero (including cached-but-unreferenced ones).
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Fraction (0..1) of blocks referenced by requests: `1 − free / total` (vLLM V1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - f64::from(self.num_free()) / self.blocks.len() as f64
    }

    /// Cache entries evicted so far (a cached block reallocated for new content).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Number of blocks currently registered in the prefix cache.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The blocks of the longest cached prefix of `hashes` (stops at the first miss).
    /// Does not change any state.
    pub fn lookup(&self, hashes: &[u64]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `blocks` currently sit in the free queue (touching them would take them
    /// out of it, reducing what is left to allocate).
    pub fn count_free_among(&self, blocks: &[BlockId]) -> u32 {
        blocks
            .iter()
            .filter(|b| {
                self.blocks
                    .get(**b as usize)
                    .is_some_and(|m| m.ref_count == 0)
            })
            .count() as u32
    }

    /// Take a reference on each of `blocks` (cache hits), removing them from the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &id in blocks {
            if let Some(meta) = self.blocks.get_mut(id as usize) {
                if meta.ref_count == 0 {
                    if let Some(key) = meta.free_key.take() {
                        self.free.remove(&key);
                    }
                }
                meta.ref_count += 1;
            }
        }
    }

    /// Allocate `n` blocks from the head of the free queue, evicting their cache entries.
    /// Returns `None` (and allocates nothing) when fewer than `n` blocks are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<BlockId>> {
        if n > self.num_free() {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            if let Some(meta) = self.blocks.get_mut(id as usize) {
                meta.free_key = None;
                meta.ref_count = 1;
                if let Some(h) = meta.hash.take() {
                    if self.cached.get(&h) == Some(&id) {
                        self.cached.remove(&h);
                    }
                    self.evictions += 1;
                }
            }
            out.push(id);
        }
        Some(out)
    }

    /// Register a full block under its chain hash, making it a future cache hit. If another
    /// block already holds that hash, the existing entry is kept (vLLM keeps the first one).
    pub fn register(&mut self, id: BlockId, hash: u64) {
        if self.cached.contains_key(&hash) {
            return;
        }
        if let Some(meta) = self.blocks.get_mut(id as usize) {
            if meta.hash.is_none() {
                meta.hash = Some(hash);
                self.cached.insert(hash, id);
            }
        }
    }

    /// Drop one reference on each of `blocks`, releasing them tail-first so later blocks of
    /// a sequence are evicted before earlier ones (vLLM V1 `free_blocks(reversed(...))`).
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let now_free = match self.blocks.get_mut(id as usize) {
                Some(meta) if meta.ref_count > 0 => {
                    meta.ref_count -= 1;
                    meta.ref_count == 0
                }
                _ => false,
            };
            if now_free {
                self.push_free(id);
            }
        }
    }
}

/// xxh64 seed of [`chain_hashes`] (arbitrary constant, ASCII "kvroute").
const CHAIN_SEED: u64 = 0x006b_7672_6f75_7465;

/// Chain hashes of a sequence of block contents: `h[i] = xxh64(h[i-1] ‖ key[i], seed)`.
///
/// `keys` identify each block's content (e.g. a hash of its text, or a Mooncake `hash_id`
/// plus the sub-block index); equal key prefixes give equal hash prefixes, and a difference
/// at block *i* changes every hash from *i* on, like vLLM's parent-hash chaining.
pub fn chain_hashes(seed: u64, keys: impl IntoIterator<Item = u64>) -> Vec<u64> {
    let mut parent = seed;
    keys.into_iter()
        .map(|k| {
            let mut h = xxhash_rust::xxh64::Xxh64::new(CHAIN_SEED);
            h.update(&parent.to_le_bytes());
            h.update(&k.to_le_bytes());
            parent = h.digest();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_usage() {
        let mut p = BlockPool::new(4);
        assert_eq!(p.usage(), 0.0);
        let a = p.allocate(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.usage(), 0.75);
        assert!(p.allocate(2).is_none());
        assert_eq!(p.num_free(), 1);
        p.release(&a);
        assert_eq!(p.num_free(), 4);
    }

    #[test]
    fn cached_blocks_survive_release_and_hit() {
        let mut p = BlockPool::new(4);
        let h = chain_hashes(1, [10, 11]);
        let a = p.allocate(2).unwrap();
        p.register(a[0], h[0]);
        p.register(a[1], h[1]);
        p.release(&a);
        assert_eq!(p.lookup(&h), a);
        assert_eq!(p.count_free_among(&a), 2);
        p.touch(&a);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.usage(), 0.5);
    }

    #[test]
    fn lru_eviction_takes_least_recently_released_and_tail_first() {
        let mut p = BlockPool::new(3);
        let h = chain_hashes(7, [1, 2, 3]);
        let a = p.allocate(3).unwrap();
        for (b, hh) in a.iter().zip(&h) {
            p.register(*b, *hh);
        }
        p.release(&a);
        // Released tail-first: block 2 is evicted first, so the prefix 0,1 still hits.
        let x = p.allocate(1).unwrap();
        assert_eq!(x, vec![2]);
        assert_eq!(p.evictions(), 1);
        assert_eq!(p.lookup(&h), vec![0, 1]);
    }

    #[test]
    fn chain_differs_after_first_difference() {
        let a = chain_hashes(0, [1, 2, 3]);
        let b = chain_hashes(0, [1, 9, 3]);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2]);
        assert_ne!(chain_hashes(1, [1])[0], a[0]);
    }
}
