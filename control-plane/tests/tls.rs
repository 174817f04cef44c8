//! `https://` scrapes and pushes with rustls: a CA, a server certificate for 127.0.0.1 and
//! a client certificate are generated in the test (rcgen); the test servers are rustls
//! (tokio-rustls) + hyper on 127.0.0.1 and require the client certificate (mTLS). They
//! close every connection after one response, so each scrape and push makes a new TLS
//! connection; their certificates can be swapped mid-test (rotation).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use bytes::Bytes;
use common::{kubelet_write, vllm_body, wait_for};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvroute_core::snapshot::Snapshot;
use kvroute_cp::{Config, ControlPlane};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// CA, server cert (SAN 127.0.0.1) and client cert, as PEM files.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let sign = |sans: Vec<SanType>, name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.subject_alt_names = sans;
            let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
            std::fs::write(dir.path().join(format!("{name}.crt")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        };
        sign(
            vec![SanType::IpAddress("127.0.0.1".parse().unwrap())],
            "server",
        );
        sign(
            vec![SanType::DnsName("kvroute-cp".try_into().unwrap())],
            "client",
        );
        std::fs::write(dir.path().join("ca.crt"), ca_cert.pem()).unwrap();
        // A second, unrelated CA.
        let other_key = KeyPair::generate().unwrap();
        let mut other = CertificateParams::new(Vec::<String>::new()).unwrap();
        other.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        std::fs::write(
            dir.path().join("other-ca.crt"),
            other.self_signed(&other_key).unwrap().pem(),
        )
        .unwrap();
        Self { dir }
    }

    fn path(&self, f: &str) -> String {
        self.dir.path().join(f).display().to_string()
    }
}

type Seen = Arc<Mutex<Vec<(String, Option<String>, Bytes)>>>;
/// The server's current TLS acceptor; replaced to rotate its certificates.
type Acceptor = Arc<Mutex<tokio_rustls::TlsAcceptor>>;

/// A rustls acceptor with `dir`'s `server.crt`/`server.key`, requiring a client certificate
/// signed by `dir`'s `ca.crt`.
fn acceptor(dir: &Path) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dir.join("ca.crt")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.crt"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// rustls + hyper server on 127.0.0.1 with [`acceptor`]`(dir)`; answers `/metrics` with a
/// vLLM body and 204 to anything else, recording (path, auth, body), one request per
/// connection.
async fn tls_server(dir: &Path) -> (SocketAddr, Seen, Acceptor, tokio::task::JoinHandle<()>) {
    let current: Acceptor = Arc::new(Mutex::new(acceptor(dir)));
    let acceptor = current.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, seen) = (acceptor.lock().unwrap().clone(), s2.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = service_fn(move |req: http::Request<Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let auth = req
                            .headers()
                            .get(http::header::AUTHORIZATION)
                            .map(|v| v.to_str().unwrap().to_owned());
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        seen.lock().unwrap().push((path.clone(), auth, body));
                        let mut r = http::Response::new(Full::new(Bytes::new()));
                        if path == "/metrics" {
                            r = http::Response::new(Full::new(Bytes::from(vllm_body(
                                0.125, 3, 1, None, 10.0,
                            ))));
                        } else {
                            *r.status_mut() = http::StatusCode::NO_CONTENT;
                        }
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (addr, seen, current, task)
}

/// Config scraping `metrics` and pushing to `ingest` over https, both sections with CA
/// bundle `ca` and client certificate `client` (cert, key).
fn yaml_files(
    metrics: SocketAddr,
    ingest: SocketAddr,
    scrape_ca: &str,
    push_ca: &str,
    client: Option<(&str, &str)>,
) -> String {
    let client = client
        .map(|(c, k)| format!("    cert_file: {c}\n    key_file: {k}\n"))
        .unwrap_or_default();
    format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 500\n  tls:\n    ca_file: {scrape_ca}\n{client}\
         push:\n  heartbeat_ms: 100\n  timeout_ms: 500\n  token_env: KVROUTE_TLS_TEST_TOKEN_UNSET\n  tls:\n    ca_file: {push_ca}\n{client}\
         targets:\n  - name: gw\n    url: https://{ingest}/kvroute/v1/snapshot\n\
         pools:\n  - name: p\n    kind: vllm\n    models: [m]\n    endpoints:\n      - name: e0\n        address: {metrics}\n        metrics_url: https://{metrics}/metrics\n",
    )
}

fn yaml(
    metrics: SocketAddr,
    ingest: SocketAddr,
    pki: &Pki,
    scrape_ca: &str,
    client_cert: bool,
) -> String {
    let (cert, key) = (pki.path("client.crt"), pki.path("client.key"));
    yaml_files(
        metrics,
        ingest,
        &pki.path(scrape_ca),
        &pki.path("ca.crt"),
        client_cert.then_some((cert.as_str(), key.as_str())),
    )
}

/// One labelled sample of the control plane's metrics, 0 when absent.
fn sample(cp: &ControlPlane, prefix: &str) -> f64 {
    cp.hub()
        .telemetry
        .encode()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A pushed snapshot carrying the stats the metrics server serves.
fn fresh_stats(body: &Bytes) -> bool {
    Snapshot::decode(body).is_ok_and(|s| {
        s.endpoints.len() == 1
            && s.endpoints[0].healthy
            && s.endpoints[0].kv_usage == Some(0.125)
            && s.endpoints[0].running == 3
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_ca_and_client_certificate_files_serve_the_next_connection() {
    // Two unrelated PKIs. The control plane reads its CA bundle and client certificate from
    // a directory that kubelet-style swaps rotate; the servers start on PKI A.
    let (a, b) = (Pki::new(), Pki::new());
    let live = tempfile::tempdir().unwrap();
    let material = |p: &Pki| {
        ["ca.crt", "client.crt", "client.key"].map(|f| std::fs::read(p.dir.path().join(f)).unwrap())
    };
    let write = |version: u32, [ca, crt, key]: &[Vec<u8>; 3]| {
        kubelet_write(
            live.path(),
            version,
            &[("ca.crt", ca), ("tls.crt", crt), ("tls.key", key)],
        );
    };
    write(1, &material(&a));
    let (metrics, metrics_seen, metrics_tls, t1) = tls_server(a.dir.path()).await;
    let (ingest, ingest_seen, ingest_tls, t2) = tls_server(a.dir.path()).await;
    let f = |name: &str| live.path().join(name).display().to_string();
    let cp = ControlPlane::start(
        Config::from_yaml(&yaml_files(
            metrics,
            ingest,
            &f("ca.crt"),
            &f("ca.crt"),
            Some((&f("tls.crt"), &f("tls.key"))),
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    let pushed_fresh_after = |n: usize| {
        ingest_seen
            .lock()
            .unwrap()
            .iter()
            .skip(n)
            .any(|(_, _, body)| fresh_stats(body))
    };
    wait_for(WAIT, "scrape and push with PKI A", || pushed_fresh_after(0)).await;

    // Both servers move to PKI B: a server certificate the control plane does not trust yet,
    // and only client certificates from B accepted. Scrapes and pushes fail.
    *metrics_tls.lock().unwrap() = acceptor(b.dir.path());
    *ingest_tls.lock().unwrap() = acceptor(b.dir.path());
    let scrape_fails = sample(&cp, "kvroute_cp_scrape_errors_total{");
    let push_fails = sample(&cp, "kvroute_cp_push_failures_total{");
    wait_for(WAIT, "scrapes and pushes fail against PKI B", || {
        sample(&cp, "kvroute_cp_scrape_errors_total{") > scrape_fails
            && sample(&cp, "kvroute_cp_push_failures_total{") > push_fails
    })
    .await;
    let (m, i) = (
        metrics_seen.lock().unwrap().len(),
        ingest_seen.lock().unwrap().len(),
    );

    // The files rotate to B (no SIGHUP, no config reload): the next connections use them.
    write(2, &material(&b));
    wait_for(WAIT, "scrape and push with the rotated PKI B files", || {
        metrics_seen.lock().unwrap().len() > m && pushed_fresh_after(i)
    })
    .await;
    let failures = |section: &str| {
        sample(
            &cp,
            &format!("kvroute_cp_file_reload_failures_total{{source=\"{section}\"}}"),
        )
    };
    assert_eq!((failures("scrape.tls"), failures("push.tls")), (0.0, 0.0));

    // A rotation to an unusable CA bundle is refused: one failure per section, and the
    // B material stays in use.
    let [_, crt, key] = material(&b);
    write(3, &[b"not a certificate\n".to_vec(), crt, key]);
    wait_for(WAIT, "the bad CA bundle counted in both sections", || {
        failures("scrape.tls") == 1.0 && failures("push.tls") == 1.0
    })
    .await;
    let (m, i) = (
        metrics_seen.lock().unwrap().len(),
        ingest_seen.lock().unwrap().len(),
    );
    wait_for(WAIT, "scrapes and pushes go on with PKI B", || {
        metrics_seen.lock().unwrap().len() > m + 2 && pushed_fresh_after(i)
    })
    .await;
    assert_eq!((failures("scrape.tls"), failures("push.tls")), (1.0, 1.0));

    // So is a client certificate that does not match its key (A's certificate, B's key).
    let ([ca, _, key], [_, crt_a, _]) = (material(&b), material(&a));
    write(4, &[ca, crt_a, key]);
    wait_for(WAIT, "the mismatched key counted in both sections", || {
        failures("scrape.tls") == 2.0 && failures("push.tls") == 2.0
    })
    .await;
    let (m, i) = (
        metrics_seen.lock().unwrap().len(),
        ingest_seen.lock().unwrap().len(),
    );
    wait_for(WAIT, "scrapes and pushes still go on with PKI B", || {
        metrics_seen.lock().unwrap().len() > m + 2 && pushed_fresh_after(i)
    })
    .await;
    cp.shutdown().await;
    t1.abort();
    t2.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_scrape_and_push_with_ca_bundle_and_client_certificate() {
    let pki = Pki::new();
    let (metrics, metrics_seen, _, t1) = tls_server(pki.dir.path()).await;
    let (ingest, ingest_seen, _, t2) = tls_server(pki.dir.path()).await;
    let cp = ControlPlane::start(
        Config::from_yaml(&yaml(metrics, ingest, &pki, "ca.crt", true)).unwrap(),
    )
    .await
    .unwrap();
    // The snapshot pushed over TLS carries the stats scraped over TLS.
    wait_for(
        WAIT,
        "a pushed snapshot with the https-scraped stats",
        || {
            ingest_seen.lock().unwrap().iter().any(|(path, _, body)| {
                path == "/kvroute/v1/snapshot"
                    && Snapshot::decode(body).is_ok_and(|s| {
                        s.endpoints.len() == 1
                            && s.endpoints[0].kv_usage == Some(0.125)
                            && s.endpoints[0].running == 3
                            && s.endpoints[0].waiting == 1
                    })
            })
        },
    )
    .await;
    assert!(metrics_seen
        .lock()
        .unwrap()
        .iter()
        .all(|(p, _, _)| p == "/metrics"));
    cp.shutdown().await;
    t1.abort();
    t2.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_fails_closed_on_unknown_ca_or_missing_client_certificate() {
    let pki = Pki::new();
    let (metrics, metrics_seen, _, t1) = tls_server(pki.dir.path()).await;
    let (ingest, ingest_seen, _, t2) = tls_server(pki.dir.path()).await;
    // Scrapes trust another CA: the handshake fails, nothing reaches the server.
    let cp = ControlPlane::start(
        Config::from_yaml(&yaml(metrics, ingest, &pki, "other-ca.crt", true)).unwrap(),
    )
    .await
    .unwrap();
    wait_for(WAIT, "scrape errors counted as connect failures", || {
        cp.hub().telemetry.encode().lines().any(|l| {
            l.starts_with("kvroute_cp_scrape_errors_total{")
                && l.contains("reason=\"connect\"")
                && !l.ends_with(" 0")
        })
    })
    .await;
    assert!(metrics_seen.lock().unwrap().is_empty());
    // Pushes (right CA) go on, carrying the endpoint as unhealthy with no stats.
    wait_for(WAIT, "the unscrapable endpoint pushed as unhealthy", || {
        ingest_seen.lock().unwrap().iter().any(|(_, _, body)| {
            Snapshot::decode(body).is_ok_and(|s| {
                s.endpoints.len() == 1
                    && !s.endpoints[0].healthy
                    && s.endpoints[0].kv_usage.is_none()
            })
        })
    })
    .await;
    cp.shutdown().await;
    ingest_seen.lock().unwrap().clear();
    // No client certificate: the server refuses the handshake; pushes fail.
    let cp = ControlPlane::start(
        Config::from_yaml(&yaml(metrics, ingest, &pki, "ca.crt", false)).unwrap(),
    )
    .await
    .unwrap();
    wait_for(WAIT, "push failures without a client certificate", || {
        cp.hub()
            .telemetry
            .encode()
            .lines()
            .any(|l| l.starts_with("kvroute_cp_push_failures_total{") && !l.ends_with(" 0"))
    })
    .await;
    assert!(ingest_seen.lock().unwrap().is_empty());
    assert!(metrics_seen.lock().unwrap().is_empty());
    cp.shutdown().await;
    t1.abort();
    t2.abort();
}

#[tokio::test]
async fn bad_tls_files_are_named_at_start() {
    let pki = Pki::new();
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let mut y = yaml(addr, addr, &pki, "ca.crt", false);
    y = y.replacen(&pki.path("ca.crt"), &pki.path("missing.crt"), 1);
    let err = ControlPlane::start(Config::from_yaml(&y).unwrap())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "tls: scrape.tls.ca_file `{}`: ",
            pki.path("missing.crt")
        )),
        "{err}"
    );
    let y = yaml(addr, addr, &pki, "client.key", false);
    let err = ControlPlane::start(Config::from_yaml(&y).unwrap())
        .await
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        err,
        format!(
            "tls: scrape.tls.ca_file `{}`: no PEM certificate in the file",
            pki.path("client.key")
        )
    );
}
