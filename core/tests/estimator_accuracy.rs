//! Estimator accuracy against real BPE tokenizers (`tiktoken-rs` cl100k_base and o200k_base)
//! on every prompt in `../shared/data/prompts/` (ShareGPT first turns and the LMBenchmark
//! multi-round inputs). Asserts median |relative error| ≤ 10% and p90 ≤ 25% per tokenizer and
//! prints the table published in the README. Native only (tiktoken ships vocabularies).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly
#![cfg(not(target_family = "wasm"))]

mod common;

use kvroute_core::analysis::{analyze_bounded, ApiKind};
use kvroute_core::estimate::{estimate_with, CharClassCosts, Estimator};
use kvroute_core::prefix::PrefixConfig;

use kvroute_core::percentile::percentile as quantile;

struct Row {
    median: f64,
    p90: f64,
    p99: f64,
    bias: f64,
    n: usize,
}

fn errors(est: &[f64], truth: &[usize]) -> Row {
    let mut rel: Vec<f64> = Vec::new();
    let mut signed = 0.0;
    for (e, &t) in est.iter().zip(truth) {
        if t == 0 {
            continue;
        }
        let r = (e - t as f64) / t as f64;
        signed += r;
        rel.push(r.abs());
    }
    rel.sort_by(f64::total_cmp);
    Row {
        median: quantile(&rel, 0.5),
        p90: quantile(&rel, 0.9),
        p99: quantile(&rel, 0.99),
        bias: signed / rel.len() as f64,
        n: rel.len(),
    }
}

/// One row of the table in docs/core.md.
fn print_row(tokenizer: &str, subset: &str, r: &Row) {
    println!(
        "| {tokenizer} | {subset} | {} | {:.1}% | {:.1}% | {:.1}% | {:+.1}% |",
        r.n,
        r.median * 100.0,
        r.p90 * 100.0,
        r.p99 * 100.0,
        r.bias * 100.0
    );
}

/// The subset of prompts longer than 1 KiB: the ones the sampled tail
/// ([`kvroute_core::estimate::SAMPLE_HEAD_BYTES`]) can reach.
const OVER_1_KIB: &str = "over 1 KiB";

#[test]
fn estimator_within_targets_on_shared_prompts() {
    let prompts = common::all_prompts();
    assert!(
        prompts.len() >= 1000,
        "expected ≥1000 prompts, got {}",
        prompts.len()
    );
    let est = Estimator::default();
    let estimates: Vec<f64> = prompts
        .iter()
        .map(|(_, p)| est.estimate_text(p) as f64)
        .collect();
    println!("| tokenizer | subset | prompts | median abs rel err | p90 | p99 | mean signed err |");
    println!("|---|---|---|---|---|---|---|");
    for (name, bpe) in [
        ("cl100k_base", tiktoken_rs::cl100k_base().unwrap()),
        ("o200k_base", tiktoken_rs::o200k_base().unwrap()),
    ] {
        let truth: Vec<usize> = prompts
            .iter()
            .map(|(_, p)| bpe.encode_ordinary(p).len())
            .collect();
        for subset in [
            "all",
            "sharegpt_v3_filtered_1000",
            "lmbenchmark_run",
            "lmbenchmark_warmup",
            OVER_1_KIB,
        ] {
            let (e, t): (Vec<f64>, Vec<usize>) = prompts
                .iter()
                .zip(&estimates)
                .zip(&truth)
                .filter(|(((s, p), _), _)| match subset {
                    "all" => true,
                    OVER_1_KIB => p.len() > 1024,
                    _ => *s == subset,
                })
                .map(|((_, e), t)| (*e, *t))
                .unzip();
            let r = errors(&e, &t);
            print_row(name, subset, &r);
            if subset == "all" {
                assert!(r.median <= 0.10, "{name}: median {:.3} > 0.10", r.median);
                assert!(r.p90 <= 0.25, "{name}: p90 {:.3} > 0.25", r.p90);
            }
        }
    }
}

/// Grid search used to fit [`CharClassCosts::default`] against cl100k_base. Ignored by
/// default (slow); run with `cargo test -p kvroute-core --test estimator_accuracy -- --ignored
/// --nocapture` to refit after changing the heuristic.
#[test]
#[ignore]
fn fit_char_class_costs() {
    let prompts = common::all_prompts();
    let bpe = tiktoken_rs::cl100k_base().unwrap();
    let truth: Vec<usize> = prompts
        .iter()
        .map(|(_, p)| bpe.encode_ordinary(p).len())
        .collect();
    let mut best = (f64::MAX, CharClassCosts::default());
    for free in [6.0, 7.0, 8.0, 9.0, 10.0, 12.0] {
        for per in [3.0, 4.0, 5.0, 6.0] {
            for pm in [0.0, 0.25, 0.5, 1.0] {
                for ob in [0.25, 0.33, 0.5, 0.75] {
                    let c = CharClassCosts {
                        word_free_chars: free,
                        word_chars_per_token: per,
                        punct_more: pm,
                        other_byte: ob,
                        ..CharClassCosts::default()
                    };
                    let e: Vec<f64> = prompts
                        .iter()
                        .map(|(_, p)| estimate_with(&c, p).ceil())
                        .collect();
                    let r = errors(&e, &truth);
                    let loss = r.median + 0.5 * r.p90;
                    if loss < best.0 {
                        best = (loss, c);
                        println!(
                            "median {:.3} p90 {:.3} bias {:+.3}: {:?}",
                            r.median, r.p90, r.bias, c
                        );
                    }
                }
            }
        }
    }
}

/// Long prompts (issue 13): the shared prompts, in file order, joined (blank line between)
/// into texts just over 64 KiB each, as a long conversation or document would be. The
/// estimator must stay within the same targets there: its per-class costs do not drift with
/// length, and the analysis scans the whole text (only the prefix rendering is bounded).
#[test]
fn estimator_within_targets_on_prompts_over_64_kib() {
    let prompts = common::all_prompts();
    let mut long: Vec<String> = Vec::new();
    let mut cur = String::new();
    for (_, p) in &prompts {
        if !cur.is_empty() {
            cur.push_str("\n\n");
        }
        cur.push_str(p);
        if cur.len() > 64 * 1024 {
            long.push(std::mem::take(&mut cur));
        }
    }
    assert!(long.len() >= 10, "only {} long prompts", long.len());
    let est = Estimator::default();
    let estimates: Vec<f64> = long.iter().map(|p| est.estimate_text(p) as f64).collect();
    // As the filter estimates them: each prompt as a chat body, analysed with the
    // router's 16 KiB rendering, which skips the raw bytes between sampling windows
    // (`Scanner::skip_raw`); written by serde_json, and with every non-ASCII character
    // as a `\u` escape, as Python's `json.dumps` writes by default (`ensure_ascii`).
    // The chat template's overhead (role, priming) is not the tokenizer's.
    let through_analysis =
        |content: &dyn Fn(&str) -> serde_json::Value, escape: bool, texts: &[String]| {
            let tokens = |text: &str| {
                let body = chat_body(content(text));
                let body = if escape { ascii_escaped(&body) } else { body };
                analysed(&body, &est)
            };
            let overhead = tokens("");
            texts
                .iter()
                .map(|p| tokens(p) - overhead)
                .collect::<Vec<f64>>()
        };
    let text = |t: &str| serde_json::json!(t);
    // Each with a 2 MiB image (a base64 data URL) after it: the windows are spaced by the
    // text fed, not the body's size.
    let image = format!("data:image/png;base64,{}", "iVBORw0K".repeat(1 << 18));
    let with_image = |t: &str| {
        serde_json::json!([
            {"type": "text", "text": t},
            {"type": "image_url", "image_url": {"url": image}},
        ])
    };
    let rows = [
        ("over 64 KiB (joined)", estimates),
        (
            "over 64 KiB, chat body",
            through_analysis(&text, false, &long),
        ),
        (
            "over 64 KiB, chat body, ASCII-escaped",
            through_analysis(&text, true, &long),
        ),
        (
            "over 64 KiB, chat body with a 2 MiB image",
            through_analysis(&with_image, false, &long),
        ),
    ];
    // Prompts over 1 MiB: each is 16 of the texts above in a row, starting at each one in turn (so they overlap; the
    // same text starts one and ends another). Their truth is the parts' token counts plus
    // one token per blank line between them (BPE pre-splits at a blank line, so a join adds
    // the separator's token and merges nothing; not re-encoded: ~35 MiB of text).
    const PARTS: usize = 16;
    let huge_parts: Vec<Vec<usize>> = (0..long.len())
        .map(|k| (0..PARTS).map(|i| (k + i) % long.len()).collect())
        .collect();
    let huge: Vec<String> = huge_parts
        .iter()
        .map(|parts| {
            let texts: Vec<&str> = parts.iter().map(|&i| long[i].as_str()).collect();
            texts.join("\n\n")
        })
        .collect();
    assert!(huge.iter().all(|h| h.len() > 1 << 20));
    let huge_rows = [
        (
            "over 1 MiB (16 joined)",
            huge.iter()
                .map(|p| est.estimate_text(p) as f64)
                .collect::<Vec<_>>(),
        ),
        (
            "over 1 MiB, chat body",
            through_analysis(&text, false, &huge),
        ),
    ];
    for (name, bpe) in [
        ("cl100k_base", tiktoken_rs::cl100k_base().unwrap()),
        ("o200k_base", tiktoken_rs::o200k_base().unwrap()),
    ] {
        let truth: Vec<usize> = long.iter().map(|p| bpe.encode_ordinary(p).len()).collect();
        let join = bpe.encode_ordinary("\n\n").len();
        let huge_truth: Vec<usize> = huge_parts
            .iter()
            .map(|parts| parts.iter().map(|&i| truth[i]).sum::<usize>() + join * (PARTS - 1))
            .collect();
        let all = rows
            .iter()
            .map(|(n, e)| (n, e, &truth))
            .chain(huge_rows.iter().map(|(n, e)| (n, e, &huge_truth)));
        for (subset, estimates, truth) in all {
            let r = errors(estimates, truth);
            print_row(name, subset, &r);
            assert!(
                r.median <= 0.10,
                "{name} {subset}: median {:.3} > 0.10",
                r.median
            );
            assert!(r.p90 <= 0.25, "{name} {subset}: p90 {:.3} > 0.25", r.p90);
        }
    }
}

/// A chat body with one user message of `content` (a string or content parts), as
/// serde_json writes it.
fn chat_body(content: serde_json::Value) -> String {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
        .to_string()
}

/// Prompt tokens of a chat `body` through the request analysis, with the router's 16 KiB
/// rendering (which skips the raw bytes between sampling windows past it).
fn analysed(body: &str, est: &Estimator) -> f64 {
    let limit = PrefixConfig::default().max_bytes();
    analyze_bounded(ApiKind::ChatCompletions, body.as_bytes(), est, limit)
        .unwrap()
        .prompt_tokens as f64
}

/// JSON text with every non-ASCII character written as `\uXXXX` (a surrogate pair above
/// U+FFFF), as Python's `json.dumps` writes it by default. Non-ASCII characters only occur
/// inside strings in JSON, so escaping them leaves the document's meaning unchanged.
fn ascii_escaped(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// Long texts whose kind changes along the way, against counting every byte with the same
/// heuristic (`Estimator::every_byte`), as a text and as a chat body (`\u`-escaped where
/// marked, as `json.dumps` writes it). Cases a breaker built against sampling schemes tried
/// and not adopted (docs/core.md, "Sampled tail"), with what those gave: the escaped
/// Cyrillic body +13 %, CJK before or after English −17 % / +20 % and −7.6 %, English then
/// hex lines −12 % to −52 %. One window per 8 KiB with one escape ratio gives −0.1 %,
/// +1.6 %, +2.4 %, +2.5 % and 0 % (bounds a point or two above).
#[test]
fn mixed_long_texts_are_sampled_close_to_counting_every_byte() {
    let prose: String = common::all_prompts()
        .into_iter()
        .map(|(_, p)| p)
        .collect::<Vec<_>>()
        .join("\n\n");
    let prose = |n: usize| {
        let mut end = n.min(prose.len());
        while !prose.is_char_boundary(end) {
            end -= 1;
        }
        prose[..end].to_string()
    };
    // Deterministic filler: CJK ideographs with punctuation, Cyrillic words, hex lines.
    let cjk = |n: usize| {
        let mut s = String::new();
        let mut k = 7u32;
        while s.len() < n {
            k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            match k >> 28 {
                0 => s.push('，'),
                1 => s.push_str("。\n"),
                _ => s.push(char::from_u32(0x4E00 + (k >> 8) % 0x5000).unwrap()),
            }
        }
        s
    };
    let cyrillic = |n: usize| "привет мир это тест ".repeat(n / 37 + 1);
    let hex = |n: usize| {
        let line: String = (0..4000)
            .map(|i| b"0123456789abcdef"[i * 7 % 16] as char)
            .collect();
        (line + "\n").repeat(n / 4001 + 1)
    };
    let est = Estimator::default();
    let every = Estimator::every_byte();
    let chat = |text: &str, escape: bool| {
        let body = chat_body(serde_json::json!(text));
        let body = if escape { ascii_escaped(&body) } else { body };
        (analysed(&body, &est), analysed(&body, &every))
    };
    let cases = [
        ("escaped Cyrillic, 1 MiB", cyrillic(1 << 20), true, 0.01),
        (
            "escaped CJK 300 KiB, then prose",
            cjk(300 << 10) + &prose(1200 << 10),
            true,
            0.03,
        ),
        (
            "prose, then escaped CJK 300 KiB",
            prose(1200 << 10) + &cjk(300 << 10),
            true,
            0.04,
        ),
        (
            "prose 200 KiB, then hex lines",
            prose(200 << 10) + &hex(800 << 10),
            false,
            0.04,
        ),
        ("hex lines, 1 MiB", hex(1 << 20), false, 0.01),
    ];
    for (name, text, escape, bound) in cases {
        let (sampled, exact) = chat(&text, escape);
        let dev = (sampled - exact) / exact;
        println!(
            "{name}: sampled {sampled} every byte {exact} ({:+.2} %)",
            dev * 100.0
        );
        assert!(dev.abs() <= bound, "{name}: {:+.2} %", dev * 100.0);
        let (s, e) = (est.estimate_text_f64(&text), every.estimate_text_f64(&text));
        assert!((s - e).abs() <= bound * e, "{name}, as text: {s} vs {e}");
    }
}
