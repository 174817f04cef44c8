//! llm-d-inference-sim adapter.
//!
//! The simulator exports vLLM's names (`pkg/llm-d-inference-sim/metrics.go`), so this reads
//! them with [`super::vllm`]'s rules. Differences that matter: no `engine` label (one rank),
//! `cache_config_info` carries only `block_size` and `num_gpu_blocks`, and its KV usage is
//! simulated from its own block accounting. It is detected by its own
//! `vllm:max_num_generation_tokens` family.

use super::{AdapterError, ServerKind, ServerStats};
use crate::expo::Exposition;

/// The simulator-only histogram count used to tell it from vLLM.
pub const DETECT_COUNT: &str = "vllm:max_num_generation_tokens_count";

/// Extract llm-d-inference-sim stats.
pub fn extract(expo: &Exposition) -> Result<ServerStats, AdapterError> {
    super::vllm::extract_as(expo, ServerKind::LlmdSim)
}
