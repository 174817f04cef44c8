//! kvroute filter in real Envoy: herd protection across workers, reservations released on
//! aborts, slow uploads, staleness fallback, oversized and compressed bodies (a chunked one
//! too, against Envoy's buffer limit, and one answered 429 while every endpoint is
//! saturated), and every shared request body plus malformed JSON
//! without a filter-made 5xx or a VM failure. The multi-worker and abort tests run with
//! the native build (`make dynmod`) too, their bodies shared by both.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_core::snapshot::Snapshot;
use kvroute_integration::harness::http::{h2_post_with_trailers, raw_exchange, request};
use kvroute_integration::harness::kvroute::{chat, now_ms, Fleet, FleetOptions};
use kvroute_integration::harness::Reply;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn sse_reply(gap_ms: u64) -> Reply {
    Reply::Sse {
        chunks: vec![
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n".into(),
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n".into(),
        ],
        gap: Duration::from_millis(gap_ms),
    }
}

/// Reservations made equal reservations released, none is held, and some were made.
async fn assert_no_leak(fleet: &Fleet) -> anyhow::Result<()> {
    let reserved = fleet.settled_reservations().await?;
    anyhow::ensure!(reserved > 0, "nothing was reserved at all");
    Ok(())
}

/// Send `parts` to the proxy on `port`, 5 ms apart, and read its reply until it closes
/// (at most 5 s): the reply as text. Written by hand, not by `raw_exchange`: a reply sent
/// mid-upload (a 413 or a 429) closes the connection, and the writes after it fail, which
/// ends the upload.
async fn upload_in_parts(port: u16, parts: &[Vec<u8>]) -> std::io::Result<String> {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    for p in parts {
        if conn.write_all(p).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut reply)).await;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

#[tokio::test]
async fn herd_of_identical_requests_is_spread() {
    let fleet = Fleet::start(FleetOptions {
        backends: 4,
        concurrency: 2,
        reply: sse_reply(400),
        route_config: r#""picker":{"stale_after_ms":60000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let eps = (0..4).map(|i| fleet.endpoint(i, 0.2, now)).collect();
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    let body = chat("the very same prompt for everyone in the herd");
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let url = fleet.url("/v1/chat/completions");
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            request("POST", &url, &[("content-type", "application/json")], &body).await
        }));
    }
    for t in tasks {
        let r = t.await.unwrap().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let counts = fleet.counts();
    assert_eq!(counts.iter().sum::<usize>(), 64, "{counts:?}");
    for c in &counts {
        assert!(
            *c <= 32,
            "a backend got more than twice its fair share (16): {counts:?}"
        );
    }
    assert_no_leak(&fleet).await.unwrap();
}

/// Each worker keeps its own in-flight reservations and shares them through shared data
/// (`kvroute_filter::inflight`, every `inflight_share_ms` = 20 ms or on the 100 ms tick):
/// with 8 streams held across 4 workers, every later decision, on whichever worker, counts
/// all 8 in its candidates' load (the decision record's `load=`: running + waiting +
/// in-flight; the snapshot reports no running or waiting requests).
#[tokio::test]
async fn inflight_load_of_every_worker_reaches_every_decision() {
    inflight_load_reaches_every_decision(false).await;
}

/// The same with the native build (`make dynmod`): its shared data is one process-wide map.
#[tokio::test]
async fn inflight_load_of_every_native_worker_reaches_every_decision() {
    inflight_load_reaches_every_decision(true).await;
}

async fn inflight_load_reaches_every_decision(dynmod: bool) {
    let fleet = Fleet::start(FleetOptions {
        dynmod,
        backends: 2,
        concurrency: 4,
        reply: sse_reply(3_000),
        route_config:
            r#""picker":{"stale_after_ms":600000},"debug_header":true,"decision_record":true"#
                .into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let eps = (0..2).map(|i| fleet.endpoint(i, 0.2, now)).collect();
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    let exchange = |text: String, read_ms: u64| {
        let port = fleet.port;
        async move {
            let body = chat(&text);
            let mut req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            req.extend_from_slice(&body);
            raw_exchange(
                port,
                &[(&req, Duration::ZERO)],
                Duration::from_millis(read_ms),
            )
            .await
            .unwrap()
        }
    };
    // Every worker decides once first, so each has read the others' tables before any
    // stream is held (without sharing, or with a slow interval, later decisions would miss
    // the other workers' streams: checked with `"inflight_share_ms":10000`).
    for i in 0..16 {
        exchange(format!("warm {i}"), 100).await;
    }
    // 8 streams held for 3 s, each on its own connection.
    let held: Vec<_> = (0..8)
        .map(|i| tokio::spawn(exchange(format!("held {i}"), 3_500)))
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut seen = Vec::new();
    for i in 0..12 {
        // A fresh connection each: Envoy hands it to any of its 4 workers.
        let r = exchange(format!("probe {i}"), 150).await;
        let line = r
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("x-kvroute-decision:"))
            .unwrap_or_else(|| panic!("no decision header: {r}"));
        let load: u64 = line
            .split("load=")
            .skip(1)
            .filter_map(|rest| rest.split(']').next()?.parse::<u64>().ok())
            .sum();
        seen.push(load);
    }
    for h in held {
        h.await.unwrap();
    }
    assert!(
        seen.iter().all(|&l| l >= 8),
        "load each probe saw: {seen:?}"
    );
    assert_no_leak(&fleet).await.unwrap();
}

/// Prefix affinity learned by one Envoy worker reaches the others through the shared
/// journal (`share_affinity`, synced every 100 ms), and so do the learners' observations
/// (`share_learning`): follow-up turns arriving on new
/// connections, and so on any of the 4 workers, land on the replica the first turn went to.
/// All replicas look equally loaded, so a worker that did not know the prefix would pick
/// among them at random: without sharing, 8 follow-ups all landing home has probability
/// about (1/4 + 3/4 × 1/4)^8 ≈ 0.1% per conversation.
#[tokio::test]
async fn prefix_affinity_is_shared_by_all_workers() {
    prefix_affinity_shared(false).await;
}

/// The same with the native build (`make dynmod`).
#[tokio::test]
async fn prefix_affinity_is_shared_by_all_native_workers() {
    prefix_affinity_shared(true).await;
}

async fn prefix_affinity_shared(dynmod: bool) {
    let fleet = Fleet::start(FleetOptions {
        dynmod,
        // The native build publishes a worker's journal records when it goes idle, at most
        // once per `affinity_sync_ms / 10` (10 ms; `Worker::flush`): answers that take
        // 30 ms, as any model server's do, keep each turn's records from waiting for that
        // worker's next request (docs/dynamic-module.md).
        reply: if dynmod {
            sse_reply(30)
        } else {
            Default::default()
        },
        backends: 4,
        concurrency: 4,
        route_config: r#""picker":{"stale_after_ms":600000},"debug_header":true"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let eps = (0..4).map(|i| fleet.endpoint(i, 0.2, now)).collect();
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    let endpoint_of = |r: &kvroute_integration::harness::http::Response| -> String {
        let reason = r.header("x-kvroute-decision").unwrap_or_default();
        reason
            .split(';')
            .find_map(|p| p.strip_prefix("endpoint="))
            .unwrap_or_else(|| panic!("no endpoint in decision {reason:?}"))
            .to_owned()
    };
    let url = fleet.url("/v1/chat/completions");
    let json = [("content-type", "application/json")];
    for conversation in 0..3 {
        let body = chat(&format!(
            "conversation {conversation}: {}",
            "a long shared system prompt that every turn repeats verbatim. ".repeat(40)
        ));
        let first = request("POST", &url, &json, &body).await.unwrap();
        assert_eq!(first.status, 200, "{}", first.text());
        let home = endpoint_of(&first);
        // Longer than one sync period on every worker.
        tokio::time::sleep(Duration::from_millis(400)).await;
        for turn in 0..8 {
            let r = request("POST", &url, &json, &body).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(
                endpoint_of(&r),
                home,
                "conversation {conversation}, follow-up {turn} left its replica"
            );
        }
    }
    assert!(fleet.custom("kvroute.affinity.published").await.unwrap() >= 3);
    assert!(fleet.custom("kvroute.affinity.imported").await.unwrap() >= 3);
    // Learner observations travel the same way (`share_learning`): each of the 27
    // responses' `usage` (5 completion tokens) is one output-length observation, published
    // once by the worker that saw it and replayed by each of the 3 others (and by Envoy's
    // main-thread instance, which ticks too). The native build has no timer: an idle
    // worker replays them at its next request, so only some have been by now.
    // With the native build's streamed answers, some responses add a first-token
    // observation to their output-length one.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let published = fleet.custom("kvroute.learned.published").await.unwrap();
    let imported = fleet.custom("kvroute.learned.imported").await.unwrap();
    if dynmod {
        assert!((27..=54).contains(&published), "published {published}");
        assert!(imported > 0, "imported {imported}");
    } else {
        assert_eq!(published, 27);
        assert!(imported >= 3 * 27, "imported {imported}");
    }
}

#[tokio::test]
async fn client_aborts_leave_no_reservation() {
    client_aborts(false).await;
}

/// The same with the native build (`make dynmod`).
#[tokio::test]
async fn client_aborts_leave_no_native_reservation() {
    client_aborts(true).await;
}

async fn client_aborts(dynmod: bool) {
    let fleet = Fleet::start(FleetOptions {
        dynmod,
        reply: sse_reply(1500),
        route_config: r#""picker":{"stale_after_ms":60000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.1, 0.1]).await.unwrap();
    let body = chat("abort me");
    // 1. Abort mid-body: headers promise more bytes than are sent.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len() + 100
    );
    raw_exchange(
        fleet.port,
        &[
            (head.as_bytes(), Duration::ZERO),
            (&body[..10], Duration::from_millis(200)),
        ],
        Duration::from_millis(10),
    )
    .await
    .unwrap();
    // 2. Abort mid-response: the decision (and reservation) is made, the stream is cut
    //    while the backend is still streaming.
    let full = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    for _ in 0..3 {
        let got = raw_exchange(
            fleet.port,
            &[(full.as_bytes(), Duration::ZERO), (&body, Duration::ZERO)],
            // Long enough to see the response headers, shorter than the backend's 1.5 s gap
            // before the final event: the connection is dropped mid-response.
            Duration::from_millis(1000),
        )
        .await
        .unwrap();
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }
    assert_no_leak(&fleet).await.unwrap();
    assert_eq!(
        fleet.custom("kvroute.reservations.reserved").await.unwrap(),
        3
    );
}

/// `c` framed as one HTTP/1.1 chunk of a `transfer-encoding: chunked` body.
fn http_chunk(c: &[u8]) -> Vec<u8> {
    let mut v = format!("{:x}\r\n", c.len()).into_bytes();
    v.extend_from_slice(c);
    v.extend_from_slice(b"\r\n");
    v
}

#[tokio::test]
async fn slow_chunked_upload_is_routed_by_its_body() {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    fleet.push_usages(1, &[0.9, 0.1]).await.unwrap();
    let body = chat("a slowly uploaded prompt");
    let (a, b) = body.split_at(body.len() / 2);
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let (ca, cb) = (http_chunk(a), http_chunk(b));
    let got = raw_exchange(
        fleet.port,
        &[
            (head, Duration::from_millis(300)),
            (&ca, Duration::from_millis(300)),
            (&cb, Duration::from_millis(300)),
            (b"0\r\n\r\n", Duration::ZERO),
        ],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("x-backend: b1"), "{got}");
    let rec = fleet.backends[1].requests().pop().unwrap();
    assert_eq!(rec.body.as_ref(), body.as_slice());
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 1);
    assert_eq!(
        fleet.custom("kvroute.decisions.load_only").await.unwrap(),
        0
    );
}

/// A chunked upload past `max_body_bytes`, 32 KiB per chunk. Envoy adds each chunk to the
/// buffered body before the filter's body callback sees it, and answers 413 itself when
/// that passes `per_connection_buffer_limit_bytes`: so the filter, which keeps buffering up
/// to `max_body_bytes`, needs the Envoy limit above it by more than one read (the rule in
/// docs/filter.md). Returns Envoy's status line, the size of the body the backend got and
/// the filter's `load_only` decisions.
async fn chunked_past_max_body(
    buffer_limit: usize,
) -> anyhow::Result<(String, Option<usize>, u64)> {
    let fleet = Fleet::start(FleetOptions {
        route_config:
            r#""max_body_bytes":131072,"picker":{"policy":"least_kv","stale_after_ms":60000}"#
                .into(),
        buffer_limit,
        ..FleetOptions::default()
    })
    .await?;
    fleet.push_usages(1, &[0.9, 0.1]).await?;
    let body = chat(&"word ".repeat(120_000));
    anyhow::ensure!(body.len() == 600_071, "body of {} bytes", body.len());
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let mut parts: Vec<Vec<u8>> = vec![head.to_vec()];
    parts.extend(body.chunks(32 * 1024).map(http_chunk));
    parts.push(b"0\r\n\r\n".to_vec());
    let got = upload_in_parts(fleet.port, &parts).await?;
    let status = got.lines().next().unwrap_or_default().to_owned();
    let served = fleet
        .backends
        .get(1)
        .and_then(|b| b.requests().pop())
        .map(|r| r.body.len());
    let load_only = fleet.custom("kvroute.decisions.load_only").await?;
    Ok((status, served, load_only))
}

#[tokio::test]
async fn chunked_upload_past_max_body_is_routed_by_load_when_envoy_buffers_more() {
    // Envoy's limit twice the filter's (the examples' ratio): routed by load, whole body.
    let (status, served, load_only) = chunked_past_max_body(262_144).await.unwrap();
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(served, Some(600_071));
    assert_eq!(load_only, 1);
    // Equal limits: the chunk that passes both is refused by Envoy before the filter sees
    // it, so the request never reaches a backend.
    let (status, served, _) = chunked_past_max_body(131_072).await.unwrap();
    assert_eq!(status, "HTTP/1.1 413 Payload Too Large");
    assert_eq!(served, None);
}

/// Every endpoint saturated, admission on: a body the filter does not read (over
/// `max_body_bytes`, declared by `Content-Length` or buffered past it in a chunked upload)
/// is answered OpenAI's 429 at once, counted as rejected, never held. Held, its paused
/// stream made Envoy buffer the body until `per_connection_buffer_limit_bytes` and answer
/// its own `413 text/plain` "Payload Too Large".
#[tokio::test]
async fn a_saturated_body_past_max_body_is_answered_429_not_held() {
    let fleet = Fleet::start(FleetOptions {
        route_config: concat!(
            r#""max_body_bytes":131072,"picker":{"policy":"least_kv","stale_after_ms":60000,"#,
            r#""min_kv_headroom":0.5},"admission":{"enabled":true,"timeout_ms":5000,"retry_after_s":2}"#
        )
        .into(),
        buffer_limit: 262_144,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.9, 0.9]).await.unwrap();
    let body = chat(&"word ".repeat(120_000));
    assert_eq!(body.len(), 600_071);
    let declared = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut by_length: Vec<Vec<u8>> = vec![declared.into_bytes()];
    by_length.extend(body.chunks(32 * 1024).map(<[u8]>::to_vec));
    let chunked_head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let mut chunked: Vec<Vec<u8>> = vec![chunked_head.to_vec()];
    chunked.extend(body.chunks(32 * 1024).map(http_chunk));
    chunked.push(b"0\r\n\r\n".to_vec());
    for (what, parts) in [("content-length", by_length), ("chunked", chunked)] {
        let started = std::time::Instant::now();
        let got = upload_in_parts(fleet.port, &parts).await.unwrap();
        let (head, text) = got.split_once("\r\n\r\n").unwrap_or((&got, ""));
        assert_eq!(
            head.lines().next(),
            Some("HTTP/1.1 429 Too Many Requests"),
            "{what}: {got}"
        );
        assert!(
            head.to_ascii_lowercase().contains("\r\nretry-after: 2\r\n"),
            "{what}: {head}"
        );
        assert_eq!(
            text,
            r#"{"error":{"code":"saturated","message":"Every endpoint serving this model is out of KV-cache capacity; retry later.","param":null,"type":"rate_limit_error"}}"#,
            "{what}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{what}: not held"
        );
    }
    assert_eq!(fleet.counts(), vec![0, 0]);
    assert_eq!(fleet.custom("kvroute.outcome.rejected").await.unwrap(), 2);
    assert_eq!(fleet.custom("kvroute.outcome.queued").await.unwrap(), 0);
}

#[tokio::test]
async fn stale_stats_lose_priority_then_fall_back_to_least_request() {
    let fleet = Fleet::start(FleetOptions {
        route_config: r#""picker":{"policy":"least_kv","stale_after_ms":2000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let old = now - 60_000;
    // e1 looks best by KV but its stats are stale; e0 is fresh.
    let mut e0 = fleet.endpoint(0, 0.8, now);
    let mut e1 = fleet.endpoint(1, 0.0, old);
    fleet
        .push(&Snapshot::new(1, now, vec![e0.clone(), e1.clone()]))
        .await
        .unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("s"))
        .await
        .unwrap();
    assert_eq!(r.header("x-backend"), Some("b0"));
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 1);

    // Everything stale: least-request over the known endpoints (e0 is busy).
    e0.scraped_at_ms = old;
    e0.running = 20;
    e1.running = 1;
    fleet
        .push(&Snapshot::new(2, now, vec![e0, e1]))
        .await
        .unwrap();
    let r = fleet
        .post("/v1/chat/completions", &chat("s"))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-backend"), Some("b1"));
    assert_eq!(
        fleet
            .custom("kvroute.decisions.stale_fallback")
            .await
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn oversized_and_gzip_bodies_are_routed_by_load_alone() {
    let fleet = Fleet::start(FleetOptions {
        route_config:
            r#""max_body_bytes":1024,"picker":{"policy":"least_kv","stale_after_ms":60000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.push_usages(1, &[0.9, 0.1]).await.unwrap();
    let big = chat(&"long ".repeat(2000));
    let r = fleet.post("/v1/chat/completions", &big).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-backend"), Some("b1"));
    assert_eq!(
        fleet.backends[1].requests().pop().unwrap().body.len(),
        big.len()
    );
    let gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03not-really-gzip";
    let r = request(
        "POST",
        &fleet.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ],
        gz,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        fleet.backends[1].requests().pop().unwrap().body.as_ref(),
        gz
    );
    assert_eq!(
        fleet.custom("kvroute.decisions.load_only").await.unwrap(),
        2
    );
    assert_eq!(fleet.custom("kvroute.parse_errors").await.unwrap(), 0);
}

fn path_for(file: &str) -> &'static str {
    if file.contains("_chat_") {
        "/v1/chat/completions"
    } else if file.contains("_completions_") {
        "/v1/completions"
    } else if file.contains("_embeddings_") {
        "/v1/embeddings"
    } else if file.contains("_responses_") {
        "/v1/responses"
    } else {
        "/generate"
    }
}

#[tokio::test]
async fn every_shared_body_and_malformed_json_stays_healthy() {
    let fleet = Fleet::start(FleetOptions {
        concurrency: 2,
        route_config: r#""picker":{"stale_after_ms":60000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let dir = kvroute_core::shared_data::dir().join("requests");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 30,
        "expected the shared request bodies in {}",
        dir.display()
    );
    // The endpoints serve every model the bodies name, so no 503 is legitimate here.
    let mut models: Vec<String> = files
        .iter()
        .filter_map(|f| serde_json::from_slice::<serde_json::Value>(&std::fs::read(f).ok()?).ok())
        .filter_map(|v| v.get("model")?.as_str().map(str::to_owned))
        .collect();
    models.push("m".into());
    models.sort();
    models.dedup();
    let now = now_ms();
    let eps = (0..2)
        .map(|i| {
            let mut e = fleet.endpoint(i, 0.3, now);
            e.models = models.clone();
            e
        })
        .collect();
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    let mut sent = 0;
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let body = std::fs::read(f).unwrap();
        let r = fleet.post(path_for(&name), &body).await.unwrap();
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        sent += 1;
    }
    let malformed: &[&[u8]] = &[
        b"",
        b"{",
        b"not json at all",
        b"[1,2,3]",
        b"{\"model\": 5, \"messages\": \"x\"}",
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":{\"deep\":[[[[[]]]]]}}]}",
        b"{\"model\":\"m\",\"messages\":[],\"max_tokens\":-1,\"n\":1e309}",
        &[0xff, 0xfe, 0x00, 0x7b],
        b"{\"model\":\"\\ud800\",\"prompt\":\"\\u0000\"}",
    ];
    for (i, body) in malformed.iter().enumerate() {
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/responses"] {
            let r = fleet.post(path, body).await.unwrap();
            assert_eq!(r.status, 200, "malformed #{i} on {path}: {}", r.text());
            sent += 1;
        }
    }
    assert_eq!(fleet.counts().iter().sum::<usize>(), sent);
    assert!(fleet.custom("kvroute.parse_errors").await.unwrap() >= 20);
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
    let mut envoy = fleet.envoy;
    assert!(envoy.is_running());
}

/// An HTTP/2 request whose body ends with a trailers frame (no end-of-stream data frame)
/// is still decided on its body: the filter's trailers callback decides, instead of
/// proxy-wasm's default `Continue` letting it through undecided to the default route.
#[tokio::test]
async fn http2_request_ending_with_trailers_is_routed_by_its_body() {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    fleet.push_usages(1, &[0.9, 0.1]).await.unwrap();
    let body = chat("sent over HTTP/2, ended by trailers");
    for _ in 0..4 {
        let r = h2_post_with_trailers(
            fleet.port,
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            &body,
            &[("x-checksum", "abc")],
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(fleet.counts(), vec![0, 4]);
    let got = fleet.backends[1].requests();
    assert_eq!(got[0].header("x-kvroute-cluster"), Some("c1"));
    assert_eq!(got[0].body.as_ref(), body.as_slice());
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 4);
    assert_no_leak(&fleet).await.unwrap();
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// A request whose KV demand (prompt + n × ⌈max_tokens × 0.5⌉ for a model without a profile)
/// exceeds every endpoint's whole KV capacity can never fit: it is routed by load, not
/// answered 429 "retry later" forever, even on an idle fleet.
#[tokio::test]
async fn demand_larger_than_every_kv_cache_is_routed_not_429() {
    let fleet = Fleet::start(FleetOptions {
        route_config: r#""picker":{"stale_after_ms":60000}"#.into(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let now = now_ms();
    let eps = vec![fleet.endpoint(0, 0.0, now), fleet.endpoint(1, 0.0, now)];
    fleet.push(&Snapshot::new(1, now, eps)).await.unwrap();
    // Capacity is 1,000,000 tokens per endpoint; a model without a profile expects half its
    // output limit per choice (kvroute_core::router's one demand rule): 2 × ⌈1,500,000 × 0.5⌉
    // = 1,500,000 tokens do not fit.
    let body =
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1500000,"n":2}"#;
    let r = fleet.post("/v1/chat/completions", body).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fleet.counts().iter().sum::<usize>(), 1);
    assert_eq!(
        fleet
            .custom("kvroute.decisions.demand_over_capacity")
            .await
            .unwrap(),
        1
    );
    assert_eq!(fleet.custom("kvroute.outcome.rejected").await.unwrap(), 0);
    assert_no_leak(&fleet).await.unwrap();
}
