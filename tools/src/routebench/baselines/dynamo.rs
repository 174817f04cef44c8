//! `dynamo-kv`: NVIDIA Dynamo's KV router cost function as of 2026
//! (`lib/kv-router/src/scheduling/selector.rs`, `DefaultWorkerSelector::select_worker`, the
//! `overlap-load` formula; active-sequence accounting in `lib/llm/src/kv_router/sequence.rs`;
//! <https://docs.nvidia.com/dynamo/latest/components/router/routing-concepts>, "Cost
//! Calculation").
//!
//! For each worker *w*, in KV blocks of the engine's block size (`--kv-cache-block-size`,
//! matching the backend: 16 tokens for vLLM):
//!
//! ```text
//! prefill_tokens(w) = active_prefill_tokens(w) + (isl − overlap_blocks(w) × block_size)
//! decode_blocks(w)  = active_blocks(w) + new_blocks(w)
//! cost(w)           = overlap_score_weight × prefill_tokens(w) / block_size + decode_blocks(w)
//! ```
//!
//! - `active_prefill_tokens(w)`: the uncached prompt tokens of the requests the router sent to
//!   *w* that have not finished prefill (`ActiveSequences::add_request` adds `isl − overlap ×
//!   block_size`, `mark_prefill_completed` removes it at the first token);
//! - `active_blocks(w)`: blocks held by the router's active sequences on *w* (prompt plus
//!   generated tokens, decremented when a request completes); `new_blocks(w)` = this request's
//!   blocks not already cached there (`⌈isl / block_size⌉ − overlap_blocks`);
//! - `overlap_blocks(w)`: Dynamo's default `--kv-events` mode feeds its indexer with the
//!   workers' KV-cache stored/removed events, so the overlap is the worker's **true** prefix
//!   cache; the replay loop passes the engine's actual cached-prefix length (event transport
//!   delay, milliseconds, is ignored).
//!
//! The lowest cost wins. Defaults: `overlap_score_weight` ([`DYNAMO_OVERLAP_WEIGHT`]) 1.0,
//! `router_temperature` 0.0 (deterministic: no softmax sampling); equal costs go to a
//! seeded random pick (Dynamo breaks them by tree size, then at random).

/// Dynamo default `overlap_score_weight` (`--kv-overlap-score-weight`).
pub const DYNAMO_OVERLAP_WEIGHT: f64 = 1.0;

/// What Dynamo's router knows of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DynamoWorker {
    /// Prompt blocks of this request already in the worker's KV cache (engine blocks).
    pub overlap_blocks: u32,
    /// Router-tracked active tokens (prompts plus generated tokens of unfinished requests).
    pub active_tokens: u64,
    /// Router-tracked uncached prompt tokens of its requests there without a first token.
    pub active_prefill_tokens: u64,
}

/// Dynamo KV router (temperature 0).
#[derive(Debug, Clone)]
pub struct DynamoKv {
    block_size: u32,
    overlap_weight: f64,
    rng: fastrand::Rng,
}

impl DynamoKv {
    /// A router for engines with `block_size`-token KV blocks (≥ 1), default weight 1.0.
    pub fn new(block_size: u32, seed: u64) -> Self {
        Self {
            block_size: block_size.max(1),
            overlap_weight: DYNAMO_OVERLAP_WEIGHT,
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// This request's uncached prompt tokens on `w` (what the router charges to its active
    /// prefill until the first token).
    pub fn new_tokens(&self, w: &DynamoWorker, input_tokens: u32) -> u64 {
        u64::from(input_tokens)
            .saturating_sub(u64::from(w.overlap_blocks) * u64::from(self.block_size))
    }

    /// Cost of `w` for a request of `input_tokens` (lower is better), in blocks.
    pub fn cost(&self, w: &DynamoWorker, input_tokens: u32) -> f64 {
        let bs = f64::from(self.block_size);
        let input = f64::from(input_tokens);
        let prefill = (w.active_prefill_tokens + self.new_tokens(w, input_tokens)) as f64 / bs;
        let new_blocks = ((input / bs).ceil() - f64::from(w.overlap_blocks)).max(0.0);
        let decode = (w.active_tokens as f64 / bs).ceil() + new_blocks;
        self.overlap_weight * prefill + decode
    }

    /// Index of the lowest-cost worker; `None` when `workers` is empty.
    pub fn pick(&mut self, workers: &[DynamoWorker], input_tokens: u32) -> Option<usize> {
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, w) in workers.iter().enumerate() {
            let c = self.cost(w, input_tokens);
            let tie = self.rng.u64(..);
            let better = match best {
                None => true,
                Some((b, t, _)) => c < b || (c == b && tie < t),
            };
            if better {
                best = Some((c, tie, i));
            }
        }
        best.map(|(_, _, i)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(overlap_blocks: u32, active_tokens: u64, active_prefill_tokens: u64) -> DynamoWorker {
        DynamoWorker {
            overlap_blocks,
            active_tokens,
            active_prefill_tokens,
        }
    }

    #[test]
    fn min_cost_worker() {
        let mut d = DynamoKv::new(16, 1);
        // 320-token prompt = 20 blocks.
        // A: overlap 0, active 160, no pending prefill → prefill 20 + decode 10 + 20 = 50.
        // B: overlap 15, active 480 → prefill 5 + decode 30 + 5 = 40.
        // C: overlap 10, active 160, 320 pending prefill tokens → (20 + 10) + 10 + 10 = 50.
        let ws = [w(0, 160, 0), w(15, 480, 0), w(10, 160, 320)];
        assert_eq!(d.cost(&ws[0], 320), 50.0);
        assert_eq!(d.cost(&ws[1], 320), 40.0);
        assert_eq!(d.cost(&ws[2], 320), 50.0);
        assert_eq!(d.pick(&ws, 320), Some(1));
        assert_eq!(d.new_tokens(&ws[1], 320), 80);
        // Overlap larger than the prompt never makes prefill or new blocks negative.
        assert_eq!(d.cost(&w(100, 0, 0), 320), 0.0);
        assert_eq!(d.new_tokens(&w(100, 0, 0), 320), 0);
        assert_eq!(d.pick(&[], 320), None);
    }
}
