//! Step-time model and KV-pool sizing for a simulated GPU replica.
//!
//! ## Step time
//! One engine step runs one forward pass over a batch that mixes prefill chunks and decode
//! sequences (vLLM V1 continuous batching with chunked prefill). Following Vidur (Agrawal et
//! al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024), the step
//! time is split into token-linear work (the dense layers), attention work that grows with
//! context, and a fixed per-step overhead. We use a roofline form of that split:
//!
//! ```text
//! t = overhead_s
//!   + max(weight_read_s, (P + D) · dense_s_per_token)       dense layers: memory- or compute-bound
//!   + attn_s_per_pair · Σ_prefill pairs                       prefill attention (compute-bound)
//!   + kv_read_s_per_token · Σ_decode context tokens           decode attention (KV reads, memory-bound)
//! ```
//! where `P` is prefill tokens and `D` decode sequences in the step, and a prefill chunk of
//! `c` new tokens after `k` computed ones has `c·k + c(c+1)/2` causal (query, key) pairs.
//!
//! Coefficients come from the GPU datasheet and the model's `config.json` via
//! [`StepTimeModel::roofline`]:
//! - `weight_read_s = weight_bytes / (gpus · mem_bw · MBU)`
//! - `dense_s_per_token = 2 · params / (gpus · bf16_flops · MFU)` (2 FLOPs per parameter per token)
//! - `attn_s_per_pair = 4 · layers · q_heads · head_dim / (gpus · bf16_flops · MFU)`
//!   (QKᵀ and AV, 2 FLOPs each per multiply-add)
//! - `kv_read_s_per_token = kv_bytes_per_token / (gpus · mem_bw · MBU)`
//!
//! Efficiencies: MBU 0.8 and MFU 0.5, and a 1 ms per-step overhead (scheduler, sampling,
//! kernel launches; 2 ms with tensor parallelism for the all-reduces). With these, Llama-3.1-8B
//! on one H100 has a 7.0 ms batch-1 TPOT and a 1,000-token prompt prefills in 34 ms.
//! **These efficiencies are assumptions, not a fit to measurements**: the datasheet numbers and
//! `config.json` shapes are published facts, the utilisation factors are typical values, and
//! published vLLM H100 reports (vLLM v0.6.0 performance blog, Sep 2024,
//! <https://blog.vllm.ai/2024/09/05/perf-update.html>; LambdaLabsML/vllm-benchmark) were only
//! used as a plausibility check. Calibrate against a real replica before quoting absolute
//! latencies.
//!
//! ## KV pool size
//! `num_gpu_blocks = ⌊(gpus · hbm_bytes · gpu_memory_utilization − weight_bytes) /
//! (kv_bytes_per_token · block_size)⌋` — vLLM's sizing (vllm/v1/worker/gpu_worker.py
//! `determine_available_memory`) without the activation-peak term, with vLLM's default
//! `gpu_memory_utilization` 0.9 and the issue's 80 GB per H100.

use kvroute_core::profile::ModelProfile;

/// A GPU model's datasheet numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    /// Marketing name.
    pub name: &'static str,
    /// Device memory in bytes.
    pub hbm_bytes: u64,
    /// Peak memory bandwidth in bytes per second.
    pub mem_bw_bytes_per_s: f64,
    /// Peak dense BF16 tensor-core throughput in FLOP per second.
    pub bf16_flops: f64,
}

/// NVIDIA H100 SXM5 80 GB: 3.35 TB/s HBM3, 989.4 dense BF16 TFLOPS (1,979 with sparsity).
/// Source: NVIDIA H100 Tensor Core GPU datasheet,
/// <https://www.nvidia.com/en-us/data-center/h100/>.
pub const H100_SXM: GpuSpec = GpuSpec {
    name: "H100-SXM-80GB",
    hbm_bytes: 80_000_000_000,
    mem_bw_bytes_per_s: 3.35e12,
    bf16_flops: 989.4e12,
};

/// Memory-bandwidth utilisation assumed for weight and KV reads (0..1).
pub const DEFAULT_MBU: f64 = 0.8;
/// Model-FLOPs utilisation assumed for prefill and large batches (0..1).
pub const DEFAULT_MFU: f64 = 0.5;
/// vLLM's default `gpu_memory_utilization` (vllm/config CacheConfig).
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// Coefficients of the step-time formula (see the module doc). All in seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepTimeModel {
    /// Fixed per-step cost (seconds).
    pub overhead_s: f64,
    /// Time to stream the weights once (seconds): the memory-bound floor of a step.
    pub weight_read_s: f64,
    /// Dense-layer compute per batched token (seconds per token).
    pub dense_s_per_token: f64,
    /// Prefill attention per causal (query, key) pair (seconds per pair).
    pub attn_s_per_pair: f64,
    /// Decode attention per context token read (seconds per token).
    pub kv_read_s_per_token: f64,
}

/// What one engine step does, as input to [`StepTimeModel::step_time`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Prefill tokens computed in the step (sum of chunk lengths).
    pub prefill_tokens: u64,
    /// Causal (query, key) pairs of the prefill chunks.
    pub prefill_pairs: u64,
    /// Decode sequences in the step (one token each).
    pub decode_seqs: u64,
    /// Context tokens read by the decode sequences.
    pub decode_context_tokens: u64,
}

impl StepTimeModel {
    /// Roofline coefficients for a model of `params` parameters and `weight_bytes` weights
    /// served on `gpus` GPUs of `gpu` with tensor parallelism. `attn_flops_per_pair` =
    /// 4 · layers · q_heads · head_dim; `kv_bytes_per_token` from
    /// [`ModelProfile::kv_bytes_per_token`].
    pub fn roofline(
        gpu: &GpuSpec,
        gpus: u32,
        params: f64,
        weight_bytes: u64,
        attn_flops_per_pair: f64,
        kv_bytes_per_token: u64,
    ) -> Self {
        let g = f64::from(gpus.max(1));
        let bw = g * gpu.mem_bw_bytes_per_s * DEFAULT_MBU;
        let flops = g * gpu.bf16_flops * DEFAULT_MFU;
        Self {
            overhead_s: if gpus > 1 { 2e-3 } else { 1e-3 },
            weight_read_s: weight_bytes as f64 / bw,
            dense_s_per_token: 2.0 * params / flops,
            attn_s_per_pair: attn_flops_per_pair / flops,
            kv_read_s_per_token: kv_bytes_per_token as f64 / bw,
        }
    }

    /// Duration of one step with the given batch, in seconds (0 for an empty batch).
    pub fn step_time(&self, b: &BatchShape) -> f64 {
        let tokens = b.prefill_tokens + b.decode_seqs;
        if tokens == 0 {
            return 0.0;
        }
        self.overhead_s
            + self
                .weight_read_s
                .max(tokens as f64 * self.dense_s_per_token)
            + self.attn_s_per_pair * b.prefill_pairs as f64
            + self.kv_read_s_per_token * b.decode_context_tokens as f64
    }
}

/// A shipped GPU/model pairing with its step-time coefficients.
#[derive(Debug, Clone, PartialEq)]
pub struct PerfProfile {
    /// Profile id used on the command line, e.g. `h100-llama-3.1-8b`.
    pub id: &'static str,
    /// GPU type.
    pub gpu: GpuSpec,
    /// GPUs per replica (tensor parallelism).
    pub gpus: u32,
    /// Step-time coefficients.
    pub step: StepTimeModel,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// Llama-3.1-8B: 8.03 B parameters, 32 layers, 32 query heads × 128 head_dim, 8 KV heads,
/// BF16 weights 16.06 GB. Source: huggingface.co/meta-llama/Llama-3.1-8B-Instruct
/// (config.json, model card).
const LLAMA_8B_PARAMS: f64 = 8.03e9;
const LLAMA_8B_WEIGHT_BYTES: u64 = 16_060_000_000;
const LLAMA_8B_ATTN_FLOPS_PER_PAIR: f64 = 4.0 * 32.0 * 32.0 * 128.0;
/// Qwen3-32B: 32.8 B parameters, 64 layers, 64 query heads × 128 head_dim, 8 KV heads,
/// BF16 weights 65.5 GB. Source: huggingface.co/Qwen/Qwen3-32B (config.json, model card).
const QWEN3_32B_PARAMS: f64 = 32.8e9;
const QWEN3_32B_WEIGHT_BYTES: u64 = 65_500_000_000;
const QWEN3_32B_ATTN_FLOPS_PER_PAIR: f64 = 4.0 * 64.0 * 64.0 * 128.0;

/// Bytes per KV token of a model with `layers` layers, `kv_heads` KV heads of `head_dim`, BF16.
const fn kv_bf16(layers: u64, kv_heads: u64, head_dim: u64) -> u64 {
    2 * layers * kv_heads * head_dim * 2
}

/// The shipped profiles: Llama-3.1-8B on 1×H100 and Qwen3-32B on 2×H100 (TP=2).
pub fn perf_profiles() -> Vec<PerfProfile> {
    vec![
        PerfProfile {
            id: "h100-llama-3.1-8b",
            gpu: H100_SXM,
            gpus: 1,
            step: StepTimeModel::roofline(
                &H100_SXM,
                1,
                LLAMA_8B_PARAMS,
                LLAMA_8B_WEIGHT_BYTES,
                LLAMA_8B_ATTN_FLOPS_PER_PAIR,
                kv_bf16(32, 8, 128),
            ),
            source: "roofline over NVIDIA H100 datasheet + Llama-3.1-8B config.json; MBU 0.8, MFU 0.5",
        },
        PerfProfile {
            id: "h100x2-qwen3-32b",
            gpu: H100_SXM,
            gpus: 2,
            step: StepTimeModel::roofline(
                &H100_SXM,
                2,
                QWEN3_32B_PARAMS,
                QWEN3_32B_WEIGHT_BYTES,
                QWEN3_32B_ATTN_FLOPS_PER_PAIR,
                kv_bf16(64, 8, 128),
            ),
            source: "roofline over NVIDIA H100 datasheet + Qwen3-32B config.json, TP=2; MBU 0.8, MFU 0.5",
        },
    ]
}

/// Look up a shipped profile by id.
pub fn perf_profile(id: &str) -> Option<PerfProfile> {
    perf_profiles().into_iter().find(|p| p.id == id)
}

/// The profile for a served model: the shipped one whose model matches `model.name`
/// (Llama-3.1-8B → `h100-llama-3.1-8b`, Qwen3-32B → `h100x2-qwen3-32b`), otherwise a
/// 1×H100 roofline built from the model's own weights (params = weight_bytes / 2 for BF16;
/// query heads assumed 4 × KV heads, the Llama-3 GQA ratio).
pub fn perf_profile_for(model: &ModelProfile) -> PerfProfile {
    let lower = model.name.to_ascii_lowercase();
    let id = if lower.contains("llama-3.1-8b") {
        Some("h100-llama-3.1-8b")
    } else if lower.contains("qwen3-32b") {
        Some("h100x2-qwen3-32b")
    } else {
        None
    };
    if let Some(p) = id.and_then(perf_profile) {
        return p;
    }
    let attn = 4.0
        * f64::from(model.num_layers)
        * 4.0
        * f64::from(model.num_kv_heads)
        * f64::from(model.head_dim);
    let gpus = if model.weight_bytes > 60_000_000_000 {
        2
    } else {
        1
    };
    let gpus = if model.weight_bytes > 120_000_000_000 {
        4
    } else {
        gpus
    };
    PerfProfile {
        id: "h100-generic",
        gpu: H100_SXM,
        gpus,
        step: StepTimeModel::roofline(
            &H100_SXM,
            gpus,
            model.weight_bytes as f64 / 2.0,
            model.weight_bytes,
            attn,
            model.kv_bytes_per_token(),
        ),
        source: "roofline over NVIDIA H100 datasheet + the model profile (params = weight_bytes/2)",
    }
}

/// Sizing failed: the weights leave no room for a single KV block.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("no KV cache room: {available_bytes} bytes available for weights of {weight_bytes} bytes (block needs {block_bytes} bytes)")]
pub struct NoKvRoom {
    /// `gpus · hbm · utilization` in bytes.
    pub available_bytes: u64,
    /// Model weights in bytes.
    pub weight_bytes: u64,
    /// Bytes per KV block.
    pub block_bytes: u64,
}

/// KV blocks that fit on `gpus` × `gpu` at `utilization` (0..1) after the weights (see the
/// module doc for the formula). Errors with [`NoKvRoom`] when not even one block fits.
pub fn num_gpu_blocks(
    gpu: &GpuSpec,
    gpus: u32,
    utilization: f64,
    model: &ModelProfile,
) -> Result<u32, NoKvRoom> {
    let available = (gpu.hbm_bytes as f64 * f64::from(gpus) * utilization.clamp(0.0, 1.0)) as u64;
    let block_bytes = model.kv_bytes_per_token() * u64::from(model.block_size);
    let err = NoKvRoom {
        available_bytes: available,
        weight_bytes: model.weight_bytes,
        block_bytes,
    };
    let room = available
        .checked_sub(model.weight_bytes)
        .ok_or(err.clone())?;
    let blocks = room.checked_div(block_bytes).ok_or(err.clone())?;
    if blocks == 0 {
        return Err(err);
    }
    Ok(u32::try_from(blocks).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn llama8b() -> ModelProfile {
        ModelProfile {
            name: "meta-llama/Llama-3.1-8B-Instruct".into(),
            num_layers: 32,
            num_kv_heads: 8,
            head_dim: 128,
            kv_dtype_bytes: 2,
            block_size: 16,
            weight_bytes: LLAMA_8B_WEIGHT_BYTES,
            max_model_len: 131_072,
            default_max_tokens: 1024,
            expected_output_fraction: 0.5,
            source: "test".into(),
        }
    }

    #[test]
    fn llama_blocks_on_one_h100() {
        // (80e9·0.9 − 16.06e9) / (131072 · 16) = 55.94e9 / 2097152 = 26674.3
        assert_eq!(num_gpu_blocks(&H100_SXM, 1, 0.9, &llama8b()), Ok(26_674));
    }

    #[test]
    fn no_room_is_an_error() {
        let mut m = llama8b();
        m.weight_bytes = 100_000_000_000;
        assert!(num_gpu_blocks(&H100_SXM, 1, 0.9, &m).is_err());
    }

    #[test]
    fn llama_step_times_match_anchors() {
        let p = perf_profile_for(&llama8b());
        assert_eq!(p.id, "h100-llama-3.1-8b");
        // batch-1 decode with 1000 context tokens: 1 ms + 5.99 ms + 0.049 ms
        let t = p.step.step_time(&BatchShape {
            decode_seqs: 1,
            decode_context_tokens: 1000,
            ..Default::default()
        });
        assert!((t - 0.007_042).abs() < 1e-5, "{t}");
        // 1000-token prefill: 1 ms + 32.46 ms + 500500 pairs · 1.06 ns
        let t = p.step.step_time(&BatchShape {
            prefill_tokens: 1000,
            prefill_pairs: 500_500,
            ..Default::default()
        });
        assert!((t - 0.034_0).abs() < 5e-4, "{t}");
        assert_eq!(p.step.step_time(&BatchShape::default()), 0.0);
    }
}
