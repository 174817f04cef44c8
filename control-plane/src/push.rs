//! Pushing snapshots: one tokio task per Envoy ingest target.
//!
//! Each target gets its own body ([`crate::hub::Published::body_for`]): the published
//! snapshot plus the other gateways' in-flight load ([`crate::peers`]).
//!
//! Each task waits for a newly published snapshot and POSTs its wire bytes to the target
//! with `Authorization: Bearer <token>` (the filter's ingest contract: 204 accepted, 400
//! invalid, 401 bad token, 413 too large). On failure it retries with exponential backoff
//! (`push.backoff_initial_ms` doubling to `push.backoff_max_ms`, plus up to 10 % jitter),
//! always sending the newest snapshot available at the time of the retry. Targets never
//! wait on each other.
//!
//! A rejected token (401, or 403 from an RBAC filter in front of the ingest) is a
//! misconfiguration, not a transient fault: it is logged at `error` naming the token and
//! where it was read from (at most once per [`crate::scrape::WARN_EVERY`]), counted in
//! `kvroute_cp_push_auth_rejected`, and `/readyz` answers 503 until a push to that target
//! succeeds ([`Hub::set_push_rejected`]). So is a 404 (the target URL is not the filter's
//! ingest listener and path, [`NOT_FOUND_HINT`]): logged at `error` and held in `/readyz`
//! the same way, without the token metric.

use crate::config::{PushSettings, Target};
use crate::hub::{Hub, Published};
use crate::telemetry::TargetLabel;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// HTTP client used for pushes (`http://` and `https://`, [`crate::tls`]).
pub type PushClient = Client<crate::tls::Connector, Full<Bytes>>;

/// A keep-alive client for pushes; `tls` is used for `https://` URLs.
pub fn client(connect_timeout: Duration, tls: &crate::tls::TlsRx) -> PushClient {
    let conn = crate::tls::connector(connect_timeout, tls);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(conn)
}

/// Why one push failed.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// No answer within `push.timeout_ms`.
    #[error("timed out")]
    Timeout,
    /// Connection failure.
    #[error("request failed: {0}")]
    Connect(String),
    /// The ingest answered something other than 2xx; a 404 carries [`NOT_FOUND_HINT`].
    #[error("ingest answered HTTP {0}{hint}", hint = status_hint(*.0))]
    Status(u16),
}

/// What a 404 from a push target means. The filter's ingest never answers 404 on its
/// route, so a 404 comes from something else: most often `targets[].url` names Envoy's
/// client listener (port 10000 in `examples/envoy/`) instead of the ingest listener
/// (10001), and the push is proxied to a model server, which has no such path.
pub const NOT_FOUND_HINT: &str = ": is `url` the filter's ingest listener? a 404 comes from a \
     listener or route without the kvroute ingest (e.g. Envoy's client listener, which proxies \
     the push to a model server)";

/// The hint appended to `ingest answered HTTP {code}` ([`NOT_FOUND_HINT`] for 404, else none).
fn status_hint(code: u16) -> &'static str {
    if code == 404 {
        NOT_FOUND_HINT
    } else {
        ""
    }
}

/// The `error` line and `/readyz` reason for a push to `url` refused with `code` (401, or
/// 403 from an RBAC filter in front of the ingest). `token_sent`: whether the push carried
/// a token; `token_source`: where it is read from ([`crate::config::PushSettings::token_source`]).
pub fn auth_rejected(url: &http::Uri, code: u16, token_sent: bool, token_source: &str) -> String {
    if token_sent {
        format!(
            "ingest {url} answered HTTP {code}: it rejected the ingest token ({token_source}); \
             it must equal the filter's `ingest_token`"
        )
    } else {
        format!(
            "ingest {url} answered HTTP {code}: no ingest token was sent (none found in \
             {token_source}); set that to the filter's `ingest_token`, or name a file holding \
             it in `push.token_file`"
        )
    }
}

impl PushError {
    /// Metric label.
    pub fn reason(&self) -> String {
        match self {
            Self::Timeout => "timeout".into(),
            Self::Connect(_) => "connect".into(),
            Self::Status(s) => s.to_string(),
        }
    }
}

/// How long after its making a snapshot may go out with its own `generated_at_ms`. A later
/// one (a push retried after failures, up to `push.heartbeat_ms` old) is re-stamped with
/// the send time ([`kvroute_core::snapshot::restamp`]): the filter takes `generated_at_ms`
/// for the control plane's clock at sending when it moves the snapshot's times onto
/// Envoy's, so a snapshot that waited made every scrape in it look that much younger. Below
/// this bound the body is sent as built (no copy per push and target); the error is at
/// most this.
pub const RESTAMP_AFTER_MS: u64 = 100;

/// `body` (made at `generated_at_ms`), re-stamped with `now_ms` when it is older than
/// [`RESTAMP_AFTER_MS`].
fn stamped_if_late(body: Bytes, generated_at_ms: u64, now_ms: u64) -> Bytes {
    if now_ms.saturating_sub(generated_at_ms) <= RESTAMP_AFTER_MS {
        return body;
    }
    match kvroute_core::snapshot::restamp(&body, now_ms) {
        Some(b) => Bytes::from(b),
        None => body,
    }
}

/// Most bytes of an ingest's answer read after a push, to reuse the connection (64 KiB; the
/// filter's answers are a few hundred bytes). Past it the answer is dropped with its
/// connection: an answer that never ends (a wrong `url` pointing at a download, a broken
/// ingest) grew kvroute-cp by ~700 MB per push within the 1 s timeout when read whole (found
/// by a breaker, 2026-12-05).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// POST one snapshot body. The answer's status decides the outcome; at most
/// [`MAX_ANSWER_BYTES`] of its body are read.
pub async fn post(
    client: &PushClient,
    url: &http::Uri,
    token: Option<&str>,
    body: Bytes,
    timeout: Duration,
) -> Result<(), PushError> {
    let mut req =
        http::Request::post(url.clone()).header(http::header::CONTENT_TYPE, "application/json");
    if let Some(t) = token {
        req = req.header(http::header::AUTHORIZATION, crate::token::bearer(t));
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| PushError::Connect(e.to_string()))?;
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| PushError::Connect(crate::scrape::error_chain(&e)))?;
        let status = resp.status();
        // Drain a small answer so the connection can be reused.
        let _ = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await;
        if status.is_success() {
            Ok(())
        } else {
            Err(PushError::Status(status.as_u16()))
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(PushError::Timeout))
}

/// Aborts the stats task of a push target when its push task ends (the supervisor aborts
/// push tasks it stops).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

/// The per-target loop; returns when `shutdown` turns true. Each push reads the current
/// token from `token` ([`crate::token`]), so a rotated token is used without a restart.
pub async fn run_target(
    hub: Arc<Hub>,
    client: PushClient,
    target: Target,
    settings: PushSettings,
    token: crate::token::TokenRx,
    token_source: Arc<str>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last_auth_log: Option<Instant> = None;
    // No push accepted yet, or the last one failed: the next success is logged once, so the
    // log shows when a target starts (or again) taking snapshots, not only its failures.
    let mut unconfirmed = true;
    let mut rx = hub.subscribe();
    let label = TargetLabel {
        target: target.name.clone(),
    };
    let mut rng = fastrand::Rng::with_seed(target.name.len() as u64 ^ 0x9e37_79b9_7f4a_7c15);
    let mut pending: Option<Arc<Published>> = rx.borrow_and_update().clone();
    // This gateway's in-flight load, read for the others while this task runs.
    let stats_task = target.stats_url.is_some().then(|| {
        tokio::spawn(crate::peers::run_gateway(
            hub.clone(),
            client.clone(),
            target.clone(),
            settings.peer_load.clone(),
            shutdown.clone(),
        ))
    });
    let _stop_stats = AbortOnDrop(stats_task);
    loop {
        let Some(snap) = pending.take() else {
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = shutdown.changed() => return,
            }
            pending = rx.borrow_and_update().clone();
            continue;
        };
        let mut backoff = settings.backoff_initial;
        let mut current = snap;
        loop {
            let started = Instant::now();
            let bearer = token.borrow().clone();
            let body = stamped_if_late(
                current.body_for(&target.name, settings.peer_load.stale_after),
                current.generated_at_ms,
                crate::hub::now_ms(),
            );
            match post(
                &client,
                &target.url,
                bearer.as_deref(),
                body,
                settings.timeout,
            )
            .await
            {
                Ok(()) => {
                    let t = &hub.telemetry;
                    t.push_duration
                        .get_or_create(&label)
                        .observe(started.elapsed().as_secs_f64());
                    t.pushes.get_or_create(&label).inc();
                    t.push_auth_rejected.get_or_create(&label).set(0);
                    if let Some(c) = current.changed_at {
                        t.scrape_to_push
                            .get_or_create(&label)
                            .observe(c.elapsed().as_secs_f64());
                    }
                    hub.set_push_rejected(&target.name, None);
                    if std::mem::replace(&mut unconfirmed, false) {
                        tracing::info!(target = %target.name, url = %target.url, version = current.version, "snapshot accepted by the ingest listener");
                    }
                    break;
                }
                Err(PushError::Status(code @ (401 | 403 | 404))) => {
                    unconfirmed = true;
                    let why = if code == 404 {
                        format!("ingest {} answered HTTP 404{NOT_FOUND_HINT}", target.url)
                    } else {
                        hub.telemetry
                            .push_auth_rejected
                            .get_or_create(&label)
                            .set(1);
                        auth_rejected(&target.url, code, bearer.is_some(), &token_source)
                    };
                    if last_auth_log.is_none_or(|t| t.elapsed() >= crate::scrape::WARN_EVERY) {
                        last_auth_log = Some(Instant::now());
                        tracing::error!(target = %target.name, retry_in = ?backoff, "{why}; Envoy routes on stale stats until this is fixed");
                    }
                    hub.telemetry.push_failure(&target.name, &code.to_string());
                    hub.set_push_rejected(&target.name, Some(why));
                    let wait = backoff.mul_f64(1.0 + 0.1 * rng.f64());
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.changed() => return,
                    }
                    backoff = (backoff * 2).min(settings.backoff_max);
                    if let Some(newer) = rx.borrow_and_update().clone() {
                        current = newer;
                    }
                }
                Err(e) => {
                    unconfirmed = true;
                    tracing::warn!(target = %target.name, error = %e, retry_in = ?backoff, "push failed");
                    hub.telemetry.push_failure(&target.name, &e.reason());
                    let wait = backoff.mul_f64(1.0 + 0.1 * rng.f64());
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.changed() => return,
                    }
                    backoff = (backoff * 2).min(settings.backoff_max);
                    if let Some(newer) = rx.borrow_and_update().clone() {
                        current = newer;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ingest that answers 204 with a body that never ends: the push succeeds once
    /// [`MAX_ANSWER_BYTES`] are read, instead of reading until the timeout.
    #[tokio::test]
    async fn an_endless_answer_is_not_read_whole() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = conn.read(&mut buf).await;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                .await;
            let chunk = format!("{:x}\r\n{}\r\n", 16 * 1024, "x".repeat(16 * 1024));
            let mut sent = 0usize;
            while conn.write_all(chunk.as_bytes()).await.is_ok() {
                sent += 16 * 1024;
            }
            sent
        });
        let tls = crate::tls::TlsSource::start(
            "push.tls",
            &crate::config::TlsSettings::default(),
            Default::default(),
        )
        .unwrap();
        let client = client(Duration::from_secs(1), &tls.subscribe());
        let url: http::Uri = format!("http://{addr}/kvroute/v1/snapshot")
            .parse()
            .unwrap();
        let r = post(
            &client,
            &url,
            None,
            Bytes::from_static(b"{}"),
            Duration::from_secs(5),
        )
        .await;
        assert!(r.is_ok(), "{r:?}");
        drop(client);
        let sent = tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
        // The connection was dropped soon after the limit (socket buffers hold a few MB).
        assert!(sent < 64 * 1024 * 1024, "{sent} bytes sent");
    }

    /// A 404 names the usual cause: a target URL on Envoy's client listener.
    /// A snapshot sent within [`RESTAMP_AFTER_MS`] of its making goes as built (the same
    /// bytes, no copy); a later one carries the send time.
    #[test]
    fn a_late_push_carries_its_send_time() {
        let body = Bytes::from_static(
            br#"{"format":1,"version":3,"generated_at_ms":1000,"endpoints":[]}"#,
        );
        let on_time = stamped_if_late(body.clone(), 1000, 1000 + RESTAMP_AFTER_MS);
        assert_eq!(on_time.as_ptr(), body.as_ptr());
        assert_eq!(
            &stamped_if_late(body, 1000, 4000)[..],
            br#"{"format":1,"version":3,"generated_at_ms":4000,"endpoints":[]}"#
        );
    }

    #[test]
    fn a_404_says_the_url_is_not_the_ingest_listener() {
        assert_eq!(
            PushError::Status(404).to_string(),
            "ingest answered HTTP 404: is `url` the filter's ingest listener? a 404 comes from \
             a listener or route without the kvroute ingest (e.g. Envoy's client listener, \
             which proxies the push to a model server)"
        );
        assert_eq!(
            PushError::Status(500).to_string(),
            "ingest answered HTTP 500"
        );
        assert_eq!(PushError::Status(404).reason(), "404");
    }

    /// A 401 with no token sent says so instead of blaming a token that was never sent.
    #[test]
    fn auth_rejection_says_whether_a_token_was_sent() {
        let url: http::Uri = "http://127.0.0.1:10001/kvroute/v1/snapshot"
            .parse()
            .unwrap();
        let env = "environment variable `KVROUTE_INGEST_TOKEN`";
        assert_eq!(
            auth_rejected(&url, 401, false, env),
            "ingest http://127.0.0.1:10001/kvroute/v1/snapshot answered HTTP 401: no ingest \
             token was sent (none found in environment variable `KVROUTE_INGEST_TOKEN`); set \
             that to the filter's `ingest_token`, or name a file holding it in `push.token_file`"
        );
        assert_eq!(
            auth_rejected(&url, 403, true, env),
            "ingest http://127.0.0.1:10001/kvroute/v1/snapshot answered HTTP 403: it rejected \
             the ingest token (environment variable `KVROUTE_INGEST_TOKEN`); it must equal the \
             filter's `ingest_token`"
        );
    }
}
