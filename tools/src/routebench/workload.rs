//! The three benchmark workloads, as [`TraceRow`]s (arrival ms, prompt tokens, output
//! tokens, 512-token prefix block ids).
//!
//! - **Mooncake** (`traces/mooncake_conversation_trace.jsonl`, kvcache-ai/Mooncake FAST'25):
//!   rows as recorded, `hash_ids` give real prefix structure ([`kvroute_sim::trace::load_mooncake`]).
//! - **Azure conv** (`traces/AzureLLMInferenceTrace_conv.csv`, Azure Public Dataset, Patel et
//!   al., "Splitwise", ISCA'24): `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`, read with
//!   the `csv` crate. The trace records **no prompt content or hashes**, so rows carry no
//!   prefix ids: no two requests are assumed to share a prefix, and every router's
//!   prefix-cache hit rate is 0 on it. It measures load balancing only.
//! - **ShareGPT multi-round** (`prompts/lmbenchmark_sharegpt_multiround_run.json`,
//!   LMCache/LMBenchmark): each entry is a cumulative conversation (every later round's
//!   input starts with an earlier round's input), so prefix reuse is real. Prompt tokens
//!   come from kvroute-core's [`Estimator`] (the same estimate the filter makes), output
//!   tokens from `output_length`. Prefix ids: xxh64 of each full
//!   [`SHAREGPT_BLOCK_CHARS`]-byte block of the input (2 048 bytes ≈ 512 tokens at the
//!   usual ~4 characters per token), so two inputs share block *k* exactly when their
//!   first (k+1)·2 048 bytes agree. Arrivals: a Poisson process (exponential gaps, seeded
//!   `fastrand`) at [`SHAREGPT_BASE_RATE`] request/s in file order, so a conversation's
//!   rounds arrive in order; the load sweep rescales the rate.
//!
//! Every loader returns rows sorted by arrival with the first at 0 ms.

use std::path::Path;

use kvroute_core::estimate::Estimator;

use kvroute_sim::trace::{load_mooncake, TraceError, TraceRow};

/// Bytes per ShareGPT prefix block.
pub const SHAREGPT_BLOCK_CHARS: usize = 2048;
/// Poisson rate of the ShareGPT workload before load scaling (requests/s).
pub const SHAREGPT_BASE_RATE: f64 = 1.0;

/// A workload that cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// Mooncake JSONL error.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// I/O error.
    #[error("reading {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// CSV error (Azure).
    #[error("{path}: {source}")]
    Csv {
        /// File.
        path: String,
        /// Cause.
        source: csv::Error,
    },
    /// A timestamp that is not `YYYY-MM-DD HH:MM:SS[.fraction]`.
    #[error("{path}: row {row}: bad TIMESTAMP `{value}`")]
    Timestamp {
        /// File.
        path: String,
        /// 1-based data row.
        row: usize,
        /// The text.
        value: String,
    },
    /// JSON error (ShareGPT).
    #[error("{path}: {source}")]
    Json {
        /// File.
        path: String,
        /// Cause.
        source: serde_json::Error,
    },
}

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
    pub fn load(self, data_dir: &Path, seed: u64) -> Result<Vec<TraceRow>, WorkloadError> {
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

/// Milliseconds since 1970-01-01 of an Azure `TIMESTAMP` (`2023-11-16 18:15:46.6805900`,
/// UTC, fraction optional; sub-millisecond digits truncated). `None` when malformed. One
/// parser serves both tools: [`crate::replay::workload::parse_azure_timestamp`].
pub fn parse_azure_timestamp(s: &str) -> Option<i64> {
    crate::replay::workload::parse_azure_timestamp(s).map(|t| (t * 1000.0).floor() as i64)
}

use crate::replay::workload::AzureRecord;

/// Load the Azure conv CSV (no prefix ids; see the module doc).
///
/// Errors: [`WorkloadError::Csv`] for unreadable files or rows, [`WorkloadError::Timestamp`]
/// for a malformed `TIMESTAMP`.
pub fn load_azure(path: &Path) -> Result<Vec<TraceRow>, WorkloadError> {
    let p = path.display().to_string();
    let mut rd = csv::Reader::from_path(path).map_err(|source| WorkloadError::Csv {
        path: p.clone(),
        source,
    })?;
    let mut stamped = Vec::new();
    for (i, rec) in rd.deserialize::<AzureRecord>().enumerate() {
        let rec = rec.map_err(|source| WorkloadError::Csv {
            path: p.clone(),
            source,
        })?;
        let ms = parse_azure_timestamp(&rec.timestamp).ok_or_else(|| WorkloadError::Timestamp {
            path: p.clone(),
            row: i + 1,
            value: rec.timestamp.clone(),
        })?;
        stamped.push((ms, rec.context, rec.generated));
    }
    let t0 = stamped.iter().map(|r| r.0).min().unwrap_or(0);
    let rows = stamped
        .into_iter()
        .map(|(ms, input, output)| TraceRow {
            timestamp: u64::try_from(ms - t0).unwrap_or(0),
            input_length: input,
            output_length: output,
            hash_ids: Vec::new(),
        })
        .collect();
    Ok(normalise(rows))
}

#[derive(serde::Deserialize)]
struct SharegptEntry {
    input: String,
    output_length: u32,
}

/// Prefix ids of `text`: xxh64 of each full [`SHAREGPT_BLOCK_CHARS`]-byte block.
pub fn text_block_ids(text: &str) -> Vec<u64> {
    text.as_bytes()
        .chunks_exact(SHAREGPT_BLOCK_CHARS)
        .map(|c| xxhash_rust::xxh64::xxh64(c, 0))
        .collect()
}

/// Load the LMBenchmark ShareGPT multi-round file with Poisson arrivals at `rate` req/s
/// (≤ 0 or non-finite → 1.0) drawn from `seed` (see the module doc).
///
/// Errors: [`WorkloadError::Io`] / [`WorkloadError::Json`].
pub fn load_sharegpt(path: &Path, seed: u64, rate: f64) -> Result<Vec<TraceRow>, WorkloadError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| WorkloadError::Io {
        path: p.clone(),
        source,
    })?;
    let entries: Vec<SharegptEntry> =
        serde_json::from_slice(&bytes).map_err(|source| WorkloadError::Json { path: p, source })?;
    let rate = if rate.is_finite() && rate > 0.0 {
        rate
    } else {
        1.0
    };
    let est = Estimator::default();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut t = 0.0f64;
    let mut rows = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            // Exponential gap: −ln(U)/λ with U in (0, 1].
            t += -(1.0 - rng.f64()).ln() / rate;
        }
        rows.push(TraceRow {
            timestamp: (t * 1000.0) as u64,
            input_length: u32::try_from(est.estimate_text(&e.input))
                .unwrap_or(u32::MAX)
                .max(1),
            output_length: e.output_length.max(1),
            hash_ids: text_block_ids(&e.input),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_timestamps() {
        let a = parse_azure_timestamp("2023-11-16 18:15:46.6805900").unwrap_or(-1);
        let b = parse_azure_timestamp("2023-11-16 18:15:50.9951690").unwrap_or(-1);
        assert_eq!(b - a, 4315);
        // 2023-11-16 is day 19 677 since the epoch.
        assert_eq!(
            parse_azure_timestamp("2023-11-16 00:00:00"),
            Some(19_677 * 86_400_000)
        );
        assert_eq!(
            parse_azure_timestamp("2023-11-17 00:00:00.5"),
            Some(19_678 * 86_400_000 + 500)
        );
        for bad in [
            "",
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-11-16 25:00:00",
            "x y",
            "2023-11-16 1:2:3.4a",
        ] {
            assert_eq!(parse_azure_timestamp(bad), None, "{bad}");
        }
    }

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
