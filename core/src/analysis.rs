//! OpenAI-compatible request analysis.
//!
//! CONTRACT SKELETON written by the lead engineer: the types and signatures below are the
//! API other crates build against. The core owner fills in the bodies, adds fields only in a
//! backwards-compatible way, and replaces this paragraph with the real module doc.

use crate::estimate::Estimator;

/// Which OpenAI-compatible API a request targets, derived from the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiKind {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/embeddings`
    Embeddings,
    /// Anything else (e.g. TGI `/generate`): routed by load, body not interpreted.
    Other,
}

impl ApiKind {
    /// Classify a request path (query string ignored), e.g. `/v1/chat/completions?x=1`.
    pub fn from_path(path: &str) -> Self {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => ApiKind::ChatCompletions,
            "/v1/completions" => ApiKind::Completions,
            "/v1/responses" => ApiKind::Responses,
            "/v1/embeddings" => ApiKind::Embeddings,
            _ => ApiKind::Other,
        }
    }
}

/// Counts of non-text items in a request; each costs a configurable token allowance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MediaCounts {
    /// `image_url` / `input_image` parts.
    pub images: u32,
    /// `input_audio` parts.
    pub audio: u32,
    /// `video_url` parts.
    pub video: u32,
}

/// What the router needs to know about one request body.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestAnalysis {
    /// API the body was read as.
    pub api: ApiKind,
    /// `model` field; `None` only where the API allows omitting it.
    pub model: Option<String>,
    /// `stream` field (default false).
    pub stream: bool,
    /// `n` (number of choices, default 1, at least 1).
    pub n: u32,
    /// Explicit output-token limit: `max_completion_tokens` wins over `max_tokens`
    /// (`max_output_tokens` for the Responses API). `None` when absent: the caller then uses
    /// the model profile's default (see [`crate::profile::ModelProfile::output_limit`]).
    pub max_output_tokens: Option<u32>,
    /// Estimated prompt tokens (text estimate × model calibration + media allowances),
    /// or the exact count for token-id prompts.
    pub prompt_tokens: u64,
    /// True when `prompt_tokens` is exact (token-id prompts).
    pub prompt_tokens_exact: bool,
    /// The text hashed for prefix affinity: for chat, the rendered conversation in order with
    /// roles; for completions, the prompt; for token ids, a canonical rendering of the ids.
    pub prefix_text: String,
    /// vLLM `cache_salt`, mixed into the prefix hash seed.
    pub cache_salt: Option<String>,
    /// vLLM `priority` (lower value = served earlier, vLLM convention; default 0).
    pub priority: i32,
    /// Media items counted in the prompt.
    pub media: MediaCounts,
}

/// A body that cannot be analysed. Every variant names the offending field (JSON path such
/// as `messages[2].content`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnalysisError {
    /// The body is not valid JSON (or not a JSON object).
    #[error("invalid JSON at line {line} column {column}: {message}")]
    InvalidJson {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// serde_json's message.
        message: String,
    },
    /// A required field is absent.
    #[error("missing required field `{field}`")]
    MissingField {
        /// JSON path of the field.
        field: String,
    },
    /// A field has the wrong JSON type or an invalid value.
    #[error("field `{field}`: expected {expected}")]
    InvalidField {
        /// JSON path of the field.
        field: String,
        /// What was expected, e.g. "an array of messages".
        expected: &'static str,
    },
}

/// Analyse one request body of the given API.
///
/// Errors: [`AnalysisError`] for malformed bodies. Never panics on any input.
pub fn analyze(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
) -> Result<RequestAnalysis, AnalysisError> {
    let _ = (api, body, estimator);
    Err(AnalysisError::MissingField {
        field: "model".into(),
    })
}
