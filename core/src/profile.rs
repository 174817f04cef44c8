//! Model profiles and KV-cache demand.
//!
//! CONTRACT SKELETON (see `analysis.rs`).

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

    /// KV demand of a request on this model.
    pub fn demand(&self, analysis: &RequestAnalysis) -> KvDemand {
        let _ = analysis;
        KvDemand::default()
    }
}

/// The built-in profiles (Llama-3.1-8B, Llama-3.1-70B, Qwen3-32B, Mistral-7B, SmolLM2-135M).
pub fn builtin_profiles() -> Vec<ModelProfile> {
    Vec::new()
}

/// Look up a built-in profile by served model name (exact or known alias).
pub fn builtin(name: &str) -> Option<ModelProfile> {
    builtin_profiles().into_iter().find(|p| p.name == name)
}
