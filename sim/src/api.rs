//! OpenAI request parsing and vLLM-shaped response bodies for the simulator.
//!
//! ## Prompt tokens and prefix blocks
//! By default a request's prompt length is kvroute-core's estimate
//! ([`kvroute_core::analysis::analyze`]), so the router and the simulator count in the same
//! units. The prompt's KV blocks are keyed by the rendered prompt text
//! (`RequestAnalysis::prefix_text`): block *i* (16 tokens) covers the proportional byte span
//! of the text, and its key is the xxh64 of those bytes, chained with
//! [`super::kv::chain_hashes`] from a seed of the model name and `cache_salt`. Requests whose
//! text shares a prefix therefore share leading blocks.
//!
//! ## The `kvroute_sim` extension (exact trace replay)
//! ```json
//! "kvroute_sim": {"prompt_tokens": 6909, "output_tokens": 300,
//!                 "prefix_block_ids": [46, 47, 48], "prefix_block_tokens": 512}
//! ```
//! - `prompt_tokens`: exact prompt length, replacing the estimate.
//! - `output_tokens`: exact output length, replacing `max_tokens` and the default.
//! - `prefix_block_ids`: content ids of consecutive `prefix_block_tokens`-token blocks
//!   (default 512, Mooncake's `hash_ids`); equal ids mean equal content. Each id expands to
//!   `prefix_block_tokens / 16` KV blocks. Tokens not covered by ids are unique to the request.
//!
//! ## Output length
//! `kvroute_sim.output_tokens` if set; else the request's `max_completion_tokens`/`max_tokens`
//! (finish reason `length`); else a seeded draw, uniform in `1..=2·mean − 1` with
//! `mean = default_max_tokens × expected_output_fraction` from the model profile (finish
//! reason `stop`). Always capped at `max_model_len − prompt_tokens`.

use kvroute_core::analysis::{analyze, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::profile::ModelProfile;
use serde::Deserialize;
use serde_json::{json, Value};

use super::kv::chain_hashes;

/// Name of the request extension field.
pub const EXTENSION_FIELD: &str = "kvroute_sim";
/// Default tokens per `prefix_block_ids` entry (Mooncake traces use 512-token blocks).
pub const DEFAULT_PREFIX_BLOCK_TOKENS: u32 = 512;

/// The `kvroute_sim` request extension (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SimExtension {
    /// Exact prompt length in tokens.
    #[serde(default)]
    pub prompt_tokens: Option<u32>,
    /// Exact output length in tokens.
    #[serde(default)]
    pub output_tokens: Option<u32>,
    /// Content ids of the prompt's leading blocks.
    #[serde(default)]
    pub prefix_block_ids: Vec<u64>,
    /// Tokens per id (default 512).
    #[serde(default)]
    pub prefix_block_tokens: Option<u32>,
}

/// An OpenAI-style error, serialised like vLLM 0.10's `ErrorResponse`:
/// `{"object":"error","message":…,"type":…,"param":null,"code":status}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// `BadRequestError`, `NotFoundError`, …
    pub kind: &'static str,
    /// Human-readable message.
    pub message: String,
}

impl ApiError {
    /// 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({
            "object": "error",
            "message": self.message,
            "type": self.kind,
            "param": null,
            "code": self.status,
        })
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The output limit was reached.
    Length,
    /// The (simulated) model stopped on its own.
    Stop,
}

impl FinishReason {
    /// OpenAI / vLLM string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// A request ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    /// Chat or completions.
    pub api: ApiKind,
    /// `model` field.
    pub model: String,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens to generate.
    pub output_tokens: u32,
    /// Finish reason once `output_tokens` are out.
    pub finish_reason: FinishReason,
    /// Chain hashes of the prompt's full 16-token blocks.
    pub block_hashes: Vec<u64>,
    /// vLLM priority.
    pub priority: i32,
}

fn xxh(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(bytes, 0)
}

/// Block hashes of a prompt given as text (see the module doc).
pub fn text_block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    prompt_tokens: u32,
    block_size: u32,
) -> Vec<u64> {
    let bs = block_size.max(1);
    let full = prompt_tokens / bs;
    let seed = xxh(format!("{model}\u{0}{}", cache_salt.unwrap_or("")).as_bytes());
    let bytes = text.as_bytes();
    let per_token = bytes.len() as f64 / f64::from(prompt_tokens.max(1));
    let keys = (0..full).map(|i| {
        let a = (f64::from(i * bs) * per_token) as usize;
        let b = (f64::from((i + 1) * bs) * per_token) as usize;
        match bytes.get(a..b.min(bytes.len())) {
            Some(s) if !s.is_empty() => xxh(s),
            _ => u64::from(i),
        }
    });
    chain_hashes(seed, keys)
}

/// Block hashes of a prompt given as trace block ids (see the module doc).
pub fn id_block_hashes(
    model: &str,
    ids: &[u64],
    id_tokens: u32,
    prompt_tokens: u32,
    block_size: u32,
) -> Vec<u64> {
    let bs = block_size.max(1);
    let per_id = (id_tokens / bs).max(1);
    let covered = (ids.len() as u64 * u64::from(per_id)).min(u64::from(prompt_tokens / bs));
    let seed = xxh(model.as_bytes());
    let keys = (0..covered).filter_map(|j| {
        let id = ids.get((j / u64::from(per_id)) as usize)?;
        let sub = j % u64::from(per_id);
        let mut h = xxhash_rust::xxh64::Xxh64::new(1);
        h.update(&id.to_le_bytes());
        h.update(&sub.to_le_bytes());
        Some(h.digest())
    });
    chain_hashes(seed, keys)
}

/// Parse and validate one request for a replica serving `profile` as `served_model`.
/// `draw` supplies a uniform random number in `0..1` for the default output length.
///
/// Errors ([`ApiError`]): 400 for malformed bodies, a bad extension, a prompt longer than
/// `max_model_len`, or an output limit that does not fit; 404 for another model name.
pub fn parse_request(
    api: ApiKind,
    body: &[u8],
    served_model: &str,
    profile: &ModelProfile,
    estimator: &Estimator,
    draw: impl FnOnce() -> f64,
) -> Result<ParsedRequest, ApiError> {
    let analysis =
        analyze(api, body, estimator).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let model = analysis.model.clone().unwrap_or_default();
    if model != served_model {
        return Err(ApiError {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
        });
    }
    // The few fields kvroute-core does not read.
    #[derive(Deserialize)]
    struct Extra {
        #[serde(default)]
        stream_options: Option<StreamOptions>,
        #[serde(default)]
        kvroute_sim: Option<SimExtension>,
    }
    #[derive(Deserialize)]
    struct StreamOptions {
        #[serde(default)]
        include_usage: Option<bool>,
    }
    let extra: Extra = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("{EXTENSION_FIELD} / stream_options: {e}")))?;
    let ext = extra.kvroute_sim.unwrap_or_default();
    let max_len = profile.max_model_len;
    let prompt_tokens: u32 = match ext.prompt_tokens {
        Some(0) => {
            return Err(ApiError::bad_request(format!(
                "{EXTENSION_FIELD}.prompt_tokens must be at least 1"
            )))
        }
        Some(n) => n,
        None => u32::try_from(analysis.prompt_tokens.max(1)).unwrap_or(u32::MAX),
    };
    if prompt_tokens >= max_len {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {max_len} tokens. However, your request has {prompt_tokens} input tokens. Please reduce the length of the input messages."
        )));
    }
    let room = max_len - prompt_tokens;
    let (output_tokens, finish_reason) = match (ext.output_tokens, analysis.max_output_tokens) {
        (Some(0), _) => {
            return Err(ApiError::bad_request(format!(
                "{EXTENSION_FIELD}.output_tokens must be at least 1"
            )))
        }
        (Some(n), limit) => {
            let reason = if limit == Some(n) {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            (n, reason)
        }
        (None, Some(0)) => {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1, got 0.",
            ))
        }
        (None, Some(n)) => (n, FinishReason::Length),
        (None, None) => {
            let mean = (f64::from(profile.default_max_tokens)
                * profile.expected_output_fraction.clamp(0.0, 1.0))
            .max(1.0);
            let hi = (2.0 * mean - 1.0).max(1.0);
            let n = 1.0 + (draw().clamp(0.0, 1.0) * hi).floor().min(hi - 1.0);
            (n as u32, FinishReason::Stop)
        }
    };
    if output_tokens > room && (ext.output_tokens.is_some() || analysis.max_output_tokens.is_some())
    {
        {
            return Err(ApiError::bad_request(format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {output_tokens}. This model's maximum context length is {max_len} tokens and your request has {prompt_tokens} input tokens ({output_tokens} > {max_len} - {prompt_tokens})."
            )));
        }
    }
    let output_tokens = output_tokens.min(room).max(1);
    let block_hashes = if ext.prefix_block_ids.is_empty() {
        text_block_hashes(
            &model,
            analysis.cache_salt.as_deref(),
            &analysis.prefix_text,
            prompt_tokens,
            profile.block_size,
        )
    } else {
        id_block_hashes(
            &model,
            &ext.prefix_block_ids,
            ext.prefix_block_tokens
                .unwrap_or(DEFAULT_PREFIX_BLOCK_TOKENS),
            prompt_tokens,
            profile.block_size,
        )
    };
    Ok(ParsedRequest {
        api,
        model,
        stream: analysis.stream,
        include_usage: extra
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        prompt_tokens,
        output_tokens,
        finish_reason,
        block_hashes,
        priority: analysis.priority,
    })
}

/// Filler text of output token `index` (1-based): one short word per token.
pub fn token_text(index: u32) -> &'static str {
    const WORDS: [&str; 8] = [
        "The ",
        "simulated ",
        "model ",
        "writes ",
        "one ",
        "word ",
        "per ",
        "token. ",
    ];
    WORDS
        .get((index.saturating_sub(1) % WORDS.len() as u32) as usize)
        .copied()
        .unwrap_or(" ")
}

/// Identity of one response, shared by all its chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseMeta {
    /// `chatcmpl-…` / `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// API.
    pub api: ApiKind,
}

/// vLLM-style `usage` object.
pub fn usage_json(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Complete (non-streamed) response body.
pub fn full_response(
    meta: &ResponseMeta,
    req: &ParsedRequest,
    cached: u32,
    timing: Value,
) -> Value {
    let text: String = (1..=req.output_tokens).map(token_text).collect();
    let reason = req.finish_reason.as_str();
    let choice = if meta.api == ApiKind::Completions {
        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason, "stop_reason": null})
    } else {
        json!({"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
               "logprobs": null, "finish_reason": reason, "stop_reason": null})
    };
    json!({
        "id": meta.id,
        "object": if meta.api == ApiKind::Completions { "text_completion" } else { "chat.completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_json(req.prompt_tokens, req.output_tokens, cached),
        EXTENSION_FIELD: timing,
    })
}

/// One streamed chunk carrying output token `index` (1-based); `finish` on the last one.
/// For chat, `index == 0` is the opening role chunk.
pub fn stream_chunk(meta: &ResponseMeta, index: u32, finish: Option<FinishReason>) -> Value {
    let reason = finish.map(FinishReason::as_str);
    let choice = if meta.api == ApiKind::Completions {
        json!({"index": 0, "text": token_text(index), "logprobs": null, "finish_reason": reason, "stop_reason": null})
    } else if index == 0 {
        json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})
    } else {
        json!({"index": 0, "delta": {"content": token_text(index)}, "logprobs": null, "finish_reason": reason, "stop_reason": null})
    };
    json!({
        "id": meta.id,
        "object": if meta.api == ApiKind::Completions { "text_completion" } else { "chat.completion.chunk" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The final usage-only chunk sent when `stream_options.include_usage` is set.
pub fn usage_chunk(meta: &ResponseMeta, req: &ParsedRequest, cached: u32) -> Value {
    json!({
        "id": meta.id,
        "object": if meta.api == ApiKind::Completions { "text_completion" } else { "chat.completion.chunk" },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage_json(req.prompt_tokens, req.output_tokens, cached),
    })
}

/// SSE framing used by vLLM: `data: <json>\n\n`.
pub fn sse_event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The terminating SSE event.
pub const SSE_DONE: &str = "data: [DONE]\n\n";
