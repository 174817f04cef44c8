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
//! - `400` (`invalid_snapshot`) — not a valid snapshot (the message says why);
//! - `404` (`not_found`) / `405` (`method_not_allowed`) — other paths or methods;
//! - `503` (`queue_unavailable`) — the shared queue could not be resolved.

use crate::config::Config;
use crate::reply::{self, LocalReply};
use subtle::ConstantTimeEq;

/// A local reply (see [`crate::reply`]).
pub type Reply = LocalReply;

/// Token check: `Authorization: Bearer <token>`, constant time in the token's content.
pub fn authorized(config: &Config, authorization: Option<&str>) -> bool {
    let Some(given) = authorization.and_then(|a| a.strip_prefix("Bearer ")) else {
        return false;
    };
    let want = config.ingest_token.as_bytes();
    !want.is_empty() && bool::from(given.trim().as_bytes().ct_eq(want))
}

/// Header-time checks. `Some(reply)` answers now; `None` means "read the body".
pub fn check_headers(
    config: &Config,
    method: Option<&str>,
    path: Option<&str>,
    authorization: Option<&str>,
    content_length: Option<&str>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::snapshot::Snapshot;

    fn cfg() -> Config {
        Config::parse(
            br#"{"role":"ingest","ingest_token":"0123456789abcdef","ingest_max_bytes":200}"#,
        )
        .unwrap()
    }

    #[test]
    fn header_checks() {
        let c = cfg();
        let auth = Some("Bearer 0123456789abcdef");
        let p = Some("/kvroute/v1/snapshot");
        assert_eq!(check_headers(&c, Some("POST"), p, auth, Some("10")), None);
        assert_eq!(
            check_headers(&c, Some("POST"), Some("/x"), auth, None)
                .unwrap()
                .status,
            404
        );
        assert_eq!(
            check_headers(&c, Some("GET"), p, auth, None)
                .unwrap()
                .status,
            405
        );
        let r = check_headers(&c, Some("POST"), p, None, None).unwrap();
        assert_eq!(r, reply::ingest_unauthorized());
        assert_eq!(r.status, 401);
        assert_eq!(r.code().as_deref(), Some("invalid_ingest_token"));
        assert_eq!(
            check_headers(&c, Some("POST"), p, Some("Bearer wrong"), None)
                .unwrap()
                .status,
            401
        );
        assert_eq!(
            check_headers(&c, Some("POST"), p, Some("0123456789abcdef"), None)
                .unwrap()
                .status,
            401
        );
        let r = check_headers(&c, Some("POST"), p, auth, Some("201")).unwrap();
        assert_eq!(r.status, 413);
        assert_eq!(
            r.body,
            r#"{"error":{"code":"request_too_large","message":"Snapshot larger than ingest_max_bytes (200 bytes).","param":null,"type":"invalid_request_error"}}"#
        );
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
