//! # kvroute-fuzz
//!
//! The checks behind kvroute's coverage-guided fuzz targets. Each function takes the raw
//! bytes libFuzzer generates, runs one untrusted-input parser of kvroute on them and asserts
//! properties that must hold for *every* input, so a wrong answer is a crash, not only a
//! panic:
//!
//! | function | input | code under test | properties checked |
//! |---|---|---|---|
//! | [`analyze`] | a request body | `kvroute_core::analysis::analyze` (and `analyze_bounded` at each of [`BOUNDS`]), then the router's request description and KV demand, on every API path | never panics; deterministic; a prefix limit changes nothing but the rendering's cut (counting every byte; sampled, also the estimate, and a defect between the sampling windows may go unread); `n ≥ 1`; demand ≥ prompt tokens; prefix hashes ≤ `max_blocks`; exact token-id counts only for token-id prompts |
//! | [`snapshot`] | an ingest body | `Snapshot::decode` | never panics; a decoded snapshot validates, and re-encodes to bytes that decode to the same ids, version, numbers and `unavailable_models` |
//! | [`exposition`] | a `/metrics` body (or a llama.cpp `/slots` body) | `expo::Exposition`, every `adapters::extract` kind, `llamacpp::slots_usage` | never panics; a body the full parse accepts, the scrape path's filtered parse accepts too, keeping exactly the relevant samples and skipping no more lines; adapter output has `kv_usage` in 0..=1, non-zero block size and capacity, and passes `Snapshot::validate` as the wire form kvroute-cp pushes |
//! | [`sse_usage`] | a streamed response body | `usage::SseUsageScanner` | never panics; the tail stays ≤ `max_tail`; the usage (and the count of events that outgrew the tail) read from the body split into arbitrary chunks equals that read from it whole |
//!
//! The targets themselves (`fuzz/libfuzzer/fuzz_targets/*.rs`, built by `cargo +nightly
//! fuzz`) are one line each. The stable test `fuzz/tests/replay.rs` runs these same
//! functions on every kept corpus entry and every past crash (`fuzz/regressions/<target>/`),
//! so `make test` guards against regressions without a nightly toolchain. How to run them and
//! what was run: `docs/reliability.md`.

use kvroute_core::analysis::{self, ApiKind};
use kvroute_core::estimate::Estimator;
use kvroute_core::prefix::PrefixConfig;
use kvroute_core::router::{RequestInfo, Router, RouterConfig};
use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_core::usage::SseUsageScanner;
use kvroute_cp::adapters::{self, llamacpp, ServerKind, ServerStats};
use kvroute_cp::expo::{Exposition, Sample};

/// One fuzz target's check.
pub type Check = fn(&[u8]);

/// The fuzz targets, by name (the directory names under `fuzz/corpus/` and
/// `fuzz/regressions/`, and the binaries of `fuzz/libfuzzer`).
pub const TARGETS: &[(&str, Check)] = &[
    ("analyze", analyze),
    ("snapshot", snapshot),
    ("exposition", exposition),
    ("sse_usage", sse_usage),
];

/// Request paths [`analyze`] reads every body as: one per `ApiKind` (the last is `Other`).
pub const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/generate",
];

/// Prefix limits (bytes of rendering) [`analyze`] also reads every body with: none, a
/// short one (so fuzz-sized bodies reach the passes and windows past it), and the
/// router's default.
pub const BOUNDS: [usize; 3] = [0, 64, 16 * 1024];

thread_local! {
    /// The router the filter builds from a default plugin config: built-in model profiles.
    static ROUTER: Option<Router> = Router::new(RouterConfig::default(), 0).ok();
}

/// Request analysis: the filter's per-request parser of untrusted bodies.
///
/// For each of [`PATHS`]: [`analysis::analyze`] with the default estimator, then
/// [`RequestInfo::from_analysis`] with the default prefix configuration and the KV demand
/// of [`Router::demand`] (built-in model profiles), the path [`Router::route`] takes.
pub fn analyze(data: &[u8]) {
    let estimator = Estimator::default();
    let prefix = PrefixConfig::default();
    ROUTER.with(|router| {
        let Some(router) = router else {
            fail("the default router configuration is rejected");
        };
        for path in PATHS {
            let api = ApiKind::from_path(path);
            let first = analysis::analyze(api, data, &estimator);
            let again = analysis::analyze(api, data, &estimator);
            assert_eq!(first, again, "analysis is not deterministic on {path}");
            // The router renders at most `max_bytes` of a prompt; past the limit the scan
            // decodes sampling windows ahead and skips the string bytes between them raw.
            // Counting every byte (no windows, nothing skipped), only the rendering may
            // differ from the unbounded analysis's, and only by its cut. Sampled, the
            // skipped bytes are not read: a body the unbounded analysis accepts is accepted
            // with the same fields but the estimate (the windows fall a few bytes apart); a
            // defect it refuses may go unread.
            let every = Estimator::every_byte();
            let exact = analysis::analyze(api, data, &every);
            for limit in BOUNDS {
                for (est, unbounded) in [(&every, &exact), (&estimator, &first)] {
                    let sampled = !est.every_byte;
                    let bounded = analysis::analyze_bounded(api, data, est, limit);
                    match (unbounded, &bounded) {
                        (Ok(a), Ok(b)) => {
                            assert!(
                                a.prefix_text.starts_with(&b.prefix_text)
                                    && b.prefix_text.len() >= limit.min(a.prefix_text.len()),
                                "rendering at limit {limit} is not the unbounded one cut on {path}"
                            );
                            let mut cut = a.clone();
                            cut.prefix_text.clone_from(&b.prefix_text);
                            if sampled {
                                cut.prompt_tokens = b.prompt_tokens;
                            }
                            assert_eq!(&cut, b, "limit {limit} changed the analysis on {path}");
                        }
                        (Err(_), _) if sampled => {}
                        (Err(a), Err(b)) => {
                            assert_eq!(a, b, "limit {limit} changed the error on {path}")
                        }
                        _ => fail(&format!("limit {limit} changed the outcome on {path}")),
                    }
                }
            }
            match first {
                Ok(a) => {
                    assert!(a.n >= 1, "n = {} on {path}", a.n);
                    if let Some(m) = &a.model {
                        assert!(!m.is_empty(), "empty model accepted on {path}");
                    }
                    let req = RequestInfo::from_analysis(a.clone(), &prefix);
                    assert_eq!(
                        req,
                        RequestInfo::from_analysis(a, &prefix),
                        "request description is not deterministic on {path}"
                    );
                    let (_, demand) = router.demand(&req);
                    assert!(
                        demand.tokens >= req.prompt_tokens,
                        "demand {} < prompt {} on {path}",
                        demand.tokens,
                        req.prompt_tokens
                    );
                    assert!(
                        req.prefix_hashes.len() <= prefix.max_blocks,
                        "{} prefix hashes > max_blocks {}",
                        req.prefix_hashes.len(),
                        prefix.max_blocks
                    );
                }
                Err(e) => {
                    // The error is shown to the client: it must render.
                    let _ = e.to_string();
                }
            }
        }
    });
}

/// Snapshot ingest: the filter's decoder of what the control plane pushes.
pub fn snapshot(data: &[u8]) {
    let Ok(snap) = Snapshot::decode(data) else {
        return;
    };
    assert_eq!(
        snap.validate(),
        Ok(()),
        "decode accepted an invalid snapshot"
    );
    let again = match Snapshot::decode(&snap.encode()) {
        Ok(s) => s,
        Err(e) => fail(&format!("re-encoded snapshot does not decode: {e}")),
    };
    assert_eq!(again.version, snap.version);
    assert_eq!(again.generated_at_ms, snap.generated_at_ms);
    assert_eq!(again.unavailable_models, snap.unavailable_models);
    assert_eq!(again.endpoints.len(), snap.endpoints.len());
    for (a, b) in again.endpoints.iter().zip(&snap.endpoints) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.address, b.address);
        assert_eq!(a.models, b.models);
        assert_eq!(a.running, b.running);
        assert_eq!(a.waiting, b.waiting);
        assert_eq!(a.kv_capacity_tokens, b.kv_capacity_tokens);
        // serde_json prints the shortest round-tripping form; its reader may land one ULP
        // away on long inputs, never further.
        match (a.kv_usage, b.kv_usage) {
            (Some(x), Some(y)) => assert!((x - y).abs() <= f64::EPSILON, "{x} vs {y}"),
            (x, y) => assert_eq!(x, y),
        }
    }
}

fn same_samples(a: &[Sample], b: &[&Sample]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.name == y.name
                && x.labels == y.labels
                && x.value.to_bits() == y.value.to_bits()
                && x.timestamp.map(f64::to_bits) == y.timestamp.map(f64::to_bits)
        })
}

/// Every adapter kind `extract` accepts, `Auto` (detection) first.
pub const KINDS: &[ServerKind] = &[
    ServerKind::Auto,
    ServerKind::Vllm,
    ServerKind::Sglang,
    ServerKind::Tgi,
    ServerKind::Llamacpp,
    ServerKind::Trtllm,
    ServerKind::LlmdSim,
];

/// What kvroute-cp pushes for one endpoint with these stats (the fields the hub copies).
fn wire(stats: &ServerStats) -> EndpointStats {
    EndpointStats {
        id: "fuzz/e0".into(),
        address: "127.0.0.1:8000".into(),
        cluster: "c0".into(),
        pool: "fuzz".into(),
        models: vec!["m".into()],
        lora_adapters: stats.lora_adapters.clone(),
        kv_usage: stats.kv_usage,
        kv_capacity_tokens: stats.kv_capacity_tokens,
        block_size: stats.block_size,
        running: stats.running,
        waiting: stats.waiting,
        healthy: true,
        scraped_at_ms: 1,
        process_start_ms: stats.process_start_ms,
        peer_inflight_requests: 0,
        peer_inflight_tokens: 0,
    }
}

/// The control plane's scrape path: exposition parser, each adapter, llama.cpp `/slots`.
pub fn exposition(data: &[u8]) {
    let _ = llamacpp::slots_usage(data);
    let full = Exposition::parse_bytes(data);
    let kept = Exposition::parse_bytes_with(data, adapters::is_relevant);
    if let Ok(full) = &full {
        let Ok(kept) = &kept else {
            fail("the filtered parse rejects a body the full parse accepts");
        };
        let relevant: Vec<&Sample> = full
            .samples
            .iter()
            .filter(|s| adapters::is_relevant(&s.name))
            .collect();
        assert!(
            same_samples(&kept.samples, &relevant),
            "the filtered parse kept {:?}, the full parse's relevant samples are {:?}",
            kept.samples,
            relevant
        );
        assert!(
            kept.skipped <= full.skipped,
            "the filtered parse skipped more lines"
        );
    }
    let Ok(expo) = kept else { return };
    for kind in KINDS {
        let Ok(stats) = adapters::extract(*kind, &expo, Some(data)) else {
            continue;
        };
        assert_ne!(stats.kind, ServerKind::Auto, "extract returned kind auto");
        if let Some(u) = stats.kv_usage {
            assert!((0.0..=1.0).contains(&u), "{kind:?}: kv_usage {u}");
        }
        assert_ne!(stats.block_size, Some(0), "{kind:?}: block size 0");
        assert_ne!(stats.kv_capacity_tokens, Some(0), "{kind:?}: capacity 0");
        let snap = Snapshot::new(1, 1, vec![wire(&stats)]);
        if let Err(e) = snap.validate() {
            fail(&format!("{kind:?}: adapter output fails validation: {e}"));
        }
    }
}

/// Tail bound used by [`sse_usage`] (small, so fuzzing reaches the overflow path).
pub const SSE_MAX_TAIL: usize = 256;

/// Streamed-response usage scanner: the filter reads `usage` from every SSE body.
///
/// The first byte seeds the chunk sizes (1..=64 bytes), the rest is the body.
pub fn sse_usage(data: &[u8]) {
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let mut whole = SseUsageScanner::new(SSE_MAX_TAIL);
    whole.feed(body);
    assert!(whole.tail_len() <= SSE_MAX_TAIL);
    whole.finish();
    assert_eq!(whole.tail_len(), 0);

    let mut split = SseUsageScanner::new(SSE_MAX_TAIL);
    let mut rng = u32::from(seed) | 1;
    let mut rest = body;
    while !rest.is_empty() {
        // xorshift32: a fixed, seed-determined sequence of chunk sizes.
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        let n = (rng % 64 + 1) as usize;
        let (chunk, tail) = rest.split_at(n.min(rest.len()));
        split.feed(chunk);
        assert!(split.tail_len() <= SSE_MAX_TAIL);
        rest = tail;
    }
    split.finish();
    assert_eq!(whole.overflows(), split.overflows());
    assert_eq!(
        whole.usage(),
        split.usage(),
        "usage depends on how the body was split"
    );
}

/// A failed property: a crash libFuzzer records (a fuzz check, not library code).
#[allow(clippy::panic)]
fn fail(msg: &str) -> ! {
    panic!("{msg}")
}
