//! Snapshot wire format and validation; model profiles and KV demand.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

use kvroute_core::analysis::{analyze, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::profile::{builtin, builtin_profiles};
use kvroute_core::snapshot::{
    check_address, restamp, EndpointStats, Snapshot, SnapshotError, FORMAT_VERSION, MAX_LABEL_BYTES,
};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn ep(id: &str) -> EndpointStats {
    EndpointStats {
        id: id.into(),
        address: "[::1]:8000".into(),
        cluster: "c".into(),
        pool: "p".into(),
        lora_adapters: vec!["lora-a".into()],
        kv_usage: Some(0.25),
        kv_capacity_tokens: Some(1000),
        running: 2,
        waiting: 1,
        ..EndpointStats::fixture(0, 5)
    }
}

#[test]
fn snapshot_round_trips_exactly() {
    let s = Snapshot::new(42, 1000, vec![ep("a"), ep("b")]);
    let bytes = s.encode();
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.starts_with(r#"{"format":1,"version":42,"generated_at_ms":1000,"endpoints":[{"id":"a","address":"[::1]:8000""#), "{text}");
    assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
    assert_eq!(FORMAT_VERSION, 1);
}

#[test]
fn snapshot_validation_rejects_bad_values() {
    let with = |f: &dyn Fn(&mut EndpointStats)| {
        let mut e = ep("a");
        f(&mut e);
        Snapshot::new(1, 1, vec![ep("z"), e]).validate()
    };
    let invalid = |field: &'static str, reason: &'static str| {
        Err(SnapshotError::InvalidEndpoint {
            index: 1,
            id: "a".into(),
            field,
            reason,
        })
    };
    assert_eq!(
        with(&|e| e.kv_usage = Some(f64::NAN)),
        invalid("kv_usage", "is not a finite number")
    );
    assert_eq!(
        with(&|e| e.kv_usage = Some(-0.1)),
        invalid("kv_usage", "is negative")
    );
    assert_eq!(
        with(&|e| e.kv_usage = Some(1.01)),
        invalid("kv_usage", "is greater than 1")
    );
    assert_eq!(with(&|e| e.kv_usage = Some(1.0)), Ok(()));
    assert_eq!(
        with(&|e| e.id = String::new()),
        Err(SnapshotError::InvalidEndpoint {
            index: 1,
            id: String::new(),
            field: "id",
            reason: "is empty"
        })
    );
    assert_eq!(
        with(&|e| e.address = "::1:80".into()),
        invalid("address", "has an IPv6 host without brackets")
    );
    assert_eq!(
        with(&|e| e.address = "host".into()),
        invalid("address", "has no `:port`")
    );
    assert_eq!(
        with(&|e| e.address = "host:0".into()),
        invalid("address", "has an invalid port (expected 1..=65535)")
    );
    assert_eq!(
        with(&|e| e.block_size = Some(0)),
        invalid("block_size", "is zero")
    );
    assert_eq!(
        with(&|e| e.cluster = String::new()),
        invalid("cluster", "is empty")
    );
    // Strings that become header values must not carry control characters (header
    // injection: found by QA with `"cluster":"bad\r\nx-inject: 1"`).
    assert_eq!(
        with(&|e| e.cluster = "bad\r\nx-inject: 1".into()),
        invalid("cluster", "contains a control character")
    );
    assert_eq!(
        with(&|e| e.pool = "p\0".into()),
        invalid("pool", "contains a control character")
    );
    assert_eq!(
        with(&|e| e.models = vec!["m\n".into()]),
        invalid("models", "contains a control character")
    );
    assert_eq!(
        with(&|e| e.lora_adapters = vec!["l\u{7f}".into()]),
        invalid("lora_adapters", "contains a control character")
    );
    assert_eq!(
        with(&|e| e.address = "ho\u{1}st:80".into()),
        invalid("address", "has an invalid host")
    );
    // Every name is bounded (found by a breaker: a 200 KiB id went into each routed
    // request's decision header): MAX_LABEL_BYTES passes, one byte more does not.
    let at_bound = "x".repeat(MAX_LABEL_BYTES);
    let over = "x".repeat(MAX_LABEL_BYTES + 1);
    assert_eq!(with(&|e| e.cluster = at_bound.clone()), Ok(()));
    for field in ["cluster", "pool", "models", "lora_adapters"] {
        let set = |e: &mut EndpointStats| match field {
            "cluster" => e.cluster = over.clone(),
            "pool" => e.pool = over.clone(),
            "models" => e.models = vec![over.clone()],
            _ => e.lora_adapters = vec![over.clone()],
        };
        assert_eq!(
            with(&set),
            invalid(field, "is longer than 1024 bytes"),
            "{field}"
        );
    }
    let long_host = format!("{}:80", "h".repeat(MAX_LABEL_BYTES - 2));
    assert_eq!(long_host.len(), MAX_LABEL_BYTES + 1);
    assert_eq!(
        with(&|e| e.address = long_host.clone()),
        invalid("address", "is longer than 1024 bytes")
    );
    assert_eq!(
        Snapshot::new(1, 1, vec![ep(&over)]).validate(),
        Err(SnapshotError::InvalidEndpoint {
            index: 0,
            // The error quotes the id's first 256 bytes and its length (kvroute_core::echo).
            id: format!("{}… (1025 bytes in all)", "x".repeat(256)),
            field: "id",
            reason: "is longer than 1024 bytes"
        })
    );
    assert_eq!(
        Snapshot::new(1, 1, vec![ep("a\r")]).validate(),
        Err(SnapshotError::InvalidEndpoint {
            index: 0,
            id: "a\r".into(),
            field: "id",
            reason: "contains a control character"
        })
    );
    assert_eq!(
        with(&|e| e.id = "z".into()),
        Err(SnapshotError::DuplicateId("z".into()))
    );
    let mut s = Snapshot::new(1, 1, vec![]);
    s.format = 2;
    assert_eq!(
        s.validate(),
        Err(SnapshotError::UnsupportedFormat { found: 2 })
    );
    assert_eq!(
        Snapshot::decode(br#"{"format":2,"version":1,"generated_at_ms":0,"endpoints":[]}"#),
        Err(SnapshotError::UnsupportedFormat { found: 2 })
    );
    // Negative counts cannot be represented; NaN is not JSON: both fail to decode.
    let neg = String::from_utf8(Snapshot::new(1, 1, vec![ep("a")]).encode())
        .unwrap()
        .replace("\"running\":2", "\"running\":-2");
    assert!(matches!(
        Snapshot::decode(neg.as_bytes()),
        Err(SnapshotError::Decode(_))
    ));
    assert!(matches!(
        Snapshot::decode(b"not json"),
        Err(SnapshotError::Decode(_))
    ));
    assert!(matches!(
        Snapshot::decode(br#"{"format":1,"version":1,"generated_at_ms":0,"endpoints":[],"x":1}"#),
        Err(SnapshotError::Decode(_))
    ));
}

/// `unavailable_models` is left off the wire when empty (the bytes an older filter reads are
/// unchanged), written before `endpoints` when not, and round-trips either way; the
/// hand-written envelope writes what serde writes for the struct.
#[test]
fn unavailable_models_are_written_only_when_not_empty() {
    let empty = Snapshot::new(42, 1000, vec![]);
    assert_eq!(
        String::from_utf8(empty.encode()).unwrap(),
        r#"{"format":1,"version":42,"generated_at_ms":1000,"endpoints":[]}"#
    );
    assert_eq!(Snapshot::decode(&empty.encode()).unwrap(), empty);
    let mut idle = Snapshot::new(42, 1000, vec![]);
    idle.unavailable_models = vec!["llama".into(), "q\"wen/é".into()];
    let bytes = idle.encode();
    assert_eq!(
        String::from_utf8(bytes.clone()).unwrap(),
        r#"{"format":1,"version":42,"generated_at_ms":1000,"unavailable_models":["llama","q\"wen/é"],"endpoints":[]}"#
    );
    assert_eq!(Snapshot::decode(&bytes).unwrap(), idle);
    // With endpoints: the same bytes as serde's encoding of the struct, both ways.
    let mut both = Snapshot::new(7, 5, vec![ep("a"), ep("b")]);
    both.unavailable_models = vec!["m2".into()];
    assert_eq!(both.encode(), serde_json::to_vec(&both).unwrap());
    let plain = Snapshot::new(7, 5, vec![ep("a")]);
    assert_eq!(plain.encode(), serde_json::to_vec(&plain).unwrap());
    assert_eq!(Snapshot::decode(&both.encode()).unwrap(), both);
    // Names are checked like the endpoints' model names, and must not be empty.
    let mut bad = Snapshot::new(1, 1, vec![]);
    bad.unavailable_models = vec!["ok".into(), "m\r\nx: 1".into()];
    assert_eq!(
        Snapshot::decode(&bad.encode()),
        Err(SnapshotError::InvalidUnavailableModel {
            index: 1,
            reason: "contains a control character"
        })
    );
    bad.unavailable_models = vec!["m".repeat(MAX_LABEL_BYTES + 1)];
    assert_eq!(
        bad.validate(),
        Err(SnapshotError::InvalidUnavailableModel {
            index: 0,
            reason: "is longer than 1024 bytes"
        })
    );
    bad.unavailable_models = vec![String::new()];
    assert_eq!(
        bad.validate(),
        Err(SnapshotError::InvalidUnavailableModel {
            index: 0,
            reason: "is empty"
        })
    );
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "unavailable_models[0]: is empty"
    );
    // A list that is not of strings fails decoding.
    assert!(matches!(
        Snapshot::decode(
            br#"{"format":1,"version":1,"generated_at_ms":0,"unavailable_models":[1],"endpoints":[]}"#
        ),
        Err(SnapshotError::Decode(_))
    ));
}

#[test]
fn addresses() {
    for ok in [
        "10.0.0.1:8000",
        "[::1]:8000",
        "[fe80::1%eth0]:1",
        "model-0.svc:65535",
        "localhost:80",
    ] {
        assert_eq!(check_address(ok), Ok(()), "{ok}");
    }
    for bad in [
        "",
        ":80",
        "[]:80",
        "[::1]",
        "[::1]80",
        "h:+80",
        "h:65536",
        "a b:80",
        "[1.2.3.4]:80",
    ] {
        assert!(check_address(bad).is_err(), "{bad}");
    }
}

#[test]
fn builtin_profiles_match_config_json() {
    let p = builtin_profiles();
    assert_eq!(p.len(), 5);
    let want = [
        ("meta-llama/Llama-3.1-8B-Instruct", 131_072u64, 131_072u32),
        ("meta-llama/Llama-3.1-70B-Instruct", 327_680, 131_072),
        ("Qwen/Qwen3-32B", 262_144, 40_960),
        ("mistralai/Mistral-7B-Instruct-v0.3", 131_072, 32_768),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 23_040, 8_192),
    ];
    for (name, bytes, len) in want {
        let m = builtin(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(
            (m.kv_bytes_per_token(), m.max_model_len, m.block_size),
            (bytes, len, 16),
            "{name}"
        );
        assert!(
            m.source.starts_with("https://huggingface.co/") && m.source.ends_with("config.json")
        );
        assert!(m.weight_bytes > 0);
    }
    assert_eq!(
        builtin("meta-llama/Llama-3.1-8B-Instruct")
            .unwrap()
            .weight_bytes,
        16_060_522_496
    );
    // Aliases and case.
    assert_eq!(
        builtin("meta-llama/Meta-Llama-3.1-8B-Instruct")
            .unwrap()
            .name,
        "meta-llama/Llama-3.1-8B-Instruct"
    );
    assert_eq!(builtin("qwen3-32b").unwrap().name, "Qwen/Qwen3-32B");
    assert!(builtin("gpt-4o").is_none());
}

#[test]
fn demand_exact_values() {
    let m = builtin("meta-llama/Llama-3.1-8B-Instruct").unwrap();
    // 100 prompt, limit 200 × 0.5 = 100 expected output.
    let d = m.demand_for(100, 200, 1);
    assert_eq!(
        (d.prompt_tokens, d.expected_output_tokens, d.tokens),
        (100, 100, 200)
    );
    assert_eq!(d.bytes, 200 * 131_072);
    assert_eq!(d.blocks, 7 + 7); // ⌈100/16⌉ + ⌈100/16⌉
                                 // n = 3: prompt once, output three times.
    let d3 = m.demand_for(100, 200, 3);
    assert_eq!(
        (d3.expected_output_tokens, d3.tokens, d3.blocks),
        (300, 400, 7 + 21)
    );
    // Output capped by the context window: 8,192 − 8,000 = 192 per choice.
    let s = builtin("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap();
    let d = s.demand_for(8_000, 4_096, 1);
    assert_eq!((d.expected_output_tokens, d.tokens), (192, 8_192));
    // Saturating, never panicking.
    let d = m.demand_for(u64::MAX, u64::MAX, u32::MAX);
    assert_eq!(d.tokens, u64::MAX);
    // Via the analysis: no limit → the default 1024 → 512 expected.
    let a = analyze(ApiKind::ChatCompletions, br#"{"model":"meta-llama/Llama-3.1-8B-Instruct","n":2,"messages":[{"role":"user","content":"Hello world"}]}"#, &Estimator::default()).unwrap();
    assert_eq!(m.output_limit(&a), 1024);
    let d = m.demand(&a);
    assert_eq!(
        (d.prompt_tokens, d.expected_output_tokens, d.tokens),
        (8, 1024, 1032)
    );
}

#[test]
fn router_demand_chains_analysis_profile_and_hashes() {
    use kvroute_core::prefix::PrefixConfig;
    use kvroute_core::router::{RequestInfo, Router, RouterConfig};
    let router = Router::new(RouterConfig::default(), 0).unwrap();
    let est = Estimator::default();
    let cfg = PrefixConfig::default();
    let text = "x".repeat(130);
    let body = format!(
        r#"{{"model":"Qwen/Qwen3-32B","max_tokens":100,"n":2,"messages":[{{"role":"user","content":"{text}"}}]}}"#
    );
    let a = analyze(ApiKind::ChatCompletions, body.as_bytes(), &est).unwrap();
    let r = RequestInfo::from_analysis(a, &cfg);
    // "<|user|>\n" (9) + 130 + "\n" = 140 bytes → 2 blocks.
    assert_eq!(r.prefix_hashes.len(), 2);
    let (limit, d) = router.demand(&r);
    assert_eq!(limit, 100);
    assert_eq!(d.expected_output_tokens, 100);
    assert_eq!(d.bytes, d.tokens * 262_144);
    // Aliases and case resolve to the built-in profile.
    assert_eq!(
        router.profile(Some("qwen3-32b")).name,
        "Qwen/Qwen3-32B".to_string()
    );
    // Unknown model: the generic rule (⌈10 × 0.5⌉ output), no bytes.
    let body = br#"{"model":"unknown","prompt":[1,2,3],"max_tokens":10}"#;
    let a = analyze(ApiKind::Completions, body, &est).unwrap();
    let (_, d) = router.demand(&RequestInfo::from_analysis(a, &cfg));
    assert_eq!((d.tokens, d.bytes, d.blocks), (3 + 5, 0, 1 + 1));
}

/// A control plane 1 s ahead of the receiver, and one 3 s behind: the scrape ages
/// (generated − scraped) are kept, on the receiver's clock; a scrape after its snapshot is
/// capped at the receipt; a shift below 0 saturates.
#[test]
fn rebase_clock_keeps_scrape_ages_on_the_receivers_clock() {
    let at = |s: &Snapshot| -> Vec<u64> { s.endpoints.iter().map(|e| e.scraped_at_ms).collect() };
    let mut ahead = Snapshot::new(
        1,
        11_000,
        vec![
            EndpointStats::fixture(0, 10_800),
            EndpointStats::fixture(1, 11_000),
            EndpointStats::fixture(2, 11_500),
        ],
    );
    ahead.rebase_clock(10_000);
    assert_eq!(ahead.generated_at_ms, 10_000);
    assert_eq!(at(&ahead), [9_800, 10_000, 10_000]);
    ahead.rebase_clock(10_000);
    assert_eq!(at(&ahead), [9_800, 10_000, 10_000], "idempotent");
    let mut behind = Snapshot::new(
        2,
        7_000,
        vec![
            EndpointStats::fixture(0, 6_000),
            EndpointStats::fixture(1, 0),
        ],
    );
    behind.rebase_clock(10_000);
    assert_eq!(
        (behind.generated_at_ms, at(&behind)),
        (10_000, vec![9_000, 3_000])
    );
    let mut early = Snapshot::new(3, 5_000, vec![EndpointStats::fixture(0, 1_000)]);
    early.rebase_clock(2_000);
    assert_eq!(at(&early), [0]);
}

/// A snapshot that waited 5 s before it was sent, re-stamped at sending: the receiver's
/// rebase keeps each scrape's true age (without it, the age less the 5 s wait); the body is
/// otherwise the same bytes, and one that does not open as `write_envelope` writes it is
/// refused.
#[test]
fn restamp_moves_only_generated_at() {
    let snap = Snapshot::new(
        7,
        20_000,
        vec![
            EndpointStats::fixture(0, 19_000),
            EndpointStats::fixture(1, 19_500),
        ],
    );
    let body = snap.encode();
    let sent = restamp(&body, 25_000).unwrap();
    let text = String::from_utf8(sent.clone()).unwrap();
    assert_eq!(
        text,
        String::from_utf8(body.clone()).unwrap().replacen(
            "\"generated_at_ms\":20000",
            "\"generated_at_ms\":25000",
            1
        )
    );
    // Scrape ages once received on a clock 1 s behind the sender's, at its 25,000.
    let ages = |wire: &[u8]| -> Vec<u64> {
        let mut got = Snapshot::decode(wire).unwrap();
        got.rebase_clock(24_000);
        got.endpoints
            .iter()
            .map(|e| 24_000 - e.scraped_at_ms)
            .collect()
    };
    assert_eq!(ages(&sent), [6_000, 5_500]);
    assert_eq!(
        ages(&body),
        [1_000, 500],
        "not re-stamped: the 5 s wait hidden"
    );
    assert_eq!(restamp(b"{\"endpoints\":[]}", 1), None);
    assert_eq!(
        restamp(b"{\"format\":1,\"version\":1,\"generated_at_ms\":x}", 1),
        None
    );
}
