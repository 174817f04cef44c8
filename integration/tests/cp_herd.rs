//! Two gateways do not herd: two real Envoys (PyPI 1.40, `--concurrency 2`, the built filter;
//! once the `.wasm`, once the native build of `make dynmod`)
//! in front of four kvroute-sim vLLM replicas, and kvroute-cp scraping the replicas and
//! pushing to both Envoys.
//!
//! The replicas are scraped every 5 s (`scrape.interval_ms: 5000`, no jitter), so a burst sent
//! just after an idle snapshot happens "between scrapes": the model servers' running counts
//! do not show it yet, which is the window in which two gateways with only their own
//! reservations send to the same endpoint. Each round sends four requests 200 ms apart,
//! alternately through gateway A and B (A, B, A, B), with `least_request` (ties at random):
//!
//! - **sharing off** (no `stats_url`): each gateway spreads its own two requests, but the
//!   two gateways pick independently: a round lands on 4 distinct endpoints with probability
//!   1/6 (rounds start only when no scrape is due inside them). The test requires at least
//!   one herded round of five; all five balanced by chance: (1/6)^5, about 1e-4.
//! - **sharing on** (`stats_url` = each Envoy's admin `/stats/prometheus?filter=inflight_unseen`): every round lands
//!   on exactly 4 distinct endpoints, one request each.
//!
//! It also checks that both gateways are fresh (a snapshot in force, `kvroute.snapshot_age_ms`
//! under 1 s with 200 ms heartbeats) and reads a real Envoy `/stats/prometheus` body with the
//! control plane's parser while one request is in flight (exact requests, tokens > 0).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_core::snapshot::Snapshot;
use kvroute_cp::{Config, ControlPlane};
use kvroute_integration::harness::http::request;
use kvroute_integration::harness::kvroute::{envoy_config_with, now_ms, FleetMode, TEST_TOKEN};
use kvroute_integration::harness::templates::{FilterModule, DYNMOD, DYNMOD_STAT_PREFIX};
use kvroute_integration::harness::{wasm_path, Envoy};
use kvroute_sim::metrics::Dialect;
use kvroute_sim::server::{spawn_fleet, FleetConfig, FleetHandle, ReplicaConfig};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const REPLICAS: usize = 4;
const ROUNDS: usize = 5;
/// Gap between two requests of a round: more than the sharing delay (filter tick 50 ms +
/// stats read every 20 ms + push).
const GAP: Duration = Duration::from_millis(200);
const SCRAPE_INTERVAL_MS: u64 = 5_000;
/// kvroute-cp's default stats path: Envoy's Prometheus stats, narrowed to the kvroute
/// in-flight gauges by the admin `filter` regex.
const STATS_PATH: &str = "/stats/prometheus?filter=inflight_unseen";
/// A round's picks span 600 ms; no scrape may fall in this window from its start.
const ROUND_QUIET_MS: u64 = 1_000;

struct Gateway {
    envoy: Envoy,
    port: u16,
    ingest_port: u16,
    /// The native build (`make dynmod`) rather than the `.wasm`.
    native: bool,
}

impl Gateway {
    /// Prefix of the filter's stats in Envoy's `/stats`.
    fn stat_prefix(&self) -> &'static str {
        if self.native {
            DYNMOD_STAT_PREFIX
        } else {
            "wasmcustom."
        }
    }
}

async fn gateway(addrs: &[String], native: bool) -> Gateway {
    let wasm = wasm_path();
    let module = if native {
        DYNMOD
    } else {
        FilterModule::Wasm(&wasm)
    };
    let (envoy, [port, ingest_port]) = Envoy::start_on_free_ports(2, |[port, ingest_port]| {
        envoy_config_with(
            module,
            FleetMode::Cluster,
            addrs,
            r#""picker":{"policy":"least_request","stale_after_ms":60000},"debug_header":true,"affinity_sync_ms":50"#,
            port,
            ingest_port,
            4 << 20,
        )
    })
    .await
    .unwrap();
    Gateway {
        envoy,
        port,
        ingest_port,
        native,
    }
}

fn cp_yaml(sims: &FleetHandle, a: &Gateway, b: &Gateway, share: bool) -> String {
    let mut y = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: {SCRAPE_INTERVAL_MS}\n  timeout_ms: 500\n  jitter: 0\n\
         push:\n  heartbeat_ms: 200\n  min_interval_ms: 5\n  token_env: KVROUTE_CP_HERD_TEST_TOKEN\n\
         \x20 peer_load: {{interval_ms: 20, timeout_ms: 500, stale_after_ms: 1000}}\ntargets:\n"
    );
    for (name, g) in [("gw-a", a), ("gw-b", b)] {
        y.push_str(&format!(
            "  - name: {name}\n    url: http://127.0.0.1:{}/kvroute/v1/snapshot\n",
            g.ingest_port
        ));
        if share {
            y.push_str(&format!(
                "    stats_url: 'http://{}{STATS_PATH}'\n",
                g.envoy.admin()
            ));
        }
    }
    y.push_str(&format!(
        "pools:\n  - name: sim\n    kind: vllm\n    models: [{MODEL}]\n    endpoints:\n"
    ));
    for (i, addr) in sims.addrs().iter().enumerate() {
        y.push_str(&format!(
            "      - {{name: '{}', address: '{addr}', cluster: c{i}}}\n",
            name(i)
        ));
    }
    y
}

fn body(n: usize) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("request {n}: explain prefill and decode")}],
        "max_tokens": 300
    })
    .to_string()
    .into_bytes()
}

/// Replica `i`'s endpoint name: dotted, with a trailing dot, as Envoy splits stat names at
/// dots (the filter's `metric::stat_id` keeps them out of its per-endpoint gauge names).
fn name(i: usize) -> String {
    format!("replica.{i}.")
}

/// Replica `i`'s endpoint id.
fn id(i: usize) -> String {
    format!("sim/{}", name(i))
}

/// The endpoint id in the decision header (`…;endpoint=sim/replica.2.;…`).
fn endpoint_of(decision: &str) -> String {
    decision
        .split(';')
        .find_map(|p| p.strip_prefix("endpoint="))
        .unwrap_or_else(|| panic!("no endpoint in decision `{decision}`"))
        .to_owned()
}

/// Wait until the snapshot in force shows every replica idle and scraped after `after_ms`
/// (so no earlier round's requests linger in it), with no replica's next scrape due within
/// [`ROUND_QUIET_MS`].
async fn wait_idle_snapshot(cp: &ControlPlane, after_ms: u64) {
    let deadline = Instant::now() + Duration::from_millis(3 * SCRAPE_INTERVAL_MS);
    loop {
        let idle = cp
            .hub()
            .latest()
            .and_then(|p| p.snapshot().ok())
            .is_some_and(|s: Snapshot| {
                s.endpoints.len() == REPLICAS
                    && s.endpoints.iter().all(|e| {
                        e.healthy
                            && e.running == 0
                            && e.waiting == 0
                            && e.scraped_at_ms > after_ms
                            // No scrape falls inside the round (4 picks in 600 ms): the
                            // burst happens between scrapes, as the control needs.
                            && e.scraped_at_ms + SCRAPE_INTERVAL_MS > now_ms() + ROUND_QUIET_MS
                    })
            });
        if idle {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replicas never idle in the snapshot: {:?}",
            cp.hub().latest().map(|p| p.snapshot())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One round: A, B, A, B, `GAP` apart; returns the endpoint of each request, in order. With
/// `probe`, reads A's Envoy stats while its first request is in flight and checks them with
/// the control plane's parser.
async fn round(
    cp: &ControlPlane,
    a: &Gateway,
    b: &Gateway,
    n: usize,
    probe: bool,
) -> (Vec<String>, u64) {
    let mut tasks = Vec::new();
    for i in 0..4 {
        let port = if i % 2 == 0 { a.port } else { b.port };
        let body = body(n * 4 + i);
        tasks.push(tokio::spawn(async move {
            let r = request(
                "POST",
                &format!("http://127.0.0.1:{port}/v1/chat/completions"),
                &[("content-type", "application/json")],
                &body,
            )
            .await
            .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            endpoint_of(r.header("x-kvroute-decision").unwrap())
        }));
        if probe && i == 0 {
            // A's tick (50 ms) has written its gauges by now.
            tokio::time::sleep(Duration::from_millis(150)).await;
            let stats = request(
                "GET",
                &format!("http://{}{STATS_PATH}", a.envoy.admin()),
                &[],
                b"",
            )
            .await
            .unwrap();
            let full = request(
                "GET",
                &format!("http://{}/stats/prometheus", a.envoy.admin()),
                &[],
                b"",
            )
            .await
            .unwrap();
            println!(
                "one Envoy's /stats/prometheus: {} bytes; with ?filter=inflight_unseen: {} bytes",
                full.body.len(),
                stats.body.len()
            );
            // The filter keeps only the kvroute in-flight gauges (and their TYPE lines).
            assert!(
                stats
                    .text()
                    .lines()
                    .all(|l| l.is_empty() || l.contains("kvroute_inflight_unseen_")),
                "{}",
                stats.text()
            );
            assert_eq!(
                kvroute_cp::peers::parse(&full.body, &(0..REPLICAS).map(id).collect::<Vec<_>>())
                    .unwrap()
                    .load,
                kvroute_cp::peers::parse(&stats.body, &(0..REPLICAS).map(id).collect::<Vec<_>>())
                    .unwrap()
                    .load,
                "the filtered body reads the same as the full one"
            );
            let text = stats.text();
            let ids: Vec<String> = (0..REPLICAS).map(id).collect();
            let parsed = kvroute_cp::peers::parse(&stats.body, &ids).unwrap();
            assert_eq!(parsed.bad_values, 0);
            assert!(parsed.ambiguous.is_empty());
            assert_eq!(
                parsed.load.len(),
                1,
                "one endpoint in flight: {parsed:?} from\n{text}"
            );
            let (id, load) = parsed.load.iter().next().unwrap();
            assert_eq!(load.requests, 1, "{parsed:?}");
            assert!(load.tokens > 0, "{parsed:?}");
            // The Wasm filter's gauge per endpoint, the native build's label.
            let sanitized = kvroute_cp::peers::sanitize(id);
            let named = if a.native {
                format!(
                    "envoy_dynamicmodulescustom_kvroute_inflight_unseen_requests{{endpoint=\"{}\"}}",
                    id.replace('.', "_")
                )
            } else {
                format!("kvroute_inflight_unseen_requests_{sanitized}")
            };
            assert!(
                text.contains(&named),
                "Envoy names the gauge as expected:\n{}",
                text.lines()
                    .filter(|l| l.contains("inflight_unseen"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            tokio::time::sleep(GAP - Duration::from_millis(150)).await;
            continue;
        }
        tokio::time::sleep(GAP).await;
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    let _ = cp;
    (out, now_ms())
}

fn distinct(eps: &[String]) -> usize {
    eps.iter().collect::<std::collections::BTreeSet<_>>().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_load_and_do_not_herd() {
    herd(false).await;
}

/// The same with the native build (`make dynmod`), whose per-endpoint gauges are one
/// labelled gauge (`kvroute_inflight_unseen_requests{endpoint="…"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_native_gateways_share_load_and_do_not_herd() {
    herd(true).await;
}

async fn herd(native: bool) {
    let cfg = ReplicaConfig::builtin(MODEL, Dialect::VllmV1, 1.0, 7).unwrap();
    let sims = spawn_fleet(FleetConfig::local(cfg, REPLICAS))
        .await
        .unwrap();
    let addrs: Vec<String> = sims.addrs().iter().map(|a| a.to_string()).collect();
    let a = gateway(&addrs, native).await;
    let b = gateway(&addrs, native).await;
    std::env::set_var("KVROUTE_CP_HERD_TEST_TOKEN", TEST_TOKEN);
    let cp = ControlPlane::start(Config::from_yaml(&cp_yaml(&sims, &a, &b, false)).unwrap())
        .await
        .unwrap();
    wait_idle_snapshot(&cp, 0).await;

    // (a) Both gateways are fresh.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for g in [&a, &b] {
        let accepted = g
            .envoy
            .stat(&format!("{}kvroute.ingest.accepted", g.stat_prefix()))
            .await
            .unwrap()
            .unwrap_or(0);
        assert!(accepted >= 2, "heartbeats reach both gateways: {accepted}");
        let age = g
            .envoy
            .stat(&format!("{}kvroute.snapshot_age_ms", g.stat_prefix()))
            .await
            .unwrap()
            .expect("a snapshot is in force");
        assert!(age < 1_000, "snapshot age {age} ms with 200 ms heartbeats");
    }

    // (b) The control: no sharing.
    let mut done = 0;
    let mut off = Vec::new();
    for n in 0..ROUNDS {
        wait_idle_snapshot(&cp, done).await;
        let (eps, end) = round(&cp, &a, &b, n, false).await;
        done = end;
        off.push(eps);
    }
    // Sharing on.
    cp.reload(Config::from_yaml(&cp_yaml(&sims, &a, &b, true)).unwrap())
        .await
        .unwrap();
    let mut on = Vec::new();
    for n in 0..ROUNDS {
        wait_idle_snapshot(&cp, done).await;
        let (eps, end) = round(&cp, &a, &b, ROUNDS + n, n == 0).await;
        done = end;
        on.push(eps);
    }
    let spread =
        |rounds: &[Vec<String>]| -> Vec<usize> { rounds.iter().map(|r| distinct(r)).collect() };
    let totals = |rounds: &[Vec<String>]| -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for e in rounds.iter().flatten() {
            *m.entry(e.clone()).or_default() += 1;
        }
        m
    };
    println!(
        "distinct endpoints per round of 4 (A,B,A,B): sharing off {:?}, on {:?}",
        spread(&off),
        spread(&on)
    );
    println!("off rounds: {off:?}\non rounds: {on:?}");
    println!("totals off {:?}, on {:?}", totals(&off), totals(&on));
    assert_eq!(
        spread(&on),
        vec![4; ROUNDS],
        "with sharing every request of a round lands on its own endpoint: {on:?}"
    );
    assert!(
        spread(&off).iter().any(|&d| d < 4),
        "without sharing the two gateways pick independently and collide: {off:?}"
    );
    let errors = cp
        .hub()
        .telemetry
        .encode()
        .lines()
        .filter(|l| l.starts_with("kvroute_cp_gateway_stats_errors_total"))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert!(errors.is_empty(), "every stats read was used: {errors:?}");
    for g in [&a, &b] {
        assert!(g.envoy.wasm_failures().await.unwrap().is_empty());
    }
    cp.shutdown().await;
    sims.shutdown();
}
