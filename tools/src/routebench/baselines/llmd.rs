//! `llmd-epp`: llm-d's endpoint picker (EPP) with its no-config default scheduling profile
//! (what the EPP runs when the operator gives no `EndpointPickerConfig`; the profile llm-d's
//! v0.10 guides ship instead is [`super::llmd_guide`]), built on
//! the Gateway API Inference Extension (GIE) scheduler: Filter → Score → Pick
//! (<https://llm-d.ai/docs/architecture/core/router/epp/scheduling>; GIE
//! `pkg/epp/scheduling/framework/plugins/`).
//!
//! Default profile (llm-d `guides/inference-scheduling`, GIE `config/charts` default
//! `EndpointPickerConfig`): `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2,
//! `prefix-cache-scorer` weight 3, `max-score-picker`.
//! - filter: healthy endpoints serving the model (all replicas in the benchmark);
//! - `queue-scorer`: `(max_q − q) / (max_q − min_q)` over the candidates' waiting-queue
//!   sizes from the last scrape, 1.0 for every endpoint when they are all equal;
//! - `kv-cache-utilization-scorer`: `1 − kv_usage` from the last scrape;
//! - `prefix-cache-scorer`: matched leading prefix blocks / request blocks, from the EPP's
//!   own approximate per-server LRU of the blocks it routed (GIE prefix plugin,
//!   `plugins/multi/prefix/plugin.go`: `lruCapacityPerServer` 31 250 blocks of
//!   `blockSize` 64 prompt characters, `maxPrefixBlocksToMatch` 256). The request's blocks
//!   are recorded for the chosen endpoint after the pick (the plugin's `PreRequest` hook);
//! - `max-score-picker`: highest weighted sum; ties broken uniformly at random (seeded).
//!
//! **Block granularity.** GIE hashes the prompt text in 64-character blocks (≈ 16 tokens at
//! 4 characters per token). The traces record prefix identity only per 512-token block
//! (Mooncake `hash_ids`; ShareGPT here is hashed in 2 048-character blocks, see
//! [`crate::routebench::workload`]), so the scorer matches those blocks; matched/total is
//! the same fraction up to the last partial block. The LRU holds the same number of tokens
//! as upstream's: 31 250 × 16 tokens ≈ 500 k tokens = [`LLMD_LRU_BLOCKS_512`] 512-token
//! blocks. `maxPrefixBlocksToMatch` (256 × 64 characters ≈ 4 k tokens) is not applied:
//! it would cap the prefix scorer at the first ~8 trace blocks, and the EPP computes the
//! score as a fraction of the *matched-to-limit* blocks, which equals the uncapped fraction
//! whenever the first 8 blocks agree.

use kvroute_core::prefix::PrefixIndex;

use super::EndpointView;

/// llm-d default `queue-scorer` weight.
pub const LLMD_QUEUE_WEIGHT: f64 = 2.0;
/// llm-d default `kv-cache-utilization-scorer` weight.
pub const LLMD_KV_WEIGHT: f64 = 2.0;
/// llm-d default `prefix-cache-scorer` weight.
pub const LLMD_PREFIX_WEIGHT: f64 = 3.0;
/// GIE prefix plugin `lruCapacityPerServer` (31 250 blocks × 64 characters ≈ 16 tokens
/// each) expressed in 512-token blocks.
pub const LLMD_LRU_BLOCKS_512: usize = 31_250 * 16 / 512;

/// llm-d EPP default profile. `ids` passed to [`LlmdEpp::pick`] are endpoint ids aligned
/// with the views.
#[derive(Debug, Clone)]
pub struct LlmdEpp {
    index: PrefixIndex,
    rng: fastrand::Rng,
}

impl LlmdEpp {
    /// A fresh picker with an empty prefix LRU and seeded tie-breaks.
    pub fn new(seed: u64) -> Self {
        Self {
            index: PrefixIndex::new(LLMD_LRU_BLOCKS_512),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// Weighted score of each endpoint (same order as `views`), without side effects.
    pub fn scores(&self, ids: &[String], views: &[EndpointView], hashes: &[u64]) -> Vec<f64> {
        let qmin = views.iter().map(|v| v.waiting).min().unwrap_or(0);
        let qmax = views.iter().map(|v| v.waiting).max().unwrap_or(0);
        let blocks = hashes.len() as f64;
        views
            .iter()
            .zip(ids)
            .map(|(v, id)| {
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
                LLMD_QUEUE_WEIGHT * q + LLMD_KV_WEIGHT * kv + LLMD_PREFIX_WEIGHT * p
            })
            .collect()
    }

    /// Pick an endpoint index for a request with chained block `hashes`, then record the
    /// blocks for it. `None` only when `views` is empty.
    pub fn pick(
        &mut self,
        ids: &[String],
        views: &[EndpointView],
        hashes: &[u64],
    ) -> Option<usize> {
        let scores = self.scores(ids, views, hashes);
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, &score) in scores.iter().enumerate() {
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

#[cfg(test)]
mod tests {
    use super::super::{test_ids, view};
    use super::*;

    #[test]
    fn weighted_sum_queue2_kv2_prefix3() {
        let ids = test_ids(3);
        let mut p = LlmdEpp::new(1);
        // queue: waiting 0/4/2 → 1, 0, 0.5; kv: 0.5/0.0/0.2 → 0.5, 1, 0.8.
        // Scores: 2·1 + 2·0.5 = 3.0; 2·0 + 2·1 = 2.0; 2·0.5 + 2·0.8 = 2.6.
        let v = [view(0.5, 0, 0), view(0.0, 4, 0), view(0.2, 2, 0)];
        let s = p.scores(&ids, &v, &[11, 12]);
        assert!((s[0] - 3.0).abs() < 1e-12 && (s[1] - 2.0).abs() < 1e-12);
        assert!((s[2] - 2.6).abs() < 1e-12);
        assert_eq!(p.pick(&ids, &v, &[11, 12]), Some(0));
        // Equal load: the prefix scorer (+3 for a full match, recorded above) decides.
        let eq = [view(0.0, 0, 0); 3];
        let s = p.scores(&ids, &eq, &[11, 12, 13]);
        // 2 of 3 blocks matched on replica 0: 2 + 2 + 3·2/3 = 6.
        assert!((s[0] - 6.0).abs() < 1e-12 && (s[1] - 4.0).abs() < 1e-12);
        assert_eq!(p.pick(&ids, &eq, &[11, 12, 13]), Some(0));
        // A full load score elsewhere (2 + 2 = 4) beats a full match on a loaded replica
        // (0 + 0 + 3 = 3).
        let busy = [view(1.0, 5, 0), view(0.0, 0, 0), view(0.0, 0, 0)];
        assert_ne!(p.pick(&ids, &busy, &[11, 12]), Some(0));
        assert_eq!(p.pick(&ids, &[], &[1]), None);
    }

    #[test]
    fn ties_are_random_but_seeded() {
        let ids = test_ids(4);
        let eq = [view(0.0, 0, 0); 4];
        let run = |seed| {
            let mut p = LlmdEpp::new(seed);
            (0..40u64)
                .filter_map(|k| p.pick(&ids, &eq, &[1000 + k]))
                .collect::<Vec<_>>()
        };
        let a = run(3);
        assert_eq!(a, run(3));
        // Every replica is used when all score the same.
        for r in 0..4 {
            assert!(a.contains(&r), "{a:?}");
        }
    }
}
