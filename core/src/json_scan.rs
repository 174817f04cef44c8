//! A byte scanner for JSON (RFC 8259), the primitives of the single-pass request analysis
//! ([`crate::analysis`]).
//!
//! The analysis reads a handful of fields out of bodies that are mostly one large string
//! array, so the scanner builds nothing: [`Scanner::skip_value`] validates and steps over a
//! value, [`Scanner::key`] reads an object key (borrowed unless it has escapes), and the
//! caller reads the strings it needs piece by piece through [`Scanner::string_stretch`] and
//! [`Scanner::escape`]. Strings are searched for their end eight bytes at a time (SWAR on a
//! `u64`, which wasm32 executes natively).
//!
//! What it accepts is exactly what `serde_json` 1.0 accepts when it skips a value
//! (`Deserializer::ignore_value`): the same number grammar (one leading zero, digits after
//! `.` and `e`), escapes checked for their letter and four hex digits (surrogates are checked
//! only where a string is decoded, [`decode_escape`]), control characters rejected inside
//! strings, and no limit on nesting: containers are tracked on a heap stack, never by
//! recursion, so no input can overflow the call stack. `core/tests/analysis_differential.rs`
//! holds the two to the same results.
//!
//! The scanner works on bytes. A body ([`Scanner::from_bytes`]) is validated as UTF-8 only
//! where its text is read, a stretch at a time in one `simdutf8` pass ([`Scanner::text`]:
//! keys, pieces, tokens; [`Scanner::decode_plain_into`]), never where
//! [`Scanner::skip_raw`] passes it: outside strings every byte is ASCII or a syntax
//! error, and the rest of every string is read, or kept or skipped as a token whose text
//! is validated, so a bad byte anywhere else is still an error, at that byte. Validating
//! the whole body up front cost ~19 % of a 1 MiB decision for bytes the raw skip passes
//! (docs/overhead.md).

use std::borrow::Cow;
use std::ops::Range;

/// A syntax error: byte offset of the offending byte and what was expected there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    /// Byte offset into the scanned text.
    pub pos: usize,
    /// What went wrong (serde_json's wording where there is one).
    pub message: Cow<'static, str>,
}

pub(crate) type Syn<T> = Result<T, SyntaxError>;

/// Outcome of decoding a string's escapes where the string is syntactically valid but holds
/// a lone UTF-16 surrogate (`"\ud800"`): serde_json refuses such a string as `str`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BadString;

/// Where [`Scanner::walk_plain`] stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Walk {
    /// The closing quote was reached (and consumed).
    pub closed: bool,
    /// One-letter escapes walked over (each two bytes, decoded to one).
    pub escapes: usize,
    /// Byte range of the plain text after the last escape, up to where the walk stopped
    /// (the closing quote excluded): walked, but not handed to the escape callback.
    /// Offsets into the scanned bytes from [`Scanner::decode_plain_into`], into the
    /// validated stretch within [`Scanner::walk_plain`].
    pub plain: Range<usize>,
}

impl Walk {
    /// Decoded length of what a walk that started at byte `start` passed (the closing
    /// quote excluded): its bytes less one per escape.
    #[cfg(test)]
    pub(crate) fn decoded_len(&self, start: usize) -> usize {
        self.plain
            .end
            .saturating_sub(start)
            .saturating_sub(self.escapes)
    }
}

/// Cursor over a JSON text: its bytes, and the stretch of them last validated as UTF-8.
pub(crate) struct Scanner<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Open containers of [`Self::skip_value`] (`[` or `{`); reused across calls.
    stack: Vec<u8>,
    /// `bytes[valid_at..]`'s first `valid.len()` bytes, validated as UTF-8: text is sliced
    /// from it ([`Self::text`]), and a read past it validates the next stretch
    /// ([`Self::cover`]).
    valid: &'a str,
    valid_at: usize,
}

/// Bytes validated past the end of a text read that the validated stretch does not hold
/// ([`Scanner::cover`]): past the prefix rendering, where such reads are a sampling
/// window's text and the word its end cuts (at most 64 bytes, `analysis.rs`), one
/// validation takes both; more would validate bytes the next raw skip passes (1 MiB body:
/// 16 / 64 / 160 bytes ahead, 3.099 M / 3.073 M / 3.087 M Wasm operations per decision).
const COVER_AHEAD_BYTES: usize = 64;

/// Message of the syntax error at a byte that is not UTF-8.
const NOT_UTF8: &str = "body is not valid UTF-8";

/// Whether `b` continues a multi-byte UTF-8 character (`0b10xx_xxxx`).
#[inline(always)]
fn is_continuation(b: u8) -> bool {
    (b as i8) < -0x40
}

/// `at` moved back onto the start of the character it is inside (at most 3 bytes back,
/// never below `floor`). Where no character starts within 3 bytes (the bytes are not
/// UTF-8), `at` itself: the text read from there reports the error.
#[inline]
fn char_start(bytes: &[u8], at: usize, floor: usize) -> usize {
    let mut i = at;
    while i > floor && bytes.get(i).copied().is_some_and(is_continuation) {
        if at - i == 3 {
            return at;
        }
        i -= 1;
    }
    i
}

/// Backslashes right before byte `at` of `bytes`, counted back no further than `floor`: an
/// odd count makes the byte at `at` escaped (a quote there is inside its string). Escapes
/// before `floor` must be whole, so that a run reaching back to it is paired.
#[inline]
pub(crate) fn backslashes_before(bytes: &[u8], at: usize, floor: usize) -> usize {
    bytes
        .get(floor..at)
        .unwrap_or_default()
        .iter()
        .rev()
        .take_while(|&&b| b == b'\\')
        .count()
}

/// The longest prefix of `b` that is UTF-8: all of `b` in one SIMD pass when it is
/// (simdutf8, 16+ bytes per step); std's validation, which tells where it stops, only
/// when it is not.
fn utf8_prefix(b: &[u8]) -> &str {
    if let Ok(s) = simdutf8::basic::from_utf8(b) {
        return s;
    }
    match std::str::from_utf8(b) {
        Ok(s) => s,
        Err(e) => b
            .get(..e.valid_up_to())
            .and_then(|v| std::str::from_utf8(v).ok())
            .unwrap_or_default(),
    }
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Bytes of `w` (little-endian) that are `"`, `\` or below 0x20 get their high bit set.
#[inline(always)]
fn special_mask(w: u64) -> u64 {
    let quote = w ^ (LO * u64::from(b'"'));
    let slash = w ^ (LO * u64::from(b'\\'));
    let zero_quote = quote.wrapping_sub(LO) & !quote;
    let zero_slash = slash.wrapping_sub(LO) & !slash;
    // Bytes below 0x20 (the subtraction borrows only out of bytes that are below it); bytes
    // at or above 0x80 are masked out by `!w` (none of the three is non-ASCII).
    let ctrl = w.wrapping_sub(LO * 0x20);
    (zero_quote | zero_slash | ctrl) & !w & HI
}

/// Length of the stretch of `b` before its first `"`, `\` or control character (or
/// `b.len()` when there is none). With 16-byte lanes ([`crate::simd`]: Wasm SIMD, which
/// the workspace's `.cargo/config.toml` enables for `wasm32-wasip1`, or x86-64's SSE2) it
/// compares 32 bytes per step ([`plain_len_simd`]); otherwise (aarch64 among them) eight
/// bytes per step on a `u64` ([`plain_len_swar`]).
#[inline]
pub(crate) fn plain_len(b: &[u8]) -> usize {
    #[cfg(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))]
    {
        plain_len_simd(b)
    }
    #[cfg(not(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    )))]
    {
        plain_len_swar(b)
    }
}

/// Lanes of `block` that are `"`, `\` or below 0x20, in two lane-wise compares: one for
/// the controls and `"` together, `x ^ 2 < 0x21` (unsigned), which holds exactly for the
/// controls (0x00..=0x1F, which XOR with 2 permutes among themselves) and `"` (0x22 ^ 2 =
/// 0x20); one for `\`.
#[cfg(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
))]
#[inline(always)]
fn special_lanes(block: &[u8; 16]) -> crate::simd::U8x16 {
    use crate::simd::U8x16;
    let v = U8x16::new(block);
    (v ^ U8x16::splat(2)).lt(U8x16::splat(0x21)) | v.eq(U8x16::splat(b'\\'))
}

/// `b[at..at + 16]` (zeros where `b` is shorter: not reached, the callers' blocks are in
/// bounds). LLVM reads it as one unaligned 16-byte load.
#[cfg(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
))]
#[inline(always)]
fn block_at(b: &[u8], at: usize) -> [u8; 16] {
    let mut block = [0u8; 16];
    if let Some(h) = b.get(at..at + 16) {
        block.copy_from_slice(h);
    }
    block
}

/// [`plain_len`] with 16-byte lanes: each block's special bytes by [`special_lanes`]. Two
/// blocks are taken per step and tested together (one test of their combined lanes), so
/// a 32-byte stretch of plain text costs one branch; at a step that has a special byte,
/// the lowest set bit of the two blocks' masks is the first one. A last 16-byte block is
/// taken alone, and the tail (under 16 bytes) goes to [`plain_len_swar`].
#[cfg(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
))]
#[inline]
fn plain_len_simd(b: &[u8]) -> usize {
    let mut i = 0;
    let mut pairs = b.chunks_exact(32);
    for pair in pairs.by_ref() {
        let (Some(lo), Some(hi)) = (pair.first_chunk::<16>(), pair.last_chunk::<16>()) else {
            // Not reached (a 32-byte chunk has both halves); the SWAR scan would go on from `i`.
            return i + plain_len_swar(b.get(i..).unwrap_or(&[]));
        };
        let (lo, hi) = (special_lanes(lo), special_lanes(hi));
        if (lo | hi).any() {
            return i + (lo.bitmask() | (hi.bitmask() << 16)).trailing_zeros() as usize;
        }
        i += 32;
    }
    if let Some(block) = pairs.remainder().first_chunk::<16>() {
        let mask = special_lanes(block).bitmask();
        if mask != 0 {
            return i + mask.trailing_zeros() as usize;
        }
        i += 16;
    }
    i + plain_len_swar(b.get(i..).unwrap_or(&[]))
}

/// Bit `i` set when `chunk[i]` is `"`, `\` or below 0x20: every such byte, not only the
/// first ([`Scanner::walk_plain`] visits them all). With 16-byte lanes, two blocks'
/// [`special_lanes`] and one test for plain text; otherwise [`special_mask32_bytes`].
#[inline(always)]
fn special_mask32(chunk: &[u8; 32]) -> u32 {
    #[cfg(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))]
    {
        let (lo, hi) = (
            special_lanes(&block_at(chunk, 0)),
            special_lanes(&block_at(chunk, 16)),
        );
        // Plain text, the common case: one test, no bit masks.
        if !(lo | hi).any() {
            return 0;
        }
        lo.bitmask() | (hi.bitmask() << 16)
    }
    #[cfg(not(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    )))]
    {
        special_mask32_bytes(chunk)
    }
}

/// [`special_mask32`] as a byte loop (LLVM vectorises it where it can).
#[cfg(any(
    test,
    not(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))
))]
#[inline(always)]
fn special_mask32_bytes(chunk: &[u8; 32]) -> u32 {
    let mut m = 0u32;
    for (i, &b) in chunk.iter().enumerate() {
        m |= u32::from(b == b'"' || b == b'\\' || b < 0x20) << i;
    }
    m
}

/// Bit `i` set when `chunk[i]` is `"`: [`Scanner::skip_raw`]'s step. With 16-byte lanes,
/// four compares and one test for the common step without a quote (~13 Wasm operations
/// per 64 bytes); otherwise eight bytes per step on a `u64` ([`quote_mask64_swar`]).
#[inline(always)]
fn quote_mask64(chunk: &[u8; 64]) -> u64 {
    #[cfg(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))]
    {
        use crate::simd::U8x16;
        let quote = U8x16::splat(b'"');
        let eq = |at: usize| U8x16::new(&block_at(chunk, at)).eq(quote);
        let (a, b, c, d) = (eq(0), eq(16), eq(32), eq(48));
        if !((a | b) | (c | d)).any() {
            return 0;
        }
        u64::from(a.bitmask())
            | (u64::from(b.bitmask()) << 16)
            | (u64::from(c.bitmask()) << 32)
            | (u64::from(d.bitmask()) << 48)
    }
    #[cfg(not(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    )))]
    {
        quote_mask64_swar(chunk)
    }
}

/// [`quote_mask64`] eight bytes per step on a `u64` (LLVM does not vectorise the byte
/// loop: a 1 MiB skip took 2.3× the time of the walk it replaced, natively). A byte of `x`
/// is zero exactly where `w` has a quote; `(x & 0x7F) + 0x7F` sets a byte's high bit when
/// its low seven bits are not all zero, and `| x` when its own high bit is set, so `!t`
/// has the high bit of exactly the zero bytes (no borrow between bytes, unlike
/// `special_mask`'s). The multiply gathers the eight high bits.
#[cfg(any(
    test,
    not(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))
))]
#[inline(always)]
fn quote_mask64_swar(chunk: &[u8; 64]) -> u64 {
    const LOW7: u64 = LO * 0x7F;
    let mut m = 0u64;
    for (k, word) in chunk.chunks_exact(8).enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(word);
        let x = u64::from_le_bytes(b) ^ (LO * u64::from(b'"'));
        let t = ((x & LOW7).wrapping_add(LOW7) | x) & HI;
        let bits = ((!t & HI) >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56;
        m |= bits << (8 * k);
    }
    m
}

/// [`plain_len`] eight bytes at a time (SWAR on a `u64`, which wasm32 executes natively).
#[inline]
pub(crate) fn plain_len_swar(b: &[u8]) -> usize {
    let mut i = 0;
    while let Some(chunk) = b.get(i..i + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        let m = special_mask(u64::from_le_bytes(w));
        if m != 0 {
            // A borrow can flag a byte after the first special one, never before it.
            return i + (m.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            return i;
        }
        i += 1;
    }
    i
}

fn err<T>(pos: usize, message: impl Into<Cow<'static, str>>) -> Syn<T> {
    Err(SyntaxError {
        pos,
        message: message.into(),
    })
}

fn hex_val(b: u8) -> Option<u32> {
    match b {
        b'0'..=b'9' => Some(u32::from(b - b'0')),
        b'a'..=b'f' => Some(u32::from(b - b'a' + 10)),
        b'A'..=b'F' => Some(u32::from(b - b'A' + 10)),
        _ => None,
    }
}

fn hex4(b: &[u8]) -> Option<u32> {
    let q = b.get(..4)?;
    q.iter()
        .try_fold(0u32, |acc, &c| Some((acc << 4) | hex_val(c)?))
}

/// Decode the escape at the start of `esc` (the bytes after a backslash) as serde_json
/// decodes a string: returns the character and the bytes used, or [`BadString`] for a lone
/// or mismatched surrogate. `esc` must be a syntactically valid escape (the scanner checked
/// it).
pub(crate) fn decode_escape(esc: &[u8]) -> Result<(char, usize), BadString> {
    if let Some(b) = simple_escape(esc) {
        return Ok((char::from(b), 1));
    }
    match esc.first().copied().ok_or(BadString)? {
        b'u' => {
            let hi = hex4(esc.get(1..).ok_or(BadString)?).ok_or(BadString)?;
            match hi {
                0xD800..=0xDBFF => {
                    let lo = match esc.get(5..7) {
                        Some(b"\\u") => esc.get(7..).and_then(hex4).ok_or(BadString)?,
                        _ => return Err(BadString),
                    };
                    if !(0xDC00..=0xDFFF).contains(&lo) {
                        return Err(BadString);
                    }
                    let cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                    Ok((char::from_u32(cp).ok_or(BadString)?, 11))
                }
                0xDC00..=0xDFFF => Err(BadString),
                _ => Ok((char::from_u32(hi).ok_or(BadString)?, 5)),
            }
        }
        _ => Err(BadString),
    }
}

/// The byte each one-letter escape's letter stands for ([`simple_escape`] as a table: one
/// load, no branch per letter); 0 for any other byte (no escape stands for 0).
const ESCAPED: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut rest: &mut [u8] = &mut t;
    let mut letter = 0u8;
    while let Some((slot, tail)) = rest.split_first_mut() {
        *slot = match letter {
            b'"' | b'\\' | b'/' => letter,
            b'b' => 0x08,
            b'f' => 0x0C,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            _ => 0,
        };
        rest = tail;
        letter = letter.wrapping_add(1);
    }
    t
};

/// The byte a one-letter escape stands for (`esc` starts after the backslash: `n` → 0x0A,
/// `"` → `"`, ...); `None` for a `\u` escape or anything else.
#[inline]
pub(crate) fn simple_escape(esc: &[u8]) -> Option<u8> {
    let b = ESCAPED.get(usize::from(*esc.first()?)).copied()?;
    (b != 0).then_some(b)
}

/// Decode the inside of a valid JSON string token (between its quotes) piece by piece:
/// unescaped stretches are passed borrowed, each escape as its decoded character.
pub(crate) fn for_each_piece(inner: &str, mut f: impl FnMut(&str)) -> Result<(), BadString> {
    let mut rest = inner;
    while let Some(at) = rest.find('\\') {
        if at > 0 {
            f(rest.get(..at).ok_or(BadString)?);
        }
        let esc = rest.get(at + 1..).ok_or(BadString)?;
        let (ch, used) = decode_escape(esc.as_bytes())?;
        let mut buf = [0u8; 4];
        f(ch.encode_utf8(&mut buf));
        rest = esc.get(used..).ok_or(BadString)?;
    }
    if !rest.is_empty() {
        f(rest);
    }
    Ok(())
}

/// Decode a valid JSON string token (quotes included): borrowed when it has no escapes.
pub(crate) fn decode_str(token: &str) -> Result<Cow<'_, str>, BadString> {
    let inner = token
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .ok_or(BadString)?;
    if !inner.contains('\\') {
        return Ok(Cow::Borrowed(inner));
    }
    let mut out = String::with_capacity(inner.len());
    for_each_piece(inner, |p| out.push_str(p))?;
    Ok(Cow::Owned(out))
}

/// Raw bytes a [`Scanner::raw_match`] looks for: up to 16, as the low bytes of a
/// little-endian `u128` with the mask of those bytes. Built at compile time.
#[derive(Clone, Copy)]
pub(crate) struct RawPattern {
    bits: u128,
    mask: u128,
    len: usize,
}

impl RawPattern {
    /// The pattern of the concatenated `parts`. One longer than 16 bytes never matches.
    pub(crate) const fn new(parts: &[&[u8]]) -> Self {
        let (mut bits, mut mask, mut len) = (0u128, 0u128, 0usize);
        let mut rest = parts;
        while let [part, more @ ..] = rest {
            let mut bytes = *part;
            while let [b, tail @ ..] = bytes {
                if len == 16 {
                    return Self {
                        bits: 1,
                        mask: 0,
                        len: 0,
                    };
                }
                bits |= (*b as u128) << (8 * len);
                mask |= 0xFF << (8 * len);
                len += 1;
                bytes = tail;
            }
            rest = more;
        }
        Self { bits, mask, len }
    }

    /// The object key `"name":` in compact JSON.
    pub(crate) const fn key(name: &str) -> Self {
        Self::new(&[b"\"", name.as_bytes(), b"\":"])
    }

    /// The object key `"name": ` as Python's `json.dumps` writes it by default (separators
    /// `", "` and `": "`; also `requests` and `aiohttp` with `json=`).
    pub(crate) const fn key_spaced(name: &str) -> Self {
        Self::new(&[b"\"", name.as_bytes(), b"\": "])
    }

    /// The JSON string `"text"` (no escape in `text`).
    pub(crate) const fn string(text: &str) -> Self {
        Self::new(&[b"\"", text.as_bytes(), b"\""])
    }
}

impl<'a> Scanner<'a> {
    /// A scanner at the start of `text` (UTF-8 already: nothing is validated again).
    pub(crate) fn new(text: &'a str) -> Self {
        Self {
            bytes: text.as_bytes(),
            pos: 0,
            stack: Vec::new(),
            valid: text,
            valid_at: 0,
        }
    }

    /// A scanner at the start of `bytes`, which are validated as UTF-8 only where they are
    /// read as text: the first `first` bytes now, in one pass, and the rest stretch by
    /// stretch as reads reach them ([`Self::text`], [`Self::decode_plain_into`]). Bytes
    /// passed by [`Self::skip_raw`] are never validated. A byte that is not UTF-8 is a
    /// syntax error where text is read over it.
    pub(crate) fn from_bytes(bytes: &'a [u8], first: usize) -> Self {
        let mut sc = Self {
            bytes,
            pos: 0,
            stack: Vec::new(),
            valid: "",
            valid_at: 0,
        };
        sc.cover(0, first);
        sc
    }

    /// Validate `bytes[start..end]` (and [`COVER_AHEAD_BYTES`] more, up to the end of a
    /// character they cut) and make it the validated stretch; where the bytes are not
    /// UTF-8, the stretch ends before the first bad one. Validating the whole body up
    /// front took ~19 % of a 1 MiB decision's Wasm operations for bytes that the raw skip
    /// then passes unread (docs/overhead.md).
    #[inline]
    fn cover(&mut self, start: usize, end: usize) {
        let len = self.bytes.len();
        let mut end = end.saturating_add(COVER_AHEAD_BYTES).min(len);
        let stop = len.min(end + 3);
        while end < stop && self.bytes.get(end).copied().is_some_and(is_continuation) {
            end += 1;
        }
        self.valid = utf8_prefix(self.bytes.get(start..end).unwrap_or_default());
        self.valid_at = start;
    }

    /// The validated text of `bytes[start..end]`, if the validated stretch holds it.
    #[inline(always)]
    fn valid_text(&self, start: usize, end: usize) -> Option<&'a str> {
        self.valid
            .get(start.wrapping_sub(self.valid_at)..end.wrapping_sub(self.valid_at))
    }

    /// The text of `bytes[start..end]` (`start` and `end` on character boundaries): sliced
    /// from the validated stretch, or validated now ([`Self::cover`]); a syntax error at
    /// the first byte that is not UTF-8.
    #[inline]
    pub(crate) fn text(&mut self, start: usize, end: usize) -> Syn<&'a str> {
        match self.valid_text(start, end) {
            Some(s) => Ok(s),
            None => self.text_uncovered(start, end),
        }
    }

    /// [`Self::text`] where the validated stretch does not hold the range: out of line, so
    /// that the common case inlined at each read stays a slice.
    #[inline(never)]
    fn text_uncovered(&mut self, start: usize, end: usize) -> Syn<&'a str> {
        self.cover(start, end);
        match self.valid_text(start, end) {
            Some(s) => Ok(s),
            None => err(self.valid_at + self.valid.len(), NOT_UTF8),
        }
    }

    /// Current byte offset.
    #[inline]
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The text from `start` to the current position ([`Self::text`]).
    #[inline]
    pub(crate) fn since(&mut self, start: usize) -> Syn<&'a str> {
        self.text(start, self.pos)
    }

    /// The bytes from the current position on.
    #[inline]
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.pos..).unwrap_or(&[])
    }

    /// The text of `len` bytes from the current position ([`Self::text`]; it must end on a
    /// character boundary, which it does before an ASCII delimiter).
    #[inline]
    pub(crate) fn ahead(&mut self, len: usize) -> Syn<&'a str> {
        self.text(self.pos, self.pos + len)
    }

    /// Move forward `n` bytes.
    #[inline]
    pub(crate) fn advance(&mut self, n: usize) {
        self.pos += n;
    }

    /// Move the cursor back to `pos`, a position it was at (never forward): what was read
    /// since is read again. Only raw matches and skips may lie between, which keep nothing.
    #[inline]
    pub(crate) fn rewind(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }

    /// Skip JSON whitespace and return the next byte, if any.
    #[inline]
    pub(crate) fn peek(&mut self) -> Option<u8> {
        let b = self.bytes;
        while let Some(&c) = b.get(self.pos) {
            // Above the space, no byte is whitespace: one compare for nearly every call
            // (compact JSON has none), before the four-way match.
            if c > b' ' || !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(c);
            }
            self.pos += 1;
        }
        None
    }

    /// Error at the current position.
    pub(crate) fn error<T>(&self, message: impl Into<Cow<'static, str>>) -> Syn<T> {
        err(self.pos, message)
    }

    /// Consume `b` (after whitespace) or fail with `message`.
    #[inline]
    pub(crate) fn expect(&mut self, b: u8, message: &'static str) -> Syn<()> {
        match self.peek() {
            Some(c) if c == b => {
                self.pos += 1;
                Ok(())
            }
            Some(_) => self.error(message),
            None => self.error(eof_message(b)),
        }
    }

    /// After a member or element: consume `,` (true) or the closing `close` (false).
    #[inline]
    pub(crate) fn comma_or_close(&mut self, close: u8) -> Syn<bool> {
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                Ok(true)
            }
            Some(c) if c == close => {
                self.pos += 1;
                Ok(false)
            }
            Some(_) if close == b']' => self.error("expected `,` or `]`"),
            Some(_) => self.error("expected `,` or `}`"),
            None => self.error(eof_message(close)),
        }
    }

    /// After an opening `[` or `{`: consume the closing byte if the container is empty.
    #[inline]
    pub(crate) fn empty(&mut self, close: u8) -> bool {
        if self.peek() == Some(close) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// At a string's opening quote: consume it.
    #[inline]
    pub(crate) fn open_quote(&mut self) -> Syn<()> {
        match self.peek() {
            Some(b'"') => {
                self.pos += 1;
                Ok(())
            }
            Some(_) => self.error("key must be a string"),
            None => self.error("EOF while parsing an object"),
        }
    }

    /// Inside a string, after [`Self::open_quote`]: the length of the stretch before the
    /// next `"`, `\` or control character.
    #[inline]
    pub(crate) fn string_stretch(&self) -> usize {
        plain_len(self.rest())
    }

    /// [`Self::string_stretch`] within the next `max` bytes (`max` ≥ 4), ended on a
    /// character boundary ([`char_start`]).
    #[inline]
    pub(crate) fn string_stretch_within(&self, max: usize) -> usize {
        let rest = self.rest();
        if rest.len() <= max {
            return plain_len(rest);
        }
        let n = plain_len(rest.get(..max).unwrap_or_default());
        char_start(self.bytes, self.pos + n, self.pos) - self.pos
    }

    /// Inside a string, at a byte that ended a stretch: `Ok(None)` at the closing quote
    /// (consumed), `Ok(Some(bytes))` at an escape, whose text starts after the backslash
    /// and has `bytes` bytes (consumed), or a syntax error (control character, bad escape,
    /// end of input).
    #[inline]
    pub(crate) fn escape(&mut self) -> Syn<Option<(&'a [u8], usize)>> {
        let b = self.rest();
        match b.first() {
            Some(b'"') => {
                self.pos += 1;
                Ok(None)
            }
            Some(b'\\') => {
                let esc = b.get(1..).unwrap_or(&[]);
                let used = match esc.first() {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => 1,
                    Some(b'u') => {
                        for k in 1..5 {
                            match esc.get(k) {
                                Some(&h) if hex_val(h).is_some() => {}
                                Some(_) => {
                                    return err(self.pos + 1 + k, "invalid escape");
                                }
                                None => return err(self.pos + 1 + k, "EOF while parsing a string"),
                            }
                        }
                        5
                    }
                    Some(_) => return err(self.pos + 1, "invalid escape"),
                    None => return err(self.pos + 1, "EOF while parsing a string"),
                };
                self.pos += 1 + used;
                Ok(Some((esc, used)))
            }
            Some(_) => {
                self.error("control character (\\u0000-\\u001F) found while parsing a string")
            }
            None => self.error("EOF while parsing a string"),
        }
    }

    /// Inside a string, after its opening quote: skip to after its closing quote.
    pub(crate) fn skip_string_rest(&mut self) -> Syn<()> {
        loop {
            let n = self.string_stretch();
            self.pos += n;
            if self.escape()?.is_none() {
                return Ok(());
            }
        }
    }

    /// Inside a string, at a one-letter escape (`\n`, `\"`, ...): consume it and return
    /// the byte it stands for; `None` (nothing consumed) at anything else. Inlined where
    /// [`Self::escape`], which also reads `\u` escapes and the closing quote and reports
    /// errors, is a call.
    #[inline(always)]
    pub(crate) fn one_letter_escape(&mut self) -> Option<u8> {
        let rest = self.rest();
        if rest.first() != Some(&b'\\') {
            return None;
        }
        let b = simple_escape(rest.get(1..)?)?;
        self.pos += 2;
        Some(b)
    }

    /// Inside a string: walk its plain text and one-letter escapes 32 bytes per step, over
    /// at most `limit` bytes from the cursor. One mask of a step's quotes, backslashes and
    /// control bytes ([`special_mask32`]) is computed, and its set bits are visited in
    /// turn: an escape clears its letter's bit (carried into the next step when the
    /// backslash is a step's last byte), so an escape costs no new scan. Chat text has an
    /// escape every ~64 bytes, and restarting the scan after each cost ~120 Wasm
    /// operations (docs/overhead.md).
    ///
    /// At each one-letter escape, `escape(plain, byte)` gets the byte range of the plain
    /// text since the previous escape (or the cursor) and the byte the escape stands for.
    /// The walk stops at the closing quote (consumed), at a byte it does not take (a `\u`
    /// escape, a control byte: the cursor is left on it), or before the first step that
    /// would pass `limit` or the text's end; a step that ends inside a multi-byte
    /// character stops before that character, so the cursor is always on a character
    /// boundary. Only whole steps are walked: what is left is the caller's.
    ///
    /// Each byte of the mask is read through the text, not the step, so that the
    /// caller's slice at each escape's backslash (its check for a character boundary)
    /// reads nothing new and folds away (~8 Wasm operations per escape).
    ///
    /// The walk stays within the validated stretch ([`Self::valid`]; the caller covers
    /// the bytes it asks for), and its ranges are offsets into that stretch's text.
    #[inline(always)]
    fn walk_plain(&mut self, limit: usize, mut escape: impl FnMut(Range<usize>, u8)) -> Walk {
        let (text, off) = (self.valid, self.valid_at);
        let bytes = text.as_bytes();
        let start = self.pos.wrapping_sub(off);
        let stop = bytes.len().min(start.saturating_add(limit));
        let mut escapes = 0usize;
        let mut from = start;
        let mut base = start;
        // 1 when the previous step ended with an escape's backslash: this step's first
        // byte is that escape's letter.
        let mut carry = 0u32;
        for chunk in bytes.get(start..stop).unwrap_or_default().chunks_exact(32) {
            let Some(chunk) = chunk.first_chunk::<32>() else {
                break;
            };
            let mut m = u64::from(special_mask32(chunk) & !carry);
            carry = 0;
            while m != 0 {
                let k = m.trailing_zeros() as usize;
                let p = base + k;
                let at = bytes.get(p);
                match at {
                    Some(b'"') => {
                        self.pos = off + p + 1;
                        return Walk {
                            closed: true,
                            escapes,
                            plain: from..p,
                        };
                    }
                    Some(b'\\') => {
                        // `simple_escape` without its slice: one table load.
                        let b = match bytes.get(p + 1) {
                            Some(&letter) => ESCAPED.get(usize::from(letter)).copied().unwrap_or(0),
                            None => 0,
                        };
                        if b == 0 {
                            break;
                        }
                        escape(from..p, b);
                        escapes += 1;
                        from = p + 2;
                        m &= u64::MAX << (k + 2);
                        carry = u32::from(k == 31);
                    }
                    _ => break,
                }
            }
            if m != 0 {
                // Stopped at a byte the walk does not take.
                let p = base + m.trailing_zeros() as usize;
                self.pos = off + p;
                return Walk {
                    closed: false,
                    escapes,
                    plain: from..p,
                };
            }
            base += 32;
        }
        // A step can end inside a multi-byte character: stop before it (the bytes backed
        // over are plain text), since the caller's next piece must start on a boundary.
        let mut end = base + carry as usize;
        while end > start && !text.is_char_boundary(end) {
            end -= 1;
        }
        self.pos = off + end;
        Walk {
            closed: false,
            escapes,
            plain: from..end,
        }
    }

    /// [`Self::walk_plain`], appending what it walked, decoded, to `out`: the plain text and
    /// each one-letter escape's byte. The bytes within `limit` are validated as UTF-8
    /// first where the validated stretch does not hold them ([`Self::cover`], one pass
    /// for them all); where they are not UTF-8, the walk stops before the bad byte, and
    /// the caller's reader of the rest reports it. A walk that reaches the stretch's end
    /// goes on in the next one, so a stretch's end costs no piece-by-piece reading. The
    /// returned range is absolute.
    #[inline(always)]
    pub(crate) fn decode_plain_into(&mut self, limit: usize, out: &mut String) -> Walk {
        let stop = self.bytes.len().min(self.pos.saturating_add(limit));
        let mut escapes = 0;
        loop {
            // Not in the stretch, or it ends short of the limit with no whole step left:
            // one validation from here to the limit.
            let held = self.pos.wrapping_sub(self.valid_at);
            let len = self.valid.len();
            if held >= len || (self.valid_at + len < stop && held + 32 > len) {
                self.cover(self.pos, stop);
            }
            let (text, at) = (self.valid, self.valid_at);
            let from = self.pos;
            let walk = self.walk_plain(stop - from.min(stop), |plain, b| {
                // Two escapes in a row (`\n\n`) leave nothing between them to copy; the
                // test and the `if let` also let the slice's checks at its start and the
                // push's empty-string case fold (~29 Wasm operations per escape).
                if plain.start < plain.end {
                    if let Some(piece) = text.get(plain) {
                        out.push_str(piece);
                    }
                }
                out.push(char::from(b));
            });
            if let Some(piece) = text.get(walk.plain.clone()) {
                out.push_str(piece);
            }
            escapes += walk.escapes;
            let end = at + text.len();
            // On past the stretch's end when it, not the limit or a byte the walk does not
            // take, stopped the walk (and the walk moved). A backslash there may be a
            // one-letter escape whose letter lay past the stretch: the next walk takes it
            // (or stops on it at once).
            let on = !walk.closed
                && end < stop
                && self.pos > from
                && self.pos + 32 > end
                && self.rest().first().is_some_and(|&c| c != b'"' && c >= 0x20);
            if !on {
                return Walk {
                    closed: walk.closed,
                    escapes,
                    plain: at + walk.plain.start..at + walk.plain.end,
                };
            }
        }
    }

    /// Inside a string, past what the analysis reads (the prefix rendering and the
    /// sampling windows): move at most `room` bytes on without decoding anything, and
    /// return the raw bytes passed and whether the closing quote was reached (and
    /// consumed). Only the string's end is looked for: each `"` found 64 bytes per step,
    /// and an odd run of backslashes before it makes it an escaped quote. What is passed
    /// is not checked: a control character, a bad escape, a lone surrogate or bytes that
    /// are not UTF-8 go unnoticed, where decoding them cost ~2.5 Wasm operations per byte
    /// and validating them ~0.7 (docs/overhead.md).
    ///
    /// Without a closing quote within `room` bytes (or before the text's end), the cursor
    /// lands at `room` bytes, backed onto a place where the string can be decoded on from:
    /// a character boundary, not an escape's letter or hex digit, and not between the two
    /// `\u` escapes of a surrogate pair (at most 11 bytes back). So the string's rest
    /// decodes as it would have whole, and the caller's decoding readers report any error
    /// there at the same byte.
    #[inline]
    pub(crate) fn skip_raw(&mut self, room: usize) -> (usize, bool) {
        let bytes = self.bytes;
        let start = self.pos;
        let stop = bytes.len().min(start.saturating_add(room));
        // Counted back to the cursor, before which escapes are whole.
        let run_before = |at: usize| backslashes_before(bytes, at, start);
        // 64 bytes per step, each quote of a step visited ([`quote_mask64`]): an escaped
        // quote (~1 in 330 bytes of chat text) then costs no new search, where a
        // `memchr` restarted after it cost ~120 Wasm operations. The last bytes (under
        // 64) go to `memchr`.
        let mut from = start;
        let mut steps = bytes.get(start..stop).unwrap_or_default().chunks_exact(64);
        for step in steps.by_ref() {
            let Some(step) = step.first_chunk::<64>() else {
                break;
            };
            let mut m = quote_mask64(step);
            while m != 0 {
                let quote = from + m.trailing_zeros() as usize;
                // Nearly every quote there is escaped by one backslash after a letter, or
                // closes the string after a letter: two byte reads, not a run count.
                let escaped = match quote.checked_sub(2).and_then(|i| bytes.get(i..quote)) {
                    Some(&[b, b'\\']) if b != b'\\' && quote >= start + 2 => true,
                    Some(&[_, b]) if b != b'\\' => false,
                    _ => run_before(quote) % 2 == 1,
                };
                if !escaped {
                    self.pos = quote + 1;
                    return (quote - start, true);
                }
                m &= m - 1;
            }
            from += 64;
        }
        while let Some(k) = bytes.get(from..stop).and_then(|s| memchr::memchr(b'"', s)) {
            let quote = from + k;
            if run_before(quote) % 2 == 0 {
                self.pos = quote + 1;
                return (quote - start, true);
            }
            from = quote + 1;
        }
        let mut at = char_start(bytes, stop, start);
        // On an escape's letter: back to its backslash.
        if run_before(at) % 2 == 1 {
            at -= 1;
        }
        // Inside a `\u` escape's four hex digits: back to its backslash.
        let escape_at = |i: usize| {
            bytes.get(i) == Some(&b'\\')
                && bytes.get(i + 1) == Some(&b'u')
                && run_before(i) % 2 == 0
        };
        if let Some(back) = (2..=5).find(|&k| {
            at >= start + k
                && escape_at(at - k)
                && bytes
                    .get(at - k + 2..at)
                    .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
        }) {
            at -= back;
        }
        // Between a surrogate pair's two escapes: back before the first, so that the
        // second is not read alone (a lone surrogate is an invalid string).
        let surrogate = |i: usize, first: &[u8]| {
            escape_at(i)
                && bytes
                    .get(i + 2)
                    .is_some_and(|b| b.eq_ignore_ascii_case(&b'd'))
                && bytes
                    .get(i + 3)
                    .is_some_and(|b| first.contains(&b.to_ascii_lowercase()))
        };
        if at >= start + 6 && surrogate(at, b"cdef") && surrogate(at - 6, b"89ab") {
            at -= 6;
        }
        self.pos = at;
        (at - start, false)
    }

    /// At a string: skip it and return its token (quotes included).
    pub(crate) fn string_token(&mut self) -> Syn<&'a str> {
        let start = self.pos;
        self.open_quote()?;
        self.skip_string_rest()?;
        self.since(start)
    }

    /// At a string (after whitespace): when it has no escape, consume it and return its
    /// text (between the quotes, borrowed); otherwise consume nothing and return `None`
    /// (the general readers then take it, and report any error at the same byte). Object
    /// keys and a message's role are such strings: one SIMD scan reads them, with no token
    /// to decode afterwards. Text that is not UTF-8 is left to the general readers too.
    #[inline(always)]
    pub(crate) fn plain_string(&mut self) -> Option<&'a str> {
        if self.peek() != Some(b'"') {
            return None;
        }
        let start = self.pos + 1;
        let n = plain_len(self.bytes.get(start..).unwrap_or_default());
        if self.bytes.get(start + n) != Some(&b'"') {
            return None;
        }
        let s = self.text(start, start + n).ok()?;
        self.pos = start + n + 1;
        Some(s)
    }

    /// Which pattern of `table` the bytes at the cursor are, exactly, with no whitespace
    /// skipped: consumes the match and returns its meaning, or consumes nothing and returns
    /// `None` (also within 16 bytes of the end, where no 16-byte load fits). Patterns are
    /// raw JSON in its compact form, such as the key `"role":` or the value `"user"`:
    /// one 16-byte load and a masked compare per pattern, where reading the key as a
    /// string and comparing its name cost ~220 Wasm operations (`key_name` and the
    /// string `match`, wasi-libc's byte-wise `memcmp`), a chat message's two keys ~450 of
    /// its ~1.65 k (docs/overhead.md). Any other form (whitespace, escapes, another key)
    /// is the general readers' ([`Self::key_name`], [`Self::plain_string`]), which decode
    /// it to the same name.
    #[inline]
    pub(crate) fn raw_match<T: Copy>(&mut self, table: &[(RawPattern, T)]) -> Option<T> {
        let w = u128::from_le_bytes(*self.rest().first_chunk::<16>()?);
        let (p, meaning) = table.iter().find(|(p, _)| w & p.mask == p.bits)?;
        self.pos += p.len;
        Some(*meaning)
    }

    /// At an object key: read it and the `:` after it, and return the key decoded
    /// (`Err(BadString)` for a lone surrogate escape, as [`decode_str`]). Syntax errors
    /// are those of [`Self::key`].
    #[inline]
    pub(crate) fn key_name(&mut self) -> Syn<Result<Cow<'a, str>, BadString>> {
        if let Some(name) = self.plain_string() {
            self.expect(b':', "expected `:`")?;
            return Ok(Ok(Cow::Borrowed(name)));
        }
        let k = self.key()?;
        Ok(decode_str(k))
    }

    /// At an object key (after `{` or `,`): read it and the `:` after it. The key is the
    /// raw token (quotes included), for skipping; [`Self::key_name`] reads a key's name.
    pub(crate) fn key(&mut self) -> Syn<&'a str> {
        self.peek();
        let k = self.string_token()?;
        self.expect(b':', "expected `:`")?;
        Ok(k)
    }

    /// [`Self::key`] without its text: inside a value [`Self::skip_value`] validates as
    /// text in one pass.
    fn skip_key(&mut self) -> Syn<()> {
        self.peek();
        self.open_quote()?;
        self.skip_string_rest()?;
        self.expect(b':', "expected `:`")
    }

    fn literal(&mut self, word: &'static [u8]) -> Syn<()> {
        for &w in word {
            match self.bytes.get(self.pos) {
                Some(&c) if c == w => self.pos += 1,
                Some(_) => return self.error("expected ident"),
                None => return self.error("EOF while parsing a value"),
            }
        }
        Ok(())
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Syn<()> {
        let b = self.bytes;
        if b.get(self.pos) == Some(&b'-') {
            self.pos += 1;
        }
        match b.get(self.pos) {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = b.get(self.pos) {
                    return self.error("invalid number");
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return self.error("invalid number"),
        }
        if b.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return self.error("invalid number");
            }
        }
        if let Some(b'e' | b'E') = b.get(self.pos) {
            self.pos += 1;
            if let Some(b'+' | b'-') = b.get(self.pos) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return self.error("invalid number");
            }
        }
        Ok(())
    }

    /// At a value's `null`: consume it and return true; else leave the position unchanged.
    pub(crate) fn null(&mut self) -> Syn<bool> {
        if self.peek() == Some(b'n') {
            self.literal(b"null")?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Validate and skip one value (after whitespace); returns its text, validated as
    /// UTF-8 in one pass at its end ([`Self::text`]).
    pub(crate) fn skip_value(&mut self) -> Syn<&'a str> {
        self.peek();
        let start = self.pos;
        let base = self.stack.len();
        loop {
            // A value.
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    self.skip_string_rest()?;
                }
                Some(b'n') => self.literal(b"null")?,
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'-' | b'0'..=b'9') => self.number()?,
                Some(open @ (b'[' | b'{')) => {
                    self.pos += 1;
                    let close = if open == b'[' { b']' } else { b'}' };
                    if !self.empty(close) {
                        self.stack.push(open);
                        if open == b'{' {
                            self.skip_key()?;
                        }
                        continue;
                    }
                }
                Some(_) => return self.error("expected value"),
                None => return self.error("EOF while parsing a value"),
            }
            // After a value: close what ends here, up to the next value.
            loop {
                if self.stack.len() <= base {
                    return self.since(start);
                }
                let open = self.stack.last().copied().unwrap_or(b'[');
                let close = if open == b'[' { b']' } else { b'}' };
                if self.comma_or_close(close)? {
                    if open == b'{' {
                        self.skip_key()?;
                    }
                    break;
                }
                self.stack.pop();
            }
        }
    }

    /// After the top-level value: only whitespace may follow.
    pub(crate) fn end(&mut self) -> Syn<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => self.error("trailing characters"),
        }
    }
}

fn eof_message(b: u8) -> &'static str {
    match b {
        b']' => "EOF while parsing a list",
        b'}' | b':' => "EOF while parsing an object",
        _ => "EOF while parsing a value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_match_takes_only_the_exact_bytes() {
        let pats = [
            (RawPattern::key("role"), 0),
            (RawPattern::key("content"), 1),
        ];
        let at = |text: &str| {
            let mut sc = Scanner::new(text);
            let m = sc.raw_match(&pats);
            (m, sc.pos())
        };
        assert_eq!(at(r#""content":"hello there, world"}"#), (Some(1), 10));
        assert_eq!(at(r#""role":"assistant","content":""}"#), (Some(0), 7));
        // Another key with the same start, whitespace, an escape: not matched, nothing
        // consumed (the general readers take them).
        assert_eq!(at(r#""roles":"assistant","content":""}"#), (None, 0));
        assert_eq!(at(r#""role" :"assistant","content":""}"#), (None, 0));
        assert_eq!(at(r#" "role":"assistant","content":""}"#), (None, 0));
        assert_eq!(at(r#""r\u006fle":"assistant","content":"x"}"#), (None, 0));
        // Within 16 bytes of the end no load fits.
        assert_eq!(at(r#""role":"user"}"#), (None, 0));
        // A pattern longer than 16 bytes never matches.
        let long = [(RawPattern::new(&[b"0123456789", b"abcdefg"]), ())];
        let mut sc = Scanner::new("0123456789abcdefghijklmnopqrstuvwxyz");
        assert_eq!(sc.raw_match(&long), None);
    }

    #[test]
    fn simple_escape_maps_exactly_the_eight_letters() {
        for c in 0..=u8::MAX {
            let want = match c {
                b'"' | b'\\' | b'/' => Some(c),
                b'b' => Some(0x08),
                b'f' => Some(0x0C),
                b'n' => Some(b'\n'),
                b'r' => Some(b'\r'),
                b't' => Some(b'\t'),
                _ => None,
            };
            assert_eq!(simple_escape(&[c, b'x']), want, "{c:#04x}");
        }
        assert_eq!(simple_escape(&[]), None);
    }

    #[test]
    fn plain_len_finds_the_first_special_byte() {
        for s in [
            "",
            "abc",
            "abcdefgh\"",
            "abcdefghijklmno\\x",
            "é东京\u{1F600}abcdefgh\n",
            "\"",
            "a\u{1f}",
            "0123456789abcdef0123456789",
        ] {
            let want = s
                .bytes()
                .position(|c| c == b'"' || c == b'\\' || c < 0x20)
                .unwrap_or(s.len());
            assert_eq!(plain_len(s.as_bytes()), want, "{s:?}");
        }
        // Every byte value at every position: inside and after the first 8-, 16- and
        // 32-byte steps, in a last 16-byte block after one or two 32-byte steps (56, 88),
        // and in the tails after them (the SWAR and the Wasm SIMD scans, whichever this
        // build runs, and the SWAR scan on its own).
        for len in [12, 16, 23, 40, 56, 63, 88] {
            for c in 0..=255u8 {
                for at in 0..len {
                    let mut b = vec![b'x'; len];
                    b[at] = c;
                    let special = c == b'"' || c == b'\\' || c < 0x20;
                    let want = if special { at } else { len };
                    assert_eq!(plain_len(&b), want, "{c} at {at} of {len}");
                    assert_eq!(plain_len_swar(&b), want, "{c} at {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn special_mask32_flags_every_special_byte() {
        // Every byte value at every position, alone and next to a second special byte.
        for c in 0..=255u8 {
            for at in 0..32 {
                let mut b = [b'x'; 32];
                b[at] = c;
                let special = c == b'"' || c == b'\\' || c < 0x20;
                assert_eq!(special_mask32(&b), u32::from(special) << at, "{c} at {at}");
                b[31 - at] = b'\\';
                let both = (u32::from(special) << at) | (1 << (31 - at));
                let want = if at == 31 - at { 1 << at } else { both };
                assert_eq!(special_mask32(&b), want, "{c} at {at}, `\\` at {}", 31 - at);
            }
        }
    }

    /// `quote_mask64` sets exactly the bits of the quotes: every byte value at every
    /// position, alone and beside a quote.
    #[test]
    fn quote_mask64_flags_exactly_the_quotes() {
        for at in 0..64 {
            for c in 0..=255u8 {
                let mut b = [b'x'; 64];
                b[at] = c;
                assert_eq!(quote_mask64(&b), u64::from(c == b'"') << at, "{c} at {at}");
                b[63 - at] = b'"';
                let want = (u64::from(c == b'"') << at) | (1 << (63 - at));
                assert_eq!(quote_mask64(&b), want, "{c} at {at}, `\"` at {}", 63 - at);
            }
        }
    }

    /// The 16-byte-lane bodies (SSE2 natively, Wasm SIMD under `make test-wasm`) return
    /// exactly what the portable bodies return. Off those targets both sides are portable.
    #[cfg(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))]
    mod lanes_match_portable {
        use super::*;

        /// One byte, mostly of the kinds the scans tell apart: `"`, `\\`, controls, 0x7F,
        /// non-ASCII, letters, digits, spaces, newlines; with `plain`, letters nearly always
        /// (so whole 16-, 32- and 64-byte blocks without a special byte are common too).
        fn scan_byte(plain: bool) -> impl proptest::strategy::Strategy<Value = u8> {
            use proptest::prelude::*;
            let letters = if plain { 400 } else { 8 };
            prop_oneof![
                letters => prop_oneof![b'a'..=b'z', b'A'..=b'Z'],
                2 => b'0'..=b'9',
                2 => Just(b' '),
                1 => Just(b'\n'),
                1 => Just(b'"'),
                1 => Just(b'\\'),
                1 => 0u8..0x20,
                1 => Just(0x7F),
                1 => 0x80u8..=0xFF,
            ]
        }

        fn scan_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
            use proptest::prelude::*;
            prop_oneof![
                proptest::collection::vec(scan_byte(false), 0..300),
                proptest::collection::vec(scan_byte(true), 0..300),
            ]
        }

        proptest::proptest! {
            #[test]
            fn plain_len_simd_is_plain_len_swar(b in scan_bytes()) {
                for start in 0..b.len().min(40) {
                    let tail = &b[start..];
                    proptest::prop_assert_eq!(plain_len_simd(tail), plain_len_swar(tail), "from {}", start);
                }
            }

            #[test]
            fn special_mask32_is_the_byte_loop(b in scan_bytes()) {
                for (at, w) in b.windows(32).enumerate() {
                    let chunk: &[u8; 32] = w.try_into().unwrap();
                    proptest::prop_assert_eq!(special_mask32(chunk), special_mask32_bytes(chunk), "at {}", at);
                }
            }

            #[test]
            fn quote_mask64_is_the_swar_mask(b in scan_bytes()) {
                for (at, w) in b.windows(64).enumerate() {
                    let chunk: &[u8; 64] = w.try_into().unwrap();
                    proptest::prop_assert_eq!(quote_mask64(chunk), quote_mask64_swar(chunk), "at {}", at);
                }
            }
        }
    }

    /// `walk_plain` as a byte loop: whole 32-byte steps from `start` while they end
    /// within `limit` bytes and the text; in a step, plain bytes copied, one-letter escapes
    /// decoded (the letter may be the next step's first byte, or past the limit), and a
    /// stop at the closing quote (consumed) or any other special byte; after the last
    /// step, back to a character boundary. Returns the walk, the cursor and the decoded
    /// bytes.
    fn walk_by_bytes(text: &str, start: usize, limit: usize) -> (Walk, usize, Vec<u8>) {
        let b = text.as_bytes();
        let stop = b.len().min(start.saturating_add(limit));
        let (mut i, mut from, mut escapes, mut out) = (start, start, 0, Vec::new());
        let mut step_end = start + 32;
        while step_end <= stop {
            while i < step_end {
                match b[i] {
                    b'"' => {
                        let walk = Walk {
                            closed: true,
                            escapes,
                            plain: from..i,
                        };
                        return (walk, i + 1, out);
                    }
                    b'\\' => match b.get(i + 1).and_then(|&l| simple_escape(&[l])) {
                        Some(c) => {
                            out.push(c);
                            escapes += 1;
                            i += 2;
                            from = i;
                        }
                        None => {
                            let walk = Walk {
                                closed: false,
                                escapes,
                                plain: from..i,
                            };
                            return (walk, i, out);
                        }
                    },
                    c if c < 0x20 => {
                        let walk = Walk {
                            closed: false,
                            escapes,
                            plain: from..i,
                        };
                        return (walk, i, out);
                    }
                    c => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            step_end += 32;
        }
        while i > start && !text.is_char_boundary(i) {
            i -= 1;
            out.pop();
        }
        let walk = Walk {
            closed: false,
            escapes,
            plain: from..i,
        };
        (walk, i, out)
    }

    /// `walk_plain` (through `decode_plain_into`) against the byte loop for every special
    /// byte or escape at every offset across the steps at 32 and 64, after one-, two- and
    /// three-byte filler, under limits at each step's end and around the special: the same
    /// stop, escapes, plain range and decoded text, never more than the limit decoded,
    /// and the cursor on a character boundary. Also with the text cut right after the
    /// special's backslash. `skip_raw` on the same texts and limits: [`skip_raw_holds`].
    #[test]
    fn walk_plain_is_a_byte_loop_at_every_offset_and_limit() {
        let specials = [
            "\\n",
            "\\\"",
            "\\\\",
            "\\/",
            "\\t",
            "\\n\\n",
            "\\\\\\\"",
            "\\u00e9",
            "\\ud83d\\ude00",
            "\\x",
            "\"",
            "\u{1}",
            "\u{1f}",
            "\u{7f}",
            "\u{80}",
            "é",
            "😀",
        ];
        for filler in ["ab", "é", "东"] {
            for special in specials {
                for k in 0..72 {
                    let mut before = filler.repeat(k / filler.len() + 1);
                    while before.len() > k {
                        before.pop();
                    }
                    let full = format!(" \"{before}{special}{}\" tail", filler.repeat(24));
                    let mut texts = vec![full.clone()];
                    if let Some(s) = special.find('\\') {
                        texts.push(full[..2 + before.len() + s + 1].to_string());
                    }
                    for text in &texts {
                        // The walk depends on the whole steps within the limit; the pass
                        // after it also on the limit's place against the special.
                        let steps = [0, 1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129];
                        let around = before.len().saturating_sub(1)..before.len() + 5;
                        for limit in steps.into_iter().chain(around).chain([usize::MAX]) {
                            let (want, want_pos, want_out) = walk_by_bytes(text, 2, limit);
                            let mut sc = Scanner::new(text);
                            sc.advance(2);
                            let mut out = String::from("x");
                            let walk = sc.decode_plain_into(limit, &mut out);
                            let at = format!("{text:?} limit {limit}");
                            assert_eq!((&walk, sc.pos()), (&want, want_pos), "{at}");
                            assert_eq!(&out.as_bytes()[1..], &want_out[..], "{at}");
                            assert_eq!(walk.decoded_len(2), want_out.len(), "{at}");
                            assert!(want_out.len() <= limit, "{at}");
                            assert!(text.is_char_boundary(sc.pos()), "{at}");

                            skip_raw_holds(text, 2, limit);
                        }
                    }
                }
            }
        }
    }

    /// Where the string that starts at `start` (after its opening quote) ends: its first
    /// `"` after an even run of backslashes, by a byte loop.
    fn closing_quote(text: &str, start: usize) -> Option<usize> {
        let b = text.as_bytes();
        let mut run = 0;
        for (i, &c) in b.iter().enumerate().skip(start) {
            match c {
                b'"' if run % 2 == 0 => return Some(i),
                b'\\' => run += 1,
                _ => run = 0,
            }
        }
        None
    }

    /// `skip_raw(room)` from `start` (just after a string's opening quote): it passes at
    /// most `room` bytes; when the string's closing quote is within them it stops right
    /// after it and reports the string's raw length; otherwise it stops on a character
    /// boundary at most 11 bytes short of `room` (or of the text's end), and when the
    /// string is valid, its two parts either side of the cursor decode, each as a string
    /// of its own, to the whole string's text.
    fn skip_raw_holds(text: &str, start: usize, room: usize) {
        let at = format!("{text:?} from {start}, room {room}");
        let mut sc = Scanner::new(text);
        sc.advance(start);
        let (passed, closed) = sc.skip_raw(room);
        assert!(passed <= room, "{at}: passed {passed}");
        let close = closing_quote(text, start);
        if let Some(q) = close.filter(|&q| q - start < room) {
            assert_eq!((passed, closed, sc.pos()), (q - start, true, q + 1), "{at}");
            return;
        }
        assert!(!closed, "{at}");
        assert_eq!(sc.pos(), start + passed, "{at}");
        assert!(text.is_char_boundary(sc.pos()), "{at}: at {}", sc.pos());
        let end = text.len().min(start.saturating_add(room));
        assert!(passed + 11 >= end - start, "{at}: passed {passed}");
        let Some(q) = close else { return };
        let token = |r: std::ops::Range<usize>| format!("\"{}\"", &text[r]);
        let (whole, head, tail) = (token(start..q), token(start..sc.pos()), token(sc.pos()..q));
        if let Ok(whole) = decode_str(&whole) {
            match (decode_str(&head), decode_str(&tail)) {
                (Ok(h), Ok(t)) => assert_eq!(format!("{h}{t}"), whole, "{at}"),
                other => panic!("{at}: split at {} into {other:?}", sc.pos()),
            }
        }
    }

    #[test]
    fn skip_raw_stops_on_a_character_boundary() {
        // 1 + 2k bytes: the room ends inside an `é` every other byte.
        let text = format!("\"a{}\"", "é".repeat(100));
        for room in 0..80 {
            skip_raw_holds(&text, 1, room);
        }
        let mut sc = Scanner::new(&text);
        sc.advance(1);
        assert_eq!(sc.skip_raw(34), (33, false));
    }

    #[test]
    fn skip_raw_never_lands_inside_an_escape() {
        // Every room from before to past each escape's end, with the escape at each
        // offset around the 64-byte step and the last bytes' `memchr`.
        let escapes = [
            "\\n",
            "\\\"",
            "\\\\",
            "\\\\\\\"",
            "\\\\\\\\\"",
            "\\u00e9",
            "\\u4E1C",
            "\\ud83d\\ude00",
            "\\uD83D\\uDE00",
            "\\ud800",
            "\\udc00",
        ];
        for escape in escapes {
            for k in 0..140 {
                let text = format!("\"{}{escape}{}\" tail", "a".repeat(k), "b".repeat(70));
                for room in k.saturating_sub(2)..k + 14 {
                    skip_raw_holds(&text, 1, room);
                }
                for room in [63, 64, 65, 127, 128, 129, usize::MAX] {
                    skip_raw_holds(&text, 1, room);
                }
            }
        }
        // A surrogate pair split by the room: back before its first escape.
        let text = "\"ab\\ud83d\\ude00cd\"";
        let mut sc = Scanner::new(text);
        sc.advance(1);
        assert_eq!(sc.skip_raw(9), (2, false));
        // An escaped quote is passed; the closing quote closes.
        let text = "\"say \\\"hi\\\" now\\\\\" tail";
        let mut sc = Scanner::new(text);
        sc.advance(1);
        assert_eq!(sc.skip_raw(usize::MAX), (16, true));
        assert_eq!(&text[sc.pos()..], " tail");
    }

    proptest::proptest! {
        /// `skip_raw` on strings of plain text (multi-byte characters across the 64-byte
        /// steps), one-letter escapes, runs of backslashes before quotes, `\u` escapes and
        /// surrogate pairs, from any offset and with any room: [`skip_raw_holds`].
        #[test]
        fn skip_raw_splits_where_the_string_decodes_on(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    "[a-z é东]{0,40}",
                    proptest::strategy::Just("\\n".to_string()),
                    proptest::strategy::Just("\\\"".to_string()),
                    proptest::strategy::Just("\\\\".to_string()),
                    proptest::strategy::Just("\\\\\\\"".to_string()),
                    proptest::strategy::Just("\\u00e9".to_string()),
                    proptest::strategy::Just("\\ud83d\\ude00".to_string()),
                    proptest::strategy::Just("\\uDBFF\\uDFFF".to_string()),
                ],
                0..60,
            ),
            room in 0usize..900,
            lead in 0usize..40,
        ) {
            let inner: String = parts.concat();
            let text = format!("{}\"{inner}\" tail", " ".repeat(lead));
            skip_raw_holds(&text, lead + 1, room);
        }
    }

    /// A walk over bytes validated stretch by stretch (`from_bytes` with the first
    /// stretch ending anywhere) goes on across each stretch's end: it decodes exactly the
    /// text it passed, and it stops short of the closing quote only where a whole step no
    /// longer fits before the text's end, as a walk over one validated text does.
    #[test]
    fn decode_plain_into_goes_on_across_validated_stretches() {
        let inner = "ab é 东京 \\n x".repeat(12);
        let text = format!(" \"{inner}\" tail");
        let quote = text.rfind('"').unwrap();
        let want = inner.replace("\\n", "\n");
        for first in 0..text.len() + 2 {
            let mut sc = Scanner::from_bytes(text.as_bytes(), first);
            sc.advance(2);
            let mut out = String::new();
            let walk = sc.decode_plain_into(usize::MAX, &mut out);
            let end = sc.pos() - usize::from(walk.closed);
            let passed = text[2..end].replace("\\n", "\n");
            assert_eq!(out, passed, "first {first}");
            assert!(
                walk.closed || quote - sc.pos() < 36,
                "first {first}: {}",
                sc.pos()
            );
            if walk.closed {
                assert_eq!(out, want, "first {first}");
            }
        }
    }

    /// Bytes that are not UTF-8 are an error only where they are read as text, at the bad
    /// byte: not before it, and not where `skip_raw` passes them.
    #[test]
    fn text_is_validated_where_it_is_read() {
        let mut bytes = b"\"abc\xff\xfedef\" \"gh\"".to_vec();
        for first in [0, 3, 4, 20] {
            let mut sc = Scanner::from_bytes(&bytes, first);
            assert_eq!(sc.text(1, 4), Ok("abc"), "first {first}");
            assert_eq!(sc.text(0, 9).map_err(|e| e.pos), Err(4), "first {first}");
            assert_eq!(sc.text(12, 14), Ok("gh"), "first {first}");
            sc.advance(1);
            assert_eq!(sc.skip_raw(usize::MAX), (8, true), "first {first}");
            assert_eq!(sc.skip_value(), Ok("\"gh\""), "first {first}");
            let mut sc = Scanner::from_bytes(&bytes, first);
            assert_eq!(sc.skip_value().map_err(|e| e.pos), Err(4), "first {first}");
        }
        // A stray continuation byte with no character start within 3 bytes: the stretch
        // within a limit is not moved back past it.
        bytes = b"\"a\x80\x80\x80\x80\x80b\"".to_vec();
        let sc = Scanner::from_bytes(&bytes, 0);
        assert_eq!(char_start(&bytes, 6, 1), 6);
        assert_eq!(char_start("a\u{1F600}".as_bytes(), 4, 0), 1);
        assert_eq!(sc.pos(), 0);
    }

    /// `key_name` as the general path reads a key: `key`, then `decode_str`.
    fn key_then_decode(text: &str) -> (Syn<Result<String, BadString>>, usize) {
        let mut sc = Scanner::new(text);
        let r = sc.key().map(|k| decode_str(k).map(|c| c.into_owned()));
        (r, sc.pos())
    }

    fn key_name_of(text: &str) -> (Syn<Result<String, BadString>>, usize) {
        let mut sc = Scanner::new(text);
        let r = sc
            .key_name()
            .map(|k| k.map(|c: Cow<'_, str>| c.into_owned()));
        (r, sc.pos())
    }

    /// A key's text, what reading it gives, and the position after it when it was read.
    type KeyCase = (&'static str, Syn<Result<&'static str, BadString>>, usize);

    #[test]
    fn key_name_reads_keys_as_key_and_decode_str_do() {
        let cases: [KeyCase; 12] = [
            ("\"role\":\"user\"", Ok(Ok("role")), 7),
            ("  \"content\" :null", Ok(Ok("content")), 13),
            ("\"\":1", Ok(Ok("")), 3),
            ("\"r\\u006fle\":1", Ok(Ok("role")), 12),
            ("\"a\\\"b\":1", Ok(Ok("a\"b")), 7),
            ("\"caf\u{e9}\":1", Ok(Ok("caf\u{e9}")), 8),
            ("\"\\ud800\":1", Ok(Err(BadString)), 9),
            (
                "\"role\"}",
                Err(err::<()>(6, "expected `:`").unwrap_err()),
                6,
            ),
            (
                "\"role\"",
                Err(err::<()>(6, "EOF while parsing an object").unwrap_err()),
                6,
            ),
            (
                "\"ro\u{1}le\":1",
                Err(err::<()>(
                    3,
                    "control character (\\u0000-\\u001F) found while parsing a string",
                )
                .unwrap_err()),
                3,
            ),
            (
                "1:2",
                Err(err::<()>(0, "key must be a string").unwrap_err()),
                0,
            ),
            (
                "\"rol",
                Err(err::<()>(4, "EOF while parsing a string").unwrap_err()),
                4,
            ),
        ];
        for (text, want, pos) in cases {
            let want = want.map(|r| r.map(str::to_owned));
            let (got, at) = key_name_of(text);
            assert_eq!(got, want, "{text:?}");
            if got.is_ok() {
                assert_eq!(at, pos, "{text:?}");
            }
            assert_eq!(key_then_decode(text).0, want, "{text:?}: the general path");
        }
    }

    proptest::proptest! {
        /// `key_name` (one scan for a key without escapes) gives what `key` and
        /// `decode_str` give, on keys with and without escapes, whitespace, control
        /// characters and truncations: the same name or error, and the same position
        /// after a key it read.
        #[test]
        fn key_name_matches_key_then_decode_str(
            lead in "[ \t\n]{0,2}",
            name in "([a-z_é东]|\\\\n|\\\\\"|\\\\u00e9|\\\\ud800|\u{1}){0,12}",
            gap in "[ \n]{0,2}",
            after in proptest::prop_oneof![
                proptest::strategy::Just(":1"),
                proptest::strategy::Just("}"),
                proptest::strategy::Just(""),
            ],
            cut in proptest::option::of(0usize..40),
        ) {
            let mut text = format!("{lead}\"{name}\"{gap}{after}");
            if let Some(c) = cut {
                let mut c = c.min(text.len());
                while !text.is_char_boundary(c) {
                    c -= 1;
                }
                text.truncate(c);
            }
            let (got, at) = key_name_of(&text);
            let (want, want_at) = key_then_decode(&text);
            proptest::prop_assert_eq!(&got, &want, "{:?}", text);
            if got.is_ok() {
                proptest::prop_assert_eq!(at, want_at, "{:?}", text);
            }
        }
    }

    #[test]
    fn skip_value_accepts_json_and_rejects_the_rest() {
        for ok in [
            "0",
            "-0",
            "1.5e-3",
            "[]",
            "{}",
            "[1,[2,{}],{\"a\":[null,true,false]}]",
            "\"a\\u00e9\\ud800\"",
            " [ 1 , 2 ] ",
        ] {
            let mut s = Scanner::new(ok);
            assert_eq!(
                s.skip_value().map(|_| ()).and_then(|_| s.end()),
                Ok(()),
                "{ok}"
            );
        }
        for bad in [
            "",
            "01",
            "1.",
            "1e",
            "-",
            "[1,]",
            "{,}",
            "{\"a\"}",
            "{\"a\":1,}",
            "[1 2]",
            "\"a\\x\"",
            "\"a\\u12\"",
            "\"a\u{1}\"",
            "nul",
            "[",
            "{\"a\":",
            "\"abc",
        ] {
            let mut s = Scanner::new(bad);
            assert!(s.skip_value().and_then(|_| s.end()).is_err(), "{bad}");
        }
        let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        assert_eq!(Scanner::new(&deep).skip_value().map(str::len), Ok(400_000));
    }
}
