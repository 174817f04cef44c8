//! The snapshot ingest route (plugin role `ingest`).
//!
//! Contract (the control plane implements the client side):
//! `POST <ingest_path>` (default `/kvroute/v1/snapshot`) with
//! `Authorization: Bearer <ingest_token>` and a `kvroute_core::snapshot::Snapshot` JSON body.
//! Answers, always locally (nothing is forwarded upstream):
//! - `204` — valid; enqueued on the shared queue for the root-context consumer;
//! - `401 {"error":"unauthorized"}` — missing or wrong token (constant-time comparison);
//! - `413 {"error":"too_large","max_bytes":N}` — body over `ingest_max_bytes`;
//! - `400 {"error":"invalid_snapshot","detail":"..."}` — not a valid snapshot;
//! - `404` / `405` JSON — other paths or methods;
//! - `503 {"error":"queue_unavailable"}` — the shared queue could not be resolved.

use crate::config::Config;
use subtle::ConstantTimeEq;

/// A local reply: status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u32,
    /// JSON body (empty for 204).
    pub body: String,
}

fn json(status: u32, error: &str, extra: Option<(&str, serde_json::Value)>) -> Reply {
    let mut m = serde_json::Map::new();
    m.insert("error".into(), serde_json::Value::String(error.into()));
    if let Some((k, v)) = extra {
        m.insert(k.into(), v);
    }
    Reply {
        status,
        body: serde_json::Value::Object(m).to_string(),
    }
}

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
        return Some(json(404, "not_found", None));
    }
    if method != Some("POST") {
        return Some(json(405, "method_not_allowed", None));
    }
    if !authorized(config, authorization) {
        return Some(json(401, "unauthorized", None));
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
    json(
        413,
        "too_large",
        Some((
            "max_bytes",
            serde_json::Value::from(config.ingest_max_bytes),
        )),
    )
}

/// Body-time check: `Ok(())` when the body is a valid snapshot within limits.
pub fn check_body(config: &Config, body: &[u8]) -> Result<(), Reply> {
    if body.len() > config.ingest_max_bytes {
        return Err(too_large(config));
    }
    kvroute_core::snapshot::Snapshot::decode(body)
        .map(|_| ())
        .map_err(|e| {
            json(
                400,
                "invalid_snapshot",
                Some(("detail", serde_json::Value::String(e.to_string()))),
            )
        })
}

/// 204 after enqueueing.
pub fn accepted() -> Reply {
    Reply {
        status: 204,
        body: String::new(),
    }
}

/// 503 when the queue is unavailable.
pub fn queue_unavailable() -> Reply {
    json(503, "queue_unavailable", None)
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
        assert_eq!(
            r,
            Reply {
                status: 401,
                body: r#"{"error":"unauthorized"}"#.into()
            }
        );
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
        assert_eq!(
            r,
            Reply {
                status: 413,
                body: r#"{"error":"too_large","max_bytes":200}"#.into()
            }
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
            r#"{"detail":"unsupported snapshot format 9 (this build reads 1)","error":"invalid_snapshot"}"#
        );
        assert_eq!(check_body(&c, &[b' '; 201]).unwrap_err().status, 413);
    }
}
