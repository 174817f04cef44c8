//! Baseline routers re-implemented from their documented algorithms (written here, not
//! copied), driven by the same snapshot and router-local state as kvroute's picker.
//!
//! **`llmd-epp`** — llm-d's endpoint picker (EPP, built on the Gateway API Inference
//! Extension scheduler: Filter → Score → Pick, <https://llm-d.ai/docs/architecture/core/router/epp/scheduling>).
//! Default llm-d scheduling profile (llm-d `guides/inference-scheduling`; Red Hat OpenShift AI
//! "Configuring scheduler settings" docs: queue weight 2, prefix weight 3):
//! - filter: healthy endpoints serving the model (all replicas here);
//! - `queue-scorer` (weight 2): `(max_q − q) / (max_q − min_q)` over the candidates'
//!   waiting-queue sizes, 1.0 for all when they are equal;
//! - `kv-cache-utilization-scorer` (weight 2): `1 − kv_usage`;
//! - `prefix-cache-scorer` (weight 3): matched leading prefix blocks / request blocks, from
//!   the EPP's own approximate per-server LRU of routed blocks (GIE `prefix` plugin,
//!   `lruCapacityPerServer` = 31 250 blocks of 64 tokens ≈ 2 M tokens, i.e.
//!   [`LLMD_LRU_BLOCKS_512`] blocks of 512 tokens);
//! - `max-score-picker`: highest weighted sum, random tie-break.
//!
//! **`sglang-cache-aware`** — SGLang model gateway (sgl-model-gateway, formerly sgl-router)
//! `cache_aware` policy (`src/policies/cache_aware.rs`; defaults from its README /
//! `RouterArgs`: `cache_threshold` 0.3, `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5, `max_tree_size` 2^26):
//! - load = router-local running requests per worker;
//! - imbalanced when `max_load − min_load > balance_abs_threshold` **and**
//!   `max_load > min_load × balance_rel_threshold` → shortest queue (least load);
//! - otherwise prefix-match the request against each worker's approximate radix tree;
//!   `match_rate = matched tokens / input tokens`; if `match_rate > cache_threshold` →
//!   the best-matching worker, else the worker with the smallest tree;
//! - the request's prefix is inserted into the chosen worker's tree.
//!
//! Both use [`kvroute_core::prefix::PrefixIndex`] as their prefix memory (leading-block match
//! over a per-endpoint LRU of chained block hashes), which is what an approximate radix tree
//! over 512-token blocks reduces to.

use kvroute_core::prefix::PrefixIndex;

/// llm-d default `queue-scorer` weight (llm-d inference-scheduling guide).
pub const LLMD_QUEUE_WEIGHT: f64 = 2.0;
/// llm-d default `kv-cache-utilization-scorer` weight (llm-d inference-scheduling guide).
pub const LLMD_KV_WEIGHT: f64 = 2.0;
/// llm-d default `prefix-cache-scorer` weight (llm-d inference-scheduling guide).
pub const LLMD_PREFIX_WEIGHT: f64 = 3.0;
/// GIE prefix plugin `lruCapacityPerServer` (31 250 blocks × 64 tokens) in 512-token blocks.
pub const LLMD_LRU_BLOCKS_512: usize = 31_250 * 64 / 512;

/// SGLang `cache_threshold` default (0..1 match rate).
pub const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
/// SGLang `balance_abs_threshold` default (requests).
pub const SGLANG_BALANCE_ABS: u64 = 64;
/// SGLang `balance_rel_threshold` default (ratio).
pub const SGLANG_BALANCE_REL: f64 = 1.5;
/// SGLang `max_tree_size` default is 2^26 characters; at ~4 characters per token that is
/// 2^24 tokens = 32 768 blocks of 512 tokens per worker.
pub const SGLANG_TREE_BLOCKS_512: usize = (1 << 24) / 512;

/// What a baseline sees of one endpoint: the 200 ms snapshot plus router-local state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointView {
    /// Snapshot KV-cache usage (0..1).
    pub kv_usage: f64,
    /// Snapshot waiting-queue size (requests).
    pub waiting: u32,
    /// Router-local in-flight requests.
    pub inflight: u64,
}

/// llm-d EPP default profile. `ids` are endpoint ids aligned with `views`.
#[derive(Debug, Clone)]
pub struct LlmdEpp {
    index: PrefixIndex,
    rng: fastrand::Rng,
}

impl LlmdEpp {
    /// A fresh picker with an empty prefix LRU, seeded tie-breaks.
    pub fn new(seed: u64) -> Self {
        Self {
            index: PrefixIndex::new(LLMD_LRU_BLOCKS_512),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// Pick an endpoint index for a request with chained block `hashes`, then record the
    /// blocks for it. `None` only when `views` is empty.
    pub fn pick(
        &mut self,
        ids: &[String],
        views: &[EndpointView],
        hashes: &[u64],
    ) -> Option<usize> {
        let qmin = views.iter().map(|v| v.waiting).min()?;
        let qmax = views.iter().map(|v| v.waiting).max()?;
        let blocks = hashes.len() as f64;
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, (v, id)) in views.iter().zip(ids).enumerate() {
            let q = if qmax > qmin {
                f64::from(qmax - v.waiting) / f64::from(qmax - qmin)
            } else {
                1.0
            };
            let kv = 1.0 - v.kv_usage.clamp(0.0, 1.0);
            let p = if blocks > 0.0 {
                f64::from(self.index.match_one(hashes, id)) / blocks
            } else {
                0.0
            };
            let score = LLMD_QUEUE_WEIGHT * q + LLMD_KV_WEIGHT * kv + LLMD_PREFIX_WEIGHT * p;
            let tie = self.rng.u64(..);
            let better = match best {
                None => true,
                Some((s, t, _)) => score > s || (score == s && tie < t),
            };
            if better {
                best = Some((score, tie, i));
            }
        }
        let (_, _, i) = best?;
        if let Some(id) = ids.get(i) {
            self.index.record(id, hashes);
        }
        Some(i)
    }
}

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
    /// them into the chosen worker's tree. Ties go to the lowest index (deterministic).
    /// `None` only when `views` is empty.
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
        let least_loaded = || {
            views
                .iter()
                .enumerate()
                .min_by_key(|(_, v)| v.inflight)
                .map(|(i, _)| i)
        };
        let chosen = if imbalanced {
            least_loaded()?
        } else {
            let (best, matched) = ids
                .iter()
                .enumerate()
                .map(|(i, id)| (i, self.index.match_one(hashes, id)))
                .fold(
                    (0usize, 0u32),
                    |acc, (i, m)| if m > acc.1 { (i, m) } else { acc },
                );
            let rate = (f64::from(matched) * 512.0 / f64::from(input_tokens.max(1))).min(1.0);
            if rate > SGLANG_CACHE_THRESHOLD {
                best
            } else {
                ids.iter()
                    .enumerate()
                    .min_by_key(|(_, id)| self.index.len(id))
                    .map(|(i, _)| i)?
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
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("replica-{i}")).collect()
    }

    fn view(kv_usage: f64, waiting: u32, inflight: u64) -> EndpointView {
        EndpointView {
            kv_usage,
            waiting,
            inflight,
        }
    }

    #[test]
    fn llmd_weighted_sum_then_prefix_affinity() {
        let ids = ids(3);
        let mut p = LlmdEpp::new(1);
        // Scores: 2·1 + 2·0.5 = 3.0; 2·0 + 2·1 = 2.0; 2·0.5 + 2·0.8 = 2.6.
        let v = [view(0.5, 0, 0), view(0.0, 4, 0), view(0.2, 2, 0)];
        assert_eq!(p.pick(&ids, &v, &[11, 12]), Some(0));
        // Equal load: the prefix scorer (+3 for a full match) decides.
        let eq = [view(0.0, 0, 0); 3];
        assert_eq!(p.pick(&ids, &eq, &[11, 12, 13]), Some(0));
        // A better load score elsewhere (2 + 2 = 4 vs 2·0 + 2·0 + 3·1 = 3) beats the match.
        let busy = [view(1.0, 5, 0), view(0.0, 0, 0), view(0.0, 0, 0)];
        assert_ne!(p.pick(&ids, &busy, &[11, 12]), Some(0));
        assert_eq!(p.pick(&ids, &[], &[1]), None);
    }

    #[test]
    fn sglang_threshold_smallest_tree_and_imbalance() {
        let ids = ids(2);
        let mut p = SglangCacheAware::new();
        let idle = [view(0.0, 0, 0), view(0.0, 0, 0)];
        // Empty trees: smallest tree, lowest index on ties.
        assert_eq!(p.pick(&ids, &idle, &[1, 2], 1024), Some(0));
        // Full match (2 × 512 / 1024 = 1.0 > 0.3) sticks to replica 0.
        assert_eq!(p.pick(&ids, &idle, &[1, 2], 1024), Some(0));
        // One of four blocks matched: 512 / 2048 = 0.25 ≤ 0.3 → smallest tree (replica 1).
        assert_eq!(p.pick(&ids, &idle, &[1, 9, 8, 7], 2048), Some(1));
        // Load gap 60 ≤ 64: not imbalanced, cache wins even on the busier replica.
        let gap60 = [view(0.0, 0, 70), view(0.0, 0, 10)];
        assert_eq!(p.pick(&ids, &gap60, &[1, 2], 1024), Some(0));
        // Gap 90 > 64 and 100 > 1.5 × 10: shortest queue regardless of the match.
        let gap90 = [view(0.0, 0, 100), view(0.0, 0, 10)];
        assert_eq!(p.pick(&ids, &gap90, &[1, 2], 1024), Some(1));
        assert_eq!(p.pick(&ids, &[], &[1], 512), None);
    }
}
