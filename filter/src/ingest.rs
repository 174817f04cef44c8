//! The snapshot ingest route (plugin role `ingest`).
//!
//! Contract (the control plane implements the client side):
//! `POST <ingest_path>` (default `/kvroute/v1/snapshot`) with
//! `Authorization: Bearer <ingest_token>` and a `kvroute_core::snapshot::Snapshot` JSON body.
//! Answers, always locally (nothing is forwarded upstream), errors in OpenAI's error shape
//! ([`crate::reply`], `code` in brackets):
//! - `204` — valid; enqueued on the shared queue for the root-context consumer;
//! - `401` (`invalid_ingest_token`) — missing or wrong token (constant-time comparison);
//! - `413` (`request_too_large`) — body over `ingest_max_bytes` (named in the message);
//! - `415` (`unsupported_encoding`) — a `Content-Encoding` other than none or `identity`;
//! - `400` (`invalid_snapshot`) — not a valid snapshot (the message says why);
//! - `404` (`not_found`) / `405` (`method_not_allowed`) — other paths or methods;
//! - `503` (`queue_unavailable`) — the shared queue could not be resolved.
//!
//! [`IngestStream`] is the per-request state machine of this role (headers checked at once,
//! body buffered up to `ingest_max_bytes`, enqueued at end of stream or trailers);
//! [`consume_snapshots`] is the root context's consumer of the shared queue, which
//! publishes each snapshot to shared data for the route role's workers.

use crate::host::{Host, Level, MetricKind};
use crate::names::metric;
use crate::reply::{self, LocalReply};
use crate::shared;
use crate::stream::Flow;
use kvroute_core::plugin_config::Config;
use std::rc::Rc;
use subtle::ConstantTimeEq;

/// A local reply (see [`crate::reply`]).
pub type Reply = LocalReply;

/// Token check: `Authorization: Bearer <token>`, constant time in the token's content. The
/// scheme's name is matched in any case, as HTTP's authentication schemes are (RFC 9110
/// §11.1: `bearer` is `Bearer`).
pub fn authorized(config: &Config, authorization: Option<&str>) -> bool {
    let scheme = kvroute_core::snapshot::AUTH_SCHEME.trim_end();
    let Some(given) = authorization.and_then(|a| {
        let (name, token) = a.trim_start().split_once(' ')?;
        name.eq_ignore_ascii_case(scheme).then_some(token)
    }) else {
        return false;
    };
    let want = config.ingest_token.as_bytes();
    !want.is_empty() && bool::from(given.trim().as_bytes().ct_eq(want))
}

/// Header-time checks, in this order: path, method, token, declared length, content
/// encoding. `Some(reply)` answers now; `None` means "read the body".
pub fn check_headers(
    config: &Config,
    method: Option<&str>,
    path: Option<&str>,
    authorization: Option<&str>,
    content_length: Option<&str>,
    content_encoding: Option<&[u8]>,
) -> Option<Reply> {
    let path = path.unwrap_or("").split('?').next().unwrap_or("");
    if path != config.ingest_path {
        return Some(reply::ingest_not_found(path));
    }
    if method != Some("POST") {
        return Some(reply::ingest_method_not_allowed());
    }
    if !authorized(config, authorization) {
        return Some(reply::ingest_unauthorized());
    }
    if let Some(len) = content_length.and_then(|l| l.trim().parse::<u64>().ok()) {
        if len > config.ingest_max_bytes as u64 {
            return Some(too_large(config));
        }
    }
    // A compressed snapshot would fail to decode with a parse error at its first byte
    // (found by a breaker): named for what it is instead.
    if let Some(e) = content_encoding.filter(|e| crate::headers::encodes(e)) {
        return Some(reply::ingest_encoded(&String::from_utf8_lossy(
            e.trim_ascii(),
        )));
    }
    None
}

/// 413 for a body over the limit.
pub fn too_large(config: &Config) -> Reply {
    reply::ingest_too_large(config.ingest_max_bytes)
}

/// Body-time check: `Ok(())` when the body is a valid snapshot within limits.
pub fn check_body(config: &Config, body: &[u8]) -> Result<(), Reply> {
    if body.len() > config.ingest_max_bytes {
        return Err(too_large(config));
    }
    kvroute_core::snapshot::Snapshot::decode(body)
        .map(|_| ())
        .map_err(|e| reply::ingest_invalid(&e.to_string()))
}

/// 204 after enqueueing.
pub fn accepted() -> Reply {
    Reply {
        status: 204,
        retry_after_s: None,
        body: String::new(),
    }
}

/// 503 when the queue is unavailable.
pub fn queue_unavailable() -> Reply {
    reply::ingest_queue_unavailable()
}

/// One request on the ingest listener: always answered locally, exactly once.
#[derive(Debug)]
pub struct IngestStream {
    config: Rc<Config>,
    replied: bool,
    /// Request body bytes buffered so far (read again when trailers end the request).
    body_len: usize,
}

impl IngestStream {
    /// A stream under `config` (role `ingest`).
    pub fn new(config: Rc<Config>) -> Self {
        Self {
            config,
            replied: false,
            body_len: 0,
        }
    }

    fn reply<H: Host>(&mut self, host: &H, r: &Reply) {
        if self.replied {
            return;
        }
        self.replied = true;
        r.send(host);
    }

    fn reject<H: Host>(&mut self, host: &H, r: &Reply) -> Flow {
        if !self.replied {
            host.metric_add(MetricKind::Counter, metric::INGEST_REJECTED, 1);
        }
        self.reply(host, r);
        Flow::Pause
    }

    /// Request headers arrived: path, method, token, declared length and content encoding
    /// are checked now ([`check_headers`]).
    pub fn on_request_headers<H: Host>(&mut self, host: &H, end_of_stream: bool) -> Flow {
        // Every header this reads, in one host call.
        let headers = host.request_headers();
        let reply = check_headers(
            &self.config,
            headers.get_str(":method"),
            headers.get_str(":path"),
            headers.get_str("authorization"),
            headers.get_str("content-length"),
            headers.get("content-encoding"),
        );
        if let Some(r) = reply {
            return self.reject(host, &r);
        }
        if end_of_stream {
            return self.finish(host, &[]);
        }
        Flow::Pause
    }

    /// A request body chunk arrived; `buffered` is the total buffered size.
    pub fn on_request_body<H: Host>(
        &mut self,
        host: &H,
        buffered: usize,
        end_of_stream: bool,
    ) -> Flow {
        if self.replied {
            return Flow::Pause;
        }
        self.body_len = buffered;
        if buffered > self.config.ingest_max_bytes {
            let r = too_large(&self.config);
            return self.reject(host, &r);
        }
        if !end_of_stream {
            return Flow::Pause;
        }
        host.with_request_body(buffered, |b| self.finish(host, b.unwrap_or_default()))
    }

    /// Request trailers arrived: they end the upload (HTTP/2, or chunked with trailers).
    pub fn on_request_trailers<H: Host>(&mut self, host: &H) -> Flow {
        if self.replied {
            return Flow::Pause;
        }
        host.with_request_body(self.body_len, |b| self.finish(host, b.unwrap_or_default()))
    }

    fn finish<H: Host>(&mut self, host: &H, body: &[u8]) -> Flow {
        if self.replied {
            return Flow::Pause;
        }
        let r = match check_body(&self.config, body) {
            Err(r) => return self.reject(host, &r),
            Ok(()) => match host.enqueue(&self.config.vm_id, &self.config.queue_name, body) {
                Ok(()) => {
                    host.metric_add(MetricKind::Counter, metric::INGEST_ACCEPTED, 1);
                    accepted()
                }
                Err(e) => {
                    host.log(
                        Level::Error,
                        &format!("kvroute: ingest enqueue failed: {e}"),
                    );
                    queue_unavailable()
                }
            },
        };
        self.reply(host, &r);
        Flow::Pause
    }
}

/// Drain snapshot bytes dequeued from the shared queue: publish each (newer versions only).
pub fn consume_snapshots<H: Host>(host: &H, items: Vec<Vec<u8>>) {
    for bytes in items {
        match shared::publish_snapshot(host, &bytes) {
            Ok(shared::Published::Published(v)) => {
                host.metric_add(MetricKind::Counter, metric::SNAPSHOTS_PUBLISHED, 1);
                host.log(Level::Debug, &format!("kvroute: snapshot {v} published"));
            }
            Ok(shared::Published::Ignored { offered, current }) => {
                host.metric_add(MetricKind::Counter, metric::SNAPSHOTS_STALE, 1);
                host.log(
                    Level::Info,
                    &format!("kvroute: snapshot {offered} ignored (current {current})"),
                );
            }
            Err(e) => host.log(
                Level::Warn,
                &format!("kvroute: snapshot not published: {e}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use kvroute_core::snapshot::Snapshot;

    const NOW: u64 = 1_000_000;

    fn setup(cfg: &str) -> (MockHost, Rc<Config>) {
        (
            MockHost::new(NOW),
            Rc::new(Config::parse(cfg.as_bytes()).unwrap()),
        )
    }

    /// An upload to the ingest path from `h`'s shared state with bearer `token`.
    fn upload(h: &MockHost, token: &str) -> MockHost {
        h.sibling()
            .with_header(":path", "/kvroute/v1/snapshot")
            .with_header(":method", "POST")
            .with_header("authorization", &format!("Bearer {token}"))
    }

    #[test]
    fn ingest_stream_answers_locally() {
        let cfg = r#"{"role":"ingest","ingest_token":"0123456789abcdef","ingest_max_bytes":4096}"#;
        let (h, c) = setup(cfg);
        let snap = Snapshot::new(3, NOW, vec![]).encode();
        let ok = upload(&h, "0123456789abcdef").with_body(&snap);
        let mut s = IngestStream::new(c.clone());
        assert_eq!(s.on_request_headers(&ok, false), Flow::Pause);
        assert_eq!(s.on_request_body(&ok, snap.len(), true), Flow::Pause);
        assert_eq!(ok.replies()[0].status, 204);
        let queued = h
            .shared
            .borrow()
            .queues
            .get("kvroute.snapshots")
            .cloned()
            .unwrap();
        assert_eq!(queued, vec![snap.clone()]);
        // The consumer publishes it.
        consume_snapshots(&h, queued);
        assert_eq!(shared::current_version(&h).unwrap(), Some(3));

        let bad = upload(&h, "nope");
        let mut s = IngestStream::new(c.clone());
        assert_eq!(s.on_request_headers(&bad, false), Flow::Pause);
        assert_eq!(bad.replies()[0].status, 401);
        assert_eq!(s.on_request_body(&bad, 10, true), Flow::Pause);
        assert_eq!(bad.replies().len(), 1, "one reply only");

        let big = upload(&ok, "0123456789abcdef");
        let mut s = IngestStream::new(c);
        s.on_request_headers(&big, false);
        assert_eq!(s.on_request_body(&big, 5000, false), Flow::Pause);
        assert_eq!(big.replies()[0].status, 413);
        assert_eq!(h.metric(metric::INGEST_ACCEPTED), 1);
        assert_eq!(h.metric(metric::INGEST_REJECTED), 2);
    }

    /// Trailers end the snapshot upload too (HTTP/2, or HTTP/1 chunked with trailers).
    #[test]
    fn trailers_end_the_upload() {
        let cfg = r#"{"role":"ingest","ingest_token":"0123456789abcdef"}"#;
        let (h, c) = setup(cfg);
        let snap = Snapshot::new(3, NOW, vec![]).encode();
        let ok = upload(&h, "0123456789abcdef").with_body(&snap);
        let mut s = IngestStream::new(c);
        assert_eq!(s.on_request_headers(&ok, false), Flow::Pause);
        assert_eq!(s.on_request_body(&ok, snap.len(), false), Flow::Pause);
        assert_eq!(s.on_request_trailers(&ok), Flow::Pause);
        assert_eq!(ok.replies()[0].status, 204);
    }

    /// A compressed snapshot is refused at its headers with a 415 that names the encoding;
    /// an empty or `identity` encoding is no encoding.
    #[test]
    fn an_encoded_snapshot_is_a_415() {
        let cfg = r#"{"role":"ingest","ingest_token":"0123456789abcdef"}"#;
        let (h, c) = setup(cfg);
        let snap = Snapshot::new(3, NOW, vec![]).encode();
        let gz = upload(&h, "0123456789abcdef").with_header("content-encoding", "gzip");
        let mut s = IngestStream::new(c.clone());
        assert_eq!(s.on_request_headers(&gz, false), Flow::Pause);
        let r = &gz.replies()[0];
        assert_eq!(r.status, 415);
        assert_eq!(
            String::from_utf8_lossy(&r.body),
            r#"{"error":{"code":"unsupported_encoding","message":"Snapshot sent with content-encoding `gzip`; the ingest listener takes it uncompressed.","param":null,"type":"invalid_request_error"}}"#
        );
        for plain in ["", "identity"] {
            let ok = upload(&h, "0123456789abcdef")
                .with_header("content-encoding", plain)
                .with_body(&snap);
            let mut s = IngestStream::new(c.clone());
            assert_eq!(s.on_request_headers(&ok, false), Flow::Pause);
            assert_eq!(s.on_request_body(&ok, snap.len(), true), Flow::Pause);
            assert_eq!(ok.replies()[0].status, 204, "{plain:?}");
        }
    }

    fn cfg() -> Config {
        Config::parse(
            br#"{"role":"ingest","ingest_token":"0123456789abcdef","ingest_max_bytes":200}"#,
        )
        .unwrap()
    }

    /// The scheme's name in any case (RFC 9110 §11.1), the token exact; another scheme, no
    /// token, or the token alone is refused.
    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        let c = cfg();
        for (auth, ok) in [
            ("Bearer 0123456789abcdef", true),
            ("bearer 0123456789abcdef", true),
            ("BEARER 0123456789abcdef", true),
            (" Bearer  0123456789abcdef ", true),
            ("Bearer 0123456789ABCDEF", false),
            ("Basic 0123456789abcdef", false),
            ("Bearer0123456789abcdef", false),
            ("Bearer", false),
            ("Bearer ", false),
            ("0123456789abcdef", false),
            ("Bearerx 0123456789abcdef", false),
        ] {
            assert_eq!(authorized(&c, Some(auth)), ok, "{auth:?}");
        }
        assert!(!authorized(&c, None));
    }

    #[test]
    fn header_checks() {
        let c = cfg();
        let auth = Some("Bearer 0123456789abcdef");
        let p = Some("/kvroute/v1/snapshot");
        assert_eq!(
            check_headers(&c, Some("POST"), p, auth, Some("10"), None),
            None
        );
        assert_eq!(
            check_headers(&c, Some("POST"), Some("/x"), auth, None, None)
                .unwrap()
                .status,
            404
        );
        assert_eq!(
            check_headers(&c, Some("GET"), p, auth, None, None)
                .unwrap()
                .status,
            405
        );
        let r = check_headers(&c, Some("POST"), p, None, None, None).unwrap();
        assert_eq!(r, reply::ingest_unauthorized());
        assert_eq!(r.status, 401);
        assert_eq!(r.code().as_deref(), Some("invalid_ingest_token"));
        assert_eq!(
            check_headers(&c, Some("POST"), p, Some("Bearer wrong"), None, None)
                .unwrap()
                .status,
            401
        );
        assert_eq!(
            check_headers(&c, Some("POST"), p, Some("0123456789abcdef"), None, None)
                .unwrap()
                .status,
            401
        );
        let r = check_headers(&c, Some("POST"), p, auth, Some("201"), None).unwrap();
        assert_eq!(r.status, 413);
        assert_eq!(
            r.body,
            r#"{"error":{"code":"request_too_large","message":"Snapshot larger than ingest_max_bytes (200 bytes).","param":null,"type":"invalid_request_error"}}"#
        );
        // A compressed body is refused by name; empty and `identity` are no encoding.
        let r = check_headers(&c, Some("POST"), p, auth, None, Some(b" gzip ")).unwrap();
        assert_eq!(r.status, 415);
        assert_eq!(
            r.body,
            r#"{"error":{"code":"unsupported_encoding","message":"Snapshot sent with content-encoding `gzip`; the ingest listener takes it uncompressed.","param":null,"type":"invalid_request_error"}}"#
        );
        for none in [b"".as_slice(), b"identity", b" Identity "] {
            assert_eq!(
                check_headers(&c, Some("POST"), p, auth, None, Some(none)),
                None
            );
        }
    }

    #[test]
    fn body_checks() {
        let c = cfg();
        assert_eq!(
            check_body(&c, &Snapshot::new(1, 0, vec![]).encode()),
            Ok(())
        );
        let r = check_body(
            &c,
            b"{\"format\":9,\"version\":1,\"generated_at_ms\":0,\"endpoints\":[]}",
        )
        .unwrap_err();
        assert_eq!(r.status, 400);
        assert_eq!(
            r.body,
            r#"{"error":{"code":"invalid_snapshot","message":"Invalid snapshot: unsupported snapshot format 9 (this build reads 1)","param":null,"type":"invalid_request_error"}}"#
        );
        assert_eq!(check_body(&c, &[b' '; 201]).unwrap_err().status, 413);
    }
}
