//! Fault matrix (issue 14): each fault injected into a real stack (Envoy 1.40 + the filter,
//! kvroute-cp, kvroute-sim replicas or recording backends), with exact expectations.
//!
//! | fault | expectation |
//! |---|---|
//! | backend killed under load | a request in flight on it is retried exactly once, to the fallback, with its body; after two scrape intervals (+ push) no request is sent to it; every request answers 200 |
//! | control plane killed, restarted | the filter keeps the last snapshot and routes on it; once it is older than `stale_after_ms` every decision is a least-request fallback; all 200; after the restart decisions are by policy again |
//! | backend restarted in place | kvroute-cp publishes its new start within two scrape intervals, the filter has it one push later; the next turn of a conversation it served matches 0 prefix blocks anywhere, another replica's affinity is kept; every request answers 200 |
//! | everything saturated | admission holds up to `max_queue` requests per worker and answers the rest 429 at once; the held ones get 429 after `timeout_ms`; nothing hangs |
//! | ingest flood | 100 pushes/s for 5 s, then 20 snapshots at the ingest size limit (1 MiB): every push is accepted and handled, routing answers 200 throughout; one byte over the limit gets 413 |
//! | endpoint churn | 2,000 new addresses over time: the in-flight table drains to 0 and the Wasm memory stops growing |
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod rel_common;

use kvroute_core::snapshot::{EndpointStats, Snapshot};
use kvroute_integration::harness::kvroute::{chat, now_ms, Fleet, FleetMode, FleetOptions};
use kvroute_integration::harness::{free_port, http};
use rel_common::{prompt_tokens, Mode, Stack, StackOptions};
use std::time::{Duration, Instant};

const RETRY: &str = "cluster.pool.upstream_rq_retry";
const CONNECT_FAIL: &str = "cluster.pool.upstream_cx_connect_fail";
const STALE: &str = "wasmcustom.kvroute.decisions.stale_fallback";
const POLICY: &str = "wasmcustom.kvroute.decisions.policy";
const PUBLISHED: &str = "wasmcustom.kvroute.snapshots.published";
const WASM_MEMORY: &str = "wasmcustom.kvroute.wasm_memory_bytes";
const INFLIGHT: &str = "wasmcustom.kvroute.inflight";

/// `vllm:num_requests_running` of replica `i` (read in process).
fn running(stack: &Stack, i: usize) -> u64 {
    let Some(f) = &stack.sims[i] else { return 0 };
    let text = f.replica(0).unwrap().render_metrics().unwrap();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_killed_under_load() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let scrape = Duration::from_millis(stack.opts.scrape_ms);

    // The body's prompt length as a replica counts it (reference for "with its body").
    let long = rel_common::chat(1, 1, 400, false);
    let want_prompt = prompt_tokens(&stack.post("/v1/chat/completions", &long).await.unwrap());
    assert!(want_prompt.is_some_and(|p| p > 100), "{want_prompt:?}");

    // One long request in flight; kill the replica serving it.
    let port = stack.port;
    let body = long.clone();
    let in_flight = tokio::spawn(async move {
        http::request(
            "POST",
            &format!("http://127.0.0.1:{port}/v1/chat/completions"),
            &[("content-type", "application/json")],
            &body,
        )
        .await
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    let victim = loop {
        if let Some(i) = (0..stack.addrs.len()).find(|&i| running(&stack, i) > 0) {
            break i;
        }
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let retries0 = stack.stat(RETRY).await;
    stack.kill(victim);
    let killed_at = Instant::now();
    let r = in_flight.await.unwrap().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(prompt_tokens(&r), want_prompt, "the retry carried the body");
    assert_eq!(
        stack.stat(RETRY).await - retries0,
        1,
        "retried exactly once"
    );

    // Load: 20 requests/s for 3 s from the kill on; all succeed.
    let mut tasks = tokio::task::JoinSet::new();
    let mut marked = None;
    for n in 0..60u64 {
        let port = stack.port;
        tasks.spawn(async move {
            http::request(
                "POST",
                &format!("http://127.0.0.1:{port}/v1/chat/completions"),
                &[("content-type", "application/json")],
                &rel_common::chat(n % 8, n, 4, false),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Two scrape intervals plus one for the push after the kill: from here on Envoy
        // must never try the dead replica again.
        if marked.is_none() && killed_at.elapsed() >= 3 * scrape {
            marked = Some(stack.stat(CONNECT_FAIL).await);
        }
    }
    while let Some(r) = tasks.join_next().await {
        let r = r.unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let after = stack.stat(CONNECT_FAIL).await;
    assert_eq!(
        after,
        marked.unwrap(),
        "connections to the dead replica after {:?}",
        3 * scrape
    );
    let cp = stack.cp.as_ref().unwrap();
    assert_eq!(cp.hub().up_count(), stack.addrs.len() - 1);
    assert!(stack.envoy.wasm_failures().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_killed_then_restarted() {
    let mut stack = Stack::start(StackOptions {
        plugin: r#""picker":{"stale_after_ms":1000}"#.into(),
        ..StackOptions::default()
    })
    .await;
    for n in 0..5 {
        let r = stack
            .post("/v1/chat/completions", &rel_common::chat(n, n, 4, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    }
    assert_eq!(stack.stat(STALE).await, 0);

    stack.kill_cp().await;
    let killed = Instant::now();
    // Fresh for up to 1 s after the last push, stale after: every request still answers.
    let mut after_stale = 0;
    let stale0 = stack.stat(STALE).await;
    let mut n = 100;
    while killed.elapsed() < Duration::from_millis(2500) {
        let late = killed.elapsed() > Duration::from_millis(1300);
        let r = stack
            .post("/v1/chat/completions", &rel_common::chat(n, n, 4, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        if late {
            after_stale += 1;
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stale = stack.stat(STALE).await - stale0;
    assert!(after_stale >= 5, "{after_stale}");
    assert!(
        stale >= after_stale,
        "{stale} stale fallbacks for {after_stale} requests made after the snapshot aged"
    );

    // Restart: the first push makes stats fresh again.
    let published = stack.stat(PUBLISHED).await;
    stack.start_cp().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.stat(PUBLISHED).await <= published {
        assert!(Instant::now() < deadline, "no snapshot after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.wait_healthy(stack.addrs.len()).await;
    let (stale1, policy1) = (stack.stat(STALE).await, stack.stat(POLICY).await);
    for n in 0..10 {
        let r = stack
            .post(
                "/v1/chat/completions",
                &rel_common::chat(n, 1000 + n, 4, false),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    }
    assert_eq!(stack.stat(STALE).await, stale1, "stale after recovery");
    assert_eq!(stack.stat(POLICY).await - policy1, 10);
}

/// The filter's `x-kvroute-decision` of a response: (endpoint id, prefix blocks matched on
/// it, prefix blocks hashed).
fn decision(r: &http::Response) -> (String, u32, u32) {
    let h = r.header("x-kvroute-decision").unwrap_or_default();
    let field = |key: &str| {
        h.split(';')
            .find_map(|f| f.strip_prefix(key))
            .unwrap_or_else(|| panic!("no `{key}` in decision `{h}`"))
    };
    let (matched, hashed) = field("prefix=").split_once('/').unwrap();
    (
        field("endpoint=").to_owned(),
        matched.parse().unwrap(),
        hashed.parse().unwrap(),
    )
}

/// The prefix block hashes the filter computes for `body` (its default prefix config).
fn prefix_hashes(body: &[u8]) -> Vec<u64> {
    use kvroute_core::analysis::{analyze, ApiKind};
    use kvroute_core::estimate::{Estimator, EstimatorConfig};
    let a = analyze(
        ApiKind::from_path("/v1/chat/completions"),
        body,
        &Estimator::new(EstimatorConfig::default()),
    )
    .unwrap();
    kvroute_core::router::RequestInfo::from_analysis(
        a,
        &kvroute_core::prefix::PrefixConfig::default(),
    )
    .prefix_hashes
}

/// Blocks of `turn` the prefix index holds after `earlier` were routed to one endpoint: the
/// longest leading run shared with any of them (block hashes are chained).
fn expected_match(turn: &[u64], earlier: &[Vec<u64>]) -> u32 {
    earlier
        .iter()
        .map(|e| turn.iter().zip(e).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0) as u32
}

/// The newest snapshot version the filter's queue consumer has published (its debug log).
fn filter_version(stack: &Stack) -> u64 {
    stack
        .envoy
        .log()
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("kvroute: snapshot ")? + "kvroute: snapshot ".len()..];
            rest.strip_suffix(" published")?.parse::<u64>().ok()
        })
        .max()
        .unwrap_or(0)
}

/// One conversation's turns sent one after another through Envoy, with the hashes of each.
struct Conversation {
    id: u64,
    sent: Vec<Vec<u64>>,
}

impl Conversation {
    /// Send the next turn; 200, routed by prefix affinity. Returns (endpoint, matched,
    /// blocks of all turns so far routed to that endpoint matched as expected).
    async fn next(&mut self, stack: &Stack) -> (String, u32, u32) {
        let body = rel_common::chat(self.id, self.sent.len() as u64, 4, false);
        let r = stack.post("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let (endpoint, matched, hashed) = decision(&r);
        let hashes = prefix_hashes(&body);
        assert_eq!(hashed as usize, hashes.len(), "conversation {}", self.id);
        self.sent.push(hashes);
        (endpoint, matched, hashed)
    }

    /// What the last turn must have matched if all earlier turns went to its endpoint.
    fn expected(&self) -> u32 {
        let (last, earlier) = self.sent.split_last().unwrap();
        expected_match(last, earlier)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_restarted_in_place_loses_its_prefix_affinity() {
    // `prefix_affinity`: a request goes where most of its prefix blocks were routed, and by
    // least-request when no endpoint has any, so each decision shows the affinity alone.
    let mut stack = Stack::start(StackOptions {
        plugin: r#""debug_header":true,"picker":{"policy":"prefix_affinity"}"#.into(),
        ..StackOptions::default()
    })
    .await;
    let scrape = Duration::from_millis(stack.opts.scrape_ms);
    let began = Instant::now();

    // Conversation A gains affinity to one replica X: its first turn matches nothing, each
    // later turn goes to X matching the shared system prompt's blocks.
    let mut a = Conversation {
        id: 1,
        sent: vec![],
    };
    let (x, matched, _) = a.next(&stack).await;
    assert_eq!(matched, 0);
    for _ in 0..3 {
        let (e, matched, _) = a.next(&stack).await;
        assert_eq!((e.as_str(), matched), (x.as_str(), a.expected()));
        assert!(matched >= 10, "{matched}");
    }
    // Conversation B gains affinity to another replica Z (new conversations land by
    // least-request, ties at random, so try a few).
    let mut found = None;
    for id in 100..130 {
        let mut c = Conversation { id, sent: vec![] };
        let (e, _, _) = c.next(&stack).await;
        if e != x {
            found = Some((c, e));
            break;
        }
    }
    let (mut conv_b, z) = found.expect("30 new conversations all landed on X");
    let (e, matched, _) = conv_b.next(&stack).await;
    assert_eq!((e.as_str(), matched), (z.as_str(), conv_b.expected()));

    // Load from other conversations (one request every 20 ms) before, during and after the
    // restart: all must succeed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let port = stack.port;
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            let mut n = 1000;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let sent = Instant::now();
                let r = http::request(
                    "POST",
                    &format!("http://127.0.0.1:{port}/v1/chat/completions"),
                    &[("content-type", "application/json")],
                    &rel_common::chat(n, 0, 4, false),
                )
                .await
                .unwrap();
                statuses.push((sent, r.status, r.text()));
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Restart X in place: same address, new process (new start time, counters from 0).
    let xi: usize = x.strip_prefix("pool/sim-").unwrap().parse().unwrap();
    let hub = stack.cp.as_ref().unwrap().hub().clone();
    let start_of = |id: &str, snap: &Snapshot| {
        snap.endpoints
            .iter()
            .find(|e| e.id == id)
            .and_then(|e| e.process_start_ms)
    };
    let before = start_of(&x, &hub.latest().unwrap().snapshot().unwrap()).unwrap();
    let restart_began = Instant::now();
    stack.restart(xi).await;
    let restarted = Instant::now();
    // One request of the same load sent now, between the restart and its detection: the
    // 20 ms load loop alone may send nothing in that window when detection is quick (one
    // fresh-clone run saw 7 ms from restart to the filter's new snapshot).
    let in_window = {
        let body = rel_common::chat(999, 0, 4, false);
        let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
        let sent = Instant::now();
        let h = tokio::spawn(async move {
            http::request("POST", &url, &[("content-type", "application/json")], &body)
                .await
                .unwrap()
        });
        (sent, h)
    };

    // kvroute-cp publishes X's new start within two scrape intervals, and the filter has
    // that snapshot one push later.
    let version = loop {
        let p = hub.latest().unwrap();
        if start_of(&x, &p.snapshot().unwrap()).is_some_and(|s| s > before) {
            break p.version;
        }
        assert!(hub.endpoint(&x).unwrap().healthy, "{x} marked down");
        assert!(
            restarted.elapsed() < 2 * scrape,
            "kvroute-cp did not publish the restart within {:?}",
            2 * scrape
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let detected = restarted.elapsed();
    while filter_version(&stack) < version {
        assert!(
            restarted.elapsed() < 3 * scrape,
            "the filter did not publish snapshot {version} within {:?}",
            3 * scrape
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let known = Instant::now();
    eprintln!(
        "restart of {x}: published by kvroute-cp after {detected:?}, by the filter after {:?}",
        known - restarted
    );
    tokio::time::sleep(Duration::from_millis(100)).await;

    // The next turn of A matches no block anywhere (X forgot it; no other replica has
    // it): a least-request decision.
    let (a_to, matched, hashed) = a.next(&stack).await;
    assert_eq!(
        matched, 0,
        "A still matched {matched}/{hashed} blocks on {a_to}"
    );
    // Z's affinity is untouched.
    let (e, matched, _) = conv_b.next(&stack).await;
    assert_eq!((e.as_str(), matched), (z.as_str(), conv_b.expected()));
    // A builds a new affinity where its last turn went.
    let (e, matched, _) = a.next(&stack).await;
    let (last, earlier) = a.sent.split_last().unwrap();
    assert_eq!(
        (e.as_str(), matched),
        (
            a_to.as_str(),
            expected_match(last, &earlier[earlier.len() - 1..])
        )
    );

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut statuses = load.await.unwrap();
    let r = in_window.1.await.unwrap();
    statuses.push((in_window.0, r.status, r.text()));
    for (_, status, body) in &statuses {
        assert_eq!(*status, 200, "{body}");
    }
    let sent_between = |from: Instant, to: Instant| {
        statuses
            .iter()
            .filter(|(t, _, _)| *t >= from && *t < to)
            .count()
    };
    let end = Instant::now();
    let phases = [
        sent_between(began, restart_began),
        sent_between(restart_began, known),
        sent_between(known, end),
    ];
    assert!(
        phases.iter().all(|n| *n > 0),
        "requests before, during, after: {phases:?}"
    );
    // Exactly one restart, of X; every replica up.
    for i in 0..stack.addrs.len() {
        let id = format!("pool/sim-{i}");
        let ep = hub.endpoint(&id).unwrap();
        assert_eq!(ep.restart.restarts, u64::from(i == xi), "{id}");
        assert!(ep.healthy, "{id}");
    }
    let failures = stack.envoy.wasm_failures().await.unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_saturated_holds_then_429_nothing_hangs() {
    const MAX_QUEUE: usize = 8;
    const HELD_MS: u64 = 1500;
    let fleet = Fleet::start(FleetOptions {
        route_config: format!(
            concat!(
                r#""picker":{{"policy":"least_kv","stale_after_ms":60000,"min_kv_headroom":0.5}},"#,
                r#""admission":{{"enabled":true,"max_queue":{},"timeout_ms":{},"tick_ms":20,"retry_after_s":3}}"#
            ),
            MAX_QUEUE, HELD_MS
        ),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.99, 0.99]).await.unwrap();
    // 3 x max_queue at once on one worker: max_queue held, the rest refused at once.
    let url = fleet.url("/v1/chat/completions");
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..3 * MAX_QUEUE {
        let url = url.clone();
        tasks.spawn(async move {
            let r = http::request(
                "POST",
                &url,
                &[("content-type", "application/json")],
                &chat(&format!("saturated {i}")),
            )
            .await
            .unwrap();
            (r, started.elapsed())
        });
    }
    // While they are held the gauge reads max_queue, sample after sample: the worker adds
    // its queue's changes, and Envoy's main-thread instance, which ticks with an empty queue,
    // leaves it alone (set, it read 0 in most samples).
    fleet
        .wait_stat_at_least(&["wasmcustom.kvroute.queue_length"], MAX_QUEUE as u64)
        .await
        .unwrap();
    for _ in 0..5 {
        let q = fleet.custom("kvroute.queue_length").await.unwrap();
        if started.elapsed() < Duration::from_millis(HELD_MS - 200) {
            assert_eq!(q, MAX_QUEUE as u64, "queue length while held");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (mut fast, mut held) = (0, 0);
    while let Some(res) = tasks.join_next().await {
        let (r, took) = res.unwrap();
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("3"));
        assert!(took < Duration::from_millis(HELD_MS + 2000), "{took:?}");
        if took >= Duration::from_millis(HELD_MS - 100) {
            held += 1;
        } else {
            fast += 1;
        }
    }
    assert_eq!(held, MAX_QUEUE, "held for timeout_ms, then 429");
    assert_eq!(fast, 2 * MAX_QUEUE, "queue full: 429 at once");
    assert_eq!(fleet.counts(), vec![0, 0], "nothing forwarded");
    assert_eq!(fleet.custom("kvroute.queue_length").await.unwrap(), 0);
}

/// A snapshot of the two fleet backends plus `filler` endpoints serving another model, with
/// ids and addresses from `seed` (so each call can be all-new addresses).
fn padded(fleet: &Fleet, version: u64, filler: usize, seed: usize) -> Snapshot {
    let now = now_ms();
    let mut eps = vec![fleet.endpoint(0, 0.2, now), fleet.endpoint(1, 0.3, now)];
    for k in 0..filler {
        let n = seed + k;
        eps.push(EndpointStats {
            id: format!("churn/endpoint-with-a-long-pod-name-{n:06}"),
            address: format!("10.{}.{}.{}:8000", (n >> 16) & 255, (n >> 8) & 255, n & 255),
            cluster: format!("c{}", n % 2),
            pool: "churn".into(),
            models: vec!["other-model".into()],
            lora_adapters: vec!["adapter-a".into(), "adapter-b".into()],
            kv_usage: Some(0.5),
            kv_capacity_tokens: Some(1_000_000),
            block_size: Some(16),
            running: 3,
            waiting: 1,
            healthy: true,
            scraped_at_ms: now,
            process_start_ms: Some(1_700_000_000_000 + n as u64),
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        });
    }
    Snapshot::new(version, now, eps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_flood_at_the_size_limit() {
    const LIMIT: usize = 1024 * 1024;
    let fleet = Fleet::start(FleetOptions {
        concurrency: 2,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    // The largest snapshot under the default ingest limit (1 MiB).
    let mut filler = 1000;
    while padded(&fleet, 1, filler + 50, 0).encode().len() < LIMIT {
        filler += 50;
    }
    let body_len = padded(&fleet, 1, filler, 0).encode().len();
    assert!(body_len < LIMIT && body_len > LIMIT - 20_000, "{body_len}");

    let version0 = now_ms() * 1000;
    let accepted0 = fleet.custom("kvroute.ingest.accepted").await.unwrap();
    let url = fleet.url("/v1/chat/completions");
    let router = tokio::spawn(async move {
        let mut statuses = Vec::new();
        for i in 0..30 {
            let r = http::request(
                "POST",
                &url,
                &[("content-type", "application/json")],
                &chat(&format!("during the flood {i}")),
            )
            .await
            .unwrap();
            statuses.push(r.status);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        statuses
    });
    // 100 pushes/s for 5 s of a 40-endpoint fleet (open loop: one task per push), then 20
    // pushes at the size limit back to back.
    let start = Instant::now();
    let pushes = 520u64;
    let mut sends = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for sent in 0..pushes {
        let big = sent >= 500;
        if !big {
            tick.tick().await;
        }
        let snap = padded(&fleet, version0 + sent, if big { filler } else { 40 }, 0).encode();
        let url = format!("http://127.0.0.1:{}/kvroute/v1/snapshot", fleet.ingest_port);
        let push = async move {
            let auth = format!(
                "Bearer {}",
                kvroute_integration::harness::kvroute::TEST_TOKEN
            );
            http::request("POST", &url, &[("authorization", auth.as_str())], &snap).await
        };
        if big {
            let r = push.await.unwrap();
            assert_eq!(r.status, 204, "push {sent}: {}", r.text());
        } else {
            sends.spawn(push);
        }
    }
    while let Some(r) = sends.join_next().await {
        let r = r.unwrap().unwrap();
        assert_eq!(r.status, 204, "{}", r.text());
    }
    let took = start.elapsed();
    let statuses = router.await.unwrap();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(
        fleet.custom("kvroute.ingest.accepted").await.unwrap() - accepted0,
        pushes
    );
    fleet
        .wait_stat_at_least(
            &[
                "wasmcustom.kvroute.snapshots.published",
                "wasmcustom.kvroute.snapshots.ignored_old",
            ],
            accepted0 + pushes,
        )
        .await
        .unwrap();
    eprintln!(
        "ingest flood: 500 pushes at 100/s, then 20 of {body_len} bytes, in {:.1} s",
        took.as_secs_f64()
    );
    // One byte over the limit: refused, named.
    let mut over = padded(&fleet, version0 + pushes + 1, filler + 200, 0).encode();
    assert!(over.len() > LIMIT + 1);
    over.truncate(LIMIT + 1);
    let r = fleet
        .ingest(
            &over,
            Some(kvroute_integration::harness::kvroute::TEST_TOKEN),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(fleet.envoy.wasm_failures().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_churn_keeps_state_bounded() {
    // Endpoint mode: requests for `other-model` are routed to the churned addresses, which
    // the override_host cluster does not know, so Envoy serves them from its fallback round
    // robin: every churned endpoint gets reservations and prefix records in the filter.
    // The shared affinity journal is bounded by bytes and keeps 2 s of records; the whole
    // churn takes about that long, so with its default 256 KiB bound the journal (copied
    // into the VM at each sync) grows through the run and hides what this test looks at.
    // A 16 KiB bound fills in the first pushes.
    let fleet = Fleet::start(FleetOptions {
        mode: FleetMode::OverrideHost,
        route_config: r#""picker":{"stale_after_ms":60000},"affinity_journal_bytes":16384"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    const PER_PUSH: usize = 50;
    const PUSHES: usize = 40; // 2,000 new addresses in all
    let mut memory = Vec::new();
    for p in 0..PUSHES {
        let mut snap = padded(&fleet, p as u64 + 1, PER_PUSH, p * PER_PUSH);
        // The real backends serve nothing here; the churned endpoints serve the model.
        snap.endpoints.drain(..2);
        for e in &mut snap.endpoints {
            e.models = vec!["m".into()];
        }
        fleet.push(&snap).await.unwrap();
        for i in 0..PER_PUSH {
            let r = fleet
                .post(
                    "/v1/chat/completions",
                    &chat(&format!("churn {p} {i} {}", "shared prefix ".repeat(20))),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        memory.push(fleet.custom("kvroute.wasm_memory_bytes").await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while fleet.custom("kvroute.inflight").await.unwrap() != 0 {
        assert!(Instant::now() < deadline, "reservations left in flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Growth stops once the per-endpoint state reaches its bounds: the last half of the
    // churn adds less than 10 % to the memory in use at its middle.
    let mid = memory[PUSHES / 2];
    let last = *memory.last().unwrap();
    eprintln!("endpoint churn: Wasm memory by push {memory:?}");
    assert!(mid > 0);
    assert!(
        (last as f64) < mid as f64 * 1.10,
        "Wasm memory grew from {mid} to {last}"
    );
    assert!(fleet.envoy.wasm_failures().await.unwrap().is_empty());
    let _ = (free_port, Mode::Cluster, INFLIGHT, WASM_MEMORY);
}

/// What a client sees for an unknown model, a model list and a misconfigured cluster, through
/// real Envoy: OpenAI-shaped replies, never an empty 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_are_openai_shaped_and_a_missing_cluster_is_named() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let now = now_ms();
    let mut typo = fleet.endpoint(1, 0.0, now);
    typo.cluster = "c1-typo".into();
    typo.lora_adapters = vec!["sql-lora".into()];
    fleet
        .push(&Snapshot::new(
            1,
            now,
            vec![fleet.endpoint(0, 0.9, now), typo],
        ))
        .await
        .unwrap();

    // Unknown model: 404 model_not_found, which OpenAI clients do not retry.
    let body = br#"{"model":"no-such-model","messages":[{"role":"user","content":"hi"}]}"#;
    let r = fleet.post("/v1/chat/completions", body).await.unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(r.header("content-type"), Some("application/json"));

    // GET /v1/models: base models and adapters of the snapshot, OpenAI's list shape.
    let r = http::request("GET", &fleet.url("/v1/models"), &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!(
        (&v["data"][0]["id"], &v["data"][0]["object"]),
        (&"m".into(), &"model".into())
    );
    assert_eq!(
        (&v["data"][1]["id"], &v["data"][1]["parent"]),
        (&"sql-lora".into(), &"m".into())
    );
    assert_eq!(fleet.counts(), vec![0, 0], "answered by the filter");

    // The endpoint whose cluster Envoy lacks: a named 503, a metric, a log line.
    let r = fleet
        .post(
            "/v1/chat/completions",
            br#"{"model":"sql-lora","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    assert!(!r.body.is_empty(), "an empty 503");
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "cluster_not_found", "{}", r.text());
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`c1-typo`"));
    assert_eq!(
        fleet
            .custom("kvroute.outcome.cluster_not_found")
            .await
            .unwrap(),
        1
    );
    assert!(fleet
        .envoy
        .log()
        .contains("kvroute: Envoy has no cluster `c1-typo` (chosen for endpoint `pool/e1`)"));
    assert!(fleet.envoy.wasm_failures().await.unwrap().is_empty());
}

/// A missing cluster is named whenever the filter chose it, not only for a request decided
/// on its body: one decided at its headers (a GET, a body it does not read) or resumed from
/// the admission queue. Envoy no longer lends the filter its request headers then (it
/// answers `BadArgument`), and re-reading the routing header there panicked the VM
/// (`proxy_on_response_headers failed`), after which every request failed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_cluster_is_named_however_the_request_was_decided() {
    let fleet = Fleet::start(FleetOptions {
        route_config: concat!(
            r#""picker":{"policy":"least_kv","stale_after_ms":60000,"min_kv_headroom":0.5},"#,
            r#""admission":{"enabled":true,"timeout_ms":5000,"tick_ms":20}"#
        )
        .into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let named = |r: &http::Response, what: &str| {
        assert_eq!(r.status, 503, "{what}: {}", r.text());
        let v: serde_json::Value =
            serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{what}: {e}: {}", r.text()));
        assert_eq!(v["error"]["code"], "cluster_not_found", "{what}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("`c0-typo`"),
            "{what}: {v}"
        );
    };
    let now = now_ms();
    let mut typo = fleet.endpoint(0, 0.1, now);
    typo.cluster = "c0-typo".into();
    fleet
        .push(&Snapshot::new(1, now, vec![typo.clone()]))
        .await
        .unwrap();
    let url = fleet.url("/v1/chat/completions");
    let r = http::request("GET", &url, &[], b"").await.unwrap();
    named(&r, "GET, decided at its headers");
    let gzip = [
        ("content-type", "application/json"),
        ("content-encoding", "gzip"),
    ];
    let r = http::request("POST", &url, &gzip, b"xxxx").await.unwrap();
    named(&r, "a body not read");
    let r = fleet
        .post("/v1/chat/completions", &chat("hi"))
        .await
        .unwrap();
    named(&r, "decided on its body");

    // Resumed: no headroom anywhere, so the request is held; then the endpoint with the
    // missing cluster frees up and the tick resumes it there.
    let now = now_ms();
    typo.kv_usage = Some(0.95);
    typo.scraped_at_ms = now;
    let other = fleet.endpoint(1, 0.97, now);
    fleet
        .push(&Snapshot::new(2, now, vec![typo.clone(), other.clone()]))
        .await
        .unwrap();
    let held = fleet
        .post_parked("/v1/chat/completions", chat("wait"), 1)
        .await
        .unwrap();
    let now = now_ms();
    typo.kv_usage = Some(0.1);
    typo.scraped_at_ms = now;
    let other = EndpointStats {
        scraped_at_ms: now,
        ..other
    };
    fleet
        .push(&Snapshot::new(3, now, vec![typo, other]))
        .await
        .unwrap();
    let r = held.await.unwrap().unwrap();
    named(&r, "resumed from the admission queue");
    assert_eq!(
        fleet
            .custom("kvroute.outcome.cluster_not_found")
            .await
            .unwrap(),
        4
    );
    assert_eq!(fleet.counts(), vec![0, 0], "nothing reached a backend");
    assert!(fleet.envoy.wasm_failures().await.unwrap().is_empty());
}
