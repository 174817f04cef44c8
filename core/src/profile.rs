//! Model profiles and KV-cache demand.
//!
//! ## KV bytes per token
//! Every decoder layer stores one key and one value vector per KV head per token, so
//! `bytes/token = 2 × num_layers × num_kv_heads × head_dim × kv_dtype_bytes`. With grouped-query
//! attention (GQA, Ainslie et al. 2023, arXiv:2305.13245) `num_kv_heads` is smaller than the
//! number of attention heads, which is why Llama-3.1-8B needs 128 KiB/token, not 512 KiB.
//! This is the same formula vLLM uses to size its paged KV cache
//! (`vllm/v1/kv_cache_interface.py`, `AttentionSpec.page_size_bytes`).
//!
//! ## Demand of one request
//! * prompt tokens `P` (from [`crate::analysis`]);
//! * output limit `L` = the request's explicit limit or [`ModelProfile::default_max_tokens`];
//! * expected output per choice `E = ⌈L × expected_output_fraction⌉`, capped so that
//!   `P + E ≤ max_model_len`;
//! * with `n > 1` choices, vLLM shares the prompt blocks across the sequences (prefix caching
//!   / forked sequences) but each choice decodes separately: expected output = `n × E`;
//! * `tokens = P + n × E`, `blocks = ⌈P/B⌉ + n × ⌈E/B⌉` for block size `B`,
//!   `bytes = tokens × bytes/token`.
//!
//! ## Built-in profiles
//! Architecture numbers are copied from each model's `config.json` on Hugging Face (URL in
//! [`ModelProfile::source`]); `weight_bytes` is the published parameter count × 2 bytes (bf16).
//! `default_max_tokens` (1024) and `expected_output_fraction` (0.5) are router assumptions, not
//! model facts. The resulting 512 expected output tokens sit near the 90th percentile of
//! generated tokens in the shared traces (`../shared/data/traces/`: Azure conversation trace,
//! Splitwise ISCA'24, p50 129 / p90 424; Mooncake conversation trace, FAST'25, p50 350 /
//! p90 597): a deliberately conservative KV reservation for requests that set no limit.

use crate::analysis::RequestAnalysis;

/// Architecture and serving facts about one model, enough to size its KV cache.
///
/// KV bytes per token = 2 (K and V) × `num_layers` × `num_kv_heads` × `head_dim` ×
/// `kv_dtype_bytes` (GQA-aware: KV heads, not attention heads).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// Served model name, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
    pub name: String,
    /// Transformer layers (`num_hidden_layers`).
    pub num_layers: u32,
    /// KV heads (`num_key_value_heads`).
    pub num_kv_heads: u32,
    /// Head dimension (`head_dim`, or `hidden_size / num_attention_heads`).
    pub head_dim: u32,
    /// Bytes per KV element (2 for fp16/bf16, 1 for fp8).
    pub kv_dtype_bytes: u32,
    /// KV cache block size in tokens (vLLM default 16).
    pub block_size: u32,
    /// Weight bytes in serving precision (used by the simulator to size the KV pool).
    pub weight_bytes: u64,
    /// Maximum context length in tokens (`max_position_embeddings` / `max_model_len`).
    pub max_model_len: u32,
    /// Output-token limit assumed when a request sets none.
    pub default_max_tokens: u32,
    /// Expected fraction (0..1) of the output limit a request actually generates.
    pub expected_output_fraction: f64,
    /// Where these numbers come from (model card / config.json URL).
    pub source: String,
}

/// KV-cache demand of one request on one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct KvDemand {
    /// Prompt tokens (prefill).
    pub prompt_tokens: u64,
    /// Expected generated tokens over all `n` choices.
    pub expected_output_tokens: u64,
    /// Total tokens of KV cache expected to be held.
    pub tokens: u64,
    /// `tokens` × KV bytes per token.
    pub bytes: u64,
    /// `tokens` rounded up to KV cache blocks.
    pub blocks: u64,
}

impl ModelProfile {
    /// KV cache bytes per token (see the type doc for the formula).
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.num_layers)
            * u64::from(self.num_kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.kv_dtype_bytes)
    }

    /// The output-token limit of a request: its explicit limit, else this profile's default.
    pub fn output_limit(&self, analysis: &RequestAnalysis) -> u32 {
        analysis
            .max_output_tokens
            .unwrap_or(self.default_max_tokens)
    }

    /// KV demand of a request on this model (see the module doc for the formula).
    /// Saturating arithmetic: never overflows or panics.
    pub fn demand(&self, analysis: &RequestAnalysis) -> KvDemand {
        self.demand_for(
            analysis.prompt_tokens,
            u64::from(self.output_limit(analysis)),
            analysis.n,
        )
    }

    /// KV demand from raw numbers: `prompt_tokens`, output limit in tokens, `n` choices
    /// (0 is treated as 1).
    pub fn demand_for(&self, prompt_tokens: u64, output_limit: u64, n: u32) -> KvDemand {
        let frac = if self.expected_output_fraction.is_finite() {
            self.expected_output_fraction.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let expected = (output_limit as f64 * frac).ceil();
        let per_choice = if expected.is_finite() && expected > 0.0 {
            expected as u64
        } else {
            0
        };
        self.demand_with_output(prompt_tokens, per_choice, n)
    }

    /// KV demand when the expected output per choice is known (e.g. learned from responses,
    /// [`crate::output_len::OutputLengths`]): `prompt_tokens` plus `per_choice` output tokens
    /// (capped at `max_model_len − prompt_tokens`) for each of `n` choices (0 counts as 1).
    pub fn demand_with_output(&self, prompt_tokens: u64, per_choice: u64, n: u32) -> KvDemand {
        let n = u64::from(n.max(1));
        let mut per_choice = per_choice;
        let room = u64::from(self.max_model_len).saturating_sub(prompt_tokens);
        if self.max_model_len > 0 {
            per_choice = per_choice.min(room);
        }
        let expected_output_tokens = per_choice.saturating_mul(n);
        let tokens = prompt_tokens.saturating_add(expected_output_tokens);
        let bs = u64::from(self.block_size.max(1));
        let blocks = prompt_tokens
            .div_ceil(bs)
            .saturating_add(per_choice.div_ceil(bs).saturating_mul(n));
        KvDemand {
            prompt_tokens,
            expected_output_tokens,
            tokens,
            bytes: tokens.saturating_mul(self.kv_bytes_per_token()),
            blocks,
        }
    }
}

/// Router assumption: output tokens when a request sets no limit (see the module doc).
pub const DEFAULT_MAX_TOKENS: u32 = 1024;
/// Router assumption: fraction of the output limit actually generated (see the module doc).
pub const DEFAULT_EXPECTED_OUTPUT_FRACTION: f64 = 0.5;
/// vLLM's default KV cache block size in tokens on CUDA (16; `--block-size`, vLLM engine
/// arguments docs).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

#[allow(clippy::too_many_arguments)]
fn profile(
    name: &str,
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    params: u64,
    max_model_len: u32,
    source: &str,
) -> ModelProfile {
    ModelProfile {
        name: name.to_string(),
        num_layers,
        num_kv_heads,
        head_dim,
        kv_dtype_bytes: 2,
        block_size: DEFAULT_BLOCK_SIZE,
        weight_bytes: params.saturating_mul(2),
        max_model_len,
        default_max_tokens: DEFAULT_MAX_TOKENS,
        expected_output_fraction: DEFAULT_EXPECTED_OUTPUT_FRACTION,
        source: source.to_string(),
    }
}

/// The built-in profiles (Llama-3.1-8B, Llama-3.1-70B, Qwen3-32B, Mistral-7B, SmolLM2-135M),
/// bf16 KV cache, block size 16.
///
/// | model | layers | KV heads | head dim | KV bytes/token | max len | params |
/// |---|---|---|---|---|---|---|
/// | Llama-3.1-8B-Instruct | 32 | 8 | 128 | 131,072 | 131,072 | 8.03 B |
/// | Llama-3.1-70B-Instruct | 80 | 8 | 128 | 327,680 | 131,072 | 70.6 B |
/// | Qwen3-32B | 64 | 8 | 128 | 262,144 | 40,960 | 32.8 B |
/// | Mistral-7B-Instruct-v0.3 | 32 | 8 | 128 | 131,072 | 32,768 | 7.25 B |
/// | SmolLM2-135M-Instruct | 30 | 3 | 64 | 23,040 | 8,192 | 134.5 M |
pub fn builtin_profiles() -> Vec<ModelProfile> {
    vec![
        profile(
            "meta-llama/Llama-3.1-8B-Instruct",
            32,
            8,
            128, // hidden_size 4096 / 32 attention heads
            8_030_261_248,
            131_072,
            "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json",
        ),
        profile(
            "meta-llama/Llama-3.1-70B-Instruct",
            80,
            8,
            128, // hidden_size 8192 / 64 attention heads
            70_553_706_496,
            131_072,
            "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json",
        ),
        profile(
            "Qwen/Qwen3-32B",
            64,
            8,
            128,            // explicit head_dim in config.json
            32_800_000_000, // "32.8B" on the model card
            40_960,
            "https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json",
        ),
        profile(
            "mistralai/Mistral-7B-Instruct-v0.3",
            32,
            8,
            128, // explicit head_dim in config.json
            7_248_023_552,
            32_768,
            "https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.3/blob/main/config.json",
        ),
        profile(
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            30,
            3,
            64, // hidden_size 576 / 9 attention heads
            134_515_008,
            8_192,
            "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json",
        ),
    ]
}

/// Known aliases of the built-in profiles' served names (`alias`, `canonical name`).
pub const ALIASES: &[(&str, &str)] = &[
    (
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
    ),
    (
        "meta-llama/Meta-Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.1-70B-Instruct",
    ),
    (
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
    ),
    (
        "meta-llama/Llama-3.1-70B",
        "meta-llama/Llama-3.1-70B-Instruct",
    ),
    (
        "mistralai/Mistral-7B-v0.3",
        "mistralai/Mistral-7B-Instruct-v0.3",
    ),
    (
        "HuggingFaceTB/SmolLM2-135M",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
];

/// Look up a built-in profile by served model name: exact, a known alias ([`ALIASES`]), or
/// the name without its `org/` prefix, compared case-insensitively.
pub fn builtin(name: &str) -> Option<ModelProfile> {
    let canonical = ALIASES
        .iter()
        .find(|(a, _)| a.eq_ignore_ascii_case(name))
        .map(|(_, c)| *c)
        .unwrap_or(name);
    let short = |s: &str| s.rsplit('/').next().unwrap_or(s).to_ascii_lowercase();
    let profiles = builtin_profiles();
    if let Some(p) = profiles
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(canonical))
    {
        return Some(p.clone());
    }
    let want = short(canonical);
    profiles.into_iter().find(|p| short(&p.name) == want)
}
