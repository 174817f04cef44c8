//! Every reply the filter makes itself, in OpenAI's shapes.
//!
//! Errors use OpenAI's error object (<https://platform.openai.com/docs/guides/error-codes>,
//! the `error` member of the API's error responses), which vLLM's OpenAI server also returns:
//! `{"error":{"message":"…","type":"…","param":null,"code":"…"}}`. OpenAI clients read
//! `message` and branch on the status; `code` is a stable machine-readable reason.
//! [`error`] is the one function that builds them; the rest of this module names each
//! reply the filter can send:
//!
//! | status | `type` | `code` | when |
//! |---|---|---|---|
//! | 400 | `invalid_request_error` | `invalid_snapshot` | ingest: the body is not a valid snapshot |
//! | 401 | `authentication_error` | `invalid_ingest_token` | ingest: missing or wrong token |
//! | 404 | `invalid_request_error` | `model_not_found` | no endpoint in the snapshot lists the model (base model or LoRA adapter), nor does its `unavailable_models` |
//! | 404 | `invalid_request_error` | `not_found` | ingest: another path |
//! | 405 | `invalid_request_error` | `method_not_allowed` | ingest: not `POST` |
//! | 413 | `invalid_request_error` | `request_too_large` | ingest: body over `ingest_max_bytes` |
//! | 429 | `rate_limit_error` | `saturated` | every endpoint serving the model is out of KV headroom (after the admission queue, when on); `retry-after` |
//! | 503 | `server_error` | `no_healthy_endpoint` | the model is known but no endpoint serving it is healthy, or its pool has no endpoint at all (the snapshot's `unavailable_models`); `retry-after` |
//! | 503 | `server_error` | `cluster_not_found` | cluster mode: the cluster kvroute-cp named for the endpoint does not exist in this Envoy (replaces Envoy's empty 503) |
//! | 503 | `server_error` | `router_unavailable` | the filter cannot decide and `fail_open` is off; `retry-after` |
//! | 503 | `server_error` | `queue_unavailable` | ingest: the shared queue is missing |
//!
//! A 404 is not retried by OpenAI clients (the SDKs retry 408, 409, 429 and 5xx), so an
//! unknown model fails at once instead of after the client's retries.
//!
//! `GET /v1/models` is answered from the snapshot in OpenAI's list shape
//! (<https://platform.openai.com/docs/api-reference/models/list>): one entry per base model
//! and per LoRA adapter any endpoint lists, healthy or not, and per model of the snapshot's
//! `unavailable_models` (a configured pool serves it but has no endpoint now), sorted by id.
//! The list is the set of names that get 503 rather than 404 when nothing can take them: a
//! model that exists but is not available right now is listed, as an unhealthy one is. The
//! body is built once per snapshot version ([`ModelCatalog`]).

use crate::host::Host;
use kvroute_core::snapshot::Snapshot;
use std::collections::{BTreeMap, BTreeSet};

/// A reply to send instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status.
    pub status: u32,
    /// `retry-after`, seconds, when the client should try again later.
    pub retry_after_s: Option<u32>,
    /// JSON body (empty for 204).
    pub body: String,
}

impl LocalReply {
    /// Send it (`content-type: application/json` when there is a body).
    pub fn send<H: Host>(&self, host: &H) {
        let ra = self.retry_after_s.map(|s| s.to_string());
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2);
        if !self.body.is_empty() {
            headers.push(("content-type", "application/json"));
        }
        if let Some(ra) = &ra {
            headers.push(("retry-after", ra));
        }
        host.send_local_reply(self.status, &headers, self.body.as_bytes());
    }

    /// The `code` of an error body (for logs and tests); `None` for other bodies.
    pub fn code(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(&self.body).ok()?;
        v.get("error")?.get("code")?.as_str().map(str::to_owned)
    }
}

/// The one builder of error replies: OpenAI's error object with `status`.
///
/// `kind` is the error `type`, `code` the machine-readable reason, `param` the request
/// field at fault (if any), `retry_after_s` sets `retry-after`.
pub fn error(
    status: u32,
    kind: &str,
    code: &str,
    message: &str,
    param: Option<&str>,
    retry_after_s: Option<u32>,
) -> LocalReply {
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code,
        }
    })
    .to_string();
    LocalReply {
        status,
        retry_after_s,
        body,
    }
}

const INVALID: &str = "invalid_request_error";
const SERVER: &str = "server_error";

use kvroute_core::echo::echo;

/// 404: no endpoint lists `model`.
pub fn model_not_found(model: &str) -> LocalReply {
    error(
        404,
        INVALID,
        "model_not_found",
        &format!("The model `{}` does not exist: no endpoint behind this gateway serves it (GET /v1/models lists those that do).", echo(model)),
        Some("model"),
        None,
    )
}

/// 503: `model` is served, but by no healthy endpoint right now.
pub fn no_healthy_endpoint(model: Option<&str>, retry_after_s: u32) -> LocalReply {
    let what = model.map_or_else(
        || "this request".to_owned(),
        |m| format!("model `{}`", echo(m)),
    );
    error(
        503,
        SERVER,
        "no_healthy_endpoint",
        &format!("No healthy endpoint serves {what} right now; retry later."),
        None,
        Some(retry_after_s),
    )
}

/// 429: every endpoint serving the request is out of KV-cache headroom.
pub fn saturated(retry_after_s: u32) -> LocalReply {
    error(
        429,
        "rate_limit_error",
        "saturated",
        "Every endpoint serving this model is out of KV-cache capacity; retry later.",
        None,
        Some(retry_after_s),
    )
}

/// 503: the filter could not decide and `fail_open` is off.
pub fn router_unavailable(retry_after_s: u32) -> LocalReply {
    error(
        503,
        SERVER,
        "router_unavailable",
        "kvroute has no usable endpoint stats yet (no snapshot from kvroute-cp) and fail_open is off; retry later.",
        None,
        Some(retry_after_s),
    )
}

/// 503: cluster mode sent the request to `cluster`, which this Envoy does not have.
pub fn cluster_not_found(cluster: &str) -> LocalReply {
    error(
        503,
        SERVER,
        "cluster_not_found",
        &format!("kvroute routed this request to Envoy cluster `{}`, which this Envoy does not have: check pools[].endpoints[].cluster in kvroute-cp's config (it defaults to the pool's name) against the Envoy clusters.", echo(cluster)),
        None,
        None,
    )
}

/// Ingest 401.
pub fn ingest_unauthorized() -> LocalReply {
    error(
        401,
        "authentication_error",
        "invalid_ingest_token",
        "Missing or wrong ingest token (Authorization: Bearer <ingest_token>).",
        None,
        None,
    )
}

/// Ingest 413: body over `max_bytes`.
pub fn ingest_too_large(max_bytes: usize) -> LocalReply {
    error(
        413,
        INVALID,
        "request_too_large",
        &format!("Snapshot larger than ingest_max_bytes ({max_bytes} bytes)."),
        None,
        None,
    )
}

/// Ingest 400: not a valid snapshot (`detail` says why).
pub fn ingest_invalid(detail: &str) -> LocalReply {
    error(
        400,
        INVALID,
        "invalid_snapshot",
        &format!("Invalid snapshot: {detail}"),
        None,
        None,
    )
}

/// Ingest 415: the snapshot came with a `content-encoding` (`encoding`) other than
/// identity; kvroute-cp sends it plain.
pub fn ingest_encoded(encoding: &str) -> LocalReply {
    error(
        415,
        INVALID,
        "unsupported_encoding",
        &format!(
            "Snapshot sent with content-encoding `{}`; the ingest listener takes it uncompressed.",
            echo(encoding)
        ),
        None,
        None,
    )
}

/// Ingest 404: another path.
pub fn ingest_not_found(path: &str) -> LocalReply {
    error(
        404,
        INVALID,
        "not_found",
        &format!("No ingest route at `{}`.", echo(path)),
        None,
        None,
    )
}

/// Ingest 405: not POST.
pub fn ingest_method_not_allowed() -> LocalReply {
    error(
        405,
        INVALID,
        "method_not_allowed",
        "The ingest route takes POST only.",
        None,
        None,
    )
}

/// Ingest 503: the shared queue is missing.
pub fn ingest_queue_unavailable() -> LocalReply {
    error(
        503,
        SERVER,
        "queue_unavailable",
        "The filter's shared queue is not available; retry later.",
        None,
        None,
    )
}

/// The models a snapshot serves, and the `GET /v1/models` body, built once per version.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelCatalog {
    /// Served ids (base models and LoRA adapters) → the model object OpenAI's API gives
    /// for it (JSON text: `id`, `object`, `created`, `owned_by`, and `parent`, the base
    /// model an adapter runs on when it runs on one only), the `GET /v1/models/{id}` body.
    models: BTreeMap<String, String>,
    /// `GET /v1/models` body.
    pub list_body: String,
}

impl ModelCatalog {
    /// From every endpoint of `snap`, healthy or not, and its `unavailable_models`.
    pub fn from_snapshot(snap: &Snapshot) -> Self {
        let mut models: BTreeMap<String, Option<String>> = BTreeMap::new();
        let mut bases: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
        for e in &snap.endpoints {
            for m in &e.models {
                models.insert(m.clone(), None);
            }
            for a in &e.lora_adapters {
                let b = bases.entry(a.clone()).or_default();
                b.extend(e.models.iter().map(String::as_str));
            }
        }
        for (a, b) in bases {
            let parent = match (b.len(), b.first()) {
                (1, Some(p)) => Some((*p).to_owned()),
                _ => None,
            };
            models.entry(a).or_insert(parent);
        }
        for m in &snap.unavailable_models {
            models.entry(m.clone()).or_insert(None);
        }
        let created = snap.generated_at_ms / 1000;
        let models: BTreeMap<String, String> = models
            .into_iter()
            .map(|(id, parent)| {
                let mut m = serde_json::json!({
                    "id": id,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvroute",
                });
                if let (Some(p), Some(obj)) = (parent, m.as_object_mut()) {
                    obj.insert("parent".into(), serde_json::Value::String(p));
                }
                (id, m.to_string())
            })
            .collect();
        let data: Vec<&str> = models.values().map(String::as_str).collect();
        // serde_json writes an object's keys sorted: `data` before `object`.
        let list_body = format!(r#"{{"data":[{}],"object":"list"}}"#, data.join(","));
        Self { models, list_body }
    }

    /// Whether any endpoint lists `model` (base model or LoRA adapter), or the snapshot's
    /// `unavailable_models` does.
    pub fn serves(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// The `GET /v1/models` reply.
    pub fn list_reply(&self) -> LocalReply {
        LocalReply {
            status: 200,
            retry_after_s: None,
            body: self.list_body.clone(),
        }
    }

    /// The `GET /v1/models/{id}` reply: 200 with the model object when a snapshot
    /// endpoint or `unavailable_models` lists `id`, else 404 `model_not_found`.
    pub fn retrieve_reply(&self, id: &str) -> LocalReply {
        match self.models.get(id) {
            Some(object) => LocalReply {
                status: 200,
                retry_after_s: None,
                body: object.clone(),
            },
            None => model_not_found(id),
        }
    }

    /// The reply to `request`.
    pub fn reply(&self, request: &ModelsRequest<'_>) -> LocalReply {
        match request {
            ModelsRequest::List => self.list_reply(),
            ModelsRequest::Retrieve(id) => self.retrieve_reply(id),
        }
    }
}

/// A request for OpenAI's models API, which the filter answers from the snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelsRequest<'a> {
    /// `GET /v1/models`: the list.
    List,
    /// `GET /v1/models/{id}`: one model; `id` percent-decoded (model ids hold `/`, sent
    /// as is or as `%2F`), invalid UTF-8 replaced.
    Retrieve(std::borrow::Cow<'a, str>),
}

/// The models-API request `method` and `path` make, if any (query string and a trailing
/// `/` ignored): `GET /v1/models` or `GET /v1/models/{id}`.
pub fn models_request<'a>(method: Option<&str>, path: &'a str) -> Option<ModelsRequest<'a>> {
    if method != Some("GET") {
        return None;
    }
    let p = path.split('?').next().unwrap_or(path).trim_end_matches('/');
    if p == "/v1/models" {
        return Some(ModelsRequest::List);
    }
    let id = p.strip_prefix("/v1/models/").filter(|id| !id.is_empty())?;
    Some(ModelsRequest::Retrieve(
        percent_encoding::percent_decode_str(id).decode_utf8_lossy(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::snapshot::EndpointStats;

    fn ep(id: &str, models: &[&str], lora: &[&str], healthy: bool) -> EndpointStats {
        EndpointStats {
            id: id.into(),
            address: "127.0.0.1:1".into(),
            cluster: "c".into(),
            pool: "p".into(),
            models: models.iter().map(|s| (*s).to_owned()).collect(),
            lora_adapters: lora.iter().map(|s| (*s).to_owned()).collect(),
            kv_usage: Some(0.1),
            kv_capacity_tokens: None,
            block_size: None,
            running: 0,
            waiting: 0,
            healthy,
            scraped_at_ms: 1,
            process_start_ms: None,
            peer_inflight_requests: 0,
            peer_inflight_tokens: 0,
        }
    }

    /// A reply quotes at most [`kvroute_core::echo::ECHO_MAX_BYTES`] of a name (a 100 KB
    /// model name came back whole in a 100 KB 404); an invalid snapshot's reply keeps its
    /// reason when the id it quotes is long.
    #[test]
    fn long_names_are_cut_in_replies() {
        let long = "m".repeat(100_000);
        let r = model_not_found(&long);
        assert!(r.body.len() < 600, "{} bytes", r.body.len());
        assert!(r.body.contains("(100000 bytes in all)"), "{}", r.body);
        let bad = kvroute_core::snapshot::SnapshotError::InvalidEndpoint {
            index: 3,
            id: kvroute_core::echo::echo(&"e".repeat(1100)).into_owned(),
            field: "id",
            reason: "is longer than 1024 bytes",
        };
        let r = ingest_invalid(&bad.to_string());
        assert!(r.body.len() < 800, "{} bytes", r.body.len());
        assert!(
            r.body
                .contains("(1100 bytes in all)`): field `id` is longer than 1024 bytes"),
            "{}",
            r.body
        );
        // A decode error quoting a 30 KB value from the body: bounded where it is made
        // (`Snapshot::decode`), so the reply stays short and says how long it was.
        let body = format!(r#"{{"version":"{}"}}"#, "东".repeat(10_000));
        let whole = serde_json::from_str::<kvroute_core::snapshot::Snapshot>(&body)
            .unwrap_err()
            .to_string();
        let e = kvroute_core::snapshot::Snapshot::decode(body.as_bytes()).unwrap_err();
        let r = ingest_invalid(&e.to_string());
        assert!(r.body.len() < 2300, "{} bytes", r.body.len());
        assert!(
            r.body.contains(&format!("({} bytes in all)", whole.len())),
            "{}",
            r.body
        );
    }

    #[test]
    fn error_object_has_openai_shape() {
        let r = model_not_found("gpt-x");
        assert_eq!(r.status, 404);
        assert_eq!(r.retry_after_s, None);
        assert_eq!(
            r.body,
            r#"{"error":{"code":"model_not_found","message":"The model `gpt-x` does not exist: no endpoint behind this gateway serves it (GET /v1/models lists those that do).","param":"model","type":"invalid_request_error"}}"#
        );
        let r = saturated(3);
        assert_eq!((r.status, r.retry_after_s), (429, Some(3)));
        assert_eq!(r.code().as_deref(), Some("saturated"));
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert_eq!(v["error"]["type"], "rate_limit_error");
        let r = no_healthy_endpoint(Some("m"), 2);
        assert_eq!((r.status, r.retry_after_s), (503, Some(2)));
        assert_eq!(
            cluster_not_found("vllm-a").code().as_deref(),
            Some("cluster_not_found")
        );
        assert!(cluster_not_found("vllm-a").body.contains("`vllm-a`"));
    }

    #[test]
    fn send_sets_content_type_and_retry_after() {
        let h = crate::host::mock::MockHost::new(0);
        saturated(5).send(&h);
        let rep = h.replies();
        assert_eq!(rep.len(), 1);
        assert_eq!(rep[0].status, 429);
        assert_eq!(
            rep[0].headers,
            vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("retry-after".to_owned(), "5".to_owned())
            ]
        );
    }

    #[test]
    fn catalog_lists_base_models_and_adapters_once() {
        let snap = Snapshot::new(
            7,
            1_700_000_123_456,
            vec![
                ep("p/a", &["llama"], &["sql-lora"], true),
                ep("p/b", &["llama"], &["sql-lora", "chat-lora"], false),
                ep("q/c", &["qwen"], &["shared"], true),
                ep("q/d", &["llama"], &["shared"], true),
            ],
        );
        let c = ModelCatalog::from_snapshot(&snap);
        assert!(c.serves("llama") && c.serves("chat-lora") && c.serves("shared"));
        assert!(!c.serves("mistral"));
        assert_eq!(
            c.list_body,
            concat!(
                r#"{"data":["#,
                r#"{"created":1700000123,"id":"chat-lora","object":"model","owned_by":"kvroute","parent":"llama"},"#,
                r#"{"created":1700000123,"id":"llama","object":"model","owned_by":"kvroute"},"#,
                r#"{"created":1700000123,"id":"qwen","object":"model","owned_by":"kvroute"},"#,
                r#"{"created":1700000123,"id":"shared","object":"model","owned_by":"kvroute"},"#,
                r#"{"created":1700000123,"id":"sql-lora","object":"model","owned_by":"kvroute","parent":"llama"}"#,
                r#"],"object":"list"}"#
            )
        );
        assert_eq!(c.list_reply().status, 200);
        let one = c.retrieve_reply("sql-lora");
        assert_eq!(
            (one.status, one.body.as_str()),
            (
                200,
                r#"{"created":1700000123,"id":"sql-lora","object":"model","owned_by":"kvroute","parent":"llama"}"#
            )
        );
        let none = c.retrieve_reply("mistral");
        assert_eq!(
            (none.status, none.body),
            (404, model_not_found("mistral").body)
        );
    }

    /// A model of a pool without endpoints is listed (it exists, it is just not available
    /// now); a name also listed as an adapter keeps its `parent`.
    #[test]
    fn catalog_lists_unavailable_models() {
        let mut snap = Snapshot::new(1, 2_000, vec![ep("p/a", &["llama"], &["sql-lora"], true)]);
        snap.unavailable_models = vec!["qwen".into(), "sql-lora".into()];
        let c = ModelCatalog::from_snapshot(&snap);
        assert!(c.serves("qwen"));
        assert_eq!(
            c.list_body,
            concat!(
                r#"{"data":["#,
                r#"{"created":2,"id":"llama","object":"model","owned_by":"kvroute"},"#,
                r#"{"created":2,"id":"qwen","object":"model","owned_by":"kvroute"},"#,
                r#"{"created":2,"id":"sql-lora","object":"model","owned_by":"kvroute","parent":"llama"}"#,
                r#"],"object":"list"}"#
            )
        );
        // No endpoint at all.
        let mut snap = Snapshot::new(2, 2_000, vec![]);
        snap.unavailable_models = vec!["qwen".into()];
        assert_eq!(
            ModelCatalog::from_snapshot(&snap).list_body,
            r#"{"data":[{"created":2,"id":"qwen","object":"model","owned_by":"kvroute"}],"object":"list"}"#
        );
    }

    #[test]
    fn models_api_requests() {
        let list = Some(ModelsRequest::List);
        let one = |id: &str| Some(ModelsRequest::Retrieve(id.to_owned().into()));
        assert_eq!(models_request(Some("GET"), "/v1/models"), list);
        assert_eq!(models_request(Some("GET"), "/v1/models/?x=1"), list);
        assert_eq!(models_request(Some("POST"), "/v1/models"), None);
        assert_eq!(
            models_request(Some("GET"), "/v1/models/llama"),
            one("llama")
        );
        assert_eq!(
            models_request(Some("GET"), "/v1/models/meta-llama/Llama-3.1-8B?x"),
            one("meta-llama/Llama-3.1-8B")
        );
        assert_eq!(
            models_request(Some("GET"), "/v1/models/meta-llama%2FLlama%20x%ff"),
            one("meta-llama/Llama x\u{fffd}")
        );
        assert_eq!(models_request(Some("GET"), "/v1/modelsx"), None);
        assert_eq!(models_request(Some("GET"), "/v1/chat/completions"), None);
        assert_eq!(models_request(None, "/v1/models"), None);
    }
}
