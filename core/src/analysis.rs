//! OpenAI-compatible request analysis.
//!
//! [`analyze`] reads one request body and answers what the router needs before it picks an
//! endpoint: the model, `stream`, `n`, the explicit output-token limit, an estimate of the
//! prompt tokens, the text hashed for prefix affinity, vLLM's `cache_salt` and `priority`.
//!
//! ## One pass, no JSON tree
//! The body is scanned once by `json_scan::Scanner` (a crate-private JSON scanner that builds
//! nothing; why it is hand-written, with measurements: `docs/core.md`). The API's prompt
//! field (`messages`, `prompt`, `input`) is read in place as the scan meets it: each prompt
//! string goes piece by piece (unescaped stretches borrowed from the body, escapes decoded)
//! to the prefix rendering while it is under its limit ([`analyze_bounded`]), and to the
//! token tally ([`crate::estimate::Tally`]): in one call per string, read back from the
//! rendering, while the rendering has room; piece by piece after that; and past the
//! limit, between the tally's sampling windows, only as a decoded length. A message whose
//! `content` comes before its `role` is still read once: it is rendered in place and the
//! role marker is inserted before it when the role is read. Unknown fields (OpenAI bodies
//! carry dozens: `temperature`, `response_format`, `logit_bias`...) are validated and
//! skipped; the other top-level fields the router reads are kept as raw slices and decoded
//! after the scan (small scalars with serde_json), in a fixed order, so an error names the
//! exact JSON path (`messages[2].content`). Nesting is tracked on a heap stack, never by
//! recursion, so no input can overflow the stack. The results equal those of the
//! serde_json-based analyser this replaced on every input of
//! `core/tests/analysis_differential.rs`.
//!
//! ## APIs
//! | API | prompt fields | output limit |
//! |---|---|---|
//! | `/v1/chat/completions` | `tools`, `messages[].content` (string or parts: `text`, `image_url`, `input_audio`, `video_url`), assistant `tool_calls`, tool results | `max_completion_tokens`, else `max_tokens` |
//! | `/v1/completions` | `prompt`: string, strings, token ids, or a batch of token-id arrays | `max_tokens` |
//! | `/v1/responses` | `instructions`, `tools`, `input`: string or items (messages, `function_call`, `function_call_output`) | `max_output_tokens` |
//! | `/v1/embeddings` | `input`: same shapes as `prompt` | 0 (embeddings generate nothing) |
//! | other paths | TGI-style `inputs` when present | `parameters.max_new_tokens` |
//!
//! `model` is required for the four OpenAI APIs ([`AnalysisError::MissingField`]). Integer
//! fields (`n`, the output limits, `priority`) take a number with no fractional part too
//! (`256.0`), as vLLM's and SGLang's pydantic request models do.
//!
//! ## Rendering for prefix hashing
//! Chat and Responses conversations are rendered in order as `<|role|>\ncontent\n`, with the
//! tool definitions first (`<|tools|>\n{json as sent}\n`), so a follow-up turn, which repeats
//! the earlier turns verbatim, shares its leading prefix blocks with the previous turn. Media
//! items render as `<|image:HASH|>` (xxh64 of the URL/data), so different images differ.
//! Token-id prompts render as the ids separated by single spaces.
//!
//! ## Token estimate
//! Text is estimated by [`Estimator`] (character classes, no vocabulary) and multiplied by the
//! model's calibration factor. Chat/Responses add the chat-template overhead counted by the
//! OpenAI cookbook "How to count tokens with tiktoken" (3 tokens per message plus 3 priming
//! the reply; <https://cookbook.openai.com/examples/how_to_count_tokens_with_tiktoken>).
//! Each media item adds its configured allowance ([`crate::estimate::MediaAllowance`]).
//! Token-id prompts are counted exactly.

use std::borrow::Cow;

use crate::estimate::{CharClassCosts, Estimator, Tally};
use crate::json_scan::{
    decode_escape, decode_str, BadString, RawPattern, Scanner, Syn, SyntaxError,
};

/// The top-level `model` string of a JSON object body, read with serde_json with nothing
/// else checked: the model of a body [`analyze`] rejects (a field of another type than the
/// API's, a malformed message, a repeated top-level field), so that a request routed by
/// load alone still goes to an endpoint that serves its model, and an error reply can name
/// it. When `model` is repeated, the last one counts, as Python's `json` (so vLLM's and
/// SGLang's pydantic request models) reads such a body. `None` when the body is not a JSON
/// object, or its (last) `model` is absent or not a string; a `model` key nested inside
/// another value does not count. Keys are compared with their escapes decoded, and a key
/// or ignored value with a lone surrogate escape (which Python's `json` accepts) does not
/// hide the model. Parses the whole body, keeping no value but the model's:
/// for the error path only.
pub fn requested_model(body: &[u8]) -> Option<String> {
    use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
    use std::fmt;

    /// Whether an object key (escapes decoded) is `model`, without keeping it.
    struct IsModel(bool);
    impl<'de> serde::Deserialize<'de> for IsModel {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Key;
            impl Visitor<'_> for Key {
                type Value = IsModel;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("an object key")
                }
                fn visit_bytes<E: serde::de::Error>(self, k: &[u8]) -> Result<IsModel, E> {
                    Ok(IsModel(k == b"model"))
                }
            }
            // As bytes: serde_json decodes the escapes but lets a lone surrogate through
            // (as WTF-8), which Python's `json` accepts in a key too; as a `str` it was
            // an error that left the whole body without a model.
            d.deserialize_bytes(Key)
        }
    }

    /// The top-level object's last `model` value, when a string.
    struct LastModel;
    impl<'de> Visitor<'de> for LastModel {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut model = None;
            while let Some(IsModel(is_model)) = map.next_key()? {
                if is_model {
                    model = match map.next_value::<serde_json::Value>()? {
                        serde_json::Value::String(s) => Some(s),
                        _ => None,
                    };
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(model)
        }
    }

    let mut de = serde_json::Deserializer::from_slice(body);
    let model = de.deserialize_map(LastModel).ok()?;
    de.end().ok()?;
    model
}

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
    /// Prompts of a `/v1/completions` (or embeddings) batch: the length of a `prompt` that
    /// is an array of strings or of token-id arrays, each completed on its own, `n` times;
    /// 1 for any other request.
    pub prompts: u32,
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
    /// Whole from [`analyze`]; only its first bytes from [`analyze_bounded`].
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

/// Tokens of chat-template overhead per message (OpenAI cookbook, see the module doc).
pub const TOKENS_PER_MESSAGE: u64 = 3;
/// Tokens priming the assistant reply (OpenAI cookbook, see the module doc).
pub const TOKENS_REPLY_PRIMING: u64 = 3;

/// Semantic outcome of reading one field: the first error in the order the fields are
/// checked (see [`analyze_bounded`]).
type Sem = Result<(), AnalysisError>;

/// Accumulates the rendered prefix text (up to `prefix_limit` bytes) and the token tally.
struct Acc<'e> {
    estimator: &'e Estimator,
    prefix: String,
    prefix_limit: usize,
    tally: Tally,
    overhead_tokens: u64,
    exact_tokens: u64,
    exact: bool,
    media: MediaCounts,
    /// Prompts of a batch `prompt` ([`RequestAnalysis::prompts`]).
    prompts: u32,
    /// A sampling window's text, decoded ahead of the tally ([`Self::string`]).
    window: String,
    /// Raw bytes (escapes undecoded) the tally took as text between sampling windows
    /// ([`Scanner::skip_raw`]).
    skipped_raw: u64,
    /// Raw and decoded bytes of the strings' text that was decoded past the rendering (the
    /// windows and the pieces around them, a sample of the same stretch of text as the
    /// skipped bytes): how much the escapes shrink the skipped bytes
    /// ([`Self::prompt_tokens`]). Not the rendering's: escapes can be far denser there than
    /// in the rest (a system prompt of emoji or CJK text written as `\u` escapes before an
    /// English document was 21-35 % off when it was mixed in).
    sample_raw: u64,
    sample_decoded: u64,
    /// Where the current string passed the rendering's end: cursor, [`Tally::fed`] and
    /// [`Self::skipped_raw`] there.
    tail_mark: Option<(usize, u64, u64)>,
}

/// Plain bytes (decoded 1:1) added to the sample of how much escapes shrink the skipped
/// bytes ([`Acc::prompt_tokens`]): a quarter of a sampling window, so that a sample of a
/// few bytes moves the estimate little and a window's worth or more decides it.
const SAMPLE_PRIOR_BYTES: u128 = 64;

/// Bytes decoded ahead in one round ([`Acc::string`]): a sampling window (256 bytes) fits
/// in one; a tally that counts every byte reads on in rounds of this.
const WINDOW_READ_BYTES: usize = 4096;
/// Bytes decoded past what the tally reads in a round: the walk takes whole 32-byte steps
/// only, and the tally finishes the word a window's end cuts; both in the same call, where
/// the bytes left over went piece by piece (~480 Wasm operations per window at 1 MiB,
/// docs/overhead.md). Past the window the tally only counts them.
const WINDOW_READ_PAST_BYTES: usize = 64;

/// Longest stretch read as a piece within this many bytes of the rendering's end and past
/// it (the pieces the walks leave: after a `\u` escape, where a walk stopped): then back
/// to [`Scanner::skip_raw`].
const PAST_RENDERING_STRETCH_BYTES: usize = 64;

/// A role marker in the rendering: `<|role|>\n` ([`Acc::role`], [`Acc::role_before`]).
const ROLE_OPEN: &str = "<|";
const ROLE_CLOSE: &str = "|>\n";
/// Room for a role marker built on the stack by [`Acc::role_before`].
const MARKER_BYTES: usize = 64;

impl<'e> Acc<'e> {
    /// `body_len`, the request body's size in bytes, sizes the prefix rendering once
    /// (the rendering is never longer than the body's text up to `prefix_limit`, plus role
    /// markers, the last character past the limit and a marker [`Self::role_before`]
    /// puts in before cutting): growing it chunk by chunk was ~5 reallocations per 1 KiB
    /// chat request.
    /// `rendering` is a buffer to render into (cleared first), or an empty `String`.
    fn new(
        estimator: &'e Estimator,
        prefix_limit: usize,
        body_len: usize,
        mut rendering: String,
    ) -> Self {
        rendering.clear();
        rendering.reserve(body_len.min(prefix_limit.saturating_add(MARKER_BYTES + 3)));
        Self {
            estimator,
            prefix: rendering,
            prefix_limit,
            tally: estimator.tally(),
            overhead_tokens: 0,
            exact_tokens: 0,
            exact: false,
            media: MediaCounts::default(),
            prompts: 1,
            window: String::new(),
            skipped_raw: 0,
            sample_raw: 0,
            sample_decoded: 0,
            tail_mark: None,
        }
    }

    /// Write the role marker of a message whose content was rendered before its role, in
    /// place from byte `start` of the prefix: the marker goes in before that content, and
    /// the result is cut where [`Self::push_prefix`] would have cut the marker and content
    /// pushed in order (at the first character boundary at or past the limit), so the
    /// rendering is the one of a role-first message. One move of the content for a role
    /// of up to [`MARKER_BYTES`] − 5 bytes (the standard roles and any other name that
    /// short), three past it; a second buffer for the content (the way before) touched a
    /// second body-sized stretch of memory per request (docs/overhead.md, the
    /// twenty-third change). Out of line: inlined into `message_from` it changed that
    /// function's code enough to cost 5 % of a warm native decision on every body.
    #[inline(never)]
    fn role_before(&mut self, start: usize, role: &str) {
        if start >= self.prefix.len() {
            // Nothing was rendered: the marker goes at the end, as for a role-first message.
            self.role(role);
            return;
        }
        self.overhead_tokens = self.overhead_tokens.saturating_add(TOKENS_PER_MESSAGE);
        let mut buf = [0u8; MARKER_BYTES];
        let len = ROLE_OPEN.len() + role.len() + ROLE_CLOSE.len();
        let marker = buf.get_mut(..len).and_then(|m| {
            let (open, rest) = m.split_at_mut(ROLE_OPEN.len());
            let (name, close) = rest.split_at_mut(role.len());
            open.copy_from_slice(ROLE_OPEN.as_bytes());
            name.copy_from_slice(role.as_bytes());
            close.copy_from_slice(ROLE_CLOSE.as_bytes());
            std::str::from_utf8(m).ok()
        });
        match marker {
            Some(m) => self.prefix.insert_str(start, m),
            None => {
                for piece in [ROLE_CLOSE, role, ROLE_OPEN] {
                    self.prefix.insert_str(start, piece);
                }
            }
        }
        if self.prefix.len() > self.prefix_limit {
            let mut cut = self.prefix_limit;
            while !self.prefix.is_char_boundary(cut) {
                cut += 1;
            }
            self.prefix.truncate(cut);
        }
    }

    /// Append to the prefix text while it is shorter than the limit; the last piece is
    /// kept up to the first character boundary at or past the limit, so the first
    /// `prefix_limit` bytes are exactly those of the unbounded rendering.
    #[inline]
    fn push_prefix(&mut self, s: &str) {
        let room = self.prefix_limit.saturating_sub(self.prefix.len());
        if room == 0 {
            return;
        }
        if s.len() <= room {
            self.prefix.push_str(s);
            return;
        }
        let mut cut = room;
        while !s.is_char_boundary(cut) {
            cut += 1;
        }
        self.prefix.push_str(s.get(..cut).unwrap_or(s));
    }

    /// Append text that is both hashed and counted.
    fn text(&mut self, s: &str) {
        self.push_prefix(s);
        self.tally.feed(s.as_bytes());
        self.tally.end_text();
    }

    /// At a JSON string: read it, hashing and counting its decoded text. The unescaped
    /// stretches are borrowed from the body; the string is always consumed, and a lone
    /// surrogate escape makes it a [`BadString`] (the rest is only checked for syntax).
    ///
    /// While the prefix rendering has room, the decoded string is only appended to it,
    /// and the tally reads it from there in one call when the string ends: per stretch
    /// (chat text has an escape every ~64 bytes) a tally call cost more than the copy
    /// (8 % of a 16 KiB request's Wasm operations, docs/overhead.md). From the piece
    /// that reaches the limit on, the pieces go to the tally one by one. The tally's
    /// result does not depend on how a text is split (`estimate.rs`), so both give the
    /// same counts. Past the limit, a sampled tally's windows are decoded ahead and the
    /// bytes between them skipped raw (see [`analyze_bounded`]).
    fn string(&mut self, sc: &mut Scanner<'_>) -> Syn<Result<(), BadString>> {
        sc.open_quote()?;
        self.string_after_quote(sc)
    }

    /// [`Self::string`] after its opening quote.
    fn string_after_quote(&mut self, sc: &mut Scanner<'_>) -> Syn<Result<(), BadString>> {
        self.tail_mark = None;
        if self.prefix.len() >= self.prefix_limit {
            // Past the rendering, between sampling windows: the first step of
            // `string_text`'s loop taken here, without its set-up and this function's
            // sample accounting. A string that closes before the next window (most of
            // them: a chat message's content, a role) is then done, nothing decoded
            // (~630 → ~490 Wasm operations for a short one, docs/overhead.md); one that
            // runs into the window goes on in `string_text`, marked where it started.
            let room = self.tally.skip_room();
            if room > 0 {
                let mark = (sc.pos(), self.tally.fed(), self.skipped_raw);
                let (passed, closed) = sc.skip_raw(usize::try_from(room).unwrap_or(usize::MAX));
                self.tally.skip(passed as u64);
                self.skipped_raw += passed as u64;
                if closed {
                    self.tally.end_text();
                    return Ok(Ok(()));
                }
                self.tail_mark = Some(mark);
            }
        }
        let r = self.string_text(sc)?;
        // What of the string was decoded past the rendering's end, raw and decoded: all of
        // it less what was skipped (the closing quote is not text).
        if let Some((pos, fed, skipped)) = self.tail_mark {
            let skipped = self.skipped_raw.saturating_sub(skipped);
            let raw = sc.pos().saturating_sub(pos + 1) as u64;
            self.sample_raw += raw.saturating_sub(skipped);
            self.sample_decoded += self.tally.fed().saturating_sub(fed).saturating_sub(skipped);
        }
        Ok(r)
    }

    /// [`Self::string`]'s reading of the text.
    #[inline(always)]
    fn string_text(&mut self, sc: &mut Scanner<'_>) -> Syn<Result<(), BadString>> {
        let mut ok = Ok(());
        // Start of this string in the rendering while the tally is deferred (`None`: the
        // pieces go to the tally as they come).
        let mut deferred = (self.prefix.len() < self.prefix_limit).then_some(self.prefix.len());
        if deferred.is_some() {
            // While the rendering has room for a whole 32-byte step and one more byte:
            // copy plain text and one-letter escapes (nearly every escape of chat text)
            // without the general loop's checks (`Scanner::walk_plain`); the rest of the
            // string, from a character boundary, goes on below. Each byte decodes to at
            // most one, so the walk stays short of the limit, whose cut is the loop's.
            let room = self.prefix_limit.saturating_sub(self.prefix.len() + 1);
            if sc.decode_plain_into(room, &mut self.prefix).closed {
                self.undefer(&mut deferred);
                self.tally.end_text();
                return Ok(ok);
            }
        }
        loop {
            if deferred.is_none() && ok.is_ok() && self.prefix.len() >= self.prefix_limit {
                // Past the rendering's limit: the bytes before the next sampling window
                // are skipped raw (`Scanner::skip_raw`), neither decoded nor checked; what
                // is decoded from here on is the sample of how much escapes shrink them.
                if self.tail_mark.is_none() {
                    self.tail_mark = Some((sc.pos(), self.tally.fed(), self.skipped_raw));
                }
                let room = self.tally.skip_room();
                if room > 0 {
                    // Raw bytes, not decoded ones: the tally takes them as text, and
                    // `prompt_tokens` takes the escapes' share back out.
                    let room = usize::try_from(room).unwrap_or(usize::MAX);
                    let (passed, closed) = sc.skip_raw(room);
                    self.tally.skip(passed as u64);
                    self.skipped_raw += passed as u64;
                    if closed {
                        break;
                    }
                }
                // In a sampling window: its text is decoded ahead (`Scanner::walk_plain`,
                // at most `WINDOW_READ_BYTES` per round) and fed to the tally in one call,
                // not piece by piece.
                let read = usize::try_from(self.tally.read_room()).unwrap_or(usize::MAX);
                if read > 0 {
                    self.window.clear();
                    let limit = read.min(WINDOW_READ_BYTES) + WINDOW_READ_PAST_BYTES;
                    let walk = sc.decode_plain_into(limit, &mut self.window);
                    self.tally.feed(self.window.as_bytes());
                    if walk.closed {
                        break;
                    }
                }
            }
            // At or past the rendering's end a stretch may not run on unbounded (to the
            // string's end in text without escapes): the skip above takes what it can.
            let bounded = self.prefix.len() + PAST_RENDERING_STRETCH_BYTES > self.prefix_limit;
            let n = if bounded {
                sc.string_stretch_within(PAST_RENDERING_STRETCH_BYTES)
            } else {
                sc.string_stretch()
            };
            // A piece after a lone surrogate is not read, but it is text: still validated.
            let piece = if n > 0 { sc.ahead(n)? } else { "" };
            if ok.is_ok() && n > 0 {
                match deferred {
                    Some(_) if self.prefix.len() + piece.len() <= self.prefix_limit => {
                        self.prefix.push_str(piece);
                    }
                    _ => {
                        self.undefer(&mut deferred);
                        self.push_prefix(piece);
                        self.tally.feed(piece.as_bytes());
                    }
                }
            }
            sc.advance(n);
            if bounded
                && sc
                    .rest()
                    .first()
                    .is_some_and(|&c| c != b'"' && c != b'\\' && c >= 0x20)
            {
                // The bound ended the stretch, not a special byte.
                continue;
            }
            // One-letter escapes (`\n`, `\"`, ...: nearly all of them in chat text) are
            // read inline; the general reader (a call returning a `Result`) and decoder
            // take `\u` escapes, the closing quote and errors.
            let (ch, used) = if let Some(b) = sc.one_letter_escape() {
                if ok.is_err() {
                    continue;
                }
                (char::from(b), 1)
            } else {
                let Some((esc, _)) = sc.escape()? else {
                    break;
                };
                if ok.is_err() {
                    continue;
                }
                match decode_escape(esc) {
                    Ok(d) => d,
                    Err(BadString) => {
                        ok = Err(BadString);
                        continue;
                    }
                }
            };
            if used > 5 {
                // A surrogate pair: its second escape is part of this character.
                sc.escape()?;
            }
            // One character: `String::push`, not a `push_str` of 1..4 bytes (a `memcpy`
            // call per escape, ~one every 64 bytes of chat text). Same cut as
            // `push_prefix`: a character that starts inside the limit is kept whole.
            if self.prefix.len() < self.prefix_limit {
                self.prefix.push(ch);
                if deferred.is_some() {
                    continue;
                }
            } else {
                self.undefer(&mut deferred);
            }
            let mut buf = [0u8; 4];
            self.tally.feed(ch.encode_utf8(&mut buf).as_bytes());
        }
        self.undefer(&mut deferred);
        self.tally.end_text();
        Ok(ok)
    }

    /// Hand the rendering of the current string since `deferred` to the tally, and count
    /// the rest of the string piece by piece.
    fn undefer(&mut self, deferred: &mut Option<usize>) {
        if let Some(start) = deferred.take() {
            self.tally
                .feed(self.prefix.as_bytes().get(start..).unwrap_or_default());
        }
    }

    /// True when the prefix rendering has reached its limit: nothing more is appended.
    #[inline]
    fn rendering_full(&self) -> bool {
        self.prefix.len() >= self.prefix_limit
    }

    /// Append a structural marker that is hashed but not counted (template overhead is
    /// counted separately).
    fn marker(&mut self, s: &str) {
        self.push_prefix(s);
    }

    fn role(&mut self, role: &str) {
        self.push_prefix(ROLE_OPEN);
        self.push_prefix(role);
        self.push_prefix(ROLE_CLOSE);
        self.overhead_tokens = self.overhead_tokens.saturating_add(TOKENS_PER_MESSAGE);
    }

    fn media(&mut self, kind: &str, data: &str) {
        if self.prefix.len() < self.prefix_limit {
            let h = xxhash_rust::xxh64::xxh64(data.as_bytes(), 0);
            let mut tag = String::with_capacity(kind.len() + 21);
            tag.push_str("<|");
            tag.push_str(kind);
            tag.push(':');
            push_hex(&mut tag, h);
            tag.push_str("|>");
            self.push_prefix(&tag);
        }
        match kind {
            "image" => self.media.images = self.media.images.saturating_add(1),
            "audio" => self.media.audio = self.media.audio.saturating_add(1),
            _ => self.media.video = self.media.video.saturating_add(1),
        }
    }

    fn file(&mut self, data: &str) {
        if self.prefix.len() < self.prefix_limit {
            let mut tag = String::with_capacity(25);
            tag.push_str("<|file:");
            push_hex(&mut tag, xxhash_rust::xxh64::xxh64(data.as_bytes(), 0));
            tag.push_str("|>");
            self.push_prefix(&tag);
        }
    }

    /// One id of a token-id prompt: counted exactly, rendered as decimal numbers separated
    /// by single spaces (`first` starts a new array).
    fn token_id(&mut self, first: bool, id: u32) {
        if self.prefix.len() < self.prefix_limit {
            if !first {
                self.push_prefix(" ");
            }
            let mut buf = [0u8; 10];
            let mut at = buf.len();
            let mut v = id;
            loop {
                at -= 1;
                if let Some(d) = buf.get_mut(at) {
                    *d = b'0' + (v % 10) as u8;
                }
                v /= 10;
                if v == 0 || at == 0 {
                    break;
                }
            }
            let digits = buf.get(at..).unwrap_or(&[]);
            self.push_prefix(std::str::from_utf8(digits).unwrap_or(""));
        }
        self.exact_tokens = self.exact_tokens.saturating_add(1);
    }

    /// The estimate. Between sampling windows the tally was handed raw bytes, in which
    /// each escape is 2 to 12 bytes for a decoded 1 to 4 (`\n` 2 → 1, `\u4e1c` 6 → 3):
    /// they are scaled by decoded ÷ raw bytes of the text decoded past the rendering (the
    /// windows and the pieces around them: a sample of the same stretch of text), and the
    /// difference is taken out of the tally's tail ([`Tally::untake`]). Without such a
    /// sample (a body that ends before the first window past the rendering: at most one
    /// stride skipped) they stay as counted.
    fn prompt_tokens(&mut self, model: Option<&str>) -> u64 {
        if self.skipped_raw > 0 && self.sample_raw > 0 {
            // `SAMPLE_PRIOR_BYTES` of plain text added to the sample: a tiny one (a window
            // the body's end cuts to a few bytes, one of them a 6-byte `\u` escape) must
            // not shrink kilobytes by its ratio (a generated 10 KB body came out 23 % low).
            let raw = u128::from(self.sample_raw) + SAMPLE_PRIOR_BYTES;
            let shrunk = u128::from(self.skipped_raw)
                * u128::from(self.sample_raw.saturating_sub(self.sample_decoded))
                / raw;
            self.tally
                .untake(u64::try_from(shrunk).unwrap_or(self.skipped_raw));
        }
        let cal = self.estimator.calibration(model);
        let text = (self.tally.tokens(&CharClassCosts::default()) * cal).ceil();
        let text = if text.is_finite() && text > 0.0 {
            text as u64
        } else {
            0
        };
        let allow = &self.estimator.config.media;
        let media = u64::from(self.media.images) * u64::from(allow.image_tokens)
            + u64::from(self.media.audio) * u64::from(allow.audio_tokens)
            + u64::from(self.media.video) * u64::from(allow.video_tokens);
        text.saturating_add(self.overhead_tokens)
            .saturating_add(self.exact_tokens)
            .saturating_add(media)
    }
}

fn push_hex(out: &mut String, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        let nibble = ((v >> (shift * 4)) & 0xf) as usize;
        out.push(char::from(HEX.get(nibble).copied().unwrap_or(b'0')));
    }
}

fn invalid(field: impl Into<String>, expected: &'static str) -> AnalysisError {
    AnalysisError::InvalidField {
        field: field.into(),
        expected,
    }
}

fn missing(field: impl Into<String>) -> AnalysisError {
    AnalysisError::MissingField {
        field: field.into(),
    }
}

fn first_byte(token: &str) -> u8 {
    token.as_bytes().first().copied().unwrap_or(b' ')
}

/// A string field (the raw token) decoded: borrowed unless it has escapes.
fn de_str<'a>(token: &'a str, field: &dyn Fn() -> String) -> Result<Cow<'a, str>, AnalysisError> {
    if first_byte(token) != b'"' {
        return Err(invalid(field(), "a string"));
    }
    decode_str(token).map_err(|_| invalid(field(), "a string"))
}

/// A JSON number token as a non-negative integer: `256`, or a number with no fractional
/// part (`256.0`, `2.56e2`, what Python's `json` writes for a float), which vLLM's and
/// SGLang's request models accept for their integer fields (pydantic's lax mode takes a
/// float whose fractional part is 0). `None` for a negative or fractional number, one of
/// 2^64 or more, and anything not a number (`"256"` included).
pub(crate) fn json_uint(token: &str) -> Option<u64> {
    if let Ok(v) = serde_json::from_str::<u64>(token) {
        return Some(v);
    }
    let f = serde_json::from_str::<f64>(token).ok()?;
    // 2^64 is exact in f64; every integral f64 below it converts exactly.
    (f >= 0.0 && f.fract() == 0.0 && f < 18_446_744_073_709_551_616.0).then_some(f as u64)
}

/// A JSON number token as an `i32`, integral floats included, as [`json_uint`] reads a
/// non-negative integer (vLLM's `priority`).
fn json_i32(token: &str) -> Option<i32> {
    if let Ok(v) = serde_json::from_str::<i32>(token) {
        return Some(v);
    }
    let f = serde_json::from_str::<f64>(token).ok()?;
    (f.fract() == 0.0 && f >= f64::from(i32::MIN) && f <= f64::from(i32::MAX)).then_some(f as i32)
}

fn de_u64(token: Option<&str>, field: &str) -> Result<Option<u64>, AnalysisError> {
    match token {
        None => Ok(None),
        Some(t) => json_uint(t)
            .map(Some)
            .ok_or_else(|| invalid(field, "a non-negative integer")),
    }
}

fn de_limit(token: Option<&str>, field: &str) -> Result<Option<u32>, AnalysisError> {
    Ok(de_u64(token, field)?.map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
}

/// A token id as serde_json reads a `u32` (plain digits on the fast path).
fn token_id(token: &str) -> Option<u32> {
    let b = token.as_bytes();
    if !b.is_empty() && b.len() <= 10 && b.iter().all(u8::is_ascii_digit) {
        let v = b.iter().fold(0u64, |v, &d| v * 10 + u64::from(d - b'0'));
        return u32::try_from(v).ok();
    }
    serde_json::from_str::<u32>(token).ok()
}

fn byte_position(body: &[u8], offset: usize) -> (usize, usize) {
    let head = body.get(..offset).unwrap_or(body);
    let line = 1 + head.iter().filter(|&&b| b == b'\n').count();
    let column = 1 + head.iter().rev().take_while(|&&b| b != b'\n').count();
    (line, column)
}

fn syntax(body: &[u8], e: SyntaxError) -> AnalysisError {
    let (line, column) = byte_position(body, e.pos);
    AnalysisError::InvalidJson {
        line,
        column,
        message: format!("{} at line {line} column {column}", e.message),
    }
}

/// Run `f` on a value already validated by the top-level scan (a field kept as its raw
/// token). It cannot meet a syntax error; one would be reported as the field's error.
fn on_token<'a>(
    token: &'a str,
    field: &dyn Fn() -> String,
    f: impl FnOnce(&mut Scanner<'a>) -> Syn<Sem>,
) -> Sem {
    let mut sc = Scanner::new(token);
    f(&mut sc).unwrap_or_else(|_| Err(invalid(field(), "valid JSON")))
}

/// At an object (after its `{`): the raw tokens of the fields named in `names` (`None`
/// when absent or `null`), other fields skipped. `Ok(Err(()))` when a name repeats or a
/// key is not a valid string: serde's derived structs refuse both.
fn fields<'a, const N: usize>(
    sc: &mut Scanner<'a>,
    names: [&str; N],
) -> Syn<Result<[Option<&'a str>; N], ()>> {
    let mut out = [None; N];
    let mut seen = [false; N];
    let mut bad = false;
    if sc.empty(b'}') {
        return Ok(Ok(out));
    }
    loop {
        match sc.key_name()? {
            Err(BadString) => {
                bad = true;
                sc.skip_value()?;
            }
            Ok(name) => match names.iter().position(|n| *n == name) {
                Some(i) => {
                    if let Some(s) = seen.get_mut(i) {
                        bad |= *s;
                        *s = true;
                    }
                    if !sc.null()? {
                        let t = sc.skip_value()?;
                        if let Some(o) = out.get_mut(i) {
                            *o = Some(t);
                        }
                    }
                }
                None => {
                    sc.skip_value()?;
                }
            },
        }
        if !sc.comma_or_close(b'}')? {
            break;
        }
    }
    Ok(if bad { Err(()) } else { Ok(out) })
}

/// The top-level fields read from any body; everything else is skipped unbuilt.
const TOP: [&str; 15] = [
    "model",
    "messages",
    "tools",
    "prompt",
    "input",
    "instructions",
    "stream",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "cache_salt",
    "priority",
    "inputs",     // TGI native `/generate`
    "parameters", // TGI native `/generate`
];

/// The prompt field an API's body is read around, as the scan meets it.
fn main_field(api: ApiKind) -> Option<&'static str> {
    match api {
        ApiKind::ChatCompletions => Some("messages"),
        ApiKind::Completions => Some("prompt"),
        ApiKind::Responses | ApiKind::Embeddings => Some("input"),
        ApiKind::Other => None,
    }
}

/// What reading the main prompt field found.
enum Main {
    /// Absent or `null`.
    Absent,
    /// Chat `messages` that is not an array (checked before `tools`).
    Shape(AnalysisError),
    /// Read; the first error of its elements, if any.
    Read(Sem),
}

/// Analyse one request body of the given API.
///
/// `body` is the raw HTTP body (UTF-8 JSON object). Errors: [`AnalysisError::InvalidJson`]
/// for bytes that are not a UTF-8 JSON object; [`AnalysisError::MissingField`] when `model`
/// (or the API's prompt field) is absent; [`AnalysisError::InvalidField`] naming the JSON
/// path of a field with the wrong type or value. Never panics on any input.
///
/// [`RequestAnalysis::prefix_text`] is the whole rendering; the router, which hashes only
/// the first [`crate::prefix::PrefixConfig::max_bytes`] bytes, calls [`analyze_bounded`].
pub fn analyze(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
) -> Result<RequestAnalysis, AnalysisError> {
    analyze_bounded(api, body, estimator, usize::MAX)
}

/// [`analyze`], rendering [`RequestAnalysis::prefix_text`] only up to `prefix_bytes` bytes
/// (cut at the first character boundary at or past it). The first `prefix_bytes` bytes of
/// the prefix text equal those of [`analyze`]'s, so [`crate::prefix::block_hashes`] with
/// `max_blocks × block_chars ≤ prefix_bytes` gives the same hashes. Nothing past the
/// rendering is copied: on a 1 MiB conversation only the first blocks are rendered.
///
/// Past the rendering, with a sampling estimator ([`Estimator::default`]), the string
/// bytes between the tally's sampling windows are skipped raw (only each string's end is
/// looked for, `json_scan::Scanner::skip_raw`): they are neither decoded nor checked, so
/// a control character, a bad escape, a lone surrogate or a byte that is not UTF-8 there
/// is not an error (the body is validated as UTF-8 only where it is read as text,
/// `json_scan::Scanner::from_bytes`; anywhere else such a byte is an
/// [`AnalysisError::InvalidJson`] at that byte), and
/// `prompt_tokens` differs from [`analyze`]'s by the sample's noise (the windows fall a few
/// bytes apart; on the shared prompts as chat up to ~6 %, mean ~0). Every other field is
/// the same. With [`Estimator::every_byte`] nothing is skipped and every result is the same.
///
/// Order of checks (the first failing one is reported): JSON syntax and UTF-8 of the
/// whole body, in the scan's order (and no repeated top-level field), then `model`,
/// `stream`, `n`, `cache_salt`, `priority`, then the API's fields in the order of the
/// table in the module doc, the prompt's elements in array order.
pub fn analyze_bounded(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
    prefix_limit: usize,
) -> Result<RequestAnalysis, AnalysisError> {
    analyze_bounded_into(api, body, estimator, prefix_limit, String::new())
}

/// [`analyze_bounded`], rendering [`RequestAnalysis::prefix_text`] into `rendering`
/// (cleared first; its allocation is reused when it has room): a router analysing one
/// request after another passes back the last one's prefix text ([`crate::router::Router`]),
/// so the rendering costs no allocation per request. The result is the same.
pub fn analyze_bounded_into(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
    prefix_limit: usize,
    rendering: String,
) -> Result<RequestAnalysis, AnalysisError> {
    let mut acc = Acc::new(estimator, prefix_limit, body.len(), rendering);
    let (f, main) = scan_top(api, body, &mut acc).map_err(|e| syntax(body, e))?;
    let [model, _messages, tools_tok, prompt, input, instructions, stream, n, max_tokens, max_completion_tokens, max_output_tokens, cache_salt, priority, inputs, parameters] =
        f;

    let model = match model {
        Some(t) => {
            let m = de_str(t, &|| "model".into())?;
            if m.is_empty() {
                return Err(invalid("model", "a non-empty string"));
            }
            Some(m.into_owned())
        }
        None if api == ApiKind::Other => None,
        None => return Err(missing("model")),
    };
    let stream = match stream {
        None => false,
        Some("true") => true,
        Some("false") => false,
        Some(_) => return Err(invalid("stream", "a boolean")),
    };
    let n = match de_u64(n, "n")? {
        None => 1,
        Some(0) => return Err(invalid("n", "an integer of at least 1")),
        Some(v) => u32::try_from(v).map_err(|_| invalid("n", "an integer of at most 2^32-1"))?,
    };
    let cache_salt = match cache_salt {
        None => None,
        Some(t) => Some(de_str(t, &|| "cache_salt".into())?.into_owned()),
    };
    let priority = match priority {
        None => 0,
        Some(t) => json_i32(t).ok_or_else(|| invalid("priority", "a 32-bit integer"))?,
    };

    // The main field was rendered during the scan; what precedes it in the rendering
    // (tool definitions, instructions) is rendered now, and the two are joined below.
    let main_text = std::mem::take(&mut acc.prefix);
    let main_result = |main: Main, field: &str| match main {
        Main::Absent => Err(missing(field)),
        Main::Shape(e) => Err(e),
        Main::Read(r) => r,
    };
    let max_output_tokens = match api {
        ApiKind::ChatCompletions => {
            let mct = de_limit(max_completion_tokens, "max_completion_tokens")?;
            let mt = de_limit(max_tokens, "max_tokens")?;
            match main {
                Main::Absent => return Err(missing("messages")),
                Main::Shape(e) => return Err(e),
                Main::Read(r) => {
                    tools(&mut acc, tools_tok)?;
                    r?;
                }
            }
            acc.overhead_tokens = acc.overhead_tokens.saturating_add(TOKENS_REPLY_PRIMING);
            mct.or(mt)
        }
        ApiKind::Completions => {
            main_result(main, "prompt")?;
            let mct = de_limit(max_completion_tokens, "max_completion_tokens")?;
            mct.or(de_limit(max_tokens, "max_tokens")?)
        }
        ApiKind::Responses => {
            tools(&mut acc, tools_tok)?;
            if let Some(ins) = instructions {
                if first_byte(ins) != b'"' {
                    return Err(invalid("instructions", "a string"));
                }
                acc.role("system");
                on_token(ins, &|| "instructions".into(), |sc| {
                    Ok(acc
                        .string(sc)?
                        .map_err(|_| invalid("instructions", "a string")))
                })?;
                acc.marker("\n");
            }
            main_result(main, "input")?;
            acc.overhead_tokens = acc.overhead_tokens.saturating_add(TOKENS_REPLY_PRIMING);
            de_limit(max_output_tokens, "max_output_tokens")?
        }
        ApiKind::Embeddings => {
            main_result(main, "input")?;
            Some(0)
        }
        ApiKind::Other => other(
            &mut acc,
            inputs,
            prompt,
            parameters,
            max_tokens,
            max_completion_tokens,
        )?,
    };
    let _ = input;
    if acc.prefix.is_empty() && main_text.len() <= acc.prefix_limit {
        // Nothing rendered ahead of the main field (no tools, no instructions): the
        // rendering is the main field's, moved back rather than copied into a new buffer.
        acc.prefix = main_text;
    } else {
        acc.push_prefix(&main_text);
    }

    Ok(RequestAnalysis {
        api,
        prompt_tokens: acc.prompt_tokens(model.as_deref()),
        prompt_tokens_exact: acc.exact,
        model,
        stream,
        n,
        prompts: acc.prompts,
        max_output_tokens,
        prefix_text: acc.prefix,
        cache_salt,
        priority,
        media: acc.media,
    })
}

/// The one pass over the body: syntax of everything, the raw tokens of the top-level fields
/// in [`TOP`], and the API's main prompt field read in place into `acc`.
fn scan_top<'a>(
    api: ApiKind,
    body: &'a [u8],
    acc: &mut Acc<'_>,
) -> Syn<([Option<&'a str>; 15], Main)> {
    // The body is validated as UTF-8 where it is read as text (`Scanner::from_bytes`):
    // its first `prefix_limit` bytes, which the rendering reads, in one pass now.
    let mut sc = Scanner::from_bytes(body, acc.prefix_limit);
    if sc.peek() != Some(b'{') {
        let start = sc.pos();
        sc.skip_value()?;
        sc.end()?;
        return Err(SyntaxError {
            pos: start,
            message: "the body must be a JSON object".into(),
        });
    }
    sc.advance(1);
    let main_key = main_field(api);
    let mut out = [None; 15];
    let mut seen = [false; 15];
    let mut main = Main::Absent;
    if !sc.empty(b'}') {
        loop {
            let at = sc.pos();
            let name = sc.key_name()?.map_err(|_| SyntaxError {
                pos: at,
                message: "invalid unicode code point in a key".into(),
            })?;
            match TOP.iter().position(|n| *n == name) {
                Some(i) => {
                    if let Some(s) = seen.get_mut(i) {
                        if *s {
                            return sc.error(format!("duplicate field `{name}`"));
                        }
                        *s = true;
                    }
                    if sc.null()? {
                    } else if main_key == Some(&*name) {
                        main = match api {
                            ApiKind::ChatCompletions => messages(acc, &mut sc)?,
                            ApiKind::Responses => Main::Read(responses_input(acc, &mut sc)?),
                            _ => Main::Read(prompt_like(acc, &mut sc, main_key.unwrap_or(""))?),
                        };
                    } else {
                        let t = sc.skip_value()?;
                        if let Some(o) = out.get_mut(i) {
                            *o = Some(t);
                        }
                    }
                }
                None => {
                    sc.skip_value()?;
                }
            }
            if !sc.comma_or_close(b'}')? {
                break;
            }
        }
    }
    sc.end()?;
    Ok((out, main))
}

fn tools(acc: &mut Acc<'_>, token: Option<&str>) -> Sem {
    if let Some(t) = token {
        if first_byte(t) != b'[' {
            return Err(invalid("tools", "an array of tool definitions"));
        }
        acc.role("tools");
        acc.text(t);
        acc.marker("\n");
    }
    Ok(())
}

/// The fields of a chat message that [`message`] reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MessageField {
    Role,
    Content,
    ToolCalls,
    Other,
}

/// A message's keys as compact JSON and Python's `json.dumps` write them, told by one
/// masked compare each ([`Scanner::raw_match`]): read by name, a `json.dumps` key cost ~190
/// Wasm operations more (4,000 short messages: 7.61 M against 6.10 M compact). Other forms
/// are read by name.
const MESSAGE_KEYS: [(RawPattern, MessageField); 6] = [
    (RawPattern::key("content"), MessageField::Content),
    (RawPattern::key("role"), MessageField::Role),
    (RawPattern::key("tool_calls"), MessageField::ToolCalls),
    (RawPattern::key_spaced("content"), MessageField::Content),
    (RawPattern::key_spaced("role"), MessageField::Role),
    (
        RawPattern::key_spaced("tool_calls"),
        MessageField::ToolCalls,
    ),
];

/// [`Scanner::raw_match`] of an object key, also after whitespace (`json.dumps` writes `, `
/// between fields): the whitespace is skipped only when the compact form missed, so compact
/// JSON pays nothing for it (skipping first cost ~17 Wasm operations per key).
#[inline]
fn raw_key<T: Copy>(sc: &mut Scanner<'_>, table: &[(RawPattern, T)]) -> Option<T> {
    if let Some(found) = sc.raw_match(table) {
        return Some(found);
    }
    if sc.rest().first().is_some_and(|&c| c <= b' ') {
        sc.peek();
        return sc.raw_match(table);
    }
    None
}

/// The chat roles of OpenAI's API as JSON strings with no escape; any other role is read
/// as a string.
const ROLE_VALUES: [(RawPattern, &str); 5] = [
    role("user"),
    role("assistant"),
    role("system"),
    role("tool"),
    role("developer"),
];

const fn role(name: &'static str) -> (RawPattern, &'static str) {
    (RawPattern::string(name), name)
}

/// Chat `messages`, read in place.
fn messages(acc: &mut Acc<'_>, sc: &mut Scanner<'_>) -> Syn<Main> {
    if sc.peek() != Some(b'[') {
        sc.skip_value()?;
        return Ok(Main::Shape(invalid("messages", "an array of messages")));
    }
    sc.advance(1);
    let mut res = Ok(());
    if !sc.empty(b']') {
        let mut i = 0usize;
        loop {
            if res.is_ok() {
                res = match quick_message(acc, sc, i)? {
                    Some(r) => r,
                    None => message(acc, sc, i)?,
                };
            } else {
                sc.skip_value()?;
            }
            i += 1;
            if !sc.comma_or_close(b']')? {
                break;
            }
        }
    }
    Ok(Main::Read(res))
}

/// A chat message of one of the two shapes nearly every client writes, `{"role":R,
/// "content":"…"}` or `{"content":"…","role":R}` (compact or as `json.dumps` writes them;
/// `R` one of [`ROLE_VALUES`]), past the rendering: its keys and role matched with raw
/// patterns ([`Scanner::raw_match`]), its content read by [`Acc::string`] (skipped raw
/// between sampling windows), and counted as [`message`] counts it. `None`, with the cursor
/// back where it was, for any other message before its content is read; one that turns
/// out otherwise after it (another field, another role) goes on in [`message_from`] from
/// after the content. So every result is [`message`]'s (the differential tests compare
/// both with the serde analyser), at ~0.8 k Wasm operations per message beyond its text
/// instead of ~1.25 k (docs/overhead.md).
fn quick_message(acc: &mut Acc<'_>, sc: &mut Scanner<'_>, i: usize) -> Syn<Option<Sem>> {
    if !acc.rendering_full() || sc.peek() != Some(b'{') {
        return Ok(None);
    }
    let at = sc.pos();
    sc.advance(1);
    // Values after whitespace too: the compact key pattern `"role":` also matches
    // `json.dumps`'s `"role": `, leaving the space.
    let role = |sc: &mut Scanner<'_>| {
        sc.peek();
        sc.raw_match(&ROLE_VALUES)
    };
    let key = |sc: &mut Scanner<'_>, want: MessageField| {
        (sc.peek() == Some(b',')).then(|| sc.advance(1))?;
        (raw_key(sc, &MESSAGE_KEYS)? == want).then_some(())
    };
    let quote = |sc: &mut Scanner<'_>| (sc.peek() == Some(b'"')).then(|| sc.advance(1));
    let close = |sc: &mut Scanner<'_>| (sc.peek() == Some(b'}')).then(|| sc.advance(1));
    let content_error = |_| invalid(format!("messages[{i}].content"), "a string");
    match raw_key(sc, &MESSAGE_KEYS) {
        Some(MessageField::Role) => {
            let Some(r) = (|| {
                let r = role(sc)?;
                key(sc, MessageField::Content)?;
                quote(sc)?;
                Some(r)
            })() else {
                sc.rewind(at);
                return Ok(None);
            };
            acc.role(r);
            let content = acc.string_after_quote(sc)?.map_err(content_error);
            if content.is_ok() && close(sc).is_some() {
                acc.marker("\n");
                return Ok(Some(Ok(())));
            }
            message_from(acc, sc, i, Some((true, content))).map(Some)
        }
        Some(MessageField::Content) => {
            if quote(sc).is_none() {
                sc.rewind(at);
                return Ok(None);
            }
            let content = acc.string_after_quote(sc)?.map_err(content_error);
            let after = sc.pos();
            if content.is_ok() {
                if let Some(r) = (|| {
                    key(sc, MessageField::Role)?;
                    let r = role(sc)?;
                    close(sc)?;
                    Some(r)
                })() {
                    acc.role(r);
                    acc.marker("\n");
                    return Ok(Some(Ok(())));
                }
            }
            sc.rewind(after);
            message_from(acc, sc, i, Some((false, content))).map(Some)
        }
        _ => {
            sc.rewind(at);
            Ok(None)
        }
    }
}

/// One chat message, read in place. `content` is rendered after the role marker; when it
/// comes before `role` (serde_json's and Go's sorted keys do that) it is rendered in place
/// and the role marker inserted before it ([`Acc::role_before`]). `tool_calls` is kept
/// raw and read after the object.
fn message(acc: &mut Acc<'_>, sc: &mut Scanner<'_>, i: usize) -> Syn<Sem> {
    message_from(acc, sc, i, None)
}

/// [`message`], or (`read` is `Some((role_read, content))`) its rest after a content
/// [`quick_message`] read: the message's first field, or its second after the role
/// (`role_read`, a known role already counted).
fn message_from(
    acc: &mut Acc<'_>,
    sc: &mut Scanner<'_>,
    i: usize,
    read: Option<(bool, Sem)>,
) -> Syn<Sem> {
    let path = |suffix: &str| format!("messages[{i}]{suffix}");
    let mut bad_object = false;
    let (mut role_seen, mut content_seen, mut calls_seen) = (false, false, false);
    let mut role_ok = false;
    let mut role_err = None;
    let mut content_read: Option<Sem> = None;
    // Where a content read before its role starts in the rendering.
    let mut content_start: Option<usize> = None;
    let mut calls_tok = None;
    // After a value already read, the next field comes after a comma.
    let mut after_value = false;
    match read {
        None => {
            if sc.peek() != Some(b'{') {
                sc.skip_value()?;
                return Ok(Err(invalid(path(""), "a message object")));
            }
            sc.advance(1);
        }
        Some((role_read, content)) => {
            (role_seen, role_ok) = (role_read, role_read);
            (content_seen, content_read) = (true, Some(content));
            after_value = true;
        }
    }
    if after_value || !sc.empty(b'}') {
        loop {
            if after_value && !sc.comma_or_close(b'}')? {
                break;
            }
            after_value = true;
            let field = match raw_key(sc, &MESSAGE_KEYS) {
                Some(field) => field,
                None => {
                    let Ok(name) = sc.key_name()? else {
                        bad_object = true;
                        sc.skip_value()?;
                        continue;
                    };
                    match &*name {
                        "role" => MessageField::Role,
                        "content" => MessageField::Content,
                        "tool_calls" => MessageField::ToolCalls,
                        _ => MessageField::Other,
                    }
                }
            };
            match field {
                MessageField::Role => {
                    bad_object |= role_seen;
                    role_seen = true;
                    if !sc.null()? {
                        let role = match sc.raw_match(&ROLE_VALUES) {
                            Some(role) => Ok(Cow::Borrowed(role)),
                            None => match sc.plain_string() {
                                Some(r) => Ok(Cow::Borrowed(r)),
                                None => de_str(sc.skip_value()?, &|| path(".role")),
                            },
                        };
                        match role {
                            Ok(role) if !bad_object => {
                                match content_start.take() {
                                    Some(start) => acc.role_before(start, &role),
                                    None => acc.role(&role),
                                }
                                role_ok = true;
                            }
                            Ok(_) => {}
                            Err(e) => role_err = Some(e),
                        }
                    }
                }
                MessageField::Content => {
                    bad_object |= content_seen;
                    content_seen = true;
                    if !sc.null()? {
                        if bad_object {
                            sc.skip_value()?;
                        } else {
                            if !role_ok {
                                // Rendered in place; the role marker goes in before it.
                                content_start = Some(acc.prefix.len());
                            }
                            content_read = Some(content(acc, sc, &|| path(".content"))?);
                        }
                    }
                }
                MessageField::ToolCalls => {
                    bad_object |= calls_seen;
                    calls_seen = true;
                    if !sc.null()? {
                        calls_tok = Some(sc.skip_value()?);
                    }
                }
                MessageField::Other => {
                    sc.skip_value()?;
                }
            }
        }
    }
    Ok((|| {
        if bad_object {
            return Err(invalid(path(""), "a message object"));
        }
        if let Some(e) = role_err {
            return Err(e);
        }
        if !role_ok {
            return Err(missing(path(".role")));
        }
        if let Some(r) = content_read {
            r?;
        }
        if let Some(t) = calls_tok {
            tool_calls(acc, t, &path(".tool_calls"))?;
        }
        acc.marker("\n");
        Ok(())
    })())
}

/// Message content: string, null, or an array of parts.
fn content(acc: &mut Acc<'_>, sc: &mut Scanner<'_>, path: &dyn Fn() -> String) -> Syn<Sem> {
    match sc.peek() {
        Some(b'"') => Ok(acc.string(sc)?.map_err(|_| invalid(path(), "a string"))),
        Some(b'n') if sc.null()? => Ok(Ok(())),
        Some(b'[') => {
            sc.advance(1);
            let mut res = Ok(());
            if !sc.empty(b']') {
                let mut j = 0usize;
                loop {
                    if res.is_ok() {
                        res = part(acc, sc, &|| format!("{}[{j}]", path()))?;
                    } else {
                        sc.skip_value()?;
                    }
                    j += 1;
                    if !sc.comma_or_close(b']')? {
                        break;
                    }
                }
            }
            Ok(res)
        }
        _ => {
            sc.skip_value()?;
            Ok(Err(invalid(
                path(),
                "a string or an array of content parts",
            )))
        }
    }
}

const PART: [&str; 8] = [
    "type",
    "text",
    "image_url",
    "input_audio",
    "video_url",
    "refusal",
    "file_data",
    "file_id",
];

/// `PART`'s first two keys, compact and as `json.dumps` writes them, with their index
/// there, for [`raw_key`].
const PART_KEYS: [(RawPattern, usize); 4] = [
    (RawPattern::key("type"), 0),
    (RawPattern::key("text"), 1),
    (RawPattern::key_spaced("type"), 0),
    (RawPattern::key_spaced("text"), 1),
];
/// The token of a text part's `type`, and its pattern.
const TEXT_TYPE_TOKEN: &str = r#""text""#;
const TEXT_TYPE: [(RawPattern, ()); 1] = [(RawPattern::string("text"), ())];

/// What a content part of a given `type` is read as (Chat and Responses names).
#[derive(Clone, Copy, PartialEq, Eq)]
enum PartKind {
    Text,
    Refusal,
    Image,
    Audio,
    Video,
    File,
    /// Any other type: hashed by its JSON, not counted.
    Other,
}

fn part_kind(kind: &str) -> PartKind {
    match kind {
        "text" | "input_text" | "output_text" => PartKind::Text,
        "refusal" => PartKind::Refusal,
        "image_url" | "input_image" => PartKind::Image,
        "input_audio" => PartKind::Audio,
        "video_url" | "input_video" => PartKind::Video,
        "file" | "input_file" => PartKind::File,
        _ => PartKind::Other,
    }
}

/// One content part. The `text` of a text part is read in place when `type` came first.
fn part(acc: &mut Acc<'_>, sc: &mut Scanner<'_>, path: &dyn Fn() -> String) -> Syn<Sem> {
    if sc.peek() != Some(b'{') {
        sc.skip_value()?;
        return Ok(Err(invalid(path(), "a content part object")));
    }
    let start = sc.pos();
    sc.advance(1);
    let mut tok: [Option<&str>; 8] = [None; 8];
    let mut seen = [false; 8];
    let mut bad = false;
    let mut text_read: Option<Sem> = None;
    if !sc.empty(b'}') {
        loop {
            // `"type":` and `"text":` (indices 0 and 1 of `PART`), compact or as `json.dumps`
            // writes them, by a masked compare, as a message's keys; other keys and forms by
            // name.
            let known = match raw_key(sc, &PART_KEYS) {
                Some(i) => Some(i),
                None => {
                    let name = match sc.key_name()? {
                        Ok(n) => Some(n),
                        Err(BadString) => {
                            bad = true;
                            None
                        }
                    };
                    name.and_then(|n| PART.iter().position(|p| *p == n))
                }
            };
            match known {
                Some(i) => {
                    if let Some(s) = seen.get_mut(i) {
                        bad |= *s;
                        *s = true;
                    }
                    let text_kind = tok[0].is_some_and(|t| {
                        first_byte(t) == b'"'
                            && decode_str(t).is_ok_and(|k| part_kind(&k) == PartKind::Text)
                    });
                    if sc.null()? {
                    } else if i == 0 && sc.raw_match(&TEXT_TYPE).is_some() {
                        // `"type":"text"`, the common part: its token without a scan.
                        if let Some(o) = tok.get_mut(0) {
                            *o = Some(TEXT_TYPE_TOKEN);
                        }
                    } else if i == 1 && text_kind && !bad && sc.peek() == Some(b'"') {
                        text_read = Some(
                            acc.string(sc)?
                                .map_err(|_| invalid(format!("{}.text", path()), "a string")),
                        );
                    } else {
                        let t = sc.skip_value()?;
                        if let Some(o) = tok.get_mut(i) {
                            *o = Some(t);
                        }
                    }
                }
                None => {
                    sc.skip_value()?;
                }
            }
            if !sc.comma_or_close(b'}')? {
                break;
            }
        }
    }
    if bad {
        return Ok(Err(invalid(path(), "a content part object")));
    }
    // The part's JSON, hashed for a type read as nothing else: taken as text (validated
    // again, in one pass) only then. A text part read in place may have passed bytes raw,
    // which are not validated (`analyze_bounded`); an image's data may be large.
    let known = text_read.is_some()
        || tok[0].is_some_and(|t| decode_str(t).is_ok_and(|k| part_kind(&k) != PartKind::Other));
    let raw = if known { "" } else { sc.since(start)? };
    let [kind, text, image_url, input_audio, video_url, refusal, file_data, file_id] = tok;
    Ok((|| {
        let kind_tok = kind.ok_or_else(|| missing(format!("{}.type", path())))?;
        let kind = de_str(kind_tok, &|| format!("{}.type", path()))?;
        let text_of = |acc: &mut Acc<'_>, t: &str, field: &str| {
            let f = || format!("{}.{field}", path());
            on_token(t, &f, |sc| {
                if sc.peek() != Some(b'"') {
                    sc.skip_value()?;
                    return Ok(Err(invalid(f(), "a string")));
                }
                Ok(acc.string(sc)?.map_err(|_| invalid(f(), "a string")))
            })
        };
        match part_kind(&kind) {
            PartKind::Text => match (text_read, text) {
                (Some(r), _) => r?,
                (None, Some(t)) => text_of(acc, t, "text")?,
                (None, None) => return Err(missing(format!("{}.text", path()))),
            },
            PartKind::Refusal => {
                if let Some(t) = refusal {
                    text_of(acc, t, "refusal")?;
                }
            }
            PartKind::Image => {
                // Chat: {"image_url": {"url": ...}}; Responses: {"image_url": "..."} or file_id.
                acc.media("image", image_url.or(file_id).unwrap_or(""));
            }
            PartKind::Audio => acc.media("audio", input_audio.unwrap_or("")),
            PartKind::Video => acc.media("video", video_url.unwrap_or("")),
            PartKind::File => {
                // Documents are opaque to the router; hash their identity, count nothing.
                acc.file(file_data.or(file_id).unwrap_or(""));
            }
            // Unknown part types are hashed by their JSON but not counted.
            PartKind::Other => acc.marker(raw),
        }
        Ok(())
    })())
}

/// A string field read from its raw token, both hashed and counted.
fn json_text(acc: &mut Acc<'_>, token: &str, field: &dyn Fn() -> String) -> Sem {
    on_token(token, field, |sc| {
        if sc.peek() != Some(b'"') {
            sc.skip_value()?;
            return Ok(Err(invalid(field(), "a string")));
        }
        Ok(acc.string(sc)?.map_err(|_| invalid(field(), "a string")))
    })
}

/// An object's fields from its raw token, or `Err(())` when it is not an object serde's
/// derived struct accepts (repeated field, bad key).
fn object_fields<'a, const N: usize>(
    token: &'a str,
    names: [&str; N],
) -> Result<[Option<&'a str>; N], ()> {
    let mut sc = Scanner::new(token);
    if sc.peek() != Some(b'{') {
        return Err(());
    }
    sc.advance(1);
    fields(&mut sc, names).unwrap_or(Err(()))
}

fn tool_calls(acc: &mut Acc<'_>, token: &str, path: &str) -> Sem {
    let mut sc = Scanner::new(token);
    if sc.peek() != Some(b'[') {
        return Err(invalid(path, "an array of tool calls"));
    }
    sc.advance(1);
    if sc.empty(b']') {
        return Ok(());
    }
    let mut k = 0usize;
    loop {
        let c = sc
            .skip_value()
            .map_err(|_| invalid(path, "an array of tool calls"))?;
        let cp = format!("{path}[{k}]");
        let [function] = object_fields(c, ["function"])
            .map_err(|()| invalid(cp.clone(), "a tool call object"))?;
        let fp = format!("{cp}.function");
        let f = function.ok_or_else(|| missing(fp.clone()))?;
        let [name, arguments] = object_fields(f, ["name", "arguments"])
            .map_err(|()| invalid(fp.clone(), "a function object"))?;
        function_call(acc, name, arguments, &fp)?;
        k += 1;
        match sc.comma_or_close(b']') {
            Ok(true) => {}
            _ => break,
        }
    }
    Ok(())
}

fn function_call(
    acc: &mut Acc<'_>,
    name: Option<&str>,
    arguments: Option<&str>,
    path: &str,
) -> Sem {
    acc.marker("<|tool_call|>");
    if let Some(n) = name {
        json_text(acc, n, &|| format!("{path}.name"))?;
    }
    if let Some(a) = arguments {
        json_text(acc, a, &|| format!("{path}.arguments"))?;
    }
    acc.marker("\n");
    Ok(())
}

/// At an array of token ids: count and render them; `Err(())` if one is not a `u32`.
fn id_array(acc: &mut Acc<'_>, sc: &mut Scanner<'_>) -> Syn<Result<(), ()>> {
    sc.advance(1);
    if sc.empty(b']') {
        return Ok(Ok(()));
    }
    let mut ok = Ok(());
    let mut first = true;
    loop {
        let t = sc.skip_value()?;
        if ok.is_ok() {
            match token_id(t) {
                Some(id) => acc.token_id(first, id),
                None => ok = Err(()),
            }
        }
        first = false;
        if !sc.comma_or_close(b']')? {
            break;
        }
    }
    Ok(ok)
}

/// `prompt` (completions) or `input` (embeddings): a string, an array of strings, an array
/// of token ids, or an array of token-id arrays.
fn prompt_like(acc: &mut Acc<'_>, sc: &mut Scanner<'_>, field: &str) -> Syn<Sem> {
    const EXPECTED: &str =
        "a string, an array of strings, an array of token ids, or an array of token-id arrays";
    match sc.peek() {
        Some(b'"') => Ok(acc.string(sc)?.map_err(|_| invalid(field, "a string"))),
        Some(b'[') => {
            sc.advance(1);
            if sc.empty(b']') {
                return Ok(Err(invalid(field, "a non-empty prompt")));
            }
            let mode = sc.peek();
            let mut res = Ok(());
            let mut i = 0usize;
            loop {
                if res.is_err() {
                    sc.skip_value()?;
                } else {
                    match mode {
                        Some(b'"') => {
                            if i > 0 {
                                acc.marker("\n");
                            }
                            let item = if sc.peek() == Some(b'"') {
                                acc.string(sc)?
                            } else {
                                sc.skip_value()?;
                                Err(BadString)
                            };
                            res = item.map_err(|_| invalid(format!("{field}[{i}]"), "a string"));
                        }
                        Some(b'[') => {
                            if i > 0 {
                                acc.marker("\n");
                            }
                            let ids = if sc.peek() == Some(b'[') {
                                id_array(acc, sc)?
                            } else {
                                sc.skip_value()?;
                                Err(())
                            };
                            res = ids.map_err(|()| {
                                invalid(format!("{field}[{i}]"), "an array of token ids")
                            });
                        }
                        _ => {
                            let t = sc.skip_value()?;
                            match token_id(t) {
                                Some(id) => acc.token_id(i == 0, id),
                                None => {
                                    res = Err(invalid(
                                        field,
                                        "an array of token ids (non-negative integers)",
                                    ))
                                }
                            }
                        }
                    }
                }
                i += 1;
                if !sc.comma_or_close(b']')? {
                    break;
                }
            }
            if res.is_ok() && mode != Some(b'"') {
                acc.exact = true;
            }
            if res.is_ok() && matches!(mode, Some(b'"' | b'[')) {
                acc.prompts = u32::try_from(i).unwrap_or(u32::MAX);
            }
            Ok(res)
        }
        _ => {
            sc.skip_value()?;
            Ok(Err(invalid(field, EXPECTED)))
        }
    }
}

/// Responses `input`, read in place: a string or an array of input items.
fn responses_input(acc: &mut Acc<'_>, sc: &mut Scanner<'_>) -> Syn<Sem> {
    match sc.peek() {
        Some(b'"') => {
            acc.role("user");
            let r = acc.string(sc)?.map_err(|_| invalid("input", "a string"));
            acc.marker("\n");
            Ok(r)
        }
        Some(b'[') => {
            sc.advance(1);
            let mut res = Ok(());
            if !sc.empty(b']') {
                let mut i = 0usize;
                loop {
                    let t = sc.skip_value()?;
                    if res.is_ok() {
                        res = response_item(acc, t, &format!("input[{i}]"));
                    }
                    i += 1;
                    if !sc.comma_or_close(b']')? {
                        break;
                    }
                }
            }
            Ok(res)
        }
        _ => {
            sc.skip_value()?;
            Ok(Err(invalid("input", "a string or an array of input items")))
        }
    }
}

fn response_item(acc: &mut Acc<'_>, raw: &str, path: &str) -> Sem {
    let [kind, role, content_tok, name, arguments, output] = object_fields(
        raw,
        ["type", "role", "content", "name", "arguments", "output"],
    )
    .map_err(|()| invalid(path, "an input item object"))?;
    let kind = match kind {
        Some(k) => Some(de_str(k, &|| format!("{path}.type"))?),
        None => None,
    };
    if let Some(role) = role {
        let role = de_str(role, &|| format!("{path}.role"))?;
        acc.role(&role);
        if let Some(c) = content_tok {
            let field = || format!("{path}.content");
            on_token(c, &field, |sc| content(acc, sc, &field))?;
        }
        acc.marker("\n");
        return Ok(());
    }
    match kind.as_deref() {
        Some("function_call") => {
            acc.role("function_call");
            function_call(acc, name, arguments, path)?;
        }
        Some("function_call_output") => {
            acc.role("function_call_output");
            match output {
                Some(o) if first_byte(o) == b'"' => {
                    json_text(acc, o, &|| format!("{path}.output"))?;
                }
                Some(o) => acc.text(o),
                None => {}
            }
            acc.marker("\n");
        }
        Some(other) => {
            acc.role(other);
            acc.text(raw);
            acc.marker("\n");
        }
        None => return Err(missing(format!("{path}.type"))),
    }
    Ok(())
}

/// Non-OpenAI bodies: TGI `{"inputs": "...", "parameters": {"max_new_tokens": N}}` is read;
/// anything else contributes no prompt text.
fn other(
    acc: &mut Acc<'_>,
    inputs: Option<&str>,
    prompt: Option<&str>,
    parameters: Option<&str>,
    max_tokens: Option<&str>,
    max_completion_tokens: Option<&str>,
) -> Result<Option<u32>, AnalysisError> {
    if let Some(t) = inputs {
        json_text(acc, t, &|| "inputs".into())?;
    } else if let Some(p) = prompt {
        on_token(p, &|| "prompt".into(), |sc| prompt_like(acc, sc, "prompt"))?;
    }
    let mut limit = de_limit(max_completion_tokens, "max_completion_tokens")?
        .or(de_limit(max_tokens, "max_tokens")?);
    if let Some(params) = parameters {
        let [max_new_tokens] = object_fields(params, ["max_new_tokens"])
            .map_err(|()| invalid("parameters", "a parameters object"))?;
        limit = limit.or(de_limit(max_new_tokens, "parameters.max_new_tokens")?);
    }
    Ok(limit)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// What reading one message leaves behind, past a full rendering, after `filler` bytes
    /// of text (so that the tally is in its head, between windows or in one): the result,
    /// the cursor and every count. `quick`: through [`quick_message`] first.
    fn read(msg: &str, filler: usize, quick: bool) -> String {
        let est = Estimator::default();
        // Raw patterns need 16 bytes ahead: another message follows, as in a body.
        let body = format!(r#"{msg},{{"role":"user","content":"and the next message"}}]"#);
        let mut acc = Acc::new(&est, 0, 1 << 20, String::new());
        acc.tally.feed("word ".repeat(filler / 5).as_bytes());
        let mut sc = Scanner::new(&body);
        let r = if quick {
            match quick_message(&mut acc, &mut sc, 3) {
                Ok(Some(r)) => Ok(r),
                Ok(None) => message(&mut acc, &mut sc, 3),
                Err(e) => Err(e),
            }
        } else {
            message(&mut acc, &mut sc, 3)
        };
        acc.tally.end_text();
        format!(
            "{r:?} at {} overhead {} skipped {} sample {}/{} fed {} tokens {} prefix {:?}",
            sc.pos(),
            acc.overhead_tokens,
            acc.skipped_raw,
            acc.sample_raw,
            acc.sample_decoded,
            acc.tally.fed(),
            acc.tally.tokens(&CharClassCosts::default()),
            acc.prefix,
        )
    }

    /// [`quick_message`] leaves exactly what [`message`] leaves, for the shapes it takes,
    /// those it hands back before the content and those it hands on after it, with the
    /// content ending before a window, running into one, or read in the head.
    #[test]
    fn a_quick_message_reads_as_message_reads() {
        let long = "Un café, s'il vous plaît.\\n \\\"Oui\\\" \\u00e9\\ud83d\\ude00 ".repeat(400);
        let bad = format!("{long}\\ud800{long}");
        let messages = [
            r#"{"role":"user","content":"hello"}"#.to_string(),
            r#"{"role": "assistant", "content": "hi there"}"#.to_string(),
            r#"{"content":"x\ny","role":"system"}"#.to_string(),
            r#"{"content": "", "role": "developer"}"#.to_string(),
            "{\n  \"role\": \"tool\",\n  \"content\": \"42\"\n}".to_string(),
            format!(r#"{{"role":"user","content":"{long}"}}"#),
            format!(r#"{{"content":"{long}","role":"assistant"}}"#),
            format!(r#"{{"content":"{bad}","role":"assistant"}}"#),
            format!(r#"{{"role":"user","content":"{bad}"}}"#),
            r#"{"role":"user","content":"x","name":"n"}"#.to_string(),
            r#"{"content":"x","role":"function"}"#.to_string(),
            r#"{"content":"x","content":"y","role":"user"}"#.to_string(),
            r#"{"content":"x","role":"user","role":"user"}"#.to_string(),
            r#"{"content":"x","tool_calls":[],"role":"assistant"}"#.to_string(),
            r#"{"role":"user","content":null}"#.to_string(),
            r#"{"role":"user","content":[{"type":"text","text":"t"}]}"#.to_string(),
            r#"{"role":null,"content":"x"}"#.to_string(),
            r#"{"content":"x"}"#.to_string(),
            r#"{"content":"x","role":"user""#.to_string(),
            r#"{"role":"user","content":"x"#.to_string(),
            r#"{}"#.to_string(),
            r#"[]"#.to_string(),
        ];
        for msg in &messages {
            for filler in [0, 1000, 2100, 3000, 8000, 10_400, 10_700, 20_000, 150_000] {
                assert_eq!(
                    read(msg, filler, true),
                    read(msg, filler, false),
                    "{msg:.60} after {filler}"
                );
            }
        }
    }
}
