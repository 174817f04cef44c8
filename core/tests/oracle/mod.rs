//! The serde_json-based request analyser that `kvroute_core::analysis` replaced, kept only
//! as the test oracle of `core/tests/analysis_differential.rs`: for every body the new
//! single-pass scanner must return exactly what this returns (same analysis, same error
//! kind and field path). Not a production path.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code
)]

use std::borrow::Cow;

use kvroute_core::analysis::{
    AnalysisError, ApiKind, MediaCounts, RequestAnalysis, TOKENS_PER_MESSAGE, TOKENS_REPLY_PRIMING,
};
use kvroute_core::estimate::{CharClassCosts, Estimator, Tally};
use serde::Deserialize;
use serde_json::value::RawValue;

type Raw<'a> = Option<&'a RawValue>;

/// Top-level fields read from any body; everything else is skipped unparsed.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Raw<'a>,
    #[serde(borrow, default)]
    messages: Raw<'a>,
    #[serde(borrow, default)]
    tools: Raw<'a>,
    #[serde(borrow, default)]
    prompt: Raw<'a>,
    #[serde(borrow, default)]
    input: Raw<'a>,
    #[serde(borrow, default)]
    instructions: Raw<'a>,
    #[serde(borrow, default)]
    stream: Raw<'a>,
    #[serde(borrow, default)]
    n: Raw<'a>,
    #[serde(borrow, default)]
    max_tokens: Raw<'a>,
    #[serde(borrow, default)]
    max_completion_tokens: Raw<'a>,
    #[serde(borrow, default)]
    max_output_tokens: Raw<'a>,
    #[serde(borrow, default)]
    cache_salt: Raw<'a>,
    #[serde(borrow, default)]
    priority: Raw<'a>,
    // TGI native `/generate`.
    #[serde(borrow, default)]
    inputs: Raw<'a>,
    #[serde(borrow, default)]
    parameters: Raw<'a>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Raw<'a>,
    #[serde(borrow, default)]
    content: Raw<'a>,
    #[serde(borrow, default)]
    tool_calls: Raw<'a>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Raw<'a>,
    #[serde(borrow, default)]
    text: Raw<'a>,
    #[serde(borrow, default)]
    image_url: Raw<'a>,
    #[serde(borrow, default)]
    input_audio: Raw<'a>,
    #[serde(borrow, default)]
    video_url: Raw<'a>,
    #[serde(borrow, default)]
    refusal: Raw<'a>,
    #[serde(borrow, default)]
    file_data: Raw<'a>,
    #[serde(borrow, default)]
    file_id: Raw<'a>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow, default)]
    function: Raw<'a>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(borrow, default)]
    name: Raw<'a>,
    #[serde(borrow, default)]
    arguments: Raw<'a>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Raw<'a>,
    #[serde(borrow, default)]
    role: Raw<'a>,
    #[serde(borrow, default)]
    content: Raw<'a>,
    #[serde(borrow, default)]
    name: Raw<'a>,
    #[serde(borrow, default)]
    arguments: Raw<'a>,
    #[serde(borrow, default)]
    output: Raw<'a>,
}

#[derive(Deserialize)]
struct TgiParameters<'a> {
    #[serde(borrow, default)]
    max_new_tokens: Raw<'a>,
}

#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

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
    prompts: u32,
}

impl<'e> Acc<'e> {
    fn new(estimator: &'e Estimator, prefix_limit: usize) -> Self {
        Self {
            estimator,
            prefix: String::new(),
            prefix_limit,
            // As the analysis counts (`Estimator::tally`, crate-private).
            tally: if estimator.every_byte {
                Tally::new()
            } else {
                Tally::sampled()
            },
            overhead_tokens: 0,
            exact_tokens: 0,
            exact: false,
            media: MediaCounts::default(),
            prompts: 1,
        }
    }

    /// Append to the prefix text while it is shorter than the limit; the last piece is
    /// kept up to the first character boundary at or past the limit, so the first
    /// `prefix_limit` bytes are exactly those of the unbounded rendering.
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

    /// Append a JSON string (the raw token, quotes included) that is both hashed and
    /// counted, decoding its escapes as it goes: unescaped stretches are borrowed from the
    /// body, so no copy of the string is made.
    fn json_text(
        &mut self,
        raw: &RawValue,
        field: &dyn Fn() -> String,
    ) -> Result<(), AnalysisError> {
        let inner = raw
            .get()
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .ok_or_else(|| invalid(field(), "a string"))?;
        let ok = for_each_piece(inner, |piece| {
            self.push_prefix(piece);
            self.tally.feed(piece.as_bytes());
        });
        self.tally.end_text();
        ok.map_err(|()| invalid(field(), "a string"))
    }

    /// Append a structural marker that is hashed but not counted (template overhead is
    /// counted separately).
    fn marker(&mut self, s: &str) {
        self.push_prefix(s);
    }

    fn role(&mut self, role: &str) {
        self.push_prefix("<|");
        self.push_prefix(role);
        self.push_prefix("|>\n");
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

    fn token_ids(&mut self, ids: &[u32]) {
        for (i, id) in ids.iter().enumerate() {
            if self.prefix.len() >= self.prefix_limit {
                break;
            }
            if i > 0 {
                self.push_prefix(" ");
            }
            self.push_prefix(&id.to_string());
        }
        self.exact_tokens = self.exact_tokens.saturating_add(ids.len() as u64);
    }

    fn prompt_tokens(&self, model: Option<&str>) -> u64 {
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

/// Decode the inside of a JSON string (between its quotes) piece by piece: each unescaped
/// stretch is passed as a borrowed `&str`, each escape as its decoded character. Errors on a
/// malformed escape or a lone UTF-16 surrogate (as serde_json does when it decodes a string).
fn for_each_piece(inner: &str, mut f: impl FnMut(&str)) -> Result<(), ()> {
    let mut rest = inner;
    while let Some(at) = rest.find('\\') {
        if at > 0 {
            f(rest.get(..at).ok_or(())?);
        }
        let esc = rest.get(at + 1..).ok_or(())?;
        let (ch, used) = match esc.as_bytes().first().copied().ok_or(())? {
            b'"' => ('"', 1),
            b'\\' => ('\\', 1),
            b'/' => ('/', 1),
            b'b' => ('\u{8}', 1),
            b'f' => ('\u{c}', 1),
            b'n' => ('\n', 1),
            b'r' => ('\r', 1),
            b't' => ('\t', 1),
            b'u' => {
                let hi = hex4(esc.get(1..5).ok_or(())?)?;
                match hi {
                    0xD800..=0xDBFF => {
                        let lo = esc
                            .get(5..7)
                            .filter(|p| *p == "\\u")
                            .and_then(|_| esc.get(7..11))
                            .ok_or(())
                            .and_then(hex4)?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            return Err(());
                        }
                        let cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                        (char::from_u32(cp).ok_or(())?, 11)
                    }
                    0xDC00..=0xDFFF => return Err(()),
                    _ => (char::from_u32(hi).ok_or(())?, 5),
                }
            }
            _ => return Err(()),
        };
        let mut buf = [0u8; 4];
        f(ch.encode_utf8(&mut buf));
        rest = esc.get(used..).ok_or(())?;
    }
    if !rest.is_empty() {
        f(rest);
    }
    Ok(())
}

fn hex4(s: &str) -> Result<u32, ()> {
    if s.len() != 4 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(());
    }
    u32::from_str_radix(s, 16).map_err(|_| ())
}

fn push_hex(out: &mut String, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        let nibble = ((v >> (shift * 4)) & 0xf) as usize;
        out.push(char::from(HEX.get(nibble).copied().unwrap_or(b'0')));
    }
}

fn first_byte(raw: &RawValue) -> u8 {
    raw.get().as_bytes().first().copied().unwrap_or(b' ')
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

fn de_str<'a>(
    raw: &'a RawValue,
    field: &dyn Fn() -> String,
) -> Result<Cow<'a, str>, AnalysisError> {
    if first_byte(raw) != b'"' {
        return Err(invalid(field(), "a string"));
    }
    serde_json::from_str::<Str<'a>>(raw.get())
        .map(|s| s.0)
        .map_err(|_| invalid(field(), "a string"))
}

fn de_array<'a>(
    raw: &'a RawValue,
    field: &dyn Fn() -> String,
    expected: &'static str,
) -> Result<Vec<&'a RawValue>, AnalysisError> {
    if first_byte(raw) != b'[' {
        return Err(invalid(field(), expected));
    }
    serde_json::from_str::<Vec<&'a RawValue>>(raw.get()).map_err(|_| invalid(field(), expected))
}

fn de_object<'a, T: Deserialize<'a>>(
    raw: &'a RawValue,
    field: &dyn Fn() -> String,
    expected: &'static str,
) -> Result<T, AnalysisError> {
    if first_byte(raw) != b'{' {
        return Err(invalid(field(), expected));
    }
    serde_json::from_str::<T>(raw.get()).map_err(|_| invalid(field(), expected))
}

/// A non-negative integer, or an integral float (`256.0`: pydantic's lax int, as vLLM and
/// SGLang read it).
fn de_u64(raw: Raw<'_>, field: &str) -> Result<Option<u64>, AnalysisError> {
    let Some(r) = raw else { return Ok(None) };
    let bad = || invalid(field, "a non-negative integer");
    let n = serde_json::from_str::<serde_json::Number>(r.get()).map_err(|_| bad())?;
    if let Some(v) = n.as_u64() {
        return Ok(Some(v));
    }
    match n.as_f64() {
        Some(f) if f >= 0.0 && f.trunc() == f && f < 2f64.powi(64) => Ok(Some(f as u64)),
        _ => Err(bad()),
    }
}

fn de_limit(raw: Raw<'_>, field: &str) -> Result<Option<u32>, AnalysisError> {
    Ok(de_u64(raw, field)?.map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
}

fn byte_position(body: &[u8], offset: usize) -> (usize, usize) {
    let head = body.get(..offset).unwrap_or(body);
    let line = 1 + head.iter().filter(|&&b| b == b'\n').count();
    let column = 1 + head.iter().rev().take_while(|&&b| b != b'\n').count();
    (line, column)
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
pub fn oracle_analyze(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
) -> Result<RequestAnalysis, AnalysisError> {
    oracle_analyze_bounded(api, body, estimator, usize::MAX)
}

/// [`analyze`], rendering [`RequestAnalysis::prefix_text`] only up to `prefix_bytes` bytes
/// (cut at the first character boundary at or past it). Everything else is the same, and
/// the first `prefix_bytes` bytes of the prefix text equal those of [`analyze`]'s, so
/// [`crate::prefix::block_hashes`] with `max_blocks × block_chars ≤ prefix_bytes` gives the
/// same hashes. The rest of the body is still read, validated and estimated, but nothing of
/// it is copied: on a 1 MiB conversation only the first blocks are rendered.
pub fn oracle_analyze_bounded(
    api: ApiKind,
    body: &[u8],
    estimator: &Estimator,
    prefix_limit: usize,
) -> Result<RequestAnalysis, AnalysisError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        let (line, column) = byte_position(body, e.valid_up_to());
        AnalysisError::InvalidJson {
            line,
            column,
            message: "body is not valid UTF-8".into(),
        }
    })?;
    let start = text.trim_start_matches([' ', '\t', '\n', '\r']);
    if !start.starts_with('{') {
        // Deserialising a struct from a JSON array would read fields by position; refuse it.
        let probe = serde_json::from_str::<serde::de::IgnoredAny>(text);
        return Err(match probe {
            Err(e) => AnalysisError::InvalidJson {
                line: e.line(),
                column: e.column(),
                message: e.to_string(),
            },
            Ok(_) => AnalysisError::InvalidJson {
                line: 1,
                column: 1 + text.len() - start.len(),
                message: "the body must be a JSON object".into(),
            },
        });
    }
    let b: Body<'_> = serde_json::from_str(text).map_err(|e| AnalysisError::InvalidJson {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;

    let model = match b.model {
        Some(raw) => {
            let m = de_str(raw, &|| "model".into())?;
            if m.is_empty() {
                return Err(invalid("model", "a non-empty string"));
            }
            Some(m.into_owned())
        }
        None if api == ApiKind::Other => None,
        None => return Err(missing("model")),
    };
    let stream = match b.stream {
        None => false,
        Some(r) => {
            serde_json::from_str::<bool>(r.get()).map_err(|_| invalid("stream", "a boolean"))?
        }
    };
    let n = match de_u64(b.n, "n")? {
        None => 1,
        Some(0) => return Err(invalid("n", "an integer of at least 1")),
        Some(v) => u32::try_from(v).map_err(|_| invalid("n", "an integer of at most 2^32-1"))?,
    };
    let cache_salt = match b.cache_salt {
        None => None,
        Some(r) => Some(de_str(r, &|| "cache_salt".into())?.into_owned()),
    };
    let priority = match b.priority {
        None => 0,
        Some(r) => {
            let bad = || invalid("priority", "a 32-bit integer");
            let n = serde_json::from_str::<serde_json::Number>(r.get()).map_err(|_| bad())?;
            match (n.as_i64(), n.as_f64()) {
                (Some(v), _) => i32::try_from(v).map_err(|_| bad())?,
                (None, Some(f)) if f.trunc() == f && f.abs() <= 2_147_483_648.0 => {
                    i32::try_from(f as i64).map_err(|_| bad())?
                }
                _ => return Err(bad()),
            }
        }
    };

    let mut acc = Acc::new(estimator, prefix_limit);
    let max_output_tokens = match api {
        ApiKind::ChatCompletions => {
            let mct = de_limit(b.max_completion_tokens, "max_completion_tokens")?;
            let mt = de_limit(b.max_tokens, "max_tokens")?;
            chat(&mut acc, b.tools, b.messages)?;
            mct.or(mt)
        }
        ApiKind::Completions => {
            let raw = b.prompt.ok_or_else(|| missing("prompt"))?;
            prompt_like(&mut acc, raw, "prompt")?;
            let mct = de_limit(b.max_completion_tokens, "max_completion_tokens")?;
            mct.or(de_limit(b.max_tokens, "max_tokens")?)
        }
        ApiKind::Responses => {
            responses(&mut acc, b.instructions, b.tools, b.input)?;
            de_limit(b.max_output_tokens, "max_output_tokens")?
        }
        ApiKind::Embeddings => {
            let raw = b.input.ok_or_else(|| missing("input"))?;
            prompt_like(&mut acc, raw, "input")?;
            Some(0)
        }
        ApiKind::Other => other(&mut acc, &b)?,
    };

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

fn tools(acc: &mut Acc<'_>, raw: Raw<'_>) -> Result<(), AnalysisError> {
    if let Some(t) = raw {
        if first_byte(t) != b'[' {
            return Err(invalid("tools", "an array of tool definitions"));
        }
        acc.role("tools");
        acc.text(t.get());
        acc.marker("\n");
    }
    Ok(())
}

fn chat(acc: &mut Acc<'_>, tools_raw: Raw<'_>, messages: Raw<'_>) -> Result<(), AnalysisError> {
    let messages = messages.ok_or_else(|| missing("messages"))?;
    let list = de_array(messages, &|| "messages".into(), "an array of messages")?;
    tools(acc, tools_raw)?;
    for (i, raw) in list.into_iter().enumerate() {
        let path = |suffix: &str| format!("messages[{i}]{suffix}");
        let m: Message<'_> = de_object(raw, &|| path(""), "a message object")?;
        let role_raw = m.role.ok_or_else(|| missing(path(".role")))?;
        let role = de_str(role_raw, &|| path(".role"))?;
        acc.role(&role);
        if let Some(c) = m.content {
            content(acc, c, &path(".content"))?;
        }
        if let Some(tc) = m.tool_calls {
            tool_calls(acc, tc, &path(".tool_calls"))?;
        }
        acc.marker("\n");
    }
    acc.overhead_tokens = acc.overhead_tokens.saturating_add(TOKENS_REPLY_PRIMING);
    Ok(())
}

/// Message content: string, null, or an array of parts.
fn content(acc: &mut Acc<'_>, raw: &RawValue, path: &str) -> Result<(), AnalysisError> {
    match first_byte(raw) {
        b'"' => {
            acc.json_text(raw, &|| path.to_string())?;
            Ok(())
        }
        b'n' if raw.get() == "null" => Ok(()),
        b'[' => {
            let parts = de_array(
                raw,
                &|| path.to_string(),
                "a string or an array of content parts",
            )?;
            for (j, p) in parts.into_iter().enumerate() {
                let pp = format!("{path}[{j}]");
                part(acc, p, &pp)?;
            }
            Ok(())
        }
        _ => Err(invalid(path, "a string or an array of content parts")),
    }
}

fn part(acc: &mut Acc<'_>, raw: &RawValue, path: &str) -> Result<(), AnalysisError> {
    let p: Part<'_> = de_object(raw, &|| path.to_string(), "a content part object")?;
    let kind_raw = p.kind.ok_or_else(|| missing(format!("{path}.type")))?;
    let kind = de_str(kind_raw, &|| format!("{path}.type"))?;
    match kind.as_ref() {
        "text" | "input_text" | "output_text" => {
            let t = p.text.ok_or_else(|| missing(format!("{path}.text")))?;
            acc.json_text(t, &|| format!("{path}.text"))?;
        }
        "refusal" => {
            if let Some(t) = p.refusal {
                acc.json_text(t, &|| format!("{path}.refusal"))?;
            }
        }
        "image_url" | "input_image" => {
            // Chat: {"image_url": {"url": ...}}; Responses: {"image_url": "..."} or file_id.
            let data = p.image_url.or(p.file_id).map(|r| r.get()).unwrap_or("");
            acc.media("image", data);
        }
        "input_audio" => {
            let data = p.input_audio.map(|r| r.get()).unwrap_or("");
            acc.media("audio", data);
        }
        "video_url" | "input_video" => {
            let data = p.video_url.map(|r| r.get()).unwrap_or("");
            acc.media("video", data);
        }
        "file" | "input_file" => {
            // Documents are opaque to the router; hash their identity, count nothing.
            let data = p.file_data.or(p.file_id).map(|r| r.get()).unwrap_or("");
            acc.file(data);
        }
        // Unknown part types are hashed by their JSON but not counted.
        _ => acc.marker(raw.get()),
    }
    Ok(())
}

fn tool_calls(acc: &mut Acc<'_>, raw: &RawValue, path: &str) -> Result<(), AnalysisError> {
    if raw.get() == "null" {
        return Ok(());
    }
    let calls = de_array(raw, &|| path.to_string(), "an array of tool calls")?;
    for (k, c) in calls.into_iter().enumerate() {
        let cp = format!("{path}[{k}]");
        let call: ToolCall<'_> = de_object(c, &|| cp.clone(), "a tool call object")?;
        let fp = format!("{cp}.function");
        let f_raw = call.function.ok_or_else(|| missing(fp.clone()))?;
        let f: Function<'_> = de_object(f_raw, &|| fp.clone(), "a function object")?;
        function_call(acc, f.name, f.arguments, &fp)?;
    }
    Ok(())
}

fn function_call(
    acc: &mut Acc<'_>,
    name: Raw<'_>,
    arguments: Raw<'_>,
    path: &str,
) -> Result<(), AnalysisError> {
    acc.marker("<|tool_call|>");
    if let Some(n) = name {
        acc.json_text(n, &|| format!("{path}.name"))?;
    }
    if let Some(a) = arguments {
        acc.json_text(a, &|| format!("{path}.arguments"))?;
    }
    acc.marker("\n");
    Ok(())
}

/// `prompt` (completions) or `input` (embeddings): a string, an array of strings, an array
/// of token ids, or an array of token-id arrays.
fn prompt_like(acc: &mut Acc<'_>, raw: &RawValue, field: &str) -> Result<(), AnalysisError> {
    const EXPECTED: &str =
        "a string, an array of strings, an array of token ids, or an array of token-id arrays";
    match first_byte(raw) {
        b'"' => {
            acc.json_text(raw, &|| field.to_string())?;
            Ok(())
        }
        b'[' => {
            let items = de_array(raw, &|| field.to_string(), EXPECTED)?;
            let Some(first) = items.first() else {
                return Err(invalid(field, "a non-empty prompt"));
            };
            match first_byte(first) {
                b'"' => {
                    for (i, it) in items.iter().enumerate() {
                        if i > 0 {
                            acc.marker("\n");
                        }
                        acc.json_text(it, &|| format!("{field}[{i}]"))?;
                    }
                    acc.prompts = u32::try_from(items.len()).unwrap_or(u32::MAX);
                }
                b'[' => {
                    for (i, it) in items.iter().enumerate() {
                        if i > 0 {
                            acc.marker("\n");
                        }
                        let ids = serde_json::from_str::<Vec<u32>>(it.get()).map_err(|_| {
                            invalid(format!("{field}[{i}]"), "an array of token ids")
                        })?;
                        acc.token_ids(&ids);
                    }
                    acc.exact = true;
                    acc.prompts = u32::try_from(items.len()).unwrap_or(u32::MAX);
                }
                _ => {
                    let ids = serde_json::from_str::<Vec<u32>>(raw.get()).map_err(|_| {
                        invalid(field, "an array of token ids (non-negative integers)")
                    })?;
                    acc.token_ids(&ids);
                    acc.exact = true;
                }
            }
            Ok(())
        }
        _ => Err(invalid(field, EXPECTED)),
    }
}

fn responses(
    acc: &mut Acc<'_>,
    instructions: Raw<'_>,
    tools_raw: Raw<'_>,
    input: Raw<'_>,
) -> Result<(), AnalysisError> {
    tools(acc, tools_raw)?;
    if let Some(ins) = instructions {
        if ins.get() != "null" {
            if first_byte(ins) != b'"' {
                return Err(invalid("instructions", "a string"));
            }
            acc.role("system");
            acc.json_text(ins, &|| "instructions".into())?;
            acc.marker("\n");
        }
    }
    let input = input.ok_or_else(|| missing("input"))?;
    match first_byte(input) {
        b'"' => {
            acc.role("user");
            acc.json_text(input, &|| "input".into())?;
            acc.marker("\n");
        }
        b'[' => {
            let items = de_array(
                input,
                &|| "input".into(),
                "a string or an array of input items",
            )?;
            for (i, raw) in items.into_iter().enumerate() {
                let path = format!("input[{i}]");
                response_item(acc, raw, &path)?;
            }
        }
        _ => return Err(invalid("input", "a string or an array of input items")),
    }
    acc.overhead_tokens = acc.overhead_tokens.saturating_add(TOKENS_REPLY_PRIMING);
    Ok(())
}

fn response_item(acc: &mut Acc<'_>, raw: &RawValue, path: &str) -> Result<(), AnalysisError> {
    let it: Item<'_> = de_object(raw, &|| path.to_string(), "an input item object")?;
    let kind = match it.kind {
        Some(k) => Some(de_str(k, &|| format!("{path}.type"))?),
        None => None,
    };
    if let Some(role) = it.role {
        let role = de_str(role, &|| format!("{path}.role"))?;
        acc.role(&role);
        if let Some(c) = it.content {
            content(acc, c, &format!("{path}.content"))?;
        }
        acc.marker("\n");
        return Ok(());
    }
    match kind.as_deref() {
        Some("function_call") => {
            acc.role("function_call");
            function_call(acc, it.name, it.arguments, path)?;
        }
        Some("function_call_output") => {
            acc.role("function_call_output");
            match it.output {
                Some(o) if first_byte(o) == b'"' => {
                    acc.json_text(o, &|| format!("{path}.output"))?;
                }
                Some(o) => acc.text(o.get()),
                None => {}
            }
            acc.marker("\n");
        }
        Some(other) => {
            acc.role(other);
            acc.text(raw.get());
            acc.marker("\n");
        }
        None => return Err(missing(format!("{path}.type"))),
    }
    Ok(())
}

/// Non-OpenAI bodies: TGI `{"inputs": "...", "parameters": {"max_new_tokens": N}}` is read;
/// anything else contributes no prompt text.
fn other(acc: &mut Acc<'_>, b: &Body<'_>) -> Result<Option<u32>, AnalysisError> {
    if let Some(inputs) = b.inputs {
        acc.json_text(inputs, &|| "inputs".into())?;
    } else if let Some(p) = b.prompt {
        prompt_like(acc, p, "prompt")?;
    }
    let mut limit = de_limit(b.max_completion_tokens, "max_completion_tokens")?
        .or(de_limit(b.max_tokens, "max_tokens")?);
    if let Some(params) = b.parameters {
        if params.get() != "null" {
            let p: TgiParameters<'_> =
                de_object(params, &|| "parameters".into(), "a parameters object")?;
            limit = limit.or(de_limit(p.max_new_tokens, "parameters.max_new_tokens")?);
        }
    }
    Ok(limit)
}
