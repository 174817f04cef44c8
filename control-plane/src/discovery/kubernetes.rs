//! InferencePool discovery through the Kubernetes API (kube-rs).
//!
//! For each configured pool, one task runs two kube-runtime watchers in one namespace:
//!
//! - the InferencePool itself (`inference.networking.k8s.io/v1`, field selector
//!   `metadata.name=<pool>`), read as a dynamic object: `spec.selector.matchLabels` and
//!   `spec.targetPorts[].number` (API reference:
//!   <https://gateway-api-inference-extension.sigs.k8s.io/reference/spec/>, InferencePoolSpec);
//! - the namespace's pods. All pods are watched and the pool's selector is applied here, so a
//!   selector change needs no new watch; model-serving namespaces hold few pods.
//!
//! Every ready pod ([`super::pod::PodView`]) × target port becomes one endpoint:
//! id `<pool>/<pod>` (`<pool>/<pod>:<port>` when the pool has several ports, which the API
//! treats as distinct endpoints), address `podIP:port`, metrics at
//! `<scheme>://podIP:<metrics_port or port><metrics_path>`. Models come from the config, or
//! else from the pod's `/v1/models` ([`super::models`]), fetched again when the pod's uid, IP or
//! container restart count changes. A pod whose list cannot be read is published with no
//! models (the picker treats that as "serves any model") and a warning, so a server without
//! `/v1/models` still gets traffic.
//!
//! The watchers list, then watch from the list's `resourceVersion`; when the API server
//! answers a watch with `410 Gone` (the version was compacted away) they list again
//! (kube-runtime `watcher`). Errors are logged and retried with kube-runtime's default
//! backoff (0.8 s doubling to 30 s, reset after 120 s of success); the last published
//! endpoint set stays in place meanwhile, so an API outage never empties the fleet.

use super::pod::PodView;
use super::Merged;
use crate::adapters::ServerKind;
use crate::config::{EndpointSpec, PoolWatch};
use crate::scrape::ScrapeClient;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::GroupVersionKind;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// API group of InferencePool v1.
pub const GROUP: &str = "inference.networking.k8s.io";
/// API version of InferencePool.
pub const VERSION: &str = "v1";
/// Longest wait for a pod's `/v1/models`.
pub const MODELS_TIMEOUT: Duration = Duration::from_secs(2);

/// The InferencePool API resource (plural `inferencepools`).
pub fn inference_pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, "InferencePool"),
        "inferencepools",
    )
}

/// The parts of `InferencePool.spec` kvroute uses.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    /// Which pods belong to the pool.
    pub selector: LabelSelector,
    /// Serving ports (1..=8 in the API).
    pub target_ports: Vec<Port>,
}

/// `spec.selector`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a pod must carry.
    pub match_labels: BTreeMap<String, String>,
}

/// `spec.targetPorts[]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Port {
    /// Port number, 1..=65535.
    pub number: u16,
}

/// Most `spec.targetPorts` of an InferencePool: the API's own bound
/// (`inference.networking.k8s.io/v1`, `maxItems: 8`). Without it one pool of 20,000 ports
/// and 5 pods became 100,000 endpoints (found by a breaker, 2026-12-05).
pub const MAX_TARGET_PORTS: usize = 8;

/// Read `spec` of an InferencePool object; errors say what is wrong. Repeated ports count
/// once.
pub fn pool_spec(obj: &DynamicObject) -> Result<PoolSpec, String> {
    let spec = obj.data.get("spec").ok_or("no spec")?;
    let mut s: PoolSpec = serde_json::from_value(spec.clone()).map_err(|e| e.to_string())?;
    if s.target_ports.is_empty() || s.target_ports.iter().any(|p| p.number == 0) {
        return Err("spec.targetPorts must list ports in 1..=65535".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    s.target_ports.retain(|p| seen.insert(p.number));
    if s.target_ports.len() > MAX_TARGET_PORTS {
        return Err(format!(
            "spec.targetPorts lists {} ports; the API allows at most {MAX_TARGET_PORTS}",
            s.target_ports.len()
        ));
    }
    if s.selector.match_labels.is_empty() {
        return Err("spec.selector.matchLabels is empty".into());
    }
    Ok(s)
}

/// What identifies one pod incarnation for the models cache.
type ModelsKey = (String, String, i64);

fn models_key(p: &PodView, ip: &str) -> ModelsKey {
    (p.uid.clone(), ip.to_owned(), p.restarts)
}

/// The endpoints of `pool` given its spec, the pods, and the models known per pod.
pub fn endpoints(
    pool: &PoolWatch,
    spec: Option<&PoolSpec>,
    pods: &BTreeMap<String, PodView>,
    models: &BTreeMap<ModelsKey, Vec<String>>,
) -> Vec<EndpointSpec> {
    let Some(spec) = spec else {
        return Vec::new();
    };
    let multi = spec.target_ports.len() > 1;
    let mut out = Vec::new();
    for p in pods
        .values()
        .filter(|p| p.matches(&spec.selector.match_labels))
    {
        let Some(ip) = &p.ready_ip else { continue };
        let Some(pod_models) = (if pool.models.is_empty() {
            models.get(&models_key(p, ip)).cloned()
        } else {
            Some(pool.models.clone())
        }) else {
            // Models not read yet: published once the fetch answers (or fails).
            continue;
        };
        for port in &spec.target_ports {
            let address = PodView::address(ip, port.number);
            let metrics_host = PodView::address(ip, pool.metrics_port.unwrap_or(port.number));
            let Ok(metrics_url) =
                format!("{}://{metrics_host}{}", pool.scheme, pool.metrics_path).parse()
            else {
                continue;
            };
            let slots_url = match pool.kind {
                ServerKind::Llamacpp | ServerKind::Auto => {
                    format!("{}://{metrics_host}/slots", pool.scheme)
                        .parse()
                        .ok()
                }
                _ => None,
            };
            let id = if multi {
                format!("{}/{}:{}", pool.name, p.name, port.number)
            } else {
                format!("{}/{}", pool.name, p.name)
            };
            // Kubernetes bounds names at 253 bytes, so this holds for any real API server;
            // one endpoint with a bad id would make every filter reject every snapshot.
            if kvroute_core::snapshot::check_label(&id).is_err() {
                continue;
            }
            out.push(EndpointSpec {
                id,
                pool: pool.name.clone(),
                address,
                metrics_url,
                slots_url,
                cluster: pool.cluster.clone(),
                kind: pool.kind,
                models: pod_models.clone(),
            });
        }
    }
    out
}

/// Prefix of every slot this source owns.
pub const SLOT_PREFIX: &str = "1-k8s/";

/// Slot name of one pool in the merged endpoint set.
pub fn slot(pool: &PoolWatch) -> String {
    format!("{SLOT_PREFIX}{}/{}", pool.namespace, pool.name)
}

/// A list/watch stream kept as a map, replaced atomically at each re-list's end.
pub(crate) struct Mirror<K> {
    /// Objects by name.
    pub(crate) items: BTreeMap<String, K>,
    buffer: Option<BTreeMap<String, K>>,
}

impl<K> Mirror<K> {
    pub(crate) fn new() -> Self {
        Self {
            items: BTreeMap::new(),
            buffer: None,
        }
    }

    /// Apply one event; returns true when `items` changed (or may have).
    pub(crate) fn apply(&mut self, ev: Event<K>, name: impl Fn(&K) -> Option<String>) -> bool {
        match ev {
            Event::Init => {
                self.buffer = Some(BTreeMap::new());
                false
            }
            Event::InitApply(k) => {
                if let (Some(b), Some(n)) = (self.buffer.as_mut(), name(&k)) {
                    b.insert(n, k);
                }
                false
            }
            Event::InitDone => {
                if let Some(b) = self.buffer.take() {
                    self.items = b;
                }
                true
            }
            Event::Apply(k) => {
                if let Some(n) = name(&k) {
                    self.items.insert(n, k);
                }
                true
            }
            Event::Delete(k) => {
                if let Some(n) = name(&k) {
                    self.items.remove(&n);
                }
                true
            }
        }
    }
}

/// How long a pool's watch gathers changes before it publishes its endpoints once: pods
/// joining, leaving or turning ready reach the fleet within this (plus a scrape). Each
/// publication rebuilds the pool's whole endpoint list and the supervisor diffs it against
/// the fleet, so with 8,000 pods and 10 pod events a second, publishing per event took
/// ~70% of a core; batched, at most 4 a second.
pub const PUBLISH_COALESCE: std::time::Duration = std::time::Duration::from_millis(250);

/// Wait for `due`, or forever when it is unset.
async fn until(due: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match due {
        Some(t) => t.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Watch `pool` until `shutdown`, publishing its endpoints into slot [`slot`] of `out`.
/// Pods' `/v1/models` are read with the current scrape token from `token`.
pub async fn run_pool(
    client: kube::Client,
    pool: PoolWatch,
    http: ScrapeClient,
    token: crate::token::TokenRx,
    out: Arc<Merged<EndpointSpec>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slot = slot(&pool);
    let pools_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &pool.namespace, &inference_pool_resource());
    let pods_api: Api<Pod> = Api::namespaced(client, &pool.namespace);
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", pool.name));
    let mut pool_events = watcher::watcher(pools_api, by_name)
        .default_backoff()
        .boxed();
    let mut pod_events = watcher::watcher(pods_api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut pools: Mirror<DynamicObject> = Mirror::new();
    let mut pods: Mirror<Pod> = Mirror::new();
    let mut spec: Option<PoolSpec> = None;
    let mut views: BTreeMap<String, PodView> = BTreeMap::new();
    let mut models: BTreeMap<ModelsKey, Vec<String>> = BTreeMap::new();
    let mut fetching: BTreeSet<ModelsKey> = BTreeSet::new();
    let (models_tx, mut models_rx) = mpsc::channel::<(ModelsKey, Vec<String>)>(64);
    // Changes are published at most once per `PUBLISH_COALESCE` (the first change arms the
    // timer, later ones ride along).
    let mut due: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        let changed = tokio::select! {
            ev = pool_events.next() => match ev {
                Some(Ok(ev)) => {
                    let c = pools.apply(ev, |o| o.metadata.name.clone());
                    if c {
                        spec = match pools.items.get(&pool.name).map(pool_spec) {
                            None => None,
                            Some(Ok(s)) => Some(s),
                            Some(Err(e)) => {
                                tracing::warn!(pool = %pool.name, error = %e, "InferencePool spec unusable; pool has no endpoints until fixed");
                                None
                            }
                        };
                    }
                    c
                }
                Some(Err(e)) => {
                    tracing::warn!(pool = %pool.name, error = %e, "InferencePool watch failed; retrying");
                    false
                }
                None => return,
            },
            ev = pod_events.next() => match ev {
                Some(Ok(ev)) => {
                    // One pod changed: only its view is rebuilt (8,000 pods churning 10
                    // events/s rebuilt every view per event); a re-list rebuilds all.
                    let touched = match &ev {
                        Event::Apply(p) | Event::Delete(p) => p.metadata.name.clone(),
                        _ => None,
                    };
                    let c = pods.apply(ev, |p| p.metadata.name.clone());
                    if c {
                        match touched {
                            Some(n) => match pods.items.get(&n).and_then(PodView::of) {
                                Some(v) => { views.insert(n, v); }
                                None => { views.remove(&n); }
                            },
                            None => {
                                views = pods.items.values().filter_map(PodView::of).map(|v| (v.name.clone(), v)).collect();
                            }
                        }
                    }
                    c
                }
                Some(Err(e)) => {
                    tracing::warn!(pool = %pool.name, error = %e, "pod watch failed; retrying");
                    false
                }
                None => return,
            },
            Some((key, m)) = models_rx.recv() => {
                fetching.remove(&key);
                models.insert(key, m);
                true
            }
            () = until(&mut due) => true,
            _ = shutdown.changed() => return,
        };
        if !changed {
            continue;
        }
        match &due {
            // The timer fired: publish now.
            Some(t) if t.is_elapsed() => due = None,
            Some(_) => continue,
            None => {
                due = Some(Box::pin(tokio::time::sleep(PUBLISH_COALESCE)));
                continue;
            }
        }
        if pool.models.is_empty() {
            // Forget incarnations that are gone; fetch for new ready ones.
            let live: BTreeSet<ModelsKey> = views
                .values()
                .filter_map(|p| p.ready_ip.as_ref().map(|ip| models_key(p, ip)))
                .collect();
            models.retain(|k, _| live.contains(k));
            let port = spec
                .as_ref()
                .and_then(|s| s.target_ports.first())
                .map(|p| p.number);
            for p in views.values() {
                let (Some(ip), Some(port), Some(s)) = (&p.ready_ip, port, spec.as_ref()) else {
                    continue;
                };
                if !p.matches(&s.selector.match_labels) {
                    continue;
                }
                let key = models_key(p, ip);
                if models.contains_key(&key) || !fetching.insert(key.clone()) {
                    continue;
                }
                let base = format!("{}://{}", pool.scheme, PodView::address(ip, port));
                let (http, tx, pod) = (http.clone(), models_tx.clone(), p.name.clone());
                let bearer = token.borrow().clone();
                tokio::spawn(async move {
                    let m = match super::models::fetch(
                        &http,
                        &base,
                        bearer.as_deref(),
                        MODELS_TIMEOUT,
                    )
                    .await
                    {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(%pod, error = %e, "cannot read /v1/models; publishing the pod as serving any model");
                            Vec::new()
                        }
                    };
                    let _ = tx.send((key, m)).await;
                });
            }
        }
        out.set(&slot, endpoints(&pool, spec.as_ref(), &views, &models));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spec(ports: &[u16]) -> Result<PoolSpec, String> {
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"matchLabels": {"app": "m"}},
                "targetPorts": ports.iter().map(|n| serde_json::json!({"number": n})).collect::<Vec<_>>()
            }
        }))
        .unwrap();
        pool_spec(&obj)
    }

    /// Repeated target ports count once; more than the API's 8 make the spec unusable.
    #[test]
    fn target_ports_are_deduplicated_and_bounded() {
        let numbers = |s: PoolSpec| s.target_ports.iter().map(|p| p.number).collect::<Vec<_>>();
        assert_eq!(numbers(spec(&[8000, 8001, 8000]).unwrap()), [8000, 8001]);
        let eight: Vec<u16> = (1..=8).collect();
        assert_eq!(numbers(spec(&eight).unwrap()), eight);
        let many: Vec<u16> = (1..=20_000).collect();
        assert_eq!(
            spec(&many).unwrap_err(),
            "spec.targetPorts lists 20000 ports; the API allows at most 8"
        );
        assert_eq!(spec(&[80; 100]).map(numbers), Ok(vec![80]));
    }
}
