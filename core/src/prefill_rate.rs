//! Per-endpoint prefill throughput, learned online from time to first byte.
//!
//! The `predicted_ttft` policy (`picker/predicted_ttft.rs`) turns prefill work in tokens into
//! seconds with each endpoint's **prefill throughput** `R(e)`, tokens/s. No model server
//! exports it, and it differs by GPU, parallelism, model and engine flags, so it is learned
//! from what the router sees anyway: for each request that reached its first token,
//!
//! ```text
//! x = work tokens ahead of and including this request at pick time (tokens, see below)
//! y = time to first byte, seconds
//! y ≈ a + x / R                     (a: fixed per-request overhead, seconds)
//! ```
//!
//! `x` is what the picker predicted the endpoint had to prefill before this request's first
//! token: its pending prefill tokens plus this request's uncached prompt tokens, scaled by
//! the decode-interference factor of the moment ([`crate::picker::predicted_ttft`]
//! documents it), so the fit recovers the bare prefill rate rather than one polluted by the
//! decode batch of the moment.
//!
//! **Fit.** Exponentially weighted least squares of `y` on `x` per endpoint: the sums
//! `Σw, Σwx, Σwy, Σwx², Σwxy` decay by [`RATE_FORGET`] per observation (an effective window
//! of ~50 requests, so a replica that slows down under a new engine flag or a noisy neighbour
//! is followed within a minute of traffic). `1/R` is the slope; when the window does not
//! spread `x` enough for a slope (all prompts alike) the ratio `Σwy / Σwx` is used, which
//! folds the overhead into the rate. The estimate is clamped to
//! [`RATE_CLAMP`] × the seed either way, so one outlier (a stalled stream, a client that
//! reads slowly) cannot swing the router.
//!
//! **Seed.** Before any observation an endpoint's rate is the seed: the model profile's
//! `prefill_tokens_per_s` when set, else [`DEFAULT_PREFILL_TOKENS_PER_S`] = 15 928 tokens/s,
//! llm-d's default `peakPrefillThroughput` (measured for Qwen-32B on 2×H100, vLLM 0.19;
//! `prefix-cache-affinity-filter`, llm-d-router
//! `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go`). The seed also
//! enters the sums as [`RATE_PRIOR_WEIGHT`] pseudo-observations, so the first few real ones
//! move the estimate gradually.
//!
//! State is a few floats per endpoint, bounded by [`MAX_ENDPOINTS`] (least recently
//! observed dropped first); the router drops an endpoint's state once a snapshot no longer
//! lists it ([`PrefillRates::retain`]). Envoy workers share the observations rather than the state:
//! each replays the others' ([`crate::observation`]), so every worker fits every sample.

use std::collections::HashMap;

/// Seed prefill throughput when the model profile gives none, tokens/s (llm-d
/// `peakPrefillThroughput` default, see the module doc).
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 15_928.0;
/// Per-observation decay of the regression sums (0..1).
pub const RATE_FORGET: f64 = 0.98;
/// Weight of the seed in the sums, in observations.
pub const RATE_PRIOR_WEIGHT: f64 = 4.0;
/// Work (tokens) of the seed's pseudo-observation.
pub const RATE_PRIOR_TOKENS: f64 = 2_048.0;
/// The learned rate stays within `seed / RATE_CLAMP ..= seed × RATE_CLAMP`.
pub const RATE_CLAMP: f64 = 8.0;
/// Endpoints remembered at most.
pub const MAX_ENDPOINTS: usize = 4_096;
/// Observations with a TTFB outside `0 < y ≤ MAX_TTFB_S` are ignored (seconds).
pub const MAX_TTFB_S: f64 = 600.0;

/// Exponentially weighted regression sums of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct RateState {
    /// Σw.
    pub w: f64,
    /// Σw·x (tokens).
    pub x: f64,
    /// Σw·y (seconds).
    pub y: f64,
    /// Σw·x².
    pub xx: f64,
    /// Σw·x·y.
    pub xy: f64,
    /// Real observations folded in (not decayed).
    pub n: u64,
    /// Sequence number of the last observation (for eviction).
    pub last: u64,
}

/// What the learner believes about one endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateEstimate {
    /// Prefill throughput, tokens/s (> 0).
    pub tokens_per_s: f64,
    /// Fixed per-request overhead, seconds (≥ 0; 0 before a slope can be fitted).
    pub overhead_s: f64,
    /// Real observations behind it.
    pub observations: u64,
}

/// Online prefill-throughput learner, keyed by endpoint id (see the module doc).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrefillRates {
    seed: f64,
    seq: u64,
    endpoints: HashMap<String, RateState>,
}

impl Default for PrefillRates {
    fn default() -> Self {
        Self::new(DEFAULT_PREFILL_TOKENS_PER_S)
    }
}

impl PrefillRates {
    /// A learner seeded with `seed_tokens_per_s` (non-finite or ≤ 0 → the default seed).
    pub fn new(seed_tokens_per_s: f64) -> Self {
        let seed = if seed_tokens_per_s.is_finite() && seed_tokens_per_s > 0.0 {
            seed_tokens_per_s
        } else {
            DEFAULT_PREFILL_TOKENS_PER_S
        };
        Self {
            seed,
            seq: 0,
            endpoints: HashMap::new(),
        }
    }

    /// The seed rate, tokens/s.
    pub fn seed(&self) -> f64 {
        self.seed
    }

    /// Endpoints with state.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// True when nothing was observed yet.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    fn prior(&self) -> RateState {
        let x = RATE_PRIOR_TOKENS;
        let y = x / self.seed;
        let w = RATE_PRIOR_WEIGHT;
        RateState {
            w,
            x: w * x,
            y: w * y,
            xx: w * x * x,
            xy: w * x * y,
            n: 0,
            last: 0,
        }
    }

    /// Fold in one request: `work_tokens` predicted ahead of and including it at pick time,
    /// `ttfb_s` its measured time to first byte. Ignored (returns `false`) when either is
    /// not a positive finite number or the TTFB exceeds [`MAX_TTFB_S`].
    pub fn observe(&mut self, endpoint: &str, work_tokens: f64, ttfb_s: f64) -> bool {
        let ok = work_tokens.is_finite()
            && work_tokens > 0.0
            && ttfb_s.is_finite()
            && ttfb_s > 0.0
            && ttfb_s <= MAX_TTFB_S;
        if !ok {
            return false;
        }
        self.seq = self.seq.wrapping_add(1);
        if !self.endpoints.contains_key(endpoint) && self.endpoints.len() >= MAX_ENDPOINTS {
            if let Some(oldest) = self
                .endpoints
                .iter()
                .min_by_key(|(_, s)| s.last)
                .map(|(k, _)| k.clone())
            {
                self.endpoints.remove(&oldest);
            }
        }
        let prior = self.prior();
        let s = self.endpoints.entry(endpoint.to_string()).or_insert(prior);
        let (x, y) = (work_tokens, ttfb_s);
        s.w = s.w * RATE_FORGET + 1.0;
        s.x = s.x * RATE_FORGET + x;
        s.y = s.y * RATE_FORGET + y;
        s.xx = s.xx * RATE_FORGET + x * x;
        s.xy = s.xy * RATE_FORGET + x * y;
        s.n = s.n.saturating_add(1);
        s.last = self.seq;
        true
    }

    /// Current estimate for `endpoint` (the seed for an unknown one).
    pub fn estimate(&self, endpoint: &str) -> RateEstimate {
        match self.endpoints.get(endpoint) {
            None => RateEstimate {
                tokens_per_s: self.seed,
                overhead_s: 0.0,
                observations: 0,
            },
            Some(s) => {
                let (lo, hi) = (self.seed / RATE_CLAMP, self.seed * RATE_CLAMP);
                let mx = s.x / s.w;
                let my = s.y / s.w;
                let var = s.xx / s.w - mx * mx;
                let cov = s.xy / s.w - mx * my;
                // A slope needs x spread: a coefficient of variation of at least 10 %.
                let fitted = if var > (0.1 * mx) * (0.1 * mx) && cov > 0.0 {
                    let slope = cov / var;
                    let a = my - slope * mx;
                    if a >= 0.0 {
                        Some((1.0 / slope, a))
                    } else {
                        None
                    }
                } else {
                    None
                };
                let (rate, a) = fitted.unwrap_or_else(|| {
                    if s.y > 0.0 {
                        (s.x / s.y, 0.0)
                    } else {
                        (self.seed, 0.0)
                    }
                });
                let rate = if rate.is_finite() {
                    rate.clamp(lo, hi)
                } else {
                    self.seed
                };
                RateEstimate {
                    tokens_per_s: rate,
                    overhead_s: if a.is_finite() { a.max(0.0) } else { 0.0 },
                    observations: s.n,
                }
            }
        }
    }

    /// Prefill throughput of `endpoint`, tokens/s (> 0).
    pub fn tokens_per_s(&self, endpoint: &str) -> f64 {
        self.estimate(endpoint).tokens_per_s
    }

    /// Forget `endpoint` (it left the pool).
    pub fn remove(&mut self, endpoint: &str) {
        self.endpoints.remove(endpoint);
    }

    /// Keep only the endpoints for which `keep` is true (the router keeps those of the
    /// snapshot in force, once per snapshot version).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.endpoints.retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn unknown_endpoint_gets_the_seed() {
        let r = PrefillRates::new(20_000.0);
        let e = r.estimate("a");
        assert_eq!(e.tokens_per_s, 20_000.0);
        assert_eq!(e.observations, 0);
        assert_eq!(
            PrefillRates::new(f64::NAN).seed(),
            DEFAULT_PREFILL_TOKENS_PER_S
        );
        assert_eq!(PrefillRates::new(-1.0).seed(), DEFAULT_PREFILL_TOKENS_PER_S);
    }

    #[test]
    fn learns_rate_and_overhead_from_exact_observations() {
        // True server: 40 ms overhead + x / 10 000 tokens/s; seed is 2.5× too fast.
        let mut r = PrefillRates::new(25_000.0);
        for i in 0..400u32 {
            let x = f64::from(500 + (i * 977) % 20_000);
            assert!(r.observe("a", x, 0.040 + x / 10_000.0));
        }
        let e = r.estimate("a");
        assert!((e.tokens_per_s - 10_000.0).abs() < 50.0, "{e:?}");
        assert!((e.overhead_s - 0.040).abs() < 0.002, "{e:?}");
        assert_eq!(e.observations, 400);
        // Another endpoint is untouched.
        assert_eq!(r.tokens_per_s("b"), 25_000.0);
    }

    #[test]
    fn equal_prompts_fall_back_to_the_ratio() {
        let mut r = PrefillRates::new(10_000.0);
        for _ in 0..300 {
            r.observe("a", 4_000.0, 0.5);
        }
        // Ratio 4 000 / 0.5 = 8 000 tokens/s once the prior has decayed away.
        let e = r.estimate("a");
        assert!((e.tokens_per_s - 8_000.0).abs() < 20.0, "{e:?}");
        assert_eq!(e.overhead_s, 0.0);
    }

    #[test]
    fn bad_observations_are_ignored_and_outliers_clamped() {
        let mut r = PrefillRates::new(10_000.0);
        assert!(!r.observe("a", 0.0, 1.0));
        assert!(!r.observe("a", 100.0, 0.0));
        assert!(!r.observe("a", f64::INFINITY, 1.0));
        assert!(!r.observe("a", 100.0, MAX_TTFB_S * 2.0));
        assert!(r.is_empty());
        // A client that stalls for 100 s on every tiny request cannot push the rate below
        // seed / 8.
        for _ in 0..200 {
            r.observe("a", 10.0, 100.0);
        }
        assert_eq!(r.tokens_per_s("a"), 10_000.0 / RATE_CLAMP);
    }

    #[test]
    fn bounded_and_serialisable() {
        let mut r = PrefillRates::new(10_000.0);
        for i in 0..(MAX_ENDPOINTS + 10) {
            r.observe(&format!("e{i}"), 1_000.0, 0.1);
        }
        assert_eq!(r.len(), MAX_ENDPOINTS);
        // The oldest ones went first.
        assert_eq!(r.estimate("e0").observations, 0);
        assert_eq!(
            r.estimate(&format!("e{}", MAX_ENDPOINTS + 9)).observations,
            1
        );
        let json = serde_json::to_string(&r).unwrap_or_default();
        let back: PrefillRates = serde_json::from_str(&json).unwrap_or_default();
        assert_eq!(back, r);
        r.remove("e20");
        assert_eq!(r.len(), MAX_ENDPOINTS - 1);
    }
}
