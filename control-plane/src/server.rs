//! kvroute-cp's own HTTP server (hyper 1, HTTP/1.1): `/healthz`, `/readyz`, `/metrics`,
//! `GET /v1/snapshot`. Paths are in [`crate::names`].
//!
//! `/readyz` answers 503 with the reason until the first snapshot is built, and while any
//! ingest target rejects the token. `/metrics` negotiates its format on `Accept`
//! ([`MetricsFormat::negotiate`]).
//!
//! A connection that does not send a request's headers within [`HEADER_READ_TIMEOUT`] is
//! closed, so clients that open connections and stall before a request is whole (a
//! slowloris) cannot hold the process's file descriptors, which the scrapes and pushes
//! need. A client that never reads its answers is not bounded by it.

use crate::hub::Hub;
use crate::names::*;
use crate::telemetry::MetricsFormat;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

/// Answer one request; `accept` is the request's `Accept` header (for `/metrics`).
pub fn handle(
    hub: &Hub,
    method: &Method,
    path: &str,
    accept: Option<&str>,
) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let known = [PATH_HEALTHZ, PATH_READYZ, PATH_METRICS, PATH_SNAPSHOT];
    if !known.contains(&path) {
        return reply(StatusCode::NOT_FOUND, TEXT, "not found\n");
    }
    if method != Method::GET && method != Method::HEAD {
        return reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "only GET\n");
    }
    match path {
        PATH_HEALTHZ => reply(StatusCode::OK, TEXT, "ok\n"),
        PATH_READYZ => match hub.not_ready_reason() {
            None => reply(StatusCode::OK, TEXT, "ready\n"),
            Some(why) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                format!("not ready: {why}\n"),
            ),
        },
        PATH_METRICS => {
            hub.refresh_gauges();
            let format = MetricsFormat::negotiate(accept);
            reply(
                StatusCode::OK,
                format.content_type(),
                hub.telemetry.encode_as(format),
            )
        }
        _ => match hub.latest() {
            Some(p) => reply(StatusCode::OK, "application/json", p.body.clone()),
            None => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, "no snapshot yet\n"),
        },
    }
}

/// How long the server waits after a failed `accept` before the next one.
pub const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

/// How long a connection may take to send a request's headers (hyper's
/// `http1::Builder::header_read_timeout`, which takes effect only with a timer; hyper's own
/// default when one is set is 30 s). Probes and Prometheus send theirs in one packet. It
/// also bounds a keep-alive connection's wait for its next request: one idle this long is
/// closed (the test below checks both).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serve until `shutdown` turns true.
///
/// A failed `accept` is retried after [`ACCEPT_BACKOFF`]: out of file descriptors
/// (EMFILE, e.g. a large fleet under a 1,024 limit), `accept` fails at once for as long as
/// a connection waits in the backlog, and retrying at once spun a core and wrote over
/// 60,000 `accept failed` lines a second (`tests/binary.rs`
/// `accept_errors_back_off_instead_of_spinning`).
pub async fn serve(listener: TcpListener, hub: Arc<Hub>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.changed() => return,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "accept failed; retrying in {} ms",
                    ACCEPT_BACKOFF.as_millis()
                );
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    _ = shutdown.changed() => return,
                }
                continue;
            }
        };
        let hub = hub.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let accept = req
                    .headers()
                    .get(http::header::ACCEPT)
                    .and_then(|v| v.to_str().ok());
                let resp = handle(&hub, req.method(), req.uri().path(), accept);
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client that sends half a request line and stalls is disconnected after
    /// [`HEADER_READ_TIMEOUT`] (paused clock: the runtime jumps it forward while idle);
    /// a whole request is still answered, and its keep-alive connection is closed once idle
    /// for as long.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_request_is_dropped_after_the_header_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hub = Hub::new(Duration::from_secs(1), Duration::ZERO, Duration::ZERO);
        let (_stop, rx) = watch::channel(false);
        tokio::spawn(serve(listener, hub, rx));

        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = c.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);

        // Idle past the bound between two requests: closed (the next read is EOF).
        tokio::time::sleep(HEADER_READ_TIMEOUT + Duration::from_secs(1)).await;
        assert_eq!(c.read(&mut buf).await.unwrap(), 0);

        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /healthz HTT").await.unwrap();
        let started = tokio::time::Instant::now();
        let mut rest = Vec::new();
        let read = slow.read_to_end(&mut rest).await;
        let waited = started.elapsed();
        assert!(
            waited >= HEADER_READ_TIMEOUT && waited < HEADER_READ_TIMEOUT * 2,
            "closed after {waited:?}"
        );
        // hyper may answer 408 before closing; either way the connection ends.
        assert!(
            read.is_err() || rest.is_empty() || rest.starts_with(b"HTTP/1.1 408"),
            "{:?}",
            String::from_utf8_lossy(&rest)
        );
    }
}
