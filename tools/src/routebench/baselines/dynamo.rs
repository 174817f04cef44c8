//! `dynamo-kv`: NVIDIA Dynamo's KV router cost function
//! (<https://docs.nvidia.com/dynamo/latest/components/router/routing-concepts>, "Cost
//! Calculation"; block tracking in <https://docs.nvidia.com/dynamo/dev/design_docs/router_design.html>).
//!
//! For each worker *w*, in KV blocks of the engine's block size (`--kv-cache-block-size`,
//! matching the backend: 16 tokens for vLLM):
//!
//! ```text
//! prefill_blocks(w) = (input_tokens − overlap_blocks(w) × block_size) / block_size
//! decode_blocks(w)  = active_blocks(w) + ⌈input_tokens / block_size⌉
//! cost(w)           = overlap_score_weight × prefill_blocks(w) + decode_blocks(w)
//! ```
//!
//! The lowest cost wins. Defaults: `overlap_score_weight` ([`DYNAMO_OVERLAP_WEIGHT`]) 1.0,
//! `router_temperature` 0.0 (deterministic: no softmax sampling); equal costs go to a
//! seeded random pick, as the docs describe for ties.
//!
//! Inputs, as Dynamo obtains them:
//! - `overlap_blocks(w)`: Dynamo's default `--kv-events` mode feeds its indexer with the
//!   workers' KV-cache stored/removed events, so the overlap is the worker's **true** prefix
//!   cache; the replay loop passes the engine's actual cached-prefix length (event transport
//!   delay, milliseconds, is ignored);
//! - `active_blocks(w)`: tracked by the router itself — incremented by a request's prompt
//!   when it is routed, by one token per generated token, decremented at completion — so it
//!   is immediate, not scraped.

/// Dynamo default `overlap_score_weight` (`--kv-overlap-score-weight`).
pub const DYNAMO_OVERLAP_WEIGHT: f64 = 1.0;

/// What Dynamo's router knows of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DynamoWorker {
    /// Prompt blocks of this request already in the worker's KV cache (engine blocks).
    pub overlap_blocks: u32,
    /// Router-tracked active tokens (prompts plus generated tokens of unfinished requests).
    pub active_tokens: u64,
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

    /// Cost of `w` for a request of `input_tokens` (lower is better), in blocks.
    pub fn cost(&self, w: &DynamoWorker, input_tokens: u32) -> f64 {
        let bs = f64::from(self.block_size);
        let input = f64::from(input_tokens);
        let prefill = (input - f64::from(w.overlap_blocks) * bs).max(0.0) / bs;
        let decode = w.active_tokens as f64 / bs + (input / bs).ceil();
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

    fn w(overlap_blocks: u32, active_tokens: u64) -> DynamoWorker {
        DynamoWorker {
            overlap_blocks,
            active_tokens,
        }
    }

    #[test]
    fn min_cost_worker() {
        let mut d = DynamoKv::new(16, 1);
        // 320-token prompt = 20 blocks.
        // A: overlap 0, active 160 → 20 + 10 + 20 = 50.
        // B: overlap 15, active 480 → 5 + 30 + 20 = 55.
        // C: overlap 10, active 160 → 10 + 10 + 20 = 40.
        let ws = [w(0, 160), w(15, 480), w(10, 160)];
        assert_eq!(d.cost(&ws[0], 320), 50.0);
        assert_eq!(d.cost(&ws[1], 320), 55.0);
        assert_eq!(d.cost(&ws[2], 320), 40.0);
        assert_eq!(d.pick(&ws, 320), Some(2));
        // Overlap larger than the prompt never makes prefill negative.
        assert_eq!(d.cost(&w(100, 0), 320), 20.0);
        assert_eq!(d.pick(&[], 320), None);
    }
}
