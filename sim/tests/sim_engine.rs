//! Engine-model tests in virtual time (no HTTP, no clock): prefix caching, KV usage,
//! preemption, priority, golden token timings, and a Mooncake trace replay.

// Test helpers outside #[test] fns may fail loudly too (clippy.toml only exempts #[test]).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_sim::engine::{Engine, EngineConfig, EngineEvent, SimRequest, SubmitError};
use kvroute_sim::kv::chain_hashes;
use kvroute_sim::perf::{perf_profile, StepTimeModel};
use kvroute_sim::trace::{load_mooncake, replay};

/// A step model with round numbers so timings can be derived by hand:
/// t = 1 ms + 5 ms + tokens · 10 µs (the additive form of `StepTimeModel::step_time`).
fn simple_step() -> StepTimeModel {
    StepTimeModel {
        overhead_s: 0.001,
        weight_read_s: 0.005,
        dense_s_per_token: 1e-5,
        attn_s_per_pair: 0.0,
        kv_read_s_per_token: 0.0,
    }
}

fn cfg(blocks: u32, budget: u32, step: StepTimeModel) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: blocks,
        block_size: 16,
        max_num_batched_tokens: budget,
        max_num_seqs: 256,
        priority_scheduling: false,
        step,
    }
}

fn req(id: u64, prompt: u32, output: u32, content: u64) -> SimRequest {
    SimRequest {
        id,
        prompt_tokens: prompt,
        output_tokens: output,
        block_hashes: chain_hashes(content, 0..u64::from(prompt / 16)),
        priority: 0,
    }
}

/// Run to idle; return (id, index, time, last) for every token.
fn run(e: &mut Engine) -> Vec<(u64, u32, f64, bool)> {
    let mut out = Vec::new();
    while let Some(r) = e.step() {
        for ev in r.events {
            if let EngineEvent::Token {
                id,
                index,
                time,
                last,
            } = ev
            {
                out.push((id, index, time, last));
            }
        }
    }
    out
}

fn first_token_time(tokens: &[(u64, u32, f64, bool)], id: u64) -> f64 {
    tokens
        .iter()
        .find(|t| t.0 == id && t.1 == 1)
        .map(|t| t.2)
        .unwrap()
}

#[test]
fn golden_token_timings() {
    // A: 32-token prompt, 3 outputs. B: 20-token prompt, 2 outputs. Budget 40 tokens/step.
    // Recomputed by hand for the additive step time t = 1 + 5 + tokens · 0.01 ms:
    // step 1: A prefill 32 + B chunk 8 = 40 tokens → 6.4 ms (t = 6.4 ms); A token 1.
    // step 2: A decode 1 + B rest 12 = 13 tokens → 6.13 ms (t = 12.53 ms); A token 2, B token 1.
    // step 3: A decode + B decode = 2 tokens → 6.02 ms (t = 18.55 ms); A token 3 (last),
    // B token 2 (last).
    let mut e = Engine::new(cfg(100, 40, simple_step()));
    e.submit(req(1, 32, 3, 1)).unwrap();
    e.submit(req(2, 20, 2, 2)).unwrap();
    let got = run(&mut e);
    let expect = [
        (1, 1, 0.0064, false),
        (1, 2, 0.01253, false),
        (2, 1, 0.01253, false),
        (1, 3, 0.01855, true),
        (2, 2, 0.01855, true),
    ];
    assert_eq!(got.len(), expect.len(), "{got:?}");
    for (g, x) in got.iter().zip(expect.iter()) {
        assert_eq!((g.0, g.1, g.3), (x.0, x.1, x.3));
        assert!((g.2 - x.2).abs() < 1e-12, "{g:?} vs {x:?}");
    }
    assert!(e.is_idle());
    assert_eq!(e.kv_usage(), 0.0);
    let c = e.counters();
    assert_eq!(c.prompt_tokens, 52);
    assert_eq!(c.generation_tokens, 5);
    assert_eq!(c.steps, 3);
    assert_eq!(c.finished, 2);
}

#[test]
fn golden_llama_h100_timings() {
    // Same requests on the shipped Llama-3.1-8B / H100 profile; pinned values (seconds).
    let step = perf_profile("h100-llama-3.1-8b").unwrap().step;
    let mut e = Engine::new(cfg(26_674, 8192, step));
    e.submit(req(1, 2000, 2, 1)).unwrap();
    e.submit(req(2, 100, 1, 2)).unwrap();
    let got = run(&mut e);
    // step 1: 2100 prefill tokens, pairs 2000·2001/2 + 100·101/2 = 2006050
    let t1 = step.overhead_s
        + step.weight_read_s
        + 2100.0 * step.dense_s_per_token
        + step.attn_s_per_pair * 2_006_050.0;
    // step 2: A decodes with 2001 context tokens
    let t2 = t1
        + step.overhead_s
        + step.weight_read_s
        + step.dense_s_per_token
        + step.kv_read_s_per_token * 2001.0;
    assert_eq!(got.len(), 3);
    assert!((got[0].2 - t1).abs() < 1e-12 && (got[1].2 - t1).abs() < 1e-12);
    assert!((got[2].2 - t2).abs() < 1e-12);
    // Pinned, recomputed from the fitted coefficients (LLAMA_8B_H100_FIT, see sim::perf):
    // 1 ms + 5.5745 ms + 2100 · 40.580 µs + 2006050 · 1.3248 ns = 94.45 ms;
    // step 2 adds 1 + 5.5745 + 0.0406 + 2001 · 41.185e-6 ms = 6.697 ms → 101.15 ms.
    assert!((t1 - 0.094_45).abs() < 1e-5, "{t1}");
    assert!((t2 - 0.101_15).abs() < 1e-5, "{t2}");
}

#[test]
fn repeated_long_prompt_hits_prefix_cache_and_lowers_ttft() {
    let step = perf_profile("h100-llama-3.1-8b").unwrap().step;
    let mut e = Engine::new(cfg(26_674, 8192, step));
    e.submit(req(1, 4000, 1, 42)).unwrap();
    let a = run(&mut e);
    let t0 = e.now();
    e.submit(req(2, 4000, 1, 42)).unwrap();
    let b = run(&mut e);
    let ttft_cold = first_token_time(&a, 1);
    let ttft_warm = first_token_time(&b, 2) - t0;
    let c = e.counters();
    assert_eq!(c.prefix_queries_tokens, 8000);
    // At most num_tokens − 1 = 3999 tokens may hit, in whole blocks: 249 · 16 = 3984.
    assert_eq!(c.prefix_hit_tokens, 3984);
    assert_eq!(c.prompt_tokens, 4000 + 16);
    assert!(
        ttft_warm < ttft_cold / 5.0,
        "warm {ttft_warm} cold {ttft_cold}"
    );
    // A different prompt misses.
    let t1 = e.now();
    e.submit(req(3, 4000, 1, 7)).unwrap();
    let d = run(&mut e);
    assert_eq!(e.counters().prefix_hit_tokens, 3984);
    assert!((first_token_time(&d, 3) - t1 - ttft_cold).abs() < 1e-9);
}

#[test]
fn concurrent_long_prompts_raise_kv_usage() {
    let mut e = Engine::new(cfg(1000, 8192, simple_step()));
    for i in 0..8 {
        e.submit(req(i, 3000, 100, 100 + i)).unwrap();
    }
    let mut usage = vec![e.kv_usage()];
    for _ in 0..4 {
        e.step().unwrap();
        usage.push(e.kv_usage());
    }
    // step 1: 2 full prompts (188 blocks each: 3000/16 → 187.5 → 188) + 2192-token chunk
    // (137 blocks) = 513 blocks of 1000.
    assert_eq!(usage[0], 0.0);
    assert!((usage[1] - 0.513).abs() < 1e-12, "{usage:?}");
    assert!(usage.windows(2).all(|w| w[1] >= w[0]), "{usage:?}");
    assert!(usage[4] > 0.9, "{usage:?}");
}

#[test]
fn overload_preempts_and_queue_grows() {
    // 300 blocks = 4800 tokens; each request needs up to 1500 tokens.
    let mut e = Engine::new(cfg(300, 2048, simple_step()));
    let mut waiting = Vec::new();
    let mut id = 0;
    for _round in 0..6 {
        for _ in 0..4 {
            e.submit(req(id, 500, 1000, 1000 + id)).unwrap();
            id += 1;
        }
        for _ in 0..50 {
            e.step();
        }
        waiting.push(e.num_waiting());
    }
    assert!(e.counters().preemptions > 0, "{:?}", e.counters());
    assert!(
        waiting.windows(2).all(|w| w[1] >= w[0]) && waiting.last() > waiting.first(),
        "{waiting:?}"
    );
    let _ = run(&mut e);
    assert_eq!(e.counters().finished, 24);
    assert_eq!(e.kv_usage(), 0.0);
}

#[test]
fn priority_scheduling_admits_urgent_first() {
    let mut c = cfg(100, 40, simple_step());
    c.priority_scheduling = true;
    c.max_num_seqs = 1;
    let mut e = Engine::new(c);
    e.submit(req(1, 16, 1, 1)).unwrap();
    let mut low = req(2, 16, 1, 2);
    low.priority = 5;
    e.submit(low).unwrap();
    let mut high = req(3, 16, 1, 3);
    high.priority = -1;
    e.submit(high).unwrap();
    let order: Vec<u64> = run(&mut e).iter().map(|t| t.0).collect();
    assert_eq!(order, vec![3, 1, 2]);
}

#[test]
fn refuses_bad_requests() {
    let mut e = Engine::new(cfg(10, 40, simple_step()));
    assert_eq!(
        e.submit(req(1, 200, 1, 1)),
        Err(SubmitError::TooLarge {
            id: 1,
            needed_blocks: 13,
            num_blocks: 10
        })
    );
    assert_eq!(e.submit(req(2, 0, 1, 1)), Err(SubmitError::Empty { id: 2 }));
    e.submit(req(3, 16, 1, 1)).unwrap();
    assert_eq!(
        e.submit(req(3, 16, 1, 1)),
        Err(SubmitError::DuplicateId { id: 3 })
    );
    assert!(e.abort(3));
    assert!(!e.abort(3));
    assert!(e.is_idle());
}

fn shared(rel: &str) -> std::path::PathBuf {
    let base = std::env::var("KVROUTE_SHARED_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data")
        });
    base.join(rel)
}

#[test]
fn mooncake_replay_reuses_shared_prefixes() {
    let rows = load_mooncake(&shared("traces/mooncake_conversation_trace.jsonl")).unwrap();
    assert_eq!(rows.len(), 12_031);
    let head = &rows[..300];
    let step = perf_profile("h100-llama-3.1-8b").unwrap().step;
    let r = replay(head, &cfg(26_674, 8192, step), 4, "m");
    assert_eq!(r.requests, 300);
    assert_eq!(r.finished + r.rejected, 300);
    // Conversation turns repeat earlier hash_ids, so tokens hit; spreading the turns over 4
    // replicas round-robin loses much of that reuse (what a KV-aware router wins back).
    let single = replay(head, &cfg(26_674, 8192, step), 1, "m");
    assert!(r.prefix_hit_ratio > 0.0, "{r:?}");
    assert!(
        single.prefix_hit_ratio > 1.5 * r.prefix_hit_ratio,
        "{single:?} vs {r:?}"
    );
    assert!(r.ttft_p50 > 0.0 && r.ttft_p99 >= r.ttft_p50);
    // Deterministic: a second replay gives the identical report.
    assert_eq!(replay(head, &cfg(26_674, 8192, step), 4, "m"), r);
}

#[test]
fn kv_block_counts_per_shipped_profile() {
    use kvroute_core::profile::builtin_profiles;
    use kvroute_sim::metrics::Dialect;
    use kvroute_sim::perf::perf_profile_for;
    use kvroute_sim::server::ReplicaConfig;
    // ⌊(gpus · 80e9 · 0.9 − 2 · params) / (kv_bytes_per_token · 16)⌋, computed by hand.
    let expect = [
        ("meta-llama/Llama-3.1-8B-Instruct", 1, 26_674),
        ("meta-llama/Llama-3.1-70B-Instruct", 4, 28_017),
        ("Qwen/Qwen3-32B", 2, 18_692),
        ("mistralai/Mistral-7B-Instruct-v0.3", 1, 27_420),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 1, 194_582),
    ];
    let profiles = builtin_profiles();
    assert_eq!(profiles.len(), expect.len());
    for (name, gpus, blocks) in expect {
        let p = profiles.iter().find(|p| p.name == name).unwrap().clone();
        assert_eq!(perf_profile_for(&p).gpus, gpus, "{name}");
        let cfg = ReplicaConfig::for_model(p, Dialect::VllmV1, 1.0, 0).unwrap();
        assert_eq!(cfg.engine.num_gpu_blocks, blocks, "{name}");
    }
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Submit {
            prompt: u32,
            output: u32,
            content: u64,
            priority: i32,
        },
        Step,
        Abort(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u32..600, 1u32..40, 0u64..4, -2i32..3).prop_map(
                |(prompt, output, content, priority)| {
                    Op::Submit {
                        prompt,
                        output,
                        content,
                        priority,
                    }
                }
            ),
            Just(Op::Step),
            Just(Op::Step),
            (0u64..40).prop_map(Op::Abort),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the interleaving of submits, steps and aborts (with shared prefixes,
        /// preemption pressure and priorities): usage stays in 0..1, every accepted request
        /// either finishes with exactly its output tokens or was aborted, and the cache drains.
        #[test]
        fn engine_invariants(ops in proptest::collection::vec(op(), 1..120), prio in any::<bool>()) {
            let mut c = cfg(64, 128, simple_step());
            c.priority_scheduling = prio;
            c.max_num_seqs = 8;
            let mut e = Engine::new(c);
            let mut next = 0u64;
            let mut accepted = std::collections::HashMap::new();
            let mut aborted = std::collections::HashSet::new();
            let mut produced: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
            let mut last_time = 0.0;
            let record = |events: Vec<EngineEvent>, produced: &mut std::collections::HashMap<u64, u32>, last_time: &mut f64| {
                for ev in events {
                    if let EngineEvent::Token { id, index, time, .. } = ev {
                        let n = produced.entry(id).or_insert(0);
                        *n += 1;
                        assert_eq!(*n, index);
                        assert!(time >= *last_time);
                        *last_time = time;
                    }
                }
            };
            for o in ops {
                match o {
                    Op::Submit { prompt, output, content, priority } => {
                        let mut r = req(next, prompt, output, content);
                        r.priority = priority;
                        if e.submit(r).is_ok() {
                            accepted.insert(next, output);
                        }
                        next += 1;
                    }
                    Op::Step => {
                        if let Some(r) = e.step() {
                            record(r.events, &mut produced, &mut last_time);
                        }
                    }
                    Op::Abort(id) => {
                        if e.abort(id) {
                            aborted.insert(id);
                        }
                    }
                }
                let u = e.kv_usage();
                prop_assert!((0.0..=1.0).contains(&u));
            }
            let mut guard = 0;
            while let Some(r) = e.step() {
                record(r.events, &mut produced, &mut last_time);
                guard += 1;
                prop_assert!(guard < 100_000, "engine does not drain");
            }
            prop_assert_eq!(e.kv_usage(), 0.0);
            for (id, out) in accepted {
                if !aborted.contains(&id) {
                    prop_assert_eq!(produced.get(&id).copied(), Some(out), "request {}", id);
                }
            }
        }
    }
}
