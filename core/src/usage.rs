//! Token `usage` from OpenAI-compatible responses, without buffering them.
//!
//! Two shapes:
//! - **Non-streamed** (`stream: false`): one JSON object whose top-level `usage` is
//!   `{"prompt_tokens", "completion_tokens", "total_tokens"}` (Chat/Completions API), or
//!   `{"input_tokens", "output_tokens", "total_tokens"}` (Responses API). See
//!   <https://platform.openai.com/docs/api-reference/chat/object>. [`parse_json`] reads it.
//! - **Streamed** (Server-Sent Events): `data: {json}` events separated by a blank line.
//!   With `stream_options.include_usage` (OpenAI, vLLM, SGLang) the last event before
//!   `data: [DONE]` carries `usage`; the Responses API sends it in
//!   `response.completed` as `response.usage`. [`SseUsageScanner`] is fed the body chunk by
//!   chunk as Envoy delivers it, reads its lines as the SSE spec does (CRLF, LF or CR line
//!   ends, one leading byte order mark skipped), keeps only the current event's `data`
//!   (bounded by `max_tail` bytes, default [`DEFAULT_MAX_TAIL`]: a longer event is read
//!   from its last `max_tail` bytes) and remembers the last `usage` seen, so its result
//!   does not depend on how the body is cut into chunks.
//!
//! Only events whose text contains `"usage"` are JSON-parsed, so ordinary token deltas cost a
//! substring search, not a parse.
//!
//! A stream's **first token** is told apart from what a server or an intermediary sends
//! before it by [`FirstTokenScanner`] (the rule is on its doc): SSE comments such as
//! LiteLLM's `: ping` or OpenRouter's `: OPENROUTER PROCESSING` keep-alives, events without
//! data, `data: [DONE]`, a failed stream's `data: {"error": ...}` (not `"error": null`), and the Responses API's
//! `response.created` / `response.in_progress` events, which vLLM and OpenAI send before
//! generation begins.

use serde::Deserialize;

/// Default bound on the `data` of an unfinished SSE event kept between chunks, bytes (16
/// KiB: a usage event is a few hundred bytes; a content delta carrying it rarely exceeds a
/// few KiB; a longer event, such as the Responses API's `response.completed` with its whole
/// output, is read from its last 16 KiB, where its `usage` is).
pub const DEFAULT_MAX_TAIL: usize = 16 * 1024;

/// Token counts reported by the model server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt (input) tokens.
    pub prompt_tokens: u64,
    /// Generated (output) tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache, when reported
    /// (`prompt_tokens_details.cached_tokens` / `input_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// A `usage` object: Chat/Completions names (`prompt_tokens`...) or the Responses API's
/// (`input_tokens`...). Separate fields, not serde aliases: a server that sends both names
/// (a proxy adding the other API's) is a duplicate field to an alias, and its usage was
/// dropped. The Chat name wins when both are present.
#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    #[serde(default)]
    input_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Inner {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    response: Option<Inner>,
}

impl RawUsage {
    fn into_usage(self) -> Option<Usage> {
        let prompt_tokens = self.prompt_tokens.or(self.input_tokens)?;
        let cached = |d: Option<Details>| d.and_then(|d| d.cached_tokens);
        Some(Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens.or(self.output_tokens).unwrap_or(0),
            cached_tokens: cached(self.prompt_tokens_details).or(cached(self.input_tokens_details)),
        })
    }
}

/// Read `usage` (or `response.usage`) from one JSON object. `None` when the body is not
/// JSON, has no usage, or the usage lacks a prompt-token count.
pub fn parse_json(body: &[u8]) -> Option<Usage> {
    let env: Envelope = serde_json::from_slice(body).ok()?;
    env.usage
        .or(env.response.and_then(|r| r.usage))
        .and_then(RawUsage::into_usage)
}

/// Read the response's own `usage` from `tail`, the end of a JSON body too large to keep
/// whole (the filter's JSON responses, and [`SseUsageScanner`]'s events longer than its
/// tail).
///
/// **The rule.** The response's own `usage` is a key of the top-level object, or of an
/// object in it (the Responses API's `response.usage`, in a `response.completed` event), as
/// [`parse_json`] reads it of a whole body. In `tail` it is the last `"usage"` key at depth
/// 1 (a member of the object that the tail's end closes), else the last one at depth 2. A
/// key's depth is how many containers close after its value, up to the tail's end: the body
/// ends there, and the count starts at the key, outside any string, wherever the tail
/// begins. Its value must be an object that parses, else `None`: a `usage` that is `null`,
/// malformed, or cut off by the body's end is not replaced by an earlier one, which is a
/// nested object's (an output item's, a tool's), not the response's. Deeper `usage` keys
/// (in the Responses API's user-set `metadata`, which OpenAI writes after `usage`) are
/// passed over. `None` too when the tail holds no such key or ends inside a string or a
/// value (a body cut short). Where it differs from [`parse_json`], for shapes no server
/// sends: a depth-2 key is read whatever its object's name, and a top-level
/// `"usage": null` is `None` even with a `response.usage` beside it.
///
/// A `"usage"` (quotes included) in a valid body is a key when `:` follows it, never part
/// of a string: a string's own quotes are escaped, and the quote before `usage` is checked
/// for a backslash (a key ending in `\"usage`). The usage object's end is found by
/// [`crate::json_scan::Scanner::skip_value`], the request analysis's JSON scanner, and the
/// depth by `nesting_change`; both step over strings whole (escapes included), so a brace
/// inside a string value (a server's extra text field in the usage) neither ends nor
/// extends an object. Linear in the tail: each stretch between two keys is scanned once.
pub fn parse_json_tail(tail: &[u8]) -> Option<Usage> {
    // The key after the one being looked at (the scan runs backward): where its opening
    // quote is, and its depth.
    let mut later: Option<(usize, isize)> = None;
    // Where the value of the last depth-2 key starts, used if no depth-1 key precedes it.
    let mut member: Option<usize> = None;
    for pos in memchr::memmem::rfind_iter(tail, USAGE_KEY) {
        // An escaped quote: inside a string, and what follows it is no key of its own.
        if crate::json_scan::backslashes_before(tail, pos, 0) % 2 == 1 {
            continue;
        }
        // Followed by no `:`: a string value, not a key.
        let Some(value) = key_value_start(tail, pos + USAGE_KEY.len()) else {
            continue;
        };
        let (end, later_depth) = later.unwrap_or((tail.len(), 0));
        let depth = later_depth - nesting_change(tail.get(value..end)?)?;
        match depth {
            // The tail ends before this value does: a body cut short (or not JSON).
            ..=0 => return None,
            1 => return usage_object_at(tail, value),
            2 => member = member.or(Some(value)),
            _ => {}
        }
        later = Some((pos, depth));
    }
    usage_object_at(tail, member?)
}

/// The change in container nesting across `json`, JSON text that begins outside any string:
/// +1 for each `{` or `[`, −1 for each `}` or `]`, strings stepped over whole (a quote after
/// a backslash is no string's end). `None` when `json` ends inside a string.
fn nesting_change(json: &[u8]) -> Option<isize> {
    let mut level = 0isize;
    let mut i = 0;
    while let Some(&b) = json.get(i) {
        match b {
            b'{' | b'[' => level += 1,
            b'}' | b']' => level -= 1,
            b'"' => loop {
                // The string's next quote or backslash (`memchr2`, SIMD).
                i += 1 + memchr::memchr2(b'"', b'\\', json.get(i + 1..)?)?;
                if json.get(i) == Some(&b'"') {
                    break;
                }
                // A backslash: the byte it escapes is no quote of the string's end.
                i += 1;
            },
            _ => {}
        }
        i += 1;
    }
    Some(level)
}

/// Where the value of a `"usage"` key starts: `i` is just past the key in `buf`, and what
/// follows must be whitespace, `:` and whitespace (the index returned, of the value's first
/// byte). `None` when no `:` follows (the quoted word is a string value, not a key).
fn key_value_start(buf: &[u8], i: usize) -> Option<usize> {
    let skip_ws = |i: usize| {
        i + buf
            .get(i..)
            .unwrap_or_default()
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let colon = skip_ws(i);
    (buf.get(colon) == Some(&b':')).then(|| skip_ws(colon + 1))
}

/// Where the object of a `"usage"` key starts: `i` is just past the key in `buf`, and what
/// follows must be whitespace, `:`, whitespace and `{` (the index returned). `None` for any
/// other value (`null` included).
fn usage_object_start(buf: &[u8], i: usize) -> Option<usize> {
    let open = key_value_start(buf, i)?;
    (buf.get(open) == Some(&b'{')).then_some(open)
}

/// The usage of the value of a `"usage"` key that starts at `value` in `buf`
/// ([`parse_json_tail`]); `None` unless it is an object that parses.
fn usage_object_at(buf: &[u8], value: usize) -> Option<Usage> {
    let rest = buf
        .get(value..)
        .filter(|rest| rest.first() == Some(&b'{'))?;
    // Only the object need be UTF-8: the scan stops at its end.
    let text = match std::str::from_utf8(rest) {
        Ok(text) => text,
        Err(e) => std::str::from_utf8(rest.get(..e.valid_up_to())?).ok()?,
    };
    let object = crate::json_scan::Scanner::new(text).skip_value().ok()?;
    serde_json::from_str::<RawUsage>(object).ok()?.into_usage()
}

/// How a response body is framed, told from its first bytes instead of its
/// `content-type` header (reading the response headers costs the filter a host call
/// that returns data, the dearest kind inside Envoy; see `docs/overhead.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// One JSON document (`stream: false`, or a JSON error): its first non-whitespace byte
    /// is `{` or `[`.
    Json,
    /// Server-Sent Events: the first line is a `:` comment or starts with one of the
    /// spec's field names, `data`, `event`, `id` or `retry`, followed by `:` or the end of
    /// the line (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>).
    /// OpenAI-style streams (vLLM, SGLang, TGI, llama.cpp, OpenAI) start with `data:`; the
    /// Responses API with `event:`.
    EventStream,
    /// Anything else: a compressed body, an HTML or plain-text error page. It carries no
    /// `usage` the filter can read, and its first bytes are no first token.
    Other,
}

impl BodyFraming {
    /// The framing of a body whose first bytes are `head` (the first chunk, or the first
    /// chunks joined); `None` while `head` is too short to tell (only whitespace, or a
    /// prefix of a field name such as `dat`), so the caller waits for more bytes.
    pub fn sniff(head: &[u8]) -> Option<Self> {
        // One leading byte order mark is no part of the body (the SSE spec strips it; a JSON
        // parser may ignore it, RFC 8259 §8.1); a part of one waits for the rest.
        let head = match head.strip_prefix(BOM) {
            Some(rest) => rest,
            None if !head.is_empty() && BOM.starts_with(head) => return None,
            None => head,
        };
        let start = head
            .iter()
            .position(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))?;
        let rest = head.get(start..).unwrap_or_default();
        match rest.first() {
            Some(b'{' | b'[') => return Some(Self::Json),
            Some(b':') => return Some(Self::EventStream),
            _ => {}
        }
        let field_end = rest
            .iter()
            .position(|b| matches!(b, b':' | b'\r' | b'\n'))
            .unwrap_or(rest.len());
        let name = rest.get(..field_end).unwrap_or_default();
        const FIELDS: [&[u8]; 4] = [b"data", b"event", b"id", b"retry"];
        if field_end < rest.len() {
            return Some(if FIELDS.contains(&name) {
                Self::EventStream
            } else {
                Self::Other
            });
        }
        // No `:` or line end yet: undecided while it can still become a field name.
        if FIELDS.iter().any(|f| f.starts_with(name)) {
            None
        } else {
            Some(Self::Other)
        }
    }
}

/// The value of a `data` field that ends an OpenAI-style stream: no token.
const DONE: &[u8] = b"[DONE]";

/// The start of the error object that vLLM and SGLang send in place of further tokens when
/// a streamed request fails (`data: {"error": {"message": ..., "type": ..., "code": ...}}`:
/// `json.dumps` of vLLM's `ErrorResponse`, `create_streaming_error_response` in
/// `vllm/entrypoints/openai/engine/serving.py`; SGLang's, of `{"error": ...}`, in
/// `python/sglang/srt/openai_api/adapter.py`), as OpenAI's chat streams do. No token unless
/// the key's value is [`NULL`] (`{"error":null,"choices":[...]}`, a token event whose
/// serializer writes every field).
const ERROR_KEY: &[u8] = b"{\"error\"";

/// The JSON value of an [`ERROR_KEY`] that leaves its event a token event.
const NULL: &[u8] = b"null";

/// Starts of `data` values that may be no token: [`DONE`] (always) and [`ERROR_KEY`] (unless
/// its value is [`NULL`]).
const NO_TOKEN_DATA: [&[u8]; 2] = [DONE, ERROR_KEY];

/// U+FEFF in UTF-8: one at the very start of an event stream is stripped before its lines
/// are read (SSE spec, "One leading U+FEFF BYTE ORDER MARK character must be ignored").
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// `event` types the Responses API sends before generation begins: vLLM yields
/// `response.created` and `response.in_progress` before it awaits the engine's first output
/// (`vllm/entrypoints/openai/responses/serving.py`, `responses_stream_generator`), and
/// OpenAI's API spec has `response.queued`, "emitted when a response is queued and waiting
/// to be processed" (`ResponseQueuedEvent`,
/// <https://platform.openai.com/docs/api-reference/responses-streaming>). Their data is the
/// response object, not a token. So are the same spec's failure events before any token:
/// `error` (`ResponseErrorEvent`) and `response.failed`.
const LIFECYCLE_EVENTS: [&[u8]; 5] = [
    b"response.created",
    b"response.in_progress",
    b"response.queued",
    b"error",
    b"response.failed",
];

/// Bytes of a field name, `event` value or `data` value start kept while a line is read:
/// the longest of [`LIFECYCLE_EVENTS`] (`response.in_progress`, 20 bytes; the longest of
/// [`NO_TOKEN_DATA`] is 8); a longer value is none of them.
const FIRST_TOKEN_KEEP: usize = 20;

/// One piece of an event stream as [`SseLines::next`] cuts a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinePiece<'a> {
    /// Bytes of the current line, no line end among them (a line may come in several
    /// pieces, one per chunk it spans).
    Text(&'a [u8]),
    /// The current line ended.
    End,
}

/// Cuts an event stream, fed chunk by chunk, into lines as the WHATWG SSE spec reads them
/// (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>):
/// one leading byte order mark ([`BOM`]) is skipped, and a line ends with CRLF, LF or CR (a
/// LF right after a CR ends no second line, even in the next chunk). The one reader of
/// lines for [`FirstTokenScanner`] and [`SseUsageScanner`]; 3 bytes of state, and line ends
/// are found with `memchr2` (SIMD), not byte by byte.
#[derive(Debug, Clone, Copy, Default)]
struct SseLines {
    /// The last byte was a CR.
    cr: bool,
    /// Bytes of a leading [`BOM`] matched so far, while `past_bom` is false.
    bom: u8,
    /// The stream's start, where one [`BOM`] is skipped, is behind.
    past_bom: bool,
}

impl SseLines {
    /// The next piece of `chunk` from `*at` on, moving `*at` past it; `None` once the chunk
    /// is used up.
    fn next<'a>(&mut self, chunk: &'a [u8], at: &mut usize) -> Option<LinePiece<'a>> {
        loop {
            let rest = chunk.get(*at..).unwrap_or_default();
            let &first = rest.first()?;
            if !self.past_bom {
                let matched = usize::from(self.bom);
                if BOM.get(matched) == Some(&first) {
                    *at += 1;
                    self.bom += 1;
                    self.past_bom = matched + 1 == BOM.len();
                    continue;
                }
                self.past_bom = true;
                // Not a BOM after all: the bytes that looked like one begin the first line.
                if matched > 0 {
                    return Some(LinePiece::Text(BOM.get(..matched).unwrap_or_default()));
                }
            }
            if std::mem::take(&mut self.cr) && first == b'\n' {
                // The LF of a CRLF whose CR already ended the line.
                *at += 1;
                continue;
            }
            return Some(match memchr::memchr2(b'\n', b'\r', rest) {
                Some(0) => {
                    *at += 1;
                    self.cr = first == b'\r';
                    LinePiece::End
                }
                Some(n) => {
                    *at += n;
                    LinePiece::Text(rest.get(..n).unwrap_or_default())
                }
                None => {
                    *at = chunk.len();
                    LinePiece::Text(rest)
                }
            });
        }
    }
}

/// Where [`FirstTokenScanner`] or [`SseUsageScanner`] is within the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum LinePart {
    /// At the start of a line.
    #[default]
    Start,
    /// In the field name (kept while it can still be `data` or `event`).
    Name,
    /// Just past the name's `:`, where one space is skipped (SSE spec).
    ValueStart,
    /// In the value of a `data` or `event` field.
    Value,
    /// The rest of the line cannot matter: a comment, another field, or a value already
    /// decided.
    Skip,
}

/// How far an event's data that began with [`ERROR_KEY`] has gone: its value is decided
/// [`NULL`] (a token) or not (no token) by the JSON after the key, `[ \t\n]*:[ \t\n]*null`
/// (the LF is the one that joins two `data` lines; a line holds none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum ErrorValue {
    /// The value did not begin with [`ERROR_KEY`] (or not yet).
    #[default]
    None,
    /// Past [`ERROR_KEY`], whitespace only since.
    Key,
    /// Past the key's `:`, whitespace only since.
    Colon,
    /// This many bytes of [`NULL`] matched (1 to 3; the 4th decides a token).
    Null(usize),
}

/// The field of the line [`FirstTokenScanner`] is reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Field {
    #[default]
    Data,
    Event,
}

/// Incremental SSE reader that says when a stream's first token has begun, fed the body
/// chunk by chunk, in constant memory (the bytes of one field name, `event` value or `data`
/// value start, at most 20).
///
/// **The rule.** The first token is the first event's data, read as the WHATWG SSE spec
/// reads lines (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>:
/// one leading byte order mark is skipped; lines end with CRLF, LF or CR; a line starting
/// with `:` is a comment; the name ends at the first `:` and one space after it is skipped;
/// an event's `data` lines are one value, each line's followed by a LF; a blank line ends
/// the event), whose value, past the LFs of empty `data` lines before it (JSON whitespace),
/// is not empty and starts with none of `NO_TOKEN_DATA` (`[DONE]`, OpenAI's end marker, on
/// which openai-python ends a stream; `{"error"`, a failed stream's error object, unless
/// what follows is `:` and `null`, with spaces, tabs or the LFs between `data` lines around
/// the `:`), taking the `data` lines read while the event's `event` type, set by an
/// `event` line before them, is none of `LIFECYCLE_EVENTS` (the Responses API's
/// `response.created`, `response.in_progress`, `response.queued`, which vLLM sends the
/// first two of before it awaits the engine's first output, and its `error` and
/// `response.failed`). So these are no token:
/// - comments, which keep-alives are: LiteLLM's `: ping` while a slow upstream is still
///   silent (`sse_keepalive_ping_interval_seconds`,
///   <https://github.com/BerriAI/litellm/pull/37322>), OpenRouter's
///   `: OPENROUTER PROCESSING` (<https://openrouter.ai/docs/api_reference/streaming>);
/// - events of `event`, `id` or `retry` fields only (`event: ping`, `retry: 3000`), and
///   fields the spec ignores (llama.cpp's `error:` lines);
/// - `data: [DONE]` before any token: no token was generated;
/// - `data: {"error": ...}`: vLLM's and SGLang's error in a stream that already began
///   (`data: {"error": null, ...}` is a token event: its error is none);
/// - `event: response.created` / `response.in_progress` / `response.queued` / `error` /
///   `response.failed` and their data.
///
/// An event's data is decided by its first byte at which it stops being a prefix of one of
/// `NO_TOKEN_DATA` (the third byte of a JSON token event, `{"i` of `{"id": ...}`), so a
/// data line split across chunks is found in the chunk where that byte is; a line that is
/// a proper prefix of one (`[DO`, `{"err`) is decided, as a token, at its line's end (the
/// LF that follows it in the data). Data that begins with `{"error"` is decided at the `l`
/// that ends its `null` (a token), or at its first byte, or its line's end, that rules
/// `null` out (no token), on whichever of the event's `data` lines that is (an error object
/// written over two lines, `data: {"error":` then `data: {"message": ...}}`, is no token).
/// Once data is no token, the rest of its event's `data` lines are passed over. An `event`
/// line after the `data` line of the same event does not undo a decision (servers send
/// `event` first).
#[derive(Debug, Clone, Default)]
pub struct FirstTokenScanner {
    part: LinePart,
    field: Field,
    /// The field name, the `event` value, or the start of a `data` value while it is a
    /// prefix of one of [`NO_TOKEN_DATA`], read so far (its first `len` bytes).
    kept: [u8; FIRST_TOKEN_KEEP],
    len: usize,
    lines: SseLines,
    /// The current event's type is one of [`LIFECYCLE_EVENTS`].
    lifecycle: bool,
    /// The current event's data began with [`ERROR_KEY`]: how far past it (kept across its
    /// `data` lines, which are one value).
    error: ErrorValue,
    /// The current event's data is decided no token (it starts with [`DONE`], or its error
    /// is not [`NULL`]): its further `data` lines are passed over.
    settled: bool,
    found: bool,
}

impl FirstTokenScanner {
    /// A scanner at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed the next body chunk; true once the stream has shown its first token (in this
    /// chunk or an earlier one). Once true, later chunks are not looked at.
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        let mut at = 0;
        while !self.found {
            match self.lines.next(chunk, &mut at) {
                None => break,
                Some(LinePiece::End) => self.end_line(),
                Some(LinePiece::Text(text)) => {
                    for &b in text {
                        // A line that cannot matter is passed over whole.
                        if self.found || self.part == LinePart::Skip {
                            break;
                        }
                        self.byte(b);
                    }
                }
            }
        }
        self.found
    }

    /// True once the stream has shown its first token.
    pub fn found(&self) -> bool {
        self.found
    }

    /// One byte of a line (no line end).
    fn byte(&mut self, b: u8) {
        match self.part {
            LinePart::Start if b == b':' => self.part = LinePart::Skip,
            LinePart::Start | LinePart::Name => {
                if b == b':' {
                    self.start_value();
                } else {
                    self.part = LinePart::Name;
                    self.keep(b, b"event".len());
                }
            }
            LinePart::ValueStart => {
                self.part = LinePart::Value;
                if b != b' ' {
                    self.value_byte(b);
                }
            }
            LinePart::Value => self.value_byte(b),
            LinePart::Skip => {}
        }
    }

    /// Keep `b` as the next byte of the name or value, or skip the line once it has more
    /// than `max` bytes (then it is no name or value that matters).
    fn keep(&mut self, b: u8, max: usize) {
        let slot = match self.len < max {
            true => self.kept.get_mut(self.len),
            false => None,
        };
        match slot {
            Some(slot) => {
                *slot = b;
                self.len += 1;
            }
            None => self.part = LinePart::Skip,
        }
    }

    fn kept(&self) -> &[u8] {
        self.kept.get(..self.len).unwrap_or_default()
    }

    /// The name ended at a `:`.
    fn start_value(&mut self) {
        let field = match self.kept() {
            b"data" if !self.lifecycle && !self.settled => Some(Field::Data),
            b"event" => {
                self.lifecycle = false;
                Some(Field::Event)
            }
            // Another field, or the data of a lifecycle event.
            _ => None,
        };
        self.len = 0;
        match field {
            Some(f) => {
                self.field = f;
                self.part = LinePart::ValueStart;
            }
            None => self.part = LinePart::Skip,
        }
    }

    fn value_byte(&mut self, b: u8) {
        match self.field {
            Field::Data if self.error != ErrorValue::None => self.error_value_byte(b),
            Field::Data => {
                let n = self.len;
                let kept = self.kept.get(..n);
                let continues = |m: &&&[u8]| m.get(..n) == kept && m.get(n) == Some(&b);
                let Some(marker) = NO_TOKEN_DATA.iter().find(continues) else {
                    self.found = true;
                    return;
                };
                let done = marker.len() == n + 1;
                if let Some(slot) = self.kept.get_mut(n) {
                    *slot = b;
                }
                self.len = n + 1;
                match (done, *marker == ERROR_KEY) {
                    (true, true) => self.error = ErrorValue::Key,
                    (true, false) => {
                        self.settled = true;
                        self.part = LinePart::Skip;
                    }
                    (false, _) => {}
                }
            }
            Field::Event => self.keep(b, FIRST_TOKEN_KEEP),
        }
    }

    /// A byte of an event's data past its [`ERROR_KEY`]: on towards `:` and [`NULL`], a token
    /// once `null` is whole, no token (the rest of the event's data passed over) at any
    /// other byte.
    fn error_value_byte(&mut self, b: u8) {
        let space = b == b' ' || b == b'\t';
        let next = match self.error {
            ErrorValue::Key if space => Some(ErrorValue::Key),
            ErrorValue::Key if b == b':' => Some(ErrorValue::Colon),
            ErrorValue::Colon if space => Some(ErrorValue::Colon),
            ErrorValue::Colon => (NULL.first() == Some(&b)).then_some(ErrorValue::Null(1)),
            ErrorValue::Null(n) => (NULL.get(n) == Some(&b)).then_some(ErrorValue::Null(n + 1)),
            ErrorValue::Key | ErrorValue::None => None,
        };
        match next {
            Some(ErrorValue::Null(n)) if n == NULL.len() => self.found = true,
            Some(e) => self.error = e,
            None => {
                self.settled = true;
                self.part = LinePart::Skip;
            }
        }
    }

    fn end_line(&mut self) {
        match self.part {
            // A blank line ends the event: its type and its data with it.
            LinePart::Start => {
                self.lifecycle = false;
                self.error = ErrorValue::None;
                self.settled = false;
            }
            // A name without `:` is a field with an empty value. For `data`, that value adds
            // only a LF to the event's data, which changes nothing here: before the data
            // begins it is passed over, after `{"error"` or its `:` it is whitespace, and no
            // other undecided state outlives a `data` line's end (`data_line_end`).
            LinePart::Name if self.kept() == b"event" => self.lifecycle = false,
            LinePart::ValueStart | LinePart::Value => match self.field {
                Field::Data => self.data_line_end(),
                Field::Event => self.lifecycle = LIFECYCLE_EVENTS.contains(&self.kept()),
            },
            LinePart::Name | LinePart::Skip => {}
        }
        self.part = LinePart::Start;
        self.len = 0;
    }

    /// A `data` line ended: the LF that the SSE spec appends to the event's data after each
    /// `data` line is the data's next byte (a `data` line that ended in `Skip` was decided
    /// already).
    fn data_line_end(&mut self) {
        match self.error {
            // The data has not begun (an empty line): a LF before it is JSON whitespace,
            // passed over.
            ErrorValue::None if self.len == 0 => {}
            // A non-empty proper prefix of a marker (a full `[DONE]` went to `Skip`), which
            // a LF continues neither: a token.
            ErrorValue::None => self.found = true,
            // Whitespace between `{"error"`, its `:` and its value: the next `data` line
            // goes on with it.
            ErrorValue::Key | ErrorValue::Colon => {}
            // `null` cut by the LF: the error is some other value.
            ErrorValue::Null(_) => self.settled = true,
        }
    }
}

/// The `data` field name.
const DATA: &[u8] = b"data";

/// The data of the event [`SseUsageScanner`] is reading: whole while it fits in `max`
/// bytes, then only its last `max` bytes, kept in a ring (each byte is copied once,
/// however the event is cut into chunks; no byte moves until the event ends).
#[derive(Debug, Clone, Default)]
struct DataTail {
    buf: Vec<u8>,
    /// Once `cut`: where the oldest kept byte is in `buf` (whose length is then `max`).
    head: usize,
    /// The data outgrew `max` bytes: its start is dropped.
    cut: bool,
}

impl DataTail {
    /// Append `bytes`, keeping at most `max` bytes; true when this made the data outgrow
    /// `max` (once per event).
    fn push(&mut self, bytes: &[u8], max: usize) -> bool {
        if !self.cut {
            let old = self.buf.len();
            let Some(excess) = (old + bytes.len()).checked_sub(max).filter(|&e| e > 0) else {
                self.buf.extend_from_slice(bytes);
                return false;
            };
            // Keep the last `max` bytes of the kept data followed by `bytes`.
            if excess >= old {
                self.buf.clear();
                self.buf
                    .extend_from_slice(bytes.get(excess - old..).unwrap_or_default());
            } else {
                self.buf.drain(..excess);
                self.buf.extend_from_slice(bytes);
            }
            self.head = 0;
            self.cut = true;
            return true;
        }
        // A ring of `max` bytes: overwrite the oldest.
        let bytes = bytes
            .get(bytes.len().saturating_sub(max)..)
            .unwrap_or_default();
        let (to_end, wrapped) = bytes.split_at(bytes.len().min(max - self.head));
        if let Some(dst) = self.buf.get_mut(self.head..self.head + to_end.len()) {
            dst.copy_from_slice(to_end);
        }
        if let Some(dst) = self.buf.get_mut(..wrapped.len()) {
            dst.copy_from_slice(wrapped);
        }
        self.head = (self.head + bytes.len()).checked_rem(max).unwrap_or(0);
        false
    }

    /// The kept data, in order.
    fn contiguous(&mut self) -> &[u8] {
        if self.head > 0 {
            self.buf.rotate_left(self.head);
            self.head = 0;
        }
        &self.buf
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.head = 0;
        self.cut = false;
    }
}

/// Incremental SSE reader that keeps the last `usage` seen, fed the body chunk by chunk.
///
/// **The rule.** The body is read as the WHATWG SSE spec reads it
/// (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>,
/// the same lines as [`FirstTokenScanner`]: one leading byte order mark skipped; lines end
/// with CRLF, LF or CR; a line starting with `:` is a comment; the name ends at the first
/// `:` and one space after it is skipped; each `data` line's value is appended to the
/// event's data, followed by a LF; a blank line ends the event). At each event's end its
/// data is read:
/// - data of at most `max_tail` bytes (LFs included) is parsed by [`parse_json`] when it
///   has a `"usage"` key whose value is an object (the gate: token events, with no usage
///   or `"usage": null`, cost a `memmem` search, not a parse);
/// - longer data (an overflow, counted by [`Self::overflows`]) keeps only its last
///   `max_tail` bytes, and the event's own `usage` in them (its last `"usage"` key of the
///   top-level object, else of an object in it; the rule on [`parse_json_tail`]) is read
///   by [`parse_json_tail`]. So the Responses API's `response.completed`, which carries the
///   whole output before its `usage` (`{"type":"response.completed","response":{...,
///   "output":[...],...,"usage":{...},...}}`), is read however long the output is, as
///   long as what follows `usage` in it fits in `max_tail` with it (with OpenAI's field
///   order, a few hundred bytes).
///
/// A usage that a later event carries replaces it. Unlike the spec, which drops an event
/// the body ends inside, [`Self::finish`] reads it. The result depends only on the body and
/// `max_tail`, never on how the body is cut into chunks. Memory: at most `max_tail` bytes
/// of data; other fields' lines and comments are passed over without being kept.
#[derive(Debug, Clone)]
pub struct SseUsageScanner {
    lines: SseLines,
    part: LinePart,
    /// Bytes of the current line's name read so far, while they are a prefix of [`DATA`].
    name_len: usize,
    data: DataTail,
    max_tail: usize,
    last: Option<Usage>,
    overflows: u64,
}

impl Default for SseUsageScanner {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_TAIL)
    }
}

/// The `"usage"` key.
const USAGE_KEY: &[u8] = b"\"usage\"";

/// A searcher for [`USAGE_KEY`] (`memchr::memmem`, SIMD on Wasm and natively), built once:
/// token events are read one by one as they stream, so their scan is per-chunk work of
/// every streamed response, and building the searcher for each ~200-byte event cost more
/// than the search.
fn usage_finder() -> &'static memchr::memmem::Finder<'static> {
    static FINDER: std::sync::OnceLock<memchr::memmem::Finder<'static>> =
        std::sync::OnceLock::new();
    FINDER.get_or_init(|| memchr::memmem::Finder::new(USAGE_KEY))
}

/// True when the JSON text `data` has a `"usage"` key whose value is an object
/// ([`usage_object_start`]). An event whose data has none carries no usage for
/// [`parse_json`] (the `"usage": null` some servers send in every token event) and is not
/// parsed.
fn has_usage_object(data: &[u8]) -> bool {
    usage_finder()
        .find_iter(data)
        .any(|at| usage_object_start(data, at + USAGE_KEY.len()).is_some())
}

impl SseUsageScanner {
    /// A scanner keeping at most `max_tail` bytes of an event's data.
    pub fn new(max_tail: usize) -> Self {
        Self {
            lines: SseLines::default(),
            part: LinePart::Start,
            name_len: 0,
            data: DataTail::default(),
            max_tail,
            last: None,
            overflows: 0,
        }
    }

    /// Feed the next body chunk.
    /// Linear in the chunk: line ends are found with `memchr2`, a `data` value is copied
    /// once into the event's data, other lines are passed over, and an event's data is
    /// searched for `"usage"` once, when the event ends.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut at = 0;
        while let Some(piece) = self.lines.next(chunk, &mut at) {
            match piece {
                LinePiece::Text(text) => self.text(text),
                LinePiece::End => self.end_line(),
            }
        }
    }

    /// Call at end of stream: reads a final event that was not followed by a blank line
    /// (and its last line, without its line end).
    pub fn finish(&mut self) {
        if self.part != LinePart::Start {
            self.end_line();
        }
        self.dispatch();
    }

    /// The last usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.last
    }

    /// Bytes of the unfinished event's data held (never more than `max_tail`).
    pub fn tail_len(&self) -> usize {
        self.data.buf.len()
    }

    /// How many events' data outgrew `max_tail` (each was read from its last `max_tail`
    /// bytes).
    pub fn overflows(&self) -> u64 {
        self.overflows
    }

    /// Bytes of the current line, no line end among them.
    fn text(&mut self, mut text: &[u8]) {
        loop {
            match self.part {
                LinePart::Skip => return,
                LinePart::Value => return self.push(text),
                LinePart::ValueStart => {
                    let Some((&first, rest)) = text.split_first() else {
                        return;
                    };
                    self.part = LinePart::Value;
                    // One space after the `:` is no part of the value.
                    return self.push(if first == b' ' { rest } else { text });
                }
                LinePart::Start | LinePart::Name => {
                    if text.is_empty() {
                        return;
                    }
                    self.part = LinePart::Name;
                    // The name's next bytes, up to one past what `data` has left.
                    let room = DATA.len() - self.name_len;
                    let head = text.get(..text.len().min(room + 1)).unwrap_or_default();
                    let colon = memchr::memchr(b':', head);
                    let name = head.get(..colon.unwrap_or(head.len())).unwrap_or_default();
                    let end = self.name_len + name.len();
                    // Another field (an empty name: a comment), or longer than `data`.
                    if DATA.get(self.name_len..end) != Some(name) {
                        self.part = LinePart::Skip;
                        return;
                    }
                    self.name_len = end;
                    match colon {
                        Some(c) if end == DATA.len() => {
                            self.part = LinePart::ValueStart;
                            text = text.get(c + 1..).unwrap_or_default();
                        }
                        Some(_) => {
                            self.part = LinePart::Skip;
                            return;
                        }
                        None => return,
                    }
                }
            }
        }
    }

    fn end_line(&mut self) {
        match self.part {
            // A blank line ends the event.
            LinePart::Start => self.dispatch(),
            // A `data` line (a name without `:` is a field with an empty value).
            LinePart::Name if self.name_len == DATA.len() => self.push(b"\n"),
            LinePart::ValueStart | LinePart::Value => self.push(b"\n"),
            LinePart::Name | LinePart::Skip => {}
        }
        self.part = LinePart::Start;
        self.name_len = 0;
    }

    fn push(&mut self, bytes: &[u8]) {
        if self.data.push(bytes, self.max_tail) {
            self.overflows += 1;
        }
    }

    /// The event ended: read its data's usage (the rule on [`SseUsageScanner`]).
    fn dispatch(&mut self) {
        let cut = self.data.cut;
        let data = self.data.contiguous();
        let usage = if cut {
            parse_json_tail(data)
        } else if has_usage_object(data) {
            parse_json(data)
        } else {
            None
        };
        if usage.is_some() {
            self.last = usage;
        }
        self.data.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const CHAT: &[u8] = br#"{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":17,"completion_tokens":9,"total_tokens":26,"prompt_tokens_details":{"cached_tokens":16}}}"#;

    fn stream() -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
        );
        s.extend_from_slice(b"data: {\"choices\":[{\"delta\":{\"content\":\" there\"}}]}\n\n");
        s.extend_from_slice(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":120,\"completion_tokens\":2,\"total_tokens\":122}}\n\n");
        s.extend_from_slice(b"data: [DONE]\n\n");
        s
    }

    #[test]
    fn json_chat_and_responses_usage() {
        assert_eq!(
            parse_json(CHAT),
            Some(Usage {
                prompt_tokens: 17,
                completion_tokens: 9,
                cached_tokens: Some(16)
            })
        );
        let resp = br#"{"object":"response","usage":{"input_tokens":5,"output_tokens":3,"total_tokens":8}}"#;
        assert_eq!(
            parse_json(resp),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_tokens: None
            })
        );
        // Both APIs' names at once (a proxy adding the other's): read, the Chat names
        // first; each detail from whichever name carries it.
        let both = br#"{"usage":{"prompt_tokens":5,"input_tokens":6,"completion_tokens":3,"output_tokens":4,"input_tokens_details":{"cached_tokens":2}}}"#;
        assert_eq!(
            parse_json(both),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_tokens: Some(2)
            })
        );
        assert_eq!(parse_json(b"{\"usage\":null}"), None);
        assert_eq!(parse_json(b"not json"), None);
        assert_eq!(parse_json(b"[1,2]"), None);
    }

    #[test]
    fn usage_found_in_the_tail_of_a_large_body() {
        let body = format!(
            r#"{{"choices":[{{"message":{{"content":"{}"}}}}],"usage":{{"prompt_tokens":42,"completion_tokens":7}}}}"#,
            "x".repeat(100_000)
        );
        let tail = &body.as_bytes()[body.len() - 200..];
        assert_eq!(
            parse_json_tail(tail),
            Some(Usage {
                prompt_tokens: 42,
                completion_tokens: 7,
                cached_tokens: None
            })
        );
        assert_eq!(parse_json_tail(br#"{"usage": {"prompt_tokens": 1"#), None);
        assert_eq!(parse_json_tail(br#""usage":null"#), None);
    }

    /// A usage with no cached tokens.
    fn usage(prompt_tokens: u64, completion_tokens: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens: None,
        })
    }

    /// Braces inside strings (in the usage object, escaped quotes and backslashes before
    /// them, or in the surrounding object) do not end or extend the usage object.
    #[test]
    fn braces_inside_strings_do_not_cut_the_tail_usage() {
        for (name, tail, want) in [
            (
                "a closing brace in a string",
                &br#"x","usage":{"prompt_tokens":3,"note":"}","completion_tokens":4}}"#[..],
                usage(3, 4),
            ),
            (
                "an opening brace in a string",
                br#"x","usage":{"prompt_tokens":3,"note":"{","completion_tokens":4}}"#,
                usage(3, 4),
            ),
            (
                "an escaped quote before a brace",
                br#"x","usage":{"note":"say \"}\" {","prompt_tokens":5,"completion_tokens":6}}"#,
                usage(5, 6),
            ),
            (
                "an escaped backslash, then the closing quote",
                br#"x","usage":{"note":"a\\","prompt_tokens":7,"x":"}","completion_tokens":8}}"#,
                usage(7, 8),
            ),
            (
                "braces in the surrounding object's strings",
                br#"{"text":"}}{","usage":{"prompt_tokens":9,"completion_tokens":1},"end":"{"}"#,
                usage(9, 1),
            ),
            (
                "cut inside a string of the usage",
                br#"x","usage":{"prompt_tokens":3,"note":"}"#,
                None,
            ),
            (
                "an earlier usage, the last one cut",
                br#""usage":{"prompt_tokens":2,"s":"{"},"usage":{"prompt_tokens":1,"s":"}"#,
                None,
            ),
        ] {
            assert_eq!(parse_json_tail(tail), want, "{name}");
        }
    }

    /// The tail's usage is the response's own: the last `"usage"` key of the top-level
    /// object (else of an object in it, the Responses API's `response.usage`), whatever its
    /// value. A later `usage` nested deeper is passed over; when the response's own is cut,
    /// malformed or `null`, an earlier `usage` (nested, or cut off by the tail) is not read
    /// in its place.
    #[test]
    fn the_tail_reads_only_the_responses_own_usage() {
        for (name, tail, want) in [
            (
                "the body cut inside its usage, a nested usage before it",
                &br#"{"choices":[{"x":{"usage":{"prompt_tokens":2}}}],"usage":{"prompt_tokens":1"#[..],
                None,
            ),
            (
                "a malformed usage, a nested usage before it",
                br#"{"choices":[{"x":{"usage":{"prompt_tokens":2}}}],"usage":{"prompt_tokens":"1"}}"#,
                None,
            ),
            (
                "a null usage, a nested usage before it",
                br#"{"choices":[{"x":{"usage":{"prompt_tokens":2}}}],"usage":null}"#,
                None,
            ),
            (
                "a null usage, spaced, after a whole earlier one in the tail",
                b"\"usage\":{\"prompt_tokens\":2}}],\"usage\" :\n null}",
                None,
            ),
            (
                "a nested usage object after the response's own",
                br#"{"usage":{"prompt_tokens":3,"completion_tokens":1},"x":[{"usage":{"prompt_tokens":9}}]}"#,
                usage(3, 1),
            ),
            (
                "a nested usage without prompt tokens after the response's own",
                br#"{"usage":{"prompt_tokens":3,"completion_tokens":1},"x":{"usage":{"note":1}}}"#,
                usage(3, 1),
            ),
            (
                "a metadata key usage after the Responses API's usage",
                br#"{"object":"response","usage":{"input_tokens":4,"output_tokens":2},"metadata":{"usage":"high"}}"#,
                usage(4, 2),
            ),
            (
                "response.usage, with a deeper usage after it",
                br#"{"type":"response.completed","response":{"usage":{"input_tokens":5,"output_tokens":1},"metadata":{"usage":"x"}},"sequence_number":9}"#,
                usage(5, 1),
            ),
            (
                "a key that ends in an escaped quote and usage",
                br#"{"usage":{"prompt_tokens":3,"completion_tokens":1},"a\"usage":{"prompt_tokens":9}}"#,
                usage(3, 1),
            ),
            (
                "the word as a string value",
                br#"{"usage":{"prompt_tokens":3,"completion_tokens":1},"kind":"usage"}"#,
                usage(3, 1),
            ),
            (
                "the body cut inside a string after its usage",
                br#"{"usage":{"prompt_tokens":3},"note":"abc"#,
                None,
            ),
        ] {
            assert_eq!(parse_json_tail(tail), want, "{name}");
        }
    }

    #[test]
    fn sse_usage_in_one_chunk() {
        let mut s = SseUsageScanner::default();
        s.feed(&stream());
        s.finish();
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 120,
                completion_tokens: 2,
                cached_tokens: None
            })
        );
    }

    #[test]
    fn responses_api_completed_event() {
        let mut s = SseUsageScanner::default();
        s.feed(b"event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":44,\"output_tokens\":4}}}\r\n\r\n");
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(44));
    }

    #[test]
    fn overlong_event_is_skipped_and_tail_stays_bounded() {
        let mut s = SseUsageScanner::new(64);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}");
        s.feed(&[b'x'; 100]);
        assert!(s.tail_len() <= 64);
        assert_eq!(s.overflows(), 1);
        s.feed(b"}\n\ndata: {\"usage\":{\"prompt_tokens\":2}}\n\n");
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(2));
    }

    /// A burst of thousands of events in one chunk (what Envoy hands over when a fast model
    /// server writes a whole stream at once) is read in one feed, usage from the last one.
    #[test]
    fn thousands_of_events_in_one_chunk() {
        let ev = "data: {\"choices\":[{\"delta\":{\"content\":\"word \"}}]}\n\n";
        let mut body = ev.repeat(4096);
        body.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":4096}}\r\n\r\ndata: [DONE]\n\n");
        let mut s = SseUsageScanner::new(256);
        s.feed(body.as_bytes());
        assert_eq!(s.tail_len(), 0);
        assert_eq!(s.overflows(), 0);
        assert_eq!(
            s.usage().map(|u| (u.prompt_tokens, u.completion_tokens)),
            Some((7, 4096))
        );
    }

    #[test]
    fn final_event_without_blank_line_is_read_at_finish() {
        let mut s = SseUsageScanner::default();
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}");
        assert_eq!(s.usage(), None);
        s.finish();
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(3));
    }

    /// `usage` read from `chunks` fed in order, then `finish`.
    fn usage_by_chunks(max_tail: usize, chunks: &[&[u8]]) -> Option<Usage> {
        let mut s = SseUsageScanner::new(max_tail);
        for c in chunks {
            s.feed(c);
            assert!(s.tail_len() <= max_tail);
        }
        s.finish();
        assert_eq!(s.tail_len(), 0);
        s.usage()
    }

    /// An event that outgrows the tail, its blank line cut after its first LF: the next
    /// event is read, as when the body comes whole.
    #[test]
    fn an_oversized_event_cut_inside_its_blank_line_hides_no_later_usage() {
        let long = format!("data: {}\n", "x".repeat(100));
        let rest = b"\ndata: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
        let want = Some(Usage {
            prompt_tokens: 5,
            completion_tokens: 1,
            cached_tokens: None,
        });
        let whole = [long.as_bytes(), rest].concat();
        assert_eq!(usage_by_chunks(64, &[&whole]), want);
        assert_eq!(usage_by_chunks(64, &[long.as_bytes(), rest]), want);
        let crlf = format!("data: {}\r\n", "x".repeat(100));
        assert_eq!(
            usage_by_chunks(64, &[crlf.as_bytes(), b"\r", b"\n", &rest[1..]]),
            want
        );
        let mut s = SseUsageScanner::new(64);
        s.feed(long.as_bytes());
        assert_eq!((s.tail_len(), s.overflows()), (64, 1));
    }

    /// The Responses API's `response.completed` carries the whole output before its usage:
    /// with 40 KB of output it outgrows the 16 KiB tail, and the usage at its end is read
    /// from the tail, whole or cut into 1000-byte chunks.
    #[test]
    fn a_long_response_completed_event_is_read_from_its_tail() {
        let event = format!(
            "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"id\":\"resp_1\",\"output\":[{{\"type\":\"message\",\"content\":[{{\"type\":\"output_text\",\"text\":\"{}\"}}]}}],\"usage\":{{\"input_tokens\":812,\"input_tokens_details\":{{\"cached_tokens\":768}},\"output_tokens\":9000,\"output_tokens_details\":{{\"reasoning_tokens\":0}},\"total_tokens\":9812}},\"user\":null,\"metadata\":{{}}}}}}\n\n",
            "word ".repeat(8000)
        );
        let want = Some(Usage {
            prompt_tokens: 812,
            completion_tokens: 9000,
            cached_tokens: Some(768),
        });
        let body = event.as_bytes();
        assert_eq!(usage_by_chunks(DEFAULT_MAX_TAIL, &[body]), want);
        let chunks: Vec<&[u8]> = body.chunks(1000).collect();
        assert_eq!(usage_by_chunks(DEFAULT_MAX_TAIL, &chunks), want);
        let mut s = SseUsageScanner::default();
        s.feed(body);
        assert_eq!((s.overflows(), s.usage()), (1, want));
    }

    /// CR-only line ends, blank lines mixing LF and CRLF, and a leading byte order mark:
    /// each is an SSE line end or stream start (WHATWG SSE spec), whole or byte by byte.
    #[test]
    fn usage_is_read_with_any_line_ends_and_a_leading_bom() {
        let usage = "data: {\"usage\":{\"prompt_tokens\":6,\"completion_tokens\":2}}";
        let want = Some(Usage {
            prompt_tokens: 6,
            completion_tokens: 2,
            cached_tokens: None,
        });
        for (name, body, finish_needed) in [
            ("CR only", format!("{usage}\r\r"), false),
            ("LF, then CRLF", format!("{usage}\n\r\n"), false),
            ("CRLF, then LF", format!("{usage}\r\n\n"), false),
            ("CR, then LF", format!("{usage}\r\r\n"), false),
            ("leading BOM", format!("\u{FEFF}{usage}\n\n"), false),
            (
                "leading BOM, unterminated",
                format!("\u{FEFF}{usage}"),
                true,
            ),
        ] {
            let bytes = body.as_bytes();
            let mut s = SseUsageScanner::default();
            s.feed(bytes);
            assert_eq!(s.usage().is_some(), !finish_needed, "{name}: before finish");
            s.finish();
            assert_eq!(s.usage(), want, "{name}");
            let by_byte: Vec<&[u8]> = bytes.chunks(1).collect();
            assert_eq!(
                usage_by_chunks(DEFAULT_MAX_TAIL, &by_byte),
                want,
                "{name}: by byte"
            );
        }
        // A CR ends the line: `}}` after it is a field of its own, not part of the data.
        let cut = b"data: {\"usage\":{\"prompt_tokens\":1\r}}\r\r";
        assert_eq!(usage_by_chunks(DEFAULT_MAX_TAIL, &[cut]), None);
        // And a CR between `data` lines is a line end like any other.
        let joined = b"data: {\"usage\":\rdata: {\"prompt_tokens\":1}}\r\r";
        assert_eq!(
            usage_by_chunks(DEFAULT_MAX_TAIL, &[joined]).map(|u| u.prompt_tokens),
            Some(1)
        );
        // A second BOM is part of the first line: no `data` field.
        assert_eq!(
            usage_by_chunks(
                DEFAULT_MAX_TAIL,
                &[format!("\u{FEFF}\u{FEFF}{usage}\n\n").as_bytes()]
            ),
            None
        );
    }

    proptest! {
        /// However the stream is cut into chunks, the usage is found.
        #[test]
        fn any_chunking_finds_usage(cuts in proptest::collection::vec(0usize..400, 0..20)) {
            let body = stream();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % body.len()).collect();
            cuts.sort_unstable();
            let mut s = SseUsageScanner::default();
            let mut prev = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                s.feed(&body[prev..c]);
                prev = c;
            }
            s.finish();
            prop_assert_eq!(s.usage().map(|u| (u.prompt_tokens, u.completion_tokens)), Some((120, 2)));
        }

        /// The gate before parsing never drops a usage `parse_json` reads: chat and
        /// Responses events with `usage` an object, `null`, absent, or another value, with
        /// any JSON whitespace around the `:`, and the word in a text value.
        #[test]
        fn the_usage_gate_never_hides_a_usage(
            nested in any::<bool>(),
            value in proptest::sample::select(vec![
                "{\"prompt_tokens\":3,\"completion_tokens\":4}",
                "{}",
                "null",
                "[]",
                "7",
                "{\"input_tokens\":5,\"output_tokens\":6}",
            ]),
            before in "[ \t\r\n]{0,2}",
            after in "[ \t\r\n]{0,2}",
            text in proptest::sample::select(vec!["hi", "the \\\"usage\\\": {x}", "usage"]),
            keyed in any::<bool>(),
        ) {
            let usage = if keyed {
                format!(",\"usage\"{before}:{after}{value}")
            } else {
                String::new()
            };
            let inner = format!("{{\"text\":\"{text}\"{usage}}}");
            let event = if nested {
                format!("{{\"type\":\"response.completed\",\"response\":{inner}}}")
            } else {
                inner
            };
            let parsed = parse_json(event.as_bytes());
            if parsed.is_some() {
                prop_assert!(has_usage_object(event.as_bytes()), "{}", event);
            }
            // As a stream: an event's line breaks (CRLF, LF or CR: SSE line ends, JSON
            // whitespace) continue it on further `data:` lines.
            let lines = event.replace("\r\n", "\n").replace('\r', "\n");
            let mut s = SseUsageScanner::default();
            s.feed(format!("data: {}\n\n", lines.replace('\n', "\ndata: ")).as_bytes());
            prop_assert_eq!(s.usage(), parsed, "{}", event);
        }

        /// A body whose strings (before the usage, in it, after it) hold braces, quotes and
        /// backslashes, JSON-escaped, with a nested `usage` after the response's own (an
        /// object in an array, a string in an object): every tail that begins at or before
        /// the response's `"usage"` key reads the usage, exactly as `parse_json` reads the
        /// whole body; a tail that begins after it reads none.
        #[test]
        fn tails_read_the_usage_whatever_the_strings_hold(
            strings in proptest::array::uniform3("[a-z{}\"\\\\:, é]{0,8}"),
            prompt_tokens in 0u64..100_000,
            completion_tokens in 0u64..100_000,
            nested in any::<bool>(),
            later in proptest::sample::select(vec![
                "null",
                r#"{"usage":"high"}"#,
                r#"[{"usage":{"prompt_tokens":1,"completion_tokens":1}}]"#,
            ]),
        ) {
            let [before, inside, after] = strings.map(|s| serde_json::to_string(&s).unwrap());
            let usage = format!(r#"{{"prompt_tokens":{prompt_tokens},"note":{inside},"completion_tokens":{completion_tokens}}}"#);
            let inner = format!(r#"{{"text":{before},"usage":{usage},"end":{after},"later":{later}}}"#);
            let body = if nested {
                format!(r#"{{"type":"response.completed","response":{inner},"x":{after}}}"#)
            } else {
                inner
            };
            let want = Some(Usage { prompt_tokens, completion_tokens, cached_tokens: None });
            prop_assert_eq!(parse_json(body.as_bytes()), want, "{}", body);
            let key = body.find("\"usage\"").unwrap();
            for cut in 0..body.len() {
                let got = parse_json_tail(&body.as_bytes()[cut..]);
                prop_assert_eq!(got, if cut <= key { want } else { None }, "{} from {}", body, cut);
            }
        }

        /// Arbitrary bytes never panic and never grow the tail past the bound.
        #[test]
        fn arbitrary_bytes(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 0..10)) {
            let mut s = SseUsageScanner::new(128);
            for c in chunks { s.feed(&c); prop_assert!(s.tail_len() <= 128); }
            s.finish();
        }
    }

    #[test]
    fn only_events_with_a_usage_object_are_parsed() {
        for (event, want) in [
            (
                &br#"{"choices":[{"delta":{"content":"Hi"}}],"usage":null}"#[..],
                false,
            ),
            (br#"{"choices":[{"delta":{"content":"Hi"}}]}"#, false),
            (br#"{"choices":[],"usage":{"prompt_tokens":1}}"#, true),
            (b"{\"usage\" :\r\n {\"prompt_tokens\":1}}", true),
            (
                br#"{"type":"response.completed","response":{"usage":{"input_tokens":1}}}"#,
                true,
            ),
            (br#"{"usage":[1]}"#, false),
            (br#"{"content":"the \"usage\": {x}"}"#, false),
            (br#"{"usage":null,"x":{"usage":{"prompt_tokens":1}}}"#, true),
            (br#""usage""#, false),
        ] {
            assert_eq!(
                has_usage_object(event),
                want,
                "{}",
                String::from_utf8_lossy(event)
            );
        }
    }

    /// What [`FirstTokenScanner::feed`] returned for each of `chunks`, fed in order.
    fn first_token_by_chunk(chunks: &[&[u8]]) -> Vec<bool> {
        let mut s = FirstTokenScanner::new();
        chunks.iter().map(|c| s.feed(c)).collect()
    }

    #[test]
    fn keep_alives_and_events_without_data_are_no_first_token() {
        for (name, chunks, want) in [
            (
                "comment, then a token",
                &[&b": ping\n\n"[..], b"data: {\"choices\":[]}\n\n"][..],
                &[false, true][..],
            ),
            ("comment, CRLF", &[b":keep-alive\r\n\r\n"], &[false]),
            ("empty comment", &[b":\n\n"], &[false]),
            ("OpenRouter", &[b": OPENROUTER PROCESSING\n\n"], &[false]),
            ("event only", &[b"event: ping\n\n"], &[false]),
            ("retry only", &[b"retry: 3000\n\n"], &[false]),
            ("id only", &[b"id: 7\n\n"], &[false]),
            ("unknown field", &[b"error: {\"code\":500}\n\n"], &[false]),
            ("longer name", &[b"dataxyz: {}\n\n"], &[false]),
            ("indented name", &[b" data: {}\n\n"], &[false]),
            ("done", &[b"data: [DONE]\n\n"], &[false]),
            ("done, no space, CRLF", &[b"data:[DONE]\r\n\r\n"], &[false]),
            ("done, unterminated", &[b"data: [DONE]"], &[false]),
            ("done and more", &[b"data: [DONE] \n\n"], &[false]),
            ("empty data", &[b"data:\n\n"], &[false]),
            ("empty data after the space", &[b"data: \n\n"], &[false]),
            ("data without colon", &[b"data\n\n"], &[false]),
            (
                "vLLM's error, then DONE",
                &[b"data: {\"error\": {\"message\": \"x\", \"code\": 400}}\n\ndata: [DONE]\n\n"],
                &[false],
            ),
            (
                "error, compact",
                &[b"data:{\"error\":{}}\r\n\r\n"],
                &[false],
            ),
            (
                "error split",
                &[b"data: {\"err", b"or\": {}}\n\n"],
                &[false, false],
            ),
            ("an error's prefix only", &[b"data: {\"err\n\n"], &[true]),
            (
                "an object: a token",
                &[b"data: {\"id\":\"x\"}\n\n"],
                &[true],
            ),
            (
                "spaced error: a token",
                &[b"data: { \"error\": {}}\n\n"],
                &[true],
            ),
            (
                "comment and token in one chunk",
                &[b": ping\n\ndata: {}\n\n"],
                &[true],
            ),
            (
                "a ping event's data is data",
                &[b"event: ping\ndata: {}\n\n"],
                &[true],
            ),
            (
                "two spaces: not the marker",
                &[b"data:  [DONE]\n\n"],
                &[true],
            ),
            ("CR line ends", &[b": ping\r\rdata: x\r\r"], &[true]),
        ] {
            assert_eq!(first_token_by_chunk(chunks), want, "{name}");
        }
    }

    /// `"error": null` is no error: a token event that carries it (a serializer writing every
    /// field) is the first token, decided at the `l` ending `null`; any other value, or a
    /// line that ends first, keeps the event an error.
    #[test]
    fn an_error_key_is_an_error_event_unless_its_value_is_null() {
        for (name, chunks, want) in [
            (
                "null error, compact",
                &[
                    &b"data: {\"error\":null,\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"[..],
                ][..],
                &[true][..],
            ),
            (
                "null error, spaced",
                &[b"data: {\"error\" :\t null, \"choices\":[]}\n\n"],
                &[true],
            ),
            (
                "null error alone",
                &[b"data:{\"error\":null}\r\n\r\n"],
                &[true],
            ),
            (
                "object error",
                &[b"data: {\"error\":{\"message\":\"x\",\"code\":500}}\n\n"],
                &[false],
            ),
            ("string error", &[b"data: {\"error\": \"x\"}\n\n"], &[false]),
            ("false error", &[b"data: {\"error\": false}\n\n"], &[false]),
            ("not quite null", &[b"data: {\"error\": nul}\n\n"], &[false]),
            (
                "null cut by the line end",
                &[b"data: {\"error\": nul\n\n"],
                &[false],
            ),
            ("no colon", &[b"data: {\"error\" null}\n\n"], &[false]),
            (
                "split inside null",
                &[b"data: {\"error\": nu", b"ll, \"choices\":[]}\n\n"],
                &[false, true],
            ),
            (
                "split before the colon",
                &[b"data: {\"error\"", b":null}\n\n"],
                &[false, true],
            ),
            (
                "object error, then a null error",
                &[b"data: {\"error\":{}}\n\ndata: {\"error\":null}\n\n"],
                &[true],
            ),
        ] {
            assert_eq!(first_token_by_chunk(chunks), want, "{name}");
        }
        // Decided at the `l` that ends `null`, fed byte by byte.
        let body = b"data: {\"error\": null}\n\n";
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        let at = body.iter().rposition(|&b| b == b'l');
        assert_eq!(at, Some(19));
        assert_eq!(first_token_by_chunk(&bytes).iter().position(|&f| f), at);
        assert_eq!(first_token_oracle(body), at);
    }

    /// An event's `data` lines are one value, joined by LFs (SSE spec), and the LF between
    /// two of them is JSON whitespace: an error object split over two lines is an error, an
    /// `"error": null` split over two lines a token, and a value that starts with `[DONE]`
    /// stays no token whatever lines follow it in its event. Empty `data` lines before the
    /// value are passed over; a blank line ends the event and its value.
    #[test]
    fn an_events_data_lines_are_one_value() {
        for (name, chunks, want) in [
            (
                "an error object over two lines",
                &[&b"data: {\"error\":\ndata: {\"message\":\"x\"}}\n\n"[..]][..],
                &[false][..],
            ),
            (
                "an error object over two lines, CR",
                &[b"data:{\"error\"\rdata: {}}\r\r"],
                &[false],
            ),
            (
                "an error, then a token line in its event",
                &[b"data: {\"error\":{}}\ndata: {\"choices\":[]}\n\n"],
                &[false],
            ),
            (
                "another field between the lines",
                &[b"data: {\"error\":\nid: 7\ndata: {\"code\":500}}\n\n"],
                &[false],
            ),
            (
                "a null error over two lines",
                &[b"data: {\"error\":\ndata: null, \"choices\":[]}\n\n"],
                &[true],
            ),
            (
                "a null error, the colon on the second line",
                &[b"data: {\"error\"\r\ndata: :null}\r\n\r\n"],
                &[true],
            ),
            (
                "null broken by the line end",
                &[b"data: {\"error\": nu\ndata: ll}\n\n"],
                &[false],
            ),
            (
                "done, then more data in its event",
                &[b"data: [DONE]\ndata: x\n\n"],
                &[false],
            ),
            (
                "an empty data line first",
                &[b"data:\ndata\ndata: {\"choices\":[]}\n\n"],
                &[true],
            ),
            (
                "an empty data line, then an error",
                &[b"data:\ndata: {\"error\":{}}\n\n"],
                &[false],
            ),
            (
                "an error event, then a token event",
                &[b"data: {\"error\":\n\ndata: {\"choices\":[]}\n\n"],
                &[true],
            ),
            (
                "a marker's prefix, then its rest",
                &[b"data: [DO\ndata: NE]\n\n"],
                &[true],
            ),
            (
                "split between the lines",
                &[b"data: {\"error\":\n", b"data: {}}\n\n"],
                &[false, false],
            ),
        ] {
            assert_eq!(first_token_by_chunk(chunks), want, "{name}");
            let body = chunks.concat();
            assert_eq!(
                first_token_oracle(&body).is_some(),
                *want.last().unwrap(),
                "{name}: oracle"
            );
        }
        // Decided at the `l` that ends `null` on the second line, fed byte by byte.
        let body = b"data: {\"error\":\ndata: null}\n\n";
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        let at = body.iter().rposition(|&b| b == b'l');
        assert_eq!(at, Some(25));
        assert_eq!(first_token_by_chunk(&bytes).iter().position(|&f| f), at);
        assert_eq!(first_token_oracle(body), at);
    }

    #[test]
    fn a_token_split_across_chunks_is_found_where_its_value_begins() {
        for (name, chunks, want) in [
            (
                "inside the name",
                &[&b"da"[..], b"ta: {\"x\":1}\n\n"][..],
                &[false, true][..],
            ),
            (
                "inside the value",
                &[b"data: {\"ch", b"oices\":[]}\n\n"],
                &[true, true],
            ),
            ("after the space", &[b"data: ", b"{}\n\n"], &[false, true]),
            (
                "before the space",
                &[b"data:", b" [DONE]\n\n"],
                &[false, false],
            ),
            (
                "inside the marker",
                &[b"data: [DO", b"NE]\n\n"],
                &[false, false],
            ),
            (
                "a marker's prefix only",
                &[b"data: [DO", b"\n\n"],
                &[false, true],
            ),
            ("CRLF split", &[b": ping\r", b"\ndata: x"], &[false, true]),
            (
                "CRLF split, blank line",
                &[b": ping\r", b"\n\r\n"],
                &[false, false],
            ),
            (
                "comment then data in the next",
                &[b": ping\n\n: ping\n", b"\ndata: {}", b"\n\n"],
                &[false, true, true],
            ),
        ] {
            assert_eq!(first_token_by_chunk(chunks), want, "{name}");
        }
    }

    #[test]
    fn responses_api_lifecycle_events_are_no_first_token() {
        let created = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\"}}\n\n";
        let in_progress =
            b"event: response.in_progress\r\ndata: {\"type\":\"response.in_progress\"}\r\n\r\n";
        let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n";
        for (name, chunks, want) in [
            (
                "created, in progress, then a delta",
                &[&created[..], in_progress, delta][..],
                &[false, false, true][..],
            ),
            (
                "queued, split in its type",
                &[b"event: response.que", b"ued\ndata: {}\n\n"],
                &[false, false],
            ),
            (
                "its type ends with its event",
                &[b"event: response.created\n\ndata: {}\n\n"],
                &[true],
            ),
            (
                "a longer type",
                &[b"event: response.created.x\ndata: {}\n\n"],
                &[true],
            ),
            (
                "a later event line",
                &[b"event: response.created\nevent: x\ndata: {}\n\n"],
                &[true],
            ),
            (
                "an error event, then a failed response",
                &[
                    b"event: error\ndata: {\"type\":\"error\",\"message\":\"x\"}\n\n",
                    b"event: response.failed\ndata: {\"type\":\"response.failed\"}\n\n",
                ],
                &[false, false],
            ),
        ] {
            assert_eq!(first_token_by_chunk(chunks), want, "{name}");
        }
    }

    /// Where the first token of `body` is decided, read as a whole by the SSE spec's rules
    /// (the oracle for [`FirstTokenScanner`]): each event's data is its `data` values (those
    /// read while its type is none of `LIFECYCLE_EVENTS`), each followed by a LF at its
    /// line end's index ([`event_data_decided`] has the rule). The first event whose data
    /// is a token decides; `None` when the body shows no token. One leading byte order mark
    /// is skipped, as the spec says.
    fn first_token_oracle(body: &[u8]) -> Option<usize> {
        match body.strip_prefix(BOM) {
            Some(rest) => first_token_in_lines(rest).map(|i| i + BOM.len()),
            None => first_token_in_lines(body),
        }
    }

    /// [`first_token_oracle`] of a body without a leading byte order mark.
    fn first_token_in_lines(body: &[u8]) -> Option<usize> {
        let mut lifecycle = false;
        // The current event's data: each byte with its index in `body`.
        let mut data: Vec<(u8, usize)> = Vec::new();
        for (start, end, terminator) in spec_lines(body) {
            let line = &body[start..end];
            if line.is_empty() {
                if let Some(at) = event_data_decided(&data) {
                    return Some(at);
                }
                data.clear();
                lifecycle = false;
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (name, value) = spec_field(line);
            match name {
                b"event" => lifecycle = LIFECYCLE_EVENTS.contains(&value),
                b"data" if !lifecycle => {
                    let at = end - value.len();
                    data.extend(value.iter().enumerate().map(|(j, &b)| (b, at + j)));
                    // A line that the body ends without a line end has no LF yet.
                    data.extend(terminator.map(|t| (b'\n', t)));
                }
                _ => {}
            }
        }
        event_data_decided(&data)
    }

    /// Where an event's data (bytes with their indexes) is decided a token, by the rule on
    /// [`FirstTokenScanner`] applied to the whole: past its leading LFs, the first byte at
    /// which it stops being a prefix of one of `NO_TOKEN_DATA`, or, past `{"error"`, the `l`
    /// ending the `null` of `[ \t\n]*:[ \t\n]*null`; `None` when it is no token (empty,
    /// `[DONE]`, another error, or undecided when the data ends).
    fn event_data_decided(data: &[(u8, usize)]) -> Option<usize> {
        let begun = data
            .iter()
            .position(|&(b, _)| b != b'\n')
            .unwrap_or(data.len());
        let (value, at): (Vec<u8>, Vec<usize>) = data[begun..].iter().copied().unzip();
        if let Some(rest) = value.strip_prefix(ERROR_KEY) {
            let spaces = |s: &[u8]| {
                s.iter()
                    .take_while(|&&b| matches!(b, b' ' | b'\t' | b'\n'))
                    .count()
            };
            let colon = ERROR_KEY.len() + spaces(rest);
            if value.get(colon) != Some(&b':') {
                return None;
            }
            let null = colon + 1 + spaces(&value[colon + 1..]);
            return value[null..]
                .starts_with(NULL)
                .then(|| at[null + NULL.len() - 1]);
        }
        if value.starts_with(DONE) {
            return None;
        }
        let decided = |j: usize| !NO_TOKEN_DATA.iter().any(|m| m.starts_with(&value[..=j]));
        (0..value.len()).find(|&j| decided(j)).map(|j| at[j])
    }

    /// The lines of `body` (one without a leading byte order mark) as the SSE spec cuts them,
    /// a line ending with CRLF, LF or CR: (start, end, index of its line end) of each,
    /// the last one without a line end included.
    fn spec_lines(body: &[u8]) -> Vec<(usize, usize, Option<usize>)> {
        let mut lines = Vec::new();
        let (mut i, mut start) = (0, 0);
        while i < body.len() {
            match body[i] {
                b'\n' | b'\r' => {
                    lines.push((start, i, Some(i)));
                    let crlf = body[i] == b'\r' && body.get(i + 1) == Some(&b'\n');
                    i += if crlf { 2 } else { 1 };
                    start = i;
                }
                _ => i += 1,
            }
        }
        if start < body.len() {
            lines.push((start, body.len(), None));
        }
        lines
    }

    /// A line's field name and value, as the SSE spec splits them: at the first `:`, one
    /// space after it skipped; a line without `:` is a name with an empty value.
    fn spec_field(line: &[u8]) -> (&[u8], &[u8]) {
        match line.iter().position(|&b| b == b':') {
            Some(p) => {
                let v = &line[p + 1..];
                (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        }
    }

    proptest! {
        /// However a stream of comments, data-less events, lifecycle events, `[DONE]`,
        /// tokens and events of several `data` lines (an error object or its `null` written
        /// over two), with any line ends, is cut into chunks, the scanner reports the first
        /// token exactly from the chunk that holds the byte deciding it.
        #[test]
        fn first_token_is_found_in_the_chunk_that_decides_it(
            lines in proptest::collection::vec((
                proptest::sample::select(vec![
                    "", ":", ": ping", ":keep-alive", "event: ping", "event: response.created",
                    "event: response.in_progress", "event", "retry: 3000", "id: 7", "data",
                    "data:", "data: ", "data: [DONE]", "data:[DONE]", "data: [DO", "data: [",
                    "data: {\"choices\":[]}", "data:x", "error: {}", "data: {\"error\": {}}",
                    "data:{\"error\"", "data: {\"err", "data: {\"", "event: error",
                    "event: response.failed", "data: {\"error\":null,\"choices\":[]}",
                    "data: {\"error\" :\tnull}", "data: {\"error\": nul", "data:{\"error\":",
                    "data: {\"error\": {\"code\": 500}}", "data: {\"error\":",
                    "data: null, \"choices\":[]}", "data: {\"message\":\"x\"}}", "data: nu",
                    "data: ll}", "data: :null}", "data:\t null}", "data: \"x\"}",
                ]),
                proptest::sample::select(vec!["\n", "\r\n", "\r"]),
            ), 0..12),
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let body: Vec<u8> = lines
                .iter()
                .flat_map(|(l, end)| l.bytes().chain(end.bytes()))
                .collect();
            let decided = first_token_oracle(&body);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = FirstTokenScanner::new();
            let mut prev = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                let found = s.feed(&body[prev..c]);
                prev = c;
                prop_assert_eq!(found, decided.is_some_and(|d| d < c), "{:?} through {}", String::from_utf8_lossy(&body), c);
            }
        }
    }

    proptest! {
        /// Bodies built from SSE's own pieces in any order (names, separators, line ends,
        /// `[DONE]`, lifecycle types, NUL, invalid UTF-8 and byte order marks, one possibly
        /// leading), cut anywhere: the scanner agrees with the oracle at every cut.
        #[test]
        fn first_token_of_any_byte_soup_matches_the_oracle(
            bom in any::<bool>(),
            pieces in proptest::collection::vec(proptest::sample::select(vec![
                &b"data"[..], b"data:", b"data: {", b"event: ", b"event", b"dat", b"eventx",
                b":", b" ", b"\n", b"\r", b"\r\n",
                b"[DONE]", b"[DO", b"[", b"x", b"{}", b"response.created", b"response.queued",
                b"{\"error\"", b"{\"e", b"error", b"\"", b"null", b"nu", b"\t", b"{\"error\":null",
                b"\0", b"\xFF\xFE", b"\xEF", b"\xEF\xBB\xBF", b"\xBB\xBF", b"\ndata: ",
                b"\rdata:",
            ]), 0..40),
            cuts in proptest::collection::vec(0usize..400, 0..10),
        ) {
            let mut body: Vec<u8> = if bom { BOM.to_vec() } else { Vec::new() };
            body.extend(pieces.iter().flat_map(|p| p.iter().copied()));
            let decided = first_token_oracle(&body);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = FirstTokenScanner::new();
            let mut prev = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                let found = s.feed(&body[prev..c]);
                prev = c;
                prop_assert_eq!(found, decided.is_some_and(|d| d < c), "{:?} through {}", body, c);
            }
        }
    }

    /// The usage of `body` read as a whole by the SSE spec's rules (the oracle for
    /// [`SseUsageScanner`], whose doc has the rule): each event's data is the `data`
    /// values, each followed by a LF; data over `max_tail` bytes is read by
    /// [`parse_json_tail`] from its last `max_tail` bytes, other data by [`parse_json`]
    /// (no gate); the last event is read even without its blank line; the last usage wins.
    fn usage_oracle(body: &[u8], max_tail: usize) -> Option<Usage> {
        let body = body.strip_prefix(BOM).unwrap_or(body);
        let read = |data: &[u8]| match data.len() > max_tail {
            true => parse_json_tail(&data[data.len() - max_tail..]),
            false => parse_json(data),
        };
        let (mut last, mut data) = (None, Vec::new());
        for (start, end, _) in spec_lines(body) {
            let line = &body[start..end];
            if line.is_empty() {
                last = read(&data).or(last);
                data.clear();
                continue;
            }
            if let (b"data", value) = spec_field(line) {
                data.extend_from_slice(value);
                data.push(b'\n');
            }
        }
        read(&data).or(last)
    }

    /// Feed `body` cut at `cuts` (taken modulo its length, sorted), checking the tail bound
    /// after each chunk; the usage after `finish`.
    fn usage_fed_in_cuts(body: &[u8], cuts: Vec<usize>, max_tail: usize) -> Option<Usage> {
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
        cuts.sort_unstable();
        let mut chunks = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([body.len()]) {
            chunks.push(&body[prev..c]);
            prev = c;
        }
        usage_by_chunks(max_tail, &chunks)
    }

    proptest! {
        /// Streams of usage events (chat, Responses, split over several `data` lines,
        /// longer than the tail), token events, comments and `[DONE]`, with any line ends
        /// and possibly a leading BOM, cut anywhere: the scanner's usage is the oracle's.
        #[test]
        fn usage_of_any_chunking_matches_the_oracle(
            bom in any::<bool>(),
            lines in proptest::collection::vec((
                proptest::sample::select(vec![
                    "", "", ":", ": ping", "event: response.completed", "id: 7", "data",
                    "data:", "data: ", "data: [DONE]", "data:  x",
                    "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}",
                    "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}",
                    "data:{\"usage\" : {\"prompt_tokens\":8,\"prompt_tokens_details\":{\"cached_tokens\":4}}}",
                    "data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":2}}}",
                    "data: {\"text\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\",",
                    "data: \"usage\":{\"input_tokens\":9,\"output_tokens\":3}}",
                    "data: {\"usage\":",
                    "data: {\"prompt_tokens\":3}}",
                    "dat", "datax: {\"usage\":{\"prompt_tokens\":4}}", " data: {}",
                ]),
                proptest::sample::select(vec!["\n", "\r\n", "\r"]),
            ), 0..14),
            max_tail in proptest::sample::select(vec![0usize, 16, 64, 100, 256, DEFAULT_MAX_TAIL]),
            cuts in proptest::collection::vec(0usize..600, 0..10),
        ) {
            let mut body: Vec<u8> = if bom { BOM.to_vec() } else { Vec::new() };
            body.extend(lines.iter().flat_map(|(l, end)| l.bytes().chain(end.bytes())));
            let want = usage_oracle(&body, max_tail);
            prop_assert_eq!(usage_fed_in_cuts(&body, cuts, max_tail), want, "{:?}", String::from_utf8_lossy(&body));
        }

        /// Bodies of SSE's pieces and usage fragments in any order (line ends, names,
        /// byte order marks, invalid UTF-8), with any tail bound, cut anywhere: the
        /// scanner's usage is the oracle's.
        #[test]
        fn usage_of_any_byte_soup_matches_the_oracle(
            bom in any::<bool>(),
            pieces in proptest::collection::vec(proptest::sample::select(vec![
                &b"data"[..], b"data:", b"data: ", b"event: ", b"dat", b":", b" ", b"\n",
                b"\r", b"\r\n", b"{\"usage\":", b"{\"usage\":{\"prompt_tokens\":2}}",
                b"{\"prompt_tokens\":3,\"completion_tokens\":1}", b"}", b"null", b"[DONE]",
                b"{\"response\":", b"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", b"\xEF\xBB\xBF", b"\xEF",
                b"\xFF",
            ]), 0..40),
            max_tail in proptest::sample::select(vec![0usize, 8, 32, 64, 256]),
            cuts in proptest::collection::vec(0usize..600, 0..10),
        ) {
            let mut body: Vec<u8> = if bom { BOM.to_vec() } else { Vec::new() };
            body.extend(pieces.iter().flat_map(|p| p.iter().copied()));
            let want = usage_oracle(&body, max_tail);
            prop_assert_eq!(usage_fed_in_cuts(&body, cuts, max_tail), want, "{:?}", body);
        }
    }

    /// The SSE spec strips one leading U+FEFF: a stream that opens with it is still an
    /// event stream, its first line still a field, whole or cut byte by byte. A second
    /// mark, or one later in the stream, is part of a line; a body that only looks like
    /// the start of one is read as it is.
    #[test]
    fn a_leading_byte_order_mark_is_skipped() {
        let stream = b"\xEF\xBB\xBFdata: {\"choices\":[]}\n\n";
        assert_eq!(BodyFraming::sniff(stream), Some(BodyFraming::EventStream));
        assert_eq!(
            BodyFraming::sniff(b"\xEF\xBB\xBF{\"usage\":{}}"),
            Some(BodyFraming::Json)
        );
        assert_eq!(
            BodyFraming::sniff(b"\xEF\xBB\xBF: ping\n"),
            Some(BodyFraming::EventStream)
        );
        for partial in [
            &b"\xEF"[..],
            b"\xEF\xBB",
            b"\xEF\xBB\xBF",
            b"\xEF\xBB\xBFda",
        ] {
            assert_eq!(BodyFraming::sniff(partial), None, "{partial:?}");
        }
        assert_eq!(BodyFraming::sniff(b"\xEF\xBBx"), Some(BodyFraming::Other));
        assert_eq!(
            BodyFraming::sniff(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n"),
            Some(BodyFraming::Other)
        );
        let mut s = FirstTokenScanner::new();
        assert!(s.feed(stream));
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        let by_byte = first_token_by_chunk(&bytes);
        // Decided at the `c` of `{"choices"`, where the value stops being a prefix of `{"error"`.
        let at = stream.iter().position(|&b| b == b'{').unwrap() + 2;
        assert_eq!(by_byte.iter().position(|&f| f), Some(at));
        for (name, body, want) in [
            (
                "two marks",
                &b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\n"[..],
                false,
            ),
            (
                "a mark on a later line",
                b": ping\n\xEF\xBB\xBFdata: x\n\n",
                false,
            ),
            ("a cut-off mark", b"\xEF\xBBdata: x\n\ndata: y\n", true),
            (
                "a mark, then a comment",
                b"\xEF\xBB\xBF:\xEF\xBB\xBF\n\n",
                false,
            ),
        ] {
            assert_eq!(FirstTokenScanner::new().feed(body), want, "{name}");
            assert_eq!(first_token_oracle(body).is_some(), want, "{name}: oracle");
        }
    }

    /// Lines of megabytes without a line end (a comment, a long `event` type, an unknown
    /// field, a data value) cost no memory: the scanner holds at most one field name or
    /// `event` value, and a line that cannot matter is skipped to its end.
    #[test]
    fn megabyte_lines_keep_the_scanner_constant_in_size() {
        assert!(std::mem::size_of::<FirstTokenScanner>() <= 64);
        let mb = vec![b'x'; 1 << 20];
        for (name, head, tail, want) in [
            ("a comment", &b":"[..], &b"\n\ndata: {}\n"[..], true),
            (
                "a long event type",
                b"event: response.created",
                b"\ndata: {}\n",
                true,
            ),
            ("an unknown field", b"error: ", b"\ndata: {}\n", true),
            ("a long field name", b"data", b": {}\n", false),
            (
                "lifecycle data",
                b"event: response.created\ndata: ",
                b"\ndata: {}\n",
                false,
            ),
        ] {
            let mut s = FirstTokenScanner::new();
            let mut found = s.feed(head);
            for _ in 0..4 {
                found |= s.feed(&mb);
            }
            assert!(!found, "{name}: found in the long line");
            assert_eq!(s.feed(tail), want, "{name}");
        }
        // A data value is decided by its first byte, however long the line goes on.
        let mut s = FirstTokenScanner::new();
        assert!(s.feed(b"data: \0"));
        assert!(s.feed(&mb));
    }

    #[test]
    fn body_framing_is_sniffed_from_the_first_bytes() {
        use BodyFraming::{EventStream, Json, Other};
        assert_eq!(BodyFraming::sniff(CHAT), Some(Json));
        assert_eq!(BodyFraming::sniff(b" \r\n\t[{}]"), Some(Json));
        assert_eq!(BodyFraming::sniff(&stream()), Some(EventStream));
        assert_eq!(BodyFraming::sniff(b": keep-alive\n\n"), Some(EventStream));
        assert_eq!(
            BodyFraming::sniff(b"event: response.created\n"),
            Some(EventStream)
        );
        assert_eq!(BodyFraming::sniff(b"id: 7\ndata: x\n\n"), Some(EventStream));
        assert_eq!(BodyFraming::sniff(b"retry:1000\n"), Some(EventStream));
        assert_eq!(BodyFraming::sniff(b"data\n\n"), Some(EventStream));
        // Not a stream: no usage to read and no first token.
        assert_eq!(BodyFraming::sniff(b"upstream connect error"), Some(Other));
        assert_eq!(BodyFraming::sniff(b"<html><body>502</body>"), Some(Other));
        assert_eq!(BodyFraming::sniff(b"Internal Server Error\n"), Some(Other));
        assert_eq!(BodyFraming::sniff(b"\x1f\x8b\x08\x00"), Some(Other), "gzip");
        assert_eq!(BodyFraming::sniff(b"database: down\n"), Some(Other));
        // Too short to tell: wait for more bytes.
        assert_eq!(BodyFraming::sniff(b""), None);
        assert_eq!(BodyFraming::sniff(b" \n\r\n"), None);
        assert_eq!(BodyFraming::sniff(b"dat"), None);
        assert_eq!(BodyFraming::sniff(b"  ev"), None);
        assert_eq!(BodyFraming::sniff(b"datab"), Some(Other));
    }
}
