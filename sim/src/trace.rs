//! Mooncake trace loading and offline replay through the engine model in virtual time.
//!
//! The Mooncake FAST'25 traces (kvcache-ai/Mooncake `FAST25-release/traces/`) are JSONL rows
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [..]}`
//! where each hash id names a 512-token block of prompt content. [`replay`] feeds the rows,
//! at their timestamps, to `replicas` engines (round-robin: this measures the engine, not a
//! routing policy), stepping every engine up to each arrival, and reports latency and cache
//! figures. Prefix blocks are keyed with [`super::api::id_block_hashes`], exactly as the
//! server does for the `kvroute_sim.prefix_block_ids` extension.

use std::path::Path;

use super::api::{id_block_hashes, DEFAULT_PREFIX_BLOCK_TOKENS};
use super::engine::{Engine, EngineConfig, EngineEvent, SimRequest};

/// One trace row.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct TraceRow {
    /// Arrival, milliseconds from trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// Ids of 512-token prompt blocks (equal ids = equal content).
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// I/O error.
    #[error("reading {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A malformed line.
    #[error("{path}:{line}: {source}")]
    Parse {
        /// File.
        path: String,
        /// 1-based line.
        line: usize,
        /// Cause.
        source: serde_json::Error,
    },
}

/// Load a Mooncake JSONL trace (blank lines skipped).
pub fn load_mooncake(path: &Path) -> Result<Vec<TraceRow>, TraceError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: p.clone(),
        source,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| TraceError::Parse {
                path: p.clone(),
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Results of a replay. Times in virtual seconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ReplayReport {
    /// Rows offered.
    pub requests: usize,
    /// Rows the engine refused (longer than the KV cache).
    pub rejected: usize,
    /// Requests finished.
    pub finished: usize,
    /// Virtual time at the end (seconds).
    pub virtual_seconds: f64,
    /// TTFT median / p99 (seconds).
    pub ttft_p50: f64,
    /// TTFT p99 (seconds).
    pub ttft_p99: f64,
    /// End-to-end latency median (seconds).
    pub e2e_p50: f64,
    /// Prefix-cache hit ratio over queried tokens (0..1).
    pub prefix_hit_ratio: f64,
    /// Preemptions over all replicas.
    pub preemptions: u64,
    /// Engine steps over all replicas.
    pub steps: u64,
}

fn collect(events: Vec<EngineEvent>, arrival: &[f64], ttft: &mut Vec<f64>, e2e: &mut Vec<f64>) {
    for ev in events {
        if let EngineEvent::Token {
            id,
            time,
            index,
            last,
        } = ev
        {
            let a = arrival.get(id as usize).copied().unwrap_or(0.0);
            if index == 1 {
                ttft.push(time - a);
            }
            if last {
                e2e.push(time - a);
            }
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted.get(idx).copied().unwrap_or(0.0)
}

/// Replay `rows` through `replicas` engines of `cfg` (round-robin). `model` seeds the block
/// hashes. Output lengths are capped at 1 token minimum.
pub fn replay(rows: &[TraceRow], cfg: &EngineConfig, replicas: usize, model: &str) -> ReplayReport {
    let n = replicas.max(1);
    let mut engines: Vec<Engine> = (0..n).map(|_| Engine::new(cfg.clone())).collect();
    let mut arrival: Vec<f64> = vec![0.0; rows.len()];
    let mut ttft = Vec::with_capacity(rows.len());
    let mut e2e = Vec::with_capacity(rows.len());
    let mut report = ReplayReport {
        requests: rows.len(),
        ..Default::default()
    };
    for (i, row) in rows.iter().enumerate() {
        let t = row.timestamp as f64 / 1000.0;
        for e in engines.iter_mut() {
            while !e.is_idle() && e.now() < t {
                match e.step() {
                    Some(r) => collect(r.events, &arrival, &mut ttft, &mut e2e),
                    None => break,
                }
            }
            e.advance_to(t);
        }
        if let Some(a) = arrival.get_mut(i) {
            *a = t;
        }
        let Some(e) = engines.get_mut(i % n) else {
            continue;
        };
        let req = SimRequest {
            id: i as u64,
            prompt_tokens: row.input_length.max(1),
            output_tokens: row.output_length.max(1),
            block_hashes: id_block_hashes(
                model,
                &row.hash_ids,
                DEFAULT_PREFIX_BLOCK_TOKENS,
                row.input_length,
                cfg.block_size,
            ),
            priority: 0,
        };
        if e.submit(req).is_err() {
            report.rejected += 1;
        }
    }
    for e in engines.iter_mut() {
        while let Some(r) = e.step() {
            collect(r.events, &arrival, &mut ttft, &mut e2e);
        }
    }
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let (mut q, mut h) = (0u64, 0u64);
    for e in &engines {
        let c = e.counters();
        q += c.prefix_queries_tokens;
        h += c.prefix_hit_tokens;
        report.preemptions += c.preemptions;
        report.steps += c.steps;
        report.finished += c.finished as usize;
        report.virtual_seconds = report.virtual_seconds.max(e.now());
    }
    report.ttft_p50 = percentile(&ttft, 0.5);
    report.ttft_p99 = percentile(&ttft, 0.99);
    report.e2e_p50 = percentile(&e2e, 0.5);
    report.prefix_hit_ratio = if q == 0 { 0.0 } else { h as f64 / q as f64 };
    report
}
