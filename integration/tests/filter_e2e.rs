//! kvroute filter in real Envoy: body-based routing, ingest, fail-open, header-only
//! requests. Needs the built `.wasm` and the PyPI Envoy (`make test-filter` provides both).

use kvroute_core::snapshot::Snapshot;
use kvroute_integration::harness::http::Response;
use kvroute_integration::harness::kvroute::{
    chat, now_ms, Fleet, FleetMode, FleetOptions, TEST_TOKEN,
};

#[tokio::test]
async fn cluster_mode_routes_by_body_after_ingest() {
    let fleet = Fleet::start(FleetOptions {
        backends: 3,
        ..FleetOptions::least_kv()
    })
    .await
    .unwrap();
    // Every fixed metric is defined when the plugin starts: 0 before any request, not absent
    // (`names::metric::fixed`).
    let stats = fleet.envoy.stats().await.unwrap();
    for n in [
        "kvroute.fail_open",
        "kvroute.decisions.policy",
        "kvroute.outcome.rejected",
        "kvroute.inflight",
    ] {
        assert_eq!(stats.get(&format!("wasmcustom.{n}")), Some(&0), "{n}");
    }
    // No stats yet: the filter fails open and the default route (round robin over all) applies.
    let r = fleet
        .post("/v1/chat/completions", &chat("hello"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fleet.custom("kvroute.fail_open").await.unwrap(), 1);

    let now = now_ms();
    let snap = Snapshot::new(
        1,
        now,
        vec![
            fleet.endpoint(0, 0.9, now),
            fleet.endpoint(1, 0.8, now),
            fleet.endpoint(2, 0.05, now),
        ],
    );
    fleet.push(&snap).await.unwrap();
    let before = fleet.counts();
    for _ in 0..5 {
        let r = fleet
            .post("/v1/chat/completions", &chat("route me by KV"))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-backend"), Some("b2"), "least KV usage is e2");
    }
    let after = fleet.counts();
    assert_eq!(after[2] - before[2], 5);
    // The backend saw the decision header and the full body.
    let rec = fleet.backends[2].requests().pop().unwrap();
    assert_eq!(rec.header("x-kvroute-cluster"), Some("c2"));
    assert_eq!(rec.body.as_ref(), chat("route me by KV").as_slice());
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 5);
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
}

#[tokio::test]
async fn client_cannot_pick_its_own_cluster() {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    fleet.push_usages(1, &[0.1, 0.9]).await.unwrap();
    let r = kvroute_integration::harness::http::request(
        "POST",
        &fleet.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("x-kvroute-cluster", "c1"),
        ],
        &chat("spoof"),
    )
    .await
    .unwrap();
    assert_eq!(r.header("x-backend"), Some("b0"));
}

#[tokio::test]
async fn ingest_auth_size_validity_and_versions() {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    let now = now_ms();
    let good = Snapshot::new(
        5,
        now,
        vec![fleet.endpoint(0, 0.9, now), fleet.endpoint(1, 0.1, now)],
    );

    let r = fleet.ingest(&good.encode(), None).await.unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (
            401,
            r#"{"error":{"code":"invalid_ingest_token","message":"Missing or wrong ingest token (Authorization: Bearer <ingest_token>).","param":null,"type":"authentication_error"}}"#
        )
    );
    let r = fleet
        .ingest(&good.encode(), Some("wrong-token-0123456789"))
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    let r = fleet
        .ingest(b"{\"format\":1}", Some(TEST_TOKEN))
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("invalid_snapshot"));
    let big = vec![b' '; 2 * 1024 * 1024];
    let r = fleet.ingest(&big, Some(TEST_TOKEN)).await.unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (
            413,
            r#"{"error":{"code":"request_too_large","message":"Snapshot larger than ingest_max_bytes (1048576 bytes).","param":null,"type":"invalid_request_error"}}"#
        )
    );
    // Nothing applied so far: requests fail open.
    assert_eq!(
        fleet.custom("kvroute.snapshots.published").await.unwrap(),
        0
    );
    // No backend saw any ingest request.
    assert_eq!(fleet.counts(), vec![0, 0]);

    fleet.push(&good).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("x"))
        .await
        .unwrap();
    assert_eq!(r.header("x-backend"), Some("b1"));

    // An older version is ignored: routing does not change.
    let older = Snapshot::new(
        4,
        now,
        vec![fleet.endpoint(0, 0.0, now), fleet.endpoint(1, 0.99, now)],
    );
    fleet.push(&older).await.unwrap();
    assert_eq!(
        fleet.custom("kvroute.snapshots.ignored_old").await.unwrap(),
        1
    );
    let r = fleet
        .post("/v1/chat/completions", &chat("x"))
        .await
        .unwrap();
    assert_eq!(r.header("x-backend"), Some("b1"));

    // A newer one applies.
    let newer = Snapshot::new(
        6,
        now,
        vec![fleet.endpoint(0, 0.0, now), fleet.endpoint(1, 0.99, now)],
    );
    fleet.push(&newer).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("x"))
        .await
        .unwrap();
    assert_eq!(r.header("x-backend"), Some("b0"));
    // Ingest paths other than the snapshot route are answered locally too.
    let r = kvroute_integration::harness::http::request(
        "GET",
        &format!("http://127.0.0.1:{}/anything", fleet.ingest_port),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(fleet.counts().iter().sum::<usize>(), 3);
}

#[tokio::test]
async fn header_only_requests_are_decided_without_waiting() {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    fleet.push_usages(1, &[0.7, 0.2]).await.unwrap();
    // A header-only request (vLLM's `/health`) is decided at its headers, by load.
    let r = kvroute_integration::harness::http::request("GET", &fleet.url("/health"), &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-backend"), Some("b1"));
    assert_eq!(
        fleet.custom("kvroute.decisions.load_only").await.unwrap(),
        1
    );
    // The models API is the filter's own, from the snapshot: `GET /v1/models/{id}` too.
    let r =
        kvroute_integration::harness::http::request("GET", &fleet.url("/v1/models/m"), &[], b"")
            .await
            .unwrap();
    assert_eq!((r.status, r.header("x-backend")), (200, None));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!((&v["id"], &v["object"]), (&"m".into(), &"model".into()));
    let r = kvroute_integration::harness::http::request(
        "GET",
        &fleet.url("/v1/models/nobody%2Fserves-this"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 404);
    assert!(r.text().contains("`nobody/serves-this`"), "{}", r.text());
}

#[tokio::test]
async fn endpoint_mode_override_host_with_fallback() {
    let fleet = Fleet::start(FleetOptions {
        backends: 3,
        mode: FleetMode::OverrideHost,
        ..FleetOptions::least_kv()
    })
    .await
    .unwrap();
    let now = now_ms();
    let mut eps = vec![
        fleet.endpoint(0, 0.5, now),
        fleet.endpoint(1, 0.1, now),
        fleet.endpoint(2, 0.3, now),
    ];
    fleet
        .push(&Snapshot::new(1, now, eps.clone()))
        .await
        .unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("endpoint"))
        .await
        .unwrap();
    assert_eq!(r.header("x-backend"), Some("b1"));
    let rec = fleet.backends[1].requests().pop().unwrap();
    let want = format!(
        "{},{},{}",
        fleet.backends[1].address(),
        fleet.backends[2].address(),
        fleet.backends[0].address()
    );
    assert_eq!(
        rec.header("x-gateway-destination-endpoint"),
        Some(want.as_str())
    );

    // The primary refuses connections: the retry policy moves on to the first fallback.
    let dead = kvroute_integration::harness::free_port().unwrap();
    eps[1].address = format!("127.0.0.1:{dead}");
    fleet.push(&Snapshot::new(2, now, eps)).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("endpoint"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-backend"), Some("b2"));
}

/// Endpoint mode: the filter chooses an endpoint whose address is no host of the cluster
/// (here an IP the cluster lacks); Envoy's `override_host` falls back to round robin and
/// the response comes from another host. The filter reads `upstream.address` in real
/// Envoy, counts the mismatch and logs both addresses (it went unnoticed: the decision
/// named the chosen endpoint).
#[tokio::test]
async fn endpoint_mode_reports_an_upstream_it_did_not_choose() {
    let fleet = Fleet::start(FleetOptions {
        backends: 2,
        mode: FleetMode::OverrideHost,
        route_config: r#""picker":{"policy":"least_kv","stale_after_ms":60000,"max_fallbacks":0}"#
            .into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let mut outside = fleet.endpoint(1, 0.1, now);
    outside.address = "127.0.0.9:9".into();
    let eps = vec![fleet.endpoint(0, 0.9, now), outside];
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("mismatch"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        fleet
            .custom("kvroute.outcome.upstream_mismatch")
            .await
            .unwrap(),
        1
    );
    let backend = r.header("x-backend").unwrap_or_default();
    let reached = match backend {
        "b0" => fleet.backends[0].address(),
        _ => fleet.backends[1].address(),
    };
    let log = fleet.envoy.log();
    assert!(
        log.contains(&format!(
            "routed to endpoint pool/e1 (127.0.0.9:9) reached upstream {reached}"
        )),
        "{backend}: {log}"
    );
    assert!(fleet.envoy.wasm_failures().await.unwrap().is_empty());
}

#[tokio::test]
async fn endpoint_mode_original_dst_single_host() {
    let fleet = Fleet::start(FleetOptions {
        backends: 2,
        mode: FleetMode::OriginalDst,
        route_config: r#""picker":{"policy":"least_kv","stale_after_ms":60000,"max_fallbacks":0}"#
            .into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.6, 0.2]).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("odst"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-backend"), Some("b1"));
    let rec = fleet.backends[1].requests().pop().unwrap();
    assert_eq!(
        rec.header("x-gateway-destination-endpoint"),
        Some(fleet.backends[1].address().as_str())
    );
}

#[tokio::test]
async fn endpoint_mode_ipv6_addresses_in_brackets() {
    let fleet = Fleet::start(FleetOptions {
        backends: 2,
        mode: FleetMode::OverrideHost,
        backend_bind: "[::1]:0",
        ..FleetOptions::least_kv()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.7, 0.2]).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("v6"))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-backend"), Some("b1"));
    let rec = fleet.backends[1].requests().pop().unwrap();
    let primary = format!("[::1]:{}", fleet.backends[1].addr().port());
    let fallback = format!("[::1]:{}", fleet.backends[0].addr().port());
    assert_eq!(
        rec.header("x-gateway-destination-endpoint"),
        Some(format!("{primary},{fallback}").as_str())
    );
}

#[tokio::test]
async fn original_dst_rejects_a_host_list() {
    // Documented limitation: ORIGINAL_DST takes one host; a list (max_fallbacks > 0) is a 503
    // from Envoy, not from the filter. Ship max_fallbacks 0 with ORIGINAL_DST.
    let fleet = Fleet::start(FleetOptions {
        backends: 2,
        mode: FleetMode::OriginalDst,
        ..FleetOptions::least_kv()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.6, 0.2]).await.unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("odst list"))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(fleet.counts(), vec![0, 0]);
}

/// Two backends whose snapshot (version 1) has both above the 0.5 KV headroom, so every
/// request is parked: least-KV routing, the debug header, admission on with a 20 ms tick,
/// `retry-after: 2` and the `admission` fields in `admission` (JSON members).
async fn saturated_fleet(dynmod: bool, admission: &str) -> anyhow::Result<Fleet> {
    let fleet = Fleet::start(FleetOptions {
        dynmod,
        route_config: format!(
            concat!(
                r#""picker":{{"policy":"least_kv","stale_after_ms":60000,"min_kv_headroom":0.5}},"#,
                r#""admission":{{"enabled":true,"tick_ms":20,"retry_after_s":2,{}}},"#,
                r#""debug_header":true"#
            ),
            admission
        ),
        ..FleetOptions::default()
    })
    .await?;
    fleet.push_usages(1, &[0.95, 0.97]).await?;
    Ok(fleet)
}

/// Push snapshot version 2 of a [`saturated_fleet`], in which e1 has room, and check that
/// the `held` request is resumed there by the tick, carrying the decision that resumed it
/// (as any routed request does).
async fn resumed_on_e1_once_it_has_room(
    fleet: &Fleet,
    held: tokio::task::JoinHandle<anyhow::Result<Response>>,
) -> anyhow::Result<()> {
    fleet.push_usages(2, &[0.95, 0.1]).await?;
    let r = held.await??;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-backend"), Some("b1"));
    assert_eq!(
        r.header("x-kvroute-decision"),
        Some("policy:least_kv;endpoint=pool/e1")
    );
    Ok(())
}

#[tokio::test]
async fn saturated_fleet_holds_requests_then_resumes_or_answers_429() {
    saturated_fleet_holds_then_resumes_or_answers_429(false)
        .await
        .unwrap();
}

/// The same with the native build (`make dynmod`), whose parked requests are retried on the
/// tick its ticker thread wakes (docs/dynamic-module.md).
#[tokio::test]
async fn saturated_native_fleet_holds_requests_then_resumes_or_answers_429() {
    saturated_fleet_holds_then_resumes_or_answers_429(true)
        .await
        .unwrap();
}

async fn saturated_fleet_holds_then_resumes_or_answers_429(dynmod: bool) -> anyhow::Result<()> {
    let fleet = saturated_fleet(dynmod, r#""timeout_ms":1500,"max_queue_bytes":4096"#).await?;
    let held = fleet
        .post_parked("/v1/chat/completions", chat("wait"), 1)
        .await?;
    assert_eq!(fleet.counts(), vec![0, 0], "held, not forwarded");
    resumed_on_e1_once_it_has_room(&fleet, held).await?;

    fleet.push_usages(3, &[0.95, 0.97]).await?;
    let started = std::time::Instant::now();
    let r = fleet.post("/v1/chat/completions", &chat("give up")).await?;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(
        r.text(),
        r#"{"error":{"code":"saturated","message":"Every endpoint serving this model is out of KV-cache capacity; retry later.","param":null,"type":"rate_limit_error"}}"#
    );
    assert!(started.elapsed() >= std::time::Duration::from_millis(1400));
    assert_eq!(fleet.counts(), vec![0, 1]);

    // A body past `max_queue_bytes` (4 KiB) is not held: 429 at once, nothing copied.
    let started = std::time::Instant::now();
    let r = fleet
        .post("/v1/chat/completions", &chat(&"long ".repeat(1000)))
        .await?;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("2"));
    assert!(started.elapsed() < std::time::Duration::from_millis(1000));
    assert_eq!(fleet.counts(), vec![0, 1]);
    Ok(())
}

/// Two requests parked on a saturated fleet; the first one's client goes away. The other
/// is still resumed by the tick once an endpoint has room, with no hook of any stream to
/// run it: in the native build the tick then comes only from the ticker thread waking the
/// worker's tick carrier, and the carrier was the stream that went away (another live
/// stream takes over, docs/dynamic-module.md).
#[tokio::test]
async fn a_parked_request_outlives_the_stream_that_parked_first() {
    parked_request_outlives_the_first(false).await.unwrap();
}

/// The same with the native build (`make dynmod`).
#[tokio::test]
async fn a_native_parked_request_outlives_the_stream_that_parked_first() {
    parked_request_outlives_the_first(true).await.unwrap();
}

async fn parked_request_outlives_the_first(dynmod: bool) -> anyhow::Result<()> {
    let fleet = saturated_fleet(dynmod, r#""timeout_ms":8000"#).await?;
    let first = fleet
        .post_parked("/v1/chat/completions", chat("first"), 1)
        .await?;
    let second = fleet
        .post_parked("/v1/chat/completions", chat("second"), 2)
        .await?;
    // The first client goes away (its connection closes); one request stays queued.
    first.abort();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while fleet.custom("kvroute.queue_length").await? != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "queue length {} after the first client left",
            fleet.custom("kvroute.queue_length").await?
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let started = std::time::Instant::now();
    resumed_on_e1_once_it_has_room(&fleet, second).await?;
    // Resumed by a tick (every 20 ms), long before the 8 s admission timeout.
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    assert_eq!(fleet.counts(), vec![0, 1]);
    assert_eq!(fleet.settled_reservations().await?, 1);
    Ok(())
}

/// The harness's own retry: a listener port taken between `free_port` and Envoy's bind
/// (another test's process) starts Envoy again on new ports, and only a bounded number of
/// times.
#[tokio::test]
async fn a_taken_listener_port_starts_envoy_again_on_new_ports() {
    use kvroute_integration::harness::{render, templates, Envoy, PORT_ATTEMPTS};
    // Held without SO_REUSEPORT: Envoy's bind of this port fails.
    let held = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let taken = held.local_addr().unwrap().port();
    let plain = |port: u16| {
        render(
            templates::PLAIN,
            &[
                ("LISTEN_PORT", port.to_string()),
                ("DEFAULT_CLUSTER", "default".into()),
                (
                    "CLUSTERS",
                    templates::static_cluster("default", &["127.0.0.1:9".into()]),
                ),
            ],
        )
    };
    // The first start is given the taken port; the second, its own.
    let mut offered = Vec::new();
    let (envoy, [port]) = Envoy::start_on_free_ports(1, |[p]| {
        offered.push(p);
        plain(if offered.len() == 1 { taken } else { p })
    })
    .await
    .unwrap();
    assert_eq!(offered.len(), 2);
    assert_eq!(port, offered[1]);
    assert_ne!(port, taken);
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    drop(envoy);
    // Always taken: the error comes back after PORT_ATTEMPTS starts.
    let mut starts = 0;
    let err = Envoy::start_on_free_ports(1, |[_]| {
        starts += 1;
        plain(taken)
    })
    .await
    .unwrap_err();
    assert_eq!(starts, PORT_ATTEMPTS);
    assert!(
        format!("{err:#}").contains("Address already in use"),
        "{err:#}"
    );
}
