//! Trace loading, and offline replay through the engine model in virtual time.
//!
//! One loader for every trace the simulator and the tools read (`kvroute-sim-replay`,
//! `kvroute-replay`, `kvroute-bench`, the demo). Files and their provenance are in the shared
//! data directory's `README.md` ([`kvroute_core::shared_data`]).
//!
//! | format | function | arrival | prompt | output |
//! |---|---|---|---|---|
//! | Mooncake JSONL (kvcache-ai/Mooncake `FAST25-release/traces/`) | [`load_mooncake`] | `timestamp` ms | `input_length` tokens + `hash_ids` | `output_length` |
//! | Azure LLM inference CSV (Azure/AzurePublicDataset, Patel et al., "Splitwise", ISCA'24) | [`load_azure`] | `TIMESTAMP` wall clock | `ContextTokens` (no content) | `GeneratedTokens` |
//! | ShareGPT v3 (`[{id, conversations}]`) | [`load_sharegpt`] | Poisson | first human turn (text) | [`DEFAULT_SHAREGPT_OUTPUT_TOKENS`] |
//! | LMBenchmark multi-round (`[{input, output_length}]`, LMCache/LMBenchmark) | [`load_sharegpt`] | Poisson | `input` (text; later inputs extend earlier ones) | `output_length` |
//!
//! A Mooncake row is a [`TraceRow`] (what the engine consumes: tokens and block ids). Every
//! format also loads as [`TraceRecord`]s ([`load`]): arrival in seconds from the first row,
//! token counts where the trace records them, and the prompt text where it has one; each
//! tool turns records into its own requests. Each `hash_id` names a 512-token block of
//! prompt content (equal ids = equal content).
//!
//! Poisson arrivals: gaps are `−ln(1 − u) / rate` with `u` uniform in `[0, 1)` from `fastrand`
//! seeded with `seed` (inverse-transform sampling of the exponential distribution); the first
//! prompt arrives at 0.
//!
//! The shared ShareGPT v3 file had e-mail addresses replaced after JSON escaping, leaving
//! invalid `\u` escapes (`\user@example.com`); such a backslash is read as a literal backslash
//! ([`repair_json_escapes`]).
//!
//! [`replay`] feeds Mooncake rows, at their timestamps, to `replicas` engines (round-robin:
//! this measures the engine, not a routing policy), stepping every engine up to each arrival,
//! and reports latency and cache figures. Prefix blocks are keyed with
//! [`super::api::id_block_hashes`], exactly as the server does for the
//! `kvroute_sim.prefix_block_ids` extension.

use std::path::{Path, PathBuf};

use kvroute_core::percentile::percentile;
use serde_json::Value;

use super::api::{id_block_hashes, DEFAULT_PREFIX_BLOCK_TOKENS};
use super::engine::{Engine, EngineConfig, EngineEvent, SimRequest};

/// Output tokens requested for ShareGPT v3 prompts, which carry no output length (the
/// `--sharegpt-output-len` default of vLLM's `benchmark_serving.py` is 256 too).
pub const DEFAULT_SHAREGPT_OUTPUT_TOKENS: u32 = 256;

/// One Mooncake trace row.
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

/// One request of a trace as recorded, in any format (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    /// Arrival, seconds after the file's first row (≥ 0).
    pub t_s: f64,
    /// Prompt tokens, where the trace records them (`None` for prompt-text files).
    pub input: Option<u32>,
    /// Output tokens.
    pub output: u32,
    /// Mooncake 512-token block ids (empty for other formats).
    pub hash_ids: Vec<u64>,
    /// The real prompt text (ShareGPT, LMBenchmark).
    pub text: Option<String>,
}

/// A trace format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Mooncake FAST'25 JSONL.
    Mooncake,
    /// Azure LLM inference trace CSV.
    Azure,
    /// ShareGPT v3 or LMBenchmark multi-round JSON, with Poisson arrivals.
    ShareGpt,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be read. The cause is part of the message, not a `source`, so an
    /// error chain (`anyhow`'s `{:#}`) does not print it twice.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        cause: std::io::Error,
    },
    /// A malformed row or document.
    #[error("{path}:{line}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// 1-based line (JSONL line, CSV line counting the header; 0 when the whole file is
        /// one JSON document and the position is unknown).
        line: usize,
        /// What is wrong.
        message: String,
    },
}

fn read_text(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|cause| TraceError::Io {
        path: path.to_owned(),
        cause,
    })
}

fn parse_err(path: &Path, line: usize, message: impl Into<String>) -> TraceError {
    TraceError::Parse {
        path: path.to_owned(),
        line,
        message: message.into(),
    }
}

/// Load a Mooncake JSONL trace (blank lines skipped), rows in file order.
///
/// Errors: [`TraceError::Io`], or [`TraceError::Parse`] with the line of a malformed row.
pub fn load_mooncake(path: &Path) -> Result<Vec<TraceRow>, TraceError> {
    let text = read_text(path)?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| parse_err(path, i + 1, e.to_string())))
        .collect()
}

/// Load any trace as [`TraceRecord`]s in file order. `rate_rps` and `seed` drive the Poisson
/// arrivals of [`TraceFormat::ShareGpt`] only.
///
/// Errors: as [`load_mooncake`], [`load_azure`] and [`load_sharegpt`].
pub fn load(
    format: TraceFormat,
    path: &Path,
    rate_rps: f64,
    seed: u64,
) -> Result<Vec<TraceRecord>, TraceError> {
    match format {
        TraceFormat::Mooncake => {
            let rows = load_mooncake(path)?;
            let t0 = rows.first().map_or(0, |r| r.timestamp);
            Ok(rows
                .into_iter()
                .map(|r| TraceRecord {
                    t_s: r.timestamp.saturating_sub(t0) as f64 / 1000.0,
                    input: Some(r.input_length),
                    output: r.output_length,
                    hash_ids: r.hash_ids,
                    text: None,
                })
                .collect())
        }
        TraceFormat::Azure => load_azure(path),
        TraceFormat::ShareGpt => load_sharegpt(path, rate_rps, seed),
    }
}

/// Seconds since 1970-01-01 of an Azure `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS[.fraction]`,
/// UTC assumed). `None` when malformed or out of range (month, day, hour, minute, second).
pub fn parse_azure_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once([' ', 'T'])?;
    let mut d = date.splitn(3, '-');
    let y: i64 = d.next()?.parse().ok()?;
    let m: i64 = d.next()?.parse().ok()?;
    let day: i64 = d.next()?.parse().ok()?;
    let mut t = time.splitn(3, ':');
    let hh: f64 = t.next()?.parse().ok()?;
    let mm: f64 = t.next()?.parse().ok()?;
    let ss: f64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
        || !(0.0..24.0).contains(&hh)
        || !(0.0..60.0).contains(&mm)
        || !(0.0..61.0).contains(&ss)
    {
        return None;
    }
    // Days from civil (proleptic Gregorian), H. Hinnant, "chrono-Compatible Low-Level Date
    // Algorithms", http://howardhinnant.github.io/date_algorithms.html#days_from_civil
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

/// One row of the Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct AzureRecord {
    /// `YYYY-MM-DD HH:MM:SS.fraction`, see [`parse_azure_timestamp`].
    #[serde(rename = "TIMESTAMP")]
    pub timestamp: String,
    /// Prompt length, tokens.
    #[serde(rename = "ContextTokens")]
    pub context: u32,
    /// Output length, tokens.
    #[serde(rename = "GeneratedTokens")]
    pub generated: u32,
}

/// Load the Azure LLM inference trace CSV. Times are seconds after the first row (a row
/// stamped before it reads as 0). The trace records no prompt content: records carry no
/// text and no block ids.
///
/// Errors: [`TraceError::Io`]; [`TraceError::Parse`] with the CSV line of a malformed row or
/// `TIMESTAMP`.
pub fn load_azure(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let text = read_text(path)?;
    let mut rdr = csv::Reader::from_reader(text.as_bytes());
    let mut rows = Vec::new();
    let mut t0 = None;
    for (i, rec) in rdr.deserialize::<AzureRecord>().enumerate() {
        let line = i + 2; // 1-based, after the header
        let rec = rec.map_err(|e| parse_err(path, line, e.to_string()))?;
        let t = parse_azure_timestamp(&rec.timestamp).ok_or_else(|| {
            parse_err(
                path,
                line,
                format!(
                    "bad TIMESTAMP {:?} (want YYYY-MM-DD HH:MM:SS.f)",
                    rec.timestamp
                ),
            )
        })?;
        let t0 = *t0.get_or_insert(t);
        rows.push(TraceRecord {
            t_s: (t - t0).max(0.0),
            input: Some(rec.context),
            output: rec.generated,
            hash_ids: Vec::new(),
            text: None,
        });
    }
    Ok(rows)
}

/// Make JSON text with invalid `\u` escapes parseable: a backslash followed by `u` and fewer
/// than four hex digits is doubled (read as a literal backslash). Valid escapes are kept.
pub fn repair_json_escapes(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        out.push(c);
        if c != '\\' {
            continue;
        }
        match chars.peek().copied() {
            Some((_, 'u')) => {
                let hex = s.get(i + 2..i + 6).unwrap_or("");
                if hex.len() != 4 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    out.push('\\');
                }
            }
            Some((_, next)) => {
                out.push(next);
                chars.next();
            }
            None => {}
        }
    }
    out
}

/// Load ShareGPT v3 (`[{id, conversations}]`: the first human turn, output
/// [`DEFAULT_SHAREGPT_OUTPUT_TOKENS`]) or LMBenchmark multi-round (`[{input, output_length}]`)
/// prompts, in file order, with Poisson arrivals at `rate_rps` (≤ 0 or non-finite: 1/s) drawn
/// from `seed`. Entries without a human turn or with an empty prompt are skipped.
///
/// Errors: [`TraceError::Io`]; [`TraceError::Parse`] for invalid JSON, a document that is
/// not an array, or an entry with neither `input` nor `conversations`.
pub fn load_sharegpt(
    path: &Path,
    rate_rps: f64,
    seed: u64,
) -> Result<Vec<TraceRecord>, TraceError> {
    let text = read_text(path)?;
    let v: Value = serde_json::from_str(&repair_json_escapes(&text))
        .map_err(|e| parse_err(path, e.line(), e.to_string()))?;
    let items = v
        .as_array()
        .ok_or_else(|| parse_err(path, 0, "expected a JSON array of prompts"))?;
    let rate = if rate_rps.is_finite() && rate_rps > 0.0 {
        rate_rps
    } else {
        1.0
    };
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut t = 0.0;
    let mut rows = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let (prompt, output) = if let Some(input) = item.get("input") {
            let p = input
                .as_str()
                .ok_or_else(|| parse_err(path, 0, format!("[{i}].input is not a string")))?;
            let out = item
                .get("output_length")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(DEFAULT_SHAREGPT_OUTPUT_TOKENS);
            (p, out)
        } else if let Some(conv) = item.get("conversations").and_then(Value::as_array) {
            let human = conv
                .iter()
                .find(|turn| turn.get("from").and_then(Value::as_str) == Some("human"))
                .and_then(|turn| turn.get("value"))
                .and_then(Value::as_str);
            match human {
                Some(p) => (p, DEFAULT_SHAREGPT_OUTPUT_TOKENS),
                None => continue, // no human turn: nothing to send
            }
        } else {
            return Err(parse_err(
                path,
                0,
                format!("[{i}] has neither `input` nor `conversations`"),
            ));
        };
        if prompt.is_empty() {
            continue;
        }
        if i > 0 {
            t += -(1.0 - rng.f64()).ln() / rate;
        }
        rows.push(TraceRecord {
            t_s: t,
            input: None,
            output,
            hash_ids: Vec::new(),
            text: Some(prompt.to_owned()),
        });
    }
    Ok(rows)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: fail loudly
    use super::*;

    #[test]
    fn repair_keeps_valid_escapes_and_doubles_bad_ones() {
        assert_eq!(
            repair_json_escapes(r#""a\u0041\n\\u""#),
            r#""a\u0041\n\\u""#
        );
        assert_eq!(repair_json_escapes(r#""x\user""#), r#""x\\user""#);
        let v: String = serde_json::from_str(&repair_json_escapes(r#""x\user\u00e9""#)).unwrap();
        assert_eq!(v, "x\\useré");
    }

    #[test]
    fn azure_timestamps() {
        assert_eq!(parse_azure_timestamp("1970-01-01 00:00:00"), Some(0.0));
        // 2023-11-16 is 19,677 days after the epoch.
        let t = parse_azure_timestamp("2023-11-16 18:15:46.6805900").unwrap();
        assert!((t - (19_677.0 * 86_400.0 + 18.0 * 3600.0 + 15.0 * 60.0 + 46.68059)).abs() < 1e-6);
        let b = parse_azure_timestamp("2023-11-16 18:15:50.9951690").unwrap();
        assert!((b - t - 4.314579).abs() < 1e-6);
        assert_eq!(
            parse_azure_timestamp("2023-11-17 00:00:00.5"),
            Some(19_678.0 * 86_400.0 + 0.5)
        );
        for bad in [
            "",
            "garbage",
            "x y",
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-11-16 25:00:00",
            "2023-11-16 1:2:3.4a",
        ] {
            assert_eq!(parse_azure_timestamp(bad), None, "{bad}");
        }
    }

    proptest::proptest! {
        /// Valid JSON is never changed by the repair.
        #[test]
        fn repair_is_identity_on_valid_json(text in "\\PC*") {
            let json = serde_json::to_string(&text).unwrap();
            proptest::prop_assert_eq!(repair_json_escapes(&json), json.clone());
            let back: String = serde_json::from_str(&repair_json_escapes(&json)).unwrap();
            proptest::prop_assert_eq!(back, text);
        }
    }
}
