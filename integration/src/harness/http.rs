//! A small async HTTP/1.1 client for tests, over hyper's connection API (one connection per
//! request, so concurrent requests really are concurrent connections).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::time::Duration;

/// First value of header `name` (case-insensitive) in `headers`, whose names are lower-case.
pub fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let name = name.to_ascii_lowercase();
    headers
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
}

/// A complete response.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-case, in arrival order.
    pub headers: Vec<(String, String)>,
    /// Whole body.
    pub body: Bytes,
}

impl Response {
    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// Body as (lossy) text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Per-request deadline used by [`request`].
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Send one request to `url` (`http://host:port/path`) and read the whole response.
///
/// Errors: bad URL, connect failure, protocol error, or no response within
/// [`REQUEST_TIMEOUT`].
pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<Response> {
    tokio::time::timeout(REQUEST_TIMEOUT, request_inner(method, url, headers, body))
        .await
        .map_err(|_| anyhow::anyhow!("{method} {url}: no response within {REQUEST_TIMEOUT:?}"))?
}

async fn request_inner(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<Response> {
    let uri: hyper::Uri = url.parse()?;
    let host = uri
        .host()
        .ok_or_else(|| anyhow::anyhow!("no host in {url}"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let path = uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    let mut builder = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", format!("{host}:{port}"));
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let req = builder.body(Full::new(Bytes::copy_from_slice(body)))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// Write `parts` to a fresh connection to 127.0.0.1:`port`, pausing after each for its
/// duration (a slow client), then read until the server closes or `read_for` passes.
/// Returns whatever arrived (lossy UTF-8). Used for slow chunked uploads and aborts.
pub async fn raw_exchange(
    port: u16,
    parts: &[(&[u8], Duration)],
    read_for: Duration,
) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    for (bytes, pause) in parts {
        s.write_all(bytes).await?;
        s.flush().await?;
        tokio::time::sleep(*pause).await;
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + read_for;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(buf.get(..n).unwrap_or(&[])),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// POST `body` then `trailers` over HTTP/2 (prior knowledge, cleartext) to
/// 127.0.0.1:`port``path`: the request ends with a trailers frame, not an end-of-stream
/// data frame. Returns the status and the response body.
///
/// Errors: connect failure, protocol error, or no response within [`REQUEST_TIMEOUT`].
pub async fn h2_post_with_trailers(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    trailers: &[(&'static str, &str)],
) -> anyhow::Result<Response> {
    let inner = async {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(stream),
        )
        .await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let (tx, rx) = kvroute_sim::body::frame_channel(4);
        let mut builder = hyper::Request::builder()
            .method("POST")
            .uri(format!("http://127.0.0.1:{port}{path}"));
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let mut tmap = http::HeaderMap::new();
        for (k, v) in trailers {
            tmap.insert(*k, http::HeaderValue::from_str(v)?);
        }
        let data = Bytes::copy_from_slice(body);
        let send = tokio::spawn(async move {
            let _ = tx.send(hyper::body::Frame::data(data)).await;
            let _ = tx.send(hyper::body::Frame::trailers(tmap)).await;
        });
        let resp = sender.send_request(builder.body(rx)?).await?;
        let _ = send.await;
        let status = resp.status().as_u16();
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = resp.into_body().collect().await?.to_bytes();
        anyhow::Ok(Response {
            status,
            headers,
            body,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, inner)
        .await
        .map_err(|_| anyhow::anyhow!("h2 POST {path}: no response within {REQUEST_TIMEOUT:?}"))?
}
