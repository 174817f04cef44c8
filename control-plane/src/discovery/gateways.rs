//! Gateway pods as push targets: every ready pod matching the label selector gets every
//! snapshot at `<scheme>://podIP:<port><path>`, and (with `share_load`) has its in-flight
//! load read from `<scheme>://podIP:<stats_port><stats_path>` ([`crate::peers`]).
//!
//! Why pods and not a Service: a Service load-balances each push to one pod, so with N
//! gateway replicas each would see only about 1/N of the snapshots and drift stale. Pushing to
//! each pod keeps every replica fresh; the push task of a new pod sends the current snapshot
//! at once ([`crate::push::run_target`]), well within one heartbeat, and a pod that goes
//! unready or is deleted is dropped from the targets on the next watch event.
//!
//! The watch is a kube-runtime `watcher` on pods with `labelSelector` (list, then watch;
//! re-list after `410 Gone`; default backoff on errors, keeping the last target set).

use super::kubernetes::Mirror;
use super::pod::{selector_query, PodView};
use super::Merged;
use crate::config::{GatewayWatch, Target};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use std::sync::Arc;
use tokio::sync::watch;

/// Prefix of every slot this source owns.
pub const SLOT_PREFIX: &str = "1-k8s-gw/";

/// Slot name of one gateway set in the merged target set.
pub fn slot(g: &GatewayWatch) -> String {
    format!("{SLOT_PREFIX}{}", g.name)
}

/// Targets for the ready pods among `pods` (sorted by pod name).
pub fn targets<'a>(g: &GatewayWatch, pods: impl Iterator<Item = &'a Pod>) -> Vec<Target> {
    pods.filter_map(PodView::of)
        .filter(|p| p.matches(&g.selector))
        .filter_map(|p| {
            let ip = p.ready_ip.as_ref()?;
            let url = format!("{}://{}{}", g.scheme, PodView::address(ip, g.port), g.path)
                .parse()
                .ok()?;
            let stats_url = match &g.stats {
                Some((port, path)) => Some(
                    format!("{}://{}{path}", g.scheme, PodView::address(ip, *port))
                        .parse()
                        .ok()?,
                ),
                None => None,
            };
            Some(Target {
                name: format!("{}/{}", g.name, p.name),
                url,
                stats_url,
            })
        })
        .collect()
}

/// Watch the gateway pods until `shutdown`, publishing targets into slot [`slot`] of `out`.
pub async fn run(
    client: kube::Client,
    g: GatewayWatch,
    out: Arc<Merged<Target>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slot = slot(&g);
    let api: Api<Pod> = Api::namespaced(client, &g.namespace);
    let cfg = watcher::Config::default().labels(&selector_query(&g.selector));
    let mut events = watcher::watcher(api, cfg).default_backoff().boxed();
    let mut pods: Mirror<Pod> = Mirror::new();
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(ev)) => {
                    if pods.apply(ev, |p| p.metadata.name.clone()) {
                        out.set(&slot, targets(&g, pods.items.values()));
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(gateways = %g.name, error = %e, "gateway pod watch failed; retrying");
                }
                None => return,
            },
            _ = shutdown.changed() => return,
        }
    }
}
