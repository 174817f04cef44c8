//! Models served by a pod, from its OpenAI-compatible `GET /v1/models`
//! (`{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct",...}]}`; vLLM, SGLang,
//! TGI and llama-server all answer it: <https://platform.openai.com/docs/api-reference/models/list>).
//!
//! vLLM lists LoRA adapters in the same list with `"parent"` set to the base model
//! (vLLM `vllm/entrypoints/openai/serving_models.py`); those are not base models and are
//! skipped here (the scrape reports loaded adapters separately).

use crate::scrape::ScrapeClient;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use kvroute_core::snapshot::check_label;
use serde::Deserialize;
use std::time::Duration;

/// Largest `/v1/models` body read (1 MiB).
pub const MAX_BODY: usize = 1 << 20;

/// Why the model list could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelsError {
    /// No answer in time.
    #[error("timed out")]
    Timeout,
    /// Transport failure.
    #[error("request failed: {0}")]
    Connect(String),
    /// Not 200.
    #[error("HTTP status {0}")]
    Status(u16),
    /// Not the OpenAI list shape, too large, or no usable id.
    #[error("bad /v1/models body: {0}")]
    Body(String),
}

#[derive(Deserialize)]
struct List {
    data: Vec<Model>,
}

#[derive(Deserialize)]
struct Model {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// Parse a `/v1/models` body into base model ids, in listed order, without duplicates.
/// Ids with control characters or longer than kvroute-core's `MAX_LABEL_BYTES` are
/// skipped (`check_label`: they would make the snapshot invalid).
pub fn parse(body: &[u8]) -> Result<Vec<String>, ModelsError> {
    let list: List = serde_json::from_slice(body).map_err(|e| ModelsError::Body(e.to_string()))?;
    let mut out: Vec<String> = Vec::new();
    for m in list.data {
        if m.parent.is_some() || m.id.is_empty() || check_label(&m.id).is_err() {
            continue;
        }
        if !out.contains(&m.id) {
            out.push(m.id);
        }
    }
    if out.is_empty() {
        return Err(ModelsError::Body("no base model listed".into()));
    }
    Ok(out)
}

/// GET `<base>/v1/models` within `timeout`; with `token` (the scrape token,
/// `scrape.token_file` / `scrape.token_env`) the request carries `Authorization: Bearer`,
/// as the scrapes do: llama-server started with `--api-key` answers this path 401 without it.
pub async fn fetch(
    client: &ScrapeClient,
    base: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<Vec<String>, ModelsError> {
    let url: http::Uri = format!("{base}/v1/models")
        .parse()
        .map_err(|e: http::uri::InvalidUri| ModelsError::Connect(e.to_string()))?;
    let mut req = http::Request::get(url).header(http::header::ACCEPT, "application/json");
    if let Some(t) = token {
        req = req.header(http::header::AUTHORIZATION, crate::token::bearer(t));
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|e| ModelsError::Connect(e.to_string()))?;
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| ModelsError::Connect(e.to_string()))?;
        if resp.status() != http::StatusCode::OK {
            return Err(ModelsError::Status(resp.status().as_u16()));
        }
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| ModelsError::Body(e.to_string()))?
            .to_bytes();
        parse(&body)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(ModelsError::Timeout))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn base_models_only() {
        // Shape of vLLM 0.10 `GET /v1/models` with one LoRA adapter loaded.
        let body = br#"{"object":"list","data":[
          {"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","created":1764500000,"owned_by":"vllm","root":"meta-llama/Llama-3.1-8B-Instruct","parent":null,"max_model_len":8192},
          {"id":"sql-lora","object":"model","created":1764500000,"owned_by":"vllm","root":"/adapters/sql","parent":"meta-llama/Llama-3.1-8B-Instruct"},
          {"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model"}]}"#;
        assert_eq!(
            parse(body).unwrap(),
            vec!["meta-llama/Llama-3.1-8B-Instruct"]
        );
    }

    #[test]
    fn bad_bodies() {
        assert_eq!(
            parse(br#"{"data":[]}"#).unwrap_err().to_string(),
            "bad /v1/models body: no base model listed"
        );
        assert!(parse(b"<html>").is_err());
        assert!(parse(br#"{"data":[{"id":"a\nb"}]}"#).is_err());
        // A name over MAX_LABEL_BYTES is skipped; one at the bound is kept.
        let at = "m".repeat(kvroute_core::snapshot::MAX_LABEL_BYTES);
        let body = format!(r#"{{"data":[{{"id":"{at}x"}},{{"id":"{at}"}}]}}"#);
        assert_eq!(parse(body.as_bytes()).unwrap(), vec![at]);
    }
}
