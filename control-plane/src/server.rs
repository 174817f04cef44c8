//! kvroute-cp's own HTTP server (hyper 1, HTTP/1.1): `/healthz`, `/readyz`, `/metrics`,
//! `GET /v1/snapshot`. Paths are in [`crate::names`].

use crate::hub::Hub;
use crate::names::*;
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

/// Answer one request.
pub fn handle(hub: &Hub, method: &Method, path: &str) -> Response<Full<Bytes>> {
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
        PATH_READYZ => {
            if hub.ready() {
                reply(StatusCode::OK, TEXT, "ready\n")
            } else {
                let (_, _, pending) = hub.counts();
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    format!("not ready: no snapshot yet ({pending} endpoints not scraped)\n"),
                )
            }
        }
        PATH_METRICS => {
            hub.refresh_gauges();
            reply(StatusCode::OK, METRICS_CONTENT_TYPE, hub.telemetry.encode())
        }
        _ => match hub.latest() {
            Some(p) => reply(StatusCode::OK, "application/json", p.body.clone()),
            None => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, "no snapshot yet\n"),
        },
    }
}

/// Serve until `shutdown` turns true.
pub async fn serve(listener: TcpListener, hub: Arc<Hub>, mut shutdown: watch::Receiver<bool>) {
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = shutdown.changed() => return,
        };
        let hub = hub.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let resp = handle(&hub, req.method(), req.uri().path());
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}
