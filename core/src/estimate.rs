//! Token estimation without vocabulary files.
//!
//! The filter runs inside Envoy's wasm VM, where shipping a 100k-entry BPE vocabulary per
//! worker is too heavy. Instead, [`Estimator::estimate_text`] scans the text once (past its
//! first 2 KiB, a 1-in-16 sample of it: [`Tally`]) and counts character classes, each
//! with a per-class token cost calibrated against OpenAI's `cl100k_base` BPE (via
//! `tiktoken-rs`) on the ShareGPT prompts in `../shared/data/prompts/` (see
//! `core/tests/estimator_accuracy.rs` and the README table):
//!
//! | class | cost | why |
//! |---|---|---|
//! | ASCII letter run of length L | 1 token for the first [`WORD_CHARS_PER_TOKEN`]... see [`CharClassCosts`] | BPE merges common English words into one token; long words split every ~4-6 letters |
//! | digit run of length L | ⌈L/3⌉ | cl100k/o200k split numbers into groups of at most 3 digits |
//! | ASCII punctuation run | per char, with a discount for repeats | runs such as `...` or `**` often merge |
//! | whitespace | a space before a word is free; newline runs and indentation cost ~1 | BPE attaches a leading space to the next word |
//! | CJK ideograph / kana / hangul | per char | common ideographs are single tokens, rare ones 2-3 |
//! | other non-ASCII | 0.5 per UTF-8 byte | accented Latin, emoji and other scripts fall back towards byte-level BPE |
//! | control character | 1 | |
//!
//! The weights were fitted by a grid search (`fit_char_class_costs` in
//! `core/tests/estimator_accuracy.rs`) minimising median + p90/2 of the absolute relative
//! error; on the 1,307 shared prompts the result is within 5% median, 14% p90 of cl100k.
//!
//! Each model then gets a calibration factor ([`EstimatorConfig::calibration`]), e.g. for a
//! tokenizer with a larger vocabulary. Images, audio and video cost a per-item allowance
//! ([`MediaAllowance`]); token-id prompts are counted exactly by the analyser.

use std::collections::BTreeMap;

/// Token allowances for non-text prompt items, in tokens per item.
///
/// Defaults: 576 tokens per image (LLaVA-1.5's 24×24 patch grid at 336 px, Liu et al. 2023,
/// arXiv:2310.03744), 750 per audio clip (Whisper-style encoders emit 50 tokens/s; a 15 s
/// clip), 4096 per video (a conservative multi-frame budget; vLLM's Qwen2-VL caps a video
/// at a few thousand tokens by default). Tune per deployment.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediaAllowance {
    /// Tokens per image.
    pub image_tokens: u32,
    /// Tokens per audio clip.
    pub audio_tokens: u32,
    /// Tokens per video.
    pub video_tokens: u32,
}

impl Default for MediaAllowance {
    fn default() -> Self {
        Self {
            image_tokens: 576,
            audio_tokens: 750,
            video_tokens: 4096,
        }
    }
}

/// Estimator configuration: media allowances and per-model calibration factors.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EstimatorConfig {
    /// Per-item allowances.
    pub media: MediaAllowance,
    /// Multiplier on the text estimate per model name (default 1.0).
    pub calibration: BTreeMap<String, f64>,
}

/// Letters per extra token in an ASCII word after its first [`WORD_FREE_CHARS`] letters.
pub const WORD_CHARS_PER_TOKEN: f64 = 5.0;
/// Letters of an ASCII word covered by its first token (cl100k holds most English words up
/// to ~10 letters, with their leading space, as one token).
pub const WORD_FREE_CHARS: f64 = 10.0;

/// Per-class token costs of the character-class heuristic (see the module doc).
/// The defaults were fitted against `cl100k_base` on `sharegpt_v3_filtered_1000.json`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CharClassCosts {
    /// Tokens for an ASCII word of up to `word_free_chars` letters.
    pub word_base: f64,
    /// Letters covered by the first token of a word.
    pub word_free_chars: f64,
    /// Letters per additional token beyond `word_free_chars`.
    pub word_chars_per_token: f64,
    /// Digits per token (cl100k groups ≤ 3 digits).
    pub digits_per_token: f64,
    /// Tokens per ASCII punctuation character (first of a run).
    pub punct_first: f64,
    /// Tokens per further punctuation character in the same run.
    pub punct_more: f64,
    /// Tokens per newline run.
    pub newline_run: f64,
    /// Tokens per run of 2+ spaces/tabs (indentation).
    pub space_run: f64,
    /// Tokens per CJK character.
    pub cjk_char: f64,
    /// Tokens per UTF-8 byte of other non-ASCII characters.
    pub other_byte: f64,
}

impl Default for CharClassCosts {
    fn default() -> Self {
        Self {
            word_base: 1.0,
            word_free_chars: WORD_FREE_CHARS,
            word_chars_per_token: WORD_CHARS_PER_TOKEN,
            digits_per_token: 3.0,
            punct_first: 1.0,
            punct_more: 0.0,
            newline_run: 1.0,
            space_run: 1.0,
            cjk_char: 1.0,
            other_byte: 0.5,
        }
    }
}

impl CharClassCosts {
    /// Tokens of one ASCII word of `len` letters.
    fn word_tokens(&self, len: u32) -> f64 {
        let r = f64::from(len);
        if r <= self.word_free_chars {
            self.word_base
        } else {
            self.word_base + ((r - self.word_free_chars) / self.word_chars_per_token).ceil()
        }
    }

    /// Tokens of one run of `len` digits.
    fn digit_tokens(&self, len: u32) -> f64 {
        (f64::from(len) / self.digits_per_token).ceil()
    }
}

/// Estimates token counts from text.
#[derive(Debug, Clone, Default)]
pub struct Estimator {
    /// Configuration in force.
    pub config: EstimatorConfig,
    /// Count every byte instead of sampling past the head ([`Estimator::every_byte`]).
    pub every_byte: bool,
}

impl Estimator {
    /// Build an estimator from configuration; it samples long texts past their head
    /// ([`Tally::sampled`]), as the filter does on its hot path.
    pub fn new(config: EstimatorConfig) -> Self {
        Self {
            config,
            every_byte: false,
        }
    }

    /// A default estimator that counts every byte ([`Tally::new`]): for token counts that
    /// stand in for a tokenizer's ground truth (the simulator's model server, a benchmark
    /// trace's prompt lengths), which must not move with the filter's sampling. Same
    /// heuristic and costs; slower on long texts.
    pub fn every_byte() -> Self {
        Self {
            config: EstimatorConfig::default(),
            every_byte: true,
        }
    }

    /// An empty tally of the kind this estimator counts with.
    pub(crate) fn tally(&self) -> Tally {
        if self.every_byte {
            Tally::new()
        } else {
            Tally::sampled()
        }
    }

    /// Estimated BPE tokens in `text` before calibration (rounded up; 0 for empty text).
    pub fn estimate_text(&self, text: &str) -> u64 {
        let t = self.estimate_text_f64(text).ceil();
        if t.is_finite() && t > 0.0 {
            t as u64
        } else {
            0
        }
    }

    /// Unrounded estimate of BPE tokens in `text` before calibration (see the module doc):
    /// the first [`SAMPLE_HEAD_BYTES`] counted exactly, the rest sampled ([`Tally::sampled`]),
    /// as the request analysis counts a prompt; every byte with [`Estimator::every_byte`].
    pub fn estimate_text_f64(&self, text: &str) -> f64 {
        let mut t = self.tally();
        t.feed(text.as_bytes());
        t.end_text();
        t.tokens(&CharClassCosts::default())
    }

    /// Calibration factor for `model` (1.0 when unconfigured).
    pub fn calibration(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|m| self.config.calibration.get(m).copied())
            .filter(|f| f.is_finite() && *f > 0.0)
            .unwrap_or(1.0)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// No open run: after a control or multi-byte character, or at the start of a text.
    None,
    Word,
    Digit,
    Punct,
    Newline,
    Space,
    // Byte kinds of [`BYTE_CLASS`] that never form runs.
    Control,
    /// Leading byte of a 2-, 3- or 4-byte UTF-8 character.
    Lead2,
    Lead3,
    Lead4,
    /// UTF-8 continuation byte.
    Cont,
}

/// Class of every byte value, as a table so the hot loop has no per-byte compare chain.
// Evaluated at compile time: an out-of-range index would be a build error, not a panic.
#[allow(clippy::indexing_slicing)]
const BYTE_CLASS: [Class; 256] = {
    let mut t = [Class::Control; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c >= 0xF0 {
            Class::Lead4
        } else if c >= 0xE0 {
            Class::Lead3
        } else if c >= 0xC0 {
            Class::Lead2
        } else if c >= 0x80 {
            Class::Cont
        } else if c.is_ascii_alphabetic() {
            Class::Word
        } else if c.is_ascii_digit() {
            Class::Digit
        } else if c == b'\n' || c == b'\r' {
            Class::Newline
        } else if c == b' ' || c == b'\t' {
            Class::Space
        } else if c.is_ascii_punctuation() {
            Class::Punct
        } else {
            Class::Control
        };
        b += 1;
    }
    t
};

/// The 16-byte block step of the exact tally ([`Tally::block`]), built where there are
/// 16-byte lanes ([`crate::simd`]: Wasm SIMD, enabled for `wasm32-wasip1` in
/// `.cargo/config.toml`, or x86-64's SSE2). Other targets (aarch64 among them) have no block
/// step and take the byte loop.
#[cfg(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    all(target_arch = "x86_64", target_feature = "sse2")
))]
mod block_step {
    use super::{Class, Counts, Tally, BYTE_CLASS};
    use crate::simd::U8x16;

    /// A block of 16 ASCII bytes by class, as lane masks (lane *k* is 0xFF where byte *k* is of
    /// the class, 0x00 where not), from [`class_masks`].
    #[derive(Clone, Copy)]
    pub(super) struct Masks {
        /// Bytes whose [`BYTE_CLASS`] differs from the byte before (byte 0 is compared with the
        /// class of the byte before the block): where runs start.
        pub(super) starts: U8x16,
        pub(super) word: U8x16,
        pub(super) digit: U8x16,
        pub(super) punct: U8x16,
        pub(super) newline: U8x16,
        pub(super) space: U8x16,
        pub(super) control: U8x16,
    }

    /// The class masks of a block of 16 ASCII bytes, `prev` being the class of the byte before
    /// it; `None` when a byte is not ASCII (the caller then takes one byte per step).
    ///
    /// With 16-byte lanes ([`crate::simd`]: Wasm SIMD, enabled for `wasm32-wasip1` in
    /// `.cargo/config.toml`, or x86-64's SSE2): each class is one or two lane-wise compares,
    /// the class ids are or-ed together (the classes are disjoint), and one compare with the
    /// ids shifted by a lane gives the run starts. Other targets (aarch64 among them) have no
    /// block step and take the byte loop: a portable 16-byte lookup loop measured slower than
    /// it natively (callgrind, 1 KiB chat body: 47 k instead of 31 k instructions per
    /// `Router::route`).
    #[inline(always)]
    pub(super) fn class_masks(block: &[u8; 16], prev: Class) -> Option<Masks> {
        let v = U8x16::new(block);
        if v.bitmask() != 0 {
            return None;
        }
        let splat = U8x16::splat;
        let id = |c: Class| splat(c as u8);
        let eq = |b: u8| v.eq(splat(b));
        // `x - lo < n` (unsigned, wrapping): x in lo..lo + n.
        let within = |x: U8x16, lo: u8, n: u8| x.wrapping_sub(splat(lo)).lt(splat(n));
        let word = within(v | splat(0x20), b'a', 26);
        let digit = within(v, b'0', 10);
        let newline = eq(b'\n') | eq(b'\r');
        let space = eq(b' ') | eq(b'\t');
        let control = v.lt(splat(0x20)).and_not(newline | space) | eq(0x7F);
        let punct = !((word | digit) | ((newline | space) | control));
        let ids = ((word & id(Class::Word)) | (digit & id(Class::Digit)))
            | (((punct & id(Class::Punct)) | (newline & id(Class::Newline)))
                | ((space & id(Class::Space)) | (control & id(Class::Control))));
        // Lane k of `before` is lane k − 1 of `ids`; lane 0 is `prev`.
        let before = ids.shift_in(prev as u8);
        Some(Masks {
            starts: !ids.eq(before),
            word,
            digit,
            punct,
            newline,
            space,
            control,
        })
    }

    /// What the block step counts lane by lane ([`Tally::block`]): one byte counter per lane
    /// and count, each lane adding at most 1 per block, so they are summed into [`Counts`]
    /// ([`Self::flush`]) at least every 255 blocks, and at the end of every call that took a
    /// block step. This replaced a population count per class and block (six per block,
    /// each a dozen instructions on x86-64's baseline, which has no `POPCNT`): the exact
    /// tally of a 1 KiB chat body went from 12.5 k to 10.0 k instructions (callgrind,
    /// `decision_ops`; docs/core.md).
    pub(super) struct LaneCounts {
        punct_runs: U8x16,
        punct_bytes: U8x16,
        newline_runs: U8x16,
        space_runs_2: U8x16,
        control_bytes: U8x16,
        /// Blocks added since the last flush.
        blocks: u32,
    }

    impl LaneCounts {
        pub(super) fn new() -> Self {
            let zero = U8x16::splat(0);
            Self {
                punct_runs: zero,
                punct_bytes: zero,
                newline_runs: zero,
                space_runs_2: zero,
                control_bytes: zero,
                blocks: 0,
            }
        }

        /// Add `m`'s punctuation run starts and bytes, newline run starts and control bytes,
        /// and `space_2`, the lanes that are the second byte of a space run (masks: a set lane
        /// is 0xFF, which subtracted adds 1). Flushes into `c` every 255 blocks.
        #[inline(always)]
        fn add(&mut self, m: &Masks, space_2: U8x16, c: &mut Counts) {
            self.punct_runs = self.punct_runs.wrapping_sub(m.starts & m.punct);
            self.punct_bytes = self.punct_bytes.wrapping_sub(m.punct);
            self.newline_runs = self.newline_runs.wrapping_sub(m.starts & m.newline);
            self.space_runs_2 = self.space_runs_2.wrapping_sub(space_2);
            self.control_bytes = self.control_bytes.wrapping_sub(m.control);
            self.blocks += 1;
            if self.blocks == 255 {
                self.flush(c);
            }
        }

        /// Sum the lanes into `c` and start again from zero.
        pub(super) fn flush(&mut self, c: &mut Counts) {
            if self.blocks == 0 {
                return;
            }
            c.punct_runs += u64::from(self.punct_runs.sum());
            c.punct_bytes += u64::from(self.punct_bytes.sum());
            c.newline_runs += u64::from(self.newline_runs.sum());
            c.space_runs_2 += u64::from(self.space_runs_2.sum());
            c.control_bytes += u64::from(self.control_bytes.sum());
            *self = Self::new();
        }
    }

    impl Counts {
        /// The word or digit runs (`class`) that start at the bits of `starts` in a block whose
        /// run starts are `changes`: each ends where the next run starts, which is inside the
        /// block (the block's last run is not in `starts`).
        #[inline(always)]
        pub(super) fn block_runs(&mut self, class: Class, mut starts: u32, changes: u32) {
            let bins = if class == Class::Word {
                &mut self.words
            } else {
                &mut self.digits
            };
            while starts != 0 {
                let at = starts.trailing_zeros();
                starts &= starts - 1;
                // The next run start after `at` (`2 << at` fits: `at` < 16).
                let end = (changes & !((2u32 << at) - 1)).trailing_zeros();
                Self::length(bins, &mut self.long, class, end.wrapping_sub(at));
            }
        }
    }

    impl Tally {
        /// One step over 16 ASCII bytes with class masks `m`, the open run being of `class` and
        /// `run` bytes before it: the other classes' counts are added lane-wise to `lanes`;
        /// the open run, if a word or number, is closed at the block's first run start, the
        /// word and digit runs that start and end inside the block are counted, and the
        /// block's last run is left open. Returns the open run's class and length after the
        /// block.
        #[inline(always)]
        pub(super) fn block(
            &mut self,
            block: &[u8; 16],
            m: &Masks,
            lanes: &mut LaneCounts,
            class: Class,
            run: u32,
        ) -> (Class, u32) {
            // The second byte of a space run: a space after a space after a non-space. Byte −1
            // is a space when the open run is one; byte −2 too when it is 2 bytes or more.
            let flag = |b: bool| if b { 0xFF } else { 0 };
            let space_1 = m.space.shift_in(flag(class == Class::Space));
            let space_2 = space_1.shift_in(flag(class == Class::Space && run >= 2));
            lanes.add(m, (m.space & space_1).and_not(space_2), &mut self.counts);
            let changes = m.starts.bitmask();
            if changes == 0 {
                return (class, run.wrapping_add(16));
            }
            let first = changes.trailing_zeros();
            let last = 31 - changes.leading_zeros();
            self.close(class, run.wrapping_add(first));
            // Bytes of the runs that start and end in the block: `first..last`.
            let inner = ((1u32 << last) - 1) & !((1u32 << first) - 1);
            let starts = changes & inner;
            let c = &mut self.counts;
            c.block_runs(Class::Word, starts & m.word.bitmask(), changes);
            c.block_runs(Class::Digit, starts & m.digit.bitmask(), changes);
            let class = block
                .get(last as usize)
                .and_then(|&b| BYTE_CLASS.get(usize::from(b)))
                .copied()
                .unwrap_or(Class::Control);
            (class, 16 - last)
        }
    }
}

/// Word and digit run lengths counted one by one; longer runs are rare and kept in a short
/// list.
const RUN_BINS: usize = 64;
// `Counts::tokens` walks the bins eight at a time (a build error otherwise, not a panic).
const _: () = assert!(RUN_BINS.is_multiple_of(8));

/// Streaming form of the heuristic: feed text in pieces (e.g. the segments of a JSON
/// string between escapes), end a text with [`Tally::end_text`], read the estimate with
/// [`Tally::tokens`].
///
/// The scan does integer work only, and per byte only a table lookup and a compare
/// ([`Counts`]): a word or digit run is counted when it ends, in a histogram of lengths
/// (their costs are not linear in the length); the other classes as they go (a
/// punctuation or newline run at its first byte, a space run at its second, punctuation
/// and control bytes one by one); multi-byte characters take a separate path. With 16-byte
/// lanes (Wasm SIMD, x86-64's SSE2), 16 ASCII bytes take one step (`block_step`): the
/// other classes' counts are added lane-wise, and
/// only the block's word and digit runs are visited one by one.
/// The per-class costs ([`CharClassCosts`], floating point) are applied once, in
/// [`Tally::tokens`]. Texts ended with `end_text` never join runs across their boundary.
///
/// ## Sampled tail ([`Tally::sampled`])
/// A sampled tally counts the first [`SAMPLE_HEAD_BYTES`] bytes it is fed exactly (up to
/// the end of the word or number at that limit). Of the
/// bytes after them (the tail) it counts one window of about [`SAMPLE_WINDOW_BYTES`] in every
/// [`SAMPLE_STRIDE_BYTES`], and scales the windows' tokens by tail bytes / window bytes:
///
/// ```text
/// tokens = head_tokens + window_tokens × tail_bytes / window_bytes
/// ```
///
/// A window starts at the first byte at or after its offset that cannot be inside a word
/// or a number (not an ASCII letter or digit, not a UTF-8 continuation byte), and ends at
/// the first such byte at or past its end, so it counts whole words and numbers only. A tail where no window found such a byte (one long run of letters or digits)
/// is priced at the head's tokens per byte. Offsets count bytes fed since the head, across
/// calls and texts, so the result does not depend on how the text is split into pieces.
///
/// This bounds the per-byte work on long prompts: past the head, the tally touches about
/// 1/32 of the bytes (the JSON scan still reads every byte). Accuracy against tiktoken on
/// the shared prompts, and on prompts over 64 KiB, is tested in
/// `core/tests/estimator_accuracy.rs` and reported in `docs/core.md`. The sample is
/// deterministic: a client that crafts a body whose windows are cheaper than the rest can
/// lower its estimate (at worst about 2.5×, letters in the windows and digits between
/// them); the model server's `usage` corrects the in-flight accounting when it answers.
#[derive(Debug, Clone)]
pub struct Tally {
    class: Class,
    run: u32,
    // Multi-byte character split across calls: code point so far, bytes still expected,
    // width.
    cp: u32,
    pending: u32,
    width: u32,
    /// What the exact scan counted: the head, then (sampled, past the head) the windows.
    counts: Counts,
    sample: Option<Box<Sample>>,
}

/// Bytes a sampled tally counts exactly before it samples ([`Tally::sampled`]).
pub const SAMPLE_HEAD_BYTES: u64 = 2048;
/// Bytes per sampled window past the head.
pub const SAMPLE_WINDOW_BYTES: u64 = 256;
/// Bytes from one window's start to the next: 1 byte in 32 is counted past the head.
/// Chosen on the accuracy table in docs/core.md: a 4 KiB stride measured 2.6 % / 6.1 %
/// (median / p90, cl100k, prompts over 64 KiB) for ~16 % more Wasm operations per decision
/// at 1 MiB (8.19 M against 7.03 M), a 16 KiB stride 5.2 % / 12.5 % (p99 24.8 %).
pub const SAMPLE_STRIDE_BYTES: u64 = 8192;

/// What a tally counted in the bytes it scanned: what [`Counts::tokens`] prices. Runs of
/// length 0 (closed at a text's start) are not counted.
#[derive(Debug, Clone, PartialEq)]
struct Counts {
    /// Word runs per length (< `RUN_BINS`; bin 0 stays empty).
    words: [u32; RUN_BINS],
    /// Digit runs per length (< `RUN_BINS`; bin 0 stays empty).
    digits: [u32; RUN_BINS],
    /// Word and digit runs of `RUN_BINS` bytes or more: (class, length).
    long: Vec<(Class, u32)>,
    punct_runs: u64,
    punct_bytes: u64,
    newline_runs: u64,
    /// Space runs of two bytes or more (indentation; a single space before a word is
    /// free), counted at their second byte.
    space_runs_2: u64,
    control_bytes: u64,
    cjk: u64,
    other_bytes: u64,
}

impl Default for Counts {
    fn default() -> Self {
        Self {
            words: [0; RUN_BINS],
            digits: [0; RUN_BINS],
            long: Vec::new(),
            punct_runs: 0,
            punct_bytes: 0,
            newline_runs: 0,
            space_runs_2: 0,
            control_bytes: 0,
            cjk: 0,
            other_bytes: 0,
        }
    }
}

impl Counts {
    /// A word (`words`) or digit (`digits`) run of `len` bytes.
    #[inline(always)]
    fn length(bins: &mut [u32; RUN_BINS], long: &mut Vec<(Class, u32)>, class: Class, len: u32) {
        match bins.get_mut(len as usize) {
            Some(n) => *n = n.wrapping_add(1),
            None => long.push((class, len)),
        }
    }

    /// Unrounded tokens of the counted runs under costs `c`.
    fn tokens(&self, c: &CharClassCosts) -> f64 {
        let word = |len: u32| c.word_tokens(len);
        let digit = |len: u32| c.digit_tokens(len);
        let mut total = 0.0;
        // Eight bins of each histogram at a time: past a text's longest word and number the
        // bins are empty, and a chunk of empty bins is passed with one test (the 63-bin
        // walk was ~0.9 k instructions a request, callgrind). Bin 0 is always empty.
        let chunks = self.words.chunks_exact(8).zip(self.digits.chunks_exact(8));
        for (first, (ws, ds)) in (0u32..).step_by(8).zip(chunks) {
            let any = ws.iter().chain(ds).fold(0, |a, &n| a | n);
            if any == 0 {
                continue;
            }
            for (len, (&w, &d)) in (first..).zip(ws.iter().zip(ds)) {
                if w > 0 {
                    total += f64::from(w) * word(len);
                }
                if d > 0 {
                    total += f64::from(d) * digit(len);
                }
            }
        }
        let long = |class: Class| self.long.iter().filter(move |(k, _)| *k == class);
        total += long(Class::Word).map(|&(_, l)| word(l)).sum::<f64>();
        total += long(Class::Digit).map(|&(_, l)| digit(l)).sum::<f64>();
        let more = self.punct_bytes.saturating_sub(self.punct_runs);
        total += self.punct_runs as f64 * c.punct_first + more as f64 * c.punct_more;
        total += self.newline_runs as f64 * c.newline_run;
        total += self.space_runs_2 as f64 * c.space_run;
        total += self.control_bytes as f64;
        total += self.cjk as f64 * c.cjk_char;
        total += self.other_bytes as f64 * c.other_byte;
        total
    }
}

/// Where a sampled tally is in its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Counting the first [`SAMPLE_HEAD_BYTES`] exactly.
    Head,
    /// Past the head's limit, inside the word or number it cut.
    HeadFinish,
    /// Between windows.
    Skip,
    /// At a window's offset, looking for a byte it may start at.
    Seek,
    /// Inside a window.
    Window,
    /// Past a window's end, inside the word or number it cut.
    Finish,
}

/// State of a sampled tally ([`Tally::sampled`]).
#[derive(Debug, Clone)]
struct Sample {
    phase: Phase,
    /// Bytes counted in the head.
    head_bytes: u64,
    /// The head's counts, once it is full.
    head: Option<Counts>,
    /// Bytes fed past the head.
    tail_bytes: u64,
    /// Bytes of the tail counted in windows.
    window_bytes: u64,
    /// Tail offset of the next window's start (in `Skip`) or of the current one's end.
    next: u64,
}

impl std::fmt::Debug for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Class::None => "none",
            Class::Word => "word",
            Class::Digit => "digit",
            Class::Punct => "punct",
            Class::Newline => "newline",
            Class::Space => "space",
            Class::Control => "control",
            Class::Lead2 | Class::Lead3 | Class::Lead4 => "lead",
            Class::Cont => "continuation",
        };
        f.write_str(s)
    }
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            class: Class::None,
            run: 0,
            cp: 0,
            pending: 0,
            width: 0,
            counts: Counts::default(),
            sample: None,
        }
    }
}

/// A byte a sampled window may start at: not inside a word or number, not inside a
/// multi-byte character.
#[inline]
fn window_start(b: u8) -> bool {
    !(b.is_ascii_alphanumeric() || b & 0xC0 == 0x80)
}

impl Tally {
    /// An empty tally that counts every byte.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty tally that counts the first [`SAMPLE_HEAD_BYTES`] exactly and samples the
    /// rest (see the type's doc). This is what [`Estimator`] and the request analysis use.
    pub fn sampled() -> Self {
        Self {
            sample: Some(Box::new(Sample {
                phase: Phase::Head,
                head_bytes: 0,
                head: None,
                tail_bytes: 0,
                window_bytes: 0,
                next: 0,
            })),
            ..Self::default()
        }
    }

    /// Record the finished run of `class` and length `run`: a word or digit run in its
    /// length histogram (nothing for a run of 0 bytes; the other classes are counted as
    /// they go, see [`Self::ascii_byte`]).
    #[inline(always)]
    fn close(&mut self, class: Class, run: u32) {
        let c = &mut self.counts;
        match class {
            Class::Word if run > 0 => Counts::length(&mut c.words, &mut c.long, class, run),
            Class::Digit if run > 0 => Counts::length(&mut c.digits, &mut c.long, class, run),
            _ => {}
        }
    }

    /// Count one ASCII byte of class `c` (one of the run classes, or a control) that makes
    /// the open run `run` bytes long: a punctuation or newline run at its first byte, a
    /// space run at its second, punctuation and control bytes each. What
    /// `block_step::LaneCounts::add` counts for a block, one byte at a time.
    #[inline(always)]
    fn ascii_byte(&mut self, c: Class, run: u32) {
        let n = &mut self.counts;
        match c {
            Class::Punct => {
                n.punct_runs += u64::from(run == 1);
                n.punct_bytes += 1;
            }
            Class::Newline => n.newline_runs += u64::from(run == 1),
            Class::Space => n.space_runs_2 += u64::from(run == 2),
            Class::Control => n.control_bytes += 1,
            _ => {}
        }
    }

    /// A whole multi-byte character with code point `cp` and `width` bytes.
    #[inline(always)]
    fn wide_char(&mut self, cp: u32, width: u32) {
        if is_cjk_cp(cp) {
            self.counts.cjk += 1;
        } else {
            self.counts.other_bytes += u64::from(width);
        }
    }

    /// Scan more bytes of the current text. `bytes` must be whole UTF-8 characters as a
    /// sequence (a `&str`, or the encoding of decoded characters); a multi-byte character
    /// ends the current ASCII run. A sampled tally counts only its head and windows.
    #[inline]
    pub fn feed(&mut self, bytes: &[u8]) {
        // Most pieces of a long text fall between two sampling windows: only their length
        // counts. This is `feed_sampled`'s `Skip` step for a piece that ends before the
        // next window, without the phase machine (a third of the analysis's instructions
        // per piece on a chat body with an escape every ~64 bytes), inlined into the caller.
        if let Some(st) = self.sample.as_deref_mut() {
            if st.phase == Phase::Skip {
                let len = bytes.len() as u64;
                if len <= st.next.saturating_sub(st.tail_bytes) {
                    st.tail_bytes += len;
                    return;
                }
            }
        }
        self.feed_counted(bytes);
    }

    /// Bytes that can be fed next without being read: those before the next sampling
    /// window while a sampled tally is between windows, else 0.
    #[inline]
    pub fn skip_room(&self) -> u64 {
        match self.sample.as_deref() {
            Some(st) if st.phase == Phase::Skip => st.next.saturating_sub(st.tail_bytes),
            _ => 0,
        }
    }

    /// Bytes that will be read (counted exactly) from here before the tally next skips
    /// or has to finish a word: the rest of a sampled tally's head, or of the window it
    /// is at or in; 0 between windows and while it finishes the word a limit cut;
    /// `u64::MAX` for a tally that counts every byte. A caller may decode that many
    /// bytes ahead and feed them in one call ([`Self::feed`] does not depend on how a text
    /// is split).
    #[inline]
    pub fn read_room(&self) -> u64 {
        match self.sample.as_deref() {
            None => u64::MAX,
            Some(st) => match st.phase {
                Phase::Head => SAMPLE_HEAD_BYTES.saturating_sub(st.head_bytes),
                Phase::Seek | Phase::Window => st.next.saturating_sub(st.tail_bytes),
                Phase::HeadFinish | Phase::Skip | Phase::Finish => 0,
            },
        }
    }

    /// Count `len` bytes of text as fed, unread: the same as feeding any `len` bytes when
    /// `len` ≤ [`Self::skip_room`] (callers hold to that; otherwise nothing is counted).
    #[inline]
    pub fn skip(&mut self, len: u64) {
        if let Some(st) = self.sample.as_deref_mut() {
            if st.phase == Phase::Skip && len <= st.next.saturating_sub(st.tail_bytes) {
                st.tail_bytes += len;
            }
        }
    }

    /// Bytes fed so far (and skipped, [`Self::skip`]) to a sampled tally; 0 for one that
    /// counts every byte.
    #[inline]
    pub fn fed(&self) -> u64 {
        self.sample
            .as_deref()
            .map_or(0, |st| st.head_bytes + st.tail_bytes)
    }

    /// Take back `len` bytes of a sampled tally's tail counted by [`Self::skip`] (never
    /// below the bytes its windows read): for a caller that skipped raw bytes of which
    /// it learned afterwards that fewer were text. Nothing for a tally that is not
    /// sampled, or whose head is not full.
    pub fn untake(&mut self, len: u64) {
        if let Some(st) = self.sample.as_deref_mut() {
            st.tail_bytes = st.tail_bytes.saturating_sub(len).max(st.window_bytes);
        }
    }

    /// [`Self::feed`] past its skip step: the exact scan, or the sampled tally's phases.
    #[inline(never)]
    fn feed_counted(&mut self, bytes: &[u8]) {
        match self.sample.take() {
            None => self.feed_exact(bytes),
            Some(mut sample) => {
                self.feed_sampled(&mut sample, bytes);
                self.sample = Some(sample);
            }
        }
    }

    /// Close the open run (as at the end of a text) without dropping a split character.
    fn cut_run(&mut self) {
        self.close(self.class, self.run);
        self.class = Class::None;
        self.run = 0;
    }

    /// Feed `bytes` to the exact scan up to `room` bytes and on to the end of the word or
    /// number (and character) that limit cuts. Returns the bytes fed and the rest (empty
    /// when the piece ended first).
    fn feed_to_word_end<'b>(&mut self, bytes: &'b [u8], room: u64) -> (u64, &'b [u8]) {
        let mut cut = usize::try_from(room).unwrap_or(usize::MAX).min(bytes.len());
        while bytes.get(cut).is_some_and(|&c| !window_start(c)) {
            cut += 1;
        }
        let (now, rest) = bytes.split_at(cut.min(bytes.len()));
        self.feed_exact(now);
        (now.len() as u64, rest)
    }

    /// [`Self::feed`] for a sampled tally: route each stretch of `bytes` to the exact scan
    /// (head, windows) or past it (between windows).
    fn feed_sampled(&mut self, st: &mut Sample, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match st.phase {
                Phase::Head | Phase::HeadFinish => {
                    let room = if st.phase == Phase::Head {
                        SAMPLE_HEAD_BYTES.saturating_sub(st.head_bytes)
                    } else {
                        0
                    };
                    // The head ends after the word or number (and character) its limit
                    // cuts, into the next piece if this one ends inside it, so the tail
                    // starts between words.
                    let within = bytes.len() as u64 <= room;
                    let (fed, rest) = self.feed_to_word_end(bytes, room);
                    st.head_bytes += fed;
                    if rest.is_empty() {
                        if !within {
                            st.phase = Phase::HeadFinish;
                        }
                        return;
                    }
                    self.cut_run();
                    st.head = Some(std::mem::take(&mut self.counts));
                    st.phase = Phase::Seek;
                    st.next = SAMPLE_WINDOW_BYTES;
                    bytes = rest;
                }
                Phase::Skip => {
                    let gap = st.next.saturating_sub(st.tail_bytes);
                    if bytes.len() as u64 <= gap {
                        st.tail_bytes += bytes.len() as u64;
                        return;
                    }
                    bytes = bytes.get(gap as usize..).unwrap_or(&[]);
                    st.tail_bytes += gap;
                    st.phase = Phase::Seek;
                    st.next += SAMPLE_WINDOW_BYTES;
                }
                Phase::Seek => {
                    let left = st.next.saturating_sub(st.tail_bytes) as usize;
                    let look = bytes.get(..left).unwrap_or(bytes);
                    match look.iter().position(|&b| window_start(b)) {
                        Some(at) => {
                            bytes = bytes.get(at..).unwrap_or(&[]);
                            st.tail_bytes += at as u64;
                            st.phase = Phase::Window;
                        }
                        None => {
                            bytes = bytes.get(look.len()..).unwrap_or(&[]);
                            st.tail_bytes += look.len() as u64;
                            if st.tail_bytes >= st.next {
                                // No start in this window: on to the next one.
                                st.next += SAMPLE_STRIDE_BYTES - SAMPLE_WINDOW_BYTES;
                                st.phase = Phase::Skip;
                            }
                        }
                    }
                }
                Phase::Window | Phase::Finish => {
                    let left = if st.phase == Phase::Window {
                        st.next.saturating_sub(st.tail_bytes)
                    } else {
                        0
                    };
                    // Finish the word or number (and character) the window's end cuts,
                    // into the next piece if this one ends inside it.
                    let within = bytes.len() as u64 <= left;
                    let (fed, rest) = self.feed_to_word_end(bytes, left);
                    st.tail_bytes += fed;
                    st.window_bytes += fed;
                    if rest.is_empty() {
                        if !within {
                            st.phase = Phase::Finish;
                        }
                        return;
                    }
                    self.cut_run();
                    st.next += SAMPLE_STRIDE_BYTES - SAMPLE_WINDOW_BYTES;
                    st.phase = Phase::Skip;
                    bytes = rest;
                }
            }
        }
    }

    /// The exact scan of `bytes` (see [`Self::feed`]).
    fn feed_exact(&mut self, bytes: &[u8]) {
        let mut i = 0;
        // The rest of a character split across calls (not expected for whole characters).
        while self.pending > 0 {
            let Some(&b) = bytes.get(i) else {
                return;
            };
            if b & 0xC0 != 0x80 {
                self.pending = 0;
                break;
            }
            self.cp = (self.cp << 6) | u32::from(b & 0x3F);
            self.pending -= 1;
            if self.pending == 0 {
                self.wide_char(self.cp, self.width);
            }
            i += 1;
        }
        let mut class = self.class;
        let mut run = self.run;
        // Below, each byte is one step, or 16 ASCII bytes one (`class_masks`, `Self::block`).
        #[cfg(any(
            all(target_arch = "wasm32", target_feature = "simd128"),
            all(target_arch = "x86_64", target_feature = "sse2")
        ))]
        let mut lanes = block_step::LaneCounts::new();
        let mut block_end = i;
        loop {
            if i >= block_end {
                #[cfg(any(
                    all(target_arch = "wasm32", target_feature = "simd128"),
                    all(target_arch = "x86_64", target_feature = "sse2")
                ))]
                if let Some(block) = bytes.get(i..).and_then(<[u8]>::first_chunk::<16>) {
                    if let Some(m) = block_step::class_masks(block, class) {
                        (class, run) = self.block(block, &m, &mut lanes, class, run);
                        i += 16;
                        block_end = i;
                        continue;
                    }
                }
                // Not 16 ASCII bytes: the next 16 bytes (or the rest) one by one.
                block_end = i + 16;
            }
            let Some(&b) = bytes.get(i) else {
                break;
            };
            let c = BYTE_CLASS
                .get(usize::from(b))
                .copied()
                .unwrap_or(Class::Control);
            i += 1;
            if c == class {
                run = run.wrapping_add(1);
                self.ascii_byte(c, run);
                continue;
            }
            self.close(class, run);
            if (c as u8) < (Class::Lead2 as u8) {
                // An ASCII class (controls count as runs of their own class).
                class = c;
                run = 1;
                self.ascii_byte(c, run);
                continue;
            }
            class = Class::None;
            run = 0;
            let (width, lead) = match c {
                Class::Lead2 => (2, u32::from(b & 0x1F)),
                Class::Lead3 => (3, u32::from(b & 0x0F)),
                Class::Lead4 => (4, u32::from(b & 0x07)),
                _ => {
                    // A stray continuation byte (not valid UTF-8): one byte of "other".
                    self.counts.other_bytes += 1;
                    continue;
                }
            };
            match bytes.get(i..i + width - 1) {
                Some(tail) => {
                    let cp = tail
                        .iter()
                        .fold(lead, |cp, &t| (cp << 6) | u32::from(t & 0x3F));
                    self.wide_char(cp, width as u32);
                    i += width - 1;
                }
                None => {
                    // Split across calls: finish it at the start of the next one.
                    (self.cp, self.width) = (lead, width as u32);
                    self.pending = width as u32 - 1;
                    while let Some(&t) = bytes.get(i) {
                        self.cp = (self.cp << 6) | u32::from(t & 0x3F);
                        self.pending -= 1;
                        i += 1;
                    }
                }
            }
        }
        #[cfg(any(
            all(target_arch = "wasm32", target_feature = "simd128"),
            all(target_arch = "x86_64", target_feature = "sse2")
        ))]
        lanes.flush(&mut self.counts);
        self.class = class;
        self.run = run;
    }

    /// End the current text: its last run is closed, and the next fed byte starts a new one.
    pub fn end_text(&mut self) {
        self.close(self.class, self.run);
        self.class = Class::None;
        self.run = 0;
        self.pending = 0;
    }

    /// Unrounded tokens of every text tallied so far, under costs `c` (call after
    /// [`Self::end_text`]: before it, an open word or number is not counted yet, while
    /// the other classes count as they go). For a sampled tally: the head's
    /// tokens plus the windows' scaled to the whole tail (see the type's doc).
    pub fn tokens(&self, c: &CharClassCosts) -> f64 {
        let Some(st) = self.sample.as_deref() else {
            return self.counts.tokens(c);
        };
        let Some(head) = &st.head else {
            return self.counts.tokens(c);
        };
        let head_tokens = head.tokens(c);
        let tail = st.tail_bytes as f64;
        if st.window_bytes > 0 {
            head_tokens + self.counts.tokens(c) * tail / st.window_bytes as f64
        } else if st.head_bytes > 0 {
            head_tokens + head_tokens * tail / st.head_bytes as f64
        } else {
            head_tokens
        }
    }
}

/// The heuristic itself, with explicit costs and every byte counted (used by tests to fit
/// the defaults).
///
/// One pass over the UTF-8 bytes ([`Tally`]): ASCII bytes extend or end a run of their
/// class; a multi-byte character ends the current run and costs `cjk_char` (CJK) or
/// `other_byte` × its byte length.
pub fn estimate_with(c: &CharClassCosts, text: &str) -> f64 {
    let mut t = Tally::new();
    t.feed(text.as_bytes());
    t.end_text();
    t.tokens(c)
}

fn is_cjk_cp(cp: u32) -> bool {
    matches!(cp,
        0x3040..=0x30FF      // hiragana, katakana
        | 0x3400..=0x4DBF    // CJK extension A
        | 0x4E00..=0x9FFF    // CJK unified ideographs
        | 0xAC00..=0xD7AF    // hangul syllables
        | 0xF900..=0xFAFF    // CJK compatibility ideographs
        | 0x20000..=0x2FFFF) // CJK extensions B+
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn sampled(text: &str) -> f64 {
        let mut t = Tally::sampled();
        t.feed(text.as_bytes());
        t.end_text();
        t.tokens(&CharClassCosts::default())
    }

    fn exact(text: &str) -> f64 {
        estimate_with(&CharClassCosts::default(), text)
    }

    proptest::proptest! {
        /// The 16-byte block step (`class_masks`, `Tally::block`) counts exactly what the
        /// byte loop counts: a text fed in arbitrary pieces (blocks taken wherever 16 ASCII
        /// bytes follow) against the same text fed one character per call (no piece
        /// reaches 16 bytes, so every byte takes the byte loop), and both against the runs
        /// counted from the text directly ([`runs_of`]). The block step exists with 16-byte
        /// lanes: SSE2 natively, Wasm SIMD under `make test-wasm`.
        #[test]
        fn blocks_count_what_the_byte_loop_counts(
            text in "([a-zA-Z]{1,12}|[0-9]{1,5}|[ \t]{1,3}|[\n\r]{1,2}|[.,;:!?()\\\"'#*{}<>~_/-]{1,3}|[\\x00-\\x1f\\x7f]|[éü中文😀]){0,120}",
            cuts in proptest::collection::vec(0usize..400, 0..6),
        ) {
            let mut whole = Tally::new();
            let mut at = 0;
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| text.is_char_boundary(c.min(text.len()))).collect();
            cuts.sort_unstable();
            for c in cuts.into_iter().chain([text.len()]) {
                let c = c.min(text.len());
                if c > at {
                    whole.feed(&text.as_bytes()[at..c]);
                    at = c;
                }
            }
            whole.end_text();
            let mut bytewise = Tally::new();
            let mut buf = [0u8; 4];
            for ch in text.chars() {
                bytewise.feed(ch.encode_utf8(&mut buf).as_bytes());
            }
            bytewise.end_text();
            proptest::prop_assert_eq!(&whole.counts, &bytewise.counts);
            proptest::prop_assert_eq!(runs_of(&whole.counts), runs_of_text(&text));
        }
    }

    /// Punctuation runs and bytes, newline runs, space runs of 2 bytes or more, control
    /// bytes, word runs, digit runs: from a tally's counts.
    fn runs_of(c: &Counts) -> [u64; 7] {
        let runs = |bins: &[u32; RUN_BINS], class| {
            bins.iter().map(|&n| u64::from(n)).sum::<u64>()
                + c.long.iter().filter(|(k, _)| *k == class).count() as u64
        };
        [
            c.punct_runs,
            c.punct_bytes,
            c.newline_runs,
            c.space_runs_2,
            c.control_bytes,
            runs(&c.words, Class::Word),
            runs(&c.digits, Class::Digit),
        ]
    }

    /// [`runs_of`] counted from the text itself: its maximal runs of one ASCII class (a
    /// non-ASCII character ends a run).
    fn runs_of_text(text: &str) -> [u64; 7] {
        let mut out = [0u64; 7];
        let mut runs: Vec<(Class, u64)> = Vec::new();
        for ch in text.chars() {
            let c = if ch.is_ascii() {
                BYTE_CLASS[ch as usize]
            } else {
                Class::None
            };
            match runs.last_mut() {
                Some((k, n)) if *k == c && c != Class::None => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        for (c, n) in runs {
            match c {
                Class::Punct => {
                    out[0] += 1;
                    out[1] += n;
                }
                Class::Newline => out[2] += 1,
                Class::Space => out[3] += u64::from(n >= 2),
                Class::Control => out[4] += n,
                Class::Word => out[5] += 1,
                Class::Digit => out[6] += 1,
                _ => {}
            }
        }
        out
    }

    proptest::proptest! {
        /// `Counts::tokens`, which passes chunks of empty bins, prices the histograms as the
        /// walk over every bin does, to the bit (the same additions in the same order).
        #[test]
        fn tokens_skip_only_empty_bins(
            bins in proptest::collection::vec((1usize..RUN_BINS, 0u32..4, 0u32..4), 0..20),
            free in 1.0f64..20.0,
        ) {
            let mut c = Counts::default();
            for (len, w, d) in bins {
                c.words[len] += w;
                c.digits[len] += d;
            }
            let costs = CharClassCosts { word_free_chars: free, ..CharClassCosts::default() };
            let mut want = 0.0;
            for len in 1..RUN_BINS {
                if c.words[len] > 0 {
                    want += f64::from(c.words[len]) * costs.word_tokens(len as u32);
                }
                if c.digits[len] > 0 {
                    want += f64::from(c.digits[len]) * costs.digit_tokens(len as u32);
                }
            }
            proptest::prop_assert_eq!(c.tokens(&costs).to_bits(), want.to_bits());
        }
    }

    /// Past 255 blocks in one call the lane counters are summed and start again: a long
    /// ASCII text fed whole counts what it counts fed one byte per call.
    #[test]
    fn lane_counters_hold_past_255_blocks() {
        let text = "Indented  code: x = f(a, b);\n\t\tif y == 0 { return 42; }\n".repeat(300);
        assert!(text.len() > 255 * 16 * 2);
        let mut whole = Tally::new();
        whole.feed(text.as_bytes());
        whole.end_text();
        let mut bytewise = Tally::new();
        for b in text.as_bytes() {
            bytewise.feed(std::slice::from_ref(b));
        }
        bytewise.end_text();
        assert_eq!(whole.counts, bytewise.counts);
        // Per line: punctuation runs `:`, `=`, `(`, `,`, `);` `{`, `==`, `;`, `}` (9, 11
        // bytes); newlines 2; space runs of 2+: `  ` and the two tabs (2).
        assert_eq!(runs_of(&whole.counts), runs_of_text(&text));
        assert_eq!(
            runs_of(&whole.counts)[..5],
            [300 * 9, 300 * 11, 300 * 2, 300 * 2, 0]
        );
    }

    /// The block step's class masks against [`BYTE_CLASS`] (targets with 16-byte lanes).
    #[cfg(any(
        all(target_arch = "wasm32", target_feature = "simd128"),
        all(target_arch = "x86_64", target_feature = "sse2")
    ))]
    mod masks {
        use super::super::*;

        /// A block of 16 ASCII bytes by class, one bit per byte (bit *k* for byte *k*): the
        /// class masks' bitmasks.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        struct Lanes {
            changes: u32,
            word: u32,
            digit: u32,
            punct: u32,
            newline: u32,
            space: u32,
            control: u32,
        }

        /// `block_step::class_masks` as bitmasks.
        fn class_lanes(block: &[u8; 16], prev: Class) -> Option<Lanes> {
            block_step::class_masks(block, prev).map(|m| Lanes {
                changes: m.starts.bitmask(),
                word: m.word.bitmask(),
                digit: m.digit.bitmask(),
                punct: m.punct.bitmask(),
                newline: m.newline.bitmask(),
                space: m.space.bitmask(),
                control: m.control.bitmask(),
            })
        }

        /// `block_step::class_masks` byte by byte from [`BYTE_CLASS`], as bitmasks: `None` when a byte
        /// is not ASCII.
        fn class_lanes_by_bytes(block: &[u8; 16], prev: Class) -> Option<Lanes> {
            if !block.is_ascii() {
                return None;
            }
            let mut l = Lanes {
                changes: 0,
                word: 0,
                digit: 0,
                punct: 0,
                newline: 0,
                space: 0,
                control: 0,
            };
            let mut before = prev;
            for (k, &b) in block.iter().enumerate() {
                let c = BYTE_CLASS[usize::from(b)];
                let bit = 1u32 << k;
                if c != before {
                    l.changes |= bit;
                }
                match c {
                    Class::Word => l.word |= bit,
                    Class::Digit => l.digit |= bit,
                    Class::Punct => l.punct |= bit,
                    Class::Newline => l.newline |= bit,
                    Class::Space => l.space |= bit,
                    Class::Control => l.control |= bit,
                    _ => unreachable!("{b:#04x} is ASCII"),
                }
                before = c;
            }
            Some(l)
        }

        /// The bytes of the [`class_lanes`] property, weighted by repetition: letters (twice),
        /// digits, every printable ASCII byte (the punctuation at the edges of the letter and
        /// digit ranges among them), spaces, tabs, newlines and carriage returns (three times),
        /// controls and 0x7F, and a few non-ASCII bytes.
        fn class_test_bytes() -> Vec<u8> {
            let mut v: Vec<u8> = (b'a'..=b'z').chain(b'A'..=b'Z').collect();
            v.extend_from_within(..);
            v.extend(0x21u8..0x7F);
            v.extend(b" \t\n\r".repeat(3));
            v.extend((0u8..0x20).chain([0x7F]));
            v.extend([0x80, 0xBF, 0xC3, 0xE4, 0xF0, 0xFF]);
            v
        }

        /// The classes `prev` can be: every class (the open run's is one of the ASCII ones or
        /// `None`; the others are covered too).
        const CLASSES: [Class; 11] = [
            Class::None,
            Class::Word,
            Class::Digit,
            Class::Punct,
            Class::Newline,
            Class::Space,
            Class::Control,
            Class::Lead2,
            Class::Lead3,
            Class::Lead4,
            Class::Cont,
        ];

        proptest::proptest! {
            /// The 16-byte-lane body of [`class_lanes`] (SSE2 natively, Wasm SIMD under `make
            /// test-wasm`) gives every byte its [`BYTE_CLASS`], on blocks of every class
            /// ([`class_test_bytes`]) after every class.
            #[test]
            fn class_lanes_are_byte_class_byte_by_byte(
                block in proptest::array::uniform16(proptest::sample::select(class_test_bytes())),
                prev in 0..CLASSES.len(),
            ) {
                let prev = CLASSES[prev];
                proptest::prop_assert_eq!(class_lanes(&block, prev), class_lanes_by_bytes(&block, prev));
            }
        }

        /// Every byte value in every lane, beside letters and after each class.
        #[test]
        fn class_lanes_cover_every_byte_value() {
            for b in 0..=255u8 {
                for k in 0..16 {
                    for prev in CLASSES {
                        let mut block = [b'q'; 16];
                        block[k] = b;
                        assert_eq!(
                            class_lanes(&block, prev),
                            class_lanes_by_bytes(&block, prev),
                            "{b:#04x} in lane {k} after class {}",
                            prev as u8
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_block_step_closes_each_run_at_its_class_change() {
        // 32 ASCII bytes (two blocks, the digit run crossing the block boundary) then a
        // CJK character and a tail shorter than a block: word runs of 5, 5, 3, 2 and 2
        // letters, one 11-digit run, one 2-punctuation run, spaces of 2 and 1, one newline.
        let text = "Hello  world12345678901 abc..\nxy中ab";
        let mut t = Tally::new();
        t.feed(text.as_bytes());
        t.end_text();
        let c = &t.counts;
        assert_eq!(c.words[5], 2); // Hello, world
        assert_eq!(c.digits[11], 1); // 12345678901
        assert_eq!(c.words[3], 1); // abc
        assert_eq!(c.words[2], 2); // xy, ab
        assert_eq!(c.words.iter().sum::<u32>(), 5);
        assert_eq!(c.digits.iter().sum::<u32>(), 1);
        assert_eq!((c.punct_runs, c.punct_bytes), (1, 2)); // ..
        assert_eq!(c.newline_runs, 1);
        assert_eq!(c.space_runs_2, 1); // the two spaces; the single one before abc is free
        assert_eq!(c.control_bytes, 0);
        assert_eq!(c.cjk, 1);
        assert!(c.long.is_empty());
    }

    #[test]
    fn a_text_within_the_head_is_counted_exactly() {
        let text = "The quick brown fox, 12345 times.\n".repeat(60);
        assert_eq!(text.len(), 2040);
        assert_eq!(sampled(&text), exact(&text));
        assert_eq!(exact(&text), 60.0 * 10.0);
    }

    #[test]
    fn a_uniform_tail_is_priced_by_its_windows() {
        // 12 bytes and 2 tokens per "hello world ": 64 KiB of it is 10,923 tokens exactly
        // (the last repetition is cut to "hello wo"). The windows see whole words only.
        let text: String = "hello world ".repeat(5462)[..65536].to_string();
        assert_eq!(exact(&text), 10923.0);
        let s = sampled(&text);
        assert!((s - 10923.0).abs() / 10923.0 < 0.005, "{s}");
    }

    #[test]
    fn a_word_longer_than_the_head_is_counted_whole() {
        // The head ends after the word its limit cuts: one 10,000-letter word is all head,
        // 1 + ⌈9990/5⌉ tokens, as the exact count.
        let text = "a".repeat(10_000);
        assert_eq!(sampled(&text), 1999.0);
        assert_eq!(exact(&text), 1999.0);
    }

    #[test]
    fn fixed_width_words_are_priced_by_bytes_past_the_head() {
        // 512 words of 6 letters and a space (the replay tool's Mooncake block text): the
        // head ends after word 293 (2050 bytes); the one window holds 37 whole words in
        // 259 bytes, 1 token per 7 bytes, applied to the 1534-byte tail: 293 + 1534 / 7.
        let text = "abcdef ".repeat(512);
        assert_eq!(exact(&text), 512.0);
        assert!(
            (sampled(&text) - (293.0 + 1534.0 / 7.0)).abs() < 1e-9,
            "{}",
            sampled(&text)
        );
    }

    #[test]
    fn every_byte_estimator_counts_the_tail_too() {
        // The fixed-width words above: 512 tokens counted in full, 512.14 sampled.
        let text = "abcdef ".repeat(512);
        assert_eq!(Estimator::every_byte().estimate_text_f64(&text), 512.0);
        assert_eq!(Estimator::every_byte().estimate_text(&text), 512);
        assert_eq!(Estimator::default().estimate_text(&text), 513);
    }

    #[test]
    fn windows_skip_the_bytes_between_them() {
        // Head of spaces-and-words, then a tail whose sampled windows hold words and
        // whose gaps hold digits: the estimate follows the windows, not the gaps.
        let head = "ab ".repeat(1366)[..SAMPLE_HEAD_BYTES as usize].to_string();
        let mut tail = String::new();
        while tail.len() < 8 * SAMPLE_STRIDE_BYTES as usize {
            let at = tail.len() as u64 % SAMPLE_STRIDE_BYTES;
            tail.push_str(if at < SAMPLE_WINDOW_BYTES + 8 {
                "ab "
            } else {
                "1 "
            });
        }
        let s = sampled(&(head.clone() + &tail));
        let e = exact(&(head + &tail));
        assert!(s < e * 0.8, "sampled {s} vs exact {e}");
    }
}
