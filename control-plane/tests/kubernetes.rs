//! Kubernetes discovery against a fake API server (`common::fake_kube`) serving the
//! fixtures in `tests/fixtures/k8s/` (provenance in its README): InferencePool pods joining,
//! leaving, restarting and coming back after a `410 Gone` re-list; a pool without a ready pod
//! naming its models as unavailable; every gateway pod as a push
//! target; the ingest token file reloaded on a Kubernetes-style symlink swap.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use bytes::Bytes;
use common::fake_kube::{pods_path, pools_path, FakeKube};
use common::{vllm_body, wait_for, FakeIngest, Server};
use kvroute_core::snapshot::Snapshot;
use kvroute_cp::adapters::ServerKind;
use kvroute_cp::config::EndpointSpec;
use kvroute_cp::{Config, ControlPlane};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const POOL: &str = "vllm-llama3-8b-instruct";
const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";
const WAIT: Duration = Duration::from_secs(10);

fn fixture(name: &str) -> Value {
    let p = format!("{}/tests/fixtures/k8s/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The vLLM pod fixture as pod `name` at `ip`, ready or not, with `restarts`.
fn vllm_pod(name: &str, ip: &str, ready: bool, restarts: u32) -> Value {
    let mut p = fixture("pod-vllm.json");
    p["metadata"]["name"] = json!(name);
    p["metadata"]["uid"] = json!(format!("uid-{name}"));
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{ "ip": ip }]);
    p["status"]["conditions"][2]["status"] = json!(if ready { "True" } else { "False" });
    p["status"]["containerStatuses"][0]["restartCount"] = json!(restarts);
    p
}

fn gateway_pod(name: &str, ip: &str) -> Value {
    let mut p = fixture("pod-gateway.json");
    p["metadata"]["name"] = json!(name);
    p["metadata"]["uid"] = json!(format!("uid-{name}"));
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{ "ip": ip }]);
    p
}

/// A fake model server: `/v1/models` lists `models`, `/metrics` answers vLLM with `kv`.
struct ModelServer {
    _server: Server,
    models: Arc<Mutex<Vec<String>>>,
}

async fn model_server(addr: SocketAddr, models: &[&str], kv: f64) -> ModelServer {
    model_server_with_key(addr, models, kv, None).await
}

/// [`model_server`] that, with `key`, answers 401 to any request without
/// `Authorization: Bearer <key>`, as llama-server `--api-key` does.
async fn model_server_with_key(
    addr: SocketAddr,
    models: &[&str],
    kv: f64,
    key: Option<&'static str>,
) -> ModelServer {
    let list = Arc::new(Mutex::new(
        models.iter().map(|m| m.to_string()).collect::<Vec<_>>(),
    ));
    let l = list.clone();
    let handler: common::Handler = Arc::new(move |_m, path, _b, auth| {
        if key.is_some_and(|k| auth.as_deref() != Some(format!("Bearer {k}").as_str())) {
            return (401, Bytes::new());
        }
        match path.as_str() {
            "/v1/models" => {
                let data: Vec<Value> = l
                .lock()
                .unwrap()
                .iter()
                .map(|id| json!({"id": id, "object": "model", "owned_by": "vllm", "parent": null}))
                .collect();
                (
                    200,
                    Bytes::from(json!({"object": "list", "data": data}).to_string()),
                )
            }
            "/metrics" => (200, Bytes::from(vllm_body(kv, 1, 0, None, 10.0))),
            _ => (404, Bytes::new()),
        }
    });
    let server = Server::start_on(
        addr,
        handler,
        Arc::new(Mutex::new(false)),
        Arc::new(Mutex::new(Duration::ZERO)),
    )
    .await;
    ModelServer {
        _server: server,
        models: list,
    }
}

/// A port free on each of `ips` (all loopback addresses).
fn common_port(ips: &[&str]) -> u16 {
    for _ in 0..50 {
        let first = std::net::TcpListener::bind(format!("{}:0", ips[0])).unwrap();
        let port = first.local_addr().unwrap().port();
        if ips[1..]
            .iter()
            .all(|ip| std::net::TcpListener::bind(format!("{ip}:{port}")).is_ok())
        {
            return port;
        }
    }
    panic!("no port free on all of {ips:?}");
}

fn endpoint(pod: &str, ip: &str, port: u16, models: &[&str]) -> EndpointSpec {
    EndpointSpec {
        id: format!("{POOL}/{pod}"),
        pool: POOL.into(),
        address: format!("{ip}:{port}"),
        metrics_url: format!("http://{ip}:{port}/metrics").parse().unwrap(),
        slots_url: None,
        cluster: "llama_8b".into(),
        kind: ServerKind::Vllm,
        models: models.iter().map(|m| m.to_string()).collect(),
    }
}

async fn wait_endpoints(cp: &ControlPlane, want: &[EndpointSpec], what: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let have = cp.endpoints();
        if have.as_slice() == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: have {have:#?}, want {want:#?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A fake API server with empty InferencePool and Pod collections in `default`, and their
/// paths.
async fn fake_api_with_pool_and_pods() -> (FakeKube, String, String) {
    let api = FakeKube::start().await;
    let (pools, pods) = (pools_path("default"), pods_path("default"));
    api.collection(
        &pools,
        "InferencePoolList",
        "inference.networking.k8s.io/v1",
    );
    api.collection(&pods, "PodList", "v1");
    (api, pools, pods)
}

fn snapshot(cp: &ControlPlane) -> Option<Snapshot> {
    let p = cp.hub().subscribe().borrow().clone()?;
    Some(Snapshot::decode(&p.body).unwrap())
}

/// An API server (or a proxy before it) that ends every watch as soon as it starts:
/// kube-runtime starts the next one at once after a clean end, ~10,000 a second against
/// such a server; kvroute-cp's client starts a watch of one path at most once a second
/// (`discovery::api_guard`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_that_end_at_once_are_restarted_at_most_once_a_second() {
    let (api, pools, _pods) = fake_api_with_pool_and_pods().await;
    api.close_watches();
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 50\n  timeout_ms: 200\n\
         kubernetes:\n  api_server: {}\n  inference_pools:\n    - namespace: default\n      name: {POOL}\n      kind: vllm\n",
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "the first watch", || api.watches(&pools) >= 1).await;
    let first = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let watches = api.watches(&pools);
    let elapsed = first.elapsed().as_secs_f64();
    // One at the start, then at most one per second.
    assert!(
        watches as f64 <= 2.0 + elapsed,
        "{watches} watches in {elapsed:.1} s"
    );
    assert!(watches >= 2, "watches go on: {watches}");
    cp.shutdown().await;
}

/// Pools in one namespace watch the same paths with their own selectors: against a healthy
/// API server none holds another back (a guard keyed by path alone started the n-th pool's
/// watch n - 1 seconds late, with a false warning: the third at 2 s or later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_in_one_namespace_start_their_watches_together() {
    let (api, pools, _pods) = fake_api_with_pool_and_pods().await;
    let yaml = format!(
        "listen: 127.0.0.1:0\nkubernetes:\n  api_server: {}\n  inference_pools:\n{}",
        api.url(),
        (0..3)
            .map(|i| format!("    - {{namespace: default, name: pool-{i}, kind: vllm}}\n"))
            .collect::<String>()
    );
    let started = std::time::Instant::now();
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "three pool watches", || api.watches(&pools) >= 3).await;
    assert!(
        started.elapsed() < Duration::from_millis(1_900),
        "three watches took {:?}",
        started.elapsed()
    );
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_pool_pods_join_leave_restart_and_relist_after_410() {
    let (api, pools, pods) = fake_api_with_pool_and_pods().await;
    let port = common_port(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]);
    let a = model_server(format!("127.0.0.2:{port}").parse().unwrap(), &[LLAMA], 0.25).await;
    let _b = model_server(format!("127.0.0.3:{port}").parse().unwrap(), &[LLAMA], 0.5).await;
    // 127.0.0.4 has no server: its /v1/models fails.
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["targetPorts"] = json!([{ "number": port }]);
    api.apply(&pools, pool.clone());
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", true, 0));
    api.apply(&pods, vllm_pod("pod-b", "127.0.0.3", true, 0));
    api.apply(&pods, vllm_pod("pod-c", "127.0.0.9", false, 0));
    let mut other = vllm_pod("other-app", "127.0.0.8", true, 0);
    other["metadata"]["labels"]["app"] = json!("something-else");
    api.apply(&pods, other);

    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 200\npush:\n  heartbeat_ms: 100\n\
         kubernetes:\n  api_server: {}\n  inference_pools:\n    - namespace: default\n      name: {POOL}\n      kind: vllm\n      cluster: llama_8b\n",
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();

    // Initial list: the two ready pods of the pool, models read from /v1/models.
    let ep_a = endpoint("pod-a", "127.0.0.2", port, &[LLAMA]);
    let ep_b = endpoint("pod-b", "127.0.0.3", port, &[LLAMA]);
    wait_endpoints(&cp, &[ep_a.clone(), ep_b.clone()], "initial list").await;
    // Scraped into the snapshot.
    wait_for(WAIT, "both pods scraped", || {
        snapshot(&cp).is_some_and(|s| {
            let kv: Vec<_> = s
                .endpoints
                .iter()
                .map(|e| (e.id.clone(), e.kv_usage))
                .collect();
            kv == vec![(ep_a.id.clone(), Some(0.25)), (ep_b.id.clone(), Some(0.5))]
        })
    })
    .await;

    // ADDED: a pod whose /v1/models cannot be read is published serving any model.
    api.apply(&pods, vllm_pod("pod-d", "127.0.0.4", true, 0));
    let ep_d = endpoint("pod-d", "127.0.0.4", port, &[]);
    wait_endpoints(
        &cp,
        &[ep_a.clone(), ep_b.clone(), ep_d.clone()],
        "pod-d added",
    )
    .await;

    // MODIFIED: pod-b turns unready and leaves (pod-c, never ready, never joined).
    api.apply(&pods, vllm_pod("pod-b", "127.0.0.3", false, 0));
    wait_endpoints(&cp, &[ep_a.clone(), ep_d.clone()], "pod-b unready").await;

    // Restart: pod-a's container restarts and comes back serving another model list.
    a.models
        .lock()
        .unwrap()
        .push("meta-llama/Llama-3.2-1B-Instruct".into());
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", true, 1));
    let ep_a2 = endpoint(
        "pod-a",
        "127.0.0.2",
        port,
        &[LLAMA, "meta-llama/Llama-3.2-1B-Instruct"],
    );
    wait_endpoints(&cp, &[ep_a2.clone(), ep_d.clone()], "pod-a restarted").await;

    // DELETED.
    api.delete(&pods, "pod-d");
    wait_endpoints(&cp, std::slice::from_ref(&ep_a2), "pod-d deleted").await;

    // 410 Gone: changes the watch never delivered are picked up by the re-list.
    let lists_before = api.lists(&pods);
    api.delete_unseen(&pods, "pod-a");
    api.apply_unseen(&pods, vllm_pod("pod-b", "127.0.0.3", true, 0));
    api.compact();
    wait_endpoints(&cp, std::slice::from_ref(&ep_b), "re-list after 410 Gone").await;
    assert!(
        api.lists(&pods) > lists_before,
        "the pod collection was listed again after 410"
    );

    // The watch resumes after the re-list: ordinary events flow again.
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", true, 0));
    wait_endpoints(
        &cp,
        &[ep_a2.clone(), ep_b.clone()],
        "pod-a back after re-list",
    )
    .await;

    // The pool's selector changes: only pods matching the new one remain.
    pool["spec"]["selector"]["matchLabels"] = json!({"app": "something-else"});
    api.apply(&pools, pool);
    let ep_other = endpoint("other-app", "127.0.0.8", port, &[]);
    wait_endpoints(&cp, &[ep_other], "selector changed").await;

    // The pool is deleted: no endpoints.
    api.delete(&pools, POOL);
    wait_endpoints(&cp, &[], "pool deleted").await;
    cp.shutdown().await;
}

/// An InferencePool with no ready pod (scale from zero, a rollout, a crash loop) still names
/// its configured models, in the snapshot's `unavailable_models`, with no endpoint: the
/// filter answers requests for them 503 `no_healthy_endpoint` (retried by clients), not 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_pool_without_ready_pod_names_its_models_unavailable() {
    let (api, pools, pods) = fake_api_with_pool_and_pods().await;
    let port = common_port(&["127.0.0.2"]);
    let _a = model_server(format!("127.0.0.2:{port}").parse().unwrap(), &[LLAMA], 0.25).await;
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["targetPorts"] = json!([{ "number": port }]);
    api.apply(&pools, pool);
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", false, 0));
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 200\npush:\n  heartbeat_ms: 100\n\
         kubernetes:\n  api_server: {}\n  inference_pools:\n    - namespace: default\n      name: {POOL}\n      kind: vllm\n      cluster: llama_8b\n      models: [{LLAMA}]\n",
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let body = |cp: &ControlPlane| -> String {
        String::from_utf8(cp.hub().latest().unwrap().body.to_vec()).unwrap()
    };

    // No ready pod: no endpoint, the pool's model named.
    wait_for(WAIT, "snapshot naming the idle pool's model", || {
        snapshot(&cp).is_some_and(|s| s.endpoints.is_empty() && s.unavailable_models == [LLAMA])
    })
    .await;
    let p = cp.hub().latest().unwrap();
    assert_eq!(
        String::from_utf8(p.body.to_vec()).unwrap(),
        format!(
            r#"{{"format":1,"version":{},"generated_at_ms":{},"unavailable_models":["{LLAMA}"],"endpoints":[]}}"#,
            p.version, p.generated_at_ms
        )
    );

    // The pod turns ready: an endpoint lists the model, the field is left off.
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", true, 0));
    wait_for(WAIT, "pod-a scraped, nothing unavailable", || {
        snapshot(&cp).is_some_and(|s| {
            let eps: Vec<_> = s
                .endpoints
                .iter()
                .map(|e| (e.id.clone(), e.models.clone(), e.healthy))
                .collect();
            s.unavailable_models.is_empty()
                && eps == [(format!("{POOL}/pod-a"), vec![LLAMA.to_string()], true)]
        })
    })
    .await;
    assert!(!body(&cp).contains("unavailable_models"), "{}", body(&cp));

    // Crash loop: the pod restarts and is not ready; the model is named again.
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", false, 1));
    wait_for(WAIT, "pod-a unready, model unavailable", || {
        snapshot(&cp).is_some_and(|s| s.endpoints.is_empty() && s.unavailable_models == [LLAMA])
    })
    .await;
    cp.shutdown().await;
}

/// A pool whose servers want an API key (llama-server `--api-key`) and whose models come
/// from the pods' `/v1/models`: discovery sends the pool's scrape token too, so the pod is
/// published with the model it lists (not as serving any model) and scraped healthy. The
/// key is the pool's own (`scrape_token_file`), which wins over `scrape.token_file` (another
/// server's key, which this pod refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_reads_models_with_the_scrape_token() {
    let (api, pools, pods) = fake_api_with_pool_and_pods().await;
    let port = common_port(&["127.0.0.2"]);
    let _a = model_server_with_key(
        format!("127.0.0.2:{port}").parse().unwrap(),
        &[LLAMA],
        0.25,
        Some("pod-key"),
    )
    .await;
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["targetPorts"] = json!([{ "number": port }]);
    api.apply(&pools, pool);
    api.apply(&pods, vllm_pod("pod-a", "127.0.0.2", true, 0));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("api-key");
    std::fs::write(&key, "pod-key\n").unwrap();
    let other = dir.path().join("other-key");
    std::fs::write(&other, "another-servers-key\n").unwrap();
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 20\n  timeout_ms: 200\n  token_file: {}\npush:\n  heartbeat_ms: 100\n\
         kubernetes:\n  api_server: {}\n  inference_pools:\n    - namespace: default\n      name: {POOL}\n      kind: vllm\n      cluster: llama_8b\n      scrape_token_file: {}\n",
        other.display(),
        api.url(),
        key.display()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    wait_endpoints(
        &cp,
        &[endpoint("pod-a", "127.0.0.2", port, &[LLAMA])],
        "pod-a with the model its /v1/models lists",
    )
    .await;
    wait_for(WAIT, "pod-a scraped healthy", || {
        snapshot(&cp).is_some_and(|s| {
            s.endpoints
                .iter()
                .map(|e| (e.id.clone(), e.healthy, e.kv_usage))
                .eq([(format!("{POOL}/pod-a"), true, Some(0.25))])
        })
    })
    .await;
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gateway_pod_gets_snapshots_and_removed_pods_are_dropped() {
    let api = FakeKube::start().await;
    let gw_pods = pods_path("istio-system");
    api.collection(&gw_pods, "PodList", "v1");
    let port = common_port(&["127.0.0.1", "127.0.0.5"]);
    let ingest1 = FakeIngest::start_on(format!("127.0.0.1:{port}").parse().unwrap()).await;
    let ingest2 = FakeIngest::start_on(format!("127.0.0.5:{port}").parse().unwrap()).await;
    let model =
        common::FakeModelServer::start(common::Behavior::Body(vllm_body(0.4, 2, 0, None, 10.0)))
            .await;
    api.apply(&gw_pods, gateway_pod("gw-1", "127.0.0.1"));
    let mut not_gateway = gateway_pod("not-a-gateway", "127.0.0.6");
    not_gateway["metadata"]["labels"] = json!({"app": "other"});
    api.apply(&gw_pods, not_gateway);

    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, "ingest-token-0123456789\n").unwrap();
    let heartbeat = Duration::from_millis(1000);
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 50\n  timeout_ms: 200\n\
         push:\n  heartbeat_ms: {}\n  token_file: {}\n\
         pools:\n  - name: p\n    kind: vllm\n    models: [m]\n    endpoints:\n      - name: e0\n        address: {}\n\
         kubernetes:\n  api_server: {}\n  gateways:\n    - name: gw\n      namespace: istio-system\n      selector: {{istio: ingressgateway}}\n      port: {port}\n",
        heartbeat.as_millis(),
        token_file.display(),
        model.addr(),
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    wait_for(WAIT, "gateway 1 receives a snapshot", || {
        ingest1.count() > 0
    })
    .await;
    let names: Vec<String> = cp.targets().iter().map(|t| t.name.clone()).collect();
    assert_eq!(names, vec!["gw/gw-1".to_string()]);
    assert_eq!(
        cp.targets()[0].url.to_string(),
        format!("http://127.0.0.1:{port}/kvroute/v1/snapshot")
    );
    // Each pod's in-flight load is read from Istio's Envoy stats port by default.
    assert_eq!(
        cp.targets()[0].stats_url.as_ref().map(ToString::to_string),
        Some("http://127.0.0.1:15090/stats/prometheus?filter=inflight_unseen".to_string())
    );
    assert_eq!(
        ingest1.last().unwrap().auth.as_deref(),
        Some("Bearer ingest-token-0123456789")
    );
    assert_eq!(ingest2.count(), 0);

    // A new gateway pod: a snapshot within one heartbeat of the ADDED event.
    let added = Instant::now();
    api.apply(&gw_pods, gateway_pod("gw-2", "127.0.0.5"));
    wait_for(
        heartbeat,
        "gateway 2 receives a snapshot within one heartbeat",
        || ingest2.count() > 0,
    )
    .await;
    let first = ingest2.received.lock().unwrap()[0].clone();
    assert!(first.at.duration_since(added) < heartbeat);
    // It is the current fleet, with the scraped stats.
    wait_for(WAIT, "gateway 2 has the scraped endpoint", || {
        ingest2.last().is_some_and(|r| {
            r.snapshot.endpoints.len() == 1 && r.snapshot.endpoints[0].kv_usage == Some(0.4)
        })
    })
    .await;

    // The token file is replaced the way kubelet updates a Secret volume (new directory,
    // `..data` symlink swap): pushes use the new token with no SIGHUP.
    rotate_token(token_dir.path(), "rotated-token-abcdefghij");
    wait_for(WAIT, "both gateways get the rotated token", || {
        [&ingest1, &ingest2].iter().all(|i| {
            i.last().and_then(|r| r.auth) == Some("Bearer rotated-token-abcdefghij".into())
        })
    })
    .await;

    // gw-1 is deleted: dropped from the targets, no more pushes to it.
    api.delete(&gw_pods, "gw-1");
    wait_for(WAIT, "gw-1 dropped", || {
        cp.targets()
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            == ["gw/gw-2"]
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (c1, c2) = (ingest1.count(), ingest2.count());
    tokio::time::sleep(heartbeat * 2 + Duration::from_millis(200)).await;
    assert_eq!(ingest1.count(), c1, "no push to a deleted gateway pod");
    assert!(ingest2.count() >= c2 + 2, "heartbeats continue to gw-2");
    // An unready gateway pod is dropped too.
    let mut unready = gateway_pod("gw-2", "127.0.0.5");
    unready["status"]["conditions"][1]["status"] = json!("False");
    api.apply(&gw_pods, unready);
    wait_for(WAIT, "gw-2 dropped when unready", || {
        cp.targets().is_empty()
    })
    .await;
    cp.shutdown().await;
}

/// Replace `dir/token` as kubelet's atomic writer does ([`common::kubelet_write`]).
fn rotate_token(dir: &std::path::Path, token: &str) {
    common::kubelet_write(dir, 1, &[("token", format!("{token}\n").as_bytes())]);
}

/// A burst of pod events is published as one change, not one per event
/// (`discovery::kubernetes::PUBLISH_COALESCE`): 40 pods applied at once reach the fleet
/// together, and no size in between is ever seen.
#[tokio::test]
async fn a_burst_of_pod_events_is_published_once() {
    let (api, pools, pods) = fake_api_with_pool_and_pods().await;
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["targetPorts"] = json!([{ "number": 8000 }]);
    api.apply(&pools, pool);
    let yaml = format!(
        "listen: 127.0.0.1:0\nscrape:\n  interval_ms: 1000\n  timeout_ms: 200\npush:\n  heartbeat_ms: 100\n\
         kubernetes:\n  api_server: {}\n  inference_pools:\n    - namespace: default\n      name: {POOL}\n      kind: vllm\n      cluster: llama_8b\n      models: [{LLAMA}]\n",
        api.url()
    );
    let cp = ControlPlane::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    // Let the initial (empty) list settle.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(cp.endpoints().is_empty());
    for i in 0..40u8 {
        api.apply(
            &pods,
            vllm_pod(&format!("pod-{i}"), &format!("127.0.1.{i}"), true, 0),
        );
    }
    let deadline = Instant::now() + WAIT;
    let mut seen = std::collections::BTreeSet::new();
    loop {
        let n = cp.endpoints().len();
        seen.insert(n);
        if n == 40 {
            break;
        }
        assert!(Instant::now() < deadline, "timed out: sizes seen {seen:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(seen, [0, 40].into_iter().collect(), "sizes seen");
    cp.shutdown().await;
}
