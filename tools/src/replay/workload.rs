//! Traces to requests: loading, prompt synthesis, arrival times, slicing and scaling.
//!
//! ## Sources
//! Files are read by `kvroute_sim::trace` (one loader for all tools); this module turns its
//! records into requests:
//!
//! | source | arrival | prompt | output |
//! |---|---|---|---|
//! | Mooncake JSONL (kvcache-ai/Mooncake `FAST25-release/traces/`) | `timestamp` ms | synthesised from `hash_ids` (below) | `output_length` |
//! | Azure CSV (Azure/AzurePublicDataset, Splitwise ISCA'24) | `TIMESTAMP` wall clock | synthesised, unique per row, `ContextTokens` long | `GeneratedTokens` |
//! | ShareGPT v3 (`[{id, conversations}]`) | Poisson, `sharegpt_rate_rps` | first human turn | [`DEFAULT_SHAREGPT_OUTPUT_TOKENS`] |
//! | LMBenchmark multi-round (`[{input, output_length}]`) | Poisson | `input` (file order kept: later inputs extend earlier ones) | `output_length` |
//!
//! `max_output_tokens` caps every output.
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
//! Poisson arrivals (ShareGPT, LMBenchmark) are drawn by the loader from `seed` at
//! `sharegpt_rate_rps` (formula in `kvroute_sim::trace`).

use std::collections::HashMap;

use bytes::Bytes;
use kvroute_core::estimate::Estimator;
use rayon::prelude::*;
use serde_json::{json, Value};

use super::{ReplayError, ReplayRequest, TraceSource, WorkloadOptions};
use kvroute_sim::api::{DEFAULT_PREFIX_BLOCK_TOKENS, EXTENSION_FIELD};
use kvroute_sim::trace::{self, TraceFormat, TraceRecord};

pub use kvroute_sim::trace::DEFAULT_SHAREGPT_OUTPUT_TOKENS;
/// Tokens per Mooncake `hash_id` block (Mooncake's block size).
pub const BLOCK_TOKENS: u32 = DEFAULT_PREFIX_BLOCK_TOKENS;
/// Letters per synthesised word; with its leading space a word is 7 bytes and one token.
pub const WORD_LETTERS: usize = 6;
/// Domain tag mixed into Azure filler words so they never equal a Mooncake block's words.
const FILLER_TAG: u64 = 0x6b76_726f_7574_6531;

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

/// What a body carries besides the row: the `model` field, and the opt-in fields of
/// [`WorkloadOptions`].
#[derive(Debug, Clone, Copy)]
struct BodyShape<'a> {
    model: &'a str,
    sim_extension: bool,
    ignore_eos: bool,
}

/// The chat body of one request (see [`super::ReplayRequest::body`]).
fn body(
    shape: BodyShape<'_>,
    text: &str,
    prompt_tokens: Option<u32>,
    output: u32,
    hash_ids: &[u64],
) -> Bytes {
    let mut b = serde_json::Map::new();
    b.insert("model".into(), json!(shape.model));
    b.insert(
        "messages".into(),
        json!([{"role": "user", "content": text}]),
    );
    b.insert("max_tokens".into(), json!(output));
    b.insert("stream".into(), json!(true));
    b.insert("stream_options".into(), json!({"include_usage": true}));
    if shape.ignore_eos {
        b.insert("ignore_eos".into(), json!(true));
    }
    if shape.sim_extension {
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

/// The body `kvroute-demo` sends for a Mooncake row on simulated replicas (the body
/// [`load_workload`] builds with `model`, `sim_extension` on, no output cap and no
/// `ignore_eos`): text from `hash_ids` over `input` tokens ([`mooncake_text`]; `seed` and
/// `row`, the row's index in the trace file, seed filler past the last block, none in the
/// shipped trace), `max_tokens` = `output`. `cache` keeps full block texts between calls.
///
/// The routing benchmark feeds these bytes to the filter's pipeline to predict what the
/// online filter sees (`routebench::PrefixView::FilterText`).
pub fn mooncake_sim_body(
    model: &str,
    hash_ids: &[u64],
    input: u32,
    output: u32,
    (seed, row): (u64, u64),
    cache: &mut HashMap<u64, String>,
) -> Bytes {
    let text = mooncake_text_cached(hash_ids, input, seed, row, cache);
    let shape = BodyShape {
        model,
        sim_extension: true,
        ignore_eos: false,
    };
    body(shape, &text, Some(input), output.max(1), hash_ids)
}

/// Load `opts.source` and build the requests of the configured slice, in send order
/// (see the module doc for text synthesis, slicing and scaling).
///
/// Errors: unreadable file or malformed row, with its line ([`ReplayError::File`]), non-positive or non-finite scale/rate/slice options or an empty model
/// ([`ReplayError::Option`]). An empty slice is not an error (no requests).
pub fn load_workload(opts: &WorkloadOptions) -> Result<Vec<ReplayRequest>, ReplayError> {
    validate(opts)?;
    let (format, path) = match &opts.source {
        TraceSource::Mooncake(p) => (TraceFormat::Mooncake, p),
        TraceSource::AzureCsv(p) => (TraceFormat::Azure, p),
        TraceSource::ShareGpt(p) => (TraceFormat::ShareGpt, p),
    };
    let rows = trace::load(format, path, opts.sharegpt_rate_rps, opts.seed)?;
    let end = opts.duration_s.map(|d| opts.start_s + d);
    // Rows without a length: counted as the simulator's model server counts them.
    let estimator = Estimator::every_byte();
    let divisor = opts.rate_scale * opts.time_scale;
    let limit = opts.max_requests.unwrap_or(usize::MAX);
    // Pass 1 (cheap): choose the rows. Pass 2 (parallel, rayon): synthesise the bodies.
    let mut chosen: Vec<(usize, &TraceRecord, u32, u32)> = Vec::new();
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
    let shape = BodyShape {
        model: &opts.model,
        sim_extension: opts.sim_extension,
        ignore_eos: opts.ignore_eos,
    };
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
                    body: body(shape, &text, row.input, *output, &row.hash_ids),
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
    fn block_text_shape() {
        let a = block_text(7, BLOCK_TOKENS);
        assert_eq!(a.len(), BLOCK_TOKENS as usize * (WORD_LETTERS + 1));
        assert_eq!(a, block_text(7, BLOCK_TOKENS));
        assert_ne!(a, block_text(8, BLOCK_TOKENS));
        assert!(a.starts_with(&block_text(7, 10)));
        assert_eq!(
            Estimator::every_byte().estimate_text(&a),
            u64::from(BLOCK_TOKENS)
        );
    }

    proptest::proptest! {
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
