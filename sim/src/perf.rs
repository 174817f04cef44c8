//! Step-time model and KV-pool sizing for a simulated GPU replica.
//!
//! ## Step time
//! One engine step runs one forward pass over a batch that mixes prefill chunks and decode
//! sequences (vLLM V1 continuous batching with chunked prefill). Following Vidur (Agrawal et
//! al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024), the step
//! time is a sum of operator costs: token-linear work (the dense layers), attention work that
//! grows with context, and a fixed per-step cost. Each term is a roofline bound divided by a
//! utilisation factor fitted to published measurements:
//!
//! ```text
//! t = overhead_s                                             scheduler, sampling, launches, TP all-reduces
//!   + weight_read_s                                          stream the weights once (memory-bound)
//!   + (P + D) · dense_s_per_token                            dense-layer FLOPs (compute-bound)
//!   + attn_s_per_pair · Σ_prefill pairs                      prefill attention (compute-bound)
//!   + kv_read_s_per_token · Σ_decode context tokens          decode attention (KV reads, memory-bound)
//! ```
//! where `P` is prefill tokens and `D` decode sequences in the step, and a prefill chunk of
//! `c` new tokens after `k` computed ones has `c·k + c(c+1)/2` causal (query, key) pairs.
//! The terms add rather than overlap (`max`): measured vLLM inter-token latency on an H100
//! grows linearly with the batch from batch 8 on (66–86 µs per added sequence for
//! Llama-3.1-8B, ML.ENERGY data below), with no flat memory-bound stretch, and the additive
//! form reproduces it within 4 % where a `max(weights, tokens)` roofline misses by up to 16 %.
//!
//! Coefficients come from the GPU datasheet and the model's `config.json` via
//! [`StepTimeModel::roofline`], with utilisations from [`Efficiencies`]:
//! - `weight_read_s = weight_bytes / (gpus · mem_bw · mbu_weights)`
//! - `dense_s_per_token = 2 · params / (gpus · bf16_flops · mfu)` (2 FLOPs per parameter per token)
//! - `attn_s_per_pair = 4 · layers · q_heads · head_dim / (gpus · bf16_flops · mfu)`
//!   (QKᵀ and AV, 2 FLOPs each per multiply-add)
//! - `kv_read_s_per_token = kv_bytes_per_token / (gpus · mem_bw · mbu_kv)`
//!
//! ## Calibration
//! The [`Efficiencies`] of each shipped profile are fitted (least squares on log error, grid
//! search) to published measurements of vLLM on H100s; each constant's doc lists its sources
//! and the test `sim/tests/sim_perf_calibration.rs` checks every measurement:
//! - **Decode/mixed steps**: ML.ENERGY Leaderboard v3 (ML.ENERGY Benchmark 3.0, vLLM 0.11.1,
//!   BF16, `lm-arena-chat` task), median ITL per `max_num_seqs` configuration,
//!   <https://ml.energy/leaderboard>, data files
//!   `public/data/models/meta-llama__Llama-3.1-8B-Instruct__lm-arena-chat.json` and
//!   `public/data/models/Qwen__Qwen3-32B__lm-arena-chat.json` in
//!   <https://github.com/ml-energy/leaderboard>. A median ITL is one engine step of a steady
//!   state with `B` running sequences, `B / avg_output_len` new requests prefilled per step
//!   and each running sequence `avg_input_len + f · avg_output_len` tokens long (`f` from the
//!   published output-length histogram; see the test).
//! - **Prefill**: LambdaLabsML/vllm-benchmark
//!   `results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json` (vLLM
//!   0.6.0, 2024-09-07; Llama-3-8B has Llama-3.1-8B's shapes) and GPUStack's
//!   "Optimizing Qwen3-32B Throughput on NVIDIA H100 GPUs"
//!   (<https://github.com/gpustack/gpustack/blob/main/docs/performance-lab/qwen3-32b/h100.md>,
//!   vLLM 0.11.0, "random 32K input" baseline run, one H100). No published Qwen3-32B
//!   prefill measurement on 2×H100 was found; the TP=2 profile shares the per-GPU compute
//!   efficiency fitted jointly with the 1×H100 data.
//!
//! What the fit absorbs: CUDA-graph padding, sampling, kernel-launch gaps and, for the
//! prefill anchor, the API server's request handling; what it cannot: per-kernel efficiency
//! curves (a real GPU runs small prefills at a lower MFU than large ones). Residuals are
//! within ±9 % for decode steps and ±15 % for prefill on the cited data.
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

/// vLLM's default `gpu_memory_utilization` (vllm/config CacheConfig).
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// Fitted utilisation factors of one GPU/model/parallelism setup (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Efficiencies {
    /// Fraction of peak memory bandwidth reached streaming the weights (0..1).
    pub mbu_weights: f64,
    /// Fraction of peak memory bandwidth reached reading decode KV (0..1).
    pub mbu_kv: f64,
    /// Fraction of peak BF16 FLOPS reached by dense layers and prefill attention (0..1).
    pub mfu: f64,
    /// Fixed cost per step in seconds (scheduler, sampling, launch gaps, TP all-reduces).
    pub overhead_s: f64,
}

/// Llama-3.1-8B on 1×H100, fitted to 12 measurements (residuals −3.2 %…+3.5 %):
/// - ML.ENERGY Leaderboard v3, vLLM 0.11.1, 1×H100, `lm-arena-chat`, median ITL (ms) at
///   average batch 8.0/16.0/31.9/63.9/95.7/127.6/191.7/255.2/383.0/510.9/690.9:
///   7.32/7.91/8.91/11.50/14.08/16.48/20.91/26.13/37.70/47.41/62.93
///   (<https://github.com/ml-energy/leaderboard>,
///   `public/data/models/meta-llama__Llama-3.1-8B-Instruct__lm-arena-chat.json`);
/// - LambdaLabsML/vllm-benchmark, vLLM 0.6.0, Meta-Llama-3-8B-Instruct on 1×H100 SXM: 10
///   prompts (1,369 tokens) prefilled in one step, mean TTFT 62.43 ms
///   (`results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json`).
///
/// Steady-state shapes assume 150 input tokens per request (the leaderboard does not publish
/// input lengths; LMSYS-Chat-1M prompts average 69.5 tokens, Zheng et al. 2023, Table 1,
/// plus chat template and multi-turn history). With 100 input tokens the best fit is
/// 0.78/0.70/0.40/0.4 ms, also within ±4 %.
pub const LLAMA_8B_H100_FIT: Efficiencies = Efficiencies {
    mbu_weights: 0.86,
    mbu_kv: 0.95,
    mfu: 0.40,
    overhead_s: 1.0e-3,
};

/// Qwen3-32B on 2×H100 (tensor parallel), fitted jointly with [`QWEN3_32B_H100_TP1_FIT`]
/// (shared `mbu_*` and `mfu`, one overhead per parallelism) to 13 measurements (residuals
/// −4.0 %…+8.3 % on decode steps, −13.9 % on the prefill midpoint, inside its interval):
/// - ML.ENERGY Leaderboard v3, vLLM 0.11.1, 2×H100, `lm-arena-chat`, median ITL (ms) at
///   average batch 8.0/16.0/31.9/63.9/95.8/127.8/191.7/255.6/340.2:
///   15.06/16.04/17.91/22.45/26.10/29.66/37.02/44.45/54.90, and on 1×H100 at 8.0/16.0/29.3:
///   25.21/26.35/28.81 (`public/data/models/Qwen__Qwen3-32B__lm-arena-chat.json`; the
///   benchmark's `configs/vllm/lm-arena-chat/Qwen/Qwen3-32B/H100/sweeps.yaml` runs
///   `num_gpus` 1 and 2);
/// - GPUStack performance lab, vLLM 0.11.0, `vllm serve Qwen/Qwen3-32B` on one H100, 100
///   requests of 32,000 input / ≤100 output tokens: 1,157.25 s, 7,681 output tokens, mean
///   TPOT 43.42 ms, so one 32k-token prefill takes between 11.57 s − 76.8 · 43.42 ms = 8.24 s
///   (decode never overlapped) and 11.57 s (fully overlapped); fitted to the midpoint 9.9 s.
///
/// Same 150-input-token assumption as [`LLAMA_8B_H100_FIT`].
pub const QWEN3_32B_H100_TP2_FIT: Efficiencies = Efficiencies {
    mbu_weights: 0.90,
    mbu_kv: 1.0,
    mfu: 0.38,
    overhead_s: 2.5e-3,
};

/// Qwen3-32B on 1×H100: the same fit as [`QWEN3_32B_H100_TP2_FIT`] with the one-GPU
/// overhead (no all-reduces). Not a shipped profile (the weights leave ~6.5 GB for KV);
/// used to check the shared efficiencies against the 1×H100 measurements.
pub const QWEN3_32B_H100_TP1_FIT: Efficiencies = Efficiencies {
    overhead_s: 0.5e-3,
    ..QWEN3_32B_H100_TP2_FIT
};

/// Coefficients of the step-time formula (see the module doc). All in seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepTimeModel {
    /// Fixed per-step cost (seconds).
    pub overhead_s: f64,
    /// Time to stream the weights once (seconds).
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

/// Architecture numbers of a dense decoder-only model (BF16 weights and KV).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DenseModel {
    /// Parameter count.
    pub params: f64,
    /// Weight bytes (BF16: 2 per parameter).
    pub weight_bytes: u64,
    /// Transformer layers.
    pub layers: u32,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads (GQA).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
}

impl DenseModel {
    /// Attention FLOPs per causal (query, key) pair: `4 · layers · q_heads · head_dim`.
    pub fn attn_flops_per_pair(&self) -> f64 {
        4.0 * f64::from(self.layers) * f64::from(self.q_heads) * f64::from(self.head_dim)
    }

    /// KV bytes per token, BF16: `2 (K and V) · layers · kv_heads · head_dim · 2 bytes`.
    pub fn kv_bytes_per_token(&self) -> u64 {
        4 * u64::from(self.layers) * u64::from(self.kv_heads) * u64::from(self.head_dim)
    }
}

/// Llama-3.1-8B: 8.03 B parameters, 32 layers, 32 query heads × 128 head_dim, 8 KV heads,
/// BF16 weights 16.06 GB. Source: huggingface.co/meta-llama/Llama-3.1-8B-Instruct
/// (config.json, model card).
pub const LLAMA_3_1_8B: DenseModel = DenseModel {
    params: 8.03e9,
    weight_bytes: 16_060_000_000,
    layers: 32,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
};

/// Qwen3-32B: 32.8 B parameters, 64 layers, 64 query heads × 128 head_dim, 8 KV heads,
/// BF16 weights 65.5 GB. Source: huggingface.co/Qwen/Qwen3-32B (config.json, model card).
pub const QWEN3_32B: DenseModel = DenseModel {
    params: 32.8e9,
    weight_bytes: 65_500_000_000,
    layers: 64,
    q_heads: 64,
    kv_heads: 8,
    head_dim: 128,
};

impl StepTimeModel {
    /// Coefficients for `model` served on `gpus` GPUs of `gpu` with tensor parallelism, at
    /// the utilisations `eff` (formulas in the module doc).
    pub fn roofline(gpu: &GpuSpec, gpus: u32, model: &DenseModel, eff: &Efficiencies) -> Self {
        let g = f64::from(gpus.max(1));
        let bw = g * gpu.mem_bw_bytes_per_s;
        let flops = g * gpu.bf16_flops * eff.mfu;
        Self {
            overhead_s: eff.overhead_s,
            weight_read_s: model.weight_bytes as f64 / (bw * eff.mbu_weights),
            dense_s_per_token: 2.0 * model.params / flops,
            attn_s_per_pair: model.attn_flops_per_pair() / flops,
            kv_read_s_per_token: model.kv_bytes_per_token() as f64 / (bw * eff.mbu_kv),
        }
    }

    /// Duration of one step with the given batch, in seconds (0 for an empty batch).
    pub fn step_time(&self, b: &BatchShape) -> f64 {
        let tokens = b.prefill_tokens + b.decode_seqs;
        if tokens == 0 {
            return 0.0;
        }
        self.overhead_s
            + self.weight_read_s
            + tokens as f64 * self.dense_s_per_token
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

/// The shipped profiles: Llama-3.1-8B on 1×H100 and Qwen3-32B on 2×H100 (TP=2).
pub fn perf_profiles() -> Vec<PerfProfile> {
    vec![
        PerfProfile {
            id: "h100-llama-3.1-8b",
            gpu: H100_SXM,
            gpus: 1,
            step: StepTimeModel::roofline(&H100_SXM, 1, &LLAMA_3_1_8B, &LLAMA_8B_H100_FIT),
            source: "H100 datasheet + Llama-3.1-8B config.json; efficiencies fitted to ML.ENERGY v3 (vLLM 0.11.1) ITLs and LambdaLabs vllm-benchmark TTFT",
        },
        PerfProfile {
            id: "h100x2-qwen3-32b",
            gpu: H100_SXM,
            gpus: 2,
            step: StepTimeModel::roofline(&H100_SXM, 2, &QWEN3_32B, &QWEN3_32B_H100_TP2_FIT),
            source: "H100 datasheet + Qwen3-32B config.json, TP=2; efficiencies fitted to ML.ENERGY v3 (vLLM 0.11.1) ITLs and GPUStack 32k-prefill run",
        },
    ]
}

/// Look up a shipped profile by id.
pub fn perf_profile(id: &str) -> Option<PerfProfile> {
    perf_profiles().into_iter().find(|p| p.id == id)
}

/// The profile for a served model: the shipped one whose model matches `model.name`
/// (Llama-3.1-8B → `h100-llama-3.1-8b`, Qwen3-32B → `h100x2-qwen3-32b`), otherwise an H100
/// model built from the model's own weights (params = weight_bytes / 2 for BF16; query heads
/// assumed 4 × KV heads, the Llama-3 GQA ratio) on 1 GPU (2 above 60 GB of weights, 4 above
/// 120 GB), with the Llama-3.1-8B fit on one GPU and the Qwen3-32B TP=2 fit on several.
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
    let gpus = if model.weight_bytes > 120_000_000_000 {
        4
    } else if model.weight_bytes > 60_000_000_000 {
        2
    } else {
        1
    };
    let dense = DenseModel {
        params: model.weight_bytes as f64 / 2.0,
        weight_bytes: model.weight_bytes,
        layers: model.num_layers,
        q_heads: model.num_kv_heads.saturating_mul(4),
        kv_heads: model.num_kv_heads,
        head_dim: model.head_dim,
    };
    let eff = if gpus > 1 {
        QWEN3_32B_H100_TP2_FIT
    } else {
        LLAMA_8B_H100_FIT
    };
    let mut step = StepTimeModel::roofline(&H100_SXM, gpus, &dense, &eff);
    // The profile's own KV layout (its dtype may differ from BF16).
    step.kv_read_s_per_token = model.kv_bytes_per_token() as f64
        / (f64::from(gpus) * H100_SXM.mem_bw_bytes_per_s * eff.mbu_kv);
    PerfProfile {
        id: "h100-generic",
        gpu: H100_SXM,
        gpus,
        step,
        source: "H100 datasheet + the model profile (params = weight_bytes/2); Llama-3.1-8B (1 GPU) or Qwen3-32B TP=2 (several) fitted efficiencies",
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
            weight_bytes: LLAMA_3_1_8B.weight_bytes,
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
        // Coefficients from the datasheet, config.json and LLAMA_8B_H100_FIT, by hand:
        // 16.06e9 / (3.35e12 · 0.86) = 5.5745 ms; 2 · 8.03e9 / (989.4e12 · 0.40) = 40.580 µs;
        // 524288 / 395.76e12 = 1.3248 ns; 131072 / (3.35e12 · 0.95) = 41.185 ns.
        assert!((p.step.weight_read_s - 5.5745e-3).abs() < 1e-7);
        assert!((p.step.dense_s_per_token - 40.580e-6).abs() < 1e-9);
        assert!((p.step.attn_s_per_pair - 1.3248e-9).abs() < 1e-13);
        assert!((p.step.kv_read_s_per_token - 41.185e-9).abs() < 1e-12);
        // batch-1 decode with 1000 context tokens: 1 + 5.5745 + 0.0406 + 0.0412 ms
        let t = p.step.step_time(&BatchShape {
            decode_seqs: 1,
            decode_context_tokens: 1000,
            ..Default::default()
        });
        assert!((t - 0.006_656_2).abs() < 1e-7, "{t}");
        // 1000-token prefill: 1 + 5.5745 + 1000 · 0.040580 + 500500 · 1.3248e-6 ms
        let t = p.step.step_time(&BatchShape {
            prefill_tokens: 1000,
            prefill_pairs: 500_500,
            ..Default::default()
        });
        assert!((t - 0.047_817_6).abs() < 1e-7, "{t}");
        assert_eq!(p.step.step_time(&BatchShape::default()), 0.0);
    }

    #[test]
    fn dense_model_shapes() {
        assert_eq!(LLAMA_3_1_8B.kv_bytes_per_token(), 131_072);
        assert_eq!(QWEN3_32B.kv_bytes_per_token(), 262_144);
        assert_eq!(
            llama8b().kv_bytes_per_token(),
            LLAMA_3_1_8B.kv_bytes_per_token()
        );
        assert_eq!(LLAMA_3_1_8B.attn_flops_per_pair(), 524_288.0);
    }
}
