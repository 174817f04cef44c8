//! `oracle`: an upper-bound router with perfect, instantaneous knowledge. At decision time
//! it reads every engine's true state — its actual prefix cache, the prefill work still
//! queued or in progress, and its free KV blocks — which no real router has (snapshots are
//! scraped, prefix memories are approximate).
//!
//! It picks the replica with the least predicted prefill work ahead of this request's
//! first token, in tokens:
//!
//! ```text
//! cost(r) = pending_prefill_tokens(r)                  // queued + partly prefilled prompts
//!         + (input_tokens − cached_tokens(r))          // this request's uncached prompt
//!         + max(0, input_tokens + output_tokens − cached_tokens(r) − free_kv_tokens(r))
//! ```
//!
//! The first two terms are the prefill compute the engine runs (FCFS, chunked prefill)
//! before this request's first token; the third is the KV shortfall the request would have
//! to wait out (or cause preemptions for). Ties go to fewer running requests, then the
//! lowest index. Prefill tokens dominate TTFT in the step-time model (compute-bound
//! chunks), which is why the cost is in tokens rather than seconds.

/// True state of one replica at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OracleView {
    /// Tokens of this request's prompt found in the replica's prefix cache.
    pub cached_tokens: u32,
    /// Prompt tokens of admitted or waiting requests whose prefill is not done.
    pub pending_prefill_tokens: u64,
    /// Free KV tokens (free blocks × block size).
    pub free_kv_tokens: u64,
    /// Running requests.
    pub running: u32,
}

/// The oracle (stateless).
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

impl Oracle {
    /// Cost of one replica (lower is better), tokens.
    pub fn cost(v: &OracleView, input_tokens: u32, output_tokens: u32) -> u64 {
        let uncached = u64::from(input_tokens.saturating_sub(v.cached_tokens));
        let need = uncached + u64::from(output_tokens);
        v.pending_prefill_tokens + uncached + need.saturating_sub(v.free_kv_tokens)
    }

    /// Index of the cheapest replica; `None` when `views` is empty.
    pub fn pick(
        &self,
        views: &[OracleView],
        input_tokens: u32,
        output_tokens: u32,
    ) -> Option<usize> {
        views
            .iter()
            .enumerate()
            .min_by_key(|(i, v)| (Self::cost(v, input_tokens, output_tokens), v.running, *i))
            .map(|(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(cached: u32, pending: u64, free: u64, running: u32) -> OracleView {
        OracleView {
            cached_tokens: cached,
            pending_prefill_tokens: pending,
            free_kv_tokens: free,
            running,
        }
    }

    #[test]
    fn least_prefill_work_with_true_cache() {
        // 1 000-token prompt, 100 output tokens, plenty of KV everywhere.
        // A: 0 cached, 0 pending → 1 000. B: 900 cached, 500 pending → 600.
        // C: 900 cached, 0 pending, but only 100 free tokens → 100 + (200 − 100) = 200.
        let views = [
            v(0, 0, 1 << 20, 0),
            v(900, 500, 1 << 20, 0),
            v(900, 0, 100, 0),
        ];
        assert_eq!(Oracle::cost(&views[0], 1000, 100), 1000);
        assert_eq!(Oracle::cost(&views[1], 1000, 100), 600);
        assert_eq!(Oracle::cost(&views[2], 1000, 100), 200);
        assert_eq!(Oracle.pick(&views, 1000, 100), Some(2));
        // Equal cost: fewer running wins.
        let eq = [v(0, 0, 1 << 20, 5), v(0, 0, 1 << 20, 2)];
        assert_eq!(Oracle.pick(&eq, 1000, 100), Some(1));
        assert_eq!(Oracle.pick(&[], 1, 1), None);
    }
}
