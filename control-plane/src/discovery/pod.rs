//! What the control plane reads from a `v1.Pod`: readiness, IP, labels, restarts.
//!
//! A pod serves traffic when it has an IP, is not being deleted (`metadata.deletionTimestamp`
//! unset) and its `Ready` condition is `True`: the same rule the EndpointSlice controller
//! uses for `ready` endpoints
//! (<https://kubernetes.io/docs/concepts/services-networking/endpoint-slices/#conditions>).
//! The IP is read as an IP address and written back in its canonical form; a `podIP` that is
//! not one (`10.0.0.1/x`: no real API server holds it) leaves the pod out. Its endpoints
//! would have made the filter reject every snapshot (core's `check_address`), and a gateway
//! pod with it a push URL of another host (found by a breaker, 2026-12-05).
//! Fields as in the Pod API reference
//! (<https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/>).

use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;

/// The parts of a pod discovery uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid` (changes when a StatefulSet pod is recreated under the same name).
    pub uid: String,
    /// `status.podIP` when ready and an IP address (canonical form), else `None`.
    pub ready_ip: Option<String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// Sum of `status.containerStatuses[].restartCount`: a container restart keeps the IP
    /// but may change the models served.
    pub restarts: i64,
}

impl PodView {
    /// Read a pod; `None` when it has no name.
    pub fn of(pod: &Pod) -> Option<Self> {
        let name = pod.metadata.name.clone()?;
        let status = pod.status.as_ref();
        let ready = pod.metadata.deletion_timestamp.is_none()
            && status
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let ip = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
            .map(|ip| ip.to_string());
        let restarts = status
            .and_then(|s| s.container_statuses.as_ref())
            .map(|cs| cs.iter().map(|c| i64::from(c.restart_count)).sum())
            .unwrap_or(0);
        Some(Self {
            name,
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            ready_ip: if ready { ip } else { None },
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            restarts,
        })
    }

    /// Whether every `selector` label is on the pod (`matchLabels` semantics; an empty
    /// selector matches nothing here, never every pod).
    pub fn matches(&self, selector: &BTreeMap<String, String>) -> bool {
        !selector.is_empty()
            && selector
                .iter()
                .all(|(k, v)| self.labels.get(k).is_some_and(|have| have == v))
    }

    /// `ip:port`, IPv6 in brackets.
    pub fn address(ip: &str, port: u16) -> String {
        if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        }
    }
}

/// A label selector as the API's `labelSelector` query parameter (`k=v,k2=v2`).
pub fn selector_query(selector: &BTreeMap<String, String>) -> String {
    selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pod(json: serde_json::Value) -> PodView {
        PodView::of(&serde_json::from_value(json).unwrap()).unwrap()
    }

    /// A `podIP` that is not an IP address leaves the pod without one (never ready); an
    /// IPv6 one is written canonically.
    #[test]
    fn a_pod_ip_must_be_an_ip_address() {
        let with_ip = |ip: &str| {
            pod(serde_json::json!({
                "metadata": {"name": "p"},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
            }))
            .ready_ip
        };
        assert_eq!(with_ip("10.0.0.7").as_deref(), Some("10.0.0.7"));
        assert_eq!(with_ip("fd00:0:0:0:0:0:0:1").as_deref(), Some("fd00::1"));
        for bad in [
            "127.0.0.1/x",
            "",
            "pod.example",
            "10.0.0.7:80",
            &"1".repeat(2000),
        ] {
            assert_eq!(with_ip(bad), None, "{bad}");
        }
    }

    #[test]
    fn ready_needs_condition_ip_and_no_deletion() {
        let base = serde_json::json!({
            "metadata": {"name": "p", "uid": "u1", "labels": {"app": "x", "tier": "a"}},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 2}]}
        });
        let p = pod(base.clone());
        assert_eq!(p.ready_ip.as_deref(), Some("10.0.0.7"));
        assert_eq!(p.restarts, 2);
        let mut not_ready = base.clone();
        not_ready["status"]["conditions"][0]["status"] = "False".into();
        assert_eq!(pod(not_ready).ready_ip, None);
        let mut deleting = base.clone();
        deleting["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z".into();
        assert_eq!(pod(deleting).ready_ip, None);
        let mut no_ip = base;
        no_ip["status"]["podIP"] = "".into();
        assert_eq!(pod(no_ip).ready_ip, None);
    }

    #[test]
    fn selector_matching() {
        let p = pod(
            serde_json::json!({"metadata": {"name": "p", "labels": {"app": "x", "tier": "a"}}}),
        );
        let sel = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(p.matches(&sel(&[("app", "x")])));
        assert!(p.matches(&sel(&[("app", "x"), ("tier", "a")])));
        assert!(!p.matches(&sel(&[("app", "y")])));
        assert!(!p.matches(&sel(&[("app", "x"), ("zone", "b")])));
        assert!(!p.matches(&sel(&[])));
        assert_eq!(selector_query(&sel(&[("b", "2"), ("a", "1")])), "a=1,b=2");
        assert_eq!(PodView::address("fd00::1", 8000), "[fd00::1]:8000");
        assert_eq!(PodView::address("10.0.0.1", 8000), "10.0.0.1:8000");
    }
}
