//! Reading each gateway's in-flight load from its Envoy stats, so N gateways do not herd
//! onto one endpoint between scrapes (the merge itself is kvroute-core's
//! [`kvroute_core::peer`]).
//!
//! Every push target with a `stats_url` (static `targets[].stats_url`, or
//! `kubernetes.gateways[].stats_port`/`stats_path` for discovered pods) is read every
//! `push.peer_load.interval_ms` by a task that lives as long as the target's push task. The
//! body is Envoy's Prometheus text (`/stats/prometheus`, on the admin port or Istio's 15090
//! listener), where the filter's per-endpoint gauges read
//! `kvroute_inflight_unseen_requests_<endpoint>` and `kvroute_inflight_unseen_tokens_<endpoint>`
//! (`filter/src/names.rs`); the native build (`kvroute-dynmod`) writes them as one gauge each
//! with the endpoint in a label,
//! `envoy_dynamicmodulescustom_kvroute_inflight_unseen_requests{endpoint="…"}` ([`REQUESTS_NAME`]). Envoy's Prometheus output replaces every character of a stat
//! name outside `[a-zA-Z0-9_]` with `_` (`wasmcustom.kvroute.inflight_unseen.requests.pool/e-0`
//! becomes `kvroute_inflight_unseen_requests_pool_e_0`), so the endpoint is found by
//! sanitising the ids of the current fleet the same way ([`sanitize`]). Two ids that read the
//! same once sanitised (`pool/a-b`, `pool/a_b`) are ambiguous: their gauges are ignored and
//! the ambiguity is logged once per read.
//!
//! Outcomes (each counted in `kvroute_cp_gateway_stats_errors_total{target,reason}`, logged
//! at `warn` at most once per [`crate::scrape::WARN_EVERY`] per target, never fatal):
//! - no answer, a refused connection, a non-2xx status: `reason="connect"|"timeout"|"status"`;
//!   the gateway's last reading stays until `push.peer_load.stale_after_ms`, then it
//!   contributes nothing;
//! - a body that is not a Prometheus exposition (HTML, JSON, garbage): `reason="parse"`, the
//!   reading is not replaced;
//! - a kvroute gauge with a value that is negative, not finite or beyond `u32::MAX` requests:
//!   that sample is skipped (`reason="value"`), the rest of the reading is used;
//! - a gauge naming an endpoint not in the fleet (it left): ignored silently.

use crate::config::{PeerLoadSettings, Target};
use crate::expo::Exposition;
use crate::hub::{now_ms, Hub};
use crate::push::PushClient;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_core::peer::{GatewayReport, PeerLoad};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::watch;

/// Prometheus name prefix of the per-endpoint in-flight request gauges (the filter's
/// `kvroute.inflight_unseen.requests.` after Envoy's sanitising).
pub const REQUESTS_PREFIX: &str = "kvroute_inflight_unseen_requests_";
/// Prometheus name prefix of the per-endpoint reserved-token gauges.
pub const TOKENS_PREFIX: &str = "kvroute_inflight_unseen_tokens_";
/// The same gauges from the native build (`kvroute-dynmod`, docs/dynamic-module.md): one
/// gauge per prefix, the endpoint in label [`ENDPOINT_LABEL`] (Envoy's dynamic-module ABI
/// defines metrics at config time only, before any endpoint is known), under Envoy's
/// dynamic-module namespace [`NATIVE_NAMESPACE`], which Envoy 1.40 keeps in the Prometheus
/// name: `envoy_dynamicmodulescustom_kvroute_inflight_unseen_requests{endpoint="pool/e-0"}`
/// (checked by `integration/tests/cp_herd.rs`). Read with or without the namespace.
pub const REQUESTS_NAME: &str = "kvroute_inflight_unseen_requests";
/// Prefix of the native build's stats in Envoy's Prometheus output.
pub const NATIVE_NAMESPACE: &str = "envoy_dynamicmodulescustom_";
/// Reserved tokens, labelled form ([`REQUESTS_NAME`]).
pub const TOKENS_NAME: &str = "kvroute_inflight_unseen_tokens";
// The endpoint's label in the labelled form: the filter's stat id of the endpoint
// (`filter/src/names.rs` `stat_id`), matched after `sanitize` like a name's suffix.
use kvroute_core::peer::ENDPOINT_LABEL;

/// Largest stats body read, bytes (an Envoy with many clusters exports a few MB).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// An endpoint id as Envoy's `/stats/prometheus` writes it inside a stat name: every byte
/// outside `[a-zA-Z0-9_]` becomes `_` (Envoy's `PrometheusStatsFormatter::sanitizeName`;
/// checked against Envoy 1.40 by `integration/tests/cp_herd.rs`).
pub fn sanitize(id: &str) -> String {
    id.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' {
                b as char
            } else {
                '_'
            }
        })
        .collect()
}

/// Why a stats reading was not used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StatsError {
    /// Not a Prometheus exposition.
    #[error("not a Prometheus exposition: {0}")]
    Parse(#[from] crate::expo::ExpoError),
}

/// A parsed reading: the load by endpoint id, and what was skipped.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// Load by endpoint id (only endpoints with a gauge above zero).
    pub load: BTreeMap<String, PeerLoad>,
    /// Samples skipped for a bad value (negative, NaN, infinite, too large).
    pub bad_values: usize,
    /// Sanitised names that more than one fleet id maps to (their gauges are ignored).
    pub ambiguous: Vec<String>,
}

/// Read the per-endpoint in-flight gauges out of an Envoy `/stats/prometheus` body, for the
/// fleet ids `ids`. Errors only when the body is not an exposition at all.
pub fn parse(body: &[u8], ids: &[String]) -> Result<Parsed, StatsError> {
    let mut by_name: BTreeMap<String, Option<&str>> = BTreeMap::new();
    for id in ids {
        by_name
            .entry(sanitize(id))
            .and_modify(|v| *v = None)
            .or_insert(Some(id.as_str()));
    }
    // Both forms start with the labelled form's names (after the native namespace).
    let ours = |n: &str| {
        let n = n.strip_prefix(NATIVE_NAMESPACE).unwrap_or(n);
        n.starts_with(REQUESTS_NAME) || n.starts_with(TOKENS_NAME)
    };
    let expo = Exposition::parse_bytes_with(body, ours)?;
    let mut out = Parsed::default();
    for s in &expo.samples {
        let name = s.name.strip_prefix(NATIVE_NAMESPACE).unwrap_or(&s.name);
        let (rest, is_requests): (std::borrow::Cow<'_, str>, bool) =
            if let Some(r) = name.strip_prefix(REQUESTS_PREFIX) {
                (r.into(), true)
            } else if let Some(r) = name.strip_prefix(TOKENS_PREFIX) {
                (r.into(), false)
            } else if name == REQUESTS_NAME || name == TOKENS_NAME {
                let Some(e) = s.label(ENDPOINT_LABEL) else {
                    continue;
                };
                (sanitize(e).into(), name == REQUESTS_NAME)
            } else {
                continue;
            };
        let id = match by_name.get(rest.as_ref()) {
            Some(Some(id)) => *id,
            Some(None) => {
                if !out.ambiguous.iter().any(|a| *a == rest) {
                    out.ambiguous.push(rest.into_owned());
                }
                continue;
            }
            None => continue,
        };
        let v = s.value;
        let limit = if is_requests {
            f64::from(u32::MAX)
        } else {
            // Exactly representable and far beyond any KV cache.
            9_007_199_254_740_992.0
        };
        if !v.is_finite() || v < 0.0 || v > limit {
            out.bad_values += 1;
            continue;
        }
        if v == 0.0 {
            continue;
        }
        let e = out.load.entry(id.to_owned()).or_default();
        if is_requests {
            e.requests = v as u32;
        } else {
            e.tokens = v as u64;
        }
    }
    out.load.retain(|_, l| !l.is_zero());
    Ok(out)
}

/// GET `url` within the timeout; the body, or the failure's metric reason and message.
async fn fetch(
    client: &PushClient,
    url: &http::Uri,
    timeout: std::time::Duration,
) -> Result<Bytes, (&'static str, String)> {
    let req = http::Request::get(url.clone())
        .header(http::header::ACCEPT, "text/plain")
        .body(Full::new(Bytes::new()))
        .map_err(|e| ("connect", e.to_string()))?;
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| ("connect", crate::scrape::error_chain(&e)))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| ("body", e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(("status", format!("HTTP status {}", status.as_u16())));
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(("timeout", "timed out".into())))
}

/// Read `target`'s stats every `settings.interval` into the hub until `shutdown`; forgets
/// the target's reading when it ends.
pub async fn run_gateway(
    hub: Arc<Hub>,
    client: PushClient,
    target: Target,
    settings: PeerLoadSettings,
    mut shutdown: watch::Receiver<bool>,
) {
    let Some(url) = target.stats_url.clone() else {
        return;
    };
    let mut last_warn: Option<Instant> = None;
    let mut failed = 0u64;
    let mut warn = |reason: &str, msg: &str, failed: &mut u64| {
        hub.telemetry.gateway_stats_error(&target.name, reason);
        *failed += 1;
        if last_warn.is_none_or(|t| t.elapsed() >= crate::scrape::WARN_EVERY) {
            last_warn = Some(Instant::now());
            tracing::warn!(target = %target.name, url = %url, error = msg, failures = *failed,
                "gateway stats unusable; its in-flight load is shared until it is older than push.peer_load.stale_after_ms, then dropped");
            *failed = 0;
        }
    };
    loop {
        let read_at = now_ms();
        match fetch(&client, &url, settings.timeout).await {
            Ok(body) => match parse(&body, &hub.endpoint_ids()) {
                Ok(p) => {
                    if p.bad_values > 0 {
                        warn(
                            "value",
                            &format!("{} in-flight gauges with a negative, non-finite or too large value skipped", p.bad_values),
                            &mut failed,
                        );
                    }
                    if !p.ambiguous.is_empty() {
                        warn(
                            "ambiguous",
                            &format!("endpoint ids that read the same in Prometheus names, their gauges ignored: {:?}", p.ambiguous),
                            &mut failed,
                        );
                    }
                    hub.record_gateway_report(
                        &target.name,
                        GatewayReport {
                            read_at_ms: read_at,
                            load: p.load,
                        },
                    );
                }
                Err(e) => warn("parse", &e.to_string(), &mut failed),
            },
            Err((reason, msg)) => warn(reason, &msg, &mut failed),
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.interval) => {}
            _ = shutdown.changed() => break,
        }
    }
    hub.forget_gateway(&target.name);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    /// A gateway that refuses the connection: the reason `connect` and the error chain as
    /// pushes and scrapes log it, not hyper's debug form.
    #[tokio::test]
    async fn a_refused_stats_read_reads_like_a_refused_push() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let tls = crate::tls::client_config("push.tls", &Default::default()).unwrap();
        let (_tx, rx) = tokio::sync::watch::channel(tls);
        let client = crate::push::client(std::time::Duration::from_secs(1), &rx);
        let url: http::Uri = format!("http://127.0.0.1:{port}/stats").parse().unwrap();
        let (reason, msg) = fetch(&client, &url, std::time::Duration::from_secs(2))
            .await
            .unwrap_err();
        assert_eq!(reason, "connect");
        assert!(
            msg.contains("Connection refused") && !msg.contains("hyper_util"),
            "{msg}"
        );
    }

    #[test]
    fn sanitize_matches_envoy() {
        assert_eq!(sanitize("pool/e-0.x:1"), "pool_e_0_x_1");
        assert_eq!(sanitize("a_B9"), "a_B9");
        // Each byte of a multi-byte character.
        assert_eq!(sanitize("é"), "__");
    }

    #[test]
    fn reads_gauges_skips_bad_values_and_ambiguous_ids() {
        let body = b"# TYPE kvroute_inflight_unseen_requests_pool_e0 gauge\n\
kvroute_inflight_unseen_requests_pool_e0{} 3\n\
# TYPE kvroute_inflight_unseen_tokens_pool_e0 gauge\n\
kvroute_inflight_unseen_tokens_pool_e0{} 1536\n\
kvroute_inflight_unseen_requests_pool_e1{} 0\n\
kvroute_inflight_unseen_tokens_pool_e1{} 0\n\
kvroute_inflight_unseen_requests_pool_e2{} -1\n\
kvroute_inflight_unseen_tokens_pool_e2{} NaN\n\
kvroute_inflight_unseen_requests_pool_a_b{} 1\n\
kvroute_inflight_unseen_requests_pool_gone{} 7\n\
envoy_cluster_upstream_rq{envoy_cluster_name=\"x\"} 5\n";
        let p = parse(
            body,
            &ids(&["pool/e0", "pool/e1", "pool/e2", "pool/a-b", "pool/a_b"]),
        )
        .unwrap();
        assert_eq!(
            p.load.into_iter().collect::<Vec<_>>(),
            vec![(
                "pool/e0".to_owned(),
                PeerLoad {
                    requests: 3,
                    tokens: 1536
                }
            )]
        );
        assert_eq!(p.bad_values, 2);
        assert_eq!(p.ambiguous, vec!["pool_a_b".to_owned()]);
    }

    /// The native build's labelled form reads like the Wasm filter's names: the label's
    /// value is matched after sanitising, a sample without the label is ignored.
    #[test]
    fn reads_the_labelled_gauges_of_the_native_build() {
        let body = b"# TYPE kvroute_inflight_unseen_requests gauge\n\
envoy_dynamicmodulescustom_kvroute_inflight_unseen_requests{endpoint=\"pool/e0\"} 3\n\
envoy_dynamicmodulescustom_kvroute_inflight_unseen_tokens{endpoint=\"pool/e0\"} 1536\n\
kvroute_inflight_unseen_requests{endpoint=\"sim/replica_1_\"} 2\n\
kvroute_inflight_unseen_requests{endpoint=\"pool/a-b\"} 1\n\
kvroute_inflight_unseen_requests{other=\"pool/e0\"} 9\n\
kvroute_inflight_unseen_tokens{endpoint=\"pool/e2\"} -5\n";
        let p = parse(
            body,
            &ids(&[
                "pool/e0",
                "sim/replica.1.",
                "pool/e2",
                "pool/a-b",
                "pool/a_b",
            ]),
        )
        .unwrap();
        assert_eq!(
            p.load.into_iter().collect::<Vec<_>>(),
            vec![
                (
                    "pool/e0".to_owned(),
                    PeerLoad {
                        requests: 3,
                        tokens: 1536
                    }
                ),
                (
                    "sim/replica.1.".to_owned(),
                    PeerLoad {
                        requests: 2,
                        tokens: 0
                    }
                ),
            ]
        );
        assert_eq!(p.bad_values, 1);
        assert_eq!(p.ambiguous, vec!["pool_a_b".to_owned()]);
    }

    #[test]
    fn garbage_is_an_error_and_an_empty_exposition_is_no_load() {
        assert!(matches!(
            parse(b"<html><body>404</body></html>", &ids(&["p/e"])),
            Err(StatsError::Parse(_))
        ));
        assert!(matches!(
            parse(b"{\"stats\":[]}", &ids(&["p/e"])),
            Err(StatsError::Parse(_))
        ));
        let p = parse(
            b"# TYPE envoy_server_live gauge\nenvoy_server_live{} 1\n",
            &ids(&["p/e"]),
        )
        .unwrap();
        assert!(p.load.is_empty());
        assert_eq!(p.bad_values, 0);
    }
}
