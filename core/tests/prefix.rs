//! Prefix hashing: GIE compatibility, chaining, limits, multi-turn reuse on real data, and
//! the approximate per-endpoint index.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly

mod common;

use kvroute_core::analysis::{analyze, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::prefix::{block_hashes, seed_hash, PrefixConfig, PrefixIndex};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;
use xxhash_rust::xxh64::xxh64;

/// GIE's `hashPrompt` written the way the Go code does it (append the previous hash to the
/// block, then one-shot hash), independently of the streaming implementation in the crate.
fn gie_hash_prompt(model: &str, prompt: &[u8], block: usize, max_blocks: usize) -> Vec<u64> {
    if prompt.len() < block {
        return Vec::new();
    }
    let prompt = &prompt[..prompt.len().min(block * max_blocks)];
    let mut res = vec![xxh64(model.as_bytes(), 0)];
    let mut i = 0;
    while i + block <= prompt.len() {
        let mut b = prompt[i..i + block].to_vec();
        b.extend_from_slice(&res.last().unwrap().to_le_bytes());
        res.push(xxh64(&b, 0));
        i += block;
    }
    res
}

#[test]
fn xxh64_reference_vectors() {
    // Reference values of XXH64 with seed 0 (xxHash's sanity-check vectors).
    assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
    assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
}

#[test]
fn matches_gie_hash_prompt_without_salt() {
    let text = "x".repeat(64 * 3 + 10);
    let ours = block_hashes("m", None, &text, &PrefixConfig::default());
    let gie = gie_hash_prompt("m", text.as_bytes(), 64, 256);
    assert_eq!(ours.len(), 3);
    assert_eq!(gie.len(), 4);
    assert_eq!(gie[0], seed_hash("m", None));
    assert_eq!(&gie[1..], &ours[..]);
}

#[test]
fn gie_truncation_at_max_blocks() {
    let text: String = (0..(64 * 300))
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let ours = block_hashes("llama", None, &text, &PrefixConfig::default());
    assert_eq!(ours.len(), 256);
    assert_eq!(
        &gie_hash_prompt("llama", text.as_bytes(), 64, 256)[1..],
        &ours[..]
    );
    let small = PrefixConfig {
        block_chars: 16,
        max_blocks: 4,
    };
    assert_eq!(block_hashes("llama", None, &text, &small).len(), 4);
    assert_eq!(
        &gie_hash_prompt("llama", text.as_bytes(), 16, 4)[1..],
        &block_hashes("llama", None, &text, &small)[..]
    );
}

#[test]
fn short_text_and_zero_block_size_give_no_hashes() {
    let cfg = PrefixConfig::default();
    assert!(block_hashes("m", None, &"a".repeat(63), &cfg).is_empty());
    assert_eq!(block_hashes("m", None, &"a".repeat(64), &cfg).len(), 1);
    let zero = PrefixConfig {
        block_chars: 0,
        max_blocks: 256,
    };
    assert!(block_hashes("m", None, "anything", &zero).is_empty());
}

#[test]
fn seed_depends_on_model_and_salt() {
    let text = "y".repeat(128);
    let cfg = PrefixConfig::default();
    let a = block_hashes("a", None, &text, &cfg);
    let b = block_hashes("b", None, &text, &cfg);
    let s1 = block_hashes("a", Some("s1"), &text, &cfg);
    let s2 = block_hashes("a", Some("s2"), &text, &cfg);
    assert_ne!(a[0], b[0]);
    assert_ne!(a[0], s1[0]);
    assert_ne!(s1[0], s2[0]);
    // Salted seed = xxh64(salt ‖ le(xxh64(model))).
    let mut seed_input = b"s1".to_vec();
    seed_input.extend_from_slice(&xxh64(b"a", 0).to_le_bytes());
    assert_eq!(seed_hash("a", Some("s1")), xxh64(&seed_input, 0));
    // The chain: block i depends on every block before it.
    let mut t2 = text.clone();
    t2.replace_range(0..1, "z");
    let c = block_hashes("a", None, &t2, &cfg);
    assert_ne!(a[1], c[1]);
}

#[test]
fn multibyte_text_hashes_bytes_not_chars() {
    // 22 three-byte characters = 66 bytes: one full 64-byte block.
    let text = "東".repeat(22);
    assert_eq!(
        block_hashes("m", None, &text, &PrefixConfig::default()).len(),
        1
    );
}

/// LMBenchmark multi-round inputs: every `run` input starts with an earlier input as an
/// exact prefix (see `../shared/data/README.md`). The hash chain of the longer input must
/// start with the full chain of the earlier one.
#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn multiround_inputs_share_leading_blocks_with_earlier_turns() {
    let cfg = PrefixConfig::default();
    let mut inputs: Vec<String> = Vec::new();
    for f in [
        "prompts/lmbenchmark_sharegpt_multiround_warmup.json",
        "prompts/lmbenchmark_sharegpt_multiround_run.json",
    ] {
        let s = String::from_utf8(common::read(f)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&common::fix_invalid_escapes(&s)).unwrap();
        inputs.extend(
            v.as_array()
                .unwrap()
                .iter()
                .map(|e| e["input"].as_str().unwrap().to_string()),
        );
    }
    let mut checked = 0;
    let mut shared_blocks = 0usize;
    for (i, cur) in inputs.iter().enumerate() {
        // Longest earlier input that is a strict prefix of this one.
        let Some(prev) = inputs[..i]
            .iter()
            .filter(|p| p.len() < cur.len() && cur.starts_with(p.as_str()))
            .max_by_key(|p| p.len())
        else {
            continue;
        };
        let hp = block_hashes("meta-llama/Llama-3.1-8B-Instruct", None, prev, &cfg);
        let hc = block_hashes("meta-llama/Llama-3.1-8B-Instruct", None, cur, &cfg);
        assert!(hc.len() >= hp.len());
        assert_eq!(
            &hc[..hp.len()],
            &hp[..],
            "input {i}: earlier turn's blocks not a prefix"
        );
        checked += 1;
        shared_blocks += hp.len();
    }
    assert!(checked >= 200, "only {checked} follow-up turns found");
    assert!(shared_blocks > 10_000, "shared blocks {shared_blocks}");
}

/// The same property through chat rendering: a follow-up turn (previous messages +
/// assistant reply + new user message) shares every full block of the previous turn.
#[test]
#[cfg_attr(
    all(target_arch = "wasm32", target_os = "unknown"),
    ignore = "reads ../shared/data: no file system on wasm32-unknown-unknown"
)]
fn chat_follow_up_turn_shares_previous_turn_blocks() {
    let s = String::from_utf8(common::read(
        "prompts/lmbenchmark_sharegpt_multiround_run.json",
    ))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&common::fix_invalid_escapes(&s)).unwrap();
    let est = Estimator::default();
    let cfg = PrefixConfig::default();
    let model = "meta-llama/Llama-3.1-8B-Instruct";
    for e in v.as_array().unwrap().iter().take(50) {
        let text = e["input"].as_str().unwrap();
        let first = serde_json::json!({"model": model, "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": text}]});
        let follow = serde_json::json!({"model": model, "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": text},
            {"role": "assistant", "content": "Sure, here is my answer."},
            {"role": "user", "content": "Tell me more."}]});
        let a = analyze(ApiKind::ChatCompletions, first.to_string().as_bytes(), &est).unwrap();
        let b = analyze(
            ApiKind::ChatCompletions,
            follow.to_string().as_bytes(),
            &est,
        )
        .unwrap();
        assert!(b.prefix_text.starts_with(&a.prefix_text));
        let ha = block_hashes(model, None, &a.prefix_text, &cfg);
        let hb = block_hashes(model, None, &b.prefix_text, &cfg);
        assert!(!ha.is_empty());
        assert_eq!(&hb[..ha.len()], &ha[..]);
    }
}

#[test]
fn index_records_matches_and_forgets() {
    let mut idx = PrefixIndex::new(100);
    idx.record("a", &[1, 2, 3, 4]);
    idx.record("b", &[1, 2]);
    assert_eq!(
        idx.match_blocks(&[1, 2, 3, 9], ["a", "b", "c"]),
        vec![3, 2, 0]
    );
    // Leading blocks only: a gap stops the match.
    assert_eq!(idx.match_one(&[9, 2, 3], "a"), 0);
    idx.forget("a");
    assert_eq!(idx.match_one(&[1, 2], "a"), 0);
    assert_eq!(idx.len("b"), 2);
    idx.retain(|id| id != "b");
    assert!(idx.is_empty());
}

#[test]
fn index_evicts_least_recently_used_beyond_capacity() {
    let mut idx = PrefixIndex::new(3);
    idx.record("a", &[1, 2, 3]);
    idx.record("a", &[1]); // touch 1: now 2 is the oldest
    idx.record("a", &[4]);
    assert_eq!(idx.len("a"), 3);
    assert_eq!(idx.match_one(&[1], "a"), 1);
    assert_eq!(idx.match_one(&[2], "a"), 0);
    assert_eq!(idx.match_one(&[3], "a"), 1);
    assert_eq!(idx.match_one(&[4], "a"), 1);
    assert_eq!(PrefixIndex::new(0).capacity(), 1);
}
