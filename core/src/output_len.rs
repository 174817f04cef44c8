//! Learned output lengths: how many tokens a request will generate, predicted from the
//! `usage` of earlier responses of the same model and API.
//!
//! KV demand and decode load depend on the output length, which the request does not state
//! (`max_tokens` is a cap, often absent or far above what is generated). The model profile's
//! rule ([`crate::profile::ModelProfile::demand_for`]: half of the output limit, 512 tokens
//! by default) is a fixed guess; this module replaces it with the distribution the model
//! server actually produced.
//!
//! **Model.** Per (model, API), requests fall in prompt-length buckets by octave
//! (`⌊log2(prompt_tokens)⌋`, 0..=[`PROMPT_OCTAVES`]), because output length depends on the
//! kind of request and prompt length is the cheapest proxy for it (short chat turns vs long
//! documents to summarise). Each bucket keeps an exponentially decayed histogram of observed
//! `completion_tokens` over log-spaced bins, [`BINS_PER_OCTAVE`] per octave from 1 to
//! 2^[`OUTPUT_OCTAVES`] tokens (±9 % resolution), decayed by [`OUTPUT_FORGET`] per
//! observation so the estimate follows a changing workload (window ≈ 1 000 requests).
//! [`OutputLengths::predict`] returns the `q`-quantile of the request's bucket, interpolated
//! geometrically inside a bin, capped by the request's `max_tokens`. A bucket with less than
//! [`MIN_OBSERVATIONS`] of (decayed) weight borrows the model's all-bucket histogram; with
//! less than that overall, the answer is `None` and the caller keeps the profile's rule.
//!
//! Which quantile: the median for decode load (what the batch will carry on average) and a
//! high quantile (p90) for the KV reservation (headroom checks should rarely be exceeded).
//!
//! Memory: (`PROMPT_OCTAVES` + 2) × `OUTPUT_OCTAVES` × `BINS_PER_OCTAVE` floats per
//! (model, API) ≈ 13 KiB, at most [`MAX_KEYS`] keys. Envoy workers share the
//! observations, not the state ([`crate::observation`]).

use std::collections::HashMap;

use crate::analysis::ApiKind;

/// Prompt-length buckets: octaves 0..=`PROMPT_OCTAVES` (the last one takes everything longer).
pub const PROMPT_OCTAVES: usize = 20;
/// Output histogram range: 1 ..= 2^`OUTPUT_OCTAVES` tokens.
pub const OUTPUT_OCTAVES: usize = 17;
/// Histogram bins per octave of output length.
pub const BINS_PER_OCTAVE: usize = 4;
/// Per-observation decay of a bucket's histogram (0..1).
pub const OUTPUT_FORGET: f64 = 0.999;
/// (Decayed) observations a histogram needs before it answers.
pub const MIN_OBSERVATIONS: f64 = 20.0;
/// (model, API) keys remembered at most.
pub const MAX_KEYS: usize = 64;

const BINS: usize = OUTPUT_OCTAVES * BINS_PER_OCTAVE;

/// A decayed histogram over log-spaced output-length bins.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Histogram {
    /// Weight per bin; bin `i` covers `[2^(i/B), 2^((i+1)/B))` tokens, `B` = bins per octave.
    pub bins: Vec<f64>,
    /// Σ bins.
    pub total: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            bins: vec![0.0; BINS],
            total: 0.0,
        }
    }
}

fn bin_of(tokens: u64) -> usize {
    let t = tokens.max(1) as f64;
    let b = (t.log2() * BINS_PER_OCTAVE as f64).floor();
    if b.is_finite() && b > 0.0 {
        (b as usize).min(BINS - 1)
    } else {
        0
    }
}

fn bin_lo(i: usize) -> f64 {
    (i as f64 / BINS_PER_OCTAVE as f64).exp2()
}

impl Histogram {
    fn add(&mut self, tokens: u64, forget: f64) {
        if self.bins.len() != BINS {
            self.bins = vec![0.0; BINS];
            self.total = 0.0;
        }
        for b in self.bins.iter_mut() {
            *b *= forget;
        }
        if let Some(b) = self.bins.get_mut(bin_of(tokens)) {
            *b += 1.0;
        }
        self.total = self.total * forget + 1.0;
    }

    /// `q`-quantile (0..1) in tokens, geometric interpolation inside the bin; `None` when
    /// empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total <= 0.0 {
            return None;
        }
        let q = if q.is_finite() {
            q.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let target = q * self.total;
        let mut acc = 0.0;
        for (i, &w) in self.bins.iter().enumerate() {
            if w > 0.0 && acc + w >= target {
                let frac = ((target - acc) / w).clamp(0.0, 1.0);
                // lo · (hi / lo)^frac with lo, hi = 2^(i / n), 2^((i + 1) / n): one `exp2`.
                return Some(((i as f64 + frac) / BINS_PER_OCTAVE as f64).exp2());
            }
            acc += w;
        }
        Some(bin_lo(BINS))
    }
}

/// Histograms of one (model, API).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct KeyState {
    /// One histogram per prompt octave.
    pub buckets: Vec<Histogram>,
    /// All prompts together.
    pub all: Histogram,
    /// Sequence number of the last observation (for eviction).
    pub last: u64,
}

fn octave(prompt_tokens: u64) -> usize {
    (63 - prompt_tokens.max(1).leading_zeros() as usize).min(PROMPT_OCTAVES)
}

/// Online output-length predictor (see the module doc).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct OutputLengths {
    seq: u64,
    keys: HashMap<String, KeyState>,
}

/// The map key of (`model`, `api`): the model name, a NUL, one letter for the API. Built
/// by hand: `format!` with the API's `Debug` name was 1.1 k of the 1.3 k instructions of a
/// prediction, on every request (callgrind).
fn key(model: &str, api: ApiKind) -> String {
    let mut k = String::with_capacity(model.len() + 2);
    k.push_str(model);
    k.push('\u{0}');
    k.push(char::from(api_letter(api)));
    k
}

/// The API's letter in a [`key`].
fn api_letter(api: ApiKind) -> u8 {
    match api {
        ApiKind::ChatCompletions => b'c',
        ApiKind::Completions => b'p',
        ApiKind::Responses => b'r',
        ApiKind::Embeddings => b'e',
        ApiKind::Other => b'o',
    }
}

/// Model names up to this long have their [`key`] looked up from the stack.
const STACK_KEY_BYTES: usize = 126;

/// `f` of the [`key`] of (`model`, `api`), built on the stack for a model name of up to
/// [`STACK_KEY_BYTES`] (a lookup on every request: the key's `String` was an allocation
/// and a free per prediction, callgrind), else as a `String`.
fn with_key<R>(model: &str, api: ApiKind, f: impl FnOnce(&str) -> R) -> R {
    let mut buf = [0u8; STACK_KEY_BYTES + 2];
    let n = model.len();
    if let Some(head) = buf.get_mut(..n) {
        head.copy_from_slice(model.as_bytes());
        // buf[n] is already NUL.
        if let Some(letter) = buf.get_mut(n + 1) {
            *letter = api_letter(api);
            // A model name (UTF-8), a NUL and an ASCII letter.
            if let Ok(k) = std::str::from_utf8(buf.get(..n + 2).unwrap_or_default()) {
                return f(k);
            }
        }
    }
    f(&key(model, api))
}

impl OutputLengths {
    /// An empty predictor.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fold in one response: `prompt_tokens` and `completion_tokens` from its `usage`.
    /// A response with no completion tokens (an error, a cancelled stream) is ignored;
    /// returns whether the response was used.
    pub fn observe(
        &mut self,
        model: &str,
        api: ApiKind,
        prompt_tokens: u64,
        completion_tokens: u64,
    ) -> bool {
        if completion_tokens == 0 {
            return false;
        }
        self.seq = self.seq.wrapping_add(1);
        let k = key(model, api);
        if !self.keys.contains_key(&k) && self.keys.len() >= MAX_KEYS {
            if let Some(oldest) = self
                .keys
                .iter()
                .min_by_key(|(_, s)| s.last)
                .map(|(k, _)| k.clone())
            {
                self.keys.remove(&oldest);
            }
        }
        let s = self.keys.entry(k).or_default();
        if s.buckets.len() != PROMPT_OCTAVES + 1 {
            s.buckets = vec![Histogram::default(); PROMPT_OCTAVES + 1];
        }
        if let Some(h) = s.buckets.get_mut(octave(prompt_tokens)) {
            h.add(completion_tokens, OUTPUT_FORGET);
        }
        s.all.add(completion_tokens, OUTPUT_FORGET);
        s.last = self.seq;
        true
    }

    /// Predicted output tokens at quantile `q` (0..1) for a request of `prompt_tokens`,
    /// capped by `max_tokens`; `None` until [`MIN_OBSERVATIONS`] responses of this model and
    /// API were seen. Always ≥ 1.
    pub fn predict(
        &self,
        model: &str,
        api: ApiKind,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        q: f64,
    ) -> Option<u64> {
        // Nothing learned yet (no response read): no key to build.
        if self.keys.is_empty() {
            return None;
        }
        let s = with_key(model, api, |k| self.keys.get(k))?;
        let h = s
            .buckets
            .get(octave(prompt_tokens))
            .filter(|h| h.total >= MIN_OBSERVATIONS)
            .or(Some(&s.all).filter(|h| h.total >= MIN_OBSERVATIONS))?;
        let v = h.quantile(q)?.round();
        let v = if v.is_finite() && v >= 1.0 {
            v as u64
        } else {
            1
        };
        Some(max_tokens.map_or(v, |m| v.min(m.max(1))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The key looked up from the stack is [`key`]'s, for every API, at the stack's limit
    /// and past it (then from a `String`), and for a multi-byte model name.
    #[test]
    fn stack_keys_are_keys() {
        let apis = [
            ApiKind::ChatCompletions,
            ApiKind::Completions,
            ApiKind::Responses,
            ApiKind::Embeddings,
            ApiKind::Other,
        ];
        for len in [
            0,
            1,
            33,
            STACK_KEY_BYTES - 1,
            STACK_KEY_BYTES,
            STACK_KEY_BYTES + 1,
            300,
        ] {
            for model in ["m".repeat(len), "é".repeat(len / 2)] {
                for api in apis {
                    assert_eq!(with_key(&model, api, str::to_owned), key(&model, api));
                }
            }
        }
        assert_eq!(
            with_key("llama", ApiKind::Completions, str::to_owned),
            "llama\0p"
        );
    }

    #[test]
    fn bins_and_octaves() {
        assert_eq!(bin_of(0), 0);
        assert_eq!(bin_of(1), 0);
        assert_eq!(bin_of(2), 4);
        assert_eq!(bin_of(3), 6); // log2(3) × 4 = 6.34
        assert_eq!(bin_of(u64::MAX), BINS - 1);
        assert_eq!(octave(0), 0);
        assert_eq!(octave(1_000), 9);
        assert_eq!(octave(1 << 40), PROMPT_OCTAVES);
    }

    #[test]
    fn none_until_enough_observations() {
        let mut o = OutputLengths::new();
        // 20 observations decay to a weight of 19.8 < MIN_OBSERVATIONS.
        for _ in 0..20 {
            o.observe("m", ApiKind::ChatCompletions, 100, 200);
        }
        assert_eq!(
            o.predict("m", ApiKind::ChatCompletions, 100, None, 0.5),
            None
        );
        o.observe("m", ApiKind::ChatCompletions, 100, 200);
        // 200 lies in bin ⌊log2(200)·4⌋ = 30, [181.0, 215.3): the median interpolates to the
        // middle of the mass, the upper end for q = 1.
        let p50 = o.predict("m", ApiKind::ChatCompletions, 100, None, 0.5);
        assert_eq!(p50, Some(197));
        assert_eq!(
            o.predict("m", ApiKind::ChatCompletions, 100, None, 1.0),
            Some(215)
        );
        // Other API or model: nothing.
        assert_eq!(o.predict("m", ApiKind::Completions, 100, None, 0.5), None);
        assert_eq!(
            o.predict("x", ApiKind::ChatCompletions, 100, None, 0.5),
            None
        );
        // Ignored: zero completion tokens.
        o.observe("x", ApiKind::ChatCompletions, 100, 0);
        assert_eq!(
            o.predict("x", ApiKind::ChatCompletions, 100, None, 0.5),
            None
        );
    }

    #[test]
    fn buckets_separate_prompt_lengths_and_borrow_when_thin() {
        let mut o = OutputLengths::new();
        // Short prompts answer with ~50 tokens, long ones with ~800.
        for i in 0..200u64 {
            o.observe("m", ApiKind::ChatCompletions, 100 + i, 50);
            o.observe("m", ApiKind::ChatCompletions, 20_000 + i, 800);
        }
        let short = o
            .predict("m", ApiKind::ChatCompletions, 120, None, 0.5)
            .unwrap_or(0);
        let long = o
            .predict("m", ApiKind::ChatCompletions, 25_000, None, 0.5)
            .unwrap_or(0);
        assert!((45..=54).contains(&short), "{short}");
        assert!((740..=880).contains(&long), "{long}");
        // A prompt length never seen borrows the all-prompt histogram: half 50, half 800 (the
        // 800s slightly more recent, so heavier), so its median is the lower edge of the
        // 800-token bin, 2^9.5 = 724.
        let mid = o
            .predict("m", ApiKind::ChatCompletions, 3_000, None, 0.5)
            .unwrap_or(0);
        assert_eq!(mid, 724);
        // Capped by max_tokens.
        assert_eq!(
            o.predict("m", ApiKind::ChatCompletions, 25_000, Some(100), 0.5),
            Some(100)
        );
        assert_eq!(
            o.predict("m", ApiKind::ChatCompletions, 25_000, Some(0), 0.5),
            Some(1)
        );
    }

    #[test]
    fn follows_a_changing_workload() {
        let mut o = OutputLengths::new();
        for _ in 0..2_000 {
            o.observe("m", ApiKind::ChatCompletions, 500, 1_000);
        }
        for _ in 0..3_000 {
            o.observe("m", ApiKind::ChatCompletions, 500, 100);
        }
        // After 3 000 observations at OUTPUT_FORGET 0.999 the old mass is e^-3 ≈ 5 %.
        let p50 = o
            .predict("m", ApiKind::ChatCompletions, 500, None, 0.5)
            .unwrap_or(0);
        assert!((90..=110).contains(&p50), "{p50}");
    }
}
