//! kvroute-cp against fake model servers and fake Envoy ingests: fault handling with exact
//! outcomes. Every wait is a poll with a deadline.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::*;
use kvroute_cp::{Config, ControlPlane};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

async fn start(yaml: &str) -> ControlPlane {
    ControlPlane::start(Config::from_yaml(yaml).unwrap())
        .await
        .unwrap()
}

fn state(cp: &ControlPlane, id: &str) -> kvroute_cp::hub::EndpointState {
    cp.hub().endpoint(id).unwrap()
}

#[tokio::test]
async fn hung_endpoint_does_not_delay_others() {
    let ok = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 2, 1, None, 10.0))).await;
    let hung = FakeModelServer::start(Behavior::Hang).await;
    let cp = start(&config_yaml(
        &[("a", ok.addr()), ("b", hung.addr())],
        &[],
        "",
    ))
    .await;
    wait_for(WAIT, "b to time out", || state(&cp, "p/b").attempted).await;
    // A timeout means reachable but slow: up, no stats, never scraped (stale).
    let b = state(&cp, "p/b");
    assert!(b.healthy);
    assert_eq!((b.stats.is_none(), b.scraped_at_ms), (true, 0));
    assert_eq!(b.last_error.as_deref(), Some("timed out after 150ms"));
    // While b hangs (150 ms per try), a keeps being scraped every ~20 ms.
    let first = state(&cp, "p/a").scraped_at_ms;
    wait_for(WAIT, "a to be scraped again", || {
        state(&cp, "p/a").scraped_at_ms > first
    })
    .await;
    let a = state(&cp, "p/a");
    assert!(a.healthy);
    assert_eq!(a.stats.as_ref().unwrap().kv_usage, Some(0.5));
    wait_for(WAIT, "snapshot with both", || {
        cp.hub()
            .latest()
            .is_some_and(|p| p.snapshot().unwrap().endpoints.iter().all(|e| e.healthy))
    })
    .await;
    let snap = cp.hub().latest().unwrap().snapshot().unwrap();
    let ids: Vec<(&str, bool, bool)> = snap
        .endpoints
        .iter()
        .map(|e| (e.id.as_str(), e.healthy, e.scraped_at_ms > 0))
        .collect();
    assert_eq!(ids, vec![("p/a", true, true), ("p/b", true, false)]);
    assert_eq!(cp.hub().counts().stale, 1);
    let (_, metrics) = get(&format!("http://{}/metrics", cp.local_addr())).await;
    assert!(
        metrics.contains("kvroute_cp_scrape_errors_total{endpoint=\"p/b\",reason=\"timeout\"}"),
        "{metrics}"
    );
    cp.shutdown().await;
}

/// A body over `scrape::PARSE_OFFLOAD_BYTES` (parsed on the blocking pool) gives the same
/// stats as a small one: 2 MiB of histogram buckets the adapters skip, then the gauges.
#[tokio::test]
async fn a_body_over_the_offload_size_is_read_whole() {
    let mut body = String::new();
    let mut le = 0u64;
    while body.len() <= 2 * kvroute_cp::scrape::PARSE_OFFLOAD_BYTES {
        body.push_str(&format!(
            "vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"{le}\"}} {le}\n"
        ));
        le += 1;
    }
    body.push_str(&vllm_body(0.375, 3, 2, None, 10.0));
    let big = FakeModelServer::start(Behavior::Body(body)).await;
    let cp = start(&config_yaml(&[("b", big.addr())], &[], "")).await;
    wait_for(WAIT, "b scraped", || cp.hub().all_attempted()).await;
    let s = state(&cp, "p/b");
    assert!(s.healthy, "{:?}", s.last_error);
    let stats = s.stats.unwrap();
    assert_eq!(stats.kv_usage, Some(0.375));
    assert_eq!((stats.running, stats.waiting), (3, 2));
    assert_eq!(stats.kv_capacity_tokens, Some(16_000));
    cp.shutdown().await;
}

#[tokio::test]
async fn garbage_and_500_are_unhealthy_with_the_reason() {
    let garbage =
        FakeModelServer::start(Behavior::Body("<html>502 Bad Gateway</html>\n".into())).await;
    let err = FakeModelServer::start(Behavior::Status(500)).await;
    let unknown = FakeModelServer::start(Behavior::Body("go_goroutines 12\n".into())).await;
    let cp = start(&config_yaml(
        &[
            ("g", garbage.addr()),
            ("e", err.addr()),
            ("u", unknown.addr()),
        ],
        &[],
        "",
    ))
    .await;
    wait_for(WAIT, "all scraped", || cp.hub().all_attempted()).await;
    assert_eq!(
        state(&cp, "p/g").last_error.as_deref(),
        Some(
            "not a Prometheus exposition: no line is a metric sample; line 1: metric name must start with a letter, `_` or `:`"
        )
    );
    assert_eq!(
        state(&cp, "p/e").last_error.as_deref(),
        Some("HTTP status 500")
    );
    assert_eq!(
        state(&cp, "p/u").last_error.as_deref(),
        Some("no known model-server metrics (looked for vllm:, sglang:, tgi_, llamacpp:, nv_trt_llm_)")
    );
    for id in ["p/g", "p/e", "p/u"] {
        let s = state(&cp, id);
        assert!(
            !s.healthy && s.stats.is_none() && s.scraped_at_ms == 0,
            "{id}"
        );
    }
    // A garbage endpoint that recovers becomes healthy.
    garbage.set(Behavior::Body(vllm_body(0.25, 0, 0, None, 1.0)));
    wait_for(WAIT, "g to recover", || state(&cp, "p/g").healthy).await;
    let (_, metrics) = get(&format!("http://{}/metrics", cp.local_addr())).await;
    assert!(metrics.contains("kvroute_cp_scrape_errors_total{endpoint=\"p/e\",reason=\"status\"}"));
    assert!(metrics.contains("kvroute_cp_scrape_errors_total{endpoint=\"p/g\",reason=\"parse\"}"));
    cp.shutdown().await;
}

#[tokio::test]
async fn vanished_endpoint_turns_unhealthy_and_keeps_last_stats() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.75, 4, 0, None, 10.0))).await;
    let addr = srv.addr();
    let cp = start(&config_yaml(&[("a", addr)], &[], "")).await;
    wait_for(WAIT, "a healthy", || state(&cp, "p/a").healthy).await;
    let scraped = state(&cp, "p/a").scraped_at_ms;
    srv.server.stop();
    drop(srv);
    wait_for(WAIT, "a unhealthy", || !state(&cp, "p/a").healthy).await;
    let a = state(&cp, "p/a");
    assert!(
        a.last_error
            .as_deref()
            .unwrap()
            .starts_with("request failed"),
        "{:?}",
        a.last_error
    );
    assert_eq!(a.stats.as_ref().unwrap().kv_usage, Some(0.75));
    assert!(a.scraped_at_ms >= scraped);
    wait_for(WAIT, "snapshot shows it", || {
        cp.hub()
            .latest()
            .is_some_and(|p| !p.snapshot().unwrap().endpoints[0].healthy)
    })
    .await;
    // Comes back on the same port.
    let _back =
        FakeModelServer::start_on(addr, Behavior::Body(vllm_body(0.1, 0, 0, None, 20.0))).await;
    wait_for(WAIT, "a healthy again", || state(&cp, "p/a").healthy).await;
    cp.shutdown().await;
}

#[tokio::test]
async fn restart_in_place_changes_process_start() {
    let srv =
        FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, Some(1000.0), 500.0))).await;
    let cnt = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 500.0))).await;
    let ingest = FakeIngest::start().await;
    let cp = start(&config_yaml(
        &[("a", srv.addr()), ("c", cnt.addr())],
        &[ingest.url()],
        "",
    ))
    .await;
    wait_for(WAIT, "first push", || ingest.count() > 0).await;
    let ep = |id: &str| {
        ingest
            .last()
            .and_then(|r| r.snapshot.endpoints.into_iter().find(|e| e.id == id))
    };
    assert_eq!(ep("p/a").unwrap().process_start_ms, Some(1_000_000));
    // No start time exported: the first scrape's time stands in.
    let c_first = ep("p/c").unwrap().process_start_ms.unwrap();
    // a restarts with a newer start time; c restarts and its counter goes down.
    let before = hub_now();
    srv.set(Behavior::Body(vllm_body(0.0, 0, 0, Some(2000.0), 3.0)));
    cnt.set(Behavior::Body(vllm_body(0.0, 0, 0, None, 3.0)));
    wait_for(WAIT, "restart of a pushed", || {
        ep("p/a").and_then(|e| e.process_start_ms) == Some(2_000_000)
    })
    .await;
    wait_for(WAIT, "restart of c pushed", || {
        ep("p/c").and_then(|e| e.process_start_ms) != Some(c_first)
    })
    .await;
    let c_start = ep("p/c").unwrap().process_start_ms.unwrap();
    assert!(
        c_start >= before && c_start <= hub_now(),
        "{c_start} not in [{before}, now]"
    );
    assert_eq!(state(&cp, "p/a").restart.restarts, 1);
    assert_eq!(state(&cp, "p/c").restart.restarts, 1);
    cp.shutdown().await;
}

fn hub_now() -> u64 {
    kvroute_cp::hub::now_ms()
}

/// `scraped_at_ms` is when the scrape began, not when its slow `/slots` answered: the
/// filter counts a reservation made after a scrape's time as unseen by it, and one made
/// while this scrape ran was not in its `/metrics`.
#[tokio::test]
async fn a_scrape_is_stamped_with_its_start() {
    let (body, slots) = llamacpp_server_body();
    let srv = FakeModelServer::start(body).await;
    *srv.slots.lock().unwrap() = Some(slots);
    *srv.slots_delay.lock().unwrap() = Duration::from_millis(300);
    let yaml = config_yaml(&[("l", srv.addr())], &[], "")
        .replace("interval_ms: 20", "interval_ms: 200")
        .replace("timeout_ms: 150", "timeout_ms: 1000");
    let cp = start(&yaml).await;
    wait_for(WAIT, "a scrape", || state(&cp, "p/l").scraped_at_ms > 0).await;
    // Recorded once /slots answered, 300 ms after the scrape began: already that old.
    let age = hub_now().saturating_sub(state(&cp, "p/l").scraped_at_ms);
    assert!(age >= 300, "scrape stamped {age} ms ago");
    cp.shutdown().await;
}

#[tokio::test]
async fn ingest_down_then_back_gets_newer_versions() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let ingest = FakeIngest::start().await;
    let addr = ingest.server.addr;
    let cp = start(&config_yaml(&[("a", srv.addr())], &[ingest.url()], "")).await;
    wait_for(WAIT, "first push", || ingest.count() > 0).await;
    let last_before = ingest.last().unwrap().snapshot.version;
    ingest.server.stop();
    drop(ingest);
    let (_, _) = get(&format!("http://{}/metrics", cp.local_addr())).await;
    wait_for(WAIT, "push failures counted", || {
        cp.hub()
            .telemetry
            .push_failures
            .get(&kvroute_cp::telemetry::TargetReason {
                target: "envoy-0".into(),
                reason: "connect".into(),
            })
            .is_some_and(|c| c.get() >= 2)
    })
    .await;
    let back = FakeIngest::start_on(addr).await;
    wait_for(WAIT, "push after recovery", || back.count() > 0).await;
    let first_after = back.received.lock().unwrap()[0].snapshot.version;
    assert!(first_after > last_before, "{first_after} <= {last_before}");
    // Versions received keep increasing.
    wait_for(WAIT, "three pushes", || back.count() >= 3).await;
    let versions: Vec<u64> = back
        .received
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.snapshot.version)
        .collect();
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    cp.shutdown().await;
}

/// What a test's `tracing` subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Capture this thread's `info` and above (the test's current-thread runtime, where
    /// kvroute-cp's tasks run) until the guard drops.
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .without_time()
                .with_max_level(tracing::Level::INFO)
                .finish(),
        )
    }

    /// The lines written so far that contain `text`.
    fn lines_with(&self, text: &str) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .filter(|l| l.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

/// A target's first accepted push is logged at `info` exactly once, with the version the
/// ingest took; the pushes after it are not, until one fails: the first accepted after the
/// failure is logged once more.
#[tokio::test]
async fn the_first_accepted_push_is_logged_once() {
    const ACCEPTED: &str = "snapshot accepted by the ingest listener";
    let logs = Logs::default();
    let _capture = logs.capture();
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let ingest = FakeIngest::start().await;
    let cp = start(&config_yaml(&[("a", srv.addr())], &[ingest.url()], "")).await;
    wait_for(WAIT, "three pushes", || ingest.count() >= 3).await;
    let version = |i: usize| ingest.received.lock().unwrap()[i].snapshot.version;
    let line = |v: u64| {
        format!(
            " INFO kvroute_cp::push: {ACCEPTED} target=envoy-0 url={} version={v}",
            ingest.url()
        )
    };
    assert_eq!(logs.lines_with(ACCEPTED), vec![line(version(0))]);
    // The ingest fails pushes (nothing is recorded), then takes them again.
    *ingest.status.lock().unwrap() = 500;
    wait_for(WAIT, "a failed push", || {
        cp.hub()
            .telemetry
            .push_failures
            .get(&kvroute_cp::telemetry::TargetReason {
                target: "envoy-0".into(),
                reason: "500".into(),
            })
            .is_some_and(|c| c.get() >= 1)
    })
    .await;
    let before = ingest.count();
    *ingest.status.lock().unwrap() = 204;
    wait_for(WAIT, "three pushes after recovery", || {
        ingest.count() >= before + 3
    })
    .await;
    assert_eq!(
        logs.lines_with(ACCEPTED),
        vec![line(version(0)), line(version(before))]
    );
    cp.shutdown().await;
}

#[tokio::test]
async fn one_unreachable_target_does_not_delay_the_other() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let good = FakeIngest::start().await;
    // A target that accepts connections (kernel backlog) but never answers: every push to
    // it waits for the 200 ms push timeout.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_addr = hung.local_addr().unwrap();
    let cp = start(&config_yaml(
        &[("a", srv.addr())],
        &[
            format!("http://{hung_addr}/kvroute/v1/snapshot"),
            good.url(),
        ],
        "",
    ))
    .await;
    let timeouts = || {
        cp.hub()
            .telemetry
            .push_failures
            .get(&kvroute_cp::telemetry::TargetReason {
                target: "envoy-0".into(),
                reason: "timeout".into(),
            })
            .map_or(0, |c| c.get())
    };
    wait_for(WAIT, "two timeouts on the hung target", || timeouts() >= 2).await;
    // Two timeouts took >= 400 ms; with a 100 ms heartbeat the good target was fed meanwhile.
    assert!(
        good.count() >= 3,
        "good target got only {} pushes",
        good.count()
    );
    drop(hung);
    cp.shutdown().await;
}

#[tokio::test]
async fn bearer_token_from_file_and_401_counted() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let ingest = FakeIngest::start().await;
    let extra = format!("  token_file: {}\n", token.display());
    let cp = start(&config_yaml(&[("a", srv.addr())], &[ingest.url()], &extra)).await;
    wait_for(WAIT, "push", || ingest.count() > 0).await;
    assert_eq!(
        ingest.last().unwrap().auth.as_deref(),
        Some("Bearer s3cret")
    );
    *ingest.status.lock().unwrap() = 401;
    wait_for(WAIT, "401 counted", || {
        cp.hub()
            .telemetry
            .push_failures
            .get(&kvroute_cp::telemetry::TargetReason {
                target: "envoy-0".into(),
                reason: "401".into(),
            })
            .is_some_and(|c| c.get() >= 1)
    })
    .await;
    cp.shutdown().await;
}

#[tokio::test]
async fn own_endpoints() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 2, 1, None, 1.0))).await;
    let cp = start(&config_yaml(&[("a", srv.addr())], &[], "")).await;
    let base = format!("http://{}", cp.local_addr());
    assert_eq!(get(&format!("{base}/healthz")).await, (200, "ok\n".into()));
    wait_for(WAIT, "ready", || cp.hub().ready()).await;
    assert_eq!(
        get(&format!("{base}/readyz")).await,
        (200, "ready\n".into())
    );
    let (status, body) = get(&format!("{base}/v1/snapshot")).await;
    assert_eq!(status, 200);
    let snap = kvroute_core::snapshot::Snapshot::decode(body.as_bytes()).unwrap();
    let e = &snap.endpoints[0];
    assert_eq!(
        (e.id.as_str(), e.address.as_str(), e.cluster.as_str()),
        ("p/a", srv.addr().to_string().as_str(), "p")
    );
    assert_eq!(
        (
            e.kv_usage,
            e.kv_capacity_tokens,
            e.block_size,
            e.running,
            e.waiting
        ),
        (Some(0.5), Some(16_000), Some(16), 2, 1)
    );
    assert_eq!(e.models, vec!["m".to_string()]);
    let (status, metrics) = get(&format!("{base}/metrics")).await;
    assert_eq!(status, 200);
    for needle in [
        "kvroute_cp_endpoints{state=\"healthy\"} 1",
        "kvroute_cp_endpoints{state=\"pending\"} 0",
        "# TYPE kvroute_cp_scrape_duration_seconds histogram",
        "# TYPE kvroute_cp_snapshot_age_seconds gauge",
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
    assert_eq!(get(&format!("{base}/nope")).await.0, 404);
    cp.shutdown().await;
}

#[tokio::test]
async fn version_grows_across_restarts_and_reload_changes_endpoints() {
    let a = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let b = FakeModelServer::start(Behavior::Body(vllm_body(0.2, 1, 0, None, 1.0))).await;
    let cp = start(&config_yaml(&[("a", a.addr())], &[], "")).await;
    wait_for(WAIT, "snapshot", || cp.hub().ready()).await;
    let v1 = cp.hub().latest().unwrap().version;
    cp.reload(Config::from_yaml(&config_yaml(&[("b", b.addr())], &[], "")).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "reloaded snapshot", || {
        cp.hub().latest().is_some_and(|p| {
            let s = p.snapshot().unwrap();
            s.endpoints.len() == 1 && s.endpoints[0].id == "p/b" && s.endpoints[0].healthy
        })
    })
    .await;
    let v2 = cp.hub().latest().unwrap().version;
    cp.shutdown().await;
    let cp = start(&config_yaml(&[("a", a.addr())], &[], "")).await;
    wait_for(WAIT, "snapshot after restart", || cp.hub().ready()).await;
    let v3 = cp.hub().latest().unwrap().version;
    assert!(v1 < v2 && v2 < v3, "{v1} {v2} {v3}");
    cp.shutdown().await;
}

#[tokio::test]
async fn llamacpp_uses_slots() {
    let srv = FakeModelServer::start(Behavior::Body(
        "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\nllamacpp:prompt_tokens_total 5\n".into(),
    ))
    .await;
    *srv.slots.lock().unwrap() = Some(
        r#"[{"id":0,"n_ctx":1000,"is_processing":true,"n_prompt_tokens":200,"next_token":[{"n_decoded":50}]},{"id":1,"n_ctx":1000,"is_processing":false,"n_prompt_tokens":900}]"#.into(),
    );
    let cp = start(&config_yaml(&[("l", srv.addr())], &[], "")).await;
    wait_for(WAIT, "scraped", || state(&cp, "p/l").healthy).await;
    let s = state(&cp, "p/l").stats.unwrap();
    assert_eq!(
        (s.kv_usage, s.kv_capacity_tokens, s.running),
        (Some(0.125), Some(2000), 1)
    );
    // /slots disabled: healthy, KV unknown.
    *srv.slots.lock().unwrap() = None;
    wait_for(WAIT, "kv unknown", || {
        state(&cp, "p/l").stats.unwrap().kv_usage.is_none()
    })
    .await;
    assert!(state(&cp, "p/l").healthy);
    cp.shutdown().await;
}

/// `/metrics` and `/slots` of a small llama.cpp server: 1 processing, 200 + 50 of 2 × 1000
/// tokens in use.
fn llamacpp_server_body() -> (Behavior, String) {
    (
        Behavior::Body(
            "llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\nllamacpp:prompt_tokens_total 5\n"
                .into(),
        ),
        r#"[{"id":0,"n_ctx":1000,"is_processing":true,"n_prompt_tokens":200,"next_token":[{"n_decoded":50}]},{"id":1,"n_ctx":1000,"is_processing":false,"n_prompt_tokens":900}]"#
            .into(),
    )
}

/// The error of a scrape answered 401.
const SCRAPE_401: &str = "HTTP status 401: the server wants credentials (e.g. llama-server \
    `--api-key`); put its key in `scrape.token_file` or `scrape.token_env`, or in its pool's \
    `scrape_token_file` or `scrape_token_env` (sent as `Authorization: Bearer`), or check \
    the key there";

/// A llama-server started with `--api-key` answers 401 without the key: the endpoint is
/// down with an error naming the scrape token settings. A reload adding `scrape.token_env`
/// restarts the scrapers with the key: healthy with its stats, and both `/metrics` and
/// `/slots` carried exactly `Authorization: Bearer <key>`.
#[tokio::test]
async fn api_key_server_is_down_without_the_scrape_token_and_up_with_it() {
    const VAR: &str = "KVROUTE_CP_FAULTS_SCRAPE_TOKEN";
    const KEY: &str = "llama-key-0123456789";
    // Only this test reads this variable; it is set before kvroute-cp starts.
    std::env::set_var(VAR, KEY);
    let (metrics, slots) = llamacpp_server_body();
    let srv = FakeModelServer::start(metrics).await;
    *srv.slots.lock().unwrap() = Some(slots);
    *srv.api_key.lock().unwrap() = Some(KEY.into());
    let yaml = config_yaml(&[("l", srv.addr())], &[], "").replace("kind: auto", "kind: llamacpp");
    let cp = start(&yaml).await;
    wait_for(WAIT, "a scrape answered 401", || {
        state(&cp, "p/l").attempted
    })
    .await;
    let l = state(&cp, "p/l");
    assert!(!l.healthy);
    assert_eq!(l.last_error.as_deref(), Some(SCRAPE_401));
    assert!(
        srv.requests
            .lock()
            .unwrap()
            .iter()
            .all(|(_, a)| a.is_none()),
        "no Authorization without a scrape token"
    );

    let with_token = yaml.replace(
        "  jitter: 0.1\n",
        &format!("  jitter: 0.1\n  token_env: {VAR}\n"),
    );
    cp.reload(Config::from_yaml(&with_token).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "healthy with the key", || state(&cp, "p/l").healthy).await;
    let l = state(&cp, "p/l");
    assert_eq!(l.last_error, None);
    let s = l.stats.unwrap();
    assert_eq!(
        (s.kv_usage, s.kv_capacity_tokens, s.running, s.waiting),
        (Some(0.125), Some(2000), 1, 0)
    );
    let want = format!("Bearer {KEY}");
    let requests = srv.requests.lock().unwrap().clone();
    let last = |path: &str| {
        requests
            .iter()
            .rev()
            .find(|(p, _)| p == path)
            .and_then(|(_, a)| a.clone())
    };
    assert_eq!(last("/metrics"), Some(want.clone()));
    assert_eq!(last("/slots"), Some(want));
    cp.shutdown().await;
}

/// A pool's own scrape token goes to its endpoints only; the other pool's get
/// `scrape.token_env`'s, and no server sees another's key. A reload that drops the pool's
/// own token falls back to `scrape.token_env`'s for it (its server, wanting its own key,
/// then answers 401); one that gives it back, with a new value in its variable, uses that.
#[tokio::test]
async fn a_pools_own_scrape_token_goes_to_its_endpoints_only() {
    const SHARED_VAR: &str = "KVROUTE_CP_FAULTS_SHARED_SCRAPE_TOKEN";
    const OWN_VAR: &str = "KVROUTE_CP_FAULTS_POOL_SCRAPE_TOKEN";
    const SHARED: &str = "shared-key-0123456789";
    const OWN: &str = "own-key-0123456789";
    // Only this test reads these variables; they are set before kvroute-cp starts.
    std::env::set_var(SHARED_VAR, SHARED);
    std::env::set_var(OWN_VAR, OWN);
    let start_server = |key: &'static str| async move {
        let (metrics, slots) = llamacpp_server_body();
        let srv = FakeModelServer::start(metrics).await;
        *srv.slots.lock().unwrap() = Some(slots);
        *srv.api_key.lock().unwrap() = Some(key.into());
        srv
    };
    let own = start_server(OWN).await;
    let shared = start_server(SHARED).await;
    let yaml = |own_token: &str| {
        format!(
            "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 150\n  token_env: {SHARED_VAR}\n\
             targets: []\npools:\n\
             \x20 - name: a\n    kind: llamacpp\n    models: [m]\n{own_token}    endpoints:\n      - {{name: l, address: '{}'}}\n\
             \x20 - name: b\n    kind: llamacpp\n    models: [m]\n    endpoints:\n      - {{name: l, address: '{}'}}\n",
            own.addr(),
            shared.addr()
        )
    };
    let with_own = yaml(&format!("    scrape_token_env: {OWN_VAR}\n"));
    let cp = start(&with_own).await;
    wait_for(WAIT, "both healthy with their keys", || {
        state(&cp, "a/l").healthy
            && state(&cp, "a/l").stats.is_some()
            && state(&cp, "b/l").healthy
            && state(&cp, "b/l").stats.is_some()
    })
    .await;
    let keys = |srv: &FakeModelServer| {
        srv.requests
            .lock()
            .unwrap()
            .iter()
            .map(|(_, a)| a.clone())
            .collect::<std::collections::BTreeSet<_>>()
    };
    let only = |k: &str| std::collections::BTreeSet::from([Some(format!("Bearer {k}"))]);
    assert_eq!(
        keys(&own),
        only(OWN),
        "pool a's server saw only its own key"
    );
    assert_eq!(
        keys(&shared),
        only(SHARED),
        "pool b's server saw only the shared key"
    );

    // Without its own token, pool a's endpoint gets the shared one: 401, down.
    own.requests.lock().unwrap().clear();
    cp.reload(Config::from_yaml(&yaml("")).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "a down with the shared key", || {
        state(&cp, "a/l").last_error.as_deref() == Some(SCRAPE_401)
    })
    .await;
    assert!(keys(&own).contains(&Some(format!("Bearer {SHARED}"))));

    // Its own token again, now with another value in the variable: picked up.
    const ROTATED: &str = "own-key-rotated-0123";
    std::env::set_var(OWN_VAR, ROTATED);
    *own.api_key.lock().unwrap() = Some(ROTATED.into());
    cp.reload(Config::from_yaml(&with_own).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "a healthy with the rotated key", || {
        state(&cp, "a/l").healthy && state(&cp, "a/l").last_error.is_none()
    })
    .await;
    let last = own.requests.lock().unwrap().last().cloned();
    assert_eq!(last.and_then(|(_, a)| a), Some(format!("Bearer {ROTATED}")));
    cp.shutdown().await;
}

/// A scrape token file rotated the way kubelet updates a Secret volume is used from the
/// next scrape, with no reload; a rotation to an empty file, a FIFO or `/dev/zero` keeps the
/// previous token and counts `kvroute_cp_file_reload_failures_total{source="scrape.token_file"}`.
#[tokio::test]
async fn rotated_scrape_token_file_is_used_without_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    kubelet_write(dir.path(), 0, &[("token", b"key-a\n")]);
    let (metrics, slots) = llamacpp_server_body();
    let srv = FakeModelServer::start(metrics).await;
    *srv.slots.lock().unwrap() = Some(slots);
    *srv.api_key.lock().unwrap() = Some("key-a".into());
    let yaml = config_yaml(&[("l", srv.addr())], &[], "").replace(
        "  jitter: 0.1\n",
        &format!(
            "  jitter: 0.1\n  token_file: {}\n",
            dir.path().join("token").display()
        ),
    );
    let cp = start(&yaml).await;
    wait_for(WAIT, "healthy with key-a", || state(&cp, "p/l").healthy).await;
    // The server's key changes: 401, down.
    *srv.api_key.lock().unwrap() = Some("key-b".into());
    wait_for(WAIT, "down on 401", || {
        state(&cp, "p/l").last_error.as_deref() == Some(SCRAPE_401)
    })
    .await;
    assert!(!state(&cp, "p/l").healthy);
    // The Secret is updated: healthy again with the new key.
    kubelet_write(dir.path(), 1, &[("token", b"key-b\n")]);
    wait_for(WAIT, "healthy with key-b", || state(&cp, "p/l").healthy).await;
    assert_eq!(
        srv.requests.lock().unwrap().last().unwrap().1.as_deref(),
        Some("Bearer key-b")
    );
    // An empty token file: the previous token stays, the failure is counted.
    let failures = || {
        cp.hub()
            .telemetry
            .file_reload_failures
            .get(&kvroute_cp::telemetry::SourceLabel {
                source: "scrape.token_file".into(),
            })
            .map_or(0, |c| c.get())
    };
    assert_eq!(failures(), 0);
    // Scrapes go on, healthy, with `key`.
    let scrapes_go_on_with = |key: &'static str| {
        let n = srv.requests.lock().unwrap().len();
        let (srv, cp) = (&srv, &cp);
        async move {
            wait_for(WAIT, "more scrapes", || {
                srv.requests.lock().unwrap().len() > n + 2
            })
            .await;
            assert!(state(cp, "p/l").healthy);
            assert_eq!(
                srv.requests.lock().unwrap().last().unwrap().1.as_deref(),
                Some(format!("Bearer {key}").as_str())
            );
        }
    };
    kubelet_write(dir.path(), 2, &[("token", b"\n")]);
    wait_for(WAIT, "failed reload counted", || failures() == 1).await;
    scrapes_go_on_with("key-b").await;
    // The token swapped for a link to /dev/zero, then (after a good one) for a FIFO:
    // neither is read (/dev/zero never ends, a FIFO blocked its reader); each is a failed
    // reload, and scraping goes on with the previous token.
    let token = dir.path().join("token");
    std::fs::remove_file(&token).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &token).unwrap();
    wait_for(WAIT, "/dev/zero refused", || failures() == 2).await;
    std::fs::remove_file(&token).unwrap();
    std::fs::write(&token, "key-c\n").unwrap();
    *srv.api_key.lock().unwrap() = Some("key-c".into());
    wait_for(WAIT, "scrapes with key-c", || {
        srv.requests
            .lock()
            .unwrap()
            .last()
            .and_then(|r| r.1.clone())
            .as_deref()
            == Some("Bearer key-c")
    })
    .await;
    std::fs::remove_file(&token).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&token)
        .status()
        .unwrap()
        .success());
    wait_for(WAIT, "FIFO refused", || failures() == 3).await;
    scrapes_go_on_with("key-c").await;
    cp.shutdown().await;
}

/// Issue 14, case 1: a busy llama-server answers `/metrics` at once and `/slots` after 2 s,
/// with a 500 ms scrape timeout. Real capture (`llamacpp-server-b11434-real-busy.*`):
/// 4 processing, 1 deferred; `/slots` holds 67 + 109 + 111 + 111 = 398 of 4 × 1024 tokens.
#[tokio::test]
async fn busy_llamacpp_is_stale_not_dead() {
    let srv = FakeModelServer::start(Behavior::Body(fixture(
        "llamacpp-server-b11434-real-busy.prom",
    )))
    .await;
    *srv.slots.lock().unwrap() = Some(fixture("llamacpp-server-b11434-real-busy.slots.json"));
    *srv.slots_delay.lock().unwrap() = Duration::from_secs(2);
    let yaml = config_yaml(&[("l", srv.addr())], &[], "")
        .replace("interval_ms: 20", "interval_ms: 200")
        .replace("timeout_ms: 150", "timeout_ms: 500");
    let cp = start(&yaml).await;
    let slots_timeouts = || {
        cp.hub()
            .telemetry
            .scrape_errors
            .get(&kvroute_cp::telemetry::EndpointReason {
                endpoint: "p/l".into(),
                reason: "slots_timeout".into(),
            })
            .map_or(0, |c| c.get())
    };
    wait_for(WAIT, "two /slots timeouts", || slots_timeouts() >= 2).await;
    let l = state(&cp, "p/l");
    assert!(l.healthy);
    assert_eq!(l.last_error, None);
    let s = l.stats.unwrap();
    // The primary signal is kept; KV usage is unknown (no /slots reading yet), never 0.
    assert_eq!((s.running, s.waiting, s.kv_usage), (4, 1, None));
    assert_eq!(s.monotonic_total, Some(184.0 + 21.0));
    // Scrapes stay fresh while /slots times out.
    let t = l.scraped_at_ms;
    wait_for(WAIT, "a fresher scrape", || {
        state(&cp, "p/l").scraped_at_ms > t
    })
    .await;
    // /slots answers again: KV usage from it.
    *srv.slots_delay.lock().unwrap() = Duration::ZERO;
    wait_for(WAIT, "KV from /slots", || {
        state(&cp, "p/l").stats.unwrap().kv_usage == Some(398.0 / 4096.0)
    })
    .await;
    // Busy again: the previous /slots reading stands in, the endpoint stays up and fresh.
    *srv.slots_delay.lock().unwrap() = Duration::from_secs(2);
    let before = slots_timeouts();
    wait_for(WAIT, "another /slots timeout", || slots_timeouts() > before).await;
    let l = state(&cp, "p/l");
    assert!(l.healthy);
    let s = l.stats.unwrap();
    assert_eq!(
        (s.kv_usage, s.kv_capacity_tokens, s.running),
        (Some(398.0 / 4096.0), Some(4096), 4)
    );
    let snap = cp.hub().latest().unwrap().snapshot().unwrap();
    assert!(snap.endpoints[0].healthy);
    cp.shutdown().await;
}

/// Every replica timing out (busy): the snapshot keeps them up with aging stats, and the
/// core picker falls back to least-request over them instead of answering 503.
#[tokio::test]
async fn all_replicas_slow_never_means_no_endpoints() {
    use kvroute_core::picker::{
        PickInput, PickOutcome, PickReason, PickRequest, Picker, PickerConfig,
    };
    let a = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 2, 0, None, 1.0))).await;
    let b = FakeModelServer::start(Behavior::Body(vllm_body(0.2, 9, 0, None, 1.0))).await;
    let cp = start(&config_yaml(&[("a", a.addr()), ("b", b.addr())], &[], "")).await;
    wait_for(WAIT, "both scraped", || {
        state(&cp, "p/a").scraped_at_ms > 0 && state(&cp, "p/b").scraped_at_ms > 0
    })
    .await;
    a.set(Behavior::Hang);
    b.set(Behavior::Hang);
    wait_for(WAIT, "both timing out", || {
        state(&cp, "p/a").last_error.is_some() && state(&cp, "p/b").last_error.is_some()
    })
    .await;
    assert_eq!(cp.hub().counts().stale, 2);
    let p = cp.hub().publish();
    let snap = p.snapshot().unwrap();
    assert!(snap.endpoints.iter().all(|e| e.healthy));
    let mut picker = Picker::new(PickerConfig::default(), 7).unwrap();
    let stale_after = picker.config().stale_after_ms;
    let input = PickInput {
        snapshot: &snap,
        inflight: &[],
        prefix_match_blocks: &[],
        now_ms: p.generated_at_ms + stale_after + 1_000,
    };
    let req = PickRequest {
        model: Some("m"),
        api: kvroute_core::analysis::ApiKind::ChatCompletions,
        prompt_tokens: 100,
        output_limit: 100,
        demand_tokens: 200,
        prefix_blocks: 0,
    };
    match picker.pick(&input, &req) {
        PickOutcome::Picked(pick) => {
            assert_eq!(pick.reason, PickReason::StaleFallback);
            // Least-request: a (2 running) before b (9 running).
            assert_eq!(snap.endpoints[pick.primary].id, "p/a");
        }
        other => panic!("expected a stale fallback pick, got {other:?}"),
    }
    cp.shutdown().await;
}

/// Refused connections mark an endpoint down only when repeated; one 503 (failed
/// readiness, e.g. llama.cpp loading a model) marks it down at once.
#[tokio::test]
async fn refused_twice_or_not_ready_marks_down() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let hub = kvroute_cp::hub::Hub::new(
        Duration::from_secs(1),
        Duration::ZERO,
        Duration::from_secs(1),
    );
    let spec = Config::from_yaml(&config_yaml(&[("a", srv.addr())], &[], ""))
        .unwrap()
        .endpoints
        .remove(0);
    hub.set_endpoints(std::slice::from_ref(&spec));
    use kvroute_cp::scrape::FailureClass::*;
    hub.record_success("p/a", Default::default(), 1_000);
    hub.record_failure("p/a", Unreachable, "refused".into());
    assert!(
        hub.endpoint("p/a").unwrap().healthy,
        "one refusal is not down"
    );
    hub.record_failure("p/a", Stale, "timed out".into());
    hub.record_failure("p/a", Unreachable, "refused".into());
    assert!(
        hub.endpoint("p/a").unwrap().healthy,
        "a timeout in between resets the run"
    );
    hub.record_failure("p/a", Unreachable, "refused".into());
    assert!(
        !hub.endpoint("p/a").unwrap().healthy,
        "two refusals in a row are down"
    );
    hub.record_success("p/a", Default::default(), 2_000);
    hub.record_failure("p/a", NotReady, "HTTP status 503".into());
    assert!(!hub.endpoint("p/a").unwrap().healthy, "503 is down at once");
    // Through the scraper: a 503 is down with its reason.
    srv.set(Behavior::Status(503));
    let cp = start(&config_yaml(&[("a", srv.addr())], &[], "")).await;
    wait_for(WAIT, "scraped", || state(&cp, "p/a").attempted).await;
    let a = state(&cp, "p/a");
    assert_eq!(
        (a.healthy, a.last_error.as_deref()),
        (false, Some("HTTP status 503"))
    );
    cp.shutdown().await;
}

/// A control plane whose one target answers every push `status` (`extra`: `push:`
/// settings): `/readyz` answers 503 with the line `reason(target URL)`, then 200 once the
/// target accepts pushes again. Returns `/metrics` while refused and after.
async fn readyz_refused_then_ready(
    status: u16,
    extra: &str,
    reason: impl Fn(&str) -> String,
) -> (String, String) {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let ingest = FakeIngest::start().await;
    *ingest.status.lock().unwrap() = status;
    let cp = start(&config_yaml(&[("a", srv.addr())], &[ingest.url()], extra)).await;
    let base = format!("http://{}", cp.local_addr());
    wait_for(WAIT, "refusal noted", || {
        cp.hub()
            .not_ready_reason()
            .is_some_and(|r| r.contains(&status.to_string()))
    })
    .await;
    assert_eq!(
        get(&format!("{base}/readyz")).await,
        (
            503,
            format!(
                "not ready: pushes to target `envoy-0` are rejected: {}\n",
                reason(&ingest.url())
            )
        )
    );
    let (_, refused) = get(&format!("{base}/metrics")).await;
    *ingest.status.lock().unwrap() = 204;
    wait_for(WAIT, "ready again", || cp.hub().ready()).await;
    assert_eq!(
        get(&format!("{base}/readyz")).await,
        (200, "ready\n".into())
    );
    let (_, after) = get(&format!("{base}/metrics")).await;
    cp.shutdown().await;
    (refused, after)
}

/// Issue 14, case 6: a wrong ingest token is named in `/readyz`, counted in a metric, and
/// clears when the token is accepted again.
#[tokio::test]
async fn rejected_token_makes_readyz_fail_with_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "wrong-token\n").unwrap();
    let extra = format!("  token_file: {}\n", token.display());
    let (refused, after) = readyz_refused_then_ready(401, &extra, |url| {
        format!(
            "ingest {url} answered HTTP 401: it rejected the ingest token (file `{}`); it must \
             equal the filter's `ingest_token`",
            token.display()
        )
    })
    .await;
    assert!(
        refused.contains("kvroute_cp_push_auth_rejected{target=\"envoy-0\"} 1"),
        "{refused}"
    );
    assert!(after.contains("kvroute_cp_push_auth_rejected{target=\"envoy-0\"} 0"));
}

/// A target URL that answers 404 (not the filter's ingest listener, e.g. Envoy's client
/// listener) holds `/readyz` at 503 with the hint, as a rejected token does, without the
/// token metric; a push accepted clears it.
#[tokio::test]
async fn a_404_from_the_target_makes_readyz_fail_with_the_hint() {
    let (refused, _) = readyz_refused_then_ready(404, "", |url| {
        format!(
            "ingest {url} answered HTTP 404: is `url` the filter's ingest listener? a 404 comes \
             from a listener or route without the kvroute ingest (e.g. Envoy's client listener, \
             which proxies the push to a model server)"
        )
    })
    .await;
    assert!(
        refused.contains("kvroute_cp_push_failures_total{target=\"envoy-0\",reason=\"404\"}"),
        "{refused}"
    );
    assert!(
        !refused.contains("kvroute_cp_push_auth_rejected{target=\"envoy-0\"} 1"),
        "{refused}"
    );
}

/// Issue 14, case 7: `/metrics` serves OpenMetrics 1.0 when asked (as Prometheus asks) and
/// the 0.0.4 text format otherwise; each parses with a real parser for its content type.
#[tokio::test]
async fn own_metrics_parse_in_both_formats() {
    let srv = FakeModelServer::start(Behavior::Body(vllm_body(0.5, 1, 0, None, 1.0))).await;
    let ingest = FakeIngest::start().await;
    let cp = start(&config_yaml(&[("a", srv.addr())], &[ingest.url()], "")).await;
    wait_for(WAIT, "push", || ingest.count() > 0).await;
    let url = format!("http://{}/metrics", cp.local_addr());
    let prometheus_accept = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
    let (status, ct, om) = get_accept(&url, Some(prometheus_accept)).await;
    assert_eq!(status, 200);
    assert_eq!(
        ct,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(om.ends_with("# EOF\n"), "{om}");
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&om)
        .unwrap_or_else(|e| panic!("{e:?}\n{om}"));
    let pushes = &parsed.families["kvroute_cp_pushes"];
    assert_eq!(
        pushes.family_type,
        openmetrics_parser::OpenMetricsType::Counter
    );
    for (accept, ct_want) in [
        (None, "text/plain; version=0.0.4; charset=utf-8"),
        (
            Some("text/plain"),
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        (Some("*/*"), "text/plain; version=0.0.4; charset=utf-8"),
    ] {
        let (status, ct, text) = get_accept(&url, accept).await;
        assert_eq!((status, ct.as_str()), (200, ct_want), "{accept:?}");
        assert!(!text.contains("# EOF"));
        assert!(
            text.contains("# TYPE kvroute_cp_pushes_total counter\n"),
            "{text}"
        );
        let parsed = openmetrics_parser::prometheus::parse_prometheus(&text)
            .unwrap_or_else(|e| panic!("{e:?}\n{text}"));
        let pushes = &parsed.families["kvroute_cp_pushes_total"];
        assert_eq!(
            pushes.family_type,
            openmetrics_parser::PrometheusType::Counter
        );
        // The second reference parser agrees on the counter sample.
        let scrape =
            prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
        assert!(scrape
            .samples
            .iter()
            .any(|s| s.metric == "kvroute_cp_pushes_total"
                && matches!(s.value, prometheus_parse::Value::Counter(v) if v >= 1.0)));
    }
    cp.shutdown().await;
}
