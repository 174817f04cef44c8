//! Traces to requests: loading, prompt synthesis, arrival times, slicing and scaling.
//!
//! ## Sources
//! | source | arrival | prompt | output |
//! |---|---|---|---|
//! | Mooncake JSONL (kvcache-ai/Mooncake `FAST25-release/traces/`) | `timestamp` ms | synthesised from `hash_ids` (below) | `output_length` |
//! | Azure CSV (Azure/AzurePublicDataset, Splitwise ISCA'24) | `TIMESTAMP` wall clock | synthesised, unique per row, `ContextTokens` long | `GeneratedTokens` |
//! | ShareGPT v3 (`[{id, conversations}]`) | Poisson, `sharegpt_rate_rps` | first human turn | [`DEFAULT_SHAREGPT_OUTPUT_TOKENS`] |
//! | LMBenchmark multi-round (`[{input, output_length}]`) | Poisson | `input` (file order kept: later inputs extend earlier ones) | `output_length` |
//!
//! `max_output_tokens` caps every output. The shared ShareGPT v3 file had e-mail addresses
//! replaced after JSON escaping, leaving invalid `\u` escapes (`\user@example.com`); such a
//! backslash is read as a literal backslash ([`repair_json_escapes`]).
//!
//! ## Mooncake prompt text
//! A Mooncake `hash_id` names a 512-token block of prompt content; equal ids in two rows mean
//! the rows share that content. Block `id` becomes the text of [`BLOCK_TOKENS`] words
//! ([`block_text`]): word `j` is a space and [`WORD_LETTERS`] lower-case letters drawn from
//! a SplitMix64 stream seeded with `xxh64(le(id))`. A space plus a short ASCII word is one
//! token for BPE and for kvroute-core's estimator (`core/src/estimate.rs`), so a block is ≈512 tokens; the
//! estimated prompt length stays within a few tokens of `input_length`. The last block is
//! partial (`input_length − 512·(n−1)` words: a prefix of the full block's text). Tokens
//! beyond `512·n` (none in the shipped trace) are unique filler seeded by the row.
//!
//! A block is `512 × 7 = 3,584` bytes = 56 of GIE's 64-character hash blocks
//! (`core/src/prefix.rs`), so two rows sharing their first k ids have byte-identical leading
//! `k·3,584` bytes of content, and the filter's prefix hashes agree on every hash block
//! covered by the shared text and the chat rendering before it.
//!
//! Prompt text depends only on the ids (never on the seed); the seed drives Poisson gaps and
//! Azure filler text.
//!
//! ## Time
//! Row times `t` are trace seconds from the first row of the file. Slicing keeps rows with
//! `start_s ≤ t < start_s + duration_s`, drops rows longer than `max_prompt_tokens`, then
//! keeps the first `max_requests`. Send offsets are
//! `at_s = (t − t_first) / (rate_scale × time_scale)` with `t_first` the first kept row, so
//! the first request goes at 0. `rate_scale` k multiplies the arrival rate; `time_scale`
//! compresses time to match a simulator running `time_scale` virtual seconds per wall second
//! (kvroute-sim `--time-scale`), which keeps the offered load relative to the simulated
//! capacity unchanged while latencies shrink by the same factor.
//!
//! Poisson gaps are `−ln(1 − u) / rate` with `u` uniform in `[0, 1)` from `fastrand` seeded
//! with `seed` (inverse-transform sampling of the exponential distribution).

use std::collections::HashMap;
use std::path::Path;

use bytes::Bytes;
use kvroute_core::estimate::Estimator;
use rayon::prelude::*;
use serde_json::{json, Value};

use super::{ReplayError, ReplayRequest, TraceSource, WorkloadOptions};
use kvroute_sim::api::{DEFAULT_PREFIX_BLOCK_TOKENS, EXTENSION_FIELD};

/// Output tokens requested for ShareGPT v3 prompts, which carry no output length (the
/// `--sharegpt-output-len` default of vLLM's `benchmark_serving.py` is 256 too).
pub const DEFAULT_SHAREGPT_OUTPUT_TOKENS: u32 = 256;
/// Tokens per Mooncake `hash_id` block (Mooncake's block size).
pub const BLOCK_TOKENS: u32 = DEFAULT_PREFIX_BLOCK_TOKENS;
/// Letters per synthesised word; with its leading space a word is 7 bytes and one token.
pub const WORD_LETTERS: usize = 6;
/// Domain tag mixed into Azure filler words so they never equal a Mooncake block's words.
const FILLER_TAG: u64 = 0x6b76_726f_7574_6531;

/// One trace row, before slicing.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    /// Trace seconds from the first row.
    t_s: f64,
    /// Prompt tokens (`None`: estimate from `text`).
    input: Option<u32>,
    /// Output tokens.
    output: u32,
    /// Mooncake block ids.
    hash_ids: Vec<u64>,
    /// Real prompt text (ShareGPT).
    text: Option<String>,
}

fn push_word(out: &mut String, h: u64) {
    out.push(' ');
    let mut x = h;
    for _ in 0..WORD_LETTERS {
        out.push(char::from(b'a' + (x % 26) as u8));
        x /= 26;
    }
}

/// SplitMix64 output function (Steele, Lea & Flood, "Fast Splittable Pseudorandom Number
/// Generators", OOPSLA 2014; constants from Vigna's `splitmix64.c`).
fn splitmix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `words` words of the stream keyed by `key`: word j is `splitmix64(key + (j+1)·γ)`.
fn words_text(key: u64, words: u32) -> String {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut s = String::with_capacity(words as usize * (WORD_LETTERS + 1));
    let mut state = key;
    for _ in 0..words {
        state = state.wrapping_add(GAMMA);
        push_word(&mut s, splitmix64(state));
    }
    s
}

/// Text of Mooncake block `id`, `words` words long (≤ [`BLOCK_TOKENS`] for a real block):
/// word j comes from SplitMix64 seeded with `xxh64(le(id))`. Equal ids give equal text; a
/// shorter block is a prefix of a longer one.
pub fn block_text(id: u64, words: u32) -> String {
    words_text(xxhash_rust::xxh64::xxh64(&id.to_le_bytes(), 0), words)
}

/// Unique filler of `words` words for row `row` under `seed`.
fn filler_text(seed: u64, row: u64, words: u32) -> String {
    let mut h = xxhash_rust::xxh64::Xxh64::new(FILLER_TAG);
    h.update(&seed.to_le_bytes());
    h.update(&row.to_le_bytes());
    words_text(h.digest(), words)
}

/// Prompt text of a Mooncake row of `input` tokens over `hash_ids` (see the module doc).
pub fn mooncake_text(hash_ids: &[u64], input: u32, seed: u64, row: u64) -> String {
    mooncake_text_cached(hash_ids, input, seed, row, &mut HashMap::new())
}

/// [`mooncake_text`] with a cache of full block texts (ids repeat across rows).
fn mooncake_text_cached(
    hash_ids: &[u64],
    input: u32,
    seed: u64,
    row: u64,
    cache: &mut HashMap<u64, String>,
) -> String {
    let mut s = String::with_capacity(input as usize * (WORD_LETTERS + 1));
    let mut left = input;
    for id in hash_ids {
        if left == 0 {
            break;
        }
        let n = left.min(BLOCK_TOKENS);
        let full = cache
            .entry(*id)
            .or_insert_with(|| block_text(*id, BLOCK_TOKENS));
        // Words are ASCII and fixed-width, so a prefix of n words is n × 7 bytes.
        let bytes = n as usize * (WORD_LETTERS + 1);
        s.push_str(full.get(..bytes).unwrap_or(full));
        left -= n;
    }
    if left > 0 {
        s.push_str(&filler_text(seed, row, left));
    }
    s
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

fn read_text(path: &Path) -> Result<String, ReplayError> {
    std::fs::read_to_string(path).map_err(|source| ReplayError::Io {
        path: path.to_owned(),
        source,
    })
}

fn parse_err(path: &Path, line: usize, message: impl Into<String>) -> ReplayError {
    ReplayError::Parse {
        path: path.to_owned(),
        line,
        message: message.into(),
    }
}

fn load_mooncake(path: &Path) -> Result<Vec<Row>, ReplayError> {
    let rows = kvroute_sim::trace::load_mooncake(path).map_err(|e| match e {
        kvroute_sim::trace::TraceError::Io { source, .. } => ReplayError::Io {
            path: path.to_owned(),
            source,
        },
        kvroute_sim::trace::TraceError::Parse { line, source, .. } => {
            parse_err(path, line, source.to_string())
        }
    })?;
    let t0 = rows.first().map(|r| r.timestamp).unwrap_or(0);
    Ok(rows
        .into_iter()
        .map(|r| Row {
            t_s: r.timestamp.saturating_sub(t0) as f64 / 1000.0,
            input: Some(r.input_length),
            output: r.output_length,
            hash_ids: r.hash_ids,
            text: None,
        })
        .collect())
}

/// Seconds since 1970-01-01 of an Azure `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS[.fraction]`,
/// UTC assumed). `None` when malformed or out of range (month, day, hour, minute, second).
/// The routing benchmark reads the same timestamps through this function.
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
/// The routing benchmark reads the same rows.
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

fn load_azure(path: &Path) -> Result<Vec<Row>, ReplayError> {
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
        rows.push(Row {
            t_s: (t - t0).max(0.0),
            input: Some(rec.context),
            output: rec.generated,
            hash_ids: Vec::new(),
            text: None,
        });
    }
    Ok(rows)
}

fn load_sharegpt(path: &Path, rate: f64, seed: u64) -> Result<Vec<Row>, ReplayError> {
    let text = read_text(path)?;
    let v: Value = serde_json::from_str(&repair_json_escapes(&text))
        .map_err(|e| parse_err(path, e.line(), e.to_string()))?;
    let items = v
        .as_array()
        .ok_or_else(|| parse_err(path, 0, "expected a JSON array of prompts"))?;
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
        rows.push(Row {
            t_s: t,
            input: None,
            output,
            hash_ids: Vec::new(),
            text: Some(prompt.to_owned()),
        });
    }
    Ok(rows)
}

fn check_positive(option: &'static str, v: f64) -> Result<(), ReplayError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ReplayError::Option {
            option,
            value: v.to_string(),
            reason: "must be a finite number > 0",
        })
    }
}

fn validate(opts: &WorkloadOptions) -> Result<(), ReplayError> {
    check_positive("rate_scale", opts.rate_scale)?;
    check_positive("time_scale", opts.time_scale)?;
    if matches!(opts.source, TraceSource::ShareGpt(_)) {
        check_positive("sharegpt_rate_rps", opts.sharegpt_rate_rps)?;
    }
    if !(opts.start_s.is_finite() && opts.start_s >= 0.0) {
        return Err(ReplayError::Option {
            option: "start_s",
            value: opts.start_s.to_string(),
            reason: "must be a finite number >= 0",
        });
    }
    if let Some(d) = opts.duration_s {
        check_positive("duration_s", d)?;
    }
    if opts.model.is_empty() {
        return Err(ReplayError::Option {
            option: "model",
            value: String::new(),
            reason: "must not be empty",
        });
    }
    Ok(())
}

/// The chat body of one request (see [`super::ReplayRequest::body`]).
fn body(
    opts: &WorkloadOptions,
    text: &str,
    prompt_tokens: Option<u32>,
    output: u32,
    hash_ids: &[u64],
) -> Bytes {
    let mut b = serde_json::Map::new();
    b.insert("model".into(), json!(opts.model));
    b.insert(
        "messages".into(),
        json!([{"role": "user", "content": text}]),
    );
    b.insert("max_tokens".into(), json!(output));
    b.insert("stream".into(), json!(true));
    b.insert("stream_options".into(), json!({"include_usage": true}));
    if opts.ignore_eos {
        b.insert("ignore_eos".into(), json!(true));
    }
    if opts.sim_extension {
        let mut ext = serde_json::Map::new();
        if let Some(p) = prompt_tokens {
            ext.insert("prompt_tokens".into(), json!(p));
        }
        ext.insert("output_tokens".into(), json!(output));
        if !hash_ids.is_empty() {
            ext.insert("prefix_block_ids".into(), json!(hash_ids));
            ext.insert("prefix_block_tokens".into(), json!(BLOCK_TOKENS));
        }
        b.insert(EXTENSION_FIELD.into(), Value::Object(ext));
    }
    let b = Value::Object(b);
    Bytes::from(b.to_string())
}

/// Load `opts.source` and build the requests of the configured slice, in send order
/// (see the module doc for text synthesis, slicing and scaling).
///
/// Errors: unreadable file ([`ReplayError::Io`]), malformed row ([`ReplayError::Parse`],
/// with its line), non-positive or non-finite scale/rate/slice options or an empty model
/// ([`ReplayError::Option`]). An empty slice is not an error (no requests).
pub fn load_workload(opts: &WorkloadOptions) -> Result<Vec<ReplayRequest>, ReplayError> {
    validate(opts)?;
    let rows = match &opts.source {
        TraceSource::Mooncake(p) => load_mooncake(p)?,
        TraceSource::AzureCsv(p) => load_azure(p)?,
        TraceSource::ShareGpt(p) => load_sharegpt(p, opts.sharegpt_rate_rps, opts.seed)?,
    };
    let end = opts.duration_s.map(|d| opts.start_s + d);
    let estimator = Estimator::default();
    let divisor = opts.rate_scale * opts.time_scale;
    let limit = opts.max_requests.unwrap_or(usize::MAX);
    // Pass 1 (cheap): choose the rows. Pass 2 (parallel, rayon): synthesise the bodies.
    let mut chosen: Vec<(usize, &Row, u32, u32)> = Vec::new();
    for (row_index, row) in rows.iter().enumerate() {
        if chosen.len() >= limit {
            break;
        }
        if row.t_s < opts.start_s || end.is_some_and(|e| row.t_s >= e) {
            continue;
        }
        let prompt_tokens = match (&row.input, &row.text) {
            (Some(n), _) => *n,
            (None, Some(t)) => u32::try_from(estimator.estimate_text(t)).unwrap_or(u32::MAX),
            (None, None) => 0,
        };
        if opts.max_prompt_tokens.is_some_and(|m| prompt_tokens > m) {
            continue;
        }
        let output = opts
            .max_output_tokens
            .map_or(row.output, |m| row.output.min(m))
            .max(1);
        chosen.push((row_index, row, prompt_tokens, output));
    }
    let t_first = chosen.first().map_or(0.0, |c| c.1.t_s);
    let out = chosen
        .par_iter()
        .enumerate()
        .map_init(
            HashMap::new,
            |blocks, (id, (row_index, row, prompt_tokens, output))| {
                let text = match &row.text {
                    Some(t) => t.clone(),
                    None if !row.hash_ids.is_empty() => mooncake_text_cached(
                        &row.hash_ids,
                        *prompt_tokens,
                        opts.seed,
                        *row_index as u64,
                        blocks,
                    ),
                    None => filler_text(opts.seed, *row_index as u64, (*prompt_tokens).max(1)),
                };
                ReplayRequest {
                    id: id as u64,
                    at_s: (row.t_s - t_first).max(0.0) / divisor,
                    body: body(opts, &text, row.input, *output, &row.hash_ids),
                    prompt_tokens: *prompt_tokens,
                    output_tokens: *output,
                }
            },
        )
        .collect();
    Ok(out)
}

#[cfg(test)]
mod tests {
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
        assert_eq!(parse_azure_timestamp("2023-13-01 00:00:00"), None);
        assert_eq!(parse_azure_timestamp("garbage"), None);
    }

    #[test]
    fn block_text_shape() {
        let a = block_text(7, BLOCK_TOKENS);
        assert_eq!(a.len(), BLOCK_TOKENS as usize * (WORD_LETTERS + 1));
        assert_eq!(a, block_text(7, BLOCK_TOKENS));
        assert_ne!(a, block_text(8, BLOCK_TOKENS));
        assert!(a.starts_with(&block_text(7, 10)));
        assert_eq!(
            Estimator::default().estimate_text(&a),
            u64::from(BLOCK_TOKENS)
        );
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

        /// Rows share exactly the text of their common leading ids, and every prompt is
        /// `input` words of 7 bytes.
        #[test]
        fn mooncake_text_shares_exactly_the_common_ids(
            common in proptest::collection::vec(0u64..50, 0..4),
            a_tail in proptest::collection::vec(100u64..150, 1..3),
            b_tail in proptest::collection::vec(200u64..250, 1..3),
        ) {
            let ids_a: Vec<u64> = common.iter().chain(&a_tail).copied().collect();
            let ids_b: Vec<u64> = common.iter().chain(&b_tail).copied().collect();
            let (na, nb) = (ids_a.len() as u32 * BLOCK_TOKENS, ids_b.len() as u32 * BLOCK_TOKENS - 5);
            let ta = mooncake_text(&ids_a, na, 1, 1);
            let tb = mooncake_text(&ids_b, nb, 1, 2);
            proptest::prop_assert_eq!(ta.len(), na as usize * 7);
            proptest::prop_assert_eq!(tb.len(), nb as usize * 7);
            let shared = common.len() * BLOCK_TOKENS as usize * 7;
            proptest::prop_assert_eq!(&ta[..shared], &tb[..shared]);
            proptest::prop_assert_ne!(&ta[shared..shared + 7], &tb[shared..shared + 7]);
        }
    }
}
