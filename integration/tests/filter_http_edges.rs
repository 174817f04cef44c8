//! kvroute filter in real Envoy with odd but legal HTTP: `Expect: 100-continue`, HEAD and
//! GET on the chat path, an empty POST, a request with 80 extra headers. Each is answered
//! by a backend (never a filter-made error), a body is still routed by its content,
//! nothing leaks and no Wasm VM fails. (HTTP/1.0 is Envoy's to refuse: 426 unless
//! `http_protocol_options.accept_http_10`.)

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_integration::harness::http::raw_exchange;
use kvroute_integration::harness::kvroute::{chat, Fleet, FleetOptions};
use std::time::Duration;

async fn least_kv_fleet() -> Fleet {
    let fleet = Fleet::start(FleetOptions::least_kv()).await.unwrap();
    fleet.push_usages(1, &[0.9, 0.1]).await.unwrap();
    fleet
}

/// Reservations made equal reservations released, and none is held.
async fn no_leak(fleet: &Fleet) {
    fleet.settled_reservations().await.unwrap();
}

/// A client that sends `Expect: 100-continue` and waits for `100 Continue` before its body
/// (curl does for bodies over 1 KiB) gets it while the filter holds the headers, and the
/// request is routed by its body.
#[tokio::test]
async fn expect_100_continue_is_routed_by_its_body() {
    let fleet = least_kv_fleet().await;
    let body = chat(&"a long prompt sent after 100 Continue ".repeat(40));
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let got = raw_exchange(
        fleet.port,
        &[
            (head.as_bytes(), Duration::from_millis(500)),
            (&body, Duration::ZERO),
        ],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 100 Continue"), "{got}");
    assert!(got.contains("HTTP/1.1 200"), "{got}");
    assert!(got.contains("x-backend: b1"), "{got}");
    let rec = fleet.backends[1].requests().pop().unwrap();
    assert_eq!(rec.body.as_ref(), body.as_slice());
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 1);
    no_leak(&fleet).await;
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// HEAD and GET on the chat path (no body: decided by load at the
/// headers), a POST with `content-length: 0`, and a POST carrying 80 extra headers (the test backend, hyper, takes 100 in all):
/// every one is answered by a backend.
#[tokio::test]
async fn odd_but_legal_requests_reach_a_backend() {
    let fleet = least_kv_fleet().await;
    for method in ["HEAD", "GET"] {
        let req = format!(
            "{method} /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        );
        let got = raw_exchange(
            fleet.port,
            &[(req.as_bytes(), Duration::ZERO)],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(got.starts_with("HTTP/1.1 200"), "{method}: {got}");
    }

    let empty = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
    let got = raw_exchange(
        fleet.port,
        &[(&empty[..], Duration::ZERO)],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");

    let body = chat("with 80 extra headers");
    let mut many = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for i in 0..80 {
        many.push_str(&format!("x-extra-{i}: {}\r\n", "v".repeat(64)));
    }
    many.push_str("\r\n");
    let mut many = many.into_bytes();
    many.extend_from_slice(&body);
    let got = raw_exchange(
        fleet.port,
        &[(&many, Duration::ZERO)],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("x-backend: b1"), "{got}");

    assert_eq!(fleet.counts().iter().sum::<usize>(), 4);
    no_leak(&fleet).await;
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// A header value with bytes that are not UTF-8 (HTTP allows obs-text, 0x80-0xFF, and
/// Envoy passes it on): the request is routed by its body like any other, and no Wasm VM
/// fails. The SDK's header-map read (`proxy_wasm::hostcalls::get_map`) panics on such a
/// value, which killed the VM of the worker for every request after it.
#[tokio::test]
async fn a_header_value_that_is_not_utf8_is_routed_and_the_vm_lives() {
    let fleet = least_kv_fleet().await;
    let body = chat("a header value in Latin-1");
    for round in 0..2 {
        let mut req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nx-latin1: caf",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(&[0xe9, 0xff]);
        req.extend_from_slice(b"\r\n\r\n");
        req.extend_from_slice(&body);
        let got = raw_exchange(
            fleet.port,
            &[(&req, Duration::ZERO)],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(got.starts_with("HTTP/1.1 200"), "round {round}: {got}");
        assert!(got.contains("x-backend: b1"), "round {round}: {got}");
    }
    // The ingest listener reads `authorization` the same way: a token that is not UTF-8
    // is no token (401), and the VM the two listeners share lives on.
    let mut push = b"POST /kvroute/v1/snapshot HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\nauthorization: Bearer caf".to_vec();
    push.extend_from_slice(&[0xe9, 0xff]);
    push.extend_from_slice(b"\r\n\r\n{}");
    let got = raw_exchange(
        fleet.ingest_port,
        &[(&push, Duration::ZERO)],
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 401"), "{got}");
    let r = fleet.post("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fleet.custom("kvroute.decisions.policy").await.unwrap(), 3);
    no_leak(&fleet).await;
    let bad = fleet.envoy.wasm_failures().await.unwrap();
    assert!(bad.is_empty(), "{bad:#?}");
}
