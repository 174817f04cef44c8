//! Trace-only reference numbers the sweep reports beside the routers' results.
//!
//! **Pooled-LRU ceiling** ([`pooled_lru_hit_rate`]). A router can only move requests between
//! replicas; the hit rate it can reach is bounded by how much of the trace's prefix reuse
//! fits in the fleet's KV cache at all. The ceiling replays the trace's prefix blocks, in
//! arrival order, through **one** LRU cache holding all replicas' KV capacity (`replicas ×
//! kv_tokens_per_replica / 512` blocks of 512 tokens, the traces' `hash_ids` granularity): a
//! request hits its leading blocks that are still cached, then all its blocks become most
//! recently used, evicting the least recently used beyond capacity. vLLM evicts the least
//! recently used free blocks (`vllm/v1/core/block_pool.py`, free-block queue), so an ideal
//! router over N replicas behaves like this pooled cache at best; capacity held by running
//! requests' own blocks and partial blocks make the real figure lower. Hit tokens count as
//! the engine counts them: matched blocks × 512 tokens, at most the prompt's full 16-token
//! blocks and at most `prompt − 1` (vLLM always computes the last token).
//!
//! **Output-length error** ([`output_length_error`]). Replays a trace's (prompt, output)
//! pairs in order through [`OutputLengths`]: each request is predicted from the responses
//! before it (the filter's situation), then observed. Reported: mean absolute error of the
//! median prediction, its median absolute percentage error, the share of outputs at or
//! below the p90 prediction (calibration of the KV-reservation quantile), and the same mean
//! absolute error for the model profile's fixed rule (512 tokens when no limit is set), over
//! the requests where the learner answered.

use std::collections::{BTreeMap, HashMap};

use kvroute_core::analysis::ApiKind;
use kvroute_core::output_len::OutputLengths;

use super::{chain_ids, PROFILE_EXPECTED_OUTPUT, TRACE_BLOCK_TOKENS};
use kvroute_sim::trace::TraceRow;

/// Engine KV block size the hit counting rounds to (vLLM default, tokens).
const ENGINE_BLOCK_TOKENS: u64 = 16;

/// Hit rate (0..1) of `rows` replayed through one LRU of `capacity_blocks` 512-token blocks
/// (see the module doc); 0 for an empty trace.
pub fn pooled_lru_hit_rate(rows: &[TraceRow], capacity_blocks: usize) -> f64 {
    let cap = capacity_blocks.max(1);
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let mut by_age: BTreeMap<u64, u64> = BTreeMap::new();
    let mut clock = 0u64;
    let (mut hit, mut total) = (0u64, 0u64);
    for row in rows {
        let prompt = u64::from(row.input_length.max(1));
        let hashes = chain_ids(&row.hash_ids);
        let matched = hashes
            .iter()
            .take_while(|h| last_use.contains_key(h))
            .count() as u64;
        let full = prompt / ENGINE_BLOCK_TOKENS * ENGINE_BLOCK_TOKENS;
        hit += (matched * u64::from(TRACE_BLOCK_TOKENS))
            .min(full)
            .min(prompt - 1);
        total += prompt;
        for h in hashes {
            clock += 1;
            if let Some(old) = last_use.insert(h, clock) {
                by_age.remove(&old);
            }
            by_age.insert(clock, h);
        }
        while last_use.len() > cap {
            let Some((_, h)) = by_age.pop_first() else {
                break;
            };
            last_use.remove(&h);
        }
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// Output-length prediction error on one trace (see the module doc).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OutputLengthError {
    /// Trace name.
    pub trace: String,
    /// Rows replayed.
    pub rows: usize,
    /// Rows the learner predicted (after its warm-up).
    pub predicted: usize,
    /// Mean |median prediction − actual|, tokens.
    pub p50_mae: f64,
    /// Median of |prediction − actual| / actual (0..).
    pub p50_median_ape: f64,
    /// Share of actual outputs ≤ the p90 prediction (0..1; 0.9 is calibrated).
    pub p90_coverage: f64,
    /// Mean |512 − actual| over the same rows (the profile's fixed rule), tokens.
    pub fixed_rule_mae: f64,
    /// Mean actual output over the same rows, tokens.
    pub mean_output: f64,
}

/// Replay `rows` through a fresh [`OutputLengths`] for `model` (see the module doc).
pub fn output_length_error(trace: &str, rows: &[TraceRow], model: &str) -> OutputLengthError {
    let mut o = OutputLengths::new();
    let (mut n, mut abs, mut fixed, mut cover, mut sum) = (0usize, 0.0, 0.0, 0usize, 0.0);
    let mut ape = Vec::new();
    for r in rows {
        let prompt = u64::from(r.input_length.max(1));
        let actual = f64::from(r.output_length.max(1));
        let p50 = o.predict(model, ApiKind::Completions, prompt, None, 0.5);
        let p90 = o.predict(model, ApiKind::Completions, prompt, None, 0.9);
        if let (Some(p50), Some(p90)) = (p50, p90) {
            n += 1;
            abs += (p50 as f64 - actual).abs();
            ape.push((p50 as f64 - actual).abs() / actual);
            fixed += (PROFILE_EXPECTED_OUTPUT as f64 - actual).abs();
            if actual <= p90 as f64 {
                cover += 1;
            }
            sum += actual;
        }
        o.observe(
            model,
            ApiKind::Completions,
            prompt,
            u64::from(r.output_length),
        );
    }
    ape.sort_by(f64::total_cmp);
    let d = n.max(1) as f64;
    OutputLengthError {
        trace: trace.to_string(),
        rows: rows.len(),
        predicted: n,
        p50_mae: abs / d,
        p50_median_ape: super::percentile(&ape, 0.5),
        p90_coverage: cover as f64 / d,
        fixed_rule_mae: fixed / d,
        mean_output: sum / d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(input: u32, output: u32, ids: &[u64]) -> TraceRow {
        TraceRow {
            timestamp: 0,
            input_length: input,
            output_length: output,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn pooled_lru_counts_leading_cached_blocks_and_evicts_lru() {
        // Capacity 3 blocks.
        let rows = [
            row(1024, 1, &[1, 2]),    // miss
            row(1500, 1, &[1, 2, 3]), // hits 2 blocks: 1024
            row(512, 1, &[9]),        // miss; evicts block 1 (LRU) → cache {2,3,9}… chained
            row(1024, 1, &[1, 2]),    // block 1's chain hash evicted → miss
        ];
        // Hits: 0 + 1024 + 0 + 0 over 1024 + 1500 + 512 + 1024.
        let h = pooled_lru_hit_rate(&rows, 3);
        assert!((h - 1024.0 / 4060.0).abs() < 1e-12, "{h}");
        // Large cache: the last request hits both blocks, capped at prompt − 1.
        let h = pooled_lru_hit_rate(&rows, 100);
        assert!((h - (1024.0 + 1023.0) / 4060.0).abs() < 1e-12, "{h}");
        assert_eq!(pooled_lru_hit_rate(&[], 10), 0.0);
    }

    #[test]
    fn output_error_after_warmup() {
        // 100 requests with 100 output tokens. The learner answers once its decayed weight
        // Σ 0.999^i reaches MIN_OBSERVATIONS (20): 20 observations weigh 19.81, 21 weigh
        // 20.79, so it answers from the 22nd request on.
        let rows: Vec<TraceRow> = (0..100).map(|_| row(1000, 100, &[])).collect();
        let e = output_length_error("t", &rows, "m");
        assert_eq!(e.rows, 100);
        assert_eq!(e.predicted, 79);
        assert!(e.p50_mae < 10.0, "{e:?}");
        assert_eq!(e.p90_coverage, 1.0);
        assert_eq!(e.fixed_rule_mae, 412.0);
        assert_eq!(e.mean_output, 100.0);
    }
}
