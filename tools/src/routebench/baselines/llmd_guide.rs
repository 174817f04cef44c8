//! `llmd-guide`: the scheduling profile llm-d's v0.10 guides ship (`optimized-baseline`,
//! also the prefill profile of `pd-disaggregation`): `prefix-cache-affinity-filter` →
//! `token-load-scorer` → `max-score-picker`, fed by `approx-prefix-cache-producer` and
//! `inflight-load-producer` (llm-d `guides/optimized-baseline/router/optimized-baseline.values.yaml`;
//! the "Sticky Until Saturated: Token-Aware Routing in llm-d" post, llm-d.github.io PR #462).
//!
//! Plugins, with the defaults of llm-d-router (`pkg/epp/framework/plugins/...`):
//! - **in-flight load** (`requesthandler/dataproducer/inflightload/producer.go`,
//!   `addEstimatedOutputTokens` false): per endpoint, the **uncached** prompt tokens of the
//!   requests the EPP sent there — prompt minus the blocks its prefix producer matched — added
//!   at `PreRequest` and released at the first response chunk (`StartOfStream`), i.e. queued
//!   prefill work. Immediate, not scraped.
//! - **`prefix-cache-affinity-filter`** (`scheduling/filter/prefixcacheaffinity/plugin.go`,
//!   `DefaultConfig`): endpoints whose prefix score (matched / total blocks) is ≥
//!   `affinityThreshold` [`LLMD_AFFINITY_THRESHOLD`] = 0.80 are *sticky*. No sticky endpoint →
//!   keep all. Otherwise the TTFT load gate (llm-d-router PR #1547, default raised to 18 000 ms
//!   in PR #1639) estimates each endpoint's TTFT as `in-flight tokens / peakPrefillThroughput`
//!   ([`LLMD_PEAK_PREFILL_TOKENS_PER_S`] = 15 928 tokens/s, calibrated for Qwen-32B on 2×H100)
//!   and, when the best sticky endpoint's exceeds the best non-sticky one's by more than
//!   `maxTTFTPenaltyMs` ([`LLMD_MAX_TTFT_PENALTY_S`] = 18 s), keeps all endpoints; else only
//!   the sticky ones. `explorationProbability` defaults to 0.
//! - **`token-load-scorer`** (`scheduling/scorer/tokenload`): `1 − min(1, tokens /
//!   queueThresholdTokens)`, `queueThresholdTokens` [`LLMD_QUEUE_THRESHOLD_TOKENS`] = 4 Mi.
//! - **`max-score-picker`**: highest score, ties uniformly at random (seeded here).
//!
//! Prefix matching uses the same approximate per-endpoint LRU as [`super::llmd`] (blocks the
//! EPP routed; 512-token trace blocks standing in for GIE's 64-character blocks, the same
//! memory budget). The 15 928 tokens/s constant is kept as shipped although the simulated
//! H100 serving Llama-3.1-8B prefills faster: the guide tells operators to calibrate it, and
//! an uncalibrated deployment runs the default.

use kvroute_core::prefix::PrefixIndex;

use super::llmd::LLMD_LRU_BLOCKS_512;

/// `prefix-cache-affinity-filter` `affinityThreshold` default (0..1).
pub const LLMD_AFFINITY_THRESHOLD: f64 = 0.80;
/// `maxTTFTPenaltyMs` default, seconds.
pub const LLMD_MAX_TTFT_PENALTY_S: f64 = 18.0;
/// `peakPrefillThroughput` default, tokens/s.
pub const LLMD_PEAK_PREFILL_TOKENS_PER_S: f64 = 15_928.0;
/// `token-load-scorer` `queueThresholdTokens` default (4 Mi tokens).
pub const LLMD_QUEUE_THRESHOLD_TOKENS: f64 = 4_194_304.0;

/// llm-d v0.10 guide profile. [`LlmdGuide::pick`] takes endpoint ids and the EPP's in-flight
/// uncached tokens per endpoint, aligned.
#[derive(Debug, Clone)]
pub struct LlmdGuide {
    index: PrefixIndex,
    rng: fastrand::Rng,
}

/// One decision with the tokens the in-flight producer charges to the chosen endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuidePick {
    /// Chosen endpoint index.
    pub index: usize,
    /// Uncached prompt tokens to add to its in-flight load until the first token.
    pub charge_tokens: u64,
}

impl LlmdGuide {
    /// A fresh picker with an empty prefix LRU and seeded tie-breaks.
    pub fn new(seed: u64) -> Self {
        Self {
            index: PrefixIndex::new(LLMD_LRU_BLOCKS_512),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// Endpoints the affinity filter keeps (indices), for a request with `hashes`.
    pub fn filter(&self, ids: &[String], inflight_tokens: &[u64], hashes: &[u64]) -> Vec<usize> {
        let all: Vec<usize> = (0..ids.len()).collect();
        if ids.len() <= 1 || hashes.is_empty() {
            return all;
        }
        let blocks = hashes.len() as f64;
        let (mut sticky, mut cold) = (Vec::new(), Vec::new());
        for (i, id) in ids.iter().enumerate() {
            let score = f64::from(self.index.match_one(hashes, id)) / blocks;
            if score >= LLMD_AFFINITY_THRESHOLD {
                sticky.push(i);
            } else {
                cold.push(i);
            }
        }
        if sticky.is_empty() {
            return all;
        }
        let ttft = |i: &usize| {
            inflight_tokens.get(*i).copied().unwrap_or(0) as f64 / LLMD_PEAK_PREFILL_TOKENS_PER_S
        };
        if !cold.is_empty() {
            let best_sticky = sticky.iter().map(ttft).fold(f64::INFINITY, f64::min);
            let best_cold = cold.iter().map(ttft).fold(f64::INFINITY, f64::min);
            if best_sticky - best_cold > LLMD_MAX_TTFT_PENALTY_S {
                return all;
            }
        }
        sticky
    }

    /// Pick for a request of `input_tokens` with chained 512-token block `hashes`, record the
    /// blocks for the chosen endpoint, and return the in-flight charge. `None` only when `ids`
    /// is empty.
    pub fn pick(
        &mut self,
        ids: &[String],
        inflight_tokens: &[u64],
        hashes: &[u64],
        input_tokens: u32,
    ) -> Option<GuidePick> {
        let kept = self.filter(ids, inflight_tokens, hashes);
        let mut best: Option<(f64, u64, usize)> = None;
        for i in kept {
            let t = inflight_tokens.get(i).copied().unwrap_or(0) as f64;
            let score = 1.0 - (t / LLMD_QUEUE_THRESHOLD_TOKENS).min(1.0);
            let tie = self.rng.u64(..);
            let better = match best {
                None => true,
                Some((s, tb, _)) => score > s || (score == s && tie < tb),
            };
            if better {
                best = Some((score, tie, i));
            }
        }
        let (_, _, i) = best?;
        let id = ids.get(i)?;
        let matched = u64::from(self.index.match_one(hashes, id));
        let cached = matched.saturating_mul(512).min(u64::from(input_tokens));
        self.index.record(id, hashes);
        Some(GuidePick {
            index: i,
            charge_tokens: u64::from(input_tokens) - cached,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_ids;
    use super::*;

    #[test]
    fn sticky_until_the_ttft_gate_breaks() {
        let ids = test_ids(3);
        let mut p = LlmdGuide::new(1);
        // Empty LRU: no sticky endpoint, least token load (replica 1) wins.
        let g = p.pick(&ids, &[5_000, 0, 7_000], &[1, 2, 3, 4], 2_048);
        assert_eq!(
            g,
            Some(GuidePick {
                index: 1,
                charge_tokens: 2_048
            })
        );
        // Same prefix, 4 of 5 blocks cached on replica 1 (0.8 ≥ 0.80): sticky although it is
        // the busiest, as long as its estimated TTFT is ≤ 18 s worse than the best cold one.
        // 200 000 tokens / 15 928 tokens/s = 12.6 s.
        let load = [0, 200_000, 0];
        assert_eq!(p.filter(&ids, &load, &[1, 2, 3, 4, 5]), vec![1]);
        let g = p.pick(&ids, &load, &[1, 2, 3, 4, 5], 2_560);
        assert_eq!(
            g,
            Some(GuidePick {
                index: 1,
                charge_tokens: 512
            })
        );
        // 300 000 tokens = 18.8 s > 18 s: the gate opens all endpoints, token load decides.
        let load = [0, 300_000, 10];
        assert_eq!(p.filter(&ids, &load, &[1, 2, 3, 4, 5]), vec![0, 1, 2]);
        assert_eq!(
            p.pick(&ids, &load, &[1, 2, 3, 4, 5], 2_560)
                .map(|g| g.index),
            Some(0)
        );
        // 3 of 5 blocks (0.6 < 0.8): not sticky anywhere new.
        assert_eq!(p.filter(&ids, &[0, 0, 0], &[1, 2, 3, 9, 9]), vec![0, 1, 2]);
        assert_eq!(p.pick(&[], &[], &[1], 1), None);
    }

    #[test]
    fn ties_are_random_but_seeded() {
        let ids = test_ids(4);
        let run = |seed| {
            let mut p = LlmdGuide::new(seed);
            (0..40u64)
                .filter_map(|k| p.pick(&ids, &[0; 4], &[1000 + k], 512).map(|g| g.index))
                .collect::<Vec<_>>()
        };
        let a = run(3);
        assert_eq!(a, run(3));
        for r in 0..4 {
            assert!(a.contains(&r), "{a:?}");
        }
    }
}
