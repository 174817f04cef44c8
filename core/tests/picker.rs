//! Endpoint picker: exact selections per policy, filters, typed outcomes, config validation
//! and statistical bounds on the random choices.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

use kvroute_core::analysis::ApiKind;
use kvroute_core::picker::*;
use kvroute_core::snapshot::{EndpointStats, Snapshot};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;

fn ep(id: &str) -> EndpointStats {
    EndpointStats {
        id: id.into(),
        address: "10.0.0.1:8000".into(),
        cluster: format!("c-{id}"),
        pool: "default".into(),
        kv_usage: Some(0.0),
        process_start_ms: Some(1),
        ..EndpointStats::fixture(0, NOW)
    }
}

fn req(demand: u64) -> PickRequest<'static> {
    PickRequest {
        model: Some("m"),
        api: ApiKind::ChatCompletions,
        prompt_tokens: demand / 2,
        output_limit: demand / 2,
        demand_tokens: demand,
        prefix_blocks: 10,
    }
}

fn picker(policy: PolicyKind) -> Picker {
    Picker::new(
        PickerConfig {
            policy,
            ..PickerConfig::default()
        },
        7,
    )
    .unwrap()
}

fn pick_with(
    p: &mut Picker,
    snap: &Snapshot,
    inflight: &[InFlight],
    prefix: &[u32],
    r: &PickRequest<'_>,
) -> PickOutcome {
    p.pick(
        &PickInput {
            snapshot: snap,
            inflight,
            prefix_match_blocks: prefix,
            now_ms: NOW,
        },
        r,
    )
}

fn primary(o: &PickOutcome) -> usize {
    match o {
        PickOutcome::Picked(p) => p.primary,
        other => panic!("expected a pick, got {other:?}"),
    }
}

fn snap(eps: Vec<EndpointStats>) -> Snapshot {
    Snapshot::new(1, NOW, eps)
}

#[test]
fn round_robin_exact_sequence_and_fallbacks() {
    let s = snap(vec![ep("a"), ep("b"), ep("c")]);
    let mut p = picker(PolicyKind::RoundRobin);
    let picks: Vec<PickOutcome> = (0..4)
        .map(|_| pick_with(&mut p, &s, &[], &[], &req(10)))
        .collect();
    let prim: Vec<usize> = picks.iter().map(primary).collect();
    assert_eq!(prim, vec![0, 1, 2, 0]);
    match &picks[1] {
        PickOutcome::Picked(pk) => {
            assert_eq!(pk.fallbacks, vec![2, 0]);
            assert_eq!(pk.policy, PolicyKind::RoundRobin);
            assert_eq!(pk.reason, PickReason::Policy);
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn least_request_counts_snapshot_and_inflight() {
    let mut a = ep("a");
    a.running = 3;
    let mut b = ep("b");
    b.waiting = 1;
    let c = ep("c");
    let s = snap(vec![a, b, c]);
    let mut p = picker(PolicyKind::LeastRequest);
    // c is idle.
    assert_eq!(primary(&pick_with(&mut p, &s, &[], &[], &req(10))), 2);
    // With 2 in-flight on c, b (1 waiting) wins; fallbacks c then a.
    let infl = [
        InFlight::default(),
        InFlight::default(),
        InFlight {
            prefill_tokens: 0,
            requests: 2,
            tokens: 0,
        },
    ];
    match pick_with(&mut p, &s, &infl, &[], &req(10)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (1, vec![2, 0])),
        o => panic!("{o:?}"),
    }
}

#[test]
fn least_kv_uses_projected_usage_and_ranks_unknown_last() {
    let mut a = ep("a");
    a.kv_usage = Some(0.5);
    let mut b = ep("b");
    b.kv_usage = Some(0.2);
    let mut c = ep("c");
    c.kv_usage = None;
    let s = snap(vec![a, b, c]);
    let mut p = picker(PolicyKind::LeastKv);
    match pick_with(&mut p, &s, &[], &[], &req(10)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (1, vec![0, 2])),
        o => panic!("{o:?}"),
    }
    // 40k in-flight tokens on b (capacity 100k): projected 0.6 > 0.5.
    let infl = [
        InFlight::default(),
        InFlight {
            prefill_tokens: 0,
            requests: 1,
            tokens: 40_000,
        },
    ];
    assert_eq!(primary(&pick_with(&mut p, &s, &infl, &[], &req(10))), 0);
}

#[test]
fn prefix_affinity_prefers_longest_match_then_load() {
    let mut a = ep("a");
    a.running = 5;
    let b = ep("b");
    let c = ep("c");
    let s = snap(vec![a, b, c]);
    let mut p = picker(PolicyKind::PrefixAffinity);
    assert_eq!(
        primary(&pick_with(&mut p, &s, &[], &[8, 2, 0], &req(10))),
        0
    );
    // Equal match: lower load wins.
    let mut c2 = s.clone();
    c2.endpoints[1].running = 2;
    assert_eq!(
        primary(&pick_with(&mut p, &c2, &[], &[0, 4, 4], &req(10))),
        2
    );
}

#[test]
fn hybrid_exact_scores() {
    // Default weights kv 1, queue 1, inflight 1, prefill 2, prefix 2; capacity 100k;
    // demand 10k, prompt 5k, 10 blocks. Prefill work = uncached prompt tokens here
    // (a 0, b 5000, c 2500; max 5000).
    // a: usage 0.1, waiting 0, prefix 10/10 → 1·(1−0.1−0.1) + 1 + 1 + 2·1 + 2·1 = 6.8
    // b: usage 0.0, waiting 4             → 1·0.9 + 0 + 1 + 2·0 + 0 = 1.9
    // c: usage 0.5, waiting 2, prefix 5   → 1·0.4 + 0.5 + 1 + 2·0.5 + 1 = 3.9
    let mut a = ep("a");
    a.kv_usage = Some(0.1);
    let mut b = ep("b");
    b.waiting = 4;
    let mut c = ep("c");
    c.kv_usage = Some(0.5);
    c.waiting = 2;
    let s = snap(vec![a, b, c]);
    let mut p = picker(PolicyKind::Hybrid);
    match pick_with(&mut p, &s, &[], &[10, 0, 5], &req(10_000)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (0, vec![2, 1])),
        o => panic!("{o:?}"),
    }
    // Without prefix matches every work is 5000 (prefill term 0):
    // a = 0.8+1+1 = 2.8, b = 0.9+0+1 = 1.9, c = 0.4+0.5+1 = 1.9;
    // a wins; b and c tie on score and the secondary key (load: b 4, c 2) puts c first.
    match pick_with(&mut p, &s, &[], &[], &req(10_000)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (0, vec![2, 1])),
        o => panic!("{o:?}"),
    }
    // In-flight tokens move traffic: 60k reserved on a → headroom 1−0.1−0.7 = 0.2 and
    // in-flight term 0: a = 0.2+1+0 = 1.2 < b = c = 1.9; c has the lower load (2 < 4).
    let infl = [InFlight {
        prefill_tokens: 0,
        requests: 3,
        tokens: 60_000,
    }];
    match pick_with(&mut p, &s, &infl, &[], &req(10_000)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (2, vec![1, 0])),
        o => panic!("{o:?}"),
    }
}

#[test]
fn uncached_prompt_tokens_exact() {
    assert_eq!(uncached_prompt_tokens(5_000, 8, 10), 1_000);
    assert_eq!(uncached_prompt_tokens(5_000, 3, 10), 3_500);
    // Rounded up: 10 × 2 / 3 = 6.67.
    assert_eq!(uncached_prompt_tokens(10, 1, 3), 7);
    // No prefix information: nothing cached; a match longer than the request: all cached.
    assert_eq!(uncached_prompt_tokens(100, 0, 0), 100);
    assert_eq!(uncached_prompt_tokens(100, 12, 10), 0);
    assert_eq!(uncached_prompt_tokens(u64::MAX, 0, 1), u64::MAX);
    assert_eq!(uncached_prompt_tokens(u64::MAX, 1, 2), u64::MAX / 2 + 1);
    // Products past u64 (the u128 path): 2^40 × (2^30 − 1) / 2^30 = 2^40 − 2^10.
    assert_eq!(uncached_prompt_tokens(u64::MAX, 0, 3), u64::MAX);
    assert_eq!(
        uncached_prompt_tokens(1 << 40, 1, 1 << 30),
        (1 << 40) - (1 << 10)
    );
}

/// a holds 8 of the request's 10 prefix blocks and has fewer requests, but 80k tokens of
/// prefill queued (one long prompt without a first token yet, reserved before the last scrape
/// so only its pending prefill is visible); b is busier by count (3 running) but has nothing
/// to prefill. Request: prompt 5k, demand 10k, capacity 100k.
#[test]
fn hybrid_pending_prefill_steers_away_from_prefix_holder() {
    let a = ep("a");
    let mut b = ep("b");
    b.running = 3;
    let s = snap(vec![a, b]);
    let mut p = picker(PolicyKind::Hybrid);
    let long_queue = [
        InFlight {
            requests: 0,
            tokens: 0,
            prefill_tokens: 80_000,
        },
        InFlight::default(),
    ];
    // work a = 80000 + 5000·2/10 = 81000, b = 5000 (max 81000):
    // a = 0.9 + 1 + 1 + 2·0 + 2·0.8 = 4.5
    // b = 0.9 + 1 + 1 + 2·(1 − 5000/81000) + 0 = 4.7765
    match pick_with(&mut p, &s, &long_queue, &[8, 0], &req(10_000)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (1, vec![0])),
        o => panic!("{o:?}"),
    }
    // Without the pending prefill a keeps the request (prefix and fewer requests):
    // work a = 1000, b = 5000: a = 0.9+1+1+2·0.8+1.6 = 6.1, b = 0.9+1+1+0+0 = 2.9.
    assert_eq!(
        primary(&pick_with(&mut p, &s, &[], &[8, 0], &req(10_000))),
        0
    );
    // The old signals alone (queue, requests, KV) cannot see the 80k: with the prefill
    // weight at 0, a wins on its prefix (a = 2.9 + 1.6 = 4.5 > b = 2.9).
    let mut no_prefill = Picker::new(
        PickerConfig {
            weights: HybridWeights {
                prefill: 0.0,
                ..HybridWeights::default()
            },
            ..PickerConfig::default()
        },
        7,
    )
    .unwrap();
    assert_eq!(
        primary(&pick_with(
            &mut no_prefill,
            &s,
            &long_queue,
            &[8, 0],
            &req(10_000)
        )),
        0
    );
}

/// The prefix saving outweighs a moderate prefill queue: a holds all 10 blocks with 4k
/// tokens pending, b holds none with nothing pending. work a = 4000 < b = 5000 (the
/// request's whole 5k prompt), as in Dynamo's cost: a = 0.9+1+1+2·0.2+2 = 5.3 beats
/// b = 0.9+1+1+0+0 = 2.9. With only 3 of 10 blocks on a, its work 4000 + 3500 = 7500
/// exceeds b's 5000: a = 0.9+1+1+0+0.6 = 3.5 < b = 2.9 + 2·(1 − 5000/7500) = 3.567.
#[test]
fn hybrid_prefix_saving_outweighs_moderate_pending_prefill() {
    let s = snap(vec![ep("a"), ep("b")]);
    let mut p = picker(PolicyKind::Hybrid);
    let infl = [
        InFlight {
            requests: 0,
            tokens: 0,
            prefill_tokens: 4_000,
        },
        InFlight::default(),
    ];
    match pick_with(&mut p, &s, &infl, &[10, 0], &req(10_000)) {
        PickOutcome::Picked(pk) => assert_eq!((pk.primary, pk.fallbacks), (0, vec![1])),
        o => panic!("{o:?}"),
    }
    assert_eq!(
        primary(&pick_with(&mut p, &s, &infl, &[3, 0], &req(10_000))),
        1
    );
}

#[test]
fn hybrid_with_unknown_kv_uses_queue_and_inflight() {
    let mut a = ep("a");
    a.kv_usage = None;
    a.kv_capacity_tokens = None;
    a.waiting = 3;
    let mut b = ep("b");
    b.kv_usage = None;
    b.kv_capacity_tokens = None;
    let s = snap(vec![a, b]);
    let mut p = picker(PolicyKind::Hybrid);
    assert_eq!(
        primary(&pick_with(&mut p, &s, &[], &[], &req(1_000_000))),
        1
    );
}

#[test]
fn filters_and_typed_outcomes() {
    let mut p = picker(PolicyKind::Hybrid);
    // No endpoint serves the model.
    let s = snap(vec![ep("a")]);
    let mut r = req(10);
    r.model = Some("other");
    assert_eq!(
        pick_with(&mut p, &s, &[], &[], &r),
        PickOutcome::NoEndpoints
    );
    assert_eq!(
        pick_with(&mut p, &snap(vec![]), &[], &[], &req(10)),
        PickOutcome::NoEndpoints
    );
    // LoRA adapters count as served models.
    let mut l = ep("l");
    l.lora_adapters = vec!["other".into()];
    assert_eq!(
        primary(&pick_with(&mut p, &snap(vec![ep("a"), l]), &[], &[], &r)),
        1
    );
    // Unhealthy only → no endpoints.
    let mut u = ep("u");
    u.healthy = false;
    assert_eq!(
        pick_with(&mut p, &snap(vec![u.clone()]), &[], &[], &req(10)),
        PickOutcome::NoEndpoints
    );
    // Full KV → no capacity; demand larger than the whole cache → no capacity.
    let mut full = ep("f");
    full.kv_usage = Some(0.95);
    assert_eq!(
        pick_with(&mut p, &snap(vec![full.clone()]), &[], &[], &req(10_000)),
        PickOutcome::NoCapacity
    );
    assert_eq!(
        pick_with(&mut p, &snap(vec![ep("a")]), &[], &[], &req(200_000)),
        PickOutcome::NoCapacity
    );
    // The one with room is chosen over the full one.
    assert_eq!(
        primary(&pick_with(
            &mut p,
            &snap(vec![full, ep("ok")]),
            &[],
            &[],
            &req(10_000)
        )),
        1
    );
    // min_kv_headroom: 0.2 required; usage 0.75 + 10% demand leaves 0.15 → no capacity.
    let mut q = Picker::new(
        PickerConfig {
            min_kv_headroom: 0.2,
            ..PickerConfig::default()
        },
        1,
    )
    .unwrap();
    let mut e = ep("e");
    e.kv_usage = Some(0.75);
    assert_eq!(
        pick_with(&mut q, &snap(vec![e]), &[], &[], &req(10_000)),
        PickOutcome::NoCapacity
    );
}

#[test]
fn stale_endpoints_only_when_nothing_is_fresh() {
    let mut stale = ep("s");
    stale.scraped_at_ms = NOW - 10_000;
    let mut p = picker(PolicyKind::Hybrid);
    // A fresh, healthy endpoint wins even if loaded.
    let mut fresh = ep("f");
    fresh.waiting = 50;
    fresh.kv_usage = Some(0.8);
    assert_eq!(
        primary(&pick_with(
            &mut p,
            &snap(vec![stale.clone(), fresh.clone()]),
            &[],
            &[],
            &req(10)
        )),
        1
    );
    // Fresh but full: no capacity, never the stale one.
    fresh.kv_usage = Some(1.0);
    assert_eq!(
        pick_with(
            &mut p,
            &snap(vec![stale.clone(), fresh]),
            &[],
            &[],
            &req(10)
        ),
        PickOutcome::NoCapacity
    );
    // All stale: least-request fallback.
    let mut stale2 = stale.clone();
    stale2.id = "s2".into();
    stale2.running = 4;
    match pick_with(&mut p, &snap(vec![stale2, stale]), &[], &[], &req(10)) {
        PickOutcome::Picked(pk) => {
            assert_eq!(
                (pk.primary, pk.reason, pk.policy),
                (1, PickReason::StaleFallback, PolicyKind::LeastRequest)
            );
            assert_eq!(pk.fallbacks, vec![0]);
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn request_classes_route_to_pools() {
    let short = RequestClass {
        name: "short".into(),
        pool: "qa".into(),
        max_prompt_tokens: Some(1000),
        ..Default::default()
    };
    let long = RequestClass {
        name: "long".into(),
        pool: "docs".into(),
        min_prompt_tokens: Some(1000),
        ..Default::default()
    };
    let cfg = PickerConfig {
        classes: vec![short, long],
        ..PickerConfig::default()
    };
    let mut p = Picker::new(cfg, 3).unwrap();
    let mut a = ep("a");
    a.pool = "qa".into();
    let mut b = ep("b");
    b.pool = "docs".into();
    let s = snap(vec![a, b]);
    let mut r = req(100);
    r.prompt_tokens = 50;
    match pick_with(&mut p, &s, &[], &[], &r) {
        PickOutcome::Picked(pk) => assert_eq!(
            (pk.primary, pk.class.as_deref(), pk.fallbacks.len()),
            (0, Some("short"), 0)
        ),
        o => panic!("{o:?}"),
    }
    r.prompt_tokens = 5000;
    r.demand_tokens = 6000;
    assert_eq!(primary(&pick_with(&mut p, &s, &[], &[], &r)), 1);
    // Class pool without endpoints: falls back to every pool.
    let only_qa = snap(vec![s.endpoints[0].clone()]);
    assert_eq!(primary(&pick_with(&mut p, &only_qa, &[], &[], &r)), 0);
    // Model and API bounds.
    let c = RequestClass {
        name: "emb".into(),
        pool: "e".into(),
        apis: vec![ApiKind::Embeddings],
        models: vec!["m".into()],
        ..Default::default()
    };
    assert!(!c.matches(&r));
    r.api = ApiKind::Embeddings;
    assert!(c.matches(&r));
    r.model = None;
    assert!(!c.matches(&r));
}

#[test]
fn config_validation_names_the_field() {
    let bad = |cfg: PickerConfig| Picker::new(cfg, 0).unwrap_err();
    let e = bad(PickerConfig {
        min_kv_headroom: 1.5,
        ..Default::default()
    });
    assert_eq!(
        (e.field.as_str(), e.value.as_str()),
        ("min_kv_headroom", "1.5")
    );
    let e = bad(PickerConfig {
        min_kv_headroom: f64::NAN,
        ..Default::default()
    });
    assert_eq!(e.field, "min_kv_headroom");
    let e = bad(PickerConfig {
        stale_after_ms: 0,
        ..Default::default()
    });
    assert_eq!(e.field, "stale_after_ms");
    let e = bad(PickerConfig {
        weights: HybridWeights {
            queue: -1.0,
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(
        e.to_string(),
        "picker config field `weights.queue` = -1: must be a number in 0..=1e6"
    );
    // A weight past MAX_WEIGHT (1e308 overflowed the score to infinity); MAX_WEIGHT itself
    // is accepted.
    let e = bad(PickerConfig {
        weights: HybridWeights {
            prefix: 1e308,
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(
        e.to_string(),
        "picker config field `weights.prefix` = 1e308: must be a number in 0..=1e6"
    );
    assert!(Picker::new(
        PickerConfig {
            weights: HybridWeights {
                prefix: kvroute_core::picker::MAX_WEIGHT,
                ..Default::default()
            },
            ..Default::default()
        },
        1
    )
    .is_ok());
    let e = bad(PickerConfig {
        classes: vec![RequestClass {
            name: "x".into(),
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!(e.field, "classes[0].pool");
    let e = bad(PickerConfig {
        classes: vec![RequestClass {
            name: "x".into(),
            pool: "p".into(),
            min_prompt_tokens: Some(5),
            max_prompt_tokens: Some(5),
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!(e.field, "classes[0].max_prompt_tokens");
    // Config parses from JSON with documented defaults; unknown fields are rejected.
    let cfg: PickerConfig =
        serde_json::from_str(r#"{"policy":"least_kv","weights":{"prefix":3}}"#).unwrap();
    assert_eq!(
        (
            cfg.policy,
            cfg.weights.prefix,
            cfg.weights.queue,
            cfg.stale_after_ms
        ),
        (PolicyKind::LeastKv, 3.0, 1.0, 2000)
    );
    // Configs written before the prefill-work weight existed get its default (2).
    assert_eq!(cfg.weights.prefill, 2.0);
    let e = bad(PickerConfig {
        weights: HybridWeights {
            prefill: f64::INFINITY,
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(e.field, "weights.prefill");
    assert!(serde_json::from_str::<PickerConfig>(r#"{"polcy":"random"}"#).is_err());
    assert_eq!(PolicyKind::PrefixAffinity.name(), "prefix_affinity");
}

/// Random policy: 4 equal endpoints, 8,000 picks. Each expected 2,000; the binomial standard
/// deviation is √(8000·¼·¾) ≈ 38.7, so ±200 is > 5σ (a fixed seed makes it deterministic).
#[test]
fn random_policy_is_uniform_within_statistical_bounds() {
    let s = snap(vec![ep("a"), ep("b"), ep("c"), ep("d")]);
    for seed in [1u64, 2, 3] {
        let mut p = Picker::new(
            PickerConfig {
                policy: PolicyKind::Random,
                ..Default::default()
            },
            seed,
        )
        .unwrap();
        let mut counts = [0u32; 4];
        for _ in 0..8000 {
            counts[primary(&pick_with(&mut p, &s, &[], &[], &req(10)))] += 1;
        }
        for c in counts {
            assert!((1800..=2200).contains(&c), "seed {seed}: {counts:?}");
        }
    }
}

/// Ties under `least_request` break at random: 3 identical endpoints share the load.
#[test]
fn ties_break_at_random_within_statistical_bounds() {
    let s = snap(vec![ep("a"), ep("b"), ep("c")]);
    let mut p = picker(PolicyKind::LeastRequest);
    let mut counts = [0u32; 3];
    for _ in 0..6000 {
        counts[primary(&pick_with(&mut p, &s, &[], &[], &req(10)))] += 1;
    }
    // Expected 2000 each; σ ≈ 36.5; ±200 > 5σ.
    for c in counts {
        assert!((1800..=2200).contains(&c), "{counts:?}");
    }
}

fn infl(requests: u32, tokens: u64, prefill_tokens: u64) -> InFlight {
    InFlight {
        requests,
        tokens,
        prefill_tokens,
    }
}

/// 10-block, 8 000-token prompt, 500 expected output tokens.
fn long_req() -> PickRequest<'static> {
    PickRequest {
        model: Some("m"),
        api: ApiKind::ChatCompletions,
        prompt_tokens: 8_000,
        output_limit: 500,
        demand_tokens: 8_500,
        prefix_blocks: 10,
    }
}

#[test]
fn predicted_ttft_terms_are_exact() {
    // Seed 15 928 tokens/s (llm-d default), step budget 8 192.
    let p = picker(PolicyKind::PredictedTtft);
    let mut a = ep("a");
    a.running = 2_048; // B − D = 6 144 → interference 8 192 / 6 144 = 4/3.
    a.kv_usage = Some(0.9); // free = 100 000 × 0.1 − 1 000 = 9 000 tokens.
    let s = snap(vec![a]);
    let inflight = [infl(0, 1_000, 4_000)];
    let input = PickInput {
        snapshot: &s,
        inflight: &inflight,
        prefix_match_blocks: &[5],
        now_ms: NOW,
    };
    let t = p.predict_ttft(&input, &long_req(), 0).unwrap();
    // uncached = 8 000 × 5 / 10 = 4 000; need 4 000 + 500 ≤ 9 000 → no shortfall.
    assert_eq!(t.pending_prefill_tokens, 4_000);
    assert_eq!(t.uncached_tokens, 4_000);
    assert_eq!(t.kv_shortfall_tokens, 0);
    assert!((t.interference - 4.0 / 3.0).abs() < 1e-12);
    assert_eq!(t.tokens_per_s, 15_928.0);
    assert!((t.effective_tokens - 8_000.0 * 4.0 / 3.0).abs() < 1e-9);
    assert!((t.seconds - 8_000.0 * 4.0 / 3.0 / 15_928.0).abs() < 1e-12);
    // Out of range: None.
    assert!(p.predict_ttft(&input, &long_req(), 1).is_none());
    // Full cache: usage 0.999 leaves 100 − 1 000 < 0 → 0 free; shortfall = 4 500.
    let mut b = ep("b");
    b.kv_usage = Some(0.999);
    let s = snap(vec![b]);
    let input = PickInput {
        snapshot: &s,
        inflight: &inflight,
        prefix_match_blocks: &[5],
        now_ms: NOW,
    };
    let t = p.predict_ttft(&input, &long_req(), 0).unwrap();
    assert_eq!(t.kv_shortfall_tokens, 4_500);
    assert!((t.effective_tokens - 12_500.0).abs() < 1e-9);
}

#[test]
fn predicted_ttft_is_sticky_until_the_prefix_holder_saturates() {
    let s = snap(vec![ep("a"), ep("b"), ep("c")]);
    let mut p = picker(PolicyKind::PredictedTtft);
    // a holds 9 of 10 blocks: 800 uncached tokens + 6 000 pending = 6 800 < 8 000 on the
    // idle endpoints → stays on a although it is the busiest.
    let busy = [infl(3, 0, 6_000), infl(0, 0, 0), infl(0, 0, 0)];
    let o = pick_with(&mut p, &s, &busy, &[9, 0, 0], &long_req());
    assert_eq!(primary(&o), 0);
    // 7 500 pending: 8 300 > 8 000 → an idle endpoint wins (b or c, both 8 000; b has fewer
    // outstanding requests).
    let busier = [infl(3, 0, 7_500), infl(0, 0, 0), infl(1, 0, 0)];
    let o = pick_with(&mut p, &s, &busier, &[9, 0, 0], &long_req());
    assert_eq!(primary(&o), 1);
}

#[test]
fn predicted_ttft_uses_the_learned_rate() {
    let s = snap(vec![ep("a"), ep("b")]);
    let mut p = picker(PolicyKind::PredictedTtft);
    // Equal work, but b was measured at half the seed's throughput: a wins.
    for _ in 0..200 {
        p.prefill_rates_mut().observe("b", 8_000.0, 1.0);
        p.prefill_rates_mut().observe("a", 8_000.0, 0.5);
    }
    let load = [infl(0, 0, 4_000), infl(0, 0, 2_000)];
    // a: (4 000 + 8 000) / 16 000 = 0.75 s; b: (2 000 + 8 000) / 8 000 = 1.25 s.
    let o = pick_with(&mut p, &s, &load, &[], &long_req());
    assert_eq!(primary(&o), 0);
    assert!((p.prefill_rates().tokens_per_s("b") - 8_000.0).abs() < 10.0);
}

#[test]
fn predicted_ttft_idle_fleet_degrades_to_least_request() {
    let mut a = ep("a");
    a.running = 1;
    let b = ep("b");
    let s = snap(vec![a, b]);
    let mut p = picker(PolicyKind::PredictedTtft);
    // No pending work anywhere: a's one running decode costs interference 8192/8191; b wins.
    let o = pick_with(&mut p, &s, &[], &[], &req(100));
    assert_eq!(primary(&o), 1);
}

#[test]
fn latency_config_is_validated() {
    let mut c = PickerConfig::default();
    c.latency.step_token_budget = 0;
    let e = Picker::new(c, 1).unwrap_err();
    assert_eq!(e.field, "latency.step_token_budget");
    let mut c = PickerConfig::default();
    c.latency.seed_prefill_tokens_per_s = f64::NAN;
    let e = Picker::new(c, 1).unwrap_err();
    assert_eq!(e.field, "latency.seed_prefill_tokens_per_s");
    // Below a token a second every predicted TTFT overflowed to infinity (1e-320).
    let mut c = PickerConfig::default();
    c.latency.seed_prefill_tokens_per_s = 1e-320;
    let e = Picker::new(c, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "picker config field `latency.seed_prefill_tokens_per_s` = 1e-320: must be a finite number >= 1"
    );
    let mut c = PickerConfig::default();
    c.latency.seed_prefill_tokens_per_s = kvroute_core::picker::MIN_SEED_PREFILL_TOKENS_PER_S;
    assert!(Picker::new(c, 1).is_ok());
}
