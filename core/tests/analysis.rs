//! Request analysis: exact values for each API and a typed error for each malformed shape.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

use kvroute_core::analysis::{analyze, AnalysisError, ApiKind, MediaCounts};
use kvroute_core::estimate::{Estimator, EstimatorConfig};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn est() -> Estimator {
    Estimator::default()
}

fn ok(api: ApiKind, body: &str) -> kvroute_core::analysis::RequestAnalysis {
    analyze(api, body.as_bytes(), &est()).unwrap_or_else(|e| panic!("{body}: {e}"))
}

fn err(api: ApiKind, body: &str) -> AnalysisError {
    analyze(api, body.as_bytes(), &est()).expect_err(body)
}

fn invalid(field: &str, expected: &'static str) -> AnalysisError {
    AnalysisError::InvalidField {
        field: field.into(),
        expected,
    }
}

#[test]
fn api_kind_from_path() {
    assert_eq!(
        ApiKind::from_path("/v1/chat/completions"),
        ApiKind::ChatCompletions
    );
    assert_eq!(
        ApiKind::from_path("/v1/chat/completions/?x=1"),
        ApiKind::ChatCompletions
    );
    assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
    assert_eq!(ApiKind::from_path("/v1/responses"), ApiKind::Responses);
    assert_eq!(ApiKind::from_path("/v1/embeddings"), ApiKind::Embeddings);
    assert_eq!(ApiKind::from_path("/generate"), ApiKind::Other);
}

#[test]
fn chat_minimal_exact_values() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":"Hello world"}]}"#,
    );
    assert_eq!(a.model.as_deref(), Some("m"));
    assert!(!a.stream);
    assert_eq!(a.n, 1);
    assert_eq!(a.max_output_tokens, None);
    // "Hello" + "world" = 2 text tokens, + 3 per message + 3 reply priming.
    assert_eq!(a.prompt_tokens, 8);
    assert!(!a.prompt_tokens_exact);
    assert_eq!(a.prefix_text, "<|user|>\nHello world\n");
    assert_eq!(a.cache_salt, None);
    assert_eq!(a.priority, 0);
    assert_eq!(a.media, MediaCounts::default());
}

#[test]
fn chat_fields_and_limits() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","stream":true,"n":3,"max_tokens":16,"max_completion_tokens":512,
            "cache_salt":"s","priority":-5,"temperature":0.2,"logit_bias":{"1":2},
            "messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Hi"}]}"#,
    );
    assert!(a.stream);
    assert_eq!(a.n, 3);
    assert_eq!(a.max_output_tokens, Some(512));
    assert_eq!(a.cache_salt.as_deref(), Some("s"));
    assert_eq!(a.priority, -5);
    // "Be"+"terse"+"." = 3, "Hi" = 1; 2 messages × 3 + 3.
    assert_eq!(a.prompt_tokens, 13);
    assert_eq!(a.prefix_text, "<|system|>\nBe terse.\n<|user|>\nHi\n");
    let b = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","max_tokens":16,"messages":[]}"#,
    );
    assert_eq!(b.max_output_tokens, Some(16));
    assert_eq!(b.prompt_tokens, 3);
    // Huge limits saturate instead of failing.
    let c = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","max_tokens":99999999999,"messages":[]}"#,
    );
    assert_eq!(c.max_output_tokens, Some(u32::MAX));
    // Explicit nulls mean "absent".
    let d = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","max_tokens":null,"stream":null,"messages":[]}"#,
    );
    assert_eq!(d.max_output_tokens, None);
}

#[test]
fn chat_parts_media_tools_and_tool_calls() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[
          {"role":"user","content":[{"type":"text","text":"Look"},
             {"type":"image_url","image_url":{"url":"https://x/a.png"}},
             {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},
             {"type":"video_url","video_url":{"url":"https://x/v.mp4"}}]},
          {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
             "function":{"name":"get","arguments":"{}"}}]},
          {"role":"tool","tool_call_id":"c1","content":"sunny"}]}"#,
    );
    assert_eq!(
        a.media,
        MediaCounts {
            images: 1,
            audio: 1,
            video: 1
        }
    );
    assert!(a.prefix_text.starts_with("<|tools|>\n[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]\n<|user|>\nLook<|image:"));
    assert!(a
        .prefix_text
        .contains("<|assistant|>\n<|tool_call|>get{}\n\n<|tool|>\nsunny\n"));
    let allow = &est().config.media;
    let media = u64::from(allow.image_tokens + allow.audio_tokens + allow.video_tokens);
    assert!(
        a.prompt_tokens > media && a.prompt_tokens < media + 40,
        "{}",
        a.prompt_tokens
    );
    // Different images hash differently, so they never share a prefix block.
    let b = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/b.png"}}]}]}"#,
    );
    let c = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/c.png"}}]}]}"#,
    );
    assert_ne!(b.prefix_text, c.prefix_text);
}

#[test]
fn completions_prompt_shapes() {
    let s = ok(
        ApiKind::Completions,
        r#"{"model":"m","prompt":"Hello world","max_tokens":7}"#,
    );
    assert_eq!(
        (s.prompt_tokens, s.prompt_tokens_exact, s.max_output_tokens),
        (2, false, Some(7))
    );
    assert_eq!(s.prefix_text, "Hello world");
    let arr = ok(
        ApiKind::Completions,
        r#"{"model":"m","prompt":["a b","c"]}"#,
    );
    assert_eq!(arr.prompt_tokens, 3);
    assert_eq!(arr.prefix_text, "a b\nc");
    let ids = ok(ApiKind::Completions, r#"{"model":"m","prompt":[1,22,333]}"#);
    assert_eq!((ids.prompt_tokens, ids.prompt_tokens_exact), (3, true));
    assert_eq!(ids.prefix_text, "1 22 333");
    let batch = ok(
        ApiKind::Completions,
        r#"{"model":"m","prompt":[[1,2],[3,4,5]]}"#,
    );
    assert_eq!((batch.prompt_tokens, batch.prompt_tokens_exact), (5, true));
    assert_eq!(batch.prefix_text, "1 2\n3 4 5");
}

#[test]
fn calibration_and_media_allowances_are_configurable() {
    let mut cfg = EstimatorConfig::default();
    cfg.calibration.insert("m".into(), 2.0);
    cfg.media.image_tokens = 10;
    let e = Estimator::new(cfg);
    let a = analyze(
        ApiKind::Completions,
        br#"{"model":"m","prompt":"Hello world"}"#,
        &e,
    )
    .unwrap();
    assert_eq!(a.prompt_tokens, 4);
    // Token ids are exact: no calibration.
    let ids = analyze(
        ApiKind::Completions,
        br#"{"model":"m","prompt":[1,2,3]}"#,
        &e,
    )
    .unwrap();
    assert_eq!(ids.prompt_tokens, 3);
    let img = analyze(
        ApiKind::ChatCompletions,
        br#"{"model":"other","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
        &e,
    )
    .unwrap();
    assert_eq!(img.prompt_tokens, 10 + 3 + 3);
}

#[test]
fn responses_and_embeddings() {
    let r = ok(
        ApiKind::Responses,
        r#"{"model":"g","instructions":"Be terse.","input":"Hi","max_output_tokens":100}"#,
    );
    assert_eq!(r.max_output_tokens, Some(100));
    assert_eq!(r.prefix_text, "<|system|>\nBe terse.\n<|user|>\nHi\n");
    assert_eq!(r.prompt_tokens, 13);
    let items = ok(
        ApiKind::Responses,
        r#"{"model":"g","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"},{"type":"input_image","image_url":"data:x"}]},
            {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
            {"type":"function_call_output","call_id":"c","output":"ok"}]}"#,
    );
    assert_eq!(items.media.images, 1);
    assert!(items
        .prefix_text
        .contains("<|function_call|>\n<|tool_call|>f{}\n<|function_call_output|>\nok\n"));
    let e = ok(
        ApiKind::Embeddings,
        r#"{"model":"e","input":"Hello world"}"#,
    );
    assert_eq!((e.prompt_tokens, e.max_output_tokens), (2, Some(0)));
    let e2 = ok(ApiKind::Embeddings, r#"{"model":"e","input":[[0,1],[2]]}"#);
    assert_eq!((e2.prompt_tokens, e2.prompt_tokens_exact), (3, true));
}

#[test]
fn other_paths_read_tgi_bodies_and_need_no_model() {
    let a = ok(
        ApiKind::Other,
        r#"{"inputs":"Hello world","parameters":{"max_new_tokens":64}}"#,
    );
    assert_eq!(
        (a.model, a.prompt_tokens, a.max_output_tokens),
        (None, 2, Some(64))
    );
    let b = ok(ApiKind::Other, r#"{}"#);
    assert_eq!((b.prompt_tokens, b.max_output_tokens), (0, None));
}

#[test]
fn malformed_bodies_name_the_field() {
    use ApiKind::*;
    let cases: Vec<(ApiKind, &str, AnalysisError)> = vec![
        (ChatCompletions, r#"{"messages":[]}"#, AnalysisError::MissingField { field: "model".into() }),
        (ChatCompletions, r#"{"model":"m"}"#, AnalysisError::MissingField { field: "messages".into() }),
        (ChatCompletions, r#"{"model":5,"messages":[]}"#, invalid("model", "a string")),
        (ChatCompletions, r#"{"model":"","messages":[]}"#, invalid("model", "a non-empty string")),
        (ChatCompletions, r#"{"model":"m","messages":{}}"#, invalid("messages", "an array of messages")),
        (ChatCompletions, r#"{"model":"m","messages":[1]}"#, invalid("messages[0]", "a message object")),
        (ChatCompletions, r#"{"model":"m","messages":[{"content":"x"}]}"#, AnalysisError::MissingField { field: "messages[0].role".into() }),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":"b"},{"role":"user","content":7}]}"#,
            invalid("messages[2].content", "a string or an array of content parts"),
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":3}]}]}"#,
            invalid("messages[0].content[0].text", "a string"),
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}"#,
            AnalysisError::MissingField { field: "messages[0].content[0].type".into() },
        ),
        (
            ChatCompletions,
            r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{}}}]}]}"#,
            invalid("messages[0].tool_calls[0].function.arguments", "a string"),
        ),
        (ChatCompletions, r#"{"model":"m","tools":{},"messages":[]}"#, invalid("tools", "an array of tool definitions")),
        (ChatCompletions, r#"{"model":"m","messages":[],"stream":"yes"}"#, invalid("stream", "a boolean")),
        (ChatCompletions, r#"{"model":"m","messages":[],"n":0}"#, invalid("n", "an integer of at least 1")),
        (ChatCompletions, r#"{"model":"m","messages":[],"max_tokens":-1}"#, invalid("max_tokens", "a non-negative integer")),
        (ChatCompletions, r#"{"model":"m","messages":[],"max_completion_tokens":1.5}"#, invalid("max_completion_tokens", "a non-negative integer")),
        (ChatCompletions, r#"{"model":"m","messages":[],"priority":"high"}"#, invalid("priority", "a 32-bit integer")),
        (ChatCompletions, r#"{"model":"m","messages":[],"cache_salt":1}"#, invalid("cache_salt", "a string")),
        (Completions, r#"{"model":"m","prompt":[]}"#, invalid("prompt", "a non-empty prompt")),
        (Completions, r#"{"model":"m","prompt":[1,-2]}"#, invalid("prompt", "an array of token ids (non-negative integers)")),
        (Completions, r#"{"model":"m","prompt":["a",2]}"#, invalid("prompt[1]", "a string")),
        (Completions, r#"{"model":"m","prompt":[[1],["x"]]}"#, invalid("prompt[1]", "an array of token ids")),
        (
            Completions,
            r#"{"model":"m","prompt":true}"#,
            invalid("prompt", "a string, an array of strings, an array of token ids, or an array of token-id arrays"),
        ),
        (Responses, r#"{"model":"m","input":5}"#, invalid("input", "a string or an array of input items")),
        (Responses, r#"{"model":"m","input":[{"call_id":"x"}]}"#, AnalysisError::MissingField { field: "input[0].type".into() }),
        (Embeddings, r#"{"model":"m"}"#, AnalysisError::MissingField { field: "input".into() }),
        (Other, r#"{"inputs":1}"#, invalid("inputs", "a string")),
    ];
    for (api, body, want) in cases {
        assert_eq!(err(api, body), want, "{body}");
    }
}

#[test]
fn invalid_json_reports_position() {
    match err(ApiKind::ChatCompletions, "{\n  \"model\": \"m\",\n  oops }") {
        AnalysisError::InvalidJson { line, column, .. } => assert_eq!((line, column), (3, 3)),
        e => panic!("{e:?}"),
    }
    for body in [
        "",
        "[1,2]",
        "\"str\"",
        "null",
        "{\"model\":\"m\"",
        "{\"model\":\"m\",\"messages\":[]} trailing",
    ] {
        assert!(
            matches!(
                err(ApiKind::ChatCompletions, body),
                AnalysisError::InvalidJson { .. }
            ),
            "{body:?}"
        );
    }
    match analyze(ApiKind::ChatCompletions, b"{\"model\":\"\xff\"}", &est()) {
        Err(AnalysisError::InvalidJson {
            line: 1,
            column: 11,
            message,
        }) => assert_eq!(message, "body is not valid UTF-8 at line 1 column 11"),
        r => panic!("{r:?}"),
    }
    // Deep nesting is captured as raw slices without recursion (no stack overflow), and a
    // deeply nested value where a content part belongs is a typed field error.
    let (open, close) = ("[".repeat(100_000), "]".repeat(100_000));
    let skipped = format!("{{\"model\":\"m\",\"messages\":[],\"x\":{open}{close}}}");
    let a =
        analyze(ApiKind::ChatCompletions, skipped.as_bytes(), &est()).map_err(|e| e.to_string());
    assert_eq!(a.map(|a| a.prompt_tokens), Ok(3));
    let inside = format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":{open}{close}}}]}}"
    );
    let e = analyze(ApiKind::ChatCompletions, inside.as_bytes(), &est()).map(|_| ());
    assert_eq!(
        e,
        Err(invalid("messages[0].content[0]", "a content part object"))
    );
}

#[test]
fn escaped_strings_are_decoded() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m\u0031","messages":[{"role":"user","content":"a\nb \"q\""}]}"#,
    );
    assert_eq!(a.model.as_deref(), Some("m1"));
    assert_eq!(a.prefix_text, "<|user|>\na\nb \"q\"\n");
}

#[test]
fn rendering_into_a_used_buffer_is_rendering_afresh() {
    use kvroute_core::analysis::{analyze_bounded, analyze_bounded_into};
    // The router hands each analysis the last one's prefix text to render into: a longer
    // one (with a multi-byte character and an escape), then one with no text at all.
    let long = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "é东京 \"quoted\" ".repeat(900)},
        {"role": "user", "content": "and a question?"}]})
    .to_string();
    let short = r#"{"model":"n","messages":[{"content":"hi","role":"user"}]}"#;
    let empty = r#"{"model":"n","prompt":""}"#;
    for limit in [16 * 1024, 100, usize::MAX] {
        let first =
            analyze_bounded(ApiKind::ChatCompletions, long.as_bytes(), &est(), limit).unwrap();
        assert!(first.prefix_text.len() >= 100.min(limit));
        let mut used = first.prefix_text;
        for (api, body) in [
            (ApiKind::ChatCompletions, short),
            (ApiKind::Completions, empty),
            (ApiKind::ChatCompletions, long.as_str()),
        ] {
            let again = analyze_bounded_into(api, body.as_bytes(), &est(), limit, used).unwrap();
            let fresh = analyze_bounded(api, body.as_bytes(), &est(), limit).unwrap();
            assert_eq!(again, fresh, "limit {limit}, {body:.40}");
            used = again.prefix_text;
        }
    }
}

#[test]
fn bounded_analysis_keeps_every_result_and_the_prefix_hashes() {
    use kvroute_core::analysis::analyze_bounded;
    use kvroute_core::prefix::{block_hashes, PrefixConfig};
    // ~300 KiB conversation with escapes, multi-byte characters and a 4-byte character
    // written as a surrogate pair, so the 16 KiB cut can fall inside a character.
    let turn = "Line one\nsays \"hi\" \\ and é东京 \u{1F600} then \t tabs 12345.\n";
    let messages: Vec<serde_json::Value> = (0..4000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": format!("{i}: {turn}")})
        })
        .collect();
    let mut body =
        serde_json::json!({"model": "m", "messages": messages, "max_tokens": 7}).to_string();
    body = body.replacen("\u{1F600}", "\\ud83d\\ude00", 3);
    let cfg = PrefixConfig::default();
    let full = analyze(ApiKind::ChatCompletions, body.as_bytes(), &est()).unwrap();
    assert!(full.prefix_text.len() > 200 * 1024);
    for limit in [cfg.max_bytes(), cfg.max_bytes() + 1, 1000, 1] {
        let b = analyze_bounded(ApiKind::ChatCompletions, body.as_bytes(), &est(), limit).unwrap();
        assert!(b.prefix_text.len() >= limit && b.prefix_text.len() < limit + 4);
        assert!(full.prefix_text.starts_with(&b.prefix_text));
        let mut rest = b.clone();
        rest.prefix_text = full.prefix_text.clone();
        // Past the rendering the bounded analysis skips raw bytes between the sampling
        // windows and takes the escapes' share out by the windows' ratio (`Scanner::skip_raw`):
        // 107,192 / 107,068 / 107,016 tokens at limits 16 KiB / 1000 / 1 against 107,041.
        let (got, want) = (b.prompt_tokens, full.prompt_tokens);
        assert!(
            got.abs_diff(want) * 200 <= want,
            "limit {limit}: {got} vs {want}"
        );
        rest.prompt_tokens = want;
        assert_eq!(rest, full, "limit {limit}");
    }
    let b = analyze_bounded(
        ApiKind::ChatCompletions,
        body.as_bytes(),
        &est(),
        cfg.max_bytes(),
    )
    .unwrap();
    let h = |t: &str| block_hashes("m", None, t, &cfg);
    assert_eq!(h(&b.prefix_text), h(&full.prefix_text));
    assert_eq!(h(&b.prefix_text).len(), cfg.max_blocks);
}

#[test]
fn escapes_decode_exactly_and_bad_ones_are_field_errors() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":"a\"b\\c\/d\b\f\n\r\t\u00e9\ud83d\ude00x"}]}"#,
    );
    assert_eq!(
        a.prefix_text,
        "<|user|>\na\"b\\c/d\u{8}\u{c}\n\r\té\u{1F600}x\n"
    );
    for bad in [r#""\ud83d""#, r#""\ude00x""#, r#""\ud83d\u0041""#] {
        let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":{bad}}}]}}"#);
        let e = analyze(ApiKind::ChatCompletions, body.as_bytes(), &est());
        assert!(
            matches!(&e, Err(AnalysisError::InvalidField { field, .. }) if field == "messages[0].content")
                || matches!(&e, Err(AnalysisError::InvalidJson { .. })),
            "{bad}: {e:?}"
        );
    }
}

/// The analysis counts with the estimator it is given: a long prompt is sampled past its
/// head by the default estimator and counted in full by `Estimator::every_byte` (the
/// simulator's model server), the same figures as `estimate_text` on the text alone.
#[test]
fn every_byte_estimator_counts_the_whole_prompt() {
    let text = "abcdef ".repeat(512);
    let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
    let full = analyze(
        ApiKind::Completions,
        body.as_bytes(),
        &Estimator::every_byte(),
    )
    .unwrap();
    assert_eq!(full.prompt_tokens, 512);
    assert_eq!(ok(ApiKind::Completions, &body).prompt_tokens, 513);
}

#[test]
fn requested_model_reads_only_the_model() {
    use kvroute_core::analysis::requested_model;
    // A body the analysis rejects (`n` as a string) still names its model.
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"n":"1"}"#;
    assert!(analyze(ApiKind::ChatCompletions, body, &Estimator::default()).is_err());
    assert_eq!(requested_model(body).as_deref(), Some("m"));
    assert_eq!(
        requested_model(br#"{"model":"a\/b\u00e9"}"#).as_deref(),
        Some("a/bé")
    );
    for none in [
        &b"{"[..],
        b"[]",
        br#"{"model":7}"#,
        br#"{"model":null}"#,
        b"{}",
        b"\xff",
    ] {
        assert_eq!(
            requested_model(none),
            None,
            "{:?}",
            String::from_utf8_lossy(none)
        );
    }
}

/// A repeated top-level `model` is read as Python's `json` (so vLLM's pydantic request
/// models) reads it: the last one counts, whether it repeats the same name or another, and
/// a last one that is not a string names no model. Keys are compared decoded
/// (`mod\u0065l` is `model`); a `model` key inside another value is not the request's.
#[test]
fn requested_model_takes_the_last_top_level_model() {
    use kvroute_core::analysis::requested_model;
    let dup = br#"{"model":"other","model":"other","messages":[]}"#;
    assert!(analyze(ApiKind::ChatCompletions, dup, &Estimator::default()).is_err());
    for (body, want) in [
        (&dup[..], Some("other")),
        (br#"{"model":"a","messages":[],"model":"b"}"#, Some("b")),
        (br#"{"model":"a","model":"b"}"#, Some("b")),
        (br#"{"model":"a"}"#, Some("a")),
        (
            br#"{"stream":true,"n":"1","messages":[{"role":"user","content":"hi"}],"model":"m"}"#,
            Some("m"),
        ),
        (
            br#"{"messages":[{"role":"user","content":"hi","model":"x"}],"model":"m","tools":[{"model":"y"}]}"#,
            Some("m"),
        ),
        (
            br#"{"messages":[{"role":"user","content":"hi","model":"x"}],"extra":{"model":"y"}}"#,
            None,
        ),
        (br#"{"model":"a","model":7}"#, None),
        (br#"{"model":"a","model":null}"#, None),
        (br#"{"model":"a","model":{"name":"b"}}"#, None),
        (br#"{"model":7,"model":"b"}"#, Some("b")),
        (br#"{"model":"a","model":"b"} x"#, None),
        // A key with a lone surrogate (which Python's `json` reads) names no model, and
        // does not hide the body's.
        (br#"{"\ud800":1,"model":"m"}"#, Some("m")),
        (br#"{"model":"m","x\udc00y":"\ud800"}"#, Some("m")),
        (br#"{"mod\u0065l":"m"}"#, Some("m")),
        (br#"{"model":"\ud800"}"#, None),
    ] {
        assert_eq!(
            requested_model(body).as_deref(),
            want,
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

/// Integer fields take a number with no fractional part (`256.0`, `2.56e2`), as vLLM's and
/// SGLang's pydantic request models do; a fraction, a negative number or a string is still an
/// error.
#[test]
fn integral_floats_are_integers() {
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[],"max_tokens":256.0,"n":2e0}"#,
    );
    assert_eq!((a.max_output_tokens, a.n), (Some(256), 2));
    let a = ok(
        ApiKind::Completions,
        r#"{"model":"m","prompt":"x","max_tokens":2.56e2}"#,
    );
    assert_eq!(a.max_output_tokens, Some(256));
    let a = ok(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[],"priority":-2.0}"#,
    );
    assert_eq!(a.priority, -2);
    // Past u32 a limit is capped, as an integer one is.
    let a = ok(
        ApiKind::Completions,
        r#"{"model":"m","prompt":"x","max_tokens":1e19}"#,
    );
    assert_eq!(a.max_output_tokens, Some(u32::MAX));
    for (body, field) in [
        (
            r#"{"model":"m","messages":[],"max_tokens":256.5}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","messages":[],"max_tokens":-1.0}"#,
            "max_tokens",
        ),
        (
            r#"{"model":"m","messages":[],"max_tokens":1e20}"#,
            "max_tokens",
        ),
        (r#"{"model":"m","messages":[],"n":"1"}"#, "n"),
    ] {
        assert_eq!(
            analyze(ApiKind::ChatCompletions, body.as_bytes(), &est()),
            Err(AnalysisError::InvalidField {
                field: field.into(),
                expected: "a non-negative integer"
            }),
            "{body}"
        );
    }
    for body in [
        r#"{"model":"m","messages":[],"priority":0.5}"#,
        r#"{"model":"m","messages":[],"priority":3e9}"#,
    ] {
        assert_eq!(
            analyze(ApiKind::ChatCompletions, body.as_bytes(), &est()),
            Err(AnalysisError::InvalidField {
                field: "priority".into(),
                expected: "a 32-bit integer"
            }),
            "{body}"
        );
    }
}

/// Compact JSON takes the scanner's masked-compare path for a message's keys, its role and
/// a text part (`Scanner::raw_match`); the same body pretty-printed takes the general
/// readers. Both give the same analysis, prefix text included.
#[test]
fn compact_and_pretty_bodies_agree() {
    let long = "word ".repeat(4000);
    let v = serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"content": [{"type": "text", "text": "first"}, {"text": long, "type": "text"}], "role": "user"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c"},
            {"role": "developer", "content": [{"type": "text", "text": "last"}]},
            {"role": "critic", "content": "a role of its own"},
        ],
        "max_tokens": 16
    });
    let compact = serde_json::to_vec(&v).unwrap();
    let pretty = serde_json::to_vec_pretty(&v).unwrap();
    for limit in [usize::MAX, 16 * 1024, 100, 1] {
        let a = kvroute_core::analysis::analyze_bounded(
            ApiKind::ChatCompletions,
            &compact,
            &est(),
            limit,
        )
        .unwrap();
        let b = kvroute_core::analysis::analyze_bounded(
            ApiKind::ChatCompletions,
            &pretty,
            &est(),
            limit,
        )
        .unwrap();
        assert_eq!(a, b, "limit {limit}");
    }
    let a = analyze(ApiKind::ChatCompletions, &compact, &est()).unwrap();
    assert!(
        a.prefix_text
            .starts_with("<|system|>\nBe brief.\n<|user|>\nfirst"),
        "{}",
        &a.prefix_text[..60]
    );
}

/// Past the 16 KiB rendering, the bytes between sampling windows are skipped raw: a defect
/// there (a control character, a bad escape, a lone surrogate, a byte that is not UTF-8)
/// goes unnoticed, and the body is estimated as if those bytes were plain text (the model
/// server still rejects it). The same defect in the rendering, or in a window, is an error.
#[test]
fn defects_between_sampling_windows_are_not_read() {
    use kvroute_core::analysis::analyze_bounded;
    use kvroute_core::estimate::{SAMPLE_HEAD_BYTES, SAMPLE_STRIDE_BYTES};
    use kvroute_core::prefix::PrefixConfig;
    let limit = PrefixConfig::default().max_bytes();
    // Text offsets: the third window starts at the head's end plus two strides (18,432:
    // past the 16 KiB rendering); 22,000 lies between it and the fourth.
    let window = (SAMPLE_HEAD_BYTES + 2 * SAMPLE_STRIDE_BYTES) as usize;
    assert_eq!((window, limit), (18_432, 16_384));
    let chat = |content: &str| {
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#)
    };
    let text = "ab ".repeat(20_000);
    // The chat body with `defect` over the text's bytes from `offset` on.
    let at = |offset: usize, defect: &[u8]| {
        let mut body = chat(&text).into_bytes();
        let start = body.windows(3).position(|w| w == b"ab ").unwrap() + offset;
        body[start..start + defect.len()].copy_from_slice(defect);
        body
    };
    let analyse = |body: &[u8]| analyze_bounded(ApiKind::ChatCompletions, body, &est(), limit);
    let defects: [&[u8]; 6] = [b"\x01", b"\\x", b"\\ud800", b"\xff", b"\x80", b"\xe4\xb8"];
    for defect in defects {
        let name = String::from_utf8_lossy(defect);
        // Between windows: estimated as the same bytes of plain text.
        let plain = analyse(&at(22_000, &b"z".repeat(defect.len()))).unwrap();
        let got = analyse(&at(22_000, defect)).unwrap_or_else(|e| panic!("{name:?}: {e}"));
        assert_eq!(got.prompt_tokens, plain.prompt_tokens, "{name:?}");
        assert_eq!(got.prefix_text, plain.prefix_text, "{name:?}");
        // In the rendering and in a window: read, so refused.
        for offset in [1_000, window + 100] {
            let e = analyse(&at(offset, defect)).expect_err(&name);
            let want_json = defect != b"\\ud800";
            assert_eq!(
                matches!(e, AnalysisError::InvalidJson { .. }),
                want_json,
                "{name:?} at {offset}: {e}"
            );
            if !want_json {
                assert_eq!(e, invalid("messages[0].content", "a string"));
            }
            if defect[0] >= 0x80 {
                // At the bad byte (the body is one line; the text starts at column 52).
                let column = 52 + offset;
                match e {
                    AnalysisError::InvalidJson {
                        line: 1,
                        column: c,
                        message,
                    } => {
                        assert_eq!(c, column, "{name:?} at {offset}: {message}");
                        assert!(message.starts_with("body is not valid UTF-8"), "{message}");
                    }
                    e => panic!("{name:?} at {offset}: {e}"),
                }
            }
        }
    }
}

/// A byte that is not UTF-8 anywhere in a body that is read whole (under 16 KiB: nothing
/// is skipped raw) is an `InvalidJson` error, inside a string at that byte: in keys, roles,
/// the rendering, skipped fields, kept tokens, under any prefix limit and with either
/// estimator.
#[test]
fn bytes_that_are_not_utf8_are_errors_where_read() {
    use kvroute_core::analysis::analyze_bounded;
    let bodies = [
        (
            ApiKind::ChatCompletions,
            r#"{"model":"m\u00e9","temperature":0.5,"x":{"k\u00e9y":["s\n","东"]},"tools":[{"type":"function","function":{"name":"f","parameters":{"a":"b"}}}],"messages":[{"content":"before role \"q\" é","role":"system"},{"role":"user","name":"ann","content":[{"type":"text","text":"part one\nwith 东京 text"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"custom","v":"w"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"g","arguments":"{\"q\":1}"}}]},{"role":"us\u0065r","content":"tail \u4e1c text that runs on for a while, past one 32-byte step"}],"stream":true}"#,
        ),
        (
            ApiKind::Completions,
            r#"{"model":"m","prompt":["first é prompt with some text","second \t one"],"max_tokens":5}"#,
        ),
        (
            ApiKind::Responses,
            r#"{"model":"m","instructions":"be brief é","input":[{"role":"user","content":[{"type":"input_text","text":"hi 东"}]},{"type":"function_call","name":"f","arguments":"{}"},{"type":"function_call_output","output":"out é"}]}"#,
        ),
    ];
    for (api, body) in bodies {
        let body = body.as_bytes();
        // The bytes inside strings, their quotes and backslashes excluded (a bad byte
        // there leaves the string's syntax as it was).
        let mut inside = vec![false; body.len()];
        let (mut in_string, mut escaped) = (false, false);
        for (i, &c) in body.iter().enumerate() {
            if escaped {
                escaped = false;
                inside[i] = true;
            } else if in_string && c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = !in_string;
            } else {
                inside[i] = in_string;
            }
        }
        for (i, &inside) in inside.iter().enumerate() {
            for bad in [0xFF, 0x80] {
                let mut b = body.to_vec();
                b[i] = bad;
                if std::str::from_utf8(&b).is_ok() {
                    // A continuation byte for another.
                    continue;
                }
                for limit in [usize::MAX, 16 * 1024, 37, 0] {
                    for estimator in [Estimator::every_byte(), est()] {
                        match analyze_bounded(api, &b, &estimator, limit) {
                            Err(AnalysisError::InvalidJson {
                                line: 1,
                                column,
                                message,
                            }) => {
                                if inside && body[i] < 0x80 {
                                    assert_eq!(column, i + 1, "{api:?} byte {i}, {message}");
                                }
                            }
                            r => panic!("{api:?} byte {i} = {bad:#x}, limit {limit}: {r:?}"),
                        }
                    }
                }
            }
        }
    }
}

/// Python's `json.dumps` (and `requests` / `aiohttp` with `json=`) writes `", "` and `": "`:
/// its keys are matched by their spaced patterns, with the same results as compact JSON.
#[test]
fn json_dumps_separators_read_as_compact_json() {
    let compact = r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"Be brief."},{"content":[{"type":"text","text":"Hi \"you\""},{"text":"there","type":"text"}],"role":"user"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}]}"#;
    let spaced = r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "Be brief."}, {"content": [{"type": "text", "text": "Hi \"you\""}, {"text": "there", "type": "text"}], "role": "user"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}"#;
    let a = ok(ApiKind::ChatCompletions, compact);
    assert_eq!(a, ok(ApiKind::ChatCompletions, spaced));
    assert_eq!(
        a.prefix_text,
        "<|system|>\nBe brief.\n<|user|>\nHi \"you\"there\n<|assistant|>\n<|tool_call|>f{}\n\n"
    );
}
