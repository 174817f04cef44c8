//! Golden tests over every request body in `../shared/data/requests/`.
//!
//! Provenance: the bodies were written for this project (see `../shared/data/README.md`,
//! "requests/"). The expected values below were checked by hand against each body:
//! model, `n`, `stream`, the output limit (`max_completion_tokens` wins over `max_tokens`;
//! `max_output_tokens` for Responses; 0 for embeddings; TGI `parameters.max_new_tokens`),
//! media counts, `cache_salt` presence and token-id exactness are read off the JSON. The
//! prompt-token range brackets the `cl100k_base` count of the rendered conversation
//! (plus 3 tokens per message + 3, plus 576 per image) within about ±25%. The block count
//! is ⌊len(prefix text) / 64⌋ of the rendering documented in `analysis.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

mod common;

use kvroute_core::analysis::{analyze, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::prefix::{block_hashes, PrefixConfig};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

struct Golden {
    file: &'static str,
    api: ApiKind,
    model: Option<&'static str>,
    n: u32,
    stream: bool,
    max_output: Option<u32>,
    tokens: (u64, u64),
    exact: bool,
    blocks: usize,
    images: u32,
    salt: bool,
}

const L8: Option<&str> = Some("meta-llama/Llama-3.1-8B-Instruct");
const VL: Option<&str> = Some("Qwen/Qwen2.5-VL-7B-Instruct");

#[rustfmt::skip]
fn table() -> Vec<Golden> {
    use ApiKind::*;
    let g = |file, api, model, n, stream, max_output, tokens, exact, blocks, images, salt| Golden {
        file, api, model, n, stream, max_output, tokens, exact, blocks, images, salt,
    };
    vec![
        g("01_chat_minimal.json", ChatCompletions, L8, 1, false, None, (10, 18), false, 0, 0, false),
        g("02_chat_system_multiturn.json", ChatCompletions, L8, 1, false, Some(256), (70, 110), false, 5, 0, false),
        g("03_chat_developer_role_reasoning.json", ChatCompletions, Some("o4-mini"), 1, false, Some(2000), (33, 55), false, 2, 0, false),
        g("04_chat_content_text_parts.json", ChatCompletions, L8, 1, false, Some(64), (50, 85), false, 4, 0, false),
        g("05_chat_image_url_http.json", ChatCompletions, VL, 1, false, Some(300), (580, 600), false, 1, 1, false),
        g("06_chat_image_base64_datauri.json", ChatCompletions, VL, 1, false, Some(32), (580, 600), false, 1, 1, false),
        g("08_chat_multi_image_interleaved.json", ChatCompletions, VL, 1, false, Some(100), (1160, 1195), false, 2, 2, false),
        g("09_chat_tools_auto.json", ChatCompletions, L8, 1, false, Some(256), (250, 400), false, 18, 0, false),
        g("10_chat_tool_call_roundtrip.json", ChatCompletions, L8, 1, false, Some(200), (300, 470), false, 21, 0, false),
        g("11_chat_tool_choice_named.json", ChatCompletions, L8, 1, false, None, (150, 250), false, 11, 0, false),
        g("12_chat_stream_include_usage.json", ChatCompletions, L8, 1, true, Some(60), (8, 16), false, 0, 0, false),
        g("14_chat_max_tokens_legacy.json", ChatCompletions, L8, 1, false, Some(16), (8, 16), false, 0, 0, false),
        g("15_chat_both_max_fields.json", ChatCompletions, L8, 1, false, Some(512), (8, 16), false, 0, 0, false),
        g("16_chat_response_format_json_schema.json", ChatCompletions, L8, 1, false, Some(200), (22, 36), false, 1, 0, false),
        g("17_chat_response_format_json_object.json", ChatCompletions, L8, 1, false, Some(50), (24, 38), false, 1, 0, false),
        g("18_chat_vllm_extra_params.json", ChatCompletions, Some("Qwen/Qwen3-8B"), 1, false, Some(8), (14, 26), false, 1, 0, true),
        g("19_chat_assistant_prefill_continue.json", ChatCompletions, L8, 1, false, Some(80), (19, 32), false, 1, 0, false),
        g("20_chat_shared_long_system_a.json", ChatCompletions, L8, 1, false, Some(120), (1000, 1300), false, 58, 0, false),
        g("21_chat_shared_long_system_b.json", ChatCompletions, L8, 1, false, Some(120), (1000, 1300), false, 58, 0, false),
        g("22_chat_stop_penalties_misc.json", ChatCompletions, L8, 1, false, Some(100), (12, 20), false, 0, 0, false),
        g("23_chat_unicode_cjk_emoji.json", ChatCompletions, Some("Qwen/Qwen2.5-7B-Instruct"), 1, false, Some(150), (45, 75), false, 2, 0, false),
        g("24_chat_audio_output_modalities.json", ChatCompletions, Some("gpt-4o-audio-preview"), 1, false, None, (10, 18), false, 0, 0, false),
        g("26_completions_prompt_string.json", Completions, L8, 1, false, Some(128), (5, 10), false, 0, 0, false),
        g("27_completions_prompt_string_array.json", Completions, L8, 2, false, Some(16), (18, 30), false, 1, 0, false),
        g("28_completions_prompt_token_ids.json", Completions, L8, 1, false, Some(8), (6, 6), true, 0, 0, false),
        g("30_completions_stream_echo_logprobs_suffix.json", Completions, Some("bigcode/starcoder2-7b"), 1, true, Some(64), (4, 12), false, 0, 0, false),
        g("31_embeddings_single_string.json", Embeddings, Some("BAAI/bge-m3"), 1, false, Some(0), (9, 15), false, 0, 0, false),
        g("33_embeddings_token_ids.json", Embeddings, Some("BAAI/bge-m3"), 1, false, Some(0), (7, 7), true, 0, 0, false),
        g("34_responses_string_input.json", Responses, Some("gpt-4.1"), 1, false, Some(100), (19, 32), false, 1, 0, false),
        g("35_responses_multimodal_items.json", Responses, Some("gpt-4.1"), 1, false, Some(200), (585, 610), false, 1, 1, false),
        g("36_responses_function_call_roundtrip.json", Responses, Some("gpt-4.1"), 1, false, None, (130, 220), false, 9, 0, false),
        g("38_tgi_native_generate.json", Other, None, 1, false, Some(64), (40, 70), false, 2, 0, false),
    ]
}

#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn every_shared_request_has_a_golden_row() {
    let files = common::list("requests");
    let t = table();
    let names: Vec<&str> = t.iter().map(|g| g.file).collect();
    for f in &files {
        assert!(
            names.contains(&f.as_str()),
            "no golden row for requests/{f}"
        );
    }
    assert_eq!(
        files.len(),
        t.len(),
        "golden rows for files that do not exist"
    );
}

#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn golden_requests_analyse_as_expected() {
    let est = Estimator::default();
    for g in table() {
        let body = common::read(&format!("requests/{}", g.file));
        let a = analyze(g.api, &body, &est).unwrap_or_else(|e| panic!("{}: {e}", g.file));
        assert_eq!(a.api, g.api, "{}", g.file);
        assert_eq!(a.model.as_deref(), g.model, "{}", g.file);
        assert_eq!(a.n, g.n, "{}", g.file);
        assert_eq!(a.stream, g.stream, "{}", g.file);
        assert_eq!(a.max_output_tokens, g.max_output, "{}", g.file);
        assert!(
            (g.tokens.0..=g.tokens.1).contains(&a.prompt_tokens),
            "{}: prompt tokens {} outside {:?}",
            g.file,
            a.prompt_tokens,
            g.tokens
        );
        assert_eq!(a.prompt_tokens_exact, g.exact, "{}", g.file);
        assert_eq!(a.media.images, g.images, "{}", g.file);
        assert_eq!(a.cache_salt.is_some(), g.salt, "{}", g.file);
        let hashes = block_hashes(
            a.model.as_deref().unwrap_or(""),
            a.cache_salt.as_deref(),
            &a.prefix_text,
            &PrefixConfig::default(),
        );
        assert_eq!(hashes.len(), g.blocks, "{}: block count", g.file);
    }
}

#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn chat_bodies_sent_to_the_wrong_api_fail_with_the_missing_field() {
    let est = Estimator::default();
    let body = common::read("requests/01_chat_minimal.json");
    let e = analyze(ApiKind::Completions, &body, &est).unwrap_err();
    assert_eq!(e.to_string(), "missing required field `prompt`");
    let e = analyze(ApiKind::Responses, &body, &est).unwrap_err();
    assert_eq!(e.to_string(), "missing required field `input`");
    let tgi = common::read("requests/38_tgi_native_generate.json");
    let e = analyze(ApiKind::ChatCompletions, &tgi, &est).unwrap_err();
    assert_eq!(e.to_string(), "missing required field `model`");
}

#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn shared_long_system_prompt_pair_shares_leading_blocks() {
    let est = Estimator::default();
    let cfg = PrefixConfig::default();
    let an = |f: &str| analyze(ApiKind::ChatCompletions, &common::read(f), &est).unwrap();
    let (ta, tb) = (
        an("requests/20_chat_shared_long_system_a.json"),
        an("requests/21_chat_shared_long_system_b.json"),
    );
    assert_ne!(ta.prefix_text, tb.prefix_text, "different user turns");
    let a = block_hashes(L8.unwrap(), None, &ta.prefix_text, &cfg);
    let b = block_hashes(L8.unwrap(), None, &tb.prefix_text, &cfg);
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    // The 3,696-character system prompt is identical (+ the 11-byte `<|system|>\n` marker):
    // at least ⌊3707 / 64⌋ = 57 leading blocks are shared.
    assert!(shared >= 57, "shared {shared} of {} blocks", a.len());
    // A different cache_salt shares nothing.
    let salted = block_hashes(L8.unwrap(), Some("tenant-b"), &tb.prefix_text, &cfg);
    assert_eq!(a.iter().zip(&salted).take_while(|(x, y)| x == y).count(), 0);
}
