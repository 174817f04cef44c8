//! `sglang-cache-aware`: SGLang model gateway (sgl-model-gateway, formerly sgl-router)
//! `cache_aware` policy, as shipped in 2026 (`sgl-model-gateway/src/policies/cache_aware.rs`).
//!
//! Defaults, confirmed from the source: the launcher's `CliArgs` (`sgl-model-gateway/src/main.rs`,
//! the values `smg launch` / `python -m sglang_router.launch_router` run with) set
//! `--cache-threshold 0.3`, `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`,
//! `--eviction-interval 120` s and `--max-tree-size 67108864` (2^26) characters; a gateway log
//! line of a default launch prints the same `CacheAware { cache_threshold: 0.3,
//! balance_abs_threshold: 64, balance_rel_threshold: 1.5, … max_tree_size: 67108864 }`. (The
//! library's `CacheAwareConfig::default()` in `policies/mod.rs` — 0.5 / 32 / 1.1 / 10 000 — is
//! only used by code that builds the policy without the CLI.)
//!
//! Algorithm (`CacheAwarePolicy::select_worker`):
//! - load = router-local in-flight requests per worker (`Worker::load`, incremented when a
//!   request is routed, decremented when it completes);
//! - the system is *imbalanced* when `max_load − min_load > balance_abs_threshold` **and**
//!   `max_load > min_load × balance_rel_threshold`; then the request goes to the least-loaded
//!   worker (`select_worker_min_load`), first on ties;
//! - otherwise the request text is prefix-matched against the per-model approximate radix
//!   tree (every worker's routed prefixes); `match_rate = matched characters / request
//!   characters`; if `match_rate > cache_threshold` the best-matching worker wins, **else the
//!   least-loaded worker** (the 2026 code; earlier sgl-router versions sent a miss to the
//!   worker with the smallest tree, which the file's header comment still describes);
//! - either way the request's text is inserted into the tree for the chosen worker.
//!
//! The tree here is a [`PrefixIndex`] over 512-token blocks (leading-block match over a
//! per-worker LRU), which is what an approximate radix tree reduces to at the trace's
//! granularity; its capacity is `max_tree_size` at ~4 characters per token
//! ([`SGLANG_TREE_BLOCKS_512`]).

use kvroute_core::prefix::PrefixIndex;

use super::{argmin_by_key, EndpointView};

/// SGLang `cache_threshold` default (0..1 match rate).
pub const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
/// SGLang `balance_abs_threshold` default (requests).
pub const SGLANG_BALANCE_ABS: u64 = 64;
/// SGLang `balance_rel_threshold` default (ratio).
pub const SGLANG_BALANCE_REL: f64 = 1.5;
/// `max_tree_size` 2^26 characters ≈ 2^24 tokens = 32 768 blocks of 512 tokens.
pub const SGLANG_TREE_BLOCKS_512: usize = (1 << 24) / 512;
/// Tokens per tree block.
pub const SGLANG_BLOCK_TOKENS: f64 = 512.0;

/// SGLang `cache_aware` policy.
#[derive(Debug, Clone)]
pub struct SglangCacheAware {
    index: PrefixIndex,
}

impl Default for SglangCacheAware {
    fn default() -> Self {
        Self::new()
    }
}

impl SglangCacheAware {
    /// A fresh policy with empty trees.
    pub fn new() -> Self {
        Self {
            index: PrefixIndex::new(SGLANG_TREE_BLOCKS_512),
        }
    }

    /// Pick for a request of `input_tokens` with chained 512-token block `hashes`, then insert
    /// them into the chosen worker's tree. `None` only when `views` is empty.
    pub fn pick(
        &mut self,
        ids: &[String],
        views: &[EndpointView],
        hashes: &[u64],
        input_tokens: u32,
    ) -> Option<usize> {
        let min_load = views.iter().map(|v| v.inflight).min()?;
        let max_load = views.iter().map(|v| v.inflight).max()?;
        let imbalanced = max_load.saturating_sub(min_load) > SGLANG_BALANCE_ABS
            && max_load as f64 > min_load as f64 * SGLANG_BALANCE_REL;
        let chosen = if imbalanced {
            argmin_by_key(views, |v| v.inflight)?
        } else {
            let (best, matched) = ids
                .iter()
                .enumerate()
                .map(|(i, id)| (i, self.index.match_one(hashes, id)))
                .fold(
                    (0usize, 0u32),
                    |acc, (i, m)| if m > acc.1 { (i, m) } else { acc },
                );
            let rate = (f64::from(matched) * SGLANG_BLOCK_TOKENS / f64::from(input_tokens.max(1)))
                .min(1.0);
            if rate > SGLANG_CACHE_THRESHOLD {
                best
            } else {
                argmin_by_key(views, |v| v.inflight)?
            }
        };
        if let Some(id) = ids.get(chosen) {
            self.index.record(id, hashes);
        }
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{test_ids, view};
    use super::*;

    #[test]
    fn threshold_least_load_and_imbalance_fallback() {
        let ids = test_ids(2);
        let mut p = SglangCacheAware::new();
        let idle = [view(0.0, 0, 0), view(0.0, 0, 0)];
        // Empty trees: a miss goes to the least-loaded worker, first on ties.
        assert_eq!(p.pick(&ids, &idle, &[1, 2], 1024), Some(0));
        // Full match (2 × 512 / 1024 = 1.0 > 0.3) sticks to replica 0.
        assert_eq!(p.pick(&ids, &idle, &[1, 2], 1024), Some(0));
        // One of four blocks matched: 512 / 2048 = 0.25 ≤ 0.3 → least load (replica 1 has 2
        // in flight, replica 0 has 3).
        let busy0 = [view(0.0, 0, 3), view(0.0, 0, 2)];
        assert_eq!(p.pick(&ids, &busy0, &[1, 9, 8, 7], 2048), Some(1));
        // Load gap 60 ≤ 64: not imbalanced, cache wins even on the busier replica.
        let gap60 = [view(0.0, 0, 70), view(0.0, 0, 10)];
        assert_eq!(p.pick(&ids, &gap60, &[1, 2], 1024), Some(0));
        // Gap 90 > 64 and 100 > 1.5 × 10: shortest queue regardless of the match.
        let gap90 = [view(0.0, 0, 100), view(0.0, 0, 10)];
        assert_eq!(p.pick(&ids, &gap90, &[1, 2], 1024), Some(1));
        // Gap 70 > 64 but 100 ≤ 1.5 × 70: balanced, the cache still decides.
        let rel = [view(0.0, 0, 100), view(0.0, 0, 70)];
        assert_eq!(p.pick(&ids, &rel, &[1, 2], 1024), Some(0));
        assert_eq!(p.pick(&ids, &[], &[1], 512), None);
    }
}
