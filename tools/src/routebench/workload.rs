//! The three benchmark workloads, as [`TraceRow`]s (arrival ms, prompt tokens, output
//! tokens, 512-token prefix block ids).
//!
//! - **Mooncake** (`traces/mooncake_conversation_trace.jsonl`, kvcache-ai/Mooncake FAST'25):
//!   rows as recorded, `hash_ids` give real prefix structure ([`kvroute_sim::trace::load_mooncake`]).
//! - **Azure conv** (`traces/AzureLLMInferenceTrace_conv.csv`, Azure Public Dataset, Patel et
//!   al., "Splitwise", ISCA'24): `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`. The trace records **no prompt content or hashes**, so rows carry no
//!   prefix ids: no two requests are assumed to share a prefix, and every router's
//!   prefix-cache hit rate is 0 on it. It measures load balancing only.
//! - **ShareGPT multi-round** (`prompts/lmbenchmark_sharegpt_multiround_run.json`,
//!   LMCache/LMBenchmark): each entry is a cumulative conversation (every later round's
//!   input starts with an earlier round's input), so prefix reuse is real. Prompt tokens
//!   come from kvroute-core's token heuristic with every byte counted
//!   ([`Estimator::every_byte`], as the simulator's model server counts; the filter counts
//!   the first 2 KiB this way and samples the rest for speed, which is not what a trace's
//!   ground truth should carry: with the sampled count as the truth, the ShareGPT prompt
//!   lengths, and with them every router's ShareGPT cells, moved whenever the sampling
//!   did), output tokens from `output_length`. Prefix ids: xxh64 of each full
//!   [`SHAREGPT_BLOCK_CHARS`]-byte block of the input (2 048 bytes ≈ 512 tokens at the
//!   usual ~4 characters per token), so two inputs share block *k* exactly when their
//!   first (k+1)·2 048 bytes agree. Arrivals: a Poisson process (exponential gaps, seeded
//!   `fastrand`) at [`SHAREGPT_BASE_RATE`] request/s in file order, so a conversation's
//!   rounds arrive in order; the load sweep rescales the rate.
//!
//! Files are read by `kvroute_sim::trace` (one loader for all tools); this module turns its
//! records into rows. Every loader returns rows sorted by arrival with the first at 0 ms.

use std::path::Path;

use kvroute_core::estimate::Estimator;

use kvroute_sim::trace::{self, load_mooncake, TraceError, TraceRow};

/// Bytes per ShareGPT prefix block.
pub const SHAREGPT_BLOCK_CHARS: usize = 2048;
/// Poisson rate of the ShareGPT workload before load scaling (requests/s).
pub const SHAREGPT_BASE_RATE: f64 = 1.0;

/// Which trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceKind {
    /// Mooncake conversation trace.
    Mooncake,
    /// Azure LLM inference trace, conversation part.
    AzureConv,
    /// LMBenchmark ShareGPT multi-round (held out from tuning).
    SharegptMultiround,
}

impl TraceKind {
    /// All three, in report order.
    pub const ALL: [TraceKind; 3] = [
        TraceKind::Mooncake,
        TraceKind::AzureConv,
        TraceKind::SharegptMultiround,
    ];

    /// Short name (`mooncake`, `azure_conv`, `sharegpt_multiround`).
    pub fn name(self) -> &'static str {
        match self {
            TraceKind::Mooncake => "mooncake",
            TraceKind::AzureConv => "azure_conv",
            TraceKind::SharegptMultiround => "sharegpt_multiround",
        }
    }

    /// Path under the shared data directory.
    pub fn rel_path(self) -> &'static str {
        match self {
            TraceKind::Mooncake => "traces/mooncake_conversation_trace.jsonl",
            TraceKind::AzureConv => "traces/AzureLLMInferenceTrace_conv.csv",
            TraceKind::SharegptMultiround => "prompts/lmbenchmark_sharegpt_multiround_run.json",
        }
    }

    /// Load the whole trace from `data_dir` (`seed` drives the ShareGPT arrivals only).
    ///
    /// Errors: the file cannot be read or a row is malformed ([`TraceError`]).
    pub fn load(self, data_dir: &Path, seed: u64) -> Result<Vec<TraceRow>, TraceError> {
        let p = data_dir.join(self.rel_path());
        match self {
            TraceKind::Mooncake => Ok(normalise(load_mooncake(&p)?)),
            TraceKind::AzureConv => load_azure(&p),
            TraceKind::SharegptMultiround => load_sharegpt(&p, seed, SHAREGPT_BASE_RATE),
        }
    }
}

/// Sort by arrival (stable) and shift so the first row arrives at 0 ms.
pub fn normalise(mut rows: Vec<TraceRow>) -> Vec<TraceRow> {
    rows.sort_by_key(|r| r.timestamp);
    let t0 = rows.first().map_or(0, |r| r.timestamp);
    for r in &mut rows {
        r.timestamp -= t0;
    }
    rows
}

/// Load the Azure conv CSV (no prefix ids; see the module doc): the loader's seconds after
/// the first row, rounded to milliseconds.
///
/// Errors: [`TraceError`] for an unreadable file, a malformed row or `TIMESTAMP`.
pub fn load_azure(path: &Path) -> Result<Vec<TraceRow>, TraceError> {
    let rows = trace::load_azure(path)?
        .into_iter()
        .map(|r| TraceRow {
            timestamp: (r.t_s * 1000.0).round() as u64,
            input_length: r.input.unwrap_or(0),
            output_length: r.output,
            hash_ids: Vec::new(),
        })
        .collect();
    Ok(normalise(rows))
}

/// Prefix ids of `text`: xxh64 of each full [`SHAREGPT_BLOCK_CHARS`]-byte block.
pub fn text_block_ids(text: &str) -> Vec<u64> {
    text.as_bytes()
        .chunks_exact(SHAREGPT_BLOCK_CHARS)
        .map(|c| xxhash_rust::xxh64::xxh64(c, 0))
        .collect()
}

/// Load the LMBenchmark ShareGPT multi-round file with Poisson arrivals at `rate` req/s
/// (≤ 0 or non-finite → 1.0) drawn from `seed` (see the module doc): prompt tokens from
/// kvroute-core's token heuristic with every byte counted ([`Estimator::every_byte`]),
/// prefix ids from [`text_block_ids`].
///
/// Errors: [`TraceError`] for an unreadable or malformed file.
pub fn load_sharegpt(path: &Path, seed: u64, rate: f64) -> Result<Vec<TraceRow>, TraceError> {
    let est = Estimator::every_byte();
    Ok(trace::load_sharegpt(path, rate, seed)?
        .into_iter()
        .map(|r| {
            let text = r.text.unwrap_or_default();
            TraceRow {
                timestamp: (r.t_s * 1000.0) as u64,
                input_length: u32::try_from(est.estimate_text(&text))
                    .unwrap_or(u32::MAX)
                    .max(1),
                output_length: r.output.max(1),
                hash_ids: text_block_ids(&text),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_are_prefix_consistent() {
        let a = "x".repeat(SHAREGPT_BLOCK_CHARS * 2 + 10);
        let mut b = a.clone();
        b.push_str(&"y".repeat(SHAREGPT_BLOCK_CHARS));
        let ia = text_block_ids(&a);
        let ib = text_block_ids(&b);
        assert_eq!(ia.len(), 2);
        assert_eq!(ib.len(), 3);
        assert_eq!(ia[..], ib[..2]);
        assert!(text_block_ids("short").is_empty());
    }

    #[test]
    fn normalise_sorts_and_shifts() {
        let row = |t| TraceRow {
            timestamp: t,
            input_length: 1,
            output_length: 1,
            hash_ids: Vec::new(),
        };
        let r = normalise(vec![row(500), row(200), row(900)]);
        let ts: Vec<u64> = r.iter().map(|r| r.timestamp).collect();
        assert_eq!(ts, vec![0, 300, 700]);
    }
}
